//! Page-locked staging slots for small GPU messages of stream and graph operations.
//!
//! A message of a few KiB spends most of its time in the copy engine's fixed costs (about 7 µs
//! on H200 from `cuMemcpyAsync` to its event: docs/PERF.md). Staged instead, gscomm's own
//! trigger kernel copies a send's bytes into a slot of mapped page-locked memory before it
//! fires the trigger, the proxy sends them eagerly from there like host memory, the receiving
//! proxy writes them into the receive's slot, and the wait kernel copies them into the user's
//! buffer once the done word says they arrived. No copy engine, no rendezvous round trip.
//!
//! Slot layout: bytes 0..8 hold the bytes received (written by the proxy before the done word),
//! bytes 128..136 the stamp of the last kernel that finished with the slot, data from byte 256.
//! What the GPU writes and what the proxy writes never share a 128-byte line (the GPU's cache
//! line), so neither side's write ever has to merge with a stale copy of the other's. Slots
//! come in a few sizes from blocks that are never freed (like the trigger words: freeing
//! page-locked memory can synchronize the device).
//!
//! Reuse: a slot returned by its operation goes back into use only once the GPU has written
//! its stamp, i.e. the kernel that copies into or out of it has run. An operation that failed
//! before its stream reached that kernel keeps its slot out of use until (if ever) it does, so
//! a late kernel never writes into a slot another operation owns.

use super::cu;
use crate::error::Result;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes before the data: the received length's line and the stamp's line.
pub(crate) const HEADER: usize = 256;
/// Where the kernels write the stamp.
const STAMP: usize = 128;
/// Data capacities of the slot sizes; the last is `config::CUDA_STAGE_LIMIT`.
const CLASSES: [usize; 4] = [256, 2 << 10, 16 << 10, 64 << 10];
/// Bytes allocated at a time for a size class (at least one slot).
const BLOCK: usize = 256 << 10;

struct Pools {
    /// (host address, device address) of free slots, by class.
    free: [Vec<(usize, u64)>; CLASSES.len()],
    /// Returned slots waiting for the GPU's stamp: (host, device, class, stamp).
    returned: Vec<(usize, u64, usize, u64)>,
}

static POOLS: Mutex<Pools> = Mutex::new(Pools { free: [Vec::new(), Vec::new(), Vec::new(), Vec::new()], returned: Vec::new() });
static NEXT_STAMP: AtomicU64 = AtomicU64::new(1);

/// One slot, owned by one operation; returned to the pool when dropped.
pub(crate) struct StageSlot {
    host: usize,
    device: u64,
    class: usize,
    stamp: u64,
}

impl StageSlot {
    /// A slot for `len` bytes (`len <= CUDA_STAGE_LIMIT`). A new block, when one is needed, is
    /// allocated with `ctx` current (the memory is portable to every context); otherwise this
    /// makes no driver call.
    pub(crate) fn take(len: usize, ctx: cu::CUcontext) -> Result<StageSlot> {
        let class = CLASSES.iter().position(|&c| len <= c).ok_or_else(|| {
            crate::error::Error::invalid_param(format!("{len} bytes is more than a staging slot holds ({})", CLASSES[CLASSES.len() - 1]))
        })?;
        let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
        let Pools { free, returned } = &mut *pools;
        if free[class].is_empty() {
            // Reclaimed only when a class runs dry: each stamp read misses the CPU's cache (the
            // GPU wrote it), and a host that runs ahead of its stream returns slots faster than
            // their kernels stamp them, so checking on every take cost more than it found.
            returned.retain(|&(host, dev, c, stamp)| {
                // SAFETY: `host` is a slot of a block that is never freed; the stamp is written
                // only by our kernels and read here atomically.
                let seen = unsafe { &*((host + STAMP) as *const AtomicU64) }.load(Ordering::Acquire);
                let done = seen == stamp;
                if done {
                    free[c].push((host, dev));
                }
                !done
            });
        }
        if free[class].is_empty() {
            let size = HEADER + CLASSES[class];
            let count = (BLOCK / size).max(1);
            let (host, dev) = {
                let _scope = super::CtxScope::enter(ctx)?;
                super::pinned::alloc_mapped(size * count)?
            };
            free[class].extend((0..count).rev().map(|i| (host + i * size, dev + (i * size) as u64)));
        }
        let (host, device) = free[class].pop().expect("refilled above");
        Ok(StageSlot { host, device, class, stamp: NEXT_STAMP.fetch_add(1, Ordering::Relaxed) })
    }

    /// Host address of the data (what the protocols send from or receive into).
    pub(crate) fn host_data(&self) -> usize {
        self.host + HEADER
    }

    /// Device address of the slot (its word 0), what the kernels take.
    pub(crate) fn device(&self) -> u64 {
        self.device
    }

    /// What the kernels write to the stamp line when they are done with the slot.
    pub(crate) fn stamp(&self) -> u64 {
        self.stamp
    }

    /// Proxy side, before the receive's done word: `len` bytes arrived.
    pub(crate) fn set_received(&self, len: u64) {
        // SAFETY: word 0 of our slot; the GPU reads it only after the done word, written later
        // with release ordering.
        unsafe { &*(self.host as *const AtomicU64) }.store(len, Ordering::Relaxed);
    }
}

impl Drop for StageSlot {
    fn drop(&mut self) {
        let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
        pools.returned.push((self.host, self.device, self.class, self.stamp));
    }
}
