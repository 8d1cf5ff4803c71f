/*
 * gsc.h - the C API of gscomm, a GPU communication runtime.
 *
 * The shape follows UCP (ucp_init, ucp_worker_*, ucp_ep_*, ucp_tag_*_nbx, ucp_mem_map, rkeys)
 * so that an MPI library with a UCX PML can adopt it with little glue. Differences from UCP are
 * noted where they matter.
 *
 * General rules
 * -------------
 * - Every function checks its arguments. A failing call returns a named gsc_status_t (or an
 *   error status pointer, or NULL/0 where the function has no status to return) and records a
 *   message for the calling thread, readable with gsc_last_error_message().
 * - Handles (gsc_context_h, gsc_worker_h, gsc_ep_h, gsc_mem_h, gsc_rkey_h) are checked against
 *   the set of live handles on every use: a NULL, destroyed or wrong-type handle is reported as
 *   GSC_ERR_INVALID_HANDLE instead of being dereferenced. (A destroyed handle whose memory was
 *   reused for a new handle of the same type cannot be told apart from the new one.)
 * - Request handles are not pointers: a stale, forged or already freed request is reported as
 *   GSC_ERR_INVALID_HANDLE.
 * - No call lets a Rust panic escape: an internal failure is reported as GSC_ERR_INTERNAL.
 * - All objects may be used from any thread (like UCS_THREAD_MODE_MULTI); completion callbacks
 *   run inside whichever thread calls gsc_worker_progress() (or a call that progresses). Once a
 *   worker has armed its first conditioned operation, its proxy thread progresses it too, so
 *   callbacks may then also run on that thread. With GSC_PROXY_THREAD=off (a config pair of
 *   gsc_init, or the environment) there is no such thread: conditioned operations start inside
 *   the application's calls that progress the worker (gsc_worker_progress, gsc_request_wait;
 *   the request tests only look), as a library that drives progress itself wants; a GPU stream waiting on one then
 *   waits until the host progresses the worker.
 * - Buffers are contiguous bytes: every `count` is a number of bytes.
 * - The C API needs 64-bit pointers (request handles use 64 bits).
 *
 * Object lifetimes
 * ----------------
 * Destroy in reverse order of creation: close endpoints, destroy workers, unmap memory, then
 * gsc_cleanup(). Destroying a parent early is not undefined behaviour: gsc_worker_destroy()
 * releases the worker's endpoints (without telling peers), gsc_cleanup() releases the context's
 * workers (and their endpoints) and unmaps its memory; their handles become invalid, and so do
 * the worker's outstanding requests (their callbacks never run; receive buffers are no longer
 * written). Address and rkey buffers stay valid until released.
 */
#ifndef GSC_H
#define GSC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------ */
/* Version                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/** Major version of this header (checked against the library's Cargo version at build time). */
#define GSC_VERSION_MAJOR 0
/** Minor version of this header. */
#define GSC_VERSION_MINOR 1
/** Patch version of this header. */
#define GSC_VERSION_PATCH 0

/**
 * The version of the loaded library (which may differ from the GSC_VERSION_* macros the caller
 * was compiled with). Any pointer may be NULL.
 */
void gsc_get_version(unsigned *major_p, unsigned *minor_p, unsigned *patch_p);

/* ------------------------------------------------------------------------------------------ */
/* Status codes                                                                                */
/* ------------------------------------------------------------------------------------------ */

/**
 * Status codes. Values are stable: they never change meaning once released. Grouped by scope:
 * -1..-19 the call itself, -20..-39 the operation, -40..-59 the peer or connection,
 * -60..-79 devices and drivers, -80..-99 the library itself.
 */
typedef enum {
    GSC_OK                    = 0,   /**< Success. */
    GSC_INPROGRESS            = 1,   /**< Operation in progress. */

    GSC_ERR_INVALID_PARAM     = -1,  /**< Invalid parameter (NULL pointer, bad field...). */
    GSC_ERR_INVALID_HANDLE    = -2,  /**< Invalid, stale or already released handle. */
    GSC_ERR_UNSUPPORTED       = -3,  /**< Operation not supported (in this build). */
    GSC_ERR_NO_MEMORY         = -4,  /**< Out of memory. */
    GSC_ERR_NO_RESOURCE       = -5,  /**< Resources temporarily exhausted. */
    GSC_ERR_OUT_OF_RANGE      = -6,  /**< Value or address out of range. */
    GSC_ERR_BUSY              = -7,  /**< Object busy (operations in flight). */
    GSC_ERR_ALREADY_EXISTS    = -8,  /**< Already exists. */
    GSC_ERR_NO_MESSAGE        = -9,  /**< No matching message. */
    GSC_ERR_INVALID_ADDRESS   = -10, /**< Invalid or corrupt worker address. */
    GSC_ERR_INVALID_CONFIG    = -11, /**< Invalid configuration value (GSC_* variable). */
    GSC_ERR_IO_ERROR          = -12, /**< Input/output error. */

    GSC_ERR_MESSAGE_TRUNCATED = -20, /**< Receive buffer smaller than the message. */
    GSC_ERR_CANCELED          = -21, /**< Request canceled. */
    GSC_ERR_TIMED_OUT         = -22, /**< Timed out (GSC_TIMEOUT). */
    GSC_ERR_ABORTED           = -23, /**< Aborted. */

    GSC_ERR_PEER_FAILED       = -40, /**< Peer failed (died or stopped answering). */
    GSC_ERR_UNREACHABLE       = -41, /**< Peer unreachable by any enabled lane. */
    GSC_ERR_NOT_CONNECTED     = -42, /**< Endpoint closed or not connected. */
    GSC_ERR_CONNECTION_RESET  = -43, /**< Connection reset by peer. */
    GSC_ERR_REJECTED          = -44, /**< Connection rejected. */

    GSC_ERR_NO_DEVICE         = -60, /**< No such device. */
    GSC_ERR_DEVICE            = -61, /**< Device or driver error. */
    GSC_ERR_LIBRARY_MISSING   = -62, /**< A required shared library could not be loaded. */

    GSC_ERR_INTERNAL          = -80, /**< Internal error (a bug; see the last-error message). */

    GSC_ERR_LAST              = -100 /**< Bound of the error codes; not a status itself. */
} gsc_status_t;

/**
 * Result of a non-blocking operation: NULL when it completed at once (successfully), an
 * encoded error status (test with GSC_PTR_IS_ERR), or a request handle (GSC_PTR_IS_PTR) to
 * test, wait on and finally release with gsc_request_free(). A request handle is an integer
 * that is never 0 and never >= (uintptr_t)GSC_ERR_LAST; it must not be dereferenced.
 */
typedef void *gsc_status_ptr_t;

/** True when the status pointer encodes an error. */
#define GSC_PTR_IS_ERR(_ptr) ((uintptr_t)(_ptr) >= (uintptr_t)GSC_ERR_LAST)

/** True when the status pointer is a request handle (neither NULL nor an error). */
#define GSC_PTR_IS_PTR(_ptr) (((uintptr_t)(_ptr) - 1) < ((uintptr_t)GSC_ERR_LAST - 1))

/**
 * The status a status pointer stands for: the error it encodes, GSC_OK for NULL, and
 * GSC_INPROGRESS for a request handle.
 */
#define GSC_PTR_STATUS(_ptr)                                                                  \
    (GSC_PTR_IS_ERR(_ptr) ? (gsc_status_t)(intptr_t)(_ptr)                                    \
                          : ((_ptr) == NULL ? GSC_OK : GSC_INPROGRESS))

/**
 * A static, NUL-terminated description of a status ("unknown status" for a value that is not a
 * gsc_status_t). Never NULL.
 */
const char *gsc_status_string(gsc_status_t status);

/**
 * The message of the most recent failing gscomm call made by the calling thread (it names the
 * function and what was wrong), or "" when none failed yet. Calls that succeed leave it alone.
 * The string stays valid until the next failing call on this thread. Never NULL.
 */
