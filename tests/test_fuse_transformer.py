"""Transformer graphs as torch's exporters write them: GELU formulas become ``gelu``
(:mod:`polyhal.passes.fuse_gelu`), attention with a padding or causal mask ``masked_attention``
(:mod:`polyhal.passes.fuse_attention`), a transposed constant weight a view
(:mod:`polyhal.passes.fold_constants`); each against numpy and onnxruntime."""

from __future__ import annotations

import math

import numpy as np
import pytest

import polyhal
from polyhal.passes.fold_constants import fold_constant_transposes
from polyhal.passes.fuse_attention import fuse_attention
from polyhal.passes.fuse_gelu import fuse_gelu

SHAPE = (4, 96)
NEG = float(np.finfo(np.float32).min)  # the "minus infinity" torch's exporters put in masks


def _x(seed=0, shape=SHAPE):
    return (np.random.default_rng(seed).standard_normal(shape) * 3).astype(np.float32)


def _gelu_erf(x):
    return np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(np.float64).ravel()]).reshape(x.shape)


def _gelu_tanh(x):
    x = x.astype(np.float64)
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _erf_form(b, x, form):
    c = lambda v: b.constant(np.float32(v))  # noqa: E731
    if form == "torchscript":  # (x * (erf(x / sqrt 2) + 1)) * 0.5
        a = b.add(b.erf(b.div(x, c(math.sqrt(2)))), c(1.0))
        return b.mul(b.mul(x, a), c(0.5))
    if form == "half-first":  # (0.5 * x) * (1 + erf(x * 1/sqrt 2))
        a = b.add(c(1.0), b.erf(b.mul(x, c(1 / math.sqrt(2)))))
        return b.mul(b.mul(c(0.5), x), a)
    a = b.add(b.erf(b.div(x, c(math.sqrt(2)))), c(1.0))  # "halved": x * (a * 0.5) ... written as (a * x) / 2
    return b.div(b.mul(a, x), c(2.0))


def _tanh_form(b, x, form):
    c = lambda v: b.constant(np.float32(v))  # noqa: E731
    cube = b.pow(x, c(3.0)) if form == "pow" else b.mul(x, b.mul(x, x))
    inner = b.mul(b.add(x, b.mul(cube, c(0.044715))), c(math.sqrt(2 / math.pi)))
    return b.mul(b.mul(x, c(0.5)), b.add(b.tanh(inner), c(1.0)))


@pytest.mark.parametrize("kind, form", [("erf", "torchscript"), ("erf", "half-first"), ("erf", "halved"),
                                        ("tanh", "pow"), ("tanh", "cube")])
def test_gelu_formulas_become_one_gelu_op(kind, form):
    b = polyhal.ProgramBuilder("gelu")
    x = b.input("x", SHAPE)
    b.output((_erf_form if kind == "erf" else _tanh_form)(b, x, form))
    program = b.build()
    fused, changes = fuse_gelu(program)
    assert [op.name for op in fused.ops] == ["gelu"]
    assert dict(fused.ops[0].attrs)["approximate"] == ("none" if kind == "erf" else "tanh")
    assert len(changes) == 1 and changes[0].kind == "gelu" and fused.ops[0].inputs[0] is program.inputs[0]
    data = _x()
    want = (_gelu_erf if kind == "erf" else _gelu_tanh)(data)
    for prog in (fused, program):  # compile fuses the original too
        plan = polyhal.compile(prog, "cpu:0")
        assert [op.name for op in plan.program.ops] == ["gelu"]
        np.testing.assert_allclose(plan(data).numpy(), want, rtol=1e-5, atol=2e-6)


def test_gelu_lookalikes_stay_as_they_are():
    def build(half=0.5, extra_use=False, k=0.044715):
        b = polyhal.ProgramBuilder("near")
        x = b.input("x", SHAPE)
        c = lambda v: b.constant(np.float32(v))  # noqa: E731
        cube = b.pow(x, c(3.0))
        t = b.tanh(b.mul(b.add(x, b.mul(cube, c(k))), c(math.sqrt(2 / math.pi))))
        a = b.add(t, c(1.0))
        b.output(b.mul(b.mul(x, c(half)), a), *([t] if extra_use else []))
        return b.build()
    for program in (build(half=0.6), build(extra_use=True), build(k=0.05)):
        fused, changes = fuse_gelu(program)
        assert changes == [] and fused is program


