//! What travels in one UCX active message: a fixed header (the AM's user header) naming the
//! link and the frame's place in it, and a body.
//!
//! Header, little-endian, 40 bytes:
//!
//! | offset | size | field                                                              |
//! |--------|------|--------------------------------------------------------------------|
//! | 0      | 1    | kind: 1 hello, 2 data, 3 close                                      |
//! | 1      | 1    | sender's side of the link: 0 connector, 1 acceptor                  |
//! | 2      | 1    | wire version (1)                                                    |
//! | 3      | 5    | reserved, 0                                                         |
//! | 8      | 16   | connector's worker uuid  } together: the link, the same on both     |
//! | 24     | 8    | connector's link number  } sides                                    |
//! | 32     | 8    | sequence number of this frame in its direction, from 0              |
//!
//! Bodies: *data* is one gscomm frame; *hello* (always sequence 0, from the connector) is the
//! uuid of the worker it wants (16 bytes) then the connector's own UCX lane address, so the
//! acceptor can make an endpoint back; *close* is a reason byte (1 closed, 2 rejected) then a
//! UTF-8 explanation.
//!
//! A link is named by (connector uuid, connector's number): the connector picks the number, so a
//! link can carry frames before the acceptor has answered, and worker uuids are random 128-bit
//! values, so two connectors never pick the same name. The side byte keeps the two directions of
//! a link apart even when a worker connects to itself.

use crate::error::{Error, Result, Status};

pub(crate) const HEADER_LEN: usize = 40;
const VERSION: u8 = 1;

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Hello = 1,
    Data = 2,
    Close = 3,
}

/// Which end of a link.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Side {
    Connector = 0,
    Acceptor = 1,
}

impl Side {
    pub(crate) fn other(self) -> Side {
        match self {
            Side::Connector => Side::Acceptor,
            Side::Acceptor => Side::Connector,
        }
    }
}

/// A link's name on the wire.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct LinkName {
    pub connector: u128,
    pub number: u64,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: Kind,
    pub from: Side,
    pub link: LinkName,
    pub seq: u64,
}

fn invalid(msg: String) -> Error {
    Error::new(Status::InvalidAddress, format!("UCX frame header: {msg}"))
}

impl Header {
    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = self.kind as u8;
        b[1] = self.from as u8;
        b[2] = VERSION;
        b[8..24].copy_from_slice(&self.link.connector.to_le_bytes());
        b[24..32].copy_from_slice(&self.link.number.to_le_bytes());
        b[32..40].copy_from_slice(&self.seq.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Header> {
        if b.len() != HEADER_LEN {
            return Err(invalid(format!("{} bytes, expected {HEADER_LEN}", b.len())));
        }
        if b[2] != VERSION {
            return Err(invalid(format!("wire version {}, this build speaks {VERSION}", b[2])));
        }
        if b[3..8] != [0; 5] {
            return Err(invalid("reserved bytes are not zero".into()));
        }
        let kind = match b[0] {
            1 => Kind::Hello,
            2 => Kind::Data,
            3 => Kind::Close,
            k => return Err(invalid(format!("unknown kind {k}"))),
        };
        let from = match b[1] {
            0 => Side::Connector,
            1 => Side::Acceptor,
            s => return Err(invalid(format!("unknown side {s}"))),
        };
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let connector = u128::from_le_bytes(b[8..24].try_into().expect("16 bytes"));
        let header = Header { kind, from, link: LinkName { connector, number: u64_at(24) }, seq: u64_at(32) };
        if kind == Kind::Hello && (from != Side::Connector || header.seq != 0) {
            return Err(invalid(format!("hello from the {from:?} side with sequence {}", header.seq)));
        }
        Ok(header)
    }
}

/// The body of a hello.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    /// The worker the connector wants (from the address it connected to).
    pub listener: u128,
    /// The connector's UCX lane address (`address::UcxAddress`), for the endpoint back.
    pub connector_address: Vec<u8>,
}

impl Hello {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(16 + self.connector_address.len());
        b.extend_from_slice(&self.listener.to_le_bytes());
        b.extend_from_slice(&self.connector_address);
        b
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Hello> {
        if b.len() < 16 {
            return Err(invalid(format!("hello body of {} bytes is shorter than 16", b.len())));
        }
        Ok(Hello { listener: u128::from_le_bytes(b[..16].try_into().expect("16 bytes")), connector_address: b[16..].to_vec() })
    }
}

/// Why a link was closed by its peer.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum CloseReason {
    /// The peer closed its side (or dropped it).
    Closed = 1,
    /// The acceptor refused the connection.
    Rejected = 2,
}

pub(crate) fn encode_close(reason: CloseReason, why: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(1 + why.len());
    b.push(reason as u8);
    b.extend_from_slice(why.as_bytes());
    b
}

pub(crate) fn decode_close(b: &[u8]) -> Result<(CloseReason, String)> {
    let reason = match b.first() {
        Some(1) => CloseReason::Closed,
        Some(2) => CloseReason::Rejected,
        other => return Err(invalid(format!("close reason {other:?}"))),
    };
    Ok((reason, String::from_utf8_lossy(&b[1..]).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Header {
        Header {
            kind: Kind::Data,
            from: Side::Acceptor,
            link: LinkName { connector: 0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10, number: 77 },
            seq: 0x1122_3344_5566,
        }
    }

    #[test]
    fn headers_round_trip() {
        let h = sample();
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        let hello = Header { kind: Kind::Hello, from: Side::Connector, seq: 0, ..h };
        assert_eq!(Header::decode(&hello.encode()).unwrap(), hello);
    }

    #[test]
    fn malformed_headers_are_named_errors() {
        let good = sample().encode();
        let check = |b: &[u8], needle: &str| {
            let e = Header::decode(b).unwrap_err();
            assert_eq!(e.status(), Status::InvalidAddress);
            assert!(e.message().contains(needle), "{e:?} should mention {needle:?}");
        };
        check(&good[..39], "40");
        let mut b = good;
        b[0] = 9;
        check(&b, "kind");
        let mut b = good;
        b[1] = 2;
        check(&b, "side");
        let mut b = good;
        b[2] = 2;
        check(&b, "version");
        let mut b = good;
        b[5] = 1;
        check(&b, "reserved");
        let mut late_hello = Header { kind: Kind::Hello, from: Side::Connector, ..sample() }.encode();
        check(&late_hello, "hello");
        late_hello[32..40].fill(0);
        late_hello[1] = 1;
        check(&late_hello, "hello");
    }

    #[test]
    fn bodies_round_trip() {
        let h = Hello { listener: 5, connector_address: vec![1, 2, 3] };
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        assert!(Hello::decode(&[0; 15]).is_err());
        let c = encode_close(CloseReason::Rejected, "not me");
        assert_eq!(decode_close(&c).unwrap(), (CloseReason::Rejected, "not me".to_string()));
        assert!(decode_close(&[]).is_err());
        assert!(decode_close(&[7]).is_err());
    }
}
