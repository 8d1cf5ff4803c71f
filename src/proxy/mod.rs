//! The proxy: one thread per worker that executes operations whose condition a producer (a CUDA
//! stream, a graph, a kernel, a host stream) satisfies by writing a trigger word.
//!
//! It watches the trigger words of armed operations, starts each operation on the worker when its
//! word reaches it (in the order they were armed), progresses the worker on every pass (so a
//! message for a receive about to trigger is already here when it does), and leaves the done
//! words to the operations' completion signals (`condition::Signal`). It never waits for a
//! stream: trigger and done words are host memory, and the only driver calls its progress makes
//! (host staging of GPU buffers, core/device_mem.rs) are copies on gscomm's own streams and
//! event queries. Those calls do take the driver's internal lock, though, so a thread that holds
//! it while waiting for the device would stall the proxy: see `outstanding`.
//!
//! Idle behaviour: with nothing armed it sleeps on its channel and wakes when an operation is
//! armed. With one-shot operations armed it spins (their trigger is near: the producer was just
//! given the write). With only persistent operations (graph nodes, kernel triggers) armed, whose
//! next trigger may be hours away, it spins for `GSC_PROXY_SPIN` after the last activity and then
//! polls every `GSC_PROXY_POLL`. A persistent operation is dropped once only the proxy refers
//! to its channel (its graphs were destroyed, or its kernel-triggered condition released).
//!
//! Heartbeat: a proxy thread is what lets the worker promise its shm peers a heartbeat (issue
//! #8, `Link::heartbeat`), so it never sleeps longer than the beat period: an idle thread wakes
//! to beat (only that: it runs no pass, so it never progresses the worker or fires callbacks
//! while idle, as before), and after any sleep it beats if a beat is due.
//!
//! Accounting: `ProxyCounters` count what the thread did (operations handed over, operations
//! started, passes), read by `Worker::stats`: they show how much host work a transfer costs,
//! e.g. none per iteration when the rounds run on the GPU.

pub(crate) mod outstanding;

use crate::condition::{Channel, LATE_LIMIT, Stage};
use crate::core::worker::{OpStart, Worker, WorkerInner};
use crate::error::{Error, Result, Status};
use crate::log::timeline::{self, Event};
use crate::protocols::ReqId;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

/// How often started operations are checked against `GSC_TIMEOUT` (`Worker::expire_stream_ops`).
const EXPIRY_CHECK_INTERVAL: Duration = Duration::from_millis(200);

/// A one-shot operation: start request `req` once `channel`'s trigger reaches `seq`.
pub(crate) struct ArmedOp {
    pub(crate) channel: Arc<Channel>,
    pub(crate) seq: u64,
    pub(crate) req: ReqId,
    pub(crate) start: OpStart,
    /// A staged send: its bytes must have arrived before it starts (`Stage::send_ready`).
    pub(crate) stage: Option<Arc<Stage>>,
}

/// A persistent operation: start a fresh request for every epoch the trigger word advances by.
pub(crate) struct PersistentOp {
    pub(crate) channel: Arc<Channel>,
    pub(crate) template: crate::core::worker::OpTemplate,
    /// Epochs started so far.
    pub(crate) started: u64,
}

/// Whether a triggered operation may start: a staged send waits for its bytes (they race the
/// trigger across PCIe), at most `LATE_LIMIT` from when the trigger was first seen (`since`).
enum Readiness {
    Ready,
    NotYet,
    Late(Error),
}

fn readiness(stage: Option<&Arc<Stage>>, epoch: Option<u64>, since: &mut Option<Instant>) -> Readiness {
    match stage {
        None => Readiness::Ready,
        Some(s) if s.send_ready(epoch) => {
            *since = None;
            Readiness::Ready
        }
        Some(s) => {
            let first = *since.get_or_insert_with(Instant::now);
            if first.elapsed() > LATE_LIMIT {
                *since = None;
                Readiness::Late(s.late_error())
            } else {
                Readiness::NotYet
            }
        }
    }
}

