//! Whole conversations between two engines over a simulated link, with simulated memory.
//! No processes, no threads, no clock: every interleaving is chosen by the test.

use super::*;
use crate::transport::LaneKind;
use std::collections::{HashMap, VecDeque};

/// A side's memory: buffers at fake, non-overlapping addresses.
#[derive(Default)]
struct Mem {
    bufs: Vec<(usize, Vec<u8>)>,
    next: usize,
}

impl Mem {
    fn alloc(&mut self, bytes: Vec<u8>) -> usize {
        let addr = 0x1000_0000 + self.next;
        self.next += bytes.len() + 4096;
        self.bufs.push((addr, bytes));
        addr
    }
    fn locate(&mut self, addr: usize, len: usize) -> Result<(&mut Vec<u8>, usize)> {
        for (base, v) in &mut self.bufs {
            if addr >= *base && addr + len <= *base + v.len() {
                return Ok((v, addr - *base));
            }
        }
        Err(Error::new(Status::OutOfRange, format!("no buffer at {addr:#x}+{len}")))
    }
    fn read(&mut self, addr: usize, len: usize) -> Vec<u8> {
        let (v, off) = self.locate(addr, len).expect("read inside a buffer");
        v[off..off + len].to_vec()
    }
    fn write(&mut self, addr: usize, data: &[u8]) {
        let (v, off) = self.locate(addr, data.len()).expect("write inside a buffer");
        v[off..off + data.len()].copy_from_slice(data);
    }
    fn get(&self, addr: usize) -> &Vec<u8> {
        &self.bufs.iter().find(|(b, _)| *b == addr).unwrap().1
    }
}

/// Registered regions for emulated RMA: region id -> (base, len).
#[derive(Default)]
struct Regions(HashMap<u64, (usize, usize)>);

impl RegionLookup for Regions {
    fn resolve(&self, region: u64, addr: u64, len: usize) -> Result<usize> {
        let (base, rlen) = *self.0.get(&region).ok_or_else(|| Error::new(Status::InvalidHandle, "unknown region"))?;
        let addr = addr as usize;
        if addr < base || addr + len > base + rlen {
            return Err(Error::new(Status::OutOfRange, "outside region"));
        }
        Ok(addr)
    }
}

struct Side {
    engine: Engine,
    mem: Mem,
    regions: Regions,
    done: HashMap<ReqId, (Status, RecvInfo)>,
}

/// Two sides joined by one link (conn 0 on each side), frames queued in both directions.
struct Pair {
    sides: [Side; 2],
    wire: [VecDeque<Vec<u8>>; 2],
    next_req: ReqId,
    /// Answer reads of (simulated) GPU memory with `remote_read_refused`.
    refuse_device_reads: bool,
    /// Device keys that reached a receiver's ReadRemote.
    keys_seen: Vec<Vec<u8>>,
    /// Fail direct writes of prepared transfers with this status.
    fail_writes: Option<Status>,
    /// Deliver eager-only frames for posted receives through `take_eager_only_match`, as the
    /// worker does; off, through `on_frame` like every other frame.
    eager_fast_path: bool,
    /// Simulated time (`fake_clock`) one host remote read takes, and one pushed data frame.
    read_cost_ns: u64,
    push_frame_cost_ns: u64,
    /// Host remote reads performed.
    host_reads: usize,
    /// Shared word pages by path: [ready, arrived]; which (side, preparation) maps which; a
    /// receiver's worker that refuses pages; frames transmitted so far.
    pages: HashMap<String, [u64; 2]>,
    mapped: HashMap<(usize, PrepId), String>,
    refuse_words: bool,
    frames_sent: usize,
}

