/*
 * A peer's files, fetched by the MPI thread into the cache of pieces (pool_int.h).
 *
 * A READ the front takes of a file a peer holds (stored whole, up to FANFS_REMOTE_MAX) is
 * answered from the cache of pieces like a local one: the piece's slot is reserved (pending)
 * and a request for it queued here, the MPI thread takes it (fanfs_remote_take, woken through
 * `wakefd`), fetches the stored bytes from a holder and hands them back (fanfs_remote_fill:
 * checked and decoded in C, the slot filled, the READ that waits on it woken), so neither
 * Python's event loop nor a hand-off to it is on the way. When no holder can give it
 * (fanfs_remote_fail), the READ goes to Python after all, which tries every source and the
 * image. A lookup of such a file reserves its piece too (reads at LOOKUP, fast.c), at most
 * LA_REMOTE_MAX at a time.
 *
 * A silent peer must not freeze the mount: a READ waits for a peer's piece at most `wait_ns`
 * (then Python answers it, with its own peer timeout and the image), and at most `max_waiting`
 * READs wait at once (the front's threads less one, set by the MPI transport): the others go
 * to Python at once, so a front thread is always left to answer local files. When the remote
 * path goes off, or the pool stops, every pending peer's piece is given up.
 *
 * The data plane (plane.c), when it runs, takes the queue instead of the MPI thread: it is
 * attached here (its own eventfd written for new requests), fetches over MPI in C, and hands
 * back what it cannot fetch (a refusal, a bad copy, a holder slow or dead, no holder left)
 * into a second ring, which the MPI thread takes (fanfs_remote_take) and fetches as before.
 *
 * Lock order: the cache's lock before the remote path's (a fetch is queued with the slot
 * reserved, under the cache's lock).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "pool_int.h"

/* Queue the fetch of slot i's piece (cache lock held); 0, or -1 when the queue is full or the
 * remote path is off. */
static int rq_push_locked(struct pool *P, int i, const struct fanfs_job *j,
                          const struct fanfs_piece *p, int ahead) {
    struct remote *rq = &P->remote;
    const struct fast *f = &P->fast; /* owners: immutable while the fast path is on */
    uint64_t one = 1;
    ssize_t w;
    uint32_t part = (uint32_t)(FANFS_REMOTE_FD(0) - j->fd);
    int k;
    struct fanfs_rreq *r;
    pthread_mutex_lock(&rq->lock);
    if (!rq->on || rq->n == RQ_MAX || f->owners == NULL || part >= f->t.nparts) {
        pthread_mutex_unlock(&rq->lock);
        return -1;
    }
    r = &rq->q[(rq->first + rq->n) % RQ_MAX];
    r->slot = i;
    r->entry = j->entry;
    r->part = part;
    r->off = p->off;
    r->len = p->len;
    r->crc = p->crc;
    r->ahead = ahead;
    r->queued_ns = fanfs_now_ns();
    r->taken_ns = 0;
    r->tried = -1;
    for (k = 0; k < FANFS_MAX_OWNERS; k++)
        r->peers[k] = f->owners[part * FANFS_MAX_OWNERS + k];
    rq->n++;
    w = write(rq->planefd >= 0 ? rq->planefd : rq->wakefd, &one, sizeof one);
    (void)w;
    pthread_mutex_unlock(&rq->lock);
    return 0;
}

/* Reserve a pending slot for a peer's piece and queue its fetch, cache lock held throughout
 * (let go in between, the slot could be settled by a stop and taken by another piece before
 * a failed push gave it up). The slot's index, or -1 (no room, the queue is full, or the pool
 * is stopping). Nobody holds a reference to it: a READ waiting for it takes one once it is
 * filled, as for any piece. */
int remote_reserve_locked(struct pool *P, const struct fanfs_job *j,
                          const struct fanfs_piece *p, int ahead) {
    int i;
    if (!__atomic_load_n(&P->fast.on, __ATOMIC_ACQUIRE)) /* a stop gave up what was pending */
        return -1;
    /* Nobody pushed it: its first READ pushes the rest. */
    if ((i = pieces_reserve_locked(&P->pieces, j->fd, p, 0, 1, ahead)) < 0)
        return -1;
    if (rq_push_locked(P, i, j, p, ahead) != 0) {
        pieces_ready_locked(&P->pieces, i, NULL, 0, NULL); /* nobody could hang on it meanwhile */
        return -1;
    }
    return i;
}

/* A peer's piece for a READ of the front (`front`: it may wait within the limits above) or
 * for the planner's read-ahead (its wait is not one of the front's: uncounted, and at most
 * REMOTE_AHEAD_WAIT_NS, well within the planner's stop, which must not find a pusher holding
 * a slot when the pool clears the cache): FANFS_EREMOTE when it cannot be had here in time
 * (the READ then goes to Python; the planner fetches it as it does without the front). */
