// A decode step's two blocks in one call each: the partial of one slice of one layer for B rows
// (one new token per sequence), the math of models/block_rows.py's attention_rows and ffn_rows.
//
// Why C: between two messages a block is ~35 NumPy calls run cold, each a few microseconds of
// interpreter and dispatch before any arithmetic (git log -p docs/decisions.md). Here a block
// is one call; the matrix products stay on the routines the device admitted for them, handed
// over as pointers: OpenBLAS's sgemv for float32 weights (no second BLAS in the process), the
// block products of models/csrc/blocks.c for GGUF's block formats.
//
// Layout, as in Python: weights row-major (out, in); the KV cache (slots, n_kv, positions, hd),
// stored as models/kvformat.py says (float32, f16, or q8_0's codes beside their f16 scales, one
// a 32 values); cos/sin (B, half) for each sequence's position. Built and checked on the device
// (models/rows_native.py): a build whose blocks differ from the NumPy ones is never used.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// cblas_sgemv with 64-bit integers (NumPy's OpenBLAS): order, trans, m, n, alpha, a, lda, x,
// incx, beta, y, incy.
typedef void (*sgemv_fn)(int, int, int64_t, int64_t, float, const float *, int64_t,
                         const float *, int64_t, float, float *, int64_t);
static sgemv_fn sgemv;

void rows_set_sgemv(void *fn) { sgemv = (sgemv_fn)fn; }

// A block format's product (models/csrc/blocks.c, expand.c): y (R, N) = x (R, K) @ W^T for W
// (N, K) as raw blocks, on nth threads. Indexed by the format's place in models/dtypes.py's
// BLOCK_DTYPES (models/rows_native.py: BLOCK_KINDS).
typedef void (*blocks_fn)(const float *, int, int, const uint8_t *, int, float *, int);
enum { F32 = -1, N_FORMATS = 16 };
static blocks_fn block_products[N_FORMATS];
// The threads a block product runs on, and below how many multiply-adds it runs on one: the
// rule of models/native.py's products, set from there (rows_set_threads).
static int block_threads = 1;
static int64_t block_small = 0;

void rows_set_block_product(int kind, void *fn) {
    if (kind >= 0 && kind < N_FORMATS) block_products[kind] = (blocks_fn)fn;
}
void rows_set_threads(int n, int64_t small) {
    block_threads = n > 0 ? n : 1;
    block_small = small;
}

// One step's sequences: shared by every layer's blocks.
typedef struct {
    int64_t B;
    const int64_t *slots;   // (B)
    const int64_t *starts;  // (B): the position of each sequence's new token
    const float *cos, *sin; // (B, half), this step's rows of the RoPE tables
    const float *local_cos, *local_sin; // a local layer's own tables (Gemma 3), or the same
} rows_step;

typedef struct {
    int64_t D, hd, nq, nkv, half; // half: rotary pairs per head (hd / 2 unless partial)
    const int64_t *kv_of_q;       // (nq): the KV head (of this slice) each query head reads
    const float *norm;            // (D)
    const float *q_norm, *k_norm; // (hd) each, or NULL
    float eps, scale;
    const void *wqkv;             // ((nq + 2 nkv) hd, D)
    const float *bqkv;            // bias or NULL
    const void *wo;               // (D, nq hd)
    int wqkv_kind, wo_kind;       // F32, or the block format each is stored in
    void *cache_k, *cache_v;      // (slots, nkv, W, hd) as kv_kind stores them
    uint16_t *scale_k, *scale_v;  // q8_0: (slots, nkv, W, hd / 32) f16 scales, else NULL
    int kv_kind;                  // KV_F32, KV_F16 or KV_Q8_0
    int64_t W;                    // positions the cache holds
    int ring;                     // a local layer: position p at p % W, the last W positions
    int local_rope;               // a local layer with its own RoPE tables
    int gate;                     // an output gate (Qwen3.5): wqkv's rows are each query head
                                  // then its gate, ((2 nq + 2 nkv) hd, D)
    const float *sinks;           // (nq): each head's logit in its softmax's denominator
                                  // (gpt-oss), or NULL
    const float *bo;              // (D): this slice's share of an O bias, or NULL
    float *scratch;               // MAX_ROWS ((nq (1 + gate) + 2 nkv) hd + nq hd + D) floats
} rows_attention_args;

