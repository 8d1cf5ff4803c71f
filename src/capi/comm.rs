//! Communicator exports: collectives and send/recv between the ranks of a communicator (see
//! `crate::collectives`), on any condition a CUDA stream or graph gives, and collectives on
//! kernel triggers (`gsc_comm_collective`, which returns the device handle).

use super::bootstrap::CUniqueId;
use super::handles;
use super::panic::ffi_guard;
use super::params::ConditionOut;
use crate::bootstrap::{Bootstrap, UniqueId};
use crate::collectives::p2p::PeerOp;
use crate::collectives::{Communicator, DataType, PeerTransfer, RedOp, Registration, Window};
use crate::condition::{Category, Condition};
use crate::error::{Error, Result, Status};
use std::ffi::{c_int, c_void};
use std::sync::Arc;

fn datatype(v: c_int) -> Result<DataType> {
    DataType::from_nccl(v).map_err(|_| Error::invalid_param(format!("datatype {v} is not a gsc_datatype_t")))
}

fn red_op(v: c_int) -> Result<RedOp> {
    RedOp::from_nccl(v).map_err(|_| Error::invalid_param(format!("op {v} is not a gsc_red_op_t")))
}

fn rank_arg(v: c_int, what: &str) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::invalid_param(format!("{what} is negative ({v})")))
}

/// The communicator and the condition of a call, both cloned out of their handles.
fn comm_and_condition(comm: *mut c_void, condition: *mut c_void) -> Result<(Arc<Communicator>, Condition)> {
    Ok((handles::get::<Arc<Communicator>>(comm)?, handles::get::<Condition>(condition)?))
}

/// The collective exports without an out-parameter (`name`) cannot hand back a kernel-triggered
/// collective's device handle: refused before anything is armed.
fn without_outputs(name: &str, on: &Condition) -> Result<()> {
    match on.category() {
        Category::KernelTriggered => Err(Error::invalid_param(format!(
            "{name} on a KERNEL_TRIGGERED condition: use gsc_comm_collective, whose condition_out returns the device handle"
        ))),
        _ => Ok(()),
    }
}

/// `gsc_coll_desc_t`. The enums are read as integers, so that a value outside them is an
/// error, not undefined behaviour.
#[repr(C)]
pub struct CollDesc {
    pub kind: c_int,
    pub sendbuf: *const c_void,
    pub recvbuf: *mut c_void,
    pub count: usize,
    pub datatype: c_int,
    pub op: c_int,
    pub root: c_int,
}

/// `gsc_comm_collective`
///
/// # Safety
/// `desc` is NULL or readable; `out` is NULL or writable; the buffers as for
/// `gsc_comm_all_reduce` (for a kernel-triggered collective: until the last kernel that
/// triggers it has finished).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_comm_collective(
    comm: *mut c_void,
    desc: *const CollDesc,
    condition: *mut c_void,
    out: *mut ConditionOut,
) -> i32 {
    ffi_guard("gsc_comm_collective", || {
        let (c, on) = comm_and_condition(comm, condition)?;
        // SAFETY: the caller's contract: NULL or readable.
        let d = unsafe { desc.as_ref() }.ok_or_else(|| Error::invalid_param("a NULL gsc_coll_desc_t"))?;
        if on.category() == Category::KernelTriggered && out.is_null() {
            return Err(Error::invalid_param("a collective on a KERNEL_TRIGGERED condition needs a condition_out for its device handle"));
        }
        let (s, r, n, dt) = (d.sendbuf as u64, d.recvbuf as u64, d.count, datatype(d.datatype)?);
        // SAFETY (each arm): the caller's contract on the buffers.
        let armed = match d.kind {
            0 => unsafe { c.all_reduce(s, r, n, dt, red_op(d.op)?, &on) },
            1 => unsafe { c.all_gather(s, r, n, dt, &on) },
            2 => unsafe { c.reduce_scatter(s, r, n, dt, red_op(d.op)?, &on) },
            3 => unsafe { c.broadcast(s, r, n, dt, rank_arg(d.root, "root")?, &on) },
            4 => unsafe { c.reduce(s, r, n, dt, red_op(d.op)?, rank_arg(d.root, "root")?, &on) },
            k => return Err(Error::invalid_param(format!("kind {k} is not a gsc_coll_kind_t"))),
        }?;
        if !out.is_null() {
            // SAFETY: the caller's contract: writable when not NULL.
            unsafe { out.write(ConditionOut::from(armed)) };
        }
        Ok(Status::Ok.code())
    })
}