int remote_piece(struct pool *P, const struct fanfs_job *j, const struct fanfs_piece *p,
                 struct got *g, int front) {
    struct pieces *c = &P->pieces;
    int i, got, unpushed = 0, mine = -1;
    int64_t wait_ns = __atomic_load_n(&P->remote.wait_ns, __ATOMIC_RELAXED), end;
    struct timespec deadline;
    struct pieces_wait how = {.counted = front, .deadline = NULL};
    if (!front && (wait_ns <= 0 || wait_ns > REMOTE_AHEAD_WAIT_NS))
        wait_ns = REMOTE_AHEAD_WAIT_NS;
    if (wait_ns > 0) {
        how.deadline = &deadline; /* on CLOCK_MONOTONIC: a wall clock's step changes nothing */
        clock_gettime(CLOCK_MONOTONIC, &deadline);
        end = (int64_t)deadline.tv_sec * 1000000000 + deadline.tv_nsec + wait_ns;
        deadline.tv_sec = (time_t)(end / 1000000000);
        deadline.tv_nsec = (long)(end % 1000000000);
    }
    pthread_mutex_lock(&c->lock);
    for (;;) {
        how.limit = front ? __atomic_load_n(&P->remote.max_waiting, __ATOMIC_RELAXED) : 0;
        got = pieces_get_locked(c, j->fd, p, &how, &i, &unpushed);
        if (got == PIECES_HIT) {
            struct fanfs_marks *m = fanfs_marks();
            pthread_mutex_unlock(&c->lock);
            if (m != NULL)
                m->remote = 1;
            fanfs_mark(FANFS_STAGE_PEER);
            g->fresh = unpushed;
            g->slot = i;
            g->data = c->slot[i].data;
            return 0;
        }
        /* Not had in time, or ours was given up (no holder could give it) or, rarely,
         * evicted; or nobody may wait: Python answers (as when the pool is stopping:
         * remote_reserve_locked refuses). */
        if (got == PIECES_GAVE_UP || mine >= 0 || !pieces_may_wait_locked(c, how.limit))
            break;
        c->misses++;
        if ((mine = remote_reserve_locked(P, j, p, 0)) < 0)
            break;
    }
    pthread_mutex_unlock(&c->lock);
    return FANFS_EREMOTE;
}

void remote_fail_pending(struct pool *P) {
    struct pieces *c = &P->pieces;
    struct qjob *w = NULL, *more, *last;
    int i;
    pthread_mutex_lock(&c->lock);
    for (i = 0; i < PIECES_SLOTS; i++)
        if (c->slot[i].pending && c->slot[i].fd <= FANFS_REMOTE_FD(0)) {
            more = pieces_ready_locked(c, i, NULL, 0, NULL);
            if (more != NULL) {
                for (last = more; last->next != NULL; last = last->next)
                    ;
                last->next = w;
                w = more;
            }
            __atomic_add_fetch(&P->remote.failed, 1, __ATOMIC_RELAXED);
        }
    pthread_mutex_unlock(&c->lock);
    pool_requeue(&P->work, w);
}

int fanfs_remote_on(void) { return __atomic_load_n(&pool_live()->remote.on, __ATOMIC_ACQUIRE); }

void fanfs_remote_set_wake(int fd, int max_waiting, int64_t wait_ns) {
    struct pool *P = pool_live();
    struct remote *rq = &P->remote;
    pthread_mutex_lock(&rq->lock);
    rq->wakefd = fd;
    __atomic_store_n(&rq->max_waiting, max_waiting, __ATOMIC_RELAXED);
    __atomic_store_n(&rq->wait_ns, wait_ns, __ATOMIC_RELAXED);
    __atomic_store_n(&rq->on, fd >= 0, __ATOMIC_RELEASE);
    if (fd < 0)
        rq->n = rq->bn = 0; /* nothing will be fetched any more */
    pthread_mutex_unlock(&rq->lock);
    if (fd < 0)
        remote_fail_pending(P); /* the READs waiting go to Python */
}

/* Up to `max` requests from a ring (rq->lock held), stamped taken. */
static int take_locked(struct fanfs_rreq *ring, int *first, int *n, struct fanfs_rreq *out,
                       int max) {
    int k = 0;
    int64_t now = fanfs_now_ns(); /* under the lock: a request queued while this thread waited
                                     for it was stamped later than a clock read before (its
                                     legs were lost) */
    while (k < max && *n > 0) {
        out[k] = ring[*first];
        if (out[k].taken_ns == 0)
            out[k].taken_ns = now; /* (one handed back keeps the plane's stamp) */
        *first = (*first + 1) % RQ_MAX;
        (*n)--;
        k++;
    }
    return k;
}

