// Greedy non-maximum suppression, for many independent problems at once (ONNX: one problem per
// (batch, class); torchvision: one problem). Boxes are first put in decreasing-score order
// (argsort by sort.cu), then:
//
//  nms_boxes   corners of every box in score order, and whether it is a candidate;
//  nms_mask    for every pair (i, j > i) of one problem, whether box i suppresses box j: one
//              bit per pair, 64 per word, rows of W = ceil(n / 64) words (torchvision's
//              layout; only words at or right of the diagonal are written and read);
//  nms_reduce  one block per problem walks the boxes in blocks of 64: warp 0 resolves the 64
//              boxes of a block against each other (the diagonal word, bit by bit, in
//              registers) and ORs the kept boxes' masks into the next word, while the other
//              warps OR the previous block's kept masks into the "removed" bits of the later
//              words. The removed bits (W words) are the kernel's scratch: shared memory when
//              it fits, a global slice per problem otherwise.
//  nms_write   ONNX's output rows (batch, class, box), problems in order, padded with -1.
//
// Modes: 0 = ONNX corners [y1, x1, y2, x2] (any two diagonal corners), 1 = ONNX centers
// [xc, yc, w, h], 2 = torchvision [x1, y1, x2, y2]. ONNX IoU is onnxruntime's, rounded op by op
// in float32 (the _rn intrinsics forbid FMA contraction, so the bits match the reference);
// torchvision's IoU is torchvision's own expression.

#define NMS_WORD 64

struct Box { float x1, y1, x2, y2; };

__device__ __forceinline__ bool onnx_suppresses(const Box a, const Box b, float thr) {
    const float ix1 = fmaxf(a.x1, b.x1), ix2 = fminf(a.x2, b.x2);
    const float iy1 = fmaxf(a.y1, b.y1), iy2 = fminf(a.y2, b.y2);
    if (!(ix2 > ix1) || !(iy2 > iy1)) return false;  // also false for nan
    const float inter = __fmul_rn(__fsub_rn(ix2, ix1), __fsub_rn(iy2, iy1));
    const float area_a = __fmul_rn(__fsub_rn(a.x2, a.x1), __fsub_rn(a.y2, a.y1));
    const float area_b = __fmul_rn(__fsub_rn(b.x2, b.x1), __fsub_rn(b.y2, b.y1));
    if (!(inter > 0.0f) || !(area_a > 0.0f) || !(area_b > 0.0f)) return false;
    const float uni = __fsub_rn(__fadd_rn(area_a, area_b), inter);
    if (!(uni > 0.0f)) return false;
    return __fdiv_rn(inter, uni) > thr;
}

__device__ __forceinline__ bool torchvision_suppresses(const Box a, const Box b, float thr) {
    const float left = fmaxf(a.x1, b.x1), right = fminf(a.x2, b.x2);
    const float top = fmaxf(a.y1, b.y1), bottom = fminf(a.y2, b.y2);
    const float width = fmaxf(right - left, 0.0f), height = fmaxf(bottom - top, 0.0f);
    const float inter = width * height;
    const float sa = (a.x2 - a.x1) * (a.y2 - a.y1);
    const float sb = (b.x2 - b.x1) * (b.y2 - b.y1);
    const float uni = sa + sb - inter;
    // Most pairs do not overlap: skip the division there. 0 / uni is 0 (> thr iff 0 > thr)
    // unless uni is 0 or nan, where the quotient is nan (never > thr) -- the same answer.
    if (inter == 0.0f) return uni != 0.0f && uni == uni && 0.0f > thr;
    return (inter / uni) > thr;
}

// boxes: [B, N, 4] (ONNX) or [N, 4] (torchvision, B = 1); scores: [B, C, N]; order: per
// problem p = b * C + c, the N box indices by decreasing score. sorted[p * N + i] gets box
// order[...]'s corners, valid the candidate flag (score not nan, above the threshold if any).
extern "C" __global__ void nms_boxes(const float* __restrict__ boxes, const float* __restrict__ scores,
                                     const long long* __restrict__ order, Box* __restrict__ sorted,
                                     unsigned char* __restrict__ valid, long long problems, int classes, int n,
                                     int mode, int has_threshold, float threshold) {
    const long long total = problems * (long long)n;
    for (long long q = (long long)blockIdx.x * blockDim.x + threadIdx.x; q < total;
         q += (long long)gridDim.x * blockDim.x) {
        const long long p = q / n;
        const long long b = p / classes;
        const long long j = order[q];
        const float* bx = boxes + (b * n + j) * 4;
        const float s = scores[p * n + j];
        Box o;
        if (mode == 1) {
            const float hw = bx[2] / 2.0f, hh = bx[3] / 2.0f;
            o.x1 = bx[0] - hw; o.y1 = bx[1] - hh; o.x2 = bx[0] + hw; o.y2 = bx[1] + hh;
        } else if (mode == 0) {
            const float y1 = bx[0], x1 = bx[1], y2 = bx[2], x2 = bx[3];
            const bool sx = x1 >= x2, sy = y1 >= y2;  // onnxruntime's MaxMin: a nan stays in place
            o.x1 = sx ? x2 : x1; o.x2 = sx ? x1 : x2; o.y1 = sy ? y2 : y1; o.y2 = sy ? y1 : y2;
        } else {
            o.x1 = bx[0]; o.y1 = bx[1]; o.x2 = bx[2]; o.y2 = bx[3];
        }
        sorted[q] = o;
        valid[q] = (unsigned char)(s == s && (!has_threshold || s > threshold));
    }
}

