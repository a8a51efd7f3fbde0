"""The storage-only element types on CUDA: the conversions' C (shared with OpenCL, where the
conformance suite checks it bit for bit) compiled as CUDA C++ by nvcc for every cast the backend
generates, which needs no GPU; on a GPU the core's conformance suite
(``test_storage_type_casts``) and tests/test_onnx_lowprec.py run them on cuda:0."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from polyhal.ir.types import STORAGE_DTYPES
from polyhal_cuda.kernels import storage_cast_code
from polyhal_gpu import storage

#: Element type -> the C type cupy's ElementwiseKernel gives ``X``/``Y`` (``__half`` stands in
#: for cupy's float16 class: both convert to and from float explicitly).
_C = {"float32": "float", "float64": "double", "float16": "__half", "int8": "signed char", "int32": "int",
      "int64": "long long", "uint8": "unsigned char", "uint64": "unsigned long long", "bool": "bool"}


def _c_type(dt: np.dtype) -> str:
    return _C.get(dt.name) or ("unsigned short" if dt.itemsize == 2 else "unsigned char")


def test_every_storage_cast_compiles_as_cuda(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed (the CUDA toolkit compiles the shared conversions here)")
    others = [np.dtype(n) for n in _C] + sorted(STORAGE_DTYPES, key=str)
    pairs = [(a, b) for s in sorted(STORAGE_DTYPES, key=str) for o in others for a, b in ((s, o), (o, s)) if a != b]
    kernels = "".join(
        f'extern "C" __global__ void k{i}(const {_c_type(a)}* xs, {_c_type(b)}* ys) {{\n'
        f"  typedef {_c_type(a)} X; typedef {_c_type(b)} Y; X x = xs[threadIdx.x]; Y y;\n"
        f"  {storage_cast_code(a, b)};\n  ys[threadIdx.x] = y;\n}}\n"
        for i, (a, b) in enumerate(pairs))
    src = tmp_path / "storage_casts.cu"
    src.write_text("#include <cuda_fp16.h>\n" + storage.source() + kernels)
    done = subprocess.run([nvcc, "-std=c++17", "-arch=sm_80", "-c", str(src), "-o", str(tmp_path / "k.o")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
