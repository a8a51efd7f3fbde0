// Stable sorting for sort, argsort and topk (polyhal.ops.sorting's order), and the argsort that
// non-maximum suppression needs.
//
// Every element type is sorted as an unsigned key K of its width (u8/u16/u32/u64) made from its
// raw bits by to_key(): ascending unsigned order of keys is the op's ascending order (floats:
// the sign-magnitude flip; every nan made one canonical nan above +inf; optionally -0.0 made
// +0.0 so that the two zeros tie), and descending is the ascending order of ~key. Ties keep
// their input order in both directions because every path is stable (bitonic networks compare
// (key, index) pairs; the radix sort is LSD, stable by construction).
//
// Lanes: the op sorts along one axis of an (OUTER, N, INNER) view; lane r = (o, i) holds the
// N elements x[(o * N + j) * INNER + i], j < N.
//
// Two paths, chosen by the host (polyhal_cuda/sorting.py) with their scratch placed by the
// bufferization policy:
//  * sort_rows: one block per lane, a bitonic network over (key, index) pairs held in a scratch
//    of P = next_pow2(N) pairs -- in shared memory when it fits (dynamic shared memory), else a
//    per-block slice of a global scratch buffer (same code, another base pointer);
//  * radix_*: an LSD radix sort over all lanes at once, 8 bits per pass, in one of two forms:
//    "onesweep" (the default; radix_histogram + radix_prefix once, then one radix_onesweep
//    kernel per pass with a decoupled look-back: see its section below) or the classic
//    reduce-then-scan: per pass radix_upsweep (per-tile digit counts), radix_scan (exclusive
//    offsets, one block per digit), radix_scatter (stable tile-local ranking with warp match,
//    staged through shared memory for coalesced writes). Lanes are kept apart by extra passes
//    over the lane number (payload / N), the most significant digits. Scratch: two key and two
//    payload buffers (ping-pong), and the histograms and per-pass digit totals (classic) or the
//    digit offsets, look-back words and tile counters (onesweep) -- always global.

#define SORT_BLOCK 256
#define RADIX 256

// Flags of the kernels below.
#define F_DESC 1         // descending order
#define F_CANON_ZERO 2   // -0.0 sorts as +0.0 (ties with it)
#define F_VALUES 4       // write the values output
#define F_INDICES 8      // write the (int64) indices output
#define F_INDEX_ORDER 16 // topk sorted=False: the selected k come out in increasing index order

template <typename K> __device__ __forceinline__ K sign_bit() { return (K)((K)1 << (sizeof(K) * 8 - 1)); }

template <typename K> struct FloatBits;
template <> struct FloatBits<u16> { static constexpr u16 EXP = 0x7c00u, MAN = 0x03ffu, QNAN = 0x7e00u; };
template <> struct FloatBits<u32> { static constexpr u32 EXP = 0x7f800000u, MAN = 0x007fffffu, QNAN = 0x7fc00000u; };
template <> struct FloatBits<u64> {
    static constexpr u64 EXP = 0x7ff0000000000000ull, MAN = 0x000fffffffffffffull, QNAN = 0x7ff8000000000000ull;
};
template <> struct FloatBits<u8> { static constexpr u8 EXP = 0, MAN = 0, QNAN = 0; };  // never used

// KIND: 0 unsigned or bool, 1 signed integer, 2 float.
template <typename K, int KIND> __device__ __forceinline__ K to_key(K bits, int flags) {
    if (KIND == 1) {
        bits = (K)(bits ^ sign_bit<K>());
    } else if (KIND == 2) {
        const K sb = sign_bit<K>();
        if ((K)(bits & FloatBits<K>::EXP) == FloatBits<K>::EXP && (K)(bits & FloatBits<K>::MAN) != 0)
            bits = FloatBits<K>::QNAN;
        else if ((flags & F_CANON_ZERO) && bits == sb)
            bits = 0;
        bits = (bits & sb) ? (K)~bits : (K)(bits | sb);
    }
    if (flags & F_DESC) bits = (K)~bits;
    return bits;
}

template <typename K, int KIND> __device__ __forceinline__ K from_key(K key, int flags) {
    if (flags & F_DESC) key = (K)~key;
    if (KIND == 1) return (K)(key ^ sign_bit<K>());
    if (KIND == 2) {
        const K sb = sign_bit<K>();
        return (key & sb) ? (K)(key ^ sb) : (K)~key;
    }
    return key;
}

__device__ __forceinline__ i64 lane_base(i64 r, i64 n, i64 inner) {
    return (r / inner) * n * inner + (r % inner);
}

// The key of flat element e (lane e / n, index e % n) read from the operand itself.
template <typename K, int KIND>
__device__ __forceinline__ K source_key(const K* __restrict__ x, u32 e, i64 n, i64 inner, int flags) {
    if (inner == 1) return to_key<K, KIND>(x[e], flags);
    const i64 r = (i64)e / n, j = (i64)e - r * n;
    return to_key<K, KIND>(x[lane_base(r, n, inner) + j * inner], flags);
}

