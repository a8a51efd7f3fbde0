"""Concurrent plans (issue 28): per-device parts on the devices' queues joined by semaphore waits;
placement across devices by the cost policy's schedule; the lead policy; bad input."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import polyhal
from polyhal import KernelTable
from polyhal.errors import KernelError, KernelNotFoundError
from polyhal.hal.queue import HostThreadQueue
from polyhal.policy import configure_policy

#: The gate device's kernels meet here: two parties, so two kernels get past it only if they run
#: at the same time (a plan that runs step by step breaks it: the first kernel waits alone).
GATE = threading.Barrier(2)
GATE_TIMEOUT = 20.0
FAIL = threading.Event()  # set: the gate device's relu raises, as a device lost mid-plan would
RAN: list[str] = []

TABLE = KernelTable("gate")


@TABLE.register("add")
def _add(device, op, attrs, ins, outs, scratch):
    def kernel(x, y, out):
        GATE.wait(GATE_TIMEOUT)
        np.add(x, y, out=out)
    return kernel


@TABLE.register("relu")
def _relu(device, op, attrs, ins, outs, scratch):
    def kernel(x, out):
        if FAIL.is_set():
            raise RuntimeError(f"{device.name} stopped answering")
        np.maximum(x, 0, out=out)
        RAN.append(device.name)
    return kernel


class GateBackend:
    """Two host devices, gate:0 and gate:1, whose ``add`` kernels wait for each other."""

    @polyhal.hookimpl
    def register_devices(self):
        from polyhal_cpu.allocator import host_heap
        from polyhal_cpu.device import CPUDevice

        class GateDevice(CPUDevice):
            kernels = TABLE

        return [polyhal.DeviceSpec(name=f"gate:{i}", backend="gate", rank=-100, factory=GateDevice,
                                   heaps=(host_heap(),), kernel_names=TABLE.kernel_names) for i in range(2)]


@pytest.fixture
def gates(fresh_registry):
    reg = fresh_registry(POLYHAL_BACKENDS="cpu", POLYHAL_CPU_DEVICES="2")
    reg.register(GateBackend(), name="gate")
    GATE.reset()
    FAIL.clear()
    RAN.clear()
    yield reg
    FAIL.clear()


@pytest.fixture
def cpus(fresh_registry):
    return fresh_registry(POLYHAL_BACKENDS="cpu", POLYHAL_CPU_DEVICES="2")


def _branches(a: str, b: str, op: str = "add", n: int = 1, shape=(64,)):
    """x -> n ops on ``a``; x -> n ops on ``b``; both outputs."""
    bld = polyhal.ProgramBuilder("branches")
    x = bld.input("x", shape)
    left = right = x
    for _ in range(n):
        left = bld.op(op, left, x, affinity=a)
        right = bld.op(op, right, x, affinity=b)
    bld.output(left)
    bld.output(right)
    return bld.build()


# -- running concurrently -----------------------------------------------------------------------------

def test_independent_branches_on_two_devices_run_at_the_same_time(gates):
    """The gate's kernels pass only together: the concurrent plan runs them at once, the step-by-step
    plan cannot (its first kernel waits alone and the barrier breaks)."""
    x = np.arange(64, dtype=np.float32)
    plan = polyhal.compile(_branches("gate:0", "gate:1"), ["gate:0", "gate:1"])
    assert plan.schedule is not None and plan.schedule.overlaps
    for _ in range(3):
        left, right = plan(x)
        np.testing.assert_array_equal(left.numpy(), 2 * x)
        np.testing.assert_array_equal(right.numpy(), 2 * x)
    assert all(isinstance(q, HostThreadQueue) for q in plan.schedule.queues)
    text = plan.explain()
    assert "concurrent: " in text and "gate:1 part 1: transfer %x (256 B)" in text
    assert "gate:1 part 2: 1 steps [add]" in text

    serial = polyhal.compile(_branches("gate:0", "gate:1"), ["gate:0", "gate:1"], concurrent=False)
    assert serial.schedule is None
    GATE.reset()
    global GATE_TIMEOUT
    old, GATE_TIMEOUT = GATE_TIMEOUT, 0.2
    try:
        with pytest.raises(KernelError, match="BrokenBarrierError"):
            serial(x)
    finally:
        GATE_TIMEOUT = old
        GATE.reset()


def test_a_chain_across_devices_stays_step_by_step_unless_asked(cpus):
    b = polyhal.ProgramBuilder("chain")
    x = b.input("x", (16,))
    y = b.op("exp", x, affinity="cpu:0")
    y = b.op("neg", y, affinity="cpu:1")
    b.output(b.op("exp", y, affinity="cpu:0"))
    plan = polyhal.compile(b.build(), ["cpu:0", "cpu:1"])
    assert plan.schedule is None  # nothing can overlap: no thread hand-offs for nothing
    forced = polyhal.compile(b.build(), ["cpu:0", "cpu:1"], concurrent=True)
    x = np.linspace(-1, 1, 16, dtype=np.float32)
    np.testing.assert_allclose(forced(x).numpy(), plan(x).numpy(), rtol=1e-6)
    assert not forced.schedule.overlaps and "waits for cpu:0 part 1" in forced.explain()


def test_single_device_plan_keeps_its_step_loop(cpus):
    b = polyhal.ProgramBuilder("one")
    x = b.input("x", (8,))
    b.output(b.op("exp", b.op("neg", x)))
    plan = polyhal.compile(b.build(), "cpu:0", concurrent=True)
    assert plan.schedule is None and "concurrent:" not in plan.explain()


def test_memory_reused_after_a_transfer_waits_for_the_transfer(cpus):
    """Write after read across lanes: bufferize gives %exp's bytes to a later value of cpu:0, which
    must not be written before cpu:1's transfer has read %exp."""
    b = polyhal.ProgramBuilder("war")
    x = b.input("x", (64,))
    a = b.op("exp", x, affinity="cpu:0")
    r = b.op("relu", a, affinity="cpu:1")
    for _ in range(3):
        r = b.op("sqrt", r, affinity="cpu:1")
    c = a
    for _ in range(3):
        c = b.op("neg", c, affinity="cpu:0")
    b.output(r)
    b.output(c)
    plan = polyhal.compile(b.build(), ["cpu:0", "cpu:1"], concurrent=True)
    assert "cpu:0 part 3: 2 steps [neg, neg]" in plan.explain()
    assert "cpu:0 part 3: 2 steps [neg, neg] (steps); waits for cpu:1 part 1" in plan.explain().replace("(replay)", "(steps)")
    x = np.random.default_rng(0).random(64, dtype=np.float32)
    for _ in range(30):
        r_, c_ = plan(x)
        np.testing.assert_allclose(r_.numpy(), np.exp(x) ** (1 / 8), rtol=1e-5)
        np.testing.assert_allclose(c_.numpy(), -np.exp(x), rtol=1e-5)


