/*
 * The pool's cache of decoded pieces (pieces.c): get, ready, release.
 *
 * A piece is found by its key (the partition's fd and where and what its stored bytes are).
 * Its slot is in one of three states: empty, pending (a thread, or a peer through the MPI
 * thread, is reading it: `pending`, no bytes yet) or filled (`buf`, `data`). The protocol,
 * the same for every caller (a READ of the pool, a READ of the front, a read-ahead, a peer's
 * piece reserved at LOOKUP):
 *
 *   lock c->lock
 *   pieces_get_locked(c, fd, p, &how, &i, &unpushed)   the one search-and-wait:
 *       PIECES_HIT     slot i is filled and referenced for the caller (refs + 1);
 *       PIECES_ABSENT  no slot holds it: the caller may reserve one (pieces_reserve_locked,
 *                      the one set-up: a pending slot, evicting settled pieces nobody uses)
 *                      and read it, or read it on its own (no room, or not worth caching);
 *       PIECES_HUNG    it is pending and `how.hang` (a queued READ) was hung on it: the READ
 *                      is another thread's from now on, handed back by pieces_ready;
 *       PIECES_GAVE_UP it is pending and the caller may not wait for it (how.limit) or
 *                      waited until how.deadline.
 *   unlock
 *   ... read and decode a reserved slot's piece without the lock ...
 *   pieces_ready(c, i, buf, cap, data)   fills it (buf NULL: gives it up, the bytes could
 *       not be had), wakes whoever waits for it and returns the READs hung on it, which the
 *       caller requeues (with the cache lock let go: the pool's lock is never taken under it);
 *   pieces_release(c, i)                 lets a reference go: a slot is evicted only while
 *       nobody references it and it is not pending.
 *
 * Any thread may call any of it. Every function named ..._locked is called with c->lock
 * held; the others take it. Lock order (locks.h): c->lock is taken before the remote path's
 * lock and after the pushes' lock, never with the pool's queue lock held or taking it.
 */
#ifndef FANFS_PIECES_H
#define FANFS_PIECES_H

#include <pthread.h>
#include <stdint.h>
#include <time.h>

#include "fanfs_native.h"

#define PIECES_SLOTS 32
/* A piece nobody has had yet is evicted after those already had, while fewer than this many
 * gets and reservations came after its own (pieces.c, room_locked). */
#define PIECES_UNTAKEN_KEPT (4 * PIECES_SLOTS)
#define PIECES_BYTES (64u << 20) /* decoded bytes the slots hold, about, at most */
/* Pieces asked ahead (a LOOKUP's, a planned epoch's push's) that nobody has got yet: a push
 * asks ahead only while fewer than this many are (jobs.c, push_ask; a LOOKUP's ask is bounded
 * by LA_REMOTE_MAX alone). A planned epoch's 8 pushers, each asking FANFS_PUSH_TOGETHER ahead,
 * had up to 64 such pieces in the 32 slots: they went before their pushes came, which fetched
 * them again (1.4-1.6 fetches a peer's file, docs/performance.md). */
#define PIECES_ASKED_MAX (PIECES_SLOTS / 2)
#define PIECES_SPARES 8 /* freed piece buffers kept for the next piece: pages mapped already */
/* A spare is kept only up to one compressed piece (4 MiB, plus a direct read's alignment) and
 * PIECES_SPARE_BYTES in all: a larger buffer is rarely asked for again, and a spare is memory
 * that the cache's budget does not see. */
#define PIECES_SPARE_MAX ((4u << 20) + 2 * FANFS_DIRECT_ALIGN)
#define PIECES_SPARE_BYTES (16u << 20)

struct qjob; /* a queued READ of the pool (pool_int.h), hung on a pending piece */

struct pieces_slot { /* every field: guarded by the cache's lock */
    int fd;
    int64_t off;
    uint32_t len, crc, size;
    uint8_t kind;          /* the key: where the stored piece is, and what it is */
    char *buf;             /* its allocation (NULL: an empty slot, or pending) */
    uint32_t cap;
    uint32_t charge;       /* bytes counted for it in `bytes`: its allocation's, once made */
    const char *data;      /* its decoded bytes, inside buf (read without the lock by a
                              holder of a reference: immutable while referenced) */
    int refs;              /* replies and pushes using it: never evicted while > 0 */
    int pending;           /* a thread is reading it */
    int unpushed;          /* read ahead with no push: the first READ of it pushes the rest */
    int ahead;             /* a peer's piece reserved at a LOOKUP, counted in `ahead` */
    int asked;             /* reserved ahead and not got since: counted in `asked` */
    int taken;             /* got by a READ or a push since it was reserved (or reserved by
                              its reader): evicted before a piece nobody has had yet */
    uint64_t used;         /* `clock` when last got: the least recent is evicted first */
    struct qjob *waiters;  /* READs hung on it until it is read */
};

