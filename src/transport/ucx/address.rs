//! The UCX lane's address blob: what a peer needs to connect to a worker over UCX.
//!
//! Little-endian, fixed header then UCP's own worker address (`ucp_worker_get_address`), which
//! lists every transport and device the worker listens on; UCX picks among them per peer.
//!
//! | offset | size | field                                                        |
//! |--------|------|--------------------------------------------------------------|
//! | 0      | 4    | magic `GUCX`                                                  |
//! | 4      | 2    | version (1)                                                   |
//! | 6      | 2    | reserved, 0                                                   |
//! | 8      | 16   | worker uuid                                                   |
//! | 24     | 2    | UCX major version of the worker (for error messages)          |
//! | 26     | 2    | UCX minor version                                             |
//! | 28     | 4    | length of the UCP worker address in bytes                     |
//! | 32     | n    | UCP worker address                                            |

use crate::error::{Error, Result, Status};

const MAGIC: [u8; 4] = *b"GUCX";
const VERSION: u16 = 1;
const HEADER_LEN: usize = 32;
/// The whole blob must fit the packed worker address's u16 lane length.
pub(crate) const MAX_BLOB: usize = u16::MAX as usize;

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct UcxAddress {
    pub uuid: u128,
    pub ucx_version: (u16, u16),
    pub worker_address: Vec<u8>,
}

fn invalid(msg: String) -> Error {
    Error::new(Status::InvalidAddress, format!("UCX address: {msg}"))
}

impl UcxAddress {
    pub(crate) fn encode(&self) -> Result<Vec<u8>> {
        let n = self.worker_address.len();
        if n == 0 || HEADER_LEN + n > MAX_BLOB {
            return Err(Error::new(
                Status::NoResource,
                format!("UCP worker address of {n} bytes does not fit a worker address lane (at most {})", MAX_BLOB - HEADER_LEN),
            ));
        }
        let mut b = Vec::with_capacity(HEADER_LEN + n);
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&0u16.to_le_bytes());
        b.extend_from_slice(&self.uuid.to_le_bytes());
        b.extend_from_slice(&self.ucx_version.0.to_le_bytes());
        b.extend_from_slice(&self.ucx_version.1.to_le_bytes());
        b.extend_from_slice(&(n as u32).to_le_bytes());
        debug_assert_eq!(b.len(), HEADER_LEN);
        b.extend_from_slice(&self.worker_address);
        Ok(b)
    }

    /// Parse and check a blob; every defect is `InvalidAddress` with a message naming it.
    pub(crate) fn decode(b: &[u8]) -> Result<UcxAddress> {
        if b.len() < HEADER_LEN {
            return Err(invalid(format!("blob of {} bytes is shorter than the {HEADER_LEN}-byte header", b.len())));
        }
        if b[..4] != MAGIC {
            return Err(invalid(format!("bad magic {:02x?} (not a UCX lane address)", &b[..4])));
        }
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let version = u16_at(4);
        if version != VERSION {
            return Err(invalid(format!("version {version}, this build speaks {VERSION}")));
        }
        if u16_at(6) != 0 {
            return Err(invalid("reserved field is not zero".into()));
        }
        let n = u32::from_le_bytes(b[28..32].try_into().expect("4 bytes")) as usize;
        if n == 0 || b.len() != HEADER_LEN + n {
            return Err(invalid(format!("blob is {} bytes, header says {}", b.len(), HEADER_LEN + n)));
        }
        Ok(UcxAddress {
            uuid: u128::from_le_bytes(b[8..24].try_into().expect("16 bytes")),
            ucx_version: (u16_at(24), u16_at(26)),
            worker_address: b[HEADER_LEN..].to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> UcxAddress {
        UcxAddress { uuid: 0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10, ucx_version: (1, 16), worker_address: (0..200u8).collect() }
    }

    #[test]
    fn round_trips() {
        let a = sample();
        let b = a.encode().unwrap();
        assert_eq!(b.len(), HEADER_LEN + 200);
        assert_eq!(UcxAddress::decode(&b).unwrap(), a);
    }

    #[test]
    fn rejects_malformed_blobs() {
        let good = sample().encode().unwrap();
        let check = |b: &[u8], needle: &str| {
            let e = UcxAddress::decode(b).unwrap_err();
            assert_eq!(e.status(), Status::InvalidAddress, "{e:?}");
            assert!(e.message().contains(needle), "{e:?} should mention {needle:?}");
        };
        check(&[], "shorter");
        check(&good[..HEADER_LEN - 1], "shorter");
        check(&good[..HEADER_LEN], "header says");
        check(&good[..good.len() - 1], "header says");
        let mut longer = good.clone();
        longer.push(0);
        check(&longer, "header says");
        let mut foreign = good.clone();
        foreign[..4].copy_from_slice(b"GSHM");
        check(&foreign, "magic");
        let mut newer = good.clone();
        newer[4] = 2;
        check(&newer, "version");
        let mut reserved = good.clone();
        reserved[7] = 1;
        check(&reserved, "reserved");
        let mut empty = good[..HEADER_LEN].to_vec();
        empty[28..32].fill(0);
        check(&empty, "header says");
    }

    #[test]
    fn oversized_worker_addresses_are_refused() {
        let a = UcxAddress { worker_address: vec![1; MAX_BLOB], ..sample() };
        assert_eq!(a.encode().unwrap_err().status(), Status::NoResource);
        let a = UcxAddress { worker_address: vec![], ..sample() };
        assert!(a.encode().is_err());
    }
}
