/*
 * The kernel's protocol (linux/fuse.h) as the front speaks it (front.h, struct fanfs_wire):
 * the INIT the kernel opens a session with, the replies and notify_store messages the front
 * and the pool write, a request failed.
 *
 * Replies and pushes are written as the protocol says: one writev per message, which the
 * kernel takes whole from any thread. Every reply the front writes (entry, attr, read, write,
 * notify_store) has kept its 7.12 layout since; what depends on a feature the kernel may lack
 * (max_pages, no_open, ...) is negotiated by libfuse, which answers the INIT.
 *
 * Concurrency: the INIT is recorded by the one thread that took it, before any other request
 * can come (the kernel sends nothing else until it is answered); `minor` is stored last, with
 * release, and read with acquire, so whoever sees it sees what the INIT said.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/fuse.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "front.h"

int fanfs_raw_reply(int fd, uint64_t unique, int err, const struct iovec *iov, int n) {
    struct iovec all[FANFS_MAX_PIECES + 2];
    struct fuse_out_header out;
    size_t len = sizeof out;
    int i;
    if (n < 0 || n > FANFS_MAX_PIECES + 1)
        return -EINVAL;
    for (i = 0; i < n; i++) {
        all[i + 1] = iov[i];
        len += iov[i].iov_len;
    }
    out.len = (uint32_t)len;
    out.error = err ? -err : 0;
    out.unique = unique;
    all[0].iov_base = &out;
    all[0].iov_len = sizeof out;
    if (err)
        n = 0, out.len = sizeof out;
    /* ENOENT: the request was interrupted and is gone; nothing else to do either way. */
    return writev(fd, all, n + 1) < 0 ? -errno : 0;
}

int fanfs_raw_notify_store(int fd, uint64_t ino, uint64_t off, const void *data, uint32_t len) {
    struct fuse_out_header out;
    struct fuse_notify_store_out st;
    struct iovec iov[3];
    out.len = sizeof out + sizeof st + len;
    out.error = FUSE_NOTIFY_STORE;
    out.unique = 0;
    memset(&st, 0, sizeof st);
    st.nodeid = ino;
    st.offset = off;
    st.size = len;
    iov[0] = (struct iovec){&out, sizeof out};
    iov[1] = (struct iovec){&st, sizeof st};
    iov[2] = (struct iovec){(void *)data, len};
    return writev(fd, iov, 3) < 0 ? -errno : 0;
}

void fanfs_wire_fail(int fd, const char *msg, int err) {
    const struct fuse_in_header *in = (const void *)msg;
    if (in->opcode != FUSE_FORGET && in->opcode != FUSE_BATCH_FORGET &&
        in->opcode != FUSE_INTERRUPT)
        fanfs_raw_reply(fd, in->unique, err, NULL, 0);
}

/* -- buffers ------------------------------------------------------------------------------ */

size_t fanfs_wire_bufsize_for(long page) { return (size_t)(page > 0 ? page : 4096) * 256 + 4096; }

size_t fanfs_wire_libfuse_bufsize(void) { return fanfs_wire_bufsize_for(sysconf(_SC_PAGESIZE)); }

size_t fanfs_wire_bufsize(const struct fanfs_wire *w) {
    return w->page > 0 ? fanfs_wire_bufsize_for(w->page) : fanfs_wire_libfuse_bufsize();
}

/* -- the kernel's INIT --------------------------------------------------------------------
 * Its layout grew with the protocol: 7.6 to 7.35 send major, minor, max_readahead and flags
 * (16 bytes); 7.36 and later add flags2 and reserved words (64 bytes). Only major and minor
 * are needed here (see above). RHEL 8 (4.18) speaks 7.27, RHEL 9 and SLES 15 (5.14) 7.33,
 * Ubuntu 22.04 (5.15) 7.34, 6.8 7.39. */

/* The INIT's layout, declared here: a build machine's linux/fuse.h is as old as its kernel
 * (RHEL 8's has neither flags2 nor FUSE_INIT_EXT), and the wire layout never changes. */
struct init_in {
    uint32_t major, minor, max_readahead, flags; /* 7.6 to 7.35: these 16 bytes */
    uint32_t flags_hi, unused[11];               /* 7.36 and later: flags2 */
};
#define INIT_OLD_SIZE 16
#define INIT_EXT (1u << 30) /* FUSE_INIT_EXT: flags2 is there */