const char *gsc_last_error_message(void);

/* ------------------------------------------------------------------------------------------ */
/* Handles                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/** A context: configuration, identity and the memory registry (cf. ucp_context_h). */
typedef struct gsc_context *gsc_context_h;
/** A worker: the progress engine owning endpoints and requests (cf. ucp_worker_h). */
typedef struct gsc_worker *gsc_worker_h;
/** An endpoint: a connection from a worker to one peer worker (cf. ucp_ep_h). */
typedef struct gsc_ep *gsc_ep_h;
/** A registered memory region (cf. ucp_mem_h). */
typedef struct gsc_mem *gsc_mem_h;
/** An unpacked remote key: a peer's region usable for put/get (cf. ucp_rkey_h). */
typedef struct gsc_rkey *gsc_rkey_h;
/** A message taken from the unexpected queue by gsc_tag_probe_nb(remove = 1). */
typedef struct gsc_tag_message *gsc_tag_message_h;
/**
 * A condition: when an operation starts and what waits for it (a CUDA stream position, a graph
 * node, a kernel trigger, a host stream). See gsc_condition_create().
 */
typedef struct gsc_condition *gsc_condition_h;
/** An ordered CPU work queue with CUDA-stream semantics (see gsc_host_stream_create()). */
typedef struct gsc_host_stream *gsc_host_stream_h;

/* ------------------------------------------------------------------------------------------ */
/* Context                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/** One configuration override: a GSC_* variable name (the prefix and case are optional) and
 *  its value, as it would be written in the environment. */
typedef struct gsc_config_pair {
    const char *name;  /**< e.g. "GSC_TIMEOUT" or "timeout". */
    const char *value; /**< e.g. "30s". */
} gsc_config_pair_t;

/** gsc_params_t.field_mask: `config` and `config_count` are set. */
#define GSC_PARAM_FIELD_CONFIG (UINT64_C(1) << 0)
/** gsc_params_t.field_mask: `request_size` is set. */
#define GSC_PARAM_FIELD_REQUEST_SIZE (UINT64_C(1) << 1)
/** gsc_params_t.field_mask: `request_init` is set. */
#define GSC_PARAM_FIELD_REQUEST_INIT (UINT64_C(1) << 2)
/** gsc_params_t.field_mask: `request_cleanup` is set. */
#define GSC_PARAM_FIELD_REQUEST_CLEANUP (UINT64_C(1) << 3)

/** Runs on a request area (see gsc_params_t.request_size and gsc_request_area()). */
typedef void (*gsc_request_area_callback_t)(void *area);

/** Parameters of gsc_init(). A zero field_mask (or a NULL pointer) means defaults. */
typedef struct gsc_params {
    uint64_t field_mask;              /**< GSC_PARAM_FIELD_* bits of the fields that are set. */
    const gsc_config_pair_t *config;  /**< Overrides applied on top of the environment. */
    size_t config_count;              /**< Number of entries in `config`. */
    /** Bytes of caller state every request carries (1 to 65536; UCP's request_size): an MPI
     *  library keeps its per-request data there, reached with gsc_request_area(). Areas are
     *  16-byte aligned and zeroed when first allocated. */
    size_t request_size;
    /** Called once on each area when it is first allocated, not on every reuse (UCP's
     *  request_init): areas are pooled per worker and handed back unchanged. Needs request_size. */
    gsc_request_area_callback_t request_init;
    /** Called once on each area before it is freed (worker destroyed, or more areas pooled
     *  than the worker keeps). Needs request_size. */
    gsc_request_area_callback_t request_cleanup;
} gsc_params_t;

/**
 * Create a context. The configuration is the GSC_* environment with the overrides of
 * `params->config` applied on top (a later pair wins); an unknown name or a bad value fails with
 * GSC_ERR_INVALID_CONFIG and a last-error message naming the variable. Also installs the
 * library's log output (GSC_LOG_LEVEL, GSC_LOG_SUBSYS, GSC_LOG_FILE) unless the process already
 * has a tracing subscriber.
 * @param params     may be NULL (defaults).
 * @param context_p  receives the context; must not be NULL.
 */
gsc_status_t gsc_init(const gsc_params_t *params, gsc_context_h *context_p);

/**
 * Release a context. Workers and memory regions still alive are released with it (see
 * "Object lifetimes" above).
 */
gsc_status_t gsc_cleanup(gsc_context_h context);

/* ------------------------------------------------------------------------------------------ */
/* Memory                                                                                      */
/* ------------------------------------------------------------------------------------------ */

/** gsc_mem_map_params_t.field_mask: `address` is set. */
#define GSC_MEM_MAP_PARAM_FIELD_ADDRESS (UINT64_C(1) << 0)
/** gsc_mem_map_params_t.field_mask: `length` is set (required). */
#define GSC_MEM_MAP_PARAM_FIELD_LENGTH  (UINT64_C(1) << 1)
/** gsc_mem_map_params_t.field_mask: `flags` is set. */
#define GSC_MEM_MAP_PARAM_FIELD_FLAGS   (UINT64_C(1) << 2)

/** gsc_mem_map_params_t.flags: let the library allocate `length` zeroed bytes (then `address`
 *  must not be given); gsc_mem_query() tells where. Freed by gsc_mem_unmap(). */
#define GSC_MEM_MAP_ALLOCATE (UINT64_C(1) << 0)

/** Parameters of gsc_mem_map(). */
typedef struct gsc_mem_map_params {
    uint64_t field_mask; /**< GSC_MEM_MAP_PARAM_FIELD_* bits of the fields that are set. */
    void *address;       /**< Existing memory to register (without GSC_MEM_MAP_ALLOCATE). */
    size_t length;       /**< Bytes to register or allocate. */
    uint64_t flags;      /**< GSC_MEM_MAP_* flags. */
} gsc_mem_map_params_t;

/**
 * Register memory for one-sided access by peers (or allocate it). Existing memory must stay
 * valid until gsc_mem_unmap().
 */
gsc_status_t gsc_mem_map(gsc_context_h context, const gsc_mem_map_params_t *params,
                         gsc_mem_h *memh_p);

/** Unregister (and, if the library allocated it, free) a region; later peer accesses fail. */
gsc_status_t gsc_mem_unmap(gsc_context_h context, gsc_mem_h memh);

/** Where a region starts and how long it is. Either output pointer may be NULL. */
gsc_status_t gsc_mem_query(gsc_mem_h memh, void **address_p, size_t *length_p);

/**
 * Pack the remote key of a region, for a peer to unpack with gsc_ep_rkey_unpack(). The buffer
 * is owned by the library until gsc_rkey_buffer_release().
 */
gsc_status_t gsc_rkey_pack(gsc_context_h context, gsc_mem_h memh, void **buffer_p,
                           size_t *size_p);

/** Release a buffer returned by gsc_rkey_pack(). */
gsc_status_t gsc_rkey_buffer_release(void *buffer);

/* ------------------------------------------------------------------------------------------ */
/* Worker                                                                                      */
/* ------------------------------------------------------------------------------------------ */

/** Parameters of gsc_worker_create(). No field is defined yet: field_mask must be 0. */
typedef struct gsc_worker_params {
    uint64_t field_mask; /**< Must be 0 in this version. */
} gsc_worker_params_t;

/** Create a worker. `params` may be NULL (defaults). */
gsc_status_t gsc_worker_create(gsc_context_h context, const gsc_worker_params_t *params,
                               gsc_worker_h *worker_p);

/**
 * Destroy a worker. Close its endpoints first; endpoints still open are released without
 * telling their peers, and outstanding requests become invalid (see "Object lifetimes").
 */
