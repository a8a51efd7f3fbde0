"""The front end stays linear in its input (issue 27, defect 6): junk model files are rejected in
about the time protobuf takes, buffer planning and naming grow no worse than n log n along a
chain, ``--input`` files are size-checked before they are decompressed, and the eager plan cache
is bounded."""

import gc
import os
import random
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import polyhal
import polyhal.onnx
from polyhal import eager
from polyhal.frontends.onnx.errors import OnnxInputError, OnnxModelError
from polyhal.frontends.onnx.run import read_inputs
from polyhal.frontends.onnx.wire import _varint_bytes
from polyhal.hal.flags import BufferUsage, MemoryType
from polyhal.passes.bufferize import PlannedBuffer, _align, _greedy, plan_offsets

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _cpu_seconds(fn) -> float:
    """CPU seconds ``fn()`` takes in this process (other processes on the machine do not count)."""
    gc.collect()
    t = time.process_time()
    fn()
    return time.process_time() - t


# -- junk model files -------------------------------------------------------------------------------

JUNK_BYTES = 64 << 20


@pytest.mark.parametrize("where", ["model", "graph"])
def test_a_64_mib_junk_file_is_rejected_in_about_protobufs_time(tmp_path, where):
    # Two-byte varint fields: a wire format that a field-by-field walk in Python follows for 32M
    # fields (15 s), at the model's level or inside its graph field.
    if where == "model":
        data = b"\x08\x01" * (JUNK_BYTES // 2)
    else:
        body = b"\x10\x01" * (JUNK_BYTES // 2 - 4)
        data = b"\x3a" + _varint_bytes(len(body)) + body
    path = tmp_path / "junk.onnx"
    path.write_bytes(data)

    def load():
        with pytest.raises(OnnxModelError, match="not an ONNX model"):
            polyhal.onnx.load(path)

    assert _cpu_seconds(load) < 2.0


def test_a_model_file_still_has_its_large_weights_read_straight_into_arrays(tmp_path):
    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
                              [onnx.numpy_helper.from_array(w, "w")])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    program = polyhal.onnx.load(path)
    (held,) = [a for _, a in program.constants if a.nbytes == w.nbytes]
    root = held
    while isinstance(root, np.ndarray) and root.base is not None:
        root = root.base
    assert isinstance(root, np.ndarray), "the weight was read through protobuf, not straight from the file"
    np.testing.assert_array_equal(held.reshape(64, 64), w)


# -- long chains --------------------------------------------------------------------------------------

def _chain(n: int) -> bytes:
    nodes = [helper.make_node("Add", ["x" if i == 0 else f"t{i - 1}", "y"], [f"t{i}" if i < n - 1 else "out"])
             for i in range(n)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info(v, TensorProto.FLOAT, [1, 16])
                                               for v in ("x", "y")],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 16])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _chain_buffers(n: int) -> list[PlannedBuffer]:
    """The intermediates of an n-op chain: each written by one op and read by the next."""
    return [PlannedBuffer(f"%t{i}", "cpu:0", 64, i, i + 1, MemoryType.DEVICE_LOCAL, BufferUsage.DEFAULT)
            for i in range(n)]


def test_buffer_planning_grows_no_worse_than_n_log_n():
    small = min(_cpu_seconds(lambda: plan_offsets(_chain_buffers(2000))) for _ in range(3))
    large = _cpu_seconds(lambda: plan_offsets(_chain_buffers(16000)))
    # 8x the buffers: ~9x the time at n log n, 64x when each buffer looks at every placed one.
    assert large / max(small, 1e-3) < 24, (small, large)


