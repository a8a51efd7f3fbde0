"""``attention`` through cuDNN's fused attention (the graph API's SDPA node), where it measures
faster than the backend's own kernel (:mod:`polyhal_cuda.attention`).

cuDNN's SDPA reads q, k, v and writes the output as (B, H, S, D) tensors of any strides with a
unit last stride, so the heads of a packed projection -- batch and head at two strides -- need
no copy. It computes float16 with float softmax and accumulation; on an H200 with cuDNN 9.19 it
also took float32 (error against float64 8.8e-7 at ViT-B/16's shape, no TF32), so both types
get the choice.

When a plan is compiled (:func:`choose`, called by the attention kernel's ``prepare``) the
instance runs both ways once on random dense operands of its shapes: cuDNN's result is checked
against the own kernel's (:data:`TOLERANCE`) and both are timed on the device's stream; the
faster correct one is kept, and the kernel's ``kernel_name`` says which with both times. Where
cuDNN is unusable, has no engine for the shape, or gives another result, the own kernel runs,
and the name says why. The graph for the operands' actual strides is built on the first call
(a plan's first call runs eagerly, before any CUDA-graph capture); a later call with other
strides runs the own kernel. ``POLYHAL_CUDA_SDPA=0`` turns this path off.

On an H200 (cuDNN 9.19; 12 heads of 64): ViT-B/16's attention at batch 16 (197 tokens, heads of
the packed projection) as the compile timed it, cuDNN against the own kernel: float16 51-69 us
against 220 (the own one casts to float32), float32 129-136 us against 163-190; torch's float16
SDPA took 30 us. The whole model in float16 at batch 16: 4.73 ms, 7.09 before (attention in
float32 between casts); torch's float16 eager 3.22 ms.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from polyhal_cuda.settings import CUDASettings

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the CUDA device; its module imports this one

#: Element types cuDNN's SDPA computes here (cuDNN's names).
DTYPES = {np.dtype(np.float16): "HALF", np.dtype(np.float32): "FLOAT"}
#: Largest allowed difference from the own kernel, relative to its largest magnitude.
TOLERANCE = {np.dtype(np.float16): 5e-3, np.dtype(np.float32): 2e-5}


def enabled() -> tuple[bool, str]:
    """``(usable, why not)``: cuDNN usable and ``POLYHAL_CUDA_SDPA`` not off."""
    from polyhal_cuda import cudnn

    if not CUDASettings.from_env().sdpa:
        return False, "POLYHAL_CUDA_SDPA=0"
    why = cudnn.status()[1]
    return (not why), why


def _levels(shape: tuple, strides: tuple) -> list[tuple[int, int]]:
    """The batch dims (all but the last two) of an operand as (count, element stride) levels,
    unit dims dropped and dims contiguous with the one outside them merged."""
    levels: list[tuple[int, int]] = []
    for n, st in zip(shape[:-2], strides[:-2]):
        if n == 1:
            continue
        if levels and levels[-1][1] == n * st:
            levels[-1] = (levels[-1][0] * n, st)
        else:
            levels.append((n, st))
    return levels


def bhsd(shape: tuple, strides: tuple, heads: int) -> tuple[list[int], list[int]] | None:
    """``(dims, strides)`` (B, H, S, D) of an operand of ``shape`` (batch..., S, D) and element
    ``strides`` with its batch dims as B = batch / ``heads`` outer and ``heads`` inner, or None
    where no two strides reach them or the last stride is not 1 (what cuDNN reads)."""
    batch = math.prod(shape[:-2])
    if (strides[-1] != 1 and shape[-1] != 1) or batch % heads:
        return None
    levels = _levels(shape, strides)
    if not levels:
        sb, sh = 0, 0
    elif len(levels) == 1:
        sh = levels[0][1]
        sb = sh * heads
    elif len(levels) == 2 and levels[1][0] == heads:
        sb, sh = levels[0][1], levels[1][1]
    else:
        return None
    return [batch // heads, heads, shape[-2], shape[-1]], [sb, sh, strides[-2], 1]


def heads_of(shapes_strides) -> int:
    """The head count to split the batch by: the inner level of the first operand whose batch
    sits at two strides, else the whole batch (B = 1)."""
    for shape, strides in shapes_strides:
        levels = _levels(shape, strides)
        if len(levels) == 2:
            return levels[1][0]
    return math.prod(shapes_strides[0][0][:-2]) or 1


def dense_strides(shape: tuple) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


class SDPAGraph:
    """One built cuDNN SDPA graph: ``run(q, k, v, o, workspace)`` with device pointers."""

    def __init__(self, device: "Device", dtype: np.dtype, layouts: dict, scale: float) -> None:
        import cudnn as cd

        from polyhal_cuda import cudnn

        state = cudnn._state(device)
        dt = getattr(cd.data_type, DTYPES[dtype])
        g = cd.pygraph(io_data_type=dt, intermediate_data_type=cd.data_type.FLOAT,
                       compute_data_type=cd.data_type.FLOAT, handle=state.handle)
        t = {n: g.tensor(name=n, dim=d, stride=s, data_type=dt) for n, (d, s) in layouts.items() if n != "o"}
        o, _ = g.sdpa(name="sdpa", q=t["q"], k=t["k"], v=t["v"], attn_scale=scale, generate_stats=False)
        od, os_ = layouts["o"]
        o.set_output(True).set_dim(od).set_stride(os_).set_data_type(dt)
        with device.activate():
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans([cd.heur_mode.A, cd.heur_mode.FALLBACK])
            g.check_support()
            g.build_plans()
        self.graph, self.handle = g, state.handle
        self.tensors = (t["q"], t["k"], t["v"], o)
        self.workspace = int(g.get_workspace_size())

    def run(self, q: int, k: int, v: int, o: int, workspace: int) -> None:
        self.graph.execute(dict(zip(self.tensors, (q, k, v, o))), workspace, handle=self.handle)


def graph_for(device: "Device", dtype: np.dtype, arrays, scale: float) -> SDPAGraph:
    """The SDPA graph for cupy operands ``arrays`` (q, k, v, out) as they are strided (raises
    where cuDNN has no engine or a layout is out of its reach)."""
    shapes = [(a.shape, tuple(st // a.itemsize for st in a.strides)) for a in arrays]
    heads = heads_of(shapes)
    layouts = {}
    for name, (shape, strides) in zip("qkvo", shapes):
        got = bhsd(shape, strides, heads)
        if got is None:
            raise ValueError(f"{name} of shape {shape} and strides {strides} is not (B, H, S, D) with unit last stride")
        layouts[name] = got
    return SDPAGraph(device, dtype, layouts, scale)


def choose(device: "Device", ins, outs, scale: float, own, workspace_bytes: int):
    """``(graph or None, note)``: cuDNN's SDPA for this instance when it is correct and faster
    than ``own(q, k, v, out)`` on random dense operands (see the module docstring); the note
    says what was measured or why cuDNN is not used. ``workspace_bytes``: the most workspace a
    graph may need (the scratch declared for it)."""
    import cupy as cp

    ok, why = enabled()
    dtype = ins[0].dtype
    if not ok:
        return None, f"own kernel ({why})"
    if dtype not in DTYPES:
        return None, f"own kernel (cuDNN's SDPA takes {', '.join(t.name for t in DTYPES)}, not {dtype.name})"
    pool = cp.cuda.MemoryPool()
    try:
        with device.activate(), cp.cuda.using_allocator(pool.malloc):
            rng = cp.random.default_rng(0)
            q, k, v = (rng.standard_normal(t.shape, dtype=np.float64).astype(dtype) for t in ins)
            mine, theirs = (cp.empty(outs[0].shape, dtype) for _ in range(2))
            try:
                graph = graph_for(device, dtype, (q, k, v, theirs), scale)
            except Exception as exc:  # noqa: BLE001 - no engine (or any cuDNN refusal): the own kernel
                return None, f"own kernel (cuDNN's SDPA: {type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
            if graph.workspace > workspace_bytes:
                return None, f"own kernel (cuDNN's SDPA wants {graph.workspace} B of workspace)"
            ws = cp.empty(max(graph.workspace, 1), np.uint8)
            stream = device.stream
            start, stop = cp.cuda.Event(), cp.cuda.Event()

            def timed(fn) -> float:
                fn()
                start.record(stream)
                for _ in range(5):
                    fn()
                stop.record(stream)
                stop.synchronize()
                return cp.cuda.get_elapsed_time(start, stop) / 5

            own_ms = timed(lambda: own(q, k, v, mine))
            cudnn_ms = timed(lambda: graph.run(q.data.ptr, k.data.ptr, v.data.ptr, theirs.data.ptr, ws.data.ptr))
            a, b = mine.astype(np.float64), theirs.astype(np.float64)
            err = float(cp.max(cp.abs(a - b)) / max(float(cp.max(cp.abs(a))), 1e-30))
    finally:
        pool.free_all_blocks()
    times = f"cuDNN {cudnn_ms * 1e3:.0f} us, own {own_ms * 1e3:.0f} us"
    if not err <= TOLERANCE[dtype]:
        return None, f"own kernel (cuDNN's SDPA differs by {err:.1e} relative; {times})"
    if cudnn_ms >= own_ms:
        return None, f"own kernel (measured faster: {times})"
    return graph, f"cuDNN SDPA (measured faster: {times})"
