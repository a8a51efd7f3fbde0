"""The precision policy (polyhal.passes.precision): compile(precision=), POLYHAL_PRECISION, the
TF32 marking and the float16 lowering, on the CPU (which computes float16, and has no TF32)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

import polyhal
from polyhal import ProgramBuilder
from polyhal.errors import PrecisionError
from polyhal.ops import OPS
from polyhal.passes import precision as prec
from polyhal.passes.precision import PrecisionReport, PrecisionWarning, allow_tf32, lower_precision, to_float16

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ANYWHERE = (lambda op: "cpu:0", lambda device, p: True)  # a device that has every precision


def mlp(rng, *, extra_input: bool = False):
    b = ProgramBuilder("mlp")
    x = b.input("x", (4, 8), "float32")
    w1 = b.constant(rng.standard_normal((8, 16)).astype(np.float32))
    bias = b.constant(rng.standard_normal((16,)).astype(np.float32))
    h = b.relu(b.add(b.matmul(x, w1), bias))
    if extra_input:  # a float32 value computed at run time meets the float16 product: promotion
        h = b.add(h, b.input("r", (4, 16), "float32"))
    w2 = b.constant(rng.standard_normal((16, 16)).astype(np.float32))
    b.output(b.softmax(b.matmul(h, w2), axis=-1))
    b.output(h)
    return b.build()


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def test_resolve_precision(monkeypatch):
    monkeypatch.delenv(prec.ENV, raising=False)
    assert prec.resolve_precision(None) == ("fp32", "default")
    assert prec.resolve_precision("FP16") == ("fp16", "precision=")
    monkeypatch.setenv(prec.ENV, "tf32")
    assert prec.resolve_precision(None) == ("tf32", prec.ENV)
    assert prec.resolve_precision("fp32") == ("fp32", "precision=")  # the option wins over the env
    monkeypatch.setenv(prec.ENV, "half")
    with pytest.raises(polyhal.ConfigError, match="POLYHAL_PRECISION='half' is not one of fp32, tf32, fp16"):
        prec.resolve_precision(None)
    monkeypatch.setenv(prec.ENV, "bf16")
    with pytest.raises(polyhal.ConfigError, match="bf16 is storage-only"):
        prec.resolve_precision(None)
    with pytest.raises(PrecisionError, match="no device computes in bfloat16.*use 'fp16'"):
        prec.resolve_precision("bf16")


def test_unknown_precision_fails_before_compiling(rng):
    with pytest.raises(PrecisionError, match="'int8' is not a precision"):
        polyhal.compile(mlp(rng), "cpu:0", precision="int8")


def test_contractions_take_a_precision_attribute():
    contractions = {n for n, d in OPS.items() if d.contraction}
    assert {"matmul", "gemm", "linear", "fused_linear", "conv", "fused_conv", "attention", "einsum"} <= contractions
    assert OPS["matmul"].defaults["precision"] == "fp32" and "precision" not in OPS["add"].defaults
    x = polyhal.ir.types.TensorType((2, 3), "float32")
    w = polyhal.ir.types.TensorType((3, 4), "float32")
    assert OPS["matmul"].infer((x, w), {"precision": "tf32"})[0].shape == (2, 4)
    with pytest.raises(polyhal.ProgramError, match="matmul: precision must be one of fp32, tf32, got 'fp16'"):
        OPS["matmul"].infer((x, w), {"precision": "fp16"})
    a = np.ones((2, 3)), np.ones((3, 4))
    np.testing.assert_array_equal(OPS["matmul"].reference(*a, precision="tf32")[0], np.full((2, 4), 3.0))


def test_fp32_is_the_default_and_explained(rng, monkeypatch):
    monkeypatch.delenv(prec.ENV, raising=False)
    plan = polyhal.compile(mlp(rng), "cpu:0")
    assert "precision fp32 (default): float32 computes in float32" in plan.explain()
    assert all(dict(op.attrs).get("precision", "fp32") == "fp32" for op in plan.program.ops)


def test_tf32_on_a_device_without_it_computes_float32_and_says_so(rng, monkeypatch):
    monkeypatch.setattr(prec, "_warned", set())
    program = mlp(rng)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    with pytest.warns(PrecisionWarning, match="cpu:0 cannot compute in tf32; the program computes in float32"):
        plan = polyhal.compile(program, "cpu:0", precision="tf32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per precision and device set
        polyhal.compile(program, "cpu:0", precision="tf32")
    text = plan.explain()
    assert "precision tf32 (precision=): 0 contraction(s) may use TF32" in text
    assert "cpu:0 has no tf32: 2 op(s) compute in float32 there (fused_linear x1, matmul x1)" in text
    assert not any(("precision", "tf32") in op.attrs for op in plan.program.ops)
    for got, want in zip(plan.run_numpy(x), polyhal.compile(program, "cpu:0").run_numpy(x)):
        np.testing.assert_array_equal(got, want)


def test_allow_tf32_marks_float32_contractions_only(rng):
    b = ProgramBuilder("m")
    x = b.input("x", (4, 8), "float32")
    d = b.input("d", (4, 8), "float64")
    b.output(b.matmul(x, b.constant(np.ones((8, 2), np.float32))))
    b.output(b.matmul(d, b.constant(np.ones((8, 2), np.float64))))
    b.output(b.relu(x))
    program = b.build()
    report = PrecisionReport("tf32")
    marked = allow_tf32(program, *ANYWHERE, report)
    assert [dict(op.attrs).get("precision") for op in marked.ops] == ["tf32", None, None]
    assert report.changed == {"matmul": 1}
    assert program.ops[0].attrs == ()  # the given program is not changed
    # A device without TF32 kernels ignores the attribute: the CPU computes it in float32.
    xs = rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal((4, 8))
    for got, want in zip(polyhal.compile(marked, "cpu:0", fuse=False).run_numpy(*xs),
                         polyhal.compile(program, "cpu:0", fuse=False).run_numpy(*xs)):
        np.testing.assert_array_equal(got, want)


def test_fp16_lowers_products_keeps_softmax_and_the_boundary(rng):
    program = mlp(rng)
    plan = polyhal.compile(program, "cpu:0", precision="fp16")
    ops = [op for op in plan.program.ops if op.kind == "dispatch"]
    dtypes = {op.name: op.outputs[0].type.dtype.name for op in ops if op.name != "cast"}
    assert dtypes == {"fused_linear": "float16", "matmul": "float16", "softmax": "float32"}
    assert sum(op.name == "cast" for op in ops) == 3  # x down; the product and h back up
    assert [v.type.dtype.name for v in plan.program.inputs + plan.program.outputs] == ["float32"] * 3
    assert {c.type.dtype.name for c, _ in plan.program.constants} == {"float16"}  # no float32 copy kept
    text = plan.explain()
    assert "precision fp16 (precision=): 2 op(s) compute in float16" in text
    assert "kept in float32 for accuracy: 1 op(s) (softmax x1); 3 cast(s) inserted; 3 constant(s) converted" in text
    assert program.ops[0].outputs[0].type.dtype == np.float32  # the given program is not changed
    x = rng.standard_normal((4, 8)).astype(np.float32)
    want = polyhal.compile(program, "cpu:0").run_numpy(x)
    got = plan.run_numpy(x)
    for g, w in zip(got, want):
        assert g.dtype == np.float32
        np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2)
    assert max(float(np.max(np.abs(g - w))) for g, w in zip(got, want)) > 0  # it did compute in float16


def test_fp16_promotes_where_a_float32_operand_meets_a_float16_one(rng):
    program = lower_precision(mlp(rng, extra_input=True), *ANYWHERE)
    add = next(op for op in program.ops if op.name == "add" and op.inputs[1].name == "r")
    assert [v.type.dtype.name for v in add.inputs] == ["float32", "float32"]  # h cast back up, r as given
    assert add.outputs[0].type.dtype == np.float32


def test_fp16_leaves_ops_on_devices_without_float16_in_float32(rng):
    report = PrecisionReport("fp16")
    program = lower_precision(mlp(rng), lambda op: "cl:0", lambda device, p: False, report)
    assert all(v.type.dtype == np.float32 for op in program.ops for v in op.outputs)
    assert report.unable == {"cl:0": {"matmul": 2}} and not report.changed and report.casts == 0


def test_to_float16_clips_like_onnxruntime():
    got = to_float16(np.array([1e9, -3.4e38, 1e-12, -1e-12, 0.0, 0.5], np.float32))
    assert got.dtype == np.float16 and np.isfinite(got).all()
    assert got[0] == np.finfo(np.float16).max and got[1] == np.finfo(np.float16).min
    assert got[2] > 0 > got[3] and got[4] == 0 and got[5] == 0.5


def test_onnx_transformer_in_fp16_on_cpu(rng):
    onnx = pytest.importorskip("onnx")  # noqa: F841
    import polyhal.onnx

    program = polyhal.onnx.load(EXAMPLES / "transformer_block.onnx", default_dim=2)
    feeds = {n: rng.standard_normal(s).astype(d) for n, s, d in program.feed_types()}
    want = program.execute(program.compile("cpu:0"), feeds)
    plan = program.compile("cpu:0", precision="fp16")
    assert "kept in float32 for accuracy" in plan.explain() and "layer_norm" in plan.explain()
    got = program.execute(plan, feeds)
    for k in want:
        assert got[k].dtype == want[k].dtype
        np.testing.assert_allclose(got[k], want[k], rtol=3e-2, atol=3e-2)


def test_cli_precision_option(capsys):
    from polyhal.cli import main

    assert main(["run", str(EXAMPLES / "mlp.onnx"), "--dim", "batch=2", "--device", "cpu:0", "--precision", "fp16",
                 "--explain"]) == 0
    assert "precision fp16 (precision=)" in capsys.readouterr().out
    assert main(["run", str(EXAMPLES / "mlp.onnx"), "--dim", "batch=2", "--precision", "half"]) != 0
    assert "'half' is not a precision" in capsys.readouterr().err


def test_fp16_lowers_attention_as_autocast_does(rng):
    """attention computes in float16 (its kernels take the softmax in float32, as torch's
    scaled_dot_product_attention under autocast); the float16 result stays close on the CPU."""
    b = ProgramBuilder("heads")
    q, k, v = (b.input(n, (2, 3, 9, 8), "float32") for n in "qkv")
    b.output(b.attention(q, k, v))
    program = b.build()
    lowered = lower_precision(program, *ANYWHERE)
    (att,) = [op for op in lowered.ops if op.name == "attention"]
    assert [x.type.dtype.name for x in (*att.inputs, *att.outputs)] == ["float16"] * 4
    assert "attention" in prec.LOWER and "attention" not in prec.KEEP_FLOAT32
    feeds = [rng.standard_normal((2, 3, 9, 8)).astype(np.float32) for _ in range(3)]
    want = OPS["attention"].reference(*[f.astype(np.float64) for f in feeds])[0]
    got = polyhal.compile(program, "cpu:0", precision="fp16").run_numpy(*feeds)[0]
    assert got.dtype == np.float32 and np.max(np.abs(got - want)) < 5e-3
