//! Communicators and NCCL-style collectives on the same machinery (issue #6).
//!
//! `Communicator` (comm.rs): ranks on the GPUs of one host, made over a bootstrap group, each
//! with a workspace every peer writes over NVLink. Collectives (all-reduce, all-gather,
//! reduce-scatter, broadcast, reduce) on NCCL's datatypes and operators (types.rs) run as
//! kernels on the caller's stream or as nodes of its graph (`cuda::coll`), or are started by a
//! user kernel's trigger (triggered.rs): small ones in one
//! round, larger ones in rounds of 64 KiB per rank, large ones by the kernels whose geometry
//! large.rs computes. Send/recv between ranks (p2p.rs) go through
//! the point-to-point engine on a worker of the communicator's own. `HostComm` (host.rs): the
//! same collectives on host memory between ranks on any hosts, over the point-to-point engine
//! (UCX between hosts). `NetComm` (net.rs): collectives on GPU buffers between ranks on several
//! hosts — hierarchical: NVLink kernels inside a host, the point-to-point engine between hosts.
//! The NCCL-ABI library is the workspace member nccl/.

pub(crate) mod agreement;
pub(crate) mod ce_ring;
pub mod comm;
pub(crate) mod copy_engine;
pub(crate) mod direct;
pub mod fp8;
pub mod host;
mod host_board;
pub mod large;
pub mod net;
pub mod p2p;
pub mod p2p_kernel;
pub(crate) mod peer_buffers;
pub mod select;
pub(crate) mod settings;
pub mod together;
mod triggered;
pub mod types;
pub mod windows;

pub use comm::{Communicator, PremulKind, Registration};
pub use host::HostComm;
pub use net::{GroupPlan, NetComm};
pub use p2p::PeerOp;
pub use p2p_kernel::PeerTransfer;
pub use together::{Coll, RankCall, issue_group, issue_together};
pub use types::{DataType, PreMulScalar, RedOp};
pub use windows::Window;

/// Compile the collective kernels for `device` (or find them in the kernel cache,
/// `GSC_KERNEL_CACHE_DIR`) and load them. A communicator does this when it is made; a program that
/// starts several ranks at once on a machine whose cache is cold can call it once first, so the
/// ranks find the kernels compiled instead of each compiling them (NVRTC takes tens of seconds
/// for the whole set).
pub fn prepare_kernels(device: i32, config: &crate::config::Config) -> crate::error::Result<()> {
    crate::cuda::init().map_err(|e| e.context("collectives need the CUDA driver"))?;
    crate::cuda::coll::preload(device, config.kernel_cache_dir.as_deref())
}

/// A collective's buffer must be GPU memory of the rank's own device: a named error otherwise,
/// before anything is issued (`what`: "send", "receive").
pub(crate) fn check_device_buffer(addr: u64, device: i32, what: &str) -> crate::error::Result<()> {
    use crate::error::Error;
    if addr == 0 {
        return Err(Error::invalid_param(format!("a null {what} buffer")));
    }
    match crate::cuda::memory::device_ptr(addr as usize)? {
        Some(p) if p.device == device => Ok(()),
        Some(p) => Err(Error::invalid_param(format!("the {what} buffer is on GPU {}, the communicator's rank on GPU {device}", p.device))),
        None => Err(Error::invalid_param(format!("the {what} buffer is not GPU memory (collectives move GPU buffers)"))),
    }
}
