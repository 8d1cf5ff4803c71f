# Probe (run on a GPU machine): does a peer's mapping keep memory its owner freed?
# gscomm maps a peer's buffer (legacy cuIpcOpenMemHandle, or an imported VMM allocation) the
# first time a call needs it and keeps the mapping until the peer replaces the allocation at
# the same address, or the process exits. This asks what that costs the owner when it frees:
#   python3 docs/probes/ipc_free_held.py [fraction]   # of the owner GPU's free memory; default 0.6
# The owner (a process of its own, GPU 0) makes an allocation and exports it; the importer (this
# process; GPU 1, or beside the owner on a one-GPU machine) maps it; the owner frees it and reads
# cuMemGetInfo, then tries to allocate the same size again; the importer closes (unmaps) its
# mapping and the owner reads cuMemGetInfo once more. For legacy IPC the owner also exports a new
# allocation, and the importer opens it while the old mapping is still open. Each step prints
# the free memory the owner sees and how long the importer's close took. At 0.6 of the free
# memory a second allocation fits only if the first one's memory came back.
import ctypes, multiprocessing as mp, socket, time, sys, os

class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

class Flags(ctypes.Structure):
    _fields_ = [("comp", ctypes.c_ubyte), ("rdma", ctypes.c_ubyte), ("usage", ctypes.c_ushort), ("res", ctypes.c_ubyte * 4)]

class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("handles", ctypes.c_int), ("loc", Loc), ("win32", ctypes.c_void_p), ("flags", Flags)]

class Access(ctypes.Structure):
    _fields_ = [("loc", Loc), ("flags", ctypes.c_int)]

class IpcHandle(ctypes.Structure):
    _fields_ = [("r", ctypes.c_char * 64)]

POSIX_FD, PINNED, DEVICE, RW = 1, 1, 1, 3
GiB = 1 << 30

def chk(r, what):
    if r != 0:
        raise RuntimeError(f"{what} -> {r}")

def setup(dev):
    l = ctypes.CDLL("libcuda.so.1"); chk(l.cuInit(0), "init")
    d = ctypes.c_int(); chk(l.cuDeviceGet(ctypes.byref(d), dev), "devget")
    ctx = ctypes.c_void_p(); chk(l.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), d), "retain")
    chk(l.cuCtxSetCurrent(ctx), "setcur")
    return l

def free_gib(l):
    f, t = ctypes.c_size_t(), ctypes.c_size_t(); chk(l.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t)), "meminfo")
    return f.value / GiB

def owner(conn, sock_name, size_box):
    """Runs the commands the importer sends; answers each with what it saw."""
    l = setup(0)
    size = 0
    ptr, vmm = ctypes.c_uint64(), None
    while True:
        cmd = conn.recv()
        if cmd == "quit":
            return
        size = size_box.value
        if cmd == "legacy":
            before = free_gib(l)
            r = l.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size))
            if r != 0:
                conn.send(("alloc failed", r, before)); continue
            h = IpcHandle(); chk(l.cuIpcGetMemHandle(ctypes.byref(h), ptr), "gethandle")
            conn.send(("ok", ctypes.string_at(ctypes.byref(h), 64), ptr.value, before, free_gib(l)))
        elif cmd == "free":
            chk(l.cuMemFree_v2(ptr), "free")
            time.sleep(0.5)
            conn.send(free_gib(l))
        elif cmd == "vmm":
            before = free_gib(l)
            p = Prop(type=PINNED, handles=POSIX_FD, loc=Loc(DEVICE, 0))
            h = ctypes.c_uint64(); chk(l.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(p), ctypes.c_ulonglong(0)), "create")
            va = ctypes.c_uint64(); chk(l.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_ulonglong(0)), "reserve")
            chk(l.cuMemMap(va, ctypes.c_size_t(size), ctypes.c_size_t(0), h, ctypes.c_ulonglong(0)), "map")
            a = Access(loc=Loc(DEVICE, 0), flags=RW); chk(l.cuMemSetAccess(va, ctypes.c_size_t(size), ctypes.byref(a), ctypes.c_size_t(1)), "access")
            fd = ctypes.c_int(-1); chk(l.cuMemExportToShareableHandle(ctypes.byref(fd), h, POSIX_FD, ctypes.c_ulonglong(0)), "export")
            vmm = (h, va)
            srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); srv.bind("\0" + sock_name); srv.listen(1)
            conn.send(("ok", before, free_gib(l)))
            c, _ = srv.accept(); socket.send_fds(c, [b"x"], [fd.value]); c.close(); srv.close()
            os.close(fd.value)  # what gscomm's exporter does once the descriptor is withdrawn
        elif cmd == "vmm free":
            h, va = vmm
            chk(l.cuMemUnmap(va, ctypes.c_size_t(size)), "unmap"); chk(l.cuMemRelease(h), "release")
            chk(l.cuMemAddressFree(va, ctypes.c_size_t(size)), "addrfree")
            time.sleep(0.5)
            conn.send(free_gib(l))
        elif cmd == "meminfo":
            conn.send(free_gib(l))

