//! The shm heartbeat (issue #8, promise 2; docs/RELIABILITY.md): a peer whose proxy thread
//! promised a heartbeat and then went silent — SIGSTOP here — fails its link with `TimedOut`
//! after `GSC_HEARTBEAT_TIMEOUT`, long before `GSC_TIMEOUT`; a peer that promised none (no proxy
//! thread) is never judged by its silence, stopped or merely idle; an idle but healthy peer with
//! a proxy thread is never failed.
//!
//! Both peers are children of the test, which relays addresses, stops and kills. Every case has
//! hard time limits (the parent's deadline on every message, the children's watchdog) and
//! proves its fault (/proc says the victim is stopped; waitpid says SIGKILL). Times are taken on
//! CLOCK_MONOTONIC, one clock for the processes of a host.
mod common;

use common::*;
use gscomm::condition::{Condition, HostStream};
use gscomm::{Endpoint, RequestParams, Started, Status, Worker};
use std::time::{Duration, Instant};

/// The parent's deadline for any one message from a child.
const T: Duration = Duration::from_secs(30);
/// The heartbeat timeout of every process here (the victim beats every 100 ms, a tenth of it).
const HEARTBEAT: Duration = Duration::from_secs(1);
/// Room beyond a bound for a loaded CI machine.
const SLACK: Duration = Duration::from_millis(2500);
/// A rendezvous-sized message (the default threshold is 64 KiB): the send is tied to the link
/// until the receiver takes the data, so only the link's failure (or GSC_TIMEOUT) ends it.
const RNDV: usize = 1 << 20;

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Case {
    /// The victim (proxy thread on) is stopped; the survivor's send to it must fail by the
    /// heartbeat. `host`: the send is on a host stream, which must be released with the error.
    StopPromised { host: bool },
    /// The victim runs without a proxy thread (it promises nothing) and is stopped: the send
    /// ends by GSC_TIMEOUT only, and the link stays up.
    StopUnpromised,
    /// The victim goes idle (no call into gscomm at all) for three heartbeat timeouts, with or
    /// without a proxy thread; the survivor watches it all along; then they talk again.
    Idle { proxy: bool },
}

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::StopPromised { host: false } => "stop-promised-none",
            Case::StopPromised { host: true } => "stop-promised-host",
            Case::StopUnpromised => "stop-unpromised",
            Case::Idle { proxy: true } => "idle-proxy",
            Case::Idle { proxy: false } => "idle-noproxy",
        }
    }

    fn parse(s: &str) -> Case {
        match s {
            "stop-promised-none" => Case::StopPromised { host: false },
            "stop-promised-host" => Case::StopPromised { host: true },
            "stop-unpromised" => Case::StopUnpromised,
            "idle-proxy" => Case::Idle { proxy: true },
            "idle-noproxy" => Case::Idle { proxy: false },
            other => panic!("unknown case {other}"),
        }
    }

    /// The survivor's GSC_TIMEOUT: large where the heartbeat must be what ends the send, small
    /// where GSC_TIMEOUT must be (the heartbeat would have fired two seconds earlier).
    fn survivor_timeout(self) -> Duration {
        match self {
            Case::StopUnpromised => Duration::from_secs(3),
            _ => Duration::from_secs(60),
        }
    }

    /// Config overrides for (survivor, victim).
    fn config(self, dir: &str) -> (Vec<(String, String)>, Vec<(String, String)>) {
        let hb = format!("{}ms", HEARTBEAT.as_millis());
        let common = [
            ("GSC_TLS".to_string(), "shm".to_string()),
            ("GSC_SHM_DIR".to_string(), dir.to_string()),
            ("GSC_PEER_CHECK_INTERVAL".to_string(), "50ms".to_string()),
            ("GSC_HEARTBEAT_TIMEOUT".to_string(), hb),
        ];
        let mut survivor = common.to_vec();
        survivor.push(("GSC_TIMEOUT".into(), format!("{}ms", self.survivor_timeout().as_millis())));
        let mut victim = common.to_vec();
        victim.push(("GSC_TIMEOUT".into(), "30s".into()));
        if matches!(self, Case::StopUnpromised | Case::Idle { proxy: false }) {
            victim.push(("GSC_PROXY_THREAD".into(), "off".into()));
        }
        (survivor, victim)
    }
}

