"""oneDNN's C API through ctypes: the engine, memory descriptors, primitives with post-ops, reorders.

The library comes from the ``onednn-cpu-gomp`` wheel (oneDNN 3.2 on the system's GNU OpenMP; a
dependency of polyhal-cpu where the wheel exists: x86-64 Linux), loaded once per process from
the environment's ``lib/`` (or ``POLYHAL_CPU_ONEDNN_LIBRARY``). :func:`status` says whether it is
usable and why not; without it the CPU's own kernels run every op, and ``polyhal devices`` says
so (``limits["onednn"]``). ``POLYHAL_CPU_ONEDNN=0`` turns it off.

Why this wheel, measured on the 2-core VM (AVX2, 2026-12): ``onednn-cpu-gomp`` is one 39 MB
download, 158 MB installed (the library three times over: the wheel format has no symlinks),
links only the system's libgomp, and ``dlopen`` plus the engine take ~7 ms. ``onednn`` (2026.1,
oneDNN 3.13) pulls Intel's SYCL, OpenCL, TBB and OpenMP runtimes: 630 MB of wheels, 2.0 GB
installed, 50-460 ms to load, and it is a SYCL build whose CPU engine needs a SYCL CPU device
(none here: engine creation fails with ``invalid_arguments``).

Vocabulary (oneDNN's): a *memory descriptor* is shape, type and layout (plain strides, or a
blocked format such as ``nChw8c``: channels cut into blocks of 8, innermost); a *primitive
descriptor* is one op instance as the library will compute it, created on layouts ``any`` so the
library picks the one its fastest implementation wants; a *primitive* is its compiled code; a
*reorder* is a layout change. Post-ops (``sum``, ``eltwise``, ``binary``) finish a primitive's
output as it is stored. The scratchpad is in user mode: its size is a declared polyhal scratch,
placed by the plan's bufferization, and handed to every execution (nothing is allocated inside
a kernel).

Threads. oneDNN runs on OpenMP; its thread count is the CPU backend's budget
(:mod:`polyhal_cpu.threads`), given to OpenMP (``omp_set_num_threads``) before primitives are
created, since a primitive's work decomposition is fixed when it is created. The user's own
settings: ``OMP_NUM_THREADS`` is respected (the budget is already capped by it) unless
``POLYHAL_CPU_THREADS`` is set too, which overrides it with a warning; ``OMP_WAIT_POLICY`` and
``GOMP_SPINCOUNT`` are respected; where both are unset polyhal sets ``OMP_WAIT_POLICY=PASSIVE``
before loading the library, so idle workers sleep instead of spinning on cores that others (the
CPU's own pool, other processes) need -- whether cores will be shared cannot be known when the
library loads, and the costs are lopsided: measured on the 2-core VM with other processes
running, MobileNetV3-large b1 took 1.4-2.2 s a run with libgomp's default spinning against 17-19
ms passive (the CPU's own kernels: 115-194 ms). A user's ``ACTIVE`` is kept (with a warning
while the budget's CPUs are busy with others). ``ONEDNN_*`` / ``DNNL_*`` (ISA limits, verbose,
the primitive cache) are the library's and are respected as they are.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
import warnings
from ctypes import POINTER, byref, c_char_p, c_float, c_int, c_int64, c_size_t, c_uint, c_void_p
from pathlib import Path

import numpy as np

from polyhal.errors import KernelError, OutOfMemoryError

from polyhal_cpu.settings import CPUSettings

__all__ = ["ACTIVATIONS", "Attr", "MemoryDesc", "OneDNNError", "Primitive", "Refused", "any_layout", "check",
           "conv_desc", "describe", "implementation", "listed", "matmul_desc", "plain", "reorder", "status", "submemory",
           "usable"]

# ------------------------------------------------------------------------------ the C API's values
# (oneDNN 3.2's dnnl_types.h / dnnl_common_types.h)

STATUS = {0: "success", 1: "out_of_memory", 2: "invalid_arguments", 3: "unimplemented", 4: "last_impl_reached",
          5: "runtime_error", 6: "not_required", 7: "invalid_graph", 8: "invalid_graph_op", 9: "invalid_shape",
          10: "invalid_data_type"}
UNIMPLEMENTED = 3
#: Element types as oneDNN's data types. Which of them a primitive takes depends on the CPU
#: (float16 and bfloat16 need AVX-512 FP16 / BF16 or AMX; float64 has no CPU primitives): a
#: primitive descriptor that refuses one is ``unimplemented``, and the CPU's own kernel runs it.
DATA_TYPES = {"float16": 1, "bfloat16": 2, "float32": 3, "float64": 7}  # by dtype name: ml_dtypes is not imported
#: The integer types of the int8 primitives (:mod:`polyhal_cpu.onednn_int8`): their operands, the
#: int32 zero points; kept apart from :data:`DATA_TYPES`, which the float kernels ask about.
INT_DATA_TYPES = {"int32": 4, "int8": 5, "uint8": 6}

FORMAT_ANY = 1
CPU_ENGINE = 1
STREAM_IN_ORDER = 1
FORWARD_INFERENCE = 96
CONVOLUTION_DIRECT = 0x1
BINARY_ADD, BINARY_MUL = 0x1FFF0, 0x1FFF1
POOLING_MAX, POOLING_AVG_INCLUDE_PADDING, POOLING_AVG_EXCLUDE_PADDING = 0x1FF, 0x2FF, 0x3FF
ELTWISE_LINEAR = 38
SCRATCHPAD_USER = 1
# queries
Q_IMPL_INFO, Q_SRC_MD, Q_WEIGHTS_MD, Q_DST_MD, Q_SCRATCHPAD_MD, Q_EXEC_ARG_MD = 8, 129, 131, 133, 136, 255
Q_STRIDES, Q_NDIMS, Q_DIMS, Q_PADDED_DIMS, Q_FORMAT_KIND = 14, 256, 257, 260, 262
Q_INNER_NBLKS, Q_INNER_BLKS, Q_INNER_IDXS = 263, 264, 265
# execution arguments
ARG_SRC, ARG_SRC_1, ARG_DST, ARG_WEIGHTS, ARG_BIAS, ARG_SCRATCHPAD = 1, 2, 17, 33, 41, 80
ARG_POST_OP_BASE = 32768
ARG_SCALE, ARG_SHIFT = 51, 52
# layer normalization flags, softmax algorithm
USE_SCALE, USE_SHIFT = 0x2, 0x4
SOFTMAX_ACCURATE = 0x30000
ARG_ATTR_SCALES, ARG_ATTR_ZERO_POINTS = 4096, 8192  # | ARG_SRC, ...: a runtime scale or zero point

#: polyhal's activations (:data:`polyhal.ops.nn.ACTIVATIONS`) as oneDNN eltwise algorithms:
#: ``name -> (algorithm, alpha, beta)``, where None takes the op's own alpha / beta.
ACTIVATIONS: dict[str, tuple[int, float | None, float | None]] = {
    "relu": (0x20, 0.0, 0.0),
    "clip": (47, None, None),            # clip_v2: min(max(y, alpha), beta)
    "hard_sigmoid": (40, None, None),    # max(0, min(1, alpha y + beta))
    "hard_swish": (52, None, None),      # y max(0, min(1, alpha y + beta))
    "sigmoid": (41, 0.0, 0.0),           # logistic
    "silu": (44, 1.0, 0.0),              # swish: y sigmoid(alpha y)
    "gelu": (49, 0.0, 0.0),              # gelu_erf
    "gelu_tanh": (43, 0.0, 0.0),
}

DIMS = c_int64 * 12  # dnnl_dims_t (DNNL_MAX_NDIMS = 12)


class _ExecArg(ctypes.Structure):
    _fields_ = [("arg", c_int), ("memory", c_void_p)]


class _Version(ctypes.Structure):
    _fields_ = [("major", c_int), ("minor", c_int), ("patch", c_int), ("hash", c_char_p), ("cpu_runtime", c_uint),
                ("gpu_runtime", c_uint)]


class OneDNNError(KernelError):
    """A oneDNN call returned an error status: names the op, the call and the status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def check(status: int, call: str, op: str = "") -> None:
    """Raise :class:`OneDNNError` (or :class:`~polyhal.errors.OutOfMemoryError` for
    ``out_of_memory``) unless ``status`` is ``success``; the message names ``op``, ``call`` and
    the status."""
    if status == 0:
        return
    name = STATUS.get(status, f"status {status}")
    where = f"{op}: " if op else ""
    message = (f"{where}oneDNN's {call} failed with {name}; run it without oneDNN (POLYHAL_CPU_ONEDNN=0) to use "
               "the CPU's own kernels, or set ONEDNN_VERBOSE=all to see the library's own account")
    if status == 1:
        raise OutOfMemoryError(message)
    raise OneDNNError(message, status)


