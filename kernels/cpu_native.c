/* pd-cluster's native CPU matmuls over GGUF's 4- and 8-bit blocks (x86-64, AVX2 + FMA + F16C).
 *
 * Built once by kernels/cpu_native.py with the system C compiler and called through ctypes: no
 * torch headers, so it compiles in about a second. The weights stay in their file's blocks; the
 * activations are rounded to 16 bits per block of 32 (one float scale per block), and each block's
 * product is an integer dot product (vpmaddwd, exact in int32) scaled once:
 *
 *   Q4_1 weight block:  w_i = d * q_i + m        (q_i in 0..15, d and m float16)
 *   Q8_0 weight block:  w_i = d * q_i            (q_i in -127..127, d float16)
 *   activation block:   x_i ~ e * p_i            (p_i in -32767..32767, e = max |x_i| / 32767)
 *
 * 16 bits, not llama.cpp's 8: an activation keeps about 4.5 more significant bits than bfloat16
 * (an element at 1/128 of its block's largest keeps bfloat16's 8), so the product is as close to
 * float32's as the weights allow, and a decode step takes the same numbers as a many-row GEMM over
 * the dequantized weights (kernels.cpu_quant). The widening costs a few instructions per block; a
 * decode step's rows are bound by reading the weights.
 *
 *   sum_i w_i x_i ~ d e sum_i q_i p_i + m e sum_i p_i   (Q4_1)
 *
 * Threads: OpenMP over output features, in the process's one OpenMP runtime (torch's libgomp,
 * which this library's libgomp.so.1 resolves to once torch is loaded). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <float.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define QMAX 32767.0f /* activations: 16-bit codes per block of 32 */

/* Row layouts (one row per output feature, nb = in_features / 32 blocks):
 *   Q4_1: d [nb] float16 | m [nb] float16 | codes [nb][16] bytes (byte j: code j low nibble, code j + 16 high)
 *   Q8_0: d [nb] float16 | codes [nb][32] int8
 * (20 and 34 bytes per block, GGUF's sizes.) The scales come apart from the codes so that they convert
 * 8 at a time, and first, so that a row is read front to back (the hardware prefetcher's pattern). */

int pd_native_abi(void) { return 8; }

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* Activations rounded to 16 bits: p [m][nb][32] int16, e [m][nb] scales, s [m][nb] = e * sum(p). */
typedef struct {
    int16_t *p;
    float *e, *s;
    void *mem;
} act16;

/* A block of 32 floats into v, and its largest magnitude. */
static inline float load_block(const float *src, __m256 v[4]) {
    __m256 amax = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(src + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    t = _mm_max_ss(t, _mm_movehdup_ps(t));
    return _mm_cvtss_f32(t);
}

static int quantize_x(const float *x, int64_t m, int64_t k, act16 *a) {
    const int64_t nb = k / QK;
    a->mem = malloc((size_t)(m * nb) * (QK * sizeof(int16_t) + 2 * sizeof(float)) + 64);
    if (a->mem == NULL) return -2;
    a->p = (int16_t *)a->mem;
    a->e = (float *)(a->p + m * nb * QK);
    a->s = a->e + m * nb;
    for (int64_t rb = 0; rb < m * nb; rb++) {
        const float *src = x + rb * QK; /* rows are contiguous: block rb of the flattened rows */
        __m256 v[4];
        const float mx = load_block(src, v);
        const __m256 inv = _mm256_set1_ps(mx > 0.0f ? QMAX / mx : 0.0f);
        __m256i q[4];
        for (int j = 0; j < 4; j++)
            q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_hadd_epi32(s4, s4);
        s4 = _mm_hadd_epi32(s4, s4);
        /* int32 -> int16 in element order (packs works within 128-bit lanes; put the quarters back) */
        for (int j = 0; j < 2; j++)
            _mm256_storeu_si256((__m256i *)(a->p + rb * QK + 16 * j),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * j], q[2 * j + 1]), 0xD8));
        a->e[rb] = mx / QMAX;
        a->s[rb] = a->e[rb] * (float)_mm_cvtsi128_si32(s4);
    }
    return 0;
}

