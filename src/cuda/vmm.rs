//! CUDA VMM allocations (`cuMemCreate` + `cuMemAddressReserve` + `cuMemMap`, as PyTorch's
//! expandable segments and NCCL's cuMem allocator make them) shared with another process as POSIX
//! file descriptors passed over a Unix socket.
//!
//! Such memory has no legacy IPC handle. What can cross processes is the physical allocation
//! behind the user's address: `cuMemExportToShareableHandle` turns it into a file descriptor, the
//! per-process exporter service (`transport::fd_pass`) hands that to the peer over an abstract
//! Unix socket (SCM_RIGHTS), and the peer imports it (`cuMemImportFromShareableHandle`), maps it
//! into a range of its own (`cuMemAddressReserve` + `cuMemMap`) and gives its GPU access
//! (`cuMemSetAccess`). The copy engine then reads from that range as from any peer memory.
//!
//! Sender side (`export`, on the user's thread when a send is posted):
//! - detection: `cuMemRetainAllocationHandle` succeeds only for VMM memory (the handle is released
//!   at once); the allocation must have been created with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`
//!   in `requestedHandleTypes` (`cuMemGetAllocationPropertiesFromHandle`), else the error says so
//!   and the caller falls back to host staging;
//! - what is shared is the one physical allocation mapped at the user's address: its mapping's
//!   base and size (`CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR`/`_SIZE`, or `cuMemGetAddressRange`
//!   where the driver lacks them) and the offset of that base in the physical allocation (always
//!   0 today: `cuMemMap` requires offset 0, the key carries it anyway);
//! - exports are cached by the driver's buffer id (never reused), like the legacy cache in `ipc`,
//!   and checked on every hit against the handle now mapped at the address, so a repeated send does
//!   not export again and a remapped range is never served stale. The exporter keeps the
//!   descriptor open while it serves it, and an open descriptor may keep the physical memory
//!   alive after the user frees it, so entries whose allocation is gone are withdrawn (and their
//!   descriptors closed): at once when gscomm's allocator frees it (`withdraw`), within 100 ms
//!   when `export_life`'s sweep finds it freed (`withdraw_export`), and when a new export finds
//!   the cache grown (at 64 entries, then each time it has doubled); at most `MAX_EXPORTS`
//!   descriptors are held.
//!
//! Receiver side (`import`, on the proxy thread through `ipc::map_peer`): fetch the descriptor
//! (bounded by `FETCH_TIMEOUT`), import it, close it, reserve a range rounded to the allocation's
//! granularity, map, grant read/write to the GPU doing the copy, release the imported handle (the
//! mapping holds the memory). `ipc::map_peer` caches the mapping per (peer, base, local GPU) and
//! unmaps it (`release`) when the peer replaces the allocation. None of these calls waits behind
//! a user stream that waits on the proxy, nor behind a spinning kernel (`docs/probes/vmm_block.py`:
//! the import calls on 2 × H200, 2026-11-21; `cuMemUnmap` too, ~0.1 ms, on an H100, 2026-11-23),
//! unlike the legacy `cuIpcCloseMemHandle`.
//!
//! Not done: a buffer that spans several physical allocations (an expandable segment's tensor
//! across two chunks) is described by its first one only, so the receiver refuses it as out of
//! range and the data is pushed; fabric handles (multi-node NVLink).

use super::copy::primary_context;
use super::{CtxScope, check, cu};
use crate::error::{Error, Result, Status};
use crate::transport::fd_pass::{self, FdServer, SocketName};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long an importer waits for the exporter's answer (the exporter's thread does nothing
/// else, so it answers in microseconds unless its process is stuck or gone).
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);
/// Export cache size at which entries of freed allocations are first looked for and withdrawn;
/// the next sweep waits until the cache has doubled, so sweeping costs O(1) per export.
const SWEEP_AT: usize = 64;
/// Hard bound on the descriptors the exporter holds open. Past it the oldest exports are
/// withdrawn even if their allocations live: a later send of one exports it again, and a peer
/// that had not fetched it yet (its RTS older than 256 newer exports) gets "unknown export id",
/// so it asks for a push (or fails, with `GSC_CUDA_IPC=on`).
const MAX_EXPORTS: usize = 512;

