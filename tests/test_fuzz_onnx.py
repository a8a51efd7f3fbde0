"""Fuzzing the ONNX front end with mutated models: every outcome is a result or a polyhal error,
never another exception, a crash or unbounded memory.

A seeded mutator changes the example models (dims, attributes, tensor bytes and types, node
inputs and op types, truncation). It runs in a child process with a memory limit, so a crash or
a runaway allocation fails the test instead of the session. ``POLYHAL_FUZZ=N`` runs N mutants
(default 40); the seed comes from ``POLYHAL_SEED`` (shown in pytest's header) to reproduce a run.

A second fuzzer writes model folders to disk: models with external data at every depth (If and
Loop bodies, nested bodies, Constant values, a staged program, the examples), mutated in the
proto and in the folder, loaded through the path. Each must end in a polyhal error or a run that
onnxruntime agrees with, and no file outside the model's folder may be opened (inotify watches
the folders around it, and the working directory holds files of the data files' names).
``POLYHAL_FUZZ=N`` runs N of those too (default 24).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from polyhal.testing.settings import TestSettings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEMORY_LIMIT = 3 << 30  # address space of the child; polyhal's own structures stay far below it

COMMON = r"""
import json, random, resource, sys
import numpy as np, onnx
from polyhal.errors import PolyhalError
from polyhal.frontends.onnx.importer import load

OPS = ["Add", "MatMul", "Relu", "Reshape", "Transpose", "Softmax", "ConstantOfShape", "Expand", "Tile", "Div",
       "Gather", "Concat", "Range", "ReduceSum", "Slice", "Cast", "Where", "Pad"]

def mutate_structure(m, g):
    # one change to graph g of model m (g may be a subgraph)
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
"""

CHILD = COMMON + r"""
seed, count, paths = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
models = [onnx.load(p) for p in paths]
rng = random.Random(seed)

def mutate(model):
    m = onnx.ModelProto(); m.CopyFrom(model)
    for _ in range(rng.randint(1, 3)):
        mutate_structure(m, m.graph)
    data = m.SerializeToString()
    if rng.random() < 0.1:
        data = data[: rng.randrange(len(data) + 1)]
    return data

def staged_feeds(data):
    # (shape, dtype) of a staged program's inputs (it has no typed `inputs`: their shapes are known
    # at run time), read from the model as loaded; None where the harness cannot read them.
    try:
        m = onnx.load_from_string(data)
        init = {t.name for t in m.graph.initializer}
        feeds = {}
        for v in m.graph.input:
            if v.name not in init:
                t = v.type.tensor_type
                shape = [d.dim_value if d.HasField("dim_value") else 2 for d in t.shape.dim]
                feeds[v.name] = (shape, onnx.helper.tensor_dtype_to_np_dtype(t.elem_type))
        return feeds
    except Exception:
        return None

outcomes = {"ok": 0, "polyhal": 0}
for i in range(count):
    data = mutate(models[i % len(models)])
    try:
        program = load(data, default_dim=2)
        if hasattr(program, "inputs"):
            feeds = {v.name: (v.type.shape, v.type.dtype) for v in program.inputs}
        else:
            feeds = staged_feeds(data)
        # the harness's own inputs stay small: sized before anything is allocated
        if feeds is not None and sum(int(np.prod(s, dtype=float)) * np.dtype(d).itemsize
                                     for s, d in feeds.values()) < (64 << 20):
            program.run({k: np.ones(s, d) for k, (s, d) in feeds.items()}, "cpu:0")
        outcomes["ok"] += 1
    except PolyhalError:
        outcomes["polyhal"] += 1
    except BaseException as exc:
        print(json.dumps({"mutant": i, "error": f"{type(exc).__name__}: {exc}"[:500]}))
        sys.exit(3)
