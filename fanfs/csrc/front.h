/*
 * The front's parts, for the front's own files (not the contract: that is fanfs_native.h).
 *
 *   wire.c     the kernel's protocol: the INIT (its layouts, flag_since, the tests' pretend
 *              rewrite), replies, notify_store, failing a request; struct fanfs_wire.
 *   meta.c     the catalog as the front reads it: LOOKUP's search and the attributes GETATTR
 *              and LOOKUP answer with (pure: no I/O, no lock; struct fanfs_meta is immutable).
 *   answer.c   what a front thread answers itself (LOOKUP, GETATTR, READ, IOCTL, FORGET...;
 *              in writes mode WRITE) and what it forwards.
 *   forward.c  the forward queue to pyfuse3's session loop: its receiver, the drain.
 *   front.c    the threads: start, the leader and its followers, the stop; counters.
 *   follow.c   what a planned epoch follows (struct fanfs_follow), the READs' latencies
 *              (struct fanfs_latencies) and their budget (struct fanfs_budget).
 *   writes.c   writes behind, for the output wing (struct fanfs_writes).
 *   cpu.c      the kernel's CPU pressure, sampled.
 * Imports go one way: front -> answer, forward -> meta, wire, follow, writes, the pool; the
 * pool -> wire. Nothing calls back into front.c.
 *
 * Locks (all leaves: nothing is taken under any of them, and none is held across a call into
 * the pool): fanfs_front.lock, fanfs_follow.lock, fanfs_writes.lock.
 *
 * Fields are marked with what guards them: a lock, "atomic" (read and written with
 * __atomic_*), "immutable while running" (written by the owner before the threads start),
 * or "leader only" (the thread that holds the lead, handed on under fanfs_front.lock).
 */
#ifndef FANFS_FRONT_H
#define FANFS_FRONT_H

#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>

#include "fanfs_native.h"

struct fuse_in_header;
struct fuse_attr;
struct fuse_entry_out;
struct fuse_attr_out;

#define FRONT_MAX_THREADS 32

/* -- wire.c: the kernel's protocol as this session speaks it ------------------------------ */

struct fanfs_wire {
    int pretend;     /* rewrite the INIT to protocol 7.pretend (tests; 0: no): immutable while
                        running */
    long page;       /* the page size the buffer is sized from (0: the machine's): immutable
                        while running */
    int minor;       /* atomic: the kernel's protocol minor, 0 until its INIT (-1: not major
                        7); stored (release) after major, kminor and kflags */
    uint32_t major, kminor; /* as its INIT said them: written once, before `minor` */
    uint64_t kflags;        /* the flags the INIT offered (flags2 in the high half): as above */
    int why;         /* atomic: FANFS_FRONT_WHY_*, why the front forwards everything */
};

/* Forget what the last session's INIT said (the owner, before the threads start). */
void fanfs_wire_reset(struct fanfs_wire *w);
/* The buffer size for `page`-byte pages (<= 0: 4 KiB), and for the machine's. */
size_t fanfs_wire_bufsize_for(long page);
size_t fanfs_wire_libfuse_bufsize(void);
size_t fanfs_wire_bufsize(const struct fanfs_wire *w);
/* An INIT taken (`n` bytes in `buf`): rewritten when pretending, then recorded. Its length.
 * By the thread that took it. */
ssize_t fanfs_wire_init(struct fanfs_wire *w, char *buf, ssize_t n);
/* The minor the kernel speaks (acquire: what the INIT said is then readable). */
int fanfs_wire_minor(const struct fanfs_wire *w);
/* fanfs_front_kernel's answer; out[4] is left to the caller. */
void fanfs_wire_said(const struct fanfs_wire *w, uint64_t out[5]);
/* Fail request `msg` with `err` on `fd` (FORGET and the like have no reply). */
void fanfs_wire_fail(int fd, const char *msg, int err);

/* -- meta.c: the catalog ------------------------------------------------------------------- */

/* Entry `e`'s attributes as the kernel wants them. */
void fanfs_meta_fill(const struct fanfs_meta *m, uint64_t e, struct fuse_attr *a);
/* The name in a LOOKUP's argument (`arglen` bytes) under inode `nodeid`: its entry, -2 (no such
 * name: a negative entry), or -1 (libfuse's answer is the rule: ".", "..", no NUL, ...). */
int64_t fanfs_meta_find(const struct fanfs_meta *m, uint64_t nodeid, const char *arg,
                        uint32_t arglen);
/* The reply to a LOOKUP that found entry `e` (-1: none, a negative entry). */
void fanfs_meta_entry_out(const struct fanfs_meta *m, int64_t e, struct fuse_entry_out *out);
/* The reply to a GETATTR of inode `nodeid`: 0, or -1 if the catalog has no such inode. */
int fanfs_meta_attr_out(const struct fanfs_meta *m, uint64_t nodeid, struct fuse_attr_out *out);
/* Whether entry `e` is a regular file, and its partition. */
int fanfs_meta_is_file(const struct fanfs_meta *m, uint64_t e);
uint32_t fanfs_meta_part(const struct fanfs_meta *m, uint64_t e);

