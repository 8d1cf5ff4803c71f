//! The fault matrix of issue #8 on a machine without a GPU (docs/RELIABILITY.md): a peer is
//! SIGKILLed (or SIGSTOPped) while the survivor talks to it, on every lane that reaches another
//! process here — shm, and UCX over TCP where libucp loads — for each condition kind that needs
//! no GPU (none: the calling thread issues and waits; a host stream, whose later work waits for
//! the operation), as sender and as receiver, with eager and rendezvous messages.
//!
//! Every case proves its fault fired (waitpid says SIGKILL; /proc says stopped), has hard time
//! limits (the parent's deadlines, the children's watchdog), and requires the survivor's
//! operation to end with the right error within a bound measured from the kill on one clock
//! (CLOCK_MONOTONIC, shared by the processes of a host):
//!
//! - an operation tied to the dead peer's link (a send, a receive whose data was arriving) ends
//!   with `PeerFailed` or `ConnectionReset` within `DETECT`;
//! - a receive that nothing matched yet is on no link (tag matching takes any peer), so only
//!   `GSC_TIMEOUT` ends it: `TimedOut`, within `GSC_TIMEOUT` + `SLACK`;
//! - a stopped peer looks alive, so its operations end with `TimedOut` after `GSC_TIMEOUT`.
//!
//! With a host stream, the stream's later work must run (the wait was released with the error
//! mark) and the condition must report the error. After the fault, a send on the survivor's
//! endpoint must fail with the link's error.
//!
//! Both peers are children of the test (each gets its own UCX environment); the test relays
//! addresses, kills and collects the survivor's verdict. The loopback lane joins workers of one
//! process, where no peer can die alone: its analog (the peer's worker aborted) is in
//! tests/abort.rs.
mod common;

