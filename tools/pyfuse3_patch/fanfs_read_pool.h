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
 * A job is one or more stored pieces (a whole file, or frames of a framed file), each read and
 * checked whole, then decoded (zstd with the image's dictionaries, and the array filters of
 * fanfs/filters.py, byte for byte); the reply is the slice [skip, skip + count) of the pieces'
 * decoded bytes, back to back. A failed read, a checksum mismatch or bytes that do not decode
 * answer EIO and post a 16-byte record (entry, errno, 0) on the error pipe, which the daemon
 * reads to log the file once and refuse it from then on. Whole files asked for whole are not
 * cached here (the kernel's page cache keeps what was read); pieces asked for in parts, and
 * frames, go through a small cache of decoded pieces (below), which read-ahead jobs (no
 * request) fill ahead of a file read in order.
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
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define FANFS_POOL_MAX_THREADS 64
#define FANFS_MAX_PIECES 4   /* frames one job may span */
#define FANFS_MAX_DICTS 1024
/* Queued read-aheads at most (beyond, the oldest is dropped: the reader has moved past it). */
#define FANFS_AHEAD_MAX 64
/* The largest piece a job may name, stored or decoded: raw files read whole up to the reader's
 * WHOLE_FILE_LIMIT; compressed pieces are at most 4 MiB (the catalog refuses more). */
#define FANFS_PIECE_MAX (16u << 20)

typedef unsigned long (*fanfs_zlib_crc32_fn)(unsigned long, const unsigned char *, unsigned int);
typedef uint32_t (*fanfs_isal_crc32_fn)(uint32_t, const unsigned char *, uint64_t);

/* What a piece's stored bytes are (the Python side's fanfs/node/native.py names the same numbers). */
enum {
    FANFS_KIND_RAW = 0,      /* the bytes themselves */
    FANFS_KIND_ZSTD = 1,     /* one zstd frame; its header names its dictionary, if any */
    FANFS_KIND_FILTERED = 2, /* a filter id byte, then one zstd frame of that filter's output */
    FANFS_KIND_FILTER = 16,  /* 16 + filter id: one zstd frame of that filter's output */
};
/* Filter ids (fanfs/filters.py, docs/format.md). */
enum { FANFS_SHUFFLE4 = 1, FANFS_SHUFFLE8 = 2, FANFS_DELTA8 = 3, FANFS_DECIMAL4 = 4,
       FANFS_DECIMAL8 = 5, FANFS_DELTA4 = 8 };

/* One stored piece: a whole file, or one frame of a framed file. */
struct fanfs_piece {
    int64_t off;    /* where its stored bytes start in fd */
    uint32_t len;   /* stored length: all of it is read and checked */
    uint32_t crc;   /* CRC-32 of the stored bytes */
    uint32_t size;  /* decoded length */
    uint8_t kind;
    uint8_t cache;  /* 1: keep the decoded piece in the frame cache (frames of framed files) */
};

struct fanfs_job {
    struct fanfs_job *next;
    fuse_req_t req;
    int fd;
    int64_t entry;  /* catalog entry, for the error record */
    uint32_t skip;  /* the reply is bytes [skip, skip + count) of the pieces' decoded bytes */
    uint32_t count;
    int npieces;
    struct fanfs_piece pieces[FANFS_MAX_PIECES];
};

struct fanfs_error_record {
    int64_t entry;
    int32_t err;
    int32_t pad;
};

/* libzstd, dlopen'ed like the CRC libraries (no -dev package or link flag needed). */
typedef struct fanfs_zstd_dctx fanfs_zstd_dctx;
typedef struct fanfs_zstd_ddict fanfs_zstd_ddict;
struct fanfs_zstd {
    fanfs_zstd_dctx *(*create_dctx)(void);
    void (*free_dctx)(fanfs_zstd_dctx *);
    size_t (*decompress_dctx)(fanfs_zstd_dctx *, void *, size_t, const void *, size_t);
    size_t (*decompress_ddict)(fanfs_zstd_dctx *, void *, size_t, const void *, size_t,
                               const fanfs_zstd_ddict *);
    fanfs_zstd_ddict *(*create_ddict)(const void *, size_t);
    void (*free_ddict)(fanfs_zstd_ddict *);
    unsigned (*is_error)(size_t);
    unsigned (*dict_id)(const void *, size_t);
};

static struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    struct fanfs_job *head, *tail;
    struct fanfs_job *ahead_head, *ahead_tail; /* read-aheads: taken when no READ waits */
    int nahead;                                /* queued read-aheads, at most FANFS_AHEAD_MAX */
    pthread_t threads[FANFS_POOL_MAX_THREADS];
    int nthreads;
    int stopping;
    int errfd;
    fanfs_isal_crc32_fn isal_crc32; /* preferred when present */
    fanfs_zlib_crc32_fn zlib_crc32;
    struct fanfs_zstd zstd;         /* all NULL when libzstd is missing: raw pieces only */
    fanfs_zstd_ddict *ddicts[FANFS_MAX_DICTS];
    int ndicts;
} fanfs_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static uint32_t fanfs_crc32(const unsigned char *buf, uint32_t len) {
    if (fanfs_pool.isal_crc32 != NULL)
        return fanfs_pool.isal_crc32(0, buf, len);
    return (uint32_t)fanfs_pool.zlib_crc32(0, buf, len);
}

