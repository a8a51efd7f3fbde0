"""The core op set: type inference, numpy references and random samples, shared by every backend.

Each op is an :class:`OpDef` in :data:`OPS`. Families live in submodules:

* :mod:`~polyhal.ops.elementwise`: add sub mul div pow maximum minimum, equal not_equal less
  less_equal greater greater_equal, neg abs exp log sqrt tanh relu sigmoid erf gelu, where, cast
* :mod:`~polyhal.ops.linalg`: matmul, gemm, det
* :mod:`~polyhal.ops.reduction`: reduce_sum reduce_mean reduce_max reduce_min, argmax, softmax,
  layer_norm
* :mod:`~polyhal.ops.shape`: transpose, reshape, concat, slice, gather
* :mod:`~polyhal.ops.sorting`: sort, argsort, topk (stable; nan order documented there)
* :mod:`~polyhal.ops.detection`: non_max_suppression (ONNX's; a padded output plus a count)
* :mod:`~polyhal.ops.data_tiling`: pack, unpack, mmt4d (what encodings materialize into)
* :mod:`~polyhal.ops.mathfn`: sin cos tan asin acos atan sinh cosh asinh acosh atanh, floor ceil
  round, sign, reciprocal, isnan isinf, mod, identity, bitcast
* :mod:`~polyhal.ops.logical`: logical_not/and/or/xor, bitwise_not/and/or/xor, bit_shift
* :mod:`~polyhal.ops.indexing`: expand, pad, gather_elements, gather_nd, scatter_elements,
  scatter_nd, cumsum, cumprod, argmin, reduce_prod, einsum
* :mod:`~polyhal.ops.ml`: tree_ensemble (ai.onnx.ml's tree ensembles as one compact array walk)
* :mod:`~polyhal.ops.nn`: conv, conv_transpose, max_pool, avg_pool, lp_pool, linear, attention
  (and the fused forms fused_conv, fused_linear, scale_shift, masked_attention)
* :mod:`~polyhal.ops.vision`: grid_sample, roi_align
* :mod:`~polyhal.ops.quantized`: quantized_conv, quantized_matmul (int8 contractions, fused forms),
  dynamic_quantize
* :mod:`~polyhal.ops.recurrent`: rnn, gru, lstm (a whole sequence each)

Backends define ops of their own besides (:meth:`polyhal.KernelTable.define`), named
``<backend>.<op>``; they join :data:`OPS` when the plugin is imported, and :func:`core_ops`
leaves them out.

Usage::

    from polyhal.ops import OPS, get_op, infer_types
    (out,) = infer_types("add", [TensorType((3, 4), "float32"), TensorType((4,), "float32")], {})
"""

from __future__ import annotations

from polyhal.ops._base import (
    CONTRACTION_PRECISIONS, OPS, REQUIRED, OpDef, canonical_attrs, core_ops, get_op, infer_types, normalize_axes,
    resolve_attrs,
)

# Importing the families registers their ops in OPS.
from polyhal.ops import elementwise, linalg, reduction, shape, sorting  # noqa: E402,F401  isort: skip
from polyhal.ops import data_tiling  # noqa: E402,F401  isort: skip
from polyhal.ops import detection  # noqa: E402,F401  isort: skip
from polyhal.ops import indexing, logical, mathfn, ml, nn  # noqa: E402,F401  isort: skip
from polyhal.ops import vision  # noqa: E402,F401  isort: skip
from polyhal.ops import recurrent  # noqa: E402,F401  isort: skip
from polyhal.ops import text  # noqa: E402,F401  isort: skip
from polyhal.ops import quantized  # noqa: E402,F401  isort: skip
from polyhal.ops.shape import normalize_slice  # noqa: E402

__all__ = [
    "CONTRACTION_PRECISIONS", "OPS", "OpDef", "REQUIRED", "canonical_attrs", "core_ops", "get_op", "infer_types", "normalize_axes",
    "normalize_slice", "resolve_attrs",
]