/// `gsc_comm_init_rank`
///
/// # Safety
/// `comm_p` is NULL or writable; `uid` is NULL or readable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_comm_init_rank(
    comm_p: *mut *mut c_void,
    nranks: c_int,
    uid: *const CUniqueId,
    rank: c_int,
    device: c_int,
) -> i32 {
    ffi_guard("gsc_comm_init_rank", || {
        if comm_p.is_null() || uid.is_null() {
            return Err(Error::invalid_param(if uid.is_null() { "uid is NULL" } else { "comm_p is NULL" }));
        }
        let (n, r) = (rank_arg(nranks, "nranks")?, rank_arg(rank, "rank")?);
        if n == 0 || r >= n {
            return Err(Error::invalid_param(format!("rank {rank} of {nranks} ranks")));
        }
        // SAFETY: non-NULL and readable by the caller's contract.
        let uid = UniqueId::from_bytes(unsafe { &(*uid).internal })?;
        let config = crate::Config::from_env()?;
        crate::cuda::api::set_device(device)?;
        let boot = Bootstrap::init(&uid, r as u32, n as u32, config.bootstrap_timeout)?;
        let comm = Communicator::new(boot, device, &config)?;
        let h = handles::register(Arc::new(comm), std::ptr::null());
        // SAFETY: non-NULL (checked), writable by the caller's contract.
        unsafe { comm_p.write(h) };
        Ok(Status::Ok.code())
    })
}

/// `gsc_comm_destroy`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_comm_destroy(comm: *mut c_void) -> i32 {
    ffi_guard("gsc_comm_destroy", || {
        handles::unregister::<Arc<Communicator>>(comm)?;
        Ok(Status::Ok.code())
    })
}

/// `gsc_comm_rank` / `gsc_comm_size`: the caller's rank, the number of ranks.
///
/// # Safety
/// `out` is NULL or writable.
unsafe fn comm_int(name: &'static str, comm: *mut c_void, out: *mut c_int, f: impl FnOnce(&Communicator) -> usize) -> i32 {
    ffi_guard(name, || {
        if out.is_null() {
            return Err(Error::invalid_param("the out-pointer is NULL"));
        }
        let v = handles::with::<Arc<Communicator>, usize>(comm, |c| f(c))?;
        // SAFETY: non-NULL (checked), writable by the caller's contract.
        unsafe { out.write(v as c_int) };
        Ok(Status::Ok.code())
    })
}

/// `gsc_comm_rank`
///
/// # Safety
/// `rank` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_comm_rank(comm: *mut c_void, rank: *mut c_int) -> i32 {
    // SAFETY: forwarded caller contract.
    unsafe { comm_int("gsc_comm_rank", comm, rank, Communicator::rank) }
}

/// `gsc_comm_size`
///
/// # Safety
/// `size` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_comm_size(comm: *mut c_void, size: *mut c_int) -> i32 {
    // SAFETY: forwarded caller contract.
    unsafe { comm_int("gsc_comm_size", comm, size, Communicator::nranks) }
}

/// `gsc_comm_device`
///
/// # Safety
/// `device` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_comm_device(comm: *mut c_void, device: *mut c_int) -> i32 {
    // SAFETY: forwarded caller contract.
    unsafe { comm_int("gsc_comm_device", comm, device, |c| c.device() as usize) }
}

/// `GSC_SPLIT_NOCOLOR`
const SPLIT_NOCOLOR: c_int = -1;
/// `GSC_SHRINK_ABORT`
const SHRINK_ABORT: c_int = 1;