use common::*;
use gscomm::condition::{Condition, HostStream};
use gscomm::{Endpoint, RequestParams, Started, Status, Worker};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The parent's deadline for any one message from a child.
const T: Duration = Duration::from_secs(30);
/// A dead peer's link must fail within this of the kill. The mechanisms are much faster (shm:
/// the liveness check every GSC_PEER_CHECK_INTERVAL, 50 ms here; UCX over TCP: the kernel
/// closes the dead process's sockets at once); the rest is room for a loaded CI machine.
const DETECT: Duration = Duration::from_secs(3);
/// The survivor's GSC_TIMEOUT in the kill cases.
const KILL_TIMEOUT: Duration = Duration::from_secs(2);
/// ... and in the stop cases.
const STOP_TIMEOUT: Duration = Duration::from_secs(1);
/// Beyond GSC_TIMEOUT: the proxy checks started stream operations every 200 ms, plus room.
const SLACK: Duration = Duration::from_millis(1500);
const EAGER: usize = 1000;
const RNDV: usize = 64 << 20;
/// Operations that must succeed before the kill, so the fault hits a flow that worked.
const BEFORE: u64 = 20;

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum LaneUnderTest {
    Shm,
    Ucx,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Case {
    /// The victim is killed while the survivor sends to it.
    KillReceiver { host: bool, rndv: bool },
    /// The victim is killed while it sends to the survivor.
    KillSender { host: bool, rndv: bool },
    /// The victim is stopped; the survivor's rendezvous send to it and receive from it time out.
    Stop { host: bool },
}

impl Case {
    fn name(self) -> String {
        let (what, host, size) = match self {
            Case::KillReceiver { host, rndv } => ("kill-receiver", host, if rndv { "rndv" } else { "eager" }),
            Case::KillSender { host, rndv } => ("kill-sender", host, if rndv { "rndv" } else { "eager" }),
            Case::Stop { host } => ("stop", host, "both"),
        };
        format!("{what}.{}.{size}", if host { "host" } else { "none" })
    }

    fn parse(s: &str) -> Case {
        let parts: Vec<&str> = s.split('.').collect();
        let host = parts[1] == "host";
        let rndv = parts[2] == "rndv";
        match parts[0] {
            "kill-receiver" => Case::KillReceiver { host, rndv },
            "kill-sender" => Case::KillSender { host, rndv },
            "stop" => Case::Stop { host },
            other => panic!("unknown case {other}"),
        }
    }

    fn host(self) -> bool {
        match self {
            Case::KillReceiver { host, .. } | Case::KillSender { host, .. } | Case::Stop { host } => host,
        }
    }

    /// Config overrides for (survivor, victim).
    fn config(self, lane: LaneUnderTest, dir: &str) -> (Vec<(String, String)>, Vec<(String, String)>) {
        let mut common = vec![("GSC_TLS", if lane == LaneUnderTest::Shm { "shm" } else { "ucx" }), ("GSC_SHM_DIR", dir)];
        common.push(("GSC_PEER_CHECK_INTERVAL", "50ms"));
        if let Case::KillSender { rndv: true, .. } = self {
            // The data must still be moving when the sender dies, so it goes in frames that the
            // survivor takes in only while it progresses (the get scheme reads it all with one
            // CMA call; the sender-survivor cases cover a receiver that dies before its read).
            common.push(("GSC_RNDV_SCHEME", "pipeline"));
        }
        let owned = |v: &[(&str, &str)]| v.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>();
        let mut survivor = owned(&common);
        let timeout = if matches!(self, Case::Stop { .. }) { STOP_TIMEOUT } else { KILL_TIMEOUT };
        survivor.push(("GSC_TIMEOUT".into(), format!("{}ms", timeout.as_millis())));
        if let Case::KillSender { host: true, rndv: true } = self {
            // No proxy thread: the host stream's operation is progressed by the survivor's own
            // calls, so it can stop taking data in while the sender is killed (with a proxy the
            // 64 MiB could all arrive before the kill). The stream still waits for it.
            survivor.push(("GSC_PROXY_THREAD".into(), "off".into()));
        }
        let mut victim = owned(&common);
        victim.push(("GSC_TIMEOUT".into(), "30s".into()));
        (survivor, victim)
    }
}

fn refs(v: &[(String, String)]) -> Vec<(&str, &str)> {
    v.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

// ---------------------------------------------------------------------------------------------
// The survivor's operations, on no condition or on a host stream

/// One operation issued by the survivor.
struct Issued {
    h: Option<u64>,
    recv: bool,
    /// Host stream: check the stream's synchronize against the request (only the first
    /// synchronize after a failure reports it).
    sync: bool,
    /// Host stream: set by work launched right after the operation, once the stream ran it.
    later: Option<Arc<AtomicBool>>,
}

/// How one operation ended.
struct Ended {
    status: Status,
    /// CLOCK_MONOTONIC when the survivor saw it end.
    at: u64,
    /// Host stream: whether the work after the operation ran.
    later_ran: Option<bool>,
    /// The operation was refused by the call that issued it (the stream never saw it).
    refused: bool,
}

struct Ops<'a> {
    w: &'a Worker,
    ep: &'a Endpoint,
    host: Option<(HostStream, Condition)>,
    /// No proxy thread (host stream only): the survivor progresses while it waits.
    self_progress: bool,
}

impl Ops<'_> {
    fn params(&self) -> RequestParams {
        match &self.host {
            Some((_, c)) => on(c, true),
            None => RequestParams::default(),
        }
    }

    /// Issue a send of `len` bytes from `buf` or a receive into it. `Err`: refused at once.
    fn start(&self, recv: bool, buf: *mut u8, len: usize, tag: u64) -> Result<Issued, Status> {
        // SAFETY: callers keep `buf` alive and untouched until `finish` returned, or for good
        // (the survivor never frees a buffer an unfinished operation may still use).
        let r = unsafe {
            if recv {
                self.w.tag_recv_nbx(buf, len, tag, u64::MAX, self.params())
            } else {
                self.ep.tag_send_nbx(buf, len, tag, self.params())
            }
        };
        let h = match r.map_err(|e| e.status())? {
            Started::Pending(h) => Some(h),
            Started::Done(_) => None,
            Started::Armed(_) => unreachable!("no graph or kernel condition here"),
        };
        let later = self.host.as_ref().map(|(s, _)| {
            let flag = Arc::new(AtomicBool::new(false));
            let f = flag.clone();
            s.launch(move || f.store(true, Ordering::SeqCst));
            flag
        });
        Ok(Issued { h, recv, sync: true, later })
    }

    fn finish(&self, op: Issued) -> Ended {
        let Some(h) = op.h else {
            return Ended { status: Status::Ok, at: mono_ns(), later_ran: op.later.map(|f| f.load(Ordering::SeqCst)), refused: false };
        };
        let status = match &self.host {
            None => match self.w.request_wait(h) {
                Ok(c) => {
                    self.w.request_release(h).unwrap();
                    c.status
                }
                Err(e) => {
                    // GSC_TIMEOUT passed: the request is still valid. A receive is withdrawn so
                    // nothing lands in its buffer later; a send is left to its link.
                    if op.recv {
                        self.w.request_cancel(h).unwrap();
                        let _ = self.w.request_wait(h);
                        self.w.request_release(h).unwrap();
                    }
                    e.status()
                }
            },
            Some((stream, _)) => {
                let deadline = Instant::now() + T;
                let c = loop {
                    if let Some(c) = self.w.request_test(h).unwrap() {
                        break c;
                    }
                    assert!(Instant::now() < deadline, "a stream operation never ended");
                    if !self.self_progress || self.w.progress() == 0 {
                        std::thread::sleep(Duration::from_micros(200));
                    }
                };
                self.w.request_release(h).unwrap();
                if op.sync {
                    // The stream's wait must be released too, with the error when there is one.
                    let synced = stream.synchronize(Some(T));
                    match (&synced, c.status) {
                        (Ok(()), Status::Ok) => {}
                        (Err(e), s) if e.status() == s => {}
                        (r, s) => panic!("the request ended with {s:?} but the stream's synchronize said {r:?}"),
                    }
                }
                c.status
            }
        };
        let at = mono_ns();
        let later_ran = op.later.map(|f| f.load(Ordering::SeqCst));
        Ended { status, at, later_ran, refused: false }
    }
}

