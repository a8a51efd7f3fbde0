"""The attention fusion pass (matmul, scaling, softmax, matmul -> attention) and the op itself."""

from __future__ import annotations

import math

import numpy as np
import pytest

import polyhal
from polyhal.passes.fuse_attention import fuse_attention


def _head(scale_on: str | None = "product", extra_use: bool = False, axis: int = -1):
    """One attention block as exporters write it: q (2, 6, 4), k (2, 5, 4) -> kT, v (2, 5, 3)."""
    b = polyhal.ProgramBuilder("head")
    q, k, v = b.input("q", (2, 6, 4)), b.input("k", (2, 5, 4)), b.input("v", (2, 5, 3))
    c = b.constant(np.float32(0.5), "scale")
    kt = b.transpose(k, perm=[0, 2, 1])
    s = b.matmul(b.mul(q, c) if scale_on == "query" else q, kt)
    if scale_on == "product":
        s = b.mul(s, c)
    p = b.softmax(s, axis=axis)
    b.output(b.matmul(p, v), *([p] if extra_use else []))
    return b.build()


def _reference(q, k, v, scale):
    s = (q.astype(np.float64) @ k.transpose(0, 2, 1)) * scale
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in ((2, 6, 4), (2, 5, 4), (2, 5, 3))]


@pytest.mark.parametrize("scale_on, scale", [("product", 0.5), ("query", 0.5), (None, 1.0)])
def test_a_head_becomes_one_attention_op(scale_on, scale):
    program = _head(scale_on)
    fused, changes = fuse_attention(program)
    names = [op.name for op in fused.ops]
    assert names.count("attention") == 1 and "softmax" not in names and "matmul" not in names
    assert "mul" not in names  # the scaling went into the op
    (att,) = [op for op in fused.ops if op.name == "attention"]
    assert dict(att.attrs)["scale"] == pytest.approx(scale)
    assert att.inputs[1] is program.inputs[1]  # k itself: the transposes composed to nothing
    assert len(changes) == 1 and len(changes[0].new) == 1 and changes[0].kind == "attention"
    data = _data()
    got = polyhal.compile(fused, "cpu:0")(*data).numpy()
    np.testing.assert_allclose(got, _reference(*data, scale), rtol=1e-5, atol=1e-6)


def test_nothing_fuses_when_the_weights_are_used_elsewhere_or_the_axis_differs():
    for program in (_head(extra_use=True), _head(axis=1)):
        fused, changes = fuse_attention(program)
        assert changes == [] and fused is program


def test_keys_not_made_by_a_transpose_get_one():
    b = polyhal.ProgramBuilder("kt")
    q, kt, v = b.input("q", (3, 4)), b.input("kt", (4, 7)), b.input("v", (7, 2))
    b.output(b.matmul(b.softmax(b.matmul(q, kt), axis=1), v))
    fused, _ = fuse_attention(b.build())
    assert [op.name for op in fused.ops] == ["transpose", "attention"]
    rng = np.random.default_rng(3)
    qs, kts, vs = (rng.standard_normal(s).astype(np.float32) for s in ((3, 4), (4, 7), (7, 2)))
    got = polyhal.compile(fused, "cpu:0")(qs, kts, vs).numpy()
    np.testing.assert_allclose(got, _reference(qs[None], kts.T[None], vs[None], 1.0)[0], rtol=1e-5, atol=1e-6)


def _torch_heads(s=5, batch=3, h=2, d=4, key_transpose_moved=False):
    """torch's multi_head_attention_forward as its exporter writes it: q, k, v as thirds of a
    packed (S, B, 3E) projection, each ``view(S, B*H, D).transpose(0, 1).view(B, H, S, D)``, and
    SDPA scaling both q and kT by sqrt(1/sqrt(D)); ``key_transpose_moved``: kT as ONNX's optimizer
    leaves it, ``view(S, B*H, D).transpose(1, 2, 0).view(B, H, D, S)``."""
    e = h * d
    b = polyhal.ProgramBuilder("mha")
    x = b.input("x", (s, batch, 3 * e))
    proj = b.reshape(b.mul(x, b.constant(np.float32(2.0), "two")), shape=[s, batch, 3, e])  # an op's result
    c = b.constant(np.float32(d ** -0.25), "sqrt_scale")
    heads = []
    for i in range(3):
        third = b.gather(proj, b.constant(np.int64(i), f"i{i}"), axis=2)
        merged = b.reshape(third, shape=[s, batch * h, d])
        if i == 1 and key_transpose_moved:
            heads.append(b.reshape(b.transpose(merged, perm=[1, 2, 0]), shape=[batch, h, d, s]))
        else:
            heads.append(b.reshape(b.transpose(merged, perm=[1, 0, 2]), shape=[batch, h, s, d]))
    q, k, v = heads
    kt = b.mul(k if key_transpose_moved else b.transpose(k, perm=[0, 1, 3, 2]), c)
    p = b.softmax(b.matmul(b.mul(q, c), kt), axis=-1)
    b.output(b.matmul(p, v))
    return b.build(), (s, batch, h, d)


