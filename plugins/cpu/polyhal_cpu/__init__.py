"""polyhal-cpu: the CPU backend of polyhal, on numpy.

Modules: ``plugin`` (the hooks), ``device`` (CPUDevice), ``allocator`` (CPUAllocator),
``kernels`` (the op set in numpy).
"""
