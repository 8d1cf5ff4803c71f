//! Tagged send/receive: the eager and rendezvous state machines over matching.
//!
//! `TagEngine` does no I/O and reads no clock. The worker feeds it events (a send or receive was
//! posted, a frame arrived, a frame left, a remote read finished, a link failed) and executes the
//! actions it pushes into an `Actions` list: transmit a frame, copy bytes into a user buffer, read
//! the peer's memory, complete a request. Buffers are plain addresses here; the worker owns the
//! unsafe copies. This keeps the whole protocol testable with a loopback in a unit test.
//!
//! Request ids (`ReqId`) are chosen by the worker and echoed on the wire (RTS/RTR/ATS carry them),
//! so they include a generation: a frame naming a request that is gone is ignored, not misrouted.

use super::idmap::IdMap;
use super::matching::{PostedQueue, UnexpectedQueue};
use super::rndv_tuner::{RndvTuner, RndvWay};
use super::select::{self, LaneProps, MemType, ProtoConfig, ProtoId, RndvScheme};
use super::wire::{self, Encoded, Header, RTS_DEVICE_KEY, RTS_LANE_KEY, RTS_REMOTE_MEMORY};
use crate::error::{Error, Result, Status};
use crate::transport::LaneKind;

pub type ConnId = usize;
pub type ReqId = u64;

/// A user buffer: where it is, how long, and in which memory. Validity is the worker's (and the
/// user's) business.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct UserBuf {
    pub addr: usize,
    pub len: usize,
    pub mem: MemType,
}

impl UserBuf {
    pub fn host(addr: usize, len: usize) -> UserBuf {
        UserBuf { addr, len, mem: MemType::Host }
    }

    /// The payload for `self[offset..offset + len]`.
    pub(crate) fn payload(self, offset: usize, len: usize) -> Payload {
        let addr = self.addr + offset;
        match self.mem {
            MemType::Host => Payload::User { addr, len },
            MemType::Cuda => Payload::Device { addr, len },
        }
    }
}

/// What a completed receive reports.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct RecvInfo {
    pub tag: u64,
    /// The sender's message length. On `MessageTruncated` only the receive buffer's length was
    /// written.
    pub length: usize,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Payload {
    None,
    /// Bytes of a user buffer, read when the frame is written into the link.
    User {
        addr: usize,
        len: usize,
    },
    Owned(Vec<u8>),
    /// Bytes of a user buffer in GPU memory: the worker stages them through host memory when it
    /// builds the frame.
    Device {
        addr: usize,
        len: usize,
    },
    /// A `Device` payload the worker has put in a chunk of its host staging pipeline
    /// (core/staging.rs): `len` bytes at `offset` of chunk `chunk`. Never made by the engine.
    Staged {
        chunk: u64,
        offset: usize,
        len: usize,
    },
}

