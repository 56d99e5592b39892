// The products of models/csrc/blocks.c's blocks of 32 in plain C, for CPUs without AVX2 (ARM
// boards, older x86): y (R, N) = x (R, K) @ W^T with W (N, K) in GGUF's blocks (Q4_0, Q4_1,
// Q8_0, Q5_0, Q5_1, IQ4_NL), each block expanded to floats (w = d*q + m) and multiplied in
// float32. No intrinsics there: the compiler vectorises the inner loops for whatever the machine
// has (-O3 -march=native), and the on-device check admits the result only if it is right there.
#include <stdint.h>
#include <string.h>
#include <omp.h>

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q5_0 = 3, Q5_1 = 4, IQ4_NL = 5 };
static int bsize(int kind) {
    return kind == Q4_0 || kind == IQ4_NL ? 18 : kind == Q4_1 ? 20 : kind == Q8_0 ? 34 : kind == Q5_0 ? 22 : 24;
}
static int has_min(int kind) { return kind == Q4_1 || kind == Q5_1; }  // an f16 minimum after d
// IQ4_NL's 16 values (llama.cpp's kvalues_iq4nl), which its nibbles index
static const int8_t IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// IEEE half to float, without the F16C instruction
static float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);  // inf, nan
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);  // normal
    } else if (man) {  // subnormal: normalise
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    } else {
        bits = sign;  // zero
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// one block's 32 codes: Q8_0's as stored, IQ4_NL's table values, else the 4- or 5-bit q (bit i
// of Q5's qh, after the scales, is element i's fifth)
static void block_codes(int kind, const uint8_t *blk, int c[32]) {
    if (kind == Q8_0) {
        for (int j = 0; j < 32; j++) c[j] = ((const int8_t *)(blk + 2))[j];
        return;
    }
    const int at = kind == Q4_0 || kind == IQ4_NL ? 2 : kind == Q4_1 ? 4 : kind == Q5_0 ? 6 : 8;
    uint32_t qh = 0;
    if (kind == Q5_0 || kind == Q5_1) memcpy(&qh, blk + (kind == Q5_0 ? 2 : 4), 4);
    for (int j = 0; j < 16; j++) {
        const int lo = (blk[at + j] & 15) | ((qh >> j) & 1) << 4, hi = (blk[at + j] >> 4) | ((qh >> (j + 16)) & 1) << 4;
        c[j] = kind == IQ4_NL ? IQ4NL[lo] : lo;
        c[j + 16] = kind == IQ4_NL ? IQ4NL[hi] : hi;
    }
}

// the value an unsigned code is off by: w = d (q - offset) for Q4_0 and Q5_0
static int offset(int kind) { return kind == Q4_0 ? 8 : kind == Q5_0 ? 16 : 0; }

// one block as 32 floats, w = d q + m (m: the stored minimum, or -offset d)
static void expand(int kind, const uint8_t *blk, float w[32]) {
    const float d = h2f(blk), m = has_min(kind) ? h2f(blk + 2) : -(float)offset(kind) * d;
    int c[32];
    block_codes(kind, blk, c);
    for (int j = 0; j < 32; j++) w[j] = d * (float)c[j] + m;
}

static void gemm(int kind, const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) {
    const int nb = K / 32, bs = bsize(kind);
#pragma omp parallel for schedule(static) num_threads(nth)
    for (int o = 0; o < N; o++) {
        const uint8_t *wr = W + (size_t)o * nb * bs;
        for (int r = 0; r < R; r++) {
            const float *xr = x + (size_t)r * K;
            float acc[32] = {0};  // 32 partial sums: independent, so they vectorise
            float w[32];
            for (int b = 0; b < nb; b++) {
                expand(kind, wr + (size_t)b * bs, w);
                for (int j = 0; j < 32; j++) acc[j] += w[j] * xr[b * 32 + j];
            }
            float sum = 0;
            for (int j = 0; j < 32; j++) sum += acc[j];
            y[(size_t)r * N + o] = sum;
        }
    }
}

void q4_0_f32(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm(Q4_0, x, R, K, W, N, y, nth); }
void q4_1_f32(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm(Q4_1, x, R, K, W, N, y, nth); }
void q8_0_f32(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm(Q8_0, x, R, K, W, N, y, nth); }
void q5_0_f32(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm(Q5_0, x, R, K, W, N, y, nth); }
void q5_1_f32(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm(Q5_1, x, R, K, W, N, y, nth); }
void iq4_nl_f32(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm(IQ4_NL, x, R, K, W, N, y, nth); }

// ---- int8 activations: models/csrc/blocks.c's rounding and sums, in plain C ------------------

#include <math.h>
#include <stdlib.h>
#if defined(__ARM_FEATURE_DOTPROD) || defined(__ARM_FEATURE_MATMUL_INT8)
#include <arm_neon.h>
#endif

// one row of x as int8 blocks: d = max|x| / 127, q = x * (1/d) to the nearest (ties to even),
// s = d * sum(q)
static void quantize_row(const float *x, int K, int8_t *q, float *d, float *s) {
    for (int b = 0; b < K / 32; b++) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[32 * b + j]));
        const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            const int v = (int)nearbyintf(x[32 * b + j] * id);
            q[32 * b + j] = (int8_t)v;
            sum += v;
        }
        d[b] = db;
        s[b] = db * (float)sum;
    }
}

