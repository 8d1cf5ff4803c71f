//! Frame headers exchanged between workers.
//!
//! Every frame on a link starts with a fixed little-endian header whose first byte is the kind;
//! the rest of the frame (if any) is payload. The decoder trusts nothing: a short frame, an
//! unknown kind or an impossible length is a `WireError`, never a panic, because the bytes come
//! from another process.

use std::fmt;

/// Largest header we ever encode; headers are built on the stack in a buffer of this size.
pub const MAX_HEADER: usize = 64;

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Header {
    /// A whole tagged message in one frame; the payload is the data.
    EagerOnly {
        tag: u64,
    },
    /// First fragment of a multi-fragment eager message; later ones are `EagerNext`.
    EagerFirst {
        tag: u64,
        msg_id: u64,
        total: u64,
    },
    /// A later eager fragment, at `offset` in the message.
    EagerNext {
        msg_id: u64,
        offset: u64,
    },
    /// Rendezvous request to send: the receiver matches it, then fetches the data itself
    /// (`remote_addr` is the sender's buffer, valid when `flags & RTS_REMOTE_MEMORY` or
    /// `RTS_DEVICE_KEY`) or asks for it to be pushed (`Rtr`).
    Rts {
        tag: u64,
        sreq: u64,
        total: u64,
        remote_addr: u64,
        flags: u32,
    },
    /// Ready to receive: push `len` bytes of `sreq` as `RndvData` frames addressed to `rreq`.
    Rtr {
        sreq: u64,
        rreq: u64,
        len: u64,
    },
    /// Pushed rendezvous data for `rreq`, at `offset`.
    RndvData {
        rreq: u64,
        offset: u64,
    },
    /// Rendezvous done at the receiver (data fetched or refused): the sender may complete.
    Ats {
        sreq: u64,
        status: i32,
    },
    /// Emulated put (target writes the payload at `addr`, inside memory region `region`).
    Put {
        region: u64,
        addr: u64,
    },
    /// Emulated get: target answers with `GetData` frames for `req`.
    GetReq {
        req: u64,
        region: u64,
        addr: u64,
        len: u64,
    },
    GetData {
        req: u64,
        offset: u64,
        status: i32,
    },
    /// Flush: the target answers once every earlier frame on this link has been applied, with
    /// the first error any emulated remote access since the previous flush met.
    FlushReq {
        id: u64,
    },
    FlushAck {
        id: u64,
        status: i32,
    },
    /// The sending side closed its endpoint; no more frames follow.
    Close,
    /// A prepared transfer announces itself (sent once, at prepare time): the peer pairs it
    /// with its own preparation of the opposite direction and the same tag, in creation order.
    /// `addr` is a receive buffer the peer may write directly (`PREP_DIRECT`).
    PrepHello {
        tag: u64,
        /// The announcing side's count of preparations of this direction and tag towards this
        /// worker (0, 1, ...): preparations pair by it, whatever link carried the hello.
        seq: u64,
        id: u64,
        len: u64,
        partitions: u64,
        addr: u64,
        flags: u32,
    },
    /// The receiver of prepared transfer `id` (the frame's addressee's id) is ready for `round`.
    PrepReady {
        id: u64,
        round: u64,
    },
    /// Bytes `offset..offset + len` of `round` for prepared receive `id`: in the payload, or
    /// already written into the receive buffer (`PREP_DIRECT`). `PREP_LAST` ends one of the
    /// sender's partitions; a nonzero `status` fails the round.
    PrepData {
        id: u64,
        round: u64,
        offset: u64,
        len: u64,
        flags: u32,
        status: i32,
    },
    /// The peer released its side of prepared transfer `id`.
    PrepBye {
        id: u64,
    },
}

