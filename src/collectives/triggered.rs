//! Collectives on kernel-triggered conditions: a user kernel starts one with `gsc_trigger` and
//! waits for it with `gsc_wait` (include/gsc_device.cuh), as many times as it likes.
//!
//! Arming such a collective captures it, once, into a CUDA graph on a stream of gscomm's own:
//! the call takes the path it would take captured on a stream (the ranks exchange buffers
//! then, once, as for any capture), and the graph ends with a node that advances the
//! operation's done word (`gsc_coll_triggered_done`, with the error bit when a round failed).
//! A watcher thread per communicator, started by the first such call, reads the trigger words
//! of the armed collectives and launches the graph once per trigger on a launch stream of its
//! own. So the host is in the loop to launch only: the completion goes from the GPU to the
//! waiting kernel without it, and the thread never waits for a stream.
//!
//! Order: as for any collective, every rank performs the same collectives in the same order.
//! The watcher launches the triggers it sees, collective by collective in arm order, so a
//! kernel must wait for one of a communicator's triggered collectives before it triggers
//! another one of the same communicator (triggers of one collective back to back are fine:
//! they launch in order). Triggered collectives share the communicator's workspace with the
//! ones issued on streams, so the two must not run at the same time either.
//!
//! Room: the collective's kernels run beside the kernel that triggered it, which must leave
//! the GPU room for them (a few blocks, not one per SM all spinning in `gsc_wait`).
//!
//! Failure: a collective that gives up on a peer (`GSC_TIMEOUT`) or finds the communicator
//! aborted sets the done word's error bit: `gsc_wait` returns -1, `Condition::query` and
//! `Communicator::async_error` report it. Dropping the communicator waits for what it
//! launched (as for every collective, the work must be done by then: `gsc_comm_destroy`) and
//! fails its triggered collectives: a trigger that was not launched, or comes later, finds
//! the error bit set and its wait returns -1 at once.
//!
//! Idle: like the proxy (src/proxy/), the thread spins for `GSC_PROXY_SPIN` after its last
//! launch and then polls every `GSC_PROXY_POLL`; with nothing armed it sleeps.
//!
//! Small all-reduces (`GSC_COLL_TRIGGER_MAX`, `on_device`) skip all of that: the triggering
//! thread runs them itself (`gsc_coll_trigger` in include/gsc_device.cuh). Arming gives every
//! rank a mailbox of LL words that the peers map (exchanged as the call's buffers are) and the
//! handle a descriptor of the call; `gsc_trigger` writes this rank's input into every peer's
//! mailbox and `gsc_wait` reduces what arrived in its own, in rank order, with the kernels'
//! arithmetic. No launch, no host: the round trip is the NVLink's, and the handle's done word
//! is in GPU memory. A failed round shows in `gsc_wait` (-1) and in the communicator's error
//! word (`async_error`), not in the condition's query (nothing on the host sees it). The
//! mailboxes live as long as the communicator (a peer may write into one until then); its
//! drop marks these handles failed, so a later trigger returns at once.

use super::peer_buffers::{self, DirectContext};
use super::types::DataType;
use crate::condition::{Category, Channel, Condition};
use crate::cuda::DeviceHandleSlot;
use crate::cuda::api::{GraphExec, Stream};
use crate::cuda::coll::{CollKind, MAX_RANKS, Workspace};
use crate::cuda::coll_device::{CollDevice, DeviceMemory};
use crate::error::{Error, Result, Status};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long the idle thread (nothing armed) sleeps between looks at its stop flag, when no
/// new collective wakes it first.
const IDLE_SLEEP: Duration = Duration::from_millis(100);

