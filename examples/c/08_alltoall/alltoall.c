/*
 * All-to-all across N processes, one GPU each, as one group of sends and receives
 * (gsc_comm_transfers) — on a CUDA stream, then captured as a node of a CUDA graph that is
 * replayed with new data — every element of every result checked exactly.
 *
 *   mpirun -np 4 -x GSC_BOOTSTRAP_ADDR=127.0.0.1:29500 -x GSC_BOOTSTRAP_SECRET=$SECRET ./alltoall
 *   EXE=./alltoall examples/c/05_allreduce/run.sh 4        (launcher-style, no MPI)
 *
 * Rank r sends `count` int32 elements to every rank p (itself included) from element p x count
 * of its send buffer, and receives rank p's into element p x count of its receive buffer: 2N
 * entries of one gsc_peer_transfer_t array, one call. Messages of up to GSC_COLL_P2P_MAX bytes
 * (32 MiB) are moved by one kernel on the stream — no host in the loop — and larger ones by the
 * point-to-point engine; the sizes below take both paths. Each all-to-all is this rank's data to
 * the GPU, the receive buffer poisoned, the group, the result back, all in stream order; then
 * the host checks every element. The graph phase puts the group on a GRAPH condition (one
 * kernel node), instantiates the graph once and launches it GRAPH_REPLAYS times, new data each
 * time. Refused input is checked too: a bad entry is named by its index and nothing is issued.
 *
 * The rendezvous and the communicator are made as in 05_allreduce (see its README). The CUDA
 * driver is loaded at run time (dlopen), so this file builds without the CUDA toolkit; without a
 * driver or a GPU it says "skipped" and exits 0. Exit status 0: every check passed.
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
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;
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
    CUresult (*GraphCreate)(CUgraph *, unsigned);
    CUresult (*GraphInstantiate)(CUgraphExec *, CUgraph, unsigned long long);
    CUresult (*GraphLaunch)(CUgraphExec, CUstream);
    CUresult (*GraphExecDestroy)(CUgraphExec);
    CUresult (*GraphDestroy)(CUgraph);
    CUresult (*GetErrorName)(CUresult, const char **);
} cu;

#define ITERS 3
#define GRAPH_REPLAYS 20
#define WAIT_SECONDS 120
/* Elements per pair: 36 MiB of int32 is past GSC_COLL_P2P_MAX's default 32 MiB, so the largest
 * all-to-all goes through the point-to-point engine; the others are the kernel's. */
#define MAX_COUNT ((size_t)9 << 20)

static const size_t counts[] = {1, 1000, 12345, (size_t)1 << 20, MAX_COUNT};
#define NCOUNTS (sizeof(counts) / sizeof(counts[0]))
/* The graph: as many elements per pair as the kernel moves at most here (4 MiB). */
#define GRAPH_COUNT ((size_t)1 << 20)

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
    SYM(GraphCreate, "cuGraphCreate");
    SYM(GraphInstantiate, "cuGraphInstantiateWithFlags");
    SYM(GraphLaunch, "cuGraphLaunch");
    SYM(GraphExecDestroy, "cuGraphExecDestroy");
    SYM(GraphDestroy, "cuGraphDestroy");
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

/* The element rank `src` sends rank `dst` at position k in round `round`. */
static int32_t element(int src, int dst, int round, size_t k)
{
    return (int32_t)(((uint32_t)src * 7919u + (uint32_t)dst * 104729u + (uint32_t)round * 15485863u + (uint32_t)k) & 0x7fffffffu);
}

/* This rank's send buffer of `round` to the host staging area, the receive buffer poisoned. */
static void stage(CUdeviceptr dsend, CUdeviceptr drecv, int32_t *host, size_t count, int round)
{
    size_t k;
    int p;
    for (p = 0; p < nranks; p++) {
        for (k = 0; k < count; k++) {
            host[(size_t)p * count + k] = element(rank, p, round, k);
        }
    }
    CU(cu.MemcpyHtoDAsync(dsend, host, (size_t)nranks * count * 4, stream));
    CU(cu.MemsetD32Async(drecv, 0xdeadbeefu, (size_t)nranks * count, stream));
}

