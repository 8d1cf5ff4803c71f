/*
 * The smallest gscomm program: what library is loaded, how it is configured, and a context and
 * a worker made and released. One process, no peer, no GPU needed.
 *
 *   ./init_info                     # or, e.g., GSC_TLS=shm GSC_LOG_LEVEL=debug ./init_info
 *
 * It prints the library's version (and checks it against the header this file was compiled
 * with), the GSC_* variables of the environment (the configuration gsc_init reads; `gsc-info -c`
 * lists every variable with its default and meaning), shows how a configuration error is
 * reported, creates a context with an override on top of the environment, creates a worker and
 * prints the size of its address (what a peer needs to connect), and says whether a CUDA driver
 * and GPUs are there. The driver is looked up at run time (dlopen), so this file builds without
 * the CUDA toolkit. Exit status 0 when every call succeeded.
 */
#define _POSIX_C_SOURCE 200809L
#include <gsc.h>

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The process environment (POSIX declares it, but no header does without _GNU_SOURCE). */
extern char **environ;

#define MUST(_call)                                                                           \
    do {                                                                                      \
        gsc_status_t _st = (_call);                                                           \
        if (_st != GSC_OK) {                                                                  \
            fprintf(stderr, "FAILED: %s: %s (%s)\n", #_call, gsc_status_string(_st),          \
                    gsc_last_error_message());                                                \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

/* Print the GSC_* variables set in the environment: gsc_init reads them (and GSC_RANK and the
 * bootstrap's variables, which the bootstrap reads). Everything else takes its default. */
static void print_environment(void)
{
    char **e;
    int n = 0;
    printf("configuration: the GSC_* environment, then gsc_params_t.config on top\n");
    for (e = environ; *e != NULL; e++) {
        if (strncmp(*e, "GSC_", 4) == 0) {
            /* Never print a secret, even in an example. */
            if (strncmp(*e, "GSC_BOOTSTRAP_SECRET=", 21) == 0 || strncmp(*e, "GSC_UNIQUE_ID=", 14) == 0) {
                printf("  %.*s=(hidden)\n", (int)(strchr(*e, '=') - *e), *e);
            } else {
                printf("  %s\n", *e);
            }
            n++;
        }
    }
    if (n == 0) {
        printf("  (no GSC_* variable set: every knob has its default; `gsc-info -c` lists them)\n");
    }
}

/* Whether a CUDA driver loads here, and what it sees. gscomm itself only loads the driver when a
 * CUDA feature is first used, so a host-only program never needs one. */
static void print_cuda(void)
{
    typedef int CUresult;
    CUresult (*init)(unsigned);
    CUresult (*driver_version)(int *);
    CUresult (*device_count)(int *);
    CUresult (*device_get)(int *, int);
    CUresult (*device_name)(char *, int, int);
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    int version = 0, count = 0, i;
    if (lib == NULL) {
        printf("CUDA driver: none (libcuda.so.1 does not load): host memory and host streams only\n");
        return;
    }
    *(void **)&init = dlsym(lib, "cuInit");
    *(void **)&driver_version = dlsym(lib, "cuDriverGetVersion");
    *(void **)&device_count = dlsym(lib, "cuDeviceGetCount");
    *(void **)&device_get = dlsym(lib, "cuDeviceGet");
    *(void **)&device_name = dlsym(lib, "cuDeviceGetName");
    if (init == NULL || driver_version == NULL || device_count == NULL || device_get == NULL ||
        device_name == NULL) {
        printf("CUDA driver: libcuda.so.1 loads but lacks the driver API entry points\n");
        return;
    }
    if (init(0) != 0 || device_count(&count) != 0 || count == 0) {
        printf("CUDA driver: present, but no usable GPU (cuInit or cuDeviceGetCount failed, or 0 "
               "devices)\n");
        return;
    }
    driver_version(&version);
    printf("CUDA driver: %d.%d, %d GPU(s)\n", version / 1000, (version % 1000) / 10, count);
    for (i = 0; i < count; i++) {
        int dev;
        char name[256];
        if (device_get(&dev, i) == 0 && device_name(name, (int)sizeof(name), dev) == 0) {
            printf("  GPU %d: %s\n", i, name);
        }
    }
}

int main(void)
{
    unsigned major, minor, patch;
    gsc_config_pair_t overrides[2];
    gsc_params_t params;
    gsc_context_h context;
    gsc_worker_h worker;
    gsc_status_t st;
    void *address;
    size_t address_length;

    /* The library may be newer than the header: a program checks what it relies on. While the
     * major version is 0 a minor release may change the ABI, so both must match. */
    gsc_get_version(&major, &minor, &patch);
    printf("gscomm %u.%u.%u (header %d.%d.%d)\n", major, minor, patch, GSC_VERSION_MAJOR,
           GSC_VERSION_MINOR, GSC_VERSION_PATCH);
    if (major != GSC_VERSION_MAJOR || minor != GSC_VERSION_MINOR) {
        fprintf(stderr, "FAILED: the library's version does not match the header's\n");
        return 1;
    }

    print_environment();

    /* A bad value is refused by gsc_init, which names the variable; nothing is created. */
    memset(&params, 0, sizeof(params));
    overrides[0].name = "GSC_TIMEOUT";
    overrides[0].value = "soon";
    params.field_mask = GSC_PARAM_FIELD_CONFIG;
    params.config = overrides;
    params.config_count = 1;
    st = gsc_init(&params, &context);
    if (st != GSC_ERR_INVALID_CONFIG) {
        fprintf(stderr, "FAILED: GSC_TIMEOUT=soon gave %s, expected GSC_ERR_INVALID_CONFIG\n",
                gsc_status_string(st));
        return 1;
    }
    printf("a bad override is refused: %s: %s\n", gsc_status_string(st), gsc_last_error_message());

    /* The real context: the environment, with two overrides on top (a later pair wins; the
     * GSC_ prefix and the case of the name are optional). */
    overrides[0].name = "GSC_TIMEOUT";
    overrides[0].value = "30s";
    overrides[1].name = "log_level";
    overrides[1].value = "warn";
    params.config_count = 2;
    MUST(gsc_init(&params, &context));
    printf("context: created (GSC_TIMEOUT=30s, GSC_LOG_LEVEL=warn on top of the environment)\n");

    MUST(gsc_worker_create(context, NULL, &worker));
    MUST(gsc_worker_get_address(worker, &address, &address_length));
    printf("worker: created; its address is %lu bytes (peers pass it to gsc_ep_create)\n",
           (unsigned long)address_length);
    MUST(gsc_worker_release_address(worker, address));
    /* Nothing to do yet; a progress call on an idle worker handles no event. */
    printf("worker: %u event(s) on an idle progress call\n", gsc_worker_progress(worker));

    print_cuda();

    MUST(gsc_worker_destroy(worker));
    MUST(gsc_cleanup(context));
    printf("worker and context released: done\n");
    return 0;
}
