/*
 * gsc_device.cuh: the device side of gscomm's kernel-triggered conditions. Header-only CUDA.
 *
 * An operation armed on a GSC_CONDITION_CATEGORY_KERNEL_TRIGGERED condition returns the device
 * address of a gsc_device_handle_t (gsc_condition_out_t.device_handle). A kernel starts the
 * operation with gsc_trigger(h) and may wait for its completion with gsc_wait(h). Each trigger
 * performs the operation once more, so a kernel may trigger in a loop or every time it runs.
 *
 * Both calls are made by ONE thread (e.g. threadIdx.x == 0 of one block), after the data the
 * operation sends has been written (use __syncthreads() or a grid-wide barrier first).
 * The words only grow (64-bit epochs), so nothing is ever reset between uses or graph replays.
 *
 * gscomm compiles this same file with NVRTC for its own graph and stream-capture nodes.
 */
#ifndef GSC_DEVICE_CUH
#define GSC_DEVICE_CUH

typedef struct gsc_device_handle {
    unsigned long long *trigger; /* written by the device: the last epoch triggered */
    unsigned long long *done;    /* written by gscomm: the last epoch completed (bit 63: failed) */
    unsigned long long epoch;    /* the device's own count of triggers */
} gsc_device_handle_t;

/* Set in *done when an operation failed: every wait is released (see gsc_condition_query). */
#define GSC_DEVICE_DONE_ERROR_BIT (1ULL << 63)

/* Start the operation once more. Returns the epoch to pass to gsc_wait_epoch(). */
static __device__ __forceinline__ unsigned long long gsc_trigger(gsc_device_handle_t *h)
{
    volatile unsigned long long *ep = &h->epoch;
    unsigned long long e = *ep + 1;
    *ep = e;
    /* A release at system scope: everything this thread wrote before (and, after a barrier, its
     * block: release is cumulative) is visible to the host and to peers before the trigger is.
     * One fence, not a __threadfence_system() plus the release: each waits for the writes still
     * in flight over PCIe, about a microsecond. */
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(h->trigger), "l"(e) : "memory");
    return e;
}

/* Wait until the operation of trigger `epoch` (and every earlier one) completed. Returns the
 * done word seen (bit 63: an operation failed). */
static __device__ __forceinline__ unsigned long long gsc_wait_epoch(const gsc_device_handle_t *h, unsigned long long epoch)
{
    unsigned long long d;
    do {
        asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(d) : "l"(h->done) : "memory");
    } while (d < epoch);
    return d;
}

/* Wait until the last triggered operation completed. Returns 0, or -1 if an operation failed. */
static __device__ __forceinline__ int gsc_wait(gsc_device_handle_t *h)
{
    unsigned long long e = *(volatile unsigned long long *)&h->epoch;
    return (gsc_wait_epoch(h, e) & GSC_DEVICE_DONE_ERROR_BIT) ? -1 : 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Prepared transfers whose rounds run on the GPU (GSC_PREPARE_FLAG_GPU_ROUNDS), partitioned:  */
/* partitions sent and observed from kernels (MPI_Pready / MPI_Parrived on the device).        */
/* ------------------------------------------------------------------------------------------ */

/* Control block words (see gscomm's src/cuda/prep_ctl.rs): round, error, peer-written words. */
#define GSC_CTL_ROUND 0
#define GSC_CTL_ERROR 1
#define GSC_CTL_DONE 2
#define GSC_CTL_PEER 16

/* What gsc_prepared_device_handle() gives a kernel, in GPU memory. */
typedef struct gsc_prepared_device {
    unsigned long long *ctl;    /* this side's control block */
    unsigned long long *remote; /* send: the receiver's arrival words, one per partition (mapped);
                                   receive: the sender's ready word (mapped) */
    const unsigned char *src;   /* send: the buffer; receive: the staging area, or NULL */
    unsigned char *dst;         /* send: where it goes at the receiver (mapped); receive: the buffer */
    unsigned long long part_len; /* send: bytes per partition; receive: bytes copied out of staging */
    unsigned long long parts, timeout_ns;
    unsigned long long ll;      /* small staged rounds: the data travels as LL words (below) into
                                   two slots of this many 8-byte words, round e into slot e % 2;
                                   0: not LL */
} gsc_prepared_device_t;

static __device__ __forceinline__ unsigned long long gsc_globaltimer()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* Wait until *w >= v (system scope); 0 if timeout_ns passed first. `acquire`: the loads are
 * acquire loads, for words that order data this thread reads after them; otherwise relaxed
 * (no L1 invalidation: the reads after stay cached). (Relaxed loads with one fence after the
 * one that saw the value measured slower than acquire loads: 8 B per exchange 5.2 -> 6.3 us on
 * 2 x H200.) */
static __device__ __forceinline__ int gsc_spin_geq_as(unsigned long long *w, unsigned long long v, unsigned long long timeout_ns,
                                                      bool acquire)
{
    unsigned long long t0 = gsc_globaltimer();
    for (;;) {
        unsigned long long x;
        if (acquire)
            asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(x) : "l"(w) : "memory");
        else
            asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(x) : "l"(w) : "memory");
        if (x >= v) return 1;
        if (gsc_globaltimer() - t0 > timeout_ns) return 0;
    }
}

