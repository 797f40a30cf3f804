/* numscope's native quantizers: the eager reference's float32 arithmetic, one element at a time.
 *
 * Each function computes exactly the float32 operations of numscope.formats.cast / scaling / blocks
 * (the same products, the same round-to-nearest-even, the same order), so its results are the eager
 * path's bit for bit (tests/formats/test_formats_native.py checks it). Compiled by numscope.formats.native
 * with -O3 and without -ffast-math: IEEE semantics, no contraction into fused multiply-adds, and the
 * default rounding mode, so rintf rounds to nearest even as torch.round does.
 *
 * Layout: x and out are distinct contiguous float32 (rows, cols). Element formats take an optional
 * scale: none, one for the tensor, one per row or one per column (scale_mode 0..3). Block formats have
 * blocks of block_size consecutive elements along each row (cols a multiple of block_size) or down each
 * column. Flags that select a branch are compile-time constants of each loop (macros below), so that the
 * compiler vectorizes every loop; with them read at run time it emitted scalar code, 4x slower.
 */
#include <math.h>
#include <float.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    int32_t kind;          /* 0: float, fewer than 8 exponent bits; 1: float, 8 exponent bits; 2: integer */
    int32_t mantissa_bits; /* floats */
    int32_t emin;          /* floats: exponent of the smallest normal */
    int32_t overflow;      /* beyond max: 0 ±max, 1 ±inf, 2 NaN */
    int32_t nonfinite;     /* inf and NaN inputs: 0 kept, 1 NaN, 2 NaN kept and ±inf to ±max */
    int32_t flush;         /* results below min_normal become zero (sign kept) */
    float zero_add;        /* added to every result: -0 keeps -0, +0 turns -0 into +0 (no -0) */
    float max, min_normal;
    float to_units, from_units;  /* integers: 2^fraction_bits, 2^-fraction_bits */
    float min_code, max_code;    /* integers */
} numscope_format;

static inline __attribute__((always_inline)) uint32_t bits_of(float x) { uint32_t b; memcpy(&b, &x, 4); return b; }
static inline __attribute__((always_inline)) float float_of(uint32_t b) { float x; memcpy(&x, &b, 4); return x; }
static inline __attribute__((always_inline)) float quiet_nan(void) { return float_of(0x7FC00000u); }
/* a block's element times its decode scale past float32's range (E4M3's 256 under 2^120) saturates to
 * ±FLT_MAX (blocks.py block_values); NaN stays NaN */
static inline __attribute__((always_inline)) float saturate_f32(float v) {
    return v > FLT_MAX ? FLT_MAX : (v < -FLT_MAX ? -FLT_MAX : v);
}

/* cast.py cast_int */
static inline __attribute__((always_inline)) float cast_int(float x, const numscope_format *f) {
    float code = rintf(x * f->to_units);
    code = code < f->min_code ? f->min_code : (code > f->max_code ? f->max_code : code); /* NaN stays */
    code = code == 0.0f ? 0.0f : code;                                                  /* no -0 */
    return code * f->from_units;
}

/* cast.py cast_float after the grid rounding: overflow, flush, zeros, non-finite inputs. OV, NF and FL are
 * compile-time constants in every caller (f->overflow, f->nonfinite, f->flush), so that each combination
 * gets its own branch-free loop, which the compiler vectorizes (with runtime flags it does not). */
static inline __attribute__((always_inline)) float finish(float x, float y, const numscope_format *f, const int OV, const int NF, const int FL) {
    const float beyond = OV == 2 ? quiet_nan() : copysignf(OV == 1 ? INFINITY : f->max, y);
    y = fabsf(y) > f->max ? beyond : y;
    if (FL) y = fabsf(y) < f->min_normal ? y * 0.0f : y;
    y = y + f->zero_add;
    const float special = NF == 0 ? x : (NF == 1 ? quiet_nan() : ((x != x) ? x : copysignf(f->max, x)));
    return fabsf(x) < INFINITY ? y : special;
}

/* cast.py _grid_small: spacing 2^(max(e, emin) - m), capped at 2^126 */
static inline __attribute__((always_inline)) float cast_small(float x, const numscope_format *f, const int OV, const int NF, const int FL) {
    const float safe = fabsf(x) < INFINITY ? x : 0.0f;
    int e = (int)((bits_of(safe) >> 23) & 0xFFu) - 127;
    e = e < f->emin ? f->emin : e;
    e -= f->mantissa_bits;
    e = e > 126 ? 126 : e;
    const float spacing = float_of((uint32_t)(e + 127) << 23);
    const float inverse = float_of((uint32_t)(127 - e) << 23);
    return finish(x, rintf(safe * inverse) * spacing, f, OV, NF, FL);
}

/* cast.py _grid_e8: round the bit pattern (drop = 23 - mantissa bits > 0) */
static inline __attribute__((always_inline)) float cast_e8(float x, const numscope_format *f, const int OV, const int NF, const int FL) {
    const float safe = fabsf(x) < INFINITY ? x : 0.0f;
    const int drop = 23 - f->mantissa_bits;
    const uint32_t sb = bits_of(safe);
    uint32_t magnitude = sb & 0x7FFFFFFFu;
    magnitude = magnitude + ((1u << (drop - 1)) - 1u) + ((magnitude >> drop) & 1u);
    magnitude &= ~((1u << drop) - 1u);
    return finish(x, float_of((sb & 0x80000000u) | magnitude), f, OV, NF, FL);
}

static inline __attribute__((always_inline)) float cast_integer(float x, const numscope_format *f, const int OV, const int NF, const int FL) {
    (void)OV, (void)NF, (void)FL;
    return cast_int(x, f);
}

/* The loops of one cast: unscaled; x * s ... * inv with one s; x * s[i] ... * (1 / s[i]); x * s[i] ... * d[i]
 * (tile scaling, each element's scale and decode given) */
#define NUMSCOPE_LOOPS(NAME, CAST, OV, NF, FL)                                                            \
    static void NAME(const float *restrict x, float *restrict out, int64_t n, const float *restrict s,      \
                     const float *restrict d, float scale, float inverse, int scaled,                     \
                     const numscope_format *format) {                                                    \
        const numscope_format local = *format, *f = &local;                                               \
        if (s && d) {                                                                                     \
            for (int64_t i = 0; i < n; ++i) out[i] = CAST(x[i] * s[i], f, OV, NF, FL) * d[i];             \
        } else if (s) {                                                                                   \
            for (int64_t i = 0; i < n; ++i) out[i] = CAST(x[i] * s[i], f, OV, NF, FL) * (1.0f / s[i]);    \
        } else if (scaled) {                                                                             \
            for (int64_t i = 0; i < n; ++i) out[i] = CAST(x[i] * scale, f, OV, NF, FL) * inverse;         \
        } else {                                                                                          \
            for (int64_t i = 0; i < n; ++i) out[i] = CAST(x[i], f, OV, NF, FL);                           \
        }                                                                                                 \
    }
