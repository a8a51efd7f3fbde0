"""Reliability: bounded memory on tiny inputs, a polyhal error for every failure (one line and exit
status 2 from the CLI), buffer lifetimes that DLPack consumers and released tensors cannot break,
and fault injection through every path that allocates."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import tracemalloc

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import polyhal
import polyhal.eager
from polyhal.cli import main
from polyhal.errors import (ArithmeticDomainError, DLPackError, IncompatibleBufferError, LifetimeError,
                            OutOfMemoryError, PolyhalError)
from polyhal.frontends.onnx.errors import OnnxInputError, OnnxModelError, OnnxUnsupportedError
from polyhal.frontends.onnx.importer import load
from polyhal.hal.adaptors import AllocatorAdaptor, FaultInjectionAdaptor, parse_adaptor_spec, set_device_allocator
from polyhal.hal.flags import MemoryType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP = os.path.join(ROOT, "examples", "mlp.onnx")


def _model(nodes, inputs=(), outputs=(), initializers=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _fill_then_sum(n: int) -> onnx.ModelProto:
    """ConstantOfShape([n]) -> ReduceSum: 160 bytes that describe n floats."""
    shape = helper.make_node("Constant", [], ["s"], value=numpy_helper.from_array(np.array([n], np.int64)))
    fill = helper.make_node("ConstantOfShape", ["s"], ["c"], value=numpy_helper.from_array(np.ones(1, np.float32)))
    return _model([shape, fill, helper.make_node("ReduceSum", ["c"], ["y"], keepdims=0)],
                  outputs=[helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])


def _live(device_name: str = "cpu:0") -> int:
    return polyhal.get_device(device_name).allocator.statistics.live_bytes


# ---------------------------------------------------------------------------------- bounded memory

def test_folding_a_huge_fill_stays_in_the_program_and_takes_no_memory():
    tracemalloc.start()
    try:
        program = load(_fill_then_sum(1 << 29))  # 2 GiB if folded
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"import took {peak} bytes"
    assert [op.name for op in program.ops] == ["expand", "reduce_sum"]


def test_fold_limit_from_the_load_option_and_the_environment(monkeypatch):
    model = _fill_then_sum(1 << 12)  # 16 KiB of float32
    assert [op.name for op in load(model).ops] == ["identity"]  # folded: the output is a copy of a constant
    kept = load(model, fold_limit="4KiB")
    assert [op.name for op in kept.ops] == ["expand", "reduce_sum"]
    assert kept.run({})["y"] == 4096
    monkeypatch.setenv("POLYHAL_FOLD_LIMIT", "1024")
    assert [op.name for op in load(model).ops] == ["expand", "reduce_sum"]
    monkeypatch.setenv("POLYHAL_FOLD_LIMIT", "lots")
    with pytest.raises(polyhal.ConfigError, match="POLYHAL_FOLD_LIMIT='lots' is not a size in bytes"):
        load(model)


def test_a_range_beyond_the_fold_limit_is_refused():
    consts = [helper.make_node("Constant", [], [n], value=numpy_helper.from_array(np.array(v, np.int64)))
              for n, v in (("a", 0), ("b", 1 << 40), ("d", 1))]
    model = _model(consts + [helper.make_node("Range", ["a", "b", "d"], ["y"])],
                   outputs=[helper.make_tensor_value_info("y", TensorProto.INT64, [None])])
    with pytest.raises(OnnxUnsupportedError, match="fold limit"):
        load(model)


def test_an_arena_beyond_available_memory_fails_fast_naming_plan_and_value():
    b = polyhal.ProgramBuilder("huge")
    x = b.input("x", (), "float32")
    b.output(b.op("reduce_sum", b.op("expand", x, shape=[1 << 40]), axes=[0]))  # 4 TiB intermediate
    before = _live()
    with pytest.raises(OutOfMemoryError, match=r"plan 'huge' .*%expand"):
        polyhal.compile(b.build(), "cpu:0")
    assert _live() == before


def test_random_inputs_are_drawn_in_their_dtype_in_chunks():
    from polyhal.frontends.onnx.run import RANDOM_CHUNK, random_input

    rng = np.random.default_rng(0)
    tracemalloc.start()
    try:
        x = random_input(rng, (4, RANDOM_CHUNK), np.float16)  # 8 MiB; a float64 draw of it would be 32 MiB
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert x.dtype == np.float16 and x.shape == (4, RANDOM_CHUNK) and np.isfinite(x).all() and x.astype(np.float32).std() > 0.5
    assert peak < x.nbytes + 3 * 4 * RANDOM_CHUNK, peak
    for dt in (np.int8, np.uint16, np.int64, np.bool_, np.float64):
        assert random_input(rng, (3, 5), dt).dtype == dt


# ------------------------------------------------------------------------------- the CLI: one line, exit 2

@pytest.mark.parametrize("argv, message", [
    (["run", MLP, "--shape", "x=4,abc"], "--shape x=4,abc"),
    (["run", MLP, "--dim", "batch=many"], "--dim batch=many"),
    (["run", MLP, "--dim", "nosuchdim=4"], "no symbolic dim 'nosuchdim'; their symbolic dims are batch"),
    (["run", MLP, "--output", "/proc/polyhal-out"], "--output /proc/polyhal-out"),
    (["run", MLP, "--dim", "batch=100000000000000"], "random inputs .* more than"),
    (["demo", "--repeat", "0"], "--repeat"),
])
def test_cli_usage_errors_print_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("polyhal: error: "), err
    assert __import__("re").search(message, err), err


def test_cli_output_closed_early_is_not_a_traceback():
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line: every write gets EPIPE
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-m", "polyhal.cli", "devices"], stdout=write, stderr=subprocess.PIPE,
                          env=env, timeout=120)
    os.close(write)
    assert b"Traceback" not in proc.stderr and b"BrokenPipe" not in proc.stderr, proc.stderr.decode()
    assert proc.returncode == 0


# ---------------------------------------------------------------------------------- polyhal errors

def test_external_data_outside_the_model_directory_is_a_model_error(tmp_path):
    w = numpy_helper.from_array(np.ones(4, np.float32), "w")
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    entry = w.external_data.add()
    entry.key, entry.value = "location", "../../etc/passwd"
    model = _model([helper.make_node("Identity", ["w"], ["y"])],
                   outputs=[helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], initializers=[w])
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(OnnxModelError, match="points outside"):
        load(str(path))


class _BackendOutOfMemory(AllocatorAdaptor):
    """Stands for a backend whose native allocation raises a plain MemoryError after the first."""

    def __init__(self, upstream):
        super().__init__(upstream)
        self.calls = 0

    def _allocate(self, heap, nbytes):
        self.calls += 1
        if self.calls > 1:
            raise MemoryError("native allocation failed")
        return super()._allocate(heap, nbytes)


def test_the_adaptor_fast_path_turns_memory_error_into_out_of_memory():
    dev = polyhal.get_device("cpu:0")
    adaptor = _BackendOutOfMemory(dev.allocator)
    first = adaptor.allocate(64)  # validates and memoizes the flags: the next call takes the fast path
    with pytest.raises(OutOfMemoryError, match="native allocation failed"):
        adaptor.allocate(64)
    with pytest.raises(OutOfMemoryError):
        adaptor.allocate_raw(dev.allocator.heaps[0], 64)
    first.release()


@pytest.mark.parametrize("memory_type", [1 << 9, MemoryType.DEVICE_LOCAL | (1 << 12)])
def test_undefined_memory_type_bits_are_refused(memory_type):
    with pytest.raises(IncompatibleBufferError, match="does not define"):
        polyhal.get_device("cpu:0").allocator.allocate(64, memory_type)


def test_negative_stride_dlpack_import_is_a_dlpack_error():
    before = _live()
    with pytest.raises(DLPackError, match="negative strides"):
        polyhal.from_dlpack(np.arange(8, dtype=np.float32)[::-1])
    assert _live() == before


def test_integer_division_by_zero_is_refused_on_the_cpu_as_onnxruntime_does():
    div = _model([helper.make_node("Div", ["a", "b"], ["y"])],
                 [helper.make_tensor_value_info(n, TensorProto.INT64, [3]) for n in "ab"],
                 [helper.make_tensor_value_info("y", TensorProto.INT64, [3])])
    program = load(div)
    a = np.array([7, -7, 1], np.int64)
    np.testing.assert_array_equal(program.run({"a": a, "b": np.array([2, 2, -1])}, "cpu:0")["y"], [3, -3, -1])
    with pytest.raises(ArithmeticDomainError, match="division by zero"):
        program.run({"a": a, "b": np.array([2, 0, 1])}, "cpu:0")
    with pytest.raises(ArithmeticDomainError, match="division by zero"):  # folded at import: refused there
        load(div, values={"a": a, "b": np.array([2, 0, 1])})


# ---------------------------------------------------------------------------------- lifetimes

def _negate_plan(device="cpu:0"):
    b = polyhal.ProgramBuilder("negate")
    b.output(b.neg(b.input("x", (4,), "float32")))
    return polyhal.compile(b.build(), device)


def test_read_only_imports_cannot_be_written_through_out():
    frozen = np.arange(4, dtype=np.float32)
    frozen.flags.writeable = False
    target = polyhal.from_dlpack(frozen)
    assert target.readonly
    with pytest.raises(LifetimeError, match="read-only"):
        _negate_plan()(np.ones(4, np.float32), out=target)
    np.testing.assert_array_equal(frozen, np.arange(4))
    with pytest.raises(ValueError):
        target.numpy()[0] = 5


def test_released_tensors_cannot_be_used():
    t = polyhal.asarray(np.ones(4, np.float32), device="cpu:0")
    t.release()
    with pytest.raises(LifetimeError, match="released"):
        polyhal.eager.neg(t)
    with pytest.raises(LifetimeError, match="released"):
        _negate_plan()(t)
    with pytest.raises(LifetimeError, match="released"):
        _negate_plan()(np.ones(4, np.float32), out=t)
    with pytest.raises(LifetimeError, match="released"):
        t.__dlpack__()


def test_an_exported_buffer_lives_and_counts_while_a_consumer_holds_it(device_name):  # every device
    before = _live(device_name)
    t = polyhal.asarray(np.arange(1024, dtype=np.float32), device=device_name)
    capsule = t.__dlpack__(max_version=(1, 0))
    consumer = np.from_dlpack(t) if t.__dlpack_device__()[0] == 1 else None
    t.release()
    assert t.buffer.released
    assert _live(device_name) - before == 4096  # still allocated, still counted
    if consumer is not None:
        np.testing.assert_array_equal(consumer, np.arange(1024))
    del capsule, consumer
    gc.collect()
    assert _live(device_name) == before


# ---------------------------------------------------------------------------------- fault injection

def test_fault_injection_adaptor_filters_and_counts():
    dev = polyhal.get_device("cpu:0")
    fault = FaultInjectionAdaptor(dev.allocator, 3, min_bytes=100)
    small = [fault.allocate(64) for _ in range(5)]  # below min_bytes: never fail
    big = []
    for i in range(6):
        try:
            big.append(fault.allocate(128))
        except OutOfMemoryError as exc:
            assert "injected" in str(exc)
    assert len(big) == 4 and fault.injected == 2
    (maker,) = parse_adaptor_spec("fault=2")
    assert maker(dev.allocator).every == 2
    with pytest.raises(PolyhalError, match="fault"):
        parse_adaptor_spec("fault=0")
    del small, big


def _each_path(device_name: str) -> None:
    """Compile and run a plan with intermediates, run eager ops and import/export through DLPack."""
    rng = np.random.default_rng(0)
    b = polyhal.ProgramBuilder("mlp")
    x, w = b.input("x", (8, 16)), b.input("w", (16, 16))
    h = b.relu(b.add(b.matmul(x, w), x))
    b.output(b.mul(h, h), h)
    plan = polyhal.compile(b.build(), device_name)
    xs, ws = rng.standard_normal((8, 16), np.float32), rng.standard_normal((16, 16), np.float32)
    out, hidden = plan(xs, ws)
    np.testing.assert_allclose(hidden.numpy(), np.maximum(xs @ ws + xs, 0), rtol=1e-4, atol=1e-4)
    t = polyhal.asarray(xs, device=device_name)
    y = polyhal.eager.add(t, t)
    np.testing.assert_allclose(polyhal.from_dlpack(y).numpy(), 2 * xs)
    plan.run_numpy(xs, ws)


def test_every_allocation_failing_in_turn_leaves_nothing_behind(device_name):  # every device
    dev = polyhal.get_device(device_name)
    polyhal.eager._cache.clear()
    before = _live(device_name)
    failures = 0
    for every in range(1, 12):
        fault = FaultInjectionAdaptor(dev.allocator, every)
        previous = set_device_allocator(dev, fault)
        try:
            _each_path(device_name)
        except PolyhalError:
            failures += 1
        finally:
            set_device_allocator(dev, previous)
            polyhal.eager._cache.clear()  # cached eager plans hold intermediates
        gc.collect()
        assert _live(device_name) == before, f"every={every}: {_live(device_name) - before} bytes left live"
    assert failures >= 5  # the early counts fail somewhere on every path
