# fanfs's hooks in pyfuse3, included in its __init__.pyx by tools/install_pyfuse3.py. Generic:
# nothing here knows fanfs (its read path is its own extension, fanfs/_native.pyx).
#
# - A read hook: a C function registered with set_read_hook(capsule) that a read handler may
#   hand its request to, by returning a tuple instead of bytes; the function answers the
#   request (from any thread) or returns nonzero, and pyfuse3 answers EIO.
# - A receiver: a C function registered with set_receiver(capsule, fd) that takes requests
#   from the FUSE device itself (in threads of its own, answering what it can) and hands the
#   session loop the others: the loop calls it instead of fuse_session_receive_buf and waits
#   for `fd` to become readable instead of the FUSE fd.
# - session_fileno(): the FUSE session's fd, for such a receiver.
# - set_background(n): the kernel's limit of requests in the background (its readahead READs
#   among them) that the next session's INIT asks for.

from cpython.pycapsule cimport PyCapsule_GetPointer
from libc.stdint cimport uint64_t

cdef extern from *:
    """
    typedef int (*pyfuse3_read_hook_t)(void *, void *, uint64_t, PyObject *);
    typedef int (*pyfuse3_receiver_t)(void *, struct fuse_buf *);
    """
    ctypedef int (*pyfuse3_read_hook_t)(void *, void *, uint64_t, object) noexcept
    ctypedef int (*pyfuse3_receiver_t)(void *, fuse_buf *) noexcept nogil

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


cdef pyfuse3_receiver_t _receiver = NULL
cdef int _receiver_fd = -1
_receiver_capsule = None


def set_receiver(capsule, int fd=-1):
    '''Register the C function that takes requests from the FUSE device itself:
    `int receive(void *session, struct fuse_buf *buf)`, in a capsule named "pyfuse3.receiver",
    called without the GIL: the size of the request it put in `buf` (whose `mem`, when NULL,
    it allocates with malloc, of libfuse's buffer size), -EAGAIN when it has none, 0 once the
    session has ended. The session loop waits for `fd` to become readable before it calls it
    again. None goes back to reading the FUSE device (wake the loop through `fd` after it).'''
    global _receiver, _receiver_fd, _receiver_capsule
    if capsule is None:
        _receiver = NULL
        _receiver_fd = -1
    else:
        _receiver = <pyfuse3_receiver_t>PyCapsule_GetPointer(capsule, b"pyfuse3.receiver")
        _receiver_fd = fd
    _receiver_capsule = capsule


cdef int _fanfs_receive(fuse_buf *buf):
    cdef int res
    if _receiver == NULL:
        return fuse_session_receive_buf(session, buf)
    with nogil:
        res = _receiver(<void *>session, buf)
    return res


cdef int _fanfs_wait_fd():
    return _receiver_fd if _receiver != NULL else session_fd


def session_fileno():
    '''The FUSE session's fd (-1 without a session).'''
    return session_fd if session != NULL else -1


def _fanfs_notify_closing():
    if _receiver != NULL:
        trio.lowlevel.notify_closing(_receiver_fd)


cdef unsigned _background = 0


def set_background(unsigned n):
    '''How many requests the kernel may keep in the background (readahead READs, which it
    sends asynchronously) that the next mount's INIT asks for; it stops async readahead at
    three quarters of it (the congestion threshold). 0: the kernel's own (12, and 9). The kernel
    caps both at the fuse module's max_user_bgreq and max_user_congthresh for a mount by a
    user without CAP_SYS_ADMIN.'''
    global _background
    _background = n


cdef void _fanfs_init(fuse_conn_info *conn):
    if _background:
        conn.max_background = _background
        conn.congestion_threshold = max(_background * 3 // 4, 1)
