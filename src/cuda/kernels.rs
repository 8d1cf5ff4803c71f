//! gscomm's own kernels, compiled at run time with NVRTC and cached on disk.
//!
//! The source is include/gsc_device.cuh (the same header users compile into their kernels) plus
//! gscomm's two node kernels: `gsc_ops_kernel`, the replay-safe trigger and completion nodes of
//! graph and captured-stream conditions, and `gsc_seq_kernel`, a plain stream's trigger and wait
//! when small GPU messages are staged around them (see `stage`). Cubins are kept in the disk
//! cache (`kernel_cache`), so only the first run on a machine pays for compilation.

use super::kernel_cache::{Entry, Found};
use super::{CtxScope, check, context_arch, cu};
use crate::error::{Error, Result, Status};
use cudarc::nvrtc::sys as nvrtc;
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::path::Path;
use std::sync::{Mutex, OnceLock};

pub(super) const DEVICE_HEADER: &str = include_str!("../../include/gsc_device.cuh");

const KERNELS: &str = r#"
/* gscomm's own nodes. One operation as they see it: its device handle (persistent operations;
 * null for sequenced ones), and for a small GPU message staged through page-locked memory its
 * slot (word 0: bytes received, written by the proxy; word 16: the stamp this kernel writes once
 * it is done with the slot; data from word 32, a send's as LL words — see src/cuda/stage.rs),
 * the user's buffer and its length. */
#define GSC_GROUP_MAX 8
#define GSC_SLOT_STAMP 16
#define GSC_SLOT_DATA 32
typedef struct {
    gsc_device_handle_t *h;
    unsigned long long *slot;
    unsigned char *buf;
    unsigned long long len;
    unsigned long long stamp;
} gsc_op_t;
typedef struct { unsigned long long n; gsc_op_t op[GSC_GROUP_MAX]; } gsc_ops_t;
/* Persistent operations (graph nodes, stream capture): trigger some, then wait for some.
 * fence: a triggered operation sends data the stream wrote that carries no flags of its own
 * (a send or put that is not staged): a system fence goes before the triggers. */
typedef struct { gsc_ops_t trig, wait; unsigned long long fence; } gsc_ops_args_t;
/* Sequenced operations of a stream: the channel's trigger write and done wait (null: none). */
typedef struct {
    unsigned long long *trigger, tval, *done, wval, fence;
    gsc_ops_t out, in;
} gsc_seq_args_t;
/* The same with nothing staged (gsc_sync_kernel). */
typedef struct { unsigned long long *trigger, tval, *done, wval, fence; } gsc_sync_args_t;

/* Sends of up to GSC_LL_MAX bytes: the user's bytes go into their slots in NCCL's LL format,
 * 8-byte words of (flag << 32 | 4 data bytes), written with system-scope stores. Each word is
 * atomic, so the proxy knows a word arrived when its flag is this use's, and no system fence is
 * needed before the trigger (a fence after page-locked stores costs ~1.5 µs a node:
 * docs/probes/slot_read.cu, part 3). The flag is ll_flag(e) = 1 + e % (2^32 - 1), never 0, of
 * epoch[k] for a persistent operation and of its slot's stamp (unique per use) for a sequenced
 * one (epoch null). */
static __device__ void gsc_stage_out(const gsc_ops_t *o, const unsigned long long *epoch)
{
    for (unsigned k = 0; k < o->n; k++) {
        const gsc_op_t *op = &o->op[k];
        if (!op->slot) continue;
        unsigned long long *dst = op->slot + GSC_SLOT_DATA;
        if (op->len > GSC_LL_MAX) {
            /* Larger sends are plain bytes (LL words would double what crosses PCIe and what the
             * proxy reads back); the kernel fences before its triggers for them. */
            const unsigned char *src = op->buf;
            unsigned long long n = op->len, words = (n + 7) / 8;
            bool aligned = ((unsigned long long)src & 7) == 0;
            for (unsigned long long w = threadIdx.x; w < words; w += blockDim.x) {
                unsigned long long v = 0;
                if (aligned && 8 * w + 8 <= n) {
                    v = ((const unsigned long long *)src)[w];
                } else {
                    for (unsigned b = 0; b < 8 && 8 * w + b < n; b++) v |= (unsigned long long)src[8 * w + b] << (8 * b);
                }
                dst[w] = v;
            }
            continue;
        }
        unsigned long long e = epoch ? epoch[k] : op->stamp; /* a sequenced use: its slot's stamp */
        unsigned long long f = (1ULL + e % 0xFFFFFFFFULL) << 32;   /* ll_flag(e) */
        const unsigned char *src = op->buf;
        unsigned long long n = op->len, words = (n + 3) / 4;
        bool aligned = ((unsigned long long)src & 3) == 0;
        for (unsigned long long w = threadIdx.x; w < words; w += blockDim.x) {
            unsigned long long v = 0;
            if (aligned && 4 * w + 4 <= n) {
                v = ((const unsigned int *)src)[w];
            } else {
                for (unsigned b = 0; b < 4 && 4 * w + b < n; b++) v |= (unsigned long long)src[4 * w + b] << (8 * b);
            }
            asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(dst + w), "l"(f | v) : "memory");
        }
    }
}

