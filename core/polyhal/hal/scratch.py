"""Scratch memory: what a kernel declares it needs, and the memory spaces it can be placed in.

A kernel never allocates. Every temporary it uses is declared ahead of time as a
:class:`ScratchDecl` -- bytes per workgroup and per thread, as functions of the problem and the
workgroup size -- and the bufferize pass (:mod:`polyhal.passes.bufferize`) places each one, at
compile time, in one of three :class:`MemorySpace`\\ s:

``PRIVATE``
    per thread (registers, OpenCL ``__private``, CUDA local memory). Only for data no other
    thread reads (``shared=False``).
``WORKGROUP``
    shared by the threads of one workgroup (OpenCL ``__local``, CUDA ``__shared__``); threads
    synchronise with barriers. Sized per workgroup: private data of every thread of the group
    may be put here too (``bytes_per_thread * workgroup_size``).
``GLOBAL``
    a device buffer that the runtime allocates before launch (through ``select_allocator``,
    reused across the plan's dispatches by the buffer planner) and passes to the kernel; one
    workgroup-sized slice per workgroup.

The choice is the ``select_memory_space`` policy hook (see :mod:`polyhal.hookspecs`); the core's
default (:mod:`polyhal.policies.memory_space`) takes the first space of the declaration's
preference order that fits the device's :class:`MemoryLimits`. A scratch that fits no allowed
space is a :class:`ScratchError` when the plan is compiled, naming the kernel, the size and the
limits -- never a crash at run time.

This module is backend-neutral: the CPU, OpenCL and CUDA backends all declare scratch with
these records and receive the decisions as a :class:`ScratchBinding` in ``Device.prepare``.
:func:`place_scratch` is the placement itself, shared by the bufferize pass and by a backend
that prepares a kernel outside a plan (``Device.place_scratch``, by the device's own policy).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, Union

from polyhal.errors import PluginError, ProgramError
from polyhal.hal.flags import MemoryType

if TYPE_CHECKING:
    from polyhal.hal.records import DeviceSpec
    from polyhal.ir.types import TensorType

__all__ = [
    "DEFAULT_PRIVATE_BYTES", "KernelInfo", "MemoryLimits", "MemorySpace", "MemorySpacePolicy", "Problem",
    "ScratchAssignment", "ScratchBinding", "ScratchDecl", "ScratchError", "ScratchRequest", "first_fit",
    "check_placement", "place_scratch", "requests_for",
]

#: Private bytes per thread assumed when a device does not say (``DeviceSpec.limits["private_bytes"]``):
#: what a GPU thread holds in registers before spilling, give or take.
DEFAULT_PRIVATE_BYTES = 512


class ScratchError(ProgramError):
    """A kernel's scratch fits no memory space it may use (raised when a plan is compiled)."""


class MemorySpace(str, enum.Enum):
    """Where a scratch lives (see the module docstring)."""

    PRIVATE = "private"
    WORKGROUP = "workgroup"
    GLOBAL = "global"

    def __str__(self) -> str:
        return self.value


#: Spaces in order of speed; a declaration's default preference.
ALL_SPACES = (MemorySpace.PRIVATE, MemorySpace.WORKGROUP, MemorySpace.GLOBAL)


