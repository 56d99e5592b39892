// The per-sum path of a decode step with no Python in it: a worker's receive, block and send, and
// the master's send, own block, gather and sum, on the same ZeroMQ sockets Python holds (libzmq's
// own calls on pyzmq's socket; the function pointers come from the libzmq pyzmq loaded).
//
// Between two messages Python runs cold: a STEP decoded and checked, a partial encoded and sent,
// cost a worker ~110 us of CPU a sum and the master more, 60 sums a token (git log -p docs/decisions.md).
// Here only the messages this path expects are taken: a STEP without a batch (a decode step's
// blocks after its first) on a worker, a PARTIAL for the block in hand on the master, both in
// exactly the msgpack the Python side writes. Any other message is held and handed back to
// Python (HOP_FOREIGN), which decodes it as it always has; so is a receive that times out
// (HOP_TIMEOUT: Python checks heartbeats and deadlines, then calls again).
#include <errno.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef struct {
    unsigned char _[64] __attribute__((aligned(sizeof(void *))));
} zmq_msg_t;
typedef struct {
    void *socket;
    int fd;
    short events, revents;
} zmq_pollitem_t;

#define ZMQ_DONTWAIT 1
#define ZMQ_SNDMORE 2
#define ZMQ_POLLIN 1

static int (*msg_init)(zmq_msg_t *);
static int (*msg_recv)(zmq_msg_t *, void *, int);
static void *(*msg_data)(zmq_msg_t *);
static size_t (*msg_size)(const zmq_msg_t *);
static int (*msg_more)(const zmq_msg_t *);
static int (*msg_close)(zmq_msg_t *);
static int (*zsend)(void *, const void *, size_t, int);
static int (*zpoll)(zmq_pollitem_t *, int, long);
static const char *(*msg_gets)(const zmq_msg_t *, const char *);

void hop_init(void *init, void *recv, void *data, void *size, void *more, void *close,
              void *send, void *poll, void *gets) {
    msg_init = init;
    msg_recv = recv;
    msg_data = data;
    msg_size = size;
    msg_more = more;
    msg_close = close;
    zsend = send;
    zpoll = poll;
    msg_gets = gets;
}

// A signal for Python (Ctrl-C) interrupts a send: send again, and let Python see the signal
// when this call returns, rather than take it for a peer that is gone.
static int send_frame(void *sock, const void *buf, size_t n, int flags) {
    int rc;
    do rc = zsend(sock, buf, n, flags);
    while (rc < 0 && errno == EINTR);
    return rc;
}

enum { HOP_DONE = 0, HOP_TIMEOUT = 1, HOP_FOREIGN = 2, HOP_SEND_FAILED = 3, HOP_ERROR = 4 };
#define HELD 8

typedef void (*block_fn)(const void *args, int ffn, const void *step, const float *h, float *out);
// models/csrc/rows.c's rows_to_half and rows_from_half: a sum's message as float16 and back
typedef void (*to_half_fn)(const float *x, uint16_t *h, int64_t n);
typedef void (*from_half_fn)(const uint16_t *h, float *x, int64_t n);

// Whether a float16 message can carry x: every value within its range (a NaN cannot), the rule of
// node/messages.py's for_the_wire; else the message goes as float32.
static int fits_half(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!(x[i] <= 65504.0f && x[i] >= -65504.0f)) return 0;
    return 1;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

// -- msgpack, as much as the two headers need ------------------------------------------------------

typedef struct {
    uint8_t *p, *end;
} writer;

