//! Worker and endpoint exports.

use super::context::CContext;
use super::handles::{self, BufKind};
use super::panic::ffi_guard;
use super::params::{self, EP_PARAM_FIELD_ADDRESS, EP_PARAM_FIELD_ADDRESS_LENGTH, EpParams, OpKind, RequestParam, WorkerParams};
use crate::core::{CloseMode, Context, Endpoint, Worker, WorkerAddress};
use crate::error::{Error, Status};
use std::ffi::{c_uint, c_void};
use std::sync::Arc;

/// Opaque C handle types (by type only).
#[repr(C)]
pub struct CWorker {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct CEp {
    _opaque: [u8; 0],
}

/// `gsc_worker_create`
///
/// # Safety
/// `params` is NULL or a readable `gsc_worker_params_t`; `worker_p` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_worker_create(context: *mut CContext, params: *const WorkerParams, worker_p: *mut *mut CWorker) -> i32 {
    ffi_guard("gsc_worker_create", || {
        let ctx: Context = handles::get(context as *const c_void)?;
        if worker_p.is_null() {
            return Err(Error::invalid_param("worker_p is NULL"));
        }
        if !params.is_null() {
            // SAFETY: non-NULL; the caller passes a readable gsc_worker_params_t.
            let mask = unsafe { (*params).field_mask };
            if mask != 0 {
                return Err(Error::invalid_param(format!("params->field_mask {mask:#x}: no worker parameter is defined in this version")));
            }
        }
        let worker = ctx.create_worker()?;
        let h = handles::register(worker, context as *const c_void);
        // SAFETY: non-NULL (checked), writable by the caller's contract.
        unsafe { worker_p.write(h as *mut CWorker) };
        Ok(Status::Ok.code())
    })
}

/// `gsc_worker_destroy`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_worker_destroy(worker: *mut CWorker) -> i32 {
    ffi_guard("gsc_worker_destroy", || {
        handles::unregister::<Worker>(worker as *const c_void)?;
        Ok(Status::Ok.code())
    })
}

/// `gsc_worker_abort`
///
/// # Safety
/// `reason` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_worker_abort(worker: *mut CWorker, reason: *const std::ffi::c_char) -> i32 {
    ffi_guard("gsc_worker_abort", || {
        let w = handles::get::<Worker>(worker as *const c_void)?;
        let reason = if reason.is_null() {
            "gsc_worker_abort".into()
        } else {
            // SAFETY: non-NULL and NUL-terminated by the caller's contract.
            unsafe { std::ffi::CStr::from_ptr(reason) }.to_string_lossy()
        };
        w.abort(&reason)?;
        Ok(Status::Ok.code())
    })
}

/// `gsc_worker_get_address`
///
/// # Safety
/// `address_p` and `length_p` are NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_worker_get_address(worker: *mut CWorker, address_p: *mut *mut c_void, length_p: *mut usize) -> i32 {
    ffi_guard("gsc_worker_get_address", || {
        let w: Worker = handles::get(worker as *const c_void)?;
        if address_p.is_null() || length_p.is_null() {
            return Err(Error::invalid_param(if address_p.is_null() { "address_p is NULL" } else { "length_p is NULL" }));
        }
        let (ptr, len) = handles::give_buffer(BufKind::Address { worker: worker as usize }, w.address());
        // SAFETY: both non-NULL (checked), writable by the caller's contract.
        unsafe {
            address_p.write(ptr);
            length_p.write(len);
        }
        Ok(Status::Ok.code())
    })
}

/// `gsc_worker_release_address`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_worker_release_address(worker: *mut CWorker, address: *mut c_void) -> i32 {
    ffi_guard("gsc_worker_release_address", || {
        // The worker may be gone already (released with its context): the buffer is still ours
        // to free, so only its identity as a handle matters, not its liveness.
        if worker.is_null() {
            return Err(Error::new(Status::InvalidHandle, "gsc_worker_h is NULL"));
        }
        handles::take_buffer(address, BufKind::Address { worker: worker as usize }, "address")?;
        Ok(Status::Ok.code())
    })
}

/// `gsc_worker_progress`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_worker_progress(worker: *mut CWorker) -> c_uint {
    ffi_guard("gsc_worker_progress", || {
        let w: Worker = handles::get(worker as *const c_void)?;
        Ok(w.progress().min(c_uint::MAX as usize) as c_uint)
    })
}