// ---------------------------------------------------------------------------------------------
// The children

/// `common::next_msg` with this file's limit.
fn next_msg(chan: &dyn Chan, w: &Worker, key: &str) -> Vec<u8> {
    common::next_msg(chan, w, key, T, Duration::ZERO)
}

/// Roles: "survivor:<case>" and "victim:<case>".
fn roles(role: &str, chan: &dyn Chan, ctx: gscomm::Context) {
    let (side, case) = role.split_once(':').expect("side:case");
    let case = Case::parse(case);
    let w = ctx.create_worker().unwrap();
    chan.put("addr", w.address());
    let ep = w.connect(&chan.get("peer")).unwrap();
    chan.put("lane", ep.lane().unwrap().name().as_bytes());
    match side {
        "victim" => victim(case, chan, &w, &ep),
        "survivor" => {
            let verdict = survivor(case, chan, &w, &ep);
            chan.put("verdict", verdict.as_bytes());
            // The endpoint's link is dead: dropping it must not wait for the peer.
            drop(ep);
        }
        other => panic!("unknown side {other}"),
    }
}

/// The victim serves its half until it is killed (the watchdog ends it otherwise).
fn victim(case: Case, chan: &dyn Chan, w: &Worker, ep: &Endpoint) {
    next_msg(chan, w, "go");
    match case {
        // Receive every eager message, as long as it lives.
        Case::KillReceiver { rndv: false, .. } => {
            let mut buf = vec![0u8; EAGER];
            for tag in 0.. {
                let _ = w.tag_recv(&mut buf, tag, u64::MAX);
            }
        }
        // Never post the receive: the survivor's rendezvous send waits for us when we die.
        // Stopped peers just progress until they are stopped.
        Case::KillReceiver { rndv: true, .. } | Case::Stop { .. } => loop {
            if w.progress() == 0 {
                std::thread::sleep(Duration::from_micros(100));
            }
        },
        // Eager messages one by one, paced, so the survivor is waiting for the next one when
        // we die.
        Case::KillSender { rndv: false, .. } => {
            let data = pattern(7, EAGER);
            for tag in 0.. {
                let _ = ep.tag_send(&data, tag);
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        // One big send whose data the survivor takes in slowly.
        Case::KillSender { rndv: true, .. } => {
            let data = pattern(9, RNDV);
            // SAFETY: `data` lives until the process dies (the loop below never ends).
            let _s = unsafe { ep.tag_send_nbx(data.as_ptr(), RNDV, 0, RequestParams::default()) }.unwrap();
            loop {
                if w.progress() == 0 {
                    std::thread::sleep(Duration::from_micros(100));
                }
            }
        }
    }
}

/// The survivor's half: run the flow, say when the victim may be killed (or stopped), see how
/// the flow ends. Returns the problems found (empty: all good), `|`, a summary.
fn survivor(case: Case, chan: &dyn Chan, w: &Worker, ep: &Endpoint) -> String {
    let host = case.host().then(|| {
        let s = HostStream::new().unwrap();
        let c = Condition::host_stream(&s);
        (s, c)
    });
    let self_progress = matches!(case, Case::KillSender { host: true, rndv: true });
    let ops = Ops { w, ep, host, self_progress };
    next_msg(chan, w, "go");
    let mut problems = Vec::new();
    let summary = match case {
        Case::KillReceiver { rndv, .. } | Case::KillSender { rndv, .. } => {
            let recv = matches!(case, Case::KillSender { .. });
            let (ended, killed) = kill_flow(&ops, chan, recv, rndv, &mut problems);
            let killed = killed.unwrap_or_else(|| bytes_u64(&chan.get("killed")));
            check_kill(&ops, case, &ended, killed, &mut problems);
            let after = Duration::from_nanos(ended.at.saturating_sub(killed));
            let how = if ended.refused { " (refused at issue)" } else { "" };
            format!("{:?}{how} {after:?} after the kill", ended.status)
        }
        Case::Stop { host } => stop_flow(&ops, chan, host, &mut problems),
    };
    format!("{}|{summary}", problems.join("; "))
}

/// A buffer that is never freed: an operation that did not end (a send on a stopped peer's
/// link) may still name it.
fn leak(v: Vec<u8>) -> *mut u8 {
    Box::leak(v.into_boxed_slice()).as_mut_ptr()
}

/// Run the flow until an operation fails; the victim is killed on the way (after BEFORE eager
/// messages, or while the rendezvous is in flight). Also returns the time of the kill if it had
/// to be waited for.
fn kill_flow(ops: &Ops, chan: &dyn Chan, recv: bool, rndv: bool, problems: &mut Vec<String>) -> (Ended, Option<u64>) {
    let w = ops.w;
    if !rndv {
        let buf = leak(if recv { vec![0u8; EAGER] } else { pattern(3, EAGER) });
        let mut n = 0u64;
        let t0 = Instant::now();
        loop {
            let e = match ops.start(recv, buf, EAGER, n) {
                Ok(op) => ops.finish(op),
                Err(status) => Ended { status, at: mono_ns(), later_ran: None, refused: true },
            };
            if e.status != Status::Ok {
                if n < BEFORE {
                    problems.push(format!("message {n} failed before the kill"));
                }
                return (e, None);
            }
            if e.later_ran == Some(false) {
                problems.push(format!("message {n}: the stream's later work had not run when the operation ended"));
            }
            n += 1;
            if n == BEFORE {
                chan.put("kill", &[]);
            }
            // The parent's deadline fails the case long before; this only stops a runaway.
            assert!(t0.elapsed() < T, "{n} messages and no failure");
        }
    } else if !recv {
        // A rendezvous send the victim never receives: pending when it dies.
        let buf = leak(pattern(5, RNDV));
        let op = ops.start(false, buf, RNDV, 0).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        if let Some(h) = op.h
            && w.request_test(h).unwrap().is_some()
        {
            problems.push("the rendezvous send ended with no receive posted".into());
        }
        chan.put("kill", &[]);
        (ops.finish(op), None)
    } else {
        // The victim's 64 MiB are arriving: stop taking data in, let it be killed, go on.
        let buf = leak(vec![0u8; RNDV]);
        let op = ops.start(true, buf, RNDV, 0).unwrap();
        // Bytes 8..16 are stamped with the sender's seed by `pattern`.
        let stamp = buf.wrapping_add(8) as *const u64;
        let t0 = Instant::now();
        // SAFETY: a read of our own live buffer while the lane writes other parts of it; a racy
        // read of plain bytes only decides when to stop progressing.
        while unsafe { std::ptr::read_volatile(stamp) } == 0 {
            assert!(t0.elapsed() < T, "the victim's data never arrived");
            if w.progress() == 0 {
                std::thread::yield_now();
            }
        }
        if w.request_test(op.h.unwrap()).unwrap().is_some() {
            problems.push("all 64 MiB arrived before the kill: no transfer was in flight".into());
        }
        chan.put("kill", &[]);
        // Nothing progresses this worker until the victim is dead (no proxy thread, see
        // `Case::config`): the rest of the data cannot arrive meanwhile.
        let killed = bytes_u64(&chan.get("killed"));
        (ops.finish(op), Some(killed))
    }
}

/// After a kill: the right error within its bound, after the kill; the stream released; the
/// condition and the endpoint report the failure.
fn check_kill(ops: &Ops, case: Case, e: &Ended, killed: u64, problems: &mut Vec<String>) {
    if e.at < killed {
        problems.push(format!("the operation failed ({:?}) before the kill", e.status));
        return;
    }
    let after = Duration::from_nanos(e.at - killed);
    // A receive waiting for the next eager message is on no link: only GSC_TIMEOUT ends it.
    let unmatched_recv = matches!(case, Case::KillSender { rndv: false, .. });
    if unmatched_recv {
        if e.status != Status::TimedOut {
            problems.push(format!("an unmatched receive ended with {:?}, not TimedOut", e.status));
        }
        if after > KILL_TIMEOUT + SLACK {
            problems.push(format!("it timed out {after:?} after the kill; GSC_TIMEOUT is {KILL_TIMEOUT:?}"));
        }
    } else {
        if !matches!(e.status, Status::PeerFailed | Status::ConnectionReset) {
            problems.push(format!("an operation on the dead peer's link ended with {:?}", e.status));
        }
        if after > DETECT {
            problems.push(format!("the failure was seen {after:?} after the kill (bound {DETECT:?})"));
        }
    }
    if e.later_ran == Some(false) {
        problems.push("the stream's later work had not run when the operation ended".into());
    }
    // A condition reports the failures of operations it carried; one refused at issue never was.
    if let Some((_, cond)) = &ops.host
        && !e.refused
    {
        let q = cond.query().err().map(|x| x.status());
        if q != Some(e.status) {
            problems.push(format!("the condition says {q:?}, the operation {:?}", e.status));
        }
    }
    // The endpoint itself reports the dead peer (within DETECT, progressing meanwhile).
    let t0 = Instant::now();
    loop {
        // SAFETY: a static buffer; a send that is not refused at once is waited for below.
        let r = unsafe { ops.ep.tag_send_nbx(b"after the kill".as_ptr(), 14, 1 << 40, RequestParams::default()) };
        let st = match r {
            Err(x) => x.status(),
            Ok(Started::Done(_)) => Status::Ok,
            Ok(Started::Pending(h)) => {
                let st = ops.w.request_wait(h).map(|c| c.status).unwrap_or_else(|x| x.status());
                let _ = ops.w.request_release(h);
                st
            }
            Ok(Started::Armed(_)) => unreachable!(),
        };
        if st != Status::Ok {
            if !matches!(st, Status::PeerFailed | Status::ConnectionReset) {
                problems.push(format!("a send on the endpoint after the kill failed with {st:?}"));
            }
            break;
        }
        if t0.elapsed() > DETECT {
            problems.push(format!("sends on the endpoint still succeed {DETECT:?} after the failure"));
            break;
        }
        ops.w.progress();
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The victim is stopped; a rendezvous send to it and a receive from it must time out after
/// GSC_TIMEOUT, releasing the stream with the error.
fn stop_flow(ops: &Ops, chan: &dyn Chan, host: bool, problems: &mut Vec<String>) -> String {
    let (w, ep) = (ops.w, ops.ep);
    chan.put("stop", &[]);
    chan.get("stopped");
    let sbuf = leak(pattern(6, RNDV));
    let rbuf = leak(vec![0u8; 64]);
    let t0 = mono_ns();
    let (s, r) = match &ops.host {
        Some((stream, cond)) => {
            // Both in flight together (no stream wait each), then one wait for both and work
            // after it.
            let p = || on(cond, false);
            // SAFETY: the buffers are leaked: they outlive the operations.
            let s = pending(unsafe { ep.tag_send_nbx(sbuf, RNDV, 1, p()) }.unwrap());
            // SAFETY: as above.
            let r = pending(unsafe { w.tag_recv_nbx(rbuf, 64, 1, u64::MAX, p()) }.unwrap());
            cond.wait().unwrap();
            let later = Arc::new(AtomicBool::new(false));
            let l2 = later.clone();
            stream.launch(move || l2.store(true, Ordering::SeqCst));
            let r_end = ops.finish(Issued { h: Some(r), recv: true, sync: true, later: Some(later) });
            let s_end = ops.finish(Issued { h: Some(s), recv: false, sync: false, later: None });
            (s_end, r_end)
        }
        None => {
            let s = ops.start(false, sbuf, RNDV, 1).unwrap();
            let r = ops.start(true, rbuf, 64, 1).unwrap();
            (ops.finish(s), ops.finish(r))
        }
    };
    for (what, e) in [("rendezvous send", &s), ("receive", &r)] {
        let took = Duration::from_nanos(e.at - t0);
        if e.status != Status::TimedOut {
            problems.push(format!("{what} with a stopped peer ended with {:?}, not TimedOut", e.status));
        }
        // Without a condition the receive's wait starts when the send's ended, and has a
        // GSC_TIMEOUT of its own.
        let most = if host || what == "rendezvous send" { STOP_TIMEOUT + SLACK } else { 2 * STOP_TIMEOUT + SLACK };
        if took + Duration::from_millis(50) < STOP_TIMEOUT || took > most {
            problems.push(format!("{what} timed out after {took:?}; GSC_TIMEOUT is {STOP_TIMEOUT:?}"));
        }
    }
    if r.later_ran == Some(false) {
        problems.push("the stream's later work did not run after the timeout".into());
    }
    // SAFETY: the receive ended (withdrawn): nothing writes its buffer any more.
    if unsafe { std::slice::from_raw_parts(rbuf, 64) }.iter().any(|&b| b != 0) {
        problems.push("the timed-out receive's buffer was written".into());
    }
    if let Some((_, cond)) = &ops.host
        && cond.query().err().map(|e| e.status()) != Some(Status::TimedOut)
    {
        problems.push(format!("the condition says {:?}, not TimedOut", cond.query()));
    }
    format!(
        "send {:?} after {:?}, receive {:?} after {:?}",
        s.status,
        Duration::from_nanos(s.at - t0),
        r.status,
        Duration::from_nanos(r.at - t0)
    )
}

// ---------------------------------------------------------------------------------------------
// The parent

fn run(test: &str, lane: LaneUnderTest, case: Case) {
    if lane == LaneUnderTest::Ucx
        && let Err(e) = gscomm::transport::ucx::availability()
    {
        println!("skipped: the UCX lane cannot load here: {e}");
        return;
    }
    let t0 = Instant::now();
    let dir = ShmDir::new(test);
    let (scfg, vcfg) = case.config(lane, dir.as_str());
    // UCX over TCP even between processes of one host, so the transport is the network one.
    let env: &[(&str, &str)] = &[("UCX_TLS", "tcp")];
    let mut survivor = spawn_child_with(test, &format!("survivor:{}", case.name()), &refs(&scfg), env, &[]);
    let mut victim = spawn_child_with(test, &format!("victim:{}", case.name()), &refs(&vcfg), env, &[]);
    let (sa, va) = (survivor.get("addr", T), victim.get("addr", T));
    survivor.put("peer", &va);
    victim.put("peer", &sa);
    let want = if lane == LaneUnderTest::Shm { "shm" } else { "ucx" };
    for c in [&mut survivor, &mut victim] {
        assert_eq!(String::from_utf8_lossy(&c.get("lane", T)), want, "{}: lane", c.role);
    }
    victim.put("go", &[]);
    survivor.put("go", &[]);
    if let Case::Stop { .. } = case {
        survivor.get("stop", T);
        victim.stop(); // returns once /proc says the victim is stopped
        survivor.put("stopped", &[]);
    } else {
        survivor.get("kill", T);
        let at = victim.sigkill_proven();
        survivor.put("killed", &u64_bytes(at));
    }
    let verdict = String::from_utf8(survivor.get("verdict", T)).unwrap();
    survivor.wait_success(T);
    if let Case::Stop { .. } = case {
        victim.sigkill_proven();
    }
    let (problems, summary) = verdict.split_once('|').unwrap();
    println!("{test}: {summary} (case took {:?})", t0.elapsed());
    assert!(problems.is_empty(), "{test}: {problems}");
    assert!(t0.elapsed() < Duration::from_secs(25), "{test} took {:?}", t0.elapsed());
}

/// One test per case, so each has its own name, deadline and verdict.
macro_rules! cases {
    ($($name:ident: $lane:ident, $case:expr;)*) => {$(
        #[test]
        fn $name() {
            if !run_child_role(roles) {
                run(stringify!($name), LaneUnderTest::$lane, $case);
            }
        }
    )*};
}

cases! {
    shm_kill_receiver_none_eager: Shm, Case::KillReceiver { host: false, rndv: false };
    shm_kill_receiver_none_rndv: Shm, Case::KillReceiver { host: false, rndv: true };
    shm_kill_receiver_host_eager: Shm, Case::KillReceiver { host: true, rndv: false };
    shm_kill_receiver_host_rndv: Shm, Case::KillReceiver { host: true, rndv: true };
    shm_kill_sender_none_eager: Shm, Case::KillSender { host: false, rndv: false };
    shm_kill_sender_none_rndv: Shm, Case::KillSender { host: false, rndv: true };
    shm_kill_sender_host_eager: Shm, Case::KillSender { host: true, rndv: false };
    shm_kill_sender_host_rndv: Shm, Case::KillSender { host: true, rndv: true };
    shm_stop_none: Shm, Case::Stop { host: false };
    shm_stop_host: Shm, Case::Stop { host: true };
    ucx_kill_receiver_none_eager: Ucx, Case::KillReceiver { host: false, rndv: false };
    ucx_kill_receiver_none_rndv: Ucx, Case::KillReceiver { host: false, rndv: true };
    ucx_kill_receiver_host_eager: Ucx, Case::KillReceiver { host: true, rndv: false };
    ucx_kill_receiver_host_rndv: Ucx, Case::KillReceiver { host: true, rndv: true };
    ucx_kill_sender_none_eager: Ucx, Case::KillSender { host: false, rndv: false };
    ucx_kill_sender_none_rndv: Ucx, Case::KillSender { host: false, rndv: true };
    ucx_kill_sender_host_eager: Ucx, Case::KillSender { host: true, rndv: false };
    ucx_kill_sender_host_rndv: Ucx, Case::KillSender { host: true, rndv: true };
    ucx_stop_none: Ucx, Case::Stop { host: false };
    ucx_stop_host: Ucx, Case::Stop { host: true };
}
