//! Page-locked staging slots for small GPU messages of stream and graph operations.
//!
//! A message of a few KiB spends most of its time in the copy engine's fixed costs (about 7 µs
//! on H200 from `cuMemcpyAsync` to its event: docs/PERF.md). Staged instead, gscomm's own
//! trigger kernel copies a send's bytes into a slot of mapped page-locked memory as it fires
//! the trigger, the proxy sends them eagerly from there like host memory, the receiving proxy
//! writes them into the receive's slot, and the wait kernel copies them into the user's buffer
//! once the done word says they arrived. No copy engine, no rendezvous round trip.
//!
//! Slot layout: bytes 0..8 hold the bytes received (written by the proxy before the done word),
//! bytes 128..136 the stamp of the last kernel that finished with the slot, data from byte 256:
//! a receive's bytes; for a send of up to `LL_MAX` bytes, its bytes as LL words (`ll_words`: 4
//! data bytes and a flag each, zeroed when the slot is taken; `ll_area`) and after them the bytes
//! the proxy unpacks from them
//! (`unpack_ll`) once every flag says this use. The flags let the kernel trigger without a
//! system fence after its page-locked stores (~1.5 µs a node, docs/probes/slot_read.cu).
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
const CLASSES: [usize; 5] = [256, 2 << 10, 4 << 10, 16 << 10, 64 << 10];
/// A class's first block: this many bytes, and slots at least. Each later block of the class is
/// twice the one before (up to `BLOCK_MAX`): a host that issues a stream's operations far ahead
/// holds a slot per operation until its kernel runs, and every block is a `cuMemHostAlloc` (a
/// 4 KiB exchange in stream mode took 20–36 µs while 15-slot blocks of the old 16 KiB class kept
/// being allocated).
const BLOCK: usize = 256 << 10;
const BLOCK_SLOTS: usize = 64;
const BLOCK_MAX: usize = 16 << 20;

struct Pools {
    /// (host address, device address) of free slots, by class.
    free: [Vec<(usize, u64)>; CLASSES.len()],
    /// Returned slots waiting for the GPU's stamp: (host, device, class, stamp).
    returned: Vec<(usize, u64, usize, u64)>,
    /// Slots of the class's last block (0: none yet).
    last_block: [usize; CLASSES.len()],
}

static POOLS: Mutex<Pools> =
    Mutex::new(Pools { free: [const { Vec::new() }; CLASSES.len()], returned: Vec::new(), last_block: [0; CLASSES.len()] });

/// Slots of a class's next block, after one of `last` slots (0: the first).
fn next_block_slots(slot_bytes: usize, last: usize) -> usize {
    let first = (BLOCK / slot_bytes).max(BLOCK_SLOTS);
    if last == 0 { first } else { (2 * last).min((BLOCK_MAX / slot_bytes).max(last)) }
}
static NEXT_STAMP: AtomicU64 = AtomicU64::new(1);

/// One slot, owned by one operation; returned to the pool when dropped.
pub(crate) struct StageSlot {
    host: usize,
    device: u64,
    class: usize,
    stamp: u64,
}