def test_a_chain_of_8000_adds_loads_compiles_and_runs_in_about_8x_the_time_of_1000():
    x = np.ones((1, 16), np.float32)

    def run(n):
        program = polyhal.onnx.load(_chain(n))
        out = program.execute(program.compile("cpu:0"), {"x": x, "y": x})
        np.testing.assert_array_equal(out["out"], x * (n + 1))

    run(1000)  # warm: the CPU kernels, the registry
    small = min(_cpu_seconds(lambda: run(1000)) for _ in range(2))
    large = _cpu_seconds(lambda: run(8000))
    assert large / small < 20, (small, large)  # linear: 8; on main (quadratic parts): > 30


def _scan_first_fit(buffers, tie):
    """The planner's rule written as the plain scan it replaced: largest first, each at the lowest
    aligned gap among the placed buffers live at a common op (O(n^2))."""
    placed, offsets, size = [], [0] * len(buffers), 0
    for i in sorted(range(len(buffers)), key=lambda i: (-buffers[i].nbytes, tie(buffers[i]))):
        b, offset = buffers[i], 0
        for p_offset, p_nbytes in sorted((o, n) for o, n, p in placed if p.overlaps(b)):
            if offset + b.nbytes <= p_offset:
                break
            offset = max(offset, _align(p_offset + p_nbytes, b.alignment))
        offsets[i] = offset
        placed.append((offset, b.nbytes, b))
        size = max(size, offset + b.nbytes)
    return size, offsets


def test_the_planner_places_every_buffer_where_the_first_fit_scan_did():
    rng = random.Random(0)
    ties = (lambda b: (b.first, b.name), lambda b: (b.first - b.last, b.first, b.name))
    for _ in range(200):
        ops = rng.randint(1, 50)
        buffers = []
        for k in range(rng.randint(0, 60)):
            first = rng.randrange(ops)
            last = min(ops - 1, first + rng.choice([0, 1, 2, rng.randrange(ops)]))
            buffers.append(PlannedBuffer(f"b{k}", "cpu:0", rng.choice([1, 256, 300, 4096, rng.randint(1, 9999)]),
                                         first, last, MemoryType.DEVICE_LOCAL, BufferUsage.DEFAULT,
                                         alignment=rng.choice([256, 4096])))
        for tie in ties:
            assert _greedy(buffers, tie) == _scan_first_fit(buffers, tie)
        size = plan_offsets(buffers)
        for a in buffers:
            assert a.offset + a.nbytes <= size
            for b in buffers:
                assert a is b or not a.overlaps(b) or a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset


# -- input files --------------------------------------------------------------------------------------

def _npy_header(shape: tuple[int, ...], descr: str = "<f4") -> bytes:
    text = repr({"descr": descr, "fortran_order": False, "shape": shape}).encode("latin1")
    pad = -(10 + len(text) + 1) % 64
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text) + pad + 1) + text + b" " * pad + b"\n"


#: zlib.crc32 of the bomb's member (its header, then 4 GiB of zeros): two seconds to compute.
_BOMB_CRC = 0xE69C0472


def _npz_bomb(path: Path) -> None:
    """A 4 MiB .npz whose one array, x (float32[2**30]), expands to 4 GiB: a ZIP64 member deflated
    from 16 MiB blocks of zeros (each one the same bytes after a full flush)."""
    header = _npy_header((1 << 30,))
    co = zlib.compressobj(9, zlib.DEFLATED, -15)
    start = co.compress(header) + co.flush(zlib.Z_FULL_FLUSH)
    block = co.compress(bytes(16 << 20)) + co.flush(zlib.Z_FULL_FLUSH)
    data = start + block * 256 + co.flush()
    size, name = len(header) + (4 << 30), b"x.npy"
    zip64 = struct.pack("<HHQQ", 1, 16, size, len(data))
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 45, 0, 8, 0, 0x21, _BOMB_CRC, 0xFFFFFFFF, 0xFFFFFFFF,
                        len(name), len(zip64)) + name + zip64
    central = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, 0, 8, 0, 0x21, _BOMB_CRC, 0xFFFFFFFF,
                          0xFFFFFFFF, len(name), len(zip64), 0, 0, 0, 0, 0) + name + zip64
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, len(central), len(local) + len(data), 0)
    path.write_bytes(local + data + central + end)


