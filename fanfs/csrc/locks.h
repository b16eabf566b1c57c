/*
 * Every mutex of fanfs's C, its order, and what it guards: the one lock table (docs/threads.md
 * says the same for readers of the docs). Nothing to compile: a thread that holds a lock may
 * take only a lock further down its chain, never one above it; a lock marked "alone" or
 * "leaf" has nothing taken under it.
 *
 * The pool's (struct pool, pool_int.h; the cache's in pieces.h), in the order they nest:
 *
 *   1. push.lock     (struct pushes, push.c)      the push ring, `running`, push counters.
 *                                                 Taken before pieces.lock: a queued push
 *                                                 takes a reference to its slot
 *                                                 (push_queue, push_stop).
 *   2. pieces.lock   (struct pieces, pieces.h)    every slot of the cache of decoded pieces,
 *                                                 the READs hung on them, the spares, the
 *                                                 cache's counters, `ahead`, `waiting`;
 *                                                 pieces.ready is its condition (a pending
 *                                                 slot was filled or given up).
 *                                                 Every function named ..._locked in pieces.c,
 *                                                 jobs.c, remote.c and fast.c runs under it.
 *   3. remote.lock   (struct remote, remote.c)    the ring of fetches for the data plane or
 *                                                 the MPI thread, the ring the plane hands
 *                                                 back, their wake fds. Taken under
 *                                                 pieces.lock: a fetch is queued with its slot
 *                                                 reserved (rq_push_locked); the plane
 *                                                 (plane.c) takes it alone.
 *
 *   work.lock        (struct workers, pool.c)     the job queues, `stopping`, the jobs count;
 *                                                 work.cond: a job queued, or the stop. A leaf,
 *                                                 and never taken with pieces.lock held: READs
 *                                                 hung on a piece are requeued
 *                                                 (pool_requeue) once pieces.lock is let go.
 *   work.dlock       (struct workers, pool.c)     the dictionaries' reference. Alone.
 *   la.lock          (struct lookahead, fast.c)   the ring of recent lookups and its counters.
 *                                                 A leaf.
 *
 * Each front's (struct fanfs_front, front.h: one per wing):
 *
 *   front.lock       (front.c, forward.c)         the forward queue, `ended`, `draining`, the
 *                                                 lead; front.turn: the lead is free. A leaf
 *                                                 (the pool is called with it let go).
 *   follow.lock      (follow.c)                   the record of followed entries. A leaf.
 *   cpu.lock         (cpu.c, one per process)     the CPU-pressure sampler's last reading;
 *                                                 only ever tried (trylock). A leaf.
 *   wb.lock          (writes.c)                   the write queue, spare buffers, `busy`;
 *                                                 wb.cond: a job queued, done, or a buffer
 *                                                 free. A leaf.
 *
 * The data plane's (plane.h):
 *
 *   reads.lock       (plane_read.c)               the owner's reads: asks to read and reads
 *                                                 done; reads.work: an ask queued, or the
 *                                                 stop. A leaf. (The rest of the plane is its
 *                                                 thread's own; it takes the pool's
 *                                                 pieces.lock and remote.lock one at a time.)
 *
 * codec.c and stored.c have no mutex: the libraries are loaded once (pthread_once), the
 * buffers are each thread's own (__thread), and the counters are atomic.
 *
 * Neither side calls into the other with a lock held: the front calls the pool
 * (fanfs_pool_fast_answer, fanfs_pool_looked_up) holding none, and the pool calls the front's
 * raw replies (fanfs_raw_reply, fanfs_raw_notify_store), which take none.
 */
#ifndef FANFS_LOCKS_H
#define FANFS_LOCKS_H
#endif
