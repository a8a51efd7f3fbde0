"""Non-maximum suppression on a GPU: polyhal_cuda.nms against torchvision.ops.nms.

Targets: 100k boxes at least 10x faster than torchvision; 10k boxes in at most 1 ms; identical
kept indices. Boxes: corners uniform in a 1000 x 1000 image, sides 1..101; scores a random
permutation of k / n (distinct, so that the visiting order, and so the result, is defined for
both). IoU threshold 0.5.
"""

from __future__ import annotations

import numpy as np

from bench.cuda_common import cuda_device, gpu_time
from bench.harness import Row


def run(args) -> list[Row]:
    dev = cuda_device(args)  # first: no GPU is DeviceAbsent, before the GPU libraries are imported
    import cupy as cp
    import torch
    import torchvision

    from polyhal_cuda import nms

    rows: list[Row] = []
    gen = torch.Generator(device=f"cuda:{dev.ordinal}").manual_seed(0)
    for n in (1000, 10_000, 100_000):
        xy = torch.rand(n, 2, device=f"cuda:{dev.ordinal}", generator=gen) * 1000
        wh = torch.rand(n, 2, device=f"cuda:{dev.ordinal}", generator=gen) * 100 + 1
        boxes = torch.cat([xy, xy + wh], 1).contiguous()
        scores = (torch.randperm(n, device=f"cuda:{dev.ordinal}", generator=gen).float() / n).contiguous()
        want = torchvision.ops.nms(boxes, scores, 0.5).cpu().numpy()
        cb, cs = cp.from_dlpack(boxes), cp.from_dlpack(scores)
        got = cp.asnumpy(nms(cb, cs, 0.5, device=dev.name))
        same = bool(np.array_equal(got, want))
        reps = 3 if (args.quick or n == 100_000) else 10
        t_ours = gpu_time(lambda: nms(cb, cs, 0.5, device=dev.name), number=3 if n == 100_000 else 10, repeat=reps)
        t_tv = gpu_time(lambda: torchvision.ops.nms(boxes, scores, 0.5), number=1 if n == 100_000 else 10,
                        repeat=reps, warmup=1)
        target, met = "identical kept indices", same
        if n == 100_000:
            target, met = ">= 10x faster, identical", same and t_tv >= 10 * t_ours
        elif n == 10_000:
            target, met = "<= 1 ms, identical", same and t_ours <= 1e-3
        rows.append(Row(f"NMS {n} boxes (IoU 0.5)", "ms", t_ours * 1e3, t_tv * 1e3, "torchvision.ops.nms",
                        target, met, {"kept": int(len(got)), "identical": same}))
    return rows
