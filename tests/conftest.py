"""Fixtures for core tests: installing throwaway plugin distributions for real."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import polyhal


_BUILD_LEFTOVERS = shutil.ignore_patterns("build", "*.egg-info", "__pycache__")


def _source_digest(source: Path) -> str:
    h = hashlib.sha256(sys.version.encode())
    for p in sorted(source.rglob("*")):
        if p.is_file() and not {"build", "__pycache__"} & set(p.parts) and ".egg-info" not in str(p):
            h.update(str(p.relative_to(source)).encode() + p.read_bytes())
    return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def pip_target(request, tmp_path_factory):
    """``pip_target(source)``: ``pip install --target`` the distribution in folder ``source`` (a
    built wheel: its dist-info and entry points, exactly as a user gets it) into a folder of its
    own, returned for ``sys.path`` or ``PYTHONPATH``; the user's environment is left as it was.
    Installs are kept in pytest's cache, keyed by the sources' hash, so that later runs skip the
    few seconds pip takes."""
    cache = getattr(request.config, "cache", None)

    def install(source: Path) -> Path:
        root = Path(cache.mkdir(f"polyhal-{source.name}")) if cache is not None else tmp_path_factory.mktemp("site")
        target = root / _source_digest(source)
        if not (target / ".installed").exists():
            src = tmp_path_factory.mktemp("src") / source.name
            shutil.copytree(source, src, ignore=_BUILD_LEFTOVERS)  # pip's build leaves build/ and egg-info behind
            shutil.rmtree(target, ignore_errors=True)
            cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                   "--no-index", "--disable-pip-version-check", "--target", str(target), str(src)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                pytest.fail(f"pip could not install {source}:\n{done.stdout}\n{done.stderr}")
            (target / ".installed").write_text(" ".join(cmd))
        return target

    return install


@pytest.fixture(scope="session")
def template_site(pip_target) -> Path:
    """The backend template (examples/backend-template, device ``mydev:0``), pip-installed into a
    folder of its own: only the tests that ask for it see it."""
    return pip_target(Path(__file__).resolve().parents[1] / "examples" / "backend-template")


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
