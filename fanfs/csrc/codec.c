/*
 * Checks and decoding of stored pieces (fanfs_native.h), for the pool's threads and for any
 * Python thread through fanfs/_native.pyx.
 *
 * CRC-32 comes from ISA-L (libisal.so.2, Debian's libisal2) when it is installed: its
 * crc32_gzip_refl computes zlib's CRC with carry-less multiplication, about ten times faster
 * (60 against 6 GB/s here). Otherwise from zlib. zstd from libzstd.so.1. All three are
 * dlopen'ed: no -dev package or link flag, and a missing libzstd only means compressed pieces
 * are decoded by the zstandard package instead (fanfs/image/codec.py). Reading the stored bytes is
 * stored.c's.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "fanfs_native.h"
#include "filters.h"

typedef unsigned long (*zlib_crc32_fn)(unsigned long, const unsigned char *, unsigned int);
typedef uint32_t (*isal_crc32_fn)(uint32_t, const unsigned char *, uint64_t);

typedef struct zstd_dctx zstd_dctx;
typedef struct zstd_ddict zstd_ddict;
struct zstd_lib { /* libzstd's functions (all NULL: no libzstd) */
    zstd_dctx *(*create_dctx)(void);
    void (*free_dctx)(zstd_dctx *);
    size_t (*decompress_dctx)(zstd_dctx *, void *, size_t, const void *, size_t);
    size_t (*decompress_ddict)(zstd_dctx *, void *, size_t, const void *, size_t,
                               const zstd_ddict *);
    zstd_ddict *(*create_ddict)(const void *, size_t);
    void (*free_ddict)(zstd_ddict *);
    unsigned (*is_error)(size_t);
    unsigned (*dict_id)(const void *, size_t);
    int (*error_code)(size_t); /* optional: ENOMEM is told from bad bytes with it */
    size_t (*set_param)(zstd_dctx *, int, int); /* optional (libzstd 1.4.0) */
};
#define ZSTD_ERROR_MEMORY_ALLOCATION 64 /* zstd_errors.h's ZSTD_error_memory_allocation */
/* zstd.h's ZSTD_d_forceIgnoreChecksum (ZSTD_d_experimentalParam3, libzstd 1.4.7) and its
 * ZSTD_d_ignoreChecksum: a frame's content checksum (XXH64 of what it decodes to) is not
 * computed. Every piece is decoded only after the CRC-32 of its stored bytes, the frame and
 * its checksum included, matched the catalog's (stored.c, remote.c, fanfs/image/codec.py): the
 * frame is the one `fanfs prepare` wrote and checked, and the XXH64 pass costs 13-24 % of the
 * decode. An older libzstd refuses the parameter and checks as before. */
#define ZSTD_D_FORCE_IGNORE_CHECKSUM 1002
#define ZSTD_D_IGNORE_CHECKSUM 1

/* The codec's one object: the libraries, loaded once for the process, and what all threads'
 * own buffers share. */
static struct {
    struct zstd_lib zstd;     /* immutable once loaded (`loaded`) */
    isal_crc32_fn isal_crc32; /* immutable once loaded */
    zlib_crc32_fn zlib_crc32; /* immutable once loaded */
    pthread_key_t tls_key;    /* immutable once made (`tls_once`) */
    int tls_key_ok;           /* immutable once made */
    uint64_t tls_kept;        /* atomic: bytes all threads keep */
} codec;
static pthread_once_t loaded = PTHREAD_ONCE_INIT;

struct fanfs_dicts {
    int refs; /* holders (atomic): its maker, the pool, the jobs decoding with it */
    int n;
    zstd_ddict *d[];
};