impl Payload {
    pub fn len(&self) -> usize {
        match self {
            Payload::None => 0,
            Payload::User { len, .. } | Payload::Device { len, .. } | Payload::Staged { len, .. } => *len,
            Payload::Owned(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The variant's name, for diagnostics.
    pub fn kind_name(&self) -> &'static str {
        match self {
            Payload::None => "none",
            Payload::User { .. } => "user buffer",
            Payload::Owned(_) => "owned bytes",
            Payload::Device { .. } => "GPU buffer (not staged yet)",
            Payload::Staged { .. } => "staged chunk",
        }
    }
}

#[derive(Debug)]
pub struct OutFrame {
    pub header: Encoded,
    pub payload: Payload,
    /// Report `frame_sent(req)` once this frame is in the link.
    pub on_sent: Option<ReqId>,
    /// The request may complete before the frame leaves: if the frame must wait in a queue, the
    /// worker copies the payload (eager-short semantics: the user buffer is free on return).
    pub copy_if_queued: bool,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Action {
    Transmit {
        conn: ConnId,
        frame: OutFrameEq,
    },
    /// Copy `len` bytes from the payload of the frame being handled, at `src_offset`, to `dst`
    /// (in `mem`).
    CopyFromFrame {
        dst: usize,
        mem: MemType,
        src_offset: usize,
        len: usize,
    },
    /// Copy bytes the engine buffered (an unexpected message) to `dst` (in `mem`) for receive
    /// `req` (which fails instead of completing if the copy cannot be done).
    CopyOwned {
        req: ReqId,
        dst: usize,
        mem: MemType,
        data: Vec<u8>,
    },
    /// Read `len` bytes of the peer's memory at `remote` into `dst`, then call
    /// `remote_read_done` (or `remote_read_refused` when this side cannot reach that memory).
    /// With `device_key`, `remote` is GPU memory the key (the sender's, opaque here) opens;
    /// without, it is host memory of the peer process.
    ReadRemote {
        conn: ConnId,
        dst: UserBuf,
        remote: u64,
        len: usize,
        req: ReqId,
        device_key: Option<Vec<u8>>,
        /// Host memory on a lane that reads by key (`LaneKind::remote_needs_key`): the
        /// sender's link's key for its buffer.
        lane_key: Option<Vec<u8>>,
    },
    /// Write `len` bytes at `src` into the peer's memory at `remote`, then transmit `then`;
    /// if the write fails, report `prepared.write_failed(req)` instead. Without `device_key`
    /// both sides are host memory (cross-memory attach, or one address space); with it both
    /// are GPU memory, `remote` opened by the (receiver's) key and written by the copy engine.
    WriteRemote {
        conn: ConnId,
        src: usize,
        remote: u64,
        len: usize,
        req: ReqId,
        device_key: Option<std::sync::Arc<[u8]>>,
        /// Shared words (protocols/prepared.rs): instead of transmitting `then`, raise the
        /// receiver's "arrived" word in the page of send preparation `.0` to round `.1` once the
        /// write is complete and visible, then report `then.on_sent` as sent.
        arrived_word: Option<(u64, u64)>,
        /// Boxed: the rare large variant would otherwise set the size of every action (all
        /// are moved several times per message).
        then: Box<OutFrameEq>,
    },
    Complete {
        req: ReqId,
        status: Status,
        info: RecvInfo,
    },
    /// Shared words: map the word page of the send paired with receive preparation `id` (at
    /// `path`); if that fails, report `prepared.words_refused(id)`.
    MapWords {
        id: u64,
        path: std::sync::Arc<str>,
    },
    /// Shared words: receive preparation `id` is ready for `round`; raise the page's "ready"
    /// word to it (nothing when the page is not mapped: `words_refused` sent a frame instead).
    RaiseReady {
        id: u64,
        round: u64,
    },
}

/// `OutFrame` compared by content, so tests can assert on actions.
#[derive(Debug)]
pub struct OutFrameEq(pub OutFrame);

impl PartialEq for OutFrameEq {
    fn eq(&self, other: &Self) -> bool {
        self.0.header.as_bytes() == other.0.header.as_bytes()
            && self.0.payload == other.0.payload
            && self.0.on_sent == other.0.on_sent
            && self.0.copy_if_queued == other.0.copy_if_queued
    }
}
impl Eq for OutFrameEq {}

pub type Actions = Vec<Action>;

#[derive(Debug)]
enum SendState {
    /// Frames queued; completes when the last one leaves.
    Frames { conn: ConnId },
    /// RTS sent; waiting for ATS (receiver read it) or RTR (push it).
    AwaitingReceiver { conn: ConnId, buf: UserBuf, max_frame: usize },
}

#[derive(Debug)]
enum RecvState {
    /// Matched an eager message that is still arriving in fragments.
    Eager { conn: ConnId, buf: UserBuf, info: RecvInfo, received: usize },
    /// Matched an RTS; reading the sender's buffer. `tuned`: the tuner chose this way and wants
    /// to hear how long the read took (`remote_read_took`).
    Reading { conn: ConnId, buf: UserBuf, info: RecvInfo, sreq: ReqId, tuned: bool },
    /// Matched an RTS; the sender is pushing `want` bytes. `timer` times it for the tuner.
    Pushed { conn: ConnId, buf: UserBuf, info: RecvInfo, want: usize, received: usize, timer: PushTimer },
}

/// Timing a pushed rendezvous for the tuner: from its first data frame to its last, so that the
/// wait behind earlier messages of a window does not count against pushing (a read is timed
/// around the read itself, for the same reason).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum PushTimer {
    Off,
    AwaitingData,
    /// Clock at the first data frame, and that frame's bytes.
    Since(u64, usize),
}

/// An unexpected (or probed, not yet received) message.
#[derive(Debug)]
struct Unexpected {
    conn: ConnId,
    total: usize,
    body: UnexpectedBody,
    /// Set when the link died before the whole message arrived.
    failed: Option<Status>,
}

#[derive(Debug)]
enum UnexpectedBody {
    /// Eager data received so far (`data.len()` of `total`), still keyed by `msg_id` if partial.
    Eager {
        data: Vec<u8>,
        msg_id: Option<u64>,
    },
    Rts {
        sreq: ReqId,
        remote_addr: u64,
        remote_memory: bool,
        lane_key: Option<Vec<u8>>,
        device_key: Option<Vec<u8>>,
    },
}

/// What a matched RTS offers.
struct RtsFrom {
    sreq: ReqId,
    remote_addr: u64,
    remote_memory: bool,
    lane_key: Option<Vec<u8>>,
    device_key: Option<Vec<u8>>,
}

/// Where the next fragments of a multi-fragment eager message go.
#[derive(Copy, Clone, Debug)]
enum Assembly {
    Recv(ReqId),
    Unexpected(u64),
    Probed(u64),
}

struct ConnState {
    props: LaneProps,
    assembling: IdMap<u64, Assembly>,
    next_msg_id: u64,
}

/// Result of a probe.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ProbeInfo {
    pub tag: u64,
    pub length: usize,
    /// With `remove`, the handle to pass to `msg_recv`.
    pub msg: Option<u64>,
}

pub struct TagEngine {
    cfg: ProtoConfig,
    conns: IdMap<ConnId, ConnState>,
    /// Receives not matched yet, with their buffers (they have no `recvs` entry).
    posted: PostedQueue<(ReqId, UserBuf)>,
    /// Receives that matched a message that is still arriving.
    recvs: IdMap<ReqId, RecvState>,
    unexpected: UnexpectedQueue<Unexpected>,
    probed: IdMap<u64, (u64, Unexpected)>,
    next_probe_id: u64,
    sends: IdMap<ReqId, SendState>,
    /// Host rendezvous on shm under `RndvScheme::Auto`: read or push, by measured speed.
    tuner: RndvTuner,
    /// Nanoseconds on a monotonic clock, for the tuner (replaceable in tests).
    clock: fn() -> u64,
}

fn monotonic_ns() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START.get_or_init(std::time::Instant::now).elapsed().as_nanos() as u64
}

