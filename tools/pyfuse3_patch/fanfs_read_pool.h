/*
 * fanfs's native read pool, compiled into pyfuse3 by tools/install_pyfuse3.py.
 *
 * Why: answering a FUSE read of a small file that is not in the page cache costs the Python
 * daemon a thread hand-off (a trio worker thread, the GIL, a wake-up back to the event loop)
 * on top of the disk read: on a 2-core VM that was about 200 us of CPU per file, which capped
 * cold reads of 128 KiB files at a third of native speed. Here the event loop only queues
 * (fd, offset, length, crc) and returns; plain threads that never touch the GIL read the bytes,
 * check their CRC-32 and send the reply to the kernel themselves (libfuse replies are
 * thread-safe: its own multi-threaded loop replies from any thread).
 *
 * A job covers one whole file stored raw: it is read and checked whole, and the reply is the
 * slice [skip, skip + count) of it. A failed read or a checksum mismatch answers EIO and posts
 * a 16-byte record (entry, errno, 0) on the error pipe, which the daemon reads to log the file
 * once and refuse it from then on. Nothing is cached here: the kernel's page cache keeps what
 * was read.
 *
 * CRC-32 comes from ISA-L (libisal.so.2, Debian's libisal2) when it is installed: its
 * crc32_gzip_refl computes the same CRC as zlib's crc32 with carry-less multiplication, about
 * ten times faster (60 against 6 GB/s here), and at 128 KiB per file zlib's CRC was a fifth of
 * the daemon's CPU. Otherwise from the zlib that Python already uses. Both are dlopen'ed, so no
 * link flag is needed.
 */
#ifndef FANFS_READ_POOL_H
#define FANFS_READ_POOL_H

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define FANFS_POOL_MAX_THREADS 64

typedef unsigned long (*fanfs_zlib_crc32_fn)(unsigned long, const unsigned char *, unsigned int);
typedef uint32_t (*fanfs_isal_crc32_fn)(uint32_t, const unsigned char *, uint64_t);

struct fanfs_job {
    struct fanfs_job *next;
    fuse_req_t req;
    int fd;
    int64_t off;    /* where the file's bytes start in fd */
    uint32_t len;   /* the file's length: all of it is read and checked */
    uint32_t crc;   /* CRC-32 of those bytes */
    int64_t entry;  /* catalog entry, for the error record */
    uint32_t skip;  /* the reply is bytes [skip, skip + count) of the file */
    uint32_t count;
};

struct fanfs_error_record {
    int64_t entry;
    int32_t err;
    int32_t pad;
};

static struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    struct fanfs_job *head, *tail;
    pthread_t threads[FANFS_POOL_MAX_THREADS];
    int nthreads;
    int stopping;
    int errfd;
    fanfs_isal_crc32_fn isal_crc32; /* preferred when present */
    fanfs_zlib_crc32_fn zlib_crc32;
} fanfs_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static uint32_t fanfs_crc32(const unsigned char *buf, uint32_t len) {
    if (fanfs_pool.isal_crc32 != NULL)
        return fanfs_pool.isal_crc32(0, buf, len);
    return (uint32_t)fanfs_pool.zlib_crc32(0, buf, len);
}

/* Each thread keeps its buffer: a fresh one per file costs page faults (glibc maps blocks of
 * 128 KiB and more straight from the kernel). Kept up to 1 MiB, the largest READ. */
#define FANFS_POOL_KEEP (1u << 20)
static __thread char *fanfs_tbuf;
static __thread uint32_t fanfs_tcap;

static char *fanfs_buffer(uint32_t len) {
    if (len <= fanfs_tcap)
        return fanfs_tbuf;
    if (len > FANFS_POOL_KEEP)
        return malloc(len);
    free(fanfs_tbuf);
    fanfs_tcap = 0;
    fanfs_tbuf = malloc(FANFS_POOL_KEEP);
    if (fanfs_tbuf != NULL)
        fanfs_tcap = FANFS_POOL_KEEP;
    return fanfs_tbuf;
}

static void fanfs_job_run(struct fanfs_job *j) {
    int err = 0;
    uint32_t done = 0;
    char *buf = fanfs_buffer(j->len ? j->len : 1);

    if (buf == NULL)
        err = ENOMEM;
    while (err == 0 && done < j->len) {
        ssize_t n = pread(j->fd, buf + done, j->len - done, (off_t)(j->off + (int64_t)done));
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            err = errno;
        else if (n == 0)
            err = EIO; /* the partition ends early */
        else
            done += (uint32_t)n;
    }
    if (err == 0 && fanfs_crc32((const unsigned char *)buf, j->len) != j->crc)
        err = EBADMSG;
    if (err == 0) {
        fuse_reply_buf(j->req, buf + j->skip, j->count);
    } else {
        /* A full pipe loses the record; the file is still answered EIO on every read. */
        struct fanfs_error_record rec = {j->entry, err, 0};
        ssize_t posted;
        fuse_reply_err(j->req, EIO);
        posted = write(fanfs_pool.errfd, &rec, sizeof rec);
        (void)posted;
    }
    if (buf != fanfs_tbuf)
        free(buf);
}

