"""Shape-polymorphic ONNX models: loaded once, a plan specialized per concrete input shape.

:func:`polyhal.onnx.load` returns an :class:`OnnxProgram` (static shapes) when every input
dim is known: fixed in the model, or given with ``shapes=``, ``dims=`` or ``default_dim=``.
Otherwise it returns a :class:`DynamicOnnxProgram`: the validated model, its input signature
and, where the model's ops allow it, :attr:`~DynamicOnnxProgram.program`: the model imported
once as a core program with symbolic dims (``float[batch,256]`` is ``tensor<batchx256xfloat32>``).
Its :meth:`~DynamicOnnxProgram.compile` gives a :class:`DynamicPlan` (a core
:class:`~polyhal.plan.PolymorphicPlan`) that, called with inputs of a shape it has not seen,
specializes that program to the shape (:meth:`polyhal.ir.program.Program.specialize`: types
inferred again, nothing re-imported), compiles it (one compile) and caches the pair in a
bounded LRU :class:`~polyhal.specialization.SpecializationCache`; a call with a shape seen
before costs one lookup (the shape dispatch, measured by ``python -m bench dynamic_shapes``).

Where the import needs a symbol's size -- a ``Shape`` of a symbolic dim, a shape computed from
one (a Reshape's target, an Expand, a ConstantOfShape), an attribute that would hold it, or
inputs and outputs the host makes (strings, run-time lengths) -- the model is imported per
concrete shape instead, as it was before the core had symbolic dims;
:attr:`~DynamicOnnxProgram.reimport` says why and ``explain`` prints it. The front end only
translates: the core's importer folds shape subgraphs into constants, and a shape computed from
a symbol has no constant.

How ``dims=`` fits: a symbol given in ``dims=`` is *bound*: every call must use that size for
it (an error names the dim and both sizes otherwise); symbols not given are free and take the
size of each call's inputs. A symbol that appears in several inputs (or twice in one) must have
one size within a call, and a dim the model fixes must have that size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from polyhal.errors import ProgramError
from polyhal.frontends.onnx.errors import OnnxInputError
from polyhal.frontends.onnx.types import STRING_DTYPE, as_strings
from polyhal.plan import PolymorphicPlan
from polyhal.specialization import Specialization, SpecializationCache

__all__ = ["DynamicOnnxProgram", "DynamicPlan", "InputSignature", "Specialization", "bind_dims"]

Dim = int | str | None  # a fixed size, a named symbol, or an unnamed dynamic dim
#: Input shapes a program remembers as checked (beyond, each call checks its shapes again).
_BOUND_SHAPES = 64


@dataclass(frozen=True)
class InputSignature:
    """A graph input as the model declares it: element type and dims (int: fixed; str: a named
    symbol; None: an unnamed dynamic dim; ``dims`` None: the rank is not declared)."""

    name: str
    dtype: np.dtype
    dims: tuple[Dim, ...] | None
    declared: str


def check_input_names(source: str, feeds: Mapping[str, Any], names: Sequence[str],
                      declared: Mapping[str, Any], listing: str) -> None:
    """OnnxInputError for a feed the model does not take, or an input missing from ``feeds``."""
    if len(feeds) == len(names) and all(n in feeds for n in names):
        return  # every input and nothing else: the common call builds nothing
    extra = [k for k in feeds if k not in names]
    if extra:
        raise OnnxInputError(f"{source}: the model has no input {extra[0]!r}; its inputs are {listing}")
    missing = [n for n in names if n not in feeds]
    if missing:
        raise OnnxInputError(f"{source}: missing input {missing[0]!r} ({declared.get(missing[0], '')}); "
                             f"its inputs are {listing}")


def feed_array(source: str, name: str, x: Any, dtype: np.dtype, declared: Any) -> np.ndarray:
    """Feed ``x`` of input ``name`` as a numpy array (strings as arrays of str) of element type ``dtype``."""
    if dtype == STRING_DTYPE:  # strings stay on the host
        arr = as_strings(x, f"{source}: input {name!r} (declared {declared})")
    else:
        arr = x.numpy() if hasattr(x, "numpy") and not isinstance(x, np.ndarray) else np.asarray(x)
    if arr.dtype != dtype:
        raise OnnxInputError(f"{source}: input {name!r} must be {dtype} (declared {declared}), got {arr.dtype}")
    return arr


def bind_dims(source: str, signature: Sequence[InputSignature], shapes: Sequence[tuple[int, ...]],
              bound: Mapping[str, int]) -> dict[str, int]:
    """Check input ``shapes`` (one per entry of ``signature``) against the declared dims and
    return the size of every named symbol, ``bound`` ones included. OnnxInputError names the
    input, the dim and both sizes of a contradiction: a fixed dim given another size, one symbol
    at two sizes, or a symbol bound at load (``dims=``) given another."""
    sizes: dict[str, tuple[int, str]] = {k: (v, "dims= at load") for k, v in bound.items()}
    for sig, shape in zip(signature, shapes):
        if sig.dims is None:
            continue
        if len(shape) != len(sig.dims):
            raise OnnxInputError(f"{source}: input {sig.name!r} must have rank {len(sig.dims)} "
                                 f"(declared {sig.declared}), got shape {tuple(shape)}")
        for axis, (want, got) in enumerate(zip(sig.dims, shape)):
            where = f"input {sig.name!r} dim {axis}"
            if isinstance(want, int):
                if want != got:
                    raise OnnxInputError(f"{source}: {where} is fixed at {want} by the model (declared "
                                         f"{sig.declared}), got {got}")
            elif isinstance(want, str):
                seen = sizes.setdefault(want, (got, where))
                if seen[0] != got:
                    raise OnnxInputError(f"{source}: symbolic dim {want!r} has two sizes: {seen[0]} ({seen[1]}) "
                                         f"and {got} ({where}); one call gives each symbol one size")
    return {k: v for k, (v, _) in sizes.items()}


class DynamicOnnxProgram:
    """An ONNX model with symbolic or unnamed input dims, loaded once.

    Compile it (:meth:`compile`) to get a :class:`DynamicPlan`, which specializes per input
    shape; or :meth:`specialize` it to the static :class:`OnnxProgram` of one shape. ``bound``
    holds the symbols fixed at load (``dims=``).
    """

    def __init__(self, *, source: str, opset: int, signature: Sequence[InputSignature],
                 output_names: Sequence[str], bound: Mapping[str, int],
                 specialize: Callable[[Mapping[str, tuple[int, ...]]], Any], program: Any = None,
                 reimport: str = "") -> None:
        self.source = source
        self.opset = opset
        self.signature = tuple(signature)
        self.output_names = list(output_names)
        self.bound = dict(bound)
        #: The model as one OnnxProgram with symbolic dims, specialized per shape by the core;
        #: None when it is imported per shape (``reimport`` says why).
        self.program = program
        #: Why the model is imported per shape ("" when :attr:`program` serves every shape).
        self.reimport = reimport
        self._specialize = specialize
        # What every call's checks read, made once: the input names, their declarations, the
        # listing errors print, and the input shapes already checked against the signature
        # (a shape that bound once binds again: the signature and ``bound`` do not change).
        self._names = tuple(s.name for s in self.signature)
        self._name_set = frozenset(self._names)
        self._declared = {s.name: s.declared for s in self.signature}
        self._listing_text = ", ".join(f"{s.name} ({s.declared})" for s in self.signature) or "(none)"
        self._bound_shapes: set[tuple] = set()

    @property
    def input_names(self) -> list[str]:
        """Names of the inputs a run takes, in order."""
        return [s.name for s in self.signature]

    @property
    def declared_inputs(self) -> dict[str, str]:
        """Input name -> its declared type, as text (``float[batch,20]``)."""
        return {s.name: s.declared for s in self.signature}

    @property
    def symbols(self) -> list[str]:
        """The named symbolic dims of the inputs, in order of first use."""
        return list(dict.fromkeys(d for s in self.signature for d in (s.dims or ()) if isinstance(d, str)))

    # -- shapes ----------------------------------------------------------------------------

    def bind(self, shapes: Sequence[tuple[int, ...]]) -> dict[str, int]:
        """Check one call's input ``shapes`` (in input order) against the signature; returns the
        size of every named symbol (see :func:`bind_dims`)."""
        return bind_dims(self.source, self.signature, shapes, self.bound)

    def specialize(self, shapes: Mapping[str, Sequence[int]] | Sequence[tuple[int, ...]]):
        """The static :class:`OnnxProgram` for these input shapes (by name or in input order),
        after :meth:`bind` checked them."""
        if isinstance(shapes, Mapping):
            missing = [n for n in self.input_names if n not in shapes]
            if missing:
                raise OnnxInputError(f"{self.source}: no shape for input {missing[0]!r} "
                                     f"({self.declared_inputs[missing[0]]})")
            shapes = [tuple(int(d) for d in shapes[n]) for n in self.input_names]
        shapes = [tuple(int(d) for d in s) for s in shapes]
        self.bind(shapes)
        if self.program is not None:
            return self.program.specialize(self.program.bind(shapes))
        return self._specialize(dict(zip(self.input_names, shapes)))

    def check_feeds(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """``feeds`` as numpy arrays after checking names, element types and shapes (as
        :meth:`OnnxProgram.check_feeds` does for a static model)."""
        if feeds.keys() != self._name_set:  # (a set comparison in C for the common call)
            check_input_names(self.source, feeds, self._names, self._declared, self._listing_text)
        out = {sig.name: feed_array(self.source, sig.name, feeds[sig.name], sig.dtype, sig.declared)
               for sig in self.signature}
        shapes = tuple([a.shape for a in out.values()])
        if shapes not in self._bound_shapes:
            self.bind(shapes)
            if len(self._bound_shapes) < _BOUND_SHAPES:
                self._bound_shapes.add(shapes)
        return out

    def _listing(self) -> str:
        return self._listing_text

    # -- compiling and running -------------------------------------------------------------

    def compile(self, devices: Sequence[str] | str | None = None, *, strict: bool = False, registry=None,
                cache_size: int | None = None, **options: Any) -> "DynamicPlan":
        """A :class:`DynamicPlan`: compiles for ``devices`` (as :meth:`OnnxProgram.compile`) per
        input shape on first use, keeping at most ``cache_size`` specializations (default
        ``POLYHAL_SHAPE_CACHE``, else 16)."""
        def make(shapes: tuple[tuple[int, ...], ...]) -> Specialization:
            program = self.specialize(shapes)
            return Specialization(program, program.compile(devices, strict=strict, registry=registry, **options))

        return DynamicPlan(self, make, SpecializationCache(cache_size))

    def execute(self, plan: "DynamicPlan", feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Run ``plan`` on ``feeds`` (by name) and return the ONNX outputs by name."""
        spec = plan.lookup([feeds[n] for n in plan._names])
        return spec.program.execute(spec.plan, feeds)

    def run(self, feeds: Mapping[str, Any], devices: Sequence[str] | str | None = None, *,
            strict: bool = False) -> dict[str, np.ndarray]:
        """Compile, run once on ``feeds`` and return {output name: numpy array}."""
        feeds = self.check_feeds(feeds)
        return self.execute(self.compile(devices, strict=strict), feeds)

    def explain(self, plan: "DynamicPlan | None" = None) -> str:
        """The input signature; with ``plan``, its shape cache and the latest specialization's
        explanation."""
        how = (f"imported per input shape: {self.reimport}" if self.program is None
               else "one program with symbolic dims, specialized per input shape")
        lines = [f"model {self.source}: opset {self.opset}, shape-polymorphic ({how})"]
        for s in self.signature:
            lines.append(f"  input {s.name!r}: {s.declared}")
        if self.bound:
            lines.append("  bound at load: " + ", ".join(f"{k}={v}" for k, v in self.bound.items()))
        if plan is not None:
            lines.append(plan.explain())
        return "\n".join(lines)


