/*
 * The front's checks of the stress harness (tests/native/pool_stress.c runs them, in the same
 * sanitizer builds): fanfs/csrc/front.c and writes.c driven as the kernel and libfuse drive
 * them, through one end of a SOCK_SEQPACKET pair (a message per request and per reply, as the
 * FUSE device gives them; tests/adapter/test_kernels.py does the same from Python, one request at a
 * time). SENDERS "kernel" threads send requests at once, a reader thread checks every reply,
 * and a "libfuse" thread takes what the front forwards (fanfs_front_forwarded) and answers it,
 * now and then more slowly than the front forwards, so that forwards wait in its queue.
 *
 * front: a small catalog (the root, a file per raw piece of the partition, an empty directory,
 * a file whose READs go to Python) served with the pool's fast path on (partition fd and, where
 * the file system can, its O_DIRECT twin). A GETATTR before the INIT (forwarded: nothing is
 * answered before it), the INIT of 7.27 (16 bytes, as RHEL 8 sends it), then LOOKUP (found,
 * not found, forwarded), GETATTR, READ (whole files and ranges, past the end, of a file left
 * to Python), IOCTL, FORGET, BATCH_FORGET, INTERRUPT, and what the front forwards (READDIR,
 * an opcode it does not know). Then the daemon's stop (fanfs_front_drain, fanfs_pool_stop,
 * fanfs_front_stop, fanfs_front_close, as fanfs/node/pool.py orders it; each session's front
 * is its own, made with the catalog and freed after) while requests are
 * still being sent, FRONT_ROUNDS times, each stopped later. Every request gets exactly one
 * reply, its own, with the right bytes (a forwarded one: libfuse's, or EIO once the drain
 * began), or none if it has none or was never read (left in the socket after the stop). Then
 * UNMOUNT_ROUNDS sessions whose device goes away under the front (the kernel's end shut down:
 * its reads return 0, where /dev/fuse's give ENODEV after an unmount): the threads end the
 * session by themselves and libfuse's receiver sees the end; no request gets two replies.
 *
 * writes: the output wing's front (fanfs_front_new(NULL, 1)) under WRITEs of up to 256 KiB at
 * any offset into temporary files, some through fds held below an offset (fanfs_front_hold: forwarded,
 * and written by the libfuse thread), some through a handle no fd can be (forwarded), with
 * GETATTR, FLUSH and FORGET between them. Every WRITE is answered with its size; after
 * fanfs_front_settle each file holds what the WRITEs, in their order, make of it, and the
 * lowest offset written behind is what fanfs_front_take_written says. Then the front is
 * stopped while WRITEs to O_DSYNC files (the writer waits for the disk: WRITEs queue up) still
 * come: every WRITE it answered is in its file.
 *
 * The socket stands in for /dev/fuse, which never blocks a reply and never raises SIGPIPE: the
 * front's end is non-blocking (fanfs_front_start makes it so), so the kernel threads keep the
 * bytes of replies in flight within the socket's send buffer (a reply that would not fit
 * would be lost, not a finding), and SIGPIPE is ignored (a reply after the kernel's end is
 * shut is EPIPE here, ENODEV there). Like the kernel's, requests left in the socket when the
 * front's threads stop are answered by nobody: they are counted, not failed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "front.h" /* (the kept file's layout: struct fanfs_wb_head, fanfs_wb_rec) */
#include "stress.h"

#define SENDERS 3
#define FRONT_THREADS 4
#define FRONT_REQUESTS 3000 /* per sender; the stop comes after 40 to 80 % of them */
#define FRONT_ROUNDS 5       /* sessions, each stopped later than the one before */
#define UNMOUNT_REQUESTS 300 /* per sender; the device goes away after 20 to 80 % of them */
#define UNMOUNT_ROUNDS 4
#define WRITES 150           /* per sender */
#define TAIL_WRITES 200      /* per sender, while the front stops: TAIL_MAX apart */
#define TAIL_MAX (64u << 10)
#define MAX_INFLIGHT 256     /* requests whose replies are awaited, at most */
#define TIMEOUT_S 60         /* for anything awaited: a hang is a failure, not a stuck test */
#define WFILE_MAX ((1u << 20) + (256u << 10)) /* offsets below 1 MiB, WRITEs up to 256 KiB */
#define WRITE_MAX (256u << 10) /* fits the kernel's end's send buffer, forced or not */
#define HOLD_AT (128u << 10)
#define NO_FD (FANFS_FRONT_MAX_FD + 7) /* a WRITE's handle that is no fd: forwarded */
#define TIMEOUT_CACHE 3600
#define OPCODE_UNKNOWN 4242

/* What a request expects. */
enum { X_INIT, X_ENTRY, X_NEG, X_ATTR, X_READ, X_ENOSYS, X_NONE, X_FWD, X_WRITE };

struct expect {
    uint8_t kind;
    uint8_t unsent;    /* its send failed: no reply */
    uint8_t unread;    /* left in the socket after the stop: no reply */
    uint8_t fwd_write; /* a WRITE the front must forward */
    uint8_t tail;      /* a WRITE sent while the front stops */
    uint8_t ok;        /* answered without an error */
    uint32_t opcode;
    uint64_t e;        /* the entry it is about (X_ENTRY, X_ATTR, X_READ); a WRITE's fd */
    uint64_t off;      /* X_READ, X_WRITE */
    uint32_t count;    /* X_READ: bytes answered; X_WRITE: its size */
    uint32_t charge;   /* bytes of the send buffer its reply may take */
    int replies;
};

static struct {
    const struct stress_file *files;
    int nfiles;
    uint64_t n; /* entries: the root, the files, "sub", "zz" */
    int sock[2]; /* [0] the kernel's end, [1] the front's */
    int gone;    /* (atomic) the kernel's end was shut: replies fail (EPIPE) */
    uint64_t sent; /* (atomic) requests sent */
    uint64_t read_ok, fwd_ok; /* (atomic) READs answered with their bytes; forwards answered */
    uint64_t drained;         /* (atomic) requests answered EIO by the drain */
    pthread_mutex_t lock; /* the fields below */
    pthread_cond_t cond;  /* a reply came, a sender must stop */
    struct expect *x;
    uint64_t nx, xcap;
    uint64_t inflight, budget; /* bytes of replies awaited, and how many may be */
    int inflight_n;
    int halt;      /* senders stop */
    int draining;  /* the drain began: EIO is an answer */
    uint64_t unread; /* requests never read, in all sessions */
    struct fanfs_front *front; /* this session's (the wing's own), made by its start */
    uint64_t counts[FANFS_FRONT_COUNTS + 1]; /* the front sessions' counters, summed */
} kern = {.lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER};

static int failures;

static void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "front_stress: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    __atomic_add_fetch(&failures, 1, __ATOMIC_SEQ_CST);
}

static int64_t now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static void deadline_in(struct timespec *t, int s) {
    clock_gettime(CLOCK_REALTIME, t);
    t->tv_sec += s;
}

