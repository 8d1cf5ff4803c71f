/*
 * The seed's graph broadcast: a binary tree of processes, each rank's part of the broadcast a
 * CUDA graph built with gscomm GRAPH conditions — a receive from the parent, then a send to each
 * child, the sends made to depend on the receive with cuGraphAddDependencies — instantiated
 * once and replayed, new data from the root every replay, checked on every rank.
 *
 *   GSC_NRANKS=3 GSC_BOOTSTRAP_ADDR=127.0.0.1:29500 GSC_BOOTSTRAP_SECRET=$SECRET \
 *       sh -c 'for r in 0 1 2; do GSC_RANK=$r ./graph_broadcast [REPLAYS] & done; wait'
 *
 * Rank r's parent is (r - 1) / 2 and its children 2r + 1 and 2r + 2 (those below N): the root
 * only sends, leaves only receive, and with 3 ranks this is the seed's shape (rank 0 sends to
 * 1 and 2) — with 4 or more, rank 1 receives and then sends to two children. Each rank uses
 * GPU rank % (number of GPUs). An operation armed on a GRAPH condition adds two nodes to the
 * condition's graph and returns them in gsc_condition_out_t: the start node (make it depend on
 * what must come first) and the done node (make later work depend on it). Here the graph is
 *
 *     [recv from parent: start -> done] --> [send to child 1: start -> done]
 *                                       \-> [send to child 2: start -> done]
 *
 * For 8 B, 64 KiB and 4 MiB, REPLAYS times (1000; a tenth for 4 MiB), in batches launched back
 * to back: the root copies the replay's data into the buffer (cuMemcpyHtoDAsync) and launches
 * its graph; every other rank launches its graph and copies the buffer out (cuMemcpyDtoHAsync),
 * all in stream order, and checks every word of every replay. At the end rank 0 gathers every
 * rank's verdict.
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
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
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
    CUresult (*GraphCreate)(CUgraph *, unsigned);
    CUresult (*GraphInstantiate)(CUgraphExec *, CUgraph, unsigned long long);
    CUresult (*GraphLaunch)(CUgraphExec, CUstream);
    CUresult (*GraphExecDestroy)(CUgraphExec);
    CUresult (*GraphDestroy)(CUgraph);
    CUresult (*GetErrorName)(CUresult, const char **);
} cu;
/* cuGraphAddDependencies: the _v2 entry point (CUDA 12.3 and later, with per-edge data, NULL
 * here) where the driver has it, else the original one. */
static CUresult (*graph_add_dependencies_v2)(CUgraph, const CUgraphNode *, const CUgraphNode *, const void *, size_t);
static CUresult (*graph_add_dependencies_v1)(CUgraph, const CUgraphNode *, const CUgraphNode *, size_t);

#define TAG_MASK_ALL (~(uint64_t)0)
#define WAIT_SECONDS 120
#define BATCH_MAX 100
#define BATCH_BYTES ((size_t)16 << 20)

static const size_t sizes[] = {8, 65536, (size_t)4 << 20};
#define NSIZES (sizeof(sizes) / sizeof(sizes[0]))

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
    SYM(GraphCreate, "cuGraphCreate");
    SYM(GraphInstantiate, "cuGraphInstantiateWithFlags");
    SYM(GraphLaunch, "cuGraphLaunch");
    SYM(GraphExecDestroy, "cuGraphExecDestroy");
    SYM(GraphDestroy, "cuGraphDestroy");
    SYM(GetErrorName, "cuGetErrorName");
#undef SYM
    *(void **)&graph_add_dependencies_v2 = dlsym(lib, "cuGraphAddDependencies_v2");
    *(void **)&graph_add_dependencies_v1 = dlsym(lib, "cuGraphAddDependencies");
    /* Every entry point must be there before any is used. */
    for (i = 0; i < sizeof(cu) / sizeof(void *); i++) {
        if (((void **)&cu)[i] == NULL) {
            fprintf(stderr, "libcuda.so.1 lacks an entry point this example uses\n");
            return 0;
        }
    }
    if (graph_add_dependencies_v2 == NULL && graph_add_dependencies_v1 == NULL) {
        fprintf(stderr, "libcuda.so.1 has no cuGraphAddDependencies\n");
        return 0;
    }
    if (cu.Init(0) != 0 || cu.DeviceGetCount(&n) != 0) {
        return 0;
    }
    return n;
}

