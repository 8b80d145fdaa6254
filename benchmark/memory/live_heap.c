/* The peak of the bytes a process holds through malloc and its kin, counted two ways:
 *   heap     every block: tensors, Python objects outside the small-object arenas, libraries' buffers;
 *   tensors  the blocks of posix_memalign, which torch's CPU allocator calls for every tensor (so does little
 *            else): the CPU's counterpart of torch.cuda.max_memory_allocated.
 * Unlike the peak RSS they leave out the freed blocks that glibc keeps resident, so they are what any allocator
 * would have to hold at least, as on a GPU (where the caching allocator plays glibc's part). Loaded into a process
 * with LD_PRELOAD by benchmark/speed/speed.py, which builds it:
 *
 *     cc -O2 -shared -fPIC -o live_heap.so benchmark/memory/live_heap.c
 *     LD_PRELOAD=$PWD/live_heap.so LIVE_HEAP_OUTPUT=peak.txt python ...
 *
 * At exit the process writes both peaks (bytes, heap then tensors) to the file $LIVE_HEAP_OUTPUT named when it
 * started (read then, so the process may unset both variables to keep its own children out). Counted: the usable
 * size of each block (the request rounded up by glibc), blocks glibc maps itself included. Not counted: memory
 * mapped directly (the safetensors files that models are loaded from, Python's small-object arenas, thread
 * stacks). Allocation goes to glibc's own entry points, so the allocator's behaviour is unchanged; the tensor
 * blocks' addresses sit in a small table (2 MiB) so that free() knows them. */
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

static long live_bytes = 0, peak_bytes = 0, tensor_bytes = 0, tensor_peak_bytes = 0;

static void count_in(long *live, long *peak, long delta) {
    long now = __atomic_add_fetch(live, delta, __ATOMIC_RELAXED);
    long seen = __atomic_load_n(peak, __ATOMIC_RELAXED);
    while (now > seen && !__atomic_compare_exchange_n(peak, &seen, now, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

static void count(long delta) { count_in(&live_bytes, &peak_bytes, delta); }

static void *counted(void *block) {
    if (block) count((long)malloc_usable_size(block));
    return block;
}

/* The tensor blocks: an open-addressing set of addresses (linear probing, deletion by backward shift) under a
 * spin lock. Once full, further tensor blocks count as heap only, and `tensor_overflow` says so. */
#define SLOTS (1 << 17)
static void *slots[SLOTS];
static char table_lock = 0;
static long tensor_overflow = 0;

static size_t slot_of(void *block) { return ((size_t)block >> 4) * 0x9E3779B97F4A7C15ull >> (64 - 17); }
static void lock(void) { while (__atomic_test_and_set(&table_lock, __ATOMIC_ACQUIRE)) {} }
static void unlock(void) { __atomic_clear(&table_lock, __ATOMIC_RELEASE); }

static void remember_tensor(void *block, long size) {
    lock();
    size_t i = slot_of(block), probes = 0;
    while (slots[i] && probes++ < SLOTS / 2) i = (i + 1) & (SLOTS - 1);
    int stored = !slots[i];
    if (stored) slots[i] = block;
    unlock();
    if (stored)
        count_in(&tensor_bytes, &tensor_peak_bytes, size);
    else
        __atomic_add_fetch(&tensor_overflow, 1, __ATOMIC_RELAXED);
}

static int forget_tensor(void *block) {  /* 1 if `block` was a tensor block */
    lock();
    size_t i = slot_of(block);
    while (slots[i] && slots[i] != block) i = (i + 1) & (SLOTS - 1);
    int found = slots[i] == block;
    if (found) {  /* move later entries of the probe run back over the hole */
        size_t hole = i, j = i;
        slots[hole] = 0;
        for (j = (j + 1) & (SLOTS - 1); slots[j]; j = (j + 1) & (SLOTS - 1)) {
            size_t home = slot_of(slots[j]);
            if (((j - home) & (SLOTS - 1)) >= ((j - hole) & (SLOTS - 1))) {
                slots[hole] = slots[j];
                slots[j] = 0;
                hole = j;
            }
        }
    }
    unlock();
    return found;
}

void *malloc(size_t size) { return counted(__libc_malloc(size)); }
void *calloc(size_t count_, size_t size) { return counted(__libc_calloc(count_, size)); }
void *memalign(size_t alignment, size_t size) { return counted(__libc_memalign(alignment, size)); }
void *aligned_alloc(size_t alignment, size_t size) { return memalign(alignment, size); }
void *valloc(size_t size) { return memalign(sysconf(_SC_PAGESIZE), size); }

void free(void *block) {
    if (block) {
        long size = (long)malloc_usable_size(block);
        count(-size);
        if (forget_tensor(block)) count_in(&tensor_bytes, &tensor_peak_bytes, -size);
    }
    __libc_free(block);
}

void *realloc(void *block, size_t size) {
    long before = block ? (long)malloc_usable_size(block) : 0;
    if (block && forget_tensor(block)) count_in(&tensor_bytes, &tensor_peak_bytes, -before);  /* no longer one */
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
    remember_tensor(block, (long)malloc_usable_size(block));
    return 0;
}

/* For tests and probes: ctypes.CDLL(None).live_heap_bytes() in a process that loaded the shim. */
long live_heap_bytes(void) { return __atomic_load_n(&live_bytes, __ATOMIC_RELAXED); }
long live_heap_peak_bytes(void) { return __atomic_load_n(&peak_bytes, __ATOMIC_RELAXED); }
long live_tensor_bytes(void) { return __atomic_load_n(&tensor_bytes, __ATOMIC_RELAXED); }
long live_tensor_peak_bytes(void) { return __atomic_load_n(&tensor_peak_bytes, __ATOMIC_RELAXED); }

static char output[4096];

__attribute__((constructor)) static void read_output(void) {
    const char *path = getenv("LIVE_HEAP_OUTPUT");
    if (path) snprintf(output, sizeof output, "%s", path);
}

__attribute__((destructor)) static void write_peak(void) {
    if (!output[0]) return;
    FILE *out = fopen(output, "w");
    if (!out) return;
    fprintf(out, "%ld %ld %ld\n", live_heap_peak_bytes(), live_tensor_peak_bytes(), tensor_overflow);
    fclose(out);
}
