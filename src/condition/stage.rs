//! Staged operations: a small GPU message of a stream or graph operation travels through a
//! page-locked slot that gscomm's own kernels fill (sends, before the trigger) or empty
//! (receives, after the wait), so the proxy moves it like host memory (see `cuda::stage`).
//!
//! What is staged: operations on GPU memory of 1 byte to `GSC_CUDA_STAGE_MAX`, on a stream (also
//! under capture) or a graph condition, where gscomm owns the nodes around the operation.
//! Kernel-triggered operations are not: the user's kernel triggers and waits itself.
//!
//! A staged send of up to `cuda::stage::LL_MAX` bytes goes as LL words that race its trigger
//! across PCIe (no fence between them): the proxy starts it only once `send_ready` has seen them
//! all, and fails it if they are not there `LATE_LIMIT` after the trigger.
//!
//! A staged receive writes the user's buffer in the wait that covers it: its own stream wait,
//! the condition's next `wait` for one issued with `no_stream_wait`, or its graph done node. Its
//! request completing on the host means the message arrived, not that the buffer holds it yet.

use crate::cuda::{LL_MAX, OpDesc, StageSlot, ll_area, ll_flag};
use crate::error::{Error, Status};

/// How long after its trigger a staged send's bytes may still be arriving: they are written
/// before the trigger and only race it across PCIe (microseconds), so this bounds a fault.
pub(crate) const LATE_LIMIT: std::time::Duration = std::time::Duration::from_secs(1);

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
    /// Slot room a staged operation of `len` bytes needs: a receive its bytes; a send its LL
    /// words (what the kernel writes) and the bytes unpacked from them (what the protocols send).
    pub(crate) fn room(dir: StageDir, len: usize) -> usize {
        if Stage::is_ll(dir, len) { ll_area(len) + len } else { len }
    }

    /// A send small enough to go as LL words (`cuda::stage::LL_MAX`); larger ones and receives
    /// are plain bytes.
    fn is_ll(dir: StageDir, len: usize) -> bool {
        dir == StageDir::Send && len <= LL_MAX
    }

    /// `slot` has `room(dir, len)` bytes; a send's LL words were zeroed when it was taken.
    pub(crate) fn new(slot: StageSlot, dir: StageDir, gpu_buf: usize, len: usize) -> Stage {
        Stage { slot, dir, gpu_buf: gpu_buf as u64, len }
    }

    /// Where the protocols send from or receive into (host memory): a receive's bytes, a send's
    /// unpacked bytes.
    pub(crate) fn host_data(&self) -> usize {
        if Stage::is_ll(self.dir, self.len) { self.slot.host_data() + ll_area(self.len) } else { self.slot.host_data() }
    }

    /// Proxy side, before a staged send starts: true once the kernel's bytes for this use
    /// (`epoch`: a persistent operation's epoch; `None` for a sequenced one, whose flag comes from
    /// its slot's stamp) have all arrived, unpacked to `host_data()`. Receives and plain-byte sends
    /// are always ready.
    pub(crate) fn send_ready(&self, epoch: Option<u64>) -> bool {
        if !Stage::is_ll(self.dir, self.len) {
            return true;
        }
        // SAFETY: the unpacked area is `len` bytes of our slot after its LL words (`room`), and
        // only the proxy thread touches it, before the send that reads it starts.
        let out = unsafe { std::slice::from_raw_parts_mut(self.host_data() as *mut u8, self.len) };
        self.slot.unpack_ll(self.len, ll_flag(epoch.unwrap_or(self.slot.stamp())), out)
    }

    /// The error of a staged send whose bytes never arrived after its trigger.
    pub(crate) fn late_error(&self) -> Error {
        Error::new(
            Status::DeviceError,
            format!("the {} staged bytes of a triggered send did not arrive within {LATE_LIMIT:?} of the trigger", self.len),
        )
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
