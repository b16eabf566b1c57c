/*
 * The front (fanfs_native.h, front.h): threads that take FUSE requests from the kernel
 * themselves and answer those the catalog and this node's disk alone answer (answer.c), with
 * no Python and no event loop between the kernel and the disk; the rest is forwarded to
 * pyfuse3's session loop (forward.c).
 *
 * Why: a request answered through pyfuse3 costs a wake-up of the event loop (epoll, trio), a
 * run through its session loop and, for a READ, a hand-off to a pool thread; on a cold small
 * file that is most of what fanfs adds to the disk read.
 *
 * Taking requests: a leader and its followers. One thread at a time, the leader, takes
 * requests from the device; the others wait for their turn (`turn`). The leader answers what
 * cannot block (a lookup, attributes, a forward) and goes on leading; before a READ, which may
 * wait for the disk, it hands the lead to a follower. So the thread that takes a request is
 * the one that answers it (no hand-off between threads on the way to the disk), several READs
 * are read at once, and only one thread waits on the device. After a request the leader polls
 * the device for a while before it sleeps (FANFS_SPIN_US): the next request of a reader
 * usually comes within microseconds, and on a VM a halted CPU costs hundreds of microseconds
 * to wake. It does not poll while threads wait for a CPU (cpu.c): then polling takes a core
 * from the readers.
 *
 * Life: the owner (the wing's main thread) sets the front up before start (the catalog, writes
 * mode, the tests' pretend), starts it on the session's fd, and stops it: fanfs_front_stop
 * wakes the followers (`turn`) and the leader (an eventfd its epoll also watches), joins them,
 * writes what is queued behind and fails what is forwarded and not taken. The FUSE fd is the
 * session's and stays open until pyfuse3 closes it, after the stop.
 */
#define _GNU_SOURCE
#define FUSE_USE_VERSION 35
#include <errno.h>
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <linux/fuse.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "front.h"

/* The leader's polling since *spun (if it polled) goes to the budget. */
static void spun_for(struct fanfs_front *f, int64_t *spun) {
    if (*spun != 0)
        __atomic_add_fetch(&f->budget.spin_ns, (uint64_t)(fanfs_now_ns() - *spun),
                           __ATOMIC_RELAXED);
    *spun = 0;
}

/* As the leader: the next request into `buf` (f->bufsize), 0 to stop, -1 once the session has
 * ended (unmounted, or the kernel refused the buffer: the wire's `why` says so). */
static ssize_t take(struct fanfs_front *f, char *buf) {
    struct epoll_event ev[2];
    int64_t until = f->last_ns + f->spin_ns;
    int spin = f->spin_ns > 0 && !fanfs_cpu_pressed();
    int64_t spun = 0; /* when this call began polling (0: it has not) */
    for (;;) {
        ssize_t n;
        int i, got;
        /* A stop ends the taking at once, not at the next pause of a steady stream: what is
         * still in the device is pyfuse3's again (the output wing's loop runs on), or the
         * unmount's, which fails it (the dataset wing, whose loop has ended). */
        if (__atomic_load_n(&f->stopping, __ATOMIC_ACQUIRE))
            return 0;
        n = read(f->fd, buf, f->bufsize);
        if (n > 0) {
            f->last_ns = fanfs_now_ns();
            spun_for(f, &spun);
            return n;
        }
        if (n < 0 && (errno == EINTR || errno == ENOENT))
            continue; /* ENOENT: a request interrupted before it was read */
        if (n < 0 && errno == EINVAL) /* smaller than a WRITE of max_write: libfuse fails too */
            __atomic_store_n(&f->wire.why, FANFS_FRONT_WHY_BUFFER, __ATOMIC_RELAXED);
        if (n == 0 || errno != EAGAIN)
            return -1; /* ENODEV: unmounted */
        if (__atomic_load_n(&f->stopping, __ATOMIC_ACQUIRE))
            return 0;
        if (spin) {
            int64_t now = fanfs_now_ns();
            if (now < until) {
                spun = spun ? spun : now;
                sched_yield();
                continue;
            }
        }
        spun_for(f, &spun);
        got = epoll_wait(f->ep, ev, 2, -1);
        for (i = 0; i < got; i++)
            if (ev[i].data.fd == f->stopfd)
                return 0;
        __atomic_add_fetch(&f->waits, 1, __ATOMIC_RELAXED);
    }
}

