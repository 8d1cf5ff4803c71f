# Probe (run on a GPU machine with 2 GPUs): what one small copy-engine read of a peer GPU's
# buffer costs the thread that issues it, and how long until its event reports it done.
#   python3 docs/probes/copy_latency.py
# This is the cost inside every rendezvous read of GPU memory (core/device_mem.rs).
import ctypes, time, statistics as st

def chk(r, what):
    if r != 0:
        raise RuntimeError(f"{what} -> {r}")

l = ctypes.CDLL("libcuda.so.1"); chk(l.cuInit(0), "init")
ctxs = []
for d in (0, 1):
    dev = ctypes.c_int(); chk(l.cuDeviceGet(ctypes.byref(dev), d), "devget")
    c = ctypes.c_void_p(); chk(l.cuDevicePrimaryCtxRetain(ctypes.byref(c), dev), "retain"); ctxs.append(c)
chk(l.cuCtxSetCurrent(ctxs[0]), "set0")
src = ctypes.c_uint64(); chk(l.cuMemAlloc_v2(ctypes.byref(src), 1 << 20), "alloc0")
chk(l.cuCtxSetCurrent(ctxs[1]), "set1")
dst = ctypes.c_uint64(); chk(l.cuMemAlloc_v2(ctypes.byref(dst), 1 << 20), "alloc1")
dst2 = ctypes.c_uint64(); chk(l.cuMemAlloc_v2(ctypes.byref(dst2), 1 << 20), "alloc1b")
r = l.cuCtxEnablePeerAccess(ctxs[0], 0)
s = ctypes.c_void_p(); chk(l.cuStreamCreate(ctypes.byref(s), 1), "stream")
ev = ctypes.c_void_p(); chk(l.cuEventCreate(ctypes.byref(ev), 2), "event")
ns = time.perf_counter_ns

def run(label, a, b, n, push=False, iters=2000):
    issue, done = [], []
    for i in range(iters):
        t0 = ns()
        if push:
            chk(l.cuCtxPushCurrent_v2(ctxs[1]), "push")
        chk(l.cuMemcpyAsync(a, b, ctypes.c_size_t(n), s), "memcpy")
        chk(l.cuEventRecord(ev, s), "record")
        if push:
            old = ctypes.c_void_p(); l.cuCtxPopCurrent_v2(ctypes.byref(old))
        t1 = ns()
        while True:
            if push:
                chk(l.cuCtxPushCurrent_v2(ctxs[1]), "push")
            q = l.cuEventQuery(ev)
            if push:
                old = ctypes.c_void_p(); l.cuCtxPopCurrent_v2(ctypes.byref(old))
            if q != 600:
                break
        t2 = ns()
        chk(q, "query")
        if i >= 100:
            issue.append((t1 - t0) / 1e3); done.append((t2 - t1) / 1e3)
    print(f"{label:40s} issue median {st.median(issue):6.2f} us  done after median {st.median(done):6.2f} us  (p90 {sorted(done)[len(done)*9//10]:6.2f})")

t0 = ns(); [l.cuEventQuery(ev) for _ in range(10000)]; print(f"python+ctypes call overhead ~{(ns()-t0)/1e4/1e3:.2f} us (event query)")
for n in (8, 4096, 65536, 1 << 20):
    run(f"peer->local {n} B", dst, src, n)
run("peer->local 8 B, ctx push/pop each call", dst, src, 8, push=True)
run("local->local 8 B", dst2, dst, 8)
