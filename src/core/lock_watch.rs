//! Who took a worker's lock last, and where — so that a thread kept waiting for the lock can
//! say who is holding it.
//!
//! Why: the proxy thread beats the worker's shm heartbeat under the worker's lock (on purpose: a
//! worker deadlocked on its lock must fall silent). When a peer then reports "heartbeat stopped",
//! the question is which thread held the lock and in which call (issue #7's intermittent stall:
//! the proxy waited in a futex while the application thread ran). Every `Worker::lock` records
//! its caller's source location and thread here with three relaxed stores; the proxy's
//! heartbeat takes the lock through `LockHolder::wait_for`, which names the holder in a warning
//! once it has waited `WARN_AFTER`.

use std::panic::Location;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

/// How long a watched wait for the lock goes before it names the holder (a progress pass holds
/// it for microseconds; a heartbeat period is 1 s by default).
pub(crate) const WARN_AFTER: Duration = Duration::from_secs(2);

/// How long a watched wait sleeps between attempts (the heartbeat is not latency-critical).
const RETRY: Duration = Duration::from_micros(200);

/// The last taker of one lock.
#[derive(Default)]
pub(crate) struct LockHolder {
    site: AtomicPtr<Location<'static>>,
    /// The taker's kernel thread id (names it in /proc, and in the stall watcher's listing).
    tid: AtomicU64,
    /// Bumped by every take: a waiter that sees it unchanged over its wait knows one holder
    /// kept the lock all along.
    takes: AtomicU64,
}

thread_local! {
    static TID: u64 = {
        // SAFETY: gettid has no arguments and cannot fail.
        (unsafe { libc::syscall(libc::SYS_gettid) }) as u64
    };
}

impl LockHolder {
    /// Record that the calling thread just took the lock at `site`.
    #[inline]
    pub(crate) fn took(&self, site: &'static Location<'static>) {
        self.site.store(site as *const Location<'static> as *mut Location<'static>, Ordering::Relaxed);
        self.tid.store(TID.with(|t| *t), Ordering::Relaxed);
        self.takes.fetch_add(1, Ordering::Relaxed);
    }

    /// Take `lock` (a poisoned lock is taken as it is), recording the caller; after
    /// `WARN_AFTER` of waiting, warn once with the holder, naming `waiter` (what waits), and
    /// wait on.
    #[track_caller]
    pub(crate) fn wait_for<'a, T>(&self, lock: &'a Mutex<T>, waiter: &str) -> MutexGuard<'a, T> {
        let site = Location::caller();
        let first_try = Instant::now();
        let takes_then = self.takes.load(Ordering::Relaxed);
        loop {
            match lock.try_lock() {
                Ok(g) => {
                    self.took(site);
                    return g;
                }
                Err(TryLockError::Poisoned(e)) => {
                    self.took(site);
                    return e.into_inner();
                }
                Err(TryLockError::WouldBlock) => {}
            }
            if first_try.elapsed() >= WARN_AFTER {
                let same = self.takes.load(Ordering::Relaxed) == takes_then;
                tracing::warn!(
                    target: "gsc::core",
                    waiter,
                    holder = %self.describe(),
                    "the worker's lock has been held for {:?}{}",
                    first_try.elapsed(),
                    if same { " by one holder" } else { " (taken more than once meanwhile)" }
                );
                // Said: from here a blocking wait, which a polling one could keep missing the
                // lock behind threads that take it often.
                let g = lock.lock().unwrap_or_else(|e| e.into_inner());
                self.took(site);
                tracing::warn!(target: "gsc::core", waiter, waited = ?first_try.elapsed(), "the worker's lock is free again");
                return g;
            }
            std::thread::sleep(RETRY);
        }
    }

    /// The last taker: thread id and name, and the source location of its `lock` call.
    pub(crate) fn describe(&self) -> String {
        let site = self.site.load(Ordering::Relaxed);
        let tid = self.tid.load(Ordering::Relaxed);
        if site.is_null() {
            return "nobody has taken it".into();
        }
        // SAFETY: only `took` stores here, always a `&'static Location`.
        let site = unsafe { &*site };
        let name = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).map_or_else(|_| "gone".into(), |n| n.trim().to_string());
        format!("thread {tid} ({name}), taken at {}:{}", site.file(), site.line())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_holder_is_named_by_thread_and_call_site() {
        let holder = LockHolder::default();
        assert_eq!(holder.describe(), "nobody has taken it");
        let lock = Mutex::new(0u32);
        let line = line!() + 1;
        let g = holder.wait_for(&lock, "test");
        drop(g);
        let d = holder.describe();
        let me = TID.with(|t| *t);
        assert!(d.starts_with(&format!("thread {me} (")), "{d}");
        assert!(d.ends_with(&format!("lock_watch.rs:{line}")), "{d}");
    }

    #[test]
    fn a_waiter_gets_the_lock_once_the_holder_lets_go() {
        let holder = Arc::new(LockHolder::default());
        let lock = Arc::new(Mutex::new(0u32));
        let (l2, h2) = (lock.clone(), holder.clone());
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            let mut g = h2.wait_for(&l2, "holder");
            tx.send(()).unwrap();
            std::thread::sleep(Duration::from_millis(50));
            *g += 1;
        });
        rx.recv().unwrap();
        let g = holder.wait_for(&lock, "waiter");
        assert_eq!(*g, 1, "the waiter got the lock before the holder let go");
        assert_eq!(holder.takes.load(Ordering::Relaxed), 2);
        drop(g);
        t.join().unwrap();
    }
}
