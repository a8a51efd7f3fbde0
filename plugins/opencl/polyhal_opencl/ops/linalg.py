"""matmul (numpy semantics, batched with broadcasting), gemm (ONNX) and linear (x @ w + b).

One generator, :func:`_product`, writes every variant; which one an instance gets is decided
when it is prepared, from the device traits and the shapes (:func:`choose`):

* ``gpu128`` / ``gpu64`` (``cl/sgemm.cl``), float32 on GPUs and accelerators: 128x128 (8x8
  per work-item, BK 8) or 64x64 (4x4 per work-item, BK 16) blocks of 256 work-items, float4
  global loads, padded double-buffered local tiles; 128x128 once the product has enough blocks
  to give every compute unit one, 64x64 below that;
* ``cpu_outer`` / ``cpu_dot`` (``cl/sgemm_cpu.cl``, ``cl/sgemm_dot.cl``), float32 on CPU devices (PoCL): no local
  memory but a packed panel of B, explicit SIMD vectors of the device's native width, K blocked
  for L1; ``cpu_dot`` for matrix-vector shapes whose operands are both k-contiguous;
* ``portable`` (``cl/matmul.cl``): every other element type, small or degenerate products,
  devices whose work-groups are too small for the GPU blocks.

``POLYHAL_OPENCL_MATMUL`` (one of the names above) forces a variant where it applies (float32,
K > 0; the GPU variants need 256-work-item groups, ``cpu_dot`` k-contiguous operands), and
``POLYHAL_OPENCL_GPU_BLOCK=BM,BN,BK,TM,TN`` replaces the GPU variants' block shape, for
comparisons and tuning.

pyclblast is not used: PyPI has only its source, which needs the CLBlast C library installed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from polyhal.errors import ConfigError
from polyhal.ops._base import broadcast

from polyhal_opencl.codegen import (
    Arg, CType, DeviceTraits, Launch, Recipe, broadcast_strides, cl_source, collapse, ctype,
    defines, dense_strides, header, index_type, offsets_code, param, prologue, round_up,
)
from polyhal_opencl.settings import MATMUL_VARIANTS, OpenCLSettings

#: Variant names (see the module docstring).
VARIANTS = MATMUL_VARIANTS
#: GPU block configurations: (BM, BN, BK, TM, TN); 256 work-items each. gpu128's BK of 16 came
#: from a sweep on an H100 through NVIDIA's OpenCL (4096² float32: BK 8 gave 26 TFLOP/s, BK 16
#: 33 TFLOP/s, cuBLAS 50; bench/results/opencl_ops-h100.md).
GPU_BLOCKS = {"gpu128": (128, 128, 16, 8, 8), "gpu64": (64, 64, 16, 4, 4)}
#: Local-memory padding of the GPU tiles, in floats (keeps rows 16-byte aligned).
GPU_PAD = 4


def tile_edge(traits: DeviceTraits) -> int:
    """The largest power-of-two work-group edge whose square fits in a work-group (at most 16)."""
    ts = 16
    while ts > 1 and ts * ts > traits.max_work_group_size:
        ts //= 2
    return ts


def register_tile(m: int, n: int, ts: int) -> int:
    """Outputs per work-item per dim: 4 once the product fills 4x4-register blocks, less for
    small products, whose blocks would be mostly padding."""
    edge = min(m, n)
    return 4 if edge >= 4 * ts else 2 if edge >= 2 * ts else 1


def _batch_strides(shape: tuple[int, ...], batch: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides over the broadcast ``batch`` dims of a dense operand of ``shape`` (whose
    last two dims are the matrix): 0 where the operand is broadcast."""
    own = shape[:-2]
    dense = dense_strides(shape)[:-2]
    lead = len(batch) - len(own)
    return tuple(0 if i < lead or own[i - lead] == 1 else dense[i - lead] for i in range(len(batch)))


@dataclass(frozen=True)
class Problem:
    """One product's shape: Y[batch] (m x n) = A (m x k, strides sa) @ B (k x n, strides sb)."""

    m: int
    n: int
    k: int
    nbatch: int
    sa: tuple[int, int]
    sb: tuple[int, int]