gsc_status_t gsc_worker_destroy(gsc_worker_h worker);
/** Abort the worker, from any thread, at any time, without its peers: every operation in flight
 *  or waiting for its condition completes with GSC_ERR_ABORTED (streams and graphs waiting for
 *  one are released with an error mark, see gsc_condition_query()), its links are closed (peers
 *  see them fail), and every later operation on it fails at once with GSC_ERR_ABORTED
 *  (sticky). `reason` (may be NULL) goes into the error message. Idempotent; returns within
 *  about a second. The worker still has to be destroyed. */
gsc_status_t gsc_worker_abort(gsc_worker_h worker, const char *reason);

/**
 * The worker's packed address, to give to peers (as opaque bytes) for gsc_ep_create(). The
 * buffer is owned by the library until gsc_worker_release_address().
 */
gsc_status_t gsc_worker_get_address(gsc_worker_h worker, void **address_p, size_t *length_p);

/** Release an address returned by gsc_worker_get_address() for the same worker. */
gsc_status_t gsc_worker_release_address(gsc_worker_h worker, void *address);

/**
 * Make progress: accept connections, move data, complete requests and run their callbacks.
 * Returns the number of events handled (0: nothing happened, or an invalid worker, which sets
 * the last-error message).
 */
unsigned gsc_worker_progress(gsc_worker_h worker);

/* ------------------------------------------------------------------------------------------ */
/* Request parameters                                                                          */
/* ------------------------------------------------------------------------------------------ */

/** Where a buffer lives. */
typedef enum {
    GSC_MEMORY_TYPE_HOST = 0, /**< Host memory. */
    GSC_MEMORY_TYPE_CUDA = 1  /**< CUDA device memory (tagged send/receive; see GSC_CUDA_IPC). */
} gsc_memory_type_t;

/** What a completed tagged receive reports. */
typedef struct gsc_tag_recv_info {
    uint64_t sender_tag; /**< The tag the message was sent with. */
    size_t length;       /**< The sender's length (on truncation, more than was written). */
} gsc_tag_recv_info_t;

/** Completion callback of sends, put/get, flushes and endpoint close. `request` is the handle
 *  the operation returned; the callback may free it. */
typedef void (*gsc_send_nbx_callback_t)(void *request, gsc_status_t status, void *user_data);

/** Completion callback of tagged receives; `info` is valid during the call only. */
typedef void (*gsc_tag_recv_nbx_callback_t)(void *request, gsc_status_t status,
                                            const gsc_tag_recv_info_t *info, void *user_data);

/** gsc_request_param_t.op_attr_mask: `cb` is set. */
#define GSC_OP_ATTR_FIELD_CALLBACK    (UINT64_C(1) << 0)
/** gsc_request_param_t.op_attr_mask: `user_data` is set. */
#define GSC_OP_ATTR_FIELD_USER_DATA   (UINT64_C(1) << 1)
/** gsc_request_param_t.op_attr_mask: `flags` is set. */
#define GSC_OP_ATTR_FIELD_FLAGS       (UINT64_C(1) << 2)
/** gsc_request_param_t.op_attr_mask: `memory_type` is set (otherwise: detected). */
#define GSC_OP_ATTR_FIELD_MEMORY_TYPE (UINT64_C(1) << 3)
/** gsc_request_param_t.op_attr_mask: `recv_info` is set (receives only). */
#define GSC_OP_ATTR_FIELD_RECV_INFO   (UINT64_C(1) << 4)
/** gsc_request_param_t.op_attr_mask: `condition` is set. */
#define GSC_OP_ATTR_FIELD_CONDITION   (UINT64_C(1) << 5)
/** gsc_request_param_t.op_attr_mask: `condition_out` is set (required with a GRAPH or
 *  KERNEL_TRIGGERED condition). */
#define GSC_OP_ATTR_FIELD_CONDITION_OUT (UINT64_C(1) << 6)

/** gsc_request_param_t.flags: always return a request, even when the operation completed at
 *  once; its callback then runs as for any request (possibly before the call returns). */
#define GSC_OP_ATTR_FLAG_NO_IMM_CMPL (UINT64_C(1) << 0)
/** gsc_request_param_t.flags, gsc_ep_close_nbx() only: close at once without waiting for
 *  sends in flight (they complete with GSC_ERR_CANCELED). */
#define GSC_EP_CLOSE_FLAG_FORCE      (UINT64_C(1) << 1)
/** gsc_request_param_t.flags, with a STREAM or HOST_STREAM condition: the stream does not wait
 *  for this operation to complete (like MPIX_Isend_enqueue); gsc_condition_wait() later makes it
 *  wait for everything issued on the condition so far. Lets a send and a receive on one stream
 *  be in flight together, as a halo exchange needs. A receive into GPU memory of at most
 *  GSC_CUDA_STAGE_MAX bytes (4 KiB by default) on a STREAM or GRAPH condition is staged through
 *  page-locked memory: its bytes reach the buffer in the stream wait that covers it (with this
 *  flag, the next gsc_condition_wait()), so its request completing on the host means the
 *  message arrived, not yet that the buffer holds it. */
#define GSC_OP_ATTR_FLAG_NO_STREAM_WAIT (UINT64_C(1) << 2)

/** What arming an operation on a GRAPH or KERNEL_TRIGGERED condition gives back. */
typedef struct gsc_condition_out {
    void *start_node;    /**< GRAPH: the CUgraphNode that triggers the operation; add the nodes
                              it must follow as its dependencies. */
    void *done_node;     /**< GRAPH: the CUgraphNode that completes after the operation did;
                              make later nodes depend on it. */
    void *device_handle; /**< KERNEL_TRIGGERED: device address of the gsc_device_handle_t a
                              kernel passes to gsc_trigger()/gsc_wait() (gsc_device.cuh). */
} gsc_condition_out_t;

/**
 * Options of a non-blocking operation (cf. ucp_request_param_t). Fields are read only when
 * their bit is set in op_attr_mask; a zero mask (or a NULL pointer) means defaults: no
 * callback, memory type detected, no condition. Unknown bits are rejected.
 */
typedef struct gsc_request_param {
    uint64_t op_attr_mask; /**< GSC_OP_ATTR_FIELD_* bits of the fields that are set. */
    uint64_t flags;        /**< GSC_OP_ATTR_FLAG_* / GSC_EP_CLOSE_FLAG_* bits. */
    union {
        gsc_send_nbx_callback_t send;     /**< For sends, put/get, flushes, close. */
        gsc_tag_recv_nbx_callback_t recv; /**< For gsc_tag_recv_nbx, gsc_tag_msg_recv_nbx. */
    } cb;                  /**< Called once when an operation that returns a request completes
                                (never when it completed at once and NULL was returned). It may
                                run before the initiating call returns (e.g. an immediate error
                                such as a truncation, or with GSC_OP_ATTR_FLAG_NO_IMM_CMPL). */
    void *user_data;       /**< Passed to the callback. */
    gsc_memory_type_t memory_type; /**< Where the buffer lives. */
    union {
        gsc_tag_recv_info_t *tag_info; /**< Filled when a receive completes at once. */
    } recv_info;           /**< Receive information on immediate completion. */
    gsc_condition_h condition; /**< When the operation starts (NULL: now). */
    gsc_condition_out_t *condition_out; /**< Filled when the call arms a GRAPH or
                                             KERNEL_TRIGGERED operation. */
} gsc_request_param_t;

/* ------------------------------------------------------------------------------------------ */
/* Endpoints                                                                                   */
/* ------------------------------------------------------------------------------------------ */

/** gsc_ep_params_t.field_mask: `address` is set (required). */
#define GSC_EP_PARAM_FIELD_ADDRESS        (UINT64_C(1) << 0)
/** gsc_ep_params_t.field_mask: `address_length` is set: the address is read within it
 *  (otherwise its length is taken from its own header, as UCP does). */
#define GSC_EP_PARAM_FIELD_ADDRESS_LENGTH (UINT64_C(1) << 1)

