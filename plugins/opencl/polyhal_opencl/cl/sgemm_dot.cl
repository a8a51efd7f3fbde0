// float32 matrix-vector products for CPU OpenCL devices, A and B both k-contiguous (A @ x,
// x^T @ W^T): a work-item computes an RM x RN tile of Y as RM * RN dot products along k on
// explicit vectors of VW floats (the device's native SIMD width), reduced horizontally at the
// end. Rows beyond M read row M - 1 and columns beyond N column N - 1 (computed, not stored).
//
// #defines written by polyhal_opencl/ops/linalg.py: VW, RM, RN, FMA(a, b, c), IT (index type),
// and as in matmul.cl M N K SAM SAK SBK SBN PARAMS PROLOGUE BATCH_OFFSETS RESULT.
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define VT CAT(float, VW)
#define VLOAD(off, p) CAT(vload, VW)(off, p)
#define VSTORE(v, off, p) CAT(vstore, VW)(v, off, p)
__kernel void matmul(PARAMS) {
PROLOGUE
  const int n0 = get_global_id(0) * RN;
  const int m0 = get_global_id(1) * RM;
  const long bat = get_global_id(2);
  BATCH_OFFSETS
  __global const float* A = a + abat;
  __global const float* B = b + bbat;
  __global const float* ar[RM];
  __global const float* br[RN];
#pragma unroll
  for (int r = 0; r < RM; ++r) ar[r] = A + (IT)min(m0 + r, M - 1) * SAM;
#pragma unroll
  for (int q = 0; q < RN; ++q) br[q] = B + (IT)min(n0 + q, N - 1) * SBN;
  VT acc[RM][RN];
#pragma unroll
  for (int r = 0; r < RM; ++r)
#pragma unroll
    for (int q = 0; q < RN; ++q) acc[r][q] = (VT)0.0f;
  int k = 0;
  for (; k + VW <= K; k += VW) {
    VT av[RM], bv[RN];
#pragma unroll
    for (int r = 0; r < RM; ++r) av[r] = VLOAD(0, ar[r] + k);
#pragma unroll
    for (int q = 0; q < RN; ++q) bv[q] = VLOAD(0, br[q] + k);
#pragma unroll
    for (int r = 0; r < RM; ++r)
#pragma unroll
      for (int q = 0; q < RN; ++q) acc[r][q] = FMA(av[r], bv[q], acc[r][q]);
  }
  float s[RM][RN];
  float t[VW];
  for (int r = 0; r < RM; ++r)
    for (int q = 0; q < RN; ++q) {
      VSTORE(acc[r][q], 0, t);
      float sum = 0.0f;
      for (int j = 0; j < VW; ++j) sum += t[j];
      s[r][q] = sum;
    }
  for (; k < K; ++k)
    for (int r = 0; r < RM; ++r)
      for (int q = 0; q < RN; ++q) s[r][q] = FMA(ar[r][k], br[q][k], s[r][q]);
  for (int r = 0; r < RM; ++r) {
    const int m = m0 + r;
    if (m >= M) break;
    for (int q = 0; q < RN; ++q) {
      const int n = n0 + q;
      if (n >= N) break;
      const long yo = bat * ((long)M * N) + (IT)m * N + n;
      const float v = s[r][q];
      RESULT
    }
  }
}
