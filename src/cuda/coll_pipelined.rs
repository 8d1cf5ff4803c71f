//! The pipelined large collectives (`GSC_COLL_LARGE_ALGO=pipelined`): the same data movement
//! as the phased kernel in `coll` (reduce-scatter then all-gather by NVLink writes, block b of
//! every rank owning the same region of every round), but each block's warps split into roles
//! that work on different rounds at once, so the NVLink writes of one round stream while
//! another round waits for its flags or is copied out. The kernel source is appended to
//! `coll`'s (it uses its helpers) and compiled with it; the host side of the geometry (stages,
//! regions, the role split) is `collectives::large`.

/// CUDA source of `gsc_coll_pipe_<type>_<op>`: needs `coll`'s source (and its #defines)
/// before it, and `GSC_PIPE_FLAGS_WORDS`.
pub(super) const SOURCE: &str = r#"
/* ------------------------------------------------------------------------------------------ */
/* Pipelined large all-reduce, reduce-scatter and all-gather.                                  */
/*                                                                                              */
/* Roles. A block's threads are cut, by whole warps, into pushers (threads 0..P-1), reducers   */
/* (P..P+R-1) and copiers (the rest). Each role runs every round of the launch in order, on    */
/* its own, with a named barrier of its own; roles meet only through flags. In round e (stage */
/* s = e % S of the areas):                                                                     */
/*   all-reduce:  pushers write slice q of the block's input region into rank q's IN[s] (at    */
/*                our place), raise IN(e). Reducers wait IN(e) and READY(e) of every rank,    */
/*                reduce our slice from the n copies in our IN[s] (rank order), write the sum   */
/*                into every rank's OUT[s] (at our place), raise OUT(e). Copiers wait OUT(e),  */
/*                copy our OUT[s] into the receive buffer, raise READY(e + S).                  */
/*   reduce-scatter: pushers as above with part q's region; reducers reduce the n copies      */
/*                straight into the receive buffer and raise OUT(e) (= "IN[s] read"). No      */
/*                copiers.                                                                      */
/*   all-gather:  pushers wait READY(e) of every rank, write the block's region into every    */
/*                rank's OUT[s] (at our place), raise OUT(e). Copiers wait OUT(e), copy the n   */
/*                regions out, raise READY(e + S). No reducers.                                 */
/* So pushers run up to S rounds ahead of the reducers and copiers, and while one role waits  */
/* for a flag the others keep NVLink busy. Every flag is one word per (block, kind, source     */
/* rank) in the receiver's workspace, holding the last round its source raised: rounds only   */
/* grow (a counter in the workspace advanced by the kernel, as for every collective), so a     */
/* word is never reset, a wait is "word >= e", and a graph replays any number of times.        */
/* A raise is a release at system scope by lanes 0..n-1 of the role's first warp after the     */
/* role's barrier (cumulative over every store of the role's threads before it); a wait is     */
/* those lanes' acquire polls through gsc_coll_spin_in_step (timeout, abort and error words)  */
/* and the role's barrier, which also carries the verdict to the whole role (bar.red.and) and  */
/* to the other roles (a shared word they read at their next barrier). A launch that finds the */
/* error word set runs no role at all (gsc_coll_out_of_step).                                  */
/*                                                                                              */
/* Why the reuse of a stage is safe (who may write which area when). Write "X(e) at r" for     */
/* "flag X of round e raised by rank r"; areas are per block, and block b of every rank has    */
/* the same geometry (same grid, same sizes), so block b only ever meets block b.              */
/* 1. IN[s] of rank q, written by rank p's pushers for round e + S while q's reducers might     */
/*    still read round e there. p's pushers wait OUT(e) at q first (all-reduce: directly, and  */
/*    through nothing else; reduce-scatter: the same), and q raises OUT(e) after its reducers' */
/*    barrier, after every read of IN[s] for round e. For e + S among the first S rounds of a */
/*    launch (no wait), round e belongs to an earlier launch of this rank, which ended only    */
/*    after it saw OUT of its last round from every rank: all-reduce's copiers and             */
/*    reduce-scatter's pushers wait for it before the kernel ends, so every read of our pushes */
/*    was done.                                                                                 */
/* 2. OUT[s] of rank q, written by rank p's reducers (all-reduce) or pushers (all-gather) for */
/*    round e + S while q's copiers might still read round e there. They wait READY(e + S) at  */
/*    q, which q's copiers raise after the barrier that follows their copy of round e. For the */
/*    first S rounds of a launch q's copiers raise READY(first + S - 1) when the kernel starts, */
/*    after q's previous kernel ended (all its copies done): values of this launch's rounds     */
/*    only, so no word left by an earlier launch satisfies a wait of this one.                 */
/* 3. The receive buffer and the input. Copiers write round e's bytes after OUT(e) of every    */
/*    rank, ours included, which our reducers raised after IN(e) of ours, which our pushers    */
/*    raised after reading round e's input: in place, no round's input is overwritten before   */
/*    it was read. Rounds cover disjoint bytes.                                                 */
/* 4. Flags. Each word has one writer (its source rank's block b, always lanes of the same     */
/*    role). A communicator runs one large algorithm and one grid for its whole life, so the   */
/*    words keep their meaning from launch to launch; a wait is for a round of its own launch, */
/*    which only that launch raises.                                                            */
/* Nothing waits for a flag raised later in the same role's program order, and each role's   */
/* waits are on flags other roles (or ranks) raise for earlier or equal rounds, so the roles   */
/* cannot wait on each other in a cycle: pushers of e wait (at most) copiers or reducers of    */
/* e - S, reducers of e wait pushers of e and copiers of e - S, copiers of e wait reducers or  */
/* pushers of e.                                                                                */
/* ------------------------------------------------------------------------------------------ */