/** Parameters of gsc_ep_create(). */
typedef struct gsc_ep_params {
    uint64_t field_mask;   /**< GSC_EP_PARAM_FIELD_* bits of the fields that are set. */
    const void *address;   /**< A peer worker's address (from gsc_worker_get_address). */
    size_t address_length; /**< Its length in bytes. */
} gsc_ep_params_t;

/** Create an endpoint to the worker whose address is `params->address`. */
gsc_status_t gsc_ep_create(gsc_worker_h worker, const gsc_ep_params_t *params, gsc_ep_h *ep_p);

/**
 * Close an endpoint. Without GSC_EP_CLOSE_FLAG_FORCE the returned request completes once every
 * send on the endpoint completed and the peer was told. The handle is invalid as soon as this
 * returns, whatever the outcome (except an argument error, which changes nothing).
 */
gsc_status_ptr_t gsc_ep_close_nbx(gsc_ep_h ep, const gsc_request_param_t *param);

/** Completes when every earlier operation on the endpoint was applied at the peer. */
gsc_status_ptr_t gsc_ep_flush_nbx(gsc_ep_h ep, const gsc_request_param_t *param);

/** Completes when every earlier operation on every endpoint of the worker was applied. */
gsc_status_ptr_t gsc_worker_flush_nbx(gsc_worker_h worker, const gsc_request_param_t *param);

/* ------------------------------------------------------------------------------------------ */
/* Tagged messages                                                                             */
/* ------------------------------------------------------------------------------------------ */

/**
 * Send `count` bytes at `buffer` with `tag`. The buffer must stay valid and unmodified until the
 * operation completes (at once when NULL is returned).
 */
gsc_status_ptr_t gsc_tag_send_nbx(gsc_ep_h ep, const void *buffer, size_t count, uint64_t tag,
                                  const gsc_request_param_t *param);

/**
 * Receive into `buffer` (up to `count` bytes) the first message whose tag matches:
 * (sender_tag & tag_mask) == (tag & tag_mask). A longer message completes the request with
 * GSC_ERR_MESSAGE_TRUNCATED; nothing is written past `count` bytes.
 */
gsc_status_ptr_t gsc_tag_recv_nbx(gsc_worker_h worker, void *buffer, size_t count, uint64_t tag,
                                  uint64_t tag_mask, const gsc_request_param_t *param);

/**
 * Is there an unexpected message matching (tag, tag_mask)? Progresses once first. Returns NULL
 * if none (or on an argument error, which sets the last-error message), else a non-NULL handle
 * and fills `info`. With `remove` non-zero the message is taken off the queue and must be
 * received with gsc_tag_msg_recv_nbx(); with `remove` 0 the handle only says "found".
 */
gsc_tag_message_h gsc_tag_probe_nb(gsc_worker_h worker, uint64_t tag, uint64_t tag_mask,
                                   int remove, gsc_tag_recv_info_t *info);

/** Receive a message taken by gsc_tag_probe_nb(remove = 1) on the same worker. */
gsc_status_ptr_t gsc_tag_msg_recv_nbx(gsc_worker_h worker, void *buffer, size_t count,
                                      gsc_tag_message_h message,
                                      const gsc_request_param_t *param);

/* ------------------------------------------------------------------------------------------ */
/* Requests                                                                                    */
/* ------------------------------------------------------------------------------------------ */

/** GSC_INPROGRESS while the request runs, then its final status. Does not progress. */
gsc_status_t gsc_request_check_status(void *request);

/** As gsc_request_check_status(), and fills `info` (may be NULL) once a receive completed. */
gsc_status_t gsc_tag_recv_request_test(void *request, gsc_tag_recv_info_t *info);

/**
 * Progress the request's worker until the request completes and return its status (filling
 * `info`, which may be NULL, for receives). Gives up after GSC_TIMEOUT with GSC_ERR_TIMED_OUT;
 * the request then stays valid. Does not free the request.
 */
gsc_status_t gsc_request_wait(void *request, gsc_tag_recv_info_t *info);

/**
 * Cancel a receive that has not matched a message yet: it completes with GSC_ERR_CANCELED.
 * Fails with GSC_ERR_BUSY once matched, GSC_ERR_UNSUPPORTED for other operations.
 */
gsc_status_t gsc_request_cancel(gsc_worker_h worker, void *request);

/**
 * The caller's area of a request (gsc_params_t.request_size bytes): valid from the call that
 * returned the request until gsc_request_free(), and during the request's completion callback
 * even when the handle was freed while the request was in progress. Operations that complete at
 * once return no request and so use no area.
 * @return GSC_OK with *area_p set; GSC_ERR_UNSUPPORTED when the context was created without a
 *         request size; GSC_ERR_INVALID_HANDLE for anything that is not a live request.
 */
gsc_status_t gsc_request_area(void *request, void **area_p);

/**
 * Release a request handle. A request still in progress completes anyway (its callback still
 * runs). The handle is invalid afterwards; releasing it again (or an invalid handle) is
 * reported through gsc_last_error_message() and the log, and otherwise ignored.
 */
void gsc_request_free(void *request);

/* ------------------------------------------------------------------------------------------ */
/* Remote memory access                                                                        */
/* ------------------------------------------------------------------------------------------ */

/** Unpack a remote key packed by the peer `ep` leads to. `buffer` is a gsc_rkey_pack() buffer. */
gsc_status_t gsc_ep_rkey_unpack(gsc_ep_h ep, const void *buffer, gsc_rkey_h *rkey_p);

/** Release an unpacked remote key. */
gsc_status_t gsc_rkey_destroy(gsc_rkey_h rkey);

/**
 * Write `count` bytes at `buffer` to `remote_addr` in the peer's region. The range must lie
 * inside the region (GSC_ERR_OUT_OF_RANGE otherwise). Use a flush to know it was applied.
 */
gsc_status_ptr_t gsc_put_nbx(gsc_ep_h ep, const void *buffer, size_t count, uint64_t remote_addr,
                             gsc_rkey_h rkey, const gsc_request_param_t *param);

/** Read `count` bytes at `remote_addr` of the peer's region into `buffer`. */
gsc_status_ptr_t gsc_get_nbx(gsc_ep_h ep, void *buffer, size_t count, uint64_t remote_addr,
                             gsc_rkey_h rkey, const gsc_request_param_t *param);

/* ------------------------------------------------------------------------------------------ */
/* Prepared transfers: persistent and partitioned send/receive                                 */
/* ------------------------------------------------------------------------------------------ */

/**
 * A prepared transfer: one side of a persistent (MPI_Send_init/Recv_init) or partitioned
 * (MPI_Psend_init/Precv_init) send/receive pair. Matching and protocol are resolved once, when
 * both sides have prepared: the k-th send prepared with tag T towards a worker pairs with the
 * k-th receive prepared with tag T from that worker, in creation order (each side prepares on
 * its own endpoint to the other; a prepared send only pairs with a prepared receive). Every
 * round (gsc_prepared_start) is then: the receiver says its buffer is ready, the sender writes
 * the data into it (in frames, or directly where the lane allows), the receiver counts its
 * arrival; no tag matching, no rendezvous handshake, no allocation.
 */
typedef struct gsc_prepared *gsc_prepared_h;

/** gsc_buffer_param_t.direction */
typedef enum {
    GSC_PREPARE_SEND = 0, /**< This side sends the buffer. */
    GSC_PREPARE_RECV = 1  /**< This side receives into the buffer. */
} gsc_prepare_direction_t;

/** gsc_buffer_param_t.field_mask: `partitions` is set (a partitioned transfer). */
#define GSC_BUFFER_PARAM_FIELD_PARTITIONS  (UINT64_C(1) << 0)
/** gsc_buffer_param_t.field_mask: `memory_type` is set (otherwise: detected). */
#define GSC_BUFFER_PARAM_FIELD_MEMORY_TYPE (UINT64_C(1) << 1)
/** gsc_buffer_param_t.field_mask: `flags` is set. */
#define GSC_BUFFER_PARAM_FIELD_FLAGS       (UINT64_C(1) << 2)

