/*
 * The stream-enqueue layer as MPICH's users use it: a stream-ordered ping-pong (4 KiB and 1 MiB),
 * non-blocking sends and receives around a ring with the waits enqueued on the stream, and a
 * stream-ordered all-reduce. Every value that arrives is copied out in stream order and checked
 * on the host at the end.
 *
 *   GSC_NRANKS=N GSC_BOOTSTRAP_ADDR=127.0.0.1:PORT GSC_BOOTSTRAP_SECRET=S GSC_RANK=r ./test_mpix
 *   (run.sh N does that for N ranks)
 *
 * With a CUDA driver and a GPU each rank uses GPU rank % (number of GPUs) and a CUDA stream (the
 * driver is loaded at run time, so this builds without CUDA). Without one, or with
 * GSC_MPIX_HOST=1, it runs the point-to-point parts on gscomm host streams over host memory, and
 * checks that the all-reduce is refused there. Exit status 0: every check passed.
 */
#define _POSIX_C_SOURCE 200809L
#include "gsc_mpix.h"

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
static struct {
    CUresult (*Init)(unsigned);
    CUresult (*DeviceGetCount)(int *);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, int);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*MemAlloc)(CUdeviceptr *, size_t);
    CUresult (*MemHostAlloc)(void **, size_t, unsigned);
    CUresult (*StreamCreate)(CUstream *, unsigned);
    CUresult (*MemsetD32Async)(CUdeviceptr, unsigned, size_t, CUstream);
    CUresult (*MemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*StreamSynchronize)(CUstream);
} cu;

static int rank = -1, nranks, failures, on_gpu;
static CUstream cuda_stream;
static gsc_host_stream_h host_stream;

#define MUST(_call)                                                                                 \
    do {                                                                                            \
        long _r = (long)(_call);                                                                    \
        if (_r != 0) {                                                                              \
            fprintf(stderr, "rank %d: FAILED: %s = %ld (%s; %s)\n", rank, #_call, _r, MPIX_Last_error(), \
                    gsc_last_error_message());                                                      \
            exit(1);                                                                                \
        }                                                                                           \
    } while (0)

