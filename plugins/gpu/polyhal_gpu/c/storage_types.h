// Conversions between float32 and the storage-only element types (bfloat16, float8, float4,
// float8e8m0, int4/uint4/int2/uint2), in the subset of C that OpenCL C, CUDA C++ (NVRTC) and HIP
// share; one source for every GPU backend (polyhal_gpu.storage names the functions). Results are
// bit-exact with ml_dtypes' astype, the CPU backend's and the op reference's conversions:
//
// * each element is one byte (two for bfloat16), as ml_dtypes stores them; a sub-byte integer
//   keeps its value in the low bits (int4 -1 is 0x0F) and decoding ignores the high bits;
// * float32 -> a float type rounds to nearest even, subnormals kept (a float64 or an integer of
//   more than 24 bits rounds once, from its own value: see ph_round_to_odd); beyond the largest
//   finite value (after rounding) gives inf where the type has one (bfloat16, e5m2), else nan (e4m3fn:
//   S.1111.111; the fnuz types: 0x80), and float4e2m1 (no inf, no nan) saturates to +-6; inf
//   likewise. nan keeps its sign (bfloat16 0x7fc0, e4m3fn 0x7f, e5m2 0x7e), is 0x80 for fnuz, and
//   for float4e2m1 is a zero of the opposite sign (ml_dtypes' choice); the fnuz types have no -0.
//   ONNX's saturate=1 is a clamp before this conversion (the front end's);
// * float8e8m0 holds 2**(e-127), e = 0..254, 255 is nan; from float32 the nearer power of two,
//   ties (1.5 * 2**e) up, 2**-127 for anything smaller; zero, negatives, inf, nan and overflow
//   give nan;
// * a real -> sub-byte integer truncates toward zero, and is 0 where that is outside the type's
//   range, nan and inf too (ml_dtypes 0.7 on; earlier versions wrapped): polyhal_gpu.storage's
//   cast_expr checks the range before it converts; an integer keeps its low bits (wraps).
// No standard headers (NVRTC has none); no float arithmetic where bits decide (a device that
// flushes subnormals would change them).

#if defined(__OPENCL_VERSION__)
#define PH_FN inline
#define ph_as_uint(x) as_uint(x)
#define ph_as_float(x) as_float(x)
#define ph_rtz(x) convert_float_rtz(x)
typedef long ph_long;
typedef ulong ph_ulong;
#else  // CUDA (NVRTC) and HIP (hiprtc)
#define PH_FN __device__ __forceinline__
#define ph_as_uint(x) __float_as_uint(x)
#define ph_as_float(x) __uint_as_float(x)
typedef long long ph_long;
typedef unsigned long long ph_ulong;
// x as float32, rounded toward zero (OpenCL's convert_float_rtz).
PH_FN float ph_rtz(double x) { return __double2float_rz(x); }
PH_FN float ph_rtz(int x) { return __int2float_rz(x); }
PH_FN float ph_rtz(unsigned int x) { return __uint2float_rz(x); }
PH_FN float ph_rtz(ph_long x) { return __ll2float_rz(x); }
PH_FN float ph_rtz(ph_ulong x) { return __ull2float_rz(x); }
#endif

// A float64 or a wide integer x as float32 rounded to odd, from t = ph_rtz(x): t with its last
// bit set where it is not x (nan stays nan). Rounding that to a type of at most 21 mantissa bits
// (every type here) rounds x once, as ml_dtypes does; rounding to nearest twice would move the
// values just off a tie (float64 1 + 2**-8 + 2**-40 is bfloat16 1 + 2**-7, not 1).
PH_FN float ph_round_to_odd(float t, int inexact) {
  return inexact ? ph_as_float(ph_as_uint(t) | 1u) : t;
}

// v >> s rounded to nearest even, 1 <= s <= 31 (v < 2**31).
PH_FN unsigned int ph_rne_shift(unsigned int v, int s) {
  return (v + ((1u << (s - 1)) - 1u) + ((v >> s) & 1u)) >> s;
}

