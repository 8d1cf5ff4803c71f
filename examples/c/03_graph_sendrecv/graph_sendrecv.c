/*
 * Stream-triggered send/receive between two processes, then the same exchange captured into a
 * CUDA graph and replayed, every message checked.
 *
 *   GSC_NRANKS=2 GSC_BOOTSTRAP_ADDR=127.0.0.1:29500 GSC_BOOTSTRAP_SECRET=$SECRET \
 *       sh -c 'GSC_RANK=0 ./graph_sendrecv [--host] [REPLAYS] & GSC_RANK=1 ./graph_sendrecv ...; wait'
 *
 * Each rank uses GPU rank % (number of GPUs), a non-blocking CUDA stream and a STREAM condition
 * on it. One exchange is a condition group holding a tagged receive from the peer and a tagged
 * send to it (both GSC_OP_ATTR_FLAG_NO_STREAM_WAIT, so both are in flight together and neither
 * rank's send waits behind its own receive) and one gsc_condition_wait: the stream waits for
 * both there. For each message size:
 *   1. stream-triggered: 20 exchanges issued on the live stream, each preceded by a copy of new
 *      data into the send buffer (cuMemcpyHtoDAsync) and followed by a copy of the receive
 *      buffer out to the host (cuMemcpyDtoHAsync), all in stream order;
 *   2. captured: the exchange alone is captured (cuStreamBeginCapture, on a second stream with
 *      its own STREAM condition) into a graph, instantiated once and replayed on the working
 *      stream REPLAYS times (1000; a tenth for the largest size), each replay between the same
 *      two copies, launched back to back in batches.
 * The host writes new data for every exchange and checks every word that arrived.
 *
 * Without a CUDA driver (or GPU), or with --host, the same exchanges run on a gscomm host stream
 * (HOST_STREAM condition) over host memory: the copies become functions queued on the host
 * stream, and phase 2 issues the exchange again each time instead of replaying a graph (there
 * is no graph on a host stream). That is how CI runs this file. The CUDA driver is loaded at run
 * time (dlopen), so the file builds without the CUDA toolkit. Exit status 0: every check passed.
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
#define CU_STREAM_CAPTURE_MODE_RELAXED 2
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
    CUresult (*StreamBeginCapture)(CUstream, int);
    CUresult (*StreamEndCapture)(CUstream, CUgraph *);
    CUresult (*GraphInstantiate)(CUgraphExec *, CUgraph, unsigned long long);
    CUresult (*GraphLaunch)(CUgraphExec, CUstream);
    CUresult (*GraphExecDestroy)(CUgraphExec);
    CUresult (*GraphDestroy)(CUgraph);
    CUresult (*GetErrorName)(CUresult, const char **);
} cu;

#define TAG_MASK_ALL (~(uint64_t)0)
#define STREAM_EXCHANGES 20
#define WAIT_SECONDS 120
/* Pinned host memory per direction for one batch of exchanges (the batch is smaller for large
 * messages). */
#define BATCH_MAX 100
#define BATCH_BYTES ((size_t)16 << 20)

static const size_t sizes[] = {8, 4096, 65536, (size_t)1 << 20};
#define NSIZES (sizeof(sizes) / sizeof(sizes[0]))

static int rank = -1, peer, failures, on_gpu;
/* The working stream (copies, live exchanges, graph launches) and, on a GPU, the stream the
 * exchange is captured on. */
static CUstream stream, capture_stream;
static gsc_host_stream_h host_stream;

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
    SYM(StreamBeginCapture, "cuStreamBeginCapture_v2");
    SYM(StreamEndCapture, "cuStreamEndCapture");
    SYM(GraphInstantiate, "cuGraphInstantiateWithFlags");
    SYM(GraphLaunch, "cuGraphLaunch");
    SYM(GraphExecDestroy, "cuGraphExecDestroy");
    SYM(GraphDestroy, "cuGraphDestroy");
    SYM(GetErrorName, "cuGetErrorName");
#undef SYM
    {
        /* Every entry point must be there before any is used. */
        void **p = (void **)&cu;
        size_t i;
        for (i = 0; i < sizeof(cu) / sizeof(void *); i++) {
            if (p[i] == NULL) {
                fprintf(stderr, "rank %d: libcuda.so.1 lacks an entry point this example uses\n", rank);
                return 0;
            }
        }
    }
    if (cu.Init(0) != 0 || cu.DeviceGetCount(&n) != 0) {
        return 0;
    }
    return n;
}

