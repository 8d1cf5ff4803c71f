//! `gsc_request_param_t` and the other C parameter structs, their conversion into the Rust
//! `RequestParams`, and the status-pointer convention of the `*_nbx` functions.

use super::handles;
use super::panic::encode_status;
use crate::condition::{Category, Condition};
use crate::core::{RequestParams, Started};
use crate::error::{Error, Result, Status};
use crate::protocols::{MemType, RecvInfo};
use std::ffi::{c_char, c_void};

pub(crate) const OP_ATTR_FIELD_CALLBACK: u64 = 1 << 0;
pub(crate) const OP_ATTR_FIELD_USER_DATA: u64 = 1 << 1;
pub(crate) const OP_ATTR_FIELD_FLAGS: u64 = 1 << 2;
pub(crate) const OP_ATTR_FIELD_MEMORY_TYPE: u64 = 1 << 3;
pub(crate) const OP_ATTR_FIELD_RECV_INFO: u64 = 1 << 4;
pub(crate) const OP_ATTR_FIELD_CONDITION: u64 = 1 << 5;
pub(crate) const OP_ATTR_FIELD_CONDITION_OUT: u64 = 1 << 6;
const OP_ATTR_ALL: u64 = (1 << 7) - 1;

pub(crate) const OP_ATTR_FLAG_NO_IMM_CMPL: u64 = 1 << 0;
pub(crate) const EP_CLOSE_FLAG_FORCE: u64 = 1 << 1;
pub(crate) const OP_ATTR_FLAG_NO_STREAM_WAIT: u64 = 1 << 2;

pub(crate) const MEMORY_TYPE_HOST: u32 = 0;
pub(crate) const MEMORY_TYPE_CUDA: u32 = 1;

pub(crate) const PARAM_FIELD_CONFIG: u64 = 1 << 0;
pub(crate) const PARAM_FIELD_REQUEST_SIZE: u64 = 1 << 1;
pub(crate) const PARAM_FIELD_REQUEST_INIT: u64 = 1 << 2;
pub(crate) const PARAM_FIELD_REQUEST_CLEANUP: u64 = 1 << 3;
pub(crate) const EP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
pub(crate) const EP_PARAM_FIELD_ADDRESS_LENGTH: u64 = 1 << 1;
pub(crate) const MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
pub(crate) const MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
pub(crate) const MEM_MAP_PARAM_FIELD_FLAGS: u64 = 1 << 2;
pub(crate) const MEM_MAP_ALLOCATE: u64 = 1 << 0;

/// `gsc_send_nbx_callback_t`
pub(crate) type SendCallback = unsafe extern "C" fn(request: *mut c_void, status: i32, user_data: *mut c_void);
/// `gsc_tag_recv_nbx_callback_t`
pub(crate) type RecvCallback = unsafe extern "C" fn(request: *mut c_void, status: i32, info: *const TagRecvInfo, user_data: *mut c_void);

/// `gsc_tag_recv_info_t`
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct TagRecvInfo {
    pub sender_tag: u64,
    pub length: usize,
}

impl From<RecvInfo> for TagRecvInfo {
    fn from(i: RecvInfo) -> TagRecvInfo {
        TagRecvInfo { sender_tag: i.tag, length: i.length }
    }
}

/// The `cb` union of `gsc_request_param_t`.
#[repr(C)]
#[derive(Copy, Clone)]
pub union CallbackUnion {
    pub send: Option<SendCallback>,
    pub recv: Option<RecvCallback>,
}

/// The `recv_info` union of `gsc_request_param_t`.
#[repr(C)]
#[derive(Copy, Clone)]
pub union RecvInfoUnion {
    pub tag_info: *mut TagRecvInfo,
}

/// `gsc_request_param_t`
#[repr(C)]
pub struct RequestParam {
    pub op_attr_mask: u64,
    pub flags: u64,
    pub cb: CallbackUnion,
    pub user_data: *mut c_void,
    /// A `gsc_memory_type_t` (an enum of int size); read as an integer so that a value outside
    /// the enum is an error rather than undefined behaviour.
    pub memory_type: u32,
    pub recv_info: RecvInfoUnion,
    pub condition: *mut c_void,
    pub condition_out: *mut ConditionOut,
}

/// `gsc_condition_out_t`: what arming a graph or kernel-triggered operation gives back.
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct ConditionOut {
    pub start_node: *mut c_void,
    pub done_node: *mut c_void,
    pub device_handle: *mut c_void,
}

impl From<crate::condition::ArmedOutputs> for ConditionOut {
    fn from(o: crate::condition::ArmedOutputs) -> ConditionOut {
        ConditionOut {
            start_node: o.start_node as *mut c_void,
            done_node: o.done_node as *mut c_void,
            device_handle: o.device_handle as usize as *mut c_void,
        }
    }
}

/// `gsc_config_pair_t`
#[repr(C)]
pub struct ConfigPair {
    pub name: *const c_char,
    pub value: *const c_char,
}

