//! Whether the GPU allocations this process exported to its peers still exist, told to the
//! processes that mapped them, so that a mapping is let go of once its allocation is freed.
//!
//! Why: a peer's mapping keeps the memory of an allocation after its owner frees it. On the
//! h100-x1 (`docs/probes/ipc_free_held.py`, 2026-11-23), 46.9 GiB that the owner freed stayed in
//! use while another process had them mapped, through legacy IPC and VMM alike, and the owner's
//! next allocation of that size failed with CUDA_ERROR_OUT_OF_MEMORY; they came back the moment
//! the importer closed or unmapped its mapping. gscomm maps the peers' buffers the first time a
//! call needs them (the zero-copy paths), so without this a program that frees memory a peer
//! had read (PyTorch's `empty_cache`, an `ncclMemFree`) got it back only when that peer exited
//! or the owner mapped new memory at the same address (`ipc::map_peer`).
//!
//! Owner side: a table in shared memory (a memfd, served by this process's fd exporter,
//! `vmm::server`), one 64-bit slot per exported allocation, holding `serial << 1 | 1` while the
//! allocation lives. Every key of an allocation carries where the table is and its slot and
//! serial (`Life`). An allocation is known to be gone when gscomm's allocator frees it (`gone`)
//! or when a sweep finds evidence at its address (`sweep`): the driver names another buffer id
//! there, or says no allocation is there, or (VMM) another physical allocation is mapped there.
//! Only such evidence counts: a query that fails otherwise keeps the entry, because a mapping
//! let go of while a peer still reads through it would fault. A freed slot is reused with a new
//! serial.
//!
//! Importer side: `PeerTable` maps an owner's table read-only (fetched once per owner) and
//! answers `alive` with one load. `ipc` looks at its mappings' slots
//! (`ipc::let_go_of_freed_mappings`).
//!
//! Both run on a thread of their own (`ensure_janitor`), every `JANITOR_PERIOD`, started with the
//! first tracked export or mapping, which also unmaps VMM mappings `ipc::GRACE` (2 s) after they
//! were let go of: so memory comes back within about 2.2 s of its free whether or not the
//! program keeps communicating (a program replaying CUDA graphs makes no call that would look),
//! and no call pays for the looking. The driver calls it makes (pointer and handle
//! queries, `cuMemUnmap`) do not wait for the device (`docs/probes/vmm_block.py`).
//!
//! Why letting go is safe once the owner freed: a peer frees a buffer only after its own
//! operations on it completed, and those complete only after our reads of it (the collective
//! kernels' closing meeting; a send's completion after the receiver's read).

use super::copy::primary_context;
use super::{CtxScope, cu};
use crate::error::{Error, Result, Status};
use crate::transport::fd_pass::{self, SocketName, TOKEN_LEN};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Slots in an owner's table (8 bytes each: a 32 KiB table). Exports past it are untracked:
/// their peers keep their mappings, as before this module.
const SLOTS: usize = 4096;

/// How often the janitor looks: an owner's free reaches its peers within about two periods.
const JANITOR_PERIOD: Duration = Duration::from_millis(100);

/// How long an importer waits for an owner's table (its exporter thread answers at once unless
/// its process is stuck or gone).
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);

/// Bytes of a `Life` in a key: the owner's exporter token, the table's export id, slot, serial.
pub(crate) const LIFE_LEN: usize = TOKEN_LEN + 8 + 4 + 4;

/// Where the liveness of one exported allocation is published.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Life {
    /// The owner's fd exporter (its name is made of the key's pid and this).
    pub token: [u8; TOKEN_LEN],
    /// The export id under which that exporter serves the table.
    pub table_id: u64,
    pub slot: u32,
    /// Never 0.
    pub serial: u32,
}

impl Life {
    /// `LIFE_LEN` bytes; all zero for none.
    pub(crate) fn encode(life: Option<&Life>, out: &mut Vec<u8>) {
        match life {
            None => out.extend_from_slice(&[0; LIFE_LEN]),
            Some(l) => {
                out.extend_from_slice(&l.token);
                out.extend_from_slice(&l.table_id.to_le_bytes());
                out.extend_from_slice(&l.slot.to_le_bytes());
                out.extend_from_slice(&l.serial.to_le_bytes());
            }
        }
    }

