// Products with matrices in GGUF's block formats (models/quant.py): y (R, N) = x (R, K) @ W^T,
// W (N, K) as raw blocks, row o being K/32 consecutive blocks (Q4_0 18 bytes, Q4_1 20, Q8_0 34,
// Q5_0 22, Q5_1 24: Q4's with a fifth bit per weight in 4 bytes after the scales; IQ4_NL 18,
// Q4_0's layout with its nibbles indices into a table of 16 values), and two K-quants in blocks
// of 256 (Q4_K 144 bytes: d, dmin, 12 bytes of 6-bit scales and minimums, a nibble a weight;
// Q6_K 210: 4 low bits, 2 high bits, a signed scale per 16 weights, d). The float products
// take a K-quant's 256 as 8 blocks of 32, each with its scale (and Q4_K's minimum) decoded.
// Built for x86 with AVX2, FMA and F16C by models/native.py, and again with AVX-512F (the float
// products' tiles then in 16 lanes, below); a CPU without them rejects the kernels in the
// on-device check (node/device.py), never at a user's request.
//
// Float activations (`<format>_f32`): each block is expanded in registers (w = d*q + m) and
// multiplied in float32, the stored weights' exact product to float rounding. Int8 activations
// (`<format>_q8`, `--activations int8`, after these): x rounded to int8 a block as llama.cpp
// rounds it, integer dot products.
// Tiles of up to 4 weight rows x up to 8 rows of x: independent accumulators (a single one would
// wait on the fmadd's latency every block), each weight block unpacked once for the tile's x rows
// and each x block loaded once for its weight rows; threads split W by groups of 4 rows. Any tile
// sums each output in the same order, so the result does not depend on the tiling.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#define AI static inline __attribute__((always_inline))

AI float hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q5_0 = 3, Q5_1 = 4, IQ4_NL = 5, Q4_K = 6, Q6_K = 7 };
AI int k_quant(int kind) { return kind == Q4_K || kind == Q6_K; }
AI int per_block(int kind) { return k_quant(kind) ? 256 : 32; }  // weights a block
AI int bsize(int kind) {
    if (k_quant(kind)) return kind == Q4_K ? 144 : 210;
    return kind == Q4_0 || kind == IQ4_NL ? 18 : kind == Q4_1 ? 20 : kind == Q8_0 ? 34 : kind == Q5_0 ? 22 : 24;
}
AI int has_min(int kind) { return kind == Q4_1 || kind == Q5_1; }  // an f16 minimum after d
AI int nibbles_at(int kind) { return kind == Q4_0 || kind == IQ4_NL ? 2 : kind == Q4_1 ? 4 : kind == Q5_0 ? 6 : 8; }
AI int offset(int kind) { return kind == Q4_0 ? 8 : kind == Q5_0 ? 16 : 0; }  // w = d (q - offset) (+ m)

// A tile of G > 1 weight rows reads G short streams at once, too many for the hardware prefetcher
// (measured: q8_0 49152x576 three times slower without this): fetch the rows a whole number of
// tiles and at least PREFETCH_BYTES ahead, in step. One tile ahead was too near for short rows:
// memory had not answered by the time they were read (a Zen 5, one thread, int8 rows: Q4_1
// 1536x576 read at 10 GB/s against 15 at 4 KB ahead; SmolLM2's token 8.0 against 6.3 ms).
enum { PREFETCH_BYTES = 4096 };
AI void prefetch_next(int G, const uint8_t *w, size_t rowbytes, int b, int bs) {
    if (G == 1) return;
    const size_t tile = G * rowbytes, ahead = tile * ((PREFETCH_BYTES + tile - 1) / tile);  // tiles
    const char *next = (const char *)w + ahead + (size_t)b * G * bs;
    for (int i = 0; i < G * bs; i += 64) _mm_prefetch(next + i, _MM_HINT_T0);
}

