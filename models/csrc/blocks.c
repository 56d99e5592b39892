// Products with matrices in GGUF's block formats (models/quant.py): y (R, N) = x (R, K) @ W^T,
// W (N, K) as raw blocks, row o being K/32 consecutive blocks (Q4_0 18 bytes, Q4_1 20, Q8_0 34).
// Built for x86 with AVX2, FMA and F16C by models/native.py; a CPU without them rejects the
// kernels in the on-device check (node/device.py), never at a user's request.
//
// *_f32: float activations; each block is expanded in registers (w = d*q + m) and multiplied in
//        float32: the stored weights' exact product, to float rounding.
// *_q8:  llama.cpp's way: the activations rounded to int8 a block (scale amax/127), integer dot
//        products, one float scale a block; the m term uses the block's rounded sum, so its
//        rounding cancels.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>

#define AI static inline __attribute__((always_inline))

AI float h2f(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }

AI float hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };
AI int bsize(int kind) { return kind == Q4_0 ? 18 : kind == Q4_1 ? 20 : 34; }

// one block -> 4 x 8 floats (elements 0-7, 8-15, 16-23, 24-31), dequantized
AI void block_f32(int kind, const uint8_t *blk, __m256 w[4]) {
    float d = h2f(blk);
    __m256 vd = _mm256_set1_ps(d);
    if (kind == Q8_0) {
        const uint8_t *q = blk + 2;
        for (int i = 0; i < 4; i++) {
            __m128i b = _mm_loadl_epi64((const __m128i *)(q + 8 * i));
            w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), vd);
        }
        return;
    }
    float m = kind == Q4_1 ? h2f(blk + 2) : -8.0f * d;
    __m256 vm = _mm256_set1_ps(m);
    __m128i b = _mm_loadu_si128((const __m128i *)(blk + (kind == Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(b, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    for (int i = 0; i < 4; i++) w[i] = _mm256_fmadd_ps(w[i], vd, vm);
}

// RT rows of x against one weight row
AI void row_f32(int kind, int RT, const uint8_t *wr, int nb, const float *x, int K, float *y, int N) {
    __m256 acc[8];
    for (int r = 0; r < RT; r++) acc[r] = _mm256_setzero_ps();
    const int bs = bsize(kind);
    for (int b = 0; b < nb; b++) {
        __m256 w[4];
        block_f32(kind, wr + (size_t)b * bs, w);
        const float *xb = x + b * 32;
        for (int r = 0; r < RT; r++) {
            const float *xr = xb + (size_t)r * K;
            acc[r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), acc[r]);
            acc[r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), acc[r]);
            acc[r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), acc[r]);
            acc[r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), acc[r]);
        }
    }
    for (int r = 0; r < RT; r++) y[(size_t)r * N] = hsum(acc[r]);
}

AI void gemm_f32_ld(int kind, const float *x, int R, int K, const uint8_t *W, int N, float *y, int ldy, int nth) {
    const int nb = K / 32;
    const size_t rowbytes = (size_t)nb * bsize(kind);
#pragma omp parallel for schedule(static) num_threads(nth)
    for (int o = 0; o < N; o++) {
        const uint8_t *wr = W + (size_t)o * rowbytes;
        int r0 = 0;
#define CALLF(RT) row_f32(kind, RT, wr, nb, x + (size_t)r0 * K, K, y + (size_t)r0 * ldy + o, ldy)
        for (; r0 + 8 <= R; r0 += 8) CALLF(8);
        switch (R - r0) {
        case 1: CALLF(1); break;
        case 2: CALLF(2); break;
        case 3: CALLF(3); break;
        case 4: CALLF(4); break;
        case 5: CALLF(5); break;
        case 6: CALLF(6); break;
        case 7: CALLF(7); break;
        default: break;
        }
#undef CALLF
    }
}
AI void gemm_f32(int kind, const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) {
    gemm_f32_ld(kind, x, R, K, W, N, y, N, nth);
}

void q4_0_f32(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_f32(Q4_0, x, R, K, W, N, y, nth); }
void q4_1_f32(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_f32(Q4_1, x, R, K, W, N, y, nth); }
void q8_0_f32(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_f32(Q8_0, x, R, K, W, N, y, nth); }

// ---- int8 activations (ggml's way) -------------------------------------------------------------