/* The most threads a block may have (the host passes the same bound to its launches): the
 * compiler keeps the registers under 64K / this. */
#ifndef GSC_PIPE_MAX_THREADS
#define GSC_PIPE_MAX_THREADS 512
#endif
#ifndef GSC_PIPE_REDUCE_UNROLL
#define GSC_PIPE_REDUCE_UNROLL 1
#endif

enum { GSC_PIPE_IN = 0, GSC_PIPE_OUT = 1, GSC_PIPE_READY = 2 };

/* Flag `which` of block b from rank `src`, in the workspace at `ws`: 32 words per block. */
static __device__ __forceinline__ unsigned long long *gsc_pipe_flag(unsigned long long ws, unsigned long long b, int which,
                                                                    unsigned long long src)
{
    return (unsigned long long *)ws + GSC_PIPE_FLAGS_WORDS + b * 32 + which * GSC_COLL_MAX_RANKS + src;
}

/* One role of a block: its named barrier, its threads, this thread's index in it. */
struct gsc_role {
    unsigned bar, threads, t;
};

/* The role's barrier: orders its threads' memory accesses before it against those after it. */
static __device__ __forceinline__ void gsc_role_sync(const gsc_role &r)
{
    asm volatile("bar.sync %0, %1;" ::"r"(r.bar), "r"(r.threads) : "memory");
}

/* The role's barrier, returning the AND of every thread's `pred` (the same answer to all). */
static __device__ __forceinline__ int gsc_role_sync_and(const gsc_role &r, int pred)
{
    int all;
    asm volatile("{\n\t.reg .pred p, q;\n\tsetp.ne.s32 p, %1, 0;\n\tbar.red.and.pred q, %2, %3, p;\n\tselp.s32 %0, 1, 0, q;\n\t}"
                 : "=r"(all)
                 : "r"(pred), "r"(r.bar), "r"(r.threads)
                 : "memory");
    return all;
}

/* Lanes 0..n-1 of the role: wait until flag `which` from rank r.t is at least v (acquire). 1
 * on the other threads. */
static __device__ __forceinline__ int gsc_pipe_poll(const gsc_coll_args_t *a, const gsc_role &r, int which, unsigned long long v)
{
    if (r.t >= a->nranks) return 1;
    return gsc_coll_spin_in_step(a, gsc_pipe_flag(a->ctl, blockIdx.x, which, r.t), v, true);
}

