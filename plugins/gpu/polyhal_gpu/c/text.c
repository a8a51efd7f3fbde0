// tfidf_vectorizer (polyhal.ops.text): one work-item per (row, output column) counts the pool
// n-grams that land in its column, for every skip and start position, and weighs the count.
// Defines: LEN (tokens per row), WIDTH (columns), MAX_SKIP, MODE (0 TF, 1 IDF, 2 TFIDF),
// HAS_WEIGHTS, TOTAL = rows * WIDTH; tables (constant arrays, built by the host):
// COL_START[WIDTH + 1] (each column's entries), ENTRY_N / ENTRY_AT (an entry's n-gram size and
// where its ids start in GRAMS), GRAMS (token ids), WEIGHTS[WIDTH].
KERNEL tfidf_vectorizer(BUF(const T, x), BUF(float, y)) {
  BIND(const T, x); BIND(float, y);
  const i64 gid = GLOBAL_ID;
  if (gid >= TOTAL) return;
  const i64 col = gid % WIDTH;
  GLOBAL const T* row = x + (gid / WIDTH) * LEN;
  i64 count = 0;
  for (int e = COL_START[col]; e < COL_START[col + 1]; ++e) {
    const int n = ENTRY_N[e], at = ENTRY_AT[e];
    const int skips = n > 1 ? MAX_SKIP : 0;  // unigrams count once
    for (int skip = 0; skip <= skips; ++skip) {
      for (i64 p = 0; p + (i64)(n - 1) * (skip + 1) < LEN; ++p) {
        int k = 0;
        while (k < n && (i64)row[p + k * (skip + 1)] == GRAMS[at + k]) ++k;
        count += k == n;
      }
    }
  }
  const ACC w = HAS_WEIGHTS ? (ACC)WEIGHTS[col] : (ACC)1;
  y[gid] = (float)(MODE == 0 ? (ACC)count : (MODE == 1 ? (count > 0 ? w : (ACC)0) : (ACC)count * w));
}