/* y [m, k] = x rounded as quantize_x rounds it, back in float32: per block of 32,
 * round(x * (QMAX * (1 / amax))) * (amax / QMAX) (each operation rounded on its own, half to even),
 * the numbers a many-row GEMM over the dequantized weight takes to give the kernels' products
 * (round_activations_ref's, bit for bit; quantize_x divides once, which can move a code at a half). */
int pd_round_activations(const float *x, int64_t m, int64_t k, float *y, int threads) {
    if (k % QK != 0 || m < 0) return -1;
    const int64_t blocks = m * (k / QK);
#pragma omp parallel for num_threads(threads) schedule(static) if (blocks >= 512)
    for (int64_t rb = 0; rb < blocks; rb++) {
        const float *src = x + rb * QK;
        float *dst = y + rb * QK;
        __m256 v[4];
        const float mx = load_block(src, v);
        /* QMAX * (1 / amax), as the torch reference computes QMAX / amax (reciprocal, then product) */
        const __m256 inv = _mm256_set1_ps(mx > 0.0f ? QMAX * (1.0f / fmaxf(mx, FLT_MIN)) : 0.0f), e = _mm256_set1_ps(mx / QMAX);
        for (int j = 0; j < 4; j++)
            _mm256_storeu_ps(dst + 8 * j, _mm256_mul_ps(_mm256_round_ps(_mm256_mul_ps(v[j], inv),
                                                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), e));
    }
    return 0;
}

/* out[b] = float(h[b]) * e[b] for b < nb. */
static inline void scale_by(const uint16_t *h, const float *e, int64_t nb, float *out) {
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8)
        _mm256_storeu_ps(out + b, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + b))), _mm256_loadu_ps(e + b)));
    for (; b < nb; b++) out[b] = _cvtsh_ss(h[b]) * e[b];
}

/* sum_b float(h[b]) * s[b]. */
static inline float dot_h(const uint16_t *h, const float *s, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + b))), _mm256_loadu_ps(s + b), acc);
    float tail = 0.0f;
    for (; b < nb; b++) tail += _cvtsh_ss(h[b]) * s[b];
    return hsum8(acc) + tail;
}

/* A Q4_1 block's 32 codes as int16 0..15, in element order: elements 0..15 (low nibbles), 16..31 (high). */
static inline void q4_codes(const uint8_t *qs, __m256i *lo, __m256i *hi) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(0x0F);
    *lo = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low4));
    *hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low4));
}

/* A Q8_0 block's 32 codes as int16, in element order. */
static inline void q8_codes(const int8_t *qs, __m256i *lo, __m256i *hi) {
    *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)qs));
    *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qs + 16)));
}

/* sum over a block of code * p (int16 * int16, exact in int32), as 8 float lanes (exact: |sum| < 2^24). */
static inline __m256 dot16(__m256i lo, __m256i hi, const int16_t *p) {
    const __m256i a = _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)p));
    const __m256i b = _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(p + 16)));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(a, b));
}

#define ROWS 4 /* activation rows per pass over a weight row */

/* A block's 32 codes as int16 in element order: Q4_1 (q4: 16 bytes a block) or Q8_0 (32). */
static inline __attribute__((always_inline)) void block_codes(const uint8_t *qs, int64_t b, const int q4,
                                                              __m256i *lo, __m256i *hi) {
    if (q4)
        q4_codes(qs + 16 * b, lo, hi);
    else
        q8_codes((const int8_t *)qs + QK * b, lo, hi);
}

/* One weight row (Q4_1 where q4, else Q8_0) against nr activation rows (of the nb blocks at p,
 * scales de; Q4_1's minimums mn against the blocks' sums s). Every row sums in the same order
 * whatever nr is (even blocks, odd blocks, then the minimums), so a request's numbers do not
 * depend on the batch it shares a step with. */
