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

struct gsc_prepared_device;
struct gsc_coll_device;

typedef struct gsc_device_handle {
    unsigned long long *trigger; /* written by the device: the last epoch triggered */
    unsigned long long *done;    /* written by gscomm: the last epoch completed (bit 63: failed) */
    unsigned long long epoch;    /* the device's own count of triggers */
    /* A prepared transfer whose rounds run on the GPU (started on a kernel-triggered
     * condition): its side's descriptor, and gsc_trigger / gsc_wait run its rounds in the
     * calling thread (see gsc_prep_trigger below); NULL for operations the proxy performs. */
    const struct gsc_prepared_device *prep;
    unsigned long long prep_recv; /* 1: prep is a receive */
    unsigned long long reserved;  /* gscomm's (a prepared transfer's done word) */
    /* A small collective run by the calling thread itself (gsc_coll_trigger below); NULL for
     * one gscomm launches on each trigger. */
    struct gsc_coll_device *coll;
} gsc_device_handle_t;

/* Set in *done when an operation failed: every wait is released (see gsc_condition_query). */
#define GSC_DEVICE_DONE_ERROR_BIT (1ULL << 63)

static __device__ unsigned long long gsc_prep_trigger(gsc_device_handle_t *h);
static __device__ void gsc_prep_trigger_wait(gsc_device_handle_t *h);
static __device__ unsigned long long gsc_coll_trigger(gsc_device_handle_t *h);
static __device__ unsigned long long gsc_coll_trigger_wait(gsc_device_handle_t *h);

/* Start the operation once more. Returns the epoch to pass to gsc_wait_epoch(). */
static __device__ __forceinline__ unsigned long long gsc_trigger(gsc_device_handle_t *h)
{
    if (h->coll) return gsc_coll_trigger(h);
    if (h->prep) return gsc_prep_trigger(h);
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
static __device__ __forceinline__ unsigned long long gsc_wait_epoch(gsc_device_handle_t *h, unsigned long long epoch)
{
    unsigned long long d;
    if (h->coll) return gsc_coll_trigger_wait(h); /* the collective's round ends here */
    if (h->prep && h->prep_recv) gsc_prep_trigger_wait(h); /* the receive's round ends here */
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

/* How long a waiting thread goes between looks at an abort word. The word is page-locked host
 * memory, so each look is a read across PCIe; with thousands of threads waiting (a one-shot
 * collective polls from every thread) and looking every few polls, the reads queue up, a thread
 * sees its flag late, its peer then waits on it in turn, and two ranks can settle into a state
 * where every call costs 100-300 us more (docs/PERF.md, session 19). NCCL looks every 10000
 * spins. Abort then releases a wait within about this long, far below any timeout. */
#define GSC_ABORT_LOOK_NS 1000000ull

/* Wait until *w >= v (system scope): 1, or 0 if timeout_ns passed first or, with a `stop0` or
 * `stop1` word, once either is non-zero (looked at every GSC_ABORT_LOOK_NS of waiting, above:
 * an abort word, or a collective workspace's error word).
 * `acquire`: the loads are acquire loads, for words that order data this thread reads after
 * them; otherwise relaxed (no L1 invalidation: the reads after stay cached).
 * (Relaxed loads with one fence after the one that saw the value measured slower than acquire
 * loads: 8 B per exchange 5.2 -> 6.3 us on 2 x H200.) */
static __device__ __forceinline__ int gsc_spin_geq_or_stop(unsigned long long *w, unsigned long long v,
                                                           unsigned long long timeout_ns, bool acquire,
                                                           const volatile unsigned long long *stop0,
                                                           const volatile unsigned long long *stop1)
{
    const unsigned long long t0 = gsc_globaltimer();
    unsigned long long look = t0 + GSC_ABORT_LOOK_NS;
    for (;;) {
        unsigned long long x;
        if (acquire)
            asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(x) : "l"(w) : "memory");
        else
            asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(x) : "l"(w) : "memory");
        if (x >= v) return 1;
        const unsigned long long now = gsc_globaltimer();
        if (now - t0 > timeout_ns) return 0;
        if ((stop0 || stop1) && now >= look) {
            if ((stop0 && *stop0 != 0) || (stop1 && *stop1 != 0)) return 0;
            look = now + GSC_ABORT_LOOK_NS;
        }
    }
}