// The f16 scales of G (1, 2 or 4) blocks side by side as floats: d_g in lane g and, for Q4_1, the
// minimum m_g in lane 4 + g. One conversion for G blocks instead of G scalar ones.
AI __m256 heads(int kind, int G, const uint8_t *const blk[4]) {
    __m128i h[4];
    for (int g = 0; g < G; g++) { int32_t v; memcpy(&v, blk[g], 4); h[g] = _mm_cvtsi32_si128(v); }
    if (has_min(kind)) {  // words d m per block: gather [d0 m0 d1 m1 ..], then [d0 d1 .. | m0 m1 ..]
        __m128i dm = G == 1 ? h[0] : _mm_unpacklo_epi32(h[0], h[1]);
        if (G == 4) dm = _mm_unpacklo_epi64(dm, _mm_unpacklo_epi32(h[2], h[3]));
        dm = _mm_shuffle_epi8(dm, _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
        return _mm256_cvtph_ps(dm);
    }
    __m128i d = G == 1 ? h[0] : _mm_unpacklo_epi16(h[0], h[1]);  // the first word is d
    if (G == 4) d = _mm_unpacklo_epi32(d, _mm_unpacklo_epi16(h[2], h[3]));
    return _mm256_castps128_ps256(_mm_cvtph_ps(d));  // (vcvtph2ps xmm zeroes the upper lanes)
}

// lane i (0-3) of both halves of v, everywhere: an in-lane shuffle, twice vpermps's throughput
AI __m256 lane(__m256 v, int i) { return _mm256_permute_ps(v, i * 0x55); }

// one block -> 4 x 8 floats (elements 0-7, 8-15, 16-23, 24-31), w = d*q + m (Q8_0: d*q); vd and
// vm hold d and m everywhere
AI void block_f32(int kind, const uint8_t *blk, __m256 vd, __m256 vm, __m256 w[4]) {
    if (kind == Q8_0) {
        const uint8_t *q = blk + 2;
        for (int i = 0; i < 4; i++) {
            __m128i b = _mm_loadl_epi64((const __m128i *)(q + 8 * i));
            w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), vd);
        }
        return;
    }
    // the 16 bytes in both halves; in-lane byte shuffles spread bytes 0-7 and 8-15 to dwords
    // (cheaper than vpmovzxbd, which crosses lanes): their low nibbles are elements 0-15, the
    // high ones 16-31
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk + nibbles_at(kind))));
    const __m256i lo = _mm256_shuffle_epi8(b, _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                                               4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1));
    const __m256i hi = _mm256_shuffle_epi8(b, _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1,
                                                               12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1));
    const __m256i low4 = _mm256_set1_epi32(15);
    __m256i q[4] = {_mm256_and_si256(lo, low4), _mm256_and_si256(hi, low4), _mm256_srli_epi32(lo, 4),
                    _mm256_srli_epi32(hi, 4)};
    if (kind == Q5_0 || kind == Q5_1) {  // bit i of qh (after the scales) is element i's fifth bit, as 16
        int32_t qh;
        memcpy(&qh, blk + (kind == Q5_0 ? 2 : 4), 4);
        const __m256i bits = _mm256_set1_epi32(qh);
        for (int i = 0; i < 4; i++) {
            const __m256i at = _mm256_setr_epi32(8 * i, 8 * i + 1, 8 * i + 2, 8 * i + 3, 8 * i + 4, 8 * i + 5, 8 * i + 6, 8 * i + 7);
            q[i] = _mm256_or_si256(q[i], _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(bits, at), _mm256_set1_epi32(1)), 4));
        }
    }
    if (kind == IQ4_NL) {  // the table's entries (llama.cpp's kvalues_iq4nl): bit 3 picks the half
        const __m256 low = _mm256_setr_ps(-127, -104, -83, -65, -49, -35, -22, -10);
        const __m256 high = _mm256_setr_ps(1, 13, 25, 38, 53, 69, 89, 113);
        for (int i = 0; i < 4; i++) {
            const __m256 upper = _mm256_castsi256_ps(_mm256_slli_epi32(q[i], 28));
            const __m256 t = _mm256_blendv_ps(_mm256_permutevar8x32_ps(low, q[i]), _mm256_permutevar8x32_ps(high, q[i]), upper);
            w[i] = _mm256_mul_ps(t, vd);
        }
        return;
    }
    for (int i = 0; i < 4; i++) w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[i]), vd, vm);
}

// The float products' shared steps: a block of 32 expanded weights (wv) against RT rows of x
// (x: the block's values in row 0, rows K apart), four fmadds a row into its accumulator; and
// each accumulator's sum into y, rows ldy apart.
AI void block_rows_f32(const __m256 wv[4], const float *x, int K, int RT, __m256 *acc) {
    for (int r = 0; r < RT; r++)
        for (int i = 0; i < 4; i++) acc[r] = _mm256_fmadd_ps(wv[i], _mm256_loadu_ps(x + (size_t)r * K + 8 * i), acc[r]);
}

AI void store_sums(int G, int RT, __m256 acc[4][8], float *y, int ldy) {
    for (int g = 0; g < G; g++)
        for (int r = 0; r < RT; r++) y[(size_t)r * ldy + g] = hsum(acc[g][r]);
}

// ---- K-quants: a block of 256 as 8 of 32 ----------------------------------------------------

// 8 bytes as 8 floats, times v
AI __m256 bytes8_times(uint64_t b, int is_signed, float v) {
    const __m128i q = _mm_cvtsi64_si128((long long)b);
    const __m256i n = is_signed ? _mm256_cvtepi8_epi32(q) : _mm256_cvtepu8_epi32(q);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(n), _mm256_set1_ps(v));
}

// Q4_K's 8 scales and minimums (6 bits each in 12 bytes, as ggml-quants.c's get_scale_min_k4
// reads them: sub-blocks 0-3 from the low 6 bits of bytes 0-3 and 4-7, 4-7 from bytes 8-11's
// nibbles with bytes 0-7's top 2 bits above them), as a byte each: sc's byte j, mn's byte j
AI void q4_k_scale_bytes(const uint8_t *blk, uint64_t *sc, uint64_t *mn) {
    uint32_t a[3];
    memcpy(a, blk + 4, 12);
    const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
    *sc = (a[0] & six) | (uint64_t)((a[2] & four) | ((a[0] >> 6) & two) << 4) << 32;
    *mn = (a[1] & six) | (uint64_t)(((a[2] >> 4) & four) | ((a[1] >> 6) & two) << 4) << 32;
}

// the same times d and -dmin, as floats
AI void q4_k_scales(const uint8_t *blk, float s[8], float m[8]) {
    uint64_t sc, mn;
    q4_k_scale_bytes(blk, &sc, &mn);
    _mm256_storeu_ps(s, bytes8_times(sc, 0, _cvtsh_ss(*(const uint16_t *)blk)));
    _mm256_storeu_ps(m, bytes8_times(mn, 0, -_cvtsh_ss(*(const uint16_t *)(blk + 2))));
}

// Q6_K's 16 signed scales times d
AI void q6_k_scales(const uint8_t *blk, float s[16]) {
    uint64_t sc[2];
    memcpy(sc, blk + 192, 16);
    const float d = _cvtsh_ss(*(const uint16_t *)(blk + 208));
    _mm256_storeu_ps(s, bytes8_times(sc[0], 1, d));
    _mm256_storeu_ps(s + 8, bytes8_times(sc[1], 1, d));
}

