//! Endpoints: a connection from a worker to one peer worker, and the operations on it.

use super::memory::{Rkey, check_range, rkey_unpack};
use super::request::{ReqKind, RequestParams, Started};
use super::worker::{Completion, OnTimeout, State, Worker, check_buffer, require_host_memory, resolve_memtype};
use crate::condition::StageDir;
use crate::error::{Error, Result, Status};
use crate::protocols::{Action, ConnId, MemType, ProtoId, RecvInfo, UserBuf};
use crate::transport::LaneKind;

pub struct Endpoint {
    worker: Worker,
    conn: ConnId,
    generation: u32,
}

/// How `close_nbx` treats operations in flight.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CloseMode {
    /// Wait for every send on the endpoint to complete, then tell the peer.
    Flush,
    /// Drop the link now; operations in flight complete with `Canceled`.
    Force,
}

/// What an operation needs to find its connection again when it starts, possibly later on the
/// proxy thread (an armed operation): the connection and the generation it must still have.
#[derive(Copy, Clone)]
pub(super) struct EpKey {
    conn: ConnId,
    generation: u32,
}

impl EpKey {
    pub(super) fn usable(self, st: &State) -> Result<ConnId> {
        match st.conns.get(self.conn) {
            Some(c) if c.generation == self.generation => match &c.failed {
                Some(e) => Err(e.clone().context("endpoint unusable")),
                None => Ok(self.conn),
            },
            _ => Err(Error::new(Status::NotConnected, "endpoint closed")),
        }
    }
}

impl Endpoint {
    pub(crate) fn new(worker: Worker, conn: ConnId, generation: u32) -> Endpoint {
        Endpoint { worker, conn, generation }
    }

    pub fn worker(&self) -> &Worker {
        &self.worker
    }

    /// The lane this endpoint runs on.
    pub fn lane(&self) -> Result<LaneKind> {
        let st = self.worker.lock();
        self.usable(&st).map(|_| st.conns[self.conn].props.lane)
    }

    /// The connection if it is still this endpoint's and alive; the error names why not.
    fn usable(&self, st: &State) -> Result<ConnId> {
        self.key().usable(st)
    }

    pub(super) fn key(&self) -> EpKey {
        EpKey { conn: self.conn, generation: self.generation }
    }

    /// Send `len` bytes at `buf` with `tag`.
    ///
    /// # Safety
    /// `buf` must be valid for `len` bytes of reads until the request completes (for an eager
    /// send that is before this call returns), and not modified in the meantime.
    pub unsafe fn tag_send_nbx(&self, buf: *const u8, len: usize, tag: u64, params: RequestParams) -> Result<Started> {
        self.worker.check_aborted()?;
        check_buffer(buf, len, "tag_send_nbx")?;
        let (key, addr) = (self.key(), buf as usize);
        let mem = resolve_memtype(&params, addr, len)?;
        // The common small host send: straight into the link, no request (UCX's am_short path).
        if mem == MemType::Host
            && params.condition.is_none()
            && !params.no_immediate_completion
            && self.worker.try_send_short(key, tag, UserBuf::host(addr, len))
        {
            return Ok(Started::Done(RecvInfo::default()));
        }
        // A small GPU buffer of a stream or graph operation is staged: sent from its slot.
        let stage = self.worker.stage_for(&params, StageDir::Send, addr, len, mem)?;
        let (addr, mem) = match &stage {
            Some(s) => (s.host_data(), MemType::Host),
            None => (addr, mem),
        };
        // A GPU buffer read by the receiver travels with its IPC key, made here on the caller's
        // thread (with the copy stream) rather than later on the proxy.
        let gpu_key = match mem {
            MemType::Cuda => self.worker.prepare_gpu_send(self.key().conn, addr, len)?,
            MemType::Host => None,
        };
        self.worker.start_staged_op(ReqKind::Send, Some(self.conn), params, stage, move |st, req, out| {
            let conn = key.usable(st)?;
            let buf = UserBuf { addr, len, mem };
            let proto = st.engine.tag.protocol_for(conn, buf)?;
            // A host buffer offered for reading on a lane that reads by key (UCX): the link
            // opens it and the key rides in the RTS (in `device_key`'s place; the engine tells
            // them apart by memory type). The hold keeps the registration until the send
            // completes. A registration that fails only costs the zero copy: the receiver,
            // seeing no key, asks for a push.
            let exposed = match (proto, mem) {
                (ProtoId::RndvGet, MemType::Host) if st.conns[conn].props.lane.remote_needs_key() => {
                    st.conns[conn].link_ref().expose(addr, len).unwrap_or_else(|e| {
                        tracing::debug!(target: "gsc::core", error = %e, "send buffer not opened for remote reads; the receiver will ask for a push");
                        None
                    })
                }
                _ => None,
            };
            let (device_key, hold) = match (proto, exposed) {
                (_, Some(x)) => (Some(x.key), Some(x.hold)),
                (ProtoId::RndvGet, None) => (gpu_key.clone(), None),
                _ => (None, None),
            };
            st.engine.tag.send(out, conn, req, tag, buf, device_key)?;
            if let Some(h) = hold {
                st.exposed.insert(req, h);
            }
            Ok(())
        })
    }