// ------------------------------------------------------------------------------- bitonic path

// Bitonic sort of p (a power of two) (key, index) pairs in ks/is, ascending by (key, index).
template <typename K> __device__ void bitonic(K* ks, u32* is, u32 p) {
    for (u32 k = 2; k <= p; k <<= 1) {
        for (u32 j = k >> 1; j > 0; j >>= 1) {
            for (u32 t = threadIdx.x; t < (p >> 1); t += blockDim.x) {
                const u32 i = ((t & ~(j - 1)) << 1) | (t & (j - 1));
                const u32 l = i + j;
                const bool up = (i & k) == 0;
                const K a = ks[i], b = ks[l];
                const u32 ia = is[i], ib = is[l];
                const bool gt = (a > b) || (a == b && ia > ib);
                if (gt == up) { ks[i] = b; ks[l] = a; is[i] = ib; is[l] = ia; }
            }
            __syncthreads();
        }
    }
}

// One block per lane. scratch: nullptr -> dynamic shared memory, else a global buffer with
// one (p * (4 + sizeof(K)))-byte slice per block. Outputs have the (OUTER, kout, INNER) layout.
template <typename K, int KIND>
__global__ void sort_rows(const K* __restrict__ x, K* __restrict__ values, i64* __restrict__ indices,
                          i64 lanes, i64 n, i64 inner, i64 kout, u32 p, u32 kp, int flags,
                          unsigned char* __restrict__ scratch) {
    extern __shared__ __align__(16) unsigned char smem[];
    const i64 r = blockIdx.x;
    if (r >= lanes) return;
    unsigned char* base = scratch ? scratch + (size_t)r * p * (4 + sizeof(K)) : smem;
    u32* is = (u32*)base;  // indices first: 4-byte aligned; keys follow at 4p (8-aligned, p even)
    K* ks = (K*)(base + 4 * (size_t)p);
    const i64 src = lane_base(r, n, inner);
    for (u32 j = threadIdx.x; j < p; j += blockDim.x) {
        if (j < n) { ks[j] = to_key<K, KIND>(x[src + (i64)j * inner], flags); is[j] = j; }
        else { ks[j] = (K)~(K)0; is[j] = 0xffffffffu; }
    }
    __syncthreads();
    bitonic<K>(ks, is, p);
    if (flags & F_INDEX_ORDER) {
        // The first kout of the order, re-sorted by index: equal keys, so (key, index) order
        // is index order; the rest of the kp-prefix is padding.
        for (u32 j = threadIdx.x; j < kp; j += blockDim.x) {
            if (j < kout) ks[j] = 0; else { ks[j] = (K)~(K)0; is[j] = 0xffffffffu; }
        }
        __syncthreads();
        bitonic<K>(ks, is, kp);
    }
    const i64 dst = lane_base(r, kout, inner);
    for (u32 j = threadIdx.x; j < kout; j += blockDim.x) {
        const u32 s = is[j];
        if (flags & F_VALUES) values[dst + (i64)j * inner] = x[src + (i64)s * inner];
        if (flags & F_INDICES) indices[dst + (i64)j * inner] = (i64)s;
    }
}

// --------------------------------------------------------------------------------- radix path

// keys[f] = key of element j of lane r (f = r * n + j); payload[f] = f when payload is given.
template <typename K, int KIND>
__global__ void radix_make_keys(const K* __restrict__ x, K* __restrict__ keys, u32* __restrict__ payload,
                                i64 total, i64 n, i64 inner, int flags) {
    for (i64 f = (i64)blockIdx.x * blockDim.x + threadIdx.x; f < total; f += (i64)gridDim.x * blockDim.x) {
        const i64 r = f / n, j = f - r * n;
        keys[f] = to_key<K, KIND>(x[lane_base(r, n, inner) + j * inner], flags);
        if (payload) payload[f] = (u32)f;
    }
}

template <typename K> struct RadixTile { static constexpr int ITEMS = sizeof(K) >= 8 ? 8 : 16; };

template <typename K, bool ROW>
__device__ __forceinline__ u32 digit_of(K key, u32 pay, int shift, u32 n) {
    if (ROW) return ((pay / n) >> shift) & (RADIX - 1);
    return (u32)(key >> shift) & (RADIX - 1);
}

