//! The packed worker address: everything a peer needs to create an endpoint to a worker.
//!
//! Layout (little-endian): magic "GSCW", format version u16, lane count u16, worker uuid u128,
//! host id u64, pid u32, process start time u64, then per lane: kind u8, blob length u16, blob.
//! It is opaque to users (MPI libraries exchange it as bytes) and checked strictly on unpack,
//! because it crosses process boundaries.

use crate::error::{Error, Result, Status};
use crate::transport::{LaneKind, ProcessIdentity};

const MAGIC: &[u8; 4] = b"GSCW";
const VERSION: u16 = 1;
const FIXED: usize = 4 + 2 + 2 + 16 + 8 + 4 + 8;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerAddress {
    pub uuid: u128,
    pub host_id: u64,
    pub process: ProcessIdentity,
    pub lanes: Vec<(LaneKind, Vec<u8>)>,
}

impl WorkerAddress {
    pub fn pack(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(FIXED + self.lanes.iter().map(|(_, b)| 3 + b.len()).sum::<usize>());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(self.lanes.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.uuid.to_le_bytes());
        out.extend_from_slice(&self.host_id.to_le_bytes());
        out.extend_from_slice(&self.process.pid.to_le_bytes());
        out.extend_from_slice(&self.process.start_time.to_le_bytes());
        for (kind, blob) in &self.lanes {
            out.push(*kind as u8);
            out.extend_from_slice(&(blob.len() as u16).to_le_bytes());
            out.extend_from_slice(blob);
        }
        out
    }

    /// The length of the packed address at `ptr`, read from its own header: the C API receives
    /// an address as a bare pointer (like UCP's `ucp_address_t *`). The magic and the format
    /// version are checked before any lane header is read, so a pointer to something else fails
    /// after the fixed header. `unpack` still checks the whole address afterwards.
    ///
    /// # Safety
    /// `ptr` must point to readable memory holding a packed address (at least the fixed header,
    /// and the whole address if the header is a valid one).
    pub unsafe fn packed_len(ptr: *const u8) -> Result<usize> {
        let bad = |what: &str| Error::new(Status::InvalidAddress, format!("worker address: {what}"));
        // SAFETY: the caller guarantees the fixed header is readable.
        let head = unsafe { std::slice::from_raw_parts(ptr, FIXED) };
        if &head[..4] != MAGIC {
            return Err(bad("not a gscomm worker address (bad magic)"));
        }
        let version = u16::from_le_bytes([head[4], head[5]]);
        if version != VERSION {
            return Err(bad(&format!("format version {version}, this library reads version {VERSION}")));
        }
        let nlanes = u16::from_le_bytes([head[6], head[7]]) as usize;
        let mut at = FIXED;
        for _ in 0..nlanes {
            // SAFETY: a valid header announces `nlanes` lane records; the caller guarantees the
            // whole address is readable, and `at` only advances by the lengths it declares.
            let lane = unsafe { std::slice::from_raw_parts(ptr.add(at), 3) };
            at += 3 + u16::from_le_bytes([lane[1], lane[2]]) as usize;
        }
        Ok(at)
    }

    pub fn unpack(bytes: &[u8]) -> Result<WorkerAddress> {
        let bad = |what: &str| Error::new(Status::InvalidAddress, format!("worker address: {what}"));
        if bytes.len() < FIXED {
            return Err(bad(&format!("{} bytes is shorter than the {FIXED}-byte header", bytes.len())));
        }
        if &bytes[..4] != MAGIC {
            return Err(bad("not a gscomm worker address (bad magic)"));
        }
        let u16_at = |at: usize| u16::from_le_bytes([bytes[at], bytes[at + 1]]);
        let version = u16_at(4);
        if version != VERSION {
            return Err(bad(&format!("format version {version}, this library reads version {VERSION}")));
        }
        let nlanes = u16_at(6) as usize;
        let uuid = u128::from_le_bytes(bytes[8..24].try_into().unwrap());
        let host_id = u64::from_le_bytes(bytes[24..32].try_into().unwrap());
        let pid = u32::from_le_bytes(bytes[32..36].try_into().unwrap());
        let start_time = u64::from_le_bytes(bytes[36..44].try_into().unwrap());
        let mut at = FIXED;
        let mut lanes = Vec::with_capacity(nlanes.min(16));
        for i in 0..nlanes {
            if at + 3 > bytes.len() {
                return Err(bad(&format!("lane {i} header runs past the end")));
            }
            let kind = LaneKind::from_u8(bytes[at]);
            let len = u16_at(at + 1) as usize;
            at += 3;
            if at + len > bytes.len() {
                return Err(bad(&format!("lane {i} blob of {len} bytes runs past the end")));
            }
            // Lanes this library does not know (a newer peer) are skipped, not fatal.
            if let Some(kind) = kind {
                lanes.push((kind, bytes[at..at + len].to_vec()));
            }
            at += len;
        }
        if at != bytes.len() {
            return Err(bad(&format!("{} trailing bytes", bytes.len() - at)));
        }
        Ok(WorkerAddress { uuid, host_id, process: ProcessIdentity { pid, start_time }, lanes })
    }

    pub fn lane_blob(&self, kind: LaneKind) -> Option<&[u8]> {
        self.lanes.iter().find(|(k, _)| *k == kind).map(|(_, b)| b.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> WorkerAddress {
        WorkerAddress {
            uuid: 0x1234_5678_9abc_def0_1122_3344_5566_7788,
            host_id: 42,
            process: ProcessIdentity { pid: 777, start_time: 123456 },
            lanes: vec![(LaneKind::Loopback, vec![]), (LaneKind::Shm, b"/dev/shm/gsc-x".to_vec())],
        }
    }

    #[test]
    fn packed_len_reads_the_header() {
        let packed = sample().pack();
        // SAFETY: `packed` is a whole packed address.
        assert_eq!(unsafe { WorkerAddress::packed_len(packed.as_ptr()) }.unwrap(), packed.len());
        let junk = [0u8; FIXED];
        // SAFETY: `junk` holds the fixed header's worth of bytes; the magic check stops there.
        assert_eq!(unsafe { WorkerAddress::packed_len(junk.as_ptr()) }.unwrap_err().status(), Status::InvalidAddress);
    }

    #[test]
    fn round_trip() {
        let a = sample();
        assert_eq!(WorkerAddress::unpack(&a.pack()).unwrap(), a);
    }

    #[test]
    fn every_truncation_and_corruption_is_a_named_error() {
        let bytes = sample().pack();
        for cut in 0..bytes.len() {
            let e = WorkerAddress::unpack(&bytes[..cut]).unwrap_err();
            assert_eq!(e.status(), Status::InvalidAddress);
        }
        let mut extra = bytes.clone();
        extra.push(0);
        assert!(WorkerAddress::unpack(&extra).unwrap_err().message().contains("trailing"));
        let mut bad_magic = bytes.clone();
        bad_magic[0] = b'X';
        assert!(WorkerAddress::unpack(&bad_magic).unwrap_err().message().contains("magic"));
        let mut bad_version = bytes;
        bad_version[4] = 9;
        assert!(WorkerAddress::unpack(&bad_version).unwrap_err().message().contains("version"));
    }

    #[test]
    fn unknown_lanes_are_skipped() {
        let mut bytes = sample().pack();
        bytes[6] = 3; // three lanes
        bytes.extend_from_slice(&[200, 2, 0, 9, 9]);
        let a = WorkerAddress::unpack(&bytes).unwrap();
        assert_eq!(a.lanes.len(), 2);
    }
}