outcomes["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
print(json.dumps(outcomes))
"""


DISK_CHILD = COMMON + r"""
import ctypes, os, shutil, struct
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data
try:
    import onnxruntime as ort
except ImportError:
    ort = None

seed, count, sandbox, examples = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
rng = random.Random(seed)
FOLDER, CWD, BAIT = os.path.join(sandbox, "model"), os.path.join(sandbox, "cwd"), os.path.join(sandbox, "bait.bin")
FILES = ["weights.bin", "sub/more.bin"]
# other names of the same files (links that stay inside the folder among them), and names that escape or miss
ALIASES = {"weights.bin": ["./weights.bin", "link_in", "dir_in/weights.bin"],
           "sub/more.bin": ["sub//more.bin", "./sub/more.bin", "sub_link/more.bin"]}
LOCATIONS = FILES + ["../bait.bin", BAIT, "link_out", "dir_out/bait.bin", "nosuch.bin", "", "sub", "fifo",
                     "sub/../weights.bin", "weights.bin\0.x", "cwd_only.bin", "C:w", "dir_out/cwd/weights.bin"]
EXTERNAL = TensorProto.EXTERNAL

def graphs(g):
    yield g
    for n in g.node:
        for a in n.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                yield from graphs(sub)

def tensors(m):
    for g in graphs(m.graph):
        yield from g.initializer
        for n in g.node:
            for a in n.attribute:
                if a.HasField("t"):
                    yield a.t

def externalize(m):
    # every tensor with raw data, at every depth, into the two files in turn: (model, {file: bytes})
    files = {f: bytearray() for f in FILES}
    for i, t in enumerate(t for t in tensors(m) if t.HasField("raw_data")):
        name = FILES[i % 2]
        set_external_data(t, name, len(files[name]), len(t.raw_data))
        files[name] += t.raw_data
        t.ClearField("raw_data")
    return m, {k: bytes(v) for k, v in files.items()}

# ---- seed models: If and Loop bodies, nesting, a staged data-length program, two examples
V, F, B, I64 = helper.make_tensor_value_info, TensorProto.FLOAT, TensorProto.BOOL, TensorProto.INT64
arr = lambda name, *v, dt=np.float32: numpy_helper.from_array(np.array(v, dt), name)
def model(nodes, inputs, outputs, inits=()):
    return helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits)),
                             opset_imports=[helper.make_opsetid("", 17)])
def body(init):
    return helper.make_graph([helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                              helper.make_node("Add", ["v_in", init], ["v_out"])], "body",
                             [V("i", I64, []), V("cond_in", B, []), V("v_in", F, [4])],
                             [V("cond_out", B, []), V("v_out", F, [4])], initializer=[arr(init, .5, 1, 1.5, 2)])
def other():
    return helper.make_graph([helper.make_node("Constant", [], ["e"], value=arr("ce", -1, -2, -3, -4))], "else", [],
                             [V("e", F, [4])])
then = helper.make_graph([helper.make_node("Add", ["v0", "kt"], ["t"])], "then", [], [V("t", F, [4])],
                         initializer=[arr("kt", 2, 4, 6, 8)])
deep = helper.make_graph([helper.make_node("Loop", ["n", "", "v0"], ["t"], body=body("kn"))], "then", [], [V("t", F, [4])])
IF_IN, LOOP_IN = [V("c", B, []), V("v0", F, [4])], [V("n", I64, []), V("v0", F, [4])]
seeds = [
    model([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other())], IF_IN, [V("y", F, [4])]),
    model([helper.make_node("Loop", ["n", "", "v0"], ["y"], body=body("kb"))], LOOP_IN, [V("y", F, [4])]),
    model([helper.make_node("If", ["c"], ["y"], then_branch=deep, else_branch=other())], IF_IN + LOOP_IN[:1],
          [V("y", F, [4])]),
    model([helper.make_node("Greater", ["x", "zero"], ["m"]), helper.make_node("NonZero", ["m"], ["idx"]),
           helper.make_node("Reshape", ["idx", "flat"], ["r"]), helper.make_node("Gather", ["w", "r"], ["y"])],
          [V("x", F, [8])], [V("y", F, ["n"])],
          [arr("zero", 0), arr("flat", -1, dt=np.int64), arr("w", *range(8))]),
] + [onnx.load(p) for p in examples]
seeds = [externalize(m) for m in seeds]

# ---- the process runs in a folder holding files of the model's data names (bait), watched by inotify
os.makedirs(os.path.join(CWD, "sub"))
size = max(len(d) for _, files in seeds for d in files.values())
for name in FILES + ["cwd_only.bin"]:
    with open(os.path.join(CWD, name), "wb") as f:
        f.write(b"BAIT" * size)
with open(BAIT, "wb") as f:
    f.write(b"BAIT" * size)
os.chdir(CWD)
libc = ctypes.CDLL(None, use_errno=True)
IN_OPEN, IN_ISDIR = 0x20, 0x40000000
watch = libc.inotify_init1(os.O_NONBLOCK)
assert watch >= 0, "inotify"
for d in (sandbox, CWD, os.path.join(CWD, "sub")):
    assert libc.inotify_add_watch(watch, d.encode(), IN_OPEN) >= 0, d

def opened_outside():
    names = []
    while True:
        try:
            buf = os.read(watch, 1 << 16)
        except BlockingIOError:
            return names
        at = 0
        while at < len(buf):
            _, mask, _, length = struct.unpack_from("iIII", buf, at)
            if not mask & IN_ISDIR:
                names.append(buf[at + 16:at + 16 + length].rstrip(b"\0").decode(errors="replace"))
            at += 16 + length

