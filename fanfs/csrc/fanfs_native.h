/*
 * fanfs's native read path: the one contract between its C (codec.c, pool.c, front.c), the
 * Cython module that exposes it to Python (fanfs/_native.pyx) and the Python that builds its
 * jobs (fanfs/node/pool.py). Anything changed here changes FANFS_NATIVE_API, which the module
 * exports and fanfs checks at import (a stale build is refused, not half used).
 *
 * What it does: read a stored piece of a file (a whole file, or one frame of a framed file)
 * from a partition, check its CRC-32, decode it (zstd with the image's dictionaries, and the
 * array filters of fanfs/image/filters.py, byte for byte), without the GIL. Python calls it directly
 * (fanfs_read_piece, fanfs_decode: the planner, remote reads on both sides, `fanfs verify`,
 * unit tests), and the pool (pool.c) runs the same code in its own threads to answer FUSE READs
 * without the event loop: pyfuse3 hands it the request (its read hook), a thread reads,
 * checks, decodes and replies, and pushes what the READ did not ask for of the pieces it
 * decoded into the kernel's page cache (notify_store), so that a large file costs one or two
 * round trips, not one per 128 KiB. And the front (front.c) takes requests from the FUSE
 * device in threads of its own: lookups and attributes come from the catalog, READs of files
 * stored whole on this node are answered in the thread that took them (the pool builds the job
 * from the catalog's own columns, fanfs_pool_fast_answer), and the rest goes to pyfuse3.
 */
#ifndef FANFS_NATIVE_H
#define FANFS_NATIVE_H

#include <endian.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>

#define FANFS_NATIVE_API 18

/* What a piece's stored bytes are (fanfs/node/pool.py names the same numbers). */
enum {
    FANFS_KIND_RAW = 0,      /* the bytes themselves */
    FANFS_KIND_ZSTD = 1,     /* one zstd frame; its header names its dictionary, if any */
    FANFS_KIND_FILTERED = 2, /* a filter id byte, then one zstd frame of that filter's output */
    FANFS_KIND_FILTER = 16,  /* 16 + filter id: one zstd frame of that filter's output */
};

/* Array filter ids (fanfs/image/filters.py, docs/format.md). */
enum {
    FANFS_SHUFFLE4 = 1,
    FANFS_SHUFFLE8 = 2,
    FANFS_DELTA8 = 3,
    FANFS_DECIMAL4 = 4,
    FANFS_DECIMAL8 = 5,
    FANFS_DELTA4 = 8,
};

#define FANFS_MAX_PIECES 4 /* pieces (frames) one job may span */
/* The largest piece, stored or decoded: raw files are read whole up to the reader's
 * WHOLE_FILE_LIMIT, compressed pieces are at most 4 MiB (the catalog refuses more). */
#define FANFS_PIECE_MAX (16u << 20)
#define FANFS_MAX_DICTS 1024
/* Reads at LOOKUP, one policy for the front (fast.c) and for pyfuse3's route (node/reader.py's
 * LookAhead, which takes these numbers from the module): the last FANFS_LA_WINDOW lookups are
 * remembered; the share of them a READ followed is averaged, each outcome weighing
 * 1/FANFS_LA_DECAY; files are read at LOOKUP while that share is at least
 * FANFS_LA_ON_SHARE/256 (a stat walk, ls -l or du, reads none of what it looks up). */
#define FANFS_LA_WINDOW 64
#define FANFS_LA_DECAY 8
#define FANFS_LA_ON_SHARE 128
/* Direct I/O is done in units of this many bytes (offset, length and memory); a file system
 * asking for a coarser alignment is read through the page cache instead. */
#define FANFS_DIRECT_ALIGN 4096

/* Error codes beyond errno: returned by fanfs_decode and fanfs_read_piece. */
#define FANFS_EBADCRC EBADMSG /* the stored bytes do not match their CRC-32 */
#define FANFS_EBADDATA EILSEQ /* they match, but do not decode to the size the catalog says */
#define FANFS_EREMOTE EREMOTEIO /* a peer's piece no holder could give: Python answers */

/* One stored piece. */
struct fanfs_piece {
    int64_t off;   /* where its stored bytes start in the partition */
    uint32_t len;  /* stored length: all of it is read and checked */
    uint32_t crc;  /* CRC-32 of the stored bytes */
    uint32_t size; /* decoded length */
    uint8_t kind;
    uint8_t cache; /* 1: keep the decoded piece in the pool's cache (parts of it are asked for) */
};

