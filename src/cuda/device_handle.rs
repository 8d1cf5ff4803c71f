//! `gsc_device_handle_t`s in GPU memory, for kernels that trigger and wait in a loop.
//!
//! A handle says where a channel's trigger and done words are and holds the device's epoch (or,
//! for a prepared transfer whose rounds run on the GPU, where its descriptor is).
//! The words must be in page-locked host memory (the proxy reads one and writes the other), but
//! the handle itself need not: kernel-triggered and graph conditions keep it in the GPU's own
//! memory, so `gsc_trigger` reads and bumps the epoch without a round trip over PCIe (measured
//! on H200: each such round trip costs about a microsecond, and a trigger/wait pair made four).
//!
//! Slots come from blocks allocated per context and never freed (like the pinned words: a
//! kernel may still hold a handle after its condition is gone). A slot is written once, when its
//! channel is made, with a copy on a non-blocking stream of our own that is waited for there:
//! it never orders itself behind a user stream that may be waiting on the proxy.
//!
//! Operations captured from a stream get theirs while the stream is being captured: the
//! allocation and the copy run with the thread's capture mode relaxed (`with_relaxed_capture`),
//! on a stream that takes no part in the capture.

use super::{CtxScope, check, cu};
use crate::error::Result;
use std::collections::HashMap;
use std::sync::Mutex;

const SLOT: usize = 64;

/// The `gsc_device_handle_t` layout (include/gsc_device.cuh).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub(crate) struct DeviceHandle {
    /// Proxy operations: the trigger word the device writes and the done word the proxy writes.
    pub(crate) trigger: u64,
    pub(crate) done: u64,
    /// The device's count of triggers.
    pub(crate) epoch: u64,
    /// A prepared transfer whose rounds run on the GPU: this side's `gsc_prepared_device_t`
    /// (gsc_trigger and gsc_wait run the round in the calling thread), else 0.
    pub(crate) prep: u64,
    /// 1: `prep` is a receive.
    pub(crate) prep_recv: u64,
    /// Where `done` points for a prepared transfer (written by the device).
    pub(crate) prep_done: u64,
    /// A small collective the triggering thread runs itself: its `gsc_coll_device_t`
    /// (`collective`), else 0.
    pub(crate) coll: u64,
}

impl DeviceHandle {
    /// A handle of an operation the proxy performs.
    pub(crate) fn proxy(trigger: u64, done: u64, epoch: u64) -> DeviceHandle {
        DeviceHandle { trigger, done, epoch, ..Default::default() }
    }
}

/// Offsets of `prep_done` and `coll` in a handle (the header's `reserved` and `coll`).
const PREP_DONE_OFFSET: u64 = 40;
const COLL_OFFSET: u64 = 48;
const _: () = assert!(
    std::mem::size_of::<DeviceHandle>() <= SLOT
        && std::mem::offset_of!(DeviceHandle, prep_done) == PREP_DONE_OFFSET as usize
        && std::mem::offset_of!(DeviceHandle, coll) == COLL_OFFSET as usize
);
const BLOCK: usize = 64 << 10;

struct Pool {
    /// Free slot addresses.
    free: Vec<u64>,
    /// Our stream for the handle writes (CU_STREAM_NON_BLOCKING).
    stream: usize,
}

/// Pools by context.
static POOLS: Mutex<Option<HashMap<usize, Pool>>> = Mutex::new(None);

/// One handle slot in a context's GPU memory; back in its pool when dropped.
pub(crate) struct DeviceHandleSlot {
    ctx: usize,
    addr: u64,
}

impl DeviceHandleSlot {
    /// A slot in `ctx`'s memory holding the handle of a proxy operation (its trigger and done
    /// words, the epoch at `epoch`), ready for kernels.
    pub(crate) fn new(ctx: cu::CUcontext, trigger: u64, done: u64, epoch: u64) -> Result<DeviceHandleSlot> {
        DeviceHandleSlot::with(ctx, |_| DeviceHandle::proxy(trigger, done, epoch))
    }

    /// A slot in `ctx`'s memory holding the handle of a prepared transfer whose rounds run on
    /// the GPU (`descriptor`: its side's `gsc_prepared_device_t`): gsc_trigger / gsc_wait run
    /// them in the calling thread, and the done word is in the slot itself.
    pub(crate) fn prepared(ctx: cu::CUcontext, descriptor: u64, recv: bool) -> Result<DeviceHandleSlot> {
        DeviceHandleSlot::with(ctx, |addr| DeviceHandle {
            done: addr + PREP_DONE_OFFSET,
            prep: descriptor,
            prep_recv: u64::from(recv),
            ..Default::default()
        })
    }

