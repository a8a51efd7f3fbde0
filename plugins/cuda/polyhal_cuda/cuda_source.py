"""CUDA C sources of this package, and their compilation into cupy ``RawModule``\\ s.

Sources live in ``polyhal_gpu/cu/``; ``common.cuh`` is prepended to each (NVRTC gets no
include path). Templates are instantiated through NVRTC name expressions, and each device keeps
its compiled modules (:meth:`polyhal_cuda.device.CUDADevice.module`); cupy caches the binaries
on disk, so a later process does not compile again.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import TYPE_CHECKING, Any, Sequence

from polyhal_cuda.errors import check

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the CUDA device; its module imports this one

OPTIONS = ("-std=c++17",)


@functools.lru_cache(maxsize=None)
def source(name: str) -> str:
    """``common.cuh`` followed by ``cu/<name>``."""
    base = resources.files("polyhal_gpu") / "cu"
    return (base / "common.cuh").read_text() + "\n" + (base / name).read_text()


def module(device: "Device", name: str, expressions: Sequence[str]) -> Any:
    """The compiled module of ``cu/<name>`` with the template ``expressions`` instantiated."""
    import cupy

    key = (name, tuple(expressions))

    def build() -> Any:
        with check(f"compiling {name} for {device.name}"):
            mod = cupy.RawModule(code=source(name), options=OPTIONS, name_expressions=list(expressions))
            mod.compile()
        return mod

    return device.module(key, build)


def function(device: "Device", name: str, expressions: Sequence[str], expression: str) -> Any:
    """One kernel (``expression``, e.g. ``"radix_scatter<unsigned int, false, true>"``)."""
    mod = module(device, name, expressions)
    with check(f"loading kernel {expression} from {name} on {device.name}", kernel=expression):
        return mod.get_function(expression)
