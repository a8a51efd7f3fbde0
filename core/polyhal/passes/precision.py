"""The precision policy: how a compile may compute a program's float32 work.

``polyhal.compile(program, devices, precision=...)`` (default ``POLYHAL_PRECISION``, else
``"fp32"``) takes one of :data:`PRECISIONS`:

``"fp32"`` (the default)
    float32 computes in float32: every contraction (:attr:`polyhal.ops.OpDef.contraction`:
    matmul, gemm, linear, conv, attention, ...) keeps ``precision="fp32"``, so a CUDA device
    uses no TF32 in cuBLAS or cuDNN. Results match a float64 reference to float32 rounding.
``"tf32"``
    contractions on float32 operands get ``precision="tf32"`` (:func:`allow_tf32`): a device
    with the ``"tf32"`` capability (CUDA, compute capability 8.0 and later) may run their
    products on TF32 tensor cores -- inputs rounded to a 10-bit mantissa, float32 accumulation,
    about 1e-3 relative error. Types do not change; other ops are untouched.
``"fp16"``
    the program is rewritten (:func:`lower_precision`) so that its float32 compute runs in
    float16 where that is safe, following torch's autocast op lists: contractions (matmul,
    gemm, linear, conv, conv_transpose, einsum, attention) compute in float16 (their kernels
    accumulate in float32: cuBLAS's 32F compute type, cuDNN's float compute type; attention
    kernels take their softmax in float32, as torch's scaled_dot_product_attention, which
    autocast runs in float16, does); ops that only move or map
    values (elementwise arithmetic, activations, pooling, reshapes, concats, ...) follow the type
    of their operands, and run in float32 where a float32 operand meets a float16 one (torch's
    promotion); numerically sensitive ops stay float32 (:data:`KEEP_FLOAT32`: softmax,
    layer_norm, masked attention, sums and means, exp/log/pow, cumulative sums, ...), and so does every
    op not listed (sorting, detection, trees, ...). Constants (weights) are converted once, when
    the program is compiled, clipped to float16's finite range as onnxruntime's float16
    converter clips them; the program's inputs and outputs keep their float32 types, with casts
    inserted at the boundary. float64 values are never lowered.
``"bf16"``
    refused (:class:`~polyhal.errors.PrecisionError`): polyhal's op set holds bfloat16 as a
    storage-only type (arithmetic on it needs a ``cast`` first), so no device computes in it.

A device that lacks the requested precision (its spec has no ``"tf32"`` / ``"fp16"``
capability: the CPU has no TF32, an OpenCL device without ``cl_khr_fp16`` no float16) computes
its ops in float32: precision is a permission to trade accuracy for speed, never a requirement,
so the same ``POLYHAL_PRECISION`` serves every device. The decision is made per op for the device
placement would choose (:meth:`polyhal.target.Target.chosen_device`); ``plan.explain()`` says
what was changed, what was kept in float32 and which devices lacked the precision, and when no op
of the program could take it a :class:`PrecisionWarning` says so once.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from polyhal.ir.program import Op, Program, Value
from polyhal.ir.types import TensorType
from polyhal.ops import OPS, canonical_attrs, infer_types
from polyhal.policies.precision import CAPABILITY, ENV, PRECISIONS, resolve_precision

# ENV, PRECISIONS, CAPABILITY and resolve_precision (the policy itself) live in
# polyhal.policies.precision, below the passes, where the compile Target reads them.
__all__ = ["CAPABILITY", "ENV", "FOLLOW", "KEEP_FLOAT32", "LOWER", "PRECISIONS", "PrecisionReport",
           "PrecisionWarning", "allow_tf32", "apply_precision", "lower_precision", "resolve_precision"]

#: Core ops that compute in float16 under "fp16" (torch autocast's float16 list: the products).
#: A backend's own contractions (``OpDef.contraction``: a conv with a prologue) do too.
LOWER = frozenset({"matmul", "gemm", "linear", "fused_linear", "conv", "fused_conv", "conv_transpose", "einsum",
                   "attention"})
#: Ops that run in the type of their float operands (torch autocast's promote rule): they map or
#: move values without accumulating many of them.
FOLLOW = frozenset({
    "add", "sub", "mul", "div", "neg", "abs", "sign", "floor", "ceil", "round", "maximum", "minimum",
    "relu", "sigmoid", "tanh", "gelu", "erf", "sin", "cos", "where",
    "equal", "not_equal", "less", "less_equal", "greater", "greater_equal", "isnan", "isinf",
    "max_pool", "avg_pool", "reduce_max", "reduce_min", "argmax", "argmin",
    "reshape", "transpose", "slice", "concat", "expand", "pad", "gather", "gather_elements", "gather_nd",
    "identity", "cast",
})
#: Ops named to stay float32 (with every op in neither list): a float16 result would lose what
#: they compute (torch autocast's float32 list; softmax normalises over long rows; a masked
#: attention's additive mask may not survive float16).
KEEP_FLOAT32 = frozenset({
    "softmax", "layer_norm", "masked_attention", "reduce_sum", "reduce_mean", "reduce_prod",
    "cumsum", "cumprod", "exp", "log", "pow", "reciprocal", "sqrt", "acos", "asin", "acosh", "asinh", "atanh",
    "cosh", "sinh", "tan", "lp_pool", "det",
})

_F32 = np.dtype(np.float32)
_F16 = np.dtype(np.float16)
_warned: set[tuple[str, tuple[str, ...]]] = set()


class PrecisionWarning(UserWarning):
    """A requested precision that no op of the program could take on the devices it runs on."""


@dataclass
class PrecisionReport:
    """What the precision policy did to one compile's program (``plan.explain()`` prints it)."""

    precision: str
    source: str = "default"
    #: Ops that compute in the requested precision, by op name.
    changed: collections.Counter = field(default_factory=collections.Counter)
    #: float32 ops kept in float32 for their numerics ("fp16": :data:`KEEP_FLOAT32` and unlisted ops).
    kept: collections.Counter = field(default_factory=collections.Counter)
    #: Device -> its ops left in float32 because it lacks the precision.
    unable: dict[str, collections.Counter] = field(default_factory=dict)
    #: Casts inserted between the float32 and float16 parts.
    casts: int = 0
    #: Constants converted once at compile time, and their bytes in the lower type.
    constants: int = 0
    constant_bytes: int = 0

    def explain_lines(self) -> list[str]:
        """explain's lines for this report."""
        head = f"  precision {self.precision} ({'from ' + ENV if self.source == ENV else self.source})"
        if self.precision == "fp32":
            return [f"{head}: float32 computes in float32 (no TF32, no float16)"]
        what = {"tf32": "contraction(s) may use TF32 tensor cores",
                "fp16": "op(s) compute in float16 (products accumulate in float32)"}[self.precision]
        lines = [f"{head}: {sum(self.changed.values())} {what}" + _counts(self.changed)]
        if self.precision == "fp16":
            lines.append(f"    kept in float32 for accuracy: {sum(self.kept.values())} op(s){_counts(self.kept)}; "
                         f"{self.casts} cast(s) inserted; {self.constants} constant(s) converted once "
                         f"({self.constant_bytes / 2**20:.1f} MiB in float16); inputs and outputs stay float32")
        for device, ops in self.unable.items():
            lines.append(f"    {device} has no {self.precision}: {sum(ops.values())} op(s) compute in float32 there"
                         + _counts(ops))
        return lines


