"""Kernels split across threads (polyhal_cpu.parallel) give the unsplit results."""

from __future__ import annotations

import numpy as np
import pytest

from polyhal.ir.types import TensorType
from polyhal.ops import OPS
from polyhal_cpu import parallel, threads
from polyhal_cpu.kernels import prepare

def _reset_budget(monkeypatch):
    """The budget is made once per process: make it again from the patched environment, and
    again after the test from the real one."""
    threads.reset()
    monkeypatch.setattr(threads, "_budget", None)


CASES = [
    ("softmax", [(1, 4, 33, 16)], {"axis": -1}),
    ("softmax", [(6, 5, 7)], {"axis": 0}),  # the first axis is the softmax's: runs whole
    ("softmax", [(1, 1, 9, 8)], {"axis": 2}),
    ("layer_norm", [(1, 37, 16), (16,), (16,)], {"axis": -1}),
    ("layer_norm", [(5, 6, 7), (6, 7), (6, 7)], {"axis": 1}),
    ("gelu", [(3, 41)], {"approximate": "tanh"}),
    ("gelu", [(1, 129)], {}),
    ("sigmoid", [(7, 3, 5)], {}),
    ("erf", [(2, 50)], {}),
]


@pytest.mark.parametrize("n_threads", ["2", "3", "1"])
@pytest.mark.parametrize("name, shapes, attrs", CASES, ids=[c[0] for c in CASES])
def test_split_kernels_match_reference(monkeypatch, n_threads, name, shapes, attrs):
    monkeypatch.setattr(parallel, "MIN_ELEMENTS", 1)
    monkeypatch.setenv("POLYHAL_CPU_THREADS", n_threads)
    _reset_budget(monkeypatch)
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float16, np.float64):
        xs = [rng.uniform(0.5, 2, s).astype(dtype) for s in shapes]
        in_types = tuple(TensorType(x.shape, x.dtype) for x in xs)
        out_types = OPS[name].infer(in_types, attrs)
        outs = [np.full(t.shape, np.nan, t.dtype) for t in out_types]
        prepare(name, attrs, in_types, out_types)(*xs, *outs)
        for got, want in zip(outs, OPS[name].reference(*xs, **attrs)):
            tol = 2e-3 if dtype == np.float16 else 1e-5
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
