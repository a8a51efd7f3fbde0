// Lane-parallel sort of many rows (sort, argsort, topk), for CPU OpenCL devices (PoCL).
//
// One work-item sorts 16 rows at once: element i of its 16 rows is one uint16 vector (lane l =
// row r0 + l), so every compare-exchange of a bitonic network is one vector min/max (or a
// vector select, with indices) and no lane ever waits for another: no barriers, no divergence.
// Rows are loaded 16 elements at a time (one vload16 per row) and turned into lane vectors by a
// 16x16 transpose in registers. Stages run on groups of vectors held in registers: the stages
// j < 16 on blocks of 16 (or of 32 with the stage j = 16), larger ones in passes over the tile
// that do up to four stages each (16 vectors a group), so the tile is streamed fewer times.
//
// Order (polyhal.ops.sorting): keys are the bits of x made to sort as unsigned integers (floats:
// sign flipped, negatives inverted), with -0.0 keyed as +0.0 and every nan as one canonical nan
// above +inf, so that ascending puts nan last; descending inverts the key, so nan comes first.
// Ties: with indices (HAS_IDX) the compare falls back to the index, which makes the order
// total and the result the stable one. Without (sort), equal keys are indistinguishable except
// for the bits of zeros and nans, which FIXUP puts back in input order afterwards.
//
// Scratch: the tile of NP lane vectors (and of NP index vectors with HAS_IDX) is per work-item
// data; the bufferize pass places it in private memory, in __local memory (work-groups of one
// work-item), or in a global scratch buffer (one slice per work-group) -- TILE_SPACE 0, 1 or 2.
//
// #defines set per instance: N (row length), NP (power of two >= max(N, 16)), ROWS, K (results
// per row), KP (power of two >= K, at most NP), DESC, HAS_IDX, IDX_ORDER (topk sorted=False),
// HAS_VALUES (write values), HAS_INDICES (write int64 indices), KIND (0 float32, 1 int32,
// 2 uint32), FIXUP (sort of floats: restore zero and nan bits), TILE_SPACE.

#define VT uint16
#define PAD 0xFFFFFFFFu

// Swap element (i, l) with (i + d, l - d) for i & d == 0 and l & d != 0: the bit-d step of a
// 16x16 transpose of v (rows of v become lanes).
#define TSTEP(v, d, MA, MB) \
  _Pragma("unroll") for (int i_ = 0; i_ < 16; i_++) if (!(i_ & d)) { \
    const VT a_ = v[i_], b_ = v[i_ + d]; v[i_] = shuffle2(a_, b_, MA); v[i_ + d] = shuffle2(a_, b_, MB); }

inline void transpose16(VT* v) {
  TSTEP(v, 8, ((uint16)(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)),
        ((uint16)(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31)))
  TSTEP(v, 4, ((uint16)(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)),
        ((uint16)(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31)))
  TSTEP(v, 2, ((uint16)(0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)),
        ((uint16)(2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31)))
  TSTEP(v, 1, ((uint16)(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)),
        ((uint16)(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31)))
}

// Element bits -> sort key, and back (KIND 0: float32, 1: int32, 2: uint32).
inline VT canonical(VT b) {
#if KIND == 0
  b = select(b, (VT)0, b == (VT)0x80000000u);  // -0.0 sorts as +0.0
  b = select(b, (VT)0x7FC00000u, (b & (VT)0x7FFFFFFFu) > (VT)0x7F800000u);  // one nan
#endif
  return b;
}
inline VT to_key(VT b) {
#if KIND == 0
  VT k = b ^ (((VT)0 - (b >> 31)) | (VT)0x80000000u);
#elif KIND == 1
  VT k = b ^ (VT)0x80000000u;
#else
  VT k = b;
#endif
#if DESC
  k = ~k;
#endif
  return k;
}
inline VT from_key(VT k) {
#if DESC
  k = ~k;
#endif
#if KIND == 0
  return k ^ (((k >> 31) - (VT)1) | (VT)0x80000000u);
#elif KIND == 1
  return k ^ (VT)0x80000000u;
#else
  return k;
#endif
}

