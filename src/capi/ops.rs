//! Tagged messages, requests and remote memory access exports.

use super::handles;
use super::panic::{TagMessage, ffi_guard};
use super::params::{self, OpKind, RequestParam, TagRecvInfo, request_handle};
use super::worker::{CEp, CWorker};
use crate::core::memory::RKEY_BYTES;
use crate::core::{Completion, Endpoint, Rkey, Worker, worker_of_request};
use crate::error::{Error, Result, Status};
use std::ffi::{c_int, c_void};
use std::sync::Arc;

/// Opaque C handle type (by type only).
#[repr(C)]
pub struct CRkey {
    _opaque: [u8; 0],
}

/// `gsc_tag_send_nbx`
///
/// # Safety
/// `buffer` is readable for `count` bytes and unmodified until the operation completes; `param`
/// is NULL or a readable `gsc_request_param_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_tag_send_nbx(
    ep: *mut CEp,
    buffer: *const c_void,
    count: usize,
    tag: u64,
    param: *const RequestParam,
) -> *mut c_void {
    ffi_guard("gsc_tag_send_nbx", || {
        let e: Arc<Endpoint> = handles::get(ep as *const c_void)?;
        // SAFETY: forwarded caller contract.
        let conv = unsafe { params::convert(param, OpKind::Send) }?;
        // SAFETY: forwarded caller contract on `buffer` (the Rust API checks NULL and wrapping).
        let started = unsafe { e.tag_send_nbx(buffer as *const u8, count, tag, conv.params) }?;
        Ok(params::status_ptr(started, conv.out))
    })
}

/// `gsc_tag_recv_nbx`
///
/// # Safety
/// `buffer` is writable for `count` bytes and not accessed until the request completes; `param`
/// is NULL or a readable `gsc_request_param_t` (with `recv_info.tag_info` writable if flagged).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_tag_recv_nbx(
    worker: *mut CWorker,
    buffer: *mut c_void,
    count: usize,
    tag: u64,
    tag_mask: u64,
    param: *const RequestParam,
) -> *mut c_void {
    ffi_guard("gsc_tag_recv_nbx", || {
        let w: Worker = handles::get(worker as *const c_void)?;
        // SAFETY: forwarded caller contract.
        let conv = unsafe { params::convert(param, OpKind::Recv) }?;
        // SAFETY: forwarded caller contract on `buffer`.
        let started = unsafe { w.tag_recv_nbx(buffer as *mut u8, count, tag, tag_mask, conv.params) }?;
        Ok(params::status_ptr(started, conv.out))
    })
}

/// Message handles: worker id in the top 16 bits (as in request handles), the probe's message
/// id below; a probe without remove returns the bare worker id part ("found", not receivable).
const MSG_ID_BITS: u32 = 48;
const MSG_ID_MASK: u64 = (1 << MSG_ID_BITS) - 1;

/// `gsc_tag_probe_nb`
///
/// # Safety
/// `info` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_tag_probe_nb(
    worker: *mut CWorker,
    tag: u64,
    tag_mask: u64,
    remove: c_int,
    info: *mut TagRecvInfo,
) -> *mut TagMessage {
    ffi_guard("gsc_tag_probe_nb", || {
        let w: Worker = handles::get(worker as *const c_void)?;
        if info.is_null() {
            return Err(Error::invalid_param("info is NULL"));
        }
        let Some(found) = w.tag_probe(tag, tag_mask, remove != 0) else {
            return Ok(std::ptr::null_mut());
        };
        // SAFETY: non-NULL (checked), writable by the caller's contract.
        unsafe { info.write(TagRecvInfo { sender_tag: found.tag, length: found.length }) };
        let id = found.msg.unwrap_or(0);
        if id > MSG_ID_MASK {
            return Err(Error::new(Status::NoResource, "message ids exhausted on this worker"));
        }
        let handle = ((w.inner.id as u64) << MSG_ID_BITS) | id;
        Ok(handle as usize as *mut TagMessage)
    })
}

