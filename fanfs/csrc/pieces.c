/*
 * The pool's cache of decoded pieces: its get/ready/release protocol is in pieces.h. All its
 * state is a `struct pieces`, guarded by its lock; this file reads no other state.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "pieces.h"
#include "pool_int.h"

/* What a piece's buffer will take, as counted before it is allocated: its decoded size in
 * whole pages (a raw piece's buffer also holds a direct read's alignment). Settled at the
 * allocation's own size when the slot is filled. */
static uint32_t piece_charge(const struct fanfs_piece *p) {
    uint64_t n = p->kind == FANFS_KIND_RAW ? (uint64_t)p->len + 2 * FANFS_DIRECT_ALIGN : p->size;
    return (uint32_t)((n + FANFS_DIRECT_ALIGN - 1) / FANFS_DIRECT_ALIGN * FANFS_DIRECT_ALIGN);
}

static int slot_is(const struct pieces_slot *s, int fd, const struct fanfs_piece *p) {
    return (s->buf != NULL || s->pending) && s->fd == fd && s->off == p->off &&
           s->len == p->len && s->crc == p->crc && s->size == p->size && s->kind == p->kind;
}

int pieces_find_locked(const struct pieces *c, int fd, const struct fanfs_piece *p) {
    int i, found = -1;
    for (i = 0; i < PIECES_SLOTS; i++)
        if (slot_is(&c->slot[i], fd, p))
            found = i;
    return found;
}

int pieces_may_wait_locked(const struct pieces *c, int limit) {
    return limit <= 0 || c->waiting < limit;
}

/* Slot s is got, evicted or given up: no longer a piece asked ahead that nobody has had. */
static void unask_locked(struct pieces *c, struct pieces_slot *s) {
    if (s->asked) {
        s->asked = 0;
        c->asked--;
    }
}

int pieces_get_locked(struct pieces *c, int fd, const struct fanfs_piece *p,
                      const struct pieces_wait *how, int *slot, int *unpushed) {
    struct pieces_slot *s;
    int i, err;
    for (;;) {
        if ((i = pieces_find_locked(c, fd, p)) < 0)
            return PIECES_ABSENT;
        s = &c->slot[i];
        if (!s->pending)
            break;
        if (how->hang != NULL) {
            how->hang->next = s->waiters;
            s->waiters = how->hang;
            return PIECES_HUNG;
        }
        if (!how->counted) {
            err = how->deadline != NULL ? pthread_cond_clockwait(&c->ready, &c->lock,
                                                                 CLOCK_MONOTONIC, how->deadline)
                                        : pthread_cond_wait(&c->ready, &c->lock);
            if (err == ETIMEDOUT)
                return PIECES_GAVE_UP;
            continue;
        }
        if (!pieces_may_wait_locked(c, how->limit))
            return PIECES_GAVE_UP;
        c->waiting++;
        err = how->deadline != NULL ? pthread_cond_clockwait(&c->ready, &c->lock,
                                                             CLOCK_MONOTONIC, how->deadline)
                                    : pthread_cond_wait(&c->ready, &c->lock);
        c->waiting--;
        if (err == ETIMEDOUT)
            return PIECES_GAVE_UP;
    }
    s->refs++;
    s->used = ++c->clock;
    s->taken = 1;
    unask_locked(c, s);
    *unpushed = s->unpushed;
    s->unpushed = 0;
    c->hits++;
    *slot = i;
    return PIECES_HIT;
}

/* A slot for `size` more bytes: settled pieces nobody uses are evicted until the bytes allow
 * `size` more and a slot is free; -1 when every piece is in use (or `size` alone is more than
 * the cache holds). Pieces already had (`taken`) go first, least recently used first: an
 * epoch reads each file once, while a piece nobody has had yet was asked ahead for a READ or
 * a push about to take it (a planned epoch's pushers ask up to eight ahead each, and under
 * load those were evicted before their push came, and fetched again: 1.14-1.36 fetches per
 * peer's file, docs/performance.md). Only while young, though (PIECES_UNTAKEN_KEPT gets
 * or reservations since its own): one never had (a LOOKUP with no READ, a push that gave up)
 * then ages as any other, and the cache never fills with them. */
static int room_locked(struct pieces *c, uint32_t size) {
    int i, empty, victim, fresh;
    struct pieces_slot *s;
    for (;;) {
        empty = victim = fresh = -1;
        for (i = 0; i < PIECES_SLOTS; i++) {
            s = &c->slot[i];
            if (s->refs != 0 || s->pending)
                continue;
            if (s->buf == NULL) {
                if (empty < 0)
                    empty = i;
            } else if (s->taken || c->clock - s->used > PIECES_UNTAKEN_KEPT) {
                if (victim < 0 || s->used < c->slot[victim].used)
                    victim = i;
            } else if (fresh < 0 || s->used < c->slot[fresh].used) {
                fresh = i;
            }
        }
        if (empty >= 0 && c->bytes + size <= PIECES_BYTES)
            return empty;
        if (victim < 0)
            victim = fresh;
        if (victim < 0)
            return -1;
        s = &c->slot[victim];
        unask_locked(c, s);
        c->bytes -= s->charge;
        s->charge = 0;
        pieces_free_locked(c, s->buf, s->cap);
        s->buf = NULL;
        s->data = NULL;
    }
}

