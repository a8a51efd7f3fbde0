"""polyhal's pytest plugin (a pytest11 entry point, so loaded in every pytest session of the
environment) stays silent in sessions that do not use it and never sets POLYHAL_SEED in their
environment; where a polyhal option is given or a test requests its fixtures, it shows the seed
(issue 31's tests that pass anywhere)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

UNRELATED = """
    import os

    def test_unrelated():
        assert "POLYHAL_SEED" not in os.environ
"""
USES_THE_SEED = """
    def test_seeded(polyhal_seed):
        print("seed", polyhal_seed)
"""
SEED_LINE = re.compile(r"^polyhal: random samples from POLYHAL_SEED=(\d+) \(set it to reproduce this run\)$", re.M)


def _session(tmp_path, test: str, *args: str, **env: str) -> str:
    """Run pytest (the installed plugins, polyhal's among them) on ``test`` in a fresh folder; its output."""
    (tmp_path / "test_it.py").write_text(textwrap.dedent(test))
    environ = {k: v for k, v in os.environ.items() if k != "POLYHAL_SEED"} | {
        "PYTHONPATH": os.pathsep.join(sys.path), **env}
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-s", *args, str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, env=environ, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def test_an_unrelated_session_hears_nothing_and_keeps_its_environment(tmp_path):
    out = _session(tmp_path, UNRELATED)
    assert "POLYHAL_SEED" not in out and "polyhal:" not in out and "1 passed" in out


def test_a_test_that_requests_the_seed_gets_it_shown_after_collection(tmp_path):
    out = _session(tmp_path, USES_THE_SEED)
    (seed,) = SEED_LINE.findall(out)
    assert f"seed {seed}" in out  # the seed shown is the one the test drew from
    out = _session(tmp_path, USES_THE_SEED, POLYHAL_SEED="1234")  # and setting it reproduces the run
    assert SEED_LINE.findall(out) == ["1234"] and "seed 1234" in out


def test_a_polyhal_option_shows_the_seed_in_the_header(tmp_path):
    out = _session(tmp_path, UNRELATED, "--polyhal-backend=cpu")
    assert len(SEED_LINE.findall(out)) == 1
