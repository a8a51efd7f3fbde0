"""sort, argsort and topk through ``cu/sort.cu``: the plan of an instance, its scratch, the
bitonic launch.

Two paths (see the CUDA source for the algorithms):

``rows`` (``sort_rows``) -- a bitonic network per lane, one block per lane, over
P = next_pow2(N) (key, index) pairs. Its scratch ``pairs`` (P * (4 + key bytes) per block) is
declared shared-first: the bufferization policy puts it in shared memory (LDS on HIP) when it
fits, or in global scratch (one slice per block) otherwise; the kernel has code for both.

``radix`` -- an LSD radix sort over all lanes at once (8-bit digits, lanes kept apart by extra
passes over the lane number), for long lanes. Its scratch -- ping-pong keys and payloads, the
digit histograms and per-pass digit totals (or onesweep's look-back words) -- is global only.
Launched by polyhal-cuda only (:mod:`polyhal_cuda.sorting`); a backend without it plans with
``radix=False`` and every instance takes the rows path.

The plan depends only on the op instance and the device (:func:`plan_sort`), so the scratch
declared at compile time (:func:`scratch_requests`) and the kernel bound later always agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from polyhal.errors import ProgramError
from polyhal.hal.scratch import KernelInfo, MemorySpace, Problem, ScratchDecl

from polyhal_gpu.launch import BLOCK, NULL
from polyhal_gpu.scratch import Scratch, shared_limit

#: The CUDA C source, under ``polyhal_gpu/cu/``.
SOURCE = "sort.cu"
#: Flags of the kernels (``flags`` argument).
F_DESC, F_CANON_ZERO, F_VALUES, F_INDICES, F_INDEX_ORDER = 1, 2, 4, 8, 16
#: Unsigned key type of each key width: keys are sorted as their order-preserving bit patterns.
KEY_CTYPE = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}
#: Lanes of at most this many (padded) elements always take the bitonic path.
SMALL_LANE = 4096
#: Sorts of at most this many elements in all take the bitonic path when a lane fits a block.
#: Past it, a few long lanes go to the radix path: one block's bitonic network over 16384 pairs
#: took 199 us on an H100 for NMS's argsort of 10,000 scores, the radix passes 75-107 us.
SMALL_TOTAL = 1 << 12
#: The radix implementations (:attr:`SortPlan.impl`).
RADIX_IMPLS = ("classic", "onesweep")


def key_kind(dtype: Any) -> int:
    """The kernels' key kind: 2 float, 1 signed integer, 0 unsigned integer or bool."""
    kind = np.dtype(dtype).kind
    return 2 if kind == "f" else 1 if kind == "i" else 0


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (2 for n <= 2)."""
    return 1 << max(n - 1, 1).bit_length()


def radix_tile(key_bytes: int) -> int:
    """Keys one classic radix block handles per pass."""
    return BLOCK * (8 if key_bytes >= 8 else 16)


#: The onesweep kernel's tile per (key width, payload): (threads, items per thread, match),
#: ``match`` 0 for ``__match_any_sync`` ranking, 1 for the shared-memory atomicOr of lane bits
#: (measured much faster on an H100). Measured there (16M float32, plugins/cuda/tools/
#: sort_tune.py): 384 x 17 keys per tile (56 registers, three blocks per SM) sorts in 0.44 ms,
#: x 16 0.45, x 12 0.49, x 21 (CUB's shape; 79 registers, two blocks) 0.50; argsort likewise
#: best at x 17 (0.66 ms; x 21 needs 123 registers, one block per SM: 1.00 ms). 8-byte keys
#: take fewer items so that a tile stays in 48 KiB of static shared memory (not tuned).
ONESWEEP_SHAPES = {(1, False): (384, 17, 1), (2, False): (384, 17, 1), (4, False): (384, 17, 1),
                   (8, False): (384, 11, 1), (1, True): (384, 17, 1), (2, True): (384, 17, 1),
                   (4, True): (384, 17, 1), (8, True): (384, 11, 1)}


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
    shape: tuple = ()       # radix onesweep: (threads, items, match) of its kernels

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
        return KEY_CTYPE[self.key_bytes]

    @property
    def kind(self) -> int:
        return key_kind(self.dtype)

    @property
    def total(self) -> int:
        return self.lanes * self.n

    @property
    def pairs_bytes(self) -> int:
        """rows: the (key, index) pairs of one lane, the ``pairs`` scratch of one block."""
        return self.p * (4 + self.key_bytes)

    @property
    def rows_expression(self) -> str:
        """rows: the template instance launched."""
        return f"sort_rows<{self.ctype}, {self.kind}>"


def plan_sort(device: Any, op: str, attrs: dict, x: Any, *, backend: str = "cuda", radix: bool = True,
              force_path: str | None = None, radix_impl: str = "classic",
              onesweep_shapes: dict | None = None) -> SortPlan:
    """The path and parameters of one sort / argsort / topk instance (``attrs`` resolved) of
    operand type ``x`` on ``device``.

    ``radix=False``: the backend launches only the bitonic path, which then takes every lane of
    fewer than 2**31 elements. Otherwise one block per lane is chosen for short lanes, for
    enough lanes to fill the GPU and for small sorts, radix for the rest; ``force_path``
    ("rows" or "radix") overrides the choice (tests), ``radix_impl`` picks the radix
    implementation (:data:`RADIX_IMPLS`) and ``onesweep_shapes`` its tile per (key width, payload) (default
    :data:`ONESWEEP_SHAPES`). ``backend`` names the backend in errors.
    """
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
    p = max(2, next_pow2(n))
    if not radix:
        if n >= 2**31:
            raise ProgramError(f"{op}: lanes of {n} elements; the {backend.upper()} sort handles fewer than 2**31 "
                               "per lane")
        path = "rows"
    else:
        fits = p * (4 + ks) <= shared_limit(device) and n < 2**31
        sms = int(device.spec.limits.get("multiprocessors", 1))
        # One block per lane is right for short lanes, for enough lanes to fill the GPU, and for
        # small sorts (one block's bitonic network beats the radix passes' launch chain there).
        path = "rows" if fits and (p <= SMALL_LANE or lanes >= 2 * sms or lanes * n <= SMALL_TOTAL) else "radix"
        if force_path == "rows" and n < 2**31:
            path = "rows"
        elif force_path == "radix":
            path = "radix"
    if path == "rows":
        return SortPlan(op, "rows", x.dtype, lanes, n, inner, kout, flags | F_CANON_ZERO, p=p,
                        kp=max(2, next_pow2(kout)), threads=min(1024, max(32, p // 2)))
    total = lanes * n
    if total >= 2**32:
        raise ProgramError(f"{op}: {total} elements; the {backend.upper()} radix sort handles fewer than 2**32 at "
                           "once (split the tensor)")
    payload = bool(flags & F_INDICES) or lanes > 1
    if payload:
        flags |= F_CANON_ZERO  # ties of -0.0 and +0.0 must keep index order
    lane_passes = 0 if lanes <= 1 else -(-(lanes - 1).bit_length() // 8)
    passes = tuple((8 * i, False) for i in range(ks)) + tuple((8 * i, True) for i in range(lane_passes))
    tiles2 = passes2 = 0
    if index_order:
        tiles2 = -(-(lanes * kout) // radix_tile(4))
        passes2 = max(1, -(-max(total - 1, 1).bit_length() // 8))
    impl = radix_impl if total < 2**30 else "classic"  # look-back words carry 30-bit counts
    shape: tuple = ()
    if impl == "onesweep":
        shape = tuple((onesweep_shapes or ONESWEEP_SHAPES)[ks, payload])
        tiles = -(-total // (shape[0] * shape[1]))
    else:
        tiles = -(-total // radix_tile(ks))
    return SortPlan(op, "radix", x.dtype, lanes, n, inner, kout, flags, tiles=tiles, passes=passes,
                    payload=payload, tiles2=tiles2, passes2=passes2, impl=impl, shape=shape)


# --------------------------------------------------------------------------------------- scratch

def scratch_decls(plan: SortPlan, backend: str) -> list[tuple[KernelInfo, list[ScratchDecl]]]:
    """The kernels of ``plan`` that have scratch, with their declarations (``backend`` labels them)."""
    if plan.path == "rows":
        kernel = KernelInfo("sort_rows", plan.op, plan.threads, plan.lanes, backend)
        return [(kernel, [ScratchDecl("pairs", shared=True, per_workgroup=plan.pairs_bytes,
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
    return [(KernelInfo("radix_sort", plan.op, BLOCK, 1, backend), decls)]


def scratch_requests(plan: SortPlan, attrs: dict, ins, outs, backend: str) -> tuple:
    """The scratch requests of one instance (what the core's ``Device.scratch`` returns)."""
    problem = Problem(plan.op, attrs, tuple(ins), tuple(outs))
    return tuple(d.request(problem, k) for k, ds in scratch_decls(plan, backend) for d in ds)


# ---------------------------------------------------------------------------------------- launch

def outputs(op: str, outs: tuple) -> tuple[Any, Any]:
    """(values, indices) of the kernels' arguments: the op's outputs, :data:`NULL` where absent."""
    if op == "sort":
        return outs[0], NULL
    if op == "argsort":
        return NULL, outs[0]
    return outs[0], outs[1]


def rows_shared_bytes(plan: SortPlan, scratch: Scratch) -> int:
    """Dynamic shared memory of the ``sort_rows`` launch: the pairs, where they went to shared memory."""
    return plan.pairs_bytes if scratch.spaces["pairs"] is MemorySpace.WORKGROUP else 0


def rows_kernel(plan: SortPlan, function: Any, launch: Callable[..., None], scratch: Scratch) -> Callable[..., None]:
    """``fn(x, *outputs)``: ``function`` (the backend's loaded :attr:`SortPlan.rows_expression`),
    one block per lane, launched through ``launch`` (the device's)."""
    name = plan.rows_expression
    smem = rows_shared_bytes(plan, scratch)
    base = NULL if scratch.spaces["pairs"] is MemorySpace.WORKGROUP else scratch.ptr("pairs")
    grid, block = (plan.lanes,), (plan.threads,)
    fixed = (np.int64(plan.lanes), np.int64(plan.n), np.int64(plan.inner), np.int64(plan.kout),
             np.uint32(plan.p), np.uint32(plan.kp), np.int32(plan.flags), base)
    op = plan.op

    def run(x, *outs):
        values, indices = outputs(op, outs)
        launch(function, name, grid, block, (x, values, indices) + fixed, smem)

    run.kernel_name = name  # type: ignore[attr-defined]
    return run
