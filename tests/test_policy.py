"""select_allocator: the default policy, validation of plugin answers, memoization."""

from __future__ import annotations

import threading

import pytest

import polyhal
from polyhal.hal.flags import BufferUsage, MemoryType
from polyhal.policy import AllocatorSelector


@pytest.fixture
def two_cpus(fresh_registry):
    return fresh_registry(POLYHAL_CPU_DEVICES="2", POLYHAL_BACKENDS="cpu")


def _cands(reg):
    return tuple((s, -1) for s in reg.device_specs())


def test_default_policy_picks_first_candidate(two_cpus):
    sel = AllocatorSelector(two_cpus)
    d = sel.select(_cands(two_cpus), MemoryType.DEVICE_LOCAL, BufferUsage.DEFAULT)
    assert d.index == 0 and d.device_name == "cpu:0" and d.plugin == "polyhal.policies.first"


def test_user_policy_overrides_and_is_memoized(two_cpus):
    calls = []

    class Last:
        @polyhal.hookimpl
        def select_allocator(self, candidates, memory_type, buffer_usage, flags):
            calls.append(len(candidates))
            return len(candidates) - 1

    two_cpus.register(Last(), name="last")
    sel = AllocatorSelector(two_cpus)
    for _ in range(100):
        d = sel.select(_cands(two_cpus), MemoryType.DEVICE_LOCAL, BufferUsage.DEFAULT)
    assert d.device_name == "cpu:1" and d.plugin == "last"
    assert calls == [2] and sel.misses == 1 and sel.hits == 99
    two_cpus.unregister(name="last")  # invalidates
    assert sel.select(_cands(two_cpus), MemoryType.DEVICE_LOCAL, BufferUsage.DEFAULT).device_name == "cpu:0"


def test_none_defers_to_next_plugin(two_cpus):
    class Abstain:
        @polyhal.hookimpl
        def select_allocator(self, candidates, memory_type, buffer_usage, flags):
            return None

    two_cpus.register(Abstain(), name="abstain")
    d = AllocatorSelector(two_cpus).select(_cands(two_cpus), MemoryType.DEVICE_LOCAL, BufferUsage.DEFAULT)
    assert d.plugin == "polyhal.policies.first"


@pytest.mark.parametrize("answer,match", [(5, "index 5"), ("0", "must return an int"), (True, "must return an int")])
def test_bad_answers_name_the_plugin(two_cpus, answer, match):
    class Bad:
        @polyhal.hookimpl
        def select_allocator(self, candidates, memory_type, buffer_usage, flags):
            return answer

    two_cpus.register(Bad(), name="badpolicy")
    with pytest.warns(RuntimeWarning, match=f"badpolicy.*{match}.*skipped"):  # skipped: the built-in decides
        d = AllocatorSelector(two_cpus).select(_cands(two_cpus), MemoryType.DEVICE_LOCAL, BufferUsage.DEFAULT)
    assert d.plugin == "polyhal.policies.first"


def test_raising_policy_names_the_plugin(two_cpus):
    class Raises:
        @polyhal.hookimpl
        def select_allocator(self, candidates, memory_type, buffer_usage, flags):
            raise KeyError("oops")

    two_cpus.register(Raises(), name="raiser")
    with pytest.warns(RuntimeWarning, match="plugin 'raiser' raised in select_allocator.*skipped"):
        d = AllocatorSelector(two_cpus).select(_cands(two_cpus), MemoryType.DEVICE_LOCAL, BufferUsage.DEFAULT)
    assert d.plugin == "polyhal.policies.first"


def test_empty_candidates_is_an_error(two_cpus):
    with pytest.raises(polyhal.PluginError, match="1 to 64"):
        AllocatorSelector(two_cpus).select((), MemoryType.DEVICE_LOCAL, BufferUsage.DEFAULT)


def test_concurrent_decisions_compute_once(two_cpus):
    calls = []

    class Slow:
        @polyhal.hookimpl
        def select_allocator(self, candidates, memory_type, buffer_usage, flags):
            calls.append(1)
            return 1

    two_cpus.register(Slow(), name="slow")
    sel = AllocatorSelector(two_cpus)
    results, barrier = [], threading.Barrier(8)

    def worker():
        barrier.wait()
        results.append(sel.select(_cands(two_cpus), MemoryType.DEVICE_LOCAL, BufferUsage.DEFAULT).index)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [1] * 8 and len(calls) == 1


def test_optimal_affinity_places_ops_through_the_policy(two_cpus):
    import numpy as np

    class Second:
        @polyhal.hookimpl
        def select_allocator(self, candidates, memory_type, buffer_usage, flags):
            return 1 if len(candidates) > 1 else None

    b = polyhal.ProgramBuilder("p")
    x = b.input("x", (4,))
    y = b.op("exp", x, affinity=polyhal.Optimal("cpu:0", "cpu:1"))
    z = b.op("neg", y, affinity="cpu:0")
    b.output(z)
    prog = b.build()
    plan = polyhal.compile(prog, "cpu:0")
    assert "exp -> cpu:0" in plan.explain() and plan.placement.transfers == 0
    two_cpus.register(Second(), name="second")
    plan = polyhal.compile(prog, "cpu:0")
    assert "exp -> cpu:1" in plan.explain() and plan.placement.transfers == 1  # x is placed where first used; y comes back
    xs = np.random.default_rng().standard_normal(4).astype(np.float32)
    np.testing.assert_allclose(plan(xs).numpy(), -np.exp(xs), rtol=1e-6)
    assert plan(xs).device.name == "cpu:0"


def test_allocation_site_resolves_once_and_after_changes(two_cpus):
    sel = AllocatorSelector(two_cpus)
    site = sel.site(_cands(two_cpus), MemoryType.DEVICE_LOCAL, BufferUsage.DEFAULT)
    assert site.decision.device_name == "cpu:0" and sel.misses == 1
    assert site.decision is site.decision and sel.misses == 1

    class Last:
        @polyhal.hookimpl
        def select_allocator(self, candidates, memory_type, buffer_usage, flags):
            return len(candidates) - 1

    two_cpus.register(Last(), name="last")
    assert site.decision.device_name == "cpu:1" and sel.misses == 2