// 32 bytes -> 4 x 8 floats (elements 0-7, 8-15, 16-23, 24-31)
AI void bytes_f32(__m256i q, int is_signed, __m256 out[4]) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; i++)
        out[i] = _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(part[i]) : _mm256_cvtepu8_epi32(part[i]));
}

// A K-quant block's 32 weights [32j, 32j + 32) as bytes: Q4_K's nibbles 0-15 (unsigned), Q6_K's
// q - 32 (signed, -32 to 31), in element order
AI __m256i k_codes(int kind, const uint8_t *blk, int j) {
    if (kind == Q4_K) {  // bytes [32 (j/2), +32): low nibbles for an even j, high for an odd one
        __m256i b = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * (j / 2)));
        if (j & 1) b = _mm256_srli_epi16(b, 4);
        return _mm256_and_si256(b, _mm256_set1_epi8(15));
    }
    // Q6_K: half h = j / 4 of 128 weights, quarter k = j % 4 of it: 4 low bits from ql[64 h +
    // 32 (k & 1)], the low nibble for k < 2, else the high one; 2 high bits from qh[32 h] at bit 2k
    const int h = j / 4, k = j % 4;
    __m256i lo = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (k & 1)));
    if (k >= 2) lo = _mm256_srli_epi16(lo, 4);
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
    const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k)), _mm256_set1_epi8(3));
    const __m256i v = _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi8(15)), _mm256_slli_epi16(high, 4));
    return _mm256_sub_epi8(v, _mm256_set1_epi8(32));
}

// weights [32j, 32j + 32) of a K-quant block as floats, w = s q + m (Q4_K) or s q (Q6_K, a scale
// per 16: s[2j] for the first half, s[2j + 1] for the second)
AI void k_block_f32(int kind, const uint8_t *blk, int j, const float *s, const float *m, __m256 w[4]) {
    __m256 q[4];
    bytes_f32(k_codes(kind, blk, j), kind == Q6_K, q);
    if (kind == Q4_K) {
        const __m256 vs = _mm256_set1_ps(s[j]), vm = _mm256_set1_ps(m[j]);
        for (int i = 0; i < 4; i++) w[i] = _mm256_fmadd_ps(q[i], vs, vm);
        return;
    }
    const __m256 s0 = _mm256_set1_ps(s[2 * j]), s1 = _mm256_set1_ps(s[2 * j + 1]);
    w[0] = _mm256_mul_ps(q[0], s0);
    w[1] = _mm256_mul_ps(q[1], s0);
    w[2] = _mm256_mul_ps(q[2], s1);
    w[3] = _mm256_mul_ps(q[3], s1);
}

// A K-quant's tile, as tile_f32's: every accumulator sums its blocks of 32 in order, four
// fmadds a block, so the result does not depend on the tiling either.
AI void tile_k_f32(int kind, int G, int RT, const uint8_t *w, size_t rowbytes, int nb, const float *x, int K, float *y,
                   int ldy) {
    __m256 acc[4][8];
    for (int g = 0; g < G; g++)
        for (int r = 0; r < RT; r++) acc[g][r] = _mm256_setzero_ps();
    const int bs = bsize(kind);
    for (int b = 0; b < nb; b++) {
        prefetch_next(G, w, rowbytes, b, bs);
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = w + g * rowbytes + (size_t)b * bs;
            float s[16], m[8];
            if (kind == Q4_K) q4_k_scales(blk, s, m);
            else q6_k_scales(blk, s);
            for (int j = 0; j < 8; j++) {
                __m256 wv[4];
                k_block_f32(kind, blk, j, s, m, wv);
                block_rows_f32(wv, x + b * 256 + 32 * j, K, RT, acc[g]);
            }
        }
    }
    store_sums(G, RT, acc, y, ldy);
}

// G weight rows x RT rows of x: G*RT accumulators, each weight block expanded once for RT rows
// and each x block loaded once for G rows. Every accumulator sums its products in the order of
// one row's (four fmadds a block): the same floats for any tile.
AI void tile_f32(int kind, int G, int RT, const uint8_t *w, size_t rowbytes, int nb, const float *x, int K, float *y,
                 int ldy) {
    if (k_quant(kind)) {
        tile_k_f32(kind, G, RT, w, rowbytes, nb, x, K, y, ldy);
        return;
    }
    __m256 acc[4][8];
    for (int g = 0; g < G; g++)
        for (int r = 0; r < RT; r++) acc[g][r] = _mm256_setzero_ps();
    const int bs = bsize(kind);
    for (int b = 0; b < nb; b++) {
        prefetch_next(G, w, rowbytes, b, bs);
        const uint8_t *blk[4];
        for (int g = 0; g < G; g++) blk[g] = w + g * rowbytes + (size_t)b * bs;
        const __m256 dm = heads(kind, G, blk);
        const __m256 dd = _mm256_insertf128_ps(dm, _mm256_castps256_ps128(dm), 1);  // d_g in lanes g and 4 + g
        const __m256 mm = has_min(kind) ? _mm256_permute2f128_ps(dm, dm, 0x11) : _mm256_mul_ps(dd, _mm256_set1_ps(-(float)offset(kind)));
        for (int g = 0; g < G; g++) {
            __m256 wv[4];
            block_f32(kind, blk[g], lane(dd, g), lane(mm, g), wv);
            block_rows_f32(wv, x + b * 32, K, RT, acc[g]);
        }
    }
    store_sums(G, RT, acc, y, ldy);
}

