"""Allocator adaptors (RMM-style): caching pool, statistics, limit, logging; swapping them at run
time with live buffers; the wrap_allocator hook and POLYHAL_ALLOCATOR."""

from __future__ import annotations

import csv
import gc
import logging
import threading

import numpy as np
import pytest

import polyhal
from polyhal import BufferUsage, Heap, MemoryType
from polyhal.hal.adaptors import (
    AllocatorAdaptor, CachingPoolAdaptor, LimitingAdaptor, LoggingAdaptor, MemoryTypeRouter, StatisticsAdaptor,
    adaptor_chain, get_device_allocator, parse_adaptor_spec, parse_size, raw_allocate, raw_deallocate,
    set_device_allocator,
)

MiB = 1 << 20


@pytest.fixture
def dev(fresh_registry, monkeypatch):
    """A fresh cpu:0 whose allocator nobody else has touched."""
    monkeypatch.delenv("POLYHAL_ALLOCATOR", raising=False)
    reg = fresh_registry(POLYHAL_BACKENDS="cpu", POLYHAL_CPU_DEVICES="1")
    return reg.get_device("cpu:0")


def _live(allocator):
    return allocator.statistics.live_bytes, allocator.statistics.live_count


def test_pool_reuses_blocks_and_every_layer_balances(dev):
    base = dev.allocator
    pool = CachingPoolAdaptor(base)
    a = pool.allocate(MiB)
    addr = dev.buffer_address(a)
    a.release()
    assert _live(pool) == (0, 0) and pool.cached_bytes == MiB and _live(base) == (MiB, 1)
    b = pool.allocate(MiB - 100)  # same 512-byte size class: the same block
    assert dev.buffer_address(b) == addr and b.nbytes == MiB - 100
    assert pool.cache_hits == 1 and pool.cache_misses == 1 and _live(pool) == (MiB - 100, 1)
    b.map()[:] = 7  # it is ordinary memory of the device
    t = polyhal.Tensor(b, polyhal.TensorType((16,), "uint8"))
    assert t.numpy()[0] == 7
    b.release()
    assert pool.release_cached() == MiB and pool.cached_bytes == 0 and _live(base) == (0, 0)
    s = pool.statistics.by_memory_type[base.heaps[0].memory_type]
    assert (s.total_allocations, s.total_frees, s.peak_bytes) == (2, 2, MiB)


def test_pool_raw_interface_is_rmm_like(dev):
    base = dev.allocator
    heap = base.heaps[0]
    pool = CachingPoolAdaptor(base, granularity=256)
    p1 = pool.allocate_raw(heap, 1000)
    assert len(p1) == 1024 and _live(base) == (1024, 1)
    pool.deallocate_raw(heap, 1000, p1)
    assert pool.allocate_raw(heap, 1010) is p1
    pool.deallocate_raw(heap, 1010, p1)
    # raw_allocate works on any allocator, adaptor or not
    n = raw_allocate(base, heap, 64)
    raw_deallocate(base, heap, 64, n)
    with pytest.raises(ValueError, match="power of two"):
        CachingPoolAdaptor(base, granularity=300)


def test_pool_cap_and_release_on_upstream_out_of_memory(dev):
    limit = LimitingAdaptor(dev.allocator, limit=3 * 1024)
    pool = CachingPoolAdaptor(limit, granularity=1024, max_cached_bytes=2048)
    bufs = [pool.allocate(1024) for _ in range(3)]
    for b in bufs:
        b.release()
    assert pool.cached_bytes == 2048 and limit.used_bytes == 2048  # the third went upstream
    # 2 KiB is cached in 1 KiB blocks; a 3 KiB request needs them back upstream first.
    big = pool.allocate(3 * 1024)
    assert pool.cached_bytes == 0 and limit.used_bytes == 3 * 1024
    big.release()


