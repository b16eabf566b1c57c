/*
 * The native read pool (fanfs_native.h): threads that answer FUSE READs without the GIL.
 *
 * Why: answering a READ of a file that is not in the page cache through the event loop costs
 * a thread hand-off (a trio worker thread, the GIL, a wake-up back to the loop) on top of the
 * disk read. Here the event loop only queues a job (pyfuse3's read hook, fanfs/_native.pyx)
 * and returns; threads that never touch the GIL read the stored pieces, check, decode and
 * reply themselves (libfuse replies are thread-safe).
 *
 * Pieces asked for in parts (a file larger than one READ, the frames of a framed file) go
 * through a small cache of decoded pieces shared by the threads, so each is read and decoded
 * once. A READ that needs a piece another thread is reading does not wait for it: it is hung
 * on the piece and queued again when the piece is there, so the thread goes on with other
 * READs (four threads waiting for each other's disk reads would leave the disk idle).
 *
 * Pushes: the kernel sends buffered READs of at most the mount's readahead (128 KiB unless
 * root raises it), so a 2 MiB file is 16 round trips. When a job decodes a piece afresh and
 * says so (FANFS_JOB_PUSH), what the READ did not ask for of that piece is pushed into the
 * kernel's page cache with notify_store, by one pusher thread: the rest of the file is then
 * read from the page cache with no round trip at all. The pusher is a thread of its own
 * because notify_store waits for page locks that the kernel holds for READs in flight, which
 * the pool's threads answer: a pool thread must never wait for it.
 */
#define _GNU_SOURCE
#define FUSE_USE_VERSION 35
#include <endian.h>
#include <errno.h>
#include <fuse_lowlevel.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fanfs_native.h"
#include "pieces.h"
#include "pool_int.h"

#define MAX_THREADS 64
#define AHEAD_MAX 64 /* queued read-aheads at most; beyond, the stalest is dropped */
#define PUSH_MAX 64       /* queued pushes; beyond, a piece is not pushed (the kernel READs it) */

static int is_read(const struct qjob *qj) { return qj->t.req != NULL || qj->t.fd >= 0; }

static void reply_iov(const struct target *t, const struct iovec *iov, int n) {
    if (t->req != NULL)
        fuse_reply_iov(t->req, iov, n);
    else
        fanfs_raw_reply(t->fd, t->unique, 0, iov, n);
}

static void reply_err(const struct target *t, int err) {
    if (t->req != NULL)
        fuse_reply_err(t->req, err);
    else
        fanfs_raw_reply(t->fd, t->unique, err, NULL, 0);
}

/* -- the cache of decoded pieces (pieces.h) ---------------------------------------------- */
static struct pieces cache = PIECES_INIT;

static struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    struct qjob *head, *tail;             /* READs */
    struct qjob *ahead_head, *ahead_tail; /* read-aheads: taken when no READ waits */
    int nahead;
    pthread_t threads[MAX_THREADS];
    int nthreads, stopping, errfd;
    uint64_t jobs;
    /* The dictionaries (a reference of the pool's). A job takes a reference of its own for as
     * long as it decodes (dicts_hold): a new set may come at any time. dlock is taken alone,
     * never with another lock held. */
    pthread_mutex_t dlock;
    struct fanfs_dicts *dicts; /* protected by dlock */
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER, .errfd = -1,
          .dlock = PTHREAD_MUTEX_INITIALIZER};

/* The dictionaries to decode with, held until fanfs_dicts_free. */
static struct fanfs_dicts *dicts_hold(void) {
    struct fanfs_dicts *d;
    pthread_mutex_lock(&pool.dlock);
    d = fanfs_dicts_ref(pool.dicts);
    pthread_mutex_unlock(&pool.dlock);
    return d;
}

struct push {
    struct fuse_session *se; /* through libfuse, or NULL: written to `fd` */
    int fd;
    uint64_t ino;
    int slot;
    int64_t pos; /* where the slot's decoded bytes start in the file */
    uint32_t from, to;
};

static struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    struct push q[PUSH_MAX];
    int first, n, running;
    pthread_t thread;
    uint64_t pushes, bytes, skipped;
} push = {.lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER};

/* After a job: the thread's own buffers (fanfs_tls: stored bytes read for a decode, a decoded
 * whole file) kept for the next within codec.c's bounds, or freed. */
static void thread_buffers_trim(void) {
    struct fanfs_tls *t = fanfs_tls();
    if (t != NULL) {
        fanfs_tbuf_settle(&t->stored);
        fanfs_tbuf_settle(&t->out);
    }
}

/* Put READs hung on a piece back at the front of the queue (their piece is there now, or
 * failed: they read it themselves). */
static void requeue(struct qjob *w) {
    struct qjob *last;
    if (w == NULL)
        return;
    for (last = w; last->next != NULL; last = last->next)
        ;
    pthread_mutex_lock(&pool.lock);
    last->next = pool.head;
    pool.head = w;
    if (pool.tail == NULL)
        pool.tail = last;
    pthread_cond_broadcast(&pool.cond);
    pthread_mutex_unlock(&pool.lock);
}

static void slot_fill(int i, char *buf, uint32_t cap, const char *data) {
    requeue(pieces_ready(&cache, i, buf, cap, data));
}

/* -- pieces ------------------------------------------------------------------------------- */

/* Read, check and decode a piece into a buffer of its own (*buf, from piece_alloc); *data
 * points at its decoded bytes. A raw piece is read straight into it (no copy). */
static int load_piece(const struct fanfs_job *j, const struct fanfs_piece *p,
                      const struct fanfs_dicts *dicts, char **buf, uint32_t *cap,
                      const char **data) {
    int err;
    const char *at;
    struct fanfs_tls *t;
    if (p->kind == FANFS_KIND_RAW) {
        if (p->len != p->size)
            return FANFS_EBADDATA;
        *buf = pieces_alloc(&cache, (uint64_t)p->len + 2 * FANFS_DIRECT_ALIGN, cap);
        if (*buf == NULL)
            return ENOMEM;
        err = fanfs_read_stored(j->fd, j->dfd, p, buf, cap, &at);
        *data = at;
        return err;
    }
    if ((t = fanfs_tls()) == NULL)
        return ENOMEM;
    err = fanfs_read_stored(j->fd, j->dfd, p, &t->stored.buf, &t->stored.cap, &at);
    if (err != 0)
        return err;
    *buf = pieces_alloc(&cache, p->size, cap);
    if (*buf == NULL)
        return ENOMEM;
    *data = *buf;
    return fanfs_decode(dicts, p, (const unsigned char *)at, (unsigned char *)*buf);
}

