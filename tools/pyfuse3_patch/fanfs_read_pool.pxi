# fanfs's native read pool (fanfs_read_pool.h), included at the end of pyfuse3's __init__.pyx
# by tools/install_pyfuse3.py. A read handler that returns a tuple
# (fd, offset, length, crc, entry, skip, count) instead of bytes hands the request to the pool,
# which reads, checks and answers it without the GIL (see fuse_read_async).

from libc.stdint cimport int64_t

cdef extern from "fanfs_read_pool.h" nogil:
    int fanfs_pool_start(int nthreads, int errfd)
    int fanfs_pool_submit(fuse_req_t req, int fd, int64_t off, uint32_t len, uint32_t crc,
                          int64_t entry, uint32_t skip, uint32_t count)
    void fanfs_pool_stop()
    const char *fanfs_pool_crc_name()
    int64_t fanfs_now_ns()
    int fanfs_spin_receive(fuse_session *se, fuse_buf *buf, int64_t chunk_ns, int64_t until)

FANFS_PATCH = @PATCH_LEVEL@  # fanfs/native.py's PATCH_LEVEL, written in by install_pyfuse3


cdef int _native_read_submit(fuse_req_t req, tuple job):
    return fanfs_pool_submit(req, job[0], job[1], job[2], job[3], job[4], job[5], job[6])


def native_read_start(int nthreads, int errfd):
    '''Start the native read pool; raises OSError if it cannot run. Returns the library that
    computes its CRC-32: "isa-l" or "zlib".'''
    cdef int ret = fanfs_pool_start(nthreads, errfd)
    if ret != 0:
        raise OSError(-ret, 'native read pool: ' + os.strerror(-ret))
    return fanfs_pool_crc_name().decode()


def native_read_stop():
    '''Answer every queued native read, then stop the pool's threads.'''
    with nogil:
        fanfs_pool_stop()



# The session loop's spin (fanfs_read_pool.h): after a request, poll the FUSE fd for up to
# FANFS_SPIN_NS before waiting through trio, in chunks of FANFS_SPIN_CHUNK_NS; between chunks
# trio is asked whether another task wants to run, and if so the spin stops (`*busy` set) so
# the loop can let it run first and spin on.
cdef enum:
    FANFS_SPIN_NS = 200000
    FANFS_SPIN_CHUNK_NS = 20000
cdef int64_t _fanfs_last_request = 0
fanfs_spins = [0, 0, 0]  # requests caught by a spin, spins that ended empty, stopped for trio


cdef int _fanfs_spin(fuse_buf *buf, bint *busy):
    cdef int64_t until = _fanfs_last_request + FANFS_SPIN_NS
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