/* -- the catalog: entry 0 the root; 1..nfiles "f00".. (the raw pieces); "sub", an empty
 * directory; "zz", a file whose READs go to Python (the fast path's FANFS_FAST_NO). ------- */

#define NAME_LEN 4
static struct {
    uint32_t *mode, *name_len, *child_start, *child_count, *part, *nlink, *crc;
    uint64_t *mtime, *size, *blocks, *name_off, *off, *stored;
    uint8_t *kind;
    char *strings;
    uint8_t part_local[1];
} cat;

static uint64_t entry_size(uint64_t e) { return cat.size[e]; }

static const char *entry_bytes(uint64_t e) {
    return e == kern.n - 1 ? kern.files[0].bytes : kern.files[e - 1].bytes;
}

static void name_of(uint64_t e, char *out) {
    if (e == kern.n - 2)
        memcpy(out, "sub", 4);
    else if (e == kern.n - 1)
        memcpy(out, "zz", 3);
    else
        snprintf(out, NAME_LEN, "f%02u", (unsigned)(e - 1) % 100);
}

static int catalog_make(void) {
    uint64_t n = kern.n, e, at = 0;
    cat.mode = calloc(n, 4), cat.name_len = calloc(n, 4), cat.child_start = calloc(n, 4);
    cat.child_count = calloc(n, 4), cat.part = calloc(n, 4), cat.nlink = calloc(n, 4);
    cat.crc = calloc(n, 4), cat.mtime = calloc(n, 8), cat.size = calloc(n, 8);
    cat.blocks = calloc(n, 8), cat.name_off = calloc(n, 8), cat.off = calloc(n, 8);
    cat.stored = calloc(n, 8), cat.kind = calloc(n, 1), cat.strings = calloc(n, NAME_LEN);
    if (cat.mode == NULL || cat.name_len == NULL || cat.child_start == NULL ||
        cat.child_count == NULL || cat.part == NULL || cat.nlink == NULL || cat.crc == NULL ||
        cat.mtime == NULL || cat.size == NULL || cat.blocks == NULL || cat.name_off == NULL ||
        cat.off == NULL || cat.stored == NULL || cat.kind == NULL || cat.strings == NULL)
        return -1;
    for (e = 0; e < n; e++) {
        int dir = e == 0 || e == n - 2;
        const struct stress_file *f = &kern.files[e == n - 1 ? 0 : dir ? 0 : e - 1];
        cat.mode[e] = dir ? S_IFDIR | 0755 : S_IFREG | 0644;
        cat.nlink[e] = e == 0 ? 3 : dir ? 2 : 1;
        cat.mtime[e] = (uint64_t)(1700000000 + e) * 1000000000 + e * 7919;
        cat.size[e] = dir ? 4096 : f->len;
        cat.blocks[e] = (cat.size[e] + 511) / 512;
        cat.off[e] = (uint64_t)f->off;
        cat.stored[e] = f->len;
        cat.crc[e] = f->crc;
        cat.kind[e] = dir || e == n - 1 ? FANFS_FAST_NO : FANFS_KIND_RAW;
        if (e > 0) { /* names in entry order are sorted: f00 < f01 < ... < sub < zz */
            name_of(e, cat.strings + at);
            cat.name_off[e] = at;
            cat.name_len[e] = (uint32_t)strlen(cat.strings + at);
            at += cat.name_len[e];
        }
    }
    cat.child_start[0] = 1;
    cat.child_count[0] = (uint32_t)(n - 1);
    cat.child_start[n - 2] = (uint32_t)n; /* "sub": none */
    cat.part_local[0] = 1;
    return 0;
}

static void catalog_free(void) {
    free(cat.mode), free(cat.name_len), free(cat.child_start), free(cat.child_count);
    free(cat.part), free(cat.nlink), free(cat.crc), free(cat.mtime), free(cat.size);
    free(cat.blocks), free(cat.name_off), free(cat.off), free(cat.stored), free(cat.kind);
    free(cat.strings);
}

/* NativePool.start and Front.start's order: the catalog, the pool, its fast path, then the
 * front's threads. */
static int pool_up(int part_fd, int dfd, int errwfd) {
    struct fanfs_meta m = {
        kern.n, (const char *)cat.mode, (const char *)cat.mtime, (const char *)cat.size,
        (const char *)cat.blocks, (const char *)cat.name_off, (const char *)cat.name_len,
        (const char *)cat.child_start, (const char *)cat.child_count, (const char *)cat.part,
        cat.nlink, cat.strings, kern.n * NAME_LEN, cat.part_local, 1, getuid(), getgid(), 4096,
        TIMEOUT_CACHE};
    struct fanfs_fast_table t = {kern.n, (const char *)cat.size, (const char *)cat.part,
                                 (const char *)cat.off, (const char *)cat.stored,
                                 (const char *)cat.crc, cat.kind, 1, 0, 1u << 20};
    if ((kern.front = fanfs_front_new(&m, 0)) == NULL || fanfs_pool_start(4, errwfd) != 0 ||
        fanfs_pool_fast_set(&t) != 0)
        return -1;
    fanfs_pool_fast_part(0, part_fd, dfd);
    fanfs_pool_fast_enable(1);
    return 0;
}

/* -- the kernel's side ----------------------------------------------------------------- */

/* Register what a request expects (its unique: the index + 1), once the replies in flight
 * leave room for its own; 0 once the senders stop. */
static uint64_t expect_new(struct expect x) {
    uint64_t u;
    int replied = x.kind != X_NONE && x.kind != X_INIT;
    /* A reply's payload, a page's rounding and the skb's own bytes. */
    x.charge = replied ? (x.kind == X_READ ? x.count : 0) + 8192 : 0;
    pthread_mutex_lock(&kern.lock);
    while (!kern.halt && replied && kern.inflight_n > 0 &&
           (kern.inflight + x.charge > kern.budget || kern.inflight_n >= MAX_INFLIGHT))
        pthread_cond_wait(&kern.cond, &kern.lock);
    if (kern.halt || kern.nx == kern.xcap) {
        pthread_mutex_unlock(&kern.lock);
        return 0;
    }
    u = ++kern.nx;
    kern.x[u - 1] = x;
    kern.inflight += x.charge;
    kern.inflight_n += replied;
    pthread_mutex_unlock(&kern.lock);
    return u;
}

static void settled_locked(struct expect *x) {
    kern.inflight -= x->charge;
    kern.inflight_n -= x->charge > 0;
    x->charge = 0;
    pthread_cond_broadcast(&kern.cond);
}

