//! The C API from C: the header compiles as C99 and C++11, the ping-pong example runs as two
//! processes (bootstrapped launcher-style on a local port), and a C test program checks the
//! error paths (bad arguments and handles, stale and double-freed requests, bad configuration,
//! truncation, conditions) and a one-rank bootstrap.
//!
//! The cdylib comes from the same `cargo test` run: the library target's crate types include
//! `cdylib`, and cargo builds the library with all its crate types before the integration tests
//! that depend on it, into target/<profile>/deps/ next to this test's executable (see
//! `lib_dir`).
//!
//! Needs a C and a C++ compiler (`cc`, `c++`, or `CC`/`CXX`).

mod c_support;

use c_support::{build_c, cxx, root, run_halo_alone, run_pingpong_ranks, scratch, spawn, wait_all};
use std::process::Command;

#[test]
fn header_compiles_as_cxx11() {
    let out = Command::new(cxx())
        .args(["-std=c++11", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", "-x", "c++"])
        .arg(root().join("include/gsc.h"))
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", cxx()));
    assert!(out.status.success(), "gsc.h as C++11:\n{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn header_compiles_as_c99_alone() {
    let dir = scratch("c99");
    let src = dir.join("h.c");
    // The header must be self-contained: nothing included before it.
    std::fs::write(&src, "#include <gsc.h>\nint main(void) { return GSC_PTR_IS_ERR((void *)0) ? 1 : 0; }\n").unwrap();
    build_c(&src, &dir.join("h"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn pingpong_example_runs_as_two_processes() {
    let dir = scratch("pingpong");
    let exe = dir.join("pingpong");
    build_c(&root().join("examples/c/01_tag_pingpong/pingpong.c"), &exe);
    run_pingpong_ranks(&exe);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The prepared halo example builds as C99 everywhere; it runs for real only with GPUs (the
/// device runs it as four ranks, see its README), here it must say why it skipped.
#[test]
fn prepared_halo_example_builds_and_runs_or_says_why_not() {
    let dir = scratch("halo");
    let exe = dir.join("halo");
    build_c(&root().join("examples/c/02_prepared_halo/halo.c"), &exe);
    run_halo_alone(&exe);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn error_paths_from_c() {
    let dir = scratch("errors");
    let src = dir.join("errors.c");
    let exe = dir.join("errors");
    std::fs::write(&src, ERRORS_C).unwrap();
    build_c(&src, &exe);
    let results = wait_all(vec![("errors", spawn(&mut Command::new(&exe)))]);
    let (_, ok, out) = &results[0];
    assert!(*ok, "C error-path tests failed:\n{out}");
    assert!(out.contains("error paths: all checks passed"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The C side of `error_paths_from_c`.
const ERRORS_C: &str = r#"
#include <gsc.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int failures = 0;

#define EXPECT(_cond)                                                                         \
    do {                                                                                      \
        if (!(_cond)) {                                                                       \
            fprintf(stderr, "FAILED line %d: %s (last error: %s)\n", __LINE__, #_cond,       \
                    gsc_last_error_message());                                                \
            failures++;                                                                       \
        }                                                                                     \
    } while (0)

/* `got` is `want`, and the last-error message is non-empty and mentions `needle` ("": anything). */
#define EXPECT_STATUS(_got, _want, _needle)                                                   \
    do {                                                                                      \
        gsc_status_t _g = (_got);                                                             \
        const char *_m = gsc_last_error_message();                                            \
        if (_g != (_want)) {                                                                  \
            fprintf(stderr, "FAILED line %d: %s is %s, expected %s (last error: %s)\n",       \
                    __LINE__, #_got, gsc_status_string(_g), gsc_status_string(_want), _m);    \
            failures++;                                                                       \
        } else if (_m == NULL || _m[0] == '\0' || strstr(_m, (_needle)) == NULL) {          \
            fprintf(stderr, "FAILED line %d: %s: last error \"%s\" should mention \"%s\"\n",  \
                    __LINE__, #_got, _m ? _m : "(null)", (_needle));                          \
            failures++;                                                                       \
        }                                                                                     \
    } while (0)

#define EXPECT_PTR_STATUS(_ptr, _want, _needle)                                               \
    do {                                                                                      \
        gsc_status_ptr_t _p = (_ptr);                                                         \
        EXPECT(GSC_PTR_IS_ERR(_p));                                                           \
        EXPECT_STATUS(GSC_PTR_STATUS(_p), _want, _needle);                                    \
    } while (0)

static gsc_worker_h wa, wb;

/* Progress both workers until the request completes (or 20 s pass); returns its status. */
static gsc_status_t wait2(gsc_status_ptr_t p, gsc_tag_recv_info_t *info)
{
    time_t start = time(NULL);
    gsc_status_t st;
    if (!GSC_PTR_IS_PTR(p)) {
        return GSC_PTR_STATUS(p);
    }
    while ((st = gsc_tag_recv_request_test(p, info)) == GSC_INPROGRESS) {
        gsc_worker_progress(wa);
        gsc_worker_progress(wb);
        if (time(NULL) - start > 20) {
            return GSC_ERR_TIMED_OUT;
        }
    }
    return st;
}

static gsc_status_t finish2(gsc_status_ptr_t p, gsc_tag_recv_info_t *info)
{
    gsc_status_t st = wait2(p, info);
    if (GSC_PTR_IS_PTR(p)) {
        gsc_request_free(p);
    }
    return st;
}

static int recv_calls = 0;
static gsc_tag_recv_info_t recv_cb_info;

static void on_recv(void *request, gsc_status_t status, const gsc_tag_recv_info_t *info,
                    void *user_data)
{
    (void)request;
    if (status == GSC_OK && user_data == (void *)&recv_calls) {
        recv_calls++;
        recv_cb_info = *info;
    }
}

static void config_errors(void)
{
    gsc_context_h ctx = NULL;
    gsc_params_t params;
    gsc_config_pair_t pair;

    EXPECT_STATUS(gsc_init(NULL, NULL), GSC_ERR_INVALID_PARAM, "context_p");

    memset(&params, 0, sizeof(params));
    params.field_mask = GSC_PARAM_FIELD_CONFIG;
    params.config = &pair;
    params.config_count = 1;

    pair.name = "GSC_TIMEOUT";
    pair.value = "banana";
    EXPECT_STATUS(gsc_init(&params, &ctx), GSC_ERR_INVALID_CONFIG, "GSC_TIMEOUT");
    EXPECT(ctx == NULL);

    pair.name = "GSC_TIMEOUTT";
    pair.value = "10s";
    EXPECT_STATUS(gsc_init(&params, &ctx), GSC_ERR_INVALID_CONFIG, "GSC_TIMEOUTT");

    /* A rule across knobs, broken by the override alone. */
    pair.name = "rndv_thresh";
    pair.value = "64";
    EXPECT_STATUS(gsc_init(&params, &ctx), GSC_ERR_INVALID_CONFIG, "GSC_RNDV_THRESH");

    pair.name = "GSC_TLS";
    pair.value = NULL;
    EXPECT_STATUS(gsc_init(&params, &ctx), GSC_ERR_INVALID_PARAM, "GSC_TLS");

    params.field_mask = (uint64_t)1 << 40;
    EXPECT_STATUS(gsc_init(&params, &ctx), GSC_ERR_INVALID_PARAM, "field_mask");
    EXPECT(ctx == NULL);
}

static void handle_errors(gsc_context_h ctx)
{
    gsc_worker_h w = NULL;
    gsc_ep_h ep = NULL;
    gsc_ep_params_t ep_params;
    int local = 0;
    char buf[16];

    EXPECT_STATUS(gsc_worker_create(NULL, NULL, &w), GSC_ERR_INVALID_HANDLE, "gsc_context_h is NULL");
    EXPECT_STATUS(gsc_worker_create(ctx, NULL, NULL), GSC_ERR_INVALID_PARAM, "worker_p");
    EXPECT_STATUS(gsc_worker_destroy((gsc_worker_h)ctx), GSC_ERR_INVALID_HANDLE, "gsc_context_h");
    EXPECT_STATUS(gsc_worker_destroy((gsc_worker_h)(void *)&local), GSC_ERR_INVALID_HANDLE, "not a live");
    EXPECT_STATUS(gsc_cleanup(NULL), GSC_ERR_INVALID_HANDLE, "");
    EXPECT(gsc_worker_progress(NULL) == 0);
    EXPECT_STATUS(GSC_ERR_INVALID_HANDLE, GSC_ERR_INVALID_HANDLE, "gsc_worker_progress");
    EXPECT_STATUS(gsc_ep_create(wa, NULL, &ep), GSC_ERR_INVALID_PARAM, "params");
    memset(&ep_params, 0, sizeof(ep_params));
    EXPECT_STATUS(gsc_ep_create(wa, &ep_params, &ep), GSC_ERR_INVALID_PARAM, "address");
    ep_params.field_mask = GSC_EP_PARAM_FIELD_ADDRESS | GSC_EP_PARAM_FIELD_ADDRESS_LENGTH;
    ep_params.address = "definitely not an address";
    ep_params.address_length = 20;
    EXPECT_STATUS(gsc_ep_create(wa, &ep_params, &ep), GSC_ERR_INVALID_ADDRESS, "worker address");
    EXPECT_PTR_STATUS(gsc_tag_send_nbx(NULL, buf, sizeof(buf), 1, NULL), GSC_ERR_INVALID_HANDLE, "gsc_ep_h");
    EXPECT_PTR_STATUS(gsc_tag_send_nbx((gsc_ep_h)wa, buf, sizeof(buf), 1, NULL), GSC_ERR_INVALID_HANDLE, "gsc_worker_h");
    EXPECT_PTR_STATUS(gsc_tag_recv_nbx(wa, NULL, 10, 1, 1, NULL), GSC_ERR_INVALID_PARAM, "NULL");
    EXPECT_PTR_STATUS(gsc_ep_close_nbx(NULL, NULL), GSC_ERR_INVALID_HANDLE, "");
    EXPECT(gsc_tag_probe_nb(wa, 1, 1, 0, NULL) == NULL);
    EXPECT_STATUS(GSC_ERR_INVALID_PARAM, GSC_ERR_INVALID_PARAM, "info is NULL");
    EXPECT_STATUS(gsc_worker_get_address(wa, NULL, NULL), GSC_ERR_INVALID_PARAM, "address_p");
    EXPECT_STATUS(gsc_worker_release_address(wa, buf), GSC_ERR_INVALID_HANDLE, "not handed out");
    EXPECT_STATUS(gsc_rkey_buffer_release(NULL), GSC_ERR_INVALID_PARAM, "");

    EXPECT(strstr(gsc_status_string(GSC_ERR_MESSAGE_TRUNCATED), "truncated") != NULL);
    EXPECT(strcmp(gsc_status_string((gsc_status_t)-99), "unknown status") == 0);
    EXPECT(strcmp(gsc_status_string(GSC_OK), "success") == 0);
    EXPECT(!GSC_PTR_IS_PTR(NULL) && !GSC_PTR_IS_ERR(NULL) && GSC_PTR_STATUS(NULL) == GSC_OK);
    EXPECT(GSC_PTR_IS_ERR((void *)(intptr_t)GSC_ERR_INTERNAL));
    EXPECT(!GSC_PTR_IS_PTR((void *)(intptr_t)GSC_ERR_INTERNAL));
}

static void param_errors(gsc_ep_h ep)
{
    gsc_request_param_t p;
    char buf[16] = "param";

    memset(&p, 0, sizeof(p));
    p.op_attr_mask = GSC_OP_ATTR_FIELD_CONDITION;
    p.condition = (gsc_condition_h)(uintptr_t)0x1000;
    EXPECT_PTR_STATUS(gsc_tag_send_nbx(ep, buf, sizeof(buf), 1, &p), GSC_ERR_INVALID_HANDLE, "gsc_condition_h");
    EXPECT_PTR_STATUS(gsc_tag_recv_nbx(wb, buf, sizeof(buf), 1, ~(uint64_t)0, &p), GSC_ERR_INVALID_HANDLE, "gsc_condition_h");
    EXPECT_PTR_STATUS(gsc_ep_flush_nbx(ep, &p), GSC_ERR_INVALID_HANDLE, "gsc_condition_h");

    memset(&p, 0, sizeof(p));
    p.op_attr_mask = GSC_OP_ATTR_FIELD_FLAGS;
    p.flags = GSC_OP_ATTR_FLAG_NO_STREAM_WAIT;
    EXPECT_PTR_STATUS(gsc_tag_send_nbx(ep, buf, sizeof(buf), 1, &p), GSC_ERR_INVALID_PARAM, "condition");

    memset(&p, 0, sizeof(p));
    p.op_attr_mask = (uint64_t)1 << 40;
    EXPECT_PTR_STATUS(gsc_tag_send_nbx(ep, buf, sizeof(buf), 1, &p), GSC_ERR_INVALID_PARAM, "op_attr_mask");

    memset(&p, 0, sizeof(p));
    p.op_attr_mask = GSC_OP_ATTR_FIELD_FLAGS;
    p.flags = GSC_EP_CLOSE_FLAG_FORCE;
    EXPECT_PTR_STATUS(gsc_tag_send_nbx(ep, buf, sizeof(buf), 1, &p), GSC_ERR_INVALID_PARAM, "GSC_EP_CLOSE_FLAG_FORCE");

    memset(&p, 0, sizeof(p));
    p.op_attr_mask = GSC_OP_ATTR_FIELD_MEMORY_TYPE;
    p.memory_type = GSC_MEMORY_TYPE_CUDA;
    {
        /* A host buffer declared as GPU memory: refused at the call. Without the CUDA driver
           loaded in this process the reason is the missing driver; with it, the mismatch. */
        gsc_status_ptr_t _p = gsc_tag_send_nbx(ep, buf, sizeof(buf), 1, &p);
        EXPECT(GSC_PTR_IS_ERR(_p));
        EXPECT(GSC_PTR_STATUS(_p) == GSC_ERR_LIBRARY_MISSING || GSC_PTR_STATUS(_p) == GSC_ERR_INVALID_PARAM);
        EXPECT(strstr(gsc_last_error_message(), "declared CUDA memory") != NULL);
    }
    p.memory_type = (gsc_memory_type_t)7;
    EXPECT_PTR_STATUS(gsc_tag_send_nbx(ep, buf, sizeof(buf), 1, &p), GSC_ERR_INVALID_PARAM, "memory_type");

    memset(&p, 0, sizeof(p));
    p.op_attr_mask = GSC_OP_ATTR_FIELD_CALLBACK;
    EXPECT_PTR_STATUS(gsc_tag_send_nbx(ep, buf, sizeof(buf), 1, &p), GSC_ERR_INVALID_PARAM, "cb.send");
    p.op_attr_mask = GSC_OP_ATTR_FIELD_RECV_INFO;
    EXPECT_PTR_STATUS(gsc_tag_send_nbx(ep, buf, sizeof(buf), 1, &p), GSC_ERR_INVALID_PARAM, "receives only");
}

/* A message of `size` bytes into a 512-byte receive: truncated, nothing written past 512. */
static void truncation(gsc_ep_h ep, size_t size, int post_first)
{
    unsigned char *data = malloc(size), *buf = malloc(size);
    gsc_tag_recv_info_t info;
    gsc_status_ptr_t s, r = NULL;
    size_t i;
    int beyond = 0, inside = 0;
    for (i = 0; i < size; i++) {
        data[i] = (unsigned char)(i * 13 + 1);
        buf[i] = 0xEE;
    }
    memset(&info, 0, sizeof(info));
    if (post_first) {
        r = gsc_tag_recv_nbx(wb, buf, 512, 42, ~(uint64_t)0, NULL);
    }
    s = gsc_tag_send_nbx(ep, data, size, 42, NULL);
    EXPECT(!GSC_PTR_IS_ERR(s));
    if (!post_first) {
        int i2;
        for (i2 = 0; i2 < 100; i2++) {
            gsc_worker_progress(wb);
        }
        r = gsc_tag_recv_nbx(wb, buf, 512, 42, ~(uint64_t)0, NULL);
    }
    EXPECT(GSC_PTR_IS_PTR(r));
    EXPECT_STATUS(finish2(r, &info), GSC_ERR_MESSAGE_TRUNCATED, "truncated");
    EXPECT(info.length == size);
    EXPECT(info.sender_tag == 42);
    (void)finish2(s, NULL);
    for (i = 0; i < 512; i++) {
        inside += buf[i] != data[i];
    }
    for (i = 512; i < size; i++) {
        beyond += buf[i] != 0xEE;
    }
    if (inside || beyond) {
        fprintf(stderr, "FAILED: truncation of %lu bytes (posted %s): %d bytes wrong inside, %d written beyond 512\n",
                (unsigned long)size, post_first ? "first" : "last", inside, beyond);
        failures++;
    }
    free(data);
    free(buf);
}

static void requests(gsc_ep_h ep)
{
    char buf[64], msg[] = "hello, callback";
    gsc_status_ptr_t r;
    gsc_request_param_t p;
    gsc_tag_recv_info_t info;

    /* A receive nobody sends to: cancel, then the handle goes stale. */
    r = gsc_tag_recv_nbx(wb, buf, sizeof(buf), 99, ~(uint64_t)0, NULL);
    EXPECT(GSC_PTR_IS_PTR(r));
    EXPECT(gsc_request_check_status(r) == GSC_INPROGRESS);
    EXPECT(gsc_request_cancel(wb, r) == GSC_OK);
    EXPECT_STATUS(gsc_request_check_status(r), GSC_ERR_CANCELED, "canceled");
    gsc_request_free(r);
    EXPECT_STATUS(gsc_request_check_status(r), GSC_ERR_INVALID_HANDLE, "stale");
    EXPECT_STATUS(gsc_request_wait(r, NULL), GSC_ERR_INVALID_HANDLE, "gsc_request_wait");
    gsc_request_free(r); /* double free: reported, not fatal */
    EXPECT_STATUS(GSC_ERR_INVALID_HANDLE, GSC_ERR_INVALID_HANDLE, "gsc_request_free");
    EXPECT_STATUS(gsc_request_check_status((void *)(uintptr_t)0x12345), GSC_ERR_INVALID_HANDLE, "");
    EXPECT_STATUS(gsc_request_check_status((void *)(intptr_t)GSC_ERR_CANCELED), GSC_ERR_INVALID_HANDLE, "error status pointer");
    EXPECT_STATUS(gsc_request_check_status(NULL), GSC_ERR_INVALID_HANDLE, "NULL");
    gsc_request_free(NULL);
    EXPECT_STATUS(GSC_ERR_INVALID_HANDLE, GSC_ERR_INVALID_HANDLE, "gsc_request_free");

    /* A receive with a callback. */
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = GSC_OP_ATTR_FIELD_CALLBACK | GSC_OP_ATTR_FIELD_USER_DATA;
    p.cb.recv = on_recv;
    p.user_data = &recv_calls;
    r = gsc_tag_recv_nbx(wb, buf, sizeof(buf), 5, ~(uint64_t)0, &p);
    EXPECT(GSC_PTR_IS_PTR(r));
    EXPECT(finish2(gsc_tag_send_nbx(ep, msg, sizeof(msg), 5, NULL), NULL) == GSC_OK);
    EXPECT(finish2(r, &info) == GSC_OK);
    EXPECT(recv_calls == 1 && recv_cb_info.length == sizeof(msg) && recv_cb_info.sender_tag == 5);
    EXPECT(strcmp(buf, msg) == 0);

    /* Immediate completion fills recv_info. */
    EXPECT(finish2(gsc_tag_send_nbx(ep, msg, 6, 0x77, NULL), NULL) == GSC_OK);
    {
        int i;
        for (i = 0; i < 100; i++) {
            gsc_worker_progress(wb);
        }
    }
    memset(&p, 0, sizeof(p));
    memset(&info, 0, sizeof(info));
    p.op_attr_mask = GSC_OP_ATTR_FIELD_RECV_INFO;
    p.recv_info.tag_info = &info;
    r = gsc_tag_recv_nbx(wb, buf, sizeof(buf), 0x70, 0xF0, &p);
    EXPECT(r == NULL);
    EXPECT(info.length == 6 && info.sender_tag == 0x77);

    /* A message handle from another worker, or from a probe without remove, is refused. */
    EXPECT(finish2(gsc_tag_send_nbx(ep, msg, 3, 0x88, NULL), NULL) == GSC_OK);
    {
        gsc_tag_message_h m = NULL;
        int i;
        for (i = 0; i < 1000 && m == NULL; i++) {
            m = gsc_tag_probe_nb(wb, 0x88, ~(uint64_t)0, 0, &info);
        }
        EXPECT(m != NULL && info.length == 3);
        EXPECT_PTR_STATUS(gsc_tag_msg_recv_nbx(wb, buf, sizeof(buf), m, NULL), GSC_ERR_INVALID_HANDLE, "without remove");
        m = gsc_tag_probe_nb(wb, 0x88, ~(uint64_t)0, 1, &info);
        EXPECT(m != NULL);
        EXPECT_PTR_STATUS(gsc_tag_msg_recv_nbx(wa, buf, sizeof(buf), m, NULL), GSC_ERR_INVALID_HANDLE, "this worker");
        EXPECT(finish2(gsc_tag_msg_recv_nbx(wb, buf, sizeof(buf), m, NULL), &info) == GSC_OK);
        EXPECT(memcmp(buf, msg, 3) == 0);
        EXPECT_PTR_STATUS(gsc_tag_msg_recv_nbx(wb, buf, sizeof(buf), m, NULL), GSC_ERR_INVALID_HANDLE, "already received");
    }
}

static void memory(gsc_context_h ctx, gsc_ep_h ep)
{
    gsc_mem_map_params_t mp;
    gsc_mem_h memh = NULL;
    void *rkey_buf, *addr;
    size_t rkey_size, len;
    gsc_rkey_h rkey;
    static char region[4096];
    char src[64] = "written through put";
    char garbage[64];

    EXPECT_STATUS(gsc_mem_map(ctx, NULL, &memh), GSC_ERR_INVALID_PARAM, "params");
    memset(&mp, 0, sizeof(mp));
    mp.field_mask = GSC_MEM_MAP_PARAM_FIELD_ADDRESS;
    mp.address = region;
    EXPECT_STATUS(gsc_mem_map(ctx, &mp, &memh), GSC_ERR_INVALID_PARAM, "LENGTH");
    mp.field_mask |= GSC_MEM_MAP_PARAM_FIELD_LENGTH | GSC_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.length = sizeof(region);
    mp.flags = GSC_MEM_MAP_ALLOCATE;
    EXPECT_STATUS(gsc_mem_map(ctx, &mp, &memh), GSC_ERR_INVALID_PARAM, "ALLOCATE");
    mp.flags = 0;
    EXPECT(gsc_mem_map(ctx, &mp, &memh) == GSC_OK);
    EXPECT(gsc_mem_query(memh, &addr, &len) == GSC_OK && addr == (void *)region && len == sizeof(region));
    EXPECT(gsc_rkey_pack(ctx, memh, &rkey_buf, &rkey_size) == GSC_OK);
    EXPECT(gsc_ep_rkey_unpack(ep, rkey_buf, &rkey) == GSC_OK);
    EXPECT(gsc_rkey_buffer_release(rkey_buf) == GSC_OK);
    EXPECT_STATUS(gsc_rkey_buffer_release(rkey_buf), GSC_ERR_INVALID_HANDLE, "already released");
    memset(garbage, 0x5A, sizeof(garbage));
    EXPECT_STATUS(gsc_ep_rkey_unpack(ep, garbage, &rkey), GSC_ERR_INVALID_PARAM, "remote key");

    EXPECT(finish2(gsc_put_nbx(ep, src, sizeof(src), (uint64_t)(uintptr_t)region + 100, rkey, NULL), NULL) == GSC_OK);
    EXPECT(finish2(gsc_ep_flush_nbx(ep, NULL), NULL) == GSC_OK);
    EXPECT(memcmp(region + 100, src, sizeof(src)) == 0);
    EXPECT_PTR_STATUS(gsc_put_nbx(ep, src, sizeof(src), (uint64_t)(uintptr_t)region + sizeof(region) - 8, rkey, NULL),
                      GSC_ERR_OUT_OF_RANGE, "outside");
    EXPECT_PTR_STATUS(gsc_get_nbx(ep, src, sizeof(src), 0, (gsc_rkey_h)memh, NULL), GSC_ERR_INVALID_HANDLE, "gsc_mem_h");

    EXPECT(gsc_rkey_destroy(rkey) == GSC_OK);
    EXPECT_STATUS(gsc_rkey_destroy(rkey), GSC_ERR_INVALID_HANDLE, "gsc_rkey_h");
    EXPECT(gsc_mem_unmap(ctx, memh) == GSC_OK);
    EXPECT_STATUS(gsc_mem_unmap(ctx, memh), GSC_ERR_INVALID_HANDLE, "gsc_mem_h");
    EXPECT_STATUS(gsc_mem_query(memh, &addr, &len), GSC_ERR_INVALID_HANDLE, "");
}

/* A one-rank job through the bootstrap API, and its argument errors. */
static void bootstrap(void)
{
    gsc_unique_id_t uid, back;
    char text[GSC_UNIQUE_ID_STRING_LEN];
    gsc_bootstrap_h b;
    int r = -1, n = -1;
    uint32_t in = 0xC0FFEE, out[1] = {0};

    EXPECT(gsc_get_unique_id(&uid) == GSC_OK);
    EXPECT_STATUS(gsc_unique_id_to_string(&uid, text, 10), GSC_ERR_INVALID_PARAM, "GSC_UNIQUE_ID_STRING_LEN");
    EXPECT(gsc_unique_id_to_string(&uid, text, sizeof(text)) == GSC_OK);
    EXPECT(strlen(text) == GSC_UNIQUE_ID_STRING_LEN - 1);
    EXPECT(gsc_unique_id_from_string(text, &back) == GSC_OK);
    EXPECT(memcmp(&uid, &back, sizeof(uid)) == 0);
    EXPECT_STATUS(gsc_unique_id_from_string("zz", &back), GSC_ERR_INVALID_PARAM, "unique id");
    EXPECT_STATUS(gsc_bootstrap_init(&uid, 1, 1, &b), GSC_ERR_INVALID_PARAM, "rank");
    EXPECT_STATUS(gsc_bootstrap_init(&uid, -1, 1, &b), GSC_ERR_INVALID_PARAM, "negative");
    EXPECT_STATUS(gsc_bootstrap_init(NULL, 0, 1, &b), GSC_ERR_INVALID_PARAM, "NULL");
    EXPECT(gsc_bootstrap_init(&uid, 0, 1, &b) == GSC_OK);
    EXPECT(gsc_bootstrap_rank(b, &r) == GSC_OK && r == 0);
    EXPECT(gsc_bootstrap_nranks(b, &n) == GSC_OK && n == 1);
    EXPECT(gsc_bootstrap_allgather(b, &in, sizeof(in), out) == GSC_OK && out[0] == in);
    EXPECT(gsc_bootstrap_barrier(b) == GSC_OK);
    EXPECT_STATUS(gsc_bootstrap_rank(b, NULL), GSC_ERR_INVALID_PARAM, "rank_p");
    EXPECT_STATUS(gsc_bootstrap_barrier((gsc_bootstrap_h)wa), GSC_ERR_INVALID_HANDLE, "gsc_worker_h");
    EXPECT(gsc_bootstrap_destroy(b) == GSC_OK);
    EXPECT_STATUS(gsc_bootstrap_barrier(b), GSC_ERR_INVALID_HANDLE, "gsc_bootstrap_h");
}

static void fill_on_stream(void *arg)
{
    memset(arg, 0x42, 64);
}

static int checked_ok = 0;
static void check_on_stream(void *arg)
{
    const unsigned char *b = arg;
    int i;
    checked_ok = 1;
    for (i = 0; i < 64; i++) {
        if (b[i] != 0x42) {
            checked_ok = 0;
        }
    }
}

/* A send and a receive on host-stream conditions: the data is made and checked on the streams. */
static void host_stream_conditions(gsc_ep_h ep)
{
    gsc_host_stream_h sa, sb;
    gsc_condition_h ca, cb, bad;
    gsc_condition_param_t cp;
    gsc_condition_out_t out;
    gsc_request_param_t p;
    gsc_status_ptr_t s, r;
    static unsigned char src[64], dst[64];

    EXPECT(gsc_host_stream_create(&sa) == GSC_OK && gsc_host_stream_create(&sb) == GSC_OK);
    memset(&cp, 0, sizeof(cp));
    EXPECT_STATUS(gsc_condition_create(&cp, &ca), GSC_ERR_INVALID_PARAM, "CATEGORY");
    cp.field_mask = GSC_CONDITION_PARAM_FIELD_CATEGORY;
    cp.category = GSC_CONDITION_CATEGORY_HOST_STREAM;
    EXPECT_STATUS(gsc_condition_create(&cp, &ca), GSC_ERR_INVALID_PARAM, "context");
    cp.field_mask |= GSC_CONDITION_PARAM_FIELD_CONTEXT;
    cp.context = wa;
    EXPECT_STATUS(gsc_condition_create(&cp, &ca), GSC_ERR_INVALID_HANDLE, "gsc_worker_h");
    cp.category = (gsc_condition_category_t)9;
    EXPECT_STATUS(gsc_condition_create(&cp, &ca), GSC_ERR_INVALID_PARAM, "category 9");
    cp.category = GSC_CONDITION_CATEGORY_HOST_STREAM;
    cp.context = sa;
    EXPECT(gsc_condition_create(&cp, &ca) == GSC_OK);
    cp.context = sb;
    EXPECT(gsc_condition_create(&cp, &cb) == GSC_OK);

    memset(&p, 0, sizeof(p));
    p.op_attr_mask = GSC_OP_ATTR_FIELD_CONDITION;
    EXPECT(gsc_host_stream_launch(sa, fill_on_stream, src) == GSC_OK);
    p.condition = ca;
    s = gsc_tag_send_nbx(ep, src, sizeof(src), 77, &p);
    EXPECT(GSC_PTR_IS_PTR(s));
    p.condition = cb;
    r = gsc_tag_recv_nbx(wb, dst, sizeof(dst), 77, ~(uint64_t)0, &p);
    EXPECT(GSC_PTR_IS_PTR(r));
    EXPECT(gsc_host_stream_launch(sb, check_on_stream, dst) == GSC_OK);
    EXPECT(finish2(s, NULL) == GSC_OK);
    EXPECT(finish2(r, NULL) == GSC_OK);
    EXPECT(gsc_host_stream_synchronize(sa, 20000) == GSC_OK);
    EXPECT(gsc_host_stream_synchronize(sb, 20000) == GSC_OK);
    EXPECT(checked_ok == 1);
    EXPECT(gsc_condition_query(ca) == GSC_OK && gsc_condition_wait(ca) == GSC_OK);
    EXPECT_STATUS(gsc_host_stream_launch(sa, NULL, NULL), GSC_ERR_INVALID_PARAM, "fn");

    /* Categories that need CUDA: refused with a reason on a machine without it; a GRAPH
     * operation without condition_out is refused before anything happens. */
    cp.category = GSC_CONDITION_CATEGORY_KERNEL_TRIGGERED;
    cp.field_mask = GSC_CONDITION_PARAM_FIELD_CATEGORY;
    if (gsc_condition_create(&cp, &bad) == GSC_OK) {
        memset(&p, 0, sizeof(p));
        p.op_attr_mask = GSC_OP_ATTR_FIELD_CONDITION;
        p.condition = bad;
        EXPECT_PTR_STATUS(gsc_tag_send_nbx(ep, src, sizeof(src), 1, &p), GSC_ERR_INVALID_PARAM, "condition_out");
        p.op_attr_mask |= GSC_OP_ATTR_FIELD_CONDITION_OUT;
        p.condition_out = &out;
        (void)out;
        EXPECT(gsc_condition_destroy(bad) == GSC_OK);
    } else {
        EXPECT(strstr(gsc_last_error_message(), "CUDA") != NULL);
    }

    EXPECT(gsc_condition_destroy(ca) == GSC_OK && gsc_condition_destroy(cb) == GSC_OK);
    EXPECT_STATUS(gsc_condition_query(ca), GSC_ERR_INVALID_HANDLE, "gsc_condition_h");
    EXPECT(gsc_host_stream_destroy(sa) == GSC_OK && gsc_host_stream_destroy(sb) == GSC_OK);
    EXPECT_STATUS(gsc_host_stream_synchronize(sa, 0), GSC_ERR_INVALID_HANDLE, "gsc_host_stream_h");
}

/* An endpoint from worker `from` to worker `to` (through `to`'s packed address). */
static gsc_ep_h connect_ep(gsc_worker_h from, gsc_worker_h to)
{
    gsc_ep_params_t ep_params;
    gsc_ep_h ep = NULL;
    void *addr = NULL;
    size_t len;
    EXPECT(gsc_worker_get_address(to, &addr, &len) == GSC_OK);
    memset(&ep_params, 0, sizeof(ep_params));
    ep_params.field_mask = GSC_EP_PARAM_FIELD_ADDRESS;
    ep_params.address = addr;
    EXPECT(gsc_ep_create(from, &ep_params, &ep) == GSC_OK);
    EXPECT(gsc_worker_release_address(to, addr) == GSC_OK);
    return ep;
}

/* Prepared transfers between wa (send, 4 partitions) and wb (receive, 2 partitions), each on
 * its own endpoint; partitions readied out of order, new data every round, and misuse. */
static void prepared(gsc_ep_h ep)
{
    gsc_ep_h back;
    gsc_buffer_param_t bp;
    gsc_prepared_h tx = NULL, rx = NULL, other = NULL;
    gsc_status_ptr_t s, r;
    static unsigned char src[4096], dst[4096];
    int round, part, flag, i, wrong = 0;

    back = connect_ep(wb, wa);

    memset(&bp, 0, sizeof(bp));
    bp.field_mask = GSC_BUFFER_PARAM_FIELD_PARTITIONS;
    bp.direction = GSC_PREPARE_SEND;
    bp.buffer = src;
    bp.length = sizeof(src);
    bp.tag = 0xBEEF;
    bp.partitions = 3;
    EXPECT_STATUS(gsc_prepare_transfers(ep, &tx, &bp), GSC_ERR_INVALID_PARAM, "equal partitions");
    bp.partitions = 4;
    EXPECT_STATUS(gsc_prepare_transfers(ep, NULL, &bp), GSC_ERR_INVALID_PARAM, "NULL");
    EXPECT_STATUS(gsc_prepare_transfers(ep, &tx, NULL), GSC_ERR_INVALID_PARAM, "NULL");
    bp.direction = (gsc_prepare_direction_t)5;
    EXPECT_STATUS(gsc_prepare_transfers(ep, &tx, &bp), GSC_ERR_INVALID_PARAM, "direction");
    bp.direction = GSC_PREPARE_SEND;
    EXPECT(gsc_prepare_transfers(ep, &tx, &bp) == GSC_OK);
    bp.direction = GSC_PREPARE_RECV;
    bp.buffer = dst;
    bp.partitions = 2;
    EXPECT(gsc_prepare_transfers(back, &rx, &bp) == GSC_OK);

    for (round = 0; round < 20; round++) {
        for (i = 0; i < (int)sizeof(src); i++) {
            src[i] = (unsigned char)(i * 7 + round);
        }
        r = gsc_prepared_start(rx, NULL);
        s = gsc_prepared_start(tx, NULL);
        EXPECT(GSC_PTR_IS_PTR(r) && GSC_PTR_IS_PTR(s));
        EXPECT_PTR_STATUS(gsc_prepared_start(tx, NULL), GSC_ERR_BUSY, "already started");
        EXPECT_STATUS(gsc_release_preparations(ep, tx), GSC_ERR_BUSY, "in flight");
        for (part = 3; part >= 0; part--) {
            EXPECT(gsc_prepared_pready(tx, (size_t)part) == GSC_OK);
        }
        EXPECT_STATUS(gsc_prepared_pready(tx, 0), GSC_ERR_INVALID_PARAM, "already ready");
        EXPECT_STATUS(gsc_prepared_pready(tx, 4), GSC_ERR_OUT_OF_RANGE, "partition 4");
        EXPECT(finish2(s, NULL) == GSC_OK);
        EXPECT(finish2(r, NULL) == GSC_OK);
        EXPECT(gsc_prepared_parrived(rx, 1, &flag) == GSC_OK && flag == 1);
        wrong += memcmp(src, dst, sizeof(src)) != 0;
    }
    EXPECT(wrong == 0);
    EXPECT_STATUS(gsc_prepared_parrived(rx, 2, &flag), GSC_ERR_OUT_OF_RANGE, "partition 2");
    EXPECT_STATUS(gsc_prepared_parrived(rx, 0, NULL), GSC_ERR_INVALID_PARAM, "flag");
    EXPECT_STATUS(gsc_prepared_pready(rx, 0), GSC_ERR_INVALID_PARAM, "partitioned send");

    /* GPU rounds: refused for host buffers and unknown flags; the GPU calls refuse a host pair. */
    {
        gsc_buffer_param_t gp;
        gsc_prepared_h g = NULL;
        uint64_t round = 1;
        void *dh = NULL;
        memset(&gp, 0, sizeof(gp));
        gp.field_mask = GSC_BUFFER_PARAM_FIELD_FLAGS;
        gp.direction = GSC_PREPARE_SEND;
        gp.buffer = src;
        gp.length = 64;
        gp.flags = GSC_PREPARE_FLAG_GPU_ROUNDS;
        EXPECT_STATUS(gsc_prepare_transfers(ep, &g, &gp), GSC_ERR_INVALID_PARAM, "GPU buffer");
        gp.flags = (uint64_t)1 << 9;
        EXPECT_STATUS(gsc_prepare_transfers(ep, &g, &gp), GSC_ERR_INVALID_PARAM, "flags");
        gp.flags = GSC_PREPARE_FLAG_GPU_ROUNDS | GSC_PREPARE_FLAG_PROXY;
        EXPECT_STATUS(gsc_prepare_transfers(ep, &g, &gp), GSC_ERR_INVALID_PARAM, "exclude each other");
        EXPECT(g == NULL);
        {
            int on_gpu = 7;
            EXPECT(gsc_prepared_on_gpu(tx, &on_gpu) == GSC_OK);
            EXPECT(on_gpu == 0);
            EXPECT_STATUS(gsc_prepared_on_gpu(tx, NULL), GSC_ERR_INVALID_PARAM, "NULL");
        }
        EXPECT_STATUS(gsc_prepared_gpu_error(tx, &round), GSC_ERR_INVALID_PARAM, "on the GPU");
        EXPECT(round == 1);
        EXPECT_STATUS(gsc_prepared_device_handle(tx, &dh), GSC_ERR_INVALID_PARAM, "on the GPU");
        EXPECT_STATUS(gsc_prepared_device_handle(tx, NULL), GSC_ERR_INVALID_PARAM, "NULL");
    }

    /* A persistent pair the MPI way; released on the wrong endpoint is refused. */
    EXPECT(gsc_tag_send_init(ep, src, 100, 1, &other) == GSC_OK);
    EXPECT_STATUS(gsc_release_preparations(back, other), GSC_ERR_INVALID_PARAM, "this endpoint");
    EXPECT(gsc_release_preparations(ep, other) == GSC_OK);
    EXPECT_STATUS(gsc_release_preparations(ep, other), GSC_ERR_INVALID_HANDLE, "gsc_prepared_h");
    EXPECT_PTR_STATUS(gsc_prepared_start(other, NULL), GSC_ERR_INVALID_HANDLE, "gsc_prepared_h");

    EXPECT(gsc_release_preparations(ep, tx) == GSC_OK);
    /* The peer released: the receive's next round fails instead of waiting. */
    r = gsc_prepared_start(rx, NULL);
    EXPECT_STATUS(finish2(r, NULL), GSC_ERR_NOT_CONNECTED, "");
    EXPECT(gsc_release_preparations(back, rx) == GSC_OK);
    EXPECT(finish2(gsc_ep_close_nbx(back, NULL), NULL) == GSC_OK);
}

/* Issue #8: stale and double-freed handles of every kind return GSC_ERR_INVALID_HANDLE naming
 * the type and never crash; the live objects around them keep working. Communicator handles
 * cannot be made without a GPU: NULL, forged and wrong-type ones are checked everywhere, and a
 * real one (where gsc_comm_init_rank works) is destroyed twice. gsc_worker_abort is idempotent
 * and sticky (the first reason stays), and refused once the worker is gone. */
static void stale_handles(gsc_context_h ctx)
{
    gsc_worker_h w, w2;
    gsc_ep_h e, e2;
    gsc_status_ptr_t r, r2;
    gsc_condition_h c;
    gsc_condition_param_t cp;
    gsc_host_stream_h s;
    gsc_request_param_t p;
    gsc_comm_h comm = NULL;
    gsc_comm_reg_h reg = NULL;
    gsc_comm_win_h win = NULL;
    gsc_unique_id_t uid;
    char buf[8];
    int x = -1, local = 0;

    /* Abort: pending requests end with ABORTED, later operations fail with the first reason. */
    EXPECT(gsc_worker_create(ctx, NULL, &w) == GSC_OK);
    e = connect_ep(w, wb);
    r = gsc_tag_recv_nbx(w, buf, sizeof(buf), 4242, ~(uint64_t)0, NULL);
    EXPECT(GSC_PTR_IS_PTR(r));
    EXPECT(gsc_worker_abort(w, "the first reason") == GSC_OK);
    EXPECT(gsc_worker_abort(w, "a second reason") == GSC_OK);
    EXPECT(gsc_request_check_status(r) == GSC_ERR_ABORTED);
    EXPECT_PTR_STATUS(gsc_tag_send_nbx(e, buf, 1, 1, NULL), GSC_ERR_ABORTED, "the first reason");
    EXPECT_PTR_STATUS(gsc_tag_recv_nbx(w, buf, 1, 1, ~(uint64_t)0, NULL), GSC_ERR_ABORTED, "the first reason");
    EXPECT_STATUS(gsc_worker_abort(NULL, "x"), GSC_ERR_INVALID_HANDLE, "gsc_worker_h");
    gsc_request_free(r);
    EXPECT_STATUS(gsc_request_check_status(r), GSC_ERR_INVALID_HANDLE, "");
    /* The worker, destroyed twice; everything that named it or its endpoint is refused. */
    EXPECT(gsc_worker_destroy(w) == GSC_OK);
    EXPECT_STATUS(gsc_worker_destroy(w), GSC_ERR_INVALID_HANDLE, "gsc_worker_h");
    EXPECT_STATUS(gsc_worker_abort(w, "late"), GSC_ERR_INVALID_HANDLE, "gsc_worker_h");
    EXPECT(gsc_worker_progress(w) == 0);
    EXPECT_PTR_STATUS(gsc_tag_recv_nbx(w, buf, 1, 1, ~(uint64_t)0, NULL), GSC_ERR_INVALID_HANDLE, "gsc_worker_h");
    EXPECT_PTR_STATUS(gsc_tag_send_nbx(e, buf, 1, 1, NULL), GSC_ERR_INVALID_HANDLE, "gsc_ep_h");
    EXPECT_PTR_STATUS(gsc_ep_close_nbx(e, NULL), GSC_ERR_INVALID_HANDLE, "gsc_ep_h");

    /* A request still pending when its worker is destroyed goes stale with it. */
    EXPECT(gsc_worker_create(ctx, NULL, &w2) == GSC_OK);
    r2 = gsc_tag_recv_nbx(w2, buf, sizeof(buf), 4243, ~(uint64_t)0, NULL);
    EXPECT(GSC_PTR_IS_PTR(r2));
    EXPECT(gsc_worker_destroy(w2) == GSC_OK);
    EXPECT_STATUS(gsc_request_check_status(r2), GSC_ERR_INVALID_HANDLE, "");
    EXPECT_STATUS(gsc_request_wait(r2, NULL), GSC_ERR_INVALID_HANDLE, "");
    EXPECT_STATUS(gsc_request_cancel(wa, r2), GSC_ERR_INVALID_HANDLE, "");
    gsc_request_free(r2);
    EXPECT_STATUS(GSC_ERR_INVALID_HANDLE, GSC_ERR_INVALID_HANDLE, "gsc_request_free");

    /* An endpoint closed twice. */
    e2 = connect_ep(wa, wb);
    EXPECT(finish2(gsc_ep_close_nbx(e2, NULL), NULL) == GSC_OK);
    EXPECT_PTR_STATUS(gsc_ep_close_nbx(e2, NULL), GSC_ERR_INVALID_HANDLE, "gsc_ep_h");
    EXPECT_PTR_STATUS(gsc_ep_flush_nbx(e2, NULL), GSC_ERR_INVALID_HANDLE, "gsc_ep_h");

    /* A condition and its host stream, destroyed twice; an operation on the stale condition is
     * refused before anything starts. */
    EXPECT(gsc_host_stream_create(&s) == GSC_OK);
    memset(&cp, 0, sizeof(cp));
    cp.field_mask = GSC_CONDITION_PARAM_FIELD_CATEGORY | GSC_CONDITION_PARAM_FIELD_CONTEXT;
    cp.category = GSC_CONDITION_CATEGORY_HOST_STREAM;
    cp.context = s;
    EXPECT(gsc_condition_create(&cp, &c) == GSC_OK);
    EXPECT(gsc_condition_destroy(c) == GSC_OK);
    EXPECT_STATUS(gsc_condition_destroy(c), GSC_ERR_INVALID_HANDLE, "gsc_condition_h");
    EXPECT_STATUS(gsc_condition_wait(c), GSC_ERR_INVALID_HANDLE, "gsc_condition_h");
    EXPECT_STATUS(gsc_condition_group_start(c), GSC_ERR_INVALID_HANDLE, "gsc_condition_h");
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = GSC_OP_ATTR_FIELD_CONDITION;
    p.condition = c;
    EXPECT_PTR_STATUS(gsc_tag_recv_nbx(wb, buf, 1, 1, ~(uint64_t)0, &p), GSC_ERR_INVALID_HANDLE, "gsc_condition_h");
    EXPECT(gsc_host_stream_destroy(s) == GSC_OK);
    EXPECT_STATUS(gsc_host_stream_destroy(s), GSC_ERR_INVALID_HANDLE, "gsc_host_stream_h");
    EXPECT_STATUS(gsc_host_stream_launch(s, fill_on_stream, buf), GSC_ERR_INVALID_HANDLE, "gsc_host_stream_h");
    /* A destroyed host stream as a condition's context. */
    cp.context = s;
    EXPECT_STATUS(gsc_condition_create(&cp, &c), GSC_ERR_INVALID_HANDLE, "gsc_host_stream_h");

    /* Communicators: NULL, forged and wrong-type handles, then a real one destroyed twice. */
    EXPECT_STATUS(gsc_comm_destroy(NULL), GSC_ERR_INVALID_HANDLE, "");
    EXPECT_STATUS(gsc_comm_destroy((gsc_comm_h)(void *)&local), GSC_ERR_INVALID_HANDLE, "not a live");
    EXPECT_STATUS(gsc_comm_destroy((gsc_comm_h)(void *)wa), GSC_ERR_INVALID_HANDLE, "gsc_worker_h");
    EXPECT_STATUS(gsc_comm_rank((gsc_comm_h)(void *)wa, &x), GSC_ERR_INVALID_HANDLE, "gsc_worker_h");
    EXPECT(x == -1);
    EXPECT_STATUS(gsc_comm_size(NULL, &x), GSC_ERR_INVALID_HANDLE, "");
    EXPECT_STATUS(gsc_comm_query((gsc_comm_h)(void *)&local), GSC_ERR_INVALID_HANDLE, "");
    EXPECT_STATUS(gsc_comm_all_reduce((gsc_comm_h)(void *)wb, buf, buf, 1, GSC_FLOAT32, GSC_SUM, NULL),
                  GSC_ERR_INVALID_HANDLE, "");
    EXPECT_STATUS(gsc_comm_send(NULL, buf, 1, GSC_UINT8, 0, NULL), GSC_ERR_INVALID_HANDLE, "");
    EXPECT_STATUS(gsc_comm_collective((gsc_comm_h)(void *)wa, NULL, NULL, NULL), GSC_ERR_INVALID_HANDLE, "gsc_worker_h");
    EXPECT_STATUS(gsc_comm_device((gsc_comm_h)(void *)wa, &x), GSC_ERR_INVALID_HANDLE, "gsc_worker_h");
    EXPECT_STATUS(gsc_comm_split(NULL, 0, 0, &comm), GSC_ERR_INVALID_HANDLE, "gsc_comm_h is NULL");
    EXPECT_STATUS(gsc_comm_abort((gsc_comm_h)(void *)&local), GSC_ERR_INVALID_HANDLE, "not a live");
    EXPECT_STATUS(gsc_comm_revoke(NULL), GSC_ERR_INVALID_HANDLE, "");
    EXPECT_STATUS(gsc_comm_shrink(NULL, &local, 1, 0, &comm), GSC_ERR_INVALID_HANDLE, "");
    EXPECT_STATUS(gsc_comm_register(NULL, buf, 8, &reg), GSC_ERR_INVALID_HANDLE, "");
    EXPECT_STATUS(gsc_comm_deregister((gsc_comm_h)(void *)wa, reg), GSC_ERR_INVALID_HANDLE, "gsc_worker_h");
    EXPECT_STATUS(gsc_comm_window_register(NULL, buf, 8, GSC_WIN_SYMMETRIC, &win), GSC_ERR_INVALID_HANDLE, "");
    EXPECT_STATUS(gsc_comm_window_deregister(NULL, win), GSC_ERR_INVALID_HANDLE, "gsc_comm_h is NULL");
    EXPECT(comm == NULL && reg == NULL && win == NULL);
    /* Memory the allocator did not hand out is refused before any driver call, GPU or not. */
    EXPECT_STATUS(gsc_gpu_mem_free(buf), GSC_ERR_INVALID_PARAM, "");
    EXPECT(gsc_gpu_mem_free(NULL) == GSC_OK);
    EXPECT_STATUS(gsc_gpu_mem_alloc(NULL, 64), GSC_ERR_INVALID_PARAM, "ptr_p is NULL");
    /* No peer memory mapped in this process: nothing to close, GPU or not; NULL is allowed. */
    {
        size_t closed = 99;
        EXPECT(gsc_release_peer_mappings(&closed) == GSC_OK && closed == 0);
        EXPECT(gsc_release_peer_mappings(NULL) == GSC_OK);
    }
    EXPECT(gsc_get_unique_id(&uid) == GSC_OK);
    if (gsc_comm_init_rank(&comm, 1, &uid, 0, 0) == GSC_OK) {
        gsc_comm_h sub = NULL, again = NULL;
        void *dev = NULL;
        EXPECT(gsc_comm_rank(comm, &x) == GSC_OK && x == 0);
        EXPECT(gsc_comm_device(comm, &x) == GSC_OK && x == 0);
        /* Split: no color gives no communicator; a color, one of this rank alone. */
        EXPECT(gsc_comm_split(comm, GSC_SPLIT_NOCOLOR, 0, &sub) == GSC_OK && sub == NULL);
        EXPECT_STATUS(gsc_comm_split(comm, -2, 0, &sub), GSC_ERR_INVALID_PARAM, "color -2");
        EXPECT_STATUS(gsc_comm_split(comm, 0, 0, NULL), GSC_ERR_INVALID_PARAM, "newcomm_p is NULL");
        EXPECT(gsc_comm_split(comm, 5, 0, &sub) == GSC_OK && sub != NULL);
        EXPECT(gsc_comm_size(sub, &x) == GSC_OK && x == 1);
        /* Registration: GPU memory of the device only; a registration belongs to its communicator. */
        EXPECT(gsc_gpu_mem_alloc(&dev, 1 << 20) == GSC_OK && dev != NULL);
        EXPECT_STATUS(gsc_gpu_mem_free((char *)dev + 64), GSC_ERR_INVALID_PARAM, "");
        EXPECT_STATUS(gsc_comm_register(comm, buf, sizeof(buf), &reg), GSC_ERR_INVALID_PARAM, "");
        EXPECT(reg == NULL);
        EXPECT(gsc_comm_register(comm, (char *)dev + 4096, 65536, &reg) == GSC_OK && reg != NULL);
        EXPECT_STATUS(gsc_comm_deregister(sub, reg), GSC_ERR_INVALID_PARAM, "is not of communicator");
        EXPECT(gsc_comm_deregister(comm, reg) == GSC_OK);
        EXPECT_STATUS(gsc_comm_deregister(comm, reg), GSC_ERR_INVALID_HANDLE, "gsc_comm_reg_h");
        /* Windows: bad flags and host memory refused; one of the communicator's, deregistered
         * there only, once; a live one goes with its communicator (sub, destroyed below). */
        EXPECT_STATUS(gsc_comm_window_register(comm, dev, 65536, 2, &win), GSC_ERR_INVALID_PARAM, "flags 2");
        EXPECT_STATUS(gsc_comm_window_register(comm, buf, sizeof(buf), GSC_WIN_SYMMETRIC, &win), GSC_ERR_INVALID_PARAM,
                      "rank 0 could not register its window");
        EXPECT(win == NULL);
        EXPECT(gsc_comm_window_register(comm, dev, 1 << 20, GSC_WIN_SYMMETRIC, &win) == GSC_OK && win != NULL);
        EXPECT_STATUS(gsc_comm_window_deregister(sub, win), GSC_ERR_INVALID_PARAM, "is not of communicator");
        EXPECT_STATUS(gsc_comm_window_deregister(comm, (gsc_comm_win_h)(void *)reg), GSC_ERR_INVALID_HANDLE, "");
        EXPECT(gsc_comm_window_deregister(comm, win) == GSC_OK);
        EXPECT_STATUS(gsc_comm_window_deregister(comm, win), GSC_ERR_INVALID_HANDLE, "gsc_comm_win_h");
        EXPECT(gsc_comm_window_register(sub, dev, 4096, 0, &win) == GSC_OK && win != NULL);
        EXPECT(gsc_gpu_mem_free(dev) == GSC_OK);
        EXPECT_STATUS(gsc_gpu_mem_free(dev), GSC_ERR_INVALID_PARAM, "");
        /* Shrink: a bad list changes nothing, the revoke GSC_SHRINK_ABORT asks for included. */
        local = 0;
        EXPECT_STATUS(gsc_comm_shrink(comm, &local, 1, GSC_SHRINK_ABORT, &again), GSC_ERR_INVALID_PARAM, "this rank (0)");
        EXPECT_STATUS(gsc_comm_shrink(comm, NULL, 0, 0, &again), GSC_ERR_INVALID_PARAM, "empty");
        EXPECT_STATUS(gsc_comm_shrink(comm, &local, 1, 4, &again), GSC_ERR_INVALID_PARAM, "flags");
        EXPECT(again == NULL && gsc_comm_query(comm) == GSC_OK);
        /* Revoke: collectives refused, the query clean, split still there; then abort. */
        EXPECT(gsc_comm_revoke(sub) == GSC_OK);
        EXPECT_STATUS(gsc_comm_revoke(sub), GSC_ERR_INVALID_PARAM, "revoke");
        EXPECT(gsc_comm_query(sub) == GSC_OK);
        EXPECT(gsc_comm_split(sub, 0, 0, &again) == GSC_OK && again != NULL);
        EXPECT(gsc_comm_destroy(again) == GSC_OK);
        EXPECT(gsc_comm_abort(comm) == GSC_OK && gsc_comm_abort(comm) == GSC_OK);
        EXPECT_STATUS(gsc_comm_query(comm), GSC_ERR_ABORTED, "gsc_comm_abort");
        EXPECT_STATUS(gsc_comm_split(comm, 0, 0, &again), GSC_ERR_ABORTED, "");
        EXPECT(gsc_comm_destroy(sub) == GSC_OK);
        EXPECT(gsc_comm_destroy(comm) == GSC_OK);
        EXPECT_STATUS(gsc_comm_destroy(comm), GSC_ERR_INVALID_HANDLE, "gsc_comm_h");
        EXPECT_STATUS(gsc_comm_query(comm), GSC_ERR_INVALID_HANDLE, "gsc_comm_h");
    } else {
        /* No GPU: refused with a reason, and the out-pointer untouched. */
        EXPECT(comm == NULL);
        EXPECT(gsc_last_error_message()[0] != '\0');
    }
    /* wa and wb, named above with the wrong types, are used for real by the sections after
     * this one. */
}

/* Destroying a worker with an open endpoint releases the endpoint; its handle goes stale. */
static void lifetimes(gsc_context_h ctx)
{
    gsc_worker_h w3;
    gsc_ep_h ep3;
    gsc_ep_params_t ep_params;
    void *addr;
    size_t len;
    EXPECT(gsc_worker_create(ctx, NULL, &w3) == GSC_OK);
    EXPECT(gsc_worker_get_address(wb, &addr, &len) == GSC_OK);
    memset(&ep_params, 0, sizeof(ep_params));
    ep_params.field_mask = GSC_EP_PARAM_FIELD_ADDRESS; /* length read from the address */
    ep_params.address = addr;
    EXPECT(gsc_ep_create(w3, &ep_params, &ep3) == GSC_OK);
    EXPECT_STATUS(gsc_worker_release_address(w3, addr), GSC_ERR_INVALID_PARAM, "another worker");
    EXPECT(gsc_worker_release_address(wb, addr) == GSC_OK);
    EXPECT(gsc_worker_destroy(w3) == GSC_OK);
    EXPECT_PTR_STATUS(gsc_ep_close_nbx(ep3, NULL), GSC_ERR_INVALID_HANDLE, "gsc_ep_h");
    EXPECT_STATUS(gsc_worker_destroy(w3), GSC_ERR_INVALID_HANDLE, "gsc_worker_h");
}

/* Request areas (request_size / request_init / request_cleanup), as an MPI library uses them. */
struct area { unsigned magic; int mpi_req; int seen_in_callback; };
static int area_inits = 0, area_cleanups = 0;
static void area_init(void *a) { ((struct area *)a)->magic = 0xA5EAu; area_inits++; }
static void area_cleanup(void *a) { EXPECT(((struct area *)a)->magic == 0xA5EAu); area_cleanups++; }
static void on_area_recv(void *request, gsc_status_t status, const gsc_tag_recv_info_t *info,
                         void *user_data)
{
    struct area *a = NULL;
    (void)status; (void)info; (void)user_data;
    EXPECT(gsc_request_area(request, (void **)&a) == GSC_OK);
    if (a != NULL) {
        a->seen_in_callback = a->mpi_req;
    }
}

static void request_areas(void)
{
    gsc_context_h c;
    gsc_params_t params;
    gsc_worker_h save_a = wa, save_b = wb;
    gsc_ep_h e;
    gsc_request_param_t rp;
    gsc_status_ptr_t r, r2;
    struct area *a = NULL, *a2 = NULL;
    void *p = NULL;
    char buf[8];

    memset(&params, 0, sizeof(params));
    params.field_mask = GSC_PARAM_FIELD_REQUEST_INIT;
    params.request_init = area_init;
    EXPECT_STATUS(gsc_init(&params, &c), GSC_ERR_INVALID_PARAM, "without request_size");
    params.field_mask |= GSC_PARAM_FIELD_REQUEST_SIZE;
    params.request_size = 0;
    EXPECT_STATUS(gsc_init(&params, &c), GSC_ERR_INVALID_PARAM, "request_size");
    params.field_mask |= GSC_PARAM_FIELD_REQUEST_CLEANUP;
    params.request_size = sizeof(struct area);
    params.request_cleanup = area_cleanup;
    EXPECT(gsc_init(&params, &c) == GSC_OK);
    EXPECT(gsc_worker_create(c, NULL, &wa) == GSC_OK);
    EXPECT(gsc_worker_create(c, NULL, &wb) == GSC_OK);
    e = connect_ep(wa, wb);

    /* A pending receive's area: initialized once, ours until the request is freed. */
    r = gsc_tag_recv_nbx(wb, buf, sizeof(buf), 1, ~(uint64_t)0, NULL);
    EXPECT(GSC_PTR_IS_PTR(r));
    EXPECT(gsc_request_area(r, (void **)&a) == GSC_OK && a != NULL);
    EXPECT(a != NULL && a->magic == 0xA5EAu && ((size_t)a % 16) == 0);
    EXPECT_STATUS(gsc_request_area(r, NULL), GSC_ERR_INVALID_PARAM, "area_p");
    EXPECT(area_inits == 1);
    EXPECT(finish2(gsc_tag_send_nbx(e, "ping", 5, 1, NULL), NULL) == GSC_OK);
    EXPECT(finish2(r, NULL) == GSC_OK);
    EXPECT_STATUS(gsc_request_area(r, &p), GSC_ERR_INVALID_HANDLE, "");

    /* Freed while in progress: its callback still reaches the area. The area is the one the
     * first request gave back, not initialized again. */
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask = GSC_OP_ATTR_FIELD_CALLBACK;
    rp.cb.recv = on_area_recv;
    r2 = gsc_tag_recv_nbx(wb, buf, sizeof(buf), 2, ~(uint64_t)0, &rp);
    EXPECT(GSC_PTR_IS_PTR(r2));
    EXPECT(gsc_request_area(r2, (void **)&a2) == GSC_OK && a2 == a);
    EXPECT(area_inits == 1);
    if (a2 != NULL) {
        a2->mpi_req = 42;
    }
    gsc_request_free(r2);
    EXPECT(finish2(gsc_tag_send_nbx(e, "pong", 5, 2, NULL), NULL) == GSC_OK);
    {
        time_t start = time(NULL);
        while ((a2 == NULL || a2->seen_in_callback != 42) && time(NULL) - start < 20) {
            gsc_worker_progress(wb);
        }
    }
    EXPECT(a2 != NULL && a2->seen_in_callback == 42);

    EXPECT(gsc_worker_destroy(wa) == GSC_OK);
    EXPECT(gsc_worker_destroy(wb) == GSC_OK);
    EXPECT(gsc_cleanup(c) == GSC_OK);
    EXPECT(area_cleanups == area_inits);
    wa = save_a;
    wb = save_b;
}

int main(void)
{
    gsc_context_h ctx;
    gsc_params_t params;
    gsc_config_pair_t pair;
    gsc_ep_params_t ep_params;
    gsc_ep_h ep;
    void *addr;
    size_t len;

    EXPECT(gsc_last_error_message() != NULL && gsc_last_error_message()[0] == '\0');
    config_errors();

    pair.name = "GSC_TIMEOUT";
    pair.value = "20s";
    memset(&params, 0, sizeof(params));
    params.field_mask = GSC_PARAM_FIELD_CONFIG;
    params.config = &pair;
    params.config_count = 1;
    if (gsc_init(&params, &ctx) != GSC_OK || gsc_worker_create(ctx, NULL, &wa) != GSC_OK ||
        gsc_worker_create(ctx, NULL, &wb) != GSC_OK || gsc_worker_get_address(wb, &addr, &len) != GSC_OK) {
        fprintf(stderr, "setup failed: %s\n", gsc_last_error_message());
        return 1;
    }
    memset(&ep_params, 0, sizeof(ep_params));
    ep_params.field_mask = GSC_EP_PARAM_FIELD_ADDRESS | GSC_EP_PARAM_FIELD_ADDRESS_LENGTH;
    ep_params.address = addr;
    ep_params.address_length = len;
    if (gsc_ep_create(wa, &ep_params, &ep) != GSC_OK) {
        fprintf(stderr, "endpoint: %s\n", gsc_last_error_message());
        return 1;
    }
    EXPECT(gsc_worker_release_address(wb, addr) == GSC_OK);

    handle_errors(ctx);
    param_errors(ep);
    host_stream_conditions(ep);
    truncation(ep, 1024, 1);
    truncation(ep, 1024, 0);
    truncation(ep, 64 * 1024, 1);
    truncation(ep, 64 * 1024, 0);
    requests(ep);
    {
        char b[1];
        void *area = NULL;
        gsc_status_ptr_t r = gsc_tag_recv_nbx(wa, b, 1, 777, ~(uint64_t)0, NULL);
        EXPECT_STATUS(gsc_request_area(r, &area), GSC_ERR_UNSUPPORTED, "request size");
        EXPECT(gsc_request_cancel(wa, r) == GSC_OK);
        EXPECT(finish2(r, NULL) == GSC_ERR_CANCELED);
    }
    prepared(ep);
    memory(ctx, ep);
    lifetimes(ctx);
    stale_handles(ctx);
    bootstrap();
    request_areas();

    {
        gsc_request_param_t p;
        memset(&p, 0, sizeof(p));
        p.op_attr_mask = GSC_OP_ATTR_FIELD_FLAGS;
        p.flags = GSC_EP_CLOSE_FLAG_FORCE;
        EXPECT(finish2(gsc_ep_close_nbx(ep, &p), NULL) == GSC_OK);
        EXPECT_PTR_STATUS(gsc_tag_send_nbx(ep, "x", 1, 1, NULL), GSC_ERR_INVALID_HANDLE, "gsc_ep_h");
    }
    EXPECT(gsc_worker_destroy(wa) == GSC_OK);
    /* Cleanup with a live worker releases it too. */
    EXPECT(gsc_cleanup(ctx) == GSC_OK);
    EXPECT_STATUS(gsc_worker_destroy(wb), GSC_ERR_INVALID_HANDLE, "gsc_worker_h");
    EXPECT_STATUS(gsc_cleanup(ctx), GSC_ERR_INVALID_HANDLE, "gsc_context_h");

    if (failures) {
        fprintf(stderr, "error paths: %d check(s) failed\n", failures);
        return 1;
    }
    printf("error paths: all checks passed\n");
    return 0;
}
"#;
