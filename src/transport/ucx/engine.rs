//! One UCP context and worker per gscomm worker, and every call the lane makes on them. Every
//! `unsafe` block of the UCX lane outside the loader is in this file.
//!
//! Locking: UCP objects of a worker are created `UCS_THREAD_MODE_SERIALIZED` (any thread, one at
//! a time); `raw` is the lock that makes it so, held around every UCP call. UCX runs our
//! callbacks (received messages, endpoint failures) inside `ucp_worker_progress`, so they must
//! not take `raw` nor call UCP: they only take the locks of `Shared` (the inbox, the announced
//! rendezvous frames, the buffer pool), which are never held while UCP is called. `Shared`
//! lives in a `Box` whose address UCX keeps as the callbacks' argument; it is freed only after
//! `ucp_worker_destroy`, after which UCX calls nothing of ours.
//!
//! Large frames (`UcxConfig::rndv_min` and up) go by UCX's rendezvous: the handler only gets a
//! descriptor, files it in `Shared::announced`, and `progress` (which holds `raw`) starts
//! `ucp_am_recv_data_nbx` into a pool buffer right after the `ucp_worker_progress` call that
//! announced it; the frame enters the inbox when that receive completes. Eager copies (bcopy)
//! of such frames were what made large transfers slow: UCX's TCP transport cuts an eager
//! message into 8 KiB segments (`UCX_TCP_TX_SEG_SIZE`), each packed and sent on its own, and
//! reassembles them on the other side; its rendezvous moves the bytes in one zero-copy
//! operation (`UCX_TCP_PUT_ENABLE`, and `cma`/`rc` where they apply) into our buffer.
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
use super::pool::BufPool;
use super::sys;
use super::wire::{HEADER_LEN, Header};
use crate::error::{Error, Result, Status};

/// Our active-message id. One handler per UCP worker serves every link of it.
const AM_ID: u32 = 0x47;
/// A UCX setting gscomm changes unless the user set it.
struct UcxDefault {
    /// The environment variable, without `UCX_`, whose presence means the user chose.
    env: &'static str,
    /// The name `ucp_config_modify` takes: a UCP setting's own name, or a transport setting's
    /// field name without its table's prefix (UCP hands unknown names to every transport's
    /// table; `TCP_TX_SEG_SIZE` is silently ignored, `TX_SEG_SIZE` reaches TCP's, and no other
    /// transport of 1.13 or 1.16 has a field of that name).
    name: &'static str,
    value: String,
    why: &'static str,
}

/// The UCX settings gscomm changes (docs/UCX.md has the table).
fn ucx_defaults(cfg: &UcxConfig) -> Vec<UcxDefault> {
    // Room for UCT's, UCP's and our own headers beside the largest frame.
    let seg = format!("{}", cfg.max_frame + (4 << 10));
    vec![
        UcxDefault {
            env: "ZCOPY_THRESH",
            name: "ZCOPY_THRESH",
            value: "inf".to_string(),
            // UCX 1.13's TCP transport aborts on an internal assertion (uct_iface.h:884,
            // `comp->count > 0`) when a peer fails while a zero-copy eager message to it is in
            // flight; our frames are copied into one buffer anyway, so copy sends cost little.
            why: "avoid UCX 1.13's TCP abort on peer failure during zero-copy sends",
        },
        // UCX's TCP transport sends an eager message in segments of UCX_TCP_TX_SEG_SIZE (8 KiB by
        // default), each packed, sent and parsed on its own, and reassembled by the receiver:
        // at 256 KiB a frame that was 32+ system calls and copies a side, and the lane moved
        // ~1 GB/s where UCX's own tag rendezvous moved 3–5 (dev VM, docs/UCX.md). Segments that
        // hold a whole frame made it 3x faster.
        UcxDefault { env: "TCP_TX_SEG_SIZE", name: "TX_SEG_SIZE", value: seg.clone(), why: "a whole frame per TCP segment" },
        UcxDefault { env: "TCP_RX_SEG_SIZE", name: "RX_SEG_SIZE", value: seg, why: "a whole frame per TCP segment" },
    ]
}
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
    /// Rendezvous frames being received: filed in the inbox when UCX completes them.
    fetching: Vec<Fetch>,
}

