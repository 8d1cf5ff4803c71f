//! Worker abort (issue #8, promise 3): from another thread at any time, without the peer;
//! idempotent; bounded; every waiting request, armed operation and host-stream wait released
//! with `Aborted`; later operations fail at once with the same error; the peer sees its link go.
//! Host memory and host streams, two workers of one process (loopback and shm lanes), so it
//! runs in CI. Each scenario is repeated with random abort timing.

use gscomm::condition::{Condition, HostStream};
use gscomm::{Config, Context, RequestParams, Started, Status, Worker};
use std::time::{Duration, Instant};

/// Abort must take effect within this, however it is timed.
const BOUND: Duration = Duration::from_secs(3);

fn pair(tls: &str) -> (Context, Worker, Worker, gscomm::Endpoint) {
    let mut c = Config::default();
    c.set("GSC_TLS", tls).unwrap();
    c.set("GSC_TIMEOUT", "30s").unwrap();
    let ctx = Context::new(c).unwrap();
    let a = ctx.create_worker().unwrap();
    let b = ctx.create_worker().unwrap();
    let ep = a.connect(b.address()).unwrap();
    (ctx, a, b, ep)
}

/// A pseudo-random delay below `max_us` (a different one each call).
fn jitter(max_us: u64) -> Duration {
    let t = Instant::now().elapsed().as_nanos() as u64 ^ (std::process::id() as u64).rotate_left(17);
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0x9e3779b97f4a7c15);
    let x = N.fetch_add(0x9e3779b97f4a7c15, std::sync::atomic::Ordering::Relaxed) ^ t;
    Duration::from_micros((x.wrapping_mul(0xbf58476d1ce4e5b9) >> 33) % max_us)
}

fn assert_aborted(r: gscomm::Result<impl std::fmt::Debug>, what: &str) {
    match r {
        Err(e) if e.status() == Status::Aborted && e.to_string().contains("test abort") => {}
        other => panic!("{what}: expected the abort error, got {other:?}"),
    }
}

/// The main thread waits in `request_wait` for a receive nobody sends; another thread aborts.
#[test]
fn abort_from_another_thread_releases_a_blocked_wait() {
    for tls in ["loopback", "shm"] {
        for round in 0..10 {
            let (_ctx, a, b, _ep) = pair(tls);
            let mut buf = vec![0u8; 64];
            let r = unsafe { b.tag_recv_nbx(buf.as_mut_ptr(), 64, 1, u64::MAX, RequestParams::default()) }.unwrap();
            let Started::Pending(h) = r else { panic!("a receive with no message completed") };
            let aborter = {
                let b = b.clone();
                std::thread::spawn(move || {
                    std::thread::sleep(jitter(20_000));
                    b.abort("test abort").unwrap();
                })
            };
            let t0 = Instant::now();
            let c = b.request_wait(h).unwrap();
            assert_eq!(c.status, Status::Aborted, "{tls} round {round}");
            assert!(t0.elapsed() < BOUND + Duration::from_millis(20), "{tls}: wait released after {:?}", t0.elapsed());
            aborter.join().unwrap();
            b.request_release(h).unwrap();
            // Sticky and idempotent.
            b.abort("a second abort").unwrap();
            assert!(b.aborted().unwrap().to_string().contains("test abort"));
            assert_aborted(unsafe { b.tag_recv_nbx(buf.as_mut_ptr(), 64, 1, u64::MAX, RequestParams::default()) }, "receive after abort");
            assert_aborted(b.connect(a.address()).map(|_| ()), "connect after abort");
            drop(a);
        }
    }
}

