"""Fixtures the CPU backend's tests share."""

from __future__ import annotations

import numpy as np
import pytest

from polyhal.ops import OPS


@pytest.fixture
def check_on_poisoned_scratch():
    """``check(kernel, scratch, requests, op, attrs, ins, fresh, out_type, atol=..., msg=...)``:
    runs a prepared kernel twice, each time on scratch filled with NaN bytes and a new input 0
    (``fresh()``), into a NaN-filled output, and compares it with the op's reference: a kernel
    must fill what it reads of its scratch (a slab's padding too) on every call. Returns the
    last output."""
    def check(kernel, scratch, requests, op, attrs, ins, fresh, out_type, atol=1e-4, msg=""):
        for _ in range(2):
            for request in requests:
                scratch.buffer(request.name).view(np.uint8)[:] = 0xFF  # nan
            ins[0] = fresh()
            out = np.full(out_type.shape, np.nan, np.float32)
            kernel(*ins, out)
            (want,) = OPS[op].reference(*ins, **attrs)
            np.testing.assert_allclose(out, want, rtol=1e-4, atol=atol, err_msg=msg)
        return out
    return check


@pytest.fixture(autouse=True)
def own_kernels(request, monkeypatch):
    """The CPU's own kernels for every test of this folder but the oneDNN binding's and its int8
    kernels': they check
    those kernels' paths, which oneDNN's primitives would otherwise serve (the conformance suite
    checks the oneDNN path on cpu:0)."""
    if request.module.__name__.rsplit(".", 1)[-1] not in ("test_cpu_onednn", "test_cpu_onednn_int8"):
        monkeypatch.setenv("POLYHAL_CPU_ONEDNN", "0")
