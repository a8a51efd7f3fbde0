"""Program builds: failures carry the build log; memory and disk caches hit."""

from __future__ import annotations

import pytest

import polyhal
from polyhal.ir.types import TensorType
from polyhal_opencl import kernels
from polyhal_opencl.errors import CLBuildError
from polyhal_opencl.program import ProgramCache

SOURCE = "__kernel void twice(__global float* x) { x[get_global_id(0)] *= 2.0f; }\n"


def test_build_failure_carries_the_log(dev):
    cache = ProgramCache(dev.context, dev.cl_device, None)
    bad = "__kernel void broken(__global float* x) { x[0] = undeclared_name; }\n"
    with pytest.raises(CLBuildError) as info:
        cache.get(bad, dev.traits.build_options())
    err = info.value
    assert isinstance(err, polyhal.KernelNotFoundError)
    assert "undeclared_name" in err.log and "undeclared_name" in str(err)
    assert err.source == bad and err.options == dev.traits.build_options()


def test_second_prepare_hits_the_memory_cache(dev):
    t = TensorType((5, 7), "float32")
    kernels.prepare(dev, "add", {}, (t, t), (t,))
    before = (dev.programs.statistics.builds, dev.programs.statistics.memory_hits)
    kernels.prepare(dev, "add", {}, (t, t), (t,))
    assert dev.programs.statistics.builds == before[0]
    assert dev.programs.statistics.memory_hits == before[1] + 1


def test_disk_cache_round_trip(dev, tmp_path):
    first = ProgramCache(dev.context, dev.cl_device, tmp_path)
    first.get(SOURCE)
    assert (first.statistics.builds, first.statistics.disk_writes) == (1, 1)
    (path,) = tmp_path.glob("*.bin")
    assert path.stem == first.key(SOURCE, "")
    second = ProgramCache(dev.context, dev.cl_device, tmp_path)  # a new process, in effect
    program = second.get(SOURCE)
    assert (second.statistics.builds, second.statistics.disk_hits) == (0, 1)
    assert "twice" in program.kernel_names
    assert second.key(SOURCE, "-cl-std=CL1.2") != second.key(SOURCE, "")  # options are part of the key


def test_corrupt_binary_is_rebuilt(dev, tmp_path):
    ProgramCache(dev.context, dev.cl_device, tmp_path).get(SOURCE)
    (path,) = tmp_path.glob("*.bin")
    path.write_bytes(b"not a program binary")
    cache = ProgramCache(dev.context, dev.cl_device, tmp_path)
    assert "twice" in cache.get(SOURCE).kernel_names
    assert cache.statistics.disk_errors == 1 and cache.statistics.builds == 1


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    from polyhal_opencl.program import default_cache_dir

    monkeypatch.setenv("POLYHAL_OPENCL_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.setenv("POLYHAL_OPENCL_CACHE_DIR", "")
    assert default_cache_dir() is None
    monkeypatch.delenv("POLYHAL_OPENCL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "polyhal" / "opencl"


def test_disk_cache_is_private_and_refuses_a_folder_others_may_write(dev, tmp_path):
    """Binaries are written 0600 in a 0700 folder; a folder others may write is not read (a
    planted PoCL binary is host code) -- the program is built from source (issue 27)."""
    from polyhal.codecache import CacheWarning

    folder = tmp_path / "a" / "opencl"
    ProgramCache(dev.context, dev.cl_device, folder).get(SOURCE)
    (path,) = folder.glob("*.bin")
    assert oct(path.stat().st_mode & 0o777) == "0o600" and oct(folder.stat().st_mode & 0o777) == "0o700"
    folder.chmod(0o777)
    cache = ProgramCache(dev.context, dev.cl_device, folder)
    with pytest.warns(CacheWarning, match="world-writable"):
        cache.get(SOURCE)
    assert (cache.statistics.builds, cache.statistics.disk_hits) == (1, 0)