/// `gsc_params_t`
#[repr(C)]
pub struct Params {
    pub field_mask: u64,
    pub config: *const ConfigPair,
    pub config_count: usize,
    pub request_size: usize,
    pub request_init: Option<crate::core::request_area::AreaHook>,
    pub request_cleanup: Option<crate::core::request_area::AreaHook>,
}

/// `gsc_worker_params_t`
#[repr(C)]
pub struct WorkerParams {
    pub field_mask: u64,
}

/// `gsc_ep_params_t`
#[repr(C)]
pub struct EpParams {
    pub field_mask: u64,
    pub address: *const c_void,
    pub address_length: usize,
}

/// `gsc_mem_map_params_t`
#[repr(C)]
pub struct MemMapParams {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub flags: u64,
}

/// Which operation the parameters are for: decides the callback member and allowed flags.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub(crate) enum OpKind {
    /// Sends, put/get, flushes: `cb.send`.
    Send,
    /// Endpoint close: `cb.send`, and `GSC_EP_CLOSE_FLAG_FORCE` is allowed.
    Close,
    /// Tagged receives: `cb.recv`, and `recv_info` is allowed.
    Recv,
}

/// A C callback with its user data, callable from whichever thread progresses.
struct CSend {
    f: SendCallback,
    user_data: *mut c_void,
}

// SAFETY: the C caller registered the callback knowing it runs in whichever thread progresses
// the worker (documented in gsc.h); the user data pointer is only passed back to it.
unsafe impl Send for CSend {}

impl CSend {
    fn call(self, request: u64, status: Status) {
        // SAFETY: `f` is the caller's function pointer of the documented signature; `request`
        // is the handle the operation returned, passed as an opaque pointer-sized integer.
        unsafe { (self.f)(request as usize as *mut c_void, status.code(), self.user_data) }
    }
}

struct CRecv {
    f: RecvCallback,
    user_data: *mut c_void,
}

// SAFETY: as for `CSend`.
unsafe impl Send for CRecv {}

impl CRecv {
    fn call(self, request: u64, status: Status, info: RecvInfo) {
        let info = TagRecvInfo::from(info);
        // SAFETY: as in `CSend::call`; `info` lives on this stack frame for the whole call, which
        // is the lifetime gsc.h promises.
        unsafe { (self.f)(request as usize as *mut c_void, status.code(), &info, self.user_data) }
    }
}

/// The converted parameters of one operation.
pub(crate) struct Converted {
    pub(crate) params: RequestParams,
    pub(crate) out: Outputs,
    /// `GSC_EP_CLOSE_FLAG_FORCE` was given.
    pub(crate) force: bool,
}

/// Where the caller wants results written when the call itself produces them.
#[derive(Copy, Clone)]
pub(crate) struct Outputs {
    /// The receive info on immediate completion (null: nowhere).
    tag_info: *mut TagRecvInfo,
    /// Graph nodes / device handle of an armed persistent operation (null: nowhere).
    condition_out: *mut ConditionOut,
}