def _counts(counter: collections.Counter) -> str:
    return f" ({', '.join(f'{k} x{n}' for k, n in counter.most_common())})" if counter else ""


#: ``device_of(op) -> device name or None``: where placement would run ``op`` (None: nowhere).
DeviceOf = Callable[[Op], "str | None"]
#: ``capable(device, precision) -> bool``.
Capable = Callable[[str, str], bool]


def apply_precision(program: Program, precision: str | tuple[str, str] | None, device_of: DeviceOf,
                    capable: Capable) -> tuple[Program, PrecisionReport]:
    """``program`` under ``precision`` (resolved by :func:`resolve_precision`, or already resolved:
    a ``(name, source)`` pair), and the report.

    ``device_of`` says where placement would run an op, ``capable`` whether a device computes in
    a precision (its capability tags). Warns (:class:`PrecisionWarning`, once per precision and
    device set) when the precision is not fp32 and no op could take it."""
    name, source = precision if isinstance(precision, tuple) else resolve_precision(precision)
    report = PrecisionReport(name, source)
    if name == "tf32":
        program = allow_tf32(program, device_of, capable, report)
    elif name == "fp16":
        program = lower_precision(program, device_of, capable, report)
    if name != "fp32" and not report.changed and report.unable:
        key = (name, tuple(sorted(report.unable)))
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"precision {name!r} ({'from ' + ENV if source == ENV else source}): "
                          f"{', '.join(sorted(report.unable))} cannot compute in {name}; the program computes in "
                          "float32", PrecisionWarning, stacklevel=4)
    return program, report


def _backend_contraction(name: str) -> bool:
    """Whether op ``name`` is a backend's own contraction (which lowers as :data:`LOWER` does)."""
    opdef = OPS.get(name)
    return opdef is not None and opdef.backend is not None and opdef.contraction


def _float32_contraction(op: Op) -> bool:
    return (op.kind == "dispatch" and op.name in OPS and OPS[op.name].contraction
            and any(v.type.dtype == _F32 for v in op.inputs))


def _check(op: Op, precision: str, device_of: DeviceOf, capable: Capable, report: PrecisionReport) -> bool:
    """Whether ``op``'s device computes in ``precision`` (else it is counted as unable)."""
    device = device_of(op)
    if device is not None and capable(device, precision):
        return True
    report.unable.setdefault(device or "(no device)", collections.Counter())[op.name] += 1
    return False


