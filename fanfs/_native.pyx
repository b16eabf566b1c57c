# cython: language_level=3, boundscheck=False, wraparound=False
"""fanfs's native read path (fanfs/csrc/): checks, decoding and the read pool, in C.

The contract is fanfs/csrc/fanfs_native.h; `API_VERSION` is its FANFS_NATIVE_API, which
fanfs checks at import (fanfs/native.py). Every function here releases the GIL while it reads,
checks or decodes, so Python threads (the planner, remote reads, `fanfs verify`) run them in
parallel. A piece whose bytes do not match their CRC or do not decode raises `CorruptPiece`;
a failed read raises OSError.

A job (the pool's unit of work, and `run_job`'s) is a tuple: (fd, dfd, entry, ino, base, skip,
count, flags), then (offset, length, crc, kind, size, cache) per stored piece. See
fanfs/node/pool.py, which builds them.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
cimport cython
from cpython.pycapsule cimport PyCapsule_GetContext, PyCapsule_New, PyCapsule_SetContext
from cpython.ref cimport Py_DECREF, Py_INCREF
from libc.errno cimport EAGAIN, EBADMSG, EILSEQ, EINVAL, EIO, ENOMEM, ENOSYS
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy

import os
import numpy as np

cdef extern from "fanfs_native.h" nogil:
    enum: FANFS_NATIVE_API
    enum: FANFS_MAX_PIECES
    enum: FANFS_LA_WINDOW
    enum: FANFS_LA_DECAY
    enum: FANFS_LA_ON_SHARE
    enum: FANFS_MAX_DICTS
    enum: FANFS_JOB_PUSH
    enum:
        FANFS_KIND_RAW
        FANFS_KIND_ZSTD
        FANFS_KIND_FILTERED
        FANFS_KIND_FILTER
    enum:
        FANFS_SHUFFLE4
        FANFS_SHUFFLE8
        FANFS_DELTA8
        FANFS_DECIMAL4
        FANFS_DECIMAL8
        FANFS_DELTA4
    unsigned int FANFS_PIECE_MAX
    struct fanfs_piece:
        int64_t off
        uint32_t len
        uint32_t crc
        uint32_t size
        uint8_t kind
        uint8_t cache
    struct fanfs_job:
        int fd
        int dfd
        int64_t entry
        uint64_t ino
        int64_t base
        uint32_t skip
        uint32_t count
        uint32_t flags
        int npieces
        fanfs_piece pieces[4]
    struct fanfs_dicts:
        pass
    struct fanfs_read_stats:
        uint64_t cached, direct, buffered
    struct fanfs_pool_stats:
        uint64_t jobs, hits, misses, pushes, pushed_bytes, push_skipped
    int fanfs_codec_init()
    const char *fanfs_crc_name()
    int fanfs_can_decode()
    uint32_t fanfs_crc32(uint32_t crc, const void *buf, size_t len)
    fanfs_dicts *fanfs_dicts_new(int n, const char *const *dicts, const size_t *lens, int *err)
    void fanfs_dicts_free(fanfs_dicts *d)
    int fanfs_decode(const fanfs_dicts *dicts, const fanfs_piece *p, const unsigned char *inp,
                     unsigned char *out)
    int fanfs_direct_ok(int fd)
    int fanfs_read_stored(int fd, int dfd, const fanfs_piece *p, char **buf, uint32_t *cap,
                          const char **at)
    char *fanfs_alloc(uint64_t size, uint32_t *cap)
    void fanfs_read_counters(fanfs_read_stats *out)
    int fanfs_pool_start(int nthreads, int errfd)
    void fanfs_pool_stop()
    void fanfs_pool_set_dicts(fanfs_dicts *d)
    int fanfs_pool_submit(void *session, void *req, const fanfs_job *job)
    int fanfs_pool_read_ahead(const fanfs_job *job)
    int fanfs_pool_push_file(const fanfs_job *job, int devfd) nogil
    int fanfs_pool_push_files(const fanfs_job *jobs, int n, int devfd, int *out) nogil
    void fanfs_pool_drop()
    void fanfs_pool_counters(fanfs_pool_stats *out)
    struct fanfs_fast_table:
        uint64_t n
        const char *size
        const char *part
        const char *off
        const char *stored
        const char *crc
        const uint8_t *kind
        uint32_t nparts, flags
        uint64_t parts_limit
    int fanfs_pool_fast_set(const fanfs_fast_table *t)
    void fanfs_pool_fast_part(uint32_t part, int fd, int dfd)
    void fanfs_pool_fast_enable(int on)
    uint64_t fanfs_pool_fast_count()
    enum:
        FANFS_PLAN_HELD
        FANFS_PLAN_AHEAD
    void fanfs_pool_plan_mark(uint64_t e, int flag, int on)
    int fanfs_run_job(const fanfs_dicts *dicts, const fanfs_job *job, char *out)
    int fanfs_job_check(const fanfs_job *job)
    enum:
        FANFS_FAST_NO
    void fanfs_lookahead_counters(uint64_t *out)
    enum: FANFS_MAX_OWNERS
    unsigned int FANFS_REMOTE_MAX
    int FANFS_REMOTE_FD(uint32_t part)
    enum: FANFS_EREMOTE
    struct fanfs_rreq:
        int slot
        int ahead
        int64_t entry
        uint32_t part
        int64_t off
        uint32_t len, crc
        int32_t peers[4]
        int64_t queued_ns, taken_ns
        int32_t tried
    int fanfs_pool_fast_owners(const int32_t *owners, uint32_t nparts, int self)
    void fanfs_remote_set_wake(int fd, int max_waiting, int64_t wait_ns)
    int fanfs_remote_take(fanfs_rreq *out, int max)
    int fanfs_remote_fill(const fanfs_rreq *r, const char *stored, uint32_t len) nogil
    void fanfs_remote_fail(const fanfs_rreq *r)
    int fanfs_remote_pending(const fanfs_rreq *r)
    void fanfs_remote_counters(uint64_t *out)
    void fanfs_remote_legs(uint64_t *out)
    enum: FANFS_STAGES
    enum: FANFS_BUDGET_LEN
    void fanfs_pool_ahead_budget(uint64_t *out)
    struct fanfs_plane_conf:
        uintptr_t comm, byte
        const char *lib
        int rank, size, tag_ub
        int fetch
        int64_t hand_back_ns, hedge_ns, quarantine_ns
        uintptr_t watch
        int watch_fd
    int fanfs_plane_built()
    int fanfs_plane_start(const fanfs_plane_conf *c)
    void fanfs_plane_stop() nogil
    void fanfs_plane_dead(int rank)
    void fanfs_plane_hedge(int64_t ns)
    enum: FANFS_PLANE_COUNTS
    enum: FANFS_PLANE_ASK
    enum: FANFS_PLANE_FIRST_TAG
    long long FANFS_PLANE_MAGIC
    void fanfs_plane_counters(uint64_t *out)
    int fanfs_remote_latencies(uint64_t since, int64_t *ns, uint32_t *len, int max, uint64_t *now)
    struct fanfs_meta:
        uint64_t n
        const char *mode
        const char *mtime
        const char *size
        const char *blocks
        const char *name_off
        const char *name_len
        const char *child_start
        const char *child_count
        const char *part
        const uint32_t *nlink
        const char *strings
        uint64_t strings_len
        const uint8_t *part_local
        uint32_t nparts, uid, gid, blksize
        uint64_t timeout_s
    struct fuse_buf:
        pass
    enum: FANFS_FRONT_COUNTS
    int fanfs_meta_attr(const fanfs_meta *m, uint64_t e, uint64_t *out)
    int64_t fanfs_meta_lookup(const fanfs_meta *m, uint64_t parent, const char *name,
                              size_t len)
    struct fanfs_front:
        pass
    fanfs_front *fanfs_front_new(const fanfs_meta *m, int writes)
    void fanfs_front_free(fanfs_front *f)
    int fanfs_front_start(fanfs_front *f, int fd, int nthreads, int spin_us)
    int fanfs_front_receive(void *session, fuse_buf *buf)
    void fanfs_front_bind(fanfs_front *f)
    ssize_t fanfs_front_forwarded(fanfs_front *f, void *out, size_t cap)
    size_t fanfs_front_bufsize(const fanfs_front *f)
    void fanfs_front_kernel(const fanfs_front *f, uint64_t *out)
    int fanfs_front_pretend(fanfs_front *f, int minor, long page)
    int fanfs_front_keep_writes(fanfs_front *f, int fd)
    enum: FANFS_FRONT_SERVES
    enum: FANFS_FRONT_WHY_PROTOCOL
    enum: FANFS_FRONT_WHY_BUFFER
    void fanfs_front_drain(fanfs_front *f)
    void fanfs_front_stop(fanfs_front *f)
    void fanfs_front_close(fanfs_front *f)
    void fanfs_front_counters(fanfs_front *f, uint64_t *out)
    enum: FANFS_FRONT_SAMPLES
    int fanfs_front_latencies(fanfs_front *f, uint32_t *out, uint32_t *longest)
    void fanfs_front_budget(fanfs_front *f, uint64_t *out)
    int64_t fanfs_front_take_written(fanfs_front *f, int fd)
    int fanfs_front_take_error(fanfs_front *f, int fd)
    void fanfs_front_hold(fanfs_front *f, int fd, uint64_t below)
    void fanfs_front_settle(fanfs_front *f)
    uint64_t fanfs_front_written(fanfs_front *f)
    unsigned long long FANFS_FOLLOW_READ
    void fanfs_front_follow(fanfs_front *f, int efd)
    int fanfs_cpu_pressed()
    int fanfs_front_followed(fanfs_front *f, uint64_t *out, int max, uint64_t *lost)

API_VERSION = FANFS_NATIVE_API
MAX_PIECES = FANFS_MAX_PIECES
# Reads at LOOKUP: fanfs_native.h's one policy (node/reader.py's LookAhead takes it from here).
LA_WINDOW, LA_DECAY, LA_ON_SHARE = FANFS_LA_WINDOW, FANFS_LA_DECAY, FANFS_LA_ON_SHARE
PIECE_MAX = FANFS_PIECE_MAX
JOB_PUSH = FANFS_JOB_PUSH
KIND_RAW = FANFS_KIND_RAW
KIND_ZSTD = FANFS_KIND_ZSTD
KIND_FILTERED = FANFS_KIND_FILTERED
KIND_FILTER = FANFS_KIND_FILTER
FAST_NO = FANFS_FAST_NO
# The filters the C decodes (fanfs/image/filters.py must name the same ids: tests/adapter/test_codec.py).
FILTERS = {"shuffle4": FANFS_SHUFFLE4, "shuffle8": FANFS_SHUFFLE8, "delta8": FANFS_DELTA8,
           "decimal4": FANFS_DECIMAL4, "decimal8": FANFS_DECIMAL8, "delta4": FANFS_DELTA4}
JOB_FIELDS = 8  # a job tuple's header; then 6 per piece

if fanfs_codec_init() != 0:
    raise ImportError("fanfs._native: neither libisal.so.2 nor libz.so.1 can be loaded")
CRC_LIBRARY = fanfs_crc_name().decode()
DECODES = bool(fanfs_can_decode())  # libzstd.so.1 was found


class CorruptPiece(ValueError):
    """A stored piece that fails its check or does not decode (`errno`: EBADMSG or EILSEQ)."""

    def __init__(self, err, reason):
        super().__init__(reason)
        self.errno = err


def failure_reason(int err):
    """What an errno from the native read path means, in words (logs and errors)."""
    if err == EBADMSG:
        return "checksum mismatch"
    if err == EILSEQ:
        return "stored bytes do not decode"
    if err == ENOSYS:
        return "compressed, and libzstd is missing"
    if err == EIO:
        return "read failed (I/O error, or the partition ends early)"
    return "read failed: " + os.strerror(err)


cdef object _raise(int err):
    if err == EBADMSG or err == EILSEQ:
        raise CorruptPiece(err, failure_reason(err))
    if err == ENOMEM:
        raise MemoryError()
    raise OSError(err, failure_reason(err))


cdef class Dictionaries:
    """An image's zstd dictionaries (dictionary id i + 1 is dicts[i]), ready for decoding."""
    cdef fanfs_dicts *d
    cdef readonly int count

    def __cinit__(self, dicts=()):
        cdef int n = len(dicts), i, err = 0
        kept = [bytes(x) for x in dicts]
        if n > FANFS_MAX_DICTS:
            raise ValueError(f"{n} dictionaries, at most {FANFS_MAX_DICTS}")
        cdef const char **ptrs = <const char **>malloc(sizeof(char *) * (n + 1))
        cdef size_t *lens = <size_t *>malloc(sizeof(size_t) * (n + 1))
        try:
            if ptrs == NULL or lens == NULL:
                raise MemoryError()
            for i in range(n):
                ptrs[i] = PyBytes_AS_STRING(kept[i])
                lens[i] = len(kept[i])
            self.d = fanfs_dicts_new(n, ptrs, lens, &err)
            if self.d == NULL:
                _raise(err)
            self.count = n
        finally:
            free(ptrs)
            free(lens)

    def __dealloc__(self):
        fanfs_dicts_free(self.d)


