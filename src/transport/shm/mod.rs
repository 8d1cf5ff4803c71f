//! The shared-memory lane: links between processes on one host.
//!
//! - Frames travel through two SPSC rings (one per direction) in a *connection segment* that the
//!   connecting side creates in the shm directory (`ring`, `layout`).
//! - A listener owns a *worker segment* with accept slots; a connector posts the path of its
//!   connection segment into a free slot, and `accept` maps it (`listener`, `connector`).
//! - Memory of the peer is read and written with cross-memory attach where the kernel allows it
//!   (`cma`); `caps().remote_memory` says whether it does for a given link.
//! - Liveness: the control block carries each side's closed flag; `check_peer` also verifies the
//!   peer process (pid + start time) is still running (`proc_identity`), and, where the peer
//!   promised a heartbeat (its proxy thread beats its word even while the application is idle),
//!   that the heartbeat moved within `heartbeat_timeout`: a stopped or hung peer looks alive.
//!
//! Nothing is left in the shm directory after a clean run: the acceptor unlinks a connection
//! segment as soon as it has mapped it (the connector unlinks it on drop if never accepted), and
//! the listener unlinks its worker segment on drop. Segments of crashed processes are removed by
//! `cleanup_stale`, which `ShmListener::new` runs on its directory.
//!
//! Trust model: peers run as the same user (segments are mode 0600 and ownership is checked), so a
//! peer can always corrupt our shared state; what we guarantee is that a buggy peer yields an
//! error on the link, never an out-of-bounds access on our side.

pub(crate) mod address;
mod cma;
mod connector;
mod layout;
mod link;
mod listener;
pub mod ring;
pub mod segment;
#[cfg(test)]
mod tests;
#[cfg(test)]
pub(crate) mod testutil;
pub mod words;

use std::path::PathBuf;
use std::time::Duration;

use crate::error::{Error, Result, Status};

pub use connector::{connect, connect_link};
pub use link::ShmLink;
pub use listener::ShmListener;
pub use segment::cleanup_stale;

/// Whether links use cross-memory attach (process_vm_readv/writev) for remote memory access.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum CmaMode {
    /// Use it when a probe to the peer succeeds.
    #[default]
    Auto,
    /// Require it: connect/accept fail when the probe fails.
    On,
    /// Never use it (`caps().remote_memory` is false).
    Off,
}

#[derive(Clone, Debug)]
pub struct ShmConfig {
    /// Where segments are created; a tmpfs (the default /dev/shm) keeps them in memory.
    pub dir: PathBuf,
    /// Ring data bytes per direction; a power of two. The connector's value is used by both sides.
    pub ring_size: usize,
    /// Largest frame; at most half the ring (with its 8-byte header). The connector's value is
    /// used by both sides.
    pub max_frame: usize,
    pub cma: CmaMode,
    /// How long `connect` waits for a free accept slot while the listener is alive.
    pub connect_timeout: Duration,
    /// How long a peer that promised a heartbeat may stay silent before `check_peer` fails the
    /// link (`GSC_HEARTBEAT_TIMEOUT`); `None`: peers are not judged by their heartbeat.
    pub heartbeat_timeout: Option<Duration>,
}

impl Default for ShmConfig {
    fn default() -> ShmConfig {
        ShmConfig {
            dir: PathBuf::from("/dev/shm"),
            ring_size: 4 << 20,
            max_frame: 64 << 10,
            cma: CmaMode::Auto,
            connect_timeout: Duration::from_secs(10),
            heartbeat_timeout: Some(Duration::from_secs(10)),
        }
    }
}

impl ShmConfig {
    pub fn validate(&self) -> Result<()> {
        if self.dir.as_os_str().is_empty() {
            return Err(Error::new(Status::InvalidConfig, "shm directory is empty"));
        }
        ring::validate(self.ring_size, self.max_frame)
    }
}
