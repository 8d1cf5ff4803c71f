# Probe (run on a GPU machine with 2 GPUs): how much of a prepared round's handshake a copy
# enqueued ahead of time would save. A 128 MiB copy-engine push from GPU 0 into GPU 1, timed
# on the host from "the proxy decides the round may go" to "the copy's event reports done":
#   A. issue: cuMemcpyAsync + event record at that moment (what the proxy does now);
#   B. gated: a one-thread kernel spinning on a page-locked word, then the copy and the event,
#      all enqueued beforehand; "go" is one store into the word;
#   C. graph: the copy as a captured one-node graph, launched at that moment.
#   python3 docs/probes/gated_copy.py [MiB] [iterations]
import ctypes, sys, time, statistics as st
import cupy as cp

MIB = int(sys.argv[1]) if len(sys.argv) > 1 else 128
ITERS = int(sys.argv[2]) if len(sys.argv) > 2 else 40
N = MIB << 20
ns = time.perf_counter_ns
DEFAULT = 4  # cudaMemcpyDefault (unified addressing)

with cp.cuda.Device(1):
    dst = cp.empty(N, cp.uint8)
with cp.cuda.Device(0):
    try:
        cp.cuda.runtime.deviceEnablePeerAccess(1)
    except cp.cuda.runtime.CUDARuntimeError:
        pass
    src = cp.ones(N, cp.uint8)
    s = cp.cuda.Stream(non_blocking=True)
    pinned = cp.cuda.alloc_pinned_memory(64)
    word = (ctypes.c_uint64 * 1).from_address(pinned.ptr)
    word[0] = 0
    gate = cp.RawKernel(r'''
extern "C" __global__ void gate(volatile unsigned long long *w, unsigned long long v) {
    while (*w < v) { }
}''', 'gate')
    ev = cp.cuda.Event(disable_timing=True)

    def spin(e):
        while not e.done:
            pass

    def copy():
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, N, DEFAULT, s.ptr)

    # Warm up every path once.
    copy(); ev.record(s); spin(ev)
    s.begin_capture(); copy(); g = s.end_capture(); g.upload(s); s.synchronize()

    res = {}
    a_issue, a_total = [], []
    for _ in range(ITERS):
        t0 = ns(); copy(); ev.record(s); t1 = ns(); spin(ev); t2 = ns()
        a_issue.append(t1 - t0); a_total.append(t2 - t0)
    res['A issue'] = (a_issue, a_total)

    b_total = []
    for i in range(ITERS):
        v = i + 1
        gate((1,), (1,), (cp.uint64(pinned.ptr), cp.uint64(v)), stream=s)
        copy(); ev.record(s)
        time.sleep(0.003)  # the gate is spinning well before "go"
        t0 = ns(); word[0] = v; spin(ev); t2 = ns()
        b_total.append(t2 - t0)
    res['B gated'] = ([0], b_total)

    c_issue, c_total = [], []
    for _ in range(ITERS):
        t0 = ns(); g.launch(s); ev.record(s); t1 = ns(); spin(ev); t2 = ns()
        c_issue.append(t1 - t0); c_total.append(t2 - t0)
    res['C graph'] = (c_issue, c_total)

    for k, (iss, tot) in res.items():
        print(f"{k:8s} {MIB} MiB: host issue median {st.median(iss)/1e3:7.2f} us; go -> done median {st.median(tot)/1e3:8.2f} us "
              f"(min {min(tot)/1e3:8.2f}, max {max(tot)/1e3:8.2f})")
