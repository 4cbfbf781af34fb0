/* int4 weight x float activation products for x86 CPUs with AVX-512 VNNI or AVX2 (+ FMA, F16C) and
 * ARM64 ones with NEON dot products (ARMv8.2), as an ONNX Runtime custom operator (runtime/platform/kernels/__init__.py builds and loads this file,
 * with the compiler flags of the best instruction set the CPU has).
 *
 * Computes what com.microsoft::MatMulNBits computes for bits=4, block_size=32 (its weights, with
 * or without zero points; plus, for a GGUF's Q4_1 blocks, their minimums' term) at accuracy level 4: the activations quantized to int8 per block of 32
 * (one float scale each), the products in int32 with vpdpbusd, each block's sum scaled in float;
 * its scales are kept as float16 (as llama.cpp's q4_0 keeps them: a relative change of at most
 * 2^-11, against the ~1% the int8 activations already make). ONNX Runtime's own kernel reads an
 * int4 step at ~2.2x the memory's floor on a 2-core Zen 4 (docs/benchmarks.md, "This project's
 * int4 kernel"); this layout feeds 16 output rows from each 64-byte load and reads 12% fewer bytes:
 *
 *   packed weights: groups of 16 output rows; per group, per block of 32 inputs, GROUP_BLOCK bytes:
 *     256 B  four 64-byte vectors; vector q, lane r (4 bytes) = row r's bytes 4q..4q+3 of the
 *            block as MatMulNBits stores them (byte j: input 2j in the low nibble, 2j+1 high)
 *      32 B  the 16 rows' scales, float16
 *       8 B  the 16 rows' zero points, 4 bits each (row 2i low, 2i+1 high; 8 where MatMulNBits
 *            has none)
 *
 * Weights are packed once, from Python, into a table of this library (q4_pack); a graph's node
 * names its entry by an attribute, so the graph holds no copy of them.
 *
 * Activations of 16 bits (what MatMulNBits at accuracy level 1 asks for: float products) are two
 * int8 passes over the same unpacked weights: each block quantized to c = round(a * 127 * 254 / amax)
 * in [-32258, 32258] and split c = 254 q1 + q2 (q1 the 8-bit pass's value, |q2| <= 127), the block's
 * integer sum 254 (w . q1) + (w . q2) exact in int32 (and in float for 4 bits: < 2^24): the activations
 * within 1/64516 of their block's largest, against 1/254 at 8 bits.
 *
 * AVX2 reads the same layout a 256-bit half (8 rows) at a time and sums the int8 products with
 * vpmaddubsw + vpmaddwd instead of vpdpbusd (8-bit weights as signed bytes w - 128, so that the
 * 16-bit pairs cannot saturate); the integer sums are the same, and every float step (scales,
 * accumulation, a block's float sum) runs in the same order, so both give the same floats.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/mman.h>
#if defined(__x86_64__)
#include <immintrin.h>
static inline uint16_t to_half(float f) { return _cvtss_sh(f, 0); } /* round to nearest even */
#else
#include <arm_neon.h>
static inline uint16_t to_half(float f) { __fp16 h = (__fp16)f; uint16_t u; memcpy(&u, &h, 2); return u; }
#endif

#define GROUP 16
#define BLOCK 32
#define GROUP_BLOCK (256 + 32 + 8)
#define GROUP_BLOCK8 (512 + 32 + 16) /* 8-bit weights: the same, a byte a weight and a byte a zero point */
#define M_TILE 4 /* activation rows that share one unpacking of a group's block */

typedef struct {
    int64_t k, n, blocks, groups, bits, stride; /* stride: GROUP_BLOCK (4 bits) or GROUP_BLOCK8 (8 bits) */
    uint8_t *data; /* groups x blocks x stride, in an arena of huge pages */
    struct arena *home; /* the arena that holds data */
    uint16_t *mins; /* groups x blocks x 16 float16 (a GGUF Q4_1's minimums: w = d q + m), or NULL */
    size_t bytes;
} q4_weight;

/* The table: chunks of CHUNK entries that never move once made, so a session reading an entry
 * never races a pack that grows the table; packs take the lock (ctypes lets go of the GIL). */
#define CHUNK 1024
#define CHUNKS 4096
static q4_weight **chunks[CHUNKS];
static int64_t table_len;
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;

/* Packed weights live in arenas of 2 MiB pages (transparent huge pages where Linux allows: a step
 * streams them), shared by consecutive weights: a weight of its own 2 MiB-aligned block would take
 * a whole huge page even when it is a few hundred KiB (SmolLM2-135M's products: 121 of them, 0.3-0.5
 * MiB each, made 170 MiB resident more than the weights). An arena is freed with its last weight. */
#define HUGE ((size_t)2 << 20)
#define ARENA ((size_t)32 << 20)
typedef struct arena {
    uint8_t *base;
    size_t size, used;
    int live; /* weights still in it */
    struct arena *next;
} arena;
static arena *arenas; /* the newest first: the one weights go into while they fit */
static pthread_mutex_t arena_lock = PTHREAD_MUTEX_INITIALIZER;

/* An arena is mapped, not malloc'd, so that its memory leaves with it: a block from malloc may sit
 * on the heap (glibc raises its mmap threshold after large frees) and stay resident once freed. */
static arena *new_arena(size_t size) {
    arena *a = calloc(1, sizeof *a);
    if (!a) return NULL;
    size = (size + HUGE - 1) / HUGE * HUGE;
    size_t span = size + HUGE; /* room to start on a 2 MiB boundary; the rest unmapped */
    uint8_t *raw = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) { free(a); return NULL; }
    uint8_t *p = (uint8_t *)(((uintptr_t)raw + HUGE - 1) & ~(uintptr_t)(HUGE - 1));
    if (p > raw) munmap(raw, (size_t)(p - raw));
    if (raw + span > p + size) munmap(p + size, (size_t)(raw + span - (p + size)));