static void put(writer *w, const void *b, size_t n) {
    if (w->p + n <= w->end) memcpy(w->p, b, n);
    w->p += n;
}
static void put_byte(writer *w, uint8_t b) { put(w, &b, 1); }
static void put_str(writer *w, const char *s) {
    size_t n = strlen(s); // every string here is under 32 bytes: a fixstr
    put_byte(w, 0xa0 | (uint8_t)n);
    put(w, s, n);
}
// The shortest form, as every msgpack encoder writes it (node/messages.py's among them).
static void put_uint(writer *w, uint64_t v) {
    if (v < 128) {
        put_byte(w, (uint8_t)v);
        return;
    }
    int n = v <= 0xff ? 1 : v <= 0xffff ? 2 : v <= 0xffffffffu ? 4 : 8;
    uint8_t b[9] = {n == 1 ? 0xcc : n == 2 ? 0xcd : n == 4 ? 0xce : 0xcf};
    for (int i = 0; i < n; i++) b[1 + i] = (uint8_t)(v >> (8 * (n - 1 - i)));
    put(w, b, (size_t)n + 1);
}
static void put_double(writer *w, double d) {
    uint64_t v;
    memcpy(&v, &d, 8);
    uint8_t b[9] = {0xcb};
    for (int i = 0; i < 8; i++) b[1 + i] = (uint8_t)(v >> (56 - 8 * i));
    put(w, b, 9);
}
// {op, step, layer, block[, compute], tensors: [[dtype, [B, D]]]}, as node/messages.py writes;
// dtype "float16" where `half`, else "float32"
size_t hop_header(uint8_t *buf, size_t cap, const char *op, int64_t step, int64_t layer,
                     int ffn, const double *compute, int64_t B, int64_t D, int half) {
    writer w = {buf, buf + cap};
    put_byte(&w, 0x80 | (compute ? 6 : 5));
    put_str(&w, "op"), put_str(&w, op);
    put_str(&w, "step"), put_uint(&w, (uint64_t)step);
    put_str(&w, "layer"), put_uint(&w, (uint64_t)layer);
    put_str(&w, "block"), put_str(&w, ffn ? "ffn" : "attn");
    if (compute) put_str(&w, "compute"), put_double(&w, *compute);
    put_str(&w, "tensors");
    put_byte(&w, 0x91), put_byte(&w, 0x92), put_str(&w, half ? "float16" : "float32");
    put_byte(&w, 0x92), put_uint(&w, (uint64_t)B), put_uint(&w, (uint64_t)D);
    return (size_t)(w.p - buf);
}

typedef struct {
    const uint8_t *p, *end;
    int bad;
} reader;

static uint8_t take(reader *r) {
    if (r->p >= r->end) {
        r->bad = 1;
        return 0;
    }
    return *r->p++;
}
static uint64_t take_be(reader *r, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = v << 8 | take(r);
    return v;
}
static int64_t take_uint(reader *r) {
    uint8_t b = take(r);
    if (b < 0x80) return b;
    if (b == 0xcc) return (int64_t)take_be(r, 1);
    if (b == 0xcd) return (int64_t)take_be(r, 2);
    if (b == 0xce) return (int64_t)take_be(r, 4);
    if (b == 0xcf) return (int64_t)take_be(r, 8);
    r->bad = 1;
    return -1;
}
static double take_number(reader *r) {
    uint8_t b = *r->p;
    if (b == 0xcb) {
        take(r);
        uint64_t v = take_be(r, 8);
        double d;
        memcpy(&d, &v, 8);
        return d;
    }
    return (double)take_uint(r);
}
// A string's bytes and length (fixstr or str8); NULL when it is not one.
static const uint8_t *take_str(reader *r, size_t *n) {
    uint8_t b = take(r);
    if ((b & 0xe0) == 0xa0) {
        *n = b & 0x1f;
    } else if (b == 0xd9) {
        *n = take(r);
    } else {
        r->bad = 1;
        return NULL;
    }
    const uint8_t *s = r->p;
    if (r->end - r->p < (ptrdiff_t)*n) {
        r->bad = 1;
        return NULL;
    }
    r->p += *n;
    return s;
}
static int is(const uint8_t *s, size_t n, const char *want) {
    return s && n == strlen(want) && memcmp(s, want, n) == 0;
}

typedef struct {
    int64_t step, layer, B, D;
    int ffn, half; // half: its tensor is float16
    double compute;
} parsed;

