//! Tagged messaging between processes (shm lane) and between threads (loopback lane): matching
//! order and wildcards, protocol boundaries, truncation, many requests in flight, cancel, probe.
//!
//! Each `_shm` test re-runs this binary as its peer (see tests/common/mod.rs); each `_loopback`
//! test runs the same peer role on a thread of this process.
mod common;

use common::*;
use gscomm::{Context, Endpoint, RequestParams, Started, Status, Worker};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------------
// Peer roles

/// One message of a plan: tag, size, pattern seed.
#[derive(Copy, Clone, Debug)]
struct Msg {
    tag: u64,
    size: usize,
    seed: u64,
}

fn encode_plan(p: &[Msg]) -> Vec<u8> {
    p.iter().flat_map(|m| [m.tag, m.size as u64, m.seed]).flat_map(u64::to_le_bytes).collect()
}

fn decode_plan(b: &[u8]) -> Vec<Msg> {
    b.chunks_exact(24).map(|c| Msg { tag: bytes_u64(&c[..8]), size: bytes_u64(&c[8..16]) as usize, seed: bytes_u64(&c[16..24]) }).collect()
}

/// Post every send of a plan non-blocking, then wait for all; returns their statuses.
fn send_plan(w: &Worker, ep: &Endpoint, plan: &[Msg]) -> Vec<Status> {
    let bufs: Vec<Vec<u8>> = plan.iter().map(|m| pattern(m.seed, m.size)).collect();
    let started: Vec<Started> = plan
        .iter()
        .zip(&bufs)
        // SAFETY: `bufs` outlives every request (all are waited for below).
        .map(|(m, b)| unsafe { ep.tag_send_nbx(b.as_ptr(), b.len(), m.tag, RequestParams::default()).expect("send") })
        .collect();
    started.into_iter().map(|s| wait_release(w, s).status).collect()
}

/// Peer roles. "sender": connect to the test's worker, then run plans until "bye".
fn roles(role: &str, chan: &dyn Chan, ctx: Context) {
    let w = ctx.create_worker().unwrap();
    match role {
        "sender" => {
            let ep = w.connect(&chan.get("addr")).unwrap();
            chan.put("ready", &[]);
            loop {
                // Progress while idle: the test may need our side of a link to move.
                let (k, v) = loop {
                    if let Some(kv) = chan.try_get() {
                        break kv;
                    }
                    if w.progress() == 0 {
                        std::thread::yield_now();
                    }
                };
                match k.as_str() {
                    "plan" => {
                        let st = send_plan(&w, &ep, &decode_plan(&v));
                        let codes: Vec<u8> = st.iter().flat_map(|s| s.code().to_le_bytes()).collect();
                        chan.put("sent", &codes);
                    }
                    "bye" => break,
                    other => panic!("sender: unexpected `{other}`"),
                }
            }
            ep.close().unwrap();
        }
        other => panic!("unknown role {other}"),
    }
}

fn child_or(f: impl FnOnce()) {
    if !run_child_role(roles) {
        f()
    }
}

/// A test's side of a scenario: a worker, its private shm dir, the config both sides use.
struct Setup {
    lane: Lane,
    test: &'static str,
    dir: ShmDir,
    cfg: Vec<(String, String)>,
    w: Option<Worker>,
}

impl Setup {
    fn new(lane: Lane, test: &'static str, extra: &[(&str, &str)]) -> Setup {
        let dir = ShmDir::new(test);
        let mut cfg = vec![("GSC_TLS".to_string(), lane.tls().to_string()), ("GSC_SHM_DIR".to_string(), dir.as_str().to_string())];
        cfg.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let w = ctx_with(&refs(&cfg)).create_worker().unwrap();
        Setup { lane, test, dir, cfg, w: Some(w) }
    }

    fn w(&self) -> &Worker {
        self.w.as_ref().unwrap()
    }

    /// Start a sender peer connected to our worker.
    fn sender(&self) -> Peer {
        let mut p = start_peer(self.lane, self.test, "sender", &refs(&self.cfg), roles);
        p.put("addr", self.w().address());
        p.get_progress("ready", T, self.w());
        p
    }

