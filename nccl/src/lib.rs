//! `libnccl.so.2` on gscomm: NCCL 2.28's C functions and types, implemented with gscomm's
//! communicators (`gscomm::collectives`), so a program built against NVIDIA's nccl.h runs on
//! gscomm when this library comes first on its library path.
//!
//! What is implemented: unique ids, communicator init (by rank, with a config, all local GPUs
//! from one thread), destroy / finalize / abort, count, device, rank, async errors, last-error
//! strings, group start/end (inits inside a group are completed together at its end, as NCCL
//! does; collectives are launched as they are called), all-reduce, broadcast (and the legacy
//! in-place bcast), reduce, all-gather, reduce-scatter, mem alloc/free. The rest of nccl.h
//! (send/recv and what is built on them, split, registration, windows, pre-multiplied sums,
//! device communicators) returns `ncclInvalidUsage` and says so in `ncclGetLastError`.
//!
//! Every exported function goes through `gate`: no panic crosses the C boundary, and a failure
//! leaves its message for `ncclGetLastError`.

#![allow(non_camel_case_types)]
#![allow(clippy::missing_safety_doc)] // the safety contract of each function is nccl.h's

use gscomm::bootstrap::{Bootstrap, UniqueId};
use gscomm::collectives::{Communicator, DataType, RedOp};
use gscomm::condition::{Category, Condition};
use gscomm::{Config, Error, Status};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{CString, c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;
use std::time::Duration;

pub type ncclResult_t = c_int;
pub const NCCL_SUCCESS: ncclResult_t = 0;
pub const NCCL_UNHANDLED_CUDA_ERROR: ncclResult_t = 1;
pub const NCCL_SYSTEM_ERROR: ncclResult_t = 2;
pub const NCCL_INTERNAL_ERROR: ncclResult_t = 3;
pub const NCCL_INVALID_ARGUMENT: ncclResult_t = 4;
pub const NCCL_INVALID_USAGE: ncclResult_t = 5;
pub const NCCL_REMOTE_ERROR: ncclResult_t = 6;

/// `NCCL_VERSION_CODE` of the nccl.h this library implements (2.28.9).
pub const NCCL_VERSION_CODE: c_int = 22809;

/// `ncclUniqueId`: 128 bytes, gscomm's `UniqueId` in its binary form.
#[repr(C)]
#[derive(Copy, Clone)]
pub struct ncclUniqueId {
    pub internal: [c_char; 128],
}
const _: () = assert!(gscomm::bootstrap::UNIQUE_ID_BYTES == 128);

/// What an `ncclComm_t` points at.
pub struct Comm {
    comm: Communicator,
    /// A stream condition per CUDA stream the program used (made once: a condition takes a
    /// page-locked slot).
    conditions: Mutex<HashMap<usize, Condition>>,
}
pub type ncclComm_t = *mut Comm;

/// A failure: the result code and the message for `ncclGetLastError`.
struct Fail(ncclResult_t, String);

impl From<Error> for Fail {
    fn from(e: Error) -> Fail {
        let code = match e.status() {
            Status::InvalidParam | Status::InvalidHandle | Status::OutOfRange | Status::InvalidAddress => NCCL_INVALID_ARGUMENT,
            Status::Unsupported | Status::Busy | Status::InvalidConfig => NCCL_INVALID_USAGE,
            Status::TimedOut | Status::PeerFailed | Status::Unreachable | Status::NotConnected | Status::ConnectionReset => {
                NCCL_REMOTE_ERROR
            }
            Status::NoDevice | Status::DeviceError | Status::LibraryMissing => NCCL_UNHANDLED_CUDA_ERROR,
            Status::IoError | Status::NoMemory | Status::NoResource => NCCL_SYSTEM_ERROR,
            _ => NCCL_INTERNAL_ERROR,
        };
        Fail(code, e.to_string())
    }
}

fn invalid(what: impl Into<String>) -> Fail {
    Fail(NCCL_INVALID_ARGUMENT, what.into())
}

fn unsupported(function: &str) -> Fail {
    Fail(NCCL_INVALID_USAGE, format!("{function} is not supported by gscomm's NCCL library yet"))
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    /// ncclGroupStart depth, and the inits deferred to the outermost ncclGroupEnd.
    static GROUP: RefCell<(u32, Vec<PendingInit>)> = const { RefCell::new((0, Vec::new())) };
}

/// The gate every exported function goes through (see the module doc).
fn gate(name: &str, body: impl FnOnce() -> Result<(), Fail>) -> ncclResult_t {
    let fail = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => return NCCL_SUCCESS,
        Ok(Err(f)) => f,
        Err(_) => Fail(NCCL_INTERNAL_ERROR, format!("{name}: internal error (a panic was caught)")),
    };
    let message = format!("{name}: {}", fail.1).replace('\0', "\\0");
    let _ = LAST_ERROR.try_with(|s| *s.borrow_mut() = CString::new(message).unwrap_or_default());
    fail.0
}