/* Without a word to stop on. */
static __device__ __forceinline__ int gsc_spin_geq_as(unsigned long long *w, unsigned long long v, unsigned long long timeout_ns,
                                                      bool acquire)
{
    return gsc_spin_geq_or_stop(w, v, timeout_ns, acquire, 0, 0);
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

/* Write n bytes of s as LL words at t (n rounded up to 4; the tail padded with zeros): the
 * words lane, lane + lanes, ... of them. `first`: word `lane`'s data, gsc_ll_data(s, n, lane),
 * loaded by the caller before it waited for the receiver, so that load overlaps the wait. */
static __device__ void gsc_ll_write_lanes(unsigned long long *t, const unsigned char *s, unsigned long long n, unsigned long long e,
                                          unsigned first, unsigned long long lane, unsigned long long lanes)
{
    /* One word per turn: loading four per turn (their loads in flight together) measured
     * 0.17 us slower per 8-byte kernel ping-pong one way on 2 x H200 (2026-11-22). */
    unsigned long long flag = (unsigned long long)gsc_ll_flag(e) << 32;
    for (unsigned long long w = lane; w < (n + 3) / 4; w += lanes) {
        unsigned data = w == lane ? first : gsc_ll_data(s, n, w);
        asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(t + w), "l"(flag | data) : "memory");
    }
}

/* Block: the same with the block's threads. */
static __device__ void gsc_ll_write(unsigned long long *t, const unsigned char *s, unsigned long long n, unsigned long long e,
                                    unsigned first)
{
    gsc_ll_write_lanes(t, s, n, e, first, threadIdx.x, blockDim.x);
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

/* Wait until each of the LL words lane, lane + lanes, ... at s (for n bytes) carries round e's
 * flag and unpack them into t. 1, or 0 on timeout. */
static __device__ int gsc_ll_read_lanes(unsigned char *t, const unsigned long long *s, unsigned long long n, unsigned long long e,
                                        unsigned long long timeout_ns, unsigned long long lane, unsigned long long lanes)
{
    unsigned flag = gsc_ll_flag(e);
    unsigned long long t0 = gsc_globaltimer();
    for (unsigned long long w = lane; w < (n + 3) / 4; w += lanes) {
        unsigned long long v;
        for (;;) {
            asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(s + w) : "memory");
            if ((unsigned)(v >> 32) == flag) break;
            if (gsc_globaltimer() - t0 > timeout_ns) return 0;
        }
        for (unsigned k = 0; k < 4 && w * 4 + k < n; k++) t[w * 4 + k] = (unsigned char)(v >> (8 * k));
    }
    return 1;
}

/* Block: the whole LL read, ending with one barrier that also agrees on the result (every
 * thread's reads of the slot are done when it returns). 1, or 0 on timeout. */
static __device__ int gsc_ll_read(unsigned char *t, const unsigned long long *s, unsigned long long n, unsigned long long e,
                                  unsigned long long timeout_ns)
{
    return __syncthreads_and(gsc_ll_read_lanes(t, s, n, e, timeout_ns, threadIdx.x, blockDim.x));
}

/* Copy n bytes, lane `lane` of `lanes` (16 bytes at a time when both sides allow it). */
static __device__ __forceinline__ void gsc_copy_lanes(unsigned char *t, const unsigned char *s, unsigned long long n,
                                                      unsigned long long lane, unsigned long long lanes)
{
    if ((((unsigned long long)s | (unsigned long long)t) & 15) == 0) {
        const uint4 *s4 = (const uint4 *)s;
        uint4 *t4 = (uint4 *)t;
        unsigned long long n16 = n / 16, i = lane;
        /* Eight loads in flight before their stores: a lane (one thread alone, above all)
         * would otherwise wait out every load. */
        for (; i + 7 * lanes < n16; i += 8 * lanes) {
            uint4 v[8];
#pragma unroll
            for (int k = 0; k < 8; k++) v[k] = s4[i + k * lanes];
#pragma unroll
            for (int k = 0; k < 8; k++) t4[i + k * lanes] = v[k];
        }
        for (; i < n16; i += lanes) t4[i] = s4[i];
        for (unsigned long long j = n16 * 16 + lane; j < n; j += lanes) t[j] = s[j];
    } else {
        for (unsigned long long i = lane; i < n; i += lanes) t[i] = s[i];
    }
}

