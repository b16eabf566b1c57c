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

