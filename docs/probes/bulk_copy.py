# Probe (run on a GPU machine with 2+ GPUs): do bulk asynchronous copies (cp.async.bulk, the
# Hopper TMA's 1-D form) move data over NVLink faster than 16-byte loads and stores from
# threads? copy_kernel.py found threads pulling at most ~331 GB/s per direction and pushing
# ~362, with both directions at once, where the copy engine does ~380; the direct collectives
# kernel is bound by the same numbers (all-gather pushes at 361, reduce-scatter pulls at 332,
# the all-reduce mixes both at 342; docs/PERF.md, session 21). Each GPU runs the same kernel
# at once, over `MiB` MiB:
#   - copy16 pull/push: threads, 16 bytes a load (the baseline);
#   - bulk pull/push: one thread per block streams chunks through shared memory, global ->
#     shared by cp.async.bulk (mbarrier transaction count), shared -> global by cp.async.bulk
#     (bulk group), STAGES chunks in flight;
#   - bulk reduce (the reduce-scatter of two ranks): each chunk of the peer's buffer and of our
#     own loaded in bulk, the threads add them and store our output.
#   python3 docs/probes/bulk_copy.py [MiB]
import sys
import time
import cupy as cp

MIB = int(sys.argv[1]) if len(sys.argv) > 1 else 128
N = MIB << 20
SRC = r"""
extern "C" __global__ void copy16(const uint4 *__restrict__ src, uint4 *__restrict__ dst, unsigned long long n16) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
        dst[i] = a; dst[i + stride] = b; dst[i + 2 * stride] = c; dst[i + 3 * stride] = d;
    }
    for (; i < n16; i += stride) dst[i] = src[i];
}

static __device__ __forceinline__ unsigned smem(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }
static __device__ __forceinline__ void bar_init(unsigned long long *b) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem(b)) : "memory");
}
static __device__ __forceinline__ void bar_expect(unsigned long long *b, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem(b)), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void bar_wait(unsigned long long *b, unsigned phase) {
    asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}" ::"r"(smem(b)), "r"(phase) : "memory");
}
static __device__ __forceinline__ void bulk_load(void *s, const void *g, unsigned bytes, unsigned long long *b) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem(s)), "l"(g), "r"(bytes), "r"(smem(b)) : "memory");
}
static __device__ __forceinline__ void bulk_store(void *g, const void *s, unsigned bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(g), "r"(smem(s)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
static __device__ __forceinline__ void bulk_store_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
static __device__ __forceinline__ void bulk_store_wait_all() {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

#define STAGES 4
/* Block b takes chunks b, b + grid, ...; `chunk` bytes each (a multiple of 16), n a multiple
 * of chunk. Dynamic shared memory: STAGES * chunk. One thread does all the work. */
extern "C" __global__ void bulk_copy(const char *src, char *dst, unsigned long long n, unsigned chunk) {
    extern __shared__ __align__(128) char buf[];
    __shared__ __align__(8) unsigned long long bar[STAGES];
    if (threadIdx.x != 0) return;
    const unsigned long long nchunks = n / chunk;
    for (int s = 0; s < STAGES; s++) bar_init(&bar[s]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    unsigned long long k = 0; /* this block's chunk index: global chunk blockIdx.x + k * gridDim.x */
    for (int s = 0; s < STAGES; s++) {
        unsigned long long c = blockIdx.x + (unsigned long long)s * gridDim.x;
        if (c >= nchunks) break;
        bar_expect(&bar[s], chunk);
        bulk_load(buf + s * chunk, src + c * chunk, chunk, &bar[s]);
    }
    for (;; k++) {
        unsigned long long c = blockIdx.x + k * gridDim.x;
        if (c >= nchunks) break;
        int s = k % STAGES;
        bar_wait(&bar[s], (k / STAGES) & 1);
        bulk_store(dst + c * chunk, buf + s * chunk, chunk);
        unsigned long long next = c + (unsigned long long)STAGES * gridDim.x;
        if (next < nchunks) {
            bulk_store_wait_read(); /* the stage's bytes left shared memory */
            bar_expect(&bar[s], chunk);
            bulk_load(buf + s * chunk, src + next * chunk, chunk, &bar[s]);
        }
    }
    bulk_store_wait_all();
}

/* dst = a + b (floats), both loaded in bulk; all threads add and store. */
extern "C" __global__ void bulk_add(const char *a, const char *b, float4 *dst, unsigned long long n, unsigned chunk) {
    extern __shared__ __align__(128) char buf[]; /* STAGES * 2 * chunk */
    __shared__ __align__(8) unsigned long long bar[STAGES];
    const unsigned long long nchunks = n / chunk;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) bar_init(&bar[s]);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (int s = 0; s < STAGES; s++) {
            unsigned long long c = blockIdx.x + (unsigned long long)s * gridDim.x;
            if (c >= nchunks) break;
            bar_expect(&bar[s], 2 * chunk);
            bulk_load(buf + (2 * s) * chunk, a + c * chunk, chunk, &bar[s]);
            bulk_load(buf + (2 * s + 1) * chunk, b + c * chunk, chunk, &bar[s]);
        }
    }
    __syncthreads();
    for (unsigned long long k = 0;; k++) {
        unsigned long long c = blockIdx.x + k * gridDim.x;
        if (c >= nchunks) break;
        int s = k % STAGES;
        bar_wait(&bar[s], (k / STAGES) & 1);
        const float4 *x = (const float4 *)(buf + (2 * s) * chunk), *y = (const float4 *)(buf + (2 * s + 1) * chunk);
        float4 *out = dst + c * (chunk / 16);
        for (unsigned i = threadIdx.x; i < chunk / 16; i += blockDim.x) {
            float4 p = x[i], q = y[i];
            out[i] = make_float4(p.x + q.x, p.y + q.y, p.z + q.z, p.w + q.w);
        }
        __syncthreads(); /* every thread done with the stage */
        unsigned long long next = c + (unsigned long long)STAGES * gridDim.x;
        if (threadIdx.x == 0 && next < nchunks) {
            bar_expect(&bar[s], 2 * chunk);
            bulk_load(buf + (2 * s) * chunk, a + next * chunk, chunk, &bar[s]);
            bulk_load(buf + (2 * s + 1) * chunk, b + next * chunk, chunk, &bar[s]);
        }
    }
}

/* dst = a + b by threads, 16 bytes a load (the direct kernel's way, four pieces in flight). */
extern "C" __global__ void add16(const float4 *a, const float4 *b, float4 *dst, unsigned long long n16) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n16; i += 4 * stride) {
        float4 p[4], q[4];
#pragma unroll
        for (int k = 0; k < 4; k++) if (i + k * stride < n16) p[k] = a[i + k * stride];
#pragma unroll
        for (int k = 0; k < 4; k++) if (i + k * stride < n16) q[k] = b[i + k * stride];
#pragma unroll
        for (int k = 0; k < 4; k++) if (i + k * stride < n16) dst[i + k * stride] = make_float4(p[k].x + q[k].x, p[k].y + q[k].y, p[k].z + q[k].z, p[k].w + q[k].w);
    }
}
"""

