//! Host-stream conditions between processes (shm lane) and threads (loopback): every operation
//! is issued on a host stream and started by the worker's proxy when the stream reaches it.
//! The CUDA-stream versions of these scenarios are in tests/conditions_gpu.rs.
mod common;

use common::*;
use gscomm::condition::{Condition, HostStream};
use gscomm::{Context, Direction, PrepareParams, RequestParams, Status, Worker};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);

/// A buffer shared by stream work (closures) and operations (raw pointers); stream order keeps
/// the two apart in time.
#[derive(Clone)]
struct Buf(Arc<Mutex<Vec<u8>>>);

impl Buf {
    fn new(len: usize) -> Buf {
        Buf(Arc::new(Mutex::new(vec![0; len])))
    }
    fn ptr(&self) -> *mut u8 {
        self.0.lock().unwrap().as_mut_ptr()
    }
    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

fn sizes_to_bytes(s: &[usize]) -> Vec<u8> {
    s.iter().flat_map(|&x| (x as u64).to_le_bytes()).collect()
}

fn bytes_to_sizes(b: &[u8]) -> Vec<usize> {
    b.chunks_exact(8).map(|c| bytes_u64(c) as usize).collect()
}

const HALO_ITERS: u8 = 200;
const HALO_SIZE: usize = 100_000;

/// Fill for a halo iteration: differs by iteration and by side, so stale data shows.
fn halo_byte(iter: u8, side: u8) -> u8 {
    iter.wrapping_mul(7) ^ side.wrapping_mul(0x55)
}

/// One side of the halo exchange: every iteration refills its buffer on the stream, sends and
/// receives with no stream wait, waits for both, and checks what arrived, all on the stream.
/// With `prepared`, the exchange runs on a prepared send and receive started on the stream.
fn halo_side(w: &Worker, ep: &gscomm::Endpoint, side: u8, prepared: bool) -> Result<(), String> {
    let stream = HostStream::new().unwrap();
    let cond = Condition::host_stream(&stream);
    let (src, dst) = (Buf::new(HALO_SIZE), Buf::new(HALO_SIZE));
    let preps = prepared.then(|| {
        let p = |dir| PrepareParams { dir, tag: 7, partitions: None, memory_type: None, engine: gscomm::Engine::Auto };
        // SAFETY: both buffers outlive the preparations (dropped at the end of this function,
        // after every round completed); stream order keeps rounds and stream work apart.
        unsafe {
            (ep.prepare(src.ptr(), HALO_SIZE, p(Direction::Send)).unwrap(), ep.prepare(dst.ptr(), HALO_SIZE, p(Direction::Recv)).unwrap())
        }
    });
    let bad = Arc::new(Mutex::new(None::<String>));
    let mut reqs = Vec::new();
    for iter in 0..HALO_ITERS {
        let s2 = src.clone();
        stream.launch(move || s2.0.lock().unwrap().fill(halo_byte(iter, side)));
        // Side 0 groups every other round (one trigger and one wait for the pair), side 1 never.
        let grouped = side == 0 && iter % 2 == 0;
        if grouped {
            cond.group_start().unwrap();
        }
        match &preps {
            Some((tx, rx)) => {
                reqs.push(pending(rx.start(on(&cond, false)).unwrap()));
                reqs.push(pending(tx.start(on(&cond, false)).unwrap()));
            }
            None => {
                reqs.push(pending(unsafe { w.tag_recv_nbx(dst.ptr(), HALO_SIZE, iter as u64, u64::MAX, on(&cond, false)).unwrap() }));
                reqs.push(pending(unsafe { ep.tag_send_nbx(src.ptr(), HALO_SIZE, iter as u64, on(&cond, false)).unwrap() }));
            }
        }
        cond.wait().unwrap();
        if grouped {
            cond.group_end().unwrap();
        }
        let (d2, bad2) = (dst.clone(), bad.clone());
        let want = halo_byte(iter, 1 - side);
        stream.launch(move || {
            if let Some(i) = d2.0.lock().unwrap().iter().position(|&x| x != want) {
                bad2.lock().unwrap().get_or_insert(format!("iteration {iter}: byte {i} stale"));
            }
        });
    }
    let statuses = wait_all(w, reqs);
    stream.synchronize(Some(T)).map_err(|e| e.to_string())?;
    if let Some(s) = statuses.iter().find(|s| **s != Status::Ok) {
        return Err(format!("an operation ended with {s:?}"));
    }
    bad.lock().unwrap().take().map_or(Ok(()), Err)
}

fn roles(role: &str, chan: &dyn Chan, ctx: Context) {
    let w = ctx.create_worker().unwrap();
    let ep = w.connect(&chan.get("addr")).unwrap();
    chan.put("ready", w.address());
    match role {
        // Receive each message on the stream, transform it there, send it back on the stream.
        "echo" => {
            let sizes = bytes_to_sizes(&chan.get("sizes"));
            let stream = HostStream::new().unwrap();
            let cond = Condition::host_stream(&stream);
            let mut reqs = Vec::new();
            let bufs: Vec<Buf> = sizes.iter().map(|&n| Buf::new(n)).collect();
            for (i, b) in bufs.iter().enumerate() {
                reqs.push(pending(unsafe { w.tag_recv_nbx(b.ptr(), b.len(), i as u64, u64::MAX, on(&cond, true)).unwrap() }));
                let b2 = b.clone();
                stream.launch(move || b2.0.lock().unwrap().iter_mut().for_each(|x| *x ^= 0x5A));
                reqs.push(pending(unsafe { ep.tag_send_nbx(b.ptr(), b.len(), 1000 + i as u64, on(&cond, true)).unwrap() }));
            }
            let st = wait_all(&w, reqs);
            stream.synchronize(Some(T)).unwrap();
            assert!(st.iter().all(|s| *s == Status::Ok), "{st:?}");
            chan.put("echoed", &[]);
        }
        "halo" | "phalo" => {
            let r = halo_side(&w, &ep, 1, role == "phalo");
            chan.put("halo", r.err().unwrap_or_default().as_bytes());
        }
        // Send tags 1..=8 in order at once (the receiver takes them in reverse, late).
        "tags" => {
            let stream = HostStream::new().unwrap();
            let cond = Condition::host_stream(&stream);
            let bufs: Vec<Vec<u8>> = (1..=8u64).map(|t| pattern(t, 1000 * t as usize)).collect();
            let reqs = bufs
                .iter()
                .zip(1u64..)
                .map(|(b, t)| pending(unsafe { ep.tag_send_nbx(b.as_ptr(), b.len(), t, on(&cond, false)).unwrap() }))
                .collect();
            cond.wait().unwrap();
            let st = wait_all(&w, reqs);
            stream.synchronize(Some(T)).unwrap();
            assert!(st.iter().all(|s| *s == Status::Ok), "{st:?}");
            chan.put("sent", &[]);
        }
        // Eight messages with one tag, in one group: the proxy sees them triggered together.
        "same_tag" => {
            let stream = HostStream::new().unwrap();
            let cond = Condition::host_stream(&stream);
            let bufs: Vec<Vec<u8>> = (0..SAME_TAG_SENDS).map(|k| pattern(100 + k, 64 + k as usize)).collect();
            cond.group_start().unwrap();
            let reqs =
                bufs.iter().map(|b| pending(unsafe { ep.tag_send_nbx(b.as_ptr(), b.len(), 5, on(&cond, false)).unwrap() })).collect();
            cond.wait().unwrap();
            cond.group_end().unwrap();
            let st = wait_all(&w, reqs);
            stream.synchronize(Some(T)).unwrap();
            assert!(st.iter().all(|s| *s == Status::Ok), "{st:?}");
            chan.put("sent", &[]);
        }
        // Connected; never receives. The test kills this process.
        "doomed" => loop {
            w.progress();
            std::thread::sleep(Duration::from_millis(1));
        },
        other => panic!("unknown role {other}"),
    }
    chan.get("bye");
    ep.close().unwrap();
}

fn child_or(f: impl FnOnce()) {
    if !run_child_role(roles) {
        f()
    }
}

struct Setup {
    lane: Lane,
    test: &'static str,
    _dir: ShmDir,
    cfg: Vec<(String, String)>,
    w: Worker,
}

impl Setup {
    fn new(lane: Lane, test: &'static str) -> Setup {
        Setup::with(lane, test, &[])
    }