#ifdef __AVX512F__
// ---- the float products in AVX-512 (the "avx512" build of this file) ---------------------------
// A block of 32 is two vectors of 16 instead of four of 8: half the unpacking, conversions and
// fmadds a block, where the AVX2 tiles are bound by those, not by memory (SmolLM2's 1536x576
// Q4_1 read from cache at 10 GB/s). Each accumulator sums elements i and 16 + i of each block,
// in block order: the same floats for any tile, another order than the AVX2 build's (3e-7).

// one block of 32 -> elements 0-15 and 16-31 as floats, w = d*q + m (Q8_0 and IQ4_NL: d*q)
AI void block_f32_512(int kind, const uint8_t *blk, __m512 vd, __m512 vm, __m512 w[2]) {
    if (kind == Q8_0) {
        for (int i = 0; i < 2; i++)
            w[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2 + 16 * i)))), vd);
        return;
    }
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + nibbles_at(kind))));
    __m512i q[2] = {_mm512_and_si512(b, _mm512_set1_epi32(15)), _mm512_srli_epi32(b, 4)};
    if (kind == Q5_0 || kind == Q5_1) {  // bit i of qh (after the scales) is element i's fifth bit, as 16
        int32_t qh;
        memcpy(&qh, blk + (kind == Q5_0 ? 2 : 4), 4);
        const __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (int i = 0; i < 2; i++) {
            const __m512i bits = _mm512_srlv_epi32(_mm512_set1_epi32(qh), _mm512_add_epi32(at, _mm512_set1_epi32(16 * i)));
            q[i] = _mm512_or_si512(q[i], _mm512_slli_epi32(_mm512_and_si512(bits, _mm512_set1_epi32(1)), 4));
        }
    }
    if (kind == IQ4_NL) {  // llama.cpp's kvalues_iq4nl, indexed by the nibble
        const __m512 table = _mm512_setr_ps(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
        for (int i = 0; i < 2; i++) w[i] = _mm512_mul_ps(_mm512_permutexvar_ps(q[i], table), vd);
        return;
    }
    for (int i = 0; i < 2; i++) w[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q[i]), vd, vm);
}

// a K-quant block's weights [32j, 32j + 32) as floats: Q4_K w = s q + m, Q6_K w = s q (a scale
// per 16, so one a vector)
AI void k_block_f32_512(int kind, const uint8_t *blk, int j, const float *s, const float *m, __m512 w[2]) {
    const __m256i c = k_codes(kind, blk, j);
    const __m128i half[2] = {_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1)};
    for (int i = 0; i < 2; i++) {
        const __m512 q = _mm512_cvtepi32_ps(kind == Q6_K ? _mm512_cvtepi8_epi32(half[i]) : _mm512_cvtepu8_epi32(half[i]));
        w[i] = kind == Q4_K ? _mm512_fmadd_ps(q, _mm512_set1_ps(s[j]), _mm512_set1_ps(m[j]))
                            : _mm512_mul_ps(q, _mm512_set1_ps(s[2 * j + i]));
    }
}

AI void block_rows_f32_512(const __m512 wv[2], const float *x, int K, int RT, __m512 *acc) {
    for (int r = 0; r < RT; r++)
        for (int i = 0; i < 2; i++) acc[r] = _mm512_fmadd_ps(wv[i], _mm512_loadu_ps(x + (size_t)r * K + 16 * i), acc[r]);
}

