"""CUDA queues (events as semaphore signals), concurrent plans with a GPU part, GPU-to-GPU
transfers (GPU; skip without one, two-GPU tests without two)."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal
from polyhal.errors import OutOfMemoryError
from polyhal.hal.queue import Semaphore
from polyhal.hal.transfer import route
from polyhal.policy import configure_policy


def _two_gpus():
    specs = [s for s in polyhal.devices() if s.backend == "cuda"]
    if len(specs) < 2:
        pytest.skip(f"needs two CUDA GPUs; this machine has {len(specs)}")
    return polyhal.get_device(specs[0].name), polyhal.get_device(specs[1].name)


def test_cuda_queue_signals_with_events_and_waits_on_the_stream(cuda, cp):
    from polyhal_cuda.queue import CUDAQueue

    q = cuda.queues[0]
    assert isinstance(q, CUDAQueue) and cuda.concurrent_queue is q and q.asynchronous
    a, b = q.semaphore(0, "a"), q.semaphore(0, "b")
    x = cp.arange(1 << 22, dtype=cp.float32)
    y = cp.empty_like(x)

    def work():
        with cuda.activate():
            cp.multiply(x, 2, out=y)

    q.execute([work], signal=[(a, 1)])
    assert a.fence(1) is not None  # issued, not waited for
    q.execute([lambda: None], wait=[(a, 1)], signal=[(b, 1)])
    assert q.deferred == 0  # a CUDA event: cudaStreamWaitEvent, no host wait
    b.wait(1, timeout=30)
    assert b.value == 1 and float(y[-1]) == 2 * float(x[-1])


def test_cuda_queue_defers_a_wait_on_cpu_work_to_its_issue_thread(cuda):
    q = cuda.queues[0]
    host, done = Semaphore(0, "cpu:0/part"), q.semaphore(0, "done")
    ran = []
    q.execute([lambda: ran.append(1)], wait=[(host, 1)], signal=[(done, 1)])
    assert ran == []
    host.signal(1)
    done.wait(1, timeout=30)
    assert ran == [1]


def _branches(gpu: str, n: int = 256, steps: int = 6):
    b = polyhal.ProgramBuilder("cpu_gpu")
    x = b.input("x", (n, n))
    left = right = x
    for _ in range(steps):
        left = b.op("matmul", left, x, affinity="cpu:0")
        right = b.op("matmul", right, x, affinity=gpu)
    b.output(b.op("add", left, right, affinity="cpu:0"))
    return b.build()


def test_cpu_branch_beside_a_gpu_branch_matches_the_serial_plan_and_replays_a_graph(cuda, rng):
    plan = polyhal.compile(_branches(cuda.name), ["cpu:0", cuda.name])
    serial = polyhal.compile(_branches(cuda.name), ["cpu:0", cuda.name], concurrent=False)
    assert plan.schedule is not None and plan.schedule.overlaps
    x = (rng.standard_normal((256, 256)) / 16).astype(np.float32)
    for _ in range(4):
        got = plan(x).numpy()
    np.testing.assert_allclose(got, serial(x).numpy(), rtol=1e-4, atol=1e-5)
    text = plan.explain()
    assert f"{cuda.name} on CUDAQueue {cuda.name}/stream0" in text and "host to device" in text
    gpu_part = next(p for p in plan.schedule.parts if p.lane == 1 and not p.transfer)
    replay = gpu_part.work[0]
    assert gpu_part.mode == "replay" and replay.mode == "graph", replay.mode


def test_to_device_larger_than_the_gpu_names_both_devices(cuda):
    free = cuda.memory_available() or 0
    big = polyhal.empty((free // 4 + (1 << 28),), "float32", "cpu:0") if free < (48 << 30) else None
    if big is None:
        pytest.skip("the host cannot hold more than this GPU's free memory for the test")
    with pytest.raises(OutOfMemoryError) as info:
        big.to_device(cuda)
    assert "cpu:0" in str(info.value) and cuda.name in str(info.value)


def test_gpu_to_gpu_without_peer_access_is_staged_and_explained():
    from polyhal_cuda.device import peer_access

    a, b = _two_gpus()
    key = (a.ordinal, b.ordinal)
    peer_access.override[key] = False
    try:
        r = route(a, b)
        assert r.how == "staged through pinned host memory (no peer access)"
        x = np.arange(1 << 20, dtype=np.float32)
        np.testing.assert_array_equal(polyhal.asarray(x, device=a).to_device(b).numpy(), x)
    finally:
        del peer_access.override[key]


def test_two_equal_branches_go_to_two_gpus_under_the_cost_policy(rng):
    a, b = _two_gpus()
    configure_policy(policy="cost")
    try:
        bld = polyhal.ProgramBuilder("two")
        x = bld.input("x", (1024, 1024))
        left = right = x
        for _ in range(4):
            left = bld.op("matmul", left, x)
            right = bld.op("matmul", right, x)
        bld.output(bld.op("add", left, right))
        plan = polyhal.compile(bld.build(), [a.name, b.name])
        devices = {op.device for op in plan.program.ops if op.name == "matmul"}
        assert devices == {a.name, b.name}, plan.explain()
        x = (rng.standard_normal((1024, 1024)) / 32).astype(np.float32)
        ref = 2 * np.linalg.matrix_power(x.astype(np.float64), 5)
        np.testing.assert_allclose(plan(x).numpy(), ref, rtol=1e-3, atol=1e-4)
    finally:
        configure_policy(policy="first")
