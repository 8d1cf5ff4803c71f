//! The UCX lane's links between UCP workers of this process: order, size limits, back-pressure,
//! close, rejection. (Between processes and network namespaces: tests/mp_ucx.rs.)
//!
//! Each test skips with a printed reason where libucp is not installed (CI has it).

use std::time::{Duration, Instant};

use super::address::UcxAddress;
use super::*;
use crate::error::Status;
use crate::transport::{Link, Listener};

const T: Duration = Duration::from_secs(20);

fn lane_with(cfg: &UcxConfig, uuid: u128) -> Option<UcxLane> {
    match UcxLane::new(cfg, uuid) {
        Ok(l) => Some(l),
        Err(e) if e.status() == Status::LibraryMissing => {
            eprintln!("skipped: {e}");
            None
        }
        Err(e) => panic!("UCX lane: {e:?}"),
    }
}

fn pair(cfg: &UcxConfig) -> Option<(UcxLane, UcxLane)> {
    Some((lane_with(cfg, 0xa)?, lane_with(cfg, 0xb)?))
}

/// Accept on `l` until a link arrives, progressing the connecting side (`peer`, whose UCP worker
/// must move for the connection to be wired up).
fn accept(l: &mut UcxListener, peer: &mut dyn Link) -> (u128, Box<dyn Link>) {
    let deadline = Instant::now() + T;
    loop {
        if let Some(x) = l.accept().expect("accept") {
            return x;
        }
        peer.poll_recv(0, &mut |_| {}).expect("connecting side's poll");
        assert!(Instant::now() < deadline, "no connection accepted within {T:?}");
    }
}

/// Poll `link` until `n` frames arrived (progressing `also`, the other side, meanwhile).
fn recv_n(link: &mut dyn Link, n: usize, also: &mut dyn Link) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    let deadline = Instant::now() + T;
    while got.len() < n {
        link.poll_recv(n - got.len(), &mut |f| got.push(f.to_vec())).expect("poll_recv");
        also.poll_recv(0, &mut |_| {}).expect("other side's poll");
        assert!(Instant::now() < deadline, "{} of {n} frames arrived within {T:?}", got.len());
    }
    got
}

/// Poll until the link reports its end; returns the error.
fn recv_end(link: &mut dyn Link) -> crate::error::Error {
    let deadline = Instant::now() + T;
    loop {
        match link.poll_recv(16, &mut |f| panic!("unexpected frame of {} bytes", f.len())) {
            Ok(_) => assert!(Instant::now() < deadline, "the link did not end within {T:?}"),
            Err(e) => return e,
        }
    }
}

fn frame(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i * 31 + j * 7) as u8).collect()
}

#[test]
fn frames_cross_whole_and_in_order_both_ways() {
    let cfg = UcxConfig::default();
    let Some((a, b)) = pair(&cfg) else { return };
    let mut listener = b.listener();
    let mut ab = a.connect(&listener.address_blob()).unwrap();
    assert_eq!(ab.lane(), crate::transport::LaneKind::Ucx);
    assert!(ab.caps().remote_memory, "remote memory by key");
    // Sent before the peer accepted: they wait behind the hello.
    let sizes = [0, 1, 8, 4096, 65_537, cfg.max_frame];
    for (i, &n) in sizes.iter().enumerate() {
        assert!(ab.try_send(&[&frame(i, n)[..n / 2], &frame(i, n)[n / 2..]]).unwrap());
    }
    let (peer, mut ba) = accept(&mut listener, ab.as_mut());
    assert_eq!(peer, 0xa);
    let got = recv_n(ba.as_mut(), sizes.len(), ab.as_mut());
    for (i, &n) in sizes.iter().enumerate() {
        assert_eq!(got[i], frame(i, n), "frame {i} of {n} bytes");
    }
    for i in 0..50 {
        while !ba.try_send(&[&frame(i, 1000 + i)]).unwrap() {
            ab.poll_recv(0, &mut |_| {}).unwrap();
        }
    }
    let back = recv_n(ab.as_mut(), 50, ba.as_mut());
    assert!(back.iter().enumerate().all(|(i, f)| *f == frame(i, 1000 + i)));
    let e = ab.try_send(&[&vec![0; cfg.max_frame + 1]]).unwrap_err();
    assert_eq!(e.status(), Status::InvalidParam);
    ab.check_peer().unwrap();
    ba.check_peer().unwrap();
    // SAFETY: never dereferenced: the lane refuses before touching memory.
    let e = unsafe { ab.read_remote(std::ptr::null_mut(), 0, 1) }.unwrap_err();
    assert_eq!(e.status(), Status::Unsupported);
}