typedef struct {
    int64_t D, n;           // n: this slice's FFN columns
    const float *norm;      // (D)
    float eps;
    int gelu;               // gelu_tanh, else silu
    const void *w_gate_up;  // (2 n, D)
    const void *w_down;     // (D, n)
    int gate_up_kind, down_kind;
    float *scratch;         // MAX_ROWS (D + 3 n) floats (models/rows_native.py)
} rows_ffn_args;

// y (B, out) = x (B, in) W^T: W float32 (kind F32: an sgemv a row) or raw blocks of format
// `kind`, all B rows in one product, which reads (and for most formats decodes) each block once
// for them all. A row's result is the same either way: the products sum each row alone.
static void products(int kind, const void *w, int64_t out, int64_t in, const float *x, int64_t B,
                     float *y) {
    if (kind == F32) {
        for (int64_t b = 0; b < B; b++)
            sgemv(101 /* row-major */, 111 /* no transpose */, out, in, 1.0f, (const float *)w, in,
                  x + b * in, 1, 0.0f, y + b * out, 1);
        return;
    }
    int nth = B * out * in < block_small ? 1 : block_threads;
    block_products[kind](x, (int)B, (int)in, (const uint8_t *)w, (int)out, y, nth);
}

static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *y) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * r * w[i];
}

static void rope(float *v, const float *c, const float *s, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c[i] - x2 * s[i];
        v[i + half] = x2 * c[i] + x1 * s[i];
    }
}

// How the KV cache stores a row (models/kvformat.py): attention reads each back as float32.
enum { KV_F32 = 0, KV_F16 = 1, KV_Q8_0 = 2, Q8_BLOCK = 32 };

// IEEE half to and from float: the compiler's _Float16 where it has one (F16C's instructions on
// x86, the FPU's on ARM), else by the bits, rounding to nearest even as NumPy does.
#if defined(__FLT16_MAX__)
static inline float h2f(uint16_t h) {
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}
static inline uint16_t f2h(float x) {
    _Float16 f = (_Float16)x;
    uint16_t h;
    memcpy(&h, &f, 2);
    return h;
}
#else
static float h2f(uint16_t h) {
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
static uint16_t f2h(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    uint32_t sign = (bits >> 16) & 0x8000, exp = (bits >> 23) & 0xff, man = bits & 0x7fffff;
    if (exp == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));  // inf, nan
    int e = (int)exp - 112;  // the half's biased exponent
    if (e >= 0x1f) return (uint16_t)(sign | 0x7c00);  // too large: inf
    if (e <= 0) {  // subnormal or zero: shift the mantissa (with its hidden bit) into place
        if (e < -10) return (uint16_t)sign;
        man |= 0x800000;
        int shift = 14 - e;
        uint32_t half = man >> shift, rest = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = ((uint32_t)e << 10) | (man >> 13), rest = man & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) half++;  // may carry into exp: right
    return (uint16_t)(sign | half);
}
#endif

// A q8_0 row's blocks are stored turned by the 32-point Walsh-Hadamard transform (models/
// kvformat.py says why): five rounds of pairwise sums and differences, in the order of
// kvformat.py's hadamard_blocks, so that every path stores the same codes and reads the same
// floats; normalized by HADAMARD_SCALE (1 / sqrt(32) as float32).
#define HADAMARD(x)                                                                     \
    for (int h = 1; h < Q8_BLOCK; h *= 2)                                               \
        for (int i = 0; i < Q8_BLOCK; i += 2 * h)                                       \
            for (int j = i; j < i + h; j++) {                                           \
                const __typeof__(x[0]) a = x[j], b = x[j + h];                          \
                x[j] = a + b, x[j + h] = a - b;                                         \
            }
static const float HADAMARD_SCALE = 0.17677669529663687; // the double, rounded to float

// Row `row` (hd values) of a cache as floats: float32 in place, else expanded into buf.
static const float *kv_row(const void *cache, const uint16_t *scales, int kind, size_t row,
                           int64_t hd, float *buf) {
    if (kind == KV_F32) return (const float *)cache + row * hd;
    if (kind == KV_F16) {
        const uint16_t *h = (const uint16_t *)cache + row * hd;
        int64_t d = 0;
#if defined(__F16C__)  // 8 at a time: the compiler converts _Float16 one by one
        for (; d + 8 <= hd; d += 8)
            _mm256_storeu_ps(buf + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + d))));
