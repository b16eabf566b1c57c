/*
 * Writes behind (fanfs_native.h, the front's writes mode for `fanfs output`): a WRITE is
 * answered as soon as its bytes are in the daemon's memory, and one writer thread puts them
 * into the file (pwrite to the request's file handle, an fd of the daemon's) in the order they
 * came, while the writer's next write() is already on its way.
 *
 * Why: with direct_io a writer waits for each WRITE's answer. Answered after its pwrite, a
 * 2 GiB dd with 1 MiB blocks ran at about 0.5 of writing to local disk here: the writer, the
 * copy out of the FUSE device and the copy into the page cache took turns. Answered first,
 * the copy into the page cache of block N overlaps the writer making block N+1.
 *
 * Order and what a reader sees: the queue is FIFO and has one writer thread, so writes land
 * in the order the kernel sent them (a rewrite of the same bytes lands last). Every other
 * request of the mount (READ, FLUSH, FSYNC, SETATTR, RELEASE, ...) waits until the queue is
 * empty before it is forwarded (fanfs_writes_settle): it sees every write answered before it.
 * A close therefore returns after its bytes are in the file.
 *
 * Holds (`fanfs_front_hold`): the output daemon may ask that writes through an fd below an
 * offset come to it instead: a pending landing holds the bytes below it (a snapshot), and the
 * daemon copies them to new data before such a write lands (output/tree.py). A WRITE at or
 * above the hold, an append, is written behind as any other. The hold is read when the WRITE
 * is taken; the daemon settles (fanfs_writes_settle) after setting one, so a WRITE taken just
 * before is in its file before the daemon looks.
 *
 * What changed: per fd, whether it was written since the daemon last asked and the lowest
 * offset written (fanfs_front_take_written): a landing of a file appended to sends only its
 * new bytes.
 *
 * Errors: a pwrite that fails (ENOSPC, EIO) marks its fd; every later WRITE through that fd
 * gets the errno, and so does its FLUSH (close) or FSYNC (the output daemon takes the mark
 * with fanfs_front_take_error and keeps it on the file), as the kernel reports a page cache's
 * write-back errors. Nothing is dropped silently.
 *
 * Kept: an answered WRITE is the writer's to lose until its pwrite, so the buffers live in a
 * file (fanfs_front_keep_writes; the output daemon's is in /dev/shm: fanfs/output/front.py,
 * `kept_places`), mapped shared: the kernel's page cache holds what the front read into them.
 * Before its answer a WRITE's record (struct fanfs_wb_rec, front.h) says which file (device
 * and inode of its fd), where, how many bytes, and in which order; the writer clears it after
 * the pwrite. A daemon killed with SIGKILL leaves the file, and its recovery
 * (fanfs/output/recover.py) writes the recorded WRITEs into their files, in order, before it
 * names what was open. On a tmpfs the mapping costs a 1 GiB dd nothing measurable; on a disk
 * a fifth of its rate (docs/performance.md; likely the disk's writeback of the mapped pages,
 * each write into a cleaned page then faulting: not profiled). The file is allocated whole at
 * start: no page fault can then find it full (SIGBUS). It is not kept against the node's
 * crash: the page cache is not either.
 *
 * Memory: FANFS_WB_SLOTS buffers of fanfs_front_bufsize() besides the front threads' own (one
 * each), all in the arena: the front waits for a free one when the disk is slower than the
 * writer.
 *
 * Concurrency: one lock (a leaf) and one condition variable for the queue, the spare buffers
 * and the writer's state; per-fd marks and counters are atomics (struct fanfs_writes in
 * front.h says which field is which). The state is the output wing's front's (one per front).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "front.h"

void fanfs_writes_init(struct fanfs_writes *wb) {
    memset(wb, 0, sizeof *wb);
    pthread_mutex_init(&wb->lock, NULL);
    pthread_cond_init(&wb->cond, NULL);
}

void fanfs_writes_destroy(struct fanfs_writes *wb) {
    pthread_cond_destroy(&wb->cond);
    pthread_mutex_destroy(&wb->lock);
}

static void lowest(struct fanfs_writes *wb, int fd, uint64_t off) {
    uint64_t was = __atomic_load_n(&wb->low1[fd], __ATOMIC_ACQUIRE), now = off + 1;
    while ((was == 0 || now < was) &&
           !__atomic_compare_exchange_n(&wb->low1[fd], &was, now, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
        ;
}

static void put(struct fanfs_writes *wb, const struct fanfs_wb_job *j) {
    size_t done = 0;
    while (done < j->len) {
        ssize_t k = pwrite(j->fd, j->data + done, j->len - done, (off_t)(j->off + done));
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            uint8_t none = 0;
            uint8_t e = (uint8_t)(k < 0 && errno > 0 && errno < 256 ? errno : EIO);
            __atomic_compare_exchange_n(&wb->err[j->fd], &none, e, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE);
            break;
        }
        done += (size_t)k;
    }
    lowest(wb, j->fd, j->off);
    __atomic_add_fetch(&wb->written, done, __ATOMIC_RELAXED);
}

/* The buffer `buf` is in the arena: its index (-1: it is not one of the arena's). */
static int index_of(const struct fanfs_writes *wb, const char *buf) {
    size_t at = (size_t)(buf - wb->arena) - FANFS_WB_HEAD, i = at / wb->stride;
    return buf >= wb->arena + FANFS_WB_HEAD && i < (size_t)wb->nbufs && at % wb->stride == 0
               ? (int)i
               : -1;
}

