//! A single-producer single-consumer ring of variable-size frames in shared memory.
//!
//! Layout of a ring region: a 256-byte control block (`head` and `tail` byte counters, each on its
//! own 128-byte block: CPUs that fetch cache lines in adjacent pairs would otherwise bounce one
//! side's counter along with the other's) followed by `capacity` bytes of data, `capacity` a power of two.
//! Counters only grow; a position's index in the data is `pos & (capacity - 1)`.
//!
//! A frame is `[u32 len][u32 flags][payload, padded to 8 bytes]`. When a frame does not fit
//! between its start and the end of the data, the producer writes a header with `FLAG_SKIP` there
//! and starts the frame at index 0; the consumer skips to the wrap.
//!
//! Publication is in the frame itself, not in `head`: the consumer polls the header word at its
//! position, and a frame is there when the word carries `FLAG_READY`. This way a message costs the
//! consumer one cache-line transfer (the frame's) instead of two (`head`, then the frame), which
//! is most of a small message's latency between cores. For the header word to be trusted, the
//! word after every frame must not be stale data from an earlier lap: the producer writes the
//! frame, zeroes the header word after it, then stores the frame's header with Release (so it
//! always keeps 8 bytes of room for that word). The consumer loads the header with Acquire, reads
//! the frame in place, and only then releases the space with a Release store of `tail`. The
//! producer still advances `head` (only a reattaching producer and the consumer's attach check
//! read it) and reloads the consumer's `tail` only when its cached copy says "full", so in the
//! steady state each side's counter line stays in its own cache.
//!
//! The consumer treats everything it reads from the ring as untrusted: a header or counter that
//! violates the format is reported as an error, never followed out of bounds.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result, Status};

/// Bytes of the frame header.
pub const FRAME_HEADER: usize = 8;
/// Bytes of the control block in front of the data.
pub const CTL_SIZE: usize = 256;
/// Smallest ring data size accepted.
pub const MIN_CAPACITY: usize = 256;
/// Largest ring data size accepted (keeps all size arithmetic far from overflow).
pub const MAX_CAPACITY: usize = 1 << 30;

/// The frame (or skip marker) at this header is published.
const FLAG_READY: u32 = 1;
/// The rest of the data up to the wrap is padding; the next frame starts at index 0.
const FLAG_SKIP: u32 = 2;

#[repr(C, align(64))]
struct CacheLine(AtomicU64);

/// Each counter is followed by an unused line, so the two are 128 bytes apart while the block
/// needs only the 64-byte alignment that segments guarantee.
#[repr(C)]
struct RingCtl {
    /// Bytes ever published by the producer; written only by the producer.
    head: CacheLine,
    _head_pad: CacheLine,
    /// Bytes ever released by the consumer; written only by the consumer.
    tail: CacheLine,
    _tail_pad: CacheLine,
}

const _: () = assert!(std::mem::size_of::<RingCtl>() == CTL_SIZE);
const _: () = assert!(std::mem::align_of::<RingCtl>() == 64);

/// Bytes a frame of `len` payload bytes occupies in the ring.
pub fn frame_size(len: usize) -> usize {
    FRAME_HEADER + len.next_multiple_of(8)
}

/// Bytes of shared memory a ring with `capacity` data bytes needs (a multiple of 64).
pub fn region_size(capacity: usize) -> usize {
    CTL_SIZE + capacity
}

/// Check a ring geometry. `max_frame` must fit in half the ring: then an empty ring always has room
/// for any frame, whatever its wrap position, so a sender is never stuck behind the wrap.
pub fn validate(capacity: usize, max_frame: usize) -> Result<()> {
    if !capacity.is_power_of_two() || !(MIN_CAPACITY..=MAX_CAPACITY).contains(&capacity) {
        return Err(Error::new(
            Status::InvalidConfig,
            format!("ring size {capacity} must be a power of two from {MIN_CAPACITY} to {MAX_CAPACITY} bytes"),
        ));
    }
    if max_frame == 0 || max_frame > u32::MAX as usize || frame_size(max_frame) > capacity / 2 {
        return Err(Error::new(
            Status::InvalidConfig,
            format!(
                "max frame {max_frame} must be at least 1 byte and, with its {FRAME_HEADER}-byte \
                 header, at most half the ring size {capacity}"
            ),
        ));
    }
    Ok(())
}

