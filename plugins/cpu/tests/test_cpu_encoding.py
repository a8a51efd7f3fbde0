"""The CPU backend's data tiling: its resolver, its pack / unpack / mmt4d kernels, and chains of
matmuls on its tiled layout."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal
from polyhal.ir.encoding import IdentityLayout, MatmulEncoding, PackedLayout
from polyhal.ir.types import TensorType
from polyhal.ops import OPS
from polyhal.registry import Registry
from polyhal_cpu import encoding as cpu_encoding
from polyhal_cpu import kernels
from polyhal_cpu.encoding import resolve_encoding, tile_size


@pytest.fixture
def registry(fresh_registry):
    """A fresh default registry of the CPU backend under the given environment."""
    return lambda **env: fresh_registry(POLYHAL_BACKENDS="cpu", **env)


def _spec(reg: Registry, name: str = "cpu:0"):
    return next(s for s in reg.device_specs() if s.name == name)


def _types(m, k, n, dtype="float32"):
    encs = MatmulEncoding.for_matmul(TensorType((m, k), dtype), TensorType((k, n), dtype), TensorType((m, n), dtype))
    shapes = ((m, k), (k, n), (m, n))
    return [TensorType(s, dtype, e) for s, e in zip(shapes, encs)]


# -- tiles and the resolver -----------------------------------------------------------------------

@pytest.mark.parametrize("bound", [8, 16, 256])
def test_tile_size_covers_the_dim_with_little_padding(bound):
    for dim in range(1, 700):
        tile = tile_size(dim, bound)
        tiles = -(-dim // tile)
        assert 1 <= tile <= max(bound, dim if dim <= bound else 0)
        assert tiles * tile - dim < tiles * cpu_encoding.TILE_QUANTUM  # under a quantum per tile
        if dim <= bound:
            assert tile == dim  # one tile, no padding


def test_resolver_layouts_chain(registry):
    reg = registry(POLYHAL_CPU_DATA_TILE="16")
    spec = _spec(reg)
    assert "data-tiling" in spec.capabilities and spec.limits["data_tile"] == 16
    lhs, rhs, res = (resolve_encoding(spec, t.encoding, t) for t in _types(40, 50, 70))
    assert lhs.storage_type.shape == (3, 4, 16, 16)          # (M1, K1, M0, K0), 40 -> 3 x 16
    assert rhs.storage_type.shape == (5, 4, 16, 16)          # (N1, K1, N0, K0)
    assert res.storage_type.shape == (3, 5, 16, 16)          # (M1, N1, M0, N0)
    assert lhs.materialize_dispatch("matmul", {}, (lhs, rhs), (res,)) == ("mmt4d", {})
    # the result is laid out as the next matmul's LHS wants it: the encode between them folds
    next_lhs, _, _ = (resolve_encoding(spec, t.encoding, t) for t in _types(40, 70, 30))
    assert res.is_same_layout(next_lhs) and next_lhs.is_same_layout(res)
    assert isinstance(res, PackedLayout) and "cpu packed" in res.describe()


def test_resolver_gives_identity_or_defers(registry):
    reg = registry(POLYHAL_CPU_DEVICES="2", POLYHAL_CPU_DATA_TILING="cpu:1")
    t32 = _types(8, 8, 8)[0]
    ints = _types(8, 8, 8, "int32")[0]
    assert isinstance(resolve_encoding(_spec(reg, "cpu:0"), t32.encoding, t32), IdentityLayout)  # not tiling
    assert isinstance(resolve_encoding(_spec(reg, "cpu:1"), t32.encoding, t32), PackedLayout)
    assert isinstance(resolve_encoding(_spec(reg, "cpu:1"), ints.encoding, ints), IdentityLayout)  # not BLAS
    assert resolve_encoding(_spec(reg, "cpu:1"), "sparse", t32) is None  # unknown encoding: defer
    other = type("Spec", (), {"backend": "opencl", "capabilities": frozenset({"data-tiling"}), "limits": {}})()
    assert resolve_encoding(other, t32.encoding, t32) is None  # another backend's device


@pytest.mark.parametrize("env,match", [({"POLYHAL_CPU_DATA_TILING": "cpu:7"}, "not CPU devices"),
                                       ({"POLYHAL_CPU_DATA_TILE": "0"}, "POLYHAL_CPU_DATA_TILE='0' is not an integer >= 1")])
def test_bad_tiling_environment_is_reported(registry, env, match):
    reg = registry(**env)
    assert not reg.device_specs()
    assert any(match in f.reason for f in reg.failures)


# -- kernels --------------------------------------------------------------------------------------

def _run(op, inputs, attrs):
    in_types = tuple(TensorType(x.shape, x.dtype) for x in inputs)
    out_types = OPS[op].infer(in_types, attrs)
    outs = [np.empty(t.shape, t.dtype) for t in out_types]
    kernels.prepare(op, attrs, in_types, out_types)(*inputs, *outs)
    return outs[0]


@pytest.mark.parametrize("shape,pos,tiles,perm", [
    ((40, 50), (0, 1), (16, 16), None),          # padded LHS
    ((64, 32), (0, 1), (16, 16), None),          # exact
    ((50, 70), (1, 0), (16, 16), (1, 0)),        # padded RHS (transposed tiles)
    ((512, 512), (1, 0), (256, 256), (1, 0)),    # blocked transposing copy
    ((300, 260), (1, 0), (256, 256), (1, 0)),    # blocked and padded
    ((5, 6, 7), (2, 0), (3, 2), (2, 0, 1)),
])
def test_pack_and_unpack_kernels_match_references(shape, pos, tiles, perm):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    attrs = {"inner_dims_pos": pos, "inner_tiles": tiles, "outer_dims_perm": perm, "padding_value": 0.0}
    packed = _run("pack", [x], attrs)
    np.testing.assert_array_equal(packed, OPS["pack"].reference(x, **attrs)[0])
    un = {"inner_dims_pos": pos, "inner_tiles": tiles, "outer_dims_perm": perm, "dest_shape": shape}
    np.testing.assert_array_equal(_run("unpack", [packed], un), x)


@pytest.mark.parametrize("lhs,rhs", [
    ((3, 1, 16, 16), (5, 1, 16, 16)),        # one reduction tile: batched matmul over tiles
    ((2, 3, 16, 8), (4, 3, 12, 8)),          # small tiles: gathered into one BLAS call
    ((1, 2, 256, 256), (1, 2, 256, 256)),    # BLAS-sized tiles: accumulated per reduction tile
])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_mmt4d_kernel_paths(lhs, rhs, dtype):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal(lhs).astype(dtype), rng.standard_normal(rhs).astype(dtype)
    got = _run("mmt4d", [a, b], {})
    want = OPS["mmt4d"].reference(a, b)[0]
    tol = {"float16": 2e-2, "float32": 1e-4, "float64": 1e-10}[dtype]
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol * 4)


def test_mmt4d_strategies_agree():
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((2, 3, 16, 8)), rng.standard_normal((4, 3, 12, 8))
    want = OPS["mmt4d"].reference(a, b)[0]
    for strategy in (cpu_encoding._accumulated, cpu_encoding._gathered):
        out = np.empty_like(want)
        strategy(a, b, out)
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    # large shapes are timed once and the choice is remembered
    big = ((2, 2, 256, 256), (2, 2, 256, 256), np.dtype(np.float32))
    assert cpu_encoding._strategy(*big) in (cpu_encoding._accumulated, cpu_encoding._gathered)
    assert cpu_encoding._strategy(*big) is cpu_encoding._strategy(*big)


# -- chains ---------------------------------------------------------------------------------------

def _chain(m, dims, dtype="float32"):
    b = polyhal.ProgramBuilder("chain")
    x = b.input("x", (m, dims[0]), dtype)
    v = x
    for i in range(len(dims) - 1):
        v = b.matmul(v, b.input(f"w{i}", (dims[i], dims[i + 1]), dtype))
    b.output(v)
    return b.build()


def _names(plan):
    return [op.name for op in plan.program.ops]


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("float64", 1e-10)])
def test_chain_of_four_matmuls_on_the_tiled_layout(registry, dtype, tol):
    registry(POLYHAL_CPU_DATA_TILE="16")
    p = _chain(40, (50, 70, 30, 90, 20), dtype)
    plan = polyhal.compile(p, "cpu:0", data_tiling=True)
    names = _names(plan)
    # one pack per chain input (x and four weights), one unpack for the output, no re-layout between
    assert (names.count("pack"), names.count("unpack"), names.count("mmt4d"), names.count("matmul")) == (5, 1, 4, 0)
    assert names[-1] == "unpack"
    rng = np.random.default_rng(2)
    feeds = [rng.standard_normal(v.type.shape).astype(dtype) for v in p.inputs]
    want = feeds[0].astype(np.float64)
    for w in feeds[1:]:
        want = want @ w
    got = plan(*feeds).numpy()
    assert got.dtype == np.dtype(dtype) and got.shape == (40, 20)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_untiled_element_types_and_devices_fold_everything(registry):
    registry(POLYHAL_CPU_DEVICES="2", POLYHAL_CPU_DATA_TILING="cpu:0", POLYHAL_CPU_DATA_TILE="16")
    for program, device in ((_chain(20, (30, 20), "float16"), "cpu:0"), (_chain(20, (30, 20), "int32"), "cpu:0"),
                            (_chain(20, (30, 40, 20)), "cpu:1")):
        plan = polyhal.compile(program, device, data_tiling=True)
        assert set(_names(plan)) == {"matmul"}
        assert plan.placement.encodings.encode_dispatches == 0
        assert "identity by 'cpu'" in plan.explain()


def test_mlp_block_with_data_tiling_matches_without(registry):
    registry(POLYHAL_CPU_DATA_TILE="32")
    b = polyhal.ProgramBuilder("mlp")
    x, w1, w2 = b.input("x", (24, 40)), b.input("w1", (40, 72)), b.input("w2", (72, 40))
    b.output(b.softmax(b.add(b.matmul(b.gelu(b.matmul(x, w1)), w2), x), axis=-1))
    p = b.build()
    rng = np.random.default_rng(3)
    feeds = [rng.standard_normal(v.type.shape).astype(np.float32) / 4 for v in p.inputs]
    dense = polyhal.compile(p, "cpu:0")(*feeds).numpy()
    plan = polyhal.compile(p, "cpu:0", data_tiling=True)
    # gelu sits between the matmuls: the first result is unpacked for it and gelu's packed again
    assert _names(plan).count("mmt4d") == 2 and _names(plan).count("unpack") == 2
    np.testing.assert_allclose(plan(*feeds).numpy(), dense, rtol=1e-5, atol=1e-6)
