/*
 * The data plane's insides (plane.c: its fetches, its thread, start and stop; plane_wire.c:
 * its messages, its sends and the owner's answers). fanfs_native.h's plane section is the
 * contract; this header is not. Everything here is the plane thread's alone but what a field
 * says otherwise.
 */
#ifndef FANFS_PLANE_H
#define FANFS_PLANE_H

#include <mpi.h>
#include <pthread.h>

#include "pool_int.h"

enum { ASKED, FILLED, HANDED_BACK, ANSWERED, ANSWERED_BYTES, REFUSED, MALFORMED, OWNER_N,
       OWNER_READ_NS, OWNER_POST_NS, HEDGED, HEDGES_WON, OWNER_QUEUE_NS, LEFT };


#define TAG_ASK FANFS_PLANE_ASK
#define FIRST_TAG FANFS_PLANE_FIRST_TAG
#define PLANE_HEADER (4 * (int)sizeof(int64_t)) /* magic, entry, stored length, reply tag */
#define PLANE_OUT 256
#define PLANE_SENDS 512
#define PLANE_REPLY_BYTES (64u << 20)
/* ... of them for one peer: a requester that never takes its replies (whose sends then never
 * end) holds at most this, not the whole budget. */
#define PLANE_PEER_BYTES (4 * FANFS_REMOTE_MAX)
#define PLANE_SPIN_NS 300000
#define WATCH_NS 1000000        /* the MPI thread's messages looked for this often, */
#define WATCH_MAX_NS 100000000LL /* ... backing off to this while a message stays (mpi.py) */
#define PLANE_HOT_NS 20000000
#define POLL_MIN_NS 20000
#define POLL_MAX_NS 2000000
#define PLANE_QUIET_NS 2000000000LL /* no traffic this long: the sleeps grow ... */
#define POLL_QUIET_NS 10000000      /* ... to this (a peer's first ask then waits that long) */
#define SETTLE_NS 1000000000LL
#define PLANE_MAX_RANKS (1 << 20)
#define PLANE_READERS 4 /* the owner's reading threads (plane_read.c) */
#define PLANE_READS 64  /* asks between submit and take at most */
#define PLANE_INLINE (256u << 10) /* asks up to this are read by the plane's thread itself */
#define PLANE_TAKES 64               /* receives of matched messages in flight at most, */
#define PLANE_TAKE_BYTES (64u << 20) /* ... and their bytes */
/* Sends or receives in flight with nothing moving this long keep the plane polling no more:
 * a dead peer's never end. */
#define PLANE_STALL_NS 100000000LL

struct out { /* a fetch of ours, by reply tag */
    int state; /* 0 free, 1 out, 2 given back: quarantined until its reply or `deadline` */
    int tag, peer;
    int hedge; /* asked of another holder because the first one was slow */
    int64_t began, deadline, hedge_at;
    struct fanfs_rreq r;
};

struct send { /* a send in flight: its buffer lives until MPI says it is done */
    MPI_Request req;
    char *buf;      /* a read's buffer (from pieces_alloc), an ask's header (malloc'd), or NULL */
    uint32_t cap;   /* a read's buffer's (then a spare for the next read), else 0 */
    uint32_t bytes; /* reserved of PLANE_REPLY_BYTES, and of its peer's PLANE_PEER_BYTES */
    int peer;
    int64_t at; /* posted */
};

struct take { /* a matched message being received: `buf` is MPI's until the receive is done */
    MPI_Request req;
    char *buf;    /* from pieces_alloc: a raw reply becomes its piece as it is */
    uint32_t cap; /* `buf`'s */
    int n, peer, tag; /* tag: the reply tag it came on, or -1: it is dropped */
    int64_t until;    /* not done by then: left to MPI, with its buffer, for good */
};

struct plane_read { /* an ask to read, then its completion (plane_read.c) */
    int peer, tag;
    int64_t entry;
    uint32_t len;
    int err;   /* 0: `buf` holds the `len` stored bytes from `at` on, else NULL */
    char *buf; /* from pieces_alloc, `cap` bytes (an O_DIRECT read's start is aligned) */
    uint32_t cap, at;
    int64_t taken_ns, began_ns, read_ns; /* taken by the plane, read begun, read done */
};

struct plane_reads {
    pthread_mutex_t lock;
    pthread_cond_t work; /* an ask queued, or the stop */
    struct plane_read todo[PLANE_READS]; /* lock: a ring from `thead`, `tn` long */
    struct plane_read done[PLANE_READS]; /* lock: a ring from `dhead`, `dn` long */
    int thead, tn, dhead, dn, inflight, stopping; /* lock */
    int wakefd, nthreads;                         /* immutable while the readers run */
    pthread_t threads[PLANE_READERS];
};

