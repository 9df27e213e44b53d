/*
 * fixedrate: an open-loop HTTP/1.1 load generator for loopback benchmarks.
 *
 * Sends GET requests at a fixed rate over a fixed pool of keep-alive
 * connections and measures every request's latency from its INTENDED send
 * time (t0 + i / rate), not from when it was actually written. A request that
 * could not be sent on time because every connection was busy waits in a
 * queue and the wait counts against the server: this is the coordinated-
 * omission correction wrk2 makes. The schedule is held with a timerfd at
 * nanosecond resolution, so no millisecond timer slop is added to latencies.
 *
 *   fixedrate --url http://127.0.0.1:8080/path --rate 15000 --duration 10
 *             [--warmup 2] [--connections 32] [--header 'k: v']...
 *             [--timeout 5] [--out result.json] [--samples lat.bin]
 *
 * Requests intended during the warm-up are sent but not recorded. After the
 * schedule ends it waits up to --timeout seconds for the outstanding ones.
 * Prints (and writes to --out) one JSON object: the rates, status counts,
 * errors, and latency percentiles in milliseconds, both corrected (from the
 * intended time) and raw service time (from the actual write). --samples
 * also writes every recorded latency (corrected, in nanoseconds, sorted) as
 * native int64s, so windows can be pooled into one distribution (bench.py's
 * paired latency windows).
 * "ok_latency_ms" has the same corrected percentiles over the 2xx responses
 * alone (answered in the measured window; "n" of them), so fast refusals
 * (429, 503) do not hide what admitted requests wait.
 *
 * Loopback only: the host must be a literal IPv4 address in 127.0.0.0/8.
 *
 * An https:// url is HTTP/1.1 over TLS (OpenSSL, its default protocols and
 * ciphers, no ALPN, as wrk does): each connection's handshake is done,
 * blocking, when it is opened, before the schedule needs it; the server's
 * certificate is not verified (loopback, the benchmark's own). The TLS
 * version and cipher of the first connection go into the JSON ("tls").
 *
 * Build: cc -O2 -o fixedrate fixedrate.c -lssl -lcrypto   (loadtest/bench.sh does this)
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#define MAX_CONNS 4096
#define RBUF 65536
#define MAX_HEADERS 8

enum { P_HEAD, P_BODY, P_CHUNK_SIZE, P_CHUNK_DATA, P_CHUNK_CRLF, P_TRAILER, P_UNTIL_CLOSE };

typedef struct {
    int fd;
    SSL *ssl;          /* https only */
    int busy;          /* a request is in flight */
    int64_t intended;  /* its intended send time (ns) */
    int64_t sent;      /* when it was actually written (ns) */
    int record;        /* inside the measured window */
    size_t woff;       /* bytes of the request written so far */
    /* response parser */
    char buf[RBUF];
    size_t blen;
    int state;
    int status;
    int64_t remaining; /* body or chunk bytes still to read */
    int close_after;
} conn_t;

static struct sockaddr_in addr;
static char *req;
static size_t req_len;
static conn_t *conns;
static int nconns = 32;
static int epfd, tfd;
static SSL_CTX *tls_ctx; /* NULL for http:// */

static long status_count[600];
static long errors_connect, errors_io, errors_parse, reconnects, unfinished;
static long sent_total, sent_measured, completed_measured, completed_total;
static int64_t max_send_lag;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void die(const char *msg) {
    fprintf(stderr, "fixedrate: %s\n", msg);
    exit(2);
}

static char tls_version[32], tls_cipher[64]; /* of the first connection */

/* The TLS handshake on a connected (still blocking) socket; NULL on failure. */
static SSL *tls_handshake(int fd) {
    SSL *ssl = SSL_new(tls_ctx);
    if (!ssl) return NULL;
    SSL_set_fd(ssl, fd);
    if (SSL_connect(ssl) != 1) {
        ERR_print_errors_fp(stderr);
        SSL_free(ssl);
        return NULL;
    }
    if (!tls_version[0]) {
        snprintf(tls_version, sizeof tls_version, "%s", SSL_get_version(ssl));
        snprintf(tls_cipher, sizeof tls_cipher, "%s", SSL_get_cipher_name(ssl));
    }
    return ssl;
}

