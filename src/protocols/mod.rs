//! Protocols: tag matching, the protocol registry and selection table, and the state machines
//! that move tagged messages (eager-short, eager-copy, rendezvous get and pipeline) and emulated
//! one-sided operations.
//!
//! Nothing in here does I/O or reads a clock: `Engine` takes events and emits `Action`s, which the
//! worker (src/core/worker.rs) executes against links and user memory. That is what lets the unit
//! tests at the bottom of this file run whole conversations between two engines with no processes.

pub mod idmap;
pub mod matching;
pub mod prepared;
pub mod rma;
pub mod rndv_tuner;
pub mod select;
pub mod tag;
pub mod wire;

pub use rma::RegionLookup;
pub use select::{EngineOffer, EngineQuery, LaneProps, MemType, ProtoConfig, ProtoId, RndvScheme};
pub use tag::{Action, Actions, ConnId, EagerDelivery, OutFrame, Payload, ProbeInfo, RecvInfo, ReqId, UserBuf};

use crate::error::{Error, Result, Status};
use idmap::IdMap;
use wire::Header;

/// The tag and RMA state machines behind one front door, with the per-link facts they share.
pub struct Engine {
    pub tag: tag::TagEngine,
    pub rma: rma::RmaEngine,
    pub prepared: prepared::PreparedEngine,
    links: IdMap<ConnId, LaneProps>,
}

impl Engine {
    pub fn new(cfg: ProtoConfig) -> Engine {
        Engine {
            tag: tag::TagEngine::new(cfg),
            rma: rma::RmaEngine::default(),
            prepared: prepared::PreparedEngine::new(cfg),
            links: IdMap::default(),
        }
    }

    /// A new link to worker `peer` (its uuid).
    pub fn add_conn(&mut self, conn: ConnId, props: LaneProps, peer: u128) {
        self.links.insert(conn, props);
        self.tag.add_conn(conn, props);
        self.prepared.add_conn(conn, props, peer);
    }

    pub fn conn_props(&self, conn: ConnId) -> Option<LaneProps> {
        self.links.get(&conn).copied()
    }

    pub fn in_flight(&self) -> usize {
        self.tag.in_flight() + self.rma.in_flight() + self.prepared.in_flight()
    }

    /// Dispatch one received frame by kind.
    pub fn on_frame(&mut self, out: &mut Actions, conn: ConnId, frame: &[u8], regions: &dyn RegionLookup) -> Result<FrameOutcome> {
        let (header, payload) =
            Header::decode(frame).map_err(|e| Error::new(Status::ConnectionReset, format!("malformed frame from peer: {e}")))?;
        match header {
            Header::Put { .. } | Header::GetReq { .. } | Header::GetData { .. } | Header::FlushReq { .. } | Header::FlushAck { .. } => {
                let max_frame = self.links.get(&conn).map(|p| p.max_frame).unwrap_or(4096);
                self.rma.on_frame(out, conn, header, payload, max_frame, regions)?;
            }
            Header::PrepHello { .. } | Header::PrepReady { .. } | Header::PrepData { .. } | Header::PrepBye { .. } => {
                self.prepared.on_frame(out, conn, header, payload)?;
            }
            Header::Close => return Ok(FrameOutcome::PeerClosed),
            _ => self.tag.on_frame(out, conn, header, payload)?,
        }
        Ok(FrameOutcome::Handled)
    }

    pub fn frame_sent(&mut self, out: &mut Actions, req: ReqId) {
        self.tag.frame_sent(out, req);
        self.rma.frame_sent(out, req);
        self.prepared.frame_sent(out, req);
    }

    pub fn conn_failed(&mut self, out: &mut Actions, conn: ConnId, status: Status) {
        self.tag.conn_failed(out, conn, status);
        self.rma.conn_failed(out, conn, status);
        self.prepared.conn_failed(out, conn, status);
        self.links.remove(&conn);
    }
}

/// The selection table for a configuration, as `gsc-info -p` prints it: one block per enabled
/// lane and memory type. For shm with `GSC_CMA=auto` both outcomes of the per-peer CMA probe
/// are shown, since which one applies is only known when a peer connects.
pub fn selection_table(cfg: &crate::Config) -> String {
    use crate::config::Tristate;
    use crate::transport::LaneKind;
    let proto = ProtoConfig { eager_short_max: cfg.eager_short_max, rndv_thresh: cfg.rndv_thresh, rndv_scheme: cfg.rndv_scheme };
    let device_ipc = cfg.cuda_ipc != Tristate::Off;
    let mut lanes = Vec::new();
    for lane in &cfg.tls {
        match lane {
            LaneKind::Loopback => {
                lanes.push(LaneProps { lane: *lane, max_frame: crate::transport::loopback::MAX_FRAME, remote_memory: true, device_ipc })
            }
            LaneKind::Shm => {
                if cfg.cma != Tristate::Off {
                    lanes.push(LaneProps { lane: *lane, max_frame: cfg.shm_max_frame, remote_memory: true, device_ipc });
                }
                if cfg.cma != Tristate::On {
                    lanes.push(LaneProps { lane: *lane, max_frame: cfg.shm_max_frame, remote_memory: false, device_ipc });
                }
            }
            // Remote memory by key (host buffers read by ucp_get_nbx); CUDA IPC never reaches
            // another host.
            LaneKind::Ucx => lanes.push(LaneProps { lane: *lane, max_frame: cfg.ucx_max_frame, remote_memory: true, device_ipc: false }),
        }
    }
    let mut table = select::describe(&proto, &lanes);
    // Whether the GPUs reach each other is only known with a driver; without one the table
    // says so and shows what would run where they do.
    let p2p = crate::cuda::init().ok().and_then(|()| crate::cuda::peer_access_everywhere().ok());
    table += &select::describe_engine(cfg.engine, cfg.engine_gpu_max, device_ipc, p2p, &cfg.tls);
    table
}

/// What a received frame meant for the link itself.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FrameOutcome {
    Handled,
    /// The peer closed its endpoint gracefully; no more frames follow on this link.
    PeerClosed,
}

#[cfg(test)]
mod tests;