static __device__ __forceinline__ int gsc_spin_geq(unsigned long long *w, unsigned long long v, unsigned long long timeout_ns)
{
    return gsc_spin_geq_as(w, v, timeout_ns, true);
}

/* LL words (as NCCL's LL protocol): 8 bytes = 4 data bytes + a 4-byte flag, each stored at once,
 * so the receiver knows a word arrived when its flag is this round's: no release fence before a
 * separate flag, no arrival word. The flag of round e is 1 + e % (2^32 - 1), never 0 (a fresh
 * staging area is zero), and differs from the previous round's. */
static __device__ __forceinline__ unsigned gsc_ll_flag(unsigned long long e)
{
    return 1u + (unsigned)(e % 0xFFFFFFFFull);
}

/* A prepared transfer's LL staging area has two slots of `slot_words` words: round e goes into
 * slot e % 2, so the sender may write round e once the receiver has consumed round e - 2 (it
 * said "ready for e - 1"): the readiness of a round is announced a whole round ahead and never
 * waited for in a steady exchange. Returns the word offset of round e's slot. */
static __device__ __forceinline__ unsigned long long gsc_ll_slot(unsigned long long e, unsigned long long slot_words)
{
    return (e & 1) * slot_words;
}

/* The 4 data bytes of LL word w of the n bytes at s (zero-padded past n). */
static __device__ __forceinline__ unsigned gsc_ll_data(const unsigned char *s, unsigned long long n, unsigned long long w)
{
    if (w * 4 >= n) return 0;
    if (w * 4 + 4 <= n && (((unsigned long long)s & 3) == 0)) return ((const unsigned *)s)[w];
    unsigned data = 0;
    for (unsigned k = 0; k < 4 && w * 4 + k < n; k++) data |= (unsigned)s[w * 4 + k] << (8 * k);
    return data;
}

/* Block: write n bytes of s as LL words at t (n rounded up to 4; the tail padded with zeros).
 * `first`: this thread's first word's data, gsc_ll_data(s, n, threadIdx.x), loaded by the caller
 * before it waited for the receiver, so that load overlaps the wait. */
static __device__ void gsc_ll_write(unsigned long long *t, const unsigned char *s, unsigned long long n, unsigned long long e,
                                    unsigned first)
{
    unsigned long long flag = (unsigned long long)gsc_ll_flag(e) << 32;
    for (unsigned long long w = threadIdx.x; w < (n + 3) / 4; w += blockDim.x) {
        unsigned data = w == threadIdx.x ? first : gsc_ll_data(s, n, w);
        asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(t + w), "l"(flag | data) : "memory");
    }
}

/* Thread 0 of a block sending an LL round: begin round e = ctl[GSC_CTL_ROUND] + 1 and wait
 * until the receiver has consumed round e - 2 (its ready word, ctl[GSC_CTL_PEER], >= e - 1: see
 * gsc_ll_slot). The round and the ready word are loaded together, and the ready word relaxed:
 * it orders only the receiver's reads of the slot before our stores into it, and no store is
 * performed before the loop that decides it. Returns e, or 0 on timeout (recorded as failed). */
static __device__ __forceinline__ unsigned long long gsc_ll_send_begin(unsigned long long *ctl, unsigned long long timeout_ns)
{
    unsigned long long round = *(volatile unsigned long long *)&ctl[GSC_CTL_ROUND], ready;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(ready) : "l"(&ctl[GSC_CTL_PEER]) : "memory");
    unsigned long long e = round + 1;
    ctl[GSC_CTL_ROUND] = e;
    if (ready + 1 < e && !gsc_spin_geq_as(&ctl[GSC_CTL_PEER], e - 1, timeout_ns, false)) {
        ctl[GSC_CTL_ERROR] = e;
        return 0;
    }
    return e;
}

/* Block: wait until every LL word at s for n bytes carries round e's flag and unpack them into
 * t. 1, or 0 on timeout (checked by each thread for its words; the block agrees on the result). */
