//! Prepared transfers: persistent and partitioned send/receive pairs whose matching and protocol
//! are resolved once, so that every later round is only "receiver ready" plus the data written
//! into the receive buffer plus an arrival count.
//!
//! Life of a pair (both sides run this engine):
//! 1. *Prepare*: each side announces its preparation with a `PrepHello` (direction, tag, length,
//!    partitions, and for a receive the buffer's address). The k-th send preparation with tag
//!    `T` on a link pairs with the k-th receive preparation with tag `T` on the same link, in
//!    creation order, so both sides reach the same pairing without a reply. Pairing fixes the
//!    peer's id (frames name it instead of a tag: no matching per round) and the protocol: data
//!    frames, or direct writes into the receive buffer where the selection table would read a
//!    message of a partition's size directly (`rndv_get` on the lane).
//! 2. *Round* `k`: the receiver's start sends `PrepReady(k)`. The sender's start (or, for a
//!    partitioned send, each `pready`) writes a partition as soon as `PrepReady(k)` arrived:
//!    `PrepData` frames carrying the bytes, or a direct write followed by one `PrepData` that
//!    says the range is there. A receive round completes when every sender partition ended
//!    (`PREP_LAST`); a send round when its last frame is in the link.
//!
//!    *Shared words* (processes of one host, `PREP_WORDS`): the sender makes a page both
//!    processes map with two 64-bit words that only grow. The receiver announces round `k` by
//!    raising "ready" to `k` (`Action::RaiseReady`) instead of sending `PrepReady`; a sender that
//!    saw round `k` ready that way ends a direct write by raising "arrived" to `k` (its copy
//!    stream, or the worker after a CPU write) instead of sending the announcing `PrepData`. The
//!    worker polls the words it watches and reports them (`ready_word`, `arrived_word`). Data
//!    frames (staged rounds, refused direct writes) and error reports stay frames, and a
//!    receiver that cannot map the page stays on `PrepReady` frames: the sender answers each
//!    round the way its readiness came, so both paths work without another message.
//! 3. *Release*: refused while a round is in flight; otherwise the peer is told (`PrepBye`) and
//!    its later rounds fail with `NotConnected` instead of waiting forever.
//!
//! Like the rest of src/protocols/, nothing here does I/O: events in, `Action`s out.

use super::idmap::IdMap;
use super::select::{self, EngineOffer, LaneProps, MemType, ProtoConfig, ProtoId};
use super::tag::{Action, Actions, ConnId, OutFrame, OutFrameEq, Payload, RecvInfo, ReqId, UserBuf};
use super::wire::{Header, PREP_DEVICE, PREP_DIRECT, PREP_GPU_REQUIRED, PREP_GPU_ROUNDS, PREP_LAST, PREP_RECV, PREP_WORDS};
use crate::error::{Error, Result, Status};
use std::collections::VecDeque;
use std::sync::Arc;

pub type PrepId = u64;

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PrepDir {
    Send,
    Recv,
}

/// What a preparation is: direction, link, tag, buffer, and how it is split.
#[derive(Copy, Clone, Debug)]
pub struct PrepSpec {
    pub dir: PrepDir,
    pub conn: ConnId,
    pub tag: u64,
    pub buf: UserBuf,
    /// `None`: a persistent operation (a start moves the whole buffer). `Some(n)`: partitioned
    /// into `n` equal parts, each sent once `pready` marks it (send side) and reported by
    /// `parrived` (receive side).
    pub partitions: Option<usize>,
    /// Whether this side offers (or requires) to run the rounds on the GPU by kernels
    /// (`select::prepared_engine`). When the pair does (both offered), no round goes through
    /// this engine: pairing only exchanges the control blocks and keys (`DeviceHello`).
    pub engine: EngineOffer,
}

/// What a side whose rounds run on the GPU announces: its control block (address and the key
/// that opens its slab), and for a receive the key of its buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceHello {
    pub ctl_addr: u64,
    pub ctl_key: Vec<u8>,
    /// A receive: where the sender writes (its buffer, or a staging area) and the key that
    /// opens it.
    pub buf_addr: u64,
    pub buf_key: Vec<u8>,
    /// A receive staged as LL words (the sender writes them instead of bytes and a flag).
    pub ll: bool,
    /// A receive that only offered GPU rounds: the key that opens its buffer to the sender's
    /// copy engine in case the pair falls back to proxy rounds (empty: none, frames then).
    pub proxy_key: Vec<u8>,
}

impl DeviceHello {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(36 + self.ctl_key.len() + self.buf_key.len() + self.proxy_key.len());
        v.extend_from_slice(&self.ctl_addr.to_le_bytes());
        v.extend_from_slice(&self.buf_addr.to_le_bytes());
        for k in [&self.ctl_key, &self.buf_key] {
            v.extend_from_slice(&(k.len() as u32).to_le_bytes());
            v.extend_from_slice(k);
        }
        v.extend_from_slice(&u64::from(self.ll).to_le_bytes());
        v.extend_from_slice(&(self.proxy_key.len() as u32).to_le_bytes());
        v.extend_from_slice(&self.proxy_key);
        v
    }

    fn decode(b: &[u8]) -> Result<DeviceHello> {
        let short = || bad("short GPU-rounds hello");
        let word = |at: usize| -> Result<u64> { Ok(u64::from_le_bytes(b.get(at..at + 8).ok_or_else(short)?.try_into().expect("8 bytes"))) };
        let key = |at: &mut usize| -> Result<Vec<u8>> {
            let n = u32::from_le_bytes(b.get(*at..*at + 4).ok_or_else(short)?.try_into().expect("4 bytes")) as usize;
            let k = b.get(*at + 4..*at + 4 + n).ok_or_else(short)?.to_vec();
            *at += 4 + n;
            Ok(k)
        };
        let (ctl_addr, buf_addr) = (word(0)?, word(8)?);
        let mut at = 16;
        let ctl_key = key(&mut at)?;
        let buf_key = key(&mut at)?;
        let ll = word(at)? != 0;
        at += 8;
        let proxy_key = key(&mut at)?;
        Ok(DeviceHello { ctl_addr, ctl_key, buf_addr, buf_key, ll, proxy_key })
    }
}

