//! The UCX lane between processes, over UCX's TCP transport (`UCX_TLS=tcp`):
//!
//! - two ranks on this host with `GSC_TLS=ucx`: tag send/recv (8 B and 4 MiB, both ways, data
//!   checked) and prepared transfers;
//! - the same between two network namespaces joined by a veth pair, with the default `GSC_TLS`:
//!   the lane choice itself must pick UCX (the namespaces count as two hosts). The test makes the
//!   namespaces (root needed) and skips with a printed reason where it cannot;
//! - rendezvous by get (the UCX lane's remote memory): messages of 1 B to 64 MiB around the
//!   rendezvous threshold, data checked, and the receiver's count of `ucp_get_nbx` reads must
//!   grow by one per rendezvous message; a truncated receive writes nothing past its buffer;
//! - a peer SIGKILLed in the middle of a 64 MiB exchange (pushed in frames) and in the middle
//!   of a 64 MiB get: the survivor's requests end with an error within a bounded time;
//! - host-memory collectives (`HostComm`: all-reduce, reduce-scatter, all-gather, broadcast)
//!   between the two ranks, on this host with `GSC_TLS=ucx` and between the namespaces, every
//!   result checked exactly.
//!
//! Both ranks are children of the test (each with its own UCX environment, which the test process
//! itself cannot change safely); the test relays addresses and collects results. Every wait is
//! bounded (tests/common: the parent's deadlines, the children's watchdog).
mod common;

use common::*;
use gscomm::{Direction, Endpoint, PrepareParams, Prepared, RequestParams, Started, Status, Worker};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);
/// Tag messages each rank sends the other: sizes.
const SIZES: [usize; 2] = [8, 4 << 20];
/// Prepared transfers: rounds of this size each way.
const PREPARED: usize = 1 << 20;
const ROUNDS: u64 = 3;
/// The exchange a peer is killed in.
const BIG: usize = 64 << 20;
/// One-way rendezvous messages (rank 0 to rank 1): both sides of the 64 KiB threshold
/// (`GSC_RNDV_THRESH`'s default), odd sizes, and 64 MiB. Those from 64 KiB on go by get.
const RNDV_SIZES: [usize; 7] = [1, (64 << 10) - 1, 64 << 10, (64 << 10) + 1, (1 << 20) + 3, 16 << 20, 64 << 20];
const RNDV_THRESH: usize = 64 << 10;
/// The truncation case: a rendezvous message into a smaller window of a guarded buffer.
const TRUNC_MSG: usize = 1 << 20;
const TRUNC_WINDOW: usize = 100_000;

fn tag(rank: u64, i: usize) -> u64 {
    (rank << 32) | i as u64
}

fn seed(rank: u64, i: u64) -> u64 {
    rank * 1000 + i + 1
}

fn codes(st: &[Status]) -> Vec<u8> {
    st.iter().flat_map(|s| s.code().to_le_bytes()).collect()
}

fn uncodes(b: &[u8]) -> Vec<Status> {
    b.chunks_exact(4).map(|c| Status::from_code(i32::from_le_bytes(c.try_into().unwrap())).unwrap()).collect()
}

/// `common::next_msg` with this file's limit.
fn next_msg(chan: &dyn Chan, w: &Worker, key: &str) -> Vec<u8> {
    common::next_msg(chan, w, key, T, Duration::ZERO)
}

/// Both ranks at once: receive the peer's messages, send ours; `Internal` marks wrong data.
fn tag_exchange(w: &Worker, ep: &Endpoint, me: u64) -> Vec<Status> {
    let peer = 1 - me;
    let mut inb: Vec<Vec<u8>> = SIZES.iter().map(|&n| vec![0u8; n]).collect();
    let out: Vec<Vec<u8>> = SIZES.iter().enumerate().map(|(i, &n)| pattern(seed(me, i as u64), n)).collect();
    let recvs: Vec<Started> = inb
        .iter_mut()
        .enumerate()
        // SAFETY: `inb` outlives every request (all are waited for below).
        .map(|(i, b)| unsafe { w.tag_recv_nbx(b.as_mut_ptr(), b.len(), tag(peer, i), u64::MAX, RequestParams::default()).unwrap() })
        .collect();
    let sends: Vec<Started> = out
        .iter()
        .enumerate()
        // SAFETY: `out` outlives every request.
        .map(|(i, b)| unsafe { ep.tag_send_nbx(b.as_ptr(), b.len(), tag(me, i), RequestParams::default()).unwrap() })
        .collect();
    let mut st: Vec<Status> = sends.into_iter().map(|s| wait_release(w, s).status).collect();
    for (i, r) in recvs.into_iter().enumerate() {
        let c = wait_release(w, r);
        let ok = c.status == Status::Ok && c.info.length == SIZES[i] && inb[i] == pattern(seed(peer, i as u64), SIZES[i]);
        st.push(if c.status != Status::Ok {
            c.status
        } else if ok {
            Status::Ok
        } else {
            Status::Internal
        });
    }
    st
}

fn prepare(ep: &Endpoint, buf: &mut [u8], dir: Direction, tag: u64) -> Prepared {
    let p = PrepareParams { dir, tag, partitions: None, memory_type: None, engine: gscomm::Engine::Auto };
    // SAFETY: the caller keeps `buf` alive until the `Prepared` is released, and touches it only
    // between rounds.
    unsafe { ep.prepare(buf.as_mut_ptr(), buf.len(), p).expect("prepare") }
}