cdef const fanfs_dicts *_dicts(Dictionaries d):
    return NULL if d is None else d.d


def crc32(data, unsigned long value=0):
    """CRC-32 of any buffer (zlib's polynomial), continuing from `value`."""
    cdef Py_buffer view
    cdef uint32_t crc
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        if view.len >= 65536:
            with nogil:
                crc = fanfs_crc32(<uint32_t>value, view.buf, view.len)
        else:
            crc = fanfs_crc32(<uint32_t>value, view.buf, view.len)
    finally:
        PyBuffer_Release(&view)
    return crc


cdef bytes _decoded(const fanfs_dicts *dicts, fanfs_piece *p, const unsigned char *src):
    """The decoded bytes of a checked piece (GIL released while decoding)."""
    cdef bytes out = PyBytes_FromStringAndSize(NULL, p.size)
    cdef unsigned char *dst = <unsigned char *>PyBytes_AS_STRING(out)
    cdef unsigned char *tmp = NULL
    cdef uint32_t cap = 0
    cdef int err
    if p.kind == FANFS_KIND_RAW:
        if p.len != p.size:
            _raise(EILSEQ)
        memcpy(dst, src, p.size)
        return out
    if (<uintptr_t>dst) & 7:  # the filters write words: decode aligned, then copy
        tmp = <unsigned char *>fanfs_alloc(p.size, &cap)
        if tmp == NULL:
            raise MemoryError()
    with nogil:
        err = fanfs_decode(dicts, p, src, dst if tmp == NULL else tmp)
        if err == 0 and tmp != NULL:
            memcpy(dst, tmp, p.size)
    free(tmp)
    if err != 0:
        _raise(err)
    return out


