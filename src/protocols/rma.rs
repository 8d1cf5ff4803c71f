//! One-sided put/get emulated with frames, and flush.
//!
//! Where a lane can write the peer's memory directly (cross-memory attach, loopback) the worker
//! does put/get itself and this module is not involved. Otherwise the data travels in `Put` /
//! `GetData` frames and the *target* applies them during its progress, after checking the access
//! against the memory it registered (it never trusts the initiator's address).
//!
//! Flush gives remote completion: links deliver in order, so when the target answers a `FlushReq`
//! every earlier frame on that link has been applied. The answer carries the first error any
//! emulated access met since the previous flush, so a bad put is reported, not lost.

use super::idmap::IdMap;
use super::select::MemType;
use super::tag::{Action, Actions, ConnId, OutFrame, OutFrameEq, Payload, RecvInfo, ReqId, UserBuf};
use super::wire::Header;
use crate::error::{Error, Result, Status};

/// The target side's view of its registered memory.
pub trait RegionLookup {
    /// Local address of `[addr, addr + len)` inside registered region `region`, or why not.
    fn resolve(&self, region: u64, addr: u64, len: usize) -> Result<usize>;
}

struct GetState {
    conn: ConnId,
    dst: UserBuf,
    received: usize,
}

#[derive(Default)]
pub struct RmaEngine {
    gets: IdMap<ReqId, GetState>,
    puts: IdMap<ReqId, ConnId>,
    flushes: IdMap<u64, (ConnId, ReqId)>,
    next_flush: u64,
    /// Target side: first error an emulated access from each link met since its last flush.
    errors: IdMap<ConnId, Status>,
}

fn send(out: &mut Actions, conn: ConnId, header: Header, payload: Payload, on_sent: Option<ReqId>) {
    out.push(Action::Transmit { conn, frame: OutFrameEq(OutFrame { header: header.encode(), payload, on_sent, copy_if_queued: false }) });
}

impl RmaEngine {
    pub fn in_flight(&self) -> usize {
        self.gets.len() + self.puts.len() + self.flushes.len()
    }

    /// Operations still in progress on `conn`.
    pub fn pending_on(&self, conn: ConnId) -> usize {
        self.gets.values().filter(|g| g.conn == conn).count()
            + self.puts.values().filter(|c| **c == conn).count()
            + self.flushes.values().filter(|(c, _)| *c == conn).count()
    }

    /// Emulated put of `src` to `addr` in the peer's `region`. Completes locally when the last
    /// frame is in the link; remote completion is a flush.
    pub fn put(&mut self, out: &mut Actions, conn: ConnId, req: ReqId, region: u64, addr: u64, src: UserBuf, max_frame: usize) {
        let room = max_frame.saturating_sub(Header::Put { region, addr }.encoded_len()).max(1);
        let mut off = 0;
        loop {
            let n = room.min(src.len - off);
            let last = off + n >= src.len;
            let payload = if n == 0 { Payload::None } else { Payload::User { addr: src.addr + off, len: n } };
            send(out, conn, Header::Put { region, addr: addr + off as u64 }, payload, last.then_some(req));
            off += n;
            if last {
                break;
            }
        }
        self.puts.insert(req, conn);
    }

    /// Emulated get of `dst.len` bytes at `addr` of the peer's `region` into `dst`.
    pub fn get(&mut self, out: &mut Actions, conn: ConnId, req: ReqId, region: u64, addr: u64, dst: UserBuf) {
        send(out, conn, Header::GetReq { req, region, addr, len: dst.len as u64 }, Payload::None, None);
        self.gets.insert(req, GetState { conn, dst, received: 0 });
    }

    /// Ask the peer to confirm every earlier frame on `conn` was applied.
    pub fn flush(&mut self, out: &mut Actions, conn: ConnId, req: ReqId) {
        let id = self.next_flush;
        self.next_flush += 1;
        send(out, conn, Header::FlushReq { id }, Payload::None, None);
        self.flushes.insert(id, (conn, req));
    }

    pub fn frame_sent(&mut self, out: &mut Actions, req: ReqId) {
        if self.puts.remove(&req).is_some() {
            out.push(Action::Complete { req, status: Status::Ok, info: RecvInfo::default() });
        }
    }