#ifdef MADV_HUGEPAGE
    madvise(p, size, MADV_HUGEPAGE);
#endif
    a->base = p;
    a->size = size;
    return a;
}

/* bytes (zeroed, 64-byte aligned) for a weight, and the arena that holds them; NULL when out of
 * memory. A weight larger than half an arena gets one of its own. */
static uint8_t *arena_alloc(size_t bytes, arena **home) {
    bytes = (bytes + 63) / 64 * 64;
    pthread_mutex_lock(&arena_lock);
    arena *a = arenas;
    if (!a || a->size - a->used < bytes) {
        a = new_arena(bytes > ARENA / 2 ? bytes : ARENA);
        if (a) { a->next = arenas; arenas = a; }
    }
    uint8_t *p = NULL;
    if (a) {
        p = a->base + a->used;
        a->used += bytes;
        a->live++;
        *home = a;
    }
    pthread_mutex_unlock(&arena_lock);
    if (p) memset(p, 0, bytes);
    return p;
}

static void arena_release(arena *home) {
    pthread_mutex_lock(&arena_lock);
    if (--home->live == 0) {
        for (arena **link = &arenas; *link; link = &(*link)->next)
            if (*link == home) { *link = home->next; break; }
        munmap(home->base, home->size);
        free(home);
    }
    pthread_mutex_unlock(&arena_lock);
}

/* Packs a MatMulNBits weight of 4 bits (b: n x blocks x 16 bytes, z: n x ceil(blocks/2) bytes
 * or NULL) or 8 bits (b: n x blocks x 32 bytes, z: n x blocks bytes or NULL), s: n x blocks
 * floats, and its minimums (mn: n x blocks floats, added as mn * the block's sum of a; NULL: none)
 * into the table; returns its handle, -1 when out of memory.
 *
 * 8 bits: per group, per block, eight 64-byte vectors, vector q < 4, lane r = row r's weights of
 * inputs 2(4q)..2(4q+3) (the even ones), vector 4 + q the odd ones: the partners of the same
 * quantized activations as the 4-bit layout's low and high nibbles; then the 16 scales (float16)
 * and the 16 zero points (a byte each; 128 where MatMulNBits has none). */
static int64_t pack(const uint8_t *b, const float *s, const uint8_t *z, const float *mn, int64_t k, int64_t n,
                    int64_t bits);

int64_t q4_pack(const uint8_t *b, const float *s, const uint8_t *z, const float *mn, int64_t k, int64_t n) {
    return pack(b, s, z, mn, k, n, 4);
}

int64_t q8_pack(const uint8_t *b, const float *s, const uint8_t *z, const float *mn, int64_t k, int64_t n) {
    return pack(b, s, z, mn, k, n, 8);
}

static void pack_block8(uint8_t *p, const uint8_t *b, const float *s, const uint8_t *z, int64_t g, int64_t j,
                        int64_t blocks, int64_t n) {
    for (int r = 0; r < GROUP; r++) {
        int64_t row = g * GROUP + r;
        if (row >= n) { p[544 + r] = 128; continue; } /* padding rows */
        const uint8_t *src = b + ((size_t)row * blocks + j) * BLOCK;
        for (int q = 0; q < 4; q++)
            for (int i = 0; i < 4; i++) {
                p[q * 64 + r * 4 + i] = src[2 * (4 * q + i)];
                p[(4 + q) * 64 + r * 4 + i] = src[2 * (4 * q + i) + 1];
            }
        uint16_t h = to_half(s[(size_t)row * blocks + j]);
        memcpy(p + 512 + r * 2, &h, 2);
        p[544 + r] = z ? z[(size_t)row * blocks + j] : 128;
    }
}

static int64_t pack(const uint8_t *b, const float *s, const uint8_t *z, const float *mn, int64_t k, int64_t n,
                    int64_t bits) {
    int64_t blocks = k / BLOCK, zbytes = (blocks + 1) / 2, groups = (n + GROUP - 1) / GROUP;
    q4_weight *w = calloc(1, sizeof *w);
    if (!w) return -1;
    w->k = k; w->n = n; w->blocks = blocks; w->groups = groups; w->bits = bits;
    w->stride = bits == 8 ? GROUP_BLOCK8 : GROUP_BLOCK;
    w->bytes = (size_t)groups * blocks * w->stride;
    w->data = arena_alloc(w->bytes, &w->home);
    if (!w->data) { free(w); return -1; }
    if (mn) {
        w->mins = calloc((size_t)groups * blocks * GROUP, sizeof *w->mins);
        if (!w->mins) { arena_release(w->home); free(w); return -1; }
        for (int64_t row = 0; row < n; row++)
            for (int64_t j = 0; j < blocks; j++)
                w->mins[((size_t)(row / GROUP) * blocks + j) * GROUP + row % GROUP] = to_half(mn[(size_t)row * blocks + j]);
    }
    for (int64_t g = 0; g < groups; g++)
        for (int64_t j = 0; j < blocks; j++) {
            uint8_t *p = w->data + ((size_t)g * blocks + j) * w->stride;
            if (bits == 8) { pack_block8(p, b, s, z, g, j, blocks, n); continue; }
            for (int r = 0; r < GROUP; r++) {
                int64_t row = g * GROUP + r;
                if (row >= n) { p[288 + r / 2] |= (uint8_t)(8 << ((r & 1) * 4)); continue; } /* padding rows */
                const uint8_t *src = b + ((size_t)row * blocks + j) * 16;
                for (int q = 0; q < 4; q++) memcpy(p + q * 64 + r * 4, src + q * 4, 4);
                uint16_t h = to_half(s[(size_t)row * blocks + j]);
                memcpy(p + 256 + r * 2, &h, 2);
                int zv = z ? (z[(size_t)row * zbytes + j / 2] >> ((j & 1) * 4)) & 15 : 8;
                p[288 + r / 2] = (uint8_t)((p[288 + r / 2] & (r & 1 ? 0x0F : 0xF0)) | (zv << ((r & 1) * 4)));
            }
        }
    pthread_mutex_lock(&table_lock);
    int64_t handle = table_len;
    if (handle >= (int64_t)CHUNK * CHUNKS) handle = -1;
    else if (!chunks[handle / CHUNK]) {
        q4_weight **chunk = calloc(CHUNK, sizeof *chunk);
        if (chunk) __atomic_store_n(&chunks[handle / CHUNK], chunk, __ATOMIC_RELEASE);
        else handle = -1;
    }
    if (handle >= 0) {
        __atomic_store_n(&chunks[handle / CHUNK][handle % CHUNK], w, __ATOMIC_RELEASE);
        table_len++;
    }
    pthread_mutex_unlock(&table_lock);
    if (handle < 0) { arena_release(w->home); free(w->mins); free(w); }
    return handle;
}