/// The peer of a pair whose rounds run on the GPU, as the kernels need it.
#[derive(Clone, Debug)]
pub struct DevicePeer {
    pub hello: Arc<DeviceHello>,
    /// The peer's buffer length.
    pub len: usize,
}

impl PrepSpec {
    fn parts(&self) -> usize {
        self.partitions.unwrap_or(1)
    }
}

/// The peer's preparation, as its `PrepHello` described it.
#[derive(Copy, Clone, Debug)]
struct Peer {
    id: PrepId,
    len: usize,
    partitions: usize,
    /// The receive buffer (when the peer receives and allows direct writes).
    addr: Option<u64>,
    /// The link the peer's frames for this pair arrive on (its hello's): not necessarily
    /// ours, since each side sends on its own endpoint.
    conn: ConnId,
}

struct Prep {
    spec: PrepSpec,
    /// This side's count of preparations of this direction and tag towards the peer worker:
    /// pairs with the peer's preparation of the other direction with the same count.
    seq: u64,
    /// The last round ended successfully (what `parrived` reports between rounds).
    last_ok: bool,
    peer: Option<Peer>,
    /// The peer's receive buffer is GPU memory this key opens.
    peer_key: Option<Arc<[u8]>>,
    /// Rounds on the GPU: what the peer announced.
    peer_device: Option<Arc<DeviceHello>>,
    /// Fixed at pairing: the pair's rounds run on the GPU (both sides offered them).
    on_gpu: bool,
    /// Send side, fixed at pairing: partitions are written into the receive buffer directly.
    direct: bool,
    /// Pairing showed the two sides cannot work together, or the peer released: every round
    /// fails with this.
    broken: Option<Error>,
    /// Dropped by its owner while a round was in flight: released when the rounds end.
    release_when_idle: bool,
    /// Released by the user before the peer's hello arrived: kept only to consume that hello
    /// (so later preparations pair as the peer paired them) and answer it with a bye.
    released: bool,
    /// Rounds begun on this side; the current (or last) round's number.
    round: u64,
    /// The request of the round in progress.
    active: Option<ReqId>,
    /// Rounds started (by conditions) while one was in progress, in start order, each with
    /// its round buffer.
    queued: VecDeque<(ReqId, Option<UserBuf>)>,
    /// The round in progress moves this buffer instead of the prepared one: a GPU buffer's
    /// staging slot in host memory for a stream or graph round (its kernels copy between the
    /// two). Such rounds always go in frames.
    round_buf: Option<UserBuf>,
    /// Send side: the receiver is ready for every round up to this one.
    ready_round: u64,
    /// Send side: partitions marked ready for the current (or, with none active, the next)
    /// round, and those already written in the current round.
    readied: Vec<bool>,
    written: Vec<bool>,
    /// Send side: frames of the current round not yet in the link.
    unsent: usize,
    /// Receive side: bytes of the current round arrived per receive partition, and sender
    /// partitions not yet ended.
    arrived: Vec<usize>,
    received: usize,
    parts_left: usize,
    round_error: Option<Status>,
    /// Shared words. A send: it made a page (`prepare_with_words`), and the highest round the
    /// receiver readied through it. A receive: fixed at pairing, readiness goes through the
    /// sender's page (not `PrepReady`) and a round may end by the "arrived" word.
    words_offered: bool,
    ready_by_word: u64,
    words: bool,
}

impl Prep {
    fn part_len(&self) -> usize {
        self.spec.buf.len / self.spec.parts()
    }

    fn in_flight(&self) -> bool {
        self.active.is_some() || !self.queued.is_empty()
    }

    /// What the round in progress reads or writes.
    fn buf(&self) -> UserBuf {
        self.round_buf.unwrap_or(self.spec.buf)
    }
}

/// A hello no local preparation has claimed yet.
#[derive(Clone, Debug)]
struct Hello {
    worker: u128,
    seq: u64,
    key: Option<Arc<[u8]>>,
    /// The peer offers GPU rounds (`PREP_GPU_ROUNDS`), and requires them (`PREP_GPU_REQUIRED`).
    device: Option<Arc<DeviceHello>>,
    gpu_required: bool,
    recv: bool,
    tag: u64,
    peer: Peer,
    direct_ok: bool,
    /// A send's shared word page (`PREP_WORDS`): its path.
    words: Option<Arc<str>>,
}

/// A link as this engine sees it.
#[derive(Copy, Clone, Debug)]
struct LinkInfo {
    props: LaneProps,
    /// The worker at the other end. Pairing is per peer worker, not per link: two workers that
    /// each connected to the other have two links, and each side prepares on its own endpoint.
    worker: u128,
}

pub struct PreparedEngine {
    cfg: ProtoConfig,
    links: IdMap<ConnId, LinkInfo>,
    preps: IdMap<PrepId, Prep>,
    /// Ids are never reused, so a frame or handle naming a released preparation is recognized
    /// as stale instead of reaching a newer one.
    next_id: PrepId,
    /// Unclaimed hellos (their preparation pairs by sequence number, not arrival order).
    hellos: VecDeque<Hello>,
    /// Preparations made so far per (peer worker, tag, receive?): the next one's `seq`.
    seqs: std::collections::HashMap<(u128, u64, bool), u64>,
    /// Send rounds in progress: request -> preparation (frames report `frame_sent(req)`).
    sending: IdMap<ReqId, PrepId>,
}

fn bad(what: &str) -> Error {
    Error::new(Status::ConnectionReset, format!("protocol violation by peer (prepared transfer): {what}"))
}

fn transmit(out: &mut Actions, conn: ConnId, header: Header, payload: Payload, on_sent: Option<ReqId>) {
    out.push(Action::Transmit { conn, frame: OutFrameEq(OutFrame { header: header.encode(), payload, on_sent, copy_if_queued: false }) });
}