/// Frames from `rndv_min` up go by UCX's rendezvous and are fetched by `progress` after the
/// handler announced them; eager frames sent after them must still come out behind them, and
/// many of both in flight at once must all arrive intact.
#[test]
fn rendezvous_frames_keep_their_place_among_eager_ones() {
    let cfg = UcxConfig { rndv_min: 16 << 10, max_frame: 512 << 10, ..UcxConfig::default() };
    let Some((a, b)) = pair(&cfg) else { return };
    let mut listener = b.listener();
    let mut ab = a.connect(&listener.address_blob()).unwrap();
    let (_, mut ba) = accept(&mut listener, ab.as_mut());
    // Alternating rendezvous and eager sizes, more than a link keeps in flight at once.
    let sizes: Vec<usize> = (0..64).map(|i| if i % 3 == 0 { 100 + i } else { (16 << 10) + i * 7919 }).collect();
    let mut sent = 0;
    let mut got = Vec::new();
    let deadline = Instant::now() + T;
    while got.len() < sizes.len() {
        while sent < sizes.len() && ab.try_send(&[&frame(sent, sizes[sent])]).unwrap() {
            sent += 1;
        }
        ba.poll_recv(16, &mut |f| got.push(f.to_vec())).unwrap();
        ab.poll_recv(0, &mut |_| {}).unwrap();
        assert!(Instant::now() < deadline, "{} of {} frames arrived within {T:?}", got.len(), sizes.len());
    }
    for (i, &n) in sizes.iter().enumerate() {
        assert_eq!(got[i].len(), n, "frame {i}");
        assert!(got[i] == frame(i, n), "frame {i} of {n} bytes differs");
    }
    // The sender's sends all complete (the receiver fetched every rendezvous frame).
    let deadline = Instant::now() + T;
    while !ab.try_send(&[&[0u8; 1]]).unwrap() {
        ba.poll_recv(16, &mut |_| {}).unwrap();
        ab.poll_recv(0, &mut |_| {}).unwrap();
        assert!(Instant::now() < deadline, "the sender stayed full");
    }
}

#[test]
fn a_worker_connects_to_itself() {
    let Some(a) = lane_with(&UcxConfig::default(), 0xc) else { return };
    let mut listener = a.listener();
    let mut out = a.connect(&listener.address_blob()).unwrap();
    out.try_send(&[b"to me"]).unwrap();
    let (peer, mut inc) = accept(&mut listener, out.as_mut());
    assert_eq!(peer, 0xc);
    assert_eq!(recv_n(inc.as_mut(), 1, out.as_mut()), vec![b"to me".to_vec()]);
    inc.try_send(&[b"and back"]).unwrap();
    assert_eq!(recv_n(out.as_mut(), 1, inc.as_mut()), vec![b"and back".to_vec()]);
}