def mutate_disk(m, files, special):
    ext = [t for t in tensors(m) if t.data_location == EXTERNAL]
    kind = rng.randrange(7)
    if kind <= 1 and ext:                                  # where the data is: another name, or a bad one
        for e in rng.choice(ext).external_data:
            if e.key == "location":
                e.value = rng.choice(ALIASES.get(e.value, [e.value]) if kind == 0 else LOCATIONS)
    elif kind == 2 and ext:                                # offset and length
        t = rng.choice(ext)
        entries = [e for e in t.external_data if e.key in ("offset", "length")]
        if entries:
            e = rng.choice(entries)
            e.value = rng.choice(["-1", "0", "3", "17", str(1 << 40), "abc", "", str(len(files.get(FILES[0], b"")) + 1)])
    elif kind == 3 and files:                              # the file's bytes
        name = rng.choice(sorted(files))
        data = bytearray(files[name])
        what = rng.randrange(4)
        if what == 0:
            data = data[: rng.randrange(len(data) + 1)]
        elif what == 1:
            data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        elif data:  # the data changes, the model still runs: onnxruntime says what to expect
            data[rng.randrange(len(data))] = rng.randrange(256)
        files[name] = bytes(data)
    elif kind == 4 and files:                              # the file is something else
        name = rng.choice(sorted(files))
        special[name] = rng.choice(["missing", "dir", "fifo", "link_out", "loop", "dev", "moved"])
        if special[name] == "moved":  # a link inside the folder to the same bytes: still right
            files["moved/" + name] = files[name]
        del files[name]
    elif kind == 5:                                        # inline <-> external
        t = rng.choice(list(tensors(m)))
        if t.data_location == EXTERNAL:
            t.data_location = TensorProto.DEFAULT
        else:
            t.data_location = EXTERNAL
            if rng.random() < 0.5:
                set_external_data(t, rng.choice(LOCATIONS), 0) if t.HasField("raw_data") else None
    elif ext:                                              # repeated or unknown keys
        e = rng.choice(ext).external_data.add()
        e.key, e.value = rng.choice(["location", "offset", "length", "checksum", "basepath", "evil"]), rng.choice(LOCATIONS + ["0", "8"])