#endif
        for (; d < hd; d++) buf[d] = h2f(h[d]);
        return buf;
    }
    const int8_t *q = (const int8_t *)cache + row * hd;
    const uint16_t *s = scales + row * (hd / Q8_BLOCK);
    for (int64_t g = 0; g < hd / Q8_BLOCK; g++) {
        int32_t turned[Q8_BLOCK]; // the codes turned back, in integers: exact
        for (int j = 0; j < Q8_BLOCK; j++) turned[j] = q[g * Q8_BLOCK + j];
        HADAMARD(turned);
        const float d = h2f(s[g]) * HADAMARD_SCALE;
        for (int j = 0; j < Q8_BLOCK; j++) buf[g * Q8_BLOCK + j] = (float)turned[j] * d;
    }
    return buf;
}

// x (hd) into row `row` of a cache: q8_0 as GGUF quantizes (d = amax / 127), rounding half to
// even as NumPy and torch do, so that every path holds the same codes.
static void kv_store(void *cache, uint16_t *scales, int kind, size_t row, int64_t hd,
                     const float *x) {
    if (kind == KV_F32) {
        memcpy((float *)cache + row * hd, x, sizeof(float) * hd);
        return;
    }
    if (kind == KV_F16) {
        uint16_t *h = (uint16_t *)cache + row * hd;
        for (int64_t d = 0; d < hd; d++) h[d] = f2h(x[d]);
        return;
    }
    int8_t *q = (int8_t *)cache + row * hd;
    for (int64_t g = 0; g < hd / Q8_BLOCK; g++) {
        float v[Q8_BLOCK]; // the block turned (models/kvformat.py)
        memcpy(v, x + g * Q8_BLOCK, sizeof v);
        HADAMARD(v);
        for (int j = 0; j < Q8_BLOCK; j++) v[j] *= HADAMARD_SCALE;
        float amax = 0.0f;
        for (int j = 0; j < Q8_BLOCK; j++) amax = fmaxf(amax, fabsf(v[j]));
        const float d = amax / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < Q8_BLOCK; j++) q[g * Q8_BLOCK + j] = (int8_t)nearbyintf(v[j] * inverse);
        scales[row * (hd / Q8_BLOCK) + g] = f2h(d);
    }
}

// Query heads read their KV head's rows together, GROUP at a time: each key and value row is
// expanded and loaded once for them all.
#define GROUP 8

// A fused multiply-add where the CPU has one (x86 with FMA, every aarch64): one rounding, which
// the compiler may not split, so the same floats on any of them. (`+= a * b` let the compiler
// fuse some and not others: scores over 128 or 256 floats came out otherwise than fused.)
#if defined(__FMA__) || defined(__aarch64__)
#define MADD(a, b, c) fmaf(a, b, c)
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

// q_i . k for the g (1 to GROUP) query heads at q, hd apart: each over hd floats in 8 lanes, then
// the lanes in order. The compiler vectorises the lanes (a single running sum, in order, it may
// not reorder), so the result is the same on any thread and on any CPU with a fused multiply-add
// (MADD). The g heads are g independent
// chains of fmadds: one head at a time waited on each fmadd's latency. g is a constant in each
// inlined copy, so the lanes stay in registers.
static inline __attribute__((always_inline)) void dots_of(int g, const float *q, const float *k,
                                                          int64_t hd, float *out) {
    float lanes[GROUP][8] = {{0}};
    int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)  // the same fused lanes, in the registers a compiler
    __m256 acc[GROUP];                     // left to itself did not keep them in
    for (int i = 0; i < g; i++) acc[i] = _mm256_setzero_ps();
    for (; d + 8 <= hd; d += 8) {
        const __m256 kd = _mm256_loadu_ps(k + d);
        for (int i = 0; i < g; i++) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * hd + d), kd, acc[i]);
    }
    for (int i = 0; i < g; i++) _mm256_storeu_ps(lanes[i], acc[i]);
