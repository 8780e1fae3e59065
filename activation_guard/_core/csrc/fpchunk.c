/* One fused pass over a chunk of a fingerprinted tensor: statistics and CountSketch routing.
 *
 * The torch path (sketch.py) takes ~15 passes over every element (a float64 copy, min/max, three
 * sums, then per sketch row a signed copy and an index_add_ of 64-element slices); this reads each
 * block of B elements once, keeps it in L1 and does all of that on it. The hashes (signs w and
 * routes) still come from sketch.py, so both paths route every element to the same bucket with
 * the same sign, and the routed sums are added in the same order as index_add_ adds them: the
 * routing matrix is bit-identical to the torch path's. The chunk statistics are kept in eight
 * lanes (lane l sums the elements with index l mod 8: another order than torch's, within the same
 * rounding depth, sketch.py's bound), in GNU C vectors of eight lanes (AVX-512), four (AVX2)
 * or two (any other CPU). Each lane is its own chain of additions in a fixed order (block by block;
 * in the last, partial block its scalar tail first), so every build computes the same bits
 * (-ffp-contract=off: no fused multiply-add either). Tests build with -DAG_NO_AVX512,
 * -DAG_NO_AVX2, -DAG_NO_BASELINE and -DAG_NO_CONVERT to compare the builds.
 *
 * Built at install time (setup.py) or, where that library is missing or stale, at run time by
 * native.py with the system C compiler. Scratch memory comes from the
 * caller (B doubles): no large array on the stack, which a thread with a small stack would not
 * survive. Nothing here calls back into Python, and ctypes releases the GIL around the call, so
 * a fingerprint worker thread runs beside the forward.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__) && !defined(AG_NO_STREAM)
#include <emmintrin.h>
#define AG_STREAM 1
#else
#define AG_STREAM 0
#endif

#define LANES 8

/* Vectors at any 8-byte alignment, allowed to alias the doubles they are read from: eight lanes
 * for the AVX-512 build, four for AVX2, two for the baseline (GCC splits a four-lane vector badly
 * without AVX: 6.7 ns per element against 1.3 with AVX2, on a 2-core Xeon). f8, f4, f2: the float
 * vectors of as many lanes, converted to double in registers. */
typedef double v8 __attribute__((vector_size(64), aligned(8), may_alias));
typedef int64_t v8i __attribute__((vector_size(64), aligned(8), may_alias));
typedef float f8 __attribute__((vector_size(32), aligned(4), may_alias));
typedef double v4 __attribute__((vector_size(32), aligned(8), may_alias));
typedef int64_t v4i __attribute__((vector_size(32), aligned(8), may_alias));
typedef float f4 __attribute__((vector_size(16), aligned(4), may_alias));
typedef double v2 __attribute__((vector_size(16), aligned(8), may_alias));
typedef int64_t v2i __attribute__((vector_size(16), aligned(8), may_alias));
typedef float f2 __attribute__((vector_size(8), aligned(4), may_alias));

#if defined(__x86_64__) && defined(__GNUC__) && !defined(AG_NO_AVX2)
#define AG_AVX2 1
#define AVX2_ATTR __attribute__((target("avx2")))
#if !defined(AG_NO_AVX512)
#define AG_AVX512 1
#define AVX512_ATTR __attribute__((target("avx512f")))
#endif
#endif
#ifndef AG_AVX2
#define AG_AVX2 0
#endif
#ifndef AG_AVX512
#define AG_AVX512 0
#endif
/* -DAG_NO_BASELINE (native.py's build at run time, on a CPU with AVX2): no two-lane functions,
 * which could never run there; it halves the build's CPU time. Ignored where AVX2 is left out. */
#if AG_AVX2 && defined(AG_NO_BASELINE)
#define AG_BASELINE 0
#else
#define AG_BASELINE 1
#endif

/* One vector of W values of x at xb + j, as doubles: converted in registers where the compiler has
 * __builtin_convertvector and __has_builtin reports it (GCC 10+, clang), else through buf (the same
 * values either way). */