#[test]
fn a_full_link_says_so_and_loses_nothing() {
    // A small budget, and a receiver that does not progress: UCX's own queues fill, sends stay
    // in flight, and `try_send` must refuse rather than queue without bound.
    let cfg = UcxConfig { max_in_flight: 256 << 10, ..UcxConfig::default() };
    let Some((a, b)) = pair(&cfg) else { return };
    let mut listener = b.listener();
    let mut ab = a.connect(&listener.address_blob()).unwrap();
    let (_, mut ba) = accept(&mut listener, ab.as_mut());
    let len = 64 << 10;
    let mut sent = 0;
    // 1 GiB is far more than any transport buffers for a peer that does not progress.
    while sent < (1 << 30) / len {
        if !ab.try_send(&[&frame(sent, len)]).unwrap() {
            break;
        }
        sent += 1;
        ab.poll_recv(0, &mut |_| {}).unwrap();
    }
    assert!(sent < (1 << 30) / len, "try_send never reported a full link");
    let got = recv_n(ba.as_mut(), sent, ab.as_mut());
    assert!(got.iter().enumerate().all(|(i, f)| *f == frame(i, len)), "frames lost or reordered");
    assert!(ab.try_send(&[b"room again"]).unwrap());
    assert_eq!(recv_n(ba.as_mut(), 1, ab.as_mut()), vec![b"room again".to_vec()]);
}

#[test]
fn close_and_drop_reach_the_peer_after_the_frames_before_them() {
    let Some((a, b)) = pair(&UcxConfig::default()) else { return };
    let mut listener = b.listener();
    let mut ab = a.connect(&listener.address_blob()).unwrap();
    for i in 0..3 {
        ab.try_send(&[&frame(i, 100)]).unwrap();
    }
    ab.close();
    assert_eq!(ab.try_send(&[b"x"]).unwrap_err().status(), Status::NotConnected);
    let (_, mut ba) = accept(&mut listener, ab.as_mut());
    assert_eq!(recv_n(ba.as_mut(), 3, ab.as_mut()).len(), 3);
    let e = recv_end(ba.as_mut());
    assert_eq!(e.status(), Status::ConnectionReset, "{e:?}");

    // Dropped without close: the peer hears of it all the same.
    let mut ab = a.connect(&listener.address_blob()).unwrap();
    ab.try_send(&[b"last"]).unwrap();
    let (_, mut ba) = accept(&mut listener, ab.as_mut());
    assert_eq!(recv_n(ba.as_mut(), 1, ab.as_mut()), vec![b"last".to_vec()]);
    drop(ab);
    let e = recv_end(ba.as_mut());
    assert_eq!(e.status(), Status::ConnectionReset, "{e:?}");
    assert!(ba.check_peer().is_err(), "the end is sticky");
}

#[test]
fn an_address_of_another_worker_is_rejected() {
    let Some((a, b)) = pair(&UcxConfig::default()) else { return };
    let mut listener = b.listener();
    // b's UCP address with another worker's uuid: what a stale address of a restarted worker
    // looks like.
    let mut stale = UcxAddress::decode(&listener.address_blob()).unwrap();
    stale.uuid = 0xdead;
    let mut ab = a.connect(&stale.encode().unwrap()).unwrap();
    let deadline = Instant::now() + T;
    let e = loop {
        match listener.accept() {
            Ok(None) => {}
            Ok(Some(_)) => panic!("accepted a connection meant for another worker"),
            Err(e) => break e,
        }
        ab.poll_recv(0, &mut |_| {}).unwrap();
        assert!(Instant::now() < deadline, "no refusal within {T:?}");
    };
    assert_eq!(e.status(), Status::Rejected, "{e:?}");
    let e = recv_end(ab.as_mut());
    assert_eq!(e.status(), Status::Rejected, "{e:?}");
    assert!(e.message().contains("not"), "{e:?}");
}

#[test]
fn malformed_addresses_are_named_errors() {
    let Some(a) = lane_with(&UcxConfig::default(), 0xe) else { return };
    let e = a.connect(b"GSHM not a ucx address at all, no").err().expect("refused");
    assert_eq!(e.status(), Status::InvalidAddress, "{e:?}");
}

/// Progress `link` on another thread until `stop`, then hand it back: the target of a get over
/// TCP serves it from its own progress.
fn progress_until(link: Box<dyn Link>, stop: &std::sync::atomic::AtomicBool) -> Box<dyn Link> {
    let mut link = link;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let _ = link.poll_recv(0, &mut |_| {});
        std::thread::yield_now();
    }
    link
}