/// Operations on a host stream: some triggered and waiting for a peer, some still behind a
/// slow task (armed, not triggered). An abort releases the stream's waits with an error, fails
/// every request, and fails operations issued after it at once.
#[test]
fn abort_releases_host_stream_waits_and_armed_operations() {
    for tls in ["loopback", "shm"] {
        for round in 0..10 {
            let (_ctx, a, b, ep) = pair(tls);
            let stream = HostStream::new().unwrap();
            let cond = Condition::host_stream(&stream);
            let on = || RequestParams { condition: Some(cond.clone()), ..Default::default() };
            let mut bufs = vec![vec![0u8; 4096]; 4];
            // Triggered at once; never matched (nobody sends tag 2): the stream waits on it.
            let r1 = unsafe { b.tag_recv_nbx(bufs[0].as_mut_ptr(), 4096, 2, u64::MAX, on()) }.unwrap();
            // Behind a slow task: armed, not triggered, when the abort comes.
            stream.launch(|| std::thread::sleep(Duration::from_millis(50)));
            let r2 = unsafe { b.tag_recv_nbx(bufs[1].as_mut_ptr(), 4096, 3, u64::MAX, on()) }.unwrap();
            // b's send that a never receives (rendezvous size): in flight at the abort.
            let big = vec![7u8; 1 << 20];
            let ep_b = b.connect(a.address()).unwrap();
            let s = unsafe { ep_b.tag_send_nbx(big.as_ptr(), big.len(), 9, RequestParams::default()) }.unwrap();
            std::thread::sleep(jitter(30_000));
            let t0 = Instant::now();
            b.abort("test abort").unwrap();
            assert!(t0.elapsed() < BOUND, "{tls}: abort took {:?}", t0.elapsed());
            let e = stream.synchronize(Some(BOUND));
            assert!(e.is_err(), "{tls} round {round}: the stream's wait was not released with an error");
            // The condition holds the first failure's status (requests carry no message).
            assert_eq!(cond.query().unwrap_err().status(), Status::Aborted, "{tls}: the condition after abort");
            for (what, st) in [("triggered receive", r1), ("armed receive", r2), ("send in flight", s)] {
                if let Started::Pending(h) = st {
                    let c = b.request_wait(h).unwrap();
                    assert!(c.status == Status::Aborted || c.status == Status::Canceled, "{tls}: {what}: {:?}", c.status);
                    b.request_release(h).unwrap();
                }
            }
            assert_aborted(unsafe { ep_b.tag_send_nbx(big.as_ptr(), 8, 9, on()) }, "a send issued on the condition after abort");
            // The peer learns its link is gone within the bound: a send to b fails.
            let deadline = Instant::now() + BOUND;
            loop {
                let r = unsafe { ep.tag_send_nbx(bufs[2].as_ptr(), 8, 4, RequestParams::default()) };
                let failed = match r {
                    Err(_) => true,
                    Ok(Started::Pending(h)) => {
                        let c = a.request_wait(h);
                        let _ = a.request_release(h);
                        !matches!(c, Ok(c) if c.status == Status::Ok)
                    }
                    Ok(_) => false,
                };
                if failed {
                    break;
                }
                assert!(Instant::now() < deadline, "{tls}: the peer never saw the aborted worker's link go");
                a.progress();
                std::thread::sleep(Duration::from_millis(5));
            }
            drop(bufs.pop());
        }
    }
}

/// A thread issuing operations in a loop while another aborts at a random moment: every call
/// after the abort fails with its error, none hangs, and every request issued before it
/// completes (none is left armed forever by an abort that raced its issue).
#[test]
fn abort_during_issue_from_another_thread() {
    for round in 0..20 {
        let (_ctx, _a, b, _ep) = pair("loopback");
        let stream = HostStream::new().unwrap();
        let cond = Condition::host_stream(&stream);
        let issuer = {
            let b = b.clone();
            let cond = cond.clone();
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 64];
                let mut handles = Vec::new();
                let t0 = Instant::now();
                loop {
                    let p = RequestParams { condition: Some(cond.clone()), no_stream_wait: true, ..Default::default() };
                    match unsafe { b.tag_recv_nbx(buf.as_mut_ptr(), 64, 1, u64::MAX, p) } {
                        Ok(Started::Pending(h)) => handles.push(h),
                        Ok(_) => {}
                        Err(e) => return (e, handles, buf),
                    }
                    assert!(t0.elapsed() < Duration::from_secs(20), "no abort seen");
                }
            })
        };
        std::thread::sleep(jitter(10_000));
        b.abort("test abort").unwrap();
        let (e, handles, _buf) = issuer.join().unwrap();
        assert_eq!(e.status(), Status::Aborted, "round {round}: {e}");
        let t0 = Instant::now();
        for h in handles {
            loop {
                if let Some(c) = b.request_test(h).unwrap() {
                    assert_eq!(c.status, Status::Aborted, "round {round}");
                    b.request_release(h).unwrap();
                    break;
                }
                assert!(t0.elapsed() < BOUND, "round {round}: a request issued before the abort never completed");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let _ = stream.synchronize(Some(BOUND));
    }
}