/// Whether a kernel-triggered call runs in the triggering thread (`arm_on_device`): an
/// all-reduce of 1 to `max` bytes (`GSC_COLL_TRIGGER_MAX`) on 2 to `MAX_RANKS` ranks, not of
/// 16-bit floats (the device header has no half arithmetic), not a pre-multiplied sum. A
/// function of the configuration and the call, so every rank decides alike.
pub(crate) fn on_device(max: usize, kind: CollKind, bytes: usize, dtype: DataType, premul: bool, nranks: usize) -> bool {
    kind == CollKind::AllReduce && (1..=max).contains(&bytes) && (2..=MAX_RANKS).contains(&nranks) && !premul && !dtype.is_narrow_float()
}

/// A call `arm_on_device` takes: its buffers and bytes, and NCCL's codes of its datatype and
/// operator (the device header's).
pub(crate) struct DeviceCall {
    pub(crate) send: u64,
    pub(crate) recv: u64,
    pub(crate) bytes: usize,
    pub(crate) dtype: u64,
    pub(crate) op: u64,
}

/// Bytes of a mailbox area (`Triggered::mailboxes`): room for hundreds of small all-reduces,
/// and a whole granule of the driver's (2 MiB on H100/H200), so the area shares its IPC
/// export with no other allocation.
const MAILBOX_AREA: usize = 2 << 20;
/// Mailboxes start on cache lines.
const MAILBOX_ALIGN: usize = 128;

/// A communicator's mailbox area, every rank's as this rank addresses it, and how much of it
/// mailboxes already took.
struct MailboxArea {
    mem: DeviceMemory,
    peers: Vec<u64>,
    len: usize,
    used: usize,
}

/// A communicator's kernel-triggered collectives: the watcher thread, once one is armed, and
/// the mailboxes and descriptors of those the triggering thread runs.
pub(crate) struct Triggered {
    device: i32,
    spin: Duration,
    poll: Duration,
    watcher: Mutex<Option<Watcher>>,
    /// Freed with the communicator, after the watcher stopped (`Drop` joins it first): the
    /// descriptors and full mailbox areas.
    on_device: Mutex<Vec<DeviceMemory>>,
    /// Where the next mailbox is cut from.
    mailbox_area: Mutex<Option<MailboxArea>>,
    /// The handles of the collectives the triggering thread runs: failed when the
    /// communicator goes, so that a later trigger returns at once.
    device_handles: Mutex<Vec<DeviceHandleSlot>>,
    /// Collectives armed to run in the triggering thread so far (tests check the path).
    armed_on_device: AtomicU64,
}

struct Watcher {
    arm: Option<Sender<Armed>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// One armed collective, as the watcher holds it.
struct Armed {
    channel: Arc<Channel>,
    /// The graph launched per trigger.
    exec: GraphExec,
    /// The last trigger launched (the channel's epochs count on from its base).
    launched: u64,
    /// The done word last taken into the channel's tracker.
    seen_done: u64,
    /// A launch failed: later triggers are not launched (the channel is failed).
    broken: bool,
    what: String,
}

impl Triggered {
    /// `spin` and `poll`: `GSC_PROXY_SPIN` and `GSC_PROXY_POLL`.
    pub(crate) fn new(device: i32, spin: Duration, poll: Duration) -> Triggered {
        Triggered {
            device,
            spin,
            poll,
            watcher: Mutex::new(None),
            on_device: Mutex::new(Vec::new()),
            mailbox_area: Mutex::new(None),
            device_handles: Mutex::new(Vec::new()),
            armed_on_device: AtomicU64::new(0),
        }
    }

    /// Collectives armed to run in the triggering thread so far.
    pub(crate) fn armed_on_device(&self) -> u64 {
        self.armed_on_device.load(Ordering::Relaxed)
    }

