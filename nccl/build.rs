//! The shared library answers to NCCL's soname, so a program linked against NVIDIA's
//! libnccl.so.2 loads this one when it comes first on the library path.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl.so.2");
}