struct plane {
    pthread_t thread;
    int running, stopping; /* the owner's; `stopping` atomic */
    int wakefd;
    struct fanfs_plane_conf c;
    MPI_Comm comm;
    MPI_Datatype byte;
    __typeof__(MPI_Isend) *isend;
    __typeof__(MPI_Improbe) *improbe;
    __typeof__(MPI_Mrecv) *mrecv;
    __typeof__(MPI_Imrecv) *imrecv;
    __typeof__(MPI_Test) *test;
    __typeof__(MPI_Get_count) *get_count;
    __typeof__(MPI_Iprobe) *iprobe;
    MPI_Comm watch;     /* the MPI thread's (conf: watch, watch_fd) */
    int64_t watch_at, watch_ns; /* when a message was last looked for; how long until again */
    uint8_t *dead; /* atomic, per rank (`ranks` of them, set with it, never freed) */
    int ranks;
    int64_t hedge_ns; /* atomic: fanfs_plane_hedge */
    uint64_t counts[FANFS_PLANE_COUNTS]; /* atomic: fanfs_plane_counters */
    struct out out[PLANE_OUT];
    int nout, nwait, next_tag; /* slots not free, slots out (set_state) */
    struct send sends[PLANE_SENDS];
    int nsends;
    uint32_t reply_bytes; /* of replies sent and not done, and of reads not taken */
    uint32_t *peer_bytes; /* per rank, its share of reply_bytes (at most PLANE_PEER_BYTES) */
    struct plane_reads reads;
    struct take takes[PLANE_TAKES];
    int ntakes;
    uint32_t take_bytes;
};

static inline void count(struct plane *pl, int what, uint64_t n) {
    __atomic_add_fetch(&pl->counts[what], n, __ATOMIC_RELAXED);
}

/* plane_wire.c */
/* MPI's functions looked up in `lib` (loaded: RTLD_NOLOAD); 0, or ENOENT. */
int plane_resolve(struct plane *pl, const char *lib);
/* Post a send of `len` bytes of `buf` (malloc'd or NULL, owned from now on, freed once MPI is
 * done with it; `bytes` of PLANE_REPLY_BYTES reserved until then). 0, or -1 (no room, or MPI
 * refused it: `buf` is freed). */
int plane_post(struct plane *pl, char *buf, uint32_t len, uint32_t bytes, int peer, int tag);
/* The sends MPI is done with let go, and those to a peer found dead, out for quarantine_ns
 * (they may never end: their buffers are then MPI's for good, counted LEFT); 1 if any. */
int plane_settle(struct plane *pl);
int plane_receive(struct plane *pl); /* every message waiting taken; 1 if any */
/* Receive matched message `m` of `n` bytes into `buf` now: only one MPI holds whole once
 * matched (an ask's header, an empty reply: far under any MPI's eager size). 0, or -1. */
int plane_take(struct plane *pl, MPI_Message *m, void *buf, int n);
/* Receive matched message `m` of `n` bytes from `peer` (up to FANFS_REMOTE_MAX, larger left
 * unreceived), in the background: plane_replied has it once done, or it is dropped (`tag`
 * -1). A receive not done within quarantine_ns (its sender died mid-send: Open MPI never ends
 * it) is left to MPI with its buffer, counted LEFT. */
void plane_take_later(struct plane *pl, MPI_Message *m, int n, int peer, int tag);
int plane_takes(struct plane *pl, int64_t now); /* the receives done handed on; 1 if any */
void plane_drop(struct plane *pl, MPI_Message *m, int peer, int n); /* malformed: dropped */

int plane_collect(struct plane *pl); /* the reads done sent (or refused); 1 if any */
/* A message waiting on the MPI thread's communicator wakes that thread (conf: watch); 1 if
 * it is a new one (the plane's own sleeps stay short while that thread has traffic). */
int plane_watch(struct plane *pl, int64_t now);

/* plane_read.c */
int plane_reads_start(struct plane_reads *q, int wakefd); /* 0, or an errno */
void plane_reads_stop(struct plane_reads *q);
int plane_read_submit(struct plane_reads *q, const struct plane_read *r); /* 0, or -1: full */
int plane_read_take(struct plane_reads *q, struct plane_read *out, int max);
void plane_read_one(struct plane_read *r); /* read in the calling thread */

/* plane.c */
/* The requester: a reply of `n` bytes from `peer` on `tag` (a reply tag). */
void plane_reply(struct plane *pl, MPI_Message *m, int peer, int tag, int n);
/* ... and its `n` bytes received into `buf` (from pieces_alloc, `cap` bytes; given to the
 * fill, or freed here; NULL: the receive failed or was left). */
void plane_replied(struct plane *pl, int peer, int tag, char *buf, uint32_t cap, int n);

#endif
