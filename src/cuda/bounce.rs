//! Page-locked bounce buffers for the host-staging pipeline (core/staging.rs): GPU data that a
//! lane cannot reach is copied by the copy engine between the GPU buffer and one of these, and
//! the lane sends from (or the receiver fills) the bounce buffer.
//!
//! Page-locked because the copy engine moves page-locked memory asynchronously and at full
//! speed; pageable memory is staged by the driver itself, in pieces, and `cuMemcpyAsync` from it
//! is synchronous with respect to the host. Buffers come in power-of-two sizes from a
//! process-wide pool and are never freed (freeing page-locked memory can synchronize the
//! device, which the proxy must never risk: crate::cuda's module note). `reserve` allocates them
//! on a user's thread when an operation that may need them is posted, and the proxy only takes
//! buffers from the pool: `take` never allocates. A page-locked allocation is one of CUDA's
//! implicit synchronization points, so a proxy that allocated while a user's stream waited on a
//! word the proxy writes could make its own next copy wait behind that stream, which waits for
//! the proxy. (A precaution: issue #7's device stall turned out to be a kernel's lazy load,
//! cuda/kernels.rs, with 18 buffers free; the proxy used to allocate here for any size class
//! nobody had reserved.) When the pool is dry the caller waits for a buffer to come back or
//! copies synchronously instead.

use super::copy::primary_context;
use super::{CtxScope, pinned};
use crate::error::Result;
use std::sync::Mutex;

/// Smallest buffer size (smaller requests get this).
const MIN: usize = 64 << 10;

/// Free buffers' host addresses, by size class (log2 of the size).
static POOL: Mutex<Vec<(u32, usize)>> = Mutex::new(Vec::new());
/// Buffers ever allocated, by size class: `reserve` tops the pool up to a count, not beyond.
static ALLOCATED: Mutex<Vec<(u32, usize)>> = Mutex::new(Vec::new());

fn class_of(len: usize) -> (u32, usize) {
    let size = len.max(MIN).next_power_of_two();
    (size.trailing_zeros(), size)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn allocate(device: i32, class: u32, size: usize) -> Result<usize> {
    let _scope = CtxScope::enter(primary_context(device)?)?;
    let (host, _dev) = pinned::alloc_mapped(size)?;
    let mut all = lock(&ALLOCATED);
    match all.iter_mut().find(|(c, _)| *c == class) {
        Some((_, n)) => *n += 1,
        None => all.push((class, 1)),
    }
    Ok(host)
}

/// Make at least `count` buffers of `len` bytes exist in the process (allocated with `device`'s
/// primary context; the memory is portable to every context). Call on a user's thread.
pub(crate) fn reserve(device: i32, len: usize, count: usize) -> Result<()> {
    let (class, size) = class_of(len);
    loop {
        let have = lock(&ALLOCATED).iter().find(|(c, _)| *c == class).map_or(0, |(_, n)| *n);
        if have >= count {
            return Ok(());
        }
        let host = allocate(device, class, size)?;
        lock(&POOL).push((class, host));
    }
}

/// Free buffers in the pool (for diagnostics).
pub(crate) fn free_count() -> usize {
    lock(&POOL).len()
}

/// One page-locked buffer of at least `len` bytes; back in the pool when dropped.
pub(crate) struct Bounce {
    host: usize,
    size: usize,
    class: u32,
}

impl Bounce {
    /// The smallest free buffer of at least `len` bytes, or `None` when no such buffer is free
    /// (the pool holds only what `reserve` made; nothing is allocated here).
    pub(crate) fn take(len: usize) -> Option<Bounce> {
        let (class, _) = class_of(len);
        let mut pool = lock(&POOL);
        let i = pool.iter().enumerate().filter(|(_, (c, _))| *c >= class).min_by_key(|(_, (c, _))| *c).map(|(i, _)| i)?;
        let (class, host) = pool.swap_remove(i);
        Some(Bounce { host, size: 1 << class, class })
    }

    /// The buffer's size (at least what was asked for).
    pub(crate) fn len(&self) -> usize {
        self.size
    }

    /// The buffer's address, for the copy engine.
    pub(crate) fn addr(&self) -> u64 {
        self.host as u64
    }

    /// `len` bytes at `offset`. Only read once the copy engine has finished writing them.
    pub(crate) fn bytes(&self, offset: usize, len: usize) -> &[u8] {
        assert!(offset.checked_add(len).is_some_and(|end| end <= self.size), "bounce buffer range out of bounds");
        // SAFETY: the range is inside this buffer (checked), which is live page-locked memory
        // owned by this value; the caller reads it only when no copy into it is running.
        unsafe { std::slice::from_raw_parts((self.host + offset) as *const u8, len) }
    }

    /// Copy `src` into the buffer at `offset`. Only while no copy engine transfer reads it.
    pub(crate) fn write(&mut self, offset: usize, src: &[u8]) {
        assert!(offset.checked_add(src.len()).is_some_and(|end| end <= self.size), "bounce buffer range out of bounds");
        // SAFETY: the range is inside this buffer (checked), owned by this value and not read
        // by a copy now (`&mut self`, and the caller starts copies only after writing).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), (self.host + offset) as *mut u8, src.len()) };
    }
}

impl Drop for Bounce {
    fn drop(&mut self) {
        lock(&POOL).push((self.class, self.host));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_up_to_powers_of_two_from_64k() {
        assert_eq!(class_of(1), (16, 64 << 10));
        assert_eq!(class_of(64 << 10), (16, 64 << 10));
        assert_eq!(class_of((64 << 10) + 1), (17, 128 << 10));
        assert_eq!(class_of(4 << 20), (22, 4 << 20));
    }

    /// `take` serves the smallest free buffer that fits, larger classes included, and never
    /// allocates: a size nothing reserved gets a bigger buffer or nothing.
    #[test]
    fn take_serves_the_smallest_free_buffer_that_fits_and_never_allocates() {
        // Fake free buffers (never dereferenced, never copied into): classes 1 MiB and 4 MiB.
        let fake = [(20u32, 0x1000_0000usize), (22, 0x2000_0000)];
        lock(&POOL).extend(fake);
        let a = Bounce::take(100).expect("the 1 MiB buffer serves 100 bytes");
        assert_eq!((a.class, a.size, a.host), (20, 1 << 20, 0x1000_0000));
        let b = Bounce::take((1 << 20) + 2).expect("the 4 MiB buffer serves 1 MiB + 2");
        assert_eq!((b.class, b.host), (22, 0x2000_0000));
        assert!(Bounce::take(1).is_none(), "nothing free: no allocation, no buffer");
        drop(a);
        drop(b);
        assert!(Bounce::take(8 << 20).is_none(), "nothing of 8 MiB or more was reserved");
        let mut pool = lock(&POOL);
        pool.retain(|e| !fake.contains(e));
    }
}