def write_folder(m, files, special):
    shutil.rmtree(FOLDER, ignore_errors=True)
    os.makedirs(os.path.join(FOLDER, "sub"))
    for name, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(FOLDER, name)), exist_ok=True)
        with open(os.path.join(FOLDER, name), "wb") as f:
            f.write(data)
    for name, how in special.items():
        path = os.path.join(FOLDER, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if how == "dir":
            os.makedirs(path)
        elif how == "fifo":
            os.mkfifo(path)
        elif how == "link_out":
            os.symlink(BAIT, path)
        elif how == "loop":
            os.symlink(os.path.basename(name), path)
        elif how == "moved":
            os.symlink(os.path.relpath(os.path.join(FOLDER, "moved", name), os.path.dirname(path)), path)
        elif how == "dev":
            os.symlink("/dev/zero", path)
    os.symlink(FILES[0], os.path.join(FOLDER, "link_in"))
    os.symlink(os.path.join("..", "bait.bin"), os.path.join(FOLDER, "link_out"))
    os.symlink("..", os.path.join(FOLDER, "dir_out"))
    os.symlink(".", os.path.join(FOLDER, "dir_in"))
    os.symlink("sub", os.path.join(FOLDER, "sub_link"))
    os.mkfifo(os.path.join(FOLDER, "fifo"))
    data = m.SerializeToString()
    if rng.random() < 0.05:
        data = data[: rng.randrange(len(data) + 1)]
    with open(os.path.join(FOLDER, "model.onnx"), "wb") as f:
        f.write(data)
    return os.path.join(FOLDER, "model.onnx")

def feeds_for(m):
    values = np.random.default_rng(rng.randrange(1 << 32))
    initialized, feeds = {t.name for t in m.graph.initializer}, {}
    for vi in m.graph.input:
        if vi.name in initialized:
            continue
        tt = vi.type.tensor_type
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        shape = [d.dim_value if d.HasField("dim_value") and d.dim_value <= 4096 else 2 for d in tt.shape.dim]
        if dtype == np.bool_:
            feeds[vi.name] = np.full(shape, rng.random() < 0.5)
        elif np.issubdtype(dtype, np.integer):
            feeds[vi.name] = np.full(shape, rng.choice([0, 1, 3, 10 ** 6]), dtype)  # Loop trip counts too
        else:
            feeds[vi.name] = values.standard_normal(shape).astype(dtype)
    return feeds

def check_against_onnxruntime(path, feeds, got):
    # a run that succeeded must be right: onnxruntime on the same folder is the oracle (onnx's
    # reference evaluator runs a Loop nested in an If with an outer trip count zero times)
    if ort is None or any(np.asarray(v).size > 1 << 20 for v in got.values() if isinstance(v, np.ndarray)):
        return False
    try:
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        expected = session.run(None, feeds)
    except Exception:
        return False  # onnxruntime refuses the model or its inputs
    for out, want in zip(session.get_outputs(), expected):
        have = got.get(out.name)
        if not isinstance(have, np.ndarray) or not isinstance(want, np.ndarray):
            continue
        scale = 1e-4 * (1 + float(np.nanmax(np.abs(want.astype(np.float64)), initial=0))) if want.size else 0
        if have.shape != want.shape or not np.allclose(have.astype(np.float64), want.astype(np.float64),
                                                       rtol=1e-4, atol=scale, equal_nan=True):
            raise AssertionError(f"output {out.name!r}: polyhal {have.ravel()[:8]} {have.shape}, "
                                 f"onnxruntime {want.ravel()[:8]} {want.shape}")
    return True

outcomes = {"ok": 0, "polyhal": 0, "checked": 0}
for i in range(count):
    seed_model, seed_files = seeds[i % len(seeds)]
    m = onnx.ModelProto(); m.CopyFrom(seed_model)
    files, special = dict(seed_files), {}
    for _ in range(rng.randint(1, 2)):
        if rng.random() < 0.7:
            mutate_disk(m, files, special)
        else:
            mutate_structure(m, rng.choice(list(graphs(m.graph))))
    path = write_folder(m, files, special)
    opened_outside()  # what the harness itself opened
    try:
        feeds = feeds_for(m)
    except (KeyError, ValueError, TypeError):
        feeds = None  # an element type numpy has no array for: load only
    try:
        try:
            program = load(path, default_dim=2)
            got = program.run(feeds, "cpu:0") if feeds is not None else None
            outcomes["ok"] += 1
        except PolyhalError:
            outcomes["polyhal"] += 1
            got = None
        outside = opened_outside()
        if outside:
            raise AssertionError(f"read outside the model's folder: {outside}")
        if got is not None and check_against_onnxruntime(path, feeds, got):
            outcomes["checked"] += 1
    except BaseException as exc:
        print(json.dumps({"mutant": i, "seed model": i % len(seeds), "error": f"{type(exc).__name__}: {exc}"[:800]}))
        sys.exit(3)
outcomes["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
print(json.dumps(outcomes))
"""


def _fuzz(child: str, seed: int, count: int, *args: str) -> dict:
    """Run a fuzzing child over ``count`` mutants from ``seed`` under the memory limit; its outcome counts."""
    def limit_memory():
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (MEMORY_LIMIT, MEMORY_LIMIT))

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), POLYHAL_BACKENDS="cpu", POLYHAL_LOOP_LIMIT="1000")
    proc = subprocess.run([sys.executable, "-c", child, str(seed), str(count), *args], capture_output=True,
                          text=True, env=env, timeout=60 + 5 * count, preexec_fn=limit_memory)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, (f"POLYHAL_SEED={seed} POLYHAL_FUZZ={count}: child exited {proc.returncode} "
                                  f"(negative: killed by that signal): {last} {proc.stderr[-2000:]}")
    outcomes = json.loads(last)
    assert outcomes["ok"] + outcomes["polyhal"] == count
    assert outcomes["maxrss_mb"] < MEMORY_LIMIT >> 20
    return outcomes


def _count(default: int) -> int:
    """Mutations per fuzz test: ``POLYHAL_FUZZ``, else ``default``."""
    count = TestSettings.from_env().fuzz
    return default if count is None else count


def test_mutated_models_give_results_or_polyhal_errors(polyhal_seed):
    models = [os.path.join(ROOT, "examples", n) for n in ("mlp.onnx", "transformer_block.onnx")]
    _fuzz(CHILD, polyhal_seed, _count(40), *models)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="watches reads with Linux's inotify")
def test_mutated_model_folders_never_read_outside_and_run_right(tmp_path, polyhal_seed):
    # Models on disk with external data at every depth (If/Loop bodies, nested, Constant values,
    # a staged program, the examples), mutated in the proto and in the folder (locations, offsets,
    # lengths, truncated, missing or swapped files, links in and out): each ends in a polyhal
    # error or a run that onnx's reference evaluator agrees with, and no file outside the model's
    # folder is ever opened (the working directory holds files of the same names).
    examples = [os.path.join(ROOT, "examples", n) for n in ("mlp.onnx", "detection_postprocess.onnx")]
    _fuzz(DISK_CHILD, polyhal_seed, _count(24), str(tmp_path), *examples)