fn header_room(frame: usize, h: &Header) -> usize {
    frame.saturating_sub(h.encoded_len())
}

fn transmit(out: &mut Actions, conn: ConnId, header: Header, payload: Payload, on_sent: Option<ReqId>) {
    let frame = OutFrame { header: header.encode(), payload, on_sent, copy_if_queued: false };
    out.push(Action::Transmit { conn, frame: OutFrameEq(frame) });
}

/// A message delivered by `TagEngine::take_eager_only_match`: copy the payload it returns into
/// `buf`, then complete `req` with `status` and `info`.
#[derive(Copy, Clone, Debug)]
pub struct EagerDelivery {
    pub req: ReqId,
    pub buf: UserBuf,
    pub info: RecvInfo,
    pub status: Status,
}

fn status_of(total: usize, buf: UserBuf) -> Status {
    if total > buf.len { Status::MessageTruncated } else { Status::Ok }
}

impl TagEngine {
    pub fn new(cfg: ProtoConfig) -> TagEngine {
        TagEngine {
            cfg,
            conns: IdMap::default(),
            posted: PostedQueue::default(),
            recvs: IdMap::default(),
            unexpected: UnexpectedQueue::default(),
            probed: IdMap::default(),
            next_probe_id: 1,
            sends: IdMap::default(),
            tuner: RndvTuner::default(),
            clock: monotonic_ns,
        }
    }

    /// Replace the tuner's clock (tests drive it by hand).
    #[cfg(test)]
    pub(crate) fn set_clock(&mut self, clock: fn() -> u64) {
        self.clock = clock;
    }

    pub fn config(&self) -> &ProtoConfig {
        &self.cfg
    }

    pub fn add_conn(&mut self, conn: ConnId, props: LaneProps) {
        self.conns.insert(conn, ConnState { props, assembling: IdMap::default(), next_msg_id: 0 });
    }

    /// Requests the engine still tracks (sends awaiting completion, matched or posted receives).
    pub fn in_flight(&self) -> usize {
        self.sends.len() + self.recvs.len() + self.posted.len()
    }

    /// The link a matched receive is tied to (posted, unmatched receives have none).
    pub fn conn_of(&self, req: ReqId) -> Option<ConnId> {
        match self.recvs.get(&req)? {
            RecvState::Eager { conn, .. } | RecvState::Reading { conn, .. } | RecvState::Pushed { conn, .. } => Some(*conn),
        }
    }

    /// Sends still in progress on `conn` (a flushing close waits for zero).
    pub fn sends_on(&self, conn: ConnId) -> usize {
        self.sends
            .values()
            .filter(|s| matches!(s, SendState::Frames { conn: c } | SendState::AwaitingReceiver { conn: c, .. } if *c == conn))
            .count()
    }

    /// Where request `req` stands, in words, for the error a stuck one ends with (issue #7:
    /// a stall should say what it waited for). `None`: the engine holds nothing for it.
    pub fn describe(&self, req: ReqId) -> Option<String> {
        if let Some(tag) = self.posted.tag_of(|&(r, _)| r == req) {
            return Some(format!(
                "receive posted with tag {tag:#x}, no message matched it ({} unexpected messages held)",
                self.unexpected.len()
            ));
        }
        if let Some(r) = self.recvs.get(&req) {
            return Some(match r {
                RecvState::Eager { conn, buf, received, .. } => {
                    format!("receiving an eager message on link {conn}: {received} of up to {} bytes", buf.len)
                }
                RecvState::Reading { conn, .. } => format!("reading the sender's buffer on link {conn}"),
                RecvState::Pushed { conn, want, received, .. } => {
                    format!("rendezvous pushed on link {conn}: {received} of {want} bytes arrived")
                }
            });
        }
        self.sends.get(&req).map(|s| match s {
            SendState::Frames { conn } => format!("send: frames queued on link {conn}"),
            SendState::AwaitingReceiver { conn, buf, .. } => {
                format!("rendezvous send of {} bytes on link {conn}: waiting for the receiver to match it", buf.len)
            }
        })
    }

    pub fn unexpected_len(&self) -> usize {
        self.unexpected.len()
    }

    /// The protocol a send of `buf` on `conn` would use (what `send` will pick).
    pub fn protocol_for(&self, conn: ConnId, buf: UserBuf) -> Result<ProtoId> {
        let cs = self
            .conns
            .get(&conn)
            .ok_or_else(|| Error::new(Status::NotConnected, "send on a connection the protocol layer does not know"))?;
        select::select(&self.cfg, buf.mem, &cs.props, buf.len)
    }

    /// The largest host send that goes eager-short on a link with `props` (see
    /// `select::eager_short_limit`). Such a send keeps no state here and is complete once its
    /// frame (`wire::eager_only_header`, then the data) is in the link, so the worker may write
    /// it straight into the link (its fast path) instead of going through `send`'s actions.
    pub fn eager_short_limit(&self, props: &LaneProps) -> Option<usize> {
        select::eager_short_limit(&self.cfg, props)
    }

    fn short_header(tag: u64) -> Encoded {
        Header::EagerOnly { tag }.encode()
    }