def decode(data, int kind, unsigned int size, Dictionaries dicts=None):
    """Decode a piece's stored bytes (checked already) to exactly `size` bytes."""
    cdef Py_buffer view
    cdef fanfs_piece p
    if size > FANFS_PIECE_MAX:
        _raise(EILSEQ)
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        if view.len > FANFS_PIECE_MAX:
            _raise(EILSEQ)
        p.off = 0
        p.len = <uint32_t>view.len
        p.crc = 0
        p.size = size
        p.kind = kind
        p.cache = 0
        return _decoded(_dicts(dicts), &p, <const unsigned char *>view.buf)
    finally:
        PyBuffer_Release(&view)


cdef extern from "filters.h" nogil:
    int fanfs_vectors()
    int fanfs_unfilter_at(int fid, const unsigned char *inp, uint64_t n, unsigned char *out,
                          uint32_t size, int vectors)


def vectors():
    """The widest vectors (bits) the array filters' decode uses on this CPU: 256, 128 or 0."""
    return fanfs_vectors()


def unfilter(data, int fid, unsigned int size, int vectors):
    """Undo array filter `fid` of `data` into `size` bytes with vectors of at most `vectors`
    bits (filters.h): each width the CPU runs must give the same bytes (tests, decode_bench)."""
    cdef Py_buffer view
    cdef uint32_t cap = 0
    cdef unsigned char *tmp
    cdef int err
    if size > FANFS_PIECE_MAX:
        _raise(EILSEQ)
    tmp = <unsigned char *>fanfs_alloc(size, &cap)
    if tmp == NULL:
        raise MemoryError()
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        with nogil:
            err = fanfs_unfilter_at(fid, <const unsigned char *>view.buf, <uint64_t>view.len,
                                    tmp, size, vectors)
        if err != 0:
            _raise(err)
        return PyBytes_FromStringAndSize(<char *>tmp, size)
    finally:
        PyBuffer_Release(&view)
        free(tmp)


def read(int fd, int dfd, long long offset, unsigned int length, unsigned int crc, int kind,
         unsigned int size, Dictionaries dicts=None):
    """Read a stored piece from `fd` (O_DIRECT through `dfd` when >= 0 and the page cache
    does not hold it), check it against `crc` and decode it to `size` bytes."""
    cdef fanfs_piece p
    cdef char *buf = NULL
    cdef uint32_t cap = 0
    cdef const char *at = NULL
    cdef int err
    if length > FANFS_PIECE_MAX or size > FANFS_PIECE_MAX or offset < 0:
        _raise(EINVAL)
    p.off = offset
    p.len = length
    p.crc = crc
    p.size = size
    p.kind = kind
    p.cache = 0
    try:
        with nogil:
            err = fanfs_read_stored(fd, dfd, &p, &buf, &cap, &at)
        if err != 0:
            _raise(err)
        return _decoded(_dicts(dicts), &p, <const unsigned char *>at)
    finally:
        free(buf)


def read_stored(int fd, int dfd, long long offset, unsigned int length, unsigned int crc):
    """A piece's stored bytes, read as `read` reads them and checked against `crc`."""
    return read(fd, dfd, offset, length, crc, FANFS_KIND_RAW, length)