/// Without a proxy thread (`GSC_PROXY_THREAD=off`, the application progresses), an abort
/// called from a completion callback — inside the progress call that runs the proxy's pass —
/// returns, and the armed operation it should fail does fail.
#[test]
fn abort_from_a_callback_without_a_proxy_thread() {
    // On a thread of its own: a regression here is a deadlock, which must fail, not hang.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        abort_from_a_callback_body();
        let _ = tx.send(());
    });
    match rx.recv_timeout(Duration::from_secs(20)) {
        Ok(()) => {}
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("abort from a completion callback deadlocked"),
        Err(e) => panic!("the test body failed: {e}"),
    }
}

fn abort_from_a_callback_body() {
    let mut c = Config::default();
    c.set("GSC_TLS", "loopback").unwrap();
    c.set("GSC_PROXY_THREAD", "off").unwrap();
    c.set("GSC_TIMEOUT", "30s").unwrap();
    let ctx = Context::new(c).unwrap();
    let (a, b) = (ctx.create_worker().unwrap(), ctx.create_worker().unwrap());
    let ep = a.connect(b.address()).unwrap();
    let stream = HostStream::new().unwrap();
    let cond = Condition::host_stream(&stream);
    // Armed behind a slow task: still waiting for its trigger when the callback aborts.
    stream.launch(|| std::thread::sleep(Duration::from_millis(100)));
    let mut late = vec![0u8; 8];
    let p = RequestParams { condition: Some(cond.clone()), ..Default::default() };
    let armed = unsafe { b.tag_recv_nbx(late.as_mut_ptr(), 8, 2, u64::MAX, p) }.unwrap();
    let fired = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let cb = {
        let (b, fired) = (b.clone(), fired.clone());
        RequestParams::with_callback(move |_, _, _| {
            b.abort("test abort from a callback").unwrap();
            fired.store(true, std::sync::atomic::Ordering::SeqCst);
        })
    };
    let mut inbox = vec![0u8; 8];
    let r = unsafe { b.tag_recv_nbx(inbox.as_mut_ptr(), 8, 1, u64::MAX, cb) }.unwrap();
    let s = unsafe { ep.tag_send_nbx(b"8 bytes!".as_ptr(), 8, 1, RequestParams::default()) }.unwrap();
    let t0 = Instant::now();
    while !fired.load(std::sync::atomic::Ordering::SeqCst) {
        assert!(t0.elapsed() < BOUND, "the callback never ran");
        a.progress();
        b.progress();
    }
    let Started::Pending(h) = armed else { panic!("a conditioned receive gave no request") };
    loop {
        b.progress();
        if let Some(c) = b.request_test(h).unwrap() {
            assert_eq!(c.status, Status::Aborted);
            break;
        }
        assert!(t0.elapsed() < BOUND, "the armed receive was not failed by the abort");
    }
    assert!(stream.synchronize(Some(BOUND)).is_err(), "the stream's wait was not released with the error");
    for (w, st) in [(&b, r), (&a, s)] {
        if let Started::Pending(h) = st {
            let _ = w.request_release(h);
        }
    }
}

/// A small seeded generator (xorshift64*), so a failing round of the test below can be replayed
/// with `GSC_TEST_SEED=<the printed seed>`.
struct Rng(u64);

impl Rng {
    fn from_env() -> Rng {
        let seed = std::env::var("GSC_TEST_SEED").ok().and_then(|s| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok());
        let seed = seed.unwrap_or(0x5eed_ab07_2026_1122);
        println!("GSC_TEST_SEED={seed:x}");
        Rng(seed | 1)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

/// Where the main thread is when the abort comes.
#[derive(Copy, Clone, Debug)]
enum Doing {
    /// A ping-pong with the peer, each reply waited for in `request_wait`.
    Waiting,
    /// Issuing sends and receives on a host stream (receives with stream waits, and work
    /// after them) as fast as it can; the stream runs behind.
    Enqueuing,
    /// In `HostStream::synchronize`, behind operations it issued.
    Synchronizing,
}

/// The peer answers every message with the same bytes and tag until told to stop (it polls, so
/// it notices; a blocking receive from any peer would wait GSC_TIMEOUT after the link died).
fn echo_peer(a: Worker, ep: gscomm::Endpoint, stop: std::sync::Arc<std::sync::atomic::AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 256];
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            // SAFETY: `buf` outlives the request: waited for, or canceled and waited for, below.
            let Ok(r) = (unsafe { a.tag_recv_nbx(buf.as_mut_ptr(), buf.len(), 0, 0, RequestParams::default()) }) else { return };
            let info = match r {
                Started::Done(info) => info,
                Started::Pending(h) => loop {
                    if let Some(c) = a.request_test(h).unwrap() {
                        a.request_release(h).unwrap();
                        if c.status != Status::Ok {
                            return;
                        }
                        break c.info;
                    }
                    if stop.load(std::sync::atomic::Ordering::SeqCst) {
                        let _ = a.request_cancel(h);
                        let _ = a.request_wait(h);
                        let _ = a.request_release(h);
                        return;
                    }
                    if a.progress() == 0 {
                        std::thread::yield_now();
                    }
                },
                Started::Armed(_) => unreachable!(),
            };
            if ep.tag_send(&buf[..info.length], info.tag).is_err() {
                return;
            }
        }
    })
}

