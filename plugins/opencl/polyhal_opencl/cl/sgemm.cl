// float32 matrix product for GPUs: Y[bat] = A[bat] @ B[bat] (RESULT applies alpha, beta * C, bias).
//
// A work-group of WX x WY work-items computes a BM x BN block of Y; each work-item accumulates a
// TM x TN register tile (TM, TN multiples of 4): rows ty*4 + g*(BM/GM) + {0..3} for g < GM = TM/4,
// columns tx*4 + g*(BN/GN) + {0..3} for g < GN = TN/4, so that its operands are float4 reads
// of local memory (one 128-bit load per 4 values). K is walked in slabs of BK: each work-item
// loads LA float4 of the BM x BK slab of A and LB of the BK x BN slab of B from global memory
// (128-bit loads where the layout and alignment allow, guarded element loads at the edges),
// and stores them, transposed where needed, into k-major __local tiles padded by PAD floats
// (PAD = 4 keeps the transposing stores of neighbouring work-items off one bank and the rows
// 16-byte aligned). The local tiles are double-buffered: the global loads of slab t+1 are in
// flight (in registers) while slab t is multiplied, and one barrier per slab suffices.
//
// Specialised per instance by #defines written by polyhal_opencl/ops/linalg.py:
//   BM BN BK TM TN PAD   block, slab and register-tile sizes (WX = BN/TN, WY = BM/TM)
//   M N K                the product's extents
//   SAM SAK SBK SBN      element strides: A[m, k] is a[m * SAM + k * SAK]
//   A_KMAJ B_NMAJ        1: A is k-contiguous (SAK == 1), B is n-contiguous (SBN == 1); 0: the
//                        other dim is walked by the 4-element groups (contiguous if its stride is 1)
//   A_VEC B_VEC          1: the 4-element groups are contiguous and 16-byte aligned whenever
//                        the tensor's own offset is a multiple of 4 (checked at run time)
//   EVEN_M EVEN_N EVEN_K 1: the extent is a multiple of the block (no guards needed)
//   IT                   index type within one matrix (int, or long for huge matrices)
//   PLAIN                1: RESULT is a plain store of v (float4 stores are used)
//   PARAMS PROLOGUE BATCH_OFFSETS RESULT   as in matmul.cl
#define WX (BN / TN)
#define WY (BM / TM)
#define NT (WX * WY)
#define GM (TM / 4)
#define GN (TN / 4)
#define LA (BM * BK / (4 * NT))
#define LB (BN * BK / (4 * NT))
#define LDA (BM + PAD)
#define LDB (BN + PAD)

// Group e of A's slab: (row, k) of its first element; the group runs along k when A_KMAJ.
#if A_KMAJ
#define A_POS(e, r, c) const int r = (e) / (BK / 4), c = ((e) % (BK / 4)) * 4
#else
#define A_POS(e, r, c) const int c = (e) / (BM / 4), r = ((e) % (BM / 4)) * 4
#endif
#if B_NMAJ
#define B_POS(e, r, c) const int r = (e) / (BN / 4), c = ((e) % (BN / 4)) * 4
#else
#define B_POS(e, r, c) const int c = (e) / (BK / 4), r = ((e) % (BK / 4)) * 4
#endif

inline float ld(__global const float* p, IT i, int ok) { return ok ? p[i] : 0.0f; }

// Four elements p[0], p[s], p[2s], p[3s] where in bounds (lim: how many are), 0 elsewhere;
// one 128-bit load when all are in bounds, contiguous and aligned.
inline float4 ld4(__global const float* p, IT s, int lim, int vec) {
  if (vec && lim >= 4) return *(__global const float4*)p;
  return (float4)(ld(p, 0, lim > 0), ld(p, s, lim > 1), ld(p, 2 * s, lim > 2), ld(p, 3 * s, lim > 3));
}

