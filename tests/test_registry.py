"""Registry: discovery through entry points, failures recorded, ranking, lazy creation."""

from __future__ import annotations

import sys

import pytest

import polyhal
from polyhal.cli import main as cli_main


def test_cpu_backend_is_discovered(fresh_registry):
    reg = fresh_registry()
    names = [s.name for s in reg.device_specs()]
    assert "cpu:0" in names
    spec = next(s for s in reg.device_specs() if s.name == "cpu:0")
    assert spec.plugin == "cpu" and spec.backend == "cpu"


def test_devices_are_created_lazily(fresh_registry, install_plugin, good_backend):
    module = install_plugin("lazy", good_backend("lazy:0", "lazy"))
    reg = fresh_registry()
    assert "lazy:0" in [s.name for s in reg.device_specs()]
    assert sys.modules[module].created == []  # listing created nothing
    dev = reg.get_device("lazy:0")
    assert sys.modules[module].created == ["lazy:0"]
    assert reg.get_device("lazy:0") is dev  # created once


def test_rank_orders_devices_and_ties_are_deterministic(fresh_registry, install_plugin, good_backend):
    install_plugin("hi", good_backend("hi:0", "hi", rank=50))
    install_plugin("tie", good_backend("tie:0", "tie", rank=0))
    reg = fresh_registry()
    names = [s.name for s in reg.device_specs()]
    assert names.index("hi:0") < names.index("cpu:0") < names.index("tie:0")  # rank, then backend name
    assert reg.get_device().name == "hi:0"


def test_plugin_that_raises_on_import_is_skipped(fresh_registry, install_plugin):
    install_plugin("boom", "raise RuntimeError('driver exploded')\n")
    reg = fresh_registry()
    assert "cpu:0" in [s.name for s in reg.device_specs()]
    [failure] = [f for f in reg.failures if f.plugin == "boom"]
    assert "driver exploded" in failure.reason


def test_incompatible_api_version_is_skipped(fresh_registry, install_plugin):
    install_plugin("old", "POLYHAL_API_VERSION = 0\n")
    reg = fresh_registry()
    [failure] = [f for f in reg.failures if f.plugin == "old"]
    assert "POLYHAL_API_VERSION=0" in failure.reason and "upgrade" in failure.reason


def test_plugin_raising_inside_hook_is_skipped(fresh_registry, install_plugin):
    install_plugin("hookboom", """
        import polyhal
        POLYHAL_API_VERSION = polyhal.API_VERSION
        @polyhal.hookimpl
        def register_devices():
            raise OSError("no such device node")
    """)
    reg = fresh_registry()
    assert "cpu:0" in [s.name for s in reg.device_specs()]
    assert any(f.plugin == "hookboom" and "no such device node" in f.reason for f in reg.failures)


def test_duplicate_device_names_name_both_plugins(fresh_registry, install_plugin, good_backend):
    install_plugin("dup", good_backend("cpu:0", "dup"))
    reg = fresh_registry()
    [failure] = [f for f in reg.failures if f.plugin == "dup"]
    assert "'cpu'" in failure.reason and "'dup'" in failure.reason
    assert [s.plugin for s in reg.device_specs() if s.name == "cpu:0"] == ["cpu"]


def test_invalid_spec_is_reported(fresh_registry, install_plugin):
    install_plugin("badspec", """
        import polyhal
        POLYHAL_API_VERSION = polyhal.API_VERSION
        @polyhal.hookimpl
        def register_devices():
            return [{"name": "x"}]
    """)
    reg = fresh_registry()
    assert any(f.plugin == "badspec" and "instead of polyhal.DeviceSpec" in f.reason for f in reg.failures)


def test_backends_env_filters_and_orders(fresh_registry, install_plugin, good_backend):
    install_plugin("other", good_backend("other:0", "other", rank=-5))
    reg = fresh_registry(POLYHAL_BACKENDS="other,cpu")
    assert [s.name for s in reg.device_specs()][:2] == ["other:0", "cpu:0"]  # preference beats rank
    reg = fresh_registry(POLYHAL_BACKENDS="cpu")
    assert [s.backend for s in reg.device_specs()] == ["cpu"]


def test_named_backend_that_fails_is_loud(fresh_registry, install_plugin):
    install_plugin("named", "raise ImportError('libfoo.so missing')\n")
    with pytest.raises(polyhal.PluginError, match="libfoo.so missing"):
        fresh_registry(POLYHAL_BACKENDS="named")
    with pytest.raises(polyhal.PluginError, match="not installed"):
        fresh_registry(POLYHAL_BACKENDS="nosuchbackend")


def test_disable_autoload_and_register_in_code(fresh_registry):
    reg = fresh_registry(POLYHAL_DISABLE_AUTOLOAD="1")
    assert reg.device_specs() == []
    import polyhal_cpu.plugin

    gen = reg.generation
    reg.register(polyhal_cpu.plugin, name="cpu")
    assert reg.generation > gen
    assert [s.name for s in reg.device_specs()] == ["cpu:0"]


