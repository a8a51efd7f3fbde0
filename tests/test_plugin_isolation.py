"""No plugin can take the healthy backends down: throwaway bad plugins, one per failure mode,
installed as real distributions (a dist-info with an entry point on sys.path); each is named with
its reason in ``polyhal devices`` / ``polyhal plugins`` and the CPU backend keeps working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import polyhal
from polyhal.cli import main as cli_main

#: A backend whose one device outranks the CPU and whose factory raises.
BROKEN_FACTORY = '''
import polyhal
from polyhal_cpu.allocator import host_heap
POLYHAL_API_VERSION = polyhal.API_VERSION
def factory(spec):
    raise OSError("cannot open /dev/brokendev0")
@polyhal.hookimpl
def register_devices():
    return [polyhal.DeviceSpec(name="broken:0", backend="broken", rank=1000, factory=factory, heaps=(host_heap(),))]
'''


def _cpu_still_works(reg) -> None:
    assert reg.get_device().name == "cpu:0"
    b = polyhal.ProgramBuilder("add")
    x, y = b.input("x", (4,)), b.input("y", (4,))
    b.output(b.add(x, y))
    plan = polyhal.compile(b.build(), registry=reg)
    out = plan(np.ones(4, np.float32), np.full(4, 2, np.float32)).numpy()
    np.testing.assert_array_equal(out, np.full(4, 3, np.float32))


def _cli(capsys, *args: str) -> tuple[str, dict]:
    assert cli_main(list(args)) == 0
    text = capsys.readouterr().out
    assert cli_main([*args, "--json"]) == 0
    return text, json.loads(capsys.readouterr().out)


def test_import_error(fresh_registry, install_plugin, capsys):
    install_plugin("imperr", "import polyhal_no_such_module_anywhere\n")
    reg = fresh_registry(POLYHAL_CPU_DEVICES="1")
    _cpu_still_works(reg)
    text, data = _cli(capsys, "devices")
    assert "plugin 'imperr' failed" in text and "polyhal_no_such_module_anywhere" in text
    text, data = _cli(capsys, "plugins")
    assert "imperr: FAILED" in text and any(f["plugin"] == "imperr" for f in data["failed_plugins"])


def test_hookimpl_signature_error(fresh_registry, install_plugin, capsys):
    install_plugin("badsig", """
        import polyhal
        POLYHAL_API_VERSION = polyhal.API_VERSION
        @polyhal.hookimpl
        def select_allocator(candidates, memory_type, buffer_usage, flags, size):  # no such argument
            return 0
    """)
    reg = fresh_registry(POLYHAL_CPU_DEVICES="1")
    _cpu_still_works(reg)
    [failure] = [f for f in reg.failures if f.plugin == "badsig"]
    assert "breaks the hook contract" in failure.reason and "size" in failure.reason
    text, _ = _cli(capsys, "plugins")
    assert "badsig: FAILED" in text and "hook contract" in text


def test_raising_register_devices(fresh_registry, install_plugin, capsys):
    install_plugin("regboom", """
        import polyhal
        POLYHAL_API_VERSION = polyhal.API_VERSION
        @polyhal.hookimpl
        def register_devices():
            yield from ()
            raise OSError("no such device node")
    """)
    reg = fresh_registry(POLYHAL_CPU_DEVICES="1")
    _cpu_still_works(reg)
    text, data = _cli(capsys, "devices")
    assert "plugin 'regboom' failed: register_devices raised OSError: no such device node" in text
    assert any(f["stage"] == "register_devices" for f in data["failed_plugins"])


def test_raising_device_factory_falls_back_with_a_warning(fresh_registry, install_plugin, capsys):
    install_plugin("broken", BROKEN_FACTORY)
    reg = fresh_registry(POLYHAL_CPU_DEVICES="1")
    assert reg.device_specs()[0].name == "broken:0"  # it outranks the CPU
    with pytest.warns(RuntimeWarning, match="device broken:0 is not used.*cannot open /dev/brokendev0"):
        assert reg.get_device().name == "cpu:0"
    _cpu_still_works(reg)  # compile's default device list leaves it out too
    with pytest.raises(polyhal.PluginError, match="could not create device 'broken:0'.*brokendev0"):
        reg.get_device("broken:0")  # named explicitly: loud
    text, data = _cli(capsys, "devices")
    assert "FAILED" in text and "device 'broken:0' of plugin 'broken' failed" in text
    assert [f["device"] for f in data["failed_plugins"]] == ["broken:0"]
    text, _ = _cli(capsys, "plugins")
    assert "broken: FAILED (device broken:0)" in text


def test_compile_falls_back_when_the_best_device_fails(fresh_registry, install_plugin):
    install_plugin("broken", BROKEN_FACTORY)
    reg = fresh_registry(POLYHAL_CPU_DEVICES="1")
    b = polyhal.ProgramBuilder("neg")
    b.output(b.neg(b.input("x", (3,))))
    with pytest.warns(RuntimeWarning, match="broken:0"):
        plan = polyhal.compile(b.build(), registry=reg)
    assert plan.placement.value_device[plan.program.outputs[0].id] == "cpu:0"


def test_slow_import_times_out_and_is_named(fresh_registry, install_plugin, capsys):
    install_plugin("slow", "import time\ntime.sleep(5)\nPOLYHAL_API_VERSION = 1\n")
    t0 = time.perf_counter()
    reg = fresh_registry(POLYHAL_CPU_DEVICES="1", POLYHAL_PLUGIN_TIMEOUT="0.3")
    assert time.perf_counter() - t0 < 4  # did not wait for the import
    [failure] = [f for f in reg.failures if f.plugin == "slow"]
    assert "did not finish within 0.3 s" in failure.reason and "POLYHAL_PLUGIN_TIMEOUT" in failure.reason
    _cpu_still_works(reg)


def test_system_exit_at_import_is_a_failure(fresh_registry, install_plugin):
    install_plugin("quitter", "raise SystemExit(3)\n")
    reg = fresh_registry(POLYHAL_CPU_DEVICES="1")
    assert any(f.plugin == "quitter" and "SystemExit" in f.reason for f in reg.failures)
    _cpu_still_works(reg)


def test_bad_timeout_value_is_a_clear_error(fresh_registry, install_plugin):
    install_plugin("any", "POLYHAL_API_VERSION = 1\n")
    with pytest.raises(polyhal.ConfigError, match="POLYHAL_PLUGIN_TIMEOUT=.soon. is not a number"):
        fresh_registry(POLYHAL_PLUGIN_TIMEOUT="soon")


def test_plugin_that_exits_the_process_is_named_by_the_log(install_plugin, tmp_path):
    """os._exit cannot be caught; ``polyhal -v`` logs each entry point before importing it, so
    the last line names the culprit."""
    install_plugin("exiter", "import os\nos._exit(7)\n")
    # The breadcrumb it leaves goes to this test's own state folder (the next run there names it).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path)] + sys.path),
               XDG_STATE_HOME=str(tmp_path / "state"))
    env.pop("POLYHAL_BACKENDS", None)
    run = subprocess.run([sys.executable, "-m", "polyhal.cli", "-v", "devices"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 7
    assert run.stderr.strip().splitlines()[-1].startswith("polyhal: loading plugin 'exiter' from entry point")


def test_named_backend_without_devices_says_why(fresh_registry, install_plugin):
    install_plugin("nodrv", """
        import polyhal
        POLYHAL_API_VERSION = polyhal.API_VERSION
        @polyhal.hookimpl
        def register_devices():
            return []
        @polyhal.hookimpl
        def report_unavailable():
            return ["libnodrv.so is not installed; install the nodrv driver"]
    """)
    reg = fresh_registry(POLYHAL_BACKENDS="nodrv")
    with pytest.raises(polyhal.DeviceNotFoundError) as info:
        reg.get_device()
    message = str(info.value)
    assert "libnodrv.so is not installed" in message and "POLYHAL_BACKENDS=nodrv" in message
    assert "polyhal-cpu" not in message


def test_cuda_without_cupy_names_cupy(fresh_registry):
    pytest.importorskip("polyhal_cuda")
    try:
        import cupy  # noqa: F401
        pytest.skip("cupy is installed here")
    except ImportError:
        pass
    reg = fresh_registry(POLYHAL_BACKENDS="cuda")
    with pytest.raises(polyhal.DeviceNotFoundError, match="cupy") as info:
        reg.get_device()
    assert "polyhal-cpu" not in str(info.value)