/// `ROUNDS` prepared rounds each way, new data every round; `Internal` marks wrong data.
fn prepared_exchange(w: &Worker, ep: &Endpoint, me: u64) -> Vec<Status> {
    let peer = 1 - me;
    let mut out = vec![0u8; PREPARED];
    let mut inb = vec![0u8; PREPARED];
    let tx = prepare(ep, &mut out, Direction::Send, 100 + me);
    let rx = prepare(ep, &mut inb, Direction::Recv, 100 + peer);
    let mut st = Vec::new();
    for r in 0..ROUNDS {
        // The send buffer is ours between rounds.
        // SAFETY: no round is in flight; `tx` reads `out` only during rounds.
        unsafe { std::ptr::copy_nonoverlapping(pattern(seed(me, 10 + r), PREPARED).as_ptr(), out.as_mut_ptr(), PREPARED) };
        let rs = rx.start(RequestParams::default()).unwrap();
        let ts = tx.start(RequestParams::default()).unwrap();
        st.push(wait_release(w, ts).status);
        let c = wait_release(w, rs);
        let ok = inb == pattern(seed(peer, 10 + r), PREPARED);
        st.push(if c.status != Status::Ok {
            c.status
        } else if ok {
            Status::Ok
        } else {
            Status::Internal
        });
    }
    tx.release().unwrap();
    rx.release().unwrap();
    st
}

/// Rank 0 sends `RNDV_SIZES` then a `TRUNC_MSG` message; rank 1 receives them (the last into a
/// `TRUNC_WINDOW` window followed by guard bytes) and reports one status per message (`Internal`
/// for wrong data or a touched guard) and how many remote reads its lane did meanwhile.
fn rndv_by_get(w: &Worker, ep: &Endpoint, me: u64) -> Vec<u8> {
    let tag = |i: usize| 500 + i as u64;
    if me == 0 {
        let mut msgs: Vec<Vec<u8>> = RNDV_SIZES.iter().enumerate().map(|(i, &n)| pattern(seed(0, 50 + i as u64), n)).collect();
        msgs.push(pattern(seed(0, 99), TRUNC_MSG));
        for (i, m) in msgs.iter().enumerate() {
            // SAFETY: `m` outlives the request (waited for at once).
            let s = unsafe { ep.tag_send_nbx(m.as_ptr(), m.len(), tag(i), RequestParams::default()).unwrap() };
            assert_eq!(wait_release(w, s).status, Status::Ok, "send of {} bytes", m.len());
        }
        return Vec::new();
    }
    let before = gscomm::transport::ucx::rma_stats();
    let mut st = Vec::new();
    for (i, &n) in RNDV_SIZES.iter().enumerate() {
        let mut b = vec![0u8; n];
        // SAFETY: `b` outlives the request.
        let r = unsafe { w.tag_recv_nbx(b.as_mut_ptr(), n, tag(i), u64::MAX, RequestParams::default()).unwrap() };
        let c = wait_release(w, r);
        let ok = c.info.length == n && b == pattern(seed(0, 50 + i as u64), n);
        st.push(if c.status != Status::Ok {
            c.status
        } else if ok {
            Status::Ok
        } else {
            Status::Internal
        });
    }
    const GUARD: usize = 4096;
    let mut b = vec![0xeeu8; TRUNC_WINDOW + GUARD];
    // SAFETY: `b` outlives the request; the window is its first TRUNC_WINDOW bytes.
    let r = unsafe { w.tag_recv_nbx(b.as_mut_ptr(), TRUNC_WINDOW, tag(RNDV_SIZES.len()), u64::MAX, RequestParams::default()).unwrap() };
    let c = wait_release(w, r);
    let want = pattern(seed(0, 99), TRUNC_MSG);
    let ok = c.info.length == TRUNC_MSG && b[..TRUNC_WINDOW] == want[..TRUNC_WINDOW] && b[TRUNC_WINDOW..].iter().all(|&x| x == 0xee);
    st.push(if c.status != Status::MessageTruncated {
        c.status
    } else if ok {
        Status::Ok
    } else {
        Status::Internal
    });
    let after = gscomm::transport::ucx::rma_stats();
    let mut out = codes(&st);
    out.extend_from_slice(&(after.gets - before.gets).to_le_bytes());
    out.extend_from_slice(&(after.get_bytes - before.get_bytes).to_le_bytes());
    out
}

/// The roles. "rank0"/"rank1": connect to the peer, exchange tag messages and prepared rounds,
/// report. "survivor"/"victim": the peer-failure scenario (see `peer_killed_mid_transfer_ucx`).
/// Rank `rank`'s input of `len` bytes for collective case `case`.
fn coll_input(rank: usize, case: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 11 + rank * 97 + case * 37 + 3) as u8).collect()
}

