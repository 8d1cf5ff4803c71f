//! The worker's side of shared words for prepared pairs (protocols/prepared.rs, module doc;
//! the page itself is transport/shm/words.rs): which pages this worker maps, polling them, and
//! raising its own words.
//!
//! A send makes its page at prepare, on the user's thread (`SendPage::make`): for a GPU buffer
//! it also registers the page with CUDA there, so the copy stream can write "arrived" after the
//! copy; a registration the driver refuses leaves the worker to store the word after the copy's
//! event instead (still no frame). A receive maps the sender's page at pairing (`map_recv`, on
//! whichever thread progresses; no CUDA call). Each progress pass loads the word each mapped
//! page's peer writes and reports a move to the engine.
//!
//! Registered pages are never unregistered or unmapped (`cuda::register_host`: unregistering
//! could wait for the device while a stream waits on gscomm): dropping one only removes its
//! name. So that a process preparing and releasing GPU sends in a loop does not pin a page per
//! send forever, at most `MAX_REGISTERED_PAGES` are registered per process; later GPU sends
//! still get a page, unregistered, and the worker stores "arrived" after each copy's event.

use crate::config::Tristate;
use crate::error::{Error, Result, Status};
use crate::log::timeline::{self, Event};
use crate::protocols::prepared::{PrepDir, PrepId, PreparedEngine};
use crate::protocols::{Actions, ConnId};
use crate::transport::shm::words::{Word, WordPage};
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Pages a process registers with CUDA at most (4 KiB each, kept until exit): enough for every
/// prepared GPU send a program keeps at once in practice (a halo exchange has a few dozen).
const MAX_REGISTERED_PAGES: usize = 256;
static REGISTERED_PAGES: AtomicUsize = AtomicUsize::new(0);

/// Take one of the process's registrations; false when all are taken.
fn take_registration() -> bool {
    REGISTERED_PAGES.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < MAX_REGISTERED_PAGES).then_some(n + 1)).is_ok()
}

/// A send's page, made before its preparation is announced.
pub(crate) struct SendPage {
    page: WordPage,
    /// Device address of the "arrived" word (the page is registered with CUDA).
    arrived_dev: Option<u64>,
}

impl SendPage {
    /// Make a send's page in `dir`; `cuda_device`: the GPU of a GPU send buffer, whose copy
    /// stream will write "arrived". `Ok(None)`: shared words are off. Under `auto` a failure is
    /// logged and gives `Ok(None)` (frames); under `on` it is the preparation's error.
    pub(crate) fn make(mode: Tristate, dir: &Path, cuda_device: Option<i32>) -> Result<Option<SendPage>> {
        if mode == Tristate::Off {
            return Ok(None);
        }
        let made = (|| -> Result<SendPage> {
            let mut page = WordPage::create(dir)?;
            let arrived_dev = match cuda_device {
                Some(_) if !take_registration() => {
                    tracing::debug!(target: "gsc::core", "{MAX_REGISTERED_PAGES} shared word pages registered already; \
                                    the proxy writes 'arrived' after each copy of this send");
                    None
                }
                Some(device) => {
                    let (host, len) = page.mapping();
                    // SAFETY: the page's mapping, never unmapped once registered (marked
                    // `keep_mapped` below).
                    match unsafe { crate::cuda::register_host(device, host, len) } {
                        Ok(dev) => {
                            // Registered: never unmapped from now on (a copy stream may write
                            // into it, and unregistering could wait for the device).
                            page.keep_mapped();
                            Some(dev + page.offset_of(Word::Arrived) as u64)
                        }
                        Err(e) if mode == Tristate::On => {
                            REGISTERED_PAGES.fetch_sub(1, Ordering::AcqRel);
                            return Err(e.context("registering a shared word page"));
                        }
                        Err(e) => {
                            REGISTERED_PAGES.fetch_sub(1, Ordering::AcqRel);
                            // Still no frame: the worker stores the word after the copy's event.
                            tracing::info!(target: "gsc::core", error = %e, "shared word page not registered with CUDA; \
                                           the proxy writes 'arrived' after each copy");
                            None
                        }
                    }
                }
                None => None,
            };
            Ok(SendPage { page, arrived_dev })
        })();
        match made {
            Ok(p) => Ok(Some(p)),
            Err(e) if mode == Tristate::On => Err(e),
            Err(e) => {
                tracing::info!(target: "gsc::core", error = %e, "no shared word page for a prepared send; its rounds use frames");
                Ok(None)
            }
        }
    }

