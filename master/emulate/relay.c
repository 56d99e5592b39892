/* A TCP relay that delays every byte by a fixed time in each direction: an emulated link's
 * latency, added outside the project's transport (this kernel has no netem).
 *
 *   relay DELAY_US LISTEN_IP TARGET_IP PORT [PORT...]
 *
 * listens on LISTEN_IP:PORT for each PORT and forwards every connection to TARGET_IP:PORT. Bytes
 * read at time t are written at t + DELAY_US, in order, on one thread: an epoll loop woken by a
 * timerfd (nanosecond deadlines; epoll's own timeout counts milliseconds). It prints "ready" once
 * listening, and exits when its standard input closes, so it never outlives the process that
 * started it, even one that was killed.
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
static int epfd, timerfd_;
static struct conn conns[MAX_CONNS];
static struct sockaddr_in target;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
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

static void enqueue(struct flow *f, const char *data, size_t len, int eof) {
    struct chunk *k = malloc(sizeof(struct chunk) + len);
    if (!k) {
        perror("relay: malloc");
        exit(1);
    }
    k->next = NULL;
    k->due = now_ns() + delay_ns;
    k->len = len;
    k->off = 0;
    k->eof = eof;
    if (len) memcpy(k->data, data, len);
    if (f->tail) f->tail->next = k; else f->head = k;
    f->tail = k;
}

/* Reads all that is there; returns -1 when the connection is broken. */
static int drain(struct conn *c, int side) {
    static char buf[READ_BYTES];
    struct flow *f = &c->flows[side];
    for (;;) {
        ssize_t n = read(f->from, buf, sizeof(buf));
        if (n > 0) {
            enqueue(f, buf, (size_t)n, 0);
        } else if (n == 0) {
            if (!f->eof_sent) enqueue(f, NULL, 0, 1);
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
    while (f->head && f->head->due <= now) {
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
                    return 0;   /* EPOLLOUT (or the connect finishing) brings us back */
                } else {
                    return -1;
                }
            }
        }
        f->head = k->next;
        if (!f->head) f->tail = NULL;
        free(k);
    }
    return 0;
}

static void arm_timer(void) {
    uint64_t next = UINT64_MAX;
    for (int i = 0; i < MAX_CONNS; i++) {
        if (!conns[i].used) continue;
        for (int s = 0; s < 2; s++) {
            struct chunk *k = conns[i].flows[s].head;
            if (k && k->due < next) next = k->due;
        }
    }
    struct itimerspec at = {0};
    if (next != UINT64_MAX) {
        at.it_value.tv_sec = (time_t)(next / 1000000000u);
        at.it_value.tv_nsec = (long)(next % 1000000000u);
        if (at.it_value.tv_sec == 0 && at.it_value.tv_nsec == 0) at.it_value.tv_nsec = 1;
    }
    timerfd_settime(timerfd_, TFD_TIMER_ABSTIME, &at, NULL);
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
                uint64_t expirations;
                (void)!read(timerfd_, &expirations, sizeof(expirations));
            } else if (h->kind == LISTENER) {
                accept_one(h);
            } else if (h->conn && h->conn->used && drain(h->conn, h->side) != 0) {
                close_conn(h->conn);
            }
        }
        uint64_t now = now_ns();
        for (int i = 0; i < MAX_CONNS; i++) {
            struct conn *c = &conns[i];
            if (!c->used) continue;
            if (flush(&c->flows[0], now) != 0 || flush(&c->flows[1], now) != 0 ||
                (c->flows[0].eof_sent && c->flows[1].eof_sent && !c->flows[0].head &&
                 !c->flows[1].head)) {
                close_conn(c);
            }
        }
        arm_timer();
    }
}
