/* fanfs-floor: the least a FUSE file system in user space does to serve a directory's files,
 * measured beside fanfs by `fanfs bench --against floor` (fanfs/bench/floor.py builds it).
 *
 * What separates fanfs from a native read is, for a large part, FUSE's own: a round trip per
 * request, and the kernel's copy of each reply into the mount's page cache. This server does
 * nothing else. It answers every request from a file of SRC, on libfuse's multi-threaded loop,
 * with no catalog, no staging, no check, no cache of its own:
 *   LOOKUP    openat() the name under its directory's descriptor; the node keeps that
 *             descriptor, so no later request opens anything. Entries and attributes are
 *             cached by the kernel "forever", as fanfs's are (nothing here changes them).
 *   OPEN      ENOSYS where the kernel offers zero-message opens (Linux 4.19+), as fanfs does:
 *             the kernel then sends no OPEN, no RELEASE, and keeps the pages. Elsewhere an open
 *             that keeps the cache.
 *   FLUSH     ENOSYS: the kernel stops sending it (a read-only mount has nothing to flush).
 *   READ      pread() of the node's descriptor into the thread's buffer, replied whole.
 *   GETATTR, READDIR, READLINK: from the descriptors, for `ls` and tests.
 * SIGUSR1 drops the kernel's pages of every file it knows (a cold pass; fanfs's `fanfs drop`
 * does the same for its mount) and then writes "dropped\n" to standard output. Directory
 * entries stay, as they do for fanfs's cold passes.
 *
 * Two ways to take requests:
 *   (default) libfuse's multi-threaded loop: each thread sleeps in read() on the device until
 *             a request comes, as C file systems on libfuse do.
 *   --poll    one thread that, after answering, polls the device (non-blocking reads) for
 *             POLL_NS before it sleeps in poll(): the request that follows an answer at once,
 *             as one reader's next file does, is taken with no sleep and no wake-up. This is
 *             what fanfs's front does between requests (FANFS_SPIN_US), with nothing else.
 *             One thread: requests are answered one at a time.
 *
 * Usage: fanfs-floor [--poll] SRC MOUNTPOINT. It stays in the foreground; SIGTERM or an
 * unmount ends it.
 */
#define FUSE_USE_VERSION 31
#define _GNU_SOURCE
#include <fuse_lowlevel.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* The image cannot change under the mount: the kernel may keep entries and attributes. */
#define FOREVER (365.0 * 24 * 3600)
/* --poll: how long the device is polled after an answer, fanfs's FANFS_SPIN_US default. */
#define POLL_NS 500000

struct node {
    int fd;              /* O_RDONLY (files, directories) or O_PATH (anything else) */
    int is_file;
    uint64_t nlookup;    /* the kernel's references, LOOKUPs less FORGETs */
    struct node *prev, *next;
};

static int root_fd = -1;
static int no_open;      /* the kernel took zero-message opens */
static struct fuse_session *session;
static pthread_mutex_t nodes_lock = PTHREAD_MUTEX_INITIALIZER;
static struct node nodes = {.prev = &nodes, .next = &nodes};  /* every live node */
static pthread_key_t buf_key;

struct buf { size_t cap; char bytes[]; };

static int fd_of(fuse_ino_t ino)
{
    return ino == FUSE_ROOT_ID ? root_fd : ((struct node *)(uintptr_t)ino)->fd;
}

static void floor_init(void *userdata, struct fuse_conn_info *conn)
{
    (void)userdata;
    no_open = (conn->capable & FUSE_CAP_NO_OPEN_SUPPORT) != 0;
}

static void floor_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    struct fuse_entry_param e;
    memset(&e, 0, sizeof e);
    int fd = openat(fd_of(parent), name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0 && (errno == ELOOP || errno == ENXIO || errno == EACCES))
        fd = openat(fd_of(parent), name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        fuse_reply_err(req, errno);
        return;
    }
    struct node *n = calloc(1, sizeof *n);
    if (n == NULL || fstatat(fd, "", &e.attr, AT_EMPTY_PATH) < 0) {
        int err = n == NULL ? ENOMEM : errno;
        free(n);
        close(fd);
        fuse_reply_err(req, err);
        return;
    }
    n->fd = fd;
    n->is_file = S_ISREG(e.attr.st_mode);
    n->nlookup = 1;
    pthread_mutex_lock(&nodes_lock);
    n->next = nodes.next;
    n->prev = &nodes;
    nodes.next->prev = n;
    nodes.next = n;
    pthread_mutex_unlock(&nodes_lock);
    e.ino = (fuse_ino_t)(uintptr_t)n;
    e.attr_timeout = e.entry_timeout = FOREVER;
    if (fuse_reply_entry(req, &e) != 0) { /* the kernel did not take it: no reference */
        pthread_mutex_lock(&nodes_lock);
        n->prev->next = n->next;
        n->next->prev = n->prev;
        pthread_mutex_unlock(&nodes_lock);
        close(fd);
        free(n);
    }
}