/// One rank of the collectives: bootstrap (rank 0 hosts the root at the address the test gives
/// it), a `HostComm`, then every collective on sizes that are eager and rendezvous over UCX.
/// Reports "ok" or what went wrong.
fn coll_role(role: &str, chan: &dyn Chan, ctx: gscomm::Context) {
    use gscomm::bootstrap::{Bootstrap, UniqueId};
    use gscomm::collectives::{DataType, HostComm, RedOp, types::reduce_reference};
    let rank = usize::from(role == "coll1");
    let uid = if rank == 0 {
        let ip: std::net::IpAddr = String::from_utf8(chan.get("ip")).unwrap().parse().unwrap();
        let uid = UniqueId::create(Some(ip)).unwrap();
        chan.put("uid", &uid.to_bytes());
        uid
    } else {
        UniqueId::from_bytes(&chan.get("uid")).unwrap()
    };
    let run = || -> Result<(), String> {
        let boot = Bootstrap::init(&uid, rank as u32, 2, T).map_err(|e| e.to_string())?;
        let comm = HostComm::new(&boot, ctx.config()).map_err(|e| e.to_string())?;
        let lane = comm.lane_to(1 - rank).map_err(|e| e.to_string())?;
        if lane.name() != "ucx" {
            return Err(format!("the peer is reached over {}, not UCX", lane.name()));
        }
        let cases =
            [(DataType::Int32, RedOp::Sum, 1usize), (DataType::Float32, RedOp::Sum, (1 << 20) + 3), (DataType::Float16, RedOp::Max, 999)];
        for (case, &(dtype, op, count)) in cases.iter().enumerate() {
            let len = count * dtype.size();
            let inputs: Vec<Vec<u8>> = (0..2).map(|r| coll_input(r, case, len)).collect();
            let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
            let mut out = vec![0u8; len];
            comm.all_reduce(&inputs[rank], &mut out, dtype, op).map_err(|e| format!("all_reduce {case}: {e}"))?;
            if out != reduce_reference(dtype, op, &refs) {
                return Err(format!("all_reduce case {case} differs"));
            }
            let mut part = vec![0u8; len / 2 / dtype.size() * dtype.size()];
            let whole: Vec<Vec<u8>> = inputs.iter().map(|i| i[..part.len() * 2].to_vec()).collect();
            comm.reduce_scatter(&whole[rank], &mut part, dtype, op).map_err(|e| format!("reduce_scatter {case}: {e}"))?;
            let slices: Vec<&[u8]> = whole.iter().map(|w| &w[rank * part.len()..(rank + 1) * part.len()]).collect();
            if !part.is_empty() && part != reduce_reference(dtype, op, &slices) {
                return Err(format!("reduce_scatter case {case} differs"));
            }
            let mut all = vec![0u8; 2 * len];
            comm.all_gather(&inputs[rank], &mut all).map_err(|e| format!("all_gather {case}: {e}"))?;
            if all != inputs.concat() {
                return Err(format!("all_gather case {case} differs"));
            }
            let mut b = if rank == 1 { inputs[1].clone() } else { vec![0u8; len] };
            comm.broadcast(&mut b, 1).map_err(|e| format!("broadcast {case}: {e}"))?;
            if b != inputs[1] {
                return Err(format!("broadcast case {case} differs"));
            }
        }
        boot.barrier().map_err(|e| e.to_string())
    };
    let result = run();
    chan.put("result", result.as_ref().map_or_else(|e| e.as_bytes(), |()| b"ok".as_slice()));
}

