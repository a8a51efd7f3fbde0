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
import os
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
#: Sorts of at most this many elements in all take the bitonic path when a lane fits a block.
SMALL_TOTAL = 1 << 16
#: Force a path: "rows" or "radix" (tests use it to exercise both on every shape).
FORCE_PATH: str | None = None
#: Warp-aggregated digit counting in the classic upsweep (``POLYHAL_CUDA_RADIX_AGG=1`` enables).
#: Off by default: plain shared-memory atomics measured faster on an H100 (16M float32 keys:
#: 0.90 ms against 1.13 ms with aggregation; bench/results/cuda_sort-h100.md).
AGGREGATE = os.environ.get("POLYHAL_CUDA_RADIX_AGG", "0") not in ("0", "false", "no", "")
#: The radix implementation (``POLYHAL_CUDA_RADIX``): "classic" (default: upsweep, scan and
#: scatter per pass) or "onesweep" (one kernel per pass, decoupled look-back; slower on an H100
#: in our measurements, 1.5 ms against 1.0 ms for 16M float32 keys: kept for comparison).
RADIX_IMPL = os.environ.get("POLYHAL_CUDA_RADIX", "classic")


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
    impl: str = "classic"   # radix: "classic" (reduce-then-scan) or "onesweep" (one kernel per pass)

    @property
    def fused_output(self) -> bool:
        """Whether the last radix pass writes the outputs itself (contiguous lanes, all of them)."""
        return self.inner == 1 and self.kout == self.n and not self.flags & F_INDEX_ORDER

    @property
    def aux_words(self) -> int:
        """onesweep: digit offsets, look-back status and tile counters of every pass, an error flag."""
        passes = len(self.passes)
        return passes * 256 + passes * self.tiles * 256 + passes + 1

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
    # One block per lane is right for short lanes, for enough lanes to fill the GPU, and for
    # small sorts (one block's bitonic network beats the radix passes' launch chain there).
    path = "rows" if fits and (p <= SMALL_LANE or lanes >= 2 * sms or lanes * n <= SMALL_TOTAL) else "radix"
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
    impl = RADIX_IMPL if total < 2**30 else "classic"  # look-back words carry 30-bit counts
    return SortPlan(op, "radix", x.dtype, lanes, n, inner, kout, flags, tiles=tiles, passes=passes,
                    payload=payload, tiles2=tiles2, passes2=passes2, impl=impl)


# --------------------------------------------------------------------------------------- scratch