static inline __attribute__((always_inline)) void weight_row(const uint8_t *qs, const uint16_t *mn, int64_t nb,
                                                             const int16_t *p, const float *s, float de[][nb],
                                                             const int nr, const int q4, float *y, int64_t ystride) {
    __m256 acc0[ROWS], acc1[ROWS];
    for (int r = 0; r < nr; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) { /* two chains: one would wait on each FMA's latency */
        __m256i l0, h0, l1, h1;
        block_codes(qs, b, q4, &l0, &h0);
        block_codes(qs, b + 1, q4, &l1, &h1);
        for (int r = 0; r < nr; r++) {
            const int16_t *pr = p + (r * nb + b) * QK;
            acc0[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&de[r][b]), dot16(l0, h0, pr), acc0[r]);
            acc1[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&de[r][b + 1]), dot16(l1, h1, pr + QK), acc1[r]);
        }
    }
    if (b < nb) {
        __m256i l0, h0;
        block_codes(qs, b, q4, &l0, &h0);
        for (int r = 0; r < nr; r++)
            acc0[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&de[r][b]), dot16(l0, h0, p + (r * nb + b) * QK), acc0[r]);
    }
    for (int r = 0; r < nr; r++) {
        const float sum = hsum8(_mm256_add_ps(acc0[r], acc1[r]));
        y[r * ystride] = q4 ? sum + dot_h(mn, s + r * nb, nb) : sum;
    }
}

/* y [m, n] = x [m, k] @ W^T for W [n, k] in rows of Q4_1 (q4) or Q8_0 blocks (see the layouts above). */
static inline __attribute__((always_inline)) int matmul(const void *weight, int64_t n, int64_t k, const float *x,
                                                        int64_t m, float *y, int threads, const int q4) {
    if (k % QK != 0 || n <= 0 || m <= 0) return -1;
    const int64_t nb = k / QK, row_bytes = nb * (q4 ? 20 : 34);
    act16 a;
    if (quantize_x(x, m, k, &a) != 0) return -2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *d = (const uint16_t *)((const uint8_t *)weight + i * row_bytes);
        const uint16_t *mn = q4 ? d + nb : NULL;
        const uint8_t *qs = (const uint8_t *)(d + (q4 ? 2 * nb : nb));
        float de[ROWS][nb];
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
            const int nr = (int)(m - r0 < ROWS ? m - r0 : ROWS);
            for (int r = 0; r < nr; r++) scale_by(d, a.e + (r0 + r) * nb, nb, de[r]);
            const int16_t *p = a.p + r0 * nb * QK;
            const float *s = a.s + r0 * nb;
            float *out = y + r0 * n + i;
            switch (nr) { /* constant row counts, so each loop unrolls into registers */
            case 1: weight_row(qs, mn, nb, p, s, de, 1, q4, out, n); break;
            case 2: weight_row(qs, mn, nb, p, s, de, 2, q4, out, n); break;
            case 3: weight_row(qs, mn, nb, p, s, de, 3, q4, out, n); break;
            default: weight_row(qs, mn, nb, p, s, de, ROWS, q4, out, n); break;
            }
        }
    }
    free(a.mem);
    return 0;
}

int pd_q4_1_matmul(const void *weight, int64_t n, int64_t k, const float *x, int64_t m, float *y, int threads) {
    return matmul(weight, n, k, x, m, y, threads, 1);
}

int pd_q8_0_matmul(const void *weight, int64_t n, int64_t k, const float *x, int64_t m, float *y, int threads) {
    return matmul(weight, n, k, x, m, y, threads, 0);
}

/* RMS norm of rows [rows, dim] (float32), after adding a residual when one is given:
 *   h = x + residual (stored to h_out),  out = w * (h * (1 / sqrt(mean(h^2) + eps))).
 * Each row sums its squares in one fixed order (8 lanes, then the lanes), whatever the rows. */
int pd_rms_norm(const float *x, const float *residual, const float *w, int64_t rows, int64_t dim, float eps,
                float *out, float *h_out) {
    if (rows < 0 || dim <= 0) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        const float *h = xr;
        if (residual != NULL) {
            float *hr = h_out + r * dim;
            const float *rr = residual + r * dim;
            int64_t i = 0;
            for (; i + 8 <= dim; i += 8) _mm256_storeu_ps(hr + i, _mm256_add_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(rr + i)));
            for (; i < dim; i++) hr[i] = xr[i] + rr[i];
            h = hr;
        }
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8) {
            const __m256 v = _mm256_loadu_ps(h + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum8(acc);
        for (; i < dim; i++) ss += h[i] * h[i];
        const float scale = 1.0f / sqrtf(ss / (float)dim + eps);
        const __m256 s8 = _mm256_set1_ps(scale);
        i = 0;
        for (; i + 8 <= dim; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(h + i), s8)));
        for (; i < dim; i++) o[i] = w[i] * (h[i] * scale);
    }
    return 0;
}