static void forget_one(fuse_ino_t ino, uint64_t count)
{
    if (ino == FUSE_ROOT_ID)
        return;
    struct node *n = (struct node *)(uintptr_t)ino;
    pthread_mutex_lock(&nodes_lock);
    n->nlookup -= count < n->nlookup ? count : n->nlookup;
    int gone = n->nlookup == 0;
    if (gone) {
        n->prev->next = n->next;
        n->next->prev = n->prev;
    }
    pthread_mutex_unlock(&nodes_lock);
    if (gone) {
        close(n->fd);
        free(n);
    }
}

static void floor_forget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup)
{
    forget_one(ino, nlookup);
    fuse_reply_none(req);
}

static void floor_forget_multi(fuse_req_t req, size_t count, struct fuse_forget_data *forgets)
{
    for (size_t i = 0; i < count; i++)
        forget_one(forgets[i].ino, forgets[i].nlookup);
    fuse_reply_none(req);
}

static void floor_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)fi;
    struct stat st;
    if (fstatat(fd_of(ino), "", &st, AT_EMPTY_PATH) < 0)
        fuse_reply_err(req, errno);
    else
        fuse_reply_attr(req, &st, FOREVER);
}

static void floor_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)ino;
    if ((fi->flags & O_ACCMODE) != O_RDONLY) {
        fuse_reply_err(req, EROFS);
        return;
    }
    if (no_open) {
        fuse_reply_err(req, ENOSYS);
        return;
    }
    fi->keep_cache = 1;
    fuse_reply_open(req, fi);
}

static void floor_flush(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)ino;
    (void)fi;
    fuse_reply_err(req, ENOSYS);
}

static void floor_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                       struct fuse_file_info *fi)
{
    (void)fi;
    struct buf *b = pthread_getspecific(buf_key);
    if (b == NULL || b->cap < size) {
        free(b);
        b = malloc(sizeof *b + size);
        pthread_setspecific(buf_key, b);
        if (b == NULL) {
            fuse_reply_err(req, ENOMEM);
            return;
        }
        b->cap = size;
    }
    ssize_t got = pread(fd_of(ino), b->bytes, size, off);
    if (got < 0)
        fuse_reply_err(req, errno);
    else
        fuse_reply_buf(req, b->bytes, (size_t)got);
}

static void floor_readlink(fuse_req_t req, fuse_ino_t ino)
{
    char target[4097];
    ssize_t got = readlinkat(fd_of(ino), "", target, sizeof target - 1);
    if (got < 0) {
        fuse_reply_err(req, errno);
        return;
    }
    target[got] = '\0';
    fuse_reply_readlink(req, target);
}

static void floor_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    int fd = openat(fd_of(ino), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *dir = fd < 0 ? NULL : fdopendir(fd);
    if (dir == NULL) {
        int err = errno;
        if (fd >= 0)
            close(fd);
        fuse_reply_err(req, err);
        return;
    }
    fi->fh = (uint64_t)(uintptr_t)dir;
    fuse_reply_open(req, fi);
}

static void floor_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                          struct fuse_file_info *fi)
{
    (void)ino;
    DIR *dir = (DIR *)(uintptr_t)fi->fh;
    char *out = malloc(size);
    if (out == NULL) {
        fuse_reply_err(req, ENOMEM);
        return;
    }
    seekdir(dir, off);
    size_t used = 0;
    for (;;) {
        errno = 0;
        struct dirent *d = readdir(dir);
        if (d == NULL)
            break;
        struct stat st = {.st_ino = d->d_ino, .st_mode = (mode_t)d->d_type << 12};
        size_t need = fuse_add_direntry(req, out + used, size - used, d->d_name, &st, telldir(dir));
        if (need > size - used)
            break;
        used += need;
    }
    if (errno != 0 && used == 0)
        fuse_reply_err(req, errno);
    else
        fuse_reply_buf(req, out, used);
    free(out);
}

static void floor_releasedir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)ino;
    closedir((DIR *)(uintptr_t)fi->fh);
    fuse_reply_err(req, 0);
}

static const struct fuse_lowlevel_ops ops = {
    .init = floor_init,
    .lookup = floor_lookup,
    .forget = floor_forget,
    .forget_multi = floor_forget_multi,
    .getattr = floor_getattr,
    .open = floor_open,
    .flush = floor_flush,
    .read = floor_read,
    .readlink = floor_readlink,
    .opendir = floor_opendir,
    .readdir = floor_readdir,
    .releasedir = floor_releasedir,
};

