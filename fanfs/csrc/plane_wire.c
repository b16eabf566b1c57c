/*
 * The data plane's messages (plane.h): its sends, every message it takes, the owner's
 * answers to peers' asks, and its look at the MPI thread's communicator (`plane_watch`).
 * plane.c's header says what the plane is and the rules of its messages: found by matched
 * probe, received into exactly their size, or dropped.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fanfs_native.h"

#ifdef FANFS_PLANE

#include "plane.h"

/* -- MPI's functions ----------------------------------------------------------------------- */

int plane_resolve(struct plane *pl, const char *lib) {
    void *h = dlopen(lib, RTLD_LAZY | RTLD_NOLOAD);
    int same;
    if (h == NULL)
        return ENOENT;
    pl->isend = (__typeof__(MPI_Isend) *)dlsym(h, "MPI_Isend");
    pl->improbe = (__typeof__(MPI_Improbe) *)dlsym(h, "MPI_Improbe");
    pl->mrecv = (__typeof__(MPI_Mrecv) *)dlsym(h, "MPI_Mrecv");
    pl->imrecv = (__typeof__(MPI_Imrecv) *)dlsym(h, "MPI_Imrecv");
    pl->test = (__typeof__(MPI_Test) *)dlsym(h, "MPI_Test");
    pl->get_count = (__typeof__(MPI_Get_count) *)dlsym(h, "MPI_Get_count");
    pl->iprobe = (__typeof__(MPI_Iprobe) *)dlsym(h, "MPI_Iprobe");
    /* The library is the MPI whose mpi.h this was built with (handles, MPI_Status and the
     * constants differ between Open MPI and MPICH's ABI): else no plane, never a wrong one. */
#ifdef OMPI_MAJOR_VERSION
    same = dlsym(h, "ompi_mpi_comm_world") != NULL;
#else
    same = dlsym(h, "ompi_mpi_comm_world") == NULL;
#endif
    dlclose(h); /* (NOLOAD: the library stays, loaded by mpi4py) */
    return same && pl->isend && pl->improbe && pl->mrecv && pl->imrecv && pl->test &&
                   pl->get_count && pl->iprobe
               ? 0
               : ENOENT;
}

/* -- sends ----------------------------------------------------------------------------------- */

/* A send's buffer let go: a read's kept as a spare for the next (its pages mapped already). */
static void release(char *buf, uint32_t cap) {
    if (cap > 0)
        pieces_free(&pool_live()->pieces, buf, cap);
    else
        free(buf);
}

/* plane_post's, the bytes sent starting at `at` in `buf` (`cap`: as struct send's). */
static int post(struct plane *pl, char *buf, uint32_t cap, const char *at, uint32_t len,
                uint32_t bytes, int peer, int tag) {
    struct send *s;
    if (pl->nsends == PLANE_SENDS) {
        release(buf, cap);
        return -1;
    }
    s = &pl->sends[pl->nsends]; /* (`buf` is MPI's until done: a slot may move, its buffer not) */
    s->buf = buf;
    s->cap = cap;
    s->bytes = bytes;
    if (pl->isend(at, (int)len, pl->byte, peer, tag, pl->comm, &s->req) != MPI_SUCCESS) {
        release(buf, cap);
        return -1;
    }
    s->peer = peer;
    s->at = fanfs_now_ns();
    pl->reply_bytes += bytes;
    pl->peer_bytes[peer] += bytes;
    pl->nsends++;
    return 0;
}

int plane_post(struct plane *pl, char *buf, uint32_t len, uint32_t bytes, int peer, int tag) {
    return post(pl, buf, 0, buf, len, bytes, peer, tag);
}

