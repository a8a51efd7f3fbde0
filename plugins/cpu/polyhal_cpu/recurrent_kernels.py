"""Recurrent layers on the CPU: ``rnn``, ``gru`` and ``lstm`` (:mod:`polyhal.ops.recurrent`), one
kernel per layer running the whole sequence.

Per direction, the input projection of every step is one GEMM (``x W^T`` over ``seq * batch``
rows, numpy's BLAS), into planned scratch; then one compiled loop (:mod:`polyhal_cpu.recurrent_loops`)
runs the steps: the recurrent product as a GEMM per step and one pass over the gates, writing
``y`` and the final states in place. Unrolled into a dozen ops per step, the same layers cost
7-17x onnxruntime's time (issue 32); the step is now one BLAS call and a loop with no Python in it.

oneDNN's RNN primitives were not taken: they have no sequence lengths, no clip and no other
activations than the defaults, which ONNX models use, so a second path would serve only part
of the op. With numba disabled (``POLYHAL_CPU_NATIVE=0``) or missing, the same loops run as
Python over numpy (slow, but the same arithmetic).

float16 layers run as float32 (:func:`~polyhal_cpu.table.float16_via_float32`).
"""

from __future__ import annotations

import numpy as np

from polyhal.errors import ProgramError
from polyhal.hal.scratch import MemorySpace, Problem, ScratchDecl
from polyhal.ops.recurrent import ACTIVATIONS, DEFAULT_ACTIVATIONS, GATES, resolve_activations
from polyhal_cpu import scratch as cpu_scratch
from polyhal_cpu.parallel import run as run_tasks
from polyhal_cpu.settings import CPUSettings
from polyhal_cpu.table import TABLE, Kernel, Types, float16_via_float32, frozen

__all__ = ["build_recurrent"]

_CODES = {name: i for i, name in enumerate(ACTIVATIONS)}
#: Multiply-adds of a step's recurrent GEMM from which it runs as numpy's BLAS between calls of
#: the loop, a step at a time, instead of inside it: numba's ``np.dot`` goes to scipy's OpenBLAS,
#: which took 2.2x numpy's time for 8 x 128 @ 128 x 512 on the 2-core VM (both on one thread),
#: while a step's call from Python costs ~2 µs, which only small steps notice.
STEP_GEMM_MACS = 1 << 17
#: Multiply-adds of a direction from which a bidirectional layer runs its directions on two
#: threads: a hand-off to the pool costs ~30-80 µs on the 2-core VM, which a 16 x 8 x 16 -> 32
#: LSTM (0.8 M multiply-adds a direction) did not win back (0.32 -> 0.55 ms).
PARALLEL_MACS = 1 << 21
_loops = None


def _native():
    """The compiled loops module, or None (numba missing or disabled by ``POLYHAL_CPU_NATIVE=0``)."""
    global _loops
    if not CPUSettings.from_env().native:
        return None
    if _loops is None:
        from polyhal_cpu.threads import budget, configure_numba

        configure_numba()
        try:
            from polyhal_cpu import recurrent_loops
        except ImportError:
            _loops = False
        else:
            _loops = recurrent_loops
            budget().refresh()  # numba's np.dot loads scipy's BLAS, with a pool of its own: limit it too
    return _loops or None


def _loop(op: str):
    loops = _native()
    if loops is not None:
        return getattr(loops, op)
    from polyhal_cpu import recurrent_loops  # numba's dispatcher keeps the Python function

    return getattr(recurrent_loops, op).py_func


def _sizes(problem: Problem) -> tuple[int, int, int, int, int]:
    """(seq, batch, hidden, gates, itemsize at least float32's, times the directions: each
    direction has scratch of its own, as they run at once) of an instance."""
    seq, batch, _ = problem.in_types[0].shape
    hidden = problem.in_types[2].shape[-1]
    dirs = problem.in_types[2].shape[0]
    return seq, batch, hidden, GATES[problem.op], max(problem.in_types[0].dtype.itemsize, 4) * dirs


def _by_step(op: str, batch: int, hidden: int, linear_before_reset: bool) -> bool:
    """Whether the steps' recurrent GEMMs run as numpy's BLAS from Python (see STEP_GEMM_MACS).
    GRU without linear_before_reset takes two GEMMs a step, around its reset gate: in the loop."""
    return batch * GATES[op] * hidden * hidden >= STEP_GEMM_MACS and (op != "gru" or linear_before_reset)


def _weights_bytes(problem: Problem, _wg: int) -> int:
    """The transposed recurrent weights (every direction), for the steps run a step at a time."""
    _, batch, hidden, gates, item = _sizes(problem)
    if not _by_step(problem.op, batch, hidden, bool(problem.attrs.get("linear_before_reset", 0))):
        return 0
    return gates * hidden * hidden * item


