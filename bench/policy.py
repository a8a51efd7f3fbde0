"""Device policy and allocator adaptors: the cost of a memoized decision, of computing one per
built-in policy, hook calls of a plan after its first run, and the caching pool against numpy.

Targets (device-policy issue): a memoized decision at most 0.2 µs; a plan with 100 allocations
per run makes zero ``select_allocator`` calls after the first run; the caching pool's
allocate+free of 1 MiB at most 1 µs on the CPU backend (anchor: ``np.empty`` of 1 MiB).
"""

from __future__ import annotations

import os
from unittest.mock import patch

import numpy as np

import polyhal
from bench.harness import Row, median_time
from polyhal.hal.adaptors import CachingPoolAdaptor, raw_allocate, raw_deallocate
from polyhal.hal.flags import BufferUsage, MemoryType
from polyhal.policies.context import BUILTIN_POLICIES, Workload, configure_policy
from polyhal.policy import AllocatorSelector
from polyhal.registry import Registry

MiB = 1 << 20
ALLOCATIONS = 100


class _CountCalls:
    """A policy plugin that only counts how often select_allocator is called (and defers)."""

    def __init__(self) -> None:
        self.calls = 0

    @polyhal.hookimpl
    def select_allocator(self, candidates, memory_type, buffer_usage, flags):
        self.calls += 1
        return None


def run(args) -> list[Row]:
    repeat = 5 if args.quick else 30
    rows: list[Row] = []
    with patch.dict(os.environ, POLYHAL_CPU_DEVICES="2"):  # two logical devices: every decision has a choice
        reg = Registry()
        rows += _decisions(reg, repeat)
        rows += _plan_hook_calls(reg, repeat)
        rows += _pool(reg.get_device("cpu:0"), repeat)
    return rows


def _decisions(reg: Registry, repeat: int) -> list[Row]:
    sel = AllocatorSelector(reg)
    cands = tuple((s, -1) for s in reg.device_specs() if s.backend == "cpu")
    mt, usage = MemoryType.DEVICE_LOCAL, BufferUsage.DEFAULT
    hook = reg.pm.hook.select_allocator
    t_hook = median_time(lambda: hook(candidates=cands, memory_type=mt, buffer_usage=usage, flags=0),
                         repeat=repeat, number=2000)
    site = sel.site(cands, mt, usage, 0)
    assert site.decision.index == 0
    t_site = median_time(lambda: site.decision, repeat=repeat, number=20000)
    rows = [Row("memoized decision (allocation site)", "µs", t_site * 1e6, t_hook * 1e6, "pluggy hook call",
                "<= 0.2 µs", t_site * 1e6 <= 0.2, {"hits": sel.hits, "misses": sel.misses})]
    t_key = median_time(lambda: sel.select(cands, mt, usage, 0), repeat=repeat, number=20000)
    rows.append(Row("memoized decision (selector.select key lookup)", "µs", t_key * 1e6, t_hook * 1e6,
                    "pluggy hook call"))
    # Computing a decision (a memo miss): the user plugins, then the active built-in.
    x = polyhal.TensorType((64, 256), "float32")
    work = Workload("matmul", (x, polyhal.TensorType((256, 256), "float32")), (x,), (), ("cpu:1", None))
    for name in BUILTIN_POLICIES:
        configure_policy(reg, policy=name)

        def compute():
            sel.clear()
            sel.select(cands, mt, usage, 0, devices=("cpu:0", "cpu:1"), workload=work)

        t = median_time(compute, repeat=repeat, number=200)
        rows.append(Row(f"decision computed by the {name!r} policy (memo miss)", "µs", t * 1e6, t_hook * 1e6,
                        "pluggy hook call"))
    configure_policy(reg, policy="first")
    return rows


def _plan_hook_calls(reg: Registry, repeat: int) -> list[Row]:
    counter = _CountCalls()
    reg.register(counter, name="bench-count")
    try:
        b = polyhal.ProgramBuilder("many_allocations")
        x = b.input("x", (16,))
        # 100 results, each an allocation whose op may live on either device.
        b.output(*[b.op("exp", x, affinity=polyhal.Optimal("cpu:0", "cpu:1")) for _ in range(ALLOCATIONS)])
        plan = polyhal.compile(b.build(), ["cpu:0", "cpu:1"], registry=reg)
        at_compile = counter.calls
        xs = np.ones(16, np.float32)
        plan(xs)  # the first run
        after_first = counter.calls
        runs = 10 if repeat <= 5 else 50
        for _ in range(runs):
            plan(xs)
        per_run = (counter.calls - after_first) / runs
        t_run = median_time(lambda: plan(xs), repeat=repeat, number=5)
    finally:
        reg.unregister(name="bench-count")
    return [Row(f"select_allocator calls per run, plan of {ALLOCATIONS} allocations (after the first run)",
                "calls", per_run, float(ALLOCATIONS), "one call per allocation (unmemoized)", "0 calls",
                per_run == 0 and after_first == at_compile,
                {"calls_at_compile": at_compile, "calls_in_first_run": after_first - at_compile,
                 "runs": runs, "run_time_us": t_run * 1e6})]


def _pool(dev, repeat: int) -> list[Row]:
    base = dev.allocator
    heap = base.heaps[0]
    pool = CachingPoolAdaptor(base)
    alloc, free = pool.allocate_raw, pool.deallocate_raw
    free(heap, MiB, alloc(heap, MiB))  # warm: one cached block

    def pool_raw():
        free(heap, MiB, alloc(heap, MiB))

    def np_empty():
        np.empty(MiB, np.uint8)

    def base_raw():
        raw_deallocate(base, heap, MiB, raw_allocate(base, heap, MiB))

    # Interleave polyhal and anchor samples so that drift on a shared machine hits both alike.
    tp, tn = [], []
    for _ in range(repeat):
        tp.append(median_time(pool_raw, repeat=3, number=5000, warmup=1))
        tn.append(median_time(np_empty, repeat=3, number=5000, warmup=1))
    t_pool, t_np = float(np.median(tp)), float(np.median(tn))
    t_base = median_time(base_raw, repeat=repeat, number=500)
    rows = [Row("caching pool allocate+free of 1 MiB (raw, RMM-like)", "µs", t_pool * 1e6, t_np * 1e6,
                "numpy np.empty(1 MiB)", "<= 1 µs", t_pool * 1e6 <= 1.0,
                {"cache_hits": pool.cache_hits, "cache_misses": pool.cache_misses}),
            Row("caching pool vs the CPU allocator, raw allocate+free of 1 MiB", "µs", t_pool * 1e6,
                t_base * 1e6, "CPUAllocator raw (np.empty + alignment)")]

    def pool_buffer():
        pool.allocate(MiB).release()

    def base_buffer():
        base.allocate(MiB).release()

    t_pb = median_time(pool_buffer, repeat=repeat, number=500)
    t_bb = median_time(base_buffer, repeat=repeat, number=100)
    rows.append(Row("Buffer allocate+release of 1 MiB: pool vs CPU allocator", "µs", t_pb * 1e6, t_bb * 1e6,
                    "CPUAllocator.allocate + release"))
    pool.release_cached()
    return rows