/* Per-thread buffers, kept between jobs (a fresh one per file costs page faults: glibc maps
 * blocks of 128 KiB and more straight from the kernel), each up to FANFS_POOL_KEEP. */
#define FANFS_POOL_KEEP (4u << 20)
struct fanfs_tbuf {
    char *p;
    uint32_t cap;
};
enum { FANFS_BUF_STORED, FANFS_BUF_FILTERED, FANFS_BUF_OUT, FANFS_NBUFS };
static __thread struct fanfs_tbuf fanfs_tbufs[FANFS_NBUFS];
static __thread fanfs_zstd_dctx *fanfs_dctx;

/* Buffer `which` with room for `len` bytes: the thread's own if it fits FANFS_POOL_KEEP, else
 * a malloc the caller frees (fanfs_buffer_done). NULL when out of memory. */
static char *fanfs_buffer(int which, uint64_t len) {
    struct fanfs_tbuf *b = &fanfs_tbufs[which];
    if (len == 0)
        len = 1;
    if (len <= b->cap)
        return b->p;
    if (len > FANFS_POOL_KEEP)
        return malloc(len);
    free(b->p);
    b->cap = 0;
    b->p = malloc(FANFS_POOL_KEEP);
    if (b->p != NULL)
        b->cap = FANFS_POOL_KEEP;
    return b->p;
}

static void fanfs_buffer_done(int which, char *p) {
    if (p != fanfs_tbufs[which].p)
        free(p);
}

/* -- the frame cache: decoded pieces asked for in parts, shared by the pool's threads --------
 * The kernel's readahead windows do not line up with frames (cat reads 256 KiB, then 512 KiB,
 * then 1 MiB windows from 786,432 on), and a whole file over 256 KiB comes in two READs at
 * least, so a piece is often asked for by two READs: decoding it once saves the second decode.
 * Keyed by where the stored piece is (fd, offset, length, CRC); a slot in use by a reply is
 * never evicted. */
#define FANFS_FRAMES 32
#define FANFS_FRAMES_BYTES (64u << 20)
#define FANFS_SPARES 8 /* evicted buffers kept for the next decode: no fresh pages to fault in */
struct fanfs_frame {
    int fd;
    int64_t off;
    uint32_t len, crc, size;
    uint8_t kind; /* part of the key: the same stored bytes decode differently per kind */
    char *data; /* NULL: empty slot, or one being decoded (pending) */
    uint32_t cap; /* bytes data can hold */
    int refs;
    int pending; /* a read-ahead is decoding it: wait for it rather than decode it twice */
    uint64_t used;
};
struct fanfs_spare {
    char *data;
    uint32_t cap;
};
static struct {
    pthread_mutex_t lock;
    struct fanfs_frame slot[FANFS_FRAMES];
    struct fanfs_spare spare[FANFS_SPARES];
    uint64_t clock;
    uint64_t bytes; /* decoded bytes held */
    uint64_t hits, misses;
    pthread_cond_t ready; /* a pending slot was filled or given up */
} fanfs_frames = {.lock = PTHREAD_MUTEX_INITIALIZER, .ready = PTHREAD_COND_INITIALIZER};

/* A buffer for a decoded piece of `size` bytes: a spare one if there is one big enough (an
 * evicted piece's: its pages are mapped already), else a new one. Its capacity in *cap. */
static char *fanfs_piece_alloc(uint32_t size, uint32_t *cap) {
    int i, best = -1;
    char *data = NULL;
    pthread_mutex_lock(&fanfs_frames.lock);
    for (i = 0; i < FANFS_SPARES; i++) {
        struct fanfs_spare *sp = &fanfs_frames.spare[i];
        if (sp->data != NULL && sp->cap >= size &&
            (best < 0 || sp->cap < fanfs_frames.spare[best].cap))
            best = i;
    }
    if (best >= 0) {
        data = fanfs_frames.spare[best].data;
        *cap = fanfs_frames.spare[best].cap;
        fanfs_frames.spare[best].data = NULL;
    }
    pthread_mutex_unlock(&fanfs_frames.lock);
    if (data == NULL) {
        *cap = size ? size : 1;
        data = malloc(*cap);
    }
    return data;
}