def _projection_bytes(problem: Problem, _wg: int) -> int:
    seq, batch, hidden, gates, item = _sizes(problem)
    return seq * batch * gates * hidden * item


def _steps_bytes(problem: Problem, _wg: int) -> int:
    _, batch, hidden, gates, item = _sizes(problem)
    return (batch * gates * hidden + 2 * batch * hidden + 2 * gates * hidden) * item


_SCRATCH = (
    ScratchDecl("projection", shared=True, per_launch=_projection_bytes, spaces=(MemorySpace.GLOBAL,), alignment=64,
                purpose="the input projection x W^T of every step of one direction"),
    ScratchDecl("steps", shared=True, per_launch=_steps_bytes, spaces=(MemorySpace.GLOBAL,), alignment=64,
                purpose="a step's recurrent product, GRU's reset rows, the summed biases"),
    ScratchDecl("weights", shared=True, per_launch=_weights_bytes, spaces=(MemorySpace.GLOBAL,), alignment=64,
                purpose="R^T of every direction, for recurrent GEMMs run by numpy's BLAS"),
)


@TABLE.register("rnn", "gru", "lstm", scratch=_SCRATCH)
@float16_via_float32
def build_recurrent(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel | None:
    """``fn(x, w, r, b, lens, h0, [c0, p], y, y_h, [y_c])``."""
    dt = ins[0].dtype
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        return None
    seq, batch, features = ins[0].shape
    hidden, gates = ins[2].shape[-1], GATES[op]
    width = gates * hidden
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
    # Each direction's own scratch: a bidirectional layer runs its two directions at once.
    projections = cpu_scratch.array(scratch, "projection", dt, (dirs, seq * batch, width))
    steps = cpu_scratch.array(scratch, "steps", dt, (dirs, batch * width + 2 * batch * hidden + 2 * width))
    products = steps[:, :batch * width].reshape(dirs, batch, width)
    rows = steps[:, batch * width:batch * width + 2 * batch * hidden].reshape(dirs, 2, batch, hidden)
    biases = steps[:, batch * width + 2 * batch * hidden:][:, :bias_width]
    linear_before_reset = bool(attrs.get("linear_before_reset", 0))
    by_step = _by_step(op, batch, hidden, linear_before_reset)
    transposed = cpu_scratch.array(scratch, "weights", dt, (dirs, hidden, width)) if by_step else None
    held: list = [None, None]  # (weights array, its transpose) for weights nothing can write
    parallel = seq * batch * width * (hidden + features) >= PARALLEL_MACS

    def recurrent_weights(r):
        """R^T per direction, contiguous: kept while the same read-only weights come back."""
        if held[0] is r:
            return held[1]
        if frozen(r):
            held[0], held[1] = r, np.ascontiguousarray(r.transpose(0, 2, 1))
            return held[1]
        np.copyto(transposed, r.transpose(0, 2, 1))
        return transposed

    def kernel(x, w, r, b, lens, h0, *rest):
        if lens.size and (lens.min() < 0 or lens.max() > seq):
            raise ProgramError(f"{op}: sequence lengths must be from 0 to {seq} (the sequence's length), got "
                               f"{lens.tolist()}")
        if op == "lstm":
            c0, p, y, y_h, y_c = rest
        else:
            y, y_h = rest
        rt = recurrent_weights(r) if by_step else None

        def one_direction(d: int) -> None:
            projection, bias, product = projections[d], biases[d], products[d]
            xw = projection.reshape(seq, batch, width)
            np.matmul(x.reshape(seq * batch, features), w[d].T, out=projection)
            if op == "gru":
                bias[:] = b[d]
            else:
                np.add(b[d, :width], b[d, width:], out=bias)
            h = y_h[d]
            h[...] = h0[d]
            reverse = direction == "reverse" or d == 1
            head = (xw, bias, r[d], lens, h, y, d, reverse, codes[d], alpha[d], beta[d], clip)
            if op == "lstm":
                y_c[d] = c0[d]
                tail = (product, p[d], y_c[d])
            elif op == "gru":
                tail = (product, rows[d, 0], rows[d, 1], linear_before_reset)
            else:
                tail = (product,)
            if by_step:
                for step in range(seq):
                    np.matmul(h, rt[d], out=product)
                    loop(*head, step, 1, False, *tail)
            else:
                loop(*head, 0, seq, True, *tail)

        if dirs == 2 and parallel:  # the directions write disjoint parts of y, y_h, y_c: on two threads
            run_tasks([lambda: one_direction(0), lambda: one_direction(1)])
        else:
            for d in range(dirs):
                one_direction(d)
    return kernel