class DynamicPlan(PolymorphicPlan):
    """A compiled shape-polymorphic model: call it like a :class:`~polyhal.plan.Plan`.

    The core's :class:`~polyhal.plan.PolymorphicPlan` (one key tuple and one cache lookup per
    call), with the model's own checks: on a miss the shapes are checked against the model's
    signature (OnnxInputError naming the input, the dim and both sizes), then the model's
    program is specialized to them (or imported for them) and compiled. ``cache`` holds the
    statistics (hits, misses, evictions); :meth:`explain` prints them with the cached shapes.
    """

    def __init__(self, program: DynamicOnnxProgram, make: Callable[[tuple], Specialization],
                 cache: SpecializationCache[Specialization]) -> None:
        super().__init__(program.source, program.input_names, make, cache, symbols=program.symbols)
        self.source = program

    def _gather(self, args: tuple, kwargs: dict) -> Sequence[Any]:
        try:
            return super()._gather(args, kwargs)
        except ProgramError as exc:  # the model's inputs: an input error of the model
            raise OnnxInputError(str(exc)) from None

    def explain(self) -> str:
        """Cache statistics, the cached shapes, and the most recently used plan's explanation."""
        names = self._names

        def describe(key: tuple) -> str:
            return ", ".join(f"{n}{list(s)}" for n, s in zip(names, key))

        lines = [self.cache.explain(describe)]
        specs = self.cache.values()
        if specs:
            lines.append("most recent specialization:")
            lines.append(specs[-1].program.explain(specs[-1].plan))
        return "\n".join(lines)