/* Receives: what arrived in a slot goes into the user's buffer. Every read of a slot crosses
 * PCIe (about a microsecond), a warp issues its instructions in order (a load whose value is
 * used at once costs the whole round trip), and reads of one line by several warps queue behind
 * each other (8 warps reading the length cost 6 µs: docs/probes/slot_read.cu). So no slot line is
 * read twice and every load is issued before any value is used, in two steps:
 *  - gsc_stage_head: the warp whose lane 0 saw the operation's done word reads the length and
 *    the first 512 bytes at once, 16 bytes a lane (a __syncwarp, no block barrier, between the
 *    poll and the reads), writes them, and returns the length;
 *  - gsc_stage_rest: after a barrier, the block copies the rest, 16 bytes a load, four loads in
 *    flight per thread. */
#define GSC_HEAD_BYTES 512

/* Bytes [off, off + 8) of a message of n bytes into dst (those below n). */
static __device__ __forceinline__ void gsc_put8(unsigned char *dst, unsigned long long off, unsigned long long v, unsigned long long n)
{
    if (off >= n) return;
    if (off + 8 <= n && ((unsigned long long)(dst + off) & 7) == 0) {
        *(unsigned long long *)(dst + off) = v;
        return;
    }
    for (unsigned b = 0; b < 8 && off + b < n; b++) dst[off + b] = (unsigned char)(v >> (8 * b));
}

/* All 32 lanes of a warp, after the done word was seen (and a __syncwarp): lane i reads bytes
 * [16i, 16i + 16) of the slot when they are within the receive's length (a slot's room is a
 * multiple of 16, so the reads stay in the slot), lane 0 the length too, all issued before any
 * is used. Returns the bytes that arrived (every lane). */
static __device__ unsigned long long gsc_stage_head(const gsc_op_t *op, unsigned lane)
{
    const unsigned long long *s = op->slot;
    unsigned long long n = 0, w0 = 0, w1 = 0;
    if (16 * lane < op->len)
        asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];" : "=l"(w0), "=l"(w1) : "l"(s + GSC_SLOT_DATA + 2 * lane) : "memory");
    if (lane == 0) asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(n) : "l"(s) : "memory");
    n = __shfl_sync(0xffffffffu, n, 0);
    if (n > op->len) n = op->len;
    gsc_put8(op->buf, 16 * lane, w0, n);
    gsc_put8(op->buf, 16 * lane + 8, w1, n);
    return n;
}

/* got[k]: bytes of operation k that arrived (0: failed, or not staged). */
static __device__ void gsc_stage_rest(const gsc_ops_t *o, const unsigned long long *got)
{
    for (unsigned k = 0; k < o->n; k++) {
        const gsc_op_t *op = &o->op[k];
        unsigned long long n = got[k];
        if (!op->slot || n <= GSC_HEAD_BYTES) continue;
        const unsigned long long *src = op->slot + GSC_SLOT_DATA;
        unsigned long long chunks = (n + 15) / 16;
        for (unsigned long long c0 = GSC_HEAD_BYTES / 16 + threadIdx.x; c0 < chunks; c0 += 4 * blockDim.x) {
            unsigned long long v[4][2] = {};
#pragma unroll
            for (unsigned j = 0; j < 4; j++) {
                unsigned long long c = c0 + j * blockDim.x;
                if (c < chunks)
                    asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];" : "=l"(v[j][0]), "=l"(v[j][1]) : "l"(src + 2 * c) : "memory");
            }
#pragma unroll
            for (unsigned j = 0; j < 4; j++) {
                unsigned long long c = c0 + j * blockDim.x;
                gsc_put8(op->buf, 16 * c, v[j][0], n);
                gsc_put8(op->buf, 16 * c + 8, v[j][1], n);
            }
        }
    }
}

/* Whether a list stages a send as plain bytes (a system fence must order them before the
 * trigger). */
static __device__ bool gsc_plain_out(const gsc_ops_t *o)
{
    for (unsigned k = 0; k < o->n; k++)
        if (o->op[k].slot && o->op[k].len > GSC_LL_MAX) return true;
    return false;
}

/* One thread, after a barrier: tell the host these slots may be reused. */
static __device__ void gsc_release_slots(const gsc_ops_t *o)
{
    for (unsigned k = 0; k < o->n; k++)
        if (o->op[k].slot) ((volatile unsigned long long *)o->op[k].slot)[GSC_SLOT_STAMP] = o->op[k].stamp;
}

