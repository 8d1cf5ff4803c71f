/*
 * All-reduce across N processes, one GPU each, with a gscomm communicator on a CUDA stream,
 * every element of every result checked exactly.
 *
 *   mpirun -np 4 -x GSC_BOOTSTRAP_ADDR=127.0.0.1:29500 -x GSC_BOOTSTRAP_SECRET=$SECRET ./allreduce
 *   GSC_NRANKS=4 GSC_BOOTSTRAP_ADDR=... GSC_BOOTSTRAP_SECRET=... \
 *       sh -c 'for r in 0 1 2 3; do GSC_RANK=$r ./allreduce & done; wait'
 *
 * The processes find each other with the launcher-style bootstrap (gsc_bootstrap_init_from_env:
 * the rank and size from mpirun's variables — Open MPI's OMPI_COMM_WORLD_*, MPICH's PMI_* — or
 * GSC_RANK/GSC_NRANKS; rank 0 serves the rendezvous at GSC_BOOTSTRAP_ADDR). Rank 0 then makes the
 * communicator's unique id (gsc_get_unique_id), hands it to every rank with
 * gsc_bootstrap_allgather, and each rank joins with gsc_comm_init_rank on GPU rank % (number of
 * GPUs) — the bootstrap is only the way to pass the id here; an MPI program would broadcast it
 * with MPI_Bcast instead. On a STREAM condition of a non-blocking stream, for int32 and float32
 * and 1, 1000 and 1M elements: 5 out-of-place sums (new data each time) and an in-place max,
 * each between a copy of this rank's contribution to the GPU and a copy of the result back, all
 * in stream order; the host checks every element (the values are small integers, so float sums
 * are exact in any order).
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

#define ITERS 5
#define WAIT_SECONDS 120
#define MAX_COUNT ((size_t)1 << 20)

static const size_t counts[] = {1, 1000, MAX_COUNT};
#define NCOUNTS (sizeof(counts) / sizeof(counts[0]))

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

/* Rank r's element k in iteration `iter`: a small integer, so sums of floats are exact. */
static int32_t contribution(int r, int iter, size_t k)
{
    return (int32_t)((r + 1) * (iter + 1)) + (int32_t)(k % 17) - 8;
}

/* What every rank must hold afterwards: the sum, or the maximum, over the ranks. */
static int32_t expected(gsc_red_op_t op, int iter, size_t k)
{
    int32_t x = op == GSC_MAX ? contribution(nranks - 1, iter, k) : 0;
    int r;
    if (op == GSC_SUM) {
        for (r = 0; r < nranks; r++) {
            x += contribution(r, iter, k);
        }
    }
    return x;
}

/* One all-reduce, start to end in stream order: this rank's contribution to the GPU (into
 * `in`), the result buffer poisoned (out of place: so a result that was never written shows),
 * the collective, the result back to the host; then the host checks it. */
static void all_reduce(gsc_comm_h comm, gsc_condition_h cond, CUdeviceptr in, CUdeviceptr out, void *host_in,
                       void *host_out, size_t count, gsc_datatype_t type, gsc_red_op_t op, int iter)
{
    size_t k, bytes = count * 4;
    const char *tname = type == GSC_FLOAT32 ? "float32" : "int32", *oname = op == GSC_SUM ? "sum" : "max";
    for (k = 0; k < count; k++) {
        int32_t v = contribution(rank, iter, k);
        if (type == GSC_FLOAT32) {
            ((float *)host_in)[k] = (float)v;
        } else {
            ((int32_t *)host_in)[k] = v;
        }
    }
    CU(cu.MemcpyHtoDAsync(in, host_in, bytes, stream));
    if (out != in) {
        CU(cu.MemsetD32Async(out, 0xdeadbeefu, count, stream));
    }
    MUST(gsc_comm_all_reduce(comm, (const void *)(uintptr_t)in, (void *)(uintptr_t)out, count, type, op, cond));
    CU(cu.MemcpyDtoHAsync(host_out, out, bytes, stream));
    synchronize("an all-reduce");
    for (k = 0; k < count; k++) {
        int32_t want = expected(op, iter, k);
        int ok = type == GSC_FLOAT32 ? ((float *)host_out)[k] == (float)want : ((int32_t *)host_out)[k] == want;
        if (!ok) {
            if (failures++ < 10) {
                if (type == GSC_FLOAT32) {
                    fprintf(stderr, "rank %d: FAILED: %s %s of %lu elements%s, iteration %d: element %lu is %g, expected %d\n",
                            rank, tname, oname, (unsigned long)count, in == out ? " in place" : "", iter,
                            (unsigned long)k, (double)((float *)host_out)[k], (int)want);
                } else {
                    fprintf(stderr, "rank %d: FAILED: %s %s of %lu elements%s, iteration %d: element %lu is %d, expected %d\n",
                            rank, tname, oname, (unsigned long)count, in == out ? " in place" : "", iter,
                            (unsigned long)k, (int)((int32_t *)host_out)[k], (int)want);
                }
            }
            break;
        }
    }
}

