//! The worker's GPU-memory paths: what the protocols ask for, done on device memory.
//!
//! - Rendezvous reads through CUDA IPC: started with the copy engine and polled by progress
//!   (`start_read` / `poll_reads`), never waited for, so the proxy thread can drive them.
//! - Host staging (frames of GPU buffers on links that cannot reach GPU memory, and receives
//!   into GPU buffers of data that came in frames): the pipeline of core/staging.rs, chunks of
//!   `GSC_CUDA_PIPELINE_CHUNK` copied through page-locked bounce buffers on our own copy
//!   stream, polled like the reads, never waited for (but for a single frame larger than a
//!   chunk, copied synchronously on that stream).
//! - Keys: the CUDA IPC description of a send buffer that the RTS carries.
//!
//! Everything CUDA is in `crate::cuda`; this module decides which copy runs where.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::staging::{Accumulator, Holds, Place};
use crate::config::Tristate;
use crate::cuda::bounce::{self, Bounce};
use crate::cuda::copy::{Copier, CopyTicket};
use crate::cuda::{ipc, memory};
use crate::error::{Error, Result, Status};
use crate::log::timeline::{self, Event};
use crate::protocols::{ConnId, MemType, OutFrame, RecvInfo, ReqId, UserBuf};
use crate::transport::LaneKind;

pub(crate) struct DeviceMem {
    /// Created with the first GPU copy, so host-only workers never touch the driver.
    copier: Option<Copier>,
    /// `GSC_CUDA_COPY_STREAMS` and `GSC_CUDA_COPY_SPLIT`, for the copier when it is made.
    copy_streams: usize,
    copy_split: usize,
    reads: Vec<(CopyTicket, ReqId)>,
    /// Prepared transfers' writes into peers' GPU buffers, with the frame that announces each
    /// once it is done.
    writes: Vec<(CopyTicket, PendingWrite)>,
    /// Completions that arrived (a link failure) while the request's read was still copying
    /// into its buffer: held until the copy is done, so the buffer is the user's again only then.
    held: Vec<(ReqId, Status, RecvInfo)>,
    /// `GSC_CUDA_IPC`: off never reads through IPC; on makes a failed IPC read an error
    /// rather than a fall back to the sender pushing through host memory.
    pub(crate) ipc: Tristate,
    /// The host-staging pipeline (core/staging.rs). `GSC_CUDA_PIPELINE_CHUNK` / `_DEPTH`.
    pub(crate) pipeline_chunk: usize,
    pub(crate) pipeline_depth: usize,
    /// Send chunks by id: copied out of GPU memory, then sent frame by frame.
    send_chunks: HashMap<u64, SendChunk>,
    next_chunk: u64,
    /// Send chunks of failed links still being copied into: released once the copy is done.
    orphans: Vec<SendChunk>,
    /// The receive side: the open bounce buffer (and its GPU), the copies into GPU memory in
    /// issue order, and the completions waiting for them.
    acc: Accumulator,
    acc_buf: Option<(i32, Bounce)>,
    recv_copies: VecDeque<(CopyTicket, Bounce)>,
    holds: Holds,
    /// A copy into GPU memory failed: completions released while copies issued before the
    /// failure were outstanding report it.
    recv_error: Option<Status>,
    /// `GSC_TIMEOUT`: how long a copy the worker waits for (under its lock) may take.
    copy_timeout: Option<Duration>,
    /// Set when such a copy timed out: later copies would queue behind it on the same stream,
    /// so every later one the worker would wait for fails at once instead of after another
    /// `GSC_TIMEOUT` under the lock.
    copy_wedged: Option<Error>,
}

/// One chunk of a send: GPU bytes copied into `buf`, sent by `frames_left` queued frames.
struct SendChunk {
    conn: ConnId,
    buf: Bounce,
    ticket: Option<CopyTicket>,
    /// The copy's result once it finished.
    ready: Option<Result<()>>,
    frames_left: usize,
}