if __name__ == "__main__":
    devs = [0, 1]
    src, dst, streams, fns = [], [], [], []
    for d in devs:
        with cp.cuda.Device(d):
            cp.cuda.runtime.deviceEnablePeerAccess(1 - d)
            src.append(cp.arange(N // 4, dtype=cp.float32) * (d + 1))
            dst.append(cp.zeros(N // 4, dtype=cp.float32))
            streams.append(cp.cuda.Stream(non_blocking=True))
            m = cp.RawModule(code=SRC)
            fns.append({k: m.get_function(k) for k in ("copy16", "bulk_copy", "bulk_add", "add16")})

    def sync():
        for d in devs:
            with cp.cuda.Device(d):
                cp.cuda.runtime.deviceSynchronize()

    def timed(label, launch, check, reps=10):
        for d in devs:
            with cp.cuda.Device(d):
                dst[d].fill(0)
        sync()
        launch()
        sync()
        ok = check()
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(5):  # back to back: the host's launch time hides behind the GPUs'
                launch()
            sync()
            t.append((time.perf_counter() - t0) / 5)
        t.sort()
        med = t[len(t) // 2]
        print(f"{label:48s} {med * 1e6:9.1f} us {N / med / 1e9:7.1f} GB/s per direction (best {N / t[0] / 1e9:7.1f}) {'ok' if ok else 'WRONG'}", flush=True)

    def both(fn):
        def go():
            for d in devs:
                with cp.cuda.Device(d):
                    fn(d)
        return go

    def peer(d):
        return 1 - d

    host = [cp.asnumpy(s) for s in src]
    total = host[0] + host[1]

    def pulled():
        return all((cp.asnumpy(dst[d]) == host[peer(d)]).all() for d in devs)

    def pushed():
        return all((cp.asnumpy(dst[peer(d)]) == host[d]).all() for d in devs)

    def summed():
        return all((cp.asnumpy(dst[d]) == total).all() for d in devs)

    n16 = N // 16

    for blocks, threads in ((132, 512), (132, 1024)):
        timed(f"copy16 pull {blocks}x{threads}", both(lambda d: fns[d]["copy16"]((blocks,), (threads,), (src[peer(d)], dst[d], cp.uint64(n16)), stream=streams[d])), pulled)
        timed(f"copy16 push {blocks}x{threads}", both(lambda d: fns[d]["copy16"]((blocks,), (threads,), (src[d], dst[peer(d)], cp.uint64(n16)), stream=streams[d])), pushed)
        timed(f"add16 (peer + own) {blocks}x{threads}", both(lambda d: fns[d]["add16"]((blocks,), (threads,), (src[0], src[1], dst[d], cp.uint64(n16)), stream=streams[d])), summed)
    for chunk in (4096, 8192, 16384, 32768):
        for per_sm in (1, 2, 4):
            blocks = 132 * per_sm
            sh = 4 * chunk
            if sh * per_sm > 200 * 1024:
                continue
            for d in devs:
                with cp.cuda.Device(d):
                    fns[d]["bulk_copy"].max_dynamic_shared_size_bytes = sh
            g = f"{blocks} blocks, {chunk // 1024} KiB x 4"
            timed(f"bulk pull {g}", both(lambda d: fns[d]["bulk_copy"]((blocks,), (32,), (src[peer(d)], dst[d], cp.uint64(N), cp.uint32(chunk)), stream=streams[d], shared_mem=sh)), pulled)
            timed(f"bulk push {g}", both(lambda d: fns[d]["bulk_copy"]((blocks,), (32,), (src[d], dst[peer(d)], cp.uint64(N), cp.uint32(chunk)), stream=streams[d], shared_mem=sh)), pushed)
            if 2 * sh * per_sm <= 200 * 1024:
                for d in devs:
                    with cp.cuda.Device(d):
                        fns[d]["bulk_add"].max_dynamic_shared_size_bytes = 2 * sh
                timed(f"bulk add (peer + own) {g}", both(lambda d: fns[d]["bulk_add"]((blocks,), (256,), (src[0], src[1], dst[d], cp.uint64(N), cp.uint32(chunk)), stream=streams[d], shared_mem=2 * sh)), summed)
    # The copy engines, each GPU's stream pulling the peer's buffer (the reference).
    timed("copy engine pull", both(lambda d: cp.cuda.runtime.memcpyPeerAsync(dst[d].data.ptr, d, src[peer(d)].data.ptr, peer(d), N, streams[d].ptr)), pulled)
