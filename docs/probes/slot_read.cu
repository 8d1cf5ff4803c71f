// Probe (run on a GPU machine): what it costs a kernel to see a small message a CPU thread
// has just written into page-locked memory, for the ways a proxy can write it and a kernel can
// read it. One GPU thread plays the trigger/wait kernel, one CPU thread the proxy:
//   kernel: trigger word := r; wait until the message of round r is visible; read it
//   proxy:  spin on the trigger word; write the message of round r
//   nvcc -O2 -arch=native -Xcompiler -mclflushopt -o /tmp/slot_read docs/probes/slot_read.cu
//   /tmp/slot_read [rounds] [1: only the 8-byte graph-node cases]
// Part 3 (last): the send side of a node — a page-locked data store, the system fence, the stamp.
// Part 1, one kernel looping over the rounds (round trip per round on the host clock; "done ->
// data" on the GPU's global timer). Modes (what the proxy writes, how the kernel learns it):
//   sep:    len + 8 B data in a slot 8 KiB away from the done word; done := r; kernel polls
//           done, then reads len and data (gscomm's staging slots)
//   sep-nt: the same with non-temporal stores for len, data and done (bypass the CPU cache)
//   sep-fl: the same, with clflushopt of the slot's lines before the done store
//   line:   len + data in the done word's own 64-byte line; kernel polls done, then reads them
//   ll:     no done word: 8-byte words of (round << 32 | 4 data bytes), NCCL's LL format; the
//           kernel polls the data words themselves until every flag says round r
//   ll-nt:  ll with non-temporal stores
//   none:   done only (no data), the floor of the handshake
// Part 2, one round per kernel of 256 threads, 100 kernels per CUDA graph (what gscomm's graph
// nodes do), copying `bytes` out of the slot in one of the ways `node` below lists.
#include <cuda_runtime.h>
#include <x86intrin.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

enum Mode { SEP, SEP_NT, SEP_FL, LINE, LL, LL_NT, NONE, NMODES };
static const char *names[] = {"sep", "sep-nt", "sep-fl", "line", "ll", "ll-nt", "none"};

// Word offsets in the page-locked block.
#define TRIG 0
#define DONE 512       /* 4 KiB */
#define SLOT 1024      /* 8 KiB: len at +0, data at +32 (256 B), like gscomm's slots */
#define LLW 2048       /* 16 KiB: LL words */

