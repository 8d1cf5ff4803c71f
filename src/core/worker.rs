//! The worker: the progress engine. It owns the links to peers, the protocol engine and the
//! request table, and executes what the protocols ask for.
//!
//! Threading: a worker is `Send + Sync`; its state sits behind one mutex, so any thread may call
//! into it (MPI_THREAD_MULTIPLE), and progress from several threads is serialized. User callbacks
//! run during progress *after* the lock is released, so a callback may call back into gscomm
//! (free its request, post the next receive) without deadlocking.

use super::address::WorkerAddress;
use super::context::{Context, random_u128};
use super::device_mem::{DeviceMem, PendingWrite, ReadStart};
use super::endpoint::Endpoint;
use super::request::{self, Callback, ReqKind, RequestParams, Slot, Started};
use super::request_area::AreaPool;
use super::staging;
use crate::condition::{Condition, Issued, Signal, Stage, StageDir};
use crate::error::{Error, Result, Status};
use crate::log::timeline::{self, Event};
use crate::protocols::{
    Action, Actions, ConnId, EagerDelivery, Engine, FrameOutcome, LaneProps, MemType, OutFrame, Payload, ProbeInfo, ProtoConfig, RecvInfo,
    ReqId, UserBuf, wire,
};
use crate::proxy::{ArmedOp, Msg, PersistentOp, Proxy};
use crate::transport::{LaneKind, Link, Listener, ProcessIdentity, loopback, shm, ucx};
use slab::Slab;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

/// How a finished operation ended.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    pub status: Status,
    pub info: RecvInfo,
}

impl Completion {
    /// `Ok(info)` for success, the status as an error otherwise.
    pub fn into_result(self) -> Result<RecvInfo> {
        if self.status == Status::Ok { Ok(self.info) } else { Err(Error::from(self.status)) }
    }
}

/// How an operation starts, given the worker's state and its request: what an armed operation
/// keeps until its condition is met (and, for persistent ones, runs again for every trigger).
pub(crate) type OpStart = Arc<dyn Fn(&mut State, ReqId, &mut Actions) -> Result<()> + Send + Sync>;

/// A persistent operation's recipe: a fresh request of `kind` on `conn` is started each time.
pub(crate) struct OpTemplate {
    kind: ReqKind,
    conn: Option<ConnId>,
    start: OpStart,
}

#[derive(Clone)]
pub struct Worker {
    pub(crate) inner: Arc<WorkerInner>,
}

pub(crate) struct WorkerInner {
    pub(crate) id: u16,
    pub(crate) uuid: u128,
    pub(crate) context: Context,
    address: Vec<u8>,
    /// This worker's UCX lane, `None` where GSC_TLS disables it, the reason where UCX could not
    /// be set up (connects that need it report that reason).
    ucx: Option<Result<ucx::UcxLane>>,
    state: Mutex<State>,
    /// The last taker of `state`'s lock, for a waiter kept waiting (the proxy's heartbeat).
    lock_holder: super::lock_watch::LockHolder,
    /// Started by the first conditioned operation; read without a lock on every later one.
    proxy: OnceLock<Proxy>,
    /// Held while the proxy is being started (two first operations at once start one).
    proxy_start: Mutex<()>,
    /// Set once by `Worker::abort`: every later operation fails with it (sticky).
    aborted: OnceLock<Error>,
    /// After the last progress pass, some link still had frames waiting for progress to leave
    /// (`Link::sending`): the proxy thread reads it without the lock to keep passing.
    lanes_sending: std::sync::atomic::AtomicBool,
}

pub(crate) struct Conn {
    link: Box<dyn Link>,
    pub(crate) generation: u32,
    outq: VecDeque<OutFrame>,
    /// The peer's process, when known (endpoints created from an address).
    pub(crate) peer_process: Option<ProcessIdentity>,
    pub(crate) props: LaneProps,
    /// Sticky: once set, the link is gone and every use reports this.
    pub(crate) failed: Option<Error>,
    /// A user endpoint refers to this connection (keep the entry after failure so the endpoint
    /// can report why).
    pub(crate) has_user_ep: bool,
    /// The user asked to close; `close_req` completes once nothing is left to send.
    closing: Option<u64>,
    /// Host sends up to this size go eager-short (from the selection table, at connect).
    short_max: Option<usize>,
    /// Frames one poll may take from the link: 1 while traffic is sparse, doubling (to
    /// `MAX_POLL_WINDOW`) while every poll fills it. Looking for a next frame that is not there
    /// yet reads the producer's newest line, a cross-core miss in the middle of a ping-pong's
    /// critical path; UCX's shared-memory FIFO adapts its poll count the same way.
    poll_window: usize,
    /// The host-staging pipeline (core/staging.rs): frames of `outq` before this index were
    /// looked at (every GPU payload among them is in a chunk), and chunks started and not yet
    /// fully sent.
    staged_upto: usize,
    chunks_staging: usize,
}

/// Most frames one poll of a link delivers.
const MAX_POLL_WINDOW: usize = 64;

pub(crate) struct State {
    pub(crate) engine: Engine,
    requests: Slab<Slot>,
    next_generation: u16,
    pub(crate) conns: Slab<Conn>,
    next_conn_generation: u32,
    listeners: Vec<Box<dyn Listener>>,
    /// Callbacks to fire once the lock is released.
    ready: Vec<Due>,
    /// Request areas for the caller (`Context::with_request_area`), pooled.
    areas: AreaPool,
    polls: u64,
    /// The connections' keys, and (next generation, count) when they were listed.
    conn_keys: Vec<ConnId>,
    conn_keys_stamp: (u32, usize),
    /// Emptied action lists kept for reuse, so the per-message path does not allocate.
    spare_actions: Vec<Actions>,
    frame_scratch: Actions,
    /// Eager-only messages that `poll_conn` matched and copied, to complete after the poll.
    deliveries: Vec<EagerDelivery>,
    last_peer_check: Instant,
    peer_check_interval: Duration,
    /// How often this side beats its links' heartbeats (`beat_period`); `None` with
    /// `GSC_HEARTBEAT_TIMEOUT=inf`.
    beat_period: Option<Duration>,
    /// A proxy thread runs and beats every `beat_period` even while the application is idle, so
    /// the beats carry a promise that peers may judge (see `Link::heartbeat`).
    beat_promise: bool,
    last_beat: Instant,
    /// GPU-memory copies (IPC reads, host staging).
    pub(crate) device: DeviceMem,
    /// Scratch for finished device reads.
    reads_done: Vec<(ReqId, Result<()>)>,
    /// Receives whose buffered data could not be copied into their (GPU) buffer: their
    /// completion reports this status.
    failed_copies: Vec<(ReqId, Status)>,
    /// Send buffers a link opened for the peer's remote reads (`Link::expose`, UCX): held
    /// until the send's request completes, then closed again (the registration is unmapped).
    pub(crate) exposed: std::collections::HashMap<ReqId, Box<dyn std::any::Any + Send>>,
    /// Prepared transfers' GPU rounds started from the host, until their kernels end.
    pub(crate) host_rounds: Vec<super::gpu_rounds::HostRoundInFlight>,
    /// Prepared pairs' shared word pages (core/prep_words.rs), polled every pass.
    pub(crate) prep_words: super::prep_words::PrepWords,
    /// `Worker::abort` ran: links peers open from now on are closed at once.
    aborted: bool,
}

/// Process-wide table from worker id (the top bits of a request handle) to worker.
fn workers() -> &'static Mutex<HashMap<u16, Weak<WorkerInner>>> {
    static WORKERS: OnceLock<Mutex<HashMap<u16, Weak<WorkerInner>>>> = OnceLock::new();
    WORKERS.get_or_init(Default::default)
}

fn register_worker_id() -> Result<u16> {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let table = workers().lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..0x7FFF {
        let id = (NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 0x7FFF + 1) as u16;
        if !table.get(&id).is_some_and(|w| w.strong_count() > 0) {
            return Ok(id);
        }
    }
    Err(Error::new(Status::NoResource, "too many live workers in this process (32767)"))
}

/// Run `f` on the worker a request handle belongs to.
pub fn worker_of_request(handle: u64) -> Result<Worker> {
    let (id, _, _) = request::decode(handle).ok_or_else(|| Error::new(Status::InvalidHandle, "not a request handle"))?;
    let table = workers().lock().unwrap_or_else(|e| e.into_inner());
    let inner = table
        .get(&id)
        .and_then(|w| w.upgrade())
        .ok_or_else(|| Error::new(Status::InvalidHandle, "request handle of a destroyed worker"))?;
    Ok(Worker { inner })
}

fn user_slice<'a>(addr: usize, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: the operation's contract (the unsafe `*_nbx` functions) is that the user buffer
    // stays valid and unmodified until the request completes, and the engine only names ranges
    // inside buffers it was given.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
}

fn copy_to_user(dst: usize, src: &[u8]) {
    if src.is_empty() {
        return;
    }
    // SAFETY: `dst..dst+len` lies inside a receive buffer the user handed to a still-pending
    // operation (the engine clips every copy to the buffer's length).
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
}

/// Deliver received bytes into a user buffer: a plain copy for host memory, staged through our
/// copy stream for GPU memory.
fn copy_in(device: &mut DeviceMem, dst: usize, mem: MemType, src: &[u8]) -> Result<()> {
    match mem {
        MemType::Host => {
            copy_to_user(dst, src);
            Ok(())
        }
        MemType::Cuda if src.is_empty() => Ok(()),
        MemType::Cuda => device.stage_in(dst, src),
    }
}