// A header this path takes: exactly the keys `hop_header` writes, op `op`. 1 if so.
int hop_parse(const uint8_t *buf, size_t size, const char *op, int with_compute, parsed *out) {
    reader r = {buf, buf + size, 0};
    uint8_t m = take(&r);
    int keys = (m & 0xf0) == 0x80 ? m & 0x0f : -1;
    if (keys != (with_compute ? 6 : 5)) return 0;
    int seen = 0;
    for (int k = 0; k < keys && !r.bad; k++) {
        size_t n = 0, vn = 0;
        const uint8_t *key = take_str(&r, &n), *v;
        if (is(key, n, "op")) {
            v = take_str(&r, &vn);
            if (!is(v, vn, op)) return 0;
            seen |= 1;
        } else if (is(key, n, "step")) {
            out->step = take_uint(&r), seen |= 2;
        } else if (is(key, n, "layer")) {
            out->layer = take_uint(&r), seen |= 4;
        } else if (is(key, n, "block")) {
            v = take_str(&r, &vn);
            if (is(v, vn, "attn")) out->ffn = 0;
            else if (is(v, vn, "ffn")) out->ffn = 1;
            else return 0;
            seen |= 8;
        } else if (with_compute && is(key, n, "compute")) {
            out->compute = take_number(&r), seen |= 16;
        } else if (is(key, n, "tensors")) {
            if (take(&r) != 0x91 || take(&r) != 0x92) return 0;
            v = take_str(&r, &vn);
            out->half = is(v, vn, "float16");
            if (!(out->half || is(v, vn, "float32")) || take(&r) != 0x92) return 0;
            out->B = take_uint(&r), out->D = take_uint(&r), seen |= 32;
        } else {
            return 0;
        }
    }
    return !r.bad && r.p == r.end && seen == (with_compute ? 63 : 47);
}

// -- receiving -------------------------------------------------------------------------------------

typedef struct {
    zmq_msg_t frames[HELD];
    int64_t n;       // frames held
    int64_t dropped; // frames past HELD (a message this protocol never sends)
} held;

static void release(held *m) {
    for (int64_t i = 0; i < m->n; i++) msg_close(&m->frames[i]);
    m->n = m->dropped = 0;
}

// 1: a whole message is held; 0: none within timeout_ms; -1: an error (errno).
static int receive(void *sock, long timeout_ms, held *m) {
    release(m);
    zmq_pollitem_t item = {sock, 0, ZMQ_POLLIN, 0};
    int ready = zpoll(&item, 1, timeout_ms);
    if (ready <= 0) return ready < 0 && errno != EINTR ? -1 : 0;
    for (;;) {
        zmq_msg_t *f = &m->frames[m->n < HELD ? m->n : HELD - 1];
        if (m->n >= HELD) { // keep the first HELD frames, count the rest
            zmq_msg_t extra;
            msg_init(&extra);
            if (msg_recv(&extra, sock, ZMQ_DONTWAIT) < 0) return -1;
            m->dropped++;
            int more = msg_more(&extra);
            msg_close(&extra);
            if (!more) return 1;
            continue;
        }
        msg_init(f);
        if (msg_recv(f, sock, ZMQ_DONTWAIT) < 0) {
            msg_close(f);
            return -1;
        }
        m->n++;
        if (!msg_more(f)) return 1;
    }
}

int64_t hop_frames(held *m) { return m->dropped ? -1 : m->n; }
int64_t hop_frame_size(held *m, int64_t i) { return (int64_t)msg_size(&m->frames[i]); }
void hop_frame_copy(held *m, int64_t i, void *to) {
    memcpy(to, msg_data(&m->frames[i]), msg_size(&m->frames[i]));
}
void hop_release(held *m) { release(m); }
// The address of the peer a held frame came from (a joining node's, for the cluster's view).
void hop_frame_peer(held *m, int64_t i, char *to, int64_t cap) {
    const char *peer = msg_gets(&m->frames[i], "Peer-Address");
    to[0] = 0;
    if (peer && cap > 0) {
        strncpy(to, peer, (size_t)cap - 1);
        to[cap - 1] = 0;
    }
}

// -- a worker ----------------------------------------------------------------------------------------

typedef struct {
    void *sock;
    block_fn block;
    void *const *args;   // (2 L): layer i's attention at 2 i, its FFN at 2 i + 1
    const void *step;    // the step's sequences (models/csrc/rows.c's rows_step)
    int64_t L, B, D;     // B: the begun step's rows; 0 before a step is begun
    float *in, *out;     // (B, D) each
    uint16_t *wire;      // (B, D): a float16 message's values
    to_half_fn to_half;
    from_half_fn from_half;
    double compute_s;    // in blocks computed here
    int64_t blocks;
    held msg;
} hop_worker;