/** Who runs a prepared transfer's rounds. Without a flag the selection table decides
 *  (GSC_ENGINE, `gsc-info -p`): the GPU itself where both sides can — GPU buffers of processes
 *  on one host with CUDA IPC and peer access between the GPUs, up to GSC_ENGINE_GPU_MAX bytes,
 *  not partitioned — the proxy thread elsewhere; the pair runs on the GPU when both sides
 *  offered it (gsc_prepared_on_gpu() tells which after pairing).
 *
 *  gsc_buffer_param_t.flags: require GPU rounds, without the proxy: each round is one kernel on
 *  the stream it is started on (a graph node under capture or on a GRAPH condition; started
 *  without a condition, a kernel on a stream of the transfer's own, the request completing when
 *  it ended) that writes the data into the peer's buffer over NVLink and raises a flag there.
 *  An error where the GPU cannot run them; the pair fails unless the peer can run them too.
 *  Needed when the application's kernels drive the rounds (gsc_prepared_device_handle).
 *  Partitioned transfers: see gsc_prepared_device_handle. A send's kernel waits on its stream
 *  until the receiver is ready, so start a receive before a send on one stream (in a condition
 *  group the order does not matter: the group's rounds go in one launch, readiness first).
 *  gsc_prepared_start() on a stream returns NULL (no request: the stream orders the round); a
 *  round whose peer does not answer within GSC_TIMEOUT gives up and is reported by
 *  gsc_prepared_gpu_error(). On a KERNEL_TRIGGERED condition the device handle's gsc_trigger()
 *  and gsc_wait() run the rounds in the calling thread (a send's trigger returns with the data
 *  written; a receive's round ends in the gsc_wait() after its trigger: see gsc_device.cuh).
 *  HOST_STREAM conditions do not start GPU rounds. */
#define GSC_PREPARE_FLAG_GPU_ROUNDS        (UINT64_C(1) << 0)
/** gsc_buffer_param_t.flags: run the rounds on the proxy thread whatever the table says (not
 *  with GSC_PREPARE_FLAG_GPU_ROUNDS). */
#define GSC_PREPARE_FLAG_PROXY             (UINT64_C(1) << 1)

/** What gsc_prepare_transfers() prepares. `direction`, `buffer`, `length` and `tag` are always
 *  read; the rest only when their bit is set in field_mask. */
typedef struct gsc_buffer_param {
    uint64_t field_mask;               /**< GSC_BUFFER_PARAM_FIELD_* bits. */
    gsc_prepare_direction_t direction; /**< Send or receive. */
    void *buffer;                      /**< The whole buffer; valid until released. */
    size_t length;                     /**< Its length in bytes; a send may be shorter than
                                            the receive it pairs with, never longer
                                            (GSC_ERR_MESSAGE_TRUNCATED on both sides). */
    uint64_t tag;                      /**< Pairs the two sides. */
    size_t partitions;                 /**< Split into this many equal parts (length must be
                                            a multiple). A send's parts go once
                                            gsc_prepared_pready() marks them; a receive reports
                                            them through gsc_prepared_parrived(). The two
                                            sides may split differently. Without this field
                                            a start moves the whole buffer. */
    gsc_memory_type_t memory_type;     /**< Where the buffer lives. */
    uint64_t flags;                    /**< GSC_PREPARE_FLAG_* bits. */
} gsc_buffer_param_t;

/**
 * Prepare a transfer of param->buffer on `ep` and announce it to the peer.
 * `prepared_memh` points to a gsc_prepared_h that receives the handle (the seed's signature
 * keeps it `void *`; pass `&handle`). The buffer must stay
 * valid until the handle is released, and must not be touched while a round is in flight (a
 * prepared receive's buffer may be written by the peer directly during its rounds).
 */
gsc_status_t gsc_prepare_transfers(gsc_ep_h ep, void *prepared_memh, const gsc_buffer_param_t *param);

/** Release a prepared transfer made on `ep` (`prepared_memh` is its gsc_prepared_h): the peer
 *  is told (its later rounds fail with GSC_ERR_NOT_CONNECTED) and the handle goes stale.
 *  GSC_ERR_BUSY, changing nothing, while a round is in flight. Rounds armed on a condition that
 *  has not triggered them yet do not count: release only after the stream passed them (they
 *  would fail with GSC_ERR_INVALID_HANDLE). Destroying the endpoint releases its prepared
 *  transfers (a round in flight first ends). A receive buffer the peer writes directly (host
 *  memory on a lane with cross-memory attach, GPU memory through CUDA IPC) must stay valid
 *  until both sides released the pair or the peer's process is gone: a round that ended on
 *  this side with an error (e.g. the endpoint was closed) may still be written by a live peer
 *  that saw its readiness. */
gsc_status_t gsc_release_preparations(gsc_ep_h ep, void *prepared_memh);

/** MPI_Send_init-like: a persistent send of `count` bytes with `tag` (gsc_prepare_transfers
 *  with GSC_PREPARE_SEND). Released with gsc_release_preparations(). */
gsc_status_t gsc_tag_send_init(gsc_ep_h ep, const void *buffer, size_t count, uint64_t tag,
                               gsc_prepared_h *prepared_p);

/** MPI_Recv_init-like: a persistent receive of `count` bytes with `tag` from the worker `ep`
 *  leads to. */
gsc_status_t gsc_tag_recv_init(gsc_ep_h ep, void *buffer, size_t count, uint64_t tag,
                               gsc_prepared_h *prepared_p);

/**
 * Start one round. Returns like gsc_tag_send_nbx()/gsc_tag_recv_nbx() (NULL when the round
 * completed at once, an error, or a request to test, wait on and free); param's callback,
 * flags and condition apply as for those (its memory type is ignored: preparing fixed it).
 * Without a condition a round must not be in flight (GSC_ERR_BUSY); on a condition, rounds
 * triggered while one is in flight run after it, in order.
 */
gsc_status_ptr_t gsc_prepared_start(gsc_prepared_h prepared, const gsc_request_param_t *param);

/** Mark `partition` of a partitioned send ready for the round in flight (or, with none in
 *  flight, the next one): it is written as soon as the receiver is ready. Marking one twice
 *  in a round is GSC_ERR_INVALID_PARAM; a partition past the last, GSC_ERR_OUT_OF_RANGE. */
gsc_status_t gsc_prepared_pready(gsc_prepared_h prepared, size_t partition);

/** Set *flag to 1 if `partition` of a partitioned receive has arrived in the round in flight
 *  (with no round in flight: if a round has completed), else 0. Progresses the worker. */
gsc_status_t gsc_prepared_parrived(gsc_prepared_h prepared, size_t partition, int *flag);

/** Set *on_gpu to 1 if the pair's rounds run on the GPU, 0 if on the proxy. Fixed at pairing:
 *  waits (up to GSC_TIMEOUT, progressing the worker) for the peer to have prepared when this
 *  side offered GPU rounds. */
gsc_status_t gsc_prepared_on_gpu(gsc_prepared_h prepared, int *on_gpu);

/** With GPU rounds (gsc_prepared_on_gpu): set *handle_p to the device address of this side's
 *  gsc_prepared_device_t (include/gsc_device.cuh), which kernels pass to gsc_pready() (a
 *  partitioned send: partitions sent from kernels, in any order, after gsc_prepared_start() on
 *  the kernel's stream) and gsc_parrived() (a partitioned receive, written in place: which
 *  partitions a kernel may read already). With GPU rounds both sides must use the same number
 *  of partitions. Waits (up to GSC_TIMEOUT) for the peer to have prepared. */