/* Wait for everything queued on the stream, bounded: a peer that died would otherwise leave
 * us waiting for ever (gscomm fails its operations after GSC_TIMEOUT and releases the stream;
 * this bound is the backstop). */
static void synchronize(const char *what)
{
    if (on_gpu) {
        time_t start = time(NULL);
        struct timespec pause = {0, 50000};
        for (;;) {
            CUresult r = cu.StreamQuery(stream);
            if (r == 0) {
                return;
            }
            if (r != CUDA_ERROR_NOT_READY) {
                fprintf(stderr, "rank %d: FAILED: %s: the stream failed: CUDA error %d (%s)\n", rank,
                        what, r, cu_error_name(r));
                exit(1);
            }
            if (time(NULL) - start > WAIT_SECONDS) {
                fprintf(stderr, "rank %d: FAILED: %s: the stream is still busy after %d s\n", rank,
                        what, WAIT_SECONDS);
                exit(1);
            }
            nanosleep(&pause, NULL);
        }
    } else {
        gsc_status_t st = gsc_host_stream_synchronize(host_stream, (int64_t)WAIT_SECONDS * 1000);
        if (st != GSC_OK) {
            fprintf(stderr, "rank %d: FAILED: %s: %s (%s)\n", rank, what, gsc_status_string(st),
                    gsc_last_error_message());
            exit(1);
        }
    }
}

/* Word k of the message rank `from` sends in exchange `iter`: different in every exchange, so a
 * stale or repeated buffer shows. */
static uint32_t word(size_t k, int iter, int from)
{
    uint32_t x = (uint32_t)k * 2654435761u ^ (uint32_t)iter * 40503u ^ (uint32_t)(from + 1) * 0x9e3779b9u;
    return x ^ (x >> 15);
}

static void fill(uint32_t *buf, size_t words, int iter, int from)
{
    size_t k;
    for (k = 0; k < words; k++) {
        buf[k] = word(k, iter, from);
    }
}

/* Count a wrong message (reporting the first few) and return 0 if buf is not what `from` sent. */
static int check(const uint32_t *buf, size_t words, int iter, int from, size_t size)
{
    size_t k;
    for (k = 0; k < words; k++) {
        if (buf[k] != word(k, iter, from)) {
            if (failures++ < 10) {
                fprintf(stderr, "rank %d: FAILED: %lu-byte message of exchange %d: word %lu is %08x, expected %08x\n",
                        rank, (unsigned long)size, iter, (unsigned long)k, (unsigned)buf[k],
                        (unsigned)word(k, iter, from));
            }
            return 0;
        }
    }
    return 1;
}

/* Host streams: the copies in and out become functions queued on the stream. They run on its
 * thread, in order with the exchanges; `failures` is read by the main thread only after a
 * synchronize. */
struct host_job {
    uint32_t *buf;
    size_t words, size;
    int iter, from;
};

static void host_fill(void *arg)
{
    struct host_job *j = arg;
    fill(j->buf, j->words, j->iter, j->from);
}

static void host_check(void *arg)
{
    struct host_job *j = arg;
    check(j->buf, j->words, j->iter, j->from, j->size);
}

/* What an operation on a stream condition returns: an error, or a request that the stream
 * orders (freed at once: a failure shows in gsc_condition_query and releases the stream), or
 * NULL (under capture: graph nodes, nothing to free). */
static void consume(gsc_status_ptr_t s, const char *what)
{
    if (GSC_PTR_IS_ERR(s)) {
        fprintf(stderr, "rank %d: FAILED: %s: %s (%s)\n", rank, what, gsc_status_string(GSC_PTR_STATUS(s)),
                gsc_last_error_message());
        exit(1);
    } else if (GSC_PTR_IS_PTR(s)) {
        gsc_request_free(s);
    }
}

