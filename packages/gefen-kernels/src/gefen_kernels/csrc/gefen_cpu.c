/* gefen-kernels CPU kernels: Gefen's named step ops for CPU tensors.
 *
 * Built at first use by gefen_kernels.cpu_build with the system C compiler
 * (-O3 -march=native -fopenmp -ffp-contract=off) and called through ctypes with raw
 * data pointers. No torch headers, so the build takes about two seconds.
 *
 * Numerics follow gefen_core.reference_ops: every fp32 operation is rounded separately
 * (-ffp-contract=off forbids fused multiply-add), division and square root are IEEE
 * (correctly rounded), sums of squares are accumulated in double and rounded once, and
 * bf16/fp16 parameters are rounded to their dtype after the decay and after the update,
 * as two separate in-place torch ops would. The order of the double sums differs from
 * torch's, which can move an fp32 mean by one ulp, very rarely.
 *
 * Structure: the step ops take lists of tensors (see run_entries: small tensors are spread
 * over the threads, large ones split); within a tensor, work is split over blocks (OpenMP,
 * static schedule); one thread handles a
 * block in passes over its P elements (the block path's sum of squares; the momentum of the
 * preconditioned gradient and its max; requantise and write), in tiles of TILE elements so
 * the later passes read from cache. Each tile is converted from
 * the parameter dtype into an fp32 buffer, processed by dtype-free loops written for the
 * auto-vectoriser (restrict pointers, scalars in locals, selects instead of branches),
 * and the parameter write converts back. The hottest loops (the momentum pass, the block sum
 * of squares, the threshold-table requantisation, the factored statistics) are also written
 * with AVX-512 or AVX2+FMA intrinsics, taken when the compiler targets either; every set of
 * loops gives the same bits (tests/test_kernels_cpu_portable_loops.py builds the others; the
 * statistics may add their float64 squares in another order, as torch does). Nearest rounding
 * reads a threshold table derived from the reference's rule (build_thresholds) when the
 * codebook allows, else the reference's bucket search; both give the reference's codes bit
 * for bit.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) && !defined(GEFEN_NO_INTRINSICS)
#include <immintrin.h>
#define GEFEN_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && !defined(GEFEN_NO_INTRINSICS)
/* AVX2 with FMA (x86-64-v3: most AMD EPYC and Ryzen, Intel before AVX-512): the same loops
 * eight lanes at a time, the same operations in the same order. */
#include <immintrin.h>
#define GEFEN_AVX2 1
#endif
#if defined(GEFEN_AVX512) || defined(GEFEN_AVX2)
#define GEFEN_SIMD 1
#endif

#define GEFEN_ABI_VERSION 9
#define CODEBOOK 256
#define BUCKETS 4096
/* Buckets of the nearest-rounding threshold table on [-1, 1] (see build_thresholds). */
#define FINE_BUCKETS 8192
#define LANES 16
#define TILE 512
/* Blocks up to this many elements keep their momentum in a buffer between the two passes. */
#define UBUF 4096
/* Below this many elements a call runs on one thread (a fork/join costs more). */
#define PARALLEL_MIN 32768
/* A list entry below this many elements runs whole on one thread (entries spread over the
 * threads in one parallel region); a larger one is split over all threads in a region of its
 * own (one fork/join per entry, which the medium tensors of a small model paid many times). */
#define ENTRY_SPLIT_MIN 262144
/* Whether n elements are split over threads. Tested before an OpenMP region is entered at
 * all: a region serialised by its if() clause still costs about 0.3 us in libgomp, more than
 * a small tensor's whole update. */
#define PARALLEL(n, threads) ((n) >= PARALLEL_MIN && (threads) > 1)

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_F64 = 3 };
/* Layout of the scalars tensor (gefen_core.step_scalars). */
enum { S_LR = 0, S_INV_BC1, S_BC2, S_DECAY, S_BETA1, S_OMB1, S_BETA2, S_OMB2, S_EPS };

int gefen_abi_version(void) { return GEFEN_ABI_VERSION; }

int gefen_openmp_enabled(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* ---- dtype conversions (round to nearest even, like c10) ------------------------------ */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(f != f ? 0x7FC0u : rounded);
}

#if defined(__FLT16_MAX__) && !defined(GEFEN_NO_FLOAT16)
static inline float f16_to_f32(uint16_t h) {
    _Float16 x;
    memcpy(&x, &h, 2);
    return (float)x;
}
static inline uint16_t f32_to_f16(float f) {
    _Float16 x = (_Float16)f;
    uint16_t h;
    memcpy(&h, &x, 2);
    return h;
}
#else
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t man = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0x1Fu) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: man * 2^-24, exact in fp32 */
        float f = (float)man * 5.9604644775390625e-08f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}
static inline uint16_t f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u); /* NaN */
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* rounds to inf */
    if (a < 0x38800000u) {                                   /* fp16 subnormal or zero */
        float mag;
        memcpy(&mag, &a, 4);
        return (uint16_t)(sign | (uint16_t)nearbyintf(mag * 16777216.0f));
    }
    uint32_t rounded = a + 0x0FFFu + ((a >> 13) & 1u);
    return (uint16_t)(sign | (uint16_t)((rounded - 0x38000000u) >> 13));
}
#endif

/* ---- SplitMix64-style counter hash (gefen_core.momentum_codec.splitmix_uniform) ------- */

static inline float splitmix_uniform(uint64_t seed, uint64_t index) {
    uint64_t z = seed + 0x9E3779B97F4A7C15ull * (index + 1u);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z = z ^ (z >> 31);
    return (float)(int32_t)(z >> 40) * 5.9604644775390625e-08f; /* 2^-24 */
}

/* ---- codebook lookup ----------------------------------------------------------------- */

/* clamp(int32(fl(x + 1) * 2048), 0, 4095), as torch's .to(torch.int32).clamp_(0, 4095): the
 * conversion truncates, and x86 turns NaN and out-of-range values into INT32_MIN (bucket 0).
 * Converting before clamping (integer clamps) is also what lets the loops vectorise. */
static inline int32_t bucket_of(float x) {
    int32_t b = (int32_t)((x + 1.0f) * 2048.0f);
    b = b > 0 ? b : 0;
    return b < BUCKETS - 1 ? b : BUCKETS - 1;
}

/* The lookup table of one codebook, by bucket b of z (see bucket_of). momentum_codec's
 * lower_bound is k = start + [n > 0 and C[start] < z] + [n > 1 and C[start + 1] < z], with
 * start = #codewords in buckets below b and n the codewords in bucket b; the bracket is
 * (max(k - 1, 0), min(k, 255)). Everything the quantiser reads is stored per bucket, so the
 * five loads of one element are independent (no load waits for another's index). */
typedef struct {
    float codebook[CODEBOOK]; /* the codebook this table was built from */
    int32_t valid;
    int32_t info[BUCKETS];    /* start | min(n, 2) << 16 */
    float below[BUCKETS];     /* C[max(start - 1, 0)] */
    float at0[BUCKETS];       /* C[min(start, 255)] */
    float at1[BUCKETS];       /* C[min(start + 1, 255)] */
    float at2[BUCKETS];       /* C[min(start + 2, 255)] */
    /* Threshold table of nearest rounding (used when `thresholds` is 1, see build_thresholds):
     * for z in [-1, 1] in fine bucket f, the nearest code is base[f] + (z > threshold[f]). */
    int32_t thresholds;
    float threshold[FINE_BUCKETS];
    uint8_t base[FINE_BUCKETS + 4]; /* + 4: read as (unaligned) 32-bit words, low byte used */
    /* The same two per fine bucket in one 64-bit word (threshold bits low, base high), so the
     * vector loop fetches both with one gather. */
    uint64_t packed[FINE_BUCKETS];
#ifdef GEFEN_AVX2
    /* Per fine bucket, for the AVX2 loop's one 16-byte load: its threshold, its base code (int32
     * bits) and the two codewords it can choose, C[base] and C[min(base + 1, 255)]. */
    float wide[FINE_BUCKETS][4];
#endif
} CodebookTable;

int64_t gefen_table_bytes(void) { return (int64_t)sizeof(CodebookTable); }

static inline int32_t clamp_code(int32_t k) { return k < 0 ? 0 : (k > CODEBOOK - 1 ? CODEBOOK - 1 : k); }

/* The reference's nearest code of z, from the bucket table (the fallback path, exact on any input). */
static int32_t nearest_code_reference(const CodebookTable* t, float z);

static inline int32_t fine_bucket_of(float x) {
    int32_t f = (int32_t)((x + 1.0f) * (float)(FINE_BUCKETS / 2));
    f = f > 0 ? f : 0;
    return f < FINE_BUCKETS - 1 ? f : FINE_BUCKETS - 1;
}

/* Order-preserving map between floats and integers (-0.0 and +0.0 share a key). */
static inline int32_t float_key(float x) {
    int32_t bits;
    memcpy(&bits, &x, 4);
    return bits < 0 ? -(bits & 0x7FFFFFFF) : bits;
}

static inline float key_float(int32_t key) {
    int32_t bits = key < 0 ? (int32_t)((uint32_t)(-key) | 0x80000000u) : key;
    float x;
    memcpy(&x, &bits, 4);
    return x;
}

/* Nearest rounding as a threshold table. When the codebook is non-decreasing and no bucket of
 * the reference table holds more than two codewords below +1 (the reference's lookup
 * precondition, which every learned or loaded codebook satisfies), the reference's lower bound
 * is exact, and its nearest code q(z) is a non-decreasing step function of z on [-1, 1]: on
 * (C[k-1], C[k]] it picks k - 1 while fl(z - C[k-1]) <= fl(C[k] - z), a prefix of the interval.
 * So q(z) = #{j : z > T_j}, with T_j the largest float whose code is below j, found by a binary
 * search over the floats that evaluates the reference rule itself (every tie and rounding
 * included). With at most one threshold per fine bucket (codewords a histogram bin apart have
 * thresholds two fine buckets apart), q(z) = base[f] + (z > threshold[f]): two loads and a
 * compare per element. Returns 0 (use the reference search) when a condition does not hold. */
static int32_t build_thresholds(CodebookTable* t, const int32_t* counts) {
    const float* c = t->codebook;
    for (int i = 1; i < CODEBOOK; i++)
        if (!(c[i - 1] <= c[i])) return 0; /* also rejects NaN */
    if (c[0] != -1.0f || c[CODEBOOK - 1] != 1.0f) return 0;
    for (int b = 0; b < BUCKETS; b++) {
        int32_t below_one = counts[b] - (b == BUCKETS - 1); /* C[255] = 1 sits in the last bucket */
        if (below_one > 2) return 0;
    }
    for (int f = 0; f < FINE_BUCKETS; f++) t->threshold[f] = INFINITY;
    memset(t->base, 0, sizeof t->base);
    int32_t low_key = float_key(-1.0f), high_key = float_key(1.0f);
    if (nearest_code_reference(t, -1.0f) != 0) return 0;
    int32_t previous_key = low_key - 1;
    for (int32_t j = 1; j < CODEBOOK; j++) {
        if (nearest_code_reference(t, 1.0f) < j) break; /* code j is never chosen on [-1, 1] */
        int32_t lo = low_key, hi = high_key;             /* q(lo) < j <= q(hi) */
        while (hi - lo > 1) {
            int32_t mid = lo + (hi - lo) / 2;
            if (nearest_code_reference(t, key_float(mid)) < j) lo = mid;
            else hi = mid;
        }
        if (lo <= previous_key) return 0; /* two thresholds at one float: q jumps by two */
        previous_key = lo;
        float threshold = key_float(lo);
        int32_t f = fine_bucket_of(threshold);
        if (t->threshold[f] != INFINITY) return 0; /* two thresholds in one fine bucket */
        t->threshold[f] = threshold;
    }
    int32_t below = 0; /* base[f]: the thresholds in buckets below f */
    for (int f = 0; f < FINE_BUCKETS; f++) {
        t->base[f] = (uint8_t)below;
        below += t->threshold[f] != INFINITY;
        uint32_t bits;
        memcpy(&bits, &t->threshold[f], 4);
        t->packed[f] = (uint64_t)bits | ((uint64_t)t->base[f] << 32);
#ifdef GEFEN_AVX2
        int32_t code = t->base[f];
        t->wide[f][0] = t->threshold[f];
        memcpy(&t->wide[f][1], &code, 4);
        t->wide[f][2] = c[code];
        t->wide[f][3] = c[clamp_code(code + 1)];
#endif
    }
    /* Check the table against the reference rule at every threshold and its neighbours. */
    for (int f = 0; f < FINE_BUCKETS; f++) {
        if (t->threshold[f] == INFINITY) continue;
        int32_t key = float_key(t->threshold[f]);
        for (int32_t d = -1; d <= 1; d++) {
            if (key + d < low_key || key + d > high_key) continue;
            float z = key_float(key + d);
            int32_t f2 = fine_bucket_of(z);
            int32_t fast = t->base[f2] + (z > t->threshold[f2]);
            if (fast != nearest_code_reference(t, z)) return 0;
        }
    }
    return 1;
}

