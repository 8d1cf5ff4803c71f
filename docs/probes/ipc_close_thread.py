# Probe (run on a GPU machine): can a thread of its own close peer mappings (cuIpcCloseMemHandle)
# while a stream waits on a memop that another thread (the proxy) releases after driver calls of
# its own? gscomm's proxy never closes a mapping (closing synchronizes the device, and a stream
# waiting on the proxy then never finishes); this asks whether a third thread may, without
# blocking the proxy's calls behind it.
#   python3 docs/probes/ipc_close_thread.py
# The importer's stream waits (64-bit GEQ) on a page-locked host word. The closing thread closes
# mapping 1; 200 ms later the proxy thread opens mapping 2, copies from it, records and queries
# an event, then sets the host word. Prints when each call returned; a call still running after
# 10 s is reported as BLOCKED (the word is then set anyway, to see whether things recover).
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

def exporter(q, done):
    l, ctx = setup(0)
    handles = []
    for _ in range(2):
        p = ctypes.c_uint64(); chk(l.cuMemAlloc_v2(ctypes.byref(p), 4 << 20), "alloc")
        h = (ctypes.c_char * 64)(); chk(l.cuIpcGetMemHandle(h, p), "gethandle")
        handles.append(bytes(h))
    q.put(handles); done.wait(60)

class H(ctypes.Structure):
    _fields_ = [("r", ctypes.c_char * 64)]

def handle(b):
    h = H(); ctypes.memmove(ctypes.byref(h), b, 64); return h

def main():
    q, done = mp.Queue(), mp.Event()
    pr = mp.Process(target=exporter, args=(q, done)); pr.start()
    h1, h2 = q.get(timeout=30)
    l0 = ctypes.CDLL("libcuda.so.1"); chk(l0.cuInit(0), "init")
    n = ctypes.c_int(); chk(l0.cuDeviceGetCount(ctypes.byref(n)), "count")
    l, ctx = setup(min(1, n.value - 1))
    host = ctypes.c_void_p(); chk(l.cuMemHostAlloc(ctypes.byref(host), 4096, 3), "hostalloc")
    ctypes.memset(host, 0, 4096)
    dptr = ctypes.c_uint64(); chk(l.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), host, 0), "hostdevptr")
    user = ctypes.c_void_p(); chk(l.cuStreamCreate(ctypes.byref(user), 1), "stream")
    chk(l.cuStreamWaitValue64_v2(user, dptr, ctypes.c_uint64(1), 0), "waitvalue64")
    m1 = ctypes.c_uint64(); chk(l.cuIpcOpenMemHandle_v2(ctypes.byref(m1), handle(h1), 1), "open 1")
    # The user's stream also reads mapping 1 after its wait, as a kernel of a call would.
    dst0 = ctypes.c_uint64(); chk(l.cuMemAlloc_v2(ctypes.byref(dst0), 4 << 20), "dst0")
    chk(l.cuMemcpyAsync(dst0, m1, 4 << 20, user), "user copy")
    t0 = time.time()
    at = {}
    def stamp(what):
        at[what] = f"{1e3 * (time.time() - t0):.1f} ms"
    def closer():
        chk(l.cuCtxPushCurrent_v2(ctx), "push")
        stamp("close start")
        r = l.cuIpcCloseMemHandle(m1)
        stamp(f"close returned {r}")
    def proxy():
        chk(l.cuCtxPushCurrent_v2(ctx), "push")
        time.sleep(0.2)
        ours = ctypes.c_void_p(); chk(l.cuStreamCreate(ctypes.byref(ours), 1), "ours"); stamp("proxy stream created")
        dst = ctypes.c_uint64(); chk(l.cuMemAlloc_v2(ctypes.byref(dst), 4 << 20), "dst"); stamp("proxy alloc")
        m2 = ctypes.c_uint64(); chk(l.cuIpcOpenMemHandle_v2(ctypes.byref(m2), handle(h2), 1), "open 2"); stamp("proxy open 2")
        ev = ctypes.c_void_p(); chk(l.cuEventCreate(ctypes.byref(ev), 2), "event")
        chk(l.cuMemcpyAsync(dst, m2, 4 << 20, ours), "memcpy"); stamp("proxy copy enqueued")
        chk(l.cuEventRecord(ev, ours), "rec")
        r = 600
        while r == 600:
            r = l.cuEventQuery(ev)
        stamp(f"proxy copy done {r}")
        ctypes.c_uint64.from_address(host.value).value = 1
        stamp("proxy set the word")
    tc = threading.Thread(target=closer, daemon=True); tp = threading.Thread(target=proxy, daemon=True)
    tc.start(); tp.start()
    tp.join(10)
    if tp.is_alive():
        stamp("proxy BLOCKED at 10 s; setting the word from main")
        ctypes.c_uint64.from_address(host.value).value = 1
        tp.join(10)
    tc.join(10)
    if tc.is_alive():
        stamp("close still BLOCKED")
    r = l.cuStreamQuery(user)
    stamp(f"user stream query {r}")
    for k, v in sorted(at.items(), key=lambda kv: float(kv[1].split()[0])):
        print(f"{v:>10}  {k}", flush=True)
    done.set(); pr.join(10)

if __name__ == "__main__":
    mp.set_start_method("spawn"); main()
    import os; os._exit(0)