/* Job flags. */
#define FANFS_JOB_PUSH 1 /* after the reply, push the rest of freshly decoded pieces */

/* A read: bytes [skip, skip + count) of the job's pieces' decoded bytes, back to back. */
struct fanfs_job {
    int fd;          /* the partition, read through the page cache */
    int dfd;         /* the same file opened O_DIRECT, or -1 */
    int64_t entry;   /* catalog entry, for the error record */
    uint64_t ino;    /* the file's inode, for pushes (0: none) */
    int64_t base;    /* where the first piece's decoded bytes start in the file */
    uint32_t skip;
    uint32_t count;
    uint32_t flags;
    int npieces;
    struct fanfs_piece pieces[FANFS_MAX_PIECES];
};

/* -- codec.c: checks and decoding, any thread, no global state but the libraries ----------- */

/* Load the libraries (idempotent): ISA-L's CRC-32 (libisal.so.2) or zlib's, libzstd. 0, or
 * -ENOENT if neither CRC library can be loaded. */
int fanfs_codec_init(void);
const char *fanfs_crc_name(void); /* "isa-l" or "zlib" */
int fanfs_can_decode(void);       /* libzstd was found */
uint32_t fanfs_crc32(uint32_t crc, const void *buf, size_t len);

/* The image's zstd dictionaries (dictionary id i + 1 is dicts[i]); immutable once made, and
 * counted: fanfs_dicts_new gives the caller one reference, fanfs_dicts_ref takes another
 * (any thread; NULL is returned as is), fanfs_dicts_free lets one go (the last frees them). */
struct fanfs_dicts;
struct fanfs_dicts *fanfs_dicts_new(int n, const char *const *dicts, const size_t *lens,
                                    int *err);
struct fanfs_dicts *fanfs_dicts_ref(struct fanfs_dicts *d);
void fanfs_dicts_free(struct fanfs_dicts *d);

/* Decode a checked piece's stored bytes `in` (p->len of them) into `out` (p->size bytes,
 * 8-byte aligned); 0, FANFS_EBADDATA, ENOSYS (no libzstd) or ENOMEM. */
int fanfs_decode(const struct fanfs_dicts *dicts, const struct fanfs_piece *p,
                 const unsigned char *in, unsigned char *out);

/* stored.c: reading a piece's stored bytes (the next two, and fanfs_read_counters), any
 * thread; the rest of this section is codec.c's. */
/* Whether `fd` can be read with O_DIRECT at FANFS_DIRECT_ALIGN (statx's dio alignment). */
int fanfs_direct_ok(int fd);

/* Read a piece's stored bytes and check them. Through the page cache when it holds them all
 * (cachestat), else O_DIRECT when `dfd` >= 0 (no copy into a page cache nobody reads again),
 * else through the page cache. `*buf` (aligned, `*cap` bytes, from fanfs_alloc) is grown as
 * needed; on success `*at` points at the stored bytes inside it. 0 or an errno. */
int fanfs_read_stored(int fd, int dfd, const struct fanfs_piece *p, char **buf, uint32_t *cap,
                      const char **at);

/* An aligned buffer of at least `size` bytes (*cap set to what it holds); free() frees it. */
char *fanfs_alloc(uint64_t size, uint32_t *cap);

/* A thread's own buffers (codec.c), kept between calls and freed when the thread ends. Only
 * the thread that owns them touches them. */
struct fanfs_tbuf {
    char *buf; /* from fanfs_alloc, or NULL */
    uint32_t cap;
    uint32_t counted; /* bytes of it counted as kept (fanfs_tbuf_settle) */
};
/* The latency budget of a READ the front answers (follow.c, docs/performance.md): the time
 * from taking the request to the reply, cut at these marks, each stage the time since the one
 * before. A stage may be marked more than once (a job of several pieces). */
enum {
    FANFS_STAGE_LEAD,   /* the request taken; the lead handed to another thread */
    FANFS_STAGE_JOB,    /* the job built from the catalog's columns */
    FANFS_STAGE_CACHE,  /* the piece found or reserved in the cache (or waited for: read at LOOKUP) */
    FANFS_STAGE_DISK,   /* the stored bytes read (cachestat, pread: O_DIRECT or the page cache) */
    FANFS_STAGE_CHECK,  /* their CRC-32 checked */
    FANFS_STAGE_DECODE, /* decoded (compressed pieces) */
    FANFS_STAGE_PEER,   /* a peer's piece fetched by the MPI thread, this thread woken */
    FANFS_STAGE_REPLY,  /* the reply written to the FUSE device (the kernel's copy, the wake) */
    FANFS_STAGE_PUSH,   /* the rest of the file queued for the pusher */
    FANFS_STAGE_END,    /* pieces let go, counted: the READ done */
    FANFS_STAGES
};
struct fanfs_marks {
    int on;                      /* this thread traces a READ */
    int remote;                  /* ... of a peer's piece */
    int64_t last;                /* CLOCK_MONOTONIC ns of the last mark */
    int64_t ns[FANFS_STAGES];    /* per stage, this READ */
};
/* A budget's sums (follow.c): 0 local, 1 a peer's piece. A thread begins tracing a READ at the
 * time it took it and ends it once answered (added if `answered`). */
