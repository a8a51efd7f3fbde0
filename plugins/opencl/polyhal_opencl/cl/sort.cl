// Stable sorting of rows (sort, argsort, topk) in the order polyhal.ops.sorting defines:
// ascending puts nan last, descending puts nan first, ties keep input order in both directions.
//
// Stability comes from the comparator, not the algorithm (see bitonic.cl, prepended to this file).
//
// Two paths, chosen per instance by polyhal_opencl/ops/sorting.py:
//   sort_rows    a row of N <= NP elements fits in __local memory: one work-group loads it,
//                bitonic-sorts it and writes the first K results (for topk with sorted=False it
//                then bitonic-sorts those K by index).
//   sort_tiles   rows too long for local memory: tiles of NP elements are sorted in local
//   merge_pass   memory into a global index buffer, then log2(N / NP) merge passes double the
//   emit         sorted runs (each element finds its place by binary search in the other run,
//                so a pass is one work-item per element), and emit writes the first K.
//                by_index = 1 reruns tiles and merges over the first K entries ordered by
//                index alone (topk with sorted=False).
//
// #defines set per instance: N (row length), INNER (element stride along the sorted axis,
// in input and outputs), K (results per row), NP (local sort size, a power of two), WG
// (work-group size), KP (next power of two >= K, at most NP), DESC, X_T (element type of x),
// KEY_T (compute type of keys), LOAD_KEY(p, i) (key at element offset i of x pointer p),
// ISNAN(v), VBITS (unsigned type of the element width), HAS_VALUES, HAS_INDICES, and the
// parameter macros X_PARAM, X_PROLOGUE, OUT_KERNEL_PARAMS, OUT_PROLOGUE, OUT_PARAMS, OUT_ARGS.

// Element offset of the start of row r in x (rows are the lanes along the sorted axis).
inline long row_x(long r) { return (r / INNER) * ((long)N * INNER) + r % INNER; }
// ... and in the outputs, whose axis has K entries.
inline long row_out(long r) { return (r / INNER) * ((long)K * INNER) + r % INNER; }

// Write result p (index i of row r) to the outputs.
inline void emit_one(__global const VBITS* xv, OUT_PARAMS, long r, int p, int i) {
  const long o = row_out(r) + (long)p * INNER;
#if HAS_VALUES
  values[o] = xv[row_x(r) + (long)i * INNER];
#endif
#if HAS_INDICES
  indices[o] = (long)i;
#endif
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void sort_rows(X_PARAM, OUT_KERNEL_PARAMS, const long index_order) {
  X_PROLOGUE
  OUT_PROLOGUE
  __local KEY_T keys[NP];
  __local int idx[NP];
  const long r = get_group_id(0);
  const int lid = get_local_id(0);
  const long xb = row_x(r);
  for (int i = lid; i < NP; i += WG) {
    idx[i] = i < N ? i : PAD;
    keys[i] = i < N ? LOAD_KEY(x, xb + (long)i * INNER) : (KEY_T)0;
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  bitonic(keys, idx, NP, 0);
  if (index_order) {  // topk, sorted=False: the first K again, by index
    for (int i = lid; i < NP; i += WG) if (i >= K) idx[i] = PAD;
    barrier(CLK_LOCAL_MEM_FENCE);
    bitonic(keys, idx, KP, 1);
  }
  for (int p = lid; p < K; p += WG) emit_one((__global const VBITS*)x, OUT_ARGS, r, p, idx[p]);
}

// Sort each tile of NP entries of the row-major index buffer buf (rows of N) in place, over
// the first `count` entries of each row. by_index = 0: the tile is made of the identity indices
// of the row, ordered by key; by_index = 1: the entries already in buf, ordered by index.
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void sort_tiles(X_PARAM, __global int* buf_base, const ulong buf_off, const long by_index, const long count) {
  X_PROLOGUE
  __global int* buf = buf_base + buf_off;
  __local KEY_T keys[NP];
  __local int idx[NP];
  const long r = get_group_id(1);
  const int lid = get_local_id(0);
  const long start = (long)get_group_id(0) * NP;
  const long xb = row_x(r);
  __global int* row = buf + r * N;
  for (int i = lid; i < NP; i += WG) {
    const long e = start + i;
    const int id = e < count ? (by_index ? row[e] : (int)e) : PAD;
    idx[i] = id;
    keys[i] = (id != PAD && !by_index) ? LOAD_KEY(x, xb + (long)id * INNER) : (KEY_T)0;
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  bitonic(keys, idx, NP, by_index);
  for (int i = lid; i < NP; i += WG) if (start + i < count) row[start + i] = idx[i];
}

// Number of entries of the sorted run[0, len) that come before (key, id).
inline long rank_in(__global const X_T* x, __global const int* run, long len, KEY_T key, int id, long xb,
                    int by_index) {
  long lo = 0, hi = len;
  while (lo < hi) {
    const long mid = (lo + hi) / 2;
    const int other = run[mid];
    const KEY_T ok = by_index ? (KEY_T)0 : LOAD_KEY(x, xb + (long)other * INNER);
    if (before(ok, other, key, id, by_index)) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Merge sorted runs of `width` pairwise, src -> dst, over the first `count` entries of each row.
__kernel void merge_pass(X_PARAM, __global const int* src_base, const ulong src_off,
                         __global int* dst_base, const ulong dst_off,
                         const long by_index, const long count, const long width) {
  X_PROLOGUE
  __global const int* src = src_base + src_off;
  __global int* dst = dst_base + dst_off;
  const long p = get_global_id(0);
  const long r = get_global_id(1);
  if (p >= count) return;
  const long xb = row_x(r);
  __global const int* row = src + r * N;
  const long s = (p / (2 * width)) * (2 * width);  // start of the pair of runs holding p
  const long mid = min(s + width, count), end = min(s + 2 * width, count);
  const int id = row[p];
  const KEY_T key = by_index ? (KEY_T)0 : LOAD_KEY(x, xb + (long)id * INNER);
  long pos;
  if (p < mid) pos = p + rank_in(x, row + mid, end - mid, key, id, xb, by_index);  // left run
  else pos = s + (p - mid) + rank_in(x, row + s, mid - s, key, id, xb, by_index);  // right run
  dst[r * N + pos] = id;
}

// Write the first K entries of each row of the index buffer to the outputs.
__kernel void emit(X_PARAM, __global const int* buf_base, const ulong buf_off, OUT_KERNEL_PARAMS) {
  X_PROLOGUE
  OUT_PROLOGUE
  __global const int* buf = buf_base + buf_off;
  const long p = get_global_id(0);
  const long r = get_global_id(1);
  if (p >= K) return;
  emit_one((__global const VBITS*)x, OUT_ARGS, r, (int)p, buf[r * N + p]);
}