extern "C" __global__ void gsc_ops_kernel(gsc_ops_args_t a)
{
    __shared__ unsigned long long epoch[GSC_GROUP_MAX], got[GSC_GROUP_MAX];
    unsigned t = threadIdx.x;
    if (a.trig.n) {
        if (t < a.trig.n) {
            volatile unsigned long long *ep = &a.trig.op[t].h->epoch;
            epoch[t] = *ep + 1;
            *ep = epoch[t];
        }
        __syncthreads();
        gsc_stage_out(&a.trig, epoch);
        /* No fence before the triggers unless a send was staged as plain bytes or one is not
         * staged (`fence`): LL words carry their own flags. */
        __syncthreads();
        if (t == 0) {
            gsc_release_slots(&a.trig);
            if (a.fence || gsc_plain_out(&a.trig)) asm volatile("fence.acq_rel.sys;" ::: "memory");
        }
        __syncthreads();
        if (t < a.trig.n) asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(a.trig.op[t].h->trigger), "l"(epoch[t]) : "memory");
    }
    if (a.wait.n) {
        /* One warp per operation: lane 0 polls (the warps' polls of page-locked words go over
         * PCIe together), then the warp reads the head of a staged receive. */
        unsigned w = t / 32, lane = t % 32;
        if (w < a.wait.n) {
            const gsc_op_t *op = &a.wait.op[w];
            int good = 0;
            if (lane == 0) good = gsc_wait(op->h) == 0;
            good = __shfl_sync(0xffffffffu, good, 0);
            __syncwarp(); /* orders lane 0's acquire of the done word before the lanes' reads */
            unsigned long long n = good && op->slot ? gsc_stage_head(op, lane) : 0;
            if (lane == 0) got[w] = n;
        }
        __syncthreads();
        gsc_stage_rest(&a.wait, got);
        __syncthreads();
        if (t == 0) gsc_release_slots(&a.wait);
    }
}

/* Programmatic dependent launch (GSC_CUDA_PDL: stream conditions' kernels, and prepared rounds
 * under capture) lets a kernel be resident before the previous kernel on its stream ends.
 * gsc_wait_previous_kernel: wait for that kernel (its memory operations included) before
 * anything else. gsc_let_next_kernel_start: let the next kernel be scheduled now; it waits for
 * us in turn, but holds its SMs meanwhile, so a kernel that waits for a peer calls it only once
 * that wait is over (a user's kernel launched with PDL behind it must not sit on the GPU for
 * the length of a network wait). Both are no-ops without PDL. */
static __device__ __forceinline__ void gsc_wait_previous_kernel()
{
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
static __device__ __forceinline__ void gsc_let_next_kernel_start()
{
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
/* A captured prepared round's kernel: both at once (its successor is the next round's). */
static __device__ __forceinline__ void gsc_after_previous_kernel()
{
    gsc_wait_previous_kernel();
    gsc_let_next_kernel_start();
}

extern "C" __global__ void gsc_seq_kernel(gsc_seq_args_t a)
{
    __shared__ unsigned long long got[GSC_GROUP_MAX];
    __shared__ int good;
    unsigned t = threadIdx.x;
    gsc_wait_previous_kernel();
    gsc_stage_out(&a.out, 0);
    __syncthreads();
    if (t < 32) {
        if (t == 0) {
            gsc_release_slots(&a.out);
            /* Also without a trigger: a launch that only copies plain bytes out comes before
             * the one that triggers (lists longer than GSC_GROUP_MAX). */
            if (a.fence || gsc_plain_out(&a.out)) asm volatile("fence.acq_rel.sys;" ::: "memory");
            if (a.trigger) {
                asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(a.trigger), "l"(a.tval) : "memory");
            }
            good = 1;
            if (a.done) {
                unsigned long long d;
                do {
                    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(d) : "l"(a.done) : "memory");
                } while (d < a.wval);
                good = (d & GSC_DEVICE_DONE_ERROR_BIT) == 0;
            }
        }
    }
    __syncthreads();
    /* Warp k reads the head of receive k right after the poll. */
    unsigned w = t / 32;
    if (w < a.in.n) {
        unsigned long long n = good && a.in.op[w].slot ? gsc_stage_head(&a.in.op[w], t % 32) : 0;
        if (t % 32 == 0) got[w] = n;
    }
    __syncthreads();
    gsc_stage_rest(&a.in, got);
    __syncthreads();
    if (t == 0) gsc_release_slots(&a.in);
    gsc_let_next_kernel_start();
}

/* A plain stream's trigger and wait, nothing staged (GSC_CUDA_WAIT_KERNEL): one thread, so the
 * launch is as cheap as a kernel gets. The system fence (a.fence) orders the stream's earlier
 * writes to host memory before the trigger, as the memop write's default flush does. */
