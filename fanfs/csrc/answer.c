/*
 * What a front thread does with the request it took (front.h): answer it itself, in the thread
 * that read it, or forward it to pyfuse3 (forward.c). Its replies go to the device it was
 * read from (f->fd).
 *
 * The node wing's front answers
 *   LOOKUP    from the catalog (meta.c), and the file's read or fetch starts
 *             (fanfs_pool_looked_up);
 *   GETATTR   from the catalog;
 *   READ      of a file stored whole in a partition staged here (the pool's job, run in this
 *             thread: read, check, decode, reply, push the rest), or held by a peer (fetched
 *             by the MPI thread into the pool's cache, this thread waiting for it);
 *   (while a planned epoch runs, the files looked up and read are recorded: follow.c)
 *   IOCTL     ENOSYS, as libfuse answers it (the kernel makes it ENOTTY; Python's open() asks
 *             every file whether it is a terminal);
 *   FORGET, BATCH_FORGET, INTERRUPT: nothing to do (fanfs keeps no per-inode state, and
 *             pyfuse3 does nothing with interrupts).
 * The output wing's (writes mode) answers only
 *   WRITE     at once, its bytes queued for a pwrite to the file handle (writes.c);
 *   FORGET, BATCH_FORGET, INTERRUPT as above;
 * and forwards the rest once the queued writes are in their files.
 * Everything else (INIT first, READDIR, the status attribute, framed and large files, files
 * whose bytes a planned epoch read ahead and holds in Python) is forwarded.
 *
 * Concurrency: the catalog is immutable; the enable flag and the per-partition fds are the
 * pool's (atomics); counters are atomics. No lock is held across a call into the pool.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/fuse.h>
#include <string.h>
#include <sys/uio.h>

#include "front.h"

static int reply_entry(struct fanfs_front *f, const struct fuse_in_header *in, int64_t e) {
    struct fuse_entry_out out;
    struct iovec iov = {&out, sizeof out};
    fanfs_meta_entry_out(&f->m, e, &out);
    fanfs_front_count(f, FANFS_FRONT_LOOKUPS);
    fanfs_raw_reply(f->fd, in->unique, 0, &iov, 1);
    return 0;
}

/* 0: answered; -1: Python answers it. */
static int lookup(struct fanfs_front *f, const struct fuse_in_header *in, const char *arg,
                  uint32_t arglen) {
    const struct fanfs_meta *m = &f->m;
    int64_t e = fanfs_meta_find(m, in->nodeid, arg, arglen);
    uint32_t part;
    if (e == -1)
        return -1;
    if (e == -2)
        return reply_entry(f, in, -1);
    if (fanfs_meta_is_file(m, (uint64_t)e)) {
        part = fanfs_meta_part(m, (uint64_t)e);
        if (part < m->nparts && !m->part_local[part] && !fanfs_remote_on())
            return -1; /* a peer's file, no remote path here: Python starts its fetch now */
        fanfs_pool_looked_up((uint64_t)e + 1);
        reply_entry(f, in, e);
        fanfs_follow_add(&f->follow, (uint64_t)e, 0);
        return 0;
    }
    return reply_entry(f, in, e);
}

static int getattr(struct fanfs_front *f, const struct fuse_in_header *in) {
    struct fuse_attr_out out;
    struct iovec iov = {&out, sizeof out};
    if (fanfs_meta_attr_out(&f->m, in->nodeid, &out) != 0)
        return -1;
    fanfs_front_count(f, FANFS_FRONT_GETATTRS);
    fanfs_raw_reply(f->fd, in->unique, 0, &iov, 1);
    return 0;
}

static int read_(struct fanfs_front *f, const struct fuse_in_header *in,
                 const struct fuse_read_in *r) {
    int64_t began = fanfs_now_ns();
    if (fanfs_pool_fast_answer(f->fd, in->unique, in->nodeid, (int64_t)r->offset, r->size) !=
        0) {
        fanfs_budget_end(&f->budget, 0);
        return -1;
    }
    fanfs_budget_end(&f->budget, 1);
    fanfs_latency_add(&f->lat, began);
    fanfs_front_count(f, FANFS_FRONT_READS);
    if (r->offset == 0)
        fanfs_follow_add(&f->follow, in->nodeid - 1, 1);
    return 0;
}

/* The node wing: answer what this thread can; 0 if it did, -1 to forward. */
static int answer(struct fanfs_front *f, const char *msg, uint32_t n) {
    const struct fuse_in_header *in = (const void *)msg;
    const char *arg = msg + sizeof *in;
    uint32_t arglen = n - sizeof *in;
    if (!fanfs_pool_fast_on())
        return -1; /* off (not started, or no fast path): Python sees everything */
    switch (in->opcode) {
    case FUSE_LOOKUP:
        return lookup(f, in, arg, arglen);
    case FUSE_GETATTR:
        return getattr(f, in);
    case FUSE_READ:
        if (arglen < sizeof(struct fuse_read_in))
            return -1;
        return read_(f, in, (const void *)arg);
    case FUSE_IOCTL:
        fanfs_front_count(f, FANFS_FRONT_OTHERS);
        fanfs_raw_reply(f->fd, in->unique, ENOSYS, NULL, 0);
        return 0;
    case FUSE_FORGET:
    case FUSE_BATCH_FORGET:
    case FUSE_INTERRUPT:
        fanfs_front_count(f, FANFS_FRONT_OTHERS);
        return 0; /* no reply: these have none */
    default:
        return -1;
    }
}

/* Writes mode: WRITE goes to the writes-behind queue (writes.c); anything else waits until
 * the queue is empty, then is forwarded. */
static int answer_writes(struct fanfs_front *f, char **bufp, uint32_t n) {
    const struct fuse_in_header *in = (const void *)*bufp;
    switch (in->opcode) {
    case FUSE_WRITE:
        if (fanfs_writes_take(&f->wb, f->fd, bufp, n) == 0) {
            fanfs_front_count(f, FANFS_FRONT_OTHERS);
            return 0;
        }
        break;
    case FUSE_FORGET:
    case FUSE_BATCH_FORGET:
    case FUSE_INTERRUPT:
        return 0;
    default:
        break;
    }
    fanfs_writes_settle(&f->wb);
    return -1;
}

void fanfs_front_handle(struct fanfs_front *f, char **bufp, ssize_t n) {
    char *buf = *bufp;
    const struct fuse_in_header *in = (const void *)buf;
    if ((size_t)n < sizeof *in || in->len != (uint32_t)n)
        return; /* the kernel never sends this */
    if (in->opcode == FUSE_INIT)
        n = fanfs_wire_init(&f->wire, buf, n);
    if (fanfs_wire_minor(&f->wire) < 12) {
        if (f->writes)
            fanfs_writes_settle(&f->wb);
        fanfs_front_forward(f, buf, (uint32_t)n);
    } else if (f->writes ? answer_writes(f, bufp, (uint32_t)n) != 0
                         : answer(f, buf, (uint32_t)n) != 0) {
        fanfs_front_forward(f, *bufp, (uint32_t)n);
    }
}
