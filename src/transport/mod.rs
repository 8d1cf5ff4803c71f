//! Lanes: the ways a worker reaches another worker.
//!
//! A *link* is one connection between two workers over one lane. It moves whole frames in order
//! (the protocol layer above fragments large messages to `max_frame`) and, where the lane can,
//! reads and writes the peer's memory directly (zero-copy rendezvous and one-sided put/get).
//!
//! Every lane provides the same small set of operations (the `Link` trait), so the worker and the
//! protocols never know which lane they are on; only `caps()` tells them what is possible.
//!
//! - `loopback`: workers inside one process; frames through an in-process queue, memory by memcpy.
//! - `shm`: processes on one host; frames through SPSC rings in a shared mapping, memory through
//!   cross-memory attach (process_vm_readv/writev) when the kernel allows it.
//! - `ucx`: workers on other hosts (or in other network namespaces of this one), over UCP active
//!   messages; UCX is loaded at run time. Remote memory needs a key the owner issues
//!   (`expose`, `read_remote_keyed`; docs/UCX.md).
//! - later: `nvlink` (CUDA IPC), `verbs`.
//!
//! Beside the lanes: `fd_pass`, a per-process service that hands file descriptors to other
//! processes of the host over an abstract Unix socket (CUDA VMM allocations are shared that way).

pub(crate) mod fd_pass;
pub mod loopback;
pub mod proc_identity;
pub mod shm;
pub mod ucx;

use crate::error::Result;

/// Which lane a link runs on. The numeric values appear in packed worker addresses.
#[repr(u8)]
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum LaneKind {
    Loopback = 1,
    Shm = 2,
    Ucx = 3,
}

impl LaneKind {
    pub fn name(self) -> &'static str {
        match self {
            LaneKind::Loopback => "loopback",
            LaneKind::Shm => "shm",
            LaneKind::Ucx => "ucx",
        }
    }

    pub fn from_u8(v: u8) -> Option<LaneKind> {
        match v {
            1 => Some(LaneKind::Loopback),
            2 => Some(LaneKind::Shm),
            3 => Some(LaneKind::Ucx),
            _ => None,
        }
    }

    pub const ALL: &'static [LaneKind] = &[LaneKind::Loopback, LaneKind::Shm, LaneKind::Ucx];

    /// Does reading the peer's memory need a key the peer issued for it (`Link::expose`)? On
    /// loopback and shm (CMA) an address is enough; UCX needs the peer's registration (a packed
    /// rkey). Callers that have only an address (one-sided put/get with gscomm's own keys,
    /// prepared direct writes) use frames on such lanes.
    pub fn remote_needs_key(self) -> bool {
        matches!(self, LaneKind::Ucx)
    }

    /// Does this lane only reach workers of this host (and this network namespace)? Only such
    /// links may hand the peer CUDA IPC handles.
    pub fn is_host_local(self) -> bool {
        match self {
            LaneKind::Loopback | LaneKind::Shm => true,
            LaneKind::Ucx => false,
        }
    }
}

/// Who is on the other side of a link, as far as liveness checks are concerned.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct ProcessIdentity {
    pub pid: u32,
    /// Process start time in clock ticks since boot (field 22 of /proc/<pid>/stat), so that a
    /// reused pid is never mistaken for the original process.
    pub start_time: u64,
}

/// What a link can do beyond moving frames.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct LinkCaps {
    /// `read_remote` / `write_remote` work: the peer's memory can be accessed directly.
    pub remote_memory: bool,
}

/// A range of this process's memory opened to the peer of a link (`Link::expose`): the key to
/// send the peer, and what must be kept alive while the peer may read (dropping it closes the
/// range again).
pub struct Exposed {
    pub key: Vec<u8>,
    pub hold: Box<dyn std::any::Any + Send>,
}

/// One ordered, reliable, bidirectional connection to a peer worker.
///
/// Frames are delivered whole and in the order they were sent. A frame is at most `max_frame()`
/// bytes. Implementations never block: a full queue is reported, not waited on.
pub trait Link: Send {
    fn lane(&self) -> LaneKind;

    /// Largest frame `try_send` accepts, in bytes.
    fn max_frame(&self) -> usize;

    fn caps(&self) -> LinkCaps;

