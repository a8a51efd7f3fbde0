"""Fuzzing the ONNX front end with mutated models: every outcome is a result or a polyhal error,
never another exception, a crash or unbounded memory.

A seeded mutator changes the example models (dims, attributes, tensor bytes and types, node
inputs and op types, truncation). It runs in a child process with a memory limit, so a crash or
a runaway allocation fails the test instead of the session. ``POLYHAL_FUZZ=N`` runs N mutants
(default 40); the seed comes from ``POLYHAL_SEED`` (shown in pytest's header) to reproduce a run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEMORY_LIMIT = 3 << 30  # address space of the child; polyhal's own structures stay far below it

CHILD = r"""
import json, random, resource, sys
import numpy as np, onnx
from polyhal.errors import PolyhalError
from polyhal.frontends.onnx.importer import load

seed, count, paths = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
models = [onnx.load(p) for p in paths]
rng = random.Random(seed)
OPS = ["Add", "MatMul", "Relu", "Reshape", "Transpose", "Softmax", "ConstantOfShape", "Expand", "Tile", "Div",
       "Gather", "Concat", "Range", "ReduceSum", "Slice", "Cast", "Where", "Pad"]

def mutate(model):
    m = onnx.ModelProto(); m.CopyFrom(model)
    g = m.graph
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(7)
        if kind == 0 and g.node:                      # op type
            rng.choice(g.node).op_type = rng.choice(OPS)
        elif kind == 1 and g.node:                    # rewire an input
            n = rng.choice(g.node)
            names = [i.name for i in g.input] + [t.name for t in g.initializer] + [o for x in g.node for o in x.output]
            if n.input and names:
                n.input[rng.randrange(len(n.input))] = rng.choice(names + ["", "missing"])
        elif kind == 2 and g.initializer:             # tensor bytes, dims or type
            t = rng.choice(g.initializer)
            what = rng.randrange(3)
            if what == 0 and t.raw_data:
                b = bytearray(t.raw_data); i = rng.randrange(len(b)); b[i] = rng.randrange(256); t.raw_data = bytes(b)
            elif what == 1 and t.dims:
                t.dims[rng.randrange(len(t.dims))] = rng.choice([0, 1, 3, 1 << 20, 1 << 40, -1])
            else:
                t.data_type = rng.randrange(1, 22)
        elif kind == 3:                               # declared input dims
            for vi in g.input:
                for d in vi.type.tensor_type.shape.dim:
                    if rng.random() < 0.3:
                        d.dim_value = rng.choice([0, 1, 7, 1 << 31])
        elif kind == 4 and g.node:                    # attributes
            n = rng.choice(g.node)
            for a in n.attribute:
                if a.type == onnx.AttributeProto.INT:
                    a.i = rng.choice([-1, 0, 1, 5, 1 << 40])
                elif a.type == onnx.AttributeProto.INTS and a.ints:
                    a.ints[rng.randrange(len(a.ints))] = rng.choice([-3, 0, 2, 1 << 33])
        elif kind == 5:                               # opset
            m.opset_import[0].version = rng.choice([1, 6, 7, 13, 99])
        else:                                         # a large fill
            shape = onnx.helper.make_tensor("big", onnx.TensorProto.INT64, [1], [rng.choice([1 << 28, 1 << 34])])
            g.initializer.append(shape)
            g.node.append(onnx.helper.make_node("ConstantOfShape", ["big"], ["big_out"]))
            g.output.append(onnx.helper.make_tensor_value_info("big_out", onnx.TensorProto.FLOAT, None))
    data = m.SerializeToString()
    if rng.random() < 0.1:
        data = data[: rng.randrange(len(data) + 1)]
    return data

outcomes = {"ok": 0, "polyhal": 0}
for i in range(count):
    data = mutate(models[i % len(models)])
    try:
        program = load(data, default_dim=2)
        if sum(v.type.nbytes for v in program.inputs) < (64 << 20):  # the harness's own inputs stay small
            program.run({v.name: np.ones(v.type.shape, v.type.dtype) for v in program.inputs}, "cpu:0")
        outcomes["ok"] += 1
    except PolyhalError:
        outcomes["polyhal"] += 1
    except BaseException as exc:
        print(json.dumps({"mutant": i, "error": f"{type(exc).__name__}: {exc}"[:500]}))
        sys.exit(3)
outcomes["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
print(json.dumps(outcomes))
"""


def test_mutated_models_give_results_or_polyhal_errors():
    from polyhal.testing.plugin import session_seed

    seed = session_seed()
    count = int(os.environ.get("POLYHAL_FUZZ") or 40)
    models = [os.path.join(ROOT, "examples", n) for n in ("mlp.onnx", "transformer_block.onnx")]

    def limit_memory():
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (MEMORY_LIMIT, MEMORY_LIMIT))

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), POLYHAL_BACKENDS="cpu")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(seed), str(count), *models], capture_output=True,
                          text=True, env=env, timeout=60 + 5 * count, preexec_fn=limit_memory)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, (f"POLYHAL_SEED={seed} POLYHAL_FUZZ={count}: child exited {proc.returncode} "
                                  f"(negative: killed by that signal): {last} {proc.stderr[-2000:]}")
    outcomes = json.loads(last)
    assert outcomes["ok"] + outcomes["polyhal"] == count
    assert outcomes["maxrss_mb"] < MEMORY_LIMIT >> 20