/* The protocol minor each INIT flag bit first appeared in (linux/fuse.h's changelog; 0: 7.12
 * or older; 0xff: unknown, dropped by a rewrite). */
static const uint8_t flag_since[64] = {
    [7] = 14, [8] = 14, [9] = 14, [10] = 17, [11] = 18,
    [12] = 20, [13] = 21, [14] = 21, [15] = 22, [16] = 23, [17] = 23, [18] = 25, [19] = 26,
    [20] = 26, [21] = 27, [22] = 28, [23] = 28, [24] = 29, [25] = 30, [26] = 31, [27] = 32,
    [28] = 33, [29] = 33, [30] = 36, [31] = 36, [32] = 36, [33] = 36, [34] = 38, [35] = 38,
    [36] = 39, [37] = 40, [38] = 40, [39] = 40, [40] = 40, [41] = 42, [42 ... 63] = 0xff};

static uint64_t init_flags(const struct init_in *init, size_t len) {
    uint64_t f = init->flags;
    if (init->minor >= 36 && len >= sizeof *init && (f & INIT_EXT))
        f |= (uint64_t)init->flags_hi << 32;
    return f;
}

/* Rewrite the INIT in `buf` (`n` bytes) as a kernel of protocol 7.minor would send it: its
 * minor, only the flags that protocol has, its layout. The new length. */
static ssize_t pretend_init(char *buf, ssize_t n, int minor) {
    struct fuse_in_header *in = (void *)buf;
    struct init_in *init = (void *)(buf + sizeof *in);
    uint64_t flags, keep = 0;
    int bit;
    if ((size_t)n < sizeof *in + INIT_OLD_SIZE || init->major != 7 ||
        init->minor <= (uint32_t)minor)
        return n;
    flags = init_flags(init, (size_t)n - sizeof *in);
    for (bit = 0; bit < 64; bit++)
        if (flag_since[bit] <= minor)
            keep |= 1ULL << bit;
    flags &= keep;
    init->minor = (uint32_t)minor;
    init->flags = (uint32_t)flags;
    if (minor >= 36 && (size_t)n >= sizeof *in + sizeof *init) {
        init->flags_hi = (uint32_t)(flags >> 32);
        return n;
    }
    in->len = sizeof *in + INIT_OLD_SIZE;
    return (ssize_t)in->len;
}

static void saw_init(struct fanfs_wire *w, const char *buf, ssize_t n) {
    const struct init_in *init = (const void *)(buf + sizeof(struct fuse_in_header));
    size_t len = (size_t)n - sizeof(struct fuse_in_header);
    if (len < INIT_OLD_SIZE)
        return; /* no kernel sends this: forwarded, libfuse answers it */
    w->major = init->major;
    w->kminor = init->minor;
    w->kflags = init_flags(init, len);
    /* Replies here are laid out for 7.12 and later (every kernel since 2.6.29); an older
     * one, or another major, is answered by libfuse alone for the life of the mount. */
    if (init->major != 7 || init->minor < 12)
        __atomic_store_n(&w->why, FANFS_FRONT_WHY_PROTOCOL, __ATOMIC_RELAXED);
    __atomic_store_n(&w->minor, init->major == 7 ? (int)init->minor : -1, __ATOMIC_RELEASE);
}

ssize_t fanfs_wire_init(struct fanfs_wire *w, char *buf, ssize_t n) {
    if (w->pretend)
        n = pretend_init(buf, n, w->pretend);
    saw_init(w, buf, n);
    return n;
}

void fanfs_wire_reset(struct fanfs_wire *w) {
    w->minor = w->why = 0;
    w->major = w->kminor = 0;
    w->kflags = 0;
}

int fanfs_wire_minor(const struct fanfs_wire *w) {
    return __atomic_load_n(&w->minor, __ATOMIC_ACQUIRE);
}

void fanfs_wire_said(const struct fanfs_wire *w, uint64_t out[5]) {
    int minor = fanfs_wire_minor(w);
    out[0] = minor ? w->major : 0;
    out[1] = minor ? w->kminor : 0;
    out[2] = minor ? w->kflags : 0;
    out[3] = (uint64_t)__atomic_load_n(&w->why, __ATOMIC_RELAXED);
}
