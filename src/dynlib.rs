//! Shared libraries opened at run time (`dlopen`), for the optional native libraries gscomm
//! drives without linking them (UCX, rdma-core): `cargo build` needs none of them, and a missing
//! one is an error value of the lane or engine that wanted it, not a load failure of gscomm.

use std::ffi::{CStr, CString, c_void};
use std::ptr::NonNull;

/// A `dlopen` handle, kept for the life of the process (never closed: function pointers taken
/// from it are stored in statics).
pub(crate) struct Library {
    pub(crate) name: String,
    handle: NonNull<c_void>,
}

// SAFETY: a dlopen handle is an opaque token; dlsym on it may be called from any thread.
unsafe impl Send for Library {}
// SAFETY: as above; the handle is never mutated or closed.
unsafe impl Sync for Library {}

fn dlerror_text() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string valid until the next dl* call on
    // this thread; it is copied at once.
    let why = unsafe { libc::dlerror() };
    if why.is_null() {
        String::from("unknown reason")
    } else {
        // SAFETY: non-null, NUL-terminated (above).
        unsafe { CStr::from_ptr(why) }.to_string_lossy().into_owned()
    }
}

impl Library {
    /// Open `name` (a soname), or say why not (dlerror's text).
    pub(crate) fn open(name: &str) -> Result<Library, String> {
        let cname = CString::new(name).map_err(|_| format!("bad library name {name:?}"))?;
        // SAFETY: a NUL-terminated name. Loading runs the library's constructors, which for the
        // libraries opened here (UCX, rdma-core) only set up their own state.
        let handle = unsafe { libc::dlopen(cname.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        NonNull::new(handle).map(|handle| Library { name: name.to_string(), handle }).ok_or_else(dlerror_text)
    }

    /// The function `symbol` as a `T`, or `None` if the library does not export it.
    ///
    /// # Safety
    /// `T` must be the function-pointer type of the C function named `symbol` (one of the
    /// bindgen-generated `sys::*_fn` types for that name).
    pub(crate) unsafe fn function<T: Copy>(&self, symbol: &str) -> Option<T> {
        assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>(), "{symbol}: not a function pointer type");
        let cname = CString::new(symbol).ok()?;
        // SAFETY: a live handle and a NUL-terminated name.
        let p = unsafe { libc::dlsym(self.handle.as_ptr(), cname.as_ptr()) };
        if p.is_null() {
            None
        } else {
            // SAFETY: the caller guarantees `T` is this symbol's function-pointer type, and the
            // sizes match (asserted above).
            Some(unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
        }
    }
}