/// The two counters and data of one ring, as seen through one mapping.
#[derive(Copy, Clone)]
struct Shared {
    ctl: *const RingCtl,
    data: *mut u8,
    capacity: usize,
    max_frame: usize,
}

impl Shared {
    /// # Safety
    /// `region` must point to `region_size(capacity)` bytes that stay mapped, 64-byte aligned,
    /// for as long as the returned value (and anything built from it) is used.
    unsafe fn new(region: *mut u8, capacity: usize, max_frame: usize) -> Result<Shared> {
        validate(capacity, max_frame)?;
        if region as usize % 64 != 0 {
            return Err(Error::new(Status::Internal, "ring region is not 64-byte aligned"));
        }
        // SAFETY: CTL_SIZE bytes are inside the region, per the contract.
        let data = unsafe { region.add(CTL_SIZE) };
        Ok(Shared { ctl: region.cast::<RingCtl>(), data, capacity, max_frame })
    }

    fn ctl(&self) -> &RingCtl {
        // SAFETY: `ctl` is valid, aligned and mapped for the life of `self` (constructor
        // contract), and it is only accessed through atomics.
        unsafe { &*self.ctl }
    }

    fn index(&self, pos: u64) -> usize {
        (pos as usize) & (self.capacity - 1)
    }

    /// The header word at data index `idx`.
    ///
    /// # Safety
    /// `idx` must be a multiple of 8 below `capacity`.
    unsafe fn header(&self, idx: usize) -> &AtomicU64 {
        // SAFETY: the word is inside the data (contract), 8-aligned (the data is 64-aligned), and
        // header words are only ever accessed through atomics.
        unsafe { &*self.data.add(idx).cast::<AtomicU64>() }
    }
}

fn header_word(len: u32, flags: u32) -> u64 {
    u64::from(len) | (u64::from(flags) << 32)
}

/// The producing end of a ring. Exactly one may exist per ring, across all processes.
pub struct RingProducer {
    sh: Shared,
    /// Our own published position (the shared `head` only ever holds this value).
    head: u64,
    /// Last `tail` read from the consumer.
    tail_cache: u64,
}

// SAFETY: the producer is the only writer of `head` and of the free space, which is what makes it
// single-producer; moving it to another thread keeps that. The pointers stay valid per the
// `attach` contract.
unsafe impl Send for RingProducer {}

impl RingProducer {
    /// Take the producing end of the ring at `region`, continuing from its current counters.
    ///
    /// # Safety
    /// `region` must point to `region_size(capacity)` bytes, 64-byte aligned, that stay mapped
    /// while the producer lives, and that are zeroed or hold a ring of this geometry. No other
    /// producer may exist for this ring.
    pub unsafe fn attach(region: *mut u8, capacity: usize, max_frame: usize) -> Result<Self> {
        // SAFETY: forwarded contract.
        let sh = unsafe { Shared::new(region, capacity, max_frame)? };
        let head = sh.ctl().head.0.load(Ordering::Relaxed);
        let tail_cache = sh.ctl().tail.0.load(Ordering::Acquire);
        Ok(RingProducer { sh, head, tail_cache })
    }

    pub fn max_frame(&self) -> usize {
        self.sh.max_frame
    }

