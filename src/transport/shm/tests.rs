//! Tests of the shm lane through its public contract (`Listener`, `Link`), in one process and
//! across processes. Multi-process tests re-run themselves as the child (see `testutil`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::testutil::{self, ChildProc, TestDir, hex, tell_parent, unhex};
use super::*;
use crate::transport::{LaneKind, Link, Listener};

const LISTENER_UUID: u128 = 0x1111_2222_3333_4444_5555_6666_7777_8888;
const CONNECTOR_UUID: u128 = 0x9999_aaaa_bbbb_cccc_dddd_eeee_ffff_0001;

fn small_cfg(dir: &TestDir) -> ShmConfig {
    ShmConfig {
        dir: dir.path().to_path_buf(),
        ring_size: 4096,
        max_frame: 1024,
        connect_timeout: Duration::from_millis(100),
        ..ShmConfig::default()
    }
}

/// Accept one link, spinning up to the test time limit.
fn accept_one(l: &mut ShmListener) -> (u128, Box<dyn Link>) {
    let deadline = Instant::now() + testutil::TIME_LIMIT;
    loop {
        if let Some(x) = l.accept().unwrap() {
            return x;
        }
        assert!(Instant::now() < deadline, "no connection request arrived");
        std::thread::yield_now();
    }
}

/// Receive one frame, spinning up to the test time limit; a link error fails the test.
fn recv_one(link: &mut dyn Link) -> Vec<u8> {
    let mut got = None;
    testutil::spin_until("a frame", || link.poll_recv(1, &mut |f| got = Some(f.to_vec())).unwrap() == 1);
    got.unwrap()
}

fn recv_all(link: &mut dyn Link) -> Vec<Vec<u8>> {
    let mut v = Vec::new();
    while link.poll_recv(usize::MAX, &mut |f| v.push(f.to_vec())).unwrap() > 0 {}
    v
}