// one block's integers: signed (Q4_0's and Q5_0's offset taken off, Q8_0's as stored, IQ4_NL's
// table values) or Q4_1's and Q5_1's unsigned q, whose minimum comes with x's block sum
static void block_i8(int kind, const uint8_t *blk, int8_t w[32]) {
    int c[32];
    block_codes(kind, blk, c);
    for (int j = 0; j < 32; j++) w[j] = (int8_t)(c[j] - offset(kind));
}

// A block's integer dot product: 32 int8 products, summed exactly (sdot where the CPU has it).
static inline int dot32(const int8_t *a, const int8_t *b) {
#if defined(__ARM_FEATURE_DOTPROD)
    int32x4_t acc = vdotq_s32(vdupq_n_s32(0), vld1q_s8(a), vld1q_s8(b));
    return vaddvq_s32(vdotq_s32(acc, vld1q_s8(a + 16), vld1q_s8(b + 16)));
#else
    int dot = 0;
    for (int j = 0; j < 32; j++) dot += a[j] * b[j];
    return dot;
#endif
}

// Blocks w[i] (i < nw) against x rows xq[k] (k < nx, K apart): dots[i][k], exact. Two by two, an
// i8mm CPU takes the four in smmla's 2x8-by-8x2 products, 8 values at a time.
static inline void block_dots(const int8_t w[2][32], int nw, const int8_t *xq, int nx, int K, int dots[2][2]) {
#if defined(__ARM_FEATURE_MATMUL_INT8)
    if (nw == 2 && nx == 2) {
        int32x4_t acc = vdupq_n_s32(0);
        for (int k = 0; k < 32; k += 8)
            acc = vmmlaq_s32(acc, vcombine_s8(vld1_s8(w[0] + k), vld1_s8(w[1] + k)),
                             vcombine_s8(vld1_s8(xq + k), vld1_s8(xq + K + k)));
        int out[4];
        vst1q_s32(out, acc);  // [w0 x0, w0 x1, w1 x0, w1 x1]
        dots[0][0] = out[0], dots[0][1] = out[1], dots[1][0] = out[2], dots[1][1] = out[3];
        return;
    }
#endif
    for (int i = 0; i < nw; i++)
        for (int k = 0; k < nx; k++) dots[i][k] = dot32(w[i], xq + (size_t)k * K);
}

// Weight rows and rows of x two by two; each output sums its blocks in order, the same floats
// whichever way its block's integer sum was taken.
static void gemm_i8(int kind, const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) {
    const int nb = K / 32, bs = bsize(kind);
    int8_t *q = malloc((size_t)R * K + 2 * sizeof(float) * (size_t)R * nb);
    if (q == NULL) return;
    float *d = (float *)(q + (size_t)R * K), *s = d + (size_t)R * nb;
    for (int r = 0; r < R; r++) quantize_row(x + (size_t)r * K, K, q + (size_t)r * K, d + (size_t)r * nb, s + (size_t)r * nb);
#pragma omp parallel for schedule(static) num_threads(nth)
    for (int o = 0; o < N; o += 2) {
        const int nw = o + 1 < N ? 2 : 1;
        const uint8_t *wr = W + (size_t)o * nb * bs;
        int8_t w[2][32];
        for (int r = 0; r < R; r += 2) {
            const int nx = r + 1 < R ? 2 : 1;
            float sum[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
            for (int b = 0; b < nb; b++) {
                int dots[2][2];
                for (int i = 0; i < nw; i++) block_i8(kind, wr + ((size_t)i * nb + b) * bs, w[i]);
                block_dots((const int8_t(*)[32])w, nw, q + (size_t)r * K + 32 * b, nx, K, dots);
                for (int i = 0; i < nw; i++) {
                    const uint8_t *blk = wr + ((size_t)i * nb + b) * bs;
                    for (int k = 0; k < nx; k++) {
                        const size_t at = (size_t)(r + k) * nb + b;
                        sum[i][k] += h2f(blk) * d[at] * (float)dots[i][k];
                        if (has_min(kind)) sum[i][k] += h2f(blk + 2) * s[at];
                    }
                }
            }
            for (int i = 0; i < nw; i++)
                for (int k = 0; k < nx; k++) y[(size_t)(r + k) * N + o + i] = sum[i][k];
        }
    }
    free(q);
}

void q4_0_q8(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_i8(Q4_0, x, R, K, W, N, y, nth); }
void q4_1_q8(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_i8(Q4_1, x, R, K, W, N, y, nth); }
void q8_0_q8(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_i8(Q8_0, x, R, K, W, N, y, nth); }
void q5_0_q8(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_i8(Q5_0, x, R, K, W, N, y, nth); }
void q5_1_q8(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_i8(Q5_1, x, R, K, W, N, y, nth); }
void iq4_nl_q8(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_i8(IQ4_NL, x, R, K, W, N, y, nth); }
