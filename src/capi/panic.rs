//! The one gate every exported function goes through: it runs the body, turns an `Error` into
//! the function's C return value and the thread's last-error message, and catches panics so
//! that no unwind crosses the C boundary (which would be undefined behaviour).

use crate::error::{Error, Status};
use std::cell::RefCell;
use std::ffi::{CString, c_char, c_uint, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};

thread_local! {
    /// The message of this thread's most recent failing call; "" until one fails.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Record `message` as this thread's last error.
pub(crate) fn set_last_error(message: String) {
    // Interior NULs would truncate the C string; messages are ours, but names in them (config
    // variables, paths) come from users.
    let c = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    // `try_with`: during thread teardown the slot may be gone; losing the message then is fine.
    let _ = LAST_ERROR.try_with(|slot| *slot.borrow_mut() = c);
}

/// The last-error message as a C string, valid until the next failing call on this thread.
pub(crate) fn last_error_ptr() -> *const c_char {
    static EMPTY: &[u8] = b"\0";
    LAST_ERROR
        .try_with(|slot| slot.borrow().as_ptr())
        // The CString lives in the thread-local until replaced by the next failing call on this
        // same thread, which is the documented lifetime of the returned pointer.
        .unwrap_or(EMPTY.as_ptr() as *const c_char)
}

/// What an exported function returns when it fails.
pub(crate) trait FfiReturn {
    fn from_error(e: &Error) -> Self;
}

/// `gsc_status_t`.
impl FfiReturn for i32 {
    fn from_error(e: &Error) -> i32 {
        e.status().code()
    }
}

/// `gsc_status_ptr_t`: the error encoded as a pointer-sized integer (`(void*)(intptr_t)status`).
impl FfiReturn for *mut c_void {
    fn from_error(e: &Error) -> *mut c_void {
        encode_status(e.status())
    }
}

/// `void` functions: the last-error message is all the caller gets.
impl FfiReturn for () {
    fn from_error(_: &Error) {}
}

/// `gsc_worker_progress`: 0 events.
impl FfiReturn for c_uint {
    fn from_error(_: &Error) -> c_uint {
        0
    }
}

/// String-returning functions (`gsc_status_string`, `gsc_last_error_message`): never NULL.
impl FfiReturn for *const c_char {
    fn from_error(_: &Error) -> *const c_char {
        Status::Internal.description_c().as_ptr() as *const c_char
    }
}

/// `gsc_tag_probe_nb`: NULL, as for "no message".
impl FfiReturn for *mut TagMessage {
    fn from_error(_: &Error) -> *mut TagMessage {
        std::ptr::null_mut()
    }
}

/// The opaque `struct gsc_tag_message` (`gsc_tag_message_h` points to it, by type only: the
/// handle is an encoded integer).
#[repr(C)]
pub struct TagMessage {
    _opaque: [u8; 0],
}

/// Encode an error status as a status pointer.
pub(crate) fn encode_status(status: Status) -> *mut c_void {
    status.code() as isize as *mut c_void
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_string()
    }
}

/// Run the body of exported function `name`. Errors become the C return value plus the
/// thread's last-error message ("name: GSC_ERR_X: what was wrong"); a panic becomes
/// `GSC_ERR_INTERNAL` the same way, and is logged.
pub(crate) fn ffi_guard<R: FfiReturn>(name: &'static str, body: impl FnOnce() -> Result<R, Error>) -> R {
    // AssertUnwindSafe: after a panic nothing the body touched is used again by this call, and
    // shared state the library keeps behind mutexes recovers from poisoning on its own.
    let error = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(r)) => return r,
        Ok(Err(e)) => e,
        Err(payload) => {
            let e = Error::new(Status::Internal, format!("panic (a bug in gscomm): {}", panic_message(&*payload)));
            tracing::error!(target: crate::log::CAPI, function = name, error = %e, "caught a panic at the C boundary");
            e
        }
    };
    set_last_error(format!("{name}: {}: {}", error.status().c_name(), error.message()));
    R::from_error(&error)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn last() -> String {
        // SAFETY: `last_error_ptr` returns a NUL-terminated string owned by this thread.
        unsafe { CStr::from_ptr(last_error_ptr()) }.to_string_lossy().into_owned()
    }

    #[test]
    fn errors_and_panics_become_statuses_and_messages() {
        let r: i32 = ffi_guard("gsc_test", || Err(Error::invalid_param("count is odd")));
        assert_eq!(r, Status::InvalidParam.code());
        assert_eq!(last(), "gsc_test: GSC_ERR_INVALID_PARAM: count is odd");

        let r: *mut c_void = ffi_guard("gsc_test_ptr", || -> Result<*mut c_void, Error> { panic!("boom") });
        assert_eq!(r as isize, Status::Internal.code() as isize);
        assert!(last().contains("gsc_test_ptr: GSC_ERR_INTERNAL: panic (a bug in gscomm): boom"), "{}", last());

        // Success leaves the message alone.
        let r: i32 = ffi_guard("gsc_ok", || Ok(0));
        assert_eq!(r, 0);
        assert!(last().contains("boom"));
    }
}
