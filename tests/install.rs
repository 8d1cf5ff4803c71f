//! Installing for C users (issue #9): scripts/install.sh (what `make install` runs) puts the
//! libraries, headers and gscomm.pc into a temporary prefix; every example under examples/c
//! then builds against the *installed* files through `pkg-config --cflags --libs gscomm` with
//! `-std=c99 -Wall -Werror -pedantic`, and runs: the CPU ones in full (00, 01, 03 on host
//! streams), the GPU ones to check that they skip cleanly without a GPU (examples/c/run_gpu.sh
//! runs them on the device). The shared library exports only
//! `gsc_` symbols, and a static link through `pkg-config --static` works too.
//!
//! The libraries come from this `cargo test` run (c_support::lib_dir), so the test needs no
//! nested cargo build. Needs `cc`, `pkg-config` and `nm` (binutils).

mod c_support;

use c_support::{
    compile_c, lib_dir, root, run_gpu_example_alone, run_graph_sendrecv_on_host_streams, run_halo_alone, run_init_info, run_pingpong_ranks,
    scratch, soname,
};
use std::path::{Path, PathBuf};
use std::process::Command;

/// `pkg-config <args> gscomm` against the prefix's .pc file, split into arguments.
fn pkg_config(prefix: &Path, args: &[&str]) -> Vec<String> {
    let out = Command::new("pkg-config")
        .args(args)
        .arg("gscomm")
        .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig"))
        .output()
        .unwrap_or_else(|e| panic!("cannot run pkg-config: {e}"));
    assert!(out.status.success(), "pkg-config {args:?} gscomm: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().split_whitespace().map(str::to_string).collect()
}

fn install_into(prefix: &Path) {
    let out = Command::new("sh")
        .arg(root().join("scripts/install.sh"))
        .arg("--prefix")
        .arg(prefix)
        .arg("--from")
        .arg(lib_dir())
        .output()
        .expect("run scripts/install.sh");
    assert!(out.status.success(), "install.sh failed:\n{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
}

/// The example directories under examples/c, each with exactly one .c file.
fn examples() -> Vec<(String, PathBuf)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(root().join("examples/c")).unwrap() {
        let dir = entry.unwrap().path();
        if !dir.is_dir() {
            continue;
        }
        let sources: Vec<PathBuf> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|x| x == "c")).collect();
        assert_eq!(sources.len(), 1, "{} should hold one C source", dir.display());
        assert!(dir.join("README.md").exists(), "{} has no README.md", dir.display());
        found.push((dir.file_name().unwrap().to_string_lossy().into_owned(), sources[0].clone()));
    }
    found.sort();
    assert!(found.len() >= 2, "examples/c lost its examples: {found:?}");
    found
}

#[test]
fn installed_library_builds_and_runs_the_c_examples_through_pkg_config() {
    let dir = scratch("install");
    let prefix = dir.join("prefix");
    install_into(&prefix);

    // The files, and the link chain a program's loader follows: libgscomm.so (for -lgscomm)
    // -> the soname (what programs record) -> the versioned file.
    let lib = prefix.join("lib");
    let versioned = format!("libgscomm.so.{}", env!("CARGO_PKG_VERSION"));
    assert!(lib.join(&versioned).is_file());
    assert_eq!(std::fs::read_link(lib.join(soname())).unwrap(), PathBuf::from(&versioned));
    assert_eq!(std::fs::read_link(lib.join("libgscomm.so")).unwrap(), PathBuf::from(soname()));
    for f in ["lib/libgscomm.a", "include/gsc.h", "include/gsc_device.cuh", "lib/pkgconfig/gscomm.pc"] {
        assert!(prefix.join(f).is_file(), "{f} not installed");
    }
    assert_eq!(pkg_config(&prefix, &["--modversion"]), [env!("CARGO_PKG_VERSION")]);

    // Only the C API is exported from the shared library.
    let nm = Command::new("nm").args(["-D", "--defined-only"]).arg(lib.join(&versioned)).output().expect("run nm");
    assert!(nm.status.success());
    let symbols = String::from_utf8_lossy(&nm.stdout);
    let foreign: Vec<&str> = symbols.lines().filter_map(|l| l.split_whitespace().nth(2)).filter(|s| !s.starts_with("gsc_")).collect();
    assert!(foreign.is_empty(), "exported symbols outside the C API: {foreign:?}");
    assert!(symbols.contains(" gsc_init"), "the C API is not exported:\n{symbols}");

    // Every example, against the installed header and library only.
    let mut flags = pkg_config(&prefix, &["--cflags", "--libs"]);
    flags.push(format!("-Wl,-rpath,{}", lib.display()));
    for (name, src) in examples() {
        let exe = dir.join(&name);
        compile_c(&src, &exe, &flags);
        match name.as_str() {
            "00_init_info" => run_init_info(&exe),
            "01_tag_pingpong" => run_pingpong_ranks(&exe),
            "02_prepared_halo" => run_halo_alone(&exe),
            "03_graph_sendrecv" => run_graph_sendrecv_on_host_streams(&exe),
            // GPU only: they must skip cleanly here; examples/c/run_gpu.sh runs them on GPUs.
            "04_partitioned_pready"
            | "05_allreduce"
            | "06_graph_broadcast"
            | "07_triggered_allreduce"
            | "08_alltoall"
            | "09_split_shrink" => run_gpu_example_alone(&exe),
            other => panic!("example {other}: say here how CI runs it (or that it needs a GPU and must skip)"),
        }
    }

    // A static link: the archive plus what `--static` lists for the Rust runtime.
    let mut static_flags = pkg_config(&prefix, &["--cflags"]);
    static_flags.push(lib.join("libgscomm.a").display().to_string());
    static_flags.extend(pkg_config(&prefix, &["--static", "--libs"]).into_iter().filter(|f| f != "-lgscomm"));
    let exe = dir.join("pingpong-static");
    compile_c(&root().join("examples/c/01_tag_pingpong/pingpong.c"), &exe, &static_flags);
    run_pingpong_ranks(&exe);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn install_script_refuses_bad_arguments_and_changes_nothing() {
    let dir = scratch("install-bad");
    let run = |args: &[&str]| Command::new("sh").arg(root().join("scripts/install.sh")).args(args).output().unwrap();
    let out = run(&["--prefix", "relative/dir"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("absolute"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = run(&["--bogus"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown argument '--bogus'"));
    let prefix = dir.join("prefix");
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let out = run(&["--prefix", prefix.to_str().unwrap(), "--from", empty.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("libgscomm.so not found"));
    assert!(!prefix.exists(), "a refused install must not create the prefix");
    let _ = std::fs::remove_dir_all(&dir);
}