#if defined(__has_builtin) && !defined(AG_NO_CONVERT)
#if __has_builtin(__builtin_convertvector)
#define AG_CONVERT 1
#endif
#endif
#ifdef AG_CONVERT
#define AG_CONVERT_OK 1
#define LOAD(V, VT, xb, j) __builtin_convertvector(*(const VT *)((xb) + (j)), V)
#else
#define AG_CONVERT_OK 0
#define LOAD(V, VT, xb, j) (*(const V *)(buf + (j)))
#endif

/* The statistics of one vector u into lane vector v (a NaN never replaces a min or max: it shows
 * in the sum). */
#define STATS(V, VI, v, u)                                                                             \
    do {                                                                                               \
        VI lt_ = (u) < lo[v], gt_ = (u) > hi[v];                                                       \
        s[v] += (u); a[v] += (V)((VI)(u) & absmask); q[v] += (u) * (u);                                \
        lo[v] = (V)(((VI)(u) & lt_) | ((VI)lo[v] & ~lt_));                                             \
        hi[v] = (V)(((VI)(u) & gt_) | ((VI)hi[v] & ~gt_));                                             \
    } while (0)

/* Routing: row r's block goes to routed + route[r][k] * B, each element times its sign w[r][k + j].
 * Rows route to disjoint parts of routed (route = row * 2B + ...) and every element of a block to
 * its own slot, so the order of rows and of elements within a block cannot change a bit; only the
 * order of blocks can, and that is k = 0, 1, ... in every path. With the default five rows the
 * rows are routed in the same loop as the statistics, the vector still in registers (a compile-time
 * count keeps the five destinations in registers: 0.71-0.74 ns per element with AVX-512 as built,
 * against 0.91-0.96 row by row); other row counts go row by row from a float64 copy of the block
 * in buf. */
#define FUSED_ROWS 5

/* NAME: the function; T: the element type read; V, VI, VT: vector types of W lanes (double,
 * int64, T); ATTR: target. */
