"""``attention`` on CUDA: softmax(scale * q @ k^T) @ v as two batched cuBLAS products and the
row-wise softmax kernel (``cu/rowwise.cu``), with every temporary declared as scratch.

What ``polyhal.passes.fuse_attention`` makes of a self-attention head's MatMul, Softmax and
MatMul. Without a kernel here the op went through the host fallback (a round trip through numpy
per call, and no CUDA graph): 4.5 ms for the example transformer block against 0.35 ms in torch.

Per call: the scores ``(B, Lq, Lk)`` = scale * q @ k^T (``cublasGemmStridedBatchedEx``, k read
transposed), the probabilities by ``softmax_rows`` into a second buffer, then probabilities @ v
into the output. q, k and v usually arrive as strided views of the heads of a projection; cuBLAS
reads those whose matrices have contiguous rows (or columns) and sit at one batch stride as they
are (:func:`.blas.operand_layout`), the others are first copied into dense scratch (one
elementwise copy each).
All of it -- scores, probabilities, the dense copies, a dense output where the output is a view
-- is global scratch the plan's bufferization places (:func:`scratch_requests`); the kernel
allocates nothing and is captured into the plan's CUDA graph like any other step.

float32 and float64 (the row kernel's types); float16 and empty shapes are left to the backend's
fallback.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from polyhal.dlpack import reshaped_strides
from polyhal.hal.scratch import KernelInfo, MemorySpace, Problem, ScratchDecl
from polyhal.ir.types import TensorType

from polyhal_cuda import blas
from polyhal_cuda.allocator import array_view
from polyhal_cuda.cuda_source import function
from polyhal_gpu import rowwise
from polyhal_gpu.scratch import Scratch

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the CUDA device; its module imports this one

#: Element types with a kernel here.
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _dims(ins) -> tuple[int, int, int, int, int]:
    q, k, v = ins
    return math.prod(q.shape[:-2]), q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]


def covered(ins) -> bool:
    """Whether this module computes the instance (else the backend's fallback does)."""
    return ins[0].dtype in DTYPES and 0 not in _dims(ins)


def scratch_requests(device: "Device", op: str, attrs: dict, ins, outs) -> tuple:
    """The scratch of one ``attention`` instance (the core's ``Device.scratch``)."""
    if not covered(ins):
        return ()
    b, lq, lk, d, dv = _dims(ins)
    item = ins[0].dtype.itemsize
    gl = (MemorySpace.GLOBAL,)

    def decl(name: str, elements: int, purpose: str) -> ScratchDecl:
        return ScratchDecl(name, shared=True, per_launch=elements * item, spaces=gl, alignment=256, purpose=purpose)

    kernel = KernelInfo("attention", "attention", 256, 1, "cuda")
    decls = [decl("scores", b * lq * lk, "scale * q @ k^T"), decl("probs", b * lq * lk, "softmax of the scores"),
             decl("q", b * lq * d, "dense copy of a strided q"), decl("k", b * lk * d, "dense copy of a strided k"),
             decl("v", b * lk * dv, "dense copy of a strided v"), decl("out", b * lq * dv, "dense result before a strided output")]
    problem = Problem(op, attrs, tuple(ins), tuple(outs))
    return tuple(d_.request(problem, kernel) for d_ in decls)


def prepare(device: "Device", op: str, attrs: dict, ins, outs, binding: Any = None):
    """``fn(q, k, v, out)`` for one instance, or None for the fallback (see the module docstring)."""
    import cupy as cp

    if not covered(ins):
        return None
    b, lq, lk, d, dv = _dims(ins)
    dtype = ins[0].dtype
    scale = 1.0 / math.sqrt(d) if attrs.get("scale") is None else float(attrs["scale"])
    s = Scratch(device, scratch_requests(device, op, attrs, ins, outs), binding, lambda a: a.data.ptr)
    view = lambda name, shape: array_view(int(s.ptr(name)), shape, dtype, s, device.ordinal)  # noqa: E731
    scores, probs = view("scores", (b, lq, lk)), view("probs", (b, lq, lk))
    dense = {"q": view("q", (b, lq, d)), "k": view("k", (b, lk, d)), "v": view("v", (b, lk, dv))}
    out_dense = view("out", (b, lq, dv))
    tf32 = attrs["precision"] == "tf32"
    qk = blas.prepare_batched(device, dtype, lq, lk, d, b, trans_b=True, alpha=scale, tf32=tf32)
    pv = blas.prepare_batched(device, dtype, lq, dv, lk, b, tf32=tf32)
    row_plan = rowwise.plan("softmax", {"axis": -1}, (TensorType((b * lq, lk), dtype),))
    if qk is None or pv is None or row_plan is None:
        return None
    softmax = rowwise.kernel(row_plan, function(device, rowwise.SOURCE, rowwise.EXPRESSIONS, row_plan.expression),
                             device.launch)
    copyto = cp.copyto
    flat_scores, flat_probs = scores.reshape(b * lq, lk), probs.reshape(b * lq, lk)

    def operand(x, name, shape):
        if x.flags.c_contiguous:
            return x.reshape(shape)
        flat = reshaped_strides(x.shape, tuple(st // x.itemsize for st in x.strides), shape)
        if flat is not None and blas.operand_layout(shape, flat) is not None:
            return x.reshape(shape)  # no copy: cuBLAS reads the heads through ld and batch stride
        target = dense[name]
        copyto(target.reshape(x.shape), x)  # a view cuBLAS cannot read (batches at two strides)
        return target

    def attention(q, k, v, out):
        q3 = operand(q, "q", (b, lq, d))
        k3 = operand(k, "k", (b, lk, d))
        v3 = operand(v, "v", (b, lk, dv))
        qk(q3, k3, scores)
        softmax(flat_scores, flat_probs)
        if out.flags.c_contiguous:
            pv(probs, v3, out.reshape(b, lq, dv))
        else:
            pv(probs, v3, out_dense)
            copyto(out, out_dense.reshape(out.shape))

    attention.kernel_name = "attention (cublasGemmStridedBatchedEx, softmax_rows, cublasGemmStridedBatchedEx)"  # type: ignore[attr-defined]
    return attention
