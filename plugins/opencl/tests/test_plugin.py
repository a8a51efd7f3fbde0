"""Discovery: device specs from platform queries only, ranks, limits, and no platform -> a reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import polyhal
from polyhal.hal.flags import MemoryType
from polyhal_opencl import plugin


def test_spec_describes_the_device(cl_spec):
    assert cl_spec.name.startswith("opencl:") and cl_spec.backend == "opencl" and cl_spec.plugin == "opencl"
    limits = cl_spec.limits
    for key in ("ordinal", "platform", "device", "max_work_group_size", "local_mem_size", "global_mem_size",
                "max_mem_alloc_size", "opencl_c_version"):
        assert key in limits, key
    assert cl_spec.workgroup_bytes == limits["local_mem_size"] > 0
    kind = limits["type"]
    assert kind in cl_spec.capabilities
    assert cl_spec.rank == plugin.RANK_BY_TYPE.get(kind, plugin.DEFAULT_RANK)
    assert cl_spec.heaps[0].memory_type == MemoryType.DEVICE_LOCAL
    assert all(h.max_allocation_size == limits["max_mem_alloc_size"] for h in cl_spec.heaps)
    assert cl_spec.dlpack_devices == {(4, limits["ordinal"])}


def test_enumeration_creates_no_context(monkeypatch):
    import pyopencl as cl

    def forbidden(*args, **kwargs):
        raise AssertionError("enumeration must not create an OpenCL context")

    monkeypatch.setattr(cl, "Context", forbidden)
    monkeypatch.setattr(cl, "CommandQueue", forbidden)
    found = plugin.enumerate_devices()
    assert found.specs or found.reasons


def test_rank_override(monkeypatch, cl_spec):
    monkeypatch.setenv("POLYHAL_OPENCL_RANK", "-3")
    assert {s.rank for s in plugin.enumerate_devices().specs} == {-3}
    monkeypatch.setenv("POLYHAL_OPENCL_RANK", f"7,{cl_spec.name}=250")
    ranks = {s.name: s.rank for s in plugin.enumerate_devices().specs}
    assert ranks[cl_spec.name] == 250 and all(r == 7 for n, r in ranks.items() if n != cl_spec.name)
    monkeypatch.setenv("POLYHAL_OPENCL_RANK", "high")
    with pytest.raises(polyhal.ConfigError, match="POLYHAL_OPENCL_RANK"):
        plugin.enumerate_devices()


def test_no_platform_means_no_device_and_a_reason(tmp_path):
    # The ICD loader reads vendor files from OCL_ICD_VENDORS: an empty directory is a machine
    # with no OpenCL driver. The CLI must list the other backends and say why OpenCL is missing.
    env = {**os.environ, "OCL_ICD_VENDORS": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "polyhal.cli", "devices", "--json"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert not [d for d in data["devices"] if d["backend"] == "opencl"]
    assert not [f for f in data["failed_plugins"] if f["plugin"] == "opencl"]
    (reason,) = data["unavailable"]["opencl"]
    assert "no OpenCL platform found" in reason and "pocl-opencl-icd" in reason


def test_cli_lists_the_device(cl_spec, capsys):
    from polyhal.cli import main

    assert main(["devices"]) == 0
    assert cl_spec.name in capsys.readouterr().out
