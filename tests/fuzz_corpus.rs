//! The fuzz targets of every decoder of untrusted bytes (`gscomm::fuzz`), run in CI: each on its
//! valid seeds, on the saved corpus in fuzz/corpus/<target>/ (inputs libFuzzer found worth
//! keeping, when a run saved any), and on 20,000 deterministic mutations of them — bit flips,
//! bytes and length words set to extremes, truncations, extensions, splices and random bytes.
//! A panic fails the test with the target's name and the input in hex.

use gscomm::fuzz::{TARGETS, seeds};
use std::path::PathBuf;

const MUTATIONS: usize = 20_000;

/// xorshift64*: the same inputs every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 { 0 } else { (self.next() % n as u64) as usize }
    }
}

/// Values that make length and offset fields interesting.
const EXTREMES: [u64; 8] = [0, 1, 0x7f, 0xff, 0xffff, 0x7fff_ffff, 0xffff_ffff, u64::MAX];

fn mutate(rng: &mut Rng, seeds: &[Vec<u8>]) -> Vec<u8> {
    let mut b = seeds[rng.below(seeds.len())].clone();
    for _ in 0..1 + rng.below(3) {
        match rng.below(7) {
            0 if !b.is_empty() => {
                let i = rng.below(b.len());
                b[i] ^= 1 << rng.below(8);
            }
            1 if !b.is_empty() => {
                let i = rng.below(b.len());
                b[i] = rng.next() as u8;
            }
            2 if b.len() >= 8 => {
                // A little-endian word of 2, 4 or 8 bytes set to an extreme value.
                let width = [2, 4, 8][rng.below(3)];
                let i = rng.below(b.len() - width + 1);
                let v = EXTREMES[rng.below(EXTREMES.len())].to_le_bytes();
                b[i..i + width].copy_from_slice(&v[..width]);
            }
            3 => b.truncate(rng.below(b.len() + 1)),
            4 => b.extend((0..rng.below(64)).map(|_| rng.next() as u8)),
            5 => {
                let other = &seeds[rng.below(seeds.len())];
                let at = rng.below(b.len() + 1);
                let from = rng.below(other.len() + 1);
                b.truncate(at);
                b.extend_from_slice(&other[from..]);
            }
            _ => b = (0..rng.below(128)).map(|_| rng.next() as u8).collect(),
        }
    }
    b
}

fn saved_corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus").join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
    entries.filter_map(|e| std::fs::read(e.ok()?.path()).ok()).collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn every_decoder_survives_its_corpus_and_mutations() {
    assert!(TARGETS.len() >= 10, "a decoder lost its target");
    for (name, target) in TARGETS {
        let mut inputs = seeds(name);
        assert!(!inputs.is_empty(), "{name}: no seeds");
        inputs.extend(saved_corpus(name));
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ name.len() as u64);
        let mutations: Vec<Vec<u8>> = (0..MUTATIONS).map(|_| mutate(&mut rng, &inputs)).collect();
        for input in inputs.iter().chain(&mutations) {
            if std::panic::catch_unwind(|| target(input)).is_err() {
                panic!("fuzz target {name} panicked on input {}", hex(input));
            }
        }
    }
}

#[test]
fn seeds_are_accepted_by_their_decoders() {
    // A seed that its own decoder refuses would make the mutations start from garbage. The
    // targets discard results, so this checks through the public decoders that have them.
    for seed in seeds("worker_address") {
        gscomm::WorkerAddress::unpack(&seed).expect("worker address seed");
    }
    for seed in seeds("unique_id") {
        let ok = gscomm::bootstrap::UniqueId::from_bytes(&seed).is_ok()
            || std::str::from_utf8(&seed).ok().and_then(|s| s.parse::<gscomm::bootstrap::UniqueId>().ok()).is_some();
        assert!(ok, "unique id seed {}", hex(&seed));
    }
}