/* the combinations cast.py allows: (overflow, non-finite) per format family, with and without flush */
#define NUMSCOPE_FAMILY(CAST)                                                                             \
    NUMSCOPE_LOOPS(CAST##_00, CAST, 0, 0, 0) NUMSCOPE_LOOPS(CAST##_00f, CAST, 0, 0, 1)                    \
    NUMSCOPE_LOOPS(CAST##_10, CAST, 1, 0, 0) NUMSCOPE_LOOPS(CAST##_10f, CAST, 1, 0, 1)                    \
    NUMSCOPE_LOOPS(CAST##_01, CAST, 0, 1, 0) NUMSCOPE_LOOPS(CAST##_01f, CAST, 0, 1, 1)                    \
    NUMSCOPE_LOOPS(CAST##_21, CAST, 2, 1, 0) NUMSCOPE_LOOPS(CAST##_21f, CAST, 2, 1, 1)                    \
    NUMSCOPE_LOOPS(CAST##_02, CAST, 0, 2, 0) NUMSCOPE_LOOPS(CAST##_02f, CAST, 0, 2, 1)                    \
    static void CAST##_any(const float *restrict x, float *restrict out, int64_t n, const float *restrict s, \
                           const float *restrict d, float scale, float inverse, int scaled,             \
                           const numscope_format *f) {                                                   \
        const int code = f->overflow * 10 + f->nonfinite;                                                 \
        if (code == 0) (f->flush ? CAST##_00f : CAST##_00)(x, out, n, s, d, scale, inverse, scaled, f);     \
        else if (code == 10) (f->flush ? CAST##_10f : CAST##_10)(x, out, n, s, d, scale, inverse, scaled, f); \
        else if (code == 1) (f->flush ? CAST##_01f : CAST##_01)(x, out, n, s, d, scale, inverse, scaled, f); \
        else if (code == 21) (f->flush ? CAST##_21f : CAST##_21)(x, out, n, s, d, scale, inverse, scaled, f); \
        else (f->flush ? CAST##_02f : CAST##_02)(x, out, n, s, d, scale, inverse, scaled, f);               \
    }
NUMSCOPE_FAMILY(cast_small)
NUMSCOPE_FAMILY(cast_e8)
NUMSCOPE_LOOPS(cast_integer_any, cast_integer, 0, 0, 0)

/* n elements of x: unscaled (s NULL, scaled 0), times scale then inverse (scaled 1), per element s[i] and
 * 1 / s[i], or per element s[i] and d[i] */
static inline __attribute__((always_inline)) void run_cast(const float *restrict x, float *restrict out, int64_t n, const float *restrict s,
                            const float *restrict d, float scale, float inverse, int scaled, const numscope_format *f) {
    if (f->kind == 0) cast_small_any(x, out, n, s, d, scale, inverse, scaled, f);
    else if (f->kind == 1) cast_e8_any(x, out, n, s, d, scale, inverse, scaled, f);
    else cast_integer_any(x, out, n, s, d, scale, inverse, scaled, f);
}

/* cast(x), or cast(x * s) * (1 / s) with s: scale[0] (mode 1), scale[row] (2), scale[col] (3) */
void numscope_element(const float *restrict x, float *restrict out, int64_t rows, int64_t cols,
                      numscope_format format, const float *restrict scale, int32_t scale_mode) {
    const numscope_format *f = &format;
    if (scale_mode == 0) {
        run_cast(x, out, rows * cols, NULL, NULL, 1.0f, 1.0f, 0, f);
    } else if (scale_mode == 1) {
        run_cast(x, out, rows * cols, NULL, NULL, scale[0], 1.0f / scale[0], 1, f);
    } else {
        for (int64_t r = 0; r < rows; ++r) {
            if (scale_mode == 2) run_cast(x + r * cols, out + r * cols, cols, NULL, NULL, scale[r], 1.0f / scale[r], 1, f);
            else run_cast(x + r * cols, out + r * cols, cols, scale, NULL, 1.0f, 1.0f, 0, f);
        }
    }
}

/* scaling.py log2_floor: floor(log2 x) for positive float32, subnormals included; -127 for zero */
static inline __attribute__((always_inline)) int log2_floor(float x) {
    const int field = (int)((bits_of(x) >> 23) & 0xFFu);
    const int lifted = (int)((bits_of(x * 18446744073709551616.0f) >> 23) & 0xFFu) - (127 + 64); /* subnormal */
    const int small = x > 0.0f ? lifted : -127;
    return field > 0 ? field - 127 : small;
}

/* scaling.py exact_pow2: 2^e exactly, e in [-149, 127] (branch-free: it runs once per block) */
static inline __attribute__((always_inline)) float exact_pow2(int e) {
    const float normal = float_of((uint32_t)((e < -126 ? -126 : e) + 127) << 23);
    int shift = e + 149;
    shift = shift < 0 ? 0 : (shift > 22 ? 22 : shift);
    return e >= -126 ? normal : float_of(1u << shift);
}

/* max |x| of each column over rows [start, start + height), on the bit patterns (their order is the
 * magnitudes': inf above the finite, NaN above inf), into top[0..cols): a loop along the rows, which
 * vectorizes, for blocks down the columns and for column amaxes */
static inline __attribute__((always_inline)) void column_tops(const float *restrict x, int64_t start, int64_t height,
                                                              int64_t cols, uint32_t *restrict top) {
    for (int64_t c = 0; c < cols; ++c) top[c] = 0;
    for (int64_t r = start; r < start + height; ++r) {
        const float *xr = x + r * cols;
        for (int64_t c = 0; c < cols; ++c) {
            const uint32_t magnitude = bits_of(xr[c]) & 0x7FFFFFFFu;
            top[c] = magnitude > top[c] ? magnitude : top[c];
        }
    }
}

/* blocks.py _mx_shared_exponent; rule 0 floor, 1 ceil, 2 even (half = 2^(22 - element mantissa bits)),
 * 3 rceil */
static inline __attribute__((always_inline)) int mx_shared_exponent(float amax, int rule, int emax, float element_max, uint32_t half) {
    if (rule == 3) {
        const float ratio = amax / element_max;
        if (!(ratio > 0.0f)) return -127;
        const int below = log2_floor(ratio);
        return below + (exact_pow2(below) != ratio);
    }
    if (rule == 1) {
        const int below = log2_floor(amax);
        return below + (exact_pow2(below) != amax) - emax;
    }
    if (rule == 2) {
        const float rounded = float_of((bits_of(amax) + half) & 0x7F800000u);
        return log2_floor(rounded) - emax;
    }
    return log2_floor(amax) - emax;
}

/* Block formats. Each block gets, from its amax, a factor, a mask m (0 or 1) and an output scale; its
 * elements become CAST(x * factor) * m * out (x / factor where DIV). A block with a non-finite element is
 * NaN throughout (factor and out NaN), as the reference's NaN scale makes it.
 *   MX (blocks.py _mx_parts): factor 2^-s, m 1, out 2^s, s the E8M0 exponent of the scale rule.
 *   NVFP4 (blocks.py _nvfp4_candidate), S the per-tensor encode scale, T 6:
 *     multiply (Transformer Engine): stored = e4m3(min(amax * (S * f32(1/T)), FLT_MAX)),
 *       decode = stored * f32(1/S), factor min(1 / decode, FLT_MAX);
 *     divide: stored = e4m3(min(amax / T * S, FLT_MAX)), decode = stored / S, factor decode > 0 ? decode : 1;
 *     m = stored > 0, out = decode. */
typedef struct {
    int32_t kind;       /* 0 MX, 1 NVFP4 multiply, 2 NVFP4 divide */
    int32_t rule, emax; /* MX */
    uint32_t half;      /* MX "even" rule */
    float element_max;  /* MX "rceil" rule */
    float encode, inverse_encode, target, inverse_target; /* NVFP4: S, f32(1 / S), T, f32(1 / T) */
    numscope_format scale_format;                         /* NVFP4: E4M3, saturating */
} numscope_blocks;

/* NVFP4 (blocks.py _nvfp4_candidate): a block's E4M3 scale as stored, from its amax */
static inline __attribute__((always_inline)) float nvfp4_stored(float amax, const numscope_blocks *p, const int KIND) {
    float wanted = KIND == 1 ? amax * (p->encode * p->inverse_target) : amax / p->target * p->encode;
    wanted = wanted > FLT_MAX ? FLT_MAX : wanted;
    return cast_small(wanted, &p->scale_format, 0, 1, 0);
}

/* NVFP4: from the stored scale, the factor of the elements (x * factor, or x / factor where KIND 2) and the
 * decode scale that multiplies them */
static inline __attribute__((always_inline)) void nvfp4_factors(float stored, const numscope_blocks *p, const int KIND,
                                                                float *factor, float *decode) {
    if (KIND == 1) {
        *decode = stored * p->inverse_encode;
        const float inverse = 1.0f / *decode;
        *factor = inverse > FLT_MAX ? FLT_MAX : inverse;
    } else {
        *decode = stored / p->encode;
        *factor = *decode > 0.0f ? *decode : 1.0f;
    }
}

static inline __attribute__((always_inline)) void block_factors(uint32_t top, const numscope_blocks *p, const int KIND,
                                                                float *factor, float *mask, float *out) {
    const float amax = float_of(top);
    const int finite = top < 0x7F800000u;
    float f, m, o;
    if (KIND == 0) {
        int shared = mx_shared_exponent(amax, p->rule, p->emax, p->element_max, p->half);
        shared = shared < -127 ? -127 : (shared > 127 ? 127 : shared);
        f = exact_pow2(-shared);
        m = 1.0f;
        o = exact_pow2(shared);
    } else {
        const float stored = nvfp4_stored(amax, p, KIND);
        nvfp4_factors(stored, p, KIND, &f, &o);
        m = stored > 0.0f ? 1.0f : 0.0f;
    }
    *factor = finite ? f : quiet_nan();
    *mask = finite ? m : 1.0f;
    *out = finite ? o : quiet_nan();
}

#define NUMSCOPE_SCALED(CAST, NF, FL, DIV, X, FACTOR, MASK, OUT) \
    (CAST((DIV) ? (X) / (FACTOR) : (X) * (FACTOR), f, 0, NF, FL) * (MASK) * (OUT))

/* a decode scale below 2^100 keeps every element's product finite (the largest element of any block format
 * is E5M2's 57344 < 2^16): only blocks at larger scales pay for saturate_f32 */
#define NUMSCOPE_SMALL_SCALE(OUT) ((OUT) < 0x1p100f)

/* blocks of B consecutive elements (B a constant in the common cases), in chunks of up to 64 blocks: their
 * amaxes, then their scales (a loop over blocks, which vectorizes), then their elements */
#define NUMSCOPE_ROW_BLOCKS(B, CAST, NF, FL, DIV, KIND)                                                   \
    for (int64_t start = 0; start < total; start += 64 * (B)) {                                           \
        const int64_t blocks = (total - start) / (B) < 64 ? (total - start) / (B) : 64;                   \
        uint32_t top[64];                                                                                 \
        float factor[64], mask[64], scale[64];                                                            \
        for (int64_t k = 0; k < blocks; ++k) {                                                            \
            const float *xb = x + start + k * (B);                                                        \
            /* max |x| on the bit patterns: their order is the magnitudes' (inf above, NaN above inf) */ \
            uint32_t t = 0;                                                                               \
            for (int i = 0; i < (B); ++i) {                                                               \
                const uint32_t magnitude = bits_of(xb[i]) & 0x7FFFFFFFu;                                  \
                t = magnitude > t ? magnitude : t;                                                        \
            }                                                                                             \
            top[k] = t;                                                                                   \
        }                                                                                                 \
        for (int64_t k = 0; k < blocks; ++k) block_factors(top[k], p, KIND, factor + k, mask + k, scale + k); \
        if (block_scales)                                                                                 \
            for (int64_t k = 0; k < blocks; ++k) block_scales[start / (B) + k] = scale[k];                \
        for (int64_t k = 0; k < blocks; ++k) {                                                            \
            const float *xb = x + start + k * (B);                                                        \
            float *ob = out + start + k * (B);                                                            \
            const float fk = factor[k], mk = mask[k], sk = scale[k];                                      \
            if (NUMSCOPE_SMALL_SCALE(sk))                                                                 \
                for (int i = 0; i < (B); ++i) ob[i] = NUMSCOPE_SCALED(CAST, NF, FL, DIV, xb[i], fk, mk, sk); \
            else                                                                                          \
                for (int i = 0; i < (B); ++i)                                                             \
                    ob[i] = saturate_f32(NUMSCOPE_SCALED(CAST, NF, FL, DIV, xb[i], fk, mk, sk));          \
        }                                                                                                 \
    }

/* blocks along the rows of one row (``total`` = cols elements from ``row``, results to ``row_out``): the
 * row loops above, on a row that the column pass has just brought into cache */
#define NUMSCOPE_ONE_ROW(B, CAST, NF, FL, DIV, KIND, ROW, ROW_OUT)                                        \
    {                                                                                                     \
        const float *x = (ROW);                                                                           \
        float *out = (ROW_OUT), *block_scales = NULL;                                                     \
        const int64_t total = cols;                                                                       \
        NUMSCOPE_ROW_BLOCKS(B, CAST, NF, FL, DIV, KIND)                                                   \
    }

/* blocks down the columns: block b of column c is rows [b*B, b*B + B) of c; the last may be short (the
 * reference zero-pads it, which changes no amax). Loops run along the rows: no transposed copy. ROWS_TOO
 * (a constant): also blocks along each row into out_rows (cols a multiple of block_size), while the row is
 * in cache: both directions from one read of x, each band of block_size rows read from memory once. */
#define NUMSCOPE_COLUMN_BLOCKS(CAST, NF, FL, DIV, KIND, ROWS_TOO)                                         \
    for (int64_t start = 0; start < rows; start += block_size) {                                          \
        const int64_t height = rows - start < block_size ? rows - start : block_size;                     \
        column_tops(x, start, height, cols, top);                                                         \
        int small = 1;                                                                                    \
        for (int64_t c = 0; c < cols; ++c) {                                                              \
            block_factors(top[c], p, KIND, factor + c, mask + c, scale + c);                              \
            small &= NUMSCOPE_SMALL_SCALE(scale[c]) || scale[c] != scale[c];                              \
        }                                                                                                 \
        for (int64_t r = start; r < start + height; ++r) {                                                \
            const float *xr = x + r * cols;                                                               \
            float *orow = out + r * cols;                                                                 \
            if (small)                                                                                    \
                for (int64_t c = 0; c < cols; ++c)                                                        \
                    orow[c] = NUMSCOPE_SCALED(CAST, NF, FL, DIV, xr[c], factor[c], mask[c], scale[c]);     \
            else                                                                                          \
                for (int64_t c = 0; c < cols; ++c)                                                        \
                    orow[c] = saturate_f32(NUMSCOPE_SCALED(CAST, NF, FL, DIV, xr[c], factor[c], mask[c], scale[c])); \
            if (ROWS_TOO) {                                                                               \
                float *rrow = out_rows + r * cols;                                                        \
                if (block_size == 32) NUMSCOPE_ONE_ROW(32, CAST, NF, FL, DIV, KIND, xr, rrow)             \
                else if (block_size == 16) NUMSCOPE_ONE_ROW(16, CAST, NF, FL, DIV, KIND, xr, rrow)        \
                else NUMSCOPE_ONE_ROW(block_size, CAST, NF, FL, DIV, KIND, xr, rrow)                      \
            }                                                                                             \
        }                                                                                                 \
    }

typedef void (*blocks_function)(const float *restrict, float *restrict, int64_t, int64_t, int64_t, int,
                                const numscope_format *, const numscope_blocks *, uint32_t *restrict,
                                float *restrict, float *restrict, float *restrict, float *restrict,
                                float *restrict);

/* the loops of one element cast and one kind of block scale: columns, both directions (columns 2), or rows
 * of 32, 16 or other blocks */
#define NUMSCOPE_BLOCK_LOOPS(CAST, NF, FL, DIV, KIND)                                                     \
    if (columns == 2) {                                                                                   \
        NUMSCOPE_COLUMN_BLOCKS(CAST, NF, FL, DIV, KIND, 1)                                                \
    } else if (columns) {                                                                                 \
        NUMSCOPE_COLUMN_BLOCKS(CAST, NF, FL, DIV, KIND, 0)                                                \
    } else if (block_size == 32) {                                                                        \
        NUMSCOPE_ROW_BLOCKS(32, CAST, NF, FL, DIV, KIND)                                                  \
    } else if (block_size == 16) {                                                                        \
        NUMSCOPE_ROW_BLOCKS(16, CAST, NF, FL, DIV, KIND)                                                  \
    } else {                                                                                              \
        NUMSCOPE_ROW_BLOCKS(block_size, CAST, NF, FL, DIV, KIND)                                          \
    }

/* one element cast's block function for one kind of block scale: MX (KIND 0), NVFP4 multiply (1), NVFP4
 * divide (2, whose elements are divided by their factor) */
#define NUMSCOPE_BLOCK_FUNCTION(NAME, CAST, NF, FL, KIND)                                                 \
    static void NAME(const float *restrict x, float *restrict out, int64_t rows, int64_t cols, int64_t columns, \
                     int block_size, const numscope_format *format, const numscope_blocks *params,          \
                     uint32_t *restrict top, float *restrict factor, float *restrict mask, float *restrict scale, \
                     float *restrict block_scales, float *restrict out_rows) {                             \
        const numscope_format local = *format, *f = &local;                                               \
        const numscope_blocks block_local = *params, *p = &block_local;                                   \
        const int64_t total = rows * cols;                                                                \
        NUMSCOPE_BLOCK_LOOPS(CAST, NF, FL, (KIND) == 2, KIND)                                             \
    }
/* what the formats use: MX elements are E4M3 (non-finite kind 1), E5M2 (0), FP6/FP4 (2) or integers;
 * NVFP4's are E2M1 (2). Other combinations return -2 and are left to the other paths. */
NUMSCOPE_BLOCK_FUNCTION(mx_0, cast_small, 0, 0, 0) NUMSCOPE_BLOCK_FUNCTION(mx_0f, cast_small, 0, 1, 0)
NUMSCOPE_BLOCK_FUNCTION(mx_1, cast_small, 1, 0, 0) NUMSCOPE_BLOCK_FUNCTION(mx_1f, cast_small, 1, 1, 0)
NUMSCOPE_BLOCK_FUNCTION(mx_2, cast_small, 2, 0, 0) NUMSCOPE_BLOCK_FUNCTION(mx_2f, cast_small, 2, 1, 0)
NUMSCOPE_BLOCK_FUNCTION(mx_integer, cast_integer, 0, 0, 0)
NUMSCOPE_BLOCK_FUNCTION(nv_multiply, cast_small, 2, 0, 1) NUMSCOPE_BLOCK_FUNCTION(nv_multiply_f, cast_small, 2, 1, 1)
NUMSCOPE_BLOCK_FUNCTION(nv_divide, cast_small, 2, 0, 2) NUMSCOPE_BLOCK_FUNCTION(nv_divide_f, cast_small, 2, 1, 2)

static int blocks_run(const float *restrict x, float *restrict out, int64_t rows, int64_t cols, int32_t columns,
                      int32_t block_size, numscope_format format, numscope_blocks params,
                      float *restrict block_scales, float *restrict out_rows) {
    static const blocks_function mx[3][2] = {{mx_0, mx_0f}, {mx_1, mx_1f}, {mx_2, mx_2f}};
    static const blocks_function nv[2][2] = {{nv_multiply, nv_multiply_f}, {nv_divide, nv_divide_f}};
    const int nf = format.nonfinite, fl = format.flush != 0;
    blocks_function run = NULL;
    if (format.kind == 2) run = params.kind == 0 ? mx_integer : NULL;
    else if (format.kind == 0 && params.kind == 0) run = mx[nf][fl];
    else if (format.kind == 0 && nf == 2) run = nv[params.kind - 1][fl];
    if (!run) return -2;
    void *scratch = NULL;
    if (columns) {
        scratch = malloc((size_t)cols * 16 + 64);
        if (!scratch) return -1;
    }
    uint32_t *top = (uint32_t *)scratch;
    float *factor = columns ? (float *)(top + cols) : NULL;
    float *mask = columns ? factor + cols : NULL, *scale = columns ? mask + cols : NULL;
    if (columns) block_scales = NULL;
    run(x, out, rows, cols, columns, block_size, &format, &params, top, factor, mask, scale, block_scales,
        out_rows);
    free(scratch);
    return 0;
}

/* A block format over a (rows, cols) tensor, blocks along each row (columns 0; cols a multiple of
 * block_size) or down each column (1); block_scales (rows only, may be NULL) receives each block's decode
 * scale (what multiplies its elements), row by row. Returns 0, -1 where scratch memory could not be
 * allocated, -2 for a combination not built here. */
int numscope_blocks_quantize(const float *restrict x, float *restrict out, int64_t rows, int64_t cols,
                             int32_t columns, int32_t block_size, numscope_format format, numscope_blocks params,
                             float *restrict block_scales) {
    return blocks_run(x, out, rows, cols, columns != 0, block_size, format, params, block_scales, NULL);
}

/* Both directions at once, from one read of x: blocks down the columns into out_columns and along the rows
 * into out_rows (cols a multiple of block_size), each exactly what numscope_blocks_quantize gives. */
int numscope_blocks_quantize_both(const float *restrict x, float *restrict out_rows, float *restrict out_columns,
                                  int64_t rows, int64_t cols, int32_t block_size, numscope_format format,
                                  numscope_blocks params) {
    if (cols % block_size) return -2;
    return blocks_run(x, out_columns, rows, cols, 2, block_size, format, params, NULL, out_rows);
}

/* Codes: the rounded value y (on the format's grid, or ±inf/NaN) in the format's own bit layout, as torch's
 * float8/float16/bfloat16 dtypes store it, written beside the descaled values so that a caller can keep
 * the codes (1 or 2 bytes) for backward instead of float32. */
typedef struct {
    int32_t e8;            /* bfloat16: the top half of float32's pattern (encode_e8) */
    int32_t mantissa_bits, bias, emin;
    uint32_t sign_bit;     /* 0x80 or 0x8000 */
    uint32_t exponent_ones; /* the exponent field all ones, at its place (inf where the format has it) */
    uint32_t nan_code;
    float subnormal_units; /* 2^(mantissa_bits - emin): a subnormal's mantissa field from its value */
} numscope_codes;

static inline __attribute__((always_inline)) uint32_t encode_e8(float y, const numscope_codes *c) {
    return (y != y) ? c->nan_code : (bits_of(y) >> 16);
}

static inline __attribute__((always_inline)) uint32_t encode_small(float y, const numscope_codes *c) {
    const uint32_t b = bits_of(y);
    const uint32_t sign = (b >> 31) ? c->sign_bit : 0u;
    const int biased = (int)((b >> 23) & 0xFFu) - 127 + c->bias;
    const uint32_t normal = ((uint32_t)(biased < 1 ? 1 : biased) << c->mantissa_bits) |
                            ((b >> (23 - c->mantissa_bits)) & ((1u << c->mantissa_bits) - 1u));
    const uint32_t subnormal = (uint32_t)(int32_t)(fabsf(y) * c->subnormal_units);
    uint32_t code = biased >= 1 ? normal : subnormal;
    code = fabsf(y) == INFINITY ? c->exponent_ones : code;
    return (y != y) ? c->nan_code : (code | sign);
}

#define NUMSCOPE_CODES_LOOP(NAME, CAST, ENCODE, OV, NF, CODE)                                                     \
    static void NAME(const float *restrict x, float *restrict out, CODE *restrict codes, int64_t n, float scale, \
                     float inverse, int scaled, const numscope_format *format, const numscope_codes *layout) { \
        const numscope_format local = *format, *f = &local;                                               \
        const numscope_codes code_local = *layout, *c = &code_local;                                      \
        if (scaled) {                                                                                     \
            for (int64_t i = 0; i < n; ++i) {                                                             \
                const float y = CAST(x[i] * scale, f, OV, NF, 0);                                          \
                out[i] = y * inverse;                                                                     \
                codes[i] = (CODE)ENCODE(y, c);                                                            \
            }                                                                                             \
        } else {                                                                                          \
            for (int64_t i = 0; i < n; ++i) {                                                             \
                const float y = CAST(x[i], f, OV, NF, 0);                                                  \
                out[i] = y;                                                                               \
                codes[i] = (CODE)ENCODE(y, c);                                                            \
            }                                                                                             \
        }                                                                                                 \
    }
/* the layouts torch has: fp8 E4M3FN (NaN only), E5M2 (inf), the FNUZ pair (NaN only), fp16 (inf), bf16 */
NUMSCOPE_CODES_LOOP(codes8_00, cast_small, encode_small, 0, 0, uint8_t)
NUMSCOPE_CODES_LOOP(codes8_10, cast_small, encode_small, 1, 0, uint8_t)
NUMSCOPE_CODES_LOOP(codes8_01, cast_small, encode_small, 0, 1, uint8_t)
NUMSCOPE_CODES_LOOP(codes8_21, cast_small, encode_small, 2, 1, uint8_t)
NUMSCOPE_CODES_LOOP(codes16_00, cast_small, encode_small, 0, 0, uint16_t)
NUMSCOPE_CODES_LOOP(codes16_10, cast_small, encode_small, 1, 0, uint16_t)
NUMSCOPE_CODES_LOOP(codes16_e8_00, cast_e8, encode_e8, 0, 0, uint16_t)
NUMSCOPE_CODES_LOOP(codes16_e8_10, cast_e8, encode_e8, 1, 0, uint16_t)

/* numscope_element without flushing, unscaled or with one scale (scale NULL or scale[0]), also writing
 * each result's code (1 or 2 bytes by code_bytes). Returns 0, or -2 for a combination not built here. */
int numscope_element_codes(const float *restrict x, float *restrict out, void *restrict codes, int64_t n,
                           int32_t code_bytes, numscope_format format, numscope_codes layout,
                           const float *restrict scale) {
    const numscope_format *f = &format;
    if (f->flush || f->kind == 2) return -2;
    const float s = scale ? scale[0] : 1.0f, inverse = scale ? 1.0f / scale[0] : 1.0f;
    const int scaled = scale != NULL, mode = f->overflow * 10 + f->nonfinite;
    if (code_bytes == 1 && f->kind == 0) {
        if (mode == 0) codes8_00(x, out, codes, n, s, inverse, scaled, f, &layout);
        else if (mode == 10) codes8_10(x, out, codes, n, s, inverse, scaled, f, &layout);
        else if (mode == 1) codes8_01(x, out, codes, n, s, inverse, scaled, f, &layout);
        else if (mode == 21) codes8_21(x, out, codes, n, s, inverse, scaled, f, &layout);
        else return -2;
    } else if (code_bytes == 2 && f->kind == 0) {
        if (mode == 0) codes16_00(x, out, codes, n, s, inverse, scaled, f, &layout);
        else if (mode == 10) codes16_10(x, out, codes, n, s, inverse, scaled, f, &layout);
        else return -2;
    } else if (code_bytes == 2 && f->kind == 1) {
        if (mode == 0) codes16_e8_00(x, out, codes, n, s, inverse, scaled, f, &layout);
        else if (mode == 10) codes16_e8_10(x, out, codes, n, s, inverse, scaled, f, &layout);
        else return -2;
    } else {
        return -2;
    }
    return 0;
}

/* The inverse: 8-bit codes back to float32 values times a descale (values · descale, one float32 product,
 * as codes.float() * descale in torch; descale NULL: the values alone). The exponent and mantissa fields
 * move into float32's; subnormals are their mantissa times 2^(emin - m), exactly. */
void numscope_decode8(const uint8_t *restrict codes, float *restrict out, int64_t n, numscope_codes layout,
                      const float *restrict descale) {
    const numscope_codes local = layout, *c = &local;
    const uint32_t mask = (1u << c->mantissa_bits) - 1u;
    const float d = descale ? descale[0] : 1.0f, subnormal_unit = 1.0f / c->subnormal_units;
    const int fnuz = c->nan_code == c->sign_bit, fn = c->nan_code == c->sign_bit - 1u;
    for (int64_t i = 0; i < n; ++i) {
        const uint32_t code = codes[i], magnitude = code & (c->sign_bit - 1u);
        const uint32_t field = magnitude >> c->mantissa_bits, mantissa = magnitude & mask;
        const float normal = float_of(((uint32_t)((int)field - c->bias + 127) << 23) |
                                      (mantissa << (23 - c->mantissa_bits)));
        float v = field ? normal : (float)(int32_t)mantissa * subnormal_unit;
        v = (code & c->sign_bit) ? -v : v; /* FNUZ's 0x80 is NaN, below */
        const int nan = fnuz ? code == c->nan_code : (fn ? magnitude == c->nan_code : (magnitude > c->exponent_ones));
        v = (!fn && !fnuz && magnitude == c->exponent_ones) ? copysignf(INFINITY, v) : v;
        v = nan ? quiet_nan() : v;
        out[i] = descale ? v * d : v;
    }
}

/* Block formats down the columns kept compactly: each element's code (1 byte, the element format's bit
 * layout) and each block's scale code: MX, the E8M0 code (exponent + 127; 255, NaN, for a block with a
 * non-finite element); NVFP4, the stored E4M3 scale's code (its NaN code for such a block). The element
 * codes of a NaN block carry nothing. Unpacking gives what numscope_blocks_quantize gives for the same
 * blocks, bit for bit: the element value (exact in float32) times the block's mask and decode scale,
 * recomputed from the scale code as the quantizer computed them. Float elements only (their values are
 * finite under the saturating cast). */
static inline __attribute__((always_inline)) float decode_finite(uint32_t code, const numscope_codes *c) {
    const uint32_t magnitude = code & (c->sign_bit - 1u);
    const uint32_t field = magnitude >> c->mantissa_bits, mantissa = magnitude & ((1u << c->mantissa_bits) - 1u);
    const float normal = float_of(((uint32_t)((int)field - c->bias + 127) << 23) | (mantissa << (23 - c->mantissa_bits)));
    const float v = field ? normal : (float)(int32_t)mantissa * (1.0f / c->subnormal_units);
    return (code & c->sign_bit) ? -v : v;
}

#define NUMSCOPE_BLOCK_PACK(NAME, NF, KIND)                                                               \
    static void NAME(const float *restrict x, uint8_t *restrict codes, uint8_t *restrict scale_codes,      \
                     int64_t rows, int64_t cols, int block_size, const numscope_format *format,            \
                     const numscope_blocks *params, const numscope_codes *layout,                          \
                     const numscope_codes *scale_layout, uint32_t *restrict top, float *restrict factor) { \
        const numscope_format local = *format, *f = &local;                                               \
        const numscope_blocks block_local = *params, *p = &block_local;                                   \
        const numscope_codes code_local = *layout, *c = &code_local;                                      \
        for (int64_t start = 0, b = 0; start < rows; start += block_size, ++b) {                          \
            const int64_t height = rows - start < block_size ? rows - start : block_size;                 \
            column_tops(x, start, height, cols, top);                                                     \
            for (int64_t j = 0; j < cols; ++j) {                                                          \
                const int finite = top[j] < 0x7F800000u;                                                  \
                uint32_t scale_code;                                                                      \
                if (KIND == 0) {                                                                          \
                    int shared = mx_shared_exponent(float_of(top[j]), p->rule, p->emax, p->element_max, p->half); \
                    shared = shared < -127 ? -127 : (shared > 127 ? 127 : shared);                        \
                    factor[j] = exact_pow2(-shared);                                                      \
                    scale_code = (uint32_t)(shared + 127);                                                \
                } else {                                                                                  \
                    const float stored = nvfp4_stored(float_of(top[j]), p, KIND);                         \
                    float decode;                                                                         \
                    nvfp4_factors(stored, p, KIND, factor + j, &decode);                                  \
                    scale_code = encode_small(stored, scale_layout);                                      \
                }                                                                                         \
                factor[j] = finite ? factor[j] : 1.0f;                                                    \
                scale_codes[b * cols + j] = (uint8_t)(finite ? scale_code : scale_layout->nan_code);      \
            }                                                                                             \
            for (int64_t r = start; r < start + height; ++r)                                              \
                for (int64_t j = 0; j < cols; ++j) {                                                      \
                    const float v = x[r * cols + j], k = factor[j];                                        \
                    codes[r * cols + j] = (uint8_t)encode_small(cast_small(KIND == 2 ? v / k : v * k, f, 0, NF, 0), c); \
                }                                                                                         \
        }                                                                                                 \
    }
NUMSCOPE_BLOCK_PACK(mx_pack_0, 0, 0) NUMSCOPE_BLOCK_PACK(mx_pack_1, 1, 0) NUMSCOPE_BLOCK_PACK(mx_pack_2, 2, 0)
NUMSCOPE_BLOCK_PACK(nv_pack_multiply, 2, 1) NUMSCOPE_BLOCK_PACK(nv_pack_divide, 2, 2)

/* scale_layout: MX, an E8M0 layout whose nan_code is 255; NVFP4, E4M3's. Returns 0, -1 where scratch memory
 * could not be allocated, -2 for an element format not built here. */
int numscope_block_pack_columns(const float *restrict x, uint8_t *restrict codes, uint8_t *restrict scale_codes,
                                int64_t rows, int64_t cols, int32_t block_size, numscope_format format,
                                numscope_blocks params, numscope_codes layout, numscope_codes scale_layout) {
    if (format.kind != 0 || format.flush || (params.kind != 0 && format.nonfinite != 2)) return -2;
    void *scratch = malloc((size_t)cols * 8 + 64);
    if (!scratch) return -1;
    uint32_t *top = (uint32_t *)scratch;
    float *factor = (float *)(top + cols);
    const numscope_format *f = &format;
    const numscope_blocks *p = &params;
    const numscope_codes *c = &layout, *sc = &scale_layout;
    if (params.kind == 1) nv_pack_multiply(x, codes, scale_codes, rows, cols, block_size, f, p, c, sc, top, factor);
    else if (params.kind == 2) nv_pack_divide(x, codes, scale_codes, rows, cols, block_size, f, p, c, sc, top, factor);
    else if (format.nonfinite == 0) mx_pack_0(x, codes, scale_codes, rows, cols, block_size, f, p, c, sc, top, factor);
    else if (format.nonfinite == 1) mx_pack_1(x, codes, scale_codes, rows, cols, block_size, f, p, c, sc, top, factor);
    else mx_pack_2(x, codes, scale_codes, rows, cols, block_size, f, p, c, sc, top, factor);
    free(scratch);
    return 0;
}

/* Returns 0, or -1 where scratch memory could not be allocated. */
int numscope_block_unpack_columns(const uint8_t *restrict codes, const uint8_t *restrict scale_codes,
                                  float *restrict out, int64_t rows, int64_t cols, int32_t block_size,
                                  numscope_codes layout, numscope_codes scale_layout, numscope_blocks params) {
    const numscope_codes *c = &layout, *sc = &scale_layout;
    const numscope_blocks *p = &params;
    float *scratch = (float *)malloc((size_t)cols * 8 + 64);
    if (!scratch) return -1;
    float *mask = scratch, *decode = scratch + cols;
    for (int64_t start = 0; start < rows; start += block_size) {
        const int64_t height = rows - start < block_size ? rows - start : block_size;
        const uint8_t *scales = scale_codes + (start / block_size) * cols;
        for (int64_t j = 0; j < cols; ++j) { /* each block's mask and decode scale, once */
            const uint32_t s = scales[j];
            float m = 1.0f, d, factor;
            if (p->kind == 0) {
                d = exact_pow2((int)s - 127);
            } else {
                const float stored = decode_finite(s, sc);
                m = stored > 0.0f ? 1.0f : 0.0f;
                if (p->kind == 1) nvfp4_factors(stored, p, 1, &factor, &d);
                else nvfp4_factors(stored, p, 2, &factor, &d);
            }
            mask[j] = s == sc->nan_code ? quiet_nan() : m;
            decode[j] = d;
        }
        for (int64_t r = start; r < start + height; ++r)
            for (int64_t j = 0; j < cols; ++j)
                out[r * cols + j] = saturate_f32(decode_finite(codes[r * cols + j], c) * mask[j] * decode[j]);
    }
    free(scratch);
    return 0;
}

/* max |x| as torch's x.abs().amax(...) gives it for finite x (NaN where any element is NaN, inf where the
 * largest is inf; a NaN's payload may differ, which no caller reads): over everything (mode 1, out[0]),
 * per row (2, out[r]) or per column (3, out[c]), taken on the bit patterns (vectorizes, NaN included). */
void numscope_abs_amax(const float *restrict x, float *restrict out, int64_t rows, int64_t cols, int32_t mode) {
    if (mode == 3) {
        column_tops(x, 0, rows, cols, (uint32_t *)out);
        return;
    }
    const int64_t n = mode == 1 ? rows * cols : cols;
    for (int64_t r = 0; r < (mode == 1 ? 1 : rows); ++r) {
        const float *xr = x + r * n;
        uint32_t top = 0;
        for (int64_t i = 0; i < n; ++i) {
            const uint32_t magnitude = bits_of(xr[i]) & 0x7FFFFFFFu;
            top = magnitude > top ? magnitude : top;
        }
        out[r] = float_of(top);
    }
}

/* gemm.py accumulate_matmul's narrow accumulator: `chunks` partial sums of each of n outputs (partials laid
 * out [batch][chunks][n]), each rounded, added in order with a rounding after every addition; with
 * per_group < chunks, each run of per_group partials so and the runs' sums added in float32 (the promotion).
 * An e8 format (fp22 = e8m13) under "propagate" overflow without flushing, as accumulate_matmul's rounding;
 * returns -1 for any other format (the caller then loops eagerly). Tiles of outputs keep a run's sum in L1. */
int numscope_rounded_sum(const float *restrict partials, float *restrict out, int64_t batch, int64_t chunks,
                         int64_t n, int64_t per_group, numscope_format format) {
    const numscope_format local = format, *f = &local;
    if (f->kind != 1 || f->overflow != 1 || f->nonfinite != 0 || f->flush != 0 || per_group < 1) return -1;
    enum { TILE = 2048 };
    float run[TILE];
    for (int64_t b = 0; b < batch; ++b) {
        const float *restrict p = partials + b * chunks * n;
        float *restrict o = out + b * n;
        for (int64_t start = 0; start < n; start += TILE) {
            const int64_t width = n - start < TILE ? n - start : TILE;
            for (int64_t first = 0; first < chunks; first += per_group) {
                const int64_t last = first + per_group < chunks ? first + per_group : chunks;
                const float *restrict q = p + first * n + start;
                for (int64_t j = 0; j < width; ++j) run[j] = cast_e8(q[j], f, 1, 0, 0);
                for (int64_t i = first + 1; i < last; ++i) {
                    q = p + i * n + start;
                    for (int64_t j = 0; j < width; ++j) run[j] = cast_e8(run[j] + cast_e8(q[j], f, 1, 0, 0), f, 1, 0, 0);
                }
                if (first == 0) {
                    for (int64_t j = 0; j < width; ++j) o[start + j] = run[j];
                } else {
                    for (int64_t j = 0; j < width; ++j) o[start + j] = o[start + j] + run[j];
                }
            }
        }
    }
    return 0;
}

/* quantize.py tile_quantize's amax: max |x| over each rp x cp tile of a (batch, rows, cols) tensor (the
 * last tiles of a row or column may be short: the reference pads them with zeros, which no amax sees),
 * into out (batch, ceil(rows / rp), ceil(cols / cp)), on the bit patterns as numscope_abs_amax. Wide tiles
 * (as numscope_tile_element decides) in loops along their rows; narrow ones (one column wide, down the
 * tokens) from each tile row's column maxima (column_tops, which vectorizes), then each tile's maximum of
 * its columns. -1: no memory. */
int numscope_tile_amax(const float *restrict x, float *restrict out, int64_t batch, int64_t rows, int64_t cols,
                       int64_t rp, int64_t cp) {
    const int64_t tile_rows = (rows + rp - 1) / rp, tile_cols = (cols + cp - 1) / cp;
    uint32_t *restrict columns = malloc((size_t)cols * sizeof(uint32_t));
    if (!columns) return -1;
    for (int64_t b = 0; b < batch; ++b) {
        for (int64_t tr = 0; tr < tile_rows; ++tr) {
            const int64_t height = (tr + 1) * rp < rows ? rp : rows - tr * rp;
            uint32_t *restrict top = (uint32_t *)(out + (b * tile_rows + tr) * tile_cols);
            if (cp >= 32) { /* wide tiles: each tile's rows in loops along them */
                for (int64_t tc = 0; tc < tile_cols; ++tc) top[tc] = 0;
                for (int64_t r = tr * rp; r < tr * rp + height; ++r) {
                    const float *restrict xr = x + (b * rows + r) * cols;
                    for (int64_t tc = 0; tc < tile_cols; ++tc) {
                        const int64_t end = (tc + 1) * cp < cols ? (tc + 1) * cp : cols;
                        uint32_t t = top[tc];
                        for (int64_t c = tc * cp; c < end; ++c) {
                            const uint32_t magnitude = bits_of(xr[c]) & 0x7FFFFFFFu;
                            t = magnitude > t ? magnitude : t;
                        }
                        top[tc] = t;
                    }
                }
                continue;
            }
            column_tops(x + b * rows * cols, tr * rp, height, cols, columns);
            for (int64_t tc = 0, c = 0; tc < tile_cols; ++tc) {
                uint32_t t = 0;
                for (int64_t k = 0; k < cp && c < cols; ++k, ++c) t = columns[c] > t ? columns[c] : t;
                top[tc] = t;
            }
        }
    }
    free(columns);
    return 0;
}

/* quantize.py tile_quantize's cast: codes = cast(x * scale[t]), out = codes * decode[t], with scale and decode
 * one per tile (laid out as numscope_tile_amax's out); codes written where codes_out is not NULL. Each tile
 * row's scales are laid out along a row first where tiles are narrow, so that every row is one vectorized
 * loop (a tile one column wide, down the tokens, would otherwise be a call per element); wide tiles take a
 * loop each with their scale a constant. -1: no memory. */
int numscope_tile_element(const float *restrict x, float *restrict out, float *restrict codes_out, int64_t batch,
                          int64_t rows, int64_t cols, int64_t rp, int64_t cp, numscope_format format,
                          const float *restrict scale, const float *restrict decode) {
    const numscope_format *f = &format;
    const int64_t tile_rows = (rows + rp - 1) / rp, tile_cols = (cols + cp - 1) / cp;
    float *buffer = malloc((size_t)(3 * cols) * sizeof(float));
    if (!buffer) return -1;
    float *restrict s = buffer, *restrict d = buffer + cols, *restrict ones = buffer + 2 * cols;
    for (int64_t c = 0; c < cols; ++c) ones[c] = 1.0f;
    for (int64_t b = 0; b < batch; ++b) {
        for (int64_t tr = 0; tr < tile_rows; ++tr) {
            const float *restrict ts = scale + (b * tile_rows + tr) * tile_cols;
            const float *restrict td = decode + (b * tile_rows + tr) * tile_cols;
            const int64_t last = (tr + 1) * rp < rows ? (tr + 1) * rp : rows;
            if (cp >= 32) { /* wide tiles: one loop per tile, its scale a constant */
                for (int64_t r = tr * rp; r < last; ++r) {
                    const int64_t offset = (b * rows + r) * cols;
                    for (int64_t tc = 0; tc < tile_cols; ++tc) {
                        const int64_t start = tc * cp, width = (start + cp < cols ? start + cp : cols) - start;
                        float *restrict target = (codes_out ? codes_out : out) + offset + start;
                        run_cast(x + offset + start, target, width, NULL, NULL, ts[tc], codes_out ? 1.0f : td[tc], 1, f);
                        if (codes_out)
                            for (int64_t i = 0; i < width; ++i) out[offset + start + i] = target[i] * td[tc];
                    }
                }
                continue;
            }
            for (int64_t tc = 0, c = 0; tc < tile_cols; ++tc)
                for (int64_t k = 0; k < cp && c < cols; ++k, ++c) s[c] = ts[tc], d[c] = td[tc];
            for (int64_t r = tr * rp; r < last; ++r) {
                const int64_t offset = (b * rows + r) * cols;
                float *restrict target = codes_out ? codes_out + offset : out + offset;
                const float *restrict factor = codes_out ? ones : d;
                run_cast(x + offset, target, cols, s, factor, 1.0f, 1.0f, 0, f);
                if (codes_out)
                    for (int64_t c = 0; c < cols; ++c) out[offset + c] = codes_out[offset + c] * d[c];
            }
        }
    }
    free(buffer);
    return 0;
}

/* quantize.py as_float32 of a float64: rounded to odd into float32 (NaN as the nearest cast gives it) */
static inline __attribute__((always_inline)) float to_odd_f32(double d) {
    const float nearest = (float)d;
    const double back = (double)nearest;
    const uint32_t toward_zero = bits_of(nearest) - (fabs(back) > fabs(d) ? 1u : 0u);
    return (back != d && d == d) ? float_of(toward_zero | 1u) : nearest;
}

/* gemm.py _promoted_exact after its matmul: partials [batch][runs * per_run][m][n] (float64 sums of the code
 * products, chunk by chunk), each rounded to the accumulator (to odd into float32, then the e8 format under
 * "propagate"), added in float64 with a rounding after each addition within a run, then
 * total = fma(sa[b][i][run] * sb[b][run][j], run_sum, total) in float32 (DeepGEMM's promotion). An e8
 * format only (fp22); returns -1 for any other. */
int numscope_promoted_sum(const double *restrict partials, float *restrict out, const float *restrict sa,
                          const float *restrict sb, int64_t batch, int64_t runs, int64_t per_run, int64_t m,
                          int64_t n, numscope_format format) {
    const numscope_format local = format, *f = &local;
    if (f->kind != 1 || f->overflow != 1 || f->nonfinite != 0 || f->flush != 0 || per_run < 1) return -1;
    enum { TILE = 1024 };
    double run[TILE];
    const int64_t plane = m * n;
    for (int64_t b = 0; b < batch; ++b) {
        const double *restrict p = partials + b * runs * per_run * plane;
        for (int64_t i = 0; i < m; ++i) {
            float *restrict o = out + b * plane + i * n;
            for (int64_t start = 0; start < n; start += TILE) {
                const int64_t width = n - start < TILE ? n - start : TILE;
                for (int64_t j = 0; j < width; ++j) o[start + j] = 0.0f;
                for (int64_t g = 0; g < runs; ++g) {
                    const double *restrict q = p + g * per_run * plane + i * n + start;
                    for (int64_t j = 0; j < width; ++j) run[j] = (double)cast_e8(to_odd_f32(q[j]), f, 1, 0, 0);
                    for (int64_t k = 1; k < per_run; ++k) {
                        q += plane;
                        for (int64_t j = 0; j < width; ++j) {
                            const double term = (double)cast_e8(to_odd_f32(q[j]), f, 1, 0, 0);
                            run[j] = (double)cast_e8(to_odd_f32(run[j] + term), f, 1, 0, 0);
                        }
                    }
                    const float row_scale = sa[(b * m + i) * runs + g];
                    const float *restrict column_scales = sb + (b * runs + g) * n + start;
                    for (int64_t j = 0; j < width; ++j)
                        o[start + j] = fmaf(row_scale * column_scales[j], (float)run[j], o[start + j]);
                }
            }
        }
    }
    return 0;
}

/* cast.py _grid_small under rounding="stochastic": floor(x / spacing + u) * spacing with u the caller's
 * uniform draw in [0, 1) for this element (torch.rand of the tensor's shape: the eager path's own draw),
 * then the same overflow, flush, zero and non-finite rules as the nearest casts */
static inline __attribute__((always_inline)) float cast_small_sr(float x, float u, const numscope_format *f, const int OV, const int NF, const int FL) {
    const float safe = fabsf(x) < INFINITY ? x : 0.0f;
    int e = (int)((bits_of(safe) >> 23) & 0xFFu) - 127;
    e = e < f->emin ? f->emin : e;
    e -= f->mantissa_bits;
    e = e > 126 ? 126 : e;
    const float spacing = float_of((uint32_t)(e + 127) << 23);
    const float inverse = float_of((uint32_t)(127 - e) << 23);
    return finish(x, floorf(safe * inverse + u) * spacing, f, OV, NF, FL);
}

#define NUMSCOPE_SR_LOOP(NAME, OV, NF, FL)                                                                \
    static void NAME(const float *restrict x, const float *restrict u, float *restrict out, int64_t n,      \
                     const numscope_format *format) {                                                    \
        const numscope_format local = *format, *f = &local;                                               \
        for (int64_t i = 0; i < n; ++i) out[i] = cast_small_sr(x[i], u[i], f, OV, NF, FL);                 \
    }
NUMSCOPE_SR_LOOP(sr_00, 0, 0, 0) NUMSCOPE_SR_LOOP(sr_00f, 0, 0, 1)
NUMSCOPE_SR_LOOP(sr_10, 1, 0, 0) NUMSCOPE_SR_LOOP(sr_10f, 1, 0, 1)
NUMSCOPE_SR_LOOP(sr_01, 0, 1, 0) NUMSCOPE_SR_LOOP(sr_01f, 0, 1, 1)
NUMSCOPE_SR_LOOP(sr_21, 2, 1, 0) NUMSCOPE_SR_LOOP(sr_21f, 2, 1, 1)
NUMSCOPE_SR_LOOP(sr_02, 0, 2, 0) NUMSCOPE_SR_LOOP(sr_02f, 0, 2, 1)

/* stochastic rounding of n elements to a float format with fewer than 8 exponent bits; -1 for another kind */
int numscope_element_stochastic(const float *restrict x, const float *restrict u, float *restrict out, int64_t n,
                                numscope_format format) {
    const numscope_format *f = &format;
    if (f->kind != 0) return -1;
    const int code = f->overflow * 10 + f->nonfinite;
    if (code == 0) (f->flush ? sr_00f : sr_00)(x, u, out, n, f);
    else if (code == 10) (f->flush ? sr_10f : sr_10)(x, u, out, n, f);
    else if (code == 1) (f->flush ? sr_01f : sr_01)(x, u, out, n, f);
    else if (code == 21) (f->flush ? sr_21f : sr_21)(x, u, out, n, f);
    else if (code == 2) (f->flush ? sr_02f : sr_02)(x, u, out, n, f);
    else return -1;
    return 0;
}
