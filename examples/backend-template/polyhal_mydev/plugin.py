"""The hooks of the mydev backend: the devices it offers, listed without creating any."""

import polyhal
from polyhal import DeviceSpec

from polyhal_mydev.allocator import HEAP
from polyhal_mydev.device import DLPACK_DEVICE, MyDevice
from polyhal_mydev.kernels import TABLE

POLYHAL_API_VERSION = polyhal.API_VERSION  # a mismatch is reported and the plugin skipped


@polyhal.hookimpl
def register_devices():
    """One device. Cheap: the factory creates it on first use. The rank is below the CPU's (0),
    so this device is used where a program or a user names it, never as the default. Its kernel
    names let placement choose it without creating it."""
    return [DeviceSpec(name="mydev:0", backend="mydev", rank=-100, factory=MyDevice, heaps=(HEAP,),
                       dlpack_devices=frozenset({DLPACK_DEVICE}), kernel_names=TABLE.kernel_names,
                       description="polyhal's template backend (numpy on host memory)")]
