//! Memory windows: buffers every rank of a communicator registers together (NCCL 2.27's
//! `ncclCommWindowRegister`), so that a collective on them needs no exchange.
//!
//! An eager call on the peers' own buffers (the direct kernel, the copy engines) must learn
//! where each peer's buffers are: the ranks exchange addresses and keys and agree on the path,
//! two host round trips per call (`peer_buffers::exchange`), and the host of every rank waits
//! for the slowest. A window moves that to registration: each rank offers its buffer's
//! address, size and key once, every rank maps the others' (`cuda::ipc`, cached), and all of
//! them learn whether everyone managed. A *symmetric* window (`NCCL_WIN_COLL_SYMMETRIC`) adds
//! NCCL's promise: a collective's buffers lie at the same offset in every rank's window. A
//! call whose buffers lie in symmetric windows then finds every peer's buffers here, at that
//! offset, without asking anyone — as a call replayed from a graph does — and every rank
//! comes to the same decision on its own, because every rank holds the same windows (they are
//! registered collectively, in the same order) and the offsets are the same by the promise.
//!
//! What keeps that decision the same on every rank beyond the promise is decided at
//! registration, from every rank's offer: a window serves calls only up to the smallest size
//! any rank registered (`span`), and only if every rank's base is 16-byte aligned (`fast`; the
//! direct kernel moves 16-byte pieces, so an offset that suits one rank then suits all). A
//! program that breaks the promise (one rank's buffer in a window, another's not) leaves the
//! ranks on different paths; like NCCL, gscomm does not check it per call — that would cost
//! the exchange the window saves — and the ranks' kernels time out (`GSC_TIMEOUT`).

use super::peer_buffers::DirectKind;
use crate::error::{Error, Result, Status};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// A registered window, as `Communicator::register_window` returns it: the handle
/// `deregister_window` takes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Window {
    /// Unique within the communicator (never reused), so a stale copy is refused.
    pub id: u64,
    pub addr: u64,
    pub bytes: usize,
    /// Registered as symmetric (`NCCL_WIN_COLL_SYMMETRIC`): collectives may rely on the same
    /// offset on every rank.
    pub symmetric: bool,
}

/// What every peer's base must be aligned to for a symmetric window to serve calls: the
/// direct kernel's 16-byte pieces (see the module doc).
const FAST_ALIGN: u64 = 16;

/// One registered window with what registration learnt from every rank.
struct Entry {
    window: Window,
    /// Every rank's window base as this rank addresses it (its own at its rank).
    bases: Vec<u64>,
    /// The smallest size any rank registered: offsets beyond it do not exist everywhere.
    span: usize,
    /// Symmetric, and every rank's base on `FAST_ALIGN`.
    fast: bool,
}

impl Entry {
    /// The offset of `[addr, addr + len)` in this window, if it lies within `span`.
    fn offset_of(&self, addr: u64, len: usize) -> Option<u64> {
        let off = addr.checked_sub(self.window.addr)?;
        (off.checked_add(len as u64)? <= self.span as u64).then_some(off)
    }
}

/// A communicator's windows.
#[derive(Default)]
pub(crate) struct Windows {
    entries: Mutex<Vec<Entry>>,
    next_id: AtomicU64,
    /// Calls that found their peers' buffers here.
    hits: AtomicU64,
}

impl Windows {
    /// Keep a window every rank registered, with every rank's base (as this rank addresses
    /// it) and offer.
    pub(crate) fn insert(&self, mine: &Offer, bases: Vec<u64>, agreed: &Agreed) -> Window {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let window = Window { id, addr: mine.addr, bytes: mine.bytes, symmetric: agreed.symmetric };
        let entry = Entry { window, bases, span: agreed.span, fast: agreed.symmetric && agreed.aligned };
        self.entries.lock().unwrap_or_else(|e| e.into_inner()).push(entry);
        window
    }

    /// Forget `w`; a window this communicator does not hold (deregistered already, or from
    /// another communicator) is an error and changes nothing.
    pub(crate) fn remove(&self, w: &Window) -> Result<()> {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let i = entries
            .iter()
            .position(|e| e.window == *w)
            .ok_or_else(|| Error::invalid_param("the window is not registered with this communicator (deregistered already?)"))?;
        entries.remove(i);
        Ok(())
    }

