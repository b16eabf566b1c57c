/*
 * The front (fanfs_native.h): threads that take FUSE requests from the kernel themselves and
 * answer those the catalog and this node's disk alone answer, with no Python and no event
 * loop between the kernel and the disk.
 *
 * Why: a request answered through pyfuse3 costs a wake-up of the event loop (epoll, trio), a
 * run through its session loop and, for a READ, a hand-off to a pool thread; on a cold small
 * file that is most of what fanfs adds to the disk read. Here FRONT_THREADS threads take turns
 * on the FUSE device (one leader reads it, the others wait for their turn: "taking requests"
 * below) and answer, in the thread that read the request:
 *   LOOKUP    from the catalog (names are sorted within each directory: a binary search),
 *             and the file's read or fetch starts (fanfs_pool_looked_up);
 *   GETATTR   from the catalog;
 *   READ      of a file stored whole in a partition staged here (the pool's job, run in
 *             this thread: read, check, decode, reply, push the rest), or held by a peer
 *             (fetched by the MPI thread into the pool's cache, this thread waiting for it);
 *   (while a planned epoch runs, the files looked up and read are recorded for Python,
 *   which follows the job through its plan with them: fanfs_front_follow)
 *   IOCTL     ENOSYS, as libfuse answers it (the kernel makes it ENOTTY; Python's open()
 *             asks every file whether it is a terminal);
 *   FORGET, BATCH_FORGET, INTERRUPT: nothing to do (fanfs keeps no per-inode state, and
 *             pyfuse3 does nothing with interrupts).
 * In writes mode (fanfs_front_writes, for `fanfs output`), it answers only
 *   WRITE     at once, its bytes queued for a pwrite to the file handle, which the output
 *             daemon makes the fd of the file's local copy (writes.c: writes behind);
 *   FORGET, BATCH_FORGET, INTERRUPT as above;
 * and forwards the rest once the queued writes are in their files.
 * Everything else (INIT first, READDIR, the status attribute, framed and large files, files
 * whose bytes a planned epoch read ahead and holds in Python; in writes mode, all but WRITE)
 * is forwarded: queued, and handed to pyfuse3's session
 * loop through its receiver hook (fanfs_front_receive), which waits for the queue's eventfd
 * instead of the FUSE device. A request is answered on the device it was read from, and
 * forwarded ones are read from the session's own fd, so libfuse's replies land right.
 *
 * Replies and pushes are written here as the kernel's protocol says (linux/fuse.h): one
 * writev per message, which the kernel takes whole from any thread.
 *
 * Concurrency: the catalog's columns are immutable; the enable flag and the per-partition fds
 * are the pool's (atomics); the forward queue and the leader's turn have their own lock.
 * fanfs_front_stop wakes the followers (front.turn) and the leader (an eventfd its epoll also
 * watches), and joins them; the FUSE fd is the
 * session's and stays open until pyfuse3 closes it, after the stop.
 */
#define _GNU_SOURCE
#define FUSE_USE_VERSION 35
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <linux/fuse.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "fanfs_native.h"

#define FRONT_MAX_THREADS 32

/* A forwarded request: its bytes, as read, aligned as the buffer they were read into (the
 * drain reads their fuse_in_header in place). */
struct fwd {
    struct fwd *next;
    uint32_t len;
    _Alignas(struct fuse_in_header) char data[];
};

static struct {
    struct fanfs_meta m;
    int fd;       /* the FUSE session's fd (non-blocking) */
    int stopfd;   /* eventfd: written once, to stop every thread */
    int readyfd;  /* eventfd: readable while forwarded requests wait (or the session ended) */
    int ep;       /* the epoll the leader waits in: the FUSE fd and stopfd */
    int nthreads, running, ended;
    int minor;            /* the kernel's protocol minor, 0 until its INIT (-1: not major 7) */
    uint32_t major, kminor; /* as its INIT said them */
    uint64_t kflags;      /* the flags the kernel offered at INIT (flags2 in the high half) */
    int why;              /* FANFS_FRONT_WHY_*: why the front forwards everything */
    size_t bufsize;       /* fanfs_front_bufsize(), fixed while running */
    long page;            /* the page size it is sized from (0: the machine's) */
    int pretend;          /* rewrite the INIT to protocol 7.pretend (tests; 0: no) */
    int stopping, led;    /* led: a thread leads (takes requests) */
    int draining;         /* pyfuse3's loop has ended: what would be forwarded fails */
    int64_t spin_ns, last_ns; /* the leader's poll after a request; when the last came */
    uint64_t waits;       /* times the leader slept in epoll (not caught by the poll) */
    pthread_t threads[FRONT_MAX_THREADS];
    pthread_mutex_t lock; /* the queue, `ended`, the lead */
    pthread_cond_t turn;  /* the lead is free */
    struct fwd *head, *tail;
    uint64_t counts[FANFS_FRONT_COUNTS];
    int writes;              /* writes mode: WRITE answered, everything else forwarded */
} front = {.fd = -1, .stopfd = -1, .readyfd = -1, .ep = -1, .lock = PTHREAD_MUTEX_INITIALIZER,
         .turn = PTHREAD_COND_INITIALIZER};

