"""The CPU loops' cache trusts nothing it did not make (issue 27): a private folder and files
whatever the umask; a folder or module of another user, writable by others, planted, truncated
or of the wrong record shape is never loaded; the build lock has a deadline; a killed build's
folder goes; a failed build is reported once per process and tried again after RETRY_AFTER.

Each case runs ``native_aot.load`` in a child process (a planted library would run its code, a
truncated one used to end the process with SIGBUS), with ``CC=false``: a build fails in seconds
(numba finds no C compiler) instead of compiling for a minute. One test builds for real."""

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("numba")

from polyhal_cpu import native_aot  # noqa: E402

#: A library whose constructor writes the file $PLANTED_MARKER when it is loaded; its 64 KiB of
#: data make a truncated copy fault (SIGBUS) where the loader maps it.
PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
static char data[1 << 16] = {1};
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("PLANTED_MARKER"), "w");
    if (f) { fputs("planted code ran\n", f); fclose(f); }
}
int planted_data(int i) { return data[i]; }
"""
NOBODY = 65534

#: The child: load the module (the JIT loop is never asked for), say whether it was had.
LOAD = """
    import json
    from polyhal_cpu import native_aot
    {setup}
    loops = [native_aot.load(lambda name: None) for _ in range({times})]
    print(json.dumps({{"loaded": [type(got).__name__ for got in loops]}}))
"""


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("no gcc to build the planted library")
    folder = tmp_path_factory.mktemp("planted")
    (folder / "planted.c").write_text(PLANTED_C)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(folder / "planted.so"), str(folder / "planted.c")],
                   check=True)
    return folder / "planted.so"


@pytest.fixture
def cache(tmp_path) -> Path:
    folder = tmp_path / "cpu"
    folder.mkdir(mode=0o700)
    return folder


def _name() -> str:
    return native_aot.module_name()


def _plant(cache: Path, library: Path, record: object = None) -> Path:
    """The planted library as the module, with a record claiming it (its sha256 and size, as
    a build records them) unless ``record`` says otherwise."""
    module = cache / f"{_name()}.so"
    shutil.copyfile(library, module)
    content = library.read_bytes()
    if record is None:
        record = {"sha256": hashlib.sha256(content).hexdigest(), "size": len(content), "meta": {"loops": {}}}
    (cache / f"{_name()}.json").write_text(record if isinstance(record, str) else json.dumps(record))
    for path in (module, cache / f"{_name()}.json"):
        path.chmod(0o600)
    return module


def _load(cache: Path, tmp_path: Path, setup: str = "", times: int = 1, env: dict | None = None,
          timeout: float = 120) -> tuple[dict, list[str], subprocess.CompletedProcess]:
    """Run LOAD in a child with the cache at ``cache``: (its answer, its warning lines, the run).
    ``env`` adds variables to the child's, or (None) takes them away."""
    env = {**os.environ, "POLYHAL_CPU_CACHE_DIR": str(cache), "CC": "false", "POLYHAL_CPU_AOT_WAIT": "1",
           "PLANTED_MARKER": str(tmp_path / "marker"), **(env or {})}
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(LOAD).format(setup=setup, times=times)],
                         capture_output=True, text=True, timeout=timeout,
                         env={k: v for k, v in env.items() if v is not None})
    assert run.returncode == 0, run.stderr[-3000:]
    warnings = [line for line in run.stderr.splitlines() if "CacheWarning:" in line]
    return json.loads(run.stdout.strip().splitlines()[-1]), warnings, run


def _refused(warnings: list[str]) -> list[str]:
    return [line for line in warnings if "refused" in line]


def test_folders_are_made_0700_and_files_0600_under_umask_000(tmp_path):
    """The one real build: every folder the cache makes is 0700 and every file 0600 with
    umask 000, and the record holds the module's sha256."""
    cache = tmp_path / "a" / "b" / "cpu"
    got, _, run = _load(cache, tmp_path, setup="import os; os.umask(0)", env={"CC": os.environ.get("CC")},
                        timeout=900)
    assert got == {"loaded": ["CompiledLoops"]}, run.stderr[-3000:]
    for folder in (tmp_path / "a", tmp_path / "a" / "b", cache):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    name = _name()
    assert {p.name for p in cache.iterdir()} == {f"{name}.so", f"{name}.json", f"{name}.lock"}
    for path in cache.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    record = json.loads((cache / f"{name}.json").read_text())
    assert record["sha256"] == hashlib.sha256((cache / f"{name}.so").read_bytes()).hexdigest()


