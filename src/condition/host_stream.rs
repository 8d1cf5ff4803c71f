//! The host stream: an ordered queue of CPU work with CUDA-stream semantics.
//!
//! It plays the part of a GPU stream on machines without one (and in CI): items run one after
//! another on the stream's own thread, and an operation issued on it becomes exactly what a CUDA
//! stream gets, a write of the trigger word and a wait on the done word. So the proxy, the
//! channels and the protocols run the same code for both; only the producer differs.

use super::channel::{Channel, DONE_ERROR_BIT};
use crate::error::{Error, Result, Status};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Work queued on a host stream.
pub(crate) enum Item {
    /// Write `value` to the channel's trigger word (like `cuStreamWriteValue64`).
    Trigger(Arc<Channel>, u64),
    /// Wait until the channel's done word is `>= value` (like `cuStreamWaitValue64(GEQ)`).
    Wait(Arc<Channel>, u64),
    /// User work (`gsc_host_stream_launch`).
    Host(Box<dyn FnOnce() + Send>),
}

/// An ordered CPU queue. Cloning gives another handle to the same stream.
#[derive(Clone)]
pub struct HostStream {
    handle: Arc<Handle>,
}

/// What user handles share; its drop (the last handle gone) tells the thread to finish up.
struct Handle {
    inner: Arc<Inner>,
    _thread: JoinHandle<()>,
}

pub(crate) struct Inner {
    queue: Mutex<Queue>,
    /// Signaled when work is queued, when an item finishes, and at shutdown.
    changed: Condvar,
}

#[derive(Default)]
struct Queue {
    items: VecDeque<Item>,
    /// Items queued / finished since creation: `synchronize` waits for `finished` to catch up.
    queued: u64,
    finished: u64,
    /// A wait ended on a failed operation, or user work panicked; reported by `synchronize`.
    error: Option<Error>,
    stop: bool,
}

impl HostStream {
    pub fn new() -> Result<HostStream> {
        let inner = Arc::new(Inner { queue: Mutex::default(), changed: Condvar::new() });
        let shared = inner.clone();
        let thread = std::thread::Builder::new()
            .name("gsc-host-stream".into())
            .spawn(move || run(&shared))
            .map_err(|e| Error::new(Status::NoResource, format!("cannot start a host stream thread: {e}")))?;
        Ok(HostStream { handle: Arc::new(Handle { inner, _thread: thread }) })
    }

    /// Queue user work; it runs after everything queued before it.
    pub fn launch(&self, f: impl FnOnce() + Send + 'static) {
        self.push_all([Item::Host(Box::new(f))]);
    }

    /// Wait until everything queued so far has run. Reports (and clears) the first failure since
    /// the last synchronize: a wait released by a failed operation, or user work that panicked.
    pub fn synchronize(&self, timeout: Option<Duration>) -> Result<()> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut q = self.handle.inner.lock();
        let target = q.queued;
        while q.finished < target {
            let slice = Duration::from_millis(50);
            let wait = match deadline {
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Err(Error::new(
                            Status::TimedOut,
                            format!("host stream still has {} item(s) to run after {:?}", target - q.finished, timeout.unwrap_or_default()),
                        ));
                    }
                    (d - now).min(slice)
                }
                None => slice,
            };
            q = self.handle.inner.changed.wait_timeout(q, wait).unwrap_or_else(|e| e.into_inner()).0;
        }
        match q.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Queue items for an operation (its trigger, maybe its wait) as one unit.
    pub(crate) fn push_all(&self, items: impl IntoIterator<Item = Item>) {
        let mut q = self.handle.inner.lock();
        for item in items {
            q.items.push_back(item);
            q.queued += 1;
        }
        drop(q);
        self.handle.inner.changed.notify_all();
    }

    /// True when both handles name the same stream.
    pub fn same_as(&self, other: &HostStream) -> bool {
        Arc::ptr_eq(&self.handle, &other.handle)
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // The last user handle is gone. Like cudaStreamDestroy, this returns at once: the thread
        // finishes what is queued (a wait ends when its operation completes or fails) and exits.
        self.inner.lock().stop = true;
        self.inner.changed.notify_all();
    }
}

/// The stream's thread: runs items in order until told to stop and the queue is empty.
fn run(inner: &Inner) {
    loop {
        let item = {
            let mut q = inner.lock();
            loop {
                if let Some(item) = q.items.pop_front() {
                    break Some(item);
                }
                if q.stop {
                    break None;
                }
                q = inner.changed.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        let Some(item) = item else { return };
        let failure = execute(item);
        let mut q = inner.lock();
        q.finished += 1;
        if let Some(e) = failure {
            q.error.get_or_insert(e);
        }
        drop(q);
        inner.changed.notify_all();
    }
}

fn execute(item: Item) -> Option<Error> {
    match item {
        Item::Trigger(channel, value) => {
            channel.words.trigger().fetch_max(value, Ordering::AcqRel);
            None
        }
        Item::Wait(channel, value) => {
            channel.wait_done(value, None);
            if channel.done_word() & DONE_ERROR_BIT != 0 {
                Some(channel.error().unwrap_or_else(|| Error::new(Status::Canceled, "operation failed")))
            } else {
                None
            }
        }
        Item::Host(f) => match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            Ok(()) => None,
            Err(_) => Some(Error::new(Status::Internal, "work launched on a host stream panicked")),
        },
    }
}