/* Give a piece's buffer back: kept as a spare while there is room, else freed. Called with
 * the cache's lock held (`locked`) or not. */
static void fanfs_piece_free(char *data, uint32_t cap, int locked) {
    int i;
    if (data == NULL)
        return;
    if (!locked)
        pthread_mutex_lock(&fanfs_frames.lock);
    for (i = 0; i < FANFS_SPARES; i++) {
        if (fanfs_frames.spare[i].data == NULL) {
            fanfs_frames.spare[i].data = data;
            fanfs_frames.spare[i].cap = cap;
            data = NULL;
            break;
        }
    }
    if (!locked)
        pthread_mutex_unlock(&fanfs_frames.lock);
    free(data);
}

static int fanfs_frame_match(const struct fanfs_frame *f, int fd, const struct fanfs_piece *p) {
    return (f->data != NULL || f->pending) && f->fd == fd && f->off == p->off && f->len == p->len &&
           f->crc == p->crc && f->size == p->size && f->kind == p->kind;
}

/* The slot holding this piece's decoded bytes (a reference taken), or -1. */
static int fanfs_frame_get(int fd, const struct fanfs_piece *p) {
    int i, found;
    pthread_mutex_lock(&fanfs_frames.lock);
    for (;;) {
        found = -1;
        for (i = 0; i < FANFS_FRAMES; i++)
            if (fanfs_frame_match(&fanfs_frames.slot[i], fd, p))
                found = i;
        if (found < 0 || !fanfs_frames.slot[found].pending)
            break;
        /* A read-ahead is decoding it now (it runs, it is not queued): wait for it. */
        pthread_cond_wait(&fanfs_frames.ready, &fanfs_frames.lock);
    }
    if (found >= 0) {
        fanfs_frames.slot[found].refs++;
        fanfs_frames.slot[found].used = ++fanfs_frames.clock;
        fanfs_frames.hits++;
    } else {
        fanfs_frames.misses++;
    }
    pthread_mutex_unlock(&fanfs_frames.lock);
    return found;
}

/* A slot for `size` more bytes, under the lock. Settled pieces (no reply uses them, no
 * read-ahead fills them) are evicted least recently used first until the cache's bytes allow
 * `size` more and a slot is free; -1 only when every piece is in use (or `size` alone is more
 * than the cache holds). An empty slot is taken only once the bytes fit: the cache never stops
 * taking pieces because the ones it holds fill its bytes while a slot is free. */
static int fanfs_frame_room(uint32_t size) {
    int i, empty, victim;
    struct fanfs_frame *f;
    for (;;) {
        empty = victim = -1;
        for (i = 0; i < FANFS_FRAMES; i++) {
            f = &fanfs_frames.slot[i];
            if (f->refs != 0 || f->pending)
                continue;
            if (f->data == NULL) {
                if (empty < 0)
                    empty = i;
            } else if (victim < 0 || f->used < fanfs_frames.slot[victim].used) {
                victim = i;
            }
        }
        if (empty >= 0 && fanfs_frames.bytes + size <= FANFS_FRAMES_BYTES)
            return empty;
        if (victim < 0)
            return -1;
        f = &fanfs_frames.slot[victim];
        fanfs_frames.bytes -= f->size;
        fanfs_piece_free(f->data, f->cap, 1);
        f->data = NULL;
    }
}

static void fanfs_frame_key(struct fanfs_frame *f, int fd, const struct fanfs_piece *p) {
    f->fd = fd;
    f->off = p->off;
    f->len = p->len;
    f->crc = p->crc;
    f->size = p->size;
    f->kind = p->kind;
    f->used = ++fanfs_frames.clock;
}

/* Claim a slot for a read-ahead of this piece: its index (pending), or -1 when the piece is
 * held or being decoded already, or there is no room. */
static int fanfs_frame_reserve(int fd, const struct fanfs_piece *p) {
    int i, slot = -1, held = 0;
    pthread_mutex_lock(&fanfs_frames.lock);
    for (i = 0; i < FANFS_FRAMES; i++)
        held |= fanfs_frame_match(&fanfs_frames.slot[i], fd, p);
    if (!held && (slot = fanfs_frame_room(p->size)) >= 0) {
        struct fanfs_frame *f = &fanfs_frames.slot[slot];
        fanfs_frame_key(f, fd, p);
        f->pending = 1;
        f->refs = 0;
        fanfs_frames.bytes += p->size; /* counted now: the room is taken */
    }
    pthread_mutex_unlock(&fanfs_frames.lock);
    return slot;
}

/* Fill a reserved slot with its decoded bytes (NULL: the decode failed, give the slot up; the
 * READ will decode it itself and report the failure), and wake whoever waits for it. */