#else
    for (; d + 8 <= hd; d += 8)
        for (int i = 0; i < g; i++)
            for (int j = 0; j < 8; j++) lanes[i][j] = MADD(q[i * hd + d + j], k[d + j], lanes[i][j]);
#endif
    for (int i = 0; i < g; i++) {
        float s = 0.0f;
        for (int j = 0; j < 8; j++) s += lanes[i][j];
        for (int64_t e = d; e < hd; e++) s = MADD(q[i * hd + e], k[e], s);
        out[i] = s;
    }
}

static void dots(int64_t g, const float *q, const float *k, int64_t hd, float *out) {
    switch (g) {
    case 1: dots_of(1, q, k, hd, out); break;
    case 2: dots_of(2, q, k, hd, out); break;
    case 3: dots_of(3, q, k, hd, out); break;
    case 4: dots_of(4, q, k, hd, out); break;
    case 5: dots_of(5, q, k, hd, out); break;
    case 6: dots_of(6, q, k, hd, out); break;
    case 7: dots_of(7, q, k, hd, out); break;
    default: dots_of(8, q, k, hd, out); break;
    }
}

// Query heads [i0, i1) of qkv, all reading the KV head whose cache rows start at `base`,
// against `seen` of them: each head's output (hd, into att) is the softmax of its scaled scores
// over the values. p: room for GROUP x seen scores.
static void heads(const float *qkv, const rows_attention_args *a, size_t base, int64_t seen,
                  int64_t i0, int64_t i1, float *p, float *att) {
    const int64_t hd = a->hd;
    float buf[hd];  // a row expanded to floats (f16, q8_0)
    for (; i0 < i1; i0 += GROUP) {
        const int64_t g = i1 - i0 < GROUP ? i1 - i0 : GROUP;
        const float *q = qkv + i0 * hd;
        float top[GROUP], sum[GROUP];
        for (int64_t i = 0; i < g; i++) {  // a sink is one more logit, without a value
            top[i] = a->sinks ? a->sinks[i0 + i] : -INFINITY;
            sum[i] = 0.0f;
        }
        for (int64_t t = 0; t < seen; t++) {
            const float *k = kv_row(a->cache_k, a->scale_k, a->kv_kind, base + t, hd, buf);
            float qk[GROUP];
            dots(g, q, k, hd, qk);
            for (int64_t i = 0; i < g; i++) {
                float *pi = p + i * seen;
                pi[t] = qk[i] * a->scale;
                if (pi[t] > top[i]) top[i] = pi[t];
            }
        }
        for (int64_t i = 0; i < g; i++) {
            for (int64_t t = 0; t < seen; t++) sum[i] += p[i * seen + t] = expf(p[i * seen + t] - top[i]);
            if (a->sinks) sum[i] += expf(a->sinks[i0 + i] - top[i]);
        }
        float *o = att + i0 * hd;
        memset(o, 0, sizeof(float) * g * hd);
        for (int64_t t = 0; t < seen; t++) {
            const float *v = kv_row(a->cache_v, a->scale_v, a->kv_kind, base + t, hd, buf);
            for (int64_t i = 0; i < g; i++) {
                const float w = p[i * seen + t] / sum[i];
                float *oi = o + i * hd;
                for (int64_t d = 0; d < hd; d++) oi[d] += w * v[d];
            }
        }
    }
}

// Query heads [i0, i1) in runs that share a KV head (kv_of_q is non-decreasing).
static void head_range(const float *qkv, const rows_attention_args *a, size_t slot_base,
                       int64_t seen, int64_t i0, int64_t i1, float *p, float *att) {
    while (i0 < i1) {
        int64_t end = i0 + 1;
        while (end < i1 && a->kv_of_q[end] == a->kv_of_q[i0]) end++;
        heads(qkv, a, slot_base + (size_t)a->kv_of_q[i0] * a->W, seen, i0, end, p, att);
        i0 = end;
    }
}