# --------------------------------------------------------------------------------- the library

_SIGNATURES = {
    # name: (restype, argtypes)
    "dnnl_version": (c_void_p, []),
    "dnnl_engine_create": (c_int, [POINTER(c_void_p), c_int, c_size_t]),
    "dnnl_stream_create": (c_int, [POINTER(c_void_p), c_void_p, c_uint]),
    "dnnl_stream_destroy": (c_int, [c_void_p]),
    "dnnl_memory_desc_create_with_strides": (c_int, [POINTER(c_void_p), c_int, DIMS, c_int, DIMS]),
    "dnnl_memory_desc_create_with_tag": (c_int, [POINTER(c_void_p), c_int, DIMS, c_int, c_int]),
    "dnnl_memory_desc_clone": (c_int, [POINTER(c_void_p), c_void_p]),
    "dnnl_memory_desc_create_submemory": (c_int, [POINTER(c_void_p), c_void_p, DIMS, DIMS]),
    "dnnl_memory_desc_destroy": (c_int, [c_void_p]),
    "dnnl_memory_desc_equal": (c_int, [c_void_p, c_void_p]),
    "dnnl_memory_desc_get_size": (c_size_t, [c_void_p]),
    "dnnl_memory_desc_query": (c_int, [c_void_p, c_int, c_void_p]),
    "dnnl_memory_create": (c_int, [POINTER(c_void_p), c_void_p, c_void_p, c_void_p]),
    "dnnl_memory_set_data_handle": (c_int, [c_void_p, c_void_p]),
    "dnnl_memory_destroy": (c_int, [c_void_p]),
    "dnnl_primitive_attr_create": (c_int, [POINTER(c_void_p)]),
    "dnnl_primitive_attr_destroy": (c_int, [c_void_p]),
    "dnnl_primitive_attr_set_scratchpad_mode": (c_int, [c_void_p, c_int]),
    "dnnl_primitive_attr_set_post_ops": (c_int, [c_void_p, c_void_p]),
    "dnnl_primitive_attr_set_scales_mask": (c_int, [c_void_p, c_int, c_int]),
    "dnnl_primitive_attr_set_zero_points_mask": (c_int, [c_void_p, c_int, c_int]),
    "dnnl_post_ops_create": (c_int, [POINTER(c_void_p)]),
    "dnnl_post_ops_destroy": (c_int, [c_void_p]),
    "dnnl_post_ops_append_sum": (c_int, [c_void_p, c_float, c_int, c_int]),
    "dnnl_post_ops_append_eltwise": (c_int, [c_void_p, c_int, c_float, c_float]),
    "dnnl_post_ops_append_binary": (c_int, [c_void_p, c_int, c_void_p]),
    "dnnl_convolution_forward_primitive_desc_create": (
        c_int, [POINTER(c_void_p), c_void_p, c_int, c_int, c_void_p, c_void_p, c_void_p, c_void_p, DIMS, DIMS, DIMS,
                DIMS, c_void_p]),
    "dnnl_matmul_primitive_desc_create": (c_int, [POINTER(c_void_p), c_void_p, c_void_p, c_void_p, c_void_p,
                                                  c_void_p, c_void_p]),
    "dnnl_layer_normalization_forward_primitive_desc_create": (
        c_int, [POINTER(c_void_p), c_void_p, c_int, c_void_p, c_void_p, c_void_p, c_float, c_uint, c_void_p]),
    "dnnl_softmax_forward_primitive_desc_create": (
        c_int, [POINTER(c_void_p), c_void_p, c_int, c_int, c_void_p, c_void_p, c_int, c_void_p]),
    "dnnl_pooling_forward_primitive_desc_create": (
        c_int, [POINTER(c_void_p), c_void_p, c_int, c_int, c_void_p, c_void_p, DIMS, DIMS, DIMS, DIMS, DIMS, c_void_p]),
    "dnnl_binary_primitive_desc_create": (c_int, [POINTER(c_void_p), c_void_p, c_int, c_void_p, c_void_p, c_void_p,
                                                  c_void_p]),
    "dnnl_reorder_primitive_desc_create": (c_int, [POINTER(c_void_p), c_void_p, c_void_p, c_void_p, c_void_p,
                                                   c_void_p]),
    "dnnl_primitive_desc_query": (c_int, [c_void_p, c_int, c_int, c_void_p]),
    "dnnl_primitive_desc_query_md": (c_void_p, [c_void_p, c_int, c_int]),
    "dnnl_primitive_desc_destroy": (c_int, [c_void_p]),
    "dnnl_primitive_create": (c_int, [POINTER(c_void_p), c_void_p]),
    "dnnl_primitive_execute": (c_int, [c_void_p, c_void_p, c_int, POINTER(_ExecArg)]),
    "dnnl_primitive_destroy": (c_int, [c_void_p]),
}