/// A write into a peer's GPU buffer in flight: what to do when it is done.
pub(crate) struct PendingWrite {
    pub(crate) req: ReqId,
    pub(crate) conn: ConnId,
    pub(crate) then: OutFrame,
    /// Shared words: (send preparation, round) whose "arrived" word ends this write instead of
    /// `then` (see `Action::WriteRemote`).
    pub(crate) arrived_word: Option<(u64, u64)>,
    /// The copy stream wrote that word after the copy; otherwise the worker stores it.
    pub(crate) word_by_stream: bool,
}

/// What became of a rendezvous read this side was asked to do.
pub(crate) enum ReadStart {
    /// Copying; `poll_reads` reports it.
    Started,
    /// This side cannot read that memory: let the sender push it.
    Refused(Error),
    Failed(Error),
}

impl DeviceMem {
    pub(crate) fn new(cfg: &crate::Config) -> DeviceMem {
        DeviceMem {
            copier: None,
            copy_streams: cfg.cuda_copy_streams,
            copy_split: cfg.cuda_copy_split,
            reads: Vec::new(),
            writes: Vec::new(),
            held: Vec::new(),
            ipc: cfg.cuda_ipc,
            pipeline_chunk: cfg.cuda_pipeline_chunk,
            pipeline_depth: cfg.cuda_pipeline_depth,
            send_chunks: HashMap::new(),
            next_chunk: 1,
            orphans: Vec::new(),
            acc: Accumulator::new(cfg.cuda_pipeline_chunk),
            acc_buf: None,
            recv_copies: VecDeque::new(),
            holds: Holds::default(),
            recv_error: None,
            copy_timeout: cfg.timeout,
            copy_wedged: None,
        }
    }

    fn copier(&mut self) -> &mut Copier {
        let (streams, split) = (self.copy_streams, self.copy_split);
        self.copier.get_or_insert_with(|| Copier::new(streams, split))
    }

    /// Copies in flight whose request's completion may be held (a receive bounce buffer still
    /// filling counts: its copy is yet to start).
    pub(crate) fn copies_in_flight(&self) -> usize {
        self.reads.len() + self.writes.len() + self.recv_copies.len() + usize::from(self.acc.open().is_some())
    }

    /// Reads in flight.
    pub(crate) fn reads_in_flight(&self) -> usize {
        self.reads.len()
    }

    /// Hold `req`'s completion if a copy of its buffer is still running: a read into it, or a
    /// prepared round's write from it (true: held).
    pub(crate) fn hold_completion(&mut self, req: ReqId, status: Status, info: RecvInfo) -> bool {
        let running = self.reads.iter().any(|(_, r)| *r == req) || self.writes.iter().any(|(_, w)| w.req == req);
        if running {
            self.held.push((req, status, info));
            return true;
        }
        // Staged receives: the request's last bytes may still be in the open bounce buffer or
        // on their way to GPU memory (core/staging.rs: held until every copy issued so far).
        if let Err(e) = self.flush_recv() {
            tracing::warn!(target: "gsc::cuda", req, error = %e, "could not start a staged copy into GPU memory");
            self.recv_error.get_or_insert(e.status());
        }
        self.holds.hold(req, status, info)
    }

    /// A completion is held for `req`.
    pub(crate) fn is_held(&self, req: ReqId) -> bool {
        self.held.iter().any(|(r, ..)| *r == req) || self.holds.is_holding(req)
    }

    /// Make enough page-locked bounce buffers for the staging pipeline exist, for the GPU
    /// holding `addr` and `links` links that stage (on the user's thread: the proxy only takes
    /// buffers from the pool). Each link may have `depth` send chunks in flight, the receive
    /// side `depth` copies and an open buffer; one spare. Capped at 64 buffers (256 MiB with
    /// the default chunk): beyond that, links wait for buffers to come back.
    pub(crate) fn reserve_staging(&mut self, addr: usize, links: usize) -> Result<()> {
        let device = device_of(addr)?;
        let count = (self.pipeline_depth * (links.max(1) + 1) + 2).min(64);
        bounce::reserve(device, self.pipeline_chunk, count)
    }