/// Check and convert a `gsc_request_param_t` (NULL: defaults).
///
/// # Safety
/// `param` is NULL or points to a readable `gsc_request_param_t`.
pub(crate) unsafe fn convert(param: *const RequestParam, kind: OpKind) -> Result<Converted> {
    let outputs = Outputs { tag_info: std::ptr::null_mut(), condition_out: std::ptr::null_mut() };
    let mut out = Converted { params: RequestParams::default(), out: outputs, force: false };
    if param.is_null() {
        return Ok(out);
    }
    // SAFETY: non-NULL, and the caller guarantees it points to a gsc_request_param_t.
    let p = unsafe { &*param };
    let mask = p.op_attr_mask;
    if mask & !OP_ATTR_ALL != 0 {
        return Err(Error::invalid_param(format!("op_attr_mask has unknown bits {:#x}", mask & !OP_ATTR_ALL)));
    }
    if mask & OP_ATTR_FIELD_FLAGS != 0 {
        let allowed = match kind {
            OpKind::Close => OP_ATTR_FLAG_NO_IMM_CMPL | EP_CLOSE_FLAG_FORCE,
            _ => OP_ATTR_FLAG_NO_IMM_CMPL | OP_ATTR_FLAG_NO_STREAM_WAIT,
        };
        if p.flags & !allowed != 0 {
            return Err(Error::invalid_param(format!(
                "flags has bits {:#x} this operation does not take{}",
                p.flags & !allowed,
                if p.flags & EP_CLOSE_FLAG_FORCE != 0 { " (GSC_EP_CLOSE_FLAG_FORCE is for gsc_ep_close_nbx only)" } else { "" }
            )));
        }
        out.params.no_immediate_completion = p.flags & OP_ATTR_FLAG_NO_IMM_CMPL != 0;
        out.params.no_stream_wait = p.flags & OP_ATTR_FLAG_NO_STREAM_WAIT != 0;
        out.force = p.flags & EP_CLOSE_FLAG_FORCE != 0;
    }
    if mask & OP_ATTR_FIELD_MEMORY_TYPE != 0 {
        out.params.memory_type = Some(match p.memory_type {
            MEMORY_TYPE_HOST => MemType::Host,
            MEMORY_TYPE_CUDA => MemType::Cuda,
            other => return Err(Error::invalid_param(format!("memory_type {other} is not a gsc_memory_type_t"))),
        });
    }
    if mask & OP_ATTR_FIELD_CONDITION != 0 && !p.condition.is_null() {
        let cond: Condition = handles::get(p.condition)?;
        if matches!(cond.category(), Category::Graph | Category::KernelTriggered) {
            // The nodes or the device handle are the only way to use such an operation.
            if mask & OP_ATTR_FIELD_CONDITION_OUT == 0 || p.condition_out.is_null() {
                return Err(Error::invalid_param(format!(
                    "a {} condition needs GSC_OP_ATTR_FIELD_CONDITION_OUT and a condition_out to return its {}",
                    cond.category().name(),
                    if cond.category() == Category::Graph { "graph nodes" } else { "device handle" }
                )));
            }
            out.out.condition_out = p.condition_out;
        }
        out.params.condition = Some(cond);
    } else if out.params.no_stream_wait {
        return Err(Error::invalid_param("GSC_OP_ATTR_FLAG_NO_STREAM_WAIT needs a stream or host-stream condition"));
    }
    if mask & OP_ATTR_FIELD_RECV_INFO != 0 {
        if kind != OpKind::Recv {
            return Err(Error::invalid_param("GSC_OP_ATTR_FIELD_RECV_INFO is for receives only"));
        }
        // SAFETY: a union of one pointer member; reading it reads the pointer the caller set.
        out.out.tag_info = unsafe { p.recv_info.tag_info };
        if out.out.tag_info.is_null() {
            return Err(Error::invalid_param("GSC_OP_ATTR_FIELD_RECV_INFO is set but recv_info.tag_info is NULL"));
        }
    }
    let user_data = if mask & OP_ATTR_FIELD_USER_DATA != 0 { p.user_data } else { std::ptr::null_mut() };
    if mask & OP_ATTR_FIELD_CALLBACK != 0 {
        match kind {
            OpKind::Send | OpKind::Close => {
                // SAFETY: both union members are nullable function pointers of the same size;
                // for this operation the caller sets `send`.
                let f =
                    unsafe { p.cb.send }.ok_or_else(|| Error::invalid_param("GSC_OP_ATTR_FIELD_CALLBACK is set but cb.send is NULL"))?;
                let cb = CSend { f, user_data };
                out.params.callback = Some(Box::new(move |h, status, _info| cb.call(h, status)));
            }
            OpKind::Recv => {
                // SAFETY: as above, with `recv` the member set for receives.
                let f =
                    unsafe { p.cb.recv }.ok_or_else(|| Error::invalid_param("GSC_OP_ATTR_FIELD_CALLBACK is set but cb.recv is NULL"))?;
                let cb = CRecv { f, user_data };
                out.params.callback = Some(Box::new(move |h, status, info| cb.call(h, status, info)));
            }
        }
    }
    Ok(out)
}

/// The status pointer for what starting an operation gave back.
pub(crate) fn status_ptr(started: Started, out: Outputs) -> *mut c_void {
    match started {
        Started::Done(info) => {
            let tag_info = out.tag_info;
            if !tag_info.is_null() {
                // SAFETY: `convert` took this pointer from `recv_info.tag_info`, which the caller
                // points at a writable gsc_tag_recv_info_t for the duration of the call.
                unsafe { tag_info.write(info.into()) };
            }
            std::ptr::null_mut()
        }
        Started::Armed(o) => {
            if !out.condition_out.is_null() {
                let c = ConditionOut::from(o);
                // SAFETY: `convert` took this pointer from `condition_out`, which the caller points
                // at a writable gsc_condition_out_t for the duration of the call.
                unsafe { out.condition_out.write(c) };
            }
            std::ptr::null_mut()
        }
        Started::Pending(handle) => {
            // A request handle is never 0 and never in the error range (see core::request).
            debug_assert!(handle != 0 && (handle as usize) < encode_status(Status::Internal) as usize);
            handle as usize as *mut c_void
        }
    }
}

/// A request handle from its C form.
pub(crate) fn request_handle(req: *const c_void) -> Result<u64> {
    if req.is_null() {
        return Err(Error::new(Status::InvalidHandle, "request is NULL (an operation that completed at once has no request)"));
    }
    if (req as usize) >= (crate::error::ERR_LAST as isize as usize) {
        return Err(Error::new(Status::InvalidHandle, format!("request {req:p} is an error status pointer, not a request")));
    }
    Ok(req as usize as u64)
}