/* read(2) / write(2), or their TLS counterparts: the same return values,
 * with errno EAGAIN while TLS waits for the socket (either way: the
 * connection is always watched for input, and for output while a request is
 * unwritten, so a retry comes). */
static ssize_t tls_result(SSL *ssl, int n) {
    if (n > 0) return n;
    switch (SSL_get_error(ssl, n)) {
    case SSL_ERROR_WANT_READ:
    case SSL_ERROR_WANT_WRITE:
        errno = EAGAIN;
        return -1;
    case SSL_ERROR_ZERO_RETURN:
        return 0;
    default:
        ERR_clear_error();
        errno = EIO;
        return -1;
    }
}

static ssize_t conn_read(conn_t *c, void *buf, size_t len) {
    if (!c->ssl) return read(c->fd, buf, len);
    return tls_result(c->ssl, SSL_read(c->ssl, buf, (int)len));
}

static ssize_t conn_write(conn_t *c, const void *buf, size_t len) {
    if (!c->ssl) return write(c->fd, buf, len);
    return tls_result(c->ssl, SSL_write(c->ssl, buf, (int)len));
}

static int open_conn(conn_t *c) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) {
        close(fd);
        return -1;
    }
    SSL *ssl = NULL;
    if (tls_ctx && !(ssl = tls_handshake(fd))) {
        close(fd);
        return -1;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
    if (epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev) < 0) {
        SSL_free(ssl);
        close(fd);
        return -1;
    }
    c->fd = fd;
    c->ssl = ssl;
    c->blen = 0;
    c->state = P_HEAD;
    c->close_after = 0;
    return 0;
}

static void close_conn(conn_t *c) {
    if (c->fd >= 0) {
        epoll_ctl(epfd, EPOLL_CTL_DEL, c->fd, NULL);
        SSL_free(c->ssl); /* no close_notify: the connection is dropped either way */
        close(c->fd);
    }
    c->ssl = NULL;
    c->fd = -1;
}

typedef struct {
    int64_t *v;
    size_t n, cap;
} vec_t;

static vec_t lat_corr, lat_raw, lat_ok; /* lat_ok: corrected, 2xx only */

static void push(vec_t *a, int64_t x) {
    if (a->n == a->cap) {
        a->cap = a->cap ? a->cap * 2 : 1 << 16;
        a->v = realloc(a->v, a->cap * sizeof *a->v);
        if (!a->v) die("out of memory");
    }
    a->v[a->n++] = x;
}

static void record(int64_t corr, int64_t raw) {
    push(&lat_corr, corr);
    if (raw >= 0) push(&lat_raw, raw);
}

static void set_writable_interest(conn_t *c, int want) {
    struct epoll_event ev = {.events = EPOLLIN | (want ? EPOLLOUT : 0), .data.ptr = c};
    epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev);
}

/* Writes (the rest of) the request; returns -1 on a broken connection. */
static int flush_req(conn_t *c) {
    while (c->woff < req_len) {
        ssize_t n = conn_write(c, req + c->woff, req_len - c->woff);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                set_writable_interest(c, 1);
                return 0;
            }
            if (errno == EINTR) continue;
            return -1;
        }
        c->woff += (size_t)n;
    }
    set_writable_interest(c, 0);
    return 0;
}

static int64_t t0, period_ns, warm_ns, end_ns;
static long next_idx; /* next request index to issue (intended t0 + idx * period) */

static int64_t intended_of(long idx) { return t0 + (int64_t)((double)idx * (double)period_ns); }

static int start_req(conn_t *c, long idx);

static void conn_failed(conn_t *c, int had_request) {
    if (had_request) {
        errors_io++;
    }
    c->busy = 0;
    close_conn(c);
    reconnects++;
    if (open_conn(c) < 0) errors_connect++;
}

static int start_req(conn_t *c, long idx) {
    int64_t now = now_ns();
    c->busy = 1;
    c->intended = intended_of(idx);
    c->sent = now;
    c->record = c->intended >= t0 + warm_ns && c->intended < end_ns;
    c->woff = 0;
    c->state = P_HEAD;
    c->status = 0;
    c->close_after = 0;
    if (now - c->intended > max_send_lag && c->record) max_send_lag = now - c->intended;
    sent_total++;
    if (c->record) sent_measured++;
    if (c->fd < 0 && open_conn(c) < 0) {
        errors_connect++;
        c->busy = 0;
        return -1;
    }
    if (flush_req(c) < 0) {
        conn_failed(c, 1);
        return -1;
    }
    return 0;
}