/* The receive buffer (already back on the host) against what every rank sent this one. */
static void check(const int32_t *host, size_t count, int round, const char *what)
{
    size_t k;
    int p;
    for (p = 0; p < nranks; p++) {
        for (k = 0; k < count; k++) {
            int32_t got = host[(size_t)p * count + k], want = element(p, rank, round, k);
            if (got != want) {
                if (failures++ < 10) {
                    fprintf(stderr, "rank %d: FAILED: %s of %lu elements, round %d: element %lu from rank %d is %d, expected %d\n",
                            rank, what, (unsigned long)count, round, (unsigned long)k, p, (int)got, (int)want);
                }
                return;
            }
        }
    }
}

/* The all-to-all group: a send to and a receive from every rank. */
static void fill_group(gsc_peer_transfer_t *group, CUdeviceptr dsend, CUdeviceptr drecv, size_t count)
{
    int p;
    for (p = 0; p < nranks; p++) {
        gsc_peer_transfer_t *s = &group[2 * p], *r = &group[2 * p + 1];
        s->op = GSC_PEER_SEND;
        s->buf = (void *)(uintptr_t)(dsend + (CUdeviceptr)p * count * 4);
        r->op = GSC_PEER_RECV;
        r->buf = (void *)(uintptr_t)(drecv + (CUdeviceptr)p * count * 4);
        s->count = r->count = count;
        s->datatype = r->datatype = GSC_INT32;
        s->peer = r->peer = p;
    }
}

/* A refused call must return `want` and name `needle` (the entry's index) in the message. */
static void expect_refused(gsc_status_t got, gsc_status_t want, const char *needle, const char *what)
{
    if (got != want || strstr(gsc_last_error_message(), needle) == NULL) {
        failures++;
        fprintf(stderr, "rank %d: FAILED: %s: %s (%s), expected %s naming \"%s\"\n", rank, what, gsc_status_string(got),
                gsc_last_error_message(), gsc_status_string(want), needle);
    }
}

