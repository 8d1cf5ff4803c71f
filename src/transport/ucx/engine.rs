//! One UCP context and worker per gscomm worker, and every call the lane makes on them. Every
//! `unsafe` block of the UCX lane outside the loader is in this file.
//!
//! Locking: UCP objects of a worker are created `UCS_THREAD_MODE_SERIALIZED` (any thread, one at
//! a time); `raw` is the lock that makes it so, held around every UCP call. UCX runs our
//! callbacks (received messages, endpoint failures) inside `ucp_worker_progress`, so they must
//! not take `raw`: they only take `inbox`, which is never held while UCP is called. The inbox
//! lives in a `Box` whose address UCX keeps as the callbacks' argument; it is freed only after
//! `ucp_worker_destroy`, after which UCX calls nothing of ours.
//!
//! Lifetimes: the engine is shared (`Arc`) by the listener and every link of a gscomm worker. A
//! link that goes away hands its endpoint and unfinished sends to `closing`: its buffers must
//! live until UCX is done with them, and a flushing close of the endpoint lets the last frames
//! (the close notice among them) leave. The engine's drop waits for those, bounded by
//! `UcxConfig::close_timeout`, then destroys the worker, which ends whatever is left.

use std::collections::VecDeque;
use std::ffi::{CString, c_void};
use std::panic::AssertUnwindSafe;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::UcxConfig;
use super::address::UcxAddress;
use super::inbox::{Inbox, Key, ORPHAN_TTL};
use super::loader::{self, StatusPtr, Ucp};
use super::sys;
use super::wire::{HEADER_LEN, Header};
use crate::error::{Error, Result, Status};

/// Our active-message id. One handler per UCP worker serves every link of it.
const AM_ID: u32 = 0x47;
/// UCX settings gscomm changes unless the user sets them (`UCX_<name>`), and why.
const DEFAULTS: &[(&str, &str, &str)] = &[(
    "ZCOPY_THRESH",
    "inf",
    // UCX 1.13's TCP transport aborts on an internal assertion (uct_iface.h:884, `comp->count >
    // 0`) when a peer fails while a zero-copy eager message to it is in flight; our frames are
    // copied into one buffer anyway, so copy sends cost little. Remote memory access (the next
    // step) uses put/get, which this does not affect.
    "avoid UCX 1.13's TCP abort on peer failure during zero-copy sends",
)];
/// Most rounds of `ucp_worker_progress` one `progress` call makes while they find work.
const PROGRESS_ROUNDS: usize = 32;

/// An endpoint to a peer UCP worker, owned by one link.
pub(crate) struct Ep {
    raw: NonNull<sys::ucp_ep>,
}

// SAFETY: an endpoint handle is only used through the engine, under its `raw` lock.
unsafe impl Send for Ep {}

impl Ep {
    fn addr(&self) -> usize {
        self.raw.as_ptr() as usize
    }
}

/// A frame UCX has not finished sending: the request to poll and the bytes it reads from.
pub(crate) struct InFlight {
    req: NonNull<c_void>,
    /// Header (first `HEADER_LEN` bytes) and body; UCX reads both until the request completes.
    buf: Vec<u8>,
}

// SAFETY: the request handle is only used through the engine, under its `raw` lock; the buffer
// is plain memory.
unsafe impl Send for InFlight {}

impl InFlight {
    pub(crate) fn len(&self) -> usize {
        self.buf.len()
    }
}

/// What `send` did with a frame.
pub(crate) enum Sent {
    Done,
    Pending(InFlight),
}

/// Something of a gone link that UCX still works on.
enum Closing {
    /// A send's request and buffer.
    Send(InFlight),
    /// An endpoint close in progress (its address, for the inbox's failure routing).
    Ep { req: NonNull<c_void>, ep: usize },
}

struct Raw {
    context: NonNull<sys::ucp_context>,
    worker: NonNull<sys::ucp_worker>,
    closing: Vec<Closing>,
}

pub(crate) struct Engine {
    ucp: &'static Ucp,
    raw: Mutex<Raw>,
    /// The callbacks' argument: must stay at this address until the worker is destroyed.
    inbox: Box<Mutex<Inbox>>,
    uuid: u128,
    blob: Vec<u8>,
    next_number: AtomicU64,
    last_gc: Mutex<Instant>,
    /// When `progress` last ran, in ns since `born` (so idle polling can be spaced out).
    last_progress: AtomicU64,
    born: Instant,
    pub(crate) cfg: UcxConfig,
}

