"""polyhal-hip: the HIP (ROCm) backend of polyhal, on AMD's hip-python bindings.

Modules, as in every backend: ``plugin`` (the hooks; enumeration makes no stream),
``device`` (HIPDevice: stream, transfers, DLPack with ROCm's rules), ``allocator``
(HIPAllocator: IREE's HIP buffer types -- device, async, pinned coherent / non-coherent,
host-registered, managed, external -- each freed by kind), ``kernels`` (the op set) with
``sorting`` (sort, top-k, NMS on polyhal-gpu's CUDA C). Below them: ``runtime`` (the one
facade over the bindings), ``errors`` (HIP statuses as polyhal errors, one ``check``),
``compiler`` (hiprtc in a worker process, with a memory and disk cache), ``launch`` (kernel argument packing), ``selftest``
(``python -m polyhal_hip.selftest``: what runs on your AMD GPU, as JSON).

Importing this package imports no bindings and loads no ROCm library.
"""
