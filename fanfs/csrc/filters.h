/*
 * The array filters undone (filters.c): fanfs/image/filters.py's decoders, byte for byte, for
 * codec.c's fanfs_decode. Pure functions of their arguments: any thread, no state.
 */
#ifndef FANFS_FILTERS_H
#define FANFS_FILTERS_H

#include <stdint.h>

/* The word width of filter `fid` (4 or 8), or 0 for an id that names no filter. */
int fanfs_filter_width(int fid);

/* The most bytes filter `fid`'s output of `size` bytes may have (decimal adds its
 * exceptions). */
uint64_t fanfs_filtered_max(int fid, uint32_t size);

/* Undo filter `fid` of `in` (`n` bytes) into `out` (`size` bytes, 8-byte aligned); 0 or
 * FANFS_EBADDATA (sizes that do not fit, an exception out of range). */
int fanfs_unfilter(int fid, const unsigned char *in, uint64_t n, unsigned char *out,
                   uint32_t size);

/* The widest vectors (bits) fanfs_unfilter uses on this CPU: 256 where it has AVX2 and FMA
 * (decimal4 and decimal8, filters_avx2.c; the other filters stay 128 bits wide), else 128
 * (SSE2, every x86-64), else 0 (the portable C alone: aarch64). */
int fanfs_vectors(void);

/* fanfs_unfilter with vectors of at most `vectors` bits (0, 128 or 256; EINVAL for wider
 * than the CPU runs): every width gives the same bytes, which tests and decode_bench check. */
int fanfs_unfilter_at(int fid, const unsigned char *in, uint64_t n, unsigned char *out,
                      uint32_t size, int vectors);

/* filters_avx2.c's steps, 32 words each: the words done (a multiple of 32); `*acc` the running
 * sum after them, for filters.c's portable pass to go on from. Only where fanfs_vectors() is
 * 256. */
uint64_t fanfs_decimal4_wide(const unsigned char *in, uint64_t words, double inv,
                             unsigned char *out, uint32_t *acc);
uint64_t fanfs_decimal8_wide(const unsigned char *in, uint64_t words, double p10,
                             unsigned char *out, uint64_t *acc);

#endif
