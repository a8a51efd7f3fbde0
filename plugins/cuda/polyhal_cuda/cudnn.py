"""``conv`` and ``fused_conv`` on CUDA through cuDNN's graph API (``nvidia-cudnn-frontend``).

An optional dependency: ``pip install 'polyhal-cuda[cudnn]'`` brings the frontend, which runs on
the cuDNN 9 library that the CUDA wheels (torch's among them) install. :func:`status` says once
per process whether it is usable and why not; the plugin shows it in ``polyhal devices``
(``limits["conv"]``) and advertises ``fused_conv`` only when it is, so the compile fuses conv
epilogues only where cuDNN runs them. ``POLYHAL_CUDA_CUDNN=0`` turns it off (the im2col path of
:mod:`polyhal_cuda.nn` runs every conv then).

Per op instance, when a plan is compiled, :func:`plan` builds one cuDNN graph -- conv, then the
bias, the residual add and the activation as pointwise nodes -- lets cuDNN's heuristics rank
its engines, drops those whose numerical notes say the result is not plain arithmetic in the
operand type (``TENSOR_CORE`` for float32, i.e. TF32, and ``DOWN_CONVERT_INPUTS`` /
``REDUCED_PRECISION_REDUCTION`` for every type: fp32 means fp32), times the first few that
remain on scratch operands of the instance's shapes and builds the fastest
(:func:`_build_fastest`; ``POLYHAL_CUDA_CUDNN_AUTOTUNE=0``: the first). Every plan it would
choose is first checked on those operands against a float64 reference at sampled outputs
(:func:`sampled_mismatch`), and a plan that fails it is never chosen (no plan passing: the graph
is refused, and a less fused one or the im2col conv runs). Why: on an H200 (cuDNN 9.19) the
float16 graphs of EfficientNet-B0's and MobileNetV3's squeeze-excitation convs -- one-pixel maps
at batch 16, declared with NCHW strides -- returned wrong values (sigmoid outputs in the
thousands; the models' results NaN and 100% off). Such maps are the same bytes in either layout
and are now declared channels-last, with which the same convs computed correctly there
(EfficientNet-B0 b16 float16 NCHW: 4.0e-3 from float64, MobileNetV3-large 8.4e-3; torch's
float16 5.0e-3 and 7.4e-3). An instance compiled with ``precision="tf32"`` (:mod:`polyhal.passes.precision`) keeps
the ``TENSOR_CORE`` engines for float32; float16 convs compute in float (``COMPUTE``) and may use
tensor cores, but never reduce in half precision. Its workspace is declared scratch (:func:`scratch_requests`), placed by the plan's
bufferization, so nothing is allocated when it runs; the kernel only hands cuDNN the operand
pointers, on a handle bound to the device's stream, so a plan's CUDA graph captures it.

Where the whole graph has no engine (an activation cuDNN's fusion engines do not take in this
precision, say), the conv -- with the bias when it can -- runs as a cuDNN graph of its own and
the rest of the epilogue as one elementwise kernel; where cuDNN has no engine for the conv
itself (or is unusable), the im2col conv of :mod:`polyhal_cuda.nn` does. A depthwise conv never
reaches cuDNN: the backend's own kernel (:func:`polyhal_cuda.nn.prepare_depthwise`) measured
3-10x faster than its fp32-exact engines. Every instance runs on the device; the kernel's
``kernel_name`` says which way.

Layouts reach cuDNN through strides. ``conv`` / ``fused_conv`` read NCHW; ``cuda.blocked_conv`` -- a
conv of a chain that the CUDA encoding resolver keeps channels-last (:mod:`polyhal_cuda.layout`)
-- reads its maps as NHWC storage (N, 1, H, W, C) and its filter dense (M, C/g, kh, kw) or
channels-last (M, 1, kh, kw, C/g), converted once at compile time; cuDNN then picks among its
NHWC engines. Without an engine for the NHWC graph it runs the NCHW way on transposed copies
(allocated while it runs; the kernel's name says so).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from polyhal.distribution import install_hint
from polyhal.hal.scratch import KernelInfo, MemorySpace, Problem, ScratchDecl
from polyhal_cuda.settings import CUDASettings

#: CUDA's own op for a conv on channels-last (NHWC) maps and filters (schema:
#: :data:`polyhal.ops.nn.CHANNEL_BLOCKED_CONV`, defined on the table in :mod:`polyhal_cuda.kernels`):
#: what :class:`polyhal_cuda.layout.ChannelsLastLayout` lowers convs to.
BLOCKED_CONV = "cuda.blocked_conv"

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the CUDA device; its module imports this one

#: Element types cuDNN convolves here, and the type they compute in.
DTYPES = {np.dtype(np.float32): "FLOAT", np.dtype(np.float16): "HALF", np.dtype(np.float64): "DOUBLE"}
COMPUTE = {"FLOAT": "FLOAT", "HALF": "FLOAT", "DOUBLE": "DOUBLE"}
#: Activations cuDNN's pointwise nodes compute (the others run in the elementwise epilogue).
ACTIVATIONS = ("none", "relu", "clip", "sigmoid", "silu", "gelu", "gelu_tanh")


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[str | None, str]:
    try:
        import cudnn
    except ImportError as exc:
        return None, f"nvidia-cudnn-frontend is not installed ({exc}); {install_hint('polyhal-cuda', 'cudnn')} (nvidia-cudnn-frontend)"
    except Exception as exc:  # noqa: BLE001 - a broken install must not break polyhal
        return None, f"cudnn cannot be imported ({type(exc).__name__}: {exc})"
    try:
        v = int(cudnn.backend_version())
    except Exception as exc:  # noqa: BLE001 - the library itself is missing or broken
        return None, (f"the cuDNN library cannot be loaded ({type(exc).__name__}: {exc}); install cuDNN 9 "
                      "(e.g. nvidia-cudnn-cu12 / -cu13) or put libcudnn.so.9 on LD_LIBRARY_PATH")
    major, minor, patch = v // 10000, (v // 100) % 100, v % 100
    if major < 9:
        return None, f"cuDNN {major}.{minor}.{patch} is older than 9.0, which the graph API here needs"
    return f"cudnn {major}.{minor}.{patch} (frontend {getattr(cudnn, '__version__', '?')})", ""


def status() -> tuple[str | None, str]:
    """``(version, "")`` when cuDNN is usable, else ``(None, why not)`` (loads the library once
    per process; ``POLYHAL_CUDA_CUDNN=0`` turns it off)."""
    if not CUDASettings.from_env().cudnn:
        return None, "POLYHAL_CUDA_CUDNN=0 turned cuDNN off"
    return _probe()


def usable() -> bool:
    """Whether convs go through cuDNN in this process (:func:`status`)."""
    return status()[0] is not None


# ------------------------------------------------------------------------------------ per device

class _DeviceState:
    """One device's cuDNN handle (bound to its stream) and its built graphs by instance."""

    def __init__(self, device: "Device") -> None:
        import cudnn

        with device.activate():
            self.handle = cudnn.create_handle()
            cudnn.set_stream(self.handle, device.stream.ptr)
        self.device = weakref.ref(device)  # the autotuner times plans on its stream
        self.plans: dict[Any, "CuDNNConv | None"] = {}
        self.reasons: dict[Any, str] = {}
        self.lock = threading.Lock()


