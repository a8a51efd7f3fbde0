"""ONNX ops that move data or make tensors: shapes, slicing, indexing, constants.

Shape operands (Reshape's shape, Slice's starts, Tile's repeats, ...) must be known at import
time (``ctx.const``); everything computed from static shapes (Shape, Size, ConstantOfShape of
a known shape, ...) folds to constants, so only real data movement reaches the program.
"""

from __future__ import annotations

import math

import numpy as np

from polyhal.frontends.onnx.converters.context import NodeContext
from polyhal.frontends.onnx.converters.registry import converter
from polyhal.frontends.onnx.errors import OnnxModelError, OnnxUnsupportedError
from polyhal.frontends.onnx.types import np_dtype

_I64 = np.dtype(np.int64)


def ints(a) -> list[int]:
    """A known operand (array) or attribute as a list of Python ints."""
    return [int(v) for v in np.asarray(a).reshape(-1).tolist()]


def norm_axis(axis: int, rank: int, what: str = "axis") -> int:
    if not -rank <= axis < rank:
        raise OnnxModelError(f"{what} {axis} is out of range for rank {rank}")
    return axis % rank


def reshape(ctx: NodeContext, x, shape) -> object:
    shape = [int(d) for d in shape]
    if list(ctx.shape(x)) == shape:
        return x
    return ctx.op("reshape", x, shape=shape)


@converter("Identity")
def _identity(ctx: NodeContext) -> list:
    raw = ctx.raw_input(0)
    # Values of run-time length and host-made outputs (string labels, ZipMap) pass through.
    return [raw if hasattr(raw, "padded") or hasattr(raw, "finish") else ctx.input(0)]


@converter("Reshape")
def _reshape(ctx: NodeContext) -> list:
    x = ctx.input(0)
    shape = ints(ctx.const(1, "the new shape"))
    allowzero = int(ctx.attr("allowzero", 0))
    in_shape = ctx.shape(x)
    dims = []
    for i, d in enumerate(shape):
        if d == 0 and not allowzero:
            if i >= len(in_shape):
                raise OnnxModelError(f"shape {shape}: dim {i} is 0 (copy the input dim) but the input has rank "
                                     f"{len(in_shape)}")
            d = in_shape[i]
        dims.append(d)
    return [ctx.op("reshape", x, shape=dims)]


@converter("Flatten")
def _flatten(ctx: NodeContext) -> list:
    x = ctx.input(0)
    shape = ctx.shape(x)
    axis = int(ctx.attr("axis", 1))
    if not -len(shape) <= axis <= len(shape):
        raise OnnxModelError(f"axis {axis} is out of range for rank {len(shape)}")
    axis = axis + len(shape) if axis < 0 else axis
    return [reshape(ctx, x, (math.prod(shape[:axis]), math.prod(shape[axis:])))]


def _axes(ctx: NodeContext, attr_until: int, input_index: int = 1):
    """Axes from the attribute (opsets before ``attr_until``) or from an input."""
    if ctx.opset < attr_until:
        a = ctx.attr("axes", None)
        return None if a is None else [int(v) for v in a]
    a = ctx.const(input_index, "the axes")
    return None if a is None else ints(a)


@converter("Squeeze")
def _squeeze(ctx: NodeContext) -> list:
    x = ctx.input(0)
    shape = ctx.shape(x)
    axes = _axes(ctx, 13)
    if axes is None:
        keep = [d for d in shape if d != 1]
    else:
        axes = {norm_axis(a, len(shape), "axes entry") for a in axes}
        for a in axes:
            if shape[a] != 1:
                raise OnnxModelError(f"cannot squeeze axis {a} of shape {list(shape)}: its size is not 1")
        keep = [d for i, d in enumerate(shape) if i not in axes]
    return [reshape(ctx, x, keep)]


@converter("Unsqueeze")
def _unsqueeze(ctx: NodeContext) -> list:
    x = ctx.input(0)
    shape = list(ctx.shape(x))
    axes = _axes(ctx, 13)
    if axes is None:
        raise OnnxModelError("Unsqueeze needs axes")
    rank = len(shape) + len(axes)
    norm = sorted(norm_axis(a, rank, "axes entry") for a in axes)
    if len(set(norm)) != len(norm):
        raise OnnxModelError(f"axes {axes} repeats an axis")
    for a in norm:
        shape.insert(a, 1)
    return [reshape(ctx, x, shape)]


