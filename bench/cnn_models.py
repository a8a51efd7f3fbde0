"""ResNet-style and MobileNet-style CNNs (224 x 224, batch 1) on polyhal against onnxruntime's CPU
provider, with a per-op profile of polyhal's plan.

The models are built here with ``onnx.helper`` from the architectures' own blocks, weights drawn
from a seed: a ResNet-18 (7x7 stem conv + BatchNormalization + Relu, 3x3 max pool, basic blocks
of two 3x3 convs with a residual Add, 1x1 stride-2 projections, global average pool, Gemm) and a
MobileNetV3-style network (3x3 stem with HardSwish, inverted residual blocks: 1x1 expansion,
3x3/5x5 depthwise, 1x1 projection, Relu or HardSwish, residual Add where shapes allow, global
average pool, Gemm). Both sides run the same model file with the same inputs in one process,
timed in alternating blocks; outputs are compared first. polyhal runs its default plan (depthwise
chains channel-blocked, :mod:`polyhal.passes.data_tiling`) and, in the same blocks, the plan
compiled with ``data_tiling=False`` (every conv in NCHW), so the layout's payoff is measured in
the same run. The per-op table (polyhal's steps timed one by one, grouped by op) is printed and
kept in the results' ``extra``.
"""

from __future__ import annotations

import collections
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness import Row, median_time

#: Target ratio polyhal / onnxruntime (the real-model issue's).
TARGET = 1.5


# ------------------------------------------------------------------------------------ models

