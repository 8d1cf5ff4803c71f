//! Side streams a communicator forks a call's copies onto, and joins back, so that copies to
//! or from several peers run on several copy engines at once (`collectives::copy_engine`);
//! and the scratch those calls pull into.
//!
//! Fork and join are events: the side streams wait (on the GPU) for an event recorded on the
//! caller's stream, and the caller's stream waits for one recorded on each side stream. Under
//! stream capture that is how CUDA pulls other streams into the capture and joins them, so a
//! captured call becomes a graph whose copy nodes run side by side. Nothing here waits on the
//! host.

use super::copy::primary_context;
use super::{CtxScope, check, cu, raw};
use crate::error::Result;

/// Side streams of one device, with the events that fork them from and join them to a caller's
/// stream. The caller serializes its use (one call's fork ... join at a time).
pub(crate) struct Lanes {
    device: i32,
    streams: Vec<usize>,
    fork: usize,
    joins: Vec<usize>,
}

// SAFETY: plain driver handles, used with the device's primary context made current.
unsafe impl Send for Lanes {}

impl Lanes {
    /// `n` side streams (non-blocking: they never wait for the legacy default stream) on
    /// `device`.
    pub(crate) fn new(device: i32, n: usize) -> Result<Lanes> {
        let _scope = CtxScope::enter(primary_context(device)?)?;
        let mut lanes = Lanes { device, streams: Vec::with_capacity(n), fork: 0, joins: Vec::with_capacity(n) };
        lanes.fork = new_event()?;
        for _ in 0..n {
            let mut s: cu::CUstream = std::ptr::null_mut();
            // SAFETY: a valid out-pointer, the device's context is current.
            check(
                unsafe { cu::cuStreamCreate(&mut s, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) },
                "cuStreamCreate (side stream)",
            )?;
            lanes.streams.push(s as usize);
            lanes.joins.push(new_event()?);
        }
        Ok(lanes)
    }

    pub(crate) fn len(&self) -> usize {
        self.streams.len()
    }

    /// Side stream `i`.
    pub(crate) fn stream(&self, i: usize) -> usize {
        self.streams[i]
    }

    /// The side streams start after what `stream` (the caller's) holds so far.
    pub(crate) fn fork(&self, stream: usize) -> Result<()> {
        let _scope = CtxScope::enter(primary_context(self.device)?)?;
        // SAFETY: our event, the caller's live stream.
        check(unsafe { cu::cuEventRecord(raw(self.fork), raw(stream)) }, "cuEventRecord (fork)")?;
        for &s in &self.streams {
            // SAFETY: our stream and event.
            check(unsafe { cu::cuStreamWaitEvent(raw(s), raw(self.fork), 0) }, "cuStreamWaitEvent (fork)")?;
        }
        Ok(())
    }

    /// `stream` (the caller's) continues after what the side streams hold so far.
    pub(crate) fn join(&self, stream: usize) -> Result<()> {
        let _scope = CtxScope::enter(primary_context(self.device)?)?;
        for (&s, &e) in self.streams.iter().zip(&self.joins) {
            // SAFETY: our stream and event, the caller's live stream.
            check(unsafe { cu::cuEventRecord(raw(e), raw(s)) }, "cuEventRecord (join)")?;
            check(unsafe { cu::cuStreamWaitEvent(raw(stream), raw(e), 0) }, "cuStreamWaitEvent (join)")?;
        }
        Ok(())
    }
}

/// Events that order work between a caller's stream and side streams within one call (the
/// copy-engine ring: a copy starts after the reduction that produced its data). Under stream
/// capture a record and a wait become an edge of the graph. The caller serializes its use.
pub(crate) struct Events {
    device: i32,
    events: Vec<usize>,
}

// SAFETY: plain driver handles, used with the device's primary context made current.
unsafe impl Send for Events {}

impl Events {
    pub(crate) fn new(device: i32, n: usize) -> Result<Events> {
        let _scope = CtxScope::enter(primary_context(device)?)?;
        let mut events = Events { device, events: Vec::with_capacity(n) };
        for _ in 0..n {
            events.events.push(new_event()?);
        }
        Ok(events)
    }

    pub(crate) fn len(&self) -> usize {
        self.events.len()
    }