/* ---- Attention of decode steps over the paged KV cache, and the rotation + KV write before it ----
 *
 * The cache of one layer: k_cache / v_cache [num_blocks, block_size, Hkv, D] (strided views into
 * one storage; an entry's Hkv * D elements contiguous), in float32, bfloat16 or float16. A key at
 * position j of a sequence is in block block_tables[row][j / block_size] at offset j % block_size. */

enum { PD_F32 = 0, PD_BF16 = 1, PD_F16 = 2 };

typedef struct {
    int64_t rows, hq, hk, d, rot;        /* rot: the rotated features of a head (rot <= d, even) */
    int64_t block_size, window;          /* window: keys a query sees (0: all) */
    int64_t block_stride, entry_stride;  /* cache elements between blocks, between a block's entries */
    int64_t dtype;                       /* the cache's: PD_F32, PD_BF16, PD_F16 */
    int64_t threads;
    float scale;
    const float *cos, *sin;              /* [rows, rot / 2], cs_stride apart */
    int64_t cs_stride;
    const int64_t *slots;                /* [rows]: where a row's k and v go (< 0: nowhere) */
    const int32_t *block_tables;         /* [rows, bt_stride] */
    int64_t bt_stride;
    const int32_t *seq_lens;             /* [rows]: keys in context, the row's own included */
} pd_attn;

/* 8 cache elements as float32. */
static inline __attribute__((always_inline)) __m256 load8(const void *base, int64_t i, const int dt) {
    if (dt == PD_F32) return _mm256_loadu_ps((const float *)base + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    if (dt == PD_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* float32 -> bfloat16, rounded to nearest even (NaN stays NaN), as torch converts. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* n float32 values (n a multiple of 8) into the cache's dtype at dst + i. */
static inline void store_row(void *dst, int64_t i, const float *x, int64_t n, int dt) {
    if (dt == PD_F32) { memcpy((float *)dst + i, x, (size_t)n * 4); return; }
    uint16_t *o = (uint16_t *)dst + i;
    if (dt == PD_F16) {
        for (int64_t j = 0; j < n; j += 8)
            _mm_storeu_si128((__m128i *)(o + j), _mm256_cvtps_ph(_mm256_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT));
        return;
    }
    for (int64_t j = 0; j < n; j++) o[j] = to_bf16(x[j]);
}

/* Rotate one head (x1 c - x2 s | x2 c + x1 s over its first rot features; the rest as they are),
 * each product and sum rounded to float32 on its own (built without contraction), as
 * kernels.rotary.apply_rotary_ref computes it. */
static inline void rotate(const float *x, const float *c, const float *s, int64_t rot, int64_t d, float *o) {
    const int64_t half = rot / 2;
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
        const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
        const __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
        _mm256_storeu_ps(o + i, _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv)));
        _mm256_storeu_ps(o + half + i, _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv)));
    }
    for (; i < half; i++) {
        const float a = x[i] * c[i], b = x[half + i] * s[i], e = x[half + i] * c[i], f = x[i] * s[i];
        o[i] = a - b;
        o[half + i] = e + f;
    }
    for (i = rot; i < d; i++) o[i] = x[i];
}

/* qkv [rows, (Hq + 2 Hkv) D] (qkv_stride apart) -> q_out [rows, Hq, D] rotated; k rotated and v
 * into the cache at each row's slot. */