    /// Start a tagged send. Selection errors leave the engine unchanged. `device_key` opens a GPU
    /// buffer for the receiver (rendezvous only); without one the receiver asks for a push.
    pub fn send(
        &mut self,
        out: &mut Actions,
        conn: ConnId,
        req: ReqId,
        tag: u64,
        buf: UserBuf,
        device_key: Option<Vec<u8>>,
    ) -> Result<ProtoId> {
        let cs = self
            .conns
            .get_mut(&conn)
            .ok_or_else(|| Error::new(Status::NotConnected, "send on a connection the protocol layer does not know"))?;
        let props = cs.props;
        let proto = select::select(&self.cfg, buf.mem, &props, buf.len)?;
        match proto {
            ProtoId::EagerShort => {
                let header = Self::short_header(tag);
                // The frame either goes into the link now or is copied into the queue by the
                // worker (`copy_if_queued`), so the send is complete as soon as it is handed over:
                // no send state, no sent notification.
                let frame = OutFrame { header, payload: buf.payload(0, buf.len), on_sent: None, copy_if_queued: true };
                out.push(Action::Transmit { conn, frame: OutFrameEq(frame) });
                out.push(Action::Complete { req, status: Status::Ok, info: RecvInfo::default() });
            }
            ProtoId::EagerCopy => {
                let only = Header::EagerOnly { tag };
                if buf.len <= header_room(props.max_frame, &only) {
                    transmit(out, conn, only, buf.payload(0, buf.len), Some(req));
                } else {
                    let msg_id = cs.next_msg_id;
                    cs.next_msg_id += 1;
                    let first = Header::EagerFirst { tag, msg_id, total: buf.len as u64 };
                    let n0 = header_room(props.max_frame, &first);
                    transmit(out, conn, first, buf.payload(0, n0), None);
                    push_fragments(out, conn, buf, n0, props.max_frame, req, |offset| Header::EagerNext { msg_id, offset });
                }
                self.sends.insert(req, SendState::Frames { conn });
            }
            ProtoId::RndvGet | ProtoId::RndvPipeline => {
                let (flags, payload) = match (proto, buf.mem, device_key) {
                    (ProtoId::RndvGet, MemType::Cuda, Some(key)) => (RTS_DEVICE_KEY, Payload::Owned(key)),
                    // A lane that reads by key: the key from the sender's link (the worker
                    // passes it in `device_key`'s place for host memory); without one (the
                    // registration failed) the receiver asks for a push.
                    (ProtoId::RndvGet, MemType::Host, Some(key)) => (RTS_REMOTE_MEMORY | RTS_LANE_KEY, Payload::Owned(key)),
                    (ProtoId::RndvGet, MemType::Host, None) if !props.lane.remote_needs_key() => (RTS_REMOTE_MEMORY, Payload::None),
                    _ => (0, Payload::None),
                };
                let h = Header::Rts { tag, sreq: req, total: buf.len as u64, remote_addr: buf.addr as u64, flags };
                transmit(out, conn, h, payload, None);
                self.sends.insert(req, SendState::AwaitingReceiver { conn, buf, max_frame: props.max_frame });
            }
        }
        Ok(proto)
    }

    /// Post a receive for messages matching `(tag, mask)`.
    pub fn recv(&mut self, out: &mut Actions, req: ReqId, tag: u64, mask: u64, buf: UserBuf) {
        if let Some(seq) = self.unexpected.find(tag, mask) {
            let (msg_tag, u) = self.unexpected.take(seq).expect("found entry exists");
            self.match_unexpected(out, req, msg_tag, u, buf);
        } else {
            self.posted.post(tag, mask, (req, buf));
        }
    }

    /// Whether a message that a receive for `(tag, mask)` would take is already here.
    pub fn has_unexpected_match(&mut self, tag: u64, mask: u64) -> bool {
        self.unexpected.find(tag, mask).is_some()
    }

    /// `recv` when `has_unexpected_match` said no: the receive waits for its message. Emits
    /// nothing, so the worker's fast path needs no action list.
    pub fn post(&mut self, req: ReqId, tag: u64, mask: u64, buf: UserBuf) {
        debug_assert!(!self.has_unexpected_match(tag, mask), "post would overtake a waiting message");
        self.posted.post(tag, mask, (req, buf));
    }

    /// Look for an unexpected message; with `remove`, take it out of matching for `msg_recv`.
    pub fn probe(&mut self, tag: u64, mask: u64, remove: bool) -> Option<ProbeInfo> {
        let seq = self.unexpected.find(tag, mask)?;
        let (msg_tag, total) = {
            let (t, u) = self.unexpected.get(seq)?;
            (*t, u.total)
        };
        if !remove {
            return Some(ProbeInfo { tag: msg_tag, length: total, msg: None });
        }
        let (t, u) = self.unexpected.take(seq)?;
        let id = self.next_probe_id;
        self.next_probe_id += 1;
        self.redirect_assembly(&u, Assembly::Probed(id));
        self.probed.insert(id, (t, u));
        Some(ProbeInfo { tag: msg_tag, length: total, msg: Some(id) })
    }

    /// Receive a message taken by `probe(.., remove = true)`.
    pub fn msg_recv(&mut self, out: &mut Actions, req: ReqId, msg: u64, buf: UserBuf) -> Result<()> {
        let (tag, u) = self
            .probed
            .remove(&msg)
            .ok_or_else(|| Error::new(Status::InvalidHandle, format!("message handle {msg} is unknown or already received")))?;
        self.match_unexpected(out, req, tag, u, buf);
        Ok(())
    }

