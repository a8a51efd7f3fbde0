// Elementwise kernels of polyhal-hip: one generated instance per (op, element types), by macros
// that polyhal_hip/elementwise.py defines before this text:
//
//   NIN          number of inputs (1..3)
//   T0, T1, T2   input element types; TOUT the output's
//   C0, C1, C2   compute types of the inputs (float for float16, else the type itself)
//   CO           compute type of the output
//   EXPR(a,b,c)  the output value from the converted inputs a, b, c (an expression; may use
//                polyhal_ct<T> and the helpers below); or BODY, statements that read in0, in1,
//                in2 and set polyhal_out (polyhal-cuda's elementwise snippets become BODYs)
//
// The output is dense row-major; each input is read through its own element strides over the
// output's shape (0 for broadcast dimensions) plus an element offset, so the same kernel also
// runs transpose, slice, expand and strided copies (EXPR(a,b,c) = a).

#define MAX_DIMS 8
struct Dims {
    long long shape[MAX_DIMS];
    long long s0[MAX_DIMS];
    long long s1[MAX_DIMS];
    long long s2[MAX_DIMS];
    long long off[MAX_DIMS];  // off[0..2]: element offsets of the inputs
};

// polyhal_ct<T> (compute type) and polyhal_minus_one come with polyhal-cuda's elementwise preamble,
// which elementwise.py puts before this text.

template <typename T> __device__ __forceinline__ T polyhal_ipow(T x, T y) {
    if (y < (T)0) return (x == (T)1) ? (T)1 : ((x == (T)(-1)) ? ((y & (T)1) ? (T)(-1) : (T)1) : (T)0);
    T r = (T)1;
    while (y) { if (y & (T)1) r = (T)(r * x); x = (T)(x * x); y = (T)(y >> 1); }
    return r;
}
template <typename T> __device__ __forceinline__ T polyhal_max(T a, T b) { return (a != a) ? a : ((b != b) ? b : (a > b ? a : b)); }
template <typename T> __device__ __forceinline__ T polyhal_min(T a, T b) { return (a != a) ? a : ((b != b) ? b : (a < b ? a : b)); }

#ifndef T1
#define T1 T0
#define C1 C0
#endif
#ifndef T2
#define T2 T0
#define C2 C0
#endif

extern "C" __global__ void polyhal_elementwise(const T0* __restrict__ x0, const T1* __restrict__ x1,
                                               const T2* __restrict__ x2, TOUT* __restrict__ out,
                                               long long n, int ndim, Dims d) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long r = i, o0 = d.off[0], o1 = d.off[1], o2 = d.off[2];
        for (int k = ndim - 1; k >= 0; --k) {
            const long long e = d.shape[k];
            const long long c = r % e;
            r /= e;
            o0 += c * d.s0[k];
            o1 += c * d.s1[k];
            o2 += c * d.s2[k];
        }
        const C0 in0 = (C0)x0[o0];
#if NIN >= 2
        const C1 in1 = (C1)x1[o1];
#else
        const C1 in1 = (C1)0;
#endif
#if NIN >= 3
        const C2 in2 = (C2)x2[o2];
#else
        const C2 in2 = (C2)0;
#endif
#ifdef BODY
        TOUT polyhal_out;
        { BODY; }
        out[i] = polyhal_out;
#else
        out[i] = (TOUT)(EXPR(in0, in1, in2));
#endif
        (void)in1; (void)in2;
    }
}
