//! The shared-memory layouts of the two segment kinds and the accept-slot protocol.
//!
//! Every field that one process writes while another may read it is an atomic, so references to
//! these structures are sound however the peer behaves; plain data is published by a Release
//! store of a state word and read after an Acquire load of it.
//!
//! **Worker segment** (one per listener): a header line, then `ACCEPT_SLOTS` slots through which
//! connectors post requests. A slot's state goes `FREE -> WRITING(pid) -> READY -> FREE`: the
//! connector claims it by CAS, fills it, marks it READY (Release) and bumps `posted`; the listener
//! copies it out and frees it. A connector that dies while WRITING is detected by its pid, and its
//! slot is reclaimed by the next connector that finds all slots busy.
//!
//! **Connection segment** (one per link, created by the connector): a control block (one line per
//! side: open/closed state, identity, CMA probe; one line of ring geometry; one heartbeat line
//! per side), then ring 0 (connector to acceptor) and ring 1 (acceptor to connector).

use std::mem::size_of;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};

use crate::error::{Error, Result, Status};
use crate::transport::ProcessIdentity;
use crate::transport::shm::ring;

pub const ACCEPT_SLOTS: usize = 64;
/// Longest connection segment path a slot carries.
pub const SLOT_PATH_MAX: usize = 480;

pub const SLOT_FREE: u64 = 0;
pub const SLOT_READY: u64 = 2;
const SLOT_WRITING: u64 = 1;

/// The WRITING state of a slot claimed by process `pid`.
pub fn slot_writing(pid: u32) -> u64 {
    SLOT_WRITING | (u64::from(pid) << 32)
}

/// The pid in a WRITING state, if `state` is one.
pub fn slot_writer(state: u64) -> Option<u32> {
    (state & 0xffff_ffff == SLOT_WRITING).then_some((state >> 32) as u32)
}

#[repr(C, align(64))]
pub struct WorkerHead {
    /// Requests ever posted; lets `accept` skip the slot scan when nothing is new.
    pub posted: AtomicU64,
    /// Set when the listener goes away, so connectors stop posting.
    pub closed: AtomicU32,
    pub nslots: AtomicU32,
    pub uuid: [AtomicU64; 2],
}

#[repr(C, align(64))]
pub struct AcceptSlot {
    pub state: AtomicU64,
    pub uuid: [AtomicU64; 2],
    pub path_len: AtomicU32,
    pub path: [AtomicU8; SLOT_PATH_MAX],
}

#[repr(C)]
pub struct WorkerArea {
    pub head: WorkerHead,
    pub slots: [AcceptSlot; ACCEPT_SLOTS],
}

pub const WORKER_AREA_SIZE: usize = size_of::<WorkerArea>();

pub fn store_u128(dst: &[AtomicU64; 2], v: u128) {
    dst[0].store(v as u64, Ordering::Relaxed);
    dst[1].store((v >> 64) as u64, Ordering::Relaxed);
}

pub fn load_u128(src: &[AtomicU64; 2]) -> u128 {
    u128::from(src[0].load(Ordering::Relaxed)) | (u128::from(src[1].load(Ordering::Relaxed)) << 64)
}

impl AcceptSlot {
    /// Fill a slot we hold in WRITING state. Published by the caller's Release store of READY.
    pub fn fill(&self, uuid: u128, path: &[u8]) {
        store_u128(&self.uuid, uuid);
        for (d, &s) in self.path.iter().zip(path) {
            d.store(s, Ordering::Relaxed);
        }
        self.path_len.store(path.len().min(SLOT_PATH_MAX) as u32, Ordering::Relaxed);
    }

    /// Copy out a slot observed READY (with Acquire).
    pub fn read(&self) -> (u128, Vec<u8>) {
        let len = (self.path_len.load(Ordering::Relaxed) as usize).min(SLOT_PATH_MAX);
        let path = self.path[..len].iter().map(|b| b.load(Ordering::Relaxed)).collect();
        (load_u128(&self.uuid), path)
    }
}