def gpu_block(variant: str) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, TM, TN) of a GPU variant; ``POLYHAL_OPENCL_GPU_BLOCK=BM,BN,BK,TM,TN``
    replaces it (for tuning on a new GPU without editing code), checked against what
    ``cl/sgemm.cl`` can run."""
    raw = OpenCLSettings.from_env().gpu_block
    if not raw:
        return GPU_BLOCKS[variant]
    try:
        bm, bn, bk, tm, tn = (int(v) for v in raw.split(","))
    except ValueError:
        raise ConfigError(f"POLYHAL_OPENCL_GPU_BLOCK={raw!r} is not five integers BM,BN,BK,TM,TN",
                          variable="POLYHAL_OPENCL_GPU_BLOCK", value=raw) from None
    threads = (bm // max(tm, 1)) * (bn // max(tn, 1))
    if (min(bm, bn, bk, tm, tn) <= 0 or tm % 4 or tn % 4 or bk % 4 or bm % tm or bn % tn
            or (bm * bk // 4) % threads or (bn * bk // 4) % threads or bm * bk // 4 < threads
            or bn * bk // 4 < threads):
        raise ConfigError(
            f"POLYHAL_OPENCL_GPU_BLOCK={raw!r}: TM, TN and BK must be multiples of 4, BM and BN multiples of TM "
            f"and TN, and each slab's float4 groups (BM*BK/4 and BN*BK/4) a multiple of the "
            f"(BM/TM)*(BN/TN) = {threads} work-items", variable="POLYHAL_OPENCL_GPU_BLOCK", value=raw)
    return bm, bn, bk, tm, tn


def _gpu_fits(traits: DeviceTraits, variant: str) -> bool:
    bm, bn, bk, tm, tn = gpu_block(variant)
    local = 2 * bk * (bm + bn + 2 * GPU_PAD) * 4
    return traits.max_work_group_size >= (bm // tm) * (bn // tn) and traits.local_mem_size >= local


def choose(t: CType, out: CType, p: Problem, traits: DeviceTraits) -> str:
    """The variant for one instance (see the module docstring)."""
    if t.store != "float" or out.store != "float" or p.k == 0 or p.m * p.n * p.nbatch == 0:
        return "portable"
    dot = p.sa[1] == 1 and p.sb[0] == 1  # both operands k-contiguous: what cpu_dot reads
    forced = OpenCLSettings.from_env().matmul
    if forced is not None:
        if forced in GPU_BLOCKS and not _gpu_fits(traits, forced):
            return "portable"
        return "cpu_outer" if forced == "cpu_dot" and not dot else forced
    if traits.is_cpu:
        # The outer kernel packs B, so it reads a transposed B well too; dot products win only
        # for matrix-vector shapes, where there is no panel to reuse.
        return "cpu_dot" if dot and min(p.m, p.n) < 8 else "cpu_outer"
    if p.m < 32 or p.n < 32:
        return "portable"
    blocks128 = -(-p.m // 128) * -(-p.n // 128) * p.nbatch
    if p.m >= 128 and p.n >= 128 and blocks128 >= traits.compute_units and _gpu_fits(traits, "gpu128"):
        return "gpu128"
    return "gpu64" if _gpu_fits(traits, "gpu64") else "portable"


def _product(t: CType, out: CType, *, m: int, n: int, k: int, batch: tuple[int, ...],
             a_strides: tuple[int, int], b_strides: tuple[int, int], a_batch, b_batch,
             result: str, c: CType | None, traits: DeviceTraits, plain: bool = False) -> Recipe:
    """The recipe of Y = A @ B (+ what ``result`` adds) in the variant :func:`choose` picks.
    ``plain``: ``result`` stores ``v`` unchanged (vector stores may be used)."""
    nbatch = math.prod(batch)
    if m * n * nbatch == 0:
        return Recipe("")
    p = Problem(m, n, k, nbatch, tuple(a_strides), tuple(b_strides))
    variant = choose(t, out, p, traits)
    bshape, (abs_, bbs) = collapse(batch, [a_batch, b_batch])
    names = [("a", t.store, True), ("b", t.store, True)] + ([("c", c.store, True)] if c else []) + [("y", out.store, False)]
    common = (
        header(t, out)
        + defines(M=m, N=n, K=k, SAM=a_strides[0], SAK=a_strides[1], SBK=b_strides[0], SBN=b_strides[1])
        + "#define PARAMS " + ", ".join(param(nm, st, cst) for nm, st, cst in names) + "\n"
        + "#define PROLOGUE " + prologue(*names).replace("\n", " ") + "\n"
        + "#define BATCH_OFFSETS " + offsets_code("bat", bshape, [abs_, bbs], ["abat", "bbat"], "long").replace("\n", " ") + "\n"
        + f"#define RESULT {result}\n"
    )
    args = tuple(Arg(i) for i in range(len(names)))
    # Offsets within one matrix (batch offsets are long everywhere).
    it = index_type(m * max(abs(a_strides[0]), 1) + k * abs(a_strides[1]),
                    k * max(abs(b_strides[0]), 1) + n * abs(b_strides[1]), m * n)
    ts = tile_edge(traits)
    rt = register_tile(m, n, ts)
    acc = t.unsigned if t.kind in "iu" else t.compute  # unsigned: integer products wrap as numpy's
    portable = Recipe(
        common
        + defines(TS=ts, RT=rt, TK=16, CT=t.compute, ACC=acc)
        + f"#define LOAD_A(i) {t.load('a', 'i')}\n#define LOAD_B(i) {t.load('b', 'i')}\n"
        + f"#define MUL(x, y) (({acc})(x) * ({acc})(y))\n"
        + cl_source("matmul.cl"),
        [Launch("matmul", (round_up(n, ts * rt) // rt, round_up(m, ts * rt) // rt, nbatch), (ts, ts, 1), args)])
    if variant == "portable":
        return portable
    recipe = _tuned(variant, common, args, t, m, n, k, nbatch, a_strides, b_strides, it, plain, traits)
    # kernels.prepare builds the portable kernel instead should a driver's compiler reject this one.
    recipe.fallback = portable
    return recipe


def _tuned(variant: str, common: str, args: tuple[Arg, ...], t: CType, m: int, n: int, k: int, nbatch: int,
           a_strides: tuple[int, int], b_strides: tuple[int, int], it: str, plain: bool,
           traits: DeviceTraits) -> Recipe:
    """The recipe of a float32 variant (``gpu128``, ``gpu64``, ``cpu_outer``, ``cpu_dot``)."""
    if variant in GPU_BLOCKS:
        bm, bn, bk, tm, tn = gpu_block(variant)
        a_kmaj, b_nmaj = a_strides[1] == 1, b_strides[1] == 1
        a_vec = a_strides[0] % 4 == 0 if a_kmaj else (a_strides[0] == 1 and a_strides[1] % 4 == 0)
        b_vec = b_strides[0] % 4 == 0 if b_nmaj else (b_strides[0] == 1 and b_strides[1] % 4 == 0)
        source = (common + defines(BM=bm, BN=bn, BK=bk, TM=tm, TN=tn, PAD=GPU_PAD, A_KMAJ=a_kmaj, B_NMAJ=b_nmaj,
                                   A_VEC=a_vec, B_VEC=b_vec, EVEN_M=m % bm == 0, EVEN_N=n % bn == 0,
                                   EVEN_K=k % bk == 0, IT=it, PLAIN=plain)
                  + cl_source("sgemm.cl"))
        gsize = (round_up(n, bn) // tn, round_up(m, bm) // tm, nbatch)
        return Recipe(source, [Launch("matmul", gsize, (bn // tn, bm // tm, 1), args)])
    vw = min(max(next_pow2_clamped(traits.vector_width), 4), 16)
    fma = "fma(a, b, c)" if traits.fma else "mad(a, b, c)"
    if variant == "cpu_dot":
        rm = rn = 4 if vw >= 16 else 3
        rm, rn = min(rm, m), min(rn, n)
        source = (common + defines(VW=vw, RM=rm, RN=rn, IT=it)
                  + f"#define FMA(a, b, c) {fma}\n" + cl_source("sgemm_dot.cl"))
        gsize = (-(-n // rn), -(-m // rm), nbatch)
    else:
        nv = 2 if n > vw else 1
        rm = min(8 if vw >= 16 else 6, m)
        # Row blocks of up to 16 * RM rows, fewer while that leaves the cores short of work.
        q = min(16, -(-m // rm))
        cols = -(-n // (vw * nv))
        while q > 1 and cols * -(-m // (rm * q)) * nbatch < 4 * traits.compute_units:
            q //= 2
        kc = k if k <= 192 else 128  # the packed KC x NW panel of B: at most 24 KiB, in L1
        source = (common + defines(VW=vw, NV=nv, RM=rm, MB=rm * q, KC=kc, IT=it, PLAIN=plain)
                  + f"#define FMA(a, b, c) {fma}\n" + cl_source("sgemm_cpu.cl"))
        gsize = (cols, -(-m // (rm * q)), nbatch)
    return Recipe(source, [Launch("matmul", gsize, (1, 1, 1), args)])


def next_pow2_clamped(n: int) -> int:
    """The largest power of two <= ``n`` (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n.bit_length() - 1)