def library_path() -> Path | None:
    """Where libdnnl is: ``POLYHAL_CPU_ONEDNN_LIBRARY``, else the environment's ``lib/`` (where
    the wheel puts it), else None."""
    given = CPUSettings.from_env().onednn_library
    if given:
        return Path(given)
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        path = Path(prefix) / "lib" / "libdnnl.so.3"
        if path.exists():
            return path
    return None


def _configure_openmp() -> list[str]:
    """Before libgomp is loaded (by libdnnl): the wait policy and thread count (see the module
    docstring). Returns the warnings it gave."""
    from polyhal_cpu import threads

    said = []
    budget = threads.budget()
    user_threads = os.environ.get("OMP_NUM_THREADS")
    if CPUSettings.from_env().threads is not None and user_threads and user_threads != str(budget.size):
        said.append(f"POLYHAL_CPU_THREADS={budget.size} overrides OMP_NUM_THREADS={user_threads} for oneDNN")
    policy = os.environ.get("OMP_WAIT_POLICY")
    if policy is None and "GOMP_SPINCOUNT" not in os.environ:
        if _gomp_loaded():
            said.append("libgomp was loaded before oneDNN (by another library), so polyhal could not set its wait "
                        "policy: set OMP_WAIT_POLICY=PASSIVE in the environment if other processes share these CPUs")
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # read once, when libgomp loads
    elif policy is not None and policy.upper() == "ACTIVE" and budget.active < budget.size:
        said.append("OMP_WAIT_POLICY=ACTIVE kept: oneDNN's idle OpenMP threads spin on CPUs that other processes "
                    "are using (unset it to let polyhal choose PASSIVE)")
    for message in said:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    return said


