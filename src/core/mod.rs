//! The core objects: context (configuration, identity, memory registry), worker (progress
//! engine, request table), endpoint (a connection to a peer worker), memory handles and remote
//! keys, and the packed worker address.

pub mod address;
pub mod context;
mod device_mem;
pub mod endpoint;
mod gpu_rounds;
mod lock_watch;
pub mod memory;
mod prep_words;
pub mod prepared;
pub mod request;
pub mod request_area;
mod staging;
pub mod worker;

pub use address::WorkerAddress;
pub use context::Context;
pub use endpoint::{CloseMode, Endpoint};
pub use memory::{MapRequest, MemHandle, Rkey};
pub use prepared::{Direction, Engine, PrepareParams, Prepared};
pub use request::{Callback, RequestParams, Started};
pub use request_area::RequestAreaSpec;
pub use worker::{Completion, Worker, WorkerStats, worker_of_request};
