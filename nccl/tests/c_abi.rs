//! The library from C, as an NCCL program sees it: a C99 program declaring nccl.h 2.28's
//! prototypes (the ones it calls, with NCCL's types: `ncclUniqueId` of 128 chars passed by
//! value, enums as int) is linked with `-lnccl` against this build's library, installed as
//! NVIDIA's is (libnccl.so.2 and a libnccl.so link), and run: it loads it by its soname. It
//! checks what needs no GPU: the version, error strings, a unique id, bad arguments named in
//! ncclGetLastError, unsupported functions refused, and group nesting. With a GPU present the
//! same checks hold (none of them touches one).
//!
//! Needs a C compiler (`cc`, or `CC`).

use std::path::PathBuf;
use std::process::Command;

const PROGRAM: &str = r#"
#include <stdio.h>
#include <string.h>
typedef enum { ncclSuccess = 0, ncclUnhandledCudaError = 1, ncclSystemError = 2, ncclInternalError = 3,
               ncclInvalidArgument = 4, ncclInvalidUsage = 5, ncclRemoteError = 6, ncclInProgress = 7 } ncclResult_t;
typedef struct ncclComm *ncclComm_t;
typedef struct { char internal[128]; } ncclUniqueId;
ncclResult_t ncclGetVersion(int *version);
const char *ncclGetErrorString(ncclResult_t result);
const char *ncclGetLastError(ncclComm_t comm);
ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId);
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t ncclCommCount(const ncclComm_t comm, int *count);
ncclResult_t ncclSend(const void *sendbuff, size_t count, int datatype, int peer, ncclComm_t comm, void *stream);
ncclResult_t ncclCommWindowDeregister(ncclComm_t comm, void *win);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);

static int failures = 0;
#define CHECK(cond) do { if (!(cond)) { fprintf(stderr, "failed: %s (line %d; last error: %s)\n", #cond, __LINE__, ncclGetLastError(NULL)); failures++; } } while (0)

int main(void) {
    int v = 0;
    CHECK(ncclGetVersion(&v) == ncclSuccess && v == 22809);
    CHECK(strlen(ncclGetErrorString(ncclInvalidUsage)) > 0);
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    CHECK(ncclGetUniqueId(&id) == ncclSuccess);
    CHECK(memcmp(id.internal, "GSCU", 4) == 0);
    int n = -1;
    CHECK(ncclCommCount(NULL, &n) == ncclInvalidArgument && n == -1);
    CHECK(strstr(ncclGetLastError(NULL), "comm is NULL") != NULL);
    /* A rank out of range is refused (before any GPU is needed, or by the CUDA check first). */
    ncclComm_t comm = NULL;
    CHECK(ncclCommInitRank(&comm, 2, id, 7) != ncclSuccess && comm == NULL);
    CHECK(ncclSend(NULL, 1, 7, 0, NULL, NULL) == ncclInvalidArgument);
    CHECK(strstr(ncclGetLastError(NULL), "ncclSend: comm is NULL") != NULL);
    CHECK(ncclCommWindowDeregister(NULL, NULL) == ncclInvalidUsage);
    CHECK(strstr(ncclGetLastError(NULL), "ncclCommWindowDeregister is not supported") != NULL);
    CHECK(ncclGroupStart() == ncclSuccess && ncclGroupEnd() == ncclSuccess);
    CHECK(ncclGroupEnd() == ncclInvalidUsage);
    if (failures == 0) printf("ok\n");
    return failures == 0 ? 0 : 1;
}
"#;

/// The directory holding this build's libnccl.so (next to this test, or one level up).
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("target/<profile>/deps").to_path_buf();
    let candidates = [deps.clone(), deps.parent().expect("target/<profile>").to_path_buf()];
    candidates.iter().find(|d| d.join("libnccl.so").exists()).cloned().unwrap_or_else(|| {
        panic!(
            "libnccl.so not found in {} or {}: is `cdylib` still in nccl/Cargo.toml's crate-type?",
            candidates[0].display(),
            candidates[1].display()
        )
    })
}

#[test]
fn an_nccl_program_in_c_links_and_gets_nccls_answers() {
    let dir = std::env::temp_dir().join(format!("gsc-nccl-c-abi-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (src, exe) = (dir.join("abi.c"), dir.join("abi"));
    std::fs::write(&src, PROGRAM).unwrap();
    // Installed as NVIDIA's is: the file under its soname (which the program records as
    // needed) beside the link-time name.
    let lib = dir.join("lib");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::copy(lib_dir().join("libnccl.so"), lib.join("libnccl.so.2")).unwrap();
    std::os::unix::fs::symlink("libnccl.so.2", lib.join("libnccl.so")).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let out = Command::new(&cc)
        .args(["-std=c99", "-Wall", "-Werror"])
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(&lib)
        .arg("-lnccl")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cc}: {e}"));
    assert!(out.status.success(), "compiling failed:\n{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let run = Command::new(&exe).output().unwrap();
    assert!(
        run.status.success(),
        "the C program failed:\n{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&run.stdout).trim(), "ok");
    let _ = std::fs::remove_dir_all(&dir);
}
