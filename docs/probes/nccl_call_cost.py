#!/usr/bin/env python3
"""What one eager ncclAllReduce costs, called through ctypes: NVIDIA's libnccl.so.2 against
gscomm's, two processes (one per GPU), no framework in between.

    python3 docs/probes/nccl_call_cost.py NVIDIA_LIB GSCOMM_LIB [BYTES]

Per library and rank, µs per call:
  enqueue       3000 calls back to back, host time until the last returned (what the host pays,
                unless the GPU falls behind and the launch queue fills);
  back to back  the same, until the stream drained;
  stream sync   one call, then cuStreamSynchronize of its stream, 300 times;
  device sync   one call, then cudaDeviceSynchronize, 300 times (what torch.cuda.synchronize does).
Buffers and the stream come from torch; the unique id goes through a TCPStore.
"""

import ctypes
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def measure(lib_path, rank, world, store, tag, nbytes):
    lib = ctypes.CDLL(lib_path, mode=ctypes.RTLD_LOCAL)
    uid = UniqueId()
    if rank == 0:
        assert lib.ncclGetUniqueId(ctypes.byref(uid)) == 0
        store.set(tag, ctypes.string_at(ctypes.addressof(uid), 128))  # all 128 bytes (the field stops at a NUL)
    else:
        raw = store.get(tag)
        ctypes.memmove(ctypes.addressof(uid), raw, 128)
    comm = ctypes.c_void_p()
    rc = lib.ncclCommInitRank(ctypes.byref(comm), world, uid, rank)
    assert rc == 0, f"init {rc}"
    n = max(1, nbytes // 4)
    x = torch.ones(n, device="cuda")
    y = torch.empty_like(x)
    s = torch.cuda.Stream()
    sp = ctypes.c_void_p(s.cuda_stream)

    def call():
        r = lib.ncclAllReduce(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()), ctypes.c_size_t(n), 7, 0, comm, sp)
        assert r == 0, r

    for _ in range(200):
        call()
    s.synchronize()
    store.set(f"{tag}-w{rank}", "1")
    store.wait([f"{tag}-w{r}" for r in range(world)])
    res = {}
    k = 3000
    t0 = time.perf_counter()
    for _ in range(k):
        call()
    t1 = time.perf_counter()
    s.synchronize()
    t2 = time.perf_counter()
    res["enqueue"] = (t1 - t0) / k * 1e6
    res["back to back"] = (t2 - t0) / k * 1e6
    t0 = time.perf_counter()
    for _ in range(300):
        call()
        s.synchronize()
    res["stream sync"] = (time.perf_counter() - t0) / 300 * 1e6
    t0 = time.perf_counter()
    for _ in range(300):
        call()
        torch.cuda.synchronize()
    res["device sync"] = (time.perf_counter() - t0) / 300 * 1e6
    assert torch.equal(y, torch.full_like(x, world)), "wrong sum"
    lib.ncclCommDestroy(comm)
    return res


def worker(rank, world, name, path, nbytes, port):
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    res = measure(path, rank, world, store, name, nbytes)
    print(f"{name:7} rank {rank}: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()) + " µs/call", flush=True)
    store.set(f"{name}-done{rank}", "1")
    store.wait([f"{name}-done{r}" for r in range(world)])


if __name__ == "__main__":
    nbytes = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    # Each library in processes of its own: both are libnccl.so.2.
    for i, (name, path) in enumerate([("nvidia", sys.argv[1]), ("gscomm", sys.argv[2])]):
        port = 29600 + (os.getpid() + 7 * i) % 1000
        mp.spawn(worker, args=(2, name, os.path.realpath(path), nbytes, port), nprocs=2)
