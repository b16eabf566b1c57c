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

#endif
