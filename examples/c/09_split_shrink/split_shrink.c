/*
 * Communicators made from communicators, across N processes (one GPU each): split, shrink and
 * revoke, with buffers carved from one gsc_gpu_mem_alloc() allocation per rank and registered;
 * every all-reduce result checked exactly.
 *
 *   GSC_NRANKS=3 GSC_BOOTSTRAP_ADDR=127.0.0.1:29500 GSC_BOOTSTRAP_SECRET=... \
 *       sh -c 'for r in 0 1 2; do GSC_RANK=$r ./split_shrink & done; wait'
 *   (or under mpirun, as 05_allreduce)
 *
 * 1. The world communicator, as in 05_allreduce. Each rank allocates one buffer with
 *    gsc_gpu_mem_alloc(), carves its send buffer (offset 0) and receive buffer (offset 1 MiB)
 *    from it, and registers the whole allocation with gsc_comm_register().
 * 2. Split, reversed: every rank color 0, key -rank. Rank r becomes rank N-1-r; an all-reduce
 *    on the new communicator sums every rank's values.
 * 3. Split, leaving the last rank out: it passes GSC_SPLIT_NOCOLOR and gets NULL; the others
 *    all-reduce over N-1 ranks.
 * 4. Shrink: the last rank leaves (it does not call); the others call gsc_comm_shrink() with
 *    the same list and all-reduce on the result. A list naming the caller is refused first.
 * 5. Revoke: each rank revokes the reversed communicator; an all-reduce on it is then
 *    GSC_ERR_CANCELED, gsc_comm_query() is GSC_OK, and a split of it still works.
 * 6. gsc_comm_deregister(), gsc_gpu_mem_free(), every communicator destroyed.
 *
 * The CUDA driver is loaded at run time (dlopen), so this file builds without the CUDA toolkit;
 * without a driver or a GPU it says "skipped" and exits 0. Exit status 0: every check passed.
 */
#define _POSIX_C_SOURCE 200809L
#include <gsc.h>

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The CUDA driver API types and entry points used here (cuda.h's definitions). */
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
#define CUDA_ERROR_NOT_READY 600
#define CU_STREAM_NON_BLOCKING 1
static struct {
    CUresult (*Init)(unsigned);
    CUresult (*DeviceGetCount)(int *);
    CUresult (*DeviceGet)(int *, int);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, int);
    CUresult (*DevicePrimaryCtxRelease)(int);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*MemAlloc)(CUdeviceptr *, size_t);
    CUresult (*MemFree)(CUdeviceptr);
    CUresult (*MemHostAlloc)(void **, size_t, unsigned);
    CUresult (*MemFreeHost)(void *);
    CUresult (*StreamCreate)(CUstream *, unsigned);
    CUresult (*StreamDestroy)(CUstream);
    CUresult (*StreamQuery)(CUstream);
    CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*MemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*MemsetD32Async)(CUdeviceptr, unsigned, size_t, CUstream);
    CUresult (*GetErrorName)(CUresult, const char **);
} cu;

#define WAIT_SECONDS 120
#define COUNT ((size_t)100000)
/* The receive buffer's offset in the one allocation each rank carves its buffers from. */
#define RECV_OFFSET ((size_t)1 << 20)

static int rank = -1, nranks, failures;
static CUstream stream;

