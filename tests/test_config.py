"""polyhal.config: settings records read from the environment, their errors, and the documentation's one
table of every variable (generated from the records, and complete: no code reads a POLYHAL_*
variable that no record declares)."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import FrozenInstanceError, dataclass
from pathlib import Path

import pytest

import polyhal
from polyhal import config
from polyhal.config import Choice, Flag, Integer, Names, Number, Settings, Size, Text, setting

ROOT = Path(__file__).resolve().parents[1]
#: Where code that may read the environment lives.
SOURCES = [ROOT / d for d in ("core", "plugins", "tests", "bench", "examples")]
#: ``POLYHAL_*`` names that are no environment variable (a plugin module's API version attribute).
NOT_VARIABLES = {"POLYHAL_API_VERSION"}


@dataclass(frozen=True)
class Sample(Settings, component="sample"):
    """One field of each kind (declared here, in a test module: never in the documentation's table)."""

    on: bool = setting("POLYHAL_TEST_ON", Flag(), False, "a switch")
    count: int = setting("POLYHAL_TEST_COUNT", Integer(1, 8), 2, "a count")
    seconds: float = setting("POLYHAL_TEST_SECONDS", Number("seconds", low=0), 5.0, "a time")
    size: int = setting("POLYHAL_TEST_SIZE", Size(), 1 << 20, "a size")
    names: tuple[str, ...] | None = setting("POLYHAL_TEST_NAMES", Names(), None, "names")
    mode: str = setting("POLYHAL_TEST_MODE", Choice("fast", "safe", aliases={"1": "fast"}), "safe", "a mode")
    folder: str | None = setting("POLYHAL_TEST_FOLDER", Text(keep_blank=True), None, "a folder")


def test_defaults_when_unset_or_blank():
    assert Sample.from_env({}) == Sample()
    blank = {v.name: "  " for _, v in Sample.variables()}
    assert Sample.from_env(blank) == Sample(folder="")  # a blank folder is a value (off), the rest default


def test_values_are_parsed_by_type():
    got = Sample.from_env({"POLYHAL_TEST_ON": "Yes", "POLYHAL_TEST_COUNT": " 8 ", "POLYHAL_TEST_SECONDS": "inf",
                           "POLYHAL_TEST_SIZE": "64MiB", "POLYHAL_TEST_NAMES": "cuda, cpu,,",
                           "POLYHAL_TEST_MODE": "1", "POLYHAL_TEST_FOLDER": "/tmp/x"})
    assert got == Sample(True, 8, float("inf"), 64 << 20, ("cuda", "cpu"), "fast", "/tmp/x")
    assert Sample.from_env({"POLYHAL_TEST_ON": "off", "POLYHAL_TEST_MODE": "SAFE"}).on is False
    with pytest.raises(FrozenInstanceError):
        got.on = False  # type: ignore[misc]


@pytest.mark.parametrize("variable, value, says", [
    ("POLYHAL_TEST_ON", "maybe", "is not a switch (1, true, yes, on / 0, false, no, off)"),
    ("POLYHAL_TEST_COUNT", "9", "is not an integer in 1..8"),
    ("POLYHAL_TEST_COUNT", "two", "is not an integer in 1..8"),
    ("POLYHAL_TEST_SECONDS", "-1", "is not a number of seconds >= 0"),
    ("POLYHAL_TEST_SECONDS", "nan", "is not a number of seconds >= 0"),
    ("POLYHAL_TEST_SIZE", "a lot", "is not a size in bytes (e.g. 4096, 512MiB or 2GiB)"),
    ("POLYHAL_TEST_NAMES", ",", "is not a comma-separated list of names"),
    ("POLYHAL_TEST_MODE", "quick", "is not one of fast, safe (1 = fast)"),
])
def test_a_bad_value_names_the_variable_the_value_and_what_is_accepted(variable, value, says):
    with pytest.raises(polyhal.ConfigError) as info:
        Sample.from_env({variable: value})
    message = str(info.value)
    assert message.startswith(f"{variable}={value!r} {says}; unset it for the default"), message
    assert "[sample: " in message  # the component and the variable's meaning
    assert (info.value.variable, info.value.value) == (variable, value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, polyhal.PolyhalError)


def test_reads_follow_the_environment(monkeypatch):
    """A record is read when asked for, so a variable set since counts (memoized on the values)."""
    monkeypatch.delenv("POLYHAL_TEST_COUNT", raising=False)
    assert Sample.from_env().count == 2
    monkeypatch.setenv("POLYHAL_TEST_COUNT", "5")
    first = Sample.from_env()
    assert first.count == 5 and Sample.from_env() is first
    monkeypatch.setenv("POLYHAL_TEST_COUNT", "6")
    assert Sample.from_env().count == 6


def test_a_component_reads_its_variable_at_use(monkeypatch, fresh_registry):
    """The registry's record is read by each new Registry: the error names the variable."""
    with pytest.raises(polyhal.ConfigError, match=r"POLYHAL_PLUGIN_TIMEOUT='abc' is not a number of seconds >= 0; "
                                                  r"set e.g. 5, 0 to import"):
        fresh_registry(POLYHAL_PLUGIN_TIMEOUT="abc")


def _declared() -> list[type[Settings]]:
    return config.declared()


def test_each_variable_is_declared_once_with_a_meaning():
    names = [v.name for record in _declared() for _, v in record.variables()]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for record in _declared():
        assert record.__dataclass_params__.frozen, record  # type: ignore[attr-defined]
        for _, v in record.variables():
            assert v.name.startswith("POLYHAL_") and v.doc and "|" not in v.doc, v


def test_the_documented_table_is_generated_from_the_records():
    page = (ROOT / config.TABLE_PAGE).read_text()
    start, end = config.TABLE_MARKERS
    found = re.search(re.escape(start) + "(.*?)" + re.escape(end), page, re.S)
    assert found, f"{config.TABLE_PAGE} lost its config-table markers"
    assert found.group(1) == config.markdown(_declared()), (
        f"{config.TABLE_PAGE}'s table differs from the records: run `python -m polyhal.config --update`")


def test_update_writes_the_table_between_the_markers(tmp_path, monkeypatch):
    """--update rewrites only what lies between the markers of the page."""
    root = tmp_path / "checkout"
    page = root / config.TABLE_PAGE
    page.parent.mkdir(parents=True)
    start, end = config.TABLE_MARKERS
    page.write_text(f"# Config\n\nbefore\n{start}| stale |\n{end}\nafter\n")
    monkeypatch.setattr(config, "__file__", str(root / "core" / "polyhal" / "config" / "__init__.py"))
    assert config.main(["--update"]) == 0
    assert page.read_text() == f"# Config\n\nbefore\n{start}{config.markdown(config.declared())}{end}\nafter\n"
    page.write_text("no markers\n")
    assert config.main(["--update"]) == 1


def test_the_table_command_prints_the_same_table():
    run = subprocess.run([sys.executable, "-m", "polyhal.config", "--markdown"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and not run.stderr, run.stderr
    assert run.stdout == config.markdown(_declared())


def _sources() -> list[Path]:
    return [p for d in SOURCES for p in d.rglob("*.py") if "/build/" not in str(p) and ".egg" not in str(p)]


def test_every_polyhal_variable_in_the_code_is_declared():
    """A ``POLYHAL_*`` name anywhere in the code (read, set for a child, or quoted in a message)
    is a declared variable: one that a record, and so the documentation's table, documents."""
    declared = {v.name for record in _declared() for _, v in record.variables()} | NOT_VARIABLES
    used: dict[str, str] = {}
    for path in _sources():
        if path == Path(__file__):
            continue  # this file's sample record is no variable of polyhal
        for name in re.findall(r"\bPOLYHAL_[A-Z0-9][A-Z0-9_]*", path.read_text(errors="replace")):
            used.setdefault(name, str(path.relative_to(ROOT)))
    missing = {n: where for n, where in used.items() if n not in declared}
    assert not missing, f"POLYHAL_* variables no settings record declares (name: first file): {missing}"


#: A direct read of a POLYHAL_* variable (not a write: ``os.environ["X"] = ...``, ``setdefault``, ``pop``).
DIRECT_READ = re.compile(r"""(?:environ\.get|getenv)\(\s*["']POLYHAL_|environ\[\s*["']POLYHAL_\w+["']\s*\](?!\s*=[^=])""")


def test_no_code_reads_a_polyhal_variable_around_its_record():
    readers = [f"{p.relative_to(ROOT)}:{n}" for p in _sources() if p != Path(__file__)
               for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if DIRECT_READ.search(line)]
    assert not readers, f"read these through their settings record (polyhal.config): {readers}"


def test_the_checks_are_not_vacuous():
    assert DIRECT_READ.search('raw = os.environ.get("POLYHAL_NEW", "")')
    assert DIRECT_READ.search('x = os.environ["POLYHAL_NEW"]')
    assert not DIRECT_READ.search('os.environ["POLYHAL_SEED"] = str(seed)')
    assert "POLYHAL_TEST_COUNT" not in {v.name for record in _declared() for _, v in record.variables()}


def test_import_polyhal_reads_no_record():
    """Records are read when a component needs them, not at ``import polyhal``."""
    probe = "import polyhal, polyhal.config as c; print(len(c._READS))"
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={"PYTHONPATH": ":".join(sys.path), "POLYHAL_PLUGIN_TIMEOUT": "abc"})
    assert run.returncode == 0 and run.stdout.strip() == "0", run.stderr[-2000:]