// Per-tile digit counts: hist[d * tiles + t]; totals[d] += count (totals zeroed by the host).
// FIRST: the first pass reads the operand x0 itself (keys made on the fly, payload = index).
// AGG: equal digits of a warp are counted with one shared atomic (warp match), so that skewed
// digits (the exponent byte of floats) do not serialise on a few counters.
template <typename K, int KIND, bool ROW, bool FIRST, bool AGG>
__global__ void radix_upsweep(const K* __restrict__ keys, const u32* __restrict__ payload, const K* __restrict__ x0,
                              u32 total, i64 n, i64 inner, int shift, int flags, u32* __restrict__ hist,
                              u32* __restrict__ totals, u32 tiles) {
    constexpr u32 TILE = SORT_BLOCK * RadixTile<K>::ITEMS;
    __shared__ u32 cnt[RADIX];
    for (u32 d = threadIdx.x; d < RADIX; d += blockDim.x) cnt[d] = 0;
    __syncthreads();
    const u32 t = blockIdx.x;
    const u32 begin = t * TILE;
    const u32 end = min(total, begin + TILE);
    const u32 lt = (1u << (threadIdx.x & 31)) - 1u;
    for (u32 base = begin; base < end; base += blockDim.x) {
        const u32 e = base + threadIdx.x;
        u32 d = RADIX;
        if (e < end) {
            if (FIRST) d = digit_of<K, ROW>(source_key<K, KIND>(x0, e, n, inner, flags), e, shift, (u32)n);
            else d = digit_of<K, ROW>(ROW ? (K)0 : keys[e], ROW ? payload[e] : 0u, shift, (u32)n);
        }
        if (AGG) {
            const u32 peers = __match_any_sync(FULL_MASK, d);
            if (d < RADIX && (peers & lt) == 0) atomicAdd(&cnt[d], __popc(peers));
        } else if (d < RADIX) {
            atomicAdd(&cnt[d], 1u);
        }
    }
    __syncthreads();
    for (u32 d = threadIdx.x; d < RADIX; d += blockDim.x) {
        const u32 c = cnt[d];
        hist[(size_t)d * tiles + t] = c;
        if (c) atomicAdd(&totals[d], c);
    }
}

// Exclusive offsets: hist[d * tiles + t] becomes (sum of totals[d' < d]) + (sum of hist[d][t' < t]).
// One block (1024 threads) per digit.
__global__ void radix_scan(u32* __restrict__ hist, const u32* __restrict__ totals, u32 tiles) {
    __shared__ u32 sh[32];
    __shared__ u32 carry;
    const u32 d = blockIdx.x;
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    u32 v = threadIdx.x < d ? totals[threadIdx.x] : 0u;  // d < 256 <= blockDim.x
    v = warp_sum(v);
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 s = 0;
        for (int w = 0; w < nw; ++w) s += sh[w];
        carry = s;
    }
    __syncthreads();
    u32* row = hist + (size_t)d * tiles;
    for (u32 base = 0; base < tiles; base += blockDim.x) {
        const u32 i = base + threadIdx.x;
        const u32 x = i < tiles ? row[i] : 0u;
        // inclusive warp scan
        u32 s = x;
        for (int o = 1; o < 32; o <<= 1) {
            const u32 y = __shfl_up_sync(FULL_MASK, s, o);
            if (lane >= o) s += y;
        }
        __syncthreads();  // sh reuse
        if (lane == 31) sh[wid] = s;
        __syncthreads();
        if (wid == 0) {
            u32 w = lane < nw ? sh[lane] : 0u;
            u32 ws = w;
            for (int o = 1; o < 32; o <<= 1) {
                const u32 y = __shfl_up_sync(FULL_MASK, ws, o);
                if (lane >= o) ws += y;
            }
            if (lane < nw) sh[lane] = ws - w;  // exclusive prefix of warp sums
        }
        __syncthreads();
        const u32 c = carry;
        if (i < tiles) row[i] = c + sh[wid] + s - x;
        __syncthreads();
        if (threadIdx.x == blockDim.x - 1) carry = c + sh[wid] + s;
        __syncthreads();
    }
}