// Serve STEPs until one comes that Python must see (HOP_FOREIGN: the step's first block, with
// its batch; the last FFN, whose partial carries the step's figures; any other op), none comes
// within timeout_ms (HOP_TIMEOUT), or the socket fails (HOP_ERROR, errno).
int hop_serve(hop_worker *w, long timeout_ms) {
    uint8_t buf[160];
    for (;;) {
        int got = receive(w->sock, timeout_ms, &w->msg);
        if (got <= 0) return got < 0 ? HOP_ERROR : HOP_TIMEOUT;
        parsed p;
        held *m = &w->msg;
        const int64_t n = w->B * w->D;
        if (!(w->B > 0 && m->n == 2 && !m->dropped &&
              hop_parse(msg_data(&m->frames[0]), msg_size(&m->frames[0]), "step", 0, &p) &&
              p.B == w->B && p.D == w->D && p.layer >= 0 && p.layer < w->L &&
              !(p.ffn && p.layer == w->L - 1) &&
              msg_size(&m->frames[1]) == (size_t)n * (p.half ? 2 : 4)))
            return HOP_FOREIGN;
        // a frame's memory need not be aligned: copied first
        if (p.half) {
            memcpy(w->wire, msg_data(&m->frames[1]), (size_t)n * 2);
            w->from_half(w->wire, w->in, n);
        } else {
            memcpy(w->in, msg_data(&m->frames[1]), (size_t)n * 4);
        }
        double start = now();
        w->block(w->args[2 * p.layer + p.ffn], p.ffn, w->step, w->in, w->out);
        double compute = now() - start;
        w->compute_s += compute;
        w->blocks++;
        // the partial goes back as the hidden state came, float16 where its values fit
        const int half = p.half && fits_half(w->out, n);
        if (half) w->to_half(w->out, w->wire, n);
        size_t head = hop_header(buf, sizeof buf, "partial", p.step, p.layer, p.ffn, &compute,
                                 w->B, w->D, half);
        if (send_frame(w->sock, buf, head, ZMQ_SNDMORE) < 0 ||
            send_frame(w->sock, half ? (const void *)w->wire : w->out, (size_t)n * (half ? 2 : 4),
                       0) < 0)
            return HOP_ERROR;
        release(m);
    }
}

// -- the master ----------------------------------------------------------------------------------------

typedef struct {
    void *sock;
    block_fn block;
    void *const *args;
    const void *step;
    int64_t L, B, D, step_no;
    int64_t n_workers;
    const uint8_t *const *ids; // each worker's identity, in the plan's order
    const int64_t *id_lens;
    const uint8_t *first;      // the step's first STEP header (it carries the batch), or NULL
    int64_t first_len;
    float *h;                  // (B, D): the residual stream, summed into in place
    float *own;                // (B, D): this process's partial
    float *partials;           // (n_workers, B, D)
    uint8_t *received;         // (n_workers)
    double *allreduce;         // (2 L): each sum's latency beyond the slowest compute
    double *hops;              // (2 L, n_workers): each partial's arrival after its STEP went,
                               // less the worker's compute: what its link and hop cost
    int64_t layer, ffn, gathering;
    double sent_at, slowest, own_compute_s;
    int64_t failed;            // the worker a send failed to
    int64_t one_core;          // this process runs on one core (node/protocol.py's on_one_core)
    int64_t attention_alone;   // the workers hold no attention: its blocks are this process's
    // each block's sum normed before the residual (Gemma 3): rows.c's rows_post_norm, by row
    // 2 layer + ffn of post_norms (2 L, D); NULL without them
    void (*post_norm)(const float *x, const float *w, int64_t B, int64_t D, float eps, float *y);
    const float *post_norms;
    float eps;
    int64_t half;              // send hidden states as float16 where they fit (MemoryOptions.wire)
    uint16_t *wire;            // (B, D): a float16 message's values
    to_half_fn to_half;
    from_half_fn from_half;
    held msg;
} hop_hub;

