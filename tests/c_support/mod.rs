//! Helpers of the tests that compile and run C programs against the library (c_api.rs,
//! install.rs): finding this build's libgscomm.so, compiling C99 with every warning an error,
//! and running processes under a hard time limit.
//!
//! Needs a C and a C++ compiler (`cc`, `c++`, or `CC`/`CXX`).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub const TIMEOUT: Duration = Duration::from_secs(60);

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The shared library's soname, as build.rs sets it: `libgscomm.so.<major>`, or
/// `libgscomm.so.0.<minor>` while the major version is 0 (where a minor release may break the
/// ABI), the convention cargo-c follows.
pub fn soname() -> String {
    match (env!("CARGO_PKG_VERSION_MAJOR"), env!("CARGO_PKG_VERSION_MINOR")) {
        ("0", minor) => format!("libgscomm.so.0.{minor}"),
        (major, _) => format!("libgscomm.so.{major}"),
    }
}

/// The directory holding the libgscomm.so of this build. `cargo test` builds the library with
/// all its crate types into target/<profile>/deps/ (this test's own directory) but copies it up
/// to target/<profile>/ only for `cargo build`; prefer the copy next to this test, which is
/// never stale, and fall back to target/<profile>/.
pub fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("target/<profile>/deps").to_path_buf();
    let candidates = [deps.clone(), deps.parent().expect("target/<profile>").to_path_buf()];
    let dir = candidates.iter().find(|d| d.join("libgscomm.so").exists()).cloned().unwrap_or_else(|| {
        panic!(
            "libgscomm.so not found in {} or {}: `cargo test` builds it with the library target; is `cdylib` still in Cargo.toml's crate-type?",
            candidates[0].display(),
            candidates[1].display()
        )
    });
    // Programs linked against it ask the loader for its soname, which cargo does not create:
    // a relative link beside it (what an install makes too). Tests race to make it; one wins.
    let link = dir.join(soname());
    if std::fs::symlink_metadata(&link).is_err() {
        let _ = std::os::unix::fs::symlink("libgscomm.so", &link);
    }
    dir
}

/// A fresh scratch directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gsc-c-api-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub fn cc() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".to_string())
}

pub fn cxx() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".to_string())
}

/// Compile a C99 program against include/gsc.h and libgscomm.so, with every warning an error.
pub fn build_c(src: &Path, exe: &Path) {
    let lib = lib_dir();
    let flags = [
        "-I".to_string(),
        root().join("include").display().to_string(),
        "-L".to_string(),
        lib.display().to_string(),
        "-lgscomm".to_string(),
        "-ldl".to_string(),
        format!("-Wl,-rpath,{}", lib.display()),
    ];
    compile_c(src, exe, &flags);
}

/// Compile a C99 program with `-std=c99 -Wall -Werror -pedantic` and `flags` (include and
/// library options).
pub fn compile_c(src: &Path, exe: &Path, flags: &[String]) {
    compile_c_sources(&[src], exe, flags)
}