@pytest.mark.parametrize("moved", [False, True])
def test_torch_heads_reach_attention_as_views_of_the_projection(moved):
    program, (s, batch, h, d) = _torch_heads(key_transpose_moved=moved)
    fused, changes = fuse_attention(program)
    (att,) = [op for op in fused.ops if op.name == "attention"]
    assert dict(att.attrs)["scale"] == pytest.approx(d ** -0.5)  # both square roots folded
    names = [op.name for op in fused.ops]
    assert "mul" not in names[1:] and "softmax" not in names  # only the projection's mul stays
    producer = {op.outputs[0].id: op for op in fused.ops}
    for i, operand in enumerate(att.inputs):  # each head: transpose(reshape(third, (S, B, H, D))), splits only
        t = producer[operand.id]
        if moved and i == 1:  # k: kT's split and transpose, transposed back
            assert t.name == "transpose" and dict(t.attrs)["perm"] == (0, 1, 3, 2)
            t = producer[t.inputs[0].id]
            assert t.name == "transpose" and dict(t.attrs)["perm"] == (1, 2, 3, 0)
        else:
            assert t.name == "transpose" and dict(t.attrs)["perm"] == (1, 2, 0, 3)
        r = producer[t.inputs[0].id]
        assert r.name == "reshape" and r.outputs[0].type.shape == (s, batch, h, d)
        assert producer[r.inputs[0].id].name == "gather"
    assert len(changes) == 1
    rng = np.random.default_rng(4)
    x = rng.standard_normal((s, batch, 3 * h * d)).astype(np.float32)
    want = polyhal.compile(program, "cpu:0")(x).numpy()
    plan = polyhal.compile(fused, "cpu:0")
    got = plan(x).numpy()
    # the CPU keeps the strided thirds copies (its kernels would copy them again per run), as
    # before the split: the heads are then views of the dense copies
    views = {w.value.name for w in plan.buffer_plan.views}
    assert not any(op.outputs[0].name in views for op in plan.program.ops if op.name == "gather")
    assert all(op.outputs[0].name in views for op in plan.program.ops if op.name in ("reshape", "transpose"))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    thirds = 2 * x.reshape(s, batch, 3, h, d).transpose(2, 1, 3, 0, 4)  # (3, B, H, S, D)
    ref = _reference(*(t.reshape(batch * h, s, d) for t in thirds), d ** -0.5).reshape(batch, h, s, d)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_the_onnx_transformer_block_fuses_on_the_cpu_only():
    pytest.importorskip("onnx")
    from pathlib import Path

    import polyhal.onnx

    path = Path(__file__).resolve().parent.parent / "examples" / "transformer_block.onnx"
    program = polyhal.onnx.load(path, dims={"batch": 1, "seq": 16})
    ops, origins = list(program.ops), dict(program.origins)
    plan = program.compile("cpu:0")
    assert program.ops == ops and program.origins == origins  # compiling changed nothing of the import
    assert [op.name for op in program.ops].count("softmax") == 1
    names = [op.name for op in plan.program.ops]
    assert names.count("attention") == 1 and "softmax" not in names
    text = program.explain(plan)
    assert "k_t (Transpose) + scores_raw (MatMul) + scores (Mul) + attn (Softmax) + ctx_heads (MatMul): " \
        "transpose, attention -> cpu:0" in text  # the fused nodes are named as the op's origin
    assert "fused attention: transpose + matmul + mul + softmax + matmul" in text
    opencl = [s.name for s in polyhal.devices() if s.backend == "opencl"]
    if opencl:  # no attention kernel there: the unfused ops run
        plan_cl = program.compile(opencl[0])
        assert "attention" not in [op.name for op in plan_cl.program.ops]
        x = np.random.default_rng(0).standard_normal((1, 16, 128)).astype(np.float32)
        np.testing.assert_allclose(program.execute(plan, {"x": x})["y"], program.execute(plan_cl, {"x": x})["y"],
                                   rtol=1e-3, atol=1e-4)


def test_attention_op_defaults_scale_to_inverse_sqrt_d():
    b = polyhal.ProgramBuilder("att")
    q, k, v = b.input("q", (5, 8)), b.input("k", (9, 8)), b.input("v", (9, 3))
    b.output(b.attention(q, k, v))
    data = [np.random.default_rng(4).standard_normal(s).astype(np.float32) for s in ((5, 8), (9, 8), (9, 3))]
    got = polyhal.compile(b.build(), "cpu:0")(*data).numpy()
    q_, k_, v_ = (x[None] for x in data)
    np.testing.assert_allclose(got, _reference(q_, k_, v_, 1 / math.sqrt(8))[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shapes, match", [
    (((2, 5, 8), (3, 9, 8), (3, 9, 4)), "batch dims differ"),
    (((5, 8), (9, 7), (9, 4)), "last dim"),
    (((5, 8), (9, 8), (8, 4)), "key count"),
    (((8,), (8,), (8,)), "rank >= 2"),
])
def test_attention_shape_errors(shapes, match):
    b = polyhal.ProgramBuilder("bad")
    ins = [b.input(n, s) for n, s in zip("qkv", shapes)]
    with pytest.raises(polyhal.ShapeError, match=match):
        b.attention(*ins)
