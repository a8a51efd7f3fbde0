"""The import layers of the core and the independence of the backends, as pyproject.toml's
import-linter contracts state them: a module imports only from its own layer and those below, no
package's modules import each other in a circle, no backend imports another, the core no backend."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    if shutil.which("lint-imports") is None:
        pytest.fail("import-linter is a test requirement (requirements-test.txt): pip install import-linter")
    # The sources of this checkout first, whatever is installed (grimp follows the import path).
    paths = [ROOT / "core"] + [ROOT / "plugins" / p for p in ("cpu", "opencl", "cuda", "hip", "gpu")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, paths)))
    run = subprocess.run(["lint-imports", "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "broken" not in run.stdout.lower().split("contracts:")[-1].replace("0 broken", "")


def test_a_layer_violation_is_caught(tmp_path):
    """The contract is not vacuous: a hal module that imports the registry breaks it."""
    core = tmp_path / "core"
    shutil.copytree(ROOT / "core" / "polyhal", core / "polyhal")
    (core / "polyhal" / "hal" / "upward.py").write_text("from polyhal.registry import default_registry\n")
    config = tmp_path / "contracts.toml"
    config.write_text('[tool.importlinter]\nroot_packages = ["polyhal"]\nexclude_type_checking_imports = true\n'
                      + (ROOT / "pyproject.toml").read_text().split("[[tool.importlinter.contracts]]")[1]
                      .join(["[[tool.importlinter.contracts]]", ""]))
    env = dict(os.environ, PYTHONPATH=str(core))
    run = subprocess.run(["lint-imports", "--no-cache", "--config", str(config)], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert run.returncode != 0 and "polyhal.hal.upward -> polyhal.registry" in run.stdout, run.stdout[-3000:]