/* Copy n bytes with the block's threads. */
static __device__ __forceinline__ void gsc_block_copy(unsigned char *t, const unsigned char *s, unsigned long long n)
{
    gsc_copy_lanes(t, s, n, threadIdx.x, blockDim.x);
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

/* Block: send partition `part` of round e: wait until the receiver is ready for round e
 * (thread 0; `seen`: its ready word as thread 0 last loaded it, kept by the caller, so a
 * receiver known to be ready costs no load), copy the partition into its buffer over NVLink,
 * raise the partition's arrival word. 0, or -1 on timeout (recorded as failed). */
static __device__ int gsc_put_part(const gsc_prepared_device_t *d, unsigned long long part, unsigned long long e,
                                   unsigned long long *seen)
{
    int ok = 1;
    if (threadIdx.x == 0 && *seen < e) {
        ok = gsc_spin_geq(&d->ctl[GSC_CTL_PEER], e, d->timeout_ns);
        if (ok) *seen = e;
        else d->ctl[GSC_CTL_ERROR] = e;
    }
    if (!__syncthreads_and(ok)) return -1;
    gsc_block_copy(d->dst + part * d->part_len, d->src + part * d->part_len, d->part_len);
    __syncthreads();
    /* Release is cumulative: the block's stores (ordered by the barrier) reach the receiver first. */
    if (threadIdx.x == 0) gsc_store_release(&d->remote[part], e);
    return 0;
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
    if (part >= d->parts) return -1;
    /* Round 0: no round was started (gsc_prepared_start on the kernel's stream comes first). */
    unsigned long long e = *(volatile unsigned long long *)&d->ctl[GSC_CTL_ROUND], seen = 0;
    if (!__syncthreads_and(e != 0)) return -1;
    return gsc_put_part(d, part, e, &seen);
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

/* ------------------------------------------------------------------------------------------ */
/* Whole rounds from a user kernel (a persistent transfer with GPU rounds, or a partitioned one */
/* taken whole), for kernels that loop over exchanges with no launch per round.                */
/* ------------------------------------------------------------------------------------------ */

/* A kernel's own view of one prepared transfer's rounds, kept in registers for as long as the
 * kernel drives them: the round count is read from the control block once (gsc_prep_open) and
 * written back once (gsc_prep_close), not loaded, bumped and shared through memory every round,
 * and a send remembers how far the receiver was last seen to be ready, so a receiver known to
 * be ready costs no load. On a ping-pong those loads were the largest cost left over the NVLink
 * flag floor.
 *
 *     gsc_prep_cursor_t tx = gsc_prep_open(send_d), rx = gsc_prep_open(recv_d);
 *     for (...) {
 *         gsc_prep_cursor_ready(&rx);       // this side may be written into
 *         ...write the data to send...
 *         gsc_prep_cursor_send(&tx);        // every partition, into the peer's buffer
 *         gsc_prep_cursor_wait(&rx);        // the peer's data is in our buffer
 *     }
 *     gsc_prep_close(&tx); gsc_prep_close(&rx);
 *
 * Every call is made by EVERY thread of ONE block (each thread keeps its own copy of the
 * cursor, all equal but `seen`). The receive's cursor is opened on the receiving side's
 * descriptor, the send's on the sending side's (each side's gsc_prepared_device_handle). No
 * other round of the same transfer (stream-started, or another cursor) may run between open
 * and close. Each of send and wait returns 0, or -1 in every thread when the peer did not
 * answer within the transfer's timeout (the round is recorded as failed: gsc_prepared_query /
 * Prepared::gpu_error). */
typedef struct gsc_prep_cursor {
    const gsc_prepared_device_t *d;
    unsigned long long round; /* the last round begun */
    unsigned long long seen;  /* send: the receiver's ready word as this thread last loaded it */
} gsc_prep_cursor_t;

static __device__ gsc_prep_cursor_t gsc_prep_open(const gsc_prepared_device_t *d)
{
    __syncthreads(); /* a close just before (thread 0) stored the round */
    gsc_prep_cursor_t c;
    c.d = d;
    c.round = *(volatile unsigned long long *)&d->ctl[GSC_CTL_ROUND];
    c.seen = 0;
    return c;
}

/* Write the round count back: later kernels, stream-started rounds and cursors continue from it. */
static __device__ void gsc_prep_close(gsc_prep_cursor_t *c)
{
    __syncthreads();
    if (threadIdx.x == 0) *(volatile unsigned long long *)&c->d->ctl[GSC_CTL_ROUND] = c->round;
    __syncthreads();
}

/* Begin a receive round and tell the sender this side is ready. */
static __device__ void gsc_prep_cursor_ready(gsc_prep_cursor_t *c)
{
    const gsc_prepared_device_t *d = c->d;
    unsigned long long e = ++c->round;
    /* LL (two slots): the sender needs no readiness for round 1 and hears of later rounds from
     * the previous wait. A staged receive's previous wait announced this round too. Otherwise
     * the block's reads of the buffer (the barrier orders them; the release is cumulative)
     * come before the sender's writes. */
    if (d->ll || (d->src && e != 1)) return;
    __syncthreads();
    if (threadIdx.x == 0) gsc_store_release(d->remote, e);
}

/* Begin a send round and send every partition (after the block wrote the data: the call
 * begins with a barrier). 0, or -1 (see the cursor). */
static __device__ int gsc_prep_cursor_send(gsc_prep_cursor_t *c)
{
    const gsc_prepared_device_t *d = c->d;
    unsigned long long e = ++c->round;
    __syncthreads();
    if (d->ll) {
        /* A small staged round: LL words into slot e % 2 of the receiver's staging area,
         * nothing else. Round e may be written once the receiver consumed round e - 2 (ready
         * word >= e - 1): checked only by the threads that write, each against the value it
         * loaded after its previous round's stores, so a steady exchange loads nothing between
         * the data being ready and its stores. */
        int ok = 1;
        if (threadIdx.x < (d->part_len + 3) / 4) {
            unsigned first = gsc_ll_data(d->src, d->part_len, threadIdx.x);
            if (c->seen + 1 < e) {
                ok = gsc_spin_geq_as(&d->ctl[GSC_CTL_PEER], e - 1, d->timeout_ns, false);
                c->seen = e - 1;
            }
            if (ok) {
                gsc_ll_write((unsigned long long *)d->dst + gsc_ll_slot(e, d->ll), d->src, d->part_len, e, first);
                /* Learn how far the receiver is for the next round now, off this round's path:
                 * nothing waits for this load until then. The word only grows and a later load
                 * of it never sees an older value, so it replaces `seen` without a compare. */
                asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(c->seen) : "l"(&d->ctl[GSC_CTL_PEER]) : "memory");
            } else {
                d->ctl[GSC_CTL_ERROR] = e;
            }
        }
        /* After the stores: the barrier is off the receiver's path. */
        return __syncthreads_and(ok) ? 0 : -1;
    }
    int rc = 0;
    for (unsigned long long p = 0; rc == 0 && p < d->parts; p++) rc = gsc_put_part(d, p, e, &c->seen);
    return rc;
}

/* Wait until the receive round begun last arrived, and make it readable in the buffer (from
 * the staging area, when the sender writes there: `src` of a receive descriptor). 0, or -1
 * (see the cursor). */
static __device__ int gsc_prep_cursor_wait(gsc_prep_cursor_t *c)
{
    const gsc_prepared_device_t *d = c->d;
    unsigned long long e = c->round;
    /* The block's earlier reads of the buffer come before this round's writes into it. */
    __syncthreads();
    if (d->ll) {
        /* One barrier after the data arrived, which also agrees on the result; then the slot of
         * round e - 1 is free: the sender may write round e + 1. */
        if (!gsc_ll_read(d->dst, (const unsigned long long *)d->src + gsc_ll_slot(e, d->ll), d->part_len, e, d->timeout_ns)) {
            if (threadIdx.x == 0) d->ctl[GSC_CTL_ERROR] = e;
            return -1;
        }
        if (threadIdx.x == 0) gsc_store_free(d->remote, e + 1);
        return 0;
    }
    int ok = 1;
    if (threadIdx.x == 0) {
        for (unsigned long long p = 0; ok && p < d->parts; p++) ok = gsc_spin_geq(&d->ctl[GSC_CTL_PEER + p], e, d->timeout_ns);
        if (!ok) d->ctl[GSC_CTL_ERROR] = e;
    }
    if (!__syncthreads_and(ok)) return -1;
    if (d->src) {
        gsc_block_copy(d->dst, d->src, d->part_len);
        __syncthreads();
        /* The staging area is free: the sender may write the next round already. */
        if (threadIdx.x == 0) gsc_store_free(d->remote, e + 1);
        __syncthreads();
    }
    return 0;
}

/* One round at a time, the round count kept in the control block (a cursor opened and closed
 * around each call): for kernels that take part in few rounds, or mix them with stream-started
 * ones. Same rules as the cursor calls. */
static __device__ void gsc_prep_ready(const gsc_prepared_device_t *d)
{
    gsc_prep_cursor_t c = gsc_prep_open(d);
    gsc_prep_cursor_ready(&c);
    gsc_prep_close(&c);
}

static __device__ int gsc_prep_send(const gsc_prepared_device_t *d)
{
    gsc_prep_cursor_t c = gsc_prep_open(d);
    int rc = gsc_prep_cursor_send(&c);
    gsc_prep_close(&c);
    return rc;
}

static __device__ int gsc_prep_wait(const gsc_prepared_device_t *d)
{
    gsc_prep_cursor_t c = gsc_prep_open(d);
    int rc = gsc_prep_cursor_wait(&c);
    gsc_prep_close(&c);
    return rc;
}

/* ------------------------------------------------------------------------------------------ */
/* Prepared transfers with GPU rounds started on a kernel-triggered condition: the handle's     */
/* gsc_trigger and gsc_wait run the rounds themselves, in the ONE calling thread (no proxy).    */
/* A send's gsc_trigger waits until the receiver is ready and copies the data (so it returns    */
/* complete: meant for small messages; a block copies faster with gsc_prep_cursor_send). A      */
/* receive's gsc_trigger announces readiness, and its round ends in the gsc_wait that follows   */
/* (which copies the data in from the staging area): a kernel that triggers a receive waits for */
/* it, at the latest before it triggers that receive again (which then waits first).            */
/* ------------------------------------------------------------------------------------------ */

/* One thread: send round e. 1, or 0 when the receiver was not ready within the timeout. */
static __device__ int gsc_prep_send_round1(const gsc_prepared_device_t *d, unsigned long long e)
{
    if (d->ll) {
        /* Round e goes into slot e % 2: the receiver consumed round e - 2 (gsc_ll_send_begin). */
        if (!gsc_spin_geq_as(&d->ctl[GSC_CTL_PEER], e - 1, d->timeout_ns, false)) return 0;
        gsc_ll_write_lanes((unsigned long long *)d->dst + gsc_ll_slot(e, d->ll), d->src, d->part_len, e,
                           gsc_ll_data(d->src, d->part_len, 0), 0, 1);
        return 1;
    }
    if (!gsc_spin_geq(&d->ctl[GSC_CTL_PEER], e, d->timeout_ns)) return 0;
    for (unsigned long long p = 0; p < d->parts; p++) {
        gsc_copy_lanes(d->dst + p * d->part_len, d->src + p * d->part_len, d->part_len, 0, 1);
        gsc_store_release(&d->remote[p], e);
    }
    return 1;
}

/* One thread: receive round e arrived; copy it out of the staging area. 1, or 0 on timeout. */
static __device__ int gsc_prep_recv_round1(const gsc_prepared_device_t *d, unsigned long long e)
{
    if (d->ll) {
        if (!gsc_ll_read_lanes(d->dst, (const unsigned long long *)d->src + gsc_ll_slot(e, d->ll), d->part_len, e,
                               d->timeout_ns, 0, 1))
            return 0;
    } else {
        for (unsigned long long p = 0; p < d->parts; p++)
            if (!gsc_spin_geq(&d->ctl[GSC_CTL_PEER + p], e, d->timeout_ns)) return 0;
        if (!d->src) return 1; /* written in place */
        gsc_copy_lanes(d->dst, d->src, d->part_len, 0, 1);
    }
    /* The staging area is free for round e + 1. A release (not gsc_store_free's relaxed store):
     * with no barrier after this thread's reads of the area, only the release orders them
     * before the sender's next writes. */
    gsc_store_release(d->remote, e + 1);
    return 1;
}

/* End the receive round triggered last, if it has not ended (gsc_wait calls this). */
static __device__ void gsc_prep_trigger_wait(gsc_device_handle_t *h)
{
    volatile unsigned long long *done = h->done;
    unsigned long long e = *(volatile unsigned long long *)&h->epoch, x = *done;
    if ((x & GSC_DEVICE_DONE_ERROR_BIT) || x >= e) return;
    if (gsc_prep_recv_round1(h->prep, e)) {
        *done = e;
    } else {
        h->prep->ctl[GSC_CTL_ERROR] = e;
        *done = e | GSC_DEVICE_DONE_ERROR_BIT;
    }
}

/* gsc_trigger of a prepared transfer with GPU rounds. After a failed round (the peer did not
 * answer within the timeout) nothing more is done: every wait returns -1. */
static __device__ unsigned long long gsc_prep_trigger(gsc_device_handle_t *h)
{
    const gsc_prepared_device_t *d = h->prep;
    volatile unsigned long long *done = h->done, *ep = &h->epoch;
    if (h->prep_recv) gsc_prep_trigger_wait(h); /* the previous round ends first */
    if (*done & GSC_DEVICE_DONE_ERROR_BIT) return *ep;
    /* The round count is the control block's, shared with rounds started on streams. */
    unsigned long long e = *(volatile unsigned long long *)&d->ctl[GSC_CTL_ROUND] + 1;
    *(volatile unsigned long long *)&d->ctl[GSC_CTL_ROUND] = e;
    *ep = e;
    if (h->prep_recv) {
        /* As gsc_prep_cursor_ready: LL and staged receives announced this round already. */
        if (!d->ll && !(d->src && e != 1)) gsc_store_release(d->remote, e);
        return e; /* `done` stays below e: the round ends in gsc_wait */
    }
    if (gsc_prep_send_round1(d, e)) {
        *done = e;
    } else {
        d->ctl[GSC_CTL_ERROR] = e;
        *done = e | GSC_DEVICE_DONE_ERROR_BIT;
    }
    return e;
}

/* ------------------------------------------------------------------------------------------ */
/* Small collectives run by the triggering thread itself (an all-reduce armed on a kernel-       */
/* triggered condition, up to GSC_COLL_TRIGGER_MAX bytes): no launch, no host. Each rank has a   */
/* mailbox of LL words, two slots per sender; round r goes into slot r % 2 of every peer's       */
/* mailbox. A rank writes round r only after its own round r - 1 ended, which needed every      */
/* peer's round r - 1, which each peer wrote after its round r - 2 ended: so slot r % 2, which  */
/* held round r - 2, has been read everywhere. gsc_trigger writes this rank's input into every  */
/* peer's mailbox; gsc_wait (or the next gsc_trigger) waits for every peer's words, reduces in  */
/* rank order — the arithmetic of gscomm's kernels — into the receive buffer, and advances the  */
/* done word (bit 63 when a peer did not answer within the timeout, or the communicator was    */
/* aborted: the communicator's error word is then set too). One thread, as for every trigger.  */
/* ------------------------------------------------------------------------------------------ */

#define GSC_DEVICE_MAX_RANKS 8

typedef struct gsc_coll_device {
    unsigned long long *box[GSC_DEVICE_MAX_RANKS]; /* every rank's mailbox, as this rank addresses it */
    const unsigned char *send;
    unsigned char *recv;
    unsigned long long bytes;      /* the buffer's bytes */
    unsigned long long words;      /* LL words per slot: (bytes + 3) / 4 */
    unsigned long long dtype, op;  /* gsc_datatype_t (not 16-bit floats), gsc_red_op_t */
    unsigned long long nranks, rank, timeout_ns;
    unsigned long long round;      /* the last round begun: 0 on every rank when armed */
    const volatile unsigned long long *abort; /* the communicator's abort word */
    unsigned long long *error;     /* the communicator's error word */
} gsc_coll_device_t;

/* One 8-byte unit (two LL words: whole elements of any type) of a and b combined with op
 * (0 sum and avg's sum, 1 prod, 2 max, 3 min), element by element, as gscomm's kernels do. */
template <typename T> static __device__ __forceinline__ unsigned long long gsc_coll_op8(unsigned long long a, unsigned long long b, int op)
{
    union { unsigned long long u; T v[8 / sizeof(T)]; } x, y;
    x.u = a;
    y.u = b;
    for (int k = 0; k < (int)(8 / sizeof(T)); k++) {
        T p = x.v[k], q = y.v[k];
        x.v[k] = op == 1 ? (T)(p * q) : op == 2 ? (q > p ? q : p) : op == 3 ? (q < p ? q : p) : (T)(p + q);
    }
    return x.u;
}

/* avg's one division, element by element. */
template <typename T> static __device__ __forceinline__ unsigned long long gsc_coll_div8(unsigned long long a, unsigned long long n)
{
    union { unsigned long long u; T v[8 / sizeof(T)]; } x;
    x.u = a;
    for (int k = 0; k < (int)(8 / sizeof(T)); k++) x.v[k] = (T)(x.v[k] / (T)n);
    return x.u;
}

static __device__ unsigned long long gsc_coll_reduce8(const gsc_coll_device_t *c, unsigned long long a, unsigned long long b)
{
    const int op = c->op == 4 ? 0 : (int)c->op;
    switch (c->dtype) {
    case 0: return gsc_coll_op8<signed char>(a, b, op);
    case 1: return gsc_coll_op8<unsigned char>(a, b, op);
    case 2: return gsc_coll_op8<int>(a, b, op);
    case 3: return gsc_coll_op8<unsigned>(a, b, op);
    case 4: return gsc_coll_op8<long long>(a, b, op);
    case 5: return gsc_coll_op8<unsigned long long>(a, b, op);
    case 7: return gsc_coll_op8<float>(a, b, op);
    default: return gsc_coll_op8<double>(a, b, op);
    }
}

static __device__ unsigned long long gsc_coll_avg8(const gsc_coll_device_t *c, unsigned long long a)
{
    switch (c->dtype) {
    case 0: return gsc_coll_div8<signed char>(a, c->nranks);
    case 1: return gsc_coll_div8<unsigned char>(a, c->nranks);
    case 2: return gsc_coll_div8<int>(a, c->nranks);
    case 3: return gsc_coll_div8<unsigned>(a, c->nranks);
    case 4: return gsc_coll_div8<long long>(a, c->nranks);
    case 5: return gsc_coll_div8<unsigned long long>(a, c->nranks);
    case 7: return gsc_coll_div8<float>(a, c->nranks);
    default: return gsc_coll_div8<double>(a, c->nranks);
    }
}

/* LL word w of sender q's slot for round r in this rank's mailbox, once it arrived: 1, or 0
 * when the timeout passed or the communicator was aborted (looked at every
 * GSC_ABORT_LOOK_NS). */
static __device__ int gsc_coll_ll_get(const gsc_coll_device_t *c, unsigned long long q, unsigned long long r, unsigned long long w,
                                      unsigned long long t0, unsigned *data)
{
    const unsigned long long *at = c->box[c->rank] + (q * 2 + (r & 1)) * c->words + w;
    const unsigned flag = gsc_ll_flag(r);
    unsigned long long look = t0 + GSC_ABORT_LOOK_NS;
    for (;;) {
        unsigned long long v;
        asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(at) : "memory");
        if ((unsigned)(v >> 32) == flag) {
            *data = (unsigned)v;
            return 1;
        }
        const unsigned long long now = gsc_globaltimer();
        if (now - t0 > c->timeout_ns) return 0;
        if (c->abort && now >= look) {
            if (*c->abort != 0) return 0;
            look = now + GSC_ABORT_LOOK_NS;
        }
    }
}

