/*
 * What the front records for others (front.h): the files a planned epoch follows, and the
 * READs' latencies.
 *
 * Follow: the files the front looked up and READ from their start, in order, while a planned
 * epoch follows them (fanfs_front_follow): the job's position in its plan moves with them.
 * The record is a bounded ring under its own lock (a leaf); a front thread that finds
 * following off (the common case) takes no lock. Python takes the record when the eventfd
 * says it stopped being empty.
 *
 * Latencies: a ring of the last FANFS_FRONT_SAMPLES READs' times, written by any front thread
 * with atomics alone (a sample may be overwritten while read: `fanfs status` takes
 * percentiles, one stale sample does not move them).
 *
 * Budget: the thread that took a READ marks the end of each stage of its answer in its own
 * fanfs_marks (fanfs_native.h; no lock, no atomic, a clock read per mark, about 30 ns), and adds
 * the READ's stages to its front's sums once answered (atomics). A thread not tracing a READ
 * (the pool's, Python's) finds its marks off and reads no clock.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "front.h"

void fanfs_follow_init(struct fanfs_follow *fl) {
    pthread_mutex_init(&fl->lock, NULL);
    fl->efd = -1;
    fl->head = fl->n = 0;
    fl->lost = 0;
}

void fanfs_follow_destroy(struct fanfs_follow *fl) { pthread_mutex_destroy(&fl->lock); }

void fanfs_follow_set(struct fanfs_follow *fl, int efd) {
    pthread_mutex_lock(&fl->lock);
    __atomic_store_n(&fl->efd, efd, __ATOMIC_RELAXED);
    fl->head = fl->n = 0;
    pthread_mutex_unlock(&fl->lock);
}

void fanfs_follow_add(struct fanfs_follow *fl, uint64_t e, int read) {
    uint64_t one = 1;
    ssize_t w;
    if (__atomic_load_n(&fl->efd, __ATOMIC_RELAXED) < 0)
        return;
    pthread_mutex_lock(&fl->lock);
    if (fl->efd >= 0) {
        if (fl->n == FANFS_FOLLOW_MAX) {
            fl->lost++;
        } else {
            fl->e[(fl->head + fl->n) % FANFS_FOLLOW_MAX] = e | (read ? FANFS_FOLLOW_READ : 0);
            if (fl->n++ == 0) {
                w = write(fl->efd, &one, sizeof one);
                (void)w;
            }
        }
    }
    pthread_mutex_unlock(&fl->lock);
}

int fanfs_follow_take(struct fanfs_follow *fl, uint64_t *out, int max, uint64_t *lost) {
    int k = 0;
    pthread_mutex_lock(&fl->lock);
    while (k < max && fl->n > 0) {
        out[k++] = fl->e[fl->head];
        fl->head = (fl->head + 1) % FANFS_FOLLOW_MAX;
        fl->n--;
    }
    *lost = fl->lost;
    pthread_mutex_unlock(&fl->lock);
    return k;
}

/* -- latencies ---------------------------------------------------------------------------- */

int64_t fanfs_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

void fanfs_latency_add(struct fanfs_latencies *lat, int64_t began_ns) {
    int64_t us = (fanfs_now_ns() - began_ns) / 1000;
    uint32_t v = us > UINT32_MAX ? UINT32_MAX : us < 0 ? 0 : (uint32_t)us;
    uint64_t k = __atomic_fetch_add(&lat->n, 1, __ATOMIC_RELAXED);
    uint32_t old = __atomic_load_n(&lat->longest, __ATOMIC_RELAXED);
    __atomic_store_n(&lat->us[k % FANFS_FRONT_SAMPLES], v, __ATOMIC_RELAXED);
    while (v > old && !__atomic_compare_exchange_n(&lat->longest, &old, v, 0, __ATOMIC_RELAXED,
                                                   __ATOMIC_RELAXED))
        ;
}

int fanfs_latency_take(const struct fanfs_latencies *lat, uint32_t out[FANFS_FRONT_SAMPLES],
                       uint32_t *longest) {
    uint64_t n = __atomic_load_n(&lat->n, __ATOMIC_RELAXED), i;
    if (n > FANFS_FRONT_SAMPLES)
        n = FANFS_FRONT_SAMPLES;
    for (i = 0; i < n; i++)
        out[i] = __atomic_load_n(&lat->us[i], __ATOMIC_RELAXED);
    *longest = __atomic_load_n(&lat->longest, __ATOMIC_RELAXED);
    return (int)n;
}

/* -- the latency budget ------------------------------------------------------------------- */

void fanfs_mark(int stage) {
    struct fanfs_marks *m = fanfs_marks();
    int64_t now;
    if (m == NULL)
        return;
    now = fanfs_now_ns();
    m->ns[stage] += now - m->last;
    m->last = now;
}

void fanfs_budget_begin(int64_t taken_ns) {
    struct fanfs_tls *t = fanfs_tls();
    if (t == NULL)
        return; /* (no buffers either: the READ fails or goes to Python) */
    memset(&t->marks, 0, sizeof t->marks);
    t->marks.on = 1;
    t->marks.last = taken_ns;
}

void fanfs_budget_end(struct fanfs_budget *b, int answered) {
    struct fanfs_marks *m = fanfs_marks();
    int k, remote;
    if (m == NULL)
        return;
    fanfs_mark(FANFS_STAGE_END);
    m->on = 0;
    if (!answered)
        return;
    remote = m->remote;
    __atomic_add_fetch(&b->n[remote], 1, __ATOMIC_RELAXED);
    for (k = 0; k < FANFS_STAGES; k++)
        if (m->ns[k] > 0)
            __atomic_add_fetch(&b->ns[remote][k], (uint64_t)m->ns[k], __ATOMIC_RELAXED);
}

void fanfs_budget_take(const struct fanfs_budget *b, uint64_t out[FANFS_BUDGET_LEN]) {
    int r, k;
    for (r = 0; r < 2; r++) {
        out[r * (1 + FANFS_STAGES)] = __atomic_load_n(&b->n[r], __ATOMIC_RELAXED);
        for (k = 0; k < FANFS_STAGES; k++)
            out[r * (1 + FANFS_STAGES) + 1 + k] = __atomic_load_n(&b->ns[r][k], __ATOMIC_RELAXED);
    }
    out[2 * (1 + FANFS_STAGES)] = __atomic_load_n(&b->spin_ns, __ATOMIC_RELAXED);
}
