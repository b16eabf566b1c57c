/*
 * READs answered with no Python (pool_int.h): the pool builds a READ's job from the catalog's
 * own columns (fanfs_pool_fast_set), read in place, and the front's thread that took the READ
 * answers it (fanfs_pool_fast_answer). And reads started at LOOKUP (below).
 *
 * The table and its arrays are set while the fast path is off (from the daemon's thread, at
 * start) and read by any thread while it is on; per-entry and per-partition marks change at
 * any time, atomically. The look-ahead's ring has a lock of its own, a leaf (locks.h).
 */
#define _GNU_SOURCE
#include <endian.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "pool_int.h"

int fanfs_pool_fast_set(const struct fanfs_fast_table *t) {
    struct fast *f = &pool_live()->fast;
    uint32_t i;
    if (__atomic_load_n(&f->on, __ATOMIC_ACQUIRE) || t->n == 0 || t->nparts == 0)
        return -EINVAL; /* never while READs may be reading it */
    free(f->fd);
    free(f->dfd);
    free(f->bad);
    free(f->plan);
    f->fd = malloc(t->nparts * sizeof(int));
    f->dfd = malloc(t->nparts * sizeof(int));
    f->bad = calloc(t->n, 1);
    f->plan = calloc(t->n, 1);
    if (f->fd == NULL || f->dfd == NULL || f->bad == NULL || f->plan == NULL) {
        free(f->fd);
        free(f->dfd);
        free(f->bad);
        free(f->plan);
        f->fd = f->dfd = NULL;
        f->bad = f->plan = NULL;
        return -ENOMEM;
    }
    for (i = 0; i < t->nparts; i++)
        f->fd[i] = f->dfd[i] = -1;
    f->t = *t;
    return 0;
}

void fanfs_pool_fast_part(uint32_t part, int fd, int dfd) {
    struct fast *f = &pool_live()->fast;
    if (f->fd == NULL || part >= f->t.nparts)
        return;
    __atomic_store_n(&f->dfd[part], dfd, __ATOMIC_RELAXED);
    __atomic_store_n(&f->fd[part], fd, __ATOMIC_RELEASE);
}

void fanfs_pool_fast_enable(int on) {
    __atomic_store_n(&pool_live()->fast.on, on, __ATOMIC_SEQ_CST);
}

uint64_t fanfs_pool_fast_count(void) {
    return __atomic_load_n(&pool_live()->fast.taken, __ATOMIC_RELAXED);
}

int fanfs_pool_fast_owners(const int32_t *owners, uint32_t nparts, int self) {
    struct fast *f = &pool_live()->fast;
    uint32_t part;
    int k;
    if (f->fd == NULL || nparts != f->t.nparts || __atomic_load_n(&f->on, __ATOMIC_SEQ_CST))
        return -EINVAL;
    free(f->owners);
    free(f->remote);
    f->owners = malloc((size_t)nparts * FANFS_MAX_OWNERS * sizeof(int32_t));
    f->remote = calloc(nparts, 1);
    if (f->owners == NULL || f->remote == NULL) {
        free(f->owners);
        free(f->remote);
        f->owners = NULL;
        f->remote = NULL;
        return -ENOMEM;
    }
    memcpy(f->owners, owners, (size_t)nparts * FANFS_MAX_OWNERS * sizeof(int32_t));
    for (part = 0; part < nparts; part++) {
        int mine = 0, any = 0;
        for (k = 0; k < FANFS_MAX_OWNERS; k++) {
            int32_t r = owners[part * FANFS_MAX_OWNERS + k];
            any |= r >= 0;
            mine |= r == self;
        }
        f->remote[part] = any && !mine;
    }
    return 0;
}

int fanfs_pool_fast_on(void) { return __atomic_load_n(&pool_live()->fast.on, __ATOMIC_SEQ_CST); }

void fanfs_pool_plan_mark(uint64_t e, int flag, int on) {
    struct fast *f = &pool_live()->fast;
    if (f->plan == NULL || e >= f->t.n)
        return;
    if (on)
        __atomic_or_fetch(&f->plan[e], (uint8_t)flag, __ATOMIC_RELEASE);
    else
        __atomic_and_fetch(&f->plan[e], (uint8_t)~flag, __ATOMIC_RELEASE);
}