/// Send bytes `offset..offset + len` of `p`'s buffer (one sender partition) in data frames, the
/// last one ending the partition.
fn send_frames(out: &mut Actions, p: &mut Prep, peer_id: PrepId, req: ReqId, max_frame: usize, offset: usize, len: usize) {
    let probe = Header::PrepData { id: 0, round: 0, offset: 0, len: 0, flags: 0, status: 0 };
    let room = max_frame.saturating_sub(probe.encoded_len()).max(1);
    let mut at = 0;
    loop {
        let n = room.min(len - at);
        let last = at + n == len;
        let header = Header::PrepData {
            id: peer_id,
            round: p.round,
            offset: (offset + at) as u64,
            len: n as u64,
            flags: if last { PREP_LAST } else { 0 },
            status: 0,
        };
        let payload = if n == 0 { Payload::None } else { p.buf().payload(offset + at, n) };
        p.unsent += 1;
        transmit(out, p.spec.conn, header, payload, Some(req));
        at += n;
        if last {
            break;
        }
    }
}

/// A send hello's payload with `PREP_WORDS`: (what precedes the page's path, the path). The
/// path is its bytes followed by their count as a little-endian u16.
pub fn split_words_trailer(payload: &[u8]) -> Result<(&[u8], &str)> {
    let short = || bad("short shared-words trailer");
    let n = payload.len().checked_sub(2).ok_or_else(short)?;
    let len = u16::from_le_bytes([payload[n], payload[n + 1]]) as usize;
    let start = n.checked_sub(len).ok_or_else(short)?;
    let path = std::str::from_utf8(&payload[start..n]).map_err(|_| bad("shared-words path is not UTF-8"))?;
    if path.is_empty() {
        return Err(bad("empty shared-words path"));
    }
    Ok((&payload[..start], path))
}

/// A receive round's data is all there (or it failed): the round ends with its first error, or
/// Ok; returns the completion of its request `req` (`len`: the bytes the sender announced).
fn end_receive_round(p: &mut Prep, req: ReqId, len: usize) -> Action {
    p.active = None;
    let status = p.round_error.take().unwrap_or(Status::Ok);
    p.last_ok = status == Status::Ok;
    Action::Complete { req, status, info: RecvInfo { tag: p.spec.tag, length: len } }
}

/// Bytes of `[a0, a1)` inside `[b0, b1)`.
fn overlap(a0: usize, a1: usize, b0: usize, b1: usize) -> usize {
    a1.min(b1).saturating_sub(a0.max(b0))
}

impl PreparedEngine {
    pub fn new(cfg: ProtoConfig) -> PreparedEngine {
        PreparedEngine {
            cfg,
            links: IdMap::default(),
            preps: IdMap::default(),
            next_id: 1,
            hellos: VecDeque::new(),
            seqs: std::collections::HashMap::new(),
            sending: IdMap::default(),
        }
    }

    /// A new link to worker `worker` (its uuid).
    pub fn add_conn(&mut self, conn: ConnId, props: LaneProps, worker: u128) {
        self.links.insert(conn, LinkInfo { props, worker });
    }

    fn worker_of(&self, conn: ConnId) -> Option<u128> {
        self.links.get(&conn).map(|l| l.worker)
    }

    /// Send rounds in progress or queued on `conn` (a flushing close waits for none).
    pub fn sends_on(&self, conn: ConnId) -> usize {
        self.preps
            .values()
            .filter(|p| p.spec.conn == conn && p.spec.dir == PrepDir::Send)
            .map(|p| p.active.is_some() as usize + p.queued.len())
            .sum()
    }

    /// Rounds in progress or queued.
    pub fn in_flight(&self) -> usize {
        self.preps.values().map(|p| p.active.is_some() as usize + p.queued.len()).sum()
    }

    /// Create a preparation and announce it to the peer. Checks everything before acting.
    /// `device_key`: for a receive into GPU memory, the key that opens it to the peer (none:
    /// the peer sends frames).
    /// `gpu`: when `spec.engine` offers GPU rounds, what to announce for them.
    pub fn prepare(&mut self, out: &mut Actions, spec: PrepSpec, device_key: Option<Vec<u8>>, gpu: Option<DeviceHello>) -> Result<PrepId> {
        self.prepare_with_words(out, spec, device_key, gpu, None)
    }

