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
        let s = unsafe { ep.tag_send_nbx(data.as_ptr(), size, 5, RequestParams::default()).unwrap() };
        let c = b.tag_recv(&mut buf, 5, u64::MAX).unwrap();
        assert_eq!(c.status, gscomm::Status::Ok, "{tls} size {size}");
        assert_eq!(c.info.length, size);
        if let Started::Pending(h) = s {
            a.request_wait(h).unwrap();
            a.request_release(h).unwrap();
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
