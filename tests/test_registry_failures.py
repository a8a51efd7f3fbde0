"""The registry holds under every plugin failure (issue 27, defects 4 and 5): factories that return
no device, failing allocator wrappers, a plugin taking another backend's device name, a plugin that
calls the registry while it is imported, failing policy hooks, bad timeouts, an interrupt on the
loader thread, kernels raising at run time, string memory types, a plugin hanging or ending the
process at import. Bad plugins are real distributions (tests/conftest.py's ``install_plugin``) or
plugin objects registered in code."""

from __future__ import annotations

import json
import math
import os
import stat
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

import polyhal
from polyhal.cli import main as cli_main
from polyhal import errors
from polyhal.errors import IncompatibleBufferError, PluginError
from polyhal.hal.adaptors import AllocatorAdaptor
from polyhal.hal.flags import BufferUsage, MemoryType
from polyhal.policy import AllocatorSelector, Workload

#: A backend of one device that outranks the CPU, whose factory returns ``{result}``.
NON_DEVICE_FACTORY = '''
import polyhal
from polyhal_cpu.allocator import host_heap
POLYHAL_API_VERSION = polyhal.API_VERSION
def factory(spec):
    return {result}
@polyhal.hookimpl
def register_devices():
    return [polyhal.DeviceSpec(name="odd:0", backend="odd", rank=1000, factory=factory, heaps=(host_heap(),))]
'''

#: A backend that registers a device named ``cpu:0`` with a rank that sorts it first.
IMPOSTOR = '''
import polyhal
from polyhal_cpu.device import CPUDevice
from polyhal_cpu.allocator import host_heap
POLYHAL_API_VERSION = polyhal.API_VERSION
@polyhal.hookimpl
def register_devices():
    return [polyhal.DeviceSpec(name="cpu:0", backend="aaa", rank=1000, factory=CPUDevice, heaps=(host_heap(),),
                               description="not the CPU")]
'''

#: A backend whose ``exp`` kernel fails at run time (a device lost mid-run).
FAILING_KERNEL = '''
import polyhal
from polyhal_cpu.device import CPUDevice
from polyhal_cpu.allocator import host_heap
POLYHAL_API_VERSION = polyhal.API_VERSION
class LossyDevice(CPUDevice):
    def prepare(self, op, attrs, in_types, out_types, scratch=None):
        fn = super().prepare(op, attrs, in_types, out_types, scratch)
        if op != "exp":
            return fn
        def lost(*args):
            raise OSError("device lost")
        return lost
@polyhal.hookimpl
def register_devices():
    return [polyhal.DeviceSpec(name="lossy:0", backend="lossy", rank=1, factory=LossyDevice, heaps=(host_heap(),))]
'''


def _subprocess_env(tmp_path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path)] + sys.path), XDG_STATE_HOME=str(tmp_path / "state"))
    for name in ("POLYHAL_BACKENDS", "POLYHAL_PLUGIN_TIMEOUT", "POLYHAL_LOG", "POLYHAL_ALLOCATOR"):
        env.pop(name, None)
    env.update(extra)
    return env


def _cli(capsys, *args: str) -> tuple[str, dict]:
    assert cli_main(list(args)) == 0
    text = capsys.readouterr().out
    assert cli_main([*args, "--json"]) == 0
    return text, json.loads(capsys.readouterr().out)


def _neg_plan(reg):
    b = polyhal.ProgramBuilder("neg")
    b.output(b.neg(b.input("x", (3,))))
    return polyhal.compile(b.build(), registry=reg)


# -- device factories ---------------------------------------------------------------------------------

@pytest.mark.parametrize("result, kind", [("None", "None"), ("object()", "object")])
def test_a_factory_returning_no_device_is_a_named_failure(fresh_registry, install_plugin, capsys, result, kind):
    install_plugin("odd", NON_DEVICE_FACTORY.format(result=result))
    reg = fresh_registry(POLYHAL_CPU_DEVICES="1")
    with pytest.warns(RuntimeWarning, match=f"device odd:0 is not used.*returned {kind} instead of a polyhal.Device"):
        assert reg.get_device().name != "odd:0"  # the next device (cpu:0, or a GPU ranked above it)
    with pytest.raises(PluginError, match="plugin 'odd' .*odd:0"):
        reg.get_device("odd:0")
    np.testing.assert_array_equal(_neg_plan(reg)(np.ones(3, np.float32)).numpy(), -np.ones(3))
    text, data = _cli(capsys, "devices")
    assert f"device 'odd:0' of plugin 'odd' failed: plugin 'odd' could not create device 'odd:0': " in text
    assert [f["device"] for f in data["failed_plugins"]] == ["odd:0"]


# -- allocator wrappers ------------------------------------------------------------------------------