def test_the_erf_gelu_kernel_is_accurate_over_the_range():
    x = np.concatenate([np.linspace(-12, 12, 20001), [np.inf, -np.inf, 0.0, -0.0]]).astype(np.float32)
    b = polyhal.ProgramBuilder("g")
    b.output(b.gelu(b.input("x", x.shape), approximate="none"))
    got = polyhal.compile(b.build(), "cpu:0")(x).numpy()
    want = _gelu_erf(x[:-4])
    np.testing.assert_allclose(got[:-4], want, rtol=1e-6, atol=2e-7 * 12)
    assert got[-4] == np.inf and got[-2] == 0
    assert np.isnan(got[-3]) or got[-3] == 0  # -inf * (1 + erf(-inf)): nan as the numpy kernel gives, or 0
    b = polyhal.ProgramBuilder("nan")
    b.output(b.gelu(b.input("x", (1,)), approximate="none"))
    assert np.isnan(polyhal.compile(b.build(), "cpu:0")(np.float32([np.nan])).numpy()).all()


# ------------------------------------------------------------------------------ masked attention

B, H, L, D = 2, 3, 20, 8


def _masked_head(mask_shape, mask_data=None):
    """q (B, H, L, D) scaled, k^T by a transpose, scores + mask, softmax, @ v: as exporters write it.
    With ``mask_data`` the mask is a constant (GPT-2's folded causal mask), else an input."""
    b = polyhal.ProgramBuilder("masked")
    q, k, v = (b.input(n, (B, H, L, D)) for n in "qkv")
    mask = b.constant(mask_data, "mask") if mask_data is not None else b.input("mask", mask_shape)
    s = b.mul(b.matmul(q, b.transpose(k, perm=[0, 1, 3, 2])), b.constant(np.float32(1 / math.sqrt(D))))
    b.output(b.matmul(b.softmax(b.add(s, mask), axis=-1), v))
    return b.build()


def _attention_reference(q, k, v, mask):
    s = q.astype(np.float64) @ np.swapaxes(k, -1, -2) / math.sqrt(D) + mask.astype(np.float32).astype(np.float64)
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v


def _qkv(seed=1):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, H, L, D)).astype(np.float32) for _ in range(3)]