/// PrepHello flag: the announcing side receives.
pub const PREP_RECV: u32 = 1;
/// PrepHello: `addr` may be written directly. PrepData: the bytes were written directly.
pub const PREP_DIRECT: u32 = 2;
/// PrepData: the last frame of one of the sender's partitions.
pub const PREP_LAST: u32 = 4;
/// PrepHello: `addr` is GPU memory and the payload is the key that opens it (see cuda/ipc.rs);
/// the sender writes it with its copy engine.
pub const PREP_DEVICE: u32 = 8;
/// PrepHello: the announcing side offers to run the rounds on the GPU (the pair does when both
/// offer); the payload is its control block and keys (see `protocols::prepared::DeviceHello`).
pub const PREP_GPU_ROUNDS: u32 = 16;
/// PrepHello, with `PREP_GPU_ROUNDS`: the announcing side requires GPU rounds (its kernels drive
/// them): a peer that cannot offer them fails the pair instead of falling back to the proxy.
pub const PREP_GPU_REQUIRED: u32 = 32;
/// PrepHello of a send: the announcing side made a shared word page (processes of one host)
/// where the receiver raises "ready" and the sender raises "arrived", each round's number, so
/// no frame crosses the link per round. The page's path ends the payload: its bytes, then their
/// count as a little-endian u16 (see `protocols::prepared::split_words_trailer`).
pub const PREP_WORDS: u32 = 64;

/// RTS flag: `remote_addr` may be read directly (the lane has remote memory access).
pub const RTS_REMOTE_MEMORY: u32 = 1;
/// RTS flag: `remote_addr` is GPU memory and the frame's payload is the key that opens it
/// (a CUDA IPC handle and the allocation it names; see cuda/ipc.rs).
pub const RTS_DEVICE_KEY: u32 = 2;
/// RTS flag, with `RTS_REMOTE_MEMORY`: the lane needs a key to read `remote_addr` (UCX) and
/// the frame's payload is the one the sender's link issued (`Link::expose`; for UCX
/// `transport::ucx::rkey`). Exclusive with `RTS_DEVICE_KEY` (one payload).
pub const RTS_LANE_KEY: u32 = 4;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireError {
    Short { kind: u8, need: usize, have: usize },
    UnknownKind(u8),
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Short { kind, need, have } => {
                write!(f, "frame kind {kind} needs {need} header bytes, got {have}")
            }
            WireError::UnknownKind(k) => write!(f, "unknown frame kind {k}"),
        }
    }
}

pub mod kind {
    pub const EAGER_ONLY: u8 = 1;
    pub const EAGER_FIRST: u8 = 2;
    pub const EAGER_NEXT: u8 = 3;
    pub const RTS: u8 = 4;
    pub const RTR: u8 = 5;
    pub const RNDV_DATA: u8 = 6;
    pub const ATS: u8 = 7;
    pub const PUT: u8 = 8;
    pub const GET_REQ: u8 = 9;
    pub const GET_DATA: u8 = 10;
    pub const FLUSH_REQ: u8 = 11;
    pub const FLUSH_ACK: u8 = 12;
    pub const CLOSE: u8 = 13;
    pub const PREP_HELLO: u8 = 14;
    pub const PREP_READY: u8 = 15;
    pub const PREP_DATA: u8 = 16;
    pub const PREP_BYE: u8 = 17;
}

/// An encoded header: a small inline buffer, so building a frame never allocates.
#[derive(Copy, Clone)]
pub struct Encoded {
    buf: [u8; MAX_HEADER],
    len: u8,
}

impl Encoded {
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len as usize]
    }
}

impl fmt::Debug for Encoded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Encoded({:?})", Header::decode(self.as_bytes()).map(|(h, _)| h))
    }
}

struct Writer {
    out: Encoded,
}

