//! Review: a rendezvous receive must not read the sender's buffer after the send completed.
use gscomm::{CloseMode, Config, Context, RequestParams, Started, Status};

#[test]
fn loopback_rndv_get_does_not_read_a_canceled_senders_buffer() {
    canceled_sender(&[("GSC_TLS", "loopback")]);
}

/// Same over shm with cross-memory attach (two workers of one process, loopback disabled): the
/// reader checks the sender's closed flag after the copy.
#[test]
fn shm_cma_get_does_not_deliver_a_canceled_senders_buffer() {
    let dir = std::env::temp_dir().join(format!("gsc-review-uaf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    canceled_sender(&[("GSC_TLS", "shm"), ("GSC_RNDV_SCHEME", "get"), ("GSC_CMA", "on"), ("GSC_SHM_DIR", dir.to_str().unwrap())]);
    let _ = std::fs::remove_dir_all(&dir);
}

fn canceled_sender(knobs: &[(&str, &str)]) {
    let mut c = Config::default();
    for (k, v) in knobs {
        c.set(k, v).unwrap();
    }
    c.set("GSC_TIMEOUT", "5s").unwrap();
    let ctx = Context::new(c).unwrap();
    let a = ctx.create_worker().unwrap();
    let b = ctx.create_worker().unwrap();
    let ep = a.connect(b.address()).unwrap();
    let size = 1 << 20;
    let mut data = vec![0xAAu8; size];
    let s = unsafe { ep.tag_send_nbx(data.as_ptr(), size, 9, RequestParams::default()).unwrap() };
    // The receiver sees the RTS and holds it as unexpected.
    for _ in 0..64 {
        b.progress();
    }
    // The sender gives up: force close; the send completes (Canceled), the buffer is the user's.
    let cl = ep.close_nbx(CloseMode::Force, RequestParams::default()).unwrap();
    assert!(matches!(cl, Started::Done(_)));
    if let Started::Pending(h) = s {
        let done = a.request_test(h).unwrap().expect("send completed by the force close");
        assert_ne!(done.status, Status::Ok);
        a.request_release(h).unwrap();
    }
    // The user reuses the buffer (stand-in for freeing it).
    data.iter_mut().for_each(|x| *x = 0x55);
    let mut buf = vec![0u8; size];
    let r = unsafe { b.tag_recv_nbx(buf.as_mut_ptr(), size, 9, u64::MAX, RequestParams::default()).unwrap() };
    let status = match r {
        Started::Done(_) => Status::Ok,
        Started::Armed(_) => panic!("no condition was given"),
        Started::Pending(h) => {
            for _ in 0..64 {
                b.progress();
            }
            b.request_test(h).unwrap().map(|c| c.status).unwrap_or(Status::InProgress)
        }
    };
    assert!(!(status == Status::Ok && buf[0] == 0x55), "receive read the sender's buffer after the send had completed (status {status:?})");
    drop(data);
}