gsc_status_t gsc_prepared_device_handle(gsc_prepared_h prepared, void **handle_p);

/** With GPU rounds (gsc_prepared_on_gpu): set *round to 0, or to the round a kernel of this side gave
 *  up on because the peer did not answer within GSC_TIMEOUT (the pair is unusable then). Reads
 *  GPU memory synchronously. */
gsc_status_t gsc_prepared_gpu_error(gsc_prepared_h prepared, uint64_t *round);

/* ------------------------------------------------------------------------------------------ */
/* Bootstrap: how the processes of a job find each other (out of band, over TCP)              */
/* ------------------------------------------------------------------------------------------ */

/** Size of a unique id in bytes. */
#define GSC_UNIQUE_ID_BYTES 128
/** Size of a unique id's string form, including the terminating NUL (hex digits). */
#define GSC_UNIQUE_ID_STRING_LEN 257

/**
 * A job's unique id: where its rendezvous service runs and the job's secret (NCCL-style). Treat
 * it like a password: whoever has it can join the job. Hand it to the other ranks as bytes
 * (e.g. an MPI broadcast) or as a string (gsc_unique_id_to_string, e.g. GSC_UNIQUE_ID).
 */
typedef struct gsc_unique_id {
    char internal[GSC_UNIQUE_ID_BYTES]; /**< Opaque. */
} gsc_unique_id_t;

/** A bootstrapped job as seen by one rank. */
typedef struct gsc_bootstrap *gsc_bootstrap_h;

/**
 * Create a job id, starting its rendezvous service on a background thread of this process
 * (which must stay alive until every rank has called gsc_bootstrap_init).
 */
gsc_status_t gsc_get_unique_id(gsc_unique_id_t *uid);

/** Write the id as GSC_UNIQUE_ID_STRING_LEN - 1 hex digits and a NUL; `length` is the room at
 *  `buffer` (at least GSC_UNIQUE_ID_STRING_LEN). */
gsc_status_t gsc_unique_id_to_string(const gsc_unique_id_t *uid, char *buffer, size_t length);

/** Parse the string form (surrounding whitespace ignored). */
gsc_status_t gsc_unique_id_from_string(const char *string, gsc_unique_id_t *uid);

/**
 * Join the job `uid` names as `rank` of `nranks`; returns once every rank has joined. Every
 * bootstrap operation is bounded by GSC_BOOTSTRAP_TIMEOUT (GSC_ERR_TIMED_OUT naming the rank
 * waited on).
 */
gsc_status_t gsc_bootstrap_init(const gsc_unique_id_t *uid, int rank, int nranks,
                                gsc_bootstrap_h *bootstrap_p);

/**
 * Join the job a launcher started this process in, without passing an id around: the rank and
 * size come from GSC_RANK/GSC_NRANKS, mpirun (Open MPI, MPICH), srun or torchrun variables; the
 * rendezvous from GSC_UNIQUE_ID, or GSC_BOOTSTRAP_ADDR (host:port where rank 0 serves) with
 * GSC_BOOTSTRAP_SECRET.
 */
gsc_status_t gsc_bootstrap_init_from_env(gsc_bootstrap_h *bootstrap_p);

/** This process's rank. */
gsc_status_t gsc_bootstrap_rank(gsc_bootstrap_h bootstrap, int *rank_p);

/** The number of ranks. */
gsc_status_t gsc_bootstrap_nranks(gsc_bootstrap_h bootstrap, int *nranks_p);

/**
 * Every rank contributes `length` bytes (the same length on every rank); `output` receives
 * nranks * length bytes, rank r's block at offset r * length. Collective: every rank calls the
 * collectives in the same order.
 */
gsc_status_t gsc_bootstrap_allgather(gsc_bootstrap_h bootstrap, const void *input, size_t length,
                                     void *output);

/** Return once every rank has entered the barrier. Collective. */
gsc_status_t gsc_bootstrap_barrier(gsc_bootstrap_h bootstrap);

/** Leave the job and release the handle. */
gsc_status_t gsc_bootstrap_destroy(gsc_bootstrap_h bootstrap);

/* ------------------------------------------------------------------------------------------ */
/* Conditions                                                                                  */
/* ------------------------------------------------------------------------------------------ */

/** The kind of a condition (cf. the seed's ucp_condition_category_t). */
typedef enum gsc_condition_category {
    /** context: a CUstream / cudaStream_t. Each operation starts when the stream reaches it;
     *  later work on the stream waits until it completed (send: the buffer may be reused;
     *  receive: the data is visible), unless GSC_OP_ATTR_FLAG_NO_STREAM_WAIT is given. On a
     *  stream being captured, the operation becomes replay-safe graph nodes. */
    GSC_CONDITION_CATEGORY_STREAM = 0,
    /** context: a CUgraph. Each operation adds a start node and a done node to the graph
     *  (returned in gsc_condition_out_t) and runs every time an instance of the graph does. */
    GSC_CONDITION_CATEGORY_GRAPH = 1,
    /** No context. Each operation returns a device handle; it runs every time a kernel calls
     *  gsc_trigger() on it. */
    GSC_CONDITION_CATEGORY_KERNEL_TRIGGERED = 2,
    /** context: a gsc_host_stream_h. STREAM semantics on a CPU queue (no GPU needed). */
    GSC_CONDITION_CATEGORY_HOST_STREAM = 3
} gsc_condition_category_t;

/** gsc_condition_param_t.field_mask: `category` is set (required). */
#define GSC_CONDITION_PARAM_FIELD_CATEGORY (UINT64_C(1) << 0)
/** gsc_condition_param_t.field_mask: `context` is set. */
#define GSC_CONDITION_PARAM_FIELD_CONTEXT  (UINT64_C(1) << 1)

/** Parameters of gsc_condition_create() (cf. ucp_condition_param_t). */
typedef struct gsc_condition_param {
    uint64_t field_mask;                /**< GSC_CONDITION_PARAM_FIELD_* bits. */
    gsc_condition_category_t category;  /**< The kind of condition. */
    void *context;                      /**< The stream, graph or host stream it refers to. */
} gsc_condition_param_t;

/** Create a condition; pass it in gsc_request_param_t.condition (GSC_OP_ATTR_FIELD_CONDITION).
 *  One condition can carry any number of operations, on any worker. */
gsc_status_t gsc_condition_create(const gsc_condition_param_t *param, gsc_condition_h *condition_p);
/** Destroy the handle. Operations already issued on it still run. */
gsc_status_t gsc_condition_destroy(gsc_condition_h condition);
/** STREAM / HOST_STREAM: make the stream wait, at its current position, for every operation
 *  issued on the condition so far. */
gsc_status_t gsc_condition_wait(gsc_condition_h condition);
/** STREAM / HOST_STREAM: open a group (groups nest). Operations issued on the condition, and
 *  gsc_condition_wait() calls, until the matching gsc_condition_group_end() are put on the stream
 *  together at the end: one trigger write and one wait for all of them (on a captured stream, one
 *  kernel node that triggers them all, then waits), like ncclGroupStart/ncclGroupEnd around sends
 *  and receives.
 *  The group belongs to the condition, not to the calling thread. */
gsc_status_t gsc_condition_group_start(gsc_condition_h condition);
/** Close a group; the outermost end enqueues what was issued in it. GSC_ERR_INVALID_PARAM
 *  without a group. If enqueueing fails, the group's operations fail (and the condition). */
gsc_status_t gsc_condition_group_end(gsc_condition_h condition);
/** GSC_OK, or the first failure of any operation issued on the condition (sticky). A failed
 *  operation releases every stream wait on the condition, so no GPU work hangs behind it. */
gsc_status_t gsc_condition_query(gsc_condition_h condition);