int main(void)
{
    int ngpus, dev, r;
    size_t c;
    gsc_bootstrap_h boot;
    gsc_unique_id_t id, *ids;
    gsc_status_t st = GSC_OK;
    gsc_comm_h comm;
    gsc_condition_param_t cp;
    gsc_condition_h cond;
    CUcontext cuctx;
    CUdeviceptr dsend, drecv;
    void *host_in, *host_out;
    const gsc_datatype_t types[2] = {GSC_INT32, GSC_FLOAT32};

    ngpus = load_cuda();
    if (ngpus <= 0) {
        printf("skipped: no CUDA driver or no GPU here (this example needs GPUs)\n");
        return 0;
    }
    MUST(gsc_bootstrap_init_from_env(&boot));
    MUST(gsc_bootstrap_rank(boot, &rank));
    MUST(gsc_bootstrap_nranks(boot, &nranks));
    if (nranks < 2) {
        fprintf(stderr, "rank %d: needs at least 2 ranks (see README.md: mpirun -np N, or GSC_NRANKS)\n", rank);
        return 2;
    }
    if (rank == 0 && nranks > ngpus) {
        printf("note: %d ranks on %d GPU(s): ranks share GPUs (collectives are meant for one rank per GPU)\n",
               nranks, ngpus);
    }

    CU(cu.DeviceGet(&dev, rank % ngpus));
    CU(cu.DevicePrimaryCtxRetain(&cuctx, dev));
    CU(cu.CtxSetCurrent(cuctx));
    CU(cu.StreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    CU(cu.MemAlloc(&dsend, MAX_COUNT * 4));
    CU(cu.MemAlloc(&drecv, MAX_COUNT * 4));
    CU(cu.MemHostAlloc(&host_in, MAX_COUNT * 4, 0));
    CU(cu.MemHostAlloc(&host_out, MAX_COUNT * 4, 0));

    /* The communicator reads its configuration from the environment (gsc_comm_init_rank takes
     * no config pairs). Give its kernels a bound on waiting for a dead peer unless the user
     * chose one. */
    setenv("GSC_TIMEOUT", "60s", 0);

    /* Rank 0's unique id to everyone. Exchanged even when making it failed, so no rank is left
     * waiting in the allgather; every rank then sees the failure. */
    memset(&id, 0, sizeof(id));
    if (rank == 0) {
        st = gsc_get_unique_id(&id);
    }
    {
        int ok = st == GSC_OK, *oks = malloc((size_t)nranks * sizeof(int));
        ids = malloc((size_t)nranks * sizeof(*ids));
        if (ids == NULL || oks == NULL) {
            fprintf(stderr, "rank %d: out of memory\n", rank);
            return 1;
        }
        MUST(gsc_bootstrap_allgather(boot, &id, sizeof(id), ids));
        MUST(gsc_bootstrap_allgather(boot, &ok, sizeof(ok), oks));
        if (!oks[0]) {
            if (rank == 0) {
                fprintf(stderr, "rank 0: FAILED: gsc_get_unique_id: %s (%s)\n", gsc_status_string(st),
                        gsc_last_error_message());
            } else {
                fprintf(stderr, "rank %d: FAILED: rank 0 could not make the unique id\n", rank);
            }
            return 1;
        }
        free(oks);
    }
    MUST(gsc_comm_init_rank(&comm, nranks, &ids[0], rank, dev));
    free(ids);
    {
        int crank, csize;
        MUST(gsc_comm_rank(comm, &crank));
        MUST(gsc_comm_size(comm, &csize));
        if (crank != rank || csize != nranks) {
            fprintf(stderr, "rank %d: FAILED: the communicator says rank %d of %d\n", rank, crank, csize);
            return 1;
        }
    }

    memset(&cp, 0, sizeof(cp));
    cp.field_mask = GSC_CONDITION_PARAM_FIELD_CATEGORY | GSC_CONDITION_PARAM_FIELD_CONTEXT;
    cp.category = GSC_CONDITION_CATEGORY_STREAM;
    cp.context = stream;
    MUST(gsc_condition_create(&cp, &cond));

    /* Every rank makes every call, in the same order, whatever its checks found: a collective
     * that one rank skipped would leave the others waiting. */
    for (r = 0; r < 2; r++) {
        for (c = 0; c < NCOUNTS; c++) {
            int iter, before = failures;
            for (iter = 0; iter < ITERS; iter++) {
                all_reduce(comm, cond, dsend, drecv, host_in, host_out, counts[c], types[r], GSC_SUM, iter);
            }
            all_reduce(comm, cond, drecv, drecv, host_in, host_out, counts[c], types[r], GSC_MAX, ITERS);
            if (rank == 0 || failures != before) {
                printf("rank %d: %s x %lu: %d sums and an in-place max: %s\n", rank,
                       types[r] == GSC_FLOAT32 ? "float32" : "int32", (unsigned long)counts[c], ITERS,
                       failures == before ? "all elements checked" : "FAILED");
            }
        }
    }
    MUST(gsc_comm_query(comm));
    MUST(gsc_condition_query(cond));

    /* Every rank's work is done before any rank's communicator goes. */
    MUST(gsc_bootstrap_barrier(boot));
    MUST(gsc_comm_destroy(comm));
    MUST(gsc_condition_destroy(cond));
    CU(cu.MemFree(dsend));
    CU(cu.MemFree(drecv));
    CU(cu.MemFreeHost(host_in));
    CU(cu.MemFreeHost(host_out));
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