/* Hands due requests to idle connections. */
static void dispatch(void) {
    int64_t now = now_ns();
    for (int i = 0; i < nconns; i++) {
        if (next_idx < 0) break;
        int64_t due = intended_of(next_idx);
        if (due > now || due >= end_ns) break;
        conn_t *c = &conns[i];
        if (c->busy) continue;
        long idx = next_idx++;
        start_req(c, idx);
    }
}

static int any_idle(void) {
    for (int i = 0; i < nconns; i++)
        if (!conns[i].busy) return 1;
    return 0;
}

/* Arms the timer for the next intended send. A request already due goes to
 * an idle connection now; with none idle (a backlog) no timer is armed: the
 * next connection to free up takes it (response_done). */
static void arm_timer(void) {
    struct itimerspec its = {0};
    for (;;) {
        int64_t due = intended_of(next_idx);
        if (due >= end_ns) break; /* the schedule is over: disarm */
        if (due > now_ns()) {
            its.it_value.tv_sec = due / 1000000000LL;
            its.it_value.tv_nsec = due % 1000000000LL;
            break;
        }
        if (!any_idle()) break;
        dispatch();
    }
    timerfd_settime(tfd, TFD_TIMER_ABSTIME, &its, NULL);
}

static void response_done(conn_t *c) {
    int64_t now = now_ns();
    completed_total++;
    if (c->record) {
        if (c->status > 0 && c->status < 600) status_count[c->status]++;
        completed_measured++;
        record(now - c->intended, now - c->sent);
        if (c->status >= 200 && c->status < 300) push(&lat_ok, now - c->intended);
    }
    c->busy = 0;
    c->state = P_HEAD;
    if (c->close_after) {
        close_conn(c);
        reconnects++;
        if (open_conn(c) < 0) errors_connect++;
    }
    /* A queued request (already due) goes out on this connection at once. */
    if (c->fd >= 0 && intended_of(next_idx) <= now && intended_of(next_idx) < end_ns) {
        long idx = next_idx++;
        start_req(c, idx);
    }
}

/* Parses what is buffered; returns -1 on a protocol error. */
/* Drops what has arrived of the body or chunk being read, at most
   c->remaining bytes; 1 when the whole of it has arrived. */
static int take_remaining(conn_t *c) {
    size_t take = c->blen < (size_t)c->remaining ? c->blen : (size_t)c->remaining;
    memmove(c->buf, c->buf + take, c->blen - take);
    c->blen -= take;
    c->remaining -= (int64_t)take;
    return c->remaining <= 0;
}

