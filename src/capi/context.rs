//! Context, configuration and memory exports.

use super::handles::{self, BufKind, MemObj};
use super::panic::ffi_guard;
use super::params::{
    ConfigPair, MEM_MAP_ALLOCATE, MEM_MAP_PARAM_FIELD_ADDRESS, MEM_MAP_PARAM_FIELD_FLAGS, MEM_MAP_PARAM_FIELD_LENGTH, MemMapParams,
    PARAM_FIELD_CONFIG, PARAM_FIELD_REQUEST_CLEANUP, PARAM_FIELD_REQUEST_INIT, PARAM_FIELD_REQUEST_SIZE, Params,
};
use crate::config::{Config, ConfigLoad};
use crate::core::{Context, MapRequest, RequestAreaSpec};
use crate::error::{Error, Result, Status};
use std::ffi::{CStr, c_void};

/// Opaque C handle types (by type only).
#[repr(C)]
pub struct CContext {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct CMem {
    _opaque: [u8; 0],
}

/// The configuration `gsc_init` uses: the `GSC_*` environment with the caller's overrides on top.
///
/// # Safety
/// `params` is NULL or points to a readable `gsc_params_t` whose `config` array (if flagged)
/// holds `config_count` pairs of NULL-or-NUL-terminated strings.
unsafe fn load_config(params: *const Params) -> Result<ConfigLoad> {
    let mut pairs: Vec<(String, String)> = Vec::new();
    for (name, value) in std::env::vars_os() {
        let name = name.to_string_lossy().into_owned();
        if !name.starts_with("GSC_") {
            continue;
        }
        let value = value
            .into_string()
            .map_err(|_| Error::new(Status::InvalidConfig, format!("{name} (environment): value is not valid UTF-8")))?;
        pairs.push((name, value));
    }
    if !params.is_null() {
        // SAFETY: non-NULL; the caller passes a readable gsc_params_t.
        let p = unsafe { &*params };
        let known = PARAM_FIELD_CONFIG | PARAM_FIELD_REQUEST_SIZE | PARAM_FIELD_REQUEST_INIT | PARAM_FIELD_REQUEST_CLEANUP;
        if p.field_mask & !known != 0 {
            return Err(Error::invalid_param(format!("params->field_mask has unknown bits {:#x}", p.field_mask & !known)));
        }
        if p.field_mask & PARAM_FIELD_CONFIG != 0 && p.config_count > 0 {
            if p.config.is_null() {
                return Err(Error::invalid_param(format!("params->config is NULL but config_count is {}", p.config_count)));
            }
            // SAFETY: non-NULL, and the caller guarantees `config_count` readable pairs.
            let list = unsafe { std::slice::from_raw_parts(p.config, p.config_count) };
            for (i, ConfigPair { name, value }) in list.iter().enumerate() {
                if name.is_null() {
                    return Err(Error::invalid_param(format!("params->config[{i}].name is NULL")));
                }
                // SAFETY: non-NULL, NUL-terminated by the caller's contract.
                let name = unsafe { CStr::from_ptr(*name) }.to_string_lossy().into_owned();
                let knob = match Config::knob(&name) {
                    Some(k) => k,
                    // `get` on an unknown name builds the usual "unknown variable; did you mean"
                    // error, with the InvalidConfig status.
                    None => {
                        return Err(Config::default()
                            .get(&name)
                            .err()
                            .unwrap_or_else(|| Error::new(Status::InvalidConfig, format!("unknown configuration variable {name:?}"))));
                    }
                };
                if value.is_null() {
                    return Err(Error::invalid_param(format!("params->config[{i}].value ({}) is NULL", knob.name)));
                }
                // SAFETY: non-NULL, NUL-terminated by the caller's contract.
                let value = unsafe { CStr::from_ptr(*value) }
                    .to_str()
                    .map_err(|_| Error::new(Status::InvalidConfig, format!("{}: value is not valid UTF-8", knob.name)))?;
                pairs.push((knob.name.to_string(), value.to_string()));
            }
        }
    }
    // Later pairs win, so the overrides replace the environment; all values are checked, then
    // the rules across knobs once.
    Config::from_pairs(pairs)
}

/// `gsc_init`
///
/// # Safety
/// `params` is NULL or a readable `gsc_params_t` (see `load_config`); `context_p` is NULL or a
/// writable `gsc_context_h`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_init(params: *const Params, context_p: *mut *mut CContext) -> i32 {
    ffi_guard("gsc_init", || {
        if context_p.is_null() {
            return Err(Error::invalid_param("context_p is NULL"));
        }
        // SAFETY: forwarded caller contract.
        let load = unsafe { load_config(params) }?;
        // The C user cannot install a tracing subscriber; the Rust library never does on its own.
        crate::log::init(&load.config)?;
        load.warn_unknown();
        // SAFETY: forwarded caller contract (read before anything is created).
        let ctx = match unsafe { request_area_of(params) }? {
            Some(spec) => Context::with_request_area(load.config, spec)?,
            None => Context::new(load.config)?,
        };
        let h = handles::register(ctx, std::ptr::null());
        // SAFETY: non-NULL (checked) and writable by the caller's contract.
        unsafe { context_p.write(h as *mut CContext) };
        Ok(Status::Ok.code())
    })
}