    /// Cancel a receive that has not matched yet. Matched receives and started sends cannot be
    /// withdrawn: the peer may already be writing.
    pub fn cancel(&mut self, out: &mut Actions, req: ReqId) -> Result<()> {
        if self.posted.remove(|&(r, _)| r == req).is_some() {
            out.push(Action::Complete { req, status: Status::Canceled, info: RecvInfo::default() });
            return Ok(());
        }
        match self.recvs.get(&req) {
            Some(_) => Err(Error::new(Status::Busy, "the receive already matched a message; it can no longer be canceled")),
            None if self.sends.contains_key(&req) => Err(Error::new(Status::Busy, "a send that has started cannot be canceled")),
            None => Err(Error::new(Status::InvalidHandle, "request is not in progress")),
        }
    }

    /// Where receive `req` stands: `Some(None)` posted and unmatched (withdrawn here and
    /// completed with `status`), `Some(Some(conn))` matched and moving data on `conn`, `None`
    /// not a receive in progress.
    pub fn expire_recv(&mut self, out: &mut Actions, req: ReqId, status: Status) -> Option<Option<ConnId>> {
        if self.posted.remove(|&(r, _)| r == req).is_some() {
            out.push(Action::Complete { req, status, info: RecvInfo::default() });
            return Some(None);
        }
        match self.recvs.get(&req)? {
            RecvState::Eager { conn, .. } | RecvState::Reading { conn, .. } | RecvState::Pushed { conn, .. } => Some(Some(*conn)),
        }
    }

    /// Complete every posted receive that has not matched with `status` (an aborted worker).
    pub fn fail_posted(&mut self, out: &mut Actions, status: Status) {
        while let Some((req, _)) = self.posted.remove(|_| true) {
            out.push(Action::Complete { req, status, info: RecvInfo::default() });
        }
    }

    /// The frame carrying `on_sent = req` is in the link.
    pub fn frame_sent(&mut self, out: &mut Actions, req: ReqId) {
        if let Some(SendState::Frames { .. }) = self.sends.get(&req) {
            self.sends.remove(&req);
            out.push(Action::Complete { req, status: Status::Ok, info: RecvInfo::default() });
        }
    }

    /// This side cannot read the memory a `ReadRemote` named (no GPU here, the key does not
    /// open, the peer is not reachable by the copy engine): ask the sender to push instead.
    pub fn remote_read_refused(&mut self, out: &mut Actions, req: ReqId) {
        let Some(RecvState::Reading { conn, buf, info, sreq, .. }) = self.recvs.remove(&req) else { return };
        let want = info.length.min(buf.len);
        transmit(out, conn, Header::Rtr { sreq, rreq: req, len: want as u64 }, Payload::None, None);
        // Not timed: a fallback after a refusal says nothing about how fast pushing is.
        self.recvs.insert(req, RecvState::Pushed { conn, buf, info, want, received: 0, timer: PushTimer::Off });
    }

    /// A host `ReadRemote` took `ns` (the worker times the read itself); call before
    /// `remote_read_done`. Counts only when the tuner chose the read.
    pub fn remote_read_took(&mut self, req: ReqId, ns: u64) {
        if let Some(RecvState::Reading { buf, info, tuned: true, .. }) = self.recvs.get(&req) {
            self.tuner.record(info.length.min(buf.len), RndvWay::Read, ns);
        }
    }

    /// A `ReadRemote` finished.
    pub fn remote_read_done(&mut self, out: &mut Actions, req: ReqId, result: Result<()>) {
        let Some(RecvState::Reading { conn, buf, info, sreq, .. }) = self.recvs.remove(&req) else { return };
        let status = match &result {
            Ok(()) => Status::Ok,
            Err(e) => {
                tracing::debug!(target: "gsc::proto", req, error = %e, "rendezvous read failed");
                e.status()
            }
        };
        transmit(out, conn, Header::Ats { sreq, status: status.code() }, Payload::None, None);
        let final_status = if status == Status::Ok { status_of(info.length, buf) } else { status };
        out.push(Action::Complete { req, status: final_status, info });
    }