/* One exchange on the condition's stream: receive and send in one group, then one wait. */
static void exchange(gsc_worker_h worker, gsc_ep_h ep, gsc_condition_h cond, void *sbuf, void *rbuf,
                     size_t size, uint64_t tag)
{
    gsc_request_param_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask = GSC_OP_ATTR_FIELD_CONDITION | GSC_OP_ATTR_FIELD_FLAGS | GSC_OP_ATTR_FIELD_MEMORY_TYPE;
    rp.condition = cond;
    rp.flags = GSC_OP_ATTR_FLAG_NO_STREAM_WAIT;
    rp.memory_type = on_gpu ? GSC_MEMORY_TYPE_CUDA : GSC_MEMORY_TYPE_HOST;
    MUST(gsc_condition_group_start(cond));
    consume(gsc_tag_recv_nbx(worker, rbuf, size, tag, TAG_MASK_ALL, &rp), "receive");
    consume(gsc_tag_send_nbx(ep, sbuf, size, tag, &rp), "send");
    MUST(gsc_condition_wait(cond));
    MUST(gsc_condition_group_end(cond));
}

/* Buffers of one message size: where the exchange reads and writes (GPU or host memory), and on
 * a GPU the pinned host slots the copies go through, one per exchange of a batch. */
struct bufs {
    size_t size, words;
    int batch;
    void *sbuf, *rbuf;
    uint32_t *hsend, *hrecv;
};

/* Exchanges first .. first + count - 1 (count <= batch): issued one by one on the stream, or
 * (exec != NULL) as replays of the captured exchange; then the host checks them all. */
static void run_batch(gsc_worker_h worker, gsc_ep_h ep, gsc_condition_h cond, struct bufs *b,
                      uint64_t tag, CUgraphExec exec, int first, int count)
{
    int j;
    if (on_gpu) {
        for (j = 0; j < count; j++) {
            fill(b->hsend + (size_t)j * b->words, b->words, first + j, rank);
        }
        for (j = 0; j < count; j++) {
            CU(cu.MemcpyHtoDAsync((CUdeviceptr)(uintptr_t)b->sbuf, b->hsend + (size_t)j * b->words, b->size, stream));
            if (exec != NULL) {
                CU(cu.GraphLaunch(exec, stream));
            } else {
                exchange(worker, ep, cond, b->sbuf, b->rbuf, b->size, tag);
            }
            CU(cu.MemcpyDtoHAsync(b->hrecv + (size_t)j * b->words, (CUdeviceptr)(uintptr_t)b->rbuf, b->size, stream));
        }
        synchronize("a batch of exchanges");
        for (j = 0; j < count; j++) {
            check(b->hrecv + (size_t)j * b->words, b->words, first + j, peer, b->size);
        }
    } else {
        struct host_job *jobs = malloc(2 * (size_t)count * sizeof(*jobs));
        if (jobs == NULL) {
            fprintf(stderr, "rank %d: out of memory\n", rank);
            exit(1);
        }
        for (j = 0; j < count; j++) {
            struct host_job *in = &jobs[2 * j], *out = &jobs[2 * j + 1];
            in->buf = b->sbuf, in->words = b->words, in->size = b->size, in->iter = first + j, in->from = rank;
            *out = *in;
            out->buf = b->rbuf, out->from = peer;
            MUST(gsc_host_stream_launch(host_stream, host_fill, in));
            exchange(worker, ep, cond, b->sbuf, b->rbuf, b->size, tag);
            MUST(gsc_host_stream_launch(host_stream, host_check, out));
        }
        synchronize("a batch of exchanges");
        free(jobs);
    }
}

static void alloc_bufs(struct bufs *b, size_t size)
{
    b->size = size;
    b->words = size / 4;
    b->batch = (int)(BATCH_BYTES / size < BATCH_MAX ? BATCH_BYTES / size : BATCH_MAX);
    if (on_gpu) {
        CUdeviceptr s, r;
        CU(cu.MemAlloc(&s, size));
        CU(cu.MemAlloc(&r, size));
        b->sbuf = (void *)(uintptr_t)s;
        b->rbuf = (void *)(uintptr_t)r;
        CU(cu.MemHostAlloc((void **)&b->hsend, (size_t)b->batch * size, 0));
        CU(cu.MemHostAlloc((void **)&b->hrecv, (size_t)b->batch * size, 0));
    } else {
        b->sbuf = calloc(1, size);
        b->rbuf = calloc(1, size);
        b->hsend = b->hrecv = NULL;
        if (b->sbuf == NULL || b->rbuf == NULL) {
            fprintf(stderr, "rank %d: out of memory\n", rank);
            exit(1);
        }
    }
}

