//! GPU-initiated execution (issue #5): the GPU, not the proxy thread, moves the data.
//!
//! What exists:
//! - `verbs`: the mlx5 verbs engine's pieces — rdma-core loaded at run time (bindgen bindings,
//!   device discovery for `gsc-info`, PD/MR/dmabuf/CQ/QP wrappers), byte-exact WQE, doorbell and
//!   CQE encodings, a send ring whose doorbells a stream can ring, a CQ reader with the stream's
//!   wait word, and the GPUDirect RDMA flush sequence. Unit-tested without a NIC; not yet wired
//!   into endpoints and not yet run on RDMA hardware (docs/GDA.md lists exactly what has not).
//!
//! The NVLink engine — prepared transfers whose rounds the GPU runs itself — lives with the
//! prepared transfers (src/core/gpu_rounds.rs, the kernels in src/cuda and
//! include/gsc_device.cuh); which engine runs a transfer is the table's choice
//! (`protocols::select::prepared_engine`, `GSC_ENGINE`).

pub mod verbs;
