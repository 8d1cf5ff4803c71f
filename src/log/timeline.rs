//! The event timeline: what happened when, in nanoseconds, for latency work.
//!
//! Logging cannot answer "where do the 20 µs of one exchange go": formatting a line costs more
//! than the steps being measured. With `GSC_TIMELINE=<file pattern>` every step of the
//! operations that go through the proxy (trigger seen, frame sent and received, copy issued,
//! enqueued and done, completion word written) is recorded as a fixed-size entry in memory and
//! written out, one line per event, when the last worker of the process is destroyed. The clock
//! is `CLOCK_MONOTONIC`, shared by every process of the host, so the files of two ranks merge
//! into one timeline with `sort -n`.
//!
//! Off (the default), a record is one relaxed atomic load. On, it takes an uncontended mutex
//! and appends 24 bytes; the buffer is reserved up front and stops growing at `CAPACITY`
//! (later events are counted as dropped, not recorded), so a long run cannot eat the memory.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Most events kept per process (24 MiB).
const CAPACITY: usize = 1 << 20;

/// What happened. `arg` of the record says to what (a request id, a frame kind, a byte count).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Event {
    /// A conditioned operation was issued on the host: armed, not yet triggered (arg: request,
    /// or 0 for a persistent operation).
    Issue,
    /// The proxy saw an armed operation's trigger word reach it (arg: request).
    Trigger,
    /// The proxy saw a persistent operation's trigger advance and started an epoch (arg: epoch).
    Epoch,
    /// A frame went into a link (arg: frame kind, the first byte of `protocols::wire`).
    FrameOut,
    /// A frame came out of a link (arg: frame kind).
    FrameIn,
    /// A rendezvous read of GPU memory is about to be enqueued (arg: request).
    ReadIssue,
    /// The read's copy and event are enqueued (arg: request).
    ReadQueued,
    /// Progress found the read done (arg: request).
    ReadDone,
    /// A prepared round's write into the peer's GPU memory is about to be enqueued (arg: request).
    WriteIssue,
    /// The write's copy and event are enqueued (arg: request).
    WriteQueued,

    /// Progress found the write done (arg: request).
    WriteDone,
    /// A request completed and its done word was written (arg: request).
    Done,
    /// Shared words (prepared pairs, `GSC_PREP_WORDS`): the receiver raised "ready" (arg: round).
    WordReady,
    /// The sender saw "ready" move (arg: round).
    WordSeen,
    /// The sender raised "arrived" from the CPU or enqueued its write on the copy stream (arg: round).
    WordWrite,
    /// The receiver saw "arrived" move (arg: round).
    WordArrived,
}

impl Event {
    fn name(self) -> &'static str {
        match self {
            Event::Issue => "issue",
            Event::Trigger => "trigger",
            Event::Epoch => "epoch",
            Event::FrameOut => "frame-out",
            Event::FrameIn => "frame-in",
            Event::ReadIssue => "read-issue",
            Event::ReadQueued => "read-queued",
            Event::ReadDone => "read-done",
            Event::WriteIssue => "write-issue",
            Event::WriteQueued => "write-queued",

            Event::WriteDone => "write-done",
            Event::Done => "done",
            Event::WordReady => "word-ready",
            Event::WordSeen => "word-seen",
            Event::WordWrite => "word-write",
            Event::WordArrived => "word-arrived",
        }
    }
}

#[derive(Copy, Clone)]
struct Record {
    ns: u64,
    arg: u64,
    event: Event,
}

static ENABLED: AtomicBool = AtomicBool::new(false);
static DROPPED: AtomicU64 = AtomicU64::new(0);
static STATE: Mutex<Option<(PathBuf, Vec<Record>)>> = Mutex::new(None);

/// Start recording into the file `path` names (already expanded). A second call while
/// recording keeps the first file.
pub(crate) fn enable(path: PathBuf) {
    let mut st = STATE.lock().unwrap_or_else(|e| e.into_inner());
    if st.is_none() {
        *st = Some((path, Vec::with_capacity(CAPACITY)));
        ENABLED.store(true, Ordering::Release);
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds: the same clock in every process of the host.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid out-pointer; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Record `event` now, if the timeline is on.
#[inline]
pub(crate) fn record(event: Event, arg: u64) {
    if ENABLED.load(Ordering::Relaxed) {
        record_slow(event, arg);
    }
}

#[cold]
fn record_slow(event: Event, arg: u64) {
    let ns = now_ns();
    let mut st = STATE.lock().unwrap_or_else(|e| e.into_inner());
    match st.as_mut() {
        Some((_, v)) if v.len() < CAPACITY => v.push(Record { ns, arg, event }),
        _ => {
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Append what was recorded to the file and start over (called when the last worker goes, and
/// by tests). Lines: `<ns> <pid> <event> <arg>`.
pub(crate) fn flush() -> std::io::Result<()> {
    let (path, events) = {
        let mut st = STATE.lock().unwrap_or_else(|e| e.into_inner());
        let Some((path, v)) = st.as_mut() else { return Ok(()) };
        (path.clone(), std::mem::take(v))
    };
    let pid = std::process::id();
    let file = std::fs::OpenOptions::new().create(true).append(true).open(&path)?;
    let mut out = std::io::BufWriter::new(file);
    for r in &events {
        writeln!(out, "{} {pid} {} {}", r.ns, r.event.name(), r.arg)?;
    }
    let dropped = DROPPED.swap(0, Ordering::Relaxed);
    if dropped > 0 {
        writeln!(out, "# {pid}: {dropped} events not recorded (more than {CAPACITY})")?;
    }
    out.flush()?;
    // Keep the reservation for the next run of this process.
    let mut st = STATE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, v)) = st.as_mut()
        && v.is_empty()
    {
        *v = events;
        v.clear();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_in_order_and_writes_one_line_per_event() {
        let path = std::env::temp_dir().join(format!("gsc-timeline-test-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        enable(path.clone());
        record(Event::Trigger, 7);
        record(Event::FrameOut, 3);
        record(Event::Done, 7);
        flush().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        // Other tests in this process may record too; ours are in order among them.
        let ours: Vec<(u64, String)> = text
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                let ev = format!("{} {}", f[2], f[3]);
                ["trigger 7", "frame-out 3", "done 7"].contains(&ev.as_str()).then(|| (f[0].parse().unwrap(), ev))
            })
            .collect();
        assert_eq!(ours.iter().map(|o| o.1.as_str()).collect::<Vec<_>>(), ["trigger 7", "frame-out 3", "done 7"]);
        assert!(ours.windows(2).all(|w| w[0].0 <= w[1].0), "timestamps go forward: {ours:?}");
    }
}
