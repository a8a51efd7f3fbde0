"""What every kernel generator shares: device traits, element types, strided index math, and the
recipe a generator returns.

A generator (``polyhal_opencl/ops/*.py``) turns one op instance (op, attributes, operand types)
into a :class:`Recipe`: OpenCL C source specialised for those shapes (every extent and stride
is a literal, so there is no argument packing at run time and no dynamic local array), the
kernel launches in order, and the sizes of any scratch buffers the launches need (allocated
once, when the op is prepared). :mod:`polyhal_opencl.kernels` builds and binds recipes.

Kernel parameter convention: every buffer is two parameters, ``__global T* NAME_base`` and
``const ulong NAME_off`` (the element offset of the tensor in its buffer), declared with
:func:`param` and turned into ``__global T* NAME`` by :func:`prologue`. Element offsets let a
tensor start anywhere in a (pooled) buffer without sub-buffers, which need aligned origins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Callable, Sequence

import numpy as np

from polyhal.errors import KernelNotFoundError
from polyhal.hal.scratch import DEFAULT_PRIVATE_BYTES as CORE_PRIVATE_BYTES

# pyopencl is imported inside the functions that use it: without pyopencl the plugin still imports,
# lists no device and says why (plugin.enumerate_devices).

# ------------------------------------------------------------------------------- device traits


@dataclass(frozen=True)
class DeviceTraits:
    """The device properties kernel generation depends on (a value, so tests can vary them)."""

    name: str
    fp64: bool
    max_work_group_size: int
    local_mem_size: int
    #: Whether ``-cl-fp32-correctly-rounded-divide-sqrt`` is honoured (else / and sqrt may be 2.5 ulp off).
    correctly_rounded_div_sqrt: bool = False
    #: The largest row a single work-group sorts in local memory (rows above use the global merge sort).
    max_local_sort: int = 4096
    #: A CPU device (PoCL, Intel's CPU runtime): a work-item looping over contiguous memory is
    #: cache-friendly there, and work-group barriers are costly, so lane-per-work-item kernels win
    #: whenever there are enough lanes to fill the cores.
    is_cpu: bool = False
    compute_units: int = 1
    #: CL_DEVICE_NATIVE_VECTOR_WIDTH_FLOAT: floats per SIMD register (16 with AVX-512, 1 on GPUs).
    vector_width: int = 1
    #: CL_FP_FMA in CL_DEVICE_SINGLE_FP_CONFIG: fma() is a hardware instruction, not an emulation.
    fma: bool = False

    @classmethod
    def from_cl(cls, cl_device: Any) -> "DeviceTraits":
        """Traits of a pyopencl device (device queries only)."""
        import pyopencl as cl

        ext = cl_device.extensions.split()
        try:
            fp_config = int(cl_device.single_fp_config)
        except Exception:  # noqa: BLE001 - optional query
            fp_config = 0
        rounded = bool(fp_config & cl.device_fp_config.CORRECTLY_ROUNDED_DIVIDE_SQRT)
        try:
            vector_width = int(cl_device.native_vector_width_float)
        except Exception:  # noqa: BLE001
            vector_width = 1
        return cls(name=cl_device.name.strip(), fp64="cl_khr_fp64" in ext,
                   max_work_group_size=int(cl_device.max_work_group_size),
                   local_mem_size=int(cl_device.local_mem_size), correctly_rounded_div_sqrt=rounded,
                   is_cpu=bool(cl_device.type & cl.device_type.CPU),
                   compute_units=int(cl_device.max_compute_units), vector_width=max(vector_width, 1),
                   fma=bool(fp_config & cl.device_fp_config.FMA))

    def build_options(self) -> str:
        """Compiler options for every program: OpenCL C 1.2 (what the generators write), and
        correctly rounded float division and sqrt where the device offers it, so results match
        numpy's to the ulp."""
        opts = ["-cl-std=CL1.2"]
        if self.correctly_rounded_div_sqrt:
            opts.append("-cl-fp32-correctly-rounded-divide-sqrt")
        return " ".join(opts)

    def lane_per_work_item(self, lanes: int, lane: int) -> bool:
        """Whether ``lanes`` independent lanes of ``lane`` elements each should get one work-item
        each (rather than one work-group each): short lanes, or many lanes on a CPU device."""
        return lane <= 16 or (self.is_cpu and lanes >= 4 * self.compute_units)

    def work_group(self, want: int) -> int:
        """The power-of-two work-group size closest to ``want`` (at least 1) the device allows."""
        limit = 1 << (min(self.max_work_group_size, 256).bit_length() - 1)
        return max(1, min(next_pow2(want), limit))


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