    /// `prepare`, for a send that made a shared word page at `words` (its path, announced in the
    /// hello): the receiver may use it instead of frames (module doc). Ignored for a receive or
    /// a partitioned send.
    pub fn prepare_with_words(
        &mut self,
        out: &mut Actions,
        spec: PrepSpec,
        device_key: Option<Vec<u8>>,
        gpu: Option<DeviceHello>,
        words: Option<&str>,
    ) -> Result<PrepId> {
        let words = words.filter(|_| spec.dir == PrepDir::Send && spec.partitions.is_none());
        if words.is_some_and(|w| w.is_empty() || w.len() > u16::MAX as usize) {
            return Err(Error::invalid_param("a shared word page's path must be 1 to 65535 bytes"));
        }
        let Some(worker) = self.worker_of(spec.conn) else {
            return Err(Error::new(Status::NotConnected, "prepare on a connection the protocol layer does not know"));
        };
        if let Some(n) = spec.partitions {
            if n == 0 {
                return Err(Error::invalid_param("a partitioned transfer needs at least one partition"));
            }
            if !spec.buf.len.is_multiple_of(n) {
                return Err(Error::invalid_param(format!("buffer of {} bytes does not split into {n} equal partitions", spec.buf.len)));
            }
        }
        if spec.engine.offers_gpu() != gpu.is_some() {
            return Err(Error::new(Status::Internal, "GPU rounds need their control block announced"));
        }
        let id = self.next_id;
        self.next_id += 1;
        let parts = spec.parts();
        let recv = spec.dir == PrepDir::Recv;
        let seq = {
            let n = self.seqs.entry((worker, spec.tag, recv)).or_insert(0);
            *n += 1;
            *n - 1
        };
        // Only a host receive buffer may be written by the peer (cross-memory attach, or a copy
        // within one process).
        let direct_ok = recv && spec.buf.mem == MemType::Host;
        let own_key: Option<Arc<[u8]>> = device_key.filter(|_| recv && spec.buf.mem == MemType::Cuda).map(Arc::from);
        let hello = Header::PrepHello {
            tag: spec.tag,
            seq,
            id,
            len: spec.buf.len as u64,
            partitions: parts as u64,
            addr: if recv { spec.buf.addr as u64 } else { 0 },
            flags: if recv { PREP_RECV } else { 0 }
                | if direct_ok { PREP_DIRECT } else { 0 }
                | if own_key.is_some() { PREP_DEVICE } else { 0 }
                | if gpu.is_some() { PREP_GPU_ROUNDS } else { 0 }
                | if spec.engine == EngineOffer::GpuRequired { PREP_GPU_REQUIRED } else { 0 }
                | if words.is_some() { PREP_WORDS } else { 0 },
        };
        let key_payload = match (gpu, &own_key) {
            // The GPU hello carries the proxy rounds' key too, for a pair that falls back.
            (Some(g), key) => {
                Payload::Owned(DeviceHello { proxy_key: key.as_deref().map(<[u8]>::to_vec).unwrap_or_default(), ..g }.encode())
            }
            (None, Some(k)) => Payload::Owned(k.to_vec()),
            (None, None) => Payload::None,
        };
        let key_payload = match words {
            Some(path) => {
                let mut v = match key_payload {
                    Payload::Owned(v) => v,
                    _ => Vec::new(),
                };
                v.extend_from_slice(path.as_bytes());
                v.extend_from_slice(&(path.len() as u16).to_le_bytes());
                Payload::Owned(v)
            }
            None => key_payload,
        };
        transmit(out, spec.conn, hello, key_payload, None);
        self.preps.insert(
            id,
            Prep {
                spec,
                seq,
                last_ok: false,
                peer: None,
                peer_key: None,
                peer_device: None,
                on_gpu: false,
                direct: false,
                broken: None,
                released: false,
                release_when_idle: false,
                round: 0,
                active: None,
                queued: VecDeque::new(),
                round_buf: None,
                ready_round: 0,
                readied: vec![false; parts],
                written: vec![false; parts],
                unsent: 0,
                arrived: vec![0; parts],
                received: 0,
                parts_left: 0,
                round_error: None,
                words_offered: words.is_some(),
                ready_by_word: 0,
                words: false,
            },
        );
        // The peer's hello may have come first.
        if let Some(i) = self.hellos.iter().position(|h| h.worker == worker && h.recv != recv && h.tag == spec.tag && h.seq == seq) {
            let h = self.hellos.remove(i).expect("position found");
            self.pair(out, id, h);
        }
        Ok(id)
    }

    /// The preparation's spec, if `id` is live (not released).
    pub fn spec(&self, id: PrepId) -> Option<PrepSpec> {
        self.preps.get(&id).filter(|p| !p.released).map(|p| p.spec)
    }

    /// For a pair whose rounds run on the GPU: the peer, once paired (`None` before).
    pub fn device_peer(&mut self, id: PrepId) -> Result<Option<DevicePeer>> {
        let p = self.live(id)?;
        if let Some(e) = &p.broken {
            return Err(e.clone());
        }
        Ok(match (p.peer, &p.peer_device) {
            (Some(peer), Some(d)) if p.on_gpu => Some(DevicePeer { hello: d.clone(), len: peer.len }),
            _ => None,
        })
    }

    /// Which engine runs the pair's rounds, once paired (`None` before): `Some(true)` the GPU.
    /// The pairing's error if the two sides cannot work together.
    pub fn runs_on_gpu(&mut self, id: PrepId) -> Result<Option<bool>> {
        let p = self.live(id)?;
        if let Some(e) = &p.broken {
            return Err(e.clone());
        }
        Ok(p.peer.map(|_| p.on_gpu))
    }

    /// Start a round. `queue`: when a round is in progress, begin this one after it (a
    /// condition started it) rather than refuse (`Busy`, a host start). `round_buf`: move this
    /// buffer (of the prepared length) in this round instead of the prepared one.
    pub fn start(&mut self, out: &mut Actions, id: PrepId, req: ReqId, queue: bool, round_buf: Option<UserBuf>) -> Result<()> {
        let p = self.live(id)?;
        if round_buf.is_some_and(|b| b.len != p.spec.buf.len) {
            return Err(Error::new(Status::Internal, "a round buffer of another length than the prepared one"));
        }
        if p.on_gpu || (p.peer.is_none() && p.spec.engine.offers_gpu()) {
            // (Before pairing the engine is not known: the caller waits for pairing first.)
            return Err(Error::new(Status::Internal, "a prepared transfer with GPU rounds has no rounds here"));
        }
        if let Some(e) = &p.broken {
            return Err(e.clone());
        }
        if p.in_flight() {
            if !queue {
                return Err(Error::new(Status::Busy, "prepared transfer already started; wait for that round's request first"));
            }
            p.queued.push_back((req, round_buf));
            return Ok(());
        }
        self.begin_round(out, id, req, round_buf);
        Ok(())
    }

    /// Mark partition `part` of a partitioned send ready (for the round in progress, or the
    /// next one when none is).
    pub fn pready(&mut self, out: &mut Actions, id: PrepId, part: usize) -> Result<()> {
        let p = self.live(id)?;
        if p.spec.dir != PrepDir::Send || p.spec.partitions.is_none() {
            return Err(Error::invalid_param("pready needs a partitioned send"));
        }
        if part >= p.readied.len() {
            return Err(Error::new(Status::OutOfRange, format!("partition {part} of {}", p.readied.len())));
        }
        if p.readied[part] {
            return Err(Error::invalid_param(format!("partition {part} is already ready in this round")));
        }
        p.readied[part] = true;
        if p.active.is_some() {
            self.write_ready(out, id);
        }
        Ok(())
    }