    /// `new` with more `GSC_*` overrides, for this process and the peer.
    fn with(lane: Lane, test: &'static str, extra: &[(&str, &str)]) -> Setup {
        let dir = ShmDir::new(test);
        let mut cfg = vec![
            ("GSC_TLS".to_string(), lane.tls().to_string()),
            ("GSC_SHM_DIR".to_string(), dir.as_str().to_string()),
            ("GSC_TIMEOUT".to_string(), "60s".to_string()),
            ("GSC_PEER_CHECK_INTERVAL".to_string(), "50ms".to_string()),
        ];
        cfg.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let w = ctx_with(&refs(&cfg)).create_worker().unwrap();
        Setup { lane, test, _dir: dir, cfg, w }
    }

    /// Start `role` and connect to it both ways (it sends its worker's address when ready).
    fn peer(&self, role: &str) -> (Peer, gscomm::Endpoint) {
        let mut p = start_peer(self.lane, self.test, role, &refs(&self.cfg), roles);
        p.put("addr", self.w.address());
        let addr = p.get_progress("ready", T, &self.w);
        let ep = self.w.connect(&addr).unwrap();
        (p, ep)
    }

    fn finish(&self, mut p: Peer, ep: gscomm::Endpoint) {
        p.put("bye", &[]);
        ep.close().unwrap();
        let deadline = Instant::now() + T;
        while !p.is_finished() {
            assert!(Instant::now() < deadline, "peer did not finish");
            self.w.progress();
        }
        p.finish(T);
    }
}

fn echo(lane: Lane, test: &'static str) {
    let s = Setup::new(lane, test);
    let (mut p, ep) = s.peer("echo");
    let sizes = [0usize, 1, 128, 129, 65_535, 65_536, 65_537, 1 << 20, 64 << 20];
    p.put("sizes", &sizes_to_bytes(&sizes));
    let stream = HostStream::new().unwrap();
    let cond = Condition::host_stream(&stream);
    let (srcs, dsts): (Vec<Buf>, Vec<Buf>) = sizes.iter().map(|&n| (Buf::new(n), Buf::new(n))).unzip();
    let bad = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut reqs = Vec::new();
    for (i, (src, dst)) in srcs.iter().zip(&dsts).enumerate() {
        // The data is made on the stream, right before the send that carries it.
        let s2 = src.clone();
        stream.launch(move || {
            let mut b = s2.0.lock().unwrap();
            let n = b.len();
            b.copy_from_slice(&pattern(i as u64 + 77, n));
        });
        reqs.push(pending(unsafe { ep.tag_send_nbx(src.ptr(), src.len(), i as u64, on(&cond, true)).unwrap() }));
        reqs.push(pending(unsafe { s.w.tag_recv_nbx(dst.ptr(), dst.len(), 1000 + i as u64, u64::MAX, on(&cond, true)).unwrap() }));
        // And checked on the stream, right after the receive that brought it back.
        let (d2, bad2) = (dst.clone(), bad.clone());
        stream.launch(move || {
            let got = d2.0.lock().unwrap();
            let want: Vec<u8> = pattern(i as u64 + 77, got.len()).iter().map(|x| x ^ 0x5A).collect();
            if *got != want {
                bad2.lock().unwrap().push(format!("size {}: wrong data after the receive", got.len()));
            }
        });
    }
    let st = wait_all(&s.w, reqs);
    assert!(st.iter().all(|x| *x == Status::Ok), "{st:?}");
    stream.synchronize(Some(T)).unwrap();
    assert!(bad.lock().unwrap().is_empty(), "{:?}", bad.lock().unwrap());
    // Every operation here went through the proxy, once: a send and a receive per size.
    let stats = s.w.stats();
    assert_eq!((stats.proxy_armed, stats.proxy_started), (2 * sizes.len() as u64, 2 * sizes.len() as u64), "{stats:?}");
    p.get_progress("echoed", T, &s.w);
    s.finish(p, ep);
}

/// `WorkerStats`' proxy counters count exactly the proxy's work: none for direct operations
/// (the proxy is not even started), each conditioned operation once when it is armed and once
/// when the proxy starts it, and nothing started before the stream reaches it.
#[test]
fn proxy_counters_count_each_armed_and_started_operation_loopback() {
    child_or(|| {
        let s = Setup::new(Lane::Loopback, "proxy_counters_count_each_armed_and_started_operation_loopback");
        let (mut p, ep) = s.peer("echo");
        // Message 0 goes direct, the others on a host stream; one eager, one rendezvous.
        let sizes = [4096usize, 100, 1 << 20];
        p.put("sizes", &sizes_to_bytes(&sizes));
        let sent: Vec<Vec<u8>> = sizes.iter().zip(1u64..).map(|(&n, seed)| pattern(seed, n)).collect();
        let echoed = |i: usize| sent[i].iter().map(|x| x ^ 0x5A).collect::<Vec<u8>>();
        let mut back = vec![0u8; sizes[0]];
        let tx = unsafe { ep.tag_send_nbx(sent[0].as_ptr(), sizes[0], 0, RequestParams::default()).unwrap() };
        let rx = unsafe { s.w.tag_recv_nbx(back.as_mut_ptr(), sizes[0], 1000, u64::MAX, RequestParams::default()).unwrap() };
        assert_eq!(wait_release(&s.w, tx).status, Status::Ok);
        assert_eq!(wait_release(&s.w, rx).status, Status::Ok);
        assert_same(&back, &echoed(0), "direct echo");
        let direct = s.w.stats();
        assert_eq!((direct.proxy_armed, direct.proxy_started, direct.proxy_passes), (0, 0, 0), "direct operations only: {direct:?}");

        // The stream is held at a gate until every operation is armed: none may start before.
        let stream = HostStream::new().unwrap();
        let cond = Condition::host_stream(&stream);
        let (open_gate, gate) = std::sync::mpsc::channel::<()>();
        stream.launch(move || {
            let _ = gate.recv_timeout(T);
        });
        let backs: Vec<Buf> = sizes[1..].iter().map(|&n| Buf::new(n)).collect();
        let mut reqs = Vec::new();
        for (i, b) in (1..).zip(&backs) {
            reqs.push(pending(unsafe { ep.tag_send_nbx(sent[i].as_ptr(), sizes[i], i as u64, on(&cond, true)).unwrap() }));
            reqs.push(pending(unsafe { s.w.tag_recv_nbx(b.ptr(), b.len(), 1000 + i as u64, u64::MAX, on(&cond, true)).unwrap() }));
        }
        let ops = reqs.len() as u64;
        let armed = s.w.stats();
        assert_eq!((armed.proxy_armed, armed.proxy_started), (ops, 0), "armed behind the gate: {armed:?}");
        open_gate.send(()).unwrap();
        let st = wait_all(&s.w, reqs);
        assert!(st.iter().all(|x| *x == Status::Ok), "{st:?}");
        stream.synchronize(Some(T)).unwrap();
        for (i, b) in (1..).zip(&backs) {
            assert_same(&b.0.lock().unwrap(), &echoed(i), &format!("echo of message {i}"));
        }
        let done = s.w.stats();
        assert_eq!((done.proxy_armed, done.proxy_started), (ops, ops), "all triggered: {done:?}");
        assert!(done.proxy_passes > 0, "the proxy started them in its passes: {done:?}");
        p.get_progress("echoed", T, &s.w);
        s.finish(p, ep);
    });
}

/// `GSC_PROXY_THREAD=off` (both processes): no thread watches the triggers, the application's
/// progress calls do. Operations the stream has passed do not start while nobody progresses the
/// worker; once it is progressed the echo completes as with a proxy thread.
#[test]
fn caller_run_proxy_starts_operations_only_inside_progress_shm() {
    child_or(|| {
        let test = "caller_run_proxy_starts_operations_only_inside_progress_shm";
        let s = Setup::with(Lane::Shm, test, &[("GSC_PROXY_THREAD", "off")]);
        let (mut p, ep) = s.peer("echo");
        let sizes = [100usize, 1 << 20];
        p.put("sizes", &sizes_to_bytes(&sizes));
        let stream = HostStream::new().unwrap();
        let cond = Condition::host_stream(&stream);
        let srcs: Vec<Vec<u8>> = sizes.iter().zip(5u64..).map(|(&n, seed)| pattern(seed, n)).collect();
        let backs: Vec<Buf> = sizes.iter().map(|&n| Buf::new(n)).collect();
        let mut reqs = Vec::new();
        for (i, (src, b)) in srcs.iter().zip(&backs).enumerate() {
            reqs.push(pending(unsafe { ep.tag_send_nbx(src.as_ptr(), src.len(), i as u64, on(&cond, true)).unwrap() }));
            reqs.push(pending(unsafe { s.w.tag_recv_nbx(b.ptr(), b.len(), 1000 + i as u64, u64::MAX, on(&cond, true)).unwrap() }));
        }
        let ops = reqs.len() as u64;
        // The stream reaches the first send at once; without a progress call nothing starts it.
        std::thread::sleep(Duration::from_millis(200));
        let idle = s.w.stats();
        assert_eq!((idle.proxy_armed, idle.proxy_started, idle.proxy_passes), (ops, 0, 0), "no thread ran them: {idle:?}");
        let st = wait_all(&s.w, reqs);
        assert!(st.iter().all(|x| *x == Status::Ok), "{st:?}");
        stream.synchronize(Some(T)).unwrap();
        for (i, b) in backs.iter().enumerate() {
            let want: Vec<u8> = srcs[i].iter().map(|x| x ^ 0x5A).collect();
            assert_same(&b.0.lock().unwrap(), &want, &format!("echo of message {i}"));
        }
        let done = s.w.stats();
        assert_eq!(done.proxy_started, ops, "{done:?}");
        p.get_progress("echoed", T, &s.w);
        s.finish(p, ep);
    });
}

#[test]
fn stream_ordered_echo_all_sizes_shm() {
    child_or(|| echo(Lane::Shm, "stream_ordered_echo_all_sizes_shm"));
}

#[test]
fn stream_ordered_echo_all_sizes_loopback() {
    child_or(|| echo(Lane::Loopback, "stream_ordered_echo_all_sizes_loopback"));
}

/// 200 rounds of a two-sided halo exchange issued ahead on the stream, new data every round.
#[test]
fn halo_exchange_rounds_with_new_data_shm() {
    child_or(|| halo(Lane::Shm, "halo_exchange_rounds_with_new_data_shm", false));
}

/// The same with prepared transfers started on the stream: matching resolved once.
#[test]
fn prepared_halo_exchange_rounds_with_new_data_shm() {
    child_or(|| halo(Lane::Shm, "prepared_halo_exchange_rounds_with_new_data_shm", true));
}

#[test]
fn prepared_halo_exchange_rounds_with_new_data_loopback() {
    child_or(|| halo(Lane::Loopback, "prepared_halo_exchange_rounds_with_new_data_loopback", true));
}

fn halo(lane: Lane, test: &'static str, prepared: bool) {
    let s = Setup::new(lane, test);
    let (mut p, ep) = s.peer(if prepared { "phalo" } else { "halo" });
    let mine = halo_side(&s.w, &ep, 0, prepared);
    let theirs = String::from_utf8(p.get_progress("halo", T, &s.w)).unwrap();
    assert_eq!(mine, Ok(()));
    assert!(theirs.is_empty(), "peer: {theirs}");
    s.finish(p, ep);
}

/// Receives posted in reverse tag order, long after the sends, behind slow stream work.
#[test]
fn late_receives_in_reverse_tag_order_shm() {
    child_or(|| {
        let s = Setup::new(Lane::Shm, "late_receives_in_reverse_tag_order_shm");
        let (mut p, ep) = s.peer("tags");
        let stream = HostStream::new().unwrap();
        let cond = Condition::host_stream(&stream);
        stream.launch(|| std::thread::sleep(Duration::from_millis(300)));
        let bufs: Vec<Buf> = (1..=8usize).map(|t| Buf::new(1000 * t)).collect();
        let reqs = (1..=8u64)
            .rev()
            .map(|t| {
                let b = &bufs[t as usize - 1];
                pending(unsafe { s.w.tag_recv_nbx(b.ptr(), b.len(), t, u64::MAX, on(&cond, false)).unwrap() })
            })
            .collect();
        cond.wait().unwrap();
        let st = wait_all(&s.w, reqs);
        assert!(st.iter().all(|x| *x == Status::Ok), "{st:?}");
        stream.synchronize(Some(T)).unwrap();
        for (b, t) in bufs.iter().zip(1u64..) {
            assert_same(&b.0.lock().unwrap(), &pattern(t, 1000 * t as usize), &format!("tag {t}"));
        }
        p.get_progress("sent", T, &s.w);
        s.finish(p, ep);
    });
}

const SAME_TAG_SENDS: u64 = 8;

/// MPI's non-overtaking rule through the proxy: sends with one tag to one peer, armed in one
/// group (started together when its trigger fires), are received in the order they were issued.
#[test]
fn same_tag_sends_of_one_group_arrive_in_issue_order_shm() {
    child_or(|| {
        let s = Setup::new(Lane::Shm, "same_tag_sends_of_one_group_arrive_in_issue_order_shm");
        let (mut p, ep) = s.peer("same_tag");
        let bufs: Vec<Buf> = (0..SAME_TAG_SENDS).map(|_| Buf::new(64 + SAME_TAG_SENDS as usize)).collect();
        let reqs: Vec<u64> = bufs
            .iter()
            .map(|b| {
                let params = RequestParams { no_immediate_completion: true, ..Default::default() };
                pending(unsafe { s.w.tag_recv_nbx(b.ptr(), b.len(), 5, u64::MAX, params).unwrap() })
            })
            .collect();
        let st = wait_all(&s.w, reqs);
        assert!(st.iter().all(|x| *x == Status::Ok), "{st:?}");
        for (k, b) in (0..SAME_TAG_SENDS).zip(&bufs) {
            let want = pattern(100 + k, 64 + k as usize);
            assert_same(&b.0.lock().unwrap()[..want.len()], &want, &format!("receive {k} holds message {k}"));
        }
        p.get_progress("sent", T, &s.w);
        s.finish(p, ep);
    });
}

/// A rendezvous send armed on a stream to a peer that dies: the request fails, the stream's
/// wait is released, the condition reports the failure, all within a bounded time.
#[test]
fn a_dead_peer_fails_the_operation_and_releases_the_stream_shm() {
    child_or(|| {
        let s = Setup::new(Lane::Shm, "a_dead_peer_fails_the_operation_and_releases_the_stream_shm");
        let (p, ep) = s.peer("doomed");
        let stream = HostStream::new().unwrap();
        let cond = Condition::host_stream(&stream);
        let data = vec![7u8; 4 << 20];
        let h = pending(unsafe { ep.tag_send_nbx(data.as_ptr(), data.len(), 1, on(&cond, true)).unwrap() });
        let Peer::Proc(mut child) = p else { unreachable!() };
        std::thread::sleep(Duration::from_millis(50));
        child.kill();
        let t0 = Instant::now();
        let st = wait_all(&s.w, vec![h]);
        assert_ne!(st[0], Status::Ok);
        let e = stream.synchronize(Some(Duration::from_secs(20))).unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(10), "took {:?}", t0.elapsed());
        assert_eq!(cond.query().unwrap_err().status(), e.status());
    });
}