static void *fanfs_pool_main(void *arg) {
    (void)arg;
    for (;;) {
        struct fanfs_job *j;
        pthread_mutex_lock(&fanfs_pool.lock);
        while (fanfs_pool.head == NULL && !fanfs_pool.stopping)
            pthread_cond_wait(&fanfs_pool.cond, &fanfs_pool.lock);
        j = fanfs_pool.head;
        if (j != NULL) {
            fanfs_pool.head = j->next;
            if (fanfs_pool.head == NULL)
                fanfs_pool.tail = NULL;
        }
        pthread_mutex_unlock(&fanfs_pool.lock);
        if (j == NULL)
            break; /* stopping, and every queued job is answered */
        fanfs_job_run(j);
        free(j);
    }
    free(fanfs_tbuf);
    fanfs_tbuf = NULL;
    fanfs_tcap = 0;
    return NULL;
}

/* Start `nthreads` threads (idempotent); error records go to `errfd` (non-blocking pipe). */
static int fanfs_pool_start(int nthreads, int errfd) {
    sigset_t all, old;
    void *zlib, *isal;
    int i;

    if (fanfs_pool.nthreads > 0)
        return 0;
    if (nthreads < 1 || nthreads > FANFS_POOL_MAX_THREADS)
        return -EINVAL;
    isal = dlopen("libisal.so.2", RTLD_NOW | RTLD_LOCAL);
    if (isal != NULL)
        fanfs_pool.isal_crc32 = (fanfs_isal_crc32_fn)dlsym(isal, "crc32_gzip_refl");
    zlib = dlopen("libz.so.1", RTLD_NOW | RTLD_LOCAL);
    if (zlib != NULL)
        fanfs_pool.zlib_crc32 = (fanfs_zlib_crc32_fn)dlsym(zlib, "crc32");
    if (fanfs_pool.isal_crc32 == NULL && fanfs_pool.zlib_crc32 == NULL)
        return -ENOENT;
    fanfs_pool.errfd = errfd;
    fanfs_pool.stopping = 0;
    /* Signals stay with the interpreter's thread. */
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    for (i = 0; i < nthreads; i++) {
        if (pthread_create(&fanfs_pool.threads[i], NULL, fanfs_pool_main, NULL) != 0)
            break;
        fanfs_pool.nthreads++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return fanfs_pool.nthreads > 0 ? 0 : -EAGAIN;
}

/* Which library computes the CRC-32 of the running pool. */
static const char *fanfs_pool_crc_name(void) {
    return fanfs_pool.isal_crc32 != NULL ? "isa-l" : "zlib";
}

/* Queue a job; -1 if the pool is not running (the caller answers the request itself). */
static int fanfs_pool_submit(fuse_req_t req, int fd, int64_t off, uint32_t len, uint32_t crc,
                             int64_t entry, uint32_t skip, uint32_t count) {
    struct fanfs_job *j;
    if (fanfs_pool.nthreads == 0 || fanfs_pool.stopping || skip > len || count > len - skip)
        return -1;
    j = malloc(sizeof *j);
    if (j == NULL)
        return -1;
    j->next = NULL;
    j->req = req;
    j->fd = fd;
    j->off = off;
    j->len = len;
    j->crc = crc;
    j->entry = entry;
    j->skip = skip;
    j->count = count;
    pthread_mutex_lock(&fanfs_pool.lock);
    if (fanfs_pool.tail != NULL)
        fanfs_pool.tail->next = j;
    else
        fanfs_pool.head = j;
    fanfs_pool.tail = j;
    pthread_cond_signal(&fanfs_pool.cond);
    pthread_mutex_unlock(&fanfs_pool.lock);
    return 0;
}

/* Answer every queued job, then stop the threads. Call before the FUSE session is destroyed. */
static void fanfs_pool_stop(void) {
    int i;
    pthread_mutex_lock(&fanfs_pool.lock);
    fanfs_pool.stopping = 1;
    pthread_cond_broadcast(&fanfs_pool.cond);
    pthread_mutex_unlock(&fanfs_pool.lock);
    for (i = 0; i < fanfs_pool.nthreads; i++)
        pthread_join(fanfs_pool.threads[i], NULL);
    fanfs_pool.nthreads = 0;
}

/*
 * The session loop's spin (see fanfs_read_pool.pxi, _fanfs_spin): a reader that just sent a
 * request is likely to send the next one within microseconds (Python's open() sends FUSE_IOCTL
 * for its terminal check, then READ or nothing; a cold file sends LOOKUP, then READ). Going
 * back to trio's epoll between them costs the daemon a sleep and a wake-up, which is most of a
 * round trip's time. So for a short while after a request the loop polls the (non-blocking)
 * FUSE fd, yielding the CPU between polls to whatever else wants it.
 */
static int64_t fanfs_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Poll `se` until a request arrives (its size), `until` passes or `chunk_ns` have been spent
 * (-EAGAIN), or an error. Called without the GIL. */
static int fanfs_spin_receive(struct fuse_session *se, struct fuse_buf *buf, int64_t chunk_ns,
                              int64_t until) {
    int64_t end = fanfs_now_ns() + chunk_ns;
    int res;
    if (end > until)
        end = until;
    do {
        sched_yield();
        res = fuse_session_receive_buf(se, buf);
        if (res != -EAGAIN)
            return res;
    } while (fanfs_now_ns() < end);
    return -EAGAIN;
}

#endif