/** Create a host stream: work queued on it runs in order on its own thread. */
gsc_status_t gsc_host_stream_create(gsc_host_stream_h *stream_p);
/** Release the handle; queued work still runs (like cudaStreamDestroy). */
gsc_status_t gsc_host_stream_destroy(gsc_host_stream_h stream);
/** Queue fn(arg); it runs on the stream's thread after everything queued before it. */
gsc_status_t gsc_host_stream_launch(gsc_host_stream_h stream, void (*fn)(void *arg), void *arg);
/** Wait until everything queued so far ran; timeout_ms < 0 waits without bound. Returns the
 *  first failure since the last synchronize (a wait released by a failed operation), or
 *  GSC_ERR_TIMED_OUT. */
gsc_status_t gsc_host_stream_synchronize(gsc_host_stream_h stream, int64_t timeout_ms);

/* ---------------------------------------------------------------------------------------------
 * Communicators: collectives and send/recv between the GPUs of one host (one rank per GPU),
 * NCCL-style, on conditions. A collective is a kernel on the condition's stream, or nodes of its
 * graph (STREAM and GRAPH conditions), or is started by a kernel (KERNEL_TRIGGERED conditions,
 * through gsc_comm_collective: see there); send/recv go through the point-to-point engine on a
 * worker of the communicator's own (STREAM conditions; inside gsc_condition_group_start/end a
 * group's transfers are in flight together, so an all-to-all cannot deadlock on its order).
 * Every rank calls the same collectives in the same order (GSC_COLL_CHECK=on verifies it). */

/** A communicator (one rank of it). */
typedef struct gsc_comm *gsc_comm_h;

/** Element types (the values are NCCL's ncclDataType_t). */
typedef enum {
    GSC_INT8 = 0,
    GSC_UINT8 = 1,
    GSC_INT32 = 2,
    GSC_UINT32 = 3,
    GSC_INT64 = 4,
    GSC_UINT64 = 5,
    GSC_FLOAT16 = 6,
    GSC_FLOAT32 = 7,
    GSC_FLOAT64 = 8,
    GSC_BFLOAT16 = 9,
    GSC_FLOAT8E4M3 = 10, /* 8-bit floats: reductions need compute capability 9.0, as in NCCL */
    GSC_FLOAT8E5M2 = 11
} gsc_datatype_t;

/** Reduction operators (the values are NCCL's ncclRedOp_t). */
typedef enum {
    GSC_SUM = 0,
    GSC_PROD = 1,
    GSC_MAX = 2,
    GSC_MIN = 3,
    GSC_AVG = 4
} gsc_red_op_t;

/** Join the communicator of `nranks` ranks whose rendezvous is `uid` (gsc_get_unique_id() on one
 *  rank, handed to the others), as `rank`, on CUDA device `device`. Collective: returns when
 *  every rank joined, or with GSC_ERR_TIMED_OUT after GSC_BOOTSTRAP_TIMEOUT. */
gsc_status_t gsc_comm_init_rank(gsc_comm_h *comm_p, int nranks, const gsc_unique_id_t *uid, int rank, int device);
/** Destroy this rank's side. Work already on streams must have completed. */
gsc_status_t gsc_comm_destroy(gsc_comm_h comm);
/** This rank's rank. */
gsc_status_t gsc_comm_rank(gsc_comm_h comm, int *rank);
/** The number of ranks. */
gsc_status_t gsc_comm_size(gsc_comm_h comm, int *size);
/** The CUDA device the rank runs on. */
gsc_status_t gsc_comm_device(gsc_comm_h comm, int *device);

/** gsc_comm_split()'s color for a rank that takes part in the split but joins no communicator. */
#define GSC_SPLIT_NOCOLOR (-1)

/** Split the communicator (MPI_Comm_split, ncclCommSplit): collective over every rank of `comm`.
 *  Ranks of the same `color` (>= 0) form a new communicator, ordered by `key`, then by their rank
 *  in `comm`; each gets its handle in *newcomm_p. A rank with GSC_SPLIT_NOCOLOR gets NULL. The
 *  new communicators work beside `comm`, which stays usable (also after gsc_comm_revoke()). */
gsc_status_t gsc_comm_split(gsc_comm_h comm, int color, int key, gsc_comm_h *newcomm_p);

/** Stop the communicator's work now, for good (ncclCommAbort), without waiting for any peer:
 *  kernels waiting for a peer give up, transfers in flight fail, and every later call on it
 *  fails with GSC_ERR_ABORTED (gsc_comm_query() too). Only gsc_comm_destroy() remains. Safe to
 *  call from another thread than the one issuing work, e.g. a watchdog. */
gsc_status_t gsc_comm_abort(gsc_comm_h comm);

/** Stop the communicator's work as gsc_comm_abort() does, but keep it for rebuilding
 *  (ncclCommRevoke, ULFM's MPI_Comm_revoke): later collectives and transfers fail with
 *  GSC_ERR_CANCELED, gsc_comm_query() returns GSC_OK, and gsc_comm_split(), gsc_comm_shrink()
 *  and gsc_comm_destroy() still work. Revoking an aborted or revoked communicator fails. */
gsc_status_t gsc_comm_revoke(gsc_comm_h comm);

/** gsc_comm_shrink() flags: revoke `comm` first (gsc_comm_revoke()), so that work waiting for an
 *  excluded rank that died ends instead of holding the GPU. */
#define GSC_SHRINK_ABORT 1

/** A new communicator of `comm`'s ranks without the `nexclude` ranks of `exclude` (ncclCommShrink,
 *  ULFM's MPI_Comm_shrink), in the same order. Called by the ranks that stay only, all with the
 *  same list (in any order): an excluded rank may be dead. A rank whose list differs from the
 *  others' fails, the message naming both lists. An empty list, a rank listed twice, one out of
 *  range or the caller itself is GSC_ERR_INVALID_PARAM and changes nothing. `flags`: 0 or
 *  GSC_SHRINK_ABORT. */
gsc_status_t gsc_comm_shrink(gsc_comm_h comm, const int *exclude, int nexclude, int flags, gsc_comm_h *newcomm_p);

/** A buffer registered with a communicator. */
typedef struct gsc_comm_reg *gsc_comm_reg_h;

/** Register `size` bytes at `buf` with the communicator (ncclCommRegister): GPU memory of the
 *  communicator's device, both ends checked. Registered buffers take the zero-copy paths, as
 *  every GPU buffer does. Released by gsc_comm_deregister() or with the communicator. */
gsc_status_t gsc_comm_register(gsc_comm_h comm, void *buf, size_t size, gsc_comm_reg_h *reg_p);
/** Release a registration; one of another communicator, or released already, is refused. */
gsc_status_t gsc_comm_deregister(gsc_comm_h comm, gsc_comm_reg_h reg);

/** A memory window of a communicator. */
typedef struct gsc_comm_win *gsc_comm_win_h;

/** gsc_comm_window_register() flag: collectives promise their buffers lie at the same offset in
 *  every rank's window (NCCL_WIN_COLL_SYMMETRIC). */
#define GSC_WIN_SYMMETRIC 1

/** Register `size` bytes at `buf` (GPU memory of the communicator's device) as a window
 *  (ncclCommWindowRegister). Collective: every rank calls it, for its windows in the same
 *  order. Each rank maps every peer's window once, here; a rank whose buffer is refused, or that
 *  cannot map a peer's, is named in every rank's error, and no rank keeps the window. With
 *  GSC_WIN_SYMMETRIC (0: none), a collective whose buffers lie in windows takes the peers'
 *  buffers at the same offsets without exchanging anything (no host round trip per call; where
 *  ranks share a process, the direct kernel can then serve it at all). Released by
 *  gsc_comm_window_deregister() or with the communicator. */
gsc_status_t gsc_comm_window_register(gsc_comm_h comm, void *buf, size_t size, int flags, gsc_comm_win_h *win_p);
/** Release a window (this rank alone); one of another communicator, or released already, is
 *  refused. */
