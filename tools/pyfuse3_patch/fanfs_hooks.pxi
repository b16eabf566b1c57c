# fanfs's hooks in pyfuse3, included in its __init__.pyx by tools/install_pyfuse3.py. Generic:
# nothing here knows fanfs (its read path is its own extension, fanfs/_native.pyx).
#
# - A read hook: a C function registered with set_read_hook(capsule) that a read handler may
#   hand its request to, by returning a tuple instead of bytes; the function answers the
#   request (from any thread) or returns nonzero, and pyfuse3 answers EIO.
# - A fast read hook: a C function registered with set_fast_read_hook(capsule) that is offered
#   every READ (inode, offset, size) before any Python runs; it answers the request itself
#   (returning 0) or declines (nonzero), and the READ goes to the read handler as usual.
# - The session loop's spin: after a request, the loop polls the (non-blocking) FUSE fd for a
#   while before it waits through trio (set_spin_us), since a reader that just sent a request
#   is likely to send the next within microseconds.

from cpython.pycapsule cimport PyCapsule_GetPointer
from libc.stdint cimport int64_t, uint64_t

cdef extern from *:
    """
    #include <sched.h>
    #include <time.h>
    typedef int (*pyfuse3_read_hook_t)(void *, void *, uint64_t, PyObject *);
    typedef int (*pyfuse3_fast_read_hook_t)(void *, void *, uint64_t, int64_t, uint64_t);

    static int64_t fanfs_now_ns(void) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
    }

    /* Poll `se` until a request arrives (its size), `until` passes or `chunk_ns` have been
     * spent (-EAGAIN), or an error. Called without the GIL. */
    static int fanfs_spin_receive(struct fuse_session *se, struct fuse_buf *buf,
                                  int64_t chunk_ns, int64_t until) {
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
    """
    ctypedef int (*pyfuse3_read_hook_t)(void *, void *, uint64_t, object) noexcept
    ctypedef int (*pyfuse3_fast_read_hook_t)(void *, void *, uint64_t, int64_t, uint64_t) noexcept
    int64_t fanfs_now_ns() nogil
    int fanfs_spin_receive(fuse_session *se, fuse_buf *buf, int64_t chunk_ns, int64_t until) nogil

FANFS_PATCH = @PATCH_LEVEL@  # written in by tools/install_pyfuse3.py

cdef pyfuse3_read_hook_t _read_hook = NULL
_read_hook_capsule = None  # kept alive while registered


def set_read_hook(capsule):
    '''Register the C function a read handler hands its request to by returning a tuple:
    `int hook(void *session, void *req, uint64_t ino, PyObject *reply)`, in a capsule named
    "pyfuse3.read_hook", called with the GIL; 0 means it answers the request. None removes it.'''
    global _read_hook, _read_hook_capsule
    if capsule is None:
        _read_hook = NULL
    else:
        _read_hook = <pyfuse3_read_hook_t>PyCapsule_GetPointer(capsule, b"pyfuse3.read_hook")
    _read_hook_capsule = capsule


cdef int _hand_to_hook(fuse_req_t req, uint64_t ino, object reply):
    '''0: the hook took the request; -1: the caller answers EIO. Never raises.'''
    if _read_hook == NULL:
        return -1
    return _read_hook(<void *>session, <void *>req, ino, reply)


cdef pyfuse3_fast_read_hook_t _fast_read_hook = NULL
_fast_read_hook_capsule = None


def set_fast_read_hook(capsule):
    '''Register the C function offered every READ before Python sees it:
    `int hook(void *session, void *req, uint64_t ino, int64_t off, uint64_t size)`, in a
    capsule named "pyfuse3.fast_read_hook", called with the GIL; 0 means it answers the
    request, anything else that the read handler does. None removes it.'''
    global _fast_read_hook, _fast_read_hook_capsule
    if capsule is None:
        _fast_read_hook = NULL
    else:
        _fast_read_hook = <pyfuse3_fast_read_hook_t>PyCapsule_GetPointer(
            capsule, b"pyfuse3.fast_read_hook")
    _fast_read_hook_capsule = capsule


cdef inline int _fast_read(fuse_req_t req, uint64_t ino, int64_t off, uint64_t size):
    '''0: the fast hook took the request.'''
    if _fast_read_hook == NULL:
        return -1
    return _fast_read_hook(<void *>session, <void *>req, ino, off, size)


# The spin: poll for up to _fanfs_spin_ns after a request, in chunks of FANFS_SPIN_CHUNK_NS;
# between chunks trio is asked whether another task wants to run, and if so the spin stops
# (`*busy` set) so the loop lets it run first and spins on.
cdef enum:
    FANFS_SPIN_CHUNK_NS = 20000
cdef int64_t _fanfs_spin_ns = 500000
cdef int64_t _fanfs_last_request = 0
# requests caught by a spin, spins that ended empty, stopped for trio, not tried (not paying)
fanfs_spins = [0, 0, 0, 0]


# Whether spinning pays, learnt as it goes: a spin that catches a request saved a wake-up, one
# that ends empty burnt its whole window on a core the readers may need (a data loader whose
# workers decode for milliseconds between two requests). `_fanfs_spin_score` is the recent
# share of spins that caught (in 1/256, moving 1/8 of the way each time); below a half the
# loop does not spin, except one request in FANFS_SPIN_PROBE, to notice when it pays again.
cdef enum:
    FANFS_SPIN_PROBE = 16
cdef int _fanfs_spin_score = 256
cdef int _fanfs_spin_skipped = 0


cdef inline void _fanfs_spin_learn(bint caught):
    global _fanfs_spin_score
    _fanfs_spin_score += ((256 if caught else 0) - _fanfs_spin_score) // 8


cdef int _fanfs_spin(fuse_buf *buf, bint *busy):
    global _fanfs_spin_skipped
    cdef int64_t until = _fanfs_last_request + _fanfs_spin_ns
    cdef int res = -errno.EAGAIN
    cdef bint resumed = busy[0]  # called again after trio ran: the same spin goes on
    busy[0] = False
    if _fanfs_spin_score < 128 and not resumed:
        _fanfs_spin_skipped += 1
        if _fanfs_spin_skipped % FANFS_SPIN_PROBE:
            fanfs_spins[3] += 1
            return res
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
    _fanfs_spin_learn(res > 0)
    return res


cdef void _fanfs_request_seen():
    global _fanfs_last_request
    _fanfs_last_request = fanfs_now_ns()


def set_spin_us(int us):
    '''How long after a request the session loop polls for the next one (0: never).'''
    global _fanfs_spin_ns
    _fanfs_spin_ns = max(0, us) * 1000
