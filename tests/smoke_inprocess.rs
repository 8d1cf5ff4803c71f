//! Two workers of one process exchange tagged messages over each lane.
use gscomm::{Config, Context, RequestParams, Started};

fn ctx(tls: &str) -> Context {
    let mut c = Config::default();
    c.set("GSC_TLS", tls).unwrap();
    c.set("GSC_TIMEOUT", "20s").unwrap();
    Context::new(c).unwrap()
}

fn exchange(tls: &str) {
    let ctx = ctx(tls);
    let a = ctx.create_worker().unwrap();
    let b = ctx.create_worker().unwrap();
    let ep = a.connect(b.address()).unwrap();
    for size in [0usize, 1, 128, 129, 16383, 16384, 16385, 1 << 20, 64 << 20] {
        let data: Vec<u8> = (0..size).map(|i| (i * 7 + size) as u8).collect();
        let mut buf = vec![0u8; size];
        // One thread drives both workers: with the pipelined rendezvous the sender must answer
        // the receiver's RTR, so progressing only the receiver would never finish.
        let s = unsafe { ep.tag_send_nbx(data.as_ptr(), size, 5, RequestParams::default()).unwrap() };
        let r = unsafe { b.tag_recv_nbx(buf.as_mut_ptr(), size, 5, u64::MAX, RequestParams::default()).unwrap() };
        let pending = |w: &gscomm::Worker, s: &Started| match s {
            Started::Done(_) => false,
            Started::Armed(_) => panic!("no condition was given"),
            Started::Pending(h) => w.request_test(*h).unwrap().is_none(),
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while pending(&a, &s) || pending(&b, &r) {
            assert!(std::time::Instant::now() < deadline, "{tls} size {size}: no completion in 20 s");
            a.progress();
            b.progress();
        }
        for (w, st) in [(&a, s), (&b, r)] {
            if let Started::Pending(h) = st {
                let c = w.request_test(h).unwrap().unwrap();
                assert_eq!(c.status, gscomm::Status::Ok, "{tls} size {size}");
                w.request_release(h).unwrap();
            }
        }
        assert!(buf == data, "{tls} size {size} data mismatch");
    }
    ep.close().unwrap();
}

#[test]
fn loopback_lane() {
    exchange("loopback");
}

#[test]
fn shm_lane_within_one_process() {
    exchange("shm");
}

/// A flush-close whose Close frame meets a link the peer already closed still completes (it
/// used to stay pending forever: the frame, and with it the request, was dropped with the link).
#[test]
fn close_completes_when_the_peer_is_gone() {
    let ctx = ctx("shm");
    let a = ctx.create_worker().unwrap();
    let b = ctx.create_worker().unwrap();
    let ep = a.connect(b.address()).unwrap();
    ep.tag_send(b"x", 1).unwrap();
    drop(b);
    ep.close().unwrap();
}
