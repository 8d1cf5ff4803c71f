//! Build checks: include/gsc.h's version macros must equal the crate version, so a C program
//! never compiles against a header that describes another library. Also gives the shared
//! library its soname.

use std::process::exit;

fn header_macro(header: &str, name: &str) -> Option<String> {
    header.lines().find_map(|line| {
        let mut it = line.split_whitespace();
        match (it.next(), it.next(), it.next()) {
            (Some("#define"), Some(n), Some(v)) if n == name => Some(v.to_string()),
            _ => None,
        }
    })
}

/// The soname of libgscomm.so: `libgscomm.so.<major>`, or `libgscomm.so.0.<minor>` while the
/// major version is 0 (a minor release may break the ABI then), as cargo-c names them.
/// scripts/install.sh and tests/c_support compute the same name.
fn soname() -> String {
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").unwrap_or_default();
    let minor = std::env::var("CARGO_PKG_VERSION_MINOR").unwrap_or_default();
    if major == "0" { format!("libgscomm.so.0.{minor}") } else { format!("libgscomm.so.{major}") }
}

fn main() {
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        // Not `rustc-cdylib-link-arg`: cargo passes that one on to every package that depends
        // on this one (kept for compatibility), and it overrode nccl/'s libnccl.so.2 soname.
        // `rustc-link-arg` stays within this package; on its executables (tests, examples,
        // gsc-bench) a soname is inert.
        println!("cargo:rustc-link-arg=-Wl,-soname,{}", soname());
    }
    println!("cargo:rerun-if-changed=include/gsc.h");
    println!("cargo:rerun-if-changed=build.rs");
    let header = match std::fs::read_to_string("include/gsc.h") {
        Ok(h) => h,
        Err(e) => {
            eprintln!("error: cannot read include/gsc.h (the C API header): {e}");
            exit(1);
        }
    };
    let mut wrong = Vec::new();
    for part in ["MAJOR", "MINOR", "PATCH"] {
        let cargo = std::env::var(format!("CARGO_PKG_VERSION_{part}")).unwrap_or_default();
        let name = format!("GSC_VERSION_{part}");
        match header_macro(&header, &name) {
            Some(v) if v == cargo => {}
            Some(v) => wrong.push(format!("{name} is {v} in include/gsc.h but Cargo.toml's version gives {cargo}")),
            None => wrong.push(format!("include/gsc.h does not #define {name}")),
        }
    }
    if !wrong.is_empty() {
        for w in &wrong {
            println!("cargo:warning={w}");
        }
        eprintln!(
            "error: include/gsc.h's version macros disagree with Cargo.toml ({}):\n  {}\nUpdate GSC_VERSION_MAJOR/MINOR/PATCH in include/gsc.h together with the crate version.",
            std::env::var("CARGO_PKG_VERSION").unwrap_or_default(),
            wrong.join("\n  ")
        );
        exit(1);
    }
}
