//! A prepared pair's shared words: one page both processes map (a segment of kind
//! `PrepWords`), holding two 64-bit words that only ever grow.
//!
//! - `ready`: the receiver raises it to `k` when its buffer is free for round `k` (instead of a
//!   `PrepReady` frame); the sender's worker polls it beside its trigger words.
//! - `arrived`: the sender raises it to `k` once round `k`'s direct write is complete and
//!   visible (its copy stream writes it after the copy, with the default memory barrier, or the
//!   worker stores it after a CPU write); the receiver's worker polls it (instead of waiting
//!   for the announcing `PrepData` frame).
//!
//! The sender creates the page (so it can register it with CUDA on its user thread, before any
//! stream may wait on its proxy) and announces its path in its hello; the receiver maps it at
//! pairing. Each word has a cache line of its own: each side writes one and polls the other,
//! and sharing a line would bounce it on every write. Round numbers, not flags: nothing is ever
//! reset, so a late or repeated write can only restate a value already passed (the words are
//! raised with `fetch_max`, so a CPU raise racing a GPU write of the same round, or a stale one,
//! never lowers them).

use super::segment::{Segment, SegmentKind};
use crate::error::{Error, Result, Status};
use std::mem::{ManuallyDrop, offset_of, size_of};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

#[repr(C, align(64))]
struct Line {
    word: AtomicU64,
}

/// The page's payload (after the segment header).
#[repr(C)]
struct Layout {
    ready: Line,
    arrived: Line,
}

const _: () = assert!(size_of::<Line>() == 64);
const _: () = assert!(offset_of!(Layout, ready) == 0 && offset_of!(Layout, arrived) == 64);
const _: () = assert!(size_of::<Layout>() == 128);

/// Which word.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Word {
    Ready,
    Arrived,
}

/// One mapping of a pair's word page.
#[derive(Debug)]
pub struct WordPage {
    seg: ManuallyDrop<Segment>,
    /// Registered with CUDA: dropping only removes the name, the mapping stays (`keep_mapped`).
    keep: bool,
}

impl WordPage {
    /// Create a page in `dir` (the sender). Both words start at 0: round numbers start at 1.
    pub fn create(dir: &Path) -> Result<WordPage> {
        let seg = Segment::create(dir, SegmentKind::PrepWords, size_of::<Layout>())?;
        Ok(WordPage { seg: ManuallyDrop::new(seg), keep: false })
    }

    /// Map the page the peer announced (the receiver). Only a segment of our kind, owned by
    /// our uid, of the right size is accepted (`Segment::open` checks the rest).
    pub fn open(path: &Path) -> Result<WordPage> {
        let seg = Segment::open(path, SegmentKind::PrepWords)?;
        if seg.payload_len() < size_of::<Layout>() {
            return Err(Error::new(Status::InvalidAddress, format!("{}: too small for shared words", path.display())));
        }
        Ok(WordPage { seg: ManuallyDrop::new(seg), keep: false })
    }

    /// Never unmap this page (it was registered with CUDA, and a stream may still write into
    /// it): dropping the handle then only removes the file name.
    pub fn keep_mapped(&mut self) {
        self.keep = true;
    }

    pub fn path(&self) -> &Path {
        self.seg.path()
    }

    /// Remove the file name (the receiver mapped it; mappings stay valid).
    pub fn unlink(&self) -> Result<bool> {
        self.seg.unlink()
    }

    fn layout(&self) -> &Layout {
        // SAFETY: the payload is at least `size_of::<Layout>()` bytes (checked at create and
        // open), 64-byte aligned, mapped for `self`'s life, and `Layout` is only atomics.
        unsafe { &*self.seg.payload().cast::<Layout>() }
    }

    pub fn word(&self, w: Word) -> &AtomicU64 {
        match w {
            Word::Ready => &self.layout().ready.word,
            Word::Arrived => &self.layout().arrived.word,
        }
    }

    /// The word's current value (Acquire: what was written before it was raised is visible).
    pub fn load(&self, w: Word) -> u64 {
        self.word(w).load(Ordering::Acquire)
    }

    /// Raise the word to `value` unless it is already there (Release: what this process wrote
    /// before, or wrote into the peer by CMA, is visible to whoever sees the new value).
    pub fn raise(&self, w: Word, value: u64) {
        self.word(w).fetch_max(value, Ordering::AcqRel);
    }

    /// Host address of the word inside the mapping: where a device address of a registration
    /// of `mapping()` points for it.
    pub fn offset_of(&self, w: Word) -> usize {
        let base = self.seg.mapping().0 as usize;
        self.word(w) as *const AtomicU64 as usize - base
    }

    /// The whole mapping, page aligned (what `cuMemHostRegister` takes).
    pub fn mapping(&self) -> (*mut u8, usize) {
        self.seg.mapping()
    }
}

impl Drop for WordPage {
    fn drop(&mut self) {
        if self.keep {
            let _ = self.seg.unlink();
            return;
        }
        // SAFETY: dropped exactly once, here; `seg` is not used after.
        unsafe { ManuallyDrop::drop(&mut self.seg) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::shm::testutil::TestDir;

    #[test]
    fn two_mappings_see_each_others_words_and_words_never_go_down() {
        let dir = TestDir::new("words");
        let sender = WordPage::create(dir.path()).unwrap();
        let receiver = WordPage::open(sender.path()).unwrap();
        assert_eq!((receiver.load(Word::Ready), receiver.load(Word::Arrived)), (0, 0));
        receiver.raise(Word::Ready, 1);
        assert_eq!(sender.load(Word::Ready), 1);
        sender.raise(Word::Arrived, 1);
        assert_eq!(receiver.load(Word::Arrived), 1);
        receiver.raise(Word::Ready, 3);
        receiver.raise(Word::Ready, 2);
        assert_eq!(sender.load(Word::Ready), 3, "a late raise of an older round changes nothing");
        assert_eq!(sender.load(Word::Arrived), 1, "the words are independent");
        let (base, len) = sender.mapping();
        assert_eq!(base as usize % 4096, 0, "registration needs the page start");
        assert!(len >= 64 + 128);
        assert_eq!(sender.offset_of(Word::Ready), 64);
        assert_eq!(sender.offset_of(Word::Arrived), 128);
    }

    #[test]
    fn only_word_pages_open_as_word_pages() {
        let dir = TestDir::new("words");
        let raw = Segment::create(dir.path(), SegmentKind::Raw, 4096).unwrap();
        assert_eq!(WordPage::open(raw.path()).unwrap_err().status(), Status::InvalidAddress);
        assert!(WordPage::open(&dir.path().join("gsc-missing")).is_err());
        let page = WordPage::create(dir.path()).unwrap();
        let path = page.path().to_path_buf();
        let peer = WordPage::open(&path).unwrap();
        assert!(peer.unlink().unwrap());
        page.raise(Word::Arrived, 7);
        assert_eq!(peer.load(Word::Arrived), 7, "the mappings outlive the name");
        drop(page);
        assert!(!path.exists());
        let mut kept = WordPage::create(dir.path()).unwrap();
        let kept_path = kept.path().to_path_buf();
        let reader = WordPage::open(&kept_path).unwrap();
        kept.keep_mapped();
        drop(kept);
        assert!(!kept_path.exists(), "a kept page loses its name");
        reader.raise(Word::Ready, 1);
        assert_eq!(reader.load(Word::Ready), 1);
    }
}
