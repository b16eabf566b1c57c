/*
 * A stress harness for the native read pool (fanfs/csrc/pool.c and the files of its
 * concerns), built by tests/sanitizers/test_sanitizers.py with -fsanitize=address,undefined and again
 * with -fsanitize=thread: any report fails it.
 *
 * It includes the pool's internal header (pool_int.h: it reaches the pool's queue and cache,
 * which fanfs_native.h does not show) and links every file of fanfs/csrc and the real
 * libfuse3; no Python. READs are answered the way the front's are: written to a file
 * descriptor, here one end of a SOCK_SEQPACKET pair read by a thread of its own, which checks
 * every reply's bytes.
 *
 *     pool_stress DIR [PARTS]
 *
 * PARTS (to look at one finding alone): the checks to run, by name, of swap (dictionaries
 * replaced), cache (its memory), remote (a peer's piece), transient (failures), ended
 * (threads that end), and the front's (tests/native/front_stress.c, after the pool's): front
 * (the front's threads answering from the catalog and the pool, stopped under requests, and
 * a session ended under them) and writes (its writes behind); all of them by default.
 *
 * DIR (written by the test): part.bin (the stored pieces back to back), decoded.bin (their
 * decoded bytes back to back), dict.bin (a zstd dictionary, id 1) and pieces.txt (one line a
 * piece: offset, stored length, CRC-32, decoded size, kind, offset in decoded.bin).
 *
 * What it checks, each a finding of the pool's review:
 * - READs hung on a piece another thread reads are never touched once handed back (many READs
 *   of the same pieces at once, evictions, drops);
 * - every READ gets exactly one reply, a READ of a peer's piece (fd <= -2) included;
 * - the dictionaries can be replaced while jobs decode with them;
 * - the cache counts what it allocated, and keeps bounded spares;
 * - a failed read that is not a bad check (EISDIR, a short partition) does not mark the file
 *   bad: the next READ of it is answered once the partition reads; a bad CRC does;
 * - threads that decoded and ended leave nothing behind (LeakSanitizer).
 */
#define _GNU_SOURCE
#include "pool_int.h"
#include "stress.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <fcntl.h>
#include <linux/fuse.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/socket.h>
#include <sys/stat.h>

#define MAXP 256
#define NREADS 3000
#define MAX_COUNT (16u << 10) /* a reply fits the socket's buffer in one message */
/* What the review asked of the cache's memory: spares only up to one compressed piece (plus
 * the alignment of a direct read), a few of them, and every allocation counted. */
#define SPARE_LIMIT ((4u << 20) + 2 * FANFS_DIRECT_ALIGN)
#define SPARES_LIMIT (16u << 20)

struct piece_info {
    struct fanfs_piece p;
    uint64_t doff; /* in decoded.bin */
};

static struct piece_info pieces[MAXP];
static int npieces;
static char *decoded, *dictbuf;
static size_t dictlen;
static int part_fd, sock[2];
static int failures;

/* What each request expects: its piece and range, or an error reply. */
struct expect {
    int piece;
    uint32_t skip, count;
    int error; /* an error reply is expected */
    int replies;
};
static struct expect *expects;
static uint64_t nexpect;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int stop_swapping;
static const char *parts; /* the checks to run; NULL: all */

static int on(const char *name) { return parts == NULL || strstr(parts, name) != NULL; }

static void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "pool_stress: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    __atomic_add_fetch(&failures, 1, __ATOMIC_SEQ_CST);
}

static char *slurp(const char *dir, const char *name, size_t *len) {
    char path[4096];
    struct stat st;
    char *buf;
    int fd;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if ((fd = open(path, O_RDONLY)) < 0 || fstat(fd, &st) != 0)
        return NULL;
    buf = malloc((size_t)st.st_size + 1);
    if (buf != NULL && pread(fd, buf, (size_t)st.st_size, 0) != st.st_size) {
        free(buf);
        buf = NULL;
    }
    close(fd);
    if (buf != NULL)
        buf[st.st_size] = 0;
    *len = (size_t)st.st_size;
    return buf;
}

