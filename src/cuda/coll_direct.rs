//! The direct collectives' kernel (`GSC_COLL_SM`): SMs read and write the peers' own buffers,
//! mapped into this process (`collectives::peer_buffers`), instead of going through the
//! workspace's areas as the phased and pipelined kernels do. One launch does a whole call:
//! meet every rank, move and reduce, meet again. The host decides which buffers are read and
//! written (`collectives::direct::job`); the kernel only reduces `nsrc` sources, in their
//! order, into `ndst` destinations, 16 bytes a load. The source is appended to `coll`'s (it
//! uses its helpers) and compiled with it.

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
/* own stores before it counted), and waits for every rank's: the kernel ends only once no     */
/* rank reads or writes this rank's buffers any more.                                          */
/*                                                                                              */
/* Flags: block 0's "in" (meet) and "out" (part) words of the phased kernel's layout, holding  */
/* round numbers, which only grow. Every block raises the meet flags (the same value, so the   */
/* stores agree) and waits for them itself: no block depends on another being scheduled.      */
/* After a failed round (ctl[2] != 0) the ranks are out of step: the kernel raises its flags   */
/* for peers that wait, moves nothing and waits for nobody.                                    */
/* ------------------------------------------------------------------------------------------ */
typedef struct {
    gsc_coll_args_t c;
    unsigned long long src[GSC_COLL_MAX_RANKS]; /* reduced in this order */
    unsigned long long dst[GSC_COLL_MAX_RANKS];
    unsigned long long nsrc, ndst;
} gsc_direct_args_t;

/* Raise flag `which` (0 meet, 1 part) for round e at every rank; wait for every rank's unless
 * `wait` is 0. The whole block calls it. 0 on timeout or abort. */
static __device__ int gsc_direct_flags(const gsc_coll_args_t *a, unsigned long long which, unsigned long long e, int wait)
{
    int ok = 1;
    if (threadIdx.x < a->nranks) {
        const unsigned long long q = threadIdx.x;
        unsigned long long *at = (unsigned long long *)a->peer[q] + GSC_FLAGS_WORDS + (which * GSC_COLL_MAX_RANKS + a->rank);
        asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(at), "l"(e) : "memory");
        if (wait) ok = gsc_coll_spin(a, (unsigned long long *)a->ctl + GSC_FLAGS_WORDS + (which * GSC_COLL_MAX_RANKS + q), e, true);
    }
    return __syncthreads_and(ok);
}

template <typename T, int OP, bool AVG> static __device__ void gsc_direct(const gsc_direct_args_t *d)
{
    const gsc_coll_args_t *a = &d->c;
    unsigned long long *ctl = (unsigned long long *)a->ctl;
    const unsigned long long e = gsc_coll_begin(a);
    const int in_step = *(volatile const unsigned long long *)(ctl + 2) == 0;
    int ok = gsc_direct_flags(a, 0, e, in_step) && in_step;
    if (ok) {
        const unsigned long long nv = a->bytes / 16, step = gridDim.x * (unsigned long long)blockDim.x;
        const unsigned long long nsrc = d->nsrc, ndst = d->ndst;
        for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < nv; i += 4 * step) {
            gsc_vec<T> acc[4], x[4];
            /* Four pieces per source in flight: the loads of one source do not wait for each other. */
#pragma unroll
            for (int k = 0; k < 4; k++)
                if (i + k * step < nv) acc[k].v = gsc_ld_cg((const uint4 *)d->src[0] + i + k * step);
            for (unsigned long long s = 1; s < nsrc; s++) {
#pragma unroll
                for (int k = 0; k < 4; k++)
                    if (i + k * step < nv) x[k].v = gsc_ld_cg((const uint4 *)d->src[s] + i + k * step);
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
                    if (i + k * step < nv) ((uint4 *)d->dst[t])[i + k * step] = acc[k].v;
        }
    }
    if (!ok && in_step) ctl[2] = e;
    /* This block's stores (some into peers' memory) before its count; the last block's flags
     * then release them all (cumulativity through the count). */
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        last = atomicAdd(&ctl[1], 1ull) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int waits = *(volatile const unsigned long long *)(ctl + 2) == 0;
    if (!gsc_direct_flags(a, 1, e + 1, waits) && waits && threadIdx.x == 0) ctl[2] = e + 1;
    if (threadIdx.x == 0) {
        ctl[1] = 0;
        *(volatile unsigned long long *)ctl = e + 1;
    }
}

#define GSC_COLL_DIRECT(T, TAG) \
    extern "C" __global__ void __launch_bounds__(GSC_DIRECT_THREADS) gsc_direct_##TAG##_sum(gsc_direct_args_t a) { gsc_direct<T, 0, false>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_DIRECT_THREADS) gsc_direct_##TAG##_prod(gsc_direct_args_t a) { gsc_direct<T, 1, false>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_DIRECT_THREADS) gsc_direct_##TAG##_max(gsc_direct_args_t a) { gsc_direct<T, 2, false>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_DIRECT_THREADS) gsc_direct_##TAG##_min(gsc_direct_args_t a) { gsc_direct<T, 3, false>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_DIRECT_THREADS) gsc_direct_##TAG##_avg(gsc_direct_args_t a) { gsc_direct<T, 0, true>(&a); }
"#;
