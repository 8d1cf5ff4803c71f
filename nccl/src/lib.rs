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
mod tests;
