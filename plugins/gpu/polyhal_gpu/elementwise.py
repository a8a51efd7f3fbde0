"""The CUDA C elementwise snippets that CUDA and HIP both run.

Each entry of :data:`SNIPPETS` is ``(inputs, outputs, code)`` in the form of cupy's
``ElementwiseKernel`` (``"T x"``, ``"T y"``, ``"y = ..."``), over the element type ``T``;
:data:`PREAMBLE` declares the helpers they use. polyhal-cuda makes ``ElementwiseKernel``\\ s of
them; polyhal-hip binds them into its generated ``elementwise.hip`` instances.
"""

from __future__ import annotations

#: Float math in the operand type's compute type (float for float16/float32, double for float64),
#: and the signed ``-1`` test of the modulo snippets.
PREAMBLE = """
template <typename T> struct polyhal_ct { typedef float type; };
template <> struct polyhal_ct<double> { typedef double type; };
// y == -1 for signed types only (x % -1 is 0; INT_MIN % -1 traps)
template <typename T> __device__ bool polyhal_minus_one(T y) { return (T)(-1) < (T)0 && y == (T)(-1); }
"""

#: key -> (inputs, outputs, code): ops whose semantics numpy's ufuncs do not give as such.
SNIPPETS: dict[str, tuple[str, str, str]] = {
    "relu": ("T x", "T y", "y = x < (T)0 ? (T)0 : x"),  # nan < 0 is false: nan stays nan
    # nan stays nan; zeros, and a denormal that an ftz device compares as zero, give zero.
    "sign": ("T x", "T y", "y = x > (T)0 ? (T)1 : (x < (T)0 ? (T)(-1) : (x != x ? x : (T)0))"),
    "sigmoid": ("T x", "T y", "typedef typename polyhal_ct<T>::type C; C v = (C)x; "
                "y = (T)((C)1 / ((C)1 + exp(-v)))"),
    "erf": ("T x", "T y", "typedef typename polyhal_ct<T>::type C; y = (T)erf((C)x)"),
    "gelu_none": ("T x", "T y", "typedef typename polyhal_ct<T>::type C; C v = (C)x; "
                  "y = (T)((C)0.5 * v * ((C)1 + erf(v * (C)0.70710678118654752440)))"),
    "gelu_tanh": ("T x", "T y", "typedef typename polyhal_ct<T>::type C; C v = (C)x; "
                  "y = (T)((C)0.5 * v * ((C)1 + tanh((C)0.79788456080286535588 * (v + (C)0.044715 * v * v * v))))"),
    "where": ("bool c, T x, T y", "T z", "z = c ? x : y"),
    # Shifts by a negative amount or by the width or more are defined (polyhal.ops.logical):
    # left gives 0; right gives the sign fill (-1 for negative signed x, else 0). Left shifts
    # run in 64-bit unsigned arithmetic so that signed values wrap instead of overflowing.
    "shl": ("T x, T y", "T z", "z = (y < (T)0 || y >= (T)(sizeof(T) * 8)) ? (T)0 "
            ": (T)((unsigned long long)x << (unsigned int)y)"),
    "shr": ("T x, T y", "T z", "z = (y < (T)0 || y >= (T)(sizeof(T) * 8)) ? (x < (T)0 ? (T)(-1) : (T)0) "
            ": (T)(x >> (unsigned int)y)"),
    # C's % truncates (sign of x); division by zero gives 0, and x % -1 is 0 (INT_MIN % -1 traps).
    "fmod_int": ("T x, T y", "T z", "z = (y == (T)0 || polyhal_minus_one(y)) ? (T)0 : (T)(x % y)"),
    "mod_int": ("T x, T y", "T z", "T r = (y == (T)0 || polyhal_minus_one(y)) ? (T)0 : (T)(x % y); "
                "if (r != (T)0 && ((r < (T)0) != (y < (T)0))) r = (T)(r + y); z = r"),
    "fmod_float": ("T x, T y", "T z", "typedef typename polyhal_ct<T>::type C; z = (T)fmod((C)x, (C)y)"),
}


def snippet_key(op: str, attrs: dict, dtype) -> str:
    """The :data:`SNIPPETS` key that computes ``op`` (relu, sign, sigmoid, erf, gelu, where,
    bit_shift, mod) with resolved ``attrs`` on operands of ``dtype``."""
    if op == "gelu":
        return "gelu_tanh" if attrs["approximate"] == "tanh" else "gelu_none"
    if op == "bit_shift":
        return "shl" if attrs["direction"] == "left" else "shr"
    if op == "mod":
        return "fmod_float" if dtype.kind == "f" else ("fmod_int" if attrs["fmod"] else "mod_int")
    return op