impl Worker {
    pub(crate) fn new(context: Context) -> Result<Worker> {
        let cfg = &context.inner.config;
        let uuid = random_u128()?;
        let mut listeners: Vec<Box<dyn Listener>> = Vec::new();
        if cfg.tls.contains(&LaneKind::Loopback) {
            listeners.push(Box::new(loopback::LoopbackListener::new(uuid)));
        }
        if cfg.tls.contains(&LaneKind::Shm) {
            listeners.push(Box::new(shm::ShmListener::new(&shm_config(cfg), uuid)?));
        }
        let ucx = if cfg.tls.contains(&LaneKind::Ucx) {
            match ucx::UcxLane::new(&ucx::UcxConfig::of(&context.inner.config), uuid) {
                Ok(lane) => {
                    listeners.push(Box::new(lane.listener()));
                    Some(Ok(lane))
                }
                // Without shm, UCX is the only way to another process: asked for, so required.
                Err(e) if !cfg.tls.contains(&LaneKind::Shm) => return Err(e.context("GSC_TLS enables no lane but UCX to other processes")),
                Err(e) => {
                    // Every other lane works; a peer that needs UCX gets this reason at connect.
                    tracing::info!(target: "gsc::core", error = %e, "UCX lane unavailable");
                    Some(Err(e))
                }
            }
        } else {
            None
        };
        let address = WorkerAddress {
            uuid,
            host_id: context.inner.host_id,
            process: context.inner.process,
            lanes: listeners.iter().map(|l| (l.lane(), l.address_blob())).collect(),
        }
        .pack();
        let proto = ProtoConfig { eager_short_max: cfg.eager_short_max, rndv_thresh: cfg.rndv_thresh, rndv_scheme: cfg.rndv_scheme };
        let state = State {
            engine: Engine::new(proto),
            requests: Slab::new(),
            next_generation: 0,
            conns: Slab::new(),
            next_conn_generation: 1,
            listeners,
            ready: Vec::new(),
            areas: AreaPool::new(context.inner.request_area),
            polls: 0,
            conn_keys: Vec::new(),
            conn_keys_stamp: (0, 0),
            spare_actions: Vec::new(),
            frame_scratch: Actions::new(),
            deliveries: Vec::new(),
            last_peer_check: Instant::now(),
            peer_check_interval: cfg.peer_check_interval,
            beat_period: cfg.heartbeat_timeout.map(beat_period),
            beat_promise: false,
            last_beat: Instant::now(),
            device: DeviceMem::new(cfg),
            reads_done: Vec::new(),
            failed_copies: Vec::new(),
            exposed: std::collections::HashMap::new(),
            host_rounds: Vec::new(),
            prep_words: super::prep_words::PrepWords::new(cfg.prep_words),
            aborted: false,
        };
        let id = register_worker_id()?;
        let inner = Arc::new(WorkerInner {
            id,
            uuid,
            context,
            address,
            ucx,
            state: Mutex::new(state),
            lock_holder: Default::default(),
            proxy: OnceLock::new(),
            proxy_start: Mutex::new(()),
            aborted: OnceLock::new(),
            lanes_sending: std::sync::atomic::AtomicBool::new(false),
        });
        workers().lock().unwrap_or_else(|e| e.into_inner()).insert(id, Arc::downgrade(&inner));
        tracing::debug!(target: "gsc::core", worker = id, "worker created");
        Ok(Worker { inner })
    }

    pub fn context(&self) -> &Context {
        &self.inner.context
    }

    /// The packed address peers use to create endpoints to this worker.
    pub fn address(&self) -> &[u8] {
        &self.inner.address
    }