__device__ __forceinline__ unsigned long long ld_sys(const unsigned long long *p) {
    unsigned long long v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ unsigned long long ld_acq(const unsigned long long *p) {
    unsigned long long v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ unsigned long long now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void rounds(unsigned long long *w, int mode, unsigned long long n, unsigned long long *out) {
    unsigned long long sum = 0, t_read = 0, bad = 0;
    for (unsigned long long r = 1; r <= n; r++) {
        asm volatile("fence.acq_rel.sys;" ::: "memory");
        asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(w + TRIG), "l"(r) : "memory");
        if (mode == LL || mode == LL_NT) {
            unsigned long long a, b;
            do { a = ld_sys(w + LLW); b = ld_sys(w + LLW + 1); } while ((a >> 32) != r || (b >> 32) != r);
            unsigned long long v = (a & 0xffffffffULL) | (b << 32);
            if (v != r * 0x9E3779B97F4A7C15ULL) bad++;
            sum += v;
        } else {
            while (ld_acq(w + DONE) < r) {}
            unsigned long long t0 = now();
            unsigned long long len, v;
            if (mode == NONE) { len = 8; v = r * 0x9E3779B97F4A7C15ULL; }
            else if (mode == LINE) { len = ld_sys(w + DONE + 1); v = ld_sys(w + DONE + 2); }
            else { len = ld_sys(w + SLOT); v = ld_sys(w + SLOT + 32); }
            if (len != 8 || v != r * 0x9E3779B97F4A7C15ULL) bad++;
            sum += v;
            t_read += now() - t0;
        }
    }
    out[0] = sum; out[1] = t_read; out[2] = bad;
}

/* One round per kernel, as gscomm's graph nodes do it: the round number lives in device memory
 * (c[0]); thread 0 triggers and polls, then the block copies `words` 8-byte words of data out of
 * the slot into device memory (c + 64) in one of these ways:
 *   0 all:  every thread reads the length (as gsc_stage_in did), data by ld.relaxed.sys
 *   1 one:  thread 0 reads the length, data by ld.relaxed.sys, 8 B a thread
 *   2 weak: thread 0 reads the length, data by plain loads after the barrier (ordered after
 *           thread 0's ld.acquire.sys of the done word through bar.sync)
 *   3 v2:   as 1 with 16-byte ld.relaxed.sys.v2 loads
 *   4 weak16: as 2 with 16-byte loads */
__global__ void node(unsigned long long *w, int how, unsigned long long words, unsigned long long *c, int flags) {
    __shared__ unsigned long long r, len;
    unsigned t = threadIdx.x;
    if (t == 0) {
        r = c[0] + 1;
        c[0] = r;
        asm volatile("fence.acq_rel.sys;" ::: "memory");
        asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(w + TRIG), "l"(r) : "memory");
        while (ld_acq(w + DONE) < r) {}
        if (how == 5) { len = ld_sys(w + SLOT); c[64] = ld_sys(w + SLOT + 32); }
    }
    __syncthreads();
    if (words == 0) return;
    const unsigned long long *src = w + SLOT + 32;
    unsigned long long *dst = c + 64, n;
    if (how == 0) {
        n = ld_sys(w + SLOT);
        for (unsigned long long i = t; i < words; i += blockDim.x) dst[i] = ld_sys(src + i);
    } else if (how == 5) {
        n = len;
    } else {
        if (t == 0) len = ld_sys(w + SLOT);
        if (how == 1) {
            for (unsigned long long i = t; i < words; i += blockDim.x) dst[i] = ld_sys(src + i);
        } else if (how == 2) {
            for (unsigned long long i = t; i < words; i += blockDim.x) dst[i] = src[i];
        } else if (how == 3) {
            for (unsigned long long i = 2 * t; i < words; i += 2 * blockDim.x) {
                unsigned long long a, b;
                asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(src + i) : "memory");
                dst[i] = a; dst[i + 1] = b;
            }
        } else {
            for (unsigned long long i = 2 * t; i < words; i += 2 * blockDim.x) {
                ulonglong2 v = *(const ulonglong2 *)(src + i);
                dst[i] = v.x; dst[i + 1] = v.y;
            }
        }
        __syncthreads();
        n = len;
    }
    if (t == 0 && n != 8 * words) c[2]++;
    if (!(flags & 2)) {
        __syncthreads();
        for (unsigned long long i = t; i < words; i += blockDim.x)
            if (dst[i] != r * 0x9E3779B97F4A7C15ULL + i) atomicAdd(c + 2, 1ULL);
    }
    if (t == 0 && !(flags & 1)) ((volatile unsigned long long *)w)[SLOT + 16] = r; /* the stamp */
}

static unsigned long long g_words = 1;
/* Part 3: what the send side of a node costs. Thread 0 (bit 0 of `what`) writes 8 bytes of
 * "send data" to page-locked memory, (bit 1) fences at system scope, stores the trigger, polls
 * the done word and reads length + data right after (as gscomm's kernels do now), and (bit 2)
 * stores a stamp to page-locked memory at the end. */
__global__ void send_node(unsigned long long *w, int what, unsigned long long *c) {
    if (threadIdx.x != 0) return;
    unsigned long long r = c[0] + 1;
    c[0] = r;
    if (what & 1) ((volatile unsigned long long *)w)[LLW + 64] = r;
    if (what & 2) asm volatile("fence.acq_rel.sys;" ::: "memory");
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(w + TRIG), "l"(r) : "memory");
    while (ld_acq(w + DONE) < r) {}
    unsigned long long len, v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%2];\n\tld.relaxed.sys.global.u64 %1, [%3];"
                 : "=l"(len), "=l"(v) : "l"(w + SLOT), "l"(w + SLOT + 32) : "memory");
    if (len != 8 || v != r * 0x9E3779B97F4A7C15ULL) c[2]++;
    if (what & 4) ((volatile unsigned long long *)w)[SLOT + 16] = r;
}


