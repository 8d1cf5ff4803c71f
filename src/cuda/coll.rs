//! The GPU side of collectives: each rank's workspace (GPU memory every peer maps and writes
//! over NVLink), the one-shot LL kernel that moves and reduces small collectives and the phased
//! large kernel (the pipelined one is `coll_pipelined`, compiled with this source).
//!
//! **Workspace.** One allocation per communicator and rank, of its own (a peer opens it once;
//! see `prep_ctl` for why allocations are not shared), zeroed, exported through CUDA IPC:
//! `CTL_BYTES` of control words (round counter, blocks finished, error), then two parities of
//! one slot per rank, each `SLOT_BYTES` of LL words. Rank r writes its contribution to round e
//! into slot r of parity e % 2 of every peer that needs it, as NCCL's LL words (4 data bytes
//! and the round's flag per 8-byte store), and reads its own slots: no barrier, no fence and no
//! separate flag.
//!
//! **Why two parities suffice without a readiness handshake.** Rank r writes round e into q's
//! parity e % 2 only after its kernel of round e - 1 ended, which needed q's round e - 1 data
//! (or, for a rooted collective, q's presence word of round e - 1), which q wrote only after
//! its kernel of round e - 2 had ended — that kernel's reads of the slot included. Rooted
//! collectives (broadcast, reduce) move data one way only, so every rank also writes a presence
//! word to every peer each launch and waits for everyone's before its kernel ends; inside a
//! launch of several rounds their readers acknowledge each round to the writers, warp by warp
//! (`gsc_rooted_ack` in the source).
//!
//! The round counter lives in the workspace and is advanced by the kernel (the last block to
//! finish), so collectives captured into a CUDA graph replay any number of times. A spin that
//! outlasts the timeout records the round in the error word and gives up: a dead peer never
//! hangs the GPU (`Workspace::error`). The word stays set, and every later launch that finds it
//! set moves nothing, tells its peers (their error words) and fails at once, so a failure costs
//! one timeout rather than one per later call (`gsc_coll_out_of_step` in the source).

use super::coll_modules::{self, MACROS, Module, TYPES, module_of};
use super::copy::primary_context;
use super::kernels::{function, load_module};
use super::replay::{self, ArgBlock};
use super::{CtxScope, Grid, check, context_arch, cu, ipc};
use crate::error::{Error, Result, Status};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Mutex, OnceLock};

/// Ranks one communicator's kernels address directly (one host's GPUs).
pub(crate) const MAX_RANKS: usize = 8;
/// Payload bytes of one slot: what one rank contributes to one round. Larger collectives take
/// several rounds in one launch.
pub(crate) const SLOT_PAYLOAD: usize = 64 << 10;
/// A slot holds its payload as LL words: twice the bytes.
const SLOT_BYTES: usize = 2 * SLOT_PAYLOAD;
/// Control words (byte 0: round, 8: blocks finished, 16: error), presence words from byte 1024
/// (one line per rank: the last round it began), slots from here (GSC_SLOTS_WORDS in the source).
const CTL_BYTES: usize = 4096;
/// The acknowledgement words of rooted collectives of several rounds (one per reader and warp
/// of the one-shot kernel: `GSC_ACK_WARPS` in the source), after the slots of the largest
/// communicator.
const ACK_OFFSET: usize = CTL_BYTES + 2 * MAX_RANKS * SLOT_BYTES;
/// Blocks of the one-shot kernel's largest grid (`one_shot_grid`).
const ONE_SHOT_BLOCKS_MAX: u64 = 32;
/// Warps of that grid: what the acknowledgement words have room for (`GSC_ACK_WARPS`).
const ACK_WARPS: usize = 256;
const _: () = assert!(ONE_SHOT_BLOCKS_MAX as usize * THREADS as usize / 32 <= ACK_WARPS);
/// The phased large kernel's flags (per block, "in" and "out", one word per rank).
const FLAGS_OFFSET: usize = 3 << 20;
/// The pipelined large kernel's flags (per block, "in", "out" and "ready", one word per rank,
/// 32 words: `coll_pipelined`).
const PIPE_FLAGS_OFFSET: usize = FLAGS_OFFSET + (512 << 10);
/// Blocks a large kernel may have (`GSC_COLL_LARGE_BLOCKS`): what the flags have room for.
pub(crate) const BIG_BLOCKS_MAX: usize = 1024;
/// The copy-engine ring's flags (`coll_ring`): one word per (phase, step, piece), then as many
/// words counting a reduction's finished blocks.
const RING_FLAGS_OFFSET: usize = PIPE_FLAGS_OFFSET + BIG_BLOCKS_MAX * 32 * 8;
/// Pieces a ring step may be cut into (`GSC_COLL_RING_PIECES`): what the flags have room for.
pub(crate) const RING_PIECES_MAX: usize = 16;
/// Flag words of the ring: two phases (reduce-scatter, all-gather) of up to MAX_RANKS - 1 steps.
const RING_FLAG_WORDS: usize = 2 * MAX_RANKS * RING_PIECES_MAX;
const _: () = assert!(
    ACK_OFFSET + MAX_RANKS * ACK_WARPS * 8 <= FLAGS_OFFSET
        && FLAGS_OFFSET + BIG_BLOCKS_MAX * 2 * MAX_RANKS * 8 <= PIPE_FLAGS_OFFSET
        && PIPE_FLAGS_OFFSET + BIG_BLOCKS_MAX * 32 * 8 <= RING_FLAGS_OFFSET
        && RING_FLAGS_OFFSET + 2 * RING_FLAG_WORDS * 8 <= BIG_OFFSET
);
/// The large kernels' in and out areas: four of `big_round_max()` bytes (phased: two parities
/// of each; pipelined: cut into stages).
const BIG_OFFSET: usize = 4 << 20;
/// `GSC_COLL_LARGE_ROUND`, read once per process (every communicator's workspace and kernels
/// share the layout).
pub(crate) fn big_round_max() -> usize {
    static ROUND: OnceLock<usize> = OnceLock::new();
    *ROUND.get_or_init(|| crate::config::Config::load_env().map_or(8 << 20, |l| l.config.coll_large_round))
}
/// Where the send/recv area begins in a workspace (`coll_p2p`): after the large kernels' areas.
fn p2p_area() -> usize {
    BIG_OFFSET + 4 * big_round_max()
}
/// Bytes of a workspace of a communicator of `nranks`.
fn workspace_bytes(nranks: usize) -> usize {
    p2p_area() + super::coll_p2p::p2p_area_bytes(nranks)
}
/// Threads per block of the collective kernel.
const THREADS: u32 = super::THREADS;

/// What a collective kernel does with the slots (`kind` of `CollArgs`; the same numbers are in
/// the kernel source).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum CollKind {
    AllReduce = 0,
    AllGather = 1,
    ReduceScatter = 2,
    Broadcast = 3,
    Reduce = 4,
}

impl CollKind {
    /// The collective's name in messages.
    pub(crate) fn name(self) -> &'static str {
        match self {
            CollKind::AllReduce => "all-reduce",
            CollKind::AllGather => "all-gather",
            CollKind::ReduceScatter => "reduce-scatter",
            CollKind::Broadcast => "broadcast",
            CollKind::Reduce => "reduce",
        }
    }

    /// Whether the collective computes on its elements (all-gather and broadcast copy them).
    pub(crate) fn reduces(self) -> bool {
        matches!(self, CollKind::AllReduce | CollKind::ReduceScatter | CollKind::Reduce)
    }
}

const SOURCE: &str = r#"
#define GSC_COLL_MAX_RANKS 8
#define GSC_PRESENCE_WORDS 128 /* word offset of the presence words in a workspace (a line per rank) */
#define GSC_SLOTS_WORDS 512    /* word offset of the slots */
#define GSC_ACK_WARPS 256      /* warps of the one-shot kernel's largest grid (ACK_WARPS) */
typedef struct {
    unsigned long long ctl;      /* this rank's workspace (control words, presence, slots) */
    unsigned long long peer[GSC_COLL_MAX_RANKS]; /* every rank's workspace, mapped (ours too) */
    unsigned long long send, recv;
    unsigned long long bytes;    /* payload bytes per part in this launch */
    unsigned long long chunk;    /* payload bytes per part and round (at most a slot's) */
    unsigned long long rounds;   /* rounds in this launch: bytes / chunk, rounded up */
    unsigned long long send_stride; /* reduce-scatter: bytes between the parts for each rank */
    unsigned long long recv_stride; /* all-gather: bytes between the ranks' parts */
    unsigned long long slot_words;
    unsigned long long nranks, rank, root, kind, timeout_ns;
    unsigned long long abort;    /* this rank's abort word (page-locked host memory): non-zero = give up */
    unsigned long long premul_bits; /* pre-multiplied sum: this rank's scalar (an element's bits) */
    unsigned long long premul_ptr;  /* ... or its address in GPU memory, read when the kernel runs (0: use the bits) */
    /* The pipelined large kernel only (gsc_coll_pipe_*): */
    unsigned long long stages;      /* rounds in flight: the "in" and "out" areas are cut in this many stages */
    unsigned long long stage_bytes; /* bytes of one stage of one area */
    unsigned long long push_threads, reduce_threads; /* the block's first threads push, the next reduce, the rest copy out */
} gsc_coll_args_t;

enum { GSC_ALL_REDUCE = 0, GSC_ALL_GATHER = 1, GSC_REDUCE_SCATTER = 2, GSC_BROADCAST = 3, GSC_REDUCE = 4 };

/* Communicator::abort sets the abort word; a kernel looks at it every GSC_ABORT_LOOK_NS while it
 * waits for a peer (a read across PCIe: not on every poll, and never on a path that does not wait,
 * so a collective whose peers are there costs nothing more). A kernel that starts after the
 * abort (a queued launch, a graph replayed later) runs normally if its peers take part, and
 * gives up at its first wait otherwise. */
static __device__ __forceinline__ bool gsc_coll_aborted(const gsc_coll_args_t *a)
{
    return *(volatile const unsigned long long *)a->abort != 0;
}

/* Wait for *w >= v: 1, or 0 when the timeout passed or the communicator was aborted. */
static __device__ __forceinline__ int gsc_coll_spin(const gsc_coll_args_t *a, unsigned long long *w, unsigned long long v, bool acquire)
{
    return gsc_spin_geq_or_stop(w, v, a->timeout_ns, acquire, (const volatile unsigned long long *)a->abort, 0);
}

/* The error word (control word 2) is set: a round of this communicator failed here, or a peer
 * said one failed there. The ranks are then out of step for good: no later result is good and
 * the host reports the failure (Communicator::async_error); the communicator is to be
 * destroyed. */
static __device__ __forceinline__ bool gsc_coll_failed(const gsc_coll_args_t *a)
{
    return ((volatile const unsigned long long *)a->ctl)[2] != 0;
}

/* gsc_coll_spin for the workspace kernels (one-shot, phased and pipelined), which also stop
 * waiting once the error word is set (looked at with the abort word): a peer that found the
 * communicator failed writes it (gsc_coll_out_of_step) and will never raise what we wait for.
 * These kernels only write peers' workspaces and read their own, so one that stops early
 * leaves no peer reading our buffers; what peers still write into our workspace is never read,
 * since every later launch finds the error word set. (Kernels that touch peers' buffers — the
 * copy-engine barrier, the direct kernel — wait their whole timeout instead.) */
static __device__ __forceinline__ int gsc_coll_spin_in_step(const gsc_coll_args_t *a, unsigned long long *w, unsigned long long v, bool acquire)
{
    return gsc_spin_geq_or_stop(w, v, a->timeout_ns, acquire, (const volatile unsigned long long *)a->abort,
                                (const volatile unsigned long long *)a->ctl + 2);
}

/* 16-bit floats as their bits; arithmetic in float, rounded back after every operation. */
struct gsc_f16 { unsigned short v; };
struct gsc_bf16 { unsigned short v; };
static __device__ __forceinline__ float gsc_to_f(gsc_f16 x) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.v)); return f; }
static __device__ __forceinline__ float gsc_to_f(gsc_bf16 x) { return __uint_as_float((unsigned)x.v << 16); }
static __device__ __forceinline__ gsc_f16 gsc_from_f(float f, gsc_f16) { gsc_f16 x; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(x.v) : "f"(f)); return x; }
static __device__ __forceinline__ gsc_bf16 gsc_from_f(float f, gsc_bf16) { gsc_bf16 x; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(x.v) : "f"(f)); return x; }

