"""polyhal-gpu: the backend-neutral GPU code that polyhal-cuda and polyhal-hip share (and, for
the kernels of ``c/``, polyhal-opencl).

A distribution of its own, with no entry point (it is no backend): both GPU backends depend on
it, and neither imports the other. The CUDA C kernels live here (``polyhal_gpu/cu/*.cu``):
polyhal-cuda compiles them with NVRTC, polyhal-hip unchanged behind its ``hip/compat.h`` with
hiprtc. Everything about those kernels that does not depend on how a backend compiles or
launches them lives here, once, with public names. So do the few pieces of device, allocator
and plugin code that the two backends have in common.

=====================  ===========================================================================
module                 what
=====================  ===========================================================================
:mod:`.launch`         launch shapes: :data:`~.launch.BLOCK`, :func:`~.launch.grid`, the null address
:mod:`.fallback`       the host fallback of ops without a device kernel (the op's numpy
                       reference); the backends' kernel tables (:mod:`polyhal.hal.kernels`) use it
:mod:`.elementwise`    the CUDA C elementwise snippets (relu, sigmoid, gelu, where, shifts, mod, ...)
                       and their preamble
:mod:`.rowwise`        ``cu/rowwise.cu`` (softmax, layer norm): when it applies, its launch
:mod:`.scratch`        where a kernel's declared scratch went (:class:`~.scratch.Scratch`), and
                       the dynamic shared memory a block may use
:mod:`.sorting`        ``cu/sort.cu``: the plan of a sort / argsort / topk instance
                       (:class:`~.sorting.SortPlan`), its scratch declarations, the bitonic
                       ``sort_rows`` launch
:mod:`.nms`            ``cu/nms.cu``: the geometry of a non-max-suppression instance, its scratch
                       declarations, the pipeline of launches (:class:`~.nms.Pipeline`)
:mod:`.portable`       ``c/*.c``: kernels in the C that OpenCL C and CUDA C++ share (grid_sample,
                       roi_align, det, tree_ensemble, tfidf_vectorizer), which polyhal-opencl
                       runs too: the source of an op instance and its launch size
:mod:`.storage`        the storage-only element types (bfloat16, float8, int4, ...): the ops GPU
                       tables hold them in, their bits dtype, and ``c/storage_types.h``, the
                       conversions that OpenCL C compiles too
:mod:`.memory`         allocator and DLPack commons: usage masks, memory types,
                       ``allocate(kind=...)``, the extent of an imported tensor
:mod:`.enumeration`    plugin commons: the enumeration record
=====================  ===========================================================================

What a backend brings (the contract): a *device* with ``spec`` (``limits["multiprocessors"]``,
``workgroup_bytes``), ``allocator`` and ``launch(function, name, grid, block, args,
shared_bytes=0)`` on its stream; kernel arguments are numpy scalars (``np.uint64`` for a device
address) or the backend's own arrays. The backend compiles the source (cupy / NVRTC, hiprtc) and
hands the loaded function in; this package never compiles, allocates device memory only for
scratch used outside a plan, and names the backend (``"cuda"``, ``"hip"``) wherever it labels
something.

Importing this package imports neither cupy nor hip-python.
"""
