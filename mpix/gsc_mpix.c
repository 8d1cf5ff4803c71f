/* gsc_mpix: MPICH's stream-enqueue calls over gscomm's C API. See gsc_mpix.h for the mapping. */
#include "gsc_mpix.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct gscx_stream {
    gsc_condition_category_t category;
    void *handle; /* the CUstream, or the gsc_host_stream_h */
    int device;   /* CUDA streams: the device; -1 for host streams */
};

struct gscx_comm {
    int rank, size;
    gsc_context_h context;
    gsc_worker_h worker;
    gsc_ep_h *eps;          /* one per rank, this one's included */
    gsc_condition_h cond;   /* on the stream */
    gsc_comm_h coll;        /* CUDA streams: collectives; NULL otherwise */
};

struct gscx_request {
    MPI_Comm comm;
};

static char last_error[512];

static int fail(int code, const char *what, gsc_status_t st)
{
    if (st != GSC_OK) {
        snprintf(last_error, sizeof last_error, "%s: %s (%s)", what, gsc_status_string(st), gsc_last_error_message());
    } else {
        snprintf(last_error, sizeof last_error, "%s", what);
    }
    return code;
}

const char *MPIX_Last_error(void)
{
    return last_error;
}

#define CHECK(call, what)                                    \
    do {                                                     \
        gsc_status_t st_ = (call);                           \
        if (st_ != GSC_OK) return fail(MPI_ERR_OTHER, what, st_); \
    } while (0)

static size_t type_size(MPI_Datatype t)
{
    switch (t) {
    case GSC_INT8: case GSC_UINT8: case GSC_FLOAT8E4M3: case GSC_FLOAT8E5M2: return 1;
    case GSC_FLOAT16: case GSC_BFLOAT16: return 2;
    case GSC_INT32: case GSC_UINT32: case GSC_FLOAT32: return 4;
    case GSC_INT64: case GSC_UINT64: case GSC_FLOAT64: return 8;
    default: return 0;
    }
}

int MPIX_Stream_create_cuda(void *cuda_stream, int device, MPIX_Stream *stream)
{
    if (stream == NULL || device < 0) return fail(MPI_ERR_ARG, "MPIX_Stream_create_cuda: stream is NULL or device < 0", GSC_OK);
    *stream = calloc(1, sizeof **stream);
    if (*stream == NULL) return fail(MPI_ERR_OTHER, "MPIX_Stream_create_cuda: out of memory", GSC_OK);
    (*stream)->category = GSC_CONDITION_CATEGORY_STREAM;
    (*stream)->handle = cuda_stream;
    (*stream)->device = device;
    return MPI_SUCCESS;
}

int MPIX_Stream_create_host(gsc_host_stream_h host_stream, MPIX_Stream *stream)
{
    if (stream == NULL || host_stream == NULL) return fail(MPI_ERR_ARG, "MPIX_Stream_create_host: NULL argument", GSC_OK);
    *stream = calloc(1, sizeof **stream);
    if (*stream == NULL) return fail(MPI_ERR_OTHER, "MPIX_Stream_create_host: out of memory", GSC_OK);
    (*stream)->category = GSC_CONDITION_CATEGORY_HOST_STREAM;
    (*stream)->handle = host_stream;
    (*stream)->device = -1;
    return MPI_SUCCESS;
}

int MPIX_Stream_free(MPIX_Stream *stream)
{
    if (stream == NULL) return fail(MPI_ERR_ARG, "MPIX_Stream_free: stream is NULL", GSC_OK);
    free(*stream);
    *stream = NULL;
    return MPI_SUCCESS;
}

/* Every rank's worker address: an allgather of the lengths, then of the addresses padded to
 * the longest; an endpoint to each. Both exchanges run on every rank whatever failed before
 * (a rank without a worker contributes length 0), so no rank is left waiting in one, and every
 * rank fails when one did. */
