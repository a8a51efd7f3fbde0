"""Recurrent layers on the CPU: ``rnn``, ``gru`` and ``lstm`` (:mod:`polyhal.ops.recurrent`), one
kernel per layer running the whole sequence.

Per direction, one compiled loop (:mod:`polyhal_cpu.recurrent_loops`) runs every step, calling
numpy's BLAS itself: ``x W^T`` for every step as one GEMM first, then per step ``h R^T`` added
to the step's rows (GRU: two products around its reset gate), then one pass over the gates,
writing ``y`` and the final states in place. Batch rows are independent, so a large layer's
directions and blocks of rows run on the pool's threads at once, each to the end of the
sequence with no hand-off between steps (onnxruntime's LSTM cuts its batch the same way).
Unrolled into a dozen ops per step, the same layers cost 7-17x onnxruntime's time (issue 32).

oneDNN's RNN primitives were not taken: they have no sequence lengths, no clip and no other
activations than the defaults, which ONNX models use, so a second path would serve only part
of the op. With numba disabled (``POLYHAL_CPU_NATIVE=0``) the same loops run as Python over
numpy (slow, but the same arithmetic).

float16 layers run as float32 (:func:`~polyhal_cpu.table.float16_via_float32`).
"""

from __future__ import annotations

from functools import partial

import numpy as np

from polyhal.errors import ProgramError
from polyhal.hal.scratch import MemorySpace, Problem, ScratchDecl
from polyhal.ops.recurrent import ACTIVATIONS, DEFAULT_ACTIVATIONS, GATES, resolve_activations
from polyhal_cpu import queue_layout as layout
from polyhal_cpu import scratch as cpu_scratch
from polyhal_cpu.parallel import blocks, float_bits, threads
from polyhal_cpu.parallel import run as run_tasks
from polyhal_cpu.settings import CPUSettings
from polyhal_cpu.table import TABLE, Kernel, Types, float16_via_float32, frozen
from polyhal_cpu.threads import budget

__all__ = ["build_recurrent"]

_CODES = {name: i for i, name in enumerate(ACTIVATIONS)}
#: Multiply-adds of a direction from which a layer runs on the pool's threads (its directions,
#: then blocks of batch rows, at once): a hand-off to the pool costs ~30-80 µs on the 2-core VM,
#: which a 16 x 8 x 16 -> 32 LSTM (0.8 M multiply-adds a direction) did not win back (0.32 ->
#: 0.55 ms).
PARALLEL_MACS = 1 << 21
_loops = None


def _native():
    """The compiled loops module, or None (numba missing or disabled by ``POLYHAL_CPU_NATIVE=0``)."""
    global _loops
    if not CPUSettings.from_env().native:
        return None
    if _loops is None:
        from polyhal_cpu.threads import configure_numba

        configure_numba()
        try:
            from polyhal_cpu import recurrent_loops
        except ImportError:
            _loops = False
        else:
            _loops = recurrent_loops
            budget().refresh()  # a BLAS loaded since (scipy's, by numba) is held to the budget too
    return _loops or None


def _loop(op: str):
    loops = _native()
    if loops is not None:
        return getattr(loops, op)
    from polyhal_cpu import recurrent_loops  # numba's dispatcher keeps the Python function

    return getattr(recurrent_loops, op).py_func


def _sizes(problem: Problem) -> tuple[int, int, int, int, int]:
    """(batch, features, hidden, gates, itemsize at least float32's, times the directions: each
    direction has scratch of its own, as they run at once) of an instance."""
    _, batch, features = problem.in_types[0].shape
    hidden = problem.in_types[2].shape[-1]
    dirs = problem.in_types[2].shape[0]
    return batch, features, hidden, GATES[problem.op], max(problem.in_types[0].dtype.itemsize, 4) * dirs


def _weights_bytes(problem: Problem, _wg: int) -> int:
    """``[W^T; R^T]`` of every direction, for weights a plan's input may change."""
    _, features, hidden, gates, item = _sizes(problem)
    return (features + hidden) * gates * hidden * item


def _projection_bytes(problem: Problem, _wg: int) -> int:
    seq = problem.in_types[0].shape[0]
    batch, _, hidden, gates, item = _sizes(problem)
    return seq * batch * gates * hidden * item


def _inputs_bytes(problem: Problem, _wg: int) -> int:
    seq = problem.in_types[0].shape[0]
    batch, features, _, _, item = _sizes(problem)
    return seq * batch * features * item


def _steps_bytes(problem: Problem, _wg: int) -> int:
    batch, _, hidden, gates, item = _sizes(problem)
    return (2 * batch * hidden + 2 * gates * hidden) * item


_SCRATCH = (
    ScratchDecl("projection", shared=True, per_launch=_projection_bytes, spaces=(MemorySpace.GLOBAL,), alignment=64,
                purpose="x W^T of every step, by blocks of batch rows"),
    ScratchDecl("inputs", shared=True, per_launch=_inputs_bytes, spaces=(MemorySpace.GLOBAL,), alignment=64,
                purpose="a block of batch rows' x at every step, gathered for its input product"),
    ScratchDecl("steps", shared=True, per_launch=_steps_bytes, spaces=(MemorySpace.GLOBAL,), alignment=64,
                purpose="GRU's reset * h and h Rh^T rows, the summed biases"),
    ScratchDecl("weights", shared=True, per_launch=_weights_bytes, spaces=(MemorySpace.GLOBAL,), alignment=64,
                purpose="[W^T; R^T] of every direction, for weights a plan's input may change"),
)