/// `gsc_tag_msg_recv_nbx`
///
/// # Safety
/// As `gsc_tag_recv_nbx`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_tag_msg_recv_nbx(
    worker: *mut CWorker,
    buffer: *mut c_void,
    count: usize,
    message: *mut TagMessage,
    param: *const RequestParam,
) -> *mut c_void {
    ffi_guard("gsc_tag_msg_recv_nbx", || {
        let w: Worker = handles::get(worker as *const c_void)?;
        let m = message as usize as u64;
        if m == 0 {
            return Err(Error::new(Status::InvalidHandle, "message is NULL"));
        }
        if (m >> MSG_ID_BITS) != w.inner.id as u64 {
            return Err(Error::new(Status::InvalidHandle, format!("message handle {message:p} was not probed on this worker")));
        }
        if m & MSG_ID_MASK == 0 {
            return Err(Error::new(Status::InvalidHandle, "message handle comes from a probe without remove; it cannot be received"));
        }
        // SAFETY: forwarded caller contract.
        let conv = unsafe { params::convert(param, OpKind::Recv) }?;
        // SAFETY: forwarded caller contract on `buffer`.
        let started = unsafe { w.tag_msg_recv_nbx(buffer as *mut u8, count, m & MSG_ID_MASK, conv.params) }?;
        Ok(params::status_ptr(started, conv.out))
    })
}

/// Report a finished request: fill `info` (may be NULL) and turn a failure into an error (so the
/// last-error message says what happened), success into `GSC_OK`.
///
/// # Safety
/// `info` is NULL or writable.
unsafe fn finished(handle: u64, c: Completion, info: *mut TagRecvInfo) -> Result<i32> {
    if !info.is_null() {
        // SAFETY: non-NULL, writable by the caller's contract.
        unsafe { info.write(c.info.into()) };
    }
    if c.status.is_error() {
        return Err(Error::new(
            c.status,
            format!("request {handle:#x} completed with {} (message length {})", c.status.description(), c.info.length),
        ));
    }
    Ok(c.status.code())
}

/// `gsc_request_check_status`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_request_check_status(request: *mut c_void) -> i32 {
    ffi_guard("gsc_request_check_status", || {
        let h = request_handle(request)?;
        match worker_of_request(h)?.request_test(h)? {
            None => Ok(Status::InProgress.code()),
            // SAFETY: NULL info.
            Some(c) => unsafe { finished(h, c, std::ptr::null_mut()) },
        }
    })
}

/// `gsc_tag_recv_request_test`
///
/// # Safety
/// `info` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_tag_recv_request_test(request: *mut c_void, info: *mut TagRecvInfo) -> i32 {
    ffi_guard("gsc_tag_recv_request_test", || {
        let h = request_handle(request)?;
        match worker_of_request(h)?.request_test(h)? {
            None => Ok(Status::InProgress.code()),
            // SAFETY: forwarded caller contract on `info`.
            Some(c) => unsafe { finished(h, c, info) },
        }
    })
}

/// `gsc_request_wait`
///
/// # Safety
/// `info` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_request_wait(request: *mut c_void, info: *mut TagRecvInfo) -> i32 {
    ffi_guard("gsc_request_wait", || {
        let h = request_handle(request)?;
        let c = worker_of_request(h)?.request_wait(h)?;
        // SAFETY: forwarded caller contract on `info`.
        unsafe { finished(h, c, info) }
    })
}

/// `gsc_request_cancel`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_request_cancel(worker: *mut CWorker, request: *mut c_void) -> i32 {
    ffi_guard("gsc_request_cancel", || {
        let w: Worker = handles::get(worker as *const c_void)?;
        w.request_cancel(request_handle(request)?)?;
        Ok(Status::Ok.code())
    })
}

/// `gsc_request_area`
///
/// # Safety
/// `area_p` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_request_area(request: *mut c_void, area_p: *mut *mut c_void) -> i32 {
    ffi_guard("gsc_request_area", || {
        if area_p.is_null() {
            return Err(Error::invalid_param("area_p is NULL"));
        }
        let h = request_handle(request)?;
        let area = worker_of_request(h)?.request_area(h)?;
        // SAFETY: non-NULL (checked) and writable by the caller's contract.
        unsafe { area_p.write(area) };
        Ok(Status::Ok.code())
    })
}