/// A `HostComm` rank of the killed-rank test: "kcoll1" joins and then only waits to be killed;
/// "kcoll0" starts a 4 MiB all-reduce its peer never joins, says so, and reports how the call
/// ended, how long after the parent's "killed" it returned, and what a later call says.
fn kill_coll_role(role: &str, chan: &dyn Chan, ctx: gscomm::Context) {
    use gscomm::bootstrap::{Bootstrap, UniqueId};
    use gscomm::collectives::{DataType, HostComm, RedOp};
    let rank = usize::from(role == "kcoll1");
    let uid = if rank == 0 {
        let uid = UniqueId::create(Some(std::net::Ipv4Addr::LOCALHOST.into())).unwrap();
        chan.put("uid", &uid.to_bytes());
        uid
    } else {
        UniqueId::from_bytes(&chan.get("uid")).unwrap()
    };
    let boot = Bootstrap::init(&uid, rank as u32, 2, T).unwrap();
    let comm = HostComm::new(&boot, ctx.config()).unwrap();
    // A first all-reduce, checked. With one element rank 0 only sends in the first half and
    // rank 1 only in the second, so rank 1's link to rank 0 is made after rank 0's carried
    // traffic, and rank 1 has nothing left to wait for once its frame is handed to UCX: the case
    // that hung before the proxy kept progressing lanes with frames still to send.
    let mut one = [0u8; 4];
    comm.all_reduce(&1i32.to_le_bytes(), &mut one, DataType::Int32, RedOp::Sum).unwrap();
    assert_eq!(i32::from_le_bytes(one), 2);
    if rank == 1 {
        chan.put("joined", &[]);
        loop {
            std::thread::sleep(Duration::from_secs(1));
        }
    }
    let comm = std::sync::Arc::new(comm);
    let call = std::thread::spawn({
        let comm = comm.clone();
        move || {
            let send = vec![1u8; 4 << 20];
            let mut recv = vec![0u8; 4 << 20];
            let r = comm.all_reduce(&send, &mut recv, DataType::Int32, RedOp::Sum);
            (r, Instant::now())
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    chan.put("started", &[]);
    chan.get("killed");
    let killed = Instant::now();
    let (r, ended) = call.join().unwrap();
    let took = ended.saturating_duration_since(killed);
    let status = r.map_err(|e| e.status()).err();
    let t0 = Instant::now();
    let later = comm.all_reduce(&[0u8; 4], &mut one, DataType::Int32, RedOp::Sum).map_err(|e| e.to_string()).err();
    let later_took = t0.elapsed();
    chan.put("result", format!("{status:?}|{}|{later:?}|{}", took.as_millis(), later_took.as_millis()).as_bytes());
}

/// Rounds of the idle-sender test, and the message of each: eager (`GSC_RNDV_THRESH` is raised
/// above it) and one frame, so the sender's request completes once UCX took that frame; far
/// larger than the children's socket buffers, so UCX's TCP transport can never write it at once.
const TAIL_ROUNDS: u64 = 4;
const TAIL_LEN: usize = 250_000;
/// The receiver's bound per round: far beyond what 1 MiB over loopback takes, far below the
/// round's GSC_TIMEOUT, so a stall shows as this failure, not as a timeout of the test.
const TAIL_ROUND_LIMIT: Duration = Duration::from_secs(3);

/// Sends one message per round on a host stream (the proxy thread drives it), then waits for
/// the test's word without progressing: whatever the receiver still needs must leave this
/// process on the proxy's own.
fn tail_sender(chan: &dyn Chan, w: &Worker, ep: &Endpoint) {
    let stream = gscomm::condition::HostStream::new().unwrap();
    let on = gscomm::condition::Condition::host_stream(&stream);
    for round in 0..TAIL_ROUNDS {
        let data = pattern(seed(0, round), TAIL_LEN);
        let params = RequestParams { condition: Some(on.clone()), ..Default::default() };
        // SAFETY: `data` lives until the stream is synchronized below.
        let started = unsafe { ep.tag_send_nbx(data.as_ptr(), data.len(), round, params) }.unwrap();
        if let Started::Pending(h) = started {
            w.request_release(h).unwrap();
        }
        stream.synchronize(Some(T)).unwrap();
        on.query().unwrap();
        chan.put("sent", &round.to_le_bytes());
        // Blocking, no progress: the proxy thread has nothing of its own in flight now.
        chan.get("next");
    }
}

/// Receives each round's message, progressing itself, within `TAIL_ROUND_LIMIT`.
fn tail_receiver(chan: &dyn Chan, w: &Worker) {
    for round in 0..TAIL_ROUNDS {
        let mut buf = vec![0u8; TAIL_LEN];
        let t0 = Instant::now();
        // SAFETY: `buf` outlives the request (waited for, or the process exits on failure).
        let h = match unsafe { w.tag_recv_nbx(buf.as_mut_ptr(), buf.len(), round, u64::MAX, RequestParams::default()) }.unwrap() {
            Started::Pending(h) => h,
            _ => panic!("a {TAIL_LEN}-byte receive completed at once"),
        };
        let done = loop {
            if let Some(c) = w.request_test(h).unwrap() {
                break Some(c.status);
            }
            if t0.elapsed() > TAIL_ROUND_LIMIT {
                break None;
            }
            w.progress();
        };
        let verdict = match done {
            Some(Status::Ok) if buf == pattern(seed(0, round), TAIL_LEN) => "ok".to_string(),
            Some(Status::Ok) => "wrong data".to_string(),
            Some(st) => format!("status {st:?}"),
            None => format!("not complete after {TAIL_ROUND_LIMIT:?}: the sender's last frame is stuck in its process"),
        };
        chan.put("got", verdict.as_bytes());
        if done.is_none() {
            return;
        }
        w.request_release(h).unwrap();
    }
}

fn roles(role: &str, chan: &dyn Chan, ctx: gscomm::Context) {
    if role.starts_with("coll") {
        return coll_role(role, chan, ctx);
    }
    if role.starts_with("kcoll") {
        return kill_coll_role(role, chan, ctx);
    }
    let w = ctx.create_worker().unwrap();
    chan.put("addr", w.address());
    let ep = w.connect(&chan.get("peer")).unwrap();
    chan.put("lane", ep.lane().unwrap().name().as_bytes());
    match role {
        "tail0" => tail_sender(chan, &w, &ep),
        "tail1" => tail_receiver(chan, &w),
        "rank0" | "rank1" => {
            let me = u64::from(role == "rank1");
            next_msg(chan, &w, "go");
            let mut st = tag_exchange(&w, &ep, me);
            st.extend(prepared_exchange(&w, &ep, me));
            chan.put("result", &codes(&st));
            chan.put("rma", &rndv_by_get(&w, &ep, me));
            next_msg(chan, &w, "bye");
            ep.close().unwrap();
        }
        "victim" => {
            next_msg(chan, &w, "go");
            let out = pattern(1, BIG);
            // SAFETY: the buffer outlives the request: this process is killed while it runs.
            let _send = unsafe { ep.tag_send_nbx(out.as_ptr(), BIG, 2, RequestParams::default()).unwrap() };
            // No receive for the survivor's message: a send the victim had matched could finish
            // before the kill (CI saw it once), and then it would prove nothing. Unmatched, it
            // stays pending until the victim dies, deterministically; the survivor's receive is
            // the part that is cut mid-transfer.
            chan.put("started", &[]);
            // Keep the data moving until the test kills us (the watchdog ends us otherwise).
            loop {
                if w.progress() == 0 {
                    std::thread::yield_now();
                }
            }
        }
        // The peer-failure-during-a-get scenario (`peer_killed_during_a_get_ucx`): over TCP
        // the target serves the reader's get from its own progress, which it stops running once
        // its RTS is out, so the get is still running when the test kills it.
        "slow_target" => {
            next_msg(chan, &w, "go");
            let out = pattern(3, BIG);
            // SAFETY: `out` outlives the request: this process is killed while it runs.
            let _send = unsafe { ep.tag_send_nbx(out.as_ptr(), BIG, 7, RequestParams::default()).unwrap() };
            // Long enough for the RTS to leave; then no more progress, so the reader's get
            // (which over TCP this side's progress serves) stalls until the kill.
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_millis(50) {
                w.progress();
            }
            chan.put("started", &[]);
            loop {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        "reader" => {
            next_msg(chan, &w, "go");
            let mut inb = vec![0u8; BIG];
            // SAFETY: `inb` outlives the request (waited for below).
            let recv = unsafe { w.tag_recv_nbx(inb.as_mut_ptr(), BIG, 7, u64::MAX, RequestParams::default()).unwrap() };
            chan.put("posted", &[]);
            let c = wait_release(&w, recv);
            chan.put("result", &codes(&[c.status]));
            drop(ep);
        }
        "survivor" | "silent_survivor" => {
            next_msg(chan, &w, "go");
            let out = pattern(2, BIG);
            let mut inb = vec![0u8; BIG];
            // SAFETY: both buffers outlive the requests (waited for below).
            let send = unsafe { ep.tag_send_nbx(out.as_ptr(), BIG, 1, RequestParams::default()).unwrap() };
            // SAFETY: as above.
            let recv = unsafe { w.tag_recv_nbx(inb.as_mut_ptr(), BIG, 2, u64::MAX, RequestParams::default()).unwrap() };
            let (Started::Pending(send), Started::Pending(recv)) = (send, recv) else { panic!("64 MiB completed at once") };
            // Wait until the victim's data is arriving (its first block stamps the seed at 8..16),
            // then stop progressing: the transfer cannot finish before the kill, since the victim
            // can send only what our UCX takes in.
            let seed_at = inb[8..16].as_ptr() as *const u64;
            // SAFETY: reads of our own receive buffer, which the worker writes only during progress.
            progress_until(&w, T, "victim's data arriving", || unsafe { std::ptr::read_volatile(seed_at) } != 0);
            assert!(w.request_test(recv).unwrap().is_none(), "64 MiB arrived before the kill");
            chan.put("arriving", &[]);
            chan.get("killed");
            let t0 = Instant::now();
            if role == "silent_survivor" {
                // Nothing tells a silent network from a slow peer: the waits end at GSC_TIMEOUT
                // (the requests stay valid, as after any timed-out wait).
                let status = |r: Result<gscomm::core::Completion, gscomm::Error>| r.map_or_else(|e| e.status(), |c| c.status);
                let (sc, rc) = (status(w.request_wait(send)), status(w.request_wait(recv)));
                let mut result = codes(&[sc, rc, rc]);
                result.extend_from_slice(&(t0.elapsed().as_millis() as u64).to_le_bytes());
                chan.put("result", &result);
                return;
            }
            progress_until(&w, Duration::from_secs(20), "requests of the dead peer", || {
                w.request_test(send).unwrap().is_some() && w.request_test(recv).unwrap().is_some()
            });
            let took = t0.elapsed();
            let (sc, rc) = (w.request_test(send).unwrap().unwrap(), w.request_test(recv).unwrap().unwrap());
            w.request_release(send).unwrap();
            w.request_release(recv).unwrap();
            // SAFETY: `out` outlives the call (it fails at once or completes inline).
            let again = unsafe { ep.tag_send_nbx(out.as_ptr(), 10, 3, RequestParams::default()) };
            let again = match again {
                Err(e) => e.status(),
                Ok(s) => wait_release(&w, s).status,
            };
            let mut result = codes(&[sc.status, rc.status, again]);
            result.extend_from_slice(&(took.as_millis() as u64).to_le_bytes());
            chan.put("result", &result);
            drop(ep);
        }
        other => panic!("unknown role {other}"),
    }
}

fn child_or(f: impl FnOnce()) {
    if !run_child_role(roles) {
        f()
    }
}

/// The children's UCX: TCP only, so the transport under test is the network one even between
/// processes of one host.
const UCX_ENV: &[(&str, &str)] = &[("UCX_TLS", "tcp")];

/// Start two ranks (through their wrappers), cross their addresses, and return them once each
/// has an endpoint to the other; checks the lane both picked.
fn start_pair(test: &str, roles: [&str; 2], cfg: &[(&str, &str)], wrappers: [&[&str]; 2]) -> [ChildProc; 2] {
    start_pair_env(test, roles, cfg, UCX_ENV, wrappers)
}

/// `start_pair` with the children's UCX environment `env`.
fn start_pair_env(test: &str, roles: [&str; 2], cfg: &[(&str, &str)], env: &[(&str, &str)], wrappers: [&[&str]; 2]) -> [ChildProc; 2] {
    let mut a = spawn_child_with(test, roles[0], cfg, env, wrappers[0]);
    let mut b = spawn_child_with(test, roles[1], cfg, env, wrappers[1]);
    let addr_a = a.get("addr", T);
    let addr_b = b.get("addr", T);
    a.put("peer", &addr_b);
    b.put("peer", &addr_a);
    for c in [&mut a, &mut b] {
        let lane = c.get("lane", T);
        assert_eq!(String::from_utf8_lossy(&lane), "ucx", "{}: lane", c.role);
    }
    [a, b]
}

/// Tag messages and prepared rounds between two ranks; every status must be Ok.
fn exchange(test: &str, cfg: &[(&str, &str)], wrappers: [&[&str]; 2]) {
    let t0 = Instant::now();
    let mut ranks = start_pair(test, ["rank0", "rank1"], cfg, wrappers);
    for r in &mut ranks {
        r.put("go", &[]);
    }
    for r in &mut ranks {
        let st = uncodes(&r.get("result", T));
        assert_eq!(st.len(), 2 * SIZES.len() + 2 * ROUNDS as usize);
        assert!(st.iter().all(|s| *s == Status::Ok), "{}: {st:?} (tag sends, tag receives, then prepared send/recv per round)", r.role);
    }
    let rma = ranks[1].get("rma", T);
    let n = RNDV_SIZES.len() + 1;
    let st = uncodes(&rma[..4 * n]);
    assert!(st.iter().all(|s| *s == Status::Ok), "rendezvous by get: {st:?} (sizes {RNDV_SIZES:?}, then truncation)");
    let (gets, bytes) = (bytes_u64(&rma[4 * n..4 * n + 8]), bytes_u64(&rma[4 * n + 8..]));
    let by_get: Vec<usize> = RNDV_SIZES.iter().copied().filter(|&s| s >= RNDV_THRESH).collect();
    let want_bytes = by_get.iter().sum::<usize>() + TRUNC_WINDOW;
    assert_eq!(gets, by_get.len() as u64 + 1, "one get per rendezvous message ({by_get:?} and the truncated one)");
    assert_eq!(bytes, want_bytes as u64, "bytes read by get (the truncated receive reads only its window)");
    for r in &mut ranks {
        r.put("bye", &[]);
    }
    for r in &mut ranks {
        r.wait_success(T);
    }
    println!("{test}: {:?}", t0.elapsed());
}

/// Host collectives between two ranks (children, through their wrappers); rank 0 hosts the
/// bootstrap root on `ip`.
fn collectives(test: &str, cfg: &[(&str, &str)], wrappers: [&[&str]; 2], ip: &str) {
    let t0 = Instant::now();
    let mut a = spawn_child_with(test, "coll0", cfg, UCX_ENV, wrappers[0]);
    let mut b = spawn_child_with(test, "coll1", cfg, UCX_ENV, wrappers[1]);
    a.put("ip", ip.as_bytes());
    let uid = a.get("uid", T);
    b.put("uid", &uid);
    for c in [&mut a, &mut b] {
        let r = c.get("result", T);
        assert_eq!(String::from_utf8_lossy(&r), "ok", "{}", c.role);
    }
    for c in [&mut a, &mut b] {
        c.wait_success(T);
    }
    println!("{test}: {:?}", t0.elapsed());
}

/// Issue #7's stall, on host memory: UCX completes an eager send once it copied the frame, and
/// its TCP transport keeps what the socket does not take in the endpoint's own buffer, sent on
/// a later progress of the *sender*. A sender whose request completed with its last frame so
/// held, and whose proxy thread then went idle, left the receiver waiting for ever (NetComm's
/// steps stalled until GSC_TIMEOUT). Small socket buffers make every large frame such a
/// partial send. Each round must complete within `TAIL_ROUND_LIMIT` while the sender waits
/// without progressing.
#[test]
fn idle_sender_still_sends_its_last_frame_ucx() {
    child_or(|| {
        let test = "idle_sender_still_sends_its_last_frame_ucx";
        let t0 = Instant::now();
        let cfg = [("GSC_TLS", "ucx"), ("GSC_RNDV_THRESH", "1M"), ("GSC_TIMEOUT", "20s")];
        let env = [("UCX_TLS", "tcp"), ("UCX_TCP_SNDBUF", "16k"), ("UCX_TCP_RCVBUF", "16k")];
        let [mut sender, mut receiver] = start_pair_env(test, ["tail0", "tail1"], &cfg, &env, [&[], &[]]);
        for round in 0..TAIL_ROUNDS {
            assert_eq!(sender.get("sent", T), round.to_le_bytes(), "sender: round");
            let got = receiver.get("got", T);
            assert_eq!(String::from_utf8_lossy(&got), "ok", "round {round}");
            sender.put("next", &[]);
        }
        for c in [&mut sender, &mut receiver] {
            c.wait_success(T);
        }
        println!("{test}: {:?}", t0.elapsed());
    });
}

#[test]
fn host_collectives_over_ucx_tcp() {
    child_or(|| collectives("host_collectives_over_ucx_tcp", &[("GSC_TLS", "ucx")], [&[], &[]], "127.0.0.1"));
}

/// Issue #8 for host collectives: one rank of a `HostComm` is SIGKILLed while the other waits
/// in an all-reduce (over UCX TCP here; `_shm` below on the shm lane). The survivor's call must fail (PeerFailed, ConnectionReset or
/// TimedOut) within GSC_TIMEOUT (3 s) plus the call's 5 s margin, and a later call must fail at
/// once with the first error (sticky).
#[test]
fn host_collective_with_a_killed_rank_ucx() {
    child_or(|| killed_rank("host_collective_with_a_killed_rank_ucx", "ucx"));
}

/// The same on the shm lane (one host, no UCX), so every lane a `HostComm` uses is covered.
#[test]
fn host_collective_with_a_killed_rank_shm() {
    child_or(|| killed_rank("host_collective_with_a_killed_rank_shm", "shm"));
}

fn killed_rank(test: &str, tls: &str) {
    let cfg = [("GSC_TLS", tls), ("GSC_TIMEOUT", "3s")];
    let mut a = spawn_child_with(test, "kcoll0", &cfg, UCX_ENV, &[]);
    let mut b = spawn_child_with(test, "kcoll1", &cfg, UCX_ENV, &[]);
    let uid = a.get("uid", T);
    b.put("uid", &uid);
    b.get("joined", T);
    a.get("started", T);
    b.sigkill_proven();
    a.put("killed", &[]);
    let r = String::from_utf8(a.get("result", T)).unwrap();
    let parts: Vec<&str> = r.split('|').collect();
    assert!(
        ["Some(PeerFailed)", "Some(ConnectionReset)", "Some(TimedOut)"].contains(&parts[0]),
        "the survivor's all-reduce ended with {}",
        parts[0]
    );
    let took: u64 = parts[1].parse().unwrap();
    assert!(took < 3_000 + 5_000 + 1_000, "the all-reduce returned {took} ms after the kill");
    assert!(parts[2].contains("an earlier collective of this host communicator failed"), "later call: {}", parts[2]);
    let later_took: u64 = parts[3].parse().unwrap();
    assert!(later_took < 100, "a later call took {later_took} ms");
    a.wait_success(T);
    println!("{tls} survivor: {} after {took} ms; later call refused in {later_took} ms", parts[0]);
}

#[test]
fn tag_and_prepared_over_ucx_tcp() {
    child_or(|| exchange("tag_and_prepared_over_ucx_tcp", &[("GSC_TLS", "ucx")], [&[], &[]]));
}

// ---------------------------------------------------------------------------------------------
// Two "hosts": network namespaces joined by a veth pair

/// Two network namespaces and the veth pair between them (10.213.7.1 and .2), removed on drop.
struct NetnsPair {
    names: [String; 2],
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = std::process::Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() { Ok(()) } else { Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim())) }
}

impl NetnsPair {
    /// `Err` says why namespaces cannot be made here (not root, no `ip`, no kernel support).
    fn create() -> Result<NetnsPair, String> {
        NetnsPair::remove_stale();
        let pid = std::process::id();
        let pair = NetnsPair { names: [format!("gsctest-{pid}-a"), format!("gsctest-{pid}-b")] };
        let veth = [format!("gsv{pid}a"), format!("gsv{pid}b")];
        for n in &pair.names {
            ip(&["netns", "add", n])?;
        }
        // From here on, dropping `pair` deletes what exists (and the veth with its namespace).
        ip(&["link", "add", &veth[0], "type", "veth", "peer", "name", &veth[1]])?;
        for (i, (n, v)) in pair.names.iter().zip(&veth).enumerate() {
            if let Err(e) = ip(&["link", "set", v, "netns", n]) {
                let _ = ip(&["link", "del", &veth[0]]);
                return Err(e);
            }
            ip(&["-n", n, "addr", "add", &format!("10.213.7.{}/24", i + 1), "dev", v])?;
            ip(&["-n", n, "link", "set", v, "up"])?;
            ip(&["-n", n, "link", "set", "lo", "up"])?;
        }
        Ok(pair)
    }

    /// `create`, or `None` with the reason printed (the test then skips).
    fn create_or_say_why() -> Option<NetnsPair> {
        NetnsPair::create().map_err(|why| println!("skipped: cannot make network namespaces here: {why}")).ok()
    }

    /// Namespaces of earlier runs that were killed before they could clean up.
    fn remove_stale() {
        let Ok(out) = std::process::Command::new("ip").args(["netns", "list"]).output() else { return };
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let name = line.split_whitespace().next().unwrap_or("");
            let Some(pid) = name.strip_prefix("gsctest-").and_then(|r| r.split('-').next()).and_then(|p| p.parse::<u32>().ok()) else {
                continue;
            };
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                let _ = ip(&["netns", "del", name]);
            }
        }
    }

    /// Namespace `i`'s end of the veth pair goes down: its packets stop, nothing is closed or
    /// reset (a silent network failure).
    fn silence(&self, i: usize) -> Result<(), String> {
        let pid = std::process::id();
        let veth = format!("gsv{pid}{}", ["a", "b"][i]);
        ip(&["-n", &self.names[i], "link", "set", &veth, "down"])
    }

    fn wrapper(&self, i: usize) -> [&str; 4] {
        ["ip", "netns", "exec", &self.names[i]]
    }
}

impl Drop for NetnsPair {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = ip(&["netns", "del", n]);
        }
    }
}

