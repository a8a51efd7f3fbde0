// non_max_suppression with IoU bitmask blocks (the GPU algorithm), every scratch placed by the
// bufferize pass. One (batch, class) pair is a "row"; its candidates are the boxes whose score
// passes the threshold, in decreasing score (ties: lower index first; nan never).
//
//   nms_prep    one work-group per row: builds a 64-bit key per box, (~score key) << 32 | index,
//               so that ascending keys are decreasing scores with ties by index and invalid
//               boxes (key ~0) last; bitonic-sorts them in SORT space; writes the row's order,
//               its sorted corner boxes and its candidate count.
//   nms_mask    one work-group of 64 work-items per (64-row block, 64-column block) of the
//               row's upper triangle: the 64 column boxes are staged in COLS space, then
//               work-item i sets bit b of word mask[i][block] when candidate 64 * block + b
//               comes after candidate i and overlaps it with IoU > IOU_T.
//   nms_reduce  one work-group per row walks the candidates in order with the bitset of
//               suppressed candidates in REMOVED space: a candidate whose bit is clear is
//               selected, and its mask row is OR-ed into the bitset by all work-items at once.
//   nms_emit    one work-item writes the selected boxes in ONNX order, pads with -1, counts.
//
// Bit layout: mask is [N][W] 64-bit words, W = ceil(N / 64); bit b of word w of row i is about
// candidate j = 64 w + b. The bitset "removed" is W words with the same layout for j.
//
// IoU: onnxruntime's float32 arithmetic and order of operations (polyhal.ops.detection), with
// contraction off so that no multiply-add is fused, so the selection matches bit for bit.
//
// #defines: NB, NC, N (boxes), NP (power of two >= N), W, LIMIT (max per row), BOUND (rows of
// the output), CENTER, IOU_T (float literal), HAS_SCORE_T, SCORE_T, WG (work-items of prep),
// WGR (of reduce), SORT_SPACE / COLS_SPACE / REMOVED_SPACE (1: __local, 2: global scratch).
#pragma OPENCL FP_CONTRACT OFF

#define ROWS (NB * NC)

inline uint score_key(float s) {
  uint b = as_uint(s);
  if (b == 0x80000000u) b = 0u;  // -0.0 scores as +0.0
  const uint k = b ^ ((0u - (b >> 31)) | 0x80000000u);  // ascending with the float's order
  return ~k;                                              // descending
}

// Corners (xmin, ymin, xmax, ymax) of a box as onnxruntime computes them.
inline float4 corners(__global const float* b) {
#if CENTER
  const float hw = b[2] / 2.0f, hh = b[3] / 2.0f;
  return (float4)(b[0] - hw, b[1] - hh, b[0] + hw, b[1] + hh);
#else
  // MaxMin(lhs, rhs): lhs >= rhs ? (rhs, lhs) : (lhs, rhs); a nan corner stays where it is.
  const float y1 = b[0], x1 = b[1], y2 = b[2], x2 = b[3];
  const int sx = x1 >= x2, sy = y1 >= y2;
  return (float4)(sx ? x2 : x1, sy ? y2 : y1, sx ? x1 : x2, sy ? y1 : y2);
#endif
}

// onnxruntime's SuppressByIOU(selected a, candidate b).
inline int suppresses(float4 a, float4 b) {
  const float ix1 = (a.x < b.x) ? b.x : a.x;  // std::max(a, b)
  const float ix2 = (b.z < a.z) ? b.z : a.z;  // std::min(a, b)
  if (ix2 <= ix1) return 0;
  const float iy1 = (a.y < b.y) ? b.y : a.y;
  const float iy2 = (b.w < a.w) ? b.w : a.w;
  if (iy2 <= iy1) return 0;
  const float inter = (ix2 - ix1) * (iy2 - iy1);
  if (inter <= 0.0f) return 0;
  const float area_a = (a.z - a.x) * (a.w - a.y);
  const float area_b = (b.z - b.x) * (b.w - b.y);
  const float uni = area_a + area_b - inter;
  if (area_a <= 0.0f || area_b <= 0.0f || uni <= 0.0f) return 0;
  return inter / uni > IOU_T;
}

#if SORT_SPACE == 2
#define SORT_PARAMS , __global ulong* sortbuf_base, const ulong sortbuf_off
#else
#define SORT_PARAMS
#endif

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void nms_prep(__global const float* boxes_base, const ulong boxes_off, __global const float* scores_base,
              const ulong scores_off, __global int* order_base, const ulong order_off,
              __global float4* sboxes_base, const ulong sboxes_off, __global int* counts_base,
              const ulong counts_off SORT_PARAMS) {
  __global const float* boxes = boxes_base + boxes_off;
  __global const float* scores = scores_base + scores_off;
  __global int* order = order_base + order_off;
  __global float4* sboxes = sboxes_base + sboxes_off;
  __global int* counts = counts_base + counts_off;
  const int row = get_group_id(0);
  const int lid = get_local_id(0);
#if SORT_SPACE == 1
  __local ulong keys[NP];
#define KEYS_FENCE CLK_LOCAL_MEM_FENCE
#else
  __global ulong* keys = sortbuf_base + sortbuf_off + (ulong)row * NP;
#define KEYS_FENCE CLK_GLOBAL_MEM_FENCE
#endif
  __global const float* s = scores + (long)row * N;
  for (int i = lid; i < NP; i += WG) {
    ulong key = ~0ul;
    if (i < N) {
      const float v = s[i];
#if HAS_SCORE_T
      const int ok = v > SCORE_T;  // nan fails
#else
      const int ok = !isnan(v);
#endif
      if (ok) key = ((ulong)score_key(v) << 32) | (ulong)i;
    }
    keys[i] = key;
  }
  // Bitonic sort by the work-group; the barrier after each stage publishes the pairs every
  // work-item wrote before the next stage reads them.
  barrier(KEYS_FENCE);
  for (int k = 2; k <= NP; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int t = lid; t < NP / 2; t += WG) {
        const int i = 2 * t - (t & (j - 1));
        const int l = i + j;
        const ulong a = keys[i], b = keys[l];
        if ((a > b) == ((i & k) == 0)) { keys[i] = b; keys[l] = a; }
      }
      barrier(KEYS_FENCE);
    }
  }
  // Candidates come first; count them by binary search for the first invalid key.
  if (lid == 0) {
    int lo = 0, hi = N;
    while (lo < hi) { const int mid = (lo + hi) / 2; if (keys[mid] != ~0ul) lo = mid + 1; else hi = mid; }
    counts[row] = lo;
  }
  __global const float* bx = boxes + (long)(row / NC) * N * 4;
  for (int p = lid; p < N; p += WG) {
    const ulong key = keys[p];
    const int i = (int)(key & 0xFFFFFFFFul);
    order[(long)row * N + p] = key == ~0ul ? -1 : i;
    sboxes[(long)row * N + p] = key == ~0ul ? (float4)(0.0f) : corners(bx + 4 * (long)i);
  }
}