_STATES: "weakref.WeakKeyDictionary[Any, _DeviceState]" = weakref.WeakKeyDictionary()
_STATES_LOCK = threading.Lock()


def _state(device: "Device") -> _DeviceState:
    with _STATES_LOCK:
        s = _STATES.get(device)
        if s is None:
            s = _STATES[device] = _DeviceState(device)
        return s


# ------------------------------------------------------------------------------------- the graph

@dataclass(frozen=True)
class Conv:
    """One conv instance in cuDNN's terms (spatial rank 1 runs as 2-d with a unit height)."""

    x: tuple[int, ...]
    w: tuple[int, ...]
    y: tuple[int, ...]
    pre: tuple[int, ...]
    post: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    dtype: np.dtype
    #: Maps (x, residual, y) and the filter channels-last (NHWC / KRSC) instead of NCHW / KCRS.
    maps_last: bool = False
    filter_last: bool = False
    #: x dense NCHW though the other maps are channels-last: a ``blocked_conv`` stem reading its
    #: image as it lies.
    image_first: bool = False

    @classmethod
    def of(cls, attrs: dict, ins, outs) -> "Conv":
        x, w, y = ins[0].shape, ins[1].shape, outs[0].shape
        n = len(x) - 2
        s = tuple(int(v) for v in attrs["strides"]) if attrs["strides"] is not None else (1,) * n
        d = tuple(int(v) for v in attrs["dilations"]) if attrs["dilations"] is not None else (1,) * n
        p = tuple(int(v) for v in attrs["pads"]) if attrs["pads"] is not None else (0,) * (2 * n)
        pre, post = p[:n], p[n:]
        if n == 1:  # cuDNN convolves 2-d and 3-d: a 1-d conv is a 2-d one of height 1
            x, w, y = x[:2] + (1,) + x[2:], w[:2] + (1,) + w[2:], y[:2] + (1,) + y[2:]
            pre, post, s, d = (0,) + pre, (0,) + post, (1,) + s, (1,) + d
        return cls(tuple(x), tuple(w), tuple(y), pre, post, s, d, ins[0].dtype)