AI void tile_f32_512(int kind, int G, int RT, const uint8_t *w, size_t rowbytes, int nb, const float *x, int K, float *y,
                     int ldy) {
    __m512 acc[4][8];
    for (int g = 0; g < G; g++)
        for (int r = 0; r < RT; r++) acc[g][r] = _mm512_setzero_ps();
    const int bs = bsize(kind);
    for (int b = 0; b < nb; b++) {
        prefetch_next(G, w, rowbytes, b, bs);
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = w + g * rowbytes + (size_t)b * bs;
            __m512 wv[2];
            if (k_quant(kind)) {
                float s[16], m[8];
                if (kind == Q4_K) q4_k_scales(blk, s, m);
                else q6_k_scales(blk, s);
                for (int j = 0; j < 8; j++) {
                    k_block_f32_512(kind, blk, j, s, m, wv);
                    block_rows_f32_512(wv, x + b * 256 + 32 * j, K, RT, acc[g]);
                }
                continue;
            }
            const float d = _cvtsh_ss(*(const uint16_t *)blk);
            const float m = has_min(kind) ? _cvtsh_ss(*(const uint16_t *)(blk + 2)) : -(float)offset(kind) * d;
            block_f32_512(kind, blk, _mm512_set1_ps(d), _mm512_set1_ps(m), wv);
            block_rows_f32_512(wv, x + b * 32, K, RT, acc[g]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int r = 0; r < RT; r++) y[(size_t)r * ldy + g] = _mm512_reduce_add_ps(acc[g][r]);
}
#define tile_f32 tile_f32_512
#endif

// weight rows [0, G) (G = 4, or 1 at the end of W) against all R rows of x: 8 rows of x a tile
// as long as there are 8 (bound by the fmadds, more weight rows a tile gain nothing), then the
// rest with 4 or 2 weight rows a tile (measured)
AI void rows_f32(int kind, int G, const uint8_t *w, size_t rowbytes, int nb, const float *x, int R, int K, float *y,
                 int ldy) {
    int r0 = 0;
#define T(GT, RT) for (int g = 0; g < G; g += (G == 4 ? GT : 1)) \
        tile_f32(kind, G == 4 ? GT : 1, RT, w + g * rowbytes, rowbytes, nb, x + (size_t)r0 * K, K, \
                 y + (size_t)r0 * ldy + g, ldy)
    for (; r0 + 8 <= R; r0 += 8) T(1, 8);
    switch (R - r0) {
    case 1: T(4, 1); break;
    case 2: T(4, 2); break;
    case 3: T(4, 3); break;
    case 4: T(4, 4); break;
    case 5: T(2, 5); break;
    case 6: T(2, 6); break;
    case 7: T(2, 7); break;
    default: break;
    }
#undef T
}

// ---- the products ------------------------------------------------------------------------------

typedef struct {
    const float *x;
    int R, K;
    const uint8_t *W;
    int N;
    float *y;
} Job;

// weight rows [o, o + G) against all of x
AI void rows(int kind, int G, const Job *j, int o) {
    const int nb = j->K / per_block(kind);
    const size_t rowbytes = (size_t)nb * bsize(kind);
    const uint8_t *w = j->W + o * rowbytes;
    rows_f32(kind, G, w, rowbytes, nb, j->x, j->R, j->K, j->y + o, j->N);
}

// weight rows [4i, 4i + 4), one at a time at the end of W
AI void group(int kind, const Job *j, int i) {
    if (4 * i + 4 <= j->N) rows(kind, 4, j, 4 * i);
    else for (int o = 4 * i; o < j->N; o++) rows(kind, 1, j, o);
}

// Groups of 4 weight rows split evenly between the threads. One loop per format: OpenMP outlines
// a loop's body before inlining, and `kind` must be a constant in the inner loops.
static void run(int kind, const Job *j, int nth) {
    const int ng = (j->N + 3) / 4;
    if (kind == Q4_0) {
#pragma omp parallel for schedule(static) num_threads(nth)
        for (int i = 0; i < ng; i++) group(Q4_0, j, i);
    } else if (kind == Q4_1) {
#pragma omp parallel for schedule(static) num_threads(nth)
        for (int i = 0; i < ng; i++) group(Q4_1, j, i);
    } else if (kind == Q5_0) {
#pragma omp parallel for schedule(static) num_threads(nth)
        for (int i = 0; i < ng; i++) group(Q5_0, j, i);
    } else if (kind == Q5_1) {
#pragma omp parallel for schedule(static) num_threads(nth)
        for (int i = 0; i < ng; i++) group(Q5_1, j, i);
    } else if (kind == IQ4_NL) {
#pragma omp parallel for schedule(static) num_threads(nth)
        for (int i = 0; i < ng; i++) group(IQ4_NL, j, i);
    } else if (kind == Q4_K) {
#pragma omp parallel for schedule(static) num_threads(nth)
        for (int i = 0; i < ng; i++) group(Q4_K, j, i);
    } else if (kind == Q6_K) {
#pragma omp parallel for schedule(static) num_threads(nth)
        for (int i = 0; i < ng; i++) group(Q6_K, j, i);
    } else {
#pragma omp parallel for schedule(static) num_threads(nth)
        for (int i = 0; i < ng; i++) group(Q8_0, j, i);
    }
}

static void gemm_f32(int kind, const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) {
    const Job j = {x, R, K, W, N, y};
    run(kind, &j, nth);
}

void q4_0_f32(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_f32(Q4_0, x, R, K, W, N, y, nth); }
void q4_1_f32(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_f32(Q4_1, x, R, K, W, N, y, nth); }
void q8_0_f32(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_f32(Q8_0, x, R, K, W, N, y, nth); }
void q5_0_f32(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_f32(Q5_0, x, R, K, W, N, y, nth); }
void q5_1_f32(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_f32(Q5_1, x, R, K, W, N, y, nth); }
void iq4_nl_f32(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_f32(IQ4_NL, x, R, K, W, N, y, nth); }
void q4_k_f32(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_f32(Q4_K, x, R, K, W, N, y, nth); }
void q6_k_f32(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_f32(Q6_K, x, R, K, W, N, y, nth); }

// ---- int8 activations --------------------------------------------------------------------------
//
// The same products with each row of x rounded first to int8 a block of 32, as llama.cpp's
// quantize_row_q8_0 rounds it: d = max|x| / 127, q = x * (1/d) rounded to the nearest (ties to
// even, as vroundps does: NumPy's rint in models/int8_activations.py gives the same bytes), and
// for the formats with a minimum also s = d * sum(q) (llama.cpp's Q8_1). d and s stay float32
// (llama.cpp stores them as f16: they are transient here). A block's sum of products is then an
// exact int32 (vpmaddubsw: unsigned weights times signed activations, pairs summed in int16,
// which no format here can overflow: at most 2 x 128 x 127), scaled once by dw * dx:
// y = sum_b dw dx sum_i qw qx (+ mw s for Q4_1, Q5_1; - offset dw s for Q4_0, Q5_0).

typedef struct {
    const int8_t *q;  // (R, K)
    const float *d, *s;  // (R, K/32) each; for a K-quant d is (R, K/256) and s unused
    const int32_t *sums;  // a K-quant's: each 32 values' sum of q, (R, K/32)
} Rows8;

// 32 rounded values (n: 4 x 8 int32, in element order) stored as bytes at q; their sum
AI int32_t store_codes(const __m256i n[4], int8_t *q) {
    // packs interleave the lanes: a final dword permutation puts the 32 bytes in order
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    t = _mm_hadd_epi32(t, t);
    t = _mm_hadd_epi32(t, t);
    return _mm_cvtsi128_si32(t);
}

// one row of x as int8 blocks
static void quantize_row(const float *x, int K, int8_t *q, float *d, float *s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < K / 32; b++) {
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + 32 * b + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float db = _mm_cvtss_f32(m) / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        __m256i n[4];
        for (int i = 0; i < 4; i++)
            n[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(id)),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        d[b] = db;
        s[b] = db * (float)store_codes(n, q + 32 * b);
    }
}