    /// Enqueue one frame made of the concatenation of `parts`. `Ok(false)` means there is no room
    /// right now (try again after progress); an error means the link is dead.
    fn try_send(&mut self, parts: &[&[u8]]) -> Result<bool>;

    /// Hand up to `max` received frames to `deliver`, in order, and return how many were handed.
    /// A frame slice is valid only during its call. An error means the link is dead (peer
    /// failure or close); frames received before the failure have been delivered first.
    fn poll_recv(&mut self, max: usize, deliver: &mut dyn FnMut(&[u8])) -> Result<usize>;

    /// False only when `poll_recv` would certainly deliver nothing and report no failure: a
    /// cheap look that lets an idle progress pass skip the poll. A lane that cannot tell says true.
    fn may_have_news(&mut self) -> bool {
        true
    }

    /// Frames `try_send` accepted are still waiting for this process's progress to leave (UCX:
    /// its sends complete only inside `ucp_worker_progress`, a new endpoint's connection too).
    /// While any link says so the proxy thread keeps passing, even with no operation of its own
    /// in flight: an eager send completes for its sender as soon as the lane took the frame, and
    /// nothing else would move it out. Lanes that write straight into the peer (shm) say false.
    /// The link's send state in words, for a stuck operation's description (empty: nothing
    /// beyond what the worker knows).
    fn describe(&self) -> String {
        String::new()
    }

    fn sending(&self) -> bool {
        false
    }

    /// Copy `len` bytes from the peer's address `remote` into `local`.
    ///
    /// # Safety
    /// `local` must be valid for `len` bytes of writes. `remote` is checked by the kernel (or, in
    /// loopback, must have been validated by the caller against a registered region).
    unsafe fn read_remote(&self, local: *mut u8, remote: u64, len: usize) -> Result<()>;

    /// Open `[addr, addr+len)` of this process to the peer's `read_remote_keyed`, on lanes
    /// where reading needs a key (`LaneKind::remote_needs_key`); `None` where an address is
    /// enough. The range must stay valid while the returned hold lives.
    fn expose(&self, _addr: usize, _len: usize) -> Result<Option<Exposed>> {
        Ok(None)
    }

    /// `read_remote` with the key the peer's `expose` made for a range containing `remote`
    /// (empty where none is needed). It may progress the lane until the read is done, bounded by
    /// `GSC_TIMEOUT` (UCX: docs/UCX.md, "Remote memory").
    ///
    /// # Safety
    /// As for `read_remote`.
    unsafe fn read_remote_keyed(&self, local: *mut u8, remote: u64, len: usize, key: &[u8]) -> Result<()> {
        let _ = key;
        // SAFETY: the caller's promise is the one `read_remote` needs.
        unsafe { self.read_remote(local, remote, len) }
    }

    /// Copy `len` bytes from `local` to the peer's address `remote`.
    ///
    /// # Safety
    /// `local` must be valid for `len` bytes of reads; `remote` as for `read_remote`.
    unsafe fn write_remote(&self, local: *const u8, remote: u64, len: usize) -> Result<()>;

    /// Is the peer still alive? Cheap enough to call every few milliseconds. An error names the
    /// failure (`PeerFailed`, `ConnectionReset` when the peer closed the link; `TimedOut` when a
    /// peer that promised a heartbeat went silent: it lives but does not run).
    fn check_peer(&mut self) -> Result<()>;

    /// Beat this side's heartbeat, if the lane keeps one (shm). `promise`: a thread of this
    /// process beats every link at least this often whatever the application does (the proxy
    /// thread), so the peer may fail the link when the beats stop; `None` withdraws the promise
    /// (the beat then only shows progress, and silence proves nothing). Lanes whose peer
    /// failures are found otherwise ignore it.
    fn heartbeat(&mut self, promise: Option<std::time::Duration>) {
        let _ = promise;
    }

    /// Tell the peer this side is going away; frames already queued are still delivered.
    fn close(&mut self);
}

/// A worker's side of a lane that accepts incoming links from peers that connected to it.
pub trait Listener: Send {
    fn lane(&self) -> LaneKind;

    /// Bytes a peer needs to connect to this listener; embedded in the packed worker address.
    fn address_blob(&self) -> Vec<u8>;

    /// Take one pending incoming connection, if any. The `u128` is the connecting worker's uuid.
    fn accept(&mut self) -> Result<Option<(u128, Box<dyn Link>)>>;
}
