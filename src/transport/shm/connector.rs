//! The connector's half of connection setup: create the connection segment and post a request
//! into one of the listener's accept slots.

use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::error::{Error, Result, Status};
use crate::transport::shm::address::ShmAddress;
use crate::transport::shm::layout::{self, ACCEPT_SLOTS, SLOT_FREE, SLOT_PATH_MAX, SLOT_READY, WorkerArea, slot_writer, slot_writing};
use crate::transport::shm::link::{ShmLink, Side};
use crate::transport::shm::listener::{absolute_dir, conn_ctrl, worker_area};
use crate::transport::shm::segment::{Segment, SegmentKind};
use crate::transport::shm::{ShmConfig, cma};
use crate::transport::{Link, ProcessIdentity, proc_identity};

/// How long to sleep between scans while every accept slot is busy.
const SLOT_RETRY: Duration = Duration::from_millis(1);

/// Connect to the listener described by `blob`. Returns at once after posting the request:
/// frames may be sent before the listener accepts (they wait in the ring).
pub fn connect(blob: &[u8], my_worker_uuid: u128, cfg: &ShmConfig) -> Result<Box<dyn Link>> {
    Ok(Box::new(connect_link(blob, my_worker_uuid, cfg)?))
}

/// `connect`, returning the concrete link type.
pub fn connect_link(blob: &[u8], my_worker_uuid: u128, cfg: &ShmConfig) -> Result<ShmLink> {
    let addr = ShmAddress::decode(blob)?;
    cfg.validate()?;
    if addr.host_id != proc_identity::host_id() {
        return Err(Error::new(
            Status::Unreachable,
            format!("shm: listener pid {} is on another host (or network namespace)", addr.listener.pid),
        ));
    }
    if addr.pid_ns != proc_identity::pid_namespace() {
        return Err(Error::new(
            Status::Unreachable,
            format!("shm: listener pid {} is in another pid namespace (liveness checks need a shared one)", addr.listener.pid),
        ));
    }
    let listener_gone = || Error::new(Status::PeerFailed, format!("shm listener pid {} is gone", addr.listener.pid));
    // A killed listener leaves its segment behind; do not post into it.
    if !proc_identity::is_alive(&addr.listener) {
        return Err(listener_gone());
    }
    let worker = Segment::open(&addr.segment, SegmentKind::Worker).map_err(|e| {
        if !proc_identity::is_alive(&addr.listener) {
            listener_gone()
        } else if e.status() == Status::InvalidAddress {
            e
        } else {
            Error::new(Status::Unreachable, format!("shm listener segment: {}", e.message()))
        }
    })?;
    if worker.creator() != addr.listener {
        return Err(Error::new(
            Status::InvalidAddress,
            format!(
                "stale shm address: {} belongs to {:?}, the address names {:?}",
                addr.segment.display(),
                worker.creator(),
                addr.listener
            ),
        ));
    }
    let area = worker_area(&worker)?;
    if area.head.nslots.load(Ordering::Acquire) as usize != ACCEPT_SLOTS || layout::load_u128(&area.head.uuid) != addr.listener_uuid {
        return Err(Error::new(Status::InvalidAddress, format!("{} is not the listener the address names", addr.segment.display())));
    }
    let cma = cma::decide(cfg.cma, addr.listener.pid, addr.cookie_addr, addr.cookie_value)?;

    let dir = absolute_dir(&cfg.dir)?;
    // Name length is fixed ("gsc-" + 32 hex), so the path length is known before creating.
    if dir.as_os_str().len() + 1 + 36 > SLOT_PATH_MAX {
        return Err(Error::new(Status::InvalidConfig, format!("shm directory path {} is too long (max {SLOT_PATH_MAX})", dir.display())));
    }
    let seg = Segment::create(&dir, SegmentKind::Connection, layout::connection_size(cfg.ring_size))?;
    let path = seg.path().as_os_str().as_bytes().to_vec();
    let ctrl = conn_ctrl(&seg)?;
    ctrl.sides[Side::Connector as usize].set_identity(seg.creator(), cma::cookie(), my_worker_uuid);
    ctrl.geometry.ring_capacity.store(cfg.ring_size as u64, Ordering::Relaxed);
    ctrl.geometry.max_frame.store(cfg.max_frame as u64, Ordering::Relaxed);
    // On error from here, dropping the link drops the segment, which unlinks it.
    let link = ShmLink::new(seg, Side::Connector, addr.listener, cma, cfg.heartbeat_timeout)?;
    post(area, my_worker_uuid, &path, &addr.listener, cfg.connect_timeout)?;
    tracing::debug!(target: "gsc::shm", listener = addr.listener.pid, cma, "shm connect posted");
    Ok(link)
}

/// Post a request into a free accept slot, waiting while all are busy and the listener lives.
fn post(area: &WorkerArea, uuid: u128, path: &[u8], listener: &ProcessIdentity, timeout: Duration) -> Result<()> {
    let closed = || Error::new(Status::ConnectionReset, format!("shm listener pid {} closed before accepting", listener.pid));
    let me = std::process::id();
    let deadline = Instant::now() + timeout;
    loop {
        if area.head.closed.load(Ordering::SeqCst) != 0 {
            return Err(closed());
        }
        for slot in &area.slots {
            if slot.state.compare_exchange(SLOT_FREE, slot_writing(me), Ordering::Acquire, Ordering::Relaxed).is_err() {
                continue;
            }
            slot.fill(uuid, path);
            // SeqCst: pairs with the listener's drop (store closed, then scan slots).
            slot.state.store(SLOT_READY, Ordering::SeqCst);
            area.head.posted.fetch_add(1, Ordering::SeqCst);
            if area.head.closed.load(Ordering::SeqCst) != 0 {
                // Withdraw; if the listener took it first, it has marked the link closed.
                let _ = slot.state.compare_exchange(SLOT_READY, SLOT_FREE, Ordering::Relaxed, Ordering::Relaxed);
                return Err(closed());
            }
            return Ok(());
        }
        // All slots busy. Free the ones held by connectors that died while writing them.
        for slot in &area.slots {
            let s = slot.state.load(Ordering::Relaxed);
            if let Some(pid) = slot_writer(s)
                && pid != me
                && matches!(proc_identity::read(pid), Ok(None))
            {
                tracing::info!(target: "gsc::shm", pid, "reclaiming accept slot of dead connector");
                let _ = slot.state.compare_exchange(s, SLOT_FREE, Ordering::Relaxed, Ordering::Relaxed);
            }
        }
        if !proc_identity::is_alive(listener) {
            return Err(Error::new(Status::PeerFailed, format!("shm listener pid {} died while all accept slots were busy", listener.pid)));
        }
        if Instant::now() >= deadline {
            return Err(Error::new(
                Status::TimedOut,
                format!("all {ACCEPT_SLOTS} accept slots of shm listener pid {} stayed busy for {timeout:?}", listener.pid),
            ));
        }
        std::thread::sleep(SLOT_RETRY);
    }
}