/* Rebuild the table unless it was built from the same codebook (bitwise). */
static void prepare_table(CodebookTable* t, const float* codebook) {
    if (t->valid == 1 && memcmp(t->codebook, codebook, sizeof t->codebook) == 0) return;
    int32_t counts[BUCKETS];
    memset(counts, 0, sizeof counts);
    for (int i = 0; i < CODEBOOK; i++) counts[bucket_of(codebook[i])]++;
    int32_t start = 0;
    for (int b = 0; b < BUCKETS; b++) {
        int32_t n = counts[b] < 2 ? counts[b] : 2;
        t->info[b] = start | (n << 16);
        t->below[b] = codebook[clamp_code(start - 1)];
        t->at0[b] = codebook[clamp_code(start)];
        t->at1[b] = codebook[clamp_code(start + 1)];
        t->at2[b] = codebook[clamp_code(start + 2)];
        start += counts[b];
    }
    memcpy(t->codebook, codebook, sizeof t->codebook);
    t->thresholds = build_thresholds(t, counts);
    t->valid = 1;
}

/* 1 when nearest rounding with this codebook takes the threshold table, 0 when it takes the
 * reference's bucket search (the table is prepared for the codebook either way). */
int gefen_uses_threshold_table(const float* codebook, void* table) {
    prepare_table((CodebookTable*)table, codebook);
    return ((const CodebookTable*)table)->thresholds;
}

typedef struct {
    float lr, inv_bc1, bc2, decay, beta1, omb1, beta2, omb2, eps;
    int apply_decay, stochastic;
    float sign; /* -1 when maximizing */
    uint64_t seed;
    const float* codebook;
    const CodebookTable* table;
} StepContext;

static void read_context(StepContext* ctx, const float* scalars, const float* codebook, const CodebookTable* table,
                         const int64_t* seed, int apply_decay, int maximize) {
    ctx->lr = scalars[S_LR];
    ctx->inv_bc1 = scalars[S_INV_BC1];
    ctx->bc2 = scalars[S_BC2];
    ctx->decay = scalars[S_DECAY];
    ctx->beta1 = scalars[S_BETA1];
    ctx->omb1 = scalars[S_OMB1];
    ctx->beta2 = scalars[S_BETA2];
    ctx->omb2 = scalars[S_OMB2];
    ctx->eps = scalars[S_EPS];
    ctx->apply_decay = apply_decay;
    ctx->stochastic = seed != NULL;
    ctx->sign = maximize ? -1.0f : 1.0f;
    ctx->seed = seed != NULL ? (uint64_t)seed[0] : 0u;
    ctx->codebook = codebook;
    ctx->table = table;
}

/* ---- dtype-free tile loops ----------------------------------------------------------- */

#ifndef GEFEN_SIMD
static void widen_codes(const uint8_t* restrict q, int32_t* restrict out, int64_t n) {
    for (int64_t j = 0; j < n; j++) out[j] = q[j];
}
#endif

#ifdef GEFEN_SIMD
/* Range of divisors a and dividends |u| for which the vector quotients need no division. */
#define QUOTIENT_MIN 0x1p-100f
#define QUOTIENT_MAX 0x1p100f
#endif

#ifdef GEFEN_AVX512

/* z = fl(u / a) for 16 lanes without the (slow) vector division, by Markstein's correction:
 * with y = fl(1 / a) correctly rounded and q0 = fl(u * y) within an ulp of u / a, the
 * remainder r = u - a q0 is exact in one fused multiply-add and q1 = fl(q0 + r y) (another)
 * is the correctly rounded quotient (Markstein's theorem for round-to-nearest; also checked
 * against the division on 4e8 random and near-midpoint pairs). The theorem needs no
 * underflow or overflow: the caller keeps a in [QUOTIENT_MIN, QUOTIENT_MAX], and lanes with
 * |u| outside that range (infinities included), or a quotient below 2^-124 or above 2^126,
 * are recomputed with the IEEE division (a NaN stays NaN; u = -0 gives +0 where the division
 * gives -0, which nothing downstream sees: z and u are only compared and taken |u| of).
 * Explicit FMAs: the result does not depend on the compiler's contraction, which stays off. */
static inline __m512 quotient_avx512(__m512 u, __m512 a, __m512 y) {
    __m512 q0 = _mm512_mul_ps(u, y);
    __m512 r = _mm512_fnmadd_ps(q0, a, u);
    __m512 q1 = _mm512_fmadd_ps(r, y, q0);
    __m512 au = _mm512_abs_ps(u), aq = _mm512_abs_ps(q1);
    __mmask16 slow = _mm512_cmp_ps_mask(au, _mm512_set1_ps(QUOTIENT_MIN), _CMP_LT_OQ) |
                     _mm512_cmp_ps_mask(au, _mm512_set1_ps(QUOTIENT_MAX), _CMP_GT_OQ) |
                     _mm512_cmp_ps_mask(aq, _mm512_set1_ps(0x1p-124f), _CMP_LT_OQ) |
                     _mm512_cmp_ps_mask(aq, _mm512_set1_ps(0x1p126f), _CMP_GT_OQ);
    slow &= _mm512_cmp_ps_mask(u, _mm512_setzero_ps(), _CMP_NEQ_UQ);
    if (slow) q1 = _mm512_mask_div_ps(q1, slow, u, a);
    return q1;
}
#endif

#ifdef GEFEN_AVX2
/* quotient_avx512 for 8 lanes: the same correction, the same lanes recomputed by division. */
static inline __m256 quotient_avx2(__m256 u, __m256 a, __m256 y) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 q0 = _mm256_mul_ps(u, y);
    __m256 r = _mm256_fnmadd_ps(q0, a, u);
    __m256 q1 = _mm256_fmadd_ps(r, y, q0);
    __m256 au = _mm256_andnot_ps(sign, u), aq = _mm256_andnot_ps(sign, q1);
    __m256 slow = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(au, _mm256_set1_ps(QUOTIENT_MIN), _CMP_LT_OQ),
                                            _mm256_cmp_ps(au, _mm256_set1_ps(QUOTIENT_MAX), _CMP_GT_OQ)),
                               _mm256_or_ps(_mm256_cmp_ps(aq, _mm256_set1_ps(0x1p-124f), _CMP_LT_OQ),
                                            _mm256_cmp_ps(aq, _mm256_set1_ps(0x1p126f), _CMP_GT_OQ)));
    slow = _mm256_and_ps(slow, _mm256_cmp_ps(u, _mm256_setzero_ps(), _CMP_NEQ_UQ));
    if (!_mm256_testz_ps(slow, slow)) q1 = _mm256_blendv_ps(q1, _mm256_div_ps(u, a), slow);
    return q1;
}

/* Eight codewords cb[q[0..7]] (scalar loads: AVX2 gathers are microcoded on AMD Zen and
 * slowed by the gather-data-sampling mitigation on Intel). */
static inline __m256 codewords_avx2(const float* cb, const uint8_t* q) {
    return _mm256_setr_ps(cb[q[0]], cb[q[1]], cb[q[2]], cb[q[3]], cb[q[4]], cb[q[5]], cb[q[6]], cb[q[7]]);
}
#endif

/* How momentum_tile preconditions the gradient: not at all (GefenMuon), by one denominator
 * (Gefen's block path) or by one per element (the factored path). */
typedef struct {
    int kind; /* PRE_NONE, PRE_BLOCK or PRE_ELEMENT */
    float h;  /* PRE_BLOCK */
    const float* hs; /* PRE_ELEMENT: the tile's denominators */
} Preconditioner;
enum { PRE_NONE = 0, PRE_BLOCK = 1, PRE_ELEMENT = 2 };

#ifdef GEFEN_AVX2
/* One half (lanes 0-7 or 8-15) of momentum_tile's 16-lane step, at element j. */
static inline __m256 momentum_avx2(const float* g, const float* hs, const uint8_t* q, int64_t j, const float* cb,
                                   int kind, int markstein, __m256 vm, __m256 vb1, __m256 vo1, __m256 vh, __m256 vy) {
    __m256 m = _mm256_mul_ps(codewords_avx2(cb, q + j), vm);
    __m256 gv = _mm256_loadu_ps(g + j);
    if (kind == PRE_ELEMENT) gv = _mm256_div_ps(gv, _mm256_loadu_ps(hs + j));
    else if (markstein) gv = quotient_avx2(gv, vh, vy);
    else if (kind == PRE_BLOCK) gv = _mm256_div_ps(gv, vh);
    return _mm256_add_ps(_mm256_mul_ps(m, vb1), _mm256_mul_ps(gv, vo1));
}
#endif

/* Momentum EMA of one tile, u = fl(fl(fl(C[q] * M) * beta1) + fl(n * (1 - beta1))) with
 * n = fl(g / h) (pre; the division overlaps the codeword gathers), kept in u_out, with max |u|
 * and a NaN flag per lane; lane k takes the elements j = k mod LANES of the tile, the tail
 * lane 0. */
static void momentum_tile(const float* restrict g, const Preconditioner* pre, const uint8_t* restrict q,
                          const float* restrict cb, float m_old, float beta1, float omb1, int64_t n,
                          float* restrict u_out, float* restrict amax, int32_t* restrict nan) {
    int64_t j = 0;
    const float* restrict hs = pre->hs;
#ifdef GEFEN_AVX512
    {
        const __m512 vm = _mm512_set1_ps(m_old), vb1 = _mm512_set1_ps(beta1), vo1 = _mm512_set1_ps(omb1);
        const __m512 vh = _mm512_set1_ps(pre->h), vy = _mm512_set1_ps(1.0f / pre->h);
        const int markstein = pre->kind == PRE_BLOCK && pre->h >= QUOTIENT_MIN && pre->h <= QUOTIENT_MAX;
        __m512 best = _mm512_loadu_ps(amax);
        __mmask16 bad = 0;
        for (; j + LANES <= n; j += LANES) {
            __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + j)));
            __m512 m = _mm512_mul_ps(_mm512_i32gather_ps(codes, cb, 4), vm);
            __m512 gv = _mm512_loadu_ps(g + j);
            if (pre->kind == PRE_ELEMENT) gv = _mm512_div_ps(gv, _mm512_loadu_ps(hs + j));
            else if (markstein) gv = quotient_avx512(gv, vh, vy);
            else if (pre->kind == PRE_BLOCK) gv = _mm512_div_ps(gv, vh);
            __m512 u = _mm512_add_ps(_mm512_mul_ps(m, vb1), _mm512_mul_ps(gv, vo1));
            _mm512_storeu_ps(u_out + j, u);
            best = _mm512_max_ps(_mm512_abs_ps(u), best); /* a > best ? a : best (NaN a keeps best) */
            bad |= _mm512_cmp_ps_mask(u, u, _CMP_UNORD_Q);
        }
        _mm512_storeu_ps(amax, best);
        for (int k = 0; k < LANES; k++) nan[k] |= (bad >> k) & 1;
    }
#elif defined(GEFEN_AVX2)
    {
        const __m256 vm = _mm256_set1_ps(m_old), vb1 = _mm256_set1_ps(beta1), vo1 = _mm256_set1_ps(omb1);
        const __m256 vh = _mm256_set1_ps(pre->h), vy = _mm256_set1_ps(1.0f / pre->h);
        const __m256 sign = _mm256_set1_ps(-0.0f);
        const int markstein = pre->kind == PRE_BLOCK && pre->h >= QUOTIENT_MIN && pre->h <= QUOTIENT_MAX;
        __m256 best0 = _mm256_loadu_ps(amax), best1 = _mm256_loadu_ps(amax + 8);
        __m256 bad0 = _mm256_setzero_ps(), bad1 = bad0;
        for (; j + LANES <= n; j += LANES) {
            __m256 u0 = momentum_avx2(g, hs, q, j, cb, pre->kind, markstein, vm, vb1, vo1, vh, vy);
            __m256 u1 = momentum_avx2(g, hs, q, j + 8, cb, pre->kind, markstein, vm, vb1, vo1, vh, vy);
            _mm256_storeu_ps(u_out + j, u0);
            _mm256_storeu_ps(u_out + j + 8, u1);
            /* max(a, best) keeps best when a is NaN, as the portable loop does */
            best0 = _mm256_max_ps(_mm256_andnot_ps(sign, u0), best0);
            best1 = _mm256_max_ps(_mm256_andnot_ps(sign, u1), best1);
            bad0 = _mm256_or_ps(bad0, _mm256_cmp_ps(u0, u0, _CMP_UNORD_Q));
            bad1 = _mm256_or_ps(bad1, _mm256_cmp_ps(u1, u1, _CMP_UNORD_Q));
        }
        _mm256_storeu_ps(amax, best0);
        _mm256_storeu_ps(amax + 8, best1);
        int low = _mm256_movemask_ps(bad0), high = _mm256_movemask_ps(bad1);
        for (int k = 0; k < 8; k++) {
            nan[k] |= (low >> k) & 1;
            nan[k + 8] |= (high >> k) & 1;
        }
    }