extern "C" __global__ void gsc_sync_kernel(gsc_sync_args_t a)
{
    gsc_wait_previous_kernel();
    if (a.fence) asm volatile("fence.acq_rel.sys;" ::: "memory");
    if (a.trigger) asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(a.trigger), "l"(a.tval) : "memory");
    if (a.done) {
        unsigned long long d;
        do {
            asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(d) : "l"(a.done) : "memory");
        } while (d < a.wval);
    }
    gsc_let_next_kernel_start();
}

/* Rounds of prepared transfers run on the GPU, no proxy (src/cuda/prep_ctl.rs has the control
 * block's layout). role 0: send: wait until the receiver is ready for this round (its word in
 * our block), copy our buffer into its (mapped) buffer over NVLink, raise its arrival word.
 * role 1: receive, ready: begin a round and tell the sender. role 2: receive, wait for the
 * round begun last to arrive, then copy it from the staging area (stage, when the sender writes
 * there rather than into the user's buffer) into buf, and then say ready for the next round
 * already (the area is free; the next start's ready step repeats it). role 3: ready, then wait.
 * role 4: begin a partitioned send round (the user's kernels send the partitions: gsc_pready).
 * A receive waits for `parts` arrival words (one per partition of the sender). Spins give up
 * after timeout_ns (globaltimer) and record the round in the error word. */
#define GSC_PREP_GROUP_MAX 8
typedef struct {
    unsigned long long *ctl, *remote;
    const unsigned char *src;
    unsigned char *dst;
    unsigned long long len, role, timeout_ns;
    const unsigned char *stage;
    unsigned char *buf;
    unsigned long long parts, ll;
} gsc_prep_args_t;
typedef struct { unsigned long long n; gsc_prep_args_t op[GSC_PREP_GROUP_MAX]; } gsc_prep_group_t;

/* One block: tell the sender we are ready (thread 0). */
static __device__ void gsc_prep_ready(const gsc_prep_args_t *a)
{
    if (threadIdx.x == 0) {
        if (a->ll) {
            /* LL (two slots): the sender needs no readiness for round 1 and hears of later
             * rounds from the previous wait: only count the round (a reduction: no load). */
            atomicAdd(a->ctl, 1ULL);
            return;
        }
        unsigned long long e = *(volatile unsigned long long *)a->ctl + 1;
        a->ctl[0] = e;
        /* A staged receive's previous wait already said so (it frees the area at once): only
         * the first round, or one written in place, tells the sender here. */
        if (!a->stage || e == 1) gsc_store_release(a->remote, e);
    }
}

/* One block: wait for the round begun last, then copy it out of the staging area. */
static __device__ void gsc_prep_wait(const gsc_prep_args_t *a)
{
    __shared__ int ok;
    __syncthreads(); /* a ready step just before (thread 0) advanced the round */
    if (a->ll) {
        /* LL words in the staging area: no arrival word; then announce the next round. */
        unsigned long long e = *(volatile unsigned long long *)a->ctl;
        if (!gsc_ll_read(a->buf, (const unsigned long long *)a->stage + gsc_ll_slot(e, a->ll), a->len, e, a->timeout_ns)) {
            if (threadIdx.x == 0) a->ctl[GSC_CTL_ERROR] = e;
        } else if (threadIdx.x == 0) {
            gsc_store_free(a->remote, e + 1);
        }
        __syncthreads();
        return;
    }
    if (threadIdx.x == 0) {
        unsigned long long e = *(volatile unsigned long long *)a->ctl;
        ok = 1;
        for (unsigned long long p = 0; ok && p < a->parts; p++) ok = gsc_spin_geq(a->ctl + GSC_CTL_PEER + p, e, a->timeout_ns);
        if (!ok) a->ctl[GSC_CTL_ERROR] = e;
    }
    __syncthreads();
    if (ok && a->stage) {
        gsc_copy_lanes(a->buf, a->stage, a->len, threadIdx.x, blockDim.x);
        __syncthreads();
        /* The staging area is free again: the sender may write the next round now, before
         * this side starts it (the user's buffer is only written by that round's wait). */
        if (threadIdx.x == 0) gsc_store_free(a->remote, *(volatile unsigned long long *)a->ctl + 1);
    }
    __syncthreads();
}