/* -- follow.c: what a planned epoch follows; the READs' latencies --------------------------- */

/* The record is bounded; past FANFS_FOLLOW_MAX, new ones are counted as lost (the plan then
 * moves with the job's progress messages alone until Python catches up). */
#define FANFS_FOLLOW_MAX 16384
struct fanfs_follow {
    pthread_mutex_t lock;
    int efd;         /* atomic, and written under `lock`: the eventfd written when the record
                        stops being empty; -1: not following */
    uint64_t e[FANFS_FOLLOW_MAX]; /* `lock` */
    uint32_t head, n;             /* `lock` */
    uint64_t lost;                /* `lock` */
};
void fanfs_follow_init(struct fanfs_follow *fl);
void fanfs_follow_destroy(struct fanfs_follow *fl);
void fanfs_follow_set(struct fanfs_follow *fl, int efd);
/* Entry `e` was looked up, or READ from its start (`read`). Any front thread. */
void fanfs_follow_add(struct fanfs_follow *fl, uint64_t e, int read);
int fanfs_follow_take(struct fanfs_follow *fl, uint64_t *out, int max, uint64_t *lost);

/* The last FANFS_FRONT_SAMPLES READs' times, from taking the request to the reply, in
 * microseconds (a ring; fanfs status takes percentiles of it), and the longest ever. */
struct fanfs_latencies {
    uint32_t us[FANFS_FRONT_SAMPLES]; /* atomic */
    uint64_t n;                       /* atomic: samples taken */
    uint32_t longest;                 /* atomic */
};
void fanfs_latency_add(struct fanfs_latencies *lat, int64_t began_ns);
int fanfs_latency_take(const struct fanfs_latencies *lat, uint32_t out[FANFS_FRONT_SAMPLES],
                       uint32_t *longest);

/* -- writes.c: writes behind ------------------------------------------------------------- */

#define FANFS_WB_SLOTS 8

/* The buffers' file (writes.c, "Kept"): a header, a record per buffer, then the buffers.
 * recover.py reads it after a SIGKILL; its layout changes with FANFS_WB_MAGIC. */
#define FANFS_WB_MAGIC "fanfs-writes-1"
#define FANFS_WB_HEAD 4096
#define FANFS_WB_OWNER 3072 /* the records end below it; the rest of the header is its
                               owner's (the output daemon writes its staging path there) */

struct fanfs_wb_head {
    char magic[16];
    uint32_t nbufs;  /* buffers (and records) */
    uint32_t at;     /* where the first buffer begins: FANFS_WB_HEAD */
    uint64_t stride; /* bytes from one buffer to the next */
    char pad[32];
};

/* A buffer's record: the WRITE it holds, answered and not yet in its file while `seq` is not
 * 0 (stored last when it is queued, cleared once its pwrite is done). */
struct fanfs_wb_rec {
    uint64_t seq; /* atomic: 1, 2, ... in the order the WRITEs were answered; 0: none */
    uint64_t dev, ino; /* the file the WRITE's fd is open on */
    uint64_t off;
    uint32_t len, at; /* the bytes: `at` bytes into the buffer */
    char pad[24];
};

struct fanfs_wb_job {
    char *buf;        /* the request's buffer, the writer's until the job is done */
    const char *data; /* its bytes, in `buf` */
    int fd;
    uint64_t off;
    uint32_t len;
};

struct fanfs_writes {
    pthread_t thread;  /* the owner's (start, stop) */
    int running;       /* the owner's: written by start and stop, read by the front's threads
                          only while they run (between the two) */
    pthread_mutex_t lock;
    pthread_cond_t cond;  /* a job queued, a job done, a buffer free */
    int stop;             /* `lock` */
    int busy;             /* `lock`: the writer holds a job */
    char *arena;          /* the owner's: the buffers' mapping (of the kept file, if any) */
    size_t arena_len, stride;
    struct fanfs_wb_rec *rec; /* in the arena: one per buffer */
    int nbufs;            /* FANFS_WB_SLOTS spares and one per front thread */
    int lent;             /* atomic: buffers handed out (the spares first) */
    uint64_t seq;         /* `lock`: the last WRITE queued */
    char *spare[FANFS_WB_SLOTS];           /* `lock` */
    int nspare;                            /* `lock` */
    struct fanfs_wb_job q[FANFS_WB_SLOTS]; /* `lock` */
    int head, count;                       /* `lock` */
    uint64_t low1[FANFS_FRONT_MAX_FD]; /* atomic: 1 + the lowest offset written since
                                          fanfs_writes_take_written; 0: not written */
    uint64_t hold[FANFS_FRONT_MAX_FD]; /* atomic: WRITEs starting below this are forwarded */
    uint8_t err[FANFS_FRONT_MAX_FD];   /* atomic: the first failed pwrite's errno, until taken */
    uint64_t written;                  /* atomic: bytes written */
};

