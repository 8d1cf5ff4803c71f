//! The send/recv kernel of a communicator (`collectives::p2p_kernel`): the sends and receives
//! of one group, moved by SMs through FIFOs in the receivers' workspaces, in one launch.
//!
//! **Layout.** Every workspace has a send/recv area (`Workspace::p2p_area`): control words
//! (chunks sent to and received from each rank so far, a count of finished blocks), then
//! *credits* (one word per (receiver, slot), written by the receiver into the sender's area),
//! *headers* (two words per (sender, slot): the chunk's number + 1 and its message's length,
//! written by the sender into the receiver's area) and *data* (`P2P_SLOTS` slots of
//! `P2P_CHUNK` bytes per sender). A message of b bytes is ceil(b / chunk) chunks; the chunks
//! between two ranks in one direction are numbered from 0 for the communicator's life, and
//! chunk c travels through slot c % slots.
//!
//! **Chunk size.** A message is cut into `P2P_SPLIT` chunks where it can be, so a mid-sized
//! message keeps as many blocks busy as a large one (one block per chunk): `chunk_bytes` —
//! between `P2P_MIN_CHUNK` and the slot's `P2P_CHUNK`, from the message's length alone, which
//! sender and receiver agree on. A smaller chunk leaves the rest of its slot unused.
//!
//! **Protocol** (NCCL's "simple" one, with a FIFO per pair). The sender of chunk c waits until
//! the receiver gave back slot c % slots from chunk c - slots (credit >= c + 1 - slots), copies
//! the chunk into the slot and releases the header (c + 1) at system scope. The
//! receiver acquires the header, copies the slot into the receive buffer and releases the
//! credit (c + 1) into the sender's area. So a pair needs no handshake per message, only per
//! chunk, and a message of up to slots x chunk bytes is delivered before the receiver shows up.
//!
//! **Copies.** A send to this rank and its receive from this rank in one group
//! (`p2p_kernel::fuse_self`) are one `P2P_COPY` operation: its blocks copy the chunks from the
//! send buffer to the receive buffer and touch no FIFO, header, credit or counter.
//!
//! **Why chunk numbers live on the GPU.** A launch reads the counters of its pairs when it
//! starts and its last block advances them when it ends, so a captured group replays any
//! number of times. So send/recv kernels of one communicator run one at a time, in issue order
//! on every rank — as NCCL requires of a communicator's operations.
//!
//! **Failure.** Every wait gives up after the timeout, on the abort word, or once this rank's
//! error word is set; a rank that gives up writes every peer of the launch's error word too
//! (they stop waiting for it) and its own. A message whose length differs between sender and
//! receiver is detected from the header and fails the same way. A communicator whose error
//! word is set moves nothing more: its counters are out of step with the peers'.

use super::coll::{CollArgs, MAX_RANKS};
use super::replay::ArgBlock;

/// Bytes of one FIFO slot (the largest chunk). Fixed: every rank's workspace must agree.
pub(crate) const P2P_CHUNK: usize = 64 << 10;
/// The smallest chunk a message is cut into: two 16-byte stores per thread of a block. 4, 8,
/// 16 and 64 KiB measured alike from 2 MiB up; 16 KiB was best below (PERF.md, session 25).
pub(crate) const P2P_MIN_CHUNK: usize = 16 << 10;
/// Chunks a message is cut into where `P2P_MIN_CHUNK` and `P2P_CHUNK` allow (so up to 2 MiB
/// a message has at most 32 blocks, past it up to `GSC_COLL_P2P_BLOCKS`).
pub(crate) const P2P_SPLIT: usize = 32;
const _: () = assert!(P2P_MIN_CHUNK % 16 == 0 && P2P_MIN_CHUNK <= P2P_CHUNK);

/// The chunk size of a message of `bytes` (`P2pOp::chunk`).
pub(crate) fn chunk_bytes(bytes: u64) -> u64 {
    bytes.div_ceil(P2P_SPLIT as u64).next_multiple_of(P2P_MIN_CHUNK as u64).min(P2P_CHUNK as u64)
}