/// `gsc_request_free`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_request_free(request: *mut c_void) {
    ffi_guard("gsc_request_free", || {
        let r = request_handle(request).and_then(|h| worker_of_request(h)?.request_release(h));
        if let Err(e) = &r {
            // void in the API: the log and the last-error message are the only reports.
            tracing::warn!(target: crate::log::CAPI, request = ?request, error = %e, "gsc_request_free on an invalid request");
        }
        r
    })
}

/// `gsc_ep_rkey_unpack`
///
/// # Safety
/// `buffer` is NULL or readable for a whole packed rkey (as `gsc_rkey_pack` produced it);
/// `rkey_p` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_ep_rkey_unpack(ep: *mut CEp, buffer: *const c_void, rkey_p: *mut *mut CRkey) -> i32 {
    ffi_guard("gsc_ep_rkey_unpack", || {
        let e: Arc<Endpoint> = handles::get(ep as *const c_void)?;
        if buffer.is_null() {
            return Err(Error::invalid_param("buffer is NULL"));
        }
        if rkey_p.is_null() {
            return Err(Error::invalid_param("rkey_p is NULL"));
        }
        // SAFETY: non-NULL; a packed rkey has a fixed size, and the caller passes a whole one.
        let bytes = unsafe { std::slice::from_raw_parts(buffer as *const u8, RKEY_BYTES) };
        let rkey = e.rkey_unpack(bytes)?;
        // Remote keys are plain data (no resources): they do not need a parent.
        let h = handles::register(rkey, std::ptr::null());
        // SAFETY: non-NULL (checked), writable by the caller's contract.
        unsafe { rkey_p.write(h as *mut CRkey) };
        Ok(Status::Ok.code())
    })
}

/// `gsc_rkey_destroy`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_rkey_destroy(rkey: *mut CRkey) -> i32 {
    ffi_guard("gsc_rkey_destroy", || {
        handles::unregister::<Rkey>(rkey as *const c_void)?;
        Ok(Status::Ok.code())
    })
}

/// `gsc_put_nbx`
///
/// # Safety
/// `buffer` is readable for `count` bytes until the operation completes; `param` is NULL or a
/// readable `gsc_request_param_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_put_nbx(
    ep: *mut CEp,
    buffer: *const c_void,
    count: usize,
    remote_addr: u64,
    rkey: *mut CRkey,
    param: *const RequestParam,
) -> *mut c_void {
    ffi_guard("gsc_put_nbx", || {
        let e: Arc<Endpoint> = handles::get(ep as *const c_void)?;
        let key: Rkey = handles::get(rkey as *const c_void)?;
        // SAFETY: forwarded caller contract.
        let conv = unsafe { params::convert(param, OpKind::Send) }?;
        // SAFETY: forwarded caller contract on `buffer`.
        let started = unsafe { e.put_nbx(buffer as *const u8, count, remote_addr, &key, conv.params) }?;
        Ok(params::status_ptr(started, conv.out))
    })
}

/// `gsc_get_nbx`
///
/// # Safety
/// `buffer` is writable for `count` bytes until the operation completes; `param` is NULL or a
/// readable `gsc_request_param_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_get_nbx(
    ep: *mut CEp,
    buffer: *mut c_void,
    count: usize,
    remote_addr: u64,
    rkey: *mut CRkey,
    param: *const RequestParam,
) -> *mut c_void {
    ffi_guard("gsc_get_nbx", || {
        let e: Arc<Endpoint> = handles::get(ep as *const c_void)?;
        let key: Rkey = handles::get(rkey as *const c_void)?;
        // SAFETY: forwarded caller contract.
        let conv = unsafe { params::convert(param, OpKind::Send) }?;
        // SAFETY: forwarded caller contract on `buffer`.
        let started = unsafe { e.get_nbx(buffer as *mut u8, count, remote_addr, &key, conv.params) }?;
        Ok(params::status_ptr(started, conv.out))
    })
}