    /// Handle one received frame. Errors mean the peer violated the protocol; the worker should
    /// treat the link as failed.
    pub fn on_frame(&mut self, out: &mut Actions, conn: ConnId, header: Header, payload: &[u8]) -> Result<()> {
        match header {
            Header::EagerOnly { tag } => {
                let u =
                    Unexpected { conn, total: payload.len(), body: UnexpectedBody::Eager { data: Vec::new(), msg_id: None }, failed: None };
                self.arrive(out, conn, tag, u, payload, None);
            }
            Header::EagerFirst { tag, msg_id, total } => {
                let total = usize::try_from(total).map_err(|_| protocol_error("eager message length overflows"))?;
                if payload.len() > total {
                    return Err(protocol_error("eager first fragment longer than its message"));
                }
                let u = Unexpected { conn, total, body: UnexpectedBody::Eager { data: Vec::new(), msg_id: Some(msg_id) }, failed: None };
                self.arrive(out, conn, tag, u, payload, Some(msg_id));
            }
            Header::EagerNext { msg_id, offset } => self.eager_fragment(out, conn, msg_id, offset as usize, payload)?,
            Header::Rts { tag, sreq, total, remote_addr, flags } => {
                let total = usize::try_from(total).map_err(|_| protocol_error("rendezvous length overflows"))?;
                let device_key = (flags & RTS_DEVICE_KEY != 0).then(|| payload.to_vec());
                let lane_key = (flags & RTS_LANE_KEY != 0 && flags & RTS_DEVICE_KEY == 0).then(|| payload.to_vec());
                let remote_memory = flags & RTS_REMOTE_MEMORY != 0;
                let u = Unexpected {
                    conn,
                    total,
                    body: UnexpectedBody::Rts { sreq, remote_addr, remote_memory, lane_key, device_key },
                    failed: None,
                };
                self.arrive(out, conn, tag, u, &[], None);
            }
            Header::Rtr { sreq, rreq, len } => {
                let Some(SendState::AwaitingReceiver { conn: c, buf, max_frame }) = self.sends.get(&sreq) else {
                    tracing::debug!(target: "gsc::proto", sreq, "RTR for a send that is gone; ignored");
                    return Ok(());
                };
                let (c, buf, max_frame) = (*c, *buf, *max_frame);
                if c != conn {
                    return Err(protocol_error("RTR arrived on a different link than its RTS"));
                }
                let len = (len as usize).min(buf.len);
                let part = UserBuf { len, ..buf };
                push_fragments(out, conn, part, 0, max_frame, sreq, |offset| Header::RndvData { rreq, offset });
                self.sends.insert(sreq, SendState::Frames { conn });
            }
            Header::RndvData { rreq, offset } => {
                let Some(RecvState::Pushed { conn: c, buf, want, received, timer, .. }) = self.recvs.get_mut(&rreq) else {
                    return Err(protocol_error("rendezvous data for an unknown receive"));
                };
                let offset = offset as usize;
                // Frames of one link arrive in order, so data must continue exactly where the
                // last frame ended: a duplicate or a gap would complete the receive early.
                if *c != conn || offset != *received || offset.checked_add(payload.len()).is_none_or(|end| end > *want) {
                    return Err(protocol_error("rendezvous data out of order or outside the receive window"));
                }
                out.push(Action::CopyFromFrame { dst: buf.addr + offset, mem: buf.mem, src_offset: 0, len: payload.len() });
                if *timer == PushTimer::AwaitingData {
                    *timer = PushTimer::Since((self.clock)(), payload.len());
                }
                *received += payload.len();
                if *received >= *want
                    && let Some(RecvState::Pushed { buf, info, want, timer, .. }) = self.recvs.remove(&rreq)
                {
                    if let PushTimer::Since(t0, first) = timer
                        && want > first
                    {
                        // The frames after the first took this long; scaled to the whole
                        // message (the first frame's own transfer was not seen).
                        let ns = (self.clock)().saturating_sub(t0) as u128 * want as u128 / (want - first) as u128;
                        self.tuner.record(want, RndvWay::Push, ns.min(u64::MAX as u128) as u64);
                    }
                    out.push(Action::Complete { req: rreq, status: status_of(info.length, buf), info });
                }
            }
            Header::Ats { sreq, status } => {
                if let Some(SendState::AwaitingReceiver { .. }) = self.sends.get(&sreq) {
                    self.sends.remove(&sreq);
                    // The receiver's trouble (e.g. it could not read our buffer) is ours too; a
                    // truncation at the receiver is not the sender's error.
                    let s = Status::from_code(status).unwrap_or(Status::Internal);
                    let s = if s == Status::MessageTruncated { Status::Ok } else { s };
                    out.push(Action::Complete { req: sreq, status: s, info: RecvInfo::default() });
                }
            }
            other => return Err(protocol_error(&format!("frame {other:?} is not a tag protocol frame"))),
        }
        Ok(())
    }

