//! CUDA IPC: how a receiver in another process reads a sender's GPU buffer directly.
//!
//! The sender describes the allocation its buffer lies in (`DeviceKey`: a legacy IPC handle from
//! `cuIpcGetMemHandle`, the allocation's base and size, its process id) and sends that with the
//! rendezvous RTS. The receiver opens the handle once (`cuIpcOpenMemHandle`, cached per peer
//! allocation and local GPU) and copies from the mapping with the copy engine over NVLink/PCIe.
//! Between two workers of one process the key says so and the address is used as it is
//! (unified addressing), since a process cannot open its own IPC handles.
//!
//! Handles are cached on both sides. The export cache is keyed by the driver's buffer id, which
//! is never reused, so a freed and re-made allocation gets a fresh handle. The mapping cache is
//! keyed by (peer process, allocation base, local GPU) and compares the handle: a different
//! handle at the same base means the peer freed the old allocation, so the old mapping is closed.
//!
//! Not covered yet: VMM allocations (`cuMemCreate`), which have no legacy handle. Exporting one
//! fails, the RTS then carries no key, and the receiver asks the sender to push the data
//! (host-staged); exchanging them as POSIX file descriptors is left for a later change.

use super::copy::primary_context;
use super::memory::DevicePtr;
use super::{CtxScope, check, cu};
use crate::error::{Error, Result, Status};
use std::collections::HashMap;
use std::sync::Mutex;

const KIND_LEGACY_IPC: u8 = 1;
const KIND_SAME_PROCESS: u8 = 2;
const HANDLE_LEN: usize = 64;
/// Encoded size: kind, 3 reserved, pid, base, size, handle.
pub(crate) const KEY_LEN: usize = 1 + 3 + 4 + 8 + 8 + HANDLE_LEN;

/// How a peer reaches one of our device allocations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DeviceKey {
    pub pid: u32,
    pub base: u64,
    pub size: u64,
    /// `None`: same process, use the address as it is.
    pub handle: Option<[u8; HANDLE_LEN]>,
}

impl DeviceKey {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(KEY_LEN);
        v.push(if self.handle.is_some() { KIND_LEGACY_IPC } else { KIND_SAME_PROCESS });
        v.extend_from_slice(&[0; 3]);
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.base.to_le_bytes());
        v.extend_from_slice(&self.size.to_le_bytes());
        v.extend_from_slice(&self.handle.unwrap_or([0; HANDLE_LEN]));
        v
    }

    pub(crate) fn decode(b: &[u8]) -> Result<DeviceKey> {
        if b.len() != KEY_LEN {
            return Err(Error::new(Status::ConnectionReset, format!("device memory key of {} bytes (expected {KEY_LEN})", b.len())));
        }
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let pid = u32::from_le_bytes(b[4..8].try_into().expect("4 bytes"));
        let (base, size) = (u64_at(8), u64_at(16));
        if base.checked_add(size).is_none() {
            return Err(Error::new(Status::ConnectionReset, "device memory key describes a range past the address space"));
        }
        let handle = match b[0] {
            KIND_LEGACY_IPC => Some(b[24..].try_into().expect("64 bytes")),
            KIND_SAME_PROCESS => None,
            k => return Err(Error::new(Status::ConnectionReset, format!("device memory key of unknown kind {k}"))),
        };
        Ok(DeviceKey { pid, base, size, handle })
    }

    /// Where `[addr, addr+len)` of the peer's allocation is, checked to lie inside it.
    pub(crate) fn offset_of(&self, addr: u64, len: usize) -> Result<u64> {
        let end = addr.checked_add(len as u64);
        if addr < self.base || end.is_none_or(|e| e > self.base + self.size) {
            return Err(Error::new(Status::ConnectionReset, "the peer's buffer lies outside the allocation its key describes"));
        }
        Ok(addr - self.base)
    }
}

fn own_pid() -> u32 {
    std::process::id()
}

/// The key for the allocation holding `addr` (from `memory::device_ptr`).
pub(crate) fn export(addr: usize, ptr: DevicePtr) -> Result<DeviceKey> {
    static EXPORTED: Mutex<Option<HashMap<u64, DeviceKey>>> = Mutex::new(None);
    let mut cache = EXPORTED.lock().unwrap_or_else(|e| e.into_inner());
    let map = cache.get_or_insert_with(HashMap::new);
    if let Some(k) = map.get(&ptr.buffer_id) {
        return Ok(k.clone());
    }
    // Both calls need a current context, and the proxy thread has none of its own.
    let _scope = CtxScope::enter(primary_context(ptr.device)?)?;
    let (mut base, mut size): (cu::CUdeviceptr, usize) = (0, 0);
    // SAFETY: valid out-pointers; `addr` is device memory (the caller asked the driver).
    check(unsafe { cu::cuMemGetAddressRange_v2(&mut base, &mut size, addr as cu::CUdeviceptr) }, "cuMemGetAddressRange")?;
    // SAFETY: zeroed is a valid handle value to be overwritten.
    let mut h: cu::CUipcMemHandle = unsafe { std::mem::zeroed() };
    // SAFETY: `base` is the start of a live allocation; a valid out-pointer.
    check(unsafe { cu::cuIpcGetMemHandle(&mut h, base) }, "cuIpcGetMemHandle")
        .map_err(|e| e.context("this GPU buffer cannot be shared by CUDA IPC (VMM allocations are not supported yet)"))?;
    let handle: [u8; HANDLE_LEN] = h.reserved.map(|c| c as u8);
    let key = DeviceKey { pid: own_pid(), base, size: size as u64, handle: Some(handle) };
    // Buffer ids are never reused, so entries of freed buffers are only dead weight: bound it.
    if map.len() >= 4096 {
        map.clear();
    }
    map.insert(ptr.buffer_id, key.clone());
    Ok(key)
}