    /// Every rank's (send, recv) for a call of `kind` with `part` bytes per part on `n` ranks,
    /// as this rank addresses them (its own at `rank`), when both of this rank's buffers lie
    /// in symmetric windows that serve calls (`Entry::fast`); `None` otherwise. Asks no peer:
    /// by the symmetric promise every rank answers alike.
    pub(crate) fn symmetric_buffers(
        &self,
        kind: DirectKind,
        send: u64,
        recv: u64,
        n: usize,
        part: usize,
        rank: usize,
    ) -> Option<Vec<(u64, u64)>> {
        let (send_len, recv_len) = kind.buffer_bytes(n, part);
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let find = |addr: u64, len: usize| {
            // The latest registration first: a window registered over an older one wins.
            entries.iter().rev().filter(|e| e.fast).find_map(|e| Some((e, e.offset_of(addr, len)?)))
        };
        let (ws, send_off) = find(send, send_len)?;
        let (wr, recv_off) = find(recv, recv_len)?;
        if ws.bases.len() != n || wr.bases.len() != n {
            return None;
        }
        Some((0..n).map(|q| if q == rank { (send, recv) } else { (ws.bases[q] + send_off, wr.bases[q] + recv_off) }).collect())
    }

    /// Count a call that ran on buffers `symmetric_buffers` gave.
    pub(crate) fn note_hit(&self) {
        self.hits.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// What one rank offers at registration: its buffer and the key that opens it, or why it
/// cannot take part (so the others learn it, instead of waiting).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Offer {
    pub(crate) addr: u64,
    pub(crate) bytes: usize,
    pub(crate) symmetric: bool,
    /// `Err`: this rank's refusal, in words.
    pub(crate) key: std::result::Result<Vec<u8>, String>,
}

/// Longer keys or messages than this are a corrupt entry (keys are ~100 bytes).
const MAX_FIELD: usize = 4096;

impl Offer {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(32);
        v.extend_from_slice(&self.addr.to_le_bytes());
        v.extend_from_slice(&(self.bytes as u64).to_le_bytes());
        v.push(u8::from(self.symmetric));
        let (tag, body) = match &self.key {
            Ok(k) => (1u8, k.as_slice()),
            Err(m) => (0u8, &m.as_bytes()[..m.len().min(MAX_FIELD)]),
        };
        v.push(tag);
        v.extend_from_slice(&(body.len() as u32).to_le_bytes());
        v.extend_from_slice(body);
        v
    }

    /// The inverse of `encode`; a malformed entry is an error naming `rank` and the fault.
    pub(crate) fn decode(rank: usize, b: &[u8]) -> Result<Offer> {
        let bad = |what: &str| Error::new(Status::ConnectionReset, format!("rank {rank}'s window offer {what}"));
        if b.len() < 22 {
            return Err(bad("is cut short"));
        }
        let addr = u64::from_le_bytes(b[0..8].try_into().expect("8 bytes"));
        let bytes = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
        let symmetric = match b[16] {
            0 => false,
            1 => true,
            _ => return Err(bad("has an unknown flag")),
        };
        let len = u32::from_le_bytes(b[18..22].try_into().expect("4 bytes")) as usize;
        if len > MAX_FIELD || b.len() != 22 + len {
            return Err(bad("has a body of the wrong length"));
        }
        let body = &b[22..];
        let key = match b[17] {
            1 => Ok(body.to_vec()),
            0 => Err(String::from_utf8_lossy(body).into_owned()),
            _ => return Err(bad("has an unknown tag")),
        };
        let bytes = usize::try_from(bytes).map_err(|_| bad("has a size beyond this machine's"))?;
        Ok(Offer { addr, bytes, symmetric, key })
    }
}

/// What every rank's offer makes of a window.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Agreed {
    pub(crate) symmetric: bool,
    /// The smallest size any rank registered.
    pub(crate) span: usize,
    /// Every rank's base on `FAST_ALIGN`.
    pub(crate) aligned: bool,
}

