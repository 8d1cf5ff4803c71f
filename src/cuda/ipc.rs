//! CUDA IPC: how a receiver in another process reads a sender's GPU buffer directly.
//!
//! The sender describes the allocation its buffer lies in (`DeviceKey`) and sends that with the
//! rendezvous RTS. Three kinds of key:
//! - legacy: a `cuIpcGetMemHandle` handle, the allocation's base and size, the process id. The
//!   receiver opens the handle once (`cuIpcOpenMemHandle`, cached per peer allocation and local
//!   GPU) and copies from the mapping with the copy engine over NVLink/PCIe;
//! - VMM (`cuMemCreate` memory, which has no legacy handle): the mapping's base and size, and
//!   where the receiver gets a POSIX file descriptor of the physical allocation: the sender's
//!   exporter socket and the export id (see `vmm` and `transport::fd_pass`). The receiver fetches
//!   the descriptor, imports and maps it once (cached like a legacy handle) and copies the same way;
//! - same process: between two workers of one process the address is used as it is (unified
//!   addressing), since a process cannot open its own IPC handles.
//!
//! `export` tries the legacy handle first and, when that fails for memory that is a VMM
//! allocation, exports it as a descriptor (memory from gscomm's own allocator, `alloc`, is known
//! to be VMM and goes straight to the descriptor). Which of the two a buffer id needs is cached, so the
//! failing legacy call is made once per allocation.
//!
//! Handles are cached on both sides. The export caches are keyed by the driver's buffer id, which
//! is never reused, so a freed and re-made allocation gets a fresh handle. The mapping cache is
//! keyed by (peer process, allocation base, local GPU) and compares the handle (or the exporter
//! and export id): a different one at the same base means the peer freed the old allocation and
//! made a new one there (as PyTorch's expandable segments do, mapping new memory into the same
//! range). Nothing of ours still reads the old one: the peer frees a buffer only after its own
//! operations on it completed, and those complete only after our reads of it did (but for a
//! round the peer gave up on: hence `GRACE`). So:
//! - a VMM mapping is unmapped `GRACE` (2 s) later, by `export_life`'s thread. `cuMemUnmap` of an
//!   imported mapping does not wait for the device: ~0.1 ms on an H100 while a stream waited on
//!   a memop and a kernel spun (`docs/probes/vmm_block.py 2`, 2026-11-23), so any thread may
//!   call it;
//! - a legacy mapping is retired, not closed: `cuIpcCloseMemHandle` synchronizes the device, and
//!   `map_peer` runs on the proxy thread while user streams may wait on it (measured: it
//!   deadlocks). Retired mappings keep the peer's freed memory until `release_retired` is called
//!   at a point where no stream waits on gscomm (`cuda::api::release_retired_peer_mappings`), or
//!   the process exits.
//!
//! A peer that frees an allocation without mapping new memory at its address is found out
//! through its liveness table (`export_life`): every legacy and VMM key says where the owner
//! publishes whether the allocation still exists, the owner marks it gone when its allocator
//! frees it or its sweep finds it gone, and a thread of ours looks through the mappings for such
//! ones every 100 ms (`release_retired` too). They are let go of as replaced ones are:
//! a VMM mapping unmapped after `GRACE`, a legacy one retired. A mapping is looked up by its
//! liveness entry too, so one whose entry says gone is never used again. Without that, a mapping
//! kept the peer's memory used until this process exited (`docs/probes/ipc_free_held.py`).
//!
//! Not covered yet: a VMM buffer that spans several physical allocations (only the mapping its
//! first byte is in is described, so the receiver refuses the range and the sender pushes the
//! data through host memory); VMM memory made without `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`
//! (no key: pushed); peers in another network namespace (the exporter's abstract socket is out
//! of reach: pushed); fabric handles across nodes.

use super::copy::primary_context;
use super::export_life::{self, LIFE_LEN, Life, PeerTable};
use super::memory::DevicePtr;
use super::vmm;
use super::{CtxScope, check, cu};
use crate::error::{Error, Result, Status};
use crate::transport::fd_pass::{SocketName, TOKEN_LEN};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const KIND_LEGACY_IPC: u8 = 1;
const KIND_SAME_PROCESS: u8 = 2;
const KIND_VMM_FD: u8 = 3;
pub(crate) const HANDLE_LEN: usize = 64;
/// Every kind starts with: kind, 3 reserved (zero), pid, base, size.
const HEADER_LEN: usize = 1 + 3 + 4 + 8 + 8;
/// Encoded size of a same-process key: the header, then zeros where a legacy key has its handle.
pub(crate) const KEY_LEN: usize = HEADER_LEN + HANDLE_LEN;
/// Encoded size of a legacy key: the header, the handle, the allocation's liveness entry.
pub(crate) const LEGACY_KEY_LEN: usize = KEY_LEN + LIFE_LEN;
/// Encoded size of a VMM key: the header, export id, offset in the physical allocation, the
/// exporter's token, the allocation's liveness entry.
pub(crate) const VMM_KEY_LEN: usize = HEADER_LEN + 8 + 8 + TOKEN_LEN + LIFE_LEN;