impl Writer {
    fn new(kind: u8) -> Writer {
        // Kind, then 7 bytes of padding so every field after it is 8-byte aligned in the frame.
        let mut w = Writer { out: Encoded { buf: [0; MAX_HEADER], len: 8 } };
        w.out.buf[0] = kind;
        w
    }
    fn u64(mut self, v: u64) -> Writer {
        let at = self.out.len as usize;
        self.out.buf[at..at + 8].copy_from_slice(&v.to_le_bytes());
        self.out.len += 8;
        self
    }
    /// A 32-bit value stored in a 64-bit slot (keeps alignment simple).
    fn i32(self, v: i32) -> Writer {
        self.u64(v as u32 as u64)
    }
    fn done(self) -> Encoded {
        self.out
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn u64(&mut self) -> u64 {
        let v = u64::from_le_bytes(self.bytes[self.at..self.at + 8].try_into().unwrap());
        self.at += 8;
        v
    }
    fn i32(&mut self) -> i32 {
        self.u64() as u32 as i32
    }
}

impl Header {
    fn kind(&self) -> u8 {
        match self {
            Header::EagerOnly { .. } => kind::EAGER_ONLY,
            Header::EagerFirst { .. } => kind::EAGER_FIRST,
            Header::EagerNext { .. } => kind::EAGER_NEXT,
            Header::Rts { .. } => kind::RTS,
            Header::Rtr { .. } => kind::RTR,
            Header::RndvData { .. } => kind::RNDV_DATA,
            Header::Ats { .. } => kind::ATS,
            Header::Put { .. } => kind::PUT,
            Header::GetReq { .. } => kind::GET_REQ,
            Header::GetData { .. } => kind::GET_DATA,
            Header::FlushReq { .. } => kind::FLUSH_REQ,
            Header::FlushAck { .. } => kind::FLUSH_ACK,
            Header::Close => kind::CLOSE,
            Header::PrepHello { .. } => kind::PREP_HELLO,
            Header::PrepReady { .. } => kind::PREP_READY,
            Header::PrepData { .. } => kind::PREP_DATA,
            Header::PrepBye { .. } => kind::PREP_BYE,
        }
    }

    /// Number of 8-byte fields after the kind word, per kind.
    fn fields(kind: u8) -> Option<usize> {
        Some(match kind {
            kind::EAGER_ONLY => 1,
            kind::EAGER_FIRST => 3,
            kind::EAGER_NEXT => 2,
            kind::RTS => 5,
            kind::RTR => 3,
            kind::RNDV_DATA => 2,
            kind::ATS => 2,
            kind::PUT => 2,
            kind::GET_REQ => 4,
            kind::GET_DATA => 3,
            kind::FLUSH_REQ => 1,
            kind::FLUSH_ACK => 2,
            kind::CLOSE => 0,
            kind::PREP_HELLO => 7,
            kind::PREP_READY => 2,
            kind::PREP_DATA => 5,
            kind::PREP_BYE => 1,
            _ => return None,
        })
    }

    /// Size of the encoded header of this kind.
    pub fn encoded_len(&self) -> usize {
        8 + 8 * Header::fields(self.kind()).expect("every Header variant has a kind")
    }

    pub fn encode(&self) -> Encoded {
        let w = Writer::new(self.kind());
        match *self {
            Header::EagerOnly { tag } => w.u64(tag),
            Header::EagerFirst { tag, msg_id, total } => w.u64(tag).u64(msg_id).u64(total),
            Header::EagerNext { msg_id, offset } => w.u64(msg_id).u64(offset),
            Header::Rts { tag, sreq, total, remote_addr, flags } => w.u64(tag).u64(sreq).u64(total).u64(remote_addr).u64(flags as u64),
            Header::Rtr { sreq, rreq, len } => w.u64(sreq).u64(rreq).u64(len),
            Header::RndvData { rreq, offset } => w.u64(rreq).u64(offset),
            Header::Ats { sreq, status } => w.u64(sreq).i32(status),
            Header::Put { region, addr } => w.u64(region).u64(addr),
            Header::GetReq { req, region, addr, len } => w.u64(req).u64(region).u64(addr).u64(len),
            Header::GetData { req, offset, status } => w.u64(req).u64(offset).i32(status),
            Header::FlushReq { id } => w.u64(id),
            Header::FlushAck { id, status } => w.u64(id).i32(status),
            Header::Close => w,
            Header::PrepHello { tag, seq, id, len, partitions, addr, flags } => {
                w.u64(tag).u64(seq).u64(id).u64(len).u64(partitions).u64(addr).u64(flags as u64)
            }
            Header::PrepReady { id, round } => w.u64(id).u64(round),
            // Flags in the low half of one word, status in the high half.
            Header::PrepData { id, round, offset, len, flags, status } => {
                w.u64(id).u64(round).u64(offset).u64(len).u64(flags as u64 | (status as u32 as u64) << 32)
            }
            Header::PrepBye { id } => w.u64(id),
        }
        .done()
    }