/* The fp8 types as their bits, stepped as NCCL does (collectives/fp8.rs): widened exactly, the
 * operation in float (exact for two fp8 operands), rounded to half, then to fp8 to nearest
 * even, saturating. The conversions are sm_89's; below it the host refuses fp8 arithmetic (as
 * NCCL does below sm_90) and these are never reached, while the copies of fp8 data, which need
 * no arithmetic, still compile and run. */
struct gsc_e4m3 { unsigned char v; };
struct gsc_e5m2 { unsigned char v; };
#if __CUDA_ARCH__ >= 890
#define GSC_FP8_TO_F(T, KIND) \
    static __device__ __forceinline__ float gsc_to_f(T x) \
    { \
        unsigned h2; \
        asm("cvt.rn.f16x2." KIND "x2 %0, %1;" : "=r"(h2) : "h"((unsigned short)x.v)); \
        return gsc_to_f(gsc_f16{(unsigned short)(h2 & 0xffff)}); \
    } \
    static __device__ __forceinline__ T gsc_from_f(float f, T) \
    { \
        const gsc_f16 h = gsc_from_f(f, gsc_f16{}); \
        unsigned short b2; \
        asm("cvt.rn.satfinite." KIND "x2.f16x2 %0, %1;" : "=h"(b2) : "r"((unsigned)h.v)); \
        return T{(unsigned char)(b2 & 0xff)}; \
    }
#else
#define GSC_FP8_TO_F(T, KIND) \
    static __device__ __forceinline__ float gsc_to_f(T) { __trap(); return 0.0f; } \
    static __device__ __forceinline__ T gsc_from_f(float, T) { __trap(); return T{0}; }
#endif
GSC_FP8_TO_F(gsc_e4m3, "e4m3")
GSC_FP8_TO_F(gsc_e5m2, "e5m2")

/* op: 0 sum (and avg before its division), 1 prod, 2 max, 3 min, 4 sum (of pre-multiplied
 * inputs: gsc_premul_unit). Max and min keep the
 * accumulator unless the new value is strictly greater (smaller). */
template <int OP, typename T> static __device__ __forceinline__ T gsc_apply(T a, T b)
{
    if (OP == 1) return a * b;
    if (OP == 2) return b > a ? b : a;
    if (OP == 3) return b < a ? b : a;
    return a + b;
}
template <int OP> static __device__ __forceinline__ gsc_f16 gsc_apply(gsc_f16 a, gsc_f16 b) { return gsc_from_f(gsc_apply<OP>(gsc_to_f(a), gsc_to_f(b)), a); }
template <int OP> static __device__ __forceinline__ gsc_bf16 gsc_apply(gsc_bf16 a, gsc_bf16 b) { return gsc_from_f(gsc_apply<OP>(gsc_to_f(a), gsc_to_f(b)), a); }
template <int OP> static __device__ __forceinline__ gsc_e4m3 gsc_apply(gsc_e4m3 a, gsc_e4m3 b) { return gsc_from_f(gsc_apply<OP>(gsc_to_f(a), gsc_to_f(b)), a); }
template <int OP> static __device__ __forceinline__ gsc_e5m2 gsc_apply(gsc_e5m2 a, gsc_e5m2 b) { return gsc_from_f(gsc_apply<OP>(gsc_to_f(a), gsc_to_f(b)), a); }
template <typename T> static __device__ __forceinline__ T gsc_div(T a, unsigned long long n) { return a / (T)n; }
template <> __device__ __forceinline__ gsc_f16 gsc_div(gsc_f16 a, unsigned long long n) { return gsc_from_f(gsc_to_f(a) / (float)n, a); }
template <> __device__ __forceinline__ gsc_bf16 gsc_div(gsc_bf16 a, unsigned long long n) { return gsc_from_f(gsc_to_f(a) / (float)n, a); }
/* Never used by the host (an fp8 average is a pre-multiplied sum, as in NCCL); here so that the
 * average kernels of every type exist. */
template <> __device__ __forceinline__ gsc_e4m3 gsc_div(gsc_e4m3 a, unsigned long long n) { return gsc_from_f(gsc_to_f(a) / (float)n, a); }
template <> __device__ __forceinline__ gsc_e5m2 gsc_div(gsc_e5m2 a, unsigned long long n) { return gsc_from_f(gsc_to_f(a) / (float)n, a); }

/* 8 bytes = one unit = two LL words; a unit holds whole elements of any type. */
template <typename T> union gsc_unit { unsigned long long u; T v[8 / sizeof(T)]; };

/* OP 4, the pre-multiplied sum: each rank multiplies its own input by its scalar (a product
 * step, so 16-bit floats round as every other step does) as it reads it; the reduction is the
 * sum. */
template <typename T> static __device__ __forceinline__ T gsc_premul_scalar(const gsc_coll_args_t *a)
{
    if (a->premul_ptr) return *(const T *)a->premul_ptr;
    union { unsigned long long u; T t; } b;
    b.u = a->premul_bits;
    return b.t;
}
template <typename T, int OP> static __device__ __forceinline__ unsigned long long gsc_premul_unit(unsigned long long u, const gsc_coll_args_t *a)
{
    if (OP != 4) return u;
    const T s = gsc_premul_scalar<T>(a);
    gsc_unit<T> x;
    x.u = u;
#pragma unroll
    for (int k = 0; k < 8 / sizeof(T); k++) x.v[k] = gsc_apply<1>(x.v[k], s);
    return x.u;
}

/* Up to 8 bytes of p (n of them; unaligned allowed), zero-padded. */
static __device__ __forceinline__ unsigned long long gsc_load8(const unsigned char *p, unsigned long long n)
{
    if (n == 8 && ((unsigned long long)p & 7) == 0) return *(const unsigned long long *)p;
    unsigned long long v = 0;
    for (unsigned k = 0; k < n; k++) v |= (unsigned long long)p[k] << (8 * k);
    return v;
}
static __device__ __forceinline__ void gsc_store8(unsigned char *p, unsigned long long v, unsigned long long n)
{
    if (n == 8 && ((unsigned long long)p & 7) == 0) { *(unsigned long long *)p = v; return; }
    for (unsigned k = 0; k < n; k++) p[k] = (unsigned char)(v >> (8 * k));
}

static __device__ __forceinline__ void gsc_put_unit(unsigned long long *w, unsigned long long v, unsigned long long flag)
{
    asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(w), "l"(flag | (v & 0xFFFFFFFFull)), "l"(flag | (v >> 32)) : "memory");
}

/* Wait for unit u of rank q's slot of this round in every rank of `mask` and return them in
 * v[q]; 0 on timeout. The loads of all ranks are in flight together. */
static __device__ int gsc_get_units(const gsc_coll_args_t *a, unsigned long long *slots, unsigned long long u, unsigned flag,
                                    unsigned mask, unsigned long long *v, unsigned long long t0)
{
    unsigned missing = mask;
    unsigned long long look = 0; /* when to look at the abort and error words next (GSC_ABORT_LOOK_NS); 0: not waiting yet */
    while (missing) {
        unsigned long long lo[GSC_COLL_MAX_RANKS], hi[GSC_COLL_MAX_RANKS];
#pragma unroll
        for (int q = 0; q < GSC_COLL_MAX_RANKS; q++)
            if (missing & (1u << q))
                asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];" : "=l"(lo[q]), "=l"(hi[q]) : "l"(slots + q * a->slot_words + 2 * u) : "memory");
#pragma unroll
        for (int q = 0; q < GSC_COLL_MAX_RANKS; q++)
            if ((missing & (1u << q)) && (unsigned)(lo[q] >> 32) == flag && (unsigned)(hi[q] >> 32) == flag) {
                v[q] = (lo[q] & 0xFFFFFFFFull) | (hi[q] << 32);
                missing &= ~(1u << q);
            }
        if (missing) {
            const unsigned long long now = gsc_globaltimer();
            if (now - t0 > a->timeout_ns) return 0;
            if (look == 0) {
                look = now + GSC_ABORT_LOOK_NS;
            } else if (now >= look) {
                if (gsc_coll_aborted(a) || gsc_coll_failed(a)) return 0;
                look = now + GSC_ABORT_LOOK_NS;
            }
        }
    }
    return 1;
}

/* Every collective kernel begins here: after the previous kernel on its stream (launched with
 * programmatic dependent launch under capture, it may be scheduled before that one ended), and
 * returns the first round of this launch. */
static __device__ __forceinline__ unsigned long long gsc_coll_begin(const gsc_coll_args_t *a)
{
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    return *(volatile unsigned long long *)a->ctl + 1;
}

/* ... and ends here: `last` is the launch's last round; ok == 0 records it as failed. The last
 * block to finish advances the round: every block has read it before it counts (its value is
 * in every flag the block wrote). No fence: nothing this kernel wrote needs ordering against
 * the count, the kernel boundary orders it all for the next round (a fence would wait for
 * every store still crossing NVLink). */
static __device__ void gsc_coll_end(const gsc_coll_args_t *a, unsigned long long last, int ok)
{
    unsigned long long *ctl = (unsigned long long *)a->ctl;
    /* The first failure stays: a later round's, or a peer's, never overwrites it. */
    if (!ok && !gsc_coll_failed(a)) ctl[2] = last;
    __syncthreads();
    if (threadIdx.x == 0) {
        if (gridDim.x == 1) {
            *(volatile unsigned long long *)ctl = last;
        } else if (atomicAdd(&ctl[1], 1ull) == gridDim.x - 1) {
            ctl[1] = 0;
            *(volatile unsigned long long *)ctl = last;
        }
    }
}

/* A launch of first round e found the communicator failed (gsc_coll_failed): tell every peer
 * (lanes 0..n-1 of one warp; their kernels stop waiting for us within GSC_ABORT_LOOK_NS). A
 * peer's error word is written only while it reads 0, so the first failure it recorded stays
 * (a remote read, on this path only). */
static __device__ __forceinline__ void gsc_coll_tell_peers(const gsc_coll_args_t *a, unsigned long long e)
{
    const unsigned q = threadIdx.x & 31;
    if (q < a->nranks && q != a->rank) {
        volatile unsigned long long *theirs = (volatile unsigned long long *)a->peer[q] + 2;
        if (*theirs == 0) *theirs = e;
    }
}

/* Whether this launch (of first round e) finds the communicator failed, the same answer to
 * every thread of the block. Then a workspace kernel moves nothing and waits for nobody: it
 * tells every peer (block 0) and ends its rounds as failed. So a failure costs one timeout,
 * not one per later call: before, every later launch waited its whole timeout for peers that
 * were in other rounds or gone (docs/ARCHITECTURE.md, "Failures of collectives"). */
static __device__ bool gsc_coll_out_of_step(const gsc_coll_args_t *a, unsigned long long e)
{
    __shared__ int failed_s;
    if (threadIdx.x == 0) failed_s = gsc_coll_failed(a);
    __syncthreads();
    const bool failed = failed_s != 0;
    if (failed && blockIdx.x == 0 && threadIdx.x < 32) gsc_coll_tell_peers(a, e);
    return failed;
}

/* The same for the one-shot kernel, without a block barrier (its latency is the small
 * collectives' cost; the load goes out beside gsc_coll_begin's): each warp decides by a vote,
 * so the answer is warp-uniform, as the kernel's warp-level acknowledgements need; warps of a
 * launch may differ (a peer's word arriving in between), and either way the launch fails. */
static __device__ __forceinline__ bool gsc_coll_out_of_step_warp(const gsc_coll_args_t *a, unsigned long long e)
{
    const bool failed = __any_sync(0xffffffffu, gsc_coll_failed(a));
    if (failed && blockIdx.x == 0 && threadIdx.x < 32) gsc_coll_tell_peers(a, e);
    return failed;
}

/* One round: this rank's units of `bytes` at offset `off` of every part into the slots of
 * round e, then its own slots read and reduced (or copied) into recv. 0 on timeout. */