    /// The inverse of `encode` (`b` is `LIFE_LEN` bytes); `what` names the problem.
    pub(crate) fn decode(b: &[u8]) -> std::result::Result<Option<Life>, &'static str> {
        debug_assert_eq!(b.len(), LIFE_LEN);
        let token: [u8; TOKEN_LEN] = b[..TOKEN_LEN].try_into().expect("token bytes");
        let table_id = u64::from_le_bytes(b[TOKEN_LEN..TOKEN_LEN + 8].try_into().expect("8 bytes"));
        let slot = u32::from_le_bytes(b[TOKEN_LEN + 8..TOKEN_LEN + 12].try_into().expect("4 bytes"));
        let serial = u32::from_le_bytes(b[TOKEN_LEN + 12..].try_into().expect("4 bytes"));
        if table_id == 0 {
            return if b.iter().all(|&x| x == 0) { Ok(None) } else { Err("a liveness entry without a table but with other fields") };
        }
        if serial == 0 || slot as usize >= SLOTS || token == [0; TOKEN_LEN] {
            return Err("a liveness entry with serial 0, a slot past the table or an empty exporter token");
        }
        Ok(Some(Life { token, table_id, slot, serial }))
    }
}

fn slot_word(serial: u32) -> u64 {
    (serial as u64) << 1 | 1
}

/// A table of `SLOTS` words in shared memory, mapped into this process.
struct Table {
    words: NonNull<AtomicU64>,
}

// SAFETY: the words are atomics in a mapping that lives as long as the `Table`.
unsafe impl Send for Table {}
// SAFETY: as above; every access is an atomic load or store.
unsafe impl Sync for Table {}

const TABLE_BYTES: usize = SLOTS * 8;

impl Table {
    /// A new table of zeros and the descriptor that shares it. The file is sealed once mapped
    /// here: a peer can map it read-only only, and can neither shrink it (which would fault our
    /// writes) nor grow it.
    fn create() -> Result<(Table, OwnedFd)> {
        // SAFETY: a NUL-terminated name; flags the kernel knows.
        let raw = unsafe { libc::memfd_create(c"gsc-export-life".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if raw < 0 {
            return Err(Error::io("memfd_create (export liveness table)", std::io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor of ours.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: our descriptor; a size that fits off_t.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), TABLE_BYTES as libc::off_t) } != 0 {
            return Err(Error::io("ftruncate (export liveness table)", std::io::Error::last_os_error()));
        }
        let table = Table::map(&fd, libc::PROT_READ | libc::PROT_WRITE)?;
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL;
        let seal = |bits: libc::c_int| {
            // SAFETY: our descriptor; F_ADD_SEALS takes an int of seal bits.
            unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, bits) == 0 }
        };
        // Kernels before 5.1 lack F_SEAL_FUTURE_WRITE: then at least no resizing. Same-uid
        // peers are trusted anyway (transport::fd_pass), so the table works either way.
        if !seal(seals) && !seal(libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL) {
            tracing::debug!(target: "gsc::cuda", error = %std::io::Error::last_os_error(), "the export liveness table could not be sealed");
        }
        Ok((table, fd))
    }

    /// Map the table behind `fd` (`prot`: read-only for a peer's).
    fn map(fd: &OwnedFd, prot: libc::c_int) -> Result<Table> {
        // SAFETY: a zeroed stat is a valid out-value; our descriptor.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(Error::io("fstat (export liveness table)", std::io::Error::last_os_error()));
        }
        if st.st_size as usize != TABLE_BYTES {
            return Err(Error::new(
                Status::ConnectionReset,
                format!("an export liveness table of {} bytes (expected {TABLE_BYTES})", st.st_size),
            ));
        }
        // SAFETY: a shared mapping of the whole file, which has exactly TABLE_BYTES bytes.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), TABLE_BYTES, prot, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            return Err(Error::io("mmap (export liveness table)", std::io::Error::last_os_error()));
        }
        Ok(Table { words: NonNull::new(p as *mut AtomicU64).expect("mmap returned null") })
    }

    fn word(&self, slot: u32) -> &AtomicU64 {
        assert!((slot as usize) < SLOTS);
        // SAFETY: in bounds of the mapping (asserted), page-aligned so every word is aligned;
        // AtomicU64 has u64's layout and the mapping lives as long as `self`.
        unsafe { &*self.words.as_ptr().add(slot as usize) }
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        // SAFETY: the mapping `map` made, of TABLE_BYTES; nothing borrows it past `self`.
        unsafe { libc::munmap(self.words.as_ptr() as *mut libc::c_void, TABLE_BYTES) };
    }
}

