//! Host-stream conditions between two workers of one process (loopback lane): ordering against
//! the stream's own work, waits, and what happens to armed operations when things go away.

use super::*;
use crate::core::{Context, RequestParams, Started, Worker};
use crate::{Config, Status};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

fn pair() -> (Worker, Worker, crate::core::Endpoint) {
    let mut c = Config::default();
    c.set("GSC_TLS", "loopback").unwrap();
    c.set("GSC_TIMEOUT", "20s").unwrap();
    let ctx = Context::new(c).unwrap();
    let a = ctx.create_worker().unwrap();
    let b = ctx.create_worker().unwrap();
    let ep = a.connect(b.address()).unwrap();
    (a, b, ep)
}

fn on(cond: &Condition) -> RequestParams {
    RequestParams { condition: Some(cond.clone()), ..Default::default() }
}

fn wait_req(w: &Worker, s: Started) -> Status {
    match s {
        Started::Pending(h) => {
            let c = w.request_wait(h).unwrap();
            w.request_release(h).unwrap();
            c.status
        }
        other => panic!("a stream-conditioned operation gave {other:?}"),
    }
}

/// A buffer the stream's work and the operations share; raw pointers cross the thread boundary.
struct Shared(Mutex<Vec<u8>>);

impl Shared {
    fn new(len: usize) -> Arc<Shared> {
        Arc::new(Shared(Mutex::new(vec![0; len])))
    }
    fn ptr(&self) -> *mut u8 {
        self.0.lock().unwrap().as_mut_ptr()
    }
}

#[test]
fn operations_start_at_their_stream_position_and_later_work_waits() {
    let (a, b, ep) = pair();
    let (sa, sb) = (HostStream::new().unwrap(), HostStream::new().unwrap());
    let (ca, cb) = (Condition::host_stream(&sa), Condition::host_stream(&sb));
    for size in [0usize, 1, 128, 129, 70_000, 1 << 20] {
        let src = Shared::new(size);
        let dst = Shared::new(size);
        // The send is queued before the data exists: it must not start until the fill ran.
        let gate = Arc::new(AtomicBool::new(false));
        let (g, s2) = (gate.clone(), src.clone());
        sa.launch(move || {
            while !g.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
            for (i, x) in s2.0.lock().unwrap().iter_mut().enumerate() {
                *x = (i * 31 + size) as u8;
            }
        });
        let s = unsafe { ep.tag_send_nbx(src.ptr(), size, 9, on(&ca)).unwrap() };
        let r = unsafe { b.tag_recv_nbx(dst.ptr(), size, 9, u64::MAX, on(&cb)).unwrap() };
        let seen = Arc::new(Mutex::new(None));
        let (d2, seen2) = (dst.clone(), seen.clone());
        sb.launch(move || *seen2.lock().unwrap() = Some(d2.0.lock().unwrap().clone()));
        std::thread::sleep(Duration::from_millis(5));
        assert!(seen.lock().unwrap().is_none(), "work after the receive ran before the message was sent");
        gate.store(true, Ordering::Release);
        assert_eq!(wait_req(&a, s), Status::Ok);
        assert_eq!(wait_req(&b, r), Status::Ok);
        sb.synchronize(Some(Duration::from_secs(20))).unwrap();
        sa.synchronize(Some(Duration::from_secs(20))).unwrap();
        let want: Vec<u8> = (0..size).map(|i| (i * 31 + size) as u8).collect();
        assert!(seen.lock().unwrap().as_ref().unwrap() == &want, "size {size}: the work after the receive saw other data");
    }
    assert!(ca.query().is_ok() && cb.query().is_ok());
}