#: Private bytes per work-item assumed for OpenCL devices of a type (``"cpu"``, ``"gpu"``, ... as
#: the plugin names CL_DEVICE_TYPE), which OpenCL has no query for: CPU devices keep private
#: arrays on the thread's stack, GPUs in registers (spilling beyond a few hundred bytes).
DEFAULT_PRIVATE_BYTES = {"cpu": 16384}


def private_bytes(kind: str) -> int:
    """The private-memory limit to declare for an OpenCL device of type ``kind`` (see
    :data:`DEFAULT_PRIVATE_BYTES`; the core's default elsewhere)."""
    return DEFAULT_PRIVATE_BYTES.get(kind, CORE_PRIVATE_BYTES)


# ------------------------------------------------------------------------------- element types


@dataclass(frozen=True)
class CType:
    """How one numpy element type is stored and computed with in OpenCL C.

    ``store`` is the C type of the buffer elements; ``compute`` the type arithmetic happens in
    (``float`` for half: half is a storage format everywhere through vload_half/vstore_half,
    even without cl_khr_fp16); ``unsigned`` the unsigned type of the compute width, used to make
    signed integer arithmetic wrap as numpy's does (signed overflow is undefined in C); ``kind``
    is numpy's kind letter ('b', 'i', 'u', 'f').
    """

    dtype: np.dtype
    store: str
    compute: str
    unsigned: str
    kind: str

    @property
    def is_float(self) -> bool:
        return self.kind == "f"

    @property
    def needs_fp64(self) -> bool:
        return "double" in (self.store, self.compute)

    def load(self, ptr: str, index: str) -> str:
        """C expression reading element ``index`` of ``ptr`` as a ``compute`` value."""
        if self.store == "half":
            return f"vload_half({index}, {ptr})"
        return f"{ptr}[{index}]"

    def store_stmt(self, ptr: str, index: str, value: str) -> str:
        """C statement writing ``value`` (any arithmetic type) to element ``index`` of ``ptr``,
        converting as numpy's ``astype`` does: nonzero is true, floats round to nearest even."""
        if self.store == "half":
            return f"vstore_half_rte((float)({value}), {index}, {ptr});"
        if self.kind == "b":
            return f"{ptr}[{index}] = (uchar)(({value}) != 0);"
        return f"{ptr}[{index}] = ({self.store})({value});"

    def lit(self, value: float) -> str:
        """A literal of the compute type (``0.5f`` for float, ``0.5`` for double)."""
        text = repr(float(value)) if math.isfinite(value) else ("INFINITY" if value > 0 else "-INFINITY")
        if self.compute == "float" and math.isfinite(value):
            text += "f"
        return f"(({self.compute}){text})"

    def lowest(self) -> str:
        """The smallest compute value (-inf for floats): the identity of max."""
        return _LIMITS[self.compute][0]

    def highest(self) -> str:
        """The largest compute value (+inf for floats): the identity of min."""
        return _LIMITS[self.compute][1]


_LIMITS = {
    "uchar": ("((uchar)0)", "((uchar)UCHAR_MAX)"), "char": ("((char)CHAR_MIN)", "((char)CHAR_MAX)"),
    "ushort": ("((ushort)0)", "((ushort)USHRT_MAX)"), "short": ("((short)SHRT_MIN)", "((short)SHRT_MAX)"),
    "uint": ("0u", "UINT_MAX"), "int": ("INT_MIN", "INT_MAX"), "ulong": ("0ul", "ULONG_MAX"),
    "long": ("LONG_MIN", "LONG_MAX"), "float": ("-INFINITY", "INFINITY"),
    "double": ("(-(double)INFINITY)", "((double)INFINITY)"),
}

#: numpy element type -> (store, compute, unsigned counterpart of compute).
_CTYPES = {
    "bool": ("uchar", "uchar", "uchar"), "int8": ("char", "char", "uchar"),
    "int16": ("short", "short", "ushort"), "int32": ("int", "int", "uint"),
    "int64": ("long", "long", "ulong"), "uint8": ("uchar", "uchar", "uchar"),
    "uint16": ("ushort", "ushort", "ushort"), "uint32": ("uint", "uint", "uint"),
    "uint64": ("ulong", "ulong", "ulong"), "float16": ("half", "float", "uint"),
    "float32": ("float", "float", "uint"), "float64": ("double", "double", "ulong"),
}
#: Same-width unsigned types: data movement copies bits, so it needs no fp64 and keeps nan payloads.
_BITS = {1: "uchar", 2: "ushort", 4: "uint", 8: "ulong"}


