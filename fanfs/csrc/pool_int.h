/*
 * What the files of the native read pool share (fanfs_native.h is the contract with Python
 * and the front; this header is not): one `struct pool` with a struct per concern, each
 * handed to the functions of its file.
 *
 *   pieces.c  the cache of decoded pieces (pieces.h: get, ready, release)
 *   pool.c    the pool's threads and job queues, its start and stop; the live pool's handle
 *   jobs.c    a job answered: its pieces got, the reply, errors posted; read-aheads run
 *   push.c    the rest of fresh pieces pushed into the kernel's page cache by one thread
 *   remote.c  peers' pieces, fetched by the MPI thread into the cache
 *   fast.c    READs answered from the catalog's columns with no Python; reads at LOOKUP
 *
 * Each field says what guards it: a lock (locks.h gives their order), "atomic" (read and
 * written with __atomic builtins only), or "immutable while ..." (written only while no other
 * thread can read it). Functions named ..._locked are called with a lock held: the cache's
 * (pieces.lock) unless their comment names another.
 */
#ifndef FANFS_POOL_INT_H
#define FANFS_POOL_INT_H

#define FUSE_USE_VERSION 35
#include <fuse_lowlevel.h>
#include <pthread.h>
#include <stdint.h>

#include "fanfs_native.h"
#include "pieces.h"

#define POOL_THREADS_MAX 64
#define AHEAD_MAX 64 /* queued read-aheads at most; beyond, the stalest is dropped */
#define PUSH_MAX 64  /* queued pushes; beyond, a piece is not pushed (the kernel READs it) */
#define RQ_MAX 256   /* queued fetches of peers' pieces: more than the slots that can wait */
#define LA_REMOTE_MAX 8 /* peers' pieces reserved ahead (LOOKUPs', pushes') pending at once */
#define RQ_LAT 1024     /* the data plane's fills remembered (fanfs_remote_latencies) */
#define LA_RING FANFS_LA_WINDOW   /* lookups remembered, to learn whether READs follow them */
#define WAITING (1 << 30) /* piece_get: the job was hung on a piece being read */

/* Where a READ's answer goes: through libfuse (`req`, a request pyfuse3 took), or written to
 * the FUSE device `fd` for request `unique` (one the front took itself). */
struct target {
    struct fuse_session *se; /* for pushes through libfuse; NULL with `fd` */
    fuse_req_t req;
    int fd;
    uint64_t unique;
};

/* A queued job: owned by whoever holds it (a queue under its lock, the thread running it, or
 * a piece it is hung on, under the cache's lock). */
struct qjob {
    struct qjob *next;
    struct target t; /* t.req NULL and t.fd < 0: a read-ahead */
    int lookahead;   /* a read-ahead started at LOOKUP: run only while its READ is to come */
    struct fanfs_job j;
};

/* A READ, not a read-ahead. */
static inline int qjob_is_read(const struct qjob *qj) {
    return qj->t.req != NULL || qj->t.fd >= 0;
}

/* A piece's decoded bytes for a reply (the calling thread's own). */
struct got {
    const char *data;
    int slot;      /* >= 0: a cache slot, referenced */
    char *own;     /* else a buffer of its own (NULL: a thread buffer) */
    uint32_t cap;
    int fresh;     /* read and decoded for this job */
};

/* -- pool.c: the threads and their queues ------------------------------------------------ */
struct workers {
    pthread_mutex_t lock;
    pthread_cond_t cond;                  /* a job was queued, or the pool stops */
    struct qjob *head, *tail;             /* lock: READs */
    struct qjob *ahead_head, *ahead_tail; /* lock: read-aheads, taken when no READ waits */
    int nahead;                           /* lock */
    uint64_t jobs;                        /* lock: jobs run */
    /* lock; also read without it by pool_enqueue as a hint: a job queued as the pool stops is
     * still run, since the threads leave only once the queue is empty. */
    int stopping;
    /* Written by fanfs_pool_start and fanfs_pool_stop only (the daemon's one thread that owns
     * the pool), before the threads start and after they are joined; read by pool_enqueue. */
    pthread_t threads[POOL_THREADS_MAX];
    int nthreads;
    int errfd; /* immutable while the threads run: where failed jobs are posted */
    /* The dictionaries (a reference of the pool's). A job takes a reference of its own for as
     * long as it decodes (pool_dicts_hold): a new set may come at any time. */
    pthread_mutex_t dlock;
    struct fanfs_dicts *dicts; /* dlock */
};

/* -- push.c: pushes into the kernel's page cache ----------------------------------------- */
struct push_item {
    struct fuse_session *se; /* through libfuse, or NULL: written to `fd` */
    int fd;
    uint64_t ino;
    int slot; /* a cache slot, referenced for the push */
    int64_t pos; /* where the slot's decoded bytes start in the file */
    uint32_t from, to;
};

struct pushes {
    pthread_mutex_t lock;
    pthread_cond_t cond;          /* a push was queued, or the pusher stops */
    struct push_item q[PUSH_MAX]; /* lock: a ring from `first`, `n` long */
    int first, n;                 /* lock */
    int running;                  /* lock: the pusher runs and takes pushes */
    pthread_t thread;             /* the pool's start and stop only */
    uint64_t pushes, bytes, skipped; /* lock */
};

