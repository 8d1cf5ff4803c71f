//! Memory type detection: is an address host memory or CUDA device memory?
//!
//! Asked for every send and receive whose memory type the user did not give, so it must cost
//! nothing in a process that does not use CUDA: the driver is consulted only once libcuda is
//! already loaded into the process (by the application or by us). A process that has not loaded
//! it cannot hold device pointers. The "not loaded" answer is re-checked every 256th call on
//! each thread, so an application that initializes CUDA later is seen.
//!
//! Page-locked host memory (cudaHostAlloc) and managed memory are host memory here: the CPU can
//! read them, so the host protocols move them correctly.

use super::{cu, init};
use crate::error::{Error, Result, Status};
use crate::protocols::MemType;
use std::sync::atomic::{AtomicBool, Ordering};

/// What the driver says about a device-memory address.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct DevicePtr {
    /// Ordinal of the GPU the memory is on.
    pub device: i32,
    /// Unique per allocation for the process's life: keys caches of exported handles, so a
    /// freed and re-made allocation at the same address is never confused with the old one.
    pub buffer_id: u64,
}

/// True once libcuda is loaded in this process.
///
/// Asked on every send and receive, so the "not loaded" answer is cached per thread and the
/// loader's list is walked again only every 256th call: a few nanoseconds per message in a
/// host-only process (`gsc-bench tag-lat`, 8-byte shm ping-pong on the 2-core dev VM,
/// 2026-11-21: a clock-based re-check took it from ~0.83 to ~0.9-1.0 µs; asking `dlopen` with
/// RTLD_NOLOAD every 256th call cost ~0.23 µs a message, 0.81-0.83 → 0.58-0.61 with
/// `libcuda_loaded`). An application that loads CUDA after creating its context and posts a
/// GPU buffer within those calls without declaring `memory_type` would have it taken for host
/// memory; the docs ask for a declaration in that case.
pub(crate) fn process_has_cuda() -> bool {
    thread_local! {
        static CALLS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    }
    if SEEN.load(Ordering::Relaxed) {
        return true;
    }
    let n = CALLS.with(|c| {
        let n = c.get();
        c.set(n.wrapping_add(1));
        n
    });
    if !n.is_multiple_of(256) {
        return false;
    }
    let loaded = libcuda_loaded();
    if loaded {
        SEEN.store(true, Ordering::Relaxed);
    }
    loaded
}

/// Set once libcuda is known to be loaded in this process.
static SEEN: AtomicBool = AtomicBool::new(false);

/// `cuda::init` loaded the driver.
pub(crate) fn note_cuda_loaded() {
    SEEN.store(true, Ordering::Relaxed);
}

/// Whether a libcuda is among the objects loaded into the process. `dl_iterate_phdr` walks the
/// loader's list in memory; `dlopen(RTLD_NOLOAD)` by name, used before, searched the library
/// path with `openat` calls each time (~8% of the samples of an 8-byte shm ping-pong, perf,
/// 2026-11-21).
fn libcuda_loaded() -> bool {
    loaded_object(is_libcuda)
}

/// Whether a loaded object's path satisfies `pred`.
fn loaded_object(pred: fn(&[u8]) -> bool) -> bool {
    struct Walk {
        pred: fn(&[u8]) -> bool,
        found: bool,
    }
    unsafe extern "C" fn visit(info: *mut libc::dl_phdr_info, _size: usize, walk: *mut std::ffi::c_void) -> std::ffi::c_int {
        // SAFETY: `walk` is the `Walk` passed below, alive and not otherwise borrowed for the
        // whole walk; the loader passes a valid entry, whose name is null or a C string.
        let (walk, name) = unsafe { (&mut *(walk as *mut Walk), (*info).dlpi_name) };
        // SAFETY: a non-null name is a NUL-terminated string owned by the loader.
        if !name.is_null() && (walk.pred)(unsafe { std::ffi::CStr::from_ptr(name) }.to_bytes()) {
            walk.found = true;
            return 1; // stop the walk
        }
        0
    }
    let mut walk = Walk { pred, found: false };
    // SAFETY: `visit` matches the callback type and only touches `walk`, which outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(visit), &mut walk as *mut Walk as *mut std::ffi::c_void) };
    walk.found
}

/// A loaded object's path names the CUDA driver library (not libcudart and friends).
fn is_libcuda(path: &[u8]) -> bool {
    let file = path.rsplit(|&b| b == b'/').next().unwrap_or(path);
    file == b"libcuda.so" || file.starts_with(b"libcuda.so.")
}

