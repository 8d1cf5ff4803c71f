//! The copy-engine ring's kernels (`collectives::ce_ring`): the copy engines move every byte
//! around the ring; these wait for a peer's copy to have landed (a flag its stream raised
//! after the copy) and reduce what arrived with this rank's own input. The source is appended
//! to `coll`'s (it uses its helpers: spin, apply, vectors) and compiled with it.

use super::coll::CollArgs;
use super::replay::ArgBlock;

/// `gsc_ring_args_t`.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub(crate) struct RingArgs {
    /// The workspace, ranks, timeout and abort word.
    pub(crate) coll: CollArgs,
    /// The first of this rank's flag words the launch waits for.
    pub(crate) flag: u64,
    /// `gsc_ring_wait`: flags from `flag` on (consecutive words).
    pub(crate) nflags: u64,
    /// `gsc_ring_reduce`: the word counting finished blocks (the last clears the flag).
    pub(crate) blocks_done: u64,
    /// `gsc_ring_reduce`: out = acc (op) own, `n16` pieces of 16 bytes.
    pub(crate) acc: u64,
    pub(crate) own: u64,
    pub(crate) out: u64,
    pub(crate) n16: u64,
    /// Average: divide the result by this (the last step); 0: no division.
    pub(crate) divisor: u64,
}
impl ArgBlock for RingArgs {}
// The C struct embeds `gsc_coll_args_t` by value, then 8 words: no padding anywhere.
const _: () = assert!(std::mem::size_of::<RingArgs>() == std::mem::size_of::<CollArgs>() + 8 * 8);

/// Threads per block of `gsc_ring_reduce`.
pub(crate) const RING_THREADS: u32 = 512;

/// CUDA source of `gsc_ring_wait` and `gsc_ring_reduce_<type>_<op>`: needs `coll`'s source
/// before it.
pub(super) const SOURCE: &str = r#"
/* ------------------------------------------------------------------------------------------ */
/* Copy-engine ring. A flag is a word of the receiver's workspace that a peer's stream sets to */
/* 1 (a stream memop after its copy: the copy has landed) and the kernel that consumed it      */
/* clears: a memop writes only constants, so the call's round cannot be in it. A neighbour     */
/* raises the flag again only in a later call, after the barrier that starts that call, which */
/* this rank reaches only after the launch that cleared it.                                   */
/*                                                                                              */
/* Failure: a wait that outlasts the timeout, or is aborted, writes the call's round (that of */
/* the barrier it began with) into every rank's error word, as gsc_coll_barrier does, so no    */
/* rank reports this call's results as good. A rank already out of step (its error word set)  */
/* does not wait at all: its results are undefined anyway, and a call waits only one timeout. */
/* ------------------------------------------------------------------------------------------ */
typedef struct {
    gsc_coll_args_t c;
    unsigned long long flag, nflags, blocks_done;
    unsigned long long acc, own, out, n16, divisor;
} gsc_ring_args_t;

/* Wait until our flag *w is raised: 1, or 0 (see above). */
static __device__ int gsc_ring_await(const gsc_ring_args_t *r, unsigned long long *w)
{
    const gsc_coll_args_t *a = &r->c;
    volatile unsigned long long *ctl = (volatile unsigned long long *)a->ctl;
    if (ctl[2] != 0) return 0;
    if (gsc_coll_spin(a, w, 1, true)) return 1;
    const unsigned long long e = ctl[0];
    for (unsigned long long q = 0; q < a->nranks; q++) *(volatile unsigned long long *)((unsigned long long *)a->peer[q] + 2) = e;
    return 0;
}

/* One warp: wait for nflags flags from `flag` on, and clear them. */
#ifdef GSC_COMMON_KERNELS
extern "C" __global__ void gsc_ring_wait(gsc_ring_args_t r)
{
    unsigned long long *f = (unsigned long long *)r.flag;
    for (unsigned long long i = threadIdx.x; i < r.nflags; i += blockDim.x) {
        gsc_ring_await(&r, f + i);
        f[i] = 0;
    }
}
#endif /* GSC_COMMON_KERNELS */

/* out = acc (op) own once the flag is raised (acc arrived); the last block clears the flag.
 * acc is what the ring brought so far (the ranks before this one), own this rank's input: the
 * same order on every rank for a given part, so every rank of an all-reduce gets the same bits. */
template <typename T, int OP> static __device__ void gsc_ring_reduce(const gsc_ring_args_t *r)
{
    __shared__ int ok_s;
    if (threadIdx.x == 0) ok_s = gsc_ring_await(r, (unsigned long long *)r->flag);
    __syncthreads();
    if (ok_s) {
        const uint4 *acc = (const uint4 *)r->acc, *own = (const uint4 *)r->own;
        uint4 *out = (uint4 *)r->out;
        const unsigned long long step = gridDim.x * (unsigned long long)blockDim.x;
        for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < r->n16; i += step) {
            gsc_vec<T> x, y;
            x.v = acc[i];
            y.v = own[i];
#pragma unroll
            for (int j = 0; j < 16 / sizeof(T); j++) x.e[j] = gsc_apply<OP>(x.e[j], y.e[j]);
            if (r->divisor)
#pragma unroll
                for (int j = 0; j < 16 / sizeof(T); j++) x.e[j] = gsc_div(x.e[j], r->divisor);
            out[i] = x.v;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long *done = (unsigned long long *)r->blocks_done;
        __threadfence();
        if (atomicAdd(done, 1ull) == gridDim.x - 1) {
            *done = 0;
            *(volatile unsigned long long *)r->flag = 0;
        }
    }
}

#define GSC_COLL_RING(T, TAG) \
    extern "C" __global__ void __launch_bounds__(GSC_RING_THREADS) gsc_ring_reduce_##TAG##_sum(gsc_ring_args_t a) { gsc_ring_reduce<T, 0>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_RING_THREADS) gsc_ring_reduce_##TAG##_prod(gsc_ring_args_t a) { gsc_ring_reduce<T, 1>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_RING_THREADS) gsc_ring_reduce_##TAG##_max(gsc_ring_args_t a) { gsc_ring_reduce<T, 2>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_RING_THREADS) gsc_ring_reduce_##TAG##_min(gsc_ring_args_t a) { gsc_ring_reduce<T, 3>(&a); }
"#;