static q4_weight *lookup(int64_t handle) {
    if (handle < 0 || handle >= (int64_t)CHUNK * CHUNKS) return NULL;
    q4_weight **chunk = __atomic_load_n(&chunks[handle / CHUNK], __ATOMIC_ACQUIRE);
    return chunk ? __atomic_load_n(&chunk[handle % CHUNK], __ATOMIC_ACQUIRE) : NULL;
}

/* A packed weight's bytes (its table entry's data, *bytes long) and minimums (GROUP float16s a group
 * and block, or NULL): for tests, which run another instruction set's products over them. */
const uint8_t *q4_packed(int64_t handle, int64_t *bytes, const uint16_t **mins) {
    const q4_weight *w = lookup(handle);
    if (!w) return NULL;
    *bytes = (int64_t)w->bytes;
    *mins = w->mins;
    return w->data;
}

void q4_free(int64_t handle) {
    q4_weight *w = lookup(handle);
    if (!w) return;
    __atomic_store_n(&chunks[handle / CHUNK][handle % CHUNK], NULL, __ATOMIC_RELEASE);
    arena_release(w->home);
    free(w->mins);
    free(w);
}

/* An activation block quantized: its 16 even and 16 odd inputs (the low and high nibbles'
 * partners), at 16 bits their second pass (even2, odd2: c = 254 q + q2), the float scale of one unit
 * of the block's integers (c at 16 bits), their sum (for the zero points) and the float values' sum
 * (for the minimums: as exact as ONNX Runtime's ReduceSum of the same term). */
typedef struct {
    int8_t even[16], odd[16], even2[16], odd2[16];
    float scale;
    int32_t sum;
    float fsum;
} act_block;

#define WIDE 254 /* 16-bit activations: c = WIDE q + q2 */

#if defined(__x86_64__)
/* a[0..7] + a[8..15] of two vectors of 8 partial sums, in one fixed order (the order GCC's
 * _mm512_reduce_add_ps takes), so that every instruction set sums a block alike */
static inline float sum8(__m256 lo, __m256 hi) {
    __m256 t3 = _mm256_add_ps(hi, lo);
    __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}
#endif

/* a block's 32 rounded int8 values q (and at 16 bits the second pass's q2 = round((x - q) WIDE),
 * x = a 127 / amax, clamped to int8), split into the even and odd inputs, with their sum and scale */
static inline void store_block(act_block *out, const float *x, const int32_t *q, float amax, int wide) {
    int32_t sum = 0;
    for (int i = 0; i < BLOCK; i++) {
        int32_t c = q[i];
        if (wide) {
            int32_t q2 = (int32_t)__builtin_lrintf((x[i] - (float)q[i]) * (float)WIDE);
            q2 = q2 > 127 ? 127 : q2 < -127 ? -127 : q2;
            (i & 1 ? out->odd2 : out->even2)[i / 2] = (int8_t)q2;
            c = WIDE * q[i] + q2;
        }
        (i & 1 ? out->odd : out->even)[i / 2] = (int8_t)q[i];
        sum += c;
    }
    out->scale = wide ? amax / (127.f * WIDE) : amax / 127.f;
    out->sum = sum;
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)

static void quantize(const float *a, int64_t blocks, int float_sums, int wide, act_block *out) {
    for (int64_t j = 0; j < blocks; j++) {
        __m512 v0 = _mm512_loadu_ps(a + j * BLOCK), v1 = _mm512_loadu_ps(a + j * BLOCK + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        __m512 inv = _mm512_set1_ps(amax > 0 ? 127.f / amax : 0.f);
        float x[BLOCK];
        int32_t q[BLOCK];
        _mm512_storeu_ps(x, _mm512_mul_ps(v0, inv));
        _mm512_storeu_ps(x + 16, _mm512_mul_ps(v1, inv));
        _mm512_storeu_si512(q, _mm512_cvtps_epi32(_mm512_loadu_ps(x))); /* rounds to nearest */
        _mm512_storeu_si512(q + 16, _mm512_cvtps_epi32(_mm512_loadu_ps(x + 16)));
        store_block(out + j, x, q, amax, wide);
        if (float_sums) { /* read by minimums alone */
            __m256 s = _mm256_add_ps(_mm512_castps512_ps256(v0), _mm512_castps512_ps256(v1));
            __m256 t = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v0), 1)),
                                     _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v1), 1)));
            out[j].fsum = sum8(s, t);
        } else out[j].fsum = 0.f;
    }
}

