"""The bufferize pass: memory spaces of kernel scratch (select_memory_space) and buffer planning."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal
from polyhal.hal.flags import BufferUsage, MemoryType
from polyhal.hal.records import DeviceSpec, Heap
from polyhal.hal.scratch import (
    KernelInfo, MemoryLimits, MemorySpace, Problem, ScratchDecl, ScratchError, ScratchRequest, place_scratch,
)
from polyhal.passes.bufferize import PlannedBuffer, plan_offsets
from polyhal.registry import Registry

HEAP = Heap(MemoryType.DEVICE_LOCAL | MemoryType.HOST_VISIBLE, BufferUsage.DEFAULT, 1 << 20)


def spec(workgroup=1024, private=64, name="fake:0") -> DeviceSpec:
    return DeviceSpec(name=name, backend="fake", rank=0, factory=lambda s: None, heaps=(HEAP,),
                      workgroup_bytes=workgroup, limits={"private_bytes": private})


def request(name="s", *, shared=True, wg_bytes=0, thread_bytes=0, wg=32, groups=4, spaces=(), launch=0,
            kernel="k") -> ScratchRequest:
    k = KernelInfo(kernel, "op", wg, groups)
    return ScratchDecl(name, shared, wg_bytes, thread_bytes, tuple(spaces), per_launch=launch).request(
        Problem("op", {}, (), ()), k)


@pytest.fixture
def registry():
    return Registry(autoload=False)


def place(registry: Registry, spec: DeviceSpec, requests) -> tuple:
    """Place ``requests`` on ``spec``'s device as a device that ``registry`` created would."""
    return place_scratch(requests, MemoryLimits.of(spec), spec.name, registry.memory_space_policy(spec))


# -- declarations ----------------------------------------------------------------------------------

def test_declaration_sizes_are_functions_of_problem_and_workgroup():
    decl = ScratchDecl("tile", shared=True, per_workgroup=lambda p, wg: wg * p.in_types[0].size * 4)
    problem = Problem("sort", {}, (polyhal.TensorType((8,), "float32"),), ())
    req = decl.request(problem, KernelInfo("sort_rows", "sort", 16, 3))
    assert req.bytes_per_workgroup == 16 * 8 * 4
    assert req.nbytes(MemorySpace.WORKGROUP) == 512 and req.nbytes(MemorySpace.GLOBAL) == 3 * 512
    assert not req.allows(MemorySpace.PRIVATE)  # shared data is never private


def test_limits_of_a_spec():
    lim = MemoryLimits.of(spec(2048, 100))
    assert (lim.private_bytes, lim.workgroup_bytes, lim.global_bytes) == (100, 2048, 1 << 20)
    assert lim.minus(MemorySpace.WORKGROUP, 48).workgroup_bytes == 2000


# -- the default policy --------------------------------------------------------------------------

def test_default_policy_fastest_space_that_fits(registry):
    small = request("a", shared=False, thread_bytes=16)
    shared = request("b", wg_bytes=512)
    big = request("c", wg_bytes=4096)
    placed = place(registry, spec(), (small, shared, big))
    assert [a.space for a in placed] == [MemorySpace.PRIVATE, MemorySpace.WORKGROUP, MemorySpace.GLOBAL]
    assert placed[2].nbytes == 4 * 4096 and placed[2].plugin == "polyhal.policies.memory_space"


def test_workgroup_memory_is_shared_by_a_kernels_scratches(registry):
    a, b = request("a", wg_bytes=700), request("b", wg_bytes=700)  # 1400 > 1024 together
    placed = place(registry, spec(), (a, b))
    assert [p.space for p in placed] == [MemorySpace.WORKGROUP, MemorySpace.GLOBAL]
    other = request("c", wg_bytes=700, kernel="k2")  # another kernel starts afresh
    assert place(registry, spec(), (a, other))[1].space is MemorySpace.WORKGROUP


def test_private_data_too_big_for_registers_goes_to_workgroup_memory(registry):
    r = request("p", shared=False, thread_bytes=128, wg=4)  # 128 B > 64 B private, 512 B per group
    (a,) = place(registry, spec(), (r,))
    assert a.space is MemorySpace.WORKGROUP and a.nbytes == 512


