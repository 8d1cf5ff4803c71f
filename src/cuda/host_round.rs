//! GPU rounds of prepared transfers started from the host (no condition): the round's kernel
//! runs on a stream of the transfer's own, and the request completes when an event recorded
//! after it is reached, which the worker's progress asks with `cuEventQuery` (never blocking).
//!
//! A stream per transfer side, not the worker's copy streams: a receive's kernel waits on the
//! GPU for the peer's data, and nothing else may queue behind it — a proxy copy the peer is
//! waiting for would deadlock the pair.

use super::copy::primary_context;
use super::{CtxScope, Kernels, PrepArgs, check, cu, launch_prep};
use crate::error::Result;

/// A non-blocking stream of our own on one GPU (its primary context), destroyed with it, and
/// gscomm's kernels there.
pub(crate) struct RoundStream {
    ctx: usize,
    stream: usize,
    kernels: Kernels,
}

// SAFETY: CUDA handles are process-wide; every call below makes their context current.
unsafe impl Send for RoundStream {}
// SAFETY: as above; the driver serializes work on one stream.
unsafe impl Sync for RoundStream {}

impl RoundStream {
    /// `kernel_cache`: where compiled kernels are kept (`GSC_KERNEL_CACHE_DIR`).
    pub(crate) fn new(device: i32, kernel_cache: Option<&std::path::Path>) -> Result<RoundStream> {
        let ctx = primary_context(device)?;
        let kernels = Kernels::of(ctx, kernel_cache)?;
        let _scope = CtxScope::enter(ctx)?;
        let mut stream: cu::CUstream = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; flag 1 = CU_STREAM_NON_BLOCKING (never ordered behind the
        // legacy default stream, which a user stream waiting on us may be part of).
        check(unsafe { cu::cuStreamCreate(&mut stream, 1) }, "cuStreamCreate (host-started GPU rounds)")?;
        Ok(RoundStream { ctx: ctx as usize, stream: stream as usize, kernels })
    }

    /// Launch `args`' round here and record an event after it.
    pub(crate) fn launch(&self, args: &PrepArgs) -> Result<HostRound> {
        let _scope = CtxScope::enter(super::raw(self.ctx))?;
        let mut event: cu::CUevent = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        check(unsafe { cu::cuEventCreate(&mut event, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) }, "cuEventCreate")?;
        let round = HostRound { ctx: self.ctx, event: event as usize };
        launch_prep(&self.kernels, self.stream, args)?;
        // SAFETY: our event and our stream, both of the current context.
        check(unsafe { cu::cuEventRecord(event, super::raw(self.stream)) }, "cuEventRecord (host-started GPU round)")?;
        Ok(round)
    }
}

impl Drop for RoundStream {
    fn drop(&mut self) {
        let Ok(_scope) = CtxScope::enter(super::raw(self.ctx)) else { return };
        // SAFETY: our stream; the driver lets its queued work finish before freeing it.
        unsafe { cu::cuStreamDestroy_v2(super::raw(self.stream)) };
    }
}

/// A launched host-started round: done when its event is.
#[derive(Debug)]
pub(crate) struct HostRound {
    ctx: usize,
    event: usize,
}

// SAFETY: as for `RoundStream`.
unsafe impl Send for HostRound {}

impl HostRound {
    /// `None` while the kernel runs; its result once it ended.
    pub(crate) fn poll(&self) -> Option<Result<()>> {
        let scope = CtxScope::enter(super::raw(self.ctx));
        if let Err(e) = scope {
            return Some(Err(e));
        }
        // SAFETY: our recorded event; querying never blocks.
        match unsafe { cu::cuEventQuery(super::raw(self.event)) } {
            cu::CUresult::CUDA_ERROR_NOT_READY => None,
            r => Some(check(r, "host-started GPU round")),
        }
    }
}

impl Drop for HostRound {
    fn drop(&mut self) {
        let Ok(_scope) = CtxScope::enter(super::raw(self.ctx)) else { return };
        // SAFETY: our event; destroying one whose work is pending is allowed (freed when done).
        unsafe { cu::cuEventDestroy_v2(super::raw(self.event)) };
    }
}