/// How a peer reaches one of our device allocations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DeviceKey {
    pub pid: u32,
    /// The allocation (legacy) or mapping (VMM) the buffer lies in.
    pub base: u64,
    pub size: u64,
    pub kind: KeyKind,
    /// Where the owner publishes whether the allocation still exists (`export_life`): legacy
    /// and VMM keys; `None` when untracked.
    pub life: Option<Life>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum KeyKind {
    /// Same process: use the address as it is.
    SameProcess,
    /// A `cuIpcGetMemHandle` handle of the allocation at `base`.
    Legacy([u8; HANDLE_LEN]),
    /// A VMM mapping whose physical allocation the peer's fd exporter serves.
    Vmm(VmmRef),
}

/// Where a VMM allocation's descriptor is and how to map it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct VmmRef {
    /// The exporter's socket token (its name is made of the key's pid and this).
    pub token: [u8; TOKEN_LEN],
    pub export_id: u64,
    /// Where the key's `base` is in the physical allocation.
    pub phys_offset: u64,
}

impl VmmRef {
    fn socket(&self, pid: u32) -> SocketName {
        SocketName { pid, token: self.token }
    }
}

fn bad_key(what: impl Into<std::borrow::Cow<'static, str>>) -> Error {
    Error::new(Status::ConnectionReset, what)
}

impl DeviceKey {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let kind = match self.kind {
            KeyKind::SameProcess => KIND_SAME_PROCESS,
            KeyKind::Legacy(_) => KIND_LEGACY_IPC,
            KeyKind::Vmm(_) => KIND_VMM_FD,
        };
        let mut v = Vec::with_capacity(VMM_KEY_LEN.max(LEGACY_KEY_LEN));
        v.push(kind);
        v.extend_from_slice(&[0; 3]);
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.base.to_le_bytes());
        v.extend_from_slice(&self.size.to_le_bytes());
        match &self.kind {
            KeyKind::SameProcess => v.extend_from_slice(&[0; HANDLE_LEN]),
            KeyKind::Legacy(h) => {
                v.extend_from_slice(h);
                Life::encode(self.life.as_ref(), &mut v);
            }
            KeyKind::Vmm(r) => {
                v.extend_from_slice(&r.export_id.to_le_bytes());
                v.extend_from_slice(&r.phys_offset.to_le_bytes());
                v.extend_from_slice(&r.token);
                Life::encode(self.life.as_ref(), &mut v);
            }
        }
        v
    }

    pub(crate) fn decode(b: &[u8]) -> Result<DeviceKey> {
        let Some(&kind) = b.first() else { return Err(bad_key("empty device memory key")) };
        let want = match kind {
            KIND_SAME_PROCESS => KEY_LEN,
            KIND_LEGACY_IPC => LEGACY_KEY_LEN,
            KIND_VMM_FD => VMM_KEY_LEN,
            k => return Err(bad_key(format!("device memory key of unknown kind {k}"))),
        };
        if b.len() != want {
            return Err(bad_key(format!("device memory key of kind {kind} with {} bytes (expected {want})", b.len())));
        }
        if b[1..4] != [0; 3] {
            return Err(bad_key("device memory key with nonzero reserved bytes"));
        }
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let pid = u32::from_le_bytes(b[4..8].try_into().expect("4 bytes"));
        let (base, size) = (u64_at(8), u64_at(16));
        if base.checked_add(size).is_none() {
            return Err(bad_key("device memory key describes a range past the address space"));
        }
        let life = match kind {
            KIND_SAME_PROCESS => None,
            _ => Life::decode(&b[b.len() - LIFE_LEN..]).map_err(|what| bad_key(format!("device memory key with {what}")))?,
        };
        let kind = match kind {
            KIND_LEGACY_IPC => KeyKind::Legacy(b[HEADER_LEN..KEY_LEN].try_into().expect("64 bytes")),
            KIND_SAME_PROCESS => KeyKind::SameProcess,
            _ => {
                let r = VmmRef {
                    export_id: u64_at(HEADER_LEN),
                    phys_offset: u64_at(HEADER_LEN + 8),
                    token: b[HEADER_LEN + 16..HEADER_LEN + 16 + TOKEN_LEN].try_into().expect("token bytes"),
                };
                if size == 0 || r.export_id == 0 || r.token == [0; TOKEN_LEN] {
                    return Err(bad_key("VMM device memory key with an empty mapping, export id or exporter token"));
                }
                if r.phys_offset.checked_add(size).is_none() {
                    return Err(bad_key("VMM device memory key describes a range past its physical allocation"));
                }
                KeyKind::Vmm(r)
            }
        };
        Ok(DeviceKey { pid, base, size, kind, life })
    }

    /// Where `[addr, addr+len)` of the peer's allocation is, checked to lie inside it.
    pub(crate) fn offset_of(&self, addr: u64, len: usize) -> Result<u64> {
        let end = addr.checked_add(len as u64);
        if addr < self.base || end.is_none_or(|e| e > self.base + self.size) {
            return Err(bad_key("the peer's buffer lies outside the allocation its key describes"));
        }
        Ok(addr - self.base)
    }
}