    /// Event `i` marks what `stream` holds so far.
    pub(crate) fn record(&self, i: usize, stream: usize) -> Result<()> {
        let _scope = CtxScope::enter(primary_context(self.device)?)?;
        // SAFETY: our event, the caller's live stream.
        check(unsafe { cu::cuEventRecord(raw(self.events[i]), raw(stream)) }, "cuEventRecord")
    }

    /// `stream` continues after event `i`'s last record.
    pub(crate) fn wait(&self, stream: usize, i: usize) -> Result<()> {
        let _scope = CtxScope::enter(primary_context(self.device)?)?;
        // SAFETY: our event, the caller's live stream.
        check(unsafe { cu::cuStreamWaitEvent(raw(stream), raw(self.events[i]), 0) }, "cuStreamWaitEvent")
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        let Ok(ctx) = primary_context(self.device) else { return };
        let Ok(_scope) = CtxScope::enter(ctx) else { return };
        for &e in &self.events {
            // SAFETY: our handles, not used after this (a pending record completes regardless).
            unsafe { cu::cuEventDestroy_v2(raw(e)) };
        }
    }
}

fn new_event() -> Result<usize> {
    let mut e: cu::CUevent = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the caller made a context current.
    check(unsafe { cu::cuEventCreate(&mut e, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) }, "cuEventCreate")?;
    Ok(e as usize)
}

impl Drop for Lanes {
    /// Streams with work still queued are released by the driver once it ran (destroying a
    /// stream never waits); events likewise.
    fn drop(&mut self) {
        let Ok(ctx) = primary_context(self.device) else { return };
        let Ok(_scope) = CtxScope::enter(ctx) else { return };
        // SAFETY: our handles, not used after this.
        unsafe {
            for &s in &self.streams {
                cu::cuStreamDestroy_v2(raw(s));
            }
            for &e in self.joins.iter().chain([&self.fork]) {
                if e != 0 {
                    cu::cuEventDestroy_v2(raw(e));
                }
            }
        }
    }
}

/// GPU memory a communicator pulls peers' parts into before it reduces them. Grown on demand
/// (doubling); an outgrown buffer is kept until the communicator is destroyed: a graph captured
/// earlier still names it, and `cuMemFree` on a user's thread could wait for the device
/// (src/cuda/mod.rs). Calls on one communicator are ordered (as NCCL requires), so one buffer
/// serves them all.
pub(crate) struct GrowingScratch {
    device: i32,
    current: Option<(u64, usize)>,
    outgrown: Vec<u64>,
}

// SAFETY: plain device addresses.
unsafe impl Send for GrowingScratch {}

impl GrowingScratch {
    pub(crate) fn new(device: i32) -> GrowingScratch {
        GrowingScratch { device, current: None, outgrown: Vec::new() }
    }

    /// At least `bytes` of scratch. Allocates (relaxing a stream capture of this thread's, so
    /// the capture stays valid) only when it has to grow.
    pub(crate) fn at_least(&mut self, bytes: usize) -> Result<u64> {
        if let Some((base, len)) = self.current
            && len >= bytes
        {
            return Ok(base);
        }
        let len = super::coll::scratch_len(self.current.map_or(0, |(_, len)| len), bytes);
        let _scope = CtxScope::enter(primary_context(self.device)?)?;
        let base = super::with_relaxed_capture(|| {
            let mut base: cu::CUdeviceptr = 0;
            // SAFETY: a valid out-pointer, the device's context is current.
            check(unsafe { cu::cuMemAlloc_v2(&mut base, len) }, "cuMemAlloc (copy-engine scratch)")?;
            Ok(base)
        })?;
        if let Some((old, _)) = self.current.replace((base, len)) {
            self.outgrown.push(old);
        }
        Ok(base)
    }
}

impl Drop for GrowingScratch {
    /// At destroy: the caller's streams are done with the communicator (as for NCCL's
    /// ncclCommDestroy), so the buffers go.
    fn drop(&mut self) {
        let Ok(ctx) = primary_context(self.device) else { return };
        let Ok(_scope) = CtxScope::enter(ctx) else { return };
        for base in self.current.take().map(|(b, _)| b).into_iter().chain(self.outgrown.drain(..)) {
            // SAFETY: our allocation, no longer used (see above).
            unsafe { cu::cuMemFree_v2(base) };
        }
    }
}
