# fanfs's native read pool (fanfs_read_pool.h), included in pyfuse3's __init__.pyx by
# tools/install_pyfuse3.py. A read handler that returns a tuple instead of bytes,
# (fd, entry, skip, count) followed by (offset, length, crc, kind, size, cache) per stored piece
# (fanfs/node/native.py), hands the request to the pool, which reads, checks, decodes and answers it
# without the GIL (see fuse_read_async).

from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.stdlib cimport malloc, free

cdef extern from "fanfs_read_pool.h" nogil:
    enum: FANFS_MAX_PIECES
    enum: FANFS_PIECE_MAX
    struct fanfs_piece:
        int64_t off
        uint32_t len
        uint32_t crc
        uint32_t size
        uint8_t kind
        uint8_t cache
    struct fanfs_job:
        fuse_req_t req
        int fd
        int64_t entry
        uint32_t skip
        uint32_t count
        int npieces
        fanfs_piece pieces[4]
    int fanfs_pool_start(int nthreads, int errfd)
    int fanfs_pool_submit(fanfs_job *job)
    int fanfs_pool_set_dicts(int n, const char **dicts, const size_t *lens)
    int fanfs_pool_decodes()
    void fanfs_pool_frame_stats(uint64_t *hits, uint64_t *misses)
    void fanfs_pool_stop()
    const char *fanfs_pool_crc_name()
    int64_t fanfs_now_ns()
    int fanfs_spin_receive(fuse_session *se, fuse_buf *buf, int64_t chunk_ns, int64_t until)

FANFS_PATCH = @PATCH_LEVEL@  # fanfs/node/native.py's PATCH_LEVEL, written in by install_pyfuse3


cdef int _fanfs_job_from(tuple job, fanfs_job *j):
    """Fill `j` from a job tuple; 0, or -1 if it is malformed: more pieces than a job holds, a
    piece over FANFS_PIECE_MAX (stored or decoded) or empty, a range outside the pieces, or a
    piece that holds none of the range (a read job names only the pieces it needs). Never
    raises."""
    cdef int i, b
    cdef uint64_t total = 0, first = 0, last = 0
    cdef int n = (len(job) - 4) // 6
    if n < 1 or n > FANFS_MAX_PIECES or len(job) != 4 + 6 * n:
        return -1
    try:
        j.fd, j.entry, j.skip, j.count = job[0], job[1], job[2], job[3]
        j.npieces = n
        for i in range(n):
            b = 4 + 6 * i
            j.pieces[i].off = job[b]
            j.pieces[i].len = job[b + 1]
            j.pieces[i].crc = job[b + 2]
            j.pieces[i].kind = job[b + 3]
            j.pieces[i].size = job[b + 4]
            j.pieces[i].cache = job[b + 5]
            if (j.pieces[i].size == 0 or j.pieces[i].size > FANFS_PIECE_MAX
                    or j.pieces[i].len > FANFS_PIECE_MAX):
                return -1
            total += j.pieces[i].size
    except (TypeError, OverflowError):
        return -1
    if j.skip > total or j.count > total - j.skip:
        return -1
    first = j.pieces[0].size  # the range must start in the first piece, end in the last
    last = total - j.pieces[n - 1].size
    if n > 1 and j.count and (j.skip >= first or j.skip + j.count <= last):
        return -1
    return 0


cdef int _native_read_submit(fuse_req_t req, tuple job):
    """0: queued, the pool answers; -1: the caller answers EIO (a malformed job, a stopped
    pool). Never raises: an exception here would leave the request unanswered."""
    cdef fanfs_job j
    if _fanfs_job_from(job, &j) != 0:
        return -1
    j.req = req
    return fanfs_pool_submit(&j)


def native_read_ahead(tuple job):
    '''Queue a read-ahead: the pool decodes the job's pieces into its frame cache (those not
    held or being decoded already) and answers nobody. False if it was not queued.'''
    cdef fanfs_job j
    if _fanfs_job_from(job, &j) != 0:
        return False
    j.req = NULL
    return fanfs_pool_submit(&j) == 0


def native_read_start(int nthreads, int errfd):
    '''Start the native read pool; raises OSError if it cannot run. Returns the library that
    computes its CRC-32: "isa-l" or "zlib".'''
    cdef int ret = fanfs_pool_start(nthreads, errfd)
    if ret != 0:
        raise OSError(-ret, 'native read pool: ' + os.strerror(-ret))
    return fanfs_pool_crc_name().decode()


def native_read_decodes():
    '''Whether the running pool decodes zstd pieces (libzstd was found).'''
    return bool(fanfs_pool_decodes())


def native_read_dicts(dicts):
    '''Give the pool the image's zstd dictionaries (id i + 1 is dicts[i]); OSError if it
    cannot take them.'''
    cdef int n = len(dicts), i, ret
    cdef const char **ptrs = <const char **>malloc(sizeof(char *) * (n + 1))
    cdef size_t *lens = <size_t *>malloc(sizeof(size_t) * (n + 1))
    kept = [bytes(d) for d in dicts]
    try:
        if ptrs == NULL or lens == NULL:
            raise MemoryError()
        for i in range(n):
            ptrs[i] = <const char *>kept[i]
            lens[i] = len(kept[i])
        ret = fanfs_pool_set_dicts(n, ptrs, lens)
        if ret != 0:
            raise OSError(-ret, 'native read pool dictionaries: ' + os.strerror(-ret))
    finally:
        free(ptrs)
        free(lens)


def native_read_frame_stats():
    '''(hits, misses) of the pool's cache of decoded frames.'''
    cdef uint64_t hits = 0, misses = 0
    fanfs_pool_frame_stats(&hits, &misses)
    return hits, misses


def native_read_stop():
    '''Answer every queued native read, then stop the pool's threads.'''
    with nogil:
        fanfs_pool_stop()



# The session loop's spin (fanfs_read_pool.h): after a request, poll the FUSE fd for up to
# _fanfs_spin_ns before waiting through trio, in chunks of FANFS_SPIN_CHUNK_NS; between chunks
# trio is asked whether another task wants to run, and if so the spin stops (`*busy` set) so
# the loop can let it run first and spin on.
cdef enum:
    FANFS_SPIN_CHUNK_NS = 20000
cdef int64_t _fanfs_spin_ns = 500000  # set_spin_us: how long after a request the loop polls
cdef int64_t _fanfs_last_request = 0
fanfs_spins = [0, 0, 0]  # requests caught by a spin, spins that ended empty, stopped for trio


cdef int _fanfs_spin(fuse_buf *buf, bint *busy):
    cdef int64_t until = _fanfs_last_request + _fanfs_spin_ns
    cdef int res = -errno.EAGAIN
    busy[0] = False
    while fanfs_now_ns() < until and not fuse_session_exited(session):
        stats = trio.lowlevel.current_statistics()
        if stats.tasks_runnable or stats.run_sync_soon_queue_size:
            busy[0] = True
            fanfs_spins[2] += 1
            return res
        with nogil:
            res = fanfs_spin_receive(session, buf, FANFS_SPIN_CHUNK_NS, until)
        if res != -errno.EAGAIN:
            break
    fanfs_spins[0 if res > 0 else 1] += 1
    return res


cdef void _fanfs_request_seen():
    global _fanfs_last_request
    _fanfs_last_request = fanfs_now_ns()


def set_spin_us(int us):
    '''How long after a request the session loop polls for the next one (0: never).'''
    global _fanfs_spin_ns
    _fanfs_spin_ns = max(0, us) * 1000
