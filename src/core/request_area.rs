//! Caller-owned space inside each request: UCP's `request_size` / `request_init` /
//! `request_cleanup`, for MPI libraries.
//!
//! An MPI library keeps per-operation state (a pointer back to its MPI_Request, a status to
//! fill) with each of our requests. With UCX it asks for `request_size` extra bytes in every
//! request and reaches them through the request pointer; our requests are handles, so the bytes
//! come from `Worker::request_area(handle)`. As in UCP, `init` runs once when an area is first
//! allocated, not on every reuse (areas are pooled per worker and handed back unchanged), and
//! `cleanup` once when it is finally freed; the area stays valid from the call that returned the
//! request until the request is freed, and during its completion callback even when the handle
//! was released before completion.

use crate::error::{Error, Result};
use std::alloc::{Layout, alloc_zeroed, dealloc, handle_alloc_error};
use std::ffi::c_void;
use std::ptr::NonNull;

/// A hook run on an area (its address).
pub type AreaHook = unsafe extern "C" fn(*mut c_void);

/// Largest area accepted: per-request state, not a buffer.
pub const MAX_AREA: usize = 64 * 1024;
/// Alignment of every area (enough for any scalar a C struct holds).
const ALIGN: usize = 16;
/// Released areas a worker keeps for reuse; beyond this they are freed.
const MAX_POOLED: usize = 4096;

/// What every request of a context carries.
#[derive(Copy, Clone, Debug)]
pub struct RequestAreaSpec {
    /// Bytes (1 to `MAX_AREA`); zeroed before `init`.
    pub size: usize,
    /// Run once on a new area.
    pub init: Option<AreaHook>,
    /// Run once on an area before it is freed (worker destroyed, or the pool is full).
    pub cleanup: Option<AreaHook>,
}

impl RequestAreaSpec {
    pub(crate) fn validate(&self) -> Result<()> {
        if self.size == 0 || self.size > MAX_AREA {
            return Err(Error::invalid_param(format!("request area size {} must be from 1 to {MAX_AREA} bytes", self.size)));
        }
        Ok(())
    }
}

/// One request's area.
pub(crate) struct Area {
    ptr: NonNull<u8>,
    size: usize,
    cleanup: Option<AreaHook>,
}

// SAFETY: the area is plain memory owned by this value; the hooks are C functions the caller
// declared callable from any thread (the C API's threading rules).
unsafe impl Send for Area {}

impl Area {
    fn new(spec: &RequestAreaSpec) -> Area {
        let layout = Layout::from_size_align(spec.size, ALIGN).expect("validated size");
        // SAFETY: non-zero size (validated).
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) }).unwrap_or_else(|| handle_alloc_error(layout));
        if let Some(init) = spec.init {
            // SAFETY: the caller's hook, given an area of the size it asked for.
            unsafe { init(ptr.as_ptr().cast()) };
        }
        Area { ptr, size: spec.size, cleanup: spec.cleanup }
    }

    pub(crate) fn as_ptr(&self) -> *mut c_void {
        self.ptr.as_ptr().cast()
    }
}

impl Drop for Area {
    fn drop(&mut self) {
        if let Some(cleanup) = self.cleanup {
            // SAFETY: the caller's hook, on an area `init` prepared; it is freed right after.
            unsafe { cleanup(self.as_ptr()) };
        }
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), Layout::from_size_align(self.size, ALIGN).expect("validated size")) };
    }
}

/// A worker's areas: handed to new requests, taken back from freed ones.
pub(crate) struct AreaPool {
    spec: Option<RequestAreaSpec>,
    free: Vec<Area>,
}

impl AreaPool {
    pub(crate) fn new(spec: Option<RequestAreaSpec>) -> AreaPool {
        AreaPool { spec, free: Vec::new() }
    }

    /// An area for a new request; `None` when the context asked for none.
    pub(crate) fn take(&mut self) -> Option<Area> {
        let spec = self.spec.as_ref()?;
        Some(self.free.pop().unwrap_or_else(|| Area::new(spec)))
    }

    /// A freed request's area, kept for the next one.
    pub(crate) fn give(&mut self, area: Area) {
        if self.free.len() < MAX_POOLED {
            self.free.push(area);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    static INITS: AtomicUsize = AtomicUsize::new(0);
    static CLEANUPS: AtomicUsize = AtomicUsize::new(0);

    unsafe extern "C" fn init(p: *mut c_void) {
        // SAFETY: the pool hands out areas of at least 8 bytes in this test, 16-aligned.
        unsafe {
            assert_eq!(*(p as *const u64), 0, "areas are zeroed before init");
            *(p as *mut u64) = 0xfeed;
        }
        INITS.fetch_add(1, Ordering::SeqCst);
    }

    unsafe extern "C" fn cleanup(p: *mut c_void) {
        // SAFETY: as in `init`.
        assert_eq!(unsafe { *(p as *const u64) }, 0xfeed, "cleanup sees what init left");
        CLEANUPS.fetch_add(1, Ordering::SeqCst);
    }

    #[test]
    fn init_once_per_area_reuse_without_init_cleanup_once() {
        let spec = RequestAreaSpec { size: 24, init: Some(init), cleanup: Some(cleanup) };
        spec.validate().unwrap();
        let mut pool = AreaPool::new(Some(spec));
        let a = pool.take().unwrap();
        let b = pool.take().unwrap();
        assert_eq!(a.as_ptr() as usize % ALIGN, 0);
        assert_eq!(INITS.load(Ordering::SeqCst), 2);
        let addr = a.as_ptr();
        pool.give(a);
        let c = pool.take().unwrap();
        assert_eq!(c.as_ptr(), addr, "a freed area is reused");
        assert_eq!(INITS.load(Ordering::SeqCst), 2, "and not initialized again");
        drop((b, c));
        assert_eq!(CLEANUPS.load(Ordering::SeqCst), 2);
        drop(pool);
        assert!(AreaPool::new(None).take().is_none());
        assert!(RequestAreaSpec { size: 0, init: None, cleanup: None }.validate().is_err());
        assert!(RequestAreaSpec { size: MAX_AREA + 1, init: None, cleanup: None }.validate().is_err());
    }
}