#[test]
fn no_stream_wait_lets_a_send_and_a_receive_overlap_until_wait() {
    // Each side sends first and receives second, both with stream waits, would deadlock with a
    // rendezvous; without them and one `wait`, it is a halo exchange.
    let (a, b, ep_ab) = pair();
    let ep_ba = b.connect(a.address()).unwrap();
    let size = 200_000;
    let streams = [HostStream::new().unwrap(), HostStream::new().unwrap()];
    let conds = [Condition::host_stream(&streams[0]), Condition::host_stream(&streams[1])];
    let bufs: Vec<(Arc<Shared>, Arc<Shared>)> = (0..2).map(|_| (Shared::new(size), Shared::new(size))).collect();
    for iter in 0..20u8 {
        let mut reqs = Vec::new();
        for (side, (w, ep)) in [(&a, &ep_ab), (&b, &ep_ba)].into_iter().enumerate() {
            let (src, dst) = &bufs[side];
            let s2 = src.clone();
            streams[side].launch(move || s2.0.lock().unwrap().fill(iter ^ side as u8));
            let nw = RequestParams { condition: Some(conds[side].clone()), no_stream_wait: true, ..Default::default() };
            let nw2 = RequestParams { condition: Some(conds[side].clone()), no_stream_wait: true, ..Default::default() };
            reqs.push((w.clone(), unsafe { ep.tag_send_nbx(src.ptr(), size, 1, nw).unwrap() }));
            reqs.push((w.clone(), unsafe { w.tag_recv_nbx(dst.ptr(), size, 1, u64::MAX, nw2).unwrap() }));
            conds[side].wait().unwrap();
            let d2 = dst.clone();
            let want = iter ^ (1 - side) as u8;
            streams[side].launch(move || assert!(d2.0.lock().unwrap().iter().all(|&x| x == want), "iteration {iter}: stale halo"));
        }
        for (w, r) in reqs {
            assert_eq!(wait_req(&w, r), Status::Ok);
        }
        for s in &streams {
            s.synchronize(Some(Duration::from_secs(20))).unwrap();
        }
    }
}

