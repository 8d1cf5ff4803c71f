//! Memory handles and remote keys.
//!
//! `mem_map` registers a range of this process's memory (or allocates one) so peers can access
//! it one-sidedly; `rkey_pack` describes it for a peer; the peer unpacks the key on an endpoint to
//! this process and uses it for put/get. The key names the region and its bounds so the initiator
//! rejects out-of-range accesses before anything moves, and the target (on lanes where it applies
//! accesses itself) checks again against its registry: a key is never trusted blindly.

use crate::error::{Error, Result, Status};
use crate::protocols::RegionLookup;
use crate::transport::ProcessIdentity;
use std::collections::HashMap;
use std::sync::Mutex;

/// A registered region of this process.
struct Region {
    base: usize,
    len: usize,
    /// Present when the library allocated the memory (`mem_map` with allocate).
    _owned: Option<Box<[u8]>>,
}

/// The context's table of registered regions.
#[derive(Default)]
pub(crate) struct RegionTable {
    regions: Mutex<HashMap<u64, Region>>,
    next_id: std::sync::atomic::AtomicU64,
}

impl RegionTable {
    pub(crate) fn insert(&self, base: usize, len: usize, owned: Option<Box<[u8]>>) -> u64 {
        let id = self.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        self.regions.lock().unwrap_or_else(|e| e.into_inner()).insert(id, Region { base, len, _owned: owned });
        id
    }

    pub(crate) fn remove(&self, id: u64) -> bool {
        self.regions.lock().unwrap_or_else(|e| e.into_inner()).remove(&id).is_some()
    }

    pub(crate) fn len(&self) -> usize {
        self.regions.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl RegionLookup for RegionTable {
    fn resolve(&self, region: u64, addr: u64, len: usize) -> Result<usize> {
        let regions = self.regions.lock().unwrap_or_else(|e| e.into_inner());
        let r = regions
            .get(&region)
            .ok_or_else(|| Error::new(Status::InvalidHandle, format!("memory region {region} is not registered (unmapped?)")))?;
        check_range(r.base as u64, r.len, addr, len)?;
        Ok(addr as usize)
    }
}

/// `[addr, addr+len)` must lie inside `[base, base+region_len)`.
pub(crate) fn check_range(base: u64, region_len: usize, addr: u64, len: usize) -> Result<()> {
    let end = addr.checked_add(len as u64);
    let region_end = base + region_len as u64;
    match end {
        Some(end) if addr >= base && end <= region_end => Ok(()),
        _ => Err(Error::new(
            Status::OutOfRange,
            format!("remote range {addr:#x}+{len} is outside the registered region {base:#x}+{region_len}"),
        )),
    }
}

/// What `mem_map` registers.
#[derive(Copy, Clone, Debug)]
pub enum MapRequest {
    /// Existing memory of this process.
    Existing { addr: *mut u8, len: usize },
    /// Let the library allocate `len` zeroed bytes.
    Allocate { len: usize },
}

/// A registered region. Unmap with `Context::mem_unmap`.
#[derive(Debug)]
pub struct MemHandle {
    pub(crate) id: u64,
    pub(crate) base: usize,
    pub(crate) len: usize,
    pub(crate) context_uuid: u128,
}

impl MemHandle {
    pub fn address(&self) -> *mut u8 {
        self.base as *mut u8
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

const RKEY_MAGIC: &[u8; 4] = b"GSCK";
/// Size of a packed remote key (fixed; the C API reads a packed key from a bare pointer).
pub(crate) const RKEY_BYTES: usize = 4 + 8 + 8 + 8 + 4 + 8;

/// A peer's region, usable for put/get through an endpoint to that peer.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Rkey {
    pub(crate) region: u64,
    pub(crate) base: u64,
    pub(crate) len: usize,
    pub(crate) owner: ProcessIdentity,
}

/// Pack the remote key of a region this process registered.
pub(crate) fn rkey_pack(mem: &MemHandle, me: ProcessIdentity) -> Vec<u8> {
    let mut out = Vec::with_capacity(RKEY_BYTES);
    out.extend_from_slice(RKEY_MAGIC);
    out.extend_from_slice(&mem.id.to_le_bytes());
    out.extend_from_slice(&(mem.base as u64).to_le_bytes());
    out.extend_from_slice(&(mem.len as u64).to_le_bytes());
    out.extend_from_slice(&me.pid.to_le_bytes());
    out.extend_from_slice(&me.start_time.to_le_bytes());
    out
}

pub(crate) fn rkey_unpack(bytes: &[u8]) -> Result<Rkey> {
    if bytes.len() != RKEY_BYTES || &bytes[..4] != RKEY_MAGIC {
        return Err(Error::invalid_param(format!("not a packed gscomm remote key ({} bytes)", bytes.len())));
    }
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
    let len = usize::try_from(u64_at(20)).map_err(|_| Error::invalid_param("remote key length overflows"))?;
    if u64_at(12).checked_add(len as u64).is_none() {
        return Err(Error::invalid_param("remote key range overflows the address space"));
    }
    Ok(Rkey {
        region: u64_at(4),
        base: u64_at(12),
        len,
        owner: ProcessIdentity { pid: u32::from_le_bytes(bytes[28..32].try_into().unwrap()), start_time: u64_at(32) },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rkey_round_trip_and_rejects_garbage() {
        let mem = MemHandle { id: 3, base: 0x1000, len: 256, context_uuid: 1 };
        let me = ProcessIdentity { pid: 9, start_time: 10 };
        let k = rkey_unpack(&rkey_pack(&mem, me)).unwrap();
        assert_eq!(k, Rkey { region: 3, base: 0x1000, len: 256, owner: me });
        assert!(rkey_unpack(&[0; 10]).is_err());
        let mut bad = rkey_pack(&mem, me);
        bad[12..20].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(rkey_unpack(&bad).unwrap_err().status(), Status::InvalidParam);
    }

    #[test]
    fn ranges_are_checked_at_both_ends_and_for_overflow() {
        assert!(check_range(100, 50, 100, 50).is_ok());
        assert!(check_range(100, 50, 120, 0).is_ok());
        assert_eq!(check_range(100, 50, 99, 1).unwrap_err().status(), Status::OutOfRange);
        assert!(check_range(100, 50, 101, 50).is_err());
        assert!(check_range(100, 50, u64::MAX, 2).is_err());
        let t = RegionTable::default();
        let id = t.insert(0x1000, 64, None);
        assert_eq!(t.resolve(id, 0x1010, 16).unwrap(), 0x1010);
        assert_eq!(t.resolve(id, 0x1030, 32).unwrap_err().status(), Status::OutOfRange);
        assert!(t.remove(id));
        assert_eq!(t.resolve(id, 0x1010, 16).unwrap_err().status(), Status::InvalidHandle);
    }
}