class _RaisingWrapper:
    @polyhal.hookimpl
    def wrap_allocator(self, device, memory_type, allocator):
        raise RuntimeError("no pools today")


def test_a_failing_wrap_allocator_leaves_the_device_working_unwrapped(fresh_registry, monkeypatch):
    monkeypatch.delenv("POLYHAL_ALLOCATOR", raising=False)
    reg = fresh_registry(POLYHAL_BACKENDS="cpu", POLYHAL_CPU_DEVICES="1")
    reg.register(_RaisingWrapper(), name="raiser")
    with pytest.warns(RuntimeWarning, match="plugin 'raiser' raised in wrap_allocator for cpu:0.*no pools today"):
        dev = reg.get_device()
    assert dev.name == "cpu:0" and not isinstance(dev.allocator, AllocatorAdaptor)
    assert reg.get_device("cpu:0") is dev
    np.testing.assert_array_equal(_neg_plan(reg)(np.ones(3, np.float32)).numpy(), -np.ones(3))
    assert any(f.plugin == "raiser" and f.stage == "wrap_allocator" and f.device == "cpu:0" for f in reg.failures)


def test_a_bad_polyhal_allocator_is_a_named_device_failure(fresh_registry, capsys):
    """The user's own setting is wrong: loud, on every device it wraps, and never KeyError."""
    reg = fresh_registry(POLYHAL_BACKENDS="cpu", POLYHAL_CPU_DEVICES="1", POLYHAL_ALLOCATOR="pool,bogus")
    for name in (None, "cpu:0", None):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(polyhal.PolyhalError, match="POLYHAL_ALLOCATOR='pool,bogus': unknown adaptor 'bogus'"):
                reg.get_device(name)  # was KeyError: 'cpu:0'
    text, _ = _cli(capsys, "devices")
    assert "device 'cpu:0' of plugin 'polyhal.policies.adaptors' failed" in text and "POLYHAL_ALLOCATOR" in text


# -- device names ------------------------------------------------------------------------------------

def test_a_plugin_registering_cpu0_does_not_take_the_name(fresh_registry, install_plugin, capsys):
    install_plugin("aaa", IMPOSTOR)  # "aaa" loads (and registers) before "cpu", and its rank sorts first
    reg = fresh_registry(POLYHAL_CPU_DEVICES="1")
    assert reg.spec("cpu:0").plugin == "cpu"  # asked before the devices are listed
    with pytest.warns(RuntimeWarning, match="plugin 'aaa'.*'cpu:0'.*belongs to plugin 'cpu'"):
        specs = reg.device_specs()
    assert [s.plugin for s in specs if s.name == "cpu:0"] == ["cpu"]
    assert reg.spec("cpu:0").plugin == "cpu" and reg.get_device("cpu:0").spec.description != "not the CPU"
    text, data = _cli(capsys, "devices")
    assert "plugin 'aaa' failed: register_devices: device name 'cpu:0'" in text
    assert any(f["plugin"] == "aaa" for f in data["failed_plugins"])


def test_the_users_ranking_decides_who_owns_a_contested_name(fresh_registry, install_plugin):
    install_plugin("aaa", IMPOSTOR)
    reg = fresh_registry(POLYHAL_BACKENDS="cpu,aaa", POLYHAL_CPU_DEVICES="1")
    assert reg.spec("cpu:0").plugin == "cpu"
    reg = fresh_registry(POLYHAL_BACKENDS="aaa,cpu", POLYHAL_CPU_DEVICES="1")
    assert reg.spec("cpu:0").plugin == "aaa"  # the user said so, before and after listing
    with pytest.warns(RuntimeWarning, match="plugin 'cpu'.*belongs to plugin 'aaa'"):
        reg.device_specs()
    assert reg.spec("cpu:0").plugin == "aaa"


# -- re-entrant registry -----------------------------------------------------------------------------

@pytest.mark.parametrize("timeout", ["0", None])
def test_a_plugin_calling_default_registry_at_import_is_refused(install_plugin, tmp_path, timeout):
    install_plugin("reentrant", "import polyhal\npolyhal.registry.default_registry()\nPOLYHAL_API_VERSION = 1\n")
    env = _subprocess_env(tmp_path, POLYHAL_CPU_DEVICES="1")
    if timeout is not None:
        env["POLYHAL_PLUGIN_TIMEOUT"] = timeout
    code = ("import polyhal.registry as r, json; reg = r.default_registry(); "
            "print(json.dumps([[f.plugin, f.reason] for f in reg.failures])); print(reg.get_device().name)")
    t0 = time.perf_counter()
    try:
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=40)
    except subprocess.TimeoutExpired:
        pytest.fail("the registry deadlocked")
    assert time.perf_counter() - t0 < 15, "the registry stalled"
    assert run.returncode == 0, run.stderr
    failures, device = run.stdout.splitlines()
    [(plugin, reason)] = [f for f in json.loads(failures) if f[0] == "reentrant"]
    assert "plugin 'reentrant' called polyhal's default registry while it was being imported" in reason
    assert device and not device.startswith("reentrant")  # the default device works