// The magnitude bits (exponent and mantissa fields) of finite |x| (its bits a < 0x7f800000) in a
// float type of M mantissa bits and exponent bias B, rounded to nearest even; may exceed the
// type's largest encoding (the caller decides what overflow gives).
PH_FN unsigned int ph_mini_encode(unsigned int a, int M, int B) {
  const int e = (int)(a >> 23);
  if (e > 127 - B) return ph_rne_shift(a - ((unsigned int)(127 - B) << 23), 23 - M);  // normal
  // Subnormal in the target: the float's significand over the target's smallest step.
  const unsigned int m = e ? (a & 0x7fffffu) | 0x800000u : a;
  const int s = 151 - B - M - (e ? e : 1);
  return s > 25 ? 0u : ph_rne_shift(m, s);
}

// A float type's magnitude bits (exponent field E bits, M mantissa bits, bias B; not nan or inf)
// as float32.
PH_FN float ph_mini_decode(unsigned int b, int M, int B) {
  const unsigned int e = b >> M, m = b & ((1u << M) - 1u);
  if (e) return ph_as_float(((e + (unsigned int)(127 - B)) << 23) | (m << (23 - M)));
  // m * 2**(1 - B - M): a small integer times a power of two, exact in float32.
  return (float)m * ph_as_float((unsigned int)(128 - B - M) << 23);
}

PH_FN float ph_signed(float v, unsigned int negative) {
  return ph_as_float(ph_as_uint(v) | (negative ? 0x80000000u : 0u));
}

// ---------------------------------------------------------------------------------- bfloat16

PH_FN float ph_decode_bfloat16(unsigned short b) { return ph_as_float((unsigned int)b << 16); }

PH_FN unsigned short ph_encode_bfloat16(float x) {
  const unsigned int u = ph_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)(((u >> 16) & 0x8000u) | 0x7fc0u);  // quiet nan, sign kept
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // overflow carries into inf
}

// ------------------------------------------------------------------------- float8 and float4

PH_FN float ph_decode_float8_e4m3fn(unsigned char b) {
  const float v = (b & 0x7fu) == 0x7fu ? ph_as_float(0x7fc00000u) : ph_mini_decode(b & 0x7fu, 3, 7);
  return ph_signed(v, b & 0x80u);
}
PH_FN unsigned char ph_encode_float8_e4m3fn(float x) {
  const unsigned int u = ph_as_uint(x), a = u & 0x7fffffffu, sign = (u >> 24) & 0x80u;
  const unsigned int r = a >= 0x7f800000u ? 0x7fu : ph_mini_encode(a, 3, 7);
  return (unsigned char)(sign | (r > 0x7eu ? 0x7fu : r));  // inf, nan, overflow: nan
}

// The fnuz formats (e4m3fnuz, e5m2fnuz): no infinity, no -0, and 0x80 their one nan.
PH_FN float ph_decode_fnuz(unsigned char b, int mantissa, int bias) {
  if (b == 0x80u) return ph_as_float(0xffc00000u);  // nan (negative, as ml_dtypes)
  return ph_signed(ph_mini_decode(b & 0x7fu, mantissa, bias), b & 0x80u);
}
PH_FN unsigned char ph_encode_fnuz(float x, int mantissa, int bias) {
  const unsigned int u = ph_as_uint(x), a = u & 0x7fffffffu;
  const unsigned int r = a >= 0x7f800000u ? 0x80u : ph_mini_encode(a, mantissa, bias);
  if (r > 0x7fu) return 0x80u;                                 // inf, nan, overflow: nan
  return (unsigned char)(r ? r | ((u >> 24) & 0x80u) : 0u);   // no -0
}