    #[track_caller]
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock (a bug) must not turn every later call into a panic.
        let guard = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
        self.inner.lock_holder.took(std::panic::Location::caller());
        guard
    }

    /// Create an endpoint to the worker whose packed address is `address`.
    pub fn connect(&self, address: &[u8]) -> Result<Endpoint> {
        self.check_aborted()?;
        let peer = WorkerAddress::unpack(address)?;
        let ctx = &self.inner.context.inner;
        let cfg = &ctx.config;
        let same_process = peer.process == ctx.process;
        let same_host = peer.host_id == ctx.host_id;
        let ucx_blob = peer.lane_blob(LaneKind::Ucx).filter(|_| cfg.tls.contains(&LaneKind::Ucx));
        // Lane choice, per peer: loopback within this process, shm within this host (and
        // network namespace), UCX otherwise, or where shm cannot reach the peer after all (a
        // container with its own /dev/shm).
        // Loopback needs the same host too: workers of one process given different
        // GSC_FAKE_HOST labels (tests) must reach each other the way other hosts do.
        let link: Box<dyn Link> = if cfg.tls.contains(&LaneKind::Loopback) && same_process && same_host && loopback::is_local(peer.uuid) {
            loopback::connect(peer.uuid, self.inner.uuid)?
        } else if let (true, true, Some(blob)) = (cfg.tls.contains(&LaneKind::Shm), same_host, peer.lane_blob(LaneKind::Shm)) {
            match shm::connect(blob, self.inner.uuid, &shm_config(cfg)) {
                Ok(link) => link,
                Err(e) if e.status() == Status::Unreachable && ucx_blob.is_some() && matches!(self.inner.ucx, Some(Ok(_))) => {
                    tracing::debug!(target: "gsc::core", error = %e, "shm cannot reach the peer; using UCX");
                    self.connect_ucx(ucx_blob.expect("checked"))?
                }
                Err(e) => return Err(e),
            }
        } else if let Some(blob) = ucx_blob {
            self.connect_ucx(blob)?
        } else {
            return Err(Error::new(
                Status::Unreachable,
                format!(
                    "no enabled lane reaches that worker (enabled: {}; peer offers: {}; same host: {same_host}, same process: {same_process}{})",
                    cfg.tls.iter().map(|l| l.name()).collect::<Vec<_>>().join(","),
                    peer.lanes.iter().map(|(l, _)| l.name()).collect::<Vec<_>>().join(","),
                    match &self.inner.ucx {
                        Some(Err(e)) => format!("; UCX unavailable here: {}", e.message()),
                        _ => String::new(),
                    }
                ),
            ));
        };
        let mut st = self.lock();
        let (conn, generation) = st.add_conn(link, peer.uuid, Some(peer.process), true);
        tracing::debug!(target: "gsc::core", conn, lane = st.conns[conn].props.lane.name(), "endpoint created");
        drop(st);
        Ok(Endpoint::new(self.clone(), conn, generation))
    }

    /// A link over this worker's UCX lane to the worker whose UCX address blob is `blob`.
    fn connect_ucx(&self, blob: &[u8]) -> Result<Box<dyn Link>> {
        match &self.inner.ucx {
            Some(Ok(lane)) => lane.connect(blob),
            Some(Err(e)) => Err(e.clone().context("the peer is reachable only over UCX, which is unavailable here")),
            None => Err(Error::new(Status::Unreachable, "the peer is reachable only over UCX, which GSC_TLS disables")),
        }
    }

    /// Make progress: accept connections, move frames, complete requests, fire callbacks.
    /// Returns the number of events handled (0 = nothing happened).
    pub fn progress(&self) -> usize {
        match self.inner.proxy.get().and_then(|p| p.run_in_caller(self)) {
            Some(events) => events,
            None => self.progress_core(),
        }
    }

    /// `progress` without running a caller-run proxy (`GSC_PROXY_THREAD=off`): what a proxy
    /// pass itself calls.
    pub(crate) fn progress_core(&self) -> usize {
        let (n, ready) = {
            let mut st = self.lock();
            let n = st.progress(&self.inner.context);
            // Only UCX links hold frames back (`Link::sending`): workers without the lane skip
            // the look on this hot path.
            if matches!(self.inner.ucx, Some(Ok(_))) {
                let sending = st.conns.iter().any(|(_, c)| c.failed.is_none() && c.link.sending());
                self.inner.lanes_sending.store(sending, std::sync::atomic::Ordering::Relaxed);
            }
            (n, std::mem::take(&mut st.ready))
        };
        self.fire(ready);
        n
    }

    /// Some link had frames waiting for progress to leave after the last pass (`Link::sending`).
    pub(crate) fn lanes_sending(&self) -> bool {
        self.inner.lanes_sending.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Run `f` under the lock with an action list, execute what it emitted (also on error: the
    /// engines emit nothing before their checks pass), then fire the callbacks that became due.
    /// The lock's holder is recorded at the caller's call site (`lock_watch`).
    #[track_caller]
    pub(crate) fn with_state<R>(&self, f: impl FnOnce(&mut State, &mut Actions) -> Result<R>) -> Result<R> {
        let (result, ready) = {
            let mut st = self.lock();
            let mut actions = st.take_actions();
            let result = f(&mut st, &mut actions);
            st.execute(&self.inner.context, actions);
            (result, std::mem::take(&mut st.ready))
        };
        self.fire(ready);
        result
    }

    /// Send `buf` as one eager-short frame written straight into the link, when that is what the
    /// general path would do and can do now: the endpoint usable, the protocol eager-short, no
    /// frame queued before it (order), room in the link. True when sent; false changes nothing
    /// and the caller takes the general path (which also reports any error).
    pub(super) fn try_send_short(&self, key: super::endpoint::EpKey, tag: u64, buf: UserBuf) -> bool {
        let mut st = self.lock();
        let Ok(conn) = key.usable(&st) else { return false };
        let c = &mut st.conns[conn];
        if c.short_max.is_none_or(|max| buf.len > max) || !c.outq.is_empty() {
            return false;
        }
        let header = wire::eager_only_header(tag);
        if let Ok(true) = c.link.try_send(&[&header, user_slice(buf.addr, buf.len)]) {
            timeline::record(Event::FrameOut, header[0] as u64);
            return true;
        }
        false
    }

    /// Start an operation under the lock: allocate its request, run `start`, execute what it
    /// emitted, and decide between immediate completion and a pending handle. With a condition,
    /// the operation is armed instead and `start` runs when the condition is met.
    pub(crate) fn start_op(
        &self,
        kind: ReqKind,
        conn: Option<ConnId>,
        params: RequestParams,
        start: impl Fn(&mut State, ReqId, &mut Actions) -> Result<()> + Send + Sync + 'static,
    ) -> Result<Started> {
        self.start_staged_op(kind, conn, params, None, start)
    }

    /// `start_op` for an operation that may be staged (`stage`, from `stage_for`; `start` then
    /// works on the slot's host memory instead of the GPU buffer).
    pub(crate) fn start_staged_op(
        &self,
        kind: ReqKind,
        conn: Option<ConnId>,
        mut params: RequestParams,
        stage: Option<Arc<Stage>>,
        start: impl Fn(&mut State, ReqId, &mut Actions) -> Result<()> + Send + Sync + 'static,
    ) -> Result<Started> {
        self.check_aborted()?;
        if let Some(cond) = params.condition.take() {
            return self.arm(kind, conn, params, cond, stage, Arc::new(start));
        }
        debug_assert!(stage.is_none(), "only conditioned operations are staged");
        let RequestParams { callback, no_immediate_completion, .. } = params;
        // Callbacks that will not run are dropped only after the lock is released: a user
        // closure may own objects (an Endpoint) whose Drop takes this worker's lock.
        let mut unused: Vec<Callback> = Vec::new();
        let (started, ready) = {
            let mut st = self.lock();
            let req = st.alloc_request(self.inner.id, kind, conn, callback);
            let mut actions = st.take_actions();
            if let Err(e) = start(&mut st, req, &mut actions) {
                // Nothing was emitted on error paths (the engine checks before it acts), so the
                // request simply disappears: the call changed nothing.
                debug_assert!(actions.is_empty());
                unused.extend(st.slot_mut(req).and_then(|s| s.callback.take()));
                st.free_slot(req);
                st.give_actions(actions);
                drop(st);
                drop(unused);
                return Err(e);
            }
            st.execute(&self.inner.context, actions);
            let started = match st.slot(req).and_then(|s| s.result) {
                // Completed successfully inside the call: UCP's NULL status pointer, no callback.
                // A failure inside the call (e.g. truncation) stays a request, so the caller gets
                // its status *and* its receive info the usual way.
                Some((Status::Ok, info)) if !no_immediate_completion => {
                    if let Some(i) = st.ready.iter().position(|d| d.req == req) {
                        unused.push(st.ready.remove(i).callback);
                    }
                    st.free_slot(req);
                    Started::Done(info)
                }
                _ => Started::Pending(req),
            };
            (started, std::mem::take(&mut st.ready))
        };
        drop(unused);
        self.fire(ready);
        Ok(started)
    }

    /// Arm an operation on `cond`: the proxy starts it when the condition's trigger fires.
    fn arm(
        &self,
        kind: ReqKind,
        conn: Option<ConnId>,
        params: RequestParams,
        cond: Condition,
        stage: Option<Arc<Stage>>,
        start: OpStart,
    ) -> Result<Started> {
        if kind == ReqKind::Close {
            return Err(Error::unsupported("closing an endpoint under a condition is not supported; close it on the host"));
        }
        // The endpoint must be usable now; a failure at trigger time is reported through the
        // request and the condition.
        if let Some(c) = conn {
            let st = self.lock();
            match st.conns.get(c) {
                Some(c) if c.failed.is_none() => {}
                Some(c) => return Err(c.failed.clone().expect("checked").context("endpoint unusable")),
                None => return Err(Error::new(Status::NotConnected, "endpoint closed")),
            }
        }
        self.ensure_proxy()?;
        // Data our kernels do not stage themselves, read by the proxy or a peer after the
        // trigger: a fence in our trigger kernel orders the producer's writes of it first.
        let orders = matches!(kind, ReqKind::Send | ReqKind::Put) && stage.is_none();
        // Counted from before the stream waits on the proxy (`proxy::outstanding`).
        let issuing = crate::proxy::outstanding::issuing();
        match cond.issue(!params.no_stream_wait, stage.as_ref(), orders)? {
            Issued::Sequenced(channel, seq) => {
                let req = {
                    let mut st = self.lock();
                    // An abort between the check at the top and here has scanned the armed
                    // requests already: this one must not be armed, and the producer given the
                    // trigger and wait for it must be released.
                    if let Some(e) = self.inner.aborted.get() {
                        drop(st);
                        channel.fail(e.clone());
                        return Err(e.clone());
                    }
                    let req = st.alloc_request(self.inner.id, kind, conn, params.callback);
                    let slot = st.slot_mut(req).expect("just allocated");
                    slot.signal = Some(Signal::new(channel.clone(), seq).with_stage(stage.clone()));
                    slot.armed = true;
                    req
                };
                timeline::record(Event::Issue, req as u64);
                let stage = stage.filter(|s| s.dir == StageDir::Send);
                self.send_to_proxy(Msg::Arm(ArmedOp { channel, seq, req, start, stage }), issuing);
                Ok(Started::Pending(req))
            }
            Issued::Persistent(channel, outputs) => {
                timeline::record(Event::Issue, 0);
                let template = OpTemplate { kind, conn, start };
                let started = channel.base;
                self.send_to_proxy(Msg::Persist(PersistentOp { channel, template, started }), issuing);
                Ok(Started::Armed(outputs))
            }
        }
    }

    fn ensure_proxy(&self) -> Result<()> {
        if self.inner.proxy.get().is_some() {
            return Ok(());
        }
        let _starting = self.inner.proxy_start.lock().unwrap_or_else(|e| e.into_inner());
        if self.inner.proxy.get().is_none() {
            let cfg = &self.inner.context.inner.config;
            let beat = cfg.heartbeat_timeout.map(beat_period);
            let proxy = if cfg.proxy_thread {
                Proxy::spawn(Arc::downgrade(&self.inner), cfg.proxy_spin, cfg.proxy_poll, beat)?
            } else {
                Proxy::in_caller(Arc::downgrade(&self.inner))
            };
            let thread = cfg.proxy_thread;
            // Under `proxy_start` nobody else sets it: this is the one proxy.
            let _ = self.inner.proxy.set(proxy);
            if thread {
                // Only a thread beats while the application is idle; a caller-run proxy
                // (GSC_PROXY_THREAD=off) beats only when called, so it promises nothing.
                self.lock().promise_heartbeat();
            }
        }
        Ok(())
    }

    /// The proxy runs for the worker's whole life once started; a send can only fail if its
    /// thread died (a bug), and then the operation's signal reports it canceled when dropped.
    /// Tests: the proxy's next pass panics (`Proxy::inject_panic`); false when this worker has
    /// no proxy yet.
    #[cfg(test)]
    pub(crate) fn inject_proxy_panic(&self) -> bool {
        self.inner.proxy.get().map(Proxy::inject_panic).is_some()
    }

    fn send_to_proxy(&self, msg: Msg, issuing: crate::proxy::outstanding::Issuing) {
        match self.inner.proxy.get().map_or(Err(Error::new(Status::Internal, "no proxy")), |p| p.send(msg)) {
            Ok(()) => issuing.handed(),
            Err(e) => tracing::error!(target: "gsc::proxy", error = %e, "could not hand an armed operation to the proxy"),
        }
    }

    /// Proxy side: the condition of armed request `req` was met; start it now, or, when it
    /// cannot start (`failed`: a staged send's bytes never arrived), complete it with that error.
    pub(crate) fn start_armed(&self, req: ReqId, start: &OpStart, failed: Option<Error>) {
        let failed = failed.or_else(|| self.inner.aborted.get().cloned());
        let ready = {
            let mut st = self.lock();
            match st.slot_mut(req) {
                Some(slot) if slot.armed => {
                    slot.armed = false;
                    slot.started_at = Some(Instant::now());
                }
                _ => return,
            }
            let mut actions = st.take_actions();
            let started = match failed {
                Some(e) => Err(e),
                None => start(&mut st, req, &mut actions),
            };
            if let Err(e) = started {
                tracing::debug!(target: "gsc::proxy", req, error = %e, "armed operation failed to start");
                actions.push(Action::Complete { req, status: e.status(), info: RecvInfo::default() });
            }
            st.execute(&self.inner.context, actions);
            std::mem::take(&mut st.ready)
        };
        self.fire(ready);
    }

    /// Proxy side: a persistent operation's trigger advanced; run one more instance of it (or
    /// complete that instance with `failed`, as for `start_armed`).
    pub(crate) fn start_epoch(&self, template: &OpTemplate, signal: Signal, failed: Option<Error>) {
        let failed = failed.or_else(|| self.inner.aborted.get().cloned());
        let ready = {
            let mut st = self.lock();
            let req = st.alloc_request(self.inner.id, template.kind, template.conn, None);
            let slot = st.slot_mut(req).expect("just allocated");
            slot.released = true;
            slot.signal = Some(signal);
            slot.started_at = Some(Instant::now());
            let mut actions = st.take_actions();
            let started = match failed {
                Some(e) => Err(e),
                None => (template.start)(&mut st, req, &mut actions),
            };
            if let Err(e) = started {
                tracing::debug!(target: "gsc::proxy", error = %e, "persistent operation failed to start");
                actions.push(Action::Complete { req, status: e.status(), info: RecvInfo::default() });
            }
            st.execute(&self.inner.context, actions);
            std::mem::take(&mut st.ready)
        };
        self.fire(ready);
    }

    /// Before a send of GPU memory on `conn`: make the copy stream exist and the IPC key the
    /// RTS will carry (see `DeviceMem::send_key`).
    pub(crate) fn prepare_gpu_send(&self, conn: ConnId, addr: usize, len: usize) -> Result<Option<Vec<u8>>> {
        let (lane, ipc) = {
            let mut st = self.lock();
            st.device.prepare_for(addr)?;
            let lane = st.conns.get(conn).map(|c| c.props.lane).ok_or_else(|| Error::new(Status::NotConnected, "endpoint closed"))?;
            if lane == LaneKind::Ucx || st.device.ipc == crate::config::Tristate::Off {
                // The data will be staged through host memory: bounce buffers made here, on
                // the user's thread, not by the proxy.
                let links = st.staging_links();
                st.device.reserve_staging(addr, links)?;
            }
            (lane, st.device.ipc)
        };
        Ok(DeviceMem::send_key(ipc, lane, addr, len))
    }

    /// Post a tagged receive of up to `len` bytes at `buf` for messages matching `(tag, mask)`.
    ///
    /// # Safety
    /// `buf` must be valid for `len` bytes of writes until the request completes (or is
    /// canceled), and not accessed by the caller in the meantime.
    pub unsafe fn tag_recv_nbx(&self, buf: *mut u8, len: usize, tag: u64, tag_mask: u64, mut params: RequestParams) -> Result<Started> {
        self.check_aborted()?;
        check_buffer(buf as *const u8, len, "tag_recv_nbx")?;
        let mem = resolve_memtype(&params, buf as usize, len)?;
        // The common receive (host buffer, no condition, no message waiting for it) is posted
        // under one lock with no action list, the counterpart of the send fast path.
        if mem == MemType::Host
            && params.condition.is_none()
            && let Some(started) = self.try_post_recv(tag, tag_mask, UserBuf::host(buf as usize, len), &mut params)
        {
            return Ok(started);
        }
        let (stage, user) = self.recv_buffer(&params, buf as usize, len, mem)?;
        self.start_staged_op(ReqKind::Recv, None, params, stage, move |st, req, out| {
            st.engine.tag.recv(out, req, tag, tag_mask, user);
            Ok(())
        })
    }

    /// Post a host receive when no message that matches it is here yet; `None` (the callback
    /// still in `params`) otherwise, for the general path.
    fn try_post_recv(&self, tag: u64, tag_mask: u64, buf: UserBuf, params: &mut RequestParams) -> Option<Started> {
        let mut st = self.lock();
        if st.engine.tag.has_unexpected_match(tag, tag_mask) {
            return None;
        }
        let req = st.alloc_request(self.inner.id, ReqKind::Recv, None, params.callback.take());
        st.engine.tag.post(req, tag, tag_mask, buf);
        Some(Started::Pending(req))
    }

    /// Where a receive into `addr..addr+len` of memory type `mem` lands: a staging slot (a small
    /// GPU buffer of a stream or graph operation), or the buffer itself.
    fn recv_buffer(&self, params: &RequestParams, addr: usize, len: usize, mem: MemType) -> Result<(Option<Arc<Stage>>, UserBuf)> {
        let stage = self.stage_for(params, StageDir::Recv, addr, len, mem)?;
        Ok(match stage {
            Some(s) => {
                let user = UserBuf { addr: s.host_data(), len, mem: MemType::Host };
                (Some(s), user)
            }
            None => {
                if mem == MemType::Cuda {
                    let mut st = self.lock();
                    st.device.prepare_for(addr)?;
                    // Data from a link that cannot reach GPU memory comes staged; the sender is
                    // not known yet, so any such link (or IPC off) is reason enough.
                    let links = st.staging_links();
                    if links > 0 || st.device.ipc == crate::config::Tristate::Off {
                        st.device.reserve_staging(addr, links)?;
                    }
                }
                (None, UserBuf { addr, len, mem })
            }
        })
    }

    /// The staging slot of a conditioned operation on GPU memory, when it is staged (see
    /// `condition::Stage`).
    pub(crate) fn stage_for(
        &self,
        params: &RequestParams,
        dir: StageDir,
        addr: usize,
        len: usize,
        mem: MemType,
    ) -> Result<Option<Arc<Stage>>> {
        match (&params.condition, mem) {
            (Some(cond), MemType::Cuda) => cond.stage_for(dir, addr, len, self.inner.context.inner.config.cuda_stage_max),
            _ => Ok(None),
        }
    }

    /// Receive a message taken with `tag_probe(.., remove = true)`.
    ///
    /// # Safety
    /// As for `tag_recv_nbx`.
    pub unsafe fn tag_msg_recv_nbx(&self, buf: *mut u8, len: usize, msg: u64, params: RequestParams) -> Result<Started> {
        check_buffer(buf as *const u8, len, "tag_msg_recv_nbx")?;
        let mem = resolve_memtype(&params, buf as usize, len)?;
        let (stage, user) = self.recv_buffer(&params, buf as usize, len, mem)?;
        self.start_staged_op(ReqKind::Recv, None, params, stage, move |st, req, out| st.engine.tag.msg_recv(out, req, msg, user))
    }

    /// Blocking receive into `buf` (progresses until done or `GSC_TIMEOUT`).
    pub fn tag_recv(&self, buf: &mut [u8], tag: u64, tag_mask: u64) -> Result<Completion> {
        // SAFETY: `buf` is borrowed mutably for the whole call and the request is waited for (or
        // canceled on timeout) before returning.
        let started = unsafe { self.tag_recv_nbx(buf.as_mut_ptr(), buf.len(), tag, tag_mask, RequestParams::default())? };
        self.finish_blocking(started, OnTimeout::Withdraw)
    }

    /// Is there an unexpected message matching `(tag, mask)`? Progresses once first.
    pub fn tag_probe(&self, tag: u64, tag_mask: u64, remove: bool) -> Option<ProbeInfo> {
        self.progress();
        self.lock().engine.tag.probe(tag, tag_mask, remove)
    }

    /// Wait for a pending request during a blocking call. On timeout nothing may keep referring
    /// to the caller's buffer after the call returns: a receive that has not matched is canceled;
    /// anything else that is still in flight (a send, a matched receive) ends its endpoint's link,
    /// which drops the queued frames and the protocol state naming the buffer. Requests that hold
    /// no user buffer (flush, close) are simply released.
    pub(crate) fn finish_blocking(&self, started: Started, on_timeout: OnTimeout) -> Result<Completion> {
        let handle = match started {
            Started::Done(info) => return Ok(Completion { status: Status::Ok, info }),
            Started::Armed(_) => return Err(Error::new(Status::Internal, "a blocking call armed a persistent operation")),
            Started::Pending(h) => h,
        };
        let r = self.request_wait(handle);
        if matches!(&r, Err(e) if e.status() == Status::TimedOut)
            && on_timeout == OnTimeout::Withdraw
            && self.request_cancel(handle).is_err()
        {
            self.break_link_of(handle);
        }
        let _ = self.request_release(handle);
        r
    }

    /// End the link a request depends on, failing it and everything else on that link.
    fn break_link_of(&self, handle: u64) {
        let ready = {
            let mut st = self.lock();
            // Another thread's progress may have completed the request since the wait gave up:
            // then nothing refers to the buffer any more and the link must stay up.
            if st.slot(handle).is_none_or(|s| s.result.is_some()) {
                return;
            }
            let conn = st.slot(handle).and_then(|s| s.conn).or_else(|| st.engine.tag.conn_of(handle));
            let mut out = Actions::new();
            if let Some(conn) = conn {
                let e = Error::new(
                    Status::TimedOut,
                    "a blocking operation timed out (GSC_TIMEOUT); the endpoint was closed so no buffer stays in use",
                );
                st.fail_conn(conn, e, &mut out);
            }
            st.execute(&self.inner.context, out);
            std::mem::take(&mut st.ready)
        };
        self.fire(ready);
    }

    /// The request's result if it completed, `None` while it is in progress.
    pub fn request_test(&self, handle: u64) -> Result<Option<Completion>> {
        let st = self.lock();
        let slot = st.checked_slot(self.inner.id, handle)?;
        Ok(slot.result.map(|(status, info)| Completion { status, info }))
    }

    /// Progress until the request completes, or `GSC_TIMEOUT` passes (`TimedOut`; the request
    /// stays valid and can be waited on again, canceled or released).
    pub fn request_wait(&self, handle: u64) -> Result<Completion> {
        let timeout = self.inner.context.inner.config.timeout;
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let (events, done) = self.progress_and_test(handle)?;
            if let Some(c) = done {
                return Ok(c);
            }
            if events == 0 {
                spins += 1;
                if spins % 1024 == 0 {
                    if let Some(t) = timeout
                        && start.elapsed() >= t
                    {
                        return Err(Error::new(Status::TimedOut, format!("request not complete after {t:?} (GSC_TIMEOUT)")));
                    }
                    std::thread::yield_now();
                }
            }
        }
    }

    /// One progress pass and a test of `handle` under a single lock acquisition (the wait loop's
    /// step: two acquisitions per spin were a visible share of small-message latency).
    pub fn progress_and_test(&self, handle: u64) -> Result<(usize, Option<Completion>)> {
        // A caller-run proxy's pass progresses the worker too; then only the test is left.
        if let Some(events) = self.inner.proxy.get().and_then(|p| p.run_in_caller(self)) {
            return Ok((events, self.request_test(handle)?));
        }
        let (events, done, ready) = {
            let mut st = self.lock();
            let first = st.checked_slot(self.inner.id, handle)?.result;
            let events = if first.is_some() { 0 } else { st.progress(&self.inner.context) };
            let done = match first {
                Some(r) => Some(r),
                None => st.checked_slot(self.inner.id, handle)?.result,
            };
            (events, done.map(|(status, info)| Completion { status, info }), std::mem::take(&mut st.ready))
        };
        self.fire(ready);
        Ok((events, done))
    }

    /// The caller's space of a request (`Context::with_request_area`): valid until the request
    /// is freed (and during its callback). An error when the context has none or the handle is
    /// not a live request of this worker.
    pub fn request_area(&self, handle: u64) -> Result<*mut std::ffi::c_void> {
        let st = self.lock();
        // A released handle whose request completed is still alive while its callback runs
        // (`Due::then_free`); that callback may ask for the area.
        let slot = match st.checked_slot(self.inner.id, handle) {
            Ok(slot) => slot,
            Err(e) => match request::decode(handle).filter(|(w, ..)| *w == self.inner.id).and_then(|_| st.slot(handle)) {
                Some(slot) if slot.released && slot.result.is_some() => slot,
                _ => return Err(e),
            },
        };
        slot.area
            .as_ref()
            .map(|a| a.as_ptr())
            .ok_or_else(|| Error::new(Status::Unsupported, "requests carry no area: the context was created without a request size"))
    }

    /// Give the handle back. A pending request still completes (its callback fires), then its
    /// slot is recycled; the handle is invalid from now on.
    pub fn request_release(&self, handle: u64) -> Result<()> {
        let mut st = self.lock();
        let slot = st.checked_slot_mut(self.inner.id, handle)?;
        if slot.released {
            return Err(Error::new(Status::InvalidHandle, "request already released"));
        }
        if slot.result.is_some() {
            st.free_slot(handle);
        } else {
            slot.released = true;
        }
        Ok(())
    }

    /// Cancel a receive that has not matched a message; it completes with `Canceled`.
    pub fn request_cancel(&self, handle: u64) -> Result<()> {
        let ready = {
            let mut st = self.lock();
            let slot = st.checked_slot(self.inner.id, handle)?;
            if slot.result.is_some() {
                return Err(Error::new(Status::InvalidParam, "request already completed; nothing to cancel"));
            }
            if slot.kind != ReqKind::Recv {
                return Err(Error::new(Status::Unsupported, "only receives can be canceled; sends and RMA have started moving data"));
            }
            if slot.armed {
                return Err(Error::new(Status::Busy, "the receive waits for its condition; it cannot be canceled before it starts"));
            }
            let mut out = Actions::new();
            st.engine.tag.cancel(&mut out, handle)?;
            st.execute(&self.inner.context, out);
            std::mem::take(&mut st.ready)
        };
        self.fire(ready);
        Ok(())
    }

    /// Abort the worker (issue #8, docs/ARCHITECTURE.md "Failures"): from any thread, at any time,
    /// without its peers. Every operation in flight or armed on a condition fails with
    /// `Aborted` naming `reason` — streams and graphs waiting for one are released with an
    /// error mark — every link is closed, and every later operation on the worker fails at once
    /// with the same error (sticky; `aborted()` returns it). Idempotent: a second abort changes
    /// nothing. Returns within about a second even if the proxy thread is stuck.
    pub fn abort(&self, reason: &str) -> Result<()> {
        let error = Error::new(Status::Aborted, format!("the worker was aborted: {reason}"));
        if self.inner.aborted.set(error.clone()).is_err() {
            return Ok(());
        }
        tracing::warn!(target: "gsc::core", worker = self.inner.id, reason, "worker aborted");
        let ready = {
            let mut st = self.lock();
            st.aborted = true;
            let mut out = st.take_actions();
            let conns: Vec<ConnId> = st.conns.iter().map(|(k, _)| k).collect();
            for conn in conns {
                st.fail_conn(conn, error.clone(), &mut out);
            }
            // Receives from any peer are on no link: fail them too.
            st.engine.tag.fail_posted(&mut out, Status::Aborted);
            // Operations still waiting for their condition: complete their requests (their
            // signals release the producers); the proxy drops them below, and would not start
            // one that is no longer armed anyway.
            let armed: Vec<ReqId> = st.armed_requests(self.inner.id);
            for req in armed {
                if let Some(slot) = st.slot_mut(req) {
                    slot.armed = false;
                }
                out.push(Action::Complete { req, status: Status::Aborted, info: RecvInfo::default() });
            }
            st.execute(&self.inner.context, out);
            std::mem::take(&mut st.ready)
        };
        self.fire(ready);
        if let Some(proxy) = self.inner.proxy.get() {
            proxy.abort(error, Duration::from_secs(1));
        }
        Ok(())
    }

    /// Proxy side (issue #8, promise 1): conditioned operations started more than `GSC_TIMEOUT`
    /// ago and not complete — their producer (a stream, a graph) is waiting for them, and
    /// nothing else would end the wait when a peer stops answering without dying — fail with
    /// `TimedOut`. A receive still waiting for its message is withdrawn; an operation moving
    /// data on a link ends that link (as a timed-out blocking send does: nothing is left naming
    /// the buffers), failing what else needs it. Returns how many it expired.
    pub(crate) fn expire_stream_ops(&self) -> usize {
        let Some(timeout) = self.inner.context.inner.config.timeout else { return 0 };
        let (expired, ready) = {
            let mut st = self.lock();
            st.report_slow_conditioned(self.inner.id, timeout / 2);
            let overdue: Vec<(ReqId, ReqKind, Option<ConnId>)> = st.overdue_conditioned(self.inner.id, timeout);
            if overdue.is_empty() {
                return 0;
            }
            let mut out = st.take_actions();
            for &(req, kind, conn) in &overdue {
                let state = st.describe_stuck(req, conn);
                tracing::warn!(target: "gsc::proxy", req, ?kind, state = %state, "a stream-ordered operation timed out");
                let conn = match kind {
                    ReqKind::Recv => match st.engine.tag.expire_recv(&mut out, req, Status::TimedOut) {
                        Some(None) => continue, // withdrawn and completed
                        Some(Some(conn)) => Some(conn),
                        None => None,
                    },
                    _ => conn,
                };
                match conn {
                    Some(conn) if st.conns.get(conn).is_some_and(|c| c.failed.is_none()) => {
                        let e = Error::new(
                            Status::TimedOut,
                            format!(
                                "a stream-ordered operation made no progress for {timeout:?} (GSC_TIMEOUT): is the peer stopped? ({state})"
                            ),
                        );
                        st.fail_conn(conn, e, &mut out);
                    }
                    // On no link, or one already failed (a worker flush, a protocol state the
                    // link's failure did not reach): complete it here, or it would be listed
                    // again on every check.
                    _ => out.push(Action::Complete { req, status: Status::TimedOut, info: RecvInfo::default() }),
                }
            }
            tracing::warn!(target: "gsc::proxy", count = overdue.len(), ?timeout, "stream-ordered operations timed out");
            st.execute(&self.inner.context, out);
            (overdue.len(), std::mem::take(&mut st.ready))
        };
        self.fire(ready);
        expired
    }

    /// The abort error, once `abort` was called.
    pub fn aborted(&self) -> Option<Error> {
        self.inner.aborted.get().cloned()
    }

    pub(crate) fn check_aborted(&self) -> Result<()> {
        match self.inner.aborted.get() {
            None => Ok(()),
            Some(e) => Err(e.clone()),
        }
    }

    /// Flush every endpoint of this worker: completes when every earlier operation on every
    /// link was applied at its peer.
    pub fn flush_nbx(&self, params: RequestParams) -> Result<Started> {
        let inner = self.inner.clone();
        self.start_op(ReqKind::Flush, None, params, move |st, req, out| {
            let conns: Vec<ConnId> = st.conns.iter().filter(|(_, c)| c.failed.is_none() && c.closing.is_none()).map(|(k, _)| k).collect();
            if conns.is_empty() {
                out.push(Action::Complete { req, status: Status::Ok, info: RecvInfo::default() });
                return Ok(());
            }
            st.slot_mut(req).expect("just allocated").pending_parts = conns.len();
            for conn in conns {
                let part = st.alloc_request(inner.id, ReqKind::FlushPart { parent: req }, Some(conn), None);
                st.slot_mut(part).expect("just allocated").released = true;
                st.engine.rma.flush(out, conn, part);
            }
            Ok(())
        })
    }

    /// Blocking worker flush.
    pub fn flush(&self) -> Result<()> {
        let s = self.flush_nbx(RequestParams::default())?;
        self.finish_blocking(s, OnTimeout::Release)?.into_result().map(|_| ())
    }

    /// Requests in progress (not yet completed), unexpected messages held and the proxy
    /// thread's work so far, for diagnostics.
    pub fn stats(&self) -> WorkerStats {
        let proxy = self.inner.proxy.get().map(Proxy::activity).unwrap_or_default();
        let st = self.lock();
        WorkerStats {
            requests: st.requests.len(),
            in_progress: st.requests.iter().filter(|(_, s)| s.result.is_none()).count(),
            unexpected: st.engine.tag.unexpected_len(),
            connections: st.conns.len(),
            proxy_armed: proxy.armed,
            proxy_started: proxy.started,
            proxy_passes: proxy.passes,
        }
    }
}

