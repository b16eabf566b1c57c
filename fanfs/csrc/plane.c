/*
 * The data plane (fanfs_native.h's plane section, issue 41): a remote read with no Python on
 * either side. One thread, "fanfs-plane", makes every MPI call of its own communicator:
 *
 *   requester  it takes the front's requests for peers' pieces (remote.c's queue, attached
 *              here), asks one live holder (in turn by entry, as fanfs/node/peers.py's
 *              in_turn) with a PLANE_HEADER on TAG_ASK, and hands the reply to
 *              fanfs_remote_fill (checked, decoded, the READ woken). What it cannot fetch
 *              (a refusal, a bad copy, no live holder, no answer within hand_back_ns) goes
 *              back to the MPI thread (remote_hand_back), which asks the other holders and
 *              times peers out as before (fanfs/node/transport/front.py). A holder that has not
 *              answered within the hedge delay (the MPI thread's, fanfs_plane_hedge) is
 *              hedged: another live holder is asked too, the first good copy filling the piece
 *              (the other's fill finds it filled: ESTALE).
 *   owner      it answers peers' asks from the fast path's tables (fanfs_pool_fast_stored: the
 *              catalog says which bytes, never the message; read and checked like a READ's,
 *              by a reader thread, plane_read.c), or refuses with an empty reply.
 *
 * Every message is found by a matched probe (MPI_Improbe; an empty one asked again at once,
 * plane_wire.c's `probe`), its size checked, and only then received into exactly its size
 * (fanfs/node/transport/inbox.py says why: Open MPI writes a longer message past a posted
 * buffer). An ask is PLANE_HEADER bytes; a reply is either empty or exactly the stored
 * length asked for, from the holder asked, on a reply tag that is out.
 * Anything else is counted malformed and dropped: received and freed up to FANFS_REMOTE_MAX,
 * larger left unreceived (never allocated for). A reply tag given back to the MPI thread stays
 * quarantined until its late reply is drained or quarantine_ns passed. Nothing is received by
 * a blocking call but an ask's header and an empty reply (MPI has them whole once matched):
 * a larger message's receive is tested each turn (plane_take_later), as a sender killed
 * mid-send leaves it unfinished for good in Open MPI; after quarantine_ns it is left to MPI
 * with its buffer (counted `left`).
 *
 * Bounds: PLANE_OUT fetches out, PLANE_SENDS sends in flight, PLANE_READS reads and
 * PLANE_REPLY_BYTES of replies in flight, PLANE_PEER_BYTES of them for one peer (beyond:
 * refused); PLANE_TAKES receives in flight and PLANE_TAKE_BYTES (beyond: one is waited for
 * up to hand_back_ns, then left).
 *
 * Waiting: while a fetch is out and something moved within PLANE_SPIN_NS it polls, yielding
 * the CPU (not while the kernel says threads wait for one: fanfs_cpu_pressed); otherwise it
 * sleeps on its eventfd (written by the front's queue), 20 us for PLANE_HOT_NS after any
 * traffic, backing off to 2 ms once idle and to 10 ms once quiet for 2 s, its own traffic
 * and new messages for the MPI thread both (an idle daemon's cost is these wake-ups; a peer's
 * first ask after a quiet spell waits up to 10 ms, its own fetches none: the front's queue
 * wakes it). Once a millisecond at most it also looks for a
 * message waiting on the MPI thread's communicator (`watch`) and writes that thread's eventfd:
 * the MPI thread, whose turn costs far more (Python), then sleeps up to 100 ms when idle
 * instead of 2 ms (mpi.py).
 *
 * Here: its fetches, its thread, start and stop; plane_wire.c: its messages (sends, the probe
 * loop, the owner's answers); plane_read.c: the owner's readers; plane.h: what they share.
 * Concurrency: the plane's state is its thread's alone, but for `dead` (atomic bytes, written
 * by the MPI thread, fanfs_plane_dead), `hedge_ns`, the counters (atomic), the readers' rings
 * (plane_read.c) and start/stop (the daemon's one thread that owns the transport).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include "pool_int.h"

#ifndef FANFS_PLANE

int fanfs_plane_built(void) { return 0; }
void fanfs_plane_counters(uint64_t out[FANFS_PLANE_COUNTS]) {
    memset(out, 0, FANFS_PLANE_COUNTS * sizeof out[0]);
}
int fanfs_plane_start(const struct fanfs_plane_conf *c) { return (void)c, ENOSYS; }
void fanfs_plane_stop(void) {}
void fanfs_plane_dead(int rank) { (void)rank; }
void fanfs_plane_hedge(int64_t ns) { (void)ns; }

#else /* built against mpi.h: FANFS_PLANE */

