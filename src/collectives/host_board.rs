//! A communicator's exchange board in shared memory: the allgathers made inside a call (the
//! direct kernel's and the copy engines' buffer exchange, `GSC_COLL_CHECK`'s comparison) in
//! about a microsecond instead of a bootstrap round over TCP.
//!
//! Why: an eager call on the peers' own buffers exchanges its buffers twice (`peer_buffers`),
//! and each bootstrap allgather costs ~25 µs on our machines (a socket write, the peer's
//! receive thread, a condition variable), so such a call paid ~50 µs before it launched
//! anything (docs/PERF.md, session 19). The ranks of a communicator are on one host (its
//! collectives run over NVLink), so a shared page does it.
//!
//! Layout: per rank two slots, used by calls of alternating parity. A rank writes its entry
//! into its slot of this call's parity, then publishes the call's number in the slot's
//! sequence word (Release); it reads a peer's entry once that word shows the same number
//! (Acquire). A slot is reused two calls later, which a rank reaches only after every peer
//! published the call in between — and a peer publishes a call only after it finished
//! reading the one before. An entry too big for a slot is marked as such: every rank then sees
//! the mark and makes that call's exchange through the bootstrap instead, all of them alike.
//!
//! The board is made at communicator creation — rank 0 creates the segment, every rank opens
//! it, and it is used only if every rank could (all agree through the bootstrap) — and its file
//! is unlinked as soon as everyone has it mapped.

use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result, Status};
use crate::transport::shm::segment::{Segment, SegmentKind};
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// One slot: a 64-byte line (sequence word, entry length), then the entry.
const SLOT_BYTES: usize = 4096;
const SLOT_HEAD: usize = 64;
/// The most an entry may hold (the buffer exchange's entries are ~200 bytes).
pub(crate) const ENTRY_MAX: usize = SLOT_BYTES - SLOT_HEAD;
/// An entry's length word for "too big for the board: exchange through the bootstrap".
const OVERSIZE: u64 = u64::MAX;

/// How long a waiting rank spins before it starts yielding its core now and then (peers' calls
/// usually arrive within microseconds of each other; an eager call from a busy rank may not),
/// and after how long it sleeps between looks instead.
const HOT_SPIN: Duration = Duration::from_micros(50);
const WARM_SPIN: Duration = Duration::from_millis(1);
const COLD_POLL: Duration = Duration::from_micros(50);

pub(crate) struct HostBoard {
    seg: Segment,
    rank: usize,
    nranks: usize,
    /// Calls made so far (the next one is `calls + 1`); held for a whole exchange, so one
    /// rank's exchanges never overlap.
    calls: Mutex<u64>,
    timeout: Duration,
    /// Set by an exchange that failed (a rank missing, a corrupt entry): the ranks are out of
    /// step on the board from then on, so every later exchange fails at once with this.
    broken: std::sync::OnceLock<Error>,
}

impl HostBoard {
    /// Collective over `boot`: `Some` on every rank when every rank mapped the board, `None` on
    /// every rank otherwise (they then exchange through the bootstrap).
    pub(crate) fn open(boot: &Bootstrap, dir: &Path) -> Result<Option<HostBoard>> {
        let (rank, nranks) = (boot.rank() as usize, boot.nranks() as usize);
        if nranks < 2 {
            return Ok(None);
        }
        let len = 2 * nranks * SLOT_BYTES;
        let created = match rank {
            0 => Some(Segment::create(dir, SegmentKind::Board, len)),
            _ => None,
        };
        let name = match &created {
            Some(Ok(seg)) => seg.path().as_os_str().as_encoded_bytes().to_vec(),
            _ => Vec::new(),
        };
        let names = boot.allgather(&name).map_err(|e| e.context("sharing the collective exchange board"))?;
        let seg = match created {
            Some(seg) => seg,
            None if names[0].is_empty() => Err(Error::new(Status::NoResource, "rank 0 could not create the board")),
            None => {
                let path = std::path::PathBuf::from(String::from_utf8_lossy(&names[0]).into_owned());
                Segment::open(&path, SegmentKind::Board)
            }
        };
        let seg = seg.and_then(|s| match s.payload_len() >= len {
            true => Ok(s),
            false => Err(Error::new(Status::InvalidAddress, "the board is smaller than this communicator needs")),
        });
        if let Err(e) = &seg {
            tracing::debug!(target: "gsc::coll", error = %e, "no shared exchange board on this rank; every rank exchanges through the bootstrap");
        }
        let verdicts = boot.allgather(&[u8::from(seg.is_ok())]).map_err(|e| e.context("agreeing on the exchange board"))?;
        if rank == 0
            && let Ok(s) = &seg
        {
            // Every rank that could open it has: the mappings outlive the name.
            let _ = s.unlink();
        }
        if verdicts.iter().any(|v| v.as_slice() != [1]) {
            return Ok(None);
        }
        Ok(Some(HostBoard {
            seg: seg.expect("checked by the verdicts"),
            rank,
            nranks,
            calls: Mutex::new(0),
            timeout: boot.timeout(),
            broken: Default::default(),
        }))
    }