    /// Handle an RMA frame. Errors mean a protocol violation by the peer.
    pub fn on_frame(
        &mut self,
        out: &mut Actions,
        conn: ConnId,
        header: Header,
        payload: &[u8],
        max_frame: usize,
        regions: &dyn RegionLookup,
    ) -> Result<()> {
        match header {
            Header::Put { region, addr } => match regions.resolve(region, addr, payload.len()) {
                Ok(dst) => out.push(Action::CopyFromFrame { dst, mem: MemType::Host, src_offset: 0, len: payload.len() }),
                Err(e) => {
                    tracing::debug!(target: "gsc::proto", error = %e, "emulated put refused");
                    self.errors.entry(conn).or_insert(e.status());
                }
            },
            Header::GetReq { req, region, addr, len } => {
                let len = usize::try_from(len).map_err(|_| bad("get length overflows"))?;
                match regions.resolve(region, addr, len) {
                    Ok(src) => {
                        let room = max_frame.saturating_sub(Header::GetData { req, offset: 0, status: 0 }.encoded_len()).max(1);
                        let mut off = 0;
                        while off < len {
                            let n = room.min(len - off);
                            let h = Header::GetData { req, offset: off as u64, status: 0 };
                            send(out, conn, h, Payload::User { addr: src + off, len: n }, None);
                            off += n;
                        }
                        if len == 0 {
                            send(out, conn, Header::GetData { req, offset: 0, status: 0 }, Payload::None, None);
                        }
                    }
                    Err(e) => send(out, conn, Header::GetData { req, offset: 0, status: e.status().code() }, Payload::None, None),
                }
            }
            Header::GetData { req, offset, status } => {
                let Some(g) = self.gets.get_mut(&req) else {
                    return Err(bad("get data for an unknown request"));
                };
                if g.conn != conn {
                    return Err(bad("get data on the wrong link"));
                }
                if status != 0 {
                    let s = Status::from_code(status).filter(|s| s.is_error()).unwrap_or(Status::Internal);
                    self.gets.remove(&req);
                    out.push(Action::Complete { req, status: s, info: RecvInfo::default() });
                    return Ok(());
                }
                let offset = offset as usize;
                if offset.checked_add(payload.len()).is_none_or(|end| end > g.dst.len) {
                    return Err(bad("get data past the requested range"));
                }
                if !payload.is_empty() {
                    out.push(Action::CopyFromFrame { dst: g.dst.addr + offset, mem: g.dst.mem, src_offset: 0, len: payload.len() });
                }
                g.received += payload.len();
                if g.received >= g.dst.len {
                    self.gets.remove(&req);
                    out.push(Action::Complete { req, status: Status::Ok, info: RecvInfo::default() });
                }
            }
            Header::FlushReq { id } => {
                let status = self.errors.remove(&conn).unwrap_or(Status::Ok);
                send(out, conn, Header::FlushAck { id, status: status.code() }, Payload::None, None);
            }
            Header::FlushAck { id, status } => {
                if let Some((_, req)) = self.flushes.remove(&id) {
                    let s = Status::from_code(status).unwrap_or(Status::Internal);
                    out.push(Action::Complete { req, status: s, info: RecvInfo::default() });
                }
            }
            other => return Err(bad(&format!("{other:?} is not an RMA frame"))),
        }
        Ok(())
    }

    /// Fail everything waiting on `conn`.
    pub fn conn_failed(&mut self, out: &mut Actions, conn: ConnId, status: Status) {
        let mut reqs: Vec<ReqId> = Vec::new();
        self.gets.retain(|r, g| {
            let keep = g.conn != conn;
            if !keep {
                reqs.push(*r);
            }
            keep
        });
        self.puts.retain(|r, c| {
            let keep = *c != conn;
            if !keep {
                reqs.push(*r);
            }
            keep
        });
        self.flushes.retain(|_, (c, r)| {
            let keep = *c != conn;
            if !keep {
                reqs.push(*r);
            }
            keep
        });
        self.errors.remove(&conn);
        reqs.sort_unstable();
        for req in reqs {
            out.push(Action::Complete { req, status, info: RecvInfo::default() });
        }
    }
}

fn bad(what: &str) -> Error {
    Error::new(Status::ConnectionReset, format!("protocol violation by peer: {what}"))
}