// One row of x as llama.cpp's quantize_row_q8_K rounds it for the K-quants, a block of 256: the
// value of largest |x| (the first, if several) is m, iscale = -127 / m, q = iscale * x to the
// nearest (ties to even) at most 127, d = 1 / iscale. With each 32 values' sum of q (Q4_K's
// minimums take it).
static void quantize_row_k(const float *x, int K, int8_t *q, float *d, int32_t *sums) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < K / 256; b++) {
        const float *v = x + 256 * b;
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 32; i++) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8 * i)));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float top = _mm_cvtss_f32(m);
        if (top == 0.0f) {
            d[b] = 0.0f;
            memset(q + 256 * b, 0, 256);
            for (int j = 0; j < 8; j++) sums[8 * b + j] = 0;
            continue;
        }
        int at = 0;
        while (__builtin_fabsf(v[at]) != top) at++;
        const float iscale = -127.0f / v[at];
        for (int j = 0; j < 8; j++) {
            __m256i n[4];
            for (int i = 0; i < 4; i++)
                n[i] = _mm256_min_epi32(
                    _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_set1_ps(iscale), _mm256_loadu_ps(v + 32 * j + 8 * i)),
                                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)),
                    _mm256_set1_epi32(127));
            sums[8 * b + j] = store_codes(n, q + 256 * b + 32 * j);
        }
        d[b] = 1.0f / iscale;
    }
}

// Q4_0's and Q5_0's w = d (q - offset) is taken as Q4_1's w = d q + m, m = -offset d: their
// unsigned q then multiply x in one vpmaddubsw, without the two sign flips a signed one needs.
AI int unsigned_q(int kind) { return kind != Q8_0 && kind != IQ4_NL; }

// one weight block's 32 integers as bytes, in element order: unsigned 0-15 or 0-31 (unsigned_q),
// else signed (Q8_0's as stored, IQ4_NL's table entries)
AI __m256i block_i8(int kind, const uint8_t *blk) {
    if (kind == Q8_0) return _mm256_loadu_si256((const __m256i *)(blk + 2));
    const __m128i b = _mm_loadu_si128((const __m128i *)(blk + nibbles_at(kind)));
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1);
    __m256i q = _mm256_and_si256(both, _mm256_set1_epi8(15));  // low nibbles 0-15, high 16-31
    if (kind == IQ4_NL) {
        const __m256i table = _mm256_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
                                               -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
        return _mm256_shuffle_epi8(table, q);
    }
    if (kind == Q5_0 || kind == Q5_1) {  // bit i of qh is element i's fifth bit: byte i gets qh's byte i/8
        int32_t qh;
        memcpy(&qh, blk + (kind == Q5_0 ? 2 : 4), 4);
        const __m256i spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(qh), _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                    2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
        const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
    }
    return q;
}

// a block's 8 partial sums of qw * qx as int32; `aw` is |w| for a signed w (unused otherwise)
AI __m256i dot_i8(int kind, __m256i w, __m256i aw, __m256i x) {
    const __m256i pairs = unsigned_q(kind) ? _mm256_maddubs_epi16(w, x) : _mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// A K-quant's tile with int8 rows (quantize_row_k): per block of 256, one exact int32 sum per
// lane of the sub-blocks' scale times their integer dot products (Q4_K: scale 0-63 times nibble
// times x, at most 8 x 2 x 63 x 15 x 127 a lane; Q6_K: signed scales a 16, |q - 32| <= 32),
// then dw dx times it into a float accumulator; Q4_K's minimums as the integer sum of m_j times
// x's sums of 32, times -dmin dx. Each output's order is the same in any tile.
AI void tile_k_i8(int kind, int G, int RT, const uint8_t *w, size_t rowbytes, int nb, Rows8 x, int K, float *y, int ldy) {
    __m256 acc[4][4];
    float mins[4][4];
    for (int g = 0; g < G; g++)
        for (int r = 0; r < RT; r++) acc[g][r] = _mm256_setzero_ps(), mins[g][r] = 0.0f;
    const int bs = bsize(kind);
    for (int b = 0; b < nb; b++) {
        prefetch_next(G, w, rowbytes, b, bs);
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = w + g * rowbytes + (size_t)b * bs;
            uint8_t sc[8], mn[8];
            int8_t sc6[16];
            float dw, dmin = 0.0f;
            if (kind == Q4_K) {
                uint64_t s64, m64;
                q4_k_scale_bytes(blk, &s64, &m64);
                memcpy(sc, &s64, 8);
                memcpy(mn, &m64, 8);
                dw = _cvtsh_ss(*(const uint16_t *)blk);
                dmin = _cvtsh_ss(*(const uint16_t *)(blk + 2));
            } else {
                memcpy(sc6, blk + 192, 16);
                dw = _cvtsh_ss(*(const uint16_t *)(blk + 208));
            }
            __m256i isum[4];
            int msum[4] = {0, 0, 0, 0};
            for (int r = 0; r < RT; r++) isum[r] = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                const __m256i wq = k_codes(kind, blk, j);
                const __m256i scale = kind == Q4_K
                    ? _mm256_set1_epi16(sc[j])
                    : _mm256_setr_m128i(_mm_set1_epi16(sc6[2 * j]), _mm_set1_epi16(sc6[2 * j + 1]));
                const __m256i aw = kind == Q4_K ? wq : _mm256_sign_epi8(wq, wq);
                for (int r = 0; r < RT; r++) {
                    const __m256i xq = _mm256_loadu_si256((const __m256i *)(x.q + (size_t)r * K + 256 * b + 32 * j));
                    const __m256i pairs = kind == Q4_K ? _mm256_maddubs_epi16(wq, xq) : _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xq, wq));
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(pairs, scale));
                    if (kind == Q4_K) msum[r] += mn[j] * x.sums[(size_t)r * (K / 32) + 8 * b + j];
                }
            }
            for (int r = 0; r < RT; r++) {
                const float dx = x.d[(size_t)r * nb + b];
                acc[g][r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx), _mm256_cvtepi32_ps(isum[r]), acc[g][r]);
                if (kind == Q4_K) mins[g][r] = __builtin_fmaf(-dmin * dx, (float)msum[r], mins[g][r]);
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int r = 0; r < RT; r++) y[(size_t)r * ldy + g] = hsum(acc[g][r]) + mins[g][r];
}