/* (A failed send too: MPI is done with it.) */
int plane_settle(struct plane *pl) {
    int i = 0, done, any = 0;
    int64_t now = pl->nsends > 0 ? fanfs_now_ns() : 0;
    while (i < pl->nsends) {
        struct send *s = &pl->sends[i];
        done = 0;
        if (pl->test(&s->req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS)
            done = 1; /* (an error: MPI is done with it too) */
        if (!done && !(__atomic_load_n(&pl->dead[s->peer], __ATOMIC_RELAXED) &&
                       now - s->at > pl->c.quarantine_ns)) {
            i++;
            continue;
        }
        if (!done) {
            s->buf = NULL; /* its peer died: left to MPI, its buffer never freed */
            count(pl, LEFT, 1);
        }
        release(s->buf, s->cap);
        pl->reply_bytes -= s->bytes;
        pl->peer_bytes[s->peer] -= s->bytes;
        pl->sends[i] = pl->sends[--pl->nsends];
        any = 1;
    }
    return any;
}

/* -- messages -------------------------------------------------------------------------------- */

int plane_take(struct plane *pl, MPI_Message *m, void *buf, int n) {
    return pl->mrecv(buf, n, pl->byte, m, MPI_STATUS_IGNORE) == MPI_SUCCESS ? 0 : -1;
}

/* 1: t's receive is done, 0: not yet, -1: it failed. */
static int tested(struct plane *pl, struct take *t) {
    int done = 0;
    return pl->test(&t->req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS ? -1 : done;
}

/* t's receive over (`got` as tested; 0: left to MPI with its buffer, for good). */
static void taken(struct plane *pl, struct take *t, int got) {
    if (got == 0) {
        count(pl, LEFT, 1);
    } else if (got < 0 || t->tag < 0) {
        pieces_free(&pool_live()->pieces, t->buf, t->cap);
        t->buf = NULL;
    }
    if (t->tag >= 0)
        plane_replied(pl, t->peer, t->tag, got > 0 ? t->buf : NULL, t->cap, t->n);
}

/* A large message comes in parts as its sender answers (rendezvous): a sender killed mid-send
 * never answers, and Open MPI's receive then never ends (a blocking one hung this thread for
 * good). So the plane blocks on none: each receive is tested every turn (plane_takes). */
void plane_take_later(struct plane *pl, MPI_Message *m, int n, int peer, int tag) {
    struct take t = {.n = n, .peer = peer, .tag = tag};
    int64_t end;
    int got, room;
    if (n > (int)FANFS_REMOTE_MAX) {
        if (tag >= 0)
            count(pl, MALFORMED, 1); /* (a drop, tag -1, was counted by plane_drop) */
        taken(pl, &t, -1); /* left unreceived: never allocated for */
        return;
    }
    if ((t.buf = pieces_alloc(&pool_live()->pieces, (uint64_t)n, &t.cap)) == NULL ||
        pl->imrecv(t.buf, n, pl->byte, m, &t.req) != MPI_SUCCESS) {
        taken(pl, &t, -1);
        return;
    }
    got = tested(pl, &t);
    room = pl->ntakes < PLANE_TAKES && pl->take_bytes + (uint32_t)n <= PLANE_TAKE_BYTES;
    if (got == 0 && !room) { /* wait here a while, but not for a peer found dead */
        end = __atomic_load_n(&pl->dead[peer], __ATOMIC_RELAXED) ? 0 : pl->c.hand_back_ns;
        end += fanfs_now_ns();
        while ((got = tested(pl, &t)) == 0 && fanfs_now_ns() < end)
            sched_yield();
    }
    if (got != 0 || !room) {
        taken(pl, &t, got);
        return;
    }
    t.until = fanfs_now_ns() + pl->c.quarantine_ns;
    pl->takes[pl->ntakes++] = t;
    pl->take_bytes += (uint32_t)n;
}

int plane_takes(struct plane *pl, int64_t now) {
    int i = 0, got, any = 0;
    struct take t;
    while (i < pl->ntakes) {
        if ((got = tested(pl, &pl->takes[i])) == 0 && now <= pl->takes[i].until) {
            i++;
            continue;
        }
        t = pl->takes[i];
        pl->takes[i] = pl->takes[--pl->ntakes];
        pl->take_bytes -= (uint32_t)t.n;
        taken(pl, &t, got);
        any = 1;
    }
    return any;
}

void plane_drop(struct plane *pl, MPI_Message *m, int peer, int n) {
    count(pl, MALFORMED, 1);
    plane_take_later(pl, m, n, peer, -1);
}

/* A read done (inline, or by a reader): its reply sent, or a refusal (not a file staged here,
 * a bad copy, a disk error). */
static void reply_read(struct plane *pl, struct plane_read *r) {
    if (r->err != 0 ||
        post(pl, r->buf, r->cap, r->buf + r->at, r->len, r->len, r->peer, r->tag) != 0) {
        count(pl, REFUSED, 1);
        plane_post(pl, NULL, 0, 0, r->peer, r->tag);
        return;
    }
    count(pl, ANSWERED, 1);
    count(pl, ANSWERED_BYTES, r->len);
    count(pl, OWNER_N, 1);
    count(pl, OWNER_QUEUE_NS, (uint64_t)(r->began_ns - r->taken_ns));
    count(pl, OWNER_READ_NS, (uint64_t)(r->read_ns - r->began_ns));
    count(pl, OWNER_POST_NS, (uint64_t)(fanfs_now_ns() - r->read_ns));
}

/* The owner: a peer's ask of `n` bytes, checked, then read here (up to PLANE_INLINE: a hand-off
 * to another thread costs more than such a read) or by a reader (plane_read.c), or refused. */
static void answer(struct plane *pl, MPI_Message *m, int peer, int n) {
    int64_t h[4];
    struct plane_read r;
    if (n != PLANE_HEADER) {
        plane_drop(pl, m, peer, n);
        return;
    }
    if (plane_take(pl, m, h, n) != 0)
        return;
    if (h[0] != FANFS_PLANE_MAGIC || h[1] < 0 || h[2] <= 0 ||
        h[2] > (int64_t)FANFS_REMOTE_MAX || h[3] < FIRST_TAG || h[3] >= pl->c.tag_ub) {
        count(pl, MALFORMED, 1);
        return; /* (no reply tag to refuse on) */
    }
    r.peer = peer;
    r.tag = (int)h[3];
    r.entry = h[1];
    r.len = (uint32_t)h[2];
    r.taken_ns = fanfs_now_ns();
    if (pl->reply_bytes + r.len > PLANE_REPLY_BYTES || pl->nsends >= PLANE_SENDS ||
        pl->peer_bytes[peer] + r.len > PLANE_PEER_BYTES) {
        count(pl, REFUSED, 1); /* too much in flight */
        plane_post(pl, NULL, 0, 0, peer, r.tag);
    } else if (r.len <= PLANE_INLINE) {
        plane_read_one(&r);
        reply_read(pl, &r);
    } else if (plane_read_submit(&pl->reads, &r) != 0) {
        count(pl, REFUSED, 1);
        plane_post(pl, NULL, 0, 0, peer, r.tag);
    } else {
        pl->reply_bytes += r.len; /* (until the read is taken; then until its send is done) */
        pl->peer_bytes[peer] += r.len;
    }
}

int plane_collect(struct plane *pl) {
    struct plane_read done[16];
    int i, n, any = 0;
    while ((n = plane_read_take(&pl->reads, done, 16)) > 0) {
        any = 1;
        for (i = 0; i < n; i++) {
            pl->reply_bytes -= done[i].len;
            pl->peer_bytes[done[i].peer] -= done[i].len;
            reply_read(pl, &done[i]);
        }
    }
    return any;
}

/* A matched probe of the plane's communicator: 1 and the message, or 0. Open MPI (ob1) moves
 * the transport on in a probe that matches nothing, and returns without matching what that
 * brought in: a probe once a turn finds a message a turn late. An empty probe is asked again
 * at once. Measured (docs/performance.md): a peer's ask waited 105 us for its owner and the
 * reply 77 us for its requester at p50, against 30 and 24 asked twice. */
static int probe(struct plane *pl, MPI_Message *m, MPI_Status *st) {
    int flag = 0, k;
    for (k = 0; k < 2 && !flag; k++)
        if (pl->improbe(MPI_ANY_SOURCE, MPI_ANY_TAG, pl->comm, &flag, m, st) != MPI_SUCCESS)
            return 0;
    return flag;
}

int plane_receive(struct plane *pl) {
    MPI_Message m;
    MPI_Status st;
    int n, k, any = 0;
    for (k = 0; k < PLANE_OUT; k++) { /* (at most this many a turn: a flood waits its turn) */
        if (!probe(pl, &m, &st))
            return any;
        any = 1;
        if (pl->get_count(&st, pl->byte, &n) != MPI_SUCCESS || n < 0) {
            count(pl, MALFORMED, 1);
            continue; /* (not a byte count: left unreceived) */
        }
        if (st.MPI_TAG == TAG_ASK)
            answer(pl, &m, st.MPI_SOURCE, n);
        else if (st.MPI_TAG >= FIRST_TAG)
            plane_reply(pl, &m, st.MPI_SOURCE, st.MPI_TAG, n);
        else
            plane_drop(pl, &m, st.MPI_SOURCE, n);
    }
    return any;
}

/* A message waiting for the MPI thread (it takes it: nothing is received here) wakes it: a
 * look every `watch_ns`, as it polls by itself while traffic flows and sleeps long when idle. A
 * message it leaves waiting (a peer's on a tag it never takes) is found again each look:
 * the wake-ups then back off to WATCH_MAX_NS, the MPI thread's longest sleep anyway. */
int plane_watch(struct plane *pl, int64_t now) {
    int flag = 0, fresh;
    uint64_t one = 1;
    ssize_t w;
    if (pl->c.watch_fd < 0 || now - pl->watch_at < pl->watch_ns)
        return 0;
    pl->watch_at = now; /* (it polls by itself while traffic flows: a look a millisecond) */
    if (pl->iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, pl->watch, &flag, MPI_STATUS_IGNORE) !=
            MPI_SUCCESS ||
        !flag) {
        pl->watch_ns = WATCH_NS;
        return 0;
    }
    w = write(pl->c.watch_fd, &one, sizeof one);
    (void)w;
    fresh = pl->watch_ns == WATCH_NS; /* the last look found none: traffic, not one that stays */
    pl->watch_ns = pl->watch_ns * 2 > WATCH_MAX_NS ? WATCH_MAX_NS : pl->watch_ns * 2;
    return fresh;
}

#endif