/* Send request `u`: 0, or -1 when it could not be (halted, or the device went away: EPIPE). */
static int send_request(uint64_t u, uint32_t opcode, uint64_t nodeid, const void *arg,
                        size_t arglen, const void *data, size_t datalen) {
    struct fuse_in_header in = {0};
    struct iovec iov[3] = {{&in, sizeof in}, {(void *)arg, arglen}, {(void *)data, datalen}};
    struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 3};
    in.len = (uint32_t)(sizeof in + arglen + datalen);
    in.opcode = opcode;
    in.unique = u;
    in.nodeid = nodeid;
    in.uid = getuid();
    in.gid = getgid();
    in.pid = (uint32_t)getpid();
    for (;;) {
        struct pollfd p = {kern.sock[0], POLLOUT, 0};
        if (sendmsg(kern.sock[0], &mh, MSG_DONTWAIT | MSG_NOSIGNAL) >= 0) {
            __atomic_add_fetch(&kern.sent, 1, __ATOMIC_SEQ_CST);
            return 0;
        }
        if (errno != EAGAIN && errno != EINTR)
            break;
        if (__atomic_load_n(&kern.halt, __ATOMIC_SEQ_CST))
            break;
        poll(&p, 1, 10);
    }
    pthread_mutex_lock(&kern.lock);
    kern.x[u - 1].unsent = 1;
    settled_locked(&kern.x[u - 1]);
    pthread_mutex_unlock(&kern.lock);
    return -1;
}

/* A reply from the kernel's end of the socket, as the front's threads and libfuse write it. */
static int send_reply(uint64_t unique, int err, const void *body, size_t len) {
    struct fuse_out_header out = {(uint32_t)(sizeof out + len), -err, unique};
    struct iovec iov[2] = {{&out, sizeof out}, {(void *)body, len}};
    struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 2};
    int64_t until = now_ms() + TIMEOUT_S * 1000;
    while (sendmsg(kern.sock[1], &mh, MSG_DONTWAIT | MSG_NOSIGNAL) < 0) {
        struct pollfd p = {kern.sock[1], POLLOUT, 0};
        if ((errno != EAGAIN && errno != EINTR) || now_ms() > until)
            return -1;
        poll(&p, 1, 10);
    }
    return 0;
}

static uint64_t marker(uint64_t unique) { return unique * 0x9e3779b97f4a7c15ull; }

/* Whether a reply `body` (`len` bytes, error `err`) is what request `x` (unique `u`) asked. */
static void check_reply(uint64_t u, const struct expect *x, int err, const char *body,
                        size_t len, int draining) {
    unsigned long long uu = (unsigned long long)u;
    if (err != 0) {
        if (err == -EIO && draining) { /* the drain answers what nobody else will */
            __atomic_add_fetch(&kern.drained, 1, __ATOMIC_RELAXED);
            return;
        }
        if (!(x->kind == X_ENOSYS && err == -ENOSYS))
            fail("request %llu (opcode %u, expects %d): error %d", uu, x->opcode, x->kind, -err);
        return;
    }
    switch (x->kind) {
    case X_ENTRY:
    case X_NEG: {
        struct fuse_entry_out o;
        if (len != sizeof o) {
            fail("LOOKUP %llu: %zu bytes", uu, len);
            return;
        }
        memcpy(&o, body, sizeof o);
        if (x->kind == X_NEG ? o.nodeid != 0
                             : o.nodeid != x->e + 1 || o.attr.ino != x->e + 1 ||
                                   o.attr.size != entry_size(x->e) ||
                                   o.attr.mode != cat.mode[x->e])
            fail("LOOKUP %llu: node %llu for entry %llu", uu, (unsigned long long)o.nodeid,
                 (unsigned long long)x->e);
        if (o.entry_valid != TIMEOUT_CACHE || o.attr_valid != TIMEOUT_CACHE)
            fail("LOOKUP %llu: timeouts %llu %llu", uu, (unsigned long long)o.entry_valid,
                 (unsigned long long)o.attr_valid);
        return;
    }
    case X_ATTR: {
        struct fuse_attr_out o;
        if (len != sizeof o) {
            fail("GETATTR %llu: %zu bytes", uu, len);
            return;
        }
        memcpy(&o, body, sizeof o);
        if (o.attr.ino != x->e + 1 || o.attr.size != entry_size(x->e) ||
            o.attr.mode != cat.mode[x->e] || o.attr.blocks != cat.blocks[x->e] ||
            o.attr.nlink != cat.nlink[x->e] || o.attr_valid != TIMEOUT_CACHE)
            fail("GETATTR %llu: the attributes of another entry than %llu", uu,
                 (unsigned long long)x->e);
        return;
    }
    case X_READ:
        if (len != x->count || memcmp(body, entry_bytes(x->e) + x->off, len) != 0)
            fail("READ %llu of entry %llu [%llu, +%u): %zu bytes, wrong", uu,
                 (unsigned long long)x->e, (unsigned long long)x->off, x->count, len);
        else
            __atomic_add_fetch(&kern.read_ok, 1, __ATOMIC_RELAXED);
        return;
    case X_FWD: {
        uint64_t v;
        memcpy(&v, body, len == sizeof v ? sizeof v : 0);
        if (len != sizeof v || v != marker(u))
            fail("forwarded request %llu: a reply that is not libfuse's to it", uu);
        return;
    }
    case X_WRITE: {
        struct fuse_write_out o;
        memcpy(&o, body, len == sizeof o ? sizeof o : 0);
        if (len != sizeof o || o.size != x->count)
            fail("WRITE %llu of %u bytes: %zu bytes of reply, size %u", uu, x->count, len,
                 len == sizeof o ? o.size : 0);
        return;
    }
    default:
        fail("request %llu (opcode %u) has no reply, and got one", uu, x->opcode);
    }
}

/* Replies come back on the kernel's end, each checked against its request. */
static void *reader_main(void *arg) {
    size_t cap = (1u << 20);
    char *msg = malloc(cap);
    (void)arg;
    for (;;) {
        struct fuse_out_header out;
        struct expect x;
        int draining;
        ssize_t n = recv(kern.sock[0], msg, cap, 0);
        if (n <= 0)
            break; /* the device went away */
        if ((size_t)n < sizeof out) {
            fail("a reply of %zd bytes", n);
            continue;
        }
        memcpy(&out, msg, sizeof out);
        if (out.unique == UINT64_MAX)
            break; /* the end */
        if (out.len != (uint32_t)n)
            fail("a reply of %zd bytes says %u", n, out.len);
        if (out.unique == 0)
            continue; /* a push (none is asked for) */
        pthread_mutex_lock(&kern.lock);
        if (out.unique > kern.nx) {
            pthread_mutex_unlock(&kern.lock);
            fail("a reply to request %llu, never sent", (unsigned long long)out.unique);
            continue;
        }
        kern.x[out.unique - 1].replies++;
        kern.x[out.unique - 1].ok = out.error == 0;
        x = kern.x[out.unique - 1];
        settled_locked(&kern.x[out.unique - 1]);
        draining = kern.draining;
        pthread_mutex_unlock(&kern.lock);
        if (x.replies > 1)
            fail("request %llu: %d replies", (unsigned long long)out.unique, x.replies);
        else
            check_reply(out.unique, &x, out.error, msg + sizeof out, (size_t)n - sizeof out,
                        draining);
    }
    free(msg);
    return NULL;
}

/* -- libfuse's side: what the front forwards --------------------------------------------- */

static int gone(void) { return __atomic_load_n(&kern.gone, __ATOMIC_SEQ_CST); }