/* After the polls: the role's barrier with the verdict. 0 (to every thread of the role) when a
 * poll gave up or another role already failed; then `failed` tells the other roles. */
static __device__ __forceinline__ int gsc_pipe_agree(const gsc_role &r, int ok, volatile int *failed)
{
    ok = gsc_role_sync_and(r, ok && !*failed);
    if (!ok) *failed = 1;
    return ok;
}

/* Lanes 0..n-1 of the role raise flag `which` of this block at every rank to e (a release: call
 * it after the role's barrier that follows the stores it announces). */
static __device__ __forceinline__ void gsc_pipe_raise(const gsc_coll_args_t *a, const gsc_role &r, int which, unsigned long long e)
{
    if (r.t >= a->nranks) return;
    unsigned long long *at = gsc_pipe_flag(a->peer[r.t], blockIdx.x, which, a->rank);
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(at), "l"(e) : "memory");
}

/* Stage s of area `out` (0: in, 1: out) of rank q, at block b's part (`per_block` bytes each). */
static __device__ __forceinline__ unsigned char *gsc_pipe_area(const gsc_coll_args_t *a, unsigned long long q, int out,
                                                               unsigned long long s, unsigned long long per_block)
{
    return (unsigned char *)a->peer[q] + GSC_BIG_OFFSET + ((unsigned long long)out * a->stages + s) * a->stage_bytes + blockIdx.x * per_block;
}

/* Round k's bytes of block b: offset (per part) and length (0 past the end: such a block still
 * takes part in the round, raising and waiting as every block does). */
static __device__ __forceinline__ void gsc_pipe_range(const gsc_coll_args_t *a, unsigned long long k, unsigned long long *off,
                                                      unsigned long long *len)
{
    const unsigned long long region = a->chunk;
    *off = k * region * gridDim.x + blockIdx.x * region;
    *len = *off >= a->bytes ? 0 : a->bytes - *off < region ? a->bytes - *off : region;
}

/* The n copies at in + q * stride (q = 0..n-1), reduced in rank order, of U 16-byte pieces at
 * i + u * step (those below len), loads of all ranks and pieces in flight together. */
template <typename T, int OP, bool AVG, int U>
static __device__ __forceinline__ void gsc_pipe_reduce_vecs(const gsc_coll_args_t *a, const unsigned char *in, unsigned long long stride,
                                                            unsigned long long i, unsigned long long step, unsigned long long len,
                                                            gsc_vec<T> *acc)
{
    const unsigned long long n = a->nranks;
    uint4 x[U][GSC_COLL_MAX_RANKS];
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
        for (int q = 0; q < GSC_COLL_MAX_RANKS; q++)
            if (q < n && i + u * step < len) x[u][q] = gsc_ld_cg(in + q * stride + i + u * step);
#pragma unroll
    for (int u = 0; u < U; u++) {
        acc[u].v = x[u][0];
#pragma unroll
        for (int q = 1; q < GSC_COLL_MAX_RANKS; q++)
            if (q < n) {
                gsc_vec<T> y;
                y.v = x[u][q];
#pragma unroll
                for (int j = 0; j < 16 / sizeof(T); j++) acc[u].e[j] = gsc_apply<OP>(acc[u].e[j], y.e[j]);
            }
        if (AVG)
#pragma unroll
            for (int j = 0; j < 16 / sizeof(T); j++) acc[u].e[j] = gsc_div(acc[u].e[j], n);
    }
}

/* Slices of an all-reduce region: whole 16-byte pieces, one per rank. */
static __device__ __forceinline__ unsigned long long gsc_pipe_slice(unsigned long long len, unsigned long long n)
{
    return (len + 16 * n - 1) / (16 * n) * 16;
}

/* Pushers. Destinations in the order me + 1, me + 2, ..., me: at any moment the ranks write to
 * different ranks (a rotation), not all to rank 0 first. */