int fanfs_remote_take(struct fanfs_rreq *out, int max) {
    struct remote *rq = &pool_live()->remote;
    int n;
    pthread_mutex_lock(&rq->lock);
    n = take_locked(rq->back, &rq->bfirst, &rq->bn, out, max);
    if (rq->planefd < 0) /* (else the plane takes the new ones) */
        n += take_locked(rq->q, &rq->first, &rq->n, out + n, max - n);
    pthread_mutex_unlock(&rq->lock);
    return n;
}

int remote_plane_attach(struct pool *P, int fd) {
    struct remote *rq = &P->remote;
    int ok;
    pthread_mutex_lock(&rq->lock);
    ok = rq->on && rq->wakefd >= 0;
    if (ok)
        rq->planefd = fd;
    pthread_mutex_unlock(&rq->lock);
    return ok ? 0 : -1;
}

void remote_plane_detach(struct pool *P) {
    struct remote *rq = &P->remote;
    uint64_t one = 1;
    ssize_t w;
    pthread_mutex_lock(&rq->lock);
    rq->planefd = -1;
    if (rq->wakefd >= 0 && rq->n > 0) /* what the plane left queued is the MPI thread's */
        w = write(rq->wakefd, &one, sizeof one), (void)w;
    pthread_mutex_unlock(&rq->lock);
}

int remote_plane_take(struct pool *P, struct fanfs_rreq *out, int max) {
    struct remote *rq = &P->remote;
    int n = 0;
    pthread_mutex_lock(&rq->lock);
    if (rq->planefd >= 0)
        n = take_locked(rq->q, &rq->first, &rq->n, out, max);
    pthread_mutex_unlock(&rq->lock);
    return n;
}

void remote_hand_back(struct pool *P, const struct fanfs_rreq *r) {
    struct remote *rq = &P->remote;
    uint64_t one = 1;
    ssize_t w;
    int kept = 0;
    pthread_mutex_lock(&rq->lock);
    if (rq->on && rq->wakefd >= 0 && rq->bn < RQ_MAX) {
        rq->back[(rq->bfirst + rq->bn) % RQ_MAX] = *r;
        rq->bn++;
        w = write(rq->wakefd, &one, sizeof one);
        (void)w;
        kept = 1;
    }
    pthread_mutex_unlock(&rq->lock);
    if (!kept) /* the remote path is off (its READs went to Python), or the ring is full */
        fanfs_remote_fail(r);
}

/* A fill's legs (fanfs_remote_legs), the fill timed until its READs are woken; a request
 * made by hand (the tests') has no stamps. */
static void legs_add(struct remote *rq, const struct fanfs_rreq *r, int64_t began) {
    int64_t now = fanfs_now_ns();
    if (r->queued_ns <= 0 || r->taken_ns < r->queued_ns || began < r->taken_ns)
        return;
    __atomic_add_fetch(&rq->legs[0], 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&rq->legs[1], (uint64_t)(r->taken_ns - r->queued_ns), __ATOMIC_RELAXED);
    __atomic_add_fetch(&rq->legs[2], (uint64_t)(began - r->taken_ns), __ATOMIC_RELAXED);
    __atomic_add_fetch(&rq->legs[3], (uint64_t)(now - began), __ATOMIC_RELAXED);
}

/* A fill of the data plane's (cache lock held: one writer at a time). */
static void lat_add(struct remote *rq, int64_t ns, uint32_t len) {
    uint64_t k = __atomic_load_n(&rq->timed, __ATOMIC_RELAXED);
    __atomic_store_n(&rq->lat_ns[k % RQ_LAT], ns, __ATOMIC_RELAXED);
    __atomic_store_n(&rq->lat_len[k % RQ_LAT], len, __ATOMIC_RELAXED);
    __atomic_store_n(&rq->timed, k + 1, __ATOMIC_RELEASE);
}

int fanfs_remote_latencies(uint64_t since, int64_t *ns, uint32_t *len, int max, uint64_t *now) {
    struct remote *rq = &pool_live()->remote;
    uint64_t end = __atomic_load_n(&rq->timed, __ATOMIC_ACQUIRE), i;
    int n = 0;
    if (end > since + RQ_LAT) /* (the older ones are overwritten) */
        since = end - RQ_LAT;
    for (i = since; i < end && n < max; i++, n++) {
        ns[n] = __atomic_load_n(&rq->lat_ns[i % RQ_LAT], __ATOMIC_RELAXED);
        len[n] = __atomic_load_n(&rq->lat_len[i % RQ_LAT], __ATOMIC_RELAXED);
    }
    *now = since + (uint64_t)n;
    return n;
}