// A gated layer's row of qkv, (q_0 g_0 q_1 g_1 ... k v): the queries packed first, as every
// other layer's (q k v), and the gates after them, in the room the packing left.
static void ungate(float *qkv, int64_t nq, int64_t nkv, int64_t hd) {
    float *gates = malloc(sizeof(float) * nq * hd);
    for (int64_t i = 0; i < nq; i++) memcpy(gates + i * hd, qkv + (2 * i + 1) * hd, sizeof(float) * hd);
    for (int64_t i = 1; i < nq; i++) memmove(qkv + i * hd, qkv + 2 * i * hd, sizeof(float) * hd);
    memmove(qkv + nq * hd, qkv + 2 * nq * hd, sizeof(float) * 2 * nkv * hd);
    memcpy(qkv + (nq + 2 * nkv) * hd, gates, sizeof(float) * nq * hd);
    free(gates);
}

// Query heads split between the block products' threads once a step's scores and sums over the
// cache are this many multiply-adds: ~2 us of work a thread for the fork and join to be worth it.
#define HEADS_PARALLEL (1 << 14)

// out (B, D) = this slice's attention partial for h (B, D); appends each sequence's key and value.
void rows_attention(const rows_attention_args *a, const rows_step *st, const float *h, float *out) {
    const int64_t D = a->D, hd = a->hd, nq = a->nq, nkv = a->nkv;
    const int64_t width = (nq * (a->gate ? 2 : 1) + 2 * nkv) * hd;
    const int64_t B = st->B;
    float *qkvs = a->scratch, *atts = qkvs + B * width, *x = atts + B * nq * hd;
    if (nq == 0) {
        memset(out, 0, sizeof(float) * B * D);
        return;
    }
    for (int64_t b = 0; b < B; b++) rms_norm(h + b * D, a->norm, D, a->eps, x + b * D);
    products(a->wqkv_kind, a->wqkv, width, D, x, B, qkvs);
    for (int64_t b = 0; b < B; b++) {
        const float *cos = (a->local_rope ? st->local_cos : st->cos) + b * a->half;
        const float *sin = (a->local_rope ? st->local_sin : st->sin) + b * a->half;
        float *qkv = qkvs + b * width, *att = atts + b * nq * hd;
        if (a->bqkv)
            for (int64_t i = 0; i < width; i++) qkv[i] += a->bqkv[i];
        if (a->gate) ungate(qkv, nq, nkv, hd);
        for (int64_t i = 0; i < nq + nkv; i++) {
            float *v = qkv + i * hd;
            const float *hn = i < nq ? a->q_norm : a->k_norm;
            if (hn) rms_norm(v, hn, hd, a->eps, v);
            rope(v, cos, sin, a->half);
        }
        int64_t pos = st->starts[b], slot = st->slots[b];
        int64_t at = a->ring ? pos % a->W : pos, seen = pos + 1 < a->W ? pos + 1 : a->W;
        for (int64_t j = 0; j < nkv; j++) {
            size_t row = ((size_t)slot * nkv + j) * a->W + at;
            kv_store(a->cache_k, a->scale_k, a->kv_kind, row, hd, qkv + (nq + j) * hd);
            kv_store(a->cache_v, a->scale_v, a->kv_kind, row, hd, qkv + (nq + nkv + j) * hd);
        }
        const size_t slot_base = (size_t)slot * nkv * a->W;  // in rows of hd
        const int threads = nq > 1 && block_threads > 1 && seen * nq * hd >= HEADS_PARALLEL
                                ? (int)(nq < block_threads ? nq : block_threads) : 1;
        float *scores = malloc(sizeof(float) * GROUP * seen * threads);
        if (threads > 1) {  // contiguous runs of heads a thread
#pragma omp parallel num_threads(threads)
            {
                const int64_t th = omp_get_thread_num(), n = omp_get_num_threads();
                head_range(qkv, a, slot_base, seen, nq * th / n, nq * (th + 1) / n,
                           scores + (size_t)th * GROUP * seen, att);
            }
        } else {
            head_range(qkv, a, slot_base, seen, 0, nq, scores, att);
        }
        free(scores);
        if (a->gate) {  // sigmoid as 0.5 (1 + tanh(g / 2)), as models/block_rows.py takes it
            const float *g = qkv + (nq + 2 * nkv) * hd;
            for (int64_t i = 0; i < nq * hd; i++) att[i] *= 0.5f + 0.5f * tanhf(0.5f * g[i]);
        }
    }
    products(a->wo_kind, a->wo, D, nq * hd, atts, B, out);
    if (a->bo)
        for (int64_t b = 0; b < B; b++)
            for (int64_t d = 0; d < D; d++) out[b * D + d] += a->bo[d];
}

