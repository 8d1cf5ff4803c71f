/*
 * Collectives started from inside a CUDA kernel: an all-reduce and an all-gather armed once on a
 * KERNEL_TRIGGERED condition with gsc_comm_collective(), then performed by one kernel that fills
 * this rank's input, triggers the collective (gsc_trigger), waits for it (gsc_wait) and checks
 * the result, round after round, with no host call in between.
 *
 *   GSC_NRANKS=2 GSC_BOOTSTRAP_ADDR=127.0.0.1:29500 GSC_BOOTSTRAP_SECRET=$SECRET \
 *       sh -c 'GSC_RANK=0 ./triggered_allreduce [--header PATH] [ROUNDS] & GSC_RANK=1 ./triggered_allreduce ...; wait'
 *   mpirun -np 4 -x GSC_BOOTSTRAP_ADDR -x GSC_BOOTSTRAP_SECRET ./triggered_allreduce
 *
 * N processes, one GPU each (GPU rank % number of GPUs), find each other with the launcher-style
 * bootstrap (gsc_bootstrap_init_from_env) and join a communicator (gsc_comm_init_rank), as in
 * example 05. For 1, 1000 and 1,048,576 floats: gsc_comm_collective() arms the all-reduce (sum)
 * and then the all-gather on the condition — collectively: every rank arms the same collectives
 * in the same order — and returns each one's device handle in gsc_condition_out_t. One block
 * of a kernel then runs ROUNDS rounds (100): fill the send buffer with round r's values,
 * __syncthreads(), one thread triggers and waits, __syncthreads(), every thread checks its part
 * of the result (small integers: float sums are exact in any order). A kernel waits for one
 * triggered collective before it triggers another, and leaves the GPU room for the collective's
 * own kernels (one block here). Rank 0 prints the time per round of the smallest all-reduce.
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

#define WAIT_SECONDS 120
#define MAX_COUNT ((size_t)1 << 20)
#define THREADS 256

static const size_t counts[] = {1, 1000, MAX_COUNT};
#define NCOUNTS (sizeof(counts) / sizeof(counts[0]))

/* The kernel: C++ for NVRTC, with gsc_device.cuh as its one header. `kind` 0 is the
 * all-reduce, 1 the all-gather (this rank's `count` elements into element rank x count of
 * every rank's receive buffer). errors[0] counts wrong elements, errors[1] failed waits. */
static const char kernels[] =
    "#include \"gsc_device.cuh\"\n"
    "\n"
    "/* Rank q's element i in round r: a small integer, so float sums are exact in any order. */\n"
    "__device__ float value(unsigned long long q, unsigned long long r, unsigned long long i)\n"
    "{\n"
    "    return (float)((long long)((i * 7 + q * 13 + r * 5) % 11) - 5);\n"
    "}\n"
    "\n"
    "extern \"C\" __global__ void rounds(gsc_device_handle_t *h, float *send, const float *recv,\n"
    "                                   unsigned long long count, unsigned long long kind,\n"
    "                                   unsigned long long rank, unsigned long long nranks,\n"
    "                                   unsigned long long first, unsigned long long n,\n"
    "                                   unsigned long long *errors)\n"
    "{\n"
    "    __shared__ int failed;\n"
    "    const unsigned long long recv_len = kind == 1 ? nranks * count : count;\n"
    "    for (unsigned long long r = first; r < first + n; r++) {\n"
    "        for (unsigned long long i = threadIdx.x; i < count; i += blockDim.x) send[i] = value(rank, r, i);\n"
    "        __syncthreads(); /* the whole input is written before the trigger */\n"
    "        if (threadIdx.x == 0) {\n"
    "            gsc_trigger(h);\n"
    "            failed = gsc_wait(h) != 0;\n"
    "        }\n"
    "        __syncthreads(); /* every thread reads the result after the wait */\n"
    "        if (failed) {\n"
    "            if (threadIdx.x == 0) atomicAdd(&errors[1], 1ULL);\n"
    "            return;\n"
    "        }\n"
    "        for (unsigned long long i = threadIdx.x; i < recv_len; i += blockDim.x) {\n"
    "            float want = 0;\n"
    "            if (kind == 1) {\n"
    "                want = value(i / count, r, i % count);\n"
    "            } else {\n"
    "                for (unsigned long long q = 0; q < nranks; q++) want += value(q, r, i);\n"
    "            }\n"
    "            if (recv[i] != want) atomicAdd(&errors[0], 1ULL);\n"
    "        }\n"
    "        __syncthreads(); /* the checks are done before the next round's trigger */\n"
    "    }\n"
    "}\n";

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
    r = nvrtc.CreateProgram(&prog, kernels, "triggered_allreduce.cu", 1, headers, names);
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

/* Monotonic seconds. */
static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Arm `kind` (GSC_COLL_ALL_REDUCE or GSC_COLL_ALL_GATHER) of `count` floats on `cond`; the
 * device handle. */
static CUdeviceptr arm(gsc_comm_h comm, gsc_condition_h cond, gsc_coll_kind_t kind, CUdeviceptr send, CUdeviceptr recv,
                       size_t count)
{
    gsc_coll_desc_t desc;
    gsc_condition_out_t out;
    memset(&desc, 0, sizeof(desc));
    desc.kind = kind;
    desc.sendbuf = (const void *)(uintptr_t)send;
    desc.recvbuf = (void *)(uintptr_t)recv;
    desc.count = count;
    desc.datatype = GSC_FLOAT32;
    desc.op = GSC_SUM;
    memset(&out, 0, sizeof(out));
    MUST(gsc_comm_collective(comm, &desc, cond, &out));
    return (CUdeviceptr)(uintptr_t)out.device_handle;
}