#[test]
fn tag_and_prepared_between_network_namespaces() {
    child_or(|| {
        let Some(pair) = NetnsPair::create_or_say_why() else { return };
        // Default GSC_TLS (every lane): the ranks are on one machine, yet in different network
        // namespaces, so they count as two hosts and must pick UCX on their own.
        exchange("tag_and_prepared_between_network_namespaces", &[], [&pair.wrapper(0), &pair.wrapper(1)]);
    });
}

#[test]
fn host_collectives_between_network_namespaces() {
    child_or(|| {
        let Some(pair) = NetnsPair::create_or_say_why() else { return };
        // The bootstrap root listens in the first namespace, on its end of the veth pair.
        collectives("host_collectives_between_network_namespaces", &[], [&pair.wrapper(0), &pair.wrapper(1)], "10.213.7.1");
    });
}

// ---------------------------------------------------------------------------------------------
// A peer dies mid-transfer

#[test]
fn peer_killed_mid_transfer_ucx() {
    child_or(|| {
        // Pushed in frames (GSC_RNDV_SCHEME=pipeline): the survivor watches the data arrive
        // frame by frame and stops progressing, which a get (one call) would not let it do;
        // `peer_killed_during_a_get_ucx` covers the get.
        let [mut survivor, mut victim] = start_pair(
            "peer_killed_mid_transfer_ucx",
            ["survivor", "victim"],
            &[("GSC_TLS", "ucx"), ("GSC_RNDV_SCHEME", "pipeline")],
            [&[], &[]],
        );
        victim.put("go", &[]);
        victim.get("started", T);
        survivor.put("go", &[]);
        survivor.get("arriving", T);
        victim.signal(libc::SIGKILL);
        victim.wait_dead_unreaped(T);
        survivor.put("killed", &[]);
        let r = survivor.get("result", T);
        let st = uncodes(&r[..12]);
        let took = Duration::from_millis(bytes_u64(&r[12..20]));
        for (what, s) in ["send", "recv", "send after the failure"].iter().zip(&st) {
            assert!(matches!(s, Status::PeerFailed | Status::ConnectionReset), "{what} ended with {s:?}");
        }
        assert!(took < Duration::from_secs(5), "failure noticed after {took:?}");
        survivor.wait_success(T);
        victim.kill();
        println!("peer failure noticed in {took:?}");
    });
}