@converter("Transpose")
def _transpose(ctx: NodeContext) -> list:
    perm = ctx.attr("perm", None)
    return [ctx.op("transpose", ctx.input(0), perm=None if perm is None else [int(p) for p in perm])]


@converter("Concat")
def _concat(ctx: NodeContext) -> list:
    xs = [x for x in ctx.inputs() if x is not None]
    return [ctx.op("concat", *xs, axis=int(ctx.attr("axis")))]


@converter("Split")
def _split(ctx: NodeContext) -> list:
    x = ctx.input(0)
    shape = ctx.shape(x)
    axis = norm_axis(int(ctx.attr("axis", 0)), len(shape))
    dim = shape[axis]
    n = ctx.num_outputs
    if ctx.opset < 13:
        split = ctx.attr("split", None)
    else:
        split = ctx.const(1, "the split sizes")
    if split is not None:
        sizes = ints(split)
        if any(size < 0 for size in sizes):  # they would still add up, as slices from the end
            raise OnnxModelError(f"split sizes {sizes} must be >= 0 (onnxruntime refuses them too)")
        if sum(sizes) != dim or len(sizes) != n:
            raise OnnxModelError(f"split sizes {sizes} do not add up to dim {dim} over {n} outputs")
    elif ctx.opset >= 18 and ctx.has_attr("num_outputs"):
        k = int(ctx.attr("num_outputs"))
        if k < 1:
            raise OnnxModelError(f"Split's num_outputs must be >= 1, got {k}")
        chunk = -(-dim // k)
        sizes = [min(chunk, max(dim - i * chunk, 0)) for i in range(k)]
    else:
        if dim % n:
            raise OnnxModelError(f"cannot split dim {dim} evenly into {n} outputs")
        sizes = [dim // n] * n
    outs, start = [], 0
    for size in sizes:
        outs.append(ctx.op("slice", x, starts=[start], ends=[start + size], axes=[axis], steps=[1]))
        start += size
    return outs


@converter("Slice")
def _slice(ctx: NodeContext) -> list:
    x = ctx.input(0)
    if ctx.opset < 10:
        starts, ends = ctx.attr("starts"), ctx.attr("ends")
        axes, steps = ctx.attr("axes", None), None
    else:
        starts, ends = ints(ctx.const(1, "starts")), ints(ctx.const(2, "ends"))
        axes = ctx.const(3, "axes")
        steps = ctx.const(4, "steps")
        axes = None if axes is None else ints(axes)
        steps = None if steps is None else ints(steps)
    starts, ends = [int(s) for s in starts], [int(e) for e in ends]
    if axes is None and steps is not None:
        axes = list(range(len(starts)))
    if steps is not None and axes is None:
        axes = list(range(len(starts)))
    return [ctx.op("slice", x, starts=starts, ends=ends, axes=None if axes is None else [int(a) for a in axes],
                   steps=steps)]


@converter("Gather")
def _gather(ctx: NodeContext) -> list:
    data, idx = ctx.input(0), ctx.input(1)
    if ctx.dtype(idx) not in (np.dtype(np.int32), _I64):
        idx = ctx.op("cast", idx, dtype="int64")
    axis = int(ctx.attr("axis", 0))
    if isinstance(idx, np.ndarray):
        dim = ctx.shape(data)[norm_axis(axis, ctx.rank(data))]
        if idx.size and (idx.min() < -dim or idx.max() >= dim):
            raise OnnxModelError(f"indices {idx.tolist()} are out of range for axis {axis} of size {dim}")
    return [ctx.op("gather", data, idx, axis=axis)]


@converter("GatherElements")
def _gather_elements(ctx: NodeContext) -> list:
    return [ctx.op("gather_elements", ctx.input(0), ctx.input(1), axis=int(ctx.attr("axis", 0)))]


@converter("GatherND")
def _gather_nd(ctx: NodeContext) -> list:
    return [ctx.op("gather_nd", ctx.input(0), ctx.input(1), batch_dims=int(ctx.attr("batch_dims", 0)))]


@converter("ScatterElements", "Scatter")
def _scatter_elements(ctx: NodeContext) -> list:
    reduction = ctx.attr("reduction", "none")
    return [ctx.op("scatter_elements", ctx.input(0), ctx.input(1), ctx.input(2), axis=int(ctx.attr("axis", 0)),
                   reduction=reduction)]


@converter("ScatterND")
def _scatter_nd(ctx: NodeContext) -> list:
    return [ctx.op("scatter_nd", ctx.input(0), ctx.input(1), ctx.input(2), reduction=ctx.attr("reduction", "none"))]


@converter("Expand")
def _expand(ctx: NodeContext) -> list:
    x = ctx.input(0)
    shape = ints(ctx.const(1, "the shape"))
    out = tuple(np.broadcast_shapes(ctx.shape(x), tuple(shape)))
    if out == ctx.shape(x):
        return [x]
    return [ctx.op("expand", x, shape=list(out))]


@converter("Tile")
def _tile(ctx: NodeContext) -> list:
    x = ctx.input(0)
    reps = ints(ctx.const(1, "the repeats"))
    shape = ctx.shape(x)
    if len(reps) != len(shape):
        raise OnnxModelError(f"repeats {reps} must have one entry per dim of the input {list(shape)}")
    if all(r == 1 for r in reps):
        return [x]
    # (d0, d1) tiled (r0, r1): view as (1, d0, 1, d1), broadcast to (r0, d0, r1, d1), merge pairs.
    spread = [v for d in shape for v in (1, d)]
    grown = [v for r, d in zip(reps, shape) for v in (r, d)]
    y = ctx.op("expand", reshape(ctx, x, spread), shape=grown)
    return [reshape(ctx, y, [r * d for r, d in zip(reps, shape)])]


@converter("Pad")
def _pad(ctx: NodeContext) -> list:
    x = ctx.input(0)
    rank = ctx.rank(x)
    mode = ctx.attr("mode", "constant")
    if ctx.opset < 11:
        pads = [int(p) for p in ctx.attr("pads")]
        value = float(ctx.attr("value", 0.0))
        axes = None
    else:
        pads = ints(ctx.const(1, "the pads"))
        v = ctx.const(2, "the constant value")
        value = 0 if v is None else np.asarray(v).reshape(-1)[0].item()
        axes = ctx.const(3, "the axes") if ctx.opset >= 18 else None
    if axes is not None:
        axes = [norm_axis(a, rank, "axes entry") for a in ints(axes)]
        full = [0] * (2 * rank)
        n = len(axes)
        if len(pads) != 2 * n:
            raise OnnxModelError(f"pads {pads} must have 2 entries per axis of {axes}")
        for i, a in enumerate(axes):
            full[a], full[a + rank] = pads[i], pads[i + n]
        pads = full
    if len(pads) != 2 * rank:
        raise OnnxModelError(f"pads {pads} must have {2 * rank} entries for rank {rank}")
    if ctx.dtype(x).kind in "iub":
        value = int(value)
    return [ctx.op("pad", x, pads=pads, mode=mode, value=value)]


@converter("Shape")
def _shape(ctx: NodeContext) -> list:
    shape = ctx.shape(ctx.input(0))
    start, end = int(ctx.attr("start", 0)), ctx.attr("end", None)
    rank = len(shape)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = rank if end is None else int(end)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return [np.array(shape[start:end], dtype=_I64)]


@converter("Size")
def _size(ctx: NodeContext) -> list:
    return [np.array(ctx.type(ctx.input(0)).size, dtype=_I64)]


@converter("ConstantOfShape")
def _constant_of_shape(ctx: NodeContext) -> list:
    shape = ints(ctx.const(0, "the shape"))
    value = ctx.attr("value", None)
    if value is None:
        value = np.zeros(1, np.float32)
    value = np.asarray(value)
    if any(d < 0 for d in shape):
        raise OnnxModelError(f"shape {shape} has a negative dim")
    return [ctx.full(shape, value.reshape(-1)[0], value.dtype)]


@converter("Constant")
def _constant(ctx: NodeContext) -> list:
    for name in ("value", "value_float", "value_floats", "value_int", "value_ints"):
        if ctx.has_attr(name):
            v = ctx.attr(name)
            if name == "value":
                return [np.asarray(v)]
            dtype = np.float32 if "float" in name else np.int64
            return [np.array(v, dtype=dtype)]
    if ctx.has_attr("sparse_value"):
        raise OnnxUnsupportedError("Constant with a sparse_value (sparse tensors are not supported)")
    raise OnnxUnsupportedError("Constant of strings (polyhal has no string tensors)")


@converter("Range")
def _range(ctx: NodeContext) -> list:
    start, limit, delta = (ctx.const(i, "decides the output length") for i in range(3))
    dtype = np.asarray(start).dtype
    s, l, d = (np.asarray(v).reshape(-1)[0].item() for v in (start, limit, delta))
    if d == 0:
        raise OnnxModelError("Range with delta 0")
    n = max(int(math.ceil((l - s) / d)), 0)
    ctx.importer.check_fold(n * dtype.itemsize, f"Range's {n} elements")
    return [(s + np.arange(n, dtype=np.float64 if dtype.kind == "f" else np.int64) * d).astype(dtype)]


@converter("EyeLike")
def _eye_like(ctx: NodeContext) -> list:
    x = ctx.input(0)
    shape = ctx.shape(x)
    if len(shape) != 2:
        raise OnnxModelError(f"EyeLike needs a 2-D input, got shape {list(shape)}")
    dtype = np_dtype(int(ctx.attr("dtype")), "EyeLike's dtype") if ctx.has_attr("dtype") else ctx.dtype(x)
    return [np.eye(shape[0], shape[1], k=int(ctx.attr("k", 0)), dtype=dtype)]


@converter("Trilu")
def _trilu(ctx: NodeContext) -> list:
    x = ctx.input(0)
    shape = ctx.shape(x)
    if len(shape) < 2:
        raise OnnxModelError(f"Trilu needs rank >= 2, got shape {list(shape)}")
    k = ctx.const(1, "k")
    k = 0 if k is None else int(np.asarray(k).reshape(-1)[0])
    ones = np.ones(shape[-2:], dtype=bool)
    mask = np.triu(ones, k) if int(ctx.attr("upper", 1)) else np.tril(ones, k)
    return [ctx.op("where", mask, x, ctx.scalar(0, ctx.dtype(x)))]


@converter("DepthToSpace")
def _depth_to_space(ctx: NodeContext) -> list:
    x = ctx.input(0)
    n, c, h, w = ctx.shape(x)
    b = int(ctx.attr("blocksize"))
    mode = ctx.attr("mode", "DCR")
    if c % (b * b):
        raise OnnxModelError(f"channels {c} are not a multiple of blocksize^2 = {b * b}")
    if mode == "DCR":
        y = ctx.op("transpose", reshape(ctx, x, (n, b, b, c // (b * b), h, w)), perm=[0, 3, 4, 1, 5, 2])
    else:
        y = ctx.op("transpose", reshape(ctx, x, (n, c // (b * b), b, b, h, w)), perm=[0, 1, 4, 2, 5, 3])
    return [reshape(ctx, y, (n, c // (b * b), h * b, w * b))]


@converter("SpaceToDepth")
def _space_to_depth(ctx: NodeContext) -> list:
    x = ctx.input(0)
    n, c, h, w = ctx.shape(x)
    b = int(ctx.attr("blocksize"))
    if h % b or w % b:
        raise OnnxModelError(f"spatial dims {h}x{w} are not multiples of blocksize {b}")
    # DCR orders the new channels (block row, block column, channel), CRD (channel, row, column).
    perm = [0, 1, 3, 5, 2, 4] if ctx.attr("mode", "DCR") == "CRD" else [0, 3, 5, 1, 2, 4]
    y = ctx.op("transpose", reshape(ctx, x, (n, c, h // b, b, w // b, b)), perm=perm)
    return [reshape(ctx, y, (n, c * b * b, h // b, w // b))]


@converter("OneHot")
def _one_hot(ctx: NodeContext) -> list:
    indices, values = ctx.input(0), ctx.input(2)
    depth = int(np.asarray(ctx.const(1, "the depth")).reshape(-1)[0])
    shape = ctx.shape(indices)
    rank = len(shape) + 1
    axis = norm_axis(int(ctx.attr("axis", -1)), rank)
    idx = indices if ctx.dtype(indices) == _I64 else ctx.op("cast", indices, dtype="int64")
    # Negative indices count from the end of the depth axis.
    idx = ctx.op("where", ctx.op("less", idx, ctx.scalar(0, _I64)), ctx.op("add", idx, ctx.scalar(depth, _I64)), idx)
    idx = reshape(ctx, idx, shape[:axis] + (1,) + shape[axis:])
    positions = np.arange(depth, dtype=_I64).reshape((depth,) + (1,) * (rank - axis - 1))
    hot = ctx.op("equal", idx, positions)
    off = ctx.op("gather", values, np.array(0, _I64), axis=0)
    on = ctx.op("gather", values, np.array(1, _I64), axis=0)
    return [ctx.op("where", hot, on, off)]


@converter("CumSum", "CumProd")
def _cumsum(ctx: NodeContext) -> list:
    x = ctx.input(0)
    axis = int(np.asarray(ctx.const(1, "the axis")).reshape(-1)[0])
    return [ctx.op("cumsum" if ctx.op_type == "CumSum" else "cumprod", x, axis=axis,
                   exclusive=bool(ctx.attr("exclusive", 0)), reverse=bool(ctx.attr("reverse", 0)))]


@converter("TopK")
def _topk(ctx: NodeContext) -> list:
    x = ctx.input(0)
    k = int(ctx.attr("k")) if ctx.opset < 10 else int(np.asarray(ctx.const(1, "k")).reshape(-1)[0])
    values, indices = ctx.op("topk", x, k=k, axis=int(ctx.attr("axis", -1)),
                             largest=bool(ctx.attr("largest", 1)), sorted=bool(ctx.attr("sorted", 1)))
    return [values, indices]


@converter("Compress")
def _compress(ctx: NodeContext) -> list:
    data = ctx.input(0)
    cond = np.asarray(ctx.const(1, "the condition (it decides the output length)")).astype(bool).reshape(-1)
    axis = ctx.attr("axis", None)
    if axis is None:
        data = reshape(ctx, data, (ctx.type(data).size,))
        axis = 0
    dim = ctx.shape(data)[norm_axis(int(axis), ctx.rank(data))]
    picked = np.nonzero(cond[:dim])[0].astype(_I64)
    return [ctx.op("gather", data, picked, axis=int(axis))]


@converter("ReverseSequence")
def _reverse_sequence(ctx: NodeContext) -> list:
    x = ctx.input(0)
    lens = ints(ctx.const(1, "the sequence lengths"))
    batch_axis, time_axis = int(ctx.attr("batch_axis", 1)), int(ctx.attr("time_axis", 0))
    shape = ctx.shape(x)
    idx = np.indices(shape)[time_axis].astype(_I64)
    moved = np.moveaxis(idx, (batch_axis, time_axis), (0, 1))
    for b, n in enumerate(lens):
        moved[b, :n] = moved[b, :n][::-1]
    return [ctx.op("gather_elements", x, np.ascontiguousarray(idx), axis=time_axis)]


@converter("Einsum")
def _einsum(ctx: NodeContext) -> list:
    xs = [x for x in ctx.inputs() if x is not None]
    return [ctx.op("einsum", *xs, equation=ctx.attr("equation").replace(" ", ""))]


@converter("Dropout")
def _dropout(ctx: NodeContext) -> list:
    x = ctx.input(0)
    training = ctx.const(2, "training_mode") if ctx.opset >= 12 else None
    if training is not None and bool(np.asarray(training).reshape(-1)[0]):
        ratio = ctx.const(1, "ratio")
        if ratio is None or float(np.asarray(ratio).reshape(-1)[0]) != 0.0:
            raise OnnxUnsupportedError("Dropout in training mode (random masks are not supported)")
    outs = [x]
    if ctx.wants(1):
        outs.append(np.ones(ctx.shape(x), dtype=bool))
    return outs


@converter("If")
def _if(ctx: NodeContext) -> list:
    cond = ctx.known(0, "with a condition computed at run time")
    branch = "then_branch" if bool(np.asarray(cond).reshape(-1)[0]) else "else_branch"
    return ctx.inline_graph(ctx.attr(branch), name=branch)