struct pieces {
    pthread_mutex_t lock;
    pthread_cond_t ready; /* a pending slot was filled or given up (waiting callers) */
    struct pieces_slot slot[PIECES_SLOTS]; /* lock */
    struct {
        char *buf;
        uint32_t cap;
    } spare[PIECES_SPARES]; /* lock */
    uint64_t spare_bytes;   /* lock: the spares' caps */
    uint64_t clock, hits, misses; /* lock */
    uint64_t bytes; /* lock: what the slots hold or will, their charges (PIECES_BYTES at most) */
    int ahead;   /* lock: pending peers' pieces reserved at LOOKUP */
    int asked;   /* lock: pieces reserved ahead that nobody has got yet (PIECES_ASKED_MAX) */
    int waiting; /* lock: callers waiting with a limit (READs of the front for a peer's piece) */
};

#define PIECES_INIT {.lock = PTHREAD_MUTEX_INITIALIZER, .ready = PTHREAD_COND_INITIALIZER}

/* How pieces_get_locked treats a pending piece. */
struct pieces_wait {
    struct qjob *hang; /* not NULL: hang this READ on it (PIECES_HUNG), never wait */
    int counted;       /* wait counted in c->waiting, at most `limit` at once (<= 0: no limit);
                          else uncounted, with no limit. Either until `deadline`
                          (CLOCK_MONOTONIC; NULL: as long as it takes). */
    int limit;
    const struct timespec *deadline;
};

enum { PIECES_HIT, PIECES_ABSENT, PIECES_HUNG, PIECES_GAVE_UP };

/* The slot holding piece p of fd (pending or filled), or -1. */
int pieces_find_locked(const struct pieces *c, int fd, const struct fanfs_piece *p);
/* Search, wait as `how` says, and on a hit take a reference (*slot) and say whether it was
 * read ahead with no push (*unpushed, cleared: its first READ pushes the rest). */
int pieces_get_locked(struct pieces *c, int fd, const struct fanfs_piece *p,
                      const struct pieces_wait *how, int *slot, int *unpushed);
/* Whether one more counted caller may wait (`limit` <= 0: no limit). */
int pieces_may_wait_locked(const struct pieces *c, int limit);
/* Reserve a pending slot for piece p of fd with `refs` references (the reader's own, or none
 * for a peer's piece), its unpushed and ahead marks; its decoded size is counted now. The
 * slot, or -1 when every slot or byte is in use. */
int pieces_reserve_locked(struct pieces *c, int fd, const struct fanfs_piece *p, int refs,
                          int unpushed, int ahead);
/* Fill a pending slot (buf NULL: give it up, its references dropped with it), wake whoever
 * waits; the READs hung on it, for the caller to requeue once the lock is let go. The caller
 * keeps its reference when it filled it. */
struct qjob *pieces_ready_locked(struct pieces *c, int i, char *buf, uint32_t cap,
                                 const char *data);
struct qjob *pieces_ready(struct pieces *c, int i, char *buf, uint32_t cap, const char *data);
void pieces_ref(struct pieces *c, int i);
void pieces_release(struct pieces *c, int i);

/* A buffer of at least `size` bytes for a piece: a spare one if one is big enough, else new. */
char *pieces_alloc(struct pieces *c, uint64_t size, uint32_t *cap);
/* Give a piece's buffer back: kept as a spare while there is room. */
void pieces_free_locked(struct pieces *c, char *buf, uint32_t cap);
void pieces_free(struct pieces *c, char *buf, uint32_t cap);

/* Whether a piece of a local partition is being read (no READ of the pool waits on a peer's). */
int pieces_busy(struct pieces *c);
/* Evict every settled piece nobody uses. */
void pieces_drop(struct pieces *c);
/* Free every slot and spare: nobody uses the cache any more (the pool's stop). */
void pieces_clear(struct pieces *c);
/* Free the spares alone (the data plane's stop: its buffers came back after the pool's). */
void pieces_free_spares(struct pieces *c);
void pieces_counters(struct pieces *c, uint64_t *hits, uint64_t *misses);

#endif
