//! The UCX lane's remote key: what a sender puts in a rendezvous RTS so the receiver can read the
//! buffer with `ucp_get_nbx` (docs/UCX.md, "Remote memory").
//!
//! A UCX packed rkey (`ucp_rkey_pack`) is opaque and its length depends on the memory domains
//! of the sender's context (a few bytes for TCP, tens per InfiniBand device). Around it we put
//! the range it opens, so the receiving link refuses an access outside it before UCX sees the
//! request (UCX does not check bounds for every transport: TCP's get serves whatever address it
//! is asked for inside the peer process). Little-endian:
//!
//! | offset | size | field                                                    |
//! |--------|------|----------------------------------------------------------|
//! | 0      | 4    | magic `GURK`                                              |
//! | 4      | 1    | version (1)                                               |
//! | 5      | 1    | reserved, 0                                               |
//! | 6      | 2    | length of the UCX packed rkey, 1..=`MAX_UCX_RKEY`         |
//! | 8      | 8    | base address of the registered range                     |
//! | 16     | 8    | length of the registered range                           |
//! | 24     | n    | the UCX packed rkey                                      |
//!
//! The length cap keeps a hostile or corrupt frame from making us hand UCX an unbounded blob;
//! 4 KiB is ten times what a context with every transport of a GPU node packs.

use crate::error::{Error, Result};

const MAGIC: &[u8; 4] = b"GURK";
const VERSION: u8 = 1;
/// Bytes before the UCX rkey.
pub(crate) const FIXED: usize = 24;
/// Longest UCX packed rkey accepted.
pub(crate) const MAX_UCX_RKEY: usize = 4096;

/// A decoded remote key: the range it opens and UCX's bytes for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteKey<'a> {
    pub base: u64,
    pub len: u64,
    pub ucx: &'a [u8],
}

impl RemoteKey<'_> {
    pub fn encode(&self) -> Result<Vec<u8>> {
        if self.ucx.is_empty() || self.ucx.len() > MAX_UCX_RKEY {
            return Err(Error::invalid_param(format!("UCX packed rkey of {} bytes (1..={MAX_UCX_RKEY})", self.ucx.len())));
        }
        if self.base.checked_add(self.len).is_none() {
            return Err(Error::invalid_param("registered range overflows the address space"));
        }
        let mut out = Vec::with_capacity(FIXED + self.ucx.len());
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.push(0);
        out.extend_from_slice(&(self.ucx.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.base.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(self.ucx);
        Ok(out)
    }

    /// Decode; every malformed input is an error (never a panic): wrong magic or version,
    /// a length field that disagrees with the bytes, an empty or oversized UCX part, a range
    /// that wraps.
    pub fn decode(b: &[u8]) -> Result<RemoteKey<'_>> {
        let bad = |why: &str| Error::invalid_param(format!("not a UCX lane remote key: {why}"));
        if b.len() < FIXED {
            return Err(bad("too short"));
        }
        if &b[..4] != MAGIC {
            return Err(bad("bad magic"));
        }
        if b[4] != VERSION {
            return Err(bad(&format!("version {} (this build reads {VERSION})", b[4])));
        }
        if b[5] != 0 {
            // Strict: a later version that uses the byte bumps `VERSION` instead.
            return Err(bad("reserved byte set"));
        }
        let n = usize::from(u16::from_le_bytes([b[6], b[7]]));
        if n == 0 || n > MAX_UCX_RKEY {
            return Err(bad(&format!("UCX rkey length {n}")));
        }
        if b.len() != FIXED + n {
            return Err(bad(&format!("{} bytes for a {n}-byte UCX rkey", b.len())));
        }
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        let (base, len) = (u64_at(8), u64_at(16));
        if base.checked_add(len).is_none() {
            return Err(bad("range wraps"));
        }
        Ok(RemoteKey { base, len, ucx: &b[FIXED..] })
    }

    /// `[addr, addr+n)` lies inside the key's range.
    pub fn covers(&self, addr: u64, n: usize) -> bool {
        let Some(end) = addr.checked_add(n as u64) else { return false };
        addr >= self.base && end <= self.base + self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_bounds_and_malformed_inputs() {
        let k = RemoteKey { base: 0x1000, len: 4096, ucx: &[7; 30] };
        let b = k.encode().unwrap();
        assert_eq!(b.len(), FIXED + 30);
        let d = RemoteKey::decode(&b).unwrap();
        assert_eq!(d, k);
        assert!(d.covers(0x1000, 4096) && d.covers(0x1fff, 1) && d.covers(0x2000, 0));
        assert!(!d.covers(0xfff, 1) && !d.covers(0x1001, 4096) && !d.covers(u64::MAX, 2));
        // Truncated, extended, wrong magic / version / length field.
        assert!(RemoteKey::decode(&b[..b.len() - 1]).is_err());
        assert!(RemoteKey::decode(&[b.as_slice(), &[0]].concat()).is_err());
        for (at, v) in [(0, b'X'), (4, 2), (5, 1), (6, 0), (7, 0x80)] {
            let mut m = b.clone();
            m[at] = v;
            assert!(RemoteKey::decode(&m).is_err(), "byte {at} = {v}");
        }
        let mut wrap = b.clone();
        wrap[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(RemoteKey::decode(&wrap).is_err());
        assert!(RemoteKey { base: 0, len: 1, ucx: &[] }.encode().is_err());
        assert!(RemoteKey { base: 0, len: 1, ucx: &[0; MAX_UCX_RKEY + 1] }.encode().is_err());
        assert!(RemoteKey { base: u64::MAX, len: 2, ucx: &[1] }.encode().is_err());
        assert!(RemoteKey::decode(&[]).is_err());
    }
}