/// `gsc_worker_flush_nbx`
///
/// # Safety
/// `param` is NULL or a readable `gsc_request_param_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_worker_flush_nbx(worker: *mut CWorker, param: *const RequestParam) -> *mut c_void {
    ffi_guard("gsc_worker_flush_nbx", || {
        let w: Worker = handles::get(worker as *const c_void)?;
        // SAFETY: forwarded caller contract.
        let conv = unsafe { params::convert(param, OpKind::Send) }?;
        Ok(params::status_ptr(w.flush_nbx(conv.params)?, conv.out))
    })
}

/// `gsc_ep_create`
///
/// # Safety
/// `params` is NULL or a readable `gsc_ep_params_t` whose address is readable (for
/// `address_length` bytes, or for the whole packed address); `ep_p` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_ep_create(worker: *mut CWorker, params: *const EpParams, ep_p: *mut *mut CEp) -> i32 {
    ffi_guard("gsc_ep_create", || {
        let w: Worker = handles::get(worker as *const c_void)?;
        if params.is_null() {
            return Err(Error::invalid_param("params is NULL"));
        }
        if ep_p.is_null() {
            return Err(Error::invalid_param("ep_p is NULL"));
        }
        // SAFETY: non-NULL; the caller passes a readable gsc_ep_params_t.
        let p = unsafe { &*params };
        let known = EP_PARAM_FIELD_ADDRESS | EP_PARAM_FIELD_ADDRESS_LENGTH;
        if p.field_mask & !known != 0 {
            return Err(Error::invalid_param(format!("params->field_mask has unknown bits {:#x}", p.field_mask & !known)));
        }
        if p.field_mask & EP_PARAM_FIELD_ADDRESS == 0 || p.address.is_null() {
            return Err(Error::invalid_param("params->address is required (GSC_EP_PARAM_FIELD_ADDRESS, non-NULL)"));
        }
        let len = if p.field_mask & EP_PARAM_FIELD_ADDRESS_LENGTH != 0 {
            p.address_length
        } else {
            // SAFETY: the caller guarantees a whole packed address at `address`.
            unsafe { WorkerAddress::packed_len(p.address as *const u8) }?
        };
        // SAFETY: readable for `len` bytes: the caller's stated length, or the address's own.
        let bytes = unsafe { std::slice::from_raw_parts(p.address as *const u8, len) };
        let ep = w.connect(bytes)?;
        let h = handles::register(Arc::new(ep), worker as *const c_void);
        // SAFETY: non-NULL (checked), writable by the caller's contract.
        unsafe { ep_p.write(h as *mut CEp) };
        Ok(Status::Ok.code())
    })
}

/// `gsc_ep_close_nbx`
///
/// # Safety
/// `param` is NULL or a readable `gsc_request_param_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_ep_close_nbx(ep: *mut CEp, param: *const RequestParam) -> *mut c_void {
    ffi_guard("gsc_ep_close_nbx", || {
        let e: Arc<Endpoint> = handles::get(ep as *const c_void)?;
        // SAFETY: forwarded caller contract.
        let conv = unsafe { params::convert(param, OpKind::Close) }?;
        let mode = if conv.force { CloseMode::Force } else { CloseMode::Flush };
        let result = e.close_nbx(mode, conv.params);
        // From here the handle is gone whatever the outcome: the endpoint is closed, closing, or
        // unusable. (Another thread may have closed it meanwhile; then there is nothing to do.)
        let _ = handles::unregister::<Arc<Endpoint>>(ep as *const c_void);
        Ok(params::status_ptr(result?, conv.out))
    })
}

/// `gsc_ep_flush_nbx`
///
/// # Safety
/// `param` is NULL or a readable `gsc_request_param_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_ep_flush_nbx(ep: *mut CEp, param: *const RequestParam) -> *mut c_void {
    ffi_guard("gsc_ep_flush_nbx", || {
        let e: Arc<Endpoint> = handles::get(ep as *const c_void)?;
        // SAFETY: forwarded caller contract.
        let conv = unsafe { params::convert(param, OpKind::Send) }?;
        Ok(params::status_ptr(e.flush_nbx(conv.params)?, conv.out))
    })
}