// out (B, D) = this slice's FFN partial for h (B, D).
void rows_ffn(const rows_ffn_args *a, const rows_step *st, const float *h, float *out) {
    const int64_t D = a->D, n = a->n, B = st->B;
    float *x = a->scratch, *gus = x + B * D, *acts = gus + B * 2 * n;
    if (n == 0) {
        memset(out, 0, sizeof(float) * B * D);
        return;
    }
    for (int64_t b = 0; b < B; b++) rms_norm(h + b * D, a->norm, D, a->eps, x + b * D);
    products(a->gate_up_kind, a->w_gate_up, 2 * n, D, x, B, gus);
    for (int64_t b = 0; b < B; b++) {
        const float *gu = gus + b * 2 * n;
        float *act = acts + b * n;
        // 0.5 (1 + tanh(z)) = 1 / (1 + exp(-2z)): glibc's expf takes ~4 ns where tanhf takes
        // ~13, and a token runs this for every FFN column of every layer. exp overflowing to
        // inf for a very negative gate gives g / inf = 0, the function's limit.
        for (int64_t i = 0; i < n; i++) {
            float g = gu[i], u = gu[n + i];
            float z = a->gelu ? 0.7978845608028654f * (g + 0.044715f * g * g * g) : 0.5f * g;
            act[i] = g / (1.0f + expf(-2.0f * z)) * u;
        }
    }
    products(a->down_kind, a->w_down, D, n, acts, B, out);
}

// A gated DeltaNet layer (Qwen3.5, Qwen3-Next) of one slice: its value heads and the key heads
// they read (models/deltanet.py says the math; this is its decode step, one token a sequence).
typedef struct {
    int64_t D, nk, nv, dk, dv, K;  // this slice's key and value heads; K: the convolution's taps
    const int64_t *key_of_value;   // (nv): the key head (of this slice) each value head reads
    const float *norm;             // (D)
    const float *taps;             // (C, K), C = 2 nk dk + nv dv: queries', keys', values' channels
    const float *decay, *dt;       // (nv)
    const float *ssm_norm;         // (dv): the gated norm's weight, as stored
    float eps, l2_eps;
    const void *wqkv;              // (C + nv dv + 2 nv, D): channels, z, b, a
    const void *wo;                // (D, nv dv)
    int wqkv_kind, wo_kind;
    float *conv_states;            // (slots, C, K - 1): each slot's last K - 1 inputs
    float *states;                 // (slots, nv, dk, dv): each slot's recurrent state
    float *scratch;                // MAX_ROWS (D + width + nv dv) + C floats (models/rows_native.py)
} rows_linear_args;

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

// Keys or queries of n heads of dk, each over its L2 norm (models/deltanet.py's _l2norm), times
// scale.
static void l2_heads(float *x, int64_t n, int64_t dk, float eps, float scale) {
    for (int64_t i = 0; i < n; i++) {
        float *v = x + i * dk, ss = 0.0f;
        for (int64_t d = 0; d < dk; d++) ss += v[d] * v[d];
        const float r = 1.0f / sqrtf(ss + eps);
        for (int64_t d = 0; d < dk; d++) v[d] = v[d] * r * scale;
    }
}

// One value head's token through the gated delta rule, its state S (dk, dv) carried on in place:
// S = e^g S; delta = beta (v - S^T k); S += k delta^T; o = S^T q. Two passes over S (the decay
// and the recall, then the write and the read), where torch's five each read all of it.
static void delta_rule(float *S, const float *q, const float *k, const float *v, float beta,
                       float g, int64_t dk, int64_t dv, float *o) {
    const float decay = expf(g);
    float delta[dv];
    for (int64_t j = 0; j < dv; j++) delta[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * dv;
        const float ki = k[i];
        for (int64_t j = 0; j < dv; j++) {
            row[j] *= decay;
            delta[j] += row[j] * ki;
        }
    }
    for (int64_t j = 0; j < dv; j++) delta[j] = (v[j] - delta[j]) * beta, o[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * dv;
        const float ki = k[i], qi = q[i];
        for (int64_t j = 0; j < dv; j++) {
            row[j] += ki * delta[j];
            o[j] += row[j] * qi;
        }
    }
}