/* A piece's decoded bytes for a reply. */
struct got {
    const char *data;
    int slot;      /* >= 0: a cache slot, referenced */
    char *own;     /* else a buffer of its own (NULL: a thread buffer) */
    uint32_t cap;
    int fresh;     /* read and decoded for this job */
};

static int remote_piece(const struct fanfs_job *j, const struct fanfs_piece *p, struct got *g);

/* A piece asked for whole and not cached: read and decoded into the thread's own buffers
 * (several pieces: a buffer of its own each). */
static int piece_alone(const struct fanfs_job *j, const struct fanfs_piece *p,
                       const struct fanfs_dicts *dicts, struct got *g) {
    struct fanfs_tls *t;
    const char *at;
    uint32_t cap = 0;
    int err;
    if ((t = fanfs_tls()) == NULL)
        return ENOMEM;
    err = fanfs_read_stored(j->fd, j->dfd, p, &t->stored.buf, &t->stored.cap, &at);
    if (err != 0)
        return err;
    g->fresh = 1;
    if (p->kind == FANFS_KIND_RAW) {
        g->data = at;
        return p->len == p->size ? 0 : FANFS_EBADDATA;
    }
    if (j->npieces == 1) {
        if (p->size > t->out.cap || t->out.buf == NULL) {
            char *n = fanfs_alloc(p->size, &cap);
            if (n == NULL)
                return ENOMEM;
            free(t->out.buf); /* (its count is redone when it is settled) */
            t->out.buf = n;
            t->out.cap = cap;
        }
        g->data = t->out.buf;
    } else {
        if ((g->own = pieces_alloc(&cache, p->size, &g->cap)) == NULL)
            return ENOMEM;
        g->data = g->own;
    }
    return fanfs_decode(dicts, p, (const unsigned char *)at, (unsigned char *)g->data);
}

/* Piece k of job j: 0 with *g filled, an errno, or WAITING when `qj` (a READ of the pool) was
 * hung on the piece because another thread is reading it. Without `qj` the caller waits. */
static int piece_get(struct qjob *qj, const struct fanfs_job *j, int k,
                     const struct fanfs_dicts *dicts, struct got *g) {
    const struct fanfs_piece *p = &j->pieces[k];
    struct pieces_wait how = {.hang = qj};
    int i = -1, err, got, unpushed;
    char *buf = NULL;
    uint32_t cap = 0;
    const char *data = NULL;

    g->slot = -1;
    g->own = NULL;
    g->fresh = 0;
    if (j->fd <= FANFS_REMOTE_FD(0))
        return remote_piece(j, p, g); /* a peer's file: the MPI thread fetches it */
    pthread_mutex_lock(&cache.lock);
    got = pieces_get_locked(&cache, j->fd, p, &how, &i, &unpushed);
    if (got == PIECES_ABSENT && p->cache) {
        cache.misses++;
        i = pieces_reserve_locked(&cache, j->fd, p, 1, 0, 0); /* -1: no room, read alone */
    }
    pthread_mutex_unlock(&cache.lock);
    if (got == PIECES_HUNG)
        return WAITING;
    if (got == PIECES_HIT) {
        /* A piece read ahead at LOOKUP: this first READ pushes the rest. (One asked for whole
         * is there only when read ahead at its LOOKUP: the kernel keeps it, nothing to push.) */
        g->fresh = p->cache ? unpushed : 0;
        g->slot = i;
        g->data = cache.slot[i].data;
        return 0;
    }
    if (!p->cache) /* a file asked for whole: nobody asks for it again (the kernel keeps it) */
        return piece_alone(j, p, dicts, g);
    err = load_piece(j, p, dicts, &buf, &cap, &data);
    if (err != 0) {
        if (buf != NULL)
            pieces_free(&cache, buf, cap);
        if (i >= 0)
            slot_fill(i, NULL, 0, NULL);
        return err;
    }
    g->fresh = 1;
    g->data = data;
    if (i >= 0) {
        slot_fill(i, buf, cap, data);
        g->slot = i;
    } else {
        g->own = buf; /* no room in the cache: this reply's alone */
        g->cap = cap;
    }
    return 0;
}

static void piece_done(struct got *g) {
    if (g->slot >= 0)
        pieces_release(&cache, g->slot);
    else if (g->own != NULL)
        pieces_free(&cache, g->own, g->cap);
}

/* -- pushes ------------------------------------------------------------------------------- */

/* Queue a push of bytes [from, to) of slot i (a reference taken for it). */
static void push_queue(const struct target *t, uint64_t ino, int i, int64_t pos, uint32_t from,
                       uint32_t to) {
    if (to <= from || (t->se == NULL && t->fd < 0))
        return;
    pthread_mutex_lock(&push.lock);
    if (push.running && push.n < PUSH_MAX) {
        struct push *q = &push.q[(push.first + push.n) % PUSH_MAX];
        *q = (struct push){t->se, t->fd, ino, i, pos, from, to};
        push.n++;
        pieces_ref(&cache, i);
        pthread_cond_signal(&push.cond);
    } else {
        push.skipped++;
    }
    pthread_mutex_unlock(&push.lock);
}

static void *pusher_main(void *arg) {
    (void)arg;
    pthread_mutex_lock(&push.lock);
    for (;;) {
        struct push q;
        struct fuse_bufvec bv = FUSE_BUFVEC_INIT(0);
        while (push.n == 0 && push.running)
            pthread_cond_wait(&push.cond, &push.lock);
        if (push.n == 0)
            break;
        q = push.q[push.first];
        push.first = (push.first + 1) % PUSH_MAX;
        push.n--;
        pthread_mutex_unlock(&push.lock);
        bv.buf[0].size = q.to - q.from;
        bv.buf[0].mem = (void *)(cache.slot[q.slot].data + q.from);
        /* ENOENT (the kernel forgot the inode) and the like: the kernel READs it instead. */
        if ((q.se != NULL
                 ? fuse_lowlevel_notify_store(q.se, q.ino, (off_t)(q.pos + q.from), &bv, 0)
                 : fanfs_raw_notify_store(q.fd, q.ino, (uint64_t)(q.pos + q.from), bv.buf[0].mem,
                                          q.to - q.from)) == 0) {
            pthread_mutex_lock(&push.lock);
            push.pushes++;
            push.bytes += q.to - q.from;
            pthread_mutex_unlock(&push.lock);
        }
        pieces_release(&cache, q.slot);
        pthread_mutex_lock(&push.lock);
    }
    pthread_mutex_unlock(&push.lock);
    return NULL;
}