static void free_bufs(struct bufs *b)
{
    if (on_gpu) {
        CU(cu.MemFree((CUdeviceptr)(uintptr_t)b->sbuf));
        CU(cu.MemFree((CUdeviceptr)(uintptr_t)b->rbuf));
        CU(cu.MemFreeHost(b->hsend));
        CU(cu.MemFreeHost(b->hrecv));
    } else {
        free(b->sbuf);
        free(b->rbuf);
    }
}

/* Exchange worker addresses through the bootstrap (allgather of the lengths, then of the
 * addresses padded to the longest) and connect to the other rank. */
static gsc_ep_h connect_peer(gsc_bootstrap_h boot, gsc_worker_h worker)
{
    void *mine;
    size_t len;
    uint64_t my_len, lens[2], max;
    unsigned char *block, *all;
    gsc_ep_params_t epp;
    gsc_ep_h ep;

    MUST(gsc_worker_get_address(worker, &mine, &len));
    my_len = len;
    MUST(gsc_bootstrap_allgather(boot, &my_len, sizeof(my_len), lens));
    max = lens[0] > lens[1] ? lens[0] : lens[1];
    block = calloc(1, (size_t)max);
    all = malloc(2 * (size_t)max);
    if (block == NULL || all == NULL) {
        fprintf(stderr, "rank %d: out of memory\n", rank);
        exit(1);
    }
    memcpy(block, mine, len);
    MUST(gsc_worker_release_address(worker, mine));
    MUST(gsc_bootstrap_allgather(boot, block, (size_t)max, all));
    memset(&epp, 0, sizeof(epp));
    epp.field_mask = GSC_EP_PARAM_FIELD_ADDRESS | GSC_EP_PARAM_FIELD_ADDRESS_LENGTH;
    epp.address = all + (size_t)peer * (size_t)max;
    epp.address_length = (size_t)lens[peer];
    MUST(gsc_ep_create(worker, &epp, &ep));
    free(block);
    free(all);
    return ep;
}