/* Replies come back on sock[0]: each one checked against what its request asked. */
static void *replies_main(void *arg) {
    static char msg[MAX_COUNT + 4096];
    (void)arg;
    for (;;) {
        struct fuse_out_header out;
        ssize_t n = recv(sock[0], msg, sizeof msg, 0);
        struct expect *x;
        if (n <= 0)
            break;
        if ((size_t)n < sizeof out) {
            fail("a reply of %zd bytes", n);
            continue;
        }
        memcpy(&out, msg, sizeof out);
        if (out.unique == 0)
            continue; /* a push */
        if (out.unique == UINT64_MAX)
            break; /* the end */
        pthread_mutex_lock(&lock);
        if (out.unique > nexpect) {
            pthread_mutex_unlock(&lock);
            fail("a reply to request %llu, never sent", (unsigned long long)out.unique);
            continue;
        }
        x = &expects[out.unique - 1];
        x->replies++;
        pthread_mutex_unlock(&lock);
        if (x->error) {
            if (out.error == 0)
                fail("request %llu answered, an error expected", (unsigned long long)out.unique);
        } else if (out.error != 0) {
            fail("request %llu: error %d", (unsigned long long)out.unique, -out.error);
        } else if ((size_t)n != sizeof out + x->count ||
                   memcmp(msg + sizeof out, decoded + pieces[x->piece].doff + x->skip,
                          x->count) != 0) {
            fail("request %llu: wrong bytes (%zd)", (unsigned long long)out.unique, n);
        }
    }
    return NULL;
}

/* Python's pool_dicts: a new set for the pool, the old one let go by its owner at once. */
static void *swapper_main(void *arg) {
    const char *ptr = dictbuf;
    struct fanfs_dicts *old = arg, *d;
    int err;
    while (!__atomic_load_n(&stop_swapping, __ATOMIC_SEQ_CST)) {
        d = fanfs_dicts_new(1, &ptr, &dictlen, &err);
        if (d == NULL) {
            fail("fanfs_dicts_new: %d", err);
            break;
        }
        fanfs_pool_set_dicts(d);
        fanfs_dicts_free(old);
        old = d;
        usleep(300);
    }
    return old;
}

static uint64_t expect_one(int piece, uint32_t skip, uint32_t count, int error) {
    uint64_t unique;
    pthread_mutex_lock(&lock);
    unique = ++nexpect;
    expects[unique - 1] = (struct expect){piece, skip, count, error, 0};
    pthread_mutex_unlock(&lock);
    return unique;
}

static void job_of(int i, uint32_t skip, uint32_t count, struct fanfs_job *j) {
    memset(j, 0, sizeof *j);
    j->fd = part_fd;
    j->dfd = -1;
    j->entry = i;
    j->ino = (uint64_t)i + 1;
    j->skip = skip;
    j->count = count;
    j->npieces = 1;
    j->pieces[0] = pieces[i].p;
    j->pieces[0].cache = 1;
}

/* Submit a READ answered on sock[1]; a job the pool refuses is answered by its caller. */
static void submit(struct fanfs_job *j, int piece, int error) {
    struct target t = {NULL, NULL, sock[1], 0};
    t.unique = expect_one(piece, j->skip, j->count, error);
    if (pool_enqueue(pool_live(), &t, 0, j) != 0) {
        pthread_mutex_lock(&lock);
        expects[t.unique - 1].replies++; /* the caller answers EIO */
        expects[t.unique - 1].error = 1;
        pthread_mutex_unlock(&lock);
    }
}

/* The cache's memory as the review asks: every filled slot's allocation counted, spares
 * bounded. */
static void check_cache(void) {
    struct pieces *c = &pool_live()->pieces;
    uint64_t filled = 0, spares = 0;
    int i;
    if (!on("cache"))
        return;
    pthread_mutex_lock(&c->lock);
    for (i = 0; i < PIECES_SLOTS; i++)
        if (c->slot[i].buf != NULL)
            filled += c->slot[i].cap;
    for (i = 0; i < PIECES_SPARES; i++)
        if (c->spare[i].buf != NULL) {
            spares += c->spare[i].cap;
            if (c->spare[i].cap > SPARE_LIMIT)
                fail("a spare of %u bytes kept", c->spare[i].cap);
        }
    if (filled > c->bytes)
        fail("the cache counts %llu bytes and holds %llu", (unsigned long long)c->bytes,
             (unsigned long long)filled);
    if (spares > SPARES_LIMIT)
        fail("%llu bytes of spares", (unsigned long long)spares);
    pthread_mutex_unlock(&c->lock);
}

/* The cache's eviction order: a piece nobody has had yet (a peer's, asked ahead for a READ or
 * a push about to take it) outlives pieces already had, whatever their age; once had, it goes
 * in its turn. Without the order, a planned epoch's pieces asked ahead were evicted before
 * their push came, and fetched again. */
