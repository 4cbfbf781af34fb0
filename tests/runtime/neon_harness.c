/* q4_vnni.c's NEON quantize and group_rows with no C library, for tests/runtime/test_kernels_neon.py
 * to run under emulation: harness() multiplies packed bytes (another machine's q4_pack) and stops. */
#include "q4_vnni.c"

/* what the compiler may call (-fno-builtin keeps these loops loops) */
void *memcpy(void *d, const void *s, size_t n) {
    volatile unsigned char *dd = d;
    const volatile unsigned char *ss = s;
    while (n--) *dd++ = *ss++;
    return d;
}
void *memset(void *d, int c, size_t n) {
    volatile unsigned char *dd = d;
    while (n--) *dd++ = (unsigned char)c;
    return d;
}

/* what the packing and the table call: never under emulation */
void *calloc(size_t a, size_t b) { (void)a; (void)b; __builtin_trap(); }
void *malloc(size_t a) { (void)a; __builtin_trap(); }
void free(void *p) { (void)p; }
void *mmap(void *a, size_t b, int c, int d, int e, off_t f) { (void)a; (void)b; (void)c; (void)d; (void)e; (void)f; __builtin_trap(); }
int munmap(void *a, size_t b) { (void)a; (void)b; __builtin_trap(); }
int madvise(void *a, size_t b, int c) { (void)a; (void)b; (void)c; return 0; }
int pthread_mutex_lock(pthread_mutex_t *m) { (void)m; return 0; }
int pthread_mutex_unlock(pthread_mutex_t *m) { (void)m; return 0; }

/* y (m x n) = a (m x k) times the weight packed as data (and mins), activations at 16 bits if wide */
void harness(const uint8_t *data, const uint16_t *mins, int64_t k, int64_t n, int64_t bits, const float *a,
             int64_t m, int64_t wide, float *y, act_block *act) {
    q4_weight w = {k, n, k / BLOCK, (n + GROUP - 1) / GROUP, bits, bits == 8 ? GROUP_BLOCK8 : GROUP_BLOCK,
                   (uint8_t *)data, 0, (uint16_t *)mins, 0};
    for (int64_t i = 0; i < m; i++) quantize(a + i * k, w.blocks, mins != 0, (int)wide, act + i * w.blocks);
    for (int64_t g = 0; g < w.groups; g++)
        for (int64_t m0 = 0; m0 < m; m0 += M_TILE)
            group_rows(&w, g, act, m0, (int)(m - m0 < M_TILE ? m - m0 : M_TILE), (int)wide, y);
    __asm__ volatile("brk #0");
}