    /// Arm `call` to run in the triggering thread (`on_device` said yes): a mailbox here, every
    /// rank's exchanged, the descriptor, the handle. `Ok(None)`: some rank could not make or
    /// share its mailbox; every rank learnt it and nothing was armed (the launched path takes
    /// the call). Collective: every rank whose `on_device` said yes calls it.
    pub(crate) fn arm_on_device(&self, on: &Condition, what: String, cx: &DirectContext, call: DeviceCall) -> Result<Option<u64>> {
        let (n, me) = (cx.nranks, cx.rank);
        let Some(boxes) = self.mailboxes(cx, CollDevice::mailbox_bytes(n, call.bytes))? else {
            return Ok(None);
        };
        let (abort, error) = cx.workspace.failure_words();
        let mut desc = CollDevice {
            send: call.send,
            recv: call.recv,
            bytes: call.bytes as u64,
            words: call.bytes.div_ceil(4) as u64,
            dtype: call.dtype,
            op: call.op,
            nranks: n as u64,
            rank: me as u64,
            timeout_ns: cx.timeout_ns,
            round: 0,
            abort,
            error,
            ..Default::default()
        };
        desc.boxes[..n].copy_from_slice(&boxes);
        let desc = DeviceMemory::descriptor(self.device, &desc)?;
        let slot = on.collective_kernel_handle(desc.addr())?;
        let handle = slot.addr();
        self.on_device.lock().unwrap_or_else(|e| e.into_inner()).push(desc);
        self.device_handles.lock().unwrap_or_else(|e| e.into_inner()).push(slot);
        tracing::debug!(target: "gsc::coll", what, "armed to run in the triggering thread");
        self.armed_on_device.fetch_add(1, Ordering::Relaxed);
        Ok(Some(handle))
    }

    /// A mailbox of `len` zeroed bytes on every rank, as this rank addresses each: cut from the
    /// communicator's mailbox area, at the same offset on every rank (every rank arms the same
    /// collectives in the same order, so every rank cuts alike), so that the area is exchanged
    /// once, not per collective. A new area, exchanged, when the current one is full (on every
    /// rank at the same call). `None`: some rank could not make or share one (every rank
    /// learnt it).
    fn mailboxes(&self, cx: &DirectContext, len: usize) -> Result<Option<Vec<u64>>> {
        let len = len.next_multiple_of(MAILBOX_ALIGN);
        let mut area = self.mailbox_area.lock().unwrap_or_else(|e| e.into_inner());
        if area.as_ref().is_none_or(|a| a.used + len > a.len) {
            let area_len = len.max(MAILBOX_AREA);
            let mem = DeviceMemory::zeroed(self.device, area_len);
            if let Err(e) = &mem {
                tracing::debug!(target: "gsc::coll", error = %e, "no mailbox area for small kernel-triggered all-reduces; every rank launches them instead");
            }
            let at = mem.as_ref().map_or(0, DeviceMemory::addr);
            let exchanged =
                peer_buffers::exchange_buffer(cx, at, area_len, mem.is_ok(), "the mailboxes of small kernel-triggered all-reduces")?;
            let Some(peers) = exchanged else { return Ok(None) };
            if let Some(old) = area.take() {
                // Peers may write into the old area's mailboxes until the communicator goes.
                self.on_device.lock().unwrap_or_else(|e| e.into_inner()).push(old.mem);
            }
            *area = Some(MailboxArea { mem: mem.expect("every rank, this one too, has its area"), peers, len: area_len, used: 0 });
        }
        let a = area.as_mut().expect("made above");
        let at = a.used as u64;
        a.used += len;
        Ok(Some(a.peers.iter().map(|p| p + at).collect()))
    }
    /// Arm a collective on kernel-triggered condition `on`: capture `issue` (the collective, on
    /// the stream condition it is given) into a graph ending in the done node, and hand it to
    /// the watcher. Returns the device handle the user's kernel triggers. Collective as
    /// `issue` is: every rank arms the same collective. `what` names it in errors.
    pub(crate) fn arm(
        &self,
        on: &Condition,
        what: String,
        workspace: &Workspace,
        kernel_cache: Option<&Path>,
        issue: impl FnOnce(&Condition) -> Result<()>,
    ) -> Result<u64> {
        let ctx = crate::cuda::copy::primary_context(self.device)?;
        let _scope = crate::cuda::CtxScope::enter(ctx)?;
        let capture = Stream::new()?;
        let cond = Condition::cuda(Category::Stream, capture.raw(), kernel_cache.map(Path::to_path_buf))?;
        capture.begin_capture()?;
        // The handle only once the collective is captured: a handle whose triggers nothing
        // would launch must not exist. After it, a failure fails the channel (waits return).
        let mut armed = None;
        let issued = issue(&cond).and_then(|()| {
            let (channel, handle) = on.arm_device_handle()?;
            let done = channel.words.device.expect("pinned words").1;
            armed = Some((channel.clone(), handle));
            workspace.launch_triggered_done(capture.raw(), kernel_cache, done)
        });
        // Always ended: an open capture would leave the stream unusable.
        let graph = capture.end_capture();
        let built = issued.and_then(|()| graph?.instantiate()).and_then(|exec| {
            let (channel, _) = armed.as_ref().expect("armed once issued");
            let base = channel.completed_through();
            self.hand_over(
                ctx as usize,
                Armed { channel: channel.clone(), exec, launched: base, seen_done: base, broken: false, what: what.clone() },
            )
        });
        match (built, armed) {
            (Ok(()), Some((_, handle))) => Ok(handle),
            (Err(e), armed) => {
                let e = e.context(format!("arming {what} on a kernel-triggered condition"));
                if let Some((channel, _)) = armed {
                    channel.fail(e.clone());
                }
                Err(e)
            }
            (Ok(()), None) => unreachable!("handed over only once armed"),
        }
    }

