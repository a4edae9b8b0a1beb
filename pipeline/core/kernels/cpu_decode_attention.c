/* Attention of one new query per row over that row's cached keys, in float32 on a CPU.

   Compiled at first use by pipeline/core/kernels/cpu_decode_attention.py, which says why this
   exists and checks every shape and stride before calling it. The tensors are read through
   their strides, so any layout whose innermost dimension is contiguous works: keys and values
   kept position by position or head by head, or gathered from a block cache.

   Row by row, the kernel streams the row's keys once for all query heads (a key head serves
   the `group` query heads next to each other), then its values once. A row's result depends on
   that row alone: keys the mask hides are skipped, not weighted by zero, so neither the other
   rows nor padding past the row's length change a bit of it. */

#include <math.h>
#include <stdint.h>
#include <string.h>

/* How far ahead of the position being read the entries are requested (measured at 32 rows:
   4 to 16 alike, 32 too far). */
#define PREFETCH_POSITIONS 6

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

/* Sixteen floats as one vector; memcpy keeps the loads and stores unaligned and legal. */
static inline f32x16 load16(const float *from) {
    f32x16 v;
    memcpy(&v, from, sizeof v);
    return v;
}

static inline void store16(float *to, f32x16 v) { memcpy(to, &v, sizeof v); }

/* The sum of a vector's lanes, pairwise (halves, then quarters, ...). */
static inline float sum16(f32x16 v) {
#if defined(__has_builtin) && __has_builtin(__builtin_shufflevector)
    f32x8 eight = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
                + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    f32x4 four = __builtin_shufflevector(eight, eight, 0, 1, 2, 3)
               + __builtin_shufflevector(eight, eight, 4, 5, 6, 7);
#else
    f32x8 low8, high8;
    memcpy(&low8, &v, sizeof low8);
    memcpy(&high8, (const char *)&v + sizeof low8, sizeof high8);
    f32x8 eight = low8 + high8;
    f32x4 low4, high4;
    memcpy(&low4, &eight, sizeof low4);
    memcpy(&high4, (const char *)&eight + sizeof low4, sizeof high4);
    f32x4 four = low4 + high4;
#endif
    return (four[0] + four[2]) + (four[1] + four[3]);
}

/* Sum of a[i] * b[i]: whole vectors, then what is left one by one. */
static inline float dot(const float *a, const float *b, int64_t n) {
    f32x16 lanes = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) lanes += load16(a + i) * load16(b + i);
    float sum = sum16(lanes);
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* to[i] += weight * from[i]. */
static inline void add_scaled(float *to, float weight, const float *from, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) store16(to + i, load16(to + i) + weight * load16(from + i));
    for (; i < n; i++) to[i] += weight * from[i];
}

/* to[i] += (w[0] from[0][i] + w[1] from[1][i]) + (w[2] from[2][i] + w[3] from[3][i]), with
   from[j] = from + j * step: four positions for one load and store of `to`. */
static inline void add_scaled4(float *to, const float *w, const float *from, int64_t step,
                               int64_t n) {
    const float *f1 = from + step, *f2 = from + 2 * step, *f3 = from + 3 * step;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        f32x16 pair01 = w[0] * load16(from + i) + w[1] * load16(f1 + i);
        f32x16 pair23 = w[2] * load16(f2 + i) + w[3] * load16(f3 + i);
        store16(to + i, load16(to + i) + (pair01 + pair23));
    }
    for (; i < n; i++) to[i] += (w[0] * from[i] + w[1] * f1[i]) + (w[2] * f2[i] + w[3] * f3[i]);
}

/* Ask for `positions` entries (each `heads` runs of `dim` floats) from `at` on, before they
   are read: a row's history is a few hundred kilobytes, too short for the hardware's prefetcher
   to get ahead of it (without this the kernel took 1.4x its time at 32 rows over 116 keys).
   Prefetching never faults, so the addresses past a row's end need not exist. */
static inline void prefetch_entries(const float *at, int64_t positions, int64_t position_stride,
                                    int64_t heads, int64_t head_stride, int64_t dim) {
    for (int64_t p = 0; p < positions; p++)
        for (int64_t h = 0; h < heads; h++)
            for (int64_t i = 0; i < dim; i += 16)
                __builtin_prefetch(at + p * position_stride + h * head_stride + i);
}

/* e^x for x <= 0, lane by lane: x = n ln2 + r with |r| <= ln2 / 2, e^r from a degree-7
   polynomial (Cephes' single-precision coefficients), 2^n put in the exponent bits. Below
   -87.3 it gives e^-87.3 (1e-38), which the weights' sum (at least 1) does not notice. */
static inline f32x16 exp_nonpositive(f32x16 x) {
    const f32x16 zero = {0}, lowest = zero - 87.3f;
    i32x16 below = x < lowest;
    x = (f32x16)(((i32x16)x & ~below) | ((i32x16)lowest & below));
    i32x16 whole = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, i32x16);
    f32x16 n = __builtin_convertvector(whole, f32x16);  /* x / ln2 rounded to nearest */
    f32x16 r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    f32x16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    f32x16 e_r = p * r * r + r + 1.0f;
    return e_r * (f32x16)((whole + 127) << 23);
}