/// The request area `params` asks for (`request_size`, `request_init`, `request_cleanup`).
///
/// # Safety
/// `params` is NULL or a readable `gsc_params_t`.
unsafe fn request_area_of(params: *const Params) -> Result<Option<RequestAreaSpec>> {
    if params.is_null() {
        return Ok(None);
    }
    // SAFETY: non-NULL; the caller passes a readable gsc_params_t.
    let p = unsafe { &*params };
    let has = |bit: u64| p.field_mask & bit != 0;
    let init = if has(PARAM_FIELD_REQUEST_INIT) { p.request_init } else { None };
    let cleanup = if has(PARAM_FIELD_REQUEST_CLEANUP) { p.request_cleanup } else { None };
    if !has(PARAM_FIELD_REQUEST_SIZE) {
        if init.is_some() || cleanup.is_some() {
            return Err(Error::invalid_param("params->request_init or request_cleanup is set without request_size"));
        }
        return Ok(None);
    }
    let spec = RequestAreaSpec { size: p.request_size, init, cleanup };
    spec.validate().map_err(|e| e.context("params->request_size"))?;
    Ok(Some(spec))
}

/// `gsc_cleanup`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_cleanup(context: *mut CContext) -> i32 {
    ffi_guard("gsc_cleanup", || {
        handles::unregister::<Context>(context as *const c_void)?;
        Ok(Status::Ok.code())
    })
}

/// `gsc_mem_map`
///
/// # Safety
/// `params` is NULL or a readable `gsc_mem_map_params_t`; without `GSC_MEM_MAP_ALLOCATE` its
/// address range stays valid until `gsc_mem_unmap`; `memh_p` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_mem_map(context: *mut CContext, params: *const MemMapParams, memh_p: *mut *mut CMem) -> i32 {
    ffi_guard("gsc_mem_map", || {
        let ctx: Context = handles::get(context as *const c_void)?;
        if params.is_null() {
            return Err(Error::invalid_param("params is NULL"));
        }
        if memh_p.is_null() {
            return Err(Error::invalid_param("memh_p is NULL"));
        }
        // SAFETY: non-NULL; the caller passes a readable gsc_mem_map_params_t.
        let p = unsafe { &*params };
        let known = MEM_MAP_PARAM_FIELD_ADDRESS | MEM_MAP_PARAM_FIELD_LENGTH | MEM_MAP_PARAM_FIELD_FLAGS;
        if p.field_mask & !known != 0 {
            return Err(Error::invalid_param(format!("params->field_mask has unknown bits {:#x}", p.field_mask & !known)));
        }
        if p.field_mask & MEM_MAP_PARAM_FIELD_LENGTH == 0 {
            return Err(Error::invalid_param("GSC_MEM_MAP_PARAM_FIELD_LENGTH is required"));
        }
        let flags = if p.field_mask & MEM_MAP_PARAM_FIELD_FLAGS != 0 { p.flags } else { 0 };
        if flags & !MEM_MAP_ALLOCATE != 0 {
            return Err(Error::invalid_param(format!("params->flags has unknown bits {:#x}", flags & !MEM_MAP_ALLOCATE)));
        }
        let has_address = p.field_mask & MEM_MAP_PARAM_FIELD_ADDRESS != 0;
        let req = if flags & MEM_MAP_ALLOCATE != 0 {
            if has_address && !p.address.is_null() {
                return Err(Error::invalid_param("address must not be given with GSC_MEM_MAP_ALLOCATE"));
            }
            MapRequest::Allocate { len: p.length }
        } else {
            if !has_address {
                return Err(Error::invalid_param("GSC_MEM_MAP_PARAM_FIELD_ADDRESS is required without GSC_MEM_MAP_ALLOCATE"));
            }
            MapRequest::Existing { addr: p.address as *mut u8, len: p.length }
        };
        let mem = ctx.mem_map(req)?;
        let h = handles::register(MemObj { context: ctx, mem }, context as *const c_void);
        // SAFETY: non-NULL (checked), writable by the caller's contract.
        unsafe { memh_p.write(h as *mut CMem) };
        Ok(Status::Ok.code())
    })
}