static int evict_add(struct pieces *c, int64_t off, int had) {
    struct fanfs_piece p = {off, 4096, 0, 4096, FANFS_KIND_ZSTD, 1};
    uint32_t cap = 0;
    char *buf = pieces_alloc(c, 4096, &cap);
    int i;
    pthread_mutex_lock(&c->lock);
    /* had: a READ's own (a reference, let go once answered); else asked ahead (no reference,
     * unpushed, as remote_reserve_locked reserves a peer's piece) */
    i = buf == NULL ? -1 : pieces_reserve_locked(c, -2, &p, had, !had, 0);
    if (i >= 0) {
        pieces_ready_locked(c, i, buf, cap, buf);
        c->slot[i].refs -= had;
    }
    pthread_mutex_unlock(&c->lock);
    if (i < 0)
        pieces_free(c, buf, cap);
    return i;
}

static int evict_has(struct pieces *c, int64_t off) {
    struct fanfs_piece p = {off, 4096, 0, 4096, FANFS_KIND_ZSTD, 1};
    int i;
    pthread_mutex_lock(&c->lock);
    i = pieces_find_locked(c, -2, &p);
    pthread_mutex_unlock(&c->lock);
    return i >= 0;
}

static void evict_order(void) {
    struct pieces c = PIECES_INIT;
    struct fanfs_piece p = {0, 4096, 0, 4096, FANFS_KIND_ZSTD, 1};
    struct pieces_wait how = {NULL, 0, 0, NULL};
    int i, slot, unpushed;
    if (!on("evict"))
        return;
    evict_add(&c, 0, 0);
    for (i = 1; i < PIECES_UNTAKEN_KEPT; i++)
        if (evict_add(&c, (int64_t)i * 4096, 1) < 0 || !evict_has(&c, 0)) {
            fail("evict: a piece asked ahead went after %d pieces already had", i);
            break;
        }
    pthread_mutex_lock(&c.lock);
    if (pieces_get_locked(&c, -2, &p, &how, &slot, &unpushed) == PIECES_HIT)
        c.slot[slot].refs--; /* had now: it goes in its turn */
    pthread_mutex_unlock(&c.lock);
    for (i = PIECES_UNTAKEN_KEPT; i < PIECES_UNTAKEN_KEPT + PIECES_SLOTS; i++)
        evict_add(&c, (int64_t)i * 4096, 1);
    if (evict_has(&c, 0))
        fail("evict: a piece had once outlived %d newer ones", PIECES_SLOTS);
    /* One never had ages: it goes once PIECES_UNTAKEN_KEPT came after it. */
    evict_add(&c, 1 << 30, 0);
    for (i = 0; i < PIECES_UNTAKEN_KEPT + PIECES_SLOTS; i++)
        evict_add(&c, (int64_t)(2 << 20) + (int64_t)i * 4096, 1);
    if (evict_has(&c, 1 << 30))
        fail("evict: a piece never had outlived %d newer ones", PIECES_UNTAKEN_KEPT);
    /* None had at all: they still make room for one another, the oldest going first. */
    for (i = 0; i <= PIECES_SLOTS; i++)
        if (evict_add(&c, (int64_t)(4 << 20) + (int64_t)i * 4096, 0) < 0) {
            fail("evict: no room among %d pieces never had", PIECES_SLOTS);
            break;
        }
    if (evict_has(&c, 4 << 20) || !evict_has(&c, (4 << 20) + PIECES_SLOTS * 4096))
        fail("evict: pieces never had did not go oldest first");
    pieces_clear(&c);
}

/* Piece `off` reserved ahead, as push_ask and a LOOKUP reserve a peer's (no reference). */
static int asked_reserve(struct pieces *c, int64_t off) {
    struct fanfs_piece p = {off, 4096, 0, 4096, FANFS_KIND_ZSTD, 1};
    int i;
    pthread_mutex_lock(&c->lock);
    i = pieces_reserve_locked(c, -2, &p, 0, 1, 1);
    pthread_mutex_unlock(&c->lock);
    return i;
}

static void asked_fill(struct pieces *c, int i) {
    uint32_t cap = 0;
    char *buf = pieces_alloc(c, 4096, &cap);
    pieces_ready(c, i, buf, cap, buf);
}

