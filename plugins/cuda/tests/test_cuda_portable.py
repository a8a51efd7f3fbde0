"""The portable C kernels on CUDA (:mod:`polyhal_cuda.portable`); their results over every mode
are checked on every OpenCL and CUDA device by tests/test_portable_kernels.py."""

from __future__ import annotations

import numpy as np

from polyhal.ir.types import TensorType
from polyhal.ops import OPS
from polyhal_cuda.kernels import HOST_FALLBACK
from polyhal_gpu import portable


def test_portable_ops_leave_the_host_fallback():
    assert portable.OPS and not portable.OPS & HOST_FALLBACK


def test_strided_operands_and_unserved_instances(cuda, cp, rng):
    # a transposed (strided) input and output: made dense around the kernel
    x = rng.standard_normal((4, 3, 3))
    t = TensorType((4, 3, 3), np.float64)
    fn = cuda.prepare("det", {}, (t,), (TensorType((4,), np.float64),))
    assert "portable" in fn.inner.kernel_name
    view = cp.asarray(x.transpose(0, 2, 1).copy()).transpose(0, 2, 1)
    assert not view.flags.c_contiguous
    out = cp.zeros(8)[::2]
    fn(view, out)
    np.testing.assert_allclose(cp.asnumpy(out), OPS["det"].reference(x)[0], rtol=1e-10)
    # float16 has no portable kernel: the host fallback serves it
    h = TensorType((2, 3, 3), np.float16)
    assert "host-fallback" in cuda.prepare("det", {}, (h,), (TensorType((2,), np.float16),)).inner.kernel_name