/* After a reply: push what [lo, hi) of the file did not cover of each piece decoded afresh. */
static void push_rest(const struct target *t, const struct fanfs_job *j, struct got *got,
                      const int *held) {
    int k;
    int64_t pos = j->base, lo = j->base + j->skip, hi = lo + j->count;
    for (k = 0; k < j->npieces; k++) {
        int64_t end = pos + j->pieces[k].size;
        if (held[k] && got[k].fresh && got[k].slot >= 0) {
            if (lo > pos)
                push_queue(t, j->ino, got[k].slot, pos, 0, (uint32_t)((lo < end ? lo : end) - pos));
            if (hi < end)
                push_queue(t, j->ino, got[k].slot, pos, (uint32_t)((hi > pos ? hi : pos) - pos),
                           j->pieces[k].size);
        }
        pos = end;
    }
}

/* -- jobs --------------------------------------------------------------------------------- */

int fanfs_job_check(const struct fanfs_job *j) {
    int i, n = j->npieces;
    uint64_t total = 0;
    if (n < 1 || n > FANFS_MAX_PIECES || j->base < 0)
        return -1;
    for (i = 0; i < n; i++) {
        const struct fanfs_piece *p = &j->pieces[i];
        if (p->size == 0 || p->size > FANFS_PIECE_MAX || p->len > FANFS_PIECE_MAX || p->off < 0)
            return -1;
        total += p->size;
    }
    if (j->skip > total || j->count > total - j->skip)
        return -1;
    /* The range starts in the first piece and ends in the last: a job names only the pieces
     * it needs. */
    if (n > 1 && j->count &&
        (j->skip >= j->pieces[0].size || j->skip + j->count <= total - j->pieces[n - 1].size))
        return -1;
    return 0;
}

/* Gather bytes [skip, skip + count) of job j's pieces into iov (pieces in got, held[k] set
 * for those read). 0, an errno, or WAITING. */
static int gather(struct qjob *qj, const struct fanfs_job *j, const struct fanfs_dicts *dicts,
                  struct got *got, int *held, struct iovec *iov, int *niov) {
    int k, err;
    uint64_t at = 0, lo = j->skip, hi = (uint64_t)j->skip + j->count;
    *niov = 0;
    for (k = 0; k < j->npieces; k++) {
        uint64_t end = at + j->pieces[k].size;
        if (end > lo && at < hi) { /* only the pieces holding some of [lo, hi) are read */
            uint64_t a = lo > at ? lo - at : 0, b = (hi < end ? hi : end) - at;
            err = piece_get(qj, j, k, dicts, &got[k]);
            if (err != 0)
                return err;
            held[k] = 1;
            iov[*niov].iov_base = (void *)(got[k].data + a);
            iov[*niov].iov_len = b - a;
            (*niov)++;
        }
        at = end;
    }
    return 0;
}

/* The fast path's table (fanfs_pool_fast_set) and its state. */
static struct {
    struct fanfs_fast_table t;
    int on;
    int *fd, *dfd;  /* per partition, -1 until staged */
    uint8_t *bad;   /* per entry: a job failed, Python answers from now on */
    uint8_t *plan;  /* per entry: FANFS_PLAN_HELD, FANFS_PLAN_AHEAD (fanfs_pool_plan_mark) */
    int32_t *owners; /* per partition, FANFS_MAX_OWNERS ranks holding it (-1: none) */
    uint8_t *remote; /* per partition: held by peers only (fanfs_pool_fast_owners) */
    uint64_t taken;
} fast;

/* -- a peer's files: fetched by the MPI thread into the cache of pieces -------------------------
 * A READ the front takes of a file a peer holds (stored whole, up to FANFS_REMOTE_MAX) is
 * answered from the cache of pieces like a local one: the piece's slot is reserved (pending)
 * and a request for it queued here, the MPI thread takes it (fanfs_remote_take, woken through
 * `rq.wakefd`), fetches the stored bytes from a holder and hands them back
 * (fanfs_remote_fill: checked and decoded in C, the slot filled, the READ that waits on it
 * woken), so neither Python's event loop nor a hand-off to it is on the way. When no holder
 * can give it (fanfs_remote_fail), the READ goes to Python after all, which tries every source
 * and the image. A lookup of such a file reserves its piece too (reads at LOOKUP), at most
 * LA_REMOTE_MAX at a time.
 *
 * A silent peer must not freeze the mount: a READ waits for a peer's piece at most `wait_ns`
 * (then Python answers it, with its own peer timeout and the image), and at most `max_waiting`
 * READs wait at once (the front's threads less one, set by the MPI transport): the others go
 * to Python at once, so a front thread is always left to answer local files. When the remote
 * path goes off, or the pool stops, every pending peer's piece is given up. */
#define RQ_MAX 256
#define LA_REMOTE_MAX 8

static struct {
    pthread_mutex_t lock;
    struct fanfs_rreq q[RQ_MAX];
    int first, n;
    int wakefd; /* the MPI thread's eventfd; -1: no remote path */
    int on;
    int max_waiting; /* READs that may wait for peers' pieces at once (0: no limit) */
    int64_t wait_ns; /* how long one may wait (0: no limit) */
    uint64_t fetched, failed, looked_up;
} rq = {.lock = PTHREAD_MUTEX_INITIALIZER, .wakefd = -1};

/* Queue the fetch of slot i's piece (cache lock held: the lock order is cache, then rq); 0,
 * or -1 when the queue is full or the remote path is off. */
static int rq_push_locked(int i, const struct fanfs_job *j, const struct fanfs_piece *p, int ahead) {
    uint64_t one = 1;
    ssize_t w;
    uint32_t part = (uint32_t)(FANFS_REMOTE_FD(0) - j->fd);
    int k;
    struct fanfs_rreq *r;
    pthread_mutex_lock(&rq.lock);
    if (!rq.on || rq.n == RQ_MAX || fast.owners == NULL || part >= fast.t.nparts) {
        pthread_mutex_unlock(&rq.lock);
        return -1;
    }
    r = &rq.q[(rq.first + rq.n) % RQ_MAX];
    r->slot = i;
    r->entry = j->entry;
    r->part = part;
    r->off = p->off;
    r->len = p->len;
    r->crc = p->crc;
    r->ahead = ahead;
    for (k = 0; k < FANFS_MAX_OWNERS; k++)
        r->peers[k] = fast.owners[part * FANFS_MAX_OWNERS + k];
    rq.n++;
    w = write(rq.wakefd, &one, sizeof one);
    (void)w;
    pthread_mutex_unlock(&rq.lock);
    return 0;
}

/* Reserve a pending slot for a peer's piece and queue its fetch, cache lock held throughout
 * (let go in between, the slot could be settled by a stop and taken by another piece before
 * a failed push gave it up). The slot's index, or -1 (no room, the queue is full, or the pool
 * is stopping). Nobody holds a reference to it: a READ waiting for it takes one once it is
 * filled, as for any piece. */