static __device__ int gsc_ll_read(unsigned char *t, const unsigned long long *s, unsigned long long n, unsigned long long e,
                                  unsigned long long timeout_ns)
{
    __shared__ int gsc_ll_ok;
    unsigned flag = gsc_ll_flag(e);
    int ok = 1;
    if (threadIdx.x == 0) gsc_ll_ok = 1;
    __syncthreads();
    unsigned long long t0 = gsc_globaltimer();
    for (unsigned long long w = threadIdx.x; ok && w < (n + 3) / 4; w += blockDim.x) {
        unsigned long long v;
        for (;;) {
            asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(s + w) : "memory");
            if ((unsigned)(v >> 32) == flag) break;
            if (gsc_globaltimer() - t0 > timeout_ns) { ok = 0; break; }
        }
        if (!ok) break;
        for (unsigned k = 0; k < 4 && w * 4 + k < n; k++) t[w * 4 + k] = (unsigned char)(v >> (8 * k));
    }
    if (!ok) gsc_ll_ok = 0;
    __syncthreads();
    return gsc_ll_ok;
}

/* Copy n bytes with the block's threads (16 bytes at a time when both sides allow it). */
static __device__ __forceinline__ void gsc_block_copy(unsigned char *t, const unsigned char *s, unsigned long long n)
{
    if ((((unsigned long long)s | (unsigned long long)t) & 15) == 0) {
        for (unsigned long long i = threadIdx.x; i < n / 16; i += blockDim.x) ((uint4 *)t)[i] = ((const uint4 *)s)[i];
        for (unsigned long long i = n / 16 * 16 + threadIdx.x; i < n; i += blockDim.x) t[i] = s[i];
    } else {
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) t[i] = s[i];
    }
}

static __device__ __forceinline__ void gsc_store_release(unsigned long long *w, unsigned long long v)
{
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(w), "l"(v) : "memory");
}

/* "The staging area is free": a receive's readiness after it copied a round out of its staging
 * area. Only our reads of that area must come before the sender's next writes, and they have
 * completed (their values were stored into the buffer before the barrier that precedes this), so
 * no release fence: a release here would wait for every store this thread still has in flight to
 * be acknowledged, i.e. a whole NVLink round trip behind the data this side just sent. (NCCL's LL
 * protocol posts its receive head the same way.) */
static __device__ __forceinline__ void gsc_store_free(unsigned long long *w, unsigned long long v)
{
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(w), "l"(v) : "memory");
}

/* Send partition `part` of the send round in progress (started with gsc_prepared_start on the
 * kernel's stream): wait until the receiver is ready, copy the partition into its buffer over
 * NVLink, raise the partition's arrival word. Called by EVERY thread of ONE block, after the
 * partition's data was written (a __syncthreads() or grid barrier first if other threads wrote
 * it). Partitions may be readied in any order, by any blocks. Returns 0, or -1 when the receiver
 * did not become ready within the timeout (the round is recorded as failed), when `part` is out
 * of range, or when no round was started. If the receiving side starts its round in a condition
 * group together with a send of its own whose partitions its kernels ready, start that receive
 * without a stream wait (GSC_OP_ATTR_FLAG_NO_STREAM_WAIT): its wait would otherwise come before
 * those kernels. */
static __device__ int gsc_pready(const gsc_prepared_device_t *d, unsigned long long part)
{
    __shared__ unsigned long long gsc_e;
    __shared__ int gsc_ok;
    if (part >= d->parts) return -1;
    __syncthreads();
    if (threadIdx.x == 0) {
        gsc_e = *(volatile unsigned long long *)&d->ctl[GSC_CTL_ROUND];
        /* Round 0: no round was started (gsc_prepared_start on the kernel's stream comes first). */
        gsc_ok = gsc_e != 0 && gsc_spin_geq(&d->ctl[GSC_CTL_PEER], gsc_e, d->timeout_ns);
        if (!gsc_ok && gsc_e != 0) d->ctl[GSC_CTL_ERROR] = gsc_e;
    }
    __syncthreads();
    if (!gsc_ok) return -1;
    gsc_block_copy(d->dst + part * d->part_len, d->src + part * d->part_len, d->part_len);
    __syncthreads();
    /* Release is cumulative: the block's stores (ordered by the barrier) reach the receiver first. */
    if (threadIdx.x == 0) gsc_store_release(&d->remote[part], gsc_e);
    return 0;
}

/* Whether partition `part` of the receive round in progress has arrived (any thread; the
 * partition's bytes are then readable). */
static __device__ __forceinline__ int gsc_parrived(const gsc_prepared_device_t *d, unsigned long long part)
{
    if (part >= d->parts) return 0;
    unsigned long long e = *(volatile unsigned long long *)&d->ctl[GSC_CTL_ROUND], x;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(x) : "l"(&d->ctl[GSC_CTL_PEER + part]) : "memory");
    return x >= e;
}

