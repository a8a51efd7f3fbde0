"""The backend template (examples/backend-template) passes the conformance suite through the
command its documentation gives, installed for this test only, and the suite says what a device
lacks instead of failing bare."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _conformance(*args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "polyhal.testing.conformance", "-q",
                           "-rfEs", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, env=env, timeout=600)


def test_template_passes_conformance(template_site):
    run = _conformance("--polyhal-backend=mydev", path=str(template_site))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "passed" in run.stdout and "mydev:0" in run.stdout  # skip reasons name the device


# bare:0 has neither an allocator nor kernels; bare:1 has an allocator and no kernel table.
BARE = '''
import numpy as np
import polyhal
POLYHAL_API_VERSION = polyhal.API_VERSION
class BareAllocator(polyhal.Allocator):
    def _allocate(self, heap, nbytes):
        return np.empty(nbytes, np.uint8)
    def _free(self, heap, native):
        pass
class BareDevice(polyhal.Device):
    def __init__(self, spec):
        super().__init__(spec, BareAllocator(self, spec.heaps) if spec.name == "bare:1" else None)
HEAPS = (polyhal.Heap(polyhal.MemoryType.DEVICE_LOCAL, polyhal.BufferUsage.DEFAULT, 1 << 20),)
@polyhal.hookimpl
def register_devices():
    return [polyhal.DeviceSpec(name=f"bare:{i}", backend="bare", rank=-100, factory=BareDevice, heaps=HEAPS)
            for i in range(2)]
'''


def test_conformance_names_what_a_device_lacks(install_plugin, tmp_path):
    install_plugin("bare", BARE)
    run = _conformance("--polyhal-backend=bare", "-k", "optimal_and or kernel_matches_reference and relu "
                       "or plan_input", path=str(tmp_path))
    out = run.stdout
    assert run.returncode == 1, out + run.stderr
    assert "bare:0 has no allocator" in out and "polyhal.Allocator subclass" in out
    assert "AttributeError" not in out
    assert "bare:1 has no kernel for relu" in out and "bare:1 has no kernel for add" in out
    assert "1 passed" in out  # bare:1's allocator


def test_the_plugin_guide_shows_the_template():
    """The plugin guide (docs/plugins.md) shows the template's files as they are."""
    guide = (ROOT / "docs" / "plugins.md").read_text()
    blocks = re.findall(r"```(?:toml|python)\n# (\S+)\n(.*?)```", guide, re.S)
    assert {name for name, _ in blocks} == {"pyproject.toml", "polyhal_mydev/plugin.py", "polyhal_mydev/kernels.py"}
    for name, body in blocks:
        assert body.strip() in (ROOT / "examples/backend-template" / name).read_text(), name


def test_the_template_is_not_left_installed_by_the_test_commands():
    """The README's test command and CI install the template nowhere: its test does, privately."""
    for text in ((ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()):
        assert "-e examples/backend-template" not in text