    /// Whether partition `part` of a receive arrived in the round in progress (with no round in
    /// progress: whether a round has completed).
    pub fn parrived(&mut self, id: PrepId, part: usize) -> Result<bool> {
        let p = self.live(id)?;
        if p.spec.dir != PrepDir::Recv {
            return Err(Error::invalid_param("parrived needs a receive"));
        }
        let parts = p.arrived.len();
        if part >= parts {
            return Err(Error::new(Status::OutOfRange, format!("partition {part} of {parts}")));
        }
        if p.active.is_none() {
            return Ok(p.last_ok);
        }
        let Some(peer) = p.peer else { return Ok(false) };
        let pl = p.part_len();
        let expect = overlap(part * pl, (part + 1) * pl, 0, peer.len);
        Ok(p.arrived[part] >= expect && (expect > 0 || p.parts_left == 0))
    }

    /// Release a preparation. Refused while a round is in flight.
    pub fn release(&mut self, out: &mut Actions, id: PrepId) -> Result<()> {
        let p = self.live(id)?;
        if p.in_flight() {
            return Err(Error::new(Status::Busy, "a round of this prepared transfer is in flight; wait for it before releasing"));
        }
        match p.peer {
            Some(peer) => {
                if p.broken.is_none() {
                    transmit(out, p.spec.conn, Header::PrepBye { id: peer.id }, Payload::None, None);
                }
                self.preps.remove(&id);
            }
            // Keep a tombstone until the peer's hello comes, so pairing stays aligned.
            None if p.broken.is_none() => p.released = true,
            None => {
                self.preps.remove(&id);
            }
        }
        Ok(())
    }

    /// Release once no round is in flight any more (the owner dropped its handle).
    pub fn release_when_idle(&mut self, id: PrepId) {
        if let Some(p) = self.preps.get_mut(&id) {
            p.release_when_idle = true;
        }
    }

    fn live(&mut self, id: PrepId) -> Result<&mut Prep> {
        self.preps
            .get_mut(&id)
            .filter(|p| !p.released)
            .ok_or_else(|| Error::new(Status::InvalidHandle, "stale or released prepared transfer"))
    }

    fn pair(&mut self, out: &mut Actions, id: PrepId, h: Hello) {
        let links = &self.links;
        let cfg = &self.cfg;
        let p = self.preps.get_mut(&id).expect("pairing a live preparation");
        p.peer = Some(h.peer);
        p.peer_key = h.key.clone();
        p.peer_device = h.device.clone();
        if p.released {
            transmit(out, p.spec.conn, Header::PrepBye { id: h.peer.id }, Payload::None, None);
            self.preps.remove(&id);
            return;
        }
        let (send_len, recv_len) = match p.spec.dir {
            PrepDir::Send => (p.spec.buf.len, h.peer.len),
            PrepDir::Recv => (h.peer.len, p.spec.buf.len),
        };
        // The engine: the GPU when both sides offered it. A side that required it (its kernels
        // drive the rounds) cannot do with the proxy.
        p.on_gpu = p.spec.engine.offers_gpu() && h.device.is_some();
        let required_here = p.spec.engine == EngineOffer::GpuRequired;
        if !p.on_gpu {
            p.peer_device = None;
        }
        if !p.on_gpu && (required_here || h.gpu_required) {
            let (asked, cannot) = if required_here { ("this side", "the peer") } else { ("the peer", "this side") };
            p.broken = Some(Error::invalid_param(format!(
                "prepared transfer (tag {:#x}): {asked} requires its rounds on the GPU but {cannot} cannot run them there \
                 (a host buffer, no CUDA IPC or peer access, or GSC_ENGINE=proxy)",
                p.spec.tag
            )));
        } else if p.on_gpu && h.peer.partitions != p.spec.parts() {
            p.broken = Some(Error::invalid_param(format!(
                "with rounds on the GPU both sides split alike: {} partitions here, {} at the peer (tag {:#x})",
                p.spec.parts(),
                h.peer.partitions,
                p.spec.tag
            )));
        } else if send_len > recv_len {
            p.broken = Some(Error::new(
                Status::MessageTruncated,
                format!("prepared send of {send_len} bytes paired with a receive of {recv_len} (tag {:#x})", p.spec.tag),
            ));
        }
        if p.spec.dir == PrepDir::Send {
            // The protocol, chosen once: a direct write where the table would have the receiver
            // read a message of one partition's size directly.
            let part = UserBuf { len: p.part_len(), ..p.spec.buf };
            p.direct = match part.mem {
                MemType::Host => {
                    h.direct_ok
                        && links.get(&p.spec.conn).is_some_and(|l| {
                            l.props.remote_memory
                                // Direct writes need only the announced address; a lane that
                                // needs a key for it (UCX) sends frames (put: docs/UCX.md).
                                && !l.props.lane.remote_needs_key()
                                && matches!(select::select(cfg, part.mem, &l.props, part.len), Ok(ProtoId::RndvGet))
                        })
                }
                // GPU to GPU through the receiver's key, at every size: a copy-engine write
                // instead of staging through host memory frame by frame.
                MemType::Cuda => h.key.is_some() && links.get(&p.spec.conn).is_some_and(|l| l.props.device_ipc),
            };
        }
        // Shared words: a receive of one partition paired with a send that made a page (one
        // partition too: a send offers only then), with proxy rounds. The worker maps the page
        // now; if it cannot, it calls `words_refused` and this side stays on frames.
        if p.spec.dir == PrepDir::Recv
            && p.broken.is_none()
            && !p.on_gpu
            && p.spec.partitions.is_none()
            && h.peer.partitions == 1
            && let Some(path) = &h.words
        {
            p.words = true;
            out.push(Action::MapWords { id, path: path.clone() });
        }
        tracing::debug!(
            target: "gsc::proto",
            id,
            peer = h.peer.id,
            dir = ?p.spec.dir,
            direct = p.direct,
            words = p.words || (p.words_offered && p.spec.dir == PrepDir::Send),
            "prepared transfer paired ({})",
            if p.words { "ready and arrival through shared words" } else { "frames" }
        );
        if let Some(req) = p.active {
            // A round started before pairing: announce readiness or fail it now.
            if let Some(e) = p.broken.clone() {
                self.fail_rounds(out, id, e.status());
            } else {
                self.round_began(out, id, req);
            }
        }
    }