fn own_pid() -> u32 {
    std::process::id()
}

/// The key for the allocation holding `addr` (from `memory::device_ptr`).
pub(crate) fn export(addr: usize, ptr: DevicePtr) -> Result<DeviceKey> {
    enum Exported {
        Key(DeviceKey),
        /// A VMM allocation: `vmm` keeps its own cache.
        Vmm,
    }
    static EXPORTED: Mutex<Option<HashMap<u64, Exported>>> = Mutex::new(None);
    let mut cache = EXPORTED.lock().unwrap_or_else(|e| e.into_inner());
    let map = cache.get_or_insert_with(HashMap::new);
    match map.get(&ptr.buffer_id) {
        Some(Exported::Key(k)) => return Ok(k.clone()),
        Some(Exported::Vmm) => {
            drop(cache);
            return vmm_key(addr, ptr);
        }
        None => {}
    }
    // Our own allocator's VMM memory (`mem_alloc`, ncclMemAlloc) is known without asking the
    // driver, so its legacy handle is not even tried.
    if super::alloc::info(addr as u64).is_some_and(|i| i.vmm) {
        map.insert(ptr.buffer_id, Exported::Vmm);
        drop(cache);
        return vmm_key(addr, ptr);
    }
    // Both calls need a current context, and the proxy thread has none of its own.
    let scope = CtxScope::enter(primary_context(ptr.device)?)?;
    let legacy = || -> Result<DeviceKey> {
        let (mut base, mut size): (cu::CUdeviceptr, usize) = (0, 0);
        // SAFETY: valid out-pointers; `addr` is device memory (the caller asked the driver).
        check(unsafe { cu::cuMemGetAddressRange_v2(&mut base, &mut size, addr as cu::CUdeviceptr) }, "cuMemGetAddressRange")?;
        // SAFETY: zeroed is a valid handle value to be overwritten.
        let mut h: cu::CUipcMemHandle = unsafe { std::mem::zeroed() };
        // SAFETY: `base` is the start of a live allocation; a valid out-pointer.
        check(unsafe { cu::cuIpcGetMemHandle(&mut h, base) }, "cuIpcGetMemHandle")?;
        // Watched at the address the buffer id was read at: by construction the same allocation.
        let life = export_life::track(addr as u64, ptr.buffer_id, ptr.device, None);
        Ok(DeviceKey { pid: own_pid(), base, size: size as u64, kind: KeyKind::Legacy(h.reserved.map(|c| c as u8)), life })
    };
    // Buffer ids are never reused, so entries of freed buffers are only dead weight: bound it.
    if map.len() >= 4096 {
        map.clear();
    }
    match legacy() {
        Ok(key) => {
            map.insert(ptr.buffer_id, Exported::Key(key.clone()));
            Ok(key)
        }
        Err(e) if vmm::is_vmm(addr as u64) => {
            tracing::debug!(target: "gsc::cuda", legacy = %e, "a VMM allocation: exporting it as a file descriptor");
            map.insert(ptr.buffer_id, Exported::Vmm);
            drop((scope, cache));
            vmm_key(addr, ptr)
        }
        Err(e) => Err(e.context("this GPU buffer cannot be shared by CUDA IPC")),
    }
}