class _Net:
    """A graph under construction: nodes, initializers, fresh names, seeded weights."""

    def __init__(self, seed: int) -> None:
        self.nodes, self.inits, self.rng, self.n = [], [], np.random.default_rng(seed), 0

    def name(self, base: str) -> str:
        self.n += 1
        return f"{base}{self.n}"

    def const(self, base: str, arr: np.ndarray) -> str:
        from onnx import numpy_helper

        name = self.name(base)
        self.inits.append(numpy_helper.from_array(np.asarray(arr, np.float32), name))
        return name

    def node(self, op: str, inputs: list[str], **attrs) -> str:
        from onnx import helper

        out = self.name(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def conv_bn(self, x: str, cin: int, cout: int, k: int, stride: int = 1, group: int = 1,
                act: str | None = None) -> str:
        fan_in = cin // group * k * k
        w = self.const("w", self.rng.standard_normal((cout, cin // group, k, k)) * np.sqrt(2.0 / fan_in))
        y = self.node("Conv", [x, w], kernel_shape=[k, k], strides=[stride, stride], pads=[k // 2] * 4, group=group)
        scale = self.const("bn_scale", 1.0 + 0.1 * self.rng.standard_normal(cout))
        bias = self.const("bn_bias", 0.1 * self.rng.standard_normal(cout))
        mean = self.const("bn_mean", 0.1 * self.rng.standard_normal(cout))
        var = self.const("bn_var", 1.0 + 0.1 * self.rng.random(cout))
        y = self.node("BatchNormalization", [y, scale, bias, mean, var], epsilon=1e-5)
        return self.node(act, [y]) if act else y

    def head(self, x: str, c: int, classes: int = 1000) -> str:
        y = self.node("Flatten", [self.node("GlobalAveragePool", [x])])
        w = self.const("fc_w", self.rng.standard_normal((classes, c)) / np.sqrt(c))
        b = self.const("fc_b", 0.01 * self.rng.standard_normal(classes))
        return self.node("Gemm", [y, w, b], transB=1)

    def model(self, name: str, x: str, y: str, shape: tuple[int, ...], classes: int = 1000):
        from onnx import TensorProto, helper

        graph = helper.make_graph(self.nodes, name, [helper.make_tensor_value_info(x, TensorProto.FLOAT, shape)],
                                  [helper.make_tensor_value_info(y, TensorProto.FLOAT, (shape[0], classes))],
                                  self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def resnet18(batch: int = 1, size: int = 224):
    """ResNet-18: stem, four stages of two basic blocks (64, 128, 256, 512 channels), head."""
    net = _Net(18)
    y = net.conv_bn("input", 3, 64, 7, 2, act="Relu")
    y = net.node("MaxPool", [y], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    c = 64
    for stage, width in enumerate((64, 128, 256, 512)):
        for block in range(2):
            stride = 2 if stage and not block else 1
            h = net.conv_bn(y, c, width, 3, stride, act="Relu")
            h = net.conv_bn(h, width, width, 3)
            short = net.conv_bn(y, c, width, 1, stride) if stride != 1 or c != width else y
            y = net.node("Relu", [net.node("Add", [h, short])])
            c = width
    return net.model("resnet18", "input", net.head(y, c), (batch, 3, size, size))


#: MobileNetV3-large's blocks: (kernel, expanded, out, activation, stride).
_MBV3 = [(3, 16, 16, "Relu", 1), (3, 64, 24, "Relu", 2), (3, 72, 24, "Relu", 1), (5, 72, 40, "Relu", 2),
         (5, 120, 40, "Relu", 1), (5, 120, 40, "Relu", 1), (3, 240, 80, "HardSwish", 2),
         (3, 200, 80, "HardSwish", 1), (3, 184, 80, "HardSwish", 1), (3, 184, 80, "HardSwish", 1),
         (3, 480, 112, "HardSwish", 1), (3, 672, 112, "HardSwish", 1), (5, 672, 160, "HardSwish", 2),
         (5, 960, 160, "HardSwish", 1), (5, 960, 160, "HardSwish", 1)]


def mobilenet(batch: int = 1, size: int = 224):
    """MobileNetV3-large's convolutions (no squeeze-excite): 3x3 stem with HardSwish, 15 inverted
    residual blocks, a 1x1 conv to 960 channels, head."""
    net = _Net(3)
    y = net.conv_bn("input", 3, 16, 3, 2, act="HardSwish")
    c = 16
    for k, exp, out, act, stride in _MBV3:
        h = net.conv_bn(y, c, exp, 1, act=act) if exp != c else y
        h = net.conv_bn(h, exp, exp, k, stride, group=exp, act=act)
        h = net.conv_bn(h, exp, out, 1)
        y = net.node("Add", [h, y]) if stride == 1 and c == out else h
        c = out
    y = net.conv_bn(y, c, 960, 1, act="HardSwish")
    return net.model("mobilenet", "input", net.head(y, 960), (batch, 3, size, size))


MODELS = {"resnet18": resnet18, "mobilenet_v3": mobilenet}


# ------------------------------------------------------------------------------------ profile

def profile(plan, x: np.ndarray, runs: int = 5) -> list[tuple[str, int, float]]:
    """polyhal's plan step by step (:meth:`polyhal.plan.Plan.profile`): (op, steps, ms per run)
    per op, largest first."""
    by_op = plan.profile(x, runs=runs).by_op()
    return [(g["op"], g["steps"], g["total_ms"] / runs) for g in by_op]


def ort_profile(path: str, feeds: dict, runs: int = 5) -> list[tuple[str, int, float]]:
    """onnxruntime's own per-op profile of the same model: (op type, calls per run, ms per run)."""
    import json

    import onnxruntime as ort

    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "ort")
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    session.run(None, feeds)
    for _ in range(runs):
        session.run(None, feeds)
    events = json.load(open(session.end_profiling()))
    total: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            op = e["args"].get("op_name", "?")
            total[op] += e["dur"] / 1e3
            calls[op] += 1
    return sorted(((op, calls[op] // (runs + 1), total[op] / (runs + 1)) for op in total), key=lambda r: -r[2])


def _table(title: str, rows) -> str:
    whole = sum(r[2] for r in rows) or 1.0
    lines = [title, f"  {'op':<24} {'calls':>6} {'ms/run':>9} {'share':>6}"]
    lines += [f"  {op:<24} {n:>6} {ms:>9.2f} {ms / whole:>6.1%}" for op, n, ms in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ bench

def run(args) -> list[Row]:
    import onnx
    import onnxruntime as ort

    import polyhal.onnx

    device = args.device or "cpu:0"
    reps = 2 if args.quick else 6
    rows = []
    tmp = Path(tempfile.mkdtemp())
    for name, build in MODELS.items():
        path = tmp / f"{name}.onnx"
        onnx.save(build(), str(path))
        x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
        feeds = {"input": x}
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        t0 = time.perf_counter()
        program = polyhal.onnx.load(path)
        plan = program.compile(device)
        t_compile = time.perf_counter() - t0
        (want,) = session.run(None, feeds)
        (got,) = program.execute(plan, feeds).values()
        err = float(np.max(np.abs(got - want)))
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3, err_msg=name)

        nchw = program.compile(device, data_tiling=False)

        def run_ours():
            program.execute(plan, feeds)

        def run_nchw():
            program.execute(nchw, feeds)

        def run_theirs():
            session.run(None, feeds)

        tp, tn, to = [], [], []
        for _ in range(reps):
            for fn, samples in ((run_ours, tp), (run_nchw, tn), (run_theirs, to)):
                time.sleep(0.3)  # both sides leave threads spinning after a burst
                for _ in range(3):
                    samples.append(median_time(fn, repeat=3, number=1, warmup=1))
        t_ours, t_theirs = statistics.median(tp), statistics.median(to)
        ours = profile(plan, x)
        theirs = ort_profile(str(path), feeds)
        print(_table(f"{name}: polyhal per op ({len(plan.program.ops)} ops)", ours))
        print(_table(f"{name}: onnxruntime per op", theirs))
        print(f"{name}: polyhal {t_ours * 1e3:.2f} ms (all NCHW: {statistics.median(tn) * 1e3:.2f} ms, "
              f"{plan.placement.encodings.encode_dispatches} relayouts), onnxruntime {t_theirs * 1e3:.2f} ms")
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        rows.append(Row(
            f"{name} (1x3x224x224) on {device}", "ms", t_ours * 1e3, t_theirs * 1e3,
            f"onnxruntime {ort.__version__} CPU", f"<= {TARGET}x", t_ours <= TARGET * t_theirs,
            {"ops": len(plan.program.ops), "dispatches": plan.dispatch_count, "compile_ms": t_compile * 1e3,
             "ms_polyhal_nchw": statistics.median(tn) * 1e3,
             "relayouts": plan.placement.encodings.encode_dispatches,
             "max_abs_err": err, "min_ms_polyhal": min(tp) * 1e3, "min_ms_onnxruntime": min(to) * 1e3,
             "load_average": load, "profile_polyhal": [list(r) for r in ours],
             "profile_onnxruntime": [list(r) for r in theirs]}))
    return rows
