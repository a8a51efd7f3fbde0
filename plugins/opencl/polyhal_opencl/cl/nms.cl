// ONNX NonMaxSuppression with onnxruntime's float32 arithmetic (see polyhal.ops.detection).
//
// nms_select: one work-group per (batch, class). The candidates (score above the threshold,
// never nan) are bitonic-sorted in __local memory by decreasing score, ties by index (bitonic.cl,
// DESC 1), then visited in that order: the work-group tests a candidate against the boxes
// selected so far in parallel and keeps it unless one suppresses it, until MAXSEL are kept.
// The selection goes to global scratch: sel[g * MAXSEL + i] and count[g].
// nms_emit: one work-item per output row: the row's (batch, class, box), counting through the
// groups in order, or -1 past the total; work-item 0 also writes num_selected. (With no
// selectable box at all, ops/detection.py launches a one-line kernel writing num_selected = 0.)
//
// #defines: NB NC N (batches, classes, boxes), NP (next power of two >= N), MAXSEL
// (min(max_output_boxes_per_class, N)), BOUND (rows of the output), CENTER (center_point_box),
// HAS_THRESHOLD and THRESHOLD (score threshold), IOU (iou_threshold), WG; and bitonic.cl's.

#pragma OPENCL FP_CONTRACT OFF

// A box's corners as onnxruntime computes them (MaxMin: lhs >= rhs ? (rhs, lhs) : (lhs, rhs)).
inline float4 corners(__global const float* boxes, long b, int j) {
  const float4 v = vload4(0, boxes + (b * N + j) * 4);
#if CENTER
  const float hw = v.z / 2.0f, hh = v.w / 2.0f;
  return (float4)(v.x - hw, v.y - hh, v.x + hw, v.y + hh);  // xmin, ymin, xmax, ymax
#else
  const float y1 = v.x, x1 = v.y, y2 = v.z, x2 = v.w;
  const int sx = x1 >= x2, sy = y1 >= y2;
  return (float4)(sx ? x2 : x1, sy ? y2 : y1, sx ? x1 : x2, sy ? y1 : y2);
#endif
}

// IoU > IOU, in onnxruntime's order of float32 operations (FP_CONTRACT is off: no fused
// multiply-adds, which would round differently).
inline int suppresses(float4 a, float4 b) {
  const float ix1 = fmax(a.x, b.x), ix2 = fmin(a.z, b.z);
  const float iy1 = fmax(a.y, b.y), iy2 = fmin(a.w, b.w);
  const float inter = (ix2 - ix1) * (iy2 - iy1);
  const float area_a = (a.z - a.x) * (a.w - a.y);
  const float area_b = (b.z - b.x) * (b.w - b.y);
  const float uni = area_a + area_b - inter;
  const int ok = ix2 > ix1 && iy2 > iy1 && inter > 0.0f && area_a > 0.0f && area_b > 0.0f && uni > 0.0f;
  return ok && inter / uni > IOU;
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void nms_select(__global const float* boxes_base, const ulong boxes_off,
                __global const float* scores_base, const ulong scores_off,
                __global int* sel_base, const ulong sel_off, __global int* count_base, const ulong count_off) {
  __global const float* boxes = boxes_base + boxes_off;
  __global const float* scores = scores_base + scores_off;
  __global int* sel = sel_base + sel_off;
  __global int* count = count_base + count_off;
  __local KEY_T keys[NP];
  __local int idx[NP];
  __local int chosen[MAXSEL];
  __local float4 chosen_box[MAXSEL];
  __local int n_chosen, n_valid, suppressed;
  const int g = get_group_id(0), lid = get_local_id(0);
  const long b = g / NC;
  __global const float* s = scores + (long)g * N;
  for (int i = lid; i < NP; i += WG) {
    const float v = i < N ? s[i] : 0.0f;
#if HAS_THRESHOLD
    const int keep = i < N && v > THRESHOLD;  // false for nan
#else
    const int keep = i < N && !isnan(v);
#endif
    keys[i] = keep ? v : 0.0f;
    idx[i] = keep ? i : PAD;
  }
  if (lid == 0) { n_chosen = 0; n_valid = 0; }
  barrier(CLK_LOCAL_MEM_FENCE);
  bitonic(keys, idx, NP, 0);
  // Candidates are a prefix: the one whose successor is padding says how many there are.
  for (int i = lid; i < NP; i += WG)
    if (idx[i] != PAD && (i + 1 == NP || idx[i + 1] == PAD)) n_valid = i + 1;
  barrier(CLK_LOCAL_MEM_FENCE);
  const int valid = n_valid;
  for (int p = 0; p < valid; ++p) {
    if (n_chosen >= MAXSEL) break;  // uniform: every work-item reads it after the last barrier
    const int j = idx[p];
    const float4 cj = corners(boxes, b, j);
    if (lid == 0) suppressed = 0;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int q = lid; q < n_chosen; q += WG)
      if (suppresses(chosen_box[q], cj)) suppressed = 1;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid == 0 && !suppressed) { chosen[n_chosen] = j; chosen_box[n_chosen] = cj; n_chosen += 1; }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  for (int i = lid; i < n_chosen; i += WG) sel[(long)g * MAXSEL + i] = chosen[i];
  if (lid == 0) count[g] = n_chosen;
}

__kernel void nms_emit(__global const int* sel_base, const ulong sel_off, __global const int* count_base,
                       const ulong count_off, __global long* out_base, const ulong out_off,
                       __global long* num_base, const ulong num_off) {
  __global const int* sel = sel_base + sel_off;
  __global const int* count = count_base + count_off;
  __global long* out = out_base + out_off;
  const long r = get_global_id(0);
  if (r >= BOUND) return;
  long start = 0;
  long row[3] = {-1, -1, -1};
  for (int g = 0; g < NB * NC; ++g) {
    const int c = count[g];
    if (r >= start && r < start + c) { row[0] = g / NC; row[1] = g % NC; row[2] = sel[(long)g * MAXSEL + (r - start)]; }
    start += c;
  }
  out[r * 3] = row[0]; out[r * 3 + 1] = row[1]; out[r * 3 + 2] = row[2];
  if (r == 0) num_base[num_off] = start;
}