// Run the step's remaining blocks from (layer, ffn): HOP_DONE when every layer is summed into h;
// else the state is kept and the same call goes on after Python has dealt with what it returned.
int hop_run(hop_hub *hb, long timeout_ms) {
    uint8_t buf[160];
    const int64_t n = hb->B * hb->D;
    while (hb->layer < hb->L) {
        // A block the workers take no part in (attention_alone) is computed here and summed
        // into h as a sum of one partial: no message, and no sum counted.
        const int64_t workers = hb->attention_alone && !hb->ffn ? 0 : hb->n_workers;
        if (!hb->gathering) {
            const uint8_t *head = buf;
            size_t head_len;
            // Python wrote the first STEP's header by the same rule (for_the_wire)
            const int half = hb->half && workers && fits_half(hb->h, n);
            if (hb->layer == 0 && hb->ffn == hb->attention_alone && hb->first) {
                head = hb->first, head_len = (size_t)hb->first_len;
            } else {
                head_len = hop_header(buf, sizeof buf, "step", hb->step_no, hb->layer,
                                      (int)hb->ffn, NULL, hb->B, hb->D, half);
            }
            if (half) hb->to_half(hb->h, hb->wire, n);
            const void *values = half ? (const void *)hb->wire : hb->h;
            hb->sent_at = now();
            for (int64_t i = 0; i < workers; i++) {
                if (send_frame(hb->sock, hb->ids[i], (size_t)hb->id_lens[i], ZMQ_SNDMORE) < 0 ||
                    send_frame(hb->sock, head, head_len, ZMQ_SNDMORE) < 0 ||
                    send_frame(hb->sock, values, (size_t)n * (half ? 2 : 4), 0) < 0) {
                    hb->failed = i;
                    return HOP_SEND_FAILED;
                }
                hb->received[i] = 0;
            }
            // ZeroMQ's I/O thread, woken by these sends, writes the STEPs out; on a core it shares
            // with this thread the scheduler may leave it waiting through the whole block below,
            // and a worker's STEP then leaves late by the master's compute. The core is its first.
            if (hb->one_core && workers) sched_yield();
            double start = now();
            hb->block(hb->args[2 * hb->layer + hb->ffn], (int)hb->ffn, hb->step, hb->h, hb->own);
            hb->slowest = now() - start;
            hb->own_compute_s += hb->slowest;
            hb->gathering = 1;
        }
        for (;;) {
            int64_t waiting = 0;
            for (int64_t i = 0; i < workers; i++) waiting += !hb->received[i];
            if (!waiting) break;
            int got = receive(hb->sock, timeout_ms, &hb->msg);
            if (got <= 0) return got < 0 ? HOP_ERROR : HOP_TIMEOUT;
            held *m = &hb->msg;
            parsed p;
            int64_t who = -1;
            if (m->n == 3 && !m->dropped)
                for (int64_t i = 0; i < hb->n_workers; i++)
                    if (!hb->received[i] && msg_size(&m->frames[0]) == (size_t)hb->id_lens[i] &&
                        memcmp(msg_data(&m->frames[0]), hb->ids[i], (size_t)hb->id_lens[i]) == 0)
                        who = i;
            if (!(who >= 0 &&
                  hop_parse(msg_data(&m->frames[1]), msg_size(&m->frames[1]), "partial", 1, &p) &&
                  p.step == hb->step_no && p.layer == hb->layer && p.ffn == hb->ffn &&
                  p.B == hb->B && p.D == hb->D &&
                  msg_size(&m->frames[2]) == (size_t)n * (p.half ? 2 : 4)))
                return HOP_FOREIGN;
            if (p.half) { // the STEPs are sent (ZeroMQ copied them): wire is free
                memcpy(hb->wire, msg_data(&m->frames[2]), (size_t)n * 2);
                hb->from_half(hb->wire, hb->partials + who * n, n);
            } else {
                memcpy(hb->partials + who * n, msg_data(&m->frames[2]), (size_t)n * 4);
            }
            hb->received[who] = 1;
            hb->hops[(2 * hb->layer + hb->ffn) * hb->n_workers + who] =
                now() - hb->sent_at - p.compute;
            if (p.compute > hb->slowest) hb->slowest = p.compute;
            release(m);
        }
        // The same sum, in the same order, as the Python path: h + (own + (p0 + p1 + ...)), the
        // parenthesis normed first where the model has post-block norms.
        for (int64_t j = 0; j < n; j++) {
            float others = workers ? hb->partials[j] : 0.0f;
            for (int64_t i = 1; i < workers; i++) others += hb->partials[i * n + j];
            const float sum = workers ? hb->own[j] + others : hb->own[j];
            if (hb->post_norms) hb->own[j] = sum;
            else hb->h[j] += sum;
        }
        if (hb->post_norms) {
            hb->post_norm(hb->own, hb->post_norms + (2 * hb->layer + hb->ffn) * hb->D, hb->B, hb->D,
                          hb->eps, hb->own);
            for (int64_t j = 0; j < n; j++) hb->h[j] += hb->own[j];
        }
        hb->allreduce[2 * hb->layer + hb->ffn] = now() - hb->sent_at - hb->slowest;
        hb->gathering = 0;
        if (hb->ffn) hb->layer++;
        hb->ffn = !hb->ffn;
    }
    return HOP_DONE;
}
