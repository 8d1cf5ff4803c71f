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
ncclResult_t ncclCommWindowRegister(ncclComm_t comm, void *buff, size_t size, void **win, int winFlags);
ncclResult_t ncclCommWindowDeregister(ncclComm_t comm, void *win);
ncclResult_t ncclGroupSimulateEnd(void *simInfo);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);
ncclResult_t pncclGetVersion(int *version);
ncclResult_t pncclCommCount(const ncclComm_t comm, int *count);
const char *pncclGetLastError(ncclComm_t comm);
void ncclResetDebugInit(void);

/* nccl.h 2.28's profiling names, each declared only to be linked: a missing one fails the link. */
#define PROFILING_NAMES(X) X(pncclAllGather) X(pncclAllReduce) X(pncclAlltoAll) X(pncclBcast) X(pncclBroadcast) \
    X(pncclCommAbort) X(pncclCommCount) X(pncclCommCuDevice) X(pncclCommDeregister) X(pncclCommDestroy) \
    X(pncclCommFinalize) X(pncclCommGetAsyncError) X(pncclCommInitAll) X(pncclCommInitRank) \
    X(pncclCommInitRankConfig) X(pncclCommInitRankScalable) X(pncclCommRegister) X(pncclCommRevoke) \
    X(pncclCommShrink) X(pncclCommSplit) X(pncclCommUserRank) X(pncclCommWindowDeregister) \
    X(pncclCommWindowRegister) X(pncclGather) X(pncclGetErrorString) X(pncclGetLastError) X(pncclGetUniqueId) \
    X(pncclGetVersion) X(pncclGroupEnd) X(pncclGroupSimulateEnd) X(pncclGroupStart) X(pncclMemAlloc) \
    X(pncclMemFree) X(pncclRecv) X(pncclRedOpCreatePreMulSum) X(pncclRedOpDestroy) X(pncclReduce) \
    X(pncclReduceScatter) X(pncclResetDebugInit) X(pncclScatter) X(pncclSend)
#define DECLARE(name) void name##_linked(void) __asm__(#name);
PROFILING_NAMES(DECLARE)
#define ENTRY(name) name##_linked,
static void (*const profiling_names[])(void) = { PROFILING_NAMES(ENTRY) };

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
    CHECK(ncclGroupSimulateEnd(NULL) == ncclInvalidUsage);
    CHECK(strstr(ncclGetLastError(NULL), "ncclGroupSimulateEnd is not supported") != NULL);
    void *win = &n;
    CHECK(ncclCommWindowRegister(NULL, NULL, 0, &win, 1) == ncclInvalidArgument && win == &n);
    CHECK(strstr(ncclGetLastError(NULL), "ncclCommWindowRegister: comm is NULL") != NULL);
    CHECK(ncclCommWindowDeregister(NULL, NULL) == ncclInvalidArgument);
    CHECK(ncclGroupStart() == ncclSuccess && ncclGroupEnd() == ncclSuccess);
    CHECK(ncclGroupEnd() == ncclInvalidUsage);
    /* The profiling names are the functions. */
    v = 0;
    CHECK(pncclGetVersion(&v) == ncclSuccess && v == 22809);
    CHECK(pncclCommCount(NULL, &n) == ncclInvalidArgument && strstr(pncclGetLastError(NULL), "comm is NULL") != NULL);
    for (size_t i = 0; i < sizeof profiling_names / sizeof profiling_names[0]; i++) CHECK(profiling_names[i] != NULL);
    ncclResetDebugInit();
    CHECK(strstr(ncclGetLastError(NULL), "ncclResetDebugInit is not supported") != NULL);
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

/// A profiling tool, as PMPI's are written: it defines two of nccl.h's functions, counts the
/// calls, and forwards each to the profiling name.
const TOOL: &str = r#"
typedef int ncclResult_t;
typedef struct ncclComm *ncclComm_t;
ncclResult_t pncclGetVersion(int *version);
ncclResult_t pncclCommCount(const ncclComm_t comm, int *count);
static int calls = 0;
int tool_calls(void) { return calls; }
ncclResult_t ncclGetVersion(int *version) { calls++; return pncclGetVersion(version); }
ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) { calls++; return pncclCommCount(comm, count); }
"#;

