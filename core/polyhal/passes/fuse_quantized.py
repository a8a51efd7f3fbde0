"""Fuse quantized convs and matmuls, written out as float ops, into ``quantized_conv`` /
``quantized_matmul`` (:mod:`polyhal.ops.quantized`), as onnxruntime's QDQ transformer turns
DequantizeLinear -> Conv -> QuantizeLinear into QLinearConv.

The ONNX front end writes DequantizeLinear as ``mul(sub(cast(q), zero_point), scale)`` and
QuantizeLinear as ``cast(maximum(minimum(add(round(div(y, scale)), zero_point), hi), lo))``
(:mod:`polyhal.frontends.onnx.converters.quantize`); a device without int8 kernels runs them
so. The pass matches, for dispatches of one affinity whose intermediate results have no other
use:

* **QDQ contractions** (onnxruntime's quantizer with ``QuantFormat.QDQ``, and QLinearConv /
  QLinearMatMul, which the front end writes the same way): a ``conv``, ``matmul`` (2-D constant
  right operand, then maybe a bias ``add``) or ``gemm`` (alpha 1, beta 1, A not transposed)
  whose input is a dequantized int8 / uint8 value (scale and zero point constants, one per
  tensor) and whose weights are a float constant that int8 holds exactly -- the dequantized
  weights, folded at import: ``w = q * scale`` with int8 q, one scale per output channel or per
  tensor (recovered as max|w| / 127, or / 64 for 7-bit weights, and checked element by element;
  weights that do not round-trip are not int8 weights, and the contraction stays float). Then maybe a
  ``relu``, then maybe a quantize (int8 / uint8 result), else the float result.
* **MatMulInteger rescaled** (onnxruntime's dynamic quantization): ``cast(matmul(sub(cast(a),
  cast(a_zero_point)), b) -> float32) * scale``, b an int32 constant within int8's range: a
  ``quantized_matmul`` with a float32 result (scale one per tensor, or one per column). Where
  the scale is ``a_scale * b_scale``, a run-time scalar (DynamicQuantizeLinear's) times constant
  weight scales, the product goes in as the contraction's two scales (its kernels multiply them
  in float32 before scaling the int32 sums, the model's order); then maybe a bias ``add``
  (a float32 constant per column) and the epilogue above (relu, quantize).

* **Order-keeping ops between equal quantizations** (QDQ models put a DequantizeLinear /
  QuantizeLinear pair around every op): ``quantize(op(dequantize(q)))`` with one int type,
  scale and zero point on both sides, ``op`` a max pool or a reshape (:data:`ORDER_KEEPING`),
  is ``op(q)`` exactly (dequantizing is increasing, and ``round((k s) / s) == k`` in float32 for
  an int8 / uint8 ``k`` and a normal scale ``s``), as onnxruntime runs MaxPool on int8 maps.

A match becomes the fused op where ``fusible(op, ops)`` says so (a device with int8 kernels:
see :mod:`polyhal.passes.fusion`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from polyhal.ir.program import Op, Program, Value, consumers_of, uses_and_producers
from polyhal.ir.types import TensorType
from polyhal.ops import canonical_attrs
from polyhal.ops.quantized import QUANTIZED_TYPES
from polyhal.passes.fusion import Fusible, always, drop_unused_constants, in_program_order, splice

__all__ = ["fuse_quantized", "int8_weights"]

_F32, _I8, _I32 = np.dtype(np.float32), np.dtype(np.int8), np.dtype(np.int32)


#: Ops that commute with a dequantization (an increasing map of each element) and whose
#: requantization with the same parameters gives the integers back: run on the integers.
ORDER_KEEPING = frozenset({"max_pool", "reshape"})
#: The scales for which ``round((k * scale) / scale) == k`` in float32 for every |k| <= 255 (no
#: overflow, no subnormal product).
_SCALES = (1e-30, 1e30)


#: The largest weight a quantizer makes, tried in turn: 127 (symmetric int8), 64 (onnxruntime's
#: reduce_range, 7-bit weights), 63.
WEIGHT_PEAKS = (127, 64, 63)


def int8_weights(w: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``(q, scale)`` with int8 ``q`` and ``q * scale == w`` (float32, to within the rounding of
    the dequantization that made ``w``), one scale per index of ``axis`` or one for the whole
    tensor, the largest |q| one of :data:`WEIGHT_PEAKS`; None when int8 does not hold ``w``
    exactly so."""
    w = np.asarray(w, _F32)
    moved = np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1)
    for per_channel in (True, False):
        peak = np.abs(moved).max(axis=1) if per_channel else np.abs(moved).max(keepdims=True)
        for top in WEIGHT_PEAKS:
            scale = (peak / np.float32(top)).astype(_F32)
            scale[scale == 0] = 1
            q = np.rint(moved / scale[:, None])
            if np.all(np.abs(q * scale[:, None] - moved) <= 1e-6 * peak[:, None]):
                q = np.moveaxis(q.astype(_I8).reshape(np.moveaxis(w, axis, 0).shape), 0, axis)
                return np.ascontiguousarray(q), (scale if per_channel else scale.reshape(()))
    return None