static void asked_expect(struct pieces *c, int want, const char *after) {
    if (c->asked != want)
        fail("asked: %d pieces counted asked ahead and not had after %s, not %d", c->asked,
             after, want);
}

/* Pieces asked ahead and not yet got are counted (what push_ask may ask is bounded by it): a
 * get, an eviction, a give-up and a drop each take one off, once. Without the bound a
 * planned epoch's pushers had twice the slots asked ahead, and fetched them again. */
static void asked_count(void) {
    struct pieces c = PIECES_INIT;
    struct fanfs_piece p = {0, 4096, 0, 4096, FANFS_KIND_ZSTD, 1};
    struct pieces_wait how = {NULL, 0, 0, NULL};
    int s[4], k, slot, unpushed;
    if (!on("evict"))
        return;
    for (k = 0; k < 4; k++)
        s[k] = asked_reserve(&c, (int64_t)k * 4096);
    asked_expect(&c, 4, "4 reserved");
    asked_fill(&c, s[0]);
    asked_expect(&c, 4, "one filled");
    pieces_ready(&c, s[1], NULL, 0, NULL);
    asked_expect(&c, 3, "one given up");
    for (k = 0; k < 2; k++) {
        pthread_mutex_lock(&c.lock);
        if (pieces_get_locked(&c, -2, &p, &how, &slot, &unpushed) != PIECES_HIT)
            fail("asked: a filled piece was not found");
        pthread_mutex_unlock(&c.lock);
        asked_expect(&c, 2, "one got");
    }
    asked_fill(&c, s[2]);
    asked_fill(&c, s[3]);
    pieces_drop(&c);
    asked_expect(&c, 0, "a drop");
    pieces_release(&c, slot);
    pieces_release(&c, slot);
    asked_fill(&c, asked_reserve(&c, 1 << 30));
    for (k = 0; k < PIECES_UNTAKEN_KEPT + PIECES_SLOTS; k++)
        evict_add(&c, (int64_t)(2 << 20) + (int64_t)k * 4096, 1);
    if (evict_has(&c, 1 << 30))
        fail("asked: the piece asked ahead was not evicted");
    asked_expect(&c, 0, "an eviction");
    pieces_clear(&c);
}

static void reads(void) {
    struct fanfs_job j;
    int r, k, i;
    unsigned seed = 7;
    for (r = 0; r < NREADS; r++) {
        i = rand_r(&seed) % npieces;
        if (pieces[i].p.size > (1u << 20))
            continue; /* the large piece: below */
        /* Several READs of one piece at once: some of them hang on it. */
        for (k = 1 + rand_r(&seed) % 4; k > 0; k--) {
            uint32_t size = pieces[i].p.size;
            uint32_t skip = rand_r(&seed) % size;
            uint32_t count = 1 + rand_r(&seed) % (size - skip);
            if (count > MAX_COUNT)
                count = MAX_COUNT;
            job_of(i, skip, count, &j);
            j.flags = rand_r(&seed) % 3 == 0 ? FANFS_JOB_PUSH : 0;
            submit(&j, i, 0);
        }
        if (r % 97 == 0 && on("remote")) {
            job_of(i, 0, 1, &j);
            j.fd = FANFS_REMOTE_FD(3); /* a peer's piece: no thread of the pool can have it */
            submit(&j, i, 1);
        }
        if (r % 13 == 0) { /* a read-ahead */
            job_of(rand_r(&seed) % npieces, 0, 0, &j);
            if (j.pieces[0].size <= (1u << 20))
                fanfs_pool_read_ahead(&j);
        }
        if (r % 211 == 0)
            fanfs_pool_drop();
        if (r % 50 == 0) {
            check_cache();
            usleep(500);
        }
    }
}

/* One large raw piece read into the cache, then dropped: its buffer is not kept as a spare. */
static void large_piece(void) {
    struct fanfs_job j;
    int i;
    for (i = 0; i < npieces; i++)
        if (pieces[i].p.size > (4u << 20)) {
            job_of(i, 0, 1, &j);
            submit(&j, i, 0);
        }
}

static int wait_replies(void) {
    int tries, i, missing = 0;
    for (tries = 0; tries < 3000; tries++) {
        missing = 0;
        pthread_mutex_lock(&lock);
        for (i = 0; (uint64_t)i < nexpect; i++)
            missing += expects[i].replies == 0;
        pthread_mutex_unlock(&lock);
        if (missing == 0)
            break;
        usleep(10000);
    }
    pthread_mutex_lock(&lock);
    for (i = 0; (uint64_t)i < nexpect; i++)
        if (expects[i].replies != 1)
            fail("request %d: %d replies", i + 1, expects[i].replies);
    pthread_mutex_unlock(&lock);
    return missing;
}