    /// Blocking send (progresses until done or `GSC_TIMEOUT`).
    pub fn tag_send(&self, data: &[u8], tag: u64) -> Result<()> {
        // SAFETY: `data` is borrowed for the whole call; the request completes before return, or
        // on timeout `finish_blocking` ends the link so nothing refers to `data` afterwards.
        let started = unsafe { self.tag_send_nbx(data.as_ptr(), data.len(), tag, RequestParams::default())? };
        self.worker.finish_blocking(started, OnTimeout::Withdraw)?.into_result().map(|_| ())
    }

    /// Unpack a remote key received from this endpoint's peer.
    pub fn rkey_unpack(&self, packed: &[u8]) -> Result<Rkey> {
        let key = rkey_unpack(packed)?;
        let st = self.worker.lock();
        let conn = self.usable(&st)?;
        if let Some(peer) = st.conns[conn].peer_process
            && peer != key.owner
        {
            return Err(Error::invalid_param(format!(
                "remote key belongs to process {} but this endpoint leads to process {}",
                key.owner.pid, peer.pid
            )));
        }
        Ok(key)
    }

    /// Write `len` bytes at `buf` to `remote_addr` in the peer's region described by `rkey`.
    ///
    /// # Safety
    /// `buf` must be valid for `len` bytes of reads until the request completes.
    pub unsafe fn put_nbx(&self, buf: *const u8, len: usize, remote_addr: u64, rkey: &Rkey, params: RequestParams) -> Result<Started> {
        check_buffer(buf, len, "put_nbx")?;
        require_host_memory(&params, buf as usize, len, "put_nbx")?;
        check_range(rkey.base, rkey.len, remote_addr, len).map_err(|e| e.context("put_nbx"))?;
        let rkey = *rkey;
        let (key, addr) = (self.key(), buf as usize);
        self.worker.start_op(ReqKind::Put, Some(self.conn), params, move |st, req, out| {
            let conn = key.usable(st)?;
            let buf = addr as *const u8;
            let c = &st.conns[conn];
            // gscomm keys carry no lane key: a lane that reads by key (UCX) emulates.
            if c.props.remote_memory && !c.props.lane.remote_needs_key() {
                // SAFETY: `buf` is readable for `len` (caller contract); the remote range was
                // checked against the key, and the kernel checks it against the peer's mappings.
                unsafe { c.link_ref().write_remote(buf, remote_addr, len)? };
                out.push(Action::Complete { req, status: Status::Ok, info: RecvInfo::default() });
            } else {
                let max_frame = c.props.max_frame;
                st.engine.rma.put(out, conn, req, rkey.region, remote_addr, UserBuf::host(buf as usize, len), max_frame);
            }
            Ok(())
        })
    }

