"""The oneDNN binding (polyhal_cpu.onednn) and its kernels (polyhal_cpu.onednn_kernels): real
library calls, checked against the ops' references; skipped where the library is not installed
(but for the test that it is missing, which makes it so)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import polyhal
from polyhal.errors import KernelError, PolyhalError
from polyhal.ir.types import TensorType
from polyhal.ops import OPS
from polyhal_cpu import onednn, onednn_kernels
from polyhal_cpu.kernels import prepare

needs_onednn = pytest.mark.skipif(not onednn.usable(), reason=f"oneDNN is not usable here: {onednn.status()[1]}")
RNG = np.random.default_rng(30)


@pytest.fixture(autouse=True)
def _untimed(monkeypatch):
    """These tests are of the primitives: oneDNN runs every conv it serves (not timed against
    the own kernel; test_small_conv_timed_against_own_kernel is of that choice)."""
    monkeypatch.setenv("POLYHAL_CPU_ONEDNN_TIMED", "0")


def _f(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _child(code: str, **env) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (the library loads once per process), with ``env`` added."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


@needs_onednn
def test_bad_status_is_a_polyhal_error_naming_op_and_status():
    # a real call with operands that do not fit: (2, 3, 4) @ (4, 5) has no 3-D weights
    with pytest.raises(onednn.OneDNNError) as info:
        onednn.matmul_desc("matmul", onednn.plain((2, 3, 4)), onednn.plain((4, 5)), None, onednn.plain((2, 3, 5)),
                           onednn.Attr())
    assert isinstance(info.value, KernelError) and isinstance(info.value, PolyhalError)
    message = str(info.value)
    assert "matmul" in message and "invalid_arguments" in message and "POLYHAL_CPU_ONEDNN=0" in message
    assert info.value.status == 2


@needs_onednn
def test_refused_instance_falls_back_per_op():
    # oneDNN has no float64 convolution on the CPU: its primitive descriptor is "unimplemented",
    # and the CPU's own conv runs the instance, correctly
    x, w = RNG.standard_normal((1, 3, 9, 9)), RNG.standard_normal((4, 3, 3, 3))
    attrs = {"strides": [1, 1], "pads": [1, 1, 1, 1], "dilations": [1, 1], "group": 1}
    ins, outs = (TensorType(x.shape, x.dtype), TensorType(w.shape, w.dtype)), (TensorType((1, 4, 9, 9), x.dtype),)
    assert onednn_kernels.conv_plan("conv", attrs, ins, outs) is None
    why = [v for k, v in onednn_kernels.refusals().items() if k[0] == "conv" and k[2] == ins]
    assert why and "unimplemented" in why[0]
    kernel = prepare("conv", attrs, ins, outs)
    assert "oneDNN" not in getattr(kernel, "kernel_name", "")
    out = np.empty(outs[0].shape)
    kernel(x, w, out)
    np.testing.assert_allclose(out, OPS["conv"].reference(x, w, **attrs)[0], rtol=1e-10, atol=1e-10)
    # and explain says so, by name
    b = polyhal.ProgramBuilder("f64")
    y = b.op("conv", b.input("x", x.shape, x.dtype), b.constant(w), pads=(1, 1, 1, 1))
    b.output(b.op("relu", y))
    explain = polyhal.compile(b.build(), "cpu:0").explain()
    assert "0 of 1 conv/matmul dispatches on the CPU run as oneDNN primitives" in explain
    assert "runs on the CPU's own kernel: oneDNN has no implementation of this" in explain


def test_library_missing_falls_back_and_says_so():
    code = ("import json, numpy as np, polyhal; from polyhal_cpu import onednn; "
            "p = polyhal.ProgramBuilder('c'); x = p.input('x', (1, 8, 10, 10), np.float32); "
            "w = p.constant(np.ones((8, 8, 3, 3), np.float32)); p.output(p.op('conv', x, w, pads=(1, 1, 1, 1))); "
            "plan = polyhal.compile(p.build(), 'cpu:0'); y = plan(np.ones((1, 8, 10, 10), np.float32)).numpy(); "
            "print(json.dumps([onednn.status()[1], y[0, 0, 5, 5].item(), plan.explain()]))")
    proc = _child(code, POLYHAL_CPU_ONEDNN_LIBRARY="/nonexistent/libdnnl.so.3")
    assert proc.returncode == 0, proc.stderr
    why, value, explain = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "/nonexistent/libdnnl.so.3" in why
    assert value == 72.0 and "onednn_" not in explain  # the CPU's own conv ran it, without oneDNN's scratch
    assert "oneDNN unusable (/nonexistent/libdnnl.so.3 does not exist" in explain
    devices = subprocess.run([sys.executable, "-m", "polyhal.cli", "devices"], capture_output=True, text=True,
                             timeout=300, env={**os.environ, "POLYHAL_CPU_ONEDNN_LIBRARY": "/nonexistent/libdnnl.so.3"})
    line = next(li for li in devices.stdout.splitlines() if li.startswith("cpu:0"))
    assert "oneDNN unusable: own kernels" in line


@needs_onednn
def test_thread_override_warns():
    proc = _child("from polyhal_cpu import onednn; print(onednn.lib().set_threads())",
                  POLYHAL_CPU_THREADS="1", OMP_NUM_THREADS="2")
    assert proc.returncode == 0, proc.stderr
    assert "POLYHAL_CPU_THREADS=1 overrides OMP_NUM_THREADS=2 for oneDNN" in proc.stderr
    assert proc.stdout.strip() == "1"


@needs_onednn
@pytest.mark.parametrize("case", ["grouped", "depthwise", "dilated_strided", "asymmetric", "conv1d"])
def test_conv_geometries_with_epilogue(case, check_on_poisoned_scratch):
    x_shape, w_shape, attrs = {
        "grouped": ((2, 8, 11, 11), (12, 4, 3, 3), {"group": 2, "pads": [1, 1, 1, 1]}),
        "depthwise": ((1, 16, 12, 12), (16, 1, 3, 3), {"group": 16, "pads": [1, 1, 1, 1]}),
        "dilated_strided": ((1, 8, 17, 17), (8, 8, 3, 3), {"strides": [2, 2], "dilations": [2, 2],
                                                         "pads": [2, 2, 2, 2]}),
        "asymmetric": ((1, 6, 10, 9), (5, 6, 3, 2), {"pads": [0, 1, 2, 0], "strides": [1, 2]}),
        "conv1d": ((2, 6, 20), (4, 6, 5), {"pads": [2, 1]}),
    }[case]
    attrs = {"strides": [1] * (len(x_shape) - 2), "dilations": [1] * (len(x_shape) - 2), "group": 1,
             "pads": [0] * (2 * len(x_shape) - 4), **attrs, "activation": "clip", "alpha": -0.5, "beta": 1.5}
    x, w, b = _f(*x_shape), _f(*w_shape), _f(w_shape[0])
    (y,) = OPS["fused_conv"].infer((TensorType(x_shape, np.float32), TensorType(w_shape, np.float32),
                                    TensorType(b.shape, np.float32)), attrs)
    r = _f(*y.shape)
    ins = [x, w, b, r]
    types = tuple(TensorType(a.shape, a.dtype) for a in ins)
    requests = onednn_kernels.conv_scratch("fused_conv", attrs, types, (y,))
    assert requests is not None, onednn_kernels.refusals()
    from polyhal_cpu.scratch import standalone

    scratch = standalone(None, requests)
    kernel = prepare("fused_conv", attrs, types, (y,), scratch)
    assert kernel.kernel_name.startswith("oneDNN conv") and "+bias+sum+clip" in kernel.kernel_name
    w.flags.writeable = False  # a plan's constant: reordered once, then kept
    check_on_poisoned_scratch(kernel, scratch, requests, "fused_conv", attrs, ins, lambda: _f(*x_shape), y)


@needs_onednn
def test_chain_keeps_channels_last_and_reorders_only_at_its_edges():
    b = polyhal.ProgramBuilder("chain")
    x = b.input("x", (1, 16, 14, 14), np.float32)
    w1, b1, w2 = _f(32, 16, 3, 3), _f(32), _f(32, 32, 3, 3)
    y = b.op("relu", b.op("conv", x, b.constant(w1), b.constant(b1), pads=(1, 1, 1, 1)))
    z = b.op("conv", y, b.constant(w2), pads=(1, 1, 1, 1))
    b.output(b.op("add", z, y))
    plan = polyhal.compile(b.build(), "cpu:0")
    explain = plan.explain()
    assert "2 pack/unpack dispatches" in explain  # the chain's input and output only
    assert "oneDNN reorder" not in explain  # its convs take nhwc as it lies
    xv = _f(1, 16, 14, 14)
    for _ in range(2):  # the second run uses the kept weights
        got = plan(xv).numpy()
    ref_y = np.maximum(OPS["conv"].reference(xv, w1, b1, pads=(1, 1, 1, 1))[0], 0)
    want = OPS["conv"].reference(ref_y, w2, pads=(1, 1, 1, 1))[0] + ref_y
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@needs_onednn
def test_depthwise_chain_stays_channels_last_on_the_library_tier(monkeypatch):
    # without the compiled loops (POLYHAL_CPU_NATIVE=0) oneDNN runs an inverted residual's convs
    # on its channels-last maps too: one pack in, one unpack out, no reorder around each conv
    monkeypatch.setenv("POLYHAL_CPU_NATIVE", "0")
    b = polyhal.ProgramBuilder("inverted_residual")
    x = b.input("x", (2, 8, 12, 12), np.float32)
    w1, w2, b2, w3 = _f(24, 8, 1, 1), _f(24, 1, 3, 3), _f(24), _f(8, 24, 1, 1)
    y = b.op("relu", b.op("conv", x, b.constant(w1)))
    y = b.op("relu", b.op("conv", y, b.constant(w2), b.constant(b2), pads=(1, 1, 1, 1), group=24))
    b.output(b.op("add", b.op("conv", y, b.constant(w3)), x))
    plan = polyhal.compile(b.build(), "cpu:0")
    explain = plan.explain()
    assert "2 pack/unpack dispatches" in explain and "oneDNN reorder" not in explain, explain
    assert "3 of 3 conv/matmul dispatches on the CPU run as oneDNN primitives" in explain, explain
    xv = _f(2, 8, 12, 12)
    got = plan(xv).numpy()
    conv = OPS["conv"].reference
    ref = np.maximum(conv(xv, w1)[0], 0)
    ref = np.maximum(conv(ref, w2, b2, pads=(1, 1, 1, 1), group=24)[0], 0)
    np.testing.assert_allclose(got, conv(ref, w3)[0] + xv, rtol=1e-4, atol=1e-4)


@needs_onednn
@pytest.mark.parametrize("op", ["matmul", "gemm", "linear", "fused_linear"])
def test_matmul_family_against_reference(op, monkeypatch):
    # every implementation taken, so that the path runs here too (on AVX2 oneDNN 3.2's matmul is
    # gemm:jit, which the CPU leaves to its own GEMMs)
    monkeypatch.setattr(onednn_kernels, "MATMUL_IMPLEMENTATIONS", ("",))
    monkeypatch.setattr(onednn_kernels, "_MATMULS", {})
    for seed in range(12):
        inputs, attrs = OPS[op].sample(np.random.default_rng(seed))
        inputs = [np.asarray(a, np.float32) for a in inputs]
        types = tuple(TensorType(a.shape, a.dtype) for a in inputs)
        outs = tuple(OPS[op].infer(types, attrs))
        kernel = prepare(op, attrs, types, outs)
        asked = all(t.size for t in (*types, *outs)) and (op != "matmul" or min(t.rank for t in types) >= 2)
        if asked and not hasattr(kernel, "kernel_name"):
            # (empty operands: nothing to compute; vectors: numpy's own) refused, e.g. a C of (M, 1), which oneDNN
            # broadcasts only in its reference implementation: the CPU's own GEMM ran it
            assert any(k[0] == op and k[2] == types for k in onednn_kernels.refusals()), (seed, types)
        out = np.empty(outs[0].shape, np.float32)
        kernel(*inputs, out)
        (want,) = OPS[op].reference(*inputs, **attrs)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4, err_msg=f"{op} seed {seed}")


@needs_onednn
@pytest.mark.parametrize("op", ["matmul", "linear"])
def test_matmul_keeps_its_copy_of_a_read_only_transposed_view(op, monkeypatch):
    # a constant's transposed view (fold_constants, Gemm's transB): reordered (or made row-major)
    # once and kept while the same view comes; a writable strided operand is copied per call
    monkeypatch.setattr(onednn_kernels, "MATMUL_IMPLEMENTATIONS", ("",))
    monkeypatch.setattr(onednn_kernels, "_MATMULS", {})
    x, original, bias = _f(32, 48), _f(40, 48), _f(40)
    original.flags.writeable = False
    w = original.T
    ins = [x, w] + ([bias] if op == "linear" else [])
    types = tuple(TensorType(a.shape, a.dtype) for a in ins)
    outs = tuple(OPS[op].infer(types, {}))
    kernel = prepare(op, {}, types, outs)
    assert hasattr(kernel, "kernel_name"), onednn_kernels.refusals()
    want = x @ original.T + (bias if op == "linear" else 0)
    for weights in (w, w, np.array(original).T):  # kept, kept again, a writable view
        out = np.empty(outs[0].shape, np.float32)
        kernel(*([x, weights] + ins[2:]), out)
def test_strided_bias_and_residual_are_held_while_the_matmul_reads_them(monkeypatch):
    # a bias or residual handed over as a strided view is copied, and the copy must live until
    # the primitive has read it (the address of a temporary copy was freed memory by the call)
    monkeypatch.setattr(onednn_kernels, "MATMUL_IMPLEMENTATIONS", ("",))
    monkeypatch.setattr(onednn_kernels, "_MATMULS", {})
    x, w = _f(64, 48), _f(48, 40)
    bias, residual = _f(80)[::2], _f(40, 64).T  # a strided row, a transposed (64, 40)
    assert not bias.flags.c_contiguous and not residual.flags.c_contiguous
    attrs = {"activation": "relu", "alpha": 0.0, "beta": 0.0}
    types = tuple(TensorType(a.shape, a.dtype) for a in (x, w, bias, residual))
    kernel = prepare("fused_linear", attrs, types, (TensorType((64, 40), np.float32),))
    assert kernel.kernel_name.startswith("oneDNN matmul"), kernel
    (want,) = OPS["fused_linear"].reference(x, w, bias, residual, **attrs)
    for _ in range(3):
        out = np.empty((64, 40), np.float32)
        kernel(x, w, bias, residual, out)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


@needs_onednn
def test_matmul_left_to_own_gemms_where_oneDNN_has_no_brgemm():
    a, b = TensorType((64, 96), np.float32), TensorType((96, 32), np.float32)
    plan = onednn_kernels.matmul_plan("matmul", {}, (a, b), (TensorType((64, 32), np.float32),))
    if plan is not None:
        assert plan.matmul.impl.startswith("brg")
    else:
        assert "lost to the CPU's own GEMMs" in onednn_kernels.refusals()[
            onednn_kernels._key("matmul", {}, (a, b), (TensorType((64, 32), np.float32),))]


@needs_onednn
def test_kernel_prepared_alone_keeps_its_scratch():
    # prepared without a plan, the kernel's scratch is made at prepare; the kernel runs on its
    # addresses, so it must keep it alive (a 1x1 conv whose weights reorder needs a scratchpad)
    import gc

    x, w = _f(1, 512, 7, 7), _f(128, 512, 1, 1)
    w.flags.writeable = False
    attrs = {"strides": [1, 1], "pads": [0, 0, 2, 2], "dilations": [1, 1], "group": 1}
    types = (TensorType(x.shape, x.dtype), TensorType(w.shape, w.dtype))
    (y,) = OPS["conv"].infer(types, attrs)
    kernel = prepare("conv", attrs, types, (y,))
    gc.collect()
    out = np.empty(y.shape, np.float32)
    kernel(x, w, out)
    np.testing.assert_allclose(out, OPS["conv"].reference(x, w, **attrs)[0], rtol=1e-4, atol=1e-4)


@needs_onednn
def test_small_conv_timed_against_own_kernel(monkeypatch):
    # an instance under TIMED_MACS runs whichever kernel measured faster when the plan was
    # compiled, and says so with both times; a larger one is left to oneDNN untimed
    monkeypatch.setenv("POLYHAL_CPU_ONEDNN_TIMED", "1")
    b = polyhal.ProgramBuilder("timed")
    x = b.input("x", (1, 40, 1, 1), np.float32)  # a squeeze-excitation 1x1 conv on a 1x1 map
    w1, b1 = _f(10, 40, 1, 1), _f(10)
    y = b.op("conv", x, b.constant(w1), b.constant(b1))
    big = b.input("big", (1, 64, 128, 128), np.float32)
    w2 = _f(64, 64, 3, 3)  # 604M multiply-adds: untimed
    z = b.op("conv", big, b.constant(w2), pads=(1, 1, 1, 1))
    b.output(y)
    b.output(z)
    plan = polyhal.compile(b.build(), "cpu:0")
    explain = plan.explain()
    timed = [line for line in explain.splitlines() if "timed: oneDNN" in line or "measured faster" in line]
    assert len(timed) == 1 and "own" in timed[0] and " us" in timed[0], explain
    ran = 1 if "runs on the CPU's own kernel: it measured faster" in timed[0] else 2
    assert f"{ran} of 2 conv/matmul dispatches on the CPU run as oneDNN primitives" in explain, explain
    xv, bv = _f(1, 40, 1, 1), _f(1, 64, 128, 128)
    got_y, got_z = (t.numpy() for t in plan(xv, bv))
    np.testing.assert_allclose(got_y, OPS["conv"].reference(xv, w1, b1)[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_z, OPS["conv"].reference(bv, w2, pads=(1, 1, 1, 1))[0], rtol=1e-3, atol=1e-3)


@needs_onednn
def test_small_conv_primitive_runs_on_one_thread():
    # under SMALL_MACS multiply-adds a primitive is made for, and run on, one thread (waking
    # OpenMP's passive workers costs more than the work); OpenMP's count is the budget's after it
    attrs = {"strides": [1, 1], "pads": [1, 1, 1, 1], "dilations": [1, 1], "group": 8}
    for shape, one in (((1, 8, 10, 10), True), ((4, 64, 64, 64), False)):
        c = shape[1]
        x, w = _f(*shape), _f(c, 1, 3, 3) if one else _f(c, c // 8, 3, 3)
        w.flags.writeable = False
        types = (TensorType(x.shape, x.dtype), TensorType(w.shape, w.dtype))
        (y,) = OPS["conv"].infer(types, attrs)
        kernel = prepare("conv", attrs, types, (y,))
        assert kernel.kernel_name.startswith("oneDNN conv") and kernel.kernel_name.endswith("(one thread)") == one
        out = np.empty(y.shape, np.float32)
        kernel(x, w, out)
        np.testing.assert_allclose(out, OPS["conv"].reference(x, w, **attrs)[0], rtol=1e-4, atol=1e-4)


@needs_onednn
def test_two_plans_of_one_primitive_run_at_once_on_two_threads():
    # Plans of the same instance share its primitive (the plan caches); each kernel binds its own
    # memory objects and stream. Once they were the primitive's: a run on one thread set the
    # addresses that another thread's run then computed with (wrong results now and then).
    import threading

    from polyhal_cpu import onednn_normalization

    shape = (64, 1024)
    x = TensorType(shape, np.float32)
    planned = onednn_normalization.plan("softmax", {"axis": -1}, (x,), (x,))
    if planned is None:
        pytest.skip("oneDNN runs no softmax of this size here")
    runs = [planned.primitive.executor() for _ in range(2)]
    bound = [run.__kwdefaults__["_keep"][1] for run in runs]
    assert not {m.value for m in bound[0].memories} & {m.value for m in bound[1].memories}
    assert bound[0].stream.value != bound[1].stream.value
    b = polyhal.ProgramBuilder("softmax_rows")
    b.output(b.op("softmax", b.input("x", shape), axis=-1))
    program = b.build()
    plans = [polyhal.compile(program, "cpu:0") for _ in range(2)]
    inputs = [np.random.default_rng(k).random(shape, np.float32) for k in range(2)]
    want = [plans[0].run_numpy(a)[0] for a in inputs]
    wrong = []

    def work(k):
        for _ in range(1500):
            if not np.array_equal(plans[k].run_numpy(inputs[k])[0], want[k]):
                wrong.append(k)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


@needs_onednn
def test_a_transposed_constant_weight_is_reordered_once(monkeypatch):
    # GPT-2's LM head multiplies by its embedding transposed: a constant that reaches the kernel
    # as a strided view. Made row-major per call, it was a fresh array each run, so its reorder
    # into oneDNN's layout (154 MB there) was paid on every run.
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    import polyhal.onnx as ponnx

    reorders = []
    real = onednn_kernels._kept_weights

    def counting(reorder, *args):
        if reorder is not None:
            inner = reorder

            def reorder(*addresses):
                reorders.append(1)
                return inner(*addresses)
        return real(reorder, *args)

    monkeypatch.setattr(onednn_kernels, "_kept_weights", counting)
    # (GPT-2's 154 MB transpose is above the import's fold limit: the compile's fold_constants
    # pass makes it a transposed view of the initializer; so here too)
    monkeypatch.setenv("POLYHAL_FOLD_LIMIT", "1")
    rng = np.random.default_rng(17)
    w = rng.standard_normal((96, 64)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
                               helper.make_node("MatMul", ["x", "wt"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [32, 96])],
                              [numpy_helper.from_array(w, "w")])
    program = ponnx.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    plan = program.compile("cpu:0")
    for _ in range(3):
        x = rng.standard_normal((32, 64)).astype(np.float32)
        np.testing.assert_allclose(program.execute(plan, {"x": x})["y"], x @ w.T, rtol=1e-4, atol=1e-4)
    if "onednn_matmul.weights" not in plan.explain():
        pytest.skip("oneDNN does not run this matmul here (the CPU's own GEMMs take a transposed matrix as it is)")
    assert len(reorders) == 1


def test_few_row_products_and_small_softmaxes_load_no_library():
    # The mlp example at batch 1: its gemms are refused by their shapes alone and its softmax
    # (16 elements) stays on the loop, so the first session loads no oneDNN; the reason is kept.
    mlp = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "mlp.onnx")
    code = f"""
