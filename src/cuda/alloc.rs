//! gscomm's device memory allocator: what `mem_alloc` (`cuda::api::mem_alloc`, `gscomm::mem_alloc`)
//! and the NCCL library's `ncclMemAlloc` return.
//!
//! Like NCCL's cuMem allocator, an allocation is CUDA VMM memory: `cuMemCreate` of pinned memory
//! on the calling thread's current device with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`
//! requested (so `vmm::export` can hand it to another process as a descriptor), the size rounded
//! up to the recommended granularity, a range reserved at that alignment (`cuMemAddressReserve`),
//! mapped (`cuMemMap`), and read/write access granted (`cuMemSetAccess`) to the owning device and
//! to every GPU of this process that can reach it (`cuDeviceCanAccessPeer`). The last point
//! matters because VMM memory ignores `cuCtxEnablePeerAccess`: two ranks of one process (the
//! NCCL library's `ncclCommInitAll`, or several GPUs driven by one thread) read each other's
//! buffers by address, which works only with access granted here. Where the device supports
//! GPUDirect RDMA on VMM memory the allocation asks for it, as NCCL does, so a NIC can register it.
//!
//! Why VMM (the seed's registration rules): one large allocation per rank is carved into send and
//! receive buffers at the same offsets on every rank, and a peer maps the whole allocation once
//! (`ipc::export` recognises it as VMM: the legacy handle fails, `vmm::export` describes the
//! mapping, every buffer carved from it shares that one export and is found by its offset).
//! Zero-copy collective paths over such buffers are not built yet (docs/ARCHITECTURE.md).
//!
//! Where the device cannot do VMM or POSIX-descriptor handles
//! (`CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`,
//! `..._HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`), the allocation is a plain `cuMemAlloc`
//! (shared through legacy CUDA IPC), and the reason is logged once per device. A VMM failure on a
//! device that supports it (out of memory, say) is returned, never papered over.
//!
//! Every allocation is recorded (`Book`), so `free` refuses — with an error naming why, changing
//! nothing — an address it did not return: memory from elsewhere, an address inside one of its
//! allocations, or one it already freed (a double free; the last `FREED_MEMORY` freed addresses
//! are remembered to say so).

use super::{CtxScope, check, copy::primary_context, cu, vmm};
use crate::error::{Error, Result, Status};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;

/// How many freed base addresses are remembered, to call a second free of one a double free.
const FREED_MEMORY: usize = 1024;

/// What backs an allocation.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Choice {
    Vmm,
    /// `cuMemAlloc`, and why not VMM.
    Plain(&'static str),
}

/// The backing a device with these capabilities gets.
pub(crate) fn choose(vmm_supported: bool, posix_fd_supported: bool) -> Choice {
    match (vmm_supported, posix_fd_supported) {
        (true, true) => Choice::Vmm,
        (false, _) => Choice::Plain("the device does not support CUDA virtual memory management (VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0)"),
        (true, false) => {
            Choice::Plain("the device cannot export VMM memory as POSIX file descriptors (HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 0)")
        }
    }
}

/// `bytes` rounded up to a multiple of `granularity`; a request of 0 bytes gets one granule (so
/// every allocation has an address of its own, as `cuMemAlloc` of 1 byte did before).
pub(crate) fn round_up(bytes: usize, granularity: usize) -> Result<usize> {
    if granularity == 0 {
        return Err(Error::new(Status::Internal, "the driver reported an allocation granularity of 0"));
    }
    bytes
        .max(1)
        .checked_next_multiple_of(granularity)
        .ok_or_else(|| Error::invalid_param(format!("{bytes} bytes cannot be rounded up to the allocation granularity ({granularity})")))
}

/// The devices to grant access to an allocation on `owner`: the owner first, then each of the
/// `count` devices that `can_access(device, owner)` says can reach it.
pub(crate) fn access_list(owner: i32, count: i32, mut can_access: impl FnMut(i32, i32) -> bool) -> Vec<i32> {
    std::iter::once(owner).chain((0..count).filter(|&d| d != owner && can_access(d, owner))).collect()
}