fn vmm_key(addr: usize, ptr: DevicePtr) -> Result<DeviceKey> {
    let x = vmm::export(addr as u64, ptr.buffer_id, ptr.device)
        .map_err(|e| e.context("this VMM GPU buffer cannot be shared with another process"))?;
    let r = VmmRef { token: x.socket.token, export_id: x.export_id, phys_offset: x.phys_offset };
    // Watched at the address the buffer id and the handle were read at (the mapping's base could
    // be another allocation's where the driver reports only the reservation's range).
    let life = export_life::track(addr as u64, ptr.buffer_id, ptr.device, Some(x.handle));
    Ok(DeviceKey { pid: x.socket.pid, base: x.base, size: x.size, kind: KeyKind::Vmm(r), life })
}

/// A key for a buffer the peer reaches in our own address space (two workers of one process).
pub(crate) fn same_process_key(addr: usize, len: usize) -> DeviceKey {
    DeviceKey { pid: own_pid(), base: addr as u64, size: len as u64, kind: KeyKind::SameProcess, life: None }
}

/// What identifies the peer allocation a mapping was made from.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Ident {
    Legacy([u8; HANDLE_LEN]),
    Vmm(VmmRef),
}

/// What has to be undone to drop a mapping.
#[derive(Debug)]
enum Opened {
    Legacy { device: i32, mapped: u64 },
    Vmm(vmm::Imported),
}

struct Mapping {
    ident: Ident,
    /// Our address of the peer's `base`.
    at: u64,
    /// The bytes readable from `at`: for legacy mappings the size the driver maps, which the
    /// peer's claim in the key is checked against; for VMM the mapping size the driver accepted.
    size: u64,
    opened: Opened,
    /// Where the owner tells whether the allocation still exists (untracked: `None`).
    life: Option<(Arc<PeerTable>, Life)>,
}

/// (peer pid, peer allocation base, local GPU) -> our mapping of it.
type Mappings = HashMap<(u32, u64, i32), Mapping>;
static MAPPED: Mutex<Option<Mappings>> = Mutex::new(None);

/// How long a VMM mapping stays after it was let go of (its allocation replaced or freed by
/// its owner), unless the application releases it itself (`release_retired`). A peer frees a
/// buffer only after its own call on it ended, and that normally means ours ended too. But a
/// rank that gives up on a round (its timeout, an abort) ends its call while our kernel or copy
/// may still be reading its buffer, and unmapping under that read would fault this process's
/// context. Such a read is a few milliseconds of copying from a peer that had arrived (1 GiB at
/// NVLink speed: ~3 ms), so the grace is hundreds of times that.
const GRACE: Duration = Duration::from_secs(2);

/// Why a mapping was let go of (which counter its unmap adds to).
#[derive(Copy, Clone, Debug)]
enum LetGo {
    /// The owner made a new allocation at its address.
    Replaced,
    /// The owner said it freed the allocation (`export_life`).
    Freed,
}

/// VMM mappings let go of, unmapped by `export_life`'s janitor once `GRACE` has passed.
static DYING: Mutex<Vec<(vmm::Imported, LetGo, Instant)>> = Mutex::new(Vec::new());

/// Mappings of peer allocations that were since replaced or freed; closed by `release_retired`.
static RETIRED: Mutex<Vec<Opened>> = Mutex::new(Vec::new());

/// Let go of a mapping nothing new will use (it left `MAPPED`): a VMM one is unmapped after
/// `GRACE`, a legacy one retired (closing it synchronizes the device: `release_retired`).
fn let_go(o: Opened, why: LetGo) {
    match o {
        Opened::Vmm(m) => {
            DYING.lock().unwrap_or_else(|e| e.into_inner()).push((m, why, Instant::now()));
            export_life::watch_mappings();
        }
        legacy => RETIRED.lock().unwrap_or_else(|e| e.into_inner()).push(legacy),
    }
}

/// Unmap a peer VMM mapping nobody reads any more, from any thread: with this thread's capture
/// mode relaxed, so that another thread capturing a stream in the global mode is not broken by
/// it (`cuMemUnmap` is one of the calls that mode forbids everywhere else). One the driver
/// refuses to unmap is kept for `release_retired`.
fn unmap_now(m: vmm::Imported, why: LetGo) {
    match super::with_relaxed_capture(|| vmm::release(&m)) {
        Ok(()) => match why {
            LetGo::Replaced => vmm::count_replaced(),
            LetGo::Freed => vmm::count_freed(),
        },
        Err(e) => {
            tracing::warn!(target: "gsc::cuda", mapping = ?m, error = %e, "could not unmap a peer VMM mapping; kept for release_retired");
            RETIRED.lock().unwrap_or_else(|e| e.into_inner()).push(Opened::Vmm(m));
        }
    }
}