    /// A message envelope arrived: match it or queue it as unexpected.
    /// The whole of `on_frame` + `arrive` + `eager_progress` for the commonest frame, an
    /// eager-only message that a posted receive is waiting for: take the receive and say where
    /// the payload goes. The caller copies it and completes the request, with no actions in
    /// between (this is the receive half of small-message latency). `None` for any other frame
    /// or when nothing is posted for it; then `on_frame` does the same work the general way.
    pub fn take_eager_only_match<'f>(&mut self, frame: &'f [u8]) -> Option<(EagerDelivery, &'f [u8])> {
        let (tag, payload) = wire::eager_only(frame)?;
        let (req, buf) = self.posted.take_match(tag)?;
        let info = RecvInfo { tag, length: payload.len() };
        let copy = payload.len().min(buf.len);
        Some((EagerDelivery { req, buf, info, status: status_of(payload.len(), buf) }, &payload[..copy]))
    }

    fn arrive(&mut self, out: &mut Actions, conn: ConnId, tag: u64, mut u: Unexpected, first: &[u8], msg_id: Option<u64>) {
        if let Some((req, buf)) = self.posted.take_match(tag) {
            let info = RecvInfo { tag, length: u.total };
            match u.body {
                UnexpectedBody::Eager { .. } => {
                    copy_clipped(out, buf, 0, first, CopySrc::Frame);
                    self.eager_progress(out, conn, req, buf, info, first.len(), msg_id);
                }
                UnexpectedBody::Rts { sreq, remote_addr, remote_memory, lane_key, device_key } => {
                    self.match_rts(out, conn, req, buf, info, RtsFrom { sreq, remote_addr, remote_memory, lane_key, device_key });
                }
            }
        } else {
            if let UnexpectedBody::Eager { data, .. } = &mut u.body {
                data.extend_from_slice(first);
            }
            let complete = !matches!(u.body, UnexpectedBody::Eager { .. }) || first.len() >= u.total;
            let seq = self.unexpected.push(tag, u);
            if let (Some(id), false) = (msg_id, complete)
                && let Some(cs) = self.conns.get_mut(&conn)
            {
                cs.assembling.insert(id, Assembly::Unexpected(seq));
            }
        }
    }

    /// Eager data of a matched receive: complete it or remember where the rest goes.
    #[allow(clippy::too_many_arguments)]
    fn eager_progress(
        &mut self,
        out: &mut Actions,
        conn: ConnId,
        req: ReqId,
        buf: UserBuf,
        info: RecvInfo,
        received: usize,
        msg_id: Option<u64>,
    ) {
        if received >= info.length {
            out.push(Action::Complete { req, status: status_of(info.length, buf), info });
            if let (Some(id), Some(cs)) = (msg_id, self.conns.get_mut(&conn)) {
                cs.assembling.remove(&id);
            }
        } else {
            self.recvs.insert(req, RecvState::Eager { conn, buf, info, received });
            if let (Some(id), Some(cs)) = (msg_id, self.conns.get_mut(&conn)) {
                cs.assembling.insert(id, Assembly::Recv(req));
            }
        }
    }

    fn match_rts(&mut self, out: &mut Actions, conn: ConnId, req: ReqId, buf: UserBuf, info: RecvInfo, rts: RtsFrom) {
        let RtsFrom { sreq, remote_addr, remote_memory, lane_key, device_key } = rts;
        let want = info.length.min(buf.len);
        let local = self.conns.get(&conn).map(|c| c.props);
        // On a lane that reads by key, only with the key.
        let keyed = lane_key.is_some() || local.is_some_and(|p| !p.lane.remote_needs_key());
        let host_read = remote_memory && keyed && local.is_some_and(|p| p.remote_memory) && buf.mem == MemType::Host;
        // How a host read offer is taken: as the knob says, except that under Auto on shm the
        // tuner decides (and the transfer is timed for it). Loopback reads are one memcpy.
        let (read, tuned) = match (host_read, self.cfg.rndv_scheme) {
            _ if device_key.is_some() => (true, false),
            (false, _) => (false, false),
            (true, RndvScheme::Pipeline) => (false, false),
            (true, RndvScheme::Auto) if local.is_some_and(|p| p.lane == LaneKind::Shm) => (self.tuner.choose(want) == RndvWay::Read, true),
            (true, _) => (true, false),
        };
        if want == 0 {
            // Nothing to move (empty message or empty buffer): release the sender at once.
            transmit(out, conn, Header::Ats { sreq, status: Status::Ok.code() }, Payload::None, None);
            out.push(Action::Complete { req, status: status_of(info.length, buf), info });
        } else if read {
            // GPU memory is read by the copy engine through the key; host memory by the lane's
            // remote read (which cannot write into GPU memory, hence the host-only condition).
            self.recvs.insert(req, RecvState::Reading { conn, buf, info, sreq, tuned });
            out.push(Action::ReadRemote { conn, dst: buf, remote: remote_addr, len: want, req, device_key, lane_key });
        } else {
            transmit(out, conn, Header::Rtr { sreq, rreq: req, len: want as u64 }, Payload::None, None);
            let timer = if tuned { PushTimer::AwaitingData } else { PushTimer::Off };
            self.recvs.insert(req, RecvState::Pushed { conn, buf, info, want, received: 0, timer });
        }
    }

    /// A receive met a message that was already (partly) here.
    fn match_unexpected(&mut self, out: &mut Actions, req: ReqId, tag: u64, u: Unexpected, buf: UserBuf) {
        let info = RecvInfo { tag, length: u.total };
        if let Some(status) = u.failed {
            out.push(Action::Complete { req, status, info });
            return;
        }
        match u.body {
            UnexpectedBody::Eager { data, msg_id } => {
                let received = data.len();
                copy_clipped(out, buf, 0, &data, CopySrc::Owned(req));
                self.eager_progress(out, u.conn, req, buf, info, received, msg_id);
            }
            UnexpectedBody::Rts { sreq, remote_addr, remote_memory, lane_key, device_key } => {
                self.match_rts(out, u.conn, req, buf, info, RtsFrom { sreq, remote_addr, remote_memory, lane_key, device_key });
            }
        }
    }

    fn redirect_assembly(&mut self, u: &Unexpected, to: Assembly) {
        if let UnexpectedBody::Eager { msg_id: Some(id), .. } = u.body
            && let Some(cs) = self.conns.get_mut(&u.conn)
            && let Some(a) = cs.assembling.get_mut(&id)
        {
            *a = to;
        }
    }

    fn eager_fragment(&mut self, out: &mut Actions, conn: ConnId, msg_id: u64, offset: usize, payload: &[u8]) -> Result<()> {
        let target = self
            .conns
            .get(&conn)
            .and_then(|c| c.assembling.get(&msg_id).copied())
            .ok_or_else(|| protocol_error("eager fragment for a message that is not being assembled"))?;
        match target {
            Assembly::Recv(req) => {
                let Some(RecvState::Eager { buf, info, received, .. }) = self.recvs.get_mut(&req) else {
                    return Err(protocol_error("eager fragment for a receive in the wrong state"));
                };
                if offset != *received || offset.checked_add(payload.len()).is_none_or(|end| end > info.length) {
                    return Err(protocol_error("eager fragment out of order or past the end of its message"));
                }
                let (buf, info) = (*buf, *info);
                copy_clipped(out, buf, offset, payload, CopySrc::Frame);
                *received += payload.len();
                let received = *received;
                if received >= info.length {
                    self.recvs.remove(&req);
                    self.eager_progress(out, conn, req, buf, info, received, Some(msg_id));
                }
            }
            Assembly::Unexpected(_) | Assembly::Probed(_) => {
                let held = match target {
                    Assembly::Unexpected(seq) => self.unexpected.get_mut(seq).map(|(_, u)| u),
                    Assembly::Probed(id) => self.probed.get_mut(&id).map(|(_, u)| u),
                    Assembly::Recv(_) => unreachable!("handled above"),
                };
                let u = held.ok_or_else(|| protocol_error("fragment for a vanished message"))?;
                if append_fragment(u, offset, payload)? {
                    // Complete: no more fragments will name this message id.
                    if let Some(cs) = self.conns.get_mut(&conn) {
                        cs.assembling.remove(&msg_id);
                    }
                }
            }
        }
        Ok(())
    }

    /// The link `conn` is dead: every request that needs it completes with `status`, partial
    /// unexpected messages from it are dropped (complete ones stay receivable), and it is
    /// forgotten.
    pub fn conn_failed(&mut self, out: &mut Actions, conn: ConnId, status: Status) {
        let mut failed_sends: Vec<ReqId> = self
            .sends
            .iter()
            .filter(|(_, s)| matches!(s, SendState::Frames { conn: c } | SendState::AwaitingReceiver { conn: c, .. } if *c == conn))
            .map(|(r, _)| *r)
            .collect();
        failed_sends.sort_unstable();
        for req in failed_sends {
            self.sends.remove(&req);
            out.push(Action::Complete { req, status, info: RecvInfo::default() });
        }
        let mut failed_recvs: Vec<(ReqId, RecvInfo)> = self
            .recvs
            .iter()
            .filter_map(|(r, s)| match s {
                RecvState::Eager { conn: c, info, .. }
                | RecvState::Reading { conn: c, info, .. }
                | RecvState::Pushed { conn: c, info, .. }
                    if *c == conn =>
                {
                    Some((*r, *info))
                }
                _ => None,
            })
            .collect();
        failed_recvs.sort_unstable_by_key(|(r, _)| *r);
        for (req, info) in failed_recvs {
            self.recvs.remove(&req);
            out.push(Action::Complete { req, status, info });
        }
        self.unexpected.retain(|u| u.conn != conn || is_complete(u));
        for (_, u) in self.probed.values_mut() {
            if u.conn == conn && !is_complete(u) {
                u.failed = Some(status);
            }
        }
        self.conns.remove(&conn);
    }
}