#define FANFS_BUDGET_LEN (2 * (1 + FANFS_STAGES) + 1)
struct fanfs_budget {
    uint64_t n[2];                /* atomic */
    uint64_t ns[2][FANFS_STAGES]; /* atomic */
    uint64_t spin_ns;             /* atomic: the front's leader's polling */
};
void fanfs_budget_begin(int64_t taken_ns);
void fanfs_budget_end(struct fanfs_budget *b, int answered);
/* n[0], ns[0][...], n[1], ns[1][...], spin_ns. */
void fanfs_budget_take(const struct fanfs_budget *b, uint64_t out[FANFS_BUDGET_LEN]);
struct fanfs_tls {
    struct fanfs_tbuf stored, out; /* the pool's: stored bytes read for a decode, a decoded file */
    struct fanfs_tbuf scratch;     /* codec.c's: the filtered bytes between zstd and a filter */
    void *dctx;                    /* codec.c's: zstd's decompression context */
    struct fanfs_marks marks;      /* the front's READ being traced (follow.c) */
};
/* The calling thread's buffers, or NULL (ENOMEM). */
struct fanfs_tls *fanfs_tls(void);
/* The calling thread's marks while it traces a READ, else NULL (never allocates). */
struct fanfs_marks *fanfs_marks(void);
/* The time since the calling thread's last mark goes to `stage` (nothing unless it traces). */
void fanfs_mark(int stage);
/* CLOCK_MONOTONIC in nanoseconds (the clock of every stamp, and of Python's monotonic_ns). */
int64_t fanfs_now_ns(void);
/* After a call used `b`: keep it for the next, or free it when it is larger than one thread
 * may keep or all threads keep too much already. */
void fanfs_tbuf_settle(struct fanfs_tbuf *b);
/* Bytes all threads keep (for the tests). */
uint64_t fanfs_tls_kept(void);

/* Reading counters since start (any thread). */
struct fanfs_read_stats {
    uint64_t cached, direct, buffered; /* pieces read from the page cache, O_DIRECT, buffered */
};
void fanfs_read_counters(struct fanfs_read_stats *out);

/* -- pool.c: the threads that answer FUSE READs ------------------------------------------ */

/* Start `nthreads` threads (idempotent); a failed job posts a 16-byte record (entry, errno, 0)
 * on `errfd` (a non-blocking pipe): FANFS_EBADCRC and FANFS_EBADDATA say the file is bad,
 * any other errno a failure of the moment. 0 or -errno. */
int fanfs_pool_start(int nthreads, int errfd);
/* Answer every queued READ, stop the threads and the pusher, free the cache. Call before the
 * FUSE session is destroyed. */
void fanfs_pool_stop(void);
/* The dictionaries jobs decode with (NULL: none), any time: the pool takes its own reference
 * (the caller may let its own go), and each job holds one while it decodes, so the previous
 * set is freed once no job uses it. */
void fanfs_pool_set_dicts(struct fanfs_dicts *d);
/* Queue a job answering `req` on `session`; 0, or -1 (the caller answers EIO). */
int fanfs_pool_submit(void *session, void *req, const struct fanfs_job *job);
/* Queue a read-ahead (no request): its pieces are decoded into the cache, and pushed when the
 * job says so. 0, or -1 if it was not queued. */
int fanfs_pool_read_ahead(const struct fanfs_job *job);
/* A planned epoch's read-ahead of one file stored whole (`job`: its one piece, as a READ of
 * all of it), in the calling thread, which may wait for the page locks of READs in flight (a
 * planner's thread, never one that answers READs): read, checked and decoded into the
 * thread's own buffers as a READ's would be (a peer's, job fd FANFS_REMOTE_FD(part): fetched
 * into the cache of pieces as for the front's READ, waiting at most the remote path's
 * wait), then stored into the kernel's page cache through the FUSE device `devfd`. 0 stored,
 * -1 the kernel does not know the inode (nothing read), else an errno (FANFS_EBADCRC,
 * FANFS_EBADDATA: the file is bad, and reported as a READ's would be; FANFS_EREMOTE: no
 * holder gave a peer's file in time; a failed read or store). */