/// The chunks of a message of `bytes` (`P2pOp::chunks`).
pub(crate) fn chunks(bytes: u64) -> u64 {
    bytes.div_ceil(chunk_bytes(bytes))
}

/// Slots per sender in every receiver's workspace: a pair has `P2P_SLOTS` chunks in flight
/// (8 MiB; 128 slots with 64 blocks per message moved 16 MiB in 56 µs between two H200s,
/// 64 slots with 32 blocks in 66: docs/PERF.md, session 25).
pub(crate) const P2P_SLOTS: usize = 128;
/// Sends and receives one launch carries (in its argument block).
pub(crate) const P2P_MAX_OPS: usize = 32;
/// Threads per block.
pub(crate) const P2P_THREADS: u32 = 512;
/// The `#define`s the source needs (`coll::module_source`).
pub(super) fn defines() -> String {
    format!(
        "#define GSC_P2P_CHUNK {P2P_CHUNK}ull\n#define GSC_P2P_SLOTS {P2P_SLOTS}ull\n#define GSC_P2P_MAX_OPS {P2P_MAX_OPS}\n\
         #define GSC_P2P_THREADS {P2P_THREADS}\n#define GSC_P2P_CREDITS {P2P_CREDITS}ull\n#define GSC_P2P_HEADERS {P2P_HEADERS}ull\n\
         #define GSC_P2P_DATA {P2P_DATA}ull\n#define GSC_P2P_FAILED {P2P_FAILED}ull\n#define GSC_P2P_SIZE_MISMATCH {P2P_SIZE_MISMATCH}ull\n"
    )
}

/// Byte offsets inside the send/recv area (see the module doc).
pub(crate) const P2P_CREDITS: usize = 4096;
pub(crate) const P2P_HEADERS: usize = P2P_CREDITS + MAX_RANKS * P2P_SLOTS * 8;
pub(crate) const P2P_DATA: usize = 32768;
const _: () = assert!(P2P_HEADERS + MAX_RANKS * P2P_SLOTS * 16 <= P2P_DATA && P2P_DATA % 4096 == 0);

/// Bytes of the send/recv area of a communicator of `nranks`.
pub(crate) const fn p2p_area_bytes(nranks: usize) -> usize {
    P2P_DATA + nranks * P2P_SLOTS * P2P_CHUNK
}

/// The error-word values a failed send/recv launch leaves (`Communicator::async_error` names
/// them): the top bit marks send/recv, the next says why, the low byte names the peer.
pub(crate) const P2P_FAILED: u64 = 1 << 63;
pub(crate) const P2P_SIZE_MISMATCH: u64 = P2P_FAILED | 1 << 62;

/// `gsc_p2p_op_t::kind`.
pub(crate) const P2P_RECV: u32 = 0;
pub(crate) const P2P_SEND: u32 = 1;
/// A send to this rank and its receive from this rank: `src` to `buf`, no FIFO.
pub(crate) const P2P_COPY: u32 = 2;

/// `gsc_p2p_op_t`: one send, receive or copy of a launch. The chunking is worked out here,
/// not in the kernel: its 64-bit divisions by a message's chunk size cost the 8 B sendrecv
/// 0.3 µs (docs/PERF.md, session 25).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct P2pOp {
    /// The send's source, the receive's or the copy's target.
    pub(crate) buf: u64,
    /// The copy's source.
    pub(crate) src: u64,
    pub(crate) bytes: u64,
    /// Chunks of the launch's earlier operations with the same peer and direction.
    pub(crate) skip: u64,
    /// `chunks(bytes)`.
    pub(crate) chunks: u64,
    /// `chunk_bytes(bytes)`.
    pub(crate) chunk: u32,
    /// The other rank (a copy's: this one).
    pub(crate) peer: u32,
    /// `P2P_RECV`, `P2P_SEND` or `P2P_COPY`.
    pub(crate) kind: u32,
    /// The operation's blocks: `first_block .. first_block + blocks`.
    pub(crate) first_block: u32,
    pub(crate) blocks: u32,
    /// Zero: no padding bytes of undefined value in the argument block.
    pub(crate) pad: u32,
}

