/*
 * redis_anchor: drives a redis-server the way envoyproxy/ratelimit's fixed
 * windows do, for loadtest/bench.sh's redis_anchor target (the standing
 * shares' anchor): per request, three descriptors, each `INCRBY key 1` then
 * `EXPIRE key 60`, sent as RESP over plain sockets, --pipeline requests
 * (6 x that many commands) written at once on a connection, the next
 * pipeline written once every reply of the last one is read. --connections
 * connections, each with one pipeline in flight, in one thread (poll).
 *
 *   redis_anchor --port 6379 [--host 127.0.0.1] [--duration 5] [--pipeline 16]
 *                [--connections 8] [--clients 1000000] [--zipf 1.0] [--over 3]
 *                [--expire 60] [--window 60] [--seed 1] [--out result.json]
 *
 * Each request's client is drawn as loadtest/bench/wrk-clients.lua draws it:
 * rank r of --clients N with probability proportional to 1/r^S (--zipf S),
 * by a uniform draw and a binary search of the cumulative distribution; the
 * client's address is 100.(64 + c/65536).(c/256 % 256).(c % 256), c = r - 1,
 * and a client is over its limit when (r * 503) % 10000 < PCT * 100, asking
 * then for the route /api/over rather than /api/bench (wrk-clients.lua's
 * two paths). The three descriptors, in envoy's key format
 * (domain_key_value[_key_value]_windowstart):
 *   bench_remote_address_<addr>_<w>                     the client's address
 *   bench_api_key_bench_<w>                             the one API key (hot)
 *   bench_path_<route>_remote_address_<addr>_<w>        the route, per client
 * with w the start of the current --window seconds (unix time).
 *
 * Runs --duration seconds from the moment every connection is open, then
 * stops writing and waits (up to 5 s) for the pipelines in flight. Prints
 * (and writes to --out) one JSON object: requests and commands completed,
 * seconds, requests per second, error replies, the settings. Exit status 0,
 * or 1 when a connection failed or an error reply came back, 2 on bad usage.
 *
 * Build: cc -O2 -Wall -o redis_anchor redis_anchor.c -lm   (bench.py does this)
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_CONNS 256
#define CMDS_PER_REQ 6

struct conn {
    int fd;
    char *out;        /* the pipeline being written */
    size_t out_len, out_off, out_cap;
    long replies_due; /* replies still to read for the pipeline in flight */
    int at_line_start;
    int busy;         /* a pipeline in flight */
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static uint64_t rng_state;
static double uniform(void) { /* xorshift64*, [0, 1) */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (double)((rng_state * 2685821657736338717ULL) >> 11) / 9007199254740992.0;
}

static double *cdf;
static long n_clients;