static EXPORTS: AtomicU64 = AtomicU64::new(0);
static IMPORTS: AtomicU64 = AtomicU64::new(0);
static READS: AtomicU64 = AtomicU64::new(0);
static REPLACED: AtomicU64 = AtomicU64::new(0);
static FREED: AtomicU64 = AtomicU64::new(0);

/// Allocations exported (descriptors made) by this process.
pub(crate) fn exports() -> u64 {
    EXPORTS.load(Ordering::Relaxed)
}

/// Peer allocations imported and mapped by this process.
pub(crate) fn imports() -> u64 {
    IMPORTS.load(Ordering::Relaxed)
}

/// Mappings unmapped because their peer allocation was replaced (`ipc::map_peer`).
pub(crate) fn replaced() -> u64 {
    REPLACED.load(Ordering::Relaxed)
}

pub(crate) fn count_replaced() {
    REPLACED.fetch_add(1, Ordering::Relaxed);
}

/// Mappings unmapped because their owner freed the allocation (`ipc::let_go_of_freed`).
pub(crate) fn freed() -> u64 {
    FREED.load(Ordering::Relaxed)
}

pub(crate) fn count_freed() {
    FREED.fetch_add(1, Ordering::Relaxed);
}

/// Reads of peer memory resolved through a VMM mapping (`ipc::map_peer` answers).
pub(crate) fn reads() -> u64 {
    READS.load(Ordering::Relaxed)
}

pub(crate) fn count_read() {
    READS.fetch_add(1, Ordering::Relaxed);
}

const POSIX_FD: cu::CUmemAllocationHandleType = cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

/// An allocation handle we hold a reference on; released on drop.
struct Handle(cu::CUmemGenericAllocationHandle);

impl Handle {
    /// The handle mapped at `addr`: an error for memory that is not a VMM mapping.
    fn retain(addr: u64) -> Result<Handle> {
        let mut h: cu::CUmemGenericAllocationHandle = 0;
        // SAFETY: a valid out-pointer; the driver only looks the address up.
        check(unsafe { cu::cuMemRetainAllocationHandle(&mut h, addr as usize as *mut std::ffi::c_void) }, "cuMemRetainAllocationHandle")?;
        Ok(Handle(h))
    }

    fn properties(&self) -> Result<cu::CUmemAllocationProp> {
        // SAFETY: all-zero is a valid property block to be overwritten.
        let mut prop: cu::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        // SAFETY: a live handle and a valid out-pointer.
        check(unsafe { cu::cuMemGetAllocationPropertiesFromHandle(&mut prop, self.0) }, "cuMemGetAllocationPropertiesFromHandle")?;
        Ok(prop)
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: one reference we hold, released once.
        unsafe { cu::cuMemRelease(self.0) };
    }
}

/// Whether `addr` lies in a mapped VMM allocation.
pub(crate) fn is_vmm(addr: u64) -> bool {
    Handle::retain(addr).is_ok()
}

/// The value of the allocation handle mapped at `addr`, if it is VMM memory.
pub(crate) fn handle_value(addr: u64) -> Option<u64> {
    Handle::retain(addr).ok().map(|h| h.0)
}

/// Whether `device` may read and write the VMM mapping holding `addr` (`cuMemGetAccess`):
/// VMM memory ignores `cuCtxEnablePeerAccess`, so another GPU of this process reaches it by
/// address only where its owner granted that GPU access (`cuMemSetAccess`).
pub(crate) fn readwrite_from(addr: u64, device: i32) -> Result<bool> {
    // SAFETY: all-zero is a valid location to fill in.
    let mut location: cu::CUmemLocation = unsafe { std::mem::zeroed() };
    location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    location.id = device;
    let mut flags: u64 = 0;
    // SAFETY: a valid out-value and location; the driver only looks the address up.
    check(unsafe { cu::cuMemGetAccess(&mut flags, &location, addr as cu::CUdeviceptr) }, "cuMemGetAccess")?;
    Ok(flags == cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE as u64)
}