def test_register_in_code_checks_api_version(fresh_registry):
    reg = fresh_registry(POLYHAL_DISABLE_AUTOLOAD="1")

    class Old:
        POLYHAL_API_VERSION = 99

    with pytest.raises(polyhal.PluginError, match="99"):
        reg.register(Old(), name="old")


def test_unknown_device_lists_available(fresh_registry):
    reg = fresh_registry()
    with pytest.raises(polyhal.DeviceNotFoundError, match="cpu:0"):
        reg.get_device("tpu:7")


def test_cli_devices_shows_devices_and_failures(fresh_registry, install_plugin, capsys):
    install_plugin("clifail", "raise RuntimeError('cannot open /dev/foo')\n")
    fresh_registry()
    assert cli_main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "cpu:0" in out and "clifail" in out and "cannot open /dev/foo" in out
    assert cli_main(["devices", "--json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    assert "cpu:0" in [d["device"] for d in data["devices"]]
    assert any(f["plugin"] == "clifail" for f in data["failed_plugins"])


def test_cli_plugins_lists_hooks(fresh_registry, capsys):
    fresh_registry()
    assert cli_main(["plugins"]) == 0
    out = capsys.readouterr().out
    cpu_line = next(line for line in out.splitlines() if line.startswith("cpu "))  # "cpu (polyhal-cpu 0.1.0): ..."
    assert "register_devices" in cpu_line and "estimate_cost" in cpu_line
    assert "polyhal.policies.first: select_allocator" in out


def test_dropped_registries_are_freed(monkeypatch):
    """1,000 registries, each with a selector, a policy configuration, a listener and a created
    device, leave none alive once dropped: nothing module-level keeps them."""
    import gc
    import weakref

    from polyhal.policies.context import configure_policy
    from polyhal.policy import selector_for
    from polyhal.registry import Registry
    from polyhal_cpu import plugin as cpu_plugin

    monkeypatch.delenv("POLYHAL_ALLOCATOR", raising=False)
    refs = []
    for i in range(1000):
        reg = Registry(autoload=False)
        reg.register(cpu_plugin, name="cpu")
        selector_for(reg).select(((reg.device_specs()[0], -1),), polyhal.MemoryType.DEVICE_LOCAL)
        configure_policy(reg, policy="rank")
        unsubscribe = reg.on_change(lambda: None)
        if i % 100 == 0:
            reg.get_device("cpu:0")
        unsubscribe()
        refs.append(weakref.ref(reg))
        del reg
    gc.collect()
    assert sum(r() is not None for r in refs) == 0


def test_on_change_returns_an_unsubscribe():
    from polyhal.registry import Registry

    reg = Registry(autoload=False)
    calls = []
    unsubscribe = reg.on_change(lambda: calls.append(1))
    reg.register(type("P", (), {})(), name="p1")
    unsubscribe()
    unsubscribe()  # twice is harmless
    reg.register(type("P", (), {})(), name="p2")
    assert calls == [1]


COUNTING_BACKEND = '''
import polyhal
from polyhal_cpu.device import CPUDevice
from polyhal_cpu.allocator import host_heap
POLYHAL_API_VERSION = polyhal.API_VERSION
asked = []

@polyhal.hookimpl
def register_devices():
    asked.append(1)  # a driver enumerated: what a device named elsewhere must not cost
    return [polyhal.DeviceSpec(name="far:0", backend="far", rank=99, factory=CPUDevice, heaps=(host_heap(),))]
'''


def test_a_named_device_asks_only_its_backend(fresh_registry, install_plugin):
    """get_device / kernel_names / compile for cpu:0 leave the other backends alone, not even
    imported; naming far:0 imports and asks its plugin; the full list asks them all (and ranks
    far:0 first)."""
    module = install_plugin("far", COUNTING_BACKEND)
    reg = fresh_registry()
    b = polyhal.ProgramBuilder("t")
    x = b.input("x", (3,))
    b.output(b.add(x, x))
    assert reg.get_device("cpu:0").name == "cpu:0" and "add" in reg.kernel_names("cpu:0")
    import numpy as np
    plan = polyhal.compile(b.build(), "cpu:0", registry=reg)
    assert plan(np.ones(3, np.float32)).numpy().tolist() == [2.0, 2.0, 2.0]
    assert module not in sys.modules and reg.pm.get_plugin("far") is None
    assert reg.spec("far:0").backend == "far" and len(sys.modules[module].asked) == 1
    assert [s.name for s in reg.device_specs()][0] == "far:0"
    assert reg.specs_by_name()["cpu:0"].plugin == "cpu" and "nosuch:0" not in reg.specs_by_name()


#: A backend that also answers link_bandwidth for every pair of devices (a backend should answer
#: only for its own; this one does not, so that the order of answers shows).
GREEDY_BACKEND = COUNTING_BACKEND + '''
@polyhal.hookimpl
def link_bandwidth(src, dst):
    return 1.0
'''


def test_a_backend_loaded_on_demand_answers_policy_hooks_where_eager_loading_would(fresh_registry,
                                                                                  install_plugin):
    """The hook order does not depend on when a backend is imported: it comes after polyhal's
    built-in policies and before the policy plugins of ``polyhal.plugins`` and those registered
    in code, which answer first, as when every plugin loads with the registry."""
    install_plugin("far", GREEDY_BACKEND)
    install_plugin("fast", '''
        import polyhal
        POLYHAL_API_VERSION = polyhal.API_VERSION
        @polyhal.hookimpl
        def link_bandwidth(src, dst):
            return 2.0
    ''', group="polyhal.plugins")

    class Mine:
        @polyhal.hookimpl
        def link_bandwidth(self, src, dst):
            return 3.0 if src.name == dst.name == "far:0" else None

    lazy = fresh_registry()
    lazy.register(Mine(), name="mine")
    assert lazy.pm.get_plugin("far") is None
    far = lazy.spec("far:0")  # imports far now, after fast and mine were registered
    eager = fresh_registry()
    eager.load_backends()
    eager.register(Mine(), name="mine")
    for reg in (lazy, eager):
        names = [n for n, _ in reg.pm.list_name_plugin()]
        assert names.index("far") < names.index("fast") < names.index("mine"), names
        assert reg.pm.first_answer("link_bandwidth", src=far, dst=far).plugin == "mine"
        assert reg.pm.first_answer("link_bandwidth", src=far, dst=reg.spec("cpu:0")).plugin == "fast"
    lazy.load_backends()
    assert [n for n, _ in lazy.pm.list_name_plugin()] == [n for n, _ in eager.pm.list_name_plugin()]


def test_a_broken_backend_imported_on_demand_leaves_the_others_working(fresh_registry, install_plugin):
    """A backend that fails to import when its device is named is recorded, named in the error,
    and takes nothing down: cpu:0 and the full list still work."""
    install_plugin("bad", "raise RuntimeError('no driver here')\n")
    reg = fresh_registry(POLYHAL_CPU_DEVICES="1")
    assert reg.get_device("cpu:0").name == "cpu:0"
    with pytest.raises(polyhal.DeviceNotFoundError, match="unknown device 'bad:0'.*no driver here"):
        reg.spec("bad:0")
    assert any(f.plugin == "bad" and "no driver here" in f.reason for f in reg.failures)
    assert "cpu:0" in [s.name for s in reg.device_specs()]


def test_a_register_devices_wrapper_sees_every_lookup(fresh_registry, install_plugin):
    """A plugin that wraps register_devices (to hide or rename devices) is never bypassed: a
    named lookup then asks every plugin, through the wrapper."""
    install_plugin("hider", '''
        import polyhal
        POLYHAL_API_VERSION = polyhal.API_VERSION
        @polyhal.hookimpl(wrapper=True)
        def register_devices():
            specs = yield
            return [[s for s in found if s.name != "cpu:0"] for found in specs]
    ''', group="polyhal.plugins")
    reg = fresh_registry()
    with pytest.raises(polyhal.DeviceNotFoundError, match="unknown device 'cpu:0'"):
        reg.get_device("cpu:0")


def test_polyhal_entry_points_are_importlibs_and_the_first_copy_of_a_distribution_wins(tmp_path, monkeypatch):
    from importlib import metadata

    from polyhal.registry import polyhal_entry_points

    for folder, text in (("first", "[console_scripts]\nshadow = polyhal_test_shadow:main\n"),
                         ("second", "[polyhal.backends]\nshadow = polyhal_test_shadow\n")):
        dist = tmp_path / folder / "polyhal_test_shadow-0.1.dist-info"
        dist.mkdir(parents=True)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: polyhal-test-shadow\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path / "second"))
    monkeypatch.syspath_prepend(str(tmp_path / "first"))  # shadows the copy with the backend
    ours = sorted((e.group, e.name, e.value) for e in polyhal_entry_points())
    everything = metadata.entry_points()
    theirs = sorted((e.group, e.name, e.value) for g in ("polyhal.backends", "polyhal.plugins")
                    for e in everything.select(group=g))
    assert ours == theirs and ("polyhal.backends", "shadow", "polyhal_test_shadow") not in ours
    monkeypatch.syspath_prepend(str(tmp_path / "second"))  # now the copy with the backend comes first
    assert ("polyhal.backends", "shadow", "polyhal_test_shadow") in [(e.group, e.name, e.value)
                                                                      for e in polyhal_entry_points()]


def test_a_loaded_backend_names_its_distribution_when_asked():
    from importlib import metadata

    from polyhal.registry import Registry

    reg = Registry()
    reg.get_device("cpu:0")
    dist = next(ep.dist for ep in metadata.entry_points(group="polyhal.backends") if ep.name == "cpu")
    assert reg.distribution("cpu") == (dist.name, dist.version)
    assert reg.distribution("no-such-plugin") is None