def _descriptor(dtype: np.dtype) -> np.ndarray:
    """A GEMM descriptor (:mod:`polyhal_cpu.queue_layout`) with numpy's cblas_sgemm (and
    cblas_sgemv) for the loops to fill and call; all zeros (the loops' own product) for float64
    or where there is no BLAS to call."""
    from polyhal_cpu import blas

    desc = np.zeros(layout.G_FIELDS, np.int64)
    found = blas.gemm_address() if dtype == np.dtype(np.float32) else None
    if found is not None:
        desc[layout.G_FN], desc[layout.G_WIDE], desc[layout.G_GEMV] = found
        desc[layout.G_TA] = desc[layout.G_TB] = 111  # no transpose
        desc[layout.G_ALPHA], desc[layout.G_BETA] = float_bits(1.0), float_bits(0.0)
    return desc


@TABLE.register("rnn", "gru", "lstm", scratch=_SCRATCH)
@float16_via_float32
def build_recurrent(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel | None:
    """``fn(x, w, r, b, lens, h0, [c0, p], y, y_h, [y_c])``."""
    dt = ins[0].dtype
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        return None
    seq, batch, features = ins[0].shape
    hidden, gates = ins[2].shape[-1], GATES[op]
    width, depth = gates * hidden, features + hidden
    direction = attrs["direction"]
    dirs = 2 if direction == "bidirectional" else 1
    acts = resolve_activations(op, direction, attrs["activations"], attrs["activation_alpha"],
                               attrs["activation_beta"])
    per_dir = len(DEFAULT_ACTIVATIONS[op])
    codes = np.array([_CODES[a[0]] for a in acts], np.int64).reshape(dirs, per_dir)
    alpha = np.array([a[1] for a in acts], np.float64).reshape(dirs, per_dir)
    beta = np.array([a[2] for a in acts], np.float64).reshape(dirs, per_dir)
    clip = float(attrs["clip"])
    loop = _loop(op)
    bias_width = 2 * width if op == "gru" else width
    # Each direction's own scratch: a layer's directions run at once. A block of rows lo:hi
    # has rows seq * lo to seq * hi of its direction's projection and gathered inputs.
    steps = cpu_scratch.array(scratch, "steps", dt, (dirs, 2 * batch * hidden + bias_width))
    resets = steps[:, :batch * hidden].reshape(dirs, batch, hidden)
    products = steps[:, batch * hidden:2 * batch * hidden].reshape(dirs, batch, hidden)
    biases = steps[:, 2 * batch * hidden:]
    fused = cpu_scratch.array(scratch, "weights", dt, (dirs, depth, width))
    projections = cpu_scratch.array(scratch, "projection", dt, (dirs, seq * batch, width))
    inputs = cpu_scratch.array(scratch, "inputs", dt, (dirs, seq * batch, features))
    held: list = [None, None, None]  # (w, r, [W^T; R^T]) for weights nothing can write
    linear_before_reset = bool(attrs.get("linear_before_reset", 0))
    # The directions first, then blocks of rows, on the pool's threads (each piece its own
    # descriptor: the loops write the operands' addresses into it). While other processes hold
    # the budget's CPUs (one thread active) the directions run whole, one after another.
    n = threads() if seq * batch * width * depth >= PARALLEL_MACS else 1
    pieces = [(d, lo, hi, _descriptor(dt)) for d in range(dirs) for lo, hi in blocks(batch, max(1, n // dirs))]
    whole = [(d, 0, batch, pieces[0][3]) for d in range(dirs)] if batch else []
    state = budget()

    def weights(w, r):
        """``[W^T; R^T]`` per direction, contiguous: kept while the same read-only weights come back."""
        if held[0] is w and held[1] is r:
            return held[2]
        out = fused
        if frozen(w) and frozen(r):
            out = np.empty((dirs, depth, width), dt)
            held[0], held[1], held[2] = w, r, out
        out[:, :features] = w.transpose(0, 2, 1)
        out[:, features:] = r.transpose(0, 2, 1)
        return out

    def kernel(x, w, r, b, lens, h0, *rest):
        if lens.size and (lens.min() < 0 or lens.max() > seq):
            raise ProgramError(f"{op}: sequence lengths must be from 0 to {seq} (the sequence's length), got "
                               f"{lens.tolist()}")
        if op == "lstm":
            c0, p, y, y_h, y_c = rest
            y_c[...] = c0
        else:
            y, y_h = rest
        y_h[...] = h0
        wt = weights(w, r)
        if op == "gru":
            biases[...] = b
        else:
            np.add(b[:, :width], b[:, width:], out=biases)
        x = np.ascontiguousarray(x)

        def piece(d: int, lo: int, hi: int, desc: np.ndarray) -> None:
            reverse = direction == "reverse" or d == 1
            if op == "lstm":
                tail = (p[d], y_c[d])
            elif op == "gru":
                tail = (linear_before_reset,)
            else:
                tail = ()
            loop(x, wt[d], biases[d], lens, y_h[d], y, d, reverse, codes[d], alpha[d], beta[d], clip, lo, hi,
                 inputs[d, seq * lo:seq * hi], projections[d, seq * lo:seq * hi].reshape(seq, hi - lo, width),
                 resets[d, lo:hi], products[d, lo:hi], desc, *tail)

        if n > 1 and len(pieces) > 1 and state.active > 1:  # the pieces write disjoint rows of y, y_h, y_c
            run_tasks([partial(piece, *args) for args in pieces])
        else:
            for args in whole:
                piece(*args)
    return kernel