@pytest.mark.parametrize("how, why", [(0o777, "group- and world-writable"), (0o702, "world-writable"),
                                      (0o770, "group-writable"), ("chown", f"owned by uid {NOBODY}")])
def test_a_folder_not_private_to_this_user_is_refused(cache, tmp_path, planted, how, why):
    _plant(cache, planted)
    if how == "chown":
        if os.geteuid() != 0:
            pytest.skip("giving a folder to another user needs root")
        os.chown(cache, NOBODY, NOBODY)
    else:
        cache.chmod(how)
    got, warnings, _ = _load(cache, tmp_path)
    assert not (tmp_path / "marker").exists(), "the planted library ran"
    assert got == {"loaded": ["NoneType"]}
    (line,) = warnings
    assert f"cache folder {cache} refused: {why}" in line and "numba's JIT" in line


@pytest.mark.parametrize("how", ["world-writable", "another user's", "a link", "another module's record"])
def test_a_planted_module_is_not_loaded(cache, tmp_path, planted, how):
    """A library under the module's name, with a record claiming it, in this user's private
    folder: loaded only if it is a file of this user nobody else can write, whose sha256 is the
    record's; otherwise it is removed and the module built again (here that build fails)."""
    module = _plant(cache, planted)
    if how == "world-writable":
        module.chmod(0o666)
    elif how == "another user's":
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(module, NOBODY, NOBODY)
    elif how == "a link":
        module.unlink()
        module.symlink_to(planted)
    else:
        record = json.loads((cache / f"{_name()}.json").read_text())
        record["sha256"] = hashlib.sha256(b"the module that was built").hexdigest()
        (cache / f"{_name()}.json").write_text(json.dumps(record))
        module.write_bytes(planted.read_bytes())  # the same size: only the content differs
    got, warnings, _ = _load(cache, tmp_path)
    assert not (tmp_path / "marker").exists(), "the planted library ran"
    assert got == {"loaded": ["NoneType"]}
    (line,) = _refused(warnings)
    assert f"cached {module} refused" in line
    assert not os.path.lexists(module)  # removed before the new build
    assert "compiler" in json.loads((cache / f"{_name()}.failed").read_text())["reason"]  # which was tried


