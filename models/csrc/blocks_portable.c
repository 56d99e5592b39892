// The products of models/csrc/blocks.c in plain C, for CPUs without AVX2 (ARM boards, older x86):
// y (R, N) = x (R, K) @ W^T with W (N, K) in GGUF's blocks, each block expanded to floats
// (w = d*q + m) and multiplied in float32. No intrinsics: the compiler vectorises the inner loops
// for whatever the machine has (-O3 -march=native), and the on-device check admits the result
// only if it is right there.
#include <stdint.h>
#include <string.h>
#include <omp.h>

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };
static int bsize(int kind) { return kind == Q4_0 ? 18 : kind == Q4_1 ? 20 : 34; }

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

// one block as 32 floats
static void expand(int kind, const uint8_t *blk, float w[32]) {
    float d = h2f(blk);
    if (kind == Q8_0) {
        const int8_t *q = (const int8_t *)(blk + 2);
        for (int j = 0; j < 32; j++) w[j] = d * (float)q[j];
        return;
    }
    float m = kind == Q4_1 ? h2f(blk + 2) : -8.0f * d;
    const uint8_t *q = blk + (kind == Q4_1 ? 4 : 2);
    for (int j = 0; j < 16; j++) {
        w[j] = d * (float)(q[j] & 15) + m;
        w[j + 16] = d * (float)(q[j] >> 4) + m;
    }
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

// ---- int8 activations: models/csrc/blocks.c's rounding and sums, in plain C ------------------

#include <math.h>
#include <stdlib.h>

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

// one block's integers: signed (Q4_0's offset taken off, Q8_0's as stored) or Q4_1's 0-15
static void block_i8(int kind, const uint8_t *blk, int8_t w[32]) {
    if (kind == Q8_0) {
        memcpy(w, blk + 2, 32);
        return;
    }
    const uint8_t *q = blk + (kind == Q4_1 ? 4 : 2);
    const int off = kind == Q4_0 ? 8 : 0;
    for (int j = 0; j < 16; j++) {
        w[j] = (int8_t)((q[j] & 15) - off);
        w[j + 16] = (int8_t)((q[j] >> 4) - off);
    }
}

static void gemm_i8(int kind, const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) {
    const int nb = K / 32, bs = bsize(kind);
    int8_t *q = malloc((size_t)R * K + 2 * sizeof(float) * (size_t)R * nb);
    if (q == NULL) return;
    float *d = (float *)(q + (size_t)R * K), *s = d + (size_t)R * nb;
    for (int r = 0; r < R; r++) quantize_row(x + (size_t)r * K, K, q + (size_t)r * K, d + (size_t)r * nb, s + (size_t)r * nb);
#pragma omp parallel for schedule(static) num_threads(nth)
    for (int o = 0; o < N; o++) {
        const uint8_t *wr = W + (size_t)o * nb * bs;
        int8_t w[32];
        for (int r = 0; r < R; r++) {
            float sum = 0.0f;
            for (int b = 0; b < nb; b++) {
                const uint8_t *blk = wr + (size_t)b * bs;
                block_i8(kind, blk, w);
                const int8_t *xq = q + (size_t)r * K + 32 * b;
                int dot = 0;
                for (int j = 0; j < 32; j++) dot += w[j] * xq[j];
                const size_t at = (size_t)r * nb + b;
                sum += h2f(blk) * d[at] * (float)dot;
                if (kind == Q4_1) sum += h2f(blk + 2) * s[at];
            }
            y[(size_t)r * N + o] = sum;
        }
    }
    free(q);
}

void q4_0_q8(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_i8(Q4_0, x, R, K, W, N, y, nth); }
void q4_1_q8(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_i8(Q4_1, x, R, K, W, N, y, nth); }
void q8_0_q8(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_i8(Q8_0, x, R, K, W, N, y, nth); }
