//! The shared library answers to NCCL's soname, so a program linked against NVIDIA's
//! libnccl.so.2 loads this one when it comes first on the library path.
//!
//! `-Bsymbolic-functions`: calls between the library's own functions bind inside it, as
//! NVIDIA's internal calls do. A profiling tool that interposes `ncclX` and calls `pncclX`
//! (src/profiling.rs) then reaches the implementation, not its own `ncclX` again.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl.so.2");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic-functions");
}
