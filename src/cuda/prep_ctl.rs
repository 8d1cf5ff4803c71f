//! Control blocks of prepared transfers whose rounds run on the GPU (no proxy): 128 bytes of
//! GPU memory per side, which the peer maps through CUDA IPC and writes over NVLink.
//!
//! A small receive's staging area follows its block (the sender writes the data there).
//!
//! Layout (bytes): 0 the round counter (bumped by our kernels only, so replays of a graph count
//! themselves), 8 `error` (the round a kernel gave up on: its peer did not answer within the
//! timeout), 16 the count of blocks of a send round that finished copying (the last one resets
//! it and raises the flag); 64 the `gsc_prepared_device_t` kernels get
//! (`gsc_prepared_device_handle`); from 128 the words the peer writes, each on its own line for
//! the first: a sender's "receiver ready for round e", a receiver's "partition p of round e
//! arrived", one per partition. The same offsets are in include/gsc_device.cuh.
//!
//! Blocks come from 2 MiB slabs per GPU, zeroed when allocated, exported once, and never reused
//! or freed: a kernel or the peer may still write a block after its transfer was released, and
//! a slab of its own (not a sub-allocation of a shared CUDA block) is what lets a peer open it
//! without colliding with its other mappings of our memory.

use super::copy::primary_context;
use super::ipc;
use super::{CtxScope, check, cu};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::Mutex;

/// Receives up to this size are staged right after their control block.
pub(crate) const STAGE_MAX: usize = 64 << 10;
/// Staged receives up to this size travel as LL words (4 data bytes per 8-byte word).
pub(crate) const LL_MAX: usize = 2048;

/// 8-byte LL words of one slot of a receive of `len` bytes (4 data bytes each; at least one, so
/// a stride of 0 never means "LL").
pub(crate) fn ll_slot_words(len: usize) -> usize {
    len.div_ceil(4).max(1)
}

/// Bytes of an LL receive's staging area: two slots, round e in slot e % 2 (`gsc_ll_slot` in
/// gsc_device.cuh), so the sender never waits for the readiness of the round it sends.
pub(crate) fn ll_area_bytes(len: usize) -> usize {
    2 * 8 * ll_slot_words(len)
}
const SLAB: usize = 2 << 20;
/// Offsets inside a block.
pub(crate) const ERROR_WORD: u64 = 1;
pub(crate) const DESCRIPTOR: u64 = 64;
pub(crate) const PEER_WORD: u64 = 16;
/// Partitions a block has arrival words for, at most.
pub(crate) const MAX_PARTS: usize = 4096;

/// Bytes of a block with `parts` peer-written words.
pub(crate) fn block_bytes(parts: usize) -> usize {
    128 + (8 * parts.max(1)).div_ceil(64) * 64
}

struct Slab {
    base: u64,
    next: usize,
    key: Vec<u8>,
}

static SLABS: Mutex<Option<HashMap<i32, Slab>>> = Mutex::new(None);

/// One side's control block: its device address and the key that opens its slab to a peer.
#[derive(Clone, Debug)]
pub(crate) struct CtlBlock {
    pub(crate) device: i32,
    pub(crate) addr: u64,
    pub(crate) key: Vec<u8>,
}

impl CtlBlock {
    /// A fresh (zeroed, never used) block on `device` with `parts` peer-written words, followed
    /// by `stage` bytes of staging (at most STAGE_MAX), at `addr + block_bytes(parts)`.
    pub(crate) fn take(device: i32, parts: usize, stage: usize) -> Result<CtlBlock> {
        assert!(stage <= STAGE_MAX && parts <= MAX_PARTS);
        let need = block_bytes(parts) + stage.div_ceil(128) * 128;
        let mut slabs = SLABS.lock().unwrap_or_else(|e| e.into_inner());
        let map = slabs.get_or_insert_with(HashMap::new);
        if map.get(&device).is_none_or(|s| s.next + need > SLAB) {
            map.insert(device, new_slab(device)?);
        }
        let slab = map.get_mut(&device).expect("made above");
        let addr = slab.base + slab.next as u64;
        slab.next += need;
        Ok(CtlBlock { device, addr, key: slab.key.clone() })
    }

    /// Write the kernels' descriptor (`gsc_prepared_device_t`, `words`) into the block; returns
    /// its device address.
    pub(crate) fn write_descriptor(&self, words: &[u64; 8]) -> Result<u64> {
        let _scope = CtxScope::enter(primary_context(self.device)?)?;
        let at = self.addr + DESCRIPTOR;
        // SAFETY: the block's descriptor area (its 64 bytes); `words` is read by the
        // synchronous copy.
        check(
            unsafe { cu::cuMemcpyHtoD_v2(at, words.as_ptr().cast(), std::mem::size_of_val(words)) },
            "cuMemcpyHtoD (prepared descriptor)",
        )?;
        Ok(at)
    }

    /// The error word: 0, or the round a kernel of this side gave up on.
    pub(crate) fn error(&self) -> Result<u64> {
        // A live word of our block (slabs are never freed), read beside other work.
        super::read_word(self.device, self.addr + ERROR_WORD * 8)
    }
}

fn new_slab(device: i32) -> Result<Slab> {
    let _scope = CtxScope::enter(primary_context(device)?)?;
    let mut base: cu::CUdeviceptr = 0;
    // SAFETY: a valid out-pointer; the slab is never freed (module doc).
    check(unsafe { cu::cuMemAlloc_v2(&mut base, SLAB) }, "cuMemAlloc (prepared control blocks)")?;
    // SAFETY: the whole new slab; a synchronous memset (no stream of the user's involved).
    check(unsafe { cu::cuMemsetD8_v2(base, 0, SLAB) }, "cuMemsetD8 (prepared control blocks)")?;
    let ptr = super::memory::device_ptr(base as usize)?
        .ok_or_else(|| Error::new(crate::error::Status::Internal, "a fresh cuMemAlloc is not device memory"))?;
    let key = ipc::export(base as usize, ptr)?.encode();
    Ok(Slab { base, next: 0, key })
}