def test_a_truncated_module_is_refused_before_it_is_mapped(cache, tmp_path, planted):
    """A module cut short after it was built (a full disk, a killed copy) faults where the loader
    maps it (SIGBUS: every CPU run ended): its size and sha256 are checked first."""
    module = _plant(cache, planted)
    with open(module, "r+b") as f:
        f.truncate(module.stat().st_size // 2)
    got, warnings, _ = _load(cache, tmp_path)
    assert got == {"loaded": ["NoneType"]} and not (tmp_path / "marker").exists()
    (line,) = _refused(warnings)
    assert f"cached {module} refused" in line and "truncated" in line
    assert not module.exists() and (cache / f"{_name()}.failed").exists()  # removed, built again


@pytest.mark.parametrize("record", ["[]", "{", '{"sha256": 1}', {"loops": {"relu": "x"}},
                                    {"loops": {"relu": [[1, "no such dtype"]]}}])
def test_a_record_of_the_wrong_shape_is_treated_as_absent(cache, tmp_path, planted, record):
    """Whatever the record (``<name>.json``) holds, a load refuses it in one warning line and
    builds again: never an AttributeError, never the module it names loaded."""
    if isinstance(record, dict):  # the right sha256, but metadata of another shape
        content = planted.read_bytes()
        record = {"sha256": hashlib.sha256(content).hexdigest(), "size": len(content), "meta": record}
    _plant(cache, planted, record)
    got, warnings, run = _load(cache, tmp_path)
    assert not (tmp_path / "marker").exists(), "the module of a malformed record was loaded"
    assert got == {"loaded": ["NoneType"]} and "Traceback" not in run.stderr
    (line,) = _refused(warnings)
    assert f"{_name()}.json refused" in line
    assert (cache / f"{_name()}.failed").exists()  # built again (and that failed)


@pytest.mark.parametrize("what", ["held", "fifo", "folder"])
def test_the_build_lock_has_a_deadline(cache, tmp_path, what):
    """A builder that holds the lock and never finishes (stopped), or a lock path that is a FIFO
    or a folder: a process waits LOCK_TIMEOUT at most (a FIFO or folder not at all), warns once
    and runs without the module."""
    lock = cache / f"{_name()}.lock"
    holder = None
    if what == "held":
        holder = open(lock, "w")  # noqa: SIM115
        fcntl.flock(holder, fcntl.LOCK_EX)
    elif what == "fifo":
        os.mkfifo(lock, 0o600)
    else:
        lock.mkdir(mode=0o700)
    try:
        start = time.monotonic()
        got, warnings, _ = _load(cache, tmp_path, setup="native_aot.LOCK_TIMEOUT = 1", timeout=60)
    finally:
        if holder is not None:
            holder.close()
    assert got == {"loaded": ["NoneType"]} and time.monotonic() - start < 45
    (line,) = warnings
    assert f"build lock {lock} refused" in line and "numba's JIT" in line
    assert {"held": "still held after 1 s", "fifo": "not a regular file", "folder": "Is a directory"}[what] in line


def test_a_killed_builds_folder_is_removed_by_the_next_build(cache, tmp_path):
    """A build killed with its process (here: SIGKILL to the process group, mid-build) leaves
    its folder; the next build removes it, and its own."""
    builder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LOAD).format(setup="", times=1)],
                               env={**os.environ, "POLYHAL_CPU_CACHE_DIR": str(cache), "POLYHAL_CPU_AOT_WAIT": "1"},
                               start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not [p for p in cache.iterdir() if p.is_dir()] and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os.killpg(builder.pid, signal.SIGKILL)  # the process group this test started
        builder.wait()
    assert [p for p in cache.iterdir() if p.is_dir()], "the build made no folder"
    got, _, _ = _load(cache, tmp_path)  # builds again (and fails: CC=false)
    assert got == {"loaded": ["NoneType"]} and (cache / f"{_name()}.failed").exists()
    assert not [p for p in cache.iterdir() if p.is_dir()]


def test_a_failed_build_is_reported_once_per_process_and_retried_after_the_interval(cache, tmp_path):
    failed = cache / f"{_name()}.failed"
    got, warnings, _ = _load(cache, tmp_path, times=3)
    assert got == {"loaded": ["NoneType"] * 3}
    (line,) = warnings  # once, however often the module is asked for
    assert "numba's JIT (~3x" in line and "install a C compiler" in line
    assert f"{native_aot.RETRY_AFTER // 60} minutes" in line and str(failed) in line
    first = failed.stat().st_mtime_ns
    _, warnings, _ = _load(cache, tmp_path)  # a later process: reported, not built again
    assert len(warnings) == 1 and failed.stat().st_mtime_ns == first
    _, warnings, _ = _load(cache, tmp_path, setup="native_aot.RETRY_AFTER = 0")  # the interval has passed
    assert len(warnings) == 1 and failed.stat().st_mtime_ns > first  # built again (and failed again)


def test_the_build_says_when_it_starts_and_ends_only_where_asked(cache, tmp_path):
    """Issue 31: a first run that compiles for a minute says so on a terminal (POLYHAL_PROGRESS=1
    here, as the child's stderr is a pipe), and is quiet when piped."""
    _, _, run = _load(cache, tmp_path)  # piped: quiet
    assert "polyhal: compiling" not in run.stderr and (cache / f"{_name()}.failed").exists()
    (cache / f"{_name()}.failed").unlink()
    _, _, run = _load(cache, tmp_path, env={"POLYHAL_PROGRESS": "1"})
    said = [line for line in run.stderr.splitlines() if line.startswith("polyhal: ")]
    assert said[0] == ("polyhal: compiling the CPU backend's loops once for this machine (about a minute) ...")
    assert re.fullmatch(r"polyhal: the CPU backend's loops failed to compile \(see the warning\) in \d+(\.\d)? s", said[1])