    fn with(ctx: cu::CUcontext, handle: impl FnOnce(u64) -> DeviceHandle) -> Result<DeviceHandleSlot> {
        let _scope = CtxScope::enter(ctx)?;
        super::with_relaxed_capture(|| DeviceHandleSlot::write_new(ctx, handle))
    }

    fn write_new(ctx: cu::CUcontext, handle: impl FnOnce(u64) -> DeviceHandle) -> Result<DeviceHandleSlot> {
        let (addr, stream) = {
            let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
            let pool = match pools.get_or_insert_with(HashMap::new).entry(ctx as usize) {
                std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => {
                    let mut stream: cu::CUstream = std::ptr::null_mut();
                    // SAFETY: a valid out-pointer; flag 1 = CU_STREAM_NON_BLOCKING (module doc).
                    check(unsafe { cu::cuStreamCreate(&mut stream, 1) }, "cuStreamCreate")?;
                    v.insert(Pool { free: Vec::new(), stream: stream as usize })
                }
            };
            if pool.free.is_empty() {
                let mut block: cu::CUdeviceptr = 0;
                // SAFETY: a valid out-pointer; the block is never freed (module doc).
                check(unsafe { cu::cuMemAlloc_v2(&mut block, BLOCK) }, "cuMemAlloc (device handles)")?;
                pool.free.extend((0..BLOCK / SLOT).rev().map(|i| block + (i * SLOT) as u64));
            }
            (pool.free.pop().expect("refilled above"), pool.stream)
        };
        let slot = DeviceHandleSlot { ctx: ctx as usize, addr };
        let stream = stream as cu::CUstream;
        let handle = handle(addr);
        // SAFETY: `addr` is a free slot of 64 bytes in this context's memory; `handle` is read by
        // the copy, which is complete when the synchronize returns (our stream holds nothing else).
        check(
            unsafe { cu::cuMemcpyHtoDAsync_v2(addr, (&handle as *const DeviceHandle).cast(), std::mem::size_of_val(&handle), stream) },
            "cuMemcpyHtoDAsync (device handle)",
        )?;
        // SAFETY: our own stream.
        check(unsafe { cu::cuStreamSynchronize(stream) }, "cuStreamSynchronize (device handle)")?;
        Ok(slot)
    }

    /// A slot in `ctx`'s memory holding the handle of a small collective the triggering thread
    /// runs itself (`coll`: its `gsc_coll_device_t`, include/gsc_device.cuh): the done word is
    /// in the slot, in GPU memory, so neither gsc_trigger nor gsc_wait crosses PCIe.
    pub(crate) fn collective(ctx: cu::CUcontext, coll: u64) -> Result<DeviceHandleSlot> {
        DeviceHandleSlot::with(ctx, |addr| DeviceHandle { done: addr + PREP_DONE_OFFSET, coll, ..Default::default() })
    }

    /// Set the error bit in the done word of a collective's handle (`collective`), and keep the
    /// slot out of the pool for good: a kernel that triggers it later (its communicator gone)
    /// finds the bit and returns at once, touching nothing else.
    pub(crate) fn fail_collective(self) -> Result<()> {
        let stream = {
            let pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
            pools.as_ref().and_then(|p| p.get(&self.ctx)).map(|p| p.stream).expect("a slot's pool lives as long as the process")
        } as cu::CUstream;
        let (ctx, done) = (self.ctx as cu::CUcontext, self.addr + PREP_DONE_OFFSET);
        // Out of the pool even if the write fails: a stale handle must never alias a new one.
        std::mem::forget(self);
        let _scope = CtxScope::enter(ctx)?;
        let failed = crate::condition::DONE_ERROR_BIT;
        // SAFETY: the slot's done word, in our context's memory; `failed` is read by the copy,
        // complete when the synchronize returns.
        check(unsafe { cu::cuMemcpyHtoDAsync_v2(done, (&failed as *const u64).cast(), 8, stream) }, "cuMemcpyHtoDAsync (device handle)")?;
        // SAFETY: our own stream.
        check(unsafe { cu::cuStreamSynchronize(stream) }, "cuStreamSynchronize (device handle)")
    }

    /// The handle's device address (what kernels take as `gsc_device_handle_t *`).
    pub(crate) fn addr(&self) -> u64 {
        self.addr
    }
}

impl Drop for DeviceHandleSlot {
    fn drop(&mut self) {
        let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(pool) = pools.as_mut().and_then(|p| p.get_mut(&self.ctx)) {
            pool.free.push(self.addr);
        }
    }
}