// SAFETY: the raw UCP handles inside `raw` are only used under its lock (serialized mode); the
// inbox is a Mutex; everything else is plain data.
unsafe impl Send for Engine {}
// SAFETY: as above.
unsafe impl Sync for Engine {}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock (a bug) must not turn every later call into a panic.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A request parameter block with only `flags` set.
fn params_with_flags(flags: u32) -> sys::ucp_request_param_t {
    // SAFETY: plain C data (integers, pointers, unions of function pointers): all-zero is valid,
    // and the library reads only the fields named in `op_attr_mask`.
    let mut p: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
    p.op_attr_mask = sys::ucp_op_attr_t::UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = flags;
    p
}

impl Engine {
    /// Create the UCP context and worker (UCX reads its `UCX_*` environment here), install the
    /// message handler and build the address blob.
    pub(crate) fn new(cfg: &UcxConfig, uuid: u128) -> Result<Arc<Engine>> {
        let ucp = loader::ucp()?;
        let (context, worker) = Engine::create(ucp)?;
        let mut engine = Engine {
            ucp,
            raw: Mutex::new(Raw { context, worker, closing: Vec::new() }),
            inbox: Box::new(Mutex::new(Inbox::default())),
            uuid,
            blob: Vec::new(),
            next_number: AtomicU64::new(1),
            last_gc: Mutex::new(Instant::now()),
            last_progress: AtomicU64::new(0),
            born: Instant::now(),
            cfg: cfg.clone(),
        };
        // From here on, dropping `engine` destroys the worker and the context.
        engine.set_handler()?;
        let worker_address = engine.worker_address()?;
        let (major, minor, _) = ucp.version;
        let version = (u16::try_from(major).unwrap_or(u16::MAX), u16::try_from(minor).unwrap_or(u16::MAX));
        engine.blob = UcxAddress { uuid, ucx_version: version, worker_address }.encode()?;
        tracing::debug!(target: "gsc::ucx", ucx = %ucp.version_text(), address_bytes = engine.blob.len(), "UCX worker ready");
        Ok(Arc::new(engine))
    }

    fn create(ucp: &Ucp) -> Result<(NonNull<sys::ucp_context>, NonNull<sys::ucp_worker>)> {
        let mut config: *mut sys::ucp_config_t = ptr::null_mut();
        // SAFETY: NULL prefix and file mean "UCX_" and no file; a valid out-pointer.
        let st = unsafe { (ucp.config_read)(ptr::null(), ptr::null(), &mut config) };
        if st != sys::ucs_status_t::UCS_OK {
            return Err(ucp.error("ucp_config_read (is a UCX_* variable invalid?)", st));
        }
        for (name, value, why) in DEFAULTS {
            if std::env::var_os(format!("UCX_{name}")).is_some() {
                continue; // the user's choice wins
            }
            let (cname, cvalue) = (CString::new(*name).expect("no NUL"), CString::new(*value).expect("no NUL"));
            // SAFETY: a live config and NUL-terminated strings, copied by UCX.
            let st = unsafe { (ucp.config_modify)(config, cname.as_ptr(), cvalue.as_ptr()) };
            if st != sys::ucs_status_t::UCS_OK {
                tracing::warn!(target: "gsc::ucx", error = %ucp.error("ucp_config_modify", st), name, value, why, "UCX default not applied");
            }
        }
        // SAFETY: plain C data; all-zero is valid and only `field_mask` fields are read.
        let mut params: sys::ucp_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = u64::from(sys::ucp_params_field::UCP_PARAM_FIELD_FEATURES);
        params.features = u64::from(sys::ucp_feature::UCP_FEATURE_AM);
        let mut context: sys::ucp_context_h = ptr::null_mut();
        // SAFETY: valid params and config (read above), a valid out-pointer; the API version is
        // the one of the headers the bindings came from.
        let st = unsafe { (ucp.init_version)(sys::UCP_API_MAJOR, sys::UCP_API_MINOR, &params, config, &mut context) };
        // SAFETY: the config is ours and no longer needed (ucp_init copies what it uses).
        unsafe { (ucp.config_release)(config) };
        let context = match (st, NonNull::new(context)) {
            (sys::ucs_status_t::UCS_OK, Some(c)) => c,
            _ => return Err(ucp.error("ucp_init (no usable UCX transport? see UCX_TLS)", st)),
        };
        // SAFETY: as for `params`.
        let mut wparams: sys::ucp_worker_params_t = unsafe { std::mem::zeroed() };
        wparams.field_mask = u64::from(sys::ucp_worker_params_field::UCP_WORKER_PARAM_FIELD_THREAD_MODE);
        wparams.thread_mode = sys::ucs_thread_mode_t::UCS_THREAD_MODE_SERIALIZED;
        let mut worker: sys::ucp_worker_h = ptr::null_mut();
        // SAFETY: a live context, valid params and out-pointer.
        let st = unsafe { (ucp.worker_create)(context.as_ptr(), &wparams, &mut worker) };
        match (st, NonNull::new(worker)) {
            (sys::ucs_status_t::UCS_OK, Some(w)) => Ok((context, w)),
            _ => {
                // SAFETY: the context is ours and has no workers.
                unsafe { (ucp.cleanup)(context.as_ptr()) };
                Err(ucp.error("ucp_worker_create", st))
            }
        }
    }

