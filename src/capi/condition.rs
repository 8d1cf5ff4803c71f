//! Condition and host-stream exports.

use super::handles;
use super::panic::ffi_guard;
use crate::condition::{Category, Condition, HostStream};
use crate::error::{Error, Status};
use std::ffi::c_void;
use std::time::Duration;

pub(crate) const CONDITION_PARAM_FIELD_CATEGORY: u64 = 1 << 0;
pub(crate) const CONDITION_PARAM_FIELD_CONTEXT: u64 = 1 << 1;

/// `gsc_condition_param_t`
#[repr(C)]
pub struct ConditionParam {
    pub field_mask: u64,
    /// A `gsc_condition_category_t`, read as an integer so a value outside the enum is an error.
    pub category: u32,
    pub context: *mut c_void,
}

fn category_of(value: u32) -> Result<Category, Error> {
    Ok(match value {
        0 => Category::Stream,
        1 => Category::Graph,
        2 => Category::KernelTriggered,
        3 => Category::HostStream,
        other => return Err(Error::invalid_param(format!("category {other} is not a gsc_condition_category_t"))),
    })
}

/// `gsc_condition_create`
///
/// # Safety
/// `param` is NULL or a readable `gsc_condition_param_t`; `condition_p` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_condition_create(param: *const ConditionParam, condition_p: *mut *mut c_void) -> i32 {
    ffi_guard("gsc_condition_create", || {
        if param.is_null() || condition_p.is_null() {
            return Err(Error::invalid_param(if param.is_null() { "param is NULL" } else { "condition_p is NULL" }));
        }
        // SAFETY: non-NULL; the caller passes a readable gsc_condition_param_t.
        let p = unsafe { &*param };
        let known = CONDITION_PARAM_FIELD_CATEGORY | CONDITION_PARAM_FIELD_CONTEXT;
        if p.field_mask & !known != 0 {
            return Err(Error::invalid_param(format!("field_mask has unknown bits {:#x}", p.field_mask & !known)));
        }
        if p.field_mask & CONDITION_PARAM_FIELD_CATEGORY == 0 {
            return Err(Error::invalid_param("GSC_CONDITION_PARAM_FIELD_CATEGORY is required"));
        }
        let category = category_of(p.category)?;
        let context = if p.field_mask & CONDITION_PARAM_FIELD_CONTEXT != 0 { p.context } else { std::ptr::null_mut() };
        let cond = match category {
            Category::HostStream => {
                if context.is_null() {
                    return Err(Error::invalid_param("a host-stream condition needs its gsc_host_stream_h as context"));
                }
                Condition::host_stream(&handles::get::<HostStream>(context)?)
            }
            // A condition belongs to no context, so its one knob comes from the environment.
            other => Condition::cuda(other, context as usize, crate::Config::from_env()?.kernel_cache_dir)?,
        };
        let h = handles::register(cond, std::ptr::null());
        // SAFETY: non-NULL (checked), writable by the caller's contract.
        unsafe { condition_p.write(h) };
        Ok(Status::Ok.code())
    })
}

/// `gsc_condition_destroy`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_condition_destroy(condition: *mut c_void) -> i32 {
    ffi_guard("gsc_condition_destroy", || {
        handles::unregister::<Condition>(condition)?;
        Ok(Status::Ok.code())
    })
}

/// `gsc_condition_wait`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_condition_wait(condition: *mut c_void) -> i32 {
    ffi_guard("gsc_condition_wait", || {
        handles::get::<Condition>(condition)?.wait()?;
        Ok(Status::Ok.code())
    })
}

/// `gsc_condition_group_start`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_condition_group_start(condition: *mut c_void) -> i32 {
    ffi_guard("gsc_condition_group_start", || {
        handles::get::<Condition>(condition)?.group_start()?;
        Ok(Status::Ok.code())
    })
}

/// `gsc_condition_group_end`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_condition_group_end(condition: *mut c_void) -> i32 {
    ffi_guard("gsc_condition_group_end", || {
        handles::get::<Condition>(condition)?.group_end()?;
        Ok(Status::Ok.code())
    })
}

/// `gsc_condition_query`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_condition_query(condition: *mut c_void) -> i32 {
    ffi_guard("gsc_condition_query", || {
        handles::get::<Condition>(condition)?.query()?;
        Ok(Status::Ok.code())
    })
}

/// `gsc_host_stream_create`
///
/// # Safety
/// `stream_p` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_host_stream_create(stream_p: *mut *mut c_void) -> i32 {
    ffi_guard("gsc_host_stream_create", || {
        if stream_p.is_null() {
            return Err(Error::invalid_param("stream_p is NULL"));
        }
        let h = handles::register(HostStream::new()?, std::ptr::null());
        // SAFETY: non-NULL (checked), writable by the caller's contract.
        unsafe { stream_p.write(h) };
        Ok(Status::Ok.code())
    })
}

/// `gsc_host_stream_destroy`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_host_stream_destroy(stream: *mut c_void) -> i32 {
    ffi_guard("gsc_host_stream_destroy", || {
        handles::unregister::<HostStream>(stream)?;
        Ok(Status::Ok.code())
    })
}

/// A C function and its argument, queued on a host stream.
struct CWork {
    f: unsafe extern "C" fn(*mut c_void),
    arg: *mut c_void,
}

// SAFETY: gsc.h tells the caller that `fn(arg)` runs on the stream's own thread.
unsafe impl Send for CWork {}

/// `gsc_host_stream_launch`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_host_stream_launch(stream: *mut c_void, f: Option<unsafe extern "C" fn(*mut c_void)>, arg: *mut c_void) -> i32 {
    ffi_guard("gsc_host_stream_launch", || {
        let s = handles::get::<HostStream>(stream)?;
        let f = f.ok_or_else(|| Error::invalid_param("fn is NULL"))?;
        let work = CWork { f, arg };
        s.launch(move || {
            let w = work;
            // SAFETY: the caller's function with the caller's argument, as gsc.h describes.
            unsafe { (w.f)(w.arg) }
        });
        Ok(Status::Ok.code())
    })
}

/// `gsc_host_stream_synchronize`: `timeout_ms` < 0 waits without bound.
#[unsafe(no_mangle)]
pub extern "C" fn gsc_host_stream_synchronize(stream: *mut c_void, timeout_ms: i64) -> i32 {
    ffi_guard("gsc_host_stream_synchronize", || {
        let s = handles::get::<HostStream>(stream)?;
        s.synchronize((timeout_ms >= 0).then(|| Duration::from_millis(timeout_ms as u64)))?;
        Ok(Status::Ok.code())
    })
}
