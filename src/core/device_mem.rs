//! The worker's GPU-memory paths: what the protocols ask for, done on device memory.
//!
//! - Rendezvous reads through CUDA IPC: started with the copy engine and polled by progress
//!   (`start_read` / `poll_reads`), never waited for, so the proxy thread can drive them.
//! - Host staging (eager and pipelined frames of GPU buffers, and receives into GPU buffers of
//!   data that came in frames): one copy on our own copy stream, waited for there.
//! - Keys: the CUDA IPC description of a send buffer that the RTS carries.
//!
//! Everything CUDA is in `crate::cuda`; this module decides which copy runs where.

use crate::config::Tristate;
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
}

/// A write into a peer's GPU buffer in flight: what to do when it is done.
pub(crate) struct PendingWrite {
    pub(crate) req: ReqId,
    pub(crate) conn: ConnId,
    pub(crate) then: OutFrame,
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
        }
    }

    fn copier(&mut self) -> &mut Copier {
        let (streams, split) = (self.copy_streams, self.copy_split);
        self.copier.get_or_insert_with(|| Copier::new(streams, split))
    }

    /// Copies in flight whose request's completion may be held.
    pub(crate) fn copies_in_flight(&self) -> usize {
        self.reads.len() + self.writes.len()
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
        }
        running
    }

    /// A completion is held for `req`.
    pub(crate) fn is_held(&self, req: ReqId) -> bool {
        self.held.iter().any(|(r, ..)| *r == req)
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
    pub(crate) fn start_write(&mut self, src: usize, remote: u64, len: usize, key: &[u8], write: PendingWrite) -> Result<()> {
        timeline::record(Event::WriteIssue, write.req as u64);
        let key = ipc::DeviceKey::decode(key)?;
        let device = device_of(src)?;
        let dst = ipc::map_peer(&key, remote, len, device).map_err(|e| e.context("opening the peer's prepared GPU buffer"))?;
        // SAFETY: `src` is the prepared send's buffer, which stays valid while its round is in
        // flight (the round completes only after this copy); `dst` is the peer's receive buffer,
        // mapped, and ready for this round (its readiness frame came before).
        let ticket = unsafe { self.copier().start(device, dst, src as u64, len) }?;
        timeline::record(Event::WriteQueued, write.req as u64);
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

    /// The bytes of a GPU buffer range, copied into host memory.
    pub(crate) fn stage_out(&mut self, addr: usize, len: usize) -> Result<Vec<u8>> {
        let device = device_of(addr)?;
        let mut v = vec![0u8; len];
        // SAFETY: `addr..addr+len` is inside a pending send's GPU buffer (the engine names only
        // such ranges); `v` is ours for the whole (synchronous) copy.
        unsafe { self.copier().copy_sync(device, v.as_mut_ptr() as u64, addr as u64, len) }?;
        Ok(v)
    }

    /// Copy host bytes into a GPU buffer range.
    pub(crate) fn stage_in(&mut self, dst: usize, src: &[u8]) -> Result<()> {
        let device = device_of(dst)?;
        // SAFETY: `dst..dst+len` is inside a pending receive's GPU buffer (clipped by the
        // engine); `src` is borrowed for the whole (synchronous) copy.
        unsafe { self.copier().copy_sync(device, dst as u64, src.as_ptr() as u64, src.len()) }
    }
}

fn device_of(addr: usize) -> Result<i32> {
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