/// What a proxy thread did since it started. Relaxed: each counter only grows and is read on
/// its own, for diagnostics; nothing is ordered by it.
#[derive(Default)]
struct ProxyCounters {
    /// Operations handed to the proxy (one-shot or persistent), counted as they are sent.
    armed: AtomicU64,
    /// Operations the proxy started: one-shot operations whose trigger fired, plus one per
    /// epoch of a persistent one. Counted before the start, so a caller that saw an operation
    /// complete also sees it counted.
    started: AtomicU64,
    /// Passes of the proxy loop (each checks the triggers and progresses the worker once).
    passes: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// A reading of a proxy's counters (`Worker::stats`); all zero for a worker that never
/// started its proxy.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ProxyActivity {
    pub(crate) armed: u64,
    pub(crate) started: u64,
    pub(crate) passes: u64,
}

pub(crate) enum Msg {
    Arm(ArmedOp),
    Persist(PersistentOp),
    /// The worker was aborted: fail everything armed, now and later, with this error; then
    /// say so on the sender.
    Abort(Error, Sender<()>),
    /// Tests: the next pass panics, as a bug in it would (`Proxy::inject_panic`).
    #[cfg(test)]
    PanicNextPass,
}

/// The worker's handle on its proxy: a thread, or an engine the application's progress calls
/// run (`GSC_PROXY_THREAD=off`).
pub(crate) struct Proxy {
    tx: Option<Sender<Msg>>,
    runner: Runner,
    counters: Arc<ProxyCounters>,
}

enum Runner {
    Thread {
        thread: Option<JoinHandle<()>>,
        thread_id: ThreadId,
    },
    /// Run by `Proxy::run_in_caller`; one caller at a time (others skip, they would only spin).
    Caller(Mutex<Engine>),
}

impl Proxy {
    /// `beat`: the heartbeat period (`None`: no heartbeat, `GSC_HEARTBEAT_TIMEOUT=inf`).
    pub(crate) fn spawn(worker: Weak<WorkerInner>, spin: Duration, poll: Duration, beat: Option<Duration>) -> Result<Proxy> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let counters = Arc::new(ProxyCounters::default());
        let mut engine = Engine::new(worker, rx, spin, poll, counters.clone());
        engine.beat = beat;
        let thread = std::thread::Builder::new()
            .name("gsc-proxy".into())
            .spawn(move || engine.run())
            .map_err(|e| Error::new(Status::NoResource, format!("cannot start the proxy thread: {e}")))?;
        let thread_id = thread.thread().id();
        Ok(Proxy { tx: Some(tx), runner: Runner::Thread { thread: Some(thread), thread_id }, counters })
    }

    /// A proxy without a thread: `run_in_caller` does its passes.
    pub(crate) fn in_caller(worker: Weak<WorkerInner>) -> Proxy {
        let (tx, rx) = crossbeam_channel::unbounded();
        let counters = Arc::new(ProxyCounters::default());
        // Spin and poll periods only pace a thread's sleeping; a caller decides its own pace.
        let engine = Engine::new(worker, rx, Duration::ZERO, Duration::ZERO, counters.clone());
        Proxy { tx: Some(tx), runner: Runner::Caller(Mutex::new(engine)), counters }
    }

    /// One pass of a caller-run proxy: take what was armed, start what triggered, progress the
    /// worker (`Worker::progress_core`), and return the events. `None` (nothing done) for a
    /// thread proxy, or while another thread is in a pass.
    pub(crate) fn run_in_caller(&self, worker: &Worker) -> Option<usize> {
        let Runner::Caller(engine) = &self.runner else { return None };
        let Ok(mut engine) = engine.try_lock() else { return None };
        engine.take_pending();
        let events = engine.pass(worker);
        engine.publish_holdings();
        Some(events)
    }

    pub(crate) fn send(&self, msg: Msg) -> Result<()> {
        let tx = self.tx.as_ref().expect("set until drop");
        // Counted before the proxy can start it: `armed` never reads below `started`.
        bump(&self.counters.armed);
        tx.send(msg).map_err(|_| {
            self.counters.armed.fetch_sub(1, Ordering::Relaxed);
            Error::new(Status::Internal, "the proxy thread has exited")
        })
    }

    /// Tests: make the proxy's next pass panic, to show what a bug there does to the operations
    /// waiting on it.
    #[cfg(test)]
    pub(crate) fn inject_panic(&self) {
        let _ = self.tx.as_ref().expect("set until drop").send(Msg::PanicNextPass);
    }

    /// Fail every armed operation with `error` (their producers are released with an error
    /// mark), and every one armed later. Waits for the proxy thread to have done it, at most
    /// `wait`; a caller-run proxy does it here.
    pub(crate) fn abort(&self, error: Error, wait: Duration) {
        let (done_tx, done_rx) = crossbeam_channel::bounded(1);
        let sent = self.tx.as_ref().expect("set until drop").send(Msg::Abort(error, done_tx)).is_ok();
        match &self.runner {
            // Applied now, unless a pass is running — on this very thread (abort from a
            // completion callback) or another: that pass, or the next, takes the message.
            Runner::Caller(engine) => {
                if let Ok(mut engine) = engine.try_lock() {
                    engine.take_pending();
                }
            }
            // Waiting for our own acknowledgement (abort from a callback the proxy thread
            // runs) would only cost the whole `wait`.
            Runner::Thread { thread_id, .. } if std::thread::current().id() == *thread_id => {}
            Runner::Thread { .. } => {
                if sent {
                    let _ = done_rx.recv_timeout(wait);
                }
            }
        }
    }

    pub(crate) fn activity(&self) -> ProxyActivity {
        let read = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ProxyActivity { armed: read(&self.counters.armed), started: read(&self.counters.started), passes: read(&self.counters.passes) }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        // Disconnecting the channel tells the thread to finish; it fails what it still holds.
        drop(self.tx.take());
        match &mut self.runner {
            Runner::Thread { thread, thread_id } => {
                if let Some(t) = thread.take() {
                    // The worker's last reference can be dropped by the proxy thread itself (it
                    // holds one while it works); joining itself would deadlock, and it is
                    // exiting anyway.
                    if std::thread::current().id() != *thread_id {
                        let _ = t.join();
                    }
                }
            }
            Runner::Caller(engine) => {
                let engine = engine.get_mut().unwrap_or_else(|e| e.into_inner());
                engine.take_pending();
                engine.shutdown();
            }
        }
    }
}