def timed(f):
    t0 = time.time(); r = f(); return r, 1e3 * (time.time() - t0)

def main(size_fraction):
    conn, child = mp.Pipe()
    name = f"gsc-free-probe-{os.getpid()}"
    size_box = mp.Value("Q", 0)
    pr = mp.Process(target=owner, args=(child, name, size_box)); pr.start()
    l0 = ctypes.CDLL("libcuda.so.1"); chk(l0.cuInit(0), "init")
    n = ctypes.c_int(); chk(l0.cuDeviceGetCount(ctypes.byref(n)), "count")
    dev = min(1, n.value - 1)
    l = setup(dev)
    conn.send("meminfo"); free = conn.recv()
    size = int(free * size_fraction * GiB) // (2 << 20) * (2 << 20)
    size_box.value = size
    print(f"importer on GPU {dev}, owner on GPU 0 ({free:.2f} GiB free), {size / GiB:.2f} GiB allocations", flush=True)

    # Legacy IPC.
    conn.send("legacy"); st, h, base, before, after = conn.recv()
    print(f"legacy: owner free {before:.2f} GiB, after its alloc {after:.2f}", flush=True)
    hh = IpcHandle(); ctypes.memmove(ctypes.byref(hh), h, 64)
    m = ctypes.c_uint64(); chk(l.cuIpcOpenMemHandle_v2(ctypes.byref(m), hh, 1), "open")
    conn.send("free"); print(f"legacy: owner freed it while the importer has it open: owner free {conn.recv():.2f} GiB", flush=True)
    conn.send("legacy"); ans = conn.recv()
    if ans[0] == "ok":
        _, h2, base2, _, after2 = ans
        print(f"legacy: owner's new allocation {'at the same address' if base2 == base else 'elsewhere'}; owner free {after2:.2f}", flush=True)
        hh2 = IpcHandle(); ctypes.memmove(ctypes.byref(hh2), h2, 64)
        m2 = ctypes.c_uint64(); r = l.cuIpcOpenMemHandle_v2(ctypes.byref(m2), hh2, 1)
        print(f"legacy: importer opens the new one with the old still open: {r}", flush=True)
        if r == 0:
            _, ms = timed(lambda: l.cuIpcCloseMemHandle(m2)); print(f"legacy: close of the new one {ms:.2f} ms", flush=True)
        conn.send("free"); print(f"legacy: owner freed the new one: owner free {conn.recv():.2f}", flush=True)
    else:
        print(f"legacy: owner's second allocation failed: {ans[1]} (free {ans[2]:.2f} GiB)", flush=True)
    r, ms = timed(lambda: l.cuIpcCloseMemHandle(m))
    conn.send("meminfo"); print(f"legacy: importer closed the old mapping ({r}, {ms:.2f} ms): owner free {conn.recv():.2f}", flush=True)

    # VMM, POSIX fd.
    conn.send("vmm"); _, before, after = conn.recv()
    print(f"vmm: owner free {before:.2f} GiB, after its allocation {after:.2f}", flush=True)
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    for _ in range(100):
        try:
            c.connect("\0" + name); break
        except OSError:
            time.sleep(0.05)
    _, fds, _, _ = socket.recv_fds(c, 1, 1); c.close()
    h = ctypes.c_uint64(); chk(l.cuMemImportFromShareableHandle(ctypes.byref(h), ctypes.c_void_p(fds[0]), POSIX_FD), "import"); os.close(fds[0])
    va = ctypes.c_uint64(); chk(l.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_ulonglong(0)), "reserve")
    chk(l.cuMemMap(va, ctypes.c_size_t(size), ctypes.c_size_t(0), h, ctypes.c_ulonglong(0)), "map")
    a = Access(loc=Loc(DEVICE, dev), flags=RW); chk(l.cuMemSetAccess(va, ctypes.c_size_t(size), ctypes.byref(a), ctypes.c_size_t(1)), "access")
    chk(l.cuMemRelease(h), "release")  # the mapping holds the memory, as in gscomm
    conn.send("vmm free"); print(f"vmm: owner unmapped and released it while the importer maps it: owner free {conn.recv():.2f} GiB", flush=True)
    conn.send("legacy"); ans = conn.recv()
    print(f"vmm: owner allocates the same size again: {'ok' if ans[0] == 'ok' else f'failed {ans[1]}'}", flush=True)
    if ans[0] == "ok":
        conn.send("free"); conn.recv()
    r, ms = timed(lambda: l.cuMemUnmap(va, ctypes.c_size_t(size)))
    chk(l.cuMemAddressFree(va, ctypes.c_size_t(size)), "addrfree")
    conn.send("meminfo"); print(f"vmm: importer unmapped ({r}, {ms:.2f} ms): owner free {conn.recv():.2f}", flush=True)
    conn.send("quit"); pr.join(10)

if __name__ == "__main__":
    mp.set_start_method("spawn")
    try:
        main(float(sys.argv[1]) if len(sys.argv) > 1 else 0.6)
    finally:
        for c in mp.active_children():
            c.kill()
        sys.stdout.flush()
        os._exit(0)
