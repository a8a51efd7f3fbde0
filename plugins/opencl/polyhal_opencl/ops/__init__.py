"""Kernel generators, one module per op family of :mod:`polyhal.ops` (same names), and
:mod:`.portable` for the ops whose kernels are written once for OpenCL and CUDA
(:mod:`polyhal_gpu.portable`).

Each module exports ``GENERATORS``: op name -> ``generate(op, attrs, in_types, out_types,
traits) -> Recipe``, with ``attrs`` already completed with the op's defaults.
"""