static int parse(conn_t *c) {
    for (;;) {
        if (!c->busy) {
            if (c->blen) { c->blen = 0; return -1; } /* unsolicited bytes */
            return 0;
        }
        switch (c->state) {
        case P_HEAD: {
            char *end = memmem(c->buf, c->blen, "\r\n\r\n", 4);
            if (!end) {
                if (c->blen == RBUF) return -1;
                return 0;
            }
            size_t hlen = (size_t)(end - c->buf) + 4;
            if (c->blen < 12 || memcmp(c->buf, "HTTP/1.", 7) != 0) return -1;
            c->status = atoi(c->buf + 9);
            int64_t clen = -1;
            int chunked = 0;
            char *line = memchr(c->buf, '\n', hlen);
            while (line && line + 1 < c->buf + hlen - 2) {
                char *p = line + 1;
                char *eol = memchr(p, '\n', (size_t)(c->buf + hlen - p));
                if (!eol) break;
                if (strncasecmp(p, "content-length:", 15) == 0) clen = strtoll(p + 15, NULL, 10);
                else if (strncasecmp(p, "transfer-encoding:", 18) == 0 && memmem(p, (size_t)(eol - p), "chunked", 7)) chunked = 1;
                else if (strncasecmp(p, "connection:", 11) == 0 && memmem(p, (size_t)(eol - p), "close", 5)) c->close_after = 1;
                line = eol;
            }
            memmove(c->buf, c->buf + hlen, c->blen - hlen);
            c->blen -= hlen;
            if (c->status == 204 || c->status == 304 || (c->status >= 100 && c->status < 200)) {
                if (c->status < 200) continue; /* interim: parse the next head */
                response_done(c);
                continue;
            }
            if (chunked) c->state = P_CHUNK_SIZE;
            else if (clen >= 0) { c->state = P_BODY; c->remaining = clen; }
            else { c->state = P_UNTIL_CLOSE; c->close_after = 1; }
            break;
        }
        case P_BODY:
            if (!take_remaining(c)) return 0;
            response_done(c);
            break;
        case P_CHUNK_SIZE: {
            char *eol = memmem(c->buf, c->blen, "\r\n", 2);
            if (!eol) return c->blen == RBUF ? -1 : 0;
            int64_t n = strtoll(c->buf, NULL, 16);
            size_t l = (size_t)(eol - c->buf) + 2;
            memmove(c->buf, c->buf + l, c->blen - l);
            c->blen -= l;
            if (n == 0) c->state = P_TRAILER;
            else { c->remaining = n; c->state = P_CHUNK_DATA; }
            break;
        }
        case P_CHUNK_DATA:
            if (!take_remaining(c)) return 0;
            c->state = P_CHUNK_CRLF;
            break;
        case P_CHUNK_CRLF: {
            if (c->blen < 2) return 0;
            memmove(c->buf, c->buf + 2, c->blen - 2);
            c->blen -= 2;
            c->state = P_CHUNK_SIZE;
            break;
        }
        case P_TRAILER: {
            char *eol = memmem(c->buf, c->blen, "\r\n", 2);
            if (!eol) return 0;
            size_t l = (size_t)(eol - c->buf) + 2;
            memmove(c->buf, c->buf + l, c->blen - l);
            c->blen -= l;
            if (l == 2) response_done(c);
            break;
        }
        case P_UNTIL_CLOSE:
            c->blen = 0;
            return 0;
        }
    }
}

static void on_readable(conn_t *c) {
    for (;;) {
        if (c->fd < 0) return;
        ssize_t n = conn_read(c, c->buf + c->blen, RBUF - c->blen);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) return;
            if (errno == EINTR) continue;
            conn_failed(c, c->busy);
            return;
        }
        if (n == 0) {
            if (c->busy && c->state == P_UNTIL_CLOSE) {
                c->close_after = 1;
                response_done(c);
                return;
            }
            conn_failed(c, c->busy);
            return;
        }
        c->blen += (size_t)n;
        if (parse(c) < 0) {
            errors_parse++;
            conn_failed(c, c->busy);
            return;
        }
    }
}

static int cmp64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

static double pct(int64_t *v, size_t n, double p) {
    if (!n) return -1;
    size_t i = (size_t)(p / 100.0 * (double)n);
    if (i >= n) i = n - 1;
    return (double)v[i] / 1e6;
}

static void usage(void) {
    fprintf(stderr,
            "usage: fixedrate --url http[s]://127.0.0.1:PORT/PATH --rate RPS --duration SECS\n"
            "                 [--warmup SECS] [--connections N] [--header 'k: v']... [--timeout SECS] [--out FILE]\n"
            "                 [--samples FILE]\n");
    exit(2);
}