int main(void)
{
    int ngpus, dev, round;
    size_t c;
    gsc_bootstrap_h boot;
    gsc_unique_id_t id, *ids;
    gsc_status_t st = GSC_OK;
    gsc_comm_h comm;
    gsc_condition_param_t cp;
    gsc_condition_h cond, gcond;
    gsc_condition_out_t out;
    CUcontext cuctx;
    CUdeviceptr dsend, drecv;
    CUgraph graph;
    CUgraphExec exec;
    int32_t *host;
    gsc_peer_transfer_t *group;

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
        printf("note: %d ranks on %d GPU(s): ranks share GPUs (communicators are meant for one rank per GPU)\n",
               nranks, ngpus);
    }

    CU(cu.DeviceGet(&dev, rank % ngpus));
    CU(cu.DevicePrimaryCtxRetain(&cuctx, dev));
    CU(cu.CtxSetCurrent(cuctx));
    CU(cu.StreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    CU(cu.MemAlloc(&dsend, (size_t)nranks * MAX_COUNT * 4));
    CU(cu.MemAlloc(&drecv, (size_t)nranks * MAX_COUNT * 4));
    CU(cu.MemHostAlloc((void **)&host, (size_t)nranks * MAX_COUNT * 4, 0));
    group = calloc(2 * (size_t)nranks, sizeof(*group));
    if (group == NULL) {
        fprintf(stderr, "rank %d: out of memory\n", rank);
        return 1;
    }
    setenv("GSC_TIMEOUT", "60s", 0);

    /* Rank 0's unique id to everyone (as 05_allreduce does). */
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
            fprintf(stderr, "rank %d: FAILED: rank 0 could not make the unique id\n", rank);
            return 1;
        }
        free(oks);
    }
    MUST(gsc_comm_init_rank(&comm, nranks, &ids[0], rank, dev));
    free(ids);

    memset(&cp, 0, sizeof(cp));
    cp.field_mask = GSC_CONDITION_PARAM_FIELD_CATEGORY | GSC_CONDITION_PARAM_FIELD_CONTEXT;
    cp.category = GSC_CONDITION_CATEGORY_STREAM;
    cp.context = stream;
    MUST(gsc_condition_create(&cp, &cond));

    /* Refused before anything is issued: on every rank alike, so no peer waits for a half. */
    fill_group(group, dsend, drecv, 1000);
    group[1].peer = nranks;
    expect_refused(gsc_comm_transfers(comm, group, 2 * (size_t)nranks, cond, NULL), GSC_ERR_INVALID_PARAM, "transfer 1",
                   "a receive from a rank past the communicator");
    fill_group(group, dsend, drecv, 1000);
    group[2].op = (gsc_peer_op_t)7;
    expect_refused(gsc_comm_transfers(comm, group, 2 * (size_t)nranks, cond, NULL), GSC_ERR_INVALID_PARAM, "transfer 2",
                   "an entry that is neither a send nor a receive");
    fill_group(group, dsend, drecv, 1000);
    group[0].buf = host;
    expect_refused(gsc_comm_transfers(comm, group, 2 * (size_t)nranks, cond, NULL), GSC_ERR_INVALID_PARAM, "transfer 0",
                   "a send from host memory");
    expect_refused(gsc_comm_transfers(comm, NULL, 2, cond, NULL), GSC_ERR_INVALID_PARAM, "NULL", "a NULL array");
    MUST(gsc_comm_transfers(comm, NULL, 0, cond, NULL)); /* an empty group is no error */

    /* On the stream: every size, new data each round. Every rank makes every call, whatever its
     * checks found. */
    for (c = 0; c < NCOUNTS; c++) {
        int before = failures;
        for (round = 0; round < ITERS; round++) {
            stage(dsend, drecv, host, counts[c], round);
            fill_group(group, dsend, drecv, counts[c]);
            MUST(gsc_comm_transfers(comm, group, 2 * (size_t)nranks, cond, NULL));
            CU(cu.MemcpyDtoHAsync(host, drecv, (size_t)nranks * counts[c] * 4, stream));
            synchronize("an all-to-all");
            check(host, counts[c], round, "an all-to-all on a stream");
        }
        if (rank == 0 || failures != before) {
            printf("rank %d: all-to-all of %lu int32 per pair on a stream, %d rounds: %s\n", rank,
                   (unsigned long)counts[c], ITERS, failures == before ? "all elements checked" : "FAILED");
        }
    }

    /* In a graph: one node, replayed with new data (the copies around it are on the stream). */
    CU(cu.GraphCreate(&graph, 0));
    cp.category = GSC_CONDITION_CATEGORY_GRAPH;
    cp.context = graph;
    MUST(gsc_condition_create(&cp, &gcond));
    fill_group(group, dsend, drecv, GRAPH_COUNT);
    memset(&out, 0, sizeof(out));
    MUST(gsc_comm_transfers(comm, group, 2 * (size_t)nranks, gcond, &out));
    if (out.start_node == NULL || out.done_node == NULL) {
        failures++;
        fprintf(stderr, "rank %d: FAILED: the graph's group returned no start or done node\n", rank);
    }
    CU(cu.GraphInstantiate(&exec, graph, 0));
    {
        int before = failures;
        for (round = 0; round < GRAPH_REPLAYS; round++) {
            stage(dsend, drecv, host, GRAPH_COUNT, 100 + round);
            CU(cu.GraphLaunch(exec, stream));
            CU(cu.MemcpyDtoHAsync(host, drecv, (size_t)nranks * GRAPH_COUNT * 4, stream));
            synchronize("a graph replay");
            check(host, GRAPH_COUNT, 100 + round, "an all-to-all in a graph");
        }
        if (rank == 0 || failures != before) {
            printf("rank %d: all-to-all of %lu int32 per pair in a graph, %d replays: %s\n", rank,
                   (unsigned long)GRAPH_COUNT, GRAPH_REPLAYS, failures == before ? "all elements checked" : "FAILED");
        }
    }
    MUST(gsc_comm_query(comm));
    MUST(gsc_condition_query(cond));

    /* Every rank's work is done before any rank's communicator goes. */
    MUST(gsc_bootstrap_barrier(boot));
    CU(cu.GraphExecDestroy(exec));
    CU(cu.GraphDestroy(graph));
    MUST(gsc_condition_destroy(gcond));
    MUST(gsc_comm_destroy(comm));
    MUST(gsc_condition_destroy(cond));
    CU(cu.MemFree(dsend));
    CU(cu.MemFree(drecv));
    CU(cu.MemFreeHost(host));
    CU(cu.StreamDestroy(stream));
    CU(cu.DevicePrimaryCtxRelease(dev));
    MUST(gsc_bootstrap_destroy(boot));
    free(group);
    if (failures == 0) {
        printf("rank %d of %d (GPU %d): all checks passed\n", rank, nranks, dev);
        return 0;
    }
    fprintf(stderr, "rank %d: %d check(s) failed\n", rank, failures);
    return 1;
}
