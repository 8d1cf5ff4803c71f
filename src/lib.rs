//! gscomm: a GPU communication runtime in which every operation carries a *condition* (a CUDA
//! stream position, a graph node, a kernel trigger or a host stream), is *prepared* ahead of time
//! and is executed by a proxy thread or by the GPU itself. See docs/ARCHITECTURE.md.
//!
//! Layers, bottom to top: `transport` (lanes), `protocols` (matching and protocol state machines,
//! no I/O), `core` (context, worker, endpoint, memory, requests), `capi` (the C ABI).

pub mod bootstrap;
pub mod collectives;
pub mod condition;
pub mod config;
pub mod core;
pub mod cuda;
pub(crate) mod dynlib;
pub mod error;
#[doc(hidden)]
pub mod fuzz;
pub mod gda;
pub mod log;
pub mod protocols;
pub mod proxy;
pub mod transport;

mod capi;

pub use crate::config::Config;
pub use crate::core::*;
/// Device memory from gscomm's allocator (CUDA VMM, shareable with peer processes; see
/// `cuda::api::mem_alloc`), independent of any communicator.
pub use crate::cuda::api::{MemAllocInfo, mem_alloc, mem_alloc_info, mem_free};
pub use crate::error::{Error, Result, Status};

/// The crate version, from Cargo.toml (the C macros in include/gsc.h are checked against it).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