// x row -> int8 per 32-block: xq, dx (scale), sx (float sum of the block's x)
static void quant_x(const float *x, int K, int8_t *xq, float *dx, float *sx) {
    for (int b = 0; b < K / 32; b++) {
        const float *xb = x + b * 32;
        float amax = 0;
        for (int j = 0; j < 32; j++) { float a = fabsf(xb[j]); amax = a > amax ? a : amax; }
        float d = amax / 127.0f, id = d ? 1.0f / d : 0.0f;
        int s = 0;  // the sum of the *quantized* block (as ggml's Q8_1): the m term's error then cancels
        for (int j = 0; j < 32; j++) { int v = (int)lrintf(xb[j] * id); xq[b * 32 + j] = (int8_t)v; s += v; }
        dx[b] = d;
        sx[b] = d * (float)s;
    }
}

AI void row_q8(int kind, int RT, const uint8_t *wr, int nb, const int8_t *xq, const float *dx, const float *sx, int K,
               float *y, int N) {
    __m256 acc[8];
    float accm[8];
    for (int r = 0; r < RT; r++) { acc[r] = _mm256_setzero_ps(); accm[r] = 0; }
    const int bs = bsize(kind);
    const __m256i ones = _mm256_set1_epi16(1);
    const __m128i mask = _mm_set1_epi8(15);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = wr + (size_t)b * bs;
        float d = h2f(blk);
        __m256i q;
        float m = 0;
        if (kind == Q8_0) {
            q = _mm256_loadu_si256((const __m256i *)(blk + 2));
        } else {
            __m128i bb = _mm_loadu_si128((const __m128i *)(blk + (kind == Q4_1 ? 4 : 2)));
            q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bb, 4), mask), _mm_and_si128(bb, mask));
            m = kind == Q4_1 ? h2f(blk + 2) : -8.0f * d;
        }
        __m256i qa = kind == Q8_0 ? _mm256_sign_epi8(q, q) : q;
        for (int r = 0; r < RT; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (size_t)r * K + b * 32));
            if (kind == Q8_0) xv = _mm256_sign_epi8(xv, q);
            __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(qa, xv), ones);
            float s = d * dx[(size_t)r * nb + b];
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(s), acc[r]);
            if (kind != Q8_0) accm[r] += m * sx[(size_t)r * nb + b];
        }
    }
    for (int r = 0; r < RT; r++) y[(size_t)r * N] = hsum(acc[r]) + accm[r];
}

static void quant_rows(const float *x, int R, int K, int8_t *xq, float *dx, float *sx) {
    for (int r = 0; r < R; r++) quant_x(x + (size_t)r * K, K, xq + (size_t)r * K, dx + (size_t)r * (K / 32), sx + (size_t)r * (K / 32));
}

// rows [0, N) of W (already offset), y with row stride ldy
AI void gemm_q8_pre(int kind, const int8_t *xq, const float *dx, const float *sx, int R, int K, const uint8_t *W, int N,
                    float *y, int ldy, int nth) {
    const int nb = K / 32;
    const size_t rowbytes = (size_t)nb * bsize(kind);
#pragma omp parallel for schedule(static) num_threads(nth)
    for (int o = 0; o < N; o++) {
        const uint8_t *wr = W + (size_t)o * rowbytes;
        int r0 = 0;
#define CALL(RT) row_q8(kind, RT, wr, nb, xq + (size_t)r0 * K, dx + (size_t)r0 * nb, sx + (size_t)r0 * nb, K, y + (size_t)r0 * ldy + o, ldy)
        for (; r0 + 8 <= R; r0 += 8) CALL(8);
        switch (R - r0) {
        case 1: CALL(1); break;
        case 2: CALL(2); break;
        case 3: CALL(3); break;
        case 4: CALL(4); break;
        case 5: CALL(5); break;
        case 6: CALL(6); break;
        case 7: CALL(7); break;
        default: break;
        }
#undef CALL
    }
}

AI void gemm_q8(int kind, const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) {
    const int nb = K / 32;
    int8_t *xq = aligned_alloc(64, ((size_t)R * K + 63) / 64 * 64);
    float *dx = malloc(sizeof(float) * R * nb), *sx = malloc(sizeof(float) * R * nb);
    quant_rows(x, R, K, xq, dx, sx);
    gemm_q8_pre(kind, xq, dx, sx, R, K, W, N, y, N, nth);
    free(xq); free(dx); free(sx);
}

void q4_0_q8(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_q8(Q4_0, x, R, K, W, N, y, nth); }
void q4_1_q8(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_q8(Q4_1, x, R, K, W, N, y, nth); }
void q8_0_q8(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_q8(Q8_0, x, R, K, W, N, y, nth); }