/* Give up the lead (`f->lock` held): a follower takes it. */
static void hand_lead_locked(struct fanfs_front *f, int all) {
    f->led = 0;
    if (all)
        pthread_cond_broadcast(&f->turn);
    else
        pthread_cond_signal(&f->turn);
}

static void *front_main(void *arg) {
    struct fanfs_front *f = arg;
    /* Writes mode: a buffer of the writes' arena, which a WRITE swaps for a spare. */
    char *buf = f->writes ? fanfs_writes_buffer(&f->wb) : malloc(f->bufsize);
    int leading = 0, traced;
    prctl(PR_SET_NAME, "fanfs-front", 0, 0, 0);
    if (buf == NULL)
        return NULL;
    for (;;) {
        const struct fuse_in_header *in = (const void *)buf;
        ssize_t n;
        if (!leading) {
            pthread_mutex_lock(&f->lock);
            while (f->led && !f->stopping)
                pthread_cond_wait(&f->turn, &f->lock);
            leading = !f->stopping;
            f->led |= leading;
            pthread_mutex_unlock(&f->lock);
            if (!leading)
                break;
        }
        n = take(f, buf);
        if (n <= 0) {
            if (n < 0)
                fanfs_front_end_session(f);
            pthread_mutex_lock(&f->lock);
            hand_lead_locked(f, 1);
            pthread_mutex_unlock(&f->lock);
            break;
        }
        traced = (size_t)n >= sizeof *in && in->opcode == FUSE_READ;
        if (traced) {
            fanfs_budget_begin(f->last_ns);
            pthread_mutex_lock(&f->lock); /* a READ may wait for the disk: lead on, someone */
            hand_lead_locked(f, 0);
            pthread_mutex_unlock(&f->lock);
            leading = 0;
            fanfs_mark(FANFS_STAGE_LEAD);
        }
        fanfs_front_handle(f, &buf, n);
        if (traced) /* answered, it was added and ended; forwarded, its trace is dropped */
            fanfs_budget_end(&f->budget, 0);
    }
    if (!f->writes)
        free(buf);
    return NULL;
}

/* -- life ------------------------------------------------------------------------------------ */

static void close_fds(struct fanfs_front *f) {
    if (f->stopfd >= 0)
        close(f->stopfd);
    if (f->readyfd >= 0)
        close(f->readyfd);
    if (f->ep >= 0)
        close(f->ep);
    f->stopfd = f->readyfd = f->ep = -1;
}

static int watch(struct fanfs_front *f, int fd) {
    struct epoll_event ev;
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    return epoll_ctl(f->ep, EPOLL_CTL_ADD, fd, &ev) != 0 ? -errno : 0;
}

