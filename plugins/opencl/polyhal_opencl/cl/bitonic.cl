// Bitonic sorting of (key, index) pairs in __local memory by one work-group, in a total order:
// ascending (DESC 0) puts nan last, descending (DESC 1) puts nan first, equal keys compare by
// index, and padding entries (index PAD) come after everything. A total order makes the
// (unstable) bitonic network produce the stable order. Used by sort.cl.
//
// #defines expected: KEY_T (key type), DESC, ISNAN(v), WG (work-group size).

#define PAD INT_MAX

// Does (a, ia) come before (b, ib)? Padding (index PAD) comes after everything.
inline int before(KEY_T a, int ia, KEY_T b, int ib, int by_index) {
  if (ia == PAD) return 0;
  if (ib == PAD) return 1;
  if (by_index) return ia < ib;
  const int na = ISNAN(a), nb = ISNAN(b);
  if (na != nb) return DESC ? na : nb;
  if (!na && a != b) return DESC ? a > b : a < b;
  return ia < ib;
}

// Bitonic sort of keys[0, size) / idx[0, size) in local memory by the work-group; size is a
// power of two. Each work-item handles compare-exchanges t = lid, lid + WG, ...
inline void bitonic(__local KEY_T* keys, __local int* idx, int size, int by_index) {
  const int lid = get_local_id(0);
  for (int k = 2; k <= size; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int t = lid; t < size / 2; t += WG) {
        const int i = 2 * t - (t & (j - 1));  // lower element of the pair: bit j of i is clear
        const int l = i + j;
        const int up = (i & k) == 0;
        const int swap = up ? before(keys[l], idx[l], keys[i], idx[i], by_index)
                            : before(keys[i], idx[i], keys[l], idx[l], by_index);
        if (swap) {
          const KEY_T tk = keys[i]; keys[i] = keys[l]; keys[l] = tk;
          const int ti = idx[i]; idx[i] = idx[l]; idx[l] = ti;
        }
      }
      barrier(CLK_LOCAL_MEM_FENCE);
    }
  }
}

