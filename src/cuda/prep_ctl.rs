//! Control blocks of prepared transfers whose rounds run on the GPU (no proxy): 128 bytes of
//! GPU memory per side, which the peer maps through CUDA IPC and writes over NVLink.
//!
//! A small receive's staging area follows its block (the sender writes the data there).
//!
//! Layout (64-bit words): 0 `epoch`, the rounds begun on this side (bumped by our round kernel
//! only, so replays of a graph count themselves); 8 `peer word`, on its own cache line, written
//! by the peer (a sender's "receiver ready for round e", a receiver's "round e arrived"); 9
//! `error`, the round a kernel gave up on (its peer did not answer within the timeout); 10 the
//! count of blocks of a send round that finished copying (the last one resets it and raises
//! the flag).
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

pub(crate) const BLOCK: usize = 128;
/// Receives up to this size are staged right after their control block.
pub(crate) const STAGE_MAX: usize = 64 << 10;
const SLAB: usize = 2 << 20;
/// Word offsets (in u64) inside a block.
pub(crate) const PEER_WORD: u64 = 8;
pub(crate) const ERROR_WORD: u64 = 9;

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
    /// A fresh (zeroed, never used) block on `device`, followed by `stage` bytes of staging
    /// (at most STAGE_MAX).
    pub(crate) fn take(device: i32, stage: usize) -> Result<CtlBlock> {
        assert!(stage <= STAGE_MAX);
        let need = BLOCK + stage.div_ceil(BLOCK) * BLOCK;
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

    /// The error word: 0, or the round a kernel of this side gave up on.
    pub(crate) fn error(&self) -> Result<u64> {
        let _scope = CtxScope::enter(primary_context(self.device)?)?;
        let mut v = 0u64;
        // SAFETY: a live 8-byte word of our block (slabs are never freed); `v` is written by
        // the synchronous copy.
        check(
            unsafe { cu::cuMemcpyDtoH_v2((&mut v as *mut u64).cast(), self.addr + ERROR_WORD * 8, 8) },
            "cuMemcpyDtoH (prepared control block)",
        )?;
        Ok(v)
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