template <typename T, int OP, bool AVG>
static __device__ int gsc_coll_round(const gsc_coll_args_t *a, unsigned long long e, unsigned long long off, unsigned long long bytes,
                                     unsigned long long tid, unsigned long long threads, unsigned long long t0)
{
    const unsigned flag32 = gsc_ll_flag(e);
    const unsigned long long flag = (unsigned long long)flag32 << 32, parity = e & 1;
    const unsigned long long n = a->nranks, me = a->rank, units = (bytes + 7) / 8;
    const unsigned char *send = (const unsigned char *)a->send + off;
    unsigned char *recv = (unsigned char *)a->recv + off;
    /* Where slot q of this round is, in rank p's workspace. */
    #define GSC_SLOT(p, q) ((unsigned long long *)a->peer[p] + GSC_SLOTS_WORDS + (parity * n + (q)) * a->slot_words)

    /* Write: this rank's units into slot `me` of the ranks that need them. */
    for (unsigned long long u = tid; u < units; u += threads) {
        unsigned long long len = bytes - u * 8 < 8 ? bytes - u * 8 : 8;
        if (a->kind == GSC_REDUCE_SCATTER) {
            for (unsigned long long p = 0; p < n; p++)
                gsc_put_unit(GSC_SLOT(p, me) + 2 * u, gsc_premul_unit<T, OP>(gsc_load8(send + p * a->send_stride + u * 8, len), a), flag);
        } else if (a->kind == GSC_REDUCE) {
            gsc_put_unit(GSC_SLOT(a->root, me) + 2 * u, gsc_premul_unit<T, OP>(gsc_load8(send + u * 8, len), a), flag);
        } else if (a->kind != GSC_BROADCAST || me == a->root) {
            unsigned long long v = gsc_premul_unit<T, OP>(gsc_load8(send + u * 8, len), a);
            for (unsigned long long p = 0; p < n; p++) gsc_put_unit(GSC_SLOT(p, me) + 2 * u, v, flag);
        }
    }

    /* Read: our own slots, in rank order (every rank reduces alike: the same bits everywhere). */
    unsigned long long *mine = GSC_SLOT(me, 0);
    unsigned all = (unsigned)((1ull << n) - 1);
    for (unsigned long long u = tid; u < units; u += threads) {
        unsigned long long len = bytes - u * 8 < 8 ? bytes - u * 8 : 8, v[GSC_COLL_MAX_RANKS];
        switch (a->kind) {
        case GSC_REDUCE:
            if (me != a->root) break;
            /* fall through */
        case GSC_ALL_REDUCE:
        case GSC_REDUCE_SCATTER: {
            if (!gsc_get_units(a, mine, u, flag32, all, v, t0)) return 0;
            gsc_unit<T> acc, x;
            acc.u = v[0];
            for (unsigned long long q = 1; q < n; q++) {
                x.u = v[q];
#pragma unroll
                for (int k = 0; k < 8 / sizeof(T); k++) acc.v[k] = gsc_apply<OP>(acc.v[k], x.v[k]);
            }
            if (AVG)
#pragma unroll
                for (int k = 0; k < 8 / sizeof(T); k++) acc.v[k] = gsc_div(acc.v[k], n);
            gsc_store8(recv + u * 8, acc.u, len);
            break;
        }
        case GSC_ALL_GATHER:
            if (!gsc_get_units(a, mine, u, flag32, all, v, t0)) return 0;
            for (unsigned long long q = 0; q < n; q++) gsc_store8(recv + q * a->recv_stride + u * 8, v[q], len);
            break;
        case GSC_BROADCAST:
            if (!gsc_get_units(a, mine, u, flag32, 1u << a->root, v, t0)) return 0;
            gsc_store8(recv + u * 8, v[a->root], len);
            break;
        }
    }
    #undef GSC_SLOT
    return 1;
}

/* Rooted collectives (broadcast, reduce) move data one way: a rank that only writes a peer's
 * slot never waits on that peer's data, so nothing in the exchange itself stops it lapping the
 * peer. Over several rounds in one launch the readers acknowledge instead: after warp w has
 * read its units of round e, it raises its acknowledgement word (one per reader and warp, in
 * the writer's workspace) to e, and the writer's warp w writes round e + 2 (the same parity)
 * only after every reader's warp w acknowledged round e. A warp keeps the same units in every
 * round and on every rank (the grid depends only on the sizes), so this covers unit by unit
 * what it must. The launch's second round overwrites the previous launch's last one, for
 * which there is no acknowledgement here: the writer waits for the readers' presence words of
 * this launch instead (a reader present has ended its previous kernel). The writer's last wait,
 * before its kernel ends, is for round e_last - 1: the next launch then finds every round
 * before its first but one read everywhere, as a launch of one round leaves it. */

/* The ranks that read this rank's slots (not itself) and those whose slots it reads. */
static __device__ __forceinline__ unsigned gsc_rooted_readers(const gsc_coll_args_t *a)
{
    const unsigned others = ((1u << a->nranks) - 1) & ~(1u << a->rank);
    if (a->kind == GSC_BROADCAST) return a->rank == a->root ? others : 0;
    return a->rank == a->root ? 0 : 1u << a->root;
}
static __device__ __forceinline__ unsigned gsc_rooted_writers(const gsc_coll_args_t *a)
{
    const unsigned others = ((1u << a->nranks) - 1) & ~(1u << a->rank);
    if (a->kind == GSC_BROADCAST) return a->rank == a->root ? 0 : 1u << a->root;
    return a->rank == a->root ? others : 0;
}

/* Warp `warp` waits until every reader's word (the presence word where `presence`, else its
 * acknowledgement of this warp) reached v. Warp-uniform result: 0 on timeout or abort. */
static __device__ int gsc_rooted_wait(const gsc_coll_args_t *a, unsigned long long warp, unsigned long long v, bool presence)
{
    int ok = 1;
    if ((threadIdx.x & 31) == 0) {
        unsigned long long *ctl = (unsigned long long *)a->ctl;
        for (unsigned readers = gsc_rooted_readers(a); ok && readers; readers &= readers - 1) {
            const unsigned q = __ffs(readers) - 1;
            ok = gsc_coll_spin_in_step(a, presence ? ctl + GSC_PRESENCE_WORDS + q * 8 : ctl + GSC_ACK_WORDS + q * GSC_ACK_WARPS + warp, v, true);
        }
    }
    return __shfl_sync(0xffffffffu, ok, 0);
}

/* Warp `warp` has read its units of round e: acknowledge it to every writer. */
static __device__ void gsc_rooted_ack(const gsc_coll_args_t *a, unsigned long long warp, unsigned long long e)
{
    __syncwarp();
    if ((threadIdx.x & 31) == 0)
        for (unsigned writers = gsc_rooted_writers(a); writers; writers &= writers - 1) {
            const unsigned q = __ffs(writers) - 1;
            unsigned long long *at = (unsigned long long *)a->peer[q] + GSC_ACK_WORDS + a->rank * GSC_ACK_WARPS + warp;
            asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(at), "l"(e) : "memory");
        }
}

/* `rounds` rounds of at most `chunk` bytes per part. Inside one launch no barrier separates
 * them: a thread handles the same units in every round and on every rank (the grid depends
 * only on the sizes), so the thread that writes unit u of round e + 2 into a peer's slot has
 * read that peer's unit u of round e + 1, which the peer's thread wrote only after it had read
 * unit u of round e there — the two-parity argument of the workspace, per unit. Rooted
 * collectives break that chain (data flows one way) and acknowledge rounds instead (above). */
template <typename T, int OP, bool AVG> static __device__ void gsc_coll_ll(const gsc_coll_args_t *a)
{
    const unsigned long long e0 = gsc_coll_begin(a), n = a->nranks, me = a->rank;
    unsigned long long *ctl = (unsigned long long *)a->ctl;
    const unsigned long long tid = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x, threads = gridDim.x * (unsigned long long)blockDim.x;
    const unsigned long long warp = tid / 32;
    const int rooted = a->kind == GSC_BROADCAST || a->kind == GSC_REDUCE;
    const int acked = rooted && a->rounds > 1;
    unsigned long long t0 = gsc_globaltimer();
    int ok = !gsc_coll_out_of_step_warp(a, e0);

    /* Presence (rooted collectives): one word to every peer, so nobody runs two rounds ahead. */
    if (ok && rooted && tid < n)
        asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"((unsigned long long *)a->peer[tid] + GSC_PRESENCE_WORDS + me * 8), "l"(e0) : "memory");
    for (unsigned long long c = 0; ok && c < a->rounds; c++) {
        unsigned long long off = c * a->chunk, bytes = a->bytes - off < a->chunk ? a->bytes - off : a->chunk;
        if (acked && c > 0) ok = gsc_rooted_wait(a, warp, c == 1 ? e0 : e0 + c - 2, c == 1);
        if (ok) ok = gsc_coll_round<T, OP, AVG>(a, e0 + c, off, bytes, tid, threads, t0);
        if (acked) {
            ok = __all_sync(0xffffffffu, ok);
            if (ok) gsc_rooted_ack(a, warp, e0 + c);
        }
    }
    const unsigned long long e = e0 + a->rounds - 1;
    if (ok && acked) ok = gsc_rooted_wait(a, warp, e - 1, false);
    /* Rooted: everyone's presence of this round before this kernel may end. */
    if (ok && rooted && tid < n)
        ok = gsc_coll_spin_in_step(a, ctl + GSC_PRESENCE_WORDS + tid * 8, e0, false);
    gsc_coll_end(a, e, ok);
}

/* ------------------------------------------------------------------------------------------ */
/* Large all-reduce (and, as its halves, large reduce-scatter and all-gather, below; broadcast */
/* and reduce on its pattern): reduce-scatter then all-gather, by NVLink writes, block by block. */
/* Block b of every rank owns the same region of each round (`chunk` bytes at b × chunk, a    */
/* multiple of 16 × nranks), cut into one slice per rank. The block pushes slice q of its      */
/* input into rank q's "in" area (at its own rank's place), raises "in" at every rank; waits   */
/* for everyone's, reduces its own slice from the n copies now in its memory and pushes the    */
/* result into every rank's "out" area; raises "out"; waits for everyone's and copies its      */
/* "out" area into the receive buffer. Every NVLink access is a write (posted: no load waits a */
/* round trip), every read is local. Only block b of each rank waits on block b of the others, */
/* so the blocks of a rank never synchronize with each other. Rounds alternate between two    */
/* parities of the areas: a rank that pushes round e + 2 into a peer passed round e + 1's      */
/* "out" wait, so that peer had reduced round e + 1 and thus finished reading round e's "in";  */
/* and a peer pushes its round e + 2 sums only after our round e + 2 "in", which we raise      */
/* after copying out round e + 1, so after round e.                                           */
/* ------------------------------------------------------------------------------------------ */

/* A load that skips L1: for memory peers wrote (announced by a flag this block acquired). */
static __device__ __forceinline__ uint4 gsc_ld_cg(const void *p)
{
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}

template <typename T> union gsc_vec { uint4 v; T e[16 / sizeof(T)]; };

/* Raise flag `which` (0 in, 1 out) of block b for round e at every rank, then wait for every
 * rank's. A barrier before (the block's writes come first: the release is cumulative over
 * them) and after (the block reads what the flags announce). 0 on timeout or abort and, with
 * `in_step` (the phased kernel, not the copy-engine barrier), once the error word is set. */
static __device__ int gsc_big_flags(const gsc_coll_args_t *a, unsigned long long which, unsigned long long e, bool in_step)
{
    const unsigned long long n = a->nranks, me = a->rank, b = blockIdx.x;
    int ok = 1;
    __syncthreads();
    if (threadIdx.x < n) {
        unsigned long long q = threadIdx.x;
        unsigned long long *at = (unsigned long long *)a->peer[q] + GSC_FLAGS_WORDS + ((b * 2 + which) * GSC_COLL_MAX_RANKS + me);
        asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(at), "l"(e) : "memory");
        unsigned long long *mine = (unsigned long long *)a->ctl + GSC_FLAGS_WORDS + ((b * 2 + which) * GSC_COLL_MAX_RANKS + q);
        ok = in_step ? gsc_coll_spin_in_step(a, mine, e, true) : gsc_coll_spin(a, mine, e, true);
    }
    return __syncthreads_and(ok);
}

/* The widest access (16, 8, 4, 2 or 1 bytes) that every address and length in `bits` (OR-ed
 * together) allow. The workspace is always on 16 bytes; an all-gather's or reduce-scatter's parts
 * are whole elements; a user's buffer may lie at any byte (the narrow kernel's element-wise
 * steps then go through gsc_ld_elem and gsc_st_elem). */
static __device__ __forceinline__ unsigned gsc_align_of(unsigned long long bits)
{
    bits |= 16;
    return (unsigned)(bits & (~bits + 1));
}