/// Live allocations by base address, and recently freed bases.
pub(crate) struct Book<T> {
    /// base -> (bytes the range spans, what undoes it)
    live: BTreeMap<u64, (usize, T)>,
    freed: VecDeque<u64>,
}

impl<T> Book<T> {
    pub(crate) const fn new() -> Self {
        Book { live: BTreeMap::new(), freed: VecDeque::new() }
    }

    /// Record `[base, base + span)`. Returns records it overlaps, which can only be stale (their
    /// memory was freed behind the allocator's back, e.g. `cudaFree` of an `ncclMemAlloc`
    /// pointer, and the driver handed the range out again): the caller must forget them, never
    /// undo them, since undoing would free the new allocation.
    pub(crate) fn insert(&mut self, base: u64, span: usize, value: T) -> Vec<(u64, usize, T)> {
        let end = base.saturating_add(span as u64);
        let overlapping: Vec<u64> =
            self.live.range(..end).rev().take_while(|(b, (s, _))| b.saturating_add(*s as u64) > base).map(|(b, _)| *b).collect();
        let stale = overlapping.into_iter().filter_map(|b| self.live.remove(&b).map(|(s, v)| (b, s, v))).collect();
        self.freed.retain(|&f| f < base || f >= end);
        self.live.insert(base, (span, value));
        stale
    }

    /// The live allocation holding `addr`: (base, span, value).
    pub(crate) fn find(&self, addr: u64) -> Option<(u64, usize, &T)> {
        let (&base, (span, v)) = self.live.range(..=addr).next_back()?;
        (addr - base < *span as u64).then_some((base, *span, v))
    }

    /// Take the allocation based at `addr` off the book, or say why `addr` is not one (the book
    /// is then unchanged).
    pub(crate) fn take(&mut self, addr: u64) -> Result<T> {
        if let Some((_, v)) = self.live.remove(&addr) {
            if self.freed.len() == FREED_MEMORY {
                self.freed.pop_front();
            }
            self.freed.push_back(addr);
            return Ok(v);
        }
        let why = if let Some((base, _, _)) = self.find(addr) {
            format!("{addr:#x} lies {} bytes into the allocation at {base:#x}; free the address mem_alloc returned", addr - base)
        } else if self.freed.contains(&addr) {
            format!("{addr:#x} was already freed (a double free)")
        } else {
            format!("{addr:#x} was not allocated by mem_alloc/ncclMemAlloc in this process")
        };
        Err(Error::invalid_param(format!("{why}; nothing was freed")))
    }

    pub(crate) fn len(&self) -> usize {
        self.live.len()
    }
}

/// One allocation of ours.
struct Record {
    /// Bytes asked for.
    requested: usize,
    device: i32,
    /// The driver's buffer id (its VMM export, if any, is withdrawn on free).
    buffer_id: u64,
    backing: Backing,
}

enum Backing {
    Vmm(vmm::Owned),
    Plain,
}

fn book() -> std::sync::MutexGuard<'static, Book<Record>> {
    static BOOK: Mutex<Book<Record>> = Mutex::new(Book::new());
    // The book is changed by single insert/remove calls: a panic elsewhere cannot leave it
    // half-changed, so a poisoned lock is still good.
    BOOK.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a device supports, asked once per device.
#[derive(Copy, Clone, Debug)]
struct Support {
    choice: Choice,
    /// GPUDirect RDMA on VMM memory.
    gdr: bool,
}

fn attribute(device: i32, which: cu::CUdevice_attribute) -> Result<bool> {
    let mut v = 0;
    // SAFETY: a valid out-pointer; `device` is an ordinal the driver gave us (current device).
    check(unsafe { cu::cuDeviceGetAttribute(&mut v, which, device) }, "cuDeviceGetAttribute")?;
    Ok(v != 0)
}