thread_local! {
    static FAKE_NOW: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// The clock tests give the tag engine; the simulation advances it (`Pair::*_cost_ns`).
fn fake_clock() -> u64 {
    FAKE_NOW.with(|c| c.get())
}

fn advance_fake_clock(ns: u64) {
    FAKE_NOW.with(|c| c.set(c.get() + ns));
}

impl Pair {
    fn new(cfg: ProtoConfig, remote_memory: bool, max_frame: usize) -> Pair {
        // Under the Auto scheme `rndv_get` is chosen on loopback and `rndv_pipeline` on shm, so the
        // lane follows `remote_memory` to keep both rendezvous paths covered.
        let lane = if remote_memory { LaneKind::Loopback } else { LaneKind::Shm };
        let props = LaneProps { lane, max_frame, remote_memory, device_ipc: false };
        let mk = || {
            let mut engine = Engine::new(cfg);
            engine.add_conn(0, props, 0);
            Side { engine, mem: Mem::default(), regions: Regions::default(), done: HashMap::new() }
        };
        Pair {
            sides: [mk(), mk()],
            wire: [VecDeque::new(), VecDeque::new()],
            next_req: 1,
            refuse_device_reads: false,
            keys_seen: Vec::new(),
            fail_writes: None,
            eager_fast_path: true,
            read_cost_ns: 0,
            push_frame_cost_ns: 0,
            host_reads: 0,
            pages: HashMap::new(),
            mapped: HashMap::new(),
            refuse_words: false,
            frames_sent: 0,
        }
    }

    /// A pair on a shm lane whose peers can read each other's memory (CMA), where Auto lets the
    /// receiver choose between reading and asking for a push.
    fn shm_with_remote_memory(cfg: ProtoConfig, max_frame: usize) -> Pair {
        let mut p = Pair::new(cfg, true, max_frame);
        let props = LaneProps { lane: LaneKind::Shm, max_frame, remote_memory: true, device_ipc: false };
        for side in &mut p.sides {
            side.engine = Engine::new(cfg);
            side.engine.add_conn(0, props, 0);
        }
        p
    }

    fn req(&mut self) -> ReqId {
        self.next_req += 1;
        self.next_req
    }

    /// Execute actions produced by side `s` (with `frame` the payload being handled, if any).
    fn run(&mut self, s: usize, actions: Actions, frame: Option<&[u8]>) {
        let mut followups = Vec::new();
        for a in actions {
            match a {
                Action::Transmit { frame: f, .. } => {
                    self.frames_sent += 1;
                    let f = f.0;
                    let mut bytes = f.header.as_bytes().to_vec();
                    match &f.payload {
                        Payload::None => {}
                        Payload::User { addr, len } => bytes.extend(self.sides[s].mem.read(*addr, *len)),
                        // Simulated "device" memory is plain memory here; the worker stages it.
                        Payload::Device { addr, len } => bytes.extend(self.sides[s].mem.read(*addr, *len)),
                        Payload::Owned(v) => bytes.extend_from_slice(v),
                        Payload::Staged { .. } => panic!("the engine never emits staged payloads (the worker makes them)"),
                    }
                    self.wire[s].push_back(bytes);
                    if let Some(req) = f.on_sent {
                        let mut out = Actions::new();
                        self.sides[s].engine.frame_sent(&mut out, req);
                        followups.push(out);
                    }
                }
                Action::CopyFromFrame { dst, src_offset, len, .. } => {
                    let payload = frame.expect("copy from a frame while handling one");
                    self.sides[s].mem.write(dst, &payload[src_offset..src_offset + len]);
                }
                Action::CopyOwned { dst, data, .. } => self.sides[s].mem.write(dst, &data),
                Action::ReadRemote { device_key: Some(key), req, .. } if self.refuse_device_reads => {
                    self.keys_seen.push(key);
                    let mut out = Actions::new();
                    self.sides[s].engine.tag.remote_read_refused(&mut out, req);
                    followups.push(out);
                }
                Action::ReadRemote { dst, remote, len, req, device_key, .. } => {
                    if device_key.is_none() {
                        self.host_reads += 1;
                        advance_fake_clock(self.read_cost_ns);
                        self.sides[s].engine.tag.remote_read_took(req, self.read_cost_ns);
                    }
                    self.keys_seen.extend(device_key);
                    let peer = 1 - s;
                    let result = self.sides[peer].mem.locate(remote as usize, len).map(|(v, off)| v[off..off + len].to_vec());
                    let result = result.map(|data| self.sides[s].mem.write(dst.addr, &data));
                    let mut out = Actions::new();
                    self.sides[s].engine.tag.remote_read_done(&mut out, req, result);
                    followups.push(out);
                }
                Action::WriteRemote { src, remote, len, req, then, device_key, arrived_word, .. } => {
                    self.keys_seen.extend(device_key.map(|k| k.to_vec()));
                    let mut out = Actions::new();
                    match self.fail_writes {
                        Some(Status::Unsupported) => self.sides[s].engine.prepared.direct_refused(&mut out, req, src, len),
                        Some(status) => self.sides[s].engine.prepared.write_failed(&mut out, req, status),
                        None => {
                            let data = self.sides[s].mem.read(src, len);
                            self.sides[1 - s].mem.write(remote as usize, &data);
                            match arrived_word {
                                Some((id, round)) => {
                                    let page = self.pages.get_mut(&self.mapped[&(s, id)]).expect("the sender's page");
                                    page[1] = page[1].max(round);
                                    self.sides[s].engine.prepared.frame_sent(&mut out, req);
                                }
                                None => out.push(Action::Transmit { conn: 0, frame: *then }),
                            }
                        }
                    }
                    followups.push(out);
                }
                Action::Complete { req, status, info } => {
                    assert!(self.sides[s].done.insert(req, (status, info)).is_none(), "request {req} completed twice");
                }
                Action::MapWords { id, path } => {
                    if self.refuse_words || !self.pages.contains_key(&*path) {
                        let mut out = Actions::new();
                        self.sides[s].engine.prepared.words_refused(&mut out, id);
                        followups.push(out);
                    } else {
                        self.mapped.insert((s, id), path.to_string());
                    }
                }
                Action::RaiseReady { id, round } => {
                    if let Some(page) = self.mapped.get(&(s, id)).and_then(|p| self.pages.get_mut(p)) {
                        page[0] = page[0].max(round);
                    }
                }
            }
        }
        for out in followups {
            self.run(s, out, None);
        }
    }

    /// Deliver frames and report moved shared words until nothing moves any more.
    fn pump(&mut self) {
        loop {
            self.pump_frames();
            if !self.poll_words() {
                break;
            }
        }
    }

    /// What a worker's pass does with its mapped pages: report each peer-written word.
    fn poll_words(&mut self) -> bool {
        let mut moved = false;
        let mut mapped: Vec<_> = self.mapped.iter().map(|(k, v)| (*k, v.clone())).collect();
        mapped.sort();
        for ((s, id), path) in mapped {
            let page = self.pages[&path];
            let mut out = Actions::new();
            let dir = self.sides[s].engine.prepared.spec(id).map(|sp| sp.dir);
            let before = out.len();
            match dir {
                Some(PrepDir::Send) => self.sides[s].engine.prepared.ready_word(&mut out, id, page[0]).expect("honest ready word"),
                Some(PrepDir::Recv) => self.sides[s].engine.prepared.arrived_word(&mut out, id, page[1]).expect("honest arrived word"),
                None => continue,
            }
            if out.len() > before {
                moved = true;
                self.run(s, out, None);
            }
        }
        moved || self.frames_in_flight() > 0
    }

    /// Deliver frames until both directions are empty.
    fn pump_frames(&mut self) {
        while let Some((to, f)) = self.wire[0].pop_front().map(|f| (1, f)).or_else(|| self.wire[1].pop_front().map(|f| (0, f))) {
            let mut out = Actions::new();
            let side = &mut self.sides[to];
            if self.eager_fast_path
                && let Some((d, data)) = side.engine.tag.take_eager_only_match(&f)
            {
                assert!(data.len() <= d.buf.len, "the fast path clips to the buffer");
                if !data.is_empty() {
                    side.mem.write(d.buf.addr, data);
                }
                assert!(side.done.insert(d.req, (d.status, d.info)).is_none(), "request {} completed twice", d.req);
                continue;
            }
            if f.first() == Some(&wire::kind::RNDV_DATA) {
                advance_fake_clock(self.push_frame_cost_ns);
            }
            let outcome = side.engine.on_frame(&mut out, 0, &f, &side.regions).expect("frame accepted");
            assert_eq!(outcome, FrameOutcome::Handled);
            let (_, payload) = wire::Header::decode(&f).unwrap();
            let payload = payload.to_vec();
            self.run(to, out, Some(&payload));
        }
    }

    fn send(&mut self, data: &[u8], tag: u64) -> ReqId {
        let req = self.req();
        let addr = self.sides[0].mem.alloc(data.to_vec());
        let mut out = Actions::new();
        self.sides[0].engine.tag.send(&mut out, 0, req, tag, UserBuf::host(addr, data.len()), None).unwrap();
        self.run(0, out, None);
        req
    }

    /// Side 1's buffer at `addr` holds `data`, and its guard bytes after it are untouched.
    fn check_received(&self, addr: usize, data: &[u8], ctx: &str) {
        let got = self.sides[1].mem.get(addr);
        assert_eq!(&got[..data.len()], data, "{ctx}");
        assert!(got[data.len()..].iter().all(|b| *b == 0xEE), "{ctx}: guard bytes written");
    }

    /// Post a receive of `len` bytes into a buffer with a 64-byte guard after it; returns
    /// (request, buffer address).
    fn recv(&mut self, len: usize, tag: u64, mask: u64) -> (ReqId, usize) {
        let req = self.req();
        let addr = self.sides[1].mem.alloc(vec![0xEE; len + 64]);
        let mut out = Actions::new();
        self.sides[1].engine.tag.recv(&mut out, req, tag, mask, UserBuf::host(addr, len));
        self.run(1, out, None);
        (req, addr)
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn cfg() -> ProtoConfig {
    ProtoConfig { eager_short_max: 128, rndv_thresh: 4096, rndv_scheme: RndvScheme::Auto }
}

#[test]
fn sizes_around_every_threshold_arrive_intact_on_both_rendezvous_schemes() {
    for remote_memory in [true, false] {
        for size in [0, 1, 127, 128, 129, 1000, 4095, 4096, 4097, 100_000, 1 << 20] {
            for recv_first in [true, false] {
                let mut p = Pair::new(cfg(), remote_memory, 1024);
                let data = pattern(size, size as u8);
                let (r, s);
                if recv_first {
                    r = p.recv(size, 9, u64::MAX);
                    s = p.send(&data, 9);
                } else {
                    s = p.send(&data, 9);
                    p.pump();
                    r = p.recv(size, 9, u64::MAX);
                }
                p.pump();
                let ctx = format!("size {size} remote {remote_memory} recv_first {recv_first}");
                assert_eq!(p.sides[0].done.get(&s).map(|d| d.0), Some(Status::Ok), "{ctx}");
                assert_eq!(p.sides[1].done.get(&r.0), Some(&(Status::Ok, RecvInfo { tag: 9, length: size })), "{ctx}");
                p.check_received(r.1, &data, &ctx);
                assert_eq!(p.sides[0].engine.in_flight() + p.sides[1].engine.in_flight(), 0, "{ctx}");
            }
        }
    }
}

#[test]
fn truncation_writes_nothing_past_the_buffer_on_every_protocol() {
    for remote_memory in [true, false] {
        for (msg, buf) in [(100, 50), (1024, 512), (3000, 512), (10_000, 512), (10_000, 0)] {
            let mut p = Pair::new(cfg(), remote_memory, 1024);
            let data = pattern(msg, 3);
            let s = p.send(&data, 1);
            let (r, addr) = p.recv(buf, 1, u64::MAX);
            p.pump();
            let ctx = format!("msg {msg} buf {buf} remote {remote_memory}");
            assert_eq!(p.sides[1].done[&r], (Status::MessageTruncated, RecvInfo { tag: 1, length: msg }), "{ctx}");
            assert_eq!(p.sides[0].done[&s].0, Status::Ok, "{ctx}: truncation is the receiver's error only");
            let got = p.sides[1].mem.get(addr);
            assert_eq!(&got[..buf], &data[..buf], "{ctx}");
            assert!(got[buf..].iter().all(|b| *b == 0xEE), "{ctx}: wrote past the buffer");
        }
    }
}

#[test]
fn messages_that_match_one_receive_are_taken_in_send_order() {
    let mut p = Pair::new(cfg(), true, 1024);
    // Mixed protocols with the same tag: eager-short, eager-copy (fragmented), rendezvous.
    let sizes = [8, 2000, 9000, 16, 5000];
    for (i, n) in sizes.iter().enumerate() {
        p.send(&pattern(*n, i as u8), 42);
    }
    p.pump();
    for (i, n) in sizes.iter().enumerate() {
        let (r, addr) = p.recv(10_000, 0, 0); // wildcard
        p.pump();
        assert_eq!(p.sides[1].done[&r], (Status::Ok, RecvInfo { tag: 42, length: *n }), "message {i}");
        assert_eq!(&p.sides[1].mem.get(addr)[..*n], &pattern(*n, i as u8)[..]);
    }
}

#[test]
fn posted_wildcards_and_exact_receives_are_satisfied_in_post_order() {
    // The eager-only fast path and the general frame path must agree.
    for fast in [true, false] {
        let mut p = Pair::new(cfg(), true, 1024);
        p.eager_fast_path = fast;
        let (a, abuf) = p.recv(64, 0x100, 0xF00); // matches 0x1??
        let (b, _) = p.recv(64, 0x105, u64::MAX);
        let (c, _) = p.recv(64, 0, 0);
        let (d, dbuf) = p.recv(4, 0x7, u64::MAX);
        p.send(b"first", 0x105);
        p.send(b"second", 0x105);
        p.send(b"third", 0x999);
        p.send(b"truncated", 0x7);
        p.send(b"nobody", 0x8);
        p.pump();
        assert_eq!(p.sides[1].done[&a].1.length, 5, "oldest matching receive takes the first message (fast {fast})");
        p.check_received(abuf, b"first", "first message");
        assert_eq!(p.sides[1].done[&b].1.length, 6);
        assert_eq!(p.sides[1].done[&c].1, RecvInfo { tag: 0x999, length: 5 });
        assert_eq!(p.sides[1].done[&d], (Status::MessageTruncated, RecvInfo { tag: 0x7, length: 9 }));
        p.check_received(dbuf, b"trun", "nothing past the buffer is written");
        assert_eq!(p.sides[1].engine.tag.unexpected_len(), 1, "an unmatched message stays unexpected");
        let (e, ebuf) = p.recv(64, 0x8, u64::MAX);
        assert_eq!(p.sides[1].done[&e], (Status::Ok, RecvInfo { tag: 0x8, length: 6 }));
        p.check_received(ebuf, b"nobody", "unexpected message");
    }
}

/// Under Auto on shm the receiver tries reading and pushing, then keeps to the one it measured
/// faster, and turns when conditions change; the data is right whichever way it went.
#[test]
fn shm_rendezvous_takes_the_way_measured_faster() {
    let mut p = Pair::shm_with_remote_memory(cfg(), 4096);
    p.sides[1].engine.tag.set_clock(fake_clock);
    let len = 64 * 1024; // 16 pushed frames
    let exchange = |p: &mut Pair, n: usize| -> usize {
        let before = p.host_reads;
        for i in 0..n {
            let data = pattern(len, i as u8);
            let (r, addr) = p.recv(len, 5, u64::MAX);
            let s = p.send(&data, 5);
            p.pump();
            assert_eq!(p.sides[1].done[&r].0, Status::Ok);
            assert_eq!(p.sides[0].done[&s].0, Status::Ok);
            p.check_received(addr, &data, "rendezvous data");
        }
        p.host_reads - before
    };
    // Pushing is cheap (16 x 1 us), reading dear (1 ms): after two tries of each, pushes win
    // (an exploring read comes only every 64th decision).
    p.read_cost_ns = 1_000_000;
    p.push_frame_cost_ns = 1_000;
    assert_eq!(exchange(&mut p, 36), 2, "only the warm-up reads");
    // Conditions change: reading becomes cheap, pushing dear. Pushes measure slower than the
    // reads did, so reads take over.
    p.read_cost_ns = 1_000;
    p.push_frame_cost_ns = 1_000_000;
    let reads = exchange(&mut p, 48);
    assert!(reads >= 40, "reads should take over once measured faster, got {reads} of 48");
    // The knob still forces a way: Pipeline never reads.
    let mut forced = Pair::shm_with_remote_memory(ProtoConfig { rndv_scheme: RndvScheme::Pipeline, ..cfg() }, 4096);
    assert_eq!(exchange(&mut forced, 3), 0);
}

#[test]
fn cancel_only_unmatched_receives() {
    let mut p = Pair::new(cfg(), false, 1024);
    let (r, _) = p.recv(64, 1, u64::MAX);
    let mut out = Actions::new();
    p.sides[1].engine.tag.cancel(&mut out, r).unwrap();
    p.run(1, out, None);
    assert_eq!(p.sides[1].done[&r].0, Status::Canceled);
    // A message sent later is unexpected, not delivered to the canceled receive.
    p.send(b"x", 1);
    p.pump();
    assert_eq!(p.sides[1].engine.tag.unexpected_len(), 1);
    // A receive matched to a rendezvous in progress cannot be canceled.
    let s = p.send(&pattern(8000, 1), 2);
    p.pump();
    let (r2, _) = p.recv(8000, 2, u64::MAX);
    let mut out = Actions::new();
    let e = p.sides[1].engine.tag.cancel(&mut out, r2).unwrap_err();
    assert_eq!(e.status(), Status::Busy);
    p.pump();
    assert_eq!(p.sides[1].done[&r2].0, Status::Ok);
    assert_eq!(p.sides[0].done[&s].0, Status::Ok);
    let mut out = Actions::new();
    assert_eq!(p.sides[1].engine.tag.cancel(&mut out, 12345).unwrap_err().status(), Status::InvalidHandle);
}

#[test]
fn probe_then_receive_the_probed_message_even_while_it_is_arriving() {
    let mut p = Pair::new(cfg(), true, 256);
    let data = pattern(3000, 5); // eager-copy, 12+ fragments
    p.send(&data, 77);
    // Deliver only the first fragment, then probe.
    let first = p.wire[0].pop_front().unwrap();
    let mut out = Actions::new();
    p.sides[1].engine.on_frame(&mut out, 0, &first, &Regions::default()).unwrap();
    p.run(1, out, None);
    let peek = p.sides[1].engine.tag.probe(0, 0, false).unwrap();
    assert_eq!(peek, ProbeInfo { tag: 77, length: 3000, msg: None });
    let taken = p.sides[1].engine.tag.probe(77, u64::MAX, true).unwrap();
    let msg = taken.msg.unwrap();
    assert!(p.sides[1].engine.tag.probe(0, 0, false).is_none(), "a removed message no longer matches");
    p.pump(); // the rest arrives into the probed message
    let req = p.req();
    let addr = p.sides[1].mem.alloc(vec![0; 3000]);
    let mut out = Actions::new();
    p.sides[1].engine.tag.msg_recv(&mut out, req, msg, UserBuf::host(addr, 3000)).unwrap();
    p.run(1, out, None);
    assert_eq!(p.sides[1].done[&req].0, Status::Ok);
    assert_eq!(p.sides[1].mem.get(addr), &data);
    let mut out = Actions::new();
    assert_eq!(p.sides[1].engine.tag.msg_recv(&mut out, 999, msg, UserBuf::host(addr, 1)).unwrap_err().status(), Status::InvalidHandle);
}

#[test]
fn a_failed_link_fails_everything_that_needs_it_and_keeps_complete_messages() {
    let mut p = Pair::new(cfg(), false, 1024);
    let complete = p.send(b"complete", 1);
    let big = p.send(&pattern(50_000, 1), 2); // rendezvous, waits for RTR
    p.pump();
    let (r_big, _) = p.recv(50_000, 2, u64::MAX); // matched; RTR sent, data not yet back
    // Sender side learns the link died before it saw the RTR.
    let mut out = Actions::new();
    p.sides[0].engine.conn_failed(&mut out, 0, Status::PeerFailed);
    p.run(0, out, None);
    assert_eq!(p.sides[0].done[&big].0, Status::PeerFailed);
    assert_eq!(p.sides[0].done[&complete].0, Status::Ok);
    let mut out = Actions::new();
    p.sides[1].engine.conn_failed(&mut out, 0, Status::PeerFailed);
    p.run(1, out, None);
    assert_eq!(p.sides[1].done[&r_big].0, Status::PeerFailed);
    // The fully received eager message is still there to be received.
    let (r, _) = p.recv(64, 1, u64::MAX);
    assert_eq!(p.sides[1].done[&r], (Status::Ok, RecvInfo { tag: 1, length: 8 }));
    assert_eq!(p.sides[1].engine.in_flight(), 0);
}

#[test]
fn emulated_put_get_and_flush_check_the_target_region() {
    let mut p = Pair::new(cfg(), false, 256);
    let target = p.sides[1].mem.alloc(vec![0; 4096]);
    p.sides[1].regions.0.insert(7, (target, 4096));
    let src_data = pattern(3000, 9);
    let src = p.sides[0].mem.alloc(src_data.clone());
    let (put, flush) = (p.req(), p.req());
    let mut out = Actions::new();
    p.sides[0].engine.rma.put(&mut out, 0, put, 7, (target + 100) as u64, UserBuf::host(src, 3000), 256);
    p.sides[0].engine.rma.flush(&mut out, 0, flush);
    p.run(0, out, None);
    p.pump();
    assert_eq!(p.sides[0].done[&put].0, Status::Ok);
    assert_eq!(p.sides[0].done[&flush].0, Status::Ok);
    assert_eq!(&p.sides[1].mem.get(target)[100..3100], &src_data[..]);

    let dst = p.sides[0].mem.alloc(vec![0; 3000]);
    let get = p.req();
    let mut out = Actions::new();
    p.sides[0].engine.rma.get(&mut out, 0, get, 7, (target + 100) as u64, UserBuf::host(dst, 3000));
    p.run(0, out, None);
    p.pump();
    assert_eq!(p.sides[0].done[&get].0, Status::Ok);
    assert_eq!(p.sides[0].mem.get(dst), &src_data);

    // Out of the region: the get fails, the put is refused and reported by the next flush.
    let (bad_get, bad_put, flush2) = (p.req(), p.req(), p.req());
    let mut out = Actions::new();
    p.sides[0].engine.rma.get(&mut out, 0, bad_get, 7, (target + 4000) as u64, UserBuf::host(dst, 200));
    p.sides[0].engine.rma.put(&mut out, 0, bad_put, 7, (target + 4000) as u64, UserBuf::host(src, 200), 256);
    p.sides[0].engine.rma.flush(&mut out, 0, flush2);
    p.run(0, out, None);
    p.pump();
    assert_eq!(p.sides[0].done[&bad_get].0, Status::OutOfRange);
    assert_eq!(p.sides[0].done[&flush2].0, Status::OutOfRange);
    assert!(p.sides[1].mem.get(target)[3100..].iter().all(|b| *b == 0), "refused put wrote nothing");
}

#[test]
fn protocol_violations_are_errors_not_panics() {
    let mut e = Engine::new(cfg());
    e.add_conn(0, LaneProps { lane: LaneKind::Shm, max_frame: 1024, remote_memory: false, device_ipc: false }, 0);
    let regions = Regions::default();
    let mut out = Actions::new();
    let frames: Vec<Vec<u8>> = vec![
        vec![],
        vec![99; 16],
        wire::Header::EagerNext { msg_id: 5, offset: 0 }.encode().as_bytes().to_vec(),
        wire::Header::RndvData { rreq: 5, offset: 0 }.encode().as_bytes().to_vec(),
        wire::Header::GetData { req: 5, offset: 0, status: 0 }.encode().as_bytes().to_vec(),
        {
            let mut f = wire::Header::EagerFirst { tag: 1, msg_id: 1, total: 4 }.encode().as_bytes().to_vec();
            f.extend_from_slice(&[0; 8]); // more data than the message
            f
        },
    ];
    for f in frames {
        let err = e.on_frame(&mut out, 0, &f, &regions).unwrap_err();
        assert_eq!(err.status(), Status::ConnectionReset, "{err}");
    }
    // Stray completions for unknown requests are ignored.
    for f in [wire::Header::Ats { sreq: 5, status: 0 }, wire::Header::FlushAck { id: 5, status: 0 }] {
        e.on_frame(&mut out, 0, f.encode().as_bytes(), &regions).unwrap();
    }
    assert!(out.is_empty());
}

#[test]
fn ten_thousand_requests_in_flight() {
    let mut p = Pair::new(cfg(), true, 1024);
    let mut recvs = Vec::new();
    for i in 0..10_000u64 {
        recvs.push(p.recv(16, i % 97, u64::MAX));
    }
    let mut sends = Vec::new();
    for i in 0..10_000u64 {
        sends.push(p.send(&i.to_le_bytes(), i % 97));
    }
    p.pump();
    // Per tag, the k-th receive got the k-th message with that tag.
    let mut per_tag: HashMap<u64, Vec<u64>> = HashMap::new();
    for i in 0..10_000u64 {
        per_tag.entry(i % 97).or_default().push(i);
    }
    let mut seen: HashMap<u64, usize> = HashMap::new();
    for (i, (r, addr)) in recvs.iter().enumerate() {
        let tag = i as u64 % 97;
        let k = seen.entry(tag).or_default();
        assert_eq!(p.sides[1].done[r].0, Status::Ok);
        let got = u64::from_le_bytes(p.sides[1].mem.get(*addr)[..8].try_into().unwrap());
        assert_eq!(got, per_tag[&tag][*k]);
        *k += 1;
    }
    assert!(sends.iter().all(|s| p.sides[0].done[s].0 == Status::Ok));
}

#[test]
fn a_duplicated_fragment_is_a_protocol_error_not_an_early_completion() {
    for size in [3000usize, 100_000] {
        // 3000 B: eager-copy fragments; 100 KB over the pipeline: rendezvous data frames.
        let mut p = Pair::new(ProtoConfig { rndv_thresh: 4096, ..cfg() }, false, 1024);
        let (r, _) = p.recv(size, 1, u64::MAX);
        p.send(&pattern(size, 1), 1);
        // Deliver until the receive is being fed data frames, then replay one of them.
        let mut replayed = false;
        while let Some(f) = p.wire[0].pop_front() {
            let (h, _) = wire::Header::decode(&f).unwrap();
            let is_data = matches!(h, wire::Header::EagerNext { .. } | wire::Header::RndvData { .. });
            let mut out = Actions::new();
            p.sides[1].engine.on_frame(&mut out, 0, &f, &Regions::default()).unwrap();
            let payload = wire::payload_of(&f).to_vec();
            p.run(1, out, Some(&payload));
            if is_data && !replayed {
                let mut out = Actions::new();
                let err = p.sides[1].engine.on_frame(&mut out, 0, &f, &Regions::default()).unwrap_err();
                assert_eq!(err.status(), Status::ConnectionReset, "size {size}: {err}");
                replayed = true;
            }
            while let Some(back) = p.wire[1].pop_front() {
                let mut out = Actions::new();
                p.sides[0].engine.on_frame(&mut out, 0, &back, &Regions::default()).unwrap();
                p.run(0, out, None);
            }
        }
        assert!(replayed, "size {size}: no data frame seen");
        assert!(p.sides[1].done.get(&r).is_none_or(|d| d.0 == Status::Ok), "size {size}");
    }
}

/// GPU buffers: the RTS carries the sender's key to the receiver's read at every size; a receiver
/// that cannot use it asks for a push, and the data arrives in frames (staged by the worker).
#[test]
fn device_rendezvous_reads_through_the_key_or_falls_back_to_a_push() {
    for refuse in [false, true] {
        for len in [1usize, 8, 5000, 70_000] {
            let mut p = Pair::new(cfg(), false, 1024);
            for side in &mut p.sides {
                side.engine.add_conn(0, LaneProps { lane: LaneKind::Shm, max_frame: 1024, remote_memory: false, device_ipc: true }, 0);
            }
            p.refuse_device_reads = refuse;
            let data = pattern(len, 3);
            let sreq = p.req();
            let saddr = p.sides[0].mem.alloc(data.clone());
            let sbuf = UserBuf { addr: saddr, len, mem: MemType::Cuda };
            assert_eq!(p.sides[0].engine.tag.protocol_for(0, sbuf).unwrap(), ProtoId::RndvGet);
            let mut out = Actions::new();
            let key = b"opaque device key".to_vec();
            p.sides[0].engine.tag.send(&mut out, 0, sreq, 9, sbuf, Some(key.clone())).unwrap();
            p.run(0, out, None);
            let rreq = p.req();
            let raddr = p.sides[1].mem.alloc(vec![0; len]);
            let mut out = Actions::new();
            p.sides[1].engine.tag.recv(&mut out, rreq, 9, u64::MAX, UserBuf { addr: raddr, len, mem: MemType::Cuda });
            p.run(1, out, None);
            p.pump();
            assert_eq!(p.keys_seen, vec![key.clone()], "refuse={refuse} len={len}");
            assert_eq!(p.sides[1].done[&rreq], (Status::Ok, RecvInfo { tag: 9, length: len }), "refuse={refuse} len={len}");
            assert_eq!(p.sides[0].done[&sreq].0, Status::Ok, "refuse={refuse} len={len}");
            assert_eq!(p.sides[1].mem.get(raddr), &data, "refuse={refuse} len={len}");
        }
    }
}

/// A host-memory RTS offering a CMA read is never read into a GPU buffer (the kernel cannot
/// write device memory): the receiver asks for a push.
#[test]
fn host_rts_into_a_gpu_buffer_is_pushed() {
    let mut p = Pair::new(ProtoConfig { rndv_scheme: RndvScheme::Get, ..cfg() }, true, 1024);
    let data = pattern(10_000, 5);
    let sreq = p.send(&data, 4);
    let rreq = p.req();
    let raddr = p.sides[1].mem.alloc(vec![0; data.len()]);
    let mut out = Actions::new();
    p.sides[1].engine.tag.recv(&mut out, rreq, 4, u64::MAX, UserBuf { addr: raddr, len: data.len(), mem: MemType::Cuda });
    assert!(!out.iter().any(|a| matches!(a, Action::ReadRemote { .. })));
    p.run(1, out, None);
    p.pump();
    assert!(p.keys_seen.is_empty());
    assert_eq!(p.sides[1].done[&rreq].0, Status::Ok);
    assert_eq!(p.sides[0].done[&sreq].0, Status::Ok);
    assert_eq!(p.sides[1].mem.get(raddr), &data);
}

// ---- prepared transfers -------------------------------------------------------------------

use prepared::{PrepDir, PrepId, PrepSpec};
use select::EngineOffer;

impl Pair {
    /// Prepare on side `s` a transfer of `len` bytes (buffer filled with 0xEE plus a 64-byte
    /// guard); returns (id, buffer address).
    fn prepare(&mut self, s: usize, dir: PrepDir, len: usize, tag: u64, partitions: Option<usize>) -> (PrepId, usize) {
        let addr = self.sides[s].mem.alloc(vec![0xEE; len + 64]);
        let mut out = Actions::new();
        let spec = PrepSpec { dir, conn: 0, tag, buf: UserBuf::host(addr, len), partitions, engine: EngineOffer::Proxy };
        let id = self.sides[s].engine.prepared.prepare(&mut out, spec, None, None).unwrap();
        self.run(s, out, None);
        (id, addr)
    }

    fn pstart(&mut self, s: usize, id: PrepId) -> ReqId {
        let req = self.req();
        let mut out = Actions::new();
        self.sides[s].engine.prepared.start(&mut out, id, req, false, None).unwrap();
        self.run(s, out, None);
        req
    }

    fn pready(&mut self, id: PrepId, part: usize) {
        let mut out = Actions::new();
        self.sides[0].engine.prepared.pready(&mut out, id, part).unwrap();
        self.run(0, out, None);
    }

    fn frames_in_flight(&self) -> usize {
        self.wire[0].len() + self.wire[1].len()
    }
}

#[test]
fn prepared_rounds_move_new_data_every_round_by_frames_and_by_direct_writes() {
    for remote_memory in [true, false] {
        for size in [0, 1, 1000, 4096, 100_000] {
            for recv_prepares_first in [true, false] {
                let ctx = format!("size {size} remote {remote_memory} recv first {recv_prepares_first}");
                let mut p = Pair::new(cfg(), remote_memory, 1024);
                let (recv, (send, saddr)) = if recv_prepares_first {
                    let r = p.prepare(1, PrepDir::Recv, size, 7, None);
                    (r, p.prepare(0, PrepDir::Send, size, 7, None))
                } else {
                    let s = p.prepare(0, PrepDir::Send, size, 7, None);
                    (p.prepare(1, PrepDir::Recv, size, 7, None), s)
                };
                p.pump();
                for round in 0..5u8 {
                    let data = pattern(size, round);
                    p.sides[0].mem.write(saddr, &data);
                    // Alternate who starts first: the data waits for readiness, never the reverse.
                    let (r, s) = if round % 2 == 0 {
                        let r = p.pstart(1, recv.0);
                        (r, p.pstart(0, send))
                    } else {
                        let s = p.pstart(0, send);
                        p.pump();
                        assert!(!p.sides[0].done.contains_key(&s), "{ctx}: sent before the receiver was ready");
                        (p.pstart(1, recv.0), s)
                    };
                    p.pump();
                    assert_eq!(p.sides[0].done.get(&s), Some(&(Status::Ok, RecvInfo { tag: 7, length: size })), "{ctx} round {round}");
                    assert_eq!(p.sides[1].done.get(&r), Some(&(Status::Ok, RecvInfo { tag: 7, length: size })), "{ctx} round {round}");
                    p.check_received(recv.1, &data, &format!("{ctx} round {round}"));
                }
                assert_eq!(p.sides[0].engine.in_flight() + p.sides[1].engine.in_flight(), 0, "{ctx}");
            }
        }
    }
}

#[test]
fn a_prepared_round_is_ready_plus_data_only() {
    // After pairing, one round of 100 bytes is exactly: ready (receiver -> sender) and one data
    // frame; a 64 KiB round on a lane with remote memory is ready + one frame after the write.
    for (remote_memory, size) in [(false, 100), (true, 65536)] {
        let mut p = Pair::new(cfg(), remote_memory, 1 << 20);
        let (send, _) = p.prepare(0, PrepDir::Send, size, 1, None);
        let (recv, _) = p.prepare(1, PrepDir::Recv, size, 1, None);
        p.pump();
        let r = p.pstart(1, recv);
        assert_eq!(p.wire[1].len(), 1, "one ready frame");
        p.pump();
        let s = p.pstart(0, send);
        assert_eq!(p.wire[0].len(), 1, "one data frame");
        let (h, payload) = wire::Header::decode(&p.wire[0][0]).unwrap();
        assert!(matches!(h, wire::Header::PrepData { .. }));
        assert_eq!(payload.len(), if remote_memory { 0 } else { size }, "direct writes carry no payload");
        p.pump();
        assert_eq!(p.sides[0].done[&s].0, Status::Ok);
        assert_eq!(p.sides[1].done[&r].0, Status::Ok);
    }
}

#[test]
fn partitions_readied_out_of_order_arrive_and_are_reported_per_partition() {
    for remote_memory in [true, false] {
        // Sender in 4 partitions of 2048 bytes, receiver in 2 of 4096: each receive partition
        // arrives when both sender partitions inside it did.
        let mut p = Pair::new(cfg(), remote_memory, 1024);
        let (send, saddr) = p.prepare(0, PrepDir::Send, 8192, 3, Some(4));
        let (recv, raddr) = p.prepare(1, PrepDir::Recv, 8192, 3, Some(2));
        p.pump();
        for round in 0..3u8 {
            let data = pattern(8192, round);
            p.sides[0].mem.write(saddr, &data);
            let r = p.pstart(1, recv);
            let s = p.pstart(0, send);
            p.pump();
            let arrived = |p: &mut Pair, q| p.sides[1].engine.prepared.parrived(recv, q).unwrap();
            assert!(!arrived(&mut p, 0) && !arrived(&mut p, 1), "nothing before pready");
            p.pready(send, 3);
            p.pump();
            assert!(!arrived(&mut p, 1), "half of receive partition 1");
            p.pready(send, 0);
            p.pready(send, 2);
            p.pump();
            assert!(arrived(&mut p, 1) && !arrived(&mut p, 0));
            assert!(!p.sides[1].done.contains_key(&r) && !p.sides[0].done.contains_key(&s));
            p.pready(send, 1);
            p.pump();
            assert_eq!(p.sides[1].done[&r].0, Status::Ok);
            assert_eq!(p.sides[0].done[&s].0, Status::Ok);
            assert!(arrived(&mut p, 0) && arrived(&mut p, 1), "after the round every partition has arrived");
            assert_eq!(&p.sides[1].mem.get(raddr)[..8192], &data[..]);
        }
        // Misuse is refused and changes nothing.
        let e = p.sides[0].engine.prepared.pready(&mut Actions::new(), send, 4).unwrap_err();
        assert_eq!(e.status(), Status::OutOfRange);
        p.pready(send, 1);
        let e = p.sides[0].engine.prepared.pready(&mut Actions::new(), send, 1).unwrap_err();
        assert_eq!(e.status(), Status::InvalidParam, "{e}");
        let e = p.sides[1].engine.prepared.pready(&mut Actions::new(), recv, 0).unwrap_err();
        assert_eq!(e.status(), Status::InvalidParam);
        let e = p.sides[0].engine.prepared.parrived(send, 0).unwrap_err();
        assert_eq!(e.status(), Status::InvalidParam);
    }
}

#[test]
fn prepared_pairs_follow_creation_order_per_tag_even_across_a_release_before_pairing() {
    let mut p = Pair::new(cfg(), false, 1024);
    let (s1, _) = p.prepare(0, PrepDir::Send, 8, 5, None);
    let (s2, s2addr) = p.prepare(0, PrepDir::Send, 8, 5, None);
    let (other, _) = p.prepare(0, PrepDir::Send, 8, 6, None);
    // Released before the receiver's hello arrived: it still consumes the first receive.
    let mut out = Actions::new();
    p.sides[0].engine.prepared.release(&mut out, s1).unwrap();
    p.run(0, out, None);
    let (r6, _) = p.prepare(1, PrepDir::Recv, 8, 6, None);
    let (r1, _) = p.prepare(1, PrepDir::Recv, 8, 5, None);
    let (r2, r2addr) = p.prepare(1, PrepDir::Recv, 8, 5, None);
    p.pump();
    p.sides[0].mem.write(s2addr, b"second!!");
    let rr = p.pstart(1, r2);
    let ss = p.pstart(0, s2);
    p.pump();
    assert_eq!(p.sides[0].done[&ss].0, Status::Ok);
    assert_eq!(p.sides[1].done[&rr].0, Status::Ok);
    assert_eq!(&p.sides[1].mem.get(r2addr)[..8], b"second!!");
    // The receive that paired with the released send fails clearly.
    let e = p.sides[1].engine.prepared.start(&mut Actions::new(), r1, 99, false, None).unwrap_err();
    assert_eq!(e.status(), Status::NotConnected, "{e}");
    let e = p.sides[0].engine.prepared.start(&mut Actions::new(), s1, 99, false, None).unwrap_err();
    assert_eq!(e.status(), Status::InvalidHandle);
    let _ = (other, r6);
}

#[test]
fn prepared_misuse_and_failures_end_rounds_with_clear_errors() {
    // A send larger than its receive: both sides' rounds fail with MessageTruncated.
    let mut p = Pair::new(cfg(), false, 1024);
    let (send, _) = p.prepare(0, PrepDir::Send, 100, 1, None);
    let (recv, _) = p.prepare(1, PrepDir::Recv, 50, 1, None);
    p.pump();
    for (s, id) in [(0, send), (1, recv)] {
        let e = p.sides[s].engine.prepared.start(&mut Actions::new(), id, 77, false, None).unwrap_err();
        assert_eq!(e.status(), Status::MessageTruncated, "{e}");
    }
    // Unequal partitions are refused at prepare time.
    let spec =
        PrepSpec { dir: PrepDir::Send, conn: 0, tag: 1, buf: UserBuf::host(0x1000, 10), partitions: Some(3), engine: EngineOffer::Proxy };
    assert_eq!(p.sides[0].engine.prepared.prepare(&mut Actions::new(), spec, None, None).unwrap_err().status(), Status::InvalidParam);

    // Busy: a second host start and a release while a round is in flight change nothing.
    let mut p = Pair::new(cfg(), false, 1024);
    let (send, _) = p.prepare(0, PrepDir::Send, 16, 2, None);
    let (recv, _) = p.prepare(1, PrepDir::Recv, 16, 2, None);
    p.pump();
    let r = p.pstart(1, recv);
    let mut out = Actions::new();
    assert_eq!(p.sides[1].engine.prepared.start(&mut out, recv, 99, false, None).unwrap_err().status(), Status::Busy);
    assert_eq!(p.sides[1].engine.prepared.release(&mut out, recv).unwrap_err().status(), Status::Busy);
    assert!(out.is_empty());
    let s = p.pstart(0, send);
    p.pump();
    assert_eq!((p.sides[0].done[&s].0, p.sides[1].done[&r].0), (Status::Ok, Status::Ok));
    // Released on one side: the other side's next round fails instead of waiting forever.
    let r = p.pstart(1, recv);
    let mut out = Actions::new();
    p.sides[0].engine.prepared.release(&mut out, send).unwrap();
    p.run(0, out, None);
    p.pump();
    assert_eq!(p.sides[1].done[&r].0, Status::NotConnected);
    assert_eq!(p.frames_in_flight(), 0);

    // A failed direct write fails both rounds.
    let mut p = Pair::new(cfg(), true, 1 << 20);
    p.fail_writes = Some(Status::IoError);
    let (send, _) = p.prepare(0, PrepDir::Send, 1 << 16, 3, None);
    let (recv, _) = p.prepare(1, PrepDir::Recv, 1 << 16, 3, None);
    p.pump();
    let r = p.pstart(1, recv);
    let s = p.pstart(0, send);
    p.pump();
    assert_eq!((p.sides[0].done[&s].0, p.sides[1].done[&r].0), (Status::IoError, Status::IoError));

    // A direct write that cannot start falls back to frames: the round succeeds.
    let mut p = Pair::new(cfg(), true, 1 << 12);
    p.fail_writes = Some(Status::Unsupported);
    let (send, saddr) = p.prepare(0, PrepDir::Send, 1 << 16, 3, Some(2));
    let (recv, raddr) = p.prepare(1, PrepDir::Recv, 1 << 16, 3, None);
    p.pump();
    let data = pattern(1 << 16, 4);
    p.sides[0].mem.write(saddr, &data);
    let r = p.pstart(1, recv);
    let s = p.pstart(0, send);
    p.pready(send, 1);
    p.pready(send, 0);
    p.pump();
    assert_eq!((p.sides[0].done[&s].0, p.sides[1].done[&r].0), (Status::Ok, Status::Ok));
    assert_eq!(&p.sides[1].mem.get(raddr)[..1 << 16], &data[..]);

    // A dead link fails the rounds in flight and breaks the preparation.
    let mut p = Pair::new(cfg(), false, 1024);
    let (send, _) = p.prepare(0, PrepDir::Send, 16, 4, None);
    let (recv, _) = p.prepare(1, PrepDir::Recv, 16, 4, None);
    p.pump();
    let r = p.pstart(1, recv);
    let mut out = Actions::new();
    p.sides[1].engine.conn_failed(&mut out, 0, Status::PeerFailed);
    p.run(1, out, None);
    assert_eq!(p.sides[1].done[&r].0, Status::PeerFailed);
    let _ = send;
    // A failed round is not reported as arrived.
    let mut p = Pair::new(cfg(), false, 1024);
    let (_send, _) = p.prepare(0, PrepDir::Send, 16, 5, Some(2));
    let (recv, _) = p.prepare(1, PrepDir::Recv, 16, 5, Some(2));
    p.pump();
    let r = p.pstart(1, recv);
    let mut out = Actions::new();
    p.sides[1].engine.conn_failed(&mut out, 0, Status::PeerFailed);
    p.run(1, out, None);
    assert_eq!(p.sides[1].done[&r].0, Status::PeerFailed);
    assert!(!p.sides[1].engine.prepared.parrived(recv, 0).unwrap());
}

#[test]
fn hostile_prepared_frames_are_protocol_errors() {
    let mut p = Pair::new(cfg(), false, 1024);
    let (_send, _) = p.prepare(0, PrepDir::Send, 16, 1, None);
    let (recv, _) = p.prepare(1, PrepDir::Recv, 16, 1, None);
    p.pump();
    let peer_id = recv; // the id side 0 names in its frames
    // (Data before the receiver is ready is covered by the "no round is ready" check: no start.)
    let mut out = Actions::new();
    let early = wire::Header::PrepData { id: peer_id, round: 1, offset: 0, len: 0, flags: wire::PREP_LAST, status: 0 };
    let e = p.sides[1].engine.on_frame(&mut out, 0, early.encode().as_bytes(), &p.sides[1].regions).unwrap_err();
    assert_eq!(e.status(), Status::ConnectionReset, "{e}");
    let frames = [
        // The round's last partition ends with bytes missing.
        wire::Header::PrepData { id: peer_id, round: 1, offset: 0, len: 0, flags: wire::PREP_LAST, status: 0 },
        // Past the buffer.
        wire::Header::PrepData { id: peer_id, round: 1, offset: 8, len: 16, flags: 0, status: 0 },
        // Data for an id that does not exist.
        wire::Header::PrepData { id: 12345, round: 1, offset: 0, len: 0, flags: 0, status: 0 },
        // Readiness for a round out of order, addressed to a receive.
        wire::Header::PrepReady { id: recv, round: 3 },
    ];
    let _r = p.pstart(1, recv);
    p.wire[1].clear();
    for (i, h) in frames.iter().enumerate() {
        let mut out = Actions::new();
        let bytes = h.encode().as_bytes().to_vec();
        let e = p.sides[1].engine.on_frame(&mut out, 0, &bytes, &p.sides[1].regions);
        assert_eq!(e.unwrap_err().status(), Status::ConnectionReset, "frame {i}: {h:?}");
    }
}

#[test]
fn prepared_gpu_receive_is_written_through_its_key_and_without_one_in_frames() {
    for with_key in [true, false] {
        let mut p = Pair::new(cfg(), false, 1024);
        for side in &mut p.sides {
            side.engine.add_conn(0, LaneProps { lane: LaneKind::Shm, max_frame: 1024, remote_memory: false, device_ipc: true }, 0);
        }
        let size = 3000;
        // Simulated GPU memory on both sides (plain memory here; the worker does the real thing).
        let saddr = p.sides[0].mem.alloc(vec![0; size]);
        let spec = PrepSpec {
            dir: PrepDir::Send,
            conn: 0,
            tag: 1,
            buf: UserBuf { addr: saddr, len: size, mem: MemType::Cuda },
            partitions: None,
            engine: EngineOffer::Proxy,
        };
        let mut out = Actions::new();
        let send = p.sides[0].engine.prepared.prepare(&mut out, spec, None, None).unwrap();
        p.run(0, out, None);
        let raddr = p.sides[1].mem.alloc(vec![0xEE; size]);
        let spec = PrepSpec {
            dir: PrepDir::Recv,
            conn: 0,
            tag: 1,
            buf: UserBuf { addr: raddr, len: size, mem: MemType::Cuda },
            partitions: None,
            engine: EngineOffer::Proxy,
        };
        let mut out = Actions::new();
        let key = with_key.then(|| b"device key".to_vec());
        let recv = p.sides[1].engine.prepared.prepare(&mut out, spec, key, None).unwrap();
        p.run(1, out, None);
        p.pump();
        let data = pattern(size, 9);
        p.sides[0].mem.write(saddr, &data);
        let r = p.pstart(1, recv);
        let s = p.pstart(0, send);
        p.pump();
        assert_eq!((p.sides[0].done[&s].0, p.sides[1].done[&r].0), (Status::Ok, Status::Ok));
        assert_eq!(p.sides[1].mem.get(raddr), &data);
        assert_eq!(p.keys_seen.len(), with_key as usize, "the key travels to the sender's writes only when there is one");
    }
}

#[test]
fn gpu_round_pairs_exchange_control_blocks_and_refuse_a_one_sided_choice() {
    use prepared::DeviceHello;
    let gpu = |ctl: u64, buf_key: &[u8]| DeviceHello {
        ctl_addr: ctl,
        ctl_key: b"ctl key".to_vec(),
        buf_addr: ctl + 128,
        buf_key: buf_key.to_vec(),
        ll: ctl == 0xB000,
        proxy_key: Vec::new(),
    };
    let spec =
        |dir, addr, engine| PrepSpec { dir, conn: 0, tag: 4, buf: UserBuf { addr, len: 64, mem: MemType::Cuda }, partitions: None, engine };
    let mut p = Pair::new(cfg(), false, 1024);
    let mut out = Actions::new();
    let s = p.sides[0]
        .engine
        .prepared
        .prepare(&mut out, spec(PrepDir::Send, 0x1000, EngineOffer::GpuRequired), None, Some(gpu(0xA000, b"")))
        .unwrap();
    p.run(0, out, None);
    assert!(p.sides[0].engine.prepared.device_peer(s).unwrap().is_none(), "not paired yet");
    let mut out = Actions::new();
    let r = p.sides[1]
        .engine
        .prepared
        .prepare(&mut out, spec(PrepDir::Recv, 0x2000, EngineOffer::GpuRequired), None, Some(gpu(0xB000, b"buf key")))
        .unwrap();
    p.run(1, out, None);
    p.pump();
    let to_recv = p.sides[0].engine.prepared.device_peer(s).unwrap().expect("paired");
    assert_eq!((to_recv.hello.ctl_addr, to_recv.hello.buf_addr, to_recv.len), (0xB000, 0xB080, 64));
    assert_eq!(to_recv.hello.buf_key, b"buf key");
    assert!(to_recv.hello.ll, "the receive's LL choice reaches the sender");
    let to_send = p.sides[1].engine.prepared.device_peer(r).unwrap().expect("paired");
    assert_eq!(to_send.hello.ctl_addr, 0xA000);
    assert_eq!(p.frames_in_flight(), 0, "GPU rounds exchange nothing else");
    // Host rounds are refused for them.
    assert!(p.sides[0].engine.prepared.start(&mut Actions::new(), s, 9, false, None).is_err());

    // One side requires GPU rounds, the other cannot run them: both sides learn it at pairing.
    let mut p = Pair::new(cfg(), false, 1024);
    let mut out = Actions::new();
    let s = p.sides[0]
        .engine
        .prepared
        .prepare(&mut out, spec(PrepDir::Send, 0x1000, EngineOffer::GpuRequired), None, Some(gpu(1, b"")))
        .unwrap();
    p.run(0, out, None);
    let mut out = Actions::new();
    let r = p.sides[1].engine.prepared.prepare(&mut out, spec(PrepDir::Recv, 0x2000, EngineOffer::Proxy), None, None).unwrap();
    p.run(1, out, None);
    p.pump();
    assert_eq!(p.sides[0].engine.prepared.device_peer(s).unwrap_err().status(), Status::InvalidParam);
    let e = p.sides[1].engine.prepared.start(&mut Actions::new(), r, 9, false, None).unwrap_err();
    assert_eq!(e.status(), Status::InvalidParam, "{e}");

    // A hello too short for what it claims is a protocol error.
    let h = wire::Header::PrepHello { tag: 1, seq: 0, id: 1, len: 8, partitions: 1, addr: 0, flags: wire::PREP_GPU_ROUNDS };
    let mut frame = h.encode().as_bytes().to_vec();
    frame.extend_from_slice(&[1, 2, 3]);
    let side = &mut p.sides[0];
    assert_eq!(side.engine.on_frame(&mut Actions::new(), 0, &frame, &side.regions).unwrap_err().status(), Status::ConnectionReset);
}

#[test]
fn the_engine_is_negotiated_at_pairing_and_falls_back_to_the_proxy_unless_required() {
    use EngineOffer::{Gpu, GpuRequired, Proxy};
    use prepared::DeviceHello;
    let size = 3000;
    // (send side's offer, receive side's offer, the pair runs on the GPU, pairing fails)
    let cases = [
        (Gpu, Gpu, true, false),
        (GpuRequired, Gpu, true, false),
        (Gpu, Proxy, false, false),
        (Proxy, Gpu, false, false),
        (GpuRequired, Proxy, false, true),
        (Proxy, GpuRequired, false, true),
    ];
    for (send_offer, recv_offer, on_gpu, fails) in cases {
        let what = format!("send {send_offer:?}, receive {recv_offer:?}");
        let mut p = Pair::new(cfg(), false, 1024);
        for side in &mut p.sides {
            side.engine.add_conn(0, LaneProps { lane: LaneKind::Shm, max_frame: 1024, remote_memory: false, device_ipc: true }, 0);
        }
        let hello = |ctl: u64| DeviceHello {
            ctl_addr: ctl,
            ctl_key: b"ctl".to_vec(),
            buf_addr: ctl + 128,
            buf_key: b"buf".to_vec(),
            ll: false,
            proxy_key: Vec::new(),
        };
        let saddr = p.sides[0].mem.alloc(pattern(size, 3));
        let raddr = p.sides[1].mem.alloc(vec![0xEE; size]);
        let spec = |dir, addr, engine| PrepSpec {
            dir,
            conn: 0,
            tag: 1,
            buf: UserBuf { addr, len: size, mem: MemType::Cuda },
            partitions: None,
            engine,
        };
        let mut out = Actions::new();
        let gpu = send_offer.offers_gpu().then(|| hello(0xA000));
        let send = p.sides[0].engine.prepared.prepare(&mut out, spec(PrepDir::Send, saddr, send_offer), None, gpu).unwrap();
        p.run(0, out, None);
        let mut out = Actions::new();
        // The receive's key for proxy rounds (direct writes) rides in its GPU hello when it
        // offered GPU rounds, alone otherwise; a receive that requires them has none.
        let key = (recv_offer != GpuRequired).then(|| b"device key".to_vec());
        let gpu = recv_offer.offers_gpu().then(|| hello(0xB000));
        let recv = p.sides[1].engine.prepared.prepare(&mut out, spec(PrepDir::Recv, raddr, recv_offer), key, gpu).unwrap();
        p.run(1, out, None);
        p.pump();
        for (side, id) in [(0, send), (1, recv)] {
            let engine = p.sides[side].engine.prepared.runs_on_gpu(id);
            if fails {
                assert_eq!(engine.unwrap_err().status(), Status::InvalidParam, "{what}");
                continue;
            }
            assert_eq!(engine.unwrap(), Some(on_gpu), "{what}");
            assert_eq!(p.sides[side].engine.prepared.device_peer(id).unwrap().is_some(), on_gpu, "{what}");
        }
        if fails || on_gpu {
            assert_eq!(p.frames_in_flight(), 0, "{what}");
            continue;
        }
        // Fallen back to the proxy: a round works, written through the receive's key.
        let r = p.pstart(1, recv);
        let s = p.pstart(0, send);
        p.pump();
        assert_eq!((p.sides[0].done[&s].0, p.sides[1].done[&r].0), (Status::Ok, Status::Ok), "{what}");
        assert_eq!(p.sides[1].mem.get(raddr), &pattern(size, 3), "{what}");
        assert_eq!(p.keys_seen.len(), 1, "{what}: the key reached the sender's writes");
    }
}

#[test]
fn a_round_may_move_a_staging_buffer_instead_of_the_prepared_one() {
    // Direct writes were chosen at pairing (remote memory, 64 KiB): a staged round still goes in
    // frames, from the sender's slot into the receiver's slot, and leaves both prepared buffers alone.
    let size = 1 << 16;
    let mut p = Pair::new(cfg(), true, 1 << 12);
    let (send, saddr) = p.prepare(0, PrepDir::Send, size, 1, None);
    let (recv, raddr) = p.prepare(1, PrepDir::Recv, size, 1, None);
    p.pump();
    let sslot = p.sides[0].mem.alloc(pattern(size, 5));
    let rslot = p.sides[1].mem.alloc(vec![0; size]);
    let mut out = Actions::new();
    let r = p.req();
    p.sides[1].engine.prepared.start(&mut out, recv, r, false, Some(UserBuf::host(rslot, size))).unwrap();
    p.run(1, out, None);
    let mut out = Actions::new();
    let s = p.req();
    p.sides[0].engine.prepared.start(&mut out, send, s, false, Some(UserBuf::host(sslot, size))).unwrap();
    assert!(!out.iter().any(|a| matches!(a, Action::WriteRemote { .. })), "a staged round writes no remote memory");
    p.run(0, out, None);
    p.pump();
    assert_eq!((p.sides[0].done[&s].0, p.sides[1].done[&r].0), (Status::Ok, Status::Ok));
    assert_eq!(p.sides[1].mem.get(rslot), &pattern(size, 5));
    assert!(p.sides[1].mem.get(raddr)[..size].iter().all(|b| *b == 0xEE), "the prepared receive buffer is untouched");
    assert!(p.sides[0].mem.get(saddr)[..size].iter().all(|b| *b == 0xEE));
    let e = p.sides[0].engine.prepared.start(&mut Actions::new(), send, 99, false, Some(UserBuf::host(sslot, 8))).unwrap_err();
    assert_eq!(e.status(), Status::Internal);
}

#[test]
fn pairing_follows_each_sides_creation_order_whatever_link_delivers_first() {
    // Side A prepares two sends with one tag towards B, on two links (two endpoints to the same
    // worker); B prepares two receives. B hears the second hello first: it must still pair its
    // first receive with A's first send.
    let props = LaneProps { lane: LaneKind::Shm, max_frame: 1024, remote_memory: false, device_ipc: false };
    let (mut a, mut b) = (Engine::new(cfg()), Engine::new(cfg()));
    for conn in [0, 1] {
        a.add_conn(conn, props, 0xB);
        b.add_conn(conn, props, 0xA);
    }
    let frames = |out: Actions| -> Vec<Vec<u8>> {
        out.into_iter()
            .filter_map(|x| match x {
                Action::Transmit { frame, .. } => Some(frame.0.header.as_bytes().to_vec()),
                _ => None,
            })
            .collect()
    };
    let spec = |dir, conn| PrepSpec {
        dir,
        conn,
        tag: 9,
        buf: UserBuf::host(0x1000 * (conn + 1), 8),
        partitions: None,
        engine: EngineOffer::Proxy,
    };
    let mut out = Actions::new();
    let s1 = a.prepared.prepare(&mut out, spec(PrepDir::Send, 0), None, None).unwrap();
    let hello1 = frames(std::mem::take(&mut out));
    let s2 = a.prepared.prepare(&mut out, spec(PrepDir::Send, 1), None, None).unwrap();
    let hello2 = frames(std::mem::take(&mut out));
    let r1 = b.prepared.prepare(&mut out, spec(PrepDir::Recv, 0), None, None).unwrap();
    let r2 = b.prepared.prepare(&mut out, spec(PrepDir::Recv, 0), None, None).unwrap();
    let b_hellos = frames(std::mem::take(&mut out));
    let regions = Regions::default();
    // The second link's hello first.
    b.on_frame(&mut out, 1, &hello2[0], &regions).unwrap();
    b.on_frame(&mut out, 0, &hello1[0], &regions).unwrap();
    for h in &b_hellos {
        a.on_frame(&mut out, 0, h, &regions).unwrap();
    }
    out.clear();
    // B's first receive is ready: its readiness goes to A's first send (s1), the second's to s2.
    b.prepared.start(&mut out, r1, 100, false, None).unwrap();
    let ready = frames(std::mem::take(&mut out));
    let (h, _) = wire::Header::decode(&ready[0]).unwrap();
    assert_eq!(h, wire::Header::PrepReady { id: s1, round: 1 }, "R1 pairs with S1");
    b.prepared.start(&mut out, r2, 101, false, None).unwrap();
    let ready = frames(std::mem::take(&mut out));
    let (h, _) = wire::Header::decode(&ready[0]).unwrap();
    assert_eq!(h, wire::Header::PrepReady { id: s2, round: 1 }, "R2 pairs with S2");
}

// ---- prepared transfers through shared words ---------------------------------------------

impl Pair {
    /// `prepare` of a send that made a shared word page (a fresh simulated one).
    fn prepare_send_with_words(&mut self, len: usize, tag: u64) -> (PrepId, usize) {
        let addr = self.sides[0].mem.alloc(vec![0xEE; len + 64]);
        let path = format!("/sim/gsc-words-{}", self.pages.len());
        self.pages.insert(path.clone(), [0, 0]);
        let mut out = Actions::new();
        let spec =
            PrepSpec { dir: PrepDir::Send, conn: 0, tag, buf: UserBuf::host(addr, len), partitions: None, engine: EngineOffer::Proxy };
        let id = self.sides[0].engine.prepared.prepare_with_words(&mut out, spec, None, None, Some(&path)).unwrap();
        self.mapped.insert((0, id), path);
        self.run(0, out, None);
        (id, addr)
    }

    /// Start a round on each side (the receive first or not), pump, and check the data and
    /// both completions.
    fn words_round(&mut self, send: (PrepId, usize), recv: (PrepId, usize), size: usize, round: u8) {
        let data = pattern(size, round);
        self.sides[0].mem.write(send.1, &data);
        let (r, s) = if round.is_multiple_of(2) {
            let r = self.pstart(1, recv.0);
            (r, self.pstart(0, send.0))
        } else {
            let s = self.pstart(0, send.0);
            (self.pstart(1, recv.0), s)
        };
        self.pump();
        assert_eq!(self.sides[1].done[&r], (Status::Ok, RecvInfo { tag: 9, length: size }), "round {round}");
        assert_eq!(self.sides[0].done[&s].0, Status::Ok, "round {round}");
        assert_eq!(&self.sides[1].mem.get(recv.1)[..size], &data[..], "round {round}");
    }
}

#[test]
fn shared_words_carry_ready_and_arrival_so_direct_rounds_send_no_frame() {
    for size in [1, 1000, 100_000] {
        for recv_first in [true, false] {
            let mut p = Pair::new(cfg(), true, 1 << 20);
            let (send, recv) = if recv_first {
                let r = p.prepare(1, PrepDir::Recv, size, 9, None);
                (p.prepare_send_with_words(size, 9), r)
            } else {
                let s = p.prepare_send_with_words(size, 9);
                (s, p.prepare(1, PrepDir::Recv, size, 9, None))
            };
            p.pump();
            assert_eq!(p.sides[1].engine.prepared.shared_words(recv.0), Some(true));
            let hellos = p.frames_sent;
            for round in 0..6u8 {
                p.words_round(send, recv, size, round);
            }
            // Small host messages go in one data frame (the table would not read them
            // directly); from the rendezvous threshold up the sender writes them directly.
            let direct = size >= 64 << 10;
            let per_round = if direct { 0 } else { 1 };
            assert_eq!(p.frames_sent - hellos, 6 * per_round, "size {size}: no ready frame, and no completion frame after a direct write");
            let page = p.pages[&p.mapped[&(0, send.0)]];
            assert_eq!(page, [6, if direct { 6 } else { 0 }], "the words count the rounds");
            assert_eq!(p.sides[0].engine.prepared.shared_words(send.0), Some(true));
        }
    }
}

#[test]
fn shared_words_ready_with_frames_for_the_data_when_the_lane_cannot_write_directly() {
    // No remote memory: the sender moves the bytes in data frames; readiness is still a word.
    let size = 3000;
    let mut p = Pair::new(cfg(), false, 1024);
    let recv = p.prepare(1, PrepDir::Recv, size, 9, None);
    let send = p.prepare_send_with_words(size, 9);
    p.pump();
    for round in 0..4u8 {
        p.words_round(send, recv, size, round);
    }
    let page = p.pages[&p.mapped[&(0, send.0)]];
    assert_eq!(page, [4, 0], "ready by word, arrival by the data frames");
}

#[test]
fn a_receiver_that_cannot_map_the_page_stays_on_frames_and_the_sender_follows() {
    for started_before_pairing in [false, true] {
        let size = 5000;
        let mut p = Pair::new(cfg(), true, 1024);
        p.refuse_words = true;
        let recv = p.prepare(1, PrepDir::Recv, size, 9, None);
        let early = started_before_pairing.then(|| p.pstart(1, recv.0));
        let send = p.prepare_send_with_words(size, 9);
        p.pump();
        assert_eq!(p.sides[1].engine.prepared.shared_words(recv.0), Some(false));
        if let Some(r) = early {
            let s = p.pstart(0, send.0);
            p.pump();
            assert_eq!(p.sides[1].done[&r].0, Status::Ok);
            assert_eq!(p.sides[0].done[&s].0, Status::Ok);
        }
        let before = p.frames_sent;
        for round in 1..4u8 {
            p.words_round(send, recv, size, round);
        }
        assert_eq!(p.frames_sent - before, 6, "a ready and a completion frame per round");
        assert_eq!(p.pages[&p.mapped[&(0, send.0)]], [0, 0], "nobody used the page");
        assert_eq!(p.sides[0].engine.prepared.shared_words(send.0), Some(false));
    }
}

#[test]
fn partitioned_and_gpu_required_pairs_do_not_use_shared_words_and_words_never_run_ahead() {
    // A partitioned receive ignores the page (one arrival word cannot tell partitions apart).
    let mut p = Pair::new(cfg(), true, 1024);
    let recv = p.prepare(1, PrepDir::Recv, 4096, 9, Some(4));
    let send = p.prepare_send_with_words(4096, 9);
    p.pump();
    assert_eq!(p.sides[1].engine.prepared.shared_words(recv.0), Some(false));
    let mut out = Actions::new();
    // Hostile words: "ready" two rounds ahead, "arrived" for a round never readied.
    assert_eq!(p.sides[0].engine.prepared.ready_word(&mut out, send.0, 2).unwrap_err().status(), Status::ConnectionReset);
    let mut q = Pair::new(cfg(), true, 1024);
    let recv = q.prepare(1, PrepDir::Recv, 64, 9, None);
    q.prepare_send_with_words(64, 9);
    q.pump();
    assert_eq!(q.sides[1].engine.prepared.arrived_word(&mut out, recv.0, 1).unwrap_err().status(), Status::ConnectionReset);
    assert!(out.is_empty());
}

#[test]
fn the_words_trailer_round_trips_and_rejects_garbage() {
    let mut payload = b"key".to_vec();
    payload.extend_from_slice(b"/dev/shm/gsc-0123");
    payload.extend_from_slice(&17u16.to_le_bytes());
    assert_eq!(prepared::split_words_trailer(&payload).unwrap(), (&b"key"[..], "/dev/shm/gsc-0123"));
    assert!(prepared::split_words_trailer(&[]).is_err());
    assert!(prepared::split_words_trailer(&[5, 0]).is_err(), "longer than the payload");
    assert!(prepared::split_words_trailer(&[0, 0]).is_err(), "empty path");
    assert!(prepared::split_words_trailer(&[0xff, 1, 0]).is_err(), "not UTF-8");
}

/// A stuck request can say what it waits for (the warning a stream-ordered timeout logs).
#[test]
fn requests_describe_where_they_stand() {
    let mut p = Pair::new(cfg(), false, 1024);
    let (r, _) = p.recv(64, 7, u64::MAX);
    let d = p.sides[1].engine.tag.describe(r).unwrap();
    assert!(d.contains("receive posted with tag 0x7") && d.contains("no message matched"), "{d}");
    // A rendezvous send whose receiver has not posted yet waits for it.
    let s = p.send(&pattern(8000, 1), 2);
    p.pump();
    let d = p.sides[0].engine.tag.describe(s).unwrap();
    assert!(d.contains("rendezvous send of 8000 bytes") && d.contains("waiting for the receiver"), "{d}");
    let (r2, _) = p.recv(8000, 2, u64::MAX);
    p.pump();
    assert_eq!(p.sides[1].done[&r2].0, Status::Ok);
    assert!(p.sides[0].engine.tag.describe(s).is_none(), "a completed send has no state");
    assert!(p.sides[1].engine.tag.describe(12345).is_none());
}
