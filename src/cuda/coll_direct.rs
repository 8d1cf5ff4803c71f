//! The direct collectives' kernel (`GSC_COLL_SM`): SMs read and write the peers' own buffers,
//! mapped into this process (`collectives::peer_buffers`), instead of going through the
//! workspace's areas as the phased and pipelined kernels do. One launch does a whole call:
//! meet every rank, move and reduce, meet again. The host decides which buffers are read and
//! written (`collectives::direct::job`); the kernel only reduces `nsrc` sources, in their
//! order, into `ndst` destinations, 16 bytes a load (every address at one offset from 16
//! bytes: the elements before and after the 16-byte pieces go one by one). The source is
//! appended to `coll`'s (it uses its helpers) and compiled with it.

use super::coll::{CollArgs, MAX_RANKS};
use super::replay::ArgBlock;

/// `gsc_direct_args_t`.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub(crate) struct DirectArgs {
    /// The workspace, ranks, timeout and abort word (`bytes`: per source and destination).
    pub(crate) coll: CollArgs,
    pub(crate) src: [u64; MAX_RANKS],
    pub(crate) dst: [u64; MAX_RANKS],
    pub(crate) nsrc: u64,
    pub(crate) ndst: u64,
}
impl ArgBlock for DirectArgs {}
// The C struct embeds `gsc_coll_args_t` by value, then 18 words: no padding anywhere.
const _: () = assert!(std::mem::size_of::<DirectArgs>() == std::mem::size_of::<CollArgs>() + 18 * 8);

/// Threads per block of the direct kernel.
pub(crate) const DIRECT_THREADS: u32 = 512;

/// CUDA source of `gsc_direct_<type>_<op>`: needs `coll`'s source (and its #defines) before it.
pub(super) const SOURCE: &str = r#"
/* ------------------------------------------------------------------------------------------ */
/* Direct collectives: every rank's buffers mapped here (peer pointers in src/dst).            */
/*                                                                                              */
/* One launch is two rounds of the communicator. Round e ("meet"): every rank's kernel has     */
/* started, so what preceded it on every rank's stream is done — inputs written, outputs no    */
/* longer read. Then each thread reduces its 16-byte pieces of the nsrc sources, in source     */
/* order (the host lists them in rank order: the same arithmetic as every other kernel), and   */
/* stores the result into each of the ndst destinations. Round e + 1 ("part"): the last block  */
/* of this rank to finish raises its flags after a system-scope fence (every block fenced its  */
/* own stores before it counted) and waits for every rank's: the kernel ends only once no rank */
/* reads or writes this rank's buffers any more.                                               */
/*                                                                                              */
/* Flags: block 0's "in" (meet) and "out" (part) words of the phased kernel's layout, holding  */
/* round numbers, which only grow. Every block raises the meet flags (the same value, so the   */
/* stores agree) and waits for them itself: no block depends on another being scheduled.      */
/*                                                                                              */
/* Failure. A raised part flag says "I no longer touch your buffers", not "I did my share": a */
/* rank whose meet failed (a peer missing past the timeout, or an abort) writes the round into */
/* every rank's error word before its part flags, so a rank that did its share still fails    */
/* the round instead of returning a result with a hole in it. After a failed meet the last     */
/* block waits only for the ranks whose meet flag it saw (alive, maybe still writing here),   */
/* so a dead peer costs one timeout, not two. A rank already out of step (an earlier round    */
/* failed: its error word is set) raises nothing and moves nothing: its peers fail at the meet */
/* rather than touch the buffers of a rank that is not taking part.                            */
/* ------------------------------------------------------------------------------------------ */
typedef struct {
    gsc_coll_args_t c;
    unsigned long long src[GSC_COLL_MAX_RANKS]; /* reduced in this order */
    unsigned long long dst[GSC_COLL_MAX_RANKS];
    unsigned long long nsrc, ndst;
} gsc_direct_args_t;

/* Lanes 0..n-1: raise flag `which` (0 meet, 1 part) for round e at rank `lane`. */
static __device__ __forceinline__ void gsc_direct_raise(const gsc_coll_args_t *a, unsigned long long which, unsigned long long e)
{
    if (threadIdx.x < a->nranks) {
        unsigned long long *at = (unsigned long long *)a->peer[threadIdx.x] + GSC_FLAGS_WORDS + (which * GSC_COLL_MAX_RANKS + a->rank);
        asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(at), "l"(e) : "memory");
    }
}

/* Lanes 0..n-1: wait for rank `lane`'s flag `which` of round e (1; 0 on timeout or abort).
 * Other threads: 1. */
static __device__ __forceinline__ int gsc_direct_wait(const gsc_coll_args_t *a, unsigned long long which, unsigned long long e)
{
    if (threadIdx.x >= a->nranks) return 1;
    return gsc_coll_spin(a, (unsigned long long *)a->ctl + GSC_FLAGS_WORDS + (which * GSC_COLL_MAX_RANKS + threadIdx.x), e, true);
}