// Stable scatter of one tile by digit. Warp w of the block owns elements
// [tile_begin + w * 32 * ITEMS, ...) in rounds of 32 (lane order = input order); ranks within a
// round come from __match_any_sync, and per-warp digit counters carry them across rounds.
// FIRST: pass 0 reads the operand x0 (as radix_upsweep). LAST: the last pass writes the
// outputs (values: from_key, or xv[payload]; indices: payload - lane * n) instead of kout/pout.
// (Template flags, not run-time ones: the hot loop keeps its registers.)
template <typename K, int KIND, bool ROW, bool PAY, bool FIRST, bool LAST>
__global__ void __launch_bounds__(SORT_BLOCK)
radix_scatter(const K* __restrict__ kin, const u32* __restrict__ pin, const K* __restrict__ x0,
              K* __restrict__ kout, u32* __restrict__ pout, K* __restrict__ values, i64* __restrict__ indices,
              const K* __restrict__ xv, u32 total, i64 n, i64 inner, int shift, int flags,
              const u32* __restrict__ hist, u32 tiles) {
    constexpr int ITEMS = RadixTile<K>::ITEMS;
    constexpr int WARPS = SORT_BLOCK / 32;
    constexpr u32 TILE = SORT_BLOCK * ITEMS;
    __shared__ u32 wcnt[WARPS][RADIX];
    __shared__ u32 tstart[RADIX];
    __shared__ u32 goff[RADIX];
    __shared__ u32 wsum[WARPS];
    __shared__ K skeys[TILE];
    __shared__ u32 spay[PAY ? TILE : 1];

    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const u32 t = blockIdx.x;
    const u32 tile_begin = t * TILE;
    const u32 count = min(total - tile_begin, TILE);
    for (u32 i = threadIdx.x; i < WARPS * RADIX; i += SORT_BLOCK) (&wcnt[0][0])[i] = 0;
    for (u32 d = threadIdx.x; d < RADIX; d += SORT_BLOCK) goff[d] = hist[(size_t)d * tiles + t];
    __syncthreads();

    const u32 lt_mask = (1u << lane) - 1u;
    K key[ITEMS];
    u32 pay[ITEMS];
    u32 rank[ITEMS];
    u32 dig[ITEMS];
#pragma unroll
    for (int r = 0; r < ITEMS; ++r) {
        const u32 local = (u32)w * 32u * ITEMS + (u32)r * 32u + (u32)lane;
        const bool valid = local < count;
        u32 d = RADIX;  // invalid lanes group together and count nowhere
        key[r] = 0;
        pay[r] = 0;
        if (valid) {
            const u32 e = tile_begin + local;
            if (FIRST) { key[r] = source_key<K, KIND>(x0, e, n, inner, flags); pay[r] = e; }
            else { key[r] = kin[e]; if (PAY) pay[r] = pin[e]; }
            d = digit_of<K, ROW>(key[r], pay[r], shift, (u32)n);
        }
        const u32 peers = __match_any_sync(FULL_MASK, d);
        const u32 leader = __ffs(peers) - 1;
        u32 pre = 0;
        if (valid) pre = wcnt[w][d];
        __syncwarp();
        if (valid && (u32)lane == leader) wcnt[w][d] = pre + __popc(peers);
        __syncwarp();
        rank[r] = pre + __popc(peers & lt_mask);
        dig[r] = d;
    }
    __syncthreads();
    // Per digit: exclusive prefix over warps, and the tile's count of the digit.
    u32 tile_cnt = 0;
    if (threadIdx.x < RADIX) {
        const u32 d = threadIdx.x;
        u32 run = 0;
#pragma unroll
        for (int ww = 0; ww < WARPS; ++ww) { const u32 c = wcnt[ww][d]; wcnt[ww][d] = run; run += c; }
        tile_cnt = run;
    }
    // Exclusive scan of the tile's digit counts (RADIX == SORT_BLOCK threads, one digit each).
    u32 s = tile_cnt;
    for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(FULL_MASK, s, o);
        if (lane >= o) s += y;
    }
    if (lane == 31) wsum[w] = s;
    __syncthreads();
    if (threadIdx.x < RADIX) {
        u32 before = 0;
        for (int ww = 0; ww < w; ++ww) before += wsum[ww];
        tstart[threadIdx.x] = before + s - tile_cnt;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < ITEMS; ++r) {
        const u32 d = dig[r];
        if (d < RADIX) {
            const u32 pos = tstart[d] + wcnt[w][d] + rank[r];
            skeys[pos] = key[r];
            if (PAY) spay[pos] = pay[r];
        }
    }
    __syncthreads();
    // Coalesced write-out: consecutive threads take consecutive (digit-sorted) tile positions.
    for (u32 i = threadIdx.x; i < count; i += SORT_BLOCK) {
        const K k = skeys[i];
        const u32 p = PAY ? spay[i] : 0u;
        const u32 d = digit_of<K, ROW>(k, p, shift, (u32)n);
        const u32 g = goff[d] + (i - tstart[d]);
        if (LAST) {
            if (values) values[g] = PAY ? xv[p] : from_key<K, KIND>(k, flags);
            if (indices) indices[g] = (i64)p - ((i64)g / n) * n;
        } else {
            kout[g] = k;
            if (PAY) pout[g] = p;
        }
    }
}