def test_pool_is_thread_safe(dev):
    base = dev.allocator
    heap = base.heaps[0]
    pool = CachingPoolAdaptor(base)
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(300):
                sizes = rng.integers(1, 5000, 4).tolist()
                raws = [(s, pool.allocate_raw(heap, s)) for s in sizes]
                bufs = [pool.allocate(s) for s in sizes]
                for s, n in raws:
                    pool.deallocate_raw(heap, s, n)
                for b in bufs:
                    b.release()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = pool.statistics.by_memory_type[heap.memory_type]
    assert (s.live_bytes, s.live_count) == (0, 0) and s.total_allocations == s.total_frees == 8 * 300 * 8
    assert _live(base)[0] == pool.cached_bytes
    pool.release_cached()
    assert _live(base) == (0, 0)


def test_limit_names_device_request_and_use(dev):
    lim = LimitingAdaptor(dev.allocator, limit=MiB)
    keep = lim.allocate(MiB - 10)
    with pytest.raises(polyhal.OutOfMemoryError) as exc:
        lim.allocate(100, MemoryType.DEVICE_LOCAL)
    msg = str(exc.value)
    assert "cpu:0" in msg and "request for 100 bytes" in msg and f"limit of {MiB} bytes" in msg
    assert f"in use: {MiB - 10} bytes" in msg
    assert isinstance(exc.value, MemoryError)
    keep.release()
    lim.allocate(100).release()
    assert lim.used_bytes == 0
    with pytest.raises(ValueError):
        LimitingAdaptor(dev.allocator, limit=-1)


def test_statistics_counters_and_scopes(dev):
    stats = StatisticsAdaptor(dev.allocator)
    a = stats.allocate(100)
    b = stats.allocate(300)
    a.release()
    c = stats.counters
    assert (c.current_bytes, c.peak_bytes, c.total_bytes, c.current_count, c.peak_count, c.total_count) == \
        (300, 400, 400, 1, 2, 2)
    stats.push_counters()
    d = stats.allocate(1000)
    d.release()
    inner = stats.pop_counters()
    assert (inner.current_bytes, inner.peak_bytes, inner.total_count) == (0, 1000, 1)
    outer = stats.counters
    assert outer.peak_bytes == 1300 and outer.total_count == 3
    b.release()
    with pytest.raises(RuntimeError):
        stats.pop_counters()


def test_logging_writes_csv(dev, tmp_path, caplog):
    path = tmp_path / "alloc.csv"
    log = LoggingAdaptor(dev.allocator, path)
    buf = log.allocate(4096)
    addr = dev.buffer_address(buf)
    buf.release()
    log.close()
    rows = list(csv.reader(path.open()))
    assert rows[0] == list(LoggingAdaptor.HEADER)
    assert [r[2] for r in rows[1:]] == ["allocate", "free"]
    assert rows[1][3] == "cpu:0" and rows[1][5] == "4096" and int(rows[1][6], 16) == addr
    with caplog.at_level(logging.DEBUG, logger="polyhal.allocations"):
        LoggingAdaptor(dev.allocator).allocate(8).release()
    assert sum("allocate" in r.message or ",free," in r.message for r in caplog.records) == 2


def test_swap_at_run_time_with_live_buffers(dev):
    base = get_device_allocator(dev)
    old = polyhal.empty((256,), "float32", dev)  # made by the base allocator
    pool = CachingPoolAdaptor(base)
    stack = StatisticsAdaptor(pool)
    assert set_device_allocator(dev, stack) is base
    new = polyhal.empty((256,), "float32", dev)
    assert new.buffer.allocator is stack and old.buffer.allocator is base
    assert adaptor_chain(dev.allocator) == [stack, pool, base]
    assert set_device_allocator(dev, base) is stack  # swap back while `new` is alive
    new.release()  # returns to the stack that made it, and into the pool
    assert stack.counters.current_bytes == 0 and pool.cached_bytes == 1024
    old.release()
    del new, stack
    gc.collect()
    assert _live(base) == (1024, 1)  # the pool still holds its block...
    del pool
    gc.collect()
    assert _live(base) == (0, 0)  # ...until it is collected, when it gives it back


