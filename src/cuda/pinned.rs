//! Page-locked host memory mapped into every context, cut into slots for trigger/done words.
//!
//! A slot is 256 bytes: the trigger word (line 0, written by the GPU), the done word (line 1,
//! written by the proxy), and a `gsc_device_handle_t` (line 2, see include/gsc_device.cuh) that
//! replay-safe kernels use. Blocks are allocated with `CU_MEMHOSTALLOC_PORTABLE |
//! CU_MEMHOSTALLOC_DEVICEMAP` and never given back: freeing page-locked memory can synchronize
//! the device, and a stream may still wait on a word long after its condition is gone. Freed
//! slots are reused with their words left as they are; a new channel continues counting from
//! the values it finds (`base`), so a late wait on an old value is still satisfied.

use super::device_handle::DeviceHandle;
use super::{check, cu};
use crate::error::Result;
use std::ptr::NonNull;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

const SLOT: usize = 256;
const BLOCK: usize = 64 << 10;

struct FreeList {
    /// (host address, device address) of free slots.
    slots: Vec<(usize, u64)>,
}

static FREE: Mutex<FreeList> = Mutex::new(FreeList { slots: Vec::new() });

/// One slot; back on the free list when dropped (unless `poison`ed).
pub(crate) struct PinnedSlot {
    host: usize,
    device: u64,
    /// A failed channel's slot may still receive a stale trigger write from a stream: never reuse.
    poisoned: bool,
}

impl PinnedSlot {
    /// A slot. The caller must have a CUDA context current (a new block is allocated in it; the
    /// memory is portable to every context).
    pub(crate) fn take() -> Result<PinnedSlot> {
        let mut free = FREE.lock().unwrap_or_else(|e| e.into_inner());
        if free.slots.is_empty() {
            let block = allocate_block()?;
            free.slots.extend(block);
        }
        let (host, device) = free.slots.pop().expect("refilled above");
        Ok(PinnedSlot { host, device, poisoned: false })
    }

    fn word(&self, line: usize) -> NonNull<AtomicU64> {
        NonNull::new((self.host + line * 64) as *mut AtomicU64).expect("non-null slot")
    }

    /// Host views of (trigger, done).
    pub(crate) fn host_words(&self) -> (NonNull<AtomicU64>, NonNull<AtomicU64>) {
        (self.word(0), self.word(1))
    }

    /// Device addresses of (trigger, done).
    pub(crate) fn device_words(&self) -> (u64, u64) {
        (self.device, self.device + 64)
    }

    /// Device address of the slot's `gsc_device_handle_t`.
    pub(crate) fn device_handle(&self) -> u64 {
        self.device + 128
    }

    /// Point the device handle at this slot's words with the epoch at `base`. Only called while
    /// no device work uses the slot (it was free).
    pub(crate) fn init_handle(&self, base: u64) {
        let (t, d) = self.device_words();
        // SAFETY: line 2 of the slot is ours and no kernel refers to it yet.
        unsafe { std::ptr::write_volatile((self.host + 128) as *mut DeviceHandle, DeviceHandle::proxy(t, d, base)) };
    }

    pub(crate) fn poison(&mut self) {
        self.poisoned = true;
    }
}

/// A new block cut into slots: (host, device) addresses, the first last.
fn allocate_block() -> Result<Vec<(usize, u64)>> {
    let (host, dev) = alloc_mapped(BLOCK)?;
    Ok((0..BLOCK / SLOT).rev().map(|i| (host + i * SLOT, dev + (i * SLOT) as u64)).collect())
}

/// `bytes` of zeroed page-locked memory mapped into every context, never freed: its (host,
/// device) addresses. Allowed while the calling thread's stream is being captured.
pub(super) fn alloc_mapped(bytes: usize) -> Result<(usize, u64)> {
    super::with_relaxed_capture(|| {
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        let flags = cu::CU_MEMHOSTALLOC_PORTABLE | cu::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: a valid out-pointer; the block is never freed (see the module note).
        check(unsafe { cu::cuMemHostAlloc(&mut host, bytes, flags) }, "cuMemHostAlloc")?;
        // SAFETY: fresh, writable, `bytes` long.
        unsafe { std::ptr::write_bytes(host as *mut u8, 0, bytes) };
        let mut dev: cu::CUdeviceptr = 0;
        // SAFETY: `host` was allocated with DEVICEMAP just above.
        check(unsafe { cu::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) }, "cuMemHostGetDevicePointer")?;
        Ok((host as usize, dev))
    })
}

impl Drop for PinnedSlot {
    fn drop(&mut self) {
        if !self.poisoned {
            FREE.lock().unwrap_or_else(|e| e.into_inner()).slots.push((self.host, self.device));
        }
    }
}
