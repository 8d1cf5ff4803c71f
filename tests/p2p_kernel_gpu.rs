//! A communicator's groups of sends and receives (`Communicator::transfers`: the send/recv
//! kernel up to `GSC_COLL_P2P_MAX`, the point-to-point engine above), between processes, one
//! GPU each, every byte checked: all-to-all (self included) from 1 B to past the kernel's
//! limit, both paths in one group, several messages per pair and unaligned buffers, a group
//! larger than one launch, a group captured into a graph and one built on a graph condition,
//! replayed with new data; bad input refused before anything is issued; then, on communicators
//! split off with a short timeout, a receive nobody sends (a timeout, reported on both sides)
//! and a send and receive of different lengths (reported as such).
//!
//! Skips with a printed reason unless `GSC_TEST_GPU=1` and enough GPUs are there (four ranks:
//! or `GSC_TEST_SHARE_GPUS=1`); the device machines run it through `.gpu/run.sh`.
mod common;

use common::*;
use gscomm::bootstrap::{Bootstrap, UniqueId};
use gscomm::collectives::{Communicator, PeerOp, PeerTransfer};
use gscomm::condition::{Category, Condition, HostStream};
use gscomm::cuda::api::{DeviceBuf, Graph, Stream, set_device};
use gscomm::{Context, Status};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(240);
/// `GSC_COLL_P2P_MAX` as the ranks see it: the largest message of the kernel.
fn kernel_max() -> usize {
    common::config_with(&[]).coll_p2p_max
}

use common::CommRank as Rank;

/// Rank `from`'s `k`-th message to rank `to` in `round`, `len` bytes.
fn message(from: usize, to: usize, round: u64, k: u64, len: usize) -> Vec<u8> {
    pattern(round * 10_000 + k * 100 + from as u64 * 10 + to as u64, len)
}

fn zeroed(len: usize) -> DeviceBuf {
    let b = DeviceBuf::new(len.max(1)).unwrap();
    b.fill(0).unwrap();
    b
}

fn send(buf: &DeviceBuf, off: usize, len: usize, peer: usize) -> PeerTransfer {
    PeerTransfer { op: PeerOp::Send, buf: buf.ptr() + off as u64, bytes: len, peer }
}

fn recv(buf: &DeviceBuf, off: usize, len: usize, peer: usize) -> PeerTransfer {
    PeerTransfer { op: PeerOp::Recv, buf: buf.ptr() + off as u64, bytes: len, peer }
}

/// An all-to-all's buffers for `round`: rank q's message at `off` of sends[q] and recvs[q].
struct AllToAll {
    sends: Vec<DeviceBuf>,
    recvs: Vec<DeviceBuf>,
    len: usize,
    off: usize,
}

impl AllToAll {
    fn new(r: &Rank, len: usize, off: usize) -> AllToAll {
        let n = r.n();
        AllToAll { sends: (0..n).map(|_| zeroed(off + len)).collect(), recvs: (0..n).map(|_| zeroed(off + len)).collect(), len, off }
    }
    fn fill(&self, r: &Rank, round: u64) {
        for (q, b) in self.sends.iter().enumerate() {
            let mut v = vec![0u8; self.off];
            v.extend(message(r.me(), q, round, 0, self.len));
            b.upload(&v).unwrap();
        }
    }
    /// The group: receives first on odd ranks, last on even ones.
    fn group(&self) -> Vec<PeerTransfer> {
        let sends = self.sends.iter().enumerate().map(|(q, b)| send(b, self.off, self.len, q));
        let recvs = self.recvs.iter().enumerate().map(|(q, b)| recv(b, self.off, self.len, q));
        sends.chain(recvs).collect()
    }
    fn group_for(&self, r: &Rank) -> Vec<PeerTransfer> {
        let mut g = self.group();
        if r.me() % 2 == 1 {
            g.reverse();
        }
        g
    }
    fn check(&self, r: &Rank, round: u64, what: &str, bad: &mut Vec<String>) {
        for (q, b) in self.recvs.iter().enumerate() {
            let got = b.download().unwrap();
            if got[self.off..self.off + self.len] != message(q, r.me(), round, 0, self.len)[..] {
                bad.push(format!("rank {}: {what}: {} B from rank {q} wrong (round {round})", r.me(), self.len));
            }
        }
    }
}

fn issue(r: &Rank, group: &[PeerTransfer], on: &Condition) {
    // SAFETY: every buffer outlives the synchronize that follows each group in these checks.
    unsafe { r.comm.transfers(group, on) }.unwrap();
}