#define DEFINE_CHUNK(NAME, T, V, VI, VT, W, ATTR)                                                      \
    ATTR void NAME(const void *restrict xv, int64_t n, int64_t rows, int64_t B, const double *restrict w, \
                   int64_t w_stride, const int64_t *restrict route, int64_t route_stride,             \
                   double *restrict routed, double *restrict stats, double *restrict buf) {           \
        const T *restrict x = (const T *)xv;                                                           \
        enum { NV = LANES / W };                                                                       \
        const VI absmask = (VI){0} + INT64_MAX;                                                        \
        V s[NV], a[NV], q[NV], lo[NV], hi[NV];                                                         \
        for (int v = 0; v < NV; v++) {                                                                 \
            s[v] = a[v] = q[v] = (V){0};                                                               \
            lo[v] = (V){0} + INFINITY; hi[v] = (V){0} - INFINITY;                                      \
        }                                                                                              \
        const int fused = rows == FUSED_ROWS;                                                          \
        int64_t K = (n + B - 1) / B;                                                                   \
        for (int64_t k = 0; k < K; k++) {                                                              \
            const T *xb = x + k * B;                                                                   \
            int64_t m = (k + 1) * B <= n ? B : n - k * B;                                              \
            int64_t full = m & ~(int64_t)(LANES - 1);                                                  \
            int64_t from = fused && AG_CONVERT_OK ? full : 0; /* what buf must hold */                 \
            for (int64_t j = from; j < m; j++) buf[j] = (double)xb[j];                                 \
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
            if (fused) {                                                                               \
                double *restrict d[FUSED_ROWS];                                                        \
                const double *restrict g[FUSED_ROWS];                                                  \
                for (int r = 0; r < FUSED_ROWS; r++) {                                                 \
                    d[r] = routed + route[r * route_stride + k] * B;                                   \
                    g[r] = w + r * w_stride + k;                                                       \
                }                                                                                      \
                for (int64_t j = 0; j < full; j += LANES) {                                            \
                    for (int v = 0; v < NV; v++) {                                                     \
                        V u = LOAD(V, VT, xb, j + v * W);                                              \
                        STATS(V, VI, v, u);                                                            \
                        for (int r = 0; r < FUSED_ROWS; r++)                                           \
                            *(V *)(d[r] + j + v * W) += u * *(const V *)(g[r] + j + v * W);            \
                    }                                                                                  \
                }                                                                                      \
                for (int r = 0; r < FUSED_ROWS; r++)                                                   \
                    for (int64_t j = full; j < m; j++) d[r][j] += buf[j] * g[r][j];                    \
                continue;                                                                              \
            }                                                                                          \
            for (int64_t j = 0; j < full; j += LANES) {                                                \
                for (int v = 0; v < NV; v++) {                                                         \
                    V u = *(const V *)(buf + j + v * W);                                               \
                    STATS(V, VI, v, u);                                                                \
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

#if AG_BASELINE
DEFINE_CHUNK(ag_chunk_f32, float, v2, v2i, f2, 2, )
DEFINE_CHUNK(ag_chunk_f64, double, v2, v2i, v2, 2, )
#endif
#if AG_AVX2
DEFINE_CHUNK(ag_chunk_f32_avx2, float, v4, v4i, f4, 4, AVX2_ATTR)
DEFINE_CHUNK(ag_chunk_f64_avx2, double, v4, v4i, v4, 4, AVX2_ATTR)
#endif
#if AG_AVX512
DEFINE_CHUNK(ag_chunk_f32_avx512, float, v8, v8i, f8, 8, AVX512_ATTR)
DEFINE_CHUNK(ag_chunk_f64_avx512, double, v8, v8i, v8, 8, AVX512_ATTR)
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

/* A whole contiguous leaf in one call (sketch.py's run_kernel on the compiled path, without a
 * Python round trip per chunk; fingerprint_plan.py prepares the arguments once per layout): chunks
 * of `chunk` elements in order, each through the chunk function of this build's width `simd`
 * (2 AVX-512, 1 AVX2, 0 baseline; the same bits), with its window of the leaf's hash tables (block
 * k of the leaf: w[r][k + j], route[r][k]); the fold rule of sketch.py's _Sketcher._reserve (fold
 * first when a chunk's blocks would take the window past `flush`, and once at the end); the chunk
 * statistics added in chunk order as sketch.py adds them.
 *
 * out, in float64 slots: [0, 5) sum, |x|, x^2, min, max; [5, 7) int64: folds, the widest window in
 * blocks; [7, 7 + npos) int64: the raw bits of x at pos[i], sign-extended (numpy's astype(int64) of
 * the int32 or int64 view); then rows x B: the folded sketch. */
typedef void (*chunk_fn)(const void *, int64_t, int64_t, int64_t, const double *, int64_t, const int64_t *, int64_t,
                         double *, double *, double *);

static chunk_fn pick(int simd, int f64) {
#if AG_AVX512
    if (simd >= 2) return f64 ? ag_chunk_f64_avx512 : ag_chunk_f32_avx512;
#endif
#if AG_AVX2 && AG_BASELINE
    if (simd >= 1) return f64 ? ag_chunk_f64_avx2 : ag_chunk_f32_avx2;
#elif AG_AVX2
    (void)simd; /* native.py never uses a build whose ag_simd() is negative */
    return f64 ? ag_chunk_f64_avx2 : ag_chunk_f32_avx2;
#endif
#if AG_BASELINE
    (void)simd;
    return f64 ? ag_chunk_f64 : ag_chunk_f32;
#endif
}

void ag_leaf(int64_t simd, int64_t f64, const void *x, int64_t n, int64_t chunk, int64_t flush, int64_t rows,
             int64_t B, const double *w, int64_t w_stride, const int64_t *route, int64_t route_stride,
             double *routed, const double *u, double *buf, const int64_t *pos, int64_t npos, double *out) {
    chunk_fn fn = pick((int)simd, (int)f64);
    const char *base = (const char *)x;
    int64_t size = f64 ? 8 : 4;
    int64_t *info = (int64_t *)(out + 5), *picked = (int64_t *)(out + 7);
    double *total = out + 7 + npos;
    double ts = 0, ta = 0, tq = 0, lo = INFINITY, hi = -INFINITY, cs[5];
    int64_t window = 0, widest = 0, folds = 0;
    memset(total, 0, (size_t)(rows * B) * sizeof(double));
    for (int64_t off = 0; off < n; off += chunk) {
        int64_t m = n - off < chunk ? n - off : chunk;
        int64_t K = (m + B - 1) / B;
        if (window && window + K > flush) {
            ag_fold(rows, B, routed, u, total, buf);
            window = 0;
            folds++;
        }
        window += K;
        widest = window > widest ? window : widest;
        fn(base + off * size, m, rows, B, w + off / B, w_stride, route + off / B, route_stride, routed, cs, buf);
        ts += cs[0]; ta += cs[1]; tq += cs[2];
        lo = cs[3] < lo ? cs[3] : lo;
        hi = cs[4] > hi ? cs[4] : hi;
    }
    if (window) {
        ag_fold(rows, B, routed, u, total, buf);
        folds++;
    }
    out[0] = ts; out[1] = ta; out[2] = tq; out[3] = lo; out[4] = hi;
    info[0] = folds; info[1] = widest;
    for (int64_t i = 0; i < npos; i++) { /* memcpy: the bits, whatever type the memory holds */
        if (f64) {
            memcpy(&picked[i], base + pos[i] * 8, 8);
        } else {
            int32_t v;
            memcpy(&v, base + pos[i] * 4, 4);
            picked[i] = v;
        }
    }
}

/* A noise floor's numbers for x - ref (calibration): out[0] = max |x - ref|, out[1] = the sum of
 * (x - ref)^2, out[2] = the sum of ref^2, all in float64 (x, ref: float32 or float64, as xf64/rf64
 * say; ref NULL: zeros, out[1] the sum of squares of x). One pass instead of torch's four (a float64
 * difference, its min and max, its square, its sum) and one more for the reference's RMS. Lane l
 * sums the elements whose index is l mod 8, in index order, and the lanes are added 0..7 at the
 * end: every build (baseline or AVX2) computes the same bits, another order than torch's sum
 * (within the same rounding depth). A NaN or infinite difference, or a sum that overflows, shows
 * as a non-finite result: the caller then takes torch's masked path, which defines those cases. */
#define DEFINE_DIFF(NAME, ATTR)                                                                        \
    ATTR static void NAME(int64_t xf64, int64_t rf64, const void *x, const void *ref, int64_t n,       \
                          double *out) {                                                               \
        double m[LANES] = {0}, s[LANES] = {0}, q[LANES] = {0};                                         \
        const float *xs = x, *rs = ref;                                                                \
        const double *xd = x, *rd = ref;                                                               \
        int64_t i = 0;                                                                                 \
        for (; i + LANES <= n; i += LANES) {                                                           \
            for (int l = 0; l < LANES; l++) {                                                          \
                double a = xf64 ? xd[i + l] : (double)xs[i + l];                                       \
                double b = ref == 0 ? 0.0 : rf64 ? rd[i + l] : (double)rs[i + l];                      \
                double d = a - b;                                                                      \
                double ad = fabs(d);                                                                   \
                m[l] = ad > m[l] ? ad : m[l];                                                          \
                s[l] += d * d;                                                                         \
                q[l] += b * b;                                                                         \
            }                                                                                          \
        }                                                                                              \
        for (int l = 0; i < n; i++, l++) {                                                             \
            double a = xf64 ? xd[i] : (double)xs[i];                                                   \
            double b = ref == 0 ? 0.0 : rf64 ? rd[i] : (double)rs[i];                                  \
            double d = a - b;                                                                          \
            double ad = fabs(d);                                                                       \
            m[l] = (ad > m[l] || ad != ad) ? ad : m[l];                                                \
            s[l] += d * d;                                                                             \
            q[l] += b * b;                                                                             \
        }                                                                                              \
        double mx = 0.0, ss = 0.0, qq = 0.0;                                                           \
        for (int l = 0; l < LANES; l++) {                                                              \
            mx = (m[l] > mx || m[l] != m[l]) ? m[l] : mx;                                              \
            ss += s[l];                                                                                \
            qq += q[l];                                                                                \
        }                                                                                              \
        out[0] = mx;                                                                                   \
        out[1] = ss;                                                                                   \
        out[2] = qq;                                                                                   \
    }

DEFINE_DIFF(diff_baseline, )
#if AG_AVX2
DEFINE_DIFF(diff_avx2, AVX2_ATTR)
#endif

void ag_diff(int64_t simd, int64_t xf64, int64_t rf64, const void *x, const void *ref, int64_t n, double *out) {
#if AG_AVX2
    if (simd >= 1) {
        diff_avx2(xf64, rf64, x, ref, n, out);
        return;
    }
#endif
    (void)simd;
    diff_baseline(xf64, rf64, x, ref, n, out);
}

/* The widest vector functions this CPU runs and this build has: 2 AVX-512, 1 AVX2, 0 the baseline
 * (native.py picks them; all compute the same bits); -1: none (a build without the baseline on a
 * CPU without AVX2), which native.py refuses. */
int ag_simd(void) {
#if AG_AVX2
    __builtin_cpu_init();
#if AG_AVX512
    if (__builtin_cpu_supports("avx512f")) return 2;
#endif
    return __builtin_cpu_supports("avx2") ? 1 : AG_BASELINE ? 0 : -1;
#else
    return 0;
#endif
}

/* The fingerprint worker's snapshot of a leaf: n bytes from src to dst, which do not overlap.
 * Called with the GIL held (native.py), on the forward's thread. On x86-64 the bulk goes with
 * non-temporal stores: the copy is read by the worker on the other core, never again by the forward,
 * and a plain memcpy first reads each destination line into this core's caches (write-allocate)
 * and then leaves the copy there in place of the model's data: 9 GB/s against 15-17 with streaming
 * stores on the benchmark machine (docs/performance.md, "tenth session"). The sfence orders the
 * streaming stores before any later store, such as the one that hands the job to the worker. */
void ag_copy(void *dst, const void *src, int64_t n) {
    char *d = dst;
    const char *s = src;
#if AG_STREAM
    if (n >= 65536) {
        int64_t head = (int64_t)((64 - ((uintptr_t)d & 63)) & 63);
        memcpy(d, s, (size_t)head);
        d += head;
        s += head;
        n -= head;
        int64_t blocks = n / 64;
        for (int64_t i = 0; i < blocks; i++, d += 64, s += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)s);
            __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)d, a);
            _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), c);
            _mm_stream_si128((__m128i *)(d + 48), e);
        }
        n -= blocks * 64;
        _mm_sfence();
    }
#endif
    memcpy(d, s, (size_t)n);
}

/* The build's interface version: native.py refuses a library whose number differs. */
int ag_version(void) { return 8; }

/* What the library was built from, as the build passed it (nativebuild.py): the SHA-256 of this
 * file and the compiler flags. native.py uses a library built at install time only while both
 * equal this file's hash and the flags it would build with now; "" where the build gave none. */
#ifndef AG_SOURCE_SHA
#define AG_SOURCE_SHA ""
#endif
#ifndef AG_FLAGS
#define AG_FLAGS ""
#endif
const char *ag_source_sha(void) { return AG_SOURCE_SHA; }
const char *ag_flags(void) { return AG_FLAGS; }