template <typename T, int OP, bool AVG> static __device__ void gsc_direct(const gsc_direct_args_t *d)
{
    const gsc_coll_args_t *a = &d->c;
    unsigned long long *ctl = (unsigned long long *)a->ctl;
    const unsigned long long e = gsc_coll_begin(a);
    __shared__ int in_step_s, last_s;
    if (threadIdx.x == 0) in_step_s = *(volatile const unsigned long long *)(ctl + 2) == 0;
    __syncthreads();
    const int in_step = in_step_s;
    int seen = 1; /* lane q: rank q's meet flag arrived */
    if (in_step) {
        gsc_direct_raise(a, 0, e);
        seen = gsc_direct_wait(a, 0, e);
    }
    /* A rank that failed this round may have said so already (it writes our error word). */
    const int ok = __syncthreads_and(seen && in_step && *(volatile const unsigned long long *)(ctl + 2) == 0);
    if (ok) {
        /* Every source and destination lies at one offset from 16 bytes, on whole elements
         * (collectives::direct::common_offset): the `head` bytes before the first 16-byte
         * piece and the `tail` after the last go element by element, one thread each. */
        const unsigned long long to16 = (16 - (d->src[0] & 15)) & 15;
        const unsigned long long head = to16 < a->bytes ? to16 : a->bytes;
        const unsigned long long nv = (a->bytes - head) / 16, tail = a->bytes - head - nv * 16;
        const unsigned long long step = gridDim.x * (unsigned long long)blockDim.x;
        const unsigned long long nsrc = d->nsrc, ndst = d->ndst;
        const unsigned long long g = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
        if (g < (head + tail) / sizeof(T)) {
            const unsigned long long at = g * sizeof(T), off = at < head ? at : nv * 16 + at;
            T acc = gsc_ld_cg_elem<T>((const unsigned char *)d->src[0] + off);
            for (unsigned long long s = 1; s < nsrc; s++) acc = gsc_apply<OP>(acc, gsc_ld_cg_elem<T>((const unsigned char *)d->src[s] + off));
            if (AVG) acc = gsc_div(acc, a->nranks);
            for (unsigned long long t = 0; t < ndst; t++) *(T *)((unsigned char *)d->dst[t] + off) = acc;
        }
        for (unsigned long long i = g; i < nv; i += 4 * step) {
            gsc_vec<T> acc[4], x[4];
            /* Four pieces per source in flight: the loads of one source do not wait for each other. */
#pragma unroll
            for (int k = 0; k < 4; k++)
                if (i + k * step < nv) acc[k].v = gsc_ld_cg((const uint4 *)(d->src[0] + head) + i + k * step);
            for (unsigned long long s = 1; s < nsrc; s++) {
#pragma unroll
                for (int k = 0; k < 4; k++)
                    if (i + k * step < nv) x[k].v = gsc_ld_cg((const uint4 *)(d->src[s] + head) + i + k * step);
#pragma unroll
                for (int k = 0; k < 4; k++)
#pragma unroll
                    for (int j = 0; j < 16 / sizeof(T); j++) acc[k].e[j] = gsc_apply<OP>(acc[k].e[j], x[k].e[j]);
            }
            if (AVG)
#pragma unroll
                for (int k = 0; k < 4; k++)
#pragma unroll
                    for (int j = 0; j < 16 / sizeof(T); j++) acc[k].e[j] = gsc_div(acc[k].e[j], a->nranks);
            for (unsigned long long t = 0; t < ndst; t++)
#pragma unroll
                for (int k = 0; k < 4; k++)
                    if (i + k * step < nv) ((uint4 *)(d->dst[t] + head))[i + k * step] = acc[k].v;
        }
    } else if (in_step && threadIdx.x < a->nranks) {
        /* This round failed here: every rank's error word (ours too) says so, ahead of the
         * part flags (the fence and count below, then the last block's release). */
        *(volatile unsigned long long *)((unsigned long long *)a->peer[threadIdx.x] + 2) = e;
    }
    /* This block's stores (some into peers' memory) before its count; the last block's flags
     * then release them all (cumulativity through the count). */
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        last_s = atomicAdd(&ctl[1], 1ull) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last_s) return;
    __threadfence();
    if (in_step) {
        gsc_direct_raise(a, 1, e + 1);
        /* Wait for every rank that may still touch our buffers: all of them after a meet this
         * block passed; after a failed one, those whose meet flag arrived. */
        const int parted = ok || seen ? gsc_direct_wait(a, 1, e + 1) : 1;
        if (!__syncthreads_and(parted) && threadIdx.x == 0) ctl[2] = e + 1;
    }
    if (threadIdx.x == 0) {
        ctl[1] = 0;
        *(volatile unsigned long long *)ctl = e + 1;
    }
}

#define GSC_COLL_DIRECT(T, TAG) \
    extern "C" __global__ void __launch_bounds__(GSC_DIRECT_THREADS, 2) gsc_direct_##TAG##_sum(gsc_direct_args_t a) { gsc_direct<T, 0, false>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_DIRECT_THREADS, 2) gsc_direct_##TAG##_prod(gsc_direct_args_t a) { gsc_direct<T, 1, false>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_DIRECT_THREADS, 2) gsc_direct_##TAG##_max(gsc_direct_args_t a) { gsc_direct<T, 2, false>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_DIRECT_THREADS, 2) gsc_direct_##TAG##_min(gsc_direct_args_t a) { gsc_direct<T, 3, false>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_DIRECT_THREADS, 2) gsc_direct_##TAG##_avg(gsc_direct_args_t a) { gsc_direct<T, 0, true>(&a); }
"#;
