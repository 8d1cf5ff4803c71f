//! Communicators and NCCL-style collectives on the same machinery (issue #6).
//!
//! `Communicator` (comm.rs): ranks on the GPUs of one host, made over a bootstrap group, each
//! with a workspace every peer writes over NVLink. Collectives (all-reduce, all-gather,
//! reduce-scatter, broadcast, reduce) on NCCL's datatypes and operators (types.rs) run as
//! kernels on the caller's stream or as nodes of its graph (`cuda::coll`): small ones in one
//! round, larger ones in rounds of 64 KiB per rank. Not built yet: the bandwidth algorithms for
//! large messages, split/abort, groups, registration, and the NCCL-ABI library.

pub(crate) mod agreement;
pub mod comm;
pub mod select;
pub mod types;

pub use comm::Communicator;
pub use types::{DataType, RedOp};
