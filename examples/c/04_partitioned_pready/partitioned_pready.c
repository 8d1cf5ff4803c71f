/*
 * A partitioned send whose partitions are produced and marked ready by a CUDA kernel
 * (MPI_Pready on the device): gscomm's gsc_pready() from include/gsc_device.cuh, the kernel
 * compiled at run time with NVRTC.
 *
 *   GSC_NRANKS=2 GSC_BOOTSTRAP_ADDR=127.0.0.1:29500 GSC_BOOTSTRAP_SECRET=$SECRET \
 *       sh -c 'GSC_RANK=0 ./partitioned_pready [--header PATH] [ROUNDS] & GSC_RANK=1 ./partitioned_pready ...; wait'
 *
 * Rank 0 prepares a partitioned send of 4 MiB in 8 partitions to rank 1, which prepares the
 * matching partitioned receive (gsc_prepare_transfers with GSC_BUFFER_PARAM_FIELD_PARTITIONS and
 * GSC_PREPARE_FLAG_GPU_ROUNDS: the GPUs run the rounds themselves, no proxy thread; the two
 * processes must share a host, with CUDA IPC between their GPUs). Each round:
 *   rank 0: gsc_prepared_start on its stream (a STREAM condition) begins the round; then one
 *           kernel of 8 blocks: block b computes partition 7 - b of this round's data and
 *           sends it with gsc_pready(d, 7 - b) — the partitions go out in reverse order, from
 *           concurrent blocks, each as soon as it is ready;
 *   rank 1: gsc_prepared_start on its stream says "ready" and makes the stream wait until
 *           every partition arrived; then a kernel checks every byte and that gsc_parrived()
 *           reports every partition.
 * `d` is the device address gsc_prepared_device_handle() returns. After ROUNDS rounds (200)
 * rank 1 also checks the last round's bytes on the host, and both check
 * gsc_prepared_gpu_error() (a round a kernel gave up on after GSC_TIMEOUT).
 *
 * The kernels are compiled at run time with NVRTC (libnvrtc.so, loaded with dlopen: put the CUDA
 * toolkit's lib64 on LD_LIBRARY_PATH) together with gsc_device.cuh, found — in this order — at
 * --header PATH, at the path the macro GSC_DEVICE_HEADER_PATH names when the program was compiled
 * (-DGSC_DEVICE_HEADER_PATH='"..."'), or beside the loaded libgscomm (LIBDIR/../include, as
 * installed, and LIBDIR/../../include, a cargo build tree). The CUDA driver is loaded at run time
 * too, so the file builds without the CUDA toolkit; without a driver, a GPU or NVRTC it says
 * "skipped" and exits 0. Exit status 0: every check passed.
 */
#define _GNU_SOURCE /* dladdr: where libgscomm was loaded from */
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
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
#define CUDA_ERROR_NOT_READY 600
#define CU_STREAM_NON_BLOCKING 1
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR 76
static struct {
    CUresult (*Init)(unsigned);
    CUresult (*DeviceGetCount)(int *);
    CUresult (*DeviceGet)(int *, int);
    CUresult (*DeviceGetAttribute)(int *, int, int);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, int);
    CUresult (*DevicePrimaryCtxRelease)(int);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*MemAlloc)(CUdeviceptr *, size_t);
    CUresult (*MemFree)(CUdeviceptr);
    CUresult (*MemHostAlloc)(void **, size_t, unsigned);
    CUresult (*MemFreeHost)(void *);
    CUresult (*MemsetD32Async)(CUdeviceptr, unsigned, size_t, CUstream);
    CUresult (*MemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*StreamCreate)(CUstream *, unsigned);
    CUresult (*StreamDestroy)(CUstream);
    CUresult (*StreamQuery)(CUstream);
    CUresult (*ModuleLoadData)(CUmodule *, const void *);
    CUresult (*ModuleUnload)(CUmodule);
    CUresult (*ModuleGetFunction)(CUfunction *, CUmodule, const char *);
    CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void **, void **);
    CUresult (*GetErrorName)(CUresult, const char **);
} cu;