// grid (W, W, problems), 64 threads: block (cb, rb) compares boxes of row block rb with those
// of column block cb >= rb.
extern "C" __global__ void nms_mask(const Box* __restrict__ sorted, int n, int words, int mode, float thr,
                                    unsigned long long* __restrict__ mask) {
    const int rb = blockIdx.y, cb = blockIdx.x;
    if (rb > cb) return;
    const long long p = blockIdx.z;
    const Box* pb = sorted + p * (long long)n;
    const int rows = min(n - rb * NMS_WORD, NMS_WORD), cols = min(n - cb * NMS_WORD, NMS_WORD);
    __shared__ Box col[NMS_WORD];
    if ((int)threadIdx.x < cols) col[threadIdx.x] = pb[cb * NMS_WORD + threadIdx.x];
    __syncthreads();
    if ((int)threadIdx.x < rows) {
        const int i = rb * NMS_WORD + threadIdx.x;
        const Box a = pb[i];
        unsigned long long bits = 0;
        const int start = (rb == cb) ? (int)threadIdx.x + 1 : 0;
        if (mode == 2) {
            for (int c = start; c < cols; ++c) if (torchvision_suppresses(a, col[c], thr)) bits |= 1ull << c;
        } else {
            for (int c = start; c < cols; ++c) if (onnx_suppresses(a, col[c], thr)) bits |= 1ull << c;
        }
        mask[(p * n + i) * (long long)words + cb] = bits;
    }
}

