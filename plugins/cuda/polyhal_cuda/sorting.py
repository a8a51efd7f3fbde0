"""sort, argsort and topk on CUDA (``cu/sort.cu``), with their scratch declared to the core.

Two paths (see the CUDA source for the algorithms):

``sort_rows`` — a bitonic network per lane, one block per lane, over P = next_pow2(N) (key,
index) pairs. Its scratch ``pairs`` (P * (4 + key bytes) per block) is declared shared-first:
the bufferization policy puts it in shared memory (dynamic shared memory, up to the device's
opt-in limit) when it fits, or in global scratch (one slice per block) otherwise; the kernel
has code for both. Chosen when the lanes are short, or many enough to fill the GPU.

``radix`` — an LSD radix sort over all lanes at once (8-bit digits, lanes kept apart by extra
passes over the lane number), for long lanes. Its scratch — ping-pong keys and payloads, the
digit histogram and per-pass digit totals — is global only.

The decision depends only on the op instance and the device (:func:`plan_sort`), so the
scratch declared at compile time (:func:`scratch_requests`) and the kernel bound by
:func:`prepare` always agree. Without a plan's scratch binding (direct use, :mod:`.nms`), the
same policy places the scratch and this module allocates the global part itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from polyhal.errors import ProgramError
from polyhal.hal.scratch import KernelInfo, MemorySpace, Problem, ScratchDecl

from polyhal_cuda.cuda_source import function

if TYPE_CHECKING:
    from polyhal_cuda.device import CUDADevice

_KEY_CTYPE = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}
F_DESC, F_CANON_ZERO, F_VALUES, F_INDICES, F_INDEX_ORDER = 1, 2, 4, 8, 16
BLOCK = 256
#: Lanes of at most this many (padded) elements always take the bitonic path.
SMALL_LANE = 4096
#: Force a path: "rows" or "radix" (tests use it to exercise both on every shape).
FORCE_PATH: str | None = None


def _kind(dtype: np.dtype) -> int:
    return 2 if dtype.kind == "f" else 1 if dtype.kind == "i" else 0


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


@dataclass(frozen=True)
class SortPlan:
    """Everything about one sort instance that the kernels and the scratch depend on."""

    op: str
    path: str            # "rows" or "radix"
    dtype: np.dtype
    lanes: int
    n: int
    inner: int
    kout: int
    flags: int
    p: int = 0           # rows: padded lane length
    kp: int = 0          # rows: padded k for the index-order re-sort
    threads: int = 0     # rows: block size
    tiles: int = 0       # radix
    passes: tuple = ()   # radix: (shift, is_lane_pass) per pass
    payload: bool = False
    tiles2: int = 0      # radix topk(sorted=False): the second sort
    passes2: int = 0

    @property
    def key_bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def ctype(self) -> str:
        return _KEY_CTYPE[self.key_bytes]

    @property
    def total(self) -> int:
        return self.lanes * self.n


def _tile(key_bytes: int) -> int:
    return BLOCK * (8 if key_bytes >= 8 else 16)


def plan_sort(device: "CUDADevice", op: str, attrs: dict, x) -> SortPlan:
    """The path and parameters of one sort/argsort/topk instance on ``device``."""
    axis = int(attrs["axis"]) % x.rank
    n = x.shape[axis]
    inner = math.prod(x.shape[axis + 1:])
    lanes = math.prod(x.shape) // n if n else 0
    if op == "topk":
        kout, desc, index_order = int(attrs["k"]), bool(attrs["largest"]), not bool(attrs["sorted"])
        flags = F_VALUES | F_INDICES
    else:
        kout, desc, index_order = n, bool(attrs["descending"]), False
        flags = F_VALUES if op == "sort" else F_INDICES
    if desc:
        flags |= F_DESC
    if index_order:
        flags |= F_INDEX_ORDER
    ks = x.dtype.itemsize
    p = max(2, _next_pow2(n))
    pair_bytes = p * (4 + ks)
    from polyhal_cuda.scratch import shared_limit

    fits = pair_bytes <= shared_limit(device) and n < 2**31
    sms = int(device.spec.limits.get("multiprocessors", 1))
    path = "rows" if fits and (p <= SMALL_LANE or lanes >= 2 * sms) else "radix"
    if FORCE_PATH == "rows" and n < 2**31:
        path = "rows"
    elif FORCE_PATH == "radix":
        path = "radix"
    if path == "rows":
        return SortPlan(op, "rows", x.dtype, lanes, n, inner, kout, flags | F_CANON_ZERO, p=p,
                        kp=max(2, _next_pow2(kout)), threads=min(1024, max(32, p // 2)))
    total = lanes * n
    if total >= 2**32:
        raise ProgramError(f"{op}: {total} elements; the CUDA radix sort handles fewer than 2**32 at once "
                           "(split the tensor)")
    payload = bool(flags & F_INDICES) or lanes > 1
    if payload:
        flags |= F_CANON_ZERO  # ties of -0.0 and +0.0 must keep index order
    lane_passes = 0 if lanes <= 1 else -(-(lanes - 1).bit_length() // 8)
    passes = tuple((8 * i, False) for i in range(ks)) + tuple((8 * i, True) for i in range(lane_passes))
    tiles = -(-total // _tile(ks))
    tiles2 = passes2 = 0
    if index_order:
        tiles2 = -(-(lanes * kout) // _tile(4))
        passes2 = max(1, -(-max(total - 1, 1).bit_length() // 8))
    return SortPlan(op, "radix", x.dtype, lanes, n, inner, kout, flags, tiles=tiles, passes=passes,
                    payload=payload, tiles2=tiles2, passes2=passes2)


# --------------------------------------------------------------------------------------- scratch

def _decls(plan: SortPlan) -> list[tuple[KernelInfo, list[ScratchDecl]]]:
    if plan.path == "rows":
        kernel = KernelInfo("sort_rows", plan.op, plan.threads, plan.lanes, "cuda")
        return [(kernel, [ScratchDecl("pairs", shared=True, per_workgroup=plan.p * (4 + plan.key_bytes),
                                      spaces=(MemorySpace.WORKGROUP, MemorySpace.GLOBAL), alignment=16,
                                      purpose="bitonic (key, index) pairs of one lane")])]
    ks, total = plan.key_bytes, plan.total
    g = (MemorySpace.GLOBAL,)
    decls = [
        ScratchDecl("keys", shared=True, per_workgroup=2 * total * ks, spaces=g, alignment=256,
                    purpose="ping-pong radix keys"),
        ScratchDecl("hist", shared=True, per_workgroup=256 * plan.tiles * 4, spaces=g, alignment=256,
                    purpose="per-tile digit counts, then their exclusive offsets"),
        ScratchDecl("totals", shared=True, per_workgroup=256 * len(plan.passes) * 4, spaces=g, alignment=256,
                    purpose="per-pass digit totals"),
    ]
    if plan.payload:
        decls.append(ScratchDecl("payload", shared=True, per_workgroup=2 * total * 4, spaces=g, alignment=256,
                                 purpose="ping-pong flat indices carried with the keys"))
    if plan.flags & F_INDEX_ORDER:
        m = plan.lanes * plan.kout
        decls += [
            ScratchDecl("flat", shared=True, per_workgroup=2 * m * 4, spaces=g, alignment=256,
                        purpose="top-k flat indices, re-sorted into index order"),
            ScratchDecl("hist2", shared=True, per_workgroup=256 * plan.tiles2 * 4, spaces=g, alignment=256,
                        purpose="digit counts of the index-order re-sort"),
            ScratchDecl("totals2", shared=True, per_workgroup=256 * plan.passes2 * 4, spaces=g, alignment=256,
                        purpose="digit totals of the index-order re-sort"),
        ]
    return [(KernelInfo("radix_sort", plan.op, BLOCK, 1, "cuda"), decls)]


def scratch_requests(device: "CUDADevice", op: str, attrs: dict, ins, outs):
    """Scratch requests of one instance (the core's ``Device.scratch``)."""
    plan = plan_sort(device, op, attrs, ins[0])
    problem = Problem(op, attrs, tuple(ins), tuple(outs))
    return tuple(d.request(problem, k) for k, ds in _decls(plan) for d in ds)


class Scratch:
    """Resolved scratch of one prepared kernel: the space and device address of each scratch,
    from the plan's :class:`~polyhal.hal.scratch.ScratchBinding`, or placed by the same policy
    and allocated here when there is none."""

    def __init__(self, device: "CUDADevice", requests: tuple, binding: Any) -> None:
        self.spaces: dict[str, MemorySpace] = {}
        self.ptrs: dict[str, int] = {}
        self._keep: list = []
        if binding:
            for req in requests:
                space = binding.space(req.name, req.kernel.name)
                self.spaces[req.name] = space
                if space is MemorySpace.GLOBAL:
                    buf = binding.buffer(req.name, req.kernel.name)
                    self._keep.append(buf)
                    self.ptrs[req.name] = int(buf.data.ptr)
            return
        from polyhal.hal.flags import MemoryType
        from polyhal.passes.bufferize import place_scratch
        from polyhal.registry import default_registry

        for a in place_scratch(default_registry(), device.spec, tuple(requests)):
            self.spaces[a.request.name] = a.space
            if a.space is MemorySpace.GLOBAL:
                buf = device.allocator.allocate(max(a.nbytes, 1), MemoryType.DEVICE_LOCAL)
                self._keep.append(buf)
                self.ptrs[a.request.name] = buf.native.ptr

    def ptr(self, name: str, offset: int = 0) -> np.uint64:
        return np.uint64(self.ptrs[name] + offset)


# ---------------------------------------------------------------------------------------- kernels

def _expressions(plan: SortPlan) -> list[str]:
    k, kind = plan.ctype, _kind(plan.dtype)
    return [f"sort_rows<{k}, {kind}>", f"radix_make_keys<{k}, {kind}>", f"radix_emit<{k}, {kind}>",
            f"radix_upsweep<{k}, false>", f"radix_upsweep<{k}, true>", f"radix_scatter<{k}, false, false>",
            f"radix_scatter<{k}, false, true>", f"radix_scatter<{k}, true, true>", f"radix_emit_flat<{k}>",
            "radix_scan", "radix_take_prefix"]


def _grid(total: int, sms: int) -> tuple[int]:
    return (max(1, min(-(-total // BLOCK), sms * 32)),)


_NULL = np.uint64(0)


def prepare(device: "CUDADevice", op: str, attrs: dict, ins, outs, binding: Any = None):
    """``fn(x, *outputs)`` for one sort / argsort / topk instance (see the module docstring)."""
    plan = plan_sort(device, op, attrs, ins[0])
    scratch = Scratch(device, scratch_requests(device, op, attrs, ins, outs), binding)
    run = _rows(device, plan, scratch) if plan.path == "rows" else _radix(device, plan, scratch)
    run.plan = plan  # type: ignore[attr-defined]
    run.scratch_spaces = dict(scratch.spaces)  # type: ignore[attr-defined]
    return run


def _outputs(plan: SortPlan, outs: tuple) -> tuple[Any, Any]:
    if plan.op == "sort":
        return outs[0], _NULL
    if plan.op == "argsort":
        return _NULL, outs[0]
    return outs[0], outs[1]


def _rows(device: "CUDADevice", plan: SortPlan, scratch: Scratch):
    exprs = _expressions(plan)
    name = exprs[0]
    fn = function(device, "sort.cu", exprs, name)
    shared = scratch.spaces["pairs"] is MemorySpace.WORKGROUP
    smem = plan.p * (4 + plan.key_bytes) if shared else 0
    if smem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = smem  # opt in beyond the default 48 KiB
    base = _NULL if shared else scratch.ptr("pairs")
    grid, block = (plan.lanes,), (plan.threads,)
    fixed = (np.int64(plan.lanes), np.int64(plan.n), np.int64(plan.inner), np.int64(plan.kout),
             np.uint32(plan.p), np.uint32(plan.kp), np.int32(plan.flags), base)
    launch = device.launch

    def run(x, *outs):
        values, indices = _outputs(plan, outs)
        launch(fn, name, grid, block, (x, values, indices) + fixed, smem)

    run.kernel_name = name  # type: ignore[attr-defined]
    return run


def _radix(device: "CUDADevice", plan: SortPlan, scratch: Scratch):
    from cupy.cuda import runtime

    exprs = _expressions(plan)
    k = plan.ctype
    get = lambda e: function(device, "sort.cu", exprs, e)  # noqa: E731
    make_keys, emit = get(exprs[1]), get(exprs[2])
    upsweep = {False: get(exprs[3]), True: get(exprs[4])}
    scatter = {(False, False): get(exprs[5]), (False, True): get(exprs[6]), (True, True): get(exprs[7])}
    scan = get("radix_scan")
    sms = int(device.spec.limits.get("multiprocessors", 1))
    total, ks, pay = plan.total, plan.key_bytes, plan.payload
    keys = [scratch.ptr("keys"), scratch.ptr("keys", total * ks)]
    pays = [scratch.ptr("payload"), scratch.ptr("payload", total * 4)] if pay else [_NULL, _NULL]
    hist, totals = scratch.ptr("hist"), scratch.ptrs["totals"]
    nbytes_totals = 256 * 4 * len(plan.passes)
    tiles = np.uint32(plan.tiles)
    u_total, u_n = np.uint32(total), np.uint32(plan.n)
    g_elems = _grid(total, sms)
    g_out = _grid(plan.lanes * plan.kout, sms)
    launch, stream = device.launch, device.stream
    steps: list = []  # (kernel, name, grid, block, args) of the passes, fixed at prepare time
    cur = 0
    for i, (shift, lane_pass) in enumerate(plan.passes):
        tot = np.uint64(totals + 256 * 4 * i)
        steps.append((upsweep[lane_pass], f"radix_upsweep<{k}, {str(lane_pass).lower()}>", (plan.tiles,), (BLOCK,),
                      (keys[cur], pays[cur], u_total, u_n, np.int32(shift), hist, tot, tiles)))
        steps.append((scan, "radix_scan", (256,), (1024,), (hist, tot, tiles)))
        steps.append((scatter[(lane_pass, pay)], f"radix_scatter<{k}, ...>", (plan.tiles,), (BLOCK,),
                      (keys[cur], pays[cur], keys[1 - cur], pays[1 - cur], u_total, u_n, np.int32(shift), hist,
                       tiles)))
        cur = 1 - cur
    final_keys, final_pay = keys[cur], pays[cur]
    second = _second_sort(device, plan, scratch, final_pay) if plan.flags & F_INDEX_ORDER else None
    shape_args = (np.int64(plan.lanes), np.int64(plan.n), np.int64(plan.inner), np.int64(plan.kout),
                  np.int32(plan.flags))
    emit_name, make_name = exprs[2], exprs[1]

    def run(x, *outs):
        values, indices = _outputs(plan, outs)
        runtime.memsetAsync(totals, 0, nbytes_totals, stream.ptr)
        launch(make_keys, make_name, g_elems, (BLOCK,),
               (x, keys[0], pays[0], np.int64(total), np.int64(plan.n), np.int64(plan.inner), np.int32(plan.flags)))
        for kernel, name, grid, block, args in steps:
            launch(kernel, name, grid, block, args)
        if second is not None:
            second(x, values, indices)
        else:
            launch(emit, emit_name, g_out, (BLOCK,), (final_keys, final_pay, x, values, indices) + shape_args)

    run.kernel_name = f"radix_sort<{k}>"  # type: ignore[attr-defined]
    return run


def _second_sort(device: "CUDADevice", plan: SortPlan, scratch: Scratch, final_pay: np.uint64):
    """topk(sorted=False) on the radix path: re-sort the selected flat indices (u32 keys)."""
    from cupy.cuda import runtime

    exprs = _expressions(plan)
    u32 = ["sort_rows<unsigned int, 0>", "radix_make_keys<unsigned int, 0>", "radix_emit<unsigned int, 0>",
           "radix_upsweep<unsigned int, false>", "radix_upsweep<unsigned int, true>",
           "radix_scatter<unsigned int, false, false>", "radix_scatter<unsigned int, false, true>",
           "radix_scatter<unsigned int, true, true>", "radix_emit_flat<unsigned int>", "radix_scan",
           "radix_take_prefix"]
    take = function(device, "sort.cu", exprs, "radix_take_prefix")
    emit_flat = function(device, "sort.cu", exprs, f"radix_emit_flat<{plan.ctype}>")
    up = function(device, "sort.cu", u32, "radix_upsweep<unsigned int, false>")
    sc = function(device, "sort.cu", u32, "radix_scatter<unsigned int, false, false>")
    scan = function(device, "sort.cu", u32, "radix_scan")
    sms = int(device.spec.limits.get("multiprocessors", 1))
    m = plan.lanes * plan.kout
    flat = [scratch.ptr("flat"), scratch.ptr("flat", m * 4)]
    hist, totals = scratch.ptr("hist2"), scratch.ptrs["totals2"]
    tiles = np.uint32(plan.tiles2)
    launch, stream = device.launch, device.stream
    g = _grid(m, sms)

    def run(x, values, indices):
        runtime.memsetAsync(totals, 0, 256 * 4 * plan.passes2, stream.ptr)
        launch(take, "radix_take_prefix", g, (BLOCK,),
               (final_pay, flat[0], np.int64(plan.lanes), np.int64(plan.n), np.int64(plan.kout)))
        cur = 0
        for i in range(plan.passes2):
            tot = np.uint64(totals + 256 * 4 * i)
            launch(up, "radix_upsweep<unsigned int, false>", (plan.tiles2,), (BLOCK,),
                   (flat[cur], _NULL, np.uint32(m), np.uint32(1), np.int32(8 * i), hist, tot, tiles))
            launch(scan, "radix_scan", (256,), (1024,), (hist, tot, tiles))
            launch(sc, "radix_scatter<unsigned int, false, false>", (plan.tiles2,), (BLOCK,),
                   (flat[cur], _NULL, flat[1 - cur], _NULL, np.uint32(m), np.uint32(1), np.int32(8 * i), hist, tiles))
            cur = 1 - cur
        launch(emit_flat, f"radix_emit_flat<{plan.ctype}>", g, (BLOCK,),
               (flat[cur], x, values, indices, np.int64(plan.lanes), np.int64(plan.n), np.int64(plan.inner),
                np.int64(plan.kout), np.int32(plan.flags)))

    return run
