# Probe (run on a GPU machine): do the driver calls the proxy makes on the VMM (POSIX fd) IPC
# path block while a stream waits on a memop (as a stream condition's stream does)? And does
# cuMemUnmap of the imported mapping (what ipc::map_peer does to a replaced one) block there?
#   python3 docs/probes/vmm_block.py 0   # exporter idle
#   python3 docs/probes/vmm_block.py 1   # exporter's own stream also stuck on a memop
#   python3 docs/probes/vmm_block.py 2   # and a kernel of the importer's spinning meanwhile
# Prints the time of every step; a step still running after 15 s is reported as BLOCKED.
# Results: 2 x H200, 2026-11-21 (modes 0 and 1): the import calls finish while streams wait.
# nvidia-h100-x1 (importer beside the exporter on the one GPU), 2026-11-23, driver 580.159.04:
# every mode finished; cuMemUnmap 89 us (mode 0), 95 us (1), 107 us (2, the kernel still
# running after it and finishing in 11 us once its word was set). So unmapping an imported
# mapping does not synchronize the device, and gscomm unmaps replaced VMM mappings at once
# (ipc::map_peer); legacy cuIpcCloseMemHandle does synchronize (ipc_close_thread.py).
import ctypes, multiprocessing as mp, socket, threading, time, sys, os

class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

class Flags(ctypes.Structure):
    _fields_ = [("comp", ctypes.c_ubyte), ("rdma", ctypes.c_ubyte), ("usage", ctypes.c_ushort), ("res", ctypes.c_ubyte * 4)]

class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("handles", ctypes.c_int), ("loc", Loc), ("win32", ctypes.c_void_p), ("flags", Flags)]

class Access(ctypes.Structure):
    _fields_ = [("loc", Loc), ("flags", ctypes.c_int)]

POSIX_FD, PINNED, DEVICE, RW = 1, 1, 1, 3
SIZE = 4 << 20

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

# A kernel that spins until the 64-bit word at its argument is non-zero (a collective kernel
# waiting on a peer, as far as the driver can tell).
SPIN_PTX = b"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry spin(.param .u64 word) {
  .reg .u64 %rd<3>;
  .reg .pred %p;
  ld.param.u64 %rd1, [word];