static int connect_all(gsc_bootstrap_h world, MPI_Comm c)
{
    void *mine = NULL;
    size_t len = 0, max = 0;
    uint64_t my_len, *lens = calloc((size_t)c->size, sizeof(uint64_t));
    unsigned char *block = NULL, *all = NULL;
    gsc_status_t st = GSC_OK;
    int r, rc = MPI_SUCCESS;

    if (c->worker != NULL && (st = gsc_worker_get_address(c->worker, &mine, &len)) != GSC_OK) {
        rc = fail(MPI_ERR_OTHER, "MPIX_Stream_comm_create: worker address", st);
        mine = NULL, len = 0;
    }
    my_len = len;
    if (lens == NULL) {
        /* Cannot take part in the exchange at all: the others then time out in it. */
        if (mine != NULL) gsc_worker_release_address(c->worker, mine);
        return fail(MPI_ERR_OTHER, "MPIX_Stream_comm_create: out of memory", GSC_OK);
    }
    st = gsc_bootstrap_allgather(world, &my_len, sizeof my_len, lens);
    if (st != GSC_OK) {
        rc = fail(MPI_ERR_OTHER, "MPIX_Stream_comm_create: exchanging address lengths", st);
    } else {
        for (r = 0; r < c->size; r++) max = lens[r] > max ? (size_t)lens[r] : max;
        block = calloc(1, max ? max : 1);
        all = malloc((size_t)c->size * (max ? max : 1));
        if (block != NULL && all != NULL) {
            if (len > 0) memcpy(block, mine, len);
            st = gsc_bootstrap_allgather(world, block, max, all);
            if (st != GSC_OK) rc = fail(MPI_ERR_OTHER, "MPIX_Stream_comm_create: exchanging addresses", st);
        } else if (rc == MPI_SUCCESS) {
            rc = fail(MPI_ERR_OTHER, "MPIX_Stream_comm_create: out of memory", GSC_OK);
        }
    }
    if (mine != NULL) gsc_worker_release_address(c->worker, mine);
    for (r = 0; rc == MPI_SUCCESS && r < c->size; r++) {
        if (lens[r] == 0) rc = fail(MPI_ERR_OTHER, "MPIX_Stream_comm_create: a rank could not make its worker", GSC_OK);
    }
    for (r = 0; rc == MPI_SUCCESS && r < c->size; r++) {
        gsc_ep_params_t p;
        memset(&p, 0, sizeof p);
        p.field_mask = GSC_EP_PARAM_FIELD_ADDRESS | GSC_EP_PARAM_FIELD_ADDRESS_LENGTH;
        p.address = all + (size_t)r * max;
        p.address_length = (size_t)lens[r];
        st = gsc_ep_create(c->worker, &p, &c->eps[r]);
        if (st != GSC_OK) rc = fail(MPI_ERR_OTHER, "MPIX_Stream_comm_create: connecting", st);
    }
    free(lens);
    free(block);
    free(all);
    return rc;
}

/* CUDA streams: rank 0's unique id through the bootstrap, then the collectives' communicator. */
static int make_collectives(gsc_bootstrap_h world, MPIX_Stream stream, MPI_Comm c)
{
    gsc_unique_id_t mine, *all;
    gsc_status_t st = GSC_OK;
    memset(&mine, 0, sizeof mine);
    if (c->rank == 0) st = gsc_get_unique_id(&mine);
    all = malloc((size_t)c->size * sizeof *all);
    if (all == NULL) return fail(MPI_ERR_OTHER, "MPIX_Stream_comm_create: out of memory", GSC_OK);
    /* Exchanged even when the id failed, so no rank is left waiting; rank 0 then reports it. */
    {
        gsc_status_t gathered = gsc_bootstrap_allgather(world, &mine, sizeof mine, all);
        if (st == GSC_OK) st = gathered;
    }
    if (st == GSC_OK) st = gsc_comm_init_rank(&c->coll, c->size, &all[0], c->rank, stream->device);
    free(all);
    if (st != GSC_OK) return fail(MPI_ERR_OTHER, "MPIX_Stream_comm_create: the collectives' communicator", st);
    return MPI_SUCCESS;
}

