//! Copies by the copy engine, started and polled without blocking.
//!
//! Each GPU gets one stream of our own, created non-blocking so it never orders itself behind
//! the legacy default stream or any user stream: a user stream may be waiting (a stream
//! condition) for the very operation this copy belongs to. A copy is enqueued with
//! `cuMemcpyAsync` (unified addressing: device, peer-mapped and host addresses alike), an event
//! is recorded after it, and progress asks `cuEventQuery`, which never waits. This is what lets
//! the proxy thread drive GPU transfers while staying free of blocking CUDA calls.
//!
//! `copy_sync` (the host-staged path) does wait, but only for our own stream, which holds only
//! our own copies, so it cannot be caught in a cycle with a stream that waits on the proxy.

use super::{CtxScope, check, cu, init};
use crate::error::Result;
use std::collections::HashMap;

struct DeviceLane {
    ctx: cu::CUcontext,
    stream: cu::CUstream,
    spare_events: Vec<cu::CUevent>,
}

/// A copy in flight.
#[derive(Debug)]
pub(crate) struct CopyTicket {
    device: i32,
    event: cu::CUevent,
}

// SAFETY: CUDA handles are process-wide and usable from any thread with their context current
// (every call here pushes it).
unsafe impl Send for CopyTicket {}

/// The copy streams of one worker, one per GPU it has copied on.
#[derive(Default)]
pub(crate) struct Copier {
    lanes: HashMap<i32, DeviceLane>,
}

// SAFETY: as for `CopyTicket`; the worker's mutex serializes use.
unsafe impl Send for Copier {}

/// The primary context of `device`, retained once for the process (never released: copies and
/// mappings may use it until exit).
pub(crate) fn primary_context(device: i32) -> Result<cu::CUcontext> {
    use std::sync::Mutex;
    static CTXS: Mutex<Vec<(i32, usize)>> = Mutex::new(Vec::new());
    init()?;
    let mut ctxs = CTXS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, c)) = ctxs.iter().find(|(d, _)| *d == device) {
        return Ok(*c as cu::CUcontext);
    }
    let mut dev: cu::CUdevice = 0;
    // SAFETY: valid out-pointers.
    check(unsafe { cu::cuDeviceGet(&mut dev, device) }, "cuDeviceGet")?;
    let mut ctx: cu::CUcontext = std::ptr::null_mut();
    check(unsafe { cu::cuDevicePrimaryCtxRetain(&mut ctx, dev) }, "cuDevicePrimaryCtxRetain")?;
    ctxs.push((device, ctx as usize));
    Ok(ctx)
}

impl Copier {
    /// Create `device`'s copy stream and a few events now, on the calling (user) thread, so the
    /// proxy never has to: creating a stream can wait behind a user thread that is itself
    /// blocked in a launch whose progress needs the proxy (measured: a graph broadcast hung).
    pub(crate) fn prepare(&mut self, device: i32) -> Result<()> {
        const SPARE: usize = 4;
        let lane = self.lane(device)?;
        let _scope = CtxScope::enter(lane.ctx)?;
        while lane.spare_events.len() < SPARE {
            let mut e: cu::CUevent = std::ptr::null_mut();
            // SAFETY: a valid out-pointer.
            check(unsafe { cu::cuEventCreate(&mut e, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) }, "cuEventCreate")?;
            lane.spare_events.push(e);
        }
        Ok(())
    }

    fn lane(&mut self, device: i32) -> Result<&mut DeviceLane> {
        use std::collections::hash_map::Entry;
        match self.lanes.entry(device) {
            Entry::Occupied(e) => Ok(e.into_mut()),
            Entry::Vacant(v) => {
                let ctx = primary_context(device)?;
                let _scope = CtxScope::enter(ctx)?;
                let mut stream: cu::CUstream = std::ptr::null_mut();
                // SAFETY: a valid out-pointer; flag 1 = CU_STREAM_NON_BLOCKING (module doc).
                check(unsafe { cu::cuStreamCreate(&mut stream, 1) }, "cuStreamCreate")?;
                Ok(v.insert(DeviceLane { ctx, stream, spare_events: Vec::new() }))
            }
        }
    }

    /// Enqueue `len` bytes from `src` to `dst` on `device`'s copy stream.
    ///
    /// # Safety
    /// `dst` and `src` are unified addresses valid for `len` bytes until the copy completes
    /// (the ticket is polled done or the worker is gone).
    pub(crate) unsafe fn start(&mut self, device: i32, dst: u64, src: u64, len: usize) -> Result<CopyTicket> {
        let lane = self.lane(device)?;
        let _scope = CtxScope::enter(lane.ctx)?;
        let event = match lane.spare_events.pop() {
            Some(e) => e,
            None => {
                let mut e: cu::CUevent = std::ptr::null_mut();
                // SAFETY: a valid out-pointer; timing off keeps the record cheap.
                check(unsafe { cu::cuEventCreate(&mut e, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) }, "cuEventCreate")?;
                e
            }
        };
        let enqueue = || -> Result<()> {
            if len > 0 {
                // SAFETY: the caller's promise on `dst`/`src`; our live stream.
                check(unsafe { cu::cuMemcpyAsync(dst, src, len, lane.stream) }, "cuMemcpyAsync")?;
            }
            // SAFETY: our event and stream, both of this context.
            check(unsafe { cu::cuEventRecord(event, lane.stream) }, "cuEventRecord")
        };
        if let Err(e) = enqueue() {
            lane.spare_events.push(event);
            return Err(e);
        }
        Ok(CopyTicket { device, event })
    }

    /// `None` while the copy runs; its result once it is done (the ticket is then spent).
    pub(crate) fn poll(&mut self, ticket: &CopyTicket) -> Option<Result<()>> {
        let lane = self.lanes.get_mut(&ticket.device)?;
        // The event belongs to the lane's context, which must be current for the query (on the
        // proxy thread nothing is); without it the driver never reports the event done.
        let r = match CtxScope::enter(lane.ctx) {
            // SAFETY: an event recorded by `start`; querying never blocks.
            Ok(_scope) => unsafe { cu::cuEventQuery(ticket.event) },
            Err(e) => return Some(Err(e)),
        };
        if r == cu::CUresult::CUDA_ERROR_NOT_READY {
            return None;
        }
        lane.spare_events.push(ticket.event);
        Some(check(r, "copy engine transfer"))
    }

    /// Copy and wait for it (host staging). Waits on our own stream only.
    ///
    /// # Safety
    /// As for `start`, for the duration of the call.
    pub(crate) unsafe fn copy_sync(&mut self, device: i32, dst: u64, src: u64, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let lane = self.lane(device)?;
        let _scope = CtxScope::enter(lane.ctx)?;
        // SAFETY: the caller's promise; our stream.
        check(unsafe { cu::cuMemcpyAsync(dst, src, len, lane.stream) }, "cuMemcpyAsync")?;
        // SAFETY: our stream, holding only our copies.
        check(unsafe { cu::cuStreamSynchronize(lane.stream) }, "cuStreamSynchronize(copy stream)")
    }
}

impl Drop for Copier {
    fn drop(&mut self) {
        for lane in self.lanes.values_mut() {
            let Ok(_scope) = CtxScope::enter(lane.ctx) else { continue };
            // Copies still running belong to requests that are gone with the worker; let them
            // finish before their events and stream go.
            // SAFETY: our stream and events, destroyed once.
            unsafe {
                cu::cuStreamSynchronize(lane.stream);
                for e in lane.spare_events.drain(..) {
                    cu::cuEventDestroy_v2(e);
                }
                cu::cuStreamDestroy_v2(lane.stream);
            }
        }
    }
}