int main(int argc, char **argv)
{
    int nranks, ngpus = 0, force_host = 0, replays = 1000, i, dev = -1;
    size_t s;
    gsc_config_pair_t overrides[1];
    gsc_params_t params;
    gsc_bootstrap_h boot;
    gsc_context_h context;
    gsc_worker_h worker;
    gsc_ep_h ep;
    gsc_condition_param_t cp;
    gsc_condition_h cond, capture_cond = NULL;
    CUcontext cuctx = NULL;

    for (i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--host") == 0) {
            force_host = 1;
        } else if (atoi(argv[i]) > 0) {
            replays = atoi(argv[i]);
        } else {
            fprintf(stderr, "usage: %s [--host] [REPLAYS]\n", argv[0]);
            return 2;
        }
    }
    MUST(gsc_bootstrap_init_from_env(&boot));
    MUST(gsc_bootstrap_rank(boot, &rank));
    MUST(gsc_bootstrap_nranks(boot, &nranks));
    if (nranks != 2) {
        fprintf(stderr, "rank %d: this example needs exactly 2 ranks, not %d\n", rank, nranks);
        return 2;
    }
    peer = 1 - rank;
    ngpus = force_host ? 0 : load_cuda();
    on_gpu = ngpus > 0;
    /* Both ranks must run the same kind of exchange (a GPU buffer would pair with a host buffer
     * just fine, but the report would be confusing): agree on the smaller. */
    {
        int mine = on_gpu, both[2];
        MUST(gsc_bootstrap_allgather(boot, &mine, sizeof(mine), both));
        on_gpu = both[0] && both[1];
    }
    if (on_gpu) {
        CU(cu.DeviceGet(&dev, rank % ngpus));
        CU(cu.DevicePrimaryCtxRetain(&cuctx, dev));
        CU(cu.CtxSetCurrent(cuctx));
        CU(cu.StreamCreate(&stream, CU_STREAM_NON_BLOCKING));
        CU(cu.StreamCreate(&capture_stream, CU_STREAM_NON_BLOCKING));
    } else {
        MUST(gsc_host_stream_create(&host_stream));
    }

    overrides[0].name = "GSC_TIMEOUT";
    overrides[0].value = "60s";
    memset(&params, 0, sizeof(params));
    params.field_mask = GSC_PARAM_FIELD_CONFIG;
    params.config = overrides;
    params.config_count = 1;
    MUST(gsc_init(&params, &context));
    MUST(gsc_worker_create(context, NULL, &worker));
    ep = connect_peer(boot, worker);

    memset(&cp, 0, sizeof(cp));
    cp.field_mask = GSC_CONDITION_PARAM_FIELD_CATEGORY | GSC_CONDITION_PARAM_FIELD_CONTEXT;
    cp.category = on_gpu ? GSC_CONDITION_CATEGORY_STREAM : GSC_CONDITION_CATEGORY_HOST_STREAM;
    cp.context = on_gpu ? (void *)stream : (void *)host_stream;
    MUST(gsc_condition_create(&cp, &cond));
    if (on_gpu) {
        /* The exchange is captured on a stream of its own, through a condition of its own, and
         * the graph is launched on the working stream: the capture then holds only the
         * exchange, whatever else the working stream has queued. */
        cp.context = capture_stream;
        MUST(gsc_condition_create(&cp, &capture_cond));
    }

    /* Every rank runs every exchange even after a failed check, so the peer is never left
     * waiting for a message that does not come. */
    for (s = 0; s < NSIZES; s++) {
        struct bufs b;
        uint64_t tag = 300 + s; /* one tag per size: a late message never meets another size */
        int n = sizes[s] >= ((size_t)1 << 20) ? (replays + 9) / 10 : replays, done;
        CUgraph graph = NULL;
        CUgraphExec exec = NULL;
        alloc_bufs(&b, sizes[s]);

        /* 1. On the live stream. */
        for (done = 0; done < STREAM_EXCHANGES; done += b.batch) {
            int count = STREAM_EXCHANGES - done < b.batch ? STREAM_EXCHANGES - done : b.batch;
            run_batch(worker, ep, cond, &b, tag, NULL, done, count);
        }

        /* 2. Captured once, replayed (host streams: issued again each time). */
        if (on_gpu) {
            CU(cu.StreamBeginCapture(capture_stream, CU_STREAM_CAPTURE_MODE_RELAXED));
            exchange(worker, ep, capture_cond, b.sbuf, b.rbuf, b.size, tag);
            CU(cu.StreamEndCapture(capture_stream, &graph));
            CU(cu.GraphInstantiate(&exec, graph, 0));
        }
        for (done = 0; done < n; done += b.batch) {
            int count = n - done < b.batch ? n - done : b.batch;
            run_batch(worker, ep, cond, &b, tag, exec, STREAM_EXCHANGES + done, count);
        }
        if (on_gpu) {
            CU(cu.GraphExecDestroy(exec));
            CU(cu.GraphDestroy(graph));
        }
        free_bufs(&b);
        printf("rank %d: %lu B: %d exchanges on the stream, %d %s: %s\n", rank, (unsigned long)sizes[s],
               STREAM_EXCHANGES, n, on_gpu ? "graph replays" : "more on the host stream",
               failures == 0 ? "all checked" : "FAILED");
    }
    MUST(gsc_condition_query(cond));
    if (on_gpu) {
        MUST(gsc_condition_query(capture_cond));
    }

    /* Both are done with each other before either closes. */
    MUST(gsc_bootstrap_barrier(boot));
    {
        gsc_status_ptr_t c = gsc_ep_close_nbx(ep, NULL);
        if (GSC_PTR_IS_PTR(c)) {
            MUST(gsc_request_wait(c, NULL));
            gsc_request_free(c);
        } else {
            MUST(GSC_PTR_STATUS(c));
        }
    }
    MUST(gsc_bootstrap_barrier(boot));
    MUST(gsc_condition_destroy(cond));
    if (on_gpu) {
        MUST(gsc_condition_destroy(capture_cond));
    }
    MUST(gsc_worker_destroy(worker));
    MUST(gsc_cleanup(context));
    if (on_gpu) {
        CU(cu.StreamDestroy(stream));
        CU(cu.StreamDestroy(capture_stream));
        CU(cu.DevicePrimaryCtxRelease(dev));
    } else {
        MUST(gsc_host_stream_destroy(host_stream));
    }
    MUST(gsc_bootstrap_destroy(boot));
    if (failures == 0) {
        printf("rank %d: all checks passed (%s)\n", rank, on_gpu ? "CUDA stream and graph" : "host stream");
        return 0;
    }
    fprintf(stderr, "rank %d: %d check(s) failed\n", rank, failures);
    return 1;
}
