# Probe (run on a GPU machine with 2 GPUs): what one kernel-initiated put+signal costs one way,
# GPU0 <-> GPU1 over NVLink, and where gscomm's GPU rounds (include/gsc_device.cuh) spend it.
#   python3 docs/probes/ll_pingpong.py [path/to/gsc_device.cuh]
# Each variant is a ping-pong between one block on each GPU (GPU0 sends first), `ROUNDS`
# round trips in one kernel per GPU; printed: half the round trip.
#   flag      thread 0 stores a counter into the peer's memory and polls its own (the floor)
#   ll        an 8-byte LL word (data + round flag) stored by thread 0, polled by thread 0
#   ll-block  the same, the poll and the store separated by the __syncthreads a block needs
#   gsc       gsc_prep_ready / gsc_prep_send / gsc_prep_wait on hand-built descriptors, 8 B
# Peers here are one process with peer access; gscomm maps them through CUDA IPC (same NVLink).
import sys, time
import cupy as cp

HDR = open(sys.argv[1] if len(sys.argv) > 1 else "include/gsc_device.cuh").read()
ROUNDS = 20000
SRC = HDR + r"""
extern "C" __global__ void flag(unsigned long long *mine, unsigned long long *peer, unsigned long long rounds, int first) {
    if (threadIdx.x) return;
    for (unsigned long long r = 1; r <= rounds; r++) {
        if (first) asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(peer), "l"(r) : "memory");
        unsigned long long v;
        do { asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(mine) : "memory"); } while (v < r);
        if (!first) asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(peer), "l"(r) : "memory");
    }
}
/* LL: word = flag << 32 | data, two slots alternating. `sync`: a block barrier after the poll. */
extern "C" __global__ void ll(unsigned long long *mine, unsigned long long *peer, unsigned long long rounds, int first, int sync) {
    for (unsigned long long r = 1; r <= rounds; r++) {
        unsigned long long w = ((unsigned long long)(unsigned)r << 32) | 7u;
        if (first && threadIdx.x == 0) asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(peer + (r & 1)), "l"(w) : "memory");
        if (threadIdx.x == 0) {
            unsigned long long v;
            do { asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(mine + (r & 1)) : "memory"); } while ((unsigned)(v >> 32) != (unsigned)r);
        }
        if (sync) __syncthreads();
        if (!first && threadIdx.x == 0) asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(peer + (r & 1)), "l"(w) : "memory");
        if (sync) __syncthreads();
    }
}
extern "C" __global__ void gsc(const gsc_prepared_device_t *s, const gsc_prepared_device_t *r, unsigned long long rounds, int first) {
    for (unsigned long long i = 0; i < rounds; i++) {
        gsc_prep_ready(r);
        int rc = first ? (gsc_prep_send(s) | gsc_prep_wait(r)) : (gsc_prep_wait(r) | gsc_prep_send(s));
        if (rc) return;
    }
}
"""

mods, streams = [], []
for d in (0, 1):
    with cp.cuda.Device(d):
        cp.cuda.runtime.deviceEnablePeerAccess(1 - d)
        mods.append(cp.RawModule(code=SRC, options=("-std=c++17",)))
        streams.append(cp.cuda.Stream(non_blocking=True))


def zeros(d, n):
    with cp.cuda.Device(d):
        return cp.zeros(n, dtype=cp.uint64)


def run(label, name, args_of, threads):
    for rounds in (100, ROUNDS):  # warm-up, then timed
        for d in (0, 1):
            with cp.cuda.Device(d):
                streams[d].synchronize()
        t0 = time.perf_counter()
        for d in (0, 1):
            with cp.cuda.Device(d):
                mods[d].get_function(name)((1,), (threads,), args_of(d, rounds), stream=streams[d])
        for d in (0, 1):
            with cp.cuda.Device(d):
                streams[d].synchronize()
        dt = time.perf_counter() - t0
    print(f"{label:28s} {dt / ROUNDS / 2 * 1e6:6.2f} us one way")


w = [zeros(0, 64), zeros(1, 64)]
run("flag", "flag", lambda d, n: (w[d], w[1 - d], cp.uint64(n), cp.int32(d == 0)), 32)
for threads in (32, 256):
    for sync in (0, 1):
        w = [zeros(0, 64), zeros(1, 64)]
        run(f"ll {threads} threads sync={sync}", "ll", lambda d, n: (w[d], w[1 - d], cp.uint64(n), cp.int32(d == 0), cp.int32(sync)), threads)


def descriptors(length):
    # Per GPU: a send and a receive control block (4 KiB each, the receive's LL staging area
    # at +1 KiB), a source and a destination buffer.
    ctl_s = [zeros(d, 512) for d in (0, 1)]
    ctl_r = [zeros(d, 512) for d in (0, 1)]
    src = [zeros(d, 64) + (d + 1) for d in (0, 1)]
    dst = [zeros(d, 64) for d in (0, 1)]
    slot = max(1, (length + 3) // 4)
    desc = []
    for d in (0, 1):
        p = 1 - d
        stage = lambda g: ctl_r[g].data.ptr + 1024
        send = [ctl_s[d].data.ptr, ctl_r[p].data.ptr + 128, src[d].data.ptr, stage(p), length, 1, 10**10, slot]
        recv = [ctl_r[d].data.ptr, ctl_s[p].data.ptr + 128, stage(d), dst[d].data.ptr, length, 1, 10**10, slot]
        with cp.cuda.Device(d):
            desc.append((cp.array(send, dtype=cp.uint64), cp.array(recv, dtype=cp.uint64)))
    return desc, (ctl_s, ctl_r, src, dst)


for threads in (32, 256):
    desc, keep = descriptors(8)
    run(f"gsc 8 B {threads} threads", "gsc", lambda d, n: (desc[d][0], desc[d][1], cp.uint64(n), cp.int32(d == 0)), threads)