template <typename T, int OP, bool NARROW>
static __device__ void gsc_pipe_push(const gsc_coll_args_t *a, const gsc_role &r, unsigned long long e0, volatile int *failed)
{
    const unsigned long long n = a->nranks, me = a->rank, S = a->stages, last = e0 + a->rounds - 1, region = a->chunk;
    const bool rs = a->kind == GSC_REDUCE_SCATTER, ag = a->kind == GSC_ALL_GATHER;
    const unsigned long long per_block = rs || ag ? n * region : region;
    for (unsigned long long k = 0; k < a->rounds; k++) {
        const unsigned long long e = e0 + k, s = e % S;
        int ok = 1;
        if (ag) ok = gsc_pipe_poll(a, r, GSC_PIPE_READY, e);       /* their OUT[s] is free (2.) */
        else if (k >= S) ok = gsc_pipe_poll(a, r, GSC_PIPE_OUT, e - S); /* their IN[s] was read (1.) */
        if (!gsc_pipe_agree(r, ok, failed)) return;
        unsigned long long off, len;
        gsc_pipe_range(a, k, &off, &len);
        const unsigned char *send = (const unsigned char *)a->send + off;
        for (unsigned long long j = 1; j <= n; j++) {
            const unsigned long long q = (me + j) % n;
            if (ag) {
                gsc_big_copy_by<NARROW>(r.t, r.threads, gsc_pipe_area(a, q, 1, s, per_block) + me * region, send, len, false);
            } else if (rs) {
                gsc_big_copy_input_by<T, OP, NARROW>(r.t, r.threads, gsc_pipe_area(a, q, 0, s, per_block) + me * region,
                                                     send + q * a->send_stride, len, a);
            } else {
                const unsigned long long slice = gsc_pipe_slice(len, n), q0 = q * slice, q1 = (q + 1) * slice < len ? (q + 1) * slice : len;
                if (q0 < q1)
                    gsc_big_copy_input_by<T, OP, NARROW>(r.t, r.threads, gsc_pipe_area(a, q, 0, s, per_block) + me * slice, send + q0, q1 - q0, a);
            }
        }
        gsc_role_sync(r);
        gsc_pipe_raise(a, r, ag ? GSC_PIPE_OUT : GSC_PIPE_IN, e);
    }
    /* Reduce-scatter has no copiers to wait for the last OUT: the pushers do (1., next launch). */
    if (rs) gsc_pipe_agree(r, gsc_pipe_poll(a, r, GSC_PIPE_OUT, last), failed);
}

/* Reducers (all-reduce, reduce-scatter): GSC_PIPE_REDUCE_UNROLL 16-byte pieces per thread per
 * step, the n copies of each in flight together. */
