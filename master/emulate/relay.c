/* A TCP relay that delays every byte by a fixed time in each direction: an emulated link's
 * latency, added outside the project's transport (this kernel has no netem).
 *
 *   relay DELAY_US LISTEN_IP TARGET_IP PORT [PORT...]
 *
 * listens on LISTEN_IP:PORT for each PORT and forwards every connection to TARGET_IP:PORT. Bytes
 * that reached it at time t are written at t + DELAY_US, in order, on one thread: an epoll loop
 * woken by a timerfd (nanosecond deadlines; epoll's own timeout counts milliseconds). It prints
 * "ready" once listening, and exits when its standard input closes, so it never outlives the
 * process that started it, even one that was killed.
 *
 * A wire is exact; a process that sleeps is not. Woken by data or by its timer, a sleeping
 * thread runs tens to hundreds of microseconds late (an idle virtual CPU first has to be
 * scheduled again), and each way of a round trip has both wake-ups: measured here, 125 us a way
 * on top of a 1 ms delay. So t is the kernel's arrival time of the bytes (SO_TIMESTAMPNS), not
 * the time the relay read them, and the timer is set early by how late it has been waking (a
 * running mean and twice its spread), the rest waited out awake.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#define MAX_CONNS 256
#define READ_BYTES 65536
/* What a flow holds before it stops reading: a link's buffer, not a reservoir. Past it the
 * sender's TCP window fills and it waits, as it would for a slow link. */
#define MAX_QUEUED (4u << 20)
#define MAX_EARLY_NS 500000u  /* the timer is never set more than this before a deadline */

enum kind { LISTENER, SOCKET, TIMER, PARENT };

struct chunk {
    struct chunk *next;
    uint64_t due;   /* ns, CLOCK_MONOTONIC */
    size_t len, off;
    int eof;        /* the sender closed its side: shut down the receiver's after the delay */
    char data[];
};

struct flow {       /* one direction of a connection */
    int from, to;
    struct chunk *head, *tail;
    int eof_sent;
    int blocked;    /* its receiver's buffer is full: wait for EPOLLOUT, not for a deadline */
    int paused;     /* it stopped reading at MAX_QUEUED: read again once it is under */
    size_t queued;  /* bytes read, not yet written */
};

struct conn;
struct handle {     /* what an epoll event points at */
    enum kind kind;
    int fd, port, side;
    struct conn *conn;
};

struct conn {
    int used;
    struct handle ends[2];     /* 0: the accepted client, 1: the connection to the target */
    struct flow flows[2];      /* 0: client -> target, 1: target -> client */
};

static uint64_t delay_ns;
static uint64_t early_ns;   /* how early to set the timer: see timer_was_late */
static uint64_t armed_for;  /* the time the timer was last set to wake at (0: unset) */
static int epfd, timerfd_;
static struct conn conns[MAX_CONNS];
static struct sockaddr_in target;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static void watch(struct handle *h, uint32_t events) {
    struct epoll_event ev = {.events = events, .data.ptr = h};
    if (epoll_ctl(epfd, EPOLL_CTL_ADD, h->fd, &ev) != 0) {
        perror("relay: epoll_ctl");
        exit(1);
    }
}

static void close_conn(struct conn *c) {
    for (int i = 0; i < 2; i++) {
        close(c->ends[i].fd);
        struct chunk *k = c->flows[i].head;
        while (k) {
            struct chunk *next = k->next;
            free(k);
            k = next;
        }
    }
    memset(c, 0, sizeof(*c));
}

/* When the bytes of the last read reached the socket, from the cmsg of SO_TIMESTAMPNS (realtime,
 * turned monotonic), or now without one; never later than now. */
static uint64_t arrival_ns(struct msghdr *msg) {
    uint64_t now = now_ns();
    for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c; c = CMSG_NXTHDR(msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_TIMESTAMPNS) continue;
        struct timespec at, real;
        memcpy(&at, CMSG_DATA(c), sizeof(at));
        clock_gettime(CLOCK_REALTIME, &real);
        uint64_t at_ns = (uint64_t)at.tv_sec * 1000000000u + (uint64_t)at.tv_nsec;
        uint64_t real_ns = (uint64_t)real.tv_sec * 1000000000u + (uint64_t)real.tv_nsec;
        uint64_t ago = real_ns > at_ns ? real_ns - at_ns : 0;
        return ago < now ? now - ago : now;
    }
    return now;
}