#[test]
fn links_in_one_process_move_frames_both_ways() {
    let dir = TestDir::new("inproc");
    let cfg = small_cfg(&dir);
    let mut l = ShmListener::new(&cfg, LISTENER_UUID).unwrap();
    assert_eq!(l.lane(), LaneKind::Shm);
    assert!(l.accept().unwrap().is_none());

    let mut a = connect(&l.address_blob(), CONNECTOR_UUID, &cfg).unwrap();
    assert_eq!(a.lane(), LaneKind::Shm);
    assert_eq!(a.max_frame(), 1024);
    assert!(a.caps().remote_memory, "CMA to self works (Auto)");
    // Queued before the listener accepts.
    assert!(a.try_send(&[b"early"]).unwrap());
    a.check_peer().unwrap();

    let (uuid, mut b) = accept_one(&mut l);
    assert_eq!(uuid, CONNECTOR_UUID);
    assert!(l.accept().unwrap().is_none(), "one request, one link");
    assert_eq!(b.max_frame(), 1024);
    // Both sides have the connection mapped: only the worker segment is left by name.
    assert_eq!(dir.entries().len(), 1);

    assert_eq!(recv_one(b.as_mut()), b"early");
    for i in 0..100u32 {
        assert!(a.try_send(&[&i.to_le_bytes(), b"-a"]).unwrap());
        assert!(b.try_send(&[&i.to_le_bytes()[..], b"-b"]).unwrap());
        if i % 3 == 2 {
            let got = recv_all(b.as_mut());
            assert_eq!(got.len(), 3);
            for (k, f) in got.iter().enumerate() {
                let mut want = (i - 2 + k as u32).to_le_bytes().to_vec();
                want.extend_from_slice(b"-a");
                assert_eq!(f, &want);
            }
        }
    }
    recv_all(b.as_mut());
    let back = recv_all(a.as_mut());
    assert_eq!(back.len(), 100);
    for (i, f) in back.iter().enumerate() {
        assert_eq!(&f[..4], &(i as u32).to_le_bytes());
        assert_eq!(&f[4..], b"-b");
    }

    // max_frame: exact fits, one more is an error (not "full").
    let big = vec![7u8; 1024];
    assert!(a.try_send(&[&big]).unwrap());
    let e = a.try_send(&[&big, b"x"]).unwrap_err();
    assert_eq!(e.status(), Status::InvalidParam, "{e:?}");
    assert_eq!(recv_one(b.as_mut()), big);
    // A zero-length frame is a frame.
    assert!(a.try_send(&[]).unwrap());
    assert_eq!(recv_one(b.as_mut()), Vec::<u8>::new());

    // Fill the ring: Ok(false), then room again after the peer drains.
    let chunk = vec![1u8; 1000];
    let mut queued = 0;
    while a.try_send(&[&chunk]).unwrap() {
        queued += 1;
        assert!(queued < 10, "a 4 KiB ring holds at most 4 such frames");
    }
    // 4 x 1008 bytes fit in 4096; one fewer when the wrap falls inside the run of frames.
    assert!((3..=4).contains(&queued), "{queued} frames fit");
    assert!(!a.try_send(&[&chunk]).unwrap(), "still full");
    let mut drained = 0;
    while b.poll_recv(1, &mut |f| assert_eq!(f, &chunk[..])).unwrap() == 1 {
        drained += 1;
    }
    assert_eq!(drained, queued);
    assert!(a.try_send(&[&chunk]).unwrap(), "room again once drained");
    assert_eq!(recv_all(b.as_mut()).len(), 1);
    assert_eq!(b.poll_recv(8, &mut |_| panic!("empty")).unwrap(), 0);

    // Close: frames already sent are still delivered, then the peer sees the reset.
    assert!(a.try_send(&[b"last"]).unwrap());
    a.close();
    assert_eq!(a.try_send(&[b"more"]).unwrap_err().status(), Status::NotConnected);
    // Not before "last" is read: a reset reported first would drop it (the worker fails the
    // connection on check_peer's error).
    b.check_peer().expect("a frame is still in the ring: the close is not news yet");
    assert_eq!(recv_one(b.as_mut()), b"last");
    assert_eq!(b.check_peer().unwrap_err().status(), Status::ConnectionReset);
    let e = b.poll_recv(8, &mut |_| panic!("nothing left")).unwrap_err();
    assert_eq!(e.status(), Status::ConnectionReset, "{e:?}");
    assert!(e.message().contains(&std::process::id().to_string()), "{e:?}");
    assert_eq!(b.try_send(&[b"x"]).unwrap_err().status(), Status::ConnectionReset);
    a.check_peer().unwrap(); // b has not closed
    drop(b);
    assert_eq!(a.check_peer().unwrap_err().status(), Status::ConnectionReset, "drop closes");

    drop(a);
    drop(l);
    assert!(dir.entries().is_empty(), "left behind: {:?}", dir.entries());
}

