# Probe (run on a GPU machine with 2-4 GPUs): can an all-reduce that only stores over NVLink
# beat the direct kernel's fused two-shot, which loads half its traffic? bulk_copy.py found SM
# stores at ~361 GB/s per direction and loads at ~331 between two H200s; the two-shot (each
# rank loads its shard of every rank's send buffer, reduces, stores the sum into every rank's
# receive buffer) runs at 342. The push variant here, out of place:
#   block b of rank q, its k-th chunk j (j = b + k * blocks) of every shard:
#   1. stores chunk j of its input's shard p into a slot of rank p's scratch (block b, sender q,
#      k mod DEPTH), for every peer p, once rank p's block b freed that slot (a credit word);
#   2. raises "data" (block b, sender q) at every peer, after a system-scope fence;
#   3. waits for every peer's "data" at home, reduces its own chunk j of shard q with the
#      peers' slots in rank order, and stores the sum into shard q of every rank's receive
#      buffer;
#   4. returns the credits.
# Every block pairs only with the same block of the other ranks: no grid-wide barrier. Both
# kernels run on every GPU at once; busbw = 2 (n - 1) / n * bytes / time, as nccl-tests.
#   python3 docs/probes/push_allreduce.py [MiB ...]
import sys
import time
import cupy as cp

SRC = r"""
#define MAXN 4
#define LINE 16 /* words between flags: one 128-byte line each */
static __device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t;
}
/* Wait until *w >= v; 0 after 5 s (the probe reports it as a failure). */
static __device__ int wait_ge(unsigned long long *w, unsigned long long v) {
    unsigned long long t0 = now_ns(), x;
    for (;;) {
        asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(x) : "l"(w) : "memory");
        if (x >= v) return 1;
        if (now_ns() - t0 > 5000000000ull) return 0;
    }
}
static __device__ __forceinline__ void put(unsigned long long *w, unsigned long long v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(w), "l"(v) : "memory");
}
static __device__ __forceinline__ float4 add4(float4 a, float4 b) { return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w); }

/* tab: send[MAXN], recv[MAXN], scratch[MAXN], flags[MAXN] (every rank's, mapped here).
 * flags of rank r: data(b, q) at (b * MAXN + q) * LINE (q's chunk of block b arrived at r),
 * credit(b, q) at (B + b) * MAXN * LINE + q * LINE (rank q freed a slot of r's block b). */
extern "C" __global__ void __launch_bounds__(512, 2) push_ar(const unsigned long long *tab, int n, int me, unsigned long long s16,
        unsigned long long c16, int depth, unsigned long long base, int *bad) {
    const float4 *const *send = (const float4 *const *)tab;
    float4 *const *recv = (float4 *const *)(tab + MAXN);
    float4 *const *scratch = (float4 *const *)(tab + 2 * MAXN);
    unsigned long long *const *flags = (unsigned long long *const *)(tab + 3 * MAXN);
    const unsigned long long B = gridDim.x, b = blockIdx.x, nch = s16 / c16;
    const int lane = threadIdx.x;
    #define SLOT(r, q, d) (scratch[r] + ((b * MAXN + (q)) * depth + (d)) * c16)
    #define DATA(r, q) (flags[r] + (b * MAXN + (q)) * LINE)
    #define CREDIT(r, q) (flags[r] + ((B + b) * MAXN + (q)) * LINE)
    __shared__ int ok_s;
    if (lane == 0) ok_s = 1;
    __syncthreads();
    unsigned long long k = 0;
    for (unsigned long long j = b; j < nch; j += B, k++) {
        const int d = k % depth;
        /* 1. the peers' slot d of this block is free (their reads of chunk k - depth done) */
        if (lane < n && lane != me && k >= depth && !wait_ge(CREDIT(me, lane), base + k - depth + 1)) ok_s = 0;
        __syncthreads();
        for (int p = 0; p < n; p++) {
            if (p == me) continue;
            const float4 *src = send[me] + p * s16 + j * c16;
            float4 *dst = SLOT(p, me, d);
            for (unsigned long long i = lane; i < c16; i += blockDim.x) dst[i] = __ldcs(src + i);
        }
        __syncthreads();
        if (lane == 0) __threadfence_system();
        __syncthreads();
        /* 2. */
        if (lane < n && lane != me) put(DATA(lane, me), base + k + 1);
        /* 3. */
        if (lane < n && lane != me && !wait_ge(DATA(me, lane), base + k + 1)) ok_s = 0;
        __syncthreads();
        const float4 *own = send[me] + me * s16 + j * c16;
        for (unsigned long long i = lane; i < c16; i += blockDim.x) {
            float4 acc = me == 0 ? __ldcs(own + i) : __ldcg(SLOT(me, 0, d) + i);
            for (int r = 1; r < n; r++) acc = add4(acc, r == me ? __ldcs(own + i) : __ldcg(SLOT(me, r, d) + i));
            for (int p = 0; p < n; p++) recv[p][me * s16 + j * c16 + i] = acc;
        }
        __syncthreads();
        /* 4. */
        if (lane < n && lane != me) put(CREDIT(lane, me), base + k + 1);
    }
    if (lane == 0 && !ok_s) atomicAdd(bad, 1);
}

/* The direct kernel's all-reduce: this rank's shard of every send buffer, four pieces of 16
 * bytes in flight per source, the sum into that shard of every receive buffer. */
extern "C" __global__ void __launch_bounds__(512, 2) twoshot(const unsigned long long *tab, int n, int me, unsigned long long s16) {
    const float4 *const *send = (const float4 *const *)tab;
    float4 *const *recv = (float4 *const *)(tab + MAXN);
    const unsigned long long step = gridDim.x * (unsigned long long)blockDim.x, at = me * s16;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < s16; i += 4 * step) {
        float4 acc[4], x[4];
#pragma unroll
        for (int k = 0; k < 4; k++) if (i + k * step < s16) acc[k] = __ldcg(send[0] + at + i + k * step);
        for (int r = 1; r < n; r++) {
#pragma unroll
            for (int k = 0; k < 4; k++) if (i + k * step < s16) x[k] = __ldcg(send[r] + at + i + k * step);
#pragma unroll
            for (int k = 0; k < 4; k++) acc[k] = add4(acc[k], x[k]);
        }
        for (int p = 0; p < n; p++)
#pragma unroll
            for (int k = 0; k < 4; k++) if (i + k * step < s16) recv[p][at + i + k * step] = acc[k];
    }
}
"""