def test_set_device_allocator_checks_its_argument(dev, fresh_registry):
    with pytest.raises(TypeError):
        set_device_allocator(dev, object())
    other = fresh_registry(POLYHAL_BACKENDS="cpu", POLYHAL_CPU_DEVICES="2").get_device("cpu:1")
    with pytest.raises(ValueError, match="cpu:1, not cpu:0"):
        set_device_allocator(dev, CachingPoolAdaptor(other.allocator))
    with pytest.raises(TypeError):
        AllocatorAdaptor("not an allocator")


def test_adaptors_keep_the_allocator_contract(dev):
    pool = CachingPoolAdaptor(dev.allocator)
    with pytest.raises(polyhal.IncompatibleBufferError, match="positive"):
        pool.allocate(0)
    with pytest.raises(polyhal.IncompatibleBufferError, match="int number of bytes"):
        pool.allocate(1.5)
    with pytest.raises(polyhal.IncompatibleBufferError, match="cannot allocate"):
        pool.allocate(8, MemoryType.HOST_VISIBLE, BufferUsage.DISPATCH_IMAGE_READ)
    assert pool.query_buffer_compatibility(MemoryType.HOST_VISIBLE)
    with pool.allocate(8, MemoryType.HOST_VISIBLE, BufferUsage.MAPPING) as buf:
        assert buf.usage & BufferUsage.MAPPING


# -- the wrap_allocator hook and POLYHAL_ALLOCATOR ------------------------------------------------------------

class TwoHeaps:
    """A backend with one device of two heaps (host-visible, device-local only)."""

    @polyhal.hookimpl
    def register_devices(self):
        from polyhal_cpu.allocator import host_heap
        from polyhal_cpu.device import CPUDevice

        local = Heap(MemoryType.DEVICE_LOCAL, BufferUsage.DEFAULT, 1 << 30)
        return [polyhal.DeviceSpec(name="two:0", backend="two", rank=1, factory=CPUDevice, heaps=(local, host_heap()))]


def test_wrap_allocator_hook_per_memory_type(fresh_registry, monkeypatch):
    monkeypatch.delenv("POLYHAL_ALLOCATOR", raising=False)
    reg = fresh_registry(POLYHAL_BACKENDS="cpu")
    seen = []

    class PoolDeviceLocal:
        @polyhal.hookimpl
        def wrap_allocator(self, device, memory_type, allocator):
            seen.append((device.name, memory_type))
            if memory_type == MemoryType.DEVICE_LOCAL:
                return CachingPoolAdaptor(allocator)
            return None

    class Outer:
        @polyhal.hookimpl
        def wrap_allocator(self, device, memory_type, allocator):
            if device.name == "two:0" and memory_type == MemoryType.DEVICE_LOCAL:
                assert isinstance(allocator, CachingPoolAdaptor)  # earlier plugins wrap first
                return StatisticsAdaptor(allocator)
            return None

    reg.register(TwoHeaps(), name="two")
    reg.register(PoolDeviceLocal(), name="pool-dl")
    reg.register(Outer(), name="outer")
    dev = reg.get_device("two:0")
    assert isinstance(dev.allocator, MemoryTypeRouter)
    stats = dev.allocator.route(MemoryType.DEVICE_LOCAL)
    assert isinstance(stats, StatisticsAdaptor) and isinstance(stats.upstream, CachingPoolAdaptor)
    with dev.allocator.allocate(4096, MemoryType.DEVICE_LOCAL) as buf:
        assert buf.heap.memory_type == MemoryType.DEVICE_LOCAL and stats.counters.current_bytes == 4096
    assert stats.upstream.cached_bytes == 4096
    dev.allocator.allocate(64, MemoryType.HOST_VISIBLE).release()
    assert stats.counters.total_count == 1  # host-visible memory is not routed through it
    cpu = reg.get_device("cpu:0")
    assert type(cpu.allocator).__name__ == "CPUAllocator"  # its single heap is HOST_LOCAL|DEVICE_LOCAL...
    assert ("cpu:0", cpu.allocator.heaps[0].memory_type) in seen