/* An access of G bytes, and its load (skipping L1 when `cg`, as gsc_ld_cg). */
template <int G> struct gsc_word;
template <> struct gsc_word<1> { typedef unsigned char t; };
template <> struct gsc_word<2> { typedef unsigned short t; };
template <> struct gsc_word<4> { typedef unsigned t; };
template <> struct gsc_word<8> { typedef unsigned long long t; };
template <> struct gsc_word<16> { typedef uint4 t; };
template <int G> static __device__ __forceinline__ typename gsc_word<G>::t gsc_ld_cg_word(const unsigned char *p);
template <> __device__ __forceinline__ uint4 gsc_ld_cg_word<16>(const unsigned char *p) { return gsc_ld_cg(p); }
template <> __device__ __forceinline__ unsigned long long gsc_ld_cg_word<8>(const unsigned char *p)
{
    unsigned long long v;
    asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
template <> __device__ __forceinline__ unsigned gsc_ld_cg_word<4>(const unsigned char *p)
{
    unsigned v;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
template <> __device__ __forceinline__ unsigned short gsc_ld_cg_word<2>(const unsigned char *p)
{
    unsigned short v;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
    return v;
}
template <> __device__ __forceinline__ unsigned char gsc_ld_cg_word<1>(const unsigned char *p)
{
    unsigned short v;
    asm volatile("ld.global.cg.u8 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
    return (unsigned char)v;
}
template <int G> static __device__ __forceinline__ typename gsc_word<G>::t gsc_ld_word(const unsigned char *p, bool cg)
{
    return cg ? gsc_ld_cg_word<G>(p) : *(const typename gsc_word<G>::t *)p;
}

/* gsc_big_copy_by in accesses of G bytes (G divides both addresses and len). */
template <int G>
static __device__ __forceinline__ void gsc_copy_words(unsigned tid, unsigned threads, unsigned char *t, const unsigned char *s, unsigned long long len,
                                                      bool cg)
{
    typedef typename gsc_word<G>::t W;
    const unsigned long long step = threads * (unsigned long long)G;
    for (unsigned long long i = tid * (unsigned long long)G; i < len; i += 4 * step) {
        W v[4];
#pragma unroll
        for (int k = 0; k < 4; k++)
            if (i + k * step < len) v[k] = gsc_ld_word<G>(s + i + k * step, cg);
#pragma unroll
        for (int k = 0; k < 4; k++)
            if (i + k * step < len) *(W *)(t + i + k * step) = v[k];
    }
}

/* Threads tid..threads-1 of the block (all of it: threadIdx.x, blockDim.x; the pipelined
 * kernel: one role's): copy len bytes, four accesses in flight per thread. Without NARROW both
 * sides and len are on 16 bytes (every kernel but gsc_coll_bign); with it each access is as
 * wide as the sides and len allow. `cg`: the source was written by peers (loads skip L1). */
template <bool NARROW = false>
static __device__ __forceinline__ void gsc_big_copy_by(unsigned tid, unsigned threads, unsigned char *t, const unsigned char *s,
                                                       unsigned long long len, bool cg)
{
    switch (NARROW ? gsc_align_of((unsigned long long)t | (unsigned long long)s | len) : 16) {
    case 16: gsc_copy_words<16>(tid, threads, t, s, len, cg); break;
    case 8: gsc_copy_words<8>(tid, threads, t, s, len, cg); break;
    case 4: gsc_copy_words<4>(tid, threads, t, s, len, cg); break;
    case 2: gsc_copy_words<2>(tid, threads, t, s, len, cg); break;
    default: gsc_copy_words<1>(tid, threads, t, s, len, cg); break;
    }
}

template <bool NARROW = false>
static __device__ __forceinline__ void gsc_big_copy(unsigned char *t, const unsigned char *s, unsigned long long len, bool cg)
{
    gsc_big_copy_by<NARROW>(threadIdx.x, blockDim.x, t, s, len, cg);
}

/* One element of type T that peers wrote (skipping L1). */
template <typename T> static __device__ __forceinline__ T gsc_ld_cg_elem(const unsigned char *p)
{
    union { typename gsc_word<sizeof(T)>::t w; T t; } u;
    u.w = gsc_ld_word<sizeof(T)>(p, true);
    return u.t;
}

/* One element at p, and one stored there, where p may lie off a multiple of the element's
 * size: a user's buffer at any byte, which the narrow kernel takes too, so that ranks whose
 * buffers sit differently still run the same kernel (`collectives::select`). Byte by byte only
 * where p is off: every element of a buffer takes the same branch. */
template <typename T> union gsc_elem_bytes { T t; unsigned char b[sizeof(T)]; };
template <typename T> static __device__ __forceinline__ T gsc_ld_elem(const unsigned char *p)
{
    if (((unsigned long long)p & (sizeof(T) - 1)) == 0) return *(const T *)p;
    gsc_elem_bytes<T> u;
#pragma unroll
    for (int k = 0; k < (int)sizeof(T); k++) u.b[k] = p[k];
    return u.t;
}
template <typename T> static __device__ __forceinline__ void gsc_st_elem(unsigned char *p, T v)
{
    if (((unsigned long long)p & (sizeof(T) - 1)) == 0) {
        *(T *)p = v;
        return;
    }
    gsc_elem_bytes<T> u;
    u.t = v;
#pragma unroll
    for (int k = 0; k < (int)sizeof(T); k++) p[k] = u.b[k];
}

/* One element of this rank's input (at any byte), multiplied by its scalar `m` for OP 4. */
template <typename T, int OP> static __device__ __forceinline__ T gsc_big_own_elem(const unsigned char *s, T m)
{
    const T x = gsc_ld_elem<T>(s);
    return OP == 4 ? gsc_apply<1>(x, m) : x;
}

/* gsc_big_copy_by of this rank's input, multiplied by its scalar on the way for OP 4 (NARROW:
 * element by element where either side is off 16 bytes). */
template <typename T, int OP, bool NARROW = false>
static __device__ __forceinline__ void gsc_big_copy_input_by(unsigned tid, unsigned threads, unsigned char *t, const unsigned char *s,
                                                             unsigned long long len, const gsc_coll_args_t *a)
{
    if (OP != 4) {
        gsc_big_copy_by<NARROW>(tid, threads, t, s, len, false);
        return;
    }
    const T m = gsc_premul_scalar<T>(a);
    if (NARROW && gsc_align_of((unsigned long long)t | (unsigned long long)s | len) < 16) {
        for (unsigned long long i = tid * sizeof(T); i < len; i += threads * sizeof(T)) *(T *)(t + i) = gsc_big_own_elem<T, OP>(s + i, m);
        return;
    }
    for (unsigned long long i = tid * 16ull; i < len; i += threads * 16ull) {
        gsc_vec<T> x;
        x.v = *(const uint4 *)(s + i);
#pragma unroll
        for (int j = 0; j < 16 / sizeof(T); j++) x.e[j] = gsc_apply<1>(x.e[j], m);
        *(uint4 *)(t + i) = x.v;
    }
}

/* 16 bytes of this rank's input, multiplied by its scalar for OP 4 (as gsc_big_copy_input_by
 * would have written them). */
template <typename T, int OP> static __device__ __forceinline__ uint4 gsc_big_own(const unsigned char *s, const gsc_coll_args_t *a)
{
    gsc_vec<T> x;
    x.v = *(const uint4 *)s;
    if (OP == 4) {
        const T m = gsc_premul_scalar<T>(a);
#pragma unroll
        for (int j = 0; j < 16 / sizeof(T); j++) x.e[j] = gsc_apply<1>(x.e[j], m);
    }
    return x.v;
}

/* NARROW (the gsc_coll_bign kernels): buffers or all-gather and reduce-scatter parts off 16
 * bytes (buffers at any byte, parts on whole elements), moved in narrower accesses; a kernel of
 * its own, so that the 16-byte kernel's registers stay its own. */
template <typename T, int OP, bool AVG, bool NARROW> static __device__ void gsc_coll_big(const gsc_coll_args_t *a)
{
    const unsigned long long e0 = gsc_coll_begin(a), n = a->nranks, me = a->rank, b = blockIdx.x;
    const unsigned long long region = a->chunk, round_bytes = region * gridDim.x;
    int ok = !gsc_coll_out_of_step(a, e0);
    for (unsigned long long k = 0; ok && k < a->rounds; k++) {
        const unsigned long long e = e0 + k, par = e & 1;
        const unsigned long long off = k * round_bytes + b * region;
        /* A block past the end still raises and waits for its flags (len 0): every channel takes
         * part in every round, which the parity argument needs for all-gather and
         * reduce-scatter, whose rounds have one flag each. */
        const unsigned long long len = off >= a->bytes ? 0 : a->bytes - off < region ? a->bytes - off : region;
        if (n == 2 && a->kind == GSC_BROADCAST) {
            /* Two ranks: the root pushes the whole region into the other's "out" area, one flag
             * exchange per round as the all-gather (the host gives the all-reduce's geometry:
             * one region per block). With more ranks the root would push n - 1 copies: the
             * all-reduce's pattern below sends fewer bytes from it. */
            #define GSC_BC_OUT(q) ((unsigned char *)a->peer[q] + GSC_BIG_OFFSET + (2 + par) * GSC_BIG_ROUND_MAX + b * region)
            const unsigned char *send = (const unsigned char *)a->send + off;
            if (me == a->root) gsc_big_copy<NARROW>(GSC_BC_OUT(1 - me), send, len, false);
            if (!(ok = gsc_big_flags(a, 1, e, true))) break;
            if (me != a->root) gsc_big_copy<NARROW>((unsigned char *)a->recv + off, GSC_BC_OUT(me), len, true);
            else if (a->send != a->recv) gsc_big_copy<NARROW>((unsigned char *)a->recv + off, send, len, false);
            #undef GSC_BC_OUT
            continue;
        }
        if (a->kind == GSC_REDUCE_SCATTER || (n == 2 && a->kind == GSC_REDUCE)) {
            /* Two ranks' reduce is the reduce-scatter with one part, the root's (the host gives
             * the reduce-scatter's geometry): both regions go to the root, which reduces them. */
            const bool to_root = a->kind == GSC_REDUCE;
            /* Part q's region goes to rank q, into its "in" area (n - 1 regions per channel: at
             * our place among q's peers); the n copies of ours are reduced into the receive
             * buffer, ours read where it is (a copy to our own area would cost a local read
             * and write, and room). The host's geometry has n - 1 regions per channel. */
            #define GSC_RS_IN(q) ((unsigned char *)a->peer[q] + GSC_BIG_OFFSET + par * GSC_BIG_ROUND_MAX + b * (n - 1) * region)
            #define GSC_RS_PLACE(p, q) ((p) < (q) ? (p) : (p) - 1) /* rank p's place in rank q's area */
            const unsigned char *own = (const unsigned char *)a->send + (to_root ? 0 : me * a->send_stride) + off;
            for (unsigned long long q = 0; q < n; q++)
                if (q != me && (!to_root || q == a->root))
                    gsc_big_copy_input_by<T, OP, NARROW>(threadIdx.x, blockDim.x, GSC_RS_IN(q) + GSC_RS_PLACE(me, q) * region,
                                                 (const unsigned char *)a->send + q * a->send_stride + off, len, a);
            if (!(ok = gsc_big_flags(a, 0, e, true))) break;
            if (to_root && me != a->root) continue;
            const unsigned char *in = GSC_RS_IN(me);
            unsigned char *recv = (unsigned char *)a->recv + off;
            if (NARROW && gsc_align_of((unsigned long long)own | (unsigned long long)recv | len) < 16) {
                /* Parts or buffers off 16 bytes: element by element, the same arithmetic, eight
                 * elements of each copy in flight per thread. One at a time, this local pass set
                 * the pace: a two-rank reduce-scatter of 128 MiB + 8 B on a stream took 402.6 us,
                 * with eight 318.1 (NCCL 329.2; docs/PERF.md, session 34). */
                const T m = OP == 4 ? gsc_premul_scalar<T>(a) : T();
                const unsigned long long step = blockDim.x * (unsigned long long)sizeof(T);
                for (unsigned long long i = threadIdx.x * sizeof(T); i < len; i += 8 * step) {
                    T acc[8], x[8];
#pragma unroll
                    for (int k = 0; k < 8; k++)
                        if (i + k * step < len) acc[k] = me == 0 ? gsc_big_own_elem<T, OP>(own + i + k * step, m) : gsc_ld_cg_elem<T>(in + i + k * step);
                    for (unsigned long long q = 1; q < n; q++) {
#pragma unroll
                        for (int k = 0; k < 8; k++)
                            if (i + k * step < len)
                                x[k] = q == me ? gsc_big_own_elem<T, OP>(own + i + k * step, m)
                                               : gsc_ld_cg_elem<T>(in + GSC_RS_PLACE(q, me) * region + i + k * step);
#pragma unroll
                        for (int k = 0; k < 8; k++)
                            if (i + k * step < len) acc[k] = gsc_apply<OP>(acc[k], x[k]);
                    }
#pragma unroll
                    for (int k = 0; k < 8; k++)
                        if (i + k * step < len) gsc_st_elem<T>(recv + i + k * step, AVG ? gsc_div(acc[k], n) : acc[k]);
                }
            } else {
                for (unsigned long long i = threadIdx.x * 16ull; i < len; i += blockDim.x * 16ull) {
                    gsc_vec<T> acc, x;
                    acc.v = me == 0 ? gsc_big_own<T, OP>(own + i, a) : gsc_ld_cg(in + i);
                    for (unsigned long long q = 1; q < n; q++) {
                        x.v = q == me ? gsc_big_own<T, OP>(own + i, a) : gsc_ld_cg(in + GSC_RS_PLACE(q, me) * region + i);
#pragma unroll
                        for (int j = 0; j < 16 / sizeof(T); j++) acc.e[j] = gsc_apply<OP>(acc.e[j], x.e[j]);
                    }
                    if (AVG)
#pragma unroll
                        for (int j = 0; j < 16 / sizeof(T); j++) acc.e[j] = gsc_div(acc.e[j], n);
                    *(uint4 *)(recv + i) = acc.v;
                }
            }
            #undef GSC_RS_IN
            #undef GSC_RS_PLACE
            continue;
        }
        if (a->kind == GSC_ALL_GATHER) {
            /* Our region goes to every rank's "out" area at our place; then every rank's region
             * from ours into the receive buffer. */
            #define GSC_AG_OUT(q) ((unsigned char *)a->peer[q] + GSC_BIG_OFFSET + (2 + par) * GSC_BIG_ROUND_MAX + b * n * region)
            for (unsigned long long q = 0; q < n; q++) gsc_big_copy<NARROW>(GSC_AG_OUT(q) + me * region, (const unsigned char *)a->send + off, len, false);
            if (!(ok = gsc_big_flags(a, 1, e, true))) break;
            for (unsigned long long q = 0; q < n; q++)
                gsc_big_copy<NARROW>((unsigned char *)a->recv + q * a->recv_stride + off, GSC_AG_OUT(me) + q * region, len, true);
            #undef GSC_AG_OUT
            continue;
        }
        /* All-reduce, and the rooted collectives on its pattern: broadcast (only the root
         * pushes; rank q forwards the root's slice q to every other rank) and reduce (the sums
         * go to the root only). Every rank raises and waits for every flag as the all-reduce
         * does, so the parity argument above holds as it is. Slices of whole 16-byte pieces
         * (the buffers' bytes are whole pieces: see the host). */
        const bool bcast = a->kind == GSC_BROADCAST, reduce = a->kind == GSC_REDUCE;
        const unsigned long long slice = (len + 16 * n - 1) / (16 * n) * 16;
        #define GSC_SLICE_END(q) ((q + 1) * slice < len ? (q + 1) * slice : len)
        #define GSC_BIG_IN(q) ((unsigned char *)a->peer[q] + GSC_BIG_OFFSET + par * GSC_BIG_ROUND_MAX + b * region)
        #define GSC_BIG_OUT(q) ((unsigned char *)a->peer[q] + GSC_BIG_OFFSET + (2 + par) * GSC_BIG_ROUND_MAX + b * region)
        const unsigned char *send = (const unsigned char *)a->send + off;
        /* Push slice q of our input to rank q, at our place in its "in" area. */
        for (unsigned long long q = 0; q < n && (!bcast || me == a->root); q++) {
            const unsigned long long q0 = q * slice, q1 = GSC_SLICE_END(q);
            if (q0 < q1) gsc_big_copy_input_by<T, OP, NARROW>(threadIdx.x, blockDim.x, GSC_BIG_IN(q) + me * slice, send + q0, q1 - q0, a);
        }
        if (!(ok = gsc_big_flags(a, 0, e, true))) break;
        /* Reduce our slice from the n copies (rank order; broadcast: the root's copy) and push
         * the result to every rank that needs it. */
        const unsigned long long s1 = GSC_SLICE_END(me) > me * slice ? GSC_SLICE_END(me) - me * slice : 0;
        const unsigned char *in = GSC_BIG_IN(me);
        for (unsigned long long i = threadIdx.x * 16ull; i < s1; i += blockDim.x * 16ull) {
            gsc_vec<T> acc, x;
            if (bcast) {
                acc.v = gsc_ld_cg(in + a->root * slice + i);
                for (unsigned long long q = 0; q < n; q++)
                    if (q != a->root) *(uint4 *)(GSC_BIG_OUT(q) + me * slice + i) = acc.v;
                continue;
            }
            acc.v = gsc_ld_cg(in + i);
            for (unsigned long long q = 1; q < n; q++) {
                x.v = gsc_ld_cg(in + q * slice + i);
#pragma unroll
                for (int j = 0; j < 16 / sizeof(T); j++) acc.e[j] = gsc_apply<OP>(acc.e[j], x.e[j]);
            }
            if (AVG)
#pragma unroll
                for (int j = 0; j < 16 / sizeof(T); j++) acc.e[j] = gsc_div(acc.e[j], n);
            for (unsigned long long q = 0; q < n; q++)
                if (!reduce || q == a->root) *(uint4 *)(GSC_BIG_OUT(q) + me * slice + i) = acc.v;
        }
        if (!(ok = gsc_big_flags(a, 1, e, true))) break;
        /* Every slice's result is in our "out" area: into the receive buffer. A broadcast's
         * root copies its own input instead (nothing when in place), a reduce's other ranks
         * receive nothing. */
        if (bcast && me == a->root) {
            if (a->send != a->recv) gsc_big_copy<NARROW>((unsigned char *)a->recv + off, send, len, false);
        } else if (!reduce || me == a->root) {
            gsc_big_copy<NARROW>((unsigned char *)a->recv + off, GSC_BIG_OUT(me), len, true);
        }
        #undef GSC_SLICE_END
        #undef GSC_BIG_IN
        #undef GSC_BIG_OUT
    }
    gsc_coll_end(a, e0 + a->rounds - 1, ok);
}

/* ------------------------------------------------------------------------------------------ */
/* The reduction step of collectives between hosts (collectives/net.rs): the n members' copies */
/* of one part, reduced element by element in member order with the same arithmetic as the     */
/* kernels above (gsc_apply: 16-bit floats in float, rounded after every step). Member `me`'s  */
/* input is `own`; the others arrived over the point-to-point engine into a scratch buffer, in */
/* member order, `stride` bytes apart. `out` may be `own` (each element is read by every input */
/* before it is written, by the same thread).                                                  */
/* ------------------------------------------------------------------------------------------ */
typedef struct {
    unsigned long long own, copies, stride, out;
    unsigned long long count;   /* elements */
    unsigned long long n, me;   /* members; own's place among them */
    unsigned long long divisor; /* average: divide the sum by this; 0: no division */
} gsc_net_reduce_args_t;

template <typename T, int OP> static __device__ void gsc_net_reduce(const gsc_net_reduce_args_t *a)
{
    const T *own = (const T *)a->own;
    T *out = (T *)a->out;
    const unsigned long long step = gridDim.x * (unsigned long long)blockDim.x;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < a->count; i += step) {
        T acc = (a->me == 0 ? own : (const T *)a->copies)[i];
        for (unsigned long long q = 1; q < a->n; q++) {
            const T *in = q == a->me ? own : (const T *)(a->copies + (q - (q > a->me ? 1 : 0)) * a->stride);
            acc = gsc_apply<OP>(acc, in[i]);
        }
        if (a->divisor) acc = gsc_div(acc, a->divisor);
        out[i] = acc;
    }
}

/* A barrier of the communicator's ranks between copy-engine steps (collectives::copy_engine):
 * one round, block 0's "in" flags. Returns once every rank reached it, so what came before it
 * on every rank's stream is done (the copies a rank issued, the buffers it will no longer
 * read); a timeout or an abort records the round as failed, as any collective kernel does,
 * and also in every peer's error word: a peer that gets past this barrier anyway (it saw our
 * flag before we gave up) would otherwise finish the call on copies of buffers we no longer
 * guard and report success. */
#ifdef GSC_COMMON_KERNELS /* the type-less kernels: in the common module only (coll_modules) */
extern "C" __global__ void gsc_coll_barrier(gsc_coll_args_t a)
{
    unsigned long long e = gsc_coll_begin(&a);
    int ok = 0;
    if (*(volatile const unsigned long long *)((const unsigned long long *)a.ctl + 2) == 0) {
        ok = gsc_big_flags(&a, 0, e, false);
        if (!ok && threadIdx.x < a.nranks) *(volatile unsigned long long *)((unsigned long long *)a.peer[threadIdx.x] + 2) = e;
    } else if (threadIdx.x < a.nranks) {
        /* A round of this communicator failed before (a peer missed a timeout): the ranks are
         * out of step, so a barrier does not wait again — a copy-engine call has three, which
         * would otherwise take three timeouts to release its stream. It still raises its flags
         * for peers that wait, after marking their rounds failed too (the release orders it):
         * they get past the barrier, but not with a result that looks good. */
        *(volatile unsigned long long *)((unsigned long long *)a.peer[threadIdx.x] + 2) = e;
        unsigned long long *at = (unsigned long long *)a.peer[threadIdx.x] + GSC_FLAGS_WORDS + a.rank;
        asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(at), "l"(e) : "memory");
    }
    gsc_coll_end(&a, e, ok);
}

/* The last node of a kernel-triggered collective's graph (collectives::triggered), one thread:
 * the operation's done word (page-locked host memory, which the triggering kernel's gsc_wait
 * reads) advances by one trigger — the graph is launched once per trigger, in order, on one
 * stream, and nothing else writes the word meanwhile — with the error bit set when a round of
 * this communicator failed (its error word: the collective before this node gave up on a
 * peer, or an earlier one did and the ranks are out of step) or it was aborted. Once set, the
 * bit stays. The release orders the collective's results before the word. */
typedef struct {
    gsc_coll_args_t c;
    unsigned long long done; /* the done word, as the device addresses it */
} gsc_triggered_args_t;

extern "C" __global__ void gsc_coll_triggered_done(gsc_triggered_args_t t)
{
#if __CUDA_ARCH__ >= 900
    /* Launched with programmatic dependent launch after a collective kernel that lets its
     * dependents start early (gsc_coll_begin): the collective must have ended first. */
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    const unsigned long long bit = 1ull << 63;
    const unsigned long long d = *(volatile const unsigned long long *)t.done;
    const int failed = ((volatile const unsigned long long *)t.c.ctl)[2] != 0 ||
                       (t.c.abort && *(volatile const unsigned long long *)t.c.abort != 0);
    const unsigned long long v = ((d & ~bit) + 1) | (d & bit) | (failed ? bit : 0);
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(t.done), "l"(v) : "memory");
}
#endif /* GSC_COMMON_KERNELS */