def _gomp_loaded() -> bool:
    """Whether libgomp is mapped into this process already."""
    try:
        return "libgomp" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


class _Library:
    """libdnnl with typed functions, its CPU engine, and libgomp's thread setter (each executor
    of a primitive makes its own stream: :class:`Primitive`)."""

    def __init__(self, path: Path) -> None:
        self.warnings = _configure_openmp()
        self.dll = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(self.dll, name)
            fn.restype, fn.argtypes = restype, argtypes
            setattr(self, name[5:], fn)  # dnnl_memory_create -> self.memory_create
        v = ctypes.cast(self.version(), POINTER(_Version)).contents
        self.version_text = f"oneDNN {v.major}.{v.minor}.{v.patch}"
        self.engine = c_void_p()
        check(self.engine_create(byref(self.engine), CPU_ENGINE, 0), "dnnl_engine_create")
        try:
            self.omp_set_num_threads = ctypes.CDLL("libgomp.so.1").omp_set_num_threads
            self.omp_set_num_threads.argtypes = [c_int]
        except (OSError, AttributeError):
            self.omp_set_num_threads = None

    def set_threads(self) -> int:
        """OpenMP's thread count on this thread from the budget (before creating primitives)."""
        from polyhal_cpu import threads

        n = threads.budget().size
        if self.omp_set_num_threads is not None:
            self.omp_set_num_threads(n)
        return n


_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def _load() -> tuple[_Library | None, str]:
    path = library_path()
    if path is None:
        from polyhal.distribution import install_hint

        return None, ("the oneDNN library is not installed (no lib/libdnnl.so.3 in this environment); "
                      f"{install_hint('onednn-cpu-gomp')} (x86-64 Linux), or set POLYHAL_CPU_ONEDNN_LIBRARY")
    if not path.exists():
        return None, f"{path} does not exist (POLYHAL_CPU_ONEDNN_LIBRARY names the library file, libdnnl.so.3)"
    try:
        return _Library(path), ""
    except OSError as exc:
        return None, f"{path} cannot be loaded ({exc})"
    except AttributeError as exc:
        return None, f"{path} is not a oneDNN 3.x library ({exc})"
    except KernelError as exc:
        return None, f"oneDNN's CPU engine cannot be created ({exc})"


def asked() -> bool:
    """Whether this process has loaded (or tried to load) the library: :func:`status` is free then."""
    return bool(_load.cache_info().currsize)


def listed() -> tuple[str, str]:
    """What ``polyhal devices`` says about oneDNN without loading it: a few words for the
    device's description and the whole story for ``limits["onednn"]`` (the library it would
    load, or why the CPU's own kernels run every op)."""
    if not CPUSettings.from_env().onednn:
        return "oneDNN off", "off (POLYHAL_CPU_ONEDNN=0): the CPU's own kernels run every op"
    loaded = _load()[0] if _load.cache_info().currsize else None
    if loaded is not None:
        return loaded.version_text, f"{loaded.version_text} primitives for conv and matmul ({library_path()})"
    path = library_path()
    if _load.cache_info().currsize or path is None or not path.exists():
        return "oneDNN unusable: own kernels", f"unusable, the CPU's own kernels run every op: {_load()[1]}"
    return "oneDNN", f"primitives for conv and matmul from {path} (loaded at the first compile)"


def status() -> tuple[str | None, str]:
    """``(version, "")`` when oneDNN is usable, else ``(None, why not)``; loads the library once
    per process. ``POLYHAL_CPU_ONEDNN=0`` turns it off."""
    if not CPUSettings.from_env().onednn:
        return None, "POLYHAL_CPU_ONEDNN=0 turned oneDNN off"
    with _lock:
        lib, why = _load()
    return (lib.version_text, "") if lib is not None else (None, why)


def usable() -> bool:
    """Whether oneDNN primitives serve the CPU's convs and matmuls in this process."""
    return status()[0] is not None


def lib() -> _Library:
    """The loaded library (call only where :func:`usable`)."""
    loaded, why = _load()
    if loaded is None:
        raise KernelError(f"oneDNN is not usable: {why}")
    return loaded


