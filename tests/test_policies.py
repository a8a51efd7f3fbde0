"""Built-in device policies (first, lead, rank, cost), their selection, memoization over the
device list and workload, explain, out-of-memory fallback, and bad input."""

from __future__ import annotations

import json
import math
import threading

import numpy as np
import pytest

import polyhal
from polyhal import BufferUsage, Heap, MemoryType, Optimal
from polyhal.hal.adaptors import LimitingAdaptor, set_device_allocator
from polyhal.policies.context import CORE_DEFAULT, PolicyConfig
from polyhal.policy import (
    AllocatorSelector, Workload, configure_policy, current, policy_config, record_reason, selector_for,
)

DL, DEFAULT = MemoryType.DEVICE_LOCAL, BufferUsage.DEFAULT


@pytest.fixture(autouse=True)
def _clean_policy_env(monkeypatch):
    for var in ("POLYHAL_POLICY", "POLYHAL_DEVICE_LEAD_ALLOCATOR", "POLYHAL_OOM_FALLBACK", "POLYHAL_ALLOCATOR"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def cpus(fresh_registry):
    """A registry of three logical CPU devices (and nothing else)."""
    def make(n: int = 3, **env: str):
        return fresh_registry(POLYHAL_CPU_DEVICES=str(n), POLYHAL_BACKENDS="cpu", **env)
    return make


def _cands(reg, *names):
    specs = {s.name: s for s in reg.device_specs()}
    return tuple((specs[n], -1) for n in (names or specs))


def _chain(n_ops: int = 1, affinity=None, shape=(8,)):
    b = polyhal.ProgramBuilder("chain")
    v = b.input("x", shape)
    for _ in range(n_ops):
        v = b.op("exp", v, affinity=affinity)
    b.output(v)
    return b.build()


# -- selection of the active built-in ------------------------------------------------------------------

def test_default_is_first_and_only_the_active_builtin_answers(cpus):
    reg = cpus()
    sel = AllocatorSelector(reg)
    d = sel.select(_cands(reg, "cpu:1", "cpu:0"), DL, DEFAULT)
    assert (d.device_name, d.plugin, d.policy) == ("cpu:1", "polyhal.policies.first", "first")
    assert "first candidate" in d.reason
    # The other built-ins are registered (polyhal plugins lists them) but inactive.
    names = [n for n, _ in reg.pm.list_name_plugin()]
    assert {"polyhal.policies.lead", "polyhal.policies.rank", "polyhal.policies.cost"} <= set(names)


def test_env_selects_the_policy(cpus):
    reg = cpus(POLYHAL_POLICY="rank")
    assert policy_config(reg).policy == "rank"
    d = AllocatorSelector(reg).select(_cands(reg), DL, DEFAULT)
    assert d.plugin == "polyhal.policies.rank" and "highest rank 0" in d.reason and "earliest of equals" in d.reason


def test_unknown_policy_is_an_error_listing_the_builtins(cpus):
    reg = cpus(POLYHAL_POLICY="fastest")
    with pytest.raises(polyhal.ConfigError, match="POLYHAL_POLICY='fastest' is not one of first, lead, rank, cost"):
        AllocatorSelector(reg).select(_cands(reg), DL, DEFAULT)
    with pytest.raises(polyhal.PluginError, match="unknown device policy"):
        PolicyConfig("nope")


def test_changing_the_policy_invalidates_decisions_and_sites(cpus):
    reg = cpus(POLYHAL_DEVICE_LEAD_ALLOCATOR="2")  # a lead index alone selects the lead policy
    assert policy_config(reg).policy == "lead"
    sel = AllocatorSelector(reg)
    site = sel.site(_cands(reg), DL, DEFAULT, devices=("cpu:0", "cpu:1", "cpu:2"))
    assert site.decision.device_name == "cpu:2" and sel.misses == 1
    epoch = sel.epoch
    configure_policy(reg, policy="first")
    assert sel.epoch > epoch and site.decision.device_name == "cpu:0" and sel.misses == 2
    configure_policy(reg, policy="first")  # no change: nothing dropped
    assert site.decision.device_name == "cpu:0" and sel.misses == 2


def test_user_plugins_run_before_builtins_and_trylast_means_last(cpus):
    reg = cpus(POLYHAL_POLICY="rank")

    class User:
        @polyhal.hookimpl
        def select_allocator(self, candidates, memory_type, buffer_usage, flags):
            record_reason("the user said so")
            return 2

    class Late:
        @polyhal.hookimpl(trylast=True)
        def select_allocator(self, candidates, memory_type, buffer_usage, flags):
            raise AssertionError("a trylast plugin runs after the built-in policy, which answers")

    reg.register(User(), name="user")
    d = AllocatorSelector(reg).select(_cands(reg), DL, DEFAULT)
    assert (d.device_name, d.plugin, d.reason) == ("cpu:2", "user", "the user said so")
    reg.unregister(name="user")
    reg.register(Late(), name="late")  # pluggy's order, as in pytest: trylast runs after the built-ins
    d = AllocatorSelector(reg).select(_cands(reg), DL, DEFAULT)
    assert d.plugin == "polyhal.policies.rank"


def test_core_default_when_no_policy_answers(cpus):
    reg = cpus()
    reg.unregister(name="polyhal.policies.first")
    d = AllocatorSelector(reg).select(_cands(reg, "cpu:2", "cpu:1"), DL, DEFAULT)
    assert d.device_name == "cpu:2" and d.plugin == CORE_DEFAULT and "no select_allocator plugin answered" in d.reason


def test_direct_pluggy_call_still_gets_an_answer(cpus):
    reg = cpus(POLYHAL_POLICY="cost")
    assert reg.pm.hook.select_allocator(candidates=_cands(reg), memory_type=DL, buffer_usage=DEFAULT, flags=0) == 0
    assert current() is None


# -- lead -------------------------------------------------------------------------------------------------

def test_lead_picks_the_nth_device_of_the_compile_list(cpus):
    reg = cpus()
    configure_policy(reg, policy="lead", lead_allocator=1)
    devices = ["cpu:2", "cpu:0", "cpu:1"]
    plan = polyhal.compile(_chain(3), devices)  # ops without affinity: the whole list is the candidate set
    assert {d.device_name for _, _, d in plan.placement.decisions} == {"cpu:0"}
    assert "cpu:0 is device 1 of the --device list" in plan.explain()
    # An op whose affinity does not include the lead device falls back to its first candidate.
    plan = polyhal.compile(_chain(1, affinity=Optimal("cpu:1", "cpu:2")), devices)
    (_, _, d), = plan.placement.decisions
    assert d.device_name == "cpu:1" and "not a candidate; first candidate" in d.reason
    x = np.arange(8, dtype=np.float32)
    np.testing.assert_allclose(plan(x).numpy(), np.exp(x), rtol=1e-6)


def test_lead_decisions_depend_on_the_device_list(cpus):
    reg = cpus()
    configure_policy(reg, lead_allocator=0)
    sel = AllocatorSelector(reg)
    a = sel.select(_cands(reg), DL, DEFAULT, devices=("cpu:1", "cpu:0"))
    b = sel.select(_cands(reg), DL, DEFAULT, devices=("cpu:2",))
    c = sel.select(_cands(reg), DL, DEFAULT, devices=("cpu:1", "cpu:0"), workload=Workload("exp"))
    assert (a.device_name, b.device_name, c.device_name) == ("cpu:1", "cpu:2", "cpu:1")
    assert a.depends_on == ("devices",) and sel.misses == 2 and c is a  # the workload was not read


def test_lead_index_beyond_the_device_list_is_an_error(cpus):
    reg = cpus()
    configure_policy(reg, lead_allocator=5)
    with pytest.raises(polyhal.PluginError, match=r"lead allocator is 5.*has 2 device\(s\) \['cpu:0', 'cpu:1'\]") as exc:
        polyhal.compile(_chain(1), ["cpu:0", "cpu:1"])
    assert "polyhal.policies.lead" in str(exc.value)
    # Outside a compile the registry's device list counts.
    with pytest.raises(polyhal.PluginError, match="registry's device list has 3"):
        AllocatorSelector(reg).select(_cands(reg), DL, DEFAULT)


@pytest.mark.parametrize("raw", ["two", "-1"])
def test_bad_lead_index_in_the_environment(cpus, raw):
    reg = cpus(POLYHAL_DEVICE_LEAD_ALLOCATOR=raw)
    with pytest.raises(polyhal.ConfigError, match=f"POLYHAL_DEVICE_LEAD_ALLOCATOR={raw!r} is not an integer >= 0"):
        AllocatorSelector(reg).select(_cands(reg), DL, DEFAULT)


# -- rank -------------------------------------------------------------------------------------------------

def test_rank_prefers_the_highest_ranked_candidate(fresh_registry, install_plugin, good_backend):
    install_plugin("fast", good_backend("fast:0", "fast", rank=7))
    reg = fresh_registry(POLYHAL_BACKENDS="cpu,fast", POLYHAL_CPU_DEVICES="2", POLYHAL_POLICY="rank")
    d = AllocatorSelector(reg).select(_cands(reg, "cpu:0", "fast:0", "cpu:1"), DL, DEFAULT)
    assert d.device_name == "fast:0" and "highest rank 7" in d.reason
    assert [s.name for s, _ in d.fallbacks] == ["cpu:0", "cpu:1"]  # then by rank, earliest first
    plan = polyhal.compile(_chain(2), ["cpu:0", "cpu:1", "fast:0"])
    assert all(d.device_name == "fast:0" for _, _, d in plan.placement.decisions)


# -- cost -------------------------------------------------------------------------------------------------

def test_cost_follows_the_data(cpus):
    """With identical devices, moving operands is the only cost: ops run where their inputs are."""
    reg = cpus(POLYHAL_POLICY="cost")
    b = polyhal.ProgramBuilder("p")
    x = b.input("x", (256,))
    y = b.op("exp", x, affinity="cpu:1")
    z = b.op("neg", y, affinity=Optimal("cpu:0", "cpu:1"))
    b.output(z)
    plan = polyhal.compile(b.build(), ["cpu:0"])
    d = plan.placement.decisions[1][2]
    assert d.device_name == "cpu:1" and d.plugin == "polyhal.policies.cost" and "workload" in d.depends_on
    assert "moving 1024 B from cpu:1" in d.reason and plan.placement.transfers == 0
    xs = np.linspace(-1, 1, 256, dtype=np.float32)
    np.testing.assert_allclose(plan(xs).numpy(), -np.exp(xs), rtol=1e-6)


def test_devices_take_part_through_estimate_cost(cpus):
    reg = cpus(POLYHAL_POLICY="cost")
    seen = []

    class FastMatmulOnCpu2:
        @polyhal.hookimpl
        def estimate_cost(self, device_spec, workload):
            seen.append((device_spec.name, workload.op))
            if workload.op == "matmul":
                return 1e-9 if device_spec.name == "cpu:2" else 1.0
            return None  # defer to the CPU backend's own estimate

    reg.register(FastMatmulOnCpu2(), name="fastmm")
    b = polyhal.ProgramBuilder("mm")
    a, w = b.input("a", (16, 32)), b.input("w", (32, 8))
    b.output(b.relu(b.matmul(a, w)))
    plan = polyhal.compile(b.build(), ["cpu:0", "cpu:1", "cpu:2"])
    (_, _, mm), (_, _, relu) = plan.placement.decisions
    assert mm.device_name == "cpu:2" and "fastmm's estimate_cost" in mm.reason
    assert relu.device_name == "cpu:2" and "cpu's estimate_cost" in relu.reason  # follows the data
    assert ("cpu:0", "matmul") in seen
    n_calls = len(seen)
    polyhal.compile(b.build(), ["cpu:0", "cpu:1", "cpu:2"])  # same signatures: memoized
    assert len(seen) == n_calls


@pytest.mark.parametrize("answer", [-1.0, "fast", math.nan, True])
def test_bad_estimate_names_the_plugin(cpus, answer):
    reg = cpus(POLYHAL_POLICY="cost")

    class Bad:
        @polyhal.hookimpl
        def estimate_cost(self, device_spec, workload):
            return answer

    reg.register(Bad(), name="badcost")
    with pytest.warns(RuntimeWarning, match="badcost.*estimate_cost.*skipped"):  # the next estimate decides
        d = AllocatorSelector(reg).select(_cands(reg), DL, DEFAULT, workload=Workload("exp"))
    assert "badcost" not in d.reason


def test_cost_without_an_op_falls_back_to_rank_then_order(cpus):
    reg = cpus(POLYHAL_POLICY="cost")
    d = AllocatorSelector(reg).select(_cands(reg, "cpu:1", "cpu:0"), DL, DEFAULT)
    assert d.device_name == "cpu:1" and "plain allocation" in d.reason


def test_measured_links_override_declared_ones(cpus):
    from polyhal.policies.cost import link_bandwidth, measure_link, measured_links

    reg = cpus(POLYHAL_POLICY="cost")
    specs = {s.name: s for s in reg.device_specs()}
    assert link_bandwidth(reg, specs["cpu:0"], specs["cpu:1"]) == (8e9, "declared by cpu")
    sel = selector_for(reg)
    epoch = sel.epoch
    bw = measure_link(reg, "cpu:0", "cpu:1", nbytes=1 << 16, repeat=1)
    assert bw > 0 and measured_links(reg)[("cpu:0", "cpu:1")] == bw and sel.epoch > epoch
    specs = {s.name: s for s in reg.device_specs()}
    assert link_bandwidth(reg, specs["cpu:0"], specs["cpu:1"]) == (bw, "measured")


def test_roofline_default_when_no_plugin_estimates(cpus):
    from polyhal.policies.cost import kernel_time

    reg = cpus(POLYHAL_POLICY="cost")
    reg.unregister(name="cpu")  # the CPU backend's estimate_cost goes; its specs were collected
    spec = polyhal.DeviceSpec("x:0", "x", 0, factory=lambda s: None, heaps=(Heap(DL, DEFAULT, 1 << 20),),
                              limits={"peak_flops": 1e9, "memory_bandwidth": 1e9, "launch_latency": 0.0})
    w = Workload("matmul", (polyhal.TensorType((10, 20), "float32"), polyhal.TensorType((20, 30), "float32")),
                 (polyhal.TensorType((10, 30), "float32"),))
    t, why = kernel_time(reg, spec, w)
    assert "roofline" in why and t == pytest.approx(max(2 * 10 * 30 * 20 / 1e9, w.input_bytes / 1e9 + 1200 / 1e9))


# -- memoization ------------------------------------------------------------------------------------------

def test_policies_that_ignore_the_workload_compute_once_per_key(cpus):
    reg = cpus()
    calls = []

    class Count:
        @polyhal.hookimpl
        def select_allocator(self, candidates, memory_type, buffer_usage, flags):
            calls.append(1)

    reg.register(Count(), name="count")
    sel = AllocatorSelector(reg)
    for op in ("exp", "neg", "relu", "exp"):
        sel.select(_cands(reg), DL, DEFAULT, devices=("cpu:0",), workload=Workload(op))
    assert len(calls) == 1 and sel.misses == 1 and sel.hits == 3 and len(sel.computed()) == 1


def test_plan_with_100_allocations_calls_no_hook_after_compiling(cpus):
    reg = cpus(2)
    calls = []

    class Count:
        @polyhal.hookimpl
        def select_allocator(self, candidates, memory_type, buffer_usage, flags):
            calls.append(1)

    reg.register(Count(), name="count")
    b = polyhal.ProgramBuilder("many")
    x = b.input("x", (4,))
    b.output(*[b.op("exp", x, affinity=Optimal("cpu:0", "cpu:1")) for _ in range(100)])
    plan = polyhal.compile(b.build(), ["cpu:0", "cpu:1"])
    compiled = len(calls)
    assert compiled == 1  # 100 identical allocation sites, one decision
    for _ in range(3):
        outs = plan(np.ones(4, np.float32))
        assert len(outs) == 100
    assert len(calls) == compiled


def test_concurrent_decisions_same_answers_one_computation_per_key(cpus):
    reg = cpus(POLYHAL_POLICY="rank")
    calls: list[tuple] = []
    gate = threading.Event()

    class Slow:
        @polyhal.hookimpl
        def select_allocator(self, candidates, memory_type, buffer_usage, flags):
            calls.append((len(candidates), memory_type))
            gate.wait(0.01)  # widen the race window
            return len(candidates) - 1

    reg.register(Slow(), name="slow")
    sel = AllocatorSelector(reg)
    keys = [(_cands(reg)[:n], mt) for n in (1, 2, 3) for mt in (DL, MemoryType.HOST_VISIBLE)]
    results: list[list[str]] = []
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        results.append([sel.site(c, mt).decision.device_name for c, mt in keys])

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and all(r == results[0] for r in results)
    assert results[0] == ["cpu:0", "cpu:0", "cpu:1", "cpu:1", "cpu:2", "cpu:2"]
    assert sorted(calls) == sorted(set(calls)) and len(calls) == len(keys) and sel.misses == len(keys)


# -- memory types and candidates ----------------------------------------------------------------------------

class DeviceLocalOnly:
    """A backend whose single device serves device-local memory only (not host-visible)."""

    @polyhal.hookimpl
    def register_devices(self):
        from polyhal_cpu.device import CPUDevice

        heap = Heap(MemoryType.DEVICE_LOCAL, BufferUsage.DEFAULT, 1 << 30)
        return [polyhal.DeviceSpec(name="dl:0", backend="dl", rank=50, factory=CPUDevice, heaps=(heap,))]


def test_candidates_that_cannot_serve_are_excluded_and_explained(cpus):
    reg = cpus(2, POLYHAL_POLICY="rank")
    reg.register(DeviceLocalOnly(), name="dl")
    sel = AllocatorSelector(reg)
    cands = _cands(reg, "dl:0", "cpu:0", "cpu:1")
    assert sel.select(cands, DL, DEFAULT).device_name == "dl:0"
    d = sel.select(cands, MemoryType.HOST_VISIBLE, DEFAULT)
    assert (d.index, d.device_name) == (1, "cpu:0")
    assert d.excluded[0][0] == "dl:0" and "serves only DEVICE_LOCAL" in d.excluded[0][1]
    assert "excluded dl:0" in sel.explain()


def test_memory_type_no_candidate_serves(cpus):
    reg = cpus(1)
    reg.register(DeviceLocalOnly(), name="dl")
    with pytest.raises(polyhal.IncompatibleBufferError, match="no candidate can allocate HOST_VISIBLE") as exc:
        AllocatorSelector(reg).select(_cands(reg, "dl:0"), MemoryType.HOST_VISIBLE, DEFAULT)
    assert "dl:0 serves only DEVICE_LOCAL" in str(exc.value)
    image = BufferUsage.DISPATCH_IMAGE_READ
    with pytest.raises(polyhal.IncompatibleBufferError, match="DISPATCH_IMAGE_READ"):
        AllocatorSelector(reg).select(_cands(reg, "cpu:0"), DL, image)


def test_empty_and_oversized_candidate_sets(cpus):
    reg = cpus(1)
    sel = AllocatorSelector(reg)
    with pytest.raises(polyhal.PluginError, match="1 to 64 candidates, got 0"):
        sel.select((), DL, DEFAULT)
    with pytest.raises(polyhal.PluginError, match="got 65"):
        sel.select(_cands(reg) * 65, DL, DEFAULT)


def test_lists_are_accepted_as_keys(cpus):
    reg = cpus(2)
    sel = AllocatorSelector(reg)
    d = sel.select(list(_cands(reg)), DL, DEFAULT, devices=["cpu:0"])
    assert d is sel.select(_cands(reg), DL, DEFAULT, devices=("cpu:0",))


# -- out of memory ------------------------------------------------------------------------------------------

def test_out_of_memory_error_or_fallback(cpus):
    reg = cpus(2)
    dev0 = reg.get_device("cpu:0")
    set_device_allocator(dev0, LimitingAdaptor(dev0.allocator, limit=1000))
    site = selector_for(reg).site(_cands(reg), DL, DEFAULT)
    with pytest.raises(polyhal.OutOfMemoryError) as exc:
        site.allocate(4096)
    msg = str(exc.value)
    assert "cpu:0" in msg and "4096 bytes" in msg and "limit of 1000" in msg and "polyhal.policies.first" in msg
    assert "['cpu:1'] were not tried" in msg and "POLYHAL_OOM_FALLBACK" in msg

    buf = site.allocate(4096, fallback=True)
    assert buf.device.name == "cpu:1"
    configure_policy(reg, oom_fallback=True)
    site = selector_for(reg).site(_cands(reg), DL, DEFAULT)
    small, big = site.allocate(100), site.allocate(4096)
    assert (small.device.name, big.device.name) == ("cpu:0", "cpu:1")
    events = selector_for(reg).oom_events
    assert events[-1].device == "cpu:1" and events[-1].nbytes == 4096
    text = polyhal.policy.explain(reg)
    assert "out of memory on cpu:0: 4096 B allocated on cpu:1 instead" in text
    assert "if cpu:0 is out of memory: cpu:1" in text


def test_out_of_memory_on_every_candidate(cpus):
    reg = cpus(2, POLYHAL_OOM_FALLBACK="1")
    for name in ("cpu:0", "cpu:1"):
        dev = reg.get_device(name)
        set_device_allocator(dev, LimitingAdaptor(dev.allocator, limit=10))
    with pytest.raises(polyhal.OutOfMemoryError, match="every candidate.*cpu:0: .*cpu:1: "):
        polyhal.policy.allocate(64, Optimal("cpu:0", "cpu:1"), registry=reg)


def test_allocate_through_an_affinity(cpus):
    reg = cpus(3)

    class Last:
        @polyhal.hookimpl
        def select_allocator(self, candidates, memory_type, buffer_usage, flags):
            return len(candidates) - 1

    reg.register(Last(), name="last")
    with polyhal.policy.allocate(256, Optimal("cpu:0", "cpu:2"), registry=reg) as buf:
        assert buf.device.name == "cpu:2" and buf.nbytes == 256
    assert polyhal.policy.allocate(8, "cpu:1", registry=reg).device.name == "cpu:1"
    with pytest.raises(polyhal.DeviceNotFoundError, match="cpu:7"):
        polyhal.policy.allocate(8, ["cpu:7"], registry=reg)


# -- explain ------------------------------------------------------------------------------------------------

def test_explain_lists_every_decision_with_plugin_and_reason(cpus):
    reg = cpus(2, POLYHAL_POLICY="cost")
    plan = polyhal.compile(_chain(2), ["cpu:0", "cpu:1"])
    text = plan.explain()
    assert "exp -> cpu:0" in text and "polyhal.policies.cost" in text and "cost of exp" in text
    full = polyhal.policy.explain()
    assert "device policy 'cost'" in full and full.count("by polyhal.policies.cost: cost of exp") == 2
    assert "exp(tensor<8xfloat32>@cpu:0)" in full  # the second exp's operand lives on cpu:0


def test_cli_explain(cpus, capsys):
    from polyhal.cli import main

    cpus(2)
    assert main(["explain", "--device", "cpu:1", "--device", "cpu:0", "--device-lead-allocator", "0",
                 "--batch", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "lead" and out["devices"] == ["cpu:1", "cpu:0"]
    assert out["decisions"][0]["chosen"] == "cpu:1" and out["decisions"][0]["devices"] == ["cpu:1", "cpu:0"]
    assert "lead allocator" in out["decisions"][0]["reason"]
    assert main(["explain", "--policy", "rank", "--batch", "4"]) == 0
    text = capsys.readouterr().out
    assert "device policy 'rank'" in text and "by polyhal.policies.rank" in text
    assert main(["explain", "--device", "cpu:0", "--device-lead-allocator", "4", "--batch", "4"]) == 2
    assert "lead allocator is 4" in capsys.readouterr().err