/* One block: a whole send round. */
static __device__ void gsc_prep_send_block(const gsc_prep_args_t *a)
{
    __shared__ unsigned long long e;
    __shared__ int ok;
    /* LL: load our first word before waiting for the receiver (the loads overlap the wait). */
    unsigned first = a->ll ? gsc_ll_data(a->src, a->len, threadIdx.x) : 0;
    if (threadIdx.x == 0) {
        if (a->ll) {
            /* LL rounds alternate between two slots: the receiver must have consumed round
             * e - 2 (gsc_ll_send_begin); otherwise it must be ready for this one. */
            e = gsc_ll_send_begin(a->ctl, a->timeout_ns);
            ok = e != 0;
        } else {
            e = *(volatile unsigned long long *)a->ctl + 1;
            ok = gsc_spin_geq(a->ctl + GSC_CTL_PEER, e, a->timeout_ns);
            if (!ok) a->ctl[GSC_CTL_ERROR] = e;
        }
    }
    __syncthreads();
    if (!ok) return;
    if (a->ll) {
        /* Small staged rounds: LL words carry their own flags; no release, no arrival word. */
        gsc_ll_write((unsigned long long *)a->dst + gsc_ll_slot(e, a->ll), a->src, a->len, e, first);
        return;
    }
    gsc_copy_lanes(a->dst, a->src, a->len, threadIdx.x, blockDim.x);
    __syncthreads();
    /* Release is cumulative: the block's stores (ordered by the barrier) reach the peer first. */
    if (threadIdx.x == 0) {
        a->ctl[0] = e;
        gsc_store_release(a->remote, e);
    }
}

/* One block: begin a partitioned send round (gsc_pready in the user's kernels sends the parts). */
static __device__ void gsc_prep_begin(const gsc_prep_args_t *a)
{
    if (threadIdx.x == 0) a->ctl[0] = *(volatile unsigned long long *)a->ctl + 1;
}

/* One round; a send may take several blocks (the last one to finish raises the flag). */
extern "C" __global__ void gsc_prep_kernel(gsc_prep_args_t a)
{
    gsc_after_previous_kernel();
    if (a.role == 4) gsc_prep_begin(&a);
    if (a.role == 1 || a.role == 3) gsc_prep_ready(&a);
    if (a.role == 2 || a.role == 3) gsc_prep_wait(&a);
    if (a.role != 0) return;
    if (gridDim.x == 1) {
        gsc_prep_send_block(&a);
        return;
    }
    __shared__ unsigned long long e;
    __shared__ int ok;
    if (threadIdx.x == 0) {
        /* Every block reads the same round number: the last block writes it back. */
        e = *(volatile unsigned long long *)a.ctl + 1;
        ok = gsc_spin_geq(a.ctl + GSC_CTL_PEER, e, a.timeout_ns);
        if (!ok) atomicMax(a.ctl + GSC_CTL_ERROR, e);
    }
    __syncthreads();
    if (ok)
        gsc_copy_lanes(a.dst, a.src, a.len, blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x,
                       (unsigned long long)gridDim.x * blockDim.x);
    __syncthreads();
    if (threadIdx.x == 0) {
        /* Every block counts, failed or not, so the count is whole for the next round; our
         * block's stores reach the peer before the count; the last block raises the flag,
         * unless a block gave up (the round is then recorded as failed, not announced). */
        __threadfence_system();
        unsigned long long done = atomicAdd(a.ctl + GSC_CTL_DONE, 1ULL) + 1;
        if (done == gridDim.x) {
            a.ctl[GSC_CTL_DONE] = 0;
            a.ctl[0] = e;
            __threadfence_system();
            if (*(volatile unsigned long long *)(a.ctl + GSC_CTL_ERROR) != e) gsc_store_release(a.remote, e);
        }
    }
}

/* The rounds of a condition group, in one block and one launch: ready, send and wait steps in
 * the order given (readies first, so two sides that both send never wait for each other). */
extern "C" __global__ void gsc_prep_group_kernel(gsc_prep_group_t g)
{
    gsc_after_previous_kernel();
    for (unsigned k = 0; k < g.n; k++) {
        const gsc_prep_args_t *a = &g.op[k];
        if (a->role == 0) gsc_prep_send_block(a);
        if (a->role == 4) gsc_prep_begin(a);
        if (a->role == 1 || a->role == 3) gsc_prep_ready(a);
        if (a->role == 2 || a->role == 3) gsc_prep_wait(a);
        __syncthreads();
    }
}
"#;
/// Most operations one kernel takes (`GSC_GROUP_MAX` above); more are split over launches.
pub(crate) const GROUP_MAX: usize = 8;
/// Threads of gscomm's kernels: enough to copy a staged message in a few turns, and a warp per
/// operation a kernel waits for (the receive heads).
pub(crate) const THREADS: u32 = 256;
const _: () = assert!(THREADS as usize / 32 >= GROUP_MAX, "a warp per waited operation");

/// One operation as the kernels see it (`gsc_op_t`).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct OpDesc {
    /// Device address of the `gsc_device_handle_t` (persistent operations), else 0.
    pub(crate) handle: u64,
    /// Device address of the staging slot, or 0 (not staged).
    pub(crate) slot: u64,
    /// The user's GPU buffer and its length (staged operations).
    pub(crate) buf: u64,
    pub(crate) len: u64,
    /// Written to the slot's stamp line when the kernel is done with it.
    pub(crate) stamp: u64,
}

