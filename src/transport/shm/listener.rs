//! `ShmListener`: a worker's accept slots, and the acceptor's half of connection setup.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use crate::error::{Error, Result, Status};
use crate::transport::shm::address::ShmAddress;
use crate::transport::shm::layout::{self, ACCEPT_SLOTS, ConnCtrl, SIDE_CLOSED, SIDE_REJECTED, SLOT_FREE, SLOT_READY, WorkerArea};
use crate::transport::shm::link::{ShmLink, Side};
use crate::transport::shm::segment::{self, Segment, SegmentKind};
use crate::transport::shm::{ShmConfig, cma};
use crate::transport::{LaneKind, Link, Listener, proc_identity};

/// The worker area of a worker segment, if the segment is large enough to hold one.
pub(crate) fn worker_area(seg: &Segment) -> Result<&WorkerArea> {
    if seg.payload_len() < layout::WORKER_AREA_SIZE {
        return Err(Error::new(Status::InvalidAddress, format!("{} is too small for a worker segment", seg.path().display())));
    }
    // SAFETY: size checked above; the payload is 64-byte aligned; every field is atomic, so a
    // shared reference is sound while other processes write it; it borrows `seg`, which keeps the
    // mapping alive.
    Ok(unsafe { &*seg.payload().cast::<WorkerArea>() })
}

/// The control block of a connection segment, if the segment is large enough to hold one.
pub(crate) fn conn_ctrl(seg: &Segment) -> Result<&ConnCtrl> {
    if seg.payload_len() < layout::CTRL_SIZE {
        return Err(Error::new(Status::InvalidAddress, format!("{} is too small for a connection segment", seg.path().display())));
    }
    // SAFETY: as in `worker_area`.
    Ok(unsafe { &*seg.payload().cast::<ConnCtrl>() })
}

/// Directories are made absolute once, since segment paths travel to other processes.
pub(crate) fn absolute_dir(dir: &Path) -> Result<PathBuf> {
    // InvalidConfig must name the variable to fix (the config module's rule for every knob);
    // the directory comes from GSC_SHM_DIR.
    std::fs::canonicalize(dir).map_err(|e| Error::new(Status::InvalidConfig, format!("GSC_SHM_DIR: shm directory {}: {e}", dir.display())))
}

/// A worker's shared-memory listener: peers on this host post connection requests into its
/// segment's accept slots, and `accept` turns them into links.
pub struct ShmListener {
    seg: Segment,
    cfg: ShmConfig,
    uuid: u128,
    /// Value of `posted` at the last scan that found nothing.
    last_posted: u64,
    blob: Vec<u8>,
}

impl ShmListener {
    /// Create the worker segment in `cfg.dir`. Segments left there by dead processes are removed
    /// first, so crashed runs do not accumulate in /dev/shm.
    pub fn new(cfg: &ShmConfig, my_worker_uuid: u128) -> Result<ShmListener> {
        cfg.validate()?;
        let mut cfg = cfg.clone();
        cfg.dir = absolute_dir(&cfg.dir)?;
        let removed = segment::cleanup_stale(&cfg.dir);
        if removed > 0 {
            tracing::info!(target: "gsc::shm", removed, dir = %cfg.dir.display(), "removed stale segments");
        }
        let seg = Segment::create(&cfg.dir, SegmentKind::Worker, layout::WORKER_AREA_SIZE)?;
        let area = worker_area(&seg)?;
        layout::store_u128(&area.head.uuid, my_worker_uuid);
        // Release: a connector that reads `nslots` (Acquire) also sees the uuid.
        area.head.nslots.store(ACCEPT_SLOTS as u32, Ordering::Release);
        let (cookie_addr, cookie_value) = cma::cookie();
        let blob = ShmAddress {
            host_id: proc_identity::host_id(),
            pid_ns: proc_identity::pid_namespace(),
            listener: seg.creator(),
            listener_uuid: my_worker_uuid,
            cookie_addr,
            cookie_value,
            segment: seg.path().to_path_buf(),
        }
        .encode()?;
        tracing::debug!(target: "gsc::shm", path = %seg.path().display(), "shm listener ready");
        Ok(ShmListener { seg, cfg, uuid: my_worker_uuid, last_posted: 0, blob })
    }

    /// Path of the worker segment.
    pub fn path(&self) -> &Path {
        self.seg.path()
    }