/// All-to-all on the stream from 1 B to past the kernel's limit (the engine), aligned and at
/// an odd offset; and both paths in one group.
fn all_to_all_sizes(r: &Rank, bad: &mut Vec<String>) {
    // Chunks of 16 KiB up to 512 KiB, then growing to 64 KiB (cuda/coll_p2p.rs: chunk_bytes).
    let sizes = [1usize, 7, 4096, 16_384, 16_385, 65_536, 65_537, (512 << 10) + 1, (1 << 20) + 3, kernel_max(), kernel_max() + 1];
    for (round, len) in sizes.into_iter().enumerate() {
        for off in [0, 1] {
            let a = AllToAll::new(r, len, off);
            let round = round as u64 * 2 + off as u64;
            a.fill(r, round);
            issue(r, &a.group_for(r), &r.cond);
            r.sync();
            a.check(r, round, &format!("all-to-all at offset {off}"), bad);
        }
    }
    // Both paths in one group: the engine's message and the kernel's, to every rank.
    let big = AllToAll::new(r, kernel_max() + 5, 0);
    let small = AllToAll::new(r, 5, 0);
    big.fill(r, 50);
    small.fill(r, 50);
    let mut g = big.group_for(r);
    g.extend(small.group_for(r));
    issue(r, &g, &r.cond);
    r.sync();
    big.check(r, 50, "mixed group (engine part)", bad);
    small.check(r, 50, "mixed group (kernel part)", bad);
}

/// Two messages to every rank in one group (the second after the first in the pair's FIFO),
/// and a ring of 20 small messages each way: 40 operations, more than one launch carries.
fn several_per_pair(r: &Rank, bad: &mut Vec<String>) {
    let (me, n) = (r.me(), r.n());
    let lens = [100_003usize, 3];
    let sends: Vec<Vec<DeviceBuf>> = (0..n).map(|_| lens.iter().map(|&l| zeroed(l)).collect()).collect();
    let recvs: Vec<Vec<DeviceBuf>> = (0..n).map(|_| lens.iter().map(|&l| zeroed(l)).collect()).collect();
    let mut g = Vec::new();
    for q in 0..n {
        for (k, &len) in lens.iter().enumerate() {
            sends[q][k].upload(&message(me, q, 60, k as u64, len)).unwrap();
            g.push(send(&sends[q][k], 0, len, q));
            g.push(recv(&recvs[q][k], 0, len, q));
        }
    }
    issue(r, &g, &r.cond);
    r.sync();
    for q in 0..n {
        for (k, &len) in lens.iter().enumerate() {
            if recvs[q][k].download().unwrap() != message(q, me, 60, k as u64, len) {
                bad.push(format!("rank {me}: message {k} ({len} B) from rank {q} wrong"));
            }
        }
    }
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let outs: Vec<DeviceBuf> = (0..20).map(|k| zeroed(1000 + k)).collect();
    let ins: Vec<DeviceBuf> = (0..20).map(|k| zeroed(1000 + k)).collect();
    let mut g = Vec::new();
    for k in 0..20 {
        outs[k].upload(&message(me, next, 61, k as u64, 1000 + k)).unwrap();
        g.push(send(&outs[k], 0, 1000 + k, next));
        g.push(recv(&ins[k], 0, 1000 + k, prev));
    }
    issue(r, &g, &r.cond);
    r.sync();
    for (k, b) in ins.iter().enumerate() {
        if b.download().unwrap() != message(prev, me, 61, k as u64, 1000 + k) {
            bad.push(format!("rank {me}: ring message {k} from rank {prev} wrong (a group of 40 operations)"));
        }
    }
}

/// Messages to itself whose sends and receives do not balance in a group (every other part
/// balances them: one copy each): sends whose receives come in a later group wait in the
/// rank's own FIFO, and from then on every message to itself takes the FIFO, in order (the
/// k-th send pairs with the k-th receive) — a balanced group last.
fn self_messages(r: &Rank, bad: &mut Vec<String>) {
    let me = r.me();
    let lens = [5000usize, 70_000, 300, 1234];
    let outs: Vec<DeviceBuf> = lens.iter().map(|&l| zeroed(l)).collect();
    let ins: Vec<DeviceBuf> = lens.iter().map(|&l| zeroed(l)).collect();
    for (k, &len) in lens.iter().enumerate() {
        outs[k].upload(&message(me, me, 62, k as u64, len)).unwrap();
    }
    let groups: [Vec<PeerTransfer>; 3] = [
        vec![send(&outs[0], 0, lens[0], me), send(&outs[1], 0, lens[1], me)],
        vec![recv(&ins[0], 0, lens[0], me), recv(&ins[1], 0, lens[1], me), send(&outs[2], 0, lens[2], me), recv(&ins[2], 0, lens[2], me)],
        vec![recv(&ins[3], 0, lens[3], me), send(&outs[3], 0, lens[3], me)],
    ];
    for g in &groups {
        issue(r, g, &r.cond);
        r.sync();
    }
    for (k, &len) in lens.iter().enumerate() {
        if ins[k].download().unwrap() != message(me, me, 62, k as u64, len) {
            bad.push(format!("rank {me}: message {k} ({len} B) to itself wrong"));
        }
    }
}

