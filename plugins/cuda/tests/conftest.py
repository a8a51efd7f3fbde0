"""Fixtures of the CUDA backend's tests.

Tests that need a GPU take the ``cuda`` fixture (the first CUDA device) and skip, with the
plugin's own reason (``report_unavailable``: no cupy, no driver, no GPU), where there is none.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import polyhal


def _cuda_specs():
    return [s for s in polyhal.devices() if s.backend == "cuda"]


def no_gpu_reason() -> str:
    reasons = polyhal.default_registry().unavailable_reasons().get("cuda", [])
    return "no CUDA device: " + ("; ".join(reasons) or "the cuda plugin registered none")


@pytest.fixture
def cuda():
    """The first CUDA device (skips without one, saying why)."""
    specs = _cuda_specs()
    if not specs:
        pytest.skip(no_gpu_reason())
    return polyhal.get_device(specs[0].name)


@pytest.fixture
def cp(cuda):
    """cupy, with the device current (skips without a GPU)."""
    import cupy

    with cupy.cuda.Device(cuda.ordinal):
        yield cupy


@pytest.fixture
def torch_cuda(cuda):
    """torch with CUDA (skips when torch or its CUDA support is missing)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA support here")
    return torch


class SeededGenerator(np.random.Generator):
    """A numpy Generator that remembers its seed (``seed_value``), for failure messages."""


@pytest.fixture
def rng():
    """Fresh random data for every test; the seed is in ``rng.seed_value``."""
    seed = int.from_bytes(os.urandom(4), "little")
    r = SeededGenerator(np.random.PCG64(seed))
    r.seed_value = seed
    return r