def direct_ok(int fd):
    """Whether `fd`'s file can be read with O_DIRECT at the alignment fanfs uses."""
    return bool(fanfs_direct_ok(fd))


def read_stats():
    """Pieces read so far: from the page cache, with O_DIRECT, and buffered (no direct fd)."""
    cdef fanfs_read_stats s
    fanfs_read_counters(&s)
    return {"cached": s.cached, "direct": s.direct, "buffered": s.buffered}


cdef int _job_from(tuple job, fanfs_job *j):
    """Fill `j` from a job tuple; 0, or -1 if it is malformed. Never raises."""
    cdef int i, b
    cdef Py_ssize_t n = (len(job) - JOB_FIELDS) // 6
    if n < 1 or n > FANFS_MAX_PIECES or len(job) != JOB_FIELDS + 6 * n:
        return -1
    try:
        j.fd, j.dfd, j.entry, j.ino = job[0], job[1], job[2], job[3]
        j.base, j.skip, j.count, j.flags = job[4], job[5], job[6], job[7]
        j.npieces = <int>n
        for i in range(n):
            b = JOB_FIELDS + 6 * i
            j.pieces[i].off = job[b]
            j.pieces[i].len = job[b + 1]
            j.pieces[i].crc = job[b + 2]
            j.pieces[i].kind = job[b + 3]
            j.pieces[i].size = job[b + 4]
            j.pieces[i].cache = job[b + 5]
    except (TypeError, OverflowError, ValueError):
        return -1
    return fanfs_job_check(j)


def job_ok(tuple job):
    """Whether the pool would take `job` (its shape; not whether its bytes are sound)."""
    cdef fanfs_job j
    return _job_from(job, &j) == 0


def run_job(tuple job, Dictionaries dicts=None):
    """Answer a job as the pool answers a READ, in this thread: its reply's bytes."""
    cdef fanfs_job j
    cdef int err
    if _job_from(job, &j) != 0:
        raise ValueError("malformed job")
    cdef bytes out = PyBytes_FromStringAndSize(NULL, j.count)
    cdef char *dst = PyBytes_AS_STRING(out)
    cdef const fanfs_dicts *d = _dicts(dicts)
    with nogil:
        err = fanfs_run_job(d, &j, dst)
    if err != 0:
        _raise(err)
    return out


# -- the pool ---------------------------------------------------------------------------------


def pool_start(int threads, int errfd):
    """Start the pool's threads; a failed READ posts a 16-byte record (entry, errno, 0) on
    `errfd`. OSError if it cannot start."""
    cdef int ret = fanfs_pool_start(threads, errfd)
    if ret != 0:
        raise OSError(-ret, "native read pool: " + os.strerror(-ret))


def pool_dicts(Dictionaries d not None):
    """The dictionaries the pool decodes with (it takes its own reference: jobs decoding with
    the previous set keep it until they are done)."""
    fanfs_pool_set_dicts(d.d)


def pool_stop():
    """Answer every queued READ, then stop the threads and the pusher."""
    with nogil:
        fanfs_pool_stop()


def pool_read_ahead(tuple job):
    """Queue a read-ahead (its pieces decoded into the cache); False if it was not queued."""
    cdef fanfs_job j
    if _job_from(job, &j) != 0:
        return False
    return fanfs_pool_read_ahead(&j) == 0


def pool_push_file(tuple job, int devfd):
    """Read, check and decode a file stored whole (`job`: one piece) and store it into the
    kernel's page cache through the FUSE device `devfd`, in this thread (it may wait for READs
    in flight): 0 stored, -1 the kernel does not know its inode (nothing read), else an
    errno."""
    cdef fanfs_job j
    cdef int r
    if _job_from(job, &j) != 0:
        return EINVAL
    with nogil:
        r = fanfs_pool_push_file(&j, devfd)
    return r


def pool_push_files(list jobs, int devfd):
    """pool_push_file of each of `jobs` (peers' files: their fetches asked together, a few
    ahead of the one being stored), in this thread; a list of its answers."""
    cdef int n = len(jobs), k
    cdef fanfs_job *js = <fanfs_job *>calloc(max(n, 1), sizeof(fanfs_job))
    cdef int *out = <int *>calloc(max(n, 1), sizeof(int))
    try:
        if js == NULL or out == NULL:
            raise MemoryError()
        for k in range(n):  # (a malformed one has no pieces: answered EINVAL)
            if not isinstance(jobs[k], tuple) or _job_from(jobs[k], &js[k]) != 0:
                js[k].npieces = 0
        with nogil:
            fanfs_pool_push_files(js, n, devfd, out)
        return [out[k] for k in range(n)]
    finally:
        free(js)
        free(out)


def pool_drop():
    """Empty the pool's cache of decoded pieces (for cold measurements)."""
    fanfs_pool_drop()


def pool_stats():
    """The pool's counters: jobs run, cache hits and misses, pushes and pushed bytes, and
    pushes skipped (the push queue was full)."""
    cdef fanfs_pool_stats s
    fanfs_pool_counters(&s)
    return {"jobs": s.jobs, "hits": s.hits, "misses": s.misses, "pushes": s.pushes,
            "pushed_bytes": s.pushed_bytes, "push_skipped": s.push_skipped}


cdef int _read_hook(void *session, void *req, uint64_t ino, object reply) noexcept:
    """pyfuse3's read hook: a read handler returned `reply`; 0 when the pool took the request
    (it answers it), -1 when pyfuse3 must answer EIO. Never raises."""
    cdef fanfs_job j
    if type(reply) is not tuple or _job_from(<tuple>reply, &j) != 0:
        return -1
    j.ino = ino
    return fanfs_pool_submit(session, req, &j)


def read_hook():
    """The capsule to give pyfuse3.set_read_hook: read handlers may then return job tuples."""
    return PyCapsule_New(<void *>_read_hook, b"pyfuse3.read_hook", NULL)


_fast_columns = None  # the arrays the fast path reads (kept alive here)


