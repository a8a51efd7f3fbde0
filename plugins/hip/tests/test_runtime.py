"""The runtime facade and the error mapping, against the real ROCm runtime where it is installed
(Debian's ROCm 5.2 with hip-python 6.2 in CI: real calls, no GPU), plus pure checks of
:func:`polyhal_hip.errors.check`."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import subprocess
import sys
import textwrap

import pytest

import polyhal
from polyhal_hip import errors, runtime
from polyhal_hip.errors import (
    HipError, HipNoDevice, HipOutOfMemory, HipRuntimeMissing, HipSymbolNotFound, HipVersionMismatch, check,
)

# -- the check helper (pure) -----------------------------------------------------------------------


def test_success_is_silent():
    check(0, "hipMalloc")


@pytest.mark.parametrize("status, cls, name", [
    (2, HipOutOfMemory, "hipErrorOutOfMemory"),
    (100, HipNoDevice, "hipErrorNoDevice"),
    (101, HipNoDevice, "hipErrorInvalidDevice"),
    (1, HipError, "hipErrorInvalidValue"),
    (700, HipError, "hipErrorIllegalAddress"),
    (4242, HipError, "hipError4242"),
])
def test_statuses_become_readable_errors(status, cls, name):
    with pytest.raises(cls) as info:
        check(status, "hipMalloc", "allocating 64 bytes on hip:0")
    exc = info.value
    assert exc.status == status and exc.call == "hipMalloc" and exc.status_name == name
    text = str(exc)
    assert text.startswith("allocating 64 bytes on hip:0: hipMalloc failed: ") and f"{name} ({status})" in text
    assert isinstance(exc, polyhal.PolyhalError)


def test_out_of_memory_is_a_memory_error_and_no_device_says_what_to_check():
    with pytest.raises(MemoryError, match="Buffer.release"):
        check(2, "hipMalloc")
    with pytest.raises(HipNoDevice, match="HIP_VISIBLE_DEVICES"):
        check(100, "hipGetDeviceCount")


def test_flag_masks_hip_python_negative_constants():
    assert runtime.flag(-2147483648) == 0x80000000 == runtime.HOST_MALLOC_NON_COHERENT
    assert runtime.flag(0x40000000) == 0x40000000


def test_version_tuple():
    assert runtime.version_tuple(50221153) == (5, 2, 21153)
    assert runtime.version_tuple(60241133) == (6, 2, 41133)


# -- real calls into ROCm (no GPU here) --------------------------------------------------------------


def test_real_runtime_answers(real_runtime):
    major, minor, _patch = runtime.version_tuple(real_runtime.runtime_version())
    assert major >= 5
    assert real_runtime.driver_version() > 0
    assert real_runtime.which in ("hip-python", "rocm.bindings")


def test_real_no_device_count(real_runtime):
    try:
        count = real_runtime.device_count()
    except HipNoDevice as exc:
        assert exc.status == errors.NO_DEVICE and exc.call == "hipGetDeviceCount"
        assert "counting AMD GPUs: hipGetDeviceCount failed: hipErrorNoDevice (100)" in str(exc)
    else:
        pytest.skip(f"this machine has {count} AMD GPU(s)")


@pytest.mark.parametrize("call", ["malloc", "host_malloc", "malloc_managed", "stream_create"])
def test_real_allocation_without_device_is_invalid_device(real_runtime, call):
    if _gpus(real_runtime):
        pytest.skip("this machine has an AMD GPU")
    args = {"malloc": (16,), "host_malloc": (16, runtime.HOST_MALLOC_NON_COHERENT | runtime.HOST_MALLOC_MAPPED),
            "malloc_managed": (16,), "stream_create": ()}[call]
    with pytest.raises(HipNoDevice) as info:
        getattr(real_runtime, call)(*args)
    assert info.value.status == errors.INVALID_DEVICE
    assert "hipErrorInvalidDevice (101)" in str(info.value)


def _gpus(rt) -> int:
    try:
        return rt.device_count()
    except HipError:
        return 0


def _library_has(symbol: str) -> bool:
    lib = ctypes.CDLL(ctypes.util.find_library("amdhip64") or "libamdhip64.so")
    return hasattr(lib, symbol)


def test_real_symbol_not_found_names_the_symbol(real_runtime):
    """hip-python 6.x calls hipGetDevicePropertiesR0600, which a ROCm 5 runtime does not have."""
    if _library_has("hipGetDevicePropertiesR0600"):
        pytest.skip("this runtime has hipGetDevicePropertiesR0600 (ROCm 6+): nothing is missing")
    if real_runtime.bindings_version()[0] < 6:
        pytest.skip("bindings older than ROCm 6 call hipGetDeviceProperties")
    with pytest.raises(HipSymbolNotFound) as info:
        real_runtime.device_properties(0)
    assert info.value.symbol == "hipGetDevicePropertiesR0600"
    assert "older than the bindings" in str(info.value)
    assert isinstance(info.value, polyhal.PluginError)


def test_real_version_match(real_runtime):
    have = runtime.version_tuple(real_runtime.runtime_version())[0]
    want = real_runtime.bindings_version()[0]
    if have == want:
        real_runtime.match()
        return
    with pytest.raises(HipVersionMismatch) as info:
        real_runtime.match()
    assert f"made for ROCm {want}." in str(info.value) and f"library is version {have}." in str(info.value)


def test_real_hiprtc_loads_even_where_it_is_bundled(real_compiler):
    """ROCm 5.x has no libhiprtc.so: the facade points the bindings at libamdhip64."""
    major, _minor = real_compiler.compiler_version()
    assert major > 0


def test_real_registration_without_gpu_says_why(real_runtime, use_runtime, monkeypatch):
    if _gpus(real_runtime):
        pytest.skip("this machine has an AMD GPU")
    use_runtime(real_runtime)
    from polyhal_hip import plugin

    assert plugin.register_devices() == []
    reasons = plugin.report_unavailable()
    assert any(r.startswith("no AMD GPU:") and "hipErrorNoDevice" in r for r in reasons), reasons


def _run(code: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env=env)


def test_polyhal_devices_says_why_no_hip_device(real_runtime):
    if _gpus(real_runtime):
        pytest.skip("this machine has an AMD GPU")
    import os

    env = dict(os.environ, POLYHAL_BACKENDS="hip,cpu")
    proc = subprocess.run(["polyhal", "devices"], capture_output=True, text=True, timeout=120, env=env)
    assert "plugin 'hip': no AMD GPU" in proc.stdout, proc.stdout + proc.stderr


def test_runtime_library_missing_is_reported(real_runtime):
    """A runtime library that cannot be loaded: no device, and the reason says to install ROCm."""
    if real_runtime.which != "hip-python":
        pytest.skip("the library is redirected through hip-python's loader only")
    proc = _run("""
        import json, importlib
        chip = importlib.import_module("hip.chip")
        chip.DLL = b"libamdhip64-not-installed.so"
        from polyhal_hip import plugin
        print(json.dumps({"devices": len(plugin.register_devices()), "reasons": plugin.report_unavailable()}))
    """)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 0
    assert out["reasons"][0].startswith("ROCm runtime missing:") and "libamdhip64-not-installed.so" in out["reasons"][0]
    assert "apt-get install libamdhip64-dev" in out["reasons"][0]


def test_bindings_missing_is_reported():
    """No hip-python (nor rocm.bindings): the plugin still loads, registers nothing, says why."""
    proc = _run("""
        import json, sys
        sys.modules["hip"] = None            # as if hip-python were not installed
        sys.modules["rocm"] = None
        sys.modules["rocm.bindings"] = None
        from polyhal_hip import plugin
        print(json.dumps({"devices": len(plugin.register_devices()), "reasons": plugin.report_unavailable()}))
    """)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 0
    assert "no Python bindings for HIP are installed" in out["reasons"][0]
    assert "hip-python" in out["reasons"][0]


def test_facade_maps_dlsym_and_dlopen_failures():
    """The loader errors of hip-python (RuntimeError: failed to dlsym/dlopen) become typed errors."""
    rt = runtime.HipPythonRuntime.__new__(runtime.HipPythonRuntime)
    rt.which = "hip-python"
    rt.runtime_version = lambda: 50221153  # type: ignore[method-assign]
    rt.bindings_version = lambda: (6, 2)  # type: ignore[method-assign]
    exc = rt._loader_error(RuntimeError("failed to dlsym 'hipFooR0600': b'undefined symbol: hipFooR0600'"), "hipFoo")
    assert isinstance(exc, HipSymbolNotFound) and exc.symbol == "hipFooR0600" and "version 5.2" in str(exc)
    exc = rt._loader_error(RuntimeError("failed to dlopen 'b'libamdhip64.so'': no such file"), "hipMalloc")
    assert isinstance(exc, HipRuntimeMissing) and "libamdhip64-dev" in str(exc)


def test_every_facade_call_reaches_the_runtime(real_runtime):
    """Each facade method marshals its arguments through the bindings into libamdhip64, which
    answers (here: no device) -- no TypeError, no crash. In a child process: a runtime given
    null handles must not take the test process down if it misbehaves."""
    if _gpus(real_runtime):
        pytest.skip("this machine has an AMD GPU (the selftest exercises these for real)")
    proc = _run("""
        import ctypes, json
        import numpy as np
        from polyhal_hip import runtime as hip
        from polyhal_hip.errors import HipError
        rt = hip.HipPythonRuntime()
        host = np.zeros(64, np.uint8)
        calls = {
            "malloc": (64,), "free": (0,), "malloc_async": (64, None), "malloc_from_pool_async": (64, None, None),
            "free_async": (0, None), "default_mem_pool": (0,), "mem_pool_trim_to": (None, 0),
            "host_malloc": (64, hip.HOST_MALLOC_MAPPED | hip.HOST_MALLOC_NON_COHERENT), "host_free": (0,),
            "host_get_device_pointer": (host.ctypes.data,), "host_register": (host.ctypes.data, 64, hip.HOST_REGISTER_MAPPED),
            "host_unregister": (host.ctypes.data,), "malloc_managed": (64,), "mem_prefetch_async": (0, 64, 0, None),
            "memcpy_async": (host.ctypes.data, host.ctypes.data, 64, hip.MEMCPY_DEFAULT, None),
            "memset_async": (host.ctypes.data, 0, 64, None), "stream_create": (), "stream_synchronize": (None,),
            "stream_wait_event": (0, None), "event_create": (), "event_record": (None, None),
            "event_synchronize": (None,), "module_load_data": (b"\\x7fELF",), "module_get_function": (None, "k"),
            "launch": (None, (1,), (64,), 0, None, bytes(16)), "mem_get_info": (), "set_device": (0,),
            "get_device": (), "pointer_kind": (host.ctypes.data,),
        }
        out = {}
        for name, args in calls.items():
            try:
                value = getattr(rt, name)(*args)
                out[name] = ["returned", repr(value)]
            except HipError as exc:
                out[name] = ["HipError", exc.status_name or type(exc).__name__]
            except Exception as exc:
                out[name] = ["other", f"{type(exc).__name__}: {exc}"]
        print(json.dumps(out))
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    wrong = {k: v for k, v in out.items() if v[0] == "other"}
    assert not wrong, wrong
    assert out["malloc"] == ["HipError", "hipErrorInvalidDevice"]
    assert out["launch"][0] == "HipError" and out["pointer_kind"][0] == "returned"