    /// Append one frame made of the concatenation of `parts`. Returns false when there is no room
    /// now. A frame larger than `max_frame` never fits and is refused (false) without effect;
    /// callers check the size first to tell the two apart.
    pub fn try_push(&mut self, parts: &[&[u8]]) -> bool {
        let len = parts.iter().fold(0usize, |acc, p| acc.saturating_add(p.len()));
        if len > self.sh.max_frame {
            return false;
        }
        let need = frame_size(len);
        let cap = self.sh.capacity;
        let idx = self.sh.index(self.head);
        let contiguous = cap - idx;
        let total = if need > contiguous { contiguous + need } else { need };
        // Wrapping arithmetic: `tail` comes from the other process, and a corrupt value (beyond
        // `head`) must read as "no room", never as an overflow. The 8 extra bytes are the header
        // word after the frame, zeroed before publication.
        let fits = |tail: u64| self.head.wrapping_sub(tail).saturating_add(total as u64 + 8) <= cap as u64;
        if !fits(self.tail_cache) {
            self.tail_cache = self.sh.ctl().tail.0.load(Ordering::Acquire);
            if !fits(self.tail_cache) {
                return false;
            }
        }
        let at = if need > contiguous { 0 } else { idx };
        // SAFETY: `[at, at + need)` lies inside the data (it fits before the end by construction)
        // and is free space: the consumer released it (tail check above, Acquire) and will not read
        // past the header at its position until we publish it. `len` fits u32 because max_frame
        // does (validate).
        unsafe {
            let mut dst = self.sh.data.add(at + FRAME_HEADER);
            for p in parts {
                std::ptr::copy_nonoverlapping(p.as_ptr(), dst, p.len());
                dst = dst.add(p.len());
            }
        }
        // SAFETY (the three header accesses): every index is a multiple of 8 below the capacity.
        // The word after the frame is free (the `+ 8` of the room check); zeroing it before the
        // Release below means the consumer, arriving there, reads "not yet" instead of whatever an
        // earlier lap left.
        unsafe { self.sh.header(self.sh.index(self.head + total as u64)).store(0, Ordering::Relaxed) };
        unsafe { self.sh.header(at).store(header_word(len as u32, FLAG_READY), Ordering::Release) };
        if at != idx {
            // The skip marker is published last: a consumer that sees it finds the frame at 0.
            // `contiguous >= 8` since all frames and indexes are multiples of 8.
            unsafe { self.sh.header(idx).store(header_word(0, FLAG_READY | FLAG_SKIP), Ordering::Release) };
        }
        self.head += total as u64;
        self.sh.ctl().head.0.store(self.head, Ordering::Release);
        self.prefetch_next_line();
        true
    }
}

impl RingProducer {
    /// Ask for the line after the one `head` is in, for writing, now that the frame is out.
    /// The next frame's zeroed header word lands there often (every other 32-byte frame), and
    /// stores become visible in order: a miss on that line would delay the frame's own header.
    /// Fetched now, while the peer answers, the miss leaves the critical path.
    fn prefetch_next_line(&self) {
        #[cfg(target_arch = "x86_64")]
        {
            let idx = self.sh.index((self.head & !63) + 64);
            // SAFETY: `idx` is inside the data; a prefetch never faults and changes no memory.
            unsafe { core::arch::asm!("prefetchw [{0}]", in(reg) self.sh.data.add(idx), options(nostack, preserves_flags, readonly)) };
        }
    }
}

/// The consuming end of a ring. Exactly one may exist per ring, across all processes.
pub struct RingConsumer {
    sh: Shared,
    /// Our own released position.
    tail: u64,
}

// SAFETY: as for `RingProducer`, with roles swapped: the consumer is the only writer of `tail`.
unsafe impl Send for RingConsumer {}

impl RingConsumer {
    /// Take the consuming end of the ring at `region`, continuing from its current counters.
    ///
    /// # Safety
    /// As for `RingProducer::attach`, with "consumer" for "producer".
    pub unsafe fn attach(region: *mut u8, capacity: usize, max_frame: usize) -> Result<Self> {
        // SAFETY: forwarded contract.
        let sh = unsafe { Shared::new(region, capacity, max_frame)? };
        let tail = sh.ctl().tail.0.load(Ordering::Relaxed);
        let c = RingConsumer { sh, tail };
        let head = sh.ctl().head.0.load(Ordering::Acquire);
        let used = head.wrapping_sub(tail);
        if used > capacity as u64 || used % 8 != 0 || tail % 8 != 0 {
            return Err(c.corrupt(format!("producer head {head} is invalid")));
        }
        Ok(c)
    }

    fn corrupt(&self, what: String) -> Error {
        Error::new(Status::PeerFailed, format!("shared ring corrupt at position {}: {what}", self.tail))
    }

    /// The header word at our position (Acquire: a ready header makes its frame visible).
    fn next_header(&self) -> u64 {
        // SAFETY: `tail` only moves by multiples of 8 (checked at attach, frame sizes and skips
        // are multiples of 8), so its index is a multiple of 8 below the capacity.
        unsafe { self.sh.header(self.sh.index(self.tail)).load(Ordering::Acquire) }
    }

    /// True when no published frame is waiting. One load of a line the producer writes only
    /// when it publishes, so polling an idle ring stays in our cache.
    pub fn is_empty(&self) -> bool {
        (self.next_header() >> 32) as u32 & FLAG_READY == 0
    }