void fast_mark_bad(struct fast *f, int64_t entry) {
    if (f->bad != NULL && entry >= 0 && (uint64_t)entry < f->t.n)
        __atomic_store_n(&f->bad[entry], 1, __ATOMIC_RELAXED);
}

static void lookahead_read(struct lookahead *la, uint64_t ino);

/* Whether entry e is a file the fast path may answer (the path on, a piece kind, not found
 * bad, its partition in range: `*part`). */
static int fast_entry(const struct fast *f, uint64_t e, uint32_t *part) {
    if (!__atomic_load_n(&f->on, __ATOMIC_SEQ_CST) || f->fd == NULL || e >= f->t.n ||
        f->t.kind[e] == FANFS_FAST_NO || __atomic_load_n(&f->bad[e], __ATOMIC_RELAXED))
        return 0;
    *part = fanfs_col32(f->t.part, e);
    return *part < f->t.nparts;
}

/* The fast path's job for [off, off + size) of inode `ino`: 0, or -1 (Python answers). */
static int fast_build(struct pool *P, uint64_t ino, int64_t off, uint64_t size,
                      struct fanfs_job *j) {
    const struct fast *f = &P->fast;
    uint64_t e, length, stored;
    uint32_t part;
    int fd, whole, remote;
    uint8_t kind;

    if (ino < 1)
        return -1;
    e = ino - 1;
    if (!fast_entry(f, e, &part) ||
        (__atomic_load_n(&f->plan[e], __ATOMIC_ACQUIRE) & FANFS_PLAN_HELD))
        return -1;
    kind = f->t.kind[e];
    fd = __atomic_load_n(&f->fd[part], __ATOMIC_ACQUIRE);
    remote = fd < 0 && f->remote != NULL && f->remote[part] &&
             __atomic_load_n(&P->remote.on, __ATOMIC_ACQUIRE);
    if (fd < 0 && !remote)
        return -1;
    length = fanfs_col64(f->t.size, e);
    stored = fanfs_col64(f->t.stored, e);
    if (off < 0 || (uint64_t)off >= length || size == 0 || length > FANFS_PIECE_MAX ||
        stored > FANFS_PIECE_MAX)
        return -1; /* EOF, or not a piece: Python answers */
    if (size > length - (uint64_t)off)
        size = length - (uint64_t)off;
    whole = off == 0 && size == length;
    if (!whole && length > f->t.parts_limit)
        return -1;
    if (remote && stored > FANFS_REMOTE_MAX)
        return -1; /* fetched whole: a large remote file goes to Python, which reads ranges */
    memset(j, 0, sizeof *j);
    j->fd = remote ? FANFS_REMOTE_FD(part) : fd;
    j->dfd = remote ? -1 : __atomic_load_n(&f->dfd[part], __ATOMIC_RELAXED);
    j->entry = (int64_t)e;
    j->ino = ino;
    j->base = 0;
    j->skip = (uint32_t)off;
    j->count = (uint32_t)size;
    j->flags = whole ? 0 : f->t.flags;
    j->npieces = 1;
    j->pieces[0].off = (int64_t)fanfs_col64(f->t.off, e);
    j->pieces[0].len = (uint32_t)stored;
    j->pieces[0].crc = fanfs_col32(f->t.crc, e);
    j->pieces[0].size = (uint32_t)length;
    j->pieces[0].kind = kind;
    j->pieces[0].cache = !whole || remote; /* a peer's piece always lands in the cache */
    return fanfs_job_check(j);
}

int fanfs_pool_fast_job(uint64_t ino, int64_t off, uint64_t size, struct fanfs_job *j) {
    struct pool *P = pool_live();
    if (fast_build(P, ino, off, size, j) != 0)
        return -1;
    if (off == 0)
        lookahead_read(&P->la, ino);
    __atomic_add_fetch(&P->fast.taken, 1, __ATOMIC_RELAXED);
    return 0;
}