int pieces_reserve_locked(struct pieces *c, int fd, const struct fanfs_piece *p, int refs,
                          int unpushed, int ahead) {
    struct pieces_slot *s;
    int i = room_locked(c, piece_charge(p));
    if (i < 0)
        return -1;
    s = &c->slot[i];
    s->fd = fd;
    s->off = p->off;
    s->len = p->len;
    s->crc = p->crc;
    s->size = p->size;
    s->kind = p->kind;
    s->used = ++c->clock;
    s->pending = 1;
    s->unpushed = unpushed;
    s->ahead = ahead;
    s->asked = ahead != 0;
    s->refs = refs;
    s->taken = refs > 0 && !unpushed; /* (read ahead unpushed: its READ is to come) */
    s->waiters = NULL;
    s->charge = piece_charge(p);
    c->bytes += s->charge; /* counted now: the room is taken */
    c->ahead += ahead;
    c->asked += s->asked;
    return i;
}

struct qjob *pieces_ready_locked(struct pieces *c, int i, char *buf, uint32_t cap,
                                 const char *data) {
    struct pieces_slot *s = &c->slot[i];
    struct qjob *w = s->waiters;
    s->pending = 0;
    s->buf = buf;
    s->cap = cap;
    s->data = data;
    if (buf == NULL) {
        unask_locked(c, s);
        c->bytes -= s->charge;
        s->charge = 0;
        s->refs = 0;
    } else { /* what it allocated, counted from now on */
        c->bytes += (uint64_t)cap - s->charge;
        s->charge = cap;
    }
    if (s->ahead) {
        s->ahead = 0;
        c->ahead--;
    }
    s->waiters = NULL;
    pthread_cond_broadcast(&c->ready);
    return w;
}

struct qjob *pieces_ready(struct pieces *c, int i, char *buf, uint32_t cap, const char *data) {
    struct qjob *w;
    pthread_mutex_lock(&c->lock);
    w = pieces_ready_locked(c, i, buf, cap, data);
    pthread_mutex_unlock(&c->lock);
    return w;
}

void pieces_ref(struct pieces *c, int i) {
    pthread_mutex_lock(&c->lock);
    c->slot[i].refs++;
    pthread_mutex_unlock(&c->lock);
}

void pieces_release(struct pieces *c, int i) {
    pthread_mutex_lock(&c->lock);
    c->slot[i].refs--;
    pthread_mutex_unlock(&c->lock);
}

char *pieces_alloc(struct pieces *c, uint64_t size, uint32_t *cap) {
    int i, best = -1;
    char *buf = NULL;
    pthread_mutex_lock(&c->lock);
    for (i = 0; i < PIECES_SPARES; i++) /* (one much larger than asked would be charged in full) */
        if (c->spare[i].buf != NULL && c->spare[i].cap >= size &&
            c->spare[i].cap <= 2 * size + 2 * FANFS_DIRECT_ALIGN &&
            (best < 0 || c->spare[i].cap < c->spare[best].cap))
            best = i;
    if (best >= 0) {
        buf = c->spare[best].buf;
        *cap = c->spare[best].cap;
        c->spare[best].buf = NULL;
        c->spare_bytes -= *cap;
    }
    pthread_mutex_unlock(&c->lock);
    return buf != NULL ? buf : fanfs_alloc(size, cap);
}

void pieces_free_locked(struct pieces *c, char *buf, uint32_t cap) {
    int i;
    if (buf == NULL)
        return;
    if (cap <= PIECES_SPARE_MAX && c->spare_bytes + cap <= PIECES_SPARE_BYTES)
        for (i = 0; i < PIECES_SPARES; i++)
            if (c->spare[i].buf == NULL) {
                c->spare[i].buf = buf;
                c->spare[i].cap = cap;
                c->spare_bytes += cap;
                return;
            }
    free(buf);
}

void pieces_free(struct pieces *c, char *buf, uint32_t cap) {
    pthread_mutex_lock(&c->lock);
    pieces_free_locked(c, buf, cap);
    pthread_mutex_unlock(&c->lock);
}

int pieces_busy(struct pieces *c) {
    int i, busy = 0;
    pthread_mutex_lock(&c->lock);
    for (i = 0; i < PIECES_SLOTS; i++)
        busy |= c->slot[i].pending && c->slot[i].fd > FANFS_REMOTE_FD(0);
    pthread_mutex_unlock(&c->lock);
    return busy;
}

void pieces_drop(struct pieces *c) {
    int i;
    pthread_mutex_lock(&c->lock);
    for (i = 0; i < PIECES_SLOTS; i++) {
        struct pieces_slot *s = &c->slot[i];
        if (s->buf != NULL && s->refs == 0 && !s->pending) {
            unask_locked(c, s);
            c->bytes -= s->charge;
            s->charge = 0;
            pieces_free_locked(c, s->buf, s->cap);
            s->buf = NULL;
            s->data = NULL;
        }
    }
    pthread_mutex_unlock(&c->lock);
}

void pieces_free_spares(struct pieces *c) {
    int i;
    pthread_mutex_lock(&c->lock);
    for (i = 0; i < PIECES_SPARES; i++) {
        free(c->spare[i].buf);
        c->spare[i].buf = NULL;
    }
    c->spare_bytes = 0;
    pthread_mutex_unlock(&c->lock);
}

void pieces_clear(struct pieces *c) {
    int i;
    pthread_mutex_lock(&c->lock);
    for (i = 0; i < PIECES_SLOTS; i++) {
        free(c->slot[i].buf);
        memset(&c->slot[i], 0, sizeof c->slot[i]);
    }
    for (i = 0; i < PIECES_SPARES; i++) {
        free(c->spare[i].buf);
        c->spare[i].buf = NULL;
    }
    c->bytes = c->spare_bytes = 0;
    c->asked = 0;
    pthread_mutex_unlock(&c->lock);
}

void pieces_counters(struct pieces *c, uint64_t *hits, uint64_t *misses) {
    pthread_mutex_lock(&c->lock);
    *hits = c->hits;
    *misses = c->misses;
    pthread_mutex_unlock(&c->lock);
}
