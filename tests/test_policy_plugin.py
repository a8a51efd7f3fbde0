"""A real third-party policy plugin (tests/plugins/polyhal_policy_example), pip-installed and
discovered through its entry point, overrides select_allocator."""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

import polyhal
from polyhal import BufferUsage, MemoryType
from polyhal.policy import AllocatorSelector

EXAMPLE = Path(__file__).resolve().parent / "plugins" / "polyhal_policy_example"


@pytest.fixture(scope="session")
def example_policy_site(pip_target) -> Path:
    """The example distribution, pip-installed into a folder of its own."""
    return pip_target(EXAMPLE)


@pytest.fixture
def example_registry(example_policy_site, monkeypatch, fresh_registry):
    """A fresh registry that discovers the installed example plugin, with three CPU devices."""
    for var in ("POLYHAL_POLICY", "POLYHAL_DEVICE_LEAD_ALLOCATOR", "POLYHAL_OOM_FALLBACK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.syspath_prepend(str(example_policy_site))
    yield lambda **env: fresh_registry(POLYHAL_BACKENDS="cpu", POLYHAL_CPU_DEVICES="3", **env)
    sys.modules.pop("polyhal_policy_example", None)


def test_example_plugin_is_installed_and_discovered(example_registry):
    reg = example_registry()
    dist = metadata.distribution("polyhal-policy-example")
    assert dist.version == "0.1.0"
    assert [ep.name for ep in dist.entry_points if ep.group == "polyhal.plugins"] == ["policy-example"]
    hooks = dict(polyhal.registry.iter_plugins(reg))
    assert hooks["policy-example"] == ["select_allocator"]
    assert not [f for f in reg.failures if f.plugin == "policy-example"]


def test_example_plugin_overrides_select_allocator(example_registry):
    reg = example_registry(POLYHAL_POLICY="rank")  # user plugins run before any built-in
    cands = tuple((s, -1) for s in reg.device_specs())
    sel = AllocatorSelector(reg)
    d = sel.select(cands, MemoryType.DEVICE_LOCAL, BufferUsage.DEFAULT)
    assert (d.device_name, d.plugin) == ("cpu:2", "policy-example")
    assert d.reason == "polyhal-policy-example: device-local memory goes to the last candidate"
    host = sel.select(cands, MemoryType.HOST_VISIBLE, BufferUsage.DEFAULT)
    assert (host.device_name, host.plugin) == ("cpu:0", "polyhal.policies.rank")  # it deferred

    b = polyhal.ProgramBuilder("p")
    x = b.input("x", (4,))
    b.output(b.op("exp", x, affinity=polyhal.Optimal("cpu:0", "cpu:1")))
    plan = polyhal.compile(b.build(), ["cpu:0"])
    assert "exp -> cpu:1" in plan.explain() and "policy-example" in plan.explain()
    xs = np.arange(4, dtype=np.float32)
    np.testing.assert_allclose(plan(xs).numpy(), np.exp(xs), rtol=1e-6)


def test_unregistering_the_example_restores_the_builtin(example_registry):
    reg = example_registry()
    cands = tuple((s, -1) for s in reg.device_specs())
    sel = AllocatorSelector(reg)
    assert sel.select(cands, MemoryType.DEVICE_LOCAL).plugin == "policy-example"
    reg.unregister(name="policy-example")
    assert sel.select(cands, MemoryType.DEVICE_LOCAL).plugin == "polyhal.policies.first"