#else
    {
        int32_t codes[TILE];
        float nbuf[TILE];
        widen_codes(q, codes, n);
        const float* restrict x = g;
        if (pre->kind != PRE_NONE) {
            const float h = pre->h;
            if (pre->kind == PRE_ELEMENT)
                for (int64_t i = 0; i < n; i++) nbuf[i] = g[i] / hs[i];
            else
                for (int64_t i = 0; i < n; i++) nbuf[i] = g[i] / h;
            x = nbuf;
        }
        for (int64_t i = 0; i < n; i++) {
            float m = cb[codes[i]] * m_old;
            u_out[i] = m * beta1 + x[i] * omb1;
        }
        for (; j + LANES <= n; j += LANES) {
            for (int k = 0; k < LANES; k++) {
                float u = u_out[j + k];
                float a = fabsf(u);
                amax[k] = a > amax[k] ? a : amax[k];
                nan[k] |= u != u;
            }
        }
    }
#endif
    for (; j < n; j++) {
#ifdef GEFEN_SIMD
        float m = cb[q[j]] * m_old;
        float x = pre->kind == PRE_NONE ? g[j] : g[j] / (pre->kind == PRE_ELEMENT ? hs[j] : pre->h);
        u_out[j] = m * beta1 + x * omb1;
#endif
        float u = u_out[j];
        float a = fabsf(u);
        amax[0] = a > amax[0] ? a : amax[0];
        nan[0] |= u != u;
    }
}

/* acc[k] += double(x_j)^2 for the elements j = k mod LANES of a tile (the tail: lane 0). */
static void sumsq_tile(const float* restrict x, int64_t n, double* restrict acc) {
    int64_t j = 0;
#ifdef GEFEN_AVX512
    __m512d lo = _mm512_loadu_pd(acc), hi = _mm512_loadu_pd(acc + 8);
    for (; j + LANES <= n; j += LANES) {
        __m512 v = _mm512_loadu_ps(x + j);
        __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
        __m512d b = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
        lo = _mm512_add_pd(lo, _mm512_mul_pd(a, a));
        hi = _mm512_add_pd(hi, _mm512_mul_pd(b, b));
    }
    _mm512_storeu_pd(acc, lo);
    _mm512_storeu_pd(acc + 8, hi);
#elif defined(GEFEN_AVX2)
    __m256d a0 = _mm256_loadu_pd(acc), a1 = _mm256_loadu_pd(acc + 4);
    __m256d a2 = _mm256_loadu_pd(acc + 8), a3 = _mm256_loadu_pd(acc + 12);
    for (; j + LANES <= n; j += LANES) {
        __m256 v = _mm256_loadu_ps(x + j), w = _mm256_loadu_ps(x + j + 8);
        __m256d b0 = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), b1 = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        __m256d b2 = _mm256_cvtps_pd(_mm256_castps256_ps128(w)), b3 = _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1));
        a0 = _mm256_add_pd(a0, _mm256_mul_pd(b0, b0));
        a1 = _mm256_add_pd(a1, _mm256_mul_pd(b1, b1));
        a2 = _mm256_add_pd(a2, _mm256_mul_pd(b2, b2));
        a3 = _mm256_add_pd(a3, _mm256_mul_pd(b3, b3));
    }
    _mm256_storeu_pd(acc, a0);
    _mm256_storeu_pd(acc + 4, a1);
    _mm256_storeu_pd(acc + 8, a2);
    _mm256_storeu_pd(acc + 12, a3);
#else
    for (; j + LANES <= n; j += LANES)
        for (int k = 0; k < LANES; k++) acc[k] += (double)x[j + k] * (double)x[j + k];
#endif
    for (; j < n; j++) acc[0] += (double)x[j] * (double)x[j];
}

/* The denominators h of Gefen's preconditioned momentum: one per block (gefen.block_step;
 * row_factor and v NULL); per element of a factored matrix (gefen.factored_step),
 * h = fl(fl(a_r * b_c) + eps) with a_r = fl(sqrt(row_factor_r)) and b_c = col_root_c =
 * fl(sqrt(v_col_c)); or per element from Adam's v (gefen.element_step), advanced in the same
 * pass: v = fl(fl(v * beta2) + fl(fl(g * g) * omb2)), h = fl(fl(sqrt(fl(v * bc2))) + eps). */
typedef struct {
    float h;
    const float* row_factor;
    const float* col_root;
    int64_t cols;
    float eps;
    float* v; /* element path */
    float beta2, omb2, bc2;
} Denominator;

/* The preconditioner of the n elements starting at flat index first (hbuf: room for n
 * per-element denominators). g is the tile's signed fp32 gradient; the element path advances
 * its v only when advance is set (a block's first pass; a recomputing second pass reads the
 * advanced v). */
static Preconditioner preconditioner_of(const Denominator* den, int64_t first, float* restrict hbuf, int64_t n,
                                        const float* restrict g, int advance) {
    Preconditioner pre = {PRE_NONE, 0.0f, NULL};
    if (den == NULL) return pre;
    if (den->v != NULL) {
        float* restrict v = den->v + first;
        const float beta2 = den->beta2, omb2 = den->omb2, bc2 = den->bc2, eps = den->eps;
        if (advance)
            for (int64_t j = 0; j < n; j++) {
                float kept = v[j] * beta2;
                float square = g[j] * g[j]; /* (-g)^2 = g^2: the sign of maximize does not matter */
                float added = square * omb2;
                v[j] = kept + added;
            }
        for (int64_t j = 0; j < n; j++) {
            float factor = v[j] * bc2;
            hbuf[j] = sqrtf(factor) + eps;
        }
        pre.kind = PRE_ELEMENT;
        pre.hs = hbuf;
        return pre;
    }
    if (den->row_factor == NULL) {
        pre.kind = PRE_BLOCK;
        pre.h = den->h;
        return pre;
    }
    for (int64_t done = 0; done < n;) {
        int64_t flat = first + done, row = flat / den->cols, col = flat - row * den->cols;
        int64_t len = n - done < den->cols - col ? n - done : den->cols - col;
        const float a = sqrtf(den->row_factor[row]), eps = den->eps;
        const float* restrict b = den->col_root + col;
        float* restrict h = hbuf + done;
        for (int64_t j = 0; j < len; j++) {
            float w = a * b[j];
            h[j] = w + eps;
        }
        done += len;
    }
    pre.kind = PRE_ELEMENT;
    pre.hs = hbuf;
    return pre;
}

/* Bracket of z: codes (lo, hi) and their codewords, from the bucket table. */
#define BRACKET(t, z, lo, hi, clo, chi)                                              \
    do {                                                                             \
        int32_t b_ = bucket_of(z);                                                   \
        int32_t info_ = (t)->info[b_];                                               \
        float below_ = (t)->below[b_], a0_ = (t)->at0[b_], a1_ = (t)->at1[b_];       \
        float a2_ = (t)->at2[b_];                                                    \
        int32_t start_ = info_ & 0xFFFF, n_ = info_ >> 16;                           \
        int32_t s1_ = (n_ > 0) & (a0_ < (z));                                        \
        int32_t s2_ = (n_ > 1) & (a1_ < (z));                                        \
        int32_t step_ = s1_ + s2_;                                                   \
        int32_t k_ = start_ + step_;                                                 \
        lo = k_ - 1 > 0 ? k_ - 1 : 0;                                                \
        hi = k_ < CODEBOOK - 1 ? k_ : CODEBOOK - 1;                                  \
        clo = step_ == 0 ? below_ : (step_ == 1 ? a0_ : a1_);                        \
        chi = step_ == 0 ? a0_ : (step_ == 1 ? a1_ : a2_);                           \
    } while (0)

static int32_t nearest_code_reference(const CodebookTable* t, float z) {
    int32_t lo, hi;
    float clo, chi;
    BRACKET(t, z, lo, hi, clo, chi);
    return fabsf(z - clo) <= fabsf(z - chi) ? lo : hi;
}


/* Nearest rounding through the threshold table (z in [-1, 1]; see build_thresholds). */
static void quantize_tile_thresholds(const float* restrict u, uint8_t* restrict q, float s,
                                     float* restrict d, const CodebookTable* restrict t,
                                     const float* restrict cb, float m_new, float lr, int64_t n) {
    float safe = m_new > 0.0f ? m_new : 1.0f;
    int64_t j = 0;
#ifdef GEFEN_AVX512
    {
        const __m512 vsafe = _mm512_set1_ps(safe), one = _mm512_set1_ps(1.0f);
        const int divide = !(safe >= QUOTIENT_MIN && safe <= QUOTIENT_MAX);
        const __m512 inv_safe = _mm512_set1_ps(1.0f / safe);
        const __m512 scale = _mm512_set1_ps((float)(FINE_BUCKETS / 2));
        const __m512 vm = _mm512_set1_ps(m_new), vlr = _mm512_set1_ps(lr), vs = _mm512_set1_ps(s);
        const __m512i zero = _mm512_setzero_si512(), top = _mm512_set1_epi32(FINE_BUCKETS - 1);
        const __m512i ione = _mm512_set1_epi32(1);
        const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        const long long* packed = (const long long*)t->packed;
        for (; j + 16 <= n; j += 16) {
            __m512 uv = _mm512_loadu_ps(u + j);
            __m512 z = divide ? _mm512_div_ps(uv, vsafe) : quotient_avx512(uv, vsafe, inv_safe);
            /* fine_bucket_of: truncating conversion (NaN -> INT32_MIN), then the integer clamp */
            __m512i f = _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_add_ps(z, one), scale));
            f = _mm512_min_epi32(_mm512_max_epi32(f, zero), top);
            __m512i e0 = _mm512_i32gather_epi64(_mm512_castsi512_si256(f), packed, 8);
            __m512i e1 = _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(f, 1), packed, 8);
            __m512 threshold = _mm512_castsi512_ps(_mm512_permutex2var_epi32(e0, even, e1));
            __m512i base = _mm512_permutex2var_epi32(e0, odd, e1);
            __mmask16 above = _mm512_cmp_ps_mask(z, threshold, _CMP_GT_OQ);
            __m512i k = _mm512_mask_add_epi32(base, above, base, ione);
            _mm_storeu_si128((__m128i*)(q + j), _mm512_cvtepi32_epi8(k));
        }
        /* The codeword gather depends on the table gather: a second loop over the codes just
         * written keeps each loop's iterations independent, so their gathers overlap. */
        for (int64_t i = 0; i + 16 <= j; i += 16) {
            __m512i k = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + i)));
            __m512 mq = _mm512_mul_ps(_mm512_i32gather_ps(k, cb, 4), vm);
            __m512 x = _mm512_mul_ps(mq, vs);
            _mm512_storeu_ps(d + i, _mm512_mul_ps(x, vlr));
        }
    }
#elif defined(GEFEN_AVX2)
    {
        const __m256 vsafe = _mm256_set1_ps(safe), one = _mm256_set1_ps(1.0f);
        const int divide = !(safe >= QUOTIENT_MIN && safe <= QUOTIENT_MAX);
        const __m256 inv_safe = _mm256_set1_ps(1.0f / safe);
        const __m256 scale = _mm256_set1_ps((float)(FINE_BUCKETS / 2));
        const __m256 vm = _mm256_set1_ps(m_new), vlr = _mm256_set1_ps(lr), vs = _mm256_set1_ps(s);
        const __m256i zero = _mm256_setzero_si256(), top = _mm256_set1_epi32(FINE_BUCKETS - 1);
        /* the low byte of each 32-bit lane, gathered into the low 4 bytes of each 128-bit half */
        const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                   0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
        const float(*wide)[4] = t->wide;
        for (; j + 8 <= n; j += 8) {
            __m256 uv = _mm256_loadu_ps(u + j);
            __m256 z = divide ? _mm256_div_ps(uv, vsafe) : quotient_avx2(uv, vsafe, inv_safe);
            /* fine_bucket_of: truncating conversion (NaN -> INT32_MIN), then the integer clamp */
            __m256i f = _mm256_cvttps_epi32(_mm256_mul_ps(_mm256_add_ps(z, one), scale));
            f = _mm256_min_epi32(_mm256_max_epi32(f, zero), top);
            int32_t at[8];
            _mm256_storeu_si256((__m256i*)at, f);
            /* row i holds the entries of elements i and i + 4; a 4 x 4 transpose in each half
             * gives the thresholds, bases and both codewords of the eight elements in order */
            __m256 r0 = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(wide[at[0]])),
                                             _mm_loadu_ps(wide[at[4]]), 1);
            __m256 r1 = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(wide[at[1]])),
                                             _mm_loadu_ps(wide[at[5]]), 1);
            __m256 r2 = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(wide[at[2]])),
                                             _mm_loadu_ps(wide[at[6]]), 1);
            __m256 r3 = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(wide[at[3]])),
                                             _mm_loadu_ps(wide[at[7]]), 1);
            __m256d t0 = _mm256_castps_pd(_mm256_unpacklo_ps(r0, r1)), t1 = _mm256_castps_pd(_mm256_unpackhi_ps(r0, r1));
            __m256d t2 = _mm256_castps_pd(_mm256_unpacklo_ps(r2, r3)), t3 = _mm256_castps_pd(_mm256_unpackhi_ps(r2, r3));
            __m256 threshold = _mm256_castpd_ps(_mm256_unpacklo_pd(t0, t2));
            __m256i base = _mm256_castpd_si256(_mm256_unpackhi_pd(t0, t2));
            __m256 low = _mm256_castpd_ps(_mm256_unpacklo_pd(t1, t3)), high = _mm256_castpd_ps(_mm256_unpackhi_pd(t1, t3));
            /* k = base + (z > threshold): the compare's all-ones lanes are -1 */
            __m256 above = _mm256_cmp_ps(z, threshold, _CMP_GT_OQ);
            __m256i k = _mm256_sub_epi32(base, _mm256_castps_si256(above));
            __m256i bytes = _mm256_shuffle_epi8(k, low_bytes);
            _mm_storel_epi64((__m128i*)(q + j),
                             _mm_unpacklo_epi32(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1)));
            __m256 mq = _mm256_mul_ps(_mm256_blendv_ps(low, high, above), vm);
            __m256 x = _mm256_mul_ps(mq, vs);
            _mm256_storeu_ps(d + j, _mm256_mul_ps(x, vlr));
        }
    }