/// A new communicator made from `comm` goes to `newcomm_p` (NULL for none): a handle of its own,
/// not a child of `comm`'s (each is destroyed on its own, as NCCL's are).
///
/// # Safety
/// `newcomm_p` is writable (checked for NULL by the caller).
unsafe fn hand_out(newcomm_p: *mut *mut c_void, made: Option<Communicator>) {
    let h = made.map_or(std::ptr::null_mut(), |c| handles::register(Arc::new(c), std::ptr::null()));
    // SAFETY: the caller's contract.
    unsafe { newcomm_p.write(h) };
}

/// `gsc_comm_split`
///
/// # Safety
/// `newcomm_p` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_comm_split(comm: *mut c_void, color: c_int, key: c_int, newcomm_p: *mut *mut c_void) -> i32 {
    ffi_guard("gsc_comm_split", || {
        let c = handles::get::<Arc<Communicator>>(comm)?;
        if newcomm_p.is_null() {
            return Err(Error::invalid_param("newcomm_p is NULL"));
        }
        let color = match color {
            SPLIT_NOCOLOR => None,
            c if c >= 0 => Some(c as u32),
            c => return Err(Error::invalid_param(format!("color {c} (a color is >= 0, or GSC_SPLIT_NOCOLOR)"))),
        };
        let config = crate::Config::from_env()?;
        crate::cuda::api::set_device(c.device())?;
        let made = c.split(color, key, &config)?;
        // SAFETY: non-NULL (checked), writable by the caller's contract.
        unsafe { hand_out(newcomm_p, made) };
        Ok(Status::Ok.code())
    })
}

/// An export that is one call on the communicator: its status.
fn on_comm(name: &'static str, comm: *mut c_void, f: impl FnOnce(&Communicator) -> Result<()>) -> i32 {
    ffi_guard(name, || {
        f(handles::get::<Arc<Communicator>>(comm)?.as_ref())?;
        Ok(Status::Ok.code())
    })
}

/// `gsc_comm_abort`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_comm_abort(comm: *mut c_void) -> i32 {
    on_comm("gsc_comm_abort", comm, |c| c.abort("gsc_comm_abort"))
}

/// `gsc_comm_revoke`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_comm_revoke(comm: *mut c_void) -> i32 {
    on_comm("gsc_comm_revoke", comm, Communicator::revoke)
}

/// `gsc_comm_shrink`: every argument, the list's rules included, is checked before the revoke
/// that `GSC_SHRINK_ABORT` asks for, so bad input changes nothing.
///
/// # Safety
/// `exclude` is NULL or readable for `nexclude` ranks; `newcomm_p` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_comm_shrink(
    comm: *mut c_void,
    exclude: *const c_int,
    nexclude: c_int,
    flags: c_int,
    newcomm_p: *mut *mut c_void,
) -> i32 {
    ffi_guard("gsc_comm_shrink", || {
        let c = handles::get::<Arc<Communicator>>(comm)?;
        if newcomm_p.is_null() {
            return Err(Error::invalid_param("newcomm_p is NULL"));
        }
        if flags & !SHRINK_ABORT != 0 {
            return Err(Error::invalid_param(format!("flags {flags:#x} (0 or GSC_SHRINK_ABORT)")));
        }
        let n = usize::try_from(nexclude).map_err(|_| Error::invalid_param(format!("nexclude is negative ({nexclude})")))?;
        if exclude.is_null() && n > 0 {
            return Err(Error::invalid_param(format!("exclude is NULL and nexclude is {n}")));
        }
        let list = match n {
            0 => &[][..],
            // SAFETY: the caller's contract: readable for n ranks (not NULL: checked above).
            _ => unsafe { std::slice::from_raw_parts(exclude, n) },
        };
        let ranks = list.iter().map(|&r| rank_arg(r, "a rank to exclude")).collect::<Result<Vec<usize>>>()?;
        c.check_shrink(&ranks)?;
        let config = crate::Config::from_env()?;
        if flags & SHRINK_ABORT != 0 && !c.revoked() {
            c.revoke()?;
        }
        crate::cuda::api::set_device(c.device())?;
        let made = c.shrink(&ranks, &config)?;
        // SAFETY: non-NULL (checked), writable by the caller's contract.
        unsafe { hand_out(newcomm_p, Some(made)) };
        Ok(Status::Ok.code())
    })
}