/// The window every rank's offer makes, or the first problem, naming its rank: a rank that
/// refused (with its reason), or ranks that disagree on whether the window is symmetric.
/// Every rank sees the same offers, so every rank gets the same answer.
pub(crate) fn agree(offers: &[Offer]) -> Result<Agreed> {
    let first = offers.first().ok_or_else(|| Error::invalid_param("a window of no ranks"))?;
    for (r, o) in offers.iter().enumerate() {
        if let Err(why) = &o.key {
            return Err(Error::invalid_param(format!("rank {r} could not register its window: {why}")));
        }
        if o.symmetric != first.symmetric {
            let how = |s: bool| if s { "as symmetric" } else { "as not symmetric" };
            return Err(Error::invalid_param(format!(
                "rank {r} registered its window {}, rank 0 {}: every rank passes the same flags",
                how(o.symmetric),
                how(first.symmetric)
            )));
        }
    }
    Ok(Agreed {
        symmetric: first.symmetric,
        span: offers.iter().map(|o| o.bytes).min().unwrap_or(0),
        aligned: offers.iter().all(|o| o.addr.is_multiple_of(FAST_ALIGN)),
    })
}

/// A rank's verdict after mapping the peers' windows: empty when it managed, else why not.
pub(crate) fn encode_verdict(mapped: &Result<Vec<u64>>) -> Vec<u8> {
    match mapped {
        Ok(_) => Vec::new(),
        Err(e) => {
            let m = e.to_string();
            let mut v = m.into_bytes();
            v.truncate(MAX_FIELD);
            if v.is_empty() {
                v.push(b'?');
            }
            v
        }
    }
}