void fanfs_writes_init(struct fanfs_writes *wb);
void fanfs_writes_destroy(struct fanfs_writes *wb);
/* Start and stop (after writing what is queued) the writer thread, with buffers of `bufsize`
 * for the spares and `nfront` front threads, in the file open at `keepfd` (-1: in memory);
 * a front thread's own buffer (NULL: none left); wait until the queue is written (any thread);
 * take a WRITE request in *bufp (0), swapping in a free buffer, or -1 if it is not one to
 * take. */
int fanfs_writes_start(struct fanfs_writes *wb, size_t bufsize, int nfront, int keepfd);
char *fanfs_writes_buffer(struct fanfs_writes *wb);
void fanfs_writes_stop(struct fanfs_writes *wb);
void fanfs_writes_settle(struct fanfs_writes *wb);
int fanfs_writes_take(struct fanfs_writes *wb, int ffd, char **bufp, uint32_t n);
int64_t fanfs_writes_take_written(struct fanfs_writes *wb, int fd);
int fanfs_writes_take_error(struct fanfs_writes *wb, int fd);
void fanfs_writes_hold(struct fanfs_writes *wb, int fd, uint64_t below);
uint64_t fanfs_writes_written(const struct fanfs_writes *wb);

/* -- front.c, answer.c, forward.c: the front -------------------------------------------- */

/* A forwarded request: its bytes, as read, aligned as the buffer they were read into (the
 * drain reads their fuse_in_header in place). */
struct fanfs_fwd {
    struct fanfs_fwd *next;
    uint32_t len;
    _Alignas(uint64_t) char data[];
};

/* One wing's front (fanfs_native.h): made by fanfs_front_new, handed to every call, freed by
 * fanfs_front_free; its owner (the wing's main thread) starts and stops it. */
struct fanfs_front {
    /* Immutable: set by new. */
    struct fanfs_meta m;  /* the catalog (node wing) */
    int writes;           /* writes mode (output wing): WRITE answered, the rest forwarded */
    int keepfd;           /* writes mode: the file its buffers live in, until start (-1) */

    /* Immutable while running: set by the owner before the threads start. */
    int fd;               /* the FUSE session's fd (non-blocking) */
    int stopfd;           /* eventfd: written once, to stop every thread */
    int ep;               /* the epoll the leader waits in: the FUSE fd and stopfd */
    int nthreads;
    int64_t spin_ns;      /* the leader's poll after a request */
    size_t bufsize;       /* fanfs_wire_bufsize() */
    pthread_t threads[FRONT_MAX_THREADS];
    int readyfd;          /* eventfd: readable while forwarded requests wait (or the session
                             ended); made by start, closed by close */
    struct fanfs_wire wire;

    pthread_mutex_t lock; /* a leaf */
    pthread_cond_t turn;  /* the lead is free */
    int running;          /* the owner's; set by start once the threads are made (a plain
                             store: the receiver, which reads it under `lock`, is installed
                             only after start returns), cleared under `lock` by stop */
    int led;              /* `lock`: a thread leads (takes requests) */
    int ended;            /* `lock`: the session ended under the threads */
    struct fanfs_fwd *head, *tail; /* `lock`: the forward queue */
    int stopping;         /* atomic, stored under `lock` (the followers wait on `turn`) */
    int draining;         /* atomic, stored under `lock`: pyfuse3's loop has ended, what would
                             be forwarded fails */

    int64_t last_ns;      /* leader only: when the last request came */
    uint64_t counts[FANFS_FRONT_COUNTS]; /* atomic */
    uint64_t waits;       /* atomic: times the leader slept in epoll (not caught by the poll) */
    struct fanfs_latencies lat;
    struct fanfs_budget budget;
    struct fanfs_follow follow;
    struct fanfs_writes wb; /* writes mode's */
};

static inline void fanfs_front_count(struct fanfs_front *f, int what) {
    __atomic_add_fetch(&f->counts[what], 1, __ATOMIC_RELAXED);
}

/* answer.c: handle the request a thread took (`n` bytes in *bufp, which writes mode may swap
 * for a free buffer): answered, or forwarded. */
void fanfs_front_handle(struct fanfs_front *f, char **bufp, ssize_t n);
/* forward.c: queue a request for pyfuse3 (or fail it once draining); the session ended. */
void fanfs_front_forward(struct fanfs_front *f, const char *msg, uint32_t n);
void fanfs_front_end_session(struct fanfs_front *f);
void fanfs_front_drain_queue(struct fanfs_front *f);
/* forward.c: pyfuse3's receiver, for front `f`. */
struct fuse_buf;
int fanfs_front_receive_from(struct fanfs_front *f, void *session, struct fuse_buf *buf);

#endif