PH_FN float ph_decode_float8_e4m3fnuz(unsigned char b) { return ph_decode_fnuz(b, 3, 8); }
PH_FN unsigned char ph_encode_float8_e4m3fnuz(float x) { return ph_encode_fnuz(x, 3, 8); }

PH_FN float ph_decode_float8_e5m2(unsigned char b) {
  const unsigned int a = b & 0x7fu;
  float v = ph_mini_decode(a, 2, 15);
  if (a >= 0x7cu) v = ph_as_float(a == 0x7cu ? 0x7f800000u : 0x7fc00000u);
  return ph_signed(v, b & 0x80u);
}
PH_FN unsigned char ph_encode_float8_e5m2(float x) {
  const unsigned int u = ph_as_uint(x), a = u & 0x7fffffffu, sign = (u >> 24) & 0x80u;
  if (a > 0x7f800000u) return (unsigned char)(sign | 0x7eu);  // nan
  const unsigned int r = a == 0x7f800000u ? 0x7cu : ph_mini_encode(a, 2, 15);
  return (unsigned char)(sign | (r > 0x7bu ? 0x7cu : r));     // overflow: inf
}

PH_FN float ph_decode_float8_e5m2fnuz(unsigned char b) { return ph_decode_fnuz(b, 2, 16); }
PH_FN unsigned char ph_encode_float8_e5m2fnuz(float x) { return ph_encode_fnuz(x, 2, 16); }

PH_FN float ph_decode_float4_e2m1fn(unsigned char b) {
  return ph_signed(ph_mini_decode(b & 0x7u, 1, 1), b & 0xf8u);  // any high bit is the sign (ml_dtypes)
}
PH_FN unsigned char ph_encode_float4_e2m1fn(float x) {
  const unsigned int u = ph_as_uint(x), a = u & 0x7fffffffu, sign = (u >> 28) & 0x8u;
  if (a > 0x7f800000u) return (unsigned char)(sign ^ 0x8u);    // nan: a zero of the other sign
  const unsigned int r = a == 0x7f800000u ? 0x7u : ph_mini_encode(a, 1, 1);
  return (unsigned char)(sign | (r > 0x7u ? 0x7u : r));       // saturates
}

PH_FN float ph_decode_float8_e8m0fnu(unsigned char b) {
  if (b == 0xffu) return ph_as_float(0x7fc00000u);
  return ph_as_float(b ? (unsigned int)b << 23 : 0x400000u);  // 2**-127 is a float32 subnormal
}
PH_FN unsigned char ph_encode_float8_e8m0fnu(float x) {
  const unsigned int u = ph_as_uint(x);
  if (u == 0u || u >= 0x7f800000u) return 0xffu;              // zero, negative, inf, nan
  if (u < 0x800000u) return u >= 0x600000u ? 1u : 0u;         // subnormal: 2**-127, or 2**-126 from 1.5 * 2**-127
  const unsigned int r = (u + 0x400000u) >> 23;               // ties round up (ml_dtypes)
  return (unsigned char)(r > 0xfeu ? 0xffu : r);
}

// --------------------------------------------------------------------------- sub-byte integers

PH_FN int ph_decode_int4(unsigned char b) { return (int)(b & 0xfu) - (int)((b & 0x8u) << 1); }
PH_FN int ph_decode_uint4(unsigned char b) { return (int)(b & 0xfu); }
PH_FN int ph_decode_int2(unsigned char b) { return (int)(b & 0x3u) - (int)((b & 0x2u) << 1); }
PH_FN int ph_decode_uint2(unsigned char b) { return (int)(b & 0x3u); }
PH_FN unsigned char ph_encode_int4(int v) { return (unsigned char)(v & 0xf); }
PH_FN unsigned char ph_encode_uint4(int v) { return (unsigned char)(v & 0xf); }
PH_FN unsigned char ph_encode_int2(int v) { return (unsigned char)(v & 0x3); }
PH_FN unsigned char ph_encode_uint2(int v) { return (unsigned char)(v & 0x3); }
