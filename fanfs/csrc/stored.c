/*
 * Reading a stored piece's bytes and checking them (fanfs_read_stored, fanfs_native.h), for
 * the pool's threads and any Python thread: through the page cache when it holds them all,
 * else with O_DIRECT where the partition allows it, else through the page cache. No lock: its
 * only state is counters and a flag, atomic.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "fanfs_native.h"

/* What was read how (fanfs_read_counters), and whether the kernel has no cachestat. */
static struct {
    uint64_t cached, direct, buffered; /* atomic */
    int no_cachestat;                  /* atomic: set once, never cleared */
} reads;

void fanfs_read_counters(struct fanfs_read_stats *out) {
    out->cached = __atomic_load_n(&reads.cached, __ATOMIC_RELAXED);
    out->direct = __atomic_load_n(&reads.direct, __ATOMIC_RELAXED);
    out->buffered = __atomic_load_n(&reads.buffered, __ATOMIC_RELAXED);
}

int fanfs_direct_ok(int fd) {
#ifdef STATX_DIOALIGN
    struct statx st;
    if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &st) != 0 || !(st.stx_mask & STATX_DIOALIGN))
        return 0;
    return st.stx_dio_offset_align != 0 && st.stx_dio_offset_align <= FANFS_DIRECT_ALIGN &&
           st.stx_dio_mem_align != 0 && st.stx_dio_mem_align <= FANFS_DIRECT_ALIGN;
#else
    (void)fd;
    return 0;
#endif
}

/* Whether the page cache holds every page of [off, off + len) of fd: cachestat (Linux 6.5),
 * which starts no I/O (a read with RWF_NOWAIT would start readahead of what is missing). -1
 * when the kernel cannot tell. */
#ifndef __NR_cachestat
#define __NR_cachestat 451
#endif
struct cachestat_range {
    uint64_t off, len;
};
struct cachestat {
    uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};
static int all_cached(int fd, int64_t off, uint32_t len) {
    struct cachestat_range r;
    struct cachestat cs;
    uint64_t first, last;
    if (__atomic_load_n(&reads.no_cachestat, __ATOMIC_RELAXED) || len == 0)
        return -1;
    first = (uint64_t)off / 4096;
    last = ((uint64_t)off + len - 1) / 4096;
    r.off = first * 4096;
    r.len = (last - first + 1) * 4096;
    if (syscall(__NR_cachestat, fd, &r, &cs, 0) != 0) {
        if (errno == ENOSYS || errno == EPERM || errno == EOPNOTSUPP)
            __atomic_store_n(&reads.no_cachestat, 1, __ATOMIC_RELAXED);
        return -1;
    }
    return cs.nr_cache >= last - first + 1;
}

static int pread_all(int fd, char *buf, uint64_t len, int64_t off, uint64_t *got) {
    uint64_t done = 0;
    while (done < len) {
        ssize_t n = pread(fd, buf + done, len - done, (off_t)(off + (int64_t)done));
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return errno;
        if (n == 0)
            break; /* the end of the file */
        done += (uint64_t)n;
    }
    *got = done;
    return 0;
}

static int grow(char **buf, uint32_t *cap, uint64_t need) {
    char *p;
    if (need <= *cap && *buf != NULL)
        return 0;
    p = fanfs_alloc(need, cap);
    if (p == NULL)
        return ENOMEM;
    free(*buf);
    *buf = p;
    return 0;
}

int fanfs_read_stored(int fd, int dfd, const struct fanfs_piece *p, char **buf, uint32_t *cap,
                      const char **at) {
    int err;
    uint64_t got;
    int64_t start = p->off & ~(int64_t)(FANFS_DIRECT_ALIGN - 1);
    uint64_t span = (uint64_t)(p->off - start) + p->len;
    span = (span + FANFS_DIRECT_ALIGN - 1) & ~(uint64_t)(FANFS_DIRECT_ALIGN - 1);

    if (p->off < 0)
        return EINVAL;
    if (dfd >= 0 && all_cached(fd, p->off, p->len) != 1) {
        err = grow(buf, cap, span);
        if (err != 0)
            return err;
        err = pread_all(dfd, *buf, span, start, &got);
        fanfs_mark(FANFS_STAGE_DISK);
        if (err == 0) {
            if (got < (uint64_t)(p->off - start) + p->len)
                return EIO; /* the partition ends early */
            *at = *buf + (p->off - start);
            __atomic_add_fetch(&reads.direct, 1, __ATOMIC_RELAXED);
            goto check;
        }
        if (err != EINVAL)
            return err;
        /* EINVAL: this file refuses direct I/O after all; read it through the cache. */
    } else if (dfd >= 0) {
        __atomic_add_fetch(&reads.cached, 1, __ATOMIC_RELAXED);
    } else {
        __atomic_add_fetch(&reads.buffered, 1, __ATOMIC_RELAXED);
    }
    err = grow(buf, cap, p->len);
    if (err != 0)
        return err;
    err = pread_all(fd, *buf, p->len, p->off, &got);
    fanfs_mark(FANFS_STAGE_DISK);
    if (err != 0)
        return err;
    if (got < p->len)
        return EIO;
    *at = *buf;
check:
    err = fanfs_crc32(0, *at, p->len) != p->crc ? FANFS_EBADCRC : 0;
    fanfs_mark(FANFS_STAGE_CHECK);
    return err;
}