// ---------------------------------------------------------------------------------------------
// Owner side.

/// One exported allocation being watched.
#[derive(Clone)]
struct Tracked {
    slot: u32,
    serial: u32,
    /// An address in it (where it was exported from) and its GPU.
    addr: u64,
    device: i32,
    /// The VMM allocation handle mapped at `addr` when exported (VMM: a range can be remapped
    /// under the same buffer id, so the handle tells allocations apart too).
    vmm_handle: Option<u64>,
}

struct Owner {
    pid: u32,
    table: Table,
    token: [u8; TOKEN_LEN],
    table_id: u64,
    /// Buffer id (and, for VMM, handle) -> its entry.
    tracked: HashMap<(u64, Option<u64>), Tracked>,
    free_slots: Vec<u32>,
    next_slot: u32,
    next_serial: u32,
}

enum OwnerState {
    Unstarted,
    Running(Owner),
    /// The table could not be made (logged once): exports go untracked.
    Failed,
}

static OWNER: Mutex<OwnerState> = Mutex::new(OwnerState::Unstarted);
/// The process whose table `OWNER` holds (0: none yet), read before taking the lock: a child
/// forked while another thread held it must not wait for a lock nobody will release.
static OWNER_PID: AtomicU32 = AtomicU32::new(0);

/// Whether this process may touch `OWNER` (a forked child of its owner may not).
fn owner_is_us() -> bool {
    let pid = OWNER_PID.load(Ordering::Acquire);
    pid == 0 || pid == std::process::id()
}

fn start_owner() -> Result<Owner> {
    let srv = super::vmm::server()?;
    let (table, fd) = Table::create()?;
    let table_id = srv.publish(fd);
    let name = srv.name();
    Ok(Owner {
        pid: std::process::id(),
        table,
        token: name.token,
        table_id,
        tracked: HashMap::new(),
        free_slots: Vec::new(),
        next_slot: 0,
        next_serial: 1,
    })
}

fn with_owner<T>(f: impl FnOnce(&mut Owner) -> Option<T>) -> Option<T> {
    if !owner_is_us() {
        return None;
    }
    let mut state = OWNER.lock().unwrap_or_else(|e| e.into_inner());
    if matches!(*state, OwnerState::Unstarted) {
        *state = match start_owner() {
            Ok(o) => {
                OWNER_PID.store(o.pid, Ordering::Release);
                OwnerState::Running(o)
            }
            Err(e) => {
                tracing::warn!(target: "gsc::cuda", error = %e, "no export liveness table: peers keep their mappings of memory this process frees until it maps new memory there or they exit");
                OwnerState::Failed
            }
        };
    }
    match &mut *state {
        // A forked child shares the parent's table: it must not write into it.
        OwnerState::Running(o) if o.pid == std::process::id() => f(o),
        _ => None,
    }
}

/// The liveness entry of the exported allocation with driver buffer id `buffer_id` (and VMM
/// handle `vmm_handle`), at `addr` on `device`: made at its first export, the same afterwards.
/// `None` when untracked (no table, or the table is full).
pub(crate) fn track(addr: u64, buffer_id: u64, device: i32, vmm_handle: Option<u64>) -> Option<Life> {
    with_owner(|o| {
        let key = (buffer_id, vmm_handle);
        if let Some(t) = o.tracked.get(&key) {
            return Some(Life { token: o.token, table_id: o.table_id, slot: t.slot, serial: t.serial });
        }
        let slot = match o.free_slots.pop() {
            Some(s) => s,
            None if (o.next_slot as usize) < SLOTS => {
                o.next_slot += 1;
                o.next_slot - 1
            }
            None => return None,
        };
        let serial = o.next_serial;
        o.next_serial = o.next_serial.checked_add(1).unwrap_or(1);
        o.table.word(slot).store(slot_word(serial), Ordering::Release);
        o.tracked.insert(key, Tracked { slot, serial, addr, device, vmm_handle });
        ensure_janitor();
        Some(Life { token: o.token, table_id: o.table_id, slot, serial })
    })
}

