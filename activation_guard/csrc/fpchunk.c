/* One fused pass over a chunk of a fingerprinted tensor: statistics and CountSketch routing.
 *
 * The torch path (sketch.py) takes ~13 passes over every element (a float64 copy, min/max, three
 * sums, then per sketch row a signed copy and an index_add_ of 64-element slices); this reads each
 * block of B elements once, keeps it in L1 and does all of that on it. The hashes (signs w and
 * routes) still come from sketch.py, so both paths route every element to the same bucket with
 * the same sign, and the routed sums are added in the same order as index_add_ adds them: the
 * routing matrix is bit-identical to the torch path's. The chunk statistics are summed in eight
 * lanes (another order than torch's, within the same rounding depth: sketch.py's depth bound).
 *
 * Built at run time by native.py with the system C compiler (-O3 -ffp-contract=off: no fused
 * multiply-add, so every build computes the same bits); nothing here calls back into Python, and
 * ctypes releases the GIL around the call, so a fingerprint worker thread runs beside the forward.
 */
#include <math.h>
#include <stdint.h>

#define LANES 8

/* Where the compiler can dispatch at load time (GCC or clang on x86-64 Linux), an AVX2 clone
 * beside the baseline one; without contraction both compute the same bits. */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(AG_NO_CLONES)
#define AG_CLONES __attribute__((target_clones(AG_TARGETS)))
#else
#define AG_CLONES
#endif
#ifndef AG_TARGETS
#define AG_TARGETS "avx2", "default"
#endif

#define DEFINE_CHUNK(NAME, T)                                                                         \
    AG_CLONES void NAME(const T *restrict x, int64_t n, int64_t rows, int64_t B, const double *restrict w,       \
              int64_t w_stride, const int64_t *restrict route, int64_t route_stride,                   \
              double *restrict routed, double *restrict stats) {                                       \
        double s[LANES] = {0}, a[LANES] = {0}, q[LANES] = {0};                                         \
        double lo[LANES], hi[LANES];                                                                   \
        for (int l = 0; l < LANES; l++) { lo[l] = INFINITY; hi[l] = -INFINITY; }                       \
        double buf[4096];                                                                              \
        int64_t K = (n + B - 1) / B;                                                                   \
        for (int64_t k = 0; k < K; k++) {                                                              \
            const T *xb = x + k * B;                                                                   \
            int64_t m = (k + 1) * B <= n ? B : n - k * B;                                              \
            for (int64_t j = 0; j < m; j++) buf[j] = (double)xb[j];                                    \
            int64_t j = 0;                                                                             \
            for (; j + LANES <= m; j += LANES) {                                                       \
                for (int l = 0; l < LANES; l++) {                                                      \
                    double v = buf[j + l];                                                             \
                    s[l] += v; a[l] += fabs(v); q[l] += v * v;                                         \
                    lo[l] = v < lo[l] ? v : lo[l]; hi[l] = v > hi[l] ? v : hi[l];                      \
                }                                                                                      \
            }                                                                                          \
            for (int l = 0; j < m; j++, l++) {                                                         \
                double v = buf[j];                                                                     \
                s[l] += v; a[l] += fabs(v); q[l] += v * v;                                             \
                lo[l] = v < lo[l] ? v : lo[l]; hi[l] = v > hi[l] ? v : hi[l];                          \
            }                                                                                          \
            for (int64_t r = 0; r < rows; r++) {                                                       \
                double *restrict dst = routed + route[r * route_stride + k] * B;                       \
                const double *restrict sg = w + r * w_stride + k;                                      \
                for (int64_t jj = 0; jj < m; jj++) dst[jj] += buf[jj] * sg[jj];                        \
            }                                                                                          \
        }                                                                                              \
        double ts = 0, ta = 0, tq = 0, tlo = INFINITY, thi = -INFINITY;                               \
        for (int l = 0; l < LANES; l++) {                                                              \
            ts += s[l]; ta += a[l]; tq += q[l];                                                        \
            tlo = lo[l] < tlo ? lo[l] : tlo; thi = hi[l] > thi ? hi[l] : thi;                          \
        }                                                                                              \
        stats[0] = ts; stats[1] = ta; stats[2] = tq; stats[3] = tlo; stats[4] = thi;                   \
    }

DEFINE_CHUNK(ag_chunk_f32, float)
DEFINE_CHUNK(ag_chunk_f64, double)

/* The build's interface version: native.py refuses a library whose number differs. */
int ag_version(void) { return 1; }