/* -- remote.c: peers' pieces --------------------------------------------------------------- */
struct remote {
    pthread_mutex_t lock;
    struct fanfs_rreq q[RQ_MAX]; /* lock: a ring from `first`, `n` long */
    int first, n;                /* lock */
    int wakefd;                  /* lock: the MPI thread's eventfd; -1: no remote path */
    /* The data plane (plane.c), while attached, takes the queue above (written to `planefd`
     * instead of `wakefd`) and hands what it cannot fetch back to the MPI thread here. */
    struct fanfs_rreq back[RQ_MAX]; /* lock: a ring from `bfirst`, `bn` long */
    int bfirst, bn;                 /* lock */
    int planefd;                    /* lock: the plane's eventfd; -1: no plane attached */
    int on;                      /* atomic (written under lock) */
    int max_waiting;             /* atomic: READs that may wait for peers' pieces at once */
    int64_t wait_ns;             /* atomic: how long one may wait (0: no limit) */
    uint64_t fetched, failed, looked_up; /* atomic */
    uint64_t legs[4];                    /* atomic: fanfs_remote_legs */
    /* The data plane's fills (fanfs_remote_latencies): the last RQ_LAT ones' latency (ns, asked
     * to filled) and stored length, and how many in all; atomic, written under the cache's lock
     * before the READs are woken (whoever they answer may ask the status next). */
    int64_t lat_ns[RQ_LAT];
    uint32_t lat_len[RQ_LAT];
    uint64_t timed;
};

/* -- fast.c: READs answered with no Python, and reads at LOOKUP ---------------------------- */
struct fast {
    struct fanfs_fast_table t; /* immutable while on (fanfs_pool_fast_set refuses then) */
    int on;                    /* atomic */
    /* The arrays: allocated while off (immutable while on); their elements are atomic. */
    int *fd, *dfd;   /* per partition, -1 until staged */
    uint8_t *bad;    /* per entry: a job failed, Python answers from now on */
    uint8_t *plan;   /* per entry: FANFS_PLAN_HELD, FANFS_PLAN_AHEAD (fanfs_pool_plan_mark) */
    int32_t *owners; /* immutable while on: per partition, FANFS_MAX_OWNERS ranks (-1: none) */
    uint8_t *remote; /* immutable while on: per partition, held by peers only */
    uint64_t taken;  /* atomic: READs it answered */
};

struct lookahead { /* every field: lock */
    pthread_mutex_t lock;
    uint64_t ino[LA_RING];
    uint8_t fetched[LA_RING];
    int n;     /* entries, oldest first */
    int share; /* the recent share of lookups that were read, in 1/256 */
    uint64_t started, used, unused;
};

/* -- the pool: one object, built in pool.c --------------------------------------------------- */
struct pool {
    struct pieces pieces;
    struct workers work;
    struct pushes push;
    struct remote remote;
    struct fast fast;
    struct lookahead la;
    /* atomic: READs and lookups answered by the front's threads right now (fast.c); the
     * pool's stop waits for none before it frees the cache they may hold pieces of. */
    int answering;
    struct fuse_session *last_session; /* atomic: read-aheads push through the READs' session */
    struct fanfs_budget ahead;         /* the reads at LOOKUP, traced (n[0], ns[0]) */
};

/* The live pool: the handle every fanfs_native.h function resolves (they take none, so that
 * fanfs/_native.pyx and front.c need no handle of their own). */
struct pool *pool_live(void);

/* pool.c */
struct fanfs_dicts *pool_dicts_hold(struct workers *w); /* until fanfs_dicts_free */
void pool_requeue(struct workers *w, struct qjob *hung); /* READs hung on a settled piece */
int pool_enqueue(struct pool *P, const struct target *t, int lookahead,
                 const struct fanfs_job *job);
/* Settle slot i (pieces_ready) and requeue the READs hung on it. */
void pool_settle(struct pool *P, int i, char *buf, uint32_t cap, const char *data);

/* jobs.c */
int job_answer(struct pool *P, struct qjob *qj, const struct target *t,
               const struct fanfs_job *j);
void job_run(struct pool *P, struct qjob *qj); /* a READ or a read-ahead, freed when done */
void job_buffers_trim(void);

/* push.c */
void push_queue(struct pool *P, const struct target *t, uint64_t ino, int i, int64_t pos,
                uint32_t from, uint32_t to);
void push_rest(struct pool *P, const struct target *t, const struct fanfs_job *j,
               const struct got *got, const int *held);
int push_start(struct pool *P);
void push_stop(struct pool *P);
void push_counters(struct pushes *q, struct fanfs_pool_stats *out);

/* remote.c */
#define REMOTE_AHEAD_WAIT_NS 5000000000LL /* the planner's wait for a peer's piece, at most */
int remote_piece(struct pool *P, const struct fanfs_job *j, const struct fanfs_piece *p,
                 struct got *g, int front);
int remote_reserve_locked(struct pool *P, const struct fanfs_job *j,
                          const struct fanfs_piece *p, int ahead);
void remote_fail_pending(struct pool *P);
/* The plane's side of the queue: attach (its eventfd is written for new requests from now on;
 * 0, or -1 when the remote path is off), detach (the MPI thread takes them again), take the
 * new requests, and hand one back to the MPI thread (`tried`: the holder the plane asked). */
int remote_plane_attach(struct pool *P, int fd);
void remote_plane_detach(struct pool *P);
int remote_plane_take(struct pool *P, struct fanfs_rreq *out, int max);
void remote_hand_back(struct pool *P, const struct fanfs_rreq *r);
/* fanfs_remote_fill for the plane: its latency since `asked_ns` remembered too, and `own`
 * (NULL, or `stored`'s buffer: from pieces_alloc, `own_cap` bytes) given to the fill, which
 * frees it or, for a raw piece, makes it the piece (no copy). */
int remote_fill(struct pool *P, const struct fanfs_rreq *r, const char *stored, uint32_t len,
                int64_t asked_ns, char *own, uint32_t own_cap);

/* fast.c */
void fast_mark_bad(struct fast *f, int64_t entry);
int lookahead_wanted(struct lookahead *la, uint64_t ino);

#endif
