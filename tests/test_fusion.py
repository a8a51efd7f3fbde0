"""Compilation policy in ``polyhal.compile``: placement reads kernel sets from the device specs
(so a compile creates only the devices it uses), and the fusion passes run there, gated by the
devices placement would choose, without changing the program they are given."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal
from polyhal.hal.records import DeviceSpec
from polyhal.registry import Registry
from polyhal_cpu.allocator import host_heap
from polyhal_cpu.device import CPUDevice
from polyhal_cpu.kernels import KERNEL_NAMES


class _SpecKernels(CPUDevice):
    """The CPU device, serving exactly the kernels its spec declares."""

    @property
    def kernel_names(self) -> frozenset[str]:
        return self.spec.kernel_names


class Farm:
    """A backend of CPU-backed devices with the given kernel sets; records every creation."""

    POLYHAL_API_VERSION = polyhal.API_VERSION

    def __init__(self, **kernels: frozenset[str] | list[str]) -> None:
        self.kernels, self.created = kernels, []

    def _create(self, spec: DeviceSpec) -> CPUDevice:
        self.created.append(spec.name)
        return _SpecKernels(spec)

    @polyhal.hookimpl
    def register_devices(self):
        return [DeviceSpec(name=f"{name}:0", backend=name, rank=len(self.kernels) - i, factory=self._create,
                           heaps=(host_heap(),), kernel_names=names)
                for i, (name, names) in enumerate(self.kernels.items())]


def _registry(**kernels: frozenset[str] | list[str]) -> tuple[Registry, Farm]:
    reg = Registry(autoload=False)
    farm = Farm(**kernels)
    reg.register(farm, name="farm")
    return reg, farm


def _head(b: polyhal.ProgramBuilder, q, k, v):
    """An attention head as exporters write it: transposed keys, a scaled product, softmax."""
    s = b.mul(b.matmul(q, b.transpose(k, perm=[0, 2, 1])), b.constant(np.float32(0.5), "scale"))
    return b.matmul(b.softmax(s, axis=-1), v)


def _block():
    """A linear layer feeding an attention head: q = x @ w + bias."""
    b = polyhal.ProgramBuilder("block")
    x, k, v = b.input("x", (2, 6, 4)), b.input("k", (2, 5, 4)), b.input("v", (2, 5, 3))
    w = b.constant(np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4), "w")
    bias = b.constant(np.arange(4, dtype=np.float32), "bias")
    b.output(_head(b, b.add(b.matmul(x, w), bias), k, v))
    return b.build()


def _data():
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s).astype(np.float32) for s in ((2, 6, 4), (2, 5, 4), (2, 5, 3))]


def _snapshot(program):
    """Everything of a program that a compile could change in place."""
    return [(op, op.kind, op.name, op.inputs, op.outputs, op.attrs, op.device,
             [(v.name, v.type) for v in op.inputs + op.outputs]) for op in program.ops], \
        list(program.inputs), list(program.outputs), [c for c, _ in program.constants]


def test_a_compile_creates_only_the_devices_it_places_ops_on():
    reg, farm = _registry(adder=frozenset({"add"}), multiplier=frozenset({"matmul"}),
                          normalizer=frozenset({"softmax"}))
    b = polyhal.ProgramBuilder("mm")
    x, w = b.input("x", (3, 4)), b.input("w", (4, 2))
    b.output(b.matmul(x, w))
    plan = polyhal.compile(b.build(), registry=reg)  # every device is a candidate
    assert farm.created == ["multiplier:0"]
    assert [d.name for d in reg.created_devices()] == ["multiplier:0"]
    xs, ws = np.ones((3, 4), np.float32), np.ones((4, 2), np.float32)
    np.testing.assert_array_equal(plan(xs, ws).numpy(), xs @ ws)
    with pytest.raises(polyhal.KernelNotFoundError, match="devices with it: \\['multiplier:0'\\]"):
        polyhal.compile(b.build(), ["adder:0", "normalizer:0"], registry=reg)
    with pytest.raises(polyhal.DeviceNotFoundError, match="unknown device 'nowhere:0'"):
        polyhal.compile(b.build(), ["nowhere:0"], registry=reg)
    assert farm.created == ["multiplier:0"]


def test_a_spec_without_kernel_names_is_asked_through_its_device():
    reg, farm = _registry(multiplier=frozenset({"matmul"}))
    reg.register(type("Legacy", (), {
        "POLYHAL_API_VERSION": polyhal.API_VERSION,
        "register_devices": polyhal.hookimpl(lambda self: [
            DeviceSpec(name="legacy:0", backend="legacy", rank=9, factory=CPUDevice, heaps=(host_heap(),))]),
    })(), name="legacy")
    assert reg.kernel_names("legacy:0") == KERNEL_NAMES
    assert [d.name for d in reg.created_devices()] == ["legacy:0"]
    assert reg.kernel_names("multiplier:0") == {"matmul"} and farm.created == []


def test_kernel_names_must_be_a_frozenset_of_op_names():
    reg, farm = _registry(listed=["add"])  # a list, not a frozenset: the device is refused
    assert [s.name for s in reg.device_specs()] == []
    (failure,) = reg.failures
    assert "device 'listed:0' has kernel_names list instead of a frozenset of op names" in failure.reason


def test_builder_programs_are_fused_and_compile_leaves_them_unchanged():
    program = _block()
    before = _snapshot(program)
    plan = polyhal.compile(program, "cpu:0")
    assert _snapshot(program) == before
    assert [op.name for op in plan.program.ops] == ["linear", "attention"]  # k's transposes cancel
    text = plan.explain()
    assert "fused linear: matmul + add -> linear" in text
    assert "fused attention: transpose + matmul + mul + softmax + matmul -> attention" in text
    unfused = polyhal.compile(program, "cpu:0", fuse=False)
    assert "attention" not in [op.name for op in unfused.program.ops]
    assert "fusion: off" in unfused.explain() and "fused " not in unfused.explain()
    data = _data()
    np.testing.assert_allclose(plan(*data).numpy(), unfused(*data).numpy(), rtol=1e-5, atol=1e-6)


def test_fusion_follows_the_device_placement_would_choose():
    everything = KERNEL_NAMES
    plain = KERNEL_NAMES - {"attention", "linear"}
    reg, farm = _registry(plain=plain, fused=everything)
    program = _block()
    # The preferred device lacks the fused kernels: its ops stay unfused and the device that
    # has them is not even created.
    plan = polyhal.compile(program, registry=reg)
    names = [op.name for op in plan.program.ops]
    assert "attention" not in names and "linear" not in names
    assert {op.device for op in plan.program.ops} == {"plain:0"} and farm.created == ["plain:0"]
    # Preferred first, the device with the kernels fuses them and runs them.
    plan2 = polyhal.compile(program, ["fused:0", "plain:0"], registry=reg)
    placed = {op.name: op.device for op in plan2.program.ops}
    assert placed == {"linear": "fused:0", "attention": "fused:0"}
    data = _data()
    np.testing.assert_allclose(plan(*data).numpy(), plan2(*data).numpy(), rtol=1e-5, atol=1e-6)
    # An op's own affinity decides as the device list does.
    b = polyhal.ProgramBuilder("pinned")
    x, w, bias = b.input("x", (3, 4)), b.input("w", (4, 2)), b.input("bias", (2,))
    b.output(b.add(b.matmul(x, w, affinity="plain:0"), bias, affinity="plain:0"))
    assert [op.name for op in polyhal.compile(b.build(), ["fused:0"], registry=reg).program.ops] == ["matmul", "add"]