def fuse_quantized(program: Program, fusible: Fusible = always) -> tuple[Program, list[Fusion]]:
    """Quantized convs and matmuls written as float ops fused into int8 ones where ``fusible`` allows."""
    uses, producer = uses_and_producers(program)
    consumers = consumers_of(program)
    constants = {v.id: data for v, data in program.constants}
    new_constants = list(program.constants)

    def made_by(v: Value, *names: str) -> Op | None:
        op = producer.get(v.id)
        return op if op is not None and op.kind == "dispatch" and op.name in names else None

    def only_user(v: Value, *names: str) -> Op | None:
        users = consumers.get(v.id, [])
        if uses[v.id] != 1 or len(users) != 1:
            return None
        op = users[0]
        return op if op.kind == "dispatch" and op.name in names else None

    def scalar(v: Value) -> float | None:
        data = constants.get(v.id)
        return None if data is None or data.size != 1 else float(np.asarray(data).reshape(()))

    def constant(data: np.ndarray, like: Value, name: str) -> Value:
        data = np.array(data, order="C")  # its own memory, read-only: kernels may keep what they derive
        data.flags.writeable = False
        v = Value(TensorType(data.shape, data.dtype), f"{like.name}_{name}", like.program_id)
        new_constants.append((v, data))
        constants[v.id] = data
        return v

    def dequantized(v: Value):
        """(q, scale, zero point as q's type, ops) when ``v`` is a dequantized int8 / uint8 value."""
        mul = made_by(v, "mul")
        if mul is None or v.type.dtype != _F32:
            return None
        x, s = mul.inputs
        scale = scalar(s)
        if scale is None or constants[s.id].dtype != _F32:
            return None
        sub = made_by(x, "sub")
        zp = 0.0
        if sub is not None:
            zp = scalar(sub.inputs[1])
            x = sub.inputs[0]
        cast = made_by(x, "cast")
        if zp is None or cast is None or cast.inputs[0].type.dtype not in QUANTIZED_TYPES:
            return None
        q = cast.inputs[0]
        chain = [cast] + ([sub] if sub is not None else []) + [mul]
        return (q, constant(np.array(scale, _F32), q, "scale"), constant(np.array(zp, q.type.dtype), q, "zero_point"),
                chain)

    def quantizer(y: Value):
        """(result, scale, zero point, ops) when ``y``'s only use is a QuantizeLinear to int8 / uint8."""
        div = only_user(y, "div")
        if div is None or div.inputs[0] is not y or scalar(div.inputs[1]) is None:
            return None
        chain = [div]
        rnd = only_user(div.outputs[0], "round")
        if rnd is None:
            return None
        chain.append(rnd)
        v, zp = rnd.outputs[0], 0.0
        add = only_user(v, "add")
        if add is not None:
            zp = scalar(add.inputs[1]) if add.inputs[0] is v else None
            if zp is None:
                return None
            chain.append(add)
            v = add.outputs[0]
        lo_op = only_user(v, "minimum")
        hi = scalar(lo_op.inputs[1]) if lo_op is not None and lo_op.inputs[0] is v else None
        mx = only_user(lo_op.outputs[0], "maximum") if hi is not None else None
        lo = scalar(mx.inputs[1]) if mx is not None and mx.inputs[0] is lo_op.outputs[0] else None
        cast = only_user(mx.outputs[0], "cast") if lo is not None else None
        if cast is None or cast.outputs[0].type.dtype not in QUANTIZED_TYPES:
            return None
        out = cast.outputs[0]
        info = np.iinfo(out.type.dtype)
        if (lo, hi) != (info.min, info.max):
            return None
        chain += [lo_op, mx, cast]
        return (out, constant(np.array(scalar(div.inputs[1]), _F32), out, "scale"),
                constant(np.array(zp, out.type.dtype), out, "zero_point"), chain)

    def epilogue(y: Value, chain: list[Op]):
        """After the contraction's float result ``y``: maybe a relu, maybe a quantize. Returns
        (activation, result, y_scale and y_zero_point or ())."""
        activation = "none"
        relu = only_user(y, "relu")
        if relu is not None:
            chain.append(relu)
            activation, y = "relu", relu.outputs[0]
        found = quantizer(y)
        if found is None:
            return activation, y, ()
        out, ys, yz, ops = found
        chain += ops
        return activation, out, (ys, yz)

    replaced: dict[int, tuple[tuple[Op, ...], tuple[Op, ...]]] = {}
    removed: set[int] = set()

    outputs = {v.id for v in program.outputs}

    def take(chain: list[Op], name: str, operands: list[Value], result: Value, attrs: dict) -> None:
        """Replace ``chain`` by the fused op where allowed; of its other ops, those whose results
        nothing else reads go (a dequantized input other ops read stays)."""
        if len({op.affinity for op in chain}) > 1 or any(id(op) in removed or id(op) in replaced for op in chain):
            return
        ordered = in_program_order(program, chain)
        if not fusible(name, ordered):
            return
        last = ordered[-1]
        gone = {id(op) for op in chain}
        changed = True
        while changed:  # keep an op whose result something outside the chain reads
            changed = False
            for op in chain:
                if op is last or id(op) not in gone:
                    continue
                if any(o.id in outputs or any(id(u) not in gone for u in consumers.get(o.id, [])) for o in op.outputs):
                    gone.discard(id(op))
                    changed = True
        fused = Op("dispatch", name, tuple(operands), (result,), canonical_attrs(attrs), last.affinity)
        replaced[id(last)] = (ordered, (fused,))
        removed.update(gone - {id(last)})

    def bias_after(y: Value, n: int, chain: list[Op]) -> tuple[np.ndarray, Value]:
        """(bias, the biased result) where ``y``'s only use adds a float32 constant of n values
        along its last dim (appended to ``chain``), else (zeros, ``y``)."""
        add = only_user(y, "add")
        if add is not None:
            other = add.inputs[1] if add.inputs[0] is y else add.inputs[0]
            data = constants.get(other.id)
            if (data is not None and data.dtype == _F32 and data.shape in ((n,), (1, n))
                    and add.outputs[0].type == y.type):
                chain.append(add)
                return data.reshape(-1), add.outputs[0]
        return np.zeros(n, _F32), y

    def float_matmul(op: Op) -> None:
        """A QDQ matmul / gemm (see the module docstring)."""
        found = dequantized(op.inputs[0])
        w = constants.get(op.inputs[1].id)
        if found is None or w is None or w.dtype != _F32 or w.ndim != 2:
            return
        attrs = dict(op.attrs)
        bias = None
        if op.name == "gemm":
            if attrs.get("trans_a") or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
                return
            if attrs.get("trans_b"):
                w = w.T
            if len(op.inputs) == 3:
                bias = constants.get(op.inputs[2].id)
                if bias is None or bias.size != w.shape[1]:
                    return
        weights = int8_weights(w, 1)
        if weights is None:
            return
        q, xs, xz, chain = found
        chain = chain + [op]
        y = op.outputs[0]
        if bias is None:
            bias, y = bias_after(y, w.shape[1], chain)
        activation, result, out = epilogue(y, chain)
        take(chain, "quantized_matmul", [q, xs, xz, constant(weights[0], op.inputs[1], "int8"),
                                         constant(weights[1], op.inputs[1], "scale"),
                                         constant(np.asarray(bias, _F32).reshape(-1), y, "bias"), *out],
             result, {"activation": activation, "alpha": 0.0, "beta": 0.0})

    def integer_matmul(op: Op) -> None:
        """MatMulInteger, cast to float32 and scaled (see the module docstring)."""
        a, b = op.inputs
        data = constants.get(b.id)
        if data is None or data.ndim != 2 or data.size == 0 or data.min() < -128 or data.max() > 127:
            return
        sub = made_by(a, "sub")
        chain = [op]
        if sub is not None:
            za = made_by(sub.inputs[1], "cast")
            if za is None or za.inputs[0].type.size != 1:
                return
            zero_point = za.inputs[0]
            if zero_point.type.rank:
                return
            chain = [za, sub] + chain
            a = sub.inputs[0]
        else:
            zero_point = None
        cast_a = made_by(a, "cast")
        if cast_a is None or cast_a.inputs[0].type.dtype not in QUANTIZED_TYPES:
            return
        q = cast_a.inputs[0]
        if zero_point is None:
            zero_point = constant(np.zeros((), q.type.dtype), q, "zero_point")
        elif zero_point.type.dtype != q.type.dtype:
            return
        chain = [cast_a] + chain
        to_float = only_user(op.outputs[0], "cast")
        if to_float is None or to_float.outputs[0].type.dtype != _F32:
            return
        mul = only_user(to_float.outputs[0], "mul")
        if mul is None:
            return
        scale = mul.inputs[1] if mul.inputs[0] is to_float.outputs[0] else mul.inputs[0]
        n = data.shape[1]
        if scale.type.dtype != _F32 or scale.type.shape not in ((), (1,), (n,)) or mul.outputs[0].type != TensorType(
                op.outputs[0].type.shape, _F32):
            return
        chain += [to_float, mul]
        one = constant(np.ones((), _F32), q, "unit_scale")
        a_scale, b_scale = (one, scale) if scale.type.shape == (n,) else (scale, one)
        product = made_by(scale, "mul")
        if product is not None and uses[scale.id] == 1 and scale.id not in outputs:
            # a's run-time scale times b's constant one(s), as onnxruntime's dynamic quantizer
            # writes them: the contraction's own two scales (its kernels multiply them in float32
            # first, the rounding of this product).
            sa, sb = product.inputs
            if sa.id in constants:
                sa, sb = sb, sa
            data_b = constants.get(sb.id)
            if (sa.id not in constants and sa.type.dtype == _F32 and sa.type.shape in ((), (1,))
                    and data_b is not None and data_b.dtype == _F32 and data_b.shape in ((), (1,), (n,))):
                chain.insert(0, product)
                a_scale = sa
                b_scale = constant(data_b.reshape(()) if data_b.size == 1 else data_b.reshape(n), b, "scale")
        bias, y = bias_after(mul.outputs[0], n, chain)
        activation, result, out = epilogue(y, chain)
        take(chain, "quantized_matmul", [q, a_scale, zero_point, constant(data.astype(_I8), b, "int8"), b_scale,
                                         constant(bias, b, "bias"), *out],
             result, {"activation": activation, "alpha": 0.0, "beta": 0.0})

    def requantized_as_is(op: Op) -> None:
        """An op of :data:`ORDER_KEEPING` between a dequantize and a quantize of the same int
        type, scale and zero point: the op on the integers (see the module docstring)."""
        found = dequantized(op.inputs[0])
        after = quantizer(op.outputs[0]) if found is not None else None
        if after is None:
            return
        q, xs, xz, chain = found
        y, ys, yz, ops = after
        scale = float(constants[xs.id])
        if (q.type.dtype != y.type.dtype or scale != float(constants[ys.id]) or constants[xz.id] != constants[yz.id]
                or not _SCALES[0] < scale < _SCALES[1]):
            return
        take(chain + [op] + ops, op.name, [q], y, dict(op.attrs))

    for op in program.ops:
        if op.kind != "dispatch" or id(op) in removed:
            continue
        if op.name in ORDER_KEEPING and len(op.inputs) == 1:
            requantized_as_is(op)
            continue
        if op.name == "conv" and len(op.inputs) >= 2:
            found = dequantized(op.inputs[0])
            w = constants.get(op.inputs[1].id)
            bias = constants.get(op.inputs[2].id) if len(op.inputs) == 3 else np.zeros(op.outputs[0].type.shape[1], _F32)
            weights = int8_weights(w, 0) if found is not None and w is not None and w.dtype == _F32 else None
            if weights is None or bias is None:
                continue
            q, xs, xz, chain = found
            chain = chain + [op]
            activation, result, out = epilogue(op.outputs[0], chain)
            attrs = {**dict(op.attrs), "activation": activation, "alpha": 0.0, "beta": 0.0}
            attrs.pop("precision", None)
            take(chain, "quantized_conv", [q, xs, xz, constant(weights[0], op.inputs[1], "int8"),
                                           constant(weights[1], op.inputs[1], "scale"),
                                           constant(np.asarray(bias, _F32), op.outputs[0], "bias"), *out],
                 result, attrs)
        elif op.name in ("matmul", "gemm") and op.outputs[0].type.dtype == _F32:
            float_matmul(op)
        elif op.name == "matmul" and op.outputs[0].type.dtype == _I32:
            integer_matmul(op)
    if not replaced:
        return program, []
    # The float weights the int8 ones replace are read by nothing now: not bound by the plan.
    fused, changes = splice(dataclasses.replace(program, constants=new_constants), replaced, removed, "quantized")
    return drop_unused_constants(fused), changes
