/*
 * The native read pool (fanfs_native.h): threads that answer FUSE READs without the GIL.
 *
 * Why: answering a READ of a file that is not in the page cache through the event loop costs
 * a thread hand-off (a trio worker thread, the GIL, a wake-up back to the loop) on top of the
 * disk read. Here the event loop only queues a job (pyfuse3's read hook, fanfs/_native.pyx)
 * and returns; threads that never touch the GIL read the stored pieces, check, decode and
 * reply themselves (libfuse replies are thread-safe; jobs.c).
 *
 * Pieces asked for in parts (a file larger than one READ, the frames of a framed file) go
 * through a small cache of decoded pieces shared by the threads (pieces.h), so each is read
 * and decoded once; what a READ did not ask for of a fresh piece is pushed into the kernel's
 * page cache (push.c). The front answers READs of files stored whole in its own threads with
 * the same code (fast.c), and peers' pieces come through the MPI thread (remote.c).
 *
 * This file: the pool's one object (its handle below), its threads and job queues, its start
 * and stop. fanfs_pool_start and fanfs_pool_stop are called by one thread, the daemon's.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "pool_int.h"

/* The live pool, built here in one place: the handle that every function of fanfs_native.h
 * resolves, since they take none (fanfs/_native.pyx and front.c call them as they are). Its
 * parts are handed to the functions of each file from here on. */
static struct pool live = {
    .pieces = PIECES_INIT,
    .work = {.lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER, .errfd = -1,
             .dlock = PTHREAD_MUTEX_INITIALIZER},
    .push = {.lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER},
    .remote = {.lock = PTHREAD_MUTEX_INITIALIZER, .wakefd = -1, .planefd = -1},
    .la = {.lock = PTHREAD_MUTEX_INITIALIZER, .share = 256},
};

struct pool *pool_live(void) { return &live; }

struct fanfs_dicts *pool_dicts_hold(struct workers *w) {
    struct fanfs_dicts *d;
    pthread_mutex_lock(&w->dlock);
    d = fanfs_dicts_ref(w->dicts);
    pthread_mutex_unlock(&w->dlock);
    return d;
}

void pool_requeue(struct workers *w, struct qjob *hung) {
    /* At the front of the queue: their piece is there now, or failed (they read it
     * themselves). */
    struct qjob *last;
    if (hung == NULL)
        return;
    for (last = hung; last->next != NULL; last = last->next)
        ;
    pthread_mutex_lock(&w->lock);
    last->next = w->head;
    w->head = hung;
    if (w->tail == NULL)
        w->tail = last;
    pthread_cond_broadcast(&w->cond);
    pthread_mutex_unlock(&w->lock);
}

void pool_settle(struct pool *P, int i, char *buf, uint32_t cap, const char *data) {
    pool_requeue(&P->work, pieces_ready(&P->pieces, i, buf, cap, data));
}

/* The next job: a READ first, a read-ahead only when no READ waits. */
static struct qjob *next_job_locked(struct workers *w) {
    struct qjob *qj;
    if (w->stopping) { /* read-aheads are not worth running any more */
        while ((qj = w->ahead_head) != NULL) {
            w->ahead_head = qj->next;
            free(qj);
        }
        w->ahead_tail = NULL;
        w->nahead = 0;
    }
    if ((qj = w->head) != NULL) {
        w->head = qj->next;
        if (w->head == NULL)
            w->tail = NULL;
    } else if ((qj = w->ahead_head) != NULL) {
        w->ahead_head = qj->next;
        if (w->ahead_head == NULL)
            w->ahead_tail = NULL;
        w->nahead--;
    }
    return qj;
}

static void *thread_main(void *arg) {
    struct pool *P = arg;
    struct workers *w = &P->work;
    prctl(PR_SET_NAME, "fanfs-pool", 0, 0, 0); /* (for top -H, perf and fanfs bench) */
    for (;;) {
        struct qjob *qj;
        pthread_mutex_lock(&w->lock);
        while ((qj = next_job_locked(w)) == NULL) {
            if (!w->stopping) {
                pthread_cond_wait(&w->cond, &w->lock);
                continue;
            }
            /* Stopping with nothing queued: leave, unless a piece is being read (the READs
             * hung on it come back to the queue when it is). */
            pthread_mutex_unlock(&w->lock);
            if (!pieces_busy(&P->pieces)) {
                pthread_mutex_lock(&w->lock);
                if (w->head == NULL)
                    break;
                continue;
            }
            usleep(1000);
            pthread_mutex_lock(&w->lock);
        }
        if (qj != NULL)
            w->jobs++;
        pthread_mutex_unlock(&w->lock);
        if (qj == NULL)
            break;
        job_run(P, qj);
        job_buffers_trim();
    }
    return NULL; /* (its own buffers are freed as it ends: fanfs_tls) */
}

