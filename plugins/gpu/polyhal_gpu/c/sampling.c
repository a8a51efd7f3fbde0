// grid_sample and roi_align (polyhal.ops.vision, whose docstring defines them): one work-item
// per output element, coordinates and weights in ACC (double where the device has it, as the
// numpy reference computes).

#ifdef GRID_SAMPLE
// Defines: R (spatial rank), N, C, P (output points per image), SPATIAL (input points per
// image), DIMS (the R input extents), MODE (0 nearest, 1 linear, 2 cubic), PAD (0 zeros,
// 1 border, 2 reflection), ALIGN (align_corners), TOTAL = N * C * P.

// x mirrored at lo and hi until inside [lo, hi]
FN ACC reflect(ACC x, ACC lo, ACC hi) {
  const ACC span = hi - lo;
  if (span <= 0) return lo;
  if (x >= lo && x <= hi) return x;
  const int below = x < lo;
  const ACC d = below ? lo - x : x - hi;
  const ACC flips = floor(d / span);
  const ACC r = d - flips * span;
  const int even = fmod(flips, (ACC)2) == 0;
  return below == even ? lo + r : hi - r;
}

KERNEL grid_sample(BUF(const T, x), BUF(const T, grid), BUF(T, y)) {
  BIND(const T, x); BIND(const T, grid); BIND(T, y);
  const i64 gid = GLOBAL_ID;
  if (gid >= TOTAL) return;
  const i64 p = gid % P, nc = gid / P, n = nc / C;
  const i64 dims[R] = {DIMS};
  i64 at[R][4];
  ACC wt[R][4];
  for (int d = 0; d < R; ++d) {
    const ACC L = (ACC)dims[d];
    const ACC g = (ACC)grid[(n * P + p) * R + (R - 1 - d)];  // grid holds (x, y, z): reversed
    ACC c = ALIGN ? (g + 1) / 2 * (L - 1) : ((g + 1) * L - 1) / 2;
    if (MODE == 0) c = rint(c);
    const ACC lo = ALIGN ? (ACC)0 : (ACC)-0.5, hi = ALIGN ? L - 1 : L - (ACC)0.5;
    if (PAD == 1 && (c < lo || c > hi)) c = c < 0 ? 0 : (c > L - 1 ? L - 1 : c);
    if (PAD == 2) c = reflect(c, lo, hi);
    const ACC base = floor(c), t = c - base;
    if (MODE == 0) { at[d][0] = (i64)c; wt[d][0] = 1; }
    if (MODE == 1) { at[d][0] = (i64)base; wt[d][0] = 1 - t; at[d][1] = (i64)base + 1; wt[d][1] = t; }
    if (MODE == 2) {  // Keys' cubic kernel, a = -0.75
      const ACC a = (ACC)-0.75, d0 = t + 1, d1 = t, d2 = 1 - t, d3 = 2 - t;
      wt[d][0] = ((a * d0 - 5 * a) * d0 + 8 * a) * d0 - 4 * a;
      wt[d][1] = ((a + 2) * d1 - (a + 3)) * d1 * d1 + 1;
      wt[d][2] = ((a + 2) * d2 - (a + 3)) * d2 * d2 + 1;
      wt[d][3] = ((a * d3 - 5 * a) * d3 + 8 * a) * d3 - 4 * a;
      for (int k = 0; k < 4; ++k) at[d][k] = (i64)base + k - 1;
    }
    const int taps = MODE == 0 ? 1 : (MODE == 1 ? 2 : 4);
    for (int k = 0; k < taps; ++k) {  // where each tap reads, and 0 weight where it reads padding
      const i64 i = at[d][k];
      if (PAD == 0 && (i < 0 || i >= dims[d])) wt[d][k] = 0;
      at[d][k] = PAD == 2 ? clamp_index((i64)reflect((ACC)i, lo, hi), 0, dims[d] - 1)
                          : clamp_index(i, 0, dims[d] - 1);
    }
  }
  const int taps = MODE == 0 ? 1 : (MODE == 1 ? 2 : 4);
  int combos = 1;
  for (int d = 0; d < R; ++d) combos *= taps;
  ACC acc = 0;
  for (int k = 0; k < combos; ++k) {
    i64 flat = 0;
    ACC w = 1;
    int rest = k;
    for (int d = 0; d < R; ++d) {
      const int j = rest % taps;
      rest /= taps;
      flat = flat * dims[d] + at[d][j];
      w *= wt[d][j];
    }
    acc += w * (ACC)x[nc * SPATIAL + flat];
  }
  y[gid] = (T)acc;
}
#endif