int pd_rope_kv_write(const pd_attn *a, const float *qkv, int64_t qkv_stride, float *q_out, void *k_cache,
                     void *v_cache) {
    const int64_t hq = a->hq, hk = a->hk, d = a->d;
    if (d % 8 || a->rot % 2 || a->rot > d || a->rot <= 0) return -1;
#pragma omp parallel for num_threads((int)a->threads) schedule(static) if (a->rows * (hq + 2 * hk) * d >= (1 << 16))
    for (int64_t t = 0; t < a->rows; t++) {
        const float *x = qkv + t * qkv_stride, *c = a->cos + t * a->cs_stride, *s = a->sin + t * a->cs_stride;
        for (int64_t h = 0; h < hq; h++) rotate(x + h * d, c, s, a->rot, d, q_out + (t * hq + h) * d);
        const int64_t slot = a->slots[t];
        if (slot < 0) continue;
        const int64_t at = (slot / a->block_size) * a->block_stride + (slot % a->block_size) * a->entry_stride;
        float k[hk * d];
        for (int64_t h = 0; h < hk; h++) rotate(x + (hq + h) * d, c, s, a->rot, d, k + h * d);
        store_row(k_cache, at, k, hk * d, (int)a->dtype);
        store_row(v_cache, at, x + (hq + hk) * d, hk * d, (int)a->dtype);
    }
    return 0;
}

/* e^x for x <= 0 (lanes below -87.3 give 0): x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-7
 * polynomial (Cephes' expf coefficients), times 2^n; within 2 ulp of expf. */
static inline __m256 exp_neg(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* One sequence's queries of one KV head's group (G = Hq / Hkv heads) over its keys:
 * scores, softmax, values; every sum in one fixed order, so a row's output is the same whatever
 * rows share the call and however many threads run it. */
static inline __attribute__((always_inline)) void attend(const pd_attn *a, const float *q, const void *kc,
                                                         const void *vc, int64_t row, int64_t g, float *out,
                                                         float *scores, const int dt) {
    const int64_t d = a->d, G = a->hq / a->hk, len = a->seq_lens[row];
    const int64_t start = a->window > 0 && len > a->window ? len - a->window : 0, n = len - start;
    const int32_t *bt = a->block_tables + row * a->bt_stride;
    const float *qg = q + g * G * d;
    float *og = out + g * G * d;
    if (n <= 0) { memset(og, 0, (size_t)(G * d) * 4); return; }
    for (int64_t j = start; j < len; j++) {
        const int64_t at = (int64_t)bt[j / a->block_size] * a->block_stride + (j % a->block_size) * a->entry_stride + g * d;
        for (int64_t h = 0; h < G; h++) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t i = 0; i < d; i += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + h * d + i), load8(kc, at + i, dt), acc);
            scores[h * n + (j - start)] = hsum8(acc) * a->scale;
        }
    }
    for (int64_t h = 0; h < G; h++) {
        float *sc = scores + h * n;
        float mx = sc[0];
        for (int64_t j = 1; j < n; j++) mx = sc[j] > mx ? sc[j] : mx;
        const __m256 m8 = _mm256_set1_ps(mx);
        __m256 sum8 = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            const __m256 p = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(sc + j), m8));
            _mm256_storeu_ps(sc + j, p);
            sum8 = _mm256_add_ps(sum8, p);
        }
        float sum = hsum8(sum8);
        if (j < n) { /* the tail through the same exp, 8 lanes padded with -inf's 0 */
            float t[8];
            for (int i = 0; i < 8; i++) t[i] = j + i < n ? sc[j + i] - mx : -100.0f;
            _mm256_storeu_ps(t, exp_neg(_mm256_loadu_ps(t)));
            for (int64_t i = 0; j + i < n; i++) { sc[j + i] = t[i]; sum += t[i]; }
        }
        const float inv = 1.0f / sum;
        for (j = 0; j < n; j++) sc[j] *= inv;
    }
    for (int64_t h = 0; h < G; h++) memset(og + h * d, 0, (size_t)d * 4);
    for (int64_t j = start; j < len; j++) {
        const int64_t at = (int64_t)bt[j / a->block_size] * a->block_stride + (j % a->block_size) * a->entry_stride + g * d;
        for (int64_t i = 0; i < d; i += 8) {
            const __m256 v = load8(vc, at + i, dt);
            for (int64_t h = 0; h < G; h++) {
                float *o = og + h * d + i;
                _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_broadcast_ss(scores + h * n + (j - start)), v, _mm256_loadu_ps(o)));
            }
        }
    }
}