static void *writer_main(void *arg) {
    struct fanfs_writes *wb = arg;
    prctl(PR_SET_NAME, "fanfs-write", 0, 0, 0);
    pthread_mutex_lock(&wb->lock);
    for (;;) {
        struct fanfs_wb_job j;
        while (wb->count == 0 && !wb->stop)
            pthread_cond_wait(&wb->cond, &wb->lock);
        if (wb->count == 0)
            break; /* stopping, and everything queued is written */
        j = wb->q[wb->head];
        wb->head = (wb->head + 1) % FANFS_WB_SLOTS;
        wb->count--;
        wb->busy = 1;
        pthread_mutex_unlock(&wb->lock);
        put(wb, &j);
        __atomic_store_n(&wb->rec[index_of(wb, j.buf)].seq, 0, __ATOMIC_RELEASE);
        pthread_mutex_lock(&wb->lock);
        wb->spare[wb->nspare++] = j.buf;
        wb->busy = 0;
        pthread_cond_broadcast(&wb->cond);
    }
    pthread_mutex_unlock(&wb->lock);
    return NULL;
}

/* The arena: FANFS_WB_HEAD bytes (the header, then a record per buffer), then the buffers,
 * each `stride` bytes, in the kept file or in memory. */
static int map_arena(struct fanfs_writes *wb, size_t bufsize, int nbufs, int keepfd) {
    struct fanfs_wb_head *h;
    size_t len;
    wb->stride = (bufsize + 4095) & ~(size_t)4095;
    len = FANFS_WB_HEAD + (size_t)nbufs * wb->stride;
    if (keepfd < 0) {
        wb->arena = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    } else {
        int e;
        if (ftruncate(keepfd, 0) != 0 || ftruncate(keepfd, (off_t)len) != 0)
            return -errno;
        if ((e = posix_fallocate(keepfd, 0, (off_t)len)) != 0)
            return -e; /* a full disk: a page fault must never find it so (SIGBUS) */
        wb->arena = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, keepfd, 0);
    }
    if (wb->arena == MAP_FAILED) {
        wb->arena = NULL;
        return -errno;
    }
    wb->arena_len = len;
    wb->nbufs = nbufs;
    wb->rec = (struct fanfs_wb_rec *)(wb->arena + sizeof *h);
    h = (struct fanfs_wb_head *)wb->arena;
    h->nbufs = (uint32_t)nbufs;
    h->at = FANFS_WB_HEAD;
    h->stride = wb->stride;
    memcpy(h->magic, FANFS_WB_MAGIC, sizeof FANFS_WB_MAGIC); /* last: the file is one now */
    return 0;
}

static void unmap_arena(struct fanfs_writes *wb) {
    if (wb->arena != NULL)
        munmap(wb->arena, wb->arena_len);
    wb->arena = NULL;
    wb->rec = NULL;
    wb->nbufs = wb->nspare = 0;
}

int fanfs_writes_start(struct fanfs_writes *wb, size_t bufsize, int nfront, int keepfd) {
    sigset_t all, old;
    int i, nbufs = FANFS_WB_SLOTS + nfront;
    if (wb->running)
        return -EBUSY;
    if (nfront < 1 || sizeof(struct fanfs_wb_head) + (size_t)nbufs * sizeof *wb->rec >
                          FANFS_WB_OWNER)
        return -EINVAL;
    wb->stop = wb->busy = wb->head = wb->count = 0;
    wb->seq = 0;
    if ((i = map_arena(wb, bufsize, nbufs, keepfd)) != 0)
        return i;
    for (i = 0; i < FANFS_WB_SLOTS; i++)
        wb->spare[i] = wb->arena + FANFS_WB_HEAD + (size_t)i * wb->stride;
    wb->nspare = wb->lent = FANFS_WB_SLOTS;
    sigfillset(&all); /* signals stay with the interpreter's thread */
    pthread_sigmask(SIG_BLOCK, &all, &old);
    i = pthread_create(&wb->thread, NULL, writer_main, wb);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (i != 0) {
        unmap_arena(wb);
        return -i;
    }
    wb->running = 1;
    return 0;
}

char *fanfs_writes_buffer(struct fanfs_writes *wb) {
    int i = __atomic_fetch_add(&wb->lent, 1, __ATOMIC_ACQ_REL);
    return wb->arena != NULL && i < wb->nbufs ? wb->arena + FANFS_WB_HEAD + (size_t)i * wb->stride
                                               : NULL;
}