#[test]
fn malformed_and_foreign_addresses_are_rejected() {
    let dir = TestDir::new("badaddr");
    let cfg = small_cfg(&dir);
    let l = ShmListener::new(&cfg, LISTENER_UUID).unwrap();
    let blob = l.address_blob();
    let status = |b: &[u8]| connect(b, CONNECTOR_UUID, &cfg).err().map(|e| e.status());

    assert_eq!(status(&[]), Some(Status::InvalidAddress));
    assert_eq!(status(&blob[..blob.len() - 1]), Some(Status::InvalidAddress));
    assert_eq!(status(b"this is not an address at all, but long enough to have a header.........."), Some(Status::InvalidAddress));
    let mut other_host = blob.clone();
    other_host[8] ^= 1;
    assert_eq!(status(&other_host), Some(Status::Unreachable));
    let mut other_uuid = blob.clone();
    other_uuid[40] ^= 1;
    assert_eq!(status(&other_uuid), Some(Status::InvalidAddress));
    let mut other_start = blob.clone();
    other_start[32] ^= 1; // same pid, different start time: a different (dead) process
    assert_eq!(status(&other_start), Some(Status::PeerFailed));

    // A wrong CMA cookie: Auto falls back to frames only, On refuses.
    let mut bad_cookie = blob.clone();
    bad_cookie[64] ^= 1;
    let link = connect(&bad_cookie, CONNECTOR_UUID, &cfg).unwrap();
    assert!(!link.caps().remote_memory);
    let mut x = 0u8;
    // SAFETY: `x` is valid for 1 byte; the call must refuse before touching anything.
    let e = unsafe { link.read_remote(&mut x, &raw const x as u64, 1) }.unwrap_err();
    assert_eq!(e.status(), Status::Unsupported);
    drop(link);
    let on = ShmConfig { cma: CmaMode::On, ..cfg.clone() };
    assert_eq!(connect(&bad_cookie, CONNECTOR_UUID, &on).err().map(|e| e.status()), Some(Status::Unsupported));
    let off = ShmConfig { cma: CmaMode::Off, ..cfg.clone() };
    assert!(!connect(&blob, CONNECTOR_UUID, &off).unwrap().caps().remote_memory);

    let bad_geometry = ShmConfig { ring_size: 3000, ..cfg.clone() };
    assert_eq!(connect(&blob, CONNECTOR_UUID, &bad_geometry).err().map(|e| e.status()), Some(Status::InvalidConfig));

    // The listener is gone but this process (its pid) lives: the segment is unreachable.
    drop(l);
    assert_eq!(status(&blob), Some(Status::Unreachable));
    assert!(dir.entries().is_empty(), "left behind: {:?}", dir.entries());
}

#[test]
fn busy_slots_time_out_and_dropped_listener_refuses_pending() {
    let dir = TestDir::new("slots");
    let cfg = small_cfg(&dir);
    let mut l = ShmListener::new(&cfg, LISTENER_UUID).unwrap();
    let blob = l.address_blob();
    let mut pending: Vec<_> = (0..64).map(|i| connect(&blob, i, &cfg).unwrap()).collect();
    let t = Instant::now();
    let e = connect(&blob, 64, &cfg).err().unwrap();
    assert_eq!(e.status(), Status::TimedOut, "{e:?}");
    assert!(t.elapsed() >= cfg.connect_timeout);
    assert!(e.message().contains("accept slots"), "{e:?}");

    // Accept half; the rest are refused when the listener goes away.
    let mut accepted = Vec::new();
    for _ in 0..32 {
        accepted.push(accept_one(&mut l));
    }
    let mut uuids: Vec<u128> = accepted.iter().map(|(u, _)| *u).collect();
    uuids.sort();
    assert_eq!(uuids.len(), 32);
    uuids.dedup();
    assert_eq!(uuids.len(), 32, "each request accepted once");
    drop(l);
    let mut reset = 0;
    for link in &mut pending {
        match link.check_peer() {
            Ok(()) => {}
            Err(e) => {
                assert_eq!(e.status(), Status::ConnectionReset, "{e:?}");
                reset += 1;
            }
        }
    }
    assert_eq!(reset, 32, "exactly the requests never accepted are refused");
    let e = connect(&blob, 99, &cfg).err().unwrap();
    assert_eq!(e.status(), Status::Unreachable, "{e:?}");
    drop(pending);
    drop(accepted);
    assert!(dir.entries().is_empty(), "left behind: {:?}", dir.entries());
}