// Compare-exchange of entries a and b, ascending (UP) or descending. With indices, equal keys
// compare by index, so the network sorts (key, index) pairs totally.
#if HAS_IDX
#define CE(ka, ia, kb, ib, UP) { \
    const VT kx_ = ka, ky_ = kb, ix_ = ia, iy_ = ib; \
    const VT gt_ = as_uint16((kx_ > ky_) | ((kx_ == ky_) & (ix_ > iy_))); \
    const VT sw_ = (UP) ? gt_ : ~gt_; \
    ka = select(kx_, ky_, sw_); kb = select(ky_, kx_, sw_); ia = select(ix_, iy_, sw_); ib = select(iy_, ix_, sw_); }
#else
#define CE(ka, ia, kb, ib, UP) { \
    const VT kx_ = ka, ky_ = kb; \
    if (UP) { ka = min(kx_, ky_); kb = max(kx_, ky_); } else { ka = max(kx_, ky_); kb = min(kx_, ky_); } }
#endif

// IDX(s): the statement s only where indices are sorted along (they are not for `sort`).
#if HAS_IDX
#define IDX(s) s
#else
#define IDX(s)
#endif

#if TILE_SPACE == 2
#define TILE_PARAMS , __global VT* tile_base, const ulong tile_off
#else
#define TILE_PARAMS
#endif

// Sort tk[0, size) (and ti) ascending; size a power of two >= 16. Blocks of 16 are already
// sorted alternately up and down when `presorted` (the load did stages k <= 16).
#if TILE_SPACE == 1
#define TSPACE __local
#elif TILE_SPACE == 2
#define TSPACE __global
#else
#define TSPACE __private
#endif

inline void block16(TSPACE VT* tk, TSPACE VT* ti, int i0, int k, int first) {
  // Stages j = 8..1 (all of k <= 16 when `first`) on the 16 entries at i0, in registers.
  VT vk[16];
  VT vi[16];
  #pragma unroll
  for (int t = 0; t < 16; t++) { vk[t] = tk[i0 + t]; IDX(vi[t] = ti[i0 + t]); }
  if (first) {
    #pragma unroll
    for (int kk = 2; kk <= 16; kk <<= 1) {
      #pragma unroll
      for (int j = kk >> 1; j > 0; j >>= 1) {
        #pragma unroll
        for (int t = 0; t < 16; t++) if (!(t & j)) {
          const int up = (kk == 16) ? ((i0 & 16) == 0) : ((t & kk) == 0);
          CE(vk[t], vi[t], vk[t + j], vi[t + j], up)
        }
      }
    }
  } else {
    const int up = (i0 & k) == 0;
    #pragma unroll
    for (int j = 8; j > 0; j >>= 1) {
      #pragma unroll
      for (int t = 0; t < 16; t++) if (!(t & j)) CE(vk[t], vi[t], vk[t + j], vi[t + j], up)
    }
  }
  #pragma unroll
  for (int t = 0; t < 16; t++) { tk[i0 + t] = vk[t]; IDX(ti[i0 + t] = vi[t]); }
}