/// `Some` for CUDA device memory, `None` for anything the CPU can address (pageable, pinned,
/// managed) and for addresses the driver does not know.
///
/// Asked for every send and receive on memory of unknown type, so the four attributes come
/// from one `cuPointerGetAttributes` call (four `cuPointerGetAttribute` calls took ~0.23 µs per
/// operation on the H200 machines, one ~0.1–0.16; temporary counters, 2026-11-21).
pub(crate) fn device_ptr(addr: usize) -> Result<Option<DevicePtr>> {
    use cu::CUpointer_attribute::{
        CU_POINTER_ATTRIBUTE_BUFFER_ID as BUFFER_ID, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL as DEVICE_ORDINAL,
        CU_POINTER_ATTRIBUTE_IS_MANAGED as IS_MANAGED, CU_POINTER_ATTRIBUTE_MEMORY_TYPE as MEMORY_TYPE,
    };
    // A process with libcuda loaded but no usable GPU holds no device pointers either.
    if !process_has_cuda() || init().is_err() {
        return Ok(None);
    }
    let (mut mem_type, mut managed, mut device, mut buffer_id) = (0u32, 0u32, -1i32, 0u64);
    let mut which = [MEMORY_TYPE, IS_MANAGED, DEVICE_ORDINAL, BUFFER_ID];
    let mut out: [*mut std::ffi::c_void; 4] = [
        &mut mem_type as *mut u32 as *mut _,
        &mut managed as *mut u32 as *mut _,
        &mut device as *mut i32 as *mut _,
        &mut buffer_id as *mut u64 as *mut _,
    ];
    // SAFETY: four attributes, each with an out-value of the width the driver writes for it
    // (u32 for MEMORY_TYPE and IS_MANAGED, i32 for DEVICE_ORDINAL, u64 for BUFFER_ID); the driver
    // only looks the address up. Memory the driver never saw (plain malloc) is not an error
    // here: MEMORY_TYPE stays 0. A failed query counts as host memory, as a failed
    // MEMORY_TYPE query always did.
    let r = unsafe { cu::cuPointerGetAttributes(which.len() as u32, which.as_mut_ptr(), out.as_mut_ptr(), addr as cu::CUdeviceptr) };
    if r != cu::CUresult::CUDA_SUCCESS || mem_type != cu::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 || managed != 0 {
        return Ok(None);
    }
    Ok(Some(DevicePtr { device, buffer_id }))
}

/// One past the last byte of the device allocation holding `addr` (on `device`).
pub(crate) fn allocation_end(addr: usize, device: i32) -> Result<usize> {
    let _scope = super::CtxScope::enter(super::copy::primary_context(device)?)?;
    let (mut base, mut size): (cu::CUdeviceptr, usize) = (0, 0);
    // SAFETY: valid out-pointers; the driver only looks the address up.
    super::check(unsafe { cu::cuMemGetAddressRange_v2(&mut base, &mut size, addr as cu::CUdeviceptr) }, "cuMemGetAddressRange")?;
    Ok(base as usize + size)
}

/// The memory type of `addr`, detected.
pub(crate) fn memtype_of(addr: usize) -> Result<MemType> {
    Ok(if device_ptr(addr)?.is_some() { MemType::Cuda } else { MemType::Host })
}

/// Check a memory type the user declared against what the driver says, so a wrong declaration
/// is an error at the call and never a fault inside a copy.
pub(crate) fn check_declared(addr: usize, len: usize, declared: MemType) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    match (declared, device_ptr(addr)?) {
        (MemType::Cuda, None) if !process_has_cuda() => {
            Err(Error::new(Status::LibraryMissing, "the buffer is declared CUDA memory but this process has not loaded the CUDA driver"))
        }
        (MemType::Cuda, None) => Err(Error::invalid_param("the buffer is declared CUDA memory but the driver says it is host memory")),
        (MemType::Host, Some(_)) => Err(Error::invalid_param("the buffer is declared host memory but it is CUDA device memory")),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_driver_library_counts_as_libcuda() {
        for yes in ["libcuda.so", "libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05"] {
            assert!(is_libcuda(yes.as_bytes()), "{yes}");
        }
        for no in ["", "libcudart.so.13", "/opt/libcuda_stub.so", "libcuda.so1", "/usr/lib/libcuda.so/x.so"] {
            assert!(!is_libcuda(no.as_bytes()), "{no}");
        }
        // The walk sees what is loaded: this process runs on glibc.
        assert!(loaded_object(|p| p.rsplit(|&b| b == b'/').next().is_some_and(|f| f.starts_with(b"libc.so"))));
        assert!(!loaded_object(|_| false));
    }
}
