// Tiled, batched matrix product: Y[bat] = ALPHA * A[bat] @ B[bat] (+ BETA * C).
//
// A work-group of TS x TS work-items computes a BT x BT block of Y (BT = TS * RT): each
// work-item accumulates an RT x RT register tile, rows ty + i*TS and columns tx + j*TS of the
// block. K is walked in slabs of TK: the group stages the BT x TK slab of A and the TK x BT
// slab of B in __local memory (out-of-range elements as 0, so no extent needs to be a multiple
// of anything), synchronises, and every work-item multiplies its RT values of A by its RT values
// of B for each k of the slab: 2*RT loads from local memory per RT*RT multiply-adds.
//
// Specialised per instance by #defines written by polyhal_opencl/ops/linalg.py:
//   TS RT TK          threads per block edge, register tile edge, K slab (TS * TS work-items)
//   M N K             the product's extents
//   SAM SAK SBK SBN   element strides: A[m, k] is a[m * SAM + k * SAK] (a transpose is a stride
//                     swap; a 1-D operand has a zero stride for its missing dim)
//   CT ACC            compute type of the elements and accumulator type
//   LOAD_A LOAD_B     (offset) -> CT value;  MUL(x, y) -> ACC product
//   PARAMS PROLOGUE   the kernel's buffer parameters and their offset arithmetic (codegen.param)
//   BATCH_OFFSETS     statements declaring long abat, bbat (element offsets of batch `bat`)
//   RESULT            statement storing the value `v` at element `yo` of y (alpha, beta, C)
#define BT (TS * RT)

__kernel __attribute__((reqd_work_group_size(TS, TS, 1)))
void matmul(PARAMS) {
PROLOGUE
  const int tx = get_local_id(0), ty = get_local_id(1);
  const int n0 = get_group_id(0) * BT, m0 = get_group_id(1) * BT;
  const long bat = get_global_id(2);
  BATCH_OFFSETS
  // +1 column of padding keeps the reads of a row by neighbouring work-items off one bank.
  __local CT As[TK][BT + 1];
  __local CT Bs[TK][BT + 1];
  ACC acc[RT][RT];
  for (int i = 0; i < RT; ++i)
    for (int j = 0; j < RT; ++j) acc[i][j] = (ACC)0;
  for (int k0 = 0; k0 < K; k0 += TK) {
    for (int e = ty * TS + tx; e < BT * TK; e += TS * TS) {
      const int kk = e / BT, mn = e % BT;
      const int k = k0 + kk, m = m0 + mn, n = n0 + mn;
      As[kk][mn] = (m < M && k < K) ? LOAD_A(abat + (long)m * SAM + (long)k * SAK) : (CT)0;
      Bs[kk][mn] = (k < K && n < N) ? LOAD_B(bbat + (long)k * SBK + (long)n * SBN) : (CT)0;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int k = 0; k < TK; ++k) {
      CT a[RT], b[RT];
      for (int i = 0; i < RT; ++i) a[i] = As[k][ty + i * TS];
      for (int j = 0; j < RT; ++j) b[j] = Bs[k][tx + j * TS];
      for (int i = 0; i < RT; ++i)
        for (int j = 0; j < RT; ++j) acc[i][j] += MUL(a[i], b[j]);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  for (int i = 0; i < RT; ++i) {
    const int m = m0 + ty + i * TS;
    for (int j = 0; j < RT; ++j) {
      const int n = n0 + tx + j * TS;
      if (m < M && n < N) {
        const long yo = bat * ((long)M * N) + (long)m * N + n;
        const ACC v = acc[i][j];
        RESULT
      }
    }
  }
}