def test_per_launch_scratch_is_global_only(registry):
    (a,) = place(registry, spec(), (request("mask", launch=100),))
    assert a.space is MemorySpace.GLOBAL and a.nbytes == 100


def test_scratch_that_fits_nowhere_names_kernel_size_and_limit(registry):
    r = request("tile", wg_bytes=1 << 20, groups=8, spaces=(MemorySpace.WORKGROUP, MemorySpace.GLOBAL))
    with pytest.raises(ScratchError) as info:
        place(registry, spec(), (r,))
    msg = str(info.value)
    assert "'tile'" in msg and "kernel 'k'" in msg and "fake:0" in msg
    assert "needs 1048576 B/workgroup, limit 1024" in msg and f"needs {8 << 20} B, limit {1 << 20}" in msg


# -- policy plugins --------------------------------------------------------------------------------

class ForceGlobal:
    @polyhal.hookimpl
    def select_memory_space(self, device, kernel, scratch, limits):
        return MemorySpace.GLOBAL if scratch.allows(MemorySpace.GLOBAL) else None


def test_a_policy_plugin_overrides_the_default(registry):
    registry.register(ForceGlobal(), name="force-global")
    (a,) = place(registry, spec(), (request("b", wg_bytes=16),))
    assert a.space is MemorySpace.GLOBAL and a.plugin == "force-global"
    # It defers where the kernel has no global code: the default answers.
    (b,) = place(registry, spec(), (request("c", wg_bytes=16, spaces=(MemorySpace.WORKGROUP,)),))
    assert b.space is MemorySpace.WORKGROUP and b.plugin == "polyhal.policies.memory_space"


class ForceWorkgroup:
    @polyhal.hookimpl
    def select_memory_space(self, device, kernel, scratch, limits):
        return MemorySpace.WORKGROUP if scratch.allows(MemorySpace.WORKGROUP) else None


def _registry_with_device(*policies) -> Registry:
    from polyhal_cpu.allocator import host_heap
    from polyhal_cpu.device import CPUDevice

    class Host:
        @polyhal.hookimpl
        def register_devices(self):
            return [DeviceSpec(name="host:0", backend="host", rank=0, factory=CPUDevice, heaps=(host_heap(),),
                               workgroup_bytes=1024)]

    reg = Registry(autoload=False)
    reg.register(Host(), name="host")
    for i, policy in enumerate(policies):
        reg.register(policy, name=f"policy{i}")
    return reg


def test_a_device_places_scratch_by_the_policy_of_the_registry_that_made_it():
    """Outside a plan (a backend preparing a kernel by itself), scratch is placed by the device's
    own registry -- not by the default registry, which has no such policy."""
    from polyhal_gpu.scratch import Scratch

    unshared = request("t", shared=False, thread_bytes=16)
    device = _registry_with_device(ForceWorkgroup()).get_device("host:0")
    (a,) = device.place_scratch((unshared,))
    assert a.space is MemorySpace.WORKGROUP and a.plugin == "policy0"
    # The GPU backends' Scratch (prepared without a plan's binding) asks the same device.
    assert Scratch(device, (unshared,), None, id).spaces == {"t": MemorySpace.WORKGROUP}
    # Another registry's device, without the policy, takes the default: the fastest space.
    plain = _registry_with_device().get_device("host:0")
    assert Scratch(plain, (unshared,), None, id).spaces == {"t": MemorySpace.PRIVATE}


def test_a_device_made_outside_a_registry_places_scratch_first_fit():
    from polyhal_cpu.allocator import host_heap
    from polyhal_cpu.device import CPUDevice

    device = CPUDevice(DeviceSpec(name="loose:0", backend="host", rank=0, factory=CPUDevice, heaps=(host_heap(),),
                                  workgroup_bytes=1024))
    small, big = request("a", shared=False, thread_bytes=16), request("b", wg_bytes=4096)
    assert [(a.space, a.plugin) for a in device.place_scratch((small, big))] == [
        (MemorySpace.PRIVATE, "first fit"), (MemorySpace.GLOBAL, "first fit")]


