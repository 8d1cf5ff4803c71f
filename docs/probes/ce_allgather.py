# Probe (run on a GPU machine with 4 GPUs): the all-gather traffic pattern by copy engines —
# every GPU moves its part to (push) or from (pull) every other GPU at once — and what busbw
# that gives, against one copy between two GPUs. This bounds the copy-engine collectives
# (src/collectives/copy_engine.rs): all-gather busbw = 3 parts per GPU / time.
#   python3 docs/probes/ce_allgather.py [MiB per part]
import sys
import time
import cupy as cp

MIB = int(sys.argv[1]) if len(sys.argv) > 1 else 128
N = MIB << 20
devs = [0, 1, 2, 3]
n = len(devs)
send, recv, streams = [], [], []
for d in devs:
    with cp.cuda.Device(d):
        for p in devs:
            if p != d:
                cp.cuda.runtime.deviceEnablePeerAccess(p)
        send.append(cp.full(N // 4, d + 1, dtype=cp.uint32))
        recv.append(cp.zeros(n * N // 4, dtype=cp.uint32))
        streams.append([cp.cuda.Stream(non_blocking=True) for _ in range(8)])


def sync():
    for d in devs:
        with cp.cuda.Device(d):
            cp.cuda.runtime.deviceSynchronize()


def run(label, push, k, split=1, gpus=None, reps=10):
    """push: the source GPU's streams write into the peers; else each GPU reads. k: streams per
    GPU the peer copies are spread over (round robin); split: each copy cut in this many."""
    gpus = gpus or devs

    def once():
        for d in gpus:
            with cp.cuda.Device(d):
                j = 0
                for q in devs:
                    if q == d:
                        continue
                    src_dev, dst_dev = (d, q) if push else (q, d)
                    step = N // split
                    for s in range(split):
                        cp.cuda.runtime.memcpyPeerAsync(
                            recv[dst_dev].data.ptr + src_dev * N + s * step, dst_dev,
                            send[src_dev].data.ptr + s * step, src_dev, step, streams[d][j % k].ptr,
                        )
                        j += 1

    once()
    sync()
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        once()
        sync()
        t.append(time.perf_counter() - t0)
    t.sort()
    med = t[len(t) // 2]
    moved = (n - 1) * N
    print(f"{label:44s} {med * 1e6:9.1f} us  per-GPU {moved / med / 1e9:7.1f} GB/s (best {moved / t[0] / 1e9:7.1f})", flush=True)


def single(reps=10):
    with cp.cuda.Device(0):
        s = streams[0][0]
        cp.cuda.runtime.memcpyPeerAsync(recv[1].data.ptr, 1, send[0].data.ptr, 0, N, s.ptr)
        sync()
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            cp.cuda.runtime.memcpyPeerAsync(recv[1].data.ptr, 1, send[0].data.ptr, 0, N, s.ptr)
            s.synchronize()
            t.append(time.perf_counter() - t0)
        t.sort()
        print(f"{'one copy GPU0 -> GPU1 (push)':44s} {t[len(t)//2] * 1e6:9.1f} us  {N / t[len(t)//2] / 1e9:7.1f} GB/s", flush=True)


print(f"# {MIB} MiB per part, {n} GPUs; per-GPU GB/s = {n - 1} parts / time (= all-gather busbw)")
single()
for push in (False, True):
    for k in (1, 3):
        for split in (1, 4):
            run(f"{'push' if push else 'pull'}, {k} stream(s)/GPU, copies cut in {split}", push, k, split)
run("pull, 3 streams/GPU, GPU 0 alone", False, 3, 1, gpus=[0])
run("push, 3 streams/GPU, GPU 0 alone", True, 3, 1, gpus=[0])
