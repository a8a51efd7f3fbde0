"""polyhal-cuda: the CUDA backend of polyhal, on cupy.

Modules, as in every backend: ``plugin`` (the hooks; enumeration creates no CUDA context),
``device`` (CUDADevice: stream, DLPack, transfers, CUDA-graph replay of plans), ``allocator``
(CUDAAllocator: caching or stream-ordered device memory, managed, pinned, imported), ``kernels``
(the op set), and the CUDA C kernels with their host code: ``sorting`` (sort, argsort, top-k),
``suppression`` (non-maximum suppression: the ONNX op and :func:`nms`), ``rowwise`` (softmax,
layer norm). The CUDA C sources and the backend-neutral half of their host code -- plans,
scratch declarations (shared memory when it fits, global scratch otherwise), launches -- and of
the allocator and plugin live in :mod:`polyhal_gpu` (distribution polyhal-gpu), shared with
polyhal-hip, which compiles the same CUDA C for AMD GPUs.
``transfer`` moves pageable host memory through pinned staging buffers, ``graphs`` captures and
replays plans, ``errors`` turns CUDA failures into polyhal errors.

Importing this package (or polyhal_gpu) does not import cupy; :func:`nms` and friends
do, when called.
"""

from __future__ import annotations

from typing import Any

__all__ = ["nms"]


def nms(boxes: Any, scores: Any, iou_threshold: float, *, device: Any = None) -> Any:
    """Greedy non-maximum suppression on a GPU (see :func:`polyhal_cuda.suppression.nms`)."""
    from polyhal_cuda.suppression import nms as _nms

    return _nms(boxes, scores, iou_threshold, device=device)
