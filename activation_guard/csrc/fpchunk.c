/* One fused pass over a chunk of a fingerprinted tensor: statistics and CountSketch routing.
 *
 * The torch path (sketch.py) takes ~15 passes over every element (a float64 copy, min/max, three
 * sums, then per sketch row a signed copy and an index_add_ of 64-element slices); this reads each
 * block of B elements once, keeps it in L1 and does all of that on it. The hashes (signs w and
 * routes) still come from sketch.py, so both paths route every element to the same bucket with
 * the same sign, and the routed sums are added in the same order as index_add_ adds them: the
 * routing matrix is bit-identical to the torch path's. The chunk statistics are kept in eight
 * lanes (lane l sums the elements with index l mod 8: another order than torch's, within the same
 * rounding depth, sketch.py's bound), in GNU C vectors of four lanes (AVX2) or two (any other
 * CPU). Each lane is its own chain of additions in a fixed order (block by block; in the last,
 * partial block its scalar tail first), so every build computes the same bits (-ffp-contract=off:
 * no fused multiply-add either).
 *
 * Built at run time by native.py with the system C compiler. Scratch memory comes from the
 * caller (B doubles): no large array on the stack, which a thread with a small stack would not
 * survive. Nothing here calls back into Python, and ctypes releases the GIL around the call, so
 * a fingerprint worker thread runs beside the forward.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 8

/* Vectors at any 8-byte alignment, allowed to alias the doubles they are read from: four lanes
 * for the AVX2 build, two for the baseline (GCC splits a four-lane vector badly without AVX:
 * 6.7 ns per element against 1.3 with AVX2, on a 2-core Xeon). */
typedef double v4 __attribute__((vector_size(32), aligned(8), may_alias));
typedef int64_t v4i __attribute__((vector_size(32), aligned(8), may_alias));
typedef double v2 __attribute__((vector_size(16), aligned(8), may_alias));
typedef int64_t v2i __attribute__((vector_size(16), aligned(8), may_alias));

#if defined(__x86_64__) && defined(__GNUC__) && !defined(AG_NO_AVX2)
#define AG_AVX2 1
#define AVX2_ATTR __attribute__((target("avx2")))
#else
#define AG_AVX2 0
#define AVX2_ATTR
#endif

