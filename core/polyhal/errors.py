"""Every error polyhal raises.

All derive from :class:`PolyhalError`, so ``except polyhal.PolyhalError`` catches any of them;
each also derives from the builtin a Python user would expect (``ValueError`` for bad arguments,
``MemoryError`` for out-of-memory, ``LookupError`` for unknown names). Messages say what was wrong
and what to do next.
"""

from __future__ import annotations


class PolyhalError(Exception):
    """Base class of every polyhal error."""


class PluginError(PolyhalError):
    """A plugin failed to load, declared an incompatible API, or broke the hook contract.

    ``plugin`` names the plugin at fault when it is known (a hook implementation that raised).
    """

    def __init__(self, *args: object, plugin: str | None = None) -> None:
        super().__init__(*args)
        self.plugin = plugin


class KernelError(PolyhalError, RuntimeError):
    """A kernel raised while a plan ran; the message names device, op and plugin, and the
    kernel's own exception is chained (``__cause__``)."""

    def __init__(self, message: str, *, device: str | None = None, op: str | None = None,
                 plugin: str | None = None) -> None:
        super().__init__(message)
        self.device, self.op, self.plugin = device, op, plugin


class DeviceNotFoundError(PolyhalError, LookupError):
    """A device name that no loaded plugin registered."""


class IncompatibleBufferError(PolyhalError, ValueError):
    """A memory type, usage or size that the allocator cannot serve."""


class OutOfMemoryError(PolyhalError, MemoryError):
    """An allocation the device could not satisfy; the message names device, request and use."""


class MappingError(PolyhalError, ValueError):
    """Mapping a buffer that is not host-visible, or a mapping used wrongly."""


class ShapeError(PolyhalError, ValueError):
    """Operand shapes that do not fit the op."""


class DTypeError(PolyhalError, TypeError):
    """Operand element types that do not fit the op."""


class ProgramError(PolyhalError, ValueError):
    """A malformed program: unknown op, value from another program, missing input, ..."""


class PrecisionError(PolyhalError, ValueError):
    """A compile precision that polyhal does not know, or that nothing can compute in."""


class PipelineError(PolyhalError, ValueError):
    """A compile pipeline whose passes cannot run in the order given (a requirement no earlier
    pass provides), or a malformed pass record."""


class KernelNotFoundError(PolyhalError, LookupError):
    """No candidate device offers a kernel for an op."""


class ArithmeticDomainError(PolyhalError, ArithmeticError):
    """A run whose data leaves an op's domain where polyhal refuses instead of giving an
    unspecified value (an integer division by zero)."""


class LifetimeError(PolyhalError, ValueError):
    """A tensor used after its buffer was released, or written although it is read-only."""


class DLPackError(PolyhalError, BufferError):
    """A DLPack exchange that cannot be done (consumed capsule, unsupported device, copy refused)."""


class UsageError(PolyhalError, ValueError):
    """A command-line argument or option value that cannot be used (the CLI exits 2)."""


class ConfigError(PolyhalError, ValueError):
    """An environment variable whose value polyhal cannot use; the message names the variable,
    the value and what it accepts. ``variable`` and ``value`` say which."""

    def __init__(self, message: str, *, variable: str | None = None, value: str | None = None) -> None:
        super().__init__(message)
        self.variable, self.value = variable, value


class SemaphoreTimeoutError(PolyhalError, TimeoutError):
    """A wait on a timeline semaphore that its timeout ended before the value was reached (a
    wait that nothing will satisfy); the message names the semaphore, its queue and the values.
    ``semaphore`` and ``value`` say which."""

    def __init__(self, message: str, *, semaphore: str | None = None, value: int | None = None) -> None:
        super().__init__(message)
        self.semaphore, self.value = semaphore, value


class SemaphoreFailedError(PolyhalError, RuntimeError):
    """A wait on a timeline semaphore that was failed (the work that would signal it raised);
    every waiter gets it, with the failure chained (``__cause__``). ``semaphore`` names it."""

    def __init__(self, message: str, *, semaphore: str | None = None) -> None:
        super().__init__(message)
        self.semaphore = semaphore