/* q [rows, Hq, D] (q_stride apart) -> out [rows, Hq, D]: each row one decode query over its
 * sequence's keys (the last `window` when one is set). Threads over (row, KV head). */
int pd_decode_attention(const pd_attn *a, const float *q, int64_t q_stride, const void *k_cache,
                        const void *v_cache, float *out) {
    if (a->d % 8 || a->hk <= 0 || a->hq % a->hk) return -1;
    const int64_t tasks = a->rows * a->hk;
    int64_t work = 0;
    for (int64_t r = 0; r < a->rows; r++) work += a->seq_lens[r];
    int failed = 0;
#pragma omp parallel for num_threads((int)a->threads) schedule(static) if (work * a->hq * a->d >= (1 << 15))
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t row = task / a->hk, g = task % a->hk;
        const int64_t n = a->seq_lens[row];
        float *scores = malloc((size_t)((n > 0 ? n : 1) * (a->hq / a->hk)) * 4);
        if (scores == NULL) { failed = 1; continue; }
        const float *qr = q + row * q_stride;
        float *o = out + row * a->hq * a->d;
        switch (a->dtype) {
        case PD_BF16: attend(a, qr, k_cache, v_cache, row, g, o, scores, PD_BF16); break;
        case PD_F16: attend(a, qr, k_cache, v_cache, row, g, o, scores, PD_F16); break;
        default: attend(a, qr, k_cache, v_cache, row, g, o, scores, PD_F32); break;
        }
        free(scores);
    }
    return failed ? -2 : 0;
}

/* A decode step's attention for one layer: rotation and KV write, then the attention, in one
 * call (the same numbers as the two calls). q_buf [rows, Hq, D] holds the rotated queries. */
int pd_decode_attention_layer(const pd_attn *a, const float *qkv, int64_t qkv_stride, float *q_buf,
                              void *k_cache, void *v_cache, float *out) {
    const int rc = pd_rope_kv_write(a, qkv, qkv_stride, q_buf, k_cache, v_cache);
    return rc != 0 ? rc : pd_decode_attention(a, q_buf, a->hq * a->d, k_cache, v_cache, out);
}

/* ---- The same matmuls on AVX-512 VNNI: integer dot products four bytes at a time ----
 *
 * vpmaddwd above spends a float conversion and a multiply-add on every block of 32 products of every
 * (row, output feature) pair, on the same pipes as the products themselves: about 10 multiply-adds a
 * cycle on an AVX-512 core, no faster than a float32 GEMM. Here the lanes of a register are 16 output
 * features instead, so a block's 32 products per feature accumulate in int32 (vpdpbusd: 4 byte
 * products a lane) and the float work is one conversion and one multiply-add per block for 16 features.
 *
 * The weights are repacked once at load (pd_vnni_pack), per group of 16 output features and per block:
 *   codes [8][16][4] uint8 | d [16] float32 | m [16] float32                (VNNI_BLOCK = 640 bytes)
 * code (t, f, i) is feature f's code for input 4 t + i of the block: Q4_1's 0..15, Q8_0's q + 128
 * (vpdpbusd multiplies unsigned by signed bytes; sum(q p) = sum((q + 128) p) - 128 sum(p)).
 * The activations keep 16-bit codes per block of 32, p in -32639..32639 (QMAX_VNNI = 127 * 256 + 127),
 * split as p = 256 h + l with h in -127..127 and l in -128..127: two vpdpbusd, then 256 acc_h + acc_l,
 * the exact sum(q p) (Q4_1: |sum| < 2^24, exact in float32; Q8_0's may round once, in float32).
 *
 * Each output is then, whatever the rows or their number (a batch of 1 and of 256 alike, threads too):
 *   acc = 0; for each block b in order: acc = fma(float(sum_b(q p)), d[b] * e[b], acc)
 *   Q4_1: accm = 0; for each b: accm = fma(m[b], s[b], accm); out = acc + accm   (s[b] = e[b] sum_b(p))
 * so a request's numbers never depend on the batch it shares a step with: one kernel for every row
 * count, no crossover to a GEMM. */