/* Whether slot r->slot still waits for r's piece (cache lock held). */
static int rq_pending_locked(const struct pieces *c, const struct fanfs_rreq *r) {
    const struct pieces_slot *s;
    if (r->slot < 0 || r->slot >= PIECES_SLOTS)
        return 0;
    s = &c->slot[r->slot];
    return s->pending && s->fd == FANFS_REMOTE_FD(r->part) && s->off == r->off &&
           s->len == r->len && s->crc == r->crc;
}

int fanfs_remote_fill(const struct fanfs_rreq *r, const char *stored, uint32_t len) {
    return remote_fill(pool_live(), r, stored, len, 0, NULL, 0);
}

int remote_fill(struct pool *P, const struct fanfs_rreq *r, const char *stored, uint32_t len,
                int64_t asked_ns, char *own, uint32_t own_cap) {
    struct pieces *c = &P->pieces;
    struct fanfs_piece p;
    struct qjob *w;
    char *buf = NULL;
    uint32_t cap = 0;
    int err;
    int64_t began = fanfs_now_ns();
    pthread_mutex_lock(&c->lock);
    err = rq_pending_locked(c, r) ? 0 : ESTALE;
    if (err == 0) {
        p.off = r->off;
        p.len = r->len;
        p.crc = r->crc;
        p.size = c->slot[r->slot].size;
        p.kind = c->slot[r->slot].kind;
        p.cache = 1;
    }
    pthread_mutex_unlock(&c->lock);
    if (err == 0 && (len != r->len || (p.kind == FANFS_KIND_RAW && p.len != p.size)))
        err = FANFS_EBADDATA;
    if (err == 0 && fanfs_crc32(0, stored, len) != r->crc)
        err = FANFS_EBADCRC; /* a bad copy: the MPI thread asks another holder */
    if (err == 0 && p.kind == FANFS_KIND_RAW && own != NULL) { /* the piece as it came */
        buf = own;
        cap = own_cap;
        own = NULL;
    } else if (err == 0 && (buf = pieces_alloc(c, p.size, &cap)) == NULL) {
        err = ENOMEM;
    } else if (err == 0 && p.kind == FANFS_KIND_RAW) {
        memcpy(buf, stored, p.size);
    } else if (err == 0) {
        struct fanfs_dicts *dicts = pool_dicts_hold(&P->work);
        err = fanfs_decode(dicts, &p, (const unsigned char *)stored, (unsigned char *)buf);
        fanfs_dicts_free(dicts);
    }
    pieces_free(c, own, own_cap); /* (`stored` is not used past here) */
    if (err != 0) {
        pieces_free(c, buf, cap);
        return err;
    }
    /* Checked again: a hedged fetch's other copy, or a stop, may have settled it meanwhile. */
    pthread_mutex_lock(&c->lock);
    if (!rq_pending_locked(c, r)) {
        pieces_free_locked(c, buf, cap);
        pthread_mutex_unlock(&c->lock);
        return ESTALE;
    }
    /* Counted before the READs waiting for it are woken: whoever they answer may ask the
     * status next, and finds it counted. */
    __atomic_add_fetch(&P->remote.fetched, 1, __ATOMIC_RELAXED);
    legs_add(&P->remote, r, began);
    if (asked_ns > 0)
        lat_add(&P->remote, fanfs_now_ns() - asked_ns, len);
    w = pieces_ready_locked(c, r->slot, buf, cap, buf);
    pthread_mutex_unlock(&c->lock);
    pool_requeue(&P->work, w);
    return 0;
}

int fanfs_remote_pending(const struct fanfs_rreq *r) {
    struct pieces *c = &pool_live()->pieces;
    int pending;
    pthread_mutex_lock(&c->lock);
    pending = rq_pending_locked(c, r);
    pthread_mutex_unlock(&c->lock);
    return pending;
}

void fanfs_remote_fail(const struct fanfs_rreq *r) {
    struct pool *P = pool_live();
    struct pieces *c = &P->pieces;
    struct qjob *w = NULL;
    pthread_mutex_lock(&c->lock);
    if (rq_pending_locked(c, r)) {
        w = pieces_ready_locked(c, r->slot, NULL, 0, NULL);
        __atomic_add_fetch(&P->remote.failed, 1, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&c->lock);
    pool_requeue(&P->work, w);
}

void fanfs_remote_counters(uint64_t out[3]) {
    struct remote *rq = &pool_live()->remote;
    out[0] = __atomic_load_n(&rq->fetched, __ATOMIC_RELAXED);
    out[1] = __atomic_load_n(&rq->failed, __ATOMIC_RELAXED);
    out[2] = __atomic_load_n(&rq->looked_up, __ATOMIC_RELAXED);
}

void fanfs_remote_legs(uint64_t out[4]) {
    struct remote *rq = &pool_live()->remote;
    int k;
    for (k = 0; k < 4; k++)
        out[k] = __atomic_load_n(&rq->legs[k], __ATOMIC_RELAXED);
}
