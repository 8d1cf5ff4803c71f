//! `libnccl.so.2` on gscomm: NCCL 2.28's C functions and types, implemented with gscomm's
//! communicators (`gscomm::collectives`), so a program built against NVIDIA's nccl.h runs on
//! gscomm when this library comes first on its library path.
//!
//! What is implemented: unique ids, communicator init (by rank; with a config, blocking or not;
//! scalable, from several ids; all local GPUs from one thread), split, destroy / finalize /
//! abort, count, device, rank,
//! async errors, last-error strings, group start/end (inits and splits inside a group are
//! completed together at its end, as NCCL does; sends and receives in a group go on each
//! stream together at its end; collectives are launched as they are called), all-reduce,
//! broadcast (and the legacy in-place bcast), reduce, all-gather, reduce-scatter, send/recv
//! (and what groups build on them), nccl.h 2.28's all-to-all, gather and scatter (made of
//! sends and receives), buffer registration (checked; registered buffers take the zero-copy
//! paths as any buffer does), pre-multiplied sums (host and device scalars), mem alloc/free
//! (CUDA VMM memory with POSIX-descriptor handles, `gscomm::mem_alloc`), shrink and revoke,
//! symmetric windows (`ncclCommWindowRegister`), the profiling names (`pncclX`,
//! profiling.rs), and log output from `GSC_LOG_*` or `NCCL_DEBUG*` (debug.rs). The rest of
//! nccl.h (group simulation, the deprecated `ncclResetDebugInit`) and nccl_device.h's device
//! communicators return `ncclInvalidUsage` and
//! say so in `ncclGetLastError`: every function is defined, so a program that preloads this
//! library (PyTorch: scripts/torch-nccl.sh) never calls NVIDIA's with one of our handles.
//!
//! Every exported function goes through `gate`: no panic crosses the C boundary, and a failure
//! leaves its message for `ncclGetLastError`.

#![allow(non_camel_case_types)]
#![allow(clippy::missing_safety_doc)] // the safety contract of each function is nccl.h's

mod debug;
mod profiling;

use gscomm::bootstrap::{Bootstrap, RootOptions, UniqueId};
use gscomm::collectives::PeerTransfer;
use gscomm::collectives::p2p::PeerOp;
use gscomm::collectives::{Coll, Communicator, DataType, PreMulScalar, PremulKind, RankCall, RedOp, Registration, Window};
use gscomm::condition::{Category, Condition};
use gscomm::{Config, Error, Status};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{CString, c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

pub type ncclResult_t = c_int;
pub const NCCL_SUCCESS: ncclResult_t = 0;
pub const NCCL_UNHANDLED_CUDA_ERROR: ncclResult_t = 1;
pub const NCCL_SYSTEM_ERROR: ncclResult_t = 2;
pub const NCCL_INTERNAL_ERROR: ncclResult_t = 3;
pub const NCCL_INVALID_ARGUMENT: ncclResult_t = 4;
pub const NCCL_INVALID_USAGE: ncclResult_t = 5;
pub const NCCL_REMOTE_ERROR: ncclResult_t = 6;
pub const NCCL_IN_PROGRESS: ncclResult_t = 7;

/// `ncclNumOps`: operators from here on are made by `ncclRedOpCreatePreMulSum`.
pub const NCCL_NUM_OPS: c_int = 5;
/// `ncclScalarResidence_t`.
const NCCL_SCALAR_DEVICE: c_int = 0;
const NCCL_SCALAR_HOST_IMMEDIATE: c_int = 1;

/// `NCCL_SPLIT_NOCOLOR`: the rank takes part in a split and gets no communicator.
pub const NCCL_SPLIT_NOCOLOR: c_int = -1;

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
    /// Set when the init finished: the communicator, or why there is none. A non-blocking init
    /// sets it from its own thread; until then calls answer `ncclInProgress`.
    state: OnceLock<Result<Communicator, Fail>>,
    /// A non-blocking init's thread, joined by destroy.
    init_thread: Mutex<Option<JoinHandle<()>>>,
    /// Set by ncclCommAbort. Taken around the check of `state` in abort and around setting it
    /// in a non-blocking init, so a communicator whose init finishes after the abort is
    /// aborted too (whichever of the two comes second sees the other).
    aborted: Mutex<bool>,
    /// A stream condition per CUDA stream the program used (made once: a condition takes a
    /// page-locked slot).
    conditions: Mutex<HashMap<usize, Condition>>,
    /// Live `ncclCommRegister` handles (addresses of boxed `Registration`s), so a stale or
    /// foreign handle given to deregister is an error, not a double free.
    registrations: Mutex<Vec<usize>>,
    /// Live `ncclCommWindowRegister` handles (addresses of boxed `Window`s), likewise.
    windows: Mutex<Vec<usize>>,
    /// `ncclRedOpCreatePreMulSum` operators: op `NCCL_NUM_OPS + i` is entry i (None once
    /// destroyed), with the datatype it was made for.
    premul_ops: Mutex<Vec<Option<(DataType, PreMulScalar)>>>,
}

impl Drop for Comm {
    fn drop(&mut self) {
        for r in std::mem::take(&mut *self.registrations.get_mut().unwrap_or_else(|e| e.into_inner())) {
            // SAFETY: made by Box::into_raw in ncclCommRegister and not deregistered (a
            // deregistered one left this list); the communicator is gone, so are its handles.
            drop(unsafe { Box::from_raw(r as *mut Registration) });
        }
        for w in std::mem::take(&mut *self.windows.get_mut().unwrap_or_else(|e| e.into_inner())) {
            // SAFETY: made by Box::into_raw in `register_windows`, likewise.
            drop(unsafe { Box::from_raw(w as *mut Window) });
        }
    }
}

impl Comm {
    fn new() -> Comm {
        Comm {
            state: OnceLock::new(),
            init_thread: Mutex::new(None),
            aborted: Mutex::new(false),
            conditions: Mutex::new(HashMap::new()),
            registrations: Mutex::new(Vec::new()),
            windows: Mutex::new(Vec::new()),
            premul_ops: Mutex::new(Vec::new()),
        }
    }

    /// The pre-multiplied sum `op` names, for a collective on `dtype`.
    fn premul(&self, op: c_int, dtype: DataType) -> Result<Option<PreMulScalar>, Fail> {
        let Some(i) = op.checked_sub(NCCL_NUM_OPS).and_then(|i| usize::try_from(i).ok()) else { return Ok(None) };
        let ops = self.premul_ops.lock().unwrap_or_else(|e| e.into_inner());
        match ops.get(i).copied().flatten() {
            Some((t, scalar)) if t == dtype => Ok(Some(scalar)),
            Some((t, _)) => Err(invalid(format!("operator {op} was made for {} data, not {}", t.name(), dtype.name()))),
            None => Err(invalid(format!("operator {op} is not a live ncclRedOpCreatePreMulSum operator of this communicator"))),
        }
    }

    /// The communicator, once its init succeeded.
    fn ready(&self) -> Result<&Communicator, Fail> {
        match self.state.get() {
            Some(Ok(c)) => Ok(c),
            Some(Err(f)) => Err(Fail(f.0, format!("the communicator's init failed: {}", f.1))),
            None => Err(Fail(NCCL_IN_PROGRESS, "the communicator is still initializing (poll ncclCommGetAsyncError)".into())),
        }
    }
}
pub type ncclComm_t = *mut Comm;

/// The value `ncclComm_t` handles start from: above every user-space address on the 64-bit
/// targets this library is built for, so a handle never equals a pointer of the program's.
const HANDLE_BASE: usize = 0x6e63 << 48;

/// Live communicators by handle. A handle is a token, never dereferenced: it is looked up here,
/// and a call holds its own reference (`Arc`) to the communicator for as long as it runs. So a
/// handle that was destroyed or aborted — even by another thread while a call on it was in
/// progress, which PyTorch-style watchdogs do with ncclCommAbort — is refused with
/// `ncclInvalidArgument`, never read after it was freed, and a call in progress finishes on a
/// communicator that is freed only after it returned. Tokens are never reused, so a stale
/// handle cannot alias a newer communicator either.
fn live() -> std::sync::MutexGuard<'static, HashMap<usize, Arc<Comm>>> {
    static LIVE: OnceLock<Mutex<HashMap<usize, Arc<Comm>>>> = OnceLock::new();
    // Each update is one insert or remove: a panic elsewhere cannot leave the map half-changed.
    LIVE.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner())
}

/// Register `comm`: its handle, and the reference a background init keeps.
fn new_handle(comm: Comm) -> (ncclComm_t, Arc<Comm>) {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let handle = HANDLE_BASE + (n << 4);
    let comm = Arc::new(comm);
    live().insert(handle, comm.clone());
    (handle as ncclComm_t, comm)
}

/// Remove `comm`'s handle (destroy, abort): later calls with it are refused. The communicator
/// itself goes when the last call still using it returns.
fn take_handle(comm: ncclComm_t) -> Result<Arc<Comm>, Fail> {
    if comm.is_null() {
        return Err(invalid("comm is NULL"));
    }
    live().remove(&(comm as usize)).ok_or_else(stale)
}

fn stale() -> Fail {
    invalid("comm is not a live communicator of this library (destroyed, aborted, or never made)")
}

/// A failure: the result code and the message for `ncclGetLastError`.
#[derive(Clone, Debug)]
struct Fail(ncclResult_t, String);

impl From<Error> for Fail {
    fn from(e: Error) -> Fail {
        let code = match e.status() {
            Status::InvalidParam | Status::InvalidHandle | Status::OutOfRange | Status::InvalidAddress => NCCL_INVALID_ARGUMENT,
            // Canceled: a call on a revoked communicator (NCCL answers ncclInvalidUsage).
            Status::Unsupported | Status::Busy | Status::InvalidConfig | Status::Canceled => NCCL_INVALID_USAGE,
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
    static GROUP: RefCell<Group> =
        const { RefCell::new(Group { depth: 0, inits: Vec::new(), collectives: Vec::new(), transfers: Vec::new(), windows: Vec::new() }) };
}

/// This thread's ncclGroupStart nesting and what its outermost ncclGroupEnd completes.
struct Group {
    depth: u32,
    /// Inits and splits, run together at the end.
    inits: Vec<PendingInit>,
    /// Collectives on communicators whose ranks all live in this process, in the order they
    /// were called: issued at the end, where every rank's call of one communicator is known
    /// (`gscomm::collectives::issue_group`), so they take the paths on the peers' buffers as
    /// ranks in separate processes do. Other communicators' collectives are issued at once.
    collectives: Vec<PendingCollective>,
    /// The sends and receives issued in the group, by (communicator, stream) in the order
    /// each pair first appeared: issued together at the end.
    transfers: Vec<GroupTransfers>,
    /// Window registrations, in the order they were called: at the end, each communicator's
    /// in that order, the communicators side by side (each is collective).
    windows: Vec<PendingWindow>,
}

/// An `ncclCommWindowRegister` in a group.
struct PendingWindow {
    comm: Arc<Comm>,
    addr: u64,
    bytes: usize,
    symmetric: bool,
    /// The program's `ncclWindow_t*`.
    slot: usize,
}

/// A collective in a group, checked, to issue at its end.
struct PendingCollective {
    comm: Arc<Comm>,
    on: Condition,
    call: Coll,
}

/// A group's sends and receives on one communicator and stream.
struct GroupTransfers {
    comm: Arc<Comm>,
    on: Condition,
    group: Vec<PeerTransfer>,
}

/// The gate every exported function goes through (see the module doc).
fn gate(name: &str, body: impl FnOnce() -> Result<(), Fail>) -> ncclResult_t {
    let fail = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => return NCCL_SUCCESS,
        Ok(Err(f)) => f,
        Err(_) => Fail(NCCL_INTERNAL_ERROR, format!("{name}: internal error (a panic was caught)")),
    };
    if fail.0 == NCCL_IN_PROGRESS {
        // Not a failure: a non-blocking call that goes on in the background.
        return fail.0;
    }
    let message = format!("{name}: {}", fail.1).replace('\0', "\\0");
    let _ = LAST_ERROR.try_with(|s| *s.borrow_mut() = CString::new(message).unwrap_or_default());
    fail.0
}

fn out<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T, Fail> {
    // SAFETY: nccl.h's contract: a non-null out-pointer is valid for writing a T.
    unsafe { p.as_mut() }.ok_or_else(|| invalid(format!("{what} is NULL")))
}

/// The live communicator `comm` names, held for the duration of the call (see `live`).
fn comm_ref(comm: ncclComm_t) -> Result<Arc<Comm>, Fail> {
    if comm.is_null() {
        return Err(invalid("comm is NULL"));
    }
    live().get(&(comm as usize)).cloned().ok_or_else(stale)
}

/// gscomm's configuration from the environment. The first call also sets up logging from it
/// (`debug`), so an init is what starts the log, as NVIDIA's library's does.
fn config() -> Result<Config, Fail> {
    let load = Config::load_env()?;
    debug::install_once(&load);
    Ok(load.config)
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
        debug::start();
        let id = out(unique_id, "uniqueId")?;
        let uid = match comm_id() {
            Some(value) => comm_id_uid(&value, &config()?)?,
            None => UniqueId::create(None)?,
        };
        for (d, s) in id.internal.iter_mut().zip(uid.to_bytes()) {
            *d = s as c_char;
        }
        Ok(())
    })
}

/// `NCCL_COMM_ID` (`host:port`), when set: every process's ncclGetUniqueId gives the same id,
/// whose root rank 0's init starts at that address (NVIDIA's rule), so a launcher need not hand
/// an id around.
fn comm_id() -> Option<String> {
    std::env::var("NCCL_COMM_ID").ok().filter(|v| !v.trim().is_empty())
}

/// The id `NCCL_COMM_ID=value` names. Its secret is `GSC_BOOTSTRAP_SECRET` where set, else
/// derived from the value: like NVIDIA's root, which has none, it then only keeps different
/// jobs apart, not a local attacker out.
fn comm_id_uid(value: &str, config: &Config) -> Result<UniqueId, Fail> {
    let seed = config.bootstrap_secret.clone().unwrap_or_else(|| format!("NCCL_COMM_ID={}", value.trim()));
    UniqueId::with_root_at(value.trim(), seed.as_bytes(), "NCCL_COMM_ID")
        .map_err(|e| invalid(format!("{} (NCCL_COMM_ID is <ipv4>:<port>, [<ipv6>]:<port> or <hostname>:<port>)", e.message())))
}

// ---------------------------------------------------------------------------------------------
// Communicators

/// What an init makes a communicator from.
enum InitJob {
    /// ncclCommInitRank(Config) / ncclCommInitAll: join the rendezvous of `id` on `device`;
    /// `serve_root`: start its root first (rank 0 under `NCCL_COMM_ID`).
    Rank { nranks: c_int, id: ncclUniqueId, rank: c_int, device: i32, serve_root: bool },
    /// ncclCommSplit of `parent`.
    Split { parent: Arc<Comm>, color: Option<u32>, key: i32 },
    /// ncclCommShrink of `parent` without the ranks of `exclude`.
    Shrink { parent: Arc<Comm>, exclude: Vec<usize> },
}