#define QMAX_VNNI 32639.0f
#define VG 16                              /* output features per group: a register's lanes */
#define VNNI_BLOCK (QK * VG + 2 * VG * 4)  /* bytes per (group, block) */
#define VMR 4                              /* activation rows per pass over a group */

int pd_vnni_block_bytes(void) { return VNNI_BLOCK; }

/* Blocks (Q4_1 where q4, else Q8_0; the layouts at the top) of n features into out
 * [ceil(n / 16)][nb][VNNI_BLOCK] (features past n: zero codes and scales). */
int pd_vnni_pack(const void *weight, int64_t n, int64_t k, int q4, uint8_t *out, int threads) {
    if (k % QK != 0 || n <= 0) return -1;
    const int64_t nb = k / QK, row_bytes = nb * (q4 ? 20 : 34), groups = (n + VG - 1) / VG;
    memset(out, 0, (size_t)(groups * nb * VNNI_BLOCK));
#pragma omp parallel for num_threads(threads) schedule(static, VG) /* a group's features on one thread */
    for (int64_t f = 0; f < n; f++) {
        const uint16_t *d = (const uint16_t *)((const uint8_t *)weight + f * row_bytes);
        const uint16_t *mn = q4 ? d + nb : NULL;
        const uint8_t *qs = (const uint8_t *)(d + (q4 ? 2 * nb : nb));
        const int64_t g = f / VG, lane = f % VG;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *blk = out + (g * nb + b) * VNNI_BLOCK;
            for (int j = 0; j < QK; j++) {
                const uint8_t code = q4 ? (uint8_t)(j < 16 ? qs[16 * b + j] & 0x0F : qs[16 * b + j - 16] >> 4)
                                        : (uint8_t)((int)((const int8_t *)qs)[QK * b + j] + 128);
                blk[((j / 4) * VG + lane) * 4 + j % 4] = code;
            }
            float *dv = (float *)(blk + QK * VG);
            dv[lane] = _cvtsh_ss(d[b]);
            dv[VG + lane] = q4 ? _cvtsh_ss(mn[b]) : 0.0f;
        }
    }
    return 0;
}

typedef struct {
    int8_t *h, *l;  /* [m][nb][32]: p = 256 h + l */
    float *e, *s;   /* [m][nb]: the scale, and e * sum(p) */
    int32_t *ps;    /* [m][nb]: sum(p) */
    void *mem;
} act_split;

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c")))
static int quantize_split(const float *x, int64_t m, int64_t k, act_split *a, int threads) {
    const int64_t n = m * (k / QK);
    a->mem = malloc((size_t)n * (2 * QK + 12) + 64);
    if (a->mem == NULL) return -2;
    a->h = (int8_t *)a->mem;
    a->l = a->h + n * QK;
    a->e = (float *)(a->l + n * QK);
    a->s = a->e + n;
    a->ps = (int32_t *)(a->s + n);
#pragma omp parallel for num_threads(threads) schedule(static) if (n >= 512)
    for (int64_t rb = 0; rb < n; rb++) {
        const float *src = x + rb * QK;
        const __m512 v0 = _mm512_loadu_ps(src), v1 = _mm512_loadu_ps(src + 16);
        const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const __m512 inv = _mm512_set1_ps(mx > 0.0f ? QMAX_VNNI * (1.0f / mx) : 0.0f);
        const __m512i p0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v0, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m512i p1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v1, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m512i c128 = _mm512_set1_epi32(128);
        const __m512i h0 = _mm512_srai_epi32(_mm512_add_epi32(p0, c128), 8), h1 = _mm512_srai_epi32(_mm512_add_epi32(p1, c128), 8);
        const __m512i l0 = _mm512_sub_epi32(p0, _mm512_slli_epi32(h0, 8)), l1 = _mm512_sub_epi32(p1, _mm512_slli_epi32(h1, 8));
        _mm_storeu_si128((__m128i *)(a->h + rb * QK), _mm512_cvtepi32_epi8(h0));
        _mm_storeu_si128((__m128i *)(a->h + rb * QK + 16), _mm512_cvtepi32_epi8(h1));
        _mm_storeu_si128((__m128i *)(a->l + rb * QK), _mm512_cvtepi32_epi8(l0));
        _mm_storeu_si128((__m128i *)(a->l + rb * QK + 16), _mm512_cvtepi32_epi8(l1));
        const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(p0, p1));
        a->e[rb] = mx / QMAX_VNNI;
        a->ps[rb] = sum;
        a->s[rb] = a->e[rb] * (float)sum;
    }
    return 0;
}

