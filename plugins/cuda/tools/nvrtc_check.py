"""Compile this package's CUDA C with NVRTC, as cupy will on the GPU, on a machine without one.

Usage: ``python plugins/cuda/tools/nvrtc_check.py [path/to/libnvrtc.so]`` — needs only the NVRTC
library (e.g. ``pip install --target /tmp/nvrtc nvidia-cuda-nvrtc``), no GPU and no cupy. Every
template instantiation the host code asks for is compiled for sm_90 (``-arch=compute_90``), so a
syntax or NVRTC-compatibility error costs no GPU time.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[2] / "gpu" / "polyhal_gpu" / "cu"
KEYS = ["unsigned char", "unsigned short", "unsigned int", "unsigned long long"]


def expressions() -> dict[str, list[str]]:
    sort = []
    for k in KEYS:
        for kind in (0, 1, 2):
            sort += [f"sort_rows<{k}, {kind}>", f"radix_make_keys<{k}, {kind}>", f"radix_emit<{k}, {kind}>"]
            from polyhal_gpu.sorting import ONESWEEP_SHAPES
            from polyhal_cuda.sorting import _SCATTERS, _SWEEPS, _UPSWEEPS, _onesweep_name, _scatter_name, _upsweep_name

            sort += [f"radix_histogram<{k}, {kind}>"]
            for r, p in _SWEEPS:  # every shape the plans use, with either ranking (m)
                threads, items, _ = ONESWEEP_SHAPES[1 << KEYS.index(k), p]  # (key width in bytes, payload)
                sort += [_onesweep_name(k, kind, r, p, (threads, items, m)) for m in (0, 1)]

            sort += [_upsweep_name(k, kind, r, f, a) for r, f in _UPSWEEPS for a in (False, True)]
            sort += [_scatter_name(k, kind, r, p, f, la) for r, p, f, la in _SCATTERS]
        sort += [f"radix_emit_flat<{k}>"]
    sort += ["radix_scan", "radix_take_prefix", "radix_prefix"]
    return {"sort.cu": sort, "nms.cu": ["nms_boxes", "nms_mask", "nms_reduce", "nms_write"],
            "rowwise.cu": [f"{k}<{t}>" for k in ("softmax_rows", "layer_norm_rows") for t in ("float", "double")]}


def main(lib: str) -> int:
    nvrtc = ctypes.CDLL(lib)
    common = (HERE / "common.cuh").read_text()
    failures = 0
    for name, exprs in expressions().items():
        src = (common + "\n" + (HERE / name).read_text()).encode()
        prog = ctypes.c_void_p()
        assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, name.encode(), 0, None, None) == 0
        for e in exprs:
            assert nvrtc.nvrtcAddNameExpression(prog, e.encode()) == 0
        opts = [b"-arch=compute_90", b"-std=c++17"]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        status = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace").strip()
        print(f"{name}: {'ok' if status == 0 else 'FAILED'} ({len(exprs)} kernels)")
        if text:
            print(text[:4000])
        failures += status != 0
    return failures


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "libnvrtc.so"))
