"""Every hook is called through pluggy (polyhal.hookcall): new-style ``wrapper=True`` and old-style
``hookwrapper=True`` implementations of each firstresult hook run, see the answer and may replace
it; ``pm.add_hookcall_monitoring`` sees every call; explain names the plugin whose answer stands."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal
from polyhal import BufferUsage, MemoryType
from polyhal.hal.adaptors import StatisticsAdaptor
from polyhal.hal.scratch import KernelInfo, MemoryLimits, MemorySpace, Problem, ScratchDecl, place_scratch
from polyhal.hookcall import PluginManager
from polyhal.ir.encoding import LHS, IdentityLayout, MatmulEncoding
from polyhal.ir.types import TensorType
from polyhal.policies.layouts import LayoutResolver
from polyhal.policy import AllocatorSelector, selector_for

DL = MemoryType.DEVICE_LOCAL


@pytest.fixture
def reg(fresh_registry, monkeypatch):
    monkeypatch.delenv("POLYHAL_ALLOCATOR", raising=False)
    monkeypatch.delenv("POLYHAL_POLICY", raising=False)
    return fresh_registry(POLYHAL_BACKENDS="cpu", POLYHAL_CPU_DEVICES="2")


def _wrapper(hook: str, style: str, change, seen: list):
    """A plugin with a hook wrapper of ``hook``: new style (``wrapper=True``) or old style
    (``hookwrapper=True``). It records each answer it sees in ``seen`` and replaces it with
    ``change(answer)`` when that is not None. (A wrapper may take none of the hook's arguments.)"""
    if style == "new":
        def impl(self):
            answer = yield
            seen.append(answer)
            replaced = change(answer)
            return answer if replaced is None else replaced

        marked = polyhal.hookimpl(wrapper=True, specname=hook)(impl)
    else:
        def impl(self):
            outcome = yield
            seen.append(outcome.get_result())
            replaced = change(outcome.get_result())
            if replaced is not None:
                outcome.force_result(replaced)

        marked = polyhal.hookimpl(hookwrapper=True, specname=hook)(impl)
    return type(f"{style.title()}StyleWrapper", (), {"around": marked})()


STYLES = ["new", "old"]


@pytest.mark.parametrize("style", STYLES)
def test_select_allocator_wrapper_sees_and_changes_the_answer(reg, style):
    seen: list = []
    reg.register(_wrapper("select_allocator", style, lambda answer: 1, seen), name="wrapper")
    specs = reg.device_specs()
    selector = selector_for(reg)
    decision = selector.select(tuple((s, -1) for s in specs), DL, BufferUsage.DEFAULT)
    assert seen == [0]  # the default 'first' policy's answer, seen by the wrapper
    assert decision.device_name == specs[1].name and decision.plugin == "wrapper"
    assert "replaced polyhal.policies.first's answer" in decision.reason
    assert "by wrapper: wrapper's hook wrapper replaced" in selector.explain()


def test_select_allocator_wrapper_that_keeps_the_answer_leaves_the_deciding_plugin(reg):
    seen: list = []
    reg.register(_wrapper("select_allocator", "new", lambda answer: None, seen), name="new")
    reg.register(_wrapper("select_allocator", "old", lambda answer: None, seen), name="old")
    spec = reg.device_specs()[0]
    decision = AllocatorSelector(reg).select(((spec, -1),), DL, BufferUsage.DEFAULT)
    assert seen == [0, 0]
    assert decision.plugin == "polyhal.policies.first"


@pytest.mark.parametrize("style", STYLES)
def test_resolve_encoding_wrapper_sees_and_changes_the_answer(reg, style):
    seen: list = []
    reg.register(_wrapper("resolve_encoding", style, lambda layout: IdentityLayout(layout.tensor_type), seen),
                 name="wrapper")
    t = TensorType((8, 16), "float32", MatmulEncoding(LHS, ("float32",) * 3, (8, 8, 16)))
    resolution = LayoutResolver(reg.specs_by_name(), reg.pm, reg.policy_answer).resolve("cpu:0", t)
    assert len(seen) == 1 and not seen[0].is_identity_layout()  # the CPU resolver's packed layout
    assert resolution.layout.is_identity_layout() and resolution.plugin == "wrapper"


@pytest.mark.parametrize("style", STYLES)
def test_select_memory_space_wrapper_sees_and_changes_the_answer(reg, style):
    seen: list = []
    reg.register(_wrapper("select_memory_space", style, lambda space: MemorySpace.GLOBAL, seen), name="wrapper")
    req = ScratchDecl("tile", True, 64, 0, ()).request(Problem("op", {}, (), ()), KernelInfo("k", "op", 32, 4))
    spec = polyhal.DeviceSpec(name="fake:0", backend="fake", rank=0, factory=lambda s: None,
                              heaps=reg.device_specs()[0].heaps, workgroup_bytes=1024)
    (placed,) = place_scratch((req,), MemoryLimits.of(spec), spec.name, reg.memory_space_policy(spec))
    assert seen == [MemorySpace.WORKGROUP]  # the default policy's answer
    assert placed.space is MemorySpace.GLOBAL and placed.plugin == "wrapper"


@pytest.mark.parametrize("style", STYLES)
def test_wrap_allocator_wrapper_sees_and_changes_each_step(reg, style):
    class Pool:
        @polyhal.hookimpl
        def wrap_allocator(self, device, memory_type, allocator):
            from polyhal.hal.adaptors import CachingPoolAdaptor

            return CachingPoolAdaptor(allocator)

    seen: list = []
    reg.register(Pool(), name="pool")
    reg.register(_wrapper("wrap_allocator", style, lambda a: a and StatisticsAdaptor(a), seen), name="wrapper")
    dev = reg.get_device("cpu:0")
    kinds = [type(a).__name__ for a in seen]
    assert "CachingPoolAdaptor" in kinds  # the wrapper saw the pool plugin's answer
    assert isinstance(dev.allocator, StatisticsAdaptor)  # and replaced it
    t = polyhal.empty((4,), "float32", dev)
    assert dev.allocator.counters.current_bytes >= t.nbytes
    t.release()


def test_wrapper_exceptions_and_errors_name_the_plugin(reg):
    class Raises:
        @polyhal.hookimpl
        def select_allocator(self, candidates, memory_type, buffer_usage, flags):
            raise RuntimeError("no decision today")

    reg.register(Raises(), name="raiser")
    spec = reg.device_specs()[0]
    with pytest.warns(RuntimeWarning, match="plugin 'raiser' raised in select_allocator.*no decision today.*skipped"):
        d = AllocatorSelector(reg).select(((spec, -1),), DL, BufferUsage.DEFAULT)
    assert d.plugin != "raiser"


def test_monitoring_sees_every_hook_call(reg):
    calls: list[str] = []
    undo = reg.pm.add_hookcall_monitoring(lambda name, impls, kwargs: calls.append(name), lambda *a: None)
    try:
        reg.unregister(name="polyhal.policies.adaptors")  # (a change: device specs are collected again)
        reg.register(__import__("polyhal.policies.adaptors", fromlist=["x"]), name="polyhal.policies.adaptors")
        b = polyhal.ProgramBuilder("mm")
        x, w = b.input("x", (8, 16)), b.input("w", (16, 8))
        b.output(b.matmul(x, w))
        plan = polyhal.compile(b.build(), "cpu:0", registry=reg, data_tiling=True)
        reg.unavailable_reasons()
    finally:
        undo()
    for hook in ("register_devices", "wrap_allocator", "select_allocator", "resolve_encoding", "report_unavailable"):
        assert hook in calls, (hook, sorted(set(calls)))
    rng = np.random.default_rng(0)
    before = len(calls)
    undo = reg.pm.add_hookcall_monitoring(lambda name, impls, kwargs: calls.append(name), lambda *a: None)
    try:
        plan(rng.standard_normal((8, 16), np.float32), rng.standard_normal((16, 8), np.float32))
    finally:
        undo()
    assert len(calls) == before  # a plan's run calls no hook


def test_direct_pluggy_calls_still_work(reg):
    """Implementations keep their plain behaviour when a user calls the hook through pluggy."""
    spec = reg.device_specs()[0]
    assert reg.pm.hook.select_allocator(candidates=((spec, -1),), memory_type=DL, buffer_usage=BufferUsage.DEFAULT,
                                        flags=0) == 0
    assert isinstance(reg.pm, PluginManager)
    assert any(isinstance(s, polyhal.DeviceSpec) for specs in reg.pm.hook.register_devices() for s in specs)


def test_installed_pluggy_is_within_the_pin_the_recording_layer_needs():
    """polyhal.hookcall sets its recording layer as each HookImpl's ``function`` (which pluggy types
    Final): pyproject.toml pins the pluggy releases that allows (.ci/run runs the rest of this
    file against pluggy's newest release, ``-k "not within_the_pin"``)."""
    import tomllib
    from pathlib import Path

    import pluggy
    from packaging.requirements import Requirement

    deps = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [Requirement(d) for d in deps if Requirement(d).name == "pluggy"]
    assert pin.specifier.contains(pluggy.__version__), (pluggy.__version__, str(pin))
    assert "<" in str(pin.specifier), "pluggy needs an upper bound: HookImpl.function is Final in pluggy's types"


def test_recording_layer_keeps_each_implementations_signature_and_answer(reg):
    """What the layer relies on, for the installed pluggy: HookImpl.function is what pluggy calls,
    and the argnames pluggy read from the plugin's function stay."""
    class Answers:
        @polyhal.hookimpl
        def select_allocator(self, candidates, memory_type):
            return len(candidates) - 1

    plugin = Answers()
    reg.register(plugin, name="answers")
    (impl,) = [i for i in reg.pm.hook.select_allocator.get_hookimpls() if i.plugin is plugin]
    assert impl.function is not plugin.select_allocator and impl.argnames == ("candidates", "memory_type")
    specs = reg.device_specs()
    answer = reg.pm.first_answer("select_allocator", candidates=tuple((s, -1) for s in specs), memory_type=DL,
                                 buffer_usage=BufferUsage.DEFAULT, flags=0)
    assert (answer.value, answer.plugin, answer.answered) == (len(specs) - 1, "answers", "answers")