/* Outputs [mr rows][the group's 16 features] (ncols of them real) from a group's blocks. */
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline))
static inline void vnni_tile(const uint8_t *wg, int64_t nb, const act_split *a, int64_t r0, const int mr,
                             const int q4, float *y, int64_t ystride, int64_t ncols) {
    __m512 acc[VMR], accm[VMR];
    for (int r = 0; r < mr; r++) acc[r] = accm[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wg + b * VNNI_BLOCK;
        __m512i ih[VMR], il[VMR];
        for (int r = 0; r < mr; r++) ih[r] = il[r] = _mm512_setzero_si512();
        for (int t = 0; t < 8; t++) {
            const __m512i w = _mm512_loadu_si512((const void *)(blk + 64 * t));
            for (int r = 0; r < mr; r++) {
                const int64_t o = ((r0 + r) * nb + b) * QK + 4 * t;
                int32_t h4, l4;
                memcpy(&h4, a->h + o, 4);
                memcpy(&l4, a->l + o, 4);
                ih[r] = _mm512_dpbusd_epi32(ih[r], w, _mm512_set1_epi32(h4));
                il[r] = _mm512_dpbusd_epi32(il[r], w, _mm512_set1_epi32(l4));
            }
        }
        const __m512 d = _mm512_loadu_ps((const float *)(blk + QK * VG));
        const __m512 mn = _mm512_loadu_ps((const float *)(blk + QK * VG + 64));
        for (int r = 0; r < mr; r++) {
            const int64_t rb = (r0 + r) * nb + b;
            __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(ih[r], 8), il[r]);
            if (!q4) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * a->ps[rb]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(a->e[rb])), acc[r]);
            if (q4) accm[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a->s[rb]), accm[r]);
        }
    }
    const __mmask16 keep = ncols >= VG ? (__mmask16)0xFFFF : (__mmask16)((1u << ncols) - 1);
    for (int r = 0; r < mr; r++)
        _mm512_mask_storeu_ps(y + r * ystride, keep, q4 ? _mm512_add_ps(acc[r], accm[r]) : acc[r]);
}

__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void vnni_group(const uint8_t *wg, int64_t nb, const act_split *a, int64_t m, const int q4, float *y,
                       int64_t n, int64_t ncols) {
    for (int64_t r0 = 0; r0 < m; r0 += VMR) {
        const int mr = (int)(m - r0 < VMR ? m - r0 : VMR);
        float *out = y + r0 * n;
        switch (mr) { /* constant row counts, so each loop unrolls into registers */
        case 1: vnni_tile(wg, nb, a, r0, 1, q4, out, n, ncols); break;
        case 2: vnni_tile(wg, nb, a, r0, 2, q4, out, n, ncols); break;
        case 3: vnni_tile(wg, nb, a, r0, 3, q4, out, n, ncols); break;
        default: vnni_tile(wg, nb, a, r0, VMR, q4, out, n, ncols); break;
        }
    }
}

/* y [m, n] = x [m, k] @ W^T for W repacked by pd_vnni_pack from Q4_1 (q4) or Q8_0 blocks. */
int pd_vnni_matmul(const uint8_t *packed, int64_t n, int64_t k, const float *x, int64_t m, float *y, int threads,
                   int q4) {
    if (k % QK != 0 || n <= 0 || m <= 0) return -1;
    const int64_t nb = k / QK, groups = (n + VG - 1) / VG;
    act_split a;
    if (quantize_split(x, m, k, &a, threads) != 0) return -2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *wg = packed + g * nb * VNNI_BLOCK;
        if (q4)
            vnni_group(wg, nb, &a, m, 1, y + g * VG, n, n - g * VG);
        else
            vnni_group(wg, nb, &a, m, 0, y + g * VG, n, n - g * VG);
    }
    free(a.mem);
    return 0;
}