/* Each query's scores, padded to a whole number of vectors. */
static inline int64_t score_stride(int64_t length) { return (length + 15) / 16 * 16; }

/* out[r, h] = sum over visible positions p of softmax_p(scale * q[r, h] . k[r, p, h / group])
   times v[r, p, h / group], for rows r < rows and query heads h < heads.

   Strides are in elements. mask (one byte per row and position, nonzero: visible) may be
   NULL: every position is visible; a row with none visible (and no sink) gets zeros. sinks (one logit per query head) may be NULL; a sink is one
   more softmax column whose value is zero. Scratch, owned by the caller: scores
   [heads * score_stride(length)], acc [heads * v_dim], top and total
   [heads] each. */
void pipe_decode_attention_f32(
    int64_t rows, int64_t heads, int64_t kv_heads, int64_t qk_dim, int64_t v_dim,
    int64_t length,
    const float *q, int64_t q_row, int64_t q_head,
    const float *k, int64_t k_row, int64_t k_position, int64_t k_head,
    const float *v, int64_t v_row, int64_t v_position, int64_t v_head,
    const uint8_t *mask, int64_t mask_row, int64_t mask_position,
    const float *sinks, float scale,
    float *out, int64_t out_row, int64_t out_head,
    float *scores, float *acc, float *top, float *total)
{
    int64_t group = heads / kv_heads, stride = score_stride(length);
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *visible = mask ? mask + r * mask_row : NULL;
        const float *q_r = q + r * q_row;
        for (int64_t h = 0; h < heads; h++) {
            top[h] = -INFINITY;
            for (int64_t p = length; p < stride; p++) scores[h * stride + p] = -INFINITY;
        }
        for (int64_t p = 0; p < length; p++) {
            if (visible && !visible[p * mask_position]) {
                for (int64_t h = 0; h < heads; h++) scores[h * stride + p] = -INFINITY;
                continue;
            }
            const float *k_p = k + r * k_row + p * k_position;
            prefetch_entries(k_p + PREFETCH_POSITIONS * k_position, 1, k_position, kv_heads,
                             k_head, qk_dim);
            for (int64_t kv = 0, h = 0; kv < kv_heads; kv++) {
                for (int64_t j = 0; j < group; j++, h++) {
                    float s = dot(q_r + h * q_head, k_p + kv * k_head, qk_dim) * scale;
                    scores[h * stride + p] = s;
                    if (s > top[h]) top[h] = s;
                }
            }
        }
        for (int64_t h = 0; h < heads; h++) {
            if (sinks && sinks[h] > top[h]) top[h] = sinks[h];
            const f32x16 zero = {0}, shift = zero + top[h];
            float *row = scores + h * stride;
            for (int64_t p = 0; p < stride; p += 16)
                store16(row + p, exp_nonpositive(load16(row + p) - shift));
            total[h] = 0.0f;
            if (sinks) {
                f32x16 sink = zero + (sinks[h] - top[h]);
                total[h] = exp_nonpositive(sink)[0];
            }
            memset(acc + h * v_dim, 0, (size_t)v_dim * sizeof(float));
        }
        /* Four visible positions at a time where the row has them, one at a time elsewhere:
           which positions go together depends on the row's own mask alone. */
        for (int64_t p = 0; p < length;) {
            int all4 = p + 4 <= length;
            for (int64_t i = 0; all4 && visible && i < 4; i++)
                all4 = visible[(p + i) * mask_position] != 0;
            if (!all4 && visible && !visible[p * mask_position]) {
                p++;
                continue;
            }
            const float *v_p = v + r * v_row + p * v_position;
            prefetch_entries(v_p + PREFETCH_POSITIONS * v_position, all4 ? 4 : 1, v_position,
                             kv_heads, v_head, v_dim);
            for (int64_t kv = 0, h = 0; kv < kv_heads; kv++) {
                for (int64_t j = 0; j < group; j++, h++) {
                    const float *w = scores + h * stride + p;
                    float *sum = acc + h * v_dim;
                    if (all4) {
                        total[h] += (w[0] + w[1]) + (w[2] + w[3]);
                        add_scaled4(sum, w, v_p + kv * v_head, v_position, v_dim);
                    } else {
                        total[h] += w[0];
                        add_scaled(sum, w[0], v_p + kv * v_head, v_dim);
                    }
                }
            }
            p += all4 ? 4 : 1;
        }
        for (int64_t h = 0; h < heads; h++) {
            /* A row that sees no key (a padded row of a static batch) gets zeros, as from SDPA. */
            float *o = out + r * out_row + h * out_head;
            float inverse = total[h] > 0.0f ? 1.0f / total[h] : 0.0f;
            for (int64_t d = 0; d < v_dim; d++) o[d] = acc[h * v_dim + d] * inverse;
        }
    }
}