/* Make `to` run after `from` in graph g. */
static CUresult add_dependency(CUgraph g, CUgraphNode from, CUgraphNode to)
{
    if (graph_add_dependencies_v2 != NULL) {
        return graph_add_dependencies_v2(g, &from, &to, NULL, 1);
    }
    return graph_add_dependencies_v1(g, &from, &to, 1);
}

/* Wait for everything queued on the stream, bounded: gscomm fails an operation whose peer died
 * after GSC_TIMEOUT and releases the graph's waits; this bound is the backstop. */
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

/* Word k of what the root broadcasts in replay `replay` of the broadcast of `size` bytes. */
static uint32_t word(size_t k, int replay, size_t size)
{
    uint32_t x = (uint32_t)k * 2654435761u ^ (uint32_t)replay * 40503u ^ (uint32_t)size * 0x9e3779b9u;
    return x ^ (x >> 15);
}

/* What arming an operation on a graph condition returned: NULL (its two nodes are in the
 * gsc_condition_out_t the request parameters point at), or an error. */
static void arm(gsc_status_ptr_t s, const char *what)
{
    if (GSC_PTR_IS_ERR(s)) {
        fprintf(stderr, "rank %d: FAILED: %s: %s (%s)\n", rank, what, gsc_status_string(GSC_PTR_STATUS(s)),
                gsc_last_error_message());
        exit(1);
    }
    if (GSC_PTR_IS_PTR(s)) {
        /* A graph operation runs with every replay; it has no request of its own. */
        gsc_request_free(s);
    }
}

/* Every rank's worker address, by rank (an allgather of the lengths, then of the addresses
 * padded to the longest). */
static unsigned char *all_addresses(gsc_bootstrap_h boot, gsc_worker_h worker, size_t *block)
{
    void *mine;
    size_t len;
    uint64_t my_len, max = 0, *lens = calloc((size_t)nranks, sizeof(uint64_t));
    unsigned char *padded, *all;
    int r;
    if (lens == NULL) {
        fprintf(stderr, "rank %d: out of memory\n", rank);
        exit(1);
    }
    MUST(gsc_worker_get_address(worker, &mine, &len));
    my_len = len;
    MUST(gsc_bootstrap_allgather(boot, &my_len, sizeof(my_len), lens));
    for (r = 0; r < nranks; r++) {
        max = lens[r] > max ? lens[r] : max;
    }
    padded = calloc(1, (size_t)max);
    all = malloc((size_t)max * (size_t)nranks);
    if (padded == NULL || all == NULL) {
        fprintf(stderr, "rank %d: out of memory\n", rank);
        exit(1);
    }
    memcpy(padded, mine, len);
    MUST(gsc_worker_release_address(worker, mine));
    MUST(gsc_bootstrap_allgather(boot, padded, (size_t)max, all));
    free(padded);
    free(lens);
    *block = (size_t)max;
    return all;
}