int fanfs_pool_push_file(const struct fanfs_job *job, int devfd);
/* `n` peers' files as fanfs_pool_push_file pushes each (out[k]: its answer), their fetches
 * asked FANFS_PUSH_TOGETHER at a time ahead of the one being stored, so that the data plane
 * asks their holders together: a planned epoch's turn of several files costs about one round
 * trip, not one each, and no Python on either side. After one FANFS_EREMOTE the rest are
 * FANFS_EREMOTE too, unwaited (a turn's files have one holder). 0, or EINVAL. */
#define FANFS_PUSH_TOGETHER 8
int fanfs_pool_push_files(const struct fanfs_job *jobs, int n, int devfd, int *out);
/* Empty the cache of decoded pieces (cold measurements). */
void fanfs_pool_drop(void);

struct fanfs_pool_stats {
    uint64_t jobs, hits, misses, pushes, pushed_bytes, push_skipped;
};
void fanfs_pool_counters(struct fanfs_pool_stats *out);

/* -- READs answered with no Python: the catalog's columns, read in place ----------------- */

#define FANFS_FAST_NO 255 /* in `kind`: this entry's READs go to Python */

/* Entry e of a catalog column (little-endian, maybe unaligned, as in the image). */
static inline uint64_t fanfs_col64(const char *col, uint64_t e) {
    uint64_t v;
    memcpy(&v, col + e * sizeof v, sizeof v);
    return le64toh(v);
}

static inline uint32_t fanfs_col32(const char *col, uint64_t e) {
    uint32_t v;
    memcpy(&v, col + e * sizeof v, sizeof v);
    return le32toh(v);
}

/* The catalog's columns (contiguous, little-endian and maybe unaligned, as in the image) and
 * which entries the pool may answer alone. The memory must outlive the pool (the daemon's
 * catalog does). */
struct fanfs_fast_table {
    uint64_t n;       /* entries; inode = entry + 1 */
    const char *size; /* u64: decoded size */
    const char *part; /* u32: partition */
    const char *off;  /* u64: offset of the stored bytes in the partition */
    const char *stored; /* u64: stored length */
    const char *crc;  /* u32: CRC-32 of the stored bytes */
    const uint8_t *kind; /* one byte per entry: a piece kind, or FANFS_FAST_NO */
    uint32_t nparts;
    uint32_t flags;   /* job flags of a READ for part of a file (FANFS_JOB_PUSH) */
    uint64_t parts_limit; /* files up to this size are answered in parts (and kept, pushed) */
};
/* Take the table (copied; -ENOMEM, -EINVAL). Until a partition is given an fd, its READs go
 * to Python. */
int fanfs_pool_fast_set(const struct fanfs_fast_table *t);
/* Partition `part` is staged here: read it through `fd` (and `dfd` with O_DIRECT, or -1). */
void fanfs_pool_fast_part(uint32_t part, int fd, int dfd);
/* Turn the fast path on or off. */
void fanfs_pool_fast_enable(int on);
uint64_t fanfs_pool_fast_count(void); /* READs answered by it */
/* Planned epochs (fanfs/node/planner.py) mark entries: bytes read ahead wait in Python for the
 * READ (FANFS_PLAN_HELD: its READs go to Python), or a read-ahead is under way
 * (FANFS_PLAN_AHEAD: no read is started at its LOOKUP, the planner's would be read twice).
 * Any thread. */
#define FANFS_PLAN_HELD 1
#define FANFS_PLAN_AHEAD 2
void fanfs_pool_plan_mark(uint64_t e, int flag, int on);

/* The fast path's job for a READ of inode `ino`: 0, or -1 when Python must answer it
 * (entries whose stored bytes failed their check or decode go to Python from then on, which
 * knows them bad; a failure of the moment, ENOMEM or a disk's EIO, marks nothing). */
int fanfs_pool_fast_job(uint64_t ino, int64_t off, uint64_t size, struct fanfs_job *j);
int fanfs_pool_fast_on(void); /* whether the fast path is on */
/* Answer a READ of inode `ino` taken from the FUSE device `fd` (request `unique`) with the
 * fast path's job, in the calling thread: the reply (or EIO, and the failure posted as the
 * pool's are) written to `fd`, the rest of fresh pieces pushed when the job says so. 0, or -1
 * when Python must answer it. fanfs_pool_stop waits for the answers in progress. */