#endif
    const float* restrict threshold = t->threshold;
    const uint8_t* restrict base = t->base;
    int32_t codes[TILE];
    int64_t first = j;
    for (; j < n; j++) {
        float z = u[j] / safe;
        int32_t f = fine_bucket_of(z);
        uint32_t word;
        memcpy(&word, base + f, 4);
        int32_t k = (int32_t)(word & 0xFFu) + (z > threshold[f]);
        codes[j] = k;
        float mq = cb[k] * m_new;
        float x = mq * s;
        d[j] = x * lr;
    }
    for (j = first; j < n; j++) q[j] = (uint8_t)codes[j];
}

/* Requantise one tile of momentum u (nearest codeword, ties low) and produce the updates
 * d = fl(fl(fl(C[q'] * M') * s) * lr), s one scale for the tile (1 / bc1, or 1 for GefenMuon); q
 * is rewritten. */
static void quantize_tile_nearest(const float* restrict u, uint8_t* restrict q, float s,
                                  float* restrict d, const CodebookTable* restrict t, float m_new, float lr,
                                  int64_t n) {
    float safe = m_new > 0.0f ? m_new : 1.0f;
    int32_t codes[TILE];
    for (int64_t j = 0; j < n; j++) {
        float z = u[j] / safe;
        int32_t lo, hi;
        float clo, chi;
        BRACKET(t, z, lo, hi, clo, chi);
        int take_lo = fabsf(z - clo) <= fabsf(z - chi);
        codes[j] = take_lo ? lo : hi;
        float mq = (take_lo ? clo : chi) * m_new;
        float x = mq * s;
        d[j] = x * lr;
    }
    for (int64_t j = 0; j < n; j++) q[j] = (uint8_t)codes[j];
}

/* The same with unbiased stochastic rounding: up = (clamp(z) - lo) / (hi - lo), choose hi
 * when U(seed, first + j) < up. */
static void quantize_tile_stochastic(const float* restrict u, uint8_t* restrict q, float s,
                                     float* restrict d, const CodebookTable* restrict t, float m_new, float lr,
                                     int64_t n, uint64_t seed, uint64_t first) {
    float safe = m_new > 0.0f ? m_new : 1.0f;
    int32_t codes[TILE];
    for (int64_t j = 0; j < n; j++) {
        float z = u[j] / safe;
        int32_t lo, hi;
        float clo, chi;
        BRACKET(t, z, lo, hi, clo, chi);
        float width = chi - clo;
        float clamped = z > clo ? z : clo;
        clamped = clamped < chi ? clamped : chi;
        float up = (clamped - clo) / (width > 0.0f ? width : 1.0f);
        up = width > 0.0f ? up : 0.0f;
        int take_hi = splitmix_uniform(seed, first + (uint64_t)j) < up;
        codes[j] = take_hi ? hi : lo;
        float mq = (take_hi ? chi : clo) * m_new;
        float x = mq * s;
        d[j] = x * lr;
    }
    for (int64_t j = 0; j < n; j++) q[j] = (uint8_t)codes[j];
}

static void quantize_tile(const StepContext* ctx, const float* u, uint8_t* q, float s, float* d, float m_new,
                          int64_t n, uint64_t first) {
    if (ctx->stochastic)
        quantize_tile_stochastic(u, q, s, d, ctx->table, m_new, ctx->lr, n, ctx->seed, first);
    else if (ctx->table->thresholds && isfinite(m_new))
        quantize_tile_thresholds(u, q, s, d, ctx->table, ctx->codebook, m_new, ctx->lr, n);
    else
        quantize_tile_nearest(u, q, s, d, ctx->table, m_new, ctx->lr, n);
}


static void nesterov_tile(float* restrict v, const float* restrict g, float beta, float omb, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        float a = v[j] * beta;
        float c = g[j] * omb;
        v[j] = a + c;
    }
}

static void store_tile(void* out, int64_t offset, const float* restrict v, int64_t n, int out_bf16) {
    if (out_bf16) {
        uint16_t* restrict o = (uint16_t*)out + offset;
        for (int64_t j = 0; j < n; j++) o[j] = f32_to_bf16(v[j]);
    } else {
        float* restrict o = (float*)out + offset;
        for (int64_t j = 0; j < n; j++) o[j] = v[j];
    }
}

/* Software prefetch of a byte range (64-byte lines; prefetches never fault). Each block's
 * passes prefetch what comes next, one tile ahead of a whole pass: the parameter tile of pass 2
 * while pass 1 runs, the next block's gradient and codes while pass 2 runs. */
static inline void prefetch_read(const void* p, int64_t bytes) {
    const char* c = (const char*)p;
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}

static inline void prefetch_write(const void* p, int64_t bytes) {
    const char* c = (const char*)p;
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 1, 3);
}

/* ---- dtype-specific loads and parameter writes --------------------------------------- */

/* Whether a dtype's gradient tile is already the fp32 the loops read. */
#define DIRECT_f32 1
#define DIRECT_bf16 0
#define DIRECT_f16 0
#define DIRECT_f64 0

/* Statistics prefetch distance: rows about 64 KiB ahead of the rows being summed (the
 * hardware prefetcher alone left the pass at half the bandwidth of a plain read); 0 (no
 * software prefetch) for rows longer than that, long sequential runs it follows well. */
/* Column j's statistic: its chunk partials added in chunk order. */
static inline double column_total(const double* scratch, int64_t chunks, int64_t cols, int64_t j) {
    double total = 0.0;
    for (int64_t k = 0; k < chunks; k++) total += scratch[k * cols + j];
    return total;
}

static inline int64_t stats_rows_ahead(int64_t cols, int64_t element_bytes) {
    int64_t row_bytes = cols * element_bytes;
    if (row_bytes <= 0 || row_bytes > 65536) return 0;
    return (65536 + row_bytes - 1) / row_bytes;
}

#ifdef GEFEN_SIMD
/* The columns [j, cols) of four rows after the vector loop, and the four rows' sums (t: their
 * vector lanes' totals) into row_sums[0..3]. */
static inline void stats_tail4(const float* g, int64_t j, int64_t cols, double t0, double t1, double t2, double t3,
                               double* row_sums, double* partial) {
    for (; j < cols; j++) {
        double v0 = g[j], v1 = g[cols + j], v2 = g[2 * cols + j], v3 = g[3 * cols + j];
        double s0 = v0 * v0, s1 = v1 * v1, s2 = v2 * v2, s3 = v3 * v3;
        t0 += s0;
        t1 += s1;
        t2 += s2;
        t3 += s3;
        partial[j] += (s0 + s1) + (s2 + s3);
    }
    row_sums[0] = t0;
    row_sums[1] = t1;
    row_sums[2] = t2;
    row_sums[3] = t3;
}
#endif

#ifdef GEFEN_AVX2
/* The squares of four floats in float64. */
static inline __m256d squares_avx2(__m128 x) {
    __m256d d = _mm256_cvtps_pd(x);
    return _mm256_mul_pd(d, d);
}

/* Horizontal sum of four doubles: (v0 + v2) + (v1 + v3). */
static inline double lanes_total_avx2(__m256d v) {
    __m128d pair = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(pair, _mm_unpackhi_pd(pair, pair)));
}
#endif

/* fp32 statistics, four rows at a time (AVX-512: 16 columns a step, two 8-lane accumulators
 * per row; AVX2: 8 columns a step, two 4-lane accumulators per row): float64 squares, the four
 * rows' squares added into the column partials once. Returns the first row it did not sum
 * (the portable loops take the rest). */