static int remote_reserve_locked(const struct fanfs_job *j, const struct fanfs_piece *p,
                                 int ahead) {
    int i;
    if (!__atomic_load_n(&fast.on, __ATOMIC_ACQUIRE)) /* a stop gave up what was pending */
        return -1;
    /* Nobody pushed it: its first READ pushes the rest. */
    if ((i = pieces_reserve_locked(&cache, j->fd, p, 0, 1, ahead)) < 0)
        return -1;
    if (rq_push_locked(i, j, p, ahead) != 0) {
        pieces_ready_locked(&cache, i, NULL, 0, NULL); /* nobody could hang on it meanwhile */
        return -1;
    }
    return i;
}

/* A peer's piece for a READ of the front (which may wait, within the limits above):
 * FANFS_EREMOTE when it cannot be had here in time (the READ then goes to Python). */
static int remote_piece(const struct fanfs_job *j, const struct fanfs_piece *p, struct got *g) {
    int i, got, unpushed, mine = -1;
    int64_t wait_ns = __atomic_load_n(&rq.wait_ns, __ATOMIC_RELAXED), end;
    struct timespec deadline;
    struct pieces_wait how = {.counted = 1, .deadline = wait_ns > 0 ? &deadline : NULL};
    if (wait_ns > 0) { /* on CLOCK_MONOTONIC: a wall clock's step changes nothing */
        clock_gettime(CLOCK_MONOTONIC, &deadline);
        end = (int64_t)deadline.tv_sec * 1000000000 + deadline.tv_nsec + wait_ns;
        deadline.tv_sec = (time_t)(end / 1000000000);
        deadline.tv_nsec = (long)(end % 1000000000);
    }
    pthread_mutex_lock(&cache.lock);
    for (;;) {
        how.limit = __atomic_load_n(&rq.max_waiting, __ATOMIC_RELAXED);
        got = pieces_get_locked(&cache, j->fd, p, &how, &i, &unpushed);
        if (got == PIECES_HIT) {
            pthread_mutex_unlock(&cache.lock);
            g->fresh = unpushed;
            g->slot = i;
            g->data = cache.slot[i].data;
            return 0;
        }
        /* Not had in time, or ours was given up (no holder could give it) or, rarely,
         * evicted; or nobody may wait: Python answers (as when the pool is stopping:
         * remote_reserve_locked refuses). */
        if (got == PIECES_GAVE_UP || mine >= 0 || !pieces_may_wait_locked(&cache, how.limit))
            break;
        cache.misses++;
        if ((mine = remote_reserve_locked(j, p, 0)) < 0)
            break;
    }
    pthread_mutex_unlock(&cache.lock);
    return FANFS_EREMOTE;
}

/* Give up every pending peer's piece: their READs go to Python. */
static void remote_fail_pending(void) {
    struct qjob *w = NULL, *more, *last;
    int i;
    pthread_mutex_lock(&cache.lock);
    for (i = 0; i < PIECES_SLOTS; i++)
        if (cache.slot[i].pending && cache.slot[i].fd <= FANFS_REMOTE_FD(0)) {
            more = pieces_ready_locked(&cache, i, NULL, 0, NULL);
            if (more != NULL) {
                for (last = more; last->next != NULL; last = last->next)
                    ;
                last->next = w;
                w = more;
            }
            __atomic_add_fetch(&rq.failed, 1, __ATOMIC_RELAXED);
        }
    pthread_mutex_unlock(&cache.lock);
    requeue(w);
}

int fanfs_remote_on(void) { return __atomic_load_n(&rq.on, __ATOMIC_ACQUIRE); }

void fanfs_remote_set_wake(int fd, int max_waiting, int64_t wait_ns) {
    pthread_mutex_lock(&rq.lock);
    rq.wakefd = fd;
    __atomic_store_n(&rq.max_waiting, max_waiting, __ATOMIC_RELAXED);
    __atomic_store_n(&rq.wait_ns, wait_ns, __ATOMIC_RELAXED);
    __atomic_store_n(&rq.on, fd >= 0, __ATOMIC_RELEASE);
    if (fd < 0)
        rq.n = 0; /* nothing will be fetched any more */
    pthread_mutex_unlock(&rq.lock);
    if (fd < 0)
        remote_fail_pending(); /* the READs waiting go to Python */
}

int fanfs_remote_take(struct fanfs_rreq *out, int max) {
    int n = 0;
    pthread_mutex_lock(&rq.lock);
    while (n < max && rq.n > 0) {
        out[n] = rq.q[rq.first];
        rq.first = (rq.first + 1) % RQ_MAX;
        rq.n--;
        n++;
    }
    pthread_mutex_unlock(&rq.lock);
    return n;
}

/* Whether slot r->slot still waits for r's piece (cache lock held). */
static int rq_pending_locked(const struct fanfs_rreq *r) {
    const struct pieces_slot *s;
    if (r->slot < 0 || r->slot >= PIECES_SLOTS)
        return 0;
    s = &cache.slot[r->slot];
    return s->pending && s->fd == FANFS_REMOTE_FD(r->part) && s->off == r->off &&
           s->len == r->len && s->crc == r->crc;
}

int fanfs_remote_fill(const struct fanfs_rreq *r, const char *stored, uint32_t len) {
    struct fanfs_piece p;
    struct qjob *w;
    char *buf;
    uint32_t cap = 0;
    int err;
    pthread_mutex_lock(&cache.lock);
    err = rq_pending_locked(r) ? 0 : ESTALE;
    if (err == 0) {
        p.off = r->off;
        p.len = r->len;
        p.crc = r->crc;
        p.size = cache.slot[r->slot].size;
        p.kind = cache.slot[r->slot].kind;
        p.cache = 1;
    }
    pthread_mutex_unlock(&cache.lock);
    if (err != 0)
        return err;
    if (len != r->len)
        return FANFS_EBADDATA;
    if (fanfs_crc32(0, stored, len) != r->crc)
        return FANFS_EBADCRC; /* a bad copy: the MPI thread asks another holder */
    buf = pieces_alloc(&cache, p.size, &cap);
    if (buf == NULL)
        return ENOMEM;
    if (p.kind == FANFS_KIND_RAW) {
        err = p.len == p.size ? (memcpy(buf, stored, p.size), 0) : FANFS_EBADDATA;
    } else {
        struct fanfs_dicts *dicts = dicts_hold();
        err = fanfs_decode(dicts, &p, (const unsigned char *)stored, (unsigned char *)buf);
        fanfs_dicts_free(dicts);
    }
    if (err != 0) {
        pieces_free(&cache, buf, cap);
        return err;
    }
    /* Checked again: a hedged fetch's other copy, or a stop, may have settled it meanwhile. */
    pthread_mutex_lock(&cache.lock);
    if (!rq_pending_locked(r)) {
        pieces_free_locked(&cache, buf, cap);
        pthread_mutex_unlock(&cache.lock);
        return ESTALE;
    }
    w = pieces_ready_locked(&cache, r->slot, buf, cap, buf);
    pthread_mutex_unlock(&cache.lock);
    requeue(w);
    __atomic_add_fetch(&rq.fetched, 1, __ATOMIC_RELAXED);
    return 0;
}