/// A group captured from a stream, and one built on a graph condition: an all-to-all of 65,537
/// bytes and 6 MiB to the next rank (96 chunks: past the end of the pair's 64-slot FIFO),
/// replayed with new data. The captured one also copies a message to itself past the kernel's
/// limit (a copy on a side stream, forked and joined by events the capture takes in).
fn replays(r: &Rank, bad: &mut Vec<String>) {
    let (me, n) = (r.me(), r.n());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let a = AllToAll::new(r, 65_537, 0);
    let big_len = 6 << 20;
    let (big_out, big_in) = (zeroed(big_len), zeroed(big_len));
    let mut g = a.group_for(r);
    g.push(send(&big_out, 0, big_len, next));
    g.push(recv(&big_in, 0, big_len, prev));
    let self_len = kernel_max() + 3;
    let (self_out, self_in) = (zeroed(self_len), zeroed(self_len));
    let mut captured_group = g.clone();
    captured_group.push(recv(&self_in, 0, self_len, me));
    captured_group.push(send(&self_out, 0, self_len, me));
    let cap = Stream::new().unwrap();
    let cond = Condition::cuda(Category::Stream, cap.raw(), None).unwrap();
    cap.begin_capture().unwrap();
    issue(r, &captured_group, &cond);
    let captured = cap.end_capture().unwrap().instantiate().unwrap();
    let graph = Graph::new().unwrap();
    let gc = Condition::cuda(Category::Graph, graph.raw(), None).unwrap();
    // SAFETY: as `issue`.
    let nodes = unsafe { r.comm.transfers(&g, &gc) }.unwrap();
    if nodes.start_node == 0 || nodes.done_node == 0 {
        bad.push(format!("rank {me}: a graph condition gave no nodes: {nodes:?}"));
    }
    let built = graph.instantiate().unwrap();
    let t0 = Instant::now();
    const REPLAYS: u64 = 60;
    for round in 100..100 + REPLAYS {
        a.fill(r, round);
        big_out.upload(&message(me, next, round, 1, big_len)).unwrap();
        self_out.upload(&message(me, me, round, 2, self_len)).unwrap();
        if round % 2 == 0 { captured.launch(&r.stream) } else { built.launch(&r.stream) }.unwrap();
        r.sync();
        a.check(r, round, "replayed all-to-all", bad);
        if big_in.download().unwrap() != message(prev, me, round, 1, big_len) {
            bad.push(format!("rank {me}: replay {round}: 6 MiB from rank {prev} wrong"));
        }
        if round % 2 == 0 && self_in.download().unwrap() != message(me, me, round, 2, self_len) {
            bad.push(format!("rank {me}: replay {round}: {self_len} B to itself (a side-stream copy) wrong"));
        }
        if !bad.is_empty() {
            break;
        }
    }
    eprintln!("rank {me}: {REPLAYS} checked replays of a {n}-rank group in {:?}", t0.elapsed());
}

/// Bad input is refused with a named error before anything is issued: the good transfers in
/// front of a bad one do not run (a group with them alone then matches the peers' as usual).
fn bad_input(r: &Rank, bad: &mut Vec<String>) {
    let (me, n) = (r.me(), r.n());
    let b = zeroed(64);
    let mut expect = |what: &str, group: &[PeerTransfer], on: &Condition, status: Status, text: &str| {
        // SAFETY: refused before anything is issued (checked below by the exchange that follows).
        match unsafe { r.comm.transfers(group, on) } {
            Err(e) if e.status() == status && e.to_string().contains(text) => {}
            other => bad.push(format!("rank {me}: {what}: want {status:?} naming \"{text}\", got {other:?}")),
        }
    };
    let good = send(&b, 0, 8, (me + 1) % n);
    expect(
        "a peer out of range",
        &[good, send(&b, 0, 8, n)],
        &r.cond,
        Status::InvalidParam,
        &format!("transfer 1 (send): peer {n} of a communicator"),
    );
    let host = [0u8; 8];
    let host_send = PeerTransfer { op: PeerOp::Send, buf: host.as_ptr() as u64, bytes: 8, peer: 0 };
    expect("a host buffer", &[good, host_send], &r.cond, Status::InvalidParam, "transfer 1: the send buffer is not GPU memory");
    let pair = [good, send(&b, 0, 8, me), recv(&b, 8, 16, me)];
    expect(
        "a send to itself and its receive of different lengths",
        &pair,
        &r.cond,
        Status::InvalidParam,
        "transfer 1 (a send to this rank, 8 bytes) pairs with transfer 2",
    );
    let hs = HostStream::new().unwrap();
    let on_host = Condition::host_stream(&hs);
    expect("a host stream", &[good], &on_host, Status::Unsupported, "CUDA stream and graph conditions");
    // Nothing of the above reached the FIFOs: a plain ring exchange still pairs up.
    let a = AllToAll::new(r, 9, 0);
    a.fill(r, 70);
    issue(r, &a.group_for(r), &r.cond);
    r.sync();
    a.check(r, 70, "the exchange after refused groups", bad);
}