/// `gsc_p2p_args_t`.
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub(crate) struct P2pArgs {
    /// The workspaces, rank, timeout and abort word (filled in by the workspace).
    pub(crate) coll: CollArgs,
    /// Byte offset of the send/recv area in every workspace.
    pub(crate) area: u64,
    pub(crate) nops: u64,
    pub(crate) ops: [P2pOp; P2P_MAX_OPS],
}
impl ArgBlock for P2pArgs {}
// No implicit padding (the argument block's bytes are all defined).
const _: () = assert!(std::mem::size_of::<P2pOp>() == 5 * 8 + 6 * 4);
const _: () = assert!(std::mem::size_of::<P2pArgs>() == std::mem::size_of::<CollArgs>() + 16 + P2P_MAX_OPS * 64);
// A kernel's parameters: 4 KiB (the limit before CUDA 12.1).
const _: () = assert!(std::mem::size_of::<P2pArgs>() <= 4096);

/// `gsc_p2p_self_copy_args_t`: a message to the rank itself copied by a kernel of its own
/// (`Workspace::launch_self_copy`).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub(crate) struct SelfCopyArgs {
    pub(crate) dst: u64,
    pub(crate) src: u64,
    pub(crate) bytes: u64,
    /// What one block copies at a time (block b: chunks b, b + blocks, ...).
    pub(crate) chunk: u64,
}
impl ArgBlock for SelfCopyArgs {}

/// `SelfCopyArgs::chunk`: the FIFO slot's size, as the send/recv kernel's copies use.
pub(crate) const SELF_COPY_CHUNK: u64 = 64 << 10;

impl Default for P2pArgs {
    fn default() -> P2pArgs {
        P2pArgs { coll: CollArgs::default(), area: 0, nops: 0, ops: [P2pOp::default(); P2P_MAX_OPS] }
    }
}

/// CUDA source of `gsc_p2p`: needs `coll`'s source (and its #defines) before it.
pub(super) const SOURCE: &str = r#"
/* ------------------------------------------------------------------------------------------ */
/* Send/recv through FIFOs in the receivers' workspaces (cuda/coll_p2p.rs has the protocol).   */
/* ------------------------------------------------------------------------------------------ */
typedef struct {
    unsigned long long buf, src, bytes, skip, chunks;
    unsigned int chunk, peer, kind, first_block, blocks, pad;
} gsc_p2p_op_t;
#define GSC_P2P_RECV 0u
#define GSC_P2P_SEND 1u
#define GSC_P2P_COPY 2u

typedef struct {
    gsc_coll_args_t c;
    unsigned long long area; /* byte offset of the send/recv area in every workspace */
    unsigned long long nops;
    gsc_p2p_op_t op[GSC_P2P_MAX_OPS];
} gsc_p2p_args_t;

/* fail_s of a launch that found the communicator failed already: it moves and reports nothing. */
#define GSC_P2P_QUIET 1ull
#define GSC_P2P_AT(ws, off) ((unsigned long long *)((ws) + a->area + (off)))

/* Wait until *w >= v: 1; 0 after the timeout, on the abort word, or once our error word is set
 * (a peer gave up on us, or an earlier operation failed here). */