/* Units per sender loaded at once: their LL words are in flight together, so one thread is not
 * held up by a load's latency per word. */
#define GSC_COLL_BATCH 8

/* Units u0 .. u0 + nu of sender q's round r into v: the words loaded together, then checked;
 * one not there yet is waited for alone (gsc_coll_ll_get). 1, or 0 (see there). */
static __device__ int gsc_coll_units(const gsc_coll_device_t *c, unsigned long long q, unsigned long long r, unsigned long long u0,
                                     unsigned long long nu, unsigned long long t0, unsigned long long *v)
{
    const unsigned long long *at = c->box[c->rank] + (q * 2 + (r & 1)) * c->words;
    const unsigned long long w0 = 2 * u0, nw = 2 * nu < c->words - w0 ? 2 * nu : c->words - w0;
    const unsigned flag = gsc_ll_flag(r);
    unsigned long long raw[2 * GSC_COLL_BATCH];
#pragma unroll
    for (int k = 0; k < 2 * GSC_COLL_BATCH; k++)
        if (k < (int)nw) asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(raw[k]) : "l"(at + w0 + k) : "memory");
    for (int k = 0; k < (int)nw; k++) {
        unsigned data;
        if ((unsigned)(raw[k] >> 32) == flag) continue;
        if (!gsc_coll_ll_get(c, q, r, w0 + k, t0, &data)) return 0;
        raw[k] = (unsigned long long)flag << 32 | data;
    }
    for (int k = 0; k < (int)nu; k++) {
        const unsigned lo = (unsigned)raw[2 * k], hi = 2 * k + 1 < (int)nw ? (unsigned)raw[2 * k + 1] : 0u;
        v[k] = (unsigned long long)hi << 32 | lo;
    }
    return 1;
}

