//! Copies by the copy engine, started and polled without blocking.
//!
//! Each GPU gets one stream of our own, created non-blocking so it never orders itself behind
//! the legacy default stream or any user stream: a user stream may be waiting (a stream
//! condition) for the very operation this copy belongs to. A copy is enqueued with
//! `cuMemcpyAsync` (unified addressing: device, peer-mapped and host addresses alike), an event
//! is recorded after it, and progress asks `cuEventQuery`, which never waits. This is what lets
//! the proxy thread drive GPU transfers while staying free of blocking CUDA calls.
//!
//! A large read is split into pieces over several streams of our own (`GSC_CUDA_COPY_STREAMS`,
//! pieces of at least `GSC_CUDA_COPY_SPLIT`): the driver gives each stream its own copy
//! channel, so the pieces run on several copy engines at once instead of queueing on one. The
//! ticket holds one event per piece and is done when all are.
//!
//! The host-staged path's copies that the worker waits for (core/device_mem.rs) are waited
//! for by polling too, with a time limit: they are on our own streams, which hold only our own
//! copies, so they cannot be caught in a cycle with a stream that waits on the proxy.

use super::{CtxScope, check, cu, init};
use crate::error::Result;
use std::collections::HashMap;

struct DeviceLane {
    ctx: cu::CUcontext,
    /// `streams[0]` carries whole copies and the first piece of split ones.
    streams: Vec<cu::CUstream>,
    spare_events: Vec<cu::CUevent>,
}

/// A copy in flight.
#[derive(Debug)]
pub(crate) struct CopyTicket {
    device: i32,
    /// One per piece, recorded after it on its stream.
    events: Vec<cu::CUevent>,
}

// SAFETY: CUDA handles are process-wide and usable from any thread with their context current
// (every call here pushes it).
unsafe impl Send for CopyTicket {}

/// The copy streams of one worker, a set per GPU it has copied on.
pub(crate) struct Copier {
    lanes: HashMap<i32, DeviceLane>,
    streams_per_gpu: usize,
    split_min: usize,
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

/// Where the pieces of a `len`-byte copy start: up to `streams` pieces of at least `split_min`
/// bytes, equal but for the last, starts aligned to 64 KiB so no piece splits a page of the
/// peer mapping.
fn piece_starts(len: usize, streams: usize, split_min: usize) -> Vec<usize> {
    const ALIGN: usize = 64 << 10;
    let k = (len / split_min.max(1)).clamp(1, streams.max(1));
    let piece = len.div_ceil(k).next_multiple_of(ALIGN);
    (0..k).map(|i| i * piece).filter(|&start| start < len || start == 0).collect()
}

impl Copier {
    pub(crate) fn new(streams_per_gpu: usize, split_min: usize) -> Copier {
        Copier { lanes: HashMap::new(), streams_per_gpu: streams_per_gpu.max(1), split_min }
    }

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
                let mut lane = DeviceLane { ctx, streams: Vec::new(), spare_events: Vec::new() };
                for _ in 0..self.streams_per_gpu {
                    let mut stream: cu::CUstream = std::ptr::null_mut();
                    // SAFETY: a valid out-pointer; flag 1 = CU_STREAM_NON_BLOCKING (module doc).
                    if let Err(e) = check(unsafe { cu::cuStreamCreate(&mut stream, 1) }, "cuStreamCreate") {
                        lane.destroy();
                        return Err(e);
                    }
                    lane.streams.push(stream);
                }
                Ok(v.insert(lane))
            }
        }
    }

    /// Enqueue `len` bytes from `src` to `dst` on `device`'s copy stream.
    ///
    /// # Safety
    /// `dst` and `src` are unified addresses valid for `len` bytes until the copy completes
    /// (the ticket is polled done or the worker is gone).
    pub(crate) unsafe fn start(&mut self, device: i32, dst: u64, src: u64, len: usize) -> Result<CopyTicket> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.start_then_write(device, dst, src, len, None) }.map(|(t, _)| t)
    }

    /// `start`, and then, once every piece is done, write `word.1` to the 64-bit word at device
    /// address `word.0` from the copy stream (a memop write with the default memory barrier:
    /// the copy's bytes are visible to whoever sees the value). Returns the ticket (done only
    /// after the write) and whether the write was enqueued: `false` when the memop was refused,
    /// and the caller then stores the word itself once the ticket is done.
    ///
    /// # Safety
    /// As for `start`; `word.0` is a device address of a mapped host word that stays mapped
    /// (registered) until the ticket is done.
    pub(crate) unsafe fn start_then_write(
        &mut self,
        device: i32,
        dst: u64,
        src: u64,
        len: usize,
        word: Option<(u64, u64)>,
    ) -> Result<(CopyTicket, bool)> {
        let starts = piece_starts(len, self.streams_per_gpu, self.split_min);
        let lane = self.lane(device)?;
        let _scope = CtxScope::enter(lane.ctx)?;
        let mut ticket = CopyTicket { device, events: Vec::with_capacity(starts.len()) };
        let mut word_written = false;
        // Pieces after the first get their events first, so the first stream can wait for them
        // before it writes the word; the first piece's event is recorded last, after the write.
        for (i, &at) in starts.iter().enumerate().rev() {
            let end = starts.get(i + 1).copied().unwrap_or(len);
            let stream = lane.streams[i];
            let event = match lane.take_event() {
                Ok(e) => e,
                Err(e) => {
                    lane.abandon(ticket);
                    return Err(e);
                }
            };
            let mut enqueue = || -> Result<()> {
                if end > at {
                    // SAFETY: the caller's promise on `dst`/`src` covers every piece; our stream.
                    check(unsafe { cu::cuMemcpyAsync(dst + at as u64, src + at as u64, end - at, stream) }, "cuMemcpyAsync")?;
                }
                if i == 0
                    && let Some((addr, value)) = word
                {
                    for &other in &ticket.events {
                        // SAFETY: events of this context, recorded on our other streams above.
                        check(unsafe { cu::cuStreamWaitEvent(stream, other, 0) }, "cuStreamWaitEvent")?;
                    }
                    // A refused write is not an error of the copy: the caller stores the word.
                    word_written = super::enqueue_write_value(stream as usize, addr, value)
                        .inspect_err(|e| tracing::debug!(target: "gsc::cuda", error = %e, "word write after a copy refused"))
                        .is_ok();
                }
                // SAFETY: our event and stream, both of this context.
                check(unsafe { cu::cuEventRecord(event, stream) }, "cuEventRecord")
            };
            let queued = enqueue();
            ticket.events.push(event);
            if let Err(e) = queued {
                lane.abandon(ticket);
                return Err(e);
            }
        }
        Ok((ticket, word_written))
    }

    /// `None` while the copy runs; its result once it is done (the ticket is then spent).
    pub(crate) fn poll(&mut self, ticket: &CopyTicket) -> Option<Result<()>> {
        let lane = self.lanes.get_mut(&ticket.device)?;
        // The events belong to the lane's context, which must be current for the query (on the
        // proxy thread nothing is); without it the driver never reports an event done.
        let _scope = match CtxScope::enter(lane.ctx) {
            Ok(s) => s,
            Err(e) => return Some(Err(e)),
        };
        let mut first_error = None;
        for &event in &ticket.events {
            // SAFETY: an event recorded by `start`; querying never blocks.
            match unsafe { cu::cuEventQuery(event) } {
                cu::CUresult::CUDA_ERROR_NOT_READY => return None,
                r => {
                    if first_error.is_none() {
                        first_error = check(r, "copy engine transfer").err();
                    }
                }
            }
        }
        lane.spare_events.extend(ticket.events.iter().copied());
        Some(first_error.map_or(Ok(()), Err))
    }
}

