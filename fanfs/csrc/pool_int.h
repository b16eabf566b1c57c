/*
 * What the files of the native read pool share (not a contract with Python: fanfs_native.h
 * is): a READ's target and a queued job.
 */
#ifndef FANFS_POOL_INT_H
#define FANFS_POOL_INT_H

#define FUSE_USE_VERSION 35
#include <fuse_lowlevel.h>
#include <stdint.h>

#include "fanfs_native.h"

#define WAITING (1 << 30) /* piece_get: the job was hung on a piece being read */

/* Where a READ's answer goes: through libfuse (`req`, a request pyfuse3 took), or written to
 * the FUSE device `fd` for request `unique` (one the front took itself). */
struct target {
    struct fuse_session *se; /* for pushes through libfuse; NULL with `fd` */
    fuse_req_t req;
    int fd;
    uint64_t unique;
};

struct qjob {
    struct qjob *next;
    struct target t; /* t.req NULL and t.fd < 0: a read-ahead */
    int lookahead;   /* a read-ahead started at LOOKUP: run only while its READ is to come */
    struct fanfs_job j;
};

#endif
