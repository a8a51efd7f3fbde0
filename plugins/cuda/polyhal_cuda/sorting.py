"""sort, argsort and topk on CUDA (``cu/sort.cu``), with their scratch declared to the core.

The plan of an instance -- the bitonic ``rows`` path (one block per lane, its pairs
shared-first) or the ``radix`` path (an LSD radix sort over all lanes, global scratch) -- its
scratch declarations and the bitonic launch are backend-neutral and shared with polyhal-hip
(:mod:`polyhal_gpu.sorting`, whose docstring describes the paths). What is CUDA's own
lives here: the knobs of the path choice (:data:`FORCE_PATH`, :data:`RADIX_IMPL`,
:data:`AGGREGATE`), the radix launches (classic: upsweep, scan and scatter per pass; onesweep:
one kernel per pass with a decoupled look-back), and compiling through cupy.

The decision depends only on the op instance and the device (:func:`plan_sort`), so the
scratch declared at compile time (:func:`scratch_requests`) and the kernel bound by
:func:`prepare` always agree. Without a plan's scratch binding (direct use, :mod:`.suppression`),
the same policy places the scratch and :class:`~polyhal_gpu.scratch.Scratch` allocates
the global part itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from polyhal_cuda.cuda_source import function
from polyhal_cuda.settings import CUDATuningSettings
from polyhal_gpu import sorting as portable
from polyhal_gpu.launch import BLOCK, NULL, grid, multiprocessors
from polyhal_gpu.scratch import Scratch
from polyhal_gpu.sorting import F_INDEX_ORDER, SortPlan

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the CUDA device; its module imports this one

#: Force a path: "rows" or "radix" (tests use it to exercise both on every shape).
FORCE_PATH: str | None = None
#: Warp-aggregated digit counting in the classic upsweep (``POLYHAL_CUDA_RADIX_AGG=1`` enables).
#: Off by default: plain shared-memory atomics measured faster on an H100 (16M float32 keys:
#: 0.90 ms against 1.13 ms with aggregation; bench/results/cuda_sort-h100.md).
AGGREGATE = CUDATuningSettings.from_env().radix_aggregate
#: The radix implementation (``POLYHAL_CUDA_RADIX``): "onesweep" (default: one histogram kernel
#: up front, then one kernel per pass with a decoupled look-back) or "classic" (upsweep, scan and
#: scatter per pass; kept for comparison and as the path of sorts of 2**30 elements or more).
#: Why onesweep, measured on an H100 (16M float32 keys, plugins/cuda/tools/sort_tune.py, per-
#: kernel times with events; cupy.sort 0.53-0.54 ms): classic 0.89 ms (upsweep + scan + scatter
#: ~0.21 ms a pass); the first onesweep (256 x 16-key tiles, __match_any_sync ranking) 1.52 ms;
#: with CUB's tile (384 x 21) and early counts 0.82 ms; ranking with shared-memory atomicOr lane
#: masks instead of __match_any_sync 0.56 ms (match.any was the bottleneck, not the look-back,
#: which walks one tile per step and costs little); pass 0 and the histogram issuing their
#: operand loads back to back instead of behind a per-item branch 0.50 ms; 16-byte loads in the
#: histogram and 384 x 17 tiles (three blocks per SM) 0.44 ms, i.e. 0.83x cupy.sort. argsort
#: (payload carried): classic 1.25 ms, onesweep 0.66 ms (cupy.argsort 0.95 ms).
RADIX_IMPL = CUDATuningSettings.from_env().radix
#: The onesweep kernel's (threads, items, match) per (key width, payload)
#: (:data:`polyhal_gpu.sorting.ONESWEEP_SHAPES`; tools/sort_tune.py tries others).
ONESWEEP_SHAPES = dict(portable.ONESWEEP_SHAPES)
#: Blocks per SM of onesweep's up-front histogram kernel (a grid-stride loop), and the copies
#: of its shared counters (warps spread over them).
HISTOGRAM_BLOCKS_PER_SM = 6
HISTOGRAM_PARTS = 8


def plan_sort(device: "Device", op: str, attrs: dict, x) -> SortPlan:
    """The path and parameters of one sort/argsort/topk instance on ``device``
    (:func:`polyhal_gpu.sorting.plan_sort` with this module's knobs)."""
    return portable.plan_sort(device, op, attrs, x, backend="cuda", force_path=FORCE_PATH, radix_impl=RADIX_IMPL,
                              onesweep_shapes=ONESWEEP_SHAPES)


def scratch_requests(device: "Device", op: str, attrs: dict, ins, outs):
    """Scratch requests of one instance (the core's ``Device.scratch``)."""
    return portable.scratch_requests(plan_sort(device, op, attrs, ins[0]), attrs, ins, outs, "cuda")


def scratch(device: "Device", requests: tuple, binding: Any) -> Scratch:
    """Where the scratch of ``requests`` went: the plan's ``binding`` hands out cupy arrays."""
    return Scratch(device, requests, binding, lambda array: array.data.ptr)


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


#: (lane pass, payload) of the onesweep kernels.
_SWEEPS = [(False, False), (False, True), (True, True)]


def _onesweep_name(k: str, kind: int, row: bool, pay: bool, shape: tuple) -> str:
    threads, items, match = shape
    return f"radix_onesweep<{k}, {kind}, {_b(row)}, {_b(pay)}, {threads}, {items}, {match}>"


def _expressions(plan: SortPlan) -> list[str]:
    k, kind = plan.ctype, plan.kind
    shape = plan.shape or tuple(ONESWEEP_SHAPES[plan.key_bytes, plan.payload])
    return [plan.rows_expression, f"radix_make_keys<{k}, {kind}>", f"radix_emit<{k}, {kind}>",
            *(_upsweep_name(k, kind, row, first, agg) for row, first in _UPSWEEPS for agg in (False, True)),
            *(_scatter_name(k, kind, row, pay, first, last) for row, pay, first, last in _SCATTERS),
            f"radix_emit_flat<{k}>",
            "radix_scan", "radix_take_prefix", f"radix_histogram<{k}, {kind}>", "radix_prefix",
            *(_onesweep_name(k, kind, row, pay, shape) for row, pay in _SWEEPS)]


def prepare(device: "Device", op: str, attrs: dict, ins, outs, binding: Any = None):
    """``fn(x, *outputs)`` for one sort / argsort / topk instance (see the module docstring)."""
    plan = plan_sort(device, op, attrs, ins[0])
    resolved = scratch(device, portable.scratch_requests(plan, attrs, ins, outs, "cuda"), binding)
    run = _rows(device, plan, resolved) if plan.path == "rows" else _radix(device, plan, resolved)
    run.plan = plan  # type: ignore[attr-defined]
    run.scratch_spaces = dict(resolved.spaces)  # type: ignore[attr-defined]
    return run


def _rows(device: "Device", plan: SortPlan, scratch: Scratch):
    fn = function(device, portable.SOURCE, _expressions(plan), plan.rows_expression)
    smem = portable.rows_shared_bytes(plan, scratch)
    if smem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = smem  # opt in beyond the default 48 KiB
    return portable.rows_kernel(plan, fn, device.launch, scratch)


def _radix(device: "Device", plan: SortPlan, scratch: Scratch):
    if plan.impl == "onesweep":
        return _onesweep(device, plan, scratch)
    return _classic(device, plan, scratch)


def _onesweep(device: "Device", plan: SortPlan, scratch: Scratch):
    from cupy.cuda import runtime

    exprs = _expressions(plan)
    k, kind = plan.ctype, plan.kind
    get = lambda e: function(device, portable.SOURCE, exprs, e)  # noqa: E731
    hist_name = f"radix_histogram<{k}, {kind}>"
    hist_k, prefix_k, emit = get(hist_name), get("radix_prefix"), get(exprs[2])
    names = {key: _onesweep_name(k, kind, *key, plan.shape) for key in _SWEEPS}
    sweep = {key: get(name) for key, name in names.items()}
    threads = plan.shape[0]
    sms = multiprocessors(device)
    total, ks, pay = plan.total, plan.key_bytes, plan.payload
    passes = len(plan.passes)
    key_passes = sum(1 for _, lane in plan.passes if not lane)
    keys = [scratch.ptr("keys"), scratch.ptr("keys", total * ks)]
    pays = [scratch.ptr("payload"), scratch.ptr("payload", total * 4)] if pay else [NULL, NULL]
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
    g_hist = grid(-(-total // 4), sms, per_multiprocessor=HISTOGRAM_BLOCKS_PER_SM)  # 4 keys per thread
    parts_ = np.int32(HISTOGRAM_PARTS)
    g_out = grid(plan.lanes * plan.kout, sms)
    second = _second_sort(device, plan, scratch, None) if plan.flags & F_INDEX_ORDER else None

    def run(x, *outs):
        values, indices = portable.outputs(plan.op, outs)
        runtime.memsetAsync(aux, 0, aux_bytes, stream.ptr)
        launch(hist_k, hist_name, g_hist, (BLOCK,), (x, np.uint32(total), n_, inner_, flags_, np.int32(key_passes),
                                                      np.int32(passes - key_passes), parts_, np.uint64(hist)))
        launch(prefix_k, "radix_prefix", (1,), (256,), (np.uint64(hist), np.int32(passes)))
        cur = 0
        for p, (shift, lane_pass) in enumerate(plan.passes):
            last = p == passes - 1
            src_x = x if p == 0 else NULL
            out_v, out_i = (values, indices) if last and fused else (NULL, NULL)
            key = (lane_pass, pay)
            launch(sweep[key], names[key], (plan.tiles,), (threads,),
                   (keys[1 - cur] if p else NULL, pays[1 - cur] if p else NULL, src_x,
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


def _classic(device: "Device", plan: SortPlan, scratch: Scratch):
    """Per pass: radix_upsweep (tile digit counts), radix_scan (offsets), radix_scatter. The
    first pass reads the operand itself and, where lanes are contiguous and all of each is
    output, the last pass writes the outputs: no separate key-making or output kernel."""
    from cupy.cuda import runtime

    exprs = _expressions(plan)
    k, kind = plan.ctype, plan.kind
    get = lambda e: function(device, portable.SOURCE, exprs, e)  # noqa: E731
    emit = get(exprs[2])
    scan = get("radix_scan")
    sms = multiprocessors(device)
    total, ks, pay = plan.total, plan.key_bytes, plan.payload
    keys = [scratch.ptr("keys"), scratch.ptr("keys", total * ks)]
    pays = [scratch.ptr("payload"), scratch.ptr("payload", total * 4)] if pay else [NULL, NULL]
    hist, totals = scratch.ptr("hist"), scratch.ptrs["totals"]
    passes = len(plan.passes)
    nbytes_totals = 256 * 4 * passes
    tiles = np.uint32(plan.tiles)
    i64 = np.int64
    u_total, n_, inner_, flags_ = np.uint32(total), i64(plan.n), i64(plan.inner), np.int32(plan.flags)
    g_out = grid(plan.lanes * plan.kout, sms)
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
        values, indices = portable.outputs(plan.op, outs)
        runtime.memsetAsync(totals, 0, nbytes_totals, stream.ptr)
        cur = 0  # pass p reads keys[1 - cur] (pass 0: x) and writes keys[cur]
        for i, (shift, lane_pass) in enumerate(plan.passes):
            first, last = i == 0, i == passes - 1
            up_name, sc_name = launches[i]
            src_k, src_p, src_x = (NULL, NULL, x) if first else (keys[1 - cur], pays[1 - cur], NULL)
            tot = np.uint64(totals + 256 * 4 * i)
            launch(kernels_[up_name], up_name, (plan.tiles,), (BLOCK,),
                   (src_k, src_p, src_x, u_total, n_, inner_, np.int32(shift), flags_, hist, tot, tiles))
            launch(scan, "radix_scan", (256,), (1024,), (hist, tot, tiles))
            out_v, out_i = (values, indices) if last and fused else (NULL, NULL)
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


def _second_sort(device: "Device", plan: SortPlan, scratch: Scratch, _unused: Any):
    """topk(sorted=False) on the radix path: re-sort the selected flat indices (u32 keys)."""
    from cupy.cuda import runtime

    exprs = _expressions(plan)
    u32 = _expressions(SortPlan("sort", "radix", np.dtype(np.uint32), 1, 1, 1, 1, 0))
    take = function(device, portable.SOURCE, exprs, "radix_take_prefix")
    emit_flat = function(device, portable.SOURCE, exprs, f"radix_emit_flat<{plan.ctype}>")
    up_name = _upsweep_name("unsigned int", 0, False, False)
    sc_name = _scatter_name("unsigned int", 0, False, False, False, False)
    up = function(device, portable.SOURCE, u32, up_name)
    sc = function(device, portable.SOURCE, u32, sc_name)
    scan = function(device, portable.SOURCE, u32, "radix_scan")
    sms = multiprocessors(device)
    m = plan.lanes * plan.kout
    flat = [scratch.ptr("flat"), scratch.ptr("flat", m * 4)]
    hist, totals = scratch.ptr("hist2"), scratch.ptrs["totals2"]
    tiles = np.uint32(plan.tiles2)
    launch, stream = device.launch, device.stream
    g = grid(m, sms)

    def run(x, values, indices, final_pay):
        runtime.memsetAsync(totals, 0, 256 * 4 * plan.passes2, stream.ptr)
        launch(take, "radix_take_prefix", g, (BLOCK,),
               (final_pay, flat[0], np.int64(plan.lanes), np.int64(plan.n), np.int64(plan.kout)))
        cur = 0
        for i in range(plan.passes2):
            tot = np.uint64(totals + 256 * 4 * i)
            launch(up, up_name, (plan.tiles2,), (BLOCK,),
                   (flat[cur], NULL, NULL, np.uint32(m), np.int64(1), np.int64(1), np.int32(8 * i), np.int32(0),
                    hist, tot, tiles))
            launch(scan, "radix_scan", (256,), (1024,), (hist, tot, tiles))
            launch(sc, sc_name, (plan.tiles2,), (BLOCK,),
                   (flat[cur], NULL, NULL, flat[1 - cur], NULL, NULL, NULL, NULL, np.uint32(m), np.int64(1),
                    np.int64(1), np.int32(8 * i), np.int32(0), hist, tiles))
            cur = 1 - cur
        launch(emit_flat, f"radix_emit_flat<{plan.ctype}>", g, (BLOCK,),
               (flat[cur], x, values, indices, np.int64(plan.lanes), np.int64(plan.n), np.int64(plan.inner),
                np.int64(plan.kout), np.int32(plan.flags)))

    return run
