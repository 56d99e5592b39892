// Products with matrices in GGUF's block types: Q4_0, Q4_1, Q8_0 (hand-tuned for AVX2 in
// models/csrc/blocks.c as well), Q5_0, Q5_1, MXFP4, IQ4_NL (blocks of 32), and Q2_K, Q3_K, Q4_K,
// Q5_K, Q6_K, IQ4_XS (blocks of 256),
// each block byte for byte as llama.cpp stores it (ggml-common.h) and expanded as llama.cpp's
// dequantize_row_* expand it (ggml-quants.c), then multiplied in float32: the stored weights'
// exact product to float rounding, as the `gguf` package (and so transformers) expands them.
//
// y (R, N) = x (R, K) @ W^T, W (N, K) with row o its K / values-per-block blocks. Plain C with
// GCC's vector types, which the compiler maps onto what the CPU has (AVX-512, AVX2, NEON):
// built with -march=native on the device and admitted there by the on-device check.
//
// Each format decodes a block to small integers (int8) and a scale, and where it has one a
// minimum, per 16 weights: w = scale * q - min, the float operations of llama.cpp's expansion,
// so `*_expand` (whole rows as float32) gives exactly the values the gguf package gives, and
// `*_gemm` multiplies bands of them by BLAS (many rows: a prefill). The product multiplies scale * q by x and subtracts the
// minimums times the sums of x over their 16 weights, once per row of x. One row is multiplied
// straight from the integers; a tile of rows from the chunk expanded once into a buffer. Every
// output sums its products in 64 lanes in the same order whatever the number of rows, so a
// row's result does not depend on the rows beside it (a batch, a draft).
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#define AI static inline __attribute__((always_inline))
#define CHUNK 256  // weights decoded at a time
#define GROUP 16   // weights sharing a scale and a minimum
#define GROUPS (CHUNK / GROUP)
#define TILE 8     // rows of x sharing one expansion