def _strides(shape: tuple[int, ...], channels_last: bool = False) -> list[int]:
    """Strides of a dense (N, C, *spatial) tensor, or of one stored channels-last."""
    order = (0, *range(2, len(shape)), 1) if channels_last else tuple(range(len(shape)))
    out, acc = [0] * len(shape), 1
    for d in reversed(order):
        out[d] = acc
        acc *= shape[d]
    return out


def logical(op: str, attrs: dict, ins, outs) -> tuple[str, tuple, tuple, bool, bool]:
    """``(op, ins, outs, maps_last, filter_last)`` of a conv instance in NCHW terms: a
    :data:`BLOCKED_CONV`'s storage types (N, 1, H, W, C) become (N, C, H, W), and it is a ``conv``
    (two or three operands, no activation) or a ``fused_conv``; others are as they are."""
    if op != BLOCKED_CONV:
        return op, tuple(ins), tuple(outs), False, False
    from polyhal.ir.types import TensorType

    def unblock(t):
        n, _, h, w, c = t.shape
        return TensorType((n, c, h, w), t.dtype)

    w_last = ins[1].rank == 5
    lins = (ins[0] if ins[0].rank == 4 else unblock(ins[0]), unblock(ins[1]) if w_last else ins[1], *ins[2:3], *(unblock(r) for r in ins[3:4]))
    fused = len(ins) == 4 or (len(ins) == 3 and attrs["activation"] != "none")
    return ("fused_conv" if fused else "conv"), lins, (unblock(outs[0]),), True, w_last


class CuDNNConv:
    """A built cuDNN graph for conv [+ bias] [+ residual] [+ activation]: ``run(ptrs, ws)``
    executes it on the handle's stream with the operands' device pointers, in the order of
    ``operands`` (``x``, ``w``, then ``b``, ``r`` if the graph has them, then ``y``)."""

    def __init__(self, state: _DeviceState, conv: Conv, bias: bool, residual: bool, activation: str,
                 alpha: float, beta: float, tf32: bool = False) -> None:
        import cudnn

        dt = getattr(cudnn.data_type, DTYPES[conv.dtype])
        ct = getattr(cudnn.data_type, COMPUTE[DTYPES[conv.dtype]])
        g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=ct, compute_data_type=ct, handle=state.handle)
        m = conv.w[0]
        bshape = (1, m) + (1,) * (len(conv.y) - 2)
        last = conv.maps_last
        x_last = last and not conv.image_first
        tensors = {"x": g.tensor(name="x", dim=list(conv.x), stride=_strides(conv.x, x_last), data_type=dt),
                   "w": g.tensor(name="w", dim=list(conv.w), stride=_strides(conv.w, conv.filter_last), data_type=dt)}
        y = g.conv_fprop(image=tensors["x"], weight=tensors["w"], pre_padding=list(conv.pre),
                         post_padding=list(conv.post), stride=list(conv.stride), dilation=list(conv.dilation),
                         compute_data_type=ct, name="conv")
        if bias:
            tensors["b"] = g.tensor(name="b", dim=list(bshape), stride=_strides(bshape, last), data_type=dt)
            y = g.bias(input=y, bias=tensors["b"], name="bias")
        if residual:
            tensors["r"] = g.tensor(name="r", dim=list(conv.y), stride=_strides(conv.y, last), data_type=dt)
            y = g.add(a=y, b=tensors["r"], name="residual")
        y = _activation(g, y, activation, alpha, beta)
        y.set_output(True).set_data_type(dt).set_dim(list(conv.y)).set_stride(_strides(conv.y, last))
        tensors["y"] = y
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        notes = [cudnn.numerical_note.DOWN_CONVERT_INPUTS, cudnn.numerical_note.REDUCED_PRECISION_REDUCTION]
        if conv.dtype == np.float32 and not tf32:
            notes.append(cudnn.numerical_note.TENSOR_CORE)  # float32 on tensor cores is TF32
        g.deselect_numeric_notes(notes)
        g.check_support()
        operands = {"x": conv.x, "w": conv.w, "b": bshape, "r": conv.y, "y": conv.y}
        layouts = {"x": x_last, "w": conv.filter_last, "b": last, "r": last, "y": last}
        tolerance = TOLERANCE["tf32" if tf32 and conv.dtype == np.float32 else conv.dtype.name]

        inputs: dict = {}  # the operands' host copies, the same for every plan

        def check(arrays: dict) -> str | None:
            host = {n: inputs[n] if n in inputs else _logical(a, operands[n], layouts[n]) for n, a in arrays.items()}
            inputs.update((n, a) for n, a in host.items() if n != "y")
            return sampled_mismatch(conv, host["x"], host["w"], host.get("b"), host.get("r"), host["y"], activation,
                                    alpha, beta, tolerance)

        self.timings, self.rejected = _build_fastest(g, state, tensors, {n: operands[n] for n in tensors},
                                                     conv.dtype, check)
        self.graph, self.handle = g, state.handle
        self.operands = tuple(tensors)
        self._tensors = tuple(tensors.values())
        self.workspace = int(g.get_workspace_size())
        self.engine = _plan_name(g)

    def run(self, ptrs: tuple[int, ...], workspace: int | None) -> None:
        self.graph.execute(dict(zip(self._tensors, ptrs)), workspace, handle=self.handle)