static int64_t stats_rows4_f32(const float* grad, int64_t r, int64_t r1, int64_t rows, int64_t cols,
                               double* row_sums, double* partial) {
#ifdef GEFEN_AVX512
    const int64_t ahead = stats_rows_ahead(cols, 4);
    for (; r + 4 <= r1; r += 4) {
        const float* g = grad + r * cols;
        const float* f = g + ahead * cols;
        const int prefetch = ahead > 0 && r + ahead + 4 <= rows;
        __m512d a0 = _mm512_setzero_pd(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        int64_t j = 0;
        for (; j + 16 <= cols; j += 16) {
            if (prefetch) {
                _mm_prefetch((const char*)(f + j), _MM_HINT_T0);
                _mm_prefetch((const char*)(f + cols + j), _MM_HINT_T0);
                _mm_prefetch((const char*)(f + 2 * cols + j), _MM_HINT_T0);
                _mm_prefetch((const char*)(f + 3 * cols + j), _MM_HINT_T0);
            }
            __m512d x0 = _mm512_cvtps_pd(_mm256_loadu_ps(g + j));
            __m512d y0 = _mm512_cvtps_pd(_mm256_loadu_ps(g + j + 8));
            __m512d x1 = _mm512_cvtps_pd(_mm256_loadu_ps(g + cols + j));
            __m512d y1 = _mm512_cvtps_pd(_mm256_loadu_ps(g + cols + j + 8));
            __m512d x2 = _mm512_cvtps_pd(_mm256_loadu_ps(g + 2 * cols + j));
            __m512d y2 = _mm512_cvtps_pd(_mm256_loadu_ps(g + 2 * cols + j + 8));
            __m512d x3 = _mm512_cvtps_pd(_mm256_loadu_ps(g + 3 * cols + j));
            __m512d y3 = _mm512_cvtps_pd(_mm256_loadu_ps(g + 3 * cols + j + 8));
            x0 = _mm512_mul_pd(x0, x0);
            y0 = _mm512_mul_pd(y0, y0);
            x1 = _mm512_mul_pd(x1, x1);
            y1 = _mm512_mul_pd(y1, y1);
            x2 = _mm512_mul_pd(x2, x2);
            y2 = _mm512_mul_pd(y2, y2);
            x3 = _mm512_mul_pd(x3, x3);
            y3 = _mm512_mul_pd(y3, y3);
            a0 = _mm512_add_pd(a0, x0);
            b0 = _mm512_add_pd(b0, y0);
            a1 = _mm512_add_pd(a1, x1);
            b1 = _mm512_add_pd(b1, y1);
            a2 = _mm512_add_pd(a2, x2);
            b2 = _mm512_add_pd(b2, y2);
            a3 = _mm512_add_pd(a3, x3);
            b3 = _mm512_add_pd(b3, y3);
            __m512d c = _mm512_add_pd(_mm512_add_pd(x0, x1), _mm512_add_pd(x2, x3));
            __m512d d = _mm512_add_pd(_mm512_add_pd(y0, y1), _mm512_add_pd(y2, y3));
            _mm512_storeu_pd(partial + j, _mm512_add_pd(_mm512_loadu_pd(partial + j), c));
            _mm512_storeu_pd(partial + j + 8, _mm512_add_pd(_mm512_loadu_pd(partial + j + 8), d));
        }
        double t0 = _mm512_reduce_add_pd(_mm512_add_pd(a0, b0)), t1 = _mm512_reduce_add_pd(_mm512_add_pd(a1, b1));
        double t2 = _mm512_reduce_add_pd(_mm512_add_pd(a2, b2)), t3 = _mm512_reduce_add_pd(_mm512_add_pd(a3, b3));
        stats_tail4(g, j, cols, t0, t1, t2, t3, row_sums + r, partial);
    }
#elif defined(GEFEN_AVX2)
    const int64_t ahead = stats_rows_ahead(cols, 4);
    for (; r + 4 <= r1; r += 4) {
        const float* g = grad + r * cols;
        const float* f = g + ahead * cols;
        const int prefetch = ahead > 0 && r + ahead + 4 <= rows;
        __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        int64_t j = 0;
        for (; j + 8 <= cols; j += 8) {
            if (prefetch && (j & 15) == 0) {
                _mm_prefetch((const char*)(f + j), _MM_HINT_T0);
                _mm_prefetch((const char*)(f + cols + j), _MM_HINT_T0);
                _mm_prefetch((const char*)(f + 2 * cols + j), _MM_HINT_T0);
                _mm_prefetch((const char*)(f + 3 * cols + j), _MM_HINT_T0);
            }
            __m256d x0 = squares_avx2(_mm_loadu_ps(g + j)), y0 = squares_avx2(_mm_loadu_ps(g + j + 4));
            __m256d x1 = squares_avx2(_mm_loadu_ps(g + cols + j)), y1 = squares_avx2(_mm_loadu_ps(g + cols + j + 4));
            __m256d x2 = squares_avx2(_mm_loadu_ps(g + 2 * cols + j));
            __m256d y2 = squares_avx2(_mm_loadu_ps(g + 2 * cols + j + 4));
            __m256d x3 = squares_avx2(_mm_loadu_ps(g + 3 * cols + j));
            __m256d y3 = squares_avx2(_mm_loadu_ps(g + 3 * cols + j + 4));
            a0 = _mm256_add_pd(a0, x0);
            b0 = _mm256_add_pd(b0, y0);
            a1 = _mm256_add_pd(a1, x1);
            b1 = _mm256_add_pd(b1, y1);
            a2 = _mm256_add_pd(a2, x2);
            b2 = _mm256_add_pd(b2, y2);
            a3 = _mm256_add_pd(a3, x3);
            b3 = _mm256_add_pd(b3, y3);
            __m256d c = _mm256_add_pd(_mm256_add_pd(x0, x1), _mm256_add_pd(x2, x3));
            __m256d d = _mm256_add_pd(_mm256_add_pd(y0, y1), _mm256_add_pd(y2, y3));
            _mm256_storeu_pd(partial + j, _mm256_add_pd(_mm256_loadu_pd(partial + j), c));
            _mm256_storeu_pd(partial + j + 4, _mm256_add_pd(_mm256_loadu_pd(partial + j + 4), d));
        }
        double t0 = lanes_total_avx2(_mm256_add_pd(a0, b0)), t1 = lanes_total_avx2(_mm256_add_pd(a1, b1));
        double t2 = lanes_total_avx2(_mm256_add_pd(a2, b2)), t3 = lanes_total_avx2(_mm256_add_pd(a3, b3));
        stats_tail4(g, j, cols, t0, t1, t2, t3, row_sums + r, partial);
    }
#else
    (void)grad, (void)r1, (void)rows, (void)cols, (void)row_sums, (void)partial;
#endif
    return r;
}

/* The other dtypes go straight to the portable loops. */
#define STATS_ROWS4_bf16(grad, first, ...) (first)
#define STATS_ROWS4_f16(grad, first, ...) (first)
#define STATS_ROWS4_f64(grad, first, ...) (first)
#define STATS_ROWS4_f32(grad, first, r1, rows, cols, row_sums, partial) \
    stats_rows4_f32(grad, first, r1, rows, cols, row_sums, partial)

#define DEFINE_DTYPE(SUF, PT, CT, LOADG, LOADP, STOREP)                                                      \
    static void load_tile_##SUF(const PT* restrict src, float* restrict dst, float sign, int64_t n) {          \
        for (int64_t j = 0; j < n; j++) dst[j] = LOADG(src[j]) * sign;                                         \
    }                                                                                                          \
                                                                                                               \
    static void write_tile_##SUF(PT* restrict p, const float* restrict d, float decay, int apply_decay,        \
                                 int64_t n) {                                                                  \
        if (apply_decay) {                                                                                     \
            CT f = (CT)decay;                                                                                  \
            for (int64_t j = 0; j < n; j++) {                                                                  \
                CT x = LOADP(p[j]) * f;                                                                        \
                x = LOADP(STOREP(x));                                                                          \
                p[j] = STOREP(x - (CT)d[j]);                                                                   \
            }                                                                                                  \
        } else {                                                                                               \
            for (int64_t j = 0; j < n; j++) p[j] = STOREP(LOADP(p[j]) - (CT)d[j]);                             \
        }                                                                                                      \
    }                                                                                                          \
                                                                                                               \
    /* The float64 sum of fl(g)^2 over one block (the block path's second-moment statistic;      \
     * lane k sums the elements j = k mod LANES of each tile, the tail lane 0). */               \
    static double block_sumsq_##SUF(const PT* g, int64_t n) {                                    \
        float gbuf[TILE];                                                                        \
        double acc[LANES];                                                                       \
        for (int k = 0; k < LANES; k++) acc[k] = 0.0;                                            \
        for (int64_t t0 = 0; t0 < n; t0 += TILE) {                                               \
            int64_t len = n - t0 < TILE ? n - t0 : TILE;                                         \
            const float* x = gbuf;                                                               \
            if (DIRECT_##SUF) x = (const float*)(const void*)(g + t0);                           \
            else load_tile_##SUF(g + t0, gbuf, 1.0f, len);                                       \
            sumsq_tile(x, len, acc);                                                             \
        }                                                                                        \
        double total = 0.0;                                                                      \
        for (int k = 0; k < LANES; k++) total += acc[k];                                         \
        return total;                                                                            \
    }                                                                                            \
                                                                                                 \
    /* One tile of the gradient as the momentum reads it: signed fp32, read in place when it     \
     * already is. */                                                                            \
    static const float* gradient_tile_##SUF(const StepContext* ctx, const PT* g, int64_t t0, int64_t len, \
                                            float* gbuf) {                                       \
        if (DIRECT_##SUF && ctx->sign == 1.0f) return (const float*)(const void*)(g + t0);       \
        load_tile_##SUF(g + t0, gbuf, ctx->sign, len);                                           \
        return gbuf;                                                                             \
    }                                                                                            \
                                                                                                 \
    /* Pass 1 over one block (first: its flat index): the momentum u (kept in ubuf when the      \
     * block fits) and max |u| (NaN if any u is NaN). */                                         \
    static float block_stats_##SUF(const StepContext* ctx, const PT* g, const uint8_t* q, float m_old, \
                                   int64_t n, float* ubuf, const Denominator* den, int64_t first, \
                                   const PT* upcoming) {                                         \
        float gbuf[TILE], spill[TILE], hbuf[TILE];                                               \
        float amax[LANES];                                                                       \
        int32_t nan[LANES];                                                                      \
        for (int k = 0; k < LANES; k++) {                                                        \
            amax[k] = 0.0f;                                                                      \
            nan[k] = 0;                                                                          \
        }                                                                                        \
        for (int64_t t0 = 0; t0 < n; t0 += TILE) {                                               \
            int64_t len = n - t0 < TILE ? n - t0 : TILE;                                         \
            if (upcoming != NULL) prefetch_write(upcoming + t0, len * (int64_t)sizeof(PT));      \
            const float* gsrc = gradient_tile_##SUF(ctx, g, t0, len, gbuf);                      \
            const Preconditioner pre = preconditioner_of(den, first + t0, hbuf, len, gsrc, 1);   \
            momentum_tile(gsrc, &pre, q + t0, ctx->codebook, m_old, ctx->beta1, ctx->omb1, len,  \
                          n <= UBUF ? ubuf + t0 : spill, amax, nan);                             \
        }                                                                                        \
        float best = 0.0f;                                                                       \
        int32_t any_nan = 0;                                                                     \
        for (int k = 0; k < LANES; k++) {                                                        \
            best = amax[k] > best ? amax[k] : best;                                              \
            any_nan |= nan[k];                                                                   \
        }                                                                                        \
        return any_nan ? NAN : best;                                                             \
    }                                                                                            \
                                                                                                 \
    /* Whether nearest rounding may have to settle an element of this tile: one has a zero      \
     * gradient (its fp32 value, as the reference reads it). */                                 \
    static int settles_##SUF(const StepContext* ctx, const PT* g, int64_t n) {                   \
        if (ctx->stochastic) return 0;                                                           \
        int zero = 0;                                                                            \
        for (int64_t j = 0; j < n; j++) zero |= LOADG(g[j]) == 0.0f;                             \
        return zero;                                                                             \
    }                                                                                            \
                                                                                                 \
    /* Nearest rounding settles a zero-gradient element whose new code decodes to no less        \
     * magnitude than its old, non-zero one (|C[q'] M'| >= |C[q] M| > 0: it failed to decay): the \
     * code moves one place towards zero and its write is recomputed as quantize_tile's          \
     * (gefen_core.reference_ops.requantized_momentum). old: the tile's codes before. */         \
    static void settle_tile_##SUF(const StepContext* ctx, const PT* g, const uint8_t* old, uint8_t* q, \
                                  float* d, float s, float m_old, float m_new, int64_t n) {      \
        const float* cb = ctx->codebook;                                                         \
        for (int64_t j = 0; j < n; j++) {                                                        \
            if (LOADG(g[j]) != 0.0f) continue;                                                   \
            int32_t k = q[j];                                                                    \
            float c = cb[k];                                                                     \
            float before = fabsf(cb[old[j]] * m_old);                                            \
            if (before == 0.0f || !(fabsf(c * m_new) >= before)) continue; /* (so c != 0) */    \
            k += c > 0.0f ? -1 : 1;                                                              \
            q[j] = (uint8_t)k;                                                                   \
            float mq = cb[k] * m_new;                                                            \
            float x = mq * s;                                                                    \
            d[j] = x * ctx->lr;                                                                  \
        }                                                                                        \
    }                                                                                            \
                                                                                                 \
    /* The momentum of one tile for pass 2: from ubuf, or recomputed when the block did not fit. */ \
    static const float* tile_momentum_##SUF(const StepContext* ctx, const PT* g, const uint8_t* q, \
                                            float m_old, int64_t n_block, int64_t t0, int64_t len, \
                                            const float* ubuf, float* scratch, const Denominator* den, \
                                            int64_t first) {                                     \
        if (n_block <= UBUF) return ubuf + t0;                                                   \
        float gbuf[TILE], hbuf[TILE];                                                            \
        float amax[LANES];                                                                       \
        int32_t nan[LANES];                                                                      \
        for (int k = 0; k < LANES; k++) {                                                        \
            amax[k] = 0.0f;                                                                      \
            nan[k] = 0;                                                                          \
        }                                                                                        \
        const float* gsrc = gradient_tile_##SUF(ctx, g, t0, len, gbuf);                          \
        const Preconditioner pre = preconditioner_of(den, first + t0, hbuf, len, gsrc, 0);       \
        momentum_tile(gsrc, &pre, q + t0, ctx->codebook, m_old, ctx->beta1, ctx->omb1, len, scratch, amax, nan); \
        return scratch;                                                                          \
    }                                                                                            \
                                                                                                 \
    /* Block b's momentum of the preconditioned gradient (den), requantised, and its write       \
     * d = fl(fl(fl(C[q'] * M') * INV_BC1) * LR) (both paths after their second moment). The     \
     * block starts at b * period and holds n elements (n < period only for a ragged last block). */ \
    static void precondition_write_##SUF(const StepContext* ctx, PT* param, const PT* grad, uint8_t* indices, \
                                         float* magnitude, int64_t b, int64_t blocks, int64_t period, \
                                         int64_t n, const Denominator* den) {                    \
        float ubuf[UBUF], dbuf[TILE], scratch[TILE];                                             \
        int64_t off = b * period;                                                                \
        float m_old = magnitude[b];                                                              \
        float m_new = block_stats_##SUF(ctx, grad + off, indices + off, m_old, n, ubuf, den, off, param + off); \
        magnitude[b] = m_new;                                                                    \
        for (int64_t t0 = 0; t0 < n; t0 += TILE) {                                               \
            int64_t len = n - t0 < TILE ? n - t0 : TILE;                                         \
            const float* u = tile_momentum_##SUF(ctx, grad + off, indices + off, m_old, n, t0, len, ubuf, \
                                                 scratch, den, off);                             \
            if (b + 1 < blocks) {                                                                \
                prefetch_read(grad + off + period + t0, len * (int64_t)sizeof(PT));              \
                prefetch_read(indices + off + period + t0, len);                                 \
            }                                                                                    \
            uint8_t old[TILE];                                                                   \
            const int settle = settles_##SUF(ctx, grad + off + t0, len);                         \
            if (settle) memcpy(old, indices + off + t0, (size_t)len);                            \
            quantize_tile(ctx, u, indices + off + t0, ctx->inv_bc1, dbuf, m_new, len, (uint64_t)(off + t0)); \
            if (settle)                                                                          \
                settle_tile_##SUF(ctx, grad + off + t0, old, indices + off + t0, dbuf, ctx->inv_bc1, m_old, \
                                  m_new, len);                                                   \
            write_tile_##SUF(param + off + t0, dbuf, ctx->decay, ctx->apply_decay, len);         \
        }                                                                                        \
    }                                                                                            \
                                                                                                 \
    static void block_step_block_##SUF(const StepContext* ctx, PT* param, const PT* grad, uint8_t* indices, \
                                       float* magnitude, float* vmean, int64_t b, int64_t blocks, int64_t period, \
                                       int64_t numel) { \
        int64_t n = numel - b * period < period ? numel - b * period : period; /* ragged last block */ \
        double sumsq = block_sumsq_##SUF(grad + b * period, n); \
        float mean = (float)(sumsq / (double)n); \
        float v = vmean[b] * ctx->beta2; \
        float w = mean * ctx->omb2; \
        v = v + w; \
        vmean[b] = v; \
        float h = sqrtf(v) * ctx->bc2; \
        h = h + ctx->eps; \
        const Denominator den = {h, NULL, NULL, 0, 0.0f, NULL, 0.0f, 0.0f, 0.0f}; \
        precondition_write_##SUF(ctx, param, grad, indices, magnitude, b, blocks, period, n, &den); \
    } \
 \
    static void block_step_##SUF(const StepContext* ctx, PT* param, const PT* grad, uint8_t* indices, \
                                 float* magnitude, float* vmean, int64_t blocks, int64_t period, int64_t numel, \
                                 int threads) { \
        int64_t b; \
        if (PARALLEL(numel, threads)) { \
            _Pragma("omp parallel for schedule(static) num_threads(threads)") \
            for (b = 0; b < blocks; b++) \
                block_step_block_##SUF(ctx, param, grad, indices, magnitude, vmean, b, blocks, period, numel); \
        } else { \
            for (b = 0; b < blocks; b++) \
                block_step_block_##SUF(ctx, param, grad, indices, magnitude, vmean, b, blocks, period, numel); \
        } \
    } \
 \
    static void factored_step_##SUF(const StepContext* ctx, PT* param, const PT* grad, uint8_t* indices, \
                                    float* magnitude, const float* row_factor, const float* col_root, \
                                    int64_t blocks, int64_t period, int64_t cols, int threads) { \
        const Denominator den = {0.0f, row_factor, col_root, cols, ctx->eps, NULL, 0.0f, 0.0f, 0.0f}; \
        int64_t b; \
        if (PARALLEL(blocks * period, threads)) { \
            _Pragma("omp parallel for schedule(static) num_threads(threads)") \
            for (b = 0; b < blocks; b++) \
                precondition_write_##SUF(ctx, param, grad, indices, magnitude, b, blocks, period, period, &den); \
        } else { \
            for (b = 0; b < blocks; b++) \
                precondition_write_##SUF(ctx, param, grad, indices, magnitude, b, blocks, period, period, &den); \
        } \
    }                                                                                            \
    /* The element path: Adam's v of each element advanced in the block's first pass. */       \
    static void element_step_##SUF(const StepContext* ctx, PT* param, const PT* grad, uint8_t* indices, \
                                   float* magnitude, float* v, int64_t blocks, int64_t period, int threads) { \
        const Denominator den = {0.0f, NULL, NULL, 0, ctx->eps, v, ctx->beta2, ctx->omb2, ctx->bc2}; \
        int64_t b; \
        if (PARALLEL(blocks * period, threads)) { \
            _Pragma("omp parallel for schedule(static) num_threads(threads)") \
            for (b = 0; b < blocks; b++) \
                precondition_write_##SUF(ctx, param, grad, indices, magnitude, b, blocks, period, period, &den); \
        } else { \
            for (b = 0; b < blocks; b++) \
                precondition_write_##SUF(ctx, param, grad, indices, magnitude, b, blocks, period, period, &den); \
        } \
    }                                                                                            \
    /* GefenMuon: requantise the momentum EMA u = fl(fl(C[q] M) beta) + fl(g (1 - beta)) and write   \
     * the Newton-Schulz input C[q'] M' (Nesterov: fl(fl(C[q'] M' beta) + fl(g (1 - beta)))). */           \
    static void muon_block_##SUF(const StepContext* ctx, const PT* grad, uint8_t* indices, float* magnitude, \
                                 void* out, int out_bf16, int64_t b, int64_t blocks, int64_t period, int nesterov) { \
            float ubuf[UBUF], vbuf[TILE], gbuf[TILE], scratch[TILE];                                           \
            int64_t off = b * period;                                                                          \
            float m_old = magnitude[b];                                                                        \
            float m_new = block_stats_##SUF(ctx, grad + off, indices + off, m_old, period, ubuf, NULL, off,    \
                                            (const PT*)NULL);                                                  \
            magnitude[b] = m_new;                                                                              \
            for (int64_t t0 = 0; t0 < period; t0 += TILE) {                                                    \
                int64_t len = period - t0 < TILE ? period - t0 : TILE;                                         \
                const float* u = tile_momentum_##SUF(ctx, grad + off, indices + off, m_old, period, t0, len,   \
                                                     ubuf, scratch, NULL, off);                                \
                if (b + 1 < blocks) {                                                                          \
                    prefetch_read(grad + off + period + t0, len * (int64_t)sizeof(PT));                        \
                    prefetch_read(indices + off + period + t0, len);                                           \
                }                                                                                              \
                uint8_t old[TILE];                                                                             \
                const int settle = settles_##SUF(ctx, grad + off + t0, len);                                   \
                if (settle) memcpy(old, indices + off + t0, (size_t)len);                                      \
                quantize_tile(ctx, u, indices + off + t0, 1.0f, vbuf, m_new, len, (uint64_t)(off + t0));       \
                if (settle) settle_tile_##SUF(ctx, grad + off + t0, old, indices + off + t0, vbuf, 1.0f, m_old, m_new, len); \
                if (nesterov) {                                                                                \
                    load_tile_##SUF(grad + off + t0, gbuf, 1.0f, len);                                         \
                    nesterov_tile(vbuf, gbuf, ctx->beta1, ctx->omb1, len);                                     \
                }                                                                                              \
                store_tile(out, off + t0, vbuf, len, out_bf16);                                                \
            }                                                                                                  \
    } \
 \
    static void muon_momentum_##SUF(const StepContext* ctx, const PT* grad, uint8_t* indices, float* magnitude, \
                                    void* out, int out_bf16, int64_t blocks, int64_t period, int nesterov, \
                                    int threads) { \
        int64_t b; \
        if (PARALLEL(blocks * period, threads)) { \
            _Pragma("omp parallel for schedule(static) num_threads(threads)") \
            for (b = 0; b < blocks; b++) \
                muon_block_##SUF(ctx, grad, indices, magnitude, out, out_bf16, b, blocks, period, nesterov); \
        } else { \
            for (b = 0; b < blocks; b++) \
                muon_block_##SUF(ctx, grad, indices, magnitude, out, out_bf16, b, blocks, period, nesterov); \
        } \
    } \
 \
    /* Blocks of period elements over numel (the last one shorter when ragged). */                       \
    static void histogram_##SUF(const PT* grad, int64_t numel, int64_t period, int64_t* counts, int threads) { \
        const int64_t blocks = numel / period + (numel % period != 0); /* no overflow near INT64_MAX */          \
        _Pragma("omp parallel num_threads(threads) if(numel >= PARALLEL_MIN && threads > 1)")                 \
        {                                                                                                      \
            int64_t* local = (int64_t*)calloc(BUCKETS, sizeof(int64_t));                                       \
            float gbuf[TILE];                                                                                  \
            int64_t b;                                                                                         \
            _Pragma("omp for schedule(static)")                                                                \
            for (b = 0; b < blocks; b++) {                                                                     \
                const PT* g = grad + b * period;                                                               \
                const int64_t n = numel - b * period < period ? numel - b * period : period;                   \
                float amax = 0.0f;                                                                             \
                for (int64_t t0 = 0; t0 < n; t0 += TILE) {                                                     \
                    int64_t len = n - t0 < TILE ? n - t0 : TILE;                                               \
                    load_tile_##SUF(g + t0, gbuf, 1.0f, len);                                                  \
                    amax = tile_absmax(gbuf, len, amax);                                                       \
                }                                                                                              \
                float safe = amax > 0.0f ? amax : 1.0f;                                                        \
                for (int64_t t0 = 0; t0 < n; t0 += TILE) {                                                     \
                    int64_t len = n - t0 < TILE ? n - t0 : TILE;                                               \
                    load_tile_##SUF(g + t0, gbuf, 1.0f, len);                                                  \
                    count_tile(gbuf, len, safe, local);                                                        \
                }                                                                                              \
            }                                                                                                  \
            _Pragma("omp critical")                                                                            \
            for (int k = 0; k < BUCKETS; k++) counts[k] += local[k];                                           \
            free(local);                                                                                       \
        }                                                                                                      \
    }                                                                                                          \
                                                                                                               \
    static void stats_chunk_##SUF(const PT* grad, int64_t rows, int64_t cols, double* row_sums, double* scratch, \
                                  int64_t per_chunk, int64_t ahead, int64_t c) { \
            double* partial = scratch + c * cols;                                                              \
            for (int64_t j = 0; j < cols; j++) partial[j] = 0.0;                                               \
            int64_t r1 = (c + 1) * per_chunk < rows ? (c + 1) * per_chunk : rows;                              \
            int64_t r = STATS_ROWS4_##SUF(grad, c * per_chunk, r1, rows, cols, row_sums, partial);             \
            for (; r + 2 <= r1; r += 2) {                                                                      \
                const PT* g0 = grad + r * cols;                                                                \
                const PT* g1 = g0 + cols;                                                                      \
                if (ahead && r + ahead + 2 <= rows) prefetch_read(g0 + ahead * cols, 2 * cols * (int64_t)sizeof(PT)); \
                double a0[16] = {0}, a1[16] = {0};                                                             \
                int64_t j = 0;                                                                                 \
                for (; j + 16 <= cols; j += 16) {                                                              \
                    for (int k = 0; k < 16; k++) {                                                             \
                        double x0 = SQUARE_SOURCE_##SUF(g0[j + k]);                                            \
                        double x1 = SQUARE_SOURCE_##SUF(g1[j + k]);                                            \
                        double s0 = x0 * x0, s1 = x1 * x1;                                                     \
                        a0[k] += s0;                                                                           \
                        a1[k] += s1;                                                                           \
                        partial[j + k] += s0 + s1;                                                             \
                    }                                                                                          \
                }                                                                                              \
                for (; j < cols; j++) {                                                                        \
                    double x0 = SQUARE_SOURCE_##SUF(g0[j]);                                                    \
                    double x1 = SQUARE_SOURCE_##SUF(g1[j]);                                                    \
                    double s0 = x0 * x0, s1 = x1 * x1;                                                         \
                    a0[0] += s0;                                                                               \
                    a1[0] += s1;                                                                               \
                    partial[j] += s0 + s1;                                                                     \
                }                                                                                              \
                double t0 = 0.0, t1 = 0.0;                                                                     \
                for (int k = 0; k < 16; k++) {                                                                 \
                    t0 += a0[k];                                                                               \
                    t1 += a1[k];                                                                               \
                }                                                                                              \
                row_sums[r] = t0;                                                                              \
                row_sums[r + 1] = t1;                                                                          \
            }                                                                                                  \
            for (; r < r1; r++) {                                                                              \
                const PT* g = grad + r * cols;                                                                 \
                double a0[16] = {0};                                                                           \
                int64_t j = 0;                                                                                 \
                for (; j + 16 <= cols; j += 16) {                                                              \
                    for (int k = 0; k < 16; k++) {                                                             \
                        double x = SQUARE_SOURCE_##SUF(g[j + k]);                                              \
                        double sq = x * x;                                                                     \
                        a0[k] += sq;                                                                           \
                        partial[j + k] += sq;                                                                  \
                    }                                                                                          \
                }                                                                                              \
                for (; j < cols; j++) {                                                                        \
                    double x = SQUARE_SOURCE_##SUF(g[j]);                                                      \
                    double sq = x * x;                                                                         \
                    a0[0] += sq;                                                                               \
                    partial[j] += sq;                                                                          \
                }                                                                                              \
                double total = 0.0;                                                                            \
                for (int k = 0; k < 16; k++) total += a0[k];                                                   \
                row_sums[r] = total;                                                                           \
            }                                                                                                  \
    } \
 \
    static void factored_stats_##SUF(const PT* grad, int64_t rows, int64_t cols, double* row_sums, \
                                     double* col_sums, double* scratch, int64_t chunks, int threads) { \
        int64_t per_chunk = (rows + chunks - 1) / chunks; \
        const int64_t ahead = stats_rows_ahead(cols, (int64_t)sizeof(PT)); \
        int64_t c, j; \
        if (PARALLEL(rows * cols, threads)) { \
            _Pragma("omp parallel for schedule(static) num_threads(threads)") \
            for (c = 0; c < chunks; c++) stats_chunk_##SUF(grad, rows, cols, row_sums, scratch, per_chunk, ahead, c); \
        } else { \
            for (c = 0; c < chunks; c++) stats_chunk_##SUF(grad, rows, cols, row_sums, scratch, per_chunk, ahead, c); \
        } \
        if (PARALLEL(chunks * cols, threads)) { \
            _Pragma("omp parallel for schedule(static) num_threads(threads)") \
            for (j = 0; j < cols; j++) col_sums[j] = column_total(scratch, chunks, cols, j); \
        } else { \
            for (j = 0; j < cols; j++) col_sums[j] = column_total(scratch, chunks, cols, j); \
        } \
    }