// out (B, D) = this slice's gated DeltaNet partial for h (B, D), each sequence's convolution
// inputs and state (in its slot) carried on past its token.
void rows_linear(const rows_linear_args *a, const rows_step *st, const float *h, float *out) {
    const int64_t D = a->D, nk = a->nk, nv = a->nv, dk = a->dk, dv = a->dv, K = a->K;
    const int64_t C = 2 * nk * dk + nv * dv, values = nv * dv, width = C + values + 2 * nv;
    const int64_t B = st->B;
    if (nv == 0) {
        memset(out, 0, sizeof(float) * B * D);
        return;
    }
    float *x = a->scratch, *proj = x + B * D, *normed = proj + B * width, *mixed = normed + B * values;
    for (int64_t b = 0; b < B; b++) rms_norm(h + b * D, a->norm, D, a->eps, x + b * D);
    products(a->wqkv_kind, a->wqkv, width, D, x, B, proj);
    const float scale = 1.0f / sqrtf((float)dk);
    for (int64_t b = 0; b < B; b++) {
        const float *p = proj + b * width, *z = p + C, *bs = z + values, *as = bs + nv;
        const int64_t slot = st->slots[b];
        float *conv = a->conv_states + slot * C * (K - 1);
        float *S = a->states + slot * nv * dk * dv;
        // The causal depthwise convolution over the last K - 1 inputs and this one, which then
        // joins them (the oldest leaves).
        for (int64_t c = 0; c < C; c++) {
            const float *t = a->taps + c * K;
            float *past = conv + c * (K - 1), acc = 0.0f;
            for (int64_t j = 0; j < K - 1; j++) acc += past[j] * t[j];
            acc += p[c] * t[K - 1];
            mixed[c] = silu(acc);
            if (K > 1) {
                memmove(past, past + 1, sizeof(float) * (K - 2));
                past[K - 2] = p[c];
            }
        }
        float *q = mixed, *k = q + nk * dk, *v = k + nk * dk;
        l2_heads(q, nk, dk, a->l2_eps, scale);
        l2_heads(k, nk, dk, a->l2_eps, 1.0f);
        float *o = normed + b * values;
        const int threads = block_threads > 1 && nv > 1 && nv * dk * dv >= HEADS_PARALLEL
                                ? (int)(nv < block_threads ? nv : block_threads) : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t i = 0; i < nv; i++) {
            const int64_t kh = a->key_of_value[i];
            const float beta = 1.0f / (1.0f + expf(-bs[i]));
            const float u = as[i] + a->dt[i];
            const float g = a->decay[i] * (u > 20.0f ? u : log1pf(expf(u))); // torch's softplus
            float *oi = o + i * dv;
            delta_rule(S + i * dk * dv, q + kh * dk, k + kh * dk, v + i * dv, beta, g, dk, dv, oi);
            rms_norm(oi, a->ssm_norm, dv, a->eps, oi);
            for (int64_t j = 0; j < dv; j++) oi[j] *= silu(z[i * dv + j]);
        }
    }
    products(a->wo_kind, a->wo, D, values, normed, B, out);
}

// A mixture's experts of one slice (Qwen3-MoE, Qwen3.5-MoE, Mixtral; models/moe.py's moe_rows):
// each chosen expert's SwiGLU over its columns of this slice, weighted, summed in the order of
// the experts' numbers as NumPy's loop sums them.
typedef struct {
    int64_t D, n;                   // n: this slice's columns of each expert
    const float *norm;              // (D): the FFN norm
    float eps;
    const uint8_t *w_gate_up;       // (E 2 n, D): expert e's gate rows, then its up rows
    const uint8_t *w_down;          // (E D, n)
    int gate_up_kind, down_kind;
    int64_t gate_up_row, down_row;  // bytes a row, as stored
    float *scratch;                 // MAX_ROWS (3 D + 3 n) floats (models/rows_native.py)
} rows_experts_args;

