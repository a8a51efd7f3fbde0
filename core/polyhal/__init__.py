"""polyhal: a pluggable heterogeneous runtime for Python.

Backends are plugins discovered through entry points; three policies (allocator selection,
encodings, memory spaces) are pluggy hooks. See README.md for a tour.

The compiler side -- the op set, programs, passes and plans (``Program``, ``ProgramBuilder``,
``KernelTable``, ``compile``, ``Plan``, ``run_op``) and the ONNX session (``InferenceSession``,
which imports ``onnx``) are imported on first use, so that
``import polyhal`` costs little more than numpy for what needs only devices and buffers
(``polyhal devices``, a backend's own import); bench/import_time.py holds it to that.
"""

import importlib
from typing import TYPE_CHECKING, Any

from polyhal.creation import asarray, empty, from_dlpack
from polyhal.errors import (
    ConfigError, DeviceNotFoundError, DLPackError, DTypeError, IncompatibleBufferError, KernelError,
    KernelNotFoundError, MappingError, OutOfMemoryError, PipelineError, PluginError, PolyhalError,
    PrecisionError, ProgramError, SemaphoreFailedError, SemaphoreTimeoutError, ShapeError,
)
from polyhal.hal.allocator import Allocator, AllocatorStatistics
from polyhal.hal.buffer import Buffer
from polyhal.hal.device import Device
from polyhal.hal.flags import BufferCompatibility, BufferKind, BufferUsage, MemoryAccess, MemoryType
from polyhal.hal.records import ANY_QUEUE, DeviceSpec, Heap
from polyhal.hal.tensor import Tensor
from polyhal.hookspecs import API_VERSION, hookimpl, hookspec
from polyhal.ir.types import Affinity, Optimal, TensorType
from polyhal.registry import Registry, default_registry, devices, get_device

if TYPE_CHECKING:
    from polyhal.eager import run_op
    from polyhal.frontends.onnx.session import InferenceSession
    from polyhal.hal.kernels import KernelTable
    from polyhal.ir.program import Program, ProgramBuilder
    from polyhal.passes.fusion import Fusion
    from polyhal.passes.pipeline import DEFAULT_PIPELINE, Compilation, Pass, PassRegistration, Pipeline, fusion_pass
    from polyhal.plan import Plan, compile
    from polyhal.target import Target

#: Names imported on first use (PEP 562), and the module of each.
_ON_FIRST_USE = {"InferenceSession": "polyhal.frontends.onnx.session", "KernelTable": "polyhal.hal.kernels",
                 "Plan": "polyhal.plan", "Program": "polyhal.ir.program", "ProgramBuilder": "polyhal.ir.program",
                 "compile": "polyhal.plan", "run_op": "polyhal.eager",
                 "Target": "polyhal.target", "Fusion": "polyhal.passes.fusion", **dict.fromkeys(
                     ("DEFAULT_PIPELINE", "Compilation", "Pass", "PassRegistration", "Pipeline", "fusion_pass"),
                     "polyhal.passes.pipeline")}

__all__ = [
    "API_VERSION", "ANY_QUEUE", "Affinity", "Allocator", "AllocatorStatistics", "Buffer",
    "BufferCompatibility", "BufferKind", "BufferUsage", "Compilation", "ConfigError", "DEFAULT_PIPELINE", "DLPackError", "DTypeError",
    "Device", "DeviceNotFoundError", "DeviceSpec", "Fusion", "Heap", "IncompatibleBufferError", "InferenceSession",
    "KernelError",
    "KernelNotFoundError",
    "KernelTable", "MappingError", "MemoryAccess", "MemoryType", "Optimal", "OutOfMemoryError", "Pass",
    "PassRegistration", "Pipeline", "PipelineError", "Plan", "PluginError", "PolyhalError", "PrecisionError", "Program", "ProgramBuilder", "ProgramError", "Registry",
    "SemaphoreFailedError", "SemaphoreTimeoutError", "ShapeError", "Target", "Tensor", "TensorType", "asarray", "compile", "default_registry", "devices",
    "empty", "from_dlpack", "fusion_pass", "get_device", "hookimpl", "hookspec", "run_op",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":  # the distribution's metadata, the one place the version is written
        from polyhal.distribution import version

        globals()[name] = value = version()
        return value
    module = _ON_FIRST_USE.get(name)
    if module is None:
        raise AttributeError(f"module 'polyhal' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_ON_FIRST_USE) | {"__version__"})
