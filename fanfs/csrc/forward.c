/*
 * The forward queue (front.h): requests the front does not answer, handed to pyfuse3's
 * session loop through its receiver hook, which waits for the queue's eventfd (`readyfd`)
 * instead of the FUSE device. A request is answered on the device it was read from, and
 * forwarded ones are read from the session's own fd, so libfuse's replies land right.
 *
 * Concurrency: the queue, `ended` and `running` are under fanfs_front.lock (a leaf); `readyfd`
 * is written under it too, so that it is readable exactly while the queue holds something or
 * the session has ended. Once the drain began (pyfuse3's loop has ended), a request that would
 * be forwarded is failed instead: `draining` is read without the lock first, then again under
 * it, so that no request is queued behind the drain.
 */
#define _GNU_SOURCE
#define FUSE_USE_VERSION 35
#include <errno.h>
#include <fuse_lowlevel.h>
#include <linux/fuse.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "front.h"

void fanfs_front_forward(struct fanfs_front *f, const char *msg, uint32_t n) {
    struct fanfs_fwd *w;
    uint64_t one = 1;
    ssize_t r;
    if (__atomic_load_n(&f->draining, __ATOMIC_ACQUIRE)) {
        fanfs_wire_fail(f->fd, msg, EIO); /* pyfuse3's loop has ended: nobody would answer */
        return;
    }
    w = malloc(sizeof *w + n);
    if (w == NULL) {
        fanfs_wire_fail(f->fd, msg, ENOMEM);
        return;
    }
    w->next = NULL;
    w->len = n;
    memcpy(w->data, msg, n);
    pthread_mutex_lock(&f->lock);
    if (f->draining) { /* the drain came in between: it would never see this one */
        pthread_mutex_unlock(&f->lock);
        fanfs_wire_fail(f->fd, msg, EIO);
        free(w);
        return;
    }
    if (f->tail != NULL) {
        f->tail->next = w;
    } else {
        f->head = w;
        r = write(f->readyfd, &one, sizeof one);
        (void)r;
    }
    f->tail = w;
    fanfs_front_count(f, FANFS_FRONT_FORWARDED);
    pthread_mutex_unlock(&f->lock);
}

void fanfs_front_end_session(struct fanfs_front *f) {
    uint64_t one = 1;
    ssize_t r;
    pthread_mutex_lock(&f->lock);
    f->ended = 1;
    r = write(f->readyfd, &one, sizeof one); /* stays readable: every loop task ends */
    (void)r;
    pthread_mutex_unlock(&f->lock);
}

int fanfs_front_receive_from(struct fanfs_front *f, void *session, struct fuse_buf *buf) {
    struct fanfs_fwd *w;
    uint64_t v;
    ssize_t r;
    size_t cap;
    pthread_mutex_lock(&f->lock);
    w = f->head;
    if (w == NULL) {
        int ended = f->ended || !f->running;
        if (!ended) /* empty: not readable until the next forward */
            r = read(f->readyfd, &v, sizeof v), (void)r;
        pthread_mutex_unlock(&f->lock);
        if (ended && session != NULL)
            fuse_session_exit(session); /* as libfuse's own receive does at ENODEV */
        return ended ? 0 : -EAGAIN;
    }
    f->head = w->next;
    if (f->head == NULL)
        f->tail = NULL;
    pthread_mutex_unlock(&f->lock);
    /* libfuse may read into this buffer itself later (once the front is gone): its size, at
     * least, which for the machine's page is the front's too */
    cap = fanfs_wire_libfuse_bufsize();
    if (buf->mem == NULL && (buf->mem = malloc(f->bufsize > cap ? f->bufsize : cap)) == NULL) {
        free(w);
        return -ENOMEM;
    }
    memcpy(buf->mem, w->data, w->len);
    buf->size = w->len;
    buf->flags = 0;
    free(w);
    return (int)buf->size;
}

void fanfs_front_drain_queue(struct fanfs_front *f) {
    struct fanfs_fwd *w;
    pthread_mutex_lock(&f->lock);
    __atomic_store_n(&f->draining, 1, __ATOMIC_RELEASE);
    while ((w = f->head) != NULL) {
        f->head = w->next;
        fanfs_wire_fail(f->fd, w->data, EIO);
        free(w);
    }
    f->tail = NULL;
    pthread_mutex_unlock(&f->lock);
}