@pytest.mark.parametrize("answer, match", [
    ("private", "shared data cannot be private"),
    ("somewhere", "must return a MemorySpace"),
    ("workgroup", "exceeds the 1024 B left"),
])
def test_bad_policy_answers_are_skipped(registry, answer, match):
    class Bad:
        @polyhal.hookimpl
        def select_memory_space(self, device, kernel, scratch, limits):
            return answer

    registry.register(Bad(), name="bad")
    with pytest.warns(RuntimeWarning, match=f"plugin 'bad' .*{match}.*skipped"):
        (a,) = place(registry, spec(), (request("s", wg_bytes=4096),))
    assert a.plugin == "polyhal.policies.memory_space"


# -- plans -----------------------------------------------------------------------------------------

def _nms_program(n=64):
    b = polyhal.ProgramBuilder("nms")
    bx, sc = b.input("boxes", (1, n, 4)), b.input("scores", (1, 1, n))
    b.output(*b.non_max_suppression(bx, sc, max_output_boxes_per_class=n, iou_threshold=0.5))
    return b.build()


def test_plan_records_and_explains_scratch():
    plan = polyhal.compile(_nms_program(), "cpu:0")
    ((assigned,),) = plan.buffer_plan.scratch.values()
    assert assigned.space is MemorySpace.GLOBAL and assigned.request.kernel.op == "non_max_suppression"
    text = plan.explain()
    assert "scratch:" in text and "cpu_non_max_suppression.boxes: global" in text and "peak" in text


def test_scratch_too_big_for_the_device_is_a_compile_time_error():
    from polyhal_cpu.allocator import host_heap
    from polyhal_cpu.device import CPUDevice

    class Tiny:
        @polyhal.hookimpl
        def register_devices(self):
            return [DeviceSpec(name="tiny:0", backend="tiny", rank=0, factory=CPUDevice, heaps=(host_heap(),),
                               limits={"global_scratch_bytes": 1000})]

    reg = Registry(autoload=False)
    reg.register(Tiny(), name="tiny")
    with pytest.raises(ScratchError, match=r"'boxes' of cpu kernel 'cpu_non_max_suppression'.*limit 1000 B"):
        polyhal.compile(_nms_program(1000), "tiny:0", registry=reg)


def test_plan_offsets_never_overlap_live_buffers():
    rng = np.random.default_rng(0)
    bufs = []
    for i in range(40):
        first = int(rng.integers(0, 20))
        bufs.append(PlannedBuffer(f"b{i}", "d", int(rng.integers(1, 5000)), first, first + int(rng.integers(0, 5)),
                                  MemoryType.DEVICE_LOCAL, BufferUsage.DEFAULT))
    size = plan_offsets(bufs)
    for a in bufs:
        assert a.offset % 256 == 0 and a.offset + a.nbytes <= size
        for b in bufs:
            if a is not b and a.overlaps(b):
                assert a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset, (a, b)
    assert size < sum(b.nbytes for b in bufs)


def test_plan_offsets_place_the_longer_lived_of_equal_buffers_first():
    """Of two buffers of one size, the one live longer goes first: placed after the shorter one,
    it would leave a gap no later buffer fits (Swin-T's arena on a GPU was 175 MB where at most
    165 MB are live at once)."""
    def buf(name, nbytes, first, last):
        return PlannedBuffer(name, "d", nbytes, first, last, MemoryType.DEVICE_LOCAL, BufferUsage.DEFAULT)

    bufs = [buf("b0", 512, 4, 6), buf("b1", 256, 3, 6), buf("b2", 512, 2, 2), buf("b3", 512, 2, 3)]
    live = max(sum(b.nbytes for b in bufs if b.first <= i <= b.last) for i in range(7))
    assert plan_offsets(bufs) == live == 1024


def _chain(n_ops=20, shape=(64, 64)):
    b = polyhal.ProgramBuilder("chain")
    x, y = b.input("x", shape), b.input("y", shape)
    v = x
    for i in range(n_ops):
        v = b.add(v, y) if i % 2 else b.mul(v, y)
    b.output(v)
    return b.build()