static void count(int what) { __atomic_add_fetch(&front.counts[what], 1, __ATOMIC_RELAXED); }

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* The last FANFS_FRONT_SAMPLES READs' times, from taking the request to the reply, in
 * microseconds (a ring; fanfs status takes percentiles of it), and the longest ever. */
static struct {
    uint32_t us[FANFS_FRONT_SAMPLES];
    uint64_t n;
    uint32_t longest;
} lat;

static void took(int64_t began) {
    int64_t us = (now_ns() - began) / 1000;
    uint32_t v = us > UINT32_MAX ? UINT32_MAX : us < 0 ? 0 : (uint32_t)us;
    uint64_t k = __atomic_fetch_add(&lat.n, 1, __ATOMIC_RELAXED);
    uint32_t old = __atomic_load_n(&lat.longest, __ATOMIC_RELAXED);
    __atomic_store_n(&lat.us[k % FANFS_FRONT_SAMPLES], v, __ATOMIC_RELAXED);
    while (v > old && !__atomic_compare_exchange_n(&lat.longest, &old, v, 0, __ATOMIC_RELAXED,
                                                   __ATOMIC_RELAXED))
        ;
}

int fanfs_front_latencies(uint32_t out[FANFS_FRONT_SAMPLES], uint32_t *longest) {
    uint64_t n = __atomic_load_n(&lat.n, __ATOMIC_RELAXED), i;
    if (n > FANFS_FRONT_SAMPLES)
        n = FANFS_FRONT_SAMPLES;
    for (i = 0; i < n; i++)
        out[i] = __atomic_load_n(&lat.us[i], __ATOMIC_RELAXED);
    *longest = __atomic_load_n(&lat.longest, __ATOMIC_RELAXED);
    return (int)n;
}

/* -- the kernel's protocol ----------------------------------------------------------------- */

int fanfs_raw_reply(int fd, uint64_t unique, int err, const struct iovec *iov, int n) {
    struct iovec all[FANFS_MAX_PIECES + 2];
    struct fuse_out_header out;
    size_t len = sizeof out;
    int i;
    if (n < 0 || n > FANFS_MAX_PIECES + 1)
        return -EINVAL;
    for (i = 0; i < n; i++) {
        all[i + 1] = iov[i];
        len += iov[i].iov_len;
    }
    out.len = (uint32_t)len;
    out.error = err ? -err : 0;
    out.unique = unique;
    all[0].iov_base = &out;
    all[0].iov_len = sizeof out;
    if (err)
        n = 0, out.len = sizeof out;
    /* ENOENT: the request was interrupted and is gone; nothing else to do either way. */
    return writev(fd, all, n + 1) < 0 ? -errno : 0;
}

int fanfs_raw_notify_store(int fd, uint64_t ino, uint64_t off, const void *data, uint32_t len) {
    struct fuse_out_header out;
    struct fuse_notify_store_out st;
    struct iovec iov[3];
    out.len = sizeof out + sizeof st + len;
    out.error = FUSE_NOTIFY_STORE;
    out.unique = 0;
    memset(&st, 0, sizeof st);
    st.nodeid = ino;
    st.offset = off;
    st.size = len;
    iov[0] = (struct iovec){&out, sizeof out};
    iov[1] = (struct iovec){&st, sizeof st};
    iov[2] = (struct iovec){(void *)data, len};
    return writev(fd, iov, 3) < 0 ? -errno : 0;
}

/* -- the catalog ---------------------------------------------------------------------------- */

static uint64_t col64(const char *col, uint64_t e) {
    uint64_t v;
    memcpy(&v, col + e * sizeof v, sizeof v);
    return le64toh(v);
}

static uint32_t col32(const char *col, uint64_t e) {
    uint32_t v;
    memcpy(&v, col + e * sizeof v, sizeof v);
    return le32toh(v);
}

static void fill_attr(uint64_t e, struct fuse_attr *a) {
    const struct fanfs_meta *m = &front.m;
    uint64_t size = col64(m->size, e);
    int64_t t = (int64_t)col64(m->mtime, e);
    int64_t sec = t / 1000000000, nsec = t % 1000000000;
    if (nsec < 0) { /* before 1970: the nanoseconds count forwards from a whole second */
        nsec += 1000000000;
        sec -= 1;
    }
    memset(a, 0, sizeof *a);
    a->ino = e + 1;
    a->size = size;
    a->blocks = col64(m->blocks, e);
    a->atime = a->mtime = a->ctime = (uint64_t)sec;
    a->atimensec = a->mtimensec = a->ctimensec = (uint32_t)nsec;
    a->mode = col32(m->mode, e);
    a->nlink = m->nlink[e];
    a->uid = m->uid;
    a->gid = m->gid;
    a->blksize = m->blksize;
}