static void fanfs_frame_fill(int slot, char *data, uint32_t cap) {
    struct fanfs_frame *f = &fanfs_frames.slot[slot];
    pthread_mutex_lock(&fanfs_frames.lock);
    f->pending = 0;
    f->data = data;
    f->cap = cap;
    if (data == NULL)
        fanfs_frames.bytes -= f->size;
    pthread_cond_broadcast(&fanfs_frames.ready);
    pthread_mutex_unlock(&fanfs_frames.lock);
}

/* Keep `data` (from fanfs_piece_alloc, `p->size` bytes of `cap`) as this piece's decoded bytes;
 * returns its slot with a reference taken, or -1 when there is no room (the caller still owns
 * `data`). Room: see fanfs_frame_room. */
static int fanfs_frame_put(int fd, const struct fanfs_piece *p, char *data, uint32_t cap) {
    int victim;
    pthread_mutex_lock(&fanfs_frames.lock);
    victim = fanfs_frame_room(p->size);
    if (victim >= 0) {
        struct fanfs_frame *f = &fanfs_frames.slot[victim];
        fanfs_frame_key(f, fd, p);
        f->data = data;
        f->cap = cap;
        f->refs = 1;
        f->pending = 0;
        fanfs_frames.bytes += p->size;
    }
    pthread_mutex_unlock(&fanfs_frames.lock);
    return victim;
}

static void fanfs_frame_release(int slot) {
    pthread_mutex_lock(&fanfs_frames.lock);
    fanfs_frames.slot[slot].refs--;
    pthread_mutex_unlock(&fanfs_frames.lock);
}

static void fanfs_frames_clear(void) {
    int i;
    pthread_mutex_lock(&fanfs_frames.lock);
    for (i = 0; i < FANFS_FRAMES; i++) {
        free(fanfs_frames.slot[i].data);
        fanfs_frames.slot[i].data = NULL;
        fanfs_frames.slot[i].refs = 0;
        fanfs_frames.slot[i].pending = 0;
    }
    for (i = 0; i < FANFS_SPARES; i++) {
        free(fanfs_frames.spare[i].data);
        fanfs_frames.spare[i].data = NULL;
    }
    fanfs_frames.bytes = 0;
    pthread_mutex_unlock(&fanfs_frames.lock);
}

/* -- filters: the inverse of fanfs/filters.py, byte for byte -------------------------------- */
static int fanfs_filter_width(int fid) {
    switch (fid) {
    case FANFS_SHUFFLE4: case FANFS_DELTA4: case FANFS_DECIMAL4: return 4;
    case FANFS_SHUFFLE8: case FANFS_DELTA8: case FANFS_DECIMAL8: return 8;
    default: return 0;
    }
}

/* The most bytes a filter's output of `size` bytes may have (decimal adds its exceptions). */
static uint64_t fanfs_filtered_max(int fid, uint32_t size) {
    int w = fanfs_filter_width(fid);
    if (fid == FANFS_DECIMAL4 || fid == FANFS_DECIMAL8)
        return 8 + (uint64_t)(size / w) * (4 + w) + size;
    return size;
}

/* The filters' loops are written to vectorize, which GCC does at -O3 only (Python's builds use
 * -O2): ask for it per function. */
#if defined(__GNUC__) && !defined(__clang__)
#define FANFS_VECTORIZE __attribute__((optimize("O3")))
#else
#define FANFS_VECTORIZE
#endif

/* The words of a shuffled stream (byte b of word i is in plane b: in[b * words + i]), written
 * to `out`. One pass per word width, simple enough for the compiler to vectorize. */
FANFS_VECTORIZE static void fanfs_unshuffle4(const unsigned char *in, uint32_t words, uint32_t *out) {
    const unsigned char *p0 = in, *p1 = in + words, *p2 = in + 2 * (uint64_t)words,
                        *p3 = in + 3 * (uint64_t)words;
    uint32_t i;
    for (i = 0; i < words; i++)
        out[i] = (uint32_t)p0[i] | (uint32_t)p1[i] << 8 | (uint32_t)p2[i] << 16 |
                 (uint32_t)p3[i] << 24;
}

FANFS_VECTORIZE static void fanfs_unshuffle8(const unsigned char *in, uint32_t words, uint64_t *out) {
    uint32_t i;
    int b;
    for (i = 0; i < words; i++)
        out[i] = 0;
    for (b = 0; b < 8; b++) {
        const unsigned char *plane = in + (uint64_t)b * words;
        for (i = 0; i < words; i++)
            out[i] |= (uint64_t)plane[i] << (8 * b);
    }
}

/* 10^e for decimal8 (a division, so every decimal round-trips) and the double nearest 10^-e
 * for decimal4 (a multiplication: rounding to float32 hides its last-bit error, and the
 * encoder keeps as exceptions the values it does not give back). Literals, as fanfs/filters.py
 * parses the same strings. */
