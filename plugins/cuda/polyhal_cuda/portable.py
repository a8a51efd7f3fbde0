"""The ops whose kernels are written once for OpenCL, CUDA and HIP (:mod:`polyhal_gpu.portable`:
grid_sample, roi_align, det, tree_ensemble, tfidf_vectorizer), compiled with NVRTC.

An instance the portable kernels do not serve (float16, det of large matrices) runs through the
host fallback, as before they existed. Operands that are strided views are made contiguous
(inputs) or written through a contiguous temporary (outputs): the kernels index dense tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from polyhal_cuda.errors import check
from polyhal_gpu import portable

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the CUDA device; its module imports this one

OPS = portable.OPS


def prepare(device: "Device", op: str, attrs: dict, ins, outs, fallback: Callable[[], Any]) -> Any:
    """The kernel of one instance: the portable kernel, or ``fallback()`` where it has none."""
    return portable.prepare(op, attrs, ins, outs, make=lambda k: _launcher(device, k, len(ins)), fallback=fallback)


def _launcher(device: "Device", k: portable.PortableKernel, n_in: int) -> Any:
    def build() -> Any:
        import cupy

        with check(f"compiling {k.name} for {device.name}"):
            mod = cupy.RawModule(code=k.source, options=("-std=c++17",))
            mod.compile()
        return mod

    mod = device.module(("portable", k.source), build)
    with check(f"loading kernel {k.name} on {device.name}", kernel=k.name):
        fn = mod.get_function(k.name)
    grid, block = k.launch_shape

    def kernel(*arrays: Any) -> None:
        import cupy

        if not k.work_items:
            return
        dense = [a if a.flags.c_contiguous else cupy.ascontiguousarray(a) for a in arrays]
        device.launch(fn, k.name, grid, block, k.arguments(dense))
        for a, d in zip(arrays[n_in:], dense[n_in:]):
            if d is not a:
                a[...] = d

    kernel.kernel_name = f"{k.name} (portable C, NVRTC)"  # type: ignore[attr-defined]
    return kernel