def test_chain_peak_is_at_most_half_of_unplanned_and_results_are_right():
    plan = polyhal.compile(_chain(), "cpu:0")
    bp = plan.buffer_plan
    assert len(plan.intermediates) == 19
    assert bp.peak_bytes <= bp.unplanned_bytes / 2
    assert bp.peak_bytes == 2 * 64 * 64 * 4  # ping-pong between two buffers
    rng = np.random.default_rng(1)
    xs, ys = rng.uniform(0.5, 1.5, (64, 64)).astype(np.float32), rng.uniform(0.5, 1.5, (64, 64)).astype(np.float32)
    want = xs.copy()
    for i in range(20):
        want = want + ys if i % 2 else want * ys
    np.testing.assert_allclose(plan(xs, ys).numpy(), want, rtol=1e-5)


def test_an_op_never_writes_over_its_own_inputs():
    # relu(a) + a: the add reads a and relu(a); neither may share memory with the add's result.
    b = polyhal.ProgramBuilder("diamond")
    x = b.input("x", (256,))
    a = b.exp(x)
    r = b.relu(b.neg(a))
    s = b.add(a, r)
    b.output(b.mul(s, s))
    plan = polyhal.compile(b.build(), "cpu:0")
    xs = np.linspace(-1, 1, 256, dtype=np.float32)
    e = np.exp(xs)
    np.testing.assert_allclose(plan(xs).numpy(), (e + np.maximum(-e, 0)) ** 2, rtol=1e-6)
    by = {bf.name: bf for bf in plan.buffer_plan.buffers}
    for name in by:
        for other in by:
            if name != other and by[name].overlaps(by[other]):
                lo, hi = sorted((by[name], by[other]), key=lambda q: q.offset)
                assert lo.offset + lo.nbytes <= hi.offset


def test_memory_types_and_usage_follow_producers_and_consumers():
    plan = polyhal.compile(_chain(3, (8,)), "cpu:0")
    for bf in plan.buffer_plan.buffers:
        assert bf.memory_type & MemoryType.DEVICE_LOCAL == MemoryType.DEVICE_LOCAL
        assert bf.usage & BufferUsage.DISPATCH_STORAGE_WRITE and bf.usage & BufferUsage.DISPATCH_STORAGE_READ
    # Host outputs of a host device: the default request (host memory is device memory there).
    (mt,) = plan.buffer_plan.output_memory.values()
    assert mt & MemoryType.DEVICE_LOCAL


def test_outputs_of_a_unified_memory_opencl_device_are_host_visible():
    names = [s.name for s in polyhal.devices() if s.backend == "opencl"]
    if not names:
        pytest.skip("no OpenCL device")
    dev = polyhal.get_device(names[0])
    if not any(h.serves(MemoryType.DEVICE_LOCAL | MemoryType.HOST_VISIBLE, BufferUsage.DEFAULT) for h in dev.spec.heaps):
        pytest.skip(f"{dev.name} has no host-visible device memory")
    plan = polyhal.compile(_chain(3, (8,)), dev.name)
    out = plan(np.ones(8, np.float32), np.ones(8, np.float32))
    assert out.buffer.host_visible
    np.testing.assert_allclose(out.numpy(), [2.0] * 8)


def test_plans_balance_the_allocator():
    dev = polyhal.get_device("cpu:0")
    before = dev.allocator.statistics.live_bytes
    plan = polyhal.compile(_nms_program(), "cpu:0")
    assert dev.allocator.statistics.live_bytes > before  # the arena
    del plan
    assert dev.allocator.statistics.live_bytes == before


def _dense_block(batch: int, layers: int = 3):
    """A DenseNet-style block: each layer reads the concatenation of all the features before it
    and adds one channel; the block's own concatenation feeds a last op."""
    b = polyhal.ProgramBuilder("dense")
    x = b.input("x", (batch, 2, 3, 4))
    feats = [b.relu(x)]
    for _ in range(layers):
        c = b.concat(*feats, axis=1)
        m = b.reduce_mean(c, axes=[1], keepdims=1)
        feats.append(b.mul(m, m))
    b.output(b.neg(b.concat(*feats, axis=1)))
    return b.build()