def pool_fast(size, part, data_off, stored_len, crc, kind, int nparts, unsigned int flags,
              uint64_t parts_limit):
    """Give the fast path the catalog's columns (contiguous arrays of one length: size, data_off
    and stored_len <u8, part and crc <u4) and `kind`, one uint8 per entry (a piece kind, or
    FAST_NO). They are kept alive here. Off until pool_fast_enable."""
    cdef fanfs_fast_table t
    cols = {"size": (size, "<u8"), "part": (part, "<u4"), "data_off": (data_off, "<u8"),
            "stored_len": (stored_len, "<u8"), "crc": (crc, "<u4"), "kind": (kind, "|u1")}
    for name, (a, want) in cols.items():
        if (a.ndim != 1 or len(a) != len(size) or a.dtype.str != want
                or not a.flags.c_contiguous):
            raise ValueError(f"pool_fast: column {name} is not a contiguous {want} array")
    t.n = len(size)
    t.size = <const char *><uintptr_t>size.ctypes.data
    t.part = <const char *><uintptr_t>part.ctypes.data
    t.off = <const char *><uintptr_t>data_off.ctypes.data
    t.stored = <const char *><uintptr_t>stored_len.ctypes.data
    t.crc = <const char *><uintptr_t>crc.ctypes.data
    t.kind = <const uint8_t *><uintptr_t>kind.ctypes.data
    t.nparts = nparts
    t.flags = flags
    t.parts_limit = parts_limit
    cdef int ret = fanfs_pool_fast_set(&t)
    if ret != 0:
        raise OSError(-ret, "pool_fast: " + os.strerror(-ret))
    global _fast_columns
    _fast_columns = tuple(a for a, _ in cols.values())


def pool_fast_part(unsigned int part, int fd, int dfd):
    """Partition `part` is staged: the fast path reads it through `fd` (`dfd`: O_DIRECT)."""
    fanfs_pool_fast_part(part, fd, dfd)


def pool_fast_enable(bint on):
    fanfs_pool_fast_enable(on)


PLAN_HELD = FANFS_PLAN_HELD
PLAN_AHEAD = FANFS_PLAN_AHEAD


def pool_plan_mark(uint64_t entry, int flag, bint on):
    """Mark `entry` for a planned epoch (PLAN_HELD: its READs go to Python, which holds its
    bytes; PLAN_AHEAD: no read starts at its LOOKUP), or clear the mark. Any thread. (An
    atomic or: with the GIL kept, since handing it over costs a thread among busy pushers up
    to the interpreter's switch interval to get it back.)"""
    fanfs_pool_plan_mark(entry, flag, on)


def cpu_pressed():
    """Whether threads waited for a CPU in more than a tenth of the last ~100 ms (the kernel's
    CPU pressure): polling instead of sleeping would take a core from them."""
    return bool(fanfs_cpu_pressed())


def pool_fast_count():
    """READs the fast path answered."""
    return fanfs_pool_fast_count()


# -- the front: requests taken from the FUSE device by C threads ------------------------------

META_COLUMNS = {"mode": "<u4", "mtime_ns": "<i8", "size": "<u8", "blocks": "<u8",
                "name_off": "<u8", "name_len": "<u4", "child_start": "<u4",
                "child_count": "<u4", "part": "<u4", "nlink": "=u4"}
ATTR_FIELDS = ("ino", "size", "blocks", "mtime", "mtimensec", "mode", "nlink", "uid", "gid",
               "blksize", "atime", "ctime")


@cython.no_gc_clear  # a Front's threads read its arrays until the Front is freed
cdef class Meta:
    """The catalog as the front reads it (fanfs/csrc/meta.c): `columns` maps each name of
    META_COLUMNS to a contiguous array of that type, one per entry; `strings` the catalog's
    string table (bytes); `part_local` one uint8 per partition, 1 where this node holds it.
    Immutable; it keeps its arrays alive, and a Front answering from it keeps it."""
    cdef fanfs_meta m
    cdef object _arrays

    def __init__(self, columns, strings, part_local, unsigned int uid, unsigned int gid,
                 unsigned int blksize, uint64_t timeout_s):
        if self._arrays is not None:  # a Front may hold the arrays it was made with
            raise ValueError("Meta: already made")
        n = len(columns["mode"])
        for name, want in META_COLUMNS.items():
            a = columns[name]
            if (a.ndim != 1 or len(a) != n
                    or a.dtype.str.replace("<", "=") != want.replace("<", "=")
                    or not a.flags.c_contiguous):
                raise ValueError(f"Meta: column {name} is not a contiguous {want} array")
        if (part_local.ndim != 1 or part_local.dtype.str != "|u1"
                or not part_local.flags.c_contiguous or not isinstance(strings, bytes)):
            raise ValueError("Meta: part_local must be contiguous uint8, strings bytes")
        self.m.n = n
        self.m.mode = <const char *><uintptr_t>columns["mode"].ctypes.data
        self.m.mtime = <const char *><uintptr_t>columns["mtime_ns"].ctypes.data
        self.m.size = <const char *><uintptr_t>columns["size"].ctypes.data
        self.m.blocks = <const char *><uintptr_t>columns["blocks"].ctypes.data
        self.m.name_off = <const char *><uintptr_t>columns["name_off"].ctypes.data
        self.m.name_len = <const char *><uintptr_t>columns["name_len"].ctypes.data
        self.m.child_start = <const char *><uintptr_t>columns["child_start"].ctypes.data
        self.m.child_count = <const char *><uintptr_t>columns["child_count"].ctypes.data
        self.m.part = <const char *><uintptr_t>columns["part"].ctypes.data
        self.m.nlink = <const uint32_t *><uintptr_t>columns["nlink"].ctypes.data
        self.m.strings = PyBytes_AS_STRING(strings)
        self.m.strings_len = len(strings)
        self.m.part_local = <const uint8_t *><uintptr_t>part_local.ctypes.data
        self.m.nparts = len(part_local)
        self.m.uid, self.m.gid, self.m.blksize, self.m.timeout_s = uid, gid, blksize, timeout_s
        self._arrays = (tuple(columns[name] for name in META_COLUMNS), strings, part_local)

    def attr(self, uint64_t entry):
        """The attributes the front answers for `entry` (a dict of ATTR_FIELDS); None when it
        is out of range."""
        cdef uint64_t out[12]
        if fanfs_meta_attr(&self.m, entry, out) != 0:
            return None
        return {name: out[i] for i, name in enumerate(ATTR_FIELDS)}

    def lookup(self, uint64_t parent, bytes name):
        """The front's lookup: the entry named `name` in directory `parent`, or None (no such
        name), or -1 (`parent` is no directory)."""
        cdef int64_t e = fanfs_meta_lookup(&self.m, parent, PyBytes_AS_STRING(name), len(name))
        return None if e == -2 else (-1 if e < 0 else e)


