"""``attention`` on CUDA: softmax(scale * q @ k^T) @ v as two batched cuBLAS products and the
row-wise softmax kernel (``cu/rowwise.cu``), with every temporary declared as scratch.

What ``polyhal.passes.fuse_attention`` makes of a self-attention head's MatMul, Softmax and
MatMul. Without a kernel here the op went through the host fallback (a round trip through numpy
per call, and no CUDA graph): 4.5 ms for the example transformer block against 0.35 ms in torch.

Per call: the scores ``(B, Lq, Lk)`` = scale * q @ k^T (k read transposed), the probabilities
by ``softmax_rows`` into a second buffer, then probabilities @ v into the output. q, k and v
usually arrive as strided views of the heads of a projection (:func:`accepts_view` takes those
cuBLAS can read; the bufferize pass copies any other): heads at one batch stride go to
``cublasGemmStridedBatchedEx`` with that stride and their leading dimension
(:func:`.blas.operand_layout`); heads at two strides -- batch and head of torch's packed (S, B,
3, H, D) projection, which no one stride reaches -- to ``cublasGemmBatchedEx``, whose arrays of
matrix addresses one small kernel writes per product (ViT-B/16 at batch 16 copied 36 heads per
run before, 0.57 ms on an H200).
The scores, the probabilities and the address arrays are global scratch the plan's
bufferization places (:func:`scratch_requests`); the kernel allocates nothing and is captured
into the plan's CUDA graph like any other step.

float32 and float64 (the row kernel's types); float16 casts its operands into float32 scratch
around the float32 kernel. Where cuDNN is usable, each float16/float32 instance is also run through
cuDNN's fused attention (:mod:`polyhal_cuda.sdpa`) when the plan is compiled, and the faster of the
two correct ones is kept. Empty shapes are left to the backend's fallback.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from polyhal.dlpack import reshaped_strides
from polyhal.hal.scratch import KernelInfo, MemorySpace, Problem, ScratchDecl
from polyhal.ir.types import TensorType

from polyhal_cuda import blas, sdpa
from polyhal_cuda.allocator import array_view
from polyhal_cuda.cuda_source import function
from polyhal_gpu import rowwise
from polyhal_gpu.scratch import Scratch

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the CUDA device; its module imports this one

#: Element types with a kernel here: float32 and float64 compute in their type; float16 in
#: float32 (its operands cast into scratch, the result cast back) or through cuDNN's SDPA.
DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
_F16, _F32 = np.dtype(np.float16), np.dtype(np.float32)
#: Workspace declared for cuDNN's SDPA (it asked for 256 B at ViT-B/16's and GPT-2's shapes on
#: an H200); a graph that wants more is not used.
SDPA_WORKSPACE = 1 << 20


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
    dtype = ins[0].dtype
    item = 4 if dtype == _F16 else dtype.itemsize  # float16 computes in float32
    gl = (MemorySpace.GLOBAL,)

    def decl(name: str, elements: int, purpose: str, size: int = item) -> ScratchDecl:
        return ScratchDecl(name, shared=True, per_launch=elements * size, spaces=gl, alignment=256, purpose=purpose)

    kernel = KernelInfo("attention", "attention", 256, 1, "cuda")
    decls = [decl("scores", b * lq * lk, "scale * q @ k^T"), decl("probs", b * lq * lk, "softmax of the scores"),
             decl("pointers", 6 * b, "matrix addresses of both products where a batch sits at two strides", 8)]
    if dtype == _F16:
        decls += [decl("q32", b * lq * d, "q in float32"), decl("k32", b * lk * d, "k in float32"),
                  decl("v32", b * lk * dv, "v in float32"), decl("o32", b * lq * dv, "the result in float32")]
    if dtype in sdpa.DTYPES and sdpa.enabled()[0]:
        decls.append(decl("sdpa_workspace", SDPA_WORKSPACE, "cuDNN SDPA workspace", 1))
    problem = Problem(op, attrs, tuple(ins), tuple(outs))
    return tuple(d_.request(problem, kernel) for d_ in decls)


def prepare(device: "Device", op: str, attrs: dict, ins, outs, binding: Any = None):
    """``fn(q, k, v, out)`` for one instance, or None for the fallback: cuDNN's SDPA where it
    measured correct and faster (:func:`polyhal_cuda.sdpa.choose`), else the own kernel; its
    ``kernel_name`` says which and why."""
    if not covered(ins):
        return None
    b, lq, lk, d, dv = _dims(ins)
    dtype = ins[0].dtype
    scale = 1.0 / math.sqrt(d) if attrs.get("scale") is None else float(attrs["scale"])
    requests = scratch_requests(device, op, attrs, ins, outs)
    s = Scratch(device, requests, binding, lambda a: a.data.ptr)
    own = _via_float32(device, attrs, ins, s, scale) if dtype == _F16 else _own(device, attrs, ins, s, scale)
    if own is None:
        return None
    if "sdpa_workspace" not in s.ptrs:
        why = "" if dtype not in sdpa.DTYPES else f" ({sdpa.enabled()[1]})"
        own.kernel_name = f"attention: own kernel{why}: {own.kernel_name}"  # type: ignore[attr-defined]
        return own
    graph, note = sdpa.choose(device, ins, outs, scale, own, SDPA_WORKSPACE)
    if graph is None:
        own.kernel_name = f"attention: {note}: {own.kernel_name}"  # type: ignore[attr-defined]
        return own
    ws = int(s.ptr("sdpa_workspace"))
    graphs: dict[tuple, Any] = {}

    def attention(q, k, v, out):
        key = (q.strides, k.strides, v.strides, out.strides)
        if key not in graphs:  # the first call (eager, before any capture): the graph for these strides
            try:
                g = sdpa.graph_for(device, dtype, (q, k, v, out), scale)
                graphs[key] = g if g.workspace <= SDPA_WORKSPACE else None
            except Exception:  # noqa: BLE001 - strides cuDNN does not take: the own kernel
                graphs[key] = None
        g = graphs[key]
        if g is None:
            own(q, k, v, out)
        else:
            g.run(q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, ws)

    attention.kernel_name = f"attention: {note}"  # type: ignore[attr-defined]
    attention.scratch = s  # type: ignore[attr-defined]
    return attention


def _via_float32(device: "Device", attrs: dict, ins, s: Scratch, scale: float):
    """The own kernel for float16: q, k, v cast into float32 scratch, the float32 kernel, the
    result cast back (softmax and products in float32, as torch's float16 attention computes)."""
    import cupy as cp

    inner = _own(device, attrs, tuple(TensorType(t.shape, _F32) for t in ins), s, scale)
    if inner is None:
        return None
    dv = ins[2].shape[-1]
    view = lambda name, shape: array_view(int(s.ptr(name)), shape, _F32, s, device.ordinal)  # noqa: E731
    q32, k32, v32 = view("q32", ins[0].shape), view("k32", ins[1].shape), view("v32", ins[2].shape)
    o32 = view("o32", ins[0].shape[:-1] + (dv,))

    def attention_float32(q, k, v, out):
        cp.copyto(q32, q)
        cp.copyto(k32, k)
        cp.copyto(v32, v)
        inner(q32, k32, v32, o32)
        cp.copyto(out, o32, casting="same_kind")

    attention_float32.kernel_name = f"float16 cast to float32, {inner.kernel_name}"  # type: ignore[attr-defined]
    return attention_float32


def _own(device: "Device", attrs: dict, ins, s: Scratch, scale: float):
    """``fn(q, k, v, out)``: the own kernel of the module docstring, in ``ins``' type."""
    import cupy as cp

    b, lq, lk, d, dv = _dims(ins)
    dtype = ins[0].dtype
    view = lambda name, shape: array_view(int(s.ptr(name)), shape, dtype, s, device.ordinal)  # noqa: E731
    scores, probs = view("scores", (b, lq, lk)), view("probs", (b, lq, lk))
    tf32 = attrs["precision"] == "tf32"
    qk = blas.prepare_batched(device, dtype, lq, lk, d, b, trans_b=True, alpha=scale, tf32=tf32)
    pv = blas.prepare_batched(device, dtype, lq, dv, lk, b, tf32=tf32)
    row_plan = rowwise.plan("softmax", {"axis": -1}, (TensorType((b * lq, lk), dtype),))
    if qk is None or pv is None or row_plan is None:
        return None
    softmax = rowwise.kernel(row_plan, function(device, rowwise.SOURCE, rowwise.EXPRESSIONS, row_plan.expression),
                             device.launch)
    flat_scores, flat_probs = scores.reshape(b * lq, lk), probs.reshape(b * lq, lk)
    pointer_qk = blas.prepare_pointer_batched(device, dtype, lq, lk, d, b, alpha=scale, tf32=tf32)
    pointer_pv = blas.prepare_pointer_batched(device, dtype, lq, dv, lk, b, tf32=tf32)
    if pointer_qk is None or pointer_pv is None:
        return None
    fill = _pointer_kernel(device)
    pointers = int(s.ptr("pointers"))
    item = dtype.itemsize

    def operand(x, shape, trans):
        """(x as a (batch, rows, cols) array cuBLAS reads at one batch stride, None) or, for a
        batch at two strides, (None, its :func:`_two_level` description)."""
        if x.flags.c_contiguous:
            return x.reshape(shape), None
        flat = reshaped_strides(x.shape, tuple(st // x.itemsize for st in x.strides), shape)
        if flat is not None and blas.operand_layout(shape, flat) is not None:
            return x.reshape(shape), None  # no copy: cuBLAS reads the heads through ld and batch stride
        two = _two_level(x.shape, tuple(st // item for st in x.strides), trans)
        if two is not None:  # no copy: the products take the matrices' addresses
            layout, inner, outer, stride = two
            return None, (x.data.ptr, layout, inner, outer * item, stride * item)
        # Not from a plan (its views are what accepts_view allowed): a called kernel's operand.
        return cp.ascontiguousarray(x).reshape(shape), None

    def described(x3, trans):
        op, ld, stride = blas._layout_of(x3, trans)
        return x3.data.ptr, (op, ld), b, 0, stride * item

    def product(slot, call, a, b_, c_ptr, rows, cols):
        """The pointer arrays of one product (one small kernel), then the product."""
        at = pointers + slot * 3 * b * 8
        c = (c_ptr, None, b, 0, rows * cols * item)
        args = [np.uint64(at), np.int32(b)]
        for ptr, _layout, inner, outer, stride in (a, b_, c):
            args += [np.uint64(ptr), np.int32(inner), np.int64(outer), np.int64(stride)]
        device.launch(fill, "batch_pointers", ((b + 127) // 128,), (128,), tuple(args))
        call(at, at + b * 8, at + 2 * b * 8, a[1], b_[1])

    def attention(q, k, v, out):
        q3, q2 = operand(q, (b, lq, d), False)
        k3, k2 = operand(k, (b, lk, d), True)
        v3, v2 = operand(v, (b, lk, dv), False)
        if q2 is None and k2 is None:
            qk(q3, k3, scores)
        else:
            product(0, pointer_qk, q2 or described(q3, False), k2 or described(k3, True), scores.data.ptr, lq, lk)
        softmax(flat_scores, flat_probs)
        # a plan's outputs are dense; a called kernel's may not be
        target = out.reshape(b, lq, dv) if out.flags.c_contiguous else cp.empty((b, lq, dv), dtype)
        if v2 is None:
            pv(probs, v3, target)
        else:
            product(1, pointer_pv, described(probs, False), v2, target.data.ptr, lq, dv)
        if not out.flags.c_contiguous:
            cp.copyto(out, target.reshape(out.shape))

    attention.kernel_name = "attention (cublasGemmStridedBatchedEx, softmax_rows, cublasGemmStridedBatchedEx)"  # type: ignore[attr-defined]
    return attention


_POINTERS = r"""
extern "C" __global__ void batch_pointers(unsigned long long out, int n,
    unsigned long long a, int a_inner, long long a_outer, long long a_stride,
    unsigned long long b, int b_inner, long long b_outer, long long b_stride,
    unsigned long long c, int c_inner, long long c_outer, long long c_stride) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  unsigned long long* p = (unsigned long long*)out;
  p[i] = a + (i / a_inner) * a_outer + (i % a_inner) * a_stride;
  p[n + i] = b + (i / b_inner) * b_outer + (i % b_inner) * b_stride;
  p[2 * n + i] = c + (i / c_inner) * c_outer + (i % c_inner) * c_stride;
}
"""


def _pointer_kernel(device: "Device") -> Any:
    """The kernel that writes a product's three arrays of matrix addresses: matrix i of an
    operand at ``base + (i / inner) * outer + (i % inner) * stride`` (bytes)."""
    def build():
        import cupy

        mod = cupy.RawModule(code=_POINTERS, options=("-std=c++17",))
        mod.compile()
        return mod

    return device.module(("batch_pointers", _POINTERS), build).get_function("batch_pointers")


def _two_level(shape: tuple, strides: tuple, trans: bool) -> tuple | None:
    """``((op, ld), inner, outer, stride)`` of an operand of ``shape`` and element ``strides``
    whose matrices (last two dims, read transposed with ``trans``) cuBLAS reads with an op flag
    and leading dimension and whose batch dims merge into at most two levels: matrix i at
    element ``(i // inner) * outer + (i % inner) * stride``; None otherwise."""
    layout = blas.operand_layout(shape[-2:], strides[-2:], trans)
    if layout is None:
        return None
    levels: list[tuple[int, int]] = []
    for n, st in zip(shape[:-2], strides[:-2]):
        if n == 1:
            continue
        if levels and levels[-1][1] == n * st:
            levels[-1] = (levels[-1][0] * n, st)  # contiguous with the level outside it: one level
        else:
            levels.append((n, st))
    if len(levels) > 2:
        return None
    inner, stride = levels[-1] if levels else (1, 0)
    outer = levels[0][1] if len(levels) == 2 else 0
    return layout[:2], inner, outer, stride


def accepts_view(op: str, attrs: dict, ins, outs, index: int, strides: tuple, offset: int) -> bool:
    """Whether ``attention`` reads operand ``index`` (q, k or v) of these element ``strides`` in
    place: its heads at one batch stride or two, each with contiguous rows or columns (anything
    else is copied by the bufferize pass, so the kernel needs no scratch for copies)."""
    t = ins[index]
    return index < 3 and t.rank >= 2 and _two_level(t.shape, strides, index == 1) is not None
