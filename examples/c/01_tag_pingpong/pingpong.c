/*
 * Tagged ping-pong between two processes with the gscomm C API.
 *
 *   GSC_NRANKS=2 GSC_BOOTSTRAP_ADDR=127.0.0.1:29500 GSC_BOOTSTRAP_SECRET=$SECRET \
 *       sh -c 'GSC_RANK=0 ./pingpong & GSC_RANK=1 ./pingpong; wait'
 *
 * The ranks find each other through the bootstrap (rank 0 serves the rendezvous at
 * GSC_BOOTSTRAP_ADDR), exchange worker addresses with an allgather and connect. Rank 1 says
 * hello, which rank 0 takes with probe + msg_recv; then they exchange messages of several sizes
 * (eager and rendezvous) and check every byte, and rank 1 writes into and reads from a region of
 * rank 0 through a remote key (put/get + flush). Both close their endpoint and clean up. The
 * exit status is 0 only if every check passed.
 */
#include <gsc.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { TAG_HELLO = 1, TAG_DATA = 2, TAG_RKEY = 3, TAG_DONE = 4 };

#define TAG_MASK_ALL (~(uint64_t)0)
#define REGION_SIZE ((size_t)64 * 1024)
#define WAIT_SECONDS 30

static int rank = -1;
static int failures = 0;

/* Report a failed check, with the library's explanation when there is one. */
static void fail(const char *what, gsc_status_t status)
{
    fprintf(stderr, "rank %d: FAILED: %s: %s (%s)\n", rank, what, gsc_status_string(status),
            gsc_last_error_message());
    failures++;
}