int fanfs_meta_set(const struct fanfs_meta *m) {
    if (front.running)
        return -EBUSY;
    front.m = *m;
    return 0;
}

int fanfs_meta_attr(uint64_t e, uint64_t out[12]) {
    struct fuse_attr a;
    if (front.m.n == 0 || e >= front.m.n)
        return -1;
    fill_attr(e, &a);
    out[0] = a.ino, out[1] = a.size, out[2] = a.blocks, out[3] = a.mtime;
    out[4] = a.mtimensec, out[5] = a.mode, out[6] = a.nlink, out[7] = a.uid;
    out[8] = a.gid, out[9] = a.blksize, out[10] = a.atime, out[11] = a.ctime;
    return 0;
}

int64_t fanfs_meta_lookup(uint64_t parent, const char *name, size_t len) {
    const struct fanfs_meta *m = &front.m;
    uint64_t lo, hi;
    if (parent >= m->n || !S_ISDIR(col32(m->mode, parent)))
        return -1;
    lo = col32(m->child_start, parent);
    hi = lo + col32(m->child_count, parent);
    if (hi > m->n)
        return -1;
    while (lo < hi) { /* names sorted by their bytes, a prefix before what extends it */
        uint64_t mid = lo + (hi - lo) / 2, off = col64(m->name_off, mid);
        uint32_t nlen = col32(m->name_len, mid);
        int c;
        if (off > m->strings_len || nlen > m->strings_len - off)
            return -1; /* the catalog was checked at load; never trust it further */
        c = memcmp(m->strings + off, name, nlen < len ? nlen : len);
        if (c == 0)
            c = nlen < len ? -1 : nlen > len ? 1 : 0;
        if (c == 0)
            return (int64_t)mid;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return -2; /* no such name */
}

/* -- what a planned epoch follows ---------------------------------------------------------- */

/* The files the front looked up and READ from their start, in order, while a planned epoch
 * follows them (fanfs_front_follow): the job's position in its plan moves with them. The
 * record is bounded; past FOLLOW_MAX, new ones are counted as lost (the plan then moves with
 * the job's progress messages alone until Python catches up). */
#define FOLLOW_MAX 16384
static struct {
    pthread_mutex_t lock;
    int efd; /* eventfd written when the record stops being empty; -1: not following */
    uint64_t e[FOLLOW_MAX];
    uint32_t head, n;
    uint64_t lost;
} follow = {.lock = PTHREAD_MUTEX_INITIALIZER, .efd = -1};

void fanfs_front_follow(int efd) {
    pthread_mutex_lock(&follow.lock);
    __atomic_store_n(&follow.efd, efd, __ATOMIC_RELAXED);
    follow.head = follow.n = 0;
    pthread_mutex_unlock(&follow.lock);
}

static void followed(uint64_t e, int read) {
    uint64_t one = 1;
    ssize_t w;
    if (__atomic_load_n(&follow.efd, __ATOMIC_RELAXED) < 0)
        return;
    pthread_mutex_lock(&follow.lock);
    if (follow.efd >= 0) {
        if (follow.n == FOLLOW_MAX) {
            follow.lost++;
        } else {
            follow.e[(follow.head + follow.n) % FOLLOW_MAX] = e | (read ? FANFS_FOLLOW_READ : 0);
            if (follow.n++ == 0) {
                w = write(follow.efd, &one, sizeof one);
                (void)w;
            }
        }
    }
    pthread_mutex_unlock(&follow.lock);
}

int fanfs_front_followed(uint64_t *out, int max, uint64_t *lost) {
    int k = 0;
    pthread_mutex_lock(&follow.lock);
    while (k < max && follow.n > 0) {
        out[k++] = follow.e[follow.head];
        follow.head = (follow.head + 1) % FOLLOW_MAX;
        follow.n--;
    }
    *lost = follow.lost;
    pthread_mutex_unlock(&follow.lock);
    return k;
}

/* -- requests ------------------------------------------------------------------------------- */

static int reply_entry(const struct fuse_in_header *in, int64_t e) {
    struct fuse_entry_out out;
    struct iovec iov = {&out, sizeof out};
    memset(&out, 0, sizeof out);
    out.entry_valid = out.attr_valid = front.m.timeout_s;
    if (e >= 0) { /* else a negative entry, cached as long: the tree never changes */
        out.nodeid = (uint64_t)e + 1;
        fill_attr((uint64_t)e, &out.attr);
    }
    count(FANFS_FRONT_LOOKUPS);
    fanfs_raw_reply(front.fd, in->unique, 0, &iov, 1);
    return 0;
}

/* 0: answered; -1: Python answers it. */
static int lookup(const struct fuse_in_header *in, const char *arg, uint32_t arglen) {
    const struct fanfs_meta *m = &front.m;
    int64_t e;
    size_t len = strnlen(arg, arglen);
    uint32_t part;
    if (len == arglen || len == 0 || in->nodeid < 1)
        return -1; /* no NUL in the request, or an empty name: libfuse's answer is the rule */
    if ((len == 1 && arg[0] == '.') || (len == 2 && arg[0] == '.' && arg[1] == '.'))
        return -1;
    e = fanfs_meta_lookup(in->nodeid - 1, arg, len);
    if (e == -1)
        return -1;
    if (e == -2)
        return reply_entry(in, -1);
    if (S_ISREG(col32(m->mode, (uint64_t)e))) {
        part = col32(m->part, (uint64_t)e);
        if (part < m->nparts && !m->part_local[part] && !fanfs_remote_on())
            return -1; /* a peer's file, no remote path here: Python starts its fetch now */
        fanfs_pool_looked_up((uint64_t)e + 1);
        reply_entry(in, e);
        followed((uint64_t)e, 0);
        return 0;
    }
    return reply_entry(in, e);
}

static int getattr(const struct fuse_in_header *in) {
    struct fuse_attr_out out;
    struct iovec iov = {&out, sizeof out};
    if (in->nodeid < 1 || in->nodeid - 1 >= front.m.n)
        return -1;
    memset(&out, 0, sizeof out);
    out.attr_valid = front.m.timeout_s;
    fill_attr(in->nodeid - 1, &out.attr);
    count(FANFS_FRONT_GETATTRS);
    fanfs_raw_reply(front.fd, in->unique, 0, &iov, 1);
    return 0;
}

static int read_(const struct fuse_in_header *in, const struct fuse_read_in *r) {
    int64_t began = now_ns();
    if (fanfs_pool_fast_answer(front.fd, in->unique, in->nodeid, (int64_t)r->offset,
                               r->size) != 0)
        return -1;
    took(began);
    count(FANFS_FRONT_READS);
    if (r->offset == 0)
        followed(in->nodeid - 1, 1);
    return 0;
}

/* Writes mode: WRITE goes to the writes-behind queue (writes.c); anything else waits until
 * the queue is empty, then is forwarded. */
static int answer_writes(char **bufp, uint32_t n) {
    const struct fuse_in_header *in = (const void *)*bufp;
    switch (in->opcode) {
    case FUSE_WRITE:
        if (fanfs_writes_take(front.fd, bufp, n) == 0) {
            count(FANFS_FRONT_OTHERS);
            return 0;
        }
        break;
    case FUSE_FORGET:
    case FUSE_BATCH_FORGET:
    case FUSE_INTERRUPT:
        return 0;
    default:
        break;
    }
    fanfs_writes_settle();
    return -1;
}

int fanfs_front_writes(int on) {
    if (front.running)
        return -EBUSY;
    front.writes = on != 0;
    return 0;
}

/* Answer what this thread can; 0 if it did, -1 to forward. */
static int answer(const char *msg, uint32_t n) {
    const struct fuse_in_header *in = (const void *)msg;
    const char *arg = msg + sizeof *in;
    uint32_t arglen = n - sizeof *in;
    if (!fanfs_pool_fast_on())
        return -1; /* off (not started, or no fast path): Python sees everything */
    switch (in->opcode) {
    case FUSE_LOOKUP:
        return lookup(in, arg, arglen);
    case FUSE_GETATTR:
        return getattr(in);
    case FUSE_READ:
        if (arglen < sizeof(struct fuse_read_in))
            return -1;
        return read_(in, (const void *)arg);
    case FUSE_IOCTL:
        count(FANFS_FRONT_OTHERS);
        fanfs_raw_reply(front.fd, in->unique, ENOSYS, NULL, 0);
        return 0;
    case FUSE_FORGET:
    case FUSE_BATCH_FORGET:
    case FUSE_INTERRUPT:
        count(FANFS_FRONT_OTHERS);
        return 0; /* no reply: these have none */
    default:
        return -1;
    }
}

/* Fail a request nobody will answer (FORGET and the like have no reply). */
static void fail(const char *msg, int err) {
    const struct fuse_in_header *in = (const void *)msg;
    if (in->opcode != FUSE_FORGET && in->opcode != FUSE_BATCH_FORGET &&
        in->opcode != FUSE_INTERRUPT)
        fanfs_raw_reply(front.fd, in->unique, err, NULL, 0);
}

static void forward(const char *msg, uint32_t n) {
    struct fwd *f;
    uint64_t one = 1;
    ssize_t w;
    if (__atomic_load_n(&front.draining, __ATOMIC_ACQUIRE)) {
        fail(msg, EIO); /* pyfuse3's loop has ended: nobody would answer it */
        return;
    }
    f = malloc(sizeof *f + n);
    if (f == NULL) {
        fail(msg, ENOMEM);
        return;
    }
    f->next = NULL;
    f->len = n;
    memcpy(f->data, msg, n);
    pthread_mutex_lock(&front.lock);
    if (front.draining) { /* the drain came in between: it would never see this one */
        pthread_mutex_unlock(&front.lock);
        fail(msg, EIO);
        free(f);
        return;
    }
    if (front.tail != NULL) {
        front.tail->next = f;
    } else {
        front.head = f;
        w = write(front.readyfd, &one, sizeof one);
        (void)w;
    }
    front.tail = f;
    front.counts[FANFS_FRONT_FORWARDED]++;
    pthread_mutex_unlock(&front.lock);
}

static void end_session(void) {
    uint64_t one = 1;
    ssize_t w;
    pthread_mutex_lock(&front.lock);
    front.ended = 1;
    w = write(front.readyfd, &one, sizeof one); /* stays readable: every loop task ends */
    (void)w;
    pthread_mutex_unlock(&front.lock);
}

/* -- taking requests: a leader and its followers ----------------------------------------------
 * One thread at a time, the leader, takes requests from the device; the others wait for their
 * turn. The leader answers what cannot block (a lookup, attributes, a forward) and goes on
 * leading; before a READ, which may wait for the disk, it hands the lead to a follower. So
 * the thread that takes a request is the one that answers it (no hand-off between threads on
 * the way to the disk), several READs are read at once, and only one thread waits on the
 * device. After a request the leader polls the device for a while before it sleeps
 * (FANFS_SPIN_US): the next request of a reader usually comes within microseconds, and on a
 * VM a halted CPU costs hundreds of microseconds to wake. It does not poll while threads wait
 * for a CPU (the kernel's CPU pressure): then polling takes a core from the readers. */

/* Whether threads waited for a CPU in more than a tenth of the last ~100 ms (/proc/pressure/cpu
 * "some"). Read at most every 100 ms, by one caller at a time (the others take the last
 * answer); a reading more than 200 ms old is only a new baseline (what happened while nobody
 * asked says nothing about now). 0 when the kernel has no PSI. */
int fanfs_cpu_pressed(void) {
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    static int64_t last_ns, last_stall_us = -1;
    static int pressed;
    int64_t now = now_ns(), stall_us;
    char buf[256], *at;
    ssize_t n;
    int fd, was;
    if (now - __atomic_load_n(&last_ns, __ATOMIC_RELAXED) < 100000000 ||
        pthread_mutex_trylock(&lock) != 0)
        return __atomic_load_n(&pressed, __ATOMIC_RELAXED);
    was = pressed;
    if (now - last_ns >= 100000000) {
        stall_us = -1;
        fd = open("/proc/pressure/cpu", O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            n = read(fd, buf, sizeof buf - 1);
            close(fd);
            if (n > 0) {
                buf[n] = 0;
                at = strstr(buf, "total=");
                if (at != NULL)
                    stall_us = strtoll(at + 6, NULL, 10);
            }
        }
        was = stall_us >= 0 && last_stall_us >= 0 && now - last_ns <= 200000000 &&
              (stall_us - last_stall_us) * 1000 * 10 > (now - last_ns);
        last_stall_us = stall_us;
        __atomic_store_n(&pressed, was, __ATOMIC_RELAXED);
        __atomic_store_n(&last_ns, now, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&lock);
    return was;
}

/* As the leader: the next request into `buf` (front.bufsize), 0 to stop, -1 once the session
 * has ended (unmounted, or the kernel refused the buffer: front.why says so). */
static ssize_t take(char *buf, int ep) {
    struct epoll_event ev[2];
    int64_t until = front.last_ns + front.spin_ns;
    int spin = front.spin_ns > 0 && !fanfs_cpu_pressed();
    for (;;) {
        ssize_t n;
        int i, got;
        /* A stop ends the taking at once, not at the next pause of a steady stream: what is
         * still in the device is pyfuse3's again (the output wing's loop runs on), or the
         * unmount's, which fails it (the dataset wing, whose loop has ended). */
        if (__atomic_load_n(&front.stopping, __ATOMIC_ACQUIRE))
            return 0;
        n = read(front.fd, buf, front.bufsize);
        if (n > 0) {
            front.last_ns = now_ns();
            return n;
        }
        if (n < 0 && (errno == EINTR || errno == ENOENT))
            continue; /* ENOENT: a request interrupted before it was read */
        if (n < 0 && errno == EINVAL) /* smaller than a WRITE of max_write: libfuse fails too */
            __atomic_store_n(&front.why, FANFS_FRONT_WHY_BUFFER, __ATOMIC_RELAXED);
        if (n == 0 || errno != EAGAIN)
            return -1; /* ENODEV: unmounted */
        if (__atomic_load_n(&front.stopping, __ATOMIC_ACQUIRE))
            return 0;
        if (spin && now_ns() < until) {
            sched_yield();
            continue;
        }
        got = epoll_wait(ep, ev, 2, -1);
        for (i = 0; i < got; i++)
            if (ev[i].data.fd == front.stopfd)
                return 0;
        front.waits++;
    }
}

/* -- the kernel's INIT --------------------------------------------------------------------
 * Its layout grew with the protocol: 7.6 to 7.35 send major, minor, max_readahead and flags
 * (16 bytes); 7.36 and later add flags2 and reserved words (64 bytes). Only major and minor
 * are needed here: every reply the front writes (entry, attr, read, write, notify_store) has
 * kept its 7.12 layout since, and what depends on a feature the kernel may lack (max_pages,
 * no_open, ...) is negotiated by libfuse, which answers the INIT. RHEL 8 (4.18) speaks 7.27,
 * RHEL 9 and SLES 15 (5.14) 7.33, Ubuntu 22.04 (5.15) 7.34, 6.8 7.39. */

/* The INIT's layout, declared here: a build machine's linux/fuse.h is as old as its kernel
 * (RHEL 8's has neither flags2 nor FUSE_INIT_EXT), and the wire layout never changes. */
struct init_in {
    uint32_t major, minor, max_readahead, flags; /* 7.6 to 7.35: these 16 bytes */
    uint32_t flags_hi, unused[11];               /* 7.36 and later: flags2 */
};
#define INIT_OLD_SIZE 16
#define INIT_EXT (1u << 30) /* FUSE_INIT_EXT: flags2 is there */

/* The protocol minor each INIT flag bit first appeared in (linux/fuse.h's changelog; 0: 7.12
 * or older; 0xff: unknown, dropped by a rewrite). */
static const uint8_t flag_since[64] = {
    [7] = 14, [8] = 14, [9] = 14, [10] = 17, [11] = 18,
    [12] = 20, [13] = 21, [14] = 21, [15] = 22, [16] = 23, [17] = 23, [18] = 25, [19] = 26,
    [20] = 26, [21] = 27, [22] = 28, [23] = 28, [24] = 29, [25] = 30, [26] = 31, [27] = 32,
    [28] = 33, [29] = 33, [30] = 36, [31] = 36, [32] = 36, [33] = 36, [34] = 38, [35] = 38,
    [36] = 39, [37] = 40, [38] = 40, [39] = 40, [40] = 40, [41] = 42, [42 ... 63] = 0xff};

static uint64_t init_flags(const struct init_in *init, size_t len) {
    uint64_t f = init->flags;
    if (init->minor >= 36 && len >= sizeof *init && (f & INIT_EXT))
        f |= (uint64_t)init->flags_hi << 32;
    return f;
}

/* Rewrite the INIT in `buf` (`n` bytes) as a kernel of protocol 7.front.pretend would send
 * it: its minor, only the flags that protocol has, its layout. The new length. */
static ssize_t pretend_init(char *buf, ssize_t n) {
    struct fuse_in_header *in = (void *)buf;
    struct init_in *init = (void *)(buf + sizeof *in);
    uint64_t flags, keep = 0;
    int bit, minor = front.pretend;
    if ((size_t)n < sizeof *in + INIT_OLD_SIZE || init->major != 7 || init->minor <= minor)
        return n;
    flags = init_flags(init, (size_t)n - sizeof *in);
    for (bit = 0; bit < 64; bit++)
        if (flag_since[bit] <= minor)
            keep |= 1ULL << bit;
    flags &= keep;
    init->minor = (uint32_t)minor;
    init->flags = (uint32_t)flags;
    if (minor >= 36 && (size_t)n >= sizeof *in + sizeof *init) {
        init->flags_hi = (uint32_t)(flags >> 32);
        return n;
    }
    in->len = sizeof *in + INIT_OLD_SIZE;
    return (ssize_t)in->len;
}

static void saw_init(const char *buf, ssize_t n) {
    const struct init_in *init = (const void *)(buf + sizeof(struct fuse_in_header));
    size_t len = (size_t)n - sizeof(struct fuse_in_header);
    if (len < INIT_OLD_SIZE)
        return; /* no kernel sends this: forwarded, libfuse answers it */
    front.major = init->major;
    front.kminor = init->minor;
    front.kflags = init_flags(init, len);
    /* Replies here are laid out for 7.12 and later (every kernel since 2.6.29); an older
     * one, or another major, is answered by libfuse alone for the life of the mount. */
    if (init->major != 7 || init->minor < 12)
        __atomic_store_n(&front.why, FANFS_FRONT_WHY_PROTOCOL, __ATOMIC_RELAXED);
    __atomic_store_n(&front.minor, init->major == 7 ? (int)init->minor : -1, __ATOMIC_RELEASE);
}

void fanfs_front_kernel(uint64_t out[5]) {
    int minor = __atomic_load_n(&front.minor, __ATOMIC_ACQUIRE);
    out[0] = minor ? front.major : 0;
    out[1] = minor ? front.kminor : 0;
    out[2] = minor ? front.kflags : 0;
    out[3] = (uint64_t)__atomic_load_n(&front.why, __ATOMIC_RELAXED);
    out[4] = fanfs_front_bufsize();
}

static size_t bufsize_for(long page) { return (size_t)(page > 0 ? page : 4096) * 256 + 4096; }

static size_t libfuse_bufsize(void) { return bufsize_for(sysconf(_SC_PAGESIZE)); }

size_t fanfs_front_bufsize(void) {
    return front.page > 0 ? bufsize_for(front.page) : libfuse_bufsize();
}

int fanfs_front_pretend(int minor, long page) {
    if (front.running)
        return -EBUSY;
    if (minor < 0 || page < 0 || (page & (page - 1)) != 0 || page > (1L << 20))
        return -EINVAL;
    front.pretend = minor;
    front.page = page;
    return 0;
}

static void handle(char **bufp, ssize_t n) {
    char *buf = *bufp;
    const struct fuse_in_header *in = (const void *)buf;
    if ((size_t)n < sizeof *in || in->len != (uint32_t)n)
        return; /* the kernel never sends this */
    if (in->opcode == FUSE_INIT) {
        if (front.pretend)
            n = pretend_init(buf, n);
        saw_init(buf, n);
    }
    if (__atomic_load_n(&front.minor, __ATOMIC_ACQUIRE) < 12) {
        if (front.writes)
            fanfs_writes_settle();
        forward(buf, (uint32_t)n);
    } else if (front.writes ? answer_writes(bufp, (uint32_t)n) != 0
                            : answer(buf, (uint32_t)n) != 0) {
        forward(*bufp, (uint32_t)n);
    }
}

static void *front_main(void *arg) {
    char *buf = malloc(front.bufsize);
    int leading = 0;
    (void)arg;
    if (buf == NULL)
        return NULL;
    for (;;) {
        const struct fuse_in_header *in = (const void *)buf;
        ssize_t n;
        if (!leading) {
            pthread_mutex_lock(&front.lock);
            while (front.led && !front.stopping)
                pthread_cond_wait(&front.turn, &front.lock);
            leading = !front.stopping;
            front.led |= leading;
            pthread_mutex_unlock(&front.lock);
            if (!leading)
                break;
        }
        n = take(buf, front.ep);
        if (n <= 0) {
            if (n < 0)
                end_session();
            pthread_mutex_lock(&front.lock);
            front.led = 0;
            pthread_cond_broadcast(&front.turn);
            pthread_mutex_unlock(&front.lock);
            break;
        }
        if ((size_t)n >= sizeof *in && in->opcode == FUSE_READ) {
            pthread_mutex_lock(&front.lock); /* a READ may wait for the disk: lead on, someone */
            front.led = 0;
            pthread_cond_signal(&front.turn);
            pthread_mutex_unlock(&front.lock);
            leading = 0;
        }
        handle(&buf, n);
    }
    free(buf);
    return NULL;
}

/* -- life ------------------------------------------------------------------------------------ */

int fanfs_front_start(int fd, int nthreads, int spin_us) {
    struct epoll_event ev;
    sigset_t all, old;
    int i, err = 0;
    if (front.running)
        return -EBUSY;
    if (nthreads < 1 || nthreads > FRONT_MAX_THREADS || (front.m.n == 0 && !front.writes) ||
        spin_us < 0)
        return -EINVAL;
    /* Non-blocking: the leader polls it, and must never sleep in a read that a stop cannot
     * wake (pyfuse3's loop makes it so too, but only once it runs). */
    if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) != 0)
        return -errno;
    front.fd = fd;
    front.ended = front.minor = front.stopping = front.led = front.draining = front.why = 0;
    front.major = front.kminor = 0;
    front.kflags = 0;
    front.bufsize = fanfs_front_bufsize();
    front.spin_ns = (int64_t)spin_us * 1000;
    front.stopfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    front.readyfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    front.ep = epoll_create1(EPOLL_CLOEXEC);
    if (front.stopfd < 0 || front.readyfd < 0 || front.ep < 0) {
        err = -errno;
        goto fail;
    }
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (epoll_ctl(front.ep, EPOLL_CTL_ADD, fd, &ev) != 0) {
        err = -errno;
        goto fail;
    }
    ev.data.fd = front.stopfd;
    if (epoll_ctl(front.ep, EPOLL_CTL_ADD, front.stopfd, &ev) != 0) {
        err = -errno;
        goto fail;
    }
    if (front.writes && (err = fanfs_writes_start()) != 0)
        goto fail;
    sigfillset(&all); /* signals stay with the interpreter's thread */
    pthread_sigmask(SIG_BLOCK, &all, &old);
    for (i = 0; i < nthreads; i++) {
        if (pthread_create(&front.threads[i], NULL, front_main, NULL) != 0)
            break;
        front.nthreads++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (front.nthreads == 0) {
        fanfs_writes_stop();
        err = -EAGAIN;
        goto fail;
    }
    front.running = 1;
    return front.readyfd;
fail:
    if (front.stopfd >= 0)
        close(front.stopfd);
    if (front.readyfd >= 0)
        close(front.readyfd);
    if (front.ep >= 0)
        close(front.ep);
    front.stopfd = front.readyfd = front.ep = -1;
    return err;
}

int fanfs_front_receive(void *session, struct fuse_buf *buf) {
    struct fwd *f;
    uint64_t v;
    ssize_t r;
    pthread_mutex_lock(&front.lock);
    f = front.head;
    if (f == NULL) {
        int ended = front.ended || !front.running;
        if (!ended) /* empty: not readable until the next forward */
            r = read(front.readyfd, &v, sizeof v), (void)r;
        pthread_mutex_unlock(&front.lock);
        if (ended && session != NULL)
            fuse_session_exit(session); /* as libfuse's own receive does at ENODEV */
        return ended ? 0 : -EAGAIN;
    }
    front.head = f->next;
    if (front.head == NULL)
        front.tail = NULL;
    pthread_mutex_unlock(&front.lock);
    /* libfuse may read into this buffer itself later (once the front is gone): its size, at
     * least, which for the machine's page is fanfs_front_bufsize's too */
    if (buf->mem == NULL && (buf->mem = malloc(front.bufsize > libfuse_bufsize()
                                                   ? front.bufsize
                                                   : libfuse_bufsize())) == NULL) {
        free(f);
        return -ENOMEM;
    }
    memcpy(buf->mem, f->data, f->len);
    buf->size = f->len;
    buf->flags = 0;
    free(f);
    return (int)buf->size;
}

ssize_t fanfs_front_forwarded(void *out, size_t cap) {
    struct fuse_buf b;
    if (cap < front.bufsize)
        return -EINVAL;
    memset(&b, 0, sizeof b);
    b.mem = out;
    return fanfs_front_receive(NULL, &b);
}

void fanfs_front_drain(void) {
    struct fwd *f;
    pthread_mutex_lock(&front.lock);
    __atomic_store_n(&front.draining, 1, __ATOMIC_RELEASE);
    while ((f = front.head) != NULL) {
        front.head = f->next;
        fail(f->data, EIO);
        free(f);
    }
    front.tail = NULL;
    pthread_mutex_unlock(&front.lock);
}

void fanfs_front_stop(void) {
    uint64_t one = 1;
    ssize_t w;
    int i;
    if (!front.running)
        return;
    pthread_mutex_lock(&front.lock);
    __atomic_store_n(&front.stopping, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&front.turn);
    pthread_mutex_unlock(&front.lock);
    w = write(front.stopfd, &one, sizeof one); /* the leader, asleep in epoll */
    (void)w;
    for (i = 0; i < front.nthreads; i++)
        pthread_join(front.threads[i], NULL);
    front.nthreads = 0;
    fanfs_writes_stop(); /* what is queued goes into its files first */
    fanfs_front_drain();
    pthread_mutex_lock(&front.lock);
    front.running = 0;
    w = write(front.readyfd, &one, sizeof one); /* wake a loop task waiting for the queue */
    (void)w;
    pthread_mutex_unlock(&front.lock);
    close(front.stopfd);
    close(front.ep);
    front.stopfd = front.ep = -1;
}

void fanfs_front_close(void) {
    if (front.running || front.readyfd < 0)
        return;
    close(front.readyfd);
    front.readyfd = -1;
}

void fanfs_front_counters(uint64_t out[FANFS_FRONT_COUNTS + 1]) {
    int i;
    for (i = 0; i < FANFS_FRONT_COUNTS; i++)
        out[i] = __atomic_load_n(&front.counts[i], __ATOMIC_RELAXED);
    out[FANFS_FRONT_WAITS] = __atomic_load_n(&front.waits, __ATOMIC_RELAXED);
}
