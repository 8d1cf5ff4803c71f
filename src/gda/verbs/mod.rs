//! The verbs GDA engine: GPU-initiated RDMA on mlx5 (ConnectX) NICs, and the GPUDirect RDMA
//! flush. See docs/GDA.md.
//!
//! The GPU cannot call verbs. So at prepare time the host writes the work queue entries (WQEs)
//! of an operation straight into the send ring of a queue pair, and the stream later does only
//! what memory operations can: store the doorbell record and the 8-byte UAR doorbell
//! (`cuStreamWriteValue32/64`, the UAR page mapped with `CU_MEMHOSTREGISTER_IOMEMORY`), then wait
//! on the owner bit of the completion entry (`cuStreamWaitValue32`). That needs the hardware's
//! own formats, which is why this engine writes WQEs and reads CQEs itself instead of going
//! through `ibv_post_send`/`ibv_poll_cq`.
//!
//! Pieces, bottom to top:
//! - `sys`: bindgen-generated libibverbs/mlx5dv declarations (functions as pointer types).
//! - `loader`: `dlopen` of libibverbs.so.1 / libmlx5.so.1 and the thin safe layer (context,
//!   PD, MR incl. dmabuf, CQ, RC QP, the mlx5 ring/doorbell views, `VerbsFlushMemory`). All the
//!   engine's `unsafe` is there.
//! - `mlx5`: byte-exact WQE segments, doorbell values and CQE decoding.
//! - `queue`: `SendQueue` (ring, producer counter, doorbells) and `CompletionQueue` (owner bit,
//!   consumer counter, stream waits) over caller-provided buffers.
//! - `flush`: the flush sequence (`Flush`, events in, actions out) and its buffers.
//! - `discover`: what `gsc-info` prints about RDMA devices (`discover::report()`).
//!
//! Everything except `loader` is pure and unit-tested without a NIC, a GPU or rdma-core. What
//! has not run on hardware is listed in docs/GDA.md.

pub mod discover;
pub mod flush;
pub mod loader;
pub mod mlx5;
pub mod queue;
pub mod sys;

pub use discover::{Discovery, discover, report};
pub use flush::{Flush, FlushAction, FlushBuffers, FlushConfig, FlushMemory, FlushMode};
pub use queue::{
    CompletionQueue, CqeWait, Doorbell, LocalSge, RemoteRef, SendQueue, SendQueueShape, StreamOp, WaitCondition, WorkOp, WorkRequest,
    stream_ops,
};
