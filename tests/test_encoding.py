"""Encodings: attributes, layouts, the resolve_encoding hook, MaterializeEncoding, data tiling."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass

import numpy as np
import pytest

import polyhal
from polyhal.hal.records import DeviceSpec
from polyhal.ir.encoding import (
    LHS, RESULT, RHS, Encoding, IdentityLayout, MatmulEncoding, PackedLayout,
)
from polyhal.ir.types import TensorType
from polyhal.passes.data_tiling import set_encodings
from polyhal.passes.materialize_encoding import has_encodings, traffic

F32 = "float32"


def _enc(role=LHS, types=(F32, F32, F32), sizes=(4, 6, 5)):
    return MatmulEncoding(role, types, sizes)


def _chain(m=12, dims=(10, 14, 6, 9, 7), dtype=F32, name="chain"):
    b = polyhal.ProgramBuilder(name)
    x = b.input("x", (m, dims[0]), dtype)
    ws = [b.input(f"w{i}", (dims[i], dims[i + 1]), dtype) for i in range(len(dims) - 1)]
    v = x
    for w in ws:
        v = b.matmul(v, w)
    b.output(v)
    return b.build()


def _feeds(program, rng):
    return [rng.standard_normal(v.type.shape).astype(v.type.dtype) for v in program.inputs]


def _ref_chain(feeds):
    v = feeds[0].astype(np.float64)
    for w in feeds[1:]:
        v = v @ w
    return v


def _count(plan, name):
    return sum(op.kind == "dispatch" and op.name == name for op in plan.program.ops)


def _shape_of(program):
    """The ops of a program as (kind, name, device, operand types, result types): what runs."""
    return [(op.kind, op.name, op.device, tuple(v.type for v in op.inputs), tuple(v.type for v in op.outputs))
            for op in program.ops]


class Tiny:
    """A resolver plugin that packs every matmul operand in 4x4 tiles on CPU devices (ahead of
    the CPU backend's own resolver, since it is registered later)."""

    def __init__(self, tile=4):
        self.tile = tile
        self.calls = 0

    @polyhal.hookimpl
    def resolve_encoding(self, device, encoding, tensor_type):
        self.calls += 1
        if not isinstance(encoding, MatmulEncoding):
            return None
        t = self.tile
        if encoding.operand_index == RHS:
            return PackedLayout(tensor_type, (1, 0), (t, t), outer_dims_perm=(1, 0), resolver="tiny")
        return PackedLayout(tensor_type, (0, 1), (t, t), resolver="tiny")


class PlainBackend:
    """A backend with the CPU's kernels but no encoding resolver of its own."""

    POLYHAL_API_VERSION = polyhal.API_VERSION

    @polyhal.hookimpl
    def register_devices(self):
        from polyhal_cpu.allocator import host_heap
        from polyhal_cpu.device import CPUDevice

        return [DeviceSpec(name="plain:0", backend="plain", rank=-5, factory=CPUDevice, heaps=(host_heap(),))]


@pytest.fixture
def cpu_only(fresh_registry):
    return fresh_registry(POLYHAL_BACKENDS="cpu")


@pytest.fixture
def tiny(cpu_only):
    plugin = Tiny()
    cpu_only.register(plugin, name="tiny")
    return plugin


# -- encodings and layouts -------------------------------------------------------------------------

def test_encodings_are_immutable_and_hashable():
    a, b = _enc(), _enc()
    assert a == b and hash(a) == hash(b) and a != _enc(RHS)
    with pytest.raises(FrozenInstanceError):
        a.operand_index = RHS
    t = TensorType((4, 5), F32, a)
    assert {t: 1}[TensorType((4, 5), F32, _enc())] == 1 and "matmul.LHS" in str(t)
    assert a.role == "LHS" and _enc(RESULT).role == "RESULT"
    assert MatmulEncoding(LHS, ("float32",) * 3, (None, None, None)).describe().endswith("?x?x?>")


@pytest.mark.parametrize("types", [("bool", "bool", "bool"), (F32, "complex64", F32), (F32, F32)])
def test_matmul_encoding_refuses_element_types_it_cannot_describe(types):
    with pytest.raises((polyhal.DTypeError, polyhal.ProgramError), match="element"):
        _enc(types=types)


@pytest.mark.parametrize("kwargs,match", [({"role": 3}, "operand_index"), ({"role": True}, "operand_index"),
                                          ({"sizes": (4, -1, 5)}, "iteration_sizes"),
                                          ({"sizes": (4, 5)}, "iteration_sizes")])
def test_matmul_encoding_validates_fields(kwargs, match):
    with pytest.raises(polyhal.ProgramError, match=match):
        _enc(**kwargs)


def test_encode_checks_the_tensor_against_the_encoding():
    b = polyhal.ProgramBuilder("bad")
    x = b.input("x", (4, 5))
    flags = b.input("flags", (4, 5), "bool")
    ints = b.input("ints", (4, 5), "int32")
    with pytest.raises(polyhal.DTypeError, match="element type float32, not bool"):
        b.encode(flags, _enc())
    with pytest.raises(polyhal.DTypeError, match="not int32"):
        b.encode(ints, _enc())
    with pytest.raises(polyhal.ShapeError, match=r"\(4, 5\)"):
        b.encode(x, _enc(RHS))  # RHS is (K, N) = (5, 6)
    with pytest.raises(polyhal.ProgramError, match="not a polyhal.ir.encoding.Encoding"):
        b.encode(x, "lhs")
    y = b.encode(x, _enc())
    assert y.type.encoding == _enc() and b.encode(y, None).type.encoding is None


def test_layout_interface():
    t = TensorType((5, 7), F32)
    ident = IdentityLayout(TensorType((5, 7), F32, _enc(sizes=(5, 3, 7))))
    assert ident.is_identity_layout() and ident.tensor_type.encoding is None
    assert ident.is_same_layout(IdentityLayout(t)) and ident.storage_size_in_bytes() == 140
    assert ident.pack_op() is None and ident.unpack_op() is None
    packed = PackedLayout(t, (0, 1), (4, 4))
    assert not packed.is_identity_layout() and packed.storage_type.shape == (2, 2, 4, 4)
    assert packed.storage_size_in_bytes() == 2 * 2 * 16 * 4  # padding counts
    assert packed.is_same_layout(PackedLayout(t, (0, 1), (4, 4), outer_dims_perm=(0, 1), resolver="other"))
    assert not packed.is_same_layout(ident) and not ident.is_same_layout(packed)  # symmetric
    assert not packed.is_same_layout(PackedLayout(t, (0, 1), (4, 8)))
    assert hash(packed) == hash(PackedLayout(t, (0, 1), (4, 4)))
    rhs = PackedLayout(t, (1, 0), (4, 2), outer_dims_perm=(1, 0))
    assert rhs.storage_type.shape == (2, 3, 4, 2)
    x = np.arange(35, dtype=np.float32).reshape(5, 7)
    for layout in (packed, rhs):
        assert layout.pack(x).shape == layout.storage_type.shape
        np.testing.assert_array_equal(layout.unpack(layout.pack(x)), x)
    assert packed.pack_op()[0] == "pack" and packed.unpack_op()[1]["dest_shape"] == (5, 7)
    with pytest.raises(polyhal.ShapeError):
        PackedLayout(t, (0, 2), (4, 4))


def test_pack_unpack_mmt4d_references_agree_with_matmul():
    from polyhal.ops import OPS

    rng = np.random.default_rng(0)
    a, w = rng.standard_normal((13, 21)), rng.standard_normal((21, 10))
    la = PackedLayout(TensorType(a.shape, "float64"), (0, 1), (4, 8))
    lw = PackedLayout(TensorType(w.shape, "float64"), (1, 0), (3, 8), outer_dims_perm=(1, 0))
    lc = PackedLayout(TensorType((13, 10), "float64"), (0, 1), (4, 3))
    (c,) = OPS["mmt4d"].reference(la.pack(a), lw.pack(w))
    np.testing.assert_allclose(lc.unpack(c), a @ w, rtol=1e-12)
    assert la.materialize_dispatch("matmul", {}, (la, lw), (lc,)) == ("mmt4d", {})
    assert lc.materialize_dispatch("matmul", {}, (la, la), (lc,)) is None  # RHS not in mmt4d form
    assert lc.materialize_dispatch("add", {}, (la, lw), (lc,)) is None
    with pytest.raises(polyhal.ShapeError, match="reduction tiles"):
        OPS["mmt4d"].infer((TensorType((1, 2, 4, 8), F32), TensorType((1, 3, 4, 8), F32)), {})
    with pytest.raises(polyhal.ShapeError, match="packing"):
        OPS["unpack"].infer((TensorType((2, 2, 4, 4), F32),),
                            {"inner_dims_pos": (0, 1), "inner_tiles": (4, 4), "dest_shape": (9, 5)})


# -- the data-tiling pass --------------------------------------------------------------------------

def test_set_encodings_wraps_2d_matmuls_only():
    b = polyhal.ProgramBuilder("p")
    x, w = b.input("x", (4, 5)), b.input("w", (5, 6))
    v = b.input("v", (5,))
    y = b.matmul(x, w)
    b.output(y, b.matmul(x, v))
    p = b.build()
    q = set_encodings(p)
    assert not has_encodings(p) and has_encodings(q)
    kinds = [(op.kind, op.name) for op in q.ops]
    assert kinds == [("encode", "encode"), ("encode", "encode"), ("dispatch", "matmul"), ("encode", "encode"),
                     ("dispatch", "matmul")]
    lhs, rhs, mm, unset = q.ops[:4]
    assert lhs.outputs[0].type.encoding == MatmulEncoding(LHS, (F32,) * 3, (4, 6, 5))
    assert rhs.outputs[0].type.encoding.role == "RHS" and mm.outputs[0].type.encoding.role == "RESULT"
    assert unset.outputs[0] is y and q.outputs == p.outputs  # values keep their identity
    assert set_encodings(q).ops == q.ops  # encoded matmuls are left alone


# -- identity: devices without data tiling pay nothing ----------------------------------------------

def test_device_without_resolver_folds_every_encode(fresh_registry):
    reg = fresh_registry(POLYHAL_BACKENDS="cpu")
    reg.register(PlainBackend(), name="plain")
    rng = np.random.default_rng(1)
    p = _chain()
    dense, tiled = polyhal.compile(p, "plain:0"), polyhal.compile(p, "plain:0", data_tiling=True)
    assert _shape_of(tiled.program) == _shape_of(dense.program)
    assert traffic(tiled.program) == traffic(dense.program)
    report = tiled.placement.encodings
    assert report.encode_dispatches == 0 and report.folded == len(report.encodes) == 12
    text = tiled.explain()
    assert "12 folded, 0 pack/unpack dispatches" in text and "both layouts are the identity" in text
    assert "plugin 'plain' has no encoding resolver" in text
    feeds = _feeds(p, rng)
    np.testing.assert_allclose(tiled(*feeds).numpy(), _ref_chain(feeds), rtol=1e-4, atol=1e-4)


def test_program_without_encodings_is_untouched(cpu_only):
    p = _chain()
    plan = polyhal.compile(p, "cpu:0")
    assert [op.outputs for op in plan.program.ops] == [op.outputs for op in p.ops]
    assert plan.placement.encodings.encodes == [] and plan.placement.encodings.explain_lines() == []


# -- materialization with a packed layout ----------------------------------------------------------

def test_chain_packs_once_per_input_and_unpacks_once(tiny):
    rng = np.random.default_rng(2)
    p = _chain()
    plan = polyhal.compile(p, "cpu:0", data_tiling=True)
    assert (_count(plan, "pack"), _count(plan, "unpack"), _count(plan, "mmt4d")) == (5, 1, 4)
    assert _count(plan, "matmul") == 0
    # consecutive matmuls hand the packed result straight on
    mm = [op for op in plan.program.ops if op.name == "mmt4d"]
    for first, second in zip(mm, mm[1:]):
        assert second.inputs[0] is first.outputs[0]
    report = plan.placement.encodings
    assert report.encode_dispatches == 6 and report.folded == 12 - 5 - 1
    text = plan.explain()
    assert "already holds this value in that layout" in text and "unused: its result" in text
    assert "tiny packed<tiles 4x4" in text
    feeds = _feeds(p, rng)
    for _ in range(2):  # plans run repeatedly
        np.testing.assert_allclose(plan(*feeds).numpy(), _ref_chain(feeds), rtol=1e-4, atol=1e-4)
    assert tiny.calls > 0


def test_resolution_is_memoized_per_device_and_type(tiny):
    p = _chain(dims=(8, 8, 8, 8, 8), m=8)
    polyhal.compile(p, "cpu:0", data_tiling=True)
    # every matmul has the same (M, N, K), so 3 distinct encoded types, resolved once each
    assert tiny.calls == 3


def test_set_unset_pair_folds(tiny):
    b = polyhal.ProgramBuilder("pair")
    x = b.input("x", (6, 5))
    y = b.encode(b.encode(x, _enc(sizes=(6, 3, 5))), None)
    b.output(b.relu(y))
    plan = polyhal.compile(b.build(), "cpu:0")
    assert [op.name for op in plan.program.ops] == ["relu"]
    records = plan.placement.encodings.encodes
    assert all(r.folded for r in records)
    assert "a set/unset pair" in records[1].reason and "unused" in records[0].reason
    xs = np.random.default_rng(3).standard_normal((6, 5)).astype(np.float32)
    np.testing.assert_array_equal(plan(xs).numpy(), np.maximum(xs, 0))


def test_encoded_value_read_densely_reuses_its_dense_form(tiny):
    b = polyhal.ProgramBuilder("reuse")
    x = b.input("x", (6, 5))
    e = b.encode(x, _enc(sizes=(6, 3, 5)))
    b.output(b.relu(e), e)  # relu on a packed value; an encoded program output
    plan = polyhal.compile(b.build(), "cpu:0")
    # both read x's dense form, which exists already: the pack is never needed (the output,
    # now x itself, gets a copy of its own: plan outputs are fresh buffers)
    assert [op.name for op in plan.program.ops] == ["relu", "reshape"]
    assert "unused" in plan.placement.encodings.encodes[0].reason
    xs = np.random.default_rng(4).standard_normal((6, 5)).astype(np.float32)
    r, same = plan(xs)
    np.testing.assert_array_equal(r.numpy(), np.maximum(xs, 0))
    np.testing.assert_array_equal(same.numpy(), xs)


def test_op_that_cannot_consume_a_layout_gets_an_unpack(tiny):
    from polyhal.ir.program import Op, Value

    b = polyhal.ProgramBuilder("fallback")
    x, w = b.input("x", (6, 5)), b.input("w", (5, 3))
    b.output(b.relu(b.matmul(x, w)))
    q = set_encodings(b.build())
    mm = q.ops[2]
    (packed,) = mm.outputs  # only ever exists packed: relu reads the matmul's RESULT encoding
    r = Value(TensorType((6, 3), F32), "r", packed.program_id)
    q = type(q)(q.name, q.inputs, q.ops[:3] + [Op("dispatch", "relu", (packed,), (r,))], [r])
    plan = polyhal.compile(q, "cpu:0")
    assert [op.name for op in plan.program.ops] == ["pack", "pack", "mmt4d", "unpack", "relu"]
    assert "relu on cpu:0 cannot run on tiny packed" in plan.explain()
    rng = np.random.default_rng(4)
    xs, ws = rng.standard_normal((6, 5)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32)
    np.testing.assert_allclose(plan(xs, ws).numpy(), np.maximum(xs @ ws, 0), rtol=1e-5, atol=1e-5)


def test_same_value_packed_once_for_two_users(tiny):
    b = polyhal.ProgramBuilder("shared")
    x, w = b.input("x", (8, 8)), b.input("w", (8, 8))
    b.output(b.add(b.matmul(x, w), b.matmul(x, w)))
    plan = polyhal.compile(b.build(), "cpu:0", data_tiling=True)
    assert (_count(plan, "pack"), _count(plan, "unpack"), _count(plan, "mmt4d")) == (2, 2, 2)


def test_constant_weights_are_packed_at_compile_time(tiny):
    rng = np.random.default_rng(5)
    w = rng.standard_normal((10, 14)).astype(np.float32)
    b = polyhal.ProgramBuilder("const")
    x = b.input("x", (12, 10))
    b.output(b.matmul(x, b.constant(w, "w")))
    plan = polyhal.compile(b.build(), "cpu:0", data_tiling=True)
    assert (_count(plan, "pack"), _count(plan, "unpack")) == (1, 1)
    assert plan.placement.encodings.constant_packs == 1
    assert "constant packed at compile time" in plan.explain()
    xs = rng.standard_normal((12, 10)).astype(np.float32)
    np.testing.assert_allclose(plan(xs).numpy(), xs @ w, rtol=1e-5, atol=1e-5)


# -- across devices -----------------------------------------------------------------------------------

def _two_device_program():
    b = polyhal.ProgramBuilder("two")
    x, w0, w1 = b.input("x", (12, 10)), b.input("w0", (10, 14)), b.input("w1", (14, 6))
    h = b.op("matmul", x, w0, affinity="cpu:0")
    b.output(b.op("matmul", h, w1, affinity="cpu:1"))
    return b.build()


@pytest.mark.parametrize("tiling,moved_packed", [("all", True), ("cpu:0", False)])
def test_packed_value_crossing_devices(fresh_registry, tiling, moved_packed):
    fresh_registry(POLYHAL_BACKENDS="cpu", POLYHAL_CPU_DEVICES="2", POLYHAL_CPU_DATA_TILING=tiling,
                   POLYHAL_CPU_DATA_TILE="4")
    rng = np.random.default_rng(6)
    p = _two_device_program()
    plan = polyhal.compile(p, data_tiling=True)
    (move,) = [op for op in plan.program.ops if op.kind == "transfer"]
    if moved_packed:  # the same layout on both sides: the packed bytes move as they are
        assert move.inputs[0].type.rank == 4 and _count(plan, "unpack") == 1
    else:  # cpu:1 does not tile: unpacked on cpu:0 before the transfer, nothing packed after
        assert move.inputs[0].type.shape == (12, 14)
        producer = next(op for op in plan.program.ops if move.inputs[0] in op.outputs)
        assert producer.name == "unpack" and producer.device == "cpu:0"
        assert "layouts differ" in plan.explain() and "unpacked on cpu:0" in plan.explain()
        assert _count(plan, "matmul") == 1  # cpu:1 runs the plain kernel
    feeds = _feeds(p, rng)
    np.testing.assert_allclose(plan(*feeds).numpy(), _ref_chain(feeds), rtol=1e-4, atol=1e-4)


def test_input_is_packed_where_it_is_used(fresh_registry):
    fresh_registry(POLYHAL_BACKENDS="cpu", POLYHAL_CPU_DEVICES="2", POLYHAL_CPU_DATA_TILE="4")
    b = polyhal.ProgramBuilder("remote")
    x, w = b.input("x", (8, 8)), b.input("w", (8, 8))
    b.output(b.op("matmul", x, w, affinity="cpu:1"))
    plan = polyhal.compile(b.build(), ("cpu:0", "cpu:1"), data_tiling=True)
    assert {op.device for op in plan.program.ops} == {"cpu:1"}
    assert not any(op.kind == "transfer" for op in plan.program.ops)


# -- bad input ---------------------------------------------------------------------------------------

class _Answer:
    def __init__(self, answer):
        self.answer = answer

    @polyhal.hookimpl
    def resolve_encoding(self, device, encoding, tensor_type):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer(tensor_type) if callable(self.answer) else self.answer


@pytest.mark.parametrize("answer,match", [
    ("packed", "must return a polyhal.ir.encoding.Layout"),
    (lambda t: IdentityLayout(TensorType((3, 3), t.dtype)), "the layout is for"),
    (RuntimeError("boom"), "raised in resolve_encoding.*boom"),
])
def test_bad_resolver_answers_name_the_plugin(cpu_only, answer, match):
    """The resolver is skipped for that decision, with a warning naming it; the CPU's decides."""
    cpu_only.register(_Answer(answer), name="broken")
    with pytest.warns(RuntimeWarning, match=f"(plugin 'broken' .*{match}|plugin 'broken' {match}).*skipped"):
        plan = polyhal.compile(_chain(), "cpu:0", data_tiling=True)
    assert "broken" not in plan.explain()


@dataclass(frozen=True)
class Sparse(Encoding):
    """An encoding no resolver knows."""

    density: float = 0.5

    def check_type(self, tensor_type):
        if tensor_type.dtype.kind != "f":
            raise polyhal.DTypeError(f"a sparse encoding cannot describe element type {tensor_type.dtype}")


def test_unknown_encoding_falls_back_to_identity(cpu_only):
    b = polyhal.ProgramBuilder("sparse")
    x = b.input("x", (4, 4))
    b.output(b.relu(b.encode(b.encode(x, Sparse()), None)))
    plan = polyhal.compile(b.build(), "cpu:0")
    assert [op.name for op in plan.program.ops] == ["relu"]
    assert "the resolver of plugin 'cpu' does not know" in plan.explain()
    assert "identity by 'polyhal.policies.identity_encoding'" in plan.explain()
    with pytest.raises(polyhal.DTypeError, match="cannot describe element type int32"):
        b.encode(b.input("i", (4, 4), "int32"), Sparse())


def test_identity_resolver_is_a_plugin(cpu_only):
    from polyhal.registry import iter_plugins

    hooks = dict(iter_plugins(cpu_only))
    assert "resolve_encoding" in hooks["polyhal.policies.identity_encoding"]
    assert "resolve_encoding" in hooks["cpu"]


def test_cli_demo_with_data_tiling(cpu_only, capsys):
    from polyhal.cli import main

    assert main(["demo", "--device", "cpu:0", "--data-tiling", "--repeat", "1", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "encodings:" in out and "1 dispatch (pack)" in out


def test_a_mean_over_one_axis_given_as_an_int_is_no_conv_chain_map():
    # Found by the conformance suite's random samples: reduce_mean's axes may be one int.
    b = polyhal.ProgramBuilder("mean")
    b.output(b.reduce_mean(b.input("x", (2, 3, 4, 5)), axes=2, keepdims=True))
    plan = polyhal.compile(b.build(), "cpu:0")
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(np.float32)
    np.testing.assert_allclose(plan.run_numpy(x)[0], x.mean(axis=2, keepdims=True), rtol=1e-6)


def test_a_wide_pointwise_conv_at_a_chains_entry_reads_its_map_as_it_lies():
    # DenseNet's bottleneck: a 1x1 conv reading a wide map from outside the chain (here through
    # a relu) is left out of it, so that map is not relaid on every layer; a narrow entry (and a
    # wide 1x1 conv inside a chain) keeps its encodings
    from polyhal.ir.encoding import FeatureMapEncoding
    from polyhal.passes.data_tiling import set_conv_encodings

    rng = np.random.default_rng(3)

    def layer(c_in: int, scale: float):
        b = polyhal.ProgramBuilder("layer")
        x = b.input("x", (1, c_in, 8, 8), np.float32)
        y = b.op("relu", b.op("mul", x, b.constant(np.float32(scale))))
        y = b.op("relu", b.op("conv", y, b.constant(rng.standard_normal((16, c_in, 1, 1)).astype(np.float32))))
        y = b.op("relu", b.op("conv", y, b.constant(rng.standard_normal((16, 16, 3, 3)).astype(np.float32)),
                              pads=(1, 1, 1, 1)))
        y = b.op("conv", y, b.constant(rng.standard_normal((8, 16, 1, 1)).astype(np.float32)))
        b.output(y)
        return b.build()

    def encoded_filters(program) -> list[tuple[int, ...]]:
        out = set_conv_encodings(program)
        return [op.inputs[0].type.shape for op in out.ops if op.kind == "encode"
                and isinstance(op.outputs[0].type.encoding, FeatureMapEncoding)
                and op.outputs[0].type.encoding.role == "filter"]

    assert (16, 64, 1, 1) not in encoded_filters(layer(64, 0.5))  # wide entry: left out
    assert {(16, 16, 3, 3), (8, 16, 1, 1)} <= set(encoded_filters(layer(64, 0.5)))  # the rest still a chain
    assert (16, 16, 1, 1) in encoded_filters(layer(16, 0.5))  # a narrow entry stays in
    program = layer(64, 0.5)
    plan = polyhal.compile(program, "cpu:0")
    x = rng.standard_normal((1, 64, 8, 8)).astype(np.float32)
    want = polyhal.compile(program, "cpu:0", data_tiling=False).run_numpy(x)[0]
    np.testing.assert_allclose(plan.run_numpy(x)[0], want, rtol=1e-4, atol=1e-4)