int main(int argc, char **argv) {
    const char *url = NULL, *out = NULL, *samples = NULL;
    double rate = 0, duration = 0, warmup = 0, timeout = 5;
    char *headers[MAX_HEADERS];
    int nheaders = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) usage();
        if (!strcmp(a, "--url")) url = v;
        else if (!strcmp(a, "--rate")) rate = atof(v);
        else if (!strcmp(a, "--duration")) duration = atof(v);
        else if (!strcmp(a, "--warmup")) warmup = atof(v);
        else if (!strcmp(a, "--connections")) nconns = atoi(v);
        else if (!strcmp(a, "--timeout")) timeout = atof(v);
        else if (!strcmp(a, "--out")) out = v;
        else if (!strcmp(a, "--samples")) samples = v;
        else if (!strcmp(a, "--header")) {
            if (nheaders == MAX_HEADERS) die("too many --header");
            headers[nheaders++] = (char *)v;
        } else usage();
        i++;
    }
    if (!url || rate <= 0 || duration <= 0 || nconns < 1 || nconns > MAX_CONNS) usage();

    /* http[s]://A.B.C.D:PORT/PATH */
    int https = !strncmp(url, "https://", 8);
    if (strncmp(url, "http://", 7) && !https) die("the url must be http:// or https://");
    if (https) {
        tls_ctx = SSL_CTX_new(TLS_client_method());
        if (!tls_ctx) die("SSL_CTX_new");
        SSL_CTX_set_verify(tls_ctx, SSL_VERIFY_NONE, NULL);
        SSL_CTX_set_mode(tls_ctx, SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    }
    char host[64];
    const char *hp = url + (https ? 8 : 7);
    const char *slash = strchr(hp, '/');
    const char *path = slash ? slash : "/";
    size_t hl = slash ? (size_t)(slash - hp) : strlen(hp);
    if (hl >= sizeof host) die("bad host");
    memcpy(host, hp, hl);
    host[hl] = 0;
    char *colon = strchr(host, ':');
    int port = https ? 443 : 80;
    if (colon) { *colon = 0; port = atoi(colon + 1); }
    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    addr.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, host, &addr.sin_addr) != 1) die("the host must be a literal IPv4 address");
    if ((ntohl(addr.sin_addr.s_addr) >> 24) != 127) die("loopback (127.0.0.0/8) targets only");
    if (colon) *colon = ':';

    size_t cap = 512 + strlen(path) + strlen(host);
    for (int i = 0; i < nheaders; i++) cap += strlen(headers[i]) + 2;
    req = malloc(cap);
    int off = snprintf(req, cap, "GET %s HTTP/1.1\r\nHost: %s:%d\r\nUser-Agent: fixedrate\r\n", path, host, port);
    for (int i = 0; i < nheaders; i++) off += snprintf(req + off, cap - (size_t)off, "%s\r\n", headers[i]);
    off += snprintf(req + off, cap - (size_t)off, "\r\n");
    req_len = (size_t)off;

    signal(SIGPIPE, SIG_IGN);
    epfd = epoll_create1(EPOLL_CLOEXEC);
    tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (epfd < 0 || tfd < 0) die("epoll/timerfd");
    struct epoll_event tev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(epfd, EPOLL_CTL_ADD, tfd, &tev);

    conns = calloc((size_t)nconns, sizeof *conns);
    for (int i = 0; i < nconns; i++) {
        conns[i].fd = -1;
        if (open_conn(&conns[i]) < 0) {
            fprintf(stderr, "fixedrate: cannot connect to %s\n", url);
            return 1;
        }
    }

    period_ns = (int64_t)(1e9 / rate);
    if (period_ns < 1) period_ns = 1;
    t0 = now_ns() + 10000000LL; /* 10 ms from now */
    warm_ns = (int64_t)(warmup * 1e9);
    end_ns = t0 + warm_ns + (int64_t)(duration * 1e9);
    next_idx = 0;
    arm_timer();

    struct epoll_event evs[256];
    int64_t deadline = end_ns + (int64_t)(timeout * 1e9);
    for (;;) {
        int64_t now = now_ns();
        int any_busy = 0;
        if (now >= end_ns) {
            dispatch(); /* requests intended just before the end still go out */
            for (int i = 0; i < nconns; i++) any_busy |= conns[i].busy;
            if ((!any_busy && intended_of(next_idx) >= end_ns) || now >= deadline) break;
        }
        int wait_ms = now >= end_ns ? 10 : (int)((end_ns - now) / 1000000LL) + 1;
        int n = epoll_wait(epfd, evs, 256, wait_ms);
        if (n < 0) {
            if (errno == EINTR) continue;
            die("epoll_wait");
        }
        int tick = 0;
        for (int i = 0; i < n; i++) {
            conn_t *c = evs[i].data.ptr;
            if (!c) { tick = 1; continue; }
            if (evs[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP)) on_readable(c);
            if (c->fd >= 0 && (evs[i].events & EPOLLOUT) && c->busy && c->woff < req_len) {
                if (flush_req(c) < 0) conn_failed(c, 1);
            }
        }
        if (tick) {
            uint64_t exp;
            ssize_t r = read(tfd, &exp, sizeof exp);
            (void)r;
        }
        dispatch();
        arm_timer();
    }
    /* Requests still in flight at the deadline, and requests never sent (the
     * backlog never drained): their latency is at least "until now", which is
     * what they are counted with (a lower bound), so a saturated target cannot
     * look fast by leaving its slowest requests out. */
    int64_t t_exit = now_ns();
    for (int i = 0; i < nconns; i++)
        if (conns[i].busy && conns[i].record) {
            unfinished++;
            record(t_exit - conns[i].intended, t_exit - conns[i].sent);
        }
    long never_sent = 0;
    for (long idx = next_idx; intended_of(idx) < end_ns; idx++)
        if (intended_of(idx) >= t0 + warm_ns) {
            never_sent++;
            record(t_exit - intended_of(idx), -1);
        }
    double achieved = (double)completed_measured / duration;

    qsort(lat_corr.v, lat_corr.n, sizeof *lat_corr.v, cmp64);
    qsort(lat_raw.v, lat_raw.n, sizeof *lat_raw.v, cmp64);
    qsort(lat_ok.v, lat_ok.n, sizeof *lat_ok.v, cmp64);
    double mean = 0;
    for (size_t i = 0; i < lat_corr.n; i++) mean += (double)lat_corr.v[i];
    mean = lat_corr.n ? mean / (double)lat_corr.n / 1e6 : -1;
    int64_t *lc = lat_corr.v, *lr = lat_raw.v;
    size_t nc = lat_corr.n, nr = lat_raw.n;

    char json[8192];
    int j = snprintf(json, sizeof json,
                     "{\"url\":\"%s\",\"connections\":%d,\"rate_target\":%.1f,\"rate_achieved\":%.1f,"
                     "\"duration_s\":%.3f,\"warmup_s\":%.3f,\"sent\":%ld,\"completed\":%ld,\"unfinished\":%ld,"
                     "\"never_sent\":%ld,\"sent_total\":%ld,\"completed_total\":%ld,\"errors\":{\"connect\":%ld,\"io\":%ld,\"parse\":%ld},\"reconnects\":%ld,"
                     "\"max_send_lag_ms\":%.3f,\"tls\":{\"version\":\"%s\",\"cipher\":\"%s\"},"
                     "\"latency_ms\":{\"p50\":%.4f,\"p90\":%.4f,\"p99\":%.4f,\"p999\":%.4f,\"max\":%.4f,\"mean\":%.4f},"
                     "\"service_time_ms\":{\"p50\":%.4f,\"p90\":%.4f,\"p99\":%.4f,\"p999\":%.4f,\"max\":%.4f},"
                     "\"status\":{",
                     url, nconns, rate, achieved, duration, warmup, sent_measured, completed_measured, unfinished,
                     never_sent, sent_total, completed_total, errors_connect, errors_io, errors_parse, reconnects, (double)max_send_lag / 1e6,
                     tls_version, tls_cipher,
                     pct(lc, nc, 50), pct(lc, nc, 90), pct(lc, nc, 99), pct(lc, nc, 99.9),
                     nc ? (double)lc[nc - 1] / 1e6 : -1, mean,
                     pct(lr, nr, 50), pct(lr, nr, 90), pct(lr, nr, 99), pct(lr, nr, 99.9),
                     nr ? (double)lr[nr - 1] / 1e6 : -1);
    int first = 1;
    for (int s = 0; s < 600; s++) {
        if (!status_count[s]) continue;
        j += snprintf(json + j, sizeof json - (size_t)j, "%s\"%d\":%ld", first ? "" : ",", s, status_count[s]);
        first = 0;
    }
    int64_t *lo = lat_ok.v;
    size_t no = lat_ok.n;
    j += snprintf(json + j, sizeof json - (size_t)j,
                  "},\"ok_latency_ms\":{\"n\":%zu,\"p50\":%.4f,\"p90\":%.4f,\"p99\":%.4f,\"max\":%.4f}}\n",
                  no, pct(lo, no, 50), pct(lo, no, 90), pct(lo, no, 99), no ? (double)lo[no - 1] / 1e6 : -1);
    fputs(json, stdout);
    if (out) {
        FILE *f = fopen(out, "w");
        if (!f) die("cannot write --out");
        fputs(json, f);
        fclose(f);
    }
    if (samples) {
        FILE *f = fopen(samples, "wb");
        if (!f || fwrite(lc, sizeof *lc, nc, f) != nc || fclose(f)) die("cannot write --samples");
    }
    return 0;
}