/// `gsc_ops_t`: up to `GROUP_MAX` operations.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub(crate) struct OpList {
    pub(crate) n: u64,
    pub(crate) op: [OpDesc; GROUP_MAX],
}

impl OpList {
    pub(crate) fn of(ops: &[OpDesc]) -> OpList {
        assert!(ops.len() <= GROUP_MAX, "callers split lists into chunks of GROUP_MAX");
        let mut l = OpList { n: ops.len() as u64, ..Default::default() };
        l.op[..ops.len()].copy_from_slice(ops);
        l
    }
}

/// `gsc_ops_args_t`: the argument of `gsc_ops_kernel`.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub(crate) struct OpsArgs {
    pub(crate) trig: OpList,
    pub(crate) wait: OpList,
    /// Nonzero: fence at system scope before the triggers (see `gsc_ops_args_t`).
    pub(crate) fence: u64,
}

/// `gsc_sync_args_t`: the argument of `gsc_sync_kernel` (0 for a word: not that step).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub(crate) struct SyncArgs {
    pub(crate) trigger: u64,
    pub(crate) tval: u64,
    pub(crate) done: u64,
    pub(crate) wval: u64,
    pub(crate) fence: u64,
}

/// `gsc_seq_args_t`: the argument of `gsc_seq_kernel`.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub(crate) struct SeqArgs {
    pub(crate) trigger: u64,
    pub(crate) tval: u64,
    pub(crate) done: u64,
    pub(crate) wval: u64,
    /// Nonzero: fence at system scope before the trigger (see `gsc_ops_args_t`).
    pub(crate) fence: u64,
    pub(crate) out: OpList,
    pub(crate) inn: OpList,
}

/// `gsc_prep_args_t`: the argument of `gsc_prep_kernel`.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub(crate) struct PrepArgs {
    pub(crate) ctl: u64,
    pub(crate) remote: u64,
    pub(crate) src: u64,
    pub(crate) dst: u64,
    pub(crate) len: u64,
    pub(crate) role: u64,
    pub(crate) timeout_ns: u64,
    /// Receive rounds whose data the sender writes into a staging area: it, and the user's
    /// buffer the wait copies it into (0: none).
    pub(crate) stage: u64,
    pub(crate) buf: u64,
    /// Arrival words a receive waits for (the sender's partitions; 1 when not partitioned).
    pub(crate) parts: u64,
    /// A small staged round whose data travels as LL words (gsc_device.cuh): the words of one
    /// of the receiver's two LL slots (`prep_ctl::ll_slot_words`); 0: not LL.
    pub(crate) ll: u64,
}

/// `gsc_prep_group_t`: the argument of `gsc_prep_group_kernel`.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub(crate) struct PrepGroup {
    pub(crate) n: u64,
    pub(crate) op: [PrepArgs; PREP_GROUP_MAX],
}

pub(crate) const PREP_GROUP_MAX: usize = 8;

/// `PrepArgs::role`
pub(crate) const PREP_SEND: u64 = 0;
pub(crate) const PREP_READY: u64 = 1;
pub(crate) const PREP_WAIT: u64 = 2;
pub(crate) const PREP_READY_WAIT: u64 = 3;
pub(crate) const PREP_BEGIN: u64 = 4;

/// The kernels of one context.
#[derive(Copy, Clone)]
pub(crate) struct Kernels {
    /// Their context (`replay` instantiates graphs of them there).
    pub(crate) ctx: usize,
    /// `gsc_ops_kernel(OpsArgs)`: trigger and/or wait for persistent operations.
    pub(crate) ops: cu::CUfunction,
    /// `gsc_seq_kernel(SeqArgs)`: a stream's trigger and wait with staged copies around them.
    pub(crate) seq: cu::CUfunction,
    /// `gsc_sync_kernel(SyncArgs)`: a stream's trigger and wait, nothing staged.
    pub(crate) sync: cu::CUfunction,
    /// `gsc_prep_kernel(PrepArgs)`: a prepared transfer's round on the GPU.
    pub(crate) prep: cu::CUfunction,
    /// `gsc_prep_group_kernel(PrepGroup)`: a group's rounds in one launch.
    pub(crate) prep_group: cu::CUfunction,
    /// The stream conditions' kernels launch with programmatic dependent launch: `GSC_CUDA_PDL`
    /// allows it and the GPU has it (compute capability 9.0 on).
    pub(crate) stream_pdl: bool,
}

// SAFETY: CUfunction handles are plain driver handles, valid from any thread while their module
// is loaded; modules are never unloaded.
unsafe impl Send for Kernels {}
// SAFETY: as above.
unsafe impl Sync for Kernels {}