/* -- reads started at LOOKUP ------------------------------------------------------------------
 * A LOOKUP of a file is most often its open(), and its first READ follows within microseconds:
 * the pool starts reading it then (a peer's file: the MPI thread starts fetching it), into its
 * cache of pieces, where the READ finds it (waiting for it if it is still on its way). A stat
 * walk (ls -l, du) looks files up that nobody reads: the last LA_RING lookups are remembered,
 * with whether a READ followed (la->share, the recent share of lookups that were read, in
 * 1/256), and files are read ahead only while most are. A file larger than the pool's parts
 * limit is not read ahead. Every la_..._locked function runs under la->lock. */
static void la_outcome_locked(struct lookahead *la, int read, int fetched) {
    la->share += ((read ? 256 : 0) - la->share) / FANFS_LA_DECAY;
    if (fetched) {
        la->used += read;
        la->unused += !read;
    }
}

static int la_find_locked(const struct lookahead *la, uint64_t ino) {
    int i;
    for (i = la->n - 1; i >= 0; i--)
        if (la->ino[i] == ino)
            return i;
    return -1;
}

static void la_remove_locked(struct lookahead *la, int i) {
    memmove(&la->ino[i], &la->ino[i + 1], (size_t)(la->n - i - 1) * sizeof la->ino[0]);
    memmove(&la->fetched[i], &la->fetched[i + 1], (size_t)(la->n - i - 1));
    la->n--;
}

static void lookahead_read(struct lookahead *la, uint64_t ino) {
    int i;
    pthread_mutex_lock(&la->lock);
    if ((i = la_find_locked(la, ino)) >= 0) {
        la_outcome_locked(la, 1, la->fetched[i]);
        la_remove_locked(la, i);
    }
    pthread_mutex_unlock(&la->lock);
}

int lookahead_wanted(struct lookahead *la, uint64_t ino) {
    int i, wanted;
    pthread_mutex_lock(&la->lock);
    i = la_find_locked(la, ino);
    wanted = i >= 0 && la->fetched[i];
    pthread_mutex_unlock(&la->lock);
    return wanted;
}

static void looked_up(struct pool *P, uint64_t ino) {
    const struct fast *f = &P->fast;
    struct lookahead *la = &P->la;
    struct pieces *c = &P->pieces;
    struct fanfs_job j;
    struct target none = {NULL, NULL, -1, 0};
    int i, fetch;
    uint64_t e = ino - 1;
    if (!__atomic_load_n(&f->on, __ATOMIC_ACQUIRE) || f->fd == NULL || ino < 1 ||
        e >= f->t.n || fanfs_col64(f->t.size, e) > f->t.parts_limit ||
        __atomic_load_n(&f->plan[e], __ATOMIC_ACQUIRE))
        return; /* (a planned epoch reads it ahead, or holds it read) */
    pthread_mutex_lock(&la->lock);
    if ((i = la_find_locked(la, ino)) >= 0)
        la_remove_locked(la, i); /* looked up again before it was read: counted once */
    if (la->n == LA_RING) {
        la_outcome_locked(la, 0, la->fetched[0]); /* never read while remembered */
        la_remove_locked(la, 0);
    }
    fetch = la->share >= FANFS_LA_ON_SHARE;
    la->ino[la->n] = ino;
    la->fetched[la->n] = (uint8_t)fetch;
    la->n++;
    pthread_mutex_unlock(&la->lock);
    if (!fetch)
        return;
    if (fast_build(P, ino, 0, fanfs_col64(f->t.size, e), &j) != 0)
        return;
    if (j.fd <= FANFS_REMOTE_FD(0)) { /* a peer's: the MPI thread fetches it, no pool thread */
        int started;
        pthread_mutex_lock(&c->lock);
        started = pieces_find_locked(c, j.fd, &j.pieces[0]) < 0 && c->ahead < LA_REMOTE_MAX &&
                  remote_reserve_locked(P, &j, &j.pieces[0], 1) >= 0;
        pthread_mutex_unlock(&c->lock);
        if (started) {
            __atomic_add_fetch(&P->remote.looked_up, 1, __ATOMIC_RELAXED);
            pthread_mutex_lock(&la->lock);
            la->started++;
            pthread_mutex_unlock(&la->lock);
        }
        return;
    }
    j.count = 0; /* no READ: the piece goes into the cache, for the READ to come */
    j.flags = 0;
    j.pieces[0].cache = 1;
    if (pool_enqueue(P, &none, 1, &j) == 0) {
        pthread_mutex_lock(&la->lock);
        la->started++;
        pthread_mutex_unlock(&la->lock);
    }
}

