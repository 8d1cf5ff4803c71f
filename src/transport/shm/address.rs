//! The listener's address blob: what a peer needs to connect over shared memory.
//!
//! Little-endian, fixed header then the segment path:
//!
//! | offset | size | field                                                        |
//! |--------|------|--------------------------------------------------------------|
//! | 0      | 4    | magic `GSHM`                                                  |
//! | 4      | 2    | version (1)                                                   |
//! | 6      | 2    | path length in bytes                                          |
//! | 8      | 8    | host id (`proc_identity::host_id`)                            |
//! | 16     | 8    | pid namespace (`proc_identity::pid_namespace`)                |
//! | 24     | 4    | listener pid                                                  |
//! | 28     | 4    | reserved, 0                                                   |
//! | 32     | 8    | listener start time                                           |
//! | 40     | 16   | listener worker uuid                                          |
//! | 56     | 8    | CMA probe: address of the cookie in the listener              |
//! | 64     | 8    | CMA probe: cookie value                                       |
//! | 72     | n    | worker segment path (absolute, no NUL)                        |

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use crate::error::{Error, Result, Status};
use crate::transport::ProcessIdentity;

const MAGIC: [u8; 4] = *b"GSHM";
const VERSION: u16 = 1;
const HEADER_LEN: usize = 72;
/// Longest segment path accepted (PATH_MAX).
const PATH_MAX: usize = 4096;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmAddress {
    pub host_id: u64,
    pub pid_ns: u64,
    pub listener: ProcessIdentity,
    pub listener_uuid: u128,
    pub cookie_addr: u64,
    pub cookie_value: u64,
    pub segment: PathBuf,
}

fn invalid(msg: String) -> Error {
    Error::new(Status::InvalidAddress, format!("shm address: {msg}"))
}

impl ShmAddress {
    pub fn encode(&self) -> Result<Vec<u8>> {
        let path = self.segment.as_os_str().as_bytes();
        if path.len() > PATH_MAX || path.is_empty() {
            return Err(Error::new(Status::InvalidConfig, format!("segment path of {} bytes is empty or too long", path.len())));
        }
        let mut b = Vec::with_capacity(HEADER_LEN + path.len());
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&(path.len() as u16).to_le_bytes());
        b.extend_from_slice(&self.host_id.to_le_bytes());
        b.extend_from_slice(&self.pid_ns.to_le_bytes());
        b.extend_from_slice(&self.listener.pid.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&self.listener.start_time.to_le_bytes());
        b.extend_from_slice(&self.listener_uuid.to_le_bytes());
        b.extend_from_slice(&self.cookie_addr.to_le_bytes());
        b.extend_from_slice(&self.cookie_value.to_le_bytes());
        debug_assert_eq!(b.len(), HEADER_LEN);
        b.extend_from_slice(path);
        Ok(b)
    }

    /// Parse and check a blob; every defect is `InvalidAddress` with a message naming it.
    pub fn decode(b: &[u8]) -> Result<ShmAddress> {
        if b.len() < HEADER_LEN {
            return Err(invalid(format!("blob of {} bytes is shorter than the {HEADER_LEN}-byte header", b.len())));
        }
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(w)
        };
        if b[..4] != MAGIC {
            return Err(invalid(format!("bad magic {:02x?} (not a shm address)", &b[..4])));
        }
        let version = u16_at(4);
        if version != VERSION {
            return Err(invalid(format!("version {version}, this build speaks {VERSION}")));
        }
        let path_len = usize::from(u16_at(6));
        if b.len() != HEADER_LEN + path_len {
            return Err(invalid(format!("blob is {} bytes, header says {}", b.len(), HEADER_LEN + path_len)));
        }
        let path = &b[HEADER_LEN..];
        if path.first() != Some(&b'/') || path.contains(&0) {
            return Err(invalid("segment path is not an absolute path".into()));
        }
        let pid = u32_at(24);
        if pid == 0 || u32_at(28) != 0 {
            return Err(invalid(format!("listener pid {pid} or reserved field invalid")));
        }
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[40..56]);
        Ok(ShmAddress {
            host_id: u64_at(8),
            pid_ns: u64_at(16),
            listener: ProcessIdentity { pid, start_time: u64_at(32) },
            listener_uuid: u128::from_le_bytes(uuid),
            cookie_addr: u64_at(56),
            cookie_value: u64_at(64),
            segment: PathBuf::from(OsStr::from_bytes(path)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ShmAddress {
        ShmAddress {
            host_id: 0x1122_3344_5566_7788,
            pid_ns: 4_026_531_836,
            listener: ProcessIdentity { pid: 4242, start_time: 987_654 },
            listener_uuid: 0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10,
            cookie_addr: 0x7fff_0000_1000,
            cookie_value: 0xdead_beef_cafe_f00d,
            segment: PathBuf::from("/dev/shm/gsc-0123456789abcdef0123456789abcdef"),
        }
    }

    #[test]
    fn round_trips() {
        let a = sample();
        let b = a.encode().unwrap();
        assert_eq!(b.len(), HEADER_LEN + a.segment.as_os_str().len());
        assert_eq!(ShmAddress::decode(&b).unwrap(), a);
    }

    #[test]
    fn rejects_malformed_blobs() {
        let good = sample().encode().unwrap();
        let check = |b: &[u8], needle: &str| {
            let e = ShmAddress::decode(b).unwrap_err();
            assert_eq!(e.status(), Status::InvalidAddress, "{e:?}");
            assert!(e.message().contains(needle), "{e:?} should mention {needle:?}");
        };
        check(&[], "shorter");
        check(&good[..HEADER_LEN - 1], "shorter");
        check(&good[..good.len() - 1], "header says");
        let mut longer = good.clone();
        longer.push(b'x');
        check(&longer, "header says");
        let mut foreign = good.clone();
        foreign[..4].copy_from_slice(b"UCX!");
        check(&foreign, "magic");
        let mut newer = good.clone();
        newer[4] = 2;
        check(&newer, "version");
        let mut relative = good.clone();
        relative[HEADER_LEN] = b'd';
        check(&relative, "absolute");
        let mut nul = good.clone();
        nul[HEADER_LEN + 3] = 0;
        check(&nul, "absolute");
        let mut nopid = good.clone();
        nopid[24..28].fill(0);
        check(&nopid, "pid");
    }
}