#[test]
fn peer_killed_during_a_get_ucx() {
    child_or(|| {
        let [mut reader, mut target] =
            start_pair("peer_killed_during_a_get_ucx", ["reader", "slow_target"], &[("GSC_TLS", "ucx"), ("GSC_TIMEOUT", "3s")], [&[], &[]]);
        target.put("go", &[]);
        target.get("started", T);
        reader.put("go", &[]);
        reader.get("posted", T);
        // The reader matches the RTS and is inside its get, which the stopped target cannot
        // serve.
        std::thread::sleep(Duration::from_millis(300));
        target.signal(libc::SIGKILL);
        target.wait_dead_unreaped(T);
        let t0 = Instant::now();
        let st = uncodes(&reader.get("result", T));
        let took = t0.elapsed();
        // Known limit (docs/UCX.md): over UCX 1.13's TCP the reader's endpoint does not report
        // the death of a peer whose only traffic is our outstanding get, so the read ends at
        // its deadline (GSC_TIMEOUT, 3 s here) with TimedOut rather than at once with
        // PeerFailed. Either way it is an error within a bound, never a hang.
        assert!(
            matches!(st[0], Status::PeerFailed | Status::ConnectionReset | Status::TimedOut),
            "the receive read by get ended with {:?}",
            st[0]
        );
        assert!(took < Duration::from_secs(8), "failure seen {took:?} after the kill");
        reader.wait_success(T);
        target.kill();
        println!("get from a killed peer: {:?} {took:?} after the kill", st[0]);
    });
}

