"""ResNet-style conv3x3 + bias + relu (N=8, C=K=64, 56x56, fp32) on cuda:0: the cuDNN fused_conv
against the im2col path (POLYHAL_CUDA_CUDNN=0) and torch (TF32 off, NCHW and channels-last),
with the max error of each against float64. Usage: python plugins/cuda/tools/cudnn_bench.py"""

from __future__ import annotations

import os

import numpy as np


def _time(fn, sync, n=200):
    import cupy as cp

    for _ in range(10):
        fn()
    sync()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(n):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def main() -> None:
    import cupy as cp

    import polyhal
    from polyhal.ir.types import TensorType
    from polyhal.ops import OPS
    from polyhal_cuda import cudnn

    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 64, 56, 56), dtype=np.float32)
    w = (rng.standard_normal((64, 64, 3, 3)) * 0.05).astype(np.float32)
    b = rng.standard_normal(64, dtype=np.float32)
    attrs = {"strides": [1, 1], "pads": [1, 1, 1, 1], "dilations": [1, 1], "group": 1, "activation": "relu",
             "alpha": 0.0, "beta": 0.0}
    want = OPS["fused_conv"].reference(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), **attrs)[0]
    scale = np.max(np.abs(want))
    dev = polyhal.get_device("cuda:0")
    types = tuple(TensorType(a.shape, a.dtype) for a in (x, w, b))
    outs = OPS["fused_conv"].infer(types, attrs)
    rows = []
    for label, env in (("polyhal cuDNN fused_conv", "1"), ("polyhal im2col + epilogue", "0")):
        os.environ["POLYHAL_CUDA_CUDNN"] = env
        fn = dev.prepare("fused_conv", attrs, types, outs)
        with dev.activate():
            dx, dw, db = cp.asarray(x), cp.asarray(w), cp.asarray(b)
            out = cp.empty(outs[0].shape, np.float32)
            ms = _time(lambda: fn(dx, dw, db, out), dev.synchronize)
            err = float(np.max(np.abs(cp.asnumpy(out) - want)) / scale)
        rows.append((label, ms, err, getattr(getattr(fn, "inner", fn), "kernel_name", "")))
    os.environ["POLYHAL_CUDA_CUDNN"] = "1"
    try:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        tx, tw, tb = (torch.from_numpy(a).cuda() for a in (x, w, b))
        for label, fmt in (("torch conv2d+relu NCHW (TF32 off)", torch.contiguous_format),
                           ("torch conv2d+relu channels_last (TF32 off)", torch.channels_last)):
            xx, ww = tx.to(memory_format=fmt), tw.to(memory_format=fmt)
            with torch.no_grad():
                f = lambda: torch.relu_(torch.nn.functional.conv2d(xx, ww, tb, padding=1))  # noqa: E731
                ms = _time(f, torch.cuda.synchronize)
                err = float(np.max(np.abs(f().cpu().numpy() - want)) / scale)
            rows.append((label, ms, err, ""))
    except Exception as exc:  # noqa: BLE001 - torch is only the anchor
        print("torch:", exc)
    print(f"device: {dev.spec.description}; {cudnn.status()[0]}")
    print(f"{'conv3x3+bias+relu N=8 C=K=64 56x56 fp32':48s} {'ms':>8s} {'max rel err vs fp64':>20s}")
    for label, ms, err, name in rows:
        print(f"{label:48s} {ms:8.4f} {err:20.2e}  {name}")


def torch_models(names=("resnet50", "mobilenet_v3_large"), batch=1) -> None:
    """torch eager (TF32 off, NCHW) for the torchvision architectures of bench/models: the anchor."""
    import torch
    import torchvision

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for name in names:
        model = getattr(torchvision.models, name)().eval().cuda()
        x = torch.randn(batch, 3, 224, 224, device="cuda")
        with torch.no_grad():
            ms = _time(lambda: model(x), torch.cuda.synchronize, n=50)
        print(f"torch eager {name} b{batch} fp32 (TF32 off): {ms:.3f} ms")


if __name__ == "__main__":
    import sys

    torch_models() if "--torch-models" in sys.argv else main()