/// A key for a buffer the peer reaches in our own address space (two workers of one process).
pub(crate) fn same_process_key(addr: usize, len: usize) -> DeviceKey {
    DeviceKey { pid: own_pid(), base: addr as u64, size: len as u64, handle: None }
}

struct Mapping {
    handle: [u8; HANDLE_LEN],
    mapped: u64,
    /// The size the driver maps, which the peer's claim in the key is checked against.
    size: u64,
}

/// Mappings of peer allocations that were since replaced; never closed yet (see `map_peer`).
static RETIRED: Mutex<Vec<u64>> = Mutex::new(Vec::new());

// SAFETY: a device address; usable from any thread.
unsafe impl Send for Mapping {}

/// The unified address at which the peer's `[addr, addr+len)` can be read from `device`'s
/// context, opening (and caching) the peer's allocation when needed.
pub(crate) fn map_peer(key: &DeviceKey, addr: u64, len: usize, device: i32) -> Result<u64> {
    /// (peer pid, peer allocation base, local GPU) -> our mapping of it.
    type Mappings = HashMap<(u32, u64, i32), Mapping>;
    static MAPPED: Mutex<Option<Mappings>> = Mutex::new(None);
    let offset = key.offset_of(addr, len)?;
    let Some(handle) = key.handle else {
        if key.pid != own_pid() {
            return Err(Error::new(Status::ConnectionReset, "a same-process device key from another process"));
        }
        return Ok(addr);
    };
    if key.pid == own_pid() {
        // Our own allocation, described for a peer in another process: use it directly.
        return Ok(addr);
    }
    let mut cache = MAPPED.lock().unwrap_or_else(|e| e.into_inner());
    let map = cache.get_or_insert_with(HashMap::new);
    let slot = (key.pid, key.base, device);
    let within = |m: &Mapping| -> Result<u64> {
        if offset + len as u64 > m.size {
            return Err(Error::new(Status::ConnectionReset, "the peer's key claims more memory than its allocation has"));
        }
        Ok(m.mapped + offset)
    };
    if let Some(m) = map.get(&slot).filter(|m| m.handle == handle) {
        return within(m);
    }
    let _scope = CtxScope::enter(primary_context(device)?)?;
    if let Some(old) = map.remove(&slot) {
        // The peer freed that allocation and made a new one at the same address. Closing the
        // old mapping here is not safe: cuIpcCloseMemHandle synchronizes the device, and this
        // runs on the proxy while user streams wait on it (measured: it deadlocks). The mapping
        // is kept (it holds the peer's freed memory until this process exits) until a safe
        // point to close it exists; see docs/ARCHITECTURE.md.
        tracing::debug!(target: "gsc::cuda", pid = key.pid, base = format_args!("{:#x}", key.base), "peer allocation replaced; old mapping retired");
        RETIRED.lock().unwrap_or_else(|e| e.into_inner()).push(old.mapped);
    }
    // SAFETY: zeroed then filled with the peer's bytes.
    let mut h: cu::CUipcMemHandle = unsafe { std::mem::zeroed() };
    h.reserved = handle.map(|b| b as std::ffi::c_char);
    let mut mapped: cu::CUdeviceptr = 0;
    let flags = cu::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
    // SAFETY: a valid out-pointer; the driver validates the handle.
    check(unsafe { cu::cuIpcOpenMemHandle_v2(&mut mapped, h, flags) }, "cuIpcOpenMemHandle")?;
    let (mut base, mut size): (cu::CUdeviceptr, usize) = (0, 0);
    // SAFETY: valid out-pointers; `mapped` was just mapped in the current context. A peer
    // cannot make us copy past the real allocation by claiming a larger one in its key.
    check(unsafe { cu::cuMemGetAddressRange_v2(&mut base, &mut size, mapped) }, "cuMemGetAddressRange(mapped)")?;
    let m = Mapping { handle, mapped, size: size as u64 };
    let at = within(&m);
    map.insert(slot, m);
    at
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_reject_garbage() {
        let k = DeviceKey { pid: 4242, base: 0x7f00_0000_0000, size: 1 << 30, handle: Some([7; HANDLE_LEN]) };
        let b = k.encode();
        assert_eq!(b.len(), KEY_LEN);
        assert_eq!(DeviceKey::decode(&b).unwrap(), k);
        let same = same_process_key(0x1000, 64);
        assert_eq!(DeviceKey::decode(&same.encode()).unwrap(), same);
        assert!(DeviceKey::decode(&b[..KEY_LEN - 1]).is_err());
        let mut bad = b.clone();
        bad[0] = 9;
        assert!(DeviceKey::decode(&bad).unwrap_err().message().contains("unknown kind"));
        let mut wrap = b;
        wrap[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(DeviceKey::decode(&wrap).is_err());
    }

    #[test]
    fn ranges_outside_the_allocation_are_refused() {
        let k = DeviceKey { pid: 1, base: 1000, size: 100, handle: None };
        assert_eq!(k.offset_of(1000, 100).unwrap(), 0);
        assert_eq!(k.offset_of(1050, 50).unwrap(), 50);
        assert!(k.offset_of(999, 1).is_err());
        assert!(k.offset_of(1050, 51).is_err());
        assert!(k.offset_of(u64::MAX, 2).is_err());
    }
}
