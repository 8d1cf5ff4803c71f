# Probe (any GPU machine): how fast a stream notices a host-written completion word, and whether
# that depends on how long the stream had been waiting for it.
#   python3 docs/probes/wait_latency.py
# Each iteration enqueues "wait until done >= i, then write trig = i" on a stream, lets it sit for
# PEND microseconds, then the host writes done = i and spins until trig = i. The time from the
# host's write to its seeing trig is the round trip a stream condition pays between one
# operation's completion and the next one's trigger (the proxy engine's per-iteration overhead
# beside a long copy). Three ways to wait: a stream memop wait (cuStreamWaitValue64), a one-thread
# kernel spinning on the word, and that kernel followed by a memop write.
import ctypes, time, statistics as st
import cupy as cp

def chk(r, what):
    if r != 0:
        raise RuntimeError(f"{what} -> {r}")

cp.cuda.Device(0).use()
cp.zeros(1)  # make the primary context current on this thread
l = ctypes.CDLL("libcuda.so.1")
host = ctypes.c_void_p()
chk(l.cuMemHostAlloc(ctypes.byref(host), ctypes.c_size_t(4096), 1 | 2), "cuMemHostAlloc")  # portable | devicemap
dev = ctypes.c_uint64()
chk(l.cuMemHostGetDevicePointer_v2(ctypes.byref(dev), host, 0), "devptr")
done_h = ctypes.c_uint64.from_address(host.value)
trig_h = ctypes.c_uint64.from_address(host.value + 128)
d_done, d_trig = dev.value, dev.value + 128
stream = cp.cuda.Stream(non_blocking=True)
s = ctypes.c_void_p(stream.ptr)
src = r'''
extern "C" __global__ void spin(volatile unsigned long long *done, volatile unsigned long long *trig,
                                unsigned long long v, int write) {
    while (*done < v) { }
    if (write) { *trig = v; __threadfence_system(); }
}'''
spin = cp.RawKernel(src, "spin")
ns = time.perf_counter_ns

def busy(us):
    end = ns() + int(us * 1000)
    while ns() < end:
        pass

seq = [0]
def run(label, how, pend_us, iters=300):
    out = []
    for k in range(iters):
        seq[0] += 1
        i = seq[0]
        if how == "memop":
            chk(l.cuStreamWaitValue64_v2(s, ctypes.c_uint64(d_done), ctypes.c_uint64(i), 0), "wait")
            chk(l.cuStreamWriteValue64_v2(s, ctypes.c_uint64(d_trig), ctypes.c_uint64(i), 0), "write")
        elif how == "kernel":
            spin((1,), (1,), (cp.uint64(d_done), cp.uint64(d_trig), cp.uint64(i), cp.int32(1)), stream=stream)
        else:  # kernel wait, memop write
            spin((1,), (1,), (cp.uint64(d_done), cp.uint64(d_trig), cp.uint64(i), cp.int32(0)), stream=stream)
            chk(l.cuStreamWriteValue64_v2(s, ctypes.c_uint64(d_trig), ctypes.c_uint64(i), 0), "write")
        busy(pend_us)
        t0 = ns()
        done_h.value = i
        while trig_h.value < i:
            pass
        t1 = ns()
        if k >= 20:
            out.append((t1 - t0) / 1e3)
    out.sort()
    print(f"{label:22s} pending {pend_us:7.0f} us: median {st.median(out):6.2f}  p10 {out[len(out)//10]:6.2f}  p90 {out[len(out)*9//10]:6.2f} us")

for pend in (5, 50, 350, 2000):
    for how in ("memop", "kernel", "kernel+memop"):
        run(how, how, pend, iters=300 if pend < 1000 else 80)
