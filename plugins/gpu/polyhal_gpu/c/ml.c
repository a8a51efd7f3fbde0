// tree_ensemble (polyhal.ops.ml, whose docstring defines the compact form): one work-item per
// (sample, target) walks every tree and sums the reached leaves' values in double.
// Defines: FEATURES, TREES, TARGETS, DEPTH, TOTAL = samples * TARGETS.
KERNEL tree_ensemble(BUF(const T, x), BUF(const i64, nodes), BUF(const T, thresholds),
                     BUF(const double, leaf_values), BUF(const i64, roots), BUF(T, y)) {
  BIND(const T, x); BIND(const i64, nodes); BIND(const T, thresholds); BIND(const double, leaf_values);
  BIND(const i64, roots); BIND(T, y);
  const i64 gid = GLOBAL_ID;
  if (gid >= TOTAL) return;
  const i64 j = gid % TARGETS, s = gid / TARGETS;
  GLOBAL const T* row = x + s * FEATURES;
  double acc = 0;
  for (i64 t = 0; t < TREES; ++t) {
    i64 i = roots[t];
    for (int level = 0; level < DEPTH; ++level) {
      GLOBAL const i64* node = nodes + i * 4;
      const i64 mode = node[1];
      if (mode == 0) break;  // a leaf
      const T v = row[node[0]], th = thresholds[i];
      const int go = v != v ? (mode & 8) != 0
                            : ((mode & 1) && v < th) || ((mode & 2) && v == th) || ((mode & 4) && v > th);
      i = go ? node[2] : node[3];
    }
    acc += leaf_values[i * TARGETS + j];
  }
  y[gid] = (T)acc;
}