// G weight rows x RT rows of x, as tile_f32: each accumulator sums its blocks in order, so the
// result does not depend on the tiling
AI void tile_i8(int kind, int G, int RT, const uint8_t *w, size_t rowbytes, int nb, Rows8 x, int K, float *y, int ldy) {
    if (k_quant(kind)) {
        tile_k_i8(kind, G, RT, w, rowbytes, nb, x, K, y, ldy);
        return;
    }
    __m256 acc[4][4], mins[4];  // lane g of mins[r]: the sum of m s of weight row g, x row r
    for (int r = 0; r < RT; r++) {
        mins[r] = _mm256_setzero_ps();
        for (int g = 0; g < G; g++) acc[g][r] = _mm256_setzero_ps();
    }
    const int bs = bsize(kind);
    for (int b = 0; b < nb; b++) {
        prefetch_next(G, w, rowbytes, b, bs);
        const uint8_t *blk[4];
        for (int g = 0; g < G; g++) blk[g] = w + g * rowbytes + (size_t)b * bs;
        const __m256 dm = heads(kind, G, blk);
        const __m256 dd = _mm256_insertf128_ps(dm, _mm256_castps256_ps128(dm), 1);
        const __m256 m = has_min(kind) ? _mm256_permute2f128_ps(dm, dm, 0x11)  // minima, or -offset d
                                       : _mm256_mul_ps(dm, _mm256_set1_ps(-(float)offset(kind)));
        if (unsigned_q(kind))
            for (int r = 0; r < RT; r++) mins[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.s[(size_t)r * nb + b]), mins[r]);
        for (int g = 0; g < G; g++) {
            const __m256i wq = block_i8(kind, blk[g]);
            const __m256i aw = unsigned_q(kind) ? wq : _mm256_sign_epi8(wq, wq);
            for (int r = 0; r < RT; r++) {
                const size_t at = (size_t)r * nb + b;
                const __m256i xq = _mm256_loadu_si256((const __m256i *)(x.q + (size_t)r * K + 32 * b));
                const __m256 scale = _mm256_mul_ps(lane(dd, g), _mm256_set1_ps(x.d[at]));
                acc[g][r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot_i8(kind, wq, aw, xq)), acc[g][r]);
            }
        }
    }
    for (int r = 0; r < RT; r++) {
        float m[8];
        _mm256_storeu_ps(m, mins[r]);
        for (int g = 0; g < G; g++) y[(size_t)r * ldy + g] = hsum(acc[g][r]) + m[g];
    }
}

// weight rows [0, G) against all R rows of x: 4 rows of x a tile (2 weight rows), the rest
// with 4 weight rows a tile for one row of x, 2 for 2 or 3
AI void rows_i8(int kind, int G, const uint8_t *w, size_t rowbytes, int nb, Rows8 x, int R, int K, float *y, int ldy) {
    int r0 = 0;
#define T(GT, RT) for (int g = 0; g < G; g += (G == 4 ? GT : 1)) {                                     \
        const Rows8 at = {x.q + (size_t)r0 * K, x.d + (size_t)r0 * nb, x.s + (size_t)r0 * nb,          \
                          x.sums + (size_t)r0 * (K / 32)};                                             \
        tile_i8(kind, G == 4 ? GT : 1, RT, w + g * rowbytes, rowbytes, nb, at, K, y + (size_t)r0 * ldy + g, ldy); }
    for (; r0 + 4 <= R; r0 += 4) T(2, 4);
    switch (R - r0) {
    case 1: T(4, 1); break;
    case 2: T(2, 2); break;
    case 3: T(2, 3); break;
    default: break;
    }
#undef T
}

typedef struct {
    Rows8 x;
    int R, K;
    const uint8_t *W;
    int N;
    float *y;
} Job8;

AI void group_i8(int kind, const Job8 *j, int i) {
    const int nb = j->K / per_block(kind);
    const size_t rowbytes = (size_t)nb * bsize(kind);
    const int G = 4 * i + 4 <= j->N ? 4 : 1;
    for (int o = 4 * i; o < 4 * i + 4 && o < j->N; o += G)
        rows_i8(kind, G, j->W + o * rowbytes, rowbytes, nb, j->x, j->R, j->K, j->y + o, j->N);
}

