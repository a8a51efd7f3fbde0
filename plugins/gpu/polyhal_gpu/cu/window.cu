// Sliding-window kernels of conv and the pools (CUDA and HIP). A window map, computed once per
// shape on the host, names the input element every (tap, output position) pair reads: map[tap * L
// + pos] is a flat spatial index into one (image, channel) plane, or -1 where the tap falls in the
// padding. Any number of spatial dims, any strides, dilations and pads.

// im2col into a caller-provided (declared scratch) buffer: cols[(plane * K + tap) * L + pos] for
// `planes` consecutive (image, channel) planes of `x`. W is the element's width (the copy moves
// bits, so float16/32/64 share the 2-, 4- and 8-byte instances; 0 bits are +0.0).
template <typename W>
__global__ void im2col(const W* __restrict__ x, W* __restrict__ cols, const int* __restrict__ map,
                       i64 planes, i64 S, int K, i64 L) {
    const i64 total = planes * K * L, step = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        const i64 pos = i % L, r = i / L;
        const int src = map[(r % K) * L + pos];
        cols[i] = src >= 0 ? x[(r / K) * S + src] : (W)0;
    }
}

template <typename T> __device__ __forceinline__ T lowest();
template <> __device__ __forceinline__ float lowest<float>() { return neg_inf<float>(); }
template <> __device__ __forceinline__ double lowest<double>() { return neg_inf<double>(); }
template <> __device__ __forceinline__ signed char lowest<signed char>() { return -128; }
template <> __device__ __forceinline__ unsigned char lowest<unsigned char>() { return 0; }

// max pool: one thread per output element; taps in the padding never win; nan propagates.
template <typename T>
__global__ void max_pool(const T* __restrict__ x, T* __restrict__ out, const int* __restrict__ map,
                         i64 planes, i64 S, int K, i64 L) {
    const i64 total = planes * L, step = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        const i64 pos = i % L;
        const T* plane = x + (i / L) * S;
        T m = lowest<T>();
        for (int t = 0; t < K; ++t) {
            const int src = map[t * L + pos];
            if (src >= 0) m = nanmax(m, plane[src]);
        }
        out[i] = m;
    }
}

// average pool (P = 0) or Lp pool (P = p): sums in double; avg divides by count[pos] (the taps
// inside the input, or inside the padded input with count_include_pad).
template <typename T>
__global__ void sum_pool(const T* __restrict__ x, T* __restrict__ out, const int* __restrict__ map,
                         const double* __restrict__ count, i64 planes, i64 S, int K, i64 L, double p) {
    const i64 total = planes * L, step = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        const i64 pos = i % L;
        const T* plane = x + (i / L) * S;
        double s = 0.0;
        for (int t = 0; t < K; ++t) {
            const int src = map[t * L + pos];
            if (src < 0) continue;
            const double v = (double)plane[src];
            s += p == 0.0 ? v : pow(fabs(v), p);
        }
        out[i] = (T)(p == 0.0 ? s / count[pos] : pow(s, 1.0 / p));
    }
}
