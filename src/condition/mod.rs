//! Conditions: when an operation starts and what waits for its completion.
//!
//! Every operation's request parameters have a condition slot. With no condition the operation
//! starts at once on the calling thread. With one, the operation is *armed*: its producer (a CUDA
//! stream, a CUDA graph, a user kernel, a host stream) is given a write of a trigger word at the
//! operation's position, the worker's proxy (src/proxy/) starts the operation when the word
//! reaches it, and the operation's completion advances a done word the producer's later work
//! waits on. See `channel` for the words and why they only grow.
//!
//! Two shapes:
//! - *Sequenced* (stream, host stream): one channel per condition; operations are numbered in
//!   issue order and each runs once.
//! - *Persistent* (graph, kernel-triggered, and stream capture): one channel per operation; the
//!   device advances an epoch, and the operation runs again for every epoch, so an instantiated
//!   graph or a kernel loop can replay it any number of times.

mod channel;
mod host_stream;
mod words;

pub(crate) use channel::{Channel, DONE_ERROR_BIT, Signal};
pub use host_stream::HostStream;
pub(crate) use words::Words;

use crate::error::{Error, Result, Status};
use host_stream::Item;
use std::sync::{Arc, Mutex};

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

/// What an armed persistent operation hands back (graph nodes, a device handle).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ArmedOutputs {
    /// Graph conditions: the node that triggers the operation (wire its dependencies to it) and
    /// the node that completes when the operation did (wire later work after it). CUgraphNode.
    pub start_node: usize,
    pub done_node: usize,
    /// Kernel-triggered conditions: the device address of the `gsc_device_handle` a kernel passes
    /// to `gsc_trigger` / `gsc_wait`.
    pub device_handle: u64,
}

/// A condition (`gsc_condition_h`). Cloning gives another handle to the same condition.
#[derive(Clone)]
pub struct Condition {
    pub(crate) inner: Arc<CondInner>,
}

pub(crate) struct CondInner {
    category: Category,
    producer: Producer,
    /// Sequenced conditions: the one channel every operation on it shares.
    channel: Option<Arc<Channel>>,
    /// Persistent conditions: the channel of every operation armed on it (for `query`).
    armed: Mutex<Vec<Arc<Channel>>>,
}

enum Producer {
    Host(HostStream),
}

/// How the worker must arm an operation on this condition.
pub(crate) enum Issued {
    /// Operation `seq` of the condition's channel.
    Sequenced(Arc<Channel>, u64),
    /// A channel of its own, with what the caller gets back.
    Persistent(Arc<Channel>, ArmedOutputs),
}

impl Condition {
    /// A condition on a host stream: operations start in the stream's order.
    pub fn host_stream(stream: &HostStream) -> Condition {
        Condition::build(Category::HostStream, Producer::Host(stream.clone()), Some(Channel::new(Words::host())))
    }

    /// A condition of `category` on the CUDA object at `context` (a CUstream or CUgraph; ignored
    /// for kernel-triggered conditions).
    pub fn cuda(category: Category, context: usize) -> Result<Condition> {
        let _ = context;
        Err(Error::unsupported(format!("{} conditions need the CUDA driver, which this build cannot use yet", category.name())))
    }

    fn build(category: Category, producer: Producer, channel: Option<Arc<Channel>>) -> Condition {
        Condition { inner: Arc::new(CondInner { category, producer, channel, armed: Mutex::new(Vec::new()) }) }
    }

    pub fn category(&self) -> Category {
        self.inner.category
    }

    /// The first failure of any operation on this condition (sticky), or Ok.
    pub fn query(&self) -> Result<()> {
        if let Some(e) = self.inner.channel.as_ref().and_then(|c| c.error()) {
            return Err(e);
        }
        let armed = self.inner.armed.lock().unwrap_or_else(|e| e.into_inner());
        match armed.iter().find_map(|c| c.error()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Make the producer wait, at its current position, for every operation issued on this
    /// condition so far (for operations issued with `no_stream_wait`).
    pub fn wait(&self) -> Result<()> {
        let channel = self.sequenced_channel("wait")?;
        let issued = channel.issue.lock().unwrap_or_else(|e| e.into_inner());
        self.enqueue(&channel, None, Some(*issued))
    }

    fn sequenced_channel(&self, what: &str) -> Result<Arc<Channel>> {
        self.inner.channel.clone().ok_or_else(|| {
            Error::invalid_param(format!(
                "{what}: a {} condition has no stream order (each operation has its own nodes)",
                self.inner.category.name()
            ))
        })
    }

    /// Arm one operation: number it and give the producer its trigger (and, unless
    /// `stream_wait` is false, the wait for its completion). Nothing is changed on error.
    pub(crate) fn issue(&self, stream_wait: bool) -> Result<Issued> {
        match &self.inner.channel {
            Some(channel) => {
                let mut issued = channel.issue.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(e) = channel.error() {
                    return Err(e.context("the condition failed earlier; no further operation is issued on it"));
                }
                let seq = *issued + 1;
                self.enqueue(channel, Some(seq), stream_wait.then_some(seq))?;
                *issued = seq;
                Ok(Issued::Sequenced(channel.clone(), seq))
            }
            None => Err(Error::new(Status::Internal, "persistent conditions are armed by their producer")),
        }
    }

    /// Put a trigger write and/or a done wait on the producer.
    fn enqueue(&self, channel: &Arc<Channel>, trigger: Option<u64>, wait: Option<u64>) -> Result<()> {
        match &self.inner.producer {
            Producer::Host(stream) => {
                let items = trigger.map(|k| Item::Trigger(channel.clone(), k)).into_iter();
                stream.push_all(items.chain(wait.map(|k| Item::Wait(channel.clone(), k))));
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests;
