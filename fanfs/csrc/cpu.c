/*
 * The kernel's CPU pressure (fanfs_cpu_pressed, fanfs_native.h), sampled: whether threads
 * waited for a CPU in more than a tenth of the last ~100 ms (/proc/pressure/cpu "some"), for
 * the threads that poll instead of sleeping (the front's leader, the MPI thread): then a poll
 * takes a core from the readers.
 *
 * One sampler per process, by nature: it caches a reading of the machine, which every caller
 * shares (file-scope state, on purpose, and only this). Read at most every 100 ms, by one
 * caller at a time (`cpu.lock`, a leaf, tried and never waited for: the others take the last
 * answer); a reading more than 200 ms old is only a new baseline (what happened while nobody
 * asked says nothing about now). 0 when the kernel has no PSI.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "front.h"

static struct {
    pthread_mutex_t lock;
    int64_t last_ns;       /* atomic, stored under `lock`: when the last reading was taken */
    int64_t last_stall_us; /* `lock`: its stall total (-1: none) */
    int pressed;           /* atomic, stored under `lock`: the last answer */
} cpu = {.lock = PTHREAD_MUTEX_INITIALIZER, .last_stall_us = -1};

int fanfs_cpu_pressed(void) {
    int64_t now = fanfs_now_ns(), stall_us;
    char buf[256], *at;
    ssize_t n;
    int fd, was;
    if (now - __atomic_load_n(&cpu.last_ns, __ATOMIC_RELAXED) < 100000000 ||
        pthread_mutex_trylock(&cpu.lock) != 0)
        return __atomic_load_n(&cpu.pressed, __ATOMIC_RELAXED);
    was = cpu.pressed;
    if (now - cpu.last_ns >= 100000000) {
        stall_us = -1;
        fd = open("/proc/pressure/cpu", O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            n = read(fd, buf, sizeof buf - 1);
            close(fd);
            if (n > 0) {
                buf[n] = 0;
                at = strstr(buf, "total=");
                if (at != NULL)
                    stall_us = strtoll(at + 6, NULL, 10);
            }
        }
        was = stall_us >= 0 && cpu.last_stall_us >= 0 && now - cpu.last_ns <= 200000000 &&
              (stall_us - cpu.last_stall_us) * 1000 * 10 > (now - cpu.last_ns);
        cpu.last_stall_us = stall_us;
        __atomic_store_n(&cpu.pressed, was, __ATOMIC_RELAXED);
        __atomic_store_n(&cpu.last_ns, now, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&cpu.lock);
    return was;
}