static const double fanfs_pow10[19] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9,
                                       1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18};
static const double fanfs_inv10[11] = {1e-0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8,
                                       1e-9, 1e-10};

/* The decoders below pass over one buffer as words, then as numbers: views that may alias. */
typedef int32_t fanfs_i32 __attribute__((may_alias));
typedef int64_t fanfs_i64 __attribute__((may_alias));
typedef float fanfs_f32 __attribute__((may_alias));
typedef double fanfs_f64 __attribute__((may_alias));

/* Undo filter `fid` of `in` (`n` bytes) into `out` (`size` bytes, 8-byte aligned: a malloc or a
 * thread buffer); 0 or EILSEQ. Separate passes (unshuffle, running sum, scaling) so that all
 * but the running sum vectorize. */
FANFS_VECTORIZE static int fanfs_unfilter(int fid, const unsigned char *in, uint64_t n, unsigned char *out,
                          uint32_t size) {
    int w = fanfs_filter_width(fid);
    uint32_t words, i, k, e;
    if (w == 0 || size % w)
        return EILSEQ;
    words = size / w;
    if (fid == FANFS_DECIMAL4 || fid == FANFS_DECIMAL8) {
        const unsigned char *pos, *kept;
        if (n < 8)
            return EILSEQ;
        e = in[0];
        memcpy(&k, in + 4, 4);
        if (e > (uint32_t)(w == 4 ? 10 : 18) || k > words ||
            n != 8 + (uint64_t)k * (4 + w) + size)
            return EILSEQ;
        pos = in + 8;
        kept = pos + (uint64_t)k * 4;
        if (w == 4) {
            /* n[i]: the running sum of the unzigzagged differences, mod 2^32, as int32. */
            uint32_t *z = (uint32_t *)out, acc = 0;
            fanfs_i32 *nn = (fanfs_i32 *)out;
            fanfs_f32 *f = (fanfs_f32 *)out;
            const double inv = fanfs_inv10[e];
            fanfs_unshuffle4(kept + (uint64_t)k * 4, words, z);
            for (i = 0; i < words; i++) {
                acc += (z[i] >> 1) ^ (0u - (z[i] & 1u));
                z[i] = acc;
            }
            for (i = 0; i < words; i++)
                f[i] = (float)((double)nn[i] * inv);
        } else {
            uint64_t *z = (uint64_t *)out, acc = 0;
            fanfs_i64 *nn = (fanfs_i64 *)out;
            fanfs_f64 *v = (fanfs_f64 *)out;
            const double p10 = fanfs_pow10[e];
            fanfs_unshuffle8(kept + (uint64_t)k * 8, words, z);
            for (i = 0; i < words; i++) {
                acc += (z[i] >> 1) ^ (0u - (z[i] & 1u));
                z[i] = acc;
            }
            for (i = 0; i < words; i++)
                v[i] = (double)nn[i] / p10;
        }
        for (i = 0; i < k; i++) {
            uint32_t at;
            memcpy(&at, pos + (uint64_t)i * 4, 4);
            if (at >= words)
                return EILSEQ;
            memcpy(out + (uint64_t)at * w, kept + (uint64_t)i * w, w);
        }
        return 0;
    }
    if (n != size)
        return EILSEQ;
    if (w == 4) {
        uint32_t *x = (uint32_t *)out, acc = 0;
        fanfs_unshuffle4(in, words, x);
        if (fid == FANFS_DELTA4)
            for (i = 0; i < words; i++)
                x[i] = acc += x[i];
    } else {
        uint64_t *x = (uint64_t *)out, acc = 0;
        fanfs_unshuffle8(in, words, x);
        if (fid == FANFS_DELTA8)
            for (i = 0; i < words; i++)
                x[i] = acc += x[i];
    }
    return 0;
}

/* One zstd frame into `out` (room for `cap` bytes); its decoded length, or -1. */
static int64_t fanfs_unzstd(const unsigned char *in, uint32_t n, unsigned char *out, uint64_t cap) {
    struct fanfs_zstd *z = &fanfs_pool.zstd;
    unsigned id;
    size_t r;
    if (fanfs_dctx == NULL && (fanfs_dctx = z->create_dctx()) == NULL)
        return -1;
    id = z->dict_id(in, n);
    if (id != 0) {
        if (id > (unsigned)fanfs_pool.ndicts)
            return -1;
        r = z->decompress_ddict(fanfs_dctx, out, cap, in, n, fanfs_pool.ddicts[id - 1]);
    } else {
        r = z->decompress_dctx(fanfs_dctx, out, cap, in, n);
    }
    return z->is_error(r) ? -1 : (int64_t)r;
}

