"""Kernel generators, one module per op family of :mod:`polyhal.ops` (same names).

Each module exports ``GENERATORS``: op name -> ``generate(op, attrs, in_types, out_types,
traits) -> Recipe``, with ``attrs`` already completed with the op's defaults.
"""