/* the 16 rows' w . a over a block: lo/hi the weights of its even/odd inputs */
static inline __m512i block_dot(const __m512i *lo, const __m512i *hi, const int8_t *even, const int8_t *odd) {
    const int32_t *e = (const int32_t *)even, *o = (const int32_t *)odd;
    __m512i acc = _mm512_setzero_si512(), acc2 = _mm512_setzero_si512();
    for (int q = 0; q < 4; q++) {
        acc = _mm512_dpbusd_epi32(acc, lo[q], _mm512_set1_epi32(e[q]));
        acc2 = _mm512_dpbusd_epi32(acc2, hi[q], _mm512_set1_epi32(o[q]));
    }
    return _mm512_add_epi32(acc, acc2);
}

/* y[m, g*16 .. g*16+15] for activation rows m0 .. m0+mt-1 (mt <= M_TILE) */
static void group_rows(const q4_weight *w, int64_t g, const act_block *act, int64_t m0, int mt, int wide, float *y) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 f[M_TILE];
    for (int t = 0; t < M_TILE; t++) f[t] = _mm512_setzero_ps();
    const uint8_t *p = w->data + (size_t)g * w->blocks * w->stride;
    const uint16_t *mins = w->mins ? w->mins + (size_t)g * w->blocks * GROUP : NULL;
    for (int64_t j = 0; j < w->blocks; j++, p += w->stride) {
        for (int64_t o = 0; o < w->stride; o += 64) /* ~14 (4 bits) or ~7 (8 bits) blocks ahead */
            _mm_prefetch((const char *)(p + 4096 + o), _MM_HINT_T0);
        __m512i lo[4], hi[4], zp;
        __m512 scale;
        if (w->bits == 8) { /* the even inputs' weights, then the odd ones', a byte each */
            for (int q = 0; q < 4; q++) {
                lo[q] = _mm512_loadu_si512(p + q * 64);
                hi[q] = _mm512_loadu_si512(p + (4 + q) * 64);
            }
            zp = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 544)));
            scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 512)));
        } else {
            for (int q = 0; q < 4; q++) {
                __m512i x = _mm512_loadu_si512(p + q * 64);
                lo[q] = _mm512_and_si512(x, low);
                hi[q] = _mm512_and_si512(_mm512_srli_epi16(x, 4), low);
            }
            __m128i z8 = _mm_loadl_epi64((const __m128i *)(p + 288));
            __m128i zlo = _mm_and_si128(z8, _mm_set1_epi8(0x0F)), zhi = _mm_and_si128(_mm_srli_epi16(z8, 4), _mm_set1_epi8(0x0F));
            zp = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(zlo, zhi));
            scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 256)));
        }
        for (int t = 0; t < mt; t++) {
            const act_block *a = act + (m0 + t) * w->blocks + j;
            __m512i acc = block_dot(lo, hi, a->even, a->odd);
            if (wide)
                acc = _mm512_add_epi32(_mm512_mullo_epi32(acc, _mm512_set1_epi32(WIDE)), block_dot(lo, hi, a->even2, a->odd2));
            /* sum_i (q_i - z) a_i = sum_i q_i a_i - z sum_i a_i */
            acc = _mm512_sub_epi32(acc, _mm512_mullo_epi32(zp, _mm512_set1_epi32(a->sum)));
            f[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(scale, _mm512_set1_ps(a->scale)), f[t]);
        }
        if (mins) {
            __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mins + j * GROUP)));
            for (int t = 0; t < mt; t++)
                f[t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(act[(m0 + t) * w->blocks + j].fsum), f[t]);
        }
    }
    int64_t n0 = g * GROUP, left = w->n - n0 < GROUP ? w->n - n0 : GROUP;
    for (int t = 0; t < mt; t++)
        _mm512_mask_storeu_ps(y + (m0 + t) * w->n + n0, (__mmask16)((1u << left) - 1), f[t]);
}

#elif defined(__AVX2__) /* + FMA + F16C: the same products from the same layout, 8 rows a 256-bit half */

static void quantize(const float *a, int64_t blocks, int float_sums, int wide, act_block *out) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t j = 0; j < blocks; j++) {
        __m256 v[4];
        for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(a + j * BLOCK + 8 * i);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
        __m256 inv = _mm256_set1_ps(amax > 0 ? 127.f / amax : 0.f);
        float x[BLOCK];
        int32_t q[BLOCK];
        for (int i = 0; i < 4; i++) { /* rounds to nearest, as the AVX-512 path */
            _mm256_storeu_ps(x + 8 * i, _mm256_mul_ps(v[i], inv));
            _mm256_storeu_si256((__m256i *)(q + 8 * i), _mm256_cvtps_epi32(_mm256_loadu_ps(x + 8 * i)));
        }
        store_block(out + j, x, q, amax, wide);
        out[j].fsum = float_sums ? sum8(_mm256_add_ps(v[0], v[2]), _mm256_add_ps(v[1], v[3])) : 0.f;
    }
}

/* sum_i w_i a_i over 4-byte lanes (vpdpbusd's product): unsigned w against signed a, two at a
 * time in 16 bits; w <= 15 (4 bits) cannot saturate them */
static inline __m256i dot4(__m256i acc, __m256i w, __m256i a) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)));
}

/* the same for 8-bit w as signed w' = w - 128 (|w'| <= 128: the 16-bit pairs cannot saturate);
 * the caller adds 128 times the sum of a */
