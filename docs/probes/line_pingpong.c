/* The floor of a cross-CPU handoff on this machine: two processes pinned to CPU 0 and 1 bounce
 * one 8-byte word in shared memory. Prints the one-way time (half a round trip). Used to tell
 * which state the development VM is in before a host latency comparison (docs/PERF.md).
 *
 *   cc -O2 docs/probes/line_pingpong.c -o /tmp/line_pingpong && /tmp/line_pingpong
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void pin(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    sched_setaffinity(0, sizeof s, &s);
}

int main(void) {
    /* Two words on separate 512-byte blocks: one inbox per process. */
    volatile uint64_t *m = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return 1;
    const long n = 1000000;
    pid_t child = fork();
    int me = child == 0;
    pin(me);
    volatile uint64_t *in = m + (me ? 0 : 64), *out = m + (me ? 64 : 0);
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 1; i <= n; i++) {
        if (!me) __atomic_store_n(out, i, __ATOMIC_RELEASE);
        while (__atomic_load_n(in, __ATOMIC_ACQUIRE) != (uint64_t)i) {}
        if (me) __atomic_store_n(out, i, __ATOMIC_RELEASE);
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    if (!me) {
        double us = ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / 1e3;
        printf("one cache line, one way: %.3f us\n", us / n / 2);
        wait(0);
    }
    return 0;
}
