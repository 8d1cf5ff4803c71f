//! Conditions: when an operation starts and what waits for its completion.
//!
//! Every operation's request parameters have a condition slot. With no condition the operation
//! starts at once on the host (everything the core runtime does today). The categories below are
//! the seed's `ucp_condition_param_t`; each one arms a trigger in its own way (a stream memop, a
//! graph node, a word a kernel writes, a host queue) and is executed by the proxy (src/proxy/) or
//! the GPU (src/gda/). They are implemented by the conditions/proxy work (issue #3); until a
//! category is implemented, an operation that carries it fails with `Unsupported` naming the
//! category, and nothing is started.

use crate::error::{Error, Result};

/// The kind of a condition (`gsc_condition_category_t`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Category {
    /// A position in a CUDA stream (context: the CUstream).
    Stream,
    /// A node in a CUDA graph (context: the CUgraph the nodes are added to).
    Graph,
    /// A trigger fired by a user kernel through a device handle.
    KernelTriggered,
    /// An ordered host queue with stream semantics (for machines without GPUs and for CI).
    HostStream,
}

impl Category {
    pub fn name(self) -> &'static str {
        match self {
            Category::Stream => "stream",
            Category::Graph => "graph",
            Category::KernelTriggered => "kernel-triggered",
            Category::HostStream => "host stream",
        }
    }
}

/// A condition attached to an operation.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Condition {
    pub category: Category,
    /// The category's context (a CUstream, a CUgraph, ...), as an opaque address.
    pub context: usize,
}

/// Refuse a condition the runtime cannot execute yet, before anything is started.
pub(crate) fn ensure_supported(cond: &Option<Condition>) -> Result<()> {
    match cond {
        None => Ok(()),
        Some(c) => Err(Error::unsupported(format!(
            "{} conditions are not implemented in this build (operations start immediately on the host only)",
            c.category.name()
        ))),
    }
}
