"""Thread stress: many threads on one plan and on one caching pool, with the interpreter switching
threads every microsecond so that an unguarded interleaving shows up within a few runs.

A plan binds inputs and outputs into one slot table, so unserialised calls would compute one
thread's outputs from another's inputs; the pool's lock-free hit path must neither lose blocks nor
miscount them.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

import polyhal
from polyhal.hal.adaptors import CachingPoolAdaptor

THREADS, RUNS = 8, 150


@pytest.fixture
def fast_switching():
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(previous)


def _hammer(work) -> list[BaseException]:
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def run(k: int) -> None:
        start.wait()
        try:
            work(k)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_one_plan_called_from_many_threads_gives_each_its_own_result(device_name, fast_switching):
    lacking = {"add", "mul", "sub"} - polyhal.get_device(device_name).kernel_names
    if lacking:
        pytest.skip(f"{device_name} has no kernel for {', '.join(sorted(lacking))}")
    b = polyhal.ProgramBuilder("chain")
    x = b.input("x", (16, 16))
    h = b.add(b.mul(x, x), x)  # intermediates in the plan's arena, shared by every call
    b.output(b.sub(h, b.mul(x, x)))  # == x
    plan = polyhal.compile(b.build(), device_name)

    def work(k: int) -> None:
        for i in range(RUNS):
            xs = np.full((16, 16), k * 16 + i % 16, np.float32)  # small: x * x + x - x * x is exact
            got = plan(xs).numpy()
            assert np.array_equal(got, xs), f"thread {k} run {i} got another thread's result {got[0, 0]}"

    errors = _hammer(work)
    assert not errors, errors[0]


def test_a_caching_pool_shared_by_threads_balances(fast_switching):
    dev = polyhal.get_device("cpu:0")
    pool = CachingPoolAdaptor(dev.allocator)

    def work(k: int) -> None:
        held = []
        for i in range(RUNS):
            held.append(pool.allocate(512 * (1 + (k + i) % 4)))
            if len(held) > 3:
                held.pop(0).release()
        for buf in held:
            buf.release()

    errors = _hammer(work)
    assert not errors, errors[0]
    stats = pool.statistics
    assert stats.live_bytes == 0 and stats.live_count == 0
    total = sum(s.total_allocations for s in stats.by_memory_type.values())
    assert total == THREADS * RUNS == sum(s.total_frees for s in stats.by_memory_type.values())
    pool.release_cached()
    assert pool.cached_bytes == 0
