# Probe (run on a GPU machine with 2 GPUs): copy-engine bandwidth between two GPUs when both
# directions run at once, as in a send/recv exchange, with each copy issued by the receiving GPU
# (pull: what the rendezvous read does) or by the sending GPU (push: what a write protocol would
# do); also one direction alone, and each direction split over several streams.
#   python3 docs/probes/copy_direction.py [MiB]
import ctypes, sys, time

def chk(r, what):
    if r != 0:
        raise RuntimeError(f"{what} -> {r}")

l = ctypes.CDLL("libcuda.so.1"); chk(l.cuInit(0), "init")
MB = int(sys.argv[1]) if len(sys.argv) > 1 else 128
N = MB << 20
ctxs, bufs, streams = [], [], []
for d in (0, 1):
    dev = ctypes.c_int(); chk(l.cuDeviceGet(ctypes.byref(dev), d), "devget")
    c = ctypes.c_void_p(); chk(l.cuDevicePrimaryCtxRetain(ctypes.byref(c), dev), "retain"); ctxs.append(c)
for d in (0, 1):
    chk(l.cuCtxSetCurrent(ctxs[d]), "set")
    l.cuCtxEnablePeerAccess(ctxs[1 - d], 0)
    b = []
    for _ in range(2):
        p = ctypes.c_uint64(); chk(l.cuMemAlloc_v2(ctypes.byref(p), N), "alloc"); b.append(p.value)
    bufs.append(b)  # bufs[d][0]: send buffer on GPU d, bufs[d][1]: receive buffer on GPU d
    ss = []
    for _ in range(8):
        s = ctypes.c_void_p(); chk(l.cuStreamCreate(ctypes.byref(s), 1), "stream"); ss.append(s)
    streams.append(ss)

def sync():
    for d in (0, 1):
        chk(l.cuCtxSetCurrent(ctxs[d]), "set")
        chk(l.cuCtxSynchronize(), "sync")

def run(label, directions, issuer, nstreams, iters=20):
    """directions: list of (src_gpu, dst_gpu); issuer: 'dst' (pull) or 'src' (push)."""
    def once():
        for (a, b) in directions:
            who = b if issuer == "dst" else a
            chk(l.cuCtxSetCurrent(ctxs[who]), "set")
            piece = N // nstreams
            for k in range(nstreams):
                chk(l.cuMemcpyAsync(ctypes.c_uint64(bufs[b][1] + k * piece), ctypes.c_uint64(bufs[a][0] + k * piece),
                                    ctypes.c_size_t(piece), streams[who][k]), "copy")
    once(); sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        once()
    sync()
    dt = (time.perf_counter() - t0) / iters
    print(f"{label:<44} {MB:>5} MiB  {dt*1e6:9.1f} us  {N/dt/1e9:7.1f} GB/s per direction", flush=True)

both = [(0, 1), (1, 0)]
for ns_ in (1, 2, 4):
    run(f"one direction 0->1, pull, {ns_} stream(s)", [(0, 1)], "dst", ns_)
    run(f"one direction 0->1, push, {ns_} stream(s)", [(0, 1)], "src", ns_)
    run(f"both directions, pull, {ns_} stream(s)", both, "dst", ns_)
    run(f"both directions, push, {ns_} stream(s)", both, "src", ns_)