#include "plane.h"

static struct plane plane = {.wakefd = -1};

int fanfs_plane_built(void) { return 1; }

void fanfs_plane_counters(uint64_t out[FANFS_PLANE_COUNTS]) {
    int k;
    for (k = 0; k < FANFS_PLANE_COUNTS; k++)
        out[k] = __atomic_load_n(&plane.counts[k], __ATOMIC_RELAXED);
}

void fanfs_plane_hedge(int64_t ns) {
    __atomic_store_n(&plane.hedge_ns, ns > 0 ? ns : 1, __ATOMIC_RELAXED);
}

void fanfs_plane_dead(int rank) {
    if (plane.dead != NULL && rank >= 0 && rank < plane.ranks)
        __atomic_store_n(&plane.dead[rank], 1, __ATOMIC_RELAXED);
}

/* o's state from now on, counted: `nout` not free, `nwait` out (a READ may wait on it). */
static void set_state(struct plane *pl, struct out *o, int state) {
    pl->nout += (state != 0) - (o->state != 0);
    pl->nwait += (state == 1) - (o->state == 1);
    o->state = state;
}

/* Hand o back to the MPI thread. `skip`: it asks the other holders only (this one's copy was
 * bad), else this one too (it refused: its MPI thread may answer, from the image while it
 * stages; it is slow: the MPI thread's hedges and peer timeout take over). `late`: a reply
 * may still come, so its tag is quarantined (else the slot is free at once). */
static void hand_back(struct plane *pl, struct out *o, int skip, int late) {
    o->r.tried = skip ? o->peer : -1;
    if (fanfs_remote_pending(&o->r)) { /* (else a hedge filled it, or it was given up) */
        remote_hand_back(pool_live(), &o->r);
        count(pl, HANDED_BACK, 1);
    }
    set_state(pl, o, late ? 2 : 0);
    o->deadline = fanfs_now_ns() + pl->c.quarantine_ns;
}

void plane_reply(struct plane *pl, MPI_Message *m, int peer, int tag, int n) {
    struct out *o = &pl->out[tag % PLANE_OUT];
    if (o->state == 0 || o->tag != tag || o->peer != peer) {
        plane_drop(pl, m, peer, n); /* not a reply to anything out */
        return;
    }
    if (o->state == 1 && (n == 0 || (uint32_t)n != o->r.len)) { /* a refusal, or a wrong one */
        if (n != 0)
            plane_drop(pl, m, peer, n);
        else
            plane_take(pl, m, NULL, 0);
        hand_back(pl, o, n != 0, 0);
        return;
    }
    plane_take_later(pl, m, n, peer, tag); /* (given back: a late one, drained) */
}

void plane_replied(struct plane *pl, int peer, int tag, char *buf, uint32_t cap, int n) {
    struct out *o = &pl->out[tag % PLANE_OUT];
    int err;
    if (o->state == 0 || o->tag != tag || o->peer != peer) {
        pieces_free(&pool_live()->pieces, buf, cap); /* (its slot was freed meanwhile) */
        return;
    }
    if (o->state == 2 || buf == NULL) {
        pieces_free(&pool_live()->pieces, buf, cap);
        if (o->state == 2)
            set_state(pl, o, 0); /* late: drained, its tag free again */
        else
            hand_back(pl, o, 0, 0); /* not received */
        return;
    }
    err = remote_fill(pool_live(), &o->r, buf, (uint32_t)n, o->began, buf, cap);
    if (err == 0 || err == ESTALE) { /* (ESTALE: given up meanwhile, or a hedge's other copy) */
        count(pl, FILLED, err == 0);
        count(pl, HEDGES_WON, err == 0 && o->hedge);
        set_state(pl, o, 0);
    } else {
        hand_back(pl, o, 1, 0); /* a bad copy: the MPI thread asks another holder */
    }
}

/* -- fetches --------------------------------------------------------------------------------- */

/* The holder of r to ask: in turn by entry, not this daemon, not dead, not `skip`; -1 if
 * none. */
static int holder(const struct plane *pl, const struct fanfs_rreq *r, int skip) {
    int k, n = 0, peer;
    for (k = 0; k < FANFS_MAX_OWNERS && r->peers[k] >= 0; k++)
        n++;
    for (k = 0; k < n; k++) {
        peer = r->peers[(r->entry % n + k) % n];
        if (peer != pl->c.rank && peer != skip && peer < pl->c.size &&
            !__atomic_load_n(&pl->dead[peer], __ATOMIC_RELAXED))
            return peer;
    }
    return -1;
}