/// A rendezvous frame UCX is receiving into `buf`.
struct Fetch {
    req: NonNull<c_void>,
    header: Header,
    buf: Vec<u8>,
}

/// A rendezvous frame the handler was told of: its header and UCX's data descriptor (kept by
/// UCX because the handler returned `UCS_INPROGRESS`; handed back by `ucp_am_recv_data_nbx` or
/// `ucp_am_data_release`).
struct Announced {
    header: Header,
    desc: NonNull<c_void>,
    len: usize,
}

// SAFETY: the descriptor is only used through the engine, under its `raw` lock.
unsafe impl Send for Announced {}

/// What the callbacks reach through their argument (module docs).
struct Shared {
    inbox: Mutex<Inbox>,
    announced: Mutex<Vec<Announced>>,
    pool: BufPool,
}

pub(crate) struct Engine {
    ucp: &'static Ucp,
    raw: Mutex<Raw>,
    /// The callbacks' argument: must stay at this address until the worker is destroyed.
    shared: Box<Shared>,
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
        let (context, worker) = Engine::create(ucp, cfg)?;
        let mut engine = Engine {
            ucp,
            raw: Mutex::new(Raw { context, worker, closing: Vec::new(), fetching: Vec::new() }),
            shared: Box::new(Shared {
                inbox: Mutex::new(Inbox::default()),
                announced: Mutex::new(Vec::new()),
                // Enough for what one link keeps in flight, in frames of the largest size.
                pool: BufPool::new((cfg.max_in_flight / cfg.max_frame.max(1)).clamp(8, 256), cfg.max_frame.saturating_add(HEADER_LEN)),
            }),
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

    fn create(ucp: &Ucp, cfg: &UcxConfig) -> Result<(NonNull<sys::ucp_context>, NonNull<sys::ucp_worker>)> {
        let mut config: *mut sys::ucp_config_t = ptr::null_mut();
        // SAFETY: NULL prefix and file mean "UCX_" and no file; a valid out-pointer.
        let st = unsafe { (ucp.config_read)(ptr::null(), ptr::null(), &mut config) };
        if st != sys::ucs_status_t::UCS_OK {
            return Err(ucp.error("ucp_config_read (is a UCX_* variable invalid?)", st));
        }
        for UcxDefault { env, name, value, why } in ucx_defaults(cfg) {
            if std::env::var_os(format!("UCX_{env}")).is_some() {
                continue; // the user's choice wins
            }
            let (cname, cvalue) = (CString::new(name).expect("no NUL"), CString::new(value.as_str()).expect("no NUL"));
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
        let p: *const Shared = &*self.shared;
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
        f(&mut lock(&self.shared.inbox))
    }

    /// An empty frame buffer with room for `capacity` bytes (`pool`).
    pub(crate) fn buffer(&self, capacity: usize) -> Vec<u8> {
        self.shared.pool.take_empty(capacity)
    }

    /// Give a frame buffer back for reuse.
    pub(crate) fn recycle(&self, buf: Vec<u8>) {
        self.shared.pool.give(buf);
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
            // Right away: the sender's rendezvous waits for this receive to start.
            self.fetch_announced(&mut raw);
            if n == 0 {
                break;
            }
        }
        if !raw.fetching.is_empty() {
            total += self.reap_fetches(&mut raw);
        }
        if !raw.closing.is_empty() {
            reap_closing(self.ucp, &self.shared.inbox, &mut raw);
        }
        total
    }

    /// Start receiving the rendezvous frames the handler was told of, each into a pool buffer.
    fn fetch_announced(&self, raw: &mut Raw) {
        let announced = std::mem::take(&mut *lock(&self.shared.announced));
        for a in announced {
            let mut buf = self.shared.pool.take_len(a.len);
            // No flags, no callback: the request is polled (`reap_fetches`); contiguous bytes.
            let params = params_with_flags(0);
            // SAFETY: a live worker under the serializing lock; `desc` is a descriptor this
            // worker's handler kept (returned UCS_INPROGRESS) and is handed back exactly once,
            // here; `buf` holds `a.len` writable bytes and stays at its address until the
            // request completes (moved into `fetching`, or dropped only after the worker is
            // destroyed).
            let p = unsafe { (self.ucp.am_recv_data_nbx)(raw.worker.as_ptr(), a.desc.as_ptr(), buf.as_mut_ptr().cast(), a.len, &params) };
            match loader::status_ptr(p) {
                StatusPtr::Done => self.with_inbox(|ib| ib.arrive(a.header, buf, Instant::now())),
                StatusPtr::Failed(st) => self.fetch_failed(&a.header, st),
                StatusPtr::Pending(req) => raw.fetching.push(Fetch { req, header: a.header, buf }),
            }
        }
    }

    /// File the rendezvous frames UCX finished receiving. Returns how many ended.
    fn reap_fetches(&self, raw: &mut Raw) -> usize {
        let mut ended = 0;
        let mut i = 0;
        while i < raw.fetching.len() {
            let req = raw.fetching[i].req;
            // SAFETY: a request of this worker not yet freed, under the lock.
            let st = unsafe { (self.ucp.request_check_status)(req.as_ptr()) };
            if st == sys::ucs_status_t::UCS_INPROGRESS {
                i += 1;
                continue;
            }
            // SAFETY: completed, freed once (the entry is removed just below).
            unsafe { (self.ucp.request_free)(req.as_ptr()) };
            let f = raw.fetching.swap_remove(i);
            ended += 1;
            if st == sys::ucs_status_t::UCS_OK {
                self.with_inbox(|ib| ib.arrive(f.header, f.buf, Instant::now()));
            } else {
                self.fetch_failed(&f.header, st);
            }
        }
        ended
    }

    /// A rendezvous frame could not be received: its link cannot go on (a frame is missing).
    fn fetch_failed(&self, h: &Header, st: sys::ucs_status_t::Type) {
        let e = self.ucp.error("ucp_am_recv_data_nbx", st);
        let e = Error::new(Status::PeerFailed, format!("receiving a UCX rendezvous frame failed: {}", e.message()));
        let key = Key { link: h.link, to: h.from.other() };
        self.with_inbox(|ib| ib.fail(&key, e));
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
        // Large frames by rendezvous (module docs); small ones eager, so that the handler gets
        // them whole in its call, with no round trip.
        let (head, body) = buf.split_at(HEADER_LEN);
        let flag = if body.len() >= self.cfg.rndv_min {
            sys::ucp_send_am_flags::UCP_AM_SEND_FLAG_RNDV
        } else {
            sys::ucp_send_am_flags::UCP_AM_SEND_FLAG_EAGER
        };
        let params = params_with_flags(flag);
        let raw = lock(&self.raw);
        // SAFETY: a live endpoint of this worker, under the lock; header and body stay valid
        // until the request completes (the buffer moves into the returned InFlight, or into
        // `closing` if the link goes away first; moving a Vec does not move its heap bytes).
        let p = unsafe {
            (self.ucp.am_send_nbx)(ep.raw.as_ptr(), AM_ID, head.as_ptr().cast(), head.len(), body.as_ptr().cast(), body.len(), &params)
        };
        drop(raw);
        match loader::status_ptr(p) {
            StatusPtr::Done => {
                self.recycle(buf);
                Ok(Sent::Done)
            }
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
            // SAFETY: a completed request, freed once; its buffer is reused after.
            unsafe { (self.ucp.request_free)(done.req.as_ptr()) };
            released += done.len();
            self.shared.pool.give(done.buf);
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
        reap_closing(self.ucp, &self.shared.inbox, &mut raw);
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
            reap_closing(ucp, &self.shared.inbox, raw);
            if n == 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        if sending(raw) {
            tracing::warn!(target: "gsc::ucx", ?timeout, "UCX sends of closed links still pending at worker destruction; abandoned");
        }
        // Rendezvous frames announced but never fetched: their descriptors go back to UCX.
        for a in std::mem::take(&mut *lock(&self.shared.announced)) {
            // SAFETY: a descriptor the handler kept, not handed back before (the list is taken).
            unsafe { (ucp.am_data_release)(raw.worker.as_ptr(), a.desc.as_ptr()) };
        }
        // UCX requires every request to be released before its worker is destroyed; released
        // ones still in progress are ended by the destruction.
        for f in &raw.fetching {
            // SAFETY: a receive request of this worker not yet freed, freed once (the list is
            // cleared after the destruction, which is when its buffer may go).
            unsafe { (ucp.request_free)(f.req.as_ptr()) };
        }
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
        raw.fetching.clear();
        // SAFETY: the context's only worker is destroyed.
        unsafe { (ucp.cleanup)(raw.context.as_ptr()) };
    }
}

/// The active-message handler: file an eager frame in the inbox, or announce a rendezvous one
/// for `progress` to fetch. Runs inside `ucp_worker_progress`.
///
/// # Safety
/// Called by UCX only, with `arg` the engine's boxed `Shared` and header/data valid for the call.
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
        // SAFETY: `arg` is the `Shared` the handler was installed with; it outlives the worker.
        let shared = unsafe { &*arg.cast::<Shared>() };
        let inbox = &shared.inbox;
        let head: &[u8] = if header.is_null() {
            &[]
        } else {
            // SAFETY: UCX passes `header_length` readable bytes, valid during this call.
            unsafe { std::slice::from_raw_parts(header.cast::<u8>(), header_length) }
        };
        // SAFETY: UCX passes a valid parameter block (or none).
        let attr = if param.is_null() { 0 } else { unsafe { (*param).recv_attr } };
        let rndv = attr & u64::from(sys::ucp_am_recv_attr_t::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
        let h = match Header::decode(head) {
            Ok(h) => h,
            Err(e) => {
                // A rendezvous descriptor returned with UCS_OK is dropped by UCX (the sender's
                // send completes); nothing of it is kept.
                tracing::warn!(target: "gsc::ucx", error = %e, "message with a bad header dropped");
                return sys::ucs_status_t::UCS_OK;
            }
        };
        if rndv {
            match NonNull::new(data) {
                Some(desc) => {
                    lock(&shared.announced).push(Announced { header: h, desc, len: length });
                    // Keep the descriptor: `progress` fetches it after this call returns.
                    return sys::ucs_status_t::UCS_INPROGRESS;
                }
                None => {
                    let key = Key { link: h.link, to: h.from.other() };
                    lock(inbox).fail(&key, Error::new(Status::PeerFailed, "UCX rendezvous message without a descriptor"));
                    return sys::ucs_status_t::UCS_OK;
                }
            }
        }
        let mut body = shared.pool.take_empty(length);
        if !data.is_null() && length > 0 {
            // SAFETY: without the rendezvous flag, `data` holds `length` readable bytes during
            // this call (copied now; returning UCS_OK tells UCX we kept nothing).
            body.extend_from_slice(unsafe { std::slice::from_raw_parts(data.cast::<u8>(), length) });
        }
        lock(inbox).arrive(h, body, Instant::now());
        sys::ucs_status_t::UCS_OK
    }));
    match r {
        Ok(st) => st,
        Err(_) => {
            tracing::error!(target: "gsc::ucx", "panic in the UCX message handler (bug); message dropped");
            sys::ucs_status_t::UCS_OK
        }
    }
}

/// The endpoint error handler: record the failure for the owning link.
///
/// # Safety
/// Called by UCX only, with `arg` the engine's boxed `Shared`.
unsafe extern "C" fn on_ep_error(arg: *mut c_void, ep: sys::ucp_ep_h, status: sys::ucs_status_t::Type) {
    let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `arg` is the `Shared` the endpoint was created with; it outlives the worker.
        let inbox = unsafe { &(*arg.cast::<Shared>()).inbox };
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