/// A pointer attribute read into a zeroed u64 (every attribute read here is at most 8 bytes).
fn attr_u64(addr: u64, which: cu::CUpointer_attribute) -> Option<u64> {
    let mut v: u64 = 0;
    // SAFETY: an 8-byte out-value, at least as wide as what the driver writes for `which`.
    let r = unsafe { cu::cuPointerGetAttribute(&mut v as *mut u64 as *mut std::ffi::c_void, which, addr as cu::CUdeviceptr) };
    (r == cu::CUresult::CUDA_SUCCESS).then_some(v)
}

/// The mapping `addr` belongs to: (base, size).
fn mapping_range(addr: u64) -> Result<(u64, u64)> {
    use cu::CUpointer_attribute::{CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR as BASE, CU_POINTER_ATTRIBUTE_MAPPING_SIZE as SIZE};
    let (base, size) = match (attr_u64(addr, BASE), attr_u64(addr, SIZE)) {
        (Some(b), Some(s)) if s > 0 => (b, s),
        _ => {
            let (mut b, mut s): (cu::CUdeviceptr, usize) = (0, 0);
            // SAFETY: valid out-pointers; the driver only looks the address up.
            check(unsafe { cu::cuMemGetAddressRange_v2(&mut b, &mut s, addr as cu::CUdeviceptr) }, "cuMemGetAddressRange")?;
            (b, s as u64)
        }
    };
    if addr < base || addr - base >= size {
        return Err(Error::new(Status::DeviceError, format!("the driver places {addr:#x} outside its own mapping {base:#x}+{size}")));
    }
    Ok((base, size))
}

/// What a peer needs to map one of our VMM allocations.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct VmmExport {
    pub socket: SocketName,
    pub export_id: u64,
    /// The mapping the user's address lies in (the peer maps `size` bytes).
    pub base: u64,
    pub size: u64,
    /// Where `base` is in the physical allocation.
    pub phys_offset: u64,
    /// The allocation handle value mapped at the exported address (0 on the importer's side,
    /// which does not know it): tells allocations remapped under one buffer id apart.
    pub handle: u64,
}

struct Exported {
    export: VmmExport,
    /// The allocation handle value mapped at `export.base` when exported (the driver returns the
    /// same value for every retain of one allocation).
    handle: cu::CUmemGenericAllocationHandle,
    /// The address the export was made for and its buffer id, to tell later whether that
    /// allocation still lives.
    addr: u64,
    buffer_id: u64,
}

/// This process's exporter service, started on the first export.
static SERVER: Mutex<Option<(u32, Arc<FdServer>)>> = Mutex::new(None);

/// This process's exporter (also serves `export_life`'s table).
pub(crate) fn server() -> Result<Arc<FdServer>> {
    let mut s = SERVER.lock().unwrap_or_else(|e| e.into_inner());
    let pid = std::process::id();
    if let Some((owner, srv)) = s.as_ref() {
        if *owner != pid {
            return Err(Error::unsupported(
                "this process was forked from the one that started the fd exporter; it cannot export VMM memory",
            ));
        }
        return Ok(srv.clone());
    }
    let srv = Arc::new(FdServer::start()?);
    *s = Some((pid, srv.clone()));
    Ok(srv)
}

/// Our exporter's name, if it was started (a key naming it is one of ours).
pub(crate) fn own_socket() -> Option<SocketName> {
    SERVER.lock().unwrap_or_else(|e| e.into_inner()).as_ref().filter(|(pid, _)| *pid == std::process::id()).map(|(_, s)| s.name())
}