# ----------------------------------------------------------------------------- memory descriptors

class MemoryDesc:
    """An owned ``dnnl_memory_desc_t``: shape, type and layout."""

    __slots__ = ("handle", "__weakref__")

    def __init__(self, handle: c_void_p) -> None:
        self.handle = handle

    @classmethod
    def borrowed(cls, handle: int) -> "MemoryDesc":
        """A copy of a descriptor the library owns (one queried from a primitive descriptor)."""
        md = c_void_p()
        check(lib().memory_desc_clone(byref(md), handle), "dnnl_memory_desc_clone")
        return cls(md)

    def __del__(self) -> None:
        loaded = _load()[0]
        if loaded is not None and self.handle:
            loaded.memory_desc_destroy(self.handle)
            self.handle = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MemoryDesc) and bool(lib().memory_desc_equal(self.handle, other.handle))

    __hash__ = None  # type: ignore[assignment]

    @property
    def nbytes(self) -> int:
        """Bytes the layout takes (blocked formats pad their blocked dims)."""
        return int(lib().memory_desc_get_size(self.handle))

    def _dims(self, what: int) -> tuple[int, ...]:
        n, out = c_int(), c_void_p()
        lib().memory_desc_query(self.handle, Q_NDIMS, byref(n))
        lib().memory_desc_query(self.handle, what, byref(out))
        if not out.value:
            return ()
        return tuple(ctypes.cast(out, POINTER(c_int64))[: n.value])

    @property
    def format(self) -> str:
        """The layout in oneDNN's tag notation (``abcd`` row-major, ``aBcd8b`` nChw8c, ...)."""
        loaded = lib()
        n, blocks = c_int(), c_int()
        loaded.memory_desc_query(self.handle, Q_NDIMS, byref(n))
        loaded.memory_desc_query(self.handle, Q_INNER_NBLKS, byref(blocks))
        strides = self._dims(Q_STRIDES)
        inner_blks = inner_idxs = ()
        if blocks.value:
            out = c_void_p()
            loaded.memory_desc_query(self.handle, Q_INNER_BLKS, byref(out))
            inner_blks = tuple(ctypes.cast(out, POINTER(c_int64))[: blocks.value])
            loaded.memory_desc_query(self.handle, Q_INNER_IDXS, byref(out))
            inner_idxs = tuple(ctypes.cast(out, POINTER(c_int64))[: blocks.value])
        letters = "abcdefghijkl"[: n.value]
        order = sorted(range(n.value), key=lambda d: -strides[d]) if strides else range(n.value)
        outer = "".join(letters[d].upper() if d in inner_idxs else letters[d] for d in order)
        return outer + "".join(f"{b}{letters[i]}" for b, i in zip(inner_blks, inner_idxs))


#: oneDNN's tags of 4-D feature maps by their usual names, for explain.
MAP_NAMES = {"abcd": "nchw", "acdb": "nhwc", "aBcd8b": "nChw8c", "aBcd16b": "nChw16c", "aBcd4b": "nChw4c"}


def describe(md: MemoryDesc, rank: int = 4) -> str:
    """``md``'s layout as a reader knows it: nChw8c for a blocked map, oneDNN's tag otherwise."""
    tag = md.format
    return MAP_NAMES.get(tag, tag) if rank == 4 else tag


def _dims(values) -> DIMS:
    return DIMS(*(int(v) for v in values))


def _data_type(dtype) -> int:
    name = np.dtype(dtype).name
    return DATA_TYPES[name] if name in DATA_TYPES else INT_DATA_TYPES[name]


def plain(shape: tuple[int, ...], strides: tuple[int, ...] | None = None, dtype=np.float32) -> MemoryDesc:
    """A descriptor of ``shape`` and ``dtype`` (one of :data:`DATA_TYPES` or
    :data:`INT_DATA_TYPES`), row-major or with element ``strides``."""
    if strides is None:
        strides = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape)))
    md = c_void_p()
    check(lib().memory_desc_create_with_strides(byref(md), len(shape), _dims(shape), _data_type(dtype),
                                                _dims(strides)),
          "dnnl_memory_desc_create_with_strides")
    return MemoryDesc(md)


def submemory(parent: MemoryDesc, dims: tuple[int, ...], offsets: tuple[int, ...]) -> MemoryDesc:
    """The part of ``parent``'s layout of ``dims`` starting at ``offsets`` (a window of a larger
    buffer, at the parent's address: a reorder into it writes only that window)."""
    md = c_void_p()
    check(lib().memory_desc_create_submemory(byref(md), parent.handle, _dims(dims), _dims(offsets)),
          "dnnl_memory_desc_create_submemory")
    return MemoryDesc(md)