static __device__ int gsc_p2p_spin(const gsc_p2p_args_t *a, unsigned long long *w, unsigned long long v)
{
    const volatile unsigned long long *error = (const volatile unsigned long long *)a->c.ctl + 2;
    const unsigned long long t0 = gsc_globaltimer();
    unsigned long long look = t0 + GSC_ABORT_LOOK_NS;
    for (;;) {
        unsigned long long x;
        asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(x) : "l"(w) : "memory");
        if (x >= v) return 1;
        if (*error != 0) return 0;
        const unsigned long long now = gsc_globaltimer();
        if (now - t0 > a->c.timeout_ns) return 0;
        if (now >= look) {
            if (gsc_coll_aborted(&a->c)) return 0;
            look = now + GSC_ABORT_LOOK_NS;
        }
    }
}

/* The block copies len bytes: 16 at a time where both sides allow it. `cg`: the source was
 * written by a peer (loads skip L1: the slot held an older chunk). */
static __device__ __forceinline__ void gsc_p2p_copy(unsigned char *t, const unsigned char *s, unsigned long long len, bool cg)
{
    unsigned long long head = 0;
    if ((((unsigned long long)t | (unsigned long long)s) & 15) == 0) {
        head = len & ~15ull;
        gsc_big_copy(t, s, head, cg);
    }
    for (unsigned long long i = head + threadIdx.x; i < len; i += blockDim.x)
        t[i] = cg ? *(volatile const unsigned char *)(s + i) : s[i];
}