fn refs(v: &[(String, String)]) -> Vec<(&str, &str)> {
    v.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// `common::next_msg` with this file's limit.
fn next_msg(chan: &dyn Chan, w: &Worker, key: &str) -> Vec<u8> {
    common::next_msg(chan, w, key, T, Duration::from_micros(200))
}

/// A buffer that is never freed: a send that did not end may still name it.
fn leak(v: Vec<u8>) -> *mut u8 {
    Box::leak(v.into_boxed_slice()).as_mut_ptr()
}

/// Send `data` on a host stream and wait for it, progressing the worker meanwhile (a caller-run
/// proxy starts the operation only inside progress calls). Starts the worker's proxy: with a
/// proxy thread, that is what makes the worker promise a heartbeat.
fn send_on_host_stream(w: &Worker, ep: &Endpoint, data: &'static [u8], tag: u64) {
    let stream = HostStream::new().unwrap();
    let cond = Condition::host_stream(&stream);
    // SAFETY: `data` is static.
    let h = pending(unsafe { ep.tag_send_nbx(data.as_ptr(), data.len(), tag, on(&cond, true)) }.unwrap());
    progress_until(w, T, "the host-stream send", || w.request_test(h).unwrap().is_some());
    w.request_release(h).unwrap();
    stream.synchronize(Some(T)).unwrap();
}

/// Roles: "survivor:<case>" and "victim:<case>".
fn roles(role: &str, chan: &dyn Chan, ctx: gscomm::Context) {
    let (side, case) = role.split_once(':').expect("side:case");
    let case = Case::parse(case);
    let w = ctx.create_worker().unwrap();
    chan.put("addr", w.address());
    let ep = w.connect(&chan.get("peer")).unwrap();
    match side {
        "victim" => victim(case, chan, &w, &ep),
        "survivor" => {
            let verdict = survivor(case, chan, &w, &ep);
            chan.put("verdict", verdict.as_bytes());
            drop(ep);
        }
        other => panic!("unknown side {other}"),
    }
}

const HELLO: &[u8] = b"hello from the victim's proxy";

fn victim(case: Case, chan: &dyn Chan, w: &Worker, ep: &Endpoint) {
    // The first message goes through the proxy (a thread, or the caller's progress calls).
    send_on_host_stream(w, ep, HELLO, 1);
    // The survivor's own link to us must be accepted before we are stopped: a link its
    // acceptor has not taken yet carries no promise (and its peer is judged by liveness and
    // GSC_TIMEOUT only). Its ping arrives on it; our pong says we have it.
    let mut ping = [0u8; 4];
    w.tag_recv(&mut ping, 9, u64::MAX).unwrap();
    ep.tag_send(b"pong", 10).unwrap();
    match case {
        // Live as an application that progresses now and then, until stopped (then killed).
        Case::StopPromised { .. } | Case::StopUnpromised => loop {
            if w.progress() == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
        },
        Case::Idle { .. } => {
            // Idle: no call into gscomm at all until told (only a proxy thread, if any, runs).
            chan.get("wake");
            // Then take what the survivor sends and check it.
            let mut big = vec![0u8; RNDV];
            let c = w.tag_recv(&mut big, 2, u64::MAX).unwrap();
            assert_eq!(c.info.length, RNDV);
            assert_same(&big, &pattern(4, RNDV), "the rendezvous message after the idle time");
            let mut small = [0u8; 5];
            w.tag_recv(&mut small, 3, u64::MAX).unwrap();
            assert_eq!(&small, b"after");
            chan.put("done", &[]);
            next_msg(chan, w, "bye");
        }
    }
}

/// Returns the problems found (empty: all good), `|`, a summary.
fn survivor(case: Case, chan: &dyn Chan, w: &Worker, ep: &Endpoint) -> String {
    let mut hello = [0u8; HELLO.len()];
    let c = w.tag_recv(&mut hello, 1, u64::MAX).unwrap();
    assert_eq!((c.info.length, &hello[..]), (HELLO.len(), HELLO));
    ep.tag_send(b"ping", 9).unwrap();
    let mut pong = [0u8; 4];
    w.tag_recv(&mut pong, 10, u64::MAX).unwrap();
    assert_eq!(&pong, b"pong");
    let mut problems = Vec::new();
    let summary = match case {
        Case::StopPromised { host } => stop_promised(chan, w, ep, host, &mut problems),
        Case::StopUnpromised => stop_unpromised(case, chan, w, ep, &mut problems),
        Case::Idle { .. } => idle(chan, w, ep, &mut problems),
    };
    format!("{}|{summary}", problems.join("; "))
}

/// Have the victim stopped; CLOCK_MONOTONIC once /proc says it is.
fn stop_victim(chan: &dyn Chan, w: &Worker) -> u64 {
    chan.put("stop", &[]);
    bytes_u64(&next_msg(chan, w, "stopped"))
}

fn stop_promised(chan: &dyn Chan, w: &Worker, ep: &Endpoint, host: bool, problems: &mut Vec<String>) -> String {
    let stopped = stop_victim(chan, w);
    let buf = leak(pattern(5, RNDV));
    let host = host.then(|| {
        let s = HostStream::new().unwrap();
        let c = Condition::host_stream(&s);
        (s, c)
    });
    let params = host.as_ref().map_or_else(RequestParams::default, |(_, c)| on(c, true));
    // SAFETY: the buffer is leaked: it outlives the send.
    let status = match unsafe { ep.tag_send_nbx(buf, RNDV, 7, params) }.unwrap() {
        Started::Pending(h) => match w.request_wait(h) {
            Ok(c) => {
                w.request_release(h).unwrap();
                c.status
            }
            // GSC_TIMEOUT (60 s) passed: exactly what must not happen.
            Err(e) => e.status(),
        },
        other => panic!("a rendezvous send to a stopped peer gave {other:?}"),
    };
    let took = Duration::from_nanos(mono_ns().saturating_sub(stopped));
    if status != Status::TimedOut {
        problems.push(format!("the send to a stopped peer ended with {status:?}, not TimedOut"));
    }
    // The victim beats every 100 ms, so its silence began about when it was stopped; a failure
    // much sooner than GSC_HEARTBEAT_TIMEOUT after the stop would be something else (half of
    // it: room for a victim whose last beats came late on a loaded machine).
    if took < HEARTBEAT / 2 || took > HEARTBEAT + SLACK {
        problems.push(format!("the heartbeat failed the link {took:?} after the stop; GSC_HEARTBEAT_TIMEOUT is {HEARTBEAT:?}"));
    }
    if let Some((stream, cond)) = &host {
        match stream.synchronize(Some(T)) {
            Err(e) if e.status() == Status::TimedOut => {}
            r => problems.push(format!("the host stream's synchronize said {r:?}, not TimedOut")),
        }
        if cond.query().err().map(|e| e.status()) != Some(Status::TimedOut) {
            problems.push(format!("the condition says {:?}, not TimedOut", cond.query()));
        }
    }
    // The endpoint reports the link's error, which names the heartbeat and the peer.
    // SAFETY: a static buffer.
    match unsafe { ep.tag_send_nbx(b"x".as_ptr(), 1, 8, RequestParams::default()) } {
        Err(e) => {
            if e.status() != Status::TimedOut || !e.message().contains("heartbeat") || !e.message().contains("silent for") {
                problems.push(format!("a send after the failure says {:?}: {}", e.status(), e.message()));
            }
        }
        Ok(s) => problems.push(format!("a send after the heartbeat failure was accepted: {s:?}")),
    }
    format!("{status:?} {took:?} after the stop")
}

fn stop_unpromised(case: Case, chan: &dyn Chan, w: &Worker, ep: &Endpoint, problems: &mut Vec<String>) -> String {
    let stopped = stop_victim(chan, w);
    let buf = leak(pattern(5, RNDV));
    // SAFETY: the buffer is leaked: it outlives the send.
    let (status, waited_out) = match unsafe { ep.tag_send_nbx(buf, RNDV, 7, RequestParams::default()) }.unwrap() {
        Started::Pending(h) => match w.request_wait(h) {
            Ok(c) => (c.status, false),
            // GSC_TIMEOUT: the request is still valid, its link untouched.
            Err(e) => (e.status(), true),
        },
        other => panic!("a rendezvous send to a stopped peer gave {other:?}"),
    };
    let took = Duration::from_nanos(mono_ns().saturating_sub(stopped));
    let timeout = case.survivor_timeout();
    if status != Status::TimedOut || !waited_out {
        problems.push(format!("the send ended with {status:?} (by GSC_TIMEOUT: {waited_out}); only GSC_TIMEOUT may end it"));
    }
    if took < timeout || took > timeout + SLACK {
        problems.push(format!("the send ended {took:?} after the stop; GSC_TIMEOUT is {timeout:?}"));
    }
    // The link is up: a small send is still taken (it waits in the ring for the stopped peer).
    // SAFETY: a static buffer.
    match unsafe { ep.tag_send_nbx(b"x".as_ptr(), 1, 8, RequestParams::default()) } {
        Ok(Started::Done(_)) | Ok(Started::Pending(_)) => {}
        r => problems.push(format!("the link of a peer that promised no heartbeat was failed: {r:?}")),
    }
    format!("{status:?} by GSC_TIMEOUT {took:?} after the stop")
}

fn idle(chan: &dyn Chan, w: &Worker, ep: &Endpoint, problems: &mut Vec<String>) -> String {
    // Watch the idle peer for three heartbeat timeouts, progressing (so checking) all along.
    let watch = 3 * HEARTBEAT;
    let t0 = Instant::now();
    let mut checks = 0u64;
    while t0.elapsed() < watch {
        checks += 1;
        if w.progress() == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    chan.put("wake", &[]);
    let big = pattern(4, RNDV);
    // SAFETY: `big` outlives the send: it is waited for below.
    let s = unsafe { ep.tag_send_nbx(big.as_ptr(), RNDV, 2, RequestParams::default()) };
    let status = match s {
        Ok(Started::Pending(h)) => {
            let c = w.request_wait(h).map(|c| c.status).unwrap_or_else(|e| e.status());
            let _ = w.request_release(h);
            c
        }
        Ok(_) => Status::Ok,
        Err(e) => {
            problems.push(format!("after the idle time the link was gone: {e}"));
            e.status()
        }
    };
    if status != Status::Ok {
        problems.push(format!("the send after the idle time ended with {status:?}"));
    }
    if let Err(e) = ep.tag_send(b"after", 3) {
        problems.push(format!("the small send after the idle time failed: {e}"));
    }
    next_msg(chan, w, "done");
    chan.put("bye", &[]);
    format!("{status:?} after {watch:?} idle ({checks} progress calls)")
}

// ---------------------------------------------------------------------------------------------
// The parent

fn run(test: &str, case: Case) {
    let t0 = Instant::now();
    let dir = ShmDir::new(test);
    let (scfg, vcfg) = case.config(dir.as_str());
    let mut survivor = spawn_child(test, &format!("survivor:{}", case.name()), &refs(&scfg));
    let mut victim = spawn_child(test, &format!("victim:{}", case.name()), &refs(&vcfg));
    let (sa, va) = (survivor.get("addr", T), victim.get("addr", T));
    survivor.put("peer", &va);
    victim.put("peer", &sa);
    let stopped = match case {
        Case::StopPromised { .. } | Case::StopUnpromised => {
            survivor.get("stop", T);
            victim.stop(); // returns once /proc says the victim is stopped
            survivor.put("stopped", &u64_bytes(mono_ns()));
            true
        }
        Case::Idle { .. } => {
            survivor.get("wake", T);
            victim.put("wake", &[]);
            victim.get("done", T);
            survivor.put("done", &[]);
            survivor.get("bye", T);
            victim.put("bye", &[]);
            false
        }
    };
    let verdict = String::from_utf8(survivor.get("verdict", T)).unwrap();
    survivor.wait_success(T);
    if stopped {
        victim.sigkill_proven();
    } else {
        victim.wait_success(T);
    }
    let (problems, summary) = verdict.split_once('|').unwrap();
    println!("{test}: {summary} (case took {:?})", t0.elapsed());
    assert!(problems.is_empty(), "{test}: {problems}");
    assert!(t0.elapsed() < Duration::from_secs(25), "{test} took {:?}", t0.elapsed());
}

macro_rules! cases {
    ($($name:ident: $case:expr;)*) => {$(
        #[test]
        fn $name() {
            if !run_child_role(roles) {
                run(stringify!($name), $case);
            }
        }
    )*};
}

cases! {
    a_stopped_peer_with_a_proxy_thread_fails_by_heartbeat_shm: Case::StopPromised { host: false };
    a_stopped_peer_with_a_proxy_thread_fails_a_host_stream_send_by_heartbeat_shm: Case::StopPromised { host: true };
    a_stopped_peer_without_a_proxy_thread_ends_by_gsc_timeout_only_shm: Case::StopUnpromised;
    an_idle_peer_with_a_proxy_thread_is_never_failed_shm: Case::Idle { proxy: true };
    an_idle_peer_without_a_proxy_thread_is_never_failed_shm: Case::Idle { proxy: false };
}