/// Wait (up to 20 s) for the communicator's asynchronous error: its text, or None.
fn async_error_within(comm: &Communicator) -> Option<(Status, String)> {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(20) {
        if let Err(e) = comm.async_error() {
            return Some((e.status(), e.to_string()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// On communicators split off with a 2 s timeout: rank 0 waits for a message rank 1 never
/// sends (the stream is released after the timeout, both report it), then rank 0 sends 100
/// bytes that rank 1 receives as 200 (both report it, the receiver saying why).
fn failures(r: &Rank, bad: &mut Vec<String>) {
    let me = r.me();
    let short = config_with(&[("GSC_TIMEOUT", "2s")]);
    let buf = zeroed(256);
    let silent = r.comm.split(Some(0), me as i32, &short).unwrap().unwrap();
    if me == 0 {
        let t0 = Instant::now();
        // SAFETY: `buf` outlives the synchronize.
        unsafe { silent.transfers(&[recv(&buf, 0, 64, 1)], &r.cond) }.unwrap();
        r.sync();
        let took = t0.elapsed();
        if !(Duration::from_millis(1900)..Duration::from_secs(10)).contains(&took) {
            bad.push(format!("rank 0: a receive nobody sends released the stream after {took:?} (timeout 2 s)"));
        }
    }
    if me < 2 {
        match async_error_within(&silent) {
            Some((Status::TimedOut, t)) if t.contains(&format!("rank {}", 1 - me)) => {}
            other => bad.push(format!("rank {me}: after the unanswered receive, want TimedOut naming the peer, got {other:?}")),
        }
    }
    let sizes = r.comm.split(Some(0), me as i32, &short).unwrap().unwrap();
    let group = match me {
        0 => vec![send(&buf, 0, 100, 1)],
        1 => vec![recv(&buf, 0, 200, 0)],
        _ => Vec::new(),
    };
    // SAFETY: `buf` outlives the synchronize.
    unsafe { sizes.transfers(&group, &r.cond) }.unwrap();
    r.sync();
    match (me, async_error_within(&sizes)) {
        (0, Some((Status::TimedOut, t))) if t.contains("rank 1") => {}
        (1, Some((Status::InvalidParam, t))) if t.contains("expected a different number of bytes") => {}
        (0 | 1, other) => bad.push(format!("rank {me}: after a 100 B send received as 200 B, got {other:?}")),
        _ => {}
    }
}

fn run_rank(rank: usize, n: usize, uid: &[u8]) -> String {
    set_device(gpu_of(rank)).unwrap();
    let uid = UniqueId::from_bytes(uid).unwrap();
    let boot = Bootstrap::init(&uid, rank as u32, n as u32, T).unwrap();
    let comm = Communicator::new(boot, gpu_of(rank), &config_with(&[("GSC_TIMEOUT", "30s")])).unwrap();
    let stream = Stream::new().unwrap();
    let cond = Condition::cuda(Category::Stream, stream.raw(), None).unwrap();
    let r = Rank { comm, stream, cond };
    let mut bad = Vec::new();
    let t0 = Instant::now();
    all_to_all_sizes(&r, &mut bad);
    several_per_pair(&r, &mut bad);
    replays(&r, &mut bad);
    bad_input(&r, &mut bad);
    // Last: once a group's messages to itself do not balance, they take the FIFO for good.
    self_messages(&r, &mut bad);
    eprintln!("rank {rank}: exact checks in {:?}", t0.elapsed());
    if let Err(e) = r.comm.async_error() {
        bad.push(format!("rank {rank}: the communicator reports {e} after the exact checks"));
    }
    if bad.is_empty() {
        failures(&r, &mut bad);
    }
    bad.join("\n")
}

fn roles(role: &str, chan: &dyn Chan, _ctx: Context) {
    let (rank, n) = role.strip_prefix("rank").unwrap().split_once("of").unwrap();
    let v = run_rank(rank.parse().unwrap(), n.parse().unwrap(), &chan.get("uid"));
    chan.put("result", v.as_bytes());
}

#[test]
fn send_recv_groups_exact_on_two_gpus() {
    if run_child_role(roles) {
        return;
    }
    run_rank_job("send_recv_groups_exact_on_two_gpus", 2, T, roles, run_rank);
}

#[test]
fn send_recv_groups_exact_on_four_gpus() {
    if run_child_role(roles) {
        return;
    }
    run_rank_job("send_recv_groups_exact_on_four_gpus", 4, T, roles, run_rank);
}
