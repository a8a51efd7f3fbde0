"""polyhal.frontends.onnx.proto: ONNX's messages without ``import onnx``, and its conversions
agreeing with onnx's ``helper``/``numpy_helper`` (issue 30: a later ``polyhal run`` imports
neither onnx nor ml_dtypes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from polyhal.frontends.onnx import proto

ROOT = Path(__file__).resolve().parents[1]


def _fresh(code: str, env: dict | None = None) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, **(env or {})})
    return out.stdout.strip()


def test_messages_are_onnx_own_classes_whichever_is_imported_first():
    code = ("import sys\nfrom polyhal.frontends.onnx.proto import pb\nbefore = 'onnx' in sys.modules\n"
            "import onnx\nprint(before, pb.ModelProto is onnx.ModelProto, pb.TensorProto is onnx.TensorProto,"
            " isinstance(pb.GraphProto(), onnx.GraphProto))")
    assert _fresh(code) == "False True True True"
    assert proto.pb.ModelProto is onnx.ModelProto  # this process: onnx was imported first


_LATER = {
    "polyhal run": ("import io, contextlib\nfrom polyhal.cli import main\n"
                    "with contextlib.redirect_stdout(io.StringIO()):\n"
                    "    status = main(['run', 'examples/transformer_block.onnx', '--dim', 'seq=128', '--device', 'cpu:0'])\n"
                    "print(status, end=' ')", "0"),
    "polyhal run, every device": ("import io, contextlib\nfrom polyhal.cli import main\n"
                                  "with contextlib.redirect_stdout(io.StringIO()):\n"
                                  "    status = main(['run', 'examples/transformer_block.onnx', '--dim', 'seq=128'])\n"
                                  "print(status, end=' ')", "0"),  # (every backend lists its devices)
    "InferenceSession": ("import numpy as np, polyhal\n"
                         "s = polyhal.InferenceSession('examples/transformer_block.onnx', 'cpu:0')\n"
                         "(y,) = s.run(None, {'x': np.ones((1, 128, 128), np.float32)})\n"
                         "print(s.get_inputs()[0].type, y.shape, end=' ')", "tensor(float) (1, 128, 128)"),
}


@pytest.mark.parametrize("how", sorted(_LATER))
def test_a_later_process_imports_neither_onnx_nor_ml_dtypes(tmp_path, how):
    job, output = _LATER[how]
    code = f"import sys\n{job}\nprint('onnx' in sys.modules, 'ml_dtypes' in sys.modules)"
    env = {"POLYHAL_ONNX_CACHE_DIR": str(tmp_path / "onnx")}
    assert _fresh(code, env) == f"{output} True True"  # the first checks the model: onnx's checker
    assert _fresh(code, env) == f"{output} False False"  # a later one reads the checked model back


_NUMPY_TYPES = [np.float32, np.float64, np.float16, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                np.uint32, np.uint64, np.bool_, np.complex64, np.complex128]


@pytest.mark.parametrize("dtype", _NUMPY_TYPES + [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.int4,
                                                  ml_dtypes.uint4, ml_dtypes.float4_e2m1fn])
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 3)])
@pytest.mark.parametrize("raw", [True, False])
def test_to_array_agrees_with_numpy_helper(dtype, shape, raw):
    rng = np.random.default_rng(0)
    values = rng.integers(0, 7, shape).astype(np.float32) / 2  # held exactly by every type, float4 and int4 too
    array = values.astype(dtype) if np.dtype(dtype).kind != "b" else values > 0
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    if raw:
        tensor = numpy_helper.from_array(array, "t")
    else:
        tensor = helper.make_tensor("t", elem, shape, array.reshape(-1).tolist() if np.dtype(dtype).kind in "fiubc"
                                    and np.dtype(dtype) in map(np.dtype, _NUMPY_TYPES) else array.reshape(-1))
    expected = numpy_helper.to_array(tensor)
    got = proto.to_array(tensor)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert got.tobytes() == expected.tobytes()  # bit for bit (ml_dtypes' types compare as values)


def test_to_array_of_strings_and_external_data_is_onnx_own(tmp_path):
    strings = helper.make_tensor("s", onnx.TensorProto.STRING, (2,), [b"a", b"bc"])
    assert proto.to_array(strings).tolist() == ["a", "bc"]
    external = numpy_helper.from_array(np.arange(4, dtype=np.float32), "e")
    external.data_location = onnx.TensorProto.EXTERNAL
    external.ClearField("raw_data")
    with pytest.raises(Exception) as ours:
        proto.to_array(external)
    with pytest.raises(Exception) as theirs:
        numpy_helper.to_array(external)
    assert type(ours.value) is type(theirs.value)


def test_dtype_maps_agree_with_helper():
    for elem in onnx.TensorProto.DataType.values():
        try:
            expected = helper.tensor_dtype_to_np_dtype(elem)
        except KeyError:
            with pytest.raises(KeyError):
                proto.np_dtype_of(elem)
            continue
        assert proto.np_dtype_of(elem) == expected
        assert proto.elem_type_name(elem) == helper.tensor_dtype_to_string(elem)
        if elem != onnx.TensorProto.STRING:
            assert proto.elem_type_of(expected) == helper.np_dtype_to_tensor_dtype(expected)


@pytest.mark.parametrize("value", [1.5, 3, "text", [1.0, 2.5], [1, 2], ["a", "b"], np.ones((2,), np.float32),
                                   helper.make_graph([], "g", [], [])])
def test_attribute_value_agrees_with_helper(value):
    a = helper.make_attribute("a", value)
    assert proto.attribute_value(a) == helper.get_attribute_value(a)
    reference = onnx.AttributeProto(name="r", ref_attr_name="outer", type=onnx.AttributeProto.INT)
    with pytest.raises(ValueError):
        proto.attribute_value(reference)
    assert proto.attribute_value(onnx.AttributeProto(name="u")) is None


@pytest.mark.parametrize("shape", [None, [], [2, 3], ["batch", None, 4]])
def test_tensor_value_info_agrees_with_helper(shape):
    ours = proto.tensor_value_info("x", onnx.TensorProto.FLOAT, shape)
    theirs = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, shape)
    assert ours.SerializeToString(deterministic=True) == theirs.SerializeToString(deterministic=True)
    assert ours.type.tensor_type.HasField("shape") == theirs.type.tensor_type.HasField("shape")