int fanfs_pool_start(int nthreads, int errfd) {
    struct pool *P = &live;
    struct workers *w = &P->work;
    sigset_t all, old;
    int i;
    if (w->nthreads > 0)
        return 0;
    if (nthreads < 1 || nthreads > POOL_THREADS_MAX)
        return -EINVAL;
    if (fanfs_codec_init() != 0)
        return -ENOENT;
    w->errfd = errfd;
    w->stopping = 0;
    /* Signals stay with the interpreter's thread. */
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    push_start(P); /* (without a pusher, pieces are not pushed: the kernel READs them) */
    for (i = 0; i < nthreads; i++) {
        if (pthread_create(&w->threads[i], NULL, thread_main, P) != 0)
            break;
        w->nthreads++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return w->nthreads > 0 ? 0 : -EAGAIN;
}

void fanfs_pool_set_dicts(struct fanfs_dicts *d) {
    struct workers *w = &live.work;
    struct fanfs_dicts *old;
    pthread_mutex_lock(&w->dlock);
    old = w->dicts;
    w->dicts = fanfs_dicts_ref(d);
    pthread_mutex_unlock(&w->dlock);
    fanfs_dicts_free(old); /* freed here, or by the last job decoding with it */
}

int pool_enqueue(struct pool *P, const struct target *t, int lookahead,
                 const struct fanfs_job *job) {
    struct workers *w = &P->work;
    struct qjob *qj;
    /* A job's pieces are read from fd: a peer's (fd <= -2) are fetched for the front's READs
     * only (remote_piece), which the pool's threads cannot do: the caller answers those. */
    if (w->nthreads == 0 || w->stopping || job->fd < 0 || fanfs_job_check(job) != 0)
        return -1;
    qj = malloc(sizeof *qj);
    if (qj == NULL)
        return -1;
    qj->next = NULL;
    qj->t = *t;
    qj->lookahead = lookahead;
    qj->j = *job;
    pthread_mutex_lock(&w->lock);
    if (qjob_is_read(qj)) {
        if (w->tail != NULL)
            w->tail->next = qj;
        else
            w->head = qj;
        w->tail = qj;
    } else {
        if (w->nahead >= AHEAD_MAX) { /* the stalest: the reader has moved past it */
            struct qjob *old = w->ahead_head;
            w->ahead_head = old->next;
            if (w->ahead_head == NULL)
                w->ahead_tail = NULL;
            w->nahead--;
            free(old);
        }
        if (w->ahead_tail != NULL)
            w->ahead_tail->next = qj;
        else
            w->ahead_head = qj;
        w->ahead_tail = qj;
        w->nahead++;
    }
    pthread_cond_signal(&w->cond);
    pthread_mutex_unlock(&w->lock);
    return 0;
}

int fanfs_pool_submit(void *session, void *req, const struct fanfs_job *job) {
    if (req == NULL)
        return -1;
    struct target t = {(struct fuse_session *)session, (fuse_req_t)req, -1, 0};
    __atomic_store_n(&live.last_session, (struct fuse_session *)session, __ATOMIC_RELAXED);
    return pool_enqueue(&live, &t, 0, job);
}

int fanfs_pool_read_ahead(const struct fanfs_job *job) {
    struct target t = {__atomic_load_n(&live.last_session, __ATOMIC_RELAXED), NULL, -1, 0};
    return pool_enqueue(&live, &t, 0, job);
}

void fanfs_pool_drop(void) { pieces_drop(&live.pieces); }

void fanfs_pool_counters(struct fanfs_pool_stats *out) {
    pthread_mutex_lock(&live.work.lock);
    out->jobs = live.work.jobs;
    pthread_mutex_unlock(&live.work.lock);
    pieces_counters(&live.pieces, &out->hits, &out->misses);
    push_counters(&live.push, out);
}

void fanfs_pool_stop(void) {
    struct pool *P = &live;
    struct workers *w = &P->work;
    int i;
    fanfs_pool_fast_enable(0); /* READs from now on go to Python (or the front's drain) */
    remote_fail_pending(P);    /* no READ waits for a peer any more */
    while (__atomic_load_n(&P->answering, __ATOMIC_SEQ_CST) > 0)
        usleep(100); /* the front's READs in flight finish with the cache */
    pthread_mutex_lock(&w->lock);
    w->stopping = 1;
    pthread_cond_broadcast(&w->cond);
    pthread_mutex_unlock(&w->lock);
    for (i = 0; i < w->nthreads; i++)
        pthread_join(w->threads[i], NULL);
    w->nthreads = 0;
    push_stop(P);
    w->errfd = -1;
    __atomic_store_n(&P->last_session, NULL, __ATOMIC_RELAXED);
    pieces_clear(&P->pieces);
}