fn retire(o: &mut Owner, key: (u64, Option<u64>)) {
    if let Some(t) = o.tracked.remove(&key) {
        o.table.word(t.slot).store(0, Ordering::Release);
        o.free_slots.push(t.slot);
    }
}

/// The allocation with buffer id `buffer_id` is being freed by gscomm's allocator: tell its
/// peers now.
pub(crate) fn gone(buffer_id: u64) {
    if !owner_is_us() {
        return;
    }
    let mut state = OWNER.lock().unwrap_or_else(|e| e.into_inner());
    if let OwnerState::Running(o) = &mut *state {
        if o.pid != std::process::id() {
            return;
        }
        let keys: Vec<_> = o.tracked.keys().filter(|(id, _)| *id == buffer_id).copied().collect();
        for k in keys {
            retire(o, k);
        }
    }
}

/// Look at every watched allocation and tell the peers of those that are evidently gone: a
/// pointer query each (plus a handle query for VMM; four pointer attributes in one query cost
/// ~0.1–0.16 µs on the H200s, `memory::device_ptr`). The queries run without the lock, so an
/// export never waits for a sweep; an entry retired or replaced meanwhile is left alone.
fn sweep() {
    if !owner_is_us() {
        return;
    }
    let watched: Vec<((u64, Option<u64>), Tracked)> = {
        let state = OWNER.lock().unwrap_or_else(|e| e.into_inner());
        match &*state {
            OwnerState::Running(o) if o.pid == std::process::id() => o.tracked.iter().map(|(k, t)| (*k, t.clone())).collect(),
            _ => return,
        }
    };
    // The queries need a context: one entered per GPU met (usually one).
    let mut scope: Option<(i32, CtxScope)> = None;
    let mut gone_now = Vec::new();
    for (key, t) in watched {
        if scope.as_ref().is_none_or(|(d, _)| *d != t.device) {
            scope = None;
            let Ok(s) = primary_context(t.device).and_then(CtxScope::enter) else { continue };
            scope = Some((t.device, s));
        }
        if evidently_gone(&t, key.0) {
            tracing::debug!(target: "gsc::cuda", addr = format_args!("{:#x}", t.addr), "an exported allocation was freed; its peers are told");
            gone_now.push((key, t.serial));
        }
    }
    drop(scope);
    let mut retired = Vec::new();
    let mut state = OWNER.lock().unwrap_or_else(|e| e.into_inner());
    if let OwnerState::Running(o) = &mut *state {
        for (key, serial) in gone_now {
            if o.tracked.get(&key).is_some_and(|t| t.serial == serial) {
                retire(o, key);
                retired.push(key);
            }
        }
    }
    drop(state);
    // Our own descriptor of a freed VMM allocation pins its memory as a peer's mapping does: close
    // it now, so no peer can be handed the old export either.
    for (buffer_id, handle) in retired {
        if let Some(h) = handle {
            super::vmm::withdraw_export(buffer_id, Some(h));
        }
    }
}

/// Start the janitor thread (once per process; a forked child starts its own).
fn ensure_janitor() {
    static STARTED: Mutex<Option<u32>> = Mutex::new(None);
    let mut started = STARTED.lock().unwrap_or_else(|e| e.into_inner());
    let pid = std::process::id();
    if *started == Some(pid) {
        return;
    }
    let spawned = std::thread::Builder::new().name("gsc-peer-memory".into()).spawn(|| {
        loop {
            std::thread::sleep(JANITOR_PERIOD);
            // Its driver calls (handle retains and releases, unmaps) must not break another
            // thread's capture in the global mode: relaxed for this thread. A panic is logged
            // and the next period tried; nothing else runs on this thread.
            let tick = std::panic::catch_unwind(|| {
                if super::init().is_ok() {
                    let _ = super::with_relaxed_capture(|| {
                        sweep();
                        super::ipc::let_go_of_freed_mappings();
                        Ok(())
                    });
                }
            });
            if tick.is_err() {
                tracing::error!(target: "gsc::cuda", "the peer-memory janitor panicked; trying again next period");
            }
        }
    });
    match spawned {
        Ok(_) => *started = Some(pid),
        Err(e) => {
            tracing::warn!(target: "gsc::cuda", error = %e, "no thread to watch for freed GPU memory: peers let go of it only when it is replaced")
        }
    }
}

/// A peer's allocation with a liveness entry was mapped here: the janitor will watch it.
pub(crate) fn watch_mappings() {
    ensure_janitor();
}