/// What a blocking call does with its request when `GSC_TIMEOUT` passes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum OnTimeout {
    /// The request refers to a user buffer: withdraw it (cancel, or end its link).
    Withdraw,
    /// The request refers to no user memory: just release it.
    Release,
}

/// Counters from `Worker::stats`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct WorkerStats {
    pub requests: usize,
    pub in_progress: usize,
    pub unexpected: usize,
    pub connections: usize,
    /// Operations handed to the proxy thread since the worker was created: one per conditioned
    /// operation issued (a captured or kernel-triggered one counts once, however often it runs).
    pub proxy_armed: u64,
    /// Operations the proxy thread started: one per triggered one-shot operation, one per epoch
    /// of a persistent one. None per iteration: the proxy did no work for the transfers.
    pub proxy_started: u64,
    /// Passes of the proxy loop (each checks the triggers and progresses the worker); it keeps
    /// growing while the proxy spins, so compare it across a window, not for equality.
    pub proxy_passes: u64,
}

impl Drop for WorkerInner {
    fn drop(&mut self) {
        // Stop the proxy first: it fails the operations still armed, releasing their producers.
        drop(self.proxy.take());
        workers().lock().unwrap_or_else(|e| e.into_inner()).remove(&self.id);
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for (_, c) in st.conns.iter_mut() {
            c.link.close();
        }
        if let Err(e) = timeline::flush() {
            tracing::warn!(target: "gsc::core", error = %e, "could not write the event timeline (GSC_TIMELINE)");
        }
    }
}

