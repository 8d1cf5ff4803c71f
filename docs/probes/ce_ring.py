# Probe (run on a GPU machine with 2-4 GPUs): reduce-scatter and all-reduce by a copy-engine
# ring, the SMs only reducing. sm_patterns.py found the copy engines at 373 GB/s per GPU when
# each GPU pushes to the next (all-to-all: ~200-220), above what SMs move through the switch
# (push 335-337, pull 303-316); this asks how much of that a pipelined ring keeps.
#
# Rank d pushes to q = d + 1 (mod n). Each chunk (bytes / n) is cut into K pieces; piece k of
# step s travels by a copy on one of L side streams ("lanes") of the copy engines, then a
# stream memop raises a flag at the receiver; a reduction kernel there waits for the flag
# (spinning, with a time limit), adds its own input and, for the next step, the lane's next
# copy starts after it (an event). All-gather (second half of the all-reduce) forwards the
# reduced chunks around the ring the same way, a small wait kernel on the lane standing for
# the reduction. Flags are 0/1 words the consumer clears, so one captured graph per GPU
# replays: a neighbour writes a flag again only after the consumer's call ended (the start
# handshake: a rank lets its predecessor write into it only when its call begins).
#
#   python3 docs/probes/ce_ring.py [GPUS] [MiB ...] [K:LANES:BLOCKS:memop|copy ...]
# (with configurations given, only the full collectives in those configurations)
# Prints busbw as nccl-tests (reduce-scatter: (n-1)/n * bytes / t; all-reduce: twice that).
import ctypes
import sys
import time
import cupy as cp

n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
sizes = [int(a) << 20 for a in sys.argv[2:] if ":" not in a] or [128 << 20, 512 << 20]
devs = list(range(n))
cuda = ctypes.CDLL("libcuda.so.1")
cuda.cuStreamWriteValue32_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]

SRC = r"""
static __device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t;
}
/* Wait until *w != 0; sets *bad after 5 s. */
static __device__ void wait_set(volatile unsigned *w, int *bad) {
    unsigned long long t0 = now_ns();
    while (*w == 0) {
        if (now_ns() - t0 > 5000000000ull) { atomicExch(bad, 1); return; }
    }
    __threadfence();
}
/* One thread per flag: wait, then clear. */
extern "C" __global__ void wait_clear(unsigned *flags, int count, int *bad) {
    for (int i = threadIdx.x; i < count; i += blockDim.x) { wait_set(flags + i, bad); flags[i] = 0; }
}
/* out = a + b after *flag is raised; the last block clears the flag. */
extern "C" __global__ void reduce(unsigned *flag, unsigned *count, const float4 *a, const float4 *b, float4 *out,
                                  unsigned long long n4, int *bad) {
    if (threadIdx.x == 0) wait_set(flag, bad);
    __syncthreads();
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n4; i += stride) {
        float4 x = a[i], y = b[i];
        out[i] = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(count, 1) == gridDim.x - 1) { *flag = 0; *count = 0; }
    }
}
"""

fns, bad = [], []
ONES = []  # per GPU: a word holding 1, the source of flags raised by a copy
for d in devs:
    with cp.cuda.Device(d):
        for p in devs:
            if p != d:
                cp.cuda.runtime.deviceEnablePeerAccess(p)
        m = cp.RawModule(code=SRC)
        fns.append({k: m.get_function(k) for k in ("wait_clear", "reduce")})
        bad.append(cp.zeros(1, dtype=cp.int32))
        ONES.append(cp.ones(1, dtype=cp.uint32))


def write_flag(stream, addr, how, d):
    """Raise the flag at `addr` after what `stream` did so far: a stream memop, or a 4-byte copy."""
    if how == "memop":
        r = cuda.cuStreamWriteValue32_v2(ctypes.c_void_p(stream.ptr), addr, 1, 0)
        assert r == 0, f"cuStreamWriteValue32: {r}"
    else:
        cp.cuda.runtime.memcpyAsync(addr, ONES[d].data.ptr, 4, 4, stream.ptr)