/// Take every mapping whose allocation its owner has freed (`export_life`) out of `map` and let
/// go of it.
fn let_go_of_freed(map: &mut Mappings) {
    let freed: Vec<(u32, u64, i32)> =
        map.iter().filter(|(_, m)| m.life.as_ref().is_some_and(|(t, l)| !t.alive(l))).map(|(k, _)| *k).collect();
    for k in freed {
        if let Some(m) = map.remove(&k) {
            tracing::debug!(target: "gsc::cuda", pid = k.0, base = format_args!("{:#x}", k.1), "the peer freed an allocation mapped here; letting go of the mapping");
            let_go(m.opened, LetGo::Freed);
        }
    }
}

/// Unmap the VMM mappings let go of at least `grace` ago.
fn unmap_dying(grace: Duration) {
    let due: Vec<(vmm::Imported, LetGo)> = {
        let mut dying = DYING.lock().unwrap_or_else(|e| e.into_inner());
        let (due, wait): (Vec<_>, Vec<_>) = std::mem::take(&mut *dying).into_iter().partition(|(_, _, at)| at.elapsed() >= grace);
        *dying = wait;
        due.into_iter().map(|(m, why, _)| (m, why)).collect()
    };
    for (m, why) in due {
        unmap_now(m, why);
    }
}

/// `export_life`'s janitor, every period: let go of the mappings whose owners freed them, and
/// unmap those let go of `GRACE` ago. The mappings are skipped while another thread holds them:
/// `map_peer` may be fetching a descriptor or table under the lock (seconds, at worst), and the
/// next period comes soon.
pub(crate) fn let_go_of_freed_mappings() {
    match MAPPED.try_lock() {
        Ok(mut cache) => cache.as_mut().map_or((), let_go_of_freed),
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner().as_mut().map_or((), let_go_of_freed),
        Err(std::sync::TryLockError::WouldBlock) => {}
    }
    unmap_dying(GRACE);
}

/// Close the mappings of replaced peer allocations, and of those their owners have freed.
/// Closing synchronizes the device, so call it only where no stream waits on a gscomm operation
/// (never on the proxy thread). Returns how many were closed; every one is tried, and the first
/// failure is returned after.
pub(crate) fn release_retired() -> Result<usize> {
    // The caller promises nothing of ours still reads them: no grace.
    if let Some(map) = MAPPED.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
        let_go_of_freed(map);
    }
    unmap_dying(Duration::ZERO);
    let retired = std::mem::take(&mut *RETIRED.lock().unwrap_or_else(|e| e.into_inner()));
    let (mut done, mut first_err) = (0, None);
    for o in retired {
        let r = match &o {
            Opened::Legacy { device, mapped } => primary_context(*device).and_then(CtxScope::enter).and_then(|_scope| {
                // SAFETY: a mapping cuIpcOpenMemHandle made in this context, let go of (its
                // allocation replaced or freed), and the caller promises no copy or kernel reads
                // it any more; closed once (it left RETIRED above).
                check(unsafe { cu::cuIpcCloseMemHandle(*mapped) }, "cuIpcCloseMemHandle")
            }),
            Opened::Vmm(m) => vmm::release(m),
        };
        match r {
            Ok(()) => done += 1,
            Err(e) => {
                tracing::warn!(target: "gsc::cuda", mapping = ?o, error = %e, "could not close a retired peer mapping");
                first_err.get_or_insert(e);
            }
        }
    }
    first_err.map_or(Ok(done), Err)
}

