//! `UcxListener`: turns the hellos that arrive at a worker into links.

use std::sync::Arc;
use std::time::Duration;

use super::address::UcxAddress;
use super::engine::Engine;
use super::inbox::Key;
use super::link::UcxLink;
use super::wire::{self, CloseReason, HEADER_LEN, Hello, Kind};
use crate::error::{Error, Result, Status};
use crate::transport::{LaneKind, Link, Listener};

/// How often an otherwise idle UCX worker is progressed by its listener.
const IDLE_PROGRESS: Duration = Duration::from_millis(1);

pub struct UcxListener {
    engine: Arc<Engine>,
}

impl UcxListener {
    pub(crate) fn new(engine: Arc<Engine>) -> UcxListener {
        UcxListener { engine }
    }

    /// Make the acceptor's side of the link a hello asks for: an endpoint back to the connector.
    fn accept_one(&self, key: Key, hello: &Hello) -> Result<UcxLink> {
        let connector = UcxAddress::decode(&hello.connector_address)?;
        if connector.uuid != key.link.connector {
            return Err(Error::new(
                Status::InvalidAddress,
                format!(
                    "hello of link {:032x}/{} carries the address of worker {:032x}",
                    key.link.connector, key.link.number, connector.uuid
                ),
            ));
        }
        let ep = self.engine.create_ep(&connector.worker_address, key)?;
        let mut link = UcxLink::new(self.engine.clone(), ep, key, connector.uuid);
        if hello.listener != self.engine.uuid() {
            // A stale address (a previous worker's): tell the connector instead of letting it
            // wait; dropping the link closes the endpoint after the notice.
            let why = format!("worker {:032x} is not {:032x}", self.engine.uuid(), hello.listener);
            let mut buf = vec![0u8; HEADER_LEN];
            buf.extend_from_slice(&wire::encode_close(CloseReason::Rejected, &why));
            link.post(Kind::Close, buf)?;
            return Err(Error::new(Status::Rejected, format!("UCX connection for another worker refused: {why}")));
        }
        Ok(link)
    }
}

impl Listener for UcxListener {
    fn lane(&self) -> LaneKind {
        LaneKind::Ucx
    }

    fn address_blob(&self) -> Vec<u8> {
        self.engine.blob().to_vec()
    }

    /// Progresses UCX when nothing else did for a millisecond: hellos arrive only through
    /// progress, and a worker without UCX links has nothing else that would make it. (Links
    /// progress on every poll that finds nothing, so a worker with UCX traffic pays nothing
    /// here; one whose traffic is all on shm pays one idle UCX progress per millisecond.)
    fn accept(&mut self) -> Result<Option<(u128, Box<dyn Link>)>> {
        if self.engine.progress_if_idle_for(IDLE_PROGRESS).is_some() {
            self.engine.collect_orphans();
        }
        let Some((key, hello)) = self.engine.with_inbox(|ib| ib.take_hello()) else {
            return Ok(None);
        };
        match self.accept_one(key, &hello) {
            Ok(link) => {
                tracing::debug!(target: "gsc::ucx", peer = %format_args!("{:032x}", key.link.connector), "UCX link accepted");
                Ok(Some((key.link.connector, Box::new(link))))
            }
            Err(e) => {
                self.engine.with_inbox(|ib| ib.remove(&key));
                Err(e)
            }
        }
    }
}
