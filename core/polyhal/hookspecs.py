"""The whole plugin contract of polyhal, in one module.

A plugin is a module or object with functions marked ``@polyhal.hookimpl`` whose names are the
hooks below. Backends are installed as distributions with an entry point in the group
``polyhal.backends``, imported when one of their devices is first asked for, so a backend's
policy hooks answer for its own devices (and defer, returning None, for the others); policy
plugins use the group ``polyhal.plugins``, imported with the registry, or are registered in code
with ``polyhal.default_registry().register(obj)`` (docs/architecture.md, "Plugins load on demand").

Every plugin module declares ``POLYHAL_API_VERSION = 1`` (see :data:`API_VERSION`); a plugin
declaring another major version is skipped with its reason shown by ``polyhal devices``.

polyhal calls every hook through pluggy (:mod:`polyhal.hookcall` records which plugin answered),
so ``tryfirst`` / ``trylast``, hook wrappers (``wrapper=True`` or old-style ``hookwrapper=True``,
which see and may replace an answer) and ``pm.add_hookcall_monitoring`` work as in pytest. Hooks
are called while compiling and when a device is created, never while a plan runs.

Hooks are grouped under banner comments: device registration, allocation policy, cost model,
allocators, bufferization policy (memory spaces), encoding resolution, compile passes, so a plugin author learns
the whole contract from this one file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

import pluggy

if TYPE_CHECKING:
    from polyhal.hal.allocator import Allocator
    from polyhal.hal.device import Device
    from polyhal.hal.flags import BufferUsage, MemoryType
    from polyhal.hal.records import DeviceSpec, Workload
    from polyhal.hal.scratch import KernelInfo, MemoryLimits, MemorySpace, ScratchRequest
    from polyhal.ir.encoding import Encoding, Layout
    from polyhal.ir.types import TensorType

#: The plugin API version this core implements. Plugins declare the one they were written for.
API_VERSION = 1

hookspec = pluggy.HookspecMarker("polyhal")
hookimpl = pluggy.HookimplMarker("polyhal")


# --------------------------------------------------------------------------------------------------
# Device registration
# --------------------------------------------------------------------------------------------------

@hookspec
def register_devices() -> Iterable["DeviceSpec"]:
    """Register the devices this plugin provides.

    Called for every plugin (not firstresult); results are concatenated. Enumeration must be
    cheap and create nothing: each :class:`~polyhal.hal.records.DeviceSpec` carries a
    ``factory`` that the core calls on first use. A backend that finds no hardware returns an
    empty list and may say why through :func:`report_unavailable`.

    :returns: an iterable of ``DeviceSpec`` records with unique names (conventionally
        ``"<backend>:<index>"``) and a ``rank`` (higher is preferred; CPU 0, OpenCL CPU 10,
        OpenCL/CUDA GPUs 100 and up). Give each its ``kernel_names`` (the backend's kernel set):
        then compiling a program creates only the devices it runs on.

    Example::

        @polyhal.hookimpl
        def register_devices():
            return [DeviceSpec(name="mydev:0", backend="mydev", rank=50, factory=MyDevice,
                               heaps=(Heap(MemoryType.DEVICE_LOCAL, BufferUsage.DEFAULT, 1 << 30),),
                               kernel_names=frozenset({"add", "matmul"}))]
    """


@hookspec
def report_unavailable() -> Iterable[str]:
    """Say why this plugin registered fewer devices than a user might expect.

    Called for every plugin (not firstresult). ``polyhal devices`` prints each reason next to
    the plugin's name, e.g. ``"no OpenCL platform found (install an ICD such as pocl-opencl-icd)"``.

    :returns: an iterable of human-readable reasons (may be empty).

    Example::

        @polyhal.hookimpl
        def report_unavailable():
            return [] if _driver_loaded() else ["libmydev.so not found; install the mydev driver"]
    """


# --------------------------------------------------------------------------------------------------
# Allocation policy
# --------------------------------------------------------------------------------------------------

@hookspec(firstresult=True)
def select_allocator(
    candidates: Sequence[tuple["DeviceSpec", int]],
    memory_type: "MemoryType",
    buffer_usage: "BufferUsage",
    flags: int,
) -> int | None:
    """Choose which candidate allocates a buffer that several devices may use (IREE's
    ``hal.allocator.select`` / ``iree_hal_module_device_policy_t``).

    firstresult: implementations are called from the most recently registered to the earliest
    until one returns an ``int``; ``None`` passes to the next (pluggy's order: ``tryfirst`` /
    ``trylast`` move an implementation, and hook wrappers may change the answer). User plugins run
    before polyhal's built-in policies (``first``, ``lead``, ``rank``, ``cost``, registered first),
    of which only the one chosen with ``--policy`` / ``POLYHAL_POLICY`` answers; a ``trylast``
    user implementation runs after them. If even the built-in policy defers, the core takes the
    first candidate. An answer that is not an ``int`` index into ``candidates``, or an exception,
    is an error naming the plugin.

    The buffer's size is deliberately not a parameter: the decision depends only on the
    arguments below, so the core computes it once per distinct argument tuple and reuses it
    (memoization) — at plan-compile time, never while a plan runs. What else a policy may read
    (the ``--device`` list of the compile, the op being placed) and how it says *why* it chose
    (for ``polyhal explain``) is :func:`polyhal.policy.current` / :func:`polyhal.policy.record_reason`;
    a decision depends on those only if the policy read them.

    :param candidates: 1 to 64 ``(device spec, queue affinity)`` pairs, in the program's order,
        keeping only devices with a heap that serves ``memory_type`` and ``buffer_usage`` (the
        core checks that first); a queue affinity of -1 means any queue.
    :param memory_type: the :class:`~polyhal.hal.flags.MemoryType` the buffer requires.
    :param buffer_usage: the :class:`~polyhal.hal.flags.BufferUsage` it will see.
    :param flags: reserved for policy flags (0 today).
    :returns: the index into ``candidates`` of the chosen pair, or ``None`` to defer.

    Example (prefer any GPU)::

        @polyhal.hookimpl
        def select_allocator(candidates, memory_type, buffer_usage, flags):
            for i, (spec, _queues) in enumerate(candidates):
                if "gpu" in spec.capabilities:
                    polyhal.policy.record_reason(f"{spec.name} is a GPU")
                    return i
            return None
    """


# --------------------------------------------------------------------------------------------------
# Cost model (read by the built-in ``cost`` policy: devices take part in the choice)
# --------------------------------------------------------------------------------------------------

@hookspec(firstresult=True)
def estimate_cost(device_spec: "DeviceSpec", workload: "Workload") -> float | None:
    """Estimate how long ``device_spec``'s device would take to run ``workload``, in seconds.

    The ``cost`` policy adds the time to move operands that live on other devices (see
    :func:`link_bandwidth`) and picks the cheapest candidate. A backend answers for its own
    devices (from its knowledge of its kernels, occupancy, clocks) and returns ``None`` for
    others; a user plugin, registered later, may override any. Where nobody answers, the core
    uses a roofline from ``DeviceSpec.limits`` (``memory_bandwidth``, ``peak_flops``,
    ``launch_latency``).

    firstresult; called at compile time only, once per distinct (candidates, op signature,
    operand placement), since the decisions it feeds are memoized.

    :param device_spec: the candidate device.
    :param workload: a :class:`polyhal.policy.Workload`: ``op`` name, ``inputs`` / ``outputs``
        tensor types, ``attrs``, ``input_devices`` (where each operand lives, ``None`` if not
        placed yet); ``flops``, ``input_bytes`` and ``bytes_from(device)`` help.
    :returns: seconds (``>= 0``; ``math.inf`` for "this device must not run it"), or ``None``.

    Example::

        @polyhal.hookimpl
        def estimate_cost(device_spec, workload):
            if device_spec.backend != "mydev":
                return None
            return 4e-6 + workload.flops / 2e12      # launch latency + 2 TFLOP/s
    """


@hookspec(firstresult=True)
def link_bandwidth(src: "DeviceSpec", dst: "DeviceSpec") -> float | None:
    """Declare the bandwidth, in bytes per second, of copying from ``src`` to ``dst``.

    firstresult. A backend declares the links between its own devices (peer-to-peer, shared
    host memory) and returns ``None`` otherwise; ``math.inf`` means a copy is free (same
    memory). Bandwidths measured with :func:`polyhal.policies.cost.measure_link` take precedence;
    without either, ``DeviceSpec.limits["link_bandwidth"]`` or a PCIe-like default is used.

    Example::

        @polyhal.hookimpl
        def link_bandwidth(src, dst):
            if src.backend == dst.backend == "mydev":
                return 300e9                          # NVLink-class peer copies
            return None
    """


# --------------------------------------------------------------------------------------------------
# Allocators
# --------------------------------------------------------------------------------------------------

@hookspec(firstresult=True)
def wrap_allocator(device: "Device", memory_type: "MemoryType", allocator: "Allocator") -> "Allocator | None":
    """Replace or wrap the allocator that serves ``memory_type`` on ``device`` (RMM's resource
    adaptors: a caching pool, statistics, a limit, logging; see :mod:`polyhal.hal.adaptors`).

    Called when a device is created, once per memory heap of the device and per implementing
    plugin, in registration order: each receives what the previous returned, so adaptors from
    several plugins stack (the most recently registered plugin's is outermost). Each of these
    calls goes through pluggy with that one plugin's implementation (firstresult), so a hook
    wrapper (``wrapper=True`` / ``hookwrapper=True``) runs around every step and may change its
    answer. A heap whose allocator changed is routed to it; buffers always return to the
    allocator that made them, so an allocator may also be swapped later with
    :func:`polyhal.hal.adaptors.set_device_allocator`. The device's own allocator stays in
    ``device.native_allocator`` for backend-only operations (trim, mapping).

    :param device: the :class:`~polyhal.hal.device.Device` just created.
    :param memory_type: the memory type of the heap being served.
    :param allocator: the allocator so far (the device's own, or an earlier plugin's adaptor).
    :returns: an :class:`~polyhal.hal.allocator.Allocator` of the same device (usually an
        adaptor over ``allocator``), or ``None`` to leave it.

    Example (a caching pool for device-local memory)::

        from polyhal.hal.adaptors import CachingPoolAdaptor

        @polyhal.hookimpl
        def wrap_allocator(device, memory_type, allocator):
            if memory_type & polyhal.MemoryType.DEVICE_LOCAL == polyhal.MemoryType.DEVICE_LOCAL:
                return CachingPoolAdaptor(allocator)
            return None
    """


# --------------------------------------------------------------------------------------------------
# Bufferization policy (memory spaces of kernel scratch)
# --------------------------------------------------------------------------------------------------

@hookspec(firstresult=True)
def select_memory_space(
    device: "DeviceSpec",
    kernel: "KernelInfo",
    scratch: "ScratchRequest",
    limits: "MemoryLimits",
) -> "MemorySpace | None":
    """Choose the memory space of one scratch buffer of one kernel (the bufferization policy).

    Kernels never allocate: each declares its scratch (:class:`~polyhal.hal.scratch.ScratchDecl`,
    bytes per workgroup and per thread as functions of the problem and workgroup size), and the
    bufferize pass asks this hook, once per scratch, at plan-compile time, where it goes:
    ``PRIVATE`` (per thread), ``WORKGROUP`` (OpenCL ``__local`` / CUDA ``__shared__``, shared by
    the group's threads) or ``GLOBAL`` (a buffer the runtime allocates before launch through
    ``select_allocator`` and passes in). The decision is recorded in the plan
    (``plan.explain()`` shows it) and handed to the backend's ``prepare``, which generates the
    kernel for that space.

    firstresult: the most recently registered plugin answers first; ``None`` defers. The core's
    default (:mod:`polyhal.policies.memory_space`: the first space of the kernel's preference
    order that fits ``limits``) is registered first, so it runs last. An answer the kernel has
    no code for (not in ``scratch.spaces``), or that does not fit ``limits``, is a
    :class:`~polyhal.hal.scratch.ScratchError` naming the plugin; a scratch that fits no allowed
    space is a ``ScratchError`` naming kernel, size and limit -- at compile time, never a crash
    at run time.

    :param device: the spec of the device the kernel runs on.
    :param kernel: the :class:`~polyhal.hal.scratch.KernelInfo` (name, op, workgroup size and count).
    :param scratch: the :class:`~polyhal.hal.scratch.ScratchRequest`: ``name``, ``shared``,
        ``bytes_per_workgroup``, ``bytes_per_thread``, allowed ``spaces`` in the kernel's order
        of preference, ``nbytes(space)``.
    :param limits: the :class:`~polyhal.hal.scratch.MemoryLimits` left for this kernel (what
        its earlier scratches took already subtracted): ``private_bytes`` per thread,
        ``workgroup_bytes`` per workgroup, ``global_bytes`` per allocation.
    :returns: a :class:`~polyhal.hal.scratch.MemorySpace`, or ``None`` to defer.

    Example (keep a GPU's shared memory free for the sort kernels)::

        from polyhal.hal.scratch import MemorySpace

        @polyhal.hookimpl
        def select_memory_space(device, kernel, scratch, limits):
            if "gpu" in device.capabilities and kernel.op != "sort" and scratch.allows(MemorySpace.GLOBAL):
                return MemorySpace.GLOBAL
            return None
    """


# --------------------------------------------------------------------------------------------------
# Encoding resolution (data tiling)
# --------------------------------------------------------------------------------------------------

@hookspec(firstresult=True)
def resolve_encoding(device: "DeviceSpec", encoding: "Encoding", tensor_type: "TensorType") -> "Layout | None":
    """Turn an encoding into this device's concrete layout for one tensor type (IREE's layout
    resolvers: ``#iree_cpu.cpu_encoding_resolver``, ``#iree_encoding.identity_resolver``).

    Encodings (:mod:`polyhal.ir.encoding`, e.g. ``MatmulEncoding``: operand role, element
    types, the op's ``(M, N, K)``) say what a tensor is; the layout says how its bytes are
    arranged on ``device``. MaterializeEncoding (:mod:`polyhal.passes.materialize_encoding`)
    calls this once per (device, encoded type) at compile time, after placement, and then folds
    every encode op whose two sides have the same layout (``Layout.is_same_layout``; two
    identity layouts are the same): a backend without data tiling pays no dispatch and no byte.
    Where layouts differ it inserts the layout's ``pack_op`` / ``unpack_op`` dispatches, so a
    backend returning a non-identity layout must have kernels for those ops (and for whatever
    ``Layout.materialize_dispatch`` lowers to, e.g. ``mmt4d``).

    firstresult: the most recently registered plugin answers first; ``None`` defers (return
    ``None`` for devices of other backends and for encodings you do not know). The core's
    identity resolver (:mod:`polyhal.policies.identity_encoding`) is registered first, so it
    runs last: a device nobody resolves for gets the identity layout, and explain says why. An
    answer that is not a :class:`~polyhal.ir.encoding.Layout` for ``tensor_type``, or an
    exception, is a :class:`~polyhal.errors.PluginError` naming the plugin.

    :param device: the spec of the device the value lives on.
    :param encoding: the encoding attribute (immutable, hashable; ``tensor_type.encoding``).
    :param tensor_type: the value's type (shape, element type, ``encoding``).
    :returns: a :class:`~polyhal.ir.encoding.Layout` (``IdentityLayout(tensor_type)``,
        ``PackedLayout(...)`` or a backend's own subclass) whose ``tensor_type`` has the same
        shape and element type, or ``None`` to defer.

    Example (tile float32 matmul operands 8x8 on my devices)::

        from polyhal.ir.encoding import MatmulEncoding, PackedLayout, LHS, RHS

        @polyhal.hookimpl
        def resolve_encoding(device, encoding, tensor_type):
            if device.backend != "mydev" or not isinstance(encoding, MatmulEncoding):
                return None
            if encoding.operand_index == RHS:   # (K, N) -> (N1, K1, N0, K0)
                return PackedLayout(tensor_type, (1, 0), (8, 8), outer_dims_perm=(1, 0))
            return PackedLayout(tensor_type, (0, 1), (8, 8))   # LHS / RESULT -> (M1, X1, M0, X0)
    """


# --------------------------------------------------------------------------------------------------
# Compile passes
# --------------------------------------------------------------------------------------------------

@hookspec
def register_passes() -> Iterable[object]:
    """Compile passes this plugin adds to every compile's pipeline (onnxruntime's EPs add graph
    transformers the same way; the passes run on :class:`polyhal.Target`, so a pass sees the
    compile's devices, kernel sets and policies).

    Called for every plugin (not firstresult); results are concatenated in registration order
    and inserted into :data:`polyhal.passes.pipeline.DEFAULT_PIPELINE` (see that module for the
    order and the properties each built-in pass requires and provides). A record that is not a
    :class:`polyhal.PassRegistration`, or whose pass cannot go where it asks (an unknown anchor,
    a requirement no earlier pass provides), is left out with a warning naming the plugin; the
    other plugins' passes still run. A pass's own exception fails that compile, naming the pass.

    A backend claims a fusion this way (as onnxruntime's execution providers claim the nodes they
    fuse): its pass, made with :func:`polyhal.fusion_pass`, names in ``creates`` the ops it may
    create -- usually the backend's own (:meth:`polyhal.KernelTable.define`) -- and asks
    ``target.fusible(op, ops)`` before each rewrite. A pass that claims an op none of the
    plugin's devices has a kernel for is left out with a warning naming the plugin and the op.

    :returns: :class:`polyhal.PassRegistration` records: ``PassRegistration(pass_, after=name)``
        or ``before=name``; ``pass_`` is a :class:`polyhal.Pass` (name, ``run(compilation,
        target)``, ``requires``, ``provides``).

    Example (fuse add + relu into my device's own op, where placement puts them on my device)::

        from polyhal import PassRegistration, fusion_pass

        def fuse_add_relu(program, fusible):  # relu(add(x, y)) into mydev.add_relu
            ...  # for each match: if fusible("mydev.add_relu", (add, relu)): rewrite it
            return new_program, fusions  # fusions: polyhal.Fusion records, for explain

        @polyhal.hookimpl
        def register_passes():
            return [PassRegistration(fusion_pass("mydev-add-relu", fuse_add_relu, creates=("mydev.add_relu",),
                                                 provides="mydev-add-relu-fused"),
                                     after="pool-before-pointwise-conv")]
    """
