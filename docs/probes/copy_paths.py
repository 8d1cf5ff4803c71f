#!/usr/bin/env python3
# docs/probes/copy_paths.py -- run on a GPU machine with cupy (the device machines have it):
#   python3 docs/probes/copy_paths.py
# Results: docs/PERF.md, 2026-11-22 (session 16).
# Probe: how fast can 128 MiB move GPU0 -> GPU1 over NVLink: one copy engine, several in
# parallel (chunks on separate streams), or a copy kernel (push from GPU0 / pull on GPU1).
import cupy as cp, time, sys
N = 128 << 20
ITER = 30
cp.cuda.Device(0).use()
src = cp.arange(N // 4, dtype=cp.uint32)
with cp.cuda.Device(1):
    dst = cp.zeros(N // 4, dtype=cp.uint32)
for a, b in ((0, 1), (1, 0)):
    with cp.cuda.Device(a):
        try: cp.cuda.runtime.deviceEnablePeerAccess(b)
        except Exception as e: print("peer", a, b, e)
def timeit(fn, dev, streams):
    with cp.cuda.Device(dev):
        for _ in range(3): fn()
        for s in streams: s.synchronize()
        cp.cuda.Device(dev).synchronize()
        t = time.perf_counter()
        for _ in range(ITER): fn()
        for s in streams: s.synchronize()
        cp.cuda.Device(dev).synchronize()
        return ITER * N / (time.perf_counter() - t) / 1e9
for k in (1, 2, 4, 8):
    with cp.cuda.Device(0):
        ss = [cp.cuda.Stream(non_blocking=True) for _ in range(k)]
    ev0 = None
    def f():
        c = N // k
        for i, s in enumerate(ss):
            cp.cuda.runtime.memcpyPeerAsync(dst.data.ptr + i * c, 1, src.data.ptr + i * c, 0, c, s.ptr)
        for s in ss[1:]:
            e = cp.cuda.Event(); e.record(s); ss[0].wait_event(e)
    print(f"CE push, {k} stream(s): {timeit(f, 0, ss):.1f} GB/s", flush=True)
    # same copies issued from GPU1's side (pull)
    with cp.cuda.Device(1):
        ss1 = [cp.cuda.Stream(non_blocking=True) for _ in range(k)]
    def g():
        c = N // k
        for i, s in enumerate(ss1):
            cp.cuda.runtime.memcpyPeerAsync(dst.data.ptr + i * c, 1, src.data.ptr + i * c, 0, c, s.ptr)
    print(f"CE from GPU1 stream, {k} stream(s): {timeit(g, 1, ss1):.1f} GB/s", flush=True)
src_k = r'''
extern "C" __global__ void copy16(const uint4* __restrict__ s, uint4* __restrict__ d, size_t n) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x, st = (size_t)gridDim.x * blockDim.x;
  for (; i + 3 * st < n; i += 4 * st) { uint4 a = s[i], b = s[i+st], c = s[i+2*st], e = s[i+3*st]; d[i] = a; d[i+st] = b; d[i+2*st] = c; d[i+3*st] = e; }
  for (; i < n; i += st) d[i] = s[i];
}'''
import numpy as np
for dev in (0, 1):
    with cp.cuda.Device(dev):
        k = cp.RawKernel(src_k, "copy16")
        st = cp.cuda.Stream(non_blocking=True)
        for blocks in (32, 64, 132, 264):
            for thr in (512, 1024):
                def h():
                    k((blocks,), (thr,), (np.uint64(src.data.ptr), np.uint64(dst.data.ptr), np.uint64(N // 16)), stream=st)
                print(f"kernel on GPU{dev} ({'push' if dev==0 else 'pull'}) {blocks}x{thr}: {timeit(h, dev, [st]):.1f} GB/s", flush=True)