    /// Read `len` bytes at `remote_addr` of the peer's region described by `rkey` into `buf`.
    ///
    /// # Safety
    /// `buf` must be valid for `len` bytes of writes until the request completes.
    pub unsafe fn get_nbx(&self, buf: *mut u8, len: usize, remote_addr: u64, rkey: &Rkey, params: RequestParams) -> Result<Started> {
        check_buffer(buf, len, "get_nbx")?;
        require_host_memory(&params, buf as usize, len, "get_nbx")?;
        check_range(rkey.base, rkey.len, remote_addr, len).map_err(|e| e.context("get_nbx"))?;
        let rkey = *rkey;
        let (key, addr) = (self.key(), buf as usize);
        self.worker.start_op(ReqKind::Get, Some(self.conn), params, move |st, req, out| {
            let conn = key.usable(st)?;
            let buf = addr as *mut u8;
            let c = &st.conns[conn];
            // gscomm keys carry no lane key: a lane that reads by key (UCX) emulates.
            if c.props.remote_memory && !c.props.lane.remote_needs_key() {
                // SAFETY: as in `put_nbx`, with the buffer written instead of read.
                unsafe { c.link_ref().read_remote(buf, remote_addr, len)? };
                out.push(Action::Complete { req, status: Status::Ok, info: RecvInfo::default() });
            } else {
                st.engine.rma.get(out, conn, req, rkey.region, remote_addr, UserBuf::host(buf as usize, len));
            }
            Ok(())
        })
    }

    /// Completes when every earlier operation on this endpoint was applied at the peer; reports
    /// the first error an emulated remote access met.
    pub fn flush_nbx(&self, params: RequestParams) -> Result<Started> {
        let key = self.key();
        self.worker.start_op(ReqKind::Flush, Some(self.conn), params, move |st, req, out| {
            let conn = key.usable(st)?;
            st.engine.rma.flush(out, conn, req);
            Ok(())
        })
    }

    pub fn flush(&self) -> Result<()> {
        let s = self.flush_nbx(RequestParams::default())?;
        self.worker.finish_blocking(s, OnTimeout::Release)?.into_result().map(|_| ())
    }

    /// Close the endpoint. With `Flush`, completes once every send on it completed and the peer
    /// was told; with `Force`, at once. The endpoint is unusable afterwards either way.
    pub fn close_nbx(&self, mode: CloseMode, params: RequestParams) -> Result<Started> {
        let EpKey { conn, generation } = self.key();
        self.worker.start_op(ReqKind::Close, Some(self.conn), params, move |st, req, out| {
            match st.conns.get(conn) {
                Some(c) if c.generation == generation => {}
                _ => return Err(Error::new(Status::NotConnected, "endpoint already closed")),
            }
            if st.conns[conn].failed.is_some() || mode == CloseMode::Force {
                let e = Error::new(Status::Canceled, "endpoint closed by force");
                st.fail_conn(conn, e, out);
                st.conns.try_remove(conn);
                out.push(Action::Complete { req, status: Status::Ok, info: RecvInfo::default() });
            } else {
                st.begin_close(conn, req, out);
            }
            Ok(())
        })
    }

    /// Blocking close with flush.
    pub fn close(self) -> Result<()> {
        let s = self.close_nbx(CloseMode::Flush, RequestParams::default())?;
        self.worker.finish_blocking(s, OnTimeout::Release).and_then(Completion::into_result).map(|_| ())
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // Without a close the connection stays up for the peer; only the endpoint goes away.
        let mut st = self.worker.lock();
        if let Some(c) = st.conns.get_mut(self.conn)
            && c.generation == self.generation
        {
            c.has_user_ep = false;
            if c.failed.is_some() {
                st.conns.remove(self.conn);
            }
        }
    }
}
