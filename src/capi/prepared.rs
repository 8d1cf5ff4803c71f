//! Prepared transfers: `gsc_prepare_transfers`, `gsc_release_preparations`, starts, partitions,
//! and the MPI-shaped `gsc_tag_send_init` / `gsc_tag_recv_init`.

use super::handles;
use super::panic::ffi_guard;
use super::params::{self, MEMORY_TYPE_CUDA, MEMORY_TYPE_HOST, OpKind, RequestParam};
use super::worker::CEp;
use crate::core::{Direction, Endpoint, Engine, PrepareParams, Prepared};
use crate::error::{Error, Result};
use crate::protocols::MemType;
use std::ffi::{c_int, c_void};
use std::sync::Arc;

pub(crate) const BUFFER_PARAM_FIELD_PARTITIONS: u64 = 1 << 0;
pub(crate) const BUFFER_PARAM_FIELD_MEMORY_TYPE: u64 = 1 << 1;
pub(crate) const BUFFER_PARAM_FIELD_FLAGS: u64 = 1 << 2;
const BUFFER_PARAM_ALL: u64 = (1 << 3) - 1;
pub(crate) const PREPARE_FLAG_GPU_ROUNDS: u64 = 1 << 0;
pub(crate) const PREPARE_FLAG_PROXY: u64 = 1 << 1;
const PREPARE_FLAGS_ALL: u64 = PREPARE_FLAG_GPU_ROUNDS | PREPARE_FLAG_PROXY;
pub(crate) const PREPARE_SEND: u32 = 0;
pub(crate) const PREPARE_RECV: u32 = 1;

/// Opaque C handle type (by type only).
#[repr(C)]
pub struct CPrepared {
    _opaque: [u8; 0],
}

/// `gsc_buffer_param_t`
#[repr(C)]
pub struct BufferParam {
    pub field_mask: u64,
    /// A `gsc_prepare_direction_t`, read as an integer (a value outside the enum is an error).
    pub direction: u32,
    pub buffer: *mut c_void,
    pub length: usize,
    pub tag: u64,
    pub partitions: usize,
    pub memory_type: u32,
    pub flags: u64,
}

/// Check and convert a `gsc_buffer_param_t`.
///
/// # Safety
/// `param` is NULL or readable.
unsafe fn convert(param: *const BufferParam) -> Result<(*mut u8, usize, PrepareParams)> {
    // SAFETY: caller contract.
    let p = unsafe { param.as_ref() }.ok_or_else(|| Error::invalid_param("gsc_buffer_param_t is NULL"))?;
    if p.field_mask & !BUFFER_PARAM_ALL != 0 {
        return Err(Error::invalid_param(format!("unknown gsc_buffer_param_t field bits {:#x}", p.field_mask & !BUFFER_PARAM_ALL)));
    }
    let dir = match p.direction {
        PREPARE_SEND => Direction::Send,
        PREPARE_RECV => Direction::Recv,
        d => {
            return Err(Error::invalid_param(format!("gsc_buffer_param_t.direction {d} is neither GSC_PREPARE_SEND nor GSC_PREPARE_RECV")));
        }
    };
    let partitions = (p.field_mask & BUFFER_PARAM_FIELD_PARTITIONS != 0).then_some(p.partitions);
    let memory_type = if p.field_mask & BUFFER_PARAM_FIELD_MEMORY_TYPE != 0 {
        Some(match p.memory_type {
            MEMORY_TYPE_HOST => MemType::Host,
            MEMORY_TYPE_CUDA => MemType::Cuda,
            m => return Err(Error::invalid_param(format!("gsc_buffer_param_t.memory_type {m} is not a gsc_memory_type_t"))),
        })
    } else {
        None
    };
    let flags = if p.field_mask & BUFFER_PARAM_FIELD_FLAGS != 0 { p.flags } else { 0 };
    if flags & !PREPARE_FLAGS_ALL != 0 {
        return Err(Error::invalid_param(format!("unknown gsc_buffer_param_t.flags bits {:#x}", flags & !PREPARE_FLAGS_ALL)));
    }
    let engine = match (flags & PREPARE_FLAG_GPU_ROUNDS != 0, flags & PREPARE_FLAG_PROXY != 0) {
        (true, true) => {
            return Err(Error::invalid_param(
                "gsc_buffer_param_t.flags: GSC_PREPARE_FLAG_GPU_ROUNDS and GSC_PREPARE_FLAG_PROXY exclude each other",
            ));
        }
        (true, false) => Engine::Gpu,
        (false, true) => Engine::Proxy,
        (false, false) => Engine::Auto,
    };
    Ok((p.buffer as *mut u8, p.length, PrepareParams { dir, tag: p.tag, partitions, memory_type, engine }))
}