@dataclass(frozen=True)
class MemoryLimits:
    """How much of each memory space one kernel launch may use on a device.

    ``private_bytes`` is per thread, ``workgroup_bytes`` per workgroup, ``global_bytes`` the
    largest single global scratch allocation. The bufferize pass hands the hook the *remaining*
    limits: what the kernel's earlier scratches took is already subtracted.
    """

    private_bytes: int
    workgroup_bytes: int
    global_bytes: int

    @classmethod
    def of(cls, spec: "DeviceSpec") -> "MemoryLimits":
        """The limits a device declares: ``workgroup_bytes`` and ``limits["private_bytes"]`` of
        its spec (0 and :data:`DEFAULT_PRIVATE_BYTES` when absent), and the largest allocation
        of a heap serving device-local memory."""
        private = int(spec.limits.get("private_bytes", DEFAULT_PRIVATE_BYTES))
        glob = max((h.max_allocation_size for h in spec.heaps
                    if h.memory_type & MemoryType.DEVICE_LOCAL == MemoryType.DEVICE_LOCAL), default=0)
        glob = int(spec.limits.get("global_scratch_bytes", glob))
        return cls(private, int(spec.workgroup_bytes), glob)

    def limit(self, space: MemorySpace) -> int:
        """The limit of ``space`` in bytes (per thread, per workgroup, per allocation)."""
        return {MemorySpace.PRIVATE: self.private_bytes, MemorySpace.WORKGROUP: self.workgroup_bytes,
                MemorySpace.GLOBAL: self.global_bytes}[MemorySpace(space)]

    def minus(self, space: MemorySpace, nbytes: int) -> "MemoryLimits":
        """These limits after ``nbytes`` of ``space`` were taken (global allocations are separate
        buffers, so a global scratch leaves the global limit as it was)."""
        space = MemorySpace(space)
        if space is MemorySpace.PRIVATE:
            return MemoryLimits(self.private_bytes - nbytes, self.workgroup_bytes, self.global_bytes)
        if space is MemorySpace.WORKGROUP:
            return MemoryLimits(self.private_bytes, self.workgroup_bytes - nbytes, self.global_bytes)
        return self

    def fits(self, request: "ScratchRequest", space: MemorySpace) -> bool:
        """Whether ``request`` may go to ``space`` and is no larger than its limit."""
        return request.allows(space) and request.nbytes(space) <= self.limit(space)

    def __str__(self) -> str:
        return (f"private {self.private_bytes} B/thread, workgroup {self.workgroup_bytes} B, "
                f"global {self.global_bytes} B")


@dataclass(frozen=True)
class Problem:
    """The op instance a kernel is prepared for (what declarations are functions of)."""

    op: str
    attrs: Mapping[str, Any]
    in_types: tuple["TensorType", ...]
    out_types: tuple["TensorType", ...]


@dataclass(frozen=True)
class KernelInfo:
    """One kernel launch that has scratch: its name, op, workgroup size and workgroup count."""

    name: str
    op: str
    workgroup_size: int = 1
    workgroups: int = 1
    backend: str = ""

    def __str__(self) -> str:
        where = f"{self.backend} " if self.backend else ""
        return f"{where}kernel {self.name!r} ({self.op}, {self.workgroups} x {self.workgroup_size} threads)"


Size = Union[int, Callable[[Problem, int], int]]


@dataclass(frozen=True)
class ScratchDecl:
    """A kernel's statement of one scratch need.

    ``per_workgroup`` and ``per_thread`` are byte counts, or functions ``f(problem,
    workgroup_size) -> bytes``; ``per_launch`` is a buffer the whole launch shares (global
    memory only: an intermediate between the kernels of one op, a bitmask). ``shared`` says that threads of a workgroup read each other's
    part (so it cannot be private, and needs barriers where it is not global). ``spaces`` are the
    spaces the kernel has code for, in its order of preference (default: every space allowed by
    ``shared``, fastest first). ``purpose`` is one line for ``Plan.explain()``.
    """

    name: str
    shared: bool
    per_workgroup: Size = 0
    per_thread: Size = 0
    spaces: tuple[MemorySpace, ...] = ()
    alignment: int = 16
    purpose: str = ""
    per_launch: Size = 0

    def request(self, problem: Problem, kernel: KernelInfo) -> "ScratchRequest":
        """This declaration evaluated for ``problem`` launched as ``kernel``."""
        def size(s: Size) -> int:
            n = s(problem, kernel.workgroup_size) if callable(s) else s
            return int(n)

        spaces = tuple(MemorySpace(s) for s in self.spaces) or ALL_SPACES
        return ScratchRequest(kernel, self.name, self.shared, size(self.per_workgroup), size(self.per_thread),
                              spaces, self.alignment, self.purpose, size(self.per_launch))


