/*
 * A 2-D halo exchange (four neighbours, periodic) with prepared transfers, captured once into a
 * CUDA graph and replayed, checking every halo after every step.
 *
 *   GSC_NRANKS=4 GSC_BOOTSTRAP_ADDR=127.0.0.1:29500 GSC_BOOTSTRAP_SECRET=$SECRET \
 *       sh -c 'for r in 0 1 2 3; do GSC_RANK=$r ./halo [--gpu-rounds] [STEPS] & done; wait'
 *
 * The ranks form a PX x PY grid (PX * PY = GSC_NRANKS, PY = 1 gives a 1-D ring); rank r uses GPU
 * r % (number of GPUs). Each rank prepares, once, a send to and a receive from each neighbour
 * (gsc_prepare_transfers), on its own endpoint to that neighbour; a message travelling east
 * carries the tag EAST, so a neighbour that is both west and east (PX = 2) still pairs each
 * transfer with the right one. One step is: copy the four outgoing halos from page-locked host
 * memory into GPU buffers, start the four receives and the four sends in one condition group,
 * wait, copy the four incoming halos back to host memory. Step 0 runs on the stream directly
 * (pairing happens there); the same step is then captured from the stream into a CUDA graph and
 * replayed STEPS times, the host writing new halo contents before each replay and checking what
 * arrived after it. With --gpu-rounds the rounds run on the GPU (GSC_PREPARE_FLAG_GPU_ROUNDS):
 * one kernel per step writes into the neighbours over NVLink, no proxy thread involved.
 *
 * The CUDA driver is loaded at run time (dlopen), so this file builds without the CUDA toolkit;
 * without a driver it says so and exits 0. Exit status 0: every halo of every step was right.
 */
#define _POSIX_C_SOURCE 200809L
#include <gsc.h>

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The few CUDA driver API types and entry points used here (cuda.h's definitions). */
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;
static struct {
    CUresult (*Init)(unsigned);
    CUresult (*DeviceGetCount)(int *);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, int);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*MemAlloc)(CUdeviceptr *, size_t);
    CUresult (*MemHostAlloc)(void **, size_t, unsigned);
    CUresult (*StreamCreate)(CUstream *, unsigned);
    CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*MemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*StreamBeginCapture)(CUstream, int);
    CUresult (*StreamEndCapture)(CUstream, CUgraph *);
    CUresult (*GraphInstantiate)(CUgraphExec *, CUgraph, unsigned long long);
    CUresult (*GraphLaunch)(CUgraphExec, CUstream);
    CUresult (*StreamSynchronize)(CUstream);
} cu;

enum { WEST, EAST, SOUTH, NORTH, NDIRS };
static const char *dir_name[NDIRS] = {"west", "east", "south", "north"};
#define OPPOSITE(d) ((d) ^ 1)
#define HALO ((size_t)4096)

static int rank = -1, failures = 0;