/// `gsc_comm_register`: the registration is a child of the communicator's handle, so it goes
/// with the communicator.
///
/// # Safety
/// `reg_p` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_comm_register(comm: *mut c_void, buf: *mut c_void, size: usize, reg_p: *mut *mut c_void) -> i32 {
    ffi_guard("gsc_comm_register", || {
        let c = handles::get::<Arc<Communicator>>(comm)?;
        if reg_p.is_null() {
            return Err(Error::invalid_param("reg_p is NULL"));
        }
        let reg = c.register(buf as u64, size)?;
        let h = handles::register(reg, comm);
        // SAFETY: non-NULL (checked), writable by the caller's contract.
        unsafe { reg_p.write(h) };
        Ok(Status::Ok.code())
    })
}

/// `gsc_comm_deregister`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_comm_deregister(comm: *mut c_void, reg: *mut c_void) -> i32 {
    ffi_guard("gsc_comm_deregister", || {
        handles::get::<Arc<Communicator>>(comm)?;
        if !std::ptr::eq(handles::parent_of::<Registration>(reg)?, comm) {
            return Err(Error::invalid_param(format!("registration {reg:p} is not of communicator {comm:p}")));
        }
        handles::unregister::<Registration>(reg)?;
        Ok(Status::Ok.code())
    })
}

/// `gsc_comm_window_register`: collective; the window is a child of the communicator's handle.
///
/// # Safety
/// `win_p` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_comm_window_register(
    comm: *mut c_void,
    buf: *mut c_void,
    size: usize,
    flags: i32,
    win_p: *mut *mut c_void,
) -> i32 {
    ffi_guard("gsc_comm_window_register", || {
        let c = handles::get::<Arc<Communicator>>(comm)?;
        if win_p.is_null() {
            return Err(Error::invalid_param("win_p is NULL"));
        }
        let symmetric = match flags {
            0 => false,
            1 => true,
            f => return Err(Error::invalid_param(format!("flags {f} (0 or GSC_WIN_SYMMETRIC)"))),
        };
        let window = c.register_window(buf as u64, size, symmetric)?;
        let h = handles::register(window, comm);
        // SAFETY: non-NULL (checked), writable by the caller's contract.
        unsafe { win_p.write(h) };
        Ok(Status::Ok.code())
    })
}

/// `gsc_comm_window_deregister`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_comm_window_deregister(comm: *mut c_void, win: *mut c_void) -> i32 {
    ffi_guard("gsc_comm_window_deregister", || {
        let c = handles::get::<Arc<Communicator>>(comm)?;
        if !std::ptr::eq(handles::parent_of::<Window>(win)?, comm) {
            return Err(Error::invalid_param(format!("window {win:p} is not of communicator {comm:p}")));
        }
        c.deregister_window(&handles::get::<Window>(win)?)?;
        handles::unregister::<Window>(win)?;
        Ok(Status::Ok.code())
    })
}

/// `gsc_gpu_mem_alloc`
///
/// # Safety
/// `ptr_p` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_gpu_mem_alloc(ptr_p: *mut *mut c_void, size: usize) -> i32 {
    ffi_guard("gsc_gpu_mem_alloc", || {
        if ptr_p.is_null() {
            return Err(Error::invalid_param("ptr_p is NULL"));
        }
        let ptr = crate::cuda::api::mem_alloc(size)?;
        // SAFETY: non-NULL (checked), writable by the caller's contract.
        unsafe { ptr_p.write(ptr as *mut c_void) };
        Ok(Status::Ok.code())
    })
}