def allow_tf32(program: Program, device_of: DeviceOf, capable: Capable,
               report: PrecisionReport | None = None) -> Program:
    """``program`` with ``precision="tf32"`` on its float32 contractions whose device has TF32
    (a new program; ``program`` is not changed)."""
    report = report or PrecisionReport("tf32")
    ops = []
    for op in program.ops:
        if _float32_contraction(op) and _check(op, "tf32", device_of, capable, report):
            op = dataclasses.replace(op, attrs=canonical_attrs({**op.attr_dict, "precision": "tf32"}))
            report.changed[op.name] += 1
        ops.append(op)
    return dataclasses.replace(program, ops=ops)


def to_float16(data: np.ndarray) -> np.ndarray:
    """float32 ``data`` as float16, clipped to float16's finite range and with magnitudes below
    its smallest subnormal kept at that subnormal (onnxruntime's float16 converter does the same:
    a large mask value stays large, an epsilon stays nonzero)."""
    info = np.finfo(np.float16)
    tiny = float(info.smallest_subnormal)
    x = np.clip(data, float(info.min), float(info.max))
    x = np.where((x > 0) & (x < tiny), tiny, np.where((x < 0) & (x > -tiny), -tiny, x))
    return np.ascontiguousarray(x.astype(np.float16))


def lower_precision(program: Program, device_of: DeviceOf, capable: Capable,
                    report: PrecisionReport | None = None) -> Program:
    """``program`` with its float32 compute in float16 where safe (see the module docstring;
    a new program: ``program`` is not changed). Inputs, outputs and their values keep their
    types; every value an op computes in float16 is a new value named ``<value>.fp16``."""
    report = report or PrecisionReport("fp16")
    constant_data = {v.id: data for v, data in program.constants}
    constants = list(program.constants)
    low: dict[int, Value] = {}      # value id -> its float16 form
    lowered: set[int] = set()       # value ids whose producer now computes in float16 (the float32 form is a cast)
    high_made: set[int] = set()     # of those, the ones whose float32 form has been cast back
    ops: list[Op] = []

    def cast(src: Value, out: Value) -> None:
        ops.append(Op("dispatch", "cast", (src,), (out,), canonical_attrs({"dtype": str(out.type.dtype)}),
                      None))
        report.casts += 1

    def as_low(v: Value) -> Value:
        found = low.get(v.id)
        if found is not None:
            return found
        out = Value(TensorType(v.type.shape, _F16), f"{v.name}.fp16", v.program_id)
        if v.id in constant_data:  # a weight: converted once, here
            data = to_float16(constant_data[v.id])
            constants.append((out, data))
            report.constants += 1
            report.constant_bytes += data.nbytes
        else:
            cast(v, out)
        low[v.id] = out
        return out

    def as_high(v: Value) -> Value:
        if v.id in lowered and v.id not in high_made:
            cast(low[v.id], v)
            high_made.add(v.id)
        return v

    for op in program.ops:
        floats = [v for v in op.inputs if v.type.dtype == _F32]
        is_low = [v.id in lowered for v in floats]
        mode = "keep"
        if op.kind == "dispatch" and floats:
            if op.name in LOWER or _backend_contraction(op.name):
                mode = "lower"
            elif op.name in FOLLOW:
                # Promotion: a float32 operand computed at run time keeps the op in float32;
                # constants adopt the float16 type (as a Python scalar does in torch).
                if any(is_low) and all(lo or v.id in constant_data for v, lo in zip(floats, is_low)):
                    mode = "lower"
            elif any(v.type.dtype == _F32 for v in op.outputs):
                report.kept[op.name] += 1
        if mode == "lower" and not _check(op, "fp16", device_of, capable, report):
            mode = "keep"
        if mode == "keep":
            inputs = tuple(as_high(v) for v in op.inputs)
            ops.append(op if inputs == op.inputs else dataclasses.replace(op, inputs=inputs))
            continue
        inputs = tuple(as_low(v) if v.type.dtype == _F32 else v for v in op.inputs)
        out_types = infer_types(op.name, tuple(v.type for v in inputs), op.attr_dict)
        outputs = []
        for v, t in zip(op.outputs, out_types):
            if t == v.type:  # not a float result (argmax, a comparison) or one cast to a fixed type
                outputs.append(v)
                continue
            new = Value(t, f"{v.name}.fp16", v.program_id)
            low[v.id] = new
            lowered.add(v.id)
            outputs.append(new)
        ops.append(dataclasses.replace(op, inputs=inputs, outputs=tuple(outputs)))
        report.changed[op.name] += 1
    outputs = [as_high(v) for v in program.outputs]
    used = {v.id for op in ops for v in op.inputs} | {v.id for v in outputs}
    return dataclasses.replace(program, ops=ops, outputs=outputs,
                               constants=[(v, d) for v, d in constants if v.id in used])
