"""Trust in producers: what another library, a file or a model hands polyhal is checked before use.

Forged DLPack capsules (real PyCapsules over structs filled in by hand with ctypes), ``polyhal
run --output`` and planted symlinks, model-provided names printed by the CLI, non-UTF-8 string
inputs, and the integer edge cases of Div, Mod and Split.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import polyhal
from polyhal import dlpack
from polyhal.errors import DLPackError

# ------------------------------------------------------------------------- forged DLPack capsules

_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))
_capsule_get_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))


class Forged:
    """A real DLPack capsule over a ``DLManagedTensorVersioned`` (or legacy ``DLManagedTensor``)
    that a test fills in: ``base``'s memory and layout unless a field is given. It keeps the
    structs and ``base`` alive and counts calls of its deleter."""

    def __init__(self, base: np.ndarray, *, versioned: bool = True, ndim: int | None = None,
                 shape: list[int] | None = None, strides: list[int] | None = None, data: int | None = None,
                 byte_offset: int = 0, readonly: bool = False) -> None:
        self.base, self.deleted = base, 0
        shape = list(base.shape) if shape is None else shape
        strides = [s // base.itemsize for s in base.strides] if strides is None else strides
        self.shape = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self.strides = (ctypes.c_int64 * max(len(strides), 1))(*strides)
        self.deleter = dlpack._Deleter(self._delete)
        managed = dlpack.DLManagedTensorVersioned() if versioned else dlpack.DLManagedTensor()
        if versioned:
            managed.version = dlpack.DLPackVersion(1, 0)
            managed.flags = dlpack.DLPACK_FLAG_BITMASK_READ_ONLY if readonly else 0
        managed.deleter = self.deleter
        t = managed.dl_tensor
        t.data = base.ctypes.data if data is None else data
        t.device = dlpack.DLDevice(dlpack.DLDeviceType.CPU, 0)
        t.ndim = len(shape) if ndim is None else ndim
        t.dtype = dlpack.DLDataType(*dlpack.dlpack_dtype(base.dtype))
        t.shape = ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64))
        t.strides = ctypes.cast(self.strides, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = byte_offset
        self.managed = managed
        self.name = b"dltensor_versioned" if versioned else b"dltensor"
        self.capsule = _capsule_new(ctypes.addressof(managed), self.name, None)

    def _delete(self, _ptr: int) -> None:
        self.deleted += 1

    @property
    def consumed(self) -> bool:
        return _capsule_get_name(self.capsule).startswith(b"used_")


_BASE = np.arange(12, dtype=np.float32).reshape(3, 4)
FORGERIES = {
    "ndim past numpy's bound": dict(ndim=(1 << 31) - 1),
    "ndim 65": dict(ndim=65),
    "negative extent": dict(shape=[3, -4]),
    "NULL data with elements": dict(data=0),
    "strides past the address space": dict(strides=[1 << 60, 1]),
    "byte_offset past the address space": dict(byte_offset=(1 << 64) - 8),
    "extents past any memory": dict(shape=[1 << 40, 1 << 40], strides=[1, 1]),
    "a pointer near the end of the address space": dict(data=(1 << 64) - 16),
    "strides that reach before address 0": dict(data=64, strides=[-4096, 1]),
    "a stride past any memory on an extent of 1": dict(shape=[1, 4], strides=[1 << 62, 1]),
}


@pytest.mark.parametrize("versioned", [True, False], ids=["versioned", "legacy"])
@pytest.mark.parametrize("forgery", FORGERIES, ids=[k.replace(" ", "-") for k in FORGERIES])
def test_forged_capsule_is_refused_and_left_to_its_producer(forgery, versioned):
    forged = Forged(_BASE.copy(), versioned=versioned, **FORGERIES[forgery])
    with pytest.raises(DLPackError, match="malformed DLPack tensor"):
        polyhal.from_dlpack(forged.capsule)
    # Refused before it was consumed: the producer still owns it, and its deleter was not called.
    assert not forged.consumed and forged.deleted == 0


def test_forged_capsule_with_empty_shape_and_null_data_imports():
    """DLPack allows NULL data for a tensor without elements (torch exports such): no byte is read."""
    forged = Forged(np.zeros((0, 3), np.float32), data=0)
    t = polyhal.from_dlpack(forged.capsule)
    assert t.shape == (0, 3) and forged.consumed
    del t


def test_honest_forged_capsule_imports_the_same_bytes():
    """The forging itself is sound: an honest description of a strided view imports exactly."""
    base = np.arange(24, dtype=np.int32).reshape(4, 6)
    forged = Forged(base, shape=[2, 3], strides=[12, 2], byte_offset=4)  # base[::2, 1::2]
    t = polyhal.from_dlpack(forged.capsule)
    np.testing.assert_array_equal(t.numpy(), base[::2, 1::2])
    del t


class _LyingArray(np.ndarray):
    """A numpy array whose ``__dlpack__`` describes more memory than the array has."""

    def __dlpack__(self, **_kw):
        self.forged = Forged(np.asarray(self), shape=[self.shape[0] * 1024])
        return self.forged.capsule


def test_producer_that_overstates_its_memory_is_refused():
    lying = np.arange(8, dtype=np.float64).view(_LyingArray)
    with pytest.raises(DLPackError, match="outside the memory its producer exposes"):
        polyhal.from_dlpack(lying)
    assert not lying.forged.consumed


def test_numpy_views_within_their_memory_import():
    base = np.arange(60, dtype=np.float32).reshape(5, 12)
    for view in (base[1:4, 2:9:3], base[:, ::5], base[4:], base.T):
        np.testing.assert_array_equal(polyhal.from_dlpack(view).numpy(), view)


# ------------------------------------------------------------------------- integer edge cases

onnx = pytest.importorskip("onnx")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper  # noqa: E402

import polyhal.onnx as ponnx  # noqa: E402
from polyhal.errors import ArithmeticDomainError  # noqa: E402
from polyhal.frontends.onnx.errors import OnnxInputError, OnnxModelError  # noqa: E402

_ONNX_TYPES = {np.int8: T.INT8, np.uint8: T.UINT8, np.int32: T.INT32, np.int64: T.INT64, np.float32: T.FLOAT}


def _binary(op: str, dtype, n: int, *, constant_b=None, **attrs):
    """A model ``y = op(a, b)`` over ``n`` elements of ``dtype``; ``b`` an initializer if given."""
    elem = _ONNX_TYPES[dtype]
    inits = [] if constant_b is None else [onnx.numpy_helper.from_array(np.asarray(constant_b, dtype), "b")]
    inputs = [helper.make_tensor_value_info("a", elem, [n])]
    if constant_b is None:
        inputs.append(helper.make_tensor_value_info("b", elem, [n]))
    graph = helper.make_graph([helper.make_node(op, ["a", "b"], ["y"], **attrs)], "g", inputs,
                              [helper.make_tensor_value_info("y", elem, [n])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _ort(model, feeds):
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int32, np.int64])
@pytest.mark.parametrize("fmod", [0, 1])
def test_integer_mod_by_zero_is_refused_as_onnxruntime_refuses_it(dtype, fmod):
    feeds = {"a": np.array([7, 5, 2], dtype), "b": np.array([3, 0, 1], dtype)}
    with pytest.raises(Exception, match="modulo by zero"):
        _ort(_binary("Mod", dtype, 3, fmod=fmod), feeds)
    with pytest.raises(ArithmeticDomainError, match="mod by zero"):
        ponnx.load(_binary("Mod", dtype, 3, fmod=fmod)).run(feeds, "cpu:0")
    with pytest.raises(ArithmeticDomainError, match="mod by zero"):  # folded at import: the same answer
        ponnx.load(_binary("Mod", dtype, 3, constant_b=feeds["b"], fmod=fmod)).run({"a": feeds["a"]}, "cpu:0")


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int32, np.int64])
def test_integer_division_by_zero_is_refused_as_onnxruntime_refuses_it(dtype):
    feeds = {"a": np.array([7, 5, 2], dtype), "b": np.array([3, 0, 1], dtype)}
    with pytest.raises(Exception, match="division by zero"):
        _ort(_binary("Div", dtype, 3), feeds)
    with pytest.raises(ArithmeticDomainError, match="division by zero"):
        ponnx.load(_binary("Div", dtype, 3)).run(feeds, "cpu:0")


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64])
def test_minimum_divided_by_minus_one_is_refused(dtype):
    """onnxruntime dies of SIGFPE here (x86's idiv traps), so there is nothing to match: refused."""
    low = np.iinfo(dtype).min
    feeds = {"a": np.array([low, 9], dtype), "b": np.array([-1, 2], dtype)}
    with pytest.raises(ArithmeticDomainError, match="outside the range of"):
        ponnx.load(_binary("Div", dtype, 2)).run(feeds, "cpu:0")
    ok = {"a": np.array([low, -9], dtype), "b": np.array([1, 2], dtype)}  # the edges that fit still divide
    np.testing.assert_array_equal(ponnx.load(_binary("Div", dtype, 2)).run(ok, "cpu:0")["y"],
                                  np.array([low, -4], dtype))


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64])
@pytest.mark.parametrize("fmod", [0, 1])
def test_minimum_mod_minus_one_is_zero_as_in_onnxruntime(dtype, fmod):
    feeds = {"a": np.array([np.iinfo(dtype).min, -7], dtype), "b": np.array([-1, 3], dtype)}
    model = _binary("Mod", dtype, 2, fmod=fmod)
    np.testing.assert_array_equal(ponnx.load(model).run(feeds, "cpu:0")["y"], _ort(model, feeds)[0])


