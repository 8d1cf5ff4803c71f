//! docs/C_API.md is generated from include/gsc.h by scripts/gen-capi-doc.py; this test fails
//! when the committed file is not what the script writes from the current header (a header
//! change without a regenerated reference, or a hand edit of the reference).
//!
//! Needs `python3` (standard library only); without it the test says so and passes. No network,
//! no GPU: the script reads the header and writes a temporary file.

use std::path::{Path, PathBuf};
use std::process::Command;

const REGENERATE: &str = "run `python3 scripts/gen-capi-doc.py` and commit docs/C_API.md";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn python3_available() -> bool {
    Command::new("python3").arg("--version").output().map(|o| o.status.success()).unwrap_or(false)
}

/// A scratch file name of this process (removed by the test).
fn scratch() -> PathBuf {
    std::env::temp_dir().join(format!("gscomm-capi-doc-{}.md", std::process::id()))
}

#[test]
fn c_api_reference_is_generated_from_the_header() {
    if !python3_available() {
        println!("skipped: python3 is not on PATH, so scripts/gen-capi-doc.py cannot run here");
        return;
    }
    let out = scratch();
    let run = Command::new("python3")
        .arg(root().join("scripts/gen-capi-doc.py"))
        .arg("--header")
        .arg(root().join("include/gsc.h"))
        .arg("--output")
        .arg(&out)
        .output()
        .expect("run python3");
    let generated = std::fs::read_to_string(&out);
    let _ = std::fs::remove_file(&out);
    assert!(
        run.status.success(),
        "scripts/gen-capi-doc.py failed ({}):\n{}{}",
        run.status,
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    let generated = generated.expect("the script wrote no output file");
    let committed = std::fs::read_to_string(root().join("docs/C_API.md"))
        .unwrap_or_else(|e| panic!("docs/C_API.md cannot be read ({e}): {REGENERATE}"));
    if generated == committed {
        return;
    }
    // Say where they part, so the reader sees what changed without diffing by hand.
    let (g, c): (Vec<&str>, Vec<&str>) = (generated.lines().collect(), committed.lines().collect());
    let at = g.iter().zip(&c).position(|(a, b)| a != b).unwrap_or(g.len().min(c.len()));
    panic!(
        "docs/C_API.md is out of date with include/gsc.h: {REGENERATE}.\n\
         First difference at line {}:\n  generated: {:?}\n  committed: {:?}",
        at + 1,
        g.get(at).copied().unwrap_or("<end of file>"),
        c.get(at).copied().unwrap_or("<end of file>"),
    );
}

/// Same input, same bytes: the reference must not depend on anything but the header.
#[test]
fn c_api_reference_is_deterministic() {
    if !python3_available() {
        println!("skipped: python3 is not on PATH, so scripts/gen-capi-doc.py cannot run here");
        return;
    }
    let run = || {
        let out = Command::new("python3")
            .arg(root().join("scripts/gen-capi-doc.py"))
            .args(["--output", "-"])
            .env("PYTHONHASHSEED", "random")
            .output()
            .expect("run python3");
        assert!(out.status.success(), "scripts/gen-capi-doc.py failed:\n{}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    };
    assert!(run() == run(), "two runs of scripts/gen-capi-doc.py wrote different output");
}