    /// Start copying `len` bytes of GPU memory at `addr` into a bounce buffer, for `frames`
    /// queued frames of link `conn`. Returns the chunk's id, or `None` when no bounce buffer is
    /// free (the caller waits for one to come back: the proxy never allocates them).
    pub(crate) fn start_send_chunk(&mut self, conn: ConnId, addr: usize, len: usize, frames: usize) -> Result<Option<u64>> {
        let device = device_of(addr)?;
        let Some(buf) = Bounce::take(len) else { return Ok(None) };
        // SAFETY: `addr..addr+len` is inside pending sends' GPU buffers (the frames that name
        // it are queued, and their requests complete only once those frames were sent, which
        // waits for this copy); `buf` is page-locked memory of at least `len` bytes, kept (in
        // `send_chunks` or `orphans`) until the copy is done.
        let ticket = unsafe { self.copier().start(device, buf.addr(), addr as u64, len) }?;
        let id = self.next_chunk;
        self.next_chunk += 1;
        self.send_chunks.insert(id, SendChunk { conn, buf, ticket: Some(ticket), ready: None, frames_left: frames });
        Ok(Some(id))
    }

    /// `len` bytes of GPU memory at `addr`, copied now into ordinary host memory: the way on
    /// when no bounce buffer is free and nothing of the link is being staged (so none will come
    /// back for it). Waits only for our own copy stream. Into pageable memory `cuMemcpyAsync`
    /// itself returns only once the copy is done (CUDA's API synchronization rules), so the
    /// time limit of `wait_copy` applies only where the driver hands the copy back earlier.
    pub(crate) fn copy_out_now(&mut self, addr: usize, len: usize) -> Result<Vec<u8>> {
        if let Some(e) = &self.copy_wedged {
            return Err(e.clone());
        }
        let device = device_of(addr)?;
        let mut out = vec![0u8; len];
        // SAFETY: `addr..addr+len` is inside a pending send's GPU buffer (its frame is queued);
        // `out` is `len` writable bytes, borrowed until the copy is done (or, timed out,
        // leaked: the copy engine may still write into it).
        let ticket = unsafe { self.copier().start(device, out.as_mut_ptr() as u64, addr as u64, len) }?;
        let timeout = self.copy_timeout;
        let copier = self.copier.as_mut().expect("made by `start` above");
        match wait_copy(copier, &ticket, timeout, &mut self.copy_wedged, "a copy out of GPU memory for a send") {
            Ok(()) => Ok(out),
            Err(e) => {
                if e.status() == Status::TimedOut {
                    std::mem::forget(out);
                }
                Err(e)
            }
        }
    }

    /// Whether chunk `id`'s copy is done: `None` while it runs.
    pub(crate) fn send_chunk_ready(&mut self, id: u64) -> Option<Result<()>> {
        let copier = self.copier.as_mut()?;
        let c = self.send_chunks.get_mut(&id)?;
        if c.ready.is_none()
            && let Some(t) = &c.ticket
        {
            c.ready = copier.poll(t);
            if c.ready.is_some() {
                c.ticket = None;
            }
        }
        c.ready.clone()
    }

    /// `len` bytes at `offset` of chunk `id` (whose copy is done).
    pub(crate) fn staged_bytes(&self, id: u64, offset: usize, len: usize) -> &[u8] {
        self.send_chunks.get(&id).map_or(&[][..], |c| c.buf.bytes(offset, len))
    }

    /// A frame of chunk `id` was sent; true when it was the chunk's last (its buffer goes back).
    pub(crate) fn staged_frame_sent(&mut self, id: u64) -> bool {
        let Some(c) = self.send_chunks.get_mut(&id) else { return false };
        c.frames_left = c.frames_left.saturating_sub(1);
        if c.frames_left == 0 {
            self.send_chunks.remove(&id);
            return true;
        }
        false
    }