/// `compile_c` of a program made of several sources.
pub fn compile_c_sources(srcs: &[&Path], exe: &Path, flags: &[String]) {
    // Sources first, libraries after them, as a linker that drops unused libraries needs.
    let (libs, rest): (Vec<&String>, Vec<&String>) =
        flags.iter().partition(|f| f.starts_with("-l") || f.starts_with("-Wl,") || f.ends_with(".a"));
    let out = Command::new(cc())
        .args(["-std=c99", "-Wall", "-Werror", "-pedantic"])
        .args(rest)
        .args(srcs)
        .arg("-o")
        .arg(exe)
        .args(libs)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", cc()));
    assert!(
        out.status.success(),
        "compiling {:?} failed:\n{}{}",
        srcs,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Start `cmd` with captured output.
pub fn spawn(cmd: &mut Command) -> std::process::Child {
    // cargo puts target/<profile> on LD_LIBRARY_PATH for tests, and LD_LIBRARY_PATH beats the
    // rpath: a stale target/<profile>/libgscomm.so from an earlier `cargo build` would be loaded
    // instead of the library this test linked against. Point the loader at that one only.
    cmd.env("LD_LIBRARY_PATH", lib_dir());
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn")
}

/// Wait for every child, killing all of them if any is still running after `TIMEOUT`.
/// Returns (name, success, output) per child.
pub fn wait_all(children: Vec<(&str, std::process::Child)>) -> Vec<(String, bool, String)> {
    let start = Instant::now();
    let mut children: Vec<(String, std::process::Child, Option<std::process::ExitStatus>)> =
        children.into_iter().map(|(n, c)| (n.to_string(), c, None)).collect();
    loop {
        for (_, c, status) in children.iter_mut() {
            if status.is_none() {
                *status = c.try_wait().expect("try_wait");
            }
        }
        if children.iter().all(|(_, _, s)| s.is_some()) {
            break;
        }
        if start.elapsed() > TIMEOUT {
            for (_, c, s) in children.iter_mut() {
                if s.is_none() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
            }
            let mut report = String::new();
            for (name, c, s) in children {
                let out = c
                    .wait_with_output()
                    .map(|o| String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr))
                    .unwrap_or_default();
                report += &format!("--- {name} ({}):\n{out}\n", if s.is_some() { "finished" } else { "killed" });
            }
            panic!("timed out after {TIMEOUT:?}; processes killed\n{report}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    children
        .into_iter()
        .map(|(name, c, s)| {
            let o = c.wait_with_output().expect("output");
            let text = String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
            (name, s.expect("finished").success(), text)
        })
        .collect()
}

/// Run `exe` as `n` ranks with the launcher-style bootstrap (rank 0 serves the rendezvous on a
/// free local port) and `env` on top; (name, success, output) per rank.
pub fn run_ranks(exe: &Path, n: usize, env: &[(&str, &str)]) -> Vec<(String, bool, String)> {
    run_ranks_with_args(exe, n, &[], env)
}

/// `run_ranks` with command-line arguments for every rank.
pub fn run_ranks_with_args(exe: &Path, n: usize, args: &[&str], env: &[(&str, &str)]) -> Vec<(String, bool, String)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let secret = format!("c-test-{}-{:?}", std::process::id(), Instant::now());
    let names: Vec<String> = (0..n).map(|r| format!("rank {r}")).collect();
    let children = (0..n)
        .map(|r| {
            let mut c = Command::new(exe);
            c.args(args)
                .env("GSC_RANK", r.to_string())
                .env("GSC_NRANKS", n.to_string())
                .env("GSC_BOOTSTRAP_ADDR", format!("127.0.0.1:{port}"))
                .env("GSC_BOOTSTRAP_SECRET", &secret)
                .env("GSC_BOOTSTRAP_TIMEOUT", "30s");
            for (k, v) in env {
                c.env(k, v);
            }
            spawn(&mut c)
        })
        .collect::<Vec<_>>();
    wait_all(names.iter().map(String::as_str).zip(children).collect())
}

/// Run examples/c/01_tag_pingpong built as `exe` as two ranks (launcher-style bootstrap: rank 0
/// serves the rendezvous on a free local port) and check that both pass their checks.
pub fn run_pingpong_ranks(exe: &Path) {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let secret = format!("c-test-{}-{:?}", std::process::id(), Instant::now());
    let rank = |r: &str| {
        let mut c = Command::new(exe);
        c.env("GSC_RANK", r)
            .env("GSC_NRANKS", "2")
            .env("GSC_BOOTSTRAP_ADDR", format!("127.0.0.1:{port}"))
            .env("GSC_BOOTSTRAP_SECRET", &secret)
            .env("GSC_BOOTSTRAP_TIMEOUT", "30s");
        spawn(&mut c)
    };
    let r0 = rank("0");
    let r1 = rank("1");
    let results = wait_all(vec![("rank 0", r0), ("rank 1", r1)]);
    for (name, ok, out) in &results {
        assert!(*ok, "{name} failed:\n{out}");
        assert!(out.contains("all checks passed"), "{name}:\n{out}");
    }
}

/// Run examples/c/02_prepared_halo built as `exe` as a single rank: with no GPU it must say it
/// skipped; with one, refuse a one-rank exchange with a clear message (the device runs it as
/// four ranks, see its README).
pub fn run_halo_alone(exe: &Path) {
    // A rendezvous for the one rank: with a GPU the example bootstraps before it counts ranks.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let out = Command::new(exe)
        .env("GSC_RANK", "0")
        .env("GSC_NRANKS", "1")
        .env("GSC_BOOTSTRAP_ADDR", format!("127.0.0.1:{port}"))
        .env("GSC_BOOTSTRAP_SECRET", format!("halo-alone-{}", std::process::id()))
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if text.contains("skipped: no CUDA driver") {
        eprintln!("halo example: {}", text.trim());
        assert!(out.status.success());
    } else {
        assert!(text.contains("needs at least 2 ranks"), "{text}");
    }
}

/// Run examples/c/00_init_info built as `exe`: it must succeed, name this library's version,
/// show the refused override and release what it made.
pub fn run_init_info(exe: &Path) {
    let results = wait_all(vec![("init_info", spawn(&mut Command::new(exe)))]);
    let (_, ok, out) = &results[0];
    assert!(*ok, "init_info failed:\n{out}");
    for want in [
        format!("gscomm {}", env!("CARGO_PKG_VERSION")),
        "GSC_TIMEOUT=\"soon\"".to_string(),
        "its address is".to_string(),
        "CUDA driver:".to_string(),
        "worker and context released".to_string(),
    ] {
        assert!(out.contains(&want), "init_info's output lacks {want:?}:\n{out}");
    }
}

/// Run examples/c/03_graph_sendrecv built as `exe` as its two ranks on host streams (`--host`,
/// what a machine without a GPU does anyway): every exchange of every size checked on both.
pub fn run_graph_sendrecv_on_host_streams(exe: &Path) {
    for (name, ok, out) in run_ranks_with_args(exe, 2, &["--host"], &[]) {
        assert!(ok, "{name} failed:\n{out}");
        assert!(out.contains("all checks passed (host stream)"), "{name}:\n{out}");
        assert_eq!(out.matches(": all checked").count(), 4, "{name}: one line per size expected:\n{out}");
    }
}

/// Run an example that needs GPUs (examples/c/04, 05, 06) built as `exe` as a single rank:
/// without a CUDA driver or GPU it must say it skipped and exit 0 (every rank of a real job
/// does the same); with one, refuse a one-rank job with a clear message (the device runs them
/// with examples/c/run_gpu.sh).
pub fn run_gpu_example_alone(exe: &Path) {
    let results = run_ranks(exe, 1, &[]);
    let (name, ok, out) = &results[0];
    if out.contains("skipped: ") {
        eprintln!("{}: {}", exe.display(), out.trim());
        assert!(*ok, "{name} skipped but failed:\n{out}");
    } else {
        assert!(!*ok && (out.contains("needs at least 2 ranks") || out.contains("needs exactly 2 ranks")), "{name}:\n{out}");
    }
}
