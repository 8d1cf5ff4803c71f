//! Host reads of single words of device memory (kernels' error words) that never wait for
//! other work on the device.
//!
//! A synchronous `cuMemcpyDtoH` runs on the legacy default stream, which waits for the work
//! of every blocking stream of the context: a program's compute on the default stream, or a
//! collective spinning for a late peer. A thread asking "did a kernel give up?" (a watchdog
//! polling `ncclCommGetAsyncError`, the proxy completing a round) would wait behind all of
//! that; PyTorch, which polls after every collective of a non-blocking communicator, took
//! 83 µs per 8-byte all-reduce that way instead of 16 (docs/PERF.md, session 26). Here each
//! device has a non-blocking stream of its own and a page-locked word: the copy runs beside
//! whatever else is queued, and only it is waited for.

use super::copy::primary_context;
use super::{CtxScope, api, check, cu, raw};
use crate::error::Result;
use std::sync::Mutex;

/// One device's reader, made at its first read (in the device's primary context).
struct Reader {
    device: i32,
    stream: api::Stream,
    word: api::PinnedBuf,
}

/// Readers by device; a read holds the lock for its copy (a few µs), so reads of one process
/// take turns.
static READERS: Mutex<Vec<Reader>> = Mutex::new(Vec::new());

/// The 8-byte word at `addr`, device memory of `device` (or memory it can address), as it is
/// now.
pub(crate) fn read_word(device: i32, addr: u64) -> Result<u64> {
    // A stream synchronize is one of the calls a capture in the global mode forbids anywhere
    // in the process; this one waits only for our own copy, so it is safe under any capture
    // (PyTorch polls async errors from the capturing thread).
    super::with_relaxed_capture(|| read_now(device, addr))
}

fn read_now(device: i32, addr: u64) -> Result<u64> {
    let mut readers = READERS.lock().unwrap_or_else(|e| e.into_inner());
    let _scope = CtxScope::enter(primary_context(device)?)?;
    let i = match readers.iter().position(|r| r.device == device) {
        Some(i) => i,
        None => {
            readers.push(Reader { device, stream: api::Stream::new()?, word: api::PinnedBuf::new(8)? });
            readers.len() - 1
        }
    };
    let r = &readers[i];
    // SAFETY: the caller's live device word into our page-locked word (unified addressing),
    // on our own stream, waited for before the word is read.
    check(unsafe { cu::cuMemcpyAsync(r.word.host_ptr() as u64, addr, 8, raw(r.stream.raw())) }, "cuMemcpyAsync (device word)")?;
    r.stream.synchronize()?;
    // SAFETY: the page-locked word, 8-aligned; the copy into it has completed.
    Ok(unsafe { std::ptr::read_volatile(r.word.host_ptr() as *const u64) })
}
