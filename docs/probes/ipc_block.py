# Probe (run on a GPU machine): do the driver calls the proxy makes on the CUDA IPC path block
# while a stream waits on a memop (as a stream condition's stream does)?
#   python3 docs/probes/ipc_block.py 0   # exporter idle
#   python3 docs/probes/ipc_block.py 1   # exporter's own stream also stuck on a memop
# Result on nvidia-h200-x4, 2026-11-21: cuIpcOpenMemHandle (~2 ms the first time), cuMemcpyAsync
# peer->local, cuEventRecord and cuEventQuery all returned at once; the copies completed
# (1 B: ~100 us to the first completed query, 1 MiB: ~180 us) in both cases.
import ctypes, multiprocessing as mp, threading, time, sys

def chk(r, what):
    if r != 0:
        raise RuntimeError(f"{what} -> {r}")

def setup(dev):
    l = ctypes.CDLL("libcuda.so.1"); chk(l.cuInit(0), "init")
    d = ctypes.c_int(); chk(l.cuDeviceGet(ctypes.byref(d), dev), "devget")
    ctx = ctypes.c_void_p(); chk(l.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), d), "retain")
    chk(l.cuCtxSetCurrent(ctx), "setcur")
    return l, ctx

def stuck_stream(l):
    """A non-blocking stream waiting (64-bit GEQ) on a mapped host word that stays 0."""
    host = ctypes.c_void_p(); chk(l.cuMemHostAlloc(ctypes.byref(host), 4096, 3), "hostalloc")
    ctypes.memset(host, 0, 4096)
    dptr = ctypes.c_uint64(); chk(l.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), host, 0), "hostdevptr")
    s = ctypes.c_void_p(); chk(l.cuStreamCreate(ctypes.byref(s), 1), "stream")
    chk(l.cuStreamWaitValue64_v2(s, dptr, ctypes.c_uint64(1), 0), "waitvalue64")
    return host, s

def exporter(q, done, stuck):
    l, ctx = setup(0)
    p = ctypes.c_uint64(); chk(l.cuMemAlloc_v2(ctypes.byref(p), 1 << 20), "alloc")
    h = (ctypes.c_char * 64)(); chk(l.cuIpcGetMemHandle(h, p), "gethandle")
    if stuck:
        host, s = stuck_stream(l)
    q.put(bytes(h)); done.wait(60)
    if stuck:
        ctypes.c_uint64.from_address(host.value).value = 1

def main(stuck_exporter):
    q, done = mp.Queue(), mp.Event()
    pr = mp.Process(target=exporter, args=(q, done, stuck_exporter)); pr.start()
    handle = q.get(timeout=30)
    l, ctx = setup(1)
    host, user = stuck_stream(l)
    class H(ctypes.Structure):
        _fields_ = [("r", ctypes.c_char * 64)]
    hh = H(); ctypes.memmove(ctypes.byref(hh), handle, 64)
    res = {}
    def work():
        chk(l.cuCtxPushCurrent_v2(ctx), "push")
        ours = ctypes.c_void_p(); chk(l.cuStreamCreate(ctypes.byref(ours), 1), "ours")
        dst = ctypes.c_uint64(); chk(l.cuMemAlloc_v2(ctypes.byref(dst), 1 << 20), "dst")
        mapped = ctypes.c_uint64(); chk(l.cuIpcOpenMemHandle_v2(ctypes.byref(mapped), hh, 1), "open")
        ev = ctypes.c_void_p(); chk(l.cuEventCreate(ctypes.byref(ev), 2), "event")
        for n in (1, 8, 1 << 20):
            chk(l.cuMemcpyAsync(dst, mapped, n, ours), "memcpy"); chk(l.cuEventRecord(ev, ours), "rec")
            t0 = time.time(); r = 600  # CUDA_ERROR_NOT_READY
            while time.time() - t0 < 3 and r == 600:
                r = l.cuEventQuery(ev)
            res[n] = f"query={r} after {1e6 * (time.time() - t0):.0f} us"
        old = ctypes.c_void_p(); l.cuCtxPopCurrent_v2(ctypes.byref(old))
    t = threading.Thread(target=work, daemon=True); t.start(); t.join(15)
    print(f"exporter stuck={stuck_exporter}: {res if res else 'BLOCKED'}", flush=True)
    ctypes.c_uint64.from_address(host.value).value = 1
    done.set(); pr.join(10)

if __name__ == "__main__":
    mp.set_start_method("spawn"); main(len(sys.argv) > 1 and sys.argv[1] == "1")
    import os; os._exit(0)