inline void network(TSPACE VT* tk, TSPACE VT* ti, int size) {
  for (int i0 = 0; i0 < size; i0 += 16) block16(tk, ti, i0, 16, 1);
  for (int k = 32; k <= size; k <<= 1) {
    int j = k >> 1;
    for (; j >= 128; j >>= 4) {  // four stages (j .. j/8) per pass: 16 entries per group, in registers
      const int q = j >> 3;
      for (int b0 = 0; b0 < size; b0 += 2 * j) {
        const int up = (b0 & k) == 0;
        for (int i = b0; i < b0 + q; i++) {
          VT a[16], x[16];
          #pragma unroll
          for (int m = 0; m < 16; m++) { a[m] = tk[i + m * q]; IDX(x[m] = ti[i + m * q]); }
          #pragma unroll
          for (int d = 8; d > 0; d >>= 1) {
            #pragma unroll
            for (int m = 0; m < 16; m++) if (!(m & d)) CE(a[m], x[m], a[m + d], x[m + d], up)
          }
          #pragma unroll
          for (int m = 0; m < 16; m++) { tk[i + m * q] = a[m]; IDX(ti[i + m * q] = x[m]); }
        }
      }
    }
    for (; j >= 64; j >>= 3) {  // three stages (j, j/2, j/4) per pass: 8 entries per group
      const int q = j >> 2;
      for (int b0 = 0; b0 < size; b0 += 2 * j) {
        const int up = (b0 & k) == 0;
        for (int i = b0; i < b0 + q; i++) {
          VT a[8], x[8];
          #pragma unroll
          for (int m = 0; m < 8; m++) { a[m] = tk[i + m * q]; IDX(x[m] = ti[i + m * q]); }
          #pragma unroll
          for (int m = 0; m < 4; m++) CE(a[m], x[m], a[m + 4], x[m + 4], up)
          CE(a[0], x[0], a[2], x[2], up) CE(a[1], x[1], a[3], x[3], up)
          CE(a[4], x[4], a[6], x[6], up) CE(a[5], x[5], a[7], x[7], up)
          CE(a[0], x[0], a[1], x[1], up) CE(a[2], x[2], a[3], x[3], up)
          CE(a[4], x[4], a[5], x[5], up) CE(a[6], x[6], a[7], x[7], up)
          #pragma unroll
          for (int m = 0; m < 8; m++) { tk[i + m * q] = a[m]; IDX(ti[i + m * q] = x[m]); }
        }
      }
    }
    for (; j >= 32; j >>= 2) {  // two stages (j, j/2): 4 entries per group
      const int q = j >> 1;
      for (int b0 = 0; b0 < size; b0 += 2 * j) {
        const int up = (b0 & k) == 0;
        for (int i = b0; i < b0 + q; i++) {
          VT a0 = tk[i], a1 = tk[i + q], a2 = tk[i + 2 * q], a3 = tk[i + 3 * q];
          VT x0 = (VT)0, x1 = (VT)0, x2 = (VT)0, x3 = (VT)0;
          IDX(x0 = ti[i]; x1 = ti[i + q]; x2 = ti[i + 2 * q]; x3 = ti[i + 3 * q]);
          CE(a0, x0, a2, x2, up) CE(a1, x1, a3, x3, up) CE(a0, x0, a1, x1, up) CE(a2, x2, a3, x3, up)
          tk[i] = a0; tk[i + q] = a1; tk[i + 2 * q] = a2; tk[i + 3 * q] = a3;
          IDX(ti[i] = x0; ti[i + q] = x1; ti[i + 2 * q] = x2; ti[i + 3 * q] = x3);
        }
      }
    }
    if (j == 16) {  // stage 16 and stages 8..1 on 32 entries in registers
      for (int i0 = 0; i0 < size; i0 += 32) {
        const int up = (i0 & k) == 0;
        VT a[32], x[32];
        #pragma unroll
        for (int m = 0; m < 32; m++) { a[m] = tk[i0 + m]; IDX(x[m] = ti[i0 + m]); }
        #pragma unroll
        for (int d = 16; d > 0; d >>= 1) {
          #pragma unroll
          for (int m = 0; m < 32; m++) if (!(m & d)) CE(a[m], x[m], a[m + d], x[m + d], up)
        }
        #pragma unroll
        for (int m = 0; m < 32; m++) { tk[i0 + m] = a[m]; IDX(ti[i0 + m] = x[m]); }
      }
      continue;
    }
    for (; j >= 16; j >>= 1) {  // one stage j = 16
      for (int b0 = 0; b0 < size; b0 += 2 * j) {
        const int up = (b0 & k) == 0;
        for (int i = b0; i < b0 + j; i++) {
          VT a0 = tk[i], a1 = tk[i + j], x0 = (VT)0, x1 = (VT)0;
          IDX(x0 = ti[i]; x1 = ti[i + j]);
          CE(a0, x0, a1, x1, up)
          tk[i] = a0; tk[i + j] = a1;
          IDX(ti[i] = x0; ti[i + j] = x1);
        }
      }
    }
    for (int i0 = 0; i0 < size; i0 += 16) block16(tk, ti, i0, k, 0);
  }
}