impl Kernels {
    /// The kernels for context `ctx`, compiling or loading them the first time.
    pub(crate) fn of(ctx: cu::CUcontext, cache_dir: Option<&Path>) -> Result<Kernels> {
        static LOADED: OnceLock<Mutex<HashMap<usize, Kernels>>> = OnceLock::new();
        let mut loaded = LOADED.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = loaded.get(&(ctx as usize)) {
            return Ok(*k);
        }
        let arch = context_arch(ctx)?;
        let source = format!("{DEVICE_HEADER}\n#define GSC_LL_MAX {}\n{KERNELS}", super::stage::LL_MAX);
        let cubin = compile_cached(&source, arch, cache_dir)?;
        let _scope = CtxScope::enter(ctx)?;
        let module = load_module(&cubin)?;
        let k = Kernels {
            ctx: ctx as usize,
            ops: function(module, "gsc_ops_kernel")?,
            seq: function(module, "gsc_seq_kernel")?,
            sync: function(module, "gsc_sync_kernel")?,
            prep: function(module, "gsc_prep_kernel")?,
            prep_group: function(module, "gsc_prep_group_kernel")?,
            stream_pdl: super::pdl_enabled() && arch.0 >= 9,
        };
        loaded.insert(ctx as usize, k);
        Ok(k)
    }
}

/// Load a cubin into the current context.
/// Load a module and every kernel in it now. With CUDA's lazy loading (the default on Linux
/// since 12.2) a kernel is loaded by its first `cuModuleGetFunction`, and a load may have to
/// wait for work already on the device (the programming guide's lazy-loading hazards). A
/// collective that posted its point-to-point steps (the stream now waits for the proxy) and
/// then looked up its reduction kernel for the first time deadlocked that way on the device:
/// the load waited behind the stream, the proxy's staging copies behind the load (issue #7,
/// session 16). So modules load every kernel up front, when they are loaded.
pub(crate) fn load_module(cubin: &[u8]) -> Result<cu::CUmodule> {
    let mut module: cu::CUmodule = std::ptr::null_mut();
    // SAFETY: `cubin` is a complete cubin image, read by the driver during the call.
    check(unsafe { cu::cuModuleLoadData(&mut module, cubin.as_ptr() as *const _) }, "cuModuleLoadData")?;
    load_every_function(module)?;
    Ok(module)
}

/// `cuFuncLoad` on every function of `module` (drivers of CUDA 12.4 and later; older ones load
/// eagerly unless told otherwise, and lack these calls: then nothing is done).
fn load_every_function(module: cu::CUmodule) -> Result<()> {
    const NEEDED: [&str; 3] = ["cuModuleGetFunctionCount", "cuModuleEnumerateFunctions", "cuFuncLoad"];
    // SAFETY: the driver library is loaded (a module was just loaded through it); `get` only
    // looks symbols up, and cudarc panics on a call to a missing one, hence the check.
    let lib = unsafe { cu::culib() };
    if NEEDED.iter().any(|n| unsafe { lib.get::<*const ()>(n.as_bytes()) }.is_err()) {
        tracing::debug!(target: "gsc::cuda", "driver without cuFuncLoad: kernels load when first looked up");
        return Ok(());
    }
    let mut count: std::ffi::c_uint = 0;
    // SAFETY: a loaded module and a valid out-pointer.
    check(unsafe { cu::cuModuleGetFunctionCount(&mut count, module) }, "cuModuleGetFunctionCount")?;
    let mut functions: Vec<cu::CUfunction> = vec![std::ptr::null_mut(); count as usize];
    // SAFETY: room for `count` handles.
    check(unsafe { cu::cuModuleEnumerateFunctions(functions.as_mut_ptr(), count, module) }, "cuModuleEnumerateFunctions")?;
    for f in functions {
        // SAFETY: a function of the loaded module.
        check(unsafe { cu::cuFuncLoad(f) }, "cuFuncLoad")?;
    }
    Ok(())
}

pub(crate) fn function(module: cu::CUmodule, name: &str) -> Result<cu::CUfunction> {
    let cname = CString::new(name).expect("no NUL in kernel names");
    let mut f: cu::CUfunction = std::ptr::null_mut();
    // SAFETY: a loaded module and a NUL-terminated name.
    check(unsafe { cu::cuModuleGetFunction(&mut f, module, cname.as_ptr()) }, "cuModuleGetFunction")?;
    Ok(f)
}

/// The cubin of `source` for `arch`, from the disk cache (`kernel_cache`) or freshly compiled;
/// while another process compiles the same source, waits for its cubin.
pub(crate) fn compile_cached(source: &str, arch: (i32, i32), cache_dir: Option<&Path>) -> Result<Vec<u8>> {
    let options = options(arch);
    Entry::new(source, &options, arch, cache_dir).get(|| compile(source, &options))
}