MAXN, LINE = 4, 16


def main():
    n = min(cp.cuda.runtime.getDeviceCount(), MAXN)
    devs = list(range(n))
    sizes = [int(a) << 20 for a in sys.argv[1:]] or [128 << 20, 512 << 20]
    # (blocks, chunk, depth): scratch per peer = blocks x chunk x depth.
    configs = [(264, 32 << 10, 2), (132, 64 << 10, 2), (264, 64 << 10, 2), (64, 256 << 10, 2), (128, 128 << 10, 2),
               (132, 256 << 10, 2), (264, 256 << 10, 2), (132, 64 << 10, 4)]
    max_blocks = max(c[0] for c in configs)
    max_scratch = max(b * MAXN * dep * c for b, c, dep in configs)
    fns, tabs, streams, bads = [], [], [], []
    for d in devs:
        with cp.cuda.Device(d):
            for p in devs:
                if p != d:
                    cp.cuda.runtime.deviceEnablePeerAccess(p)
            m = cp.RawModule(code=SRC)
            fns.append((m.get_function("push_ar"), m.get_function("twoshot")))
            streams.append(cp.cuda.Stream(non_blocking=True))
            bads.append(cp.zeros(1, dtype=cp.int32))
    print(f"# {n} GPUs; busbw GB/s = 2 (n-1)/n x bytes / time; both kernels out of place, float sum")
    for size in sizes:
        send, recv, scratch, flags = [], [], [], []
        for d in devs:
            with cp.cuda.Device(d):
                # Small integers: every order of the sum is exact, so the check is exact too.
                send.append((cp.arange(size // 4, dtype=cp.int64) % 7 + d + 1).astype(cp.float32))
                recv.append(cp.zeros(size // 4, dtype=cp.float32))
                scratch.append(cp.zeros(max_scratch // 4, dtype=cp.float32))
                flags.append(cp.zeros(2 * max_blocks * MAXN * LINE, dtype=cp.uint64))
        want = sum(cp.asnumpy(s) for s in send)
        ptrs = [a.data.ptr for a in send] + [0] * (MAXN - n)
        ptrs += [a.data.ptr for a in recv] + [0] * (MAXN - n)
        ptrs += [a.data.ptr for a in scratch] + [0] * (MAXN - n)
        ptrs += [a.data.ptr for a in flags] + [0] * (MAXN - n)
        tabs = []
        for d in devs:
            with cp.cuda.Device(d):
                tabs.append(cp.array(ptrs, dtype=cp.uint64))
        s16 = size // 16 // n
        epoch = [0]

        def sync():
            for d in devs:
                with cp.cuda.Device(d):
                    cp.cuda.runtime.deviceSynchronize()

        def run(label, launch, reps=8):
            for d in devs:
                with cp.cuda.Device(d):
                    recv[d].fill(0)
            sync()
            launch()
            sync()
            ok = all((cp.asnumpy(recv[d]) == want).all() for d in devs) and all(int(b[0]) == 0 for b in bads)
            t = []
            for _ in range(reps):
                t0 = time.perf_counter()
                launch()
                sync()
                t.append(time.perf_counter() - t0)
            t.sort()
            med = t[len(t) // 2]
            bw = 2 * (n - 1) / n * size / 1e9
            print(f"{size >> 20:5d} MiB  {label:40s} {med * 1e6:9.1f} us  busbw {bw / med:6.1f} (best {bw / t[0]:6.1f})  {'ok' if ok else 'WRONG'}", flush=True)

        for blocks in (132, 264):
            def two(blocks=blocks):
                for d in devs:
                    with cp.cuda.Device(d):
                        fns[d][1]((blocks,), (512,), (tabs[d], cp.int32(n), cp.int32(d), cp.uint64(s16)), stream=streams[d])
            run(f"two-shot, {blocks} blocks", two)
        for blocks, chunk, depth in configs:
            c16 = chunk // 16
            if s16 % c16:
                continue

            def push(blocks=blocks, c16=c16, depth=depth):
                iters = (s16 // c16 + blocks - 1) // blocks
                for d in devs:
                    with cp.cuda.Device(d):
                        fns[d][0]((blocks,), (512,), (tabs[d], cp.int32(n), cp.int32(d), cp.uint64(s16), cp.uint64(c16), cp.int32(depth), cp.uint64(epoch[0]), bads[d]), stream=streams[d])
                epoch[0] += iters
            run(f"push, {blocks} blocks, {chunk >> 10} KiB x {depth}", push)
        del send, recv, scratch, flags


if __name__ == "__main__":
    main()