/* One family of a type's kernels per macro (coll_modules::MACROS). */
#define GSC_COLL_LL(T, TAG) \
    extern "C" __global__ void gsc_net_reduce_##TAG##_sum(gsc_net_reduce_args_t a) { gsc_net_reduce<T, 0>(&a); } \
    extern "C" __global__ void gsc_net_reduce_##TAG##_prod(gsc_net_reduce_args_t a) { gsc_net_reduce<T, 1>(&a); } \
    extern "C" __global__ void gsc_net_reduce_##TAG##_max(gsc_net_reduce_args_t a) { gsc_net_reduce<T, 2>(&a); } \
    extern "C" __global__ void gsc_net_reduce_##TAG##_min(gsc_net_reduce_args_t a) { gsc_net_reduce<T, 3>(&a); } \
    extern "C" __global__ void gsc_coll_##TAG##_sum(gsc_coll_args_t a) { gsc_coll_ll<T, 0, false>(&a); } \
    extern "C" __global__ void gsc_coll_##TAG##_prod(gsc_coll_args_t a) { gsc_coll_ll<T, 1, false>(&a); } \
    extern "C" __global__ void gsc_coll_##TAG##_max(gsc_coll_args_t a) { gsc_coll_ll<T, 2, false>(&a); } \
    extern "C" __global__ void gsc_coll_##TAG##_min(gsc_coll_args_t a) { gsc_coll_ll<T, 3, false>(&a); } \
    extern "C" __global__ void gsc_coll_##TAG##_avg(gsc_coll_args_t a) { gsc_coll_ll<T, 0, true>(&a); } \
    extern "C" __global__ void gsc_coll_##TAG##_premul(gsc_coll_args_t a) { gsc_coll_ll<T, 4, false>(&a); }