template <typename T, int OP, bool AVG, bool NARROW>
static __device__ void gsc_pipe_reduce(const gsc_coll_args_t *a, const gsc_role &r, unsigned long long e0, volatile int *failed)
{
    constexpr int U = GSC_PIPE_REDUCE_UNROLL;
    const unsigned long long n = a->nranks, me = a->rank, S = a->stages, region = a->chunk;
    const bool rs = a->kind == GSC_REDUCE_SCATTER;
    const unsigned long long per_block = rs ? n * region : region, step = r.threads * 16ull;
    for (unsigned long long k = 0; k < a->rounds; k++) {
        const unsigned long long e = e0 + k, s = e % S;
        int ok = gsc_pipe_poll(a, r, GSC_PIPE_IN, e);
        if (!rs && ok) ok = gsc_pipe_poll(a, r, GSC_PIPE_READY, e); /* their OUT[s] is free (2.) */
        if (!gsc_pipe_agree(r, ok, failed)) return;
        unsigned long long off, len;
        gsc_pipe_range(a, k, &off, &len);
        const unsigned char *in = gsc_pipe_area(a, me, 0, s, per_block);
        if (rs && NARROW && gsc_align_of((unsigned long long)a->recv + off | len) < 16) {
            /* The receive buffer or the part off 16 bytes: element by element (the n copies are
             * in our IN[s], on 16 bytes), the same arithmetic. */
            unsigned char *recv = (unsigned char *)a->recv + off;
            for (unsigned long long i = r.t * sizeof(T); i < len; i += r.threads * sizeof(T)) {
                T acc = gsc_ld_cg_elem<T>(in + i);
                for (unsigned long long q = 1; q < n; q++) acc = gsc_apply<OP>(acc, gsc_ld_cg_elem<T>(in + q * region + i));
                gsc_st_elem<T>(recv + i, AVG ? gsc_div(acc, n) : acc);
            }
        } else if (rs) {
            unsigned char *recv = (unsigned char *)a->recv + off;
            for (unsigned long long i = r.t * 16ull; i < len; i += U * step) {
                gsc_vec<T> acc[U];
                gsc_pipe_reduce_vecs<T, OP, AVG, U>(a, in, region, i, step, len, acc);
#pragma unroll
                for (int u = 0; u < U; u++)
                    if (i + u * step < len) *(uint4 *)(recv + i + u * step) = acc[u].v;
            }
        } else {
            const unsigned long long slice = gsc_pipe_slice(len, n);
            const unsigned long long mine = (me + 1) * slice < len ? slice : me * slice < len ? len - me * slice : 0;
            unsigned char *out[GSC_COLL_MAX_RANKS];
#pragma unroll
            for (int j = 0; j < GSC_COLL_MAX_RANKS; j++)
                if (j < n) out[j] = gsc_pipe_area(a, (me + 1 + j) % n, 1, s, per_block) + me * slice;
            for (unsigned long long i = r.t * 16ull; i < mine; i += U * step) {
                gsc_vec<T> acc[U];
                /* Rank q's copy of our slice is at its place in our IN[s]: q * slice. */
                gsc_pipe_reduce_vecs<T, OP, AVG, U>(a, in, slice, i, step, mine, acc);
#pragma unroll
                for (int u = 0; u < U; u++)
                    if (i + u * step < mine)
#pragma unroll
                        for (int j = 0; j < GSC_COLL_MAX_RANKS; j++)
                            if (j < n) *(uint4 *)(out[j] + i + u * step) = acc[u].v;
            }
        }
        gsc_role_sync(r);
        gsc_pipe_raise(a, r, GSC_PIPE_OUT, e);
    }
}

/* Copiers (all-reduce, all-gather): our OUT[s] into the receive buffer. */
template <bool NARROW>
static __device__ void gsc_pipe_copy(const gsc_coll_args_t *a, const gsc_role &r, unsigned long long e0, volatile int *failed)
{
    const unsigned long long n = a->nranks, me = a->rank, S = a->stages, last = e0 + a->rounds - 1, region = a->chunk;
    const bool ag = a->kind == GSC_ALL_GATHER;
    const unsigned long long per_block = ag ? n * region : region;
    /* Our OUT stages are free for the first S rounds: our previous kernel ended (2.). */
    gsc_pipe_raise(a, r, GSC_PIPE_READY, e0 + S - 1 < last ? e0 + S - 1 : last);
    for (unsigned long long k = 0; k < a->rounds; k++) {
        const unsigned long long e = e0 + k, s = e % S;
        if (!gsc_pipe_agree(r, gsc_pipe_poll(a, r, GSC_PIPE_OUT, e), failed)) return;
        unsigned long long off, len;
        gsc_pipe_range(a, k, &off, &len);
        const unsigned char *out = gsc_pipe_area(a, me, 1, s, per_block);
        if (ag) {
            for (unsigned long long q = 0; q < n; q++)
                gsc_big_copy_by<NARROW>(r.t, r.threads, (unsigned char *)a->recv + q * a->recv_stride + off, out + q * region, len, true);
        } else {
            gsc_big_copy_by<NARROW>(r.t, r.threads, (unsigned char *)a->recv + off, out, len, true);
        }
        gsc_role_sync(r);
        if (e + S <= last) gsc_pipe_raise(a, r, GSC_PIPE_READY, e + S);
    }
}

/* NARROW (the gsc_coll_pipen kernels): buffers at any byte or parts off 16 bytes, moved in
 * narrower accesses as the phased kernel's twin does, with the same roles, rounds and flags,
 * so that ranks whose buffers sit differently still meet. */