    /// Give `armed` to the watcher, starting it if this is the first.
    fn hand_over(&self, ctx: usize, armed: Armed) -> Result<()> {
        let mut w = self.watcher.lock().unwrap_or_else(|e| e.into_inner());
        if w.is_none() {
            let stream = Stream::new()?;
            let (tx, rx) = crossbeam_channel::unbounded();
            let stop = Arc::new(AtomicBool::new(false));
            let (spin, poll, stop2) = (self.spin, self.poll, stop.clone());
            let thread = std::thread::Builder::new()
                .name(format!("gsc-triggered-{}", self.device))
                .spawn(move || watch(ctx, stream, rx, stop2, spin, poll))
                .map_err(|e| Error::new(Status::NoResource, format!("starting the kernel-triggered collectives' thread: {e}")))?;
            *w = Some(Watcher { arm: Some(tx), stop, thread: Some(thread) });
        }
        let sender = w.as_ref().and_then(|w| w.arm.as_ref()).expect("started above");
        sender.send(armed).map_err(|_| Error::new(Status::Internal, "the kernel-triggered collectives' thread has ended"))
    }
}

impl Drop for Triggered {
    fn drop(&mut self) {
        let w = self.watcher.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = w.as_mut() {
            w.stop.store(true, Ordering::Release);
            w.arm.take();
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
        // Before the mailboxes and descriptors go (the fields, after this): a trigger from now
        // on finds its handle failed and touches neither.
        for slot in self.device_handles.get_mut().unwrap_or_else(|e| e.into_inner()).drain(..) {
            if let Err(e) = slot.fail_collective() {
                tracing::warn!(target: "gsc::coll", error = %e, "a kernel-triggered all-reduce's handle could not be marked failed");
            }
        }
    }
}

/// The watcher thread: launch every new trigger of every armed collective, in arm order.
fn watch(ctx: usize, stream: Stream, rx: Receiver<Armed>, stop: Arc<AtomicBool>, spin: Duration, poll: Duration) {
    let scope = crate::cuda::CtxScope::enter(crate::cuda::raw(ctx));
    let mut armed: Vec<Armed> = Vec::new();
    let mut last_launch = Instant::now();
    while !stop.load(Ordering::Acquire) {
        let next = match armed.is_empty() {
            true => rx.recv_timeout(IDLE_SLEEP).map_err(|e| e == RecvTimeoutError::Disconnected),
            false => rx.try_recv().map_err(|e| e == TryRecvError::Disconnected),
        };
        match next {
            Ok(a) => armed.push(a),
            Err(true) => break,
            Err(false) => {}
        }
        let mut launched = false;
        for a in armed.iter_mut() {
            launched |= launch_new_triggers(a, &stream, scope.as_ref().err());
            let done = a.channel.done_word();
            if done != a.seen_done {
                a.seen_done = done;
                a.channel.adopt_device_done(&a.what);
            }
        }
        // Gone: only this thread refers to it (its condition was released) and its launches
        // completed (the graph no longer writes its words).
        armed.retain(|a| Arc::strong_count(&a.channel) > 1 || a.channel.completed_through() < a.launched);
        if launched {
            last_launch = Instant::now();
        } else if !armed.is_empty() {
            match last_launch.elapsed() < spin {
                true => std::hint::spin_loop(),
                false => std::thread::sleep(poll),
            }
        }
    }
    // What was launched completes (the collective kernels' own timeout bounds it). Then every
    // armed collective fails: a trigger not launched yet, or one a kernel makes later, would
    // otherwise wait for ever; with the error bit set every wait returns at once.
    let _ = stream.synchronize();
    for a in &armed {
        a.channel.adopt_device_done(&a.what);
        a.channel.fail(Error::new(Status::Canceled, format!("{}: its communicator was destroyed", a.what)));
    }
}

/// Launch `a`'s triggers since the last pass; whether any was. `no_context`: the thread could
/// not make the device's context current, so no launch can succeed.
fn launch_new_triggers(a: &mut Armed, stream: &Stream, no_context: Option<&Error>) -> bool {
    let trigger = a.channel.trigger();
    let mut any = false;
    while !a.broken && a.launched < trigger {
        let launched = match no_context {
            Some(e) => Err(e.clone()),
            None => a.exec.launch(stream),
        };
        match launched {
            Ok(()) => {
                a.launched += 1;
                any = true;
            }
            Err(e) => {
                a.broken = true;
                a.channel.fail(e.context(format!("launching {} for trigger {}", a.what, a.launched + 1)));
            }
        }
    }
    any
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_small_all_reduces_of_whole_types_run_in_the_triggering_thread() {
        let f = |kind, bytes, dtype, premul, n| on_device(256, kind, bytes, dtype, premul, n);
        assert!(f(CollKind::AllReduce, 8, DataType::Float32, false, 2));
        assert!(f(CollKind::AllReduce, 256, DataType::Int8, false, 8));
        assert!(f(CollKind::AllReduce, 1, DataType::Uint8, false, 4), "any size from 1 byte");
        assert!(!f(CollKind::AllReduce, 257, DataType::Float32, false, 2), "above GSC_COLL_TRIGGER_MAX");
        assert!(!f(CollKind::AllReduce, 0, DataType::Float32, false, 2), "nothing to move");
        assert!(!f(CollKind::AllGather, 8, DataType::Float32, false, 2), "all-reduces only");
        assert!(!f(CollKind::AllReduce, 8, DataType::Float16, false, 2), "no half arithmetic on the device");
        assert!(!f(CollKind::AllReduce, 8, DataType::Bfloat16, false, 2));
        assert!(!f(CollKind::AllReduce, 8, DataType::Float32, true, 2), "pre-multiplied sums");
        assert!(!f(CollKind::AllReduce, 8, DataType::Float32, false, 1), "one rank");
        assert!(!f(CollKind::AllReduce, 8, DataType::Float32, false, MAX_RANKS + 1));
        assert!(!on_device(0, CollKind::AllReduce, 8, DataType::Float32, false, 2), "0: never");
    }
}