// Outputs from the sorted keys/payload of all lanes (lane r's order at [r * n, r * n + n)):
// the first kout of each lane. Values come from x through the payload (exact bits) or, without
// a payload, from the keys themselves.
template <typename K, int KIND>
__global__ void radix_emit(const K* __restrict__ keys, const u32* __restrict__ payload, const K* __restrict__ x,
                           K* __restrict__ values, i64* __restrict__ indices, i64 lanes, i64 n, i64 inner,
                           i64 kout, int flags) {
    const i64 total = lanes * kout;
    for (i64 q = (i64)blockIdx.x * blockDim.x + threadIdx.x; q < total; q += (i64)gridDim.x * blockDim.x) {
        const i64 r = q / kout, p = q - r * kout;
        const i64 s = r * n + p;
        const i64 dst = lane_base(r, kout, inner) + p * inner;
        i64 j = 0;
        if (payload) j = (i64)payload[s] - r * n;
        if (flags & F_VALUES) values[dst] = payload ? x[lane_base(r, n, inner) + j * inner] : from_key<K, KIND>(keys[s], flags);
        if (flags & F_INDICES) indices[dst] = j;
    }
}

// topk(sorted=False), radix path: the flat indices of each lane's first kout, as u32 keys of a
// second sort (flat index order is (lane, index) order).
__global__ void radix_take_prefix(const u32* __restrict__ payload, u32* __restrict__ out, i64 lanes, i64 n, i64 kout) {
    const i64 total = lanes * kout;
    for (i64 q = (i64)blockIdx.x * blockDim.x + threadIdx.x; q < total; q += (i64)gridDim.x * blockDim.x) {
        const i64 r = q / kout, p = q - r * kout;
        out[q] = payload[r * n + p];
    }
}

// Outputs of topk(sorted=False) from the re-sorted flat indices.
template <typename K>
__global__ void radix_emit_flat(const u32* __restrict__ flat, const K* __restrict__ x, K* __restrict__ values,
                                i64* __restrict__ indices, i64 lanes, i64 n, i64 inner, i64 kout, int flags) {
    const i64 total = lanes * kout;
    for (i64 q = (i64)blockIdx.x * blockDim.x + threadIdx.x; q < total; q += (i64)gridDim.x * blockDim.x) {
        const i64 r = q / kout, p = q - r * kout;
        const i64 j = (i64)flat[q] - r * n;
        const i64 dst = lane_base(r, kout, inner) + p * inner;
        if (flags & F_VALUES) values[dst] = x[lane_base(r, n, inner) + j * inner];
        if (flags & F_INDICES) indices[dst] = j;
    }
}

// ------------------------------------------------------------------------ onesweep radix path
//
// One kernel per pass (Merrill & Adinets' "onesweep", as CUB's DeviceRadixSort does it): the
// global digit counts of every pass come from one histogram kernel up front (radix_histogram +
// radix_prefix), and each pass finds its tiles' offsets by decoupled look-back instead of an
// upsweep and a scan. Tiles are numbered in the order blocks start (an atomic counter), so a
// block only waits for tiles whose blocks already run: no deadlock. A tile publishes, per digit,
// one word: 2 flag bits (1 = its own count, 2 = the inclusive prefix through it) and a 30-bit
// count.
//
// A tile is THREADS x ITEMS keys; warp w owns ITEMS rounds of 32 consecutive keys (lane order
// = input order within a round, rounds in order). Per tile:
//  1. load the keys (pass 0: made from the operand; lane passes: the payload, whose lane number
//     is the digit) and count digits into per-warp shared counters (plain shared atomics);
//  2. publish the tile's counts at once ("early counts": successors' look-backs need not wait
//     for this tile's ranking), scan them into the tile's digit starts, and turn the per-warp
//     counts into each warp's first rank per digit;
//  3. rank: per round, the lanes of equal digits found by a warp match (__match_any_sync, or
//     MATCH=1: an atomicOr of lane bits into per-warp shared masks), their leader advancing
//     the warp's counter by the group size with one shared atomic; the rank is the key's final
//     position in the digit-sorted tile;
//  4. stage the keys through shared memory in tile order while threads 0..255 look back for
//     their digit's exclusive prefix over earlier tiles (one word per step, no sleep);
//  5. write out coalesced (consecutive threads, consecutive positions of one digit run); then,
//     with a payload, stage and write the payload (or, on a lane pass, the keys) the same way.
// The first pass reads the operand itself (keys made on the fly, payload = element index) and,
// when lanes are contiguous and every element is output, the last pass writes the outputs.

#define ST_AGG 1u
#define ST_PREFIX 2u
#define ST_COUNT_MASK 0x3fffffffu
#define SPIN_LIMIT (1u << 24)

__device__ __forceinline__ u32 ld_volatile(const u32* p) { return *(const volatile u32*)p; }
__device__ __forceinline__ void st_volatile(u32* p, u32 v) { *(volatile u32*)p = v; }