static float tile_absmax(const float* restrict g, int64_t n, float start) {
    float lanes[LANES];
    for (int k = 0; k < LANES; k++) lanes[k] = start;
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int k = 0; k < LANES; k++) {
            float a = fabsf(g[j + k]);
            lanes[k] = a > lanes[k] ? a : lanes[k];
        }
    for (; j < n; j++) {
        float a = fabsf(g[j]);
        lanes[0] = a > lanes[0] ? a : lanes[0];
    }
    float best = lanes[0];
    for (int k = 1; k < LANES; k++) best = lanes[k] > best ? lanes[k] : best;
    return best;
}

/* bin = clamp(floor(fl(fl(g / a) + 1) * 2048), 0, 4095) */
static void count_tile(const float* restrict g, int64_t n, float safe, int64_t* restrict counts) {
    int32_t bins[TILE];
    for (int64_t j = 0; j < n; j++) {
        float z = g[j] / safe;
        int32_t b = (int32_t)floorf((z + 1.0f) * 2048.0f);
        b = b > 0 ? b : 0;
        bins[j] = b < BUCKETS - 1 ? b : BUCKETS - 1;
    }
    for (int64_t j = 0; j < n; j++) counts[bins[j]]++;
}

#define ID(x) (x)
#define TO_FLOAT(x) ((float)(x))
#define SQUARE_SOURCE_f32(x) ((double)(x))
#define SQUARE_SOURCE_bf16(x) ((double)bf16_to_f32(x))
#define SQUARE_SOURCE_f16(x) ((double)f16_to_f32(x))
#define SQUARE_SOURCE_f64(x) (x)