static void load(void) {
    struct zstd_lib *z = &codec.zstd;
    void *lib = dlopen("libisal.so.2", RTLD_NOW | RTLD_LOCAL);
    if (lib != NULL)
        codec.isal_crc32 = (isal_crc32_fn)dlsym(lib, "crc32_gzip_refl");
    lib = dlopen("libz.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib != NULL)
        codec.zlib_crc32 = (zlib_crc32_fn)dlsym(lib, "crc32");
    lib = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL)
        return;
    *(void **)&z->create_dctx = dlsym(lib, "ZSTD_createDCtx");
    *(void **)&z->free_dctx = dlsym(lib, "ZSTD_freeDCtx");
    *(void **)&z->decompress_dctx = dlsym(lib, "ZSTD_decompressDCtx");
    *(void **)&z->decompress_ddict = dlsym(lib, "ZSTD_decompress_usingDDict");
    *(void **)&z->create_ddict = dlsym(lib, "ZSTD_createDDict");
    *(void **)&z->free_ddict = dlsym(lib, "ZSTD_freeDDict");
    *(void **)&z->is_error = dlsym(lib, "ZSTD_isError");
    *(void **)&z->dict_id = dlsym(lib, "ZSTD_getDictID_fromFrame");
    *(void **)&z->error_code = dlsym(lib, "ZSTD_getErrorCode");
    *(void **)&z->set_param = dlsym(lib, "ZSTD_DCtx_setParameter");
    if (!(z->create_dctx && z->free_dctx && z->decompress_dctx && z->decompress_ddict &&
          z->create_ddict && z->free_ddict && z->is_error && z->dict_id))
        memset(z, 0, sizeof *z);
}

int fanfs_codec_init(void) {
    pthread_once(&loaded, load);
    return codec.isal_crc32 != NULL || codec.zlib_crc32 != NULL ? 0 : -ENOENT;
}

const char *fanfs_crc_name(void) { return codec.isal_crc32 != NULL ? "isa-l" : "zlib"; }

int fanfs_can_decode(void) { return codec.zstd.create_dctx != NULL; }

uint32_t fanfs_crc32(uint32_t crc, const void *buf, size_t len) {
    const unsigned char *p = buf;
    if (codec.isal_crc32 != NULL)
        return codec.isal_crc32(crc, p, len);
    while (len > 0) { /* zlib takes at most 4 GiB - 1 at a time */
        unsigned int n = len > (1u << 30) ? 1u << 30 : (unsigned int)len;
        crc = (uint32_t)codec.zlib_crc32(crc, p, n);
        p += n;
        len -= n;
    }
    return crc;
}

struct fanfs_dicts *fanfs_dicts_new(int n, const char *const *dicts, const size_t *lens,
                                    int *err) {
    struct fanfs_dicts *d;
    int i;
    *err = 0;
    if (n < 0 || n > FANFS_MAX_DICTS) {
        *err = EINVAL;
        return NULL;
    }
    if (n > 0 && codec.zstd.create_ddict == NULL) {
        *err = ENOSYS;
        return NULL;
    }
    d = calloc(1, sizeof *d + sizeof(zstd_ddict *) * (size_t)n);
    if (d == NULL) {
        *err = ENOMEM;
        return NULL;
    }
    for (i = 0; i < n; i++) {
        d->d[i] = codec.zstd.create_ddict(dicts[i], lens[i]);
        if (d->d[i] == NULL) {
            fanfs_dicts_free(d);
            *err = ENOMEM;
            return NULL;
        }
        d->n = i + 1;
    }
    d->refs = 1;
    return d;
}

struct fanfs_dicts *fanfs_dicts_ref(struct fanfs_dicts *d) {
    if (d != NULL)
        __atomic_add_fetch(&d->refs, 1, __ATOMIC_RELAXED);
    return d;
}

void fanfs_dicts_free(struct fanfs_dicts *d) {
    int i;
    if (d == NULL || __atomic_sub_fetch(&d->refs, 1, __ATOMIC_ACQ_REL) > 0)
        return;
    for (i = 0; i < d->n; i++)
        codec.zstd.free_ddict(d->d[i]);
    free(d);
}

/* -- buffers ------------------------------------------------------------------------------ */

