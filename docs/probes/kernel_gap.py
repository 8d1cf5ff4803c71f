# Probe (run on a GPU machine): what one kernel per exchange costs on the GPU, before any
# proxy or peer is involved. Each variant is a chain of kernels, replayed as a CUDA graph of
# 100 nodes and launched 1000 times on a stream; times are per kernel.
#   python3 docs/probes/kernel_gap.py
# The variants add, one at a time, what gscomm's trigger/wait kernel (gsc_seq_kernel,
# gsc_ops_kernel in src/cuda/kernels.rs) does over PCIe: a read of a page-locked word, a
# system-scope fence, a store to a page-locked word, and a poll of a page-locked word that is
# already satisfied.
import time
import cupy as cp

SRC = r"""
extern "C" __global__ void empty(unsigned long long *p) {}
extern "C" __global__ void read_host(unsigned long long *p) {
    if (threadIdx.x == 0) p[8] = *(volatile unsigned long long *)p + 1;   /* p: device memory */
}
extern "C" __global__ void pcie_read(unsigned long long *p) {
    if (threadIdx.x == 0) { unsigned long long v = *(volatile unsigned long long *)p; ((volatile unsigned long long *)p)[16] = v; }
}
/* p[0]: a counter in device memory; q: page-locked memory, read one page further each time */
extern "C" __global__ void pcie_read_pages(unsigned long long *p, unsigned long long *q, unsigned long long pages) {
    if (threadIdx.x == 0) {
        unsigned long long i = p[0]++;
        unsigned long long v = *(volatile unsigned long long *)(q + (i % pages) * 512);
        p[1] += v;
    }
}
extern "C" __global__ void fence_store(unsigned long long *p) {
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("fence.acq_rel.sys;" ::: "memory");
        asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(p + 8), "l"(1ULL) : "memory");
    }
}
extern "C" __global__ void full(unsigned long long *p) {
    /* store + fence + trigger, then poll a satisfied word, then read the slot */
    __shared__ int ok;
    if (threadIdx.x == 0) {
        ((volatile unsigned long long *)p)[24] = 5;
        asm volatile("fence.acq_rel.sys;" ::: "memory");
        asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(p + 8), "l"(1ULL) : "memory");
        unsigned long long d;
        do { asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(d) : "l"(p) : "memory"); } while (d < 1);
        ok = (int)((volatile unsigned long long *)p)[32];
    }
    __syncthreads();
    if (threadIdx.x == 0 && ok == 12345) p[40] = 1;
}
"""

mod = cp.RawModule(code=SRC)
host = cp.cuda.alloc_pinned_memory(4096)
hp = host.ptr
import ctypes
ctypes.c_uint64.from_address(hp).value = 1
dptr = hp  # unified addressing: page-locked memory has the same address on the device
dmem = cp.zeros(512, dtype=cp.uint64)

def timed(name, fn, arg, threads=256, more=()):
    k = mod.get_function(fn)
    args = (arg,) + tuple(more)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        for _ in range(100):
            k((1,), (threads,), args)
        s.synchronize()
        t0 = time.perf_counter()
        for _ in range(2000):
            k((1,), (threads,), args)
        s.synchronize()
        stream_us = (time.perf_counter() - t0) / 2000 * 1e6
        s.begin_capture()
        for _ in range(100):
            k((1,), (threads,), args)
        g = s.end_capture()
        g.launch(s)
        s.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            g.launch(s)
        s.synchronize()
        graph_us = (time.perf_counter() - t0) / 10000 * 1e6
    print(f"{name:40s} stream {stream_us:6.2f} us/kernel   graph {graph_us:6.2f} us/node")

timed("empty (1 thread)", "empty", dmem.data.ptr, 1)
timed("empty (256 threads)", "empty", dmem.data.ptr)
timed("read+write device memory", "read_host", dmem.data.ptr)
timed("PCIe read of a page-locked word", "pcie_read", dptr)
timed("fence.sys + store to page-locked word", "fence_store", dptr)
timed("store, fence, trigger, poll, read", "full", dptr)

big = cp.cuda.alloc_pinned_memory(64 << 20)
for pages in (1, 16, 256, 4096, 16384):
    timed(f"PCIe read, {pages} pages in turn", "pcie_read_pages", dmem.data.ptr, 1, (big.ptr, cp.uint64(pages)))