/// A stopped (SIGSTOP) peer (issue #8): a receive and a rendezvous send armed on a host stream,
/// with the peer stopped before it could answer, fail with `TimedOut` after `GSC_TIMEOUT`
/// (1 s here) instead of holding the stream forever; the stream's waits are released.
#[test]
fn a_stopped_peer_times_out_stream_operations_shm() {
    child_or(|| {
        let s = Setup::with(Lane::Shm, "a_stopped_peer_times_out_stream_operations_shm", &[("GSC_TIMEOUT", "1s")]);
        let (mut p, ep) = s.peer("doomed");
        p.proc().stop();
        let stream = HostStream::new().unwrap();
        let cond = Condition::host_stream(&stream);
        let mut inbox = vec![0u8; 64];
        let data = vec![7u8; 4 << 20];
        let t0 = Instant::now();
        // Both in flight at once (no stream wait each), then one wait for both.
        let r = pending(unsafe { s.w.tag_recv_nbx(inbox.as_mut_ptr(), 64, 9, u64::MAX, on(&cond, false)).unwrap() });
        let h = pending(unsafe { ep.tag_send_nbx(data.as_ptr(), data.len(), 1, on(&cond, false)).unwrap() });
        cond.wait().unwrap();
        // Not request_wait: it has the same 1 s bound and would race the proxy's expiry.
        let st: Vec<Status> = [r, h]
            .into_iter()
            .map(|q| {
                loop {
                    if let Some(c) = s.w.request_test(q).unwrap() {
                        s.w.request_release(q).unwrap();
                        break c.status;
                    }
                    assert!(t0.elapsed() < Duration::from_secs(10), "no expiry after {:?}", t0.elapsed());
                    std::thread::sleep(Duration::from_millis(5));
                }
            })
            .collect();
        let took = t0.elapsed();
        assert_eq!(st, vec![Status::TimedOut, Status::TimedOut], "after {took:?}");
        assert!(took >= Duration::from_secs(1) && took < Duration::from_secs(5), "timed out after {took:?}");
        let e = stream.synchronize(Some(Duration::from_secs(10))).unwrap_err();
        assert_eq!(e.status(), Status::TimedOut);
        assert_eq!(cond.query().unwrap_err().status(), Status::TimedOut);
        assert!(inbox.iter().all(|&b| b == 0), "the timed-out receive's buffer was written");
        let c = p.proc();
        c.signal(libc::SIGCONT);
        c.kill();
    });
}

