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

#endif /* GSC_DEVICE_CUH */
