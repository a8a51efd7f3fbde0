"""Fixtures shared by the core's tests (tests/) and the plugins' tests (plugins/*/tests): installing
throwaway distributions for real, without touching the user's environment."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


_BUILD_LEFTOVERS = shutil.ignore_patterns("build", "*.egg-info", "__pycache__")

# The CPU's compiled loops are built in the foreground in a test session: a process that finds
# them unbuilt would otherwise run on the library tier while a background build goes on, and the
# tests of the loops would skip or pass depending on when the build ends. (The tiers themselves
# are tested with this variable set in their subprocesses: plugins/cpu/tests/test_cpu_native_aot.py.)
os.environ.setdefault("POLYHAL_CPU_AOT_WAIT", "1")


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
    return pip_target(Path(__file__).resolve().parent / "examples" / "backend-template")


@pytest.fixture(scope="session", autouse=True)
def _onnx_check_cache(tmp_path_factory):
    """The ONNX front end's checked-model cache in a folder of this test session (unless the
    environment names one): the fuzzers' mutants stay out of the user's cache."""
    with pytest.MonkeyPatch.context() as mp:
        if "POLYHAL_ONNX_CACHE_DIR" not in os.environ:
            mp.setenv("POLYHAL_ONNX_CACHE_DIR", str(tmp_path_factory.mktemp("onnx-checked")))
        yield