/// Make sure `device`'s kernels and copies can reach `[addr, addr+len)`, memory of this
/// process (two ranks of one process, the other on another GPU): an ordinary allocation once
/// peer access from `device` to its GPU is on; a VMM one only where its owner granted `device`
/// access (`cuMemSetAccess`; `mem_alloc`'s memory grants every GPU that can reach it, PyTorch's
/// expandable segments only their own), checked at both ends of the range, since a VMM range
/// may be several mappings. An error names what is missing: reading such memory would fault
/// the kernel. Verdicts are cached by (allocation at the start, at the end, device).
pub(crate) fn reach_own(addr: u64, len: usize, device: i32) -> Result<()> {
    static REACHED: Mutex<Option<std::collections::HashSet<(u64, u64, i32)>>> = Mutex::new(None);
    let Some(first) = super::memory::device_ptr(addr as usize)? else { return Ok(()) };
    if first.device == device {
        return Ok(());
    }
    let last_addr = addr + (len.max(1) - 1) as u64;
    let last = super::memory::device_ptr(last_addr as usize)?.unwrap_or(first);
    let slot = (first.buffer_id, last.buffer_id, device);
    if REACHED.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(|r| r.contains(&slot)) {
        return Ok(());
    }
    super::enable_peer_access(device, first.device)?;
    let scope = CtxScope::enter(primary_context(first.device)?)?;
    if super::alloc::info(addr).is_some_and(|i| i.vmm) || vmm::is_vmm(addr) {
        for at in [addr, last_addr] {
            if !vmm::readwrite_from(at, device)? {
                return Err(Error::invalid_param(format!(
                    "a VMM buffer on GPU {} that GPU {device} has no access to (its allocator granted it none: \
                     cuMemSetAccess), so that GPU's kernels cannot reach it by address; allocate with ncclMemAlloc \
                     (gsc_mem_alloc), which grants every GPU of the process access",
                    first.device
                )));
            }
        }
    }
    drop(scope);
    let mut reached = REACHED.lock().unwrap_or_else(|e| e.into_inner());
    let set = reached.get_or_insert_with(Default::default);
    // Allocation ids are never reused: entries of freed buffers are only dead weight.
    if set.len() >= 4096 {
        set.clear();
    }
    set.insert(slot);
    Ok(())
}

/// The unified address at which the peer's `[addr, addr+len)` can be read from `device`'s
/// context, opening (and caching) the peer's allocation when needed.
pub(crate) fn map_peer(key: &DeviceKey, addr: u64, len: usize, device: i32) -> Result<u64> {
    let offset = key.offset_of(addr, len)?;
    // Our own allocation (described for a worker of this process, or for a peer in another
    // process): used directly — from `device`'s kernels too, when it lives on another GPU (two
    // ranks of one process).
    let ours = || reach_own(addr, len, device).map(|()| addr);
    let ident = match &key.kind {
        KeyKind::SameProcess if key.pid != own_pid() => return Err(bad_key("a same-process device key from another process")),
        KeyKind::SameProcess => return ours(),
        KeyKind::Legacy(_) if key.pid == own_pid() => return ours(),
        KeyKind::Legacy(h) => Ident::Legacy(*h),
        // Ours when it names our own exporter (the pid alone could be another namespace's).
        KeyKind::Vmm(r) if vmm::own_socket() == Some(r.socket(key.pid)) => return ours(),
        KeyKind::Vmm(r) => Ident::Vmm(*r),
    };
    let is_vmm = matches!(ident, Ident::Vmm(..));
    let mut cache = MAPPED.lock().unwrap_or_else(|e| e.into_inner());
    let map = cache.get_or_insert_with(HashMap::new);
    let slot = (key.pid, key.base, device);
    let within = |m: &Mapping| -> Result<u64> {
        if offset + len as u64 > m.size {
            return Err(bad_key("the peer's key claims more memory than its allocation has"));
        }
        if is_vmm {
            vmm::count_read();
        }
        Ok(m.at + offset)
    };
    // A hit needs the same liveness entry too: an owner can map an allocation it had unmapped
    // back at its address, under the export it had (`vmm::export`'s cache), while the entry our
    // mapping watches says gone, and the janitor would unmap it under the new use.
    let same_life = |m: &Mapping| m.life.as_ref().map(|(_, l)| *l) == key.life || m.life.is_none();
    if let Some(m) = map.get(&slot).filter(|m| m.ident == ident && same_life(m)) {
        return within(m);
    }
    if let Some(old) = map.remove(&slot) {
        // The peer freed that allocation and made a new one at the same address (module doc).
        tracing::debug!(target: "gsc::cuda", pid = key.pid, base = format_args!("{:#x}", key.base), vmm = is_vmm, "peer allocation replaced; letting go of the old mapping");
        let_go(old.opened, LetGo::Replaced);
    }
    // A VMM import fetches the descriptor from the peer's exporter under this lock: bounded by
    // vmm's fetch timeout, and immediate unless the exporter's process is stuck.
    let m = match ident {
        Ident::Vmm(r) => {
            let x = vmm::VmmExport {
                socket: r.socket(key.pid),
                export_id: r.export_id,
                base: key.base,
                size: key.size,
                phys_offset: r.phys_offset,
                handle: 0,
            };
            let imported = vmm::import(&x, device)?;
            Mapping { ident, at: imported.va, size: key.size, opened: Opened::Vmm(imported), life: None }
        }
        Ident::Legacy(handle) => {
            let _scope = CtxScope::enter(primary_context(device)?)?;
            // SAFETY: zeroed then filled with the peer's bytes.
            let mut h: cu::CUipcMemHandle = unsafe { std::mem::zeroed() };
            h.reserved = handle.map(|b| b as std::ffi::c_char);
            let mut mapped: cu::CUdeviceptr = 0;
            let flags = cu::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
            // SAFETY: a valid out-pointer; the driver validates the handle.
            let r = unsafe { cu::cuIpcOpenMemHandle_v2(&mut mapped, h, flags) };
            if r == cu::CUresult::CUDA_ERROR_ALREADY_MAPPED {
                // The peer's allocator carved this allocation out of a block this process has
                // already opened for another (maybe since freed) allocation of the peer: small
                // cudaMalloc allocations share blocks, and a block opens once per process.
                // Which of our mappings holds the block's current contents cannot be told, so
                // this buffer is not read through IPC: the sender pushes it (see `start_read`).
                return Err(Error::unsupported(
                    "cuIpcOpenMemHandle: the peer's allocation lies in a memory block this process already mapped",
                ));
            }
            check(r, "cuIpcOpenMemHandle")?;
            let (mut base, mut size): (cu::CUdeviceptr, usize) = (0, 0);
            // SAFETY: valid out-pointers; `mapped` was just mapped in the current context. A peer
            // cannot make us copy past the real allocation by claiming a larger one in its key.
            check(unsafe { cu::cuMemGetAddressRange_v2(&mut base, &mut size, mapped) }, "cuMemGetAddressRange(mapped)")?;
            Mapping { ident, at: mapped, size: size as u64, opened: Opened::Legacy { device, mapped }, life: None }
        }
    };
    // Where the owner will tell us it freed the allocation; without it (an owner whose table
    // cannot be reached) the mapping is kept until replaced, as before.
    let life = key.life.and_then(|l| export_life::peer_table(key.pid, &l).map(|t| (t, l)));
    if life.is_some() {
        export_life::watch_mappings();
    }
    let m = Mapping { life, ..m };
    let at = within(&m);
    map.insert(slot, m);
    at
}