static int front_start(struct fanfs_front *f, int fd, int nthreads, int spin_us) {
    sigset_t all, old;
    int i, err = 0, keepfd = f->keepfd;
    f->keepfd = -1; /* used by this start only, whatever it ends in: its owner may close it */
    if (f->running)
        return -EBUSY;
    if (nthreads < 1 || nthreads > FRONT_MAX_THREADS || (f->m.n == 0 && !f->writes) ||
        spin_us < 0)
        return -EINVAL;
    /* Non-blocking: the leader polls it, and must never sleep in a read that a stop cannot
     * wake (pyfuse3's loop makes it so too, but only once it runs). */
    if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) != 0)
        return -errno;
    f->fd = fd;
    f->ended = f->stopping = f->led = f->draining = 0;
    fanfs_wire_reset(&f->wire);
    f->bufsize = fanfs_wire_bufsize(&f->wire);
    f->spin_ns = (int64_t)spin_us * 1000;
    f->stopfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    f->readyfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    f->ep = epoll_create1(EPOLL_CLOEXEC);
    if (f->stopfd < 0 || f->readyfd < 0 || f->ep < 0) {
        err = -errno;
        goto fail;
    }
    if ((err = watch(f, fd)) != 0 || (err = watch(f, f->stopfd)) != 0)
        goto fail;
    if (f->writes && (err = fanfs_writes_start(&f->wb, f->bufsize, nthreads, keepfd)) != 0)
        goto fail;
    sigfillset(&all); /* signals stay with the interpreter's thread */
    pthread_sigmask(SIG_BLOCK, &all, &old);
    for (i = 0; i < nthreads; i++) {
        if (pthread_create(&f->threads[i], NULL, front_main, f) != 0)
            break;
        f->nthreads++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (f->nthreads == 0) {
        fanfs_writes_stop(&f->wb);
        err = -EAGAIN;
        goto fail;
    }
    f->running = 1;
    return f->readyfd;
fail:
    close_fds(f);
    return err;
}

static void front_stop(struct fanfs_front *f) {
    uint64_t one = 1;
    ssize_t w;
    int i;
    if (!f->running)
        return;
    pthread_mutex_lock(&f->lock);
    __atomic_store_n(&f->stopping, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&f->turn);
    pthread_mutex_unlock(&f->lock);
    w = write(f->stopfd, &one, sizeof one); /* the leader, asleep in epoll */
    (void)w;
    for (i = 0; i < f->nthreads; i++)
        pthread_join(f->threads[i], NULL);
    f->nthreads = 0;
    fanfs_writes_stop(&f->wb); /* what is queued goes into its files first */
    fanfs_front_drain_queue(f);
    pthread_mutex_lock(&f->lock);
    f->running = 0;
    w = write(f->readyfd, &one, sizeof one); /* wake a loop task waiting for the queue */
    (void)w;
    pthread_mutex_unlock(&f->lock);
    close(f->stopfd);
    close(f->ep);
    f->stopfd = f->ep = -1;
}

static void front_close(struct fanfs_front *f) {
    if (f->running || f->readyfd < 0)
        return;
    close(f->readyfd);
    f->readyfd = -1;
}

static void front_counters(struct fanfs_front *f, uint64_t out[FANFS_FRONT_COUNTS + 1]) {
    int i;
    for (i = 0; i < FANFS_FRONT_COUNTS; i++)
        out[i] = __atomic_load_n(&f->counts[i], __ATOMIC_RELAXED);
    out[FANFS_FRONT_WAITS] = __atomic_load_n(&f->waits, __ATOMIC_RELAXED);
}

/* -- a wing's front (fanfs_native.h's calls) ---------------------------------------------- */

struct fanfs_front *fanfs_front_new(const struct fanfs_meta *m, int writes) {
    struct fanfs_front *f;
    if ((m == NULL || m->n == 0) && !writes)
        return NULL;
    if ((f = calloc(1, sizeof *f)) == NULL)
        return NULL;
    if (m != NULL)
        f->m = *m;
    f->writes = writes != 0;
    f->fd = f->stopfd = f->readyfd = f->ep = f->keepfd = -1;
    pthread_mutex_init(&f->lock, NULL);
    pthread_cond_init(&f->turn, NULL);
    fanfs_follow_init(&f->follow);
    fanfs_writes_init(&f->wb);
    return f;
}

/* pyfuse3's receiver hook takes no argument of ours, and pyfuse3 runs one session per
 * process: the front it reads from is this one pointer (atomic), bound by the wing that owns
 * the front before it installs the hook and unbound when the front is freed. The only
 * file-scope state of the front. */
static struct fanfs_front *bound;

void fanfs_front_bind(struct fanfs_front *f) { __atomic_store_n(&bound, f, __ATOMIC_RELEASE); }

