"""Fixtures for core tests: installing throwaway plugin distributions for real."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

import polyhal


@pytest.fixture
def template_registry(template_site, monkeypatch, fresh_registry):
    """A fresh default registry that discovers the backend template beside the CPU backend."""
    monkeypatch.syspath_prepend(str(template_site))
    yield fresh_registry(POLYHAL_BACKENDS="cpu,mydev")
    for name in [m for m in sys.modules if m == "polyhal_mydev" or m.startswith("polyhal_mydev.")]:
        del sys.modules[name]


@pytest.fixture(scope="session", autouse=True)
def private_state_home(tmp_path_factory):
    """Breadcrumbs of plugins that end a test's child process (registry: ``$XDG_STATE_HOME/polyhal``)
    go to a folder of this test session, never to the user's own state folder, where the user's
    next ``polyhal`` run would name the test's plugin."""
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
    yield
    mp.undo()


@pytest.fixture
def install_plugin(tmp_path, monkeypatch):
    """Write a plugin module and a ``*.dist-info`` with its entry point onto sys.path, so that
    importlib.metadata discovers it exactly as it would a pip-installed distribution."""
    monkeypatch.syspath_prepend(str(tmp_path))
    made = []

    def install(name: str, source: str, group: str = "polyhal.backends", entry: str | None = None) -> str:
        module = f"polyhal_test_{name}"
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        dist = tmp_path / f"polyhal_test_{name}-0.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: polyhal-test-{name}\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text(f"[{group}]\n{entry or name} = {module}\n")
        made.append(module)
        return module

    yield install
    for m in made:
        sys.modules.pop(m, None)


GOOD_BACKEND = '''
import polyhal
from polyhal_cpu.device import CPUDevice
from polyhal_cpu.allocator import host_heap
POLYHAL_API_VERSION = polyhal.API_VERSION
created = []
def factory(spec):
    created.append(spec.name)
    return CPUDevice(spec)
@polyhal.hookimpl
def register_devices():
    return [polyhal.DeviceSpec(name="{name}", backend="{backend}", rank={rank}, factory=factory,
                               heaps=(host_heap(),))]
'''


@pytest.fixture
def good_backend():
    """Source of a small real backend (the CPU device under another name)."""
    return lambda name, backend, rank=5: GOOD_BACKEND.format(name=name, backend=backend, rank=rank)


__all__ = ["polyhal", "Path"]