// One block per problem. keep[p * cap + t] = box index of the t-th selected box (t < counts[p]),
// at most max_out of them. removed: nullptr -> dynamic shared memory of W words, else a global
// slice of W words per problem. blockDim.x >= 64.
//
// The walk is sequential in blocks of 64 boxes; what is on its critical path is kept short.
// Warp 0 resolves block b against itself (the diagonal word) and then ORs the masks of the rows
// it kept into word b + 1 only (a warp reduction), so it can start block b + 1 after one
// barrier. The other warps meanwhile OR the rows kept in block b - 1 into words b + 1 .. W - 1
// (shared-memory atomics, no merge step): word b + 1 then holds every earlier block's
// suppression by the time warp 0 reads it. One __syncthreads per block of 64 boxes.
extern "C" __global__ void nms_reduce(const unsigned long long* __restrict__ mask,
                                      const unsigned char* __restrict__ valid, const long long* __restrict__ order,
                                      int n, int words, long long max_out, long long cap,
                                      unsigned long long* __restrict__ removed_global,
                                      long long* __restrict__ keep, long long* __restrict__ counts) {
    extern __shared__ __align__(16) unsigned long long removed_shared[];
    __shared__ int rows[2][NMS_WORD];  // kept rows of the current / previous block
    __shared__ int nrows[2];
    __shared__ long long count;
    __shared__ int done;
    const long long p = blockIdx.x;
    unsigned long long* removed = removed_global ? removed_global + p * (long long)words : removed_shared;
    const unsigned long long* pm = mask + p * (long long)n * words;
    const unsigned char* pv = valid + p * (long long)n;
    const long long* po = order + p * (long long)n;
    const int lane = threadIdx.x & 31;
    // Boxes that are no candidates start removed: never kept, they suppress nothing.
    for (int w = threadIdx.x; w < words; w += blockDim.x) {
        unsigned long long bits = 0;
        const int base = w * NMS_WORD;
        const int m = min(NMS_WORD, n - base);
        for (int b = 0; b < m; ++b) if (!pv[base + b]) bits |= 1ull << b;
        removed[w] = bits;
    }
    if (threadIdx.x == 0) { count = 0; done = max_out <= 0; nrows[0] = 0; nrows[1] = 0; }
    __syncthreads();
    // Warp 0: the diagonal words of the current block (lane l: rows l and l + 32), loaded one
    // block ahead, and `extra`, the previous block's kept rows ORed at the current word.
    unsigned long long d0 = 0, d1 = 0, extra = 0;
    if (threadIdx.x < 32) {
        if (lane < n) d0 = pm[(long long)lane * words];
        if (lane + 32 < n) d1 = pm[(long long)(lane + 32) * words];
    }
    const int helpers = (int)blockDim.x - 32;
    for (int b = 0; b < words && !done; ++b) {
        const int cur = b & 1, prev = cur ^ 1;
        const int base = b * NMS_WORD;
        if (threadIdx.x < 32) {
            const int m = min(NMS_WORD, n - base);
            unsigned long long rem = removed[b] | extra;
            unsigned long long kept = 0;
            const long long c = count;
            const long long room = max_out - c;
            int taken = 0;
            // (the shuffles do not depend on the removed bits: unrolled, they are issued ahead)
#pragma unroll 8
            for (int i = 0; i < m; ++i) {
                const unsigned long long di = __shfl_sync(FULL_MASK, i < 32 ? d0 : d1, i & 31);
                if (!((rem >> i) & 1ull) && taken < room) { kept |= 1ull << i; rem |= di; ++taken; }
            }
            // compact the kept rows, in order
            for (int half = 0; half < 2; ++half) {
                const int i = lane + 32 * half;
                if ((kept >> i) & 1ull) {
                    const int pos = __popcll(kept & ((1ull << i) - 1ull));
                    rows[cur][pos] = base + i;
                    keep[p * cap + c + pos] = po[base + i];
                }
            }
            __syncwarp();
            extra = 0;
            if (b + 1 < words) {
                // the next diagonal block, and this block's kept rows at word b + 1, loaded together
                const int nb = (b + 1) * NMS_WORD;
                d0 = (nb + lane < n) ? pm[(long long)(nb + lane) * words + b + 1] : 0ull;
                d1 = (nb + lane + 32 < n) ? pm[(long long)(nb + lane + 32) * words + b + 1] : 0ull;
                unsigned long long e = 0;
                if (lane < taken) e = pm[(long long)rows[cur][lane] * words + b + 1];
                if (lane + 32 < taken) e |= pm[(long long)rows[cur][lane + 32] * words + b + 1];
                for (int o = 16; o > 0; o >>= 1) e |= __shfl_xor_sync(FULL_MASK, e, o);
                extra = e;
            }
            if (lane == 0) {
                nrows[cur] = taken;
                count = c + taken;
                if (count >= max_out) done = 1;
            }
        } else if (helpers > 0) {
            // The previous block's kept rows into words b + 1 and later. Helpers are split into R
            // row groups per word (R = helpers / later words, so that short tails keep every
            // thread busy): thread (g, w) ORs rows g, g + R, ... of word w (consecutive threads
            // take consecutive words: coalesced), four loads in flight.
            const int nr = nrows[prev];
            const int nw = words - (b + 1);
            if (nr > 0 && nw > 0) {
                const int R = max(1, min(helpers / nw, nr));
                const int* rp = rows[prev];
                for (int idx = (int)threadIdx.x - 32; idx < nw * R; idx += helpers) {
                    const int g = idx / nw, w = b + 1 + (idx - g * nw);
                    unsigned long long acc = 0;
                    int r = g;
                    for (; r + 3 * R < nr; r += 4 * R) {
                        const unsigned long long m0 = pm[(long long)rp[r] * words + w];
                        const unsigned long long m1 = pm[(long long)rp[r + R] * words + w];
                        const unsigned long long m2 = pm[(long long)rp[r + 2 * R] * words + w];
                        const unsigned long long m3 = pm[(long long)rp[r + 3 * R] * words + w];
                        acc |= m0 | m1 | m2 | m3;
                    }
                    for (; r < nr; r += R) acc |= pm[(long long)rp[r] * words + w];
                    if (acc) atomicOr(&removed[w], acc);
                }
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) counts[p] = count;
}

// ONNX output: rows (batch, class, box) of every problem in order, then -1 rows (the host fills
// selected with -1 first). One block; problems are few (batches * classes).
extern "C" __global__ void nms_write(const long long* __restrict__ keep, const long long* __restrict__ counts,
                                     long long problems, int classes, long long cap,
                                     long long* __restrict__ selected, long long* __restrict__ num_selected) {
    __shared__ long long offset;
    if (threadIdx.x == 0) offset = 0;
    __syncthreads();
    for (long long p = 0; p < problems; ++p) {
        const long long c = counts[p], off = offset;
        for (long long t = threadIdx.x; t < c; t += blockDim.x) {
            long long* row = selected + (off + t) * 3;
            row[0] = p / classes;
            row[1] = p % classes;
            row[2] = keep[p * cap + t];
        }
        __syncthreads();
        if (threadIdx.x == 0) offset = off + c;
        __syncthreads();
    }
    if (threadIdx.x == 0) *num_selected = offset;
}