/// An init or split to run; its communicator (or NULL, for a split without a color) goes to
/// `slot` (an `*mut ncclComm_t`, kept as an address so pending inits can cross threads).
struct PendingInit {
    slot: usize,
    job: InitJob,
    /// A config's `blocking` field: 0 runs the init on a thread of its own and answers
    /// `ncclInProgress` at once.
    blocking: bool,
}

fn run_job(job: &InitJob) -> Result<Option<Communicator>, Fail> {
    let made = make(job)?;
    if let Some(c) = &made {
        let how = match job {
            InitJob::Rank { .. } => "init",
            InitJob::Split { .. } => "split",
            InitJob::Shrink { .. } => "shrink",
        };
        tracing::info!(target: "gsc::capi", "{how}: rank {} of {} on CUDA device {} ready", c.rank(), c.nranks(), c.device());
    }
    Ok(made)
}

fn make(job: &InitJob) -> Result<Option<Communicator>, Fail> {
    match *job {
        InitJob::Rank { nranks, ref id, rank, device, serve_root } => {
            if nranks < 1 || rank < 0 || rank >= nranks {
                return Err(invalid(format!("rank {rank} of {nranks} ranks")));
            }
            let bytes: Vec<u8> = id.internal.iter().map(|c| *c as u8).collect();
            let uid = UniqueId::from_bytes(&bytes)?;
            let config = config()?;
            gscomm::cuda::api::set_device(device)?;
            let timeout = config.bootstrap_timeout.max(Duration::from_secs(1));
            if serve_root {
                let opts = RootOptions { timeout, ..RootOptions::default() };
                uid.serve(&opts).map_err(|e| e.context("NCCL_COMM_ID: rank 0 starts the rendezvous there"))?;
            }
            let boot = Bootstrap::init(&uid, rank as u32, nranks as u32, timeout)?;
            Ok(Some(Communicator::new(boot, device, &config)?))
        }
        InitJob::Split { ref parent, color, key } => {
            let parent = parent.ready()?;
            gscomm::cuda::api::set_device(parent.device())?;
            Ok(parent.split(color, key, &config()?)?)
        }
        InitJob::Shrink { ref parent, ref exclude } => {
            let parent = parent.ready()?;
            gscomm::cuda::api::set_device(parent.device())?;
            Ok(Some(parent.shrink(exclude, &config()?)?))
        }
    }
}

/// Run `inits`: the blocking ones together on threads of their own (each joins the others'
/// rendezvous), waited for here; the others started on threads that outlive the call
/// (`ncclInProgress`: the program polls ncclCommGetAsyncError on the new communicator).
fn start_inits(inits: Vec<PendingInit>) -> Result<(), Fail> {
    let (blocking, background): (Vec<_>, Vec<_>) = inits.into_iter().partition(|p| p.blocking);
    let in_background = !background.is_empty();
    for p in background {
        let (handle, comm) = new_handle(Comm::new());
        // SAFETY: the program's out-pointer (nccl.h), valid for the call.
        unsafe { *(p.slot as *mut ncclComm_t) = handle };
        let mine = comm.clone();
        let thread = std::thread::Builder::new()
            .name("gsc-nccl-init".into())
            .spawn(move || {
                let state = catch_unwind(AssertUnwindSafe(|| run_job(&p.job)))
                    .unwrap_or_else(|_| Err(Fail(NCCL_INTERNAL_ERROR, "communicator init: internal error (a panic was caught)".into())))
                    .and_then(|c| c.ok_or_else(|| invalid("a split without a color makes no communicator")));
                let aborted = mine.aborted.lock().unwrap_or_else(|e| e.into_inner());
                let _ = mine.state.set(state);
                if *aborted && let Some(Ok(c)) = mine.state.get() {
                    // ncclCommAbort came while this init ran: nobody will use the result.
                    let _ = c.abort("ncclCommAbort during a non-blocking init");
                }
            })
            .map_err(|e| Fail(NCCL_SYSTEM_ERROR, format!("no thread for the init: {e}")))?;
        *comm.init_thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(thread);
    }
    let results: Vec<Result<Option<Communicator>, Fail>> = std::thread::scope(|s| {
        let handles: Vec<_> = blocking.iter().map(|p| s.spawn(|| run_job(&p.job))).collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| Err(Fail(NCCL_INTERNAL_ERROR, "communicator init: internal error (a panic was caught)".into())))
            })
            .collect()
    });
    let mut first = None;
    for (p, r) in blocking.iter().zip(results) {
        match r {
            Ok(made) => {
                let comm = made.map_or(std::ptr::null_mut(), |c| {
                    let comm = Comm::new();
                    let _ = comm.state.set(Ok(c));
                    new_handle(comm).0
                });
                // SAFETY: the program's out-pointer, valid until its group ended (nccl.h).
                unsafe { *(p.slot as *mut ncclComm_t) = comm };
            }
            Err(f) => first = first.or(Some(f)),
        }
    }
    match first {
        Some(f) => Err(f),
        None if in_background => Err(Fail(NCCL_IN_PROGRESS, String::new())),
        None => Ok(()),
    }
}

/// Queue `init` for the group's end, or run it now outside a group.
fn init_or_defer(init: PendingInit) -> Result<(), Fail> {
    let now = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth > 0 {
            g.inits.push(init);
            None
        } else {
            Some(init)
        }
    });
    match now {
        // Inside a group: completed at ncclGroupEnd, with the group's other inits.
        None => Ok(()),
        Some(init) => start_inits(vec![init]),
    }
}

/// `ncclConfig_t` up to the field read here (nccl.h 2.28): a config is accepted whatever its
/// other fields say, since gscomm's knobs are GSC_ environment variables.
#[repr(C)]
struct ConfigHead {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
}

/// `NCCL_CONFIG_UNDEF_INT`: a field the program left at its default.
const CONFIG_UNDEF_INT: c_int = i32::MIN;

/// The config's `blocking` (default: blocking).
fn blocking(config: *const c_void) -> Result<bool, Fail> {
    // SAFETY: nccl.h: NULL or an ncclConfig_t made with NCCL_CONFIG_INITIALIZER.
    let Some(head) = (unsafe { (config as *const ConfigHead).as_ref() }) else { return Ok(true) };
    if head.size < std::mem::size_of::<ConfigHead>() {
        return Err(invalid(format!("a config of size {} (not made with NCCL_CONFIG_INITIALIZER?)", head.size)));
    }
    match head.blocking {
        CONFIG_UNDEF_INT | 1 => Ok(true),
        0 => Ok(false),
        b => Err(invalid(format!("config.blocking = {b} (0 or 1)"))),
    }
}

fn init_rank(comm: *mut ncclComm_t, nranks: c_int, id: ncclUniqueId, rank: c_int, config: *const c_void) -> Result<(), Fail> {
    debug::start();
    out(comm, "comm")?;
    let blocking = blocking(config)?;
    let device = gscomm::cuda::api::current_device()?;
    // As NVIDIA's: under NCCL_COMM_ID no root was started by ncclGetUniqueId; rank 0 starts it.
    let serve_root = rank == 0 && comm_id().is_some();
    init_or_defer(PendingInit { slot: comm as usize, job: InitJob::Rank { nranks, id, rank, device, serve_root }, blocking })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRank(comm: *mut ncclComm_t, nranks: c_int, id: ncclUniqueId, rank: c_int) -> ncclResult_t {
    gate("ncclCommInitRank", || init_rank(comm, nranks, id, rank, std::ptr::null()))
}

/// Of the config, `blocking` is read (0: the init goes on in the background and the call
/// answers `ncclInProgress`); the rest is accepted: gscomm's knobs are GSC_ variables.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut ncclComm_t,
    nranks: c_int,
    id: ncclUniqueId,
    rank: c_int,
    config: *mut c_void,
) -> ncclResult_t {
    gate("ncclCommInitRankConfig", || init_rank(comm, nranks, id, rank, config))
}

/// NCCL spreads its bootstrap over the `n_ids` ids (made by different ranks) to start large
/// jobs faster. gscomm's rendezvous takes one root, so every rank joins that of the first id
/// (all ranks hold the same ids in the same order); the other ids' root services, never
/// contacted, end by themselves after their timeout.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRankScalable(
    comm: *mut ncclComm_t,
    nranks: c_int,
    rank: c_int,
    n_ids: c_int,
    ids: *mut ncclUniqueId,
    config: *mut c_void,
) -> ncclResult_t {
    gate("ncclCommInitRankScalable", || {
        if n_ids < 1 || n_ids > nranks.max(1) {
            return Err(invalid(format!("nId {n_ids} (from 1 to nranks, {nranks})")));
        }
        // SAFETY: nccl.h: `ids` holds `n_ids` ids (checked for NULL here).
        let first = unsafe { ids.as_ref() }.ok_or_else(|| invalid("commIds is NULL"))?;
        init_rank(comm, nranks, *first, rank, config)
    })
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
                let slot = unsafe { comms.add(r as usize) } as usize;
                PendingInit { slot, job: InitJob::Rank { nranks: ndev, id, rank: r, device, serve_root: false }, blocking: true }
            })
            .collect();
        start_inits(inits)
    })
}

/// Collective over `comm`. `color` `NCCL_SPLIT_NOCOLOR` takes part and gets NULL. Splits run
/// blocking whatever the config says (they are collective over a communicator that exists).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommSplit(
    comm: ncclComm_t,
    color: c_int,
    key: c_int,
    newcomm: *mut ncclComm_t,
    _config: *mut c_void,
) -> ncclResult_t {
    gate("ncclCommSplit", || {
        comm_ref(comm)?.ready()?;
        out(newcomm, "newcomm")?;
        let color = match color {
            NCCL_SPLIT_NOCOLOR => None,
            c if c >= 0 => Some(c as u32),
            c => return Err(invalid(format!("color {c} (a color is >= 0, or NCCL_SPLIT_NOCOLOR)"))),
        };
        let parent = comm_ref(comm)?;
        init_or_defer(PendingInit { slot: newcomm as usize, job: InitJob::Split { parent, color, key }, blocking: true })
    })
}

/// `NCCL_SHRINK_ABORT`: stop what is in flight on the parent first.
const NCCL_SHRINK_ABORT: c_int = 1;

/// Called by the ranks that stay (an excluded rank does not call it: it may be dead), each with
/// the same ranks in any order. With `NCCL_SHRINK_ABORT` the parent is revoked first, so a
/// collective or send/recv waiting for an excluded rank gives up; the parent is then good for
/// destroy, split and shrink only (`ncclCommRevoke`). Non-blocking where the config says so.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommShrink(
    comm: ncclComm_t,
    exclude_ranks: *mut c_int,
    exclude_count: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut c_void,
    shrink_flags: c_int,
) -> ncclResult_t {
    gate("ncclCommShrink", || {
        let parent = comm_ref(comm)?;
        out(newcomm, "newcomm")?;
        if shrink_flags & !NCCL_SHRINK_ABORT != 0 {
            return Err(invalid(format!("shrinkFlags {shrink_flags:#x} (NCCL_SHRINK_DEFAULT or NCCL_SHRINK_ABORT)")));
        }
        let count = usize::try_from(exclude_count).ok().filter(|&n| n > 0);
        let count = count.ok_or_else(|| invalid(format!("excludeRanksCount {exclude_count} (at least one rank to exclude)")))?;
        if exclude_ranks.is_null() {
            return Err(invalid("excludeRanksList is NULL"));
        }
        // SAFETY: nccl.h: the list holds `excludeRanksCount` ranks (checked for NULL above).
        let list = unsafe { std::slice::from_raw_parts(exclude_ranks, count) };
        let exclude = list
            .iter()
            .map(|&r| usize::try_from(r).map_err(|_| invalid(format!("rank {r} in excludeRanksList"))))
            .collect::<Result<Vec<usize>, Fail>>()?;
        let blocking = blocking(config)?;
        let communicator = parent.ready()?;
        // A bad list changes nothing, the revoke included.
        communicator.check_shrink(&exclude)?;
        if shrink_flags & NCCL_SHRINK_ABORT != 0 && !communicator.revoked() {
            communicator.revoke()?;
        }
        init_or_defer(PendingInit { slot: newcomm as usize, job: InitJob::Shrink { parent, exclude }, blocking })
    })
}

