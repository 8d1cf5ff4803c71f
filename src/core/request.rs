//! Requests: the handle a non-blocking operation returns while it is in progress.
//!
//! Requests live in the worker's `slab`. The handle given out is not a pointer: it encodes the
//! worker's registry id, a generation and the slab key, so a stale, forged or double-freed handle
//! is *detected* (`InvalidHandle`) instead of dereferenced. As an integer it is never zero and never
//! in the error range of a status pointer, so the C API can return it as `gsc_status_ptr_t`.

use crate::condition::{ArmedOutputs, Condition, Signal};
use crate::error::Status;
use crate::protocols::{MemType, RecvInfo};

/// Called once when a request completes (never when the operation succeeded at once and no
/// request was returned). It runs without the worker's lock held, so it may call back into the
/// library. Arguments: the request handle, status, receive info.
pub type Callback = Box<dyn FnOnce(u64, Status, RecvInfo) + Send>;

/// Options of a non-blocking operation: UCP's `ucp_request_param_t`.
#[derive(Default)]
pub struct RequestParams {
    pub callback: Option<Callback>,
    /// The memory type of the buffer; `None` means detect (host memory until GPU lanes exist).
    pub memory_type: Option<MemType>,
    /// When the operation starts and what waits for it. `None`: now, on the calling thread.
    pub condition: Option<Condition>,
    /// With a stream or host-stream condition: the producer does *not* wait for this operation's
    /// completion (MPI's `Isend_enqueue` rather than `Send_enqueue`); `Condition::wait` later
    /// makes it wait for everything issued so far. Lets a send and a receive be in flight
    /// together, as a halo exchange needs. A staged receive (GPU memory up to
    /// `GSC_CUDA_STAGE_MAX` on a stream or graph condition) writes its buffer in the wait that
    /// covers it, so with this flag at that later `Condition::wait`.
    pub no_stream_wait: bool,
    /// Always return a request, even if the operation completed at once (UCP's
    /// `UCP_OP_ATTR_FLAG_NO_IMM_CMPL`). A request that completes inside the starting call (with
    /// this flag, or because it failed at once, e.g. truncation) fires its callback before that
    /// call returns, after the worker's lock is released.
    pub no_immediate_completion: bool,
}

impl RequestParams {
    pub fn with_callback(f: impl FnOnce(u64, Status, RecvInfo) + Send + 'static) -> RequestParams {
        RequestParams { callback: Some(Box::new(f)), ..Default::default() }
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum ReqKind {
    Send,
    Recv,
    Put,
    Get,
    Flush,
    /// Part of a worker flush: completes `parent` when the last part is done.
    FlushPart {
        parent: u64,
    },
    Close,
}

pub(crate) struct Slot {
    pub(crate) generation: u16,
    pub(crate) kind: ReqKind,
    /// The connection the request needs, if any (a posted receive needs none).
    pub(crate) conn: Option<usize>,
    pub(crate) result: Option<(Status, RecvInfo)>,
    pub(crate) callback: Option<Callback>,
    /// The user released the handle; drop the slot as soon as the request completes.
    pub(crate) released: bool,
    /// For worker flushes: parts still outstanding and the first error among them.
    pub(crate) pending_parts: usize,
    pub(crate) first_error: Option<Status>,
    /// Conditioned operations: advances the condition's done word when the request completes.
    pub(crate) signal: Option<Signal>,
    /// Armed on a condition that has not triggered yet: the operation has not started.
    pub(crate) armed: bool,
    /// When a conditioned operation's trigger started it (`Worker::expire_stream_ops`).
    pub(crate) started_at: Option<std::time::Instant>,
    /// Its state was logged once as slow (half of `GSC_TIMEOUT` passed), so that a stall shows
    /// where every rank stood before the first timeout fails links and hides it.
    pub(crate) slow_reported: bool,
    /// The caller's space (`Context::with_request_area`).
    pub(crate) area: Option<super::request_area::Area>,
}

impl Slot {
    pub(crate) fn new(kind: ReqKind, conn: Option<usize>, generation: u16, callback: Option<Callback>) -> Slot {
        Slot {
            generation,
            kind,
            conn,
            result: None,
            callback,
            released: false,
            pending_parts: 0,
            first_error: None,
            signal: None,
            armed: false,
            started_at: None,
            slow_reported: false,
            area: None,
        }
    }
}

/// Handle layout: worker id (15 bits) | generation (16 bits) | slab key + 1 (32 bits).
pub(crate) fn encode(worker: u16, generation: u16, key: usize) -> u64 {
    debug_assert!(worker < 0x8000 && key < u32::MAX as usize);
    ((worker as u64) << 48) | ((generation as u64) << 32) | (key as u64 + 1)
}

/// (worker id, generation, slab key), or None when the bits cannot be a handle.
pub(crate) fn decode(handle: u64) -> Option<(u16, u16, usize)> {
    let worker = (handle >> 48) as u16;
    let low = handle & 0xFFFF_FFFF;
    if worker == 0 || worker >= 0x8000 || low == 0 {
        return None;
    }
    Some((worker, (handle >> 32) as u16, (low - 1) as usize))
}

/// What starting an operation gave back.
#[derive(Debug, PartialEq, Eq)]
pub enum Started {
    /// Completed within the call (UCP's NULL status pointer); no callback fires.
    Done(RecvInfo),
    /// In progress: test or wait on the handle, then release it (see `Worker::request_*`).
    /// Operations with a stream or host-stream condition always give one.
    Pending(u64),
    /// Armed on a graph or kernel-triggered condition: it runs every time its trigger fires, so
    /// there is no single request; failures show in `Condition::query`.
    Armed(ArmedOutputs),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_never_look_like_errors_or_null() {
        for (w, g, k) in [(1u16, 0u16, 0usize), (0x7FFF, 0xFFFF, u32::MAX as usize - 1), (5, 7, 12345)] {
            let h = encode(w, g, k);
            assert_ne!(h, 0);
            assert!(h < (crate::error::ERR_LAST as i64 as u64), "handle in the error range");
            assert_eq!(decode(h), Some((w, g, k)));
        }
        assert_eq!(decode(0), None);
        assert_eq!(decode(u64::MAX), None);
        assert_eq!(decode(1 << 48), None, "key bits zero");
    }
}