/* Stop at the first failure of a step that later steps depend on. */
#define MUST(_call)                                                                           \
    do {                                                                                      \
        gsc_status_t _st = (_call);                                                           \
        if (_st != GSC_OK) {                                                                  \
            fail(#_call, _st);                                                                \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

/* Wait for a status pointer to complete; frees the request. */
static gsc_status_t finish(gsc_status_ptr_t p, gsc_tag_recv_info_t *info)
{
    gsc_status_t st;
    if (!GSC_PTR_IS_PTR(p)) {
        return GSC_PTR_STATUS(p);
    }
    st = gsc_request_wait(p, info);
    gsc_request_free(p);
    return st;
}

/* The byte at offset i of a message of `size` bytes identified by `seed`. */
static unsigned char pattern(size_t i, size_t seed)
{
    return (unsigned char)((i * 131u + seed * 7u + (i >> 8)) & 0xff);
}

static void fill(unsigned char *buf, size_t size, size_t seed)
{
    size_t i;
    for (i = 0; i < size; i++) {
        buf[i] = pattern(i, seed);
    }
}

static int check(const unsigned char *buf, size_t size, size_t seed, const char *what)
{
    size_t i;
    for (i = 0; i < size; i++) {
        if (buf[i] != pattern(i, seed)) {
            fprintf(stderr, "rank %d: FAILED: %s: byte %lu of %lu is %u, expected %u\n", rank,
                    what, (unsigned long)i, (unsigned long)size, buf[i], pattern(i, seed));
            failures++;
            return 0;
        }
    }
    return 1;
}

static gsc_status_t send_bytes(gsc_ep_h ep, const void *buf, size_t size, uint64_t tag)
{
    return finish(gsc_tag_send_nbx(ep, buf, size, tag, NULL), NULL);
}

/* Receive into buf (capacity `size`); reports the sender's tag and length in *info. */
static gsc_status_t recv_bytes(gsc_worker_h worker, void *buf, size_t size, uint64_t tag,
                               gsc_tag_recv_info_t *info)
{
    gsc_request_param_t param;
    memset(&param, 0, sizeof(param));
    param.op_attr_mask = GSC_OP_ATTR_FIELD_RECV_INFO;
    param.recv_info.tag_info = info; /* filled if the receive completes at once */
    return finish(gsc_tag_recv_nbx(worker, buf, size, tag, TAG_MASK_ALL, &param), info);
}

/* Completion callback of the last send: counts its calls in *user_data. */
static void count_send(void *request, gsc_status_t status, void *user_data)
{
    (void)request;
    if (status == GSC_OK) {
        ++*(int *)user_data;
    }
}

static const size_t sizes[] = {0, 1, 100, 128, 129, 4096, 16383, 16384, 16385, 100000,
                               1u << 20, 4u << 20};
#define NSIZES (sizeof(sizes) / sizeof(sizes[0]))

static void pingpong(gsc_worker_h worker, gsc_ep_h ep)
{
    size_t k, max = sizes[NSIZES - 1];
    unsigned char *out = malloc(max), *in = malloc(max);
    if (out == NULL || in == NULL) {
        fprintf(stderr, "rank %d: out of memory\n", rank);
        exit(1);
    }
    for (k = 0; k < NSIZES; k++) {
        size_t size = sizes[k];
        gsc_tag_recv_info_t info;
        gsc_status_t st;
        char what[64];
        sprintf(what, "message of %lu bytes", (unsigned long)size);
        memset(in, 0, size);
        if (rank == 0) {
            fill(out, size, size);
            if ((st = send_bytes(ep, out, size, TAG_DATA)) != GSC_OK) {
                fail(what, st);
                continue;
            }
            st = recv_bytes(worker, in, size, TAG_DATA, &info);
            if (st != GSC_OK || info.length != size || info.sender_tag != TAG_DATA) {
                fail(what, st);
                continue;
            }
            check(in, size, size + 1, what);
        } else {
            st = recv_bytes(worker, in, size, TAG_DATA, &info);
            if (st != GSC_OK || info.length != size || info.sender_tag != TAG_DATA) {
                fail(what, st);
                continue;
            }
            check(in, size, size, what);
            fill(out, size, size + 1);
            if ((st = send_bytes(ep, out, size, TAG_DATA)) != GSC_OK) {
                fail(what, st);
            }
        }
    }
    free(out);
    free(in);
}

/* Rank 0: offer a region through a remote key; rank 1 writes it, reads it back, says done. */
static void rma_target(gsc_context_h context, gsc_worker_h worker, gsc_ep_h ep)
{
    gsc_mem_map_params_t mp;
    gsc_mem_h memh;
    void *addr, *rkey_buf;
    size_t len, rkey_size;
    unsigned char msg[256];
    uint64_t header[2];
    gsc_tag_recv_info_t info;
    gsc_status_t st;

    memset(&mp, 0, sizeof(mp));
    mp.field_mask = GSC_MEM_MAP_PARAM_FIELD_LENGTH | GSC_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.length = REGION_SIZE;
    mp.flags = GSC_MEM_MAP_ALLOCATE;
    MUST(gsc_mem_map(context, &mp, &memh));
    MUST(gsc_mem_query(memh, &addr, &len));
    MUST(gsc_rkey_pack(context, memh, &rkey_buf, &rkey_size));
    if (len != REGION_SIZE || rkey_size + sizeof(header) > sizeof(msg)) {
        fail("region or rkey size", GSC_ERR_INTERNAL);
        exit(1);
    }
    header[0] = (uint64_t)(uintptr_t)addr;
    header[1] = (uint64_t)len;
    memcpy(msg, header, sizeof(header));
    memcpy(msg + sizeof(header), rkey_buf, rkey_size);
    MUST(gsc_rkey_buffer_release(rkey_buf));
    MUST(send_bytes(ep, msg, sizeof(header) + rkey_size, TAG_RKEY));

    st = recv_bytes(worker, msg, sizeof(msg), TAG_DONE, &info);
    if (st != GSC_OK) {
        fail("waiting for the peer's remote accesses", st);
    } else {
        check(addr, len, 77, "region written by the peer's put");
    }
    MUST(gsc_mem_unmap(context, memh));
}

/* Rank 1: put a pattern into rank 0's region, flush, get it back, check, say done. */
static void rma_initiator(gsc_worker_h worker, gsc_ep_h ep)
{
    unsigned char msg[256];
    uint64_t header[2];
    gsc_tag_recv_info_t info;
    gsc_rkey_h rkey;
    unsigned char *local, *back;
    gsc_request_param_t param;
    int callbacks = 0;
    gsc_status_t st;

    MUST(recv_bytes(worker, msg, sizeof(msg), TAG_RKEY, &info));
    memcpy(header, msg, sizeof(header));
    MUST(gsc_ep_rkey_unpack(ep, msg + sizeof(header), &rkey));
    local = malloc(REGION_SIZE);
    back = malloc(REGION_SIZE);
    if (local == NULL || back == NULL || header[1] != REGION_SIZE) {
        fail("rma setup", GSC_ERR_NO_MEMORY);
        exit(1);
    }
    fill(local, REGION_SIZE, 77);
    memset(back, 0, REGION_SIZE);
    if ((st = finish(gsc_put_nbx(ep, local, REGION_SIZE, header[0], rkey, NULL), NULL)) != GSC_OK) {
        fail("put", st);
    }
    if ((st = finish(gsc_ep_flush_nbx(ep, NULL), NULL)) != GSC_OK) {
        fail("endpoint flush", st);
    }
    if ((st = finish(gsc_get_nbx(ep, back, REGION_SIZE, header[0], rkey, NULL), NULL)) != GSC_OK) {
        fail("get", st);
    }
    if ((st = finish(gsc_worker_flush_nbx(worker, NULL), NULL)) != GSC_OK) {
        fail("worker flush", st);
    }
    check(back, REGION_SIZE, 77, "region read back with get");
    MUST(gsc_rkey_destroy(rkey));

    /* The last send uses a callback and always returns a request (NO_IMM_CMPL). */
    memset(&param, 0, sizeof(param));
    param.op_attr_mask = GSC_OP_ATTR_FIELD_CALLBACK | GSC_OP_ATTR_FIELD_USER_DATA |
                         GSC_OP_ATTR_FIELD_FLAGS;
    param.flags = GSC_OP_ATTR_FLAG_NO_IMM_CMPL;
    param.cb.send = count_send;
    param.user_data = &callbacks;
    {
        gsc_status_ptr_t req = gsc_tag_send_nbx(ep, "done", 4, TAG_DONE, &param);
        if (!GSC_PTR_IS_PTR(req)) {
            fail("send with GSC_OP_ATTR_FLAG_NO_IMM_CMPL returned no request", GSC_PTR_STATUS(req));
        } else if ((st = finish(req, NULL)) != GSC_OK) {
            fail("final send", st);
        } else if (callbacks != 1) {
            fprintf(stderr, "rank 1: FAILED: send callback ran %d times, expected once\n", callbacks);
            failures++;
        }
    }
    free(local);
    free(back);
}

static gsc_ep_h connect_to(gsc_worker_h worker, const void *addr, size_t len)
{
    gsc_ep_params_t ep_params;
    gsc_ep_h ep;
    memset(&ep_params, 0, sizeof(ep_params));
    ep_params.field_mask = GSC_EP_PARAM_FIELD_ADDRESS | GSC_EP_PARAM_FIELD_ADDRESS_LENGTH;
    ep_params.address = addr;
    ep_params.address_length = len;
    MUST(gsc_ep_create(worker, &ep_params, &ep));
    return ep;
}

/* Exchange worker addresses through the bootstrap (allgather of fixed-size blocks: first the
 * lengths, then the addresses padded to the longest) and connect to the other rank. */
static gsc_ep_h connect_peer(gsc_bootstrap_h boot, gsc_worker_h worker)
{
    void *mine;
    size_t len;
    uint64_t my_len, lens[2], max;
    unsigned char *block, *all;
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
    ep = connect_to(worker, all + (size_t)peer * (size_t)max, (size_t)lens[peer]);
    free(block);
    free(all);
    return ep;
}

/* Rank 1 says hello; rank 0 finds the message with a probe and receives it by its handle. */
static void hello(gsc_worker_h worker, gsc_ep_h ep)
{
    unsigned char msg[300];
    if (rank == 1) {
        fill(msg, sizeof(msg), 300);
        MUST(send_bytes(ep, msg, sizeof(msg), TAG_HELLO));
    } else {
        gsc_tag_recv_info_t info;
        gsc_tag_message_h handle;
        time_t start = time(NULL);
        while ((handle = gsc_tag_probe_nb(worker, TAG_HELLO, TAG_MASK_ALL, 1, &info)) == NULL) {
            if (time(NULL) - start > WAIT_SECONDS) {
                fprintf(stderr, "rank 0: no hello from rank 1 after %d s\n", WAIT_SECONDS);
                exit(1);
            }
            gsc_worker_progress(worker);
        }
        if (info.length != sizeof(msg) || info.sender_tag != TAG_HELLO) {
            fail("probed message has the wrong length or tag", GSC_ERR_INTERNAL);
            return;
        }
        memset(msg, 0, sizeof(msg));
        MUST(finish(gsc_tag_msg_recv_nbx(worker, msg, sizeof(msg), handle, NULL), NULL));
        check(msg, sizeof(msg), 300, "probed hello message");
    }
}

int main(void)
{
    gsc_config_pair_t overrides[1];
    gsc_params_t params;
    gsc_bootstrap_h boot;
    gsc_context_h context;
    gsc_worker_h worker;
    gsc_ep_h ep;
    int nranks;
    unsigned major, minor, patch;

    gsc_get_version(&major, &minor, &patch);
    if (major != GSC_VERSION_MAJOR || minor != GSC_VERSION_MINOR) {
        fprintf(stderr, "header %d.%d but library %u.%u\n", GSC_VERSION_MAJOR, GSC_VERSION_MINOR,
                major, minor);
        return 1;
    }

    /* Who we are, from the launcher's (or GSC_RANK/GSC_NRANKS) environment. */
    MUST(gsc_bootstrap_init_from_env(&boot));
    MUST(gsc_bootstrap_rank(boot, &rank));
    MUST(gsc_bootstrap_nranks(boot, &nranks));
    if (nranks != 2) {
        fprintf(stderr, "rank %d: this example needs exactly 2 ranks, not %d\n", rank, nranks);
        return 2;
    }

    /* Configuration: the GSC_* environment, with overrides on top. */
    overrides[0].name = "GSC_TIMEOUT";
    overrides[0].value = "30s";
    memset(&params, 0, sizeof(params));
    params.field_mask = GSC_PARAM_FIELD_CONFIG;
    params.config = overrides;
    params.config_count = 1;
    MUST(gsc_init(&params, &context));
    MUST(gsc_worker_create(context, NULL, &worker));

    ep = connect_peer(boot, worker);
    hello(worker, ep);
    pingpong(worker, ep);
    if (rank == 0) {
        rma_target(context, worker, ep);
    } else {
        rma_initiator(worker, ep);
    }

    /* Both sides are done with each other before either closes. */
    MUST(gsc_bootstrap_barrier(boot));
    {
        gsc_status_t st = finish(gsc_ep_close_nbx(ep, NULL), NULL);
        if (st != GSC_OK) {
            fail("closing the endpoint", st);
        }
    }
    MUST(gsc_worker_destroy(worker));
    MUST(gsc_cleanup(context));
    MUST(gsc_bootstrap_destroy(boot));
    if (failures == 0) {
        printf("rank %d: all checks passed\n", rank);
        return 0;
    }
    fprintf(stderr, "rank %d: %d check(s) failed\n", rank, failures);
    return 1;
}