    /// Link `conn` failed: its chunks are not sent; each buffer goes back once its copy is done.
    pub(crate) fn drop_send_chunks(&mut self, conn: ConnId) {
        let ids: Vec<u64> = self.send_chunks.iter().filter(|(_, c)| c.conn == conn).map(|(id, _)| *id).collect();
        for id in ids {
            let c = self.send_chunks.remove(&id).expect("listed above");
            if c.ticket.is_some() {
                self.orphans.push(c);
            }
        }
    }

    /// Receive `src` into GPU memory at `dst` through the staging pipeline: into the open bounce
    /// buffer while bytes follow on, a full buffer to the copy engine. Completions wait for the
    /// copies (`hold_completion`).
    pub(crate) fn stage_in(&mut self, dst: usize, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        match self.acc.place(dst, src.len()) {
            Place::Append { offset } => match self.acc_buf.as_mut() {
                Some((_, buf)) => buf.write(offset, src),
                None => {
                    self.acc.close();
                    return Err(Error::new(Status::Internal, "staging: an open range without its bounce buffer"));
                }
            },
            Place::Open { closed } => {
                // `place` opened the new range already: on any failure below it is closed
                // again, so no later frame joins a range that has no buffer.
                if let Some(range) = closed
                    && let Err(e) = self.issue_recv(range)
                {
                    self.acc.close();
                    return Err(e);
                }
                // Bounded: with `depth` copies to the GPU outstanding, wait for the oldest
                // (it waits on our own copy stream only) rather than take ever more page-locked
                // memory. The network is far slower than the copy engine, so this is rare.
                while self.recv_copies.len() >= self.pipeline_depth {
                    self.wait_oldest_recv_copy();
                }
                // The proxy never allocates a bounce buffer (cuda/bounce.rs): with none free,
                // these bytes are copied straight from the frame, like an oversized frame.
                let Some(mut buf) = Bounce::take(self.pipeline_chunk) else {
                    self.acc.close();
                    return self.copy_in_now(dst, src);
                };
                let opened = (|| -> Result<(i32, usize)> {
                    let device = device_of(dst)?;
                    Ok((device, memory::allocation_end(dst, device)?))
                })();
                match opened {
                    Ok((device, end)) => {
                        buf.write(0, src);
                        self.acc_buf = Some((device, buf));
                        // Later frames join this copy only inside the same allocation.
                        self.acc.set_limit(end);
                    }
                    Err(e) => {
                        self.acc.close();
                        tracing::warn!(target: "gsc::cuda", error = %e, dst, "staging into GPU memory refused");
                        return Err(e);
                    }
                }
            }
            Place::Direct { closed } => {
                if let Some(range) = closed {
                    self.issue_recv(range)?;
                }
                // Larger than a chunk (a frame bigger than GSC_CUDA_PIPELINE_CHUNK).
                return self.copy_in_now(dst, src);
            }
        }
        if self.acc.is_full() {
            self.flush_recv()?;
        }
        Ok(())
    }

    /// Copy `src` to GPU memory at `dst` now, on the copy stream (so after the copies issued
    /// before it), waiting for it.
    fn copy_in_now(&mut self, dst: usize, src: &[u8]) -> Result<()> {
        if let Some(e) = &self.copy_wedged {
            return Err(e.clone());
        }
        let device = device_of(dst)?;
        // SAFETY: `dst..dst+len` is inside a pending receive's GPU buffer (clipped by the
        // engine); `src` is borrowed until the copy is done. Timed out, the copy may still read
        // `src` after it is reused, but only into the receive that this error fails.
        let ticket = unsafe { self.copier().start(device, dst as u64, src.as_ptr() as u64, src.len()) }?;
        let timeout = self.copy_timeout;
        let copier = self.copier.as_mut().expect("made by `start` above");
        wait_copy(copier, &ticket, timeout, &mut self.copy_wedged, "a copy into GPU memory for a receive")
    }