#[test]
fn an_armed_receive_cannot_be_canceled_and_destroying_the_worker_releases_the_stream() {
    let (_a, b, _ep) = pair();
    let s = HostStream::new().unwrap();
    let c = Condition::host_stream(&s);
    let mut buf = [0u8; 8];
    let gate = Arc::new(AtomicBool::new(false));
    let g = gate.clone();
    s.launch(move || {
        while !g.load(Ordering::Acquire) {
            std::thread::yield_now();
        }
    });
    let Started::Pending(h) = (unsafe { b.tag_recv_nbx(buf.as_mut_ptr(), 8, 1, u64::MAX, on(&c)).unwrap() }) else { panic!() };
    assert_eq!(b.request_cancel(h).unwrap_err().status(), Status::Busy);
    // Dropping every handle of the worker stops its proxy; the receive, never matched, ends and
    // the stream's wait on it is released with an error rather than hanging.
    drop(b);
    drop(_a);
    drop(_ep);
    gate.store(true, Ordering::Release);
    let t0 = Instant::now();
    let err = s.synchronize(Some(Duration::from_secs(10))).unwrap_err();
    assert_eq!(err.status(), Status::Canceled, "{err}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert_eq!(c.query().unwrap_err().status(), Status::Canceled);
    // A failed condition takes no more operations, and says why.
    let (a2, _b2, ep2) = pair();
    let e = unsafe { ep2.tag_send_nbx(buf.as_ptr(), 8, 1, on(&c)).unwrap_err() };
    assert_eq!(e.status(), Status::Canceled, "{e}");
    drop(a2);
}

#[test]
fn a_send_that_fails_at_trigger_time_fails_its_request_and_condition() {
    let (a, b, ep) = pair();
    let s = HostStream::new().unwrap();
    let c = Condition::host_stream(&s);
    let gate = Arc::new(AtomicBool::new(false));
    let g = gate.clone();
    s.launch(move || {
        while !g.load(Ordering::Acquire) {
            std::thread::yield_now();
        }
    });
    let data = vec![1u8; 100_000];
    let st = unsafe { ep.tag_send_nbx(data.as_ptr(), data.len(), 1, on(&c)).unwrap() };
    // The endpoint goes away between arming and the trigger.
    let _ = ep.close_nbx(crate::core::CloseMode::Force, RequestParams::default()).unwrap();
    gate.store(true, Ordering::Release);
    assert_eq!(wait_req(&a, st), Status::NotConnected);
    assert!(s.synchronize(Some(Duration::from_secs(10))).is_err());
    assert!(c.query().is_err());
    drop(b);
}

#[test]
fn wait_is_for_sequenced_conditions_and_close_cannot_be_conditioned() {
    let (_a, _b, ep) = pair();
    let s = HostStream::new().unwrap();
    let c = Condition::host_stream(&s);
    c.wait().unwrap();
    s.synchronize(Some(Duration::from_secs(5))).unwrap();
    let e = ep.close_nbx(crate::core::CloseMode::Flush, on(&c)).unwrap_err();
    assert_eq!(e.status(), Status::Unsupported);
}

#[test]
fn a_group_starts_its_operations_together_at_its_end() {
    let (a, b, ep) = pair();
    let (sa, sb) = (HostStream::new().unwrap(), HostStream::new().unwrap());
    let (ca, cb) = (Condition::host_stream(&sa), Condition::host_stream(&sb));
    let src: Vec<Arc<Shared>> = (0..3u8).map(|i| Arc::new(Shared(Mutex::new(vec![i + 1; 1000])))).collect();
    let dst: Vec<Arc<Shared>> = (0..3).map(|_| Shared::new(1000)).collect();
    let recvs: Vec<Started> = (0..3).map(|i| unsafe { b.tag_recv_nbx(dst[i].ptr(), 1000, i as u64, u64::MAX, on(&cb)) }.unwrap()).collect();
    ca.group_start().unwrap();
    ca.group_start().unwrap(); // nested: only the outermost end flushes
    let sends: Vec<Started> = (0..3).map(|i| unsafe { ep.tag_send_nbx(src[i].ptr(), 1000, i as u64, on(&ca)) }.unwrap()).collect();
    ca.wait().unwrap();
    ca.group_end().unwrap();
    // Nothing is on the stream yet, so nothing can have been sent.
    std::thread::sleep(Duration::from_millis(50));
    let channel = ca.inner.channel.clone().unwrap();
    assert_eq!(channel.trigger(), channel.base, "a group's operations started before its end");
    ca.group_end().unwrap();
    sa.synchronize(Some(Duration::from_secs(20))).unwrap();
    assert_eq!(channel.trigger(), channel.base + 3, "one trigger write covers the group");
    for (s, r) in sends.into_iter().zip(recvs) {
        assert_eq!(wait_req(&a, s), Status::Ok);
        assert_eq!(wait_req(&b, r), Status::Ok);
    }
    for i in 0..3 {
        assert!(dst[i].0.lock().unwrap().iter().all(|&x| x == i as u8 + 1), "message {i} wrong");
    }
}

#[test]
fn group_misuse_is_an_error_that_changes_nothing() {
    let s = HostStream::new().unwrap();
    let c = Condition::host_stream(&s);
    let e = c.group_end().unwrap_err();
    assert_eq!(e.status(), Status::InvalidParam);
    assert!(e.to_string().contains("without group_start"), "{e}");
    // Still usable, and a group opened afterwards works.
    c.group_start().unwrap();
    c.group_end().unwrap();
    assert!(c.query().is_ok());
}

/// Issue #8, promise 1: a bug that panics inside the proxy thread must not leave what waits on
/// it waiting forever. A receive nothing will match waits on a host stream; the proxy's next
/// pass panics: the worker is aborted with the panic's message, the stream is released with
/// that error well before GSC_TIMEOUT, and later operations on the worker fail at once.
#[test]
fn a_panic_in_the_proxy_thread_releases_what_waits_on_it() {
    let (_a, b, _ep) = pair();
    let s = HostStream::new().unwrap();
    let c = Condition::host_stream(&s);
    let mut buf = [0u8; 8];
    let Started::Pending(h) = (unsafe { b.tag_recv_nbx(buf.as_mut_ptr(), 8, 1, u64::MAX, on(&c)).unwrap() }) else { panic!() };
    assert!(b.inject_proxy_panic(), "the conditioned receive started the worker's proxy");
    let t0 = Instant::now();
    let err = s.synchronize(Some(Duration::from_secs(10))).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(5), "released after {:?}", t0.elapsed());
    assert_eq!(err.status(), Status::Aborted, "{err}");
    let done = b.request_wait(h).unwrap();
    assert_eq!(done.status, Status::Aborted);
    b.request_release(h).unwrap();
    // The worker's sticky error names the panic.
    let e = unsafe { b.tag_recv_nbx(buf.as_mut_ptr(), 8, 2, u64::MAX, RequestParams::default()) }.map(|_| ()).unwrap_err();
    assert_eq!(e.status(), Status::Aborted, "{e}");
    assert!(e.to_string().contains("internal error in the proxy thread: a panic injected by a test"), "{e}");
}
