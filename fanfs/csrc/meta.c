/*
 * The catalog as the front reads it (front.h; struct fanfs_meta in fanfs_native.h): the
 * entry a LOOKUP names, the attributes LOOKUP and GETATTR answer with. The columns are the
 * image's own (little-endian, maybe unaligned), read in place.
 *
 * Pure: no I/O and no lock. The catalog is immutable for the life of the mount (it outlives
 * the front that reads it), so any thread may ask at any time.
 */
#define _GNU_SOURCE
#include <endian.h>
#include <linux/fuse.h>
#include <string.h>
#include <sys/stat.h>

#include "front.h"

void fanfs_meta_fill(const struct fanfs_meta *m, uint64_t e, struct fuse_attr *a) {
    uint64_t size = fanfs_col64(m->size, e);
    int64_t t = (int64_t)fanfs_col64(m->mtime, e);
    int64_t sec = t / 1000000000, nsec = t % 1000000000;
    if (nsec < 0) { /* before 1970: the nanoseconds count forwards from a whole second */
        nsec += 1000000000;
        sec -= 1;
    }
    memset(a, 0, sizeof *a);
    a->ino = e + 1;
    a->size = size;
    a->blocks = fanfs_col64(m->blocks, e);
    a->atime = a->mtime = a->ctime = (uint64_t)sec;
    a->atimensec = a->mtimensec = a->ctimensec = (uint32_t)nsec;
    a->mode = fanfs_col32(m->mode, e);
    a->nlink = m->nlink[e];
    a->uid = m->uid;
    a->gid = m->gid;
    a->blksize = m->blksize;
}

int fanfs_meta_is_file(const struct fanfs_meta *m, uint64_t e) {
    return S_ISREG(fanfs_col32(m->mode, e));
}

uint32_t fanfs_meta_part(const struct fanfs_meta *m, uint64_t e) { return fanfs_col32(m->part, e); }

int fanfs_meta_attr(const struct fanfs_meta *m, uint64_t e, uint64_t out[12]) {
    struct fuse_attr a;
    if (m->n == 0 || e >= m->n)
        return -1;
    fanfs_meta_fill(m, e, &a);
    out[0] = a.ino, out[1] = a.size, out[2] = a.blocks, out[3] = a.mtime;
    out[4] = a.mtimensec, out[5] = a.mode, out[6] = a.nlink, out[7] = a.uid;
    out[8] = a.gid, out[9] = a.blksize, out[10] = a.atime, out[11] = a.ctime;
    return 0;
}

int64_t fanfs_meta_lookup(const struct fanfs_meta *m, uint64_t parent, const char *name,
                          size_t len) {
    uint64_t lo, hi;
    if (parent >= m->n || !S_ISDIR(fanfs_col32(m->mode, parent)))
        return -1;
    lo = fanfs_col32(m->child_start, parent);
    hi = lo + fanfs_col32(m->child_count, parent);
    if (hi > m->n)
        return -1;
    while (lo < hi) { /* names sorted by their bytes, a prefix before what extends it */
        uint64_t mid = lo + (hi - lo) / 2, off = fanfs_col64(m->name_off, mid);
        uint32_t nlen = fanfs_col32(m->name_len, mid);
        int c;
        if (off > m->strings_len || nlen > m->strings_len - off)
            return -1; /* the catalog was checked at load; never trust it further */
        c = memcmp(m->strings + off, name, nlen < len ? nlen : len);
        if (c == 0)
            c = nlen < len ? -1 : nlen > len ? 1 : 0;
        if (c == 0)
            return (int64_t)mid;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return -2; /* no such name */
}

int64_t fanfs_meta_find(const struct fanfs_meta *m, uint64_t nodeid, const char *arg,
                        uint32_t arglen) {
    size_t len = strnlen(arg, arglen);
    if (len == arglen || len == 0 || nodeid < 1)
        return -1; /* no NUL in the request, or an empty name: libfuse's answer is the rule */
    if ((len == 1 && arg[0] == '.') || (len == 2 && arg[0] == '.' && arg[1] == '.'))
        return -1;
    return fanfs_meta_lookup(m, nodeid - 1, arg, len);
}

void fanfs_meta_entry_out(const struct fanfs_meta *m, int64_t e, struct fuse_entry_out *out) {
    memset(out, 0, sizeof *out);
    out->entry_valid = out->attr_valid = m->timeout_s;
    if (e >= 0) { /* else a negative entry, cached as long: the tree never changes */
        out->nodeid = (uint64_t)e + 1;
        fanfs_meta_fill(m, (uint64_t)e, &out->attr);
    }
}

int fanfs_meta_attr_out(const struct fanfs_meta *m, uint64_t nodeid, struct fuse_attr_out *out) {
    if (nodeid < 1 || nodeid - 1 >= m->n)
        return -1;
    memset(out, 0, sizeof *out);
    out->attr_valid = m->timeout_s;
    fanfs_meta_fill(m, nodeid - 1, &out->attr);
    return 0;
}