def test_float_division_and_mod_by_zero_keep_their_ieee_results():
    feeds = {"a": np.array([1, -1, 0], np.float32), "b": np.zeros(3, np.float32)}
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(ponnx.load(_binary("Div", np.float32, 3)).run(feeds, "cpu:0")["y"],
                                      feeds["a"] / feeds["b"])
        got = ponnx.load(_binary("Mod", np.float32, 3, fmod=1)).run(feeds, "cpu:0")["y"]
    assert np.isnan(got).all()


def _split_model(sizes, opset):
    # A symbolic dim: with a fixed one, onnx's shape inference would contradict the data first.
    x = helper.make_tensor_value_info("x", T.FLOAT, ["n"])
    outs = [helper.make_tensor_value_info(f"y{i}", T.FLOAT, [f"n{i}"]) for i in range(len(sizes))]
    if opset < 13:
        node, inits = helper.make_node("Split", ["x"], [o.name for o in outs], axis=0, split=sizes), []
    else:
        node = helper.make_node("Split", ["x", "s"], [o.name for o in outs], axis=0)
        inits = [helper.make_tensor("s", T.INT64, [len(sizes)], sizes)]
    graph = helper.make_graph([node], "g", [x], outs, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("opset", [11, 18])
@pytest.mark.parametrize("sizes", [[-1, 5], [5, -1], [6, -2]])
def test_negative_split_sizes_are_refused_as_onnxruntime_refuses_them(sizes, opset):
    x = {"x": np.arange(4, dtype=np.float32)}
    if opset >= 13:
        with pytest.raises(Exception, match="must be >= 0"):
            _ort(_split_model(sizes, opset), x)
    with pytest.raises(OnnxModelError, match="must be >= 0"):
        ponnx.load(_split_model(sizes, opset)).run(x, "cpu:0")


# ------------------------------------------------------------------------- string inputs

def _strings_model():
    graph = helper.make_graph([helper.make_node("StringConcat", ["s", "s"], ["y"])], "g",
                              [helper.make_tensor_value_info("s", T.STRING, [2])],
                              [helper.make_tensor_value_info("y", T.STRING, [2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


@pytest.mark.parametrize("feed", [np.array([b"ok", b"\xff\xfe"], dtype="S"), np.array([b"ok", b"\xc3"], dtype=object)],
                         ids=["S-array", "object-array"])
def test_non_utf8_string_input_is_a_polyhal_error(feed):
    with pytest.raises(OnnxInputError, match=r"element \[1\] .* is not UTF-8"):
        ponnx.load(_strings_model()).run({"s": feed}, "cpu:0")


def test_utf8_bytes_still_decode():
    got = ponnx.load(_strings_model()).run({"s": np.array(["é".encode(), b"x"], dtype=object)}, "cpu:0")
    assert got["y"].tolist() == ["éé", "xx"]


# ------------------------------------------------------------------------- the CLI: --output and names

import os  # noqa: E402

from polyhal.cli import main as cli_main  # noqa: E402


def _relu_model(path, x="x", y="y", node="relu"):
    graph = helper.make_graph([helper.make_node("Relu", [x], [y], name=node)], "g",
                              [helper.make_tensor_value_info(x, T.FLOAT, [3])],
                              [helper.make_tensor_value_info(y, T.FLOAT, [3])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return str(path)


def test_output_refuses_a_symlink_planted_at_an_output_file(tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / "y.npy").symlink_to(victim)
    assert cli_main(["run", _relu_model(tmp_path / "m.onnx"), "--device", "cpu:0", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "y.npy is a symbolic link" in err and len(err.strip().splitlines()) == 1
    assert victim.read_text() == "precious"


def test_output_replaces_a_hard_link_instead_of_writing_through_it(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    os.link(victim, out / "y.npy")
    assert cli_main(["run", _relu_model(tmp_path / "m.onnx"), "--device", "cpu:0", "--output", str(out)]) == 0
    assert victim.read_text() == "precious"
    assert np.load(out / "y.npy").shape == (3,) and not any(p.name.endswith(".tmp") for p in out.iterdir())


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0,
                    reason="making a symbolic link owned by another user needs root (lchown)")
@pytest.mark.parametrize("where", ["output folder", "parent"])
def test_output_refuses_a_symlink_another_user_owns(tmp_path, capsys, where):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "shared"
    link.symlink_to(elsewhere, target_is_directory=True)
    os.lchown(link, 54321, 54321)  # as if another user had planted it
    out = link if where == "output folder" else link / "out"
    assert cli_main(["run", _relu_model(tmp_path / "m.onnx"), "--device", "cpu:0", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "symbolic link owned by another user (uid 54321)" in err and len(err.strip().splitlines()) == 1
    assert not any(elsewhere.rglob("*.npy"))


def test_own_symlinked_output_folder_still_works(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    assert cli_main(["run", _relu_model(tmp_path / "m.onnx"), "--device", "cpu:0",
                     "--output", str(tmp_path / "link")]) == 0
    assert (tmp_path / "real" / "y.npy").exists()


ESCAPE = "\x1b]0;owned\x07\x1b[2J\r\u202e"


def test_model_names_are_printed_escaped(tmp_path, capsys):
    model = _relu_model(tmp_path / "m.onnx", x="in" + ESCAPE, y="out" + ESCAPE, node="n" + ESCAPE)
    assert cli_main(["run", model, "--device", "cpu:0", "--explain", "--profile"]) == 0
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\x07\r\u202e")
    assert "out\\x1b]0;owned\\x07\\x1b[2J\\r\\u202e" in out and "in\\x1b" in out and "n\\x1b" in out


def test_model_names_in_errors_are_printed_escaped(tmp_path, capsys):
    graph = helper.make_graph([helper.make_node("Split", ["x", "s"], ["a", "b"], axis=0, name="evil" + ESCAPE)], "g",
                              [helper.make_tensor_value_info("x", T.FLOAT, [4])],
                              [helper.make_tensor_value_info(n, T.FLOAT, [None]) for n in "ab"],
                              initializer=[helper.make_tensor("s", T.INT64, [2], [-1, 5])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), tmp_path / "m.onnx")
    assert cli_main(["run", str(tmp_path / "m.onnx"), "--device", "cpu:0"]) == 2
    err = capsys.readouterr().err
    assert "evil\\x1b" in err and not any(c in err for c in "\x1b\x07\r\u202e")