#if COLS_SPACE == 2
#define COLS_PARAMS , __global float4* cols_base, const ulong cols_off
#else
#define COLS_PARAMS
#endif

__kernel __attribute__((reqd_work_group_size(64, 1, 1)))
void nms_mask(__global const float4* sboxes_base, const ulong sboxes_off, __global const int* counts_base,
              const ulong counts_off, __global ulong* mask_base, const ulong mask_off COLS_PARAMS, const long row) {
  __global const float4* sboxes = sboxes_base + sboxes_off + row * N;
  __global ulong* mask = mask_base + mask_off;
  const int cnt = counts_base[counts_off + row];
  const int cb = get_group_id(0), rb = get_group_id(1), lid = get_local_id(0);
  if (cb < rb) return;  // below the diagonal: nms_reduce never reads it (uniform per group)
#if COLS_SPACE == 1
  __local float4 cols[64];
#else
  __global float4* cols = cols_base + cols_off + ((ulong)rb * get_num_groups(0) + cb) * 64;
#endif
  const int j0 = cb * 64;
  if (j0 + lid < cnt) cols[lid] = sboxes[j0 + lid];
  barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);  // the column boxes are staged for all
  const int i = rb * 64 + lid;
  if (i >= cnt) return;
  const float4 a = sboxes[i];
  ulong word = 0;
  const int jn = min(64, cnt - j0);
  for (int b = 0; b < jn; b++) {
    const int j = j0 + b;
    if (j > i && suppresses(a, cols[b])) word |= 1ul << b;
  }
  mask[(long)i * W + cb] = word;
}

#if REMOVED_SPACE == 2
#define REMOVED_PARAMS , __global ulong* removed_base, const ulong removed_off
#else
#define REMOVED_PARAMS
#endif

__kernel __attribute__((reqd_work_group_size(WGR, 1, 1)))
void nms_reduce(__global const int* order_base, const ulong order_off, __global const int* counts_base,
                const ulong counts_off, __global const ulong* mask_base, const ulong mask_off,
                __global int* sel_base, const ulong sel_off, __global int* nsel_base,
                const ulong nsel_off REMOVED_PARAMS, const long row) {
  __global const int* order = order_base + order_off + row * N;
  __global const ulong* mask = mask_base + mask_off;
  __global int* sel = sel_base + sel_off + row * LIMIT;
  const int lid = get_local_id(0);
  const int cnt = counts_base[counts_off + row];
#if REMOVED_SPACE == 1
  __local ulong removed[W];
#define RM_FENCE CLK_LOCAL_MEM_FENCE
#else
  __global ulong* removed = removed_base + removed_off;
#define RM_FENCE CLK_GLOBAL_MEM_FENCE
#endif
  for (int w = lid; w < W; w += WGR) removed[w] = 0;
  barrier(RM_FENCE);
  int kept = 0;  // every work-item makes the same decisions, so each keeps the same count
  for (int i = 0; i < cnt && kept < LIMIT; i++) {
    const int gone = (int)((removed[i >> 6] >> (i & 63)) & 1ul);
    barrier(RM_FENCE);  // everyone has read bit i before anyone ORs into its word
    if (!gone) {
      if (lid == 0) sel[kept] = order[i];
      kept++;
      for (int w = (i >> 6) + lid; w < W; w += WGR) removed[w] |= mask[(long)i * W + w];
    }
    barrier(RM_FENCE);  // the OR is complete before the next candidate is read
  }
  if (lid == 0) nsel_base[nsel_off + row] = kept;
}

__kernel void nms_emit(__global const int* sel_base, const ulong sel_off, __global const int* nsel_base,
                       const ulong nsel_off, __global long* out_base, const ulong out_off,
                       __global long* num_base, const ulong num_off) {
  __global const int* sel = sel_base + sel_off;
  __global long* out = out_base + out_off;
  long p = 0;
  for (int r = 0; r < ROWS; r++) {
    const int k = nsel_base[nsel_off + r];
    for (int q = 0; q < k; q++, p++) {
      out[3 * p] = r / NC;
      out[3 * p + 1] = r % NC;
      out[3 * p + 2] = sel[(long)r * LIMIT + q];
    }
  }
  num_base[num_off] = p;
  for (long q = p; q < BOUND; q++) { out[3 * q] = -1; out[3 * q + 1] = -1; out[3 * q + 2] = -1; }
}