#[test]
fn remote_read_by_key_into_the_buffer_and_bounded_by_the_key() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let cfg = UcxConfig::default();
    let Some((a, b)) = pair(&cfg) else { return };
    let mut listener = b.listener();
    let ab = a.connect(&listener.address_blob()).unwrap();
    let mut ab = ab;
    let (_, ba) = accept(&mut listener, &mut *ab);
    let src = frame(3, 3 << 20);
    let exposed = ba.expose(src.as_ptr() as usize, src.len()).unwrap().expect("UCX needs a key");
    let key = exposed.key.clone();
    // A second exposure of the same range (or part of it) while the first lives shares it.
    let again = ba.expose(src.as_ptr() as usize + 10, 100).unwrap().unwrap();
    assert_eq!(again.key, key, "a covering registration is reused");
    let before = rma_stats();
    let stop = AtomicBool::new(false);
    let mut dst = vec![0u8; src.len() - 100];
    std::thread::scope(|s| {
        let peer = s.spawn(|| progress_until(ba, &stop));
        // SAFETY: `dst` is writable for its length and outlives the call.
        let r = unsafe { ab.read_remote_keyed(dst.as_mut_ptr(), src.as_ptr() as u64 + 100, dst.len(), &key) };
        r.expect("remote read");
        assert!(dst == src[100..], "the read brought the peer's bytes");
        // One byte past the range the peer opened: refused before UCX sees it.
        // SAFETY: as above (nothing is written on refusal).
        let e = unsafe { ab.read_remote_keyed(dst.as_mut_ptr(), src.as_ptr() as u64 + 101, dst.len(), &key) }.unwrap_err();
        assert_eq!(e.status(), Status::OutOfRange);
        let mut bad = key.clone();
        bad[0] ^= 1;
        // SAFETY: as above.
        let e = unsafe { ab.read_remote_keyed(dst.as_mut_ptr(), src.as_ptr() as u64, 1, &bad) }.unwrap_err();
        assert_eq!(e.status(), Status::InvalidParam);
        // Without a key a UCX link cannot read.
        // SAFETY: as above.
        assert!(unsafe { ab.read_remote(dst.as_mut_ptr(), src.as_ptr() as u64, 1) }.is_err());
        stop.store(true, Ordering::Relaxed);
        drop(peer.join().unwrap());
    });
    let after = rma_stats();
    assert!(after.gets > before.gets && after.get_bytes >= before.get_bytes + dst.len() as u64, "{before:?} -> {after:?}");
    drop((exposed, again));
}

#[test]
fn remote_read_from_a_peer_that_never_progresses_ends_at_the_deadline() {
    let cfg = UcxConfig { rma_timeout: Duration::from_millis(300), ..UcxConfig::default() };
    let Some((a, b)) = pair(&cfg) else { return };
    let mut listener = b.listener();
    let mut ab = a.connect(&listener.address_blob()).unwrap();
    let (_, ba) = accept(&mut listener, &mut *ab);
    let src = frame(5, 8 << 20);
    let exposed = ba.expose(src.as_ptr() as usize, src.len()).unwrap().unwrap();
    let mut dst = vec![0u8; src.len()];
    let t0 = Instant::now();
    // `ba`'s worker is not progressed by anyone.
    // SAFETY: `dst` is writable for its length and outlives the call.
    let r = unsafe { ab.read_remote_keyed(dst.as_mut_ptr(), src.as_ptr() as u64, dst.len(), &exposed.key) };
    match r {
        Ok(()) => eprintln!("note: the transport served the get without the peer's progress; deadline not exercised"),
        Err(e) => {
            assert_eq!(e.status(), Status::TimedOut, "{e}");
            assert!(t0.elapsed() < Duration::from_secs(5), "ended after {:?}", t0.elapsed());
            // The link is failed from then on, and dropping it does not touch the closed endpoint.
            assert!(ab.try_send(&[b"x"]).is_err());
            assert!(ab.check_peer().is_err());
        }
    }
    drop(ab);
    drop((exposed, ba));
}
