/* The peak of the bytes a process holds through malloc and its kin: every tensor torch allocates on the CPU,
 * every Python object outside the small-object arenas. Unlike the peak RSS it leaves out the freed blocks glibc
 * keeps resident, so it is what any allocator would have to hold at least, as on a GPU (where the caching
 * allocator plays glibc's part). Loaded into a process with LD_PRELOAD by benchmark/speed.py, which builds it:
 *
 *     cc -O2 -shared -fPIC -o live_heap.so benchmark/live_heap.c
 *     LD_PRELOAD=$PWD/live_heap.so LIVE_HEAP_OUTPUT=peak.txt python ...
 *
 * At exit the process writes its peak (bytes) to the file $LIVE_HEAP_OUTPUT named when it started (read then, so
 * the process may unset both variables to keep its own children out). Counted: the usable size of each block (the request rounded up
 * by glibc), so the figure is what glibc hands out, blocks it maps itself included. Not counted: memory mapped
 * directly (the safetensors files that models are loaded from, Python's small-object arenas, thread stacks).
 * Allocation goes to glibc's own entry points, so the allocator's behaviour is unchanged. */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

extern void *__libc_malloc(size_t size);
extern void __libc_free(void *block);
extern void *__libc_calloc(size_t count, size_t size);
extern void *__libc_realloc(void *block, size_t size);
extern void *__libc_memalign(size_t alignment, size_t size);

static long live_bytes = 0, peak_bytes = 0;

static void count(long delta) {
    long now = __atomic_add_fetch(&live_bytes, delta, __ATOMIC_RELAXED);
    long peak = __atomic_load_n(&peak_bytes, __ATOMIC_RELAXED);
    while (now > peak &&
           !__atomic_compare_exchange_n(&peak_bytes, &peak, now, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

static void *counted(void *block) {
    if (block) count((long)malloc_usable_size(block));
    return block;
}

void *malloc(size_t size) { return counted(__libc_malloc(size)); }
void *calloc(size_t count_, size_t size) { return counted(__libc_calloc(count_, size)); }
void *memalign(size_t alignment, size_t size) { return counted(__libc_memalign(alignment, size)); }
void *aligned_alloc(size_t alignment, size_t size) { return memalign(alignment, size); }
void *valloc(size_t size) { return memalign(sysconf(_SC_PAGESIZE), size); }

void free(void *block) {
    if (block) count(-(long)malloc_usable_size(block));
    __libc_free(block);
}

void *realloc(void *block, size_t size) {
    long before = block ? (long)malloc_usable_size(block) : 0;
    void *moved = __libc_realloc(block, size);
    if (moved)
        count((long)malloc_usable_size(moved) - before);
    else if (size == 0)  /* realloc(block, 0) frees the block */
        count(-before);
    return moved;
}

int posix_memalign(void **result, size_t alignment, size_t size) {  /* torch's CPU allocator */
    void *block = __libc_memalign(alignment, size);
    if (!block) return ENOMEM;
    *result = counted(block);
    return 0;
}

/* For tests and probes: ctypes.CDLL(None).live_heap_bytes() in a process that loaded the shim. */
long live_heap_bytes(void) { return __atomic_load_n(&live_bytes, __ATOMIC_RELAXED); }
long live_heap_peak_bytes(void) { return __atomic_load_n(&peak_bytes, __ATOMIC_RELAXED); }

static char output[4096];

__attribute__((constructor)) static void read_output(void) {
    const char *path = getenv("LIVE_HEAP_OUTPUT");
    if (path) snprintf(output, sizeof output, "%s", path);
}

__attribute__((destructor)) static void write_peak(void) {
    if (!output[0]) return;
    FILE *out = fopen(output, "w");
    if (!out) return;
    fprintf(out, "%ld\n", __atomic_load_n(&peak_bytes, __ATOMIC_RELAXED));
    fclose(out);
}