/* Decode a checked piece's stored bytes `in` into `out` (p->size bytes); 0 or an errno. */
static int fanfs_decode(const struct fanfs_piece *p, const unsigned char *in, unsigned char *out) {
    int fid = 0, err = 0;
    uint32_t n = p->len;
    uint64_t cap;
    int64_t got;
    char *filtered;

    if (p->kind == FANFS_KIND_RAW) {
        if (n != p->size)
            return EILSEQ;
        memcpy(out, in, n);
        return 0;
    }
    if (fanfs_pool.zstd.create_dctx == NULL)
        return ENOSYS;
    if (p->kind == FANFS_KIND_FILTERED) {
        if (n < 2)
            return EILSEQ;
        fid = in[0];
        in++;
        n--;
    } else if (p->kind > FANFS_KIND_FILTER) {
        fid = p->kind - FANFS_KIND_FILTER;
    } else if (p->kind != FANFS_KIND_ZSTD) {
        return EILSEQ;
    }
    if (fid == 0) {
        got = fanfs_unzstd(in, n, out, p->size);
        return got == (int64_t)p->size ? 0 : EILSEQ;
    }
    if (fanfs_filter_width(fid) == 0)
        return EILSEQ;
    cap = fanfs_filtered_max(fid, p->size);
    filtered = fanfs_buffer(FANFS_BUF_FILTERED, cap);
    if (filtered == NULL)
        return ENOMEM;
    got = fanfs_unzstd(in, n, (unsigned char *)filtered, cap);
    if (got < 0)
        err = EILSEQ;
    else
        err = fanfs_unfilter(fid, (unsigned char *)filtered, (uint64_t)got, out, p->size);
    fanfs_buffer_done(FANFS_BUF_FILTERED, filtered);
    return err;
}

static int fanfs_pread_all(int fd, char *buf, uint32_t len, int64_t off) {
    uint32_t done = 0;
    while (done < len) {
        ssize_t n = pread(fd, buf + done, len - done, (off_t)(off + (int64_t)done));
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return errno;
        if (n == 0)
            return EIO; /* the partition ends early */
        done += (uint32_t)n;
    }
    return 0;
}

/* A piece's decoded bytes, for the reply: from the frame cache (slot >= 0, a reference held),
 * in one of this thread's buffers (`which`), or malloc'ed (`which` < 0). */
struct fanfs_decoded {
    char *data;
    int slot;
    int which;
    uint32_t cap; /* which < 0: the capacity of data, from fanfs_piece_alloc */
};

/* A piece of a job: only the piece of a one-piece job may use the thread's buffers (a second
 * piece would be read into the same buffer as the first, still to be sent). */
static int fanfs_piece_get(int fd, const struct fanfs_piece *p, int single,
                           struct fanfs_decoded *d) {
    int err;
    char *stored, *out;

    d->slot = -1;
    d->which = p->cache || !single ? -1 : FANFS_BUF_OUT;
    if (p->cache && (d->slot = fanfs_frame_get(fd, p)) >= 0) {
        d->data = fanfs_frames.slot[d->slot].data;
        return 0;
    }
    stored = fanfs_buffer(FANFS_BUF_STORED, p->len);
    if (stored == NULL)
        return ENOMEM;
    err = fanfs_pread_all(fd, stored, p->len, p->off);
    if (err == 0 && fanfs_crc32((const unsigned char *)stored, p->len) != p->crc)
        err = EBADMSG;
    if (err == 0 && p->kind == FANFS_KIND_RAW && d->which == FANFS_BUF_OUT) {
        if (p->len != p->size)
            err = EILSEQ;
        d->data = stored; /* a raw whole file: reply from the stored bytes themselves */
        d->which = FANFS_BUF_STORED;
        if (err != 0)
            fanfs_buffer_done(FANFS_BUF_STORED, stored);
        return err;
    }
    out = NULL;
    if (err == 0) {
        out = d->which < 0 ? fanfs_piece_alloc(p->size, &d->cap)
                           : fanfs_buffer(d->which, p->size);
        if (out == NULL)
            err = ENOMEM;
    }
    if (err == 0)
        err = fanfs_decode(p, (const unsigned char *)stored, (unsigned char *)out);
    fanfs_buffer_done(FANFS_BUF_STORED, stored);
    if (err != 0) {
        if (d->which < 0)
            fanfs_piece_free(out, d->cap, 0);
        else if (out != NULL)
            fanfs_buffer_done(d->which, out);
        return err;
    }
    d->data = out;
    if (p->cache)
        d->slot = fanfs_frame_put(fd, p, out, d->cap); /* -1: no room, the job frees it */
    return 0;
}