def _decls(plan: SortPlan) -> list[tuple[KernelInfo, list[ScratchDecl]]]:
    if plan.path == "rows":
        kernel = KernelInfo("sort_rows", plan.op, plan.threads, plan.lanes, "cuda")
        return [(kernel, [ScratchDecl("pairs", shared=True, per_workgroup=plan.p * (4 + plan.key_bytes),
                                      spaces=(MemorySpace.WORKGROUP, MemorySpace.GLOBAL), alignment=16,
                                      purpose="bitonic (key, index) pairs of one lane")])]
    ks, total = plan.key_bytes, plan.total
    g = (MemorySpace.GLOBAL,)
    decls = [ScratchDecl("keys", shared=True, per_workgroup=2 * total * ks, spaces=g, alignment=256,
                         purpose="ping-pong radix keys")]
    if plan.impl == "onesweep":
        decls.append(ScratchDecl("aux", shared=True, per_workgroup=4 * plan.aux_words, spaces=g, alignment=256,
                                 purpose="digit offsets, look-back status and tile counters of every pass"))
    else:
        decls += [
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

def _b(v: bool) -> str:
    return "true" if v else "false"


#: (lane pass, first pass) of the upsweeps, and (lane pass, payload, first, last) of the
#: scatters that the classic path launches (lane passes are never first).
_UPSWEEPS = [(False, True), (False, False), (True, False)]
_SCATTERS = [(row, pay, first, last) for row, pay in ((False, False), (False, True), (True, True))
             for first in (False, True) for last in (False, True) if not (row and first)]


def _upsweep_name(k: str, kind: int, row: bool, first: bool, agg: bool | None = None) -> str:
    agg = AGGREGATE if agg is None else agg
    return f"radix_upsweep<{k}, {kind}, {_b(row)}, {_b(first)}, {_b(agg)}>"


def _scatter_name(k: str, kind: int, row: bool, pay: bool, first: bool, last: bool) -> str:
    return f"radix_scatter<{k}, {kind}, {_b(row)}, {_b(pay)}, {_b(first)}, {_b(last)}>"


def _expressions(plan: SortPlan) -> list[str]:
    k, kind = plan.ctype, _kind(plan.dtype)
    return [f"sort_rows<{k}, {kind}>", f"radix_make_keys<{k}, {kind}>", f"radix_emit<{k}, {kind}>",
            *(_upsweep_name(k, kind, row, first, agg) for row, first in _UPSWEEPS for agg in (False, True)),
            *(_scatter_name(k, kind, row, pay, first, last) for row, pay, first, last in _SCATTERS),
            f"radix_emit_flat<{k}>",
            "radix_scan", "radix_take_prefix", f"radix_histogram<{k}, {kind}>", "radix_prefix",
            f"radix_onesweep<{k}, {kind}, false, false>", f"radix_onesweep<{k}, {kind}, false, true>",
            f"radix_onesweep<{k}, {kind}, true, true>"]


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
    if plan.impl == "onesweep":
        return _onesweep(device, plan, scratch)
    return _classic(device, plan, scratch)


def _onesweep(device: "CUDADevice", plan: SortPlan, scratch: Scratch):
    from cupy.cuda import runtime

    exprs = _expressions(plan)
    k, kind = plan.ctype, _kind(plan.dtype)
    get = lambda e: function(device, "sort.cu", exprs, e)  # noqa: E731
    hist_name = f"radix_histogram<{k}, {kind}>"
    hist_k, prefix_k, emit = get(hist_name), get("radix_prefix"), get(exprs[2])
    sweep = {(r, p_): get(f"radix_onesweep<{k}, {kind}, {_b(r)}, {_b(p_)}>")
             for r, p_ in ((False, False), (False, True), (True, True))}
    sms = int(device.spec.limits.get("multiprocessors", 1))
    total, ks, pay = plan.total, plan.key_bytes, plan.payload
    passes = len(plan.passes)
    key_passes = sum(1 for _, lane in plan.passes if not lane)
    keys = [scratch.ptr("keys"), scratch.ptr("keys", total * ks)]
    pays = [scratch.ptr("payload"), scratch.ptr("payload", total * 4)] if pay else [_NULL, _NULL]
    aux = scratch.ptrs["aux"]
    hist = aux
    status = aux + 4 * passes * 256
    counters = status + 4 * passes * plan.tiles * 256
    error = np.uint64(counters + 4 * passes)
    aux_bytes = 4 * plan.aux_words
    fused = plan.fused_output
    launch, stream = device.launch, device.stream
    i64 = np.int64
    n_, inner_, flags_ = i64(plan.n), i64(plan.inner), np.int32(plan.flags)
    g_hist = (max(1, min(-(-total // BLOCK), sms * 16)),)
    g_out = _grid(plan.lanes * plan.kout, sms)
    second = _second_sort(device, plan, scratch, None) if plan.flags & F_INDEX_ORDER else None
    names = {key: f"radix_onesweep<{k}, {kind}, {str(key[0]).lower()}, {str(key[1]).lower()}>" for key in sweep}

    def run(x, *outs):
        values, indices = _outputs(plan, outs)
        runtime.memsetAsync(aux, 0, aux_bytes, stream.ptr)
        launch(hist_k, hist_name, g_hist, (BLOCK,), (x, np.uint32(total), n_, inner_, flags_, np.int32(key_passes),
                                                      np.int32(passes - key_passes), np.uint64(hist)))
        launch(prefix_k, "radix_prefix", (1,), (256,), (np.uint64(hist), np.int32(passes)))
        cur = 0
        for p, (shift, lane_pass) in enumerate(plan.passes):
            last = p == passes - 1
            src_x = x if p == 0 else _NULL
            out_v, out_i = (values, indices) if last and fused else (_NULL, _NULL)
            key = (lane_pass, pay)
            launch(sweep[key], names[key], (plan.tiles,), (BLOCK,),
                   (keys[1 - cur] if p else _NULL, pays[1 - cur] if p else _NULL, src_x,
                    keys[cur], pays[cur], out_v, out_i, x, np.uint32(total), n_, inner_, np.int32(shift), flags_,
                    np.uint64(hist + 4 * 256 * p), np.uint64(status + 4 * 256 * plan.tiles * p),
                    np.uint64(counters + 4 * p), error))
            cur = 1 - cur
        final_keys, final_pay = keys[1 - cur], pays[1 - cur]
        if fused:
            return
        if second is not None:
            second(x, values, indices, final_pay)
        else:
            launch(emit, exprs[2], g_out, (BLOCK,),
                   (final_keys, final_pay, x, values, indices, i64(plan.lanes), n_, inner_, i64(plan.kout), flags_))

    run.kernel_name = f"radix_onesweep<{k}, {kind}>"  # type: ignore[attr-defined]
    run.error_flag = int(error)  # type: ignore[attr-defined]
    return run


def _classic(device: "CUDADevice", plan: SortPlan, scratch: Scratch):
    """Per pass: radix_upsweep (tile digit counts), radix_scan (offsets), radix_scatter. The
    first pass reads the operand itself and, where lanes are contiguous and all of each is
    output, the last pass writes the outputs: no separate key-making or output kernel."""
    from cupy.cuda import runtime

    exprs = _expressions(plan)
    k, kind = plan.ctype, _kind(plan.dtype)
    get = lambda e: function(device, "sort.cu", exprs, e)  # noqa: E731
    emit = get(exprs[2])
    scan = get("radix_scan")
    sms = int(device.spec.limits.get("multiprocessors", 1))
    total, ks, pay = plan.total, plan.key_bytes, plan.payload
    keys = [scratch.ptr("keys"), scratch.ptr("keys", total * ks)]
    pays = [scratch.ptr("payload"), scratch.ptr("payload", total * 4)] if pay else [_NULL, _NULL]
    hist, totals = scratch.ptr("hist"), scratch.ptrs["totals"]
    passes = len(plan.passes)
    nbytes_totals = 256 * 4 * passes
    tiles = np.uint32(plan.tiles)
    i64 = np.int64
    u_total, n_, inner_, flags_ = np.uint32(total), i64(plan.n), i64(plan.inner), np.int32(plan.flags)
    g_out = _grid(plan.lanes * plan.kout, sms)
    fused = plan.fused_output
    launch, stream = device.launch, device.stream
    second = _second_sort(device, plan, scratch, None) if plan.flags & F_INDEX_ORDER else None
    fused_last = fused
    launches = []  # (upsweep name, scatter name) per pass, fixed at prepare time
    for i, (shift, lane_pass) in enumerate(plan.passes):
        first, last = i == 0, i == passes - 1
        launches.append((_upsweep_name(k, kind, lane_pass, first),
                         _scatter_name(k, kind, lane_pass, pay, first, last and fused_last)))
    kernels_ = {name: get(name) for pair in launches for name in pair}

    def run(x, *outs):
        values, indices = _outputs(plan, outs)
        runtime.memsetAsync(totals, 0, nbytes_totals, stream.ptr)
        cur = 0  # pass p reads keys[1 - cur] (pass 0: x) and writes keys[cur]
        for i, (shift, lane_pass) in enumerate(plan.passes):
            first, last = i == 0, i == passes - 1
            up_name, sc_name = launches[i]
            src_k, src_p, src_x = (_NULL, _NULL, x) if first else (keys[1 - cur], pays[1 - cur], _NULL)
            tot = np.uint64(totals + 256 * 4 * i)
            launch(kernels_[up_name], up_name, (plan.tiles,), (BLOCK,),
                   (src_k, src_p, src_x, u_total, n_, inner_, np.int32(shift), flags_, hist, tot, tiles))
            launch(scan, "radix_scan", (256,), (1024,), (hist, tot, tiles))
            out_v, out_i = (values, indices) if last and fused else (_NULL, _NULL)
            launch(kernels_[sc_name], sc_name, (plan.tiles,), (BLOCK,),
                   (src_k, src_p, src_x, keys[cur], pays[cur], out_v, out_i, x, u_total, n_, inner_,
                    np.int32(shift), flags_, hist, tiles))
            cur = 1 - cur
        if fused:
            return
        final_keys, final_pay = keys[1 - cur], pays[1 - cur]
        if second is not None:
            second(x, values, indices, final_pay)
        else:
            launch(emit, exprs[2], g_out, (BLOCK,),
                   (final_keys, final_pay, x, values, indices, i64(plan.lanes), n_, inner_, i64(plan.kout), flags_))

    run.kernel_name = f"radix_sort<{k}>"  # type: ignore[attr-defined]
    return run


def _second_sort(device: "CUDADevice", plan: SortPlan, scratch: Scratch, _unused: Any):
    """topk(sorted=False) on the radix path: re-sort the selected flat indices (u32 keys)."""
    from cupy.cuda import runtime

    exprs = _expressions(plan)
    u32 = _expressions(SortPlan("sort", "radix", np.dtype(np.uint32), 1, 1, 1, 1, 0))
    take = function(device, "sort.cu", exprs, "radix_take_prefix")
    emit_flat = function(device, "sort.cu", exprs, f"radix_emit_flat<{plan.ctype}>")
    up_name = _upsweep_name("unsigned int", 0, False, False)
    sc_name = _scatter_name("unsigned int", 0, False, False, False, False)
    up = function(device, "sort.cu", u32, up_name)
    sc = function(device, "sort.cu", u32, sc_name)
    scan = function(device, "sort.cu", u32, "radix_scan")
    sms = int(device.spec.limits.get("multiprocessors", 1))
    m = plan.lanes * plan.kout
    flat = [scratch.ptr("flat"), scratch.ptr("flat", m * 4)]
    hist, totals = scratch.ptr("hist2"), scratch.ptrs["totals2"]
    tiles = np.uint32(plan.tiles2)
    launch, stream = device.launch, device.stream
    g = _grid(m, sms)

    def run(x, values, indices, final_pay):
        runtime.memsetAsync(totals, 0, 256 * 4 * plan.passes2, stream.ptr)
        launch(take, "radix_take_prefix", g, (BLOCK,),
               (final_pay, flat[0], np.int64(plan.lanes), np.int64(plan.n), np.int64(plan.kout)))
        cur = 0
        for i in range(plan.passes2):
            tot = np.uint64(totals + 256 * 4 * i)
            launch(up, up_name, (plan.tiles2,), (BLOCK,),
                   (flat[cur], _NULL, _NULL, np.uint32(m), np.int64(1), np.int64(1), np.int32(8 * i), np.int32(0),
                    hist, tot, tiles))
            launch(scan, "radix_scan", (256,), (1024,), (hist, tot, tiles))
            launch(sc, sc_name, (plan.tiles2,), (BLOCK,),
                   (flat[cur], _NULL, _NULL, flat[1 - cur], _NULL, _NULL, _NULL, _NULL, np.uint32(m), np.int64(1),
                    np.int64(1), np.int32(8 * i), np.int32(0), hist, tiles))
            cur = 1 - cur
        launch(emit_flat, f"radix_emit_flat<{plan.ctype}>", g, (BLOCK,),
               (flat[cur], x, values, indices, np.int64(plan.lanes), np.int64(plan.n), np.int64(plan.inner),
                np.int64(plan.kout), np.int32(plan.flags)))

    return run