def matmul(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """numpy.matmul: 1-D operands become a row (a) or a column (b); batch dims broadcast."""
    a, b = in_types
    t = ctype(a.dtype, traits, op)
    a2 = a.shape if a.rank > 1 else (1,) + a.shape
    b2 = b.shape if b.rank > 1 else b.shape + (1,)
    batch = broadcast(a2[:-2], b2[:-2])
    (m, k), n = a2[-2:], b2[-1]
    sa, sb = dense_strides(a2), dense_strides(b2)
    return _product(t, t, m=m, n=n, k=k, batch=batch, a_strides=(sa[-2], sa[-1]), b_strides=(sb[-2], sb[-1]),
                    a_batch=_batch_strides(a2, batch), b_batch=_batch_strides(b2, batch),
                    result=t.store_stmt("y", "yo", "v"), c=None, traits=traits, plain=True)


def gemm(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """alpha * op(A) @ op(B) + beta * C: transposes are stride swaps, C broadcasts by zero strides."""
    a, b = in_types[:2]
    c = in_types[2] if len(in_types) > 2 else None
    y = out_types[0]
    t = ctype(a.dtype, traits, op)
    (m, n), k = y.shape, (a.shape[0] if attrs["trans_a"] else a.shape[1])
    sa, sb = dense_strides(a.shape), dense_strides(b.shape)
    a_strides = (sa[1], sa[0]) if attrs["trans_a"] else (sa[0], sa[1])
    b_strides = (sb[1], sb[0]) if attrs["trans_b"] else (sb[0], sb[1])
    value = f"{t.lit(float(attrs['alpha']))} * v"
    if c is not None:
        scm, scn = broadcast_strides(c.shape, (m, n))
        value += f" + {t.lit(float(attrs['beta']))} * {t.load('c', f'(long)m * {scm} + (long)n * {scn}')}"
    plain = c is None and float(attrs["alpha"]) == 1.0
    return _product(t, t, m=m, n=n, k=k, batch=(), a_strides=a_strides, b_strides=b_strides, a_batch=(),
                    b_batch=(), result=t.store_stmt("y", "yo", value), c=t if c is not None else None,
                    traits=traits, plain=plain)


def linear(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """x @ w + b with the leading dims of x flattened into M (x is dense): the bias is added as
    each result is stored, so the result is written once."""
    x, w, b = in_types
    t = ctype(x.dtype, traits, op)
    k, n = w.shape
    m = x.size // k if k else math.prod(x.shape[:-1])
    bias = t.load("c", f"(long)n * {1 if b.shape == (n,) and n > 1 else 0}")
    return _product(t, t, m=m, n=n, k=k, batch=(), a_strides=(k, 1), b_strides=(n, 1), a_batch=(), b_batch=(),
                    result=t.store_stmt("y", "yo", f"v + {bias}"), c=t, traits=traits)


GENERATORS = {"matmul": matmul, "gemm": gemm, "linear": linear}