    /// Map a requested connection and build our side of it.
    fn accept_one(&self, uuid: u128, path: &[u8]) -> Result<ShmLink> {
        let path = Path::new(OsStr::from_bytes(path));
        if !path.is_absolute() {
            return Err(Error::new(Status::InvalidAddress, format!("connection path {} is not absolute", path.display())));
        }
        let seg = Segment::open(path, SegmentKind::Connection)?;
        // Both sides have it mapped now; the name is no longer needed.
        if let Err(e) = seg.unlink() {
            tracing::warn!(target: "gsc::shm", error = %e, "connection segment not unlinked");
        }
        let ctrl = conn_ctrl(&seg)?;
        layout::geometry(ctrl, seg.payload_len())?;
        let conn = &ctrl.sides[Side::Connector as usize];
        let peer = conn.identity();
        if peer != seg.creator() || layout::load_u128(&conn.uuid) != uuid {
            return Err(Error::new(
                Status::InvalidAddress,
                format!("{}: connector identity {peer:?} / uuid does not match the request", path.display()),
            ));
        }
        let mine = &ctrl.sides[Side::Acceptor as usize];
        let cma = match cma::decide(
            self.cfg.cma,
            peer.pid,
            conn.cookie_addr.load(Ordering::Relaxed),
            conn.cookie_value.load(Ordering::Relaxed),
        ) {
            Ok(c) => c,
            Err(e) => {
                mine.state.store(SIDE_REJECTED, Ordering::Release);
                return Err(e);
            }
        };
        mine.set_identity(proc_identity::current(), cma::cookie(), self.uuid);
        ShmLink::new(seg, Side::Acceptor, peer, cma, self.cfg.heartbeat_timeout)
    }

    /// Tell a connector whose request will never be accepted that the connection is closed.
    fn refuse_pending(path: &[u8]) {
        let path = Path::new(OsStr::from_bytes(path));
        match Segment::open(path, SegmentKind::Connection) {
            Ok(seg) => {
                if let Ok(ctrl) = conn_ctrl(&seg) {
                    ctrl.sides[Side::Acceptor as usize].state.store(SIDE_CLOSED, Ordering::Release);
                }
                let _ = seg.unlink();
            }
            Err(e) => tracing::debug!(target: "gsc::shm", error = %e, "pending request gone"),
        }
    }
}

impl Listener for ShmListener {
    fn lane(&self) -> LaneKind {
        LaneKind::Shm
    }

    fn address_blob(&self) -> Vec<u8> {
        self.blob.clone()
    }

    /// Requests that cannot be honored (the connector vanished, a bad segment, CMA required but
    /// unavailable) are logged and skipped; the connector sees the refusal on its link.
    fn accept(&mut self) -> Result<Option<(u128, Box<dyn Link>)>> {
        let area = worker_area(&self.seg)?;
        let posted = area.head.posted.load(Ordering::Acquire);
        if posted == self.last_posted {
            return Ok(None);
        }
        for slot in &area.slots {
            if slot.state.load(Ordering::Acquire) != SLOT_READY {
                continue;
            }
            let (uuid, path) = slot.read();
            slot.state.store(SLOT_FREE, Ordering::Release);
            match self.accept_one(uuid, &path) {
                Ok(link) => {
                    tracing::debug!(target: "gsc::shm", peer_uuid = %format_args!("{uuid:032x}"),
                        cma = link.caps().remote_memory, "shm link accepted");
                    // `posted` is not recorded: other slots may be ready too.
                    return Ok(Some((uuid, Box::new(link))));
                }
                Err(e) => tracing::warn!(target: "gsc::shm", error = %e, "shm connection refused"),
            }
        }
        self.last_posted = posted;
        Ok(None)
    }
}

impl Drop for ShmListener {
    fn drop(&mut self) {
        let Ok(area) = worker_area(&self.seg) else {
            return;
        };
        // SeqCst pairs with the connector's SeqCst post-then-check: either we see its READY slot
        // here, or it sees `closed` and withdraws the request.
        area.head.closed.store(1, Ordering::SeqCst);
        for slot in &area.slots {
            if slot.state.load(Ordering::SeqCst) == SLOT_READY {
                let (_, path) = slot.read();
                if slot.state.compare_exchange(SLOT_READY, SLOT_FREE, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                    ShmListener::refuse_pending(&path);
                }
            }
        }
        // Dropping `seg` unlinks the worker segment.
    }
}