def test_an_npz_that_expands_past_the_input_limit_is_refused_before_it_is_decompressed(tmp_path, monkeypatch):
    bomb = tmp_path / "bomb.npz"
    _npz_bomb(bomb)
    assert bomb.stat().st_size < 8 << 20
    monkeypatch.setenv("POLYHAL_INPUT_LIMIT", "1GiB")
    with pytest.raises(OnnxInputError, match=r"expand to 4294967424 bytes, more than the input limit of 1073741824"):
        read_inputs([f"x={bomb}"])
    monkeypatch.setenv("POLYHAL_INPUT_LIMIT", "a lot")
    with pytest.raises(polyhal.ConfigError, match="POLYHAL_INPUT_LIMIT='a lot' is not a size"):
        read_inputs([f"x={bomb}"])


def test_inputs_under_the_limit_are_read_as_before(tmp_path, monkeypatch):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.savez_compressed(tmp_path / "in.npz", x=x, y=x + 1)
    np.save(tmp_path / "x.npy", x)
    monkeypatch.setenv("POLYHAL_INPUT_LIMIT", "1MiB")
    feeds = read_inputs([str(tmp_path / "in.npz"), f"z={tmp_path / 'x.npy'}"])
    np.testing.assert_array_equal(feeds["y"], x + 1)
    np.testing.assert_array_equal(feeds["z"], x)
    monkeypatch.setenv("POLYHAL_INPUT_LIMIT", "100")  # 2 x 48 B fit; a third file does not
    with pytest.raises(OnnxInputError, match="input limit of 100 bytes"):
        read_inputs([str(tmp_path / "in.npz"), f"z={tmp_path / 'x.npy'}"])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the memory limit is set in the child (resource)")
@pytest.mark.parametrize("kind", ["npz bomb", "forged npy"])
def test_an_oversized_input_file_is_one_cli_line_under_a_memory_limit(tmp_path, kind):
    import resource

    if kind == "npz bomb":
        path, spec = tmp_path / "bomb.npz", str(tmp_path / "bomb.npz")
        _npz_bomb(path)
        expect = "the input files expand to 4294967424 bytes, more than the input limit of 3221225472 bytes"
    else:
        path = tmp_path / "x.npy"
        path.write_bytes(_npy_header((1 << 40,)) + bytes(64))  # numpy would allocate 4 TiB first
        spec = f"x={path}"
        expect = "declares a float32[1099511627776] array of 4398046511104 bytes, but only 64 bytes"
    env = {k: v for k, v in os.environ.items() if k != "POLYHAL_INPUT_LIMIT"}
    result = subprocess.run(  # the default limit follows the process's own (as `ulimit -v 3145728`)
        [sys.executable, "-m", "polyhal.cli", "run", str(EXAMPLES / "mlp.onnx"), "--input", spec],
        capture_output=True, text=True, timeout=120, env=env,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (3 << 30, resource.RLIM_INFINITY)))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert expect in lines[0]


# -- the eager plan cache -----------------------------------------------------------------------------

def test_the_eager_plan_cache_keeps_the_most_recently_used_plans(monkeypatch):
    monkeypatch.setattr(eager, "CACHE_SIZE", 4)
    eager._cache.clear()
    before = eager.cache_info()
    ones = [np.ones(n, np.float32) for n in range(1, 11)]
    for a in ones:
        eager.add(a, a)
        np.testing.assert_array_equal(eager.add(ones[0], ones[0]).numpy(), [2.0])  # keeps n=1 recent
    info = eager.cache_info()
    assert info.size == info.maxsize == 4
    assert info.misses - before.misses == 10 and info.evictions - before.evictions == 6
    assert info.hits - before.hits == 10
    assert any(key[2][0].shape == (1,) for key in eager._cache)
    eager._cache.clear()