static void serve_forwarded(const char *msg, ssize_t n) {
    struct fuse_in_header in;
    struct expect x;
    uint64_t v;
    int sent;
    if ((size_t)n < sizeof in) {
        fail("a forwarded request of %zd bytes", n);
        return;
    }
    memcpy(&in, msg, sizeof in);
    pthread_mutex_lock(&kern.lock);
    sent = in.unique >= 1 && in.unique <= kern.nx;
    x = sent ? kern.x[in.unique - 1] : (struct expect){0};
    pthread_mutex_unlock(&kern.lock);
    if (!sent || in.len != (uint32_t)n || in.opcode != x.opcode) {
        fail("forwarded: request %llu, opcode %u, %zd bytes, never sent so",
             (unsigned long long)in.unique, in.opcode, n);
        return;
    }
    if (x.kind == X_FWD) {
        v = marker(in.unique);
        __atomic_add_fetch(&kern.fwd_ok, 1, __ATOMIC_RELAXED);
        if (send_reply(in.unique, 0, &v, sizeof v) != 0 && !gone())
            fail("libfuse's reply to %llu: %s", (unsigned long long)in.unique, strerror(errno));
    } else if (x.kind == X_WRITE && x.fwd_write) {
        struct fuse_write_in w;
        struct fuse_write_out o = {0};
        memcpy(&w, msg + sizeof in, sizeof w);
        if (w.fh < FANFS_FRONT_MAX_FD &&
            pwrite((int)w.fh, msg + sizeof in + sizeof w, w.size, (off_t)w.offset) != w.size)
            fail("libfuse's pwrite of WRITE %llu", (unsigned long long)in.unique);
        o.size = w.size;
        __atomic_add_fetch(&kern.fwd_ok, 1, __ATOMIC_RELAXED);
        if (send_reply(in.unique, 0, &o, sizeof o) != 0 && !gone())
            fail("libfuse's reply to %llu: %s", (unsigned long long)in.unique, strerror(errno));
    } else {
        fail("request %llu (opcode %u, expects %d) forwarded: the front answers it",
             (unsigned long long)in.unique, in.opcode, x.kind);
        send_reply(in.unique, EIO, NULL, 0); /* answered all the same: one failure each */
    }
}

struct libfuse {
    pthread_t thread;
    int readyfd;
    int ended; /* the receiver said the session ended */
};

static void *libfuse_main(void *arg) {
    struct libfuse *l = arg;
    size_t cap = fanfs_front_bufsize(kern.front);
    char *buf = malloc(cap);
    int k = 0;
    for (;;) {
        ssize_t n = fanfs_front_forwarded(kern.front, buf, cap);
        if (n == -EAGAIN) {
            struct pollfd p = {l->readyfd, POLLIN, 0};
            poll(&p, 1, 100);
            continue;
        }
        if (n <= 0) {
            if (n < 0)
                fail("fanfs_front_forwarded: %zd", n);
            break;
        }
        serve_forwarded(buf, n);
        if (++k % 16 == 0)
            usleep(500); /* slower than the front: forwards wait in its queue for the drain */
    }
    __atomic_store_n(&l->ended, 1, __ATOMIC_SEQ_CST);
    free(buf);
    return NULL;
}

/* -- one session ------------------------------------------------------------------------- */

static int session_open(void) {
    int big = 8 << 20, have;
    socklen_t len = sizeof have;
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, kern.sock) != 0)
        return -1;
    /* Room for replies (SO_SNDBUFFORCE needs root; the test runs as root, else the default
     * maximum), and for the kernel's WRITEs of up to WRITE_MAX. */
    for (int i = 0; i < 2; i++)
        if (setsockopt(kern.sock[i], SOL_SOCKET, SO_SNDBUFFORCE, &big, sizeof big) != 0)
            setsockopt(kern.sock[i], SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
    if (getsockopt(kern.sock[1], SOL_SOCKET, SO_SNDBUF, &have, &len) != 0)
        return -1;
    kern.budget = (uint64_t)have / 2;
    kern.nx = kern.sent = 0;
    kern.halt = kern.draining = kern.gone = 0;
    kern.inflight = 0;
    kern.inflight_n = 0;
    return 0;
}

/* The next forwarded request, as libfuse's receiver waits for it. */
static ssize_t next_forwarded(char *buf, size_t cap) {
    int64_t until = now_ms() + TIMEOUT_S * 1000;
    ssize_t n;
    while ((n = fanfs_front_forwarded(kern.front, buf, cap)) == -EAGAIN && now_ms() < until)
        usleep(1000);
    return n;
}

/* A GETATTR before any INIT, which the front leaves to libfuse (here: this thread), then the
 * kernel's INIT of protocol 7.27 (RHEL 8: the 16-byte fuse_init_in), handed to libfuse too. */
static int session_init(void) {
    struct {
        uint32_t major, minor, max_readahead, flags;
    } init = {7, 27, 128u << 10, FUSE_ASYNC_READ | FUSE_BIG_WRITES | FUSE_DO_READDIRPLUS};
    struct fuse_getattr_in g = {0};
    size_t cap = fanfs_front_bufsize(kern.front);
    char *buf = malloc(cap);
    struct fuse_in_header in;
    uint64_t said[5], v, u = expect_new((struct expect){.kind = X_FWD, .opcode = FUSE_GETATTR});
    ssize_t n = -EAGAIN;
    if (buf == NULL || u == 0 || send_request(u, FUSE_GETATTR, 1, &g, sizeof g, NULL, 0))
        return -1;
    n = next_forwarded(buf, cap);
    memcpy(&in, buf, n >= (ssize_t)sizeof in ? sizeof in : 0);
    v = marker(u);
    if (n != (ssize_t)(sizeof in + sizeof g) || in.unique != u || send_reply(u, 0, &v, sizeof v))
        fail("a GETATTR before the INIT was not forwarded (%zd bytes)", n);
    u = expect_new((struct expect){.kind = X_INIT, .opcode = FUSE_INIT});
    if (u == 0 || send_request(u, FUSE_INIT, 0, &init, sizeof init, NULL, 0))
        return -1;
    n = next_forwarded(buf, cap);
    memcpy(&in, buf, n >= (ssize_t)sizeof in ? sizeof in : 0);
    if (n != (ssize_t)(sizeof in + sizeof init) || in.opcode != FUSE_INIT || in.unique != u ||
        memcmp(buf + sizeof in, &init, sizeof init) != 0) {
        fail("the INIT was not forwarded as sent (%zd bytes)", n);
        free(buf);
        return -1;
    }
    free(buf);
    fanfs_front_kernel(kern.front, said);
    if (said[0] != 7 || said[1] != 27 || said[3] != FANFS_FRONT_SERVES)
        fail("the front saw protocol %llu.%llu, why %llu", (unsigned long long)said[0],
             (unsigned long long)said[1], (unsigned long long)said[3]);
    return 0;
}

/* Requests still in the front's end of the socket once its threads stopped: never read, so
 * never answered (the kernel ends them at the unmount). */