/// Prepare on `ep` and register the handle as the endpoint's child.
///
/// # Safety
/// `buf` stays valid (see `Endpoint::prepare`); `out` is writable.
unsafe fn prepare_into(ep: *mut CEp, buf: *mut u8, len: usize, params: PrepareParams, out: *mut *mut CPrepared) -> Result<()> {
    if out.is_null() {
        return Err(Error::invalid_param("the handle out-pointer is NULL"));
    }
    let e: Arc<Endpoint> = handles::get(ep as *const c_void)?;
    // SAFETY: forwarded caller contract on `buf`.
    let prepared = unsafe { e.prepare(buf, len, params) }?;
    let h = handles::register(Arc::new(prepared), ep as *const c_void);
    // SAFETY: checked non-NULL; caller contract says writable.
    unsafe { out.write(h as *mut CPrepared) };
    Ok(())
}

/// `gsc_prepare_transfers`: `prepared_memh` is a `gsc_prepared_h *` that receives the handle.
///
/// # Safety
/// `param` is NULL or readable, its buffer valid until the preparation is released;
/// `prepared_memh` is NULL or a writable `gsc_prepared_h`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_prepare_transfers(ep: *mut CEp, prepared_memh: *mut c_void, param: *const BufferParam) -> c_int {
    ffi_guard("gsc_prepare_transfers", || {
        // SAFETY: forwarded caller contract.
        let (buf, len, params) = unsafe { convert(param) }?;
        // SAFETY: forwarded caller contract.
        unsafe { prepare_into(ep, buf, len, params, prepared_memh as *mut *mut CPrepared) }.map(|()| 0)
    })
}

/// `gsc_tag_send_init`
///
/// # Safety
/// `buffer` is readable for `count` bytes until the preparation is released; `prepared_p` is
/// NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_tag_send_init(
    ep: *mut CEp,
    buffer: *const c_void,
    count: usize,
    tag: u64,
    prepared_p: *mut *mut CPrepared,
) -> c_int {
    ffi_guard("gsc_tag_send_init", || {
        let params = PrepareParams { dir: Direction::Send, tag, partitions: None, memory_type: None, engine: Engine::Auto };
        // SAFETY: forwarded caller contract (a send only reads its buffer).
        unsafe { prepare_into(ep, buffer as *mut u8, count, params, prepared_p) }.map(|()| 0)
    })
}

/// `gsc_tag_recv_init`
///
/// # Safety
/// `buffer` is writable for `count` bytes until the preparation is released; `prepared_p` is
/// NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_tag_recv_init(
    ep: *mut CEp,
    buffer: *mut c_void,
    count: usize,
    tag: u64,
    prepared_p: *mut *mut CPrepared,
) -> c_int {
    ffi_guard("gsc_tag_recv_init", || {
        let params = PrepareParams { dir: Direction::Recv, tag, partitions: None, memory_type: None, engine: Engine::Auto };
        // SAFETY: forwarded caller contract.
        unsafe { prepare_into(ep, buffer as *mut u8, count, params, prepared_p) }.map(|()| 0)
    })
}

/// `gsc_prepared_start`
///
/// # Safety
/// `param` is NULL or a readable `gsc_request_param_t` (its memory type is ignored: the
/// preparation fixed it).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_prepared_start(prepared: *mut CPrepared, param: *const RequestParam) -> *mut c_void {
    ffi_guard("gsc_prepared_start", || {
        let p: Arc<Prepared> = handles::get(prepared as *const c_void)?;
        let kind = match p.direction() {
            Direction::Send => OpKind::Send,
            Direction::Recv => OpKind::Recv,
        };
        // SAFETY: forwarded caller contract.
        let conv = unsafe { params::convert(param, kind) }?;
        let started = p.start(conv.params)?;
        Ok(params::status_ptr(started, conv.out))
    })
}

