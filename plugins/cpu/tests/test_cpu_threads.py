"""The CPU backend's thread budget (polyhal_cpu.threads): its size from affinity, cgroup quota
and the environment, the shared-core rule, and what BLAS, numba and the pool get."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from polyhal.errors import ConfigError
from polyhal_cpu import threads


def _files(files: dict[str, str]):
    return lambda path: files.get(path)


def test_cgroup_v2_quota_of_the_process_group():
    read = _files({"/sys/fs/cgroup/app/worker/cpu.max": "150000 100000\n", "/sys/fs/cgroup/app/cpu.max": "max 100000"})
    assert threads.cgroup_cpu_limit("0::/app/worker\n", read) == 1.5


def test_cgroup_v2_parent_quota_limits_the_child():
    read = _files({"/sys/fs/cgroup/app/worker/cpu.max": "max 100000", "/sys/fs/cgroup/app/cpu.max": "200000 100000"})
    assert threads.cgroup_cpu_limit("0::/app/worker", read) == 2.0


def test_cgroup_v2_container_sees_its_group_as_root():
    assert threads.cgroup_cpu_limit("0::/", _files({"/sys/fs/cgroup/cpu.max": "50000 100000"})) == 0.5


def test_cgroup_v1_quota():
    text = "12:pids:/docker/abc\n4:cpu,cpuacct:/docker/abc\n3:cpuset:/docker/abc\n"
    read = _files({"/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n",
                   "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"})
    assert threads.cgroup_cpu_limit(text, read) == 3.0


def test_no_quota():
    read = _files({"/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1", "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000",
                   "/sys/fs/cgroup/cpu.max": "max 100000"})
    assert threads.cgroup_cpu_limit("1:cpu:/\n0::/\n", read) is None


def test_available_cpus_is_affinity_capped_by_the_quota_rounded_up():
    assert threads.available_cpus(range(64), 2.0) == 2
    assert threads.available_cpus(range(64), 1.5) == 2
    assert threads.available_cpus(range(64), 0.2) == 1
    assert threads.available_cpus({0, 3}, 8.0) == 2
    assert threads.available_cpus({5}, None) == 1


def test_budget_size_from_environment():
    assert threads.budget_size({}, cpus=8) == 8
    assert threads.budget_size({"POLYHAL_CPU_THREADS": "3"}, cpus=8) == 3
    assert threads.budget_size({"POLYHAL_CPU_THREADS": "3", "OPENBLAS_NUM_THREADS": "1"}, cpus=8) == 3
    assert threads.budget_size({"OPENBLAS_NUM_THREADS": "1"}, cpus=8) == 1
    assert threads.budget_size({"OMP_NUM_THREADS": "4,2"}, cpus=8) == 4
    assert threads.budget_size({"OMP_NUM_THREADS": "lots"}, cpus=8) == 8


@pytest.mark.parametrize("raw", ["0", "-2", "two"])
def test_bad_override_says_what_to_write(raw):
    with pytest.raises(ConfigError, match=r"POLYHAL_CPU_THREADS=.* is not an integer >= 1; set it to the number"):
        threads.budget_size({"POLYHAL_CPU_THREADS": raw}, cpus=2)


def test_busy_seconds_of_the_budgets_cpus():
    stat = ("cpu  300 0 30 900 10 0 0 0 0 0\n"
            "cpu0 100 0 10 500 5 0 0 0 0 0\n"
            "cpu1 200 0 20 400 5 0 0 7 0 0\n")
    assert threads.cpu_busy_seconds(stat, [0], 0.01) == pytest.approx(1.1)
    assert threads.cpu_busy_seconds(stat, [0, 1], 0.01) == pytest.approx(1.1 + 2.27)


def test_free_cpus_rule():
    assert threads.free_cpus(2, 0.1, 2) == 2  # idle: the whole budget
    assert threads.free_cpus(2, 0.9, 2) == 1  # one core busy elsewhere: no second thread to spin
    assert threads.free_cpus(2, 2.0, 2) == 1  # never fewer than one
    assert threads.free_cpus(64, 10.0, 8) == 8  # the budget caps it


def test_adjust_follows_other_processes_load(monkeypatch):
    """Fed /proc/stat samples in which other processes keep one of two CPUs busy, then none."""
    state = {"busy": 0.0, "own": 0.0}
    monkeypatch.setattr(threads, "_read", lambda path: "stat" if path == "/proc/stat" else None)
    monkeypatch.setattr(threads, "cpu_busy_seconds", lambda text, cpus, tick: state["busy"])
    monkeypatch.setattr(os, "times", lambda: os.times_result((state["own"], 0, 0, 0, 0)))
    monkeypatch.setattr(os.path, "exists", lambda p: True)
    b = threads.Budget(2, [0, 1], adaptive=True)
    assert b.active == 2
    t = time.monotonic() + 10  # after the sample the budget took when made
    for _ in range(3):  # 1 s: our process used 1 CPU second, others 1 (one core busy elsewhere)
        t += 1.0
        state["busy"] += 2.0
        state["own"] += 1.0
        b.adjust(now=t)
    assert b.active == 1
    assert b.adjust(now=t + 0.01) == 1  # not due: no sample
    for _ in range(2):  # the other work ended: only ours
        t += 1.0
        state["busy"] += 1.2
        state["own"] += 1.2
        b.adjust(now=t)
    assert b.active == 2


def _probe(env: dict[str, str], code: str) -> dict:
    env = {**{k: v for k, v in os.environ.items()
              if k not in ("POLYHAL_CPU_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "NUMBA_NUM_THREADS")},
           **env}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


PROBE = """
    import json
    import numpy as np
    import polyhal
    from threadpoolctl import threadpool_info
    from polyhal_cpu import native, parallel, threads
    polyhal.get_device("cpu:0")
    native._jit_loops()  # imports numba the way the JIT loops do (the compiled module needs none)
    import numba
    blas = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
    print(json.dumps({"budget": threads.budget().size, "blas": blas, "pool": parallel.threads(),
                      "numba": numba.get_num_threads()}))
