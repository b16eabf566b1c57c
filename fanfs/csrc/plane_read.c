/*
 * The owner's reads for the data plane (plane.h): PLANE_READERS threads, "fanfs-pread", read
 * the stored bytes peers ask for (fanfs_pool_fast_stored), so that the plane's thread never
 * waits for a disk: a cold 2 MiB file's read took 3 to 5 ms here, during which the plane's own
 * fetches and every other ask waited, and reads of several asks did not overlap.
 *
 * The plane's thread submits an ask (plane_read_submit: never blocks; a full ring says so,
 * and the ask is refused); a reader takes it, reads it into a buffer of its own, queues the
 * completion and writes the plane's eventfd; the plane's thread takes the completions
 * (plane_read_take) and sends each reply. At most PLANE_READS asks are between submit and
 * take, so neither ring can overflow (a completion takes the place its ask held).
 *
 * Stop (plane_reads_stop, once the plane's thread is joined): reads under way finish, asks
 * not begun are dropped, the readers are joined, and the buffers nobody took are freed.
 *
 * Concurrency: one lock (reads.lock, a leaf: nothing is called with it held) and one
 * condition (`work`: an ask queued, or the stop); the rest is the plane's thread's.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "fanfs_native.h"

#ifdef FANFS_PLANE

#include "plane.h"

void plane_read_one(struct plane_read *r) {
    const char *at = NULL;
    r->began_ns = fanfs_now_ns();
    r->buf = NULL; /* (a spare if one is kept: the last sends' buffers) */
    r->cap = 0;
    r->err = fanfs_pool_fast_stored(r->entry, r->len, &r->buf, &r->cap, &at);
    if (r->err == 0) {
        r->at = (uint32_t)(at - r->buf);
    } else {
        pieces_free(&pool_live()->pieces, r->buf, r->cap);
        r->buf = NULL;
    }
    r->read_ns = fanfs_now_ns();
}

static void *reader_main(void *arg) {
    struct plane_reads *q = arg;
    struct plane_read r;
    uint64_t one = 1;
    ssize_t w;
    prctl(PR_SET_NAME, "fanfs-pread", 0, 0, 0);
    pthread_mutex_lock(&q->lock);
    for (;;) {
        while (q->tn == 0 && !q->stopping)
            pthread_cond_wait(&q->work, &q->lock);
        if (q->stopping)
            break;
        r = q->todo[q->thead];
        q->thead = (q->thead + 1) % PLANE_READS;
        q->tn--;
        pthread_mutex_unlock(&q->lock);
        plane_read_one(&r);
        pthread_mutex_lock(&q->lock);
        q->done[(q->dhead + q->dn) % PLANE_READS] = r;
        q->dn++;
        pthread_mutex_unlock(&q->lock);
        w = write(q->wakefd, &one, sizeof one);
        (void)w; /* (EAGAIN: the counter is full, so the plane is woken anyway) */
        pthread_mutex_lock(&q->lock);
    }
    pthread_mutex_unlock(&q->lock);
    return NULL;
}

int plane_reads_start(struct plane_reads *q, int wakefd) {
    int err = 0;
    memset(q, 0, sizeof *q);
    pthread_mutex_init(&q->lock, NULL);
    pthread_cond_init(&q->work, NULL);
    q->wakefd = wakefd;
    while (q->nthreads < PLANE_READERS &&
           (err = pthread_create(&q->threads[q->nthreads], NULL, reader_main, q)) == 0)
        q->nthreads++;
    if (q->nthreads > 0)
        return 0; /* (fewer readers than asked for read all the same) */
    pthread_cond_destroy(&q->work);
    pthread_mutex_destroy(&q->lock);
    return err;
}

void plane_reads_stop(struct plane_reads *q) {
    int i;
    pthread_mutex_lock(&q->lock);
    q->stopping = 1;
    pthread_cond_broadcast(&q->work);
    pthread_mutex_unlock(&q->lock);
    for (i = 0; i < q->nthreads; i++)
        pthread_join(q->threads[i], NULL);
    for (i = 0; i < q->dn; i++)
        free(q->done[(q->dhead + i) % PLANE_READS].buf);
    q->nthreads = q->tn = q->dn = q->inflight = 0;
    pthread_cond_destroy(&q->work);
    pthread_mutex_destroy(&q->lock);
}

int plane_read_submit(struct plane_reads *q, const struct plane_read *r) {
    int ok;
    pthread_mutex_lock(&q->lock);
    ok = q->inflight < PLANE_READS;
    if (ok) {
        q->todo[(q->thead + q->tn) % PLANE_READS] = *r;
        q->tn++;
        q->inflight++;
        pthread_cond_signal(&q->work);
    }
    pthread_mutex_unlock(&q->lock);
    return ok ? 0 : -1;
}

int plane_read_take(struct plane_reads *q, struct plane_read *out, int max) {
    int n = 0;
    pthread_mutex_lock(&q->lock);
    while (n < max && q->dn > 0) {
        out[n++] = q->done[q->dhead];
        q->dhead = (q->dhead + 1) % PLANE_READS;
        q->dn--;
        q->inflight--;
    }
    pthread_mutex_unlock(&q->lock);
    return n;
}

#endif