#define GSC_COLL_BIG(T, TAG) \
    extern "C" __global__ void gsc_coll_big_##TAG##_sum(gsc_coll_args_t a) { gsc_coll_big<T, 0, false, false>(&a); } \
    extern "C" __global__ void gsc_coll_big_##TAG##_prod(gsc_coll_args_t a) { gsc_coll_big<T, 1, false, false>(&a); } \
    extern "C" __global__ void gsc_coll_big_##TAG##_max(gsc_coll_args_t a) { gsc_coll_big<T, 2, false, false>(&a); } \
    extern "C" __global__ void gsc_coll_big_##TAG##_min(gsc_coll_args_t a) { gsc_coll_big<T, 3, false, false>(&a); } \
    extern "C" __global__ void gsc_coll_big_##TAG##_avg(gsc_coll_args_t a) { gsc_coll_big<T, 0, true, false>(&a); } \
    extern "C" __global__ void gsc_coll_big_##TAG##_premul(gsc_coll_args_t a) { gsc_coll_big<T, 4, false, false>(&a); }
#define GSC_COLL_BIGN(T, TAG) \
    extern "C" __global__ void __launch_bounds__(GSC_BIG_MAX_THREADS) gsc_coll_bign_##TAG##_sum(gsc_coll_args_t a) { gsc_coll_big<T, 0, false, true>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_BIG_MAX_THREADS) gsc_coll_bign_##TAG##_prod(gsc_coll_args_t a) { gsc_coll_big<T, 1, false, true>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_BIG_MAX_THREADS) gsc_coll_bign_##TAG##_max(gsc_coll_args_t a) { gsc_coll_big<T, 2, false, true>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_BIG_MAX_THREADS) gsc_coll_bign_##TAG##_min(gsc_coll_args_t a) { gsc_coll_big<T, 3, false, true>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_BIG_MAX_THREADS) gsc_coll_bign_##TAG##_avg(gsc_coll_args_t a) { gsc_coll_big<T, 0, true, true>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_BIG_MAX_THREADS) gsc_coll_bign_##TAG##_premul(gsc_coll_args_t a) { gsc_coll_big<T, 4, false, true>(&a); }
"#;

/// `gsc_coll_args_t`.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub(crate) struct CollArgs {
    pub(crate) ctl: u64,
    pub(crate) peer: [u64; MAX_RANKS],
    pub(crate) send: u64,
    pub(crate) recv: u64,
    pub(crate) bytes: u64,
    pub(crate) chunk: u64,
    pub(crate) rounds: u64,
    pub(crate) send_stride: u64,
    pub(crate) recv_stride: u64,
    pub(crate) slot_words: u64,
    pub(crate) nranks: u64,
    pub(crate) rank: u64,
    pub(crate) root: u64,
    pub(crate) kind: u64,
    pub(crate) timeout_ns: u64,
    /// The device address of this rank's abort word (filled in by the workspace).
    pub(crate) abort: u64,
    /// A pre-multiplied sum's scalar: its bits, or (when not 0) its address in GPU memory.
    pub(crate) premul_bits: u64,
    pub(crate) premul_ptr: u64,
    /// The pipelined large kernel only: stages, bytes per stage, threads that push, threads
    /// that reduce (the rest of the block copies out).
    pub(crate) stages: u64,
    pub(crate) stage_bytes: u64,
    pub(crate) push_threads: u64,
    pub(crate) reduce_threads: u64,
}
impl ArgBlock for CollArgs {}

/// `gsc_triggered_args_t`: the last node of a kernel-triggered collective's graph
/// (`Workspace::launch_triggered_done`).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub(crate) struct TriggeredArgs {
    pub(crate) coll: CollArgs,
    /// The operation's done word, as the device addresses it.
    pub(crate) done: u64,
}
impl ArgBlock for TriggeredArgs {}

/// The source of one module of the collective kernels (`coll_modules`): the header, the
/// sources of every kernel family, and the instantiations of that module's type, or for the
/// common module the type-less kernels.
fn module_source(m: Module) -> String {
    // The common module's switch goes before the sources, a type's instantiations after them.
    let (common, typed) = match m {
        Module::Common => ("#define GSC_COMMON_KERNELS\n".to_string(), String::new()),
        Module::Typed { t } => {
            let (ty, tag) = TYPES[t];
            (String::new(), MACROS.iter().map(|mac| format!("{mac}({ty}, {tag})\n")).collect())
        }
    };
    format!(
        "{}\n{common}#define GSC_ACK_WORDS {}\n#define GSC_FLAGS_WORDS {}\n#define GSC_PIPE_FLAGS_WORDS {}\n#define GSC_BIG_OFFSET {}ull\n#define GSC_BIG_ROUND_MAX {}ull\n#define GSC_PIPE_MAX_THREADS {}\n#define GSC_BIG_MAX_THREADS {}\n#define GSC_DIRECT_THREADS {}\n#define GSC_RING_THREADS {}\n{}{SOURCE}\n{}\n{}\n{}\n{}\n{typed}",
        super::kernels::DEVICE_HEADER,
        ACK_OFFSET / 8,
        FLAGS_OFFSET / 8,
        PIPE_FLAGS_OFFSET / 8,
        BIG_OFFSET,
        big_round_max(),
        crate::collectives::large::PIPELINED_MAX_THREADS,
        crate::collectives::large::PHASED_MAX_THREADS,
        super::coll_direct::DIRECT_THREADS,
        super::coll_ring::RING_THREADS,
        super::coll_p2p::defines(),
        super::coll_pipelined::SOURCE,
        super::coll_direct::SOURCE,
        super::coll_ring::SOURCE,
        super::coll_p2p::SOURCE
    )
}

/// The collective kernels of one context, by name (`gsc_coll_<type>_<op>`), loaded once. The
/// first lookup in a context builds every module (`coll_modules::build`: from the disk cache,
/// or compiled in parallel) and loads them all.
fn kernel(ctx: cu::CUcontext, name: &str, cache_dir: Option<&Path>) -> Result<cu::CUfunction> {
    type Loaded = HashMap<(usize, String), usize>;
    static LOADED: OnceLock<Mutex<(HashMap<usize, Vec<usize>>, Loaded)>> = OnceLock::new();
    let mut loaded = LOADED.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    let key = (ctx as usize, name.to_string());
    if let Some(f) = loaded.1.get(&key) {
        return Ok(*f as cu::CUfunction);
    }
    if !loaded.0.contains_key(&(ctx as usize)) {
        let arch = context_arch(ctx)?;
        let started = std::time::Instant::now();
        let cubins = coll_modules::build(arch, cache_dir, &module_source);
        let _scope = CtxScope::enter(ctx)?;
        let mut modules = Vec::with_capacity(cubins.len());
        for cubin in cubins {
            modules.push(load_module(&cubin?)? as usize);
        }
        tracing::debug!(target: "gsc::coll", modules = modules.len(), took = ?started.elapsed(), "collective kernels built and loaded");
        loaded.0.insert(ctx as usize, modules);
    }
    let module = loaded.0[&(ctx as usize)][module_of(name)] as cu::CUmodule;
    let f = function(module, name)?;
    loaded.1.insert(key, f as usize);
    Ok(f)
}

/// One rank's workspace on `device`, and every rank's mapped into our GPU's address space.
pub(crate) struct Workspace {
    device: i32,
    base: u64,
    /// Every rank's workspace as we address it (ours at our rank).
    peers: Vec<u64>,
    abort: AbortWord,
    /// The error word as `error` last read it, and when (at most every `ERROR_READ_INTERVAL`).
    error_read: Mutex<Option<(std::time::Instant, u64)>>,
}

/// `Workspace::error` reads the error word from the device (`read_word`: never behind other
/// work) at most this often; calls in between answer what it read last. So a program polling
/// an async error after every call (PyTorch polls ncclCommGetAsyncError after each collective
/// of a non-blocking communicator) costs a device read per interval, not per call, and an
/// error a kernel records is reported at most this late.
const ERROR_READ_INTERVAL: std::time::Duration = std::time::Duration::from_micros(100);

/// A loaded direct kernel (`Workspace::direct_kernel`).
#[derive(Copy, Clone, Debug)]
pub(crate) struct DirectKernel(usize);

/// Add kernel `f` with its one by-value parameter `args` to `graph` (the CUgraph and the
/// context its nodes are built in), after `after` when given; returns the node.
fn add_kernel_node<T: ArgBlock>(graph: (usize, usize), f: cu::CUfunction, args: &T, grid: Grid, after: Option<usize>) -> Result<usize> {
    let ctx = super::raw::<std::ffi::c_void>(graph.1) as cu::CUcontext;
    let _scope = CtxScope::enter(ctx)?;
    let deps: Vec<cu::CUgraphNode> = after.into_iter().map(|n| n as cu::CUgraphNode).collect();
    // SAFETY: the user's live graph (its context current), dependencies that are nodes of it
    // (the previous round), and `args` the kernel's one by-value parameter.
    let node = unsafe { replay::add_kernel_node(super::raw(graph.0), f, grid, args, &deps) }?;
    Ok(node as usize)
}

/// A page-locked word this rank's kernels poll while they wait (`abort` in their arguments):
/// the host sets it, with no CUDA call, to make them give up (`Workspace::abort`).
struct AbortWord(std::mem::ManuallyDrop<super::api::PinnedBuf>);

// SAFETY: the word is accessed only atomically on the host (and by volatile loads on the GPU);
// the buffer is never freed.
unsafe impl Sync for AbortWord {}

impl AbortWord {
    fn word(&self) -> &std::sync::atomic::AtomicU64 {
        // SAFETY: an 8-byte, 8-aligned (page-locked allocation) word of the live buffer, only
        // ever accessed atomically here.
        unsafe { std::sync::atomic::AtomicU64::from_ptr(self.0.host_ptr() as *mut u64) }
    }
}

impl Workspace {
    /// A fresh, zeroed workspace on `device` and the key that lets a peer open it.
    pub(crate) fn allocate(device: i32, nranks: usize) -> Result<(Workspace, Vec<u8>)> {
        if nranks == 0 || nranks > MAX_RANKS {
            return Err(Error::invalid_param(format!("a communicator of {nranks} ranks (1 to {MAX_RANKS} on one host)")));
        }
        let _scope = CtxScope::enter(primary_context(device)?)?;
        // Its own allocation (a peer opens each CUDA block once: prep_ctl).
        let bytes = workspace_bytes(nranks);
        let mut base: cu::CUdeviceptr = 0;
        // SAFETY: a valid out-pointer. Never freed: a peer may still write into it after this
        // rank destroyed its communicator (a kernel of a round this rank gave up on).
        check(unsafe { cu::cuMemAlloc_v2(&mut base, bytes) }, "cuMemAlloc (collective workspace)")?;
        // SAFETY: the whole new allocation; a synchronous memset.
        check(unsafe { cu::cuMemsetD8_v2(base, 0, bytes) }, "cuMemsetD8 (collective workspace)")?;
        let ptr = super::memory::device_ptr(base as usize)?
            .ok_or_else(|| Error::new(Status::Internal, "a fresh cuMemAlloc is not device memory"))?;
        let key = ipc::export(base as usize, ptr)?.encode();
        // Never freed either, for the same reason (a kernel still running reads it).
        let abort = AbortWord(std::mem::ManuallyDrop::new(super::api::PinnedBuf::new(8)?));
        Ok((Workspace { device, base, peers: Vec::new(), abort, error_read: Mutex::new(None) }, key))
    }

