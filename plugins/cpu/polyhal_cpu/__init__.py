"""polyhal-cpu: the CPU backend of polyhal, on numpy.

Modules: ``plugin`` (the hooks), ``device`` (CPUDevice), ``allocator`` (CPUAllocator),
``table`` (the kernel table), ``kernels`` (the op set in numpy; it imports the other kernel
modules: ``math_kernels``, ``indexing_kernels``, ``nn_kernels``, ``encoding``, ``detection``).
"""