static void enqueue(struct flow *f, const char *data, size_t len, int eof, uint64_t at) {
    struct chunk *k = malloc(sizeof(struct chunk) + len);
    if (!k) {
        perror("relay: malloc");
        exit(1);
    }
    k->next = NULL;
    k->due = at + delay_ns;
    k->len = len;
    k->off = 0;
    k->eof = eof;
    if (len) memcpy(k->data, data, len);
    if (f->tail) f->tail->next = k; else f->head = k;
    f->tail = k;
    f->queued += len;
}

/* Reads all that is there, up to MAX_QUEUED held; returns -1 when the connection is broken. */
static int drain(struct conn *c, int side) {
    static char buf[READ_BYTES];
    static char control[CMSG_SPACE(sizeof(struct timespec))];
    struct flow *f = &c->flows[side];
    for (;;) {
        f->paused = f->queued >= MAX_QUEUED;
        if (f->paused) return 0;
        struct iovec io = {.iov_base = buf, .iov_len = sizeof(buf)};
        struct msghdr msg = {.msg_iov = &io, .msg_iovlen = 1, .msg_control = control,
                             .msg_controllen = sizeof(control)};
        ssize_t n = recvmsg(f->from, &msg, 0);
        if (n > 0) {
            enqueue(f, buf, (size_t)n, 0, arrival_ns(&msg));
        } else if (n == 0) {
            if (!f->eof_sent) enqueue(f, NULL, 0, 1, now_ns());
            f->eof_sent = 1;
            return 0;
        } else if (errno == EINTR) {
            continue;
        } else if (errno == EAGAIN) {
            return 0;
        } else {
            return -1;
        }
    }
}

/* Writes what is due; returns -1 when the connection is broken. */
static int flush(struct flow *f, uint64_t now) {
    while (!f->blocked && f->head && f->head->due <= now) {
        struct chunk *k = f->head;
        if (k->eof) {
            shutdown(f->to, SHUT_WR);
        } else {
            while (k->off < k->len) {
                ssize_t n = write(f->to, k->data + k->off, k->len - k->off);
                if (n > 0) {
                    k->off += (size_t)n;
                } else if (n < 0 && errno == EINTR) {
                    continue;
                } else if (n < 0 && (errno == EAGAIN || errno == ENOTCONN)) {
                    f->blocked = 1;  /* EPOLLOUT (or the connect finishing) brings us back */
                    return 0;
                } else {
                    return -1;
                }
            }
        }
        f->head = k->next;
        if (!f->head) f->tail = NULL;
        f->queued -= k->len;
        free(k);
    }
    return 0;
}

static uint64_t next_due(void) {
    uint64_t next = UINT64_MAX;
    for (int i = 0; i < MAX_CONNS; i++) {
        if (!conns[i].used) continue;
        for (int s = 0; s < 2; s++) {
            struct chunk *k = conns[i].flows[s].head;
            if (k && !conns[i].flows[s].blocked && k->due < next) next = k->due;
        }
    }
    return next;
}

/* Wakes the loop `early_ns` before `next` (UINT64_MAX: never). */
static void arm_timer(uint64_t next) {
    struct itimerspec at = {0};
    armed_for = 0;
    if (next != UINT64_MAX) {
        armed_for = next > early_ns ? next - early_ns : 1;
        at.it_value.tv_sec = (time_t)(armed_for / 1000000000u);
        at.it_value.tv_nsec = (long)(armed_for % 1000000000u);
    }
    timerfd_settime(timerfd_, TFD_TIMER_ABSTIME, &at, NULL);
}

/* The timer woke the loop `late` after it was set for: the next one is set earlier by how late
 * it has been, on average over the last eight or so, and twice the spread about that average,
 * so that it rarely wakes after a deadline. */
static void timer_was_late(uint64_t late) {
    static uint64_t mean, spread;
    if (late > MAX_EARLY_NS) late = MAX_EARLY_NS;
    uint64_t off = late > mean ? late - mean : mean - late;
    mean = mean - mean / 8 + late / 8;
    spread = spread - spread / 8 + off / 8;
    early_ns = mean + 2 * spread < MAX_EARLY_NS ? mean + 2 * spread : MAX_EARLY_NS;
}