def ctype(dtype: Any, traits: DeviceTraits, op: str = "") -> CType:
    """The :class:`CType` for arithmetic on ``dtype``; KernelNotFoundError when the device
    cannot compute with it (float64 without cl_khr_fp64)."""
    dt = np.dtype(dtype)
    if dt.name not in _CTYPES:  # the IR's storage types (bfloat16, float8, int4, ...)
        raise KernelNotFoundError(
            f"{op or 'this op'} on {dt} has no OpenCL kernel (OpenCL converts the storage-only types with "
            "cast and moves them, but computes nothing else on them); cast to float32 first, or run it on cpu:0")
    store, compute, unsigned = _CTYPES[dt.name]
    t = CType(dt, store, compute, unsigned, dt.kind)
    if t.needs_fp64 and not traits.fp64:
        raise KernelNotFoundError(
            f"{op or 'this op'} on float64 needs cl_khr_fp64, which {traits.name} lacks; cast to float32 "
            "first or run the op on another device")
    return t


def bits_ctype(dtype: Any) -> CType:
    """A :class:`CType` that moves ``dtype``'s elements as raw bits (for data-movement kernels)."""
    dt = np.dtype(dtype)
    b = _BITS[dt.itemsize]
    return CType(dt, b, b, b, "u")


def bits_literal(value: Any, dtype: Any) -> str:
    """``value`` converted to ``dtype`` (numpy's astype), as a literal of its bits type."""
    dt = np.dtype(dtype)
    raw = int(np.asarray(value).astype(dt).reshape(1).view(f"u{dt.itemsize}")[0])
    b = _BITS[dt.itemsize]
    return f"(({b}){raw}{'ul' if dt.itemsize == 8 else 'u'})"


def header(*types: CType, fp64: bool = False) -> str:
    """The pragmas a source needs for the types it uses (``fp64``: it uses double otherwise)."""
    if fp64 or any(t.needs_fp64 for t in types):
        return "#pragma OPENCL EXTENSION cl_khr_fp64 : enable\n"
    return ""


def param(name: str, store: str, const: bool = False) -> str:
    """The two kernel parameters of buffer ``name`` (see the module docstring)."""
    q = "const " if const else ""
    return f"__global {q}{store}* {name}_base, const ulong {name}_off"


def prologue(*names_and_types: tuple[str, str, bool]) -> str:
    """``__global T* NAME = NAME_base + NAME_off;`` for each ``(name, store, const)``."""
    return "".join(f"  __global {'const ' if c else ''}{t}* {n} = {n}_base + {n}_off;\n"
                   for n, t, c in names_and_types)


def cl_source(name: str) -> str:
    """The text of ``polyhal_opencl/cl/<name>`` (shipped as package data)."""
    return resources.files("polyhal_opencl").joinpath("cl", name).read_text(encoding="utf-8")


def defines(**values: Any) -> str:
    """``#define KEY VALUE`` lines, for specialising a hand-written ``.cl`` template."""
    return "".join(f"#define {k} {_c_value(v)}\n" for k, v in values.items())


def _c_value(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v)


# ----------------------------------------------------------------------------- strided indexing