static int load_cuda(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    int n = 0;
    if (lib == NULL) return 0;
#define SYM(field, name) *(void **)&cu.field = dlsym(lib, name)
    SYM(Init, "cuInit");
    SYM(DeviceGetCount, "cuDeviceGetCount");
    SYM(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    SYM(CtxSetCurrent, "cuCtxSetCurrent");
    SYM(MemAlloc, "cuMemAlloc_v2");
    SYM(MemHostAlloc, "cuMemHostAlloc");
    SYM(StreamCreate, "cuStreamCreate");
    SYM(MemsetD32Async, "cuMemsetD32Async");
    SYM(MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
    SYM(StreamSynchronize, "cuStreamSynchronize");
#undef SYM
    return cu.Init != NULL && cu.StreamSynchronize != NULL && cu.Init(0) == 0 && cu.DeviceGetCount(&n) == 0 && n > 0 ? n : 0;
}

/* Stream-ordered buffer work: a CUDA memset / copy, or the same on the host stream's thread. */
struct host_job {
    int32_t *buf, *out;
    size_t n;
    int32_t value;
};

static void host_fill(void *arg)
{
    struct host_job *j = arg;
    size_t i;
    for (i = 0; i < j->n; i++) j->buf[i] = j->value;
    free(j);
}

static void host_copy_ends(void *arg)
{
    struct host_job *j = arg;
    j->out[0] = j->buf[0];
    j->out[1] = j->buf[j->n - 1];
    free(j);
}

static void *alloc_buf(size_t bytes)
{
    if (on_gpu) {
        CUdeviceptr p;
        MUST(cu.MemAlloc(&p, bytes));
        return (void *)(uintptr_t)p;
    }
    return calloc(1, bytes);
}

static void fill(void *buf, size_t n, int32_t value)
{
    if (on_gpu) {
        MUST(cu.MemsetD32Async((CUdeviceptr)(uintptr_t)buf, (unsigned)value, n, cuda_stream));
    } else {
        struct host_job *j = malloc(sizeof *j);
        j->buf = buf, j->n = n, j->value = value, j->out = NULL;
        MUST(gsc_host_stream_launch(host_stream, host_fill, j));
    }
}

/* Copy the first and the last element of buf[n] to out[0], out[1], in stream order. */
static void copy_ends(void *buf, size_t n, int32_t *out)
{
    if (on_gpu) {
        MUST(cu.MemcpyDtoHAsync(&out[0], (CUdeviceptr)(uintptr_t)buf, 4, cuda_stream));
        MUST(cu.MemcpyDtoHAsync(&out[1], (CUdeviceptr)(uintptr_t)buf + (n - 1) * 4, 4, cuda_stream));
    } else {
        struct host_job *j = malloc(sizeof *j);
        j->buf = buf, j->n = n, j->out = out, j->value = 0;
        MUST(gsc_host_stream_launch(host_stream, host_copy_ends, j));
    }
}

static void synchronize(void)
{
    if (on_gpu) {
        MUST(cu.StreamSynchronize(cuda_stream));
    } else {
        MUST(gsc_host_stream_synchronize(host_stream, 60000));
    }
}

static void expect(const int32_t *got, int32_t want, const char *what, int it)
{
    if (got[0] != want || got[1] != want) {
        if (failures++ < 10) fprintf(stderr, "rank %d: %s, iteration %d: got %d/%d, want %d\n", rank, what, it, got[0], got[1], want);
    }
}

#define ITERS 100

/* Pairs (0,1), (2,3), ...: the even rank sends then receives, the odd one receives then
 * sends back its own value; each received buffer is copied out right after its receive. */
static void ping_pong(MPI_Comm comm, int32_t *out, size_t n)
{
    int peer = rank ^ 1, it;
    void *sbuf, *rbuf;
    if (peer >= nranks) return;
    sbuf = alloc_buf(n * 4), rbuf = alloc_buf(n * 4);
    for (it = 0; it < ITERS; it++) {
        int tag = it % 7;
        if (rank % 2 == 0) {
            fill(sbuf, n, it * 10 + rank);
            MUST(MPIX_Send_enqueue(sbuf, (int)n, MPI_INT, peer, tag, comm));
            MUST(MPIX_Recv_enqueue(rbuf, (int)n, MPI_INT, peer, tag, comm, MPI_STATUS_IGNORE));
        } else {
            MUST(MPIX_Recv_enqueue(rbuf, (int)n, MPI_INT, MPI_ANY_SOURCE, tag, comm, MPI_STATUS_IGNORE));
            fill(sbuf, n, it * 10 + rank);
            MUST(MPIX_Send_enqueue(sbuf, (int)n, MPI_INT, peer, tag, comm));
        }
        copy_ends(rbuf, n, &out[2 * it]);
    }
    synchronize();
    for (it = 0; it < ITERS; it++) expect(&out[2 * it], it * 10 + peer, n > 4096 ? "ping-pong 1 MiB" : "ping-pong 4 KiB", it);
}

/* Around the ring: receive from the left and send to the right without stream waits, then
 * one enqueued wait for both (alternately MPIX_Wait_enqueue twice and MPIX_Waitall_enqueue). */
static void ring(MPI_Comm comm, int32_t *out, size_t n)
{
    int left = (rank + nranks - 1) % nranks, right = (rank + 1) % nranks, it;
    void *sbuf = alloc_buf(n * 4), *rbuf = alloc_buf(n * 4);
    for (it = 0; it < ITERS; it++) {
        MPI_Request reqs[2];
        fill(sbuf, n, it * 100 + rank);
        MUST(MPIX_Irecv_enqueue(rbuf, (int)n, MPI_INT, left, 5, comm, &reqs[0]));
        MUST(MPIX_Isend_enqueue(sbuf, (int)n, MPI_INT, right, 5, comm, &reqs[1]));
        if (it % 2 == 0) {
            MUST(MPIX_Waitall_enqueue(2, reqs, MPI_STATUSES_IGNORE));
        } else {
            MUST(MPIX_Wait_enqueue(&reqs[0], MPI_STATUS_IGNORE));
            MUST(MPIX_Wait_enqueue(&reqs[1], MPI_STATUS_IGNORE));
        }
        if (reqs[0] != MPI_REQUEST_NULL || reqs[1] != MPI_REQUEST_NULL) failures++;
        copy_ends(rbuf, n, &out[2 * it]);
    }
    synchronize();
    for (it = 0; it < ITERS; it++) expect(&out[2 * it], it * 100 + left, "ring with enqueued waits", it);
}

static void all_reduce(MPI_Comm comm, int32_t *out, size_t n)
{
    void *buf = alloc_buf(n * 4);
    int it;
    for (it = 0; it < ITERS; it++) {
        fill(buf, n, (rank + 1) * (it + 1));
        MUST(MPIX_Allreduce_enqueue(MPI_IN_PLACE, buf, (int)n, MPI_INT, MPI_SUM, comm));
        copy_ends(buf, n, &out[2 * it]);
    }
    synchronize();
    for (it = 0; it < ITERS; it++) expect(&out[2 * it], (it + 1) * nranks * (nranks + 1) / 2, "all-reduce", it);
}

int main(void)
{
    gsc_bootstrap_h world;
    MPIX_Stream stream;
    MPI_Comm comm;
    int32_t *out;
    int ngpus, r;
    const char *host = getenv("GSC_MPIX_HOST");
    MPI_Status status;

    MUST(gsc_bootstrap_init_from_env(&world));
    MUST(gsc_bootstrap_rank(world, &rank));
    MUST(gsc_bootstrap_nranks(world, &nranks));
    ngpus = (host != NULL && strcmp(host, "1") == 0) ? 0 : load_cuda();
    on_gpu = ngpus > 0;
    if (on_gpu) {
        CUcontext ctx;
        int dev = rank % ngpus;
        MUST(cu.DevicePrimaryCtxRetain(&ctx, dev));
        MUST(cu.CtxSetCurrent(ctx));
        MUST(cu.StreamCreate(&cuda_stream, 1 /* non-blocking */));
        MUST(cu.MemHostAlloc((void **)&out, 2 * ITERS * sizeof *out, 0));
        MUST(MPIX_Stream_create_cuda(cuda_stream, dev, &stream));
    } else {
        MUST(gsc_host_stream_create(&host_stream));
        out = calloc(2 * ITERS, sizeof *out);
        MUST(MPIX_Stream_create_host(host_stream, &stream));
    }
    MUST(MPIX_Stream_comm_create(world, stream, &comm));

    /* Refusals: a status to fill, a bad rank; on host streams, a collective. */
    if (MPIX_Recv_enqueue(out, 1, MPI_INT, 0, 0, comm, &status) != MPI_ERR_ARG) failures++;
    if (MPIX_Send_enqueue(out, 1, MPI_INT, nranks, 0, comm) != MPI_ERR_ARG) failures++;
    if (!on_gpu && MPIX_Allreduce_enqueue(MPI_IN_PLACE, out, 1, MPI_INT, MPI_SUM, comm) != MPI_ERR_ARG) failures++;

    ping_pong(comm, out, 1024);
    ping_pong(comm, out, 1 << 18);
    ring(comm, out, 1024);
    ring(comm, out, 1 << 18);
    if (on_gpu) {
        all_reduce(comm, out, 1024);
        all_reduce(comm, out, 1 << 20);
    }
    MUST(gsc_bootstrap_barrier(world));
    MUST(MPI_Comm_free(&comm));
    MUST(MPIX_Stream_free(&stream));
    r = failures == 0 ? 0 : 1;
    printf("rank %d of %d: %s (%s, %d iterations per check)\n", rank, nranks, r == 0 ? "ok" : "FAILED", on_gpu ? "CUDA stream" : "host stream", ITERS);
    MUST(gsc_bootstrap_destroy(world));
    return r;
}
