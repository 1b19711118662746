/*
 * Gather and scatter between a rank's KV pool regions and a staging buffer on host memory: the
 * same bytes as backends/staging_copy.py (numpy) and the Triton kernels, for the staged flows'
 * copies on DRAM pools. Called through ctypes from the copy thread with the GIL released, so a
 * copy never holds the interpreter, and with memcpy of whole head rows (or of a token's whole
 * head run where the pool and the staging layout both keep the heads adjacent), walked in the
 * order that keeps the staging side sequential.
 *
 * A map (core/staging_layout.StagingMap): for region r (its base pointer and size), token i
 * (token_offsets[i], a byte offset in the region) and head j < num_heads:
 *   pool bytes    [token_offsets[i] + j * pool_head_stride, ... + head_bytes)
 *   staging bytes [staging_base + r * stride_region + i * stride_token + j * stride_head, ...)
 * Every range is checked against its buffer before any byte moves (the extremes of a sum of
 * arithmetic ranges are exact, in 128-bit arithmetic so no offset can wrap).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef __int128 i128;

static i128 lo_of(int64_t count, int64_t stride) { return count > 1 && stride < 0 ? (i128)(count - 1) * stride : 0; }
static i128 hi_of(int64_t count, int64_t stride) { return count > 1 && stride > 0 ? (i128)(count - 1) * stride : 0; }

/* 0: copied; -1: a pool range outside its region; -2: a staging range outside the buffer;
 * -3: bad arguments (negative counts or sizes). Nothing is written unless it returns 0. */
int kvf_copy_map(int scatter, size_t nreg, uint8_t *const *regions, const uint64_t *region_sizes,
                 uint8_t *staging, uint64_t staging_size, const int64_t *token_offsets, size_t ntok,
                 int64_t num_heads, int64_t head_bytes, int64_t pool_head_stride, int64_t staging_base,
                 int64_t stride_region, int64_t stride_token, int64_t stride_head) {
    if (num_heads < 0 || head_bytes < 0)
        return -3;
    if (nreg == 0 || ntok == 0 || num_heads == 0 || head_bytes == 0)
        return 0;
    int64_t tmin = token_offsets[0], tmax = token_offsets[0];
    for (size_t i = 1; i < ntok; i++) {
        tmin = token_offsets[i] < tmin ? token_offsets[i] : tmin;
        tmax = token_offsets[i] > tmax ? token_offsets[i] : tmax;
    }
    i128 plo = (i128)tmin + lo_of(num_heads, pool_head_stride);
    i128 phi = (i128)tmax + hi_of(num_heads, pool_head_stride) + head_bytes;
    for (size_t r = 0; r < nreg; r++)
        if (plo < 0 || phi > (i128)region_sizes[r])
            return -1;
    i128 slo = (i128)staging_base + lo_of((int64_t)nreg, stride_region) + lo_of((int64_t)ntok, stride_token) +
               lo_of(num_heads, stride_head);
    i128 shi = (i128)staging_base + hi_of((int64_t)nreg, stride_region) + hi_of((int64_t)ntok, stride_token) +
               hi_of(num_heads, stride_head) + head_bytes;
    if (slo < 0 || shi > (i128)staging_size)
        return -2;

    /* A token's heads are one run on both sides: one memcpy per (region, token). */
    int merged = num_heads > 1 && pool_head_stride == head_bytes && stride_head == head_bytes;
    size_t hb = (size_t)head_bytes;
    for (size_t r = 0; r < nreg; r++) {
        uint8_t *pool = regions[r];
        uint8_t *st_r = staging + staging_base + (int64_t)r * stride_region;
        if (merged) {
            size_t run = hb * (size_t)num_heads;
            for (size_t i = 0; i < ntok; i++) {
                uint8_t *p = pool + token_offsets[i], *s = st_r + (int64_t)i * stride_token;
                if (scatter)
                    memcpy(p, s, run);
                else
                    memcpy(s, p, run);
            }
        } else if (stride_token <= stride_head) { /* head-major staging: tokens innermost */
            for (int64_t j = 0; j < num_heads; j++) {
                uint8_t *st_j = st_r + j * stride_head;
                int64_t pj = j * pool_head_stride;
                for (size_t i = 0; i < ntok; i++) {
                    uint8_t *p = pool + token_offsets[i] + pj, *s = st_j + (int64_t)i * stride_token;
                    if (scatter)
                        memcpy(p, s, hb);
                    else
                        memcpy(s, p, hb);
                }
            }
        } else { /* layer-major staging: heads innermost */
            for (size_t i = 0; i < ntok; i++) {
                uint8_t *p_i = pool + token_offsets[i], *st_i = st_r + (int64_t)i * stride_token;
                for (int64_t j = 0; j < num_heads; j++) {
                    uint8_t *p = p_i + j * pool_head_stride, *s = st_i + j * stride_head;
                    if (scatter)
                        memcpy(p, s, hb);
                    else
                        memcpy(s, p, hb);
                }
            }
        }
    }
    return 0;
}