/// Two ids from ncclGetUniqueId: "same" or "different" (or the error, named).
const ID_PROGRAM: &str = r#"
#include <stdio.h>
#include <string.h>
typedef int ncclResult_t;
typedef struct ncclComm *ncclComm_t;
typedef struct { char internal[128]; } ncclUniqueId;
ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId);
const char *ncclGetLastError(ncclComm_t comm);
int main(void) {
    ncclUniqueId a, b;
    ncclResult_t r = ncclGetUniqueId(&a);
    if (r != 0) { printf("error %d: %s\n", r, ncclGetLastError(NULL)); return 0; }
    if (ncclGetUniqueId(&b) != 0) return 1;
    printf(memcmp(&a, &b, sizeof a) == 0 ? "same\n" : "different\n");
    return 0;
}
"#;

/// A program the tool is linked into ahead of the library.
const TOOL_PROGRAM: &str = r#"
#include <stdio.h>
typedef int ncclResult_t;
typedef struct ncclComm *ncclComm_t;
ncclResult_t ncclGetVersion(int *version);
ncclResult_t ncclCommCount(const ncclComm_t comm, int *count);
int tool_calls(void);
int main(void) {
    int v = 0, n = -1;
    int ok = ncclGetVersion(&v) == 0 && v == 22809 && tool_calls() == 1;
    ok = ok && ncclCommCount(NULL, &n) == 4 && n == -1 && tool_calls() == 2;
    if (ok) printf("ok\n"); else printf("version %d, %d calls seen by the tool\n", v, tool_calls());
    return ok ? 0 : 1;
}
"#;

/// A directory of its own, with this build's library installed as NVIDIA's is: the file under
/// its soname (which programs record as needed) beside the link-time name.
struct Install {
    dir: PathBuf,
    lib: PathBuf,
}

