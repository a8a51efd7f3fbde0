// det (polyhal.ops.linalg): one work-item per matrix, Gaussian elimination with partial
// pivoting in private memory, as the numpy reference does it.
// Defines: M (the matrix order), TOTAL (matrices).
KERNEL det(BUF(const T, x), BUF(T, y)) {
  BIND(const T, x); BIND(T, y);
  const i64 gid = GLOBAL_ID;
  if (gid >= TOTAL) return;
  ACC a[M * M + 1];
  for (int i = 0; i < M * M; ++i) a[i] = (ACC)x[gid * M * M + i];
  ACC d = 1;
  for (int col = 0; col < M; ++col) {
    int p = col;
    ACC best = fabs(a[col * M + col]);
    for (int r = col + 1; r < M; ++r) {  // the first largest magnitude, as argmax picks
      if (fabs(a[r * M + col]) > best) { best = fabs(a[r * M + col]); p = r; }
    }
    if (a[p * M + col] == 0) { d = 0; break; }
    if (p != col) {
      for (int k = col; k < M; ++k) { const ACC t = a[col * M + k]; a[col * M + k] = a[p * M + k]; a[p * M + k] = t; }
      d = -d;
    }
    const ACC pivot = a[col * M + col];
    d *= pivot;
    for (int r = col + 1; r < M; ++r) {
      const ACC f = a[r * M + col] / pivot;
      for (int k = col; k < M; ++k) a[r * M + k] -= f * a[col * M + k];
    }
  }
  y[gid] = (T)d;
}