static inline __m256i dot4s(__m256i acc, __m256i ws, __m256i a) {
    return dot4(acc, _mm256_abs_epi8(ws), _mm256_sign_epi8(a, ws));
}

/* 8 rows' w . a over a block: lo/hi the weights of its even/odd inputs (8-bit ones as w - 128) */
static inline __m256i block_dot(const __m256i *lo, const __m256i *hi, const int8_t *even, const int8_t *odd, int bits) {
    const int32_t *e = (const int32_t *)even, *o = (const int32_t *)odd;
    __m256i acc = _mm256_setzero_si256(), acc2 = _mm256_setzero_si256();
    for (int q = 0; q < 4; q++) {
        if (bits == 8) {
            acc = dot4s(acc, lo[q], _mm256_set1_epi32(e[q]));
            acc2 = dot4s(acc2, hi[q], _mm256_set1_epi32(o[q]));
        } else {
            acc = dot4(acc, lo[q], _mm256_set1_epi32(e[q]));
            acc2 = dot4(acc2, hi[q], _mm256_set1_epi32(o[q]));
        }
    }
    return _mm256_add_epi32(acc, acc2);
}

/* y[m, g*16 .. g*16+15] for activation rows m0 .. m0+mt-1 (mt <= M_TILE) */
static void group_rows(const q4_weight *w, int64_t g, const act_block *act, int64_t m0, int mt, int wide, float *y) {
    const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x80);
    __m256 f[M_TILE][2];
    for (int t = 0; t < M_TILE; t++) f[t][0] = f[t][1] = _mm256_setzero_ps();
    const uint8_t *p = w->data + (size_t)g * w->blocks * w->stride;
    const uint16_t *mins = w->mins ? w->mins + (size_t)g * w->blocks * GROUP : NULL;
    for (int64_t j = 0; j < w->blocks; j++, p += w->stride) {
        for (int64_t o = 0; o < w->stride; o += 64)
            _mm_prefetch((const char *)(p + 4096 + o), _MM_HINT_T0);
        __m128i z16; /* the 16 rows' zero points, a byte each */
        const uint8_t *scales;
        if (w->bits == 8) {
            z16 = _mm_loadu_si128((const __m128i *)(p + 544));
            scales = p + 512;
        } else {
            __m128i z8 = _mm_loadl_epi64((const __m128i *)(p + 288));
            z16 = _mm_unpacklo_epi8(_mm_and_si128(z8, _mm_set1_epi8(0x0F)), _mm_and_si128(_mm_srli_epi16(z8, 4), _mm_set1_epi8(0x0F)));
            scales = p + 256;
        }
        for (int h = 0; h < 2; h++) { /* rows 8h .. 8h+7: bytes 32h .. 32h+31 of every vector */
            __m256i lo[4], hi[4];
            for (int q = 0; q < 4; q++) {
                if (w->bits == 8) { /* as signed bytes w - 128 */
                    lo[q] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + q * 64 + 32 * h)), flip);
                    hi[q] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + (4 + q) * 64 + 32 * h)), flip);
                } else {
                    __m256i x = _mm256_loadu_si256((const __m256i *)(p + q * 64 + 32 * h));
                    lo[q] = _mm256_and_si256(x, low);
                    hi[q] = _mm256_and_si256(_mm256_srli_epi16(x, 4), low);
                }
            }
            __m256i zp = _mm256_cvtepu8_epi32(h ? _mm_unpackhi_epi64(z16, z16) : z16); /* 8 bytes */
            if (w->bits == 8) zp = _mm256_sub_epi32(zp, _mm256_set1_epi32(128)); /* w' + 128 - z */
            __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 16 * h)));
            for (int t = 0; t < mt; t++) {
                const act_block *a = act + (m0 + t) * w->blocks + j;
                __m256i acc = block_dot(lo, hi, a->even, a->odd, (int)w->bits);
                if (wide)
                    acc = _mm256_add_epi32(_mm256_mullo_epi32(acc, _mm256_set1_epi32(WIDE)),
                                           block_dot(lo, hi, a->even2, a->odd2, (int)w->bits));
                acc = _mm256_sub_epi32(acc, _mm256_mullo_epi32(zp, _mm256_set1_epi32(a->sum)));
                f[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(scale, _mm256_set1_ps(a->scale)), f[t][h]);
            }
            if (mins) {
                __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mins + j * GROUP + 8 * h)));
                for (int t = 0; t < mt; t++)
                    f[t][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(act[(m0 + t) * w->blocks + j].fsum), f[t][h]);
            }
        }
    }
    int64_t n0 = g * GROUP, left = w->n - n0 < GROUP ? w->n - n0 : GROUP;
    for (int t = 0; t < mt; t++) {
        float out[GROUP];
        _mm256_storeu_ps(out, f[t][0]);
        _mm256_storeu_ps(out + 8, f[t][1]);
        memcpy(y + (m0 + t) * w->n + n0, out, (size_t)left * sizeof *out);
    }
}

#elif defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
/* ARMv8.2 dot products (Cortex-A76/A78: Raspberry Pi 5, Jetson Orin): the same layout a 16-byte
 * quarter (4 rows) at a time, sdot's signed products (4-bit weights are 0..15 as signed bytes;
 * 8-bit ones signed w - 128, as AVX2's), every float step in the AVX-512 path's order: the same
 * floats as the x86 paths (checked under emulation: tests/runtime/test_kernels.py). */