static void proxy(volatile unsigned long long *w, int mode, unsigned long long n) {
    for (unsigned long long r = 1; r <= n; r++) {
        while (w[TRIG] < r) _mm_pause();
        unsigned long long v = r * 0x9E3779B97F4A7C15ULL;
        switch (mode) {
        case SEP:
            for (unsigned long long i = 0; i < g_words; i++) w[SLOT + 32 + i] = v + i;
            w[SLOT] = 8 * g_words;
            std::atomic_thread_fence(std::memory_order_release);
            w[DONE] = r;
            break;
        case SEP_NT:
            _mm_stream_si64((long long *)&w[SLOT], 8);
            _mm_stream_si64((long long *)&w[SLOT + 32], (long long)v);
            _mm_sfence();
            _mm_stream_si64((long long *)&w[DONE], (long long)r);
            _mm_sfence();
            break;
        case SEP_FL:
            w[SLOT] = 8; w[SLOT + 32] = v;
            _mm_clflushopt((void *)&w[SLOT]);
            _mm_clflushopt((void *)&w[SLOT + 32]);
            _mm_sfence();
            w[DONE] = r;
            break;
        case LINE:
            w[DONE + 1] = 8; w[DONE + 2] = v;
            std::atomic_thread_fence(std::memory_order_release);
            w[DONE] = r;
            break;
        case LL:
            w[LLW] = (r << 32) | (v & 0xffffffffULL);
            w[LLW + 1] = (r << 32) | (v >> 32);
            break;
        case LL_NT:
            _mm_stream_si64((long long *)&w[LLW], (long long)((r << 32) | (v & 0xffffffffULL)));
            _mm_stream_si64((long long *)&w[LLW + 1], (long long)((r << 32) | (v >> 32)));
            _mm_sfence();
            break;
        case NONE:
            w[DONE] = r;
            break;
        }
    }
}

