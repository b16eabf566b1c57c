/*
 * What tests/native/pool_stress.c hands the front's checks (tests/native/front_stress.c): the
 * raw pieces of its partition, each of which the front's catalog makes a file.
 */
#ifndef FANFS_STRESS_H
#define FANFS_STRESS_H

#include <stdint.h>

struct stress_file {
    int64_t off;       /* its stored bytes in the partition */
    uint32_t len, crc; /* raw: its size too */
    const char *bytes; /* what a READ of it answers */
};

/* Run the front's checks named in `parts` (NULL: all): "front" (the dataset front under READs,
 * stopped while requests are in flight, then the session ended under it) and "writes" (the
 * output front's writes behind). The pool is stopped before and after; `part_fd` is the
 * partition, `errfd` the read end of the pipe the pool posts failures on (its write end
 * `errwfd`). The number of failures. */
int front_stress(const char *dir, int part_fd, int errfd, int errwfd,
                 const struct stress_file *files, int nfiles, const char *parts);

#endif