static void quantize(const float *a, int64_t blocks, int float_sums, int wide, act_block *out) {
    for (int64_t j = 0; j < blocks; j++) {
        const float *b = a + j * BLOCK;
        float32x4_t v[8], m = vdupq_n_f32(0.f);
        for (int i = 0; i < 8; i++) {
            v[i] = vld1q_f32(b + 4 * i);
            m = vmaxq_f32(m, vabsq_f32(v[i]));
        }
        float amax = vmaxvq_f32(m);
        float32x4_t inv = vdupq_n_f32(amax > 0 ? 127.f / amax : 0.f);
        float x[BLOCK];
        int32_t q[BLOCK];
        for (int i = 0; i < 8; i++) {
            float32x4_t xi = vmulq_f32(v[i], inv);
            vst1q_f32(x + 4 * i, xi);
            vst1q_s32(q + 4 * i, vcvtnq_s32_f32(xi)); /* rounds to nearest even, as cvtps */
        }
        store_block(out + j, x, q, amax, wide);
        if (float_sums) { /* sum8's order: lanes i of (a[0..7] + a[16..23]) and (a[8..15] + a[24..31]) */
            float t3[8], t6[4];
            for (int i = 0; i < 8; i++) t3[i] = (b[8 + i] + b[24 + i]) + (b[i] + b[16 + i]);
            for (int i = 0; i < 4; i++) t6[i] = t3[4 + i] + t3[i];
            out[j].fsum = (t6[0] + t6[2]) + (t6[1] + t6[3]);
        } else out[j].fsum = 0.f;
    }
}

/* 4 rows' w . a over a block: lo/hi the weights of its even/odd inputs, 4 bytes a row each */
static inline int32x4_t block_dot(const int8x16_t *lo, const int8x16_t *hi, const int8_t *even, const int8_t *odd) {
    const int32_t *e = (const int32_t *)even, *o = (const int32_t *)odd;
    int32x4_t acc = vdupq_n_s32(0), acc2 = vdupq_n_s32(0);
    for (int q = 0; q < 4; q++) {
        acc = vdotq_s32(acc, lo[q], vreinterpretq_s8_s32(vdupq_n_s32(e[q])));
        acc2 = vdotq_s32(acc2, hi[q], vreinterpretq_s8_s32(vdupq_n_s32(o[q])));
    }
    return vaddq_s32(acc, acc2);
}

/* y[m, g*16 .. g*16+15] for activation rows m0 .. m0+mt-1 (mt <= M_TILE) */
static void group_rows(const q4_weight *w, int64_t g, const act_block *act, int64_t m0, int mt, int wide, float *y) {
    float32x4_t f[M_TILE][4];
    for (int t = 0; t < M_TILE; t++)
        for (int c = 0; c < 4; c++) f[t][c] = vdupq_n_f32(0.f);
    const uint8_t *p = w->data + (size_t)g * w->blocks * w->stride;
    const uint16_t *mins = w->mins ? w->mins + (size_t)g * w->blocks * GROUP : NULL;
    for (int64_t j = 0; j < w->blocks; j++, p += w->stride) {
        int32_t zp[GROUP];
        const uint8_t *scales = p + (w->bits == 8 ? 512 : 256);
        for (int r = 0; r < GROUP; r++) /* w - z; 8-bit weights are read as w - 128, so z - 128 */
            zp[r] = w->bits == 8 ? p[544 + r] - 128 : (p[288 + r / 2] >> ((r & 1) * 4)) & 15;
        for (int c = 0; c < 4; c++) { /* rows 4c .. 4c+3: bytes 16c .. 16c+15 of every vector */
            int8x16_t lo[4], hi[4];
            for (int q = 0; q < 4; q++) {
                if (w->bits == 8) {
                    lo[q] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(p + q * 64 + 16 * c), vdupq_n_u8(0x80)));
                    hi[q] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(p + (4 + q) * 64 + 16 * c), vdupq_n_u8(0x80)));
                } else {
                    uint8x16_t x = vld1q_u8(p + q * 64 + 16 * c);
                    lo[q] = vreinterpretq_s8_u8(vandq_u8(x, vdupq_n_u8(0x0F)));
                    hi[q] = vreinterpretq_s8_u8(vshrq_n_u8(x, 4));
                }
            }
            int32x4_t z = vld1q_s32(zp + 4 * c);
            float32x4_t scale = vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(scales + 8 * c)));
            for (int t = 0; t < mt; t++) {
                const act_block *a = act + (m0 + t) * w->blocks + j;
                int32x4_t acc = block_dot(lo, hi, a->even, a->odd);
                if (wide) acc = vaddq_s32(vmulq_n_s32(acc, WIDE), block_dot(lo, hi, a->even2, a->odd2));
                acc = vsubq_s32(acc, vmulq_n_s32(z, a->sum));
                f[t][c] = vfmaq_f32(f[t][c], vcvtq_f32_s32(acc), vmulq_n_f32(scale, a->scale));
            }
            if (mins) {
                float32x4_t mv = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(mins + j * GROUP + 4 * c)));
                for (int t = 0; t < mt; t++)
                    f[t][c] = vfmaq_n_f32(f[t][c], mv, act[(m0 + t) * w->blocks + j].fsum);
            }
        }
    }
    int64_t n0 = g * GROUP, left = w->n - n0 < GROUP ? w->n - n0 : GROUP;
    for (int t = 0; t < mt; t++) {
        float out[GROUP];
        for (int c = 0; c < 4; c++) vst1q_f32(out + 4 * c, f[t][c]);
        memcpy(y + (m0 + t) * w->n + n0, out, (size_t)left * sizeof *out);
    }
}

#else
#error "q4_vnni.c is written for AVX-512 VNNI, AVX2 with FMA and F16C, or ARMv8.2 NEON with dot products"
#endif