LOOP:
  ld.volatile.global.u64 %rd2, [%rd1];
  setp.eq.u64 %p, %rd2, 0;
  @%p bra LOOP;
  ret;
}
"""

def spinning_kernel(l):
    """Launch `spin` on a stream of its own, on a mapped host word that stays 0 until set."""
    host = ctypes.c_void_p(); chk(l.cuMemHostAlloc(ctypes.byref(host), 4096, 3), "hostalloc")
    ctypes.memset(host, 0, 4096)
    dptr = ctypes.c_uint64(); chk(l.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), host, 0), "hostdevptr")
    mod = ctypes.c_void_p(); chk(l.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(SPIN_PTX + b"\0")), "module")
    f = ctypes.c_void_p(); chk(l.cuModuleGetFunction(ctypes.byref(f), mod, b"spin"), "function")
    s = ctypes.c_void_p(); chk(l.cuStreamCreate(ctypes.byref(s), 1), "stream")
    arg = ctypes.c_uint64(dptr.value); args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(arg), ctypes.c_void_p))
    chk(l.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, args, None), "launch")
    time.sleep(0.1)
    return host, s, arg

def exporter(name, ready, done, stuck):
    l, ctx = setup(0)
    p = Prop(type=PINNED, handles=POSIX_FD, loc=Loc(DEVICE, 0))
    h = ctypes.c_uint64(); chk(l.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(SIZE), ctypes.byref(p), ctypes.c_ulonglong(0)), "create")
    fd = ctypes.c_int(-1)
    chk(l.cuMemExportToShareableHandle(ctypes.byref(fd), h, POSIX_FD, ctypes.c_ulonglong(0)), "export")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); srv.bind("\0" + name); srv.listen(1)
    if stuck:
        host, s = stuck_stream(l)
    ready.set()
    c, _ = srv.accept(); socket.send_fds(c, [b"x"], [fd.value]); c.close()
    done.wait(60)
    if stuck:
        ctypes.c_uint64.from_address(host.value).value = 1

def main(stuck_exporter, spin_kernel):
    name = f"gsc-vmm-probe-{os.getpid()}"
    ready, done = mp.Event(), mp.Event()
    pr = mp.Process(target=exporter, args=(name, ready, done, stuck_exporter)); pr.start()
    ready.wait(30)
    l0 = ctypes.CDLL("libcuda.so.1"); chk(l0.cuInit(0), "init")
    count = ctypes.c_int(); chk(l0.cuDeviceGetCount(ctypes.byref(count)), "count")
    dev = min(1, count.value - 1)  # the importer on the second GPU, or beside the exporter on one
    l, ctx = setup(dev)
    # The kernel first: with lazy loading, launching it behind the stuck stream would wait for
    # that stream (the programming guide's lazy-loading hazard; gscomm loads its modules eagerly).
    spin = spinning_kernel(l) if spin_kernel else None
    host, user = stuck_stream(l)
    steps = []
    def step(what, f):
        t0 = time.time(); steps.append(f"{what}: running"); f()
        steps[-1] = f"{what}: {1e6 * (time.time() - t0):.0f} us"
    def work():
        chk(l.cuCtxPushCurrent_v2(ctx), "push")
        ours = ctypes.c_void_p(); chk(l.cuStreamCreate(ctypes.byref(ours), 1), "ours")
        dst = ctypes.c_uint64(); chk(l.cuMemAlloc_v2(ctypes.byref(dst), SIZE), "dst")
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); c.connect("\0" + name)
        _, fds, _, _ = socket.recv_fds(c, 1, 1)
        h = ctypes.c_uint64()
        step("cuMemImportFromShareableHandle", lambda: chk(l.cuMemImportFromShareableHandle(ctypes.byref(h), ctypes.c_void_p(fds[0]), POSIX_FD), "import"))
        os.close(fds[0])
        p = Prop(); chk(l.cuMemGetAllocationPropertiesFromHandle(ctypes.byref(p), h), "props")
        g = ctypes.c_size_t(); chk(l.cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(p), 0), "gran")
        va = ctypes.c_uint64()
        step("cuMemAddressReserve", lambda: chk(l.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(SIZE), g, ctypes.c_uint64(0), ctypes.c_ulonglong(0)), "reserve"))
        step("cuMemMap", lambda: chk(l.cuMemMap(va, ctypes.c_size_t(SIZE), ctypes.c_size_t(0), h, ctypes.c_ulonglong(0)), "map"))
        a = Access(loc=Loc(DEVICE, dev), flags=RW)
        step("cuMemSetAccess", lambda: chk(l.cuMemSetAccess(va, ctypes.c_size_t(SIZE), ctypes.byref(a), ctypes.c_size_t(1)), "access"))
        step("cuMemRelease(imported)", lambda: chk(l.cuMemRelease(h), "release"))
        ev = ctypes.c_void_p(); chk(l.cuEventCreate(ctypes.byref(ev), 2), "event")
        for n in (1, 8, 1 << 20):
            chk(l.cuMemcpyAsync(dst, va, ctypes.c_size_t(n), ours), "memcpy"); chk(l.cuEventRecord(ev, ours), "rec")
            t0 = time.time(); r = 600  # CUDA_ERROR_NOT_READY
            while time.time() - t0 < 3 and r == 600:
                r = l.cuEventQuery(ev)
            steps.append(f"copy {n} B: query={r} after {1e6 * (time.time() - t0):.0f} us")
        step("cuMemUnmap", lambda: chk(l.cuMemUnmap(va, ctypes.c_size_t(SIZE)), "unmap"))
        step("cuMemAddressFree", lambda: chk(l.cuMemAddressFree(va, ctypes.c_size_t(SIZE)), "free"))
        old = ctypes.c_void_p(); l.cuCtxPopCurrent_v2(ctypes.byref(old))
    t = threading.Thread(target=work, daemon=True); t.start(); t.join(15)
    state = "finished" if not t.is_alive() else "BLOCKED at the last step"
    print(f"exporter stuck={stuck_exporter}, importer's kernel spinning={spin_kernel}: {state}", flush=True)
    for s in steps:
        print("  " + s, flush=True)
    if spin:
        print(f"  spinning kernel's stream before its word is set: query={l.cuStreamQuery(spin[1])} (600: still running)", flush=True)
        ctypes.c_uint64.from_address(spin[0].value).value = 1
        t0 = time.time(); r = l.cuStreamSynchronize(spin[1])
        print(f"  spinning kernel after its word is set: sync={r} in {1e6 * (time.time() - t0):.0f} us", flush=True)
    ctypes.c_uint64.from_address(host.value).value = 1
    print(f"  stuck stream after its word is set: sync={l.cuStreamSynchronize(user)}", flush=True)
    done.set(); pr.join(10)

if __name__ == "__main__":
    import faulthandler; faulthandler.dump_traceback_later(40, exit=True)  # a hang shows where
    mode = sys.argv[1] if len(sys.argv) > 1 else "0"
    mp.set_start_method("spawn"); main(mode in ("1", "2"), mode == "2")
    os._exit(0)