/// The armed operations of one channel, oldest first.
struct ArmedQueue {
    channel: Arc<Channel>,
    ops: VecDeque<ArmedOp>,
    /// When the head was first seen triggered but not ready (a staged send's bytes).
    head_since: Option<Instant>,
}

/// Put `item` into `q` (ordered by `key`) after every item whose key is not larger: two threads
/// issuing on one condition may hand their operations over in the other order than they were
/// numbered, and items with equal keys keep the order they came in. From the back: the new one
/// is almost always the last.
fn insert_in_order<T>(q: &mut VecDeque<T>, item: T, key: impl Fn(&T) -> u64) {
    let k = key(&item);
    let at = q.iter().rposition(|o| key(o) <= k).map_or(0, |i| i + 1);
    q.insert(at, item);
}

struct Engine {
    worker: Weak<WorkerInner>,
    rx: Receiver<Msg>,
    /// One-shot operations waiting for their trigger, one queue per channel in issue (= seq)
    /// order: a pass looks at each queue's head only, however far ahead the producer issued.
    armed: Vec<ArmedQueue>,
    /// With when its next epoch was first seen triggered but not ready.
    persistent: Vec<(PersistentOp, Option<Instant>)>,
    /// Started operations not yet complete: (channel, seq).
    in_flight: Vec<(Arc<Channel>, u64)>,
    spin: Duration,
    poll: Duration,
    last_activity: Instant,
    disconnected: bool,
    counters: Arc<ProxyCounters>,
    /// Set by `Msg::Abort`: what every armed operation, and every later one, fails with.
    aborted: Option<Error>,
    /// When started operations were last checked against `GSC_TIMEOUT`.
    last_expiry_check: Instant,
    /// The heartbeat period: the longest the thread may sleep. `None` for a caller-run proxy
    /// (it sleeps in no call of its own) and with `GSC_HEARTBEAT_TIMEOUT=inf`.
    beat: Option<Duration>,
    /// After the last pass some link still had frames waiting to leave (`Worker::lanes_sending`).
    lanes_sending: bool,
    /// This engine's part of the process's outstanding operations (`outstanding`).
    share: outstanding::Share,
    /// Tests: the next pass panics (`Msg::PanicNextPass`).
    #[cfg(test)]
    panic_next_pass: bool,
}