    /// Every rank's `mine`, indexed by rank (an allgather); `boot` carries a call whose entry
    /// some rank could not fit. Collective: every rank makes the same sequence of calls. After
    /// a failed exchange the board is out of step, and every later call fails with that error.
    pub(crate) fn allgather(&self, boot: &Bootstrap, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let mut calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = self.broken.get() {
            return Err(e.clone());
        }
        let call = *calls + 1;
        *calls = call;
        let result = self.exchange(call, mine).and_then(|gathered| match gathered {
            Some(all) => Ok(all),
            // Some rank's entry did not fit: every rank sees the mark and goes through the
            // bootstrap, with `calls` still held so this rank's exchanges stay in order.
            None => boot.allgather(mine),
        });
        if let Err(e) = &result {
            let _ = self.broken.set(e.clone().context("an earlier exchange on the communicator's board failed"));
        }
        result
    }

    /// Call `call`'s exchange on the board; `None`: some rank's entry is marked too big.
    fn exchange(&self, call: u64, mine: &[u8]) -> Result<Option<Vec<Vec<u8>>>> {
        let parity = (call & 1) as usize;
        // SAFETY: our own slot of this parity: no peer reads it until we publish `call`, and
        // it was last read in call `call - 2`, which every peer finished before publishing
        // `call - 1`, which we saw (module note; a failed call breaks the board first).
        unsafe {
            let slot = self.slot(parity, self.rank);
            let fits = mine.len() <= ENTRY_MAX;
            if fits {
                std::ptr::copy_nonoverlapping(mine.as_ptr(), slot.add(SLOT_HEAD), mine.len());
            }
            len_word(slot).store(if fits { mine.len() as u64 } else { OVERSIZE }, Ordering::Relaxed);
            seq_word(slot).store(call, Ordering::Release);
        }
        let start = Instant::now();
        let mut all = vec![Vec::new(); self.nranks];
        let mut oversize = false;
        for (q, out) in all.iter_mut().enumerate() {
            let slot = self.slot(parity, q);
            // SAFETY: a slot inside the mapping; its words are only accessed atomically.
            let (seq, len) = unsafe { (seq_word(slot), len_word(slot)) };
            let mut spins = 0u32;
            while seq.load(Ordering::Acquire) != call {
                let waited = start.elapsed();
                if waited >= self.timeout {
                    return Err(Error::new(
                        Status::TimedOut,
                        format!("rank {q} did not reach the communicator's exchange (call {call}) within {waited:?}"),
                    ));
                }
                spins = spins.wrapping_add(1);
                if waited >= WARM_SPIN {
                    std::thread::sleep(COLD_POLL);
                } else if waited >= HOT_SPIN && spins.is_multiple_of(64) {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
            match len.load(Ordering::Relaxed) {
                OVERSIZE => oversize = true,
                n if n as usize <= ENTRY_MAX => {
                    // SAFETY: `n` bytes of q's entry, complete before its Release of `call`.
                    *out = unsafe { std::slice::from_raw_parts(slot.add(SLOT_HEAD), n as usize) }.to_vec();
                }
                n => return Err(Error::new(Status::ConnectionReset, format!("rank {q}'s board entry claims {n} bytes"))),
            }
        }
        Ok((!oversize).then_some(all))
    }

    fn slot(&self, parity: usize, rank: usize) -> *mut u8 {
        debug_assert!(rank < self.nranks);
        // SAFETY: `open` checked the payload holds 2 × nranks slots.
        unsafe { self.seg.payload().add((parity * self.nranks + rank) * SLOT_BYTES) }
    }
}

/// The sequence word at the start of a slot.
///
/// # Safety
/// `slot` is a slot of a live board (64-byte aligned: the payload is, and slots are 4 KiB).
unsafe fn seq_word<'a>(slot: *mut u8) -> &'a AtomicU64 {
    // SAFETY: the caller's promise; shared memory, so accessed only atomically.
    unsafe { &*slot.cast::<AtomicU64>() }
}

/// The entry-length word after the sequence word.
///
/// # Safety
/// As `seq_word`.
unsafe fn len_word<'a>(slot: *mut u8) -> &'a AtomicU64 {
    // SAFETY: the caller's promise; 8 bytes into the slot's head line.
    unsafe { &*slot.add(8).cast::<AtomicU64>() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::UniqueId;

    /// `n` ranks, one thread each, running `f` on their board and bootstrap.
    fn on_ranks<T: Send + 'static>(n: u32, f: impl Fn(u32, &HostBoard, &Bootstrap) -> T + Send + Sync + 'static) -> Vec<T> {
        let uid = UniqueId::create(Some("127.0.0.1".parse().unwrap())).unwrap();
        let f = std::sync::Arc::new(f);
        let dir = std::env::temp_dir();
        let threads: Vec<_> = (0..n)
            .map(|r| {
                let (uid, f, dir) = (uid.clone(), f.clone(), dir.clone());
                std::thread::spawn(move || {
                    let boot = Bootstrap::init(&uid, r, n, Duration::from_secs(20)).unwrap();
                    let board = HostBoard::open(&boot, &dir).unwrap().expect("every rank maps the board");
                    f(r, &board, &boot)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    #[test]
    fn every_call_gathers_every_rank_entry_of_that_call() {
        let n = 4;
        let results = on_ranks(n, move |r, board, boot| {
            for call in 0..500u32 {
                // Sizes differ per rank and call, including empty entries.
                let mine: Vec<u8> = (0..(r + call) % 37).map(|i| (r * 31 + call + i) as u8).collect();
                if call % 97 == (r * 13) % 97 {
                    std::thread::sleep(Duration::from_millis(2)); // a late rank now and then
                }
                let all = board.allgather(boot, &mine).unwrap();
                for q in 0..n {
                    let want: Vec<u8> = (0..(q + call) % 37).map(|i| (q * 31 + call + i) as u8).collect();
                    assert_eq!(all[q as usize], want, "call {call}, rank {r}'s view of rank {q}");
                }
            }
        });
        assert_eq!(results.len(), n as usize);
    }

    #[test]
    fn an_entry_too_big_for_the_board_goes_through_the_bootstrap_on_every_rank() {
        on_ranks(3, |r, board, boot| {
            let big = vec![r as u8; if r == 1 { ENTRY_MAX + 1 } else { 10 }];
            let all = board.allgather(boot, &big).unwrap();
            assert_eq!(all[1].len(), ENTRY_MAX + 1);
            assert_eq!(all[0], vec![0u8; 10]);
            // And the board goes on working after it.
            let all = board.allgather(boot, &[r as u8]).unwrap();
            assert_eq!(all, vec![vec![0], vec![1], vec![2]]);
        });
    }

    #[test]
    fn a_missing_rank_is_a_timeout_naming_it_and_breaks_the_board() {
        let uid = UniqueId::create(Some("127.0.0.1".parse().unwrap())).unwrap();
        let dir = std::env::temp_dir();
        let threads: Vec<_> = (0..2u32)
            .map(|r| {
                let (uid, dir) = (uid.clone(), dir.clone());
                std::thread::spawn(move || {
                    let boot = Bootstrap::init(&uid, r, 2, Duration::from_millis(300)).unwrap();
                    let board = HostBoard::open(&boot, &dir).unwrap().unwrap();
                    board.allgather(&boot, b"first").unwrap();
                    // Rank 1 stops exchanging; rank 0 makes one more call.
                    if r != 0 {
                        return String::new();
                    }
                    let first = board.allgather(&boot, b"second").unwrap_err().to_string();
                    // The board is out of step now: a later exchange fails at once.
                    let t = Instant::now();
                    let again = board.allgather(&boot, b"third").unwrap_err().to_string();
                    assert!(t.elapsed() < Duration::from_millis(100), "{:?}", t.elapsed());
                    format!("{first}\n{again}")
                })
            })
            .collect();
        let msgs: Vec<String> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(msgs[0].contains("rank 1 did not reach"), "{}", msgs[0]);
        assert!(msgs[0].contains("an earlier exchange on the communicator's board failed"), "{}", msgs[0]);
    }
}
