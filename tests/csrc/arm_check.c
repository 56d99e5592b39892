// The block formats' products and expansions on another architecture (tests/test_arm.py builds
// this for aarch64 and runs it under qemu-user): reads "format R K N" ("format_q8" for the
// product with int8 activations) and then the blocks (N rows
// of K weights) and x (R x K float32) from standard input, writes y (R x N float32) and, where
// the build has them, the expanded weights (N x K float32).
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef void (*product_fn)(const float *, int, int, const uint8_t *, int, float *, int);
typedef void (*expand_fn)(const uint8_t *, int, int, float *, int);

#define DECLARE(name)                                                                      \
    void name##_f32(const float *, int, int, const uint8_t *, int, float *, int);          \
    void name##_expand(const uint8_t *, int, int, float *, int);

DECLARE(q4_0) DECLARE(q4_1) DECLARE(q8_0)
#ifdef PORTABLE  // models/csrc/blocks_portable.c: products only, float and int8 activations
#define PRODUCTS(name)                                                                     \
    void name##_f32(const float *, int, int, const uint8_t *, int, float *, int);          \
    void name##_q8(const float *, int, int, const uint8_t *, int, float *, int);
PRODUCTS(q4_0) PRODUCTS(q4_1) PRODUCTS(q8_0) PRODUCTS(q5_0) PRODUCTS(q5_1) PRODUCTS(iq4_nl)
#define ENTRY(name) {#name, name##_f32, NULL}, {#name "_q8", name##_q8, NULL}
static const struct { const char *name; product_fn product; expand_fn expand; } FORMATS[] = {
    ENTRY(q4_0), ENTRY(q4_1), ENTRY(q8_0), ENTRY(q5_0), ENTRY(q5_1), ENTRY(iq4_nl)};
#else  // models/csrc/expand.c
DECLARE(q5_0) DECLARE(q5_1) DECLARE(mxfp4) DECLARE(q2_k) DECLARE(q3_k) DECLARE(q4_k) DECLARE(q5_k)
DECLARE(q6_k) DECLARE(iq4_xs) DECLARE(iq4_nl)
#define ENTRY(name) {#name, name##_f32, name##_expand}
static const struct { const char *name; product_fn product; expand_fn expand; } FORMATS[] = {
    ENTRY(q4_0), ENTRY(q4_1), ENTRY(q8_0), ENTRY(q5_0), ENTRY(q5_1), ENTRY(mxfp4), ENTRY(q2_k),
    ENTRY(q3_k), ENTRY(q4_k), ENTRY(q5_k), ENTRY(q6_k), ENTRY(iq4_xs), ENTRY(iq4_nl)};
#endif

static void *read_all(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p || fread(p, 1, n, stdin) != n) {
        fprintf(stderr, "arm_check: short input\n");
        exit(2);
    }
    return p;
}

int main(void) {
    char name[16];
    int R, K, N;
    size_t wbytes;
    if (scanf("%15s %d %d %d %zu", name, &R, &K, &N, &wbytes) != 5 || getchar() != '\n') {
        fprintf(stderr, "arm_check: bad header\n");
        return 2;
    }
    for (size_t i = 0; i < sizeof FORMATS / sizeof FORMATS[0]; i++) {
        if (strcmp(FORMATS[i].name, name)) continue;
        uint8_t *w = read_all(wbytes);
        float *x = read_all(sizeof(float) * (size_t)R * K);
        float *y = malloc(sizeof(float) * (size_t)R * N);
        FORMATS[i].product(x, R, K, w, N, y, 2);
        fwrite(y, sizeof(float), (size_t)R * N, stdout);
        if (FORMATS[i].expand) {
            float *values = malloc(sizeof(float) * (size_t)N * K);
            FORMATS[i].expand(w, N, K, values, 2);
            fwrite(values, sizeof(float), (size_t)N * K, stdout);
        }
        return 0;
    }
    fprintf(stderr, "arm_check: no format %s in this build\n", name);
    return 2;
}
