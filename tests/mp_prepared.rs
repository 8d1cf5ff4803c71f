//! Prepared (persistent and partitioned) transfers between processes (shm lane) and between
//! threads (loopback lane, where large rounds are direct writes): many rounds with new data each
//! time, partitions readied out of order, release rules, and a peer that dies mid-round.
mod common;

use common::*;
use gscomm::{Context, Direction, Endpoint, PrepareParams, Prepared, RequestParams, Started, Status, Worker};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);

fn params(dir: Direction, tag: u64, partitions: Option<usize>) -> PrepareParams {
    PrepareParams { dir, tag, partitions, memory_type: None, engine: gscomm::Engine::Auto }
}

/// Prepare over `buf` (which the caller keeps alive and untouched during rounds).
fn prepare(ep: &Endpoint, buf: &mut [u8], p: PrepareParams) -> Prepared {
    // SAFETY: every caller keeps `buf` alive until the `Prepared` is released or dropped, and
    // touches it only between rounds.
    unsafe { ep.prepare(buf.as_mut_ptr(), buf.len(), p).expect("prepare") }
}

fn round(w: &Worker, p: &Prepared) -> gscomm::Completion {
    wait_release(w, p.start(RequestParams::default()).expect("start"))
}

/// Peer roles. "echo": receive with tag 1 into a buffer and send it back with tag 2, `rounds`
/// times. "psend": a partitioned send (tag 3) whose partitions are readied last to first.
/// "die": prepare, then exit without a word once told.
fn roles(role: &str, chan: &dyn Chan, ctx: Context) {
    let w = ctx.create_worker().unwrap();
    let ep = w.connect(&chan.get("addr")).unwrap();
    chan.put("addr-back", w.address());
    let spec = chan.get("spec");
    let (size, rounds, parts) = (bytes_u64(&spec[..8]) as usize, bytes_u64(&spec[8..16]), bytes_u64(&spec[16..24]) as usize);
    let mut buf = vec![0u8; size];
    match role {
        "echo" => {
            let rx = prepare(&ep, &mut buf, params(Direction::Recv, 1, None));
            let tx = prepare(&ep, &mut buf, params(Direction::Send, 2, None));
            chan.put("ready", &[]);
            for _ in 0..rounds {
                assert_eq!(round(&w, &rx).status, Status::Ok);
                assert_eq!(round(&w, &tx).status, Status::Ok);
            }
            chan.put("done", &[]);
            // Release needs nothing from the peer; the link stays up until it is told "bye".
            rx.release().unwrap();
            tx.release().unwrap();
        }
        "psend" => {
            let tx = prepare(&ep, &mut buf, params(Direction::Send, 3, Some(parts)));
            chan.put("ready", &[]);
            for r in 0..rounds {
                let h = tx.start(RequestParams::default()).unwrap();
                for part in (0..parts).rev() {
                    // Partition contents depend on the round: new data each time. Progress while
                    // waiting: the receiver's readiness must be seen for readied parts to go.
                    get_progress(chan, &w, "go");
                    let n = size / parts;
                    // SAFETY: no round touches the buffer before its partition is readied.
                    let b = unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr().add(part * n), n) };
                    b.copy_from_slice(&pattern(r * 1000 + part as u64, n));
                    tx.pready(part).unwrap();
                    w.progress();
                    chan.put("readied", &[]);
                }
                assert_eq!(wait_release(&w, h).status, Status::Ok);
            }
            chan.put("done", &[]);
        }
        "die" => {
            let _tx = prepare(&ep, &mut buf, params(Direction::Send, 4, None));
            chan.put("ready", &[]);
            chan.get("die");
            std::process::exit(0);
        }
        other => panic!("unknown role {other}"),
    }
    get_progress(chan, &w, "bye");
    ep.close().unwrap();
}