    fn set_handler(&mut self) -> Result<()> {
        let arg = self.inbox_arg();
        let raw = lock(&self.raw);
        let param = sys::ucp_am_handler_param_t {
            field_mask: u64::from(
                sys::ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_ID
                    | sys::ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_FLAGS
                    | sys::ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_CB
                    | sys::ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_ARG,
            ),
            id: AM_ID,
            flags: sys::ucp_am_cb_flags::UCP_AM_FLAG_WHOLE_MSG,
            cb: Some(on_message),
            arg,
        };
        // SAFETY: a live worker; the callback's argument is the boxed inbox, which outlives the
        // worker (module docs).
        let st = unsafe { (self.ucp.worker_set_am_recv_handler)(raw.worker.as_ptr(), &param) };
        if st != sys::ucs_status_t::UCS_OK {
            return Err(self.ucp.error("ucp_worker_set_am_recv_handler", st));
        }
        Ok(())
    }

    fn inbox_arg(&self) -> *mut c_void {
        let p: *const Mutex<Inbox> = &*self.inbox;
        p.cast_mut().cast()
    }

    fn worker_address(&self) -> Result<Vec<u8>> {
        let raw = lock(&self.raw);
        let mut addr: *mut sys::ucp_address_t = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: a live worker and valid out-pointers.
        let st = unsafe { (self.ucp.worker_get_address)(raw.worker.as_ptr(), &mut addr, &mut len) };
        if st != sys::ucs_status_t::UCS_OK || addr.is_null() {
            return Err(self.ucp.error("ucp_worker_get_address", st));
        }
        // SAFETY: UCX returned `len` readable bytes at `addr`; copied before release.
        let bytes = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), len) }.to_vec();
        // SAFETY: the address came from this worker and is released once.
        unsafe { (self.ucp.worker_release_address)(raw.worker.as_ptr(), addr) };
        Ok(bytes)
    }

    pub(crate) fn uuid(&self) -> u128 {
        self.uuid
    }

    /// This worker's address blob (`address::UcxAddress`).
    pub(crate) fn blob(&self) -> &[u8] {
        &self.blob
    }

    /// A link number no other link of this worker uses.
    pub(crate) fn next_number(&self) -> u64 {
        self.next_number.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn with_inbox<R>(&self, f: impl FnOnce(&mut Inbox) -> R) -> R {
        f(&mut lock(&self.inbox))
    }

    /// Run UCX's progress engine (which files received messages and failures in the inbox) and
    /// finish what gone links left behind. Returns UCX's count of progressed events.
    pub(crate) fn progress(&self) -> usize {
        self.last_progress.store(self.now_ns(), Ordering::Relaxed);
        let mut raw = lock(&self.raw);
        let mut total = 0;
        for _ in 0..PROGRESS_ROUNDS {
            // SAFETY: a live worker, under the serializing lock.
            let n = unsafe { (self.ucp.worker_progress)(raw.worker.as_ptr()) } as usize;
            total += n;
            if n == 0 {
                break;
            }
        }
        if !raw.closing.is_empty() {
            reap_closing(self.ucp, &self.inbox, &mut raw);
        }
        total
    }

    fn now_ns(&self) -> u64 {
        u64::try_from(self.born.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// `progress`, unless it ran less than `interval` ago. An idle UCP worker still costs a
    /// system call per progress (the TCP transport polls its sockets), which a worker whose
    /// traffic is all on shm should not pay on every pass.
    /// `None` when it did not run.
    pub(crate) fn progress_if_idle_for(&self, interval: Duration) -> Option<usize> {
        let last = self.last_progress.load(Ordering::Relaxed);
        if self.now_ns().saturating_sub(last) < u64::try_from(interval.as_nanos()).unwrap_or(u64::MAX) {
            return None;
        }
        Some(self.progress())
    }

    /// Remove channels nobody claimed for `ORPHAN_TTL`; cheap to call often (runs once a second).
    pub(crate) fn collect_orphans(&self) {
        let now = Instant::now();
        let mut last = lock(&self.last_gc);
        if now.duration_since(*last) < Duration::from_secs(1) {
            return;
        }
        *last = now;
        let n = self.with_inbox(|ib| ib.collect_orphans(now, ORPHAN_TTL));
        if n > 0 {
            tracing::debug!(target: "gsc::ucx", channels = n, "dropped frames of links nobody claimed");
        }
    }

    /// An endpoint to the UCP worker whose address is `worker_address`, with peer error handling;
    /// its failures are routed to channel `key`.
    pub(crate) fn create_ep(&self, worker_address: &[u8], key: Key) -> Result<Ep> {
        let arg = self.inbox_arg();
        let raw = lock(&self.raw);
        // SAFETY: plain C data; all-zero is valid and only `field_mask` fields are read.
        let mut params: sys::ucp_ep_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = u64::from(
            sys::ucp_ep_params_field::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::ucp_ep_params_field::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | sys::ucp_ep_params_field::UCP_EP_PARAM_FIELD_ERR_HANDLER,
        );
        params.address = worker_address.as_ptr().cast();
        params.err_mode = sys::ucp_err_handling_mode_t::UCP_ERR_HANDLING_MODE_PEER;
        params.err_handler = sys::ucp_err_handler_t { cb: Some(on_ep_error), arg };
        let mut ep: sys::ucp_ep_h = ptr::null_mut();
        // SAFETY: a live worker; the address bytes are valid for the call (UCX unpacks them
        // during it and checks them: a malformed address is an error status); the handler's
        // argument outlives the worker.
        let st = unsafe { (self.ucp.ep_create)(raw.worker.as_ptr(), &params, &mut ep) };
        let ep = match (st, NonNull::new(ep)) {
            (sys::ucs_status_t::UCS_OK, Some(ep)) => Ep { raw: ep },
            _ => return Err(self.ucp.error("ucp_ep_create", st)),
        };
        drop(raw);
        self.with_inbox(|ib| ib.register_ep(ep.addr(), key));
        Ok(ep)
    }

    /// Send one frame: `buf` holds the encoded header, then the body. Never waits: UCX queues
    /// what it cannot send now, and the returned `InFlight` keeps the bytes until it is done.
    pub(crate) fn send(&self, ep: &Ep, buf: Vec<u8>) -> Result<Sent> {
        debug_assert!(buf.len() >= HEADER_LEN);
        // Eager only: the receiver's handler then always gets the whole frame in its call (a
        // rendezvous message would have to be fetched with a separate receive).
        let params = params_with_flags(sys::ucp_send_am_flags::UCP_AM_SEND_FLAG_EAGER);
        let (head, body) = buf.split_at(HEADER_LEN);
        let raw = lock(&self.raw);
        // SAFETY: a live endpoint of this worker, under the lock; header and body stay valid
        // until the request completes (the buffer moves into the returned InFlight, or into
        // `closing` if the link goes away first; moving a Vec does not move its heap bytes).
        let p = unsafe {
            (self.ucp.am_send_nbx)(ep.raw.as_ptr(), AM_ID, head.as_ptr().cast(), head.len(), body.as_ptr().cast(), body.len(), &params)
        };
        drop(raw);
        match loader::status_ptr(p) {
            StatusPtr::Done => Ok(Sent::Done),
            StatusPtr::Failed(st) => Err(self.send_error(st)),
            StatusPtr::Pending(req) => Ok(Sent::Pending(InFlight { req, buf })),
        }
    }

    fn send_error(&self, st: sys::ucs_status_t::Type) -> Error {
        let e = self.ucp.error("ucp_am_send_nbx", st);
        // A send fails because its endpoint did: the peer is gone (or unreachable).
        match e.status() {
            Status::ConnectionReset | Status::IoError | Status::TimedOut | Status::Canceled => {
                Error::new(Status::PeerFailed, e.message().to_string())
            }
            _ => e,
        }
    }

    /// Drop the finished sends at the front of `q` (an unfinished one is polled again next
    /// time; UCX completes one endpoint's eager sends in order). Returns the bytes released, or
    /// a failed send's error.
    pub(crate) fn poll_sends(&self, q: &mut VecDeque<InFlight>) -> Result<usize> {
        let raw = lock(&self.raw);
        let mut released = 0;
        let mut failure = None;
        while let Some(front) = q.front() {
            // SAFETY: a request of this worker not yet freed, under the lock.
            let st = unsafe { (self.ucp.request_check_status)(front.req.as_ptr()) };
            if st == sys::ucs_status_t::UCS_INPROGRESS {
                break;
            }
            let done = q.pop_front().expect("front exists");
            // SAFETY: a completed request, freed once; its buffer is dropped after.
            unsafe { (self.ucp.request_free)(done.req.as_ptr()) };
            released += done.len();
            if st != sys::ucs_status_t::UCS_OK && failure.is_none() {
                failure = Some(self.send_error(st));
            }
        }
        drop(raw);
        failure.map_or(Ok(released), Err)
    }

    /// A link is going away: close its endpoint (flushing what it sent, unless `force`: the peer
    /// failed) and keep its unfinished sends until UCX is done with them.
    pub(crate) fn retire(&self, ep: Ep, sends: VecDeque<InFlight>, force: bool) {
        let flags = if force { sys::ucp_ep_close_flags_t::UCP_EP_CLOSE_FLAG_FORCE } else { 0 };
        let params = params_with_flags(flags);
        let mut raw = lock(&self.raw);
        raw.closing.extend(sends.into_iter().map(Closing::Send));
        // SAFETY: a live endpoint owned by the caller, closed once (it is consumed here).
        let p = unsafe { (self.ucp.ep_close_nbx)(ep.raw.as_ptr(), &params) };
        match loader::status_ptr(p) {
            StatusPtr::Done => self.with_inbox(|ib| ib.forget_ep(ep.addr())),
            StatusPtr::Failed(st) => {
                // The endpoint is released all the same; a failed flush is what a dead peer gives.
                tracing::debug!(target: "gsc::ucx", error = %self.ucp.error("ucp_ep_close_nbx", st), "endpoint closed");
                self.with_inbox(|ib| ib.forget_ep(ep.addr()));
            }
            StatusPtr::Pending(req) => raw.closing.push(Closing::Ep { req, ep: ep.addr() }),
        }
        reap_closing(self.ucp, &self.inbox, &mut raw);
    }
}

/// Free the requests of gone links that UCX has finished; keep the others.
fn reap_closing(ucp: &Ucp, inbox: &Mutex<Inbox>, raw: &mut Raw) {
    raw.closing.retain(|c| {
        let req = match c {
            Closing::Send(f) => f.req,
            Closing::Ep { req, .. } => *req,
        };
        // SAFETY: a request of this worker not yet freed; `&mut Raw` means the caller holds the
        // serializing lock (or owns the engine).
        let st = unsafe { (ucp.request_check_status)(req.as_ptr()) };
        if st == sys::ucs_status_t::UCS_INPROGRESS {
            return true;
        }
        // SAFETY: completed, freed once; a send's buffer is dropped with the entry after.
        unsafe { (ucp.request_free)(req.as_ptr()) };
        if let Closing::Ep { ep, .. } = c {
            lock(inbox).forget_ep(*ep);
        }
        false
    });
}

impl Drop for Engine {
    fn drop(&mut self) {
        let ucp = self.ucp;
        let timeout = self.cfg.close_timeout;
        let raw = self.raw.get_mut().unwrap_or_else(|e| e.into_inner());
        // Let the last frames of closed links leave: a send is done once the transport took it
        // (the peer need not take part), and destroying the worker would lose it. Bounded: a
        // transport that cannot take more because the peer stopped reading must not hang the
        // worker's destruction. Endpoint closes are not waited for (a flushing close needs the
        // peer's progress); destroying the worker closes them.
        let deadline = Instant::now() + timeout;
        let sending = |raw: &Raw| raw.closing.iter().any(|c| matches!(c, Closing::Send(_)));
        while sending(raw) && Instant::now() < deadline {
            let mut n = 0;
            for _ in 0..PROGRESS_ROUNDS {
                // SAFETY: a live worker; `&mut self` excludes every other caller.
                n += unsafe { (ucp.worker_progress)(raw.worker.as_ptr()) };
            }
            reap_closing(ucp, &self.inbox, raw);
            if n == 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        if sending(raw) {
            tracing::warn!(target: "gsc::ucx", ?timeout, "UCX sends of closed links still pending at worker destruction; abandoned");
        }
        // UCX requires every request to be released before its worker is destroyed; released
        // ones still in progress are ended by the destruction.
        for c in &raw.closing {
            let req = match c {
                Closing::Send(f) => f.req,
                Closing::Ep { req, .. } => *req,
            };
            // SAFETY: a request of this worker not yet freed, freed once (the list is cleared
            // below without freeing again).
            unsafe { (ucp.request_free)(req.as_ptr()) };
        }
        // SAFETY: every link is gone (each held an Arc of this engine) and closed its endpoint;
        // destroying the worker ends what is left, after which UCX no longer touches the
        // buffers in `closing` nor calls our callbacks (so the inbox may go after it).
        unsafe { (ucp.worker_destroy)(raw.worker.as_ptr()) };
        raw.closing.clear();
        // SAFETY: the context's only worker is destroyed.
        unsafe { (ucp.cleanup)(raw.context.as_ptr()) };
    }
}

/// The active-message handler: file the frame in the inbox. Runs inside `ucp_worker_progress`.
///
/// # Safety
/// Called by UCX only, with `arg` the engine's boxed inbox and header/data valid for the call.
unsafe extern "C" fn on_message(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t::Type {
    // Nothing may unwind into UCX.
    let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `arg` is the inbox the handler was installed with; it outlives the worker.
        let inbox = unsafe { &*arg.cast::<Mutex<Inbox>>() };
        let head: &[u8] = if header.is_null() {
            &[]
        } else {
            // SAFETY: UCX passes `header_length` readable bytes, valid during this call.
            unsafe { std::slice::from_raw_parts(header.cast::<u8>(), header_length) }
        };
        let h = match Header::decode(head) {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(target: "gsc::ucx", error = %e, "message with a bad header dropped");
                return;
            }
        };
        // SAFETY: UCX passes a valid parameter block (or none).
        let attr = if param.is_null() { 0 } else { unsafe { (*param).recv_attr } };
        if attr & u64::from(sys::ucp_am_recv_attr_t::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 {
            // We send eager only; a rendezvous descriptor means the sender is not gscomm's.
            let key = Key { link: h.link, to: h.from.other() };
            let e = Error::new(Status::PeerFailed, "UCX rendezvous message on a gscomm link (the sender is not eager-only)");
            lock(inbox).fail(&key, e);
            return;
        }
        let body = if data.is_null() || length == 0 {
            Vec::new()
        } else {
            // SAFETY: without the rendezvous flag, `data` holds `length` readable bytes during
            // this call (copied now; returning UCS_OK tells UCX we kept nothing).
            unsafe { std::slice::from_raw_parts(data.cast::<u8>(), length) }.to_vec()
        };
        lock(inbox).arrive(h, body, Instant::now());
    }));
    if r.is_err() {
        tracing::error!(target: "gsc::ucx", "panic in the UCX message handler (bug); message dropped");
    }
    sys::ucs_status_t::UCS_OK
}

/// The endpoint error handler: record the failure for the owning link.
///
/// # Safety
/// Called by UCX only, with `arg` the engine's boxed inbox.
unsafe extern "C" fn on_ep_error(arg: *mut c_void, ep: sys::ucp_ep_h, status: sys::ucs_status_t::Type) {
    let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `arg` is the inbox the endpoint was created with; it outlives the worker.
        let inbox = unsafe { &*arg.cast::<Mutex<Inbox>>() };
        let why = loader::ucp().map_or_else(|_| format!("UCX status {status}"), |u| u.describe(status));
        // A clean close arrives as a close frame: an endpoint error means the peer failed.
        let e = Error::new(Status::PeerFailed, format!("UCX endpoint failed: {why} (UCX status {status})"));
        tracing::info!(target: "gsc::ucx", error = %e, "UCX peer failure");
        lock(inbox).ep_failed(ep as usize, e);
    }));
    if r.is_err() {
        tracing::error!(target: "gsc::ucx", "panic in the UCX endpoint error handler (bug)");
    }
}