/* End the round triggered last, if it has not ended: every rank's input, reduced in rank
 * order into the receive buffer; the done word advanced. Returns the done word. */
static __device__ unsigned long long gsc_coll_trigger_wait(gsc_device_handle_t *h)
{
    gsc_coll_device_t *c = h->coll;
    volatile unsigned long long *done = h->done;
    const unsigned long long e = *(volatile unsigned long long *)&h->epoch, d = *done;
    if ((d & GSC_DEVICE_DONE_ERROR_BIT) || d >= e) return d;
    const unsigned long long r = *(volatile unsigned long long *)&c->round, units = (c->bytes + 7) / 8;
    const unsigned long long t0 = gsc_globaltimer();
    int ok = 1;
    for (unsigned long long u0 = 0; ok && u0 < units; u0 += GSC_COLL_BATCH) {
        const unsigned long long nu = units - u0 < GSC_COLL_BATCH ? units - u0 : GSC_COLL_BATCH;
        unsigned long long acc[GSC_COLL_BATCH], v[GSC_COLL_BATCH];
        for (unsigned long long q = 0; ok && q < c->nranks; q++) {
            if (q == c->rank) {
                for (unsigned long long k = 0; k < nu; k++)
                    v[k] = (unsigned long long)gsc_ll_data(c->send, c->bytes, 2 * (u0 + k) + 1) << 32 |
                           gsc_ll_data(c->send, c->bytes, 2 * (u0 + k));
            } else {
                ok = gsc_coll_units(c, q, r, u0, nu, t0, v);
            }
            for (unsigned long long k = 0; k < nu; k++) acc[k] = q == 0 ? v[k] : gsc_coll_reduce8(c, acc[k], v[k]);
        }
        if (!ok) break;
        for (unsigned long long k = 0; k < nu; k++) {
            const unsigned long long x = c->op == 4 ? gsc_coll_avg8(c, acc[k]) : acc[k];
            for (unsigned long long b = 0; b < 8 && (u0 + k) * 8 + b < c->bytes; b++) c->recv[(u0 + k) * 8 + b] = (unsigned char)(x >> (8 * b));
        }
    }
    unsigned long long v = e;
    if (!ok) {
        v = e | GSC_DEVICE_DONE_ERROR_BIT;
        *(volatile unsigned long long *)c->error = r | (1ull << 62);
    }
    /* The receive buffer's bytes before the word (other threads of the block read them after
     * the __syncthreads that follows the wait). */
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(done), "l"(v) : "memory");
    return v;
}

/* gsc_trigger of such a collective: the previous round ends first; then this rank's input
 * (written before the call, with a __syncthreads) goes into every peer's mailbox as LL words.
 * After a failed round nothing more is done: every wait returns -1. */
static __device__ unsigned long long gsc_coll_trigger(gsc_device_handle_t *h)
{
    gsc_coll_device_t *c = h->coll;
    volatile unsigned long long *ep = &h->epoch;
    const unsigned long long d = gsc_coll_trigger_wait(h), e = *ep + 1;
    *ep = e;
    if (d & GSC_DEVICE_DONE_ERROR_BIT) return e;
    const unsigned long long r = *(volatile unsigned long long *)&c->round + 1;
    *(volatile unsigned long long *)&c->round = r;
    const unsigned first = gsc_ll_data(c->send, c->bytes, 0);
    for (unsigned long long q = 0; q < c->nranks; q++)
        if (q != c->rank)
            gsc_ll_write_lanes(c->box[q] + (c->rank * 2 + (r & 1)) * c->words, c->send, c->bytes, r, first, 0, 1);
    return e;
}

#endif /* GSC_DEVICE_CUH */