    /// Hand the next frame to `f`, in place in shared memory, then release its space.
    /// `Ok(false)` when the ring is empty; an error when the ring contents violate the format.
    pub fn pop(&mut self, f: impl FnOnce(&[u8])) -> Result<bool> {
        // At most one skip marker precedes a frame (after it the index is 0).
        for _ in 0..2 {
            let word = self.next_header();
            let (len, flags) = ((word & 0xffff_ffff) as usize, (word >> 32) as u32);
            if flags & FLAG_READY == 0 {
                return Ok(false);
            }
            let idx = self.sh.index(self.tail);
            let contiguous = self.sh.capacity - idx;
            if flags & FLAG_SKIP != 0 {
                if idx == 0 {
                    return Err(self.corrupt("skip marker at the start of the data".into()));
                }
                self.tail += contiguous as u64;
                continue;
            }
            let need = frame_size(len);
            if len > self.sh.max_frame || need > contiguous {
                return Err(self.corrupt(format!("frame of {len} bytes (max {}, {contiguous} before wrap)", self.sh.max_frame)));
            }
            // SAFETY: `[idx + 8, idx + 8 + len)` is inside the data (need <= contiguous) and
            // published (Acquire on its ready header); the producer does not touch it until we
            // advance `tail` below, so the slice is immutable for the duration of `f`.
            let frame = unsafe { std::slice::from_raw_parts(self.sh.data.add(idx + FRAME_HEADER).cast_const(), len) };
            f(frame);
            self.tail += need as u64;
            self.sh.ctl().tail.0.store(self.tail, Ordering::Release);
            return Ok(true);
        }
        Err(self.corrupt("two consecutive skip markers".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::shm::segment::{Segment, SegmentKind};
    use crate::transport::shm::testutil::{self, ChildProc, TestDir};
    use std::alloc::{Layout, alloc_zeroed, dealloc};
    use std::path::PathBuf;
    use std::sync::Arc;

    /// Zeroed, 64-byte aligned memory for a ring inside one process.
    struct Region {
        ptr: *mut u8,
        layout: Layout,
    }
    // SAFETY: plain owned memory; the ring protocol synchronizes access to it.
    unsafe impl Send for Region {}
    // SAFETY: as above.
    unsafe impl Sync for Region {}
    impl Region {
        fn new(capacity: usize) -> Region {
            let layout = Layout::from_size_align(region_size(capacity), 64).unwrap();
            // SAFETY: non-zero size.
            let ptr = unsafe { alloc_zeroed(layout) };
            assert!(!ptr.is_null());
            Region { ptr, layout }
        }
    }
    impl Drop for Region {
        fn drop(&mut self) {
            // SAFETY: allocated in `new` with this layout.
            unsafe { dealloc(self.ptr, self.layout) };
        }
    }

    fn pair(r: &Region, capacity: usize, max_frame: usize) -> (RingProducer, RingConsumer) {
        // SAFETY: `r` outlives the ends in every test; one producer and one consumer.
        unsafe { (RingProducer::attach(r.ptr, capacity, max_frame).unwrap(), RingConsumer::attach(r.ptr, capacity, max_frame).unwrap()) }
    }

    /// Deterministic frame content for frame number `i`.
    fn frame(i: u64, max: usize) -> Vec<u8> {
        let len = ((i.wrapping_mul(2_654_435_761)) % (max as u64 + 1)) as usize;
        (0..len).map(|k| (i as usize).wrapping_add(k * 7) as u8).collect()
    }

    #[test]
    fn geometry_is_validated() {
        assert!(validate(4096, 2040).is_ok());
        assert!(validate(4096, 2041).is_err(), "frame must fit half the ring");
        assert!(validate(3000, 8).is_err(), "not a power of two");
        assert!(validate(128, 8).is_err(), "too small");
        assert!(validate(1 << 31, 8).is_err(), "too large");
        assert!(validate(4096, 0).is_err());
        assert_eq!(frame_size(0), 8);
        assert_eq!(frame_size(1), 16);
        assert_eq!(frame_size(8), 16);
        assert_eq!(region_size(4096) % 64, 0);
    }

    #[test]
    fn wraparound_with_varied_sizes() {
        let (cap, max) = (1024, 200);
        let r = Region::new(cap);
        let (mut p, mut c) = pair(&r, cap, max);
        let mut sent = 0u64;
        let mut recvd = 0u64;
        // Many passes around the ring, with a varying backlog so wraps land everywhere.
        while recvd < 5000 {
            let burst = 1 + sent % 5;
            for _ in 0..burst {
                let f = frame(sent, max);
                let (a, b) = f.split_at(f.len() / 3);
                if !p.try_push(&[a, &[], b]) {
                    break;
                }
                sent += 1;
            }
            let mut n = 0;
            while n < 3 {
                let want = frame(recvd, max);
                if !c.pop(|got| assert_eq!(got, &want[..], "frame {recvd}")).unwrap() {
                    break;
                }
                recvd += 1;
                n += 1;
            }
        }
        assert!(p.head > 20 * cap as u64, "the test wrapped many times");
    }

    #[test]
    fn full_ring_refuses_then_drains() {
        let (cap, max) = (1024, 100);
        let r = Region::new(cap);
        let (mut p, mut c) = pair(&r, cap, max);
        let payload = [0xabu8; 56]; // 64 bytes per frame with header
        let mut n = 0;
        while p.try_push(&[&payload]) {
            n += 1;
            assert!(n < cap / 64);
        }
        // One frame's worth less than the capacity: the producer always keeps the header word
        // after its last frame.
        assert_eq!(n, cap / 64 - 1, "exactly full");
        // The last 64 bytes take seven empty frames (8 bytes each) plus the reserved word.
        let mut empties = 0;
        while p.try_push(&[]) {
            empties += 1;
        }
        assert_eq!(empties, 7, "the room left is exact");
        assert!(!p.try_push(&[&[0u8; 101]]), "over max_frame never fits");
        assert!(c.pop(|f| assert_eq!(f, &payload)).unwrap());
        // The frame has to wrap (8 bytes left before the end): skip, frame and reserved word.
        assert!(!p.try_push(&[&payload]), "80 bytes needed, 64 free");
        assert!(c.pop(|f| assert_eq!(f, &payload)).unwrap());
        assert!(p.try_push(&[&payload]), "room again after two pops");
        let mut m = 2;
        while c.pop(|f| assert!(f == payload || f.is_empty())).unwrap() {
            m += 1;
        }
        assert_eq!(m, n + empties + 1);
        assert!(c.is_empty());
        assert!(!c.pop(|_| panic!("empty")).unwrap());
    }

    /// Payload that looks like ready headers, left behind at positions a later lap reads as
    /// headers, must never be taken for a frame: the word after each frame is zeroed first.
    #[test]
    fn stale_payload_is_never_read_as_a_frame() {
        let (cap, max) = (1024, 120);
        let r = Region::new(cap);
        let (mut p, mut c) = pair(&r, cap, max);
        let fake: Vec<u8> = (0..max / 8).flat_map(|_| header_word(16, FLAG_READY).to_le_bytes()).collect();
        let (mut sent, mut recvd) = (0u64, 0u64);
        while recvd < 3000 {
            // Sizes that move frame starts across each other's old payload from lap to lap.
            let len = 8 * (1 + (sent * 7 % 15) as usize);
            if p.try_push(&[&fake[..len]]) {
                sent += 1;
            }
            // Drain everything, then the ring must read empty, whatever the old bytes say.
            while c.pop(|f| assert!(f.len() % 8 == 0 && f.iter().zip(fake.iter()).all(|(a, b)| a == b))).unwrap() {
                recvd += 1;
            }
            assert_eq!(recvd, sent, "a frame appeared that was never sent, or one went missing");
            assert!(c.is_empty());
        }
        assert!(p.head > 10 * cap as u64, "the test wrapped many times");
    }

    #[test]
    fn corrupt_ring_is_an_error_not_a_crash() {
        let (cap, max) = (1024, 100);
        let r = Region::new(cap);
        let (mut p, mut c) = pair(&r, cap, max);
        assert!(p.try_push(&[b"hello"]));
        // SAFETY: single thread; overwrite the published header with an oversized length.
        unsafe { (*r.ptr.add(CTL_SIZE).cast::<AtomicU64>()).store(header_word(5000, FLAG_READY), Ordering::Relaxed) };
        let e = c.pop(|_| panic!("must not deliver")).unwrap_err();
        assert_eq!(e.status(), Status::PeerFailed, "{e:?}");
        // A head beyond the capacity is rejected too.
        let r2 = Region::new(cap);
        // SAFETY: the region is 64-aligned; we store a bogus head before attaching.
        unsafe { (*r2.ptr.cast::<RingCtl>()).head.0.store(4096, Ordering::Relaxed) };
        // SAFETY: r2 outlives the attempt.
        assert!(unsafe { RingConsumer::attach(r2.ptr, cap, max) }.is_err());
        // A consumer tail beyond the producer's head reads as "no room", not as an overflow.
        let r3 = Region::new(cap);
        // SAFETY: r3 outlives the producer; single thread.
        let mut p3 = unsafe { RingProducer::attach(r3.ptr, cap, max) }.unwrap();
        // SAFETY: as above; a bogus tail written the way a broken peer would.
        unsafe { (*r3.ptr.cast::<RingCtl>()).tail.0.store(1 << 40, Ordering::Relaxed) };
        p3.tail_cache = 1 << 40;
        assert!(!p3.try_push(&[b"x"]));
    }

    #[test]
    fn two_threads_keep_order_and_content() {
        const N: u64 = 1_000_000;
        let (cap, max) = (1 << 16, 64);
        let r = Arc::new(Region::new(cap));
        let (mut p, mut c) = pair(&r, cap, max);
        let keep = Arc::clone(&r);
        let producer = std::thread::spawn(move || {
            let _keep = keep;
            let mut spins = 0u64;
            for i in 0..N {
                let len = (i % 17) as usize * 3;
                let mut buf = [0u8; 64];
                buf[..8].copy_from_slice(&i.to_le_bytes());
                while !p.try_push(&[&buf[..8], &buf[8..8 + len]]) {
                    spins += 1;
                    if spins % 128 == 0 {
                        std::thread::yield_now();
                    }
                }
            }
        });
        let mut next = 0u64;
        let deadline = std::time::Instant::now() + testutil::TIME_LIMIT;
        let mut idle = 0u64;
        while next < N {
            let got = c
                .pop(|f| {
                    let i = u64::from_le_bytes(f[..8].try_into().unwrap());
                    assert_eq!(i, next, "order");
                    assert_eq!(f.len(), 8 + (i % 17) as usize * 3, "length of frame {i}");
                    assert!(f[8..].iter().all(|&b| b == 0), "content of frame {i}");
                })
                .unwrap();
            if got {
                next += 1;
            } else {
                idle += 1;
                if idle % 128 == 0 {
                    assert!(std::time::Instant::now() < deadline, "stalled at frame {next}");
                    std::thread::yield_now();
                }
            }
        }
        producer.join().unwrap();
        assert!(c.is_empty());
    }

    /// The child produces into a ring in a segment the parent created; the parent consumes.
    #[test]
    fn two_processes_share_a_ring() {
        const NAME: &str = "transport::shm::ring::tests::two_processes_share_a_ring";
        const N: u64 = 100_000;
        let (cap, max) = (1 << 14, 256);
        if testutil::role().is_some() {
            let seg = Segment::open(&PathBuf::from(testutil::env("RING_SEG")), SegmentKind::Raw).unwrap();
            // SAFETY: the segment holds region_size(cap) bytes and outlives the producer; the
            // parent only consumes.
            let mut p = unsafe { RingProducer::attach(seg.payload(), cap, max).unwrap() };
            let deadline = std::time::Instant::now() + testutil::TIME_LIMIT;
            for i in 0..N {
                let f = frame(i, max);
                testutil::spin_until("ring space", || p.try_push(&[&f]));
                assert!(std::time::Instant::now() < deadline);
            }
            return;
        }
        let dir = TestDir::new("ring2p");
        let seg = Segment::create(dir.path(), SegmentKind::Raw, region_size(cap)).unwrap();
        // SAFETY: as in the child, with roles swapped.
        let mut c = unsafe { RingConsumer::attach(seg.payload(), cap, max).unwrap() };
        let mut child = ChildProc::spawn(NAME, "producer", &[("RING_SEG", seg.path().to_string_lossy().into_owned())]);
        for i in 0..N {
            let want = frame(i, max);
            testutil::spin_until("next frame", || c.pop(|got| assert_eq!(got, &want[..], "frame {i}")).unwrap());
        }
        child.wait_success();
        assert!(c.is_empty());
    }
}