    /// Spin until the oldest copy into GPU memory is done (its held completions are released
    /// by the next `poll_staging`). A copy that never ends (a wedged GPU) fails the receives
    /// waiting on it at `GSC_TIMEOUT` instead of holding the worker's lock forever; its bounce
    /// buffer is then leaked, as the copy engine may still write from it.
    fn wait_oldest_recv_copy(&mut self) {
        let timeout = self.copy_timeout;
        let Some(copier) = self.copier.as_mut() else { return };
        let Some((ticket, _)) = self.recv_copies.front() else { return };
        let r = wait_copy(copier, ticket, timeout, &mut self.copy_wedged, "a staged copy into GPU memory");
        if let Err(e) = &r {
            tracing::warn!(target: "gsc::cuda", error = %e, "a staged copy into GPU memory failed");
            self.recv_error.get_or_insert(e.status());
        }
        let (_, buf) = self.recv_copies.pop_front().expect("looked at above");
        if r.as_ref().is_err_and(|e| e.status() == Status::TimedOut) {
            std::mem::forget(buf);
        }
        self.holds.finished();
    }

    /// Hand the open receive bounce buffer, if any, to the copy engine.
    fn flush_recv(&mut self) -> Result<()> {
        match self.acc.close() {
            Some(range) => self.issue_recv(range),
            None => Ok(()),
        }
    }

    fn issue_recv(&mut self, (dst, len): (usize, usize)) -> Result<()> {
        let Some((device, buf)) = self.acc_buf.take() else {
            return Err(Error::new(Status::Internal, "staging: an open range without its bounce buffer"));
        };
        // SAFETY: `dst..dst+len` is inside pending receives' GPU buffers (each range was placed
        // by the engine's clipped copies), whose completions are held until this copy is done
        // (`holds`); `buf` is page-locked, holds those `len` bytes, and is kept in
        // `recv_copies` until the copy is done.
        let ticket = unsafe { self.copier().start(device, dst as u64, buf.addr(), len) }?;
        self.recv_copies.push_back((ticket, buf));
        self.holds.issued();
        Ok(())
    }

    /// Send chunk `id`'s state, for a stuck request's description.
    pub(crate) fn describe_chunk(&self, id: u64) -> String {
        match self.send_chunks.get(&id) {
            None => "not in the table".into(),
            Some(c) => format!(
                "copy {}, {} frames left, {} bytes of buffer",
                match (&c.ticket, &c.ready) {
                    (_, Some(Ok(()))) => "done".to_string(),
                    (_, Some(Err(e))) => format!("failed ({e})"),
                    (Some(_), None) => "running (or not polled since)".to_string(),
                    (None, None) => "without a ticket".to_string(),
                },
                c.frames_left,
                c.buf.len()
            ),
        }
    }

    /// The staging pipeline's state, for a stuck request's description (`req`: is its
    /// completion held?).
    pub(crate) fn describe_staging(&self, req: ReqId) -> String {
        format!(
            "staging: {} send chunks, {} copies to GPU memory, open buffer {:?}, {} copies outstanding, completion held: {}, {} bounce buffers free",
            self.send_chunks.len(),
            self.recv_copies.len(),
            self.acc.open(),
            self.holds.outstanding(),
            self.is_held(req),
            bounce::free_count()
        )
    }

    /// The staging pipeline has copies or held completions to look after.
    pub(crate) fn staging_busy(&self) -> bool {
        // Held completions count too: `wait_oldest_recv_copy` can retire the last copy in
        // flight outside `poll_staging`, and the completions it freed are released only there
        // (without this they waited for the next staged message, or forever).
        !self.recv_copies.is_empty() || !self.orphans.is_empty() || self.holds.holding()
    }