/// Whether the driver shows that the allocation `t` (buffer id `buffer_id`) no longer exists
/// (a context of its GPU is current).
fn evidently_gone(t: &Tracked, buffer_id: u64) -> bool {
    use cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID as BUFFER_ID;
    let mut id: u64 = 0;
    // SAFETY: an 8-byte out-value for BUFFER_ID; the driver only looks the address up.
    let r = unsafe { cu::cuPointerGetAttribute(&mut id as *mut u64 as *mut std::ffi::c_void, BUFFER_ID, t.addr as cu::CUdeviceptr) };
    match r {
        cu::CUresult::CUDA_ERROR_INVALID_VALUE => true,
        cu::CUresult::CUDA_SUCCESS if id != buffer_id => true,
        cu::CUresult::CUDA_SUCCESS => match t.vmm_handle {
            Some(h) => super::vmm::handle_value(t.addr).is_some_and(|now| now != h),
            None => false,
        },
        _ => false,
    }
}

// ---------------------------------------------------------------------------------------------
// Importer side.

/// An owner's table, mapped read-only here.
pub(crate) struct PeerTable(Table);

impl PeerTable {
    /// Whether the allocation `life` describes still exists, as far as its owner has found.
    pub(crate) fn alive(&self, life: &Life) -> bool {
        self.0.word(life.slot).load(Ordering::Acquire) == slot_word(life.serial)
    }
}