    fn begin_round(&mut self, out: &mut Actions, id: PrepId, req: ReqId, round_buf: Option<UserBuf>) {
        let p = self.preps.get_mut(&id).expect("live");
        p.round += 1;
        p.active = Some(req);
        p.round_buf = round_buf;
        p.round_error = None;
        p.written.iter_mut().for_each(|w| *w = false);
        p.arrived.iter_mut().for_each(|a| *a = 0);
        p.received = 0;
        p.unsent = 0;
        if p.spec.partitions.is_none() {
            p.readied[0] = true;
        }
        if p.peer.is_some() {
            self.round_began(out, id, req);
        }
    }

    /// The round in progress can act now that the peer is known.
    fn round_began(&mut self, out: &mut Actions, id: PrepId, req: ReqId) {
        let p = self.preps.get_mut(&id).expect("live");
        let peer = p.peer.expect("paired");
        match p.spec.dir {
            PrepDir::Recv => {
                p.parts_left = peer.partitions;
                if p.words {
                    out.push(Action::RaiseReady { id, round: p.round });
                } else {
                    transmit(out, p.spec.conn, Header::PrepReady { id: peer.id, round: p.round }, Payload::None, None);
                }
            }
            PrepDir::Send => {
                self.sending.insert(req, id);
                self.write_ready(out, id);
            }
        }
    }

    /// Send side: write every readied, unwritten partition if the receiver is ready.
    fn write_ready(&mut self, out: &mut Actions, id: PrepId) {
        let Some(max_frame) = self.preps.get(&id).and_then(|p| self.links.get(&p.spec.conn)).map(|l| l.props.max_frame) else { return };
        let p = self.preps.get_mut(&id).expect("live");
        let (Some(req), Some(peer)) = (p.active, p.peer) else { return };
        if p.ready_round < p.round {
            return;
        }
        let pl = p.part_len();
        for part in 0..p.written.len() {
            if !p.readied[part] || p.written[part] {
                continue;
            }
            p.written[part] = true;
            let offset = part * pl;
            if p.direct && pl > 0 && p.round_buf.is_none() {
                let remote = peer.addr.expect("direct writes only to an announced buffer") + offset as u64;
                let device_key = p.peer_key.clone();
                let header = Header::PrepData {
                    id: peer.id,
                    round: p.round,
                    offset: offset as u64,
                    len: pl as u64,
                    flags: PREP_DIRECT | PREP_LAST,
                    status: 0,
                };
                p.unsent += 1;
                // The receiver readied this round through the shared page: it learns of the
                // data the same way (the whole buffer is one partition on both sides then).
                let arrived_word = (p.words_offered && p.ready_by_word >= p.round).then_some((id, p.round));
                out.push(Action::WriteRemote {
                    conn: p.spec.conn,
                    src: p.spec.buf.addr + offset,
                    remote,
                    len: pl,
                    req,
                    device_key,
                    arrived_word,
                    then: Box::new(OutFrameEq(OutFrame {
                        header: header.encode(),
                        payload: Payload::None,
                        on_sent: Some(req),
                        copy_if_queued: false,
                    })),
                });
                continue;
            }
            send_frames(out, p, peer.id, req, max_frame, offset, pl);
        }
    }

    /// A direct write could not start (the peer's buffer cannot be opened here, e.g. a GPU
    /// allocation in a block this process already opened for another buffer): this pair falls
    /// back to frames for good, starting with the range `src..src+len` of the round in progress
    /// (whose announcing frame, counted in `unsent`, is replaced by the data frames).
    pub fn direct_refused(&mut self, out: &mut Actions, req: ReqId, src: usize, len: usize) {
        let Some(&id) = self.sending.get(&req) else { return };
        let Some(max_frame) = self.preps.get(&id).and_then(|p| self.links.get(&p.spec.conn)).map(|l| l.props.max_frame) else { return };
        let p = self.preps.get_mut(&id).expect("live");
        let Some(peer) = p.peer else { return };
        tracing::debug!(target: "gsc::proto", id, "prepared transfer: direct writes refused; sending frames from now on");
        p.direct = false;
        p.unsent = p.unsent.saturating_sub(1);
        send_frames(out, p, peer.id, req, max_frame, src - p.spec.buf.addr, len);
    }

    /// A receive's worker could not map the sender's word page (or shared words are off
    /// there): readiness goes in `PrepReady` frames from now on, starting with the round in
    /// progress (its `RaiseReady` found no page). The sender answers each round the way its
    /// readiness came, so it needs no word of this.
    pub fn words_refused(&mut self, out: &mut Actions, id: PrepId) {
        let Some(p) = self.preps.get_mut(&id) else { return };
        if !p.words {
            return;
        }
        p.words = false;
        tracing::debug!(target: "gsc::proto", id, "prepared transfer: shared words refused here; readiness goes in frames");
        if let (Some(_), Some(peer)) = (p.active, p.peer) {
            transmit(out, p.spec.conn, Header::PrepReady { id: peer.id, round: p.round }, Payload::None, None);
        }
    }

    /// The worker saw send `id`'s shared "ready" word at `value`: the receiver is ready for
    /// every round up to it. (It may come before our pairing: the receiver's hello can still be
    /// in the link when its word moves.) An error is a protocol violation by the peer.
    pub fn ready_word(&mut self, out: &mut Actions, id: PrepId, value: u64) -> Result<()> {
        let Some(p) = self.preps.get_mut(&id) else { return Ok(()) };
        if p.spec.dir != PrepDir::Send || !p.words_offered || value <= p.ready_by_word {
            return Ok(());
        }
        // The receiver begins round k + 1 only after round k's data, which we write only after
        // its readiness: it can never be more than one round ahead of what it readied before.
        if value > p.ready_round + 1 {
            return Err(bad(&format!("ready word at round {value} after round {}", p.ready_round)));
        }
        p.ready_by_word = value;
        p.ready_round = p.ready_round.max(value);
        self.write_ready(out, id);
        Ok(())
    }

