"""The kernel table of the mydev backend: op name -> builder.

A builder runs when a plan is compiled; it returns the kernel ``fn(*inputs, *outputs)`` that the
plan calls on every run, with the native arrays of ``MyDevice.view``. The table checks every
instance first (an op it has no kernel for, encoded operands, empty outputs) and fills in the
op's default attributes.
"""

import numpy as np

from polyhal import KernelTable

TABLE = KernelTable("mydev")


@TABLE.register("add")
def _add(device, op, attrs, in_types, out_types, scratch):
    def kernel(x, y, out):
        np.add(x, y, out=out)
    return kernel


@TABLE.register("relu")
def _relu(device, op, attrs, in_types, out_types, scratch):
    zero = np.zeros((), in_types[0].dtype)  # built once, here, not on every call

    def kernel(x, out):
        np.maximum(x, zero, out=out)
    return kernel