# -- policy hooks ------------------------------------------------------------------------------------

DL = MemoryType.DEVICE_LOCAL


def _cands(reg):
    return tuple((s, -1) for s in reg.device_specs())


@pytest.mark.parametrize("answer", [RuntimeError("no decision today"), 7, "0"])
def test_a_failing_select_allocator_is_skipped_for_that_decision(fresh_registry, answer):
    reg = fresh_registry(POLYHAL_BACKENDS="cpu", POLYHAL_CPU_DEVICES="2", POLYHAL_POLICY="first")

    class Bad:
        @polyhal.hookimpl
        def select_allocator(self, candidates, memory_type, buffer_usage, flags):
            if isinstance(answer, Exception):
                raise answer
            return answer

    reg.register(Bad(), name="badpolicy")
    with pytest.warns(RuntimeWarning, match="plugin 'badpolicy' .*select_allocator.*skipped"):
        d = AllocatorSelector(reg).select(_cands(reg), DL, BufferUsage.DEFAULT)
    assert d.device_name == "cpu:0" and d.plugin == "polyhal.policies.first"


@pytest.mark.parametrize("answer", [math.nan, ValueError("no model")])
def test_a_failing_cost_estimate_is_skipped_and_the_roofline_decides(fresh_registry, answer):
    reg = fresh_registry(POLYHAL_BACKENDS="cpu", POLYHAL_CPU_DEVICES="2", POLYHAL_POLICY="cost")

    class Bad:
        @polyhal.hookimpl
        def estimate_cost(self, device_spec, workload):
            if isinstance(answer, Exception):
                raise answer
            return answer

    reg.register(Bad(), name="badcost")
    with pytest.warns(RuntimeWarning, match="plugin 'badcost' .*estimate_cost.*skipped"):
        d = AllocatorSelector(reg).select(_cands(reg), DL, BufferUsage.DEFAULT, workload=Workload("exp"))
    assert d.plugin == "polyhal.policies.cost" and "by cpu's estimate_cost" in d.reason  # the next plugin's estimate


def test_a_failing_encoding_resolver_is_skipped(fresh_registry):
    reg = fresh_registry(POLYHAL_BACKENDS="cpu")

    class Bad:
        @polyhal.hookimpl
        def resolve_encoding(self, device, encoding, tensor_type):
            raise RuntimeError("boom")

    reg.register(Bad(), name="badresolver")
    b = polyhal.ProgramBuilder("mm")
    x, w = b.input("x", (8, 8)), b.input("w", (8, 8))
    b.output(b.matmul(x, w))
    with pytest.warns(RuntimeWarning, match="plugin 'badresolver' raised in resolve_encoding.*boom.*skipped"):
        plan = polyhal.compile(b.build(), "cpu:0", data_tiling=True, registry=reg)
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    np.testing.assert_allclose(plan(x, x).numpy(), x @ x, rtol=1e-5)


def test_a_failing_memory_space_policy_is_skipped(fresh_registry):
    reg = fresh_registry(POLYHAL_BACKENDS="cpu")

    class Bad:
        @polyhal.hookimpl
        def select_memory_space(self, device, kernel, scratch, limits):
            return "somewhere"

    reg.register(Bad(), name="badspace")
    b = polyhal.ProgramBuilder("nms")
    bx, sc = b.input("boxes", (1, 16, 4)), b.input("scores", (1, 1, 16))
    b.output(*b.non_max_suppression(bx, sc, max_output_boxes_per_class=16, iou_threshold=0.5))
    with pytest.warns(RuntimeWarning, match="plugin 'badspace' .*select_memory_space.*skipped"):
        plan = polyhal.compile(b.build(), "cpu:0", registry=reg)
    assigned = [a for group in plan.buffer_plan.scratch.values() for a in group]
    assert assigned and all(a.plugin == "polyhal.policies.memory_space" for a in assigned)


# -- POLYHAL_PLUGIN_TIMEOUT --------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["nan", "-1", "-inf"])  # "abc": tests/test_plugin_isolation.py
def test_a_bad_plugin_timeout_names_the_variable(fresh_registry, install_plugin, value):
    install_plugin("any", "POLYHAL_API_VERSION = 1\n")
    with pytest.raises(polyhal.ConfigError, match=f"POLYHAL_PLUGIN_TIMEOUT={value!r} .*seconds"):
        fresh_registry(POLYHAL_PLUGIN_TIMEOUT=value)


