# Probe (run on a GPU machine with 2+ GPUs): can a copy kernel move a large message between two
# GPUs over NVLink faster than the copy engine, with both directions at once (what gsc-bench's
# sendrecv does)? Each GPU runs a kernel that pulls (reads the peer's buffer, writes its own) or
# pushes (reads its own, writes the peer's) `MiB` MiB, 16 bytes a load, both GPUs at the same
# time; the copy engine (cudaMemcpyPeerAsync, pulled by the receiver's stream) for comparison.
#   python3 docs/probes/copy_kernel.py [MiB]
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
        streams.append(cp.cuda.Stream(non_blocking=True))


def run(kind, blocks=0, threads=0, reps=20):
    def once():
        for d in devs:
            peer = 1 - d
            with cp.cuda.Device(d):
                s = streams[d]
                if kind == "engine":
                    # the receiver's stream pulls the peer's send buffer into its receive buffer
                    cp.cuda.runtime.memcpyPeerAsync(bufs[d][1].data.ptr, d, bufs[peer][0].data.ptr, peer, N, s.ptr)
                elif kind == "pull":
                    mods[d]((blocks,), (threads,), (bufs[peer][0], bufs[d][1], cp.uint64(N // 16)), stream=s)
                else:  # push: write into the peer's receive buffer
                    mods[d]((blocks,), (threads,), (bufs[d][0], bufs[peer][1], cp.uint64(N // 16)), stream=s)

    def sync():
        for d in devs:
            with cp.cuda.Device(d):
                streams[d].synchronize()

    once()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        once()
    sync()
    dt = (time.perf_counter() - t0) / reps
    ok = all(int(bufs[d][1][12345]) == 2 - d for d in devs)
    label = kind if kind == "engine" else f"{kind} {blocks}x{threads}"
    print(f"{label:22s} {dt * 1e6:9.1f} us  {N / dt / 1e9:7.1f} GB/s per direction  {'ok' if ok else 'WRONG'}")


print(f"{MIB} MiB each way, GPUs {devs}, both directions at once")
run("engine")
for kind in ("pull", "push"):
    for blocks in (16, 32, 64, 132):
        for threads in (512, 1024):
            run(kind, blocks, threads)
run("engine")