/* NAME: the function; T: the element type read; V, VI: vector types of W lanes; ATTR: target. */
#define DEFINE_CHUNK(NAME, T, V, VI, W, ATTR)                                                          \
    ATTR void NAME(const T *restrict x, int64_t n, int64_t rows, int64_t B, const double *restrict w, \
                   int64_t w_stride, const int64_t *restrict route, int64_t route_stride,             \
                   double *restrict routed, double *restrict stats, double *restrict buf) {           \
        enum { NV = LANES / W };                                                                       \
        const VI absmask = (VI){0} + INT64_MAX;                                                        \
        V s[NV], a[NV], q[NV], lo[NV], hi[NV];                                                         \
        for (int v = 0; v < NV; v++) {                                                                 \
            s[v] = a[v] = q[v] = (V){0};                                                               \
            lo[v] = (V){0} + INFINITY; hi[v] = (V){0} - INFINITY;                                      \
        }                                                                                              \
        int64_t K = (n + B - 1) / B;                                                                   \
        for (int64_t k = 0; k < K; k++) {                                                              \
            const T *xb = x + k * B;                                                                   \
            int64_t m = (k + 1) * B <= n ? B : n - k * B;                                              \
            int64_t full = m & ~(int64_t)(LANES - 1);                                                  \
            for (int64_t j = 0; j < m; j++) buf[j] = (double)xb[j];                                    \
            for (int64_t j = full; j < m; j += LANES) { /* the last block's tail: scalar, lane by lane */ \
                double sl[LANES], al[LANES], ql[LANES], lol[LANES], hil[LANES];                        \
                memcpy(sl, s, sizeof sl); memcpy(al, a, sizeof al); memcpy(ql, q, sizeof ql);          \
                memcpy(lol, lo, sizeof lol); memcpy(hil, hi, sizeof hil);                              \
                for (int l = 0; l < m - full; l++) {                                                   \
                    double u = buf[full + l];                                                          \
                    sl[l] += u; al[l] += fabs(u); ql[l] += u * u;                                      \
                    lol[l] = u < lol[l] ? u : lol[l]; hil[l] = u > hil[l] ? u : hil[l];                \
                }                                                                                      \
                memcpy(s, sl, sizeof sl); memcpy(a, al, sizeof al); memcpy(q, ql, sizeof ql);          \
                memcpy(lo, lol, sizeof lol); memcpy(hi, hil, sizeof hil);                              \
            }                                                                                          \
            for (int64_t j = 0; j < full; j += LANES) {                                                \
                for (int v = 0; v < NV; v++) {                                                         \
                    V u = *(const V *)(buf + j + v * W);                                               \
                    VI lt = u < lo[v], gt = u > hi[v]; /* a NaN never replaces: it shows in the sum */ \
                    s[v] += u; a[v] += (V)((VI)u & absmask); q[v] += u * u;                            \
                    lo[v] = (V)(((VI)u & lt) | ((VI)lo[v] & ~lt));                                     \
                    hi[v] = (V)(((VI)u & gt) | ((VI)hi[v] & ~gt));                                     \
                }                                                                                      \
            }                                                                                          \
            for (int64_t r = 0; r < rows; r++) {                                                       \
                double *restrict dst = routed + route[r * route_stride + k] * B;                       \
                const double *restrict sg = w + r * w_stride + k;                                      \
                int64_t j = 0;                                                                         \
                for (; j < full; j += W) *(V *)(dst + j) += *(const V *)(buf + j) * *(const V *)(sg + j); \
                for (; j < m; j++) dst[j] += buf[j] * sg[j];                                           \
            }                                                                                          \
        }                                                                                              \
        double sl[LANES], al[LANES], ql[LANES], lol[LANES], hil[LANES];                                \
        memcpy(sl, s, sizeof sl); memcpy(al, a, sizeof al); memcpy(ql, q, sizeof ql);                  \
        memcpy(lol, lo, sizeof lol); memcpy(hil, hi, sizeof hil);                                      \
        double ts = 0, ta = 0, tq = 0, tlo = INFINITY, thi = -INFINITY;                               \
        for (int l = 0; l < LANES; l++) {                                                              \
            ts += sl[l]; ta += al[l]; tq += ql[l];                                                     \
            tlo = lol[l] < tlo ? lol[l] : tlo; thi = hil[l] > thi ? hil[l] : thi;                      \
        }                                                                                              \
        stats[0] = ts; stats[1] = ta; stats[2] = tq; stats[3] = tlo; stats[4] = thi;                   \
    }

DEFINE_CHUNK(ag_chunk_f32, float, v2, v2i, 2, )
DEFINE_CHUNK(ag_chunk_f64, double, v2, v2i, 2, )
#if AG_AVX2
DEFINE_CHUNK(ag_chunk_f32_avx2, float, v4, v4i, 4, AVX2_ATTR)
DEFINE_CHUNK(ag_chunk_f64_avx2, double, v4, v4i, 4, AVX2_ATTR)
#endif

/* sketch.py's fold in one pass: bucket b of row r gets
 *   total[r][b] += sum over m = 0..B-1, in that order, of (P[r][m][b ^ m] - N[r][m][b ^ m]) * u[r][b ^ m]
 * where P and N are the two halves of routed[r][m] (blocks with sign bit v = 0 and 1); then routed
 * is zeroed for the next window. The same operations in the same order as the torch fold (a
 * subtraction, a multiply, then a sum over m): the same bits. */
void ag_fold(int64_t rows, int64_t B, double *restrict routed, const double *restrict u, double *restrict total,
             double *restrict acc) {
    for (int64_t r = 0; r < rows; r++) {
        const double *ur = u + r * B;
        for (int64_t b = 0; b < B; b++) acc[b] = 0.0;
        for (int64_t m = 0; m < B; m++) {
            double *pos = routed + ((r * B + m) * 2) * B, *neg = pos + B;
            for (int64_t b = 0; b < B; b++) {
                int64_t j = b ^ m;
                acc[b] += (pos[j] - neg[j]) * ur[j];
            }
            memset(pos, 0, (size_t)(2 * B) * sizeof(double)); /* zeroed while it is in L1 */
        }
        for (int64_t b = 0; b < B; b++) total[r * B + b] += acc[b];
    }
}

/* Whether this CPU runs the AVX2 functions (native.py then picks them; both compute the same bits). */
int ag_avx2(void) {
#if AG_AVX2
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? 1 : 0;
#else
    return 0;
#endif
}

/* The build's interface version: native.py refuses a library whose number differs. */
int ag_version(void) { return 4; }