"""


@pytest.mark.parametrize("n", [1, 3])
def test_override_reaches_numba_and_the_pool_and_blas_runs_on_one_thread(n):
    got = _probe({"POLYHAL_CPU_THREADS": str(n)}, PROBE)
    assert got["budget"] == n and got["pool"] == n and got["numba"] == n
    assert got["blas"] and all(b == 1 for b in got["blas"]), got  # GEMMs are cut by polyhal's pool


def test_default_budget_is_the_cpus_this_process_may_use():
    got = _probe({}, PROBE)
    assert got["budget"] == threads.available_cpus()
    assert got["blas"] and all(b == 1 for b in got["blas"]), got
    assert got["numba"] == got["budget"]


def test_the_device_pins_numpys_own_blas_without_a_library_scan():
    # numpy's OpenBLAS is found in the process's mappings: threadpoolctl (its import, its scan of
    # every loaded library) waits for a BLAS loaded later (numba's scipy).
    got = _probe({}, """
        import json, sys
        import numpy as np
        import polyhal
        from polyhal_cpu import blas
        polyhal.get_device("cpu:0")
        scanned = "threadpoolctl" in sys.modules
        from threadpoolctl import threadpool_info
        mine = [i["num_threads"] for i in threadpool_info() if i["filepath"] in blas.numpy_openblas()]
        print(json.dumps({"libs": blas.numpy_openblas(), "scanned": scanned, "blas": mine,
                          "gemm": sorted(map(str, blas._load()))}))
    """)
    if not got["libs"]:
        pytest.skip("numpy has no OpenBLAS of its own here (threadpoolctl pins it)")
    assert not got["scanned"] and got["blas"] == [1] * len(got["libs"]), got
    assert "float32" in got["gemm"], got