/* Whole rounds from a user kernel (a persistent transfer with GPU rounds, or a partitioned one
 * taken whole), for kernels that loop over exchanges with no launch per round. Each is called
 * by EVERY thread of ONE block; the receive descriptor is the receiving side's, the send's the
 * sending side's (each side's gsc_prepared_device_handle). Per round: gsc_prep_ready on the
 * receive, gsc_prep_send on the send (after the block wrote the data), gsc_prep_wait on the
 * receive; a stream-started round of the same transfer must not run at the same time. */

/* Begin a receive round and tell the sender this side is ready. */
static __device__ void gsc_prep_ready(const gsc_prepared_device_t *d)
{
    __syncthreads();
    if (threadIdx.x == 0) {
        if (d->ll) {
            /* LL (two slots): the sender needs no readiness for round 1 and hears of later
             * rounds from the previous gsc_prep_wait: only count the round (no load). */
            atomicAdd(&d->ctl[GSC_CTL_ROUND], 1ULL);
        } else {
            unsigned long long e = *(volatile unsigned long long *)&d->ctl[GSC_CTL_ROUND] + 1;
            d->ctl[GSC_CTL_ROUND] = e;
            /* A staged receive's previous gsc_prep_wait already announced this round. */
            if (!d->src || e == 1) gsc_store_release(d->remote, e);
        }
    }
    __syncthreads();
}

/* Begin a send round and send every partition. 0, or -1 (see gsc_pready). */
static __device__ int gsc_prep_send(const gsc_prepared_device_t *d)
{
    __shared__ unsigned long long gsc_e;
    __syncthreads();
    if (d->ll) {
        /* A small staged round: LL words into the receiver's staging area, nothing else. Each
         * thread loads its data while thread 0 checks the receiver (one wait, not two). */
        unsigned first = gsc_ll_data(d->src, d->part_len, threadIdx.x);
        if (threadIdx.x == 0) gsc_e = gsc_ll_send_begin(d->ctl, d->timeout_ns);
        __syncthreads();
        unsigned long long e = gsc_e;
        if (!e) return -1;
        gsc_ll_write((unsigned long long *)d->dst + gsc_ll_slot(e, d->ll), d->src, d->part_len, e, first);
        return 0;
    }
    if (threadIdx.x == 0) {
        gsc_e = *(volatile unsigned long long *)&d->ctl[GSC_CTL_ROUND] + 1;
        d->ctl[GSC_CTL_ROUND] = gsc_e;
    }
    __syncthreads();
    int rc = 0;
    for (unsigned long long p = 0; p < d->parts; p++) rc |= gsc_pready(d, p);
    return rc;
}

/* Wait until the receive round begun last arrived, and make it readable in the buffer (from
 * the staging area, when the sender writes there: `src` of a receive descriptor). 0, or -1
 * when it did not arrive within the timeout (recorded as failed). */
static __device__ int gsc_prep_wait(const gsc_prepared_device_t *d)
{
    __shared__ int gsc_ok;
    __syncthreads(); /* gsc_prep_ready (thread 0) advanced the round */
    unsigned long long gsc_e = *(volatile unsigned long long *)&d->ctl[GSC_CTL_ROUND];
    if (d->ll) {
        /* gsc_ll_read ends with a barrier: every thread's reads of the slot are done. */
        if (!gsc_ll_read(d->dst, (const unsigned long long *)d->src + gsc_ll_slot(gsc_e, d->ll), d->part_len, gsc_e,
                         d->timeout_ns)) {
            if (threadIdx.x == 0) d->ctl[GSC_CTL_ERROR] = gsc_e;
            return -1;
        }
        if (threadIdx.x == 0) gsc_store_free(d->remote, gsc_e + 1);
        return 0;
    }
    if (threadIdx.x == 0) {
        gsc_ok = 1;
        for (unsigned long long p = 0; gsc_ok && p < d->parts; p++)
            gsc_ok = gsc_spin_geq(&d->ctl[GSC_CTL_PEER + p], gsc_e, d->timeout_ns);
        if (!gsc_ok) d->ctl[GSC_CTL_ERROR] = gsc_e;
    }
    __syncthreads();
    if (!gsc_ok) return -1;
    if (d->src) {
        gsc_block_copy(d->dst, d->src, d->part_len);
        __syncthreads();
        /* The staging area is free: the sender may write the next round already. */
        if (threadIdx.x == 0) gsc_store_free(d->remote, gsc_e + 1);
    }
    __syncthreads();
    return 0;
}

#endif /* GSC_DEVICE_CUH */