def sync():
    for d in devs:
        with cp.cuda.Device(d):
            cp.cuda.runtime.deviceSynchronize()


class Ring:
    """Per-GPU buffers, flags and one captured graph for (kind, bytes, K, L, blocks).
    variant: "full" (the collective); "memop"/"copy" (its copies and the flags raised by memops
    or 4-byte copies, no reductions, waits only at the end); "bare" (its copies alone)."""

    def __init__(self, kind, nbytes, K, L, blocks, variant="full", sig="memop"):
        self.kind, self.nbytes, self.variant = kind, nbytes, variant
        full = variant == "full"
        if not full:
            sig = variant
        chunk = nbytes // n
        piece = chunk // K
        assert piece * K * n == nbytes and piece % 16 == 0
        self.inp, self.out, self.scr, self.flags, self.counts = [], [], [], [], []
        nflags = 1 + 2 * (n - 1) * K  # start, data(s, k), gathered(t, k)
        for d in devs:
            with cp.cuda.Device(d):
                i = cp.arange(nbytes // 4, dtype=cp.int64)
                self.inp.append(((i % 7) + d + 1).astype(cp.float32))
                self.out.append(cp.zeros(nbytes // 4 if kind == "ar" else chunk // 4, dtype=cp.float32))
                self.scr.append(cp.zeros((n - 1) * chunk // 4, dtype=cp.float32))
                self.flags.append(cp.zeros(nflags, dtype=cp.uint32))
                self.counts.append(cp.zeros(nflags, dtype=cp.uint32))
        # Everything above ran on the null stream, which the graphs' streams do not wait for:
        # a peer's first flag must not land before our zeroing.
        sync()
        START = 0
        DATA = lambda s, k: 1 + s * K + k  # noqa: E731
        GATH = lambda t, k: 1 + (n - 1) * K + t * K + k  # noqa: E731
        fa = lambda d, f: self.flags[d].data.ptr + 4 * f  # noqa: E731
        self.graphs, self.mains = [], []
        for d in devs:
            q, p = (d + 1) % n, (d - 1) % n
            with cp.cuda.Device(d):
                main = cp.cuda.Stream(non_blocking=True)
                lanes = [cp.cuda.Stream(non_blocking=True) for _ in range(L)]
                f = fns[d]
                inp, out, scr = self.inp[d].data.ptr, self.out[d].data.ptr, self.scr[d].data.ptr
                main.begin_capture(mode=getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", 2))
                # Start: let p write into us, wait until q lets us write into it.
                write_flag(main, fa(p, START), "memop", d)
                f["wait_clear"]((1,), (32,), (self.flags[d][START:], cp.int32(1), bad[d]), stream=main)
                ev = cp.cuda.Event(disable_timing=True)
                ev.record(main)
                for ln in lanes:
                    ln.wait_event(ev)
                reduced = {}
                last = n - 2
                for s in range(n - 1):
                    for k in range(K):
                        ln = lanes[(s * K + k) % L]
                        if s == 0:
                            src = inp + ((d - 1) % n) * chunk + k * piece
                        else:
                            if full:
                                ln.wait_event(reduced[(s - 1, k)])
                            src = scr + (s - 1) * chunk + k * piece
                        dst = self.scr[q].data.ptr + s * chunk + k * piece
                        cp.cuda.runtime.memcpyAsync(dst, src, piece, 4, ln.ptr)
                        if sig != "bare":
                            write_flag(ln, fa(q, DATA(s, k)), sig, d)
                    for k in range(K if full else 0):
                        c = (d - s - 2) % n
                        a = scr + s * chunk + k * piece
                        b = inp + c * chunk + k * piece
                        if s < last:
                            o = a
                        elif kind == "ar":
                            o = out + d * chunk + k * piece
                        else:
                            o = out + k * piece
                        fl = DATA(s, k)
                        f["reduce"]((blocks,), (512,), (self.flags[d][fl:], self.counts[d][fl:], cp.uint64(a), cp.uint64(b), cp.uint64(o), cp.uint64(piece // 16), bad[d]), stream=main)
                        e = cp.cuda.Event(disable_timing=True)
                        e.record(main)
                        reduced[(s, k)] = e
                if kind == "ar":
                    for t in range(n - 1):
                        c = (d - t) % n
                        for k in range(K):
                            ln = lanes[(t * K + k) % L]
                            if not full:
                                pass
                            elif t == 0:
                                ln.wait_event(reduced[(last, k)])
                            else:
                                g = GATH(t - 1, k)
                                f["wait_clear"]((1,), (32,), (self.flags[d][g:], cp.int32(1), bad[d]), stream=ln)
                            off = c * chunk + k * piece
                            cp.cuda.runtime.memcpyAsync(self.out[q].data.ptr + off, out + off, piece, 4, ln.ptr)
                            if sig != "bare":
                                write_flag(ln, fa(q, GATH(t, k)), sig, d)
                for ln in lanes:
                    e = cp.cuda.Event(disable_timing=True)
                    e.record(ln)
                    main.wait_event(e)
                if not full and sig != "bare":
                    # Every data and gathered flag, at the end.
                    count = (n - 1) * K * (2 if kind == "ar" else 1)
                    f["wait_clear"]((1,), (256,), (self.flags[d][1:], cp.int32(count), bad[d]), stream=main)
                elif full and kind == "ar":
                    g = GATH(n - 2, 0)
                    f["wait_clear"]((1,), (32,), (self.flags[d][g:], cp.int32(K), bad[d]), stream=main)
                self.graphs.append(main.end_capture())
                self.mains.append(main)

    def launch(self):
        for d in devs:
            with cp.cuda.Device(d):
                self.graphs[d].launch(self.mains[d])

    def check(self):
        if self.variant != "full":
            return
        chunk4 = self.nbytes // n // 4
        for d in devs:
            with cp.cuda.Device(d):
                assert int(bad[d][0]) == 0, f"GPU {d}: a wait timed out"
                i = cp.arange(self.nbytes // 4, dtype=cp.int64)
                want = ((i % 7) * n + n * (n + 1) // 2).astype(cp.float32)
                if self.kind == "rs":
                    want = want[d * chunk4:(d + 1) * chunk4]
                assert bool((self.out[d] == want).all()), f"GPU {d}: wrong result"
                self.out[d].fill(0)
        sync()


def measure(kind, nbytes, K, L, blocks, variant="full", sig="memop", reps=20):
    r = Ring(kind, nbytes, K, L, blocks, variant, sig)
    r.launch()
    sync()
    r.check()
    r.launch()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        r.launch()
    sync()
    dt = (time.perf_counter() - t0) / reps
    for d in devs:
        assert int(bad[d][0]) == 0, f"GPU {d}: a wait timed out"
    factor = (n - 1) / n * (2 if kind == "ar" else 1)
    print(f"{kind} {variant:5s} {sig:5s} {nbytes >> 20:4d} MiB K={K:3d} lanes={L} blocks={blocks:3d}  {dt * 1e6:9.1f} us  busbw {factor * nbytes / dt / 1e9:6.1f} GB/s", flush=True)
    del r


print(f"# {n} GPUs, copy-engine ring, graphs replayed back to back")
configs = [(int(k), int(ln), int(b), sig) for k, ln, b, sig in (c.split(":") for c in sys.argv[2:] if ":" in c)]
for nbytes in sizes:
    for kind in ("rs", "ar"):
        if configs:
            for K, L, blocks, sig in configs:
                if (nbytes // n // K) % 16 == 0:
                    measure(kind, nbytes, K, L, blocks, "full", sig)
            continue
        for variant in ("bare", "memop", "copy"):
            for K, L in ((1, 1), (4, 1), (4, 2), (16, 1), (16, 2)):
                measure(kind, nbytes, K, L, 0, variant)
        for K, L, blocks, sig in ((4, 1, 32, "memop"), (4, 1, 132, "memop"), (4, 2, 132, "memop"), (8, 2, 132, "memop"), (4, 2, 132, "copy"), (8, 2, 132, "copy")):
            measure(kind, nbytes, K, L, blocks, "full", sig)