int MPI_Comm_free(MPI_Comm *comm)
{
    MPI_Comm c;
    int r;
    if (comm == NULL || *comm == MPI_COMM_NULL) return fail(MPI_ERR_ARG, "MPI_Comm_free: no communicator", GSC_OK);
    c = *comm;
    if (c->coll != NULL) gsc_comm_destroy(c->coll);
    if (c->cond != NULL) gsc_condition_destroy(c->cond);
    for (r = 0; c->eps != NULL && r < c->size; r++) {
        if (c->eps[r] != NULL) {
            gsc_status_ptr_t s = gsc_ep_close_nbx(c->eps[r], NULL);
            if (GSC_PTR_IS_PTR(s)) {
                gsc_request_wait(s, NULL);
                gsc_request_free(s);
            }
        }
    }
    free(c->eps);
    if (c->worker != NULL) gsc_worker_destroy(c->worker);
    if (c->context != NULL) gsc_cleanup(c->context);
    free(c);
    *comm = MPI_COMM_NULL;
    return MPI_SUCCESS;
}

int MPIX_Stream_comm_create(gsc_bootstrap_h world, MPIX_Stream stream, MPI_Comm *newcomm)
{
    gsc_condition_param_t cp;
    gsc_status_t st;
    MPI_Comm c;
    int rc;
    if (stream == NULL || newcomm == NULL) return fail(MPI_ERR_ARG, "MPIX_Stream_comm_create: NULL argument", GSC_OK);
    c = calloc(1, sizeof *c);
    if (c == NULL) return fail(MPI_ERR_OTHER, "MPIX_Stream_comm_create: out of memory", GSC_OK);
    st = gsc_bootstrap_rank(world, &c->rank);
    if (st == GSC_OK) st = gsc_bootstrap_nranks(world, &c->size);
    if (st != GSC_OK) {
        free(c);
        return fail(MPI_ERR_ARG, "MPIX_Stream_comm_create: world", st);
    }
    c->eps = calloc((size_t)c->size, sizeof *c->eps);
    rc = c->eps == NULL ? fail(MPI_ERR_OTHER, "MPIX_Stream_comm_create: out of memory", GSC_OK) : MPI_SUCCESS;
    if (rc == MPI_SUCCESS && (st = gsc_init(NULL, &c->context)) != GSC_OK) rc = fail(MPI_ERR_OTHER, "MPIX_Stream_comm_create: context", st);
    if (rc == MPI_SUCCESS && (st = gsc_worker_create(c->context, NULL, &c->worker)) != GSC_OK) rc = fail(MPI_ERR_OTHER, "MPIX_Stream_comm_create: worker", st);
    /* Collective steps run on every rank even after a local failure, so no rank hangs in them. */
    if (c->eps != NULL) {
        int rc2 = connect_all(world, c);
        if (rc == MPI_SUCCESS) rc = rc2;
    }
    if (stream->category == GSC_CONDITION_CATEGORY_STREAM) {
        int rc2 = make_collectives(world, stream, c);
        if (rc == MPI_SUCCESS) rc = rc2;
    }
    if (rc == MPI_SUCCESS) {
        memset(&cp, 0, sizeof cp);
        cp.field_mask = GSC_CONDITION_PARAM_FIELD_CATEGORY | GSC_CONDITION_PARAM_FIELD_CONTEXT;
        cp.category = stream->category;
        cp.context = stream->handle;
        st = gsc_condition_create(&cp, &c->cond);
        if (st != GSC_OK) rc = fail(MPI_ERR_OTHER, "MPIX_Stream_comm_create: the stream's condition", st);
    }
    if (rc != MPI_SUCCESS) {
        MPI_Comm_free(&c);
        return rc;
    }
    *newcomm = c;
    return MPI_SUCCESS;
}