__kernel void sort_lanes(__global const uint* x_base, const ulong x_off OUT_KERNEL_PARAMS TILE_PARAMS) {
  __global const uint* x = x_base + x_off;
  OUT_PROLOGUE
#if TILE_SPACE == 1
  __local VT tk[NP];
#if HAS_IDX
  __local VT ti[NP];
#else
  __local VT ti[1];  // unused: the macros name it, the compiler drops it
#endif
#elif TILE_SPACE == 2
  __global VT* tk = tile_base + tile_off + (ulong)get_group_id(0) * (HAS_IDX ? 2 * NP : NP);
  __global VT* ti = tk + (HAS_IDX ? NP : 0);
#else
  VT tk[NP];
#if HAS_IDX
  VT ti[NP];
#else
  VT ti[1];
#endif
#endif
  const int r0 = get_group_id(0) * 16;
  VT odd = (VT)0;  // lanes whose row holds -0.0 or a non-canonical nan (FIXUP)
  for (int i0 = 0; i0 < NP; i0 += 16) {
    VT v[16];
    #pragma unroll
    for (int l = 0; l < 16; l++) {
      const long row = (long)min(r0 + l, ROWS - 1) * N;
      if (i0 + 16 <= N) {
        v[l] = vload16(0, x + row + i0);
      } else {  // the row's tail: pad with the largest key
        uint e[16];
        for (int t = 0; t < 16; t++) e[t] = i0 + t < N ? x[row + i0 + t] : 0u;
        v[l] = vload16(0, e);
      }
    }
    transpose16(v);  // v[t] = element i0 + t of the 16 rows
    #pragma unroll
    for (int t = 0; t < 16; t++) {
      const VT c = canonical(v[t]);
      odd |= as_uint16(c != v[t]);
      tk[i0 + t] = (i0 + t < N) ? to_key(c) : (VT)PAD;
#if HAS_IDX
      ti[i0 + t] = (VT)(uint)(i0 + t);
#endif
    }
  }
  network(tk, ti, NP);
#if IDX_ORDER
  // topk, sorted=False: the first K again, ordered by index alone.
  for (int p = 0; p < KP; p++) { tk[p] = p < K ? ti[p] : (VT)PAD; ti[p] = (VT)0; }
  if (KP >= 16) network(tk, ti, KP);
  else for (int a = 1; a < KP; a++) for (int b = a; b > 0; b--) {  // tiny K: insertion sort
    const VT lo = min(tk[b - 1], tk[b]), hi = max(tk[b - 1], tk[b]); tk[b - 1] = lo; tk[b] = hi; }
  for (int p = 0; p < KP; p++) ti[p] = tk[p];
#endif
  // Write the first K of each row.
  for (int i0 = 0; i0 < K; i0 += 16) {
#if HAS_VALUES && !HAS_IDX
    VT v[16];
    #pragma unroll
    for (int t = 0; t < 16; t++) v[t] = i0 + t < K ? from_key(tk[i0 + t]) : (VT)0;
    transpose16(v);
    #pragma unroll
    for (int l = 0; l < 16; l++) {
      if (r0 + l >= ROWS) break;
      const long o = (long)(r0 + l) * K + i0;
      if (i0 + 16 <= K) vstore16(v[l], 0, values + o);
      else { uint e[16]; vstore16(v[l], 0, e); for (int t = 0; i0 + t < K; t++) values[o + t] = e[t]; }
    }
#else
    VT v[16];
    #pragma unroll
    for (int t = 0; t < 16; t++) v[t] = i0 + t < K ? ti[i0 + t] : (VT)0;
    transpose16(v);  // v[l] = the indices of row r0 + l
    #pragma unroll
    for (int l = 0; l < 16; l++) {
      if (r0 + l >= ROWS) break;
      const long o = (long)(r0 + l) * K + i0;
      uint e[16];
      vstore16(v[l], 0, e);
      for (int t = 0; t < 16 && i0 + t < K; t++) {
#if HAS_INDICES
        indices[o + t] = (long)e[t];
#endif
#if HAS_VALUES
        values[o + t] = x[(long)(r0 + l) * N + e[t]];  // the input's own bits
#endif
      }
    }
#endif
  }
#if FIXUP && HAS_VALUES && !HAS_IDX
  // Rows with -0.0 or nan payloads: equal keys came out as +0.0 / the canonical nan; put the
  // input's own bits back, in input order (the stable order of equal elements).
  uint flags[16];
  vstore16(odd, 0, flags);
  for (int l = 0; l < 16; l++) {
    if (!flags[l] || r0 + l >= ROWS) continue;
    __global const uint* in = x + (long)(r0 + l) * N;
    __global uint* out = values + (long)(r0 + l) * K;
    int zp = 0, np = 0;
    while (zp < K && out[zp] != 0u) zp++;          // the run of zeros
    while (np < K && out[np] != 0x7FC00000u) np++;  // the run of nans
    for (int i = 0; i < N; i++) {
      const uint b = in[i];
      if ((b & 0x7FFFFFFFu) == 0u) { if (zp < K) out[zp++] = b; }
      else if ((b & 0x7FFFFFFFu) > 0x7F800000u) { if (np < K) out[np++] = b; }
    }
  }
#endif
}