/* The NVRTC entry points used here (nvrtc.h's definitions). */
typedef int nvrtcResult;
typedef struct _nvrtcProgram *nvrtcProgram;
static struct {
    nvrtcResult (*Version)(int *, int *);
    nvrtcResult (*CreateProgram)(nvrtcProgram *, const char *, const char *, int, const char *const *,
                                 const char *const *);
    nvrtcResult (*CompileProgram)(nvrtcProgram, int, const char *const *);
    nvrtcResult (*GetCUBINSize)(nvrtcProgram, size_t *);
    nvrtcResult (*GetCUBIN)(nvrtcProgram, char *);
    nvrtcResult (*GetProgramLogSize)(nvrtcProgram, size_t *);
    nvrtcResult (*GetProgramLog)(nvrtcProgram, char *);
    nvrtcResult (*DestroyProgram)(nvrtcProgram *);
    const char *(*GetErrorString)(nvrtcResult);
} nvrtc;

#define PARTS 8
#define LENGTH ((size_t)4 << 20)
#define THREADS 256
#define TAG 4
#define WAIT_SECONDS 120

/* The kernels: C++ for NVRTC, with gsc_device.cuh as its one header. The byte pattern is the
 * same function as pattern() below, so the host can check a round too. */
static const char kernels[] =
    "#include \"gsc_device.cuh\"\n"
    "\n"
    "/* Byte i of round r's message. */\n"
    "__device__ unsigned char pattern(unsigned long long i, unsigned long long r)\n"
    "{\n"
    "    unsigned long long x = (i + 1) * 0x9E3779B97F4A7C15ULL ^ (r + 1) * 0xBF58476D1CE4E5B9ULL;\n"
    "    x ^= x >> 31;\n"
    "    x *= 0x94D049BB133111EBULL;\n"
    "    x ^= x >> 29;\n"
    "    return (unsigned char)x;\n"
    "}\n"
    "\n"
    "/* Sender, one block per partition: block b produces partition parts - 1 - b of round r and\n"
    " * sends it (every thread of the block calls gsc_pready, after the block's writes). */\n"
    "extern \"C\" __global__ void produce_and_pready(const gsc_prepared_device_t *d, unsigned char *buf,\n"
    "                                               unsigned long long r, unsigned long long *errors)\n"
    "{\n"
    "    unsigned long long part = d->parts - 1 - blockIdx.x, n = d->part_len;\n"
    "    for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x)\n"
    "        buf[part * n + i] = pattern(part * n + i, r);\n"
    "    __syncthreads();\n"
    "    if (gsc_pready(d, part) != 0 && threadIdx.x == 0)\n"
    "        atomicAdd(&errors[0], 1ULL); /* the receiver never became ready (GSC_TIMEOUT) */\n"
    "}\n"
    "\n"
    "/* Receiver, after the round ended on the stream: every byte is round r's and every partition\n"
    " * reports arrived. errors[0] counts what is wrong, errors[1] the rounds checked. */\n"
    "extern \"C\" __global__ void check_round(const gsc_prepared_device_t *d, const unsigned char *buf,\n"
    "                                        unsigned long long n, unsigned long long r,\n"
    "                                        unsigned long long *errors)\n"
    "{\n"
    "    unsigned long long bad = 0;\n"
    "    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;\n"
    "         i += (unsigned long long)gridDim.x * blockDim.x)\n"
    "        bad += buf[i] != pattern(i, r);\n"
    "    if (blockIdx.x == 0 && threadIdx.x < d->parts && !gsc_parrived(d, threadIdx.x))\n"
    "        bad++;\n"
    "    if (bad)\n"
    "        atomicAdd(&errors[0], bad);\n"
    "    if (blockIdx.x == 0 && threadIdx.x == 0)\n"
    "        atomicAdd(&errors[1], 1ULL);\n"
    "}\n";

/* pattern() of the kernels, on the host. */
static unsigned char pattern(unsigned long long i, unsigned long long r)
{
    unsigned long long x = (i + 1) * 0x9E3779B97F4A7C15ULL ^ (r + 1) * 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 31;
    x *= 0x94D049BB133111EBULL;
    x ^= x >> 29;
    return (unsigned char)x;
}

static int rank = -1;
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