@dataclass(frozen=True)
class ScratchRequest:
    """A :class:`ScratchDecl` evaluated for one launch: what the memory-space policy sees."""

    kernel: KernelInfo
    name: str
    shared: bool
    bytes_per_workgroup: int
    bytes_per_thread: int
    spaces: tuple[MemorySpace, ...] = ALL_SPACES
    alignment: int = 16
    purpose: str = ""
    bytes_per_launch: int = 0

    def __post_init__(self) -> None:
        if self.bytes_per_workgroup < 0 or self.bytes_per_thread < 0 or self.bytes_per_launch < 0:
            raise ScratchError(f"{self.kernel}: scratch {self.name!r} declares a negative size")

    def allows(self, space: MemorySpace) -> bool:
        """Whether the kernel has code for ``space`` and the data may live there (shared data,
        or data that is per workgroup anyway, cannot be private)."""
        space = MemorySpace(space)
        if space not in self.spaces:
            return False
        if self.bytes_per_launch and space is not MemorySpace.GLOBAL:
            return False  # shared by every workgroup of the launch: only global memory is
        if space is MemorySpace.PRIVATE:
            return not self.shared and self.bytes_per_workgroup == 0
        return True

    @property
    def workgroup_total(self) -> int:
        """Bytes one workgroup needs: its shared part plus every thread's private part."""
        return self.bytes_per_workgroup + self.bytes_per_thread * self.kernel.workgroup_size

    def nbytes(self, space: MemorySpace) -> int:
        """Bytes this scratch takes in ``space``, in that space's unit: per thread (private),
        per workgroup (workgroup) or in total (global: one slice per workgroup)."""
        space = MemorySpace(space)
        if space is MemorySpace.PRIVATE:
            return self.bytes_per_thread
        if space is MemorySpace.WORKGROUP:
            return self.workgroup_total
        return self.workgroup_total * max(self.kernel.workgroups, 1) + self.bytes_per_launch

    def describe(self) -> str:
        parts = []
        if self.bytes_per_workgroup:
            parts.append(f"{self.bytes_per_workgroup} B/workgroup")
        if self.bytes_per_thread:
            parts.append(f"{self.bytes_per_thread} B/thread")
        if self.bytes_per_launch:
            parts.append(f"{self.bytes_per_launch} B/launch")
        return f"{self.name} ({', '.join(parts) or '0 B'}{', shared' if self.shared else ''})"


@dataclass(frozen=True)
class ScratchAssignment:
    """Where the bufferize pass put one scratch, who decided, and the limit it was checked against.

    ``offset`` is the scratch's byte offset in its device's global arena (GLOBAL only; set by
    the buffer planner).
    """

    request: ScratchRequest
    space: MemorySpace
    nbytes: int
    limit: int
    plugin: str
    offset: int = -1

    def __str__(self) -> str:
        unit = {MemorySpace.PRIVATE: "B/thread", MemorySpace.WORKGROUP: "B/workgroup",
                MemorySpace.GLOBAL: "B"}[self.space]
        where = f" @ global arena +{self.offset}" if self.space is MemorySpace.GLOBAL and self.offset >= 0 else ""
        why = f" -- {self.request.purpose}" if self.request.purpose else ""
        return (f"{self.request.kernel.name}.{self.request.name}: {self.space} {self.nbytes} {unit} "
                f"(limit {self.limit}; by {self.plugin}){where}{why}")


@dataclass
class ScratchBinding:
    """What a backend's ``prepare`` receives: the placement of each scratch of the op, and the
    buffer of each global one (the backend's native object for the slice, e.g. a numpy byte
    array or an OpenCL sub-buffer), by ``(kernel name, scratch name)``."""

    assignments: tuple[ScratchAssignment, ...] = ()
    buffers: dict[tuple[str, str], Any] = field(default_factory=dict)

    def _find(self, name: str, kernel: str | None) -> ScratchAssignment:
        for a in self.assignments:
            if a.request.name == name and (kernel is None or a.request.kernel.name == kernel):
                return a
        raise KeyError(f"no scratch {name!r}" + (f" of kernel {kernel!r}" if kernel else "")
                       + f"; declared: {[f'{a.request.kernel.name}.{a.request.name}' for a in self.assignments]}")

    def space(self, name: str, kernel: str | None = None) -> MemorySpace:
        """The space scratch ``name`` (of ``kernel``, if several kernels declare that name) went to."""
        return self._find(name, kernel).space

    def buffer(self, name: str, kernel: str | None = None) -> Any:
        """The native global buffer of scratch ``name``; KeyError unless it went to GLOBAL."""
        a = self._find(name, kernel)
        return self.buffers[(a.request.kernel.name, a.request.name)]

    def __bool__(self) -> bool:
        return bool(self.assignments)


def requests_for(problem: Problem, kernels: Sequence[tuple[KernelInfo, Sequence[ScratchDecl]]]
                 ) -> tuple[ScratchRequest, ...]:
    """Evaluate every declaration of every kernel of an op instance (helper for backends)."""
    return tuple(d.request(problem, k) for k, decls in kernels for d in decls)


