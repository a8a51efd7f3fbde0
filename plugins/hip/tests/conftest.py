"""Fixtures of the HIP backend's tests.

Three kinds of test live here, and each says which it is:

* **real ROCm, no GPU** (``real_runtime``): calls into Debian's ROCm runtime (libamdhip64) and
  hiprtc through hip-python -- error mapping, version checks, no-device registration, kernel
  compiles. They skip, saying what to install, where the runtime or the bindings are missing.
* **stand-in** (``fake``, ``fake_device``): the same plugin code over ``FakeHipRuntime -- a
  stand-in, not ROCm`` (fake_runtime.py): allocation, free-by-kind, exports, streams.
* **hardware** (``hip``): need an AMD GPU; they skip here. ``python -m polyhal_hip.selftest``
  is the way to run them on one.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # fake_runtime, for tests run in importlib mode

import polyhal  # noqa: E402
from polyhal.registry import Registry, set_default_registry  # noqa: E402

from fake_runtime import FakeHipRuntime, gpu  # noqa: E402

INSTALL = "apt-get install libamdhip64-dev && pip install -r requirements-test.txt (hip-python 6.2)"


@functools.lru_cache(maxsize=1)
def real_runtime_reason() -> str:
    """Empty when the real runtime (bindings and library) answers calls, else why not."""
    try:
        from polyhal_hip.runtime import HipPythonRuntime

        rt = HipPythonRuntime()
        rt.runtime_version()
    except Exception as exc:  # noqa: BLE001
        first = str(exc).split(";")[0].split(" (")[0]
        return f"ROCm runtime or hip-python missing ({type(exc).__name__}: {first}); to test: {INSTALL}"
    return ""


@functools.lru_cache(maxsize=1)
def _real():
    from polyhal_hip.runtime import HipPythonRuntime

    return HipPythonRuntime()


@functools.lru_cache(maxsize=1)
def compiler_reason() -> str:
    """Empty when hiprtc compiles here, else why not."""
    reason = real_runtime_reason()
    if reason:
        return reason
    try:
        _real().compiler_version()
    except Exception as exc:  # noqa: BLE001
        return f"hiprtc cannot be loaded ({type(exc).__name__}: {str(exc)[:200]}); to test: {INSTALL}"
    return ""


@pytest.fixture
def real_runtime():
    """The real HIP runtime facade (Debian's ROCm 5.2 here; no GPU). Skips, saying why."""
    reason = real_runtime_reason()
    if reason:
        pytest.skip(reason)
    return _real()


@pytest.fixture
def real_compiler(real_runtime):
    reason = compiler_reason()
    if reason:
        pytest.skip(reason)
    return real_runtime


@pytest.fixture
def use_runtime():
    """Install a runtime as the plugin's (``use_runtime(fake)``); the real one comes back after."""
    from polyhal_hip import runtime

    olds = []

    def use(rt):
        olds.append(runtime.set_runtime(rt))
        return rt

    yield use
    if olds:
        runtime.set_runtime(olds[0])


class SessionCompiler:
    """The real hiprtc (in polyhal-hip's compile worker process: this test process may hold
    PoCL's LLVM, which clashes with comgr's), memoized for the whole test session: every
    FakeHipRuntime compiles through it, so a kernel several tests prepare is compiled once."""

    def __init__(self, real) -> None:
        self.real, self.results, self.count = real, {}, 0

    def compile(self, source, name, options, expressions=()):
        key = (source, tuple(options), tuple(expressions))
        if key not in self.results:
            self.count += 1
            self.results[key] = self.real.compile(source, name, options, expressions)
        return self.results[key]


@functools.lru_cache(maxsize=1)
def session_compiler():
    from polyhal_hip.compiler import worker

    compiler = SessionCompiler(worker())
    compiler.compiler_version = _real().compiler_version  # type: ignore[method-assign]
    return compiler


@pytest.fixture
def make_fake(use_runtime):
    """``make_fake(**fields)``: a FakeHipRuntime (compiling with the real hiprtc where there is
    one), installed as the plugin's runtime."""
    def make(**kw):
        if "compiler" not in kw and not compiler_reason():
            kw["compiler"] = session_compiler()
        return use_runtime(FakeHipRuntime(**kw))
    return make


@pytest.fixture
def needs_compiler():
    """Skip (saying why) where hiprtc is not available to the stand-in."""
    reason = compiler_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def fake(make_fake):
    """FakeHipRuntime -- a stand-in, not ROCm -- with one gfx90a-like GPU."""
    return make_fake()


@pytest.fixture
def fake_registry(fake, monkeypatch):
    """A default registry with the HIP plugin over the fake runtime (and the CPU backend)."""
    monkeypatch.setenv("POLYHAL_BACKENDS", "hip,cpu")
    monkeypatch.setenv("POLYHAL_HIP_CACHE_DIR", "off")
    reg = Registry()
    old = set_default_registry(reg)
    yield reg
    set_default_registry(old)


@pytest.fixture
def fake_device(fake_registry):
    """``hip:0`` over FakeHipRuntime (a stand-in, not ROCm)."""
    return fake_registry.get_device("hip:0")


@pytest.fixture
def hip():
    """An AMD GPU (skips here: no test machine of this project has one)."""
    specs = [s for s in polyhal.devices() if s.backend == "hip" and "fake-runtime" not in s.capabilities]
    if not specs:
        reasons = polyhal.default_registry().unavailable_reasons().get("hip", [])
        first = reasons[0].split(": no AMD GPU is visible")[0][:160] if reasons else "it registered none"
        pytest.skip(f"needs an AMD GPU; polyhal-hip says: {first} (`polyhal devices` says more)")
    return polyhal.get_device(specs[0].name)


class SeededRng:
    """A numpy Generator that remembers its seed (for failure messages)."""

    def __init__(self, seed: int) -> None:
        import numpy as np

        self.seed_value = seed
        self._gen = np.random.default_rng(seed)

    def __getattr__(self, name):
        return getattr(self._gen, name)


@pytest.fixture
def rng():
    return SeededRng(int.from_bytes(os.urandom(4), "little"))


__all__ = ["FakeHipRuntime", "gpu"]