int MPI_Comm_rank(MPI_Comm comm, int *rank)
{
    if (comm == MPI_COMM_NULL || rank == NULL) return fail(MPI_ERR_ARG, "MPI_Comm_rank: NULL argument", GSC_OK);
    *rank = comm->rank;
    return MPI_SUCCESS;
}

int MPI_Comm_size(MPI_Comm comm, int *size)
{
    if (comm == MPI_COMM_NULL || size == NULL) return fail(MPI_ERR_ARG, "MPI_Comm_size: NULL argument", GSC_OK);
    *size = comm->size;
    return MPI_SUCCESS;
}

/* One send or receive on the communicator's stream. */
static int enqueue(const char *name, int send, void *buf, int count, MPI_Datatype datatype, int peer, int tag,
                   MPI_Comm comm, int stream_waits)
{
    gsc_request_param_t p;
    gsc_status_ptr_t s;
    uint64_t tag64, mask = ~UINT64_C(0);
    size_t size = type_size(datatype);
    char what[96];

    snprintf(what, sizeof what, "%s", name);
    if (comm == MPI_COMM_NULL || count < 0 || size == 0 || (buf == NULL && count > 0)) {
        return fail(MPI_ERR_ARG, strcat(what, ": bad communicator, count, datatype or buffer"), GSC_OK);
    }
    if ((send && (peer < 0 || tag < 0)) || peer >= comm->size || (!send && peer < MPI_ANY_SOURCE) ||
        (!send && tag < MPI_ANY_TAG)) {
        return fail(MPI_ERR_ARG, strcat(what, ": rank or tag out of range"), GSC_OK);
    }
    memset(&p, 0, sizeof p);
    p.op_attr_mask = GSC_OP_ATTR_FIELD_CONDITION | GSC_OP_ATTR_FIELD_FLAGS;
    p.condition = comm->cond;
    p.flags = stream_waits ? 0 : GSC_OP_ATTR_FLAG_NO_STREAM_WAIT;
    if (send) {
        tag64 = ((uint64_t)(uint32_t)tag << 32) | (uint32_t)comm->rank;
        s = gsc_tag_send_nbx(comm->eps[peer], buf, (size_t)count * size, tag64, &p);
    } else {
        tag64 = ((uint64_t)(uint32_t)(tag < 0 ? 0 : tag) << 32) | (uint32_t)(peer < 0 ? 0 : peer);
        if (peer == MPI_ANY_SOURCE) mask &= ~UINT64_C(0xffffffff);
        if (tag == MPI_ANY_TAG) mask &= UINT64_C(0xffffffff);
        s = gsc_tag_recv_nbx(comm->worker, buf, (size_t)count * size, tag64, mask, &p);
    }
    if (GSC_PTR_IS_ERR(s)) return fail(MPI_ERR_OTHER, what, GSC_PTR_STATUS(s));
    /* The stream tracks it from here; failures show in gsc_condition_query(). */
    if (GSC_PTR_IS_PTR(s)) gsc_request_free(s);
    return MPI_SUCCESS;
}

static int new_request(MPI_Comm comm, MPI_Request *request)
{
    *request = malloc(sizeof **request);
    if (*request == NULL) return fail(MPI_ERR_OTHER, "request: out of memory", GSC_OK);
    (*request)->comm = comm;
    return MPI_SUCCESS;
}

int MPIX_Send_enqueue(const void *buf, int count, MPI_Datatype datatype, int dest, int tag, MPI_Comm comm)
{
    return enqueue("MPIX_Send_enqueue", 1, (void *)buf, count, datatype, dest, tag, comm, 1);
}

int MPIX_Recv_enqueue(void *buf, int count, MPI_Datatype datatype, int source, int tag, MPI_Comm comm, MPI_Status *status)
{
    if (status != MPI_STATUS_IGNORE) return fail(MPI_ERR_ARG, "MPIX_Recv_enqueue: status must be MPI_STATUS_IGNORE", GSC_OK);
    return enqueue("MPIX_Recv_enqueue", 0, buf, count, datatype, source, tag, comm, 1);
}