fn is_complete(u: &Unexpected) -> bool {
    match &u.body {
        UnexpectedBody::Eager { data, .. } => data.len() >= u.total,
        // An RTS needs the sender to move its data; it is useless once the link is gone.
        UnexpectedBody::Rts { .. } => false,
    }
}

/// Append an in-order fragment to a held message; returns whether the message is now complete
/// (and then forgets its message id).
fn append_fragment(u: &mut Unexpected, offset: usize, payload: &[u8]) -> Result<bool> {
    let UnexpectedBody::Eager { data, msg_id } = &mut u.body else {
        return Err(protocol_error("eager fragment for a rendezvous message"));
    };
    // Fragments of one message arrive in order on one link; anything else is a broken peer.
    if offset != data.len() || offset + payload.len() > u.total {
        return Err(protocol_error("eager fragment out of order or past the end of its message"));
    }
    data.extend_from_slice(payload);
    let complete = data.len() >= u.total;
    if complete {
        *msg_id = None;
    }
    Ok(complete)
}

enum CopySrc {
    Frame,
    /// Buffered bytes for this receive.
    Owned(ReqId),
}

/// Copy `data` (which belongs at `offset` of the message) into `buf`, writing nothing past the
/// buffer's end: truncation keeps the bytes that fit.
fn copy_clipped(out: &mut Actions, buf: UserBuf, offset: usize, data: &[u8], src: CopySrc) {
    if offset >= buf.len || data.is_empty() {
        return;
    }
    let n = data.len().min(buf.len - offset);
    let (dst, mem) = (buf.addr + offset, buf.mem);
    match src {
        CopySrc::Frame => out.push(Action::CopyFromFrame { dst, mem, src_offset: 0, len: n }),
        CopySrc::Owned(req) => out.push(Action::CopyOwned { req, dst, mem, data: data[..n].to_vec() }),
    }
}

/// Frames for `buf[start..]`, each as large as the frame allows; the last reports `req` sent.
fn push_fragments(
    out: &mut Actions,
    conn: ConnId,
    buf: UserBuf,
    start: usize,
    max_frame: usize,
    req: ReqId,
    header_at: impl Fn(u64) -> Header,
) {
    let mut offset = start;
    if offset >= buf.len {
        // Nothing left to push: completion rides on an empty last frame only if none was sent.
        if start == 0 {
            transmit(out, conn, header_at(0), Payload::None, Some(req));
        } else if let Some(Action::Transmit { frame, .. }) = out.last_mut() {
            frame.0.on_sent = Some(req);
        }
        return;
    }
    while offset < buf.len {
        let h = header_at(offset as u64);
        let n = header_room(max_frame, &h).min(buf.len - offset);
        let last = offset + n >= buf.len;
        transmit(out, conn, h, buf.payload(offset, n), last.then_some(req));
        offset += n;
    }
}

fn protocol_error(what: &str) -> Error {
    Error::new(Status::ConnectionReset, format!("protocol violation by peer: {what}"))
}