#define MUST(_call)                                                                           \
    do {                                                                                      \
        gsc_status_t _st = (_call);                                                           \
        if (_st != GSC_OK) {                                                                  \
            fprintf(stderr, "rank %d: FAILED: %s: %s (%s)\n", rank, #_call,                   \
                    gsc_status_string(_st), gsc_last_error_message());                        \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

static const char *cu_error_name(CUresult r)
{
    const char *name = NULL;
    if (cu.GetErrorName == NULL || cu.GetErrorName(r, &name) != 0 || name == NULL) {
        return "?";
    }
    return name;
}

#define CU(_call)                                                                             \
    do {                                                                                      \
        CUresult _r = (_call);                                                                \
        if (_r != 0) {                                                                        \
            fprintf(stderr, "rank %d: FAILED: %s: CUDA error %d (%s)\n", rank, #_call, _r,    \
                    cu_error_name(_r));                                                       \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

/* Load the driver; the number of GPUs, 0 when there is no driver or no GPU. */
static int load_cuda(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    int n = 0;
    size_t i;
    if (lib == NULL) {
        return 0;
    }
#define SYM(field, name) *(void **)&cu.field = dlsym(lib, name)
    SYM(Init, "cuInit");
    SYM(DeviceGetCount, "cuDeviceGetCount");
    SYM(DeviceGet, "cuDeviceGet");
    SYM(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    SYM(DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    SYM(CtxSetCurrent, "cuCtxSetCurrent");
    SYM(MemAlloc, "cuMemAlloc_v2");
    SYM(MemFree, "cuMemFree_v2");
    SYM(MemHostAlloc, "cuMemHostAlloc");
    SYM(MemFreeHost, "cuMemFreeHost");
    SYM(StreamCreate, "cuStreamCreate");
    SYM(StreamDestroy, "cuStreamDestroy_v2");
    SYM(StreamQuery, "cuStreamQuery");
    SYM(MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
    SYM(MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
    SYM(MemsetD32Async, "cuMemsetD32Async");
    SYM(GetErrorName, "cuGetErrorName");
#undef SYM
    /* Every entry point must be there before any is used. */
    for (i = 0; i < sizeof(cu) / sizeof(void *); i++) {
        if (((void **)&cu)[i] == NULL) {
            fprintf(stderr, "libcuda.so.1 lacks an entry point this example uses\n");
            return 0;
        }
    }
    if (cu.Init(0) != 0 || cu.DeviceGetCount(&n) != 0) {
        return 0;
    }
    return n;
}

/* Wait for everything queued on the stream, bounded: a collective kernel whose peer died gives
 * up after GSC_TIMEOUT (set below); this bound is the backstop. */
static void synchronize(const char *what)
{
    time_t start = time(NULL);
    struct timespec pause = {0, 50000};
    for (;;) {
        CUresult r = cu.StreamQuery(stream);
        if (r == 0) {
            return;
        }
        if (r != CUDA_ERROR_NOT_READY) {
            fprintf(stderr, "rank %d: FAILED: %s: the stream failed: CUDA error %d (%s)\n", rank, what, r,
                    cu_error_name(r));
            exit(1);
        }
        if (time(NULL) - start > WAIT_SECONDS) {
            fprintf(stderr, "rank %d: FAILED: %s: the stream is still busy after %d s\n", rank, what,
                    WAIT_SECONDS);
            exit(1);
        }
        nanosleep(&pause, NULL);
    }
}

/* World rank r's element k: a small integer, so sums are exact. */
static int32_t contribution(int r, size_t k)
{
    return (int32_t)(r + 1) * 3 + (int32_t)(k % 13) - 6;
}

/* A sum of int32 over `comm` (whose members are the world ranks in `members`, `n` of them), in
 * stream order between a copy of this rank's values in and the result out; the host checks
 * every element. */
static void sum_over(gsc_comm_h comm, gsc_condition_h cond, CUdeviceptr in, CUdeviceptr out, int32_t *host,
                     const int *members, int n, const char *what)
{
    size_t k;
    int m;
    for (k = 0; k < COUNT; k++) {
        host[k] = contribution(rank, k);
    }
    CU(cu.MemcpyHtoDAsync(in, host, COUNT * 4, stream));
    CU(cu.MemsetD32Async(out, 0xdeadbeefu, COUNT, stream));
    MUST(gsc_comm_all_reduce(comm, (const void *)(uintptr_t)in, (void *)(uintptr_t)out, COUNT, GSC_INT32, GSC_SUM, cond));
    CU(cu.MemcpyDtoHAsync(host, out, COUNT * 4, stream));
    synchronize(what);
    for (k = 0; k < COUNT; k++) {
        int32_t want = 0;
        for (m = 0; m < n; m++) {
            want += contribution(members[m], k);
        }
        if (host[k] != want) {
            fprintf(stderr, "rank %d: FAILED: %s: element %lu is %d, expected %d\n", rank, what, (unsigned long)k,
                    (int)host[k], (int)want);
            failures++;
            return;
        }
    }
    printf("rank %d: %s: %lu sums over %d rank(s) checked\n", rank, what, (unsigned long)COUNT, n);
}

/* The communicator's rank and size must be `want_rank` of `want_size`. */
static void expect_place(gsc_comm_h comm, int want_rank, int want_size, const char *what)
{
    int r, n;
    MUST(gsc_comm_rank(comm, &r));
    MUST(gsc_comm_size(comm, &n));
    if (r != want_rank || n != want_size) {
        fprintf(stderr, "rank %d: FAILED: %s: rank %d of %d, expected %d of %d\n", rank, what, r, n, want_rank, want_size);
        failures++;
    }
}

int main(void)
{
    int ngpus, dev, i, last, *everyone;
    gsc_bootstrap_h boot;
    gsc_unique_id_t id, *ids;
    gsc_status_t st = GSC_OK;
    gsc_comm_h world, reversed, without_last = NULL, shrunk = NULL, again = NULL;
    gsc_comm_reg_h reg;
    gsc_condition_param_t cp;
    gsc_condition_h cond;
    CUcontext cuctx;
    CUdeviceptr base, dsend, drecv;
    void *mem = NULL;
    int32_t *host;

    ngpus = load_cuda();
    if (ngpus <= 0) {
        printf("skipped: no CUDA driver or no GPU here (this example needs GPUs)\n");
        return 0;
    }
    MUST(gsc_bootstrap_init_from_env(&boot));
    MUST(gsc_bootstrap_rank(boot, &rank));
    MUST(gsc_bootstrap_nranks(boot, &nranks));
    if (nranks < 2) {
        fprintf(stderr, "rank %d: needs at least 2 ranks (GSC_NRANKS, or mpirun -np N)\n", rank);
        return 2;
    }
    last = nranks - 1;
    CU(cu.DeviceGet(&dev, rank % ngpus));
    CU(cu.DevicePrimaryCtxRetain(&cuctx, dev));
    CU(cu.CtxSetCurrent(cuctx));
    CU(cu.StreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    CU(cu.MemHostAlloc((void **)&host, COUNT * 4, 0));
    setenv("GSC_TIMEOUT", "60s", 0);

    /* Rank 0's unique id to everyone (see 05_allreduce). */
    memset(&id, 0, sizeof(id));
    if (rank == 0) {
        st = gsc_get_unique_id(&id);
    }
    ids = malloc((size_t)nranks * sizeof(*ids));
    everyone = malloc((size_t)nranks * sizeof(int));
    if (ids == NULL || everyone == NULL) {
        fprintf(stderr, "rank %d: out of memory\n", rank);
        return 1;
    }
    MUST(gsc_bootstrap_allgather(boot, &id, sizeof(id), ids));
    if (rank == 0) {
        MUST(st);
    }
    MUST(gsc_comm_init_rank(&world, nranks, &ids[0], rank, dev));
    free(ids);
    for (i = 0; i < nranks; i++) {
        everyone[i] = i;
    }

    /* 1. One allocation on the context made current above, carved into both buffers, and
     * registered whole. */
    MUST(gsc_gpu_mem_alloc(&mem, 2 * RECV_OFFSET));
    base = (CUdeviceptr)(uintptr_t)mem;
    dsend = base;
    drecv = base + RECV_OFFSET;
    MUST(gsc_comm_register(world, mem, 2 * RECV_OFFSET, &reg));

    memset(&cp, 0, sizeof(cp));
    cp.field_mask = GSC_CONDITION_PARAM_FIELD_CATEGORY | GSC_CONDITION_PARAM_FIELD_CONTEXT;
    cp.category = GSC_CONDITION_CATEGORY_STREAM;
    cp.context = stream;
    MUST(gsc_condition_create(&cp, &cond));
    sum_over(world, cond, dsend, drecv, host, everyone, nranks, "world");

    /* 2. Reversed: the same ranks, ordered by key = -rank. */
    MUST(gsc_comm_split(world, 0, -rank, &reversed));
    expect_place(reversed, last - rank, nranks, "reversed split");
    sum_over(reversed, cond, dsend, drecv, host, everyone, nranks, "reversed split");

    /* 3. Without the last rank: it takes part in the split and gets no communicator. */
    MUST(gsc_comm_split(world, rank == last ? GSC_SPLIT_NOCOLOR : 0, rank, &without_last));
    if ((rank == last) != (without_last == NULL)) {
        fprintf(stderr, "rank %d: FAILED: split without the last rank gave %p\n", rank, (void *)without_last);
        failures++;
    }
    if (without_last != NULL) {
        expect_place(without_last, rank, last, "split without the last rank");
        sum_over(without_last, cond, dsend, drecv, host, everyone, last, "split without the last rank");
    }

    /* 4. Shrink: the last rank leaves and does not call; the others name it. */
    if (rank != last) {
        st = gsc_comm_shrink(world, &rank, 1, GSC_SHRINK_ABORT, &shrunk);
        if (st != GSC_ERR_INVALID_PARAM || shrunk != NULL || gsc_comm_query(world) != GSC_OK) {
            fprintf(stderr, "rank %d: FAILED: a shrink list naming the caller gave %s\n", rank, gsc_status_string(st));
            failures++;
        }
        MUST(gsc_comm_shrink(world, &last, 1, 0, &shrunk));
        expect_place(shrunk, rank, last, "shrink");
        sum_over(shrunk, cond, dsend, drecv, host, everyone, last, "shrink");
    }

    /* 5. Revoke the reversed communicator: collectives refused, the query clean, split kept. */
    MUST(gsc_bootstrap_barrier(boot));
    MUST(gsc_comm_revoke(reversed));
    st = gsc_comm_all_reduce(reversed, (const void *)(uintptr_t)dsend, (void *)(uintptr_t)drecv, COUNT, GSC_INT32,
                             GSC_SUM, cond);
    if (st != GSC_ERR_CANCELED || gsc_comm_query(reversed) != GSC_OK) {
        fprintf(stderr, "rank %d: FAILED: an all-reduce on a revoked communicator gave %s\n", rank, gsc_status_string(st));
        failures++;
    }
    MUST(gsc_comm_split(reversed, 0, rank, &again));
    expect_place(again, rank, nranks, "split of the revoked communicator");
    sum_over(again, cond, dsend, drecv, host, everyone, nranks, "split of the revoked communicator");
    printf("rank %d: revoked: collectives refused with %s, split still works\n", rank, gsc_status_string(GSC_ERR_CANCELED));

    /* 6. Every rank's work is done before any rank's communicators go. */
    MUST(gsc_comm_query(world));
    MUST(gsc_condition_query(cond));
    MUST(gsc_bootstrap_barrier(boot));
    MUST(gsc_comm_deregister(world, reg));
    MUST(gsc_gpu_mem_free(mem));
    MUST(gsc_comm_destroy(again));
    if (shrunk != NULL) {
        MUST(gsc_comm_destroy(shrunk));
    }
    if (without_last != NULL) {
        MUST(gsc_comm_destroy(without_last));
    }
    MUST(gsc_comm_destroy(reversed));
    MUST(gsc_comm_destroy(world));
    MUST(gsc_condition_destroy(cond));
    free(everyone);
    CU(cu.MemFreeHost(host));
    CU(cu.StreamDestroy(stream));
    CU(cu.DevicePrimaryCtxRelease(dev));
    MUST(gsc_bootstrap_destroy(boot));
    if (failures == 0) {
        printf("rank %d of %d (GPU %d): all checks passed\n", rank, nranks, dev);
        return 0;
    }
    fprintf(stderr, "rank %d: %d check(s) failed\n", rank, failures);
    return 1;
}
