# Probe (run on a GPU machine with 4 GPUs): what SM kernels get from NVLink through the switch
# when every GPU moves data at once, by traffic pattern — all-to-all (what a direct all-gather
# or the two-shot all-reduce does) against a ring (what NCCL does) — beside the copy engines.
# ce_allgather.py found the engines at ~200 GB/s per GPU all-to-all (383 alone); this asks
# whether SMs, or a ring, do better, and what a fused two-shot all-reduce (each rank reads its
# slice from all four buffers, sums, writes the sum into all four) reaches.
#   python3 docs/probes/sm_patterns.py [MiB per part] [mix]
# "mix" instead asks whether SMs and copy engines together move more than either alone: every
# GPU runs the SM all-to-all push and a copy-engine ring copy at once, on two streams.
import sys
import time
import cupy as cp

MIB = int(sys.argv[1]) if len(sys.argv) > 1 else 128
N = MIB << 20
devs = [0, 1, 2, 3]
n = len(devs)
SRC = r"""
// Each GPU writes (push) or reads (pull) its part to/from `npeers` peers, 16 bytes a load;
// a thread takes every peer for one index so all links are busy at once.
extern "C" __global__ void push(const uint4 *__restrict__ src, uint4 *d0, uint4 *d1, uint4 *d2, int npeers, unsigned long long n16) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n16; i += stride) {
        uint4 v = src[i];
        d0[i] = v;
        if (npeers > 1) d1[i] = v;
        if (npeers > 2) d2[i] = v;
    }
}
extern "C" __global__ void pull(const uint4 *s0, const uint4 *s1, const uint4 *s2, uint4 *__restrict__ dst, unsigned long long n16) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    for (; i < n16; i += stride) {
        uint4 a = s0[i], b = s1[i], c = s2[i];
        dst[i] = a; dst[n16 + i] = b; dst[2 * n16 + i] = c;
    }
}
// Two-shot all-reduce of floats, fused: this rank's slice [off, off + m) of four buffers.
extern "C" __global__ void twoshot(const float4 *s0, const float4 *s1, const float4 *s2, const float4 *s3,
                                   float4 *d0, float4 *d1, float4 *d2, float4 *d3, unsigned long long off, unsigned long long m) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = off + blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < off + m; i += stride) {
        float4 a = s0[i], b = s1[i], c = s2[i], d = s3[i];
        float4 r = make_float4(((a.x + b.x) + c.x) + d.x, ((a.y + b.y) + c.y) + d.y, ((a.z + b.z) + c.z) + d.z, ((a.w + b.w) + c.w) + d.w);
        d0[i] = r; d1[i] = r; d2[i] = r; d3[i] = r;
    }
}
"""
part, out, ar_in, ar_out, streams, fns = [], [], [], [], [], []
for d in devs:
    with cp.cuda.Device(d):
        for p in devs:
            if p != d:
                cp.cuda.runtime.deviceEnablePeerAccess(p)
        part.append(cp.full(N // 4, d + 1, dtype=cp.uint32))
        out.append(cp.zeros(n * N // 4, dtype=cp.uint32))
        ar_in.append(cp.full(N // 4, float(d + 1), dtype=cp.float32))
        ar_out.append(cp.zeros(N // 4, dtype=cp.float32))
        streams.append(cp.cuda.Stream(non_blocking=True))
        m = cp.RawModule(code=SRC)
        fns.append({k: m.get_function(k) for k in ("push", "pull", "twoshot")})


def sync():
    for d in devs:
        with cp.cuda.Device(d):
            cp.cuda.runtime.deviceSynchronize()


def timed(label, launch, moved, reps=10):
    launch()
    sync()
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        launch()
        sync()
        t.append(time.perf_counter() - t0)
    t.sort()
    med = t[len(t) // 2]
    print(f"{label:52s} {med * 1e6:9.1f} us  per-GPU {moved / med / 1e9:7.1f} GB/s (best {moved / t[0] / 1e9:7.1f})", flush=True)


n16 = N // 16


def sm_push(targets, blocks, threads):
    """targets(d) -> the peers GPU d writes its part into (at its own slot)."""

    def go():
        for d in devs:
            peers = targets(d)
            dst = [out[q].data.ptr + d * N for q in peers] + [0] * (3 - len(peers))
            with cp.cuda.Device(d):
                fns[d]["push"]((blocks,), (threads,), (part[d], cp.uint64(dst[0]), cp.uint64(dst[1]), cp.uint64(dst[2]), cp.int32(len(peers)), cp.uint64(n16)), stream=streams[d])

    return go


def sm_pull(blocks, threads):
    def go():
        for d in devs:
            peers = [q for q in devs if q != d]
            with cp.cuda.Device(d):
                fns[d]["pull"]((blocks,), (threads,), tuple(cp.uint64(part[q].data.ptr) for q in peers) + (out[d], cp.uint64(n16)), stream=streams[d])

    return go


def ce_ring():
    def go():
        for d in devs:
            q = (d + 1) % n
            with cp.cuda.Device(d):
                cp.cuda.runtime.memcpyPeerAsync(out[q].data.ptr + d * N, q, part[d].data.ptr, d, N, streams[d].ptr)

    return go


def twoshot(blocks, threads):
    m = N // 16 // n  # float4s per slice

    def go():
        for d in devs:
            with cp.cuda.Device(d):
                args = tuple(cp.uint64(ar_in[q].data.ptr) for q in devs) + tuple(cp.uint64(ar_out[q].data.ptr) for q in devs)
                fns[d]["twoshot"]((blocks,), (threads,), args + (cp.uint64(d * m), cp.uint64(m)), stream=streams[d])

    return go


if "mix" in sys.argv[2:]:
    side, ce_src, ce_dst = [], [], []
    for d in devs:
        with cp.cuda.Device(d):
            side.append(cp.cuda.Stream(non_blocking=True))
            ce_src.append(cp.ones(N, dtype=cp.uint32))  # 4 N bytes: room for up to 4 parts
            ce_dst.append(cp.zeros(N, dtype=cp.uint32))

    def mixed(ce_bytes, blocks, threads, sm=True):
        push_all = sm_push(lambda d: [q for q in devs if q != d], blocks, threads)

        def go():
            if sm:
                push_all()
            for d in devs:
                q = (d + 1) % n
                with cp.cuda.Device(d):
                    cp.cuda.runtime.memcpyPeerAsync(ce_dst[q].data.ptr, q, ce_src[d].data.ptr, d, ce_bytes, side[d].ptr)

        return go

    print(f"# {MIB} MiB per part, {n} GPUs; per-GPU GB/s = bytes each GPU sends by SMs and engines / time")
    for mult in (1, 2, 3, 4):
        timed(f"CE ring alone, {mult * MIB} MiB", mixed(mult * N, 0, 0, sm=False), mult * N)
    for blocks, threads in ((132, 512), (66, 512), (32, 512)):
        timed(f"SM push all-to-all alone {blocks}x{threads}", sm_push(lambda d: [q for q in devs if q != d], blocks, threads), 3 * N)
        for mult in (1, 2, 3):
            timed(f"SM all-to-all {blocks}x{threads} + CE ring {mult * MIB} MiB", mixed(mult * N, blocks, threads), 3 * N + mult * N)
    sys.exit(0)

print(f"# {MIB} MiB per part, {n} GPUs; per-GPU GB/s = bytes each GPU sends / time")
timed("CE ring: each GPU pushes one part to the next", ce_ring(), N)
for blocks, threads in ((132, 512), (264, 512), (132, 1024), (528, 256)):
    g = f"{blocks}x{threads}"
    timed(f"SM push all-to-all (3 peers) {g}", sm_push(lambda d: [q for q in devs if q != d], blocks, threads), 3 * N)
    timed(f"SM pull all-to-all (3 peers) {g}", sm_pull(blocks, threads), 3 * N)
    timed(f"SM push ring (next GPU) {g}", sm_push(lambda d: [(d + 1) % n], blocks, threads), N)
    timed(f"SM push, GPU 0 alone to 3 peers {g}", lambda: fns[0]["push"]((blocks,), (threads,), (part[0], cp.uint64(out[1].data.ptr), cp.uint64(out[2].data.ptr), cp.uint64(out[3].data.ptr), cp.int32(3), cp.uint64(n16)), stream=streams[0]), 3 * N)
    # Two-shot all-reduce of one N-byte buffer per GPU: busbw = 2 (n-1)/n N / time.
    timed(f"SM two-shot all-reduce, busbw {g}", twoshot(blocks, threads), 2 * (n - 1) * N // n)
# The result of the two-shot is the sum of 1..4 everywhere.
for d in devs:
    with cp.cuda.Device(d):
        assert bool((ar_out[d] == 10.0).all()), f"two-shot wrong on GPU {d}"
print("two-shot result checked")