FRONT_WHY = {FANFS_FRONT_SERVES: "", FANFS_FRONT_WHY_PROTOCOL: "protocol",
             FANFS_FRONT_WHY_BUFFER: "buffer"}


cdef void _receiver_released(object capsule) noexcept:
    """A receiver capsule is gone (pyfuse3 let it go): the front it kept alive may go too."""
    cdef void *front = PyCapsule_GetContext(capsule)
    if front != NULL:
        Py_DECREF(<object>front)


@cython.no_gc_clear  # its threads run until __dealloc__ stops them: `meta` must outlive them
cdef class Front:
    """One wing's front (fanfs/csrc/front.c): its C threads take requests from the FUSE
    device and answer, from `meta` (the node wing's), or, with `writes`, WRITEs written
    behind to the request's file handle (an fd of the caller's), in order (the output
    wing's); they forward the rest to pyfuse3. The wing that makes it owns it: pretend and
    start, drain, stop and close are its calls; the rest may come from any thread. Freed with
    the object (stopped first if it still runs)."""
    cdef fanfs_front *f
    cdef readonly Meta meta
    cdef readonly bint writes

    def __cinit__(self, Meta meta=None, bint writes=False):
        if meta is None and not writes:
            raise ValueError("Front: a catalog (Meta), or writes")
        self.f = fanfs_front_new(&meta.m if meta is not None else NULL, writes)
        if self.f == NULL:
            if meta is not None and meta.m.n == 0 and not writes:
                raise ValueError("Front: an empty catalog")
            raise MemoryError()
        self.meta = meta
        self.writes = writes

    def __dealloc__(self):
        if self.f != NULL:
            with nogil:
                fanfs_front_free(self.f)
            self.f = NULL

    def pretend(self, int minor, long page=0):
        """Before start, for tests that play another kernel: rewrite the INIT to protocol
        7.`minor`'s layout and flags (0: as sent); size the buffer for `page`-byte pages (0:
        the machine's)."""
        cdef int ret = fanfs_front_pretend(self.f, minor, page)
        if ret < 0:
            raise OSError(-ret, "front pretend: " + os.strerror(-ret))

    def keep_writes(self, int fd):
        """Before start, in writes mode: the WRITEs answered and not yet written live in the
        file open at `fd` (mapped at start; the fd may be closed then), for a SIGKILL's
        recovery."""
        cdef int ret = fanfs_front_keep_writes(self.f, fd)
        if ret < 0:
            raise OSError(-ret, "front keep_writes: " + os.strerror(-ret))

    def start(self, int fd, int threads, int spin_us):
        """Start the threads on the FUSE session's fd (the leader polls the device for
        `spin_us` after a request): the fd pyfuse3's receiver waits on. OSError if they
        cannot start."""
        cdef int ret = fanfs_front_start(self.f, fd, threads, spin_us)
        if ret < 0:
            raise OSError(-ret, "front: " + os.strerror(-ret))
        return ret

    def bufsize(self):
        """The size the front reads requests with (libfuse's: 256 pages and a header page)."""
        return fanfs_front_bufsize(self.f)

    def kernel(self):
        """What the kernel's INIT said: {"major", "minor" (0 before the INIT), "flags", "why"
        ("": the front answers; "protocol": older than 7.12, libfuse answers everything;
        "buffer": the kernel refused the front's request buffer and the session ended),
        "bufsize"}."""
        cdef uint64_t out[5]
        fanfs_front_kernel(self.f, out)
        return {"major": out[0], "minor": out[1], "flags": out[2], "why": FRONT_WHY[out[3]],
                "bufsize": out[4]}

    def forwarded(self):
        """The next request the front forwarded (bytes), None if none waits, b"" once the
        session ended: pyfuse3's receiver, for a test that plays the kernel."""
        cdef size_t cap = fanfs_front_bufsize(self.f)
        cdef char *buf = <char *>malloc(cap)
        cdef ssize_t n
        if buf == NULL:
            raise MemoryError()
        try:
            n = fanfs_front_forwarded(self.f, buf, cap)
            if n == -EAGAIN:
                return None
            if n < 0:
                raise OSError(-n, "front forwarded: " + os.strerror(-n))
            return buf[:n]
        finally:
            free(buf)

    def receiver(self):
        """The capsule to give pyfuse3.set_receiver: it reads from this front (a process has
        one pyfuse3 session, and one front bound to it). The capsule holds a reference to this
        front, so that the front outlives pyfuse3's hold of its receiver."""
        fanfs_front_bind(self.f)
        capsule = PyCapsule_New(<void *>fanfs_front_receive, b"pyfuse3.receiver",
                                _receiver_released)
        Py_INCREF(self)
        PyCapsule_SetContext(capsule, <void *>self)
        return capsule

    def take_written(self, int fd):
        """The lowest offset the front wrote to through `fd` since the last call, None if it
        did not (clears it)."""
        cdef int64_t low = fanfs_front_take_written(self.f, fd)
        return None if low < 0 else low

    def hold(self, int fd, uint64_t below):
        """WRITEs through `fd` starting below `below` come to pyfuse3 from now on (0: none)."""
        fanfs_front_hold(self.f, fd, below)

    def settle(self):
        """Return once every WRITE the front answered is in its file."""
        with nogil:
            fanfs_front_settle(self.f)

    def take_error(self, int fd):
        """The errno of a write through `fd` that failed since the last call (0: none)."""
        return fanfs_front_take_error(self.f, fd)

    def written(self):
        """Bytes the front wrote in writes mode."""
        return fanfs_front_written(self.f)

    def drain(self):
        """pyfuse3's loop has ended: what the front would forward is answered EIO from now
        on."""
        fanfs_front_drain(self.f)

    def stop(self):
        """Stop and join the threads (requests still forwarded are answered EIO)."""
        with nogil:
            fanfs_front_stop(self.f)

    def close(self):
        """Close the receiver's fd, once pyfuse3 no longer waits on it."""
        fanfs_front_close(self.f)

    def follow(self, int efd):
        """Record the files the front looks up and reads from their start, writing the
        eventfd `efd` when the record stops being empty (-1: stop recording)."""
        fanfs_front_follow(self.f, efd)

    def followed(self, int most=4096):
        """What the front recorded, oldest first: (entries, whether each was a READ (else a
        LOOKUP), records lost to a full record since start)."""
        cdef uint64_t lost = 0
        cdef int n
        buf = bytearray(8 * max(0, min(most, 1 << 16)))
        cdef char *at = buf
        n = fanfs_front_followed(self.f, <uint64_t *>at, len(buf) // 8, &lost)
        got = np.frombuffer(buf, np.uint64, n)
        flag = np.uint64(FANFS_FOLLOW_READ)
        return (got & ~flag).astype(np.int64), (got & flag) != 0, lost

    def latencies(self):
        """(the front's last READs' times in seconds, in no order; the longest since start)."""
        cdef uint32_t longest = 0
        out = np.zeros(FANFS_FRONT_SAMPLES, dtype=np.uint32)
        cdef uint32_t[::1] view = out
        cdef int n = fanfs_front_latencies(self.f, &view[0], &longest)
        return out[:n] / 1e6, longest / 1e6

    def budget(self):
        """The latency budget of the READs it answered: for this node's files, then for peers',
        the READs and the nanoseconds of each stage (BUDGET_STAGES of them); then the
        nanoseconds its leader polled for requests."""
        cdef uint64_t c[FANFS_BUDGET_LEN]
        fanfs_front_budget(self.f, c)
        return tuple(c[i] for i in range(FANFS_BUDGET_LEN))

    def counters(self):
        """Requests the front answered (lookups, getattrs, reads, others) and forwarded, and
        how often its leader slept."""
        cdef uint64_t c[8]
        fanfs_front_counters(self.f, c)
        return {"lookups": c[0], "getattrs": c[1], "reads": c[2], "others": c[3],
                "forwarded": c[4], "waits": c[5]}


# The stages of a READ's latency budget (FANFS_STAGE_*; fanfs/status.py names them in order).
BUDGET_STAGES = FANFS_STAGES


def pool_budget():
    """The latency budget of the reads the pool began at LOOKUP (Front.budget's layout: READs
    and nanoseconds per stage, twice, then 0), and the legs of the peers' pieces the MPI thread
    fetched for the front: fills, then the nanoseconds queued (until the MPI thread took them),
    away (the request out, the owner, the reply in), and filling (check, decode, the READ
    woken)."""
    cdef uint64_t c[FANFS_BUDGET_LEN]
    cdef uint64_t legs[4]
    fanfs_pool_ahead_budget(c)
    fanfs_remote_legs(legs)
    return tuple(c[i] for i in range(FANFS_BUDGET_LEN)), tuple(legs[i] for i in range(4))


def front_stats(Front front=None):
    """`front`'s counters (Front.counters; zeros without one) and the reads the pool started
    at LOOKUP (started, then read, never read)."""
    cdef uint64_t la[3]
    fanfs_lookahead_counters(la)
    counts = front.counters() if front is not None else dict.fromkeys(
        ("lookups", "getattrs", "reads", "others", "forwarded", "waits"), 0)
    return {**counts, "lookahead_started": la[0], "lookahead_used": la[1],
            "lookahead_unused": la[2]}


# The buffers' file of an output front's WRITEs (csrc/front.h, writes.c's "Kept"), as
# fanfs/output/recover.py reads it after a SIGKILL and fanfs/output/front.py writes its owner's
# part: its magic, where the buffers begin, where its owner's part of the header begins.
cdef extern from "front.h":
    const char *FANFS_WB_MAGIC
    enum: FANFS_WB_HEAD
    enum: FANFS_WB_OWNER

WB_MAGIC = <bytes>FANFS_WB_MAGIC
WB_HEAD = FANFS_WB_HEAD
WB_OWNER = FANFS_WB_OWNER


# -- a peer's files for the front, fetched by the MPI thread -----------------------------------

MAX_OWNERS = FANFS_MAX_OWNERS
REMOTE_MAX = FANFS_REMOTE_MAX
EREMOTE = FANFS_EREMOTE  # a peer's piece no holder gave in time (pool_push_file)


def remote_fd(unsigned int part):
    """The descriptor a job names for partition `part` held by peers (pool_push_file)."""
    return FANFS_REMOTE_FD(part)


def pool_fast_owners(owners, int rank):
    """Which ranks hold each partition (a contiguous int32 array, partitions x MAX_OWNERS, -1
    padded) and which is this daemon: the front then answers READs of files only peers hold
    through the MPI thread (remote_take/remote_fill), once remote_set_wake is called."""
    if (owners.ndim != 2 or owners.shape[1] != FANFS_MAX_OWNERS or owners.dtype.str != "<i4"
            or not owners.flags.c_contiguous):
        raise ValueError("pool_fast_owners: owners must be contiguous <i4, partitions x "
                         f"{FANFS_MAX_OWNERS}")
    cdef int ret = fanfs_pool_fast_owners(<const int32_t *><uintptr_t>owners.ctypes.data,
                                          owners.shape[0], rank)
    if ret != 0:
        raise OSError(-ret, "pool_fast_owners: " + os.strerror(-ret))


def remote_set_wake(int fd, int max_waiting=0, double wait_s=0):
    """The eventfd the front writes when it queues a request for a peer's piece (-1: none;
    what is queued or pending is given up, its READs go to Python). At most `max_waiting` READs
    wait for peers' pieces at once, each at most `wait_s` seconds (0: no limit); the others go
    to Python."""
    if max_waiting < 0 or not wait_s >= 0:
        raise ValueError("remote_set_wake: max_waiting and wait_s must not be negative")
    fanfs_remote_set_wake(fd, max_waiting, <int64_t>(min(wait_s, 1e9) * 1e9))


cdef tuple _rreq_tuple(fanfs_rreq *r):
    return (r.slot, r.ahead, r.entry, r.part, r.off, r.len, r.crc,
            tuple(r.peers[k] for k in range(FANFS_MAX_OWNERS) if r.peers[k] >= 0),
            r.queued_ns, r.taken_ns, r.tried)


cdef int _rreq_from(tuple t, fanfs_rreq *r) except -1:
    cdef int k
    r.slot, r.ahead, r.entry, r.part, r.off, r.len, r.crc = t[:7]
    for k in range(FANFS_MAX_OWNERS):
        r.peers[k] = t[7][k] if k < len(t[7]) else -1
    r.queued_ns, r.taken_ns = t[8:10] if len(t) >= 10 else (0, 0)
    r.tried = t[10] if len(t) >= 11 else -1
    return 0


def remote_take(int most=64):
    """Requests the front queued for peers' pieces: (slot, ahead, entry, partition, offset,
    length, crc, holders, queued_ns, taken_ns, tried) each, `tried` the holder the data plane
    asked before it handed the request back (-1: none); never waits."""
    cdef fanfs_rreq out[64]
    cdef int n = fanfs_remote_take(out, min(most, 64))
    return [_rreq_tuple(&out[i]) for i in range(n)]


def remote_fill(tuple request, data):
    """Hand the front a request's stored bytes (checked and decoded here, without the GIL): 0,
    or an errno: ESTALE (it was given up), EBADMSG or EILSEQ (a bad copy: ask another holder),
    ENOMEM."""
    cdef fanfs_rreq r
    cdef Py_buffer view
    cdef int err
    _rreq_from(request, &r)
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        with nogil:
            err = fanfs_remote_fill(&r, <const char *>view.buf, <uint32_t>view.len)
    finally:
        PyBuffer_Release(&view)
    return err


def remote_fail(tuple request):
    """No holder can give a request's piece: the READs waiting for it go to Python."""
    cdef fanfs_rreq r
    _rreq_from(request, &r)
    fanfs_remote_fail(&r)


def remote_pending(tuple request):
    """Whether a request still waits for its bytes (not filled, not given up)."""
    cdef fanfs_rreq r
    _rreq_from(request, &r)
    return bool(fanfs_remote_pending(&r))


# -- the data plane: remote reads over MPI in C (plane.c) -------------------------------------

PLANE_ASK = FANFS_PLANE_ASK
PLANE_FIRST_TAG = FANFS_PLANE_FIRST_TAG
PLANE_MAGIC = FANFS_PLANE_MAGIC
PLANE_COUNTERS = ("asked", "filled", "handed_back", "answered", "answered_bytes", "refused",
                  "malformed", "owner_n", "owner_read_ns", "owner_post_ns", "hedged", "hedges_won",
                  "owner_queue_ns", "left")


def plane_built():
    """Whether this build has the data plane (mpi.h was found when it was built)."""
    return bool(fanfs_plane_built())


def plane_start(uintptr_t comm, uintptr_t byte, str lib, int rank, int size, int tag_ub,
                bint fetch, double hand_back_s, double hedge_s, double quarantine_s,
                uintptr_t watch=0, int watch_fd=-1):
    """Start the data plane's thread on communicator `comm` (its MPI_BYTE `byte`: mpi4py's
    handles), through the MPI library loaded with `lib` (mpi4py's MPI module); `fetch`: take
    the front's requests for peers' pieces too (remote_set_wake was called); `watch`,
    `watch_fd`: the MPI thread's communicator and eventfd, written when a message waits there
    (the fd must outlive the plane). OSError if it cannot start (ENOSYS: not built)."""
    cdef fanfs_plane_conf c
    encoded = os.fsencode(lib)
    c.comm, c.byte, c.lib = comm, byte, encoded
    c.rank, c.size, c.tag_ub, c.fetch = rank, size, tag_ub, fetch
    c.hand_back_ns = <int64_t>(min(hand_back_s, 1e6) * 1e9)
    c.hedge_ns = <int64_t>(min(hedge_s, 1e6) * 1e9)
    c.quarantine_ns = <int64_t>(min(quarantine_s, 1e6) * 1e9)
    c.watch, c.watch_fd = watch, watch_fd
    cdef int err = fanfs_plane_start(&c)
    if err != 0:
        raise OSError(err, "plane_start: " + os.strerror(err))


def plane_stop():
    """Stop the data plane (idempotent; waits for its thread, at most about a second)."""
    with nogil:
        fanfs_plane_stop()


def plane_hedge(double seconds):
    """The data plane's hedge delay from now on."""
    fanfs_plane_hedge(<int64_t>(min(seconds, 1e6) * 1e9))


def plane_dead(int rank):
    """Peer `rank` is dead: the data plane asks it nothing more."""
    fanfs_plane_dead(rank)


def plane_stats():
    """The data plane's counters (PLANE_COUNTERS), since the process began."""
    cdef uint64_t c[FANFS_PLANE_COUNTS]
    fanfs_plane_counters(c)
    return {name: c[i] for i, name in enumerate(PLANE_COUNTERS)}


def plane_latencies(uint64_t since):
    """(next, [(seconds, stored length), ...]): the data plane's fetches filled since the
    `since`th (at most the last 1024), and where the next call begins."""
    cdef int64_t ns[1024]
    cdef uint32_t length[1024]
    cdef uint64_t now = since
    cdef int n = fanfs_remote_latencies(since, ns, length, 1024, &now)
    return now, [(ns[i] / 1e9, length[i]) for i in range(n)]


def remote_stats():
    """Peers' pieces the MPI thread fetched for the front, gave up, and reserved at LOOKUP."""
    cdef uint64_t c[3]
    fanfs_remote_counters(c)
    return {"remote_fetched": c[0], "remote_failed": c[1], "remote_at_lookup": c[2]}