void fanfs_pool_looked_up(uint64_t ino) {
    struct pool *P = pool_live();
    /* Counted like a READ: the pool's stop waits for it before it frees the cache. */
    __atomic_add_fetch(&P->answering, 1, __ATOMIC_SEQ_CST);
    looked_up(P, ino);
    __atomic_sub_fetch(&P->answering, 1, __ATOMIC_SEQ_CST);
}

void fanfs_pool_ahead_budget(uint64_t out[FANFS_BUDGET_LEN]) {
    fanfs_budget_take(&pool_live()->ahead, out);
}

void fanfs_lookahead_counters(uint64_t out[3]) {
    struct lookahead *la = &pool_live()->la;
    pthread_mutex_lock(&la->lock);
    out[0] = la->started;
    out[1] = la->used;
    out[2] = la->unused;
    pthread_mutex_unlock(&la->lock);
}

int fanfs_pool_fast_stored(int64_t e, uint32_t len, char **buf, uint32_t *cap, const char **at) {
    struct pool *P = pool_live();
    const struct fast *f = &P->fast;
    struct fanfs_piece p;
    uint32_t part;
    int fd, err = ENOENT;
    /* Counted before the check of fast.on, as a READ: the stop waits for none to be reading
     * before the partitions' fds may close. */
    __atomic_add_fetch(&P->answering, 1, __ATOMIC_SEQ_CST);
    if (e < 0 || !fast_entry(f, (uint64_t)e, &part) ||
        (fd = __atomic_load_n(&f->fd[part], __ATOMIC_ACQUIRE)) < 0)
        goto out;
    memset(&p, 0, sizeof p);
    p.off = (int64_t)fanfs_col64(f->t.off, (uint64_t)e);
    p.len = len;
    p.crc = fanfs_col32(f->t.crc, (uint64_t)e);
    err = EINVAL;
    if (len == 0 || len > FANFS_REMOTE_MAX || fanfs_col64(f->t.stored, (uint64_t)e) != len)
        goto out;
    err = ENOMEM; /* (room for an O_DIRECT read's aligned span: the read never grows it) */
    if (*buf == NULL &&
        (*buf = pieces_alloc(&P->pieces, (uint64_t)len + 2 * FANFS_DIRECT_ALIGN, cap)) == NULL)
        goto out;
    err = fanfs_read_stored(fd, __atomic_load_n(&f->dfd[part], __ATOMIC_RELAXED), &p, buf, cap,
                            at);
    if (err == FANFS_EBADCRC) /* a bad copy: its READs here go to Python, which knows it then */
        fast_mark_bad(&P->fast, e);
out:
    __atomic_sub_fetch(&P->answering, 1, __ATOMIC_SEQ_CST);
    return err;
}

int fanfs_pool_fast_answer(int fd, uint64_t unique, uint64_t ino, int64_t off, uint64_t size) {
    struct pool *P = pool_live();
    struct target t = {NULL, NULL, fd, unique};
    struct fanfs_job j;
    int err;
    /* Counted before the check of fast.on: the pool's stop turns it off, then waits for none
     * to be answering before it frees the cache. */
    __atomic_add_fetch(&P->answering, 1, __ATOMIC_SEQ_CST);
    if (fanfs_pool_fast_job(ino, off, size, &j) != 0) {
        __atomic_sub_fetch(&P->answering, 1, __ATOMIC_SEQ_CST);
        return -1;
    }
    fanfs_mark(FANFS_STAGE_JOB);
    err = job_answer(P, NULL, &t, &j);
    job_buffers_trim();
    __atomic_sub_fetch(&P->answering, 1, __ATOMIC_SEQ_CST);
    return err == FANFS_EREMOTE ? -1 : 0;
}