static void run_i8(int kind, const Job8 *j, int nth) {
    const int ng = (j->N + 3) / 4;
    if (kind == Q4_0) {
#pragma omp parallel for schedule(static) num_threads(nth)
        for (int i = 0; i < ng; i++) group_i8(Q4_0, j, i);
    } else if (kind == Q4_1) {
#pragma omp parallel for schedule(static) num_threads(nth)
        for (int i = 0; i < ng; i++) group_i8(Q4_1, j, i);
    } else if (kind == Q5_0) {
#pragma omp parallel for schedule(static) num_threads(nth)
        for (int i = 0; i < ng; i++) group_i8(Q5_0, j, i);
    } else if (kind == Q5_1) {
#pragma omp parallel for schedule(static) num_threads(nth)
        for (int i = 0; i < ng; i++) group_i8(Q5_1, j, i);
    } else if (kind == IQ4_NL) {
#pragma omp parallel for schedule(static) num_threads(nth)
        for (int i = 0; i < ng; i++) group_i8(IQ4_NL, j, i);
    } else if (kind == Q4_K) {
#pragma omp parallel for schedule(static) num_threads(nth)
        for (int i = 0; i < ng; i++) group_i8(Q4_K, j, i);
    } else if (kind == Q6_K) {
#pragma omp parallel for schedule(static) num_threads(nth)
        for (int i = 0; i < ng; i++) group_i8(Q6_K, j, i);
    } else {
#pragma omp parallel for schedule(static) num_threads(nth)
        for (int i = 0; i < ng; i++) group_i8(Q8_0, j, i);
    }
}

// A decode step's few rows fit on the stack; a prompt's are allocated.
enum { STACK_VALUES = 16384 };

static void gemm_i8(int kind, const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) {
    const int nb = K / per_block(kind), ns = K / 32;
    const size_t n = (size_t)R * K;
    // q (R, K), then d and s (R, nb) each, then a K-quant's sums (R, K/32): at most 2 floats and
    // an int32 a 32 values
    int8_t stack_q[STACK_VALUES + 3 * 4 * (STACK_VALUES / 32)] __attribute__((aligned(32)));
    int8_t *q = n <= STACK_VALUES ? stack_q : malloc(n + 3 * 4 * (n / 32));
    if (q == NULL) return;  // (the check holds y's garbage against the product: rejected)
    float *d = (float *)(q + n), *s = d + (size_t)R * nb;
    int32_t *sums = (int32_t *)(s + (size_t)R * nb);
    for (int r = 0; r < R; r++) {
        if (k_quant(kind))
            quantize_row_k(x + (size_t)r * K, K, q + (size_t)r * K, d + (size_t)r * nb, sums + (size_t)r * ns);
        else
            quantize_row(x + (size_t)r * K, K, q + (size_t)r * K, d + (size_t)r * nb, s + (size_t)r * nb);
    }
    const Job8 j = {{q, d, s, sums}, R, K, W, N, y};
    run_i8(kind, &j, nth);
    if (q != stack_q) free(q);
}

void q4_0_q8(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_i8(Q4_0, x, R, K, W, N, y, nth); }
void q4_1_q8(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_i8(Q4_1, x, R, K, W, N, y, nth); }
void q8_0_q8(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_i8(Q8_0, x, R, K, W, N, y, nth); }
void q5_0_q8(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_i8(Q5_0, x, R, K, W, N, y, nth); }
void q5_1_q8(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_i8(Q5_1, x, R, K, W, N, y, nth); }
void iq4_nl_q8(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_i8(IQ4_NL, x, R, K, W, N, y, nth); }
void q4_k_q8(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_i8(Q4_K, x, R, K, W, N, y, nth); }
void q6_k_q8(const float *x, int R, int K, const uint8_t *W, int N, float *y, int nth) { gemm_i8(Q6_K, x, R, K, W, N, y, nth); }
// The quantized rows themselves, for the tests' reference: q (R, K), d and s (R, K/32)
void quantize_rows_q8(const float *x, int R, int K, int8_t *q, float *d, float *s) {
    for (int r = 0; r < R; r++) quantize_row(x + (size_t)r * K, K, q + (size_t)r * K, d + (size_t)r * (K / 32), s + (size_t)r * (K / 32));
}
// The same for the K-quants' rounding: q (R, K), d (R, K/256), sums (R, K/32)
void quantize_rows_q8k(const float *x, int R, int K, int8_t *q, float *d, int32_t *sums) {
    for (int r = 0; r < R; r++)
        quantize_row_k(x + (size_t)r * K, K, q + (size_t)r * K, d + (size_t)r * (K / 256), sums + (size_t)r * (K / 32));
}

// Rows x as the products above round them, as floats: out = d q, each value's block rounded as
// `per_block` (32, or 256 for the K-quants) says. For "c-int8-blas" (models/native.py): a
// prompt's many rows multiplied by BLAS at its float speed, with int8 activations' values.
void rounded_rows_q8(const float *x, int R, int K, int per_block, float *out, int nth) {
#pragma omp parallel for schedule(static) num_threads(nth)
    for (int r = 0; r < R; r++) {
        int8_t q[STACK_VALUES];
        float d[STACK_VALUES / 32], s[STACK_VALUES / 32];
        int32_t sums[STACK_VALUES / 32];
        for (int at = 0; at < K; at += STACK_VALUES) {  // a row longer than the stack, in parts
            const int n = K - at < STACK_VALUES ? K - at : STACK_VALUES;
            if (per_block == 256) quantize_row_k(x + (size_t)r * K + at, n, q, d, sums);
            else quantize_row(x + (size_t)r * K + at, n, q, d, s);
            float *o = out + (size_t)r * K + at;
            for (int i = 0; i < n; i++) o[i] = d[i / per_block] * (float)q[i];
        }
    }
}