#: A memory-space policy: ``policy(request, limits) -> (answer, who)``, where ``answer`` is a
#: :class:`MemorySpace` (or its value) or None when nothing fits, and ``who`` names the plugin that
#: answered. A registry's policy asks its ``select_memory_space`` hook; None means :func:`first_fit`.
MemorySpacePolicy = Callable[[ScratchRequest, MemoryLimits], "tuple[Any, str]"]

#: Who decided, in a :class:`ScratchAssignment`, when no policy was given.
FIRST_FIT = "first fit"


def first_fit(request: ScratchRequest, limits: MemoryLimits) -> MemorySpace | None:
    """The core's default rule: the first space of the request's own order of preference that the
    data may live in and that ``limits`` has room for; None when none has."""
    return next((space for space in request.spaces if limits.fits(request, space)), None)


def place_scratch(requests: Sequence[ScratchRequest], limits: MemoryLimits, device: str,
                  policy: MemorySpacePolicy | None = None) -> tuple[ScratchAssignment, ...]:
    """Place each request, in order, by ``policy`` (default :func:`first_fit`) within the limits
    its kernel has left (``limits`` less what the kernel's earlier scratches took), and validate
    each answer. ``device`` names the device in errors.

    Raises :class:`ScratchError` when a request fits no space it allows (naming kernel, size and
    every limit) or the policy put it where it may not go or does not fit, and
    :class:`~polyhal.errors.PluginError` when the policy answers something that is not a space.
    """
    left: dict[str, MemoryLimits] = {}
    out = []
    for req in requests:
        room = left.get(req.kernel.name, limits)
        if policy is None:
            answer, plugin = first_fit(req, room), FIRST_FIT
        else:
            answer, plugin = policy(req, room)
        if answer is None:
            raise ScratchError(_fits_nowhere(device, req, room))
        space = check_placement(answer, plugin, req, room, device)
        nbytes, limit = req.nbytes(space), room.limit(space)
        out.append(ScratchAssignment(req, space, nbytes, limit, plugin))
        left[req.kernel.name] = room.minus(space, nbytes)
    return tuple(out)


def check_placement(answer: Any, plugin: str, req: ScratchRequest, limits: MemoryLimits, device: str) -> MemorySpace:
    """The space a policy's (non-None) ``answer`` names for ``req``, validated: a
    :class:`~polyhal.errors.PluginError` when it is not a MemorySpace, a :class:`ScratchError` when
    the request may not live there or does not fit what ``limits`` leaves."""
    try:
        space = MemorySpace(answer)
    except ValueError:
        raise PluginError(f"plugin {plugin!r} returned {answer!r} from select_memory_space; "
                          f"it must return a MemorySpace ({', '.join(s.value for s in MemorySpace)}) "
                          "or None") from None
    if not req.allows(space):
        raise ScratchError(
            f"plugin {plugin!r} put scratch {req.name!r} of {req.kernel} in {space} memory, but the "
            f"kernel allows only {[s.value for s in req.spaces if req.allows(s)]}"
            + (" (shared data cannot be private)" if space is MemorySpace.PRIVATE else ""))
    nbytes, limit = req.nbytes(space), limits.limit(space)
    if nbytes > limit:
        raise ScratchError(
            f"plugin {plugin!r} put scratch {req.name!r} of {req.kernel} in {space} memory: "
            f"{nbytes} B exceeds the {limit} B left there on {device}")
    return space


def _fits_nowhere(device: str, req: ScratchRequest, limits: MemoryLimits) -> str:
    tried = []
    for s in req.spaces:
        if s is MemorySpace.PRIVATE and not req.allows(s):
            tried.append("private: not allowed for shared data")
            continue
        unit = {MemorySpace.PRIVATE: "B/thread", MemorySpace.WORKGROUP: "B/workgroup",
                MemorySpace.GLOBAL: "B"}[s]
        tried.append(f"{s}: needs {req.nbytes(s)} {unit}, limit {limits.limit(s)} {unit}")
    return (f"scratch {req.name!r} of {req.kernel} fits no memory space on {device}: "
            + "; ".join(tried)
            + ". Use a smaller problem (split the tensor), another device, or a memory-space policy "
              "with a kernel variant that allows more spaces")
