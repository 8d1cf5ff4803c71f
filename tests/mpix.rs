//! The MPIX stream-enqueue layer (mpix/, issue #9), built as C99 with every warning an error
//! against include/gsc.h and this build's libgscomm.so, run as 2 and 3 ranks on gscomm host
//! streams (`GSC_MPIX_HOST=1`): a stream-ordered ping-pong at 4 KiB and 1 MiB, non-blocking
//! sends and receives around a ring with the waits enqueued, and the refusals (a status to
//! fill, a rank out of range, a collective on a host stream). The CUDA-stream run (the same
//! program, plus the stream-ordered all-reduce) is the device's: see mpix/README.md.
//!
//! Needs a C compiler (`cc`, or `CC`).

mod c_support;

use c_support::{compile_c_sources, lib_dir, root, run_ranks, scratch};

fn build() -> std::path::PathBuf {
    let dir = scratch("mpix");
    let exe = dir.join("test_mpix");
    let lib = lib_dir();
    let flags = [
        format!("-I{}", root().join("include").display()),
        format!("-I{}", root().join("mpix").display()),
        format!("-L{}", lib.display()),
        "-lgscomm".to_string(),
        "-ldl".to_string(),
        format!("-Wl,-rpath,{}", lib.display()),
    ];
    let srcs = [root().join("mpix/gsc_mpix.c"), root().join("mpix/test_mpix.c")];
    compile_c_sources(&[&srcs[0], &srcs[1]], &exe, &flags);
    exe
}

#[test]
fn enqueued_ping_pong_ring_and_waits_on_host_streams() {
    let exe = build();
    for n in [2, 3] {
        for (name, ok, out) in run_ranks(&exe, n, &[("GSC_MPIX_HOST", "1"), ("GSC_TIMEOUT", "30s")]) {
            assert!(ok, "{n} ranks: {name} failed:\n{out}");
            assert!(out.contains(&format!("of {n}: ok (host stream")), "{n} ranks: {name}:\n{out}");
        }
    }
}