    /// Poll the pipeline's copies; completions whose copies are all done go to `done`.
    pub(crate) fn poll_staging(&mut self, done: &mut Vec<(ReqId, Status, RecvInfo)>) {
        if let Some(copier) = self.copier.as_mut() {
            self.orphans.retain(|c| c.ticket.as_ref().is_some_and(|t| copier.poll(t).is_none()));
            while let Some((ticket, _)) = self.recv_copies.front() {
                match copier.poll(ticket) {
                    None => break,
                    Some(r) => {
                        if let Err(e) = r {
                            tracing::warn!(target: "gsc::cuda", error = %e, "a staged copy into GPU memory failed");
                            self.recv_error.get_or_insert(e.status());
                        }
                        self.recv_copies.pop_front();
                        self.holds.finished();
                    }
                }
            }
        }
        let first = done.len();
        self.holds.release(done);
        if let Some(err) = self.recv_error {
            for d in &mut done[first..] {
                if d.1 == Status::Ok {
                    d.1 = err;
                }
            }
            if self.holds.outstanding() == 0 {
                self.recv_error = None;
            }
        }
    }

    /// The completion held for `req`, once its read is done.
    pub(crate) fn take_held(&mut self, req: ReqId) -> Option<(Status, RecvInfo)> {
        let i = self.held.iter().position(|(r, ..)| *r == req)?;
        let (_, status, info) = self.held.swap_remove(i);
        Some((status, info))
    }

    /// Make the copy stream of the GPU holding `addr` exist. Called on the user's thread when
    /// an operation on GPU memory is posted, so the proxy only ever enqueues and queries.
    pub(crate) fn prepare_for(&mut self, addr: usize) -> Result<()> {
        let device = device_of(addr)?;
        self.copier().prepare(device)
    }

    /// The key the RTS for a GPU send buffer carries, or `None` (the receiver then asks for a
    /// push): IPC is off, or the buffer cannot be exported (a VMM allocation). Computed on the
    /// user's thread when the send is posted (exporting is a driver call the proxy avoids).
    pub(crate) fn send_key(ipc_mode: Tristate, lane: LaneKind, addr: usize, len: usize) -> Option<Vec<u8>> {
        if ipc_mode == Tristate::Off {
            return None;
        }
        let key = match lane {
            LaneKind::Loopback => Ok(ipc::same_process_key(addr, len)),
            LaneKind::Shm => memory::device_ptr(addr).and_then(|p| {
                let p = p.ok_or_else(|| Error::invalid_param("send buffer is not GPU memory"))?;
                ipc::export(addr, p)
            }),
            // An IPC handle means nothing on another host: the receiver asks for a push.
            LaneKind::Ucx => return None,
        };
        match key {
            Ok(k) => Some(k.encode()),
            Err(e) => {
                tracing::debug!(target: "gsc::cuda", error = %e, "no IPC key for a GPU send buffer; the receiver will ask for a push");
                None
            }
        }
    }