/// `gsc_prepared_pready`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_prepared_pready(prepared: *mut CPrepared, partition: usize) -> c_int {
    ffi_guard("gsc_prepared_pready", || {
        let p: Arc<Prepared> = handles::get(prepared as *const c_void)?;
        p.pready(partition).map(|()| 0)
    })
}

/// `gsc_prepared_parrived`
///
/// # Safety
/// `flag` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_prepared_parrived(prepared: *mut CPrepared, partition: usize, flag: *mut c_int) -> c_int {
    ffi_guard("gsc_prepared_parrived", || {
        if flag.is_null() {
            return Err(Error::invalid_param("gsc_prepared_parrived: flag is NULL"));
        }
        let p: Arc<Prepared> = handles::get(prepared as *const c_void)?;
        let arrived = p.parrived(partition)?;
        // SAFETY: checked non-NULL; caller contract says writable.
        unsafe { flag.write(arrived as c_int) };
        Ok(0)
    })
}

/// `gsc_release_preparations`: `prepared_memh` is the `gsc_prepared_h` to release.
#[unsafe(no_mangle)]
pub extern "C" fn gsc_release_preparations(ep: *mut CEp, prepared_memh: *mut c_void) -> c_int {
    ffi_guard("gsc_release_preparations", || {
        let parent = handles::parent_of::<Arc<Prepared>>(prepared_memh)?;
        handles::with::<Arc<Endpoint>, _>(ep as *const c_void, |_| ())?;
        if parent != ep as *const c_void {
            return Err(Error::invalid_param("the prepared transfer was not prepared on this endpoint"));
        }
        let p: Arc<Prepared> = handles::get(prepared_memh)?;
        // Busy leaves the handle as it was; once released, the handle goes too.
        p.release()?;
        handles::unregister::<Arc<Prepared>>(prepared_memh).map(|_| 0)
    })
}

/// `gsc_prepared_gpu_error`
///
/// # Safety
/// `round` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_prepared_gpu_error(prepared: *mut CPrepared, round: *mut u64) -> c_int {
    ffi_guard("gsc_prepared_gpu_error", || {
        if round.is_null() {
            return Err(Error::invalid_param("gsc_prepared_gpu_error: round is NULL"));
        }
        let p: Arc<Prepared> = handles::get(prepared as *const c_void)?;
        let r = p.gpu_error()?;
        // SAFETY: checked non-NULL; caller contract says writable.
        unsafe { round.write(r) };
        Ok(0)
    })
}

/// `gsc_prepared_on_gpu`
///
/// # Safety
/// `on_gpu` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_prepared_on_gpu(prepared: *mut CPrepared, on_gpu: *mut c_int) -> c_int {
    ffi_guard("gsc_prepared_on_gpu", || {
        if on_gpu.is_null() {
            return Err(Error::invalid_param("gsc_prepared_on_gpu: on_gpu is NULL"));
        }
        let p: Arc<Prepared> = handles::get(prepared as *const c_void)?;
        let on = p.runs_on_gpu()?;
        // SAFETY: checked non-NULL; caller contract says writable.
        unsafe { on_gpu.write(c_int::from(on)) };
        Ok(0)
    })
}

/// `gsc_prepared_device_handle`
///
/// # Safety
/// `handle_p` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_prepared_device_handle(prepared: *mut CPrepared, handle_p: *mut *mut c_void) -> c_int {
    ffi_guard("gsc_prepared_device_handle", || {
        if handle_p.is_null() {
            return Err(Error::invalid_param("gsc_prepared_device_handle: handle_p is NULL"));
        }
        let p: Arc<Prepared> = handles::get(prepared as *const c_void)?;
        let d = p.device_handle()?;
        // SAFETY: checked non-NULL; caller contract says writable.
        unsafe { handle_p.write(d as usize as *mut c_void) };
        Ok(0)
    })
}
