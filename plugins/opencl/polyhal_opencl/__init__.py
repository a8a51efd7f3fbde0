"""polyhal-opencl: the OpenCL backend of polyhal, on pyopencl.

Modules, in the same places as the CPU backend's: ``plugin`` (the hooks: one device per OpenCL
device), ``device`` (CLDevice), ``allocator`` (CLAllocator and its caching pool), ``kernels``
(the op set: ``prepare`` and ``KERNEL_NAMES``). Behind ``kernels``: ``generators`` maps each op
to its generator in ``ops/``, which generate OpenCL C per op family (mirroring ``polyhal.ops``),
``codegen`` holds what the generators share (device traits, element types, index math, launch
recipes), ``program`` builds and caches programs (memory and disk), ``cl/*.cl`` are the
hand-written kernels (tiled matmul, bitonic sort, NMS), ``scratch`` places kernel scratch
through the core's bufferize pass, and ``errors`` turns OpenCL status codes into polyhal errors.
README.md has the memory model and the environment variables.
"""