#define MUST(_call)                                                                           \
    do {                                                                                      \
        gsc_status_t _st = (_call);                                                           \
        if (_st != GSC_OK) {                                                                  \
            fprintf(stderr, "rank %d: FAILED: %s: %s (%s)\n", rank, #_call,                   \
                    gsc_status_string(_st), gsc_last_error_message());                        \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

#define CU(_call)                                                                             \
    do {                                                                                      \
        CUresult _r = (_call);                                                                \
        if (_r != 0) {                                                                        \
            fprintf(stderr, "rank %d: FAILED: %s: CUDA error %d\n", rank, #_call, _r);       \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

/* Load the driver; 0 when there is none. */
static int load_cuda(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == NULL) {
        return 0;
    }
#define SYM(field, name) *(void **)&cu.field = dlsym(lib, name)
    SYM(Init, "cuInit");
    SYM(DeviceGetCount, "cuDeviceGetCount");
    SYM(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    SYM(CtxSetCurrent, "cuCtxSetCurrent");
    SYM(MemAlloc, "cuMemAlloc_v2");
    SYM(MemHostAlloc, "cuMemHostAlloc");
    SYM(StreamCreate, "cuStreamCreate");
    SYM(MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
    SYM(MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
    SYM(StreamBeginCapture, "cuStreamBeginCapture_v2");
    SYM(StreamEndCapture, "cuStreamEndCapture");
    SYM(GraphInstantiate, "cuGraphInstantiateWithFlags");
    SYM(GraphLaunch, "cuGraphLaunch");
    SYM(StreamSynchronize, "cuStreamSynchronize");
#undef SYM
    return cu.Init != NULL && cu.GraphLaunch != NULL && cu.Init(0) == 0;
}

/* The halo byte i that `from` sends in direction d at step s. */
static unsigned char halo_byte(size_t i, int step, int from, int d)
{
    return (unsigned char)(i * 31u + (unsigned)step * 7u + (unsigned)from * 13u + (unsigned)d * 101u + (i >> 7));
}

/* Start a round on the stream. A request, if one comes back, is freed at once: the stream
 * orders the round, and its completion is not needed on the host. */
static void start(gsc_prepared_h p, const gsc_request_param_t *rp)
{
    gsc_status_ptr_t s = gsc_prepared_start(p, rp);
    if (GSC_PTR_IS_ERR(s)) {
        MUST(GSC_PTR_STATUS(s));
    } else if (GSC_PTR_IS_PTR(s)) {
        gsc_request_free(s);
    }
}

/* Every rank's worker address, by rank (an allgather of fixed-size blocks). */
static unsigned char *all_addresses(gsc_bootstrap_h boot, gsc_worker_h worker, int nranks, size_t *block)
{
    void *mine;
    size_t len;
    uint64_t my_len, max = 0, *lens = calloc((size_t)nranks, sizeof(uint64_t));
    unsigned char *padded, *all;
    int r;
    MUST(gsc_worker_get_address(worker, &mine, &len));
    my_len = len;
    MUST(gsc_bootstrap_allgather(boot, &my_len, sizeof(my_len), lens));
    for (r = 0; r < nranks; r++) {
        max = lens[r] > max ? lens[r] : max;
    }
    padded = calloc(1, (size_t)max);
    all = malloc((size_t)max * (size_t)nranks);
    memcpy(padded, mine, len);
    MUST(gsc_worker_release_address(worker, mine));
    MUST(gsc_bootstrap_allgather(boot, padded, (size_t)max, all));
    free(padded);
    free(lens);
    *block = (size_t)max;
    return all;
}

int main(int argc, char **argv)
{
    int nranks, px, py, x, y, d, ndirs, ndev, step, steps = 1000, gpu_rounds = 0, i;
    int nbr[NDIRS];
    gsc_bootstrap_h boot;
    gsc_context_h context;
    gsc_worker_h worker;
    gsc_ep_h ep[NDIRS] = {0};
    gsc_prepared_h tx[NDIRS], rx[NDIRS];
    gsc_condition_h cond;
    gsc_condition_param_t cp;
    gsc_request_param_t rp;
    CUcontext cuctx;
    CUstream stream;
    CUgraph graph;
    CUgraphExec exec;
    CUdeviceptr dsend[NDIRS], drecv[NDIRS];
    unsigned char *hsend, *hrecv, *addrs;
    size_t block;

    for (i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--gpu-rounds") == 0) {
            gpu_rounds = 1;
        } else {
            steps = atoi(argv[i]);
        }
    }
    if (!load_cuda()) {
        printf("skipped: no CUDA driver here (this example needs GPUs)\n");
        return 0;
    }
    MUST(gsc_bootstrap_init_from_env(&boot));
    MUST(gsc_bootstrap_rank(boot, &rank));
    MUST(gsc_bootstrap_nranks(boot, &nranks));
    for (px = 1; px * px <= nranks; px++) {
    }
    while (nranks % --px != 0) {
    }
    if (px < 2) {
        px = nranks;
    }
    py = nranks / px;
    if (nranks < 2) {
        fprintf(stderr, "rank %d: needs at least 2 ranks\n", rank);
        return 2;
    }
    x = rank % px;
    y = rank / px;
    nbr[WEST] = y * px + (x + px - 1) % px;
    nbr[EAST] = y * px + (x + 1) % px;
    nbr[SOUTH] = ((y + py - 1) % py) * px + x;
    nbr[NORTH] = ((y + 1) % py) * px + x;
    ndirs = py > 1 ? NDIRS : 2;

    CU(cu.DeviceGetCount(&ndev));
    CU(cu.DevicePrimaryCtxRetain(&cuctx, rank % ndev));
    CU(cu.CtxSetCurrent(cuctx));
    CU(cu.StreamCreate(&stream, 1 /* non-blocking */));
    CU(cu.MemHostAlloc((void **)&hsend, NDIRS * HALO, 0));
    CU(cu.MemHostAlloc((void **)&hrecv, NDIRS * HALO, 0));

    MUST(gsc_init(NULL, &context));
    MUST(gsc_worker_create(context, NULL, &worker));
    addrs = all_addresses(boot, worker, nranks, &block);
    for (d = 0; d < ndirs; d++) {
        int e;
        gsc_ep_params_t epp;
        gsc_buffer_param_t bp;
        for (e = 0; e < d; e++) {
            if (nbr[e] == nbr[d]) {
                ep[d] = ep[e]; /* one endpoint per neighbour */
            }
        }
        if (ep[d] == NULL) {
            memset(&epp, 0, sizeof(epp));
            epp.field_mask = GSC_EP_PARAM_FIELD_ADDRESS;
            epp.address = addrs + (size_t)nbr[d] * block;
            MUST(gsc_ep_create(worker, &epp, &ep[d]));
        }
        CU(cu.MemAlloc(&dsend[d], HALO));
        CU(cu.MemAlloc(&drecv[d], HALO));
        memset(&bp, 0, sizeof(bp));
        bp.field_mask = GSC_BUFFER_PARAM_FIELD_MEMORY_TYPE | (gpu_rounds ? GSC_BUFFER_PARAM_FIELD_FLAGS : 0);
        bp.memory_type = GSC_MEMORY_TYPE_CUDA;
        bp.flags = gpu_rounds ? GSC_PREPARE_FLAG_GPU_ROUNDS : 0;
        bp.length = HALO;
        /* Travelling east carries the tag EAST: what arrives from the west side was sent east. */
        bp.direction = GSC_PREPARE_SEND;
        bp.buffer = (void *)(uintptr_t)dsend[d];
        bp.tag = (uint64_t)d;
        MUST(gsc_prepare_transfers(ep[d], &tx[d], &bp));
        bp.direction = GSC_PREPARE_RECV;
        bp.buffer = (void *)(uintptr_t)drecv[d];
        bp.tag = (uint64_t)OPPOSITE(d);
        MUST(gsc_prepare_transfers(ep[d], &rx[d], &bp));
    }
    free(addrs);

    memset(&cp, 0, sizeof(cp));
    cp.field_mask = GSC_CONDITION_PARAM_FIELD_CATEGORY | GSC_CONDITION_PARAM_FIELD_CONTEXT;
    cp.category = GSC_CONDITION_CATEGORY_STREAM;
    cp.context = stream;
    MUST(gsc_condition_create(&cp, &cond));
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask = GSC_OP_ATTR_FIELD_CONDITION | GSC_OP_ATTR_FIELD_FLAGS;
    rp.condition = cond;
    rp.flags = GSC_OP_ATTR_FLAG_NO_STREAM_WAIT;

    for (step = 0; step <= steps; step++) {
        for (d = 0; d < ndirs; d++) {
            size_t k;
            for (k = 0; k < HALO; k++) {
                hsend[(size_t)d * HALO + k] = halo_byte(k, step, rank, d);
            }
        }
        if (step <= 1) {
            /* Step 0 on the stream; step 1 is captured once, then every step replays it. */
            if (step == 1) {
                CU(cu.StreamBeginCapture(stream, 2 /* relaxed */));
            }
            for (d = 0; d < ndirs; d++) {
                CU(cu.MemcpyHtoDAsync(dsend[d], hsend + (size_t)d * HALO, HALO, stream));
            }
            MUST(gsc_condition_group_start(cond));
            for (d = 0; d < ndirs; d++) {
                start(rx[d], &rp);
            }
            for (d = 0; d < ndirs; d++) {
                start(tx[d], &rp);
            }
            MUST(gsc_condition_wait(cond));
            MUST(gsc_condition_group_end(cond));
            for (d = 0; d < ndirs; d++) {
                CU(cu.MemcpyDtoHAsync(hrecv + (size_t)d * HALO, drecv[d], HALO, stream));
            }
            if (step == 1) {
                CU(cu.StreamEndCapture(stream, &graph));
                CU(cu.GraphInstantiate(&exec, graph, 0));
            }
        }
        if (step >= 1) {
            CU(cu.GraphLaunch(exec, stream));
        }
        CU(cu.StreamSynchronize(stream));
        /* What arrived on side d was sent in the opposite direction by the neighbour there. */
        for (d = 0; d < ndirs; d++) {
            size_t k;
            for (k = 0; k < HALO; k++) {
                unsigned char want = halo_byte(k, step, nbr[d], OPPOSITE(d));
                if (hrecv[(size_t)d * HALO + k] != want) {
                    fprintf(stderr, "rank %d: FAILED: step %d, %s halo byte %lu is %u, expected %u\n", rank, step,
                            dir_name[d], (unsigned long)k, hrecv[(size_t)d * HALO + k], want);
                    failures++;
                    break;
                }
            }
        }
        if (failures) {
            break;
        }
    }
    MUST(gsc_condition_query(cond));
    if (gpu_rounds) {
        for (d = 0; d < ndirs; d++) {
            uint64_t bad_tx = 0, bad_rx = 0;
            MUST(gsc_prepared_gpu_error(tx[d], &bad_tx));
            MUST(gsc_prepared_gpu_error(rx[d], &bad_rx));
            if (bad_tx || bad_rx) {
                fprintf(stderr, "rank %d: FAILED: %s rounds gave up (%lu, %lu)\n", rank, dir_name[d],
                        (unsigned long)bad_tx, (unsigned long)bad_rx);
                failures++;
            }
        }
    }
    /* Everyone is done before anyone releases. */
    MUST(gsc_bootstrap_barrier(boot));
    for (d = 0; d < ndirs; d++) {
        MUST(gsc_release_preparations(ep[d], tx[d]));
        MUST(gsc_release_preparations(ep[d], rx[d]));
    }
    MUST(gsc_bootstrap_barrier(boot));
    for (d = 0; d < ndirs; d++) {
        int e, first = 1;
        for (e = 0; e < d; e++) {
            first &= ep[e] != ep[d];
        }
        if (first) {
            gsc_status_ptr_t c = gsc_ep_close_nbx(ep[d], NULL);
            if (GSC_PTR_IS_PTR(c)) {
                MUST(gsc_request_wait(c, NULL));
                gsc_request_free(c);
            } else {
                MUST(GSC_PTR_STATUS(c));
            }
        }
    }
    MUST(gsc_bootstrap_barrier(boot));
    MUST(gsc_condition_destroy(cond));
    MUST(gsc_worker_destroy(worker));
    MUST(gsc_cleanup(context));
    MUST(gsc_bootstrap_destroy(boot));
    if (failures == 0) {
        printf("rank %d: %d x %d grid, %d steps%s: all halos checked\n", rank, px, py, steps,
               gpu_rounds ? " (GPU rounds)" : "");
        return 0;
    }
    return 1;
}