int fanfs_pool_fast_answer(int fd, uint64_t unique, uint64_t ino, int64_t off, uint64_t size);
/* Inode `ino` (a file stored whole here) was looked up: its READ is likely next, so the pool
 * may start reading it now (into its cache of pieces), while lookups keep being followed by
 * reads. */
void fanfs_pool_looked_up(uint64_t ino);
/* Reads started at LOOKUP: started, then read by their READ, or never read. */
void fanfs_lookahead_counters(uint64_t out[3]);

/* -- a peer's files, fetched by the MPI thread into the cache of pieces --------------------- */

#define FANFS_MAX_OWNERS 4 /* holders of a partition the C knows of (more: Python's) */
#define FANFS_REMOTE_MAX (4u << 20) /* a peer's file up to this, stored, is fetched whole */
/* A job's `fd` for a piece of partition `part` held by peers only (no fd of ours). */
#define FANFS_REMOTE_FD(part) (-2 - (int)(part))

/* Which ranks hold each partition (`owners`: nparts x FANFS_MAX_OWNERS, -1 padded) and which
 * is this daemon: the front answers READs of files only peers hold through the MPI thread
 * (once fanfs_remote_set_wake has been called). Before fanfs_pool_fast_enable. 0 or -errno. */
int fanfs_pool_fast_owners(const int32_t *owners, uint32_t nparts, int self);

/* A request for a peer's piece: fetch `len` stored bytes at `off` of partition `part` from one
 * of `peers` (-1: none), and hand them back with fanfs_remote_fill. */
struct fanfs_rreq {
    int slot;
    int ahead;  /* reserved at a LOOKUP, not by a READ */
    int64_t entry;
    uint32_t part;
    int64_t off;
    uint32_t len, crc;
    int32_t peers[FANFS_MAX_OWNERS];
    int64_t queued_ns, taken_ns; /* when the front queued it, when the MPI thread took it */
    int32_t tried; /* the holder the data plane asked before it handed it back; -1: none */
};
/* The MPI thread's eventfd, written when a request is queued (-1: the remote path is off, and
 * what is queued or pending is given up). At most `max_waiting` READs wait for peers' pieces
 * at once, each at most `wait_ns` (0: no limit); the others are answered by Python. */
void fanfs_remote_set_wake(int fd, int max_waiting, int64_t wait_ns);
int fanfs_remote_on(void);
/* Up to `max` queued requests (never waits): those the data plane handed back, and the new
 * ones unless the plane takes them. */
int fanfs_remote_take(struct fanfs_rreq *out, int max);
/* The stored bytes for a request: checked, decoded into the cache, its READs woken. 0; ESTALE
 * if the request is over (given up); FANFS_EBADCRC or FANFS_EBADDATA for a bad copy (ask
 * another holder); ENOMEM. */
int fanfs_remote_fill(const struct fanfs_rreq *r, const char *stored, uint32_t len);
/* No holder can give it: its READs go to Python. */
void fanfs_remote_fail(const struct fanfs_rreq *r);
/* Whether the request still waits for its bytes (not filled, not given up). */
int fanfs_remote_pending(const struct fanfs_rreq *r);
/* Pieces fetched, given up, and reserved at LOOKUP. */
void fanfs_remote_counters(uint64_t out[3]);
/* The legs of the fetches filled (the requester's side of the latency budget): fills, then
 * the nanoseconds from queued to taken by the MPI thread, from taken to the bytes handed back
 * (the request out, the owner, the reply in, Python), and of the fills (check, decode, wake). */
void fanfs_remote_legs(uint64_t out[4]);
/* The reads the pool began at LOOKUP (fast.c), traced as the front's READs are (as local). */
void fanfs_pool_ahead_budget(uint64_t out[FANFS_BUDGET_LEN]);

/* -- the data plane: the front's fetches and the owner's answers over MPI, in C (plane.c) ---
 * One thread makes every MPI call of the plane, on a communicator of its own (a duplicate of
 * the world's made at start-up, which nothing else uses), through the MPI library that mpi4py
 * loaded (`lib`: a path dlopen finds loaded; its functions are looked up there, so this module
 * links no MPI). Built only where mpi.h was found (fanfs_plane_built). */
