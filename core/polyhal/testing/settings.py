"""The settings of polyhal's test suites and benchmarks from the environment (import-light: the
pytest plugin and the benchmarks read them)."""

from __future__ import annotations

from dataclasses import dataclass

from polyhal.config import Flag, Integer, Settings, Text, setting

__all__ = ["BenchSettings", "TestSettings"]


@dataclass(frozen=True)
class TestSettings(Settings, component="tests"):
    """How the test suites draw their random samples."""

    __test__ = False  # not a test class (pytest collects Test* names)

    seed: int | None = setting(
        "POLYHAL_SEED", Integer(), None,
        "base seed of the random samples of a test session (pytest shows it; set it to reproduce a run)",
        shown="drawn per session")
    fuzz: int | None = setting(
        "POLYHAL_FUZZ", Integer(low=0), None,
        "mutated inputs each fuzz test runs (tests/test_fuzz_*.py)", shown="per test (40 ONNX models, 24 on disk, 300 DLPack capsules)")


@dataclass(frozen=True)
class BenchSettings(Settings, component="benchmarks"):
    """What the benchmarks record about the machine and which optional parts they run."""

    gpu: str = setting("POLYHAL_BENCH_GPU", Text(), "",
                       "the GPU named in a benchmark's machine line (bench/harness.py)")
    opencl_sweep: bool = setting("POLYHAL_BENCH_OPENCL_SWEEP", Flag(), False,
                                 "bench/opencl_ops.py also sweeps the OpenCL matmul block shapes (GPUs only)")