/// Side state values (`SideInfo::state`), written only by that side.
pub const SIDE_OPEN: u32 = 0;
pub const SIDE_CLOSED: u32 = 1;
/// The acceptor refused the connection (e.g. CMA required but unavailable).
pub const SIDE_REJECTED: u32 = 2;

#[repr(C, align(64))]
pub struct SideInfo {
    pub state: AtomicU32,
    pub pid: AtomicU32,
    pub start_time: AtomicU64,
    pub cookie_addr: AtomicU64,
    pub cookie_value: AtomicU64,
    pub uuid: [AtomicU64; 2],
}

impl SideInfo {
    pub fn set_identity(&self, id: ProcessIdentity, cookie: (u64, u64), uuid: u128) {
        self.pid.store(id.pid, Ordering::Relaxed);
        self.start_time.store(id.start_time, Ordering::Relaxed);
        self.cookie_addr.store(cookie.0, Ordering::Relaxed);
        self.cookie_value.store(cookie.1, Ordering::Relaxed);
        store_u128(&self.uuid, uuid);
    }

    pub fn identity(&self) -> ProcessIdentity {
        ProcessIdentity { pid: self.pid.load(Ordering::Relaxed), start_time: self.start_time.load(Ordering::Relaxed) }
    }
}

#[repr(C, align(64))]
pub struct Geometry {
    pub ring_capacity: AtomicU64,
    pub max_frame: AtomicU64,
}

/// One side's heartbeat, written only by that side, on a line of its own: the peer reads the
/// side's `state` line on every progress pass, and that line must stay read-mostly.
///
/// The peer judges by whether `count` moves, timed on its own clock, so the two processes need
/// no common clock (a time namespace may shift CLOCK_MONOTONIC between them).
#[repr(C, align(64))]
pub struct Heartbeat {
    /// Beats so far.
    pub count: AtomicU64,
    /// 0: no promise — nothing beats while the application does not progress the worker (no
    /// proxy thread), so silence means nothing. Otherwise the promise: a thread of this side's
    /// process beats at least every this many milliseconds, whatever the application does.
    pub period_ms: AtomicU64,
}

#[repr(C)]
pub struct ConnCtrl {
    /// Index 0: the connector; 1: the acceptor.
    pub sides: [SideInfo; 2],
    pub geometry: Geometry,
    /// Indexed like `sides`. Zero in a fresh segment: no promise until a side makes one.
    pub beats: [Heartbeat; 2],
}

pub const CTRL_SIZE: usize = size_of::<ConnCtrl>();
const _: () = assert!(CTRL_SIZE % 64 == 0);

/// Payload bytes of a connection segment with rings of `capacity` bytes.
pub fn connection_size(capacity: usize) -> usize {
    CTRL_SIZE + 2 * ring::region_size(capacity)
}

/// Offset in the payload of ring `i` (0: connector to acceptor, 1: back).
pub fn ring_offset(capacity: usize, i: usize) -> usize {
    CTRL_SIZE + i * ring::region_size(capacity)
}

/// Read and check the geometry of a connection segment whose payload is `payload_len` bytes.
pub fn geometry(ctrl: &ConnCtrl, payload_len: usize) -> Result<(usize, usize)> {
    let cap = usize::try_from(ctrl.geometry.ring_capacity.load(Ordering::Relaxed)).unwrap_or(usize::MAX);
    let max = usize::try_from(ctrl.geometry.max_frame.load(Ordering::Relaxed)).unwrap_or(0);
    ring::validate(cap, max).map_err(|e| Error::new(Status::InvalidAddress, format!("connection segment: {}", e.message())))?;
    if connection_size(cap) != payload_len {
        return Err(Error::new(
            Status::InvalidAddress,
            format!("connection segment of {payload_len} bytes does not hold two {cap}-byte rings"),
        ));
    }
    Ok((cap, max))
}