DEFINE_DTYPE(f32, float, float, ID, ID, ID)
DEFINE_DTYPE(bf16, uint16_t, float, bf16_to_f32, bf16_to_f32, f32_to_bf16)
DEFINE_DTYPE(f16, uint16_t, float, f16_to_f32, f16_to_f32, f32_to_f16)
DEFINE_DTYPE(f64, double, double, TO_FLOAT, ID, ID)

/* ---- exported entry points ----------------------------------------------------------- */
/* Each returns 0 on success, -1 for an unknown dtype (the Python side checks first), -2 when
 * a buffer cannot be allocated. */

/* The step ops take lists (one call per parameter group): each tensor is one row of
 * `fields` int64 values in `entries`, built by gefen_kernels.cpu_ops, starting with its
 * dtype code and element count (the layouts below). Rows of fewer than PARALLEL_MIN
 * elements run one per thread, spread over the threads; larger rows run one after another,
 * each split over all threads. A row's result does not depend on the thread that runs it.
 * `scalars` + i * scalar_stride is row i's packet (stride 0: one shared packet); `seeds`
 * holds one stochastic-rounding seed per row, or is NULL for nearest rounding. */
typedef struct {
    const int64_t* entries;
    int64_t fields;
    const float* codebook;
    const CodebookTable* table;
    const float* scalars;
    int64_t scalar_stride;
    const int64_t* seeds;
    int apply_decay, maximize;
    int64_t chunks; /* factored statistics: fixed row chunks (see gefen_factored_stats) */
    int nesterov;   /* GefenMuon's momentum */
} ListCall;

typedef int (*EntryFn)(const ListCall* call, int64_t i, int threads);