#ifdef ROI_ALIGN
// Defines: C, H, W, OH, OW, SCALE, SAMPLING (0: adaptive), HALF_PIXEL, MAX_MODE,
// TOTAL = rois * C * OH * OW.
KERNEL roi_align(BUF(const T, x), BUF(const T, rois), BUF(const i64, batch), BUF(T, y)) {
  BIND(const T, x); BIND(const T, rois); BIND(const i64, batch); BIND(T, y);
  const i64 gid = GLOBAL_ID;
  if (gid >= TOTAL) return;
  const i64 pw = gid % OW, ph = (gid / OW) % OH, c = (gid / (OW * OH)) % C, r = gid / (OW * OH * C);
  const ACC off = HALF_PIXEL ? (ACC)0.5 : (ACC)0;
  const ACC x1 = (ACC)rois[r * 4] * SCALE - off, y1 = (ACC)rois[r * 4 + 1] * SCALE - off;
  ACC rw = (ACC)rois[r * 4 + 2] * SCALE - off - x1, rh = (ACC)rois[r * 4 + 3] * SCALE - off - y1;
  if (!HALF_PIXEL) { rw = rw > 1 ? rw : 1; rh = rh > 1 ? rh : 1; }
  const ACC bh = rh / OH, bw = rw / OW;
  const i64 gy = SAMPLING > 0 ? SAMPLING : (i64)ceil(rh / OH), gx = SAMPLING > 0 ? SAMPLING : (i64)ceil(rw / OW);
  ACC acc = 0;
  int first = 1;
  GLOBAL const T* img = x + (batch[r] * C + c) * H * W;
  for (i64 iy = 0; iy < gy; ++iy) {
    for (i64 ix = 0; ix < gx; ++ix) {
      ACC yy = y1 + ph * bh + (iy + (ACC)0.5) * bh / gy, xx = x1 + pw * bw + (ix + (ACC)0.5) * bw / gx;
      ACC v = 0;
      if (!(yy < -1 || yy > H || xx < -1 || xx > W)) {  // samples more than a pixel outside read 0
        yy = yy > 0 ? yy : 0;
        xx = xx > 0 ? xx : 0;
        i64 y0 = (i64)yy, x0 = (i64)xx, y1i, x1i;
        if (y0 >= H - 1) { y0 = y1i = H - 1; yy = (ACC)y0; } else { y1i = y0 + 1; }
        if (x0 >= W - 1) { x0 = x1i = W - 1; xx = (ACC)x0; } else { x1i = x0 + 1; }
        const ACC ly = yy - y0, lx = xx - x0, hy = 1 - ly, hx = 1 - lx;
        const ACC t0 = hy * hx * img[y0 * W + x0], t1 = hy * lx * img[y0 * W + x1i];
        const ACC t2 = ly * hx * img[y1i * W + x0], t3 = ly * lx * img[y1i * W + x1i];
        if (MAX_MODE) {  // the maximum of the bilinear terms, as onnxruntime
          v = t0 > t1 ? t0 : t1;
          v = v > t2 ? v : t2;
          v = v > t3 ? v : t3;
        } else {
          v = t0 + t1 + t2 + t3;
        }
      }
      if (MAX_MODE) acc = first || v > acc ? v : acc;
      else acc += v;
      first = 0;
    }
  }
  if (!MAX_MODE && gy > 0 && gx > 0) acc /= (ACC)(gy * gx);
  y[gid] = (T)(gy > 0 && gx > 0 ? acc : 0);
}
#endif