def collapse(shape: Sequence[int], strides: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """Drop size-1 dims and merge neighbours that every operand walks contiguously, so that the
    index math of e.g. a dense add is one dim however many the tensors have.

    ``strides`` is one stride list (in elements, 0 for broadcast dims) per operand, all over
    ``shape``. Returns the new shape and stride lists (equivalent for every operand).
    """
    dims = [i for i, d in enumerate(shape) if d != 1]
    out_shape: list[int] = []
    out_strides: list[list[int]] = [[] for _ in strides]
    for i in dims:
        if out_shape and all(s[-1] == st[i] * shape[i] for s, st in zip(out_strides, strides)):
            out_shape[-1] *= shape[i]
            for s, st in zip(out_strides, strides):
                s[-1] = st[i]
        else:
            out_shape.append(shape[i])
            for s, st in zip(out_strides, strides):
                s.append(st[i])
    return tuple(out_shape), [tuple(s) for s in out_strides]


def dense_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides of ``shape``."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(out))


def broadcast_strides(shape: Sequence[int], full: Sequence[int]) -> tuple[int, ...]:
    """Element strides that read a dense tensor of ``shape`` broadcast to ``full`` (numpy rules:
    dims aligned from the right; absent or size-1 dims get stride 0)."""
    dense = dense_strides(shape)
    lead = len(full) - len(shape)
    return tuple(0 if i < lead or shape[i - lead] == 1 else dense[i - lead] for i in range(len(full)))


def index_type(*extents: int) -> str:
    """``int`` when every index and offset fits in 31 bits, else ``long``."""
    return "int" if max((abs(e) for e in extents), default=0) < 2**31 - 1 else "long"


def offsets_code(linear: str, shape: Sequence[int], strides: Sequence[Sequence[int]],
                 names: Sequence[str], idx: str, tag: str = "") -> str:
    """C statements declaring ``idx NAME = <offset>`` for each operand, from the row-major
    ``linear`` index over ``shape`` (div/mod by literal extents; the outermost dim needs none).
    ``tag`` keeps the helper variables of two decompositions in one scope apart."""
    lines = [f"  {idx} {n} = 0;\n" for n in names]
    if not shape:
        return "".join(lines)
    rest = f"rest{tag}_"
    lines.append(f"  {idx} {rest} = ({idx})({linear});\n")
    for d in range(len(shape) - 1, -1, -1):
        coord = f"c{d}{tag}_"
        if d == 0:
            lines.append(f"  {idx} {coord} = {rest};\n")
        else:
            lines.append(f"  {idx} {coord} = {rest} % {shape[d]}; {rest} /= {shape[d]};\n")
        for n, s in zip(names, strides):
            if s[d]:
                lines.append(f"  {n} += {coord} * {s[d]};\n")
    return "".join(lines)


# ---------------------------------------------------------------------------------------- recipe


@dataclass(frozen=True)
class Arg:
    """A buffer argument of a launch: operand ``index`` (inputs first, then outputs), scratch
    buffer ``index`` when ``scratch``, or the recipe's error flag when ``flag`` (see :class:`Check`)."""

    index: int
    scratch: bool = False
    flag: bool = False


#: The launch argument of a recipe's error flag.
FLAG = Arg(0, flag=True)


@dataclass(frozen=True)
class Launch:
    """One ``clEnqueueNDRangeKernel``: kernel ``kernel`` of the recipe's source over ``gsize``
    (``lsize`` None lets the driver choose), with buffer ``args`` then the fixed ``scalars``
    (ints passed as ``long``, set once when prepared)."""

    kernel: str
    gsize: tuple[int, ...]
    lsize: tuple[int, ...] | None
    args: tuple[Arg, ...]
    scalars: tuple[int, ...] = ()


@dataclass(frozen=True)
class Copy:
    """A buffer-to-buffer copy of ``nbytes`` from operand ``src`` to operand ``dst``."""

    src: int
    dst: int
    nbytes: int


@dataclass(frozen=True)
class Check:
    """Where data can leave an op's domain (an integer division by zero), kernels set the
    recipe's error flag, an ``int`` buffer argument (:data:`FLAG`, zero while all is well),
    instead of writing an unspecified value silently. This step, after them, reads the flag
    back (it waits for the device) and, where it is set, clears it and raises
    :class:`~polyhal.errors.ArithmeticDomainError` with ``message``."""

    message: str


@dataclass
class Recipe:
    """A prepared op: its source, its steps in order, and scratch buffer sizes in bytes."""

    source: str
    steps: list[Launch | Copy | Check] = field(default_factory=list)
    scratch: list[int] = field(default_factory=list)


def operands(n_in: int, n_out: int) -> tuple[list[Arg], list[Arg]]:
    """``Arg`` lists for the inputs and the outputs of an op."""
    return [Arg(i) for i in range(n_in)], [Arg(n_in + i) for i in range(n_out)]


def strided_kernel(name: str, shape: Sequence[int], views: Sequence[tuple[str, CType, Sequence[int], bool]],
                   body: Callable[[dict[str, str]], str], extra_params: str = "", extent: int = 0) -> str:
    """One kernel over the elements of ``shape``: each work-item computes the element offset of
    every view (name, type, strides over ``shape``, read-only) and runs ``body(offsets)``,
    where ``offsets`` maps a view name to the C variable holding its offset. ``extent`` bounds
    any further offset the body computes (it picks 32- or 64-bit index math).

    Dims are collapsed first (:func:`collapse`), so dense and simply broadcast operands cost one
    multiply-add per view.
    """
    total = math.prod(shape)
    cshape, cstrides = collapse(shape, [v[2] for v in views])
    extent = max([total, extent] + [sum(abs(s) * (d - 1) for s, d in zip(st, cshape)) for st in cstrides])
    idx = index_type(extent)
    params = ", ".join(param(v[0], v[1].store, v[3]) for v in views) + extra_params
    offs = {v[0]: f"o_{v[0]}" for v in views}
    return (
        f"__kernel void {name}({params}) {{\n"
        + prologue(*((v[0], v[1].store, v[3]) for v in views))
        + f"  const size_t gid = get_global_id(0);\n  if (gid >= {total}) return;\n"
        + offsets_code("gid", cshape, cstrides, list(offs.values()), idx)
        + body(offs) + "\n}\n"
    )


def coords_code(linear: str, shape: Sequence[int], idx: str, prefix: str = "c") -> str:
    """C statements declaring ``idx c0 .. c{r-1}``: the coordinates of the row-major ``linear``
    index over ``shape`` (for kernels whose index math is per dim, e.g. padding or windows)."""
    if not shape:
        return ""
    lines = [f"  {idx} {prefix}rest_ = ({idx})({linear});\n"]
    for d in range(len(shape) - 1, 0, -1):
        lines.append(f"  const {idx} {prefix}{d} = {prefix}rest_ % {shape[d]}; {prefix}rest_ /= {shape[d]};\n")
    lines.append(f"  const {idx} {prefix}0 = {prefix}rest_;\n")
    return "".join(lines)


def coord_kernel(name: str, shape: Sequence[int], params: Sequence[tuple[str, str, bool]],
                 body: Callable[[str], str], extent: int = 0) -> str:
    """One kernel over the elements of ``shape``: ``body(idx)`` is C code that sees ``gid`` and
    the coordinates ``c0..c{r-1}``, of the C index type ``idx`` (int or long, by ``extent``, a
    bound on the element offsets the body computes). ``params`` are ``(name, store type,
    read-only)`` buffers."""
    total = math.prod(shape)
    idx = index_type(max(total, extent))
    return (
        f"__kernel void {name}({', '.join(param(n, t, c) for n, t, c in params)}) {{\n"
        + prologue(*params)
        + f"  const size_t gid = get_global_id(0);\n  if (gid >= {total}) return;\n"
        + coords_code("gid", shape, idx) + body(idx) + "\n}\n"
    )


def linear_launch(kernel: str, total: int, args: Sequence[Arg], traits: DeviceTraits) -> list[Launch]:
    """One work-item per element (none when ``total`` is 0: an empty NDRange is an error)."""
    if total == 0:
        return []
    wg = traits.work_group(min(total, 256))
    return [Launch(kernel, (round_up(total, wg),), (wg,), tuple(args))]


def group_reduce_fn(name: str, t: str, combine: Callable[[str, str], str], wg: int) -> str:
    """A C function ``t name(t v, __local t* scratch)`` combining ``v`` over the work-group of
    ``wg`` (a power of two) work-items by a tree in local memory; every work-item gets the
    result. ``combine(a, b)`` is a C expression; the final barrier makes ``scratch`` reusable."""
    return (
        f"inline {t} {name}({t} v, __local {t}* s) {{\n"
        f"  const int lid = get_local_id(0);\n  s[lid] = v;\n  barrier(CLK_LOCAL_MEM_FENCE);\n"
        f"  for (int k = {wg // 2}; k > 0; k >>= 1) {{\n"
        f"    if (lid < k) {{ {t} a = s[lid], b = s[lid + k]; s[lid] = {combine('a', 'b')}; }}\n"
        f"    barrier(CLK_LOCAL_MEM_FENCE);\n  }}\n"
        f"  {t} r = s[0];\n  barrier(CLK_LOCAL_MEM_FENCE);\n  return r;\n}}\n"
    )


def accumulator(t: CType, traits: DeviceTraits) -> str:
    """The type sums of ``t`` accumulate in: double for floats where the device has fp64 (sums
    of thousands of float32 terms then round once, as numpy's float64 reference does), else the
    compute type; the unsigned type for integers, so overflow wraps as numpy's does."""
    if t.is_float:
        return "double" if traits.fp64 else t.compute
    return t.unsigned