/// Fail unless `memh` is a live memory handle of `context`.
fn check_mem_of(context: *mut CContext, memh: *mut CMem) -> Result<Context> {
    let ctx: Context = handles::get(context as *const c_void)?;
    let parent = handles::parent_of::<MemObj>(memh as *const c_void)?;
    if parent != context as *const c_void {
        return Err(Error::invalid_param(format!("memory handle {memh:p} belongs to another context")));
    }
    Ok(ctx)
}

/// `gsc_mem_unmap`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_mem_unmap(context: *mut CContext, memh: *mut CMem) -> i32 {
    ffi_guard("gsc_mem_unmap", || {
        check_mem_of(context, memh)?;
        let MemObj { context, mem } = handles::unregister::<MemObj>(memh as *const c_void)?;
        context.mem_unmap(mem)?;
        Ok(Status::Ok.code())
    })
}

/// `gsc_mem_query`
///
/// # Safety
/// Each output pointer is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_mem_query(memh: *mut CMem, address_p: *mut *mut c_void, length_p: *mut usize) -> i32 {
    ffi_guard("gsc_mem_query", || {
        let (addr, len) = handles::with(memh as *const c_void, |m: &MemObj| (m.mem.address(), m.mem.len()))?;
        if !address_p.is_null() {
            // SAFETY: non-NULL, writable by the caller's contract.
            unsafe { address_p.write(addr as *mut c_void) };
        }
        if !length_p.is_null() {
            // SAFETY: as above.
            unsafe { length_p.write(len) };
        }
        Ok(Status::Ok.code())
    })
}

/// `gsc_rkey_pack`
///
/// # Safety
/// `buffer_p` and `size_p` are NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_rkey_pack(context: *mut CContext, memh: *mut CMem, buffer_p: *mut *mut c_void, size_p: *mut usize) -> i32 {
    ffi_guard("gsc_rkey_pack", || {
        if buffer_p.is_null() || size_p.is_null() {
            return Err(Error::invalid_param(if buffer_p.is_null() { "buffer_p is NULL" } else { "size_p is NULL" }));
        }
        let ctx = check_mem_of(context, memh)?;
        let packed = handles::with(memh as *const c_void, |m: &MemObj| ctx.rkey_pack(&m.mem))??;
        let (ptr, len) = handles::give_buffer(BufKind::Rkey, &packed);
        // SAFETY: both non-NULL (checked), writable by the caller's contract.
        unsafe {
            buffer_p.write(ptr);
            size_p.write(len);
        }
        Ok(Status::Ok.code())
    })
}

/// `gsc_rkey_buffer_release`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_rkey_buffer_release(buffer: *mut c_void) -> i32 {
    ffi_guard("gsc_rkey_buffer_release", || {
        handles::take_buffer(buffer, BufKind::Rkey, "rkey buffer")?;
        Ok(Status::Ok.code())
    })
}