/* A free slot's reply tag, or -1. */
static int free_tag(struct plane *pl) {
    int k, tag;
    for (k = 0; k < PLANE_OUT; k++) {
        tag = pl->next_tag;
        pl->next_tag = tag + 1 < pl->c.tag_ub ? tag + 1 : FIRST_TAG;
        if (pl->out[tag % PLANE_OUT].state == 0)
            return tag;
    }
    return -1;
}

/* Ask a holder but `skip` for r's stored bytes (`hedge`: the other was slow), or hand r back
 * when none can be asked (a hedge is then not made). */
static void ask(struct plane *pl, const struct fanfs_rreq *r, int skip, int hedge) {
    struct out *o;
    int64_t *h;
    int peer = holder(pl, r, skip), tag = peer >= 0 ? free_tag(pl) : -1;
    if (tag < 0 && hedge)
        return;
    if (tag < 0) {
        remote_hand_back(pool_live(), r);
        count(pl, HANDED_BACK, 1);
        return;
    }
    o = &pl->out[tag % PLANE_OUT];
    set_state(pl, o, 1);
    o->tag = tag;
    o->peer = peer;
    o->hedge = hedge;
    o->r = *r;
    o->began = fanfs_now_ns();
    o->deadline = o->began + pl->c.hand_back_ns;
    /* A slow holder is hedged: another one asked too, the first copy filling the piece. */
    o->hedge_at = hedge ? INT64_MAX
                        : o->began + __atomic_load_n(&pl->hedge_ns, __ATOMIC_RELAXED);
    if ((h = malloc(PLANE_HEADER)) != NULL) {
        h[0] = FANFS_PLANE_MAGIC;
        h[1] = r->entry;
        h[2] = r->len;
        h[3] = tag;
    }
    if (h == NULL || plane_post(pl, (char *)h, PLANE_HEADER, 0, peer, TAG_ASK) != 0) {
        hand_back(pl, o, 0, 0); /* (nothing was sent) */
        return;
    }
    count(pl, ASKED, 1);
    count(pl, HEDGED, hedge);
}

/* Ask for the front's new requests; hand back the fetches out too long, free the tags
 * quarantined too long. 1 if any new request came. */
static int fetches(struct plane *pl) {
    struct fanfs_rreq r[64];
    int i, n = 0;
    int64_t now;
    if (pl->c.fetch)
        for (;;) {
            int got = remote_plane_take(pool_live(), r, 64);
            for (i = 0; i < got; i++)
                ask(pl, &r[i], -1, 0);
            n += got;
            if (got < 64)
                break;
        }
    if (pl->nout > 0) {
        now = fanfs_now_ns();
        for (i = 0; i < PLANE_OUT; i++) {
            struct out *o = &pl->out[i];
            if (o->state == 1 && now > o->deadline) {
                hand_back(pl, o, 0, 1);
            } else if (o->state == 1 && now > o->hedge_at) {
                o->hedge_at = INT64_MAX;
                ask(pl, &o->r, o->peer, 1); /* (into another slot: this one stays out) */
            } else if (o->state == 2 && now > o->deadline) {
                set_state(pl, o, 0);
            }
        }
    }
    return n > 0;
}

/* -- the thread ------------------------------------------------------------------------------ */

static void sleep_on(int fd, int64_t ns) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    struct timespec t = {.tv_sec = ns / 1000000000, .tv_nsec = ns % 1000000000};
    uint64_t v;
    if (ppoll(&p, 1, &t, NULL) > 0 && read(fd, &v, sizeof v) < 0)
        return;
}

static void *plane_main(void *arg) {
    struct plane *pl = arg;
    int64_t now, idle = POLL_MIN_NS, hot_until = 0, moved = 0, heard = 0, most, end;
    int busy, quiet, i;
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0); /* (mpi.py's _precise_timeouts says why) */
    prctl(PR_SET_NAME, "fanfs-plane", 0, 0, 0);
    while (!__atomic_load_n(&pl->stopping, __ATOMIC_ACQUIRE)) {
        busy = fetches(pl);
        busy |= plane_receive(pl);
        busy |= plane_collect(pl);
        busy |= plane_settle(pl);
        now = fanfs_now_ns();
        busy |= plane_takes(pl, now);
        if (plane_watch(pl, now))
            heard = now;
        moved = busy ? now : moved;
        if (busy || ((pl->nsends > 0 || pl->ntakes > 0) && now - moved < PLANE_STALL_NS))
            hot_until = now + PLANE_HOT_NS;
        if (now - moved < PLANE_SPIN_NS && pl->nwait > 0 && !fanfs_cpu_pressed()) {
            sched_yield(); /* a READ waits: no sleep at all */
            idle = 0;
            continue;
        }
        quiet = now - hot_until > PLANE_QUIET_NS && now - heard > PLANE_QUIET_NS;
        most = quiet ? POLL_QUIET_NS : POLL_MAX_NS;
        idle = now < hot_until ? POLL_MIN_NS : (idle * 2 > most ? most : idle * 2);
        if (idle < POLL_MIN_NS)
            idle = POLL_MIN_NS;
        sleep_on(pl->wakefd, idle);
    }
    for (i = 0; i < PLANE_OUT; i++) /* the MPI thread fetches them, or they go to Python */
        if (pl->out[i].state == 1)
            hand_back(pl, &pl->out[i], 0, 1);
    end = fanfs_now_ns() + SETTLE_NS;
    while ((pl->nsends > 0 || pl->ntakes > 0) && fanfs_now_ns() < end) {
        plane_settle(pl);
        plane_takes(pl, fanfs_now_ns());
        usleep(1000);
    }
    plane_takes(pl, INT64_MAX); /* (those MPI still holds: their buffers are never freed) */
    pl->nsends = 0;
    return NULL;
}