template <typename T, int OP, bool AVG, bool NARROW> static __device__ void gsc_coll_pipe(const gsc_coll_args_t *a)
{
    __shared__ int failed;
    const unsigned long long e0 = gsc_coll_begin(a);
    const unsigned p = (unsigned)a->push_threads, rd = (unsigned)a->reduce_threads, c = blockDim.x - p - rd;
    /* The host shapes the roles (collectives::large); a shape that would leave a barrier
     * without threads fails the launch's round rather than hang. */
    const bool shaped = blockDim.x % 32 == 0 && p > 0 && p % 32 == 0 && rd % 32 == 0 && p + rd <= blockDim.x && (a->kind == GSC_ALL_GATHER || rd > 0) &&
                        (a->kind == GSC_REDUCE_SCATTER || c > 0) && a->stages >= 2;
    const bool in_step = !gsc_coll_out_of_step(a, e0);
    if (threadIdx.x == 0) failed = !shaped || !in_step;
    __syncthreads();
    if (shaped && in_step) {
        const unsigned t = threadIdx.x;
        if (t < p) {
            gsc_pipe_push<T, OP, NARROW>(a, gsc_role{1, p, t}, e0, &failed);
        } else if (t < p + rd) {
            if (a->kind != GSC_ALL_GATHER) gsc_pipe_reduce<T, OP, AVG, NARROW>(a, gsc_role{2, rd, t - p}, e0, &failed);
        } else if (a->kind != GSC_REDUCE_SCATTER) {
            gsc_pipe_copy<NARROW>(a, gsc_role{3, c, t - p - rd}, e0, &failed);
        }
    }
    __syncthreads();
    gsc_coll_end(a, e0 + a->rounds - 1, !failed);
}

#define GSC_COLL_PIPE(T, TAG) \
    extern "C" __global__ void __launch_bounds__(GSC_PIPE_MAX_THREADS) gsc_coll_pipe_##TAG##_sum(gsc_coll_args_t a) { gsc_coll_pipe<T, 0, false, false>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_PIPE_MAX_THREADS) gsc_coll_pipe_##TAG##_prod(gsc_coll_args_t a) { gsc_coll_pipe<T, 1, false, false>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_PIPE_MAX_THREADS) gsc_coll_pipe_##TAG##_max(gsc_coll_args_t a) { gsc_coll_pipe<T, 2, false, false>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_PIPE_MAX_THREADS) gsc_coll_pipe_##TAG##_min(gsc_coll_args_t a) { gsc_coll_pipe<T, 3, false, false>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_PIPE_MAX_THREADS) gsc_coll_pipe_##TAG##_avg(gsc_coll_args_t a) { gsc_coll_pipe<T, 0, true, false>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_PIPE_MAX_THREADS) gsc_coll_pipe_##TAG##_premul(gsc_coll_args_t a) { gsc_coll_pipe<T, 4, false, false>(&a); }
#define GSC_COLL_PIPEN(T, TAG) \
    extern "C" __global__ void __launch_bounds__(GSC_PIPE_MAX_THREADS) gsc_coll_pipen_##TAG##_sum(gsc_coll_args_t a) { gsc_coll_pipe<T, 0, false, true>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_PIPE_MAX_THREADS) gsc_coll_pipen_##TAG##_prod(gsc_coll_args_t a) { gsc_coll_pipe<T, 1, false, true>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_PIPE_MAX_THREADS) gsc_coll_pipen_##TAG##_max(gsc_coll_args_t a) { gsc_coll_pipe<T, 2, false, true>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_PIPE_MAX_THREADS) gsc_coll_pipen_##TAG##_min(gsc_coll_args_t a) { gsc_coll_pipe<T, 3, false, true>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_PIPE_MAX_THREADS) gsc_coll_pipen_##TAG##_avg(gsc_coll_args_t a) { gsc_coll_pipe<T, 0, true, true>(&a); } \
    extern "C" __global__ void __launch_bounds__(GSC_PIPE_MAX_THREADS) gsc_coll_pipen_##TAG##_premul(gsc_coll_args_t a) { gsc_coll_pipe<T, 4, false, true>(&a); }
"#;
