"""The ops whose kernels are written once for OpenCL, CUDA and HIP (:mod:`polyhal_gpu.portable`:
grid_sample, roi_align, det, tree_ensemble, tfidf_vectorizer), compiled with hiprtc.

The source is polyhal-gpu's as it stands: ``portable.h`` gives HIP what it gives CUDA
(``extern "C" __global__`` kernels, ``__constant__`` tables, the thread index from ``blockIdx``,
``blockDim`` and ``threadIdx``), which hiprtc compiles for the device's architecture as it does
the other CUDA C sources (through :meth:`HIPDevice.function <polyhal_hip.device.HIPDevice.function>`
and its cache), only without ``compat.h``: these kernels use no warp intrinsics. Every AMD GPU
has float64, so sums and coordinates are in ``double``, as the numpy references compute.

An instance the portable kernels do not serve (float16, det of matrices above 16 x 16) runs
through the host fallback, as before they existed; so does a call with a strided operand (the
kernels index dense tensors, and polyhal's plans give them dense ones).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from polyhal_gpu import portable

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the HIP device; its module imports this one

OPS = portable.OPS


def prepare(device: "Device", op: str, attrs: dict, ins, outs, fallback: Callable[[], Any]) -> Any:
    """The kernel of one instance: the portable kernel, or ``fallback()`` where it has none."""
    return portable.prepare(op, attrs, ins, outs, make=lambda k: _launcher(device, k, fallback), fallback=fallback)


def _launcher(device: "Device", k: portable.PortableKernel, fallback: Callable[[], Any]) -> Any:
    fn = device.function(k.source, f"{k.name}.c", k.name)
    (grid, block), launch = k.launch_shape, device.launch
    strided: list[Any] = []  # the host fallback, made on the first call that needs it

    def kernel(*arrays: Any) -> None:
        if not k.work_items:
            return
        if not all(a.is_contiguous for a in arrays):
            if not strided:
                strided.append(fallback())
            strided[0](*arrays)
            return
        launch(fn, k.name, grid, block, k.arguments(arrays))

    kernel.kernel_name = f"{k.name} (portable C, hiprtc)"  # type: ignore[attr-defined]
    return kernel