char *fanfs_alloc(uint64_t size, uint32_t *cap) {
    void *p = NULL;
    /* Whole pages: a direct read may fill the last one. */
    uint64_t n = (size + FANFS_DIRECT_ALIGN - 1) / FANFS_DIRECT_ALIGN * FANFS_DIRECT_ALIGN;
    if (n == 0)
        n = FANFS_DIRECT_ALIGN;
    if (n > UINT32_MAX || posix_memalign(&p, FANFS_DIRECT_ALIGN, n) != 0)
        return NULL;
    *cap = (uint32_t)n;
    return p;
}

/* -- a thread's own buffers -----------------------------------------------------------------
 * Kept between calls (a fresh one per piece costs page faults: glibc maps blocks of 128 KiB and
 * more straight from the kernel), each up to TLS_KEEP_ONE, and all threads' together up to
 * TLS_KEEP_ALL (`codec.tls_kept`): with 64 threads, per-thread buffers kept at their largest
 * would hold about 1 GiB. What a thread holds goes with it: a pthread key's destructor frees it
 * when the thread ends (trio's worker threads end after 10 s idle). */
#define TLS_KEEP_ONE (4u << 20)
#define TLS_KEEP_ALL (64u << 20)

static pthread_once_t tls_once = PTHREAD_ONCE_INIT;
static __thread struct fanfs_tls *tls; /* (the key's value, without a call to get it) */

static void tbuf_free(struct fanfs_tbuf *b) {
    __atomic_sub_fetch(&codec.tls_kept, b->counted, __ATOMIC_RELAXED);
    free(b->buf);
    b->buf = NULL;
    b->cap = b->counted = 0;
}

static void tls_end(void *arg) {
    struct fanfs_tls *t = arg;
    tbuf_free(&t->stored);
    tbuf_free(&t->out);
    tbuf_free(&t->scratch);
    if (t->dctx != NULL)
        codec.zstd.free_dctx(t->dctx);
    free(t);
    tls = NULL;
}

static void tls_key_make(void) {
    codec.tls_key_ok = pthread_key_create(&codec.tls_key, tls_end) == 0;
}

struct fanfs_tls *fanfs_tls(void) {
    struct fanfs_tls *t = tls;
    if (t != NULL)
        return t;
    pthread_once(&tls_once, tls_key_make);
    if (!codec.tls_key_ok || (t = calloc(1, sizeof *t)) == NULL)
        return NULL;
    if (pthread_setspecific(codec.tls_key, t) != 0) {
        free(t);
        return NULL;
    }
    return tls = t;
}

void fanfs_tbuf_settle(struct fanfs_tbuf *b) {
    __atomic_sub_fetch(&codec.tls_kept, b->counted, __ATOMIC_RELAXED);
    b->counted = 0;
    if (b->buf == NULL)
        return;
    if (b->cap <= TLS_KEEP_ONE &&
        __atomic_add_fetch(&codec.tls_kept, b->cap, __ATOMIC_RELAXED) <= TLS_KEEP_ALL) {
        b->counted = b->cap;
        return;
    }
    if (b->cap <= TLS_KEEP_ONE)
        __atomic_sub_fetch(&codec.tls_kept, b->cap, __ATOMIC_RELAXED);
    free(b->buf);
    b->buf = NULL;
    b->cap = 0;
}

uint64_t fanfs_tls_kept(void) { return __atomic_load_n(&codec.tls_kept, __ATOMIC_RELAXED); }

struct fanfs_marks *fanfs_marks(void) { return tls != NULL && tls->marks.on ? &tls->marks : NULL; }

/* The scratch for `len` filtered bytes (the thread's, grown to it), or NULL (ENOMEM). An
 * empty piece's too: a thread's first piece may be one (a hostile image's empty filtered file),
 * and a NULL scratch read as no memory. */