/* One size: build this rank's graph, replay it `replays` times, check what arrived. */
static void broadcast(gsc_worker_h worker, gsc_ep_h *child_ep, const int *child, int nchildren, size_t size,
                      int replays, uint64_t tag)
{
    size_t words = size / 4, k;
    int batch = (int)(BATCH_BYTES / size < BATCH_MAX ? BATCH_BYTES / size : BATCH_MAX), done, j, c;
    int before = failures;
    CUdeviceptr buf;
    uint32_t *slots;
    CUgraph graph;
    CUgraphExec exec;
    gsc_condition_param_t cp;
    gsc_condition_h cond;
    gsc_condition_out_t recv_nodes, send_nodes;
    gsc_request_param_t rp;

    CU(cu.MemAlloc(&buf, size));
    CU(cu.MemHostAlloc((void **)&slots, (size_t)batch * size, 0));
    CU(cu.GraphCreate(&graph, 0));

    /* The condition that adds our operations to `graph` (in the current CUDA context). */
    memset(&cp, 0, sizeof(cp));
    cp.field_mask = GSC_CONDITION_PARAM_FIELD_CATEGORY | GSC_CONDITION_PARAM_FIELD_CONTEXT;
    cp.category = GSC_CONDITION_CATEGORY_GRAPH;
    cp.context = graph;
    MUST(gsc_condition_create(&cp, &cond));
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask = GSC_OP_ATTR_FIELD_CONDITION | GSC_OP_ATTR_FIELD_CONDITION_OUT | GSC_OP_ATTR_FIELD_MEMORY_TYPE;
    rp.condition = cond;
    rp.memory_type = GSC_MEMORY_TYPE_CUDA;

    if (rank != 0) {
        rp.condition_out = &recv_nodes;
        arm(gsc_tag_recv_nbx(worker, (void *)(uintptr_t)buf, size, tag, TAG_MASK_ALL, &rp), "receive from the parent");
    }
    for (c = 0; c < nchildren; c++) {
        char what[64];
        sprintf(what, "send to child %d", child[c]);
        rp.condition_out = &send_nodes;
        arm(gsc_tag_send_nbx(child_ep[c], (const void *)(uintptr_t)buf, size, tag, &rp), what);
        if (rank != 0) {
            /* The send starts once the receive is done: the data is in the buffer by then. */
            CU(add_dependency(graph, (CUgraphNode)recv_nodes.done_node, (CUgraphNode)send_nodes.start_node));
        }
    }
    CU(cu.GraphInstantiate(&exec, graph, 0));

    for (done = 0; done < replays; done += batch) {
        int count = replays - done < batch ? replays - done : batch;
        if (rank == 0) {
            for (j = 0; j < count; j++) {
                for (k = 0; k < words; k++) {
                    slots[(size_t)j * words + k] = word(k, done + j, size);
                }
            }
        }
        for (j = 0; j < count; j++) {
            if (rank == 0) {
                CU(cu.MemcpyHtoDAsync(buf, slots + (size_t)j * words, size, stream));
                CU(cu.GraphLaunch(exec, stream));
            } else {
                CU(cu.GraphLaunch(exec, stream));
                CU(cu.MemcpyDtoHAsync(slots + (size_t)j * words, buf, size, stream));
            }
        }
        synchronize("a batch of replays");
        for (j = 0; rank != 0 && j < count; j++) {
            for (k = 0; k < words; k++) {
                uint32_t got = slots[(size_t)j * words + k], want = word(k, done + j, size);
                if (got != want) {
                    if (failures++ < 10) {
                        fprintf(stderr, "rank %d: FAILED: %lu B, replay %d: word %lu is %08x, expected %08x\n", rank,
                                (unsigned long)size, done + j, (unsigned long)k, (unsigned)got, (unsigned)want);
                    }
                    break;
                }
            }
        }
    }
    /* A failed operation releases the graph's waits and is reported here (sticky). */
    {
        gsc_status_t st = gsc_condition_query(cond);
        if (st != GSC_OK) {
            fprintf(stderr, "rank %d: FAILED: %lu B: an operation failed: %s (%s)\n", rank, (unsigned long)size,
                    gsc_status_string(st), gsc_last_error_message());
            failures++;
        }
    }
    printf("rank %d: %lu B x %d replays: %s\n", rank, (unsigned long)size, replays,
           failures != before ? "FAILED" : rank == 0 ? "sent" : "every replay checked");
    CU(cu.GraphExecDestroy(exec));
    CU(cu.GraphDestroy(graph));
    MUST(gsc_condition_destroy(cond));
    CU(cu.MemFreeHost(slots));
    CU(cu.MemFree(buf));
}