/// Stops what is in flight (as abort does) and keeps the communicator for destroy, split and
/// shrink; collectives and send/recv on it then fail with `ncclInvalidUsage`. Returns once
/// this rank's transfers are failed and its kernels told to give up; its async error reads
/// ncclSuccess from then on (NCCL's state once quiescent). Local: each rank revokes its own.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommRevoke(comm: ncclComm_t, revoke_flags: c_int) -> ncclResult_t {
    gate("ncclCommRevoke", || {
        let c = comm_ref(comm)?;
        if revoke_flags != 0 {
            return Err(invalid(format!("revokeFlags {revoke_flags} (NCCL_REVOKE_DEFAULT, 0)")));
        }
        Ok(c.ready()?.revoke()?)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGroupStart() -> ncclResult_t {
    gate("ncclGroupStart", || {
        GROUP.with(|g| g.borrow_mut().depth += 1);
        Ok(())
    })
}

/// The outermost end registers its windows (`ncclCommWindowRegister`), issues its sends and
/// receives (per communicator and stream, together: `Communicator::transfers`), then runs its
/// inits and splits.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGroupEnd() -> ncclResult_t {
    gate("ncclGroupEnd", || {
        let (inits, collectives, transfers, windows) = GROUP.with(|g| {
            let mut g = g.borrow_mut();
            if g.depth == 0 {
                return Err(Fail(NCCL_INVALID_USAGE, "ncclGroupEnd without ncclGroupStart".into()));
            }
            g.depth -= 1;
            Ok(match g.depth {
                0 => (
                    std::mem::take(&mut g.inits),
                    std::mem::take(&mut g.collectives),
                    std::mem::take(&mut g.transfers),
                    std::mem::take(&mut g.windows),
                ),
                _ => Default::default(),
            })
        })?;
        let mut first = register_windows(windows).err();
        if let Err(f) = issue_collectives(&collectives) {
            first = first.or(Some(f));
        }
        for t in transfers {
            if let Err(f) = issue_transfers(&t) {
                first = first.or(Some(f));
            }
        }
        let inits = if inits.is_empty() { Ok(()) } else { start_inits(inits) };
        match first {
            Some(f) => Err(f),
            None => inits,
        }
    })
}

/// Destroy: the program has synchronized its streams (nccl.h). A non-blocking init still
/// running is waited for (bounded by the bootstrap timeout). The handle is refused from here
/// on; the communicator is freed once no call is using it (at once, unless another thread is
/// inside a call on it).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommDestroy(comm: ncclComm_t) -> ncclResult_t {
    gate("ncclCommDestroy", || {
        let c = take_handle(comm)?;
        let init = c.init_thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = init {
            let _ = t.join();
        }
        drop(c);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommFinalize(comm: ncclComm_t) -> ncclResult_t {
    gate("ncclCommFinalize", || comm_ref(comm).map(|_| ()))
}

/// Abort, from any thread (issue #8): send/recv in flight or waiting on a stream fail and
/// release their streams, and this rank's collective kernels give up at their next wait
/// (`Communicator::abort`); the handle is refused from here on, as after destroy. Unlike
/// NCCL's, it may be called while other threads are inside calls on the communicator (a
/// collective being enqueued, ncclCommGetAsyncError polled by a watchdog): those calls finish
/// (or fail with the abort error) and the communicator is freed when the last one returns. A
/// non-blocking init still running (NCCL's pattern: init, time out, abort) is not waited for:
/// it finishes on its own thread (bounded by the bootstrap timeout), aborts what it made, and
/// frees it, so abort returns at once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommAbort(comm: ncclComm_t) -> ncclResult_t {
    gate("ncclCommAbort", || {
        let c = take_handle(comm)?;
        let mut aborted = c.aborted.lock().unwrap_or_else(|e| e.into_inner());
        *aborted = true;
        if let Some(Ok(communicator)) = c.state.get() {
            communicator.abort("ncclCommAbort")?;
        }
        drop(aborted);
        // Detach a running init: its thread holds its own reference and ends by itself.
        drop(c.init_thread.lock().unwrap_or_else(|e| e.into_inner()).take());
        Ok(())
    })
}

/// `ncclInProgress` while a non-blocking init runs; then its failure, a collective kernel's
/// timeout, or the first failed send/recv on any of the communicator's streams.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommGetAsyncError(comm: ncclComm_t, async_error: *mut ncclResult_t) -> ncclResult_t {
    gate("ncclCommGetAsyncError", || {
        let c = comm_ref(comm)?;
        let slot = out(async_error, "asyncError")?;
        *slot = match c.ready() {
            Err(f) => f.0,
            Ok(communicator) if communicator.revoked() => NCCL_SUCCESS,
            Ok(communicator) => {
                let conditions = c.conditions.lock().unwrap_or_else(|e| e.into_inner());
                let p2p = conditions.values().map(|cond| cond.query()).find(|r| r.is_err()).unwrap_or(Ok(()));
                match communicator.async_error().and(p2p) {
                    Ok(()) => NCCL_SUCCESS,
                    Err(e) => Fail::from(e).0,
                }
            }
        };
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommCount(comm: ncclComm_t, count: *mut c_int) -> ncclResult_t {
    gate("ncclCommCount", || {
        *out(count, "count")? = comm_ref(comm)?.ready()?.nranks() as c_int;
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommCuDevice(comm: ncclComm_t, device: *mut c_int) -> ncclResult_t {
    gate("ncclCommCuDevice", || {
        *out(device, "device")? = comm_ref(comm)?.ready()?.device();
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommUserRank(comm: ncclComm_t, rank: *mut c_int) -> ncclResult_t {
    gate("ncclCommUserRank", || {
        *out(rank, "rank")? = comm_ref(comm)?.ready()?.rank() as c_int;
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

/// A collective entry point: `make` describes the call from the datatype and operator (`op`:
/// None for those without one).
fn collective(
    name: &str,
    comm: ncclComm_t,
    stream: *mut c_void,
    datatype: c_int,
    op: Option<c_int>,
    make: impl FnOnce(DataType, RedOp) -> Coll,
) -> ncclResult_t {
    gate(name, || {
        let c = comm_ref(comm)?;
        let (dtype, op) = types(datatype, op)?;
        let on = on_stream(&c, stream)?;
        enqueue_collective(&c, on, make(dtype, op))
    })
}

/// Inside a group, on a communicator whose ranks all live in this process, keep `call` for
/// the group's end; otherwise issue it now.
fn enqueue_collective(c: &Arc<Comm>, on: Condition, call: Coll) -> Result<(), Fail> {
    let communicator = c.ready()?;
    let now = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 || communicator.family_here().is_none() {
            return Some(Ok((on, call)));
        }
        // Bad arguments fail the call itself, as NCCL's checks at enqueue do.
        if let Err(e) = communicator.check_collective(&call) {
            return Some(Err(e));
        }
        g.collectives.push(PendingCollective { comm: c.clone(), on, call });
        None
    });
    if let Some(now) = now {
        let (on, call) = now?;
        // SAFETY: nccl.h's contract on the buffers and the stream.
        unsafe { communicator.collective(&call, &on) }?;
    }
    Ok(())
}

/// A group's collectives, issued together (`enqueue_collective`): the first failure, after
/// every call was tried.
fn issue_collectives(pending: &[PendingCollective]) -> Result<(), Fail> {
    let mut calls = Vec::with_capacity(pending.len());
    let mut first = None;
    for p in pending {
        match p.comm.ready() {
            Ok(comm) => calls.push(RankCall { comm, call: p.call, on: &p.on }),
            Err(f) => first = first.or(Some(f)),
        }
    }
    // SAFETY: nccl.h's contract on the buffers and the streams, for every call of the group.
    let results = unsafe { gscomm::collectives::issue_group(&calls) };
    match results.into_iter().find_map(Result::err) {
        Some(e) => Err(first.unwrap_or_else(|| Fail::from(e))),
        None => first.map_or(Ok(()), Err),
    }
}

/// A reduction with an `ncclRedOpCreatePreMulSum` operator.
#[allow(clippy::too_many_arguments)]
fn premul(
    name: &str,
    kind: PremulKind,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    datatype: c_int,
    op: c_int,
    root: usize,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> ncclResult_t {
    gate(name, || {
        let c = comm_ref(comm)?;
        c.ready()?;
        let dtype = DataType::from_nccl(datatype)?;
        let scalar = c.premul(op, dtype)?.ok_or_else(|| invalid(format!("operator {op}")))?;
        let on = on_stream(&c, stream)?;
        enqueue_collective(&c, on, Coll::PremulSum { kind, send: send as u64, recv: recv as u64, count, dtype, scalar, root })
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
    if op >= NCCL_NUM_OPS {
        return premul("ncclAllReduce", PremulKind::AllReduce, sendbuff, recvbuff, count, datatype, op, 0, comm, stream);
    }
    collective("ncclAllReduce", comm, stream, datatype, Some(op), |dtype, op| Coll::AllReduce {
        send: sendbuff as u64,
        recv: recvbuff as u64,
        count,
        dtype,
        op,
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
    collective("ncclBroadcast", comm, stream, datatype, None, |dtype, _| Coll::Broadcast {
        send: sendbuff as u64,
        recv: recvbuff as u64,
        count,
        dtype,
        root,
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
    if op >= NCCL_NUM_OPS {
        return premul("ncclReduce", PremulKind::Reduce, sendbuff, recvbuff, count, datatype, op, root, comm, stream);
    }
    collective("ncclReduce", comm, stream, datatype, Some(op), |dtype, op| Coll::Reduce {
        send: sendbuff as u64,
        recv: recvbuff as u64,
        count,
        dtype,
        op,
        root,
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
    collective("ncclAllGather", comm, stream, datatype, None, |dtype, _| Coll::AllGather {
        send: sendbuff as u64,
        recv: recvbuff as u64,
        count: sendcount,
        dtype,
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
    if op >= NCCL_NUM_OPS {
        return premul("ncclReduceScatter", PremulKind::ReduceScatter, sendbuff, recvbuff, recvcount, datatype, op, 0, comm, stream);
    }
    collective("ncclReduceScatter", comm, stream, datatype, Some(op), |dtype, op| Coll::ReduceScatter {
        send: sendbuff as u64,
        recv: recvbuff as u64,
        recv_count: recvcount,
        dtype,
        op,
    })
}

// ---------------------------------------------------------------------------------------------
// Point-to-point

/// ncclSend / ncclRecv. Inside a group they are kept per (communicator, stream) and issued at
/// its end, together (`Communicator::transfers`: one kernel for those up to GSC_COLL_P2P_MAX,
/// the point-to-point engine in one condition group for larger ones): in flight at once, so
/// an all-to-all cannot deadlock on its own order, and the stream waits for all of them.
/// Outside a group a transfer is a group of one.
#[allow(clippy::too_many_arguments)]
fn p2p(
    name: &str,
    op: PeerOp,
    buf: u64,
    count: usize,
    datatype: c_int,
    peer: c_int,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> ncclResult_t {
    gate(name, || {
        let c = comm_ref(comm)?;
        let communicator = c.ready()?;
        let dtype = DataType::from_nccl(datatype)?;
        let peer = usize::try_from(peer).map_err(|_| invalid(format!("peer {peer}")))?;
        let on = on_stream(&c, stream)?;
        let bytes = count.checked_mul(dtype.size()).ok_or_else(|| invalid(format!("{count} elements overflow")))?;
        if peer >= communicator.nranks() {
            return Err(invalid(format!("peer {peer} of a communicator of {} ranks", communicator.nranks())));
        }
        enqueue_transfers(&c, on, vec![PeerTransfer { op, buf, bytes, peer }])
    })
}

/// Inside a group, add `transfers` to the group's sends and receives on `c` and `on` (issued
/// at its end); outside one, issue them now as a group of their own.
fn enqueue_transfers(c: &Arc<Comm>, on: Condition, transfers: Vec<PeerTransfer>) -> Result<(), Fail> {
    let alone = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Some((on, transfers));
        }
        match g.transfers.iter_mut().find(|t| Arc::ptr_eq(&t.comm, c) && t.on.same(&on)) {
            Some(t) => t.group.extend(transfers),
            None => g.transfers.push(GroupTransfers { comm: c.clone(), on, group: transfers }),
        }
        None
    });
    match alone {
        Some((on, group)) => issue_transfers(&GroupTransfers { comm: c.clone(), on, group }),
        None => Ok(()),
    }
}

/// A group's sends and receives on one communicator and stream, issued.
fn issue_transfers(t: &GroupTransfers) -> Result<(), Fail> {
    let communicator = t.comm.ready()?;
    // SAFETY: nccl.h's contract on the buffers and the stream, for every call of the group.
    unsafe { communicator.transfers(&t.group, &t.on) }.map_err(|e| Fail::from(e.context("issuing the group's sends and receives")))?;
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: c_int,
    peer: c_int,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> ncclResult_t {
    p2p("ncclSend", PeerOp::Send, sendbuff as u64, count, datatype, peer, comm, stream)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    peer: c_int,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> ncclResult_t {
    p2p("ncclRecv", PeerOp::Recv, recvbuff as u64, count, datatype, peer, comm, stream)
}

// ---------------------------------------------------------------------------------------------
// All-to-all, gather and scatter (nccl.h 2.28's collectives made of sends and receives)

/// A collective that is a pattern of sends and receives of `count` elements each: `transfers`
/// lists this rank's (from its rank, the communicator's size and the bytes per part), which
/// are then queued or issued as ncclSend/ncclRecv are (`enqueue_transfers`): inside a group
/// with the group's other sends and receives, else as a group of their own, so those of up to
/// GSC_COLL_P2P_MAX bytes are one kernel on the stream.
fn peer_pattern(
    name: &str,
    comm: ncclComm_t,
    stream: *mut c_void,
    count: usize,
    datatype: c_int,
    transfers: impl FnOnce(usize, usize, usize) -> Result<Vec<PeerTransfer>, Fail>,
) -> ncclResult_t {
    gate(name, || {
        let c = comm_ref(comm)?;
        let communicator = c.ready()?;
        let dtype = DataType::from_nccl(datatype)?;
        let nranks = communicator.nranks();
        // Every part's offset (at most nranks parts) must fit the address space.
        let bytes = count
            .checked_mul(dtype.size())
            .filter(|b| b.checked_mul(nranks).is_some_and(|all| all <= isize::MAX as usize))
            .ok_or_else(|| invalid(format!("{count} elements per rank for {nranks} ranks overflow")))?;
        let group = transfers(communicator.rank(), nranks, bytes)?;
        enqueue_transfers(&c, on_stream(&c, stream)?, group)
    })
}

/// Part `i` (of `bytes` each) of the buffer at `base`.
fn part(base: u64, i: usize, bytes: usize) -> Result<u64, Fail> {
    base.checked_add((i * bytes) as u64).ok_or_else(|| invalid("a buffer's parts run past the end of the address space"))
}

/// `root` as a rank of a communicator of `nranks`.
fn root_rank(root: c_int, nranks: usize) -> Result<usize, Fail> {
    usize::try_from(root).ok().filter(|r| *r < nranks).ok_or_else(|| invalid(format!("root {root} of a communicator of {nranks} ranks")))
}

/// Part j of `sendbuff` goes to rank j, and part i of `recvbuff` comes from rank i. As in NCCL,
/// the two buffers must not overlap (nccl.h defines no in-place all-to-all).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclAlltoAll(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> ncclResult_t {
    peer_pattern("ncclAlltoAll", comm, stream, count, datatype, |_, nranks, bytes| {
        alltoall_parts(sendbuff as u64, recvbuff as u64, nranks, bytes)
    })
}

fn alltoall_parts(sendbuff: u64, recvbuff: u64, nranks: usize, bytes: usize) -> Result<Vec<PeerTransfer>, Fail> {
    let mut group = Vec::with_capacity(2 * nranks);
    for peer in 0..nranks {
        group.push(PeerTransfer { op: PeerOp::Send, buf: part(sendbuff, peer, bytes)?, bytes, peer });
        group.push(PeerTransfer { op: PeerOp::Recv, buf: part(recvbuff, peer, bytes)?, bytes, peer });
    }
    Ok(group)
}

/// Every rank's `sendbuff` goes to part i of the root's `recvbuff` (i: the sender's rank).
/// In place (the root's `sendbuff` is its own part of `recvbuff`) the root copies nothing to
/// itself. Other ranks' `recvbuff` is not used.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    root: c_int,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> ncclResult_t {
    peer_pattern("ncclGather", comm, stream, count, datatype, |rank, nranks, bytes| {
        rooted_parts(sendbuff as u64, recvbuff as u64, true, root_rank(root, nranks)?, rank, nranks, bytes)
    })
}

/// Part i of the root's `sendbuff` goes to rank i's `recvbuff`. In place (the root's
/// `recvbuff` is its own part of `sendbuff`) the root copies nothing to itself. Other ranks'
/// `sendbuff` is not used.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    root: c_int,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> ncclResult_t {
    peer_pattern("ncclScatter", comm, stream, count, datatype, |rank, nranks, bytes| {
        rooted_parts(recvbuff as u64, sendbuff as u64, false, root_rank(root, nranks)?, rank, nranks, bytes)
    })
}

/// A rooted pattern (gather: `to_root`; scatter): each rank's `own` buffer pairs with part i
/// of the root's `parts` buffer, i being the rank. In place (the root's `own` is its own part
/// of `parts`) the root moves nothing to itself.
fn rooted_parts(
    own: u64,
    parts: u64,
    to_root: bool,
    root: usize,
    rank: usize,
    nranks: usize,
    bytes: usize,
) -> Result<Vec<PeerTransfer>, Fail> {
    let (own_op, root_op) = if to_root { (PeerOp::Send, PeerOp::Recv) } else { (PeerOp::Recv, PeerOp::Send) };
    let in_place = rank == root && own == part(parts, root, bytes)?;
    let own = (!in_place).then_some(PeerTransfer { op: own_op, buf: own, bytes, peer: root });
    let mut at_root = Vec::new();
    if rank == root {
        for peer in (0..nranks).filter(|&p| !(in_place && p == root)) {
            at_root.push(PeerTransfer { op: root_op, buf: part(parts, peer, bytes)?, bytes, peer });
        }
    }
    // The order within a group does not matter (pairs are per peer); this one reads naturally.
    Ok(match to_root {
        true => own.into_iter().chain(at_root).collect(),
        false => at_root.into_iter().chain(own).collect(),
    })
}

// ---------------------------------------------------------------------------------------------
// Registration

/// The buffer is checked (GPU memory of the communicator's device) and a handle returned;
/// no collective takes a zero-copy path for registered buffers yet (`Communicator::register`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommRegister(comm: ncclComm_t, buff: *mut c_void, size: usize, handle: *mut *mut c_void) -> ncclResult_t {
    gate("ncclCommRegister", || {
        let c = comm_ref(comm)?;
        let slot = out(handle, "handle")?;
        let reg = c.ready()?.register(buff as u64, size)?;
        let boxed = Box::into_raw(Box::new(reg));
        c.registrations.lock().unwrap_or_else(|e| e.into_inner()).push(boxed as usize);
        *slot = boxed as *mut c_void;
        Ok(())
    })
}

/// A handle this communicator did not give out (or already took back) is refused, unchanged.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommDeregister(comm: ncclComm_t, handle: *mut c_void) -> ncclResult_t {
    gate("ncclCommDeregister", || {
        let c = comm_ref(comm)?;
        let mut regs = c.registrations.lock().unwrap_or_else(|e| e.into_inner());
        let i = regs
            .iter()
            .position(|&r| r == handle as usize)
            .ok_or_else(|| invalid("the handle is not a live registration of this communicator (deregistered already?)"))?;
        regs.swap_remove(i);
        // SAFETY: made by Box::into_raw in ncclCommRegister, and just taken off the live list.
        drop(unsafe { Box::from_raw(handle as *mut Registration) });
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// Pre-multiplied sums

/// A pre-multiplied sum operator for `datatype`: a host scalar (`ncclScalarHostImmediate`) is
/// read now; a device one (`ncclScalarDevice`) each time a collective using it runs.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclRedOpCreatePreMulSum(
    op: *mut c_int,
    scalar: *mut c_void,
    datatype: c_int,
    residence: c_int,
    comm: ncclComm_t,
) -> ncclResult_t {
    gate("ncclRedOpCreatePreMulSum", || {
        let c = comm_ref(comm)?;
        c.ready()?;
        let slot = out(op, "op")?;
        let dtype = DataType::from_nccl(datatype)?;
        if scalar.is_null() {
            return Err(invalid("scalar is NULL"));
        }
        let value = match residence {
            NCCL_SCALAR_HOST_IMMEDIATE => {
                let mut bits = [0u8; 8];
                // SAFETY: nccl.h: a host scalar points at one element of `datatype`.
                unsafe { std::ptr::copy_nonoverlapping(scalar as *const u8, bits.as_mut_ptr(), dtype.size()) };
                PreMulScalar::Value(u64::from_le_bytes(bits))
            }
            NCCL_SCALAR_DEVICE => PreMulScalar::Device(scalar as u64),
            r => return Err(invalid(format!("residence {r} (ncclScalarDevice 0 or ncclScalarHostImmediate 1)"))),
        };
        let mut ops = c.premul_ops.lock().unwrap_or_else(|e| e.into_inner());
        let i = match ops.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                ops.push(None);
                ops.len() - 1
            }
        };
        ops[i] = Some((dtype, value));
        *slot = NCCL_NUM_OPS + i as c_int;
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclRedOpDestroy(op: c_int, comm: ncclComm_t) -> ncclResult_t {
    gate("ncclRedOpDestroy", || {
        let c = comm_ref(comm)?;
        let mut ops = c.premul_ops.lock().unwrap_or_else(|e| e.into_inner());
        let entry = op.checked_sub(NCCL_NUM_OPS).and_then(|i| usize::try_from(i).ok()).and_then(|i| ops.get_mut(i));
        match entry {
            Some(e @ Some(_)) => {
                *e = None;
                Ok(())
            }
            _ => Err(invalid(format!("operator {op} is not a live ncclRedOpCreatePreMulSum operator of this communicator"))),
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Memory

/// CUDA VMM memory on the current device, as NCCL's cuMem allocator makes it (`gscomm::mem_alloc`):
/// shareable with other processes as a POSIX file descriptor, rounded up to the recommended
/// granularity, accessible from every GPU of the process that can reach it; `cuMemAlloc` where
/// the device cannot do VMM with such handles (the reason is logged). `*ptr` is left unchanged
/// on failure.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> ncclResult_t {
    gate("ncclMemAlloc", || {
        let p = out(ptr, "ptr")?;
        *p = gscomm::mem_alloc(size)? as *mut c_void;
        Ok(())
    })
}

/// NULL is a no-op. A pointer ncclMemAlloc did not return (memory from elsewhere, an address
/// inside an allocation, one already freed) is `ncclInvalidArgument`, and nothing is freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclMemFree(ptr: *mut c_void) -> ncclResult_t {
    gate("ncclMemFree", || {
        // SAFETY: nccl.h: memory from ncclMemAlloc that no work uses any more; anything the
        // allocator did not hand out (or took back already) is refused before any driver call.
        unsafe { gscomm::mem_free(ptr as u64) }?;
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// Memory windows

/// `NCCL_WIN_DEFAULT` and `NCCL_WIN_COLL_SYMMETRIC`, the flags nccl.h 2.28 defines.
const NCCL_WIN_DEFAULT: c_int = 0x00;
const NCCL_WIN_COLL_SYMMETRIC: c_int = 0x01;

/// Collective (`Communicator::register_window`): every rank registers its buffer, inside a
/// group when one thread drives several ranks (nccl-tests' `-R 2`). A NULL buffer or size 0
/// registers nothing and succeeds with a NULL window, as NVIDIA's returns without one.
/// `NCCL_WIN_COLL_SYMMETRIC` windows let collectives on them skip the per-call exchange.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommWindowRegister(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    win: *mut *mut c_void,
    win_flags: c_int,
) -> ncclResult_t {
    gate("ncclCommWindowRegister", || {
        let c = comm_ref(comm)?;
        let slot = out(win, "win")?;
        let symmetric = match win_flags {
            NCCL_WIN_DEFAULT => false,
            NCCL_WIN_COLL_SYMMETRIC => true,
            f => return Err(invalid(format!("winFlags {f:#x} (NCCL_WIN_DEFAULT 0x0 or NCCL_WIN_COLL_SYMMETRIC 0x1)"))),
        };
        c.ready()?;
        *slot = std::ptr::null_mut();
        if buff.is_null() || size == 0 {
            return Ok(());
        }
        let pending = PendingWindow { comm: c, addr: buff as u64, bytes: size, symmetric, slot: win as usize };
        let alone = GROUP.with(|g| {
            let mut g = g.borrow_mut();
            if g.depth == 0 {
                return Some(pending);
            }
            g.windows.push(pending);
            None
        });
        alone.map_or(Ok(()), |p| register_windows(vec![p]))
    })
}

/// A NULL window is a no-op, as in NCCL; one this communicator did not give out (or took back
/// already) is refused, unchanged. Local to the rank (`Communicator::deregister_window`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommWindowDeregister(comm: ncclComm_t, win: *mut c_void) -> ncclResult_t {
    gate("ncclCommWindowDeregister", || {
        let c = comm_ref(comm)?;
        if win.is_null() {
            return Ok(());
        }
        let mut wins = c.windows.lock().unwrap_or_else(|e| e.into_inner());
        let i = wins
            .iter()
            .position(|&w| w == win as usize)
            .ok_or_else(|| invalid("the window is not a live window of this communicator (deregistered already?)"))?;
        // SAFETY: a live handle of this communicator's (just found in its list): a boxed Window.
        let window = unsafe { *(win as *const Window) };
        c.ready()?.deregister_window(&window)?;
        wins.swap_remove(i);
        // SAFETY: made by Box::into_raw in `register_windows`, and just taken off the live list.
        drop(unsafe { Box::from_raw(win as *mut Window) });
        Ok(())
    })
}

/// Run window registrations: each communicator's in the order they were called, the
/// communicators on threads side by side (a registration waits for every rank's, and one
/// thread may be driving all of them). Each slot gets its window, or stays NULL; the first
/// failure is returned after all ran.
fn register_windows(pending: Vec<PendingWindow>) -> Result<(), Fail> {
    if pending.is_empty() {
        return Ok(());
    }
    let mut by_comm: Vec<Vec<&PendingWindow>> = Vec::new();
    for p in &pending {
        match by_comm.iter_mut().find(|l| Arc::ptr_eq(&l[0].comm, &p.comm)) {
            Some(l) => l.push(p),
            None => by_comm.push(vec![p]),
        }
    }
    let register = |list: &[&PendingWindow]| -> Vec<Result<Window, Fail>> {
        list.iter()
            .map(|p| {
                let communicator = p.comm.ready()?;
                communicator.register_window(p.addr, p.bytes, p.symmetric).map_err(Fail::from)
            })
            .collect()
    };
    let results: Vec<Vec<Result<Window, Fail>>> = match by_comm.len() {
        1 => vec![register(&by_comm[0])],
        _ => std::thread::scope(|s| {
            let threads: Vec<_> = by_comm.iter().map(|l| s.spawn(|| register(l))).collect();
            threads
                .into_iter()
                .zip(&by_comm)
                .map(|(t, l)| {
                    t.join().unwrap_or_else(|_| {
                        l.iter()
                            .map(|_| Err(Fail(NCCL_INTERNAL_ERROR, "window registration: internal error (a panic was caught)".into())))
                            .collect()
                    })
                })
                .collect()
        }),
    };
    let mut first = None;
    for (list, results) in by_comm.iter().zip(results) {
        for (p, r) in list.iter().zip(results) {
            match r {
                Ok(w) => {
                    let boxed = Box::into_raw(Box::new(w));
                    p.comm.windows.lock().unwrap_or_else(|e| e.into_inner()).push(boxed as usize);
                    // SAFETY: the program's ncclWindow_t*, valid until its group ended (nccl.h).
                    unsafe { *(p.slot as *mut *mut c_void) = boxed as *mut c_void };
                }
                Err(f) => first = first.or(Some(f)),
            }
        }
    }
    first.map_or(Ok(()), Err)
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

/// Deprecated in nccl.h 2.28, and there "not supported as part of the NCCL API": NVIDIA's
/// re-reads `NCCL_DEBUG` at its next message. gscomm's log subscriber is the process's and is
/// installed once (`debug`), so this changes nothing; it says so in the log and in
/// `ncclGetLastError`.
#[unsafe(no_mangle)]
pub extern "C" fn ncclResetDebugInit() {
    let _ = gate("ncclResetDebugInit", || {
        tracing::warn!(target: "gsc::capi", "ncclResetDebugInit is not supported: the log settings were read at the first init");
        Err(unsupported("ncclResetDebugInit"))
    });
}

not_yet! {
    ncclGroupSimulateEnd(sim_info: *mut c_void);
    // nccl_device.h (installed with nccl.h 2.28): device communicators.
    ncclDevCommCreate(comm: ncclComm_t, requirements: *const c_void, dev_comm: *mut c_void);
    ncclDevCommDestroy(comm: ncclComm_t, dev_comm: *const c_void);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    /// Whether the GPU tests may run here with `n` GPUs; says why not when they may not.
    fn gpus_or_skip(n: i32) -> bool {
        use gscomm::cuda::api::{device_count, gpu_test_skip_reason};
        if let Some(why) = gpu_test_skip_reason() {
            eprintln!("skipped: {why}");
            return false;
        }
        if device_count() < n {
            eprintln!("skipped: needs {n} GPUs, found {}", device_count());
            return false;
        }
        true
    }

    /// A communicator of two ranks on GPUs 0 and 1, both made from this thread in one group.
    fn two_comms_from_one_thread() -> [ncclComm_t; 2] {
        use gscomm::cuda::api::set_device;
        let mut id = ncclUniqueId { internal: [0; 128] };
        assert_eq!(unsafe { ncclGetUniqueId(&mut id) }, NCCL_SUCCESS);
        let mut comms: [ncclComm_t; 2] = [std::ptr::null_mut(); 2];
        assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
        for (r, c) in comms.iter_mut().enumerate() {
            set_device(r as i32).unwrap();
            assert_eq!(unsafe { ncclCommInitRank(c, 2, id, r as c_int) }, NCCL_SUCCESS, "{}", last());
        }
        assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS, "{}", last());
        comms
    }

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

    /// NCCL_COMM_ID's id: the same from every call (so every process makes it alone), at the
    /// address given; GSC_BOOTSTRAP_SECRET, where set, is its secret; bad values are named.
    #[test]
    fn nccl_comm_id_names_one_id_at_its_address() {
        let config = Config::default();
        let a = comm_id_uid("127.0.0.1:29511", &config).unwrap();
        assert_eq!(a.to_bytes(), comm_id_uid(" 127.0.0.1:29511 ", &config).unwrap().to_bytes());
        assert_eq!(a.root_addr(), "127.0.0.1:29511".parse().unwrap());
        assert_eq!(comm_id_uid("[::1]:29511", &config).unwrap().root_addr(), "[::1]:29511".parse().unwrap());
        assert_ne!(a.to_bytes(), comm_id_uid("127.0.0.1:29512", &config).unwrap().to_bytes());
        let mut secret = Config::default();
        secret.set("GSC_BOOTSTRAP_SECRET", "s3cret").unwrap();
        assert_ne!(a.to_bytes(), comm_id_uid("127.0.0.1:29511", &secret).unwrap().to_bytes());
        for bad in ["127.0.0.1", "127.0.0.1:port", "[::1]"] {
            let e = comm_id_uid(bad, &config).unwrap_err();
            assert_eq!(e.0, NCCL_INVALID_ARGUMENT, "{bad}");
            assert!(e.1.contains("NCCL_COMM_ID") && e.1.contains("<hostname>:<port>"), "{bad}: {}", e.1);
        }
    }

    /// Two communicators in a row made under one NCCL_COMM_ID address, as NVIDIA's library makes
    /// them: both ranks take the same id, rank 0's init starts its root, and the second job finds
    /// the address free again.
    #[test]
    fn nccl_comm_id_jobs_one_after_another_on_two_gpus() {
        if !gpus_or_skip(2) {
            return;
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let value = format!("127.0.0.1:{port}");
        for job in 0..3 {
            let ranks: Vec<_> = (0..2)
                .map(|rank| {
                    let value = value.clone();
                    std::thread::spawn(move || {
                        let uid = comm_id_uid(&value, &Config::default()).map_err(|f| f.1)?;
                        let mut id = ncclUniqueId { internal: [0; 128] };
                        for (d, s) in id.internal.iter_mut().zip(uid.to_bytes()) {
                            *d = s as c_char;
                        }
                        let job = InitJob::Rank { nranks: 2, id, rank, device: rank, serve_root: rank == 0 };
                        let c = run_job(&job).map_err(|f| f.1)?.expect("a communicator");
                        Ok::<_, String>((c.rank(), c.nranks()))
                    })
                })
                .collect();
            let got: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
            assert_eq!(got, vec![Ok((0, 2)), Ok((1, 2))], "job {job}");
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
        assert_eq!(unsafe { ncclSend(std::ptr::null(), 1, 7, 0, std::ptr::null_mut(), std::ptr::null_mut()) }, NCCL_INVALID_ARGUMENT);
        assert!(last().contains("ncclSend: comm is NULL"), "{}", last());
        let mut op = 0;
        let r = unsafe { ncclRedOpCreatePreMulSum(&mut op, std::ptr::null_mut(), 7, 1, std::ptr::null_mut()) };
        assert_eq!(r, NCCL_INVALID_ARGUMENT);
        assert!(last().contains("ncclRedOpCreatePreMulSum: comm is NULL"), "{}", last());
    }

    #[test]
    fn configs_say_blocking_or_not_and_bad_ones_are_named() {
        let mut c = ConfigHead { size: 64, magic: 0xcafebeef, version: NCCL_VERSION_CODE as u32, blocking: CONFIG_UNDEF_INT };
        let p = |c: &mut ConfigHead| c as *mut ConfigHead as *const c_void;
        assert!(blocking(std::ptr::null()).unwrap(), "no config: blocking");
        assert!(blocking(p(&mut c)).unwrap(), "undefined: blocking");
        c.blocking = 0;
        assert!(!blocking(p(&mut c)).unwrap());
        c.blocking = 7;
        assert!(blocking(p(&mut c)).unwrap_err().1.contains("config.blocking = 7"));
        c.size = 4;
        assert!(blocking(p(&mut c)).unwrap_err().1.contains("size 4"));
    }

    #[test]
    fn split_and_registration_refuse_bad_arguments() {
        let mut newcomm: ncclComm_t = std::ptr::null_mut();
        assert_eq!(unsafe { ncclCommSplit(std::ptr::null_mut(), 0, 0, &mut newcomm, std::ptr::null_mut()) }, NCCL_INVALID_ARGUMENT);
        assert!(last().contains("comm is NULL"), "{}", last());
        let mut h = std::ptr::null_mut();
        assert_eq!(unsafe { ncclCommRegister(std::ptr::null_mut(), std::ptr::null_mut(), 8, &mut h) }, NCCL_INVALID_ARGUMENT);
        assert!(h.is_null());
        // A communicator still initializing answers ncclInProgress, and a handle it never gave
        // out is refused without touching it.
        let (comm, c) = new_handle(Comm::new());
        let mut n = -1;
        assert_eq!(unsafe { ncclCommCount(comm, &mut n) }, NCCL_IN_PROGRESS);
        let mut err = 0;
        assert_eq!(unsafe { ncclCommGetAsyncError(comm, &mut err) }, NCCL_SUCCESS);
        assert_eq!(err, NCCL_IN_PROGRESS);
        let mut bogus = 5u64;
        assert_eq!(unsafe { ncclCommDeregister(comm, &mut bogus as *mut u64 as *mut c_void) }, NCCL_INVALID_ARGUMENT);
        assert!(last().contains("not a live registration"), "{}", last());
        assert_eq!(bogus, 5);
        // Windows: bad flags and a NULL out-pointer are named; a window never given out is
        // refused untouched; a NULL one is a no-op; a communicator still initializing answers
        // ncclInProgress and leaves the slot NULL.
        let mut win = &mut bogus as *mut u64 as *mut c_void;
        let buf = 0x1000 as *mut c_void;
        assert_eq!(unsafe { ncclCommWindowRegister(comm, buf, 64, &mut win, 2) }, NCCL_INVALID_ARGUMENT);
        assert!(last().contains("winFlags 0x2"), "{}", last());
        assert_eq!(unsafe { ncclCommWindowRegister(comm, buf, 64, std::ptr::null_mut(), 1) }, NCCL_INVALID_ARGUMENT);
        assert!(last().contains("win is NULL"), "{}", last());
        assert_eq!(unsafe { ncclCommWindowRegister(comm, buf, 64, &mut win, NCCL_WIN_COLL_SYMMETRIC) }, NCCL_IN_PROGRESS);
        assert_eq!(unsafe { ncclCommWindowDeregister(comm, &mut bogus as *mut u64 as *mut c_void) }, NCCL_INVALID_ARGUMENT);
        assert!(last().contains("not a live window"), "{}", last());
        assert_eq!(bogus, 5);
        assert_eq!(unsafe { ncclCommWindowDeregister(comm, std::ptr::null_mut()) }, NCCL_SUCCESS);
        let _ = c.state.set(Err(Fail(NCCL_REMOTE_ERROR, "rank 1 went away".into())));
        assert_eq!(unsafe { ncclCommCount(comm, &mut n) }, NCCL_REMOTE_ERROR);
        assert!(last().contains("init failed: rank 1 went away"), "{}", last());
        assert_eq!(unsafe { ncclCommDestroy(comm) }, NCCL_SUCCESS);
    }

    /// On two GPUs from one thread, as a program would: non-blocking inits in a group (polled
    /// to success), send/recv between them in a group with data checked, a split into two
    /// one-rank communicators that then all-reduce, and registration. Skips without GPUs.
    #[test]
    fn non_blocking_init_send_recv_split_and_registration_on_gpus() {
        use gscomm::cuda::api::{DeviceBuf, Stream, set_device};
        if !gpus_or_skip(2) {
            return;
        }
        let mut id = ncclUniqueId { internal: [0; 128] };
        assert_eq!(unsafe { ncclGetUniqueId(&mut id) }, NCCL_SUCCESS);
        let mut config = ConfigHead { size: 64, magic: 0xcafebeef, version: NCCL_VERSION_CODE as u32, blocking: 0 };
        let mut comms: [ncclComm_t; 2] = [std::ptr::null_mut(); 2];
        assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
        for (r, c) in comms.iter_mut().enumerate() {
            set_device(r as i32).unwrap();
            let cfg = &mut config as *mut ConfigHead as *mut c_void;
            assert_eq!(unsafe { ncclCommInitRankConfig(c, 2, id, r as c_int, cfg) }, NCCL_SUCCESS, "{}", last());
        }
        assert_eq!(unsafe { ncclGroupEnd() }, NCCL_IN_PROGRESS, "{}", last());
        let t0 = std::time::Instant::now();
        for c in comms {
            assert!(!c.is_null());
            loop {
                let mut e = -1;
                assert_eq!(unsafe { ncclCommGetAsyncError(c, &mut e) }, NCCL_SUCCESS);
                if e == NCCL_SUCCESS {
                    break;
                }
                assert_eq!(e, NCCL_IN_PROGRESS, "{}", last());
                assert!(t0.elapsed() < Duration::from_secs(60), "non-blocking init did not finish");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        // Send/recv both ways in one group: 3 MiB, so the copy-engine path.
        let len = 3 << 20;
        let mut bufs = Vec::new();
        for r in 0..2 {
            set_device(r).unwrap();
            let send = DeviceBuf::new(len).unwrap();
            send.upload(&(0..len).map(|i| (i * 13 + r as usize * 7) as u8).collect::<Vec<_>>()).unwrap();
            let recv = DeviceBuf::new(len).unwrap();
            recv.fill(0).unwrap();
            bufs.push((send, recv, Stream::new().unwrap()));
        }
        assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
        for (r, (send, recv, stream)) in bufs.iter().enumerate() {
            let (c, peer, s) = (comms[r], 1 - r as c_int, stream.raw() as *mut c_void);
            assert_eq!(unsafe { ncclSend(send.ptr() as *const c_void, len, 1, peer, c, s) }, NCCL_SUCCESS, "{}", last());
            assert_eq!(unsafe { ncclRecv(recv.ptr() as *mut c_void, len, 1, peer, c, s) }, NCCL_SUCCESS, "{}", last());
        }
        assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS, "{}", last());
        for (r, (_, recv, stream)) in bufs.iter().enumerate() {
            stream.synchronize().unwrap();
            let want: Vec<u8> = (0..len).map(|i| (i * 13 + (1 - r) * 7) as u8).collect();
            assert!(recv.download().unwrap() == want, "GPU {r} received wrong data");
        }
        // Registration: a real buffer is taken, a host address is not, a handle only once.
        let mut h = std::ptr::null_mut();
        let (send, _, stream) = &bufs[0];
        assert_eq!(unsafe { ncclCommRegister(comms[0], send.ptr() as *mut c_void, len, &mut h) }, NCCL_SUCCESS, "{}", last());
        let host = vec![0u8; 64];
        let mut h2 = std::ptr::null_mut();
        assert_eq!(unsafe { ncclCommRegister(comms[0], host.as_ptr() as *mut c_void, 64, &mut h2) }, NCCL_INVALID_ARGUMENT);
        assert!(h2.is_null() && last().contains("not GPU memory"), "{}", last());
        assert_eq!(unsafe { ncclCommDeregister(comms[0], h) }, NCCL_SUCCESS);
        assert_eq!(unsafe { ncclCommDeregister(comms[0], h) }, NCCL_INVALID_ARGUMENT);
        // A pre-multiplied sum through the ABI: rank r scales by r + 2 (host scalar), uint8.
        let mut ops = [0 as c_int; 2];
        for (r, op) in ops.iter_mut().enumerate() {
            let mut k = (r + 2) as u8;
            let scalar = &mut k as *mut u8 as *mut c_void;
            assert_eq!(
                unsafe { ncclRedOpCreatePreMulSum(op, scalar, 1, NCCL_SCALAR_HOST_IMMEDIATE, comms[r]) },
                NCCL_SUCCESS,
                "{}",
                last()
            );
        }
        let outs: Vec<DeviceBuf> = (0..2)
            .map(|r| {
                set_device(r).unwrap();
                DeviceBuf::new(len).unwrap()
            })
            .collect();
        assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
        for (r, (send, _, stream)) in bufs.iter().enumerate() {
            let (c, s) = (comms[r], stream.raw() as *mut c_void);
            let rc = unsafe { ncclAllReduce(send.ptr() as *const c_void, outs[r].ptr() as *mut c_void, len, 1, ops[r], c, s) };
            assert_eq!(rc, NCCL_SUCCESS, "{}", last());
        }
        assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS);
        let want: Vec<u8> = (0..len).map(|i| ((i * 13) as u8).wrapping_mul(2).wrapping_add(((i * 13 + 7) as u8).wrapping_mul(3))).collect();
        for (r, (_, _, stream)) in bufs.iter().enumerate() {
            stream.synchronize().unwrap();
            assert!(outs[r].download().unwrap() == want, "GPU {r}: pre-multiplied sum wrong");
            assert_eq!(unsafe { ncclRedOpDestroy(ops[r], comms[r]) }, NCCL_SUCCESS);
        }
        // Split into two one-rank communicators (both splits from this thread: a group).
        let mut subs: [ncclComm_t; 2] = [std::ptr::null_mut(); 2];
        assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
        for (r, sub) in subs.iter_mut().enumerate() {
            assert_eq!(unsafe { ncclCommSplit(comms[r], r as c_int, 0, sub, std::ptr::null_mut()) }, NCCL_SUCCESS, "{}", last());
        }
        assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS, "{}", last());
        for sub in subs {
            let (mut n, mut rank) = (0, -1);
            assert_eq!(unsafe { ncclCommCount(sub, &mut n) }, NCCL_SUCCESS);
            assert_eq!(unsafe { ncclCommUserRank(sub, &mut rank) }, NCCL_SUCCESS);
            assert_eq!((n, rank), (1, 0));
        }
        set_device(0).unwrap();
        let out = DeviceBuf::new(len).unwrap();
        let s = stream.raw() as *mut c_void;
        let r = unsafe { ncclAllReduce(send.ptr() as *const c_void, out.ptr() as *mut c_void, len, 1, 0, subs[0], s) };
        assert_eq!(r, NCCL_SUCCESS, "{}", last());
        stream.synchronize().unwrap();
        assert!(out.download().unwrap() == send.download().unwrap(), "a one-rank all-reduce is a copy");
        for c in subs.into_iter().chain(comms) {
            assert_eq!(unsafe { ncclCommDestroy(c) }, NCCL_SUCCESS);
        }
    }

    /// Without a GPU: NULL frees are no-ops, anything ncclMemAlloc did not return is refused
    /// (before any driver call) with the reason, and an allocation reports its failure.
    #[test]
    fn mem_free_refuses_what_mem_alloc_did_not_return() {
        assert_eq!(unsafe { ncclMemFree(std::ptr::null_mut()) }, NCCL_SUCCESS);
        let mut local = 0u64;
        assert_eq!(unsafe { ncclMemFree(&mut local as *mut u64 as *mut c_void) }, NCCL_INVALID_ARGUMENT);
        assert!(last().contains("ncclMemFree") && last().contains("not allocated by mem_alloc"), "{}", last());
        assert_eq!(unsafe { ncclMemAlloc(std::ptr::null_mut(), 64) }, NCCL_INVALID_ARGUMENT);
        assert!(last().contains("ptr is NULL"), "{}", last());
    }

    /// Symmetric windows on two GPUs from one thread, as nccl-tests' `-R 2` runs: both ranks
    /// register a send and a receive window (ncclMemAlloc memory) in one group, so each
    /// communicator's two registrations pair in order. Eager all-reduce (out of place and in
    /// place, at an offset), all-gather and reduce-scatter on them then take the direct kernel
    /// with no exchange — which ranks sharing a thread could not do before (their exchange would
    /// wait for the other rank's call) — and are exact; an unaligned offset, and a call below
    /// `auto`'s stream floor, run the workspace kernels on both ranks, still exact; after
    /// deregistration the direct kernel is
    /// off again. A bad buffer on one rank and disagreeing flags fail on both ranks, naming the
    /// rank, and leave no window. Skips without `GSC_TEST_GPU=1` and 2 GPUs.
    #[test]
    fn symmetric_windows_take_the_direct_kernel_from_one_thread_on_two_gpus() {
        use gscomm::cuda::api::{Stream, copy_from_device, copy_to_device, set_device};
        if !gpus_or_skip(2) {
            return;
        }
        let comms = two_comms_from_one_thread();
        const WIN: usize = 48 << 20;
        // Per rank: (send window, recv window, stream).
        let mut ranks = Vec::new();
        for r in 0..2 {
            set_device(r).unwrap();
            let (mut a, mut b): (*mut c_void, *mut c_void) = (std::ptr::null_mut(), std::ptr::null_mut());
            assert_eq!(unsafe { ncclMemAlloc(&mut a, WIN) }, NCCL_SUCCESS, "{}", last());
            assert_eq!(unsafe { ncclMemAlloc(&mut b, WIN) }, NCCL_SUCCESS, "{}", last());
            ranks.push((a as u64, b as u64, Stream::new().unwrap()));
        }
        let communicator = |r: usize| comm_ref(comms[r]).unwrap();
        let calls = |r: usize| {
            let c = communicator(r);
            let c = c.ready().unwrap();
            (c.direct_calls(), c.window_calls())
        };
        let mut wins = [[std::ptr::null_mut::<c_void>(); 2]; 2];
        assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
        for (r, (a, b, _)) in ranks.iter().enumerate() {
            for (i, at) in [*a, *b].into_iter().enumerate() {
                let rc = unsafe { ncclCommWindowRegister(comms[r], at as *mut c_void, WIN, &mut wins[r][i], NCCL_WIN_COLL_SYMMETRIC) };
                assert_eq!(rc, NCCL_SUCCESS, "{}", last());
            }
        }
        assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS, "{}", last());
        assert!(wins.iter().flatten().all(|w| !w.is_null()));
        let val = |r: usize, i: usize| ((i * 2_654_435_761 + r * 97) as u32 as i32) >> 2;
        let bytes = |v: Vec<i32>| v.into_iter().flat_map(i32::to_le_bytes).collect::<Vec<u8>>();
        // (what, send offset in A or, in place, in B, recv offset in B, count, kind, direct expected)
        #[derive(Clone, Copy, Debug, PartialEq)]
        enum Kind {
            AllReduce,
            AllReduceInPlace,
            AllGather,
            ReduceScatter,
        }
        // At `auto`'s stream floors (16 MiB all-reduces, 8 MiB all-gather parts, 16 MiB
        // reduce-scatter parts), and one below them.
        let cases = [
            (Kind::AllReduce, 0u64, 0u64, 4usize << 20, true),
            (Kind::AllReduceInPlace, 0, 16 << 20, 4 << 20, true),
            (Kind::AllGather, 16 << 20, 0, 2 << 20, true),
            (Kind::ReduceScatter, 0, 32 << 20, 4 << 20, true),
            // 4 bytes off 16 on both ranks alike: still the direct kernel (`direct::common_offset`).
            (Kind::AllReduce, 4, 4, 4 << 20, true),
            // Send and receive buffers at different offsets from 16 bytes: the workspace kernels.
            (Kind::AllReduce, 4, 8, 4 << 20, false),
            // Below the floor: the workspace kernels.
            (Kind::AllReduce, 0, 0, 1 << 20, false),
        ];
        // `expect`: (direct kernel, window) calls each rank makes.
        let run = |kind: Kind, send_off: u64, recv_off: u64, count: usize, expect: (u64, u64), salt: usize| {
            let before = [calls(0), calls(1)];
            let in_len = match kind {
                Kind::ReduceScatter => 2 * count,
                _ => count,
            };
            for (r, (a, b, _)) in ranks.iter().enumerate() {
                set_device(r as i32).unwrap();
                let src = if kind == Kind::AllReduceInPlace { b + recv_off } else { a + send_off };
                unsafe {
                    if kind != Kind::AllReduceInPlace {
                        copy_to_device(b + recv_off, &vec![0xEE; 4 * if kind == Kind::AllGather { 2 * count } else { count }]).unwrap();
                    }
                    copy_to_device(src, &bytes((0..in_len).map(|i| val(r, i + salt)).collect())).unwrap();
                }
            }
            assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
            for (r, (a, b, s)) in ranks.iter().enumerate() {
                let recv = (b + recv_off) as *mut c_void;
                let send = if kind == Kind::AllReduceInPlace { recv as *const c_void } else { (a + send_off) as *const c_void };
                let (c, st) = (comms[r], s.raw() as *mut c_void);
                let rc = unsafe {
                    match kind {
                        Kind::AllReduce | Kind::AllReduceInPlace => ncclAllReduce(send, recv, count, 2, 0, c, st),
                        Kind::AllGather => ncclAllGather(send, recv, count, 2, c, st),
                        Kind::ReduceScatter => ncclReduceScatter(send, recv, count, 2, 0, c, st),
                    }
                };
                assert_eq!(rc, NCCL_SUCCESS, "{kind:?}: {}", last());
            }
            assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS, "{}", last());
            let out_len = if kind == Kind::AllGather { 2 * count } else { count };
            for (r, (_, b, s)) in ranks.iter().enumerate() {
                set_device(r as i32).unwrap();
                s.synchronize().unwrap();
                let want: Vec<i32> = (0..out_len)
                    .map(|i| match kind {
                        Kind::AllGather => val(i / count, i % count + salt),
                        Kind::ReduceScatter => val(0, r * count + i + salt).wrapping_add(val(1, r * count + i + salt)),
                        _ => val(0, i + salt).wrapping_add(val(1, i + salt)),
                    })
                    .collect();
                let got = unsafe { copy_from_device(b + recv_off, out_len * 4) }.unwrap();
                assert!(got == bytes(want), "GPU {r}: {kind:?} of {count} int32 at +{send_off}/+{recv_off} wrong");
                let (d0, w0) = before[r];
                let (d1, w1) = calls(r);
                let took = (d1 - d0, w1 - w0);
                assert_eq!(took, expect, "GPU {r}: {kind:?} +{send_off}: (direct, window) calls");
            }
            eprintln!("{kind:?} of {count} int32 at +{send_off}/+{recv_off}: exact on both GPUs, (direct, window) calls: {expect:?}");
        };
        for (salt, &(kind, so, ro, count, direct)) in cases.iter().enumerate() {
            run(kind, so, ro, count, if direct { (1, 1) } else { (0, 0) }, salt);
        }
        // Bad input on one rank: host memory on rank 1. Both ranks fail naming rank 1, and no
        // window is kept on either.
        let host = vec![0u8; 4096];
        let mut bad = [std::ptr::null_mut::<c_void>(); 2];
        assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
        for (r, (a, _, _)) in ranks.iter().enumerate() {
            let at = if r == 1 { host.as_ptr() as u64 } else { *a };
            let rc = unsafe { ncclCommWindowRegister(comms[r], at as *mut c_void, 4096, &mut bad[r], NCCL_WIN_COLL_SYMMETRIC) };
            assert_eq!(rc, NCCL_SUCCESS, "deferred to the group's end");
        }
        assert_eq!(unsafe { ncclGroupEnd() }, NCCL_INVALID_ARGUMENT);
        assert!(last().contains("rank 1 could not register its window") && last().contains("not GPU memory"), "{}", last());
        assert!(bad.iter().all(|w| w.is_null()));
        // Disagreeing flags.
        assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
        for (r, (a, _, _)) in ranks.iter().enumerate() {
            let flags = if r == 0 { NCCL_WIN_COLL_SYMMETRIC } else { NCCL_WIN_DEFAULT };
            assert_eq!(unsafe { ncclCommWindowRegister(comms[r], *a as *mut c_void, 4096, &mut bad[r], flags) }, NCCL_SUCCESS);
        }
        assert_eq!(unsafe { ncclGroupEnd() }, NCCL_INVALID_ARGUMENT);
        assert!(last().contains("rank 1 registered its window as not symmetric, rank 0 as symmetric"), "{}", last());
        for r in 0..2 {
            assert_eq!(communicator(r).ready().unwrap().windows(), 2, "rank {r}: only the two good windows");
        }
        // Deregistered: the group's calls still take the direct kernel, every rank's buffers
        // known at the group's end (`issue_group`), but no window.
        for (r, w) in wins.iter().enumerate() {
            for &w in w {
                assert_eq!(unsafe { ncclCommWindowDeregister(comms[r], w) }, NCCL_SUCCESS, "{}", last());
                assert_eq!(unsafe { ncclCommWindowDeregister(comms[r], w) }, NCCL_INVALID_ARGUMENT, "twice");
            }
        }
        run(Kind::AllReduce, 0, 0, 4 << 20, (1, 0), 9);
        for (r, (a, b, _)) in ranks.into_iter().enumerate() {
            set_device(r as i32).unwrap();
            assert_eq!(unsafe { ncclMemFree(a as *mut c_void) }, NCCL_SUCCESS, "{}", last());
            assert_eq!(unsafe { ncclMemFree(b as *mut c_void) }, NCCL_SUCCESS, "{}", last());
        }
        for c in comms {
            assert_eq!(unsafe { ncclCommDestroy(c) }, NCCL_SUCCESS);
        }
    }

    /// Issue #6's registration rule on two GPUs from one thread: each rank makes one
    /// ncclMemAlloc allocation (CUDA VMM with a POSIX-fd handle) and carves it into buffers at the
    /// same offsets on both ranks — all-reduce send and receive (one-shot and large sizes), and
    /// send/recv source and destination — then the results are checked exactly, the
    /// allocations are registered, deregistered and freed, and a double free, an interior
    /// pointer and foreign memory are refused. Skips without `GSC_TEST_GPU=1` and 2 GPUs.
    #[test]
    fn mem_alloc_carved_buffers_all_reduce_and_send_recv_on_two_gpus() {
        use gscomm::cuda::api::{DeviceBuf, Stream, copy_from_device, copy_to_device, ipc_export_kind, set_device};
        if !gpus_or_skip(2) {
            return;
        }
        let comms = two_comms_from_one_thread();
        // int32 elements: 1001 (one-shot LL) and 2^20 + 3 (the large kernel, with a tail).
        const COUNTS: [usize; 2] = [1001, (1 << 20) + 3];
        let part = ((COUNTS[1] * 4) as u64).next_multiple_of(4096);
        // Offsets of the four buffers, the same on both ranks: all-reduce in/out, p2p out/in.
        let offs = [0, part, 2 * part, 3 * part];
        let total = (4 * part) as usize;
        let mut ranks = Vec::new();
        for r in 0..2 {
            set_device(r).unwrap();
            let mut p: *mut c_void = std::ptr::null_mut();
            assert_eq!(unsafe { ncclMemAlloc(&mut p, total) }, NCCL_SUCCESS, "{}", last());
            let base = p as u64;
            let info = gscomm::mem_alloc_info(base + offs[3]).expect("the allocation is booked");
            assert_eq!((info.base, info.offset, info.bytes, info.device), (base, offs[3], total, r));
            assert!(info.vmm, "GPU {r}: ncclMemAlloc fell back to cuMemAlloc (the log says why)");
            assert_eq!(info.mapped % (2 << 20), 0, "GPU {r}: {} B mapped", info.mapped);
            // Every carved buffer is recognised as VMM memory by the IPC key path.
            for off in offs {
                assert_eq!(ipc_export_kind(base + off).unwrap(), "vmm", "GPU {r}, buffer at +{off}");
            }
            ranks.push((base, Stream::new().unwrap()));
        }
        let val = |r: usize, i: usize, salt: usize| ((i * 2_654_435_761 + r * 97 + salt) as u32 as i32).wrapping_mul(3);
        let bytes = |v: Vec<i32>| v.into_iter().flat_map(i32::to_le_bytes).collect::<Vec<u8>>();
        for (salt, n) in COUNTS.into_iter().enumerate() {
            for (r, (base, _)) in ranks.iter().enumerate() {
                set_device(r as i32).unwrap();
                unsafe {
                    copy_to_device(base + offs[0], &bytes((0..n).map(|i| val(r, i, salt)).collect())).unwrap();
                    copy_to_device(base + offs[1], &vec![0xEE; n * 4]).unwrap();
                    copy_to_device(base + offs[2], &bytes((0..n).map(|i| val(r, i, salt + 10)).collect())).unwrap();
                    copy_to_device(base + offs[3], &vec![0xEE; n * 4]).unwrap();
                }
            }
            // All-reduce (int32 = 2, sum = 0) from one thread: a group, as NCCL requires.
            assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
            for (r, (base, s)) in ranks.iter().enumerate() {
                let (send, recv) = ((base + offs[0]) as *const c_void, (base + offs[1]) as *mut c_void);
                let rc = unsafe { ncclAllReduce(send, recv, n, 2, 0, comms[r], s.raw() as *mut c_void) };
                assert_eq!(rc, NCCL_SUCCESS, "{}", last());
            }
            assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS, "{}", last());
            // Send/recv both ways between the carved p2p buffers.
            assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
            for (r, (base, s)) in ranks.iter().enumerate() {
                let (c, peer, s) = (comms[r], 1 - r as c_int, s.raw() as *mut c_void);
                let rc = unsafe { ncclSend((base + offs[2]) as *const c_void, n, 2, peer, c, s) };
                assert_eq!(rc, NCCL_SUCCESS, "{}", last());
                let rc = unsafe { ncclRecv((base + offs[3]) as *mut c_void, n, 2, peer, c, s) };
                assert_eq!(rc, NCCL_SUCCESS, "{}", last());
            }
            assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS, "{}", last());
            let sum = bytes((0..n).map(|i| val(0, i, salt).wrapping_add(val(1, i, salt))).collect());
            for (r, (base, s)) in ranks.iter().enumerate() {
                set_device(r as i32).unwrap();
                s.synchronize().unwrap();
                let got = unsafe { copy_from_device(base + offs[1], n * 4) }.unwrap();
                assert!(got == sum, "GPU {r}: all-reduce of {n} int32 wrong");
                let from_peer = bytes((0..n).map(|i| val(1 - r, i, salt + 10)).collect());
                let got = unsafe { copy_from_device(base + offs[3], n * 4) }.unwrap();
                assert!(got == from_peer, "GPU {r}: received {n} int32 wrong");
                eprintln!("GPU {r}: {n} int32 all-reduced and exchanged through carved ncclMemAlloc buffers");
            }
        }
        // Registration records the allocation and the offset (the same on both ranks).
        for (r, (base, _)) in ranks.iter().enumerate() {
            let mut h = std::ptr::null_mut();
            let buf = (base + offs[2]) as *mut c_void;
            assert_eq!(unsafe { ncclCommRegister(comms[r], buf, part as usize, &mut h) }, NCCL_SUCCESS, "{}", last());
            // SAFETY: a live handle from ncclCommRegister.
            let reg = unsafe { *(h as *const Registration) };
            assert_eq!(reg.mem_alloc.map(|m| (m.base, m.offset)), Some((*base, offs[2])));
            assert_eq!(unsafe { ncclCommDeregister(comms[r], h) }, NCCL_SUCCESS);
        }
        for c in comms {
            assert_eq!(unsafe { ncclCommDestroy(c) }, NCCL_SUCCESS);
        }
        set_device(0).unwrap();
        let foreign = DeviceBuf::new(64).unwrap();
        assert_eq!(unsafe { ncclMemFree(foreign.ptr() as *mut c_void) }, NCCL_INVALID_ARGUMENT);
        assert!(last().contains("not allocated by mem_alloc"), "{}", last());
        for (r, (base, s)) in ranks.into_iter().enumerate() {
            set_device(r as i32).unwrap();
            drop(s);
            let interior = (base + 256) as *mut c_void;
            assert_eq!(unsafe { ncclMemFree(interior) }, NCCL_INVALID_ARGUMENT);
            assert!(last().contains("lies 256 bytes into the allocation"), "{}", last());
            assert_eq!(unsafe { ncclMemFree(base as *mut c_void) }, NCCL_SUCCESS, "GPU {r}: {}", last());
            assert_eq!(unsafe { ncclMemFree(base as *mut c_void) }, NCCL_INVALID_ARGUMENT, "GPU {r}: a double free");
            assert!(last().contains("double free"), "{}", last());
            assert!(gscomm::mem_alloc_info(base).is_none());
        }
    }

    /// nccl.h 2.28's all-to-all, gather and scatter on two GPUs from one thread, each call of
    /// the two ranks in one group as NCCL requires (and nccl-tests does): the kernel's sizes
    /// and one past GSC_COLL_P2P_MAX's default (the engine), gather and scatter out of place
    /// and in place, results checked exactly. The communicators come from
    /// ncclCommInitRankScalable with two ids. Skips without `GSC_TEST_GPU=1` and 2 GPUs.
    #[test]
    fn alltoall_gather_and_scatter_on_two_gpus() {
        use gscomm::cuda::api::{DeviceBuf, Stream, set_device};
        if !gpus_or_skip(2) {
            return;
        }
        let mut ids = [ncclUniqueId { internal: [0; 128] }; 2];
        for id in ids.iter_mut() {
            assert_eq!(unsafe { ncclGetUniqueId(id) }, NCCL_SUCCESS);
        }
        let mut comms: [ncclComm_t; 2] = [std::ptr::null_mut(); 2];
        assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
        for (r, c) in comms.iter_mut().enumerate() {
            set_device(r as i32).unwrap();
            let rc = unsafe { ncclCommInitRankScalable(c, 2, r as c_int, 2, ids.as_mut_ptr(), std::ptr::null_mut()) };
            assert_eq!(rc, NCCL_SUCCESS, "{}", last());
        }
        assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS, "{}", last());
        // int32 elements per part: 1, odd, 2^20 + 3, and 9 Mi (36 MiB: the engine's path).
        const UINT32: c_int = 3; // ncclUint32
        let counts = [1usize, 1001, (1 << 20) + 3, 9 << 20];
        let max = counts[3] * 4;
        let val = |r: usize, i: usize, salt: usize| (i as u32).wrapping_mul(2_654_435_761).wrapping_add((r * 97 + salt) as u32);
        let le = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let gpus: Vec<(DeviceBuf, DeviceBuf, Stream)> = (0..2)
            .map(|r| {
                set_device(r).unwrap();
                (DeviceBuf::new(2 * max).unwrap(), DeviceBuf::new(2 * max).unwrap(), Stream::new().unwrap())
            })
            .collect();
        let group = |call: &dyn Fn(usize, u64, u64, *mut c_void) -> ncclResult_t| {
            assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
            for (r, (send, recv, stream)) in gpus.iter().enumerate() {
                assert_eq!(call(r, send.ptr(), recv.ptr(), stream.raw() as *mut c_void), NCCL_SUCCESS, "{}", last());
            }
            assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS, "{}", last());
            for (r, (_, _, stream)) in gpus.iter().enumerate() {
                set_device(r as i32).unwrap();
                stream.synchronize().unwrap();
            }
        };
        let fill = |salt: usize, n: usize| {
            for (r, (send, recv, _)) in gpus.iter().enumerate() {
                set_device(r as i32).unwrap();
                send.upload(&le(&(0..2 * n).map(|i| val(r, i, salt)).collect::<Vec<_>>())).unwrap();
                recv.fill(0xEE).unwrap();
            }
        };
        let got = |r: usize, which: usize, n: usize| -> Vec<u8> {
            set_device(r as i32).unwrap();
            let b = if which == 0 { &gpus[r].0 } else { &gpus[r].1 };
            b.download().unwrap()[..2 * n * 4].to_vec()
        };
        for (salt, n) in counts.into_iter().enumerate() {
            // All-to-all: rank r's part j goes to part r of rank j.
            fill(salt, n);
            group(&|r, send, recv, s| unsafe { ncclAlltoAll(send as *const c_void, recv as *mut c_void, n, UINT32, comms[r], s) });
            for r in 0..2 {
                let want: Vec<u32> = (0..2).flat_map(|j| (0..n).map(move |i| val(j, r * n + i, salt))).collect();
                assert!(got(r, 1, n) == le(&want), "GPU {r}: all-to-all of {n} int32 per part wrong");
            }
            // Gather to rank 1, out of place: part j of its receive buffer is rank j's input.
            fill(salt + 10, n);
            group(&|r, send, recv, s| unsafe { ncclGather(send as *const c_void, recv as *mut c_void, n, UINT32, 1, comms[r], s) });
            let want: Vec<u32> = (0..2).flat_map(|j| (0..n).map(move |i| val(j, i, salt + 10))).collect();
            assert!(got(1, 1, n) == le(&want), "gather of {n} int32 to rank 1 wrong");
            // Gather to rank 0, in place: its input is already part 0 of its send buffer,
            // which is also the receive buffer.
            fill(salt + 20, n);
            group(&|r, send, _, s| {
                let recv = if r == 0 { send } else { 0 };
                unsafe { ncclGather(send as *const c_void, recv as *mut c_void, n, UINT32, 0, comms[r], s) }
            });
            let want: Vec<u32> = (0..n).map(|i| val(0, i, salt + 20)).chain((0..n).map(|i| val(1, i, salt + 20))).collect();
            assert!(got(0, 0, n) == le(&want), "in-place gather of {n} int32 to rank 0 wrong");
            // Scatter from rank 0, out of place: rank j gets part j of rank 0's input.
            fill(salt + 30, n);
            group(&|r, send, recv, s| unsafe { ncclScatter(send as *const c_void, recv as *mut c_void, n, UINT32, 0, comms[r], s) });
            for r in 0..2 {
                let want: Vec<u32> = (0..n).map(|i| val(0, r * n + i, salt + 30)).collect();
                assert!(got(r, 1, n)[..n * 4] == le(&want), "GPU {r}: scatter of {n} int32 from rank 0 wrong");
            }
            // Scatter from rank 1, in place: its receive buffer is its own part of its input.
            fill(salt + 40, n);
            group(&|r, send, recv, s| {
                let recv = if r == 1 { send + (n * 4) as u64 } else { recv };
                unsafe { ncclScatter(send as *const c_void, recv as *mut c_void, n, UINT32, 1, comms[r], s) }
            });
            let want: Vec<u32> = (0..n).map(|i| val(1, i, salt + 40)).collect();
            assert!(got(0, 1, n)[..n * 4] == le(&want), "in-place scatter of {n} int32 to rank 0 wrong");
            let want: Vec<u32> = (0..2 * n).map(|i| val(1, i, salt + 40)).collect();
            assert!(got(1, 0, n) == le(&want), "in-place scatter from rank 1 changed its own part");
            eprintln!("{n} int32 per part: all-to-all, gather and scatter (in place and not) exact on both GPUs");
        }
        // A root out of range is refused before anything is issued.
        let (send, recv, stream) = &gpus[0];
        let rc = unsafe {
            ncclGather(send.ptr() as *const c_void, recv.ptr() as *mut c_void, 1, UINT32, 2, comms[0], stream.raw() as *mut c_void)
        };
        assert_eq!(rc, NCCL_INVALID_ARGUMENT);
        assert!(last().contains("root 2 of a communicator of 2 ranks"), "{}", last());
        for c in comms {
            assert_eq!(unsafe { ncclCommDestroy(c) }, NCCL_SUCCESS);
        }
    }

    /// Fault tolerance on two GPUs, as PyTorch's shrink_group uses it. Rank 1 is gone (aborted)
    /// while rank 0 has an all-reduce waiting for it: rank 0's shrink with NCCL_SHRINK_ABORT
    /// stops that all-reduce (its stream completes, well inside the 1 h timeout) and makes a
    /// one-rank communicator that works, while the parent refuses collectives as revoked. Then
    /// two fresh ranks revoke: a second revoke is an error, their async errors read success,
    /// and a split of the revoked pair (ranks reversed) all-reduces right. Skips without GPUs.
    #[test]
    fn shrink_after_a_rank_dies_and_revoke_on_two_gpus() {
        use gscomm::cuda::api::{DeviceBuf, Stream, set_device};
        if !gpus_or_skip(2) {
            return;
        }
        const FLOAT: c_int = 7;
        let count = 1024;
        let init_two = || {
            let mut comms: [ncclComm_t; 2] = [std::ptr::null_mut(); 2];
            assert_eq!(unsafe { ncclCommInitAll(comms.as_mut_ptr(), 2, [0, 1].as_ptr()) }, NCCL_SUCCESS, "{}", last());
            comms
        };
        let floats = |v: f32| (0..count).flat_map(|_| v.to_le_bytes()).collect::<Vec<u8>>();
        let buffers = |r: i32, v: f32| {
            set_device(r).unwrap();
            let send = DeviceBuf::new(count * 4).unwrap();
            send.upload(&floats(v)).unwrap();
            let recv = DeviceBuf::new(count * 4).unwrap();
            recv.fill(0).unwrap();
            (send, recv, Stream::new().unwrap())
        };
        let all_reduce = |comm, (send, recv, stream): &(DeviceBuf, DeviceBuf, Stream)| unsafe {
            ncclAllReduce(send.ptr() as *const c_void, recv.ptr() as *mut c_void, count, FLOAT, 0, comm, stream.raw() as *mut c_void)
        };
        let comms = init_two();
        let b0 = buffers(0, 1.5);
        assert_eq!(unsafe { ncclCommAbort(comms[1]) }, NCCL_SUCCESS);
        assert_eq!(all_reduce(comms[0], &b0), NCCL_SUCCESS, "{}", last());
        std::thread::sleep(Duration::from_millis(300));
        assert!(!b0.2.query().unwrap(), "the all-reduce did not wait for the aborted rank");
        let mut small: ncclComm_t = std::ptr::null_mut();
        let mut exclude = [1 as c_int];
        let rc = unsafe { ncclCommShrink(comms[0], exclude.as_mut_ptr(), 1, &mut small, std::ptr::null_mut(), NCCL_SHRINK_ABORT) };
        assert_eq!(rc, NCCL_SUCCESS, "{}", last());
        let t0 = std::time::Instant::now();
        while !b0.2.query().unwrap() {
            assert!(t0.elapsed() < Duration::from_secs(20), "the shrink did not stop the all-reduce waiting for rank 1");
            std::thread::sleep(Duration::from_millis(1));
        }
        let (mut n, mut rank) = (0, -1);
        assert_eq!(unsafe { ncclCommCount(small, &mut n) }, NCCL_SUCCESS);
        assert_eq!(unsafe { ncclCommUserRank(small, &mut rank) }, NCCL_SUCCESS);
        assert_eq!((n, rank), (1, 0));
        assert_eq!(all_reduce(small, &b0), NCCL_SUCCESS, "{}", last());
        b0.2.synchronize().unwrap();
        assert!(b0.1.download().unwrap() == floats(1.5), "a one-rank all-reduce is a copy");
        assert_eq!(all_reduce(comms[0], &b0), NCCL_INVALID_USAGE);
        assert!(last().contains("revoked"), "{}", last());
        let mut e = -1;
        assert_eq!(unsafe { ncclCommGetAsyncError(comms[0], &mut e) }, NCCL_SUCCESS);
        assert_eq!(e, NCCL_SUCCESS, "a revoked communicator's async error");
        for c in [small, comms[0]] {
            assert_eq!(unsafe { ncclCommDestroy(c) }, NCCL_SUCCESS);
        }

        let comms = init_two();
        for c in comms {
            assert_eq!(unsafe { ncclCommRevoke(c, 0) }, NCCL_SUCCESS, "{}", last());
        }
        assert_eq!(unsafe { ncclCommRevoke(comms[0], 0) }, NCCL_INVALID_ARGUMENT);
        assert!(last().contains("revoke: the communicator was revoked"), "{}", last());
        let bufs = [buffers(0, 1.0), buffers(1, 2.0)];
        assert_eq!(all_reduce(comms[1], &bufs[1]), NCCL_INVALID_USAGE);
        let mut subs: [ncclComm_t; 2] = [std::ptr::null_mut(); 2];
        assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
        for (r, sub) in subs.iter_mut().enumerate() {
            let rc = unsafe { ncclCommSplit(comms[r], 0, 1 - r as c_int, sub, std::ptr::null_mut()) };
            assert_eq!(rc, NCCL_SUCCESS, "{}", last());
        }
        assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS, "{}", last());
        assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
        for (r, sub) in subs.iter().enumerate() {
            let mut rank = -1;
            assert_eq!(unsafe { ncclCommUserRank(*sub, &mut rank) }, NCCL_SUCCESS);
            assert_eq!(rank, 1 - r as c_int, "split by reversed keys");
            assert_eq!(all_reduce(*sub, &bufs[r]), NCCL_SUCCESS, "{}", last());
        }
        assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS);
        for (_, recv, stream) in &bufs {
            stream.synchronize().unwrap();
            assert!(recv.download().unwrap() == floats(3.0), "all-reduce on the split of revoked communicators");
        }
        for c in subs.into_iter().chain(comms) {
            assert_eq!(unsafe { ncclCommDestroy(c) }, NCCL_SUCCESS);
        }
    }

    #[test]
    fn premul_operators_are_looked_up_by_type_and_destroyed_once() {
        let (comm, c) = new_handle(Comm::new());
        c.premul_ops.lock().unwrap().push(Some((DataType::Float32, PreMulScalar::Value(7))));
        assert_eq!(c.premul(NCCL_NUM_OPS, DataType::Float32).unwrap(), Some(PreMulScalar::Value(7)));
        assert_eq!(c.premul(0, DataType::Float32).unwrap(), None, "a built-in operator");
        assert!(c.premul(NCCL_NUM_OPS, DataType::Int32).unwrap_err().1.contains("made for float data, not int32"));
        assert!(c.premul(NCCL_NUM_OPS + 1, DataType::Float32).is_err());
        assert_eq!(unsafe { ncclRedOpDestroy(NCCL_NUM_OPS, comm) }, NCCL_SUCCESS);
        assert_eq!(unsafe { ncclRedOpDestroy(NCCL_NUM_OPS, comm) }, NCCL_INVALID_ARGUMENT);
        assert!(last().contains("not a live ncclRedOpCreatePreMulSum operator"), "{}", last());
        assert!(c.premul(NCCL_NUM_OPS, DataType::Float32).is_err(), "destroyed");
        assert_eq!(unsafe { ncclCommDestroy(comm) }, NCCL_SUCCESS);
    }

    /// Issue #8: ncclCommAbort from one thread while others are inside calls on the same
    /// communicator (a watchdog polling ncclCommGetAsyncError, a thread enqueueing collectives),
    /// at random moments. Every call returns a result code (no crash, no read of freed memory),
    /// every call after the abort is refused as a stale handle, a second abort and a destroy
    /// after it are refused too, and the communicator is freed once the last call returned.
    /// Here the communicator is still initializing or its init failed (no GPU needed); the GPU
    /// test below does the same with collectives running.
    #[test]
    fn abort_while_other_threads_are_inside_calls_on_the_communicator() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for round in 0..200 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let (comm, c) = new_handle(Comm::new());
            if round % 2 == 1 {
                let _ = c.state.set(Err(Fail(NCCL_REMOTE_ERROR, "rank 1 went away".into())));
            }
            let freed = Arc::downgrade(&c);
            drop(c);
            let addr = comm as usize;
            let callers: Vec<_> = (0..3)
                .map(|who| {
                    std::thread::spawn(move || {
                        let comm = addr as ncclComm_t;
                        let t0 = std::time::Instant::now();
                        let mut calls = 0u32;
                        loop {
                            let mut err = -1;
                            let mut n = -1;
                            let r = match who {
                                0 => unsafe { ncclCommGetAsyncError(comm, &mut err) },
                                1 => unsafe { ncclCommCount(comm, &mut n) },
                                // No GPU: the stream's condition cannot be made, or the init
                                // is not done; either way a result code, never a crash.
                                _ => unsafe { ncclAllReduce(std::ptr::null(), std::ptr::null_mut(), 1, 7, 0, comm, std::ptr::null_mut()) },
                            };
                            calls += 1;
                            if r == NCCL_INVALID_ARGUMENT {
                                assert!(last().contains("not a live communicator"), "caller {who}: {}", last());
                                return calls;
                            }
                            match who {
                                0 => assert!(r == NCCL_SUCCESS && (err == NCCL_IN_PROGRESS || err == NCCL_REMOTE_ERROR), "r {r} err {err}"),
                                1 => assert!(r == NCCL_IN_PROGRESS || r == NCCL_REMOTE_ERROR, "count: {r}"),
                                _ => assert_ne!(r, NCCL_SUCCESS, "an all-reduce on a communicator without a GPU"),
                            }
                            assert!(t0.elapsed() < std::time::Duration::from_secs(10), "caller {who} never saw the abort");
                        }
                    })
                })
                .collect();
            std::thread::sleep(std::time::Duration::from_micros(seed % 2000));
            assert_eq!(unsafe { ncclCommAbort(comm) }, NCCL_SUCCESS, "round {round}: {}", last());
            assert_eq!(unsafe { ncclCommAbort(comm) }, NCCL_INVALID_ARGUMENT, "round {round}: a second abort");
            assert_eq!(unsafe { ncclCommDestroy(comm) }, NCCL_INVALID_ARGUMENT, "round {round}: destroy after abort");
            for t in callers {
                assert!(t.join().unwrap() > 0);
            }
            assert!(freed.upgrade().is_none(), "round {round}: the communicator outlived every call");
        }
        // Handles that were never made, and NULL, are refused the same way.
        let mut err = 0;
        assert_eq!(unsafe { ncclCommGetAsyncError((HANDLE_BASE + 8) as ncclComm_t, &mut err) }, NCCL_INVALID_ARGUMENT);
        assert_eq!(unsafe { ncclCommAbort(std::ptr::null_mut()) }, NCCL_INVALID_ARGUMENT);
        let mut local = 0u64;
        assert_eq!(unsafe { ncclCommDestroy(&mut local as *mut u64 as ncclComm_t) }, NCCL_INVALID_ARGUMENT);
    }

    /// The same on a GPU: a one-rank communicator, one thread enqueueing all-reduces on a
    /// stream and another polling ncclCommGetAsyncError, aborted from the test's thread at a
    /// random moment, 20 rounds. Calls after the abort are refused, the stream drains within
    /// seconds, and the communicator is freed. Skips without `GSC_TEST_GPU=1` and a GPU.
    #[test]
    fn abort_while_collectives_are_enqueued_on_a_gpu() {
        use gscomm::cuda::api::{DeviceBuf, Stream, set_device};
        if !gpus_or_skip(1) {
            return;
        }
        set_device(0).unwrap();
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for round in 0..20 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let mut id = ncclUniqueId { internal: [0; 128] };
            assert_eq!(unsafe { ncclGetUniqueId(&mut id) }, NCCL_SUCCESS);
            let mut comm: ncclComm_t = std::ptr::null_mut();
            assert_eq!(unsafe { ncclCommInitRank(&mut comm, 1, id, 0) }, NCCL_SUCCESS, "{}", last());
            let freed = Arc::downgrade(&comm_ref(comm).unwrap());
            let addr = comm as usize;
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let enqueuer = {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    set_device(0).unwrap();
                    let stream = Stream::new().unwrap();
                    let (send, recv) = (DeviceBuf::new(1 << 20).unwrap(), DeviceBuf::new(1 << 20).unwrap());
                    let mut launched = 0u32;
                    let r = loop {
                        let r = unsafe {
                            ncclAllReduce(
                                send.ptr() as *const c_void,
                                recv.ptr() as *mut c_void,
                                1 << 18,
                                7,
                                0,
                                addr as ncclComm_t,
                                stream.raw() as *mut c_void,
                            )
                        };
                        if r != NCCL_SUCCESS || stop.load(std::sync::atomic::Ordering::SeqCst) {
                            break r;
                        }
                        launched += 1;
                    };
                    // A call that took the communicator just before the abort fails with the
                    // abort's error; one after it is refused as a stale handle.
                    let why = if r == NCCL_SUCCESS { String::new() } else { last() };
                    // Whatever was queued before the abort drains: nothing waits forever.
                    let t0 = std::time::Instant::now();
                    stream.synchronize().unwrap();
                    (r, why, launched, t0.elapsed())
                })
            };
            let watchdog = std::thread::spawn(move || {
                loop {
                    let mut err = -1;
                    let r = unsafe { ncclCommGetAsyncError(addr as ncclComm_t, &mut err) };
                    if r != NCCL_SUCCESS {
                        return r;
                    }
                    // The abort's own error (Aborted, which maps to ncclInternalError), seen by
                    // a call that raced it, is the only one.
                    assert!(err == NCCL_SUCCESS || err == NCCL_INTERNAL_ERROR, "async error {err}");
                }
            });
            std::thread::sleep(std::time::Duration::from_micros(500 + seed % 20_000));
            assert_eq!(unsafe { ncclCommAbort(comm) }, NCCL_SUCCESS, "round {round}: {}", last());
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
            let (r, why, launched, drained) = enqueuer.join().unwrap();
            assert!(
                r == NCCL_SUCCESS || why.contains("not a live communicator") || why.contains("aborted"),
                "round {round}: the enqueuing thread's last call gave {r}: {why}"
            );
            assert!(drained < std::time::Duration::from_secs(10), "round {round}: the stream drained in {drained:?}");
            assert_eq!(watchdog.join().unwrap(), NCCL_INVALID_ARGUMENT, "round {round}: the watchdog after the abort");
            assert_eq!(unsafe { ncclCommDestroy(comm) }, NCCL_INVALID_ARGUMENT);
            assert!(freed.upgrade().is_none(), "round {round}: the communicator outlived every call");
            eprintln!("round {round}: {launched} all-reduces enqueued before the abort; the stream drained in {drained:?}");
        }
    }

    /// The sends and receives each rank of an all-to-all, gather and scatter makes: parts at
    /// their offsets, the root's own part skipped in place, and bad roots and parts past the
    /// end of the address space named.
    #[test]
    fn all_to_all_gather_and_scatter_parts() {
        let list = |g: Vec<PeerTransfer>| -> Vec<(char, u64, usize, usize)> {
            g.into_iter().map(|t| (if t.op == PeerOp::Send { 's' } else { 'r' }, t.buf, t.bytes, t.peer)).collect()
        };
        // As ncclGather and ncclScatter call it (send and receive buffers, root, rank, ranks, bytes).
        let gather = |send, recv, root, rank, n, b| rooted_parts(send, recv, true, root, rank, n, b);
        let scatter = |send, recv, root, rank, n, b| rooted_parts(recv, send, false, root, rank, n, b);
        let (send, recv) = (0x1000u64, 0x9000u64);
        assert_eq!(
            list(alltoall_parts(send, recv, 3, 16).unwrap()),
            [
                ('s', 0x1000, 16, 0),
                ('r', 0x9000, 16, 0),
                ('s', 0x1010, 16, 1),
                ('r', 0x9010, 16, 1),
                ('s', 0x1020, 16, 2),
                ('r', 0x9020, 16, 2)
            ]
        );
        // Gather to root 1 of 3: everyone sends; the root receives part i from rank i.
        assert_eq!(list(gather(send, recv, 1, 0, 3, 16).unwrap()), [('s', 0x1000, 16, 1)]);
        assert_eq!(
            list(gather(send, recv, 1, 1, 3, 16).unwrap()),
            [('s', 0x1000, 16, 1), ('r', 0x9000, 16, 0), ('r', 0x9010, 16, 1), ('r', 0x9020, 16, 2)]
        );
        // In place at the root (its input is its own part): nothing to itself.
        let own = 0x9010u64;
        assert_eq!(list(gather(own, recv, 1, 1, 3, 16).unwrap()), [('r', 0x9000, 16, 0), ('r', 0x9020, 16, 2)]);
        // Scatter from root 2 of 3, out of place and in place.
        assert_eq!(list(scatter(send, recv, 2, 0, 3, 16).unwrap()), [('r', 0x9000, 16, 2)]);
        assert_eq!(
            list(scatter(send, recv, 2, 2, 3, 16).unwrap()),
            [('s', 0x1000, 16, 0), ('s', 0x1010, 16, 1), ('s', 0x1020, 16, 2), ('r', 0x9000, 16, 2)]
        );
        let own = 0x1020u64;
        assert_eq!(list(scatter(send, own, 2, 2, 3, 16).unwrap()), [('s', 0x1000, 16, 0), ('s', 0x1010, 16, 1)]);
        assert!(root_rank(3, 3).unwrap_err().1.contains("root 3 of a communicator of 3 ranks"));
        assert!(root_rank(-1, 3).is_err());
        let high = u64::MAX - 8;
        assert!(alltoall_parts(high, recv, 2, 16).unwrap_err().1.contains("past the end of the address space"));
    }

    #[test]
    fn new_entry_points_refuse_bad_arguments_and_say_what_is_not_supported() {
        assert_eq!(
            unsafe { ncclAlltoAll(std::ptr::null(), std::ptr::null_mut(), 1, 7, std::ptr::null_mut(), std::ptr::null_mut()) },
            NCCL_INVALID_ARGUMENT
        );
        assert!(last().contains("ncclAlltoAll: comm is NULL"), "{}", last());
        assert_eq!(
            unsafe { ncclGather(std::ptr::null(), std::ptr::null_mut(), 1, 7, 0, std::ptr::null_mut(), std::ptr::null_mut()) },
            NCCL_INVALID_ARGUMENT
        );
        assert!(last().contains("ncclGather: comm is NULL"), "{}", last());
        let mut ids = [ncclUniqueId { internal: [0; 128] }; 2];
        let mut comm: ncclComm_t = std::ptr::null_mut();
        let r = unsafe { ncclCommInitRankScalable(&mut comm, 2, 0, 0, ids.as_mut_ptr(), std::ptr::null_mut()) };
        assert_eq!(r, NCCL_INVALID_ARGUMENT);
        assert!(last().contains("nId 0 (from 1 to nranks, 2)"), "{}", last());
        let r = unsafe { ncclCommInitRankScalable(&mut comm, 2, 0, 3, ids.as_mut_ptr(), std::ptr::null_mut()) };
        assert_eq!(r, NCCL_INVALID_ARGUMENT);
        let r = unsafe { ncclCommInitRankScalable(&mut comm, 2, 0, 1, std::ptr::null_mut(), std::ptr::null_mut()) };
        assert_eq!(r, NCCL_INVALID_ARGUMENT);
        assert!(last().contains("commIds is NULL"), "{}", last());
        assert!(comm.is_null());
        // Shrink and revoke name each bad argument before they look at the communicator (here
        // one whose init failed), and change nothing.
        let (failed, c) = new_handle(Comm::new());
        let _ = c.state.set(Err(Fail(NCCL_REMOTE_ERROR, "rank 1 went away".into())));
        let mut newcomm: ncclComm_t = std::ptr::null_mut();
        let list = [1 as c_int, -2];
        let null = std::ptr::null_mut();
        let shrink = |list: *mut c_int, n, newcomm, flags| unsafe { ncclCommShrink(failed, list, n, newcomm, null, flags) };
        let nc: *mut ncclComm_t = &mut newcomm;
        let calls: [(&dyn Fn() -> ncclResult_t, &str); 7] = [
            (&|| unsafe { ncclCommShrink(null as ncclComm_t, list.as_ptr() as *mut c_int, 1, nc, null, 0) }, "comm is NULL"),
            (&|| shrink(list.as_ptr() as *mut c_int, 1, null as *mut ncclComm_t, 0), "newcomm is NULL"),
            (&|| shrink(list.as_ptr() as *mut c_int, 1, nc, 4), "shrinkFlags 0x4"),
            (&|| shrink(list.as_ptr() as *mut c_int, 0, nc, 0), "excludeRanksCount 0"),
            (&|| shrink(null as *mut c_int, 1, nc, 0), "excludeRanksList is NULL"),
            (&|| shrink(list.as_ptr() as *mut c_int, 2, nc, 1), "rank -2 in excludeRanksList"),
            (&|| unsafe { ncclCommRevoke(failed, 1) }, "revokeFlags 1"),
        ];
        for (call, says) in calls {
            assert_eq!(call(), NCCL_INVALID_ARGUMENT, "{says}: {}", last());
            assert!(last().contains(says), "{says}: {}", last());
        }
        assert_eq!(shrink(list.as_ptr() as *mut c_int, 1, nc, 1), NCCL_REMOTE_ERROR);
        assert!(last().contains("ncclCommShrink: the communicator's init failed"), "{}", last());
        assert_eq!(unsafe { ncclCommRevoke(failed, 0) }, NCCL_REMOTE_ERROR);
        assert!(newcomm.is_null());
        assert_eq!(unsafe { ncclCommDestroy(failed) }, NCCL_SUCCESS);
        assert_eq!(unsafe { ncclGroupSimulateEnd(std::ptr::null_mut()) }, NCCL_INVALID_USAGE);
        assert_eq!(unsafe { ncclDevCommCreate(std::ptr::null_mut(), std::ptr::null(), std::ptr::null_mut()) }, NCCL_INVALID_USAGE);
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
        assert!(matches!(types(10, Some(4)), Ok((DataType::Float8E4M3, RedOp::Avg))));
        assert!(matches!(types(11, None), Ok((DataType::Float8E5M2, RedOp::Sum))));
        assert!(types(12, Some(0)).is_err(), "ncclNumTypes is not a type");
        assert!(types(7, Some(5)).is_err(), "pre-multiplied sum ops are not created");
    }
}
