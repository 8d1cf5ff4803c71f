//! Staged operations: a small GPU message of a stream or graph operation travels through a
//! page-locked slot that gscomm's own kernels fill (sends, before the trigger) or empty
//! (receives, after the wait), so the proxy moves it like host memory (see `cuda::stage`).
//!
//! What is staged: operations on GPU memory of 1 byte to `GSC_CUDA_STAGE_MAX`, on a stream (also
//! under capture) or a graph condition, where gscomm owns the nodes around the operation.
//! Kernel-triggered operations are not: the user's kernel triggers and waits itself.
//!
//! A staged receive writes the user's buffer in the wait that covers it: its own stream wait,
//! the condition's next `wait` for one issued with `no_stream_wait`, or its graph done node. Its
//! request completing on the host means the message arrived, not that the buffer holds it yet.

use crate::cuda::{OpDesc, StageSlot};

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum StageDir {
    /// The trigger copies the user's buffer into the slot.
    Send,
    /// The wait copies what arrived in the slot into the user's buffer.
    Recv,
}

/// One staged operation: its slot and the user's GPU buffer behind it.
pub(crate) struct Stage {
    slot: StageSlot,
    pub(crate) dir: StageDir,
    gpu_buf: u64,
    len: usize,
}

impl Stage {
    pub(crate) fn new(slot: StageSlot, dir: StageDir, gpu_buf: usize, len: usize) -> Stage {
        Stage { slot, dir, gpu_buf: gpu_buf as u64, len }
    }

    /// Where the protocols send from or receive into (host memory).
    pub(crate) fn host_data(&self) -> usize {
        self.slot.host_data()
    }

    /// The operation as the kernels see it, with its device handle (0 for sequenced ones).
    pub(crate) fn desc(&self, handle: u64) -> OpDesc {
        OpDesc { handle, slot: self.slot.device(), buf: self.gpu_buf, len: self.len as u64, stamp: self.slot.stamp() }
    }

    /// A receive completed with `len` bytes: recorded for the wait kernel (before the done word).
    pub(crate) fn received(&self, len: usize) {
        if self.dir == StageDir::Recv {
            self.slot.set_received(len as u64);
        }
    }
}