def any_layout(shape: tuple[int, ...], dtype=np.float32) -> MemoryDesc:
    """A descriptor of ``shape`` and ``dtype`` with layout ``any``: the primitive chooses."""
    md = c_void_p()
    check(lib().memory_desc_create_with_tag(byref(md), len(shape), _dims(shape), _data_type(dtype),
                                            FORMAT_ANY),
          "dnnl_memory_desc_create_with_tag")
    return MemoryDesc(md)


# --------------------------------------------------------------------------------------- attributes

class Attr:
    """Primitive attributes: the scratchpad in user mode and the post-ops, in order. Each post-op
    is ``("sum",)`` (add what the destination holds), ``("add", md)`` (a binary add of an
    operand of descriptor ``md``, broadcast over the destination), ``("linear", a, b)`` (``a y +
    b``) or ``(activation, alpha, beta)`` for an activation of :data:`ACTIVATIONS`; ``"none"``
    adds nothing. :attr:`binary_args` are the execution arguments of the binary post-ops.

    ``scales`` and ``zero_points`` map an argument (``ARG_SRC``, ``ARG_WEIGHTS``, ``ARG_DST``) to
    the mask of its runtime quantization parameter (0: one for the tensor; ``1 << d``: one per
    index of dim d), given at execution as ``ARG_ATTR_SCALES | arg`` (float32) and
    ``ARG_ATTR_ZERO_POINTS | arg`` (int32) memories. oneDNN's int8 arithmetic:
    ``dst = post_ops(src_scale wei_scale sum((src - src_zp) wei) + bias) / dst_scale + dst_zp``."""

    def __init__(self, post_ops=(), scales=None, zero_points=None) -> None:
        loaded = lib()
        self.handle, post = c_void_p(), c_void_p()
        check(loaded.primitive_attr_create(byref(self.handle)), "dnnl_primitive_attr_create")
        check(loaded.primitive_attr_set_scratchpad_mode(self.handle, SCRATCHPAD_USER),
              "dnnl_primitive_attr_set_scratchpad_mode")
        for arg, mask in (scales or {}).items():
            check(loaded.primitive_attr_set_scales_mask(self.handle, arg, mask), "dnnl_primitive_attr_set_scales_mask")
        for arg, mask in (zero_points or {}).items():
            check(loaded.primitive_attr_set_zero_points_mask(self.handle, arg, mask),
                  "dnnl_primitive_attr_set_zero_points_mask")
        post_ops = [p for p in post_ops if p[0] != "none"]
        self.mds = [p[1] for p in post_ops if p[0] == "add"]  # kept alive with the attr
        #: The execution argument of each binary post-op's operand, in order.
        self.binary_args = tuple(ARG_POST_OP_BASE * (i + 1) | ARG_SRC_1 for i, p in enumerate(post_ops)
                                 if p[0] == "add")
        if not post_ops:
            return
        check(loaded.post_ops_create(byref(post)), "dnnl_post_ops_create")
        try:
            for kind, *params in post_ops:
                if kind == "sum":
                    check(loaded.post_ops_append_sum(post, 1.0, 0, 0), "dnnl_post_ops_append_sum")
                elif kind == "add":
                    check(loaded.post_ops_append_binary(post, BINARY_ADD, params[0].handle),
                          "dnnl_post_ops_append_binary")
                else:
                    alg, a, b = (ELTWISE_LINEAR, None, None) if kind == "linear" else ACTIVATIONS[kind]
                    check(loaded.post_ops_append_eltwise(post, alg, params[0] if a is None else a,
                                                         params[1] if b is None else b), "dnnl_post_ops_append_eltwise")
            check(loaded.primitive_attr_set_post_ops(self.handle, post), "dnnl_primitive_attr_set_post_ops")
        finally:
            loaded.post_ops_destroy(post)

    def __del__(self) -> None:
        loaded = _load()[0]
        if loaded is not None and self.handle:
            loaded.primitive_attr_destroy(self.handle)
            self.handle = None


# ------------------------------------------------------------------------------------- primitives

class Refused(Exception):
    """oneDNN has no implementation for an op instance (``unimplemented``): the caller falls back."""