/// `compile_cached`, but `None` at once while another process compiles the same source (the
/// caller builds something else meanwhile, then asks `compile_cached`).
pub(crate) fn try_compile_cached(source: &str, arch: (i32, i32), cache_dir: Option<&Path>) -> Result<Option<Vec<u8>>> {
    let options = options(arch);
    Ok(match Entry::new(source, &options, arch, cache_dir).try_get(|| compile(source, &options))? {
        Found::Cubin(c) => Some(c),
        Found::Busy => None,
    })
}

fn nvrtc_check(r: nvrtc::nvrtcResult, what: &str) -> Result<()> {
    if r == nvrtc::nvrtcResult::NVRTC_SUCCESS { Ok(()) } else { Err(Error::new(Status::DeviceError, format!("{what} failed: {r:?}"))) }
}

fn options(arch: (i32, i32)) -> [String; 3] {
    [format!("--gpu-architecture=sm_{}{}", arch.0, arch.1), "-std=c++17".to_string(), "-default-device".to_string()]
}

/// `source` compiled for `arch` without the cache: for tests that check the kernels compile on
/// a machine without a GPU (NVRTC needs none).
#[cfg(test)]
pub(crate) fn compile_uncached(source: &str, arch: (i32, i32)) -> Result<Vec<u8>> {
    compile(source, &options(arch))
}

/// Test helper: `Ok(false)` (with the reason printed) when this machine has no NVRTC to
/// compile with; the kernels' compile tests then skip.
#[cfg(test)]
pub(crate) fn nvrtc_present_or_say_why() -> bool {
    // SAFETY: probing for the library has no preconditions.
    let present = unsafe { nvrtc::is_culib_present() };
    if !present {
        eprintln!(
            "skipped: NVRTC (libnvrtc.so) not found; install it (pip install nvidia-cuda-nvrtc-cu12, then put its lib directory on LD_LIBRARY_PATH) to compile the kernels here"
        );
    }
    present
}

fn compile(source: &str, options: &[String]) -> Result<Vec<u8>> {
    // SAFETY: probing for the library has no preconditions.
    if !unsafe { nvrtc::is_culib_present() } {
        return Err(Error::new(Status::LibraryMissing, "NVRTC (libnvrtc.so) cannot be loaded; it compiles gscomm's kernels"));
    }
    let src = CString::new(source).map_err(|_| Error::invalid_param("kernel source contains NUL"))?;
    let name = CString::new("gscomm.cu").expect("no NUL");
    let mut prog: nvrtc::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: NUL-terminated strings that outlive the call; no headers.
    nvrtc_check(
        unsafe { nvrtc::nvrtcCreateProgram(&mut prog, src.as_ptr(), name.as_ptr(), 0, std::ptr::null(), std::ptr::null()) },
        "nvrtcCreateProgram",
    )?;
    let opts: Vec<CString> = options.iter().map(|o| CString::new(o.as_str()).expect("no NUL")).collect();
    let ptrs: Vec<*const std::ffi::c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: `prog` was created above; `ptrs` points at live NUL-terminated options.
    let compiled = unsafe { nvrtc::nvrtcCompileProgram(prog, ptrs.len() as i32, ptrs.as_ptr()) };
    let result = if compiled == nvrtc::nvrtcResult::NVRTC_SUCCESS {
        let mut size = 0usize;
        // SAFETY: a compiled program and valid out-pointers; `cubin` has `size` bytes.
        nvrtc_check(unsafe { nvrtc::nvrtcGetCUBINSize(prog, &mut size) }, "nvrtcGetCUBINSize").and_then(|_| {
            let mut cubin = vec![0u8; size];
            nvrtc_check(unsafe { nvrtc::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut _) }, "nvrtcGetCUBIN").map(|_| cubin)
        })
    } else {
        let mut size = 0usize;
        // SAFETY: as above, for the log.
        unsafe { nvrtc::nvrtcGetProgramLogSize(prog, &mut size) };
        let mut log = vec![0u8; size.max(1)];
        unsafe { nvrtc::nvrtcGetProgramLog(prog, log.as_mut_ptr() as *mut _) };
        let text = CStr::from_bytes_until_nul(&log).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
        Err(Error::new(Status::DeviceError, format!("NVRTC could not compile gscomm's kernels: {compiled:?}\n{text}")))
    };
    // SAFETY: destroys the program created above, once.
    unsafe { nvrtc::nvrtcDestroyProgram(&mut prog) };
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The point-to-point kernels compile for the device machines' GPUs (sm_90) wherever
    /// NVRTC is, GPU or not: a source error shows in CI, not first on a device run.
    #[test]
    fn the_point_to_point_kernels_compile_for_sm90() {
        if !nvrtc_present_or_say_why() {
            return;
        }
        let source = format!("{DEVICE_HEADER}\n#define GSC_LL_MAX {}\n{KERNELS}", super::super::stage::LL_MAX);
        let cubin = compile_uncached(&source, (9, 0)).unwrap_or_else(|e| panic!("{e}"));
        assert!(cubin.starts_with(b"\x7fELF"));
    }
}
