"""The import layers of the core and the independence of the backends, as pyproject.toml's
import-linter contracts state them: a module imports only from its own layer and those below, no
package's modules import each other in a circle, no backend imports another, the core no backend,
and a backend only the HAL side of the core. Plus the one kind of circle import-linter cannot see:
a package that imports a child which imports the package back."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The root packages of the checkout: the core and every backend plugin.
PACKAGES = {"polyhal": ROOT / "core"} | {f"polyhal_{p}": ROOT / "plugins" / p
                                         for p in ("cpu", "opencl", "cuda", "hip", "gpu")}
#: What a backend may import of the core (besides ``polyhal`` itself, the public API): the
#: sixth contract forbids every other module, and a new core module must be put on one side.
BACKEND_API = {"hal", "ir", "ops", "errors", "config", "dlpack", "hookspecs", "testing", "codecache", "distribution", "progress"}


def _contract(name_start: str) -> dict:
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["name"].startswith(name_start)]
    return contract


def _package_circles(roots: dict[str, Path]) -> list[str]:
    """Every chain ``P -> ... -> P.child -> P``: a package whose import (directly or through other
    modules) reaches one of its own descendants that imports the package itself. Such a child
    runs while the package's ``__init__`` is half done, and what it takes from the package may
    not be there yet. ``acyclic_siblings`` compares only siblings, so it never sees these."""
    import grimp

    graph = grimp.build_graph(*roots, exclude_type_checking_imports=True, cache_dir=None)
    circles = []
    for package in sorted(m for m in graph.modules if graph.find_children(m)):
        for child in sorted(graph.find_modules_that_directly_import(package)):
            if child.startswith(package + "."):
                chain = graph.find_shortest_chain(importer=package, imported=child)
                if chain:
                    circles.append(" -> ".join((*chain, package)))
    return circles


def test_import_contracts_are_kept():
    if shutil.which("lint-imports") is None:
        pytest.fail("import-linter is a test requirement (requirements-test.txt): pip install import-linter")
    # The sources of this checkout first, whatever is installed (grimp follows the import path).
    paths = [ROOT / "core"] + [ROOT / "plugins" / p for p in ("cpu", "opencl", "cuda", "hip", "gpu", "ray")]
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


def test_no_package_imports_a_child_that_imports_it_back():
    sys.path[:0] = [str(p) for p in PACKAGES.values()]  # grimp reads the sources on the import path
    try:
        circles = _package_circles(PACKAGES)
    finally:
        del sys.path[:len(PACKAGES)]
    assert not circles, "import circles between a package and its children:\n" + "\n".join(circles)


def test_a_package_child_circle_is_caught(tmp_path):
    """The check is not vacuous: a child that takes a name from the package that imports it."""
    pkg = tmp_path / "circled"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from circled import child\nNAME = 1\n")
    (pkg / "child.py").write_text("from circled import NAME\n")
    (pkg / "leaf.py").write_text("import circled.child\n")  # a sibling import is no circle
    sys.path.insert(0, str(tmp_path))
    try:
        assert _package_circles({"circled": tmp_path}) == ["circled -> circled.child -> circled"]
    finally:
        sys.path.remove(str(tmp_path))


def test_every_core_module_is_open_or_closed_to_backends():
    """A new core module must be named in the backend contract's forbidden list or in BACKEND_API."""
    forbidden = {m.removeprefix("polyhal.") for m in _contract("backends stand on the HAL")["forbidden_modules"]}
    core = ROOT / "core" / "polyhal"
    children = {p.stem for p in core.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in core.iterdir() if (p / "__init__.py").exists()}
    assert not forbidden & BACKEND_API
    assert children == forbidden | BACKEND_API, (
        f"unclassified: {sorted(children - forbidden - BACKEND_API)}; gone: {sorted((forbidden | BACKEND_API) - children)}")


def test_a_backend_reaching_into_the_compiler_is_caught(tmp_path):
    """The backend contract is not vacuous: a backend module that imports a pass breaks it."""
    contract = _contract("backends stand on the HAL")
    shutil.copytree(ROOT / "core" / "polyhal", tmp_path / "polyhal")
    shutil.copytree(ROOT / "plugins" / "gpu" / "polyhal_gpu", tmp_path / "polyhal_gpu")
    (tmp_path / "polyhal_gpu" / "reach.py").write_text("import polyhal\nfrom polyhal.passes import bufferize\n")
    config = tmp_path / ".importlinter"
    config.write_text("[importlinter]\nroot_packages =\n    polyhal\n    polyhal_gpu\n"
                      "exclude_type_checking_imports = true\n\n[importlinter:contract:backends]\n"
                      f"name = {contract['name']}\ntype = forbidden\nsource_modules = polyhal_gpu\n"
                      "forbidden_modules =\n" + "".join(f"    {m}\n" for m in contract["forbidden_modules"])
                      + f"allow_indirect_imports = {str(contract['allow_indirect_imports']).lower()}\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    run = subprocess.run(["lint-imports", "--no-cache", "--config", str(config)], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert run.returncode != 0 and "polyhal_gpu.reach -> polyhal.passes" in run.stdout, run.stdout[-3000:]
    assert "polyhal_gpu.reach -> polyhal\n" not in run.stdout  # the public API is allowed


def test_import_polyhal_leaves_the_heavy_dependencies_out():
    """ml_dtypes (the storage types) and onnx (the front end) are imported when first needed,
    not by ``import polyhal`` (bench/import_time.py times it); both still work once asked for."""
    paths = os.pathsep.join(str(p) for p in PACKAGES.values())
    probe = ("import sys, polyhal\n"
             "print(sorted(m for m in ('ml_dtypes', 'onnx') if m in sys.modules))\n"
             "print(polyhal.TensorType((2,), 'bfloat16'), 'ml_dtypes' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ, PYTHONPATH=paths),
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == ["[]", "tensor<2xbfloat16> True"]