/// The same stopped peer, but the send starts half a second after the receive on one host
/// stream: the receive times out first and sets the channel's error bit while the send still
/// runs. The proxy must go on watching the send until its own `GSC_TIMEOUT` (it once dropped
/// every operation of a failed channel from its watch, and the send then never ended; CI saw
/// it when the two expiries fell into different checks).
#[test]
fn a_send_still_running_after_an_earlier_timeout_times_out_too_shm() {
    child_or(|| {
        let s = Setup::with(Lane::Shm, "a_send_still_running_after_an_earlier_timeout_times_out_too_shm", &[("GSC_TIMEOUT", "1s")]);
        let (mut p, ep) = s.peer("doomed");
        p.proc().stop();
        let stream = HostStream::new().unwrap();
        let cond = Condition::host_stream(&stream);
        let mut inbox = vec![0u8; 64];
        let data = vec![7u8; 4 << 20];
        let t0 = Instant::now();
        let r = pending(unsafe { s.w.tag_recv_nbx(inbox.as_mut_ptr(), 64, 9, u64::MAX, on(&cond, false)).unwrap() });
        std::thread::sleep(Duration::from_millis(500));
        let h = pending(unsafe { ep.tag_send_nbx(data.as_ptr(), data.len(), 1, on(&cond, false)).unwrap() });
        let finished = |q| loop {
            if let Some(c) = s.w.request_test(q).unwrap() {
                s.w.request_release(q).unwrap();
                break (c.status, t0.elapsed());
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "no expiry after {:?}", t0.elapsed());
            std::thread::sleep(Duration::from_millis(5));
        };
        let (recv_status, recv_at) = finished(r);
        let (send_status, send_at) = finished(h);
        assert_eq!((recv_status, send_status), (Status::TimedOut, Status::TimedOut));
        assert!(recv_at >= Duration::from_secs(1) && send_at >= Duration::from_millis(1500), "{recv_at:?}, {send_at:?}");
        assert!(send_at < Duration::from_secs(5), "the send timed out after {send_at:?}");
        let c = p.proc();
        c.signal(libc::SIGCONT);
        c.kill();
    });
}

fn refs(v: &[(String, String)]) -> Vec<(&str, &str)> {
    v.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}