    /// Start reading `len` bytes of the peer's GPU memory at `remote` (opened by `key`) into
    /// `dst`.
    pub(crate) fn start_read(&mut self, dst: UserBuf, remote: u64, len: usize, key: &[u8], req: ReqId) -> ReadStart {
        let refuse_or_fail = |ipc: Tristate, e: Error| if ipc == Tristate::On { ReadStart::Failed(e) } else { ReadStart::Refused(e) };
        if self.ipc == Tristate::Off {
            return ReadStart::Refused(Error::unsupported("GSC_CUDA_IPC=off"));
        }
        let key = match ipc::DeviceKey::decode(key) {
            Ok(k) => k,
            Err(e) => return ReadStart::Failed(e),
        };
        let device = match local_device(dst) {
            Ok(d) => d,
            Err(e) => return refuse_or_fail(self.ipc, e),
        };
        let src = match ipc::map_peer(&key, remote, len, device) {
            Ok(s) => s,
            // Not a failure of IPC but memory it cannot reach this way (a block already open):
            // pushed even with GSC_CUDA_IPC=on.
            Err(e) if e.status() == Status::Unsupported => return ReadStart::Refused(e),
            Err(e) => return refuse_or_fail(self.ipc, e.context("opening the peer's GPU buffer")),
        };
        tracing::debug!(target: "gsc::cuda", req, len, device, src = format_args!("{src:#x}"), "IPC read");
        // SAFETY: `dst` is the pending receive's buffer, valid until it completes, which waits
        // for this copy (even a failure's completion is held: `hold_completion`); `src` is the
        // peer's mapped buffer, held by its pending send until our ATS, sent after the copy.
        timeline::record(Event::ReadIssue, req as u64);
        match unsafe { self.copier().start(device, dst.addr as u64, src, len) } {
            Ok(t) => {
                timeline::record(Event::ReadQueued, req as u64);
                self.reads.push((t, req));
                ReadStart::Started
            }
            Err(e) => ReadStart::Failed(e),
        }
    }

    /// Start writing `len` bytes of our GPU memory at `src` into the peer's GPU memory at
    /// `remote`, opened by `key` (a prepared transfer's round). `poll_writes` reports it.
    /// `word`: (device address, value) of a word for the copy stream to write after the copy
    /// (shared words); `write.word_by_stream` tells whether it was enqueued.
    pub(crate) fn start_write(
        &mut self,
        src: usize,
        remote: u64,
        len: usize,
        key: &[u8],
        word: Option<(u64, u64)>,
        mut write: PendingWrite,
    ) -> Result<()> {
        timeline::record(Event::WriteIssue, write.req as u64);
        let key = ipc::DeviceKey::decode(key)?;
        let device = device_of(src)?;
        let dst = ipc::map_peer(&key, remote, len, device).map_err(|e| e.context("opening the peer's prepared GPU buffer"))?;
        // SAFETY: `src` is the prepared send's buffer, which stays valid while its round is in
        // flight (the round completes only after this copy); `dst` is the peer's receive buffer,
        // mapped, and ready for this round (its readiness frame or word came before); `word`,
        // if any, is in a registered page the worker keeps mapped until exit (`prep_words`).
        let (ticket, by_stream) = unsafe { self.copier().start_then_write(device, dst, src as u64, len, word) }?;
        write.word_by_stream = by_stream;
        timeline::record(Event::WriteQueued, write.req as u64);
        if let (true, Some((_, round))) = (by_stream, write.arrived_word) {
            timeline::record(Event::WordWrite, round);
        }
        self.writes.push((ticket, write));
        Ok(())
    }

    pub(crate) fn writes_in_flight(&self) -> usize {
        self.writes.len()
    }

    /// A write of request `req` is still copying.
    pub(crate) fn writing(&self, req: ReqId) -> bool {
        self.writes.iter().any(|(_, w)| w.req == req)
    }

    /// Writes that finished since the last call, with their results.
    pub(crate) fn poll_writes(&mut self, done: &mut Vec<(PendingWrite, Result<()>)>) {
        let Some(copier) = self.copier.as_mut() else { return };
        let mut i = 0;
        while i < self.writes.len() {
            match copier.poll(&self.writes[i].0) {
                None => i += 1,
                Some(r) => {
                    let write = self.writes.swap_remove(i).1;
                    timeline::record(Event::WriteDone, write.req as u64);
                    done.push((write, r));
                }
            }
        }
    }

    /// Reads that finished since the last call, with their results.
    pub(crate) fn poll_reads(&mut self, done: &mut Vec<(ReqId, Result<()>)>) {
        let Some(copier) = self.copier.as_mut() else { return };
        let mut i = 0;
        while i < self.reads.len() {
            match copier.poll(&self.reads[i].0) {
                None => i += 1,
                Some(r) => {
                    let req = self.reads.swap_remove(i).1;
                    timeline::record(Event::ReadDone, req as u64);
                    match &r {
                        Ok(()) => tracing::debug!(target: "gsc::cuda", req, "IPC read finished"),
                        Err(e) => tracing::debug!(target: "gsc::cuda", req, error = %e, "IPC read failed"),
                    }
                    done.push((req, r));
                }
            }
        }
    }
}