static void session_unread(void) {
    char *buf = malloc(fanfs_front_bufsize(kern.front));
    struct fuse_in_header in;
    ssize_t n;
    while ((n = recv(kern.sock[1], buf, fanfs_front_bufsize(kern.front), MSG_DONTWAIT)) >=
           (ssize_t)sizeof in) {
        memcpy(&in, buf, sizeof in);
        pthread_mutex_lock(&kern.lock);
        if (in.unique >= 1 && in.unique <= kern.nx) {
            kern.x[in.unique - 1].unread = 1;
            kern.unread++;
            settled_locked(&kern.x[in.unique - 1]);
        }
        pthread_mutex_unlock(&kern.lock);
    }
    free(buf);
}

/* Every request got exactly the replies it should (`at_most`: at most those: the device went
 * away under some). */
/* Whether request `x` must be answered. */
static int awaited(const struct expect *x) {
    return x->kind != X_NONE && x->kind != X_INIT && !x->unsent && !x->unread;
}

static void session_check(int at_most) {
    int64_t until = now_ms() + TIMEOUT_S * 1000;
    uint64_t i, missing;
    do {
        missing = 0;
        pthread_mutex_lock(&kern.lock);
        for (i = 0; i < kern.nx && !at_most; i++)
            missing += kern.x[i].replies == 0 && awaited(&kern.x[i]);
        pthread_mutex_unlock(&kern.lock);
    } while (missing > 0 && now_ms() < until && usleep(10000) == 0);
    pthread_mutex_lock(&kern.lock);
    for (i = 0; i < kern.nx; i++) {
        const struct expect *x = &kern.x[i];
        int want = awaited(x);
        if (x->replies > 1 || (x->replies == 1 && !want) || (x->replies == 0 && want && !at_most))
            fail("request %llu (opcode %u%s%s): %d replies", (unsigned long long)i + 1,
                 x->opcode, x->unsent ? ", unsent" : "", x->unread ? ", never read" : "",
                 x->replies);
    }
    pthread_mutex_unlock(&kern.lock);
}

static void session_halt(void) {
    pthread_mutex_lock(&kern.lock);
    __atomic_store_n(&kern.halt, 1, __ATOMIC_SEQ_CST);
    pthread_cond_broadcast(&kern.cond);
    pthread_mutex_unlock(&kern.lock);
}

/* The end of the replies: the reader stops there. */
static void session_end_reader(pthread_t reader) {
    if (send_reply(UINT64_MAX, 0, NULL, 0) != 0)
        fail("the end marker: %s", strerror(errno));
    pthread_join(reader, NULL);
}

static void wait_sent(uint64_t n) {
    int64_t until = now_ms() + TIMEOUT_S * 1000;
    while (__atomic_load_n(&kern.sent, __ATOMIC_SEQ_CST) < n && now_ms() < until)
        usleep(1000);
}

/* -- front: the dataset wing's front ------------------------------------------------------ */

struct sender {
    pthread_t thread;
    unsigned seed;
    int requests;
};

static void read_request(unsigned *seed, struct expect *x, uint64_t *nodeid,
                         struct fuse_read_in *r) {
    uint64_t e = 1 + (uint64_t)(rand_r(seed) % kern.nfiles), len = entry_size(e);
    int how = rand_r(seed) % 20;
    memset(r, 0, sizeof *r);
    r->flags = O_RDONLY;
    x->kind = X_READ;
    if (how < 8) { /* the whole file, in the pages the kernel asks for */
        r->size = (uint32_t)((len + 4095) / 4096 * 4096);
        x->count = (uint32_t)len;
    } else if (how < 18) { /* a range */
        r->offset = (uint64_t)rand_r(seed) % len;
        r->size = 1 + (uint32_t)((uint64_t)rand_r(seed) % (len - r->offset + 100));
        x->count = (uint32_t)(r->size < len - r->offset ? r->size : len - r->offset);
    } else if (how == 18) { /* at the end or past it: Python answers */
        r->offset = len + (uint64_t)(rand_r(seed) % 3) * 4096;
        r->size = 4096;
        x->kind = X_FWD;
    } else { /* "zz", whose READs go to Python */
        e = kern.n - 1;
        r->size = 4096;
        x->kind = X_FWD;
    }
    x->e = e;
    x->off = r->offset;
    *nodeid = e + 1;
}

static void *front_sender_main(void *arg) {
    struct sender *s = arg;
    int i;
    for (i = 0; i < s->requests && !__atomic_load_n(&kern.halt, __ATOMIC_SEQ_CST); i++) {
        union {
            struct fuse_read_in read;
            struct fuse_getattr_in getattr;
            struct fuse_ioctl_in ioctl;
            struct fuse_forget_in forget;
            struct {
                struct fuse_batch_forget_in head;
                struct fuse_forget_one one[2];
            } batch;
            struct fuse_interrupt_in interrupt;
            char name[16];
        } arg;
        struct expect x = {0};
        uint64_t nodeid = 1, e, u;
        size_t arglen;
        int r = rand_r(&s->seed) % 100;
        memset(&arg, 0, sizeof arg);
        if (r < 30) {
            x.opcode = FUSE_LOOKUP;
            e = 1 + (uint64_t)(rand_r(&s->seed) % (kern.n - 1));
            x.kind = X_ENTRY;
            x.e = e;
            name_of(e, arg.name);
            if (r < 3) { /* no such name: a negative entry */
                arg.name[0] = 'g';
                x.kind = X_NEG;
            } else if (r < 5) { /* ".": libfuse's */
                memcpy(arg.name, ".", 2);
                x.kind = X_FWD;
            } else if (r < 7) { /* in a file: libfuse's */
                nodeid = 2;
                x.kind = X_FWD;
            }
            arglen = strlen(arg.name) + 1;
        } else if (r < 50) {
            x.opcode = FUSE_GETATTR;
            nodeid = 1 + (uint64_t)(rand_r(&s->seed) % kern.n);
            x.kind = X_ATTR;
            x.e = nodeid - 1;
            if (r < 32) { /* no such inode: libfuse's */
                nodeid = kern.n + 5;
                x.kind = X_FWD;
            }
            arglen = sizeof arg.getattr;
        } else if (r < 84) {
            x.opcode = FUSE_READ;
            read_request(&s->seed, &x, &nodeid, &arg.read);
            arglen = sizeof arg.read;
        } else if (r < 88) {
            x.opcode = FUSE_IOCTL; /* isatty() */
            x.kind = X_ENOSYS;
            nodeid = 2 + (uint64_t)(rand_r(&s->seed) % kern.nfiles);
            arg.ioctl.cmd = 0x5401; /* TCGETS */
            arglen = sizeof arg.ioctl;
        } else if (r < 92) {
            x.kind = X_NONE;
            nodeid = 2 + (uint64_t)(rand_r(&s->seed) % kern.nfiles);
            if (r == 88 || r == 89) {
                x.opcode = FUSE_FORGET;
                arg.forget.nlookup = 1;
                arglen = sizeof arg.forget;
            } else if (r == 90) {
                x.opcode = FUSE_BATCH_FORGET;
                arg.batch.head.count = 2;
                arg.batch.one[0] = (struct fuse_forget_one){nodeid, 1};
                arg.batch.one[1] = (struct fuse_forget_one){1, 1};
                arglen = sizeof arg.batch;
            } else {
                x.opcode = FUSE_INTERRUPT;
                arg.interrupt.unique = 1 + __atomic_load_n(&kern.sent, __ATOMIC_RELAXED);
                arglen = sizeof arg.interrupt;
            }
        } else if (r < 97) {
            x.opcode = FUSE_READDIR;
            x.kind = X_FWD;
            nodeid = rand_r(&s->seed) % 2 ? 1 : kern.n - 1;
            arg.read.size = 4096;
            arglen = sizeof arg.read;
        } else {
            x.opcode = OPCODE_UNKNOWN;
            x.kind = X_FWD;
            arglen = sizeof arg.getattr;
        }
        if ((u = expect_new(x)) == 0 ||
            send_request(u, x.opcode, nodeid, &arg, arglen, NULL, 0) != 0)
            break;
    }
    return NULL;
}