int fanfs_remote_pending(const struct fanfs_rreq *r) {
    int pending;
    pthread_mutex_lock(&cache.lock);
    pending = rq_pending_locked(r);
    pthread_mutex_unlock(&cache.lock);
    return pending;
}

void fanfs_remote_fail(const struct fanfs_rreq *r) {
    struct qjob *w = NULL;
    pthread_mutex_lock(&cache.lock);
    if (rq_pending_locked(r)) {
        w = pieces_ready_locked(&cache, r->slot, NULL, 0, NULL);
        __atomic_add_fetch(&rq.failed, 1, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&cache.lock);
    requeue(w);
}

void fanfs_remote_counters(uint64_t out[3]) {
    out[0] = __atomic_load_n(&rq.fetched, __ATOMIC_RELAXED);
    out[1] = __atomic_load_n(&rq.failed, __ATOMIC_RELAXED);
    out[2] = __atomic_load_n(&rq.looked_up, __ATOMIC_RELAXED);
}

/* Whether a failure is the stored bytes' own (a failed check or decode: every later read
 * fails the same way), not the moment's (ENOMEM, EIO from the disk, EINTR, EAGAIN, ...: the
 * READ is answered with an error, and the next one tries again). */
static int bad_data(int err) { return err == FANFS_EBADCRC || err == FANFS_EBADDATA; }

static void post_error(int64_t entry, int err) {
    /* A full pipe loses the record; a bad file is still answered EIO on every read. */
    struct {
        int64_t entry;
        int32_t err, pad;
    } rec = {entry, err, 0};
    ssize_t posted;
    if (bad_data(err) && fast.bad != NULL && entry >= 0 && (uint64_t)entry < fast.t.n)
        __atomic_store_n(&fast.bad[entry], 1, __ATOMIC_RELAXED);
    posted = pool.errfd >= 0 ? write(pool.errfd, &rec, sizeof rec) : 0;
    (void)posted;
}

/* Answer a READ: 0, or WAITING when `qj` (a queued READ; NULL: the caller waits instead)
 * was hung on a piece another thread is reading. `t` and `j` must not point into `qj`: once
 * it is hung, the thread that settles the piece owns it (requeues it, and another thread
 * answers and frees it), so this one never touches it again. A queued READ is always answered
 * (nobody else can); one of the front's (`qj` NULL) that needs a peer's piece it cannot have
 * is left to Python (FANFS_EREMOTE). */
static int answer(struct qjob *qj, const struct target *t, const struct fanfs_job *j) {
    struct got got[FANFS_MAX_PIECES];
    struct iovec iov[FANFS_MAX_PIECES];
    int held[FANFS_MAX_PIECES] = {0}, niov, k, err;
    struct fanfs_dicts *dicts = dicts_hold();

    err = gather(qj, j, dicts, got, held, iov, &niov);
    fanfs_dicts_free(dicts);
    if (err == WAITING || err == FANFS_EREMOTE) {
        for (k = 0; k < j->npieces; k++) /* let go of what it holds; it starts over */
            if (held[k])
                piece_done(&got[k]);
        if (err == WAITING || qj == NULL)
            return err; /* WAITING: queued again when its piece is read; EREMOTE: to Python */
        reply_err(t, EIO); /* a queued READ of a peer's piece: Python has no request to answer */
        return 0;
    }
    if (err == 0) {
        reply_iov(t, iov, niov);
        if ((j->flags & FANFS_JOB_PUSH) && j->ino != 0)
            push_rest(t, j, got, held);
    }
    for (k = 0; k < j->npieces; k++)
        if (held[k])
            piece_done(&got[k]);
    if (err != 0) {
        reply_err(t, EIO);
        post_error(j->entry, err);
    }
    return 0;
}

static void run_read(struct qjob *qj) {
    /* Copies: if the READ is hung on a piece, qj is another thread's from then on. */
    struct target t = qj->t;
    struct fanfs_job j = qj->j;
    if (answer(qj, &t, &j) != WAITING)
        free(qj); /* else it is hung on a piece: queued again when the piece is read */
}

static int lookahead_wanted(uint64_t ino);

/* READs answered by fanfs_pool_fast_answer right now: the pool's stop waits for them before
 * it frees the cache they may hold pieces of. */
static int answering;

int fanfs_pool_fast_answer(int fd, uint64_t unique, uint64_t ino, int64_t off, uint64_t size) {
    struct target t = {NULL, NULL, fd, unique};
    struct fanfs_job j;
    int err;
    __atomic_add_fetch(&answering, 1, __ATOMIC_SEQ_CST); /* before the check of fast.on */
    if (fanfs_pool_fast_job(ino, off, size, &j) != 0) {
        __atomic_sub_fetch(&answering, 1, __ATOMIC_SEQ_CST);
        return -1;
    }
    err = answer(NULL, &t, &j);
    thread_buffers_trim();
    __atomic_sub_fetch(&answering, 1, __ATOMIC_SEQ_CST);
    return err == FANFS_EREMOTE ? -1 : 0;
}

/* A read-ahead: decode each piece nobody holds into the cache (and push it, if asked). */
static void run_ahead(struct qjob *qj) {
    const struct fanfs_job *j = &qj->j;
    int k, slot;
    int64_t pos = j->base;
    struct fanfs_dicts *dicts;
    if (qj->lookahead && !lookahead_wanted(j->ino)) {
        free(qj); /* its READ came first and read it */
        return;
    }
    dicts = dicts_hold();
    for (k = 0; k < j->npieces; k++) {
        const struct fanfs_piece *p = &j->pieces[k];
        char *buf = NULL;
        uint32_t cap = 0;
        const char *data = NULL;
        pthread_mutex_lock(&cache.lock);
        slot = -1;
        if (pieces_find_locked(&cache, j->fd, p) < 0)
            slot = pieces_reserve_locked(&cache, j->fd, p, 1,
                                         !(j->flags & FANFS_JOB_PUSH) || j->ino == 0, 0);
        pthread_mutex_unlock(&cache.lock);
        if (slot >= 0) {
            if (load_piece(j, p, dicts, &buf, &cap, &data) != 0) {
                if (buf != NULL)
                    pieces_free(&cache, buf, cap);
                slot_fill(slot, NULL, 0, NULL); /* its READ reads it and reports it */
            } else {
                slot_fill(slot, buf, cap, data);
                if ((j->flags & FANFS_JOB_PUSH) && j->ino != 0)
                    push_queue(&qj->t, j->ino, slot, pos, 0, p->size);
                pieces_release(&cache, slot);
            }
        }
        pos += p->size;
    }
    fanfs_dicts_free(dicts);
    free(qj);
}

int fanfs_run_job(const struct fanfs_dicts *dicts, const struct fanfs_job *j, char *out) {
    struct got got[FANFS_MAX_PIECES];
    struct iovec iov[FANFS_MAX_PIECES];
    int held[FANFS_MAX_PIECES] = {0}, niov, k, err;
    if (fanfs_job_check(j) != 0)
        return EINVAL;
    err = gather(NULL, j, dicts, got, held, iov, &niov);
    if (err == 0)
        for (k = 0; k < niov; k++) {
            memcpy(out, iov[k].iov_base, iov[k].iov_len);
            out += iov[k].iov_len;
        }
    for (k = 0; k < j->npieces; k++)
        if (held[k])
            piece_done(&got[k]);
    thread_buffers_trim();
    return err;
}

/* -- the threads -------------------------------------------------------------------------- */

/* The next job, pool lock held: a READ first, a read-ahead only when no READ waits. */
static struct qjob *next_job(void) {
    struct qjob *qj;
    if (pool.stopping) { /* read-aheads are not worth running any more */
        while ((qj = pool.ahead_head) != NULL) {
            pool.ahead_head = qj->next;
            free(qj);
        }
        pool.ahead_tail = NULL;
        pool.nahead = 0;
    }
    if ((qj = pool.head) != NULL) {
        pool.head = qj->next;
        if (pool.head == NULL)
            pool.tail = NULL;
    } else if ((qj = pool.ahead_head) != NULL) {
        pool.ahead_head = qj->next;
        if (pool.ahead_head == NULL)
            pool.ahead_tail = NULL;
        pool.nahead--;
    }
    return qj;
}

static void *thread_main(void *arg) {
    (void)arg;
    for (;;) {
        struct qjob *qj;
        pthread_mutex_lock(&pool.lock);
        while ((qj = next_job()) == NULL) {
            if (!pool.stopping) {
                pthread_cond_wait(&pool.cond, &pool.lock);
                continue;
            }
            /* Stopping with nothing queued: leave, unless a piece is being read (the READs
             * hung on it come back to the queue when it is). */
            pthread_mutex_unlock(&pool.lock);
            if (!pieces_busy(&cache)) {
                pthread_mutex_lock(&pool.lock);
                if (pool.head == NULL)
                    break;
                continue;
            }
            usleep(1000);
            pthread_mutex_lock(&pool.lock);
        }
        if (qj != NULL)
            pool.jobs++;
        pthread_mutex_unlock(&pool.lock);
        if (qj == NULL)
            break;
        if (is_read(qj))
            run_read(qj);
        else
            run_ahead(qj);
        thread_buffers_trim();
    }
    return NULL; /* (its own buffers are freed as it ends: fanfs_tls) */
}

int fanfs_pool_start(int nthreads, int errfd) {
    sigset_t all, old;
    int i;
    if (pool.nthreads > 0)
        return 0;
    if (nthreads < 1 || nthreads > MAX_THREADS)
        return -EINVAL;
    if (fanfs_codec_init() != 0)
        return -ENOENT;
    pool.errfd = errfd;
    pool.stopping = 0;
    /* Signals stay with the interpreter's thread. */
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    push.running = 1;
    if (pthread_create(&push.thread, NULL, pusher_main, NULL) != 0)
        push.running = 0;
    for (i = 0; i < nthreads; i++) {
        if (pthread_create(&pool.threads[i], NULL, thread_main, NULL) != 0)
            break;
        pool.nthreads++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return pool.nthreads > 0 ? 0 : -EAGAIN;
}

void fanfs_pool_set_dicts(struct fanfs_dicts *d) {
    struct fanfs_dicts *old;
    pthread_mutex_lock(&pool.dlock);
    old = pool.dicts;
    pool.dicts = fanfs_dicts_ref(d);
    pthread_mutex_unlock(&pool.dlock);
    fanfs_dicts_free(old); /* freed here, or by the last job decoding with it */
}

static int enqueue(const struct target *t, int lookahead, const struct fanfs_job *job) {
    struct qjob *qj;
    /* A job's pieces are read from fd: a peer's (fd <= -2) are fetched for the front's READs
     * only (remote_piece), which the pool's threads cannot do: the caller answers those. */
    if (pool.nthreads == 0 || pool.stopping || job->fd < 0 || fanfs_job_check(job) != 0)
        return -1;
    qj = malloc(sizeof *qj);
    if (qj == NULL)
        return -1;
    qj->next = NULL;
    qj->t = *t;
    qj->lookahead = lookahead;
    qj->j = *job;
    pthread_mutex_lock(&pool.lock);
    if (is_read(qj)) {
        if (pool.tail != NULL)
            pool.tail->next = qj;
        else
            pool.head = qj;
        pool.tail = qj;
    } else {
        if (pool.nahead >= AHEAD_MAX) { /* the stalest: the reader has moved past it */
            struct qjob *old = pool.ahead_head;
            pool.ahead_head = old->next;
            if (pool.ahead_head == NULL)
                pool.ahead_tail = NULL;
            pool.nahead--;
            free(old);
        }
        if (pool.ahead_tail != NULL)
            pool.ahead_tail->next = qj;
        else
            pool.ahead_head = qj;
        pool.ahead_tail = qj;
        pool.nahead++;
    }
    pthread_cond_signal(&pool.cond);
    pthread_mutex_unlock(&pool.lock);
    return 0;
}

static struct fuse_session *last_session; /* read-aheads push through the READs' session */

int fanfs_pool_submit(void *session, void *req, const struct fanfs_job *job) {
    if (req == NULL)
        return -1;
    struct target t = {(struct fuse_session *)session, (fuse_req_t)req, -1, 0};
    __atomic_store_n(&last_session, (struct fuse_session *)session, __ATOMIC_RELAXED);
    return enqueue(&t, 0, job);
}

int fanfs_pool_read_ahead(const struct fanfs_job *job) {
    struct target t = {__atomic_load_n(&last_session, __ATOMIC_RELAXED), NULL, -1, 0};
    return enqueue(&t, 0, job);
}

void fanfs_pool_drop(void) { pieces_drop(&cache); }

void fanfs_pool_counters(struct fanfs_pool_stats *out) {
    pthread_mutex_lock(&pool.lock);
    out->jobs = pool.jobs;
    pthread_mutex_unlock(&pool.lock);
    pieces_counters(&cache, &out->hits, &out->misses);
    pthread_mutex_lock(&push.lock);
    out->pushes = push.pushes;
    out->pushed_bytes = push.bytes;
    out->push_skipped = push.skipped;
    pthread_mutex_unlock(&push.lock);
}

void fanfs_pool_stop(void) {
    int i;
    fanfs_pool_fast_enable(0); /* READs from now on go to Python (or the front's drain) */
    remote_fail_pending();     /* no READ waits for a peer any more */
    while (__atomic_load_n(&answering, __ATOMIC_SEQ_CST) > 0)
        usleep(100); /* the front's READs in flight finish with the cache */
    pthread_mutex_lock(&pool.lock);
    pool.stopping = 1;
    pthread_cond_broadcast(&pool.cond);
    pthread_mutex_unlock(&pool.lock);
    for (i = 0; i < pool.nthreads; i++)
        pthread_join(pool.threads[i], NULL);
    pool.nthreads = 0;
    pthread_mutex_lock(&push.lock);
    if (push.running) {
        /* Pushes not made are only speed lost: drop them. */
        while (push.n > 0) {
            pieces_release(&cache, push.q[push.first].slot);
            push.first = (push.first + 1) % PUSH_MAX;
            push.n--;
        }
        push.running = 0;
        pthread_cond_signal(&push.cond);
        pthread_mutex_unlock(&push.lock);
        pthread_join(push.thread, NULL);
    } else {
        pthread_mutex_unlock(&push.lock);
    }
    pool.errfd = -1;
    __atomic_store_n(&last_session, NULL, __ATOMIC_RELAXED);
    pieces_clear(&cache);
}

/* -- READs answered with no Python ------------------------------------------------------- */

static uint64_t field64(const char *col, uint64_t e) {
    uint64_t v;
    memcpy(&v, col + e * sizeof v, sizeof v);
    return le64toh(v);
}

static uint32_t field32(const char *col, uint64_t e) {
    uint32_t v;
    memcpy(&v, col + e * sizeof v, sizeof v);
    return le32toh(v);
}

int fanfs_pool_fast_set(const struct fanfs_fast_table *t) {
    uint32_t i;
    if (__atomic_load_n(&fast.on, __ATOMIC_ACQUIRE) || t->n == 0 || t->nparts == 0)
        return -EINVAL; /* never while READs may be reading it */
    free(fast.fd);
    free(fast.dfd);
    free(fast.bad);
    free(fast.plan);
    fast.fd = malloc(t->nparts * sizeof(int));
    fast.dfd = malloc(t->nparts * sizeof(int));
    fast.bad = calloc(t->n, 1);
    fast.plan = calloc(t->n, 1);
    if (fast.fd == NULL || fast.dfd == NULL || fast.bad == NULL || fast.plan == NULL) {
        free(fast.fd);
        free(fast.dfd);
        free(fast.bad);
        free(fast.plan);
        fast.fd = fast.dfd = NULL;
        fast.bad = fast.plan = NULL;
        return -ENOMEM;
    }
    for (i = 0; i < t->nparts; i++)
        fast.fd[i] = fast.dfd[i] = -1;
    fast.t = *t;
    return 0;
}

void fanfs_pool_fast_part(uint32_t part, int fd, int dfd) {
    if (fast.fd == NULL || part >= fast.t.nparts)
        return;
    __atomic_store_n(&fast.dfd[part], dfd, __ATOMIC_RELAXED);
    __atomic_store_n(&fast.fd[part], fd, __ATOMIC_RELEASE);
}

void fanfs_pool_fast_enable(int on) { __atomic_store_n(&fast.on, on, __ATOMIC_SEQ_CST); }

uint64_t fanfs_pool_fast_count(void) { return __atomic_load_n(&fast.taken, __ATOMIC_RELAXED); }

int fanfs_pool_fast_owners(const int32_t *owners, uint32_t nparts, int self) {
    uint32_t part;
    int k;
    if (fast.fd == NULL || nparts != fast.t.nparts || __atomic_load_n(&fast.on, __ATOMIC_SEQ_CST))
        return -EINVAL;
    free(fast.owners);
    free(fast.remote);
    fast.owners = malloc((size_t)nparts * FANFS_MAX_OWNERS * sizeof(int32_t));
    fast.remote = calloc(nparts, 1);
    if (fast.owners == NULL || fast.remote == NULL) {
        free(fast.owners);
        free(fast.remote);
        fast.owners = NULL;
        fast.remote = NULL;
        return -ENOMEM;
    }
    memcpy(fast.owners, owners, (size_t)nparts * FANFS_MAX_OWNERS * sizeof(int32_t));
    for (part = 0; part < nparts; part++) {
        int mine = 0, any = 0;
        for (k = 0; k < FANFS_MAX_OWNERS; k++) {
            int32_t r = owners[part * FANFS_MAX_OWNERS + k];
            any |= r >= 0;
            mine |= r == self;
        }
        fast.remote[part] = any && !mine;
    }
    return 0;
}

int fanfs_pool_fast_on(void) { return __atomic_load_n(&fast.on, __ATOMIC_SEQ_CST); }

void fanfs_pool_plan_mark(uint64_t e, int flag, int on) {
    if (fast.plan == NULL || e >= fast.t.n)
        return;
    if (on)
        __atomic_or_fetch(&fast.plan[e], (uint8_t)flag, __ATOMIC_RELEASE);
    else
        __atomic_and_fetch(&fast.plan[e], (uint8_t)~flag, __ATOMIC_RELEASE);
}

static void lookahead_read(uint64_t ino);

/* The fast path's job for [off, off + size) of inode `ino`: 0, or -1 (Python answers). */
static int fast_build(uint64_t ino, int64_t off, uint64_t size, struct fanfs_job *j) {
    uint64_t e, length, stored;
    uint32_t part;
    int fd, whole, remote;
    uint8_t kind;

    if (!__atomic_load_n(&fast.on, __ATOMIC_SEQ_CST) || fast.fd == NULL || ino < 1)
        return -1;
    e = ino - 1;
    if (e >= fast.t.n || fast.t.kind[e] == FANFS_FAST_NO ||
        __atomic_load_n(&fast.bad[e], __ATOMIC_RELAXED) ||
        (__atomic_load_n(&fast.plan[e], __ATOMIC_ACQUIRE) & FANFS_PLAN_HELD))
        return -1;
    kind = fast.t.kind[e];
    part = field32(fast.t.part, e);
    if (part >= fast.t.nparts)
        return -1;
    fd = __atomic_load_n(&fast.fd[part], __ATOMIC_ACQUIRE);
    remote = fd < 0 && fast.remote != NULL && fast.remote[part] &&
             __atomic_load_n(&rq.on, __ATOMIC_ACQUIRE);
    if (fd < 0 && !remote)
        return -1;
    length = field64(fast.t.size, e);
    stored = field64(fast.t.stored, e);
    if (off < 0 || (uint64_t)off >= length || size == 0 || length > FANFS_PIECE_MAX ||
        stored > FANFS_PIECE_MAX)
        return -1; /* EOF, or not a piece: Python answers */
    if (size > length - (uint64_t)off)
        size = length - (uint64_t)off;
    whole = off == 0 && size == length;
    if (!whole && length > fast.t.parts_limit)
        return -1;
    if (remote && stored > FANFS_REMOTE_MAX)
        return -1; /* fetched whole: a large remote file goes to Python, which reads ranges */
    memset(j, 0, sizeof *j);
    j->fd = remote ? FANFS_REMOTE_FD(part) : fd;
    j->dfd = remote ? -1 : __atomic_load_n(&fast.dfd[part], __ATOMIC_RELAXED);
    j->entry = (int64_t)e;
    j->ino = ino;
    j->base = 0;
    j->skip = (uint32_t)off;
    j->count = (uint32_t)size;
    j->flags = whole ? 0 : fast.t.flags;
    j->npieces = 1;
    j->pieces[0].off = (int64_t)field64(fast.t.off, e);
    j->pieces[0].len = (uint32_t)stored;
    j->pieces[0].crc = field32(fast.t.crc, e);
    j->pieces[0].size = (uint32_t)length;
    j->pieces[0].kind = kind;
    j->pieces[0].cache = !whole || remote; /* a peer's piece always lands in the cache */
    return fanfs_job_check(j);
}

int fanfs_pool_fast_job(uint64_t ino, int64_t off, uint64_t size, struct fanfs_job *j) {
    if (fast_build(ino, off, size, j) != 0)
        return -1;
    if (off == 0)
        lookahead_read(ino);
    __atomic_add_fetch(&fast.taken, 1, __ATOMIC_RELAXED);
    return 0;
}

/* -- reads started at LOOKUP ------------------------------------------------------------------
 * A LOOKUP of a file is most often its open(), and its first READ follows within microseconds:
 * the pool starts reading it then (a peer's file: the MPI thread starts fetching it), into its
 * cache of pieces, where the READ finds it (waiting for it if it is still on its way). A stat walk (ls -l, du) looks files up
 * that nobody reads: the last LA_RING lookups are remembered, with whether a READ followed
 * (la.share, the recent share of lookups that were read, in 1/256), and files are read ahead
 * only while most are. A file larger than the pool's parts limit is not read ahead. */
#define LA_RING 64
static struct {
    pthread_mutex_t lock;
    uint64_t ino[LA_RING];
    uint8_t fetched[LA_RING];
    int n;      /* entries, oldest first */
    int share;  /* 1/256 */
    uint64_t started, used, unused;
} la = {.lock = PTHREAD_MUTEX_INITIALIZER, .share = 256};

static void la_outcome(int read, int fetched) {
    la.share += ((read ? 256 : 0) - la.share) / 8;
    if (fetched) {
        la.used += read;
        la.unused += !read;
    }
}

static int la_find(uint64_t ino) {
    int i;
    for (i = la.n - 1; i >= 0; i--)
        if (la.ino[i] == ino)
            return i;
    return -1;
}

static void la_remove(int i) {
    memmove(&la.ino[i], &la.ino[i + 1], (size_t)(la.n - i - 1) * sizeof la.ino[0]);
    memmove(&la.fetched[i], &la.fetched[i + 1], (size_t)(la.n - i - 1));
    la.n--;
}

static void lookahead_read(uint64_t ino) {
    int i;
    pthread_mutex_lock(&la.lock);
    if ((i = la_find(ino)) >= 0) {
        la_outcome(1, la.fetched[i]);
        la_remove(i);
    }
    pthread_mutex_unlock(&la.lock);
}

static int lookahead_wanted(uint64_t ino) {
    int i, wanted;
    pthread_mutex_lock(&la.lock);
    i = la_find(ino);
    wanted = i >= 0 && la.fetched[i];
    pthread_mutex_unlock(&la.lock);
    return wanted;
}

static void looked_up(uint64_t ino) {
    struct fanfs_job j;
    struct target none = {NULL, NULL, -1, 0};
    int i, fetch;
    uint64_t e = ino - 1;
    if (!__atomic_load_n(&fast.on, __ATOMIC_ACQUIRE) || fast.fd == NULL || ino < 1 ||
        e >= fast.t.n || field64(fast.t.size, e) > fast.t.parts_limit ||
        __atomic_load_n(&fast.plan[e], __ATOMIC_ACQUIRE))
        return; /* (a planned epoch reads it ahead, or holds it read) */
    pthread_mutex_lock(&la.lock);
    if ((i = la_find(ino)) >= 0)
        la_remove(i); /* looked up again before it was read: counted once */
    if (la.n == LA_RING) {
        la_outcome(0, la.fetched[0]); /* never read while remembered */
        la_remove(0);
    }
    fetch = la.share >= 128;
    la.ino[la.n] = ino;
    la.fetched[la.n] = (uint8_t)fetch;
    la.n++;
    pthread_mutex_unlock(&la.lock);
    if (!fetch)
        return;
    if (fast_build(ino, 0, field64(fast.t.size, e), &j) != 0)
        return;
    if (j.fd <= FANFS_REMOTE_FD(0)) { /* a peer's: the MPI thread fetches it, no pool thread */
        int started;
        pthread_mutex_lock(&cache.lock);
        started = pieces_find_locked(&cache, j.fd, &j.pieces[0]) < 0 &&
                  cache.ahead < LA_REMOTE_MAX && remote_reserve_locked(&j, &j.pieces[0], 1) >= 0;
        pthread_mutex_unlock(&cache.lock);
        if (started) {
            __atomic_add_fetch(&rq.looked_up, 1, __ATOMIC_RELAXED);
            pthread_mutex_lock(&la.lock);
            la.started++;
            pthread_mutex_unlock(&la.lock);
        }
        return;
    }
    j.count = 0; /* no READ: the piece goes into the cache, for the READ to come */
    j.flags = 0;
    j.pieces[0].cache = 1;
    if (enqueue(&none, 1, &j) == 0) {
        pthread_mutex_lock(&la.lock);
        la.started++;
        pthread_mutex_unlock(&la.lock);
    }
}

void fanfs_pool_looked_up(uint64_t ino) {
    /* Counted like a READ: the pool's stop waits for it before it frees the cache. */
    __atomic_add_fetch(&answering, 1, __ATOMIC_SEQ_CST);
    looked_up(ino);
    __atomic_sub_fetch(&answering, 1, __ATOMIC_SEQ_CST);
}

void fanfs_lookahead_counters(uint64_t out[3]) {
    pthread_mutex_lock(&la.lock);
    out[0] = la.started;
    out[1] = la.used;
    out[2] = la.unused;
    pthread_mutex_unlock(&la.lock);
}