gsc_status_t gsc_comm_window_deregister(gsc_comm_h comm, gsc_comm_win_h win);

/** Allocate `size` bytes of GPU memory on the calling thread's current CUDA device (ncclMemAlloc):
 *  CUDA VMM memory with a POSIX file-descriptor handle, readable and writable by every GPU of the
 *  process that reaches it, and shared with a peer process by one export of the whole
 *  allocation; so one allocation per rank can be carved into send and receive buffers. Falls
 *  back to cuMemAlloc, with a warning, on a device without VMM. */
gsc_status_t gsc_gpu_mem_alloc(void **ptr_p, size_t size);
/** Free memory from gsc_gpu_mem_alloc() (NULL: nothing to do). Any other pointer, one inside an
 *  allocation, or one freed already is GSC_ERR_INVALID_PARAM, and nothing is freed. */
gsc_status_t gsc_gpu_mem_free(void *ptr);
/** Close this process's mappings of peer GPU memory that the peers have freed (or replaced), and
 *  write how many were closed to `*closed_p` (NULL: not wanted). A mapping keeps the memory of a
 *  peer's allocation in use after its owner frees it. A thread of each process finds its frees
 *  and unmaps the VMM mappings of peers' freed memory (gsc_gpu_mem_alloc, PyTorch's expandable
 *  segments) by itself, 2 s later. Closing a legacy one (cudaMalloc memory) synchronizes the
 *  device, so those wait for this call, which also unmaps VMM ones without waiting out the 2 s. Call it only where no stream waits on a gscomm operation
 *  and no thread of the process is inside a group of calls, e.g. after synchronizing every
 *  stream that has gscomm work. Every mapping is tried; the first failure is returned. */
gsc_status_t gsc_release_peer_mappings(size_t *closed_p);

/** GSC_OK, or why the communicator's work cannot be trusted: GSC_ERR_TIMED_OUT when a collective
 *  or gsc_comm_transfers() kernel gave up waiting for a peer (GSC_TIMEOUT), GSC_ERR_INVALID_PARAM
 *  when a gsc_comm_transfers() message's length differed from its peer's (the message names the
 *  peer); gsc_comm_send()/gsc_comm_recv() failures show in gsc_condition_query() of their
 *  condition. */
gsc_status_t gsc_comm_query(gsc_comm_h comm);
/** `count` elements of `sendbuf` reduced with `op` across the ranks into every rank's `recvbuf`
 *  (sendbuf == recvbuf: in place), when `condition` reaches the call. */
gsc_status_t gsc_comm_all_reduce(gsc_comm_h comm, const void *sendbuf, void *recvbuf, size_t count,
                                 gsc_datatype_t datatype, gsc_red_op_t op, gsc_condition_h condition);
/** Rank `root`'s `count` elements into every rank's `recvbuf` (`sendbuf` read on the root only). */
gsc_status_t gsc_comm_broadcast(gsc_comm_h comm, const void *sendbuf, void *recvbuf, size_t count,
                                gsc_datatype_t datatype, int root, gsc_condition_h condition);
/** Every rank's `count` elements into `recvbuf` (size x count), rank r's at element r x count. */
gsc_status_t gsc_comm_all_gather(gsc_comm_h comm, const void *sendbuf, void *recvbuf, size_t count,
                                 gsc_datatype_t datatype, gsc_condition_h condition);
/** Which collective a gsc_coll_desc_t describes. */
typedef enum {
    GSC_COLL_ALL_REDUCE = 0,
    GSC_COLL_ALL_GATHER = 1,
    GSC_COLL_REDUCE_SCATTER = 2,
    GSC_COLL_BROADCAST = 3,
    GSC_COLL_REDUCE = 4
} gsc_coll_kind_t;

/** One collective call, as NCCL's functions take it. */
typedef struct gsc_coll_desc {
    gsc_coll_kind_t kind;
    const void *sendbuf;     /**< broadcast: read on the root only */
    void *recvbuf;           /**< reduce: written on the root only */
    size_t count;            /**< elements: all-gather, each rank's part; reduce-scatter, each
                                  rank's result; the others, the whole buffer */
    gsc_datatype_t datatype;
    gsc_red_op_t op;         /**< all-reduce, reduce-scatter, reduce */
    int root;                /**< broadcast, reduce */
} gsc_coll_desc_t;

/** Any collective on any condition; `out` (NULL allowed, except on KERNEL_TRIGGERED conditions)
 *  receives what the condition hands back.
 *
 *  KERNEL_TRIGGERED: the call is armed once — collectively: every rank arms the same
 *  collectives in the same order — and out->device_handle is the gsc_device_handle_t a kernel
 *  passes to gsc_trigger() to perform the collective once more, with that rank's buffers as
 *  they are then, and to gsc_wait() to wait for it (-1: it failed: a peer did not answer within
 *  GSC_TIMEOUT, or the communicator was aborted; gsc_condition_query() and gsc_comm_query() say
 *  so too). gscomm's thread for the communicator launches each trigger; the collective's
 *  kernels run beside the triggering kernel, which must leave the GPU room for them. Rules, as
 *  for every collective, the same order on every rank: a kernel waits for one of a
 *  communicator's triggered collectives before triggering another (triggers of one collective
 *  may follow each other), and none runs while the communicator's stream collectives do.
 *  The buffers stay valid until the last kernel that triggers it has finished. */
gsc_status_t gsc_comm_collective(gsc_comm_h comm, const gsc_coll_desc_t *desc, gsc_condition_h condition,
                                 gsc_condition_out_t *out);
/** Send `count` elements to rank `peer`: the k-th send to a peer pairs with its k-th receive from
 *  this rank. The condition's stream waits for completion (in a group: at its end). */
gsc_status_t gsc_comm_send(gsc_comm_h comm, const void *buf, size_t count, gsc_datatype_t datatype, int peer,
                           gsc_condition_h condition);
/** Receive `count` elements from rank `peer` (see gsc_comm_send()). */
gsc_status_t gsc_comm_recv(gsc_comm_h comm, void *buf, size_t count, gsc_datatype_t datatype, int peer,
                           gsc_condition_h condition);

/** Which way a gsc_peer_transfer_t goes. */
typedef enum {
    GSC_PEER_SEND = 0,
    GSC_PEER_RECV = 1
} gsc_peer_op_t;

/** One send or receive of a gsc_comm_transfers() group. */
typedef struct gsc_peer_transfer {
    gsc_peer_op_t op;
    void *buf;      /**< GPU memory of the communicator's device (read by a send) */
    size_t count;   /**< elements */
    gsc_datatype_t datatype;
    int peer;
} gsc_peer_transfer_t;

/** A group of sends and receives (NCCL's ncclSend/ncclRecv between ncclGroupStart and
 *  ncclGroupEnd), in flight together once `condition` reaches them; the condition's stream
 *  (or the graph's later nodes) waits for all of them. The k-th send to a peer pairs with its
 *  k-th receive from this rank, with the same number of bytes. Messages of up to
 *  GSC_COLL_P2P_MAX bytes (32 MiB) are moved by one kernel on the stream, or one node of the
 *  graph, with no host in the loop — the fast path, which gsc_comm_send()/gsc_comm_recv() do
 *  not take; larger ones go through the point-to-point engine after it. STREAM and GRAPH
 *  conditions; `out` (NULL allowed) receives a GRAPH condition's start and done nodes. The
 *  groups of one communicator run one at a time, in the same order on every rank, as its
 *  collectives do. Every entry is checked before anything is issued (an error names the
 *  entry's index). A peer that does not answer within GSC_TIMEOUT, or a length that differs
 *  from its peer's, fails the communicator: gsc_comm_query() then says which peer. */
gsc_status_t gsc_comm_transfers(gsc_comm_h comm, const gsc_peer_transfer_t *transfers, size_t n,
                                gsc_condition_h condition, gsc_condition_out_t *out);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* GSC_H */
