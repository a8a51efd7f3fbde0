"""What an installed polyhal tells about itself: one version (the distribution's metadata), the
plugins' versions, and install hints that work for how it was installed (issue 31's packaging)."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest

import polyhal
from polyhal import distribution
from polyhal.cli import main
from polyhal.distribution import install_hint

ROOT = Path(__file__).resolve().parents[1]


def test_polyhal_version_prints_the_distribution_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"polyhal {metadata.version('polyhal')}"


def test_the_module_version_is_the_distribution_version():
    assert polyhal.__version__ == metadata.version("polyhal")
    assert "__version__" in dir(polyhal)
    assert "version =" not in (ROOT / "core" / "polyhal" / "__init__.py").read_text()  # written once


def test_polyhal_plugins_shows_each_plugins_distribution_and_version(capsys):
    assert main(["plugins", "--no-create", "--json"]) == 0
    rows = {p["plugin"]: p for p in json.loads(capsys.readouterr().out)["plugins"]}
    assert (rows["cpu"]["distribution"], rows["cpu"]["version"]) == ("polyhal-cpu", metadata.version("polyhal-cpu"))
    assert rows["polyhal.policies.first"]["distribution"] is None  # registered in code, not installed
    assert main(["plugins", "--no-create"]) == 0
    assert f"cpu (polyhal-cpu {metadata.version('polyhal-cpu')}): " in capsys.readouterr().out


def test_from_a_checkout_a_hint_names_the_plugin_folder(monkeypatch):
    # This suite runs from a checkout, its plugins installed in editable mode (or not at all).
    monkeypatch.chdir(ROOT)
    assert install_hint("polyhal-cpu") == "pip install -e plugins/cpu"
    assert install_hint("polyhal-cuda", "cuda13") == "pip install -e 'plugins/cuda[cuda13]'"
    assert install_hint("polyhal", "images") == "pip install -e '.[images]'"


def test_outside_the_checkout_a_hint_gives_the_folder_in_full(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert install_hint("polyhal-cpu") == f"pip install -e {ROOT / 'plugins' / 'cpu'}"


def test_without_a_checkout_folder_a_hint_names_the_distribution():
    assert install_hint("polyhal-nosuch") == "pip install polyhal-nosuch"
    assert install_hint("polyhal-nosuch", "x") == "pip install 'polyhal-nosuch[x]'"


def test_a_distribution_installed_from_an_index_is_named_even_in_a_checkout(monkeypatch, tmp_path):
    # A checkout that holds a folder for pluggy, which is installed from an index (not editable).
    (tmp_path / "core" / "polyhal").mkdir(parents=True)
    (tmp_path / "plugins" / "pluggy").mkdir(parents=True)
    (tmp_path / "plugins" / "pluggy" / "pyproject.toml").write_text("")
    monkeypatch.setattr(distribution, "_CHECKOUT", tmp_path)
    assert distribution.checkout_folder("polyhal-nosuch") is None
    assert install_hint("pluggy") == "pip install pluggy"


def test_no_device_is_hinted_the_way_polyhal_was_installed(monkeypatch):
    from polyhal.errors import DeviceNotFoundError
    from polyhal.registry import Registry

    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("POLYHAL_BACKENDS", raising=False)
    with pytest.raises(DeviceNotFoundError, match=r"install a backend \(pip install -e plugins/cpu\)"):
        Registry(autoload=False).get_device()


# ------------------------------------------------------------------------ every distribution

DISTRIBUTIONS = [ROOT, *sorted(p for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").is_file()),
                 ROOT / "examples" / "backend-template"]


def _project(folder: Path) -> dict:
    import tomllib

    return tomllib.loads((folder / "pyproject.toml").read_text())["project"]


@pytest.mark.parametrize("folder", DISTRIBUTIONS, ids=lambda p: p.relative_to(ROOT).as_posix() or ".")
def test_every_distribution_carries_the_license_classifiers_and_one_version(folder):
    project = _project(folder)
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    # The license travels in each wheel: a copy beside each pyproject, the same text as the root's.
    assert (folder / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()
    assert "Programming Language :: Python :: 3" in project["classifiers"]
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]  # PEP 639: the expression says it
    assert "version" in project and "version" not in project.get("dynamic", [])
    package = folder / "core" / "polyhal" if folder == ROOT else next(folder.glob("polyhal_*"))
    assert not [p for p in package.rglob("*.py") if "__version__ =" in p.read_text()]  # written once: the pyproject


def test_the_test_extra_is_requirements_test_txt():
    lines = [line.strip() for line in (ROOT / "requirements-test.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert _project(ROOT)["optional-dependencies"]["test"] == lines, (
        "the test extra of pyproject.toml and requirements-test.txt differ: list each requirement in both")


def test_the_cpu_extra_gives_a_working_device():
    assert _project(ROOT)["optional-dependencies"]["cpu"] == [f"{_project(ROOT / 'plugins' / 'cpu')['name']}>=0.1"]
