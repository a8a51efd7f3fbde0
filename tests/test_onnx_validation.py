"""The checked-model cache (polyhal.frontends.onnx.validation): a model ONNX's checker accepted
is read back in a later process instead of checked again; the cache trusts nothing it did not
make (a changed entry is refused and the model checked again), keeps no refused model, and is
off with ``POLYHAL_ONNX_CACHE_DIR=off``."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper as h

from polyhal.codecache import CacheWarning
from polyhal.frontends.onnx import validation
from polyhal.frontends.onnx.errors import OnnxModelError
from polyhal.frontends.onnx.importer import load

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _model(scale: float = 2.0) -> onnx.ModelProto:
    node = h.make_node("Mul", ["x", "s"], ["y"])
    graph = h.make_graph([node], "scale", [h.make_tensor_value_info("x", T.FLOAT, ["n", 3])],
                         [h.make_tensor_value_info("y", T.FLOAT, ["n", 3])],
                         [h.make_tensor("s", T.FLOAT, [3], [scale] * 3)])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "onnx-cache"
    monkeypatch.setenv("POLYHAL_ONNX_CACHE_DIR", str(folder))
    monkeypatch.setattr(validation, "_seen", {})  # as a new process: nothing read yet
    return folder


@pytest.fixture
def checks(monkeypatch):
    """The number of times ONNX's checker ran (the real one runs)."""
    count = []
    real = onnx.checker.check_model

    def counted(*args, **kwargs):
        count.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(onnx.checker, "check_model", counted)
    return count


def _run(program, x):
    plan = program.compile("cpu:0")
    return program.execute(plan, {"x": x})["y"]


def test_a_model_checked_once_is_read_back_not_checked_again(cache_dir, checks):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    first = _run(load(_model().SerializeToString()), x)
    assert len(checks) == 1 and len(list(cache_dir.glob("*.onnx"))) == 1
    assert oct(cache_dir.stat().st_mode & 0o777) == "0o700"
    validation._seen.clear()  # a later process: from the file
    again = _run(load(_model().SerializeToString()), x)
    assert len(checks) == 1
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(again, x * 2)
    np.testing.assert_array_equal(_run(load(_model(3.0)), x), x * 3)  # another model (its small weights in it)
    assert len(checks) == 2


def test_a_changed_entry_is_refused_and_the_model_checked_again(cache_dir, checks):
    load(_model())
    [entry] = cache_dir.glob("*.onnx")
    entry.write_bytes(entry.read_bytes().replace(b"Mul", b"Add"))  # same size, another op
    validation._seen.clear()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        program = load(_model())
    assert len(checks) == 2
    assert any(issubclass(w.category, CacheWarning) and "sha256" in str(w.message) for w in said)
    x = np.ones((1, 3), np.float32)
    np.testing.assert_array_equal(_run(program, x), x * 2)  # the Mul the model has, not the planted Add


def test_a_refused_model_is_not_kept(cache_dir, checks):
    bad = _model()
    bad.graph.node[0].input[1] = "nowhere"
    for _ in range(2):
        with pytest.raises(OnnxModelError, match="checker rejects"):
            load(bad)
    assert len(checks) == 2 and not list(cache_dir.glob("*.onnx"))


def test_off_checks_every_time_and_writes_nothing(cache_dir, checks, monkeypatch):
    monkeypatch.setenv("POLYHAL_ONNX_CACHE_DIR", "off")
    load(_model())
    load(_model())
    assert len(checks) == 2 and not cache_dir.exists()


def test_a_cache_folder_others_may_write_is_not_used(cache_dir, checks, monkeypatch):
    import polyhal.codecache

    monkeypatch.setattr(polyhal.codecache, "_warned", set())  # warned once per process
    load(_model())
    os.chmod(cache_dir, 0o777)
    validation._seen.clear()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        load(_model())
    assert len(checks) == 2
    assert any(issubclass(w.category, CacheWarning) and "others may write" in str(w.message)
               or "writable" in str(w.message) for w in said), [str(w.message) for w in said]


def test_a_fresh_process_reads_the_example_models_checked(tmp_path):
    """The example models in a new process: checked by the first, read back by the next (no
    ONNX schema set-up: onnx.defs never asked)."""
    env = dict(os.environ, POLYHAL_ONNX_CACHE_DIR=str(tmp_path / "c"))
    code = ("import sys, onnx.checker as c, polyhal\n"
            "calls = []\nreal = c.check_model\nc.check_model = lambda *a, **k: (calls.append(1), real(*a, **k))[1]\n"
            "for m in sys.argv[1:]: polyhal.InferenceSession(m, 'cpu:0')\nprint(len(calls))")
    models = [str(EXAMPLES / f"{m}.onnx") for m in ("mlp", "transformer_block", "detection_postprocess")]
    runs = [subprocess.run([sys.executable, "-c", code, *models], env=env, capture_output=True, text=True,
                           check=True).stdout.split()[-1] for _ in range(2)]
    assert runs == ["3", "0"]


def test_the_cache_key_takes_onnxs_version_from_the_imported_module(monkeypatch):
    import sys
    import types
    from importlib import metadata

    from polyhal.frontends.onnx import validation

    validation._onnx_version.cache_clear()
    monkeypatch.setitem(sys.modules, "onnx", types.SimpleNamespace(__version__="9.9.9"))
    try:
        assert validation._onnx_version() == "9.9.9"  # no metadata read where onnx is imported
        monkeypatch.delitem(sys.modules, "onnx")
        validation._onnx_version.cache_clear()
        assert validation._onnx_version() == metadata.version("onnx")
    finally:
        validation._onnx_version.cache_clear()
