//! The C ABI (include/gsc.h): converts arguments, checks them, catches panics and calls the Rust
//! API. It has no logic of its own beyond what the ABI needs:
//!
//! - `panic`: `ffi_guard`, the gate every export goes through (errors become return values and
//!   the thread's last-error message; panics become `GSC_ERR_INTERNAL`);
//! - `handles`: the registry that validates context/worker/endpoint/memory/rkey handles, and the
//!   library-owned buffers (addresses, packed rkeys);
//! - `params`: the `#[repr(C)]` mirrors of the parameter structs and their conversion;
//! - `context`, `worker`, `ops`, `condition`, `bootstrap`, `comm`: the exported functions, grouped like
//!   the header.
//!
//! Request handles are the Rust API's `u64` handles passed as pointer-sized integers (never 0,
//! never in the error range), looked up through `worker_of_request`: a stale or freed request is
//! an error, never a dangling pointer.

#[cfg(not(target_pointer_width = "64"))]
compile_error!("the gscomm C API passes 64-bit request handles as pointers and needs a 64-bit target");

mod bootstrap;
mod comm;
mod condition;
mod context;
mod handles;
mod ops;
mod panic;
mod params;
mod prepared;
mod worker;

#[cfg(test)]
mod tests;

use self::panic::{ffi_guard, last_error_ptr};
use crate::error::Status;
use std::ffi::{c_char, c_uint};

/// `gsc_get_version`
///
/// # Safety
/// Each pointer is NULL or points to a writable `unsigned`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_get_version(major_p: *mut c_uint, minor_p: *mut c_uint, patch_p: *mut c_uint) {
    ffi_guard("gsc_get_version", || {
        let parts = [
            (major_p, env!("CARGO_PKG_VERSION_MAJOR")),
            (minor_p, env!("CARGO_PKG_VERSION_MINOR")),
            (patch_p, env!("CARGO_PKG_VERSION_PATCH")),
        ];
        for (p, text) in parts {
            let v: c_uint =
                text.parse().map_err(|_| crate::Error::new(Status::Internal, format!("version part {text:?} is not a number")))?;
            if !p.is_null() {
                // SAFETY: non-NULL, and the caller passes a writable unsigned.
                unsafe { p.write(v) };
            }
        }
        Ok(())
    })
}

/// `gsc_status_string`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_status_string(status: i32) -> *const c_char {
    ffi_guard("gsc_status_string", || {
        let text = match Status::from_code(status) {
            Some(s) => s.description_c(),
            None => "unknown status\0",
        };
        Ok(text.as_ptr() as *const c_char)
    })
}

/// `gsc_last_error_message`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_last_error_message() -> *const c_char {
    ffi_guard("gsc_last_error_message", || Ok(last_error_ptr()))
}