/// `gsc_gpu_mem_free`
///
/// # Safety
/// Nothing uses the memory any more (a pointer the allocator did not hand out is refused).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_gpu_mem_free(ptr: *mut c_void) -> i32 {
    ffi_guard("gsc_gpu_mem_free", || {
        // SAFETY: the caller's contract.
        unsafe { crate::cuda::api::mem_free(ptr as u64) }?;
        Ok(Status::Ok.code())
    })
}

/// `gsc_release_peer_mappings`: close the mappings of peer allocations their owners freed
/// (`cuda::api::release_retired_peer_mappings`).
///
/// # Safety
/// `closed_p` is NULL or points to a writable size_t.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_release_peer_mappings(closed_p: *mut usize) -> i32 {
    ffi_guard("gsc_release_peer_mappings", || {
        let closed = crate::cuda::api::release_retired_peer_mappings()?;
        if !closed_p.is_null() {
            // SAFETY: the caller's contract.
            unsafe { *closed_p = closed };
        }
        Ok(Status::Ok.code())
    })
}

/// `gsc_comm_query`: GSC_OK, or why the communicator's collectives cannot be trusted (a kernel
/// gave up waiting for a peer).
#[unsafe(no_mangle)]
pub extern "C" fn gsc_comm_query(comm: *mut c_void) -> i32 {
    on_comm("gsc_comm_query", comm, Communicator::async_error)
}

/// `gsc_comm_all_reduce`
///
/// # Safety
/// The buffers are GPU memory of the communicator's device, valid for `count` elements until
/// the operation completed on `condition`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_comm_all_reduce(
    comm: *mut c_void,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    condition: *mut c_void,
) -> i32 {
    ffi_guard("gsc_comm_all_reduce", || {
        let (c, on) = comm_and_condition(comm, condition)?;
        without_outputs("gsc_comm_all_reduce", &on)?;
        // SAFETY: the caller's contract on the buffers.
        unsafe { c.all_reduce(sendbuf as u64, recvbuf as u64, count, datatype(dtype)?, red_op(op)?, &on) }?;
        Ok(Status::Ok.code())
    })
}

/// `gsc_comm_broadcast`
///
/// # Safety
/// As `gsc_comm_all_reduce`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_comm_broadcast(
    comm: *mut c_void,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    condition: *mut c_void,
) -> i32 {
    ffi_guard("gsc_comm_broadcast", || {
        let (c, on) = comm_and_condition(comm, condition)?;
        without_outputs("gsc_comm_broadcast", &on)?;
        // SAFETY: the caller's contract on the buffers.
        unsafe { c.broadcast(sendbuf as u64, recvbuf as u64, count, datatype(dtype)?, rank_arg(root, "root")?, &on) }?;
        Ok(Status::Ok.code())
    })
}

/// `gsc_comm_all_gather` (`count`: elements each rank contributes).
///
/// # Safety
/// As `gsc_comm_all_reduce`; `recvbuf` holds size × `count` elements.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_comm_all_gather(
    comm: *mut c_void,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: c_int,
    condition: *mut c_void,
) -> i32 {
    ffi_guard("gsc_comm_all_gather", || {
        let (c, on) = comm_and_condition(comm, condition)?;
        without_outputs("gsc_comm_all_gather", &on)?;
        // SAFETY: the caller's contract on the buffers.
        unsafe { c.all_gather(sendbuf as u64, recvbuf as u64, count, datatype(dtype)?, &on) }?;
        Ok(Status::Ok.code())
    })
}

