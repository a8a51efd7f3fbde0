// tree_ensemble (polyhal.ops.ml, whose docstring defines the compact form and the epilogue): one
// work-item per sample walks every tree once, aggregating the reached leaves' values of all
// targets in double (AGG 0: sum; 1 / 2: min / max of the non-nan values, 0 where there are
// none), then applies the epilogue on its row: BASE, the binary columns (BINARY 1: probability
// [1 - s, s], 2: margin [-s, s]), the post transform (POST 0 none, 1 logistic, 2 softmax, 3
// softmax_zero), one rounding to T, and with LABELS the label of the row's largest output.
// Defines: FEATURES, TREES, TARGETS, COLUMNS, DEPTH, SAMPLES, AGG, BINARY, POST, LABELS; table BASE.
KERNEL tree_ensemble(BUF(const T, x), BUF(const i64, nodes), BUF(const T, thresholds),
                     BUF(const double, leaf_values), BUF(const i64, roots),
#if LABELS
                     BUF(const i64, labels), BUF(T, y), BUF(i64, label_out)) {
  BIND(const i64, labels); BIND(i64, label_out);
#else
                     BUF(T, y)) {
#endif
  BIND(const T, x); BIND(const i64, nodes); BIND(const T, thresholds); BIND(const double, leaf_values);
  BIND(const i64, roots); BIND(T, y);
  const i64 s = GLOBAL_ID;
  if (s >= SAMPLES) return;
  GLOBAL const T* row = x + s * FEATURES;
  double acc[TARGETS];
  int seen[TARGETS];
  for (int j = 0; j < TARGETS; ++j) { acc[j] = 0; seen[j] = 0; }
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
    for (int j = 0; j < TARGETS; ++j) {
      const double leaf = leaf_values[i * TARGETS + j];
      if (AGG == 0) {
        acc[j] += leaf;
      } else if (leaf == leaf) {  // min / max skip nan: that leaf gives target j nothing
        acc[j] = !seen[j] ? leaf : (AGG == 1 ? (leaf < acc[j] ? leaf : acc[j]) : (leaf > acc[j] ? leaf : acc[j]));
        seen[j] = 1;
      }
    }
  }
  double out[COLUMNS];
  for (int j = 0; j < TARGETS; ++j) acc[j] += BASE[j];
  if (BINARY) {
    out[0] = BINARY == 1 ? 1.0 - acc[0] : -acc[0];
    out[COLUMNS - 1] = acc[0];
  } else {
    for (int j = 0; j < COLUMNS; ++j) out[j] = acc[j];
  }
  if (POST == 1) {
    for (int c = 0; c < COLUMNS; ++c) out[c] = 1.0 / (1.0 + exp(-out[c]));
  } else if (POST >= 2) {  // softmax (softmax_zero: over the nonzero entries; zeros stay zero)
    const double inf = 1.0 / 0.0;
    double m = -inf, total = 0;
    for (int c = 0; c < COLUMNS; ++c)
      if ((POST == 2 || out[c] != 0) && out[c] > m) m = out[c];
    if (!(m > -inf && m < inf)) m = 0;
    for (int c = 0; c < COLUMNS; ++c) {
      out[c] = (POST == 2 || out[c] != 0) ? exp(out[c] - m) : 0.0;
      total += out[c];
    }
    for (int c = 0; c < COLUMNS; ++c) out[c] = total > 0 ? out[c] / total : 0.0;
  }
  int best = 0;
  for (int c = 0; c < COLUMNS; ++c) {
    const T v = (T)out[c];
    y[s * COLUMNS + c] = v;
    if (c && v > (T)out[best]) best = c;
  }
#if LABELS
  label_out[s] = COLUMNS ? labels[best] : 0;
#endif
}