/// The table of the owner (process `pid`) that `life` names: fetched and mapped the first time.
/// A failure is remembered too (that owner's allocations are then untracked here), so an owner
/// whose exporter cannot be reached (another network namespace; a stuck process) costs one try,
/// not one per allocation.
pub(crate) fn peer_table(pid: u32, life: &Life) -> Option<Arc<PeerTable>> {
    type Tables = HashMap<(u32, [u8; TOKEN_LEN], u64), Option<Arc<PeerTable>>>;
    static TABLES: Mutex<Option<Tables>> = Mutex::new(None);
    let key = (pid, life.token, life.table_id);
    if let Some(t) = TABLES.lock().unwrap_or_else(|e| e.into_inner()).as_ref().and_then(|m| m.get(&key)) {
        return t.clone();
    }
    let fetched = fd_pass::fetch_fd(&SocketName { pid, token: life.token }, life.table_id, FETCH_TIMEOUT)
        .and_then(|fd| Table::map(&fd, libc::PROT_READ))
        .map(|t| Arc::new(PeerTable(t)));
    if let Err(e) = &fetched {
        tracing::debug!(target: "gsc::cuda", pid, error = %e, "no liveness table from this peer: mappings of its memory are kept until replaced");
    }
    let mut tables = TABLES.lock().unwrap_or_else(|e| e.into_inner());
    tables.get_or_insert_with(HashMap::new).entry(key).or_insert(fetched.ok()).clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner_with_table() -> (Owner, OwnedFd) {
        let (table, fd) = Table::create().unwrap();
        let o = Owner {
            pid: std::process::id(),
            table,
            token: [9; TOKEN_LEN],
            table_id: 3,
            tracked: HashMap::new(),
            free_slots: Vec::new(),
            next_slot: 0,
            next_serial: 1,
        };
        (o, fd)
    }

    fn add(o: &mut Owner, buffer_id: u64) -> Life {
        let slot = o.free_slots.pop().unwrap_or_else(|| {
            o.next_slot += 1;
            o.next_slot - 1
        });
        let serial = o.next_serial;
        o.next_serial += 1;
        o.table.word(slot).store(slot_word(serial), Ordering::Release);
        o.tracked.insert((buffer_id, None), Tracked { slot, serial, addr: 0, device: 0, vmm_handle: None });
        Life { token: o.token, table_id: o.table_id, slot, serial }
    }

    #[test]
    fn a_peer_sees_an_allocation_die_and_its_slot_reused_under_a_new_serial() {
        let (mut o, fd) = owner_with_table();
        // The peer's view: the same memory, mapped read-only from the shared descriptor.
        let peer = PeerTable(Table::map(&fd, libc::PROT_READ).unwrap());
        let a = add(&mut o, 10);
        let b = add(&mut o, 11);
        assert!(peer.alive(&a) && peer.alive(&b));
        retire(&mut o, (10, None));
        assert!(!peer.alive(&a), "a retired allocation still looks alive");
        assert!(peer.alive(&b), "retiring one allocation touched another");
        // Its slot goes to the next export, with a serial the old key does not have.
        let c = add(&mut o, 12);
        assert_eq!(c.slot, a.slot);
        assert!(peer.alive(&c) && !peer.alive(&a));
        retire(&mut o, (99, None)); // unknown: nothing changes
        assert!(peer.alive(&b) && peer.alive(&c));
    }

    #[test]
    fn life_entries_round_trip_and_bad_ones_are_named() {
        let l = Life { token: [7; TOKEN_LEN], table_id: 5, slot: 17, serial: 3 };
        let mut v = Vec::new();
        Life::encode(Some(&l), &mut v);
        assert_eq!(v.len(), LIFE_LEN);
        assert_eq!(Life::decode(&v), Ok(Some(l)));
        let mut none = Vec::new();
        Life::encode(None, &mut none);
        assert_eq!(Life::decode(&none), Ok(None));
        let patch = |at: usize, bytes: &[u8]| {
            let mut b = v.clone();
            b[at..at + bytes.len()].copy_from_slice(bytes);
            b
        };
        assert!(Life::decode(&patch(TOKEN_LEN + 12, &0u32.to_le_bytes())).is_err(), "serial 0");
        assert!(Life::decode(&patch(TOKEN_LEN + 8, &(SLOTS as u32).to_le_bytes())).is_err(), "slot past the table");
        assert!(Life::decode(&patch(0, &[0; TOKEN_LEN])).is_err(), "no token");
        let mut half = none.clone();
        half[TOKEN_LEN + 12] = 1;
        assert!(Life::decode(&half).is_err(), "no table but a serial");
    }

    #[test]
    fn an_importer_fetches_the_table_through_the_exporter_and_sees_a_free() {
        // This process as both owner and importer: the table goes through the fd exporter's
        // socket as it would to another process. No GPU: tracking and `gone` make no driver call,
        // and the janitor's sweep skips entries of a device that does not exist (-1).
        let (id_a, id_b) = (u64::MAX - 0x1000, u64::MAX - 0x1001);
        let a = track(0x7000_0000, id_a, -1, None).expect("tracked");
        let b = track(0x7100_0000, id_b, -1, Some(5)).expect("tracked");
        assert_eq!(track(0x7000_0000, id_a, -1, None), Some(a), "a second export of one allocation has the same entry");
        assert_ne!(track(0x7100_0000, id_b, -1, Some(6)), Some(b), "another VMM handle under the same buffer id is another allocation");
        let table = peer_table(std::process::id(), &a).expect("the table through the socket");
        assert!(table.alive(&a) && table.alive(&b));
        gone(id_a);
        assert!(!table.alive(&a), "a free was not seen");
        assert!(table.alive(&b));
        gone(id_b);
        assert!(!table.alive(&b));
        // An owner that cannot be reached: no table, at once, and remembered.
        let nowhere = Life { token: [0xEE; TOKEN_LEN], ..a };
        let t0 = std::time::Instant::now();
        assert!(peer_table(1, &nowhere).is_none() && peer_table(1, &nowhere).is_none());
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    }

    #[test]
    fn a_peer_can_neither_write_nor_shrink_the_table() {
        let (_table, fd) = Table::create().unwrap();
        // SAFETY: our descriptor.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_FUTURE_WRITE == 0 {
            println!("skipped: this kernel cannot seal a memfd against future writes (Linux 5.1+)");
            return;
        }
        assert!(Table::map(&fd, libc::PROT_READ | libc::PROT_WRITE).is_err(), "a writable mapping of a sealed table");
        // SAFETY: our descriptor.
        assert_ne!(unsafe { libc::ftruncate(fd.as_raw_fd(), 8) }, 0, "a sealed table was shrunk");
        assert!(Table::map(&fd, libc::PROT_READ).is_ok());
    }

    #[test]
    fn a_table_of_the_wrong_size_is_refused() {
        // SAFETY: a NUL-terminated name.
        let raw = unsafe { libc::memfd_create(c"t".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: a fresh descriptor of ours.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: our descriptor.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 64) }, 0);
        let e = Table::map(&fd, libc::PROT_READ).err().expect("a 64-byte table was accepted");
        assert!(e.to_string().contains("expected"), "{e}");
    }
}