pub(crate) fn device_of(addr: usize) -> Result<i32> {
    memory::device_ptr(addr)?
        .map(|p| p.device)
        .ok_or_else(|| Error::new(Status::InvalidParam, "a buffer declared as GPU memory is not (or no longer) GPU memory"))
}

/// The GPU whose copy engine moves data into `dst`: its own for device memory; for host memory
/// the first GPU (any GPU can copy into host memory; the first is always there).
fn local_device(dst: UserBuf) -> Result<i32> {
    match dst.mem {
        MemType::Cuda => device_of(dst.addr),
        MemType::Host if memory::process_has_cuda() => Ok(0),
        MemType::Host => Err(Error::new(Status::LibraryMissing, "this process does not use CUDA; the sender pushes the data instead")),
    }
}

/// After this long, a copy the worker waits for is named in a warning (a copy of a staging
/// chunk takes microseconds to a few milliseconds).
const SLOW_COPY: Duration = Duration::from_secs(1);

/// Spin until `ticket`'s copy is done. The worker's lock is held meanwhile, so a copy that does
/// not end is named in a warning after `SLOW_COPY` and becomes a `TimedOut` error after
/// `timeout` (`None`: never), which also marks the copies `wedged`: later ones fail at once.
/// (Beyond `GSC_HEARTBEAT_TIMEOUT` under the lock, shm peers fail the link first: the proxy's
/// heartbeat waits for the lock.)
fn wait_copy(copier: &mut Copier, ticket: &CopyTicket, timeout: Option<Duration>, wedged: &mut Option<Error>, what: &str) -> Result<()> {
    if let Some(e) = wedged {
        return Err(e.clone());
    }
    let start = Instant::now();
    let mut warned = false;
    loop {
        if let Some(r) = copier.poll(ticket) {
            if warned {
                tracing::warn!(target: "gsc::cuda", what, took = ?start.elapsed(), "the slow copy ended");
            }
            return r;
        }
        let waited = start.elapsed();
        if !warned && waited >= SLOW_COPY {
            warned = true;
            tracing::warn!(target: "gsc::cuda", what, waited = ?waited, "a copy the worker waits for (holding its lock) has not ended");
        }
        if timeout.is_some_and(|t| waited >= t) {
            let e = Error::new(Status::TimedOut, format!("{what} did not end within {waited:?} (GSC_TIMEOUT)"));
            *wedged = Some(e.clone());
            return Err(e);
        }
        std::hint::spin_loop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A held completion whose copies were finished outside `poll_staging` (by
    /// `wait_oldest_recv_copy`, with no copy left in flight) keeps the pipeline busy until
    /// `poll_staging` releases it. (Found on the device: collectives across hosts stalled until
    /// the next staged message, or timed out when none came.)
    #[test]
    fn a_completion_held_after_the_last_copy_finished_is_still_released() {
        let mut dm = DeviceMem::new(&crate::Config::default());
        assert!(!dm.staging_busy());
        dm.holds.issued();
        assert!(dm.holds.hold(7, Status::Ok, RecvInfo::default()));
        dm.holds.finished(); // the copy ended, as `wait_oldest_recv_copy` ends it
        assert!(dm.recv_copies.is_empty());
        assert!(dm.staging_busy(), "a held completion must keep the pipeline polled");
        let mut done = Vec::new();
        dm.poll_staging(&mut done);
        assert_eq!(done.iter().map(|d| d.0).collect::<Vec<_>>(), vec![7]);
        assert!(!dm.staging_busy());
    }
}