/* The fast path's answer to a READ (the front's, in this thread) on sock[1]. */
static int fast_read(uint64_t ino, int piece, uint32_t size, int error) {
    uint64_t unique = expect_one(piece, 0, size, error);
    int ret = fanfs_pool_fast_answer(sock[1], unique, ino, 0, size);
    if (ret != 0) {
        pthread_mutex_lock(&lock);
        expects[unique - 1].replies++; /* Python answers it */
        pthread_mutex_unlock(&lock);
    }
    return ret;
}

/* A transient failure (here: the partition's fd is a directory, EISDIR) answers the READ with
 * an error and leaves the file readable; a bad CRC marks it bad (Python answers it then). */
static void transient_errors(const char *dir) {
    static char size[16], part[8], off[16], stored[16], crc[8];
    static uint8_t kind[2];
    struct fanfs_fast_table t;
    uint64_t v;
    uint32_t w;
    int i, e, dirfd;
    for (i = 0; i < npieces && (pieces[i].p.kind != FANFS_KIND_RAW ||
                                pieces[i].p.size > MAX_COUNT); i++)
        ;
    if (i == npieces) {
        fail("no small raw piece");
        return;
    }
    for (e = 0; e < 2; e++) { /* entry 0: the piece; entry 1: the same with a wrong CRC */
        v = pieces[i].p.size;
        memcpy(size + 8 * e, &v, 8);
        w = 0;
        memcpy(part + 4 * e, &w, 4);
        v = (uint64_t)pieces[i].p.off;
        memcpy(off + 8 * e, &v, 8);
        v = pieces[i].p.len;
        memcpy(stored + 8 * e, &v, 8);
        w = pieces[i].p.crc ^ (uint32_t)e;
        memcpy(crc + 4 * e, &w, 4);
        kind[e] = FANFS_KIND_RAW;
    }
    t = (struct fanfs_fast_table){2, size, part, off, stored, crc, kind, 1, 0, 1u << 20};
    if (fanfs_pool_fast_set(&t) != 0) {
        fail("fanfs_pool_fast_set");
        return;
    }
    dirfd = open(dir, O_RDONLY | O_DIRECTORY);
    fanfs_pool_fast_part(0, dirfd, -1);
    fanfs_pool_fast_enable(1);
    if (fast_read(1, i, pieces[i].p.size, 1) != 0)
        fail("a READ of a partition that cannot be read went to Python");
    fanfs_pool_fast_part(0, part_fd, -1); /* the disk is back */
    if (fast_read(1, i, pieces[i].p.size, 0) != 0)
        fail("a transient error marked the file bad: its next READ went to Python");
    if (fast_read(2, i, pieces[i].p.size, 1) != 0)
        fail("a READ with a bad CRC went to Python the first time");
    if (fast_read(2, i, pieces[i].p.size, 1) == 0)
        fail("a file with a bad CRC was not marked bad");
    fanfs_pool_fast_enable(0);
    close(dirfd);
}

/* Threads that decode and end: what they kept for the next piece must go with them. */
static void *decoder_main(void *arg) {
    const struct fanfs_dicts *d = arg;
    int i;
    for (i = 0; i < npieces; i++)
        if (pieces[i].p.kind != FANFS_KIND_RAW) {
            char *out = aligned_alloc(4096, (pieces[i].p.size + 4095) / 4096 * 4096);
            char *buf = NULL;
            uint32_t cap = 0;
            const char *at;
            if (fanfs_read_stored(part_fd, -1, &pieces[i].p, &buf, &cap, &at) != 0 ||
                fanfs_decode(d, &pieces[i].p, (const unsigned char *)at,
                             (unsigned char *)out) != 0 ||
                memcmp(out, decoded + pieces[i].doff, pieces[i].p.size) != 0)
                fail("decoding piece %d", i);
            free(buf);
            free(out);
        }
    for (i = 0; i < npieces; i++) { /* and the pool's own code, in a thread of the caller */
        struct fanfs_job j;
        char *out = malloc(MAX_COUNT);
        job_of(i, 0, pieces[i].p.size < MAX_COUNT ? pieces[i].p.size : MAX_COUNT, &j);
        j.pieces[0].cache = 0;
        if (fanfs_run_job(d, &j, out) != 0 || memcmp(out, decoded + pieces[i].doff, j.count))
            fail("run_job of piece %d", i);
        free(out);
    }
    return NULL;
}