struct fanfs_plane_conf {
    uintptr_t comm, byte; /* the plane's MPI_Comm and MPI_BYTE handles (mpi4py's _handleof) */
    const char *lib;      /* a loaded library whose dependencies include the MPI library */
    int rank, size, tag_ub;
    int fetch;            /* take the front's requests (fanfs_remote_set_wake was called) */
    int64_t hand_back_ns; /* a fetch not answered within this goes back to the MPI thread */
    int64_t hedge_ns;     /* ... within this, another holder is asked too (fanfs_plane_hedge) */
    int64_t quarantine_ns; /* ... its reply tag is not reused before its reply or this */
    uintptr_t watch;       /* the MPI thread's communicator: a message waiting there writes */
    int watch_fd;          /* this eventfd (the MPI thread's; -1: none), so that an idle MPI
                              thread sleeps instead of polling (it lives longer than the plane) */
};
/* Its messages: an ask, tag FANFS_PLANE_ASK, is four int64 (FANFS_PLANE_MAGIC, entry, its
 * stored length, the reply tag); the reply, on the reply tag (from FANFS_PLANE_FIRST_TAG), is
 * exactly the stored bytes, or empty (refused). */
#define FANFS_PLANE_ASK 1
#define FANFS_PLANE_FIRST_TAG 16
#define FANFS_PLANE_MAGIC 0x66616e66706c6e31LL /* "fanfpln1": version 1 */
int fanfs_plane_built(void);
/* Start the plane's thread: 0, or an errno (ENOSYS: not built; ENOENT: the library's MPI
 * functions were not found; EALREADY). */
int fanfs_plane_start(const struct fanfs_plane_conf *c);
/* Stop it (idempotent): what it fetched goes back to the MPI thread, its sends are waited for
 * at most a second (a buffer MPI may still read is then never freed). */
void fanfs_plane_stop(void);
/* Peer `rank` is dead (the MPI thread decides): the plane asks it nothing more. */
void fanfs_plane_dead(int rank);
/* The hedge delay from now on (the MPI thread's, from its fetches' latencies). */
void fanfs_plane_hedge(int64_t ns);
#define FANFS_PLANE_COUNTS 14
/* asked, filled, handed back, answered (owner), bytes answered, refused, malformed messages,
 * the owner's budget (answers timed, ns reading, ns from read to send posted), fetches hedged
 * and hedges that filled the piece, the owner's ns from an ask taken to its read begun, and
 * receives and sends left unfinished to MPI (their peers died mid-transfer). */
void fanfs_plane_counters(uint64_t out[FANFS_PLANE_COUNTS]);
/* The plane's fetches filled since the `since`th (at most the last 1024 and `max`): each
 * one's latency in ns (asked to filled) and stored length; `*now`: where the next call begins.
 * Counted before the READs are woken. */
int fanfs_remote_latencies(uint64_t since, int64_t *ns, uint32_t *len, int max, uint64_t *now);
/* The stored bytes of entry `e` (`len` of them, checked) for a peer, read by the calling
 * thread like the fast path's (fast.c): 0 with `*at` in `*buf` (`*cap` bytes; when NULL, taken
 * from pieces_alloc, a spare when one is kept, once the entry and length are found good and
 * with room for an O_DIRECT read's aligned span); ENOENT
 * when it is not a file stored whole in a partition staged here (or the fast path is off),
 * EINVAL when `len` is not its stored length or over FANFS_REMOTE_MAX; a read's errno, or
 * FANFS_EBADCRC. */
int fanfs_pool_fast_stored(int64_t e, uint32_t len, char **buf, uint32_t *cap, const char **at);

/* Run a job in the calling thread with the same code as the pool, the reply copied to `out`
 * (`count` bytes); 0 or an errno. For Python callers and unit tests. */
int fanfs_run_job(const struct fanfs_dicts *dicts, const struct fanfs_job *job, char *out);

/* Check a job's shape: 0, or -1 if it is malformed (pieces over the limits or empty, a range
 * outside the pieces, or a piece that holds none of the range). */
int fanfs_job_check(const struct fanfs_job *job);

/* -- the front: threads that take requests from the FUSE device themselves -----------------
 * (front.c and the files front.h lists: wire.c, meta.c, answer.c, forward.c, follow.c,
 * writes.c, cpu.c) */

/* The catalog as the front reads it: columns as in the image (little-endian, maybe
 * unaligned), nlink and which partitions this node holds computed at load. Must outlive the
 * front. */