int fanfs_front_receive(void *session, struct fuse_buf *buf) {
    struct fanfs_front *f = __atomic_load_n(&bound, __ATOMIC_ACQUIRE);
    if (f != NULL)
        return fanfs_front_receive_from(f, session, buf);
    if (session != NULL)
        fuse_session_exit(session); /* no front: as if the session had ended */
    return 0;
}

void fanfs_front_free(struct fanfs_front *f) {
    struct fanfs_front *was = f;
    if (f == NULL)
        return;
    __atomic_compare_exchange_n(&bound, &was, NULL, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    front_stop(f);
    front_close(f);
    fanfs_writes_destroy(&f->wb);
    fanfs_follow_destroy(&f->follow);
    pthread_cond_destroy(&f->turn);
    pthread_mutex_destroy(&f->lock);
    free(f);
}

int fanfs_front_pretend(struct fanfs_front *f, int minor, long page) {
    if (f->running)
        return -EBUSY;
    if (minor < 0 || page < 0 || (page & (page - 1)) != 0 || page > (1L << 20))
        return -EINVAL;
    f->wire.pretend = minor;
    f->wire.page = page;
    return 0;
}

int fanfs_front_keep_writes(struct fanfs_front *f, int fd) {
    if (f->running)
        return -EBUSY;
    if (!f->writes || fd < 0)
        return -EINVAL;
    f->keepfd = fd;
    return 0;
}

size_t fanfs_front_bufsize(const struct fanfs_front *f) { return fanfs_wire_bufsize(&f->wire); }

void fanfs_front_kernel(const struct fanfs_front *f, uint64_t out[5]) {
    fanfs_wire_said(&f->wire, out);
    out[4] = fanfs_front_bufsize(f);
}

int fanfs_front_start(struct fanfs_front *f, int fd, int nthreads, int spin_us) {
    return front_start(f, fd, nthreads, spin_us);
}

ssize_t fanfs_front_forwarded(struct fanfs_front *f, void *out, size_t cap) {
    struct fuse_buf b;
    if (cap < f->bufsize)
        return -EINVAL;
    memset(&b, 0, sizeof b);
    b.mem = out;
    return fanfs_front_receive_from(f, NULL, &b);
}

void fanfs_front_drain(struct fanfs_front *f) { fanfs_front_drain_queue(f); }
void fanfs_front_stop(struct fanfs_front *f) { front_stop(f); }
void fanfs_front_close(struct fanfs_front *f) { front_close(f); }

void fanfs_front_counters(struct fanfs_front *f, uint64_t out[FANFS_FRONT_COUNTS + 1]) {
    front_counters(f, out);
}

int fanfs_front_latencies(struct fanfs_front *f, uint32_t out[FANFS_FRONT_SAMPLES],
                          uint32_t *longest) {
    return fanfs_latency_take(&f->lat, out, longest);
}

void fanfs_front_budget(struct fanfs_front *f, uint64_t out[FANFS_BUDGET_LEN]) {
    fanfs_budget_take(&f->budget, out);
}

void fanfs_front_follow(struct fanfs_front *f, int efd) { fanfs_follow_set(&f->follow, efd); }

int fanfs_front_followed(struct fanfs_front *f, uint64_t *out, int max, uint64_t *lost) {
    return fanfs_follow_take(&f->follow, out, max, lost);
}

int64_t fanfs_front_take_written(struct fanfs_front *f, int fd) {
    return fanfs_writes_take_written(&f->wb, fd);
}
int fanfs_front_take_error(struct fanfs_front *f, int fd) {
    return fanfs_writes_take_error(&f->wb, fd);
}
void fanfs_front_hold(struct fanfs_front *f, int fd, uint64_t below) {
    fanfs_writes_hold(&f->wb, fd, below);
}
void fanfs_front_settle(struct fanfs_front *f) { fanfs_writes_settle(&f->wb); }
uint64_t fanfs_front_written(struct fanfs_front *f) { return fanfs_writes_written(&f->wb); }
