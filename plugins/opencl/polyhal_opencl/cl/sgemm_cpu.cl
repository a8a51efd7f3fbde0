// float32 matrix product for CPU OpenCL devices (PoCL, Intel's CPU runtime): work-groups of one
// work-item, no barriers; each work-item runs a register-blocked micro-kernel on explicit vectors
// of VW floats (the device's native SIMD width), which the compiler keeps in SIMD registers.
//
// A work-item computes rows [mb, mb + MB) x columns [n, n + NW) of Y (NW = NV * VW), RM rows at
// a time: per k, NV vector loads of B and RM broadcasts of A feed RM * NV vector FMAs. K is
// walked in blocks of KC, outermost; each block's KC x NW panel of B is first packed into local
// memory (contiguous, zeros past N: this is what BLAS packing does), where it stays in L1 while
// the RM-row blocks stream over it. Partial sums go to Y itself (float, written by this
// work-item only) between blocks; RESULT is applied once, after the last block.
//
// Rows beyond M read row M - 1: their results are computed but not stored, so the inner loops
// have no guards.
//
// #defines written by polyhal_opencl/ops/linalg.py: VW, NV, RM, MB, KC, FMA(a, b, c), IT (index
// type), PLAIN (RESULT is a plain store of v), and as in matmul.cl M N K SAM SAK SBK SBN PARAMS
// PROLOGUE BATCH_OFFSETS RESULT. sgemm_dot.cl is the matrix-vector form.
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define VT CAT(float, VW)
#define VLOAD(off, p) CAT(vload, VW)(off, p)
#define VSTORE(v, off, p) CAT(vstore, VW)(v, off, p)

#define NW (VW * NV)

__kernel void matmul(PARAMS) {
PROLOGUE
  const int n = get_global_id(0) * NW;
  const int mb = get_global_id(1) * MB;
  const long bat = get_global_id(2);
  BATCH_OFFSETS
  __global const float* A = a + abat;
  __global const float* B = b + bbat;
  __global float* Y = y + bat * ((long)M * N);
  const int full_n = n + NW <= N;
  __global const float* bp = B + (IT)n * SBN;
  // The KC x NW panel of B, packed k-major (work-groups are one work-item): contiguous, so it
  // stays in L1 even where B's rows are a power-of-two apart (all in one cache set).
  __local float pk[KC * NW];
  for (int k0 = 0; k0 < K; k0 += KC) {
    const int kn = min(KC, K - k0);
#if SBN == 1
    if (full_n) {
      for (int k = 0; k < kn; ++k)
        for (int v = 0; v < NV; ++v) VSTORE(VLOAD(0, bp + (IT)(k0 + k) * SBK + v * VW), k * NV + v, pk);
    } else
#endif
    {
      for (int k = 0; k < kn; ++k)
        for (int j = 0; j < NW; ++j) pk[k * NW + j] = n + j < N ? bp[(IT)(k0 + k) * SBK + (IT)j * SBN] : 0.0f;
    }
    for (int m = mb; m < mb + MB && m < M; m += RM) {
      const int full = full_n && m + RM <= M;
      VT acc[RM][NV];
      float t[NW];
      if (k0 == 0) {
        for (int r = 0; r < RM; ++r)
          for (int v = 0; v < NV; ++v) acc[r][v] = (VT)0.0f;
      } else {  // the partial sums of the earlier blocks
        for (int r = 0; r < RM; ++r) {
          if (full) {
            for (int v = 0; v < NV; ++v) acc[r][v] = VLOAD(0, Y + (IT)(m + r) * N + n + v * VW);
          } else {
            for (int j = 0; j < NW; ++j) t[j] = (m + r < M && n + j < N) ? Y[(IT)(m + r) * N + n + j] : 0.0f;
            for (int v = 0; v < NV; ++v) acc[r][v] = VLOAD(v, t);
          }
        }
      }
      if (m + RM <= M) {
        __global const float* ap = A + (IT)m * SAM + (IT)k0 * SAK;
        for (int k = 0; k < kn; ++k) {
          VT bv[NV];
#pragma unroll
          for (int v = 0; v < NV; ++v) bv[v] = VLOAD(k * NV + v, pk);
#pragma unroll
          for (int r = 0; r < RM; ++r) {
            const VT x = (VT)(ap[(IT)r * SAM + (IT)k * SAK]);
#pragma unroll
            for (int v = 0; v < NV; ++v) acc[r][v] = FMA(x, bv[v], acc[r][v]);
          }
        }
      } else {  // rows past M read row M - 1 (not stored)
        for (int k = 0; k < kn; ++k) {
          VT bv[NV];
#pragma unroll
          for (int v = 0; v < NV; ++v) bv[v] = VLOAD(k * NV + v, pk);
#pragma unroll
          for (int r = 0; r < RM; ++r) {
            const VT x = (VT)(A[(IT)min(m + r, M - 1) * SAM + (IT)(k0 + k) * SAK]);
#pragma unroll
            for (int v = 0; v < NV; ++v) acc[r][v] = FMA(x, bv[v], acc[r][v]);
          }
        }
      }
      const int last = k0 + kn == K;
      for (int r = 0; r < RM; ++r) {
        if (m + r >= M) break;
        const int direct = PLAIN ? full : (full & !last);  // vector stores, no RESULT
        if (direct) {
          for (int v = 0; v < NV; ++v) VSTORE(acc[r][v], 0, Y + (IT)(m + r) * N + n + v * VW);
          continue;
        }
        for (int v = 0; v < NV; ++v) VSTORE(acc[r][v], v, t);
        for (int j = 0; j < NW && n + j < N; ++j) {
          if (!last) {
            Y[(IT)(m + r) * N + n + j] = t[j];
          } else {
            const long yo = bat * ((long)M * N) + (IT)(m + r) * N + n + j;
            const int row = m + r, col = n + j;
            const float v = t[j];
            {  // RESULT sees the element's own m and n
              const int m = row, n = col;
              RESULT
            }
          }
        }
      }
    }
  }
}