/* The front's checks (front_stress.c), with the small raw pieces as the files of its catalog. */
static void front_checks(const char *dir, const int errpipe[2]) {
    struct stress_file files[MAXP];
    int i, n = 0;
    for (i = 0; i < npieces; i++)
        if (pieces[i].p.kind == FANFS_KIND_RAW && pieces[i].p.size <= (64u << 10))
            files[n++] = (struct stress_file){pieces[i].p.off, pieces[i].p.len, pieces[i].p.crc,
                                              decoded + pieces[i].doff};
    failures += front_stress(dir, part_fd, errpipe[0], errpipe[1], files, n, parts);
}

int main(int argc, char **argv) {
    size_t len;
    char *manifest, *line, *save;
    pthread_t replier, swapper, decoders[4];
    struct fanfs_dicts *first;
    const char *ptr;
    int err, i, errpipe[2];
    struct fuse_out_header end = {sizeof end, 0, UINT64_MAX};

    if (argc < 2 || argc > 3)
        return 2;
    parts = argc == 3 ? argv[2] : NULL;
    manifest = slurp(argv[1], "pieces.txt", &len);
    decoded = slurp(argv[1], "decoded.bin", &len);
    dictbuf = slurp(argv[1], "dict.bin", &dictlen);
    {
        char path[4096];
        snprintf(path, sizeof path, "%s/part.bin", argv[1]);
        part_fd = open(path, O_RDONLY);
    }
    if (manifest == NULL || decoded == NULL || dictbuf == NULL || part_fd < 0) {
        fprintf(stderr, "pool_stress: cannot read %s\n", argv[1]);
        return 2;
    }
    for (line = strtok_r(manifest, "\n", &save); line != NULL && npieces < MAXP;
         line = strtok_r(NULL, "\n", &save)) {
        long long off, doff;
        unsigned plen, crc, size, kind;
        if (sscanf(line, "%lld %u %u %u %u %lld", &off, &plen, &crc, &size, &kind, &doff) != 6)
            return 2;
        pieces[npieces].p = (struct fanfs_piece){off, plen, crc, size, (uint8_t)kind, 1};
        pieces[npieces].doff = (uint64_t)doff;
        npieces++;
    }
    free(manifest);
    expects = calloc(NREADS * 6 + 64, sizeof *expects);

    if (fanfs_codec_init() != 0 || !fanfs_can_decode()) {
        fprintf(stderr, "pool_stress: no CRC library or no libzstd\n");
        return 2;
    }
    ptr = dictbuf;
    first = fanfs_dicts_new(1, &ptr, &dictlen, &err);
    if (first == NULL || pipe2(errpipe, O_NONBLOCK) != 0 ||
        socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sock) != 0)
        return 2;
    fanfs_pool_set_dicts(first);
    if (fanfs_pool_start(4, errpipe[1]) != 0)
        return 2;
    pthread_create(&replier, NULL, replies_main, NULL);
    if (on("swap"))
        pthread_create(&swapper, NULL, swapper_main, first);

    evict_order();
    asked_count();
    reads();
    large_piece();
    wait_replies();
    fanfs_pool_drop();
    check_cache();
    if (on("transient"))
        transient_errors(argv[1]);

    __atomic_store_n(&stop_swapping, 1, __ATOMIC_SEQ_CST);
    if (on("swap"))
        pthread_join(swapper, (void **)&first);
    for (i = 0; i < 4 && on("ended"); i++)
        pthread_create(&decoders[i], NULL, decoder_main, first);
    for (i = 0; i < 4 && on("ended"); i++)
        pthread_join(decoders[i], NULL);

    fanfs_pool_stop();
    wait_replies();
    send(sock[1], &end, sizeof end, 0);
    pthread_join(replier, NULL);
    if (on("front") || on("writes"))
        front_checks(argv[1], errpipe);
    fanfs_pool_set_dicts(NULL);
    fanfs_dicts_free(first);
    free(expects);
    free(decoded);
    free(dictbuf);
    close(part_fd);
    if (failures == 0)
        printf("pool_stress: ok\n");
    return failures == 0 ? 0 : 1;
}