/// Buffer id -> export, and the cache size at which to sweep next.
static EXPORTED: Mutex<Option<(HashMap<u64, Exported>, usize)>> = Mutex::new(None);

/// The allocation with driver buffer id `buffer_id` is being freed by its owner (`cuda::alloc`):
/// withdraw its export, if any, so the exporter's descriptor no longer pins the physical memory
/// (the sweep would find it only later), and tell the peers that mapped it (`export_life::gone`),
/// so that they let go of their mappings, which pin it too.
pub(crate) fn withdraw(buffer_id: u64) {
    super::export_life::gone(buffer_id);
    withdraw_export(buffer_id, None);
}

/// Stop serving the export of the allocation with buffer id `buffer_id` (and, if given, handle
/// value `handle`: another allocation remapped under that id keeps its export) and close its
/// descriptor, which would pin the memory: `export_life` found it freed.
pub(crate) fn withdraw_export(buffer_id: u64, handle: Option<u64>) {
    let mut cache = EXPORTED.lock().unwrap_or_else(|e| e.into_inner());
    let Some((map, _)) = cache.as_mut() else { return };
    if map.get(&buffer_id).is_none_or(|x| handle.is_some_and(|h| h != x.handle)) {
        return;
    }
    let x = map.remove(&buffer_id).expect("looked up above");
    if let Ok(srv) = server() {
        srv.withdraw(x.export.export_id);
    }
}

/// Describe the VMM allocation holding `addr` (device `device`, driver buffer id `buffer_id`) for
/// a peer, exporting it the first time.
pub(crate) fn export(addr: u64, buffer_id: u64, device: i32) -> Result<VmmExport> {
    let _scope = CtxScope::enter(primary_context(device)?)?;
    let handle = Handle::retain(addr).map_err(|e| e.context("not a VMM allocation"))?;
    let mut cache = EXPORTED.lock().unwrap_or_else(|e| e.into_inner());
    let (map, sweep_at) = cache.get_or_insert_with(|| (HashMap::new(), SWEEP_AT));
    if let Some(x) = map.get(&buffer_id) {
        let e = x.export;
        if x.handle == handle.0 && addr >= e.base && addr - e.base < e.size {
            return Ok(e);
        }
        // Another allocation is mapped there now under the same buffer id: export afresh.
        if let Ok(srv) = server() {
            srv.withdraw(e.export_id);
        }
        map.remove(&buffer_id);
    }
    let prop = handle.properties()?;
    if prop.requestedHandleTypes & POSIX_FD != POSIX_FD {
        return Err(Error::unsupported(format!(
            "the VMM allocation at {addr:#x} was created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in \
             requestedHandleTypes (it has {:#x}), so it cannot be shared with another process",
            prop.requestedHandleTypes.0
        )));
    }
    let (base, size) = mapping_range(addr)?;
    let mut raw: std::ffi::c_int = -1;
    // SAFETY: for POSIX_FD the driver writes an int descriptor through the pointer; `handle` is
    // live. The descriptor is ours (owned right below).
    check(
        unsafe { cu::cuMemExportToShareableHandle(&mut raw as *mut std::ffi::c_int as *mut std::ffi::c_void, handle.0, POSIX_FD, 0) },
        "cuMemExportToShareableHandle",
    )?;
    if raw < 0 {
        return Err(Error::new(Status::DeviceError, "cuMemExportToShareableHandle returned no descriptor"));
    }
    // SAFETY: a fresh descriptor the driver made for us.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let srv = server()?;
    if map.len() >= *sweep_at {
        sweep(map, &srv);
        *sweep_at = (2 * map.len()).clamp(SWEEP_AT, MAX_EXPORTS);
    }
    let export_id = srv.publish(fd);
    EXPORTS.fetch_add(1, Ordering::Relaxed);
    let export = VmmExport { socket: srv.name(), export_id, base, size, phys_offset: 0, handle: handle.0 };
    tracing::debug!(target: "gsc::cuda", base = format_args!("{base:#x}"), size, export_id, "VMM allocation exported");
    map.insert(buffer_id, Exported { export, handle: handle.0, addr, buffer_id });
    Ok(export)
}

