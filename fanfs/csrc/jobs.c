/*
 * A job of the native read pool answered (pool_int.h): its pieces got from the cache of
 * pieces (pieces.h) or read alone, the reply written, the rest of fresh pieces pushed
 * (push.c), a failure posted. Runs in the pool's threads (a queued READ, a read-ahead), the
 * front's (fanfs_pool_fast_answer) and Python's (fanfs_run_job), with no lock of its own.
 *
 * A READ that needs a piece another thread is reading does not wait for it: it is hung on
 * the piece and queued again when the piece is there, so the thread goes on with other READs
 * (four threads waiting for each other's disk reads would leave the disk idle).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pool_int.h"

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

void job_buffers_trim(void) {
    /* The thread's own buffers (fanfs_tls: stored bytes read for a decode, a decoded whole
     * file) kept for the next job within codec.c's bounds, or freed. */
    struct fanfs_tls *t = fanfs_tls();
    if (t != NULL) {
        fanfs_tbuf_settle(&t->stored);
        fanfs_tbuf_settle(&t->out);
    }
}

/* Read, check and decode a piece into a buffer of its own (*buf, from pieces_alloc); *data
 * points at its decoded bytes. A raw piece is read straight into it (no copy). */
static int load_piece(struct pieces *c, const struct fanfs_job *j, const struct fanfs_piece *p,
                      const struct fanfs_dicts *dicts, char **buf, uint32_t *cap,
                      const char **data) {
    int err;
    const char *at;
    struct fanfs_tls *t;
    if (p->kind == FANFS_KIND_RAW) {
        if (p->len != p->size)
            return FANFS_EBADDATA;
        *buf = pieces_alloc(c, (uint64_t)p->len + 2 * FANFS_DIRECT_ALIGN, cap);
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
    *buf = pieces_alloc(c, p->size, cap);
    if (*buf == NULL)
        return ENOMEM;
    *data = *buf;
    err = fanfs_decode(dicts, p, (const unsigned char *)at, (unsigned char *)*buf);
    fanfs_mark(FANFS_STAGE_DECODE);
    return err;
}

/* A piece asked for whole and not cached: read and decoded into the thread's own buffers
 * (several pieces: a buffer of its own each). */
static int piece_alone(struct pieces *c, const struct fanfs_job *j, const struct fanfs_piece *p,
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
        if ((g->own = pieces_alloc(c, p->size, &g->cap)) == NULL)
            return ENOMEM;
        g->data = g->own;
    }
    err = fanfs_decode(dicts, p, (const unsigned char *)at, (unsigned char *)g->data);
    fanfs_mark(FANFS_STAGE_DECODE);
    return err;
}

/* Piece k of job j: 0 with *g filled, an errno, or WAITING when `qj` (a READ of the pool) was
 * hung on the piece because another thread is reading it. Without `qj` the caller waits. */
static int piece_get(struct pool *P, struct qjob *qj, const struct fanfs_job *j, int k,
                     const struct fanfs_dicts *dicts, struct got *g) {
    struct pieces *c = &P->pieces;
    const struct fanfs_piece *p = &j->pieces[k];
    struct pieces_wait how = {.hang = qj};
    int i = -1, err, got, unpushed = 0;
    char *buf = NULL;
    uint32_t cap = 0;
    const char *data = NULL;

    g->slot = -1;
    g->own = NULL;
    g->fresh = 0;
    if (j->fd <= FANFS_REMOTE_FD(0))
        return remote_piece(P, j, p, g, 1); /* a peer's file: the MPI thread fetches it */
    pthread_mutex_lock(&c->lock);
    got = pieces_get_locked(c, j->fd, p, &how, &i, &unpushed);
    if (got == PIECES_ABSENT && p->cache) {
        c->misses++;
        i = pieces_reserve_locked(c, j->fd, p, 1, 0, 0); /* -1: no room, read alone */
    }
    pthread_mutex_unlock(&c->lock);
    fanfs_mark(FANFS_STAGE_CACHE);
    if (got == PIECES_HUNG)
        return WAITING;
    if (got == PIECES_HIT) {
        /* A piece read ahead at LOOKUP: this first READ pushes the rest. (One asked for whole
         * is there only when read ahead at its LOOKUP: the kernel keeps it, nothing to push.) */
        g->fresh = p->cache ? unpushed : 0;
        g->slot = i;
        g->data = c->slot[i].data;
        return 0;
    }
    if (!p->cache) /* a file asked for whole: nobody asks for it again (the kernel keeps it) */
        return piece_alone(c, j, p, dicts, g);
    err = load_piece(c, j, p, dicts, &buf, &cap, &data);
    if (err != 0) {
        if (buf != NULL)
            pieces_free(c, buf, cap);
        if (i >= 0)
            pool_settle(P, i, NULL, 0, NULL);
        return err;
    }
    g->fresh = 1;
    g->data = data;
    if (i >= 0) {
        pool_settle(P, i, buf, cap, data);
        g->slot = i;
    } else {
        g->own = buf; /* no room in the cache: this reply's alone */
        g->cap = cap;
    }
    return 0;
}