/// The heartbeat judgment on one pair of links: a side that promises nothing is never failed
/// by its silence; one that promised is failed (TimedOut, naming the silence) once its count
/// stays put past the limit, and not while it beats; a judge's own pause does not count against
/// a peer that beat meanwhile; the limit is never less than four promised periods.
#[test]
fn heartbeat_fails_only_a_silent_peer_that_promised_one() {
    let dir = TestDir::new("heartbeat");
    let timeout = Duration::from_millis(150);
    let cfg = ShmConfig { heartbeat_timeout: Some(timeout), ..small_cfg(&dir) };
    let mut l = ShmListener::new(&cfg, LISTENER_UUID).unwrap();
    let mut a = connect(&l.address_blob(), CONNECTOR_UUID, &cfg).unwrap();
    let (_, mut b) = accept_one(&mut l);

    // No promise: `b` beats now and then but promised nothing; `a` never fails it.
    b.heartbeat(None);
    let t0 = Instant::now();
    while t0.elapsed() < 3 * timeout {
        a.check_peer().unwrap();
        std::thread::sleep(Duration::from_millis(10));
    }

    // A promise kept: beats every 20 ms, checked for several timeouts.
    let period = Duration::from_millis(20);
    b.heartbeat(Some(period));
    let t0 = Instant::now();
    while t0.elapsed() < 3 * timeout {
        b.heartbeat(Some(period));
        a.check_peer().unwrap();
        std::thread::sleep(Duration::from_millis(10));
    }

    // The judge pauses longer than the limit while the peer beats: not a silence.
    a.check_peer().unwrap();
    std::thread::sleep(2 * timeout);
    // The promise broken after this last beat: failed after the limit, not before, and sticky.
    // (Taken before the check that sees the beat: the judge's watch starts at that check.)
    let silent_from = Instant::now();
    b.heartbeat(Some(period));
    a.check_peer().unwrap();
    let e = loop {
        match a.check_peer() {
            Ok(()) => {
                assert!(silent_from.elapsed() < timeout + Duration::from_secs(5), "a silent peer was never failed");
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => break e,
        }
    };
    assert!(silent_from.elapsed() >= timeout, "failed after {:?}, the limit is {timeout:?}", silent_from.elapsed());
    assert_eq!(e.status(), Status::TimedOut, "{e}");
    assert!(e.message().contains("heartbeat") && e.message().contains(&std::process::id().to_string()), "{e}");
    assert_eq!(a.check_peer().unwrap_err().status(), Status::TimedOut, "sticky");
    assert_eq!(a.try_send(&[b"x"]).unwrap_err().status(), Status::TimedOut, "the link is dead");

    // A peer that promised a slow beat (1 s) is given four of its periods, not our 150 ms.
    let mut c = connect(&l.address_blob(), CONNECTOR_UUID, &cfg).unwrap();
    let (_, mut d) = accept_one(&mut l);
    d.heartbeat(Some(Duration::from_secs(1)));
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(600) {
        c.check_peer().unwrap();
        std::thread::sleep(Duration::from_millis(20));
    }
    // And the judge that judges nothing (timeout None) never fails anyone.
    let quiet = ShmConfig { heartbeat_timeout: None, ..small_cfg(&dir) };
    let mut e1 = connect(&l.address_blob(), CONNECTOR_UUID, &quiet).unwrap();
    let (_, mut f1) = accept_one(&mut l);
    f1.heartbeat(Some(Duration::from_millis(10)));
    std::thread::sleep(Duration::from_millis(50));
    e1.check_peer().unwrap();
    std::thread::sleep(3 * timeout);
    e1.check_peer().unwrap();
}

/// Connect from a child process given the listener blob and directory in the environment.
fn child_connect(ring_size: usize) -> Box<dyn Link> {
    let cfg = ShmConfig {
        dir: PathBuf::from(testutil::env("SHM_DIR")),
        ring_size,
        max_frame: ring_size / 4,
        cma: CmaMode::On,
        connect_timeout: testutil::TIME_LIMIT,
        heartbeat_timeout: None,
    };
    connect(&unhex(&testutil::env("SHM_BLOB")), CONNECTOR_UUID, &cfg).unwrap()
}

fn spawn_child(test: &str, l: &ShmListener, dir: &TestDir) -> ChildProc {
    ChildProc::spawn(test, "connector", &[("SHM_BLOB", hex(&l.address_blob())), ("SHM_DIR", dir.path().to_string_lossy().into_owned())])
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// The parent reads and writes a buffer of the child through the link's CMA.
#[test]
fn cma_between_processes() {
    const NAME: &str = "transport::shm::tests::cma_between_processes";
    const LEN: usize = (3 << 20) + 13;
    if testutil::role().is_some() {
        let mut link = child_connect(1 << 16);
        assert!(link.caps().remote_memory);
        let buf = pattern(1, LEN);
        let addr = buf.as_ptr() as u64;
        assert!(link.try_send(&[&addr.to_le_bytes(), &(LEN as u64).to_le_bytes()]).unwrap());
        assert_eq!(recv_one(link.as_mut()), b"written");
        // SAFETY: the parent wrote `buf` through process_vm_writev while we waited; read it
        // through a volatile copy so the compiler does not assume its old contents.
        let now: Vec<u8> = (0..LEN).map(|i| unsafe { buf.as_ptr().add(i).read_volatile() }).collect();
        assert!(now == pattern(2, LEN), "parent's write arrived");
        assert!(link.try_send(&[b"ok"]).unwrap());
        return;
    }
    let dir = TestDir::new("cma");
    let cfg = ShmConfig { cma: CmaMode::On, ..small_cfg(&dir) };
    let mut l = ShmListener::new(&cfg, LISTENER_UUID).unwrap();
    let mut child = spawn_child(NAME, &l, &dir);
    let (uuid, mut link) = accept_one(&mut l);
    assert_eq!(uuid, CONNECTOR_UUID);
    assert!(link.caps().remote_memory);
    let msg = recv_one(link.as_mut());
    let addr = u64::from_le_bytes(msg[..8].try_into().unwrap());
    assert_eq!(u64::from_le_bytes(msg[8..16].try_into().unwrap()), LEN as u64);

    let mut local = vec![0u8; LEN];
    // SAFETY: `local` is valid for LEN bytes.
    unsafe { link.read_remote(local.as_mut_ptr(), addr, LEN) }.unwrap();
    assert!(local == pattern(1, LEN), "read the child's buffer");
    let new = pattern(2, LEN);
    // SAFETY: `new` is valid for LEN bytes of reads.
    unsafe { link.write_remote(new.as_ptr(), addr, LEN) }.unwrap();
    // SAFETY: `local` is valid for 8 bytes; the remote address is checked by the kernel.
    let e = unsafe { link.read_remote(local.as_mut_ptr(), 8, 8) }.unwrap_err();
    assert_eq!(e.status(), Status::OutOfRange, "{e:?}");
    assert!(e.message().contains("remote address range not accessible"), "{e:?}");

    assert!(link.try_send(&[b"written"]).unwrap());
    assert_eq!(recv_one(link.as_mut()), b"ok");
    child.wait_success();
    // The child's link was dropped at exit: closed, after its last frame.
    let e = link.poll_recv(4, &mut |_| panic!("no frames left")).unwrap_err();
    assert_eq!(e.status(), Status::ConnectionReset, "{e:?}");
    drop(link);
    drop(l);
    assert!(dir.entries().is_empty(), "left behind: {:?}", dir.entries());
}

/// A child queues frames and is SIGKILLed before the parent even accepts: the parent gets the
/// frames, then PeerFailed naming the pid, and nothing is left in the directory.
#[test]
fn killed_peer_is_peer_failed() {
    const NAME: &str = "transport::shm::tests::killed_peer_is_peer_failed";
    if testutil::role().is_some() {
        let mut link = child_connect(4096);
        for f in [&b"a"[..], b"bb", b"ccc"] {
            assert!(link.try_send(&[f]).unwrap());
        }
        tell_parent("sent");
        // Wait to be killed, but never outlive the time limit.
        std::thread::sleep(testutil::TIME_LIMIT);
        std::process::exit(3);
    }
    let dir = TestDir::new("kill");
    let mut l = ShmListener::new(&small_cfg(&dir), LISTENER_UUID).unwrap();
    let mut child = spawn_child(NAME, &l, &dir);
    let pid = child.pid();
    assert_eq!(child.expect_msg(), "sent");
    child.kill();

    let (_, mut link) = accept_one(&mut l);
    let e = link.check_peer().unwrap_err();
    assert_eq!(e.status(), Status::PeerFailed, "{e:?}");
    assert!(e.message().contains(&pid.to_string()), "{e:?} names pid {pid}");
    let mut got = Vec::new();
    assert_eq!(link.poll_recv(16, &mut |f| got.push(f.to_vec())).unwrap(), 3);
    assert_eq!(got, vec![b"a".to_vec(), b"bb".to_vec(), b"ccc".to_vec()]);
    assert_eq!(link.poll_recv(16, &mut |_| {}).unwrap_err().status(), Status::PeerFailed);
    assert_eq!(link.try_send(&[b"x"]).unwrap_err().status(), Status::PeerFailed);
    let mut x = 0u8;
    // SAFETY: `x` is valid for 1 byte; the call must refuse before touching anything.
    let e = unsafe { link.read_remote(&mut x, 4096, 1) }.unwrap_err();
    assert_eq!(e.status(), Status::PeerFailed, "no CMA by pid after the peer died");
    drop(link);
    drop(l);
    assert!(dir.entries().is_empty(), "left behind: {:?}", dir.entries());
}

/// One-way latency of an 8-byte frame between two processes (half the ping-pong round trip).
/// Run: cargo test --release --lib shm_pingpong_latency -- --ignored --nocapture
#[test]
#[ignore = "benchmark; prints the latency"]
fn shm_pingpong_latency() {
    const NAME: &str = "transport::shm::tests::shm_pingpong_latency";
    const WARMUP: usize = 10_000;
    const ITERS: usize = 200_000;
    fn spin_recv(link: &mut dyn Link) -> usize {
        let mut len = 0;
        let mut n = 0u64;
        while link.poll_recv(1, &mut |f| len = f.len()).unwrap() == 0 {
            n += 1;
            if n % (1 << 24) == 0 {
                link.check_peer().unwrap();
            }
        }
        len
    }
    if testutil::role().is_some() {
        let mut link = child_connect(1 << 16);
        loop {
            let len = spin_recv(link.as_mut());
            if len == 0 {
                return;
            }
            while !link.try_send(&[&[0u8; 8]]).unwrap() {}
        }
    }
    let dir = TestDir::new("lat");
    let mut l = ShmListener::new(&small_cfg(&dir), LISTENER_UUID).unwrap();
    let mut child = spawn_child(NAME, &l, &dir);
    let (_, mut link) = accept_one(&mut l);
    let msg = [0u8; 8];
    // Per-round-trip times; the median is robust against preemption on a busy host.
    let mut rtts = Vec::with_capacity(ITERS);
    for i in 0..WARMUP + ITERS {
        let t0 = Instant::now();
        assert!(link.try_send(&[&msg]).unwrap());
        assert_eq!(spin_recv(link.as_mut()), 8);
        if i >= WARMUP {
            rtts.push(t0.elapsed());
        }
    }
    let mean = rtts.iter().sum::<Duration>().as_secs_f64() / ITERS as f64;
    rtts.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6 / 2.0;
    println!(
        "shm 8-byte one-way latency (half round trip): median {:.3} us, p90 {:.3} us, p99 {:.3} us, mean {:.3} us",
        us(rtts[ITERS / 2]),
        us(rtts[ITERS * 9 / 10]),
        us(rtts[ITERS * 99 / 100]),
        mean * 1e6 / 2.0
    );
    assert!(link.try_send(&[]).unwrap());
    child.wait_success();
}