/// Withdraw the exports of allocations that are gone (their descriptors may pin freed memory),
/// then bound the cache.
fn sweep(map: &mut HashMap<u64, Exported>, srv: &FdServer) {
    use cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID as BUFFER_ID;
    let dead: Vec<u64> = map
        .iter()
        .filter(|(_, x)| {
            let same_id = attr_u64(x.addr, BUFFER_ID) == Some(x.buffer_id);
            !(same_id && Handle::retain(x.addr).is_ok_and(|h| h.0 == x.handle))
        })
        .map(|(k, _)| *k)
        .collect();
    for k in dead {
        if let Some(x) = map.remove(&k) {
            srv.withdraw(x.export.export_id);
        }
    }
    if map.len() >= MAX_EXPORTS {
        let mut ids: Vec<(u64, u64)> = map.iter().map(|(k, x)| (x.export.export_id, *k)).collect();
        ids.sort_unstable();
        for (id, k) in ids.into_iter().take(map.len() - MAX_EXPORTS / 2) {
            srv.withdraw(id);
            map.remove(&k);
        }
    }
}

/// A peer allocation mapped into our address space.
#[derive(Debug)]
pub(crate) struct Imported {
    pub va: u64,
    /// Bytes reserved and mapped at `va` (the peer's mapping size rounded to the granularity).
    pub len: u64,
    pub device: i32,
}

/// Fetch, import and map the peer's export on `device` (its primary context is made current).
pub(crate) fn import(x: &VmmExport, device: i32) -> Result<Imported> {
    if x.size == 0 {
        return Err(Error::new(Status::ConnectionReset, "a VMM key of an empty mapping"));
    }
    let fd = fd_pass::fetch_fd(&x.socket, x.export_id, FETCH_TIMEOUT)?;
    let _scope = CtxScope::enter(primary_context(device)?)?;
    let mut h: cu::CUmemGenericAllocationHandle = 0;
    // SAFETY: for POSIX_FD the driver takes the descriptor's value in the pointer argument and
    // does not take ownership of it; `fd` stays open for the call and is closed after it.
    check(
        unsafe { cu::cuMemImportFromShareableHandle(&mut h, fd.as_raw_fd() as usize as *mut std::ffi::c_void, POSIX_FD) },
        "cuMemImportFromShareableHandle",
    )?;
    let handle = Handle(h);
    drop(fd);
    let prop = handle.properties()?;
    let mut gran: usize = 0;
    let min = cu::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
    // SAFETY: valid pointers to a property block and an out-value.
    check(unsafe { cu::cuMemGetAllocationGranularity(&mut gran, &prop, min) }, "cuMemGetAllocationGranularity")?;
    let gran = gran.max(1) as u64;
    let len =
        x.size.checked_next_multiple_of(gran).ok_or_else(|| Error::new(Status::ConnectionReset, "a VMM key of an impossible size"))?;
    let mut va: cu::CUdeviceptr = 0;
    // SAFETY: a valid out-pointer; freed below on failure or by `release`.
    check(unsafe { cu::cuMemAddressReserve(&mut va, len as usize, gran as usize, 0, 0) }, "cuMemAddressReserve")?;
    // SAFETY: our fresh reservation of `len` bytes and a live imported handle; the driver checks
    // that `phys_offset + len` lies inside the physical allocation, so a peer's key cannot make
    // us map (and later read) more than it exported.
    if let Err(e) = check(unsafe { cu::cuMemMap(va, len as usize, x.phys_offset as usize, handle.0, 0) }, "cuMemMap") {
        // SAFETY: our reservation, with nothing mapped in it.
        unsafe { cu::cuMemAddressFree(va, len as usize) };
        return Err(e);
    }
    let imported = Imported { va, len, device };
    // SAFETY: all-zero is a valid descriptor to fill in.
    let mut access: cu::CUmemAccessDesc = unsafe { std::mem::zeroed() };
    access.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device;
    access.flags = cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    // SAFETY: the range we just mapped and one valid descriptor.
    if let Err(e) = check(unsafe { cu::cuMemSetAccess(va, len as usize, &access, 1) }, "cuMemSetAccess") {
        // Nothing can have used the range: undone at once (unmapping does not wait, module doc).
        if let Err(undo) = release(&imported) {
            tracing::warn!(target: "gsc::cuda", va = format_args!("{va:#x}"), len, error = %undo, "could not undo a VMM mapping that got no access");
        }
        return Err(e.context(format!("GPU {device} cannot access the peer's memory (no peer access between the GPUs?)")));
    }
    drop(handle);
    IMPORTS.fetch_add(1, Ordering::Relaxed);
    tracing::debug!(target: "gsc::cuda", socket = %x.socket, export_id = x.export_id, va = format_args!("{va:#x}"), len, device, "peer VMM allocation mapped");
    Ok(imported)
}