// Digit counts of every pass at once: hist[p * 256 + d]. Key passes first (one per key byte),
// then lane passes (digits of e / n). Reads the operand (keys made on the fly). Plain shared
// atomics (measured faster than warp-aggregated counting on an H100) into `parts` copies of the
// counters: lane l counts into copy l % parts, so that lanes of one warp with equal digits (the
// skewed top byte of floats) mostly hit different words; copies are padded by one word so that
// a digit's words sit in different banks. Loads: 16-byte vectors where the operand is
// contiguous and aligned and there are no lane passes, else one key at a time; several loads
// in flight per thread either way.
#define HIST_WORDS 8200
template <typename K, int KIND>
__device__ __forceinline__ void count_key(u32* mine, K key) {
#pragma unroll
    for (int p = 0; p < (int)sizeof(K); ++p) atomicAdd(&mine[p * RADIX + ((u32)(key >> (8 * p)) & (RADIX - 1))], 1u);
}

template <typename K, int KIND>
__global__ void __launch_bounds__(SORT_BLOCK)
radix_histogram(const K* __restrict__ x, u32 total, i64 n, i64 inner, int flags,
                int key_passes, int lane_passes, int parts, u32* __restrict__ hist) {
    __shared__ u32 cnt[HIST_WORDS];
    const int passes = key_passes + lane_passes;  // key_passes == sizeof(K)
    const int words = passes * RADIX;             // one copy
    parts = max(1, min(parts, HIST_WORDS / (words + 1)));
    for (int i = threadIdx.x; i < parts * (words + 1); i += blockDim.x) cnt[i] = 0;
    __syncthreads();
    u32* mine = cnt + ((threadIdx.x & 31) % parts) * (words + 1);
    constexpr int U = 4;
    const u32 tid = blockIdx.x * blockDim.x + threadIdx.x, nthreads = gridDim.x * blockDim.x;
    if (inner == 1 && lane_passes == 0 && ((unsigned long long)x & 15) == 0) {
        constexpr int V = 16 / sizeof(K);  // keys per vector
        const u32 nvec = total / V;
        const uint4* xv = (const uint4*)x;
        for (u32 base = blockIdx.x * blockDim.x * U; base < nvec; base += nthreads * U) {
            uint4 v[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const u32 i = base + u * blockDim.x + threadIdx.x;
                if (i < nvec) v[u] = xv[i];
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (base + u * blockDim.x + threadIdx.x < nvec) {
                    const K* ks = (const K*)&v[u];
#pragma unroll
                    for (int j = 0; j < V; ++j) count_key<K, KIND>(mine, to_key<K, KIND>(ks[j], flags));
                }
            }
        }
        for (u32 e = nvec * V + tid; e < total; e += nthreads) count_key<K, KIND>(mine, to_key<K, KIND>(x[e], flags));
    } else {
        for (u32 base = blockIdx.x * blockDim.x * U; base < total; base += nthreads * U) {
            K key[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const u32 e = base + u * blockDim.x + threadIdx.x;
                key[u] = e < total ? source_key<K, KIND>(x, e, n, inner, flags) : (K)0;
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const u32 e = base + u * blockDim.x + threadIdx.x;
                if (e < total) {
                    count_key<K, KIND>(mine, key[u]);
                    if (lane_passes) {
                        const u32 lane = (u32)((i64)e / n);
                        for (int p = 0; p < lane_passes; ++p)
                            atomicAdd(&mine[(key_passes + p) * RADIX + ((lane >> (8 * p)) & (RADIX - 1))], 1u);
                    }
                }
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < words; i += blockDim.x) {
        u32 c = 0;
        for (int q = 0; q < parts; ++q) c += cnt[q * (words + 1) + i];
        if (c) atomicAdd(&hist[i], c);
    }
}

// Exclusive prefix of each pass's digit counts, in place. One block of RADIX threads.
__global__ void radix_prefix(u32* __restrict__ hist, int passes) {
    __shared__ u32 wsum[RADIX / 32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    for (int p = 0; p < passes; ++p) {
        const u32 x = hist[p * RADIX + threadIdx.x];
        u32 s = x;
        for (int o = 1; o < 32; o <<= 1) {
            const u32 y = __shfl_up_sync(FULL_MASK, s, o);
            if (lane >= o) s += y;
        }
        if (lane == 31) wsum[w] = s;
        __syncthreads();
        u32 before = 0;
        for (int ww = 0; ww < w; ++ww) before += wsum[ww];
        hist[p * RADIX + threadIdx.x] = before + s - x;
        __syncthreads();
    }
}

// The outputs of one element of the last pass from its payload p at sorted position g.
template <typename K>
__device__ __forceinline__ void emit_payload(K* __restrict__ values, i64* __restrict__ indices,
                                             const K* __restrict__ xv, u32 p, u32 g, i64 n) {
    if (values) values[g] = xv[p];
    if (indices) indices[g] = (i64)p - ((i64)g / n) * n;
}

// One pass. Inputs: kin/pin, or (pass 0) the operand x0 with payload = element index. Outputs:
// kout/pout, or (last pass, when fused) values (from_key, or xv[payload] with a payload) and
// indices (payload - lane * n). goff: this pass's exclusive digit offsets; status: tiles * 256
// words, zeroed; counter: the tile counter, zeroed; error: set if a look-back gave up.
// Launched with THREADS threads (THREADS >= RADIX) and ceil(total / (THREADS * ITEMS)) blocks.
template <typename K, int KIND, bool ROW, bool PAY, int THREADS, int ITEMS, int MATCH>
__global__ void __launch_bounds__(THREADS)
radix_onesweep(const K* __restrict__ kin, const u32* __restrict__ pin, const K* __restrict__ x0,
               K* __restrict__ kout, u32* __restrict__ pout, K* __restrict__ values, i64* __restrict__ indices,
               const K* __restrict__ xv, u32 total, i64 n, i64 inner, int shift, int flags,
               const u32* __restrict__ goff, u32* __restrict__ status, u32* __restrict__ counter,
               u32* __restrict__ error) {
    constexpr int WARPS = THREADS / 32;
    constexpr u32 TILE = THREADS * ITEMS;
    constexpr u32 XBYTES = TILE * (sizeof(K) > 4 ? sizeof(K) : 4);
    constexpr u32 RBYTES = WARPS * RADIX * 4;
    // The staging buffer of the keys / payload, first the per-warp digit counters (ranking).
    __shared__ __align__(16) unsigned char xbuf[XBYTES > RBYTES ? XBYTES : RBYTES];
    __shared__ u32 gofs[RADIX];  // digit d's global position minus its start in the tile
    __shared__ u32 masks[MATCH ? WARPS : 1][RADIX];
    __shared__ u32 wsum[THREADS / 32];
    __shared__ u32 tile_id;
    u32 (*wofs)[RADIX] = (u32 (*)[RADIX])xbuf;
    K* sk = (K*)xbuf;
    u32* sp = (u32*)xbuf;

    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (threadIdx.x == 0) tile_id = atomicAdd(counter, 1u);
    for (u32 i = threadIdx.x; i < WARPS * RADIX; i += THREADS) (&wofs[0][0])[i] = 0;
    if (MATCH)
        for (u32 i = threadIdx.x; i < WARPS * RADIX; i += THREADS) (&masks[0][0])[i] = 0;
    __syncthreads();
    const u32 t = tile_id;
    const u32 tile_begin = t * TILE;
    const u32 count = min(total - tile_begin, TILE);
    const u32 wbase = (u32)w * 32u * ITEMS + (u32)lane;  // tile position of this lane's round 0
    const bool final_out = values != nullptr || indices != nullptr;

    // 1. Digit sources and per-warp counts. Padding (past the end of the last tile) counts as
    //    digit 255 and ranks after every real key of the tile; it is never written.
    //    The loads of a thread are issued back to back (branch-free, predicated) before any use:
    //    behind a per-item branch they were serialised (pass 0 measured 1.8x a later pass).
    K key[ITEMS];
    u32 pay[ITEMS];
    u32 dig[ITEMS];
    if (!ROW) {
        const K* src = x0 ? x0 : kin;
        if (!x0 || inner == 1) {
#pragma unroll
            for (int r = 0; r < ITEMS; ++r) {
                const u32 local = wbase + (u32)r * 32u;
                key[r] = local < count ? src[tile_begin + local] : (K)~(K)0;
            }
            if (x0) {
#pragma unroll
                for (int r = 0; r < ITEMS; ++r)
                    if (wbase + (u32)r * 32u < count) key[r] = to_key<K, KIND>(key[r], flags);
            }
        } else {
#pragma unroll
            for (int r = 0; r < ITEMS; ++r) {
                const u32 local = wbase + (u32)r * 32u;
                key[r] = local < count ? source_key<K, KIND>(x0, tile_begin + local, n, inner, flags) : (K)~(K)0;
            }
        }
#pragma unroll
        for (int r = 0; r < ITEMS; ++r) dig[r] = (u32)(key[r] >> shift) & (RADIX - 1);
    } else {
#pragma unroll
        for (int r = 0; r < ITEMS; ++r) {
            const u32 local = wbase + (u32)r * 32u;
            pay[r] = local < count ? pin[tile_begin + local] : 0xffffffffu;
        }
#pragma unroll
        for (int r = 0; r < ITEMS; ++r)
            dig[r] = pay[r] != 0xffffffffu ? ((pay[r] / (u32)n) >> shift) & (RADIX - 1) : RADIX - 1;
    }
#pragma unroll
    for (int r = 0; r < ITEMS; ++r) atomicAdd(&wofs[w][dig[r]], 1u);
    __syncthreads();

    // 2. Early counts; the tile's digit starts; each warp's first rank per digit.
    const u32 d = threadIdx.x;
    u32 tile_cnt = 0;
    if (d < RADIX) {
        u32 run = 0;
#pragma unroll
        for (int ww = 0; ww < WARPS; ++ww) { const u32 c = wofs[ww][d]; wofs[ww][d] = run; run += c; }
        tile_cnt = run;
        st_volatile(status + (size_t)t * RADIX + d, ((t == 0 ? ST_PREFIX : ST_AGG) << 30) | tile_cnt);
    }
    u32 s = tile_cnt;
    for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(FULL_MASK, s, o);
        if (lane >= o) s += y;
    }
    if (lane == 31) wsum[w] = s;
    __syncthreads();
    u32 tstart = 0;
    if (d < RADIX) {
        for (int ww = 0; ww < w; ++ww) tstart += wsum[ww];
        tstart += s - tile_cnt;
#pragma unroll
        for (int ww = 0; ww < WARPS; ++ww) wofs[ww][d] += tstart;
    }
    __syncthreads();

    // 3. Ranks: final positions in the digit-sorted tile.
    u32 rank[ITEMS];
    const u32 lanemask_le = (2u << lane) - 1u;  // lane 31: 0 - 1 = all ones
#pragma unroll
    for (int r = 0; r < ITEMS; ++r) {
        const u32 dd = dig[r];
        u32 peers;
        if (MATCH) {
            atomicOr(&masks[w][dd], 1u << lane);
            __syncwarp();
            peers = masks[w][dd];
        } else {
            peers = __match_any_sync(FULL_MASK, dd);
        }
        const int leader = 31 - __clz(peers);
        const u32 below = __popc(peers & lanemask_le);
        u32 o = 0;
        if (lane == leader) o = atomicAdd(&wofs[w][dd], below);  // below == group size here
        o = __shfl_sync(FULL_MASK, o, leader);
        if (MATCH) {
            if (lane == leader) masks[w][dd] = 0;
            __syncwarp();
        }
        rank[r] = o + below - 1;
    }
    __syncthreads();  // the counters (aliasing the staging buffer) are read

    // 4. Stage the digit sources in tile order; look back for this tile's global offsets.
#pragma unroll
    for (int r = 0; r < ITEMS; ++r) {
        if (!ROW) sk[rank[r]] = key[r];
        else sp[rank[r]] = pay[r];
    }
    if (d < RADIX) {
        u32 excl = 0;
        if (t > 0) {
            int look = (int)t - 1;
            u32 spins = 0;
            while (true) {
                const u32 v = ld_volatile(status + (size_t)look * RADIX + d);
                const u32 f = v >> 30;
                if (f == 0) {
                    if (++spins > SPIN_LIMIT) { atomicExch(error, 1u); break; }
                    continue;
                }
                excl += v & ST_COUNT_MASK;
                if (f == ST_PREFIX) break;
                --look;
            }
            st_volatile(status + (size_t)t * RADIX + d, (ST_PREFIX << 30) | (excl + tile_cnt));
        }
        gofs[d] = goff[d] + excl - tstart;
    }
    __syncthreads();

    // 5. Coalesced write-out.
    u32 gpos[ITEMS];
#pragma unroll
    for (int r = 0; r < ITEMS; ++r) {
        const u32 idx = threadIdx.x + (u32)r * THREADS;
        gpos[r] = 0;
        if (idx < count) {
            if (!ROW) {
                const K k = sk[idx];
                const u32 g = gofs[(u32)(k >> shift) & (RADIX - 1)] + idx;
                gpos[r] = g;
                if (!final_out) kout[g] = k;
                else if (!PAY && values) values[g] = from_key<K, KIND>(k, flags);
            } else {
                const u32 p = sp[idx];
                const u32 g = gofs[((p / (u32)n) >> shift) & (RADIX - 1)] + idx;
                gpos[r] = g;
                if (!final_out) pout[g] = p;
                else emit_payload<K>(values, indices, xv, p, g, n);
            }
        }
    }
    if (PAY && (!ROW || !final_out)) {
        // The payload (key passes) or the keys (lane passes), through the same ranks.
#pragma unroll
        for (int r = 0; r < ITEMS; ++r) {
            const u32 local = wbase + (u32)r * 32u;
            const u32 e = tile_begin + local;
            if (!ROW) pay[r] = x0 ? e : (local < count ? pin[e] : 0u);
            else key[r] = local < count ? kin[e] : (K)0;
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < ITEMS; ++r) {
            if (!ROW) sp[rank[r]] = pay[r];
            else sk[rank[r]] = key[r];
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < ITEMS; ++r) {
            const u32 idx = threadIdx.x + (u32)r * THREADS;
            if (idx < count) {
                if (!ROW) {
                    const u32 p = sp[idx];
                    if (!final_out) pout[gpos[r]] = p;
                    else emit_payload<K>(values, indices, xv, p, gpos[r], n);
                } else {
                    kout[gpos[r]] = sk[idx];
                }
            }
        }
    }
}