/// `gsc_comm_send` / `gsc_comm_recv`
///
/// # Safety
/// `buf` is valid for `count` elements until the transfer completed on `condition`.
unsafe fn peer_op(
    name: &'static str,
    op: PeerOp,
    comm: *mut c_void,
    buf: u64,
    count: usize,
    dtype: c_int,
    peer: c_int,
    condition: *mut c_void,
) -> i32 {
    ffi_guard(name, || {
        let (c, on) = comm_and_condition(comm, condition)?;
        let (dtype, peer) = (datatype(dtype)?, rank_arg(peer, "peer")?);
        // SAFETY: the caller's contract on the buffer.
        match op {
            PeerOp::Send => unsafe { c.send(buf, count, dtype, peer, &on) }?,
            PeerOp::Recv => unsafe { c.recv(buf, count, dtype, peer, &on) }?,
        }
        Ok(Status::Ok.code())
    })
}

/// `gsc_comm_send`
///
/// # Safety
/// See `peer_op`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_comm_send(
    comm: *mut c_void,
    buf: *const c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    condition: *mut c_void,
) -> i32 {
    // SAFETY: forwarded caller contract.
    unsafe { peer_op("gsc_comm_send", PeerOp::Send, comm, buf as u64, count, dtype, peer, condition) }
}

/// `gsc_comm_recv`
///
/// # Safety
/// See `peer_op`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_comm_recv(
    comm: *mut c_void,
    buf: *mut c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    condition: *mut c_void,
) -> i32 {
    // SAFETY: forwarded caller contract.
    unsafe { peer_op("gsc_comm_recv", PeerOp::Recv, comm, buf as u64, count, dtype, peer, condition) }
}

/// `gsc_peer_transfer_t`. The enums are read as integers (see `CollDesc`).
#[repr(C)]
pub struct CPeerTransfer {
    pub op: c_int,
    pub buf: *mut c_void,
    pub count: usize,
    pub datatype: c_int,
    pub peer: c_int,
}

/// The group of `gsc_comm_transfers`, each entry checked (its index in every message).
pub(super) fn peer_transfers(entries: &[CPeerTransfer]) -> Result<Vec<PeerTransfer>> {
    let named = |i: usize, e: Error| Error::new(e.status(), format!("transfer {i}: {}", e.message()));
    let one = |t: &CPeerTransfer| -> Result<PeerTransfer> {
        let op = match t.op {
            0 => PeerOp::Send,
            1 => PeerOp::Recv,
            v => return Err(Error::invalid_param(format!("op {v} is not a gsc_peer_op_t"))),
        };
        let dtype = datatype(t.datatype)?;
        let bytes = t
            .count
            .checked_mul(dtype.size())
            .filter(|b| *b <= isize::MAX as usize)
            .ok_or_else(|| Error::invalid_param(format!("{} elements of {} bytes overflow", t.count, dtype.size())))?;
        Ok(PeerTransfer { op, buf: t.buf as u64, bytes, peer: rank_arg(t.peer, "peer")? })
    };
    entries.iter().enumerate().map(|(i, t)| one(t).map_err(|e| named(i, e))).collect()
}

/// `gsc_comm_transfers`
///
/// # Safety
/// `transfers` is NULL (with `n` 0) or readable for `n` entries; `out` is NULL or writable;
/// every buffer is valid for its elements until the group completed on `condition`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_comm_transfers(
    comm: *mut c_void,
    transfers: *const CPeerTransfer,
    n: usize,
    condition: *mut c_void,
    out: *mut ConditionOut,
) -> i32 {
    ffi_guard("gsc_comm_transfers", || {
        let (c, on) = comm_and_condition(comm, condition)?;
        if transfers.is_null() && n != 0 {
            return Err(Error::invalid_param(format!("transfers is NULL and n is {n}")));
        }
        let entries = if n == 0 {
            &[][..]
        } else {
            // SAFETY: the caller's contract: readable for n entries (not NULL: checked above).
            unsafe { std::slice::from_raw_parts(transfers, n) }
        };
        let group = peer_transfers(entries)?;
        // SAFETY: the caller's contract on the buffers.
        let armed = unsafe { c.transfers(&group, &on) }?;
        if !out.is_null() {
            // SAFETY: the caller's contract: writable when not NULL.
            unsafe { out.write(ConditionOut::from(armed)) };
        }
        Ok(Status::Ok.code())
    })
}