    /// The worker saw receive `id`'s shared "arrived" word at `value`: the sender's direct
    /// write of every round up to it is complete and visible. Ends the round in progress when
    /// it is covered. An error is a protocol violation by the peer.
    pub fn arrived_word(&mut self, out: &mut Actions, id: PrepId, value: u64) -> Result<()> {
        let Some(p) = self.preps.get_mut(&id) else { return Ok(()) };
        if p.spec.dir != PrepDir::Recv || !p.words {
            return Ok(());
        }
        if value > p.round {
            return Err(bad(&format!("arrived word at round {value}, but round {} is the last readied", p.round)));
        }
        let (Some(req), Some(peer)) = (p.active, p.peer) else { return Ok(()) };
        if value < p.round {
            return Ok(());
        }
        if p.round_buf.is_some() {
            // A staged round is moved in frames; a word for it is not the sender's to raise.
            return Err(bad("arrived word for a round that goes in frames"));
        }
        // One partition on both sides (shared words need it): the write covered the buffer.
        p.received = peer.len;
        p.arrived[0] = peer.len.min(p.spec.buf.len);
        p.parts_left = 0;
        out.push(end_receive_round(p, req, peer.len));
        self.next_round(out, id);
        Ok(())
    }

    /// Whether the pair's per-round signals go through shared words, once paired (`None`
    /// before): a receive decided at pairing (and stays so unless its worker refused the page);
    /// a send whose receiver has readied a round through its page.
    pub fn shared_words(&self, id: PrepId) -> Option<bool> {
        let p = self.preps.get(&id).filter(|p| !p.released)?;
        p.peer?;
        Some(match p.spec.dir {
            PrepDir::Recv => p.words,
            PrepDir::Send => p.words_offered && p.ready_by_word > 0,
        })
    }

    /// A frame of a send round is in the link.
    pub fn frame_sent(&mut self, out: &mut Actions, req: ReqId) {
        let Some(&id) = self.sending.get(&req) else { return };
        let p = self.preps.get_mut(&id).expect("sending rounds belong to live preparations");
        p.unsent = p.unsent.saturating_sub(1);
        self.maybe_finish_send(out, id);
    }

    /// A direct write of a send round failed: the round fails, and instead of the frame that
    /// would have announced the bytes (counted in `unsent` already) the receiver is told.
    pub fn write_failed(&mut self, out: &mut Actions, req: ReqId, status: Status) {
        let Some(&id) = self.sending.get(&req) else { return };
        let p = self.preps.get_mut(&id).expect("live");
        let Some(peer) = p.peer else { return };
        p.round_error.get_or_insert(status);
        let h = Header::PrepData { id: peer.id, round: p.round, offset: 0, len: 0, flags: PREP_LAST, status: status.code() };
        transmit(out, p.spec.conn, h, Payload::None, Some(req));
    }

    fn maybe_finish_send(&mut self, out: &mut Actions, id: PrepId) {
        let p = self.preps.get_mut(&id).expect("live");
        if p.active.is_none() || p.unsent > 0 || !p.written.iter().all(|w| *w) {
            return;
        }
        let req = p.active.take().expect("checked");
        let status = p.round_error.take().unwrap_or(Status::Ok);
        self.sending.remove(&req);
        p.readied.iter_mut().for_each(|r| *r = false);
        let info = RecvInfo { tag: p.spec.tag, length: p.spec.buf.len };
        out.push(Action::Complete { req, status, info });
        self.next_round(out, id);
    }

    fn next_round(&mut self, out: &mut Actions, id: PrepId) {
        let p = self.preps.get_mut(&id).expect("live");
        match p.queued.pop_front() {
            Some((req, round_buf)) => match p.broken.clone() {
                Some(e) => {
                    out.push(Action::Complete { req, status: e.status(), info: RecvInfo::default() });
                    self.next_round(out, id);
                }
                None => self.begin_round(out, id, req, round_buf),
            },
            None if p.release_when_idle && p.active.is_none() => {
                let _ = self.release(out, id);
            }
            None => {}
        }
    }