class Primitive:
    """A created primitive and the memory descriptors of its arguments.

    ``args`` are the execution arguments (``ARG_*``) in the order :meth:`executor`'s ``run``
    takes their addresses. ``scratchpad_bytes`` is the user-mode scratchpad it needs (0: none);
    when it has one, ``run`` takes its address last. ``impl`` names the implementation oneDNN
    chose (``jit:avx2``, ``brg:avx512_core``, ``gemm:jit``, ...). One primitive serves every plan
    with the same instance (the kernels' plan caches); each executor binds its own memory objects
    and stream, so that two plans may run it at once on two threads.
    """

    def __init__(self, pd: c_void_p, args: tuple[int, ...], op: str, given: dict | None = None) -> None:
        loaded = lib()
        self.op = op
        self.pd = pd
        self.impl = implementation(pd)
        scratch = self.query_md(Q_SCRATCHPAD_MD)
        self.scratchpad_bytes = scratch.nbytes if scratch is not None else 0
        #: Each argument's memory descriptor, as the primitive chose it (or as ``given``: the
        #: runtime scales and zero points, which the primitive descriptor does not describe).
        self.mds: dict[int, MemoryDesc] = {arg: (given or {}).get(arg) or self.query_md(Q_EXEC_ARG_MD, arg)
                                           for arg in args}
        if self.scratchpad_bytes:
            args = (*args, ARG_SCRATCHPAD)
            self.mds[ARG_SCRATCHPAD] = scratch
        self._args = args
        self.prim = c_void_p()
        check(loaded.primitive_create(byref(self.prim), pd), "dnnl_primitive_create", op)

    def query_md(self, what: int, index: int = 0) -> MemoryDesc | None:
        """A copy of one of the primitive descriptor's memory descriptors (None: it has none)."""
        handle = lib().primitive_desc_query_md(self.pd, what, index)
        if not handle:
            return None
        md = MemoryDesc.borrowed(handle)
        return md if md.nbytes else None

    def executor(self):
        """``run(*addresses)``: executes with the arguments at ``addresses`` (in :attr:`args`
        order, the scratchpad last). Synchronous: the stream is in-order and the OpenMP runtime
        returns when the work is done. ``run`` sets its memory objects' addresses, then
        executes: it must not run on two threads at once (a plan serialises its runs), while
        other executors of the primitive may."""
        loaded = lib()
        bound = _Bound(loaded, self._args, self.mds, self.op)
        set_handle, execute = loaded.memory_set_data_handle, loaded.primitive_execute
        memories, prim, stream, count, args, op = bound.memories, self.prim, bound.stream, len(self._args), \
            bound.exec_args, self.op

        def run(*addresses: int, _keep=(self, bound)) -> None:  # (_keep: both live as long as run)
            for mem, address in zip(memories, addresses):
                set_handle(mem, address)
            status = execute(prim, stream, count, args)
            if status:
                check(status, "dnnl_primitive_execute", op)
        return run

    def __del__(self) -> None:
        loaded = _load()[0]
        if loaded is None:
            return
        if getattr(self, "prim", None):
            loaded.primitive_destroy(self.prim)
        if getattr(self, "pd", None):
            loaded.primitive_desc_destroy(self.pd)


class _Bound:
    """One executor's memory objects (an address is set into each per call) and stream: oneDNN's
    memory objects and streams may not be used from two threads at once, its primitives may."""

    def __init__(self, loaded: "_Library", args: tuple[int, ...], mds: dict[int, "MemoryDesc"], op: str) -> None:
        self.memories: list[c_void_p] = []
        self.stream = c_void_p()
        check(loaded.stream_create(byref(self.stream), loaded.engine, STREAM_IN_ORDER), "dnnl_stream_create", op)
        self.exec_args = (_ExecArg * len(args))()
        for i, arg in enumerate(args):
            mem = c_void_p()
            check(loaded.memory_create(byref(mem), mds[arg].handle, loaded.engine, None), "dnnl_memory_create", op)
            self.memories.append(mem)
            self.exec_args[i].arg, self.exec_args[i].memory = arg, mem

    def __del__(self) -> None:
        loaded = _load()[0]
        if loaded is None:
            return
        for mem in self.memories:
            loaded.memory_destroy(mem)
        if self.stream:
            loaded.stream_destroy(self.stream)


def implementation(pd: c_void_p) -> str:
    """The name of the implementation oneDNN chose for a primitive descriptor (``jit:avx2``, ...)."""
    out = c_char_p()
    lib().primitive_desc_query(pd, Q_IMPL_INFO, 0, byref(out))
    return (out.value or b"?").decode()


def _created(status: int, pd: c_void_p, call: str, op: str) -> c_void_p:
    """``pd``, checked: :class:`Refused` where oneDNN has no implementation, or only its
    reference one (``ref:any``, a plain loop that is there to be correct: measured ~100x slower
    than the CPU's own kernels on a stem conv); an error for other statuses."""
    if status == UNIMPLEMENTED:
        raise Refused(f"oneDNN has no implementation of this {op} ({call}: unimplemented)")
    check(status, call, op)
    impl = implementation(pd)
    if impl.startswith("ref"):
        lib().primitive_desc_destroy(pd)
        raise Refused(f"oneDNN has only its reference implementation ({impl}) of this {op}")
    return pd