/* One session: requests from SENDERS threads; then the daemon's stop while they still come
 * (`unmount` 0), or the device gone under the front (1). */
static void front_session(int part_fd, int dfd, int errwfd, int unmount, int round) {
    uint64_t counts[FANFS_FRONT_COUNTS + 1];
    struct sender senders[SENDERS];
    struct libfuse lf = {0};
    pthread_t reader;
    int64_t until;
    int i, per = unmount ? UNMOUNT_REQUESTS : FRONT_REQUESTS;
    if (session_open() != 0 || pool_up(part_fd, dfd, errwfd) != 0) {
        fail("cannot start the %s session", unmount ? "unmount" : "front");
        return;
    }
    lf.readyfd = fanfs_front_start(kern.front, kern.sock[1], FRONT_THREADS, 0);
    if (lf.readyfd < 0 || session_init() != 0) {
        fail("the front did not start (%d) or took no INIT", lf.readyfd);
        return;
    }
    pthread_create(&reader, NULL, reader_main, NULL);
    pthread_create(&lf.thread, NULL, libfuse_main, &lf);
    for (i = 0; i < SENDERS; i++) {
        senders[i] = (struct sender){.seed = 17u * (unsigned)i + 3u + 1000u * unmount +
                                             100u * (unsigned)round,
                                     .requests = per};
        pthread_create(&senders[i].thread, NULL, front_sender_main, &senders[i]);
    }
    if (!unmount) {
        wait_sent((uint64_t)SENDERS * per * (40 + 48 * (unsigned)round / FRONT_ROUNDS) / 100);
        pthread_mutex_lock(&kern.lock);
        kern.draining = 1;
        pthread_mutex_unlock(&kern.lock);
        fanfs_front_drain(kern.front); /* pyfuse3's loop has ended */
        fanfs_pool_stop();
        fanfs_front_stop(kern.front);
        session_halt();
        for (i = 0; i < SENDERS; i++)
            pthread_join(senders[i].thread, NULL);
        pthread_join(lf.thread, NULL); /* the receiver says the session ended */
        fanfs_front_close(kern.front);
        session_unread();
        session_end_reader(reader);
        session_check(0);
    } else {
        wait_sent((uint64_t)SENDERS * per * (1 + (unsigned)round) / (UNMOUNT_ROUNDS + 1));
        __atomic_store_n(&kern.gone, 1, __ATOMIC_SEQ_CST);
        shutdown(kern.sock[0], SHUT_RDWR); /* the unmount */
        until = now_ms() + TIMEOUT_S * 1000;
        while (!__atomic_load_n(&lf.ended, __ATOMIC_SEQ_CST) && now_ms() < until)
            usleep(1000);
        if (!__atomic_load_n(&lf.ended, __ATOMIC_SEQ_CST))
            fail("the device went away and the front's receiver never said so");
        session_halt();
        for (i = 0; i < SENDERS; i++)
            pthread_join(senders[i].thread, NULL);
        pthread_join(reader, NULL); /* its recv saw the end */
        pthread_mutex_lock(&kern.lock);
        kern.draining = 1;
        pthread_mutex_unlock(&kern.lock);
        fanfs_front_drain(kern.front);
        fanfs_pool_stop();
        fanfs_front_stop(kern.front);
        pthread_join(lf.thread, NULL);
        fanfs_front_close(kern.front);
        session_check(1);
    }
    fanfs_front_counters(kern.front, counts);
    for (i = 0; i <= FANFS_FRONT_COUNTS; i++)
        kern.counts[i] += counts[i];
    fanfs_front_free(kern.front); /* the wing's front goes with its session */
    kern.front = NULL;
    close(kern.sock[0]);
    close(kern.sock[1]);
}

/* -- writes: the output wing's front ------------------------------------------------------ */

struct wsender {
    pthread_t thread;
    unsigned seed;
    int fd[2];          /* [0] written behind, [1] held below hold */
    int slow;           /* O_DSYNC: the writer waits for the disk, WRITEs queue up */
    uint64_t hold;
    char *model[2];     /* what each file must hold */
    uint64_t extent[2]; /* its size */
    int64_t low;        /* the lowest offset written behind through fd[0] */
    int64_t low_held;   /* ... through fd[1] (-1: none) */
    uint64_t behind;    /* bytes written behind */
};

/* Wait for request `u`'s reply (a WRITE the front forwards: its pwrite is libfuse's, done
 * before it answers, as a writer waits for its write() before the next). */
static void wait_reply(uint64_t u) {
    struct timespec t;
    deadline_in(&t, TIMEOUT_S);
    pthread_mutex_lock(&kern.lock);
    while (kern.x[u - 1].replies == 0 &&
           pthread_cond_timedwait(&kern.cond, &kern.lock, &t) != ETIMEDOUT)
        ;
    if (kern.x[u - 1].replies == 0)
        fail("no reply to WRITE %llu", (unsigned long long)u);
    pthread_mutex_unlock(&kern.lock);
}

