# fanfs's hooks in pyfuse3, included in its __init__.pyx by tools/install_pyfuse3.py. Generic:
# nothing here knows fanfs (its read path is its own extension, fanfs/_native.pyx).
#
# - A read hook: a C function registered with set_read_hook(capsule) that a read handler may
#   hand its request to, by returning a tuple instead of bytes; the function answers the
#   request (from any thread) or returns nonzero, and pyfuse3 answers EIO.
# - A fast read hook: a C function registered with set_fast_read_hook(capsule) that is offered
#   every READ (inode, offset, size) before any Python runs; it answers the request itself
#   (returning 0) or declines (nonzero), and the READ goes to the read handler as usual.
# - A receiver: a C function registered with set_receiver(capsule, fd) that takes requests
#   from the FUSE device itself (in threads of its own, answering what it can) and hands the
#   session loop the others: the loop calls it instead of fuse_session_receive_buf and waits
#   for `fd` to become readable instead of the FUSE fd.
# - The session loop's spin (without a receiver): after a request, the loop polls the
#   (non-blocking) FUSE fd for a while before it waits through trio (set_spin_us), since a
#   reader that just sent a request is likely to send the next within microseconds.

from cpython.pycapsule cimport PyCapsule_GetPointer
from libc.stdint cimport int64_t, uint64_t

cdef extern from *:
    """
    #include <fcntl.h>
    #include <sched.h>
    #include <stdlib.h>
    #include <string.h>
    #include <time.h>
    #include <unistd.h>
    typedef int (*pyfuse3_read_hook_t)(void *, void *, uint64_t, PyObject *);
    typedef int (*pyfuse3_fast_read_hook_t)(void *, void *, uint64_t, int64_t, uint64_t);
    typedef int (*pyfuse3_receiver_t)(void *, struct fuse_buf *);

    static int64_t fanfs_now_ns(void) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
    }

    /* Whether threads waited for a CPU in more than a tenth of the last ~100 ms (the kernel's
     * CPU pressure, /proc/pressure/cpu "some"): spinning then takes a core from someone.
     * Read at most every 100 ms; a reading more than 200 ms old is only a new baseline (what
     * happened while the loop was idle says nothing about now). 0 when the kernel has no PSI. */
    static int fanfs_cpu_pressed(void) {
        static int64_t last_ns, last_stall_us = -1;
        static int pressed;
        int64_t now = fanfs_now_ns(), stall_us;
        char buf[256], *at;
        ssize_t n;
        int fd;
        if (now - last_ns < 100000000)
            return pressed;
        fd = open("/proc/pressure/cpu", O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            return pressed = 0;
        n = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (n <= 0)
            return pressed = 0;
        buf[n] = 0;
        at = strstr(buf, "total=");
        if (at == NULL)
            return pressed = 0;
        stall_us = strtoll(at + 6, NULL, 10);
        pressed = last_stall_us >= 0 && now - last_ns <= 200000000 &&
                  (stall_us - last_stall_us) * 1000 * 10 > (now - last_ns);
        last_stall_us = stall_us;
        last_ns = now;
        return pressed;
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
    ctypedef int (*pyfuse3_receiver_t)(void *, fuse_buf *) noexcept nogil
    int64_t fanfs_now_ns() nogil
    int fanfs_cpu_pressed() nogil
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


# The spin: poll for up to _fanfs_spin_ns after a request, in chunks of FANFS_SPIN_CHUNK_NS;
# between chunks trio is asked whether another task wants to run, and if so the spin stops
# (`*busy` set) so the loop lets it run first and spins on.
cdef enum:
    FANFS_SPIN_CHUNK_NS = 20000
cdef int64_t _fanfs_spin_ns = 500000
cdef int64_t _fanfs_last_request = 0
# requests caught by a spin, spins that ended empty, stopped for trio, not tried (CPU wanted)
fanfs_spins = [0, 0, 0, 0]


# Whether to spin: a spin that catches a request saves a wake-up (on a VM an idle CPU halts,
# and waking it costs hundreds of microseconds); one that ends empty burns its window, which
# costs nothing while a CPU is idle but takes a core from the readers while every core is
# wanted (a data loader whose workers decode between two requests, more readers than cores).
# So the loop does not spin while threads are waiting for a CPU (fanfs_cpu_pressed). Whether
# spins catch requests says nothing here: a spinning thread that is preempted for a few
# milliseconds "catches" the next request when it runs again.
cdef int _fanfs_spin(fuse_buf *buf, bint *busy):
    cdef int64_t until = _fanfs_last_request + _fanfs_spin_ns
    cdef int res = -errno.EAGAIN
    cdef bint resumed = busy[0]  # called again after trio ran: the same spin goes on
    busy[0] = False
    if _receiver != NULL:  # the receiver's threads wait for requests: no spin
        return res
    if not resumed and fanfs_cpu_pressed():
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
    return res


cdef void _fanfs_request_seen():
    global _fanfs_last_request
    _fanfs_last_request = fanfs_now_ns()


def set_spin_us(int us):
    '''How long after a request the session loop polls for the next one (0: never).'''
    global _fanfs_spin_ns
    _fanfs_spin_ns = max(0, us) * 1000