impl StageSlot {
    /// A slot with `len` bytes of data room (`len <= CUDA_STAGE_LIMIT`), its first `zero` bytes
    /// zeroed. A new block, when one is needed, is allocated with `ctx` current (the memory is
    /// portable to every context); otherwise this makes no driver call.
    pub(crate) fn take(len: usize, zero: usize, ctx: cu::CUcontext) -> Result<StageSlot> {
        let class = CLASSES.iter().position(|&c| len <= c).ok_or_else(|| {
            crate::error::Error::invalid_param(format!("{len} bytes is more than a staging slot holds ({})", CLASSES[CLASSES.len() - 1]))
        })?;
        let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
        let Pools { free, returned, last_block } = &mut *pools;
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
            let count = next_block_slots(size, last_block[class]);
            last_block[class] = count;
            let (host, dev) = {
                let _scope = super::CtxScope::enter(ctx)?;
                super::pinned::alloc_mapped(size * count)?
            };
            free[class].extend((0..count).rev().map(|i| (host + i * size, dev + (i * size) as u64)));
        }
        let (host, device) = free[class].pop().expect("refilled above");
        // SAFETY: the slot is ours alone now (its last kernel stamped it), `zero <= len` bytes of
        // its data room.
        unsafe { std::ptr::write_bytes((host + HEADER) as *mut u8, 0, zero.min(len)) };
        Ok(StageSlot { host, device, class, stamp: NEXT_STAMP.fetch_add(1, Ordering::Relaxed) })
    }

    /// Host address of the data room.
    pub(crate) fn host_data(&self) -> usize {
        self.host + HEADER
    }

    /// Proxy side, before a staged send starts: if every LL word of its `len` bytes carries
    /// `flag` (the kernel's stores all arrived), unpack them to `out` and say so.
    pub(crate) fn unpack_ll(&self, len: usize, flag: u32, out: &mut [u8]) -> bool {
        // SAFETY: the LL words of `len` bytes lie at the start of our slot's data room (the
        // caller took the slot with room for them), 8-byte aligned, and live as long as the
        // slot; the GPU writes each word with one 8-byte store, read atomically here.
        let words = unsafe { std::slice::from_raw_parts(self.host_data() as *const AtomicU64, ll_words(len)) };
        unpack_ll(words, len, flag, out)
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

/// `len` bytes from LL words (4 data bytes in the low half, the flag in the high half), into
/// `out`, if every word carries `flag`; false (with `out` partly written) otherwise.
fn unpack_ll(words: &[AtomicU64], len: usize, flag: u32, out: &mut [u8]) -> bool {
    for (i, word) in words.iter().enumerate().take(ll_words(len)) {
        let w = word.load(Ordering::Acquire);
        if (w >> 32) as u32 != flag {
            return false;
        }
        let at = 4 * i;
        let n = (len - at).min(4);
        out[at..at + n].copy_from_slice(&(w as u32).to_le_bytes()[..n]);
    }
    true
}

/// The largest staged send written as LL words (`GSC_LL_MAX` in the kernels); larger ones are
/// plain bytes ordered before the trigger by a system fence. Measured 2026-11-21 (x4, stream /
/// graph µs): LL 8 B 10.2 / 8.3, 512 B 15.1 / 11.6, 1 KiB 18.9 / 11.6, 2 KiB 22.6 / 14.4; plain
/// with the fence 2 KiB 14.2 / 12.3 — LL doubles what crosses PCIe and what the proxy reads
/// back (docs/PERF.md).
pub(crate) const LL_MAX: usize = 512;

/// The flag of a staged send's LL words for `epoch` (a persistent operation's epoch, or for a
/// sequenced one its slot's stamp, unique per use): never 0 (a slot's LL words are zeroed when it
/// is taken), different for consecutive epochs. `gsc_stage_out` computes the same.
pub(crate) fn ll_flag(epoch: u64) -> u32 {
    1 + (epoch % 0xFFFF_FFFF) as u32
}

/// LL words of a `len`-byte message: 4 data bytes and a 4-byte flag each.
pub(crate) fn ll_words(len: usize) -> usize {
    len.div_ceil(4)
}

/// Bytes of the LL words of a `len`-byte message.
pub(crate) fn ll_bytes(len: usize) -> usize {
    8 * ll_words(len)
}

/// Room of the LL words in a slot: whole 128-byte lines, so the bytes the proxy unpacks after
/// them never share a line with what the GPU writes.
pub(crate) fn ll_area(len: usize) -> usize {
    ll_bytes(len).next_multiple_of(128)
}

impl Drop for StageSlot {
    fn drop(&mut self) {
        let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
        pools.returned.push((self.host, self.device, self.class, self.stamp));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// LL words as `gsc_stage_out` writes them: (flag << 32) | 4 little-endian data bytes.
    fn pack(data: &[u8], flag: u32) -> Vec<AtomicU64> {
        data.chunks(4)
            .map(|c| {
                let mut b = [0u8; 4];
                b[..c.len()].copy_from_slice(c);
                AtomicU64::new((u64::from(flag) << 32) | u64::from(u32::from_le_bytes(b)))
            })
            .collect()
    }

    #[test]
    fn blocks_start_at_64_slots_and_double_up_to_16_mib() {
        let size = HEADER + (4 << 10);
        let first = next_block_slots(size, 0);
        assert_eq!(first, 64, "256 KiB holds fewer than 64 slots of 4 KiB");
        assert_eq!(next_block_slots(HEADER + 256, 0), (256 << 10) / 512, "small slots fill 256 KiB");
        let mut n = first;
        for _ in 0..20 {
            let next = next_block_slots(size, n);
            assert!(next >= n && next * size <= BLOCK_MAX.max(n * size), "{n} -> {next}");
            n = next;
        }
        assert_eq!(n, BLOCK_MAX / size, "growth stops at 16 MiB blocks");
    }

    #[test]
    fn ll_words_unpack_when_every_flag_is_this_uses() {
        for len in [1usize, 3, 4, 5, 8, 31, 33, 4096] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + 1) as u8).collect();
            let words = pack(&data, 5);
            assert_eq!(words.len(), ll_words(len));
            assert_eq!(ll_bytes(len), 8 * words.len());
            let mut out = vec![0xEEu8; len + 3];
            assert!(unpack_ll(&words, len, 5, &mut out), "{len} B");
            assert_eq!(&out[..len], &data[..], "{len} B");
            assert_eq!(&out[len..], &[0xEE; 3], "bytes past the message stay");
        }
    }

    #[test]
    fn a_word_of_an_earlier_use_is_not_ready() {
        let data = [9u8; 13];
        let words = pack(&data, 7);
        // The last word is still the previous epoch's (the kernel's store has not landed).
        words[3].store((6u64 << 32) | 0x0909, Ordering::Relaxed);
        let mut out = [0u8; 13];
        assert!(!unpack_ll(&words, 13, 7, &mut out));
        // A zeroed slot (just taken) is never ready: no epoch's flag is 0.
        let fresh: Vec<AtomicU64> = (0..4).map(|_| AtomicU64::new(0)).collect();
        for e in [0, 1, 0xFFFF_FFFE, 0xFFFF_FFFF, 1 << 40, u64::MAX - 1] {
            assert!(!unpack_ll(&fresh, 13, ll_flag(e), &mut out), "epoch {e}");
            assert_ne!(ll_flag(e), ll_flag(e + 1), "epochs {e} and the next share a flag");
        }
        assert_eq!(ll_flag(0), 1);
        assert_eq!((ll_area(1), ll_area(64), ll_area(65), ll_area(512)), (128, 128, 256, 1024));
    }
}