static long draw_rank(void) {
    double u = uniform();
    long lo = 1, hi = n_clients;
    while (lo < hi) {
        long mid = (lo + hi) / 2;
        if (cdf[mid - 1] < u)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static void reserve(struct conn *c, size_t more) {
    if (c->out_len + more <= c->out_cap)
        return;
    size_t cap = c->out_cap ? c->out_cap : 4096;
    while (cap < c->out_len + more)
        cap *= 2;
    c->out = realloc(c->out, cap);
    if (!c->out) {
        perror("realloc");
        exit(1);
    }
    c->out_cap = cap;
}

static const char *expire_arg;

/* INCRBY key 1, then EXPIRE key <expire>, appended to the connection's pipeline. */
static void append_pair(struct conn *c, const char *key, int klen) {
    int elen = (int)strlen(expire_arg);
    reserve(c, 2 * (size_t)klen + 128);
    int n = sprintf(c->out + c->out_len, "*3\r\n$6\r\nINCRBY\r\n$%d\r\n", klen);
    c->out_len += n;
    memcpy(c->out + c->out_len, key, klen);
    c->out_len += klen;
    memcpy(c->out + c->out_len, "\r\n$1\r\n1\r\n", 9);
    c->out_len += 9;
    n = sprintf(c->out + c->out_len, "*3\r\n$6\r\nEXPIRE\r\n$%d\r\n", klen);
    c->out_len += n;
    memcpy(c->out + c->out_len, key, klen);
    c->out_len += klen;
    n = sprintf(c->out + c->out_len, "\r\n$%d\r\n%s\r\n", elen, expire_arg);
    c->out_len += n;
}

static int pipeline_n;
static double over_pct;
static long window_secs;

static void build_pipeline(struct conn *c) {
    c->out_len = c->out_off = 0;
    long w = (long)time(NULL);
    w -= w % window_secs;
    char key[256];
    for (int i = 0; i < pipeline_n; i++) {
        long r = draw_rank(), k = r - 1;
        char addr[32];
        snprintf(addr, sizeof addr, "100.%ld.%ld.%ld", 64 + k / 65536, (k / 256) % 256, k % 256);
        const char *route = ((r * 503) % 10000 < over_pct * 100) ? "/api/over" : "/api/bench";
        int len = snprintf(key, sizeof key, "bench_remote_address_%s_%ld", addr, w);
        append_pair(c, key, len);
        len = snprintf(key, sizeof key, "bench_api_key_bench_%ld", w);
        append_pair(c, key, len);
        len = snprintf(key, sizeof key, "bench_path_%s_remote_address_%s_%ld", route, addr, w);
        append_pair(c, key, len);
    }
    c->replies_due = (long)pipeline_n * CMDS_PER_REQ;
    c->busy = 1;
}

static void usage(void) {
    fprintf(stderr, "usage: redis_anchor --port N [--host 127.0.0.1] [--duration SECS] [--pipeline N] "
                    "[--connections N] [--clients N] [--zipf S] [--over PCT] [--expire SECS] [--window SECS] "
                    "[--seed N] [--out FILE]\n");
    exit(2);
}

int main(int argc, char **argv) {
    const char *host = "127.0.0.1", *out_path = NULL;
    int port = 0, nconns = 8;
    double duration = 5, zipf = 1.0;
    long seed = 1;
    expire_arg = "60";
    pipeline_n = 16;
    over_pct = 3;
    window_secs = 60;
    n_clients = 1000000;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (i + 1 >= argc)
            usage();
        const char *v = argv[++i];
        if (!strcmp(a, "--host"))
            host = v;
        else if (!strcmp(a, "--port"))
            port = atoi(v);
        else if (!strcmp(a, "--duration"))
            duration = atof(v);
        else if (!strcmp(a, "--pipeline"))
            pipeline_n = atoi(v);
        else if (!strcmp(a, "--connections"))
            nconns = atoi(v);
        else if (!strcmp(a, "--clients"))
            n_clients = atol(v);
        else if (!strcmp(a, "--zipf"))
            zipf = atof(v);
        else if (!strcmp(a, "--over"))
            over_pct = atof(v);
        else if (!strcmp(a, "--expire"))
            expire_arg = v;
        else if (!strcmp(a, "--window"))
            window_secs = atol(v);
        else if (!strcmp(a, "--seed"))
            seed = atol(v);
        else if (!strcmp(a, "--out"))
            out_path = v;
        else
            usage();
    }
    if (port <= 0 || duration <= 0 || pipeline_n < 1 || nconns < 1 || nconns > MAX_CONNS || n_clients < 1 ||
        zipf < 0 || window_secs < 1 || atol(expire_arg) < 1)
        usage();
    rng_state = 0x9E3779B97F4A7C15ULL ^ (uint64_t)seed;
    if (!rng_state)
        rng_state = 1;

    /* The cumulative distribution over ranks 1..N, as wrk-clients.lua builds it. */
    cdf = malloc(sizeof(double) * n_clients);
    if (!cdf) {
        perror("malloc");
        return 1;
    }
    double total = 0;
    for (long r = 1; r <= n_clients; r++) {
        total += zipf == 1.0 ? 1.0 / r : 1.0 / pow((double)r, zipf);
        cdf[r - 1] = total;
    }
    for (long r = 0; r < n_clients; r++)
        cdf[r] /= total;

    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) {
        fprintf(stderr, "redis_anchor: --host must be an IPv4 address: %s\n", host);
        return 2;
    }
    struct conn conns[MAX_CONNS];
    struct pollfd pfd[MAX_CONNS];
    memset(conns, 0, sizeof conns);
    for (int i = 0; i < nconns; i++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
            fprintf(stderr, "redis_anchor: connect %s:%d: %s\n", host, port, strerror(errno));
            return 1;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
        conns[i].fd = fd;
        conns[i].at_line_start = 1;
    }

    long pipelines = 0, errors = 0, replies = 0;
    int failed = 0;
    char buf[65536];
    double t0 = now_s(), deadline = t0 + duration, t_end = t0;
    for (int i = 0; i < nconns; i++)
        build_pipeline(&conns[i]);
    for (;;) {
        double t = now_s();
        int stopping = t >= deadline;
        int live = 0;
        for (int i = 0; i < nconns; i++) {
            struct conn *c = &conns[i];
            pfd[i].fd = -1;
            pfd[i].events = 0;
            pfd[i].revents = 0;
            if (c->fd < 0 || !c->busy)
                continue;
            live++;
            pfd[i].fd = c->fd;
            pfd[i].events = c->out_off < c->out_len ? POLLOUT | POLLIN : POLLIN;
        }
        if (!live)
            break;
        if (stopping && t > deadline + 5) {
            fprintf(stderr, "redis_anchor: %d pipelines still unanswered 5 s after the end\n", live);
            failed = 1;
            break;
        }
        int n = poll(pfd, nconns, 100);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            perror("poll");
            return 1;
        }
        for (int i = 0; i < nconns; i++) {
            struct conn *c = &conns[i];
            if (pfd[i].fd < 0 || !pfd[i].revents)
                continue;
            if (pfd[i].revents & (POLLERR | POLLNVAL)) {
                fprintf(stderr, "redis_anchor: connection %d failed\n", i);
                close(c->fd);
                c->fd = -1;
                failed = 1;
                continue;
            }
            if ((pfd[i].revents & POLLOUT) && c->out_off < c->out_len) {
                ssize_t w = write(c->fd, c->out + c->out_off, c->out_len - c->out_off);
                if (w < 0 && errno != EAGAIN && errno != EINTR) {
                    fprintf(stderr, "redis_anchor: write: %s\n", strerror(errno));
                    close(c->fd);
                    c->fd = -1;
                    failed = 1;
                    continue;
                }
                if (w > 0)
                    c->out_off += (size_t)w;
            }
            if (pfd[i].revents & (POLLIN | POLLHUP)) {
                ssize_t r = read(c->fd, buf, sizeof buf);
                if (r <= 0) {
                    if (r < 0 && (errno == EAGAIN || errno == EINTR))
                        continue;
                    fprintf(stderr, "redis_anchor: connection %d closed by the server\n", i);
                    close(c->fd);
                    c->fd = -1;
                    failed = 1;
                    continue;
                }
                /* Every reply here is one line (":n" or "-ERR ..."): count lines. */
                for (ssize_t j = 0; j < r; j++) {
                    if (c->at_line_start && buf[j] == '-')
                        errors++;
                    c->at_line_start = buf[j] == '\n';
                    if (buf[j] == '\n') {
                        c->replies_due--;
                        replies++;
                    }
                }
                if (c->replies_due <= 0 && c->out_off >= c->out_len) {
                    pipelines++;
                    c->busy = 0;
                    t_end = now_s();
                    if (now_s() < deadline)
                        build_pipeline(c);
                }
            }
        }
    }
    double secs = t_end - t0;
    long requests = pipelines * pipeline_n;
    char json[1024];
    snprintf(json, sizeof json,
             "{\"requests\": %ld, \"commands\": %ld, \"replies\": %ld, \"pipelines\": %ld, \"seconds\": %.6f, "
             "\"rps\": %.1f, \"errors\": %ld, \"failed\": %s, \"pipeline\": %d, \"connections\": %d, "
             "\"clients\": %ld, \"zipf\": %g, \"over_pct\": %g, \"expire_s\": %s, \"window_s\": %ld, "
             "\"commands_per_request\": %d}\n",
             requests, requests * CMDS_PER_REQ, replies, pipelines, secs, secs > 0 ? requests / secs : 0.0, errors,
             failed ? "true" : "false", pipeline_n, nconns, n_clients, zipf, over_pct, expire_arg, window_secs,
             CMDS_PER_REQ);
    fputs(json, stdout);
    if (out_path) {
        FILE *f = fopen(out_path, "w");
        if (!f || fputs(json, f) < 0 || fclose(f) != 0) {
            fprintf(stderr, "redis_anchor: cannot write %s\n", out_path);
            return 1;
        }
    }
    for (int i = 0; i < nconns; i++)
        if (conns[i].fd >= 0)
            close(conns[i].fd);
    return failed || errors ? 1 : 0;
}