/// The role side's wait for `key`, progressing its worker meanwhile.
fn get_progress(chan: &dyn Chan, w: &Worker, key: &str) {
    let deadline = Instant::now() + T;
    loop {
        if let Some((k, _)) = chan.try_get() {
            assert_eq!(k, key);
            return;
        }
        assert!(Instant::now() < deadline, "role: no `{key}`");
        if w.progress() == 0 {
            std::thread::yield_now();
        }
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

    /// `new` with more configuration (both processes get it).
    fn with(lane: Lane, test: &'static str, extra: &[(&str, &str)]) -> Setup {
        let dir = ShmDir::new(test);
        let mut cfg = vec![("GSC_TLS".to_string(), lane.tls().to_string()), ("GSC_SHM_DIR".to_string(), dir.as_str().to_string())];
        cfg.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let w = ctx_with(&refs(&cfg)).create_worker().unwrap();
        Setup { lane, test, _dir: dir, cfg, w }
    }

    /// Start `role` for a transfer of `size` bytes, `rounds` rounds, `parts` partitions, and
    /// connect to it.
    fn peer(&self, role: &str, size: usize, rounds: u64, parts: usize) -> (Peer, Endpoint) {
        let mut p = start_peer(self.lane, self.test, role, &refs(&self.cfg), roles);
        p.put("addr", self.w.address());
        let spec: Vec<u8> = [size as u64, rounds, parts as u64].iter().flat_map(|v| v.to_le_bytes()).collect();
        p.put("spec", &spec);
        // The peer connected to us; our endpoint to it is made from its address (each side
        // prepares on its own endpoint).
        let ep = self.w.connect(&p.get_progress("addr-back", T, &self.w)).unwrap();
        p.get_progress("ready", T, &self.w);
        (p, ep)
    }

    fn finish(&self, mut p: Peer) {
        p.put("bye", &[]);
        let deadline = Instant::now() + T;
        while !p.is_finished() {
            assert!(Instant::now() < deadline, "peer did not finish");
            self.w.progress();
        }
        p.finish(T);
    }
}

fn refs(v: &[(String, String)]) -> Vec<(&str, &str)> {
    v.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

fn child_or(f: impl FnOnce()) {
    if !run_child_role(roles) {
        f()
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Persistent rounds: new data every round, every size class, both lanes

/// `words`: whether the pairs must have used shared words (`GSC_PREP_WORDS`): between
/// processes (shm) by default, never on loopback or with the knob off.
fn echo_rounds(lane: Lane, test: &'static str, extra: &[(&str, &str)], words: bool) {
    let s = Setup::with(lane, test, extra);
    for (size, rounds) in [(0usize, 50u64), (8, 1000), (4096, 500), (70_000, 100), (1 << 20, 20)] {
        let (peer, ep) = s.peer("echo", size, rounds, 1);
        let mut sbuf = vec![0u8; size];
        let mut rbuf = vec![0u8; size];
        let tx = prepare(&ep, &mut sbuf, params(Direction::Send, 1, None));
        let rx = prepare(&ep, &mut rbuf, params(Direction::Recv, 2, None));
        for r in 0..rounds {
            let want = pattern(r * 7 + size as u64, size);
            // SAFETY: no round is in flight; the preparations read/write these buffers only
            // during rounds.
            unsafe { std::ptr::copy_nonoverlapping(want.as_ptr(), sbuf.as_mut_ptr(), size) };
            let hr = rx.start(RequestParams::default()).unwrap();
            let hs = tx.start(RequestParams::default()).unwrap();
            assert_eq!(wait_release(&s.w, hs).status, Status::Ok, "size {size} round {r}: send");
            let c = wait_release(&s.w, hr);
            assert_eq!((c.status, c.info.length, c.info.tag), (Status::Ok, size, 2), "size {size} round {r}: receive");
            // SAFETY: the round is complete; nothing writes `rbuf` until the next start.
            let got = unsafe { std::slice::from_raw_parts(rbuf.as_ptr(), size) };
            assert_same(got, &want, &format!("size {size} round {r}"));
        }
        // Ready and arrival through the page, or frames: the receive decided at pairing, the
        // send saw its receiver's readiness come one way or the other.
        assert_eq!(rx.shared_words().unwrap(), Some(words), "size {size}: receive");
        if rounds > 0 {
            assert_eq!(tx.shared_words().unwrap(), Some(words), "size {size}: send");
        }
        let mut peer = peer;
        peer.get_progress("done", T, &s.w);
        drop(tx);
        drop(rx);
        s.finish(peer);
        ep.close().unwrap();
    }
}

#[test]
fn prepared_echo_rounds_carry_new_data_every_round_shm() {
    child_or(|| echo_rounds(Lane::Shm, "prepared_echo_rounds_carry_new_data_every_round_shm", &[], true))
}

/// The frame path as the fallback and the A/B switch: the same rounds with shared words off.
#[test]
fn prepared_echo_rounds_with_shared_words_off_use_frames_shm() {
    child_or(|| echo_rounds(Lane::Shm, "prepared_echo_rounds_with_shared_words_off_use_frames_shm", &[("GSC_PREP_WORDS", "off")], false))
}

#[test]
fn prepared_echo_rounds_carry_new_data_every_round_loopback() {
    child_or(|| echo_rounds(Lane::Loopback, "prepared_echo_rounds_carry_new_data_every_round_loopback", &[], false))
}

// ---------------------------------------------------------------------------------------------
// 2. Partitions readied out of order, reported per partition as they arrive

fn partitions_out_of_order(lane: Lane, test: &'static str) {
    let s = Setup::new(lane, test);
    let (size, rounds, send_parts, recv_parts) = (8 * 4096usize, 5u64, 8usize, 4usize);
    let (mut peer, ep) = s.peer("psend", size, rounds, send_parts);
    let mut rbuf = vec![0u8; size];
    let rx = prepare(&ep, &mut rbuf, params(Direction::Recv, 3, Some(recv_parts)));
    let (sn, rn) = (size / send_parts, size / recv_parts);
    for r in 0..rounds {
        let h = rx.start(RequestParams::default()).unwrap();
        for readied in (0..send_parts).rev() {
            for q in 0..recv_parts {
                assert!(!rx.parrived(q).unwrap() || q * rn >= readied * sn, "round {r}: partition {q} arrived before its data was readied");
            }
            peer.put("go", &[]);
            peer.get_progress("readied", T, &s.w);
            // Receive partitions wholly made of readied sender partitions arrive (soon).
            for q in 0..recv_parts {
                if q * rn >= readied * sn {
                    progress_until(&s.w, T, "partition arrival", || rx.parrived(q).unwrap());
                }
            }
        }
        assert_eq!(wait_release(&s.w, h).status, Status::Ok);
        let want: Vec<u8> = (0..send_parts).flat_map(|p| pattern(r * 1000 + p as u64, sn)).collect();
        // SAFETY: the round is complete.
        assert_same(unsafe { std::slice::from_raw_parts(rbuf.as_ptr(), size) }, &want, &format!("round {r}"));
    }
    peer.get_progress("done", T, &s.w);
    // Misuse is refused with a clear error.
    assert_eq!(rx.pready(0).unwrap_err().status(), Status::InvalidParam);
    assert_eq!(rx.parrived(recv_parts).unwrap_err().status(), Status::OutOfRange);
    drop(rx);
    s.finish(peer);
    ep.close().unwrap();
}

#[test]
fn partitions_readied_out_of_order_arrive_per_partition_shm() {
    child_or(|| partitions_out_of_order(Lane::Shm, "partitions_readied_out_of_order_arrive_per_partition_shm"))
}

#[test]
fn partitions_readied_out_of_order_arrive_per_partition_loopback() {
    child_or(|| partitions_out_of_order(Lane::Loopback, "partitions_readied_out_of_order_arrive_per_partition_loopback"))
}

// ---------------------------------------------------------------------------------------------
// 3. Release is refused while a round is in flight; a dead peer ends the round, not a hang

#[test]
fn release_is_refused_in_flight_and_a_dead_peer_fails_the_round_shm() {
    child_or(|| {
        let s = Setup::new(Lane::Shm, "release_is_refused_in_flight_and_a_dead_peer_fails_the_round_shm");
        let (mut peer, ep) = s.peer("die", 64, 1, 1);
        let mut rbuf = vec![0u8; 64];
        let rx = prepare(&ep, &mut rbuf, params(Direction::Recv, 4, None));
        let h = match rx.start(RequestParams::default()).unwrap() {
            Started::Pending(h) => h,
            other => panic!("nothing was sent yet, got {other:?}"),
        };
        let e = rx.release().expect_err("release with a round in flight");
        assert_eq!(e.status(), Status::Busy, "{e}");
        assert_eq!(rx.start(RequestParams::default()).unwrap_err().status(), Status::Busy);
        peer.put("die", &[]);
        let t0 = Instant::now();
        let c = loop {
            if let Some(c) = s.w.request_test(h).unwrap() {
                break c;
            }
            assert!(t0.elapsed() < T, "the round did not end after the peer died");
            if s.w.progress() == 0 {
                std::thread::yield_now();
            }
        };
        s.w.request_release(h).unwrap();
        assert!(c.status.is_error(), "{:?}", c.status);
        peer.finish(T);
        rx.release().expect("release once nothing is in flight");
        assert_eq!(rx.start(RequestParams::default()).unwrap_err().status(), Status::InvalidHandle);
        drop(ep);
    })
}
