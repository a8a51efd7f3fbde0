// Tiled, batched matrix product: Y[bat] = ALPHA * A[bat] @ B[bat] (+ BETA * C).
//
// One work-group of TS x TS work-items computes one TS x TS tile of Y, walking K in slabs of
// TS: each work-item stages one element of A and one of B into __local memory, the group
// synchronises, and every work-item accumulates a row of the A slab times a column of the B
// slab. Out-of-range elements are staged as 0, so no shape needs to be a multiple of TS.
//
// Specialised per instance by #defines written by polyhal_opencl/ops/linalg.py:
//   TS                tile edge (TS * TS <= CL_DEVICE_MAX_WORK_GROUP_SIZE)
//   M N K             the product's extents
//   SAM SAK SBK SBN   element strides: A[m, k] is a[m * SAM + k * SAK] (a transpose is a stride
//                     swap; a 1-D operand has a zero stride for its missing dim)
//   CT ACC            compute type of the elements and accumulator type
//   LOAD_A LOAD_B     (offset) -> CT value;  MUL(x, y) -> ACC product
//   PARAMS PROLOGUE   the kernel's buffer parameters and their offset arithmetic (codegen.param)
//   BATCH_OFFSETS     statements declaring long abat, bbat (element offsets of batch `bat`)
//   RESULT            statement storing the value `acc` at element `yo` of y (alpha, beta, C)
__kernel __attribute__((reqd_work_group_size(TS, TS, 1)))
void matmul(PARAMS) {
PROLOGUE
  const int tx = get_local_id(0), ty = get_local_id(1);
  const int n = get_group_id(0) * TS + tx;
  const int m = get_group_id(1) * TS + ty;
  const long bat = get_global_id(2);
  BATCH_OFFSETS
  // +1 column of padding: work-items of a row read a column of Bs, which would otherwise hit
  // one local memory bank on GPUs.
  __local CT As[TS][TS + 1];
  __local CT Bs[TS][TS + 1];
  ACC acc = (ACC)0;
  for (int k0 = 0; k0 < K; k0 += TS) {
    const int ka = k0 + tx, kb = k0 + ty;
    As[ty][tx] = (m < M && ka < K) ? LOAD_A(abat + (long)m * SAM + (long)ka * SAK) : (CT)0;
    Bs[ty][tx] = (kb < K && n < N) ? LOAD_B(bbat + (long)kb * SBK + (long)n * SBN) : (CT)0;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int k = 0; k < TS; ++k) acc += MUL(As[ty][k], Bs[k][tx]);
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (m < M && n < N) {
    const long yo = bat * ((long)M * N) + (long)m * N + n;
    RESULT
  }
}