#: Plans of cuDNN's ranked list that the autotuner times (the heuristics' first few: further down
#: the list the engines are rarely faster, and each timing costs compile time).
AUTOTUNE_CANDIDATES = 6
#: Plans needing more workspace than this are not timed (nor chosen).
AUTOTUNE_WORKSPACE = 256 << 20


def _build_fastest(g: Any, state: _DeviceState, tensors: dict, shapes: dict, dtype: np.dtype,
                   check: Any = None) -> tuple[dict[str, float], dict[str, str]]:
    """Build the fastest plan among the first :data:`AUTOTUNE_CANDIDATES` of cuDNN's ranked list
    that build, pass the filters and give correct results, timed once here on scratch operands
    of the instance's shapes (cuDNN's heuristics rank engines by a model; on small batches their
    first choice was several times slower than the best, which timing finds, as
    ``torch.backends.cudnn.benchmark`` does). ``check(arrays)`` (the operands by name, the
    result under ``"y"``) says why a plan's result is wrong, or None; a wrong plan is never
    chosen, and the search goes on down the list until one passes. Returns ``(timings in ms by
    plan name, why each rejected plan was)``; ``POLYHAL_CUDA_CUDNN_AUTOTUNE=0`` keeps the first
    correct plan. Raises when no plan builds or none gives correct results."""
    import cupy as cp

    autotune = CUDASettings.from_env().cudnn_autotune
    device = state.device()
    if device is None:  # the device is gone: nothing to time or check on
        g.build_plans()
        return {}, {}
    timings: dict[str, float] = {}
    rejected: dict[str, str] = {}
    best, best_ms = None, float("inf")
    # The operands and workspaces come from a pool of their own, returned to the driver when
    # the search ends: a compile leaves no cached blocks behind.
    pool = cp.cuda.MemoryPool()
    with device.activate(), cp.cuda.using_allocator(pool.malloc):
        rng = cp.random.default_rng(0)
        arrays = {n: rng.standard_normal(shape, dtype=np.float64).astype(dtype) for n, shape in shapes.items()}
        stream = device.stream
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        pack = {tensors[n]: arrays[n].data.ptr for n in shapes}
        for i in range(g.get_execution_plan_count()):
            if best is not None and (not autotune or i >= AUTOTUNE_CANDIDATES):
                break
            try:
                g.build_plan_at_index(i)
            except Exception:  # noqa: BLE001 - barred by a filter, or declined: not a candidate
                continue
            size = int(g.get_workspace_size())
            name = str(g.get_plan_name_at_index(i))
            if size > AUTOTUNE_WORKSPACE:
                rejected[name] = f"workspace {size} B > {AUTOTUNE_WORKSPACE} B"
                continue
            workspace = cp.empty(max(size, 1), np.uint8)
            ws = workspace.data.ptr
            try:
                arrays["y"].fill(np.nan)  # a plan that leaves outputs unwritten fails the check
                g.execute_plan_at_index(pack, ws, i, handle=state.handle)
                stream.synchronize()
                why = check(arrays) if check is not None else None
                if why is not None:
                    rejected[name] = why
                    continue
                ms = 0.0
                if autotune:
                    start.record(stream)
                    for _ in range(5):
                        g.execute_plan_at_index(pack, ws, i, handle=state.handle)
                    stop.record(stream)
                    stop.synchronize()
                    ms = cp.cuda.get_elapsed_time(start, stop) / 5
            except Exception as exc:  # noqa: BLE001 - a plan that fails to run is not chosen
                rejected[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                continue
            if autotune:
                timings[name] = ms
            if ms < best_ms:
                best, best_ms = i, ms
        del arrays, pack
    pool.free_all_blocks()
    if best is None:
        raise RuntimeError("no cuDNN plan gave correct results" + (": " + "; ".join(
            f"{k}: {v}" for k, v in rejected.items()) if rejected else " (none builds)"))
    g.build_plan_at_index(best)
    return timings, rejected


#: Allowed error of a sampled output, relative to the sum of the magnitudes it adds up (products,
#: bias, residual), by the instance's type: float16 in and out (float accumulation), float32
#: without TF32, TF32, float64. A wrong engine misses by orders of magnitude more.
TOLERANCE = {"float16": 1e-2, "float32": 1e-5, "tf32": 1e-2, "float64": 1e-12}
#: Outputs :func:`sampled_mismatch` checks per plan.
SAMPLES = 256


def _logical(a: Any, shape: tuple, channels_last: bool) -> np.ndarray:
    """A cupy operand of ``shape`` as cuDNN reads it (dense, NCHW or channels-last strides),
    copied to the host as a numpy view indexed (N, C, spatial...)."""
    flat = np.ascontiguousarray(a.get()).reshape(-1)
    strides = tuple(st * flat.itemsize for st in _strides(shape, channels_last))
    return np.lib.stride_tricks.as_strided(flat, shape, strides, writeable=False)


def sampled_mismatch(conv: Conv, x: np.ndarray, w: np.ndarray, b: np.ndarray | None, r: np.ndarray | None,
                     y: np.ndarray, activation: str, alpha: float, beta: float, tolerance: float,
                     samples: int = SAMPLES) -> str | None:
    """Why ``y`` is not ``activation(conv(x, w) + b + r)`` (NCHW-indexed arrays of ``conv``'s
    shapes, ``b`` as (1, M, 1...)), checked in float64 at ``samples`` outputs drawn at random
    (the first and the last always among them); None when every one is within ``tolerance``
    times the sum of the magnitudes it adds up. Cheap enough to run on every plan a compile
    would choose: ``samples`` dot products of a filter's size."""
    import itertools

    from polyhal.ops.nn import apply_activation

    n_out = int(np.prod(conv.y))
    picks = np.unique(np.concatenate([[0, n_out - 1], np.random.default_rng(0).integers(0, n_out, samples)]))
    idx = np.unravel_index(picks, conv.y)
    n, m, spatial = idx[0], idx[1], idx[2:]
    groups = conv.x[1] // conv.w[1]
    cg = conv.w[1]
    first = (m // (conv.w[0] // groups)) * cg
    channels = first[:, None] + np.arange(cg)[None, :]               # (P, C/g)
    acc = np.zeros(len(picks))
    size = np.zeros(len(picks))
    for k in itertools.product(*(range(s) for s in conv.w[2:])):
        pos = [o * st - p + kk * d for o, st, p, kk, d in zip(spatial, conv.stride, conv.pre, k, conv.dilation)]
        inside = np.all([(q >= 0) & (q < s) for q, s in zip(pos, conv.x[2:])], axis=0)
        pos = [np.where(inside, q, 0) for q in pos]
        xs = x[(n[:, None], channels, *(q[:, None] for q in pos))].astype(np.float64)
        ws = w[(m[:, None], np.arange(cg)[None, :], *(np.full((1, 1), kk) for kk in k))].astype(np.float64)
        terms = np.where(inside[:, None], xs * ws, 0.0)
        acc += terms.sum(axis=1)
        size += np.abs(terms).sum(axis=1)
    if b is not None:
        bias = b.reshape(-1)[m].astype(np.float64)
        acc, size = acc + bias, size + np.abs(bias)
    if r is not None:
        res = r[idx].astype(np.float64)
        acc, size = acc + res, size + np.abs(res)
    want = apply_activation(acc, activation, alpha, beta)
    got = y[idx].astype(np.float64)
    err = np.abs(got - want)
    bad = ~(err <= tolerance * (size + np.abs(want)) + 1e-30)  # NaN fails too
    if not bad.any():
        return None
    j = int(np.argmax(np.where(bad, np.nan_to_num(err, nan=np.inf), -1.0)))
    where = tuple(int(i[j]) for i in idx)
    return (f"wrong result: {int(bad.sum())} of {len(picks)} sampled outputs off, e.g. y{list(where)} = "
            f"{got[j]:.6g}, float64 reference {want[j]:.6g}")


def _plan_name(g: Any) -> str:
    try:
        return str(g.get_plan_name_at_index(g._plan_index))
    except Exception:  # noqa: BLE001 - only a label
        return "?"


def _activation(g: Any, y: Any, activation: str, alpha: float, beta: float) -> Any:
    if activation == "none":
        return y
    if activation == "relu":
        return g.relu(input=y, name="act")
    if activation == "clip":
        return g.relu(input=y, lower_clip=alpha, upper_clip=beta, name="act")
    if activation == "sigmoid":
        return g.sigmoid(input=y, name="act")
    if activation == "silu":
        return g.swish(input=y, swish_beta=1.0, name="act")
    if activation == "gelu":
        return g.gelu(input=y, name="act")
    if activation == "gelu_tanh":
        return g.gelu_approx_tanh(input=y, name="act")
    raise NotImplementedError(activation)


def _key(op: str, attrs: dict, ins, outs) -> Any:
    return op, repr(sorted(attrs.items())), tuple(ins), tuple(outs)


def _stages(op: str, attrs: dict, ins) -> list[tuple[bool, bool, str]]:
    """The graphs to try, most fused first: (bias, residual, activation) of each."""
    bias = len(ins) >= 3
    if op == "conv":
        return [(bias, False, "none"), (False, False, "none")]
    residual = len(ins) == 4
    act = attrs["activation"]
    tries = []
    if act in ACTIVATIONS:
        tries.append((True, residual, act))
    if residual:
        tries.append((True, True, "none"))
    return tries + [(True, False, "none"), (False, False, "none")]


def plan(device: "Device", op: str, attrs: dict, ins, outs) -> tuple["CuDNNConv | None", tuple, str]:
    """The most fused cuDNN graph that has an engine for this instance (built once, cached per
    device): ``(graph, what it covers (bias, residual, activation), "")``, or ``(None, (), why
    not)``."""
    why = status()[1]
    if why:
        return None, (), why
    key = _key(op, attrs, ins, outs)
    image_first = op == BLOCKED_CONV and ins[0].rank == 4
    op, ins, outs, maps_last, filter_last = logical(op, attrs, ins, outs)
    if ins[0].dtype not in DTYPES:
        return None, (), f"cuDNN convolves {', '.join(t.name for t in DTYPES)} here, not {ins[0].dtype.name}"
    if ins[0].rank not in (3, 4, 5) or any(t.size == 0 for t in (*ins, *outs)):
        return None, (), "cuDNN convolves 1-, 2- and 3-d non-empty operands"
    state = _state(device)
    with state.lock:
        if key in state.plans:
            found = state.plans[key]
            return found, (found.covers if found else ()), state.reasons.get(key, "")
        conv = Conv.of(attrs, ins, outs)
        # Maps of one pixel (a squeeze-excitation's convs) are the same bytes in NCHW and NHWC:
        # declared channels-last, as cuDNN computes them correctly (see the module docstring).
        single = all(d == 1 for d in (*conv.x[2:], *conv.y[2:]))
        conv = dataclasses.replace(conv, maps_last=maps_last or single, image_first=image_first and not single,
                                   filter_last=filter_last or (single and all(d == 1 for d in conv.w[2:])))
        alpha = float(attrs.get("alpha", 0.0))
        beta = float(attrs.get("beta", 0.0))
        failures = []
        built = None
        for bias, residual, act in _stages(op, attrs, ins):
            try:
                with device.activate():
                    built = CuDNNConv(state, conv, bias, residual, act, alpha, beta, attrs["precision"] == "tf32")
            except Exception as exc:  # noqa: BLE001 - no engine (or any cuDNN refusal): try less
                failures.append(f"{'+'.join(s for s, on in (('bias', bias), ('residual', residual), (act, act != 'none')) if on) or 'conv'}: "
                                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                continue
            built.covers = (bias, residual, act)  # type: ignore[attr-defined]
            break
        state.plans[key] = built
        if built is None:
            exact = "engine" if attrs["precision"] == "tf32" else "fp-exact engine"
            state.reasons[key] = f"cuDNN has no {exact}: " + "; ".join(failures)
        return built, (built.covers if built else ()), state.reasons.get(key, "")


# --------------------------------------------------------------------------------------- kernels

def scratch_requests(device: "Device", op: str, attrs: dict, ins, outs) -> tuple:
    """The cuDNN workspace of one conv / fused_conv instance (building its graph: the engine is
    chosen when the plan is compiled)."""
    from polyhal_cuda import nn

    lop, lins, louts, maps_last, _ = logical(op, attrs, ins, outs)
    if nn.is_depthwise(attrs, lins):
        return ()  # the backend's own kernel: no scratch
    graph, _, _ = plan(device, op, attrs, ins, outs)
    if graph is None and maps_last:  # the NCHW way, on transposed copies
        return scratch_requests(device, lop, attrs, lins, louts)
    problem = Problem(op, attrs, tuple(ins), tuple(outs))
    if graph is None:  # the im2col conv: its columns
        columns = nn.columns_request(attrs, ins[:2], outs)
        if columns is None:
            return ()
        decl = ScratchDecl("columns", shared=True, per_launch=columns[1], spaces=(MemorySpace.GLOBAL,),
                           alignment=256, purpose=columns[0])
        return (decl.request(problem, KernelInfo("im2col_conv", op, 1, 1, "cuda")),)
    if graph.workspace == 0:
        return ()
    decl = ScratchDecl("workspace", shared=True, per_launch=graph.workspace, spaces=(MemorySpace.GLOBAL,),
                       alignment=256, purpose="cuDNN workspace of the chosen engine")
    return (decl.request(problem, KernelInfo("cudnn_conv", op, 1, 1, "cuda")),)


def prepare(device: "Device", op: str, attrs: dict, ins, outs, binding: Any = None):
    """``fn(x, w[, b][, r], out)`` for one conv or fused_conv instance: a depthwise conv by the
    backend's own kernel (:func:`polyhal_cuda.nn.is_depthwise`), others by cuDNN as far as it has
    an engine, the elementwise epilogue for the rest, the im2col conv without one."""
    from polyhal_cuda import nn
    from polyhal_gpu.scratch import Scratch

    lop, lins, louts, maps_last, filter_last = logical(op, attrs, ins, outs)
    fused = lop == "fused_conv"
    act = attrs["activation"] if fused else "none"
    alpha, beta = (float(attrs["alpha"]), float(attrs["beta"])) if fused else (0.0, 0.0)
    if nn.is_depthwise(attrs, lins):
        return nn.prepare_depthwise(device, attrs, lins, louts, act, alpha, beta, channels_last=maps_last)
    graph, covers, why = plan(device, op, attrs, ins, outs)
    if graph is None and maps_last:
        return _through_nchw(prepare(device, lop, attrs, lins, louts, binding), filter_last, why)
    instance = (op, attrs, ins, outs)  # what the graph and its scratch were planned for
    op, ins, outs = lop, lins, louts
    residual = fused and len(ins) == 4
    if graph is None:
        requests = scratch_requests(device, op, attrs, ins, outs)
        s = Scratch(device, requests, binding, lambda a: a.data.ptr)
        conv = nn.prepare_conv(device, attrs, ins[:2] if fused else ins, outs, s.ptrs.get("columns"))
        conv.scratch = s  # type: ignore[attr-defined]  (the columns live as long as the kernel)
        if not fused:
            conv.kernel_name = f"{conv.kernel_name}; {why}"  # type: ignore[attr-defined]
            return conv
        tail = nn.epilogue(outs[0].dtype, act, alpha, beta, bias=True, residual=residual)
        m = ins[1].shape[0]
        bshape = (m,) + (1,) * (ins[0].rank - 2)

        def im2col_fused(x, w, b, *rest):
            out = rest[-1]
            conv(x, w, out)
            tail(out, b.reshape(bshape), *rest[:-1], out)
        im2col_fused.kernel_name = f"fused_conv (im2col + cuBLAS + epilogue; {why})"  # type: ignore[attr-defined]
        return im2col_fused

    requests = scratch_requests(device, *instance)
    s = Scratch(device, requests, binding, lambda a: a.data.ptr)
    ws = int(s.ptrs["workspace"]) if requests else None
    bias, res_in_graph, act_in_graph = covers
    has_bias = len(ins) >= 3
    rest_act = "none" if act_in_graph == act else act
    rest_bias, rest_res = has_bias and not bias, residual and not res_in_graph
    run = graph.run
    keep = s  # the scratch lives as long as the kernel
    n_graph_in = 2 + int(bias) + int(res_in_graph)

    if not (rest_bias or rest_res or rest_act != "none"):
        if n_graph_in == 2 and len(ins) == 2:
            def cudnn_conv(x, w, out):
                run((x.data.ptr, w.data.ptr, out.data.ptr), ws)
            kernel = cudnn_conv
        elif n_graph_in == 3 and len(ins) == 3:
            def cudnn_conv_bias(x, w, b, out):
                run((x.data.ptr, w.data.ptr, b.data.ptr, out.data.ptr), ws)
            kernel = cudnn_conv_bias
        else:
            def cudnn_fused(*arrays):
                run(tuple(a.data.ptr for a in arrays), ws)
            kernel = cudnn_fused
    else:
        tail = nn.epilogue(outs[0].dtype, rest_act, alpha, beta, bias=rest_bias, residual=rest_res)
        m = ins[1].shape[0]
        bshape = (m,) if maps_last else (m,) + (1,) * (ins[0].rank - 2)  # channels last: the last axis

        def cudnn_then_epilogue(*arrays):
            out = arrays[-1]
            run(tuple(a.data.ptr for a in arrays[:n_graph_in]) + (out.data.ptr,), ws)
            extra = ((arrays[2].reshape(bshape),) if rest_bias else ()) + ((arrays[3],) if rest_res else ())
            tail(out, *extra, out)
        kernel = cudnn_then_epilogue
    kernel.scratch = keep  # type: ignore[attr-defined]
    covered = "+".join(n for n, on in (("bias", bias), ("residual", res_in_graph), (act_in_graph, act_in_graph != "none")) if on)
    wrong = sum(why.startswith("wrong result") for why in graph.rejected.values())
    kernel.kernel_name = (f"cuDNN {'NHWC ' if maps_last else ''}conv{'+' + covered if covered else ''} [{graph.engine}]"  # type: ignore[attr-defined]
                          + (" + epilogue" if rest_bias or rest_res or rest_act != "none" else "")
                          + (f" ({wrong} plan(s) with wrong results passed over)" if wrong else ""))
    return kernel


def _through_nchw(kernel, filter_last: bool, why: str):
    """A channels-last conv that cuDNN has no NHWC engine for: ``kernel`` (the NCHW way) on
    NCHW copies of the maps (and of a channels-last filter), the result copied back. The
    copies are allocated while it runs: a fallback, and its name says so."""
    import cupy as cp

    def nchw(a):  # (N, 1, H, W, C) -> (N, C, H, W); a stem's image is NCHW already
        return a if a.ndim == 4 else cp.ascontiguousarray(a[:, 0].transpose(0, 3, 1, 2))

    def through_nchw(x, w, *rest):
        out, extra = rest[-1], rest[:-1]  # extra: the bias, then the residual
        y = cp.empty((out.shape[0], out.shape[4], out.shape[2], out.shape[3]), out.dtype)
        kernel(nchw(x), nchw(w) if filter_last else w, *extra[:1], *(nchw(r) for r in extra[1:]), y)
        cp.copyto(out[:, 0], y.transpose(0, 2, 3, 1))
    through_nchw.scratch = kernel  # type: ignore[attr-defined]  (keeps the inner kernel's scratch)
    through_nchw.kernel_name = (f"{getattr(kernel, 'kernel_name', 'conv')} on NCHW copies of channels-last "  # type: ignore[attr-defined]
                                f"operands (no NHWC engine: {why})")
    return through_nchw