    /// Tell peers to go, wait for them, drop our worker, and check no shm file is left.
    fn finish(mut self, peers: Vec<Peer>) {
        for mut p in peers {
            p.put("bye", &[]);
            // Its flushing close needs our progress.
            let deadline = Instant::now() + T;
            match &mut p {
                Peer::Proc(_) | Peer::Thread { .. } => {
                    while !p.is_finished() {
                        assert!(Instant::now() < deadline, "peer did not finish");
                        self.w().progress();
                    }
                }
            }
            p.finish(T);
        }
        self.w.take();
        assert_eq!(self.dir.segments(), Vec::<String>::new(), "{}: shm segments left behind", self.test);
    }
}

fn refs(v: &[(String, String)]) -> Vec<(&str, &str)> {
    v.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// Send `plan` from `peer` and progress until it reports its sends done.
fn run_plan(s: &Setup, peer: &mut Peer, plan: &[Msg]) -> Vec<Status> {
    peer.put("plan", &encode_plan(plan));
    collect_sent(s, peer)
}

fn collect_sent(s: &Setup, peer: &mut Peer) -> Vec<Status> {
    let v = peer.get_progress("sent", T, s.w());
    v.chunks_exact(4).map(|c| Status::from_code(i32::from_le_bytes(c.try_into().unwrap())).unwrap()).collect()
}

/// A posted receive with its own buffer.
struct Rx {
    buf: Vec<u8>,
    h: Started,
}

fn post(w: &Worker, len: usize, tag: u64, mask: u64) -> Rx {
    let mut buf = vec![0u8; len];
    // SAFETY: the buffer lives in `Rx`, which is kept until the request completes.
    let h = unsafe { w.tag_recv_nbx(buf.as_mut_ptr(), len, tag, mask, RequestParams::default()).unwrap() };
    Rx { buf, h }
}

fn wait_rx(w: &Worker, rx: &Rx) -> gscomm::Completion {
    match rx.h {
        Started::Done(info) => gscomm::Completion { status: Status::Ok, info },
        Started::Armed(_) => panic!("no condition was given"),
        Started::Pending(h) => {
            let deadline = Instant::now() + T;
            loop {
                if let Some(c) = w.request_test(h).unwrap() {
                    w.request_release(h).unwrap();
                    return c;
                }
                assert!(Instant::now() < deadline, "receive not complete");
                if w.progress() == 0 {
                    std::thread::yield_now();
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Matching order and wildcards

const SENDER_SHIFT: u32 = 48;
const CLASS_SHIFT: u32 = 32;
const CLASS_MASK: u64 = 0xFFFF << CLASS_SHIFT;
const SENDER_MASK: u64 = 0xFFFF << SENDER_SHIFT;
const PER_SENDER: u64 = 40;

fn order_plan(sender: u64) -> Vec<Msg> {
    // eager-short (0, 100, 128), eager-copy (129, 5000), rendezvous (16384, 20000, 200000)
    let sizes = [0usize, 100, 5000, 20000, 200000, 128, 129, 16384];
    (0..PER_SENDER)
        .map(|i| Msg {
            tag: sender << SENDER_SHIFT | (i % 3) << CLASS_SHIFT | i,
            size: sizes[(i as usize + sender as usize) % sizes.len()],
            seed: sender * 1000 + i,
        })
        .collect()
}

/// Post the receive structure: class-1 wildcards, one exact, sender-2 wildcards, full wildcards.
/// Returns (group name, receive) in post order.
fn post_order_receives(w: &Worker) -> Vec<(&'static str, Rx)> {
    let mut v = Vec::new();
    for _ in 0..26 {
        v.push(("class1", post(w, 200000, 1 << CLASS_SHIFT, CLASS_MASK)));
    }
    v.push(("exact", post(w, 200000, 1 << SENDER_SHIFT | 30, u64::MAX)));
    for _ in 0..10 {
        v.push(("sender2", post(w, 200000, 2 << SENDER_SHIFT, SENDER_MASK)));
    }
    for _ in 0..(2 * PER_SENDER as usize - 37) {
        v.push(("any", post(w, 200000, 0xdead, 0)));
    }
    v
}

/// Check every receive got the message non-overtaking matching dictates, with the right data.
fn check_order(w: &Worker, rxs: Vec<(&'static str, Rx)>) {
    let plans = [order_plan(1), order_plan(2)];
    let mut got: std::collections::BTreeMap<(&str, u64), Vec<u64>> = Default::default();
    let mut seen = std::collections::HashSet::new();
    for (group, rx) in &rxs {
        let c = wait_rx(w, rx);
        assert_eq!(c.status, Status::Ok, "{group}");
        let sender = c.info.tag >> SENDER_SHIFT;
        let i = c.info.tag & 0xFFFF_FFFF;
        let m = plans[sender as usize - 1][i as usize];
        assert_eq!(c.info.tag, m.tag);
        assert_eq!(c.info.length, m.size, "length of {:#x}", m.tag);
        assert_same(&rx.buf[..m.size], &pattern(m.seed, m.size), &format!("data of {:#x}", m.tag));
        assert!(rx.buf[m.size..].iter().all(|&b| b == 0), "bytes written past the message");
        assert!(seen.insert(m.tag), "message {:#x} received twice", m.tag);
        got.entry((group, sender)).or_default().push(i);
    }
    assert_eq!(seen.len(), 2 * PER_SENDER as usize);
    let class1: Vec<u64> = (0..PER_SENDER).filter(|i| i % 3 == 1).collect();
    let rest = |s: u64| -> Vec<u64> { (0..PER_SENDER).filter(|i| i % 3 != 1 && !(s == 1 && *i == 30)).collect() };
    assert_eq!(got[&("class1", 1)], class1, "class-1 wildcard receives, sender 1");
    assert_eq!(got[&("class1", 2)], class1, "class-1 wildcard receives, sender 2");
    assert_eq!(got[&("exact", 1)], vec![30]);
    assert_eq!(got[&("sender2", 2)], rest(2)[..10].to_vec(), "sender-2 wildcard receives");
    assert_eq!(got[&("any", 1)], rest(1), "full wildcards, sender 1");
    assert_eq!(got[&("any", 2)], rest(2)[10..].to_vec(), "full wildcards, sender 2");
}

fn matching_order(lane: Lane, test: &'static str) {
    let s = Setup::new(lane, test, &[]);
    let mut peers = vec![s.sender(), s.sender()];
    // Round 1, expected path: every receive is posted before the first message is sent.
    let rxs = post_order_receives(s.w());
    for (k, p) in peers.iter_mut().enumerate() {
        p.put("plan", &encode_plan(&order_plan(k as u64 + 1)));
    }
    for p in peers.iter_mut() {
        assert!(collect_sent(&s, p).iter().all(|st| *st == Status::Ok));
    }
    check_order(s.w(), rxs);
    assert_eq!(s.w().stats().requests, 0);
    // Round 2, unexpected path: every message (or its RTS) has arrived before any receive.
    for (k, p) in peers.iter_mut().enumerate() {
        p.put("plan", &encode_plan(&order_plan(k as u64 + 1)));
    }
    progress_until(s.w(), T, "all 80 messages unexpected", || s.w().stats().unexpected == 2 * PER_SENDER as usize);
    let rxs = post_order_receives(s.w());
    check_order(s.w(), rxs);
    for p in peers.iter_mut() {
        assert!(collect_sent(&s, p).iter().all(|st| *st == Status::Ok));
    }
    assert_eq!(s.w().stats().unexpected, 0);
    s.finish(peers);
}

#[test]
fn matching_order_and_wildcards_shm() {
    child_or(|| matching_order(Lane::Shm, "matching_order_and_wildcards_shm"));
}

#[test]
fn matching_order_and_wildcards_loopback() {
    matching_order(Lane::Loopback, "matching_order_and_wildcards_loopback");
}

// ---------------------------------------------------------------------------------------------
// 2. Protocol boundaries

fn boundaries(lane: Lane, test: &'static str, extra: &[(&str, &str)]) {
    let mut cfg = vec![("GSC_EAGER_SHORT_MAX", "1K"), ("GSC_RNDV_THRESH", "32K")];
    cfg.extend_from_slice(extra);
    let s = Setup::new(lane, test, &cfg);
    let mut peer = s.sender();
    let sizes = [0usize, 1, 1023, 1024, 1025, 32767, 32768, 32769, 64 << 20];
    let plan: Vec<Msg> = sizes.iter().enumerate().map(|(i, &n)| Msg { tag: i as u64, size: n, seed: 77 + i as u64 }).collect();
    // Half the receives wait for their message, half meet it unexpected.
    let early: Vec<(usize, Rx)> = (0..plan.len()).filter(|i| i % 2 == 0).map(|i| (i, post(s.w(), sizes[i], i as u64, u64::MAX))).collect();
    peer.put("plan", &encode_plan(&plan));
    progress_until(s.w(), T, "odd-numbered messages unexpected", || s.w().stats().unexpected == plan.len() / 2);
    let late: Vec<(usize, Rx)> = (0..plan.len()).filter(|i| i % 2 == 1).map(|i| (i, post(s.w(), sizes[i], i as u64, u64::MAX))).collect();
    for (i, rx) in early.iter().chain(&late) {
        let c = wait_rx(s.w(), rx);
        assert_eq!(c.status, Status::Ok, "size {}", sizes[*i]);
        assert_eq!(c.info.length, sizes[*i]);
        assert_same(&rx.buf, &pattern(plan[*i].seed, sizes[*i]), &format!("{test}: size {}", sizes[*i]));
    }
    assert!(collect_sent(&s, &mut peer).iter().all(|st| *st == Status::Ok));
    s.finish(vec![peer]);
}

#[test]
fn boundaries_rndv_get_shm() {
    child_or(|| boundaries(Lane::Shm, "boundaries_rndv_get_shm", &[("GSC_RNDV_SCHEME", "get")]));
}

#[test]
fn boundaries_rndv_pipeline_shm() {
    child_or(|| boundaries(Lane::Shm, "boundaries_rndv_pipeline_shm", &[("GSC_RNDV_SCHEME", "pipeline")]));
}

#[test]
fn boundaries_cma_off_shm() {
    child_or(|| boundaries(Lane::Shm, "boundaries_cma_off_shm", &[("GSC_CMA", "off"), ("GSC_RNDV_SCHEME", "get")]));
}

#[test]
fn boundaries_rndv_get_loopback() {
    boundaries(Lane::Loopback, "boundaries_rndv_get_loopback", &[("GSC_RNDV_SCHEME", "get")]);
}

#[test]
fn boundaries_rndv_pipeline_loopback() {
    boundaries(Lane::Loopback, "boundaries_rndv_pipeline_loopback", &[("GSC_RNDV_SCHEME", "pipeline")]);
}

// ---------------------------------------------------------------------------------------------
// 3. Truncation

const GUARD: usize = 256;

fn truncation(lane: Lane, test: &'static str, extra: &[(&str, &str)]) {
    let s = Setup::new(lane, test, extra);
    let mut peer = s.sender();
    // (message size, receive size): eager-short, eager-copy, rendezvous, and a rendezvous that
    // meets its receive unexpected.
    let cases = [(100usize, 50usize), (1024, 512), (64 << 10, 32 << 10), (64 << 10, 32 << 10)];
    let plan: Vec<Msg> = cases.iter().enumerate().map(|(i, &(n, _))| Msg { tag: 40 + i as u64, size: n, seed: 5 + i as u64 }).collect();
    let mut bufs: Vec<Vec<u8>> = cases.iter().map(|&(_, r)| vec![0xAB; r + GUARD]).collect();
    let mut hs = Vec::new();
    for (i, &(_, r)) in cases.iter().enumerate().take(3) {
        // SAFETY: `bufs` outlives the requests, which are waited for below.
        hs.push(unsafe { s.w().tag_recv_nbx(bufs[i].as_mut_ptr(), r, plan[i].tag, u64::MAX, RequestParams::default()).unwrap() });
    }
    peer.put("plan", &encode_plan(&plan));
    progress_until(s.w(), T, "last message unexpected", || s.w().stats().unexpected == 1);
    // SAFETY: as above.
    hs.push(unsafe { s.w().tag_recv_nbx(bufs[3].as_mut_ptr(), cases[3].1, plan[3].tag, u64::MAX, RequestParams::default()).unwrap() });
    for (i, h) in hs.into_iter().enumerate() {
        let (n, r) = cases[i];
        let c = wait_release(s.w(), h);
        assert_eq!(c.status, Status::MessageTruncated, "{n} into {r}");
        assert_eq!(c.info.length, n, "the info reports the sender's length");
        assert_eq!(c.info.tag, plan[i].tag);
        assert_same(&bufs[i][..r], &pattern(plan[i].seed, n)[..r], &format!("{n} into {r}: the bytes that fit"));
        assert!(bufs[i][r..].iter().all(|&b| b == 0xAB), "{n} into {r}: guard bytes overwritten");
    }
    // A truncation at the receiver is not the sender's error.
    assert_eq!(collect_sent(&s, &mut peer), vec![Status::Ok; 4]);
    s.finish(vec![peer]);
}

#[test]
fn truncation_shm() {
    child_or(|| truncation(Lane::Shm, "truncation_shm", &[]));
}

#[test]
fn truncation_cma_off_shm() {
    child_or(|| truncation(Lane::Shm, "truncation_cma_off_shm", &[("GSC_CMA", "off")]));
}

#[test]
fn truncation_loopback() {
    truncation(Lane::Loopback, "truncation_loopback", &[]);
}

// ---------------------------------------------------------------------------------------------
// 4. 10,000 requests in flight

fn many_in_flight(lane: Lane, test: &'static str) {
    const N: u64 = 10_000;
    let s = Setup::new(lane, test, &[]);
    let mut peer = s.sender();
    let size = |i: u64| if i % 997 == 0 { 20_000 } else { (i * 37 % 300) as usize };
    let plan: Vec<Msg> = (0..N).map(|i| Msg { tag: i, size: size(i), seed: i }).collect();
    let mut bufs: Vec<Vec<u8>> = (0..N).map(|i| vec![0u8; size(i)]).collect();
    let fired: Arc<Vec<AtomicUsize>> = Arc::new((0..N).map(|_| AtomicUsize::new(0)).collect());
    let bad: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut handles = Vec::new();
    // Post in a scrambled order so matching does not just pop a queue front.
    let order: Vec<u64> = (0..N).map(|k| k * 7919 % N).collect();
    for &i in &order {
        let params = if i % 3 == 0 {
            let (fired, bad, expect) = (fired.clone(), bad.clone(), size(i));
            RequestParams::with_callback(move |_, st, info| {
                fired[info.tag as usize].fetch_add(1, Ordering::SeqCst);
                if st != Status::Ok || info.length != expect || info.tag != i {
                    bad.lock().unwrap().push(format!("{i}: {st:?} {info:?}"));
                }
            })
        } else {
            RequestParams::default()
        };
        let b = &mut bufs[i as usize];
        // SAFETY: `bufs` is not touched until every request completed.
        let st = unsafe { s.w().tag_recv_nbx(b.as_mut_ptr(), b.len(), i, u64::MAX, params).unwrap() };
        let Started::Pending(h) = st else { panic!("receive {i} completed before any send") };
        if i % 3 == 0 {
            // Released at once: the callback still fires once and the slot is recycled.
            s.w().request_release(h).unwrap();
        } else {
            handles.push((i, h));
        }
    }
    assert_eq!(s.w().stats().in_progress, N as usize);
    let sent = run_plan(&s, &mut peer, &plan);
    assert!(sent.iter().all(|st| *st == Status::Ok));
    for (i, h) in handles {
        let c = s.w().request_wait(h).unwrap();
        s.w().request_release(h).unwrap();
        assert_eq!((c.status, c.info.tag, c.info.length), (Status::Ok, i, size(i)));
    }
    progress_until(s.w(), T, "callbacks", || s.w().stats().requests == 0);
    assert!(bad.lock().unwrap().is_empty(), "{:?}", &bad.lock().unwrap()[..1]);
    for i in 0..N {
        let expect = usize::from(i % 3 == 0);
        assert_eq!(fired[i as usize].load(Ordering::SeqCst), expect, "callback count of receive {i}");
        assert_same(&bufs[i as usize], &pattern(i, size(i)), &format!("message {i}"));
    }
    assert_eq!(s.w().stats().in_progress, 0);
    s.finish(vec![peer]);
}

#[test]
fn ten_thousand_in_flight_shm() {
    child_or(|| many_in_flight(Lane::Shm, "ten_thousand_in_flight_shm"));
}

#[test]
fn ten_thousand_in_flight_loopback() {
    many_in_flight(Lane::Loopback, "ten_thousand_in_flight_loopback");
}

// ---------------------------------------------------------------------------------------------
// 5. Cancel

fn cancel(lane: Lane, test: &'static str) {
    let s = Setup::new(lane, test, &[]);
    let w = s.w();
    let mut peer = s.sender();
    let fired = Arc::new(AtomicUsize::new(0));
    let f = fired.clone();
    let mut b1 = vec![0u8; 64];
    // SAFETY: b1 outlives the request (canceled and waited for below).
    let r1 = unsafe {
        w.tag_recv_nbx(
            b1.as_mut_ptr(),
            64,
            5,
            u64::MAX,
            RequestParams::with_callback(move |_, st, _| {
                assert_eq!(st, Status::Canceled);
                f.fetch_add(1, Ordering::SeqCst);
            }),
        )
        .unwrap()
    };
    let Started::Pending(r1) = r1 else { panic!("nothing was sent yet") };
    w.request_cancel(r1).unwrap();
    assert_eq!(w.request_test(r1).unwrap().map(|c| c.status), Some(Status::Canceled));
    for _ in 0..100 {
        w.progress();
    }
    assert_eq!(fired.load(Ordering::SeqCst), 1, "cancel callback fires exactly once");
    let e = w.request_cancel(r1).unwrap_err();
    assert_eq!(e.status(), Status::InvalidParam, "cancel of a completed request: {e:?}");
    w.request_release(r1).unwrap();
    assert_eq!(w.request_cancel(r1).unwrap_err().status(), Status::InvalidHandle, "cancel of a released handle");
    assert_eq!(w.request_cancel(0x1234).unwrap_err().status(), Status::InvalidHandle, "cancel of a forged handle");
    assert_eq!(w.request_release(r1).unwrap_err().status(), Status::InvalidHandle, "double release");
    // The next message with that tag goes to the next receive, not to the canceled one.
    let r2 = post(w, 64, 5, u64::MAX);
    let plan = [Msg { tag: 5, size: 48, seed: 9 }];
    assert_eq!(run_plan(&s, &mut peer, &plan), vec![Status::Ok]);
    let c = wait_rx(w, &r2);
    assert_eq!((c.status, c.info.length), (Status::Ok, 48));
    assert_same(&r2.buf[..48], &pattern(9, 48), "after cancel");
    assert!(b1.iter().all(|&b| b == 0), "the canceled buffer was written");
    // A rendezvous message meeting a receive posted after the cancel works too.
    let ep_plan = [Msg { tag: 6, size: 100_000, seed: 1 }];
    peer.put("plan", &encode_plan(&ep_plan));
    progress_until(w, T, "rts", || w.stats().unexpected == 1);
    let r3 = post(w, 100_000, 6, u64::MAX);
    let c = wait_rx(w, &r3);
    assert_eq!(c.status, Status::Ok);
    assert_eq!(collect_sent(&s, &mut peer), vec![Status::Ok]);
    assert_eq!(fired.load(Ordering::SeqCst), 1);
    s.finish(vec![peer]);
}

#[test]
fn cancel_shm() {
    child_or(|| cancel(Lane::Shm, "cancel_shm"));
}

#[test]
fn cancel_loopback() {
    cancel(Lane::Loopback, "cancel_loopback");
}

// ---------------------------------------------------------------------------------------------
// 6. Probe and msg_recv

fn probe(lane: Lane, test: &'static str) {
    // Small frames so a 40000-byte eager message arrives in fragments.
    let s = Setup::new(lane, test, &[("GSC_SHM_MAX_FRAME", "16K"), ("GSC_RNDV_THRESH", "64K")]);
    let w = s.w();
    let mut peer = s.sender();
    let plan = [
        Msg { tag: 21, size: 3000, seed: 1 },
        Msg { tag: 22, size: 100_000, seed: 2 },
        Msg { tag: 23, size: 50, seed: 3 },
        Msg { tag: 24, size: 40_000, seed: 4 },
    ];
    peer.put("plan", &encode_plan(&plan));
    let mut p = None;
    progress_until(w, T, "probe 21", || {
        p = w.tag_probe(21, u64::MAX, false);
        p.is_some()
    });
    let p = p.unwrap();
    assert_eq!((p.tag, p.length, p.msg), (21, 3000, None));
    assert!(w.tag_probe(21, u64::MAX, false).is_some(), "a non-removing probe leaves the message");
    let taken = w.tag_probe(21, u64::MAX, true).unwrap();
    let m21 = taken.msg.expect("removing probe gives a message handle");
    assert!(w.tag_probe(21, u64::MAX, false).is_none(), "a removed message is out of matching");
    // A wildcard receive must not take the probed message: it gets the next one (22).
    let mut got = None;
    progress_until(w, T, "probe 22", || {
        got = w.tag_probe(22, u64::MAX, true);
        got.is_some()
    });
    let m22 = got.unwrap();
    assert_eq!(m22.length, 100_000);
    let mut b21 = vec![0u8; 3000];
    // SAFETY: the buffer outlives the request (waited for at once).
    let s21 = unsafe { w.tag_msg_recv_nbx(b21.as_mut_ptr(), b21.len(), m21, RequestParams::default()).unwrap() };
    assert_eq!(wait_release(w, s21).info.length, 3000);
    assert_same(&b21, &pattern(1, 3000), "msg_recv eager");
    // SAFETY: as above.
    let again = unsafe { w.tag_msg_recv_nbx(b21.as_mut_ptr(), b21.len(), m21, RequestParams::default()) };
    assert_eq!(again.unwrap_err().status(), Status::InvalidHandle, "msg_recv of a consumed message");
    let mut b22 = vec![0u8; 100_000];
    // SAFETY: as above.
    let s22 = unsafe { w.tag_msg_recv_nbx(b22.as_mut_ptr(), b22.len(), m22.msg.unwrap(), RequestParams::default()).unwrap() };
    let c = wait_release(w, s22);
    assert_eq!((c.status, c.info.tag, c.info.length), (Status::Ok, 22, 100_000));
    assert_same(&b22, &pattern(2, 100_000), "msg_recv rendezvous");
    // A full-wildcard probe takes the oldest remaining message: 23, then 24 (possibly while its
    // fragments are still arriving).
    let mut got = None;
    progress_until(w, T, "probe any", || {
        got = w.tag_probe(0, 0, true);
        got.is_some()
    });
    let m23 = got.unwrap();
    assert_eq!((m23.tag, m23.length), (23, 50));
    let mut got = None;
    progress_until(w, T, "probe any", || {
        got = w.tag_probe(0, 0, true);
        got.is_some()
    });
    let m24 = got.unwrap();
    assert_eq!((m24.tag, m24.length), (24, 40_000));
    let mut b24 = vec![0u8; 40_000];
    // SAFETY: as above.
    let s24 = unsafe { w.tag_msg_recv_nbx(b24.as_mut_ptr(), b24.len(), m24.msg.unwrap(), RequestParams::default()).unwrap() };
    assert_eq!(wait_release(w, s24).status, Status::Ok);
    assert_same(&b24, &pattern(4, 40_000), "msg_recv fragmented eager");
    let mut b23 = vec![0u8; 50];
    // SAFETY: as above.
    let s23 = unsafe { w.tag_msg_recv_nbx(b23.as_mut_ptr(), 50, m23.msg.unwrap(), RequestParams::default()).unwrap() };
    assert_eq!(wait_release(w, s23).status, Status::Ok);
    assert_same(&b23, &pattern(3, 50), "msg_recv short");
    assert!(w.tag_probe(0, 0, false).is_none());
    assert_eq!(collect_sent(&s, &mut peer), vec![Status::Ok; 4]);
    s.finish(vec![peer]);
}

#[test]
fn probe_and_msg_recv_shm() {
    child_or(|| probe(Lane::Shm, "probe_and_msg_recv_shm"));
}

#[test]
fn probe_and_msg_recv_loopback() {
    probe(Lane::Loopback, "probe_and_msg_recv_loopback");
}