    /// Map every rank's workspace (`keys[r]`, `bases[r]`; ours at `rank`).
    pub(crate) fn map_peers(&mut self, rank: usize, keys: &[Vec<u8>], bases: &[u64]) -> Result<()> {
        let n = keys.len();
        let mut peers = Vec::with_capacity(n);
        for (r, (key, base)) in keys.iter().zip(bases).enumerate() {
            if r == rank {
                peers.push(self.base);
                continue;
            }
            let key = ipc::DeviceKey::decode(key)?;
            let at = ipc::map_peer(&key, *base, workspace_bytes(n), self.device)
                .map_err(|e| e.context(format!("opening the collective workspace of rank {r}")))?;
            peers.push(at);
        }
        self.peers = peers;
        Ok(())
    }

    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    /// Make this rank's kernels give up at their next wait for a peer (within GSC_ABORT_LOOK_NS, 1 ms; a
    /// kernel whose peers all take part runs to its end), recording a failed round in the
    /// error word.
    pub(crate) fn abort(&self) {
        self.abort.word().store(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// The device addresses of this rank's abort word (page-locked) and error word (control
    /// word 2 of the workspace), for kernels outside the workspace's own that take part in its
    /// failure handling (a kernel-triggered collective run by the triggering thread).
    pub(crate) fn failure_words(&self) -> (u64, u64) {
        (self.abort.0.device_ptr(), self.base + 16)
    }

    /// 0, or the round a kernel of this rank gave up on (a peer did not answer in time, or the
    /// communicator was aborted). Read from the device at most every `ERROR_READ_INTERVAL` (an
    /// error, once read, is kept: it is never cleared).
    pub(crate) fn error(&self) -> Result<u64> {
        let mut last = self.error_read.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, value)) = *last
            && (value != 0 || at.elapsed() < ERROR_READ_INTERVAL)
        {
            return Ok(value);
        }
        let value = super::read_word(self.device, self.base + 16)?;
        *last = Some((std::time::Instant::now(), value));
        Ok(value)
    }

    /// Add one round to a graph (`graph`: the CUgraph and the context its nodes are built in),
    /// after `after` when given; returns the node.
    pub(crate) fn add_node(
        &self,
        graph: (usize, usize),
        kernel_name: &str,
        cache_dir: Option<&Path>,
        args: CollArgs,
        grid: Grid,
        after: Option<usize>,
    ) -> Result<usize> {
        let ctx = super::raw::<std::ffi::c_void>(graph.1) as cu::CUcontext;
        let f = kernel(ctx, kernel_name, cache_dir)?;
        add_kernel_node(graph, f, &self.fill(args), grid, after)
    }

    /// Add a direct kernel (`direct_kernel` with the graph's context) to a graph as its own
    /// node, with no dependencies; returns the node.
    pub(crate) fn add_direct_node(
        &self,
        graph: (usize, usize),
        f: DirectKernel,
        mut args: super::coll_direct::DirectArgs,
        grid: Grid,
    ) -> Result<usize> {
        args.coll = self.fill(args.coll);
        add_kernel_node(graph, f.0 as cu::CUfunction, &args, grid, None)
    }

    /// `args` with this workspace's part: its control words, every rank's slots.
    fn fill(&self, args: CollArgs) -> CollArgs {
        let mut a = CollArgs { ctl: self.base, slot_words: (SLOT_BYTES / 8) as u64, abort: self.abort.0.device_ptr(), ..args };
        a.peer[..self.peers.len()].copy_from_slice(&self.peers);
        a
    }

    /// Launch `args.rounds` rounds on `stream` as `grid` (the kernel `kernel_name`): `args`
    /// gives the buffers and sizes, the workspace fills in the rest. A call is one launch, and
    /// the same call is likely to come again, so it is replayed from a cached one-node graph
    /// (`replay`).
    pub(crate) fn launch(&self, stream: usize, kernel_name: &str, cache_dir: Option<&Path>, args: CollArgs, grid: Grid) -> Result<()> {
        let ctx = primary_context(self.device)?;
        let f = kernel(ctx, kernel_name, cache_dir)?;
        replay::launch(ctx as usize, f, stream, grid, &self.fill(args))
    }
}

impl Workspace {
    /// The direct kernel `kernel_name` (`gsc_direct_<type>_<op>`) of this workspace's device
    /// (of `graph`'s context for a node of it), compiled and loaded (looked up before the ranks agree to run it, so that a failure here
    /// sends every rank to the workspace kernels rather than leave the others waiting).
    pub(crate) fn direct_kernel(&self, kernel_name: &str, cache_dir: Option<&Path>, graph: Option<(usize, usize)>) -> Result<DirectKernel> {
        let ctx = match graph {
            // A graph's nodes take the kernel as loaded in the graph's context.
            Some((_, ctx)) => super::raw::<std::ffi::c_void>(ctx) as cu::CUcontext,
            None => primary_context(self.device)?,
        };
        Ok(DirectKernel(kernel(ctx, kernel_name, cache_dir)? as usize))
    }

    /// Launch a direct kernel on `stream`: `args` gives the buffers, sizes and ranks, the
    /// workspace fills in the rest. Not through the replay cache: its arguments name the
    /// call's buffers, and a graph per buffer pair would evict everything else there.
    pub(crate) fn launch_direct(&self, stream: usize, f: DirectKernel, mut args: super::coll_direct::DirectArgs, grid: Grid) -> Result<()> {
        args.coll = self.fill(args.coll);
        replay::launch_uncached(f.0 as cu::CUfunction, stream, grid, &args)
    }

    /// Launch a ring kernel (`gsc_ring_wait`, `gsc_ring_reduce_<type>_<op>`, looked up with
    /// `direct_kernel`) on `stream`: `args` gives the flags and buffers, the workspace fills in
    /// the rest. Not through the replay cache, as for the direct kernel.
    pub(crate) fn launch_ring(&self, stream: usize, f: DirectKernel, mut args: super::coll_ring::RingArgs, grid: Grid) -> Result<()> {
        args.coll = self.fill(args.coll);
        replay::launch_uncached(f.0 as cu::CUfunction, stream, grid, &args)
    }

    /// The address, as this rank sees it, of rank `rank`'s ring flag for (`phase` 0:
    /// reduce-scatter, 1: all-gather; `step`; `piece`), and of the word beside it counting a
    /// reduction's finished blocks.
    pub(crate) fn ring_flag(&self, rank: usize, phase: usize, step: usize, piece: usize) -> (u64, u64) {
        debug_assert!(phase < 2 && step < MAX_RANKS && piece < RING_PIECES_MAX);
        let word = (phase * MAX_RANKS + step) * RING_PIECES_MAX + piece;
        let base = self.peers.get(rank).copied().unwrap_or(self.base) + RING_FLAGS_OFFSET as u64;
        (base + 8 * word as u64, base + 8 * (RING_FLAG_WORDS + word) as u64)
    }

    /// Advance a kernel-triggered collective's done word (`done`, its device address) by one
    /// trigger on `stream`, with the error bit when this rank's collectives failed or were
    /// aborted (`gsc_coll_triggered_done`): the last node of the collective's graph.
    pub(crate) fn launch_triggered_done(&self, stream: usize, cache_dir: Option<&Path>, done: u64) -> Result<()> {
        let f = self.direct_kernel("gsc_coll_triggered_done", cache_dir, None)?;
        let args = TriggeredArgs { coll: self.fill(CollArgs::default()), done };
        replay::launch_uncached(f.0 as cu::CUfunction, stream, Grid { blocks: 1, threads: 1 }, &args)
    }

    /// `args` with this workspace's part: the workspaces, the abort word, the send/recv area.
    fn fill_p2p(&self, mut args: super::coll_p2p::P2pArgs) -> super::coll_p2p::P2pArgs {
        args.coll = self.fill(args.coll);
        args.area = p2p_area() as u64;
        args
    }

    /// Launch one group's sends and receives (`gsc_p2p`) on `stream` as `grid`: `args` gives
    /// the operations, ranks and timeout. Not through the replay cache, as for the direct
    /// kernel: the arguments name the group's buffers, which many programs change from call
    /// to call (an instantiation per new set would cost more than the launch it saves).
    pub(crate) fn launch_p2p(&self, stream: usize, cache_dir: Option<&Path>, args: super::coll_p2p::P2pArgs, grid: Grid) -> Result<()> {
        let f = kernel(primary_context(self.device)?, "gsc_p2p", cache_dir)?;
        replay::launch_uncached(f, stream, grid, &self.fill_p2p(args))
    }

    /// Copy `bytes` from `src` to `dst` (a message to this rank itself) on `stream` by
    /// `gsc_p2p_self_copy`, with at most `max_blocks` blocks. Touches nothing of the
    /// communicator, so it may run beside a send/recv launch (`launch_p2p`).
    ///
    /// # Safety
    /// Both ranges are valid GPU memory for `bytes` until the copy ran on the stream, and do
    /// not overlap (as for `stream_copy`).
    pub(crate) unsafe fn launch_self_copy(
        &self,
        stream: usize,
        cache_dir: Option<&Path>,
        (dst, src, bytes): (u64, u64, usize),
        max_blocks: usize,
    ) -> Result<()> {
        use super::coll_p2p::{P2P_THREADS, SELF_COPY_CHUNK, SelfCopyArgs};
        if bytes == 0 || dst == src {
            return Ok(());
        }
        let f = kernel(primary_context(self.device)?, "gsc_p2p_self_copy", cache_dir)?;
        let blocks = (bytes as u64).div_ceil(SELF_COPY_CHUNK).min(max_blocks.max(1) as u64) as u32;
        let args = SelfCopyArgs { dst, src, bytes: bytes as u64, chunk: SELF_COPY_CHUNK };
        replay::launch_uncached(f, stream, Grid { blocks, threads: P2P_THREADS }, &args)
    }

    /// Add one group's sends and receives to a graph (`graph`: the CUgraph and the context
    /// its nodes are built in), after `after` when given; returns the node.
    pub(crate) fn add_p2p_node(
        &self,
        graph: (usize, usize),
        cache_dir: Option<&Path>,
        args: super::coll_p2p::P2pArgs,
        grid: Grid,
        after: Option<usize>,
    ) -> Result<usize> {
        let ctx = super::raw::<std::ffi::c_void>(graph.1) as cu::CUcontext;
        let f = kernel(ctx, "gsc_p2p", cache_dir)?;
        add_kernel_node(graph, f, &self.fill_p2p(args), grid, after)
    }

    /// A barrier of every rank on `stream` (`gsc_coll_barrier`, one block of a warp): a round
    /// of the communicator like any collective's, with its timeout and abort.
    pub(crate) fn launch_barrier(
        &self,
        stream: usize,
        cache_dir: Option<&Path>,
        nranks: usize,
        rank: usize,
        timeout_ns: u64,
    ) -> Result<()> {
        let args = CollArgs { rounds: 1, nranks: nranks as u64, rank: rank as u64, timeout_ns, ..Default::default() };
        self.launch(stream, "gsc_coll_barrier", cache_dir, args, Grid { blocks: 1, threads: 32 })
    }
}

/// The one-shot kernel's grid: a thread per 8-byte unit of a round, at most 32 blocks of
/// `THREADS`.
pub(crate) fn one_shot_grid(a: &CollArgs) -> Grid {
    Grid::of(a.bytes.min(a.chunk).div_ceil(8).div_ceil(u64::from(THREADS)).clamp(1, ONE_SHOT_BLOCKS_MAX) as u32)
}

/// `gsc_net_reduce_args_t`: the reduction step of collectives between hosts
/// (`collectives::net`).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub(crate) struct NetReduceArgs {
    /// This member's input.
    pub(crate) own: u64,
    /// The other members' inputs, in member order, `stride` bytes apart.
    pub(crate) copies: u64,
    pub(crate) stride: u64,
    /// Where the result goes (may be `own`).
    pub(crate) out: u64,
    pub(crate) count: u64,
    pub(crate) n: u64,
    pub(crate) me: u64,
    /// An average: the sum is divided by this (0: no division).
    pub(crate) divisor: u64,
}
impl ArgBlock for NetReduceArgs {}

/// Load (compile if need be) the collective kernels on `device` now, with every kernel in them
/// (`kernels::load_module`): at communicator creation, never behind a stream wait. The stream
/// conditions' trigger and wait kernels too (`Kernels`, as `GSC_CUDA_WAIT_KERNEL` asks): a
/// communicator's first send/recv through the engine would load them otherwise, and where ranks
/// share a process that load waited for the group's send/recv kernel, spinning for a peer whose
/// kernel the same thread had yet to launch (session 27).
pub(crate) fn preload(device: i32, cache_dir: Option<&Path>) -> Result<()> {
    let ctx = primary_context(device)?;
    kernel(ctx, "gsc_net_reduce_f32_sum", cache_dir)?;
    match super::wait_kernel_mode() {
        crate::config::Tristate::Off => Ok(()),
        crate::config::Tristate::On => super::Kernels::of(ctx, cache_dir).map(|_| ()),
        // As the conditions do: without the kernels (no NVRTC) their waits are memops.
        crate::config::Tristate::Auto => {
            let _ = super::Kernels::of(ctx, cache_dir);
            Ok(())
        }
    }
}