def test_cpu_beside_opencl_and_beside_the_template_device():
    """cpu:0 with a second device of another backend: PoCL's OpenCL queue (events), and the
    template device (examples/backend-template, a host thread queue)."""
    available = {s.name for s in polyhal.devices()}
    x = np.random.default_rng(1).standard_normal((32, 32)).astype(np.float32) / 8
    cases = [("mydev:0", "add", 3 * x)]
    if "opencl:0" in available:
        cases.append(("opencl:0", "matmul", None))
    for other, op, want in cases:
        if other not in available:
            pytest.skip(f"{other} is not installed here")
        plan = polyhal.compile(_branches("cpu:0", other, op, n=2, shape=(32, 32)), ["cpu:0", other])
        serial = polyhal.compile(_branches("cpu:0", other, op, n=2, shape=(32, 32)), ["cpu:0", other],
                                 concurrent=False)
        assert plan.schedule is not None, plan.explain()
        queue = plan.schedule.queues[1]
        assert queue.asynchronous and queue.name.startswith(other)
        for _ in range(3):
            got = [t.numpy() for t in plan(x)]
        ref = [t.numpy() for t in serial(x)]
        for g, r in zip(got, ref):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
        if want is not None:
            np.testing.assert_allclose(got[0], want, rtol=1e-6)
        assert f"transfer %x: cpu:0 -> {other}" in plan.explain() and "host to device" in plan.explain()


# -- a device failing mid-plan ---------------------------------------------------------------------------

def test_a_device_failing_mid_plan_names_device_and_step_and_releases_the_rest(gates):
    b = polyhal.ProgramBuilder("lost")
    x = b.input("x", (64,))
    left = b.op("relu", b.op("relu", x, affinity="gate:0"), affinity="gate:0")
    right = b.op("relu", b.op("relu", x, affinity="cpu:1"), affinity="gate:1")
    b.output(left)
    b.output(right)
    plan = polyhal.compile(b.build(), ["gate:0", "gate:1", "cpu:1"], concurrent=True)
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    plan(x)
    stats = {d.name: d.allocator.statistics.live_bytes for d in plan.schedule.devices}
    RAN.clear()
    FAIL.set()
    with pytest.raises(KernelError) as info:
        plan(x)
    message = str(info.value)
    assert "on device gate:" in message and "step" in message and "stopped answering" in message
    assert info.value.device in ("gate:0", "gate:1") and info.value.op == "relu"
    # Every queue finished what it had: no thread is left waiting, nothing stays allocated.
    for q in plan.schedule.queues:
        done = threading.Event()
        q.execute([done.set])
        assert done.wait(10), f"{q.name} is stuck after the failure"
    assert {d.name: d.allocator.statistics.live_bytes for d in plan.schedule.devices} == stats
    FAIL.clear()
    left_, right_ = plan(x)  # the plan runs again (fresh semaphores)
    np.testing.assert_array_equal(left_.numpy(), np.maximum(x, 0))


# -- placement across devices ---------------------------------------------------------------------------