static void piece_done(struct pieces *c, struct got *g) {
    if (g->slot >= 0)
        pieces_release(c, g->slot);
    else if (g->own != NULL)
        pieces_free(c, g->own, g->cap);
}

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
static int gather(struct pool *P, struct qjob *qj, const struct fanfs_job *j,
                  const struct fanfs_dicts *dicts, struct got *got, int *held, struct iovec *iov,
                  int *niov) {
    int k, err;
    uint64_t at = 0, lo = j->skip, hi = (uint64_t)j->skip + j->count;
    *niov = 0;
    for (k = 0; k < j->npieces; k++) {
        uint64_t end = at + j->pieces[k].size;
        if (end > lo && at < hi) { /* only the pieces holding some of [lo, hi) are read */
            uint64_t a = lo > at ? lo - at : 0, b = (hi < end ? hi : end) - at;
            err = piece_get(P, qj, j, k, dicts, &got[k]);
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

/* Whether a failure is the stored bytes' own (a failed check or decode: every later read
 * fails the same way), not the moment's (ENOMEM, EIO from the disk, EINTR, EAGAIN, ...: the
 * READ is answered with an error, and the next one tries again). */
static int bad_data(int err) { return err == FANFS_EBADCRC || err == FANFS_EBADDATA; }

static void post_error(struct pool *P, int64_t entry, int err) {
    /* A full pipe loses the record; a bad file is still answered EIO on every read. */
    struct {
        int64_t entry;
        int32_t err, pad;
    } rec = {entry, err, 0};
    ssize_t posted;
    if (bad_data(err))
        fast_mark_bad(&P->fast, entry);
    posted = P->work.errfd >= 0 ? write(P->work.errfd, &rec, sizeof rec) : 0;
    (void)posted;
}

/* Answer a READ: 0, or WAITING when `qj` (a queued READ; NULL: the caller waits instead)
 * was hung on a piece another thread is reading. `t` and `j` must not point into `qj`: once
 * it is hung, the thread that settles the piece owns it (requeues it, and another thread
 * answers and frees it), so this one never touches it again. A queued READ is always answered
 * (nobody else can); one of the front's (`qj` NULL) that needs a peer's piece it cannot have
 * is left to Python (FANFS_EREMOTE). */
int job_answer(struct pool *P, struct qjob *qj, const struct target *t,
               const struct fanfs_job *j) {
    struct got got[FANFS_MAX_PIECES];
    struct iovec iov[FANFS_MAX_PIECES];
    int held[FANFS_MAX_PIECES] = {0}, niov, k, err;
    struct fanfs_dicts *dicts = pool_dicts_hold(&P->work);

    err = gather(P, qj, j, dicts, got, held, iov, &niov);
    fanfs_dicts_free(dicts);
    if (err == WAITING || err == FANFS_EREMOTE) {
        for (k = 0; k < j->npieces; k++) /* let go of what it holds; it starts over */
            if (held[k])
                piece_done(&P->pieces, &got[k]);
        if (err == WAITING || qj == NULL)
            return err; /* WAITING: queued again when its piece is read; EREMOTE: to Python */
        reply_err(t, EIO); /* a queued READ of a peer's piece: Python has no request to answer */
        return 0;
    }
    if (err == 0) {
        reply_iov(t, iov, niov);
        fanfs_mark(FANFS_STAGE_REPLY);
        if ((j->flags & FANFS_JOB_PUSH) && j->ino != 0) {
            push_rest(P, t, j, got, held);
            fanfs_mark(FANFS_STAGE_PUSH);
        }
    }
    for (k = 0; k < j->npieces; k++)
        if (held[k])
            piece_done(&P->pieces, &got[k]);
    if (err != 0) {
        reply_err(t, EIO);
        post_error(P, j->entry, err);
    }
    return 0;
}

/* fanfs_pool_push_file's first step: 0 when job j may be pushed, -1 when the kernel does not
 * know its inode, else an errno. */
static int push_probe(const struct fanfs_job *j, int devfd) {
    int err;
    if (j->npieces != 1 || j->ino == 0 || j->fd == -1 || devfd < 0 || fanfs_job_check(j) != 0)
        return EINVAL;
    /* An empty store: the kernel answers ENOENT for an inode it does not know, having copied
     * nothing, and the file is then not read for nothing. */
    if ((err = -fanfs_raw_notify_store(devfd, j->ino, 0, NULL, 0)) != 0)
        return err == ENOENT ? -1 : err;
    return 0;
}

/* ... and the rest, once probed. */
static int push_probed(struct pool *P, const struct fanfs_job *j, int devfd) {
    struct fanfs_dicts *dicts;
    struct got g = {NULL, -1, NULL, 0, 0};
    int err;
    if (j->fd <= FANFS_REMOTE_FD(0)) { /* a peer's: fetched into the cache as for a READ */
        err = remote_piece(P, j, &j->pieces[0], &g, 0);
    } else {
        dicts = pool_dicts_hold(&P->work);
        err = piece_alone(&P->pieces, j, &j->pieces[0], dicts, &g);
        fanfs_dicts_free(dicts);
    }
    if (err == 0)
        err = -fanfs_raw_notify_store(devfd, j->ino, 0, g.data, j->pieces[0].size);
    else if (bad_data(err))
        post_error(P, j->entry, err); /* marked bad, as a READ's failure would */
    piece_done(&P->pieces, &g);
    job_buffers_trim();
    return err == ENOENT ? -1 : err;
}

int fanfs_pool_push_file(const struct fanfs_job *j, int devfd) {
    int err = push_probe(j, devfd);
    return err != 0 ? err : push_probed(pool_live(), j, devfd);
}

/* A peer's file's fetch asked now, its piece reserved (pending) for its push to find: 0, or
 * push_probe's answer. One the cache has, or cannot reserve now, its push fetches itself.
 * Reserved as a LOOKUP's fetch is, and counted with them: LA_REMOTE_MAX pending at once in
 * all, so that the pushers (eight, each asking ahead) never hold the cache's slots, and
 * PIECES_ASKED_MAX not yet got, so that none goes before its push comes. */
static int push_ask(struct pool *P, const struct fanfs_job *j, int devfd) {
    struct pieces *c = &P->pieces;
    int err = push_probe(j, devfd);
    if (err != 0 || j->fd > FANFS_REMOTE_FD(0))
        return err;
    pthread_mutex_lock(&c->lock);
    if (pieces_find_locked(c, j->fd, &j->pieces[0]) < 0 && c->ahead < LA_REMOTE_MAX &&
        c->asked < PIECES_ASKED_MAX) {
        c->misses++;
        remote_reserve_locked(P, j, &j->pieces[0], 1);
    }
    pthread_mutex_unlock(&c->lock);
    return 0;
}

int fanfs_pool_push_files(const struct fanfs_job *jobs, int n, int devfd, int *out) {
    struct pool *P = pool_live();
    int k, next = 0, gave_up = 0;
    if (n < 0 || (n > 0 && (jobs == NULL || out == NULL)))
        return EINVAL;
    for (k = 0; k < n; k++) {
        /* (A piece is held only from its push's HIT to its store: asked ahead, it is a pending
         * or filled piece nobody holds.) */
        for (; !gave_up && next < n && next < k + FANFS_PUSH_TOGETHER; next++)
            out[next] = push_ask(P, &jobs[next], devfd);
        /* Once a file was not had in time (its holder silent, the pool stopping), neither
         * are the rest, asked of the same peer: each would wait as long again, and the turn
         * would outlast the planner's stop. They go back, FANFS_EREMOTE, unwaited. */
        if (k >= next || (gave_up && out[k] == 0))
            out[k] = FANFS_EREMOTE;
        else if (out[k] == 0)
            out[k] = push_probed(P, &jobs[k], devfd);
        gave_up |= out[k] == FANFS_EREMOTE;
    }
    return 0;
}

/* A read-ahead: decode each piece nobody holds into the cache (and push it, if asked). */
static void run_ahead(struct pool *P, struct qjob *qj) {
    struct pieces *c = &P->pieces;
    const struct fanfs_job *j = &qj->j;
    int k, slot;
    int64_t pos = j->base;
    struct fanfs_dicts *dicts;
    if (qj->lookahead && !lookahead_wanted(&P->la, j->ino)) {
        free(qj); /* its READ came first and read it */
        return;
    }
    if (qj->lookahead)
        fanfs_budget_begin(fanfs_now_ns());
    dicts = pool_dicts_hold(&P->work);
    for (k = 0; k < j->npieces; k++) {
        const struct fanfs_piece *p = &j->pieces[k];
        char *buf = NULL;
        uint32_t cap = 0;
        const char *data = NULL;
        pthread_mutex_lock(&c->lock);
        slot = -1;
        if (pieces_find_locked(c, j->fd, p) < 0)
            slot = pieces_reserve_locked(c, j->fd, p, 1,
                                         !(j->flags & FANFS_JOB_PUSH) || j->ino == 0, 0);
        pthread_mutex_unlock(&c->lock);
        fanfs_mark(FANFS_STAGE_CACHE);
        if (slot >= 0) {
            if (load_piece(c, j, p, dicts, &buf, &cap, &data) != 0) {
                if (buf != NULL)
                    pieces_free(c, buf, cap);
                pool_settle(P, slot, NULL, 0, NULL); /* its READ reads it and reports it */
            } else {
                pool_settle(P, slot, buf, cap, data);
                if ((j->flags & FANFS_JOB_PUSH) && j->ino != 0)
                    push_queue(P, &qj->t, j->ino, slot, pos, 0, p->size);
                pieces_release(c, slot);
                fanfs_mark(FANFS_STAGE_PUSH);
            }
        }
        pos += p->size;
    }
    fanfs_dicts_free(dicts);
    fanfs_budget_end(&P->ahead, 1);
    free(qj);
}

void job_run(struct pool *P, struct qjob *qj) {
    struct target t;
    struct fanfs_job j;
    if (!qjob_is_read(qj)) {
        run_ahead(P, qj);
        return;
    }
    /* Copies: if the READ is hung on a piece, qj is another thread's from then on. */
    t = qj->t;
    j = qj->j;
    if (job_answer(P, qj, &t, &j) != WAITING)
        free(qj); /* else it is hung on a piece: queued again when the piece is read */
}

int fanfs_run_job(const struct fanfs_dicts *dicts, const struct fanfs_job *j, char *out) {
    struct pool *P = pool_live();
    struct got got[FANFS_MAX_PIECES];
    struct iovec iov[FANFS_MAX_PIECES];
    int held[FANFS_MAX_PIECES] = {0}, niov, k, err;
    if (fanfs_job_check(j) != 0)
        return EINVAL;
    err = gather(P, NULL, j, dicts, got, held, iov, &niov);
    if (err == 0)
        for (k = 0; k < niov; k++) {
            memcpy(out, iov[k].iov_base, iov[k].iov_len);
            out += iov[k].iov_len;
        }
    for (k = 0; k < j->npieces; k++)
        if (held[k])
            piece_done(&P->pieces, &got[k]);
    job_buffers_trim();
    return err;
}