fn out<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T, Fail> {
    // SAFETY: nccl.h's contract: a non-null out-pointer is valid for writing a T.
    unsafe { p.as_mut() }.ok_or_else(|| invalid(format!("{what} is NULL")))
}

fn comm_ref<'a>(comm: ncclComm_t) -> Result<&'a Comm, Fail> {
    // SAFETY: a communicator this library made and the program has not destroyed.
    unsafe { comm.as_ref() }.ok_or_else(|| invalid("comm is NULL"))
}

fn config() -> Result<Config, Fail> {
    Ok(Config::from_env()?)
}

// ---------------------------------------------------------------------------------------------
// Versions, errors, ids

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> ncclResult_t {
    gate("ncclGetVersion", || {
        *out(version, "version")? = NCCL_VERSION_CODE;
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclGetErrorString(result: ncclResult_t) -> *const c_char {
    let s: &'static [u8] = match result {
        NCCL_SUCCESS => b"no error\0",
        NCCL_UNHANDLED_CUDA_ERROR => b"unhandled cuda error (run with NCCL_DEBUG=INFO for details)\0",
        NCCL_SYSTEM_ERROR => b"unhandled system error (run with NCCL_DEBUG=INFO for details)\0",
        NCCL_INTERNAL_ERROR => b"internal error - please report this issue to the NCCL developers\0",
        NCCL_INVALID_ARGUMENT => b"invalid argument (run with NCCL_DEBUG=WARN for details)\0",
        NCCL_INVALID_USAGE => b"invalid usage (run with NCCL_DEBUG=WARN for details)\0",
        NCCL_REMOTE_ERROR => b"remote process exited or there was a network error\0",
        7 => b"NCCL operation in progress\0",
        _ => b"unknown result code\0",
    };
    s.as_ptr() as *const c_char
}

/// The message of this thread's last failing call ("" if none), whatever `comm`.
#[unsafe(no_mangle)]
pub extern "C" fn ncclGetLastError(_comm: ncclComm_t) -> *const c_char {
    static EMPTY: &[u8] = b"\0";
    LAST_ERROR.try_with(|s| s.borrow().as_ptr()).unwrap_or(EMPTY.as_ptr() as *const c_char)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetUniqueId(unique_id: *mut ncclUniqueId) -> ncclResult_t {
    gate("ncclGetUniqueId", || {
        let id = out(unique_id, "uniqueId")?;
        let uid = UniqueId::create(None)?;
        for (d, s) in id.internal.iter_mut().zip(uid.to_bytes()) {
            *d = s as c_char;
        }
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// Communicators

/// An init to run: the communicator is written to `slot` when it succeeded.
struct PendingInit {
    slot: *mut ncclComm_t,
    nranks: c_int,
    id: ncclUniqueId,
    rank: c_int,
    device: i32,
}

fn init_comm(nranks: c_int, id: &ncclUniqueId, rank: c_int, device: i32) -> Result<ncclComm_t, Fail> {
    if nranks < 1 || rank < 0 || rank >= nranks {
        return Err(invalid(format!("rank {rank} of {nranks} ranks")));
    }
    let bytes: Vec<u8> = id.internal.iter().map(|c| *c as u8).collect();
    let uid = UniqueId::from_bytes(&bytes)?;
    let config = config()?;
    gscomm::cuda::api::set_device(device)?;
    let timeout = config.bootstrap_timeout.max(Duration::from_secs(1));
    let boot = Bootstrap::init(&uid, rank as u32, nranks as u32, timeout)?;
    let comm = Communicator::new(boot, device, &config)?;
    Ok(Box::into_raw(Box::new(Comm { comm, conditions: Mutex::new(HashMap::new()) })))
}

/// Run `inits` together (each joins the others' rendezvous), on threads of their own.
fn run_inits(inits: Vec<PendingInit>) -> Result<(), Fail> {
    let results: Vec<Result<ncclComm_t, Fail>> = std::thread::scope(|s| {
        let handles: Vec<_> = inits
            .iter()
            .map(|p| {
                let (nranks, id, rank, device) = (p.nranks, p.id, p.rank, p.device);
                s.spawn(move || init_comm(nranks, &id, rank, device).map(|c| c as usize))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h.join() {
                Ok(r) => r.map(|c| c as ncclComm_t),
                Err(_) => Err(Fail(NCCL_INTERNAL_ERROR, "communicator init: internal error (a panic was caught)".into())),
            })
            .collect()
    });
    let mut first = None;
    for (p, r) in inits.iter().zip(results) {
        match r {
            // SAFETY: the out-pointer the program passed to ncclCommInitRank, valid until its
            // group ended (nccl.h).
            Ok(c) => unsafe { *p.slot = c },
            Err(f) => first = first.or(Some(f)),
        }
    }
    first.map_or(Ok(()), Err)
}

fn init_rank(name: &str, comm: *mut ncclComm_t, nranks: c_int, id: ncclUniqueId, rank: c_int) -> ncclResult_t {
    gate(name, || {
        out(comm, "comm")?;
        let device = gscomm::cuda::api::current_device()?;
        let pending = PendingInit { slot: comm, nranks, id, rank, device };
        let deferred = GROUP.with(|g| {
            let mut g = g.borrow_mut();
            if g.0 > 0 {
                g.1.push(pending);
                None
            } else {
                Some(pending)
            }
        });
        match deferred {
            // Inside a group: completed at ncclGroupEnd, with the group's other inits.
            None => Ok(()),
            Some(p) => {
                let c = init_comm(p.nranks, &p.id, p.rank, p.device)?;
                // SAFETY: checked non-null above; nccl.h's out-pointer.
                unsafe { *comm = c };
                Ok(())
            }
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRank(comm: *mut ncclComm_t, nranks: c_int, id: ncclUniqueId, rank: c_int) -> ncclResult_t {
    init_rank("ncclCommInitRank", comm, nranks, id, rank)
}

/// The config is accepted and not read: gscomm's communicators are blocking, and their knobs
/// are GSC_ environment variables.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut ncclComm_t,
    nranks: c_int,
    id: ncclUniqueId,
    rank: c_int,
    _config: *mut c_void,
) -> ncclResult_t {
    init_rank("ncclCommInitRankConfig", comm, nranks, id, rank)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitAll(comms: *mut ncclComm_t, ndev: c_int, devlist: *const c_int) -> ncclResult_t {
    gate("ncclCommInitAll", || {
        if comms.is_null() {
            return Err(invalid("comms is NULL"));
        }
        if ndev < 1 {
            return Err(invalid(format!("ndev {ndev}")));
        }
        let uid = UniqueId::create(Some(std::net::Ipv4Addr::LOCALHOST.into()))?;
        let mut id = ncclUniqueId { internal: [0; 128] };
        for (d, s) in id.internal.iter_mut().zip(uid.to_bytes()) {
            *d = s as c_char;
        }
        let inits = (0..ndev)
            .map(|r| {
                // SAFETY: nccl.h: `devlist` (when not NULL) and `comms` hold `ndev` entries.
                let device = if devlist.is_null() { r } else { unsafe { *devlist.add(r as usize) } };
                PendingInit { slot: unsafe { comms.add(r as usize) }, nranks: ndev, id, rank: r, device }
            })
            .collect();
        run_inits(inits)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGroupStart() -> ncclResult_t {
    gate("ncclGroupStart", || {
        GROUP.with(|g| g.borrow_mut().0 += 1);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGroupEnd() -> ncclResult_t {
    gate("ncclGroupEnd", || {
        let inits = GROUP.with(|g| {
            let mut g = g.borrow_mut();
            if g.0 == 0 {
                return Err(Fail(NCCL_INVALID_USAGE, "ncclGroupEnd without ncclGroupStart".into()));
            }
            g.0 -= 1;
            Ok(if g.0 == 0 { std::mem::take(&mut g.1) } else { Vec::new() })
        })?;
        if inits.is_empty() { Ok(()) } else { run_inits(inits) }
    })
}

/// Destroy: the program has synchronized its streams (nccl.h: destroy waits for nothing here,
/// as gscomm's collectives hold no host state after their launch).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommDestroy(comm: ncclComm_t) -> ncclResult_t {
    gate("ncclCommDestroy", || {
        comm_ref(comm)?;
        // SAFETY: made by Box::into_raw in init_comm; destroyed once (nccl.h).
        drop(unsafe { Box::from_raw(comm) });
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommFinalize(comm: ncclComm_t) -> ncclResult_t {
    gate("ncclCommFinalize", || comm_ref(comm).map(|_| ()))
}

/// Abort frees the communicator like destroy: a kernel of it waiting for a dead peer gives up
/// by itself after GSC_TIMEOUT.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommAbort(comm: ncclComm_t) -> ncclResult_t {
    // SAFETY: as ncclCommDestroy.
    unsafe { ncclCommDestroy(comm) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommGetAsyncError(comm: ncclComm_t, async_error: *mut ncclResult_t) -> ncclResult_t {
    gate("ncclCommGetAsyncError", || {
        let c = comm_ref(comm)?;
        *out(async_error, "asyncError")? = match c.comm.async_error() {
            Ok(()) => NCCL_SUCCESS,
            Err(e) => Fail::from(e).0,
        };
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommCount(comm: ncclComm_t, count: *mut c_int) -> ncclResult_t {
    gate("ncclCommCount", || {
        *out(count, "count")? = comm_ref(comm)?.comm.nranks() as c_int;
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommCuDevice(comm: ncclComm_t, device: *mut c_int) -> ncclResult_t {
    gate("ncclCommCuDevice", || {
        *out(device, "device")? = comm_ref(comm)?.comm.device();
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommUserRank(comm: ncclComm_t, rank: *mut c_int) -> ncclResult_t {
    gate("ncclCommUserRank", || {
        *out(rank, "rank")? = comm_ref(comm)?.comm.rank() as c_int;
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// Collectives

/// The condition of `stream` for `c` (made at its first use).
fn on_stream(c: &Comm, stream: *mut c_void) -> Result<Condition, Fail> {
    let mut map = c.conditions.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(cond) = map.get(&(stream as usize)) {
        return Ok(cond.clone());
    }
    let cond = Condition::cuda(Category::Stream, stream as usize, None)?;
    map.insert(stream as usize, cond.clone());
    Ok(cond)
}

fn types(datatype: c_int, op: Option<c_int>) -> Result<(DataType, RedOp), Fail> {
    let dtype = DataType::from_nccl(datatype)?;
    let op = match op {
        Some(o) => RedOp::from_nccl(o)?,
        None => RedOp::Sum,
    };
    Ok((dtype, op))
}

fn root_of(root: c_int) -> Result<usize, Fail> {
    usize::try_from(root).map_err(|_| invalid(format!("root {root}")))
}

/// A collective entry point: `run` gets the communicator, the stream's condition and the
/// datatype and operator (`op`: None for those without one).
fn collective(
    name: &str,
    comm: ncclComm_t,
    stream: *mut c_void,
    datatype: c_int,
    op: Option<c_int>,
    run: impl FnOnce(&Communicator, &Condition, DataType, RedOp) -> gscomm::Result<gscomm::condition::ArmedOutputs>,
) -> ncclResult_t {
    gate(name, || {
        let c = comm_ref(comm)?;
        let (dtype, op) = types(datatype, op)?;
        let on = on_stream(c, stream)?;
        run(&c.comm, &on, dtype, op)?;
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    op: c_int,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> ncclResult_t {
    // SAFETY (each entry point): nccl.h's contract on the buffers and the stream.
    collective("ncclAllReduce", comm, stream, datatype, Some(op), |c, on, dtype, op| unsafe {
        c.all_reduce(sendbuff as u64, recvbuff as u64, count, dtype, op, on)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    root: c_int,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> ncclResult_t {
    let Ok(root) = root_of(root) else { return gate("ncclBroadcast", || Err(invalid(format!("root {root}")))) };
    // SAFETY: as ncclAllReduce.
    collective("ncclBroadcast", comm, stream, datatype, None, |c, on, dtype, _| unsafe {
        c.broadcast(sendbuff as u64, recvbuff as u64, count, dtype, root, on)
    })
}

/// The legacy in-place broadcast.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclBcast(
    buff: *mut c_void,
    count: usize,
    datatype: c_int,
    root: c_int,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> ncclResult_t {
    // SAFETY: as ncclBroadcast, in place.
    unsafe { ncclBroadcast(buff, buff, count, datatype, root, comm, stream) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    op: c_int,
    root: c_int,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> ncclResult_t {
    let Ok(root) = root_of(root) else { return gate("ncclReduce", || Err(invalid(format!("root {root}")))) };
    // SAFETY: as ncclAllReduce.
    collective("ncclReduce", comm, stream, datatype, Some(op), |c, on, dtype, op| unsafe {
        c.reduce(sendbuff as u64, recvbuff as u64, count, dtype, op, root, on)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: c_int,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> ncclResult_t {
    // SAFETY: as ncclAllReduce.
    collective("ncclAllGather", comm, stream, datatype, None, |c, on, dtype, _| unsafe {
        c.all_gather(sendbuff as u64, recvbuff as u64, sendcount, dtype, on)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: c_int,
    op: c_int,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> ncclResult_t {
    // SAFETY: as ncclAllReduce.
    collective("ncclReduceScatter", comm, stream, datatype, Some(op), |c, on, dtype, op| unsafe {
        c.reduce_scatter(sendbuff as u64, recvbuff as u64, recvcount, dtype, op, on)
    })
}

// ---------------------------------------------------------------------------------------------
// Memory

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> ncclResult_t {
    gate("ncclMemAlloc", || {
        let p = out(ptr, "ptr")?;
        *p = gscomm::cuda::api::mem_alloc(size)? as *mut c_void;
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclMemFree(ptr: *mut c_void) -> ncclResult_t {
    gate("ncclMemFree", || {
        if ptr.is_null() {
            return Ok(());
        }
        // SAFETY: nccl.h: memory from ncclMemAlloc, freed once.
        unsafe { gscomm::cuda::api::mem_free(ptr as u64) }?;
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// Not supported yet: each says so (ncclInvalidUsage and the last-error message).

macro_rules! not_yet {
    ($($name:ident($($arg:ident: $ty:ty),*);)*) => {$(
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> ncclResult_t {
            $(let _ = $arg;)*
            gate(stringify!($name), || Err(unsupported(stringify!($name))))
        }
    )*};
}

not_yet! {
    ncclSend(sendbuff: *const c_void, count: usize, datatype: c_int, peer: c_int, comm: ncclComm_t, stream: *mut c_void);
    ncclRecv(recvbuff: *mut c_void, count: usize, datatype: c_int, peer: c_int, comm: ncclComm_t, stream: *mut c_void);
    ncclCommSplit(comm: ncclComm_t, color: c_int, key: c_int, newcomm: *mut ncclComm_t, config: *mut c_void);
    ncclCommRegister(comm: ncclComm_t, buff: *mut c_void, size: usize, handle: *mut *mut c_void);
    ncclCommDeregister(comm: ncclComm_t, handle: *mut c_void);
    ncclCommWindowRegister(comm: ncclComm_t, buff: *mut c_void, size: usize, win: *mut *mut c_void, flags: c_int);
    ncclCommWindowDeregister(comm: ncclComm_t, win: *mut c_void);
    ncclRedOpCreatePreMulSum(op: *mut c_int, scalar: *mut c_void, datatype: c_int, residence: c_int, comm: ncclComm_t);
    ncclRedOpDestroy(op: c_int, comm: ncclComm_t);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn last() -> String {
        // SAFETY: a NUL-terminated string owned by this thread.
        unsafe { CStr::from_ptr(ncclGetLastError(std::ptr::null_mut())) }.to_string_lossy().into_owned()
    }

    #[test]
    fn version_and_error_strings() {
        let mut v = 0;
        assert_eq!(unsafe { ncclGetVersion(&mut v) }, NCCL_SUCCESS);
        assert_eq!(v, 22809);
        assert_eq!(unsafe { ncclGetVersion(std::ptr::null_mut()) }, NCCL_INVALID_ARGUMENT);
        assert!(last().contains("version is NULL"), "{}", last());
        for code in 0..8 {
            // SAFETY: static NUL-terminated strings.
            let s = unsafe { CStr::from_ptr(ncclGetErrorString(code)) };
            assert!(!s.to_bytes().is_empty());
        }
    }

    #[test]
    fn unique_ids_are_gscomm_ids() {
        let mut id = ncclUniqueId { internal: [0; 128] };
        assert_eq!(unsafe { ncclGetUniqueId(&mut id) }, NCCL_SUCCESS);
        let bytes: Vec<u8> = id.internal.iter().map(|c| *c as u8).collect();
        assert!(UniqueId::from_bytes(&bytes).is_ok());
    }

    #[test]
    fn bad_arguments_change_nothing_and_say_why() {
        let mut n = -1;
        assert_eq!(unsafe { ncclCommCount(std::ptr::null_mut(), &mut n) }, NCCL_INVALID_ARGUMENT);
        assert_eq!(n, -1);
        assert!(last().contains("comm is NULL"));
        let id = ncclUniqueId { internal: [0; 128] };
        let mut comm: ncclComm_t = std::ptr::null_mut();
        // Rank out of range: refused before anything is started (no GPU needed to say so).
        let r = unsafe { ncclCommInitRank(&mut comm, 2, id, 5) };
        assert_ne!(r, NCCL_SUCCESS);
        assert!(comm.is_null());
        assert_eq!(unsafe { ncclSend(std::ptr::null(), 1, 7, 0, std::ptr::null_mut(), std::ptr::null_mut()) }, NCCL_INVALID_USAGE);
        assert!(last().contains("ncclSend is not supported"), "{}", last());
    }

    #[test]
    fn groups_nest_and_unbalanced_end_is_an_error() {
        assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
        assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
        assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS);
        assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS);
        assert_eq!(unsafe { ncclGroupEnd() }, NCCL_INVALID_USAGE);
        assert!(last().contains("without ncclGroupStart"));
    }

    #[test]
    fn datatypes_and_ops_follow_nccl_h() {
        assert!(matches!(types(7, Some(0)), Ok((DataType::Float32, RedOp::Sum))));
        assert!(matches!(types(9, Some(4)), Ok((DataType::Bfloat16, RedOp::Avg))));
        assert!(types(10, Some(0)).is_err(), "fp8 is refused");
        assert!(types(7, Some(5)).is_err(), "pre-multiplied sum ops are not created");
    }
}
