"""The ahead-of-time module of the native loops: loaded without numba, the same results as the
JIT loops, calls it does not fit sent to the JIT, and a module that cannot be had falls back."""

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

pytest.importorskip("numba")

from polyhal_cpu import native, native_aot  # noqa: E402


@pytest.fixture(scope="module")
def aot():
    loops = native_aot.load(native._jit_loop, wait=True)
    if loops is None:
        pytest.skip("no ahead-of-time module here (see the .failed file in the cache directory)")
    return loops


def _child(code: str, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_process_running_a_depthwise_conv_loads_no_numba(aot):
    got = _child("""
        import json, sys
        import numpy as np
        from onnx import TensorProto, helper
        import polyhal.onnx
        from polyhal_cpu import native
        rng = np.random.default_rng(0)
        w = helper.make_tensor("w", TensorProto.FLOAT, (8, 1, 3, 3), rng.standard_normal(72).tolist())
        graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], group=8)], "g",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, 8, 9, 9))],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, (1, 8, 7, 7))], [w])
        program = polyhal.onnx.load(helper.make_model(graph))
        y = program.execute(program.compile("cpu:0"), {"x": rng.standard_normal((1, 8, 9, 9), dtype=np.float32)})
        print(json.dumps({"numba": "numba" in sys.modules, "llvmlite": "llvmlite" in sys.modules,
                          "path": str(getattr(native._loops, "path", "")), "shape": list(np.shape(y["y"]))}))
    """)
    assert got == {"numba": False, "llvmlite": False, "path": str(aot.path), "shape": [1, 8, 7, 7]}


def test_a_process_running_a_tiled_conv_loads_no_numba(aot):
    """The tiles' loops take an int64 index array beside float32 ones: the compiled module
    serves them too (a dtype check that knew only float32 sent every call to the JIT)."""
    got = _child("""
        import json, sys
        import numpy as np
        from onnx import TensorProto, helper
        import polyhal.onnx
        rng = np.random.default_rng(0)
        w = helper.make_tensor("w", TensorProto.FLOAT, (16, 16, 3, 3), rng.standard_normal(2304).tolist())
        graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "g",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, 16, 9, 9))],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, (1, 16, 9, 9))], [w])
        program = polyhal.onnx.load(helper.make_model(graph))
        y = program.execute(program.compile("cpu:0"), {"x": rng.standard_normal((1, 16, 9, 9), dtype=np.float32)})
        print(json.dumps({"numba": "numba" in sys.modules, "shape": list(np.shape(y["y"]))}))
    """)
    assert got == {"numba": False, "shape": [1, 16, 9, 9]}


def _results(loops) -> dict[str, np.ndarray]:
    """Each public loop wrapper called once (with ``loops`` serving it) on seeded data: its output."""
    rng = np.random.default_rng(1)
    f = lambda *s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
    x1, x2, img, scale, shift, y = f(1000), f(37, 129), f(2, 6, 11, 13), f(129), f(129), f(12, 40)
    w, bias = f(6, 1, 3, 3), f(6)
    w.flags.writeable = bias.flags.writeable = False  # weights are bound read-only
    inv = np.full((5, 6), 1 / 9, np.float32)
    calls = {
        "gelu_tanh": (np.empty_like(x1), lambda o: native.gelu_tanh(x1, o)),
        "gelu_erf": (np.empty_like(x1), lambda o: native.gelu_erf(x1, o)),
        "relu": (np.empty_like(x1), lambda o: native.relu(x1, o)),
        "softmax_rows": (np.empty_like(x2), lambda o: native.softmax_rows(x2, o)),
        "layer_norm": (np.empty_like(x2), lambda o: native.layer_norm(x2, scale, shift, 1e-5, o)),
        "depthwise": (np.empty((2, 6, 6, 7), np.float32),
                      lambda o: native.depthwise(img, w, native.column_table(7, 3, 2, 1, 1, 13), bias, None, o, (2, 2),
                                                 (1, 1), (1, 1), 1, 0.0, 0.0)),
        "pool2d": (np.empty((12, 5, 6), np.float32),
                   lambda o: native.pool2d(img.reshape(12, 11, 13), o, inv, np.empty(154, np.float32),
                                           native.column_table(6, 3, 2, 0, 1, 13), (3, 3), (2, 2), (0, 0), (1, 1),
                                           True)),
        "im2col": (np.empty((54, 84), np.float32),
                   lambda o: native.im2col(img, 0, o, np.empty(0, np.float32), (3, 3), (2, 2), (1, 1), (1, 1), (6, 7))),
        "epilogue": (y.copy(), lambda o: native.epilogue(o, np.resize(bias, 12), None, 1, 0.0, 0.0)),
        # (6, 27) weights @ img's first 1080 values as (27, 40); (40 pixels, 27) of them @ (27, 32)
        "gemm_tiles": (np.empty((6, 40), np.float32), lambda o: native.gemm_tiles(
            native.pack_gemm_weights(f(6, 27)), img.reshape(-1), np.arange(27) * 40, np.arange(27) * 32, 40, 40, 40, o,
            bias, None, np.empty(27 * 32, np.float32), np.empty(8 * 64, np.float32), 64, 6, 0.0, 0.0)),
        "gemm_channels_last": (np.empty((40, 32), np.float32), lambda o: native.gemm_channels_last(
            img.reshape(-1)[:1080].reshape(40, 27), f(27, 32), np.arange(27) * 32, o, f(32), f(40, 32),
            np.empty(8 * 32, np.float32), np.empty(8 * 27, np.float32), 16, 6, 0.0, 0.0)),
    }
    saved, native._loops = native._loops, loops
    try:
        for out, call in calls.values():
            call(out)
    finally:
        native._loops = saved
    return {name: out for name, (out, _) in calls.items()}


def test_compiled_loops_give_the_jit_loops_results(aot):
    ours, jits = _results(aot), _results(native._jit_loops())
    for name, got in ours.items():
        np.testing.assert_allclose(got, jits[name], rtol=1e-6, atol=1e-6, err_msg=name)


def test_a_call_the_compiled_signature_does_not_fit_runs_the_jit_loop(aot):
    x = np.random.default_rng(2).standard_normal(64, dtype=np.float32)
    out = np.zeros(64, np.float32)
    aot["relu"](x[::2], out[::2])  # strided: the compiled loop would read the wrong elements
    np.testing.assert_array_equal(out[::2], np.maximum(x[::2], 0))
    assert not out[1::2].any()
    m = np.random.default_rng(3).standard_normal((4, 5), dtype=np.float32)
    got = np.empty((4, 5), np.float32)
    aot["softmax_rows"](np.asfortranarray(m), got)
    np.testing.assert_allclose(got, np.exp(m) / np.exp(m).sum(1, keepdims=True), rtol=1e-5)


def test_no_module_where_it_is_off_failed_or_cannot_be_written(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYHAL_CPU_CACHE_DIR", "")
    assert native_aot.load(native._jit_loop) is None
    monkeypatch.setenv("POLYHAL_CPU_CACHE_DIR", str(tmp_path))
    failed = tmp_path / f"{native_aot.module_name()}.failed"
    failed.write_text(json.dumps({"reason": "building: no C compiler", "at": time.time()}))
    failed.chmod(0o600)
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        assert native_aot.load(native._jit_loop) is None  # recorded: no second attempt for RETRY_AFTER
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("POLYHAL_CPU_CACHE_DIR", str(blocked / "cpu"))
    with pytest.warns(RuntimeWarning, match="cannot be made"):
        assert native_aot.load(native._jit_loop) is None


def test_a_failure_is_forgotten_once_packages_change_since_its_build_began(tmp_path):
    # The README's second command upgraded setuptools while a first run's background build ran:
    # that build failed ("unable to load module 'distutils.unixccompiler'"), and the test suite
    # after it ran an hour without the loops. A failure belongs to the packages its build began with.
    cache = native_aot.CodeCache(tmp_path, "polyhal-cpu", "POLYHAL_CPU_CACHE_DIR", native_aot.FALLBACK)
    assert cache.ready()
    name = native_aot.module_name()
    why = "DistutilsModuleError: unable to load module 'distutils.unixccompiler'"
    with pytest.warns(RuntimeWarning, match="reinstall setuptools"):
        native_aot._report_failure(cache, name, why, record=True, environment="packages-before")
    assert native_aot._recent_failure(cache, name) is None  # installed since: build again
    native_aot._report_failure(cache, name, why, record=True, environment=native_aot._environment())  # (warned once)
    assert native_aot._recent_failure(cache, name) == why  # the same packages: wait RETRY_AFTER


def test_a_failed_build_is_recorded_with_its_reason_and_the_jit_serves(tmp_path):
    got = _child("""
        import json, sys
        import numpy as np
        from polyhal_cpu import native
        x = np.arange(-3, 5, dtype=np.float32)
        out = np.empty_like(x)
        native.relu(x, out)
        print(json.dumps({"aot": type(native._loops).__name__, "relu": out.tolist()}))
    """, {"POLYHAL_CPU_CACHE_DIR": str(tmp_path), "CC": "false",  # a C compiler that always fails
          "POLYHAL_CPU_AOT_WAIT": "1"})
    assert got == {"aot": "dict", "relu": [0, 0, 0, 0, 1, 2, 3, 4]}
    (failed,) = tmp_path.glob("*.failed")
    assert "RuntimeError" in failed.read_text() and "compiler" in failed.read_text()
    assert not list(tmp_path.glob("*.so"))


def test_every_loop_is_in_the_compiled_module(aot):
    """A loop left to the JIT brings numba (~120 MB) into every process that runs it: each loop
    of native_loops must be warmed (native._warm) with one signature, up to read-only arrays."""
    from polyhal_cpu import native_loops

    assert set(native_loops.__all__) <= set(dict(aot))


def test_a_first_process_builds_the_module_in_the_background_and_runs_on_library_kernels(tmp_path):
    """Issue 30: a machine's first run does not wait for the build. The process that finds no
    module starts its build in a background process of its own session (niced) and runs
    without the loops -- no numba in it -- with the same results; a second process finds the
    build under way and starts none."""
    code = """
        import json, sys
        import numpy as np
        from polyhal_cpu import native
        x = np.arange(-3, 5, dtype=np.float32).reshape(2, 4)
        from polyhal_cpu.kernels import prepare
        from polyhal.ir.types import TensorType
        t = TensorType((2, 4), np.float32)
        out = np.empty_like(x)
        prepare("softmax", {"axis": -1}, (t,), (t,))(x, out)
        builder = native._pending.builder if native._pending is not None else None
        print(json.dumps({"available": native.available(), "numba": "numba" in sys.modules,
                          "builder": builder.pid if builder is not None else None,
                          "softmax": out.tolist()}))
    """
    env = {"POLYHAL_CPU_CACHE_DIR": str(tmp_path), "POLYHAL_CPU_AOT_WAIT": "0", "CC": "false",
           "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    first = _child(code, env)
    try:
        assert first["available"] is False and first["numba"] is False and first["builder"] is not None
        x = np.arange(-3, 5, dtype=np.float32).reshape(2, 4)
        want = np.exp(x - x.max(1, keepdims=True))
        np.testing.assert_allclose(first["softmax"], want / want.sum(1, keepdims=True), rtol=1e-6)
        cache = native_aot.CodeCache(tmp_path, "polyhal-cpu", "POLYHAL_CPU_CACHE_DIR", native_aot.FALLBACK)
        deadline = time.monotonic() + 60
        while not cache.building(f"{native_aot.module_name()}.lock") and time.monotonic() < deadline:
            time.sleep(0.1)  # the builder takes the lock once its interpreter is up
        assert cache.building(f"{native_aot.module_name()}.lock"), "the background builder holds no lock"
        second = _child(code, env)
        assert second["available"] is False and second["builder"] is None  # waits for the first one's build
    finally:
        try:
            os.killpg(first["builder"], 9)  # the builder's own session (it and the compiler it runs)
        except (ProcessLookupError, TypeError):
            pass


def test_a_process_keeps_its_tier_after_the_build_ends(monkeypatch, tmp_path):
    """Scratch declared on the library tier must not meet a kernel built on the loops' (a conv's
    scratch differs): a process that started without the loops stays so."""
    monkeypatch.setattr(native, "_pending", native_aot.Pending(None, "x"))
    monkeypatch.setattr(native, "_loops", {})
    monkeypatch.setattr(native, "_build", lambda: pytest.fail("asked for the module again"))
    assert not native.available() and not native.available()