static void *write_sender_main(void *arg) {
    struct wsender *s = arg;
    char *data = malloc(WRITE_MAX);
    int i;
    for (i = 0; i < WRITES && !__atomic_load_n(&kern.halt, __ATOMIC_SEQ_CST); i++) {
        struct fuse_write_in w = {0};
        struct expect x = {.kind = X_WRITE, .opcode = FUSE_WRITE};
        int f = rand_r(&s->seed) % 5 < 3 ? 0 : 1, k;
        uint64_t u;
        w.offset = (uint64_t)rand_r(&s->seed) % (1u << 20);
        if (rand_r(&s->seed) % 3 == 0)
            w.offset &= ~4095ull;
        w.size = rand_r(&s->seed) % 4 == 0 ? 1 + (uint32_t)rand_r(&s->seed) % 4096
                                           : 1 + (uint32_t)rand_r(&s->seed) % WRITE_MAX;
        w.fh = (uint64_t)s->fd[f];
        w.flags = O_WRONLY;
        for (k = 0; k < (int)w.size; k++)
            data[k] = (char)(rand_r(&s->seed) >> 7);
        x.count = w.size;
        x.fwd_write = f == 1 && w.offset < s->hold;
        if (i % 29 == 7) { /* a handle that is no fd of the daemon's: libfuse's */
            w.fh = NO_FD;
            x.fwd_write = 1;
        } else {
            memcpy(s->model[f] + w.offset, data, w.size);
            if (w.offset + w.size > s->extent[f])
                s->extent[f] = w.offset + w.size;
            if (!x.fwd_write) {
                int64_t *low = f == 0 ? &s->low : &s->low_held;
                if (*low < 0 || (int64_t)w.offset < *low)
                    *low = (int64_t)w.offset;
                s->behind += w.size;
            }
        }
        if ((u = expect_new(x)) == 0 ||
            send_request(u, FUSE_WRITE, 2, &w, sizeof w, data, w.size) != 0)
            break;
        if (x.fwd_write)
            wait_reply(u);
        if (i % 11 == 3 || i % 13 == 5) { /* forwarded once the writes before it landed */
            struct fuse_getattr_in g = {0};
            struct expect a = {.kind = X_FWD, .opcode = i % 11 == 3 ? FUSE_GETATTR : FUSE_FLUSH};
            if ((u = expect_new(a)) == 0 || send_request(u, a.opcode, 2, &g, sizeof g, NULL, 0))
                break;
        }
        if (i % 17 == 0) {
            struct fuse_forget_in fg = {1};
            struct expect a = {.kind = X_NONE, .opcode = FUSE_FORGET};
            if ((u = expect_new(a)) == 0 ||
                send_request(u, FUSE_FORGET, 2, &fg, sizeof fg, NULL, 0) != 0)
                break;
        }
    }
    free(data);
    return NULL;
}

/* The bytes of a WRITE sent while the front stops, from its unique: each checked alone. */
static char tail_byte(uint64_t u, uint32_t k) { return (char)((u * 2654435761u + k * 131) >> 5); }

static void *tail_sender_main(void *arg) {
    struct wsender *s = arg;
    char *data = malloc(TAIL_MAX);
    uint32_t k, j;
    for (k = 0; k < TAIL_WRITES && !__atomic_load_n(&kern.halt, __ATOMIC_SEQ_CST); k++) {
        struct fuse_write_in w = {0};
        struct expect x = {.kind = X_WRITE, .opcode = FUSE_WRITE, .tail = 1};
        uint64_t u;
        w.fh = (uint64_t)s->slow;
        w.offset = (uint64_t)k * TAIL_MAX;
        w.size = 1 + (uint32_t)rand_r(&s->seed) % TAIL_MAX;
        w.flags = O_WRONLY;
        x.e = w.fh, x.off = w.offset, x.count = w.size;
        if ((u = expect_new(x)) == 0)
            break;
        for (j = 0; j < w.size; j++)
            data[j] = tail_byte(u, j);
        if (send_request(u, FUSE_WRITE, 2, &w, sizeof w, data, w.size) != 0)
            break;
    }
    free(data);
    return NULL;
}

/* The output front stopped under WRITEs: every WRITE it answered is in its file. */
static void writes_stop_under_load(struct wsender *s) {
    char *got = malloc(TAIL_MAX), *want = malloc(TAIL_MAX);
    uint64_t i, answered = 0, before = __atomic_load_n(&kern.sent, __ATOMIC_SEQ_CST);
    uint32_t j;
    int t;
    for (t = 0; t < SENDERS; t++)
        pthread_create(&s[t].thread, NULL, tail_sender_main, &s[t]);
    wait_sent(before + (uint64_t)SENDERS * TAIL_WRITES / 2);
    pthread_mutex_lock(&kern.lock);
    kern.draining = 1;
    pthread_mutex_unlock(&kern.lock);
    fanfs_front_stop(kern.front);
    session_halt();
    for (t = 0; t < SENDERS; t++)
        pthread_join(s[t].thread, NULL);
    session_unread();
    session_check(0);
    for (i = 0; i < kern.nx; i++) { /* (the senders are done, the reader only counts now) */
        struct expect x;
        pthread_mutex_lock(&kern.lock);
        x = kern.x[i];
        pthread_mutex_unlock(&kern.lock);
        if (!x.tail || !x.ok)
            continue;
        answered++;
        for (j = 0; j < x.count; j++)
            want[j] = tail_byte(i + 1, j);
        if (pread((int)x.e, got, x.count, (off_t)x.off) != (ssize_t)x.count ||
            memcmp(got, want, x.count) != 0)
            fail("WRITE %llu answered before the stop, not in its file", (unsigned long long)i + 1);
    }
    if (answered == 0)
        fail("no WRITE answered while the front stopped");
    printf("front_stress: writes: %llu answered while the front stopped\n",
           (unsigned long long)answered);
    free(got);
    free(want);
}

/* Once the front stopped, every WRITE it answered is in its file: no buffer's record in the
 * kept file still says it is pending (what a recovery would write again). */
static void kept_all_written(int keepfd) {
    struct fanfs_wb_head h;
    struct fanfs_wb_rec r;
    uint32_t i;
    if (pread(keepfd, &h, sizeof h, 0) != (ssize_t)sizeof h ||
        memcmp(h.magic, FANFS_WB_MAGIC, sizeof FANFS_WB_MAGIC) != 0 ||
        h.nbufs != FANFS_WB_SLOTS + FRONT_THREADS || h.at != FANFS_WB_HEAD) {
        fail("the kept file's header is not the front's");
        return;
    }
    for (i = 0; i < h.nbufs; i++)
        if (pread(keepfd, &r, sizeof r, (off_t)(sizeof h + i * sizeof r)) != (ssize_t)sizeof r ||
            r.seq != 0)
            fail("buffer %u's record still pending after the stop (seq %llu)", i,
                 (unsigned long long)r.seq);
}