/* SIGUSR1, taken by this thread alone (the others block it): drop the pages of every file the
 * kernel knows. The ids are copied first: invalidating may wait on pages that a READ is
 * filling, and READs must not wait on the nodes' lock meanwhile. A node forgotten since
 * cannot be confused: the kernel answers ENOENT for an id it no longer has. Ends when main
 * sets `ending` and signals it, before the session it writes to is destroyed. */
static int ending; /* atomic */

static void *dropper(void *arg)
{
    sigset_t *usr1 = arg;
    for (;;) {
        int sig;
        if (sigwait(usr1, &sig) != 0)
            continue;
        if (__atomic_load_n(&ending, __ATOMIC_ACQUIRE))
            return NULL;
        size_t count = 0, cap = 1024;
        fuse_ino_t *ids = malloc(cap * sizeof *ids);
        int whole = ids != NULL; /* every file's id taken (no allocation failed) */
        pthread_mutex_lock(&nodes_lock);
        for (struct node *n = nodes.next; whole && n != &nodes; n = n->next) {
            if (!n->is_file)
                continue;
            if (count == cap) {
                fuse_ino_t *more = realloc(ids, 2 * cap * sizeof *ids);
                if (more == NULL) {
                    whole = 0;
                    break;
                }
                ids = more;
                cap *= 2;
            }
            ids[count++] = (fuse_ino_t)(uintptr_t)n;
        }
        pthread_mutex_unlock(&nodes_lock);
        for (size_t i = 0; i < count; i++)
            fuse_lowlevel_notify_inval_inode(session, ids[i], 0, 0);
        free(ids);
        fputs(whole ? "dropped\n" : "failed\n", stdout);
        fflush(stdout);
    }
    return NULL;
}

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* --poll's loop: 0 once unmounted or told to end, else 1. */
static int poll_loop(struct fuse_session *se)
{
    int fd = fuse_session_fd(se);
    if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) < 0)
        return 1;
    struct fuse_buf buf = {0};
    uint64_t last = now_ns();
    int rc = 0;
    while (!fuse_session_exited(se)) {
        int got = fuse_session_receive_buf(se, &buf);
        if (got == -EAGAIN) {
            if (now_ns() - last < POLL_NS)
                continue;
            struct pollfd p = {.fd = fd, .events = POLLIN};
            poll(&p, 1, -1);  /* EINTR: SIGTERM's handler has ended the session */
            continue;
        }
        if (got == -EINTR)
            continue;
        if (got <= 0) {  /* 0: unmounted */
            rc = got < 0;
            break;
        }
        fuse_session_process_buf(se, &buf);
        last = now_ns();
    }
    free(buf.mem);
    return rc;
}

int main(int argc, char **argv)
{
    int polls = argc == 4 && strcmp(argv[1], "--poll") == 0;
    if (argc != 3 + polls) {
        fprintf(stderr, "usage: %s [--poll] SRC MOUNTPOINT\n", argv[0]);
        return 2;
    }
    argv += polls;
    root_fd = open(argv[1], O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (root_fd < 0) {
        fprintf(stderr, "fanfs-floor: %s: %s\n", argv[1], strerror(errno));
        return 1;
    }
    if (pthread_key_create(&buf_key, free) != 0)
        return 1;
    /* A descriptor a file the kernel knows (LOOKUP to FORGET): the bench's 2,048 files of
     * 128 KiB passed the usual soft limit of 1,024, and the readers' opens failed (EMFILE). */
    struct rlimit files;
    if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
        files.rlim_cur = files.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &files) != 0)
            fprintf(stderr, "fanfs-floor: cannot raise the descriptor limit: %s\n",
                    strerror(errno));
    }
    static sigset_t usr1;
    sigemptyset(&usr1);
    sigaddset(&usr1, SIGUSR1);
    pthread_sigmask(SIG_BLOCK, &usr1, NULL);  /* libfuse's threads inherit it */
    char *fuse_argv[] = {"fanfs-floor", "-o", "ro,default_permissions,fsname=fanfs-floor", NULL};
    struct fuse_args args = FUSE_ARGS_INIT(3, fuse_argv);
    session = fuse_session_new(&args, &ops, sizeof ops, NULL);
    fuse_opt_free_args(&args); /* what libfuse added to them while parsing */
    if (session == NULL)
        return 1;
    int rc = 1;
    pthread_t drops;
    if (fuse_set_signal_handlers(session) == 0) {
        if (fuse_session_mount(session, argv[2]) == 0) {
            if (pthread_create(&drops, NULL, dropper, &usr1) == 0) {
                rc = polls ? poll_loop(session) : fuse_session_loop_mt(session, 0) != 0;
                __atomic_store_n(&ending, 1, __ATOMIC_RELEASE);
                pthread_kill(drops, SIGUSR1);
                pthread_join(drops, NULL);
            }
            fuse_session_unmount(session);
        }
        fuse_remove_signal_handlers(session);
    }
    fuse_session_destroy(session);
    return rc;
}