    /// Handle a prepared-transfer frame. Errors are protocol violations by the peer.
    pub fn on_frame(&mut self, out: &mut Actions, conn: ConnId, header: Header, payload: &[u8]) -> Result<()> {
        match header {
            Header::PrepHello { tag, seq, id, len, partitions, addr, flags } => {
                let len = usize::try_from(len).map_err(|_| bad("length overflows"))?;
                let partitions = usize::try_from(partitions).ok().filter(|n| *n > 0).ok_or_else(|| bad("zero partitions"))?;
                let recv = flags & PREP_RECV != 0;
                let (payload, words) = if flags & PREP_WORDS != 0 && !recv {
                    let (rest, path) = split_words_trailer(payload)?;
                    (rest, Some(Arc::<str>::from(path)))
                } else {
                    (payload, None)
                };
                let device = if flags & PREP_GPU_ROUNDS != 0 { Some(Arc::new(DeviceHello::decode(payload)?)) } else { None };
                // The proxy rounds' key: the whole payload, or inside the GPU hello.
                let key_bytes = match &device {
                    Some(d) => &d.proxy_key[..],
                    None => payload,
                };
                let key: Option<Arc<[u8]>> = (recv && flags & PREP_DEVICE != 0 && !key_bytes.is_empty()).then(|| Arc::from(key_bytes));
                let gpu_required = device.is_some() && flags & PREP_GPU_REQUIRED != 0;
                let direct_ok = recv && flags & PREP_DIRECT != 0;
                let worker = self.worker_of(conn).ok_or_else(|| bad("hello on an unknown link"))?;
                let peer = Peer { id, len, partitions, addr: (direct_ok || key.is_some()).then_some(addr), conn };
                let h = Hello { worker, seq, key, device, gpu_required, recv, tag, peer, direct_ok, words };
                // Our preparation towards that worker, of the other direction, with this tag
                // and the same sequence number (a broken one lost its link: it pairs no more).
                let links = &self.links;
                let mine = self
                    .preps
                    .iter()
                    .find(|(_, p)| {
                        p.peer.is_none()
                            && p.broken.is_none()
                            && p.seq == seq
                            && (p.spec.dir == PrepDir::Recv) != recv
                            && p.spec.tag == tag
                            && links.get(&p.spec.conn).is_some_and(|l| l.worker == worker)
                    })
                    .map(|(k, _)| *k);
                match mine {
                    Some(mine) => self.pair(out, mine, h),
                    None => self.hellos.push_back(h),
                }
            }
            Header::PrepReady { id, round } => {
                // A stale id (released here) is ignored: the peer learns it from our bye.
                let Some(p) = self.preps.get_mut(&id) else { return Ok(()) };
                if p.peer.is_none_or(|peer| peer.conn != conn) || p.spec.dir != PrepDir::Send {
                    return Err(bad("ready for a preparation that is not a send on this link"));
                }
                if round != p.ready_round + 1 {
                    return Err(bad(&format!("ready for round {round} after round {}", p.ready_round)));
                }
                p.ready_round = round;
                self.write_ready(out, id);
            }
            Header::PrepData { id, round, offset, len, flags, status } => {
                self.on_data(out, conn, id, round, offset, len, flags, status, payload)?
            }
            Header::PrepBye { id } => {
                let Some(p) = self.preps.get_mut(&id) else { return Ok(()) };
                if p.peer.is_none_or(|peer| peer.conn != conn) {
                    return Err(bad("bye on the wrong link"));
                }
                p.broken.get_or_insert_with(|| Error::new(Status::NotConnected, "the peer released its side of the prepared transfer"));
                if p.spec.dir == PrepDir::Send && p.active.is_some() && p.unsent > 0 {
                    // Frames of the round still in the queue read the user's buffer: the round
                    // ends (failed) only once they have left. Nothing more is written.
                    p.round_error = Some(Status::NotConnected);
                    p.written.iter_mut().for_each(|w| *w = true);
                    let queued: Vec<ReqId> = p.queued.drain(..).map(|(r, _)| r).collect();
                    for req in queued {
                        out.push(Action::Complete { req, status: Status::NotConnected, info: RecvInfo::default() });
                    }
                } else {
                    self.fail_rounds(out, id, Status::NotConnected);
                }
            }
            other => return Err(bad(&format!("{other:?} is not a prepared-transfer frame"))),
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn on_data(
        &mut self,
        out: &mut Actions,
        conn: ConnId,
        id: PrepId,
        round: u64,
        offset: u64,
        len: u64,
        flags: u32,
        status: i32,
        payload: &[u8],
    ) -> Result<()> {
        let Some(p) = self.preps.get_mut(&id) else { return Err(bad("data for an unknown preparation")) };
        if p.peer.is_none_or(|peer| peer.conn != conn) || p.spec.dir != PrepDir::Recv {
            return Err(bad("data for a preparation that is not a receive on this link"));
        }
        let (Some(req), Some(peer)) = (p.active, p.peer) else { return Err(bad("data while no round is ready")) };
        if round != p.round {
            return Err(bad(&format!("data for round {round} during round {}", p.round)));
        }
        let (offset, len) = (offset as usize, len as usize);
        if offset.checked_add(len).is_none_or(|end| end > peer.len.min(p.spec.buf.len)) {
            return Err(bad("data past the buffer"));
        }
        let direct = flags & PREP_DIRECT != 0;
        if !direct && payload.len() != len {
            return Err(bad("data frame length disagrees with its header"));
        }
        if status != 0 {
            let s = Status::from_code(status).filter(|s| s.is_error()).unwrap_or(Status::Internal);
            p.round_error.get_or_insert(s);
        } else if !direct && len > 0 {
            let buf = p.buf();
            out.push(Action::CopyFromFrame { dst: buf.addr + offset, mem: buf.mem, src_offset: 0, len });
        }
        p.received += len;
        let pl = p.part_len();
        if pl > 0 && status == 0 {
            for part in offset / pl..=((offset + len).saturating_sub(1) / pl).min(p.arrived.len() - 1) {
                p.arrived[part] += overlap(offset, offset + len, part * pl, (part + 1) * pl);
            }
        }
        if flags & PREP_LAST != 0 {
            if p.parts_left == 0 {
                return Err(bad("more partitions than announced"));
            }
            p.parts_left -= 1;
            if p.parts_left == 0 {
                if p.round_error.is_none() && p.received != peer.len {
                    return Err(bad(&format!("round ended with {} of {} bytes", p.received, peer.len)));
                }
                out.push(end_receive_round(p, req, peer.len));
                self.next_round(out, id);
            }
        }
        Ok(())
    }

    /// End the round in progress and every queued one with `status`.
    fn fail_rounds(&mut self, out: &mut Actions, id: PrepId, status: Status) {
        let Some(p) = self.preps.get_mut(&id) else { return };
        let reqs: Vec<ReqId> = p.active.take().into_iter().chain(p.queued.drain(..).map(|(r, _)| r)).collect();
        if !reqs.is_empty() {
            p.last_ok = false;
        }
        p.readied.iter_mut().for_each(|r| *r = false);
        for req in reqs {
            self.sending.remove(&req);
            out.push(Action::Complete { req, status, info: RecvInfo::default() });
        }
        self.next_round(out, id);
    }

    /// The link is dead: every preparation that sends on it or hears its peer on it is broken,
    /// its rounds fail.
    pub fn conn_failed(&mut self, out: &mut Actions, conn: ConnId, status: Status) {
        let mut ids: Vec<PrepId> = self
            .preps
            .iter()
            .filter(|(_, p)| p.spec.conn == conn || p.peer.is_some_and(|peer| peer.conn == conn))
            .map(|(k, _)| *k)
            .collect();
        ids.sort_unstable();
        for id in ids {
            let p = self.preps.get_mut(&id).expect("listed");
            if p.released {
                self.preps.remove(&id);
                continue;
            }
            p.broken.get_or_insert_with(|| Error::new(status, "the connection of this prepared transfer failed"));
            self.fail_rounds(out, id, status);
        }
        self.hellos.retain(|h| h.peer.conn != conn);
        self.links.remove(&conn);
    }
}