static void fanfs_piece_done(struct fanfs_decoded *d) {
    if (d->slot >= 0)
        fanfs_frame_release(d->slot);
    else if (d->which < 0)
        fanfs_piece_free(d->data, d->cap, 0);
    else
        fanfs_buffer_done(d->which, d->data);
}

/* A read-ahead job (no request): decode each piece nobody holds into the frame cache. */
static void fanfs_readahead_run(struct fanfs_job *j) {
    int i;
    for (i = 0; i < j->npieces; i++) {
        const struct fanfs_piece *p = &j->pieces[i];
        int slot = fanfs_frame_reserve(j->fd, p), err;
        uint32_t cap = 0;
        char *stored, *out = NULL;
        if (slot < 0)
            continue;
        stored = fanfs_buffer(FANFS_BUF_STORED, p->len);
        err = stored == NULL ? ENOMEM : fanfs_pread_all(j->fd, stored, p->len, p->off);
        if (err == 0 && fanfs_crc32((const unsigned char *)stored, p->len) != p->crc)
            err = EBADMSG;
        if (err == 0 && (out = fanfs_piece_alloc(p->size, &cap)) == NULL)
            err = ENOMEM;
        if (err == 0)
            err = fanfs_decode(p, (const unsigned char *)stored, (unsigned char *)out);
        if (stored != NULL)
            fanfs_buffer_done(FANFS_BUF_STORED, stored);
        if (err != 0) {
            fanfs_piece_free(out, cap, 0);
            out = NULL;
        }
        fanfs_frame_fill(slot, out, cap);
    }
}

static void fanfs_job_run(struct fanfs_job *j) {
    struct fanfs_decoded got[FANFS_MAX_PIECES];
    struct iovec iov[FANFS_MAX_PIECES];
    int err = 0, i, niov = 0, held[FANFS_MAX_PIECES] = {0};
    uint64_t at = 0, lo = j->skip, hi = (uint64_t)j->skip + j->count;

    if (j->req == NULL) {
        fanfs_readahead_run(j);
        return;
    }
    for (i = 0; i < j->npieces && err == 0; i++) {
        const struct fanfs_piece *p = &j->pieces[i];
        uint64_t end = at + p->size;
        /* Only the pieces that hold some of [lo, hi) are read: this one's [at, end). */
        if (end > lo && at < hi) {
            uint64_t a = lo > at ? lo - at : 0, b = (hi < end ? hi : end) - at;
            err = fanfs_piece_get(j->fd, p, j->npieces == 1, &got[i]);
            if (err != 0)
                break;
            held[i] = 1;
            iov[niov].iov_base = got[i].data + a;
            iov[niov].iov_len = b - a;
            niov++;
        }
        at = end;
    }
    if (err == 0)
        fuse_reply_iov(j->req, iov, niov);
    for (i = 0; i < j->npieces; i++)
        if (held[i])
            fanfs_piece_done(&got[i]);
    if (err != 0) {
        /* A full pipe loses the record; the file is still answered EIO on every read. */
        struct fanfs_error_record rec = {j->entry, err, 0};
        ssize_t posted;
        fuse_reply_err(j->req, EIO);
        posted = write(fanfs_pool.errfd, &rec, sizeof rec);
        (void)posted;
    }
}

/* The next job under the lock: a READ's first, a read-ahead only when no READ waits. */
static struct fanfs_job *fanfs_next_job(void) {
    struct fanfs_job **head = &fanfs_pool.head, **tail = &fanfs_pool.tail, *j;
    if (fanfs_pool.stopping) /* read-aheads are not worth running any more */
        while ((j = fanfs_pool.ahead_head) != NULL) {
            fanfs_pool.ahead_head = j->next;
            free(j);
        }
    if (fanfs_pool.stopping) {
        fanfs_pool.ahead_tail = NULL;
        fanfs_pool.nahead = 0;
    }
    if (*head == NULL) {
        head = &fanfs_pool.ahead_head;
        tail = &fanfs_pool.ahead_tail;
    }
    j = *head;
    if (j != NULL) {
        *head = j->next;
        if (*head == NULL)
            *tail = NULL;
        if (j->req == NULL)
            fanfs_pool.nahead--;
    }
    return j;
}

static void *fanfs_pool_main(void *arg) {
    int i;
    (void)arg;
    for (;;) {
        struct fanfs_job *j;
        pthread_mutex_lock(&fanfs_pool.lock);
        while (fanfs_pool.head == NULL && fanfs_pool.ahead_head == NULL && !fanfs_pool.stopping)
            pthread_cond_wait(&fanfs_pool.cond, &fanfs_pool.lock);
        j = fanfs_next_job();
        pthread_mutex_unlock(&fanfs_pool.lock);
        if (j == NULL)
            break; /* stopping, and every queued job is answered */
        fanfs_job_run(j);
        free(j);
    }
    for (i = 0; i < FANFS_NBUFS; i++) {
        free(fanfs_tbufs[i].p);
        fanfs_tbufs[i].p = NULL;
        fanfs_tbufs[i].cap = 0;
    }
    if (fanfs_dctx != NULL)
        fanfs_pool.zstd.free_dctx(fanfs_dctx);
    fanfs_dctx = NULL;
    return NULL;
}

