//! Choosing, at the receiver, how a host rendezvous moves its data on a shared-memory lane:
//! one cross-memory read of the sender's buffer (CMA), or a push through the ring (two copies).
//!
//! Neither wins everywhere, and the difference is large. On the dev VM (2 vCPUs, docs/PERF.md,
//! 2026-11-22) 4 MiB went at 12-31 GB/s pushed and ~9 GB/s read while the two CPUs shared their
//! caches, and at 3.5-6 GB/s pushed against 8-10 read while they did not, the state switching
//! within seconds. Which case a machine is in depends on where the two processes run, so it is
//! measured, not configured: each size class (power of two) keeps a moving average of the time
//! per byte of each way, takes the faster one, and now and then tries the other, so a change of
//! conditions is noticed.
//!
//! Pure state: the caller supplies the clock readings, so tests drive it deterministically.

/// The two ways a host rendezvous can move its data.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RndvWay {
    /// The receiver reads the sender's buffer (process_vm_readv on shm).
    Read,
    /// The receiver asks the sender to push the data in frames (RTR).
    Push,
}

/// Samples of each way a class takes before it trusts the averages.
const WARMUP_SAMPLES: u32 = 2;
/// Every this many decisions of a class, the slower way is taken once to refresh its average.
const EXPLORE_EVERY: u32 = 64;
/// Size classes: log2 of the length, so 64 covers every usize.
const CLASSES: usize = 64;

#[derive(Copy, Clone, Default)]
struct ClassStats {
    /// Moving average of nanoseconds per KiB, per way (index `way as usize`).
    ns_per_kib: [f64; 2],
    samples: [u32; 2],
    decisions: u32,
}

/// The receiver's record of how fast each way has been, by message size class.
pub struct RndvTuner {
    classes: Box<[ClassStats; CLASSES]>,
}

impl Default for RndvTuner {
    fn default() -> Self {
        RndvTuner { classes: Box::new([ClassStats::default(); CLASSES]) }
    }
}

fn class_of(len: usize) -> usize {
    (usize::BITS - 1 - len.max(1).leading_zeros()) as usize
}

fn index(way: RndvWay) -> usize {
    match way {
        RndvWay::Read => 0,
        RndvWay::Push => 1,
    }
}

fn other(way: RndvWay) -> RndvWay {
    match way {
        RndvWay::Read => RndvWay::Push,
        RndvWay::Push => RndvWay::Read,
    }
}

impl RndvTuner {
    /// The way to move a message of `len` bytes.
    pub fn choose(&mut self, len: usize) -> RndvWay {
        let c = &mut self.classes[class_of(len)];
        for way in [RndvWay::Read, RndvWay::Push] {
            if c.samples[index(way)] < WARMUP_SAMPLES {
                return way;
            }
        }
        c.decisions = c.decisions.wrapping_add(1);
        let faster = if c.ns_per_kib[index(RndvWay::Read)] <= c.ns_per_kib[index(RndvWay::Push)] { RndvWay::Read } else { RndvWay::Push };
        if c.decisions % EXPLORE_EVERY == 0 { other(faster) } else { faster }
    }

    /// A message of `len` bytes moved `way` took `ns` from the match to the last byte.
    pub fn record(&mut self, len: usize, way: RndvWay, ns: u64) {
        let c = &mut self.classes[class_of(len)];
        let sample = ns as f64 * 1024.0 / len.max(1) as f64;
        let i = index(way);
        // A quarter weight on the newest sample follows a change within a few messages
        // without flipping on one outlier.
        c.ns_per_kib[i] = if c.samples[i] == 0 { sample } else { 0.75 * c.ns_per_kib[i] + 0.25 * sample };
        c.samples[i] = c.samples[i].saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn tries_both_then_keeps_the_faster_and_still_explores() {
        let mut t = RndvTuner::default();
        // Warm-up: each way until it has its samples, reads first.
        let mut seen = Vec::new();
        for _ in 0..4 {
            let way = t.choose(4 * MIB);
            seen.push(way);
            t.record(4 * MIB, way, if way == RndvWay::Read { 400_000 } else { 150_000 });
        }
        assert_eq!(seen, [RndvWay::Read, RndvWay::Read, RndvWay::Push, RndvWay::Push]);
        // Push is faster: it is taken, except one exploring read in every EXPLORE_EVERY.
        let mut reads = 0;
        for _ in 0..EXPLORE_EVERY * 4 {
            let way = t.choose(4 * MIB);
            reads += (way == RndvWay::Read) as u32;
            t.record(4 * MIB, way, if way == RndvWay::Read { 400_000 } else { 150_000 });
        }
        assert_eq!(reads, 4);
    }

    #[test]
    fn follows_a_change_of_conditions() {
        let mut t = RndvTuner::default();
        let mut push_ns = 150_000;
        let mut last = RndvWay::Push;
        for round in 0..400 {
            if round == 100 {
                push_ns = 900_000; // the CPUs stopped sharing their caches
            }
            last = t.choose(4 * MIB);
            t.record(4 * MIB, last, if last == RndvWay::Read { 400_000 } else { push_ns });
            if round == 98 {
                assert_eq!(last, RndvWay::Push);
            }
        }
        assert_eq!(last, RndvWay::Read, "after the change, reads win");
    }

    #[test]
    fn size_classes_are_independent() {
        let mut t = RndvTuner::default();
        for _ in 0..8 {
            let small = t.choose(64 * 1024);
            t.record(64 * 1024, small, if small == RndvWay::Read { 1_000 } else { 50_000 });
            let big = t.choose(16 * MIB);
            t.record(16 * MIB, big, if big == RndvWay::Read { 9_000_000 } else { 1_000_000 });
        }
        assert_eq!(t.choose(100 * 1024), RndvWay::Read, "64-128 KiB class: reads were faster");
        assert_eq!(t.choose(20 * MIB), RndvWay::Push, "16-32 MiB class: pushes were faster");
        assert_eq!(class_of(0), 0);
        assert_eq!(class_of(usize::MAX), 63);
    }
}