impl DeviceLane {
    /// A spare event, or a new one. The lane's context must be current.
    fn take_event(&mut self) -> Result<cu::CUevent> {
        if let Some(e) = self.spare_events.pop() {
            return Ok(e);
        }
        let mut e: cu::CUevent = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; timing off keeps the record cheap.
        check(unsafe { cu::cuEventCreate(&mut e, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) }, "cuEventCreate")?;
        Ok(e)
    }

    /// A copy that failed to enqueue whole: wait for the pieces already queued (they write into
    /// the caller's buffer, which is the caller's again once we return), then keep the events.
    fn abandon(&mut self, ticket: CopyTicket) {
        for &s in &self.streams {
            // SAFETY: our stream, holding only our copies.
            unsafe { cu::cuStreamSynchronize(s) };
        }
        self.spare_events.extend(ticket.events);
    }

    /// Wait for our copies and destroy the streams and events. The lane's context must be current.
    fn destroy(&mut self) {
        // SAFETY: our streams and events, destroyed once (the vectors are drained).
        unsafe {
            for s in &self.streams {
                cu::cuStreamSynchronize(*s);
            }
            for e in self.spare_events.drain(..) {
                cu::cuEventDestroy_v2(e);
            }
            for s in self.streams.drain(..) {
                cu::cuStreamDestroy_v2(s);
            }
        }
    }
}

impl Drop for Copier {
    fn drop(&mut self) {
        for lane in self.lanes.values_mut() {
            let Ok(_scope) = CtxScope::enter(lane.ctx) else { continue };
            // Copies still running belong to requests that are gone with the worker; `destroy`
            // lets them finish before their events and streams go.
            lane.destroy();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::piece_starts;

    #[test]
    fn small_copies_stay_whole_and_large_ones_split_evenly() {
        const M: usize = 1 << 20;
        assert_eq!(piece_starts(0, 4, 8 * M), [0]);
        assert_eq!(piece_starts(8, 4, 8 * M), [0]);
        assert_eq!(piece_starts(15 * M, 4, 8 * M), [0]);
        assert_eq!(piece_starts(16 * M, 4, 8 * M), [0, 8 * M]);
        assert_eq!(piece_starts(128 * M, 4, 8 * M), [0, 32 * M, 64 * M, 96 * M]);
        assert_eq!(piece_starts(128 * M, 1, 8 * M), [0]);
        // Uneven: pieces aligned to 64 KiB, the last one shorter, none empty.
        let s = piece_starts(100 * M + 1, 3, 8 * M);
        assert_eq!(s.len(), 3);
        assert!(s.iter().all(|x| x % (64 << 10) == 0));
        assert!(s[2] < 100 * M + 1);
    }
}