// The products' vectors: 16 floats where the CPU has AVX-512, else 8. Either way an output sums
// weight j's products in lane j mod 64, in the same order, and the lanes as `lanes_sum` does.
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
#define NACC (64 / VW)
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));  // an unaligned load
typedef float v8 __attribute__((vector_size(32)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

typedef struct {
    int8_t q[CHUNK] __attribute__((aligned(32)));
    float scale[GROUPS], min[GROUPS];
} Chunk;

// IEEE half to float: F16C's instruction where there is one, else by its bits
#if defined(__F16C__)
AI float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
#else
AI float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) {
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

static const int8_t IQ4NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                        1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 16 bytes of nibbles: the low ones are weights 0-15 of 32, the high ones 16-31 (byte ops on
// 16 at once, where a loop over them was measured 4x slower: GCC left it scalar)
AI void nibbles(const uint8_t *qs, u8x16 *lo, u8x16 *hi) {
    u8x16 v;
    memcpy(&v, qs, 16);
    *lo = v & 15;
    *hi = v >> 4;
}

// bit j of the 32 bits `qh` (little-endian) as 16 in lane j: weights 0-15, then 16-31
AI void high_bits(const uint8_t *qh, u8x16 *lo, u8x16 *hi) {
    const u8x16 bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const u8x16 a = {qh[0], qh[0], qh[0], qh[0], qh[0], qh[0], qh[0], qh[0],
                     qh[1], qh[1], qh[1], qh[1], qh[1], qh[1], qh[1], qh[1]};
    const u8x16 b = {qh[2], qh[2], qh[2], qh[2], qh[2], qh[2], qh[2], qh[2],
                     qh[3], qh[3], qh[3], qh[3], qh[3], qh[3], qh[3], qh[3]};
    // (bit or 0) + 127 has its top bit set exactly when the bit is: byte adds and shifts, where
    // a comparison became mask-register code with AVX-512, twice as slow
    *lo = (((a & bit) + 127) >> 7) << 4;
    *hi = (((b & bit) + 127) >> 7) << 4;
}

AI void put(int8_t *q, u8x16 v) { memcpy(q, &v, 16); }

// the table's entries for 16 indices (a byte shuffle)
AI u8x16 lookup(const int8_t table[16], u8x16 idx) {
    u8x16 t;
    memcpy(&t, table, 16);
    return __builtin_shuffle(t, idx);
}

// ---- one block each: its integers, and per 16 of them a scale (s) and a minimum (m), as
// ggml-quants.c's dequantize_row_* computes them ------------------------------------------------

AI void scale2(float *s, float v) { s[0] = s[1] = v; }  // a scale of 32 weights: two groups

AI void q4_0_decode(const uint8_t *restrict b, int8_t *restrict q, float *restrict s, float *restrict m) {  // d, qs[16]
    (void)m;
    u8x16 lo, hi;
    nibbles(b + 2, &lo, &hi);
    put(q, lo - 8);
    put(q + 16, hi - 8);
    scale2(s, h2f(b));
}

AI void q4_1_decode(const uint8_t *restrict b, int8_t *restrict q, float *restrict s, float *restrict m) {  // d, m, qs[16]
    u8x16 lo, hi;
    nibbles(b + 4, &lo, &hi);
    put(q, lo);
    put(q + 16, hi);
    scale2(s, h2f(b));
    scale2(m, -h2f(b + 2));
}

AI void q5_0_decode(const uint8_t *restrict b, int8_t *restrict q, float *restrict s, float *restrict m) {  // d, qh[4], qs[16]
    (void)m;
    u8x16 lo, hi, hlo, hhi;
    nibbles(b + 6, &lo, &hi);
    high_bits(b + 2, &hlo, &hhi);
    put(q, (lo | hlo) - 16);
    put(q + 16, (hi | hhi) - 16);
    scale2(s, h2f(b));
}

AI void q5_1_decode(const uint8_t *restrict b, int8_t *restrict q, float *restrict s, float *restrict m) {  // d, m, qh[4], qs[16]
    u8x16 lo, hi, hlo, hhi;
    nibbles(b + 8, &lo, &hi);
    high_bits(b + 4, &hlo, &hhi);
    put(q, lo | hlo);
    put(q + 16, hi | hhi);
    scale2(s, h2f(b));
    scale2(m, -h2f(b + 2));
}

AI void q8_0_decode(const uint8_t *restrict b, int8_t *restrict q, float *restrict s, float *restrict m) {  // d, qs[32]
    (void)m;
    memcpy(q, b + 2, 32);
    scale2(s, h2f(b));
}

AI void mxfp4_decode(const uint8_t *restrict b, int8_t *restrict q, float *restrict s, float *restrict m) {  // e (E8M0), qs[16]
    (void)m;
    const uint8_t e = b[0];
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;  // 2^(e-127) / 2
    float d;
    memcpy(&d, &bits, 4);
    u8x16 lo, hi;
    nibbles(b + 1, &lo, &hi);
    put(q, lookup(MXFP4_VALUES, lo));
    put(q + 16, lookup(MXFP4_VALUES, hi));
    scale2(s, d);
}

AI void iq4_nl_decode(const uint8_t *restrict b, int8_t *restrict q, float *restrict s, float *restrict m) {  // d, qs[16]
    (void)m;
    u8x16 lo, hi;
    nibbles(b + 2, &lo, &hi);
    put(q, lookup(IQ4NL_VALUES, lo));
    put(q + 16, lookup(IQ4NL_VALUES, hi));
    scale2(s, h2f(b));
}

AI void q2_k_decode(const uint8_t *restrict b, int8_t *restrict q, float *restrict s, float *restrict m) {  // sc[16], qs[64], d, dmin
    const uint8_t *sc = b, *qs = b + 16;
    const float d = h2f(b + 80), min = h2f(b + 82);
    int g = 0;
    for (int n = 0; n < 256; n += 128, qs += 32)
        for (int shift = 0; shift < 8; shift += 2)
            for (int half = 0; half < 2; half++, g++) {
                for (int l = 0; l < 16; l++) q[16 * g + l] = (int8_t)((qs[l + 16 * half] >> shift) & 3);
                s[g] = d * (sc[g] & 0xf);
                m[g] = min * (sc[g] >> 4);
            }
}

AI void q3_k_decode(const uint8_t *restrict b, int8_t *restrict q, float *restrict s, float *restrict m) {  // hm[32], qs[64], sc[12], d
    (void)m;
    const uint8_t *hm = b, *qs = b + 32;
    const float d_all = h2f(b + 108);
    uint32_t aux[4];
    memcpy(aux, b + 96, 12);
    const uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f, tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
    aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
    int8_t scales[16];
    memcpy(scales, aux, 16);
    int g = 0;
    uint8_t bit = 1;
    for (int n = 0; n < 256; n += 128, qs += 32)
        for (int shift = 0; shift < 8; shift += 2, bit <<= 1)
            for (int half = 0; half < 2; half++, g++) {
                for (int l = 0; l < 16; l++) {
                    const int k = l + 16 * half;
                    q[16 * g + l] = (int8_t)(((qs[k] >> shift) & 3) - ((hm[k] & bit) ? 0 : 4));
                }
                s[g] = d_all * (scales[g] - 32);
            }
}

// the 6-bit scale and minimum of sub-block j of a Q4_K or Q5_K block
AI void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// the scales and minimums of a Q4_K or Q5_K block's eight sub-blocks of 32
AI void k4_scales(const uint8_t *b, float *s, float *m) {
    const float d = h2f(b), min = h2f(b + 2);
    for (int j = 0; j < 8; j++) {
        uint8_t sc, mn;
        scale_min_k4(j, b + 4, &sc, &mn);
        scale2(s + 2 * j, d * sc);
        scale2(m + 2 * j, min * mn);
    }
}

AI void q4_k_decode(const uint8_t *restrict b, int8_t *restrict q, float *restrict s, float *restrict m) {  // d, dmin, sc[12], qs[128]
    const uint8_t *qs = b + 16;
    for (int j = 0; j < 256; j += 64, qs += 32)
        for (int l = 0; l < 32; l++) {
            q[j + l] = (int8_t)(qs[l] & 0xf);
            q[j + l + 32] = (int8_t)(qs[l] >> 4);
        }
    k4_scales(b, s, m);
}

AI void q5_k_decode(const uint8_t *restrict b, int8_t *restrict q, float *restrict s, float *restrict m) {  // d, dmin, sc[12], qh[32], qs[128]
    const uint8_t *qh = b + 16, *ql = b + 48;
    int shift = 0;
    for (int j = 0; j < 256; j += 64, ql += 32, shift += 2)
        for (int l = 0; l < 32; l++) {
            q[j + l] = (int8_t)((ql[l] & 0xf) | (((qh[l] >> shift) & 1) << 4));
            q[j + l + 32] = (int8_t)((ql[l] >> 4) | (((qh[l] >> (shift + 1)) & 1) << 4));
        }
    k4_scales(b, s, m);
}

AI void q6_k_decode(const uint8_t *restrict b, int8_t *restrict q, float *restrict s, float *restrict m) {  // ql[128], qh[64], sc[16], d
    (void)m;
    const float d = h2f(b + 208);
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    for (int n = 0; n < 256; n += 128, ql += 64, qh += 32)
        for (int l = 0; l < 32; l++) {
            q[n + l] = (int8_t)(((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32);
            q[n + l + 32] = (int8_t)(((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32);
            q[n + l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
            q[n + l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
    for (int g = 0; g < 16; g++) s[g] = d * sc[g];
}

AI void iq4_xs_decode(const uint8_t *restrict b, int8_t *restrict q, float *restrict s, float *restrict m) {  // d, sc_h, sc_l[4], qs[128]
    (void)m;
    const float d = h2f(b);
    uint16_t scales_h;
    memcpy(&scales_h, b + 2, 2);
    const uint8_t *scales_l = b + 4, *qs = b + 8;
    for (int ib = 0; ib < 8; ib++, qs += 16) {
        const int ls = ((scales_l[ib / 2] >> 4 * (ib % 2)) & 0xf) | (((scales_h >> 2 * ib) & 3) << 4);
        u8x16 lo, hi;
        nibbles(qs, &lo, &hi);
        put(q + 32 * ib, lookup(IQ4NL_VALUES, lo));
        put(q + 32 * ib + 16, lookup(IQ4NL_VALUES, hi));
        scale2(s + 2 * ib, d * (ls - 32));
    }
}

// ---- the product, the same for every format ----------------------------------------------------

typedef void (*decode_fn)(const uint8_t *, int8_t *, float *, float *);

AI vf splat(float v) { return (vf){0} + v; }
AI vf load(const float *p) { return *(const vfu *)p; }
// VW integers as floats: GCC turns a vector conversion from int8 into scalar code, so where the
// CPU has one, its instruction for it
#if defined(__AVX512F__)
AI vf ints(const int8_t *p) {
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#elif defined(__AVX2__)
AI vf ints(const int8_t *p) {
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#elif defined(__ARM_NEON)
AI vf ints(const int8_t *p) {
    const int16x8_t h = vmovl_s8(vld1_s8(p));
    const float32x4_t lo = vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
    const float32x4_t hi = vcvtq_f32_s32(vmovl_s16(vget_high_s16(h)));
    vf r;
    memcpy(&r, &lo, 16);
    memcpy((char *)&r + 16, &hi, 16);
    return r;
}
#else
AI vf ints(const int8_t *p) {
    vf r;
    for (int i = 0; i < VW; i++) r[i] = (float)p[i];
    return r;
}
#endif

// the blocks of weights [k0, k0 + n) of one row into `c`
AI void decode_chunk(decode_fn decode, int V, int BS, const uint8_t *wrow, int k0, int n, Chunk *c) {
    for (int i = 0; i < n / V; i++)
        decode(wrow + (size_t)(k0 / V + i) * BS, c->q + i * V, c->scale + i * V / GROUP, c->min + i * V / GROUP);
}

// acc (64 lanes: weight j in lane j mod 64) += (scale q) . x over the chunk's n weights (a
// multiple of 32); the accumulators named by constants, so that they stay in registers
AI void dot_ints(const Chunk *c, int n, const float *x, vf acc[NACC]) {
    int j = 0;
    for (; j + 64 <= n; j += 64)
        for (int k = 0; k < NACC; k++)
            acc[k] += (ints(c->q + j + VW * k) * splat(c->scale[(j + VW * k) / GROUP])) * load(x + j + VW * k);
    if (j < n)
        for (int k = 0; k < 32 / VW; k++)
            acc[k] += (ints(c->q + j + VW * k) * splat(c->scale[(j + VW * k) / GROUP])) * load(x + j + VW * k);
}

// the same from the chunk expanded (w = scale q) into `w`: the same products in the same lanes
AI void dot_floats(const float *w, int n, const float *x, vf acc[NACC]) {
    int j = 0;
    for (; j + 64 <= n; j += 64)
        for (int k = 0; k < NACC; k++) acc[k] += load(w + j + VW * k) * load(x + j + VW * k);
    if (j < n)
        for (int k = 0; k < 32 / VW; k++) acc[k] += load(w + j + VW * k) * load(x + j + VW * k);
}

// The 64 lanes folded 8 at a time in lane order, then those 8 in order: what an 8-float build
// computes, so an output is the same float whatever the CPU's vector width.
AI float lanes_sum(const vf acc[NACC]) {
    const float *lanes = (const float *)acc;
    v8 t, part;
    memcpy(&t, lanes, 32);
    for (int k = 1; k < 8; k++) {
        memcpy(&part, lanes + 8 * k, 32);
        t += part;
    }
    float s = 0;
    for (int i = 0; i < 8; i++) s += t[i];
    return s;
}

// weight row o against rows [r0, r0 + RT) of x (xs: their sums per 16, for a format with minimums)
AI void row_tile(decode_fn decode, int V, int BS, int mins, const uint8_t *wrow, int K, const float *x,
                 const float *xs, int r0, int RT, float *y, int N, int o) {
    vf acc[TILE][NACC];
    v8 corr[TILE][2];  // the minimums' part, group g in lane g mod 16
    memset(acc, 0, sizeof acc);
    memset(corr, 0, sizeof corr);
    Chunk c;
    float w[CHUNK] __attribute__((aligned(32)));
    for (int k0 = 0; k0 < K; k0 += CHUNK) {
        const int n = K - k0 < CHUNK ? K - k0 : CHUNK;
        decode_chunk(decode, V, BS, wrow, k0, n, &c);
        if (RT == 1) {
            dot_ints(&c, n, x + (size_t)r0 * K + k0, acc[0]);
        } else {
            for (int j = 0; j < n; j += VW) *(vfu *)(w + j) = ints(c.q + j) * splat(c.scale[j / GROUP]);
            for (int r = 0; r < RT; r++) dot_floats(w, n, x + (size_t)(r0 + r) * K + k0, acc[r]);
        }
        if (mins)  // n / GROUP groups: 16, or 2 to 14 in a shorter last chunk of 32-blocks
            for (int r = 0; r < RT; r++) {
                const float *xr = xs + (size_t)(r0 + r) * (K / GROUP) + k0 / GROUP;
                if (n == CHUNK) {  // group g in lane g mod 16: two vectors, not 16 lane updates
                    v8 m0, m1, x0, x1;
                    memcpy(&m0, c.min, 32);
                    memcpy(&m1, c.min + 8, 32);
                    memcpy(&x0, xr, 32);
                    memcpy(&x1, xr + 8, 32);
                    corr[r][0] += m0 * x0;
                    corr[r][1] += m1 * x1;
                } else {
                    for (int g = 0; g < n / GROUP; g++) corr[r][g / 8][g % 8] += c.min[g] * xr[g];
                }
            }
    }
    for (int r = 0; r < RT; r++) {
        v8 t = corr[r][0] + corr[r][1];
        float m = 0;
        for (int i = 0; i < 8; i++) m += t[i];
        y[(size_t)(r0 + r) * N + o] = lanes_sum(acc[r]) - m;
    }
}

// Each row of x summed per 16 weights, in order: the minimums' partners (NULL without them).
static float *group_sums(int mins, const float *x, int R, int K) {
    if (!mins) return NULL;
    float *xs = malloc(sizeof(float) * (size_t)R * (K / GROUP));
    for (size_t i = 0; i < (size_t)R * (K / GROUP); i++) {
        float t = 0;
        for (int j = 0; j < GROUP; j++) t += x[i * GROUP + j];
        xs[i] = t;
    }
    return xs;
}

AI void expand_row(decode_fn decode, int V, int BS, int mins, const uint8_t *wrow, int K, float *y) {
    int8_t q[256];
    float s[16], m[16] = {0};
    for (int b = 0; b < K / V; b++, y += V) {
        decode(wrow + (size_t)b * BS, q, s, m);
        for (int j = 0; j < V; j++) y[j] = mins ? s[j / GROUP] * q[j] - m[j / GROUP] : s[j / GROUP] * q[j];
    }
}

// NumPy's BLAS, for `*_gemm` (models/native.py hands it over): its sgemm (64-bit integers), and
// how many threads it runs, which a gemm sets to one while its own threads call it.
typedef void (*sgemm_fn)(int, int, int, int64_t, int64_t, int64_t, float, const float *, int64_t,
                         const float *, int64_t, float, float *, int64_t);
static sgemm_fn sgemm;
static void (*blas_set_threads)(int);
static int (*blas_get_threads)(void);

void expand_set_blas(void *gemm, void *set_threads, void *get_threads) {
    sgemm = (sgemm_fn)gemm;
    blas_set_threads = (void (*)(int))set_threads;
    blas_get_threads = (int (*)(void))get_threads;
}

#define BAND_BYTES (1 << 20)  // float32 weights one thread expands at a time for its sgemm

// Weight rows in bands a thread: a band is expanded, then multiplied with all R rows of x by
// a single-threaded sgemm. The threads are this library's, not BLAS's: BLAS's own threads spin
// for ~0.1 s after a product, and an OpenMP product then (a decode step's) waited 4 ms a call
// for a core.
static int gemm_band(int K, int N, int nth) {
    int band = BAND_BYTES / (4 * K), even = (N + 4 * nth - 1) / (4 * nth);
    if (band > even) band = even;
    return band < 16 ? 16 : band;
}

// One function per format, its decoding named in the loop: OpenMP outlines a loop's body before
// inlining, so a decoding passed in would be called through a pointer for every block.
#define FORMAT(name, V, BS, MINS)                                                                          \
    void name##_f32(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) {            \
        const size_t rowbytes = (size_t)(K / V) * BS;                                                      \
        float *xs = group_sums(MINS, x, R, K);                                                             \
        _Pragma("omp parallel for schedule(static) num_threads(nth)")                                      \
        for (int o = 0; o < N; o++)                                                                        \
            for (int r0 = 0; r0 < R; r0 += TILE)                                                           \
                row_tile(name##_decode, V, BS, MINS, W + (size_t)o * rowbytes, K, x, xs, r0,                \
                         R - r0 < TILE ? R - r0 : TILE, y, N, o);                                          \
        free(xs);                                                                                          \
    }                                                                                                      \
    void name##_expand(const uint8_t *W, int N, int K, float *out, int nth) {                              \
        _Pragma("omp parallel for schedule(static) num_threads(nth)")                                      \
        for (int o = 0; o < N; o++)                                                                        \
            expand_row(name##_decode, V, BS, MINS, W + (size_t)o * (K / V) * BS, K, out + (size_t)o * K);  \
    }                                                                                                      \
    void name##_gemm(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) {           \
        const size_t rowbytes = (size_t)(K / V) * BS;                                                      \
        const int band = gemm_band(K, N, nth), blas = blas_get_threads();                                  \
        blas_set_threads(1);                                                                               \
        _Pragma("omp parallel num_threads(nth)") {                                                         \
            float *w = malloc(sizeof(float) * (size_t)band * K);                                           \
            _Pragma("omp for schedule(static)")                                                            \
            for (int a = 0; a < N; a += band) {                                                            \
                const int n = N - a < band ? N - a : band;                                                 \
                for (int o = 0; o < n; o++)                                                                \
                    expand_row(name##_decode, V, BS, MINS, W + (size_t)(a + o) * rowbytes, K, w + (size_t)o * K); \
                sgemm(101, 111, 112, R, n, K, 1.0f, x, K, w, K, 0.0f, y + a, N);                           \
            }                                                                                              \
            free(w);                                                                                       \
        }                                                                                                  \
        blas_set_threads(blas);                                                                            \
    }

FORMAT(q4_0, 32, 18, 0)
FORMAT(q4_1, 32, 20, 1)
FORMAT(q8_0, 32, 34, 0)
FORMAT(q5_0, 32, 22, 0)
FORMAT(q5_1, 32, 24, 1)
FORMAT(mxfp4, 32, 17, 0)
FORMAT(iq4_nl, 32, 18, 0)
FORMAT(q2_k, 256, 84, 1)
FORMAT(q3_k, 256, 110, 0)
FORMAT(q4_k, 256, 144, 1)
FORMAT(q5_k, 256, 176, 1)
FORMAT(q6_k, 256, 210, 0)
FORMAT(iq4_xs, 256, 136, 0)