/// A network that goes silent mid-transfer: no close, no reset, the packets just stop (the
/// victim's end of the veth pair is set down while 64 MiB move both ways over UCX TCP between
/// two network namespaces). The survivor's waits for its send and receive must each end with
/// an error within `GSC_TIMEOUT` (3 s here), never hang. Skips with a printed reason where
/// namespaces cannot be made.
#[test]
fn network_silent_mid_transfer_between_network_namespaces() {
    child_or(|| {
        let Some(pair) = NetnsPair::create_or_say_why() else { return };
        let [mut survivor, mut victim] = start_pair(
            "network_silent_mid_transfer_between_network_namespaces",
            ["silent_survivor", "victim"],
            &[("GSC_RNDV_SCHEME", "pipeline"), ("GSC_TIMEOUT", "3s")],
            [&pair.wrapper(0), &pair.wrapper(1)],
        );
        victim.put("go", &[]);
        victim.get("started", T);
        survivor.put("go", &[]);
        survivor.get("arriving", T);
        pair.silence(1).unwrap();
        survivor.put("killed", &[]);
        let r = survivor.get("result", T);
        let st = uncodes(&r[..12]);
        let took = Duration::from_millis(bytes_u64(&r[12..20]));
        for (what, s) in ["send", "recv"].iter().zip(&st) {
            assert!(
                matches!(s, Status::PeerFailed | Status::ConnectionReset | Status::TimedOut),
                "the wait for the {what} ended with {s:?}"
            );
        }
        // Two waits, each bounded by GSC_TIMEOUT.
        assert!(took < Duration::from_secs(2 * 3 + 5), "the waits on the silent network ended after {took:?}");
        survivor.wait_success(T);
        victim.kill();
        println!(
            "silent network: the waits for the send and the receive ended with {:?} and {:?}, {took:?} after the link went down",
            st[0], st[1]
        );
    });
}