def test_a_causal_mask_constant_fuses_into_masked_attention():
    causal = np.triu(np.full((L, L), NEG, np.float32), 1)[None, None]
    program = _masked_head(None, causal)
    fused, changes = fuse_attention(program)
    names = [op.name for op in fused.ops]
    assert names == ["masked_attention"] and changes[0].kind == "attention"
    assert fused.ops[0].inputs[3].name == "mask"
    q, k, v = _qkv()
    want = _attention_reference(q, k, v, causal)
    for prog in (fused, program):
        np.testing.assert_allclose(polyhal.compile(prog, "cpu:0")(q, k, v).numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mask_shape", [(B, 1, 1, L), (1, 1, L, L), (L,), (B, H, L, L)])
def test_padding_masks_of_any_broadcast_shape_match_the_unfused_ops(mask_shape):
    program = _masked_head(mask_shape)
    plan = polyhal.compile(program, "cpu:0")
    assert "masked_attention" in [op.name for op in plan.program.ops]
    rng = np.random.default_rng(2)
    mask = np.where(rng.random(mask_shape) < 0.3, NEG, 0.0).astype(np.float32)
    mask[..., 0] = 0.0  # every row keeps a key
    q, k, v = _qkv()
    want = polyhal.compile(program, "cpu:0", fuse=False)(q, k, v, mask).numpy()
    np.testing.assert_allclose(plan(q, k, v, mask).numpy(), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(want, _attention_reference(q, k, v, mask), rtol=1e-5, atol=1e-6)


def test_a_fully_masked_row_gets_the_uniform_weights_the_unfused_ops_give():
    mask = np.zeros((B, 1, L, L), np.float32)
    mask[0, 0, 3] = NEG  # one query row sees no key
    mask[1, 0, :, 5:] = -np.inf  # keys masked by -inf in the other batch
    program = _masked_head(mask.shape)
    q, k, v = _qkv(4)
    got = polyhal.compile(program, "cpu:0")(q, k, v, mask).numpy()
    want = polyhal.compile(program, "cpu:0", fuse=False)(q, k, v, mask).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[0, :, 3], v[0].mean(axis=1), rtol=1e-5, atol=1e-6)


def test_masked_attention_rejects_a_mask_that_does_not_broadcast_to_the_scores():
    b = polyhal.ProgramBuilder("bad")
    q, k, v = (b.input(n, (H, L, D)) for n in "qkv")
    with pytest.raises(polyhal.errors.ShapeError, match="do not broadcast"):
        b.masked_attention(q, k, v, b.input("mask", (H, L, L + 1)))
    with pytest.raises(polyhal.errors.ShapeError, match="does not broadcast to the scores"):
        b.masked_attention(q, k, v, b.input("mask5", (2, H, L, L)))


# -------------------------------------------------------------------------------- constant views

def test_a_transposed_constant_weight_is_folded_into_a_view():
    rng = np.random.default_rng(5)
    table = rng.standard_normal((50, 16)).astype(np.float32)  # (vocab, d), tied output projection
    b = polyhal.ProgramBuilder("tied")
    x = b.input("x", (1, 7, 16))
    b.output(b.matmul(x, b.transpose(b.constant(table, "wte"), perm=[1, 0])))
    program = b.build()
    folded, changes = fold_constant_transposes(program)
    assert [op.name for op in folded.ops] == ["matmul"] and changes[0].kind == "constant"
    view = dict((v.id, a) for v, a in folded.constants)[folded.ops[0].inputs[1].id]
    assert np.shares_memory(view, program.constants[0][1])  # a view: no copy of the table
    plan = polyhal.compile(program, "cpu:0")
    assert "transpose" not in [op.name for op in plan.program.ops]
    assert "constant: transpose -> constant" in plan.explain()
    xs = rng.standard_normal((1, 7, 16)).astype(np.float32)
    np.testing.assert_allclose(plan(xs).numpy(), xs @ table.T, rtol=1e-5, atol=1e-5)


def _tied(table, b=None):
    """GPT-2's tied embedding: gather rows of the table, then the product with its transpose."""
    b = b or polyhal.ProgramBuilder("tied")
    ids = b.input("ids", (2, 5), "int64")
    wte = b.constant(table, "wte")
    h = b.tanh(b.gather(wte, ids, axis=0))  # (2, 5, d)
    b.output(b.matmul(h, b.transpose(wte, perm=[1, 0])))  # (2, 5, vocab)
    return b.build()


def _tied_expected(table, ids):
    return np.tanh(table[ids].astype(np.float64)) @ table.T.astype(np.float64)


def test_a_tied_table_is_one_constant_the_lookup_reads_transposed():
    rng = np.random.default_rng(6)
    table = rng.standard_normal((50, 16)).astype(np.float32)
    program = _tied(table)
    folded, changes = fold_constant_transposes(program)
    assert sorted(c.kind for c in changes) == ["constant", "gather"]
    (view, data), = folded.constants  # the original is read by nothing any more: dropped
    assert view.type.shape == (16, 50) and np.shares_memory(data, program.constants[0][1])
    assert [op.name for op in folded.ops] == ["gather", "transpose", "tanh", "matmul"]
    assert dict(folded.ops[0].attrs)["axis"] == 1 and folded.ops[0].inputs[0] is view
    ids = rng.integers(-50, 50, (2, 5))
    plan = polyhal.compile(program, "cpu:0")
    np.testing.assert_allclose(plan(ids).numpy(), _tied_expected(table, ids), rtol=1e-5, atol=1e-5)
    assert "gather: gather -> gather, transpose (%gather)" in plan.explain()


def test_a_device_that_uploads_constants_holds_a_tied_table_once():
    names = [s.name for s in polyhal.devices() if s.backend == "opencl"]
    if not names:
        pytest.skip("no OpenCL device")
    rng = np.random.default_rng(8)
    table = rng.standard_normal((64, 8)).astype(np.float32)
    plan = polyhal.compile(_tied(table), names[0])
    assert [t.shape for t in plan.constants] == [(8, 64)]  # one upload of the table, row-major
    ids = rng.integers(0, 64, (2, 5))
    np.testing.assert_allclose(plan(ids).numpy(), _tied_expected(table, ids), rtol=1e-4, atol=1e-4)


def test_a_table_also_read_by_other_ops_keeps_its_original_beside_the_view():
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    b = polyhal.ProgramBuilder("shared")
    x = b.input("x", (2, 4))
    wte = b.constant(table, "wte")
    b.output(b.matmul(x, wte), b.transpose(wte, perm=[1, 0]), b.add(b.transpose(wte, perm=[1, 0]), b.constant(np.float32(1))))
    folded, changes = fold_constant_transposes(b.build())
    # One transpose is a program output and stays an op; the other folds; the matmul keeps the table.
    assert [c.kind for c in changes] == ["constant"]
    assert sorted(v.type.shape for v, _ in folded.constants) == [(), (3, 4), (4, 3)]


def test_repeated_transposes_of_one_constant_share_one_view():
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    b = polyhal.ProgramBuilder("twice")
    x = b.input("x", (2, 3))
    wte = b.constant(table, "wte")
    y = b.add(b.matmul(x, b.transpose(wte, perm=[1, 0])), b.matmul(b.neg(x), b.transpose(wte, perm=[1, 0])))
    b.output(y)
    folded, changes = fold_constant_transposes(b.build())
    assert [c.kind for c in changes] == ["constant", "constant"]
    (view, _), = folded.constants
    assert [op.inputs[1] for op in folded.ops if op.name == "matmul"] == [view, view]
    xs = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(polyhal.compile(b.build(), "cpu:0")(xs).numpy(), np.zeros((2, 4)), atol=1e-6)


# --------------------------------------------------------------------------------- ONNX-made graphs

def _onnx_block(gelu: str):
    """A DistilBERT/GPT-2-style block in ONNX: scores + mask (a padding mask from an input via
    Where, or a causal one from Trilu and Where on constants), softmax, and a GELU MLP written
    out as the TorchScript (erf) or dynamo (tanh, Pow) exporter writes it."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(7)
    w = rng.standard_normal((D, 4 * D)).astype(np.float32) * 0.5
    consts = {"scale": np.float32(1 / math.sqrt(D)), "neg": np.float32(NEG), "zero": np.float32(0),
              "sqrt2": np.float32(math.sqrt(2)), "one": np.float32(1), "half": np.float32(0.5),
              "three": np.float32(3), "cubic": np.float32(0.044715), "c": np.float32(math.sqrt(2 / math.pi)),
              "w": w, "ones": np.ones((L, L), np.float32)}
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["qk"]),
             helper.make_node("Mul", ["qk", "scale"], ["s"])]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, (B, H, L, D)) for n in "qkv"]
    if gelu == "erf":  # padding mask from a 0/1 input, as DistilBERT's export builds it
        inputs.append(helper.make_tensor_value_info("keep", TensorProto.BOOL, (B, 1, 1, L)))
        nodes.append(helper.make_node("Where", ["keep", "zero", "neg"], ["mask"]))
    else:  # causal mask from constants: Trilu then Where, as GPT-2's dynamo export has it
        nodes += [helper.make_node("Trilu", ["ones"], ["tril"], upper=0),
                  helper.make_node("Cast", ["tril"], ["lower"], to=TensorProto.BOOL),
                  helper.make_node("Where", ["lower", "zero", "neg"], ["mask"])]
    nodes += [helper.make_node("Add", ["s", "mask"], ["sm"]),
              helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "v"], ["ctx"]),
              helper.make_node("MatMul", ["ctx", "w"], ["h"])]
    if gelu == "erf":
        nodes += [helper.make_node("Div", ["h", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
                  helper.make_node("Add", ["e", "one"], ["a"]), helper.make_node("Mul", ["h", "a"], ["m"]),
                  helper.make_node("Mul", ["m", "half"], ["y"])]
    else:
        nodes += [helper.make_node("Mul", ["h", "half"], ["m1"]), helper.make_node("Pow", ["h", "three"], ["p3"]),
                  helper.make_node("Mul", ["p3", "cubic"], ["m2"]), helper.make_node("Add", ["h", "m2"], ["a6"]),
                  helper.make_node("Mul", ["a6", "c"], ["m3"]), helper.make_node("Tanh", ["m3"], ["t"]),
                  helper.make_node("Add", ["t", "one"], ["a7"]), helper.make_node("Mul", ["m1", "a7"], ["y"])]
    graph = helper.make_graph(nodes, "block", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, (B, H, L, 4 * D))],
                              [numpy_helper.from_array(np.asarray(a), n) for n, a in consts.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)  # older onnxruntimes read it


@pytest.mark.parametrize("gelu", ["erf", "tanh"])
def test_onnx_blocks_fuse_and_match_onnxruntime(gelu, tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    import polyhal.onnx

    path = tmp_path / f"block-{gelu}.onnx"
    onnx.save(_onnx_block(gelu), path)
    q, k, v = _qkv(8)
    feeds = {"q": q, "k": k, "v": v}
    if gelu == "erf":
        keep = np.ones((B, 1, 1, L), bool)
        keep[0, ..., L // 2:] = False
        feeds["keep"] = keep
    program = polyhal.onnx.load(str(path))
    plan = program.compile("cpu:0")
    names = [op.name for op in plan.program.ops]
    assert "masked_attention" in names and "gelu" in names and "softmax" not in names
    assert not {"erf", "tanh", "pow"} & set(names)
    got = np.asarray(program.execute(plan, feeds)["y"])
    (want,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