int fanfs_plane_start(const struct fanfs_plane_conf *c) {
    struct plane *pl = &plane;
    int err;
    if (pl->running)
        return EALREADY;
    if (c->size < 1 || c->size > PLANE_MAX_RANKS || c->rank < 0 || c->rank >= c->size ||
        c->tag_ub <= FIRST_TAG || c->hand_back_ns <= 0 || c->quarantine_ns <= 0)
        return EINVAL;
    if ((err = plane_resolve(pl, c->lib)) != 0)
        return err;
    pl->c = *c;
    pl->c.lib = NULL;
    pl->comm = (MPI_Comm)c->comm;
    pl->byte = (MPI_Datatype)c->byte;
    pl->watch = (MPI_Comm)c->watch;
    pl->watch_at = 0;
    pl->watch_ns = WATCH_NS;
    if (c->watch == 0)
        pl->c.watch_fd = -1;
    pl->nout = pl->nwait = pl->nsends = pl->ntakes = 0;
    pl->reply_bytes = pl->take_bytes = 0;
    pl->next_tag = FIRST_TAG;
    pl->hedge_ns = c->hedge_ns > 0 ? c->hedge_ns : c->hand_back_ns;
    memset(pl->out, 0, sizeof pl->out);
    /* `dead` is never freed (fanfs_plane_dead may read it at any time): one per process. */
    if (pl->dead == NULL && (pl->dead = calloc((size_t)c->size, 1)) != NULL)
        pl->ranks = c->size;
    if (pl->dead == NULL || pl->ranks < c->size)
        return pl->dead == NULL ? ENOMEM : EINVAL;
    if ((pl->peer_bytes = calloc((size_t)c->size, sizeof *pl->peer_bytes)) == NULL)
        return ENOMEM;
    if ((pl->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0) {
        err = errno;
        free(pl->peer_bytes);
        pl->peer_bytes = NULL;
        return err;
    }
    if ((err = plane_reads_start(&pl->reads, pl->wakefd)) != 0) {
        close(pl->wakefd);
        pl->wakefd = -1;
        free(pl->peer_bytes);
        pl->peer_bytes = NULL;
        return err;
    }
    if (c->fetch && remote_plane_attach(pool_live(), pl->wakefd) != 0)
        pl->c.fetch = 0; /* the remote path is off: answer only */
    pl->stopping = 0;
    if ((err = pthread_create(&pl->thread, NULL, plane_main, pl)) != 0) {
        remote_plane_detach(pool_live());
        plane_reads_stop(&pl->reads);
        close(pl->wakefd);
        pl->wakefd = -1;
        free(pl->peer_bytes);
        pl->peer_bytes = NULL;
        return err;
    }
    pl->running = 1;
    return 0;
}

void fanfs_plane_stop(void) {
    struct plane *pl = &plane;
    uint64_t one = 1;
    ssize_t w;
    if (!pl->running)
        return;
    remote_plane_detach(pool_live()); /* new requests go to the MPI thread again */
    __atomic_store_n(&pl->stopping, 1, __ATOMIC_RELEASE);
    w = write(pl->wakefd, &one, sizeof one);
    (void)w;
    pthread_join(pl->thread, NULL);
    plane_reads_stop(&pl->reads); /* (after the thread: it takes no read any more) */
    pieces_free_spares(&pool_live()->pieces); /* what it gave back after the pool's stop */
    pl->running = 0;
    close(pl->wakefd);
    pl->wakefd = -1;
    free(pl->peer_bytes);
    pl->peer_bytes = NULL;
}

#endif