def test_an_infinite_plugin_timeout_waits_on_the_loader_thread(fresh_registry, install_plugin, good_backend):
    install_plugin("good", good_backend("good:0", "good"))
    reg = fresh_registry(POLYHAL_PLUGIN_TIMEOUT="inf", POLYHAL_CPU_DEVICES="1")
    assert not reg.failures and "good:0" in [s.name for s in reg.device_specs()]


# -- interrupts on the loader thread -----------------------------------------------------------------

def test_a_keyboard_interrupt_raised_by_a_plugin_import_is_that_plugins_failure(fresh_registry, install_plugin):
    install_plugin("interrupter", "raise KeyboardInterrupt\n")
    try:
        reg = fresh_registry(POLYHAL_CPU_DEVICES="1")
    except KeyboardInterrupt:
        pytest.fail("a KeyboardInterrupt raised on the loader thread escaped: every registry fails the same way")
    assert any(f.plugin == "interrupter" and "KeyboardInterrupt" in f.reason for f in reg.failures)
    assert reg.get_device().name in {s.name for s in reg.device_specs()}  # the default device works


# -- kernels at run time -----------------------------------------------------------------------------

@pytest.mark.parametrize("devices", [["lossy:0"], ["lossy:0", "cpu:0"]])  # replayed, and the plain step loop
def test_a_kernel_raising_at_run_time_names_device_op_and_plugin(fresh_registry, install_plugin, devices):
    install_plugin("lossy", FAILING_KERNEL)
    reg = fresh_registry(POLYHAL_CPU_DEVICES="1")
    b = polyhal.ProgramBuilder("p")
    x = b.input("x", (4,))
    b.output(b.op("exp", b.neg(x), affinity=polyhal.Optimal("lossy:0")))
    plan = polyhal.compile(b.build(), devices, registry=reg)
    with pytest.raises(errors.KernelError, match=r"kernel 'exp' on device lossy:0 \(plugin 'lossy'\).*OSError: device lost") as info:
        plan(np.ones(4, np.float32))
    assert isinstance(info.value.__cause__, OSError)
    assert (info.value.device, info.value.op, info.value.plugin) == ("lossy:0", "exp", "lossy")


# -- string memory types -----------------------------------------------------------------------------

@pytest.mark.parametrize("args", [(64, "HOST_VISIBLE"), (64, MemoryType.HOST_VISIBLE, "TRANSFER"), (64, 2.0)])
def test_string_memory_types_are_refused_as_polyhal_errors(args):
    allocator = polyhal.get_device("cpu:0").allocator
    adaptor = AllocatorAdaptor(allocator)
    adaptor.allocate(64, MemoryType.HOST_VISIBLE, BufferUsage.TRANSFER).release()  # the adaptor's fast path is warm
    for a in (allocator, adaptor):
        with pytest.raises(IncompatibleBufferError, match="must be polyhal.(MemoryType|BufferUsage) flags"):
            a.allocate(*args)


# -- plugins that hang or end the process at import --------------------------------------------------

def test_a_plugin_hanging_at_import_lets_polyhal_devices_answer_within_10_s(install_plugin, tmp_path):
    install_plugin("hang", "import time\ntime.sleep(60)\n")
    env = _subprocess_env(tmp_path, POLYHAL_CPU_DEVICES="1")
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "polyhal.cli", "devices"], env=env, capture_output=True, text=True,
                         timeout=60)
    took = time.perf_counter() - t0
    assert run.returncode == 0 and "plugin 'hang' failed" in run.stdout and "cpu:0" in run.stdout, run.stderr
    assert took <= 10, f"polyhal devices took {took:.1f} s"


def test_a_plugin_ending_the_process_at_import_is_named_on_the_next_run(install_plugin, tmp_path):
    install_plugin("exiter", "import os\nos._exit(7)\n")
    env = _subprocess_env(tmp_path)
    argv = [sys.executable, "-m", "polyhal.cli", "devices"]
    first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 7
    state = tmp_path / "state" / "polyhal"
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in state.iterdir())
    second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)  # no -v
    assert second.returncode == 7
    assert "plugin 'exiter'" in second.stderr and "polyhal_test_exiter" in second.stderr, second.stderr


def test_a_breadcrumb_in_a_folder_others_can_write_is_not_trusted(install_plugin, tmp_path):
    install_plugin("exiter", "import os\nos._exit(7)\n")
    env = _subprocess_env(tmp_path)
    argv = [sys.executable, "-m", "polyhal.cli", "devices"]
    assert subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120).returncode == 7
    state = tmp_path / "state" / "polyhal"
    state.chmod(0o777)
    second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert "plugin 'exiter'" not in second.stderr and "not private" in second.stderr, second.stderr