/* Every activation row of a (m x k) quantized for weight w at 8 or 16 bits (wide), with their float
 * sums where it has minimums; NULL when out of memory. */
static act_block *quantize_rows(const q4_weight *w, const float *a, int64_t m, int wide) {
    act_block *act = malloc((size_t)(m ? m : 1) * w->blocks * sizeof *act);
    if (act)
        for (int64_t i = 0; i < m; i++) quantize(a + i * w->k, w->blocks, w->mins != NULL, wide, act + i * w->blocks);
    return act;
}

typedef struct {
    const q4_weight *w;
    const act_block *act;
    int64_t m;
    int wide; /* 16-bit activations */
    float *y;
    int64_t per_item; /* groups a work item runs */
} job;

static void run_items(const job *jb, int64_t first, int64_t last) {
    for (int64_t g = first * jb->per_item; g < last * jb->per_item && g < jb->w->groups; g++)
        for (int64_t m0 = 0; m0 < jb->m; m0 += M_TILE)
            group_rows(jb->w, g, jb->act, m0, (int)(jb->m - m0 < M_TILE ? jb->m - m0 : M_TILE), jb->wide, jb->y);
}

static void run_item(void *data, size_t i) { run_items((const job *)data, (int64_t)i, (int64_t)i + 1); }

/* y (m x n) = a (m x k) times the weight's transpose, the activations at act_bits 8 or 16, on the
 * calling thread (tests call this). */
int q4_matmul(int64_t handle, const float *a, int64_t m, float *y, int64_t act_bits) {
    const q4_weight *w = lookup(handle);
    if (!w) return -1;
    if (act_bits != 8 && act_bits != 16) return -3;
    act_block *act = quantize_rows(w, a, m, act_bits == 16);
    if (!act) return -2;
    job jb = {w, act, m, act_bits == 16, y, 1};
    run_items(&jb, 0, w->groups);
    free(act);
    return 0;
}

/* ---- ONNX Runtime custom operator: skipdecode.Q4MatMul(A) -> Y, attributes K, N, handle, activations
 * (8 or 16: the bits of the quantized activations) ----
 * ONNX Runtime's C API is a table of function pointers that only ever grows at its end
 * (OrtApi); this file declares no header of it, only the entries it calls, by position. */

typedef void *ort_status; /* OrtStatus*; NULL is success */
typedef const void *const *ort_api; /* the table */

#define ORT_API_VERSION_USED 17 /* ONNX Runtime 1.17: KernelContext_ParallelFor arrived */
enum { /* positions in OrtApi */
    API_CreateCustomOpDomain = 26,
    API_CustomOpDomain_Add = 27,
    API_AddCustomOpDomain = 28,
    API_GetTensorMutableData = 51,
    API_GetDimensionsCount = 61,
    API_GetDimensions = 62,
    API_GetTensorTypeAndShape = 65,
    API_KernelInfoGetAttribute_int64 = 86,
    API_KernelContext_GetInput = 90,
    API_KernelContext_GetOutput = 91,
    API_ReleaseTensorTypeAndShapeInfo = 99,
    API_KernelContext_ParallelFor = 274,
};
#define CALL(api, idx, type) ((type)(api)[idx])
#define TRY(expr) do { ort_status st_ = (expr); if (st_) return st_; } while (0)

typedef ort_status (*create_status_fn)(int code, const char *msg);
typedef ort_status (*get_int_fn)(const void *info, const char *name, int64_t *out);
typedef ort_status (*get_input_fn)(const void *context, size_t index, const void **out);
typedef ort_status (*get_output_fn)(void *context, size_t index, const int64_t *dims, size_t rank, void **out);
typedef ort_status (*type_shape_fn)(const void *value, void **out);
typedef ort_status (*dims_count_fn)(const void *info, size_t *out);
typedef ort_status (*dims_fn)(const void *info, int64_t *out, size_t length);
typedef void (*release_fn)(void *info);
typedef ort_status (*data_fn)(const void *value, void **out);
typedef ort_status (*parallel_fn)(const void *context, void (*fn)(void *, size_t), size_t total, size_t batches,
                                  void *data);

/* OrtCustomOp, as far as its version 17 reads */
typedef struct {
    uint32_t version;
    void *(*CreateKernel)(const void *op, const void *api, const void *info);
    const char *(*GetName)(const void *op);
    const char *(*GetExecutionProviderType)(const void *op);
    int (*GetInputType)(const void *op, size_t index);
    size_t (*GetInputTypeCount)(const void *op);
    int (*GetOutputType)(const void *op, size_t index);
    size_t (*GetOutputTypeCount)(const void *op);
    void (*KernelCompute)(void *kernel, void *context);
    void (*KernelDestroy)(void *kernel);
    int (*GetInputCharacteristic)(const void *op, size_t index);
    int (*GetOutputCharacteristic)(const void *op, size_t index);
    int (*GetInputMemoryType)(const void *op, size_t index);
    int (*GetVariadicInputMinArity)(const void *op);
    int (*GetVariadicInputHomogeneity)(const void *op);
    int (*GetVariadicOutputMinArity)(const void *op);
    int (*GetVariadicOutputHomogeneity)(const void *op);
    ort_status (*CreateKernelV2)(const void *op, const void *api, const void *info, void **kernel);
    ort_status (*KernelComputeV2)(void *kernel, void *context);
    ort_status (*InferOutputShapeFn)(const void *op, void *context);
    int (*GetStartVersion)(const void *op);
    int (*GetEndVersion)(const void *op);
    void *unread[4]; /* GetMayInplace .. ReleaseAliasMap: versions after 17 */
} custom_op;