import json, numpy as np, polyhal, polyhal.onnx
from polyhal_cpu import onednn, onednn_kernels
session = polyhal.InferenceSession({mlp!r}, "cpu:0")
(y,) = session.run(None, {{"x": np.ones((1, 256), np.float32)}})
print(json.dumps({{"loaded": onednn._load.cache_info().currsize, "sum": float(y.sum()),
                  "why": sorted({{why.split(":")[0] for why in onednn_kernels.refusals().values()}}),
                  "explain": session.plan.explain()}}))
"""
    out = _child(code, POLYHAL_CPU_AOT_WAIT="1")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["loaded"] == 0 and got["why"] and set(got["why"]) <= {"gemm", "fused_linear"}, got
    assert abs(got["sum"] - 1.0) < 1e-5  # a softmax's row
    assert "oneDNN (not loaded): 0 of 3 conv/matmul dispatches" in got["explain"]
    # Without the library, explain says why it is unusable, as before.
    out = _child(code, POLYHAL_CPU_AOT_WAIT="1", POLYHAL_CPU_ONEDNN_LIBRARY="/nonexistent/libdnnl.so.3")
    assert out.returncode == 0, out.stderr
    explain = json.loads(out.stdout.splitlines()[-1])["explain"]
    assert "oneDNN unusable (/nonexistent/libdnnl.so.3 does not exist" in explain
    t, w = TensorType((3, 64), np.float32), TensorType((64, 32), np.float32)
    assert onednn_kernels.matmul_plan("matmul", {}, (t, w), (TensorType((3, 32), np.float32),)) is None
    why = onednn_kernels.refusals()[onednn_kernels._key("matmul", {}, (t, w), (TensorType((3, 32), np.float32),))]
    assert "3 row(s) against 64 x 32 weights" in why