/// Issue B (issue #8): 50 rounds, each with a seeded random lane, activity and abort delay; the
/// abort comes from another thread while the main thread waits, issues onto a host stream, or
/// synchronizes it. Then: the abort returned within the bound; the main thread's call ended
/// with the abort error; every request issued before it ended; the stream was released; and
/// every later operation fails at once with the *first* abort's error, a second abort changing
/// nothing.
#[test]
fn abort_at_seeded_random_moments_then_everything_fails_fast_with_the_first_error() {
    let mut rng = Rng::from_env();
    // Where the main thread met the abort, counted (printed: timing decides, not the test).
    let mut seen = std::collections::BTreeMap::<String, u32>::new();
    for round in 0..50u64 {
        let tls = ["loopback", "shm"][rng.below(2) as usize];
        let doing = [Doing::Waiting, Doing::Enqueuing, Doing::Synchronizing][rng.below(3) as usize];
        let delay = Duration::from_micros(rng.below(8_000));
        let what = format!("round {round} ({tls}, {doing:?}, abort after {delay:?})");
        let (_ctx, a, b, ep_ab) = pair(tls);
        let ep_ba = b.connect(a.address()).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let peer = echo_peer(a.clone(), ep_ab, stop.clone());
        let reason = format!("seeded abort {round}");
        let aborter = {
            let (b, reason) = (b.clone(), reason.clone());
            std::thread::spawn(move || {
                std::thread::sleep(delay);
                let t0 = Instant::now();
                b.abort(&reason).unwrap();
                t0.elapsed()
            })
        };
        let stream = HostStream::new().unwrap();
        let cond = Condition::host_stream(&stream);
        // Buffers the requests name; kept until every request ended.
        let mut bufs: Vec<Box<[u8; 64]>> = Vec::new();
        let mut handles = Vec::new();
        let t_main = Instant::now();
        let main_error = match doing {
            Doing::Waiting => {
                let mut k = 0u64;
                loop {
                    let out = Box::new([k as u8; 64]);
                    let mut back = Box::new([0u8; 64]);
                    // SAFETY: the boxes live in `bufs` until the requests ended.
                    let r = unsafe { b.tag_recv_nbx(back.as_mut_ptr(), 64, k, u64::MAX, RequestParams::default()) };
                    let s = r.and_then(|r| unsafe { ep_ba.tag_send_nbx(out.as_ptr(), 64, k, RequestParams::default()) }.map(|s| (r, s)));
                    bufs.push(out);
                    bufs.push(back);
                    let (r, s) = match s {
                        Ok(rs) => rs,
                        Err(e) => break (e, "issue"),
                    };
                    if let Started::Pending(h) = s {
                        handles.push(h);
                    }
                    let Started::Pending(h) = r else { panic!("{what}: a receive completed before its send") };
                    match b.request_wait(h) {
                        Ok(c) if c.status == Status::Ok => b.request_release(h).unwrap(),
                        Ok(c) => {
                            b.request_release(h).unwrap();
                            break (gscomm::Error::new(c.status, "the receive's status"), "wait");
                        }
                        Err(e) => break (e, "wait"),
                    }
                    k += 1;
                }
            }
            Doing::Enqueuing | Doing::Synchronizing => {
                let mut k = 0u64;
                let e = loop {
                    let out = Box::new([k as u8; 64]);
                    let mut back = Box::new([0u8; 64]);
                    let nw = RequestParams { condition: Some(cond.clone()), no_stream_wait: true, ..Default::default() };
                    let wait = RequestParams { condition: Some(cond.clone()), ..Default::default() };
                    // SAFETY: the boxes live in `bufs` until the requests ended.
                    let s = unsafe { ep_ba.tag_send_nbx(out.as_ptr(), 64, k, nw) };
                    let r = s.and_then(|s| unsafe { b.tag_recv_nbx(back.as_mut_ptr(), 64, k, u64::MAX, wait) }.map(|r| (s, r)));
                    bufs.push(out);
                    bufs.push(back);
                    match r {
                        Ok((s, r)) => {
                            handles.extend([s, r].into_iter().filter_map(|x| if let Started::Pending(h) = x { Some(h) } else { None }))
                        }
                        Err(e) => break (e, "issue"),
                    }
                    stream.launch(|| std::hint::black_box(()));
                    k += 1;
                    // Synchronizing: issue a few, then wait for the stream (the abort comes
                    // while we are in there, or while issuing the next few).
                    if matches!(doing, Doing::Synchronizing) && k % 8 == 0 {
                        if let Err(e) = stream.synchronize(Some(BOUND * 2)) {
                            break (e, "synchronize");
                        }
                    }
                };
                e
            }
        };
        let (main_error, seen_in) = main_error;
        *seen.entry(format!("{doing:?} in {seen_in}")).or_insert(0) += 1;
        let abort_took = aborter.join().unwrap();
        assert!(abort_took < BOUND, "{what}: abort took {abort_took:?}");
        assert_eq!(main_error.status(), Status::Aborted, "{what}: the main thread's call ended with {main_error}");
        assert!(
            t_main.elapsed() < delay + abort_took + BOUND,
            "{what}: the main thread noticed the abort {:?} after it started",
            t_main.elapsed()
        );
        // Every request issued before the abort ends, one way or another, within the bound.
        let t0 = Instant::now();
        for h in handles {
            loop {
                if let Some(c) = b.request_test(h).unwrap() {
                    assert!(
                        matches!(c.status, Status::Ok | Status::Aborted | Status::Canceled),
                        "{what}: a request ended with {:?}",
                        c.status
                    );
                    b.request_release(h).unwrap();
                    break;
                }
                assert!(t0.elapsed() < BOUND, "{what}: a request issued before the abort never ended");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        // The stream was released (an error, or nothing failed on it before the abort).
        match stream.synchronize(Some(BOUND)) {
            Ok(()) => {}
            Err(e) => assert_eq!(e.status(), Status::Aborted, "{what}: the stream after abort: {e}"),
        }
        // Sticky: a second abort changes nothing; every later call fails at once, naming the
        // first abort's reason.
        b.abort("a later abort").unwrap();
        let first = |r: gscomm::Result<()>, call: &str| {
            let t0 = Instant::now();
            match r {
                Err(e) if e.status() == Status::Aborted && e.to_string().contains(&reason) => {}
                other => panic!("{what}: {call} after the abort: {other:?}"),
            }
            // "At once": no waiting for anything (generous for a loaded CI machine).
            assert!(t0.elapsed() < Duration::from_millis(100), "{what}: {call} took {:?}", t0.elapsed());
        };
        let mut buf = [0u8; 64];
        let t = Instant::now();
        first(unsafe { b.tag_recv_nbx(buf.as_mut_ptr(), 64, 1, u64::MAX, RequestParams::default()) }.map(|_| ()), "a receive");
        first(unsafe { ep_ba.tag_send_nbx(buf.as_ptr(), 64, 1, RequestParams::default()) }.map(|_| ()), "a send");
        let on_stream = RequestParams { condition: Some(cond.clone()), ..Default::default() };
        first(unsafe { ep_ba.tag_send_nbx(buf.as_ptr(), 64, 1, on_stream) }.map(|_| ()), "a send on the host stream");
        first(b.connect(a.address()).map(|_| ()), "connect");
        first(b.flush_nbx(RequestParams::default()).map(|_| ()), "a worker flush");
        first(ep_ba.flush_nbx(RequestParams::default()).map(|_| ()), "an endpoint flush");
        let p = gscomm::PrepareParams {
            dir: gscomm::Direction::Send,
            tag: 3,
            partitions: None,
            memory_type: None,
            engine: gscomm::Engine::Auto,
        };
        first(unsafe { ep_ba.prepare(buf.as_mut_ptr(), 64, p) }.map(|_| ()), "prepare");
        first(b.aborted().map_or(Ok(()), Err), "aborted()");
        assert!(t.elapsed() < Duration::from_millis(300), "{what}: the calls after abort took {:?}", t.elapsed());
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        peer.join().unwrap();
        drop(bufs);
    }
    println!("the main thread met the abort: {seen:?}");
}