def _dense_reference(x: np.ndarray, layers: int = 3) -> np.ndarray:
    feats = [np.maximum(x, 0)]
    for _ in range(layers):
        m = np.concatenate(feats, axis=1).mean(axis=1, keepdims=True)
        feats.append(m * m)
    return -np.concatenate(feats, axis=1)


def _disjoint_while_live(plan) -> None:
    bufs = plan.buffer_plan.buffers
    for i, a in enumerate(bufs):
        for c in bufs[i + 1:]:
            if a.arena == c.arena and a.overlaps(c):
                lo, hi = sorted((a, c), key=lambda q: q.offset)
                assert lo.offset + lo.nbytes <= hi.offset


def test_concatenations_in_place_share_one_block_buffer():
    """At batch 1 every concatenation of the block runs no step: each feature's producer writes
    into its slice of the last concatenation's buffer, the earlier concatenations are its
    prefixes; the results are those of copying concats, run after run."""
    plan = polyhal.compile(_dense_block(1), "cpu:0")
    bp = plan.buffer_plan
    concats = [i for i, op in enumerate(plan.program.ops) if op.name == "concat"]
    assert len(concats) == 4 and bp.concats_in_place == frozenset(concats)
    assert not any(op.name == "concat" for op in plan._step_ops)
    last = plan.program.ops[concats[-1]].outputs[0]
    placed = {p.value.id: p for p in bp.in_place}
    features = plan.program.ops[concats[-1]].inputs
    assert [placed[f.id].offset for f in features] == [0, 24, 36, 48]  # channels of 3 x 4 elements
    assert all(placed[f.id].owner is last for f in features)
    prefixes = [placed[plan.program.ops[i].outputs[0].id] for i in concats[:-1]]
    assert [(p.owner, p.offset) for p in prefixes] == [(last, 0)] * 3
    assert "in place into" in plan.explain()
    _disjoint_while_live(plan)
    rng = np.random.default_rng(2)
    for _ in range(2):
        xs = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
        np.testing.assert_allclose(plan(xs).numpy(), _dense_reference(xs), rtol=1e-6)


def test_concatenations_stay_copies_where_slices_would_be_strided_or_clash():
    """Batch 2 (each operand's slice strided), a concatenation that is the program's output, and
    a value two concatenations want in different places: those copy, and results stay right."""
    plan = polyhal.compile(_dense_block(2), "cpu:0")
    assert not plan.buffer_plan.concats_in_place and not plan.buffer_plan.in_place
    xs = np.random.default_rng(3).standard_normal((2, 2, 3, 4)).astype(np.float32)
    np.testing.assert_allclose(plan(xs).numpy(), _dense_reference(xs), rtol=1e-6)

    b = polyhal.ProgramBuilder("clash")
    x = b.input("x", (1, 4, 8))
    a, p, q = b.relu(x), b.exp(x), b.neg(x)
    b.output(b.concat(a, p, axis=1))  # the program's output: a fresh tensor per run
    b.output(b.exp(b.concat(p, q, axis=1)))
    b.output(b.exp(b.concat(q, a, axis=1)))  # q first here, second above; a first in the output
    plan = polyhal.compile(b.build(), "cpu:0")
    assert len(plan.buffer_plan.concats_in_place) == 1  # the last one; then q clashes
    xs = np.random.default_rng(4).standard_normal((1, 4, 8)).astype(np.float32)
    ra, rp, rq = np.maximum(xs, 0), np.exp(xs), -xs
    got = [t.numpy() for t in plan(xs)]
    for g, want in zip(got, (np.concatenate([ra, rp], 1), np.exp(np.concatenate([rp, rq], 1)),
                             np.exp(np.concatenate([rq, ra], 1)))):
        np.testing.assert_allclose(g, want, rtol=1e-6)
    _disjoint_while_live(plan)