static void writes_session(const char *dir) {
    struct wsender s[SENDERS];
    struct libfuse lf = {0};
    pthread_t reader;
    uint64_t written, behind = 0;
    int i, f, keepfd;
    char path[4096], kept[4096];
    memset(s, 0, sizeof s);
    if (session_open() != 0 || (kern.front = fanfs_front_new(NULL, 1)) == NULL) {
        fail("cannot start the writes session");
        return;
    }
    for (i = 0; i < SENDERS; i++) {
        s[i].seed = 101u + (unsigned)i;
        s[i].hold = i == SENDERS - 1 ? UINT64_MAX : HOLD_AT;
        s[i].low = s[i].low_held = -1;
        for (f = 0; f < 2; f++) {
            snprintf(path, sizeof path, "%s/front-writes-%d-%d-%d", dir, (int)getpid(), i, f);
            s[i].fd[f] = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
            unlink(path);
            s[i].model[f] = calloc(1, WFILE_MAX);
            if (s[i].fd[f] < 0 || s[i].fd[f] >= FANFS_FRONT_MAX_FD || s[i].model[f] == NULL) {
                fail("cannot make %s", path);
                return;
            }
        }
        fanfs_front_hold(kern.front, s[i].fd[1], s[i].hold);
        snprintf(path, sizeof path, "%s/front-writes-%d-%d-slow", dir, (int)getpid(), i);
        s[i].slow = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_DSYNC, 0600);
        unlink(path);
        if (s[i].slow < 0 || s[i].slow >= FANFS_FRONT_MAX_FD) {
            fail("cannot make %s", path);
            return;
        }
        for (f = 0; f < 2; f++)
            fanfs_front_take_written(kern.front, s[i].fd[f]); /* what an fd of this number had */
    }
    written = fanfs_front_written(kern.front);
    /* The buffers in a file, as the output daemon keeps them (writes.c, "Kept"). */
    snprintf(kept, sizeof kept, "%s/front-writes-%d-kept", dir, (int)getpid());
    keepfd = open(kept, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (keepfd < 0 || fanfs_front_keep_writes(kern.front, keepfd) != 0) {
        fail("cannot keep the writes' buffers in %s", kept);
        return;
    }
    lf.readyfd = fanfs_front_start(kern.front, kern.sock[1], FRONT_THREADS, 0);
    if (lf.readyfd < 0 || session_init() != 0) {
        fail("the writes front did not start (%d) or took no INIT", lf.readyfd);
        return;
    }
    pthread_create(&reader, NULL, reader_main, NULL);
    pthread_create(&lf.thread, NULL, libfuse_main, &lf);
    for (i = 0; i < SENDERS; i++)
        pthread_create(&s[i].thread, NULL, write_sender_main, &s[i]);
    for (i = 0; i < SENDERS; i++)
        pthread_join(s[i].thread, NULL);
    session_check(0);
    fanfs_front_settle(kern.front);
    for (i = 0; i < SENDERS; i++) {
        char *got = malloc(WFILE_MAX);
        struct stat st;
        for (f = 0; f < 2; f++) {
            int64_t low = fanfs_front_take_written(kern.front, s[i].fd[f]);
            int64_t want = f ? s[i].low_held : s[i].low;
            if (fstat(s[i].fd[f], &st) != 0 || (uint64_t)st.st_size != s[i].extent[f] ||
                pread(s[i].fd[f], got, s[i].extent[f], 0) != (ssize_t)s[i].extent[f] ||
                memcmp(got, s[i].model[f], s[i].extent[f]) != 0)
                fail("file %d.%d (%s): not what its WRITEs wrote (%lld bytes of %llu)", i, f,
                     f ? "held" : "behind", (long long)st.st_size,
                     (unsigned long long)s[i].extent[f]);
            if (low != want)
                fail("file %d.%d: lowest offset written behind %lld, not %lld", i, f,
                     (long long)low, (long long)want);
            if (fanfs_front_take_error(kern.front, s[i].fd[f]) != 0)
                fail("file %d.%d: a write failed", i, f);
        }
        behind += s[i].behind;
        free(got);
    }
    if (fanfs_front_written(kern.front) - written != behind)
        fail("%llu bytes written behind, not %llu",
             (unsigned long long)(fanfs_front_written(kern.front) - written),
             (unsigned long long)behind);
    printf("front_stress: writes: %llu requests, %llu bytes written behind\n",
           (unsigned long long)kern.nx, (unsigned long long)behind);
    writes_stop_under_load(s);
    kept_all_written(keepfd);
    close(keepfd);
    unlink(kept);
    pthread_join(lf.thread, NULL);
    fanfs_front_close(kern.front);
    session_end_reader(reader);
    for (i = 0; i < SENDERS; i++)
        for (f = 0; f < 2; f++) {
            fanfs_front_hold(kern.front, s[i].fd[f], 0);
            close(s[i].fd[f]);
            free(s[i].model[f]);
        }
    fanfs_front_free(kern.front);
    kern.front = NULL;
    for (i = 0; i < SENDERS; i++)
        close(s[i].slow);
    close(kern.sock[0]);
    close(kern.sock[1]);
}

/* -- the checks ---------------------------------------------------------------------------- */

/* The pool posted no failure: every READ of the front was answered from the disk. */
static void no_failures(int errfd) {
    struct {
        int64_t entry;
        int32_t err, pad;
    } rec;
    while (read(errfd, &rec, sizeof rec) == (ssize_t)sizeof rec)
        fail("the pool failed a READ of entry %lld: %s", (long long)rec.entry,
             strerror(rec.err));
}

int front_stress(const char *dir, int part_fd, int errfd, int errwfd,
                 const struct stress_file *files, int nfiles, const char *parts) {
    uint64_t counts[FANFS_FRONT_COUNTS + 1];
    char path[4096];
    int dfd = -1, round;
    char drain[256];
    signal(SIGPIPE, SIG_IGN); /* a socket's EPIPE, where /dev/fuse gives ENODEV */
    while (read(errfd, drain, sizeof drain) > 0)
        ; /* what the pool's own checks posted */
    kern.files = files;
    kern.nfiles = nfiles < 100 ? nfiles : 99;
    kern.n = (uint64_t)kern.nfiles + 3;
    kern.xcap = (uint64_t)SENDERS * (FRONT_REQUESTS + 4 * WRITES + TAIL_WRITES) + 64;
    kern.x = calloc(kern.xcap, sizeof *kern.x);
    if (kern.nfiles < 2 || kern.x == NULL || catalog_make() != 0) {
        fprintf(stderr, "front_stress: no files or no memory\n");
        return 1;
    }
    snprintf(path, sizeof path, "%s/part.bin", dir);
    dfd = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (dfd >= 0 && !fanfs_direct_ok(dfd)) {
        close(dfd);
        dfd = -1;
    }
    if (parts == NULL || strstr(parts, "front") != NULL) {
        for (round = 0; round < FRONT_ROUNDS; round++)
            front_session(part_fd, dfd, errwfd, 0, round);
        memcpy(counts, kern.counts, sizeof counts);
        if (kern.read_ok < 100 || counts[FANFS_FRONT_READS] < 100 ||
            counts[FANFS_FRONT_LOOKUPS] == 0 || counts[FANFS_FRONT_GETATTRS] == 0 ||
            counts[FANFS_FRONT_OTHERS] == 0 || kern.fwd_ok == 0 || kern.drained == 0)
            fail("too little answered: %llu READs checked, %llu forwards, %llu drained",
                 (unsigned long long)kern.read_ok, (unsigned long long)kern.fwd_ok,
                 (unsigned long long)kern.drained);
        printf("front_stress: front: %d rounds, %llu READs checked, %llu forwards answered, "
               "%llu drained, %llu never read\n", FRONT_ROUNDS, (unsigned long long)kern.read_ok,
               (unsigned long long)kern.fwd_ok, (unsigned long long)kern.drained,
               (unsigned long long)kern.unread);
        for (round = 0; round < UNMOUNT_ROUNDS; round++)
            front_session(part_fd, dfd, errwfd, 1, round);
        no_failures(errfd);
    }
    if (parts == NULL || strstr(parts, "writes") != NULL)
        writes_session(dir);
    if (dfd >= 0)
        close(dfd);
    catalog_free();
    free(kern.x);
    return failures;
}