int main(int argc, char **argv)
{
    int nranks, ngpus, dev, major = 0, minor = 0, i, failures = 0;
    unsigned long long nrounds = 100, kind, count, rank_arg, nranks_arg, first;
    const char *header_arg = NULL;
    char header_path[4096];
    char *header, *cubin;
    size_t cubin_size, c;
    gsc_bootstrap_h boot;
    gsc_unique_id_t id, *ids;
    gsc_status_t st = GSC_OK;
    gsc_comm_h comm;
    gsc_condition_param_t cp;
    gsc_condition_h cond;
    CUcontext cuctx;
    CUmodule module;
    CUfunction rounds;
    CUdeviceptr send, recv, errors, handle;
    unsigned long long *host_errors;

    for (i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--header") == 0 && i + 1 < argc) {
            header_arg = argv[++i];
        } else if (atoi(argv[i]) > 0) {
            nrounds = (unsigned long long)atoi(argv[i]);
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
    if (nranks < 2) {
        fprintf(stderr, "rank %d: needs at least 2 ranks (GSC_NRANKS, or mpirun -np N)\n", rank);
        return 2;
    }
    CU(cu.DeviceGet(&dev, rank % ngpus));
    CU(cu.DevicePrimaryCtxRetain(&cuctx, dev));
    CU(cu.CtxSetCurrent(cuctx));
    CU(cu.DeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
    CU(cu.DeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev));
    CU(cu.StreamCreate(&stream, CU_STREAM_NON_BLOCKING));
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
    CU(cu.ModuleGetFunction(&rounds, module, "rounds"));
    free(cubin);
    free(header);

    CU(cu.MemAlloc(&send, MAX_COUNT * 4));
    CU(cu.MemAlloc(&recv, (size_t)nranks * MAX_COUNT * 4));
    CU(cu.MemAlloc(&errors, 2 * sizeof(unsigned long long)));
    CU(cu.MemHostAlloc((void **)&host_errors, 2 * sizeof(unsigned long long), 0));

    /* The communicator reads its configuration from the environment: a bound on waiting for a
     * dead peer unless the user chose one. Then rank 0's unique id to everyone (exchanged even
     * when making it failed, so that no rank is left waiting in the allgather). */
    setenv("GSC_TIMEOUT", "60s", 0);
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

    /* A KERNEL_TRIGGERED condition has no context: each collective armed on it returns a
     * device handle. */
    memset(&cp, 0, sizeof(cp));
    cp.field_mask = GSC_CONDITION_PARAM_FIELD_CATEGORY;
    cp.category = GSC_CONDITION_CATEGORY_KERNEL_TRIGGERED;
    MUST(gsc_condition_create(&cp, &cond));

    for (c = 0; c < NCOUNTS; c++) {
        for (kind = 0; kind < 2; kind++) {
            void *args[10];
            double t0;
            handle = arm(comm, cond, kind == 0 ? GSC_COLL_ALL_REDUCE : GSC_COLL_ALL_GATHER, send, recv, counts[c]);
            CU(cu.MemsetD32Async(errors, 0, 4, stream));
            count = counts[c];
            rank_arg = (unsigned long long)rank;
            nranks_arg = (unsigned long long)nranks;
            first = 1;
            args[0] = &handle;
            args[1] = &send;
            args[2] = &recv;
            args[3] = &count;
            args[4] = &kind;
            args[5] = &rank_arg;
            args[6] = &nranks_arg;
            args[7] = &first;
            args[8] = &nrounds;
            args[9] = &errors;
            t0 = now();
            CU(cu.LaunchKernel(rounds, 1, 1, 1, THREADS, 1, 1, 0, stream, args, NULL));
            CU(cu.MemcpyDtoHAsync(host_errors, errors, 2 * sizeof(unsigned long long), stream));
            synchronize("the triggering kernel");
            if (host_errors[0] != 0 || host_errors[1] != 0) {
                fprintf(stderr, "rank %d: FAILED: %s of %lu floats: %llu wrong elements, %llu failed waits\n", rank,
                        kind == 0 ? "all-reduce" : "all-gather", (unsigned long)count, host_errors[0], host_errors[1]);
                failures++;
            } else if (rank == 0) {
                printf("rank 0: %s of %lu floats: %llu rounds checked, %.1f us per round (fill, trigger, wait, check)\n",
                       kind == 0 ? "all-reduce" : "all-gather", (unsigned long)count, nrounds,
                       (now() - t0) * 1e6 / (double)nrounds);
            }
        }
    }
    MUST(gsc_comm_query(comm));
    MUST(gsc_condition_query(cond));

    /* Every rank's kernels are done before any rank's communicator goes. */
    MUST(gsc_bootstrap_barrier(boot));
    MUST(gsc_comm_destroy(comm));
    MUST(gsc_condition_destroy(cond));
    CU(cu.ModuleUnload(module));
    CU(cu.MemFree(send));
    CU(cu.MemFree(recv));
    CU(cu.MemFree(errors));
    CU(cu.MemFreeHost(host_errors));
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