// out (B, D) = this slice's partial of the experts of each of B rows h (B, D): experts and
// weights (B, k), each row's choice (a row chooses an expert once).
void rows_experts(const rows_experts_args *a, const rows_step *st, const float *h,
                  const int64_t *experts, const float *weights, int64_t k, float *out) {
    const int64_t D = a->D, n = a->n, B = st->B;
    memset(out, 0, sizeof(float) * B * D);
    if (n == 0) return;
    float *x = a->scratch, *xs = x + B * D, *gu = xs + B * D, *act = gu + B * 2 * n;
    float *y = act + B * n;
    for (int64_t b = 0; b < B; b++) rms_norm(h + b * D, a->norm, D, a->eps, x + b * D);
    int64_t chosen[B * k], count = 0;  // the distinct experts, ascending
    for (int64_t i = 0; i < B * k; i++) {
        int64_t e = experts[i], at = 0;
        while (at < count && chosen[at] < e) at++;
        if (at < count && chosen[at] == e) continue;
        memmove(chosen + at + 1, chosen + at, sizeof(int64_t) * (count - at));
        chosen[at] = e, count++;
    }
    int64_t token[B];
    float weight[B];
    for (int64_t c = 0; c < count; c++) {
        const int64_t e = chosen[c];
        int64_t R = 0;
        for (int64_t b = 0; b < B; b++)
            for (int64_t j = 0; j < k; j++)
                if (experts[b * k + j] == e) {
                    token[R] = b, weight[R] = weights[b * k + j];
                    memcpy(xs + R * D, x + b * D, sizeof(float) * D);
                    R++;
                    break;
                }
        products(a->gate_up_kind, a->w_gate_up + e * 2 * n * a->gate_up_row, 2 * n, D, xs, R, gu);
        for (int64_t r = 0; r < R; r++)
            for (int64_t i = 0; i < n; i++) {  // silu(g) u as NumPy writes it: no overflow
                const float g = gu[r * 2 * n + i], u = gu[r * 2 * n + n + i];
                act[r * n + i] = g * (0.5f + 0.5f * tanhf(0.5f * g)) * u;
            }
        products(a->down_kind, a->w_down + e * D * a->down_row, D, n, act, R, y);
        for (int64_t r = 0; r < R; r++)
            for (int64_t d = 0; d < D; d++) out[token[r] * D + d] += y[r * D + d] * weight[r];
    }
}

// The two blocks behind one signature, for a caller that keeps a table of them (node/csrc/hop.c).
void rows_block(const void *args, int ffn, const rows_step *st, const float *h, float *out) {
    if (ffn)
        rows_ffn((const rows_ffn_args *)args, st, h, out);
    else
        rows_attention((const rows_attention_args *)args, st, h, out);
}

// y (B, D) = each row of x RMS-normed times w (D): a block's summed output normed before the
// residual (Gemma 3's post-block norms), here and in the engine's loop over the blocks alike.
void rows_post_norm(const float *x, const float *w, int64_t B, int64_t D, float eps, float *y) {
    for (int64_t b = 0; b < B; b++) rms_norm(x + b * D, w, D, eps, y + b * D);
}

// A sum's message as float16 and back (node/csrc/hop.c's, where MemoryOptions.wire asks): the
// same rounding as the KV cache's, and as NumPy's astype.
void rows_to_half(const float *x, uint16_t *h, int64_t n) {
    for (int64_t i = 0; i < n; i++) h[i] = f2h(x[i]);
}
void rows_from_half(const uint16_t *h, float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = h2f(h[i]);
}

// A decode step's layers on h (B, D), for a node that holds every layer whole: h += each block's
// output, in order (table[2 i]: layer i's attention arguments, table[2 i + 1]: its FFN's), normed
// first by row i of post_norms (2 layers, D) where the model has them (else NULL); out is (B, D)
// of room. The same sums, in the same float32 order, as the engine's loop over the blocks.
void rows_layers(const void *const *table, int64_t layers, const rows_step *st, float *h,
                 float *out, const float *post_norms, float eps) {
    const int64_t D = ((const rows_ffn_args *)table[1])->D, n = st->B * D;
    for (int64_t i = 0; i < 2 * layers; i++) {
        rows_block(table[i], (int)(i & 1), st, h, out);
        if (post_norms) rows_post_norm(out, post_norms + i * D, st->B, D, eps, out);
        for (int64_t j = 0; j < n; j++) h[j] += out[j];
    }
}
