"""Cross-device transfers: who moves the bytes, and how (see ``Device.can_copy``).

A transfer from ``src`` to ``dst`` is done by the destination's backend when it can copy that
pair, else by the source's, else it goes through a host array (``src.download`` then
``dst.upload``). :func:`route` decides once, when a plan is built; :func:`transfer_fn` gives the
hot-path callable; :class:`Route` says what explain prints.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from polyhal.hal.device import Device


@dataclass(frozen=True)
class Route:
    """How a transfer goes: ``by`` is the device whose backend copies (None: staged through a
    host array by the core), ``how`` its path in words."""

    src: "Device"
    dst: "Device"
    by: "Device | None"
    how: str

    def explain(self, nbytes: int) -> str:
        """``"cpu:0 -> opencl:0, 4096 B, by opencl (enqueue_copy)"``."""
        who = f"by {self.by.spec.backend} ({self.how})" if self.by is not None else self.how
        return f"{self.src.name} -> {self.dst.name}, {nbytes} B, {who}"

    @property
    def direction(self) -> str:
        """``"host to device"``, ``"device to host"``, ``"device to device"`` or ``"host to host"``."""
        def side(d: "Device") -> str:
            return "host" if d.is_host else "device"
        return f"{side(self.src)} to {side(self.dst)}"


def route(src: "Device", dst: "Device") -> Route:
    """Who moves data from ``src`` to ``dst``: the destination's backend, else the source's,
    else the host (a host copy between two host devices, download + upload otherwise)."""
    for by in (dst, src):
        if by.can_copy(src, dst):
            return Route(src, dst, by, by.copy_path(src, dst))
    if src.is_host and dst.is_host:
        return Route(src, dst, None, "host copy")
    return Route(src, dst, None, "staged through the host")


def transfer_fn(r: Route, shape: tuple[int, ...], dtype: Any, queued: bool = False) -> Callable[[Any, Any], None]:
    """``copy(src_native, dst_native)`` for values of ``shape`` and ``dtype`` along route ``r``
    (``queued``: on the destination's queue, after a wait for the source; see ``Device.transfer``)."""
    src, dst = r.src, r.dst
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if r.by is not None:
        move = r.by.transfer
        if queued and "queued" in inspect.signature(move).parameters:  # (a backend's older override has none)
            return lambda a, b: move(src, a, dst, b, nbytes, queued=True)
        return lambda a, b: move(src, a, dst, b, nbytes)
    if src.is_host and dst.is_host:
        return lambda a, b: np.copyto(b, a)
    staging = np.empty(shape, dtype)

    def staged(a: Any, b: Any) -> None:
        src.download(a, staging)
        dst.upload(staging, b)

    return staged