/// The first rank that could not map the others' windows, named with its reason.
pub(crate) fn check_verdicts(verdicts: &[Vec<u8>]) -> Result<()> {
    match verdicts.iter().enumerate().find(|(_, v)| !v.is_empty()) {
        None => Ok(()),
        Some((r, v)) => {
            Err(Error::new(Status::Unsupported, format!("rank {r} could not map its peers' windows: {}", String::from_utf8_lossy(v))))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer(addr: u64, bytes: usize, symmetric: bool) -> Offer {
        Offer { addr, bytes, symmetric, key: Ok(vec![7; 96]) }
    }

    /// Windows of three ranks whose bases are `bases` (as rank 0 addresses them), `bytes` each.
    fn table(bases: &[u64], sizes: &[usize], symmetric: bool) -> (Windows, Window) {
        let offers: Vec<Offer> = bases.iter().zip(sizes).map(|(&a, &b)| offer(a, b, symmetric)).collect();
        let agreed = agree(&offers).unwrap();
        let w = Windows::default();
        let win = w.insert(&offers[0], bases.to_vec(), &agreed);
        (w, win)
    }

    #[test]
    fn offers_round_trip_and_malformed_ones_name_the_rank() {
        for o in [offer(0x7000_0000, 1 << 20, true), Offer { addr: 1, bytes: 0, symmetric: false, key: Err("not GPU memory".into()) }] {
            assert_eq!(Offer::decode(3, &o.encode()).unwrap(), o);
        }
        let good = offer(0x1000, 64, false).encode();
        let mut flag = good.clone();
        flag[16] = 9;
        let mut tag = good.clone();
        tag[17] = 5;
        for bad in [vec![], good[..21].to_vec(), good[..good.len() - 1].to_vec(), [good.clone(), vec![0]].concat(), flag, tag] {
            let e = Offer::decode(2, &bad).unwrap_err().to_string();
            assert!(e.contains("rank 2's window offer"), "{e}");
        }
    }

    #[test]
    fn agreement_names_the_refusing_rank_and_disagreeing_flags() {
        let mut offers = vec![offer(0x1000, 4096, true), offer(0x2000, 8192, true), offer(0x3008, 4096, true)];
        let a = agree(&offers).unwrap();
        assert_eq!(a, Agreed { symmetric: true, span: 4096, aligned: false }, "rank 2's base is not on 16 bytes");
        offers[2].addr = 0x3000;
        assert!(agree(&offers).unwrap().aligned);
        offers[1].key = Err("the buffer is on GPU 3".into());
        let e = agree(&offers).unwrap_err().to_string();
        assert!(e.contains("rank 1 could not register its window: the buffer is on GPU 3"), "{e}");
        offers[1].key = Ok(vec![1]);
        offers[2].symmetric = false;
        let e = agree(&offers).unwrap_err().to_string();
        assert!(e.contains("rank 2 registered its window as not symmetric, rank 0 as symmetric"), "{e}");
        assert!(agree(&[]).is_err());
    }

    #[test]
    fn verdicts_name_the_first_rank_that_failed() {
        let ok = encode_verdict(&Ok(vec![1, 2]));
        let bad = encode_verdict(&Err(Error::invalid_param("peer access refused")));
        assert!(check_verdicts(&[ok.clone(), ok.clone()]).is_ok());
        let e = check_verdicts(&[ok, bad.clone(), bad]).unwrap_err().to_string();
        assert!(e.contains("rank 1 could not map its peers' windows") && e.contains("peer access refused"), "{e}");
    }

    #[test]
    fn calls_in_symmetric_windows_find_every_peer_at_the_same_offset() {
        let bases = [0x10_0000, 0xA0_0000, 0xB0_0000];
        let (w, win) = table(&bases, &[1 << 16, 1 << 16, 1 << 15], true);
        assert_eq!(win, Window { id: 0, addr: 0x10_0000, bytes: 1 << 16, symmetric: true });
        // An all-reduce of 4 KiB at offsets 0x100 (send) and 0x2000 (recv), seen from rank 0.
        let got = w.symmetric_buffers(DirectKind::AllReduce, 0x10_0100, 0x10_2000, 3, 4096, 0).unwrap();
        assert_eq!(got, vec![(0x10_0100, 0x10_2000), (0xA0_0100, 0xA0_2000), (0xB0_0100, 0xB0_2000)]);
        // An all-gather's receive buffer is n parts long; a reduce-scatter's send buffer too.
        let got = w.symmetric_buffers(DirectKind::AllGather, 0x10_0000, 0x10_1000, 3, 1024, 0).unwrap();
        assert_eq!(got[2], (0xB0_0000, 0xB0_1000));
        // The span is the smallest registration (rank 2's 32 KiB): past it, no window.
        assert!(w.symmetric_buffers(DirectKind::AllReduce, 0x10_0000 + (1 << 15) - 4096, 0x10_0000, 3, 4096, 0).is_some());
        assert!(w.symmetric_buffers(DirectKind::AllReduce, 0x10_0000 + (1 << 15) - 4080, 0x10_0000, 3, 4096, 0).is_none());
        assert!(w.symmetric_buffers(DirectKind::ReduceScatter, 0x10_0000 + (1 << 15) - 8192, 0x10_0000, 3, 4096, 0).is_none());
        // Outside, before, or another rank count: no.
        assert!(w.symmetric_buffers(DirectKind::AllReduce, 0x0F_F000, 0x10_0000, 3, 4096, 0).is_none());
        assert!(w.symmetric_buffers(DirectKind::AllReduce, 0x10_0000, 0x90_0000, 3, 4096, 0).is_none());
        assert!(w.symmetric_buffers(DirectKind::AllReduce, 0x10_0000, 0x10_0000, 2, 4096, 0).is_none());
        // Removed: no more; removed twice: refused.
        w.remove(&win).unwrap();
        assert!(w.symmetric_buffers(DirectKind::AllReduce, 0x10_0100, 0x10_2000, 3, 4096, 0).is_none());
        assert!(w.remove(&win).unwrap_err().to_string().contains("not registered with this communicator"));
        assert_eq!(w.len(), 0);
    }

    #[test]
    fn only_symmetric_aligned_windows_serve_calls() {
        let (w, _) = table(&[0x10_0000, 0x20_0000, 0x30_0000], &[1 << 16; 3], false);
        assert!(w.symmetric_buffers(DirectKind::AllReduce, 0x10_0000, 0x10_0000, 3, 4096, 0).is_none(), "not symmetric");
        let (w, _) = table(&[0x10_0000, 0x20_0008, 0x30_0000], &[1 << 16; 3], true);
        assert!(w.symmetric_buffers(DirectKind::AllReduce, 0x10_0000, 0x10_0000, 3, 4096, 0).is_none(), "a base off 16 bytes");
        // Send and receive in two windows; the later of two overlapping windows wins.
        let w = Windows::default();
        let a = [offer(0x10_0000, 1 << 20, true), offer(0x20_0000, 1 << 20, true)];
        let b = [offer(0x10_8000, 4096, true), offer(0x50_0000, 4096, true)];
        w.insert(&a[0], vec![0x10_0000, 0x20_0000], &agree(&a).unwrap());
        let inner = w.insert(&b[0], vec![0x10_8000, 0x50_0000], &agree(&b).unwrap());
        assert_eq!(inner.id, 1);
        let got = w.symmetric_buffers(DirectKind::AllReduce, 0x10_0000, 0x10_8000, 2, 4096, 0).unwrap();
        assert_eq!(got, vec![(0x10_0000, 0x10_8000), (0x20_0000, 0x50_0000)], "the receive buffer in the inner window");
    }
}