/// A completion callback that became due under the lock, to run after it is released.
pub(crate) struct Due {
    req: ReqId,
    callback: Callback,
    status: Status,
    info: RecvInfo,
    /// The handle was released before completion: free the slot once the callback ran (its
    /// request area stays valid during the callback).
    then_free: bool,
}

impl Worker {
    /// Run callbacks that became due (without the lock), then free the slots of those whose
    /// handles were already released.
    fn fire(&self, ready: Vec<Due>) {
        if ready.is_empty() {
            return; // nearly every call: keep it to a test
        }
        let mut free = Vec::new();
        for Due { req, callback, status, info, then_free } in ready {
            // A panicking user callback must not unwind through the progress engine's callers (C).
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| callback(req, status, info))).is_err() {
                tracing::error!(target: "gsc::core", request = req, "a completion callback panicked; continuing");
            }
            if then_free {
                free.push(req);
            }
        }
        if !free.is_empty() {
            let mut st = self.lock();
            for req in free {
                st.free_slot(req);
            }
        }
    }
}

pub(crate) fn check_buffer(buf: *const u8, len: usize, what: &str) -> Result<()> {
    if buf.is_null() && len > 0 {
        return Err(Error::invalid_param(format!("{what}: buffer is NULL but count is {len}")));
    }
    if (buf as usize).checked_add(len).is_none() {
        return Err(Error::invalid_param(format!("{what}: buffer range wraps the address space")));
    }
    Ok(())
}

/// The memory type of a buffer: as declared (checked against the driver, so a wrong
/// declaration is an error here and not a fault in a copy), else detected.
pub(crate) fn resolve_memtype(params: &RequestParams, addr: usize, len: usize) -> Result<MemType> {
    match params.memory_type {
        Some(m) => crate::cuda::memory::check_declared(addr, len, m).map(|()| m),
        None => crate::cuda::memory::memtype_of(addr),
    }
}

/// For operations that move host memory only (put/get).
pub(crate) fn require_host_memory(params: &RequestParams, addr: usize, len: usize, what: &str) -> Result<()> {
    match resolve_memtype(params, addr, len)? {
        MemType::Host => Ok(()),
        m => Err(Error::unsupported(format!("{what} on {} memory is not supported yet; use tagged send/receive", m.name()))),
    }
}