int main(int argc, char **argv)
{
    int ngpus, dev, replays = 1000, nchildren = 0, c, r;
    int child[2];
    size_t s, block;
    gsc_config_pair_t overrides[1];
    gsc_params_t params;
    gsc_bootstrap_h boot;
    gsc_context_h context;
    gsc_worker_h worker;
    gsc_ep_h child_ep[2];
    unsigned char *addrs;
    CUcontext cuctx;

    if (argc > 1 && (replays = atoi(argv[1])) <= 0) {
        fprintf(stderr, "usage: %s [REPLAYS]\n", argv[0]);
        return 2;
    }
    ngpus = load_cuda();
    if (ngpus <= 0) {
        printf("skipped: no CUDA driver or no GPU here (this example needs GPUs)\n");
        return 0;
    }
    MUST(gsc_bootstrap_init_from_env(&boot));
    MUST(gsc_bootstrap_rank(boot, &rank));
    MUST(gsc_bootstrap_nranks(boot, &nranks));
    if (nranks < 2) {
        fprintf(stderr, "rank %d: needs at least 2 ranks (3 gives the seed's shape)\n", rank);
        return 2;
    }
    for (c = 1; c <= 2; c++) {
        if (2 * rank + c < nranks) {
            child[nchildren++] = 2 * rank + c;
        }
    }

    CU(cu.DeviceGet(&dev, rank % ngpus));
    CU(cu.DevicePrimaryCtxRetain(&cuctx, dev));
    CU(cu.CtxSetCurrent(cuctx));
    CU(cu.StreamCreate(&stream, CU_STREAM_NON_BLOCKING));

    overrides[0].name = "GSC_TIMEOUT";
    overrides[0].value = "60s";
    memset(&params, 0, sizeof(params));
    params.field_mask = GSC_PARAM_FIELD_CONFIG;
    params.config = overrides;
    params.config_count = 1;
    MUST(gsc_init(&params, &context));
    MUST(gsc_worker_create(context, NULL, &worker));
    /* Endpoints to the children only: a receive needs none (it matches on the worker). */
    addrs = all_addresses(boot, worker, &block);
    for (c = 0; c < nchildren; c++) {
        gsc_ep_params_t epp;
        memset(&epp, 0, sizeof(epp));
        epp.field_mask = GSC_EP_PARAM_FIELD_ADDRESS;
        epp.address = addrs + (size_t)child[c] * block;
        MUST(gsc_ep_create(worker, &epp, &child_ep[c]));
    }
    free(addrs);
    if (rank == 0) {
        printf("rank 0: broadcast tree of %d ranks (parent (r-1)/2, children 2r+1, 2r+2), %d GPU(s)\n", nranks,
               ngpus);
    }

    /* Every rank runs every size whatever its checks found, so no peer waits for ever. */
    for (s = 0; s < NSIZES; s++) {
        int n = sizes[s] >= ((size_t)4 << 20) ? (replays + 9) / 10 : replays;
        broadcast(worker, child_ep, child, nchildren, sizes[s], n, 600 + s);
    }

    /* Everyone's verdict, and everyone done, before anyone closes. */
    {
        int *all = malloc((size_t)nranks * sizeof(int)), bad = 0;
        if (all == NULL) {
            fprintf(stderr, "rank %d: out of memory\n", rank);
            return 1;
        }
        MUST(gsc_bootstrap_allgather(boot, &failures, sizeof(failures), all));
        for (r = 0; r < nranks; r++) {
            bad += all[r] != 0;
        }
        if (rank == 0) {
            if (bad == 0) {
                printf("rank 0: every rank received every replay intact\n");
            } else {
                printf("rank 0: %d rank(s) reported failures\n", bad);
            }
        }
        free(all);
    }
    for (c = 0; c < nchildren; c++) {
        gsc_status_ptr_t p = gsc_ep_close_nbx(child_ep[c], NULL);
        if (GSC_PTR_IS_PTR(p)) {
            MUST(gsc_request_wait(p, NULL));
            gsc_request_free(p);
        } else {
            MUST(GSC_PTR_STATUS(p));
        }
    }
    MUST(gsc_bootstrap_barrier(boot));
    MUST(gsc_worker_destroy(worker));
    MUST(gsc_cleanup(context));
    CU(cu.StreamDestroy(stream));
    CU(cu.DevicePrimaryCtxRelease(dev));
    MUST(gsc_bootstrap_destroy(boot));
    if (failures == 0) {
        printf("rank %d: all checks passed\n", rank);
        return 0;
    }
    fprintf(stderr, "rank %d: %d check(s) failed\n", rank, failures);
    return 1;
}
