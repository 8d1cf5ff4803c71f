/*
 * gsc_mpix: MPICH's stream-enqueue calls (MPIX_Send_enqueue, MPIX_Recv_enqueue,
 * MPIX_Isend_enqueue, MPIX_Irecv_enqueue, MPIX_Wait_enqueue, MPIX_Waitall_enqueue,
 * MPIX_Allreduce_enqueue) as a small library over gscomm's C API (gsc.h), for programs that
 * have no MPI library with them, and as a worked example of the mapping for MPI implementers
 * (docs/MPI_IMPLEMENTERS.md).
 *
 * The semantics are MPICH's: an enqueued operation starts when the stream reaches it; a
 * blocking one (Send/Recv/Allreduce_enqueue) makes the stream's later work wait for its
 * completion; a non-blocking one (Isend/Irecv_enqueue) does not, and MPIX_Wait_enqueue /
 * MPIX_Waitall_enqueue put that wait on the stream later. The host never blocks in any of them.
 *
 * Mapping: a stream communicator is a gscomm worker with an endpoint to every rank, a condition
 * on the stream (STREAM for a CUDA stream, HOST_STREAM for a gsc host stream), and, for CUDA
 * streams, a gscomm communicator for the collectives. MPI's (source, tag) matching is a 64-bit
 * gscomm tag: tag in the high 32 bits, source rank in the low 32; MPI_ANY_SOURCE and
 * MPI_ANY_TAG clear the matching half of the mask. Isend/Irecv_enqueue issue with
 * GSC_OP_ATTR_FLAG_NO_STREAM_WAIT; a Wait_enqueue is a gsc_condition_wait(), which makes the
 * stream wait for every operation issued on the communicator's stream so far (at least the
 * request waited for, as MPI requires; possibly more, which only ever waits for operations that
 * were already started).
 *
 * The MPI_ types and constants below are this layer's own, not an MPI library's: do not
 * include this header together with mpi.h (an MPI library provides these calls itself).
 */
#ifndef GSC_MPIX_H
#define GSC_MPIX_H

#include <gsc.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gscx_comm *MPI_Comm;
typedef struct gscx_request *MPI_Request;
typedef struct gscx_stream *MPIX_Stream;
typedef int MPI_Datatype; /* a gsc_datatype_t */
typedef int MPI_Op;       /* a gsc_red_op_t */
typedef struct {
    int MPI_SOURCE;
    int MPI_TAG;
    int MPI_ERROR;
} MPI_Status;

#define MPI_SUCCESS 0
#define MPI_ERR_ARG 12
#define MPI_ERR_OTHER 15
#define MPI_ANY_SOURCE (-1)
#define MPI_ANY_TAG (-1)
#define MPI_COMM_NULL ((MPI_Comm)0)
#define MPI_REQUEST_NULL ((MPI_Request)0)
#define MPI_STATUS_IGNORE ((MPI_Status *)0)
#define MPI_STATUSES_IGNORE ((MPI_Status *)0)
#define MPI_IN_PLACE ((void *)1)

#define MPI_BYTE GSC_UINT8
#define MPI_CHAR GSC_INT8
#define MPI_INT8_T GSC_INT8
#define MPI_UINT8_T GSC_UINT8
#define MPI_INT GSC_INT32
#define MPI_INT32_T GSC_INT32
#define MPI_UINT32_T GSC_UINT32
#define MPI_INT64_T GSC_INT64
#define MPI_UINT64_T GSC_UINT64
#define MPI_FLOAT GSC_FLOAT32
#define MPI_DOUBLE GSC_FLOAT64

#define MPI_SUM GSC_SUM
#define MPI_PROD GSC_PROD
#define MPI_MAX GSC_MAX
#define MPI_MIN GSC_MIN

/* Streams. MPICH makes them from an MPI_Info ("type" = "cudaStream_t", "value" = the stream);
 * here one call per kind. `device` is the CUDA device the stream belongs to. */
int MPIX_Stream_create_cuda(void *cuda_stream, int device, MPIX_Stream *stream);
int MPIX_Stream_create_host(gsc_host_stream_h host_stream, MPIX_Stream *stream);
int MPIX_Stream_free(MPIX_Stream *stream);

/* A stream communicator over the ranks of `world` (MPICH: MPIX_Stream_comm_create over an
 * MPI_Comm). Collective over `world`. */
int MPIX_Stream_comm_create(gsc_bootstrap_h world, MPIX_Stream stream, MPI_Comm *newcomm);
/* The stream must have completed the communicator's work (synchronize it first), as MPI
 * requires of a freed communicator's operations. */
int MPI_Comm_free(MPI_Comm *comm);
int MPI_Comm_rank(MPI_Comm comm, int *rank);
int MPI_Comm_size(MPI_Comm comm, int *size);

int MPIX_Send_enqueue(const void *buf, int count, MPI_Datatype datatype, int dest, int tag, MPI_Comm comm);
/* `status` must be MPI_STATUS_IGNORE (as in MPICH: nothing on the host sees the completion). */
int MPIX_Recv_enqueue(void *buf, int count, MPI_Datatype datatype, int source, int tag, MPI_Comm comm,
                      MPI_Status *status);
int MPIX_Isend_enqueue(const void *buf, int count, MPI_Datatype datatype, int dest, int tag, MPI_Comm comm,
                       MPI_Request *request);
int MPIX_Irecv_enqueue(void *buf, int count, MPI_Datatype datatype, int source, int tag, MPI_Comm comm,
                       MPI_Request *request);
int MPIX_Wait_enqueue(MPI_Request *request, MPI_Status *status);
int MPIX_Waitall_enqueue(int count, MPI_Request array_of_requests[], MPI_Status array_of_statuses[]);
/* CUDA streams only (the collective is a kernel on the stream). */
int MPIX_Allreduce_enqueue(const void *sendbuf, void *recvbuf, int count, MPI_Datatype datatype, MPI_Op op,
                           MPI_Comm comm);

/* The reason for the last failure of a call of this layer (process-wide: the last one of any
 * thread). */
const char *MPIX_Last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* GSC_MPIX_H */
