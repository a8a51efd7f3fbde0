"""Program IR: values with tensor types, and ops (dispatches, transfers) over them.

Programs are built with :class:`ProgramBuilder` (or a front end such as ONNX), then compiled
into a :class:`~polyhal.plan.Plan` by :func:`polyhal.compile`.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from polyhal.errors import PolyhalError, ProgramError, ShapeError
from polyhal.ir.types import Affinity, SymbolicDim, TensorType, as_dtype, as_shape
from polyhal.ir.encoding import Encoding
from polyhal.ops import OPS, canonical_attrs, infer_types

_ids = itertools.count()


@dataclass(eq=False)
class Value:
    """An SSA value: produced once (by an op, or as a program input), used by any number of ops."""

    type: TensorType
    name: str
    program_id: int
    id: int = field(default_factory=lambda: next(_ids))

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


@dataclass(eq=False)
class Op:
    """One op of a program.

    ``kind`` is ``"dispatch"`` (run kernel ``name`` on one device), ``"transfer"`` (copy a
    value to another device; inserted by placement) or ``"encode"`` (IREE's
    ``flow.tensor.encode``: the same value from its operand's encoding to its result's, either
    may be None; it folds away or becomes pack/unpack dispatches in MaterializeEncoding).
    ``attrs`` are canonical (hashable).
    ``affinity`` is where the program allows it to run (None: any compile-time device).
    ``device`` is filled in by placement.
    """

    kind: str
    name: str
    inputs: tuple[Value, ...]
    outputs: tuple[Value, ...]
    attrs: tuple = ()
    affinity: Affinity | None = None
    device: str | None = None

    @property
    def attr_dict(self) -> dict[str, Any]:
        return dict(self.attrs)

    def __str__(self) -> str:
        outs = ", ".join(f"%{v.name}" for v in self.outputs)
        ins = ", ".join(f"%{v.name}" for v in self.inputs)
        attrs = "".join(f" {k}={v!r}" for k, v in self.attrs)
        where = f" @{self.device}" if self.device else (f" @{self.affinity}" if self.affinity else "")
        types = ", ".join(str(v.type) for v in self.outputs)
        return f"{outs} = {self.kind}.{self.name}({ins}){attrs}{where} : {types}"


@dataclass(eq=False)
class Program:
    """A straight-line tensor program: inputs, ops in execution order, outputs.

    ``constants`` are values whose data is part of the program (weights, folded tables), as
    ``(value, array)`` pairs: a plan uploads each once, to every device that uses it, when it
    is compiled, so a run binds only the inputs.
    """

    name: str
    inputs: list[Value]
    ops: list[Op]
    outputs: list[Value]
    constants: list[tuple[Value, np.ndarray]] = field(default_factory=list)

    # -- symbolic dims ------------------------------------------------------------------------

    @property
    def is_static(self) -> bool:
        """True when no input has a symbolic dim (then no value has one)."""
        return all(v.type.is_static for v in self.inputs)

    @property
    def symbols(self) -> list[str]:
        """The named symbolic dims of the inputs, in order of first use."""
        return list(dict.fromkeys(d.name for v in self.inputs for d in v.type.shape if isinstance(d, SymbolicDim)))

    def bind(self, shapes: Sequence[Sequence[int]]) -> dict[str, int]:
        """The size of each symbolic dim given one call's input ``shapes`` (in input order).

        ShapeError when a shape has the wrong rank, a fixed dim another size, or a symbol two
        sizes (the message names the dim, both sizes and where each came from).
        """
        if len(shapes) != len(self.inputs):
            raise ProgramError(f"program {self.name!r} takes {len(self.inputs)} inputs, got {len(shapes)} shapes")
        sizes: dict[str, tuple[int, str]] = {}
        for v, shape in zip(self.inputs, shapes):
            want = v.type.shape
            if len(shape) != len(want):
                raise ShapeError(f"input %{v.name} expects rank {len(want)} ({v.type}), got shape {tuple(shape)}")
            for axis, (dim, got) in enumerate(zip(want, shape)):
                where = f"input %{v.name} dim {axis}"
                if isinstance(dim, SymbolicDim):
                    seen = sizes.setdefault(dim.name, (int(got), where))
                    if seen[0] != got:
                        raise ShapeError(f"symbolic dim {dim.name!r} has two sizes in one call: {seen[0]} ({seen[1]}) "
                                         f"and {got} ({where}); give every use of a symbol the same size")
                elif dim != got:
                    raise ShapeError(f"{where} is fixed at {dim} ({v.type}), got {got} (shape {tuple(shape)})")
        return {name: size for name, (size, _) in sizes.items()}

    def specialize(self, sizes: Mapping[str, int]) -> "Program":
        """This program with each named symbolic dim at its size in ``sizes`` and every op's
        result types inferred again from the concrete operands (derived dims become sizes).

        Values keep their names and ids, so what a front end keyed by value id (the ONNX
        importer's ``origins``) still holds; a subclass's other fields are kept as they are.
        ShapeError when an op does not hold at these sizes (says which sizes).
        """
        missing = [s for s in self.symbols if s not in sizes]
        if missing:
            raise ShapeError(f"program {self.name!r}: no size for symbolic dim(s) {missing}")
        values: dict[int, Value] = {}

        def concrete(v: Value, t: TensorType) -> Value:
            values[v.id] = new = Value(t, v.name, v.program_id, v.id)
            return new

        inputs = [concrete(v, TensorType(tuple(sizes[d.name] if isinstance(d, SymbolicDim) else d
                                               for d in v.type.shape), v.type.dtype, v.type.encoding))
                  for v in self.inputs]
        ops = []
        for op in self.ops:
            ins = tuple(values.get(v.id, v) for v in op.inputs)
            if op.kind == "dispatch":
                try:
                    types = infer_types(op.name, [v.type for v in ins], dict(op.attrs))
                except PolyhalError as exc:
                    bound = ", ".join(f"{k}={n}" for k, n in sizes.items())
                    raise type(exc)(f"program {self.name!r} specialized to {bound}: {self.origin(op)}: {exc}") from None
            else:  # encode and transfer keep the operand's shape
                types = tuple(TensorType(ins[0].type.shape, ins[0].type.dtype, v.type.encoding) for v in op.outputs)
            outs = tuple(concrete(v, t) for v, t in zip(op.outputs, types))
            ops.append(Op(op.kind, op.name, ins, outs, op.attrs, op.affinity, op.device))
        return dataclasses.replace(self, inputs=inputs, ops=ops, outputs=[values.get(v.id, v) for v in self.outputs])

    def origin(self, op: Op) -> str:
        """What messages call ``op``: its first result (a front end's program names its source,
        as the ONNX one names the node)."""
        return f"%{op.outputs[0].name}" if op.outputs else op.name

    def __str__(self) -> str:
        head = ", ".join(repr(v) for v in self.inputs)
        body = "\n".join([f"  %{v.name} = constant : {v.type}" for v, _ in self.constants]
                         + [f"  {op}" for op in self.ops])
        tail = ", ".join(f"%{v.name}" for v in self.outputs)
        return f"program @{self.name}({head}) {{\n{body}\n  return {tail}\n}}"


def uses_and_producers(program: Program) -> tuple["collections.Counter[int]", dict[int, Op]]:
    """For rewrite passes: how many times each value id is read (outputs count as reads), and
    the op producing each value id."""
    uses: collections.Counter[int] = collections.Counter()
    for op in program.ops:
        for v in op.inputs:
            uses[v.id] += 1
    for v in program.outputs:
        uses[v.id] += 1
    return uses, {v.id: op for op in program.ops for v in op.outputs}


def consumers_of(program: Program) -> dict[int, list[Op]]:
    """For rewrite passes: the ops reading each value id, in program order."""
    consumers: dict[int, list[Op]] = collections.defaultdict(list)
    for op in program.ops:
        for v in op.inputs:
            consumers[v.id].append(op)
    return consumers


class ProgramBuilder:
    """Builds a :class:`Program` op by op, checking shapes and element types as it goes.

    Example::

        b = ProgramBuilder("axpy")
        x = b.input("x", (16,), "float32")
        y = b.input("y", (16,), "float32")
        b.output(b.add(b.mul(x, x), y))
        program = b.build()

    Every op of :mod:`polyhal.ops` is a method (``b.matmul(a, w)``); :meth:`op` is the general
    form and takes ``affinity=`` (a device name or :func:`~polyhal.ir.types.Optimal`).
    """

    def __init__(self, name: str = "main") -> None:
        self.name = name
        self._id = next(_ids)
        self._inputs: list[Value] = []
        self._ops: list[Op] = []
        self._outputs: list[Value] = []
        self._constants: list[tuple[Value, np.ndarray]] = []
        self._names: set[str] = set()
        # base -> the suffix its next fresh name tries first: every smaller one is taken (names are
        # never given back), so a chain of n adds names them in O(n), not O(n^2).
        self._suffix: dict[str, int] = {}

    def _fresh(self, base: str) -> str:
        n = self._suffix.get(base, 0)
        name = f"{base}{n}" if n else base
        while name in self._names:
            n += 1
            name = f"{base}{n}"
        self._names.add(name)
        self._suffix[base] = n + 1
        return name

    def input(self, name: str, shape: Any, dtype: Any = "float32") -> Value:
        """Declare a program input of a shape and element type.

        A dim may be a name instead of a size (``b.input("x", ("batch", 256))``): a symbolic
        dim, the same dim wherever the name is used. Each call of the compiled program binds it
        to the size its inputs have, and runs a plan specialized for those sizes (see
        :func:`polyhal.compile`).
        """
        if name in self._names:
            raise ProgramError(f"program {self.name!r} already has a value named {name!r}")
        self._names.add(name)
        value = Value(TensorType(as_shape(shape), as_dtype(dtype)), name, self._id)
        self._inputs.append(value)
        return value

    def constant(self, data: Any, name: str = "const", dtype: Any = None, *, copy: bool = True) -> Value:
        """A value holding ``data`` (copied, read-only), part of the program like a weight.

        ``copy=False`` takes a read-only C-ordered array of the right type as it is, without a
        second copy of a model's weights; the caller promises that nothing writes it later.
        """
        arr = np.array(data, dtype=dtype, copy=None if not copy and not _writeable(data) else True, order="C")
        arr.flags.writeable = False
        value = Value(TensorType(as_shape(arr.shape), as_dtype(arr.dtype)), self._fresh(name), self._id)
        self._constants.append((value, arr))
        return value

    def op(self, name: str, *inputs: Value, affinity: Affinity | str | None = None,
           **attrs: Any) -> Value | tuple[Value, ...]:
        """Append a dispatch of op ``name``; returns its result (a tuple if it has several)."""
        for i, v in enumerate(inputs):
            if not isinstance(v, Value):
                raise ProgramError(f"{name}: operand {i} is {type(v).__name__}, not a value of this program; "
                                   "declare data with builder.input()")
            if v.program_id != self._id:
                raise ProgramError(f"{name}: operand {i} (%{v.name}) belongs to another program")
        return self.append(name, inputs, infer_types(name, tuple(v.type for v in inputs), attrs), attrs, affinity)

    def append(self, name: str, inputs: Sequence[Value], out_types: Sequence[TensorType],
               attrs: Mapping[str, Any], affinity: Affinity | str | None = None) -> Value | tuple[Value, ...]:
        """Append a dispatch of op ``name`` whose result types the caller has already inferred
        (``infer_types(name, input types, attrs)``: a front end that infers them to decide whether
        to fold the op need not infer them twice); :meth:`op` checks operands and infers."""
        if isinstance(affinity, str):
            affinity = Affinity((affinity,))
        outs = tuple(Value(t, self._fresh(name), self._id) for t in out_types)
        self._ops.append(Op("dispatch", name, tuple(inputs), outs, canonical_attrs(attrs), affinity))
        return outs[0] if len(outs) == 1 else outs

    def encode(self, value: Value, encoding: Any) -> Value:
        """The same tensor with ``encoding`` (a :class:`polyhal.ir.encoding.Encoding`, or None
        to drop it): set_encoding and unset_encoding are both this op. See
        :mod:`polyhal.ir.encoding`."""
        if not isinstance(value, Value) or value.program_id != self._id:
            raise ProgramError(f"encode: {value!r} is not a value of program {self.name!r}")
        if encoding is not None:
            if not isinstance(encoding, Encoding):
                raise ProgramError(f"encode: {encoding!r} is not a polyhal.ir.encoding.Encoding (or None)")
            encoding.check_type(TensorType(value.type.shape, value.type.dtype))
        out = Value(TensorType(value.type.shape, value.type.dtype, encoding), self._fresh("encode"), self._id)
        self._ops.append(Op("encode", "encode", (value,), (out,)))
        return out

    def __getattr__(self, name: str) -> Any:
        if name in OPS:
            return lambda *inputs, **attrs: self.op(name, *inputs, **attrs)
        raise AttributeError(f"ProgramBuilder has no attribute or op {name!r}")

    def output(self, *values: Value) -> None:
        """Mark values as program results, in order."""
        for v in values:
            if not isinstance(v, Value) or v.program_id != self._id:
                raise ProgramError(f"output {v!r} is not a value of program {self.name!r}")
        self._outputs.extend(values)

    def build(self) -> Program:
        """The finished program (the builder may keep being used for another)."""
        if not self._outputs:
            raise ProgramError(f"program {self.name!r} has no outputs; call builder.output(...)")
        return Program(self.name, list(self._inputs), list(self._ops), list(self._outputs),
                       list(self._constants))


def _writeable(data: Any) -> bool:
    return not isinstance(data, np.ndarray) or data.flags.writeable
