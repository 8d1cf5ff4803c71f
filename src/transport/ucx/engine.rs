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

use std::collections::{HashMap, VecDeque};
use std::ffi::{CString, c_void};
use std::panic::AssertUnwindSafe;
use std::ptr::{self, NonNull};
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
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
    /// Force-closed by a get that ran past its deadline (`Engine::get`): UCX released it, so
    /// nothing may use `raw` again (checked under the `raw` lock by every call that would).
    dead: AtomicBool,
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

/// An endpoint flush UCX has not finished (`Engine::flush`): until it completes, bytes of
/// frames whose sends UCX already called complete may still be in this process.
pub(crate) struct Flushing {
    req: NonNull<c_void>,
}

// SAFETY: the request handle is only used through the engine, under its `raw` lock.
unsafe impl Send for Flushing {}

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
    /// Registrations of this process's memory alive now, by range (`register`): sends of one
    /// buffer in flight together share one.
    regs: Mutex<HashMap<(usize, usize), Weak<Registration>>>,
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
            regs: Mutex::new(HashMap::new()),
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
        // RMA for rendezvous by get (`get`, `register`); where no transport does RMA in
        // hardware UCX emulates it over its own active messages, so asking costs nothing.
        params.features = u64::from(sys::ucp_feature::UCP_FEATURE_AM | sys::ucp_feature::UCP_FEATURE_RMA);
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
            (sys::ucs_status_t::UCS_OK, Some(ep)) => Ep { raw: ep, dead: AtomicBool::new(false) },
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
        if ep.dead.load(Ordering::Relaxed) {
            return Err(dead_ep());
        }
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

    /// Start flushing `ep`: the returned request completes once everything sent on it so far
    /// has left this process (`None`: it already has).
    ///
    /// Why a completed send is not enough: UCX completes an eager (bcopy) send once it has
    /// copied the frame, and its TCP transport copies what the socket does not take into the
    /// endpoint's own send buffer, returning success; the rest goes out only in a later
    /// `ucp_worker_progress` of *this* process, when the socket has room (EPOLLOUT). A sender
    /// whose last frame stayed there and that then stops progressing (its proxy thread asleep:
    /// nothing of its own in flight) leaves the peer waiting for that frame's tail: the
    /// intermittent stalls of issue #7. The flush says when nothing is left here.
    pub(crate) fn flush(&self, ep: &Ep) -> Result<Option<Flushing>> {
        let params = params_with_flags(0);
        let raw = lock(&self.raw);
        if ep.dead.load(Ordering::Relaxed) {
            return Err(dead_ep());
        }
        // SAFETY: a live endpoint of this worker, under the lock; no buffer is involved.
        let p = unsafe { (self.ucp.ep_flush_nbx)(ep.raw.as_ptr(), &params) };
        drop(raw);
        match loader::status_ptr(p) {
            StatusPtr::Done => Ok(None),
            StatusPtr::Failed(st) => Err(self.send_error(st)),
            StatusPtr::Pending(req) => Ok(Some(Flushing { req })),
        }
    }

    /// Whether a flush finished: `None` while in progress, then its result (the request is
    /// freed then, so `f` must not be polled again).
    pub(crate) fn flush_done(&self, f: &Flushing) -> Option<Result<()>> {
        let raw = lock(&self.raw);
        // SAFETY: a request of this worker not yet freed, under the lock.
        let st = unsafe { (self.ucp.request_check_status)(f.req.as_ptr()) };
        if st == sys::ucs_status_t::UCS_INPROGRESS {
            return None;
        }
        // SAFETY: completed, freed once (the caller drops `f` on a `Some`).
        unsafe { (self.ucp.request_free)(f.req.as_ptr()) };
        drop(raw);
        Some(if st == sys::ucs_status_t::UCS_OK { Ok(()) } else { Err(self.send_error(st)) })
    }

    /// Give up on a flush (its link is going away): UCX frees the request when it ends.
    pub(crate) fn flush_abandon(&self, f: Flushing) {
        let _raw = lock(&self.raw);
        // SAFETY: a request of this worker not yet freed, freed once (consumed); a flush has no
        // buffer that UCX could still touch.
        unsafe { (self.ucp.request_free)(f.req.as_ptr()) };
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
        if ep.dead.load(Ordering::Relaxed) {
            // Already force-closed by a timed-out get, which handed its close to `closing`.
            reap_closing(self.ucp, &self.shared.inbox, &mut raw);
            return;
        }
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

/// The error of a call on an endpoint a timed-out get force-closed.
fn dead_ep() -> Error {
    Error::new(Status::TimedOut, "UCX endpoint closed after a remote read ran past GSC_TIMEOUT")
}

/// Process-wide counts of the lane's remote-memory work, for tests and `gsc-bench` (they show
/// that rendezvous data moved by get and not in frames).
pub(crate) static GETS: AtomicU64 = AtomicU64::new(0);
pub(crate) static GET_BYTES: AtomicU64 = AtomicU64::new(0);
pub(crate) static REGISTRATIONS: AtomicU64 = AtomicU64::new(0);

/// A range of this process's memory registered with UCX (`ucp_mem_map`) and its packed key
/// (`rkey::RemoteKey`, what an RTS carries). Shared by the sends of that range in flight;
/// unmapped when the last of them completes (the worker holds it per request), so UCX never
/// keeps a registration of memory the user may have freed since (with a NIC that pins pages,
/// a stale registration would read old pages at a reused address).
pub(crate) struct Registration {
    engine: Arc<Engine>,
    memh: NonNull<sys::ucp_mem>,
    base: usize,
    len: usize,
    pub(crate) key: Vec<u8>,
}

// SAFETY: the memory handle is only used through the engine, under its `raw` lock (unmap in
// drop); the rest is plain data.
unsafe impl Send for Registration {}
// SAFETY: as above; shared readers only read `key`.
unsafe impl Sync for Registration {}

impl Drop for Registration {
    fn drop(&mut self) {
        let me: *const Registration = self;
        {
            let mut regs = lock(&self.engine.regs);
            // Only our own entry: a new registration of the same range may have replaced it.
            if regs.get(&(self.base, self.len)).is_some_and(|w| std::ptr::eq(w.as_ptr(), me)) {
                regs.remove(&(self.base, self.len));
            }
        }
        let raw = lock(&self.engine.raw);
        // SAFETY: a handle this context mapped, unmapped once (here, as the last owner goes).
        let st = unsafe { (self.engine.ucp.mem_unmap)(raw.context.as_ptr(), self.memh.as_ptr()) };
        if st != sys::ucs_status_t::UCS_OK {
            // Nothing to give back to: the next registration is unaffected.
            tracing::warn!(target: "gsc::ucx", error = %self.engine.ucp.error("ucp_mem_unmap", st), "UCX registration not released");
        }
    }
}

/// A peer's packed key unpacked on one of our endpoints (`ucp_ep_rkey_unpack`); destroyed by
/// the link that owns the endpoint, before the endpoint goes.
pub(crate) struct RkeyHandle(NonNull<sys::ucp_rkey>);

// SAFETY: only used through the engine, under its `raw` lock.
unsafe impl Send for RkeyHandle {}

impl Engine {
    /// The registration covering `[addr, addr+len)` of this process: one alive already (a send
    /// of the same buffer in flight), or a new `ucp_mem_map` of exactly that range.
    pub(crate) fn register(self: &Arc<Engine>, addr: usize, len: usize) -> Result<Arc<Registration>> {
        let mut regs = lock(&self.regs);
        let end = addr.checked_add(len).ok_or_else(|| Error::invalid_param("registered range overflows"))?;
        if let Some(r) = regs.get(&(addr, len)).and_then(Weak::upgrade) {
            return Ok(r);
        }
        // A covering one (a send of part of a buffer whose whole is in flight). The map holds
        // only what is in flight, so a scan is short.
        if let Some(r) = regs.iter().filter(|((b, l), _)| *b <= addr && end <= b + l).find_map(|(_, w)| w.upgrade()) {
            return Ok(r);
        }
        regs.retain(|_, w| w.strong_count() > 0);
        let raw = lock(&self.raw);
        // SAFETY: plain C data; all-zero is valid and only `field_mask` fields are read.
        let mut params: sys::ucp_mem_map_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = u64::from(
            sys::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_LENGTH,
        );
        params.address = addr as *mut c_void;
        params.length = len;
        let mut memh: sys::ucp_mem_h = ptr::null_mut();
        // SAFETY: a live context under the lock; the range is the caller's send buffer, valid
        // until the send completes, which is when the registration goes (the worker's hold).
        // UCX only records (or pins) the range here; it reads it when a peer's get arrives.
        let st = unsafe { (self.ucp.mem_map)(raw.context.as_ptr(), &params, &mut memh) };
        let memh = match (st, NonNull::new(memh)) {
            (sys::ucs_status_t::UCS_OK, Some(m)) => m,
            _ => return Err(self.ucp.error("ucp_mem_map", st)),
        };
        let mut buf: *mut c_void = ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: a handle this context just mapped; valid out-pointers.
        let st = unsafe { (self.ucp.rkey_pack)(raw.context.as_ptr(), memh.as_ptr(), &mut buf, &mut size) };
        let packed = if st == sys::ucs_status_t::UCS_OK && !buf.is_null() {
            // SAFETY: UCX returned `size` readable bytes at `buf`; copied, then released once.
            let v = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), size) }.to_vec();
            // SAFETY: the buffer rkey_pack returned, released once.
            unsafe { (self.ucp.rkey_buffer_release)(buf) };
            Ok(v)
        } else {
            Err(self.ucp.error("ucp_rkey_pack", st))
        };
        let key = match packed.and_then(|ucx| super::rkey::RemoteKey { base: addr as u64, len: len as u64, ucx: &ucx }.encode()) {
            Ok(k) => k,
            Err(e) => {
                // SAFETY: mapped just above, unmapped once; nobody else knows the handle.
                unsafe { (self.ucp.mem_unmap)(raw.context.as_ptr(), memh.as_ptr()) };
                return Err(e);
            }
        };
        drop(raw);
        // From here on dropping `reg` unmaps (after `regs` is unlocked: its drop takes it).
        let reg = Arc::new(Registration { engine: self.clone(), memh, base: addr, len, key });
        regs.insert((addr, len), Arc::downgrade(&reg));
        REGISTRATIONS.fetch_add(1, Ordering::Relaxed);
        Ok(reg)
    }

    /// Unpack a peer's UCX packed key on `ep` (UCX checks the bytes; a malformed key is an
    /// error status).
    pub(crate) fn rkey_unpack(&self, ep: &Ep, packed: &[u8]) -> Result<RkeyHandle> {
        let raw = lock(&self.raw);
        if ep.dead.load(Ordering::Relaxed) {
            return Err(dead_ep());
        }
        let mut rkey: sys::ucp_rkey_h = ptr::null_mut();
        // SAFETY: a live endpoint under the lock; `packed` is readable for the call (UCX copies
        // what it keeps); a valid out-pointer.
        let st = unsafe { (self.ucp.ep_rkey_unpack)(ep.raw.as_ptr(), packed.as_ptr().cast(), &mut rkey) };
        drop(raw);
        match (st, NonNull::new(rkey)) {
            (sys::ucs_status_t::UCS_OK, Some(k)) => Ok(RkeyHandle(k)),
            _ => Err(self.ucp.error("ucp_ep_rkey_unpack", st)),
        }
    }

    pub(crate) fn rkey_destroy(&self, rkey: RkeyHandle) {
        let _raw = lock(&self.raw);
        // SAFETY: a key unpacked by this worker, destroyed once (consumed), before its endpoint
        // is closed (the link destroys its keys first).
        unsafe { (self.ucp.rkey_destroy)(rkey.0.as_ptr()) };
    }

    /// Read `len` bytes at the peer's `remote` into `local` with `ucp_get_nbx`, progressing this
    /// worker until the read is done (the gscomm `Link` contract is synchronous).
    ///
    /// Why progress here rather than return and poll: a rendezvous read is one call, and the
    /// worker's lock is held around it either way; a read ends when the peer's transport has
    /// served it (over TCP the peer's progress answers it, which a peer waiting for our ATS
    /// does), when the peer fails (PEER error mode completes the request with an error), or at
    /// `timeout` (GSC_TIMEOUT: a peer that is alive but never progresses). At the deadline the
    /// endpoint is force-closed, which cancels the read, so UCX no longer writes into `local`
    /// once this returns; the link is failed with `TimedOut`.
    ///
    /// # Safety
    /// `local` must be valid for `len` bytes of writes until this returns.
    pub(crate) unsafe fn get(&self, ep: &Ep, rkey: &RkeyHandle, local: *mut u8, remote: u64, len: usize, key: &Key) -> Result<()> {
        let params = params_with_flags(0);
        let raw = lock(&self.raw);
        if ep.dead.load(Ordering::Relaxed) {
            return Err(dead_ep());
        }
        // SAFETY: a live endpoint and a key unpacked on it, under the lock; `local` is valid for
        // `len` bytes until this function returns, and it returns only once the request is
        // complete or its endpoint is force-closed (which ends the request).
        let p = unsafe { (self.ucp.get_nbx)(ep.raw.as_ptr(), local.cast(), len, remote, rkey.0.as_ptr(), &params) };
        drop(raw);
        let req = match loader::status_ptr(p) {
            StatusPtr::Done => return self.got(len),
            StatusPtr::Failed(st) => return Err(self.rma_error("ucp_get_nbx", st)),
            StatusPtr::Pending(req) => req,
        };
        let deadline = Instant::now() + self.cfg.rma_timeout;
        loop {
            let n = self.progress();
            let mut raw = lock(&self.raw);
            // SAFETY: a request of this worker not yet freed, under the lock.
            let st = unsafe { (self.ucp.request_check_status)(req.as_ptr()) };
            if st != sys::ucs_status_t::UCS_INPROGRESS {
                // SAFETY: completed, freed once.
                unsafe { (self.ucp.request_free)(req.as_ptr()) };
                drop(raw);
                return if st == sys::ucs_status_t::UCS_OK { self.got(len) } else { Err(self.rma_error("ucp_get_nbx", st)) };
            }
            // The link failed (the endpoint error callback ran during `progress`): UCX 1.13's
            // TCP does not always complete an outstanding get when its endpoint fails (seen in
            // peer_killed_during_a_get_ucx: the request stayed in progress until the deadline),
            // so the failure ends the read here, as the deadline does.
            let failed = self.with_inbox(|ib| ib.failure(key));
            if failed.is_some() || Instant::now() >= deadline {
                self.abandon_get(&mut raw, ep, req);
                drop(raw);
                let e = failed.unwrap_or_else(|| {
                    Error::new(
                        Status::TimedOut,
                        format!("UCX remote read of {len} bytes not done within {:?}; link closed", self.cfg.rma_timeout),
                    )
                });
                self.with_inbox(|ib| ib.fail(key, e.clone()));
                return Err(e);
            }
            drop(raw);
            if n == 0 {
                std::thread::yield_now();
            }
        }
    }

    /// End a get that will not complete: force-close its endpoint (which cancels the
    /// endpoint's requests, so UCX no longer writes into the read's buffer) and release the
    /// request. `dead` keeps every later call, the link's drop included, off the endpoint.
    fn abandon_get(&self, raw: &mut Raw, ep: &Ep, req: NonNull<c_void>) {
        ep.dead.store(true, Ordering::Relaxed);
        let close = params_with_flags(sys::ucp_ep_close_flags_t::UCP_EP_CLOSE_FLAG_FORCE);
        // SAFETY: a live endpoint (not dead until the line above; the caller holds the `raw`
        // lock), closed once.
        let p = unsafe { (self.ucp.ep_close_nbx)(ep.raw.as_ptr(), &close) };
        match loader::status_ptr(p) {
            StatusPtr::Pending(creq) => raw.closing.push(Closing::Ep { req: creq, ep: ep.addr() }),
            _ => self.with_inbox(|ib| ib.forget_ep(ep.addr())),
        }
        // SAFETY: our request, freed once; UCX releases it when it completes (canceled by the
        // forced close).
        unsafe { (self.ucp.request_free)(req.as_ptr()) };
    }

    fn got(&self, len: usize) -> Result<()> {
        GETS.fetch_add(1, Ordering::Relaxed);
        GET_BYTES.fetch_add(len as u64, Ordering::Relaxed);
        Ok(())
    }

    fn rma_error(&self, what: &str, st: sys::ucs_status_t::Type) -> Error {
        let e = self.ucp.error(what, st);
        // As for sends: an RMA operation fails because its endpoint did.
        match e.status() {
            Status::ConnectionReset | Status::IoError | Status::TimedOut | Status::Canceled => {
                Error::new(Status::PeerFailed, e.message().to_string())
            }
            _ => e,
        }
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