__kernel __attribute__((reqd_work_group_size(WX, WY, 1)))
void matmul(PARAMS) {
PROLOGUE
  const int tx = get_local_id(0), ty = get_local_id(1), tid = ty * WX + tx;
  const int n0 = get_group_id(0) * BN, m0 = get_group_id(1) * BM;
  const long bat = get_group_id(2);
  BATCH_OFFSETS
  __global const float* A = a + abat;
  __global const float* B = b + bbat;
  const int avec = A_VEC & (((a_off + abat) & 3) == 0);
  const int bvec = B_VEC & (((b_off + bbat) & 3) == 0);
  __local float As[2][BK][LDA] __attribute__((aligned(16)));
  __local float Bs[2][BK][LDB] __attribute__((aligned(16)));
  float4 ra[LA], rb[LB];
  float acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;

// Global -> registers: slab starting at k0.
#define LOAD_SLAB(k0)                                                                           \
  for (int i = 0; i < LA; ++i) {                                                                \
    A_POS(tid + i * NT, r, c);                                                                  \
    const int m = m0 + r, k = (k0) + c;                                                         \
    if (A_KMAJ) ra[i] = ld4(A + (IT)m * SAM + (IT)k * SAK, SAK,                                 \
                            (EVEN_M || m < M) ? (EVEN_K ? 4 : K - k) : 0, avec);                \
    else ra[i] = ld4(A + (IT)m * SAM + (IT)k * SAK, SAM,                                        \
                     (EVEN_K || k < K) ? (EVEN_M ? 4 : M - m) : 0, avec);                       \
  }                                                                                             \
  for (int i = 0; i < LB; ++i) {                                                                \
    B_POS(tid + i * NT, r, c);                                                                  \
    if (B_NMAJ) {                                                                               \
      const int k = (k0) + r, n = n0 + c;                                                       \
      rb[i] = ld4(B + (IT)k * SBK + (IT)n * SBN, SBN,                                           \
                  (EVEN_K || k < K) ? (EVEN_N ? 4 : N - n) : 0, bvec);                          \
    } else {                                                                                    \
      const int k = (k0) + r, n = n0 + c;                                                       \
      rb[i] = ld4(B + (IT)k * SBK + (IT)n * SBN, SBK,                                           \
                  (EVEN_N || n < N) ? (EVEN_K ? 4 : K - k) : 0, bvec);                          \
    }                                                                                           \
  }

// Registers -> local buffer `buf` (k-major; transposed where the groups ran along k / n).
#define STORE_SLAB(buf)                                                                         \
  for (int i = 0; i < LA; ++i) {                                                                \
    A_POS(tid + i * NT, r, c);                                                                  \
    if (A_KMAJ) {                                                                               \
      As[buf][c][r] = ra[i].s0; As[buf][c + 1][r] = ra[i].s1;                                   \
      As[buf][c + 2][r] = ra[i].s2; As[buf][c + 3][r] = ra[i].s3;                               \
    } else *(__local float4*)&As[buf][c][r] = ra[i];                                            \
  }                                                                                             \
  for (int i = 0; i < LB; ++i) {                                                                \
    B_POS(tid + i * NT, r, c);                                                                  \
    if (B_NMAJ) *(__local float4*)&Bs[buf][r][c] = rb[i];                                       \
    else {                                                                                      \
      Bs[buf][r][c] = rb[i].s0; Bs[buf][r + 1][c] = rb[i].s1;                                   \
      Bs[buf][r + 2][c] = rb[i].s2; Bs[buf][r + 3][c] = rb[i].s3;                               \
    }                                                                                           \
  }

  const int slabs = (K + BK - 1) / BK;
  LOAD_SLAB(0)
  STORE_SLAB(0)
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int t = 0; t < slabs; ++t) {
    const int cur = t & 1;
    if (t + 1 < slabs) { LOAD_SLAB((t + 1) * BK) }
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      float av[TM], bv[TN];
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        const float4 x = *(__local const float4*)&As[cur][kk][ty * 4 + g * (BM / GM)];
        av[4 * g] = x.s0; av[4 * g + 1] = x.s1; av[4 * g + 2] = x.s2; av[4 * g + 3] = x.s3;
      }
#pragma unroll
      for (int g = 0; g < GN; ++g) {
        const float4 x = *(__local const float4*)&Bs[cur][kk][tx * 4 + g * (BN / GN)];
        bv[4 * g] = x.s0; bv[4 * g + 1] = x.s1; bv[4 * g + 2] = x.s2; bv[4 * g + 3] = x.s3;
      }
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = fma(av[i], bv[j], acc[i][j]);
    }
    if (t + 1 < slabs) { STORE_SLAB(cur ^ 1) }
    barrier(CLK_LOCAL_MEM_FENCE);
  }

  const long ybat = bat * ((long)M * N);
#if PLAIN
  const int yvec = (N % 4 == 0) && (((y_off + ybat) & 3) == 0);
#endif
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int m = m0 + ty * 4 + (i / 4) * (BM / GM) + (i % 4);
    if (!EVEN_M && m >= M) continue;
#pragma unroll
    for (int g = 0; g < GN; ++g) {
      const int nb = n0 + tx * 4 + g * (BN / GN);
#if PLAIN
      if (yvec && (EVEN_N || nb + 4 <= N)) {
        *(__global float4*)(y + ybat + (IT)m * N + nb) =
            (float4)(acc[i][4 * g], acc[i][4 * g + 1], acc[i][4 * g + 2], acc[i][4 * g + 3]);
        continue;
      }
#endif
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int n = nb + j;
        if (EVEN_N || n < N) {
          const long yo = ybat + (IT)m * N + n;
          const float v = acc[i][4 * g + j];
          RESULT
        }
      }
    }
  }
}
