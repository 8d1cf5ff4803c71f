//! Hash maps keyed by the integers the protocols use (request ids, connection ids, tags).
//!
//! std's SipHash cost about a tenth of the small-message path in profiles (several lookups per
//! message). These keys are integers, so a multiply-mix hasher (the FxHash scheme) does. A peer
//! that picks tags to collide can only slow its own messages' matching on this worker, which it
//! could do by sending more messages anyway.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(b));
        }
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(SEED);
    }

    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        // hashbrown takes the top 7 bits as the control byte: fold the high bits down too.
        self.0 ^ (self.0 >> 32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_ids_spread_and_maps_work() {
        let mut m: IdMap<u64, u64> = IdMap::default();
        for i in 0..10_000u64 {
            m.insert(i << 32 | 7, i);
        }
        for i in 0..10_000u64 {
            assert_eq!(m[&(i << 32 | 7)], i);
        }
        let hashes: std::collections::HashSet<u64> = (0..1000u64)
            .map(|i| {
                let mut h = IdHasher::default();
                h.write_u64(i);
                h.finish() >> 57
            })
            .collect();
        assert!(hashes.len() > 64, "top bits barely vary: {}", hashes.len());
    }
}