def conv_desc(op: str, src: MemoryDesc, weights: MemoryDesc, bias: MemoryDesc | None, dst: MemoryDesc,
              strides, dilations, pad_l, pad_r, attr: Attr) -> c_void_p:
    """A forward-inference direct convolution's primitive descriptor (``dilations`` in oneDNN's
    sense: 0 is dense). :class:`Refused` where oneDNN has no implementation."""
    loaded = lib()
    pd = c_void_p()
    status = loaded.convolution_forward_primitive_desc_create(
        byref(pd), loaded.engine, FORWARD_INFERENCE, CONVOLUTION_DIRECT, src.handle, weights.handle,
        bias.handle if bias is not None else None, dst.handle, _dims(strides), _dims(dilations), _dims(pad_l),
        _dims(pad_r), attr.handle)
    return _created(status, pd, "dnnl_convolution_forward_primitive_desc_create", op)


def matmul_desc(op: str, src: MemoryDesc, weights: MemoryDesc, bias: MemoryDesc | None, dst: MemoryDesc,
                attr: Attr) -> c_void_p:
    """A matmul's primitive descriptor. :class:`Refused` where oneDNN has no implementation."""
    loaded = lib()
    pd = c_void_p()
    status = loaded.matmul_primitive_desc_create(byref(pd), loaded.engine, src.handle, weights.handle,
                                                 bias.handle if bias is not None else None, dst.handle, attr.handle)
    return _created(status, pd, "dnnl_matmul_primitive_desc_create", op)


def layer_norm_desc(op: str, src: MemoryDesc, dst: MemoryDesc, epsilon: float, scale: bool, shift: bool,
                    attr: Attr) -> c_void_p:
    """A forward-inference layer normalization over the last dimension (statistics computed, not
    kept). :class:`Refused` where oneDNN has no implementation."""
    loaded = lib()
    pd = c_void_p()
    flags = (USE_SCALE if scale else 0) | (USE_SHIFT if shift else 0)
    status = loaded.layer_normalization_forward_primitive_desc_create(
        byref(pd), loaded.engine, FORWARD_INFERENCE, src.handle, dst.handle, None, epsilon, flags, attr.handle)
    return _created(status, pd, "dnnl_layer_normalization_forward_primitive_desc_create", op)


def softmax_desc(op: str, src: MemoryDesc, dst: MemoryDesc, axis: int, attr: Attr) -> c_void_p:
    """A forward-inference (accurate: max subtracted) softmax along ``axis``. :class:`Refused`
    where oneDNN has no implementation."""
    loaded = lib()
    pd = c_void_p()
    status = loaded.softmax_forward_primitive_desc_create(byref(pd), loaded.engine, FORWARD_INFERENCE,
                                                          SOFTMAX_ACCURATE, src.handle, dst.handle, axis, attr.handle)
    return _created(status, pd, "dnnl_softmax_forward_primitive_desc_create", op)


def binary_desc(op: str, algorithm: int, src0: MemoryDesc, src1: MemoryDesc, dst: MemoryDesc,
                attr: Attr) -> c_void_p:
    """An elementwise binary primitive's descriptor (``src1`` broadcast over ``src0`` where its
    dims are 1; ``algorithm`` one of ``BINARY_*``). :class:`Refused` where oneDNN has no
    implementation."""
    loaded = lib()
    pd = c_void_p()
    status = loaded.binary_primitive_desc_create(byref(pd), loaded.engine, algorithm, src0.handle, src1.handle,
                                                 dst.handle, attr.handle)
    return _created(status, pd, "dnnl_binary_primitive_desc_create", op)


def pooling_desc(op: str, algorithm: int, src: MemoryDesc, dst: MemoryDesc, strides, kernel, dilations, pad_l,
                 pad_r, attr: Attr) -> c_void_p:
    """A forward-inference pooling's descriptor (``algorithm`` one of ``POOLING_*``; ``dilations``
    in oneDNN's sense: 0 is dense). :class:`Refused` where oneDNN has no implementation."""
    loaded = lib()
    pd = c_void_p()
    status = loaded.pooling_forward_primitive_desc_create(
        byref(pd), loaded.engine, FORWARD_INFERENCE, algorithm, src.handle, dst.handle, _dims(strides), _dims(kernel),
        _dims(dilations), _dims(pad_l), _dims(pad_r), attr.handle)
    return _created(status, pd, "dnnl_pooling_forward_primitive_desc_create", op)


def reorder(op: str, src: MemoryDesc, dst: MemoryDesc) -> Primitive:
    """A reorder (layout change) from ``src`` to ``dst``: ``run(src_address, dst_address[, scratchpad])``."""
    loaded = lib()
    pd = c_void_p()
    attr = Attr()
    status = loaded.reorder_primitive_desc_create(byref(pd), src.handle, loaded.engine, dst.handle, loaded.engine,
                                                  attr.handle)
    _created(status, pd, "dnnl_reorder_primitive_desc_create", op)
    # Its memories on the descriptors given (a submemory window's is not queried back whole).
    return Primitive(pd, (ARG_SRC, ARG_DST), op, {ARG_SRC: src, ARG_DST: dst})


def address(a: np.ndarray) -> int:
    """The address of ``a``'s first element."""
    return a.__array_interface__["data"][0]