#ifdef GSC_COMMON_KERNELS
extern "C" __global__ void __launch_bounds__(GSC_P2P_THREADS, 1) gsc_p2p(gsc_p2p_args_t args)
{
    const gsc_p2p_args_t *a = &args;
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    const unsigned long long me = a->c.rank, ws = a->c.ctl;
    unsigned long long *ctl = GSC_P2P_AT(ws, 0); /* [0, 8): sent to, [8, 16): received from, 16: blocks done */
    volatile unsigned long long *error = (volatile unsigned long long *)ws + 2;
    __shared__ int ok_s, last_s;
    __shared__ unsigned long long fail_s;
    if (threadIdx.x == 0) {
        fail_s = *error != 0 ? GSC_P2P_QUIET : 0;
        ok_s = 1;
    }
    unsigned i = 0;
    while (i < a->nops && !(blockIdx.x >= a->op[i].first_block && blockIdx.x < a->op[i].first_block + a->op[i].blocks)) i++;
    __syncthreads();
    if (fail_s == 0 && i < a->nops) {
        const gsc_p2p_op_t o = a->op[i];
        const unsigned long long chunk = o.chunk, chunks = o.chunks, slot_bytes = GSC_P2P_CHUNK, slots = GSC_P2P_SLOTS;
        const bool send = o.kind == GSC_P2P_SEND;
        const unsigned long long base = o.kind == GSC_P2P_COPY ? 0 : *(volatile unsigned long long *)(ctl + (send ? 0 : 8) + o.peer) + o.skip;
        const unsigned long long peer_ws = a->c.peer[o.peer];
        for (unsigned long long j = blockIdx.x - o.first_block; j < chunks; j += o.blocks) {
            const unsigned long long c = base + j, k = c % slots;
            const unsigned long long off = j * chunk, len = o.bytes - off < chunk ? o.bytes - off : chunk;
            if (o.kind == GSC_P2P_COPY) {
                gsc_p2p_copy((unsigned char *)o.buf + off, (const unsigned char *)o.src + off, len, false);
            } else if (send) {
                /* Our slot k at the receiver; its credit word here. */
                unsigned char *slot = (unsigned char *)GSC_P2P_AT(peer_ws, GSC_P2P_DATA + (me * slots + k) * slot_bytes);
                unsigned long long *hdr = GSC_P2P_AT(peer_ws, GSC_P2P_HEADERS + (me * slots + k) * 16);
                unsigned long long *credit = GSC_P2P_AT(ws, GSC_P2P_CREDITS + (o.peer * slots + k) * 8);
                if (threadIdx.x == 0) ok_s = c < slots || gsc_p2p_spin(a, credit, c + 1 - slots);
                __syncthreads();
                if (!ok_s) break;
                gsc_p2p_copy(slot, (const unsigned char *)o.buf + off, len, false);
                __syncthreads();
                /* The release is cumulative over the block's stores (ordered before it by the
                 * barrier): no separate fence. */
                if (threadIdx.x == 0) {
                    *(volatile unsigned long long *)(hdr + 1) = o.bytes;
                    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(hdr), "l"(c + 1) : "memory");
                }
            } else {
                /* The sender's slot k here; our credit word at the sender. */
                const unsigned char *slot = (const unsigned char *)GSC_P2P_AT(ws, GSC_P2P_DATA + (o.peer * slots + k) * slot_bytes);
                unsigned long long *hdr = GSC_P2P_AT(ws, GSC_P2P_HEADERS + (o.peer * slots + k) * 16);
                unsigned long long *credit = GSC_P2P_AT(peer_ws, GSC_P2P_CREDITS + (me * slots + k) * 8);
                if (threadIdx.x == 0) {
                    ok_s = gsc_p2p_spin(a, hdr, c + 1);
                    if (ok_s && *(volatile unsigned long long *)(hdr + 1) != o.bytes) {
                        ok_s = 0;
                        fail_s = GSC_P2P_SIZE_MISMATCH | o.peer;
                    }
                }
                __syncthreads();
                if (!ok_s) break;
                gsc_p2p_copy((unsigned char *)o.buf + off, slot, len, true);
                __syncthreads();
                if (threadIdx.x == 0) asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(credit), "l"(c + 1) : "memory");
            }
        }
        if (threadIdx.x == 0 && !ok_s && fail_s == 0) fail_s = GSC_P2P_FAILED | o.peer;
    }
    __syncthreads();
    /* A failure: our error word, and every peer's of this launch (they stop waiting for us and
     * move nothing more with us: the chunk counters are out of step now). */
    if (fail_s != 0 && fail_s != GSC_P2P_QUIET && threadIdx.x == 0) {
        for (unsigned long long q = 0; q < a->nops; q++)
            *(volatile unsigned long long *)(a->c.peer[a->op[q].peer] + 16) = GSC_P2P_FAILED | me;
        *error = fail_s;
    }
    if (threadIdx.x == 0) {
        __threadfence();
        last_s = atomicAdd(ctl + 16, 1ull) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last_s || threadIdx.x != 0) return;
    /* Every block has read the counters: advance them past this launch's chunks. */
    for (unsigned long long q = 0; q < a->nops; q++) {
        const gsc_p2p_op_t o = a->op[q];
        if (o.kind != GSC_P2P_COPY) ctl[(o.kind == GSC_P2P_SEND ? 0 : 8) + o.peer] += o.chunks;
    }
    ctl[16] = 0;
}
#endif /* GSC_COMMON_KERNELS */
#undef GSC_P2P_AT
#undef GSC_P2P_QUIET

/* A message to the rank itself larger than GSC_COLL_P2P_MAX, copied by SMs on a side stream
 * beside the point-to-point engine's copies (collectives/comm.rs), so that the copy engines
 * carry only the peers' data. It touches nothing of the communicator (gsc_p2p's counters allow
 * one launch at a time; this may run beside one). */
typedef struct {
    unsigned long long dst, src, bytes, chunk;
} gsc_p2p_self_copy_args_t;

#ifdef GSC_COMMON_KERNELS
extern "C" __global__ void __launch_bounds__(GSC_P2P_THREADS, 1) gsc_p2p_self_copy(gsc_p2p_self_copy_args_t a)
{
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    for (unsigned long long off = blockIdx.x * a.chunk; off < a.bytes; off += gridDim.x * a.chunk) {
        const unsigned long long len = a.bytes - off < a.chunk ? a.bytes - off : a.chunk;
        gsc_p2p_copy((unsigned char *)a.dst + off, (const unsigned char *)a.src + off, len, false);
    }
}
#endif /* GSC_COMMON_KERNELS */
"#;