/// Launch `gsc_net_reduce_<type>_<op>` (`op_tag`: sum, prod, max or min) on `stream` of
/// `device`'s primary context: a thread per element, at most 1024 blocks (a grid-stride loop
/// covers the rest).
pub(crate) fn launch_net_reduce(
    device: i32,
    stream: usize,
    type_tag: &str,
    op_tag: &str,
    cache_dir: Option<&Path>,
    args: NetReduceArgs,
) -> Result<()> {
    if args.count == 0 {
        return Ok(());
    }
    let ctx = primary_context(device)?;
    let f = kernel(ctx, &format!("gsc_net_reduce_{type_tag}_{op_tag}"), cache_dir)?;
    let blocks = args.count.div_ceil(u64::from(THREADS)).clamp(1, 1024) as u32;
    let _scope = CtxScope::enter(ctx)?;
    replay::launch_uncached(f, stream, Grid::of(blocks), &args)
}

/// Scratch GPU memory one communicator keeps between its calls (collectives across hosts:
/// the copies of peers' parts before they are reduced), grown on demand.
///
/// Why not `cuMemAllocAsync` per call: the proxy thread and the copy engine of the staging
/// pipeline read and write the scratch from streams of their own, and ask the driver about it
/// (memory type, allocation range) from another thread — none of which the stream-ordered
/// allocator promises for memory whose allocation the stream may not have reached yet. A plain
/// allocation is valid from the moment it is made. Calls that use it on different streams are
/// ordered by an event: a call waits (on the GPU, not the host) for the previous call's last
/// use. A buffer outgrown is kept until the communicator is destroyed: `cuMemFree` may wait for
/// the device, and while a call's stream waits on the proxy that wait could be the cycle
/// src/cuda/mod.rs forbids (the proxy's copies queued behind the free). Growth doubles, so what
/// is kept is at most the size of the current buffer.
pub(crate) struct StreamScratch {
    device: i32,
    /// (address, bytes) of the current buffer.
    buf: Option<(u64, usize)>,
    /// The stream of the last call that used `buf`, and the event recorded after that use.
    last: Option<(usize, usize)>,
    /// Outgrown buffers and the events after their last use.
    retired: Vec<(u64, usize)>,
}

// SAFETY: the addresses and events are plain driver handles, valid from any thread with the
// device's context current (every method enters it).
unsafe impl Send for StreamScratch {}

/// Scratch is allocated in multiples of this (fewer regrowths for sizes that creep up).
const SCRATCH_GRAIN: usize = 1 << 20;

/// The size of a scratch buffer replacing one of `current` bytes that is too small for
/// `bytes`: at least double (outgrown buffers are kept, so they sum to less than the newest),
/// in whole grains.
pub(crate) fn scratch_len(current: usize, bytes: usize) -> usize {
    bytes.max(1).max(2 * current).next_multiple_of(SCRATCH_GRAIN)
}

impl StreamScratch {
    pub(crate) fn new(device: i32) -> StreamScratch {
        StreamScratch { device, buf: None, last: None, retired: Vec::new() }
    }

    /// At least `bytes` of scratch for work about to be queued on `stream`, which is first made
    /// to wait (on the GPU) for the previous call's use when that was on another stream. Call
    /// `queued` once the work using it is queued. Never waits on the host.
    pub(crate) fn take(&mut self, stream: usize, bytes: usize) -> Result<u64> {
        let _scope = CtxScope::enter(primary_context(self.device)?)?;
        if self.buf.is_none_or(|(_, len)| len < bytes) {
            let len = scratch_len(self.buf.map_or(0, |(_, len)| len), bytes);
            let mut base: cu::CUdeviceptr = 0;
            // SAFETY: a valid out-pointer, the device's context is current.
            check(unsafe { cu::cuMemAlloc_v2(&mut base, len) }, "cuMemAlloc (collective scratch)")?;
            match (self.buf.take(), self.last.take()) {
                (Some((old, _)), Some((_, event))) => self.retired.push((old, event as usize)),
                // Never used by queued work: freeing it waits for nothing of ours, but it is
                // kept with the others all the same (no free on a user's thread mid-life).
                (Some((old, _)), None) => self.retired.push((old, 0)),
                (None, last) => self.last = last,
            }
            self.buf = Some((base, len));
        }
        if let Some((previous, event)) = self.last
            && previous != stream
        {
            // SAFETY: our event (recorded on the previous stream), the caller's live stream.
            check(unsafe { cu::cuStreamWaitEvent(super::raw(stream), event as cu::CUevent, 0) }, "cuStreamWaitEvent")?;
        }
        Ok(self.buf.expect("allocated above").0)
    }

    /// The work using the scratch has been queued on `stream`.
    pub(crate) fn queued(&mut self, stream: usize) -> Result<()> {
        let _scope = CtxScope::enter(primary_context(self.device)?)?;
        let event = match self.last {
            Some((_, e)) => e as cu::CUevent,
            None => {
                let mut e: cu::CUevent = std::ptr::null_mut();
                // SAFETY: a valid out-pointer.
                check(unsafe { cu::cuEventCreate(&mut e, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) }, "cuEventCreate")?;
                e
            }
        };
        self.last = Some((stream, event as usize));
        // SAFETY: our event, the caller's live stream.
        check(unsafe { cu::cuEventRecord(event, super::raw(stream)) }, "cuEventRecord")
    }

    /// Free the outgrown buffers whose last use is done (event 0: never used). The context
    /// must be current. Only at destroy (see the type's comment).
    fn free_done(&mut self) {
        self.retired.retain(|&(base, event)| {
            // SAFETY: our event; `cuEventQuery` never waits.
            let done = event == 0 || unsafe { cu::cuEventQuery(event as cu::CUevent) } != cu::CUresult::CUDA_ERROR_NOT_READY;
            if done {
                // SAFETY: our allocation and event; the work that used them is done.
                unsafe {
                    cu::cuMemFree_v2(base);
                    if event != 0 {
                        cu::cuEventDestroy_v2(event as cu::CUevent);
                    }
                }
            }
            !done
        });
    }
}

impl Drop for StreamScratch {
    /// Buffers whose last use is done are freed; one still in use by queued work (a stream held
    /// by a peer that will time out) is left allocated rather than freed under it or waited for.
    fn drop(&mut self) {
        let Ok(ctx) = primary_context(self.device) else { return };
        let Ok(_scope) = CtxScope::enter(ctx) else { return };
        if let Some((base, _)) = self.buf.take() {
            match self.last.take() {
                Some((_, event)) => self.retired.push((base, event)),
                // SAFETY: our allocation, never used by queued work.
                None => unsafe {
                    cu::cuMemFree_v2(base);
                },
            }
        }
        self.free_done();
        if !self.retired.is_empty() {
            tracing::warn!(target: "gsc::cuda", buffers = self.retired.len(), "collective scratch still in use by queued work at destroy: left allocated");
        }
    }
}

/// Copy `bytes` from `src` to `dst` (GPU memory of `device`) in `stream`'s order. Never waits.
///
/// # Safety
/// Both ranges are valid GPU memory for `bytes` until the copy ran on the stream, and do not
/// overlap.
pub(crate) unsafe fn stream_copy(device: i32, stream: usize, dst: u64, src: u64, bytes: usize) -> Result<()> {
    if bytes == 0 || dst == src {
        return Ok(());
    }
    let _scope = CtxScope::enter(primary_context(device)?)?;
    // SAFETY: the caller's promise; the caller's live stream.
    check(unsafe { cu::cuMemcpyAsync(dst, src, bytes, super::raw(stream)) }, "cuMemcpyAsync (collective copy)")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A module's source instantiates its own type's kernels and nothing else; the common
    /// module's turns the type-less kernels on before the sources and instantiates nothing.
    #[test]
    fn each_module_source_instantiates_its_own_kernels_only() {
        for m in coll_modules::modules() {
            let src = module_source(m);
            let invoked: Vec<&str> = MACROS.iter().copied().filter(|mac| src.contains(&format!("\n{mac}("))).collect();
            match m {
                Module::Common => {
                    assert!(invoked.is_empty(), "the common module instantiates {invoked:?}");
                    let on = src.find("#define GSC_COMMON_KERNELS").expect("the common module defines GSC_COMMON_KERNELS");
                    assert!(on < src.find("gsc_coll_barrier").unwrap(), "GSC_COMMON_KERNELS after the sources");
                }
                Module::Typed { t } => {
                    assert!(!src.contains("#define GSC_COMMON_KERNELS"), "{m:?}");
                    let want: Vec<String> = MACROS.iter().map(|mac| format!("{mac}({}, {})", TYPES[t].0, TYPES[t].1)).collect();
                    assert_eq!(invoked.len(), want.len(), "{m:?} instantiates {invoked:?}");
                    for w in want {
                        assert_eq!(src.matches(&format!("\n{w}\n")).count(), 1, "{m:?}: {w}");
                    }
                }
            }
        }
    }

    /// The kernels a cubin holds, by the names of their `.text.<name>` sections.
    fn kernels_in(cubin: &[u8]) -> std::collections::BTreeSet<String> {
        let mut names = std::collections::BTreeSet::new();
        let needle = b".text.";
        for at in (0..cubin.len().saturating_sub(needle.len())).filter(|&i| &cubin[i..i + needle.len()] == needle) {
            let rest = &cubin[at + needle.len()..];
            let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
            names.insert(String::from_utf8_lossy(&rest[..end]).into_owned());
        }
        names
    }

    /// Compile every module for `arch` one after the other (on CI's two cores, compiles side by
    /// side would starve the timing-sensitive tests running beside this one) and check that
    /// each kernel in a cubin is where `module_of` looks for it.
    fn modules_compile_and_hold_what_module_of_expects(arch: (i32, i32), only: impl Fn(Module) -> bool) {
        for (i, m) in coll_modules::modules().into_iter().enumerate().filter(|&(_, m)| only(m)) {
            let cubin = super::super::kernels::compile_uncached(&module_source(m), arch).unwrap_or_else(|e| panic!("{m:?}: {e}"));
            assert!(cubin.starts_with(b"\x7fELF"), "{m:?} is not a cubin");
            let names = kernels_in(&cubin);
            let typed = if m == Module::Common { 0 } else { MACROS.len() };
            // Six operators per macro but the four of `gsc_net_reduce_` and the ring's reduce.
            assert!(names.len() >= 4 * typed.max(1), "{m:?} holds only {names:?}");
            for n in &names {
                assert_eq!(module_of(n), i, "{n} is in {m:?}, but module_of looks for it elsewhere");
            }
            if m == Module::Common {
                for n in ["gsc_coll_barrier", "gsc_coll_triggered_done", "gsc_p2p", "gsc_p2p_self_copy", "gsc_ring_wait"] {
                    assert!(names.contains(n), "the common module lacks {n}: {names:?}");
                }
            }
        }
    }

    /// Every module compiles for the device machines' GPUs (sm_90) wherever NVRTC is, GPU or
    /// not (`kernels::nvrtc_present_or_say_why`).
    #[test]
    fn every_collective_module_compiles_for_sm90() {
        if !super::super::kernels::nvrtc_present_or_say_why() {
            return;
        }
        modules_compile_and_hold_what_module_of_expects((9, 0), |_| true);
    }

    /// The fp8 modules compile for a GPU without sm_89's fp8 conversions too (sm_80): their
    /// copies run there, their arithmetic is refused by the host (`Communicator::checked`).
    #[test]
    fn fp8_modules_compile_below_sm89() {
        if !super::super::kernels::nvrtc_present_or_say_why() {
            return;
        }
        let fp8 = |m: Module| matches!(m, Module::Typed { t, .. } if TYPES[t].1.starts_with('e'));
        modules_compile_and_hold_what_module_of_expects((8, 0), fp8);
    }

    #[test]
    fn scratch_grows_by_doubling_in_whole_grains() {
        assert_eq!(scratch_len(0, 0), SCRATCH_GRAIN);
        assert_eq!(scratch_len(0, SCRATCH_GRAIN + 1), 2 * SCRATCH_GRAIN);
        // Creeping sizes double the buffer, so the outgrown ones kept sum to less than it.
        let (mut len, mut kept) = (0, 0);
        for bytes in (1..200).map(|i| i * (SCRATCH_GRAIN / 3)) {
            if len < bytes {
                kept += len;
                len = scratch_len(len, bytes);
                assert!(len >= bytes && len.is_multiple_of(SCRATCH_GRAIN));
                assert!(kept < len, "kept {kept} against {len}");
            }
        }
    }
}