/// How often a worker beats its heartbeats, given `GSC_HEARTBEAT_TIMEOUT`: a tenth of it, so a
/// peer with the same timeout sees ten beats per timeout and a few late ones (a busy machine)
/// never fail a link; at most once a second (a stopped peer is found within the timeout plus
/// one peer check either way) and at least 10 ms apart (each beat locks the worker).
pub(crate) fn beat_period(heartbeat_timeout: Duration) -> Duration {
    (heartbeat_timeout / 10).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

impl Worker {
    /// The proxy thread's heartbeat: beat if due. It runs this after every sleep (idle, or
    /// polling persistent triggers), when no pass of its own would reach the 64-pass check in
    /// `progress`. Under the worker's lock, so a worker deadlocked on it falls silent too.
    /// Waiting long for the lock, it names the holder in a warning (`lock_watch`).
    pub(crate) fn heartbeat(&self) {
        self.inner.lock_holder.wait_for(&self.inner.state, "the proxy thread's heartbeat").beat_if_due(Instant::now());
    }
}

pub(crate) fn shm_config(cfg: &crate::Config) -> shm::ShmConfig {
    shm::ShmConfig {
        dir: cfg.shm_dir.clone(),
        ring_size: cfg.shm_ring_size,
        max_frame: cfg.shm_max_frame,
        cma: match cfg.cma {
            crate::config::Tristate::Auto => shm::CmaMode::Auto,
            crate::config::Tristate::On => shm::CmaMode::On,
            crate::config::Tristate::Off => shm::CmaMode::Off,
        },
        connect_timeout: cfg.connect_timeout,
        heartbeat_timeout: cfg.heartbeat_timeout,
    }
}

impl Conn {
    pub(crate) fn link_ref(&self) -> &dyn Link {
        &*self.link
    }
}

impl State {
    pub(crate) fn add_conn(
        &mut self,
        link: Box<dyn Link>,
        peer_worker: u128,
        peer_process: Option<ProcessIdentity>,
        has_user_ep: bool,
    ) -> (ConnId, u32) {
        let props = LaneProps {
            lane: link.lane(),
            max_frame: link.max_frame(),
            remote_memory: link.caps().remote_memory,
            // CUDA IPC handles only open on the host that made them.
            device_ipc: self.device.ipc != crate::config::Tristate::Off && link.lane().is_host_local(),
        };
        let generation = self.next_conn_generation;
        self.next_conn_generation = self.next_conn_generation.wrapping_add(1).max(1);
        let mut link = link;
        if let Some(period) = self.beat_period {
            // A new link carries the worker's promise (or its absence) from its first moment.
            link.heartbeat(self.beat_promise.then_some(period));
        }
        let conn = self.conns.insert(Conn {
            link,
            generation,
            outq: VecDeque::new(),
            peer_process,
            props,
            failed: None,
            has_user_ep,
            closing: None,
            short_max: self.engine.tag.eager_short_limit(&props),
            poll_window: 1,
            staged_upto: 0,
            chunks_staging: 0,
        });
        self.engine.add_conn(conn, props, peer_worker);
        (conn, generation)
    }

    pub(crate) fn alloc_request(&mut self, worker: u16, kind: ReqKind, conn: Option<ConnId>, callback: Option<Callback>) -> ReqId {
        let generation = self.next_generation;
        self.next_generation = self.next_generation.wrapping_add(1);
        let mut slot = Slot::new(kind, conn, generation, callback);
        slot.area = self.areas.take();
        let key = self.requests.insert(slot);
        request::encode(worker, generation, key)
    }

    fn slot(&self, req: ReqId) -> Option<&Slot> {
        let (_, generation, key) = request::decode(req)?;
        self.requests.get(key).filter(|s| s.generation == generation)
    }

    /// Conditioned requests started longer than `timeout` ago and not complete.
    fn overdue_conditioned(&self, worker: u16, timeout: Duration) -> Vec<(ReqId, ReqKind, Option<ConnId>)> {
        self.requests
            .iter()
            .filter(|(_, s)| s.result.is_none() && s.started_at.is_some_and(|t| t.elapsed() > timeout))
            .map(|(key, s)| (request::encode(worker, s.generation, key), s.kind, s.conn))
            .collect()
    }

    /// Log, once each, the state of conditioned operations started more than `after` ago and
    /// not complete (a warning only: nothing fails here).
    fn report_slow_conditioned(&mut self, worker: u16, after: Duration) {
        let slow: Vec<(ReqId, ReqKind, Option<ConnId>)> = self
            .requests
            .iter_mut()
            .filter(|(_, s)| s.result.is_none() && !s.slow_reported && s.started_at.is_some_and(|t| t.elapsed() > after))
            .map(|(key, s)| {
                s.slow_reported = true;
                (request::encode(worker, s.generation, key), s.kind, s.conn)
            })
            .collect();
        for (req, kind, conn) in slow {
            let state = self.describe_stuck(req, conn);
            tracing::warn!(target: "gsc::proxy", req, ?kind, ?after, state = %state, "a stream-ordered operation is slow");
        }
    }

    /// Requests armed on a condition that has not triggered yet.
    fn armed_requests(&self, worker: u16) -> Vec<ReqId> {
        self.requests
            .iter()
            .filter(|(_, s)| s.armed && s.result.is_none())
            .map(|(key, s)| request::encode(worker, s.generation, key))
            .collect()
    }

    pub(crate) fn slot_mut(&mut self, req: ReqId) -> Option<&mut Slot> {
        let (_, generation, key) = request::decode(req)?;
        self.requests.get_mut(key).filter(|s| s.generation == generation)
    }

    fn checked_slot(&self, worker: u16, handle: u64) -> Result<&Slot> {
        match request::decode(handle) {
            Some((w, _, _)) if w == worker => {}
            _ => return Err(Error::new(Status::InvalidHandle, "request handle does not belong to this worker")),
        }
        // A released slot stays in the table until its request completes (so the callback can
        // still fire), but the handle itself is dead: `request_release` promises "invalid from
        // now on", and a test/wait/cancel through it would race with the slot being recycled.
        self.slot(handle)
            .filter(|s| !s.released)
            .ok_or_else(|| Error::new(Status::InvalidHandle, "stale or already released request handle"))
    }

    fn checked_slot_mut(&mut self, worker: u16, handle: u64) -> Result<&mut Slot> {
        self.checked_slot(worker, handle)?;
        Ok(self.slot_mut(handle).expect("checked above"))
    }

    /// What a stuck request `req` (on link `conn`, if known) waits for: its protocol state, its
    /// link's queue, and the staging pipeline's, for the warning a timeout logs.
    fn describe_stuck(&self, req: ReqId, conn: Option<ConnId>) -> String {
        let proto = self.engine.tag.describe(req).unwrap_or_else(|| "no tag-protocol state".into());
        let conn = conn.or_else(|| self.engine.tag.conn_of(req));
        let link = conn.and_then(|k| self.conns.get(k).map(|c| (k, c))).map_or(String::new(), |(k, c)| {
            let front = c.outq.front().map_or("none".to_string(), |f| match f.payload {
                Payload::Staged { chunk, .. } => format!("staged chunk {chunk}: {}", self.device.describe_chunk(chunk)),
                ref p => p.kind_name().to_string(),
            });
            format!(
                "; link {k}: {} frames queued (front payload: {front}), {} chunks staging, failed: {}, {}",
                c.outq.len(),
                c.chunks_staging,
                c.failed.is_some(),
                c.link.describe()
            )
        });
        format!("{proto}{link}; {}", self.device.describe_staging(req))
    }

    /// Links whose GPU data goes through the host-staging pipeline: the UCX lane's, or every
    /// link with `GSC_CUDA_IPC=off`.
    fn staging_links(&self) -> usize {
        let off = self.device.ipc == crate::config::Tristate::Off;
        self.conns.iter().filter(|(_, c)| off || c.props.lane == LaneKind::Ucx).count()
    }

    fn free_slot(&mut self, req: ReqId) {
        if let Some((_, generation, key)) = request::decode(req)
            && self.requests.get(key).is_some_and(|s| s.generation == generation)
        {
            let slot = self.requests.remove(key);
            self.exposed.remove(&req);
            if let Some(area) = slot.area {
                self.areas.give(area);
            }
        }
    }

    /// One pass of progress. Returns the number of events.
    fn progress(&mut self, ctx: &Context) -> usize {
        self.polls += 1;
        let mut events = 0;
        // Accepting is a scan of the listeners' slots: every 16th pass is plenty for
        // connection setup and keeps the per-message path short.
        if self.polls % 16 == 1 {
            events += self.accept_all();
        }
        // The key list is rebuilt only when connections came or went (adding one moves the
        // generation counter; removing one changes the count), so a pass allocates nothing.
        let stamp = (self.next_conn_generation, self.conns.len());
        if self.conn_keys_stamp != stamp {
            self.conn_keys.clear();
            self.conn_keys.extend(self.conns.iter().map(|(k, _)| k));
            self.conn_keys_stamp = stamp;
        }
        let mut actions = self.take_actions();
        for i in 0..self.conn_keys.len() {
            let conn = self.conn_keys[i];
            let Some(c) = self.conns.get_mut(conn) else { continue };
            if c.failed.is_some() {
                continue;
            }
            if c.outq.is_empty() && c.closing.is_none() && !c.link.may_have_news() {
                continue; // idle: the common case of a pass, kept to a couple of loads
            }
            if !c.outq.is_empty() {
                events += self.flush_outq(conn, &mut actions);
            }
            events += self.poll_conn(ctx, conn, &mut actions);
            if self.conns.get(conn).is_some_and(|c| c.closing.is_some()) {
                self.maybe_finish_close(conn, &mut actions);
            }
        }
        if self.device.reads_in_flight() > 0 {
            let mut done = std::mem::take(&mut self.reads_done);
            self.device.poll_reads(&mut done);
            events += done.len();
            for (req, result) in done.drain(..) {
                match self.device.take_held(req) {
                    // The receive already ended (its link failed); its buffer is free now.
                    Some((status, info)) => actions.push(Action::Complete { req, status, info }),
                    None => self.engine.tag.remote_read_done(&mut actions, req, result),
                }
            }
            self.reads_done = done;
        }
        if self.device.writes_in_flight() > 0 {
            let mut done = Vec::new();
            self.device.poll_writes(&mut done);
            events += done.len();
            for (write, result) in done {
                // The round already ended (its link failed or the peer left): its buffer is
                // the user's again only now.
                if !self.device.writing(write.req)
                    && let Some((status, info)) = self.device.take_held(write.req)
                {
                    actions.push(Action::Complete { req: write.req, status, info });
                    continue;
                }
                if self.slot(write.req).is_none_or(|s| s.result.is_some()) || self.device.is_held(write.req) {
                    continue; // the round ended while this write ran: nothing more to announce
                }
                match (result, write.arrived_word) {
                    (Ok(()), Some((id, round))) => {
                        if !write.word_by_stream {
                            self.prep_words.raise_arrived(id, round);
                        }
                        self.frame_sent(write.req, &mut actions);
                    }
                    (Ok(()), None) => self.queue_frame(write.conn, write.then, &mut actions),
                    (Err(e), _) => self.engine.prepared.write_failed(&mut actions, write.req, e.status()),
                }
            }
        }
        if self.device.staging_busy() {
            let mut done = Vec::new();
            self.device.poll_staging(&mut done);
            events += done.len();
            for (req, status, info) in done {
                // Not through `complete`: that could hold it again behind newer copies.
                self.finish_complete(req, status, info, &mut actions);
            }
        }
        if !self.host_rounds.is_empty() {
            events += super::gpu_rounds::poll_host_rounds(&mut self.host_rounds, &mut actions);
        }
        if !self.prep_words.is_empty() {
            let (moves, violation) = self.prep_words.poll(&mut self.engine.prepared, &mut actions);
            events += moves;
            if let Some((conn, e)) = violation {
                self.fail_conn(conn, e, &mut actions);
            }
            if self.polls.is_multiple_of(64) {
                self.prep_words.sweep(&self.engine.prepared);
            }
        }
        // One clock read per 64 passes serves both the heartbeat and the peer checks.
        if self.polls % 64 == 0 {
            let now = Instant::now();
            self.beat_if_due(now);
            if now.saturating_duration_since(self.last_peer_check) >= self.peer_check_interval {
                self.last_peer_check = now;
                self.check_peers(&mut actions);
            }
        }
        if actions.is_empty() {
            self.give_actions(actions);
        } else {
            events += actions.len();
            self.execute(ctx, actions);
        }
        events
    }

    fn take_actions(&mut self) -> Actions {
        self.spare_actions.pop().unwrap_or_default()
    }

    fn give_actions(&mut self, mut actions: Actions) {
        actions.clear();
        if self.spare_actions.len() < 8 {
            self.spare_actions.push(actions);
        }
    }

    fn accept_all(&mut self) -> usize {
        let mut accepted = Vec::new();
        for l in &mut self.listeners {
            loop {
                match l.accept() {
                    Ok(Some((peer_uuid, link))) => accepted.push((peer_uuid, link)),
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(target: "gsc::core", lane = l.lane().name(), error = %e, "refused an incoming connection");
                        break;
                    }
                }
            }
        }
        let n = accepted.len();
        for (peer_uuid, mut link) in accepted {
            if self.aborted {
                // The peer's endpoint sees its link closed, as the links open at the abort did.
                link.close();
                continue;
            }
            let (conn, _) = self.add_conn(link, peer_uuid, None, false);
            tracing::debug!(target: "gsc::core", conn, "accepted a connection");
        }
        n
    }

    fn poll_conn(&mut self, ctx: &Context, conn: ConnId, deferred: &mut Actions) -> usize {
        // Fields, not the spare pool: this runs on every pass for every link, busy or not.
        let mut scratch = std::mem::take(&mut self.frame_scratch);
        let mut deliveries = std::mem::take(&mut self.deliveries);
        let State { engine, conns, device, prep_words, .. } = self;
        let Some(c) = conns.get_mut(conn) else { return 0 };
        let mut violation: Option<Error> = None;
        let mut other_violation: Option<(ConnId, Error)> = None;
        let mut peer_closed = false;
        let regions = &ctx.inner.regions;
        let window = c.poll_window;
        let result = c.link.poll_recv(window, &mut |frame| {
            if violation.is_some() || peer_closed {
                return;
            }
            timeline::record(Event::FrameIn, frame.first().copied().unwrap_or(0) as u64);
            // The commonest frame, a small message someone waits for, skips the action lists.
            if let Some((mut delivery, data)) = engine.tag.take_eager_only_match(frame) {
                if let Err(e) = copy_in(device, delivery.buf.addr, delivery.buf.mem, data) {
                    delivery.status = e.status();
                    violation = Some(e.context("receiving into a GPU buffer"));
                }
                deliveries.push(delivery);
                return;
            }
            // Shared words and frames are not ordered with each other: a peer that raised
            // "arrived" for its last round, then released the pair or closed the link, must
            // not have that round fail as "peer gone" because this pass read the frame before
            // the word. It raised the word before it wrote the frame, so the word is visible.
            if !prep_words.is_empty() && matches!(frame.first(), Some(&wire::kind::PREP_BYE | &wire::kind::CLOSE)) {
                match prep_words.poll(&mut engine.prepared, deferred) {
                    (_, Some((bad_conn, e))) if bad_conn == conn => {
                        violation = Some(e);
                        return;
                    }
                    // Another link's peer broke the protocol: failed after this link's frames.
                    (_, Some(other)) => other_violation = Some(other),
                    (_, None) => {}
                }
            }
            match engine.on_frame(&mut scratch, conn, frame, regions) {
                Ok(FrameOutcome::Handled) => {}
                Ok(FrameOutcome::PeerClosed) => peer_closed = true,
                Err(e) => violation = Some(e),
            }
            // Copies out of the frame must happen now: the frame is only valid in this call.
            let payload = wire::payload_of(frame);
            for a in scratch.drain(..) {
                match a {
                    Action::CopyFromFrame { dst, mem, src_offset, len } => {
                        if let Err(e) = copy_in(device, dst, mem, &payload[src_offset..src_offset + len]) {
                            // The message cannot be delivered and frames of it are still coming.
                            violation.get_or_insert(e.context("receiving into a GPU buffer"));
                        }
                    }
                    other => deferred.push(other),
                }
            }
        });
        if let Ok(n) = result {
            c.poll_window = if n == window { (window * 2).min(MAX_POLL_WINDOW) } else { 1 };
        }
        scratch.clear();
        self.frame_scratch = scratch;
        for d in deliveries.drain(..) {
            self.complete(d.req, d.status, d.info, deferred);
        }
        self.deliveries = deliveries;
        if let Some((other, e)) = other_violation {
            self.fail_conn(other, e, deferred);
        }
        let failure = match (result, violation) {
            (Err(e), _) | (Ok(_), Some(e)) => e,
            (Ok(_), None) if peer_closed => Error::new(Status::ConnectionReset, "the peer closed its endpoint"),
            (Ok(n), None) => return n,
        };
        self.fail_conn(conn, failure, deferred);
        1
    }

    /// Write queued frames into the link while it has room. GPU payloads are staged ahead in
    /// chunks (`stage_ahead`); a frame whose chunk is still being copied waits for it.
    fn flush_outq(&mut self, conn: ConnId, out: &mut Actions) -> usize {
        let mut sent = 0;
        loop {
            if let Err(e) = self.stage_ahead(conn) {
                self.fail_conn(conn, e.context("staging a GPU send buffer"), out);
                return sent;
            }
            let State { conns, device, .. } = self;
            let Some(c) = conns.get_mut(conn) else { return sent };
            let Some(front) = c.outq.front() else { return sent };
            let (payload, chunk) = match &front.payload {
                Payload::None => (&[][..], None),
                Payload::User { addr, len } => (user_slice(*addr, *len), None),
                Payload::Owned(v) => (v.as_slice(), None),
                Payload::Device { .. } => unreachable!("stage_ahead puts the front's GPU payload in a chunk"),
                &Payload::Staged { chunk, offset, len } => match device.send_chunk_ready(chunk) {
                    None => return sent, // still copying
                    Some(Err(e)) => {
                        self.fail_conn(conn, e.context("copying a GPU send buffer to host memory"), out);
                        return sent;
                    }
                    Some(Ok(())) => (device.staged_bytes(chunk, offset, len), Some(chunk)),
                },
            };
            match c.link.try_send(&[front.header.as_bytes(), payload]) {
                Ok(true) => {
                    timeline::record(Event::FrameOut, front.header.as_bytes()[0] as u64);
                    let f = c.outq.pop_front().expect("front exists");
                    c.staged_upto = c.staged_upto.saturating_sub(1);
                    if let Some(id) = chunk
                        && device.staged_frame_sent(id)
                    {
                        c.chunks_staging -= 1;
                    }
                    sent += 1;
                    if let Some(req) = f.on_sent {
                        self.frame_sent(req, out);
                    }
                }
                Ok(false) => return sent,
                Err(e) => {
                    self.fail_conn(conn, e, out);
                    return sent;
                }
            }
        }
    }

    /// Start copying the GPU payloads of `conn`'s queue into bounce buffers, chunk by chunk,
    /// until `GSC_CUDA_PIPELINE_DEPTH` chunks are being copied or waiting to be sent.
    fn stage_ahead(&mut self, conn: ConnId) -> Result<()> {
        let State { conns, device, .. } = self;
        let Some(c) = conns.get_mut(conn) else { return Ok(()) };
        while c.chunks_staging < device.pipeline_depth {
            // Where the first frame's allocation ends: unknown (a failed query) joins nothing.
            let end_of = |addr: usize| {
                crate::cuda::memory::device_ptr(addr)
                    .ok()
                    .flatten()
                    .and_then(|p| crate::cuda::memory::allocation_end(addr, p.device).ok())
                    .unwrap_or(addr)
            };
            let Some(plan) = staging::next_chunk(&c.outq, c.staged_upto, device.pipeline_chunk, end_of) else {
                c.staged_upto = c.outq.len();
                break;
            };
            let Some(id) = device.start_send_chunk(conn, plan.addr, plan.len, plan.frames)? else {
                if c.chunks_staging > 0 {
                    break; // no bounce buffer free: this link's own chunks will bring one back
                }
                // None free and none of this link's in flight to bring one back: copy the
                // chunk's frames out now (our copy stream only), so the link never waits on
                // buffers held by other links.
                for f in c.outq.range_mut(plan.start..plan.start + plan.frames) {
                    let Payload::Device { addr, len } = f.payload else { unreachable!("next_chunk takes GPU frames") };
                    f.payload = Payload::Owned(device.copy_out_now(addr, len)?);
                }
                c.staged_upto = plan.start + plan.frames;
                continue;
            };
            let mut offset = 0;
            for f in c.outq.range_mut(plan.start..plan.start + plan.frames) {
                let len = f.payload.len();
                f.payload = Payload::Staged { chunk: id, offset, len };
                offset += len;
            }
            c.staged_upto = plan.start + plan.frames;
            c.chunks_staging += 1;
        }
        Ok(())
    }

    fn queue_frame(&mut self, conn: ConnId, mut frame: OutFrame, out: &mut Actions) {
        let Some(c) = self.conns.get_mut(conn) else {
            tracing::debug!(target: "gsc::core", conn, "frame for a connection that is gone; dropped");
            return;
        };
        if c.failed.is_some() {
            return;
        }
        if let Payload::Device { .. } = frame.payload {
            // GPU bytes go through host memory, in chunks copied ahead (`flush_outq`).
            c.outq.push_back(frame);
            self.flush_outq(conn, out);
            return;
        }
        let c = &mut self.conns[conn];
        if c.outq.is_empty() {
            let payload = match &frame.payload {
                Payload::None => &[][..],
                Payload::User { addr, len } => user_slice(*addr, *len),
                Payload::Owned(v) => v.as_slice(),
                Payload::Device { .. } | Payload::Staged { .. } => unreachable!("queued above"),
            };
            match c.link.try_send(&[frame.header.as_bytes(), payload]) {
                Ok(true) => {
                    timeline::record(Event::FrameOut, frame.header.as_bytes()[0] as u64);
                    if let Some(req) = frame.on_sent {
                        self.frame_sent(req, out);
                    }
                    return;
                }
                Ok(false) => {}
                Err(e) => {
                    // Queue it first so that `fail_conn` sees it: a Close frame's request must
                    // still complete.
                    self.conns[conn].outq.push_back(frame);
                    self.fail_conn(conn, e, out);
                    return;
                }
            }
        }
        if frame.copy_if_queued {
            // Eager-short: the request completes when the call returns, so the queued frame must
            // not refer to the user's buffer.
            if let Payload::User { addr, len } = frame.payload {
                frame.payload = Payload::Owned(user_slice(addr, len).to_vec());
            }
        }
        self.conns[conn].outq.push_back(frame);
    }

    fn frame_sent(&mut self, req: ReqId, out: &mut Actions) {
        if self.slot(req).is_some_and(|s| s.kind == ReqKind::Close) {
            out.push(Action::Complete { req, status: Status::Ok, info: RecvInfo::default() });
        } else {
            self.engine.frame_sent(out, req);
        }
    }

    /// The link is dead: fail what needs it, keep the entry only if a user endpoint refers to it.
    pub(crate) fn fail_conn(&mut self, conn: ConnId, error: Error, out: &mut Actions) {
        let Some(c) = self.conns.get_mut(conn) else { return };
        if c.failed.is_some() {
            return;
        }
        tracing::info!(target: "gsc::core", conn, error = %error, "connection failed");
        let status = error.status();
        // Requests completed by their frame being sent and tracked by no protocol (closes) would
        // never complete once their frame is dropped; a close that meets a dead link is a close.
        let unsent: Vec<ReqId> = c.outq.drain(..).filter_map(|f| f.on_sent).collect();
        (c.staged_upto, c.chunks_staging) = (0, 0);
        c.link.close();
        self.device.drop_send_chunks(conn);
        let closing = c.closing.take();
        let keep = c.has_user_ep;
        c.failed = Some(error);
        self.engine.conn_failed(out, conn, status);
        if let Some(req) = closing {
            // A close that meets a dead link is still a close.
            out.push(Action::Complete { req, status: Status::Ok, info: RecvInfo::default() });
        }
        for req in unsent {
            if self.slot(req).is_some_and(|s| s.kind == ReqKind::Close) {
                out.push(Action::Complete { req, status: Status::Ok, info: RecvInfo::default() });
            }
        }
        // Requests the engine does not track (none today) would be failed here by slot.conn.
        if !keep {
            self.conns.remove(conn);
        }
    }

    /// Beat every live link's heartbeat if a beat period has passed since the last beat. Every
    /// progress pass may beat (the beats then show that someone progresses this worker), but only
    /// a worker with a proxy thread promises it (`beat_promise`): without one, an application
    /// that stops calling progress stops the beats while alive and well.
    pub(crate) fn beat_if_due(&mut self, now: Instant) {
        let Some(period) = self.beat_period else { return };
        if now.saturating_duration_since(self.last_beat) < period {
            return;
        }
        self.last_beat = now;
        let promise = self.beat_promise.then_some(period);
        for (_, c) in self.conns.iter_mut().filter(|(_, c)| c.failed.is_none()) {
            c.link.heartbeat(promise);
        }
    }

    /// From now on a proxy thread beats this worker's heartbeats: promise it on every link (and
    /// on every later one, at `add_conn`), beating now so the promise comes with a fresh beat.
    pub(crate) fn promise_heartbeat(&mut self) {
        let Some(period) = self.beat_period else { return };
        self.beat_promise = true;
        self.last_beat = Instant::now();
        for (_, c) in self.conns.iter_mut().filter(|(_, c)| c.failed.is_none()) {
            c.link.heartbeat(Some(period));
        }
    }

    fn check_peers(&mut self, out: &mut Actions) {
        let keys: Vec<ConnId> = self.conns.iter().filter(|(_, c)| c.failed.is_none()).map(|(k, _)| k).collect();
        for conn in keys {
            if let Err(e) = self.conns[conn].link.check_peer() {
                // Frames the peer sent before it went away are still delivered by the next poll,
                // which reports the failure itself; only a silent failure is raised here.
                self.fail_conn(conn, e, out);
            }
        }
    }

    /// Start closing: the Close frame goes out once every send on this link has completed.
    pub(crate) fn begin_close(&mut self, conn: ConnId, req: ReqId, out: &mut Actions) {
        self.conns[conn].closing = Some(req);
        self.maybe_finish_close(conn, out);
    }

    fn maybe_finish_close(&mut self, conn: ConnId, out: &mut Actions) {
        let Some(c) = self.conns.get(conn) else { return };
        let Some(req) = c.closing else { return };
        if c.failed.is_some()
            || self.engine.tag.sends_on(conn) > 0
            || self.engine.rma.pending_on(conn) > 0
            || self.engine.prepared.sends_on(conn) > 0
        {
            return;
        }
        self.conns[conn].closing = None;
        let frame = OutFrame { header: wire::Header::Close.encode(), payload: Payload::None, on_sent: Some(req), copy_if_queued: false };
        self.queue_frame(conn, frame, out);
    }

    /// Execute actions until none are left (executing one can emit more).
    pub(crate) fn execute(&mut self, ctx: &Context, mut work: Actions) {
        while !work.is_empty() {
            let mut next = self.take_actions();
            for a in work.drain(..) {
                match a {
                    Action::Transmit { conn, frame } => self.queue_frame(conn, frame.0, &mut next),
                    Action::CopyOwned { req, dst, mem, data } => {
                        if let Err(e) = copy_in(&mut self.device, dst, mem, &data) {
                            // The engine completes the receive right after its copy; make that
                            // completion report the failure instead of wrong data.
                            tracing::warn!(target: "gsc::core", req, error = %e, "could not deliver a buffered message into a GPU buffer");
                            self.failed_copies.push((req, e.status()));
                        }
                    }
                    Action::CopyFromFrame { .. } => {
                        tracing::error!(target: "gsc::core", "copy-from-frame outside frame handling; dropped (bug)");
                    }
                    Action::ReadRemote { dst, remote, len, req, device_key: Some(key), .. } => {
                        match self.device.start_read(dst, remote, len, &key, req) {
                            ReadStart::Started => {}
                            ReadStart::Refused(why) => {
                                tracing::debug!(target: "gsc::cuda", req, %why, "GPU read refused; asking the sender to push");
                                self.engine.tag.remote_read_refused(&mut next, req);
                            }
                            ReadStart::Failed(e) => {
                                tracing::debug!(target: "gsc::cuda", req, error = %e, "GPU read failed");
                                self.engine.tag.remote_read_done(&mut next, req, Err(e))
                            }
                        }
                    }
                    Action::ReadRemote { conn, dst, remote, len, req, device_key: None, lane_key } => {
                        let started = Instant::now();
                        let result = match self.conns.get(conn) {
                            Some(c) if c.failed.is_none() => {
                                // SAFETY: `dst..dst+len` is inside the pending receive's host
                                // buffer (the engine clips `len` to it and sends only host
                                // buffers this way); the kernel (CMA) or the key's range and
                                // the peer's registration (UCX) bound `remote`.
                                unsafe { c.link.read_remote_keyed(dst.addr as *mut u8, remote, len, lane_key.as_deref().unwrap_or(&[])) }
                            }
                            _ => Err(Error::new(Status::NotConnected, "connection gone before the rendezvous read")),
                        };
                        if result.is_ok() {
                            self.engine.tag.remote_read_took(req, started.elapsed().as_nanos() as u64);
                        }
                        self.engine.tag.remote_read_done(&mut next, req, result);
                    }
                    Action::WriteRemote { conn, src, remote, len, req, device_key: Some(key), then, arrived_word } => {
                        let write = PendingWrite { req, conn, then: then.0, arrived_word, word_by_stream: false };
                        let word = arrived_word.and_then(|(id, round)| Some((self.prep_words.arrived_device_word(id)?, round)));
                        if let Err(e) = self.device.start_write(src, remote, len, &key, word, write) {
                            // Like a refused rendezvous read: the data goes in frames instead.
                            tracing::debug!(target: "gsc::cuda", req, error = %e, "prepared GPU write refused");
                            self.engine.prepared.direct_refused(&mut next, req, src, len);
                        }
                    }
                    Action::WriteRemote { conn, src, remote, len, req, device_key: None, then, arrived_word } => {
                        let result = match self.conns.get(conn) {
                            Some(c) if c.failed.is_none() => {
                                // SAFETY: `src..src+len` is inside the prepared send's host
                                // buffer, which its owner keeps valid while a round is in
                                // flight; the kernel (CMA) or the loopback lane checks `remote`,
                                // the receive buffer the peer announced for direct writes.
                                unsafe { c.link.write_remote(src as *const u8, remote, len) }
                            }
                            _ => Err(Error::new(Status::NotConnected, "connection gone before a prepared write")),
                        };
                        match (result, arrived_word) {
                            // The bytes are in the peer (the syscall returned): the raise
                            // (release) publishes them with the round.
                            (Ok(()), Some((id, round))) => {
                                self.prep_words.raise_arrived(id, round);
                                self.frame_sent(req, &mut next);
                            }
                            (Ok(()), None) => self.queue_frame(conn, then.0, &mut next),
                            (Err(e), _) => {
                                tracing::debug!(target: "gsc::core", req, error = %e, "prepared direct write failed");
                                self.engine.prepared.write_failed(&mut next, req, e.status());
                            }
                        }
                    }
                    Action::Complete { req, status, info } => self.complete(req, status, info, &mut next),
                    Action::MapWords { id, path } => {
                        if let Err(e) = self.prep_words.map_recv(id, &path) {
                            tracing::info!(target: "gsc::core", id, error = %e, "prepared receive: the sender's word page is not \
                                           usable here; readiness and arrival go in frames");
                            self.engine.prepared.words_refused(&mut next, id);
                        }
                    }
                    Action::RaiseReady { id, round } => {
                        // No page: `words_refused` already sent this round's frame.
                        let _ = self.prep_words.raise_ready(id, round);
                    }
                }
            }
            // Completing a send may let a pending close go out.
            if self.conns.iter().any(|(_, c)| c.closing.is_some()) {
                let closing: Vec<ConnId> = self.conns.iter().filter(|(_, c)| c.closing.is_some()).map(|(k, _)| k).collect();
                for conn in closing {
                    self.maybe_finish_close(conn, &mut next);
                }
            }
            let _ = ctx;
            self.give_actions(std::mem::replace(&mut work, next));
        }
        self.give_actions(work);
    }

    fn complete(&mut self, req: ReqId, status: Status, info: RecvInfo, out: &mut Actions) {
        let status = match self.failed_copies.iter().position(|(r, _)| *r == req) {
            Some(i) => self.failed_copies.swap_remove(i).1,
            None => status,
        };
        if self.device.copies_in_flight() > 0 && self.device.hold_completion(req, status, info) {
            return;
        }
        self.finish_complete(req, status, info, out);
    }

    /// `complete`, past the holds for copies into (or out of) the request's buffer.
    fn finish_complete(&mut self, req: ReqId, status: Status, info: RecvInfo, out: &mut Actions) {
        // The peer has read the send buffer (ATS) or never will (failure): close it again.
        if !self.exposed.is_empty() {
            self.exposed.remove(&req);
        }
        let Some(slot) = self.slot_mut(req) else {
            tracing::debug!(target: "gsc::core", req, "completion for a request that is gone");
            return;
        };
        if slot.result.is_some() {
            return;
        }
        if let ReqKind::FlushPart { parent } = slot.kind {
            self.free_slot(req);
            if let Some(p) = self.slot_mut(parent) {
                if status != Status::Ok && p.first_error.is_none() {
                    p.first_error = Some(status);
                }
                p.pending_parts = p.pending_parts.saturating_sub(1);
                if p.pending_parts == 0 {
                    let s = p.first_error.unwrap_or(Status::Ok);
                    out.push(Action::Complete { req: parent, status: s, info: RecvInfo::default() });
                }
            }
            return;
        }
        if slot.kind == ReqKind::Close
            && let Some(conn) = slot.conn
            && let Some(mut c) = self.conns.try_remove(conn)
        {
            c.link.close();
            // Anything still tied to the link (receives mid-message from the peer) ends.
            self.engine.conn_failed(out, conn, Status::NotConnected);
        }
        let slot = self.slot_mut(req).expect("checked above");
        slot.result = Some((status, info));
        if let Some(signal) = slot.signal.take() {
            signal.fire(status, info.length);
            timeline::record(Event::Done, req as u64);
        }
        let released = slot.released;
        if let Some(callback) = slot.callback.take() {
            self.ready.push(Due { req, callback, status, info, then_free: released });
        } else if released {
            self.free_slot(req);
        }
    }
}
