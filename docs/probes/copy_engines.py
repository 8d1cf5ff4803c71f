# Probe (run on a GPU machine with 2+ GPUs): how fast can 128 MiB move between two GPUs in both
# directions at once, and does splitting one copy over several streams (several copy engines),
# pushing instead of pulling, or adding a copy kernel beside the copy engine move it faster than
# one cudaMemcpyPeerAsync? This is what gsc-bench's sendrecv at 128 MiB is bound by (issue #3).
#   python3 docs/probes/copy_engines.py [MiB]
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
"""

devs = [0, 1]
bufs, mods, streams = [], [], []
for d in devs:
    with cp.cuda.Device(d):
        for p in devs:
            if p != d:
                cp.cuda.runtime.deviceEnablePeerAccess(p)
        bufs.append((cp.full(N // 4, d + 1, dtype=cp.uint32), cp.zeros(N // 4, dtype=cp.uint32)))
        mods.append(cp.RawModule(code=SRC).get_function("copy16"))
        streams.append([cp.cuda.Stream(non_blocking=True) for _ in range(8)])


def run(label, k=1, push=False, kernel_frac=0.0, both=True, reps=20, blocks=32):
    """k: streams the copy-engine part is split over; push: the sender's streams write into the
    peer; kernel_frac: the share a copy kernel pushes on one more stream, beside the engine."""
    chunk_total = int(N * (1 - kernel_frac)) // 4096 * 4096

    def once():
        for d in (devs if both else devs[:1]):
            peer = 1 - d
            src_dev, dst_dev = (d, peer) if push else (peer, d)
            with cp.cuda.Device(d):
                step = chunk_total // k // 4096 * 4096
                for j in range(k):
                    off = j * step
                    n = step if j < k - 1 else chunk_total - off
                    cp.cuda.runtime.memcpyPeerAsync(
                        bufs[dst_dev][1].data.ptr + off, dst_dev, bufs[src_dev][0].data.ptr + off, src_dev, n, streams[d][j].ptr
                    )
                if kernel_frac > 0:
                    n16 = (N - chunk_total) // 16
                    mods[d](
                        (blocks,), (1024,),
                        (bufs[d][0][chunk_total // 4:], bufs[peer][1][chunk_total // 4:], cp.uint64(n16)),
                        stream=streams[d][k],
                    )

    def sync():
        for d in devs:
            with cp.cuda.Device(d):
                for s in streams[d]:
                    s.synchronize()

    once()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        once()
    sync()
    dt = (time.perf_counter() - t0) / reps
    ok = all(int(bufs[d][1][12345]) == 2 - d and int(bufs[d][1][N // 4 - 1]) == 2 - d for d in (devs if both else devs[:1]))
    print(f"{label:34s} {dt * 1e6:9.1f} us  {N / dt / 1e9:7.1f} GB/s per direction  {'ok' if ok else 'WRONG'}", flush=True)


print(f"{MIB} MiB each way, GPUs {devs}")
run("engine pull, one direction", both=False)
run("engine pull x1")
for k in (2, 4, 8):
    run(f"engine pull x{k}", k=k)
run("engine push x1", push=True)
for k in (2, 4):
    run(f"engine push x{k}", k=k, push=True)
for f in (0.05, 0.1, 0.2):
    for b in (16, 32):
        run(f"engine pull x1 + kernel push {f:.2f} b{b}", kernel_frac=f, blocks=b)
        run(f"engine pull x2 + kernel push {f:.2f} b{b}", k=2, kernel_frac=f, blocks=b)
run("engine pull x1")