void fanfs_writes_stop(struct fanfs_writes *wb) {
    if (!wb->running)
        return;
    pthread_mutex_lock(&wb->lock);
    wb->stop = 1;
    pthread_cond_broadcast(&wb->cond);
    pthread_mutex_unlock(&wb->lock);
    pthread_join(wb->thread, NULL); /* after it wrote everything queued */
    unmap_arena(wb);                /* the front's threads have ended: theirs go too */
    wb->running = 0;
}

void fanfs_writes_settle(struct fanfs_writes *wb) {
    if (!wb->running)
        return;
    pthread_mutex_lock(&wb->lock);
    while (wb->count > 0 || wb->busy)
        pthread_cond_wait(&wb->cond, &wb->lock);
    pthread_mutex_unlock(&wb->lock);
}

int fanfs_writes_take(struct fanfs_writes *wb, int ffd, char **bufp, uint32_t n) {
    char *msg = *bufp, *fresh;
    const struct fuse_in_header *in = (const void *)msg;
    const struct fuse_write_in *w = (const void *)(msg + sizeof *in);
    struct fuse_write_out out = {0};
    struct iovec iov = {&out, sizeof out};
    struct fanfs_wb_rec *rec;
    struct stat st;
    uint64_t unique;
    uint8_t e;
    int slot, idx;
    if (!wb->running || n < sizeof *in + sizeof *w || w->size > n - sizeof *in - sizeof *w ||
        w->fh >= FANFS_FRONT_MAX_FD ||
        w->offset < __atomic_load_n(&wb->hold[w->fh], __ATOMIC_ACQUIRE))
        return -1; /* not one we take: pyfuse3 answers it */
    e = __atomic_load_n(&wb->err[w->fh], __ATOMIC_ACQUIRE); /* left for the close to take */
    if (e != 0) {
        fanfs_writes_settle(wb);
        fanfs_raw_reply(ffd, in->unique, e, NULL, 0);
        return 0;
    }
    if ((idx = index_of(wb, msg)) < 0)
        return -1;
    unique = in->unique; /* `msg` is the writer thread's once queued */
    out.size = w->size;
    rec = &wb->rec[idx];
    pthread_mutex_lock(&wb->lock);
    while (wb->nspare == 0)
        pthread_cond_wait(&wb->cond, &wb->lock);
    if (w->offset < __atomic_load_n(&wb->hold[w->fh], __ATOMIC_ACQUIRE)) {
        /* Held since the look above: the daemon set a hold, then settles under this lock,
         * so a WRITE it did not see queued must now go to it. */
        pthread_mutex_unlock(&wb->lock);
        return -1;
    }
    /* Under the lock, after the hold's look: the daemon moves an fd to a copy (dup2) only
     * after it settled, which waits for this lock, so the file recorded is the one the pwrite
     * will reach. */
    if (fstat((int)w->fh, &st) != 0) {
        pthread_mutex_unlock(&wb->lock);
        return -1; /* pyfuse3 answers it, with the error */
    }
    fresh = wb->spare[--wb->nspare];
    rec->dev = (uint64_t)st.st_dev;
    rec->ino = (uint64_t)st.st_ino;
    rec->off = w->offset;
    rec->len = w->size;
    rec->at = (uint32_t)(sizeof *in + sizeof *w);
    __atomic_store_n(&rec->seq, ++wb->seq, __ATOMIC_RELEASE); /* kept from here on */
    slot = (wb->head + wb->count) % FANFS_WB_SLOTS;
    wb->q[slot] =
        (struct fanfs_wb_job){msg, msg + sizeof *in + sizeof *w, (int)w->fh, w->offset, w->size};
    wb->count++;
    pthread_cond_broadcast(&wb->cond);
    pthread_mutex_unlock(&wb->lock);
    fanfs_raw_reply(ffd, unique, 0, &iov, 1);
    *bufp = fresh;
    return 0;
}

int64_t fanfs_writes_take_written(struct fanfs_writes *wb, int fd) {
    uint64_t low1;
    if (fd < 0 || fd >= FANFS_FRONT_MAX_FD)
        return -1;
    low1 = __atomic_exchange_n(&wb->low1[fd], 0, __ATOMIC_ACQ_REL);
    return low1 == 0 || low1 - 1 > (uint64_t)INT64_MAX ? -1 : (int64_t)(low1 - 1);
}

void fanfs_writes_hold(struct fanfs_writes *wb, int fd, uint64_t below) {
    if (fd >= 0 && fd < FANFS_FRONT_MAX_FD)
        __atomic_store_n(&wb->hold[fd], below, __ATOMIC_RELEASE);
}

int fanfs_writes_take_error(struct fanfs_writes *wb, int fd) {
    if (fd < 0 || fd >= FANFS_FRONT_MAX_FD)
        return 0;
    return __atomic_exchange_n(&wb->err[fd], 0, __ATOMIC_ACQ_REL);
}

uint64_t fanfs_writes_written(const struct fanfs_writes *wb) {
    return __atomic_load_n(&wb->written, __ATOMIC_RELAXED);
}