    /// Decode a frame into its header and the payload that follows it.
    pub fn decode(frame: &[u8]) -> Result<(Header, &[u8]), WireError> {
        let Some(&k) = frame.first() else {
            return Err(WireError::Short { kind: 0, need: 8, have: 0 });
        };
        let fields = Header::fields(k).ok_or(WireError::UnknownKind(k))?;
        let need = 8 + 8 * fields;
        if frame.len() < need {
            return Err(WireError::Short { kind: k, need, have: frame.len() });
        }
        let mut r = Reader { bytes: frame, at: 8 };
        let h = match k {
            kind::EAGER_ONLY => Header::EagerOnly { tag: r.u64() },
            kind::EAGER_FIRST => Header::EagerFirst { tag: r.u64(), msg_id: r.u64(), total: r.u64() },
            kind::EAGER_NEXT => Header::EagerNext { msg_id: r.u64(), offset: r.u64() },
            kind::RTS => Header::Rts { tag: r.u64(), sreq: r.u64(), total: r.u64(), remote_addr: r.u64(), flags: r.u64() as u32 },
            kind::RTR => Header::Rtr { sreq: r.u64(), rreq: r.u64(), len: r.u64() },
            kind::RNDV_DATA => Header::RndvData { rreq: r.u64(), offset: r.u64() },
            kind::ATS => Header::Ats { sreq: r.u64(), status: r.i32() },
            kind::PUT => Header::Put { region: r.u64(), addr: r.u64() },
            kind::GET_REQ => Header::GetReq { req: r.u64(), region: r.u64(), addr: r.u64(), len: r.u64() },
            kind::GET_DATA => Header::GetData { req: r.u64(), offset: r.u64(), status: r.i32() },
            kind::FLUSH_REQ => Header::FlushReq { id: r.u64() },
            kind::FLUSH_ACK => Header::FlushAck { id: r.u64(), status: r.i32() },
            kind::CLOSE => Header::Close,
            kind::PREP_HELLO => Header::PrepHello {
                tag: r.u64(),
                seq: r.u64(),
                id: r.u64(),
                len: r.u64(),
                partitions: r.u64(),
                addr: r.u64(),
                flags: r.u64() as u32,
            },
            kind::PREP_READY => Header::PrepReady { id: r.u64(), round: r.u64() },
            kind::PREP_DATA => {
                let (id, round, offset, len, word) = (r.u64(), r.u64(), r.u64(), r.u64(), r.u64());
                Header::PrepData { id, round, offset, len, flags: word as u32, status: (word >> 32) as u32 as i32 }
            }
            kind::PREP_BYE => Header::PrepBye { id: r.u64() },
            _ => unreachable!("kind validated by Header::fields"),
        };
        Ok((h, &frame[need..]))
    }
}

/// The payload of a frame that `Header::decode` accepted (empty if the frame is malformed).
/// The encoded `Header::EagerOnly { tag }`, built without the general encoder (the send fast
/// path writes it for every small message).
#[inline]
pub fn eager_only_header(tag: u64) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[0] = kind::EAGER_ONLY;
    h[8..].copy_from_slice(&tag.to_le_bytes());
    h
}

/// The tag and payload of an eager-only frame; `None` for any other (or a malformed) frame.
/// Decodes only what the receive fast path needs.
#[inline]
pub fn eager_only(frame: &[u8]) -> Option<(u64, &[u8])> {
    if frame.len() < 16 || frame[0] != kind::EAGER_ONLY {
        return None;
    }
    let tag = u64::from_le_bytes(frame[8..16].try_into().expect("8 bytes"));
    Some((tag, &frame[16..]))
}

