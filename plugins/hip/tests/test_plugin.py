"""Registration: what the HIP plugin registers, and why it registers nothing -- on
FakeHipRuntime (a stand-in, not ROCm) for the GPU cases; the real no-GPU case is in
test_runtime.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import polyhal
from polyhal import BufferKind, MemoryType
from polyhal.registry import Registry
from polyhal_hip import plugin

from fake_runtime import gpu


def test_plugin_imports_no_bindings():
    """Installing and loading the plugin must work where ROCm is absent: nothing is imported
    or loaded until devices are enumerated."""
    code = ("import sys; import polyhal_hip.plugin, polyhal_hip.device, polyhal_hip.allocator; "
            "print(any(m == 'hip' or m.startswith(('hip.', 'rocm')) for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_every_gpu_becomes_a_device(make_fake):
    make_fake(devices=[gpu(0), gpu(1, arch="gfx1030", warp_size=32, name="Fake Radeon (stand-in)",
                                   memory_pools=False, concurrent_managed_access=False)])
    specs = plugin.register_devices()
    assert [s.name for s in specs] == ["hip:0", "hip:1"] and plugin.report_unavailable() == []
    a, b = specs
    assert a.backend == "hip" and a.rank == plugin.DEFAULT_RANK
    assert {"gpu", "hip", "gfx90a", "wave64", "managed-memory", "async-pool", "fake-runtime"} <= a.capabilities
    assert {"gfx1030", "wave32"} <= b.capabilities and "managed-memory" not in b.capabilities
    assert a.dlpack_devices == {(10, 0), (11, 0)} and b.dlpack_devices == {(10, 1), (11, 1)}
    assert "FAKE runtime (a stand-in, not ROCm)" in a.description
    assert a.workgroup_bytes == 65536 and a.limits["arch"] == "gfx90a:sramecc+:xnack-"
    kinds = [(h.memory_type, h.kind) for h in a.heaps]
    assert kinds[0] == (MemoryType.DEVICE_LOCAL, BufferKind.DEVICE)
    assert [k for _m, k in kinds] == [BufferKind.DEVICE, BufferKind.MANAGED, BufferKind.HOST, BufferKind.HOST]
    assert BufferKind.MANAGED not in [h.kind for h in b.heaps]


@pytest.mark.parametrize("fields, reason", [
    ({"no_device": True}, "no AMD GPU: counting AMD GPUs: hipGetDeviceCount failed: hipErrorNoDevice (100)"),
    ({"devices": []}, "no AMD GPU"),
    ({"bindings": (7, 0)}, "runtime version does not match the bindings"),
    ({"missing": {"hipGetDeviceProperties"}}, "hip:0: hipGetDeviceProperties"),
    ({"missing": {"hipRuntimeGetVersion"}}, "ROCm runtime missing"),
])
def test_no_device_and_the_reason(make_fake, fields, reason):
    make_fake(**fields)
    assert plugin.register_devices() == []
    reasons = plugin.report_unavailable()
    assert any(r.startswith(reason) or reason in r for r in reasons), reasons


def test_polyhal_devices_lists_the_reason(make_fake, monkeypatch):
    make_fake(no_device=True)
    monkeypatch.setenv("POLYHAL_BACKENDS", "hip,cpu")
    reg = Registry()
    assert [s.name for s in reg.device_specs()] == ["cpu:0"]
    assert reg.unavailable_reasons()["hip"][0].startswith("no AMD GPU")


def test_rank_and_pool_environment(make_fake, monkeypatch):
    make_fake()
    monkeypatch.setenv("POLYHAL_HIP_RANK", "7")
    monkeypatch.setenv("POLYHAL_HIP_POOL", "async")
    (spec,) = plugin.register_devices()
    assert spec.rank == 7 and spec.heaps[0].kind is BufferKind.ASYNC and spec.limits["pool"] == "async"
    monkeypatch.setenv("POLYHAL_HIP_POOL", "bogus")
    with pytest.raises(polyhal.ConfigError, match="POLYHAL_HIP_POOL"):
        plugin.register_devices()
    monkeypatch.setenv("POLYHAL_HIP_POOL", "device")
    monkeypatch.setenv("POLYHAL_HIP_RANK", "high")
    with pytest.raises(polyhal.ConfigError, match="POLYHAL_HIP_RANK"):
        plugin.register_devices()


def test_bad_environment_is_a_registration_failure_not_a_crash(make_fake, monkeypatch):
    make_fake()
    monkeypatch.setenv("POLYHAL_BACKENDS", "hip,cpu")
    monkeypatch.setenv("POLYHAL_HIP_POOL", "bogus")
    reg = Registry()
    assert [s.name for s in reg.device_specs()] == ["cpu:0"]
    assert any(f.plugin == "hip" and "POLYHAL_HIP_POOL" in f.reason for f in reg.failures)


def test_selftest_report_on_the_stand_in(fake_registry, fake):
    """The selftest's report says plainly that the stand-in is no hardware."""
    from polyhal_hip import selftest

    report = selftest.run(quick=True)
    assert report["ran_on_hardware"] is False
    assert report["runtime"]["fake"] is True and "stand-in" in report["runtime"]["description"]
    (dev,) = report["devices"]
    names = [c["name"] for c in dev["checks"]]
    assert any(n.startswith("heap DEVICE_LOCAL") for n in names) and "DLPack: ROCm stream rules, numpy consumer" in names
    failed = [c for c in dev["checks"] if c["status"] == "fail"]
    assert not failed, json.dumps(failed, indent=1)
    json.dumps(report)  # serialisable


def test_selftest_command_without_gpu(real_runtime):
    """Here (no AMD GPU) the command reports why and exits 2: nothing ran on hardware."""
    import os

    env = dict(os.environ, POLYHAL_BACKENDS="hip,cpu")
    proc = subprocess.run([sys.executable, "-m", "polyhal_hip.selftest", "--quick"], capture_output=True, text=True,
                          timeout=120, env=env)
    report = json.loads(proc.stdout)
    if report["devices"]:
        pytest.skip("this machine has an AMD GPU")
    assert proc.returncode == 2 and report["ran_on_hardware"] is False
    assert any("no AMD GPU" in r for r in report["unavailable"]) and "no AMD GPU was used" in proc.stderr