/* Every entry point of a table loaded with dlsym must be there before any is used. */
static int all_loaded(const void *table, size_t bytes)
{
    size_t i;
    for (i = 0; i < bytes / sizeof(void *); i++) {
        if (((void *const *)table)[i] == NULL) {
            return 0;
        }
    }
    return 1;
}

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
    SYM(DeviceGetAttribute, "cuDeviceGetAttribute");
    SYM(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    SYM(DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    SYM(CtxSetCurrent, "cuCtxSetCurrent");
    SYM(MemAlloc, "cuMemAlloc_v2");
    SYM(MemFree, "cuMemFree_v2");
    SYM(MemHostAlloc, "cuMemHostAlloc");
    SYM(MemFreeHost, "cuMemFreeHost");
    SYM(MemsetD32Async, "cuMemsetD32Async");
    SYM(MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
    SYM(StreamCreate, "cuStreamCreate");
    SYM(StreamDestroy, "cuStreamDestroy_v2");
    SYM(StreamQuery, "cuStreamQuery");
    SYM(ModuleLoadData, "cuModuleLoadData");
    SYM(ModuleUnload, "cuModuleUnload");
    SYM(ModuleGetFunction, "cuModuleGetFunction");
    SYM(LaunchKernel, "cuLaunchKernel");
    SYM(GetErrorName, "cuGetErrorName");
#undef SYM
    if (!all_loaded(&cu, sizeof(cu))) {
        fprintf(stderr, "libcuda.so.1 lacks an entry point this example uses\n");
        return 0;
    }
    if (cu.Init(0) != 0 || cu.DeviceGetCount(&n) != 0) {
        return 0;
    }
    return n;
}

/* Load NVRTC: the unversioned name (the toolkit's development link), then the sonames of recent
 * toolkits, then the toolkit's usual place. 1 when it loaded. */
static int load_nvrtc(void)
{
    static const char *const names[] = {"libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12",
                                        "/usr/local/cuda/lib64/libnvrtc.so"};
    void *lib = NULL;
    size_t i;
    for (i = 0; lib == NULL && i < sizeof(names) / sizeof(names[0]); i++) {
        lib = dlopen(names[i], RTLD_NOW);
    }
    if (lib == NULL) {
        return 0;
    }
#define SYM(field, name) *(void **)&nvrtc.field = dlsym(lib, name)
    SYM(Version, "nvrtcVersion");
    SYM(CreateProgram, "nvrtcCreateProgram");
    SYM(CompileProgram, "nvrtcCompileProgram");
    SYM(GetCUBINSize, "nvrtcGetCUBINSize");
    SYM(GetCUBIN, "nvrtcGetCUBIN");
    SYM(GetProgramLogSize, "nvrtcGetProgramLogSize");
    SYM(GetProgramLog, "nvrtcGetProgramLog");
    SYM(DestroyProgram, "nvrtcDestroyProgram");
    SYM(GetErrorString, "nvrtcGetErrorString");
#undef SYM
    return all_loaded(&nvrtc, sizeof(nvrtc));
}

/* The whole file at `path` as a NUL-terminated string, or NULL. */
static char *read_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    char *text = NULL;
    size_t len = 0, cap = 0, got;
    if (f == NULL) {
        return NULL;
    }
    do {
        if (cap - len < 4096) {
            char *more = realloc(text, cap + 65536);
            if (more == NULL) {
                free(text);
                fclose(f);
                return NULL;
            }
            text = more;
            cap += 65536;
        }
        got = fread(text + len, 1, cap - len - 1, f);
        len += got;
    } while (got > 0);
    fclose(f);
    text[len] = '\0';
    return text;
}

/* gsc_device.cuh's text: from `given` (--header), the compile-time path, or beside the loaded
 * libgscomm. *where receives the path it came from. */
static char *device_header(const char *given, char *where, size_t room)
{
    char *text;
    Dl_info info;
    void (*in_library)(unsigned *, unsigned *, unsigned *) = gsc_get_version;
    void *addr;
    if (given != NULL) {
        snprintf(where, room, "%s", given);
        return read_file(given);
    }
#ifdef GSC_DEVICE_HEADER_PATH
    snprintf(where, room, "%s", GSC_DEVICE_HEADER_PATH);
    if ((text = read_file(where)) != NULL) {
        return text;
    }
#endif
    /* Where the loader found libgscomm (ISO C has no cast from a function pointer to void *;
     * the bytes are the address). */
    memcpy(&addr, &in_library, sizeof(addr));
    if (dladdr(addr, &info) != 0 && info.dli_fname != NULL) {
        static const char *const relative[] = {"/../include/gsc_device.cuh", "/../../include/gsc_device.cuh"};
        const char *slash = strrchr(info.dli_fname, '/');
        int dir_len = slash == NULL ? 1 : (int)(slash - info.dli_fname);
        size_t i;
        for (i = 0; i < sizeof(relative) / sizeof(relative[0]); i++) {
            snprintf(where, room, "%.*s%s", dir_len, slash == NULL ? "." : info.dli_fname, relative[i]);
            if ((text = read_file(where)) != NULL) {
                return text;
            }
        }
    }
    snprintf(where, room, "(not found: give --header PATH/gsc_device.cuh)");
    return NULL;
}

/* Compile the kernels for sm_<major><minor>; the cubin (malloc'ed, *size bytes), or NULL with
 * NVRTC's log printed. */
static char *compile_kernels(const char *header, int major, int minor, size_t *size)
{
    const char *const headers[1] = {header}, *const names[1] = {"gsc_device.cuh"};
    char arch[64];
    const char *const options[2] = {arch, "-std=c++17"};
    nvrtcProgram prog;
    nvrtcResult r;
    char *cubin = NULL;
    sprintf(arch, "--gpu-architecture=sm_%d%d", major, minor);
    r = nvrtc.CreateProgram(&prog, kernels, "partitioned_pready.cu", 1, headers, names);
    if (r != 0) {
        fprintf(stderr, "rank %d: FAILED: nvrtcCreateProgram: %s\n", rank, nvrtc.GetErrorString(r));
        return NULL;
    }
    r = nvrtc.CompileProgram(prog, 2, options);
    if (r != 0) {
        size_t log_size = 0;
        char *log;
        nvrtc.GetProgramLogSize(prog, &log_size);
        log = calloc(1, log_size + 1);
        if (log != NULL) {
            nvrtc.GetProgramLog(prog, log);
        }
        fprintf(stderr, "rank %d: FAILED: NVRTC could not compile the kernels (%s, %s):\n%s\n", rank,
                nvrtc.GetErrorString(r), arch, log != NULL ? log : "");
        free(log);
    } else if ((r = nvrtc.GetCUBINSize(prog, size)) != 0 || (cubin = malloc(*size)) == NULL ||
               (r = nvrtc.GetCUBIN(prog, cubin)) != 0) {
        fprintf(stderr, "rank %d: FAILED: getting the cubin: %s\n", rank, nvrtc.GetErrorString(r));
        free(cubin);
        cubin = NULL;
    }
    nvrtc.DestroyProgram(&prog);
    return cubin;
}

/* Wait for everything queued on the stream, bounded: a kernel that waits for a dead peer gives
 * up after GSC_TIMEOUT (60 s here); this bound is the backstop. */
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
    int peer = 1 - rank;

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

/* Launch `f` on the stream with its arguments (pointers to each, as cuLaunchKernel takes them). */
static void launch(CUfunction f, unsigned blocks, void **args)
{
    CU(cu.LaunchKernel(f, blocks, 1, 1, THREADS, 1, 1, 0, stream, args, NULL));
}

int main(int argc, char **argv)
{
    int nranks, ngpus, dev, major = 0, minor = 0, on_gpu = 0, failures = 0, i, ok;
    unsigned long long rounds = 200, r;
    const char *header_arg = NULL;
    char header_path[4096];
    char *header, *cubin;
    size_t cubin_size;
    gsc_config_pair_t overrides[1];
    gsc_params_t params;
    gsc_bootstrap_h boot;
    gsc_context_h context;
    gsc_worker_h worker;
    gsc_ep_h ep;
    gsc_buffer_param_t bp;
    gsc_prepared_h prep;
    gsc_condition_param_t cp;
    gsc_condition_h cond;
    gsc_request_param_t rp;
    void *handle;
    CUcontext cuctx;
    CUmodule module;
    CUfunction produce, check;
    CUdeviceptr buf, errors, d;
    unsigned long long *host_errors;
    unsigned char *host_buf;

    for (i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--header") == 0 && i + 1 < argc) {
            header_arg = argv[++i];
        } else if (atoi(argv[i]) > 0) {
            rounds = (unsigned long long)atoi(argv[i]);
        } else {
            fprintf(stderr, "usage: %s [--header PATH/gsc_device.cuh] [ROUNDS]\n", argv[0]);
            return 2;
        }
    }
    ngpus = load_cuda();
    if (ngpus <= 0) {
        printf("skipped: no CUDA driver or no GPU here (this example needs GPUs)\n");
        return 0;
    }
    if (!load_nvrtc()) {
        printf("skipped: NVRTC (libnvrtc.so) does not load: put the CUDA toolkit's lib64 on LD_LIBRARY_PATH\n");
        return 0;
    }
    MUST(gsc_bootstrap_init_from_env(&boot));
    MUST(gsc_bootstrap_rank(boot, &rank));
    MUST(gsc_bootstrap_nranks(boot, &nranks));
    if (nranks != 2) {
        fprintf(stderr, "rank %d: this example needs exactly 2 ranks, not %d\n", rank, nranks);
        return 2;
    }

    /* The device, and the kernels compiled for it. */
    CU(cu.DeviceGet(&dev, rank % ngpus));
    CU(cu.DevicePrimaryCtxRetain(&cuctx, dev));
    CU(cu.CtxSetCurrent(cuctx));
    CU(cu.StreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    CU(cu.DeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
    CU(cu.DeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev));
    header = device_header(header_arg, header_path, sizeof(header_path));
    if (header == NULL) {
        fprintf(stderr, "rank %d: FAILED: cannot read gsc_device.cuh: %s\n", rank, header_path);
        return 1;
    }
    cubin = compile_kernels(header, major, minor, &cubin_size);
    if (cubin == NULL) {
        return 1;
    }
    CU(cu.ModuleLoadData(&module, cubin));
    CU(cu.ModuleGetFunction(&produce, module, "produce_and_pready"));
    CU(cu.ModuleGetFunction(&check, module, "check_round"));
    free(cubin);
    free(header);
    {
        int nv_major = 0, nv_minor = 0;
        nvrtc.Version(&nv_major, &nv_minor);
        printf("rank %d: GPU %d (sm_%d%d), kernels compiled by NVRTC %d.%d with %s\n", rank, dev, major, minor,
               nv_major, nv_minor, header_path);
    }

    /* Buffers: the 4 MiB buffer in an allocation of its own (the sender writes the receiver's
     * in place, through CUDA IPC), two error words, host memory to read them back. */
    CU(cu.MemAlloc(&buf, LENGTH));
    CU(cu.MemAlloc(&errors, 2 * sizeof(unsigned long long)));
    CU(cu.MemsetD32Async(errors, 0, 4, stream));
    CU(cu.MemsetD32Async(buf, 0, LENGTH / 4, stream));
    CU(cu.MemHostAlloc((void **)&host_errors, 2 * sizeof(unsigned long long), 0));
    CU(cu.MemHostAlloc((void **)&host_buf, LENGTH, 0));
    synchronize("zeroing the buffers");

    overrides[0].name = "GSC_TIMEOUT";
    overrides[0].value = "60s";
    memset(&params, 0, sizeof(params));
    params.field_mask = GSC_PARAM_FIELD_CONFIG;
    params.config = overrides;
    params.config_count = 1;
    MUST(gsc_init(&params, &context));
    MUST(gsc_worker_create(context, NULL, &worker));
    ep = connect_peer(boot, worker);

    /* Each side prepares on its endpoint to the other; the send pairs with the receive of the
     * same tag. GPU rounds are required: the kernels drive the partitions. */
    memset(&bp, 0, sizeof(bp));
    bp.field_mask = GSC_BUFFER_PARAM_FIELD_PARTITIONS | GSC_BUFFER_PARAM_FIELD_MEMORY_TYPE | GSC_BUFFER_PARAM_FIELD_FLAGS;
    bp.direction = rank == 0 ? GSC_PREPARE_SEND : GSC_PREPARE_RECV;
    bp.buffer = (void *)(uintptr_t)buf;
    bp.length = LENGTH;
    bp.tag = TAG;
    bp.partitions = PARTS;
    bp.memory_type = GSC_MEMORY_TYPE_CUDA;
    bp.flags = GSC_PREPARE_FLAG_GPU_ROUNDS;
    MUST(gsc_prepare_transfers(ep, &prep, &bp));
    /* Both wait (up to GSC_TIMEOUT) for the peer's preparation. */
    MUST(gsc_prepared_on_gpu(prep, &on_gpu));
    if (!on_gpu) {
        fprintf(stderr, "rank %d: FAILED: the pair does not run on the GPU\n", rank);
        return 1;
    }
    MUST(gsc_prepared_device_handle(prep, &handle));
    d = (CUdeviceptr)(uintptr_t)handle;

    memset(&cp, 0, sizeof(cp));
    cp.field_mask = GSC_CONDITION_PARAM_FIELD_CATEGORY | GSC_CONDITION_PARAM_FIELD_CONTEXT;
    cp.category = GSC_CONDITION_CATEGORY_STREAM;
    cp.context = stream;
    MUST(gsc_condition_create(&cp, &cond));
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask = GSC_OP_ATTR_FIELD_CONDITION;
    rp.condition = cond;

    for (r = 1; r <= rounds; r++) {
        /* Begin the round on the stream (a send: the round only; a receive: "ready", then the
         * stream waits until every partition arrived). No request comes back: the stream orders
         * the round. */
        gsc_status_ptr_t s = gsc_prepared_start(prep, &rp);
        if (GSC_PTR_IS_ERR(s)) {
            MUST(GSC_PTR_STATUS(s));
        } else if (GSC_PTR_IS_PTR(s)) {
            gsc_request_free(s);
        }
        if (rank == 0) {
            void *args[4];
            args[0] = &d, args[1] = &buf, args[2] = &r, args[3] = &errors;
            launch(produce, PARTS, args);
        } else {
            unsigned long long n = LENGTH;
            void *args[5];
            args[0] = &d, args[1] = &buf, args[2] = &n, args[3] = &r, args[4] = &errors;
            launch(check, (unsigned)(LENGTH / THREADS / 16), args);
        }
    }
    CU(cu.MemcpyDtoHAsync(host_errors, errors, 2 * sizeof(unsigned long long), stream));
    CU(cu.MemcpyDtoHAsync(host_buf, buf, LENGTH, stream));
    synchronize("the rounds");

    /* What the kernels found, what gscomm recorded, and the last round on the host. */
    if (host_errors[0] != 0) {
        fprintf(stderr, "rank %d: FAILED: %llu error(s) found by the %s kernels\n", rank, host_errors[0],
                rank == 0 ? "sending (a partition the receiver never became ready for)" : "checking");
        failures++;
    }
    if (rank == 1 && host_errors[1] != rounds) {
        fprintf(stderr, "rank 1: FAILED: %llu rounds checked, expected %llu\n", host_errors[1], rounds);
        failures++;
    }
    {
        uint64_t gave_up = 0;
        MUST(gsc_prepared_gpu_error(prep, &gave_up));
        if (gave_up != 0) {
            fprintf(stderr, "rank %d: FAILED: a kernel gave up on round %llu (the peer did not answer)\n", rank,
                    (unsigned long long)gave_up);
            failures++;
        }
    }
    MUST(gsc_condition_query(cond));
    for (ok = 1, i = 0; ok && (size_t)i < LENGTH; i++) {
        ok = host_buf[i] == pattern((unsigned long long)i, rounds);
    }
    if (!ok) {
        fprintf(stderr, "rank %d: FAILED: byte %d of the last round's %s is %u, expected %u\n", rank, i - 1,
                rank == 0 ? "data" : "message", host_buf[i - 1], pattern((unsigned long long)(i - 1), rounds));
        failures++;
    }
    printf("rank %d: %llu rounds of %lu B in %d partitions %s from a kernel: %s\n", rank, rounds,
           (unsigned long)LENGTH, PARTS, rank == 0 ? "produced and sent (gsc_pready)" : "received and checked",
           failures == 0 ? "ok" : "FAILED");

    /* Release only when both sides are done with the rounds; free the buffers only when both
     * released (the peer writes our receive buffer directly). */
    MUST(gsc_bootstrap_barrier(boot));
    MUST(gsc_release_preparations(ep, prep));
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
    MUST(gsc_worker_destroy(worker));
    MUST(gsc_cleanup(context));
    CU(cu.ModuleUnload(module));
    CU(cu.MemFree(buf));
    CU(cu.MemFree(errors));
    CU(cu.MemFreeHost(host_errors));
    CU(cu.MemFreeHost(host_buf));
    CU(cu.StreamDestroy(stream));
    CU(cu.DevicePrimaryCtxRelease(dev));
    MUST(gsc_bootstrap_destroy(boot));
    if (failures == 0) {
        printf("rank %d: all checks passed\n", rank);
        return 0;
    }
    return 1;
}