/// Unmap and free an imported mapping that nothing uses any more. It does not wait for the
/// device (module doc), so the proxy thread may call it.
pub(crate) fn release(m: &Imported) -> Result<()> {
    let _scope = CtxScope::enter(primary_context(m.device)?)?;
    // SAFETY: a range `import` mapped and nobody uses any more (the caller's promise).
    check(unsafe { cu::cuMemUnmap(m.va, m.len as usize) }, "cuMemUnmap")?;
    // SAFETY: the reservation `import` made, now empty.
    check(unsafe { cu::cuMemAddressFree(m.va, m.len as usize) }, "cuMemAddressFree")
}

/// A VMM allocation of our own, exportable as a POSIX descriptor (`api::DeviceBuf::new_vmm`, and
/// the allocator behind `mem_alloc`, `cuda::alloc`).
pub(crate) struct Owned {
    pub ptr: u64,
    /// Bytes reserved and mapped at `ptr` (a multiple of the granularity).
    pub len: usize,
    handle: cu::CUmemGenericAllocationHandle,
}

/// The properties of a pinned allocation on `device` that can be exported as a POSIX file
/// descriptor; `gdr`: ask for GPUDirect RDMA capability (the device must support it with VMM).
pub(crate) fn shareable_prop(device: i32, gdr: bool) -> cu::CUmemAllocationProp {
    // SAFETY: all-zero is a valid property block (no compression, no special flags).
    let mut prop: cu::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    prop.requestedHandleTypes = POSIX_FD;
    prop.allocFlags.gpuDirectRDMACapable = u8::from(gdr);
    prop
}

/// The allocation granularity for `prop`: the minimum, or the recommended one (what NCCL's
/// cuMem allocator rounds to: a multiple of the minimum that the driver maps faster).
pub(crate) fn granularity(prop: &cu::CUmemAllocationProp, recommended: bool) -> Result<usize> {
    use cu::CUmemAllocationGranularity_flags::{CU_MEM_ALLOC_GRANULARITY_MINIMUM as MIN, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED as REC};
    let mut gran: usize = 0;
    // SAFETY: valid pointers to a property block and an out-value.
    check(
        unsafe { cu::cuMemGetAllocationGranularity(&mut gran, prop, if recommended { REC } else { MIN }) },
        "cuMemGetAllocationGranularity",
    )?;
    Ok(gran.max(1))
}

