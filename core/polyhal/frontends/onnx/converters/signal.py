"""DFT as a matmul with a constant transform matrix.

A DFT along one axis is a fixed real-linear map from the input's (real, imaginary) pairs to the
output's, whatever the variant (forward, inverse, one-sided, real-to-complex, complex-to-real,
padded or truncated to ``dft_length``). The importer computes that map once, by transforming
each unit input with numpy's FFT, and emits transposes around one ``matmul``.
"""

from __future__ import annotations

import numpy as np

from polyhal.frontends.onnx.converters.context import NodeContext
from polyhal.frontends.onnx.converters.registry import converter
from polyhal.frontends.onnx.converters.tensor import norm_axis, reshape
from polyhal.frontends.onnx.errors import OnnxModelError, OnnxUnsupportedError


def dft_matrix(length: int, components: int, n: int, *, inverse: bool, onesided: bool) -> tuple[np.ndarray, int, int]:
    """(T, out_length, out_components): ``T`` maps ``[length, components]`` flattened to the
    output ``[out_length, out_components]`` flattened."""
    def transform(signal: np.ndarray) -> np.ndarray:
        signal = np.pad(signal, (0, max(n - length, 0)))[:n] if not (inverse and onesided) else signal
        if inverse and onesided:
            return np.fft.irfft(signal, n=n)  # one-sided spectrum -> real signal
        y = np.fft.ifft(signal, n=n) if inverse else np.fft.fft(signal, n=n)
        return y[: n // 2 + 1] if onesided and not inverse else y

    probe = transform(np.zeros(length, complex))
    out_len = probe.shape[0]
    out_components = 1 if inverse and onesided else 2
    t = np.zeros((length * components, out_len * out_components))
    for pos in range(length):
        for comp in range(components):
            unit = np.zeros(length, complex)
            unit[pos] = 1j if comp else 1.0
            y = transform(unit)
            row = np.stack([y.real, y.imag], -1) if out_components == 2 else np.real(y)[:, None]
            t[pos * components + comp] = row.reshape(-1)
    return t, out_len, out_components


@converter("DFT")
def _dft(ctx: NodeContext) -> list:
    x = ctx.input(0)
    rank = ctx.rank(x)
    shape = ctx.shape(x)
    if rank < 2 or shape[-1] not in (1, 2):
        raise OnnxModelError(f"DFT input must end in a dim of 1 (real) or 2 (complex), got shape {list(shape)}")
    if ctx.dtype(x).kind != "f":
        raise OnnxUnsupportedError(f"DFT of {ctx.dtype(x)}")
    if ctx.opset >= 20:
        a = ctx.const(2, "the axis")
        axis = -2 if a is None else int(np.asarray(a).reshape(-1)[0])
    else:
        axis = int(ctx.attr("axis", 1))
    axis = norm_axis(axis, rank)
    if axis == rank - 1:
        raise OnnxModelError("the DFT axis cannot be the last (complex) dim")
    inverse, onesided = bool(ctx.attr("inverse", 0)), bool(ctx.attr("onesided", 0))
    length, comps = shape[axis], shape[-1]
    dl = ctx.const(1, "dft_length")
    n = int(np.asarray(dl).reshape(-1)[0]) if dl is not None else (2 * (length - 1) if inverse and onesided else length)
    if n < 1:
        raise OnnxModelError(f"dft_length must be >= 1, got {n}")
    t, out_len, out_comps = dft_matrix(length, comps, n, inverse=inverse, onesided=onesided)
    # Bring the axis next to the complex dim, flatten the pair, transform, and undo.
    perm = [i for i in range(rank - 1) if i != axis] + [axis, rank - 1]
    moved = x if perm == list(range(rank)) else ctx.op("transpose", x, perm=perm)
    lead = ctx.shape(moved)[:-2]
    flat = reshape(ctx, moved, lead + (length * comps,))
    y = reshape(ctx, ctx.op("matmul", flat, t.astype(ctx.dtype(x))), lead + (out_len, out_comps))
    back = [0] * rank
    for i, p in enumerate(perm):
        back[p] = i
    return [y if perm == list(range(rank)) else ctx.op("transpose", y, perm=back)]