fn support(device: i32) -> Result<Support> {
    static SEEN: Mutex<Option<HashMap<i32, Support>>> = Mutex::new(None);
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    let map = seen.get_or_insert_with(HashMap::new);
    if let Some(s) = map.get(&device) {
        return Ok(*s);
    }
    use cu::CUdevice_attribute::{
        CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED as GDR,
        CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED as POSIX_FD,
        CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED as VMM,
    };
    let choice = choose(attribute(device, VMM)?, attribute(device, POSIX_FD)?);
    let s = Support { choice, gdr: choice == Choice::Vmm && attribute(device, GDR)? };
    if let Choice::Plain(why) = choice {
        tracing::warn!(target: "gsc::cuda", device, "mem_alloc falls back to cuMemAlloc on this device: {why}");
    }
    map.insert(device, s);
    Ok(s)
}

/// The devices of this process that can access memory of `owner`, and `owner`.
fn access_for(owner: i32) -> Result<Vec<i32>> {
    let mut n = 0;
    // SAFETY: a valid out-pointer.
    check(unsafe { cu::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
    let mut failure = None;
    let list = access_list(owner, n, |d, o| {
        let mut yes = 0;
        // SAFETY: a valid out-pointer; both are ordinals below the device count.
        let r = check(unsafe { cu::cuDeviceCanAccessPeer(&mut yes, d, o) }, "cuDeviceCanAccessPeer");
        if let Err(e) = r {
            failure.get_or_insert(e);
        }
        yes != 0
    });
    failure.map_or(Ok(list), Err)
}

/// At least `bytes` of device memory on the calling thread's current device (device 0's primary
/// context is made current when there is none, as the CUDA runtime does). See the module doc.
pub(crate) fn alloc(bytes: usize) -> Result<u64> {
    let device = super::api::current_device()?;
    let support = support(device)?;
    let (ptr, backing) = match support.choice {
        Choice::Vmm => {
            let prop = vmm::shareable_prop(device, support.gdr);
            let gran = vmm::granularity(&prop, true)?;
            let len = round_up(bytes, gran)?;
            let owned = vmm::Owned::create(&prop, len, gran, &access_for(device)?, 0)?;
            (owned.ptr, Backing::Vmm(owned))
        }
        Choice::Plain(_) => {
            let mut p: cu::CUdeviceptr = 0;
            // SAFETY: a valid out-pointer; a context is current (`current_device`).
            check(unsafe { cu::cuMemAlloc_v2(&mut p, bytes.max(1)) }, "cuMemAlloc")?;
            (p, Backing::Plain)
        }
    };
    let span = match &backing {
        Backing::Vmm(o) => o.len,
        Backing::Plain => bytes.max(1),
    };
    let buffer_id = super::memory::device_ptr(ptr as usize).ok().flatten().map_or(0, |p| p.buffer_id);
    let record = Record { requested: bytes, device, buffer_id, backing };
    let stale = book().insert(ptr, span, record);
    for (base, span, r) in stale {
        tracing::warn!(
            target: "gsc::cuda",
            base = format_args!("{base:#x}"),
            span,
            "a mem_alloc allocation was freed behind the allocator's back (not with mem_free); its record is dropped"
        );
        // Undoing it would unmap or free the new allocation now at that address.
        if let Backing::Vmm(o) = r.backing {
            std::mem::forget(o);
        }
    }
    tracing::debug!(target: "gsc::cuda", ptr = format_args!("{ptr:#x}"), bytes, span, device, vmm = matches!(support.choice, Choice::Vmm), "mem_alloc");
    Ok(ptr)
}

/// Free an allocation `alloc` returned (`ptr` 0: nothing to do). Anything else — an address it
/// did not return, one inside an allocation, one already freed — is refused with an error and
/// nothing is changed.
///
/// # Safety
/// No work (kernels, copies, a peer's pending read of a send) still uses the memory.
pub(crate) unsafe fn free(ptr: u64) -> Result<()> {
    if ptr == 0 {
        return Ok(());
    }
    let record = book().take(ptr)?;
    match record.backing {
        Backing::Vmm(owned) => {
            // The exporter's descriptor would keep the physical memory alive.
            vmm::withdraw(record.buffer_id);
            let _scope = CtxScope::enter(primary_context(record.device)?)?;
            owned.free().map_err(|e| e.context(format!("freeing the VMM allocation at {ptr:#x}")))
        }
        Backing::Plain => {
            // cuMemFree needs a context; a thread without one (a cleanup thread) gets the
            // owner's primary context.
            let _scope = match super::current_context() {
                Ok(_) => None,
                Err(_) => Some(CtxScope::enter(primary_context(record.device)?)?),
            };
            // SAFETY: allocated by `alloc` with cuMemAlloc, taken off the book (freed once),
            // unused (the caller's promise).
            check(unsafe { cu::cuMemFree_v2(ptr) }, "cuMemFree")
        }
    }
}

/// What `alloc` made, as seen from an address in it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct MemAllocInfo {
    /// The address `mem_alloc` returned.
    pub base: u64,
    /// Where the address asked about lies in the allocation.
    pub offset: u64,
    /// Bytes asked for.
    pub bytes: usize,
    /// Bytes reserved and mapped (a multiple of the granularity for VMM).
    pub mapped: usize,
    pub device: i32,
    /// VMM memory with a POSIX-descriptor handle (else a `cuMemAlloc` fallback).
    pub vmm: bool,
}

/// The allocation `addr` lies in, if `alloc` made it and it is live.
pub(crate) fn info(addr: u64) -> Option<MemAllocInfo> {
    let b = book();
    let (base, span, r) = b.find(addr)?;
    Some(MemAllocInfo {
        base,
        offset: addr - base,
        bytes: r.requested,
        mapped: span,
        device: r.device,
        vmm: matches!(r.backing, Backing::Vmm(_)),
    })
}

/// Live allocations (for tests).
pub(crate) fn live() -> usize {
    book().len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_up_to_the_granularity() {
        const G: usize = 2 << 20;
        assert_eq!(round_up(0, G).unwrap(), G, "0 bytes still get an address of their own");
        assert_eq!(round_up(1, G).unwrap(), G);
        assert_eq!(round_up(G, G).unwrap(), G);
        assert_eq!(round_up(G + 1, G).unwrap(), 2 * G);
        assert_eq!(round_up(5 * G - 7, G).unwrap(), 5 * G);
        assert_eq!(round_up(100, 64 << 10).unwrap(), 64 << 10);
        assert!(round_up(usize::MAX - 5, G).unwrap_err().message().contains("granularity"));
        assert_eq!(round_up(8, 0).unwrap_err().status(), Status::Internal);
    }

    #[test]
    fn vmm_only_with_posix_descriptors_else_a_named_fallback() {
        assert_eq!(choose(true, true), Choice::Vmm);
        let Choice::Plain(why) = choose(false, true) else { panic!() };
        assert!(why.contains("VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"));
        let Choice::Plain(why) = choose(true, false) else { panic!() };
        assert!(why.contains("POSIX_FILE_DESCRIPTOR"));
        assert!(matches!(choose(false, false), Choice::Plain(_)));
    }

    #[test]
    fn access_goes_to_the_owner_and_the_peers_that_can_reach_it() {
        // Devices 0..4; device 3 cannot reach device 1 (no P2P between them).
        let can = |d: i32, o: i32| !(d == 3 && o == 1);
        assert_eq!(access_list(1, 4, can), vec![1, 0, 2]);
        assert_eq!(access_list(0, 4, can), vec![0, 1, 2, 3]);
        assert_eq!(access_list(0, 1, can), vec![0], "one GPU: the owner only");
        assert_eq!(access_list(2, 4, |_, _| false), vec![2]);
    }

    #[test]
    fn the_book_finds_addresses_inside_allocations() {
        let mut b = Book::new();
        assert!(b.insert(0x1000, 0x1000, 'a').is_empty());
        assert!(b.insert(0x4000, 0x2000, 'b').is_empty());
        assert_eq!(b.find(0x1000), Some((0x1000, 0x1000, &'a')));
        assert_eq!(b.find(0x1fff), Some((0x1000, 0x1000, &'a')));
        assert_eq!(b.find(0x2000), None);
        assert_eq!(b.find(0x5800), Some((0x4000, 0x2000, &'b')));
        assert_eq!(b.find(0xfff), None);
        assert_eq!(b.find(0x6000), None);
        assert_eq!(b.len(), 2);
    }

    #[test]
    fn foreign_interior_and_double_frees_are_refused_and_change_nothing() {
        let mut b = Book::new();
        b.insert(0x10_0000, 0x20_0000, 1);
        b.insert(0x40_0000, 0x20_0000, 2);
        let msg = |e: Error| {
            assert_eq!(e.status(), Status::InvalidParam);
            e.message().to_string()
        };
        let m = msg(b.take(0x99_0000).unwrap_err());
        assert!(m.contains("not allocated by mem_alloc") && m.contains("nothing was freed"), "{m}");
        let m = msg(b.take(0x40_0010).unwrap_err());
        assert!(m.contains("lies 16 bytes into the allocation at 0x400000"), "{m}");
        assert_eq!(b.len(), 2, "refusals change nothing");
        assert_eq!(b.take(0x40_0000).unwrap(), 2);
        let m = msg(b.take(0x40_0000).unwrap_err());
        assert!(m.contains("already freed (a double free)"), "{m}");
        assert_eq!(b.len(), 1);
        assert_eq!(b.find(0x10_0000).map(|(_, _, v)| *v), Some(1), "the other allocation is untouched");
        // The driver hands the range out again: it is live, and freeing it works once more.
        assert!(b.insert(0x40_0000, 0x20_0000, 3).is_empty());
        assert_eq!(b.take(0x40_0000).unwrap(), 3);
        assert!(msg(b.take(0x40_0000).unwrap_err()).contains("double free"));
    }

    #[test]
    fn stale_records_overlapping_a_new_allocation_are_handed_back() {
        let mut b = Book::new();
        b.insert(0x1000, 0x1000, 'a');
        b.insert(0x3000, 0x1000, 'b');
        b.insert(0x5000, 0x1000, 'c');
        // A new range starting inside 'b' and running into 'c'.
        let stale = b.insert(0x3800, 0x2000, 'n');
        let mut names: Vec<char> = stale.iter().map(|(_, _, v)| *v).collect();
        names.sort();
        assert_eq!(names, vec!['b', 'c']);
        assert_eq!(b.find(0x1000).map(|(_, _, v)| *v), Some('a'));
        assert_eq!(b.find(0x3800).map(|(_, _, v)| *v), Some('n'));
        assert_eq!(b.len(), 2);
    }

    #[test]
    fn freed_addresses_are_remembered_within_a_bound() {
        let mut b = Book::new();
        for i in 0..(FREED_MEMORY as u64 + 10) {
            b.insert(0x1000 * (i + 1), 0x1000, ());
            b.take(0x1000 * (i + 1)).unwrap();
        }
        assert!(b.take(0x1000).unwrap_err().message().contains("not allocated"), "the oldest is forgotten");
        assert!(b.take(0x1000 * (FREED_MEMORY as u64 + 10)).unwrap_err().message().contains("double free"));
    }

    #[test]
    fn without_a_driver_free_refuses_and_info_knows_nothing() {
        // No allocation was made by this test process's allocator at these addresses.
        // SAFETY: the allocator refuses before any driver call.
        let e = unsafe { free(0x7f00_dead_0000) }.unwrap_err();
        assert!(e.message().contains("not allocated"), "{e}");
        // SAFETY: null is a no-op.
        unsafe { free(0) }.unwrap();
        assert_eq!(info(0x7f00_dead_0000), None);
    }
}