struct fanfs_meta {
    uint64_t n;          /* entries; inode = entry + 1 */
    const char *mode;    /* u32 */
    const char *mtime;   /* i64, nanoseconds */
    const char *size;    /* u64 */
    const char *blocks;  /* u64: st_blocks, 512-byte units (the source's, or size rounded up) */
    const char *name_off, *name_len;        /* u64, u32: into strings */
    const char *child_start, *child_count;  /* u32: a directory's children, sorted by name */
    const char *part;    /* u32 */
    const uint32_t *nlink; /* native order */
    const char *strings;
    uint64_t strings_len;
    const uint8_t *part_local; /* per partition: 1 if this node holds it */
    uint32_t nparts;
    uint32_t uid, gid, blksize;
    uint64_t timeout_s;  /* how long the kernel may keep entries and attributes */
};

/* The catalog's answers, from `m` (any thread: the catalog is immutable): the attributes the
 * front answers for entry `e` (ino, size, blocks, mtime, mtimensec, mode, nlink, uid, gid,
 * blksize, atime, ctime; -1: no such entry), and the entry named `name` in directory `parent`
 * (-2: no such name; -1: not a directory). */
int fanfs_meta_attr(const struct fanfs_meta *m, uint64_t e, uint64_t out[12]);
int64_t fanfs_meta_lookup(const struct fanfs_meta *m, uint64_t parent, const char *name,
                          size_t len);

/* A front: the threads of one wing (fanfs mount's node wing, or fanfs output's), and all they
 * share, in one object its wing owns: made by fanfs_front_new, handed to every call, freed by
 * fanfs_front_free. The owner calls new, pretend, start, drain, stop, close and free, from one
 * thread; the others any thread, at any time between new and free. */
struct fanfs_front;
/* A front answering from catalog `m` (copied; its columns must outlive the front), or, with
 * `writes` (m may be NULL), the output wing's: it answers WRITE at once and queues its bytes
 * for a pwrite to its file handle, which must be an fd of the daemon's below
 * FANFS_FRONT_MAX_FD (others are forwarded), and forwards everything else once the queue is
 * written (writes.c). NULL: no memory, or neither a catalog nor writes. */
struct fanfs_front *fanfs_front_new(const struct fanfs_meta *m, int writes);
/* Stop it if it runs, close its fds, free it (unbinding pyfuse3's receiver from it). */
void fanfs_front_free(struct fanfs_front *f);

/* The size the front reads requests with and hands pyfuse3 buffers of: libfuse's own, 256
 * pages of the machine's size and a header page. The kernel refuses (EINVAL) a read of the
 * device smaller than a WRITE of the negotiated max_write, which libfuse caps at 256 pages:
 * 16 MiB with 64 KiB pages (aarch64, GH200), 4 MiB with 16 KiB ones. Fixed while the front
 * runs. */
size_t fanfs_front_bufsize(const struct fanfs_front *f);
/* What the kernel's INIT said, for `fanfs status` and the mount's log: out[0] major, out[1]
 * minor (both 0: no INIT yet), out[2] its flags (flags2 in the high half), out[3] why the front
 * does not answer (FANFS_FRONT_WHY_*), out[4] the buffer size. */
enum { FANFS_FRONT_SERVES, FANFS_FRONT_WHY_PROTOCOL, FANFS_FRONT_WHY_BUFFER };
void fanfs_front_kernel(const struct fanfs_front *f, uint64_t out[5]);
/* For tests that play an older or other kernel, before fanfs_front_start (-EBUSY while it
 * runs): the page size the buffer is sized from (0: the machine's), and `minor` > 0 rewrites
 * the kernel's INIT to protocol 7.minor's layout and flags before anyone reads it, so that
 * libfuse negotiates as with such a kernel and the real kernel gets only what that protocol
 * offers (no max_pages before 7.28, ...), though it keeps its own protocol otherwise
 * (FANFS_PRETEND_PROTOCOL; tests/adapter/test_kernels.py). */
int fanfs_front_pretend(struct fanfs_front *f, int minor, long page);
/* Writes mode, before fanfs_front_start (-EBUSY while it runs): the WRITEs it answered and
 * has not yet written live in the file open at `fd` (read-write, private; start maps it and
 * the fd may then be closed), so a SIGKILL loses none of them (fanfs/output/recover.py writes
 * them). Without it they live in memory. */
int fanfs_front_keep_writes(struct fanfs_front *f, int fd);

/* Start `nthreads` front threads on the FUSE session's fd (non-blocking), whose leader polls
 * the device for `spin_us` after a request before it sleeps: the fd pyfuse3's receiver must
 * wait on (readable while forwarded requests wait), or -errno. */
int fanfs_front_start(struct fanfs_front *f, int fd, int nthreads, int spin_us);
/* pyfuse3's receiver: the next request the bound front forwarded into `buf` (its size),
 * -EAGAIN if none, 0 once the session has ended (or no front is bound). pyfuse3's hook takes
 * no argument of ours, and a process has one pyfuse3 session: fanfs_front_bind says which
 * front it reads from (NULL: none), the one pointer the process keeps. */