    pub(crate) fn path(&self) -> String {
        self.page.path().to_string_lossy().into_owned()
    }
}

struct Entry {
    page: WordPage,
    dir: PrepDir,
    /// The peer's word as last reported to the engine.
    seen: u64,
    arrived_dev: Option<u64>,
}

/// The pages a worker maps, by preparation.
pub(crate) struct PrepWords {
    pages: HashMap<PrepId, Entry>,
    /// `GSC_PREP_WORDS`: with `off`, a receive refuses the sender's page.
    pub(crate) mode: Tristate,
}

impl PrepWords {
    pub(crate) fn new(mode: Tristate) -> PrepWords {
        PrepWords { pages: HashMap::new(), mode }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// Send preparation `id` announced `page`.
    pub(crate) fn add_send(&mut self, id: PrepId, page: SendPage) {
        let SendPage { page, arrived_dev } = page;
        self.pages.insert(id, Entry { page, dir: PrepDir::Send, seen: 0, arrived_dev });
    }

    /// Receive preparation `id` paired with a send that announced its page at `path`.
    pub(crate) fn map_recv(&mut self, id: PrepId, path: &str) -> Result<()> {
        if self.mode == Tristate::Off {
            return Err(Error::new(Status::Unsupported, "GSC_PREP_WORDS=off"));
        }
        let page = WordPage::open(Path::new(path))?;
        let seen = page.load(Word::Arrived);
        self.pages.insert(id, Entry { page, dir: PrepDir::Recv, seen, arrived_dev: None });
        Ok(())
    }

    /// Receive `id` is ready for `round`. False: it has no page (it went to frames).
    pub(crate) fn raise_ready(&self, id: PrepId, round: u64) -> bool {
        match self.pages.get(&id) {
            Some(e) if e.dir == PrepDir::Recv => {
                e.page.raise(Word::Ready, round);
                timeline::record(Event::WordReady, round);
                true
            }
            _ => false,
        }
    }

    /// Device address of send `id`'s "arrived" word, where its page is registered.
    pub(crate) fn arrived_device_word(&self, id: PrepId) -> Option<u64> {
        self.pages.get(&id).and_then(|e| e.arrived_dev)
    }

    /// Send `id`'s round `round` is written (and visible): raise "arrived" from the CPU.
    pub(crate) fn raise_arrived(&self, id: PrepId, round: u64) {
        if let Some(e) = self.pages.get(&id).filter(|e| e.dir == PrepDir::Send) {
            e.page.raise(Word::Arrived, round);
            timeline::record(Event::WordWrite, round);
        }
    }

    /// Load the word each page's peer writes and report moves to `engine`. Returns the number
    /// of moves, and a protocol violation with the link it came on (the caller fails the link).
    pub(crate) fn poll(&mut self, engine: &mut PreparedEngine, out: &mut Actions) -> (usize, Option<(ConnId, Error)>) {
        let mut moves = 0;
        for (&id, e) in self.pages.iter_mut() {
            let word = match e.dir {
                PrepDir::Send => Word::Ready,
                PrepDir::Recv => Word::Arrived,
            };
            let v = e.page.load(word);
            if v <= e.seen {
                continue;
            }
            let first = e.seen == 0;
            e.seen = v;
            moves += 1;
            let result = match e.dir {
                PrepDir::Send => {
                    timeline::record(Event::WordSeen, v);
                    if first {
                        // The receiver mapped the page: its name is no longer needed.
                        let _ = e.page.unlink();
                    }
                    engine.ready_word(out, id, v)
                }
                PrepDir::Recv => {
                    timeline::record(Event::WordArrived, v);
                    engine.arrived_word(out, id, v)
                }
            };
            if let Err(err) = result {
                let conn = engine.spec(id).map(|s| s.conn);
                if let Some(conn) = conn {
                    return (moves, Some((conn, err)));
                }
            }
        }
        (moves, None)
    }

    /// Forget pages of preparations the engine no longer has (released).
    pub(crate) fn sweep(&mut self, engine: &PreparedEngine) {
        self.pages.retain(|id, _| engine.spec(*id).is_some());
    }
}