def test_cost_policy_splits_independent_branches_across_devices(cpus):
    configure_policy(cpus, policy="cost")
    bld = polyhal.ProgramBuilder("two")
    x = bld.input("x", (256, 256))
    left = right = x
    for _ in range(3):
        left = bld.op("matmul", left, x)
    for _ in range(3):
        right = bld.op("matmul", right, x)
    bld.output(bld.op("add", left, right))
    plan = polyhal.compile(bld.build(), ["cpu:0", "cpu:1"])
    devices = [op.device for op in plan.program.ops if op.name == "matmul"]
    assert devices == ["cpu:0"] * 3 + ["cpu:1"] * 3, plan.explain()
    text = plan.explain()
    assert "starts at" in text and "(device busy)" in text and "concurrent:" in text
    x = np.random.default_rng(2).standard_normal((256, 256)).astype(np.float32) / 16
    ref = 2 * np.linalg.matrix_power(x.astype(np.float64), 4)
    np.testing.assert_allclose(plan(x).numpy(), ref, rtol=1e-3, atol=1e-5)


def test_cost_policy_spreads_micro_batches_and_keeps_each_one_on_its_device(cpus):
    """A two-stage pipeline over four micro-batches: each micro-batch's stages stay together (no
    move), and the micro-batches alternate between the devices."""
    configure_policy(cpus, policy="cost")
    b = polyhal.ProgramBuilder("pipeline")
    w1 = b.constant(np.eye(64, dtype=np.float32), "w1")
    w2 = b.constant(2 * np.eye(64, dtype=np.float32), "w2")
    xs = [b.input(f"x{i}", (64, 64)) for i in range(4)]
    for x in xs:
        b.output(b.op("matmul", b.op("matmul", x, w1), w2))
    plan = polyhal.compile(b.build(), ["cpu:0", "cpu:1"])
    devices = [op.device for op in plan.program.ops if op.name == "matmul"]
    assert devices == ["cpu:0", "cpu:0", "cpu:1", "cpu:1"] * 2, plan.explain()
    assert plan.placement.transfers == 0 and plan.schedule is not None
    data = [np.random.default_rng(i).standard_normal((64, 64)).astype(np.float32) for i in range(4)]
    for got, x in zip(plan(*data), data):
        np.testing.assert_allclose(got.numpy(), 2 * x, rtol=1e-6)


def test_cost_policy_uses_measured_kernel_times(cpus):
    from polyhal.policies.cost import measure_kernels, measured_kernels

    configure_policy(cpus, policy="cost")
    b = polyhal.ProgramBuilder("m")
    x = b.input("x", (64, 64))
    b.output(b.op("matmul", x, x))
    program = b.build()
    times = measure_kernels(polyhal.compile(program, "cpu:1"), np.ones((64, 64), np.float32), runs=2)
    assert set(times) == {("cpu:1", "matmul")} and times[("cpu:1", "matmul")] > 0
    assert any(device == "cpu:1" for device, _ in measured_kernels(cpus))
    plan = polyhal.compile(program, ["cpu:0", "cpu:1"])
    assert "by measurement" in plan.explain()


def test_lead_allocator_chooses_the_device_and_a_user_hook_overrides_every_policy(cpus):
    configure_policy(cpus, lead_allocator=1)
    plan = polyhal.compile(_single("exp"), ["cpu:0", "cpu:1"])
    assert {op.device for op in plan.program.ops} == {"cpu:1"}
    assert "lead allocator: cpu:1 is device 1" in plan.explain()

    class LastCandidate:
        @polyhal.hookimpl
        def select_allocator(self, candidates, memory_type, buffer_usage, flags):
            polyhal.policy.record_reason("the user's hook: last candidate")
            return len(candidates) - 1

    for policy in ("cost", "lead", "first"):
        configure_policy(cpus, policy=policy, lead_allocator=0)
        cpus.register(LastCandidate(), name="user-last")
        plan = polyhal.compile(_single("exp"), ["cpu:0", "cpu:1"])
        assert {op.device for op in plan.program.ops} == {"cpu:1"}
        assert "'user-last'" in plan.explain() and "the user's hook: last candidate" in plan.explain()
        cpus.unregister(name="user-last")


def _single(op: str):
    b = polyhal.ProgramBuilder("single")
    x = b.input("x", (8,))
    b.output(b.op(op, x))
    return b.build()


def test_a_pass_placing_an_op_on_a_device_without_its_kernel_names_pass_and_op(cpus):
    from polyhal.passes.pipeline import DEFAULT_PIPELINE, Pass

    def misplace(c, target):
        """Moves every exp to gate:0 (which has no exp kernel)."""
        import dataclasses

        ops = [dataclasses.replace(op, device="gate:0") if op.name == "exp" else op for op in c.placement.program.ops]
        c.placement.program = dataclasses.replace(c.placement.program, ops=ops)

    cpus.register(GateBackend(), name="gate")
    pipeline = DEFAULT_PIPELINE.insert(Pass("misplace", misplace, requires=("placed",)), after="place")
    with pytest.raises(KernelNotFoundError) as info:
        polyhal.compile(_single("exp"), "cpu:0", pipeline=pipeline)
    message = str(info.value)
    assert "pass 'misplace'" in message and "op 'exp'" in message and "gate:0, which has no 'exp' kernel" in message
    assert "cpu:0" in message  # where it could go