struct fuse_buf;
int fanfs_front_receive(void *session, struct fuse_buf *buf);
void fanfs_front_bind(struct fanfs_front *f);
/* The receiver for a test that plays the kernel (no session): the next forwarded request
 * copied into `out` (`cap` >= fanfs_front_bufsize()), as fanfs_front_receive answers. */
ssize_t fanfs_front_forwarded(struct fanfs_front *f, void *out, size_t cap);
/* pyfuse3's loop has ended: requests forwarded and not taken, and every one the threads
 * would forward from now on, are answered EIO (the threads go on answering the rest). Call it
 * before stopping the pool: its pusher may wait for a page that a READ in the kernel's queue
 * holds, and only the front can answer that READ then. */
void fanfs_front_drain(struct fanfs_front *f);
/* Drain, stop and join the threads; then fanfs_front_close closes the receiver's fd. */
void fanfs_front_stop(struct fanfs_front *f);
void fanfs_front_close(struct fanfs_front *f);
/* Requests answered by the front, by kind, and forwarded; then how often the leader slept. */
enum { FANFS_FRONT_LOOKUPS, FANFS_FRONT_GETATTRS, FANFS_FRONT_READS, FANFS_FRONT_OTHERS,
       FANFS_FRONT_FORWARDED, FANFS_FRONT_COUNTS, FANFS_FRONT_WAITS = FANFS_FRONT_COUNTS };
void fanfs_front_counters(struct fanfs_front *f, uint64_t out[FANFS_FRONT_COUNTS + 1]);
/* The front's last READs' times in microseconds (how many, up to FANFS_FRONT_SAMPLES; in no
 * order) and the longest since start. */
#define FANFS_FRONT_SAMPLES 4096
int fanfs_front_latencies(struct fanfs_front *f, uint32_t out[FANFS_FRONT_SAMPLES],
                          uint32_t *longest);
/* The front's latency budget (follow.c): for the READs it answered from this node's disk,
 * then for those of peers' pieces, how many and the nanoseconds spent in each FANFS_STAGE_*
 * (1 + FANFS_STAGES each); then the nanoseconds the leader polled for requests (spinning). */
void fanfs_front_budget(struct fanfs_front *f, uint64_t out[FANFS_BUDGET_LEN]);

/* Planned epochs: while `efd` >= 0 (an eventfd; -1 stops it), the front records the entries
 * of the regular files it looks up and of those it READs from offset 0 (FANFS_FOLLOW_READ
 * set), and writes `efd` when the record stops being empty; fanfs_front_followed takes up to
 * `max` of them, oldest first, and says how many were lost to a full record since start. */
#define FANFS_FOLLOW_READ (1ull << 63)
void fanfs_front_follow(struct fanfs_front *f, int efd);
int fanfs_front_followed(struct fanfs_front *f, uint64_t *out, int max, uint64_t *lost);

/* Writes mode: a WRITE through fd starting below the offset given to fanfs_front_hold
 * (UINT64_MAX: every WRITE; 0: none, the default) is forwarded too.
 * fanfs_front_take_written: the lowest offset written through fd since the last call (-1: not
 * written); fanfs_front_take_error: the errno of a failed write through it (0: none); both
 * cleared by the call. fanfs_front_settle: wait until the queue is written (any thread). Then
 * the bytes written in all. */
#define FANFS_FRONT_MAX_FD 65536
int64_t fanfs_front_take_written(struct fanfs_front *f, int fd);
int fanfs_front_take_error(struct fanfs_front *f, int fd);
void fanfs_front_hold(struct fanfs_front *f, int fd, uint64_t below);
void fanfs_front_settle(struct fanfs_front *f);
uint64_t fanfs_front_written(struct fanfs_front *f);

/* Whether threads waited for a CPU in more than a tenth of the last ~100 ms (the kernel's CPU
 * pressure, read at most every 100 ms): then a thread that polls instead of sleeping takes a
 * core from others (the front's leader, the MPI thread). Any thread; 0 without PSI. */
int fanfs_cpu_pressed(void);

/* Raw messages to the FUSE device: a reply (error `err`, or the data), a notify_store. */
int fanfs_raw_reply(int fd, uint64_t unique, int err, const struct iovec *iov, int n);
int fanfs_raw_notify_store(int fd, uint64_t ino, uint64_t off, const void *data, uint32_t len);

#endif