impl Owned {
    /// At least `bytes` (rounded up to the minimum granularity) on the current context's device,
    /// readable and writable by that device only, mapped where the driver likes or, with `at`
    /// non-zero, at `at` if that range is free (the driver's hint; `ptr` says where it landed).
    pub(crate) fn new(bytes: usize, at: u64) -> Result<Owned> {
        let mut dev: cu::CUdevice = 0;
        super::current_context()?;
        // SAFETY: a valid out-pointer; a context is current.
        check(unsafe { cu::cuCtxGetDevice(&mut dev) }, "cuCtxGetDevice")?;
        let prop = shareable_prop(dev, false);
        let gran = granularity(&prop, false)?;
        let len = bytes.max(1).checked_next_multiple_of(gran).ok_or_else(|| Error::invalid_param("allocation size overflows"))?;
        Owned::create(&prop, len, gran, &[dev], at)
    }

    /// Create `len` bytes (a multiple of `align`, the granularity for `prop`) with `prop`,
    /// reserve a range aligned to `align` (at `at` if non-zero and free), map it and grant
    /// read/write to each of `access` (device ordinals; the owner among them). On failure
    /// everything done is undone.
    pub(crate) fn create(prop: &cu::CUmemAllocationProp, len: usize, align: usize, access: &[i32], at: u64) -> Result<Owned> {
        let mut h: cu::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid pointers; the handle is released by `Handle`'s drop on failure below, or
        // by `Owned`'s drop / `free`.
        check(unsafe { cu::cuMemCreate(&mut h, len, prop, 0) }, "cuMemCreate")?;
        let handle = Handle(h);
        let mut ptr: cu::CUdeviceptr = 0;
        // SAFETY: a valid out-pointer.
        check(unsafe { cu::cuMemAddressReserve(&mut ptr, len, align, at, 0) }, "cuMemAddressReserve")?;
        // SAFETY: our reservation and our allocation, both `len` bytes.
        if let Err(e) = check(unsafe { cu::cuMemMap(ptr, len, 0, handle.0, 0) }, "cuMemMap") {
            // SAFETY: our empty reservation.
            unsafe { cu::cuMemAddressFree(ptr, len) };
            return Err(e);
        }
        let descs: Vec<cu::CUmemAccessDesc> = access
            .iter()
            .map(|&d| {
                // SAFETY: all-zero is a valid descriptor to fill in.
                let mut a: cu::CUmemAccessDesc = unsafe { std::mem::zeroed() };
                a.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
                a.location.id = d;
                a.flags = cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
                a
            })
            .collect();
        // SAFETY: the range we just mapped and `descs.len()` valid descriptors.
        if let Err(e) = check(unsafe { cu::cuMemSetAccess(ptr, len, descs.as_ptr(), descs.len()) }, "cuMemSetAccess") {
            // SAFETY: our mapping and reservation, unused by anyone.
            unsafe {
                cu::cuMemUnmap(ptr, len);
                cu::cuMemAddressFree(ptr, len);
            }
            return Err(e.context(format!("granting devices {access:?} access to a new VMM allocation")));
        }
        let handle = std::mem::ManuallyDrop::new(handle);
        Ok(Owned { ptr, len, handle: handle.0 })
    }

    /// Undo `create`, reporting the driver's errors (drop ignores them): unmap (no work may use
    /// the range any more: the unmap does not synchronize the device), release the physical memory, free the
    /// address range. Every step is tried; the first failure is returned.
    pub(crate) fn free(self) -> Result<()> {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: our mapping, reservation and handle, each undone once (`this` is not dropped).
        let steps = unsafe {
            [
                check(cu::cuMemUnmap(this.ptr, this.len), "cuMemUnmap"),
                check(cu::cuMemRelease(this.handle), "cuMemRelease"),
                check(cu::cuMemAddressFree(this.ptr, this.len), "cuMemAddressFree"),
            ]
        };
        steps.into_iter().collect::<Result<Vec<()>>>().map(|_| ())
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        // SAFETY: our mapping, reservation and handle, each undone once: unmap, then release the
        // physical memory, then free the address range.
        unsafe {
            cu::cuMemUnmap(self.ptr, self.len);
            cu::cuMemRelease(self.handle);
            cu::cuMemAddressFree(self.ptr, self.len);
        }
    }
}
