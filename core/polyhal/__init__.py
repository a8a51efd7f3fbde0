"""polyhal: a pluggable heterogeneous runtime for Python.

Backends are plugins discovered through entry points; three policies (allocator selection,
encodings, memory spaces) are pluggy hooks. See README.md for a tour.
"""

from polyhal.creation import asarray, empty, from_dlpack
from polyhal.errors import (
    DeviceNotFoundError, DLPackError, DTypeError, IncompatibleBufferError, KernelNotFoundError,
    MappingError, OutOfMemoryError, PluginError, PipelineError, PolyhalError, PrecisionError, ProgramError, ShapeError,
)
from polyhal.eager import run_op
from polyhal.hal.allocator import Allocator, AllocatorStatistics
from polyhal.hal.buffer import Buffer
from polyhal.hal.device import Device
from polyhal.hal.flags import BufferCompatibility, BufferKind, BufferUsage, MemoryAccess, MemoryType
from polyhal.hal.kernels import KernelTable
from polyhal.hal.records import ANY_QUEUE, DeviceSpec, Heap
from polyhal.hal.tensor import Tensor
from polyhal.hookspecs import API_VERSION, hookimpl, hookspec
from polyhal.ir.program import Program, ProgramBuilder
from polyhal.ir.types import Affinity, Optimal, TensorType
from polyhal.passes.fusion import Fusion
from polyhal.passes.pipeline import DEFAULT_PIPELINE, Compilation, Pass, PassRegistration, Pipeline, fusion_pass
from polyhal.plan import Plan, compile
from polyhal.registry import Registry, default_registry, devices, get_device
from polyhal.target import Target

__version__ = "0.1.0"

__all__ = [
    "API_VERSION", "ANY_QUEUE", "Compilation", "DEFAULT_PIPELINE", "Fusion", "Pass", "PassRegistration", "Pipeline", "Target", "Affinity", "Allocator", "AllocatorStatistics", "Buffer",
    "BufferCompatibility", "BufferKind", "BufferUsage", "DLPackError", "DTypeError", "Device",
    "DeviceNotFoundError", "DeviceSpec", "Heap", "IncompatibleBufferError", "KernelNotFoundError", "KernelTable",
    "MappingError", "MemoryAccess", "MemoryType", "Optimal", "OutOfMemoryError", "Plan",
    "PipelineError", "PluginError", "PolyhalError", "PrecisionError", "Program", "ProgramBuilder", "ProgramError", "Registry",
    "ShapeError", "Tensor", "TensorType", "asarray", "compile", "default_registry", "devices",
    "empty", "from_dlpack", "fusion_pass", "get_device", "hookimpl", "hookspec", "run_op",
]