impl Install {
    fn new(tag: &str) -> Install {
        let dir = std::env::temp_dir().join(format!("gsc-nccl-c-abi-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let lib = dir.join("lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::copy(lib_dir().join("libnccl.so"), lib.join("libnccl.so.2")).unwrap();
        std::os::unix::fs::symlink("libnccl.so.2", lib.join("libnccl.so")).unwrap();
        Install { dir, lib }
    }

    /// Compile C `source` into `name` (a program, or a shared library with `-shared`), linked
    /// with `libs` (`-l` names, in order) from the install's lib directory.
    fn cc(&self, source: &str, name: &str, flags: &[&str], libs: &[&str]) -> PathBuf {
        let (src, out) = (self.dir.join(format!("{name}.c")), self.dir.join(name));
        std::fs::write(&src, source).unwrap();
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
        let run = Command::new(&cc)
            .args(["-std=c99", "-Wall", "-Werror"])
            .args(flags)
            .arg(&src)
            .arg("-o")
            .arg(&out)
            .arg("-L")
            .arg(&self.lib)
            .args(libs.iter().map(|l| format!("-l{l}")))
            .arg(format!("-Wl,-rpath,{}", self.lib.display()))
            .output()
            .unwrap_or_else(|e| panic!("cannot run {cc}: {e}"));
        assert!(
            run.status.success(),
            "compiling {name} failed:\n{}{}",
            String::from_utf8_lossy(&run.stdout),
            String::from_utf8_lossy(&run.stderr)
        );
        out
    }

    /// Run `exe` with `env` added; its standard output, after asserting it printed "ok".
    fn run_ok(&self, exe: &PathBuf, env: &[(&str, String)]) {
        let run = Command::new(exe).envs(env.iter().map(|(k, v)| (*k, v))).output().unwrap();
        let (stdout, stderr) = (String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
        assert!(run.status.success() && stdout.trim() == "ok", "{} failed ({}):\n{stdout}{stderr}", exe.display(), run.status);
    }
}

impl Drop for Install {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn an_nccl_program_in_c_links_and_gets_nccls_answers() {
    let install = Install::new("abi");
    let exe = install.cc(PROGRAM, "abi", &[], &["nccl"]);
    install.run_ok(&exe, &[]);
}

/// The tool's `ncclX` is what the program calls; its `pncclX` reaches the library, and the
/// library's `pncclX` does not come back to the tool's `ncclX` (one count per call, no loop).
#[test]
fn a_profiling_tool_interposes_nccl_names_and_calls_the_profiling_ones() {
    let install = Install::new("tool");
    install.cc(TOOL, "lib/libtool.so", &["-shared", "-fPIC"], &["nccl"]);
    let exe = install.cc(TOOL_PROGRAM, "profiled", &[], &["tool", "nccl"]);
    install.run_ok(&exe, &[]);
}

/// NCCL_COMM_ID: every call (so every process) gives the same id, the address's; a bad value
/// is ncclInvalidArgument, named. Without it each id is new (a root of its own).
#[test]
fn nccl_comm_id_gives_every_process_the_same_id() {
    let install = Install::new("commid");
    let exe = install.cc(ID_PROGRAM, "ids", &[], &["nccl"]);
    let out = |env: &[(&str, &str)]| {
        let run = Command::new(&exe).envs(env.iter().copied()).env_remove("GSC_BOOTSTRAP_SECRET").output().unwrap();
        assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
        String::from_utf8_lossy(&run.stdout).trim().to_string()
    };
    assert_eq!(out(&[("NCCL_COMM_ID", "127.0.0.1:29533")]), "same");
    assert_eq!(out(&[]), "different");
    let bad = out(&[("NCCL_COMM_ID", "127.0.0.1")]);
    assert!(bad.starts_with("error 4:") && bad.contains("NCCL_COMM_ID"), "{bad}");
}

/// NCCL_DEBUG and NCCL_DEBUG_FILE start the log (at ncclGetUniqueId, as NVIDIA's do), unless
/// GSC_LOG_LEVEL says otherwise; without them nothing is written at info level.
#[test]
fn nccl_debug_switches_start_the_log() {
    let install = Install::new("debug");
    let exe = install.cc(PROGRAM, "abi", &[], &["nccl"]);
    let pattern = install.dir.join("log.%p").display().to_string();
    let logged = |env: &[(&str, String)]| -> String {
        for old in std::fs::read_dir(&install.dir).unwrap().flatten() {
            if old.file_name().to_string_lossy().starts_with("log.") {
                std::fs::remove_file(old.path()).unwrap();
            }
        }
        install.run_ok(&exe, env);
        let mut text = String::new();
        for file in std::fs::read_dir(&install.dir).unwrap().flatten() {
            if file.file_name().to_string_lossy().starts_with("log.") {
                text += &std::fs::read_to_string(file.path()).unwrap();
            }
        }
        text
    };
    let file = ("NCCL_DEBUG_FILE", pattern.clone());
    let info = logged(&[("NCCL_DEBUG", "INFO".into()), file.clone()]);
    assert!(info.contains("as libnccl.so.2 (NCCL 2.28.9's API)"), "NCCL_DEBUG=INFO logged:\n{info}");
    // The deprecated reset says it changes nothing, at warning level.
    assert!(info.contains("ncclResetDebugInit is not supported"), "{info}");
    let warn = logged(&[("NCCL_DEBUG", "WARN".into()), file.clone()]);
    assert!(!warn.contains("as libnccl.so.2") && warn.contains("ncclResetDebugInit"), "NCCL_DEBUG=WARN logged:\n{warn}");
    let quiet = logged(&[("NCCL_DEBUG", "INFO".into()), ("GSC_LOG_LEVEL", "error".into()), file]);
    assert!(quiet.is_empty(), "GSC_LOG_LEVEL=error beside NCCL_DEBUG=INFO logged:\n{quiet}");
}