pub fn payload_of(frame: &[u8]) -> &[u8] {
    match frame.first().and_then(|k| Header::fields(*k)) {
        Some(f) if frame.len() >= 8 + 8 * f => &frame[8 + 8 * f..],
        _ => &[],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<Header> {
        vec![
            Header::EagerOnly { tag: u64::MAX },
            Header::EagerFirst { tag: 7, msg_id: 3, total: 1 << 40 },
            Header::EagerNext { msg_id: 3, offset: 65536 },
            Header::Rts { tag: 1, sreq: 2, total: 3, remote_addr: 0xdead_beef, flags: RTS_REMOTE_MEMORY },
            Header::Rtr { sreq: 9, rreq: 10, len: 11 },
            Header::RndvData { rreq: 10, offset: 12 },
            Header::Ats { sreq: 9, status: -20 },
            Header::Put { region: 4, addr: 5 },
            Header::GetReq { req: 1, region: 2, addr: 3, len: 4 },
            Header::GetData { req: 1, offset: 0, status: 0 },
            Header::FlushReq { id: 77 },
            Header::FlushAck { id: 77, status: -6 },
            Header::Close,
            Header::PrepHello { tag: 5, seq: 2, id: 6, len: 7, partitions: 8, addr: 0xfeed, flags: PREP_RECV | PREP_DIRECT },
            Header::PrepReady { id: 6, round: 1 << 40 },
            Header::PrepData { id: 6, round: 2, offset: 3, len: 4, flags: PREP_LAST, status: -43 },
            Header::PrepBye { id: 6 },
        ]
    }

    #[test]
    fn eager_only_shortcut_agrees_with_decode() {
        for h in [Header::EagerOnly { tag: 0 }, Header::EagerOnly { tag: u64::MAX }, Header::EagerOnly { tag: 0x1234_5678_9abc }] {
            let enc = h.encode();
            let mut frame = enc.as_bytes().to_vec();
            frame.extend_from_slice(b"payload");
            let (decoded, payload) = Header::decode(&frame).unwrap();
            let Header::EagerOnly { tag } = decoded else { unreachable!() };
            assert_eq!(eager_only(&frame), Some((tag, payload)));
            assert_eq!(&eager_only_header(tag)[..], enc.as_bytes(), "the fast encoder agrees");
            assert_eq!(eager_only(&frame[..16]), Some((tag, &[][..])), "empty message");
            assert_eq!(eager_only(&frame[..15]), None, "short frame");
        }
        let other = Header::EagerNext { msg_id: 1, offset: 2 }.encode();
        assert_eq!(eager_only(other.as_bytes()), None);
        assert_eq!(eager_only(&[]), None);
    }

    #[test]
    fn every_header_round_trips_with_payload() {
        for h in all() {
            let enc = h.encode();
            assert_eq!(enc.as_bytes().len(), h.encoded_len());
            assert!(enc.as_bytes().len() <= MAX_HEADER);
            let mut frame = enc.as_bytes().to_vec();
            frame.extend_from_slice(b"payload");
            let (d, payload) = Header::decode(&frame).unwrap();
            assert_eq!(d, h);
            assert_eq!(payload, b"payload");
        }
    }

    #[test]
    fn hostile_frames_are_errors_not_panics() {
        assert!(Header::decode(&[]).is_err());
        assert_eq!(Header::decode(&[200, 0, 0]), Err(WireError::UnknownKind(200)));
        for h in all() {
            let enc = h.encode();
            let bytes = enc.as_bytes();
            for cut in 0..bytes.len() {
                assert!(Header::decode(&bytes[..cut]).is_err(), "{h:?} cut at {cut}");
            }
        }
        // Every one-byte frame, including random kinds, decodes or errors without panicking.
        for k in 0..=255u8 {
            let _ = Header::decode(&[k; 64]);
        }
    }
}
