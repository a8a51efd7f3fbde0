"""polyhal-mydev: a template polyhal backend, runnable as it is.

Four modules, as in every backend: ``plugin`` (the hooks: which devices exist), ``device``
(MyDevice: data movement and DLPack), ``allocator`` (MyAllocator: memory) and ``kernels`` (the
kernel table). Its "device" keeps its memory in host RAM and computes with numpy, so that the
template runs anywhere and passes polyhal's conformance suite::

    pytest --pyargs polyhal.testing.conformance --polyhal-backend=mydev
"""