#[cfg(test)]
mod tests {
    use super::*;

    fn life() -> Option<Life> {
        Some(Life { token: [0x33; TOKEN_LEN], table_id: 1, slot: 12, serial: 99 })
    }

    fn vmm_key() -> DeviceKey {
        let r = VmmRef { token: [0x5a; TOKEN_LEN], export_id: 17, phys_offset: 0 };
        DeviceKey { pid: 4242, base: 0x7f00_0020_0000, size: 2 << 20, kind: KeyKind::Vmm(r), life: life() }
    }

    #[test]
    fn keys_round_trip_and_reject_garbage() {
        let k = DeviceKey { pid: 4242, base: 0x7f00_0000_0000, size: 1 << 30, kind: KeyKind::Legacy([7; HANDLE_LEN]), life: life() };
        let b = k.encode();
        assert_eq!(b.len(), LEGACY_KEY_LEN);
        assert_eq!(DeviceKey::decode(&b).unwrap(), k);
        let untracked = DeviceKey { life: None, ..k.clone() };
        assert_eq!(DeviceKey::decode(&untracked.encode()).unwrap(), untracked);
        let same = same_process_key(0x1000, 64);
        assert_eq!(same.encode().len(), KEY_LEN);
        assert_eq!(DeviceKey::decode(&same.encode()).unwrap(), same);
        assert!(DeviceKey::decode(&b[..LEGACY_KEY_LEN - 1]).is_err());
        // A liveness entry with serial 0 is refused, naming it.
        let mut serial0 = b.clone();
        serial0[LEGACY_KEY_LEN - 4..].copy_from_slice(&[0; 4]);
        assert!(DeviceKey::decode(&serial0).unwrap_err().message().contains("serial 0"));
        assert!(DeviceKey::decode(&[]).is_err());
        let mut bad = b.clone();
        bad[0] = 9;
        assert!(DeviceKey::decode(&bad).unwrap_err().message().contains("unknown kind"));
        let mut reserved = b.clone();
        reserved[2] = 1;
        assert!(DeviceKey::decode(&reserved).unwrap_err().message().contains("reserved"));
        let mut wrap = b;
        wrap[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(DeviceKey::decode(&wrap).is_err());
    }

    #[test]
    fn vmm_keys_round_trip() {
        let k = vmm_key();
        let b = k.encode();
        assert_eq!(b.len(), VMM_KEY_LEN);
        assert_eq!(b[0], KIND_VMM_FD);
        assert_eq!(DeviceKey::decode(&b).unwrap(), k);
        let KeyKind::Vmm(r) = k.kind else { unreachable!() };
        assert_eq!(r.socket(k.pid), SocketName { pid: 4242, token: [0x5a; TOKEN_LEN] });
        // Every field survives, each at its own place.
        let r2 = VmmRef { token: core::array::from_fn(|i| i as u8 + 1), export_id: u64::MAX - 1, phys_offset: 4 << 20 };
        let l2 = Life { token: core::array::from_fn(|i| 200 - i as u8), table_id: u64::MAX, slot: 4095, serial: u32::MAX };
        let k2 = DeviceKey { pid: u32::MAX, base: 1 << 40, size: 6 << 20, kind: KeyKind::Vmm(r2), life: Some(l2) };
        assert_eq!(DeviceKey::decode(&k2.encode()).unwrap(), k2);
    }

    #[test]
    fn malformed_vmm_keys_are_rejected() {
        let b = vmm_key().encode();
        let err = |bytes: &[u8]| DeviceKey::decode(bytes).unwrap_err();
        // Wrong lengths, including a VMM key padded to the legacy length and the reverse.
        assert!(err(&b[..VMM_KEY_LEN - 1]).message().contains("expected 88"));
        let mut long = b.clone();
        long.resize(LEGACY_KEY_LEN, 0);
        assert!(err(&long).message().contains("expected 88"));
        let mut legacy_as_vmm = DeviceKey { pid: 1, base: 0, size: 8, kind: KeyKind::Legacy([1; HANDLE_LEN]), life: None }.encode();
        legacy_as_vmm[0] = KIND_VMM_FD;
        assert!(err(&legacy_as_vmm).message().contains("expected 88"));
        let mut vmm_as_legacy = b.clone();
        vmm_as_legacy[0] = KIND_LEGACY_IPC;
        assert!(err(&vmm_as_legacy).message().contains("expected 120"));
        // Empty mapping, export id 0, all-zero token, offset + size past u64.
        let patch = |at: usize, bytes: &[u8]| {
            let mut v = b.clone();
            v[at..at + bytes.len()].copy_from_slice(bytes);
            v
        };
        assert!(err(&patch(16, &0u64.to_le_bytes())).message().contains("empty"));
        assert!(err(&patch(HEADER_LEN, &0u64.to_le_bytes())).message().contains("export id"));
        assert!(err(&patch(HEADER_LEN + 16, &[0; TOKEN_LEN])).message().contains("token"));
        assert!(err(&patch(HEADER_LEN + 8, &u64::MAX.to_le_bytes())).message().contains("physical"));
        assert!(err(&patch(8, &u64::MAX.to_le_bytes())).message().contains("address space"));
        assert!(err(&patch(1, &[0, 7, 0])).message().contains("reserved"));
        for e in [err(&b[..10]), err(&patch(16, &0u64.to_le_bytes()))] {
            assert_eq!(e.status(), Status::ConnectionReset);
        }
    }

    #[test]
    fn vmm_key_of_a_vanished_exporter_fails_cleanly() {
        // A key naming an exporter that does not exist: mapping fails with an error (the
        // receiver then asks for a push), before any CUDA call and without waiting.
        let k = vmm_key();
        let t0 = std::time::Instant::now();
        let e = map_peer(&k, k.base + 100, 100, 0).unwrap_err();
        assert!(t0.elapsed() < std::time::Duration::from_secs(4), "{:?}", t0.elapsed());
        assert_eq!(e.status(), Status::PeerFailed, "{e}");
        // Out-of-range reads are refused before anything else.
        assert!(map_peer(&k, k.base + k.size - 1, 2, 0).unwrap_err().message().contains("outside"));
    }

    #[test]
    fn ranges_outside_the_allocation_are_refused() {
        let k = DeviceKey { pid: 1, base: 1000, size: 100, kind: KeyKind::SameProcess, life: None };
        assert_eq!(k.offset_of(1000, 100).unwrap(), 0);
        assert_eq!(k.offset_of(1050, 50).unwrap(), 50);
        assert!(k.offset_of(999, 1).is_err());
        assert!(k.offset_of(1050, 51).is_err());
        assert!(k.offset_of(u64::MAX, 2).is_err());
    }
}