/// How often the thread passes while only lanes' frames wait to leave (`Worker::lanes_sending`).
const SENDING_POLL: Duration = Duration::from_micros(100);

/// How `wait_for_work` ended.
#[derive(Copy, Clone, PartialEq, Eq)]
enum Wake {
    /// Time to exit.
    Exit,
    /// Run a pass; `slept`: after a sleep (a message, or the persistent triggers' poll), not a
    /// spin.
    Pass { slept: bool },
    /// Idle and the beat period passed: beat, run no pass.
    Beat,
}

impl Engine {
    fn new(worker: Weak<WorkerInner>, rx: Receiver<Msg>, spin: Duration, poll: Duration, counters: Arc<ProxyCounters>) -> Engine {
        Engine {
            worker,
            rx,
            armed: Vec::new(),
            persistent: Vec::new(),
            in_flight: Vec::new(),
            spin,
            poll,
            last_activity: Instant::now(),
            disconnected: false,
            counters,
            aborted: None,
            last_expiry_check: Instant::now(),
            beat: None,
            lanes_sending: false,
            share: outstanding::Share::default(),
            #[cfg(test)]
            panic_next_pass: false,
        }
    }

    fn run(mut self) {
        tracing::debug!(target: "gsc::proxy", "proxy thread started");
        let mut idle_spins = 0u32;
        loop {
            let wake = self.wait_for_work(idle_spins);
            self.publish_holdings();
            if wake == Wake::Exit {
                break;
            }
            let Some(worker) = self.worker.upgrade().map(|inner| Worker { inner }) else { break };
            // After a sleep the 64-pass check inside `progress` may be far off (one pass per
            // GSC_PROXY_POLL, or none at all while idle); spinning passes reach it on their own.
            if matches!(wake, Wake::Beat | Wake::Pass { slept: true }) && self.beat.is_some() {
                worker.heartbeat();
            }
            if wake == Wake::Beat {
                continue;
            }
            // A panic in a pass is a bug, but it must not leave every stream and request
            // waiting on this thread forever (issue #8, promise 1): the worker is aborted with
            // the panic's message, which completes everything with an error, and the thread
            // goes on serving (an aborted worker's operations fail fast).
            let events = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.pass(&worker))) {
                Ok(events) => events,
                Err(panic) => {
                    let what = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "a panic without a message".into());
                    tracing::error!(target: "gsc::proxy", panic = %what, "the proxy thread panicked; aborting its worker");
                    let _ = worker.abort(&format!("internal error in the proxy thread: {what}"));
                    1
                }
            };
            drop(worker);
            self.publish_holdings();
            if events > 0 {
                self.last_activity = Instant::now();
                idle_spins = 0;
            } else {
                idle_spins = idle_spins.saturating_add(1);
            }
        }
        self.shutdown();
    }

    /// Take new messages; sleep first when nothing needs watching.
    fn wait_for_work(&mut self, idle_spins: u32) -> Wake {
        let busy = !self.armed.is_empty() || !self.in_flight.is_empty();
        let go_on = |go: bool, slept: bool| if go { Wake::Pass { slept } } else { Wake::Exit };
        let mut slept = false;
        let msg = if self.disconnected {
            return go_on(busy, false);
        } else if busy || (!self.persistent.is_empty() && self.last_activity.elapsed() < self.spin) {
            if idle_spins > 0 && idle_spins % 64 == 0 {
                // Spinning, but let a producer thread on the same core run.
                std::thread::yield_now();
            }
            match self.rx.try_recv() {
                Ok(m) => Some(m),
                Err(TryRecvError::Empty) => None,
                Err(TryRecvError::Disconnected) => {
                    self.disconnected = true;
                    None
                }
            }
        } else if self.lanes_sending {
            // Only frames of senders that already completed wait to leave (UCX): no one waits on
            // them this instant, so poll instead of spinning — a peer that stopped reading would
            // otherwise keep this thread at 100 % until the link fails.
            slept = true;
            match self.rx.recv_timeout(SENDING_POLL) {
                Ok(m) => Some(m),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => {
                    self.disconnected = true;
                    None
                }
            }
        } else if !self.persistent.is_empty() {
            slept = true;
            match self.rx.recv_timeout(self.beat.map_or(self.poll, |b| b.min(self.poll))) {
                Ok(m) => Some(m),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => {
                    self.disconnected = true;
                    None
                }
            }
        } else if let Some(beat) = self.beat {
            // Idle, but the promised heartbeat must go on: sleep at most one beat period.
            match self.rx.recv_timeout(beat) {
                Ok(m) => {
                    slept = true;
                    Some(m)
                }
                Err(RecvTimeoutError::Timeout) => return Wake::Beat,
                Err(RecvTimeoutError::Disconnected) => return Wake::Exit,
            }
        } else {
            match self.rx.recv() {
                Ok(m) => {
                    slept = true;
                    Some(m)
                }
                Err(_) => return Wake::Exit,
            }
        };
        if let Some(m) = msg {
            self.take(m);
            while let Ok(m) = self.rx.try_recv() {
                self.take(m);
            }
        }
        go_on(!self.disconnected || busy, slept)
    }

    /// Take every message waiting in the channel (a caller-run proxy's start of a pass).
    fn take_pending(&mut self) {
        while let Ok(m) = self.rx.try_recv() {
            self.take(m);
        }
    }

    fn take(&mut self, msg: Msg) {
        self.last_activity = Instant::now();
        if matches!(msg, Msg::Arm(_) | Msg::Persist(_)) {
            self.share.adopt();
        }
        if let Some(e) = self.aborted.clone() {
            // Armed after the abort (the operation passed the worker's check just before it):
            // its request completes with the abort error, which also releases its producer.
            match msg {
                Msg::Arm(op) => match self.worker.upgrade() {
                    Some(inner) => Worker { inner }.start_armed(op.req, &op.start, Some(e)),
                    None => op.channel.fail(e),
                },
                Msg::Persist(op) => op.channel.fail(e),
                Msg::Abort(_, done) => drop(done.send(())),
                #[cfg(test)]
                Msg::PanicNextPass => {}
            }
            return;
        }
        match msg {
            Msg::Arm(op) => match self.armed.iter_mut().find(|q| Arc::ptr_eq(&q.channel, &op.channel)) {
                Some(q) => insert_in_order(&mut q.ops, op, |o| o.seq),
                None => self.armed.push(ArmedQueue { channel: op.channel.clone(), ops: VecDeque::from([op]), head_since: None }),
            },
            Msg::Persist(op) => self.persistent.push((op, None)),
            Msg::Abort(e, done) => {
                self.abort(e);
                let _ = done.send(());
            }
            #[cfg(test)]
            Msg::PanicNextPass => self.panic_next_pass = true,
        }
    }

    /// Fail what is armed with `error`, and remember it for what comes later. Operations
    /// already started are failed by the worker (their links are failed).
    fn abort(&mut self, error: Error) {
        for op in self.armed.drain(..).flat_map(|q| q.ops) {
            op.channel.fail(error.clone());
        }
        for (p, _) in self.persistent.drain(..) {
            p.channel.fail(error.clone());
        }
        self.aborted = Some(error);
    }

    /// Start whatever was triggered, progress the worker. Returns the number of events (the
    /// proxy's own: they keep it spinning).
    fn pass(&mut self, worker: &Worker) -> usize {
        #[cfg(test)]
        if std::mem::take(&mut self.panic_next_pass) {
            panic!("a panic injected by a test");
        }
        bump(&self.counters.passes);
        let mut events = 0;
        // In the order they were armed: sends with one tag to one peer that trigger together
        // (a group) must go out in issue order (MPI's non-overtaking rule).
        for q in &mut self.armed {
            let trigger = q.channel.trigger();
            while let Some(op) = q.ops.front().filter(|op| op.seq <= trigger) {
                let late = match readiness(op.stage.as_ref(), None, &mut q.head_since) {
                    Readiness::NotYet => break,
                    Readiness::Ready => None,
                    Readiness::Late(e) => Some(e),
                };
                let op = q.ops.pop_front().expect("checked");
                timeline::record(Event::Trigger, op.req as u64);
                bump(&self.counters.started);
                worker.start_armed(op.req, &op.start, late);
                self.in_flight.push((op.channel, op.seq));
                events += 1;
            }
        }
        self.armed.retain(|q| !q.ops.is_empty());
        // A persistent operation nobody else refers to any more (its graphs were destroyed, its
        // condition released) can never trigger again: stop watching it.
        self.persistent.retain(|(p, _)| Arc::strong_count(&p.channel) > 1);
        for (p, since) in &mut self.persistent {
            let trigger = p.channel.trigger();
            while p.started < trigger {
                let epoch = p.started + 1;
                let late = match readiness(p.channel.stage.as_ref(), Some(epoch), since) {
                    Readiness::NotYet => break,
                    Readiness::Ready => None,
                    Readiness::Late(e) => Some(e),
                };
                p.started = epoch;
                timeline::record(Event::Epoch, epoch);
                let signal = crate::condition::Signal::new(p.channel.clone(), epoch);
                bump(&self.counters.started);
                worker.start_epoch(&p.template, signal, late);
                self.in_flight.push((p.channel.clone(), epoch));
                events += 1;
            }
        }
        // Progress on every pass, not only with operations in flight: a message for a receive
        // that is about to trigger (a one-shot op armed, or a graph's next epoch) is then
        // already here, unexpected, when it does, and completes the receive at once. Only the
        // proxy's own operations count as activity (keep it spinning); traffic of the
        // application's host operations does not.
        let progressed = worker.progress_core();
        if !self.in_flight.is_empty() || !self.armed.is_empty() {
            events += progressed;
        }
        // Frames a lane took but has not sent yet (UCX) leave only through progress: keep
        // passing until they are out (`Link::sending`), or a sender that completed would leave
        // its data, even a new link's hello, sitting in this process.
        self.lanes_sending = worker.lanes_sending();
        // Not `done_word`: its error bit, set by the first failure, would drop every later
        // operation of the channel from the watch below while it still runs (a receive that
        // timed out a moment before its send: the send then never would).
        self.in_flight.retain(|(c, seq)| c.completed_through() < *seq);
        // Started operations whose peer stopped answering (without dying) would hold their
        // producers forever: a few times a second, fail those older than GSC_TIMEOUT.
        if !self.in_flight.is_empty() && self.last_expiry_check.elapsed() > EXPIRY_CHECK_INTERVAL {
            self.last_expiry_check = Instant::now();
            events += worker.expire_stream_ops();
        }
        events
    }

    /// Publish what this engine holds now (`outstanding`): armed, in flight, persistent.
    fn publish_holdings(&mut self) {
        let armed: usize = self.armed.iter().map(|q| q.ops.len()).sum();
        self.share.publish(armed + self.in_flight.len() + self.persistent.len());
    }

    /// The worker is gone or dropped its proxy: nothing will start the operations still armed,
    /// so their producers are released with an error instead of waiting forever.
    fn shutdown(&mut self) {
        let gone = || Error::new(Status::Canceled, "the worker was destroyed before the operation's condition was met");
        // Messages still on their way too: they would otherwise be dropped with the channel,
        // their producers never released (and still counted as outstanding).
        while let Ok(m) = self.rx.try_recv() {
            self.take(m);
        }
        for op in self.armed.drain(..).flat_map(|q| q.ops) {
            op.channel.fail(gone());
        }
        for (p, _) in self.persistent.drain(..) {
            p.channel.fail(gone());
        }
        self.in_flight.clear();
        self.publish_holdings();
        tracing::debug!(target: "gsc::proxy", "proxy thread exited");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn armed_operations_queue_by_sequence_keeping_issue_order_within_one() {
        let mut q: VecDeque<(u64, char)> = VecDeque::new();
        for item in [(5, 'a'), (7, 'b'), (6, 'c'), (7, 'd'), (4, 'e'), (6, 'f')] {
            insert_in_order(&mut q, item, |&(seq, _)| seq);
        }
        let order: String = q.iter().map(|&(_, c)| c).collect();
        assert_eq!(order, "eacfbd");
    }
}