static void fanfs_load_zstd(void) {
    struct fanfs_zstd z;
    void *lib = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL)
        return;
    *(void **)&z.create_dctx = dlsym(lib, "ZSTD_createDCtx");
    *(void **)&z.free_dctx = dlsym(lib, "ZSTD_freeDCtx");
    *(void **)&z.decompress_dctx = dlsym(lib, "ZSTD_decompressDCtx");
    *(void **)&z.decompress_ddict = dlsym(lib, "ZSTD_decompress_usingDDict");
    *(void **)&z.create_ddict = dlsym(lib, "ZSTD_createDDict");
    *(void **)&z.free_ddict = dlsym(lib, "ZSTD_freeDDict");
    *(void **)&z.is_error = dlsym(lib, "ZSTD_isError");
    *(void **)&z.dict_id = dlsym(lib, "ZSTD_getDictID_fromFrame");
    if (z.create_dctx && z.free_dctx && z.decompress_dctx && z.decompress_ddict &&
        z.create_ddict && z.free_ddict && z.is_error && z.dict_id)
        fanfs_pool.zstd = z;
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
    if (fanfs_pool.zstd.create_dctx == NULL)
        fanfs_load_zstd();
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

/* The image's zstd dictionaries (dictionary id i + 1 is dicts[i]); call before the first job
 * that needs one. 0, or -ENOSYS without libzstd, -EINVAL / -ENOMEM. */
static int fanfs_pool_set_dicts(int n, const char **dicts, const size_t *lens) {
    int i;
    if (fanfs_pool.zstd.create_ddict == NULL)
        return -ENOSYS;
    if (n < 0 || n > FANFS_MAX_DICTS)
        return -EINVAL;
    for (i = 0; i < fanfs_pool.ndicts; i++)
        fanfs_pool.zstd.free_ddict(fanfs_pool.ddicts[i]);
    fanfs_pool.ndicts = 0;
    for (i = 0; i < n; i++) {
        fanfs_pool.ddicts[i] = fanfs_pool.zstd.create_ddict(dicts[i], lens[i]);
        if (fanfs_pool.ddicts[i] == NULL)
            return -ENOMEM;
        fanfs_pool.ndicts = i + 1;
    }
    return 0;
}

/* Which library computes the CRC-32 of the running pool. */
static const char *fanfs_pool_crc_name(void) {
    return fanfs_pool.isal_crc32 != NULL ? "isa-l" : "zlib";
}

/* Whether the pool decodes zstd pieces (libzstd found). */
static int fanfs_pool_decodes(void) {
    return fanfs_pool.zstd.create_dctx != NULL;
}

/* Frame cache hits and misses so far. */
static void fanfs_pool_frame_stats(uint64_t *hits, uint64_t *misses) {
    pthread_mutex_lock(&fanfs_frames.lock);
    *hits = fanfs_frames.hits;
    *misses = fanfs_frames.misses;
    pthread_mutex_unlock(&fanfs_frames.lock);
}

/* Queue a job (its pieces already checked by the caller for sizes); -1 if the pool is not
 * running (the caller answers the request itself). */
static int fanfs_pool_submit(struct fanfs_job *proto) {
    struct fanfs_job *j, **head, **tail;
    if (fanfs_pool.nthreads == 0 || fanfs_pool.stopping)
        return -1;
    j = malloc(sizeof *j);
    if (j == NULL)
        return -1;
    *j = *proto;
    j->next = NULL;
    head = j->req == NULL ? &fanfs_pool.ahead_head : &fanfs_pool.head; /* read-aheads apart */
    tail = j->req == NULL ? &fanfs_pool.ahead_tail : &fanfs_pool.tail;
    pthread_mutex_lock(&fanfs_pool.lock);
    if (j->req == NULL && fanfs_pool.nahead >= FANFS_AHEAD_MAX) {
        struct fanfs_job *old = fanfs_pool.ahead_head; /* the stalest: drop it */
        fanfs_pool.ahead_head = old->next;
        if (fanfs_pool.ahead_head == NULL)
            fanfs_pool.ahead_tail = NULL;
        fanfs_pool.nahead--;
        free(old);
    }
    if (*tail != NULL)
        (*tail)->next = j;
    else
        *head = j;
    *tail = j;
    if (j->req == NULL)
        fanfs_pool.nahead++;
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
    fanfs_frames_clear();
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