static int run_entries(const ListCall* call, int64_t n, EntryFn fn, int threads) {
    int64_t small = 0, i;
    int status = 0;
    for (i = 0; i < n; i++) {
        int64_t dtype = call->entries[i * call->fields];
        if (dtype < DT_F32 || dtype > DT_F64) return -1;
        if (call->entries[i * call->fields + 1] < ENTRY_SPLIT_MIN) small += call->entries[i * call->fields + 1];
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(| : status) if(small >= PARALLEL_MIN && threads > 1)
    for (i = 0; i < n; i++)
        if (call->entries[i * call->fields + 1] < ENTRY_SPLIT_MIN) status |= fn(call, i, 1);
    for (i = 0; i < n; i++)
        if (call->entries[i * call->fields + 1] >= ENTRY_SPLIT_MIN) status |= fn(call, i, threads);
    return status;
}

static void entry_context(StepContext* ctx, const ListCall* call, int64_t i) {
    read_context(ctx, call->scalars + i * call->scalar_stride, call->codebook, call->table,
                 call->seeds != NULL ? call->seeds + i : NULL, call->apply_decay, call->maximize);
}

#define PTR(e, k) ((void*)(intptr_t)(e)[k])
/* NAME_f32/_bf16/_f16/_f64(...) by a dtype code already checked (run_entries, or the caller). */
#define BY_DTYPE(code, NAME, ...)                        \
    switch (code) {                                      \
        case DT_F32: NAME##_f32(__VA_ARGS__); break;     \
        case DT_BF16: NAME##_bf16(__VA_ARGS__); break;   \
        case DT_F16: NAME##_f16(__VA_ARGS__); break;     \
        default: NAME##_f64(__VA_ARGS__); break;         \
    }

/* block step rows: dtype, numel, param, grad, indices, magnitude, vmean, blocks, period; the last
 * block holds numel - (blocks - 1) * period elements (ragged when that is below period). */
enum { BS_PARAM = 2, BS_GRAD, BS_INDICES, BS_MAGNITUDE, BS_VMEAN, BS_BLOCKS, BS_PERIOD, BS_FIELDS };

static int block_step_entry(const ListCall* call, int64_t i, int threads) {
    const int64_t* e = call->entries + i * BS_FIELDS;
    StepContext ctx;
    entry_context(&ctx, call, i);
    BY_DTYPE(e[0], block_step, &ctx, PTR(e, BS_PARAM), PTR(e, BS_GRAD), PTR(e, BS_INDICES), PTR(e, BS_MAGNITUDE),
             PTR(e, BS_VMEAN), e[BS_BLOCKS], e[BS_PERIOD], e[1], threads)
    return 0;
}

/* table: a caller-owned CodebookTable (gefen_table_bytes() bytes, zeroed once), reused across
 * calls and rebuilt only when the codebook changes; one per calling thread. */
int gefen_block_step(int64_t n, const int64_t* entries, const float* codebook, const float* scalars,
                     int64_t scalar_stride, const int64_t* seeds, int apply_decay, int maximize, int threads,
                     void* table) {
    prepare_table((CodebookTable*)table, codebook);
    ListCall call = {entries, BS_FIELDS, codebook, (const CodebookTable*)table, scalars, scalar_stride, seeds,
                     apply_decay, maximize, 0};
    return run_entries(&call, n, block_step_entry, threads);
}

/* element step rows: the block step's layout, with v (one fp32 per element) for vmean; the
 * blocks tile the parameter. */
static int element_step_entry(const ListCall* call, int64_t i, int threads) {
    const int64_t* e = call->entries + i * BS_FIELDS;
    StepContext ctx;
    entry_context(&ctx, call, i);
    BY_DTYPE(e[0], element_step, &ctx, PTR(e, BS_PARAM), PTR(e, BS_GRAD), PTR(e, BS_INDICES), PTR(e, BS_MAGNITUDE),
             PTR(e, BS_VMEAN), e[BS_BLOCKS], e[BS_PERIOD], threads)
    return 0;
}

int gefen_element_step(int64_t n, const int64_t* entries, const float* codebook, const float* scalars,
                       int64_t scalar_stride, const int64_t* seeds, int apply_decay, int maximize, int threads,
                       void* table) {
    prepare_table((CodebookTable*)table, codebook);
    ListCall call = {entries, BS_FIELDS, codebook, (const CodebookTable*)table, scalars, scalar_stride, seeds,
                     apply_decay, maximize, 0};
    return run_entries(&call, n, element_step_entry, threads);
}

/* factored step rows: dtype, numel, param, grad, indices, magnitude, row_factor, v_col, blocks, period, cols */
enum { FS_PARAM = 2, FS_GRAD, FS_INDICES, FS_MAGNITUDE, FS_ROW_FACTOR, FS_V_COL, FS_BLOCKS, FS_PERIOD, FS_COLS,
       FS_FIELDS };

static int factored_step_entry(const ListCall* call, int64_t i, int threads) {
    const int64_t* e = call->entries + i * FS_FIELDS;
    int64_t cols = e[FS_COLS];
    const float* v_col = (const float*)PTR(e, FS_V_COL);
    float* col_root = (float*)malloc((size_t)(cols > 0 ? cols : 1) * sizeof(float));
    if (!col_root) return -2;
    for (int64_t j = 0; j < cols; j++) col_root[j] = sqrtf(v_col[j]);
    StepContext ctx;
    entry_context(&ctx, call, i);
    BY_DTYPE(e[0], factored_step, &ctx, PTR(e, FS_PARAM), PTR(e, FS_GRAD), PTR(e, FS_INDICES), PTR(e, FS_MAGNITUDE),
             (const float*)PTR(e, FS_ROW_FACTOR), col_root, e[FS_BLOCKS], e[FS_PERIOD], cols, threads)
    free(col_root);
    return 0;
}

int gefen_factored_step(int64_t n, const int64_t* entries, const float* codebook, const float* scalars,
                        int64_t scalar_stride, const int64_t* seeds, int apply_decay, int maximize, int threads,
                        void* table) {
    prepare_table((CodebookTable*)table, codebook);
    ListCall call = {entries, FS_FIELDS, codebook, (const CodebookTable*)table, scalars, scalar_stride, seeds,
                     apply_decay, maximize, 0};
    return run_entries(&call, n, factored_step_entry, threads);
}

/* scratch: chunks * cols doubles; chunks is fixed by the caller, so the summation order does
 * not depend on the thread count. */
int gefen_factored_stats(int dtype, const void* grad, int64_t rows, int64_t cols, double* row_sums, double* col_sums,
                         double* scratch, int64_t chunks, int threads) {
    if (dtype < DT_F32 || dtype > DT_F64) return -1;
    BY_DTYPE(dtype, factored_stats, grad, rows, cols, row_sums, col_sums, scratch, chunks, threads)
    return 0;
}

/* The factored second moment's small part after the statistics (gefen.factored_moments/1):
 * mean = fl(sumsq / n) (float64 division; n = 0 counts as 1), v = fl(fl(v * BETA2) + fl(mean * ONE_MINUS_BETA2)) for
 * rows and columns, d = max(fl(sum_j float64(v_col_j) / cols), FLT_MIN) (a NaN stays NaN),
 * row_factor = fl(fl(v_row / d) * BC2). O(rows + cols): one thread. */
static void factored_moments_update(const double* row_sums, const double* col_sums, int64_t rows, int64_t cols,
                                    float* v_row, float* v_col, const float* scalars, float* row_factor) {
    const float beta2 = scalars[S_BETA2], omb2 = scalars[S_OMB2], bc2 = scalars[S_BC2];
    const double nrows = rows > 0 ? (double)rows : 1.0, ncols = cols > 0 ? (double)cols : 1.0; /* empty: means 0 */
    for (int64_t i = 0; i < rows; i++) {
        float mean = (float)(row_sums[i] / ncols);
        float kept = v_row[i] * beta2;
        float added = mean * omb2;
        v_row[i] = kept + added;
    }
    double total = 0.0;
    for (int64_t j = 0; j < cols; j++) {
        float mean = (float)(col_sums[j] / nrows);
        float kept = v_col[j] * beta2;
        float added = mean * omb2;
        v_col[j] = kept + added;
        total += (double)v_col[j];
    }
    float d = (float)(total / ncols);
    if (d < FLT_MIN) d = FLT_MIN;
    for (int64_t i = 0; i < rows; i++) {
        float ratio = v_row[i] / d;
        row_factor[i] = ratio * bc2;
    }
}

/* factored moments rows: dtype, numel, grad, rows, cols, v_row, v_col, row_factor. Each row
 * sums its statistics in min(chunks, rows) fixed row chunks (as gefen_factored_stats). */
enum { FM_GRAD = 2, FM_ROWS, FM_COLS, FM_V_ROW, FM_V_COL, FM_ROW_FACTOR, FM_FIELDS };

static int factored_moments_entry(const ListCall* call, int64_t i, int threads) {
    const int64_t* e = call->entries + i * FM_FIELDS;
    int64_t rows = e[FM_ROWS], cols = e[FM_COLS];
    int64_t chunks = rows < call->chunks ? (rows > 0 ? rows : 1) : call->chunks;
    double* scratch = (double*)malloc((size_t)(chunks * cols + rows + cols + 1) * sizeof(double));
    if (!scratch) return -2;
    double* row_sums = scratch + chunks * cols;
    double* col_sums = row_sums + rows;
    int status = gefen_factored_stats((int)e[0], PTR(e, FM_GRAD), rows, cols, row_sums, col_sums, scratch, chunks,
                                      threads);
    if (status == 0)
        factored_moments_update(row_sums, col_sums, rows, cols, (float*)PTR(e, FM_V_ROW), (float*)PTR(e, FM_V_COL),
                                call->scalars + i * call->scalar_stride, (float*)PTR(e, FM_ROW_FACTOR));
    free(scratch);
    return status;
}

int gefen_factored_moments(int64_t n, const int64_t* entries, const float* scalars, int64_t scalar_stride,
                           int64_t chunks, int threads) {
    ListCall call = {entries, FM_FIELDS, NULL, NULL, scalars, scalar_stride, NULL, 0, 0, chunks > 0 ? chunks : 1};
    return run_entries(&call, n, factored_moments_entry, threads);
}

/* muon momentum rows: dtype, numel, grad, indices, magnitude, out, out_bf16, blocks, period. The
 * packet (gefen_core.step_scalars.muon_scalars) is [beta, 1 - beta]; out is bf16 or fp32. */
enum { MM_GRAD = 2, MM_INDICES, MM_MAGNITUDE, MM_OUT, MM_OUT_BF16, MM_BLOCKS, MM_PERIOD, MM_FIELDS };

static int muon_momentum_entry(const ListCall* call, int64_t i, int threads) {
    const int64_t* e = call->entries + i * MM_FIELDS;
    const float* scalars = call->scalars + i * call->scalar_stride;
    float packet[9] = {1.0f, 1.0f, 1.0f, 1.0f, scalars[0], scalars[1], 0.0f, 0.0f, 0.0f};
    StepContext ctx;
    read_context(&ctx, packet, call->codebook, call->table, call->seeds != NULL ? call->seeds + i : NULL, 0, 0);
    BY_DTYPE(e[0], muon_momentum, &ctx, PTR(e, MM_GRAD), PTR(e, MM_INDICES), PTR(e, MM_MAGNITUDE), PTR(e, MM_OUT),
             (int)e[MM_OUT_BF16], e[MM_BLOCKS], e[MM_PERIOD], call->nesterov, threads)
    return 0;
}

int gefen_muon_momentum(int64_t n, const int64_t* entries, const float* codebook, const float* scalars,
                        int64_t scalar_stride, const int64_t* seeds, int nesterov, int threads, void* table) {
    prepare_table((CodebookTable*)table, codebook);
    ListCall call = {entries, MM_FIELDS, codebook, (const CodebookTable*)table, scalars, scalar_stride, seeds,
                     0, 0, 0, nesterov};
    return run_entries(&call, n, muon_momentum_entry, threads);
}

int gefen_histogram(int dtype, const void* grad, int64_t numel, int64_t period, int64_t* counts, int threads) {
    if (dtype < DT_F32 || dtype > DT_F64) return -1;
    BY_DTYPE(dtype, histogram, grad, numel, period, counts, threads)
    return 0;
}

int gefen_stochastic_uniform(const int64_t* seed, const int64_t* index, float* out, int64_t n, int threads) {
    uint64_t s = (uint64_t)seed[0];
    int64_t i;
#pragma omp parallel for schedule(static) num_threads(threads) if(n >= PARALLEL_MIN && threads > 1)
    for (i = 0; i < n; i++) out[i] = splitmix_uniform(s, (uint64_t)index[i]);
    return 0;
}

/* The codebook solve (gefen_core.exact_dp, whose docstring states the problem, the tie rule and
 * why the values are exact): optimal 1-D weighted k-means of a histogram's occupied bins with
 * codewords pinned at -1, 0 and +1, one program per side of zero, each layer by divide and
 * conquer. Every candidate value is the reference's one expression, in the same order, on the
 * same doubles (segment sums are int64 prefix differences converted once; built with
 * -ffp-contract=off), and a scan keeps the first of equal minima as the reference does, so the
 * codebook is bit-identical. */
typedef struct {
    const int64_t* w;
    const int64_t* x;
    const int64_t* q;
    const double* previous;
    double* current;
    int32_t* argmin;
} SolveLayer;

static inline void segment_sums(const SolveLayer* s, int64_t j, int64_t e, double* dw, double* dx, double* dq) {
    *dw = (double)(s->w[e] - s->w[j]);
    *dx = (double)(s->x[e] - s->x[j]);
    *dq = (double)(s->q[e] - s->q[j]);
}

static inline double pinned_cost(const SolveLayer* s, int64_t j, int64_t e, double c) {
    double dw, dx, dq;
    segment_sums(s, j, e, &dw, &dx, &dq);
    return dq - 2.0 * c * dx + c * c * dw;
}

static void solve_range(const SolveLayer* s, int64_t e_lo, int64_t e_hi, int64_t o_lo, int64_t o_hi) {
    while (e_lo <= e_hi) {
        int64_t mid = (e_lo + e_hi) / 2;
        int64_t top = mid - 1 < o_hi ? mid - 1 : o_hi;
        double best = INFINITY;
        int64_t chosen = o_lo;
        for (int64_t j = o_lo; j <= top; j++) {
            double dw, dx, dq;
            segment_sums(s, j, mid, &dw, &dx, &dq);
            double value = s->previous[j] + (dq - dx * dx / dw);
            if (value < best) {
                best = value;
                chosen = j;
            }
        }
        s->current[mid] = best;
        s->argmin[mid] = (int32_t)chosen;
        solve_range(s, e_lo, mid - 1, o_lo, chosen);  /* the left half recursively, the right one here */
        e_lo = mid + 1;
        o_lo = chosen;
    }
}

/* One side's program (exact_dp._side): the points lo+1..hi between the pins `left` and `right`,
 * for k = 0..layers interior codewords (layers = min(most, hi - lo)): costs[k], ends[k] (where
 * the last segment ends), layer k's split points at choices + (k - 1) * (n + 1). `a` and `b`
 * are scratch rows of n + 1 doubles. Returns `layers`. */
static int64_t solve_side(SolveLayer* s, int64_t n, int64_t lo, int64_t hi, double left, double right, int64_t most,
                          double* a, double* b, double* costs, int64_t* ends, int32_t* choices) {
    int64_t layers = most < hi - lo ? most : hi - lo;
    for (int64_t e = 0; e <= n; e++) a[e] = INFINITY;
    for (int64_t e = lo; e <= hi; e++) a[e] = pinned_cost(s, lo, e, left);
    s->previous = a;
    s->current = b;
    for (int64_t k = 0; k <= layers; k++) {
        if (k) {
            for (int64_t e = 0; e <= n; e++) s->current[e] = INFINITY;
            s->argmin = choices + (k - 1) * (n + 1);
            memset(s->argmin, 0, (size_t)(n + 1) * sizeof(int32_t));
            solve_range(s, lo + k, hi, lo + k - 1, hi - 1);
            double* done = s->current; /* this layer is the next one's previous */
            s->current = (double*)s->previous;
            s->previous = done;
        }
        double best = INFINITY; /* the first minimum: the smallest end */
        int64_t end = lo + k;
        for (int64_t e = lo + k; e <= hi; e++) {
            double value = s->previous[e] + pinned_cost(s, e, hi, right);
            if (value < best) {
                best = value;
                end = e;
            }
        }
        costs[k] = best;
        ends[k] = end;
    }
    return layers;
}

/* The k interior centres of a side's optimum into out[0..k) (ascending). */
static void side_centres(const SolveLayer* s, int64_t n, const int64_t* ends, const int32_t* choices, int64_t k,
                         double bins, double* out) {
    int64_t end = ends[k];
    for (int64_t layer = k; layer >= 1; layer--) {
        int64_t start = choices[(layer - 1) * (n + 1) + end];
        out[layer - 1] = ((double)(s->x[end] - s->x[start]) / (double)(s->w[end] - s->w[start])) / bins;
        end = start;
    }
}

/* No more nonzero points than free codewords (exact_dp._few_points): every point its own
 * codeword, 0 and the rest spread over the grid positions no point holds (segment middles),
 * then +1. out[0] is already -1. 0 on success, 4 out of memory. */
static int few_points(const int64_t* y, int64_t n, int64_t bins, int64_t clusters, double* out) {
    int64_t held = 0;
    for (int64_t i = 0; i < n; i++) held += y[i] != 0;
    int64_t free_count = bins - held - (bins % 2 != 0); /* an odd grid holds 0 itself */
    int64_t spread = clusters - 3 - held < free_count ? clusters - 3 - held : free_count;
    int64_t* inner = malloc((size_t)(held + spread + 1) * sizeof(int64_t));
    if (inner == NULL) return 4;
    int64_t filled = 0, next = 0, p = 0, rank = 0;
    int zero_done = 0;
    for (int64_t pos = 1 - bins; pos < bins; pos += 2) {
        if (!zero_done && pos > 0) {
            inner[filled++] = 0;
            zero_done = 1;
        }
        if (pos == 0) {
            inner[filled++] = 0;
            zero_done = 1;
            if (p < n && y[p] == 0) p++;
            continue;
        }
        if (p < n && y[p] == pos) {
            inner[filled++] = pos;
            p++;
            continue;
        }
        /* the free position of this rank is picked when it is the next wanted one */
        if (next < spread && rank == ((2 * next + 1) * free_count) / (2 * (spread > 0 ? spread : 1))) {
            inner[filled++] = pos;
            next++;
        }
        rank++;
    }
    if (!zero_done) inner[filled++] = 0;
    for (int64_t i = 0; i < filled; i++) out[1 + i] = (double)inner[i] / (double)bins;
    for (int64_t i = 1 + filled; i < clusters; i++) out[i] = 1.0;
    free(inner);
    return 0;
}

/* counts: int64[bins] (none negative, one positive at least); out: float64[clusters >= 3]. 0 on
 * success; 1 a negative count, 2 an empty histogram, 3 sums beyond int64, 4 out of memory. */
int gefen_codebook_solve(const int64_t* counts, int64_t bins, int64_t clusters, double* out) {
    int64_t n = 0, total = 0, free_codewords = clusters - 3;
    for (int64_t k = 0; k < bins; k++) {
        if (counts[k] < 0) return 1;
        if (counts[k] > INT64_MAX - total) return 3;
        if (counts[k] > 0) n++;
        total += counts[k];
    }
    if (n == 0) return 2;
    int64_t* y = malloc((size_t)n * sizeof(int64_t));
    if (y == NULL) return 4;
    int64_t m = 0, negative = 0, nonpositive = 0;
    for (int64_t k = 0; k < bins; k++)
        if (counts[k] > 0) y[m++] = 2 * k + 1 - bins; /* bin k's centre is y / bins */
    for (int64_t i = 0; i < n; i++) {
        negative += y[i] < 0;
        nonpositive += y[i] <= 0;
    }
    out[0] = -1.0;
    if (n - (nonpositive - negative) <= free_codewords) {
        int status = few_points(y, n, bins, clusters, out);
        free(y);
        return status;
    }
    int64_t largest = bins;
    if (-y[0] > largest) largest = -y[0];
    if (y[n - 1] > largest) largest = y[n - 1];
    if (total > (INT64_MAX / 2) / (largest * largest)) { /* total * largest^2 >= 2^62: int64 sums overflow */
        free(y);
        return 3;
    }
    size_t row = (size_t)(n + 1);
    int64_t* w = calloc(3 * row, sizeof(int64_t));
    double* scratch = malloc(2 * row * sizeof(double));
    double* costs = malloc(2 * (size_t)(free_codewords + 1) * sizeof(double));
    int64_t* ends = malloc(2 * (size_t)(free_codewords + 1) * sizeof(int64_t));
    int32_t* choices = malloc(2 * (size_t)(free_codewords > 0 ? free_codewords : 1) * row * sizeof(int32_t));
    if (w == NULL || scratch == NULL || costs == NULL || ends == NULL || choices == NULL) {
        free(w), free(scratch), free(costs), free(ends), free(choices), free(y);
        return 4;
    }
    int64_t *x = w + row, *q = x + row;
    for (int64_t i = 0, k = 0; k < bins; k++) {
        if (counts[k] <= 0) continue;
        int64_t c = counts[k], pos = y[i];
        w[i + 1] = w[i] + c;
        x[i + 1] = x[i] + c * pos;
        q[i + 1] = q[i] + c * pos * pos;
        i++;
    }
    SolveLayer s = {w, x, q, NULL, NULL, NULL};
    double *costs_below = costs, *costs_above = costs + free_codewords + 1;
    int64_t *ends_below = ends, *ends_above = ends + free_codewords + 1;
    int32_t *choices_below = choices, *choices_above = choices + (size_t)(free_codewords > 0 ? free_codewords : 1) * row;
    int64_t most_below = solve_side(&s, n, 0, negative, -(double)bins, 0.0, free_codewords, scratch, scratch + row,
                                    costs_below, ends_below, choices_below);
    int64_t most_above = solve_side(&s, n, nonpositive, n, 0.0, (double)bins, free_codewords, scratch, scratch + row,
                                    costs_above, ends_above, choices_above);
    /* the free codewords split between the sides: the first minimum, the fewest below zero */
    int64_t first = free_codewords - most_above > 0 ? free_codewords - most_above : 0;
    int64_t last = free_codewords < most_below ? free_codewords : most_below;
    int64_t below = first;
    double best = INFINITY;
    for (int64_t k = first; k <= last; k++) {
        double value = costs_below[k] + costs_above[free_codewords - k];
        if (value < best) {
            best = value;
            below = k;
        }
    }
    side_centres(&s, n, ends_below, choices_below, below, (double)bins, out + 1);
    out[1 + below] = 0.0;
    side_centres(&s, n, ends_above, choices_above, free_codewords - below, (double)bins, out + 2 + below);
    out[clusters - 1] = 1.0;
    free(w), free(scratch), free(costs), free(ends), free(choices), free(y);
    return 0;
}
