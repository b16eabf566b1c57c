/*
 * Pushes (pool_int.h): the kernel sends buffered READs of at most the mount's readahead (128
 * KiB unless root raises it), so a 2 MiB file is 16 round trips. When a job decodes a piece
 * afresh and says so (FANFS_JOB_PUSH), what the READ did not ask for of that piece is pushed
 * into the kernel's page cache with notify_store, by one pusher thread: the rest of the file
 * is then read from the page cache with no round trip at all. The pusher is a thread of its
 * own because notify_store waits for page locks that the kernel holds for READs in flight,
 * which the pool's threads answer: a pool thread must never wait for it.
 *
 * A push holds a reference to its cache slot from its queueing to its end, so the pusher
 * reads the slot's bytes with no lock. Lock order: the pushes' lock before the cache's.
 */
#define _GNU_SOURCE
#include <sys/prctl.h>

#include "pool_int.h"

void push_queue(struct pool *P, const struct target *t, uint64_t ino, int i, int64_t pos,
                uint32_t from, uint32_t to) {
    struct pushes *q = &P->push;
    if (to <= from || (t->se == NULL && t->fd < 0))
        return;
    pthread_mutex_lock(&q->lock);
    if (q->running && q->n < PUSH_MAX) {
        q->q[(q->first + q->n) % PUSH_MAX] =
            (struct push_item){t->se, t->fd, ino, i, pos, from, to};
        q->n++;
        pieces_ref(&P->pieces, i);
        pthread_cond_signal(&q->cond);
    } else {
        q->skipped++;
    }
    pthread_mutex_unlock(&q->lock);
}

static void *pusher_main(void *arg) {
    struct pool *P = arg;
    struct pushes *q = &P->push;
    prctl(PR_SET_NAME, "fanfs-push", 0, 0, 0);
    pthread_mutex_lock(&q->lock);
    for (;;) {
        struct push_item it;
        struct fuse_bufvec bv = FUSE_BUFVEC_INIT(0);
        while (q->n == 0 && q->running)
            pthread_cond_wait(&q->cond, &q->lock);
        if (q->n == 0)
            break;
        it = q->q[q->first];
        q->first = (q->first + 1) % PUSH_MAX;
        q->n--;
        pthread_mutex_unlock(&q->lock);
        bv.buf[0].size = it.to - it.from;
        bv.buf[0].mem = (void *)(P->pieces.slot[it.slot].data + it.from); /* referenced */
        /* ENOENT (the kernel forgot the inode) and the like: the kernel READs it instead. */
        if ((it.se != NULL
                 ? fuse_lowlevel_notify_store(it.se, it.ino, (off_t)(it.pos + it.from), &bv, 0)
                 : fanfs_raw_notify_store(it.fd, it.ino, (uint64_t)(it.pos + it.from),
                                          bv.buf[0].mem, it.to - it.from)) == 0) {
            pthread_mutex_lock(&q->lock);
            q->pushes++;
            q->bytes += it.to - it.from;
            pthread_mutex_unlock(&q->lock);
        }
        pieces_release(&P->pieces, it.slot);
        pthread_mutex_lock(&q->lock);
    }
    pthread_mutex_unlock(&q->lock);
    return NULL;
}

void push_rest(struct pool *P, const struct target *t, const struct fanfs_job *j,
               const struct got *got, const int *held) {
    int k;
    int64_t pos = j->base, lo = j->base + j->skip, hi = lo + j->count;
    for (k = 0; k < j->npieces; k++) {
        int64_t end = pos + j->pieces[k].size;
        if (held[k] && got[k].fresh && got[k].slot >= 0) {
            if (lo > pos)
                push_queue(P, t, j->ino, got[k].slot, pos, 0,
                           (uint32_t)((lo < end ? lo : end) - pos));
            if (hi < end)
                push_queue(P, t, j->ino, got[k].slot, pos,
                           (uint32_t)((hi > pos ? hi : pos) - pos), j->pieces[k].size);
        }
        pos = end;
    }
}

int push_start(struct pool *P) {
    struct pushes *q = &P->push;
    q->running = 1; /* (no other thread runs yet: the pool's start) */
    if (pthread_create(&q->thread, NULL, pusher_main, P) != 0)
        q->running = 0;
    return q->running ? 0 : -1;
}

void push_stop(struct pool *P) {
    struct pushes *q = &P->push;
    pthread_mutex_lock(&q->lock);
    if (!q->running) {
        pthread_mutex_unlock(&q->lock);
        return;
    }
    /* Pushes not made are only speed lost: drop them. */
    while (q->n > 0) {
        pieces_release(&P->pieces, q->q[q->first].slot);
        q->first = (q->first + 1) % PUSH_MAX;
        q->n--;
    }
    q->running = 0;
    pthread_cond_signal(&q->cond);
    pthread_mutex_unlock(&q->lock);
    pthread_join(q->thread, NULL);
}

void push_counters(struct pushes *q, struct fanfs_pool_stats *out) {
    pthread_mutex_lock(&q->lock);
    out->pushes = q->pushes;
    out->pushed_bytes = q->bytes;
    out->push_skipped = q->skipped;
    pthread_mutex_unlock(&q->lock);
}