int main(int argc, char **argv) {
    unsigned long long n = argc > 1 ? strtoull(argv[1], 0, 10) : 20000;
    CK(cudaSetDevice(0));
    unsigned long long *out;
    CK(cudaMalloc(&out, 64));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    printf("%-8s %12s %16s %6s\n", "mode", "round(us)", "done->data(us)", "bad");
    for (int pass = 0; pass < 2; pass++) {
        for (int mode = 0; mode < NMODES; mode++) {
            unsigned long long *w;
            // A fresh block per mode, so every mode starts from zeroed words.
            CK(cudaHostAlloc((void **)&w, 1 << 20, cudaHostAllocMapped | cudaHostAllocPortable));
            memset(w, 0, 1 << 20);
            std::thread t(proxy, (volatile unsigned long long *)w, mode, n);
            auto t0 = std::chrono::steady_clock::now();
            rounds<<<1, 1, 0, s>>>(w, mode, n, out);
            CK(cudaStreamSynchronize(s));
            double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n;
            t.join();
            unsigned long long h[3];
            CK(cudaMemcpy(h, out, sizeof h, cudaMemcpyDeviceToHost));
            if (pass == 1) printf("%-8s %12.2f %16.2f %6llu\n", names[mode], us, h[1] / 1e3 / n, h[2]);
            CK(cudaFreeHost(w));
        }
    }
    // Graph nodes: 100 one-round kernels per graph (256 threads), launched n/100 times.
    static const char *hows[] = {"all", "one", "weak", "v2", "weak16", "t0"};
    printf("%-8s %8s %12s %6s\n", "node", "bytes", "round(us)", "bad");
    int only = argc > 2 ? atoi(argv[2]) : 0;
    for (unsigned long long words : {0ULL, 1ULL, 16ULL, 256ULL, 512ULL, 2048ULL, 8192ULL}) {
      for (int flags = 0; flags < 4; flags++) {
        if (flags && words != 1) break;
        for (int how = 0; how < 6; how++) {
            if (only && words > 1) break;
            if (words == 0 && (how > 0 || flags)) break;
            if (words == 1 && how > 2 && how < 5) continue;
            if (words > 1 && how == 5) continue;
            g_words = words ? words : 1;
            unsigned long long *w, *c;
            CK(cudaHostAlloc((void **)&w, 1 << 20, cudaHostAllocMapped | cudaHostAllocPortable));
            memset(w, 0, 1 << 20);
            CK(cudaMalloc(&c, (64 + 8192) * 8));
            CK(cudaMemset(c, 0, 64 * 8));
            cudaGraph_t g;
            cudaGraphExec_t ge;
            CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            for (int i = 0; i < 100; i++) node<<<1, 256, 0, s>>>(w, how, words, c, flags);
            CK(cudaStreamEndCapture(s, &g));
            CK(cudaGraphInstantiate(&ge, g, 0));
            unsigned long long launches = n / 100, warm = 10;
            std::thread t(proxy, (volatile unsigned long long *)w, SEP, (launches + warm) * 100);
            for (unsigned long long i = 0; i < warm; i++) CK(cudaGraphLaunch(ge, s));
            CK(cudaStreamSynchronize(s));
            auto t0 = std::chrono::steady_clock::now();
            for (unsigned long long i = 0; i < launches; i++) CK(cudaGraphLaunch(ge, s));
            CK(cudaStreamSynchronize(s));
            double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / (launches * 100);
            t.join();
            unsigned long long h[3];
            CK(cudaMemcpy(h, c, sizeof h, cudaMemcpyDeviceToHost));
            printf("%-8s %8llu %12.2f %6llu%s%s\n", words ? hows[how] : "-", 8 * words, us, h[2], flags & 1 ? " no-stamp" : "", flags & 2 ? " no-check" : "");
            CK(cudaGraphExecDestroy(ge));
            CK(cudaGraphDestroy(g));
            CK(cudaFree(c));
            CK(cudaFreeHost(w));
        }
      }
    }
    // Part 3: send-side costs, one-thread nodes (the other 255 threads exit at once).
    printf("%-28s %12s %6s\n", "send side", "round(us)", "bad");
    static const char *whats[] = {"-", "data", "fence", "data+fence", "stamp", "data+stamp", "fence+stamp", "data+fence+stamp"};
    for (int what : {0, 2, 3, 1, 7, 5}) {
        g_words = 1;
        unsigned long long *w, *c;
        CK(cudaHostAlloc((void **)&w, 1 << 20, cudaHostAllocMapped | cudaHostAllocPortable));
        memset(w, 0, 1 << 20);
        CK(cudaMalloc(&c, 64 * 8));
        CK(cudaMemset(c, 0, 64 * 8));
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < 100; i++) send_node<<<1, 256, 0, s>>>(w, what, c);
        CK(cudaStreamEndCapture(s, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        unsigned long long launches = n / 100, warm = 10;
        std::thread t(proxy, (volatile unsigned long long *)w, SEP, (launches + warm) * 100);
        for (unsigned long long i = 0; i < warm; i++) CK(cudaGraphLaunch(ge, s));
        CK(cudaStreamSynchronize(s));
        auto t0 = std::chrono::steady_clock::now();
        for (unsigned long long i = 0; i < launches; i++) CK(cudaGraphLaunch(ge, s));
        CK(cudaStreamSynchronize(s));
        double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / (launches * 100);
        t.join();
        unsigned long long h[3];
        CK(cudaMemcpy(h, c, sizeof h, cudaMemcpyDeviceToHost));
        printf("%-28s %12.2f %6llu\n", whats[what], us, h[2]);
        if (what == 7 || what == 0) {
            // The same node launched on its own each round (a plain stream; the host runs ahead).
            CK(cudaMemset(c, 0, 64 * 8));
            memset(w, 0, 1 << 20);
            unsigned long long rounds = n;
            std::thread t2(proxy, (volatile unsigned long long *)w, SEP, rounds);
            auto t1 = std::chrono::steady_clock::now();
            for (unsigned long long i = 0; i < rounds; i++) send_node<<<1, 256, 0, s>>>(w, what, c);
            double host = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t1).count() / rounds;
            CK(cudaStreamSynchronize(s));
            double us2 = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t1).count() / rounds;
            t2.join();
            CK(cudaMemcpy(h, c, sizeof h, cudaMemcpyDeviceToHost));
            printf("%-28s %12.2f %6llu   (stream launches; host %.2f us per launch)\n", whats[what], us2, h[2], host);
        }
        CK(cudaGraphExecDestroy(ge));
        CK(cudaGraphDestroy(g));
        CK(cudaFree(c));
        CK(cudaFreeHost(w));
    }
    return 0;
}