typedef struct {
    ort_api api;
    int64_t k, n, handle, activations;
} kernel;

enum { ORT_FAIL = 1, TENSOR_FLOAT = 1, REQUIRED = 0, MEM_DEFAULT = 0 };

static ort_status fail(ort_api api, const char *msg) { return CALL(api, 0, create_status_fn)(ORT_FAIL, msg); }

static ort_status create_kernel(const void *op, const void *api_, const void *info, void **out) {
    (void)op;
    ort_api api = (ort_api)api_;
    kernel *kn = calloc(1, sizeof *kn);
    if (!kn) return fail(api, "Q4MatMul: out of memory");
    kn->api = api;
    get_int_fn get = CALL(api, API_KernelInfoGetAttribute_int64, get_int_fn);
    ort_status st = get(info, "K", &kn->k);
    if (!st) st = get(info, "N", &kn->n);
    if (!st) st = get(info, "handle", &kn->handle);
    if (!st) st = get(info, "activations", &kn->activations);
    if (!st && kn->activations != 8 && kn->activations != 16) st = fail(api, "Q4MatMul: activations must be 8 or 16");
    if (!st && !lookup(kn->handle)) st = fail(api, "Q4MatMul: its handle names no packed weight of this process");
    if (!st && (lookup(kn->handle)->k != kn->k || lookup(kn->handle)->n != kn->n))
        st = fail(api, "Q4MatMul: K and N differ from its packed weight's");
    if (st) { free(kn); return st; }
    *out = kn;
    return NULL;
}

static ort_status compute(void *kn_, void *context) {
    kernel *kn = kn_;
    ort_api api = kn->api;
    const q4_weight *w = lookup(kn->handle);
    const void *a_value = NULL;
    void *info = NULL, *y_value = NULL;
    size_t rank = 0;
    int64_t shape[8];
    TRY(CALL(api, API_KernelContext_GetInput, get_input_fn)(context, 0, &a_value));
    TRY(CALL(api, API_GetTensorTypeAndShape, type_shape_fn)(a_value, &info));
    ort_status st = CALL(api, API_GetDimensionsCount, dims_count_fn)(info, &rank);
    if (!st && (rank < 1 || rank > 8)) st = fail(api, "Q4MatMul: A must have 1 to 8 dimensions");
    if (!st) st = CALL(api, API_GetDimensions, dims_fn)(info, shape, rank);
    CALL(api, API_ReleaseTensorTypeAndShapeInfo, release_fn)(info);
    if (st) return st;
    if (shape[rank - 1] != w->k) return fail(api, "Q4MatMul: A's last dimension is not K");
    int64_t m = 1;
    for (size_t i = 0; i + 1 < rank; i++) m *= shape[i];
    shape[rank - 1] = w->n;
    TRY(CALL(api, API_KernelContext_GetOutput, get_output_fn)(context, 0, shape, rank, &y_value));
    float *a = NULL, *y = NULL;
    TRY(CALL(api, API_GetTensorMutableData, data_fn)(a_value, (void **)&a));
    TRY(CALL(api, API_GetTensorMutableData, data_fn)(y_value, (void **)&y));
    if (m == 0) return NULL;
    act_block *act = quantize_rows(w, a, m, kn->activations == 16);
    if (!act) return fail(api, "Q4MatMul: out of memory");
    job jb = {w, act, m, kn->activations == 16, y, 4}; /* 4 groups an item: 64 rows, a few KB of weights per call */
    size_t items = (size_t)((w->groups + jb.per_item - 1) / jb.per_item);
    st = CALL(api, API_KernelContext_ParallelFor, parallel_fn)(context, run_item, items, 0, &jb);
    free(act);
    return st;
}

static const char *op_name(const void *op) { (void)op; return "Q4MatMul"; }
static const char *op_provider(const void *op) { (void)op; return "CPUExecutionProvider"; }
static int op_float(const void *op, size_t i) { (void)op; (void)i; return TENSOR_FLOAT; }
static size_t op_one(const void *op) { (void)op; return 1; }
static void destroy_kernel(void *kn) { free(kn); }
static int op_required(const void *op, size_t i) { (void)op; (void)i; return REQUIRED; }
static int op_memory(const void *op, size_t i) { (void)op; (void)i; return MEM_DEFAULT; }
static int op_int_one(const void *op) { (void)op; return 1; }
static int op_end_version(const void *op) { (void)op; return 0x7fffffff; }

static custom_op q4_op = {
    ORT_API_VERSION_USED, NULL, op_name, op_provider, op_float, op_one, op_float, op_one, NULL, destroy_kernel,
    op_required, op_required, op_memory, op_int_one, op_int_one, op_int_one, op_int_one,
    create_kernel, compute, NULL, op_int_one, op_end_version, {NULL, NULL, NULL, NULL},
};

typedef struct {
    const void *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} ort_api_base;

/* ONNX Runtime calls this when a session's options register the library */
void *RegisterCustomOps(void *options, const ort_api_base *base) {
    ort_api api = base->GetApi(ORT_API_VERSION_USED);
    if (!api) return NULL; /* too old: runtime/kernels checks the version before it registers */
    typedef ort_status (*create_domain_fn)(const char *, void **);
    typedef ort_status (*domain_add_fn)(void *, const void *);
    typedef ort_status (*add_domain_fn)(void *, void *);
    void *domain = NULL;
    TRY(CALL(api, API_CreateCustomOpDomain, create_domain_fn)("skipdecode", &domain));
    TRY(CALL(api, API_CustomOpDomain_Add, domain_add_fn)(domain, &q4_op));
    return CALL(api, API_AddCustomOpDomain, add_domain_fn)(options, domain);
}