int MPIX_Isend_enqueue(const void *buf, int count, MPI_Datatype datatype, int dest, int tag, MPI_Comm comm, MPI_Request *request)
{
    int rc;
    if (request == NULL) return fail(MPI_ERR_ARG, "MPIX_Isend_enqueue: request is NULL", GSC_OK);
    rc = enqueue("MPIX_Isend_enqueue", 1, (void *)buf, count, datatype, dest, tag, comm, 0);
    return rc == MPI_SUCCESS ? new_request(comm, request) : rc;
}

int MPIX_Irecv_enqueue(void *buf, int count, MPI_Datatype datatype, int source, int tag, MPI_Comm comm, MPI_Request *request)
{
    int rc;
    if (request == NULL) return fail(MPI_ERR_ARG, "MPIX_Irecv_enqueue: request is NULL", GSC_OK);
    rc = enqueue("MPIX_Irecv_enqueue", 0, buf, count, datatype, source, tag, comm, 0);
    return rc == MPI_SUCCESS ? new_request(comm, request) : rc;
}

int MPIX_Waitall_enqueue(int count, MPI_Request array_of_requests[], MPI_Status array_of_statuses[])
{
    int i, j;
    if (count < 0 || (count > 0 && array_of_requests == NULL)) return fail(MPI_ERR_ARG, "MPIX_Waitall_enqueue: bad request array", GSC_OK);
    if (array_of_statuses != MPI_STATUSES_IGNORE) return fail(MPI_ERR_ARG, "MPIX_Waitall_enqueue: statuses must be MPI_STATUSES_IGNORE", GSC_OK);
    /* One stream wait per communicator among the requests (each covers all of its requests). */
    for (i = 0; i < count; i++) {
        MPI_Comm c;
        int seen = 0;
        if (array_of_requests[i] == MPI_REQUEST_NULL) continue;
        c = array_of_requests[i]->comm;
        for (j = 0; j < i && !seen; j++) seen = array_of_requests[j] != MPI_REQUEST_NULL && array_of_requests[j]->comm == c;
        if (!seen) CHECK(gsc_condition_wait(c->cond), "MPIX_Waitall_enqueue");
    }
    for (i = 0; i < count; i++) {
        free(array_of_requests[i]);
        array_of_requests[i] = MPI_REQUEST_NULL;
    }
    return MPI_SUCCESS;
}

int MPIX_Wait_enqueue(MPI_Request *request, MPI_Status *status)
{
    if (request == NULL) return fail(MPI_ERR_ARG, "MPIX_Wait_enqueue: request is NULL", GSC_OK);
    if (status != MPI_STATUS_IGNORE) return fail(MPI_ERR_ARG, "MPIX_Wait_enqueue: status must be MPI_STATUS_IGNORE", GSC_OK);
    return MPIX_Waitall_enqueue(1, request, MPI_STATUSES_IGNORE);
}

int MPIX_Allreduce_enqueue(const void *sendbuf, void *recvbuf, int count, MPI_Datatype datatype, MPI_Op op, MPI_Comm comm)
{
    if (comm == MPI_COMM_NULL || count < 0) return fail(MPI_ERR_ARG, "MPIX_Allreduce_enqueue: bad communicator or count", GSC_OK);
    if (comm->coll == NULL) return fail(MPI_ERR_ARG, "MPIX_Allreduce_enqueue: collectives need a CUDA stream communicator", GSC_OK);
    if (sendbuf == MPI_IN_PLACE) sendbuf = recvbuf;
    CHECK(gsc_comm_all_reduce(comm->coll, sendbuf, recvbuf, (size_t)count, (gsc_datatype_t)datatype, (gsc_red_op_t)op, comm->cond),
          "MPIX_Allreduce_enqueue");
    return MPI_SUCCESS;
}