static char *scratch_get(struct fanfs_tls *t, uint64_t len) {
    uint32_t cap;
    char *p;
    if (len == 0)
        len = 1;
    if (len <= t->scratch.cap)
        return t->scratch.buf;
    if (len > UINT32_MAX || (p = fanfs_alloc(len, &cap)) == NULL)
        return NULL;
    tbuf_free(&t->scratch);
    t->scratch.buf = p;
    t->scratch.cap = cap;
    return p;
}

/* One zstd frame into `out` (room for `cap` bytes); its decoded length, -1 if the bytes do
 * not decode, or -ENOMEM (the memory of the moment, not the bytes: the file is not bad). */
static int64_t unzstd(struct fanfs_tls *t, const struct fanfs_dicts *dicts,
                      const unsigned char *in, uint32_t n, unsigned char *out, uint64_t cap) {
    unsigned id;
    size_t r;
    zstd_dctx *dctx = t->dctx;
    if (dctx == NULL) {
        if ((t->dctx = dctx = codec.zstd.create_dctx()) == NULL)
            return -ENOMEM;
        if (codec.zstd.set_param != NULL) /* (refused by an older libzstd: it checks) */
            (void)codec.zstd.set_param(dctx, ZSTD_D_FORCE_IGNORE_CHECKSUM, ZSTD_D_IGNORE_CHECKSUM);
    }
    id = codec.zstd.dict_id(in, n);
    if (id != 0) {
        if (dicts == NULL || id > (unsigned)dicts->n)
            return -1;
        r = codec.zstd.decompress_ddict(dctx, out, cap, in, n, dicts->d[id - 1]);
    } else {
        r = codec.zstd.decompress_dctx(dctx, out, cap, in, n);
    }
    if (!codec.zstd.is_error(r))
        return (int64_t)r;
    return codec.zstd.error_code != NULL &&
                   codec.zstd.error_code(r) == ZSTD_ERROR_MEMORY_ALLOCATION
               ? -ENOMEM
               : -1;
}

int fanfs_decode(const struct fanfs_dicts *dicts, const struct fanfs_piece *p,
                 const unsigned char *in, unsigned char *out) {
    int fid = 0, err;
    uint32_t n = p->len;
    uint64_t cap;
    int64_t got;
    char *filtered;
    struct fanfs_tls *t;

    if (p->kind == FANFS_KIND_RAW) {
        if (n != p->size)
            return FANFS_EBADDATA;
        if (out != in)
            memcpy(out, in, n);
        return 0;
    }
    if (codec.zstd.create_dctx == NULL)
        return ENOSYS;
    if ((t = fanfs_tls()) == NULL)
        return ENOMEM;
    if (p->kind == FANFS_KIND_FILTERED) {
        if (n < 2)
            return FANFS_EBADDATA;
        fid = in[0];
        in++;
        n--;
    } else if (p->kind > FANFS_KIND_FILTER) {
        fid = p->kind - FANFS_KIND_FILTER;
    } else if (p->kind != FANFS_KIND_ZSTD) {
        return FANFS_EBADDATA;
    }
    if (fid == 0) {
        got = unzstd(t, dicts, in, n, out, p->size);
        return got == -ENOMEM ? ENOMEM : got == (int64_t)p->size ? 0 : FANFS_EBADDATA;
    }
    if (fanfs_filter_width(fid) == 0)
        return FANFS_EBADDATA;
    cap = fanfs_filtered_max(fid, p->size);
    filtered = scratch_get(t, cap);
    if (filtered == NULL)
        return ENOMEM;
    got = unzstd(t, NULL, in, n, (unsigned char *)filtered, cap);
    if (got == -ENOMEM)
        err = ENOMEM;
    else if (got < 0)
        err = FANFS_EBADDATA;
    else
        err = fanfs_unfilter(fid, (unsigned char *)filtered, (uint64_t)got, out, p->size);
    fanfs_tbuf_settle(&t->scratch); /* kept for the next piece, or freed */
    return err;
}