def test_wrap_allocator_bad_answers_name_the_plugin(fresh_registry, monkeypatch):
    monkeypatch.delenv("POLYHAL_ALLOCATOR", raising=False)
    reg = fresh_registry(POLYHAL_BACKENDS="cpu")

    class Bad:
        @polyhal.hookimpl
        def wrap_allocator(self, device, memory_type, allocator):
            return "a pool"

    reg.register(Bad(), name="badwrap")
    with pytest.warns(RuntimeWarning, match="badwrap.*must return an Allocator.*skipped"):
        dev = reg.get_device("cpu:0")  # skipped: the device keeps its own allocator
    assert not isinstance(dev.allocator, AllocatorAdaptor)

    class Raises:
        @polyhal.hookimpl
        def wrap_allocator(self, device, memory_type, allocator):
            raise RuntimeError("no pools today")

    reg = fresh_registry(POLYHAL_BACKENDS="cpu")
    reg.register(Raises(), name="raiser")
    with pytest.warns(RuntimeWarning, match="raiser.*no pools today.*skipped"):
        dev = reg.get_device("cpu:0")
    assert not isinstance(dev.allocator, AllocatorAdaptor)
    assert {(f.plugin, f.stage) for f in reg.failures} == {("raiser", "wrap_allocator")}


def test_polyhal_allocator_env(fresh_registry, monkeypatch):
    monkeypatch.setenv("POLYHAL_ALLOCATOR", "pool, limit=1MiB, stats")
    reg = fresh_registry(POLYHAL_BACKENDS="cpu")
    dev = reg.get_device("cpu:0")
    kinds = [type(a).__name__ for a in adaptor_chain(dev.allocator)]
    assert kinds == ["StatisticsAdaptor", "LimitingAdaptor", "CachingPoolAdaptor", "CPUAllocator"]
    with pytest.raises(polyhal.OutOfMemoryError, match="limit of 1048576"):
        polyhal.empty((MiB,), "float32", dev)
    x = polyhal.asarray(np.arange(10, dtype=np.float32), device=dev)
    assert x.numpy()[3] == 3 and x.buffer.allocator is dev.allocator


@pytest.mark.parametrize("spec,match", [("pool,bogus", "unknown adaptor 'bogus'"), ("limit", "limit needs a size"),
                                        ("limit=lots", "not a size")])
def test_polyhal_allocator_env_errors(spec, match):
    with pytest.raises(polyhal.PluginError, match=match):
        parse_adaptor_spec(spec)


def test_parse_size():
    assert parse_size("4096") == 4096 and parse_size("512MiB") == 512 * MiB and parse_size("1g") == 1 << 30
    assert parse_size("1.5k") == 1536 and parse_size("2GB") == 2 * 10**9


def test_a_plan_whose_arena_exceeds_the_limit_names_the_plan_and_what_it_holds(dev, tmp_path):
    import onnx
    from onnx import TensorProto, helper

    import polyhal.onnx

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [512, 1024])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [512, 1024])
    graph = helper.make_graph([helper.make_node("Exp", ["x"], ["e"], name="big_exp"),
                               helper.make_node("Neg", ["e"], ["n"]), helper.make_node("Relu", ["n"], ["y"])],
                              "g", [x], [y])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    program = polyhal.onnx.load(str(path))
    base = dev.allocator
    lim = LimitingAdaptor(base, limit=MiB)  # the two 2 MiB intermediates do not fit
    previous = set_device_allocator(dev, lim)
    try:
        with pytest.raises(polyhal.OutOfMemoryError) as exc:
            program.compile("cpu:0")
        msg = str(exc.value)
        assert "could not allocate its" in msg and "arena" in msg and "%e" in msg and f"limit of {MiB} bytes" in msg
        del exc
        assert lim.used_bytes == 0  # nothing of the failed plan stays allocated
    finally:
        set_device_allocator(dev, previous)
    plan = program.compile("cpu:0")  # the same program compiles once the memory is there
    data = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(plan(x=data)), np.maximum(-np.exp(data), 0))