static void accept_one(struct handle *listener) {
    int client = accept4(listener->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (client < 0) return;
    int slot = -1;
    for (int i = 0; i < MAX_CONNS && slot < 0; i++)
        if (!conns[i].used) slot = i;
    int onward = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct sockaddr_in to = target;
    to.sin_port = htons((uint16_t)listener->port);
    if (slot < 0 || onward < 0 ||
        (connect(onward, (struct sockaddr *)&to, sizeof(to)) != 0 && errno != EINPROGRESS)) {
        close(client);
        if (onward >= 0) close(onward);
        return;
    }
    int one = 1;
    setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(onward, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(client, SOL_SOCKET, SO_TIMESTAMPNS, &one, sizeof(one));
    setsockopt(onward, SOL_SOCKET, SO_TIMESTAMPNS, &one, sizeof(one));
    struct conn *c = &conns[slot];
    c->used = 1;
    int fds[2] = {client, onward};
    for (int s = 0; s < 2; s++) {
        c->ends[s] = (struct handle){.kind = SOCKET, .fd = fds[s], .side = s, .conn = c};
        c->flows[s] = (struct flow){.from = fds[s], .to = fds[1 - s]};
        watch(&c->ends[s], EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET);
    }
}

static int listen_on(const char *ip, int port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    struct sockaddr_in at = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, ip, &at.sin_addr) != 1 ||
        bind(fd, (struct sockaddr *)&at, sizeof(at)) != 0 || listen(fd, 64) != 0) {
        fprintf(stderr, "relay: cannot listen on %s:%d: %s\n", ip, port, strerror(errno));
        exit(1);
    }
    return fd;
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: relay DELAY_US LISTEN_IP TARGET_IP PORT [PORT...]\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    prctl(PR_SET_TIMERSLACK, 1UL);  /* wake at the deadline, not up to 50 us after it */
    /* A wire does not wait for a core: the lowest real-time priority puts the relay ahead of
     * the nodes' processes. It sleeps between deadlines, so it takes them almost nothing.
     * Without the right (another cgroup's real-time budget) it runs as it is. */
    struct sched_param rt = {.sched_priority = 1};
    (void)sched_setscheduler(0, SCHED_FIFO, &rt);
    delay_ns = (uint64_t)strtoull(argv[1], NULL, 10) * 1000u;
    target = (struct sockaddr_in){.sin_family = AF_INET};
    if (inet_pton(AF_INET, argv[3], &target.sin_addr) != 1) {
        fprintf(stderr, "relay: bad target address %s\n", argv[3]);
        return 2;
    }
    epfd = epoll_create1(EPOLL_CLOEXEC);
    timerfd_ = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    static struct handle timer = {.kind = TIMER}, parent = {.kind = PARENT, .fd = 0};
    timer.fd = timerfd_;
    watch(&timer, EPOLLIN);
    watch(&parent, EPOLLIN);
    int nports = argc - 4;
    struct handle *listeners = calloc((size_t)nports, sizeof(struct handle));
    for (int i = 0; i < nports; i++) {
        int port = atoi(argv[4 + i]);
        listeners[i] = (struct handle){.kind = LISTENER, .fd = listen_on(argv[2], port),
                                       .port = port};
        watch(&listeners[i], EPOLLIN);
    }
    printf("ready\n");
    fflush(stdout);
    struct epoll_event events[64];
    for (;;) {
        int n = epoll_wait(epfd, events, 64, -1);
        if (n < 0 && errno == EINTR) continue;
        for (int i = 0; i < n; i++) {
            struct handle *h = events[i].data.ptr;
            if (h->kind == PARENT) {
                char b[64];
                if (read(0, b, sizeof(b)) <= 0) return 0;
            } else if (h->kind == TIMER) {
                uint64_t expirations, now = now_ns();
                (void)!read(timerfd_, &expirations, sizeof(expirations));
                if (armed_for && now > armed_for) timer_was_late(now - armed_for);
            } else if (h->kind == LISTENER) {
                accept_one(h);
            } else if (h->conn && h->conn->used) {
                if (events[i].events & EPOLLOUT)  /* room again for what flows to this end */
                    h->conn->flows[1 - h->side].blocked = 0;
                if (drain(h->conn, h->side) != 0) close_conn(h->conn);
            }
        }
        uint64_t next;
        for (;;) {
            uint64_t now = now_ns();
            for (int i = 0; i < MAX_CONNS; i++) {
                struct conn *c = &conns[i];
                if (!c->used) continue;
                int broken = flush(&c->flows[0], now) != 0 || flush(&c->flows[1], now) != 0;
                for (int s = 0; s < 2 && !broken; s++)  /* room again: read what waits */
                    if (c->flows[s].paused && c->flows[s].queued < MAX_QUEUED)
                        broken = drain(c, s) != 0;
                if (broken || (c->flows[0].eof_sent && c->flows[1].eof_sent &&
                               !c->flows[0].head && !c->flows[1].head)) {
                    close_conn(c);
                }
            }
            next = next_due();
            /* Due sooner than a sleep would end: wait for it awake. */
            if (next == UINT64_MAX || next > now_ns() + early_ns) break;
            while (now_ns() < next) cpu_relax();
        }
        arm_timer(next);
    }
}
