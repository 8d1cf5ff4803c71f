//! Communicators: a group of ranks, one GPU each, that run collectives together.
//!
//! A communicator is made collectively over a bootstrap group (`Bootstrap`: a unique id and a
//! TCP rendezvous, or a launcher's environment): each rank allocates its workspace
//! (`cuda::coll::Workspace`), the ranks exchange the keys that open them, and each maps every
//! peer's. After that a collective is one kernel launch on the caller's stream — or a node of
//! the caller's graph — that writes straight into the peers' workspaces over NVLink and reads
//! its own, in rounds of 64 KiB per rank, all in one launch: no proxy, no
//! host work after the launch.
//!
//! As in NCCL, every rank must call the same collectives in the same order with matching
//! arguments (counts, datatype, operation, root). The round counter that keeps the ranks in
//! step lives in GPU memory and is advanced by the kernels, so a captured collective replays
//! any number of times.

use super::agreement::{self, Signature};
use super::ce_ring::{self, Ring};
use super::copy_engine::{self, CopyEngine};
use super::direct::{self, Direct, Placement};
use super::host_board::HostBoard;
use super::large::{self, LargeKind, LargeShape};
use super::p2p::{PeerLinks, PeerOp};
use super::p2p_kernel::{self, KernelOp, PeerTransfer};
use super::peer_buffers::{DirectCall, DirectContext, DirectKind};
use super::select::{self, Alignment, Collective};
use super::settings;
use super::together::{Coll, Known, Shape};
use super::triggered::{self, DeviceCall, Triggered};
use super::types::{DataType, PreMulScalar, RedOp, fp8_avg_scalar};
use super::windows::{self, Offer, Window, Windows};
use crate::bootstrap::{Bootstrap, UniqueId};
use crate::condition::{ArmedOutputs, Category, Condition};
use crate::config::{Config, Tristate};
use crate::cuda::Grid;
use crate::cuda::coll::{CollArgs, CollKind, MAX_RANKS, SLOT_PAYLOAD, Workspace, big_round_max, one_shot_grid};
use crate::cuda::coll_p2p::{P2P_FAILED, P2P_SIZE_MISMATCH, P2P_THREADS, P2pArgs};
use crate::cuda::lanes::Lanes;
use crate::error::{Error, Result, Status};
use std::path::PathBuf;
use std::time::Duration;

/// One rank of a communicator.
pub struct Communicator {
    /// Collectives on kernel-triggered conditions (`triggered`): first, so that its thread
    /// has stopped launching before the workspace and the rest go.
    triggered: Triggered,
    rank: usize,
    nranks: usize,
    device: i32,
    workspace: Workspace,
    timeout: Duration,
    kernel_cache: Option<PathBuf>,
    /// `GSC_COLL_LARGE_MIN` (see `select`).
    large_min: usize,
    /// The large kernels' algorithm and shape (`GSC_COLL_LARGE_*`), fixed for the
    /// communicator's life: its workspace's flags keep their meaning from launch to launch.
    large: LargeShape,
    /// `GSC_COLL_CHECK`: every call is compared across the ranks first (`agreement`).
    check_calls: bool,
    /// Kept for the collective teardown, the call check and split.
    bootstrap: Bootstrap,
    /// The exchanges inside a call (buffer exchange, call check) in shared memory, where every
    /// rank could map it (`host_board`); `None`: through the bootstrap.
    board: Option<HostBoard>,
    /// Send/recv between the ranks (`p2p`).
    peers: PeerLinks,
    /// Set once by `abort` or `revoke`: every later call fails with its error. `true`: by
    /// `revoke`, after which `split` and `shrink` still work.
    aborted: std::sync::OnceLock<(Error, bool)>,
    /// `GSC_COLL_CE` and `GSC_COLL_CE_MIN`, and the copy engines' side streams and scratch.
    ce_mode: Tristate,
    ce_min: usize,
    ce: CopyEngine,
    /// `GSC_COLL_SM` and `GSC_COLL_SM_MIN`, and the direct kernel's state. Where ranks share
    /// a process (`shares_process`) the kernel takes only calls on symmetric windows.
    sm_mode: Tristate,
    sm_min: usize,
    direct: Direct,
    /// `GSC_COLL_RING`, `GSC_COLL_RING_MIN`, and the copy-engine ring's state (its pieces:
    /// `GSC_COLL_RING_PIECES`).
    ring_mode: Tristate,
    ring_min: usize,
    ring: Ring,
    /// Several ranks of this communicator live in this process (ncclCommInitAll, one thread
    /// driving several GPUs): no exchange may happen inside a call (see `new`), so the paths on
    /// the peers' buffers take only calls whose buffers are known without one (symmetric
    /// windows; every rank's call issued together: `together`).
    shares_process: bool,
    /// Every rank lives in this process, and what tells this communicator's ranks from any
    /// other's here (rank 0's pid and workspace address): `issue_together`'s check.
    all_here: bool,
    family: (u32, u64),
    /// Buffers registered by every rank together (`register_window`): calls on symmetric ones
    /// take the peers' buffers from here instead of exchanging them.
    windows: Windows,
    /// `GSC_COLL_TRIGGER_MAX`: the largest kernel-triggered all-reduce the triggering thread
    /// runs itself (`triggered::on_device`).
    trigger_max: usize,
    /// `GSC_COLL_P2P_MAX` and `GSC_COLL_P2P_BLOCKS`: which sends and receives of a group the
    /// send/recv kernel moves (`p2p_kernel`), with how many blocks; and the most blocks one
    /// launch of it may have (the SMs: every block resident at once).
    p2p_max: usize,
    p2p_blocks: usize,
    p2p_grid_max: usize,
    /// `GSC_COLL_P2P_HEAD` (at most `p2p_max`): the start of an
    /// engine-sized message to a peer that the kernel moves while the engine starts on the rest
    /// (`split_heads`).
    p2p_head: usize,
    /// Whether messages to this rank have gone through its own FIFO (`p2p_kernel::fuse_self`);
    /// groups are issued one at a time, so the lock is never contended.
    p2p_self_fifo: std::sync::Mutex<bool>,
    /// The same for the point-to-point engine: whether messages to this rank have gone through
    /// its matching (an unbalanced group, `send`/`recv` to itself, or a condition that is not a
    /// CUDA stream); until then a group's balanced pairs larger than `GSC_COLL_P2P_MAX` are
    /// copies on `p2p_lane`, beside the engine's transfers to the peers.
    p2p_self_engine: std::sync::Mutex<bool>,
    /// The side streams those copies (stream 0) and a group's kernel beside the engine (stream
    /// 1, `split_heads`) run on, made at the first use.
    p2p_lane: std::sync::Mutex<Option<Lanes>>,
}

/// The collectives a pre-multiplied sum exists for (`Communicator::premul_sum`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PremulKind {
    AllReduce,
    Reduce,
    ReduceScatter,
}

/// A buffer registered with a communicator (`Communicator::register`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    pub addr: u64,
    pub bytes: usize,
    /// The `mem_alloc` allocation the buffer lies in, with the buffer's offset in it (`None` for
    /// memory from elsewhere): what the seed's rule for carved registrations — the same offset
    /// on every rank — will be checked against once registered buffers take zero-copy paths.
    pub mem_alloc: Option<crate::cuda::api::MemAllocInfo>,
}

/// What one collective call asks for, before it is cut into rounds.
#[derive(Copy, Clone)]
pub(crate) struct Call {
    kind: CollKind,
    pub(crate) send: u64,
    pub(crate) recv: u64,
    /// Bytes each rank contributes per part (all-gather: its part; reduce-scatter: each
    /// rank's part of the input; the others: the whole buffer).
    part_bytes: usize,
    dtype: DataType,
    op: RedOp,
    root: usize,
    /// A pre-multiplied sum (`op` is then `Sum`): this rank's scalar.
    premul: Option<PreMulScalar>,
}

impl Call {
    /// (send, recv) bytes on `n` ranks of a call that can run on the peers' buffers.
    pub(crate) fn buffer_bytes(&self, n: usize) -> Option<(usize, usize)> {
        DirectKind::of(self.kind).map(|k| k.buffer_bytes(n, self.part_bytes))
    }

    /// The operator's name in kernel symbols (`gsc_coll_<type>_<op>`).
    fn op_tag(&self) -> &'static str {
        if self.premul.is_some() { "premul" } else { self.op.kernel_tag() }
    }
    fn premul_bits(&self) -> u64 {
        match self.premul {
            Some(PreMulScalar::Value(bits)) => bits,
            _ => 0,
        }
    }
    fn premul_ptr(&self) -> u64 {
        match self.premul {
            Some(PreMulScalar::Device(addr)) => addr,
            _ => 0,
        }
    }
}

impl Communicator {
    /// Join a communicator of `bootstrap.nranks()` ranks, this one on CUDA device `device`.
    /// Collective: every rank of the bootstrap group calls it. `config` gives the timeout
    /// (`GSC_TIMEOUT`: how long a kernel waits for a peer before it gives up) and the kernel
    /// cache. The ranks' collective settings (`GSC_COLL_*`, which choose kernels and paths)
    /// must agree: otherwise every rank gets an error naming the first rank and knob that
    /// differ.
    pub fn new(bootstrap: Bootstrap, device: i32, config: &Config) -> Result<Communicator> {
        crate::cuda::init().map_err(|e| e.context("communicators need the CUDA driver"))?;
        let (rank, nranks) = (bootstrap.rank() as usize, bootstrap.nranks() as usize);
        if nranks > MAX_RANKS {
            return Err(Error::unsupported(format!(
                "a communicator of {nranks} ranks: collectives run between the GPUs of one host, at most {MAX_RANKS}"
            )));
        }
        // Before anything collective: a shape this rank cannot run fails here on every rank
        // given the same configuration.
        let large = LargeShape::from_config(config)?;
        // Kernels loaded now, not by a first call behind a stream wait (cuda/kernels.rs).
        crate::cuda::coll::preload(device, config.kernel_cache_dir.as_deref())?;
        let (mut workspace, key) = Workspace::allocate(device, nranks)?;
        let ours = settings::encode(config, crate::cuda::coll::big_round_max());
        let mine = settings::encode_workspace_entry(workspace.base(), &ours, &key);
        let all = bootstrap.allgather(&mine).map_err(|e| e.context("exchanging collective workspaces"))?;
        let mut keys = Vec::with_capacity(nranks);
        let mut bases = Vec::with_capacity(nranks);
        let mut all_settings = Vec::with_capacity(nranks);
        for (r, entry) in all.iter().enumerate() {
            let (base, theirs, key) = settings::decode_workspace_entry(r, entry)?;
            bases.push(base);
            all_settings.push(theirs);
            keys.push(key.to_vec());
        }
        // Every rank sees the same entries, so every rank refuses alike.
        settings::agree(&all_settings)?;
        // Ranks of this communicator sharing a process (ncclCommInitAll, one thread driving
        // several GPUs): an exchange through the bootstrap inside a call (the copy engines',
        // the direct kernel's, GSC_COLL_CHECK's) would wait on the host for ranks whose calls
        // the same thread issues later, so they stay off — on every rank, decided from every
        // rank's key, so that all of them take the same paths (ranks 0 and 1 in one process
        // and 2 and 3 in their own must not disagree).
        let pids: Vec<Option<u32>> = keys.iter().map(|k| crate::cuda::ipc::DeviceKey::decode(k).ok().map(|k| k.pid)).collect();
        let shares_process = pids.iter().enumerate().any(|(r, p)| p.is_some() && pids[..r].contains(p));
        let all_here = nranks > 1 && pids.iter().all(|p| *p == Some(std::process::id()));
        let family = (pids[0].unwrap_or(0), bases[0]);
        if shares_process && config.coll_check {
            tracing::warn!(
                target: "gsc::coll",
                "GSC_COLL_CHECK is off for this communicator: several of its ranks are in this process, and the \
                 check's exchange inside one rank's call would wait for calls the same thread has not made yet"
            );
        }
        workspace.map_peers(rank, &keys, &bases)?;
        let p2p_grid_max = crate::cuda::sm_count(device)?;
        let peers = PeerLinks::new(&bootstrap, config)?;
        let board = HostBoard::open(&bootstrap, &config.shm_dir)?;
        // Nobody launches before everyone has mapped (a kernel would wait for a peer that is
        // still opening our workspace: harmless, but it would count against its timeout).
        bootstrap.barrier()?;
        Ok(Communicator {
            triggered: Triggered::new(device, config.proxy_spin, config.proxy_poll),
            rank,
            nranks,
            device,
            workspace,
            timeout: config.timeout.unwrap_or(Duration::from_secs(3600)),
            kernel_cache: config.kernel_cache_dir.clone(),
            large_min: config.coll_large_min,
            large,
            check_calls: config.coll_check && !shares_process,
            bootstrap,
            board,
            peers,
            aborted: std::sync::OnceLock::new(),
            // Where ranks share a process, the paths on the peers' buffers take only calls whose
            // buffers are known without an exchange (`on_peer_buffers`).
            ce_mode: config.coll_ce,
            ce_min: config.coll_ce_min,
            ce: CopyEngine::new(device),
            sm_mode: config.coll_sm,
            sm_min: config.coll_sm_min,
            direct: Direct::new(config.coll_sm_blocks),
            ring_mode: config.coll_ring,
            ring_min: config.coll_ring_min,
            ring: Ring::new(device, config.coll_ring_pieces),
            shares_process,
            all_here,
            family,
            windows: Windows::default(),
            // Off where ranks share a process: the mailboxes are exchanged while arming.
            trigger_max: if shares_process { 0 } else { config.coll_trigger_max },
            p2p_max: config.coll_p2p_max,
            p2p_blocks: config.coll_p2p_blocks,
            p2p_grid_max,
            p2p_head: config.coll_p2p_head.min(config.coll_p2p_max),
            p2p_self_fifo: std::sync::Mutex::new(false),
            p2p_self_engine: std::sync::Mutex::new(false),
            p2p_lane: std::sync::Mutex::new(None),
        })
    }

    /// Abort this rank's side, from any thread, without the peers: its send/recv worker is
    /// aborted (transfers in flight or waiting on a stream fail with `Aborted` and release their
    /// streams), and every later call fails at once with the error. Idempotent. This rank's
    /// collective kernels give up too: one waiting for a peer within microseconds, one that
    /// starts later (a queued launch, a graph replayed later) at its first wait — through an abort
    /// word in page-locked memory they poll, so no CUDA call is made (none could wait on a
    /// stream held by the very kernel being aborted). Peers are not told: their kernels wait
    /// for this rank until `GSC_TIMEOUT`, or until they abort too.
    pub fn abort(&self, reason: &str) -> Result<()> {
        let error = Error::new(Status::Aborted, format!("the communicator was aborted: {reason}"));
        if self.aborted.set((error, false)).is_ok() {
            self.workspace.abort();
            self.peers.worker().abort(reason)?;
        }
        Ok(())
    }

    /// NCCL's revoke: what is in flight stops as with `abort` (send/recv fail and release their
    /// streams, this rank's kernels give up at their next wait), every later collective and
    /// send/recv fails naming the revoke, and the communicator stays good for `split` and
    /// `shrink` — over its bootstrap, which a revoke leaves alone — and for its destroy. Once
    /// only: a second revoke, or a revoke after `abort`, is an error.
    pub fn revoke(&self) -> Result<()> {
        let error = Error::new(Status::Canceled, "the communicator was revoked: only split, shrink and destroy remain");
        if let Err((e, _)) = self.aborted.set((error, true)) {
            let (was, _) = self.aborted.get().cloned().unwrap_or((e, false));
            return Err(Error::new(Status::InvalidParam, format!("revoke: {}", was.message())));
        }
        self.workspace.abort();
        self.peers.worker().abort("revoked")
    }

    /// Whether `revoke` was called.
    pub fn revoked(&self) -> bool {
        self.aborted.get().is_some_and(|(_, revoked)| *revoked)
    }

    fn check_aborted(&self) -> Result<()> {
        self.aborted.get().map_or(Ok(()), |(e, _)| Err(e.clone()))
    }

    /// For `split` and `shrink`: an aborted communicator is refused, a revoked one is not.
    fn check_not_aborted(&self) -> Result<()> {
        match self.aborted.get() {
            Some((e, false)) => Err(e.clone()),
            _ => Ok(()),
        }
    }

    /// NCCL's split: the ranks that give the same `color` form a new communicator, ranked by
    /// (`key`, rank here); `None` (NCCL_SPLIT_NOCOLOR) takes part in the call and gets none.
    /// Collective over this communicator; the new one is on the same device, with `config`.
    pub fn split(&self, color: Option<u32>, key: i32, config: &Config) -> Result<Option<Communicator>> {
        self.check_not_aborted()?;
        let mut mine = vec![u8::from(color.is_some())];
        mine.extend_from_slice(&color.unwrap_or(0).to_le_bytes());
        mine.extend_from_slice(&key.to_le_bytes());
        let all = self.bootstrap.allgather(&mine).map_err(|e| e.context("split: exchanging colors"))?;
        let mut entries = Vec::with_capacity(all.len());
        for (r, e) in all.iter().enumerate() {
            let e: &[u8; 9] = e
                .as_slice()
                .try_into()
                .map_err(|_| Error::new(Status::ConnectionReset, format!("split: rank {r} sent a color entry of {} bytes", e.len())))?;
            let color = (e[0] != 0).then(|| u32::from_le_bytes(e[1..5].try_into().expect("4 bytes")));
            entries.push((color, i32::from_le_bytes(e[5..9].try_into().expect("4 bytes"))));
        }
        let members = split_members(&entries, color);
        // The first member of each color hosts the new group's rendezvous; a second exchange
        // hands its id to the others.
        let leads = members.first() == Some(&self.rank);
        let uid = if leads {
            let ip = self.bootstrap.peer_addr(self.rank as u32).map(|a| a.ip());
            UniqueId::create(ip).map(|u| u.to_bytes().to_vec()).unwrap_or_else(|e| {
                tracing::warn!(target: "gsc::coll", error = %e, "split: no rendezvous for the new communicator");
                Vec::new()
            })
        } else {
            Vec::new()
        };
        let ids = self.bootstrap.allgather(&uid).map_err(|e| e.context("split: exchanging the new ids"))?;
        let Some(&lead) = members.first() else { return Ok(None) };
        if ids[lead].is_empty() {
            return Err(Error::new(Status::NoResource, format!("split: rank {lead} could not start the new communicator's rendezvous")));
        }
        let uid = UniqueId::from_bytes(&ids[lead])?;
        let new_rank = members.iter().position(|&r| r == self.rank).expect("a rank with a color is among its members");
        let boot = Bootstrap::init(&uid, new_rank as u32, members.len() as u32, self.bootstrap.timeout())?;
        Communicator::new(boot, self.device, config).map(Some)
    }

    /// NCCL's shrink: the ranks not in `exclude` form a new communicator, numbered in their
    /// order here, on the same devices, with `config`. Collective over those ranks only: an
    /// excluded rank takes no part (it may be dead), and each remaining rank gives the same
    /// list, in any order (`Bootstrap::shrink` names a rank whose list differs). Works on a
    /// revoked communicator — revoke first to stop what waits for an excluded rank.
    pub fn shrink(&self, exclude: &[usize], config: &Config) -> Result<Communicator> {
        self.check_not_aborted()?;
        let boot = self.bootstrap.shrink(&self.shrink_ranks(exclude)?)?;
        Communicator::new(boot, self.device, config)
    }

    /// Whether `shrink` would take `exclude` from this rank (the list's own rules: see
    /// `Bootstrap::check_shrink`), so a caller that revokes before shrinking can refuse a bad
    /// list first and change nothing.
    pub fn check_shrink(&self, exclude: &[usize]) -> Result<()> {
        self.bootstrap.check_shrink(&self.shrink_ranks(exclude)?).map(|_| ())
    }

    fn shrink_ranks(&self, exclude: &[usize]) -> Result<Vec<u32>> {
        exclude
            .iter()
            .map(|&r| {
                u32::try_from(r)
                    .map_err(|_| Error::invalid_param(format!("shrink: rank {r} to exclude is not below nranks {}", self.nranks)))
            })
            .collect()
    }

    /// NCCL's buffer registration: `bytes` at `addr` are checked to be memory of this rank's
    /// GPU, and the range is returned for `deregister` (with the `mem_alloc` allocation it lies
    /// in, if any). Registration is a hint in NCCL; here every buffer, registered or not,
    /// takes the zero-copy paths where they apply (exchanged per eager call, once per capture),
    /// so it changes no path and no result; it is checked so that a wrong buffer is named at
    /// registration, not later.
    pub fn register(&self, addr: u64, bytes: usize) -> Result<Registration> {
        if bytes == 0 {
            return Err(Error::invalid_param("registering 0 bytes"));
        }
        let last = addr.checked_add(bytes as u64 - 1).ok_or_else(|| Error::invalid_param("the registered range wraps around"))?;
        self.check_device_buffer(addr, "registered")?;
        self.check_device_buffer(last, "registered (at its last byte)")?;
        Ok(Registration { addr, bytes, mem_alloc: crate::cuda::api::mem_alloc_info(addr) })
    }

    /// NCCL's window registration (`ncclCommWindowRegister`; `windows` explains it):
    /// collective — every rank registers a buffer of its GPU, and windows in the same order on
    /// every rank. Each rank offers its buffer's address and key, maps every peer's, and all
    /// learn whether everyone managed: a rank that refused (bad buffer) or could not map is
    /// named in every rank's error, and no rank keeps the window. `symmetric`
    /// (`NCCL_WIN_COLL_SYMMETRIC`): the program promises that a collective's buffers lie at the
    /// same offset in every rank's window; such calls then exchange nothing, on a stream as in
    /// a graph — and where ranks share a process, the direct kernel serves them, which it
    /// cannot do for calls that exchange.
    pub fn register_window(&self, addr: u64, bytes: usize, symmetric: bool) -> Result<Window> {
        self.check_aborted()?;
        let key = (|| -> Result<Vec<u8>> {
            if bytes == 0 {
                return Err(Error::invalid_param("a window of 0 bytes"));
            }
            let last = addr.checked_add(bytes as u64 - 1).ok_or_else(|| Error::invalid_param("the window's range wraps around"))?;
            self.check_device_buffer(addr, "window")?;
            self.check_device_buffer(last, "window (at its last byte)")?;
            let ptr =
                crate::cuda::memory::device_ptr(addr as usize)?.ok_or_else(|| Error::invalid_param("the window is not GPU memory"))?;
            Ok(crate::cuda::ipc::export(addr as usize, ptr)?.encode())
        })();
        // A rank that refuses still takes part, so the others learn why instead of waiting.
        let mine = Offer { addr, bytes, symmetric, key: key.map_err(|e| e.to_string()) };
        let all = self.bootstrap.allgather(&mine.encode()).map_err(|e| e.context("exchanging window registrations"))?;
        let offers = all.iter().enumerate().map(|(r, b)| Offer::decode(r, b)).collect::<Result<Vec<_>>>()?;
        let agreed = windows::agree(&offers)?;
        let mapped = offers
            .iter()
            .enumerate()
            .map(|(q, o)| match (q == self.rank, &o.key) {
                (true, _) => Ok(addr),
                (false, Ok(key)) => crate::cuda::ipc::map_peer(&crate::cuda::ipc::DeviceKey::decode(key)?, o.addr, o.bytes, self.device),
                // `agree` refused offers without a key already.
                (false, Err(why)) => Err(Error::invalid_param(format!("rank {q} could not register its window: {why}"))),
            })
            .collect::<Result<Vec<u64>>>();
        let verdicts = self.bootstrap.allgather(&windows::encode_verdict(&mapped)).map_err(|e| e.context("agreeing on a window"))?;
        windows::check_verdicts(&verdicts)?;
        let window = self.windows.insert(&mine, mapped?, &agreed);
        tracing::debug!(target: "gsc::coll", id = window.id, addr = format_args!("{addr:#x}"), bytes, symmetric, span = agreed.span, "window registered");
        Ok(window)
    }

    /// Forget a window of this communicator's (`register_window`); this rank alone. Peers'
    /// memory stays mapped (`cuda::ipc` caches it), so work already issued on it is not
    /// affected. A window it does not hold is refused, and nothing changes.
    pub fn deregister_window(&self, window: &Window) -> Result<()> {
        self.windows.remove(window)
    }

    /// Collectives this rank ran on the peers' buffers found in symmetric windows, without an
    /// exchange, so far.
    pub fn window_calls(&self) -> u64 {
        self.windows.hits()
    }

    /// Windows this rank holds.
    pub fn windows(&self) -> usize {
        self.windows.len()
    }

    /// Send `count` elements of `buf` to rank `peer` (NCCL's ncclSend): the k-th send to a peer
    /// pairs with its k-th receive from this rank. `on`'s producer waits for completion; inside
    /// a condition group, at its end, so a group's sends and receives are in flight together.
    ///
    /// # Safety
    /// `buf` is memory of this rank's device (or host memory), valid for `count` elements
    /// until the send completed on `on`.
    pub unsafe fn send(&self, buf: u64, count: usize, dtype: DataType, peer: usize, on: &Condition) -> Result<()> {
        self.check_aborted()?;
        let bytes = self.bytes(count, dtype)?;
        self.note_engine_self(peer);
        // SAFETY: the caller's contract.
        unsafe { self.peers.transfer(PeerOp::Send, buf, bytes, peer, on) }
    }

    /// Receive `count` elements from rank `peer` into `buf` (NCCL's ncclRecv); see `send`.
    ///
    /// # Safety
    /// As `send`, and `buf` is not touched by anything else until the receive completed.
    pub unsafe fn recv(&self, buf: u64, count: usize, dtype: DataType, peer: usize, on: &Condition) -> Result<()> {
        self.check_aborted()?;
        let bytes = self.bytes(count, dtype)?;
        self.note_engine_self(peer);
        // SAFETY: the caller's contract.
        unsafe { self.peers.transfer(PeerOp::Recv, buf, bytes, peer, on) }
    }

    /// A message to or from this rank itself went through the engine's matching: from now on
    /// its groups' pairs to itself do too (`p2p_self_engine`).
    fn note_engine_self(&self, peer: usize) {
        if peer == self.rank {
            *self.p2p_self_engine.lock().unwrap_or_else(|e| e.into_inner()) = true;
        }
    }

    /// A group of sends and receives (NCCL's ncclSend/ncclRecv between ncclGroupStart and
    /// ncclGroupEnd), in flight together once `on` reaches them; `on`'s producer waits for all
    /// of them. The k-th send to a peer pairs with its k-th receive from this rank, whatever
    /// path either takes, and a send and its receive must have the same length. Those of up
    /// to `GSC_COLL_P2P_MAX` bytes run as one kernel on the stream or one node of the graph
    /// (`p2p_kernel`), which needs GPU buffers of this rank's device and a CUDA stream or
    /// graph condition; the rest go through the point-to-point engine, after the kernel, as
    /// `send`/`recv` do. The groups of one communicator run one at a time, in the same order
    /// on every rank (as its collectives do). Every transfer is checked before anything is
    /// issued. Returns the kernel's node (graph conditions), else nothing.
    ///
    /// # Safety
    /// Every buffer is valid for its bytes until the group completed on `on`, and a receive
    /// buffer is not read or written by anything else until then.
    pub unsafe fn transfers(&self, group: &[PeerTransfer], on: &Condition) -> Result<ArmedOutputs> {
        self.check_aborted()?;
        let headed = match on.category() {
            Category::Stream => split_heads(group, self.rank, self.p2p_max, self.p2p_head),
            _ => None,
        };
        let group = headed.as_deref().unwrap_or(group);
        let on_kernel = |t: &PeerTransfer| t.bytes > 0 && t.bytes <= self.p2p_max;
        let on_engine = |t: &PeerTransfer| t.bytes > self.p2p_max;
        for (i, t) in group.iter().enumerate() {
            let what = if t.op == PeerOp::Send { "send" } else { "receive" };
            if t.peer >= self.nranks {
                return Err(Error::invalid_param(format!(
                    "transfer {i} ({what}): peer {} of a communicator of {} ranks",
                    t.peer, self.nranks
                )));
            }
            if on_kernel(t) {
                self.check_device_buffer(t.buf, what).map_err(|e| Error::new(e.status(), format!("transfer {i}: {}", e.message())))?;
            }
        }
        let has_kernel_part = group.iter().any(on_kernel);
        let graph = match (has_kernel_part, on.category()) {
            (false, _) | (true, Category::Stream) => None,
            (true, Category::Graph) => Some(on.cuda_graph()?),
            (true, _) => {
                return Err(Error::unsupported(format!(
                    "a group's sends and receives of up to GSC_COLL_P2P_MAX ({} bytes) run on CUDA stream and graph \
                     conditions (use send/recv on others)",
                    self.p2p_max
                )));
            }
        };
        // Both parts are planned (and so checked) before anything is issued.
        let kernel_ops = match has_kernel_part {
            true => {
                let mut self_fifo = self.p2p_self_fifo.lock().unwrap_or_else(|e| e.into_inner());
                p2p_kernel::fuse_self(group, on_kernel, self.rank, &mut self_fifo)?
            }
            false => Vec::new(),
        };
        let (engine, self_copies) = self.engine_part(group, on_engine, on)?;
        // The copies to itself start first, beside everything else of the group, and so does
        // the kernel when heads were split off (else the engine would start only after it);
        // the stream waits for them after the engine's part (`Lanes`: events, so a capture
        // takes them in).
        let lane = match self_copies.is_empty() && headed.is_none() {
            true => None,
            false => {
                let stream = on.cuda_stream()?;
                let mut lane = self.p2p_lane.lock().unwrap_or_else(|e| e.into_inner());
                if lane.is_none() {
                    *lane = Some(crate::cuda::with_relaxed_capture(|| Lanes::new(self.device, 2))?);
                }
                let side = lane.as_ref().expect("made above");
                side.fork(stream)?;
                // By SMs: the copy engines then carry only the peers' data.
                let cache = self.kernel_cache.as_deref();
                for &(src, dst, bytes) in &self_copies {
                    // SAFETY: the caller's contract: both buffers valid until the group
                    // completed on `on`, which waits for this side stream (`join` below).
                    unsafe { self.workspace.launch_self_copy(side.stream(0), cache, (dst, src, bytes), self.p2p_grid_max) }?;
                }
                Some((lane, stream))
            }
        };
        let kernel_stream = match (&lane, &headed) {
            (Some((side, _)), Some(_)) => Some(side.as_ref().expect("made above").stream(1)),
            _ => None,
        };
        let issue_engine = || -> Result<()> {
            if engine.is_empty() {
                return Ok(());
            }
            on.group_start()?;
            let mut first = Ok(());
            for t in &engine {
                // SAFETY: the caller's contract.
                if let Err(e) = unsafe { self.peers.transfer(t.op, t.buf, t.bytes, t.peer, on) } {
                    first = Err(e);
                    break;
                }
            }
            let ended = on.group_end();
            first?;
            ended
        };
        // On the caller's stream the kernel goes first: after the engine's part it would wait
        // there for the engine's completion. On a side stream it goes last: nothing the
        // engine's part does on the host then runs while this rank's kernel spins for a peer
        // whose kernel the same thread may have yet to launch (ranks sharing a process).
        let issued = match kernel_stream {
            None => self.issue_kernel_part(&kernel_ops, graph, None, on).and_then(|outputs| issue_engine().map(|()| outputs)),
            Some(side) => issue_engine().and_then(|()| self.issue_kernel_part(&kernel_ops, graph, Some(side), on)),
        };
        // Joined whatever happened: the stream must not run past copies still reading and
        // writing the caller's buffers.
        let joined = match &lane {
            Some((side, stream)) => side.as_ref().expect("made above").join(*stream),
            None => Ok(()),
        };
        let outputs = issued?;
        joined?;
        Ok(outputs)
    }

    /// The group's transfers for the point-to-point engine (larger than `GSC_COLL_P2P_MAX`),
    /// and, on a CUDA stream, its balanced pairs to this rank itself taken out of them as
    /// copies (source, destination, bytes) while no message to itself ever went through the
    /// engine (`p2p_self_engine`; the pairing rule is `fuse_self`'s).
    fn engine_part(
        &self,
        group: &[PeerTransfer],
        on_engine: impl Fn(&PeerTransfer) -> bool,
        on: &Condition,
    ) -> Result<(Vec<PeerTransfer>, Vec<(u64, u64, usize)>)> {
        let mut self_engine = self.p2p_self_engine.lock().unwrap_or_else(|e| e.into_inner());
        if on.category() != Category::Stream {
            *self_engine |= group.iter().any(|t| on_engine(t) && t.peer == self.rank);
            return Ok((group.iter().filter(|t| on_engine(t)).copied().collect(), Vec::new()));
        }
        let (mut engine, mut copies) = (Vec::new(), Vec::new());
        // `fuse_self` on the engine's entries: its FIFO transfers are the engine's here.
        for op in p2p_kernel::fuse_self(group, on_engine, self.rank, &mut self_engine)? {
            match op {
                KernelOp::Fifo(t) => engine.push(t),
                KernelOp::SelfCopy { src, dst, bytes } if src == 0 || dst == 0 => {
                    return Err(Error::invalid_param(format!("a NULL buffer for {bytes} bytes sent to this rank itself")));
                }
                KernelOp::SelfCopy { src, dst, bytes } => copies.push((src, dst, bytes)),
            }
        }
        Ok((engine, copies))
    }

    /// Launch (on `on`'s stream, or `stream` where given) or add (graph: `Some`) the send/recv
    /// kernel for `kernel_ops`; returns the graph nodes.
    fn issue_kernel_part(
        &self,
        kernel_ops: &[KernelOp],
        graph: Option<(usize, usize)>,
        stream: Option<usize>,
        on: &Condition,
    ) -> Result<ArmedOutputs> {
        let mut outputs = ArmedOutputs::default();
        let cache = self.kernel_cache.as_deref();
        for launch in p2p_kernel::plan(kernel_ops, self.rank, self.p2p_blocks, self.p2p_grid_max) {
            let mut args = P2pArgs {
                coll: CollArgs {
                    nranks: self.nranks as u64,
                    rank: self.rank as u64,
                    timeout_ns: self.timeout.as_nanos().min(u64::MAX as u128) as u64,
                    ..Default::default()
                },
                nops: launch.ops.len() as u64,
                ..Default::default()
            };
            args.ops[..launch.ops.len()].copy_from_slice(&launch.ops);
            let grid = Grid { blocks: launch.blocks as u32, threads: P2P_THREADS };
            match graph {
                Some(g) => {
                    let after = (outputs.done_node != 0).then_some(outputs.done_node);
                    let node = self.workspace.add_p2p_node(g, cache, args, grid, after)?;
                    if outputs.start_node == 0 {
                        outputs.start_node = node;
                    }
                    outputs.done_node = node;
                }
                None => self.workspace.launch_p2p(stream.map_or_else(|| on.cuda_stream(), Ok)?, cache, args, grid)?,
            }
        }
        Ok(outputs)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Collectives this rank ran by the copy engines (`GSC_COLL_CE`) so far.
    pub fn copy_engine_calls(&self) -> u64 {
        self.ce.runs()
    }

    /// Collectives this rank ran by the direct kernel (`GSC_COLL_SM`) so far.
    pub fn direct_calls(&self) -> u64 {
        self.direct.runs()
    }

    /// Kernel-triggered all-reduces armed so far to run in the triggering thread
    /// (`GSC_COLL_TRIGGER_MAX`).
    pub fn triggered_on_device(&self) -> u64 {
        self.triggered.armed_on_device()
    }

    /// Collectives this rank ran by the copy-engine ring (`GSC_COLL_RING`) so far.
    pub fn ring_calls(&self) -> u64 {
        self.ring.runs()
    }

    /// The large kernels' algorithm and shape this communicator runs (`GSC_COLL_LARGE_*`).
    pub fn large_shape(&self) -> &LargeShape {
        &self.large
    }

    pub fn nranks(&self) -> usize {
        self.nranks
    }

    pub fn device(&self) -> i32 {
        self.device
    }

    /// Ok, or `TimedOut` when a kernel of this rank gave up waiting for a peer (its results
    /// are then undefined; the communicator should be destroyed). Ok after `revoke`.
    pub fn async_error(&self) -> Result<()> {
        if self.revoked() {
            // NCCL's state after a revoke once nothing is in flight: kernels given up by the
            // revoke leave their error behind, which is not the communicator's.
            return Ok(());
        }
        self.check_aborted()?;
        match self.workspace.error()? {
            0 => Ok(()),
            word if word & P2P_FAILED != 0 => {
                let peer = word & 0xff;
                Err(match word & P2P_SIZE_MISMATCH == P2P_SIZE_MISMATCH {
                    true => Error::invalid_param(format!(
                        "a receive from rank {peer} expected a different number of bytes than rank {peer} sent \
                         (a send and its receive must have the same size); the communicator is unusable now"
                    )),
                    false => Error::new(
                        Status::TimedOut,
                        format!(
                            "a send or receive between this rank and rank {peer} failed (it did not come within the timeout, \
                             the communicator was aborted, or rank {peer} found an error); the communicator is unusable now"
                        ),
                    ),
                })
            }
            round => Err(Error::new(Status::TimedOut, format!("a collective (round {round}) gave up waiting for a peer"))),
        }
    }

    /// `count` elements of `send` reduced with `op` across the ranks into `recv` of every rank
    /// (`send == recv`: in place).
    ///
    /// # Safety
    /// `send` and `recv` are GPU memory of this rank's device, valid for `count` elements until
    /// the operation completed on `on` (as for any stream work).
    pub unsafe fn all_reduce(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        op: RedOp,
        on: &Condition,
    ) -> Result<ArmedOutputs> {
        // SAFETY: the caller's promise.
        unsafe { self.collective(&Coll::AllReduce { send, recv, count, dtype, op }, on) }
    }

    /// Every rank's `count` elements of `send` into `recv`, rank r's at element r × count
    /// (in place: `send == recv + rank × count elements`).
    ///
    /// # Safety
    /// As `all_reduce`; `recv` holds `nranks × count` elements.
    pub unsafe fn all_gather(&self, send: u64, recv: u64, count: usize, dtype: DataType, on: &Condition) -> Result<ArmedOutputs> {
        // SAFETY: the caller's promise.
        unsafe { self.collective(&Coll::AllGather { send, recv, count, dtype }, on) }
    }

    /// `send` (`nranks × recv_count` elements) reduced across the ranks; rank r gets part r
    /// in `recv` (in place: `recv == send + rank × recv_count elements`).
    ///
    /// # Safety
    /// As `all_reduce`; `send` holds `nranks × recv_count` elements.
    pub unsafe fn reduce_scatter(
        &self,
        send: u64,
        recv: u64,
        recv_count: usize,
        dtype: DataType,
        op: RedOp,
        on: &Condition,
    ) -> Result<ArmedOutputs> {
        // SAFETY: the caller's promise.
        unsafe { self.collective(&Coll::ReduceScatter { send, recv, recv_count, dtype, op }, on) }
    }

    /// Rank `root`'s `count` elements of `send` into `recv` of every rank (`send` is read on
    /// the root only).
    ///
    /// # Safety
    /// As `all_reduce`.
    pub unsafe fn broadcast(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        root: usize,
        on: &Condition,
    ) -> Result<ArmedOutputs> {
        // SAFETY: the caller's promise.
        unsafe { self.collective(&Coll::Broadcast { send, recv, count, dtype, root }, on) }
    }

    /// `count` elements of `send` reduced with `op` across the ranks into `recv` of rank
    /// `root` (`recv` is written on the root only).
    ///
    /// # Safety
    /// As `all_reduce`.
    #[allow(clippy::too_many_arguments)] // NCCL's ncclReduce, with the condition for the stream
    pub unsafe fn reduce(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        op: RedOp,
        root: usize,
        on: &Condition,
    ) -> Result<ArmedOutputs> {
        // SAFETY: the caller's promise.
        unsafe { self.collective(&Coll::Reduce { send, recv, count, dtype, op, root }, on) }
    }

    /// NCCL's pre-multiplied sum (`ncclRedOpCreatePreMulSum`) as an all-reduce (`kind`
    /// `AllReduce`), reduce (`Reduce`, to `root`) or reduce-scatter (`ReduceScatter`, `count`
    /// per rank): every rank's input is multiplied by its own `scalar` (an element of
    /// `dtype`), then summed.
    ///
    /// # Safety
    /// As the collective without the scalar; a `PreMulScalar::Device` address is GPU memory of
    /// this rank's device holding one element, valid until the collective ran.
    #[allow(clippy::too_many_arguments)] // the collective's own arguments, with the scalar
    pub unsafe fn premul_sum(
        &self,
        kind: PremulKind,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        scalar: PreMulScalar,
        root: usize,
        on: &Condition,
    ) -> Result<ArmedOutputs> {
        // SAFETY: the caller's promise.
        unsafe { self.collective(&Coll::PremulSum { kind, send, recv, count, dtype, scalar, root }, on) }
    }

    /// Any of the collectives above, described by `call`.
    ///
    /// # Safety
    /// As the collective's own method.
    pub unsafe fn collective(&self, call: &Coll, on: &Condition) -> Result<ArmedOutputs> {
        let call = self.checked(call)?;
        self.run(call, on, None)
    }

    /// What `collective` would refuse `c` for before issuing anything: its counts, root and
    /// buffers (GPU memory of this rank's device, where this rank touches them). For a caller
    /// that issues the call later (the NCCL library's groups).
    pub fn check_collective(&self, c: &Coll) -> Result<()> {
        let call = self.checked(c)?;
        if call.part_bytes != 0 {
            self.check_buffers(&call)?;
        }
        Ok(())
    }

    /// The buffers this rank touches in `call` (its send buffer, unless a broadcast's root is
    /// another rank; its receive buffer, unless a reduce's root is) must be GPU memory of its
    /// device; the call with those it does not touch set to 0.
    fn check_buffers(&self, call: &Call) -> Result<Call> {
        let reads_send = call.kind != CollKind::Broadcast || call.root == self.rank;
        let writes_recv = call.kind != CollKind::Reduce || call.root == self.rank;
        if reads_send {
            self.check_device_buffer(call.send, "send")?;
        }
        if writes_recv {
            self.check_device_buffer(call.recv, "receive")?;
        }
        Ok(Call { send: if reads_send { call.send } else { 0 }, recv: if writes_recv { call.recv } else { 0 }, ..*call })
    }

    /// The call `c` describes, its counts and root checked against this communicator; an fp8
    /// average becomes NCCL's pre-multiplied sum (`fp8_arithmetic`).
    fn checked(&self, c: &Coll) -> Result<Call> {
        let call = self.checked_counts(c)?;
        if call.dtype.fp8().is_some() && call.kind.reduces() {
            return self.fp8_arithmetic(call);
        }
        Ok(call)
    }

    /// An fp8 reduction: as NCCL, only on sm_90 and later GPUs (the kernels' conversions
    /// need sm_89), and an average is a pre-multiplied sum by 1/n rounded to the type
    /// (`types::fp8_avg_scalar`: averaging after summing would saturate the sum first).
    fn fp8_arithmetic(&self, call: Call) -> Result<Call> {
        let (major, minor) = crate::cuda::device_arch(self.device)?;
        if major < 9 {
            return Err(Error::invalid_param(format!(
                "{} of {}: fp8 reductions need a GPU of compute capability 9.0 or later, as in NCCL; device {} is {major}.{minor}",
                call.kind.name(),
                call.dtype.name(),
                self.device
            )));
        }
        match fp8_avg_scalar(call.dtype, self.nranks) {
            Some(scalar) if call.op == RedOp::Avg => Ok(Call { op: RedOp::Sum, premul: Some(PreMulScalar::Value(scalar.into())), ..call }),
            _ => Ok(call),
        }
    }

    /// The call `c` describes, its counts and root checked against this communicator.
    fn checked_counts(&self, c: &Coll) -> Result<Call> {
        let n = self.nranks;
        let call = |kind, send, recv, part_bytes, dtype, op, root| Call { kind, send, recv, part_bytes, dtype, op, root, premul: None };
        Ok(match *c {
            Coll::AllReduce { send, recv, count, dtype, op } => {
                call(CollKind::AllReduce, send, recv, self.bytes(count, dtype)?, dtype, op, 0)
            }
            Coll::AllGather { send, recv, count, dtype } => {
                self.bytes(count.checked_mul(n).ok_or_else(too_large)?, dtype)?;
                call(CollKind::AllGather, send, recv, self.bytes(count, dtype)?, dtype, RedOp::Sum, 0)
            }
            Coll::ReduceScatter { send, recv, recv_count, dtype, op } => {
                self.bytes(recv_count.checked_mul(n).ok_or_else(too_large)?, dtype)?;
                call(CollKind::ReduceScatter, send, recv, self.bytes(recv_count, dtype)?, dtype, op, 0)
            }
            Coll::Broadcast { send, recv, count, dtype, root } => {
                self.check_root(root)?;
                call(CollKind::Broadcast, send, recv, self.bytes(count, dtype)?, dtype, RedOp::Sum, root)
            }
            Coll::Reduce { send, recv, count, dtype, op, root } => {
                self.check_root(root)?;
                call(CollKind::Reduce, send, recv, self.bytes(count, dtype)?, dtype, op, root)
            }
            Coll::PremulSum { kind, send, recv, count, dtype, scalar, root } => {
                let part_bytes = self.bytes(count, dtype)?;
                let (kind, root) = match kind {
                    PremulKind::AllReduce => (CollKind::AllReduce, 0),
                    PremulKind::ReduceScatter => {
                        self.bytes(count.checked_mul(n).ok_or_else(too_large)?, dtype)?;
                        (CollKind::ReduceScatter, 0)
                    }
                    PremulKind::Reduce => {
                        self.check_root(root)?;
                        (CollKind::Reduce, root)
                    }
                };
                if let PreMulScalar::Device(addr) = scalar {
                    self.check_device_buffer(addr, "pre-multiplied sum's scalar")?;
                }
                Call { premul: Some(scalar), ..call(kind, send, recv, part_bytes, dtype, RedOp::Sum, root) }
            }
        })
    }

    fn bytes(&self, count: usize, dtype: DataType) -> Result<usize> {
        count.checked_mul(dtype.size()).filter(|b| *b <= isize::MAX as usize).ok_or_else(too_large)
    }

    fn check_root(&self, root: usize) -> Result<()> {
        if root >= self.nranks {
            return Err(Error::invalid_param(format!("root {root} of a communicator of {} ranks", self.nranks)));
        }
        Ok(())
    }

    /// Check the call, then launch its rounds (or add them to the condition's graph, or arm
    /// them on its kernel trigger). `known`: every rank's buffers, from `issue_together`.
    fn run(&self, call: Call, on: &Condition, known: Option<&Known>) -> Result<ArmedOutputs> {
        self.check_aborted()?;
        // First, before any check of our own that could fail on this rank alone and leave the
        // others waiting in the exchange.
        if self.check_calls {
            self.agree(&call)?;
        }
        match on.category() {
            Category::Stream | Category::Graph => self.issue(&call, on, known),
            Category::KernelTriggered => self.arm_triggered(&call, on),
            Category::HostStream => Err(Error::unsupported(
                "collectives start on CUDA stream, graph and kernel-triggered conditions, not on host streams (they move GPU buffers)",
            )),
        }
    }

    /// The checked call on a kernel-triggered condition (`triggered`): run by the triggering
    /// thread itself where it is a small all-reduce and every rank can share a mailbox, else
    /// captured once and launched per trigger.
    fn arm_triggered(&self, call: &Call, on: &Condition) -> Result<ArmedOutputs> {
        let what = format!("a kernel-triggered {} of {} bytes", call.kind.name(), call.part_bytes);
        if triggered::on_device(self.trigger_max, call.kind, call.part_bytes, call.dtype, call.premul.is_some(), self.nranks) {
            self.check_device_buffer(call.send, "send")?;
            self.check_device_buffer(call.recv, "receive")?;
            let on_device = DeviceCall {
                send: call.send,
                recv: call.recv,
                bytes: call.part_bytes,
                dtype: call.dtype.nccl() as u64,
                op: call.op.nccl() as u64,
            };
            if let Some(handle) = self.triggered.arm_on_device(on, what.clone(), &self.direct_context(), on_device)? {
                return Ok(ArmedOutputs { device_handle: handle, ..Default::default() });
            }
        }
        let cache = self.kernel_cache.as_deref();
        let handle = self.triggered.arm(on, what, &self.workspace, cache, |captured| self.issue(call, captured, None).map(drop))?;
        Ok(ArmedOutputs { device_handle: handle, ..Default::default() })
    }

    /// The checked call on a stream or graph condition: its rounds launched or added.
    fn issue(&self, call: &Call, on: &Condition, known: Option<&Known>) -> Result<ArmedOutputs> {
        if call.part_bytes == 0 {
            return Ok(ArmedOutputs::default());
        }
        // A buffer this rank does not touch is not passed on (0), checked or not.
        let call = self.check_buffers(call)?;
        if let Some(outputs) = self.on_peer_buffers(&call, on, known)? {
            return Ok(outputs);
        }
        if self.large(&call) {
            return self.launch_large(&call, on);
        }
        self.launch_one_shot(&call, on, None)
    }

    /// The call on the peers' own buffers — by the direct kernel (`direct`) or the copy engines
    /// (`copy_engine`), in that order — when the configuration wants it there and every rank
    /// can share its buffers; `None`: nothing was issued. Stream conditions take either; graph
    /// conditions the direct kernel only (one kernel node; the copy engines' copies and side
    /// streams as nodes of the user's graph are not built).
    fn on_peer_buffers(&self, call: &Call, on: &Condition, known: Option<&Known>) -> Result<Option<ArmedOutputs>> {
        let at = match on.category() {
            Category::Stream => Placement::Stream(on.cuda_stream()?),
            Category::Graph => Placement::Graph(on.cuda_graph()?),
            _ => return Ok(None),
        };
        let cx = self.direct_context();
        let direct_call =
            |kind| DirectCall { kind, send: call.send, recv: call.recv, part_bytes: call.part_bytes, dtype: call.dtype, op: call.op };
        if call.part_bytes < self.peer_buffers_floor() {
            return Ok(None);
        }
        let replayed = self.replayed(at)?;
        let premul = call.premul.is_some();
        // Buffers in symmetric windows: the peers' are known without an exchange, as for a
        // replayed call, and every rank knows it alike (`windows`); or every rank's call is
        // issued here together (`together`).
        let windowed = DirectKind::of(call.kind)
            .and_then(|k| self.windows.symmetric_buffers(k, call.send, call.recv, self.nranks, call.part_bytes, self.rank));
        let bufs = windowed.as_deref().or(known.map(|k| k.bufs.as_slice()));
        // Where ranks share a process, a path that would exchange buffers inside the call is off.
        let unless_shared = |mode: Tristate, can: bool| if self.shares_process && !can { Tristate::Off } else { mode };
        // The floors stay a stream call's: on a stream the workspace kernels tie or win below
        // them with or without the exchange (`direct::auto_floor`).
        let sm_mode = unless_shared(self.sm_mode, bufs.is_some());
        if let Some(kind) = direct::wanted(sm_mode, self.sm_min, call.kind, call.part_bytes, self.nranks, premul, replayed) {
            // SAFETY: the caller's promise on the buffers (`all_reduce` and the others), checked
            // to be GPU memory of this device by `run`.
            if let Some(node) = unsafe { self.direct.try_run(&cx, &direct_call(kind), at, bufs) }? {
                if windowed.is_some() {
                    self.windows.note_hit();
                }
                return Ok(Some(ArmedOutputs { start_node: node, done_node: node, device_handle: 0 }));
            }
        }
        let Placement::Stream(stream) = at else { return Ok(None) };
        let pieces = self.ring.pieces();
        // The ring writes into the peers' scratch too: known only where `together` made it.
        let ring_known = known.and_then(|k| Some((k.bufs.as_slice(), k.ring_scratch.as_deref()?)));
        let ring_mode = unless_shared(self.ring_mode, ring_known.is_some());
        if let Some(kind) = ce_ring::wanted(ring_mode, self.ring_min, call.kind, call.part_bytes, self.nranks, pieces, premul, replayed) {
            // SAFETY: as above.
            if unsafe { self.ring.try_run(&cx, &direct_call(kind), stream, ring_known) }? {
                return Ok(Some(ArmedOutputs::default()));
            }
        }
        let ce_mode = unless_shared(self.ce_mode, bufs.is_some());
        let Some(kind) =
            copy_engine::wanted(ce_mode, self.ce_min, call.kind, call.part_bytes, self.nranks, call.dtype.size(), premul, replayed)
        else {
            return Ok(None);
        };
        // SAFETY: as above.
        let ran = unsafe { self.ce.try_run(&cx, &direct_call(kind), stream, bufs) }?;
        Ok(ran.then(ArmedOutputs::default))
    }

    /// Below every path's floor (every mode applies its floor) no call goes to the peers'
    /// buffers: nothing to ask CUDA about.
    fn peer_buffers_floor(&self) -> usize {
        self.sm_min.min(self.ce_min).min(self.ring_min)
    }

    /// Whether a call at `at` is replayed (captured into a graph or added to one): its buffers
    /// are then exchanged once, for every replay.
    fn replayed(&self, at: Placement) -> Result<bool> {
        Ok(match at {
            Placement::Graph(_) => true,
            Placement::Stream(stream) => {
                [self.sm_mode, self.ce_mode, self.ring_mode].contains(&Tristate::Auto) && crate::cuda::capture_graph(stream)?.is_some()
            }
        })
    }

    /// Where every rank of this communicator lives in this process (ncclCommInitAll), what
    /// tells it from any other communicator here; `None` otherwise (`together::issue_group`).
    pub fn family_here(&self) -> Option<(u32, u64)> {
        self.all_here.then_some(self.family)
    }

    /// The checked call `c` on `on` and what `together::issue_together` compares across the
    /// ranks, when it could go to the peers' buffers with every rank's buffers known: every
    /// rank in this process, not aborted, an all-reduce, all-gather or reduce-scatter (not a
    /// pre-multiplied sum) above the paths' floor, on GPU buffers of this rank's device, on a
    /// stream or graph condition. `None`: issue it alone.
    pub(crate) fn together_shape(&self, c: &Coll, on: &Condition) -> Result<Option<(Call, Shape)>> {
        if !self.all_here || self.check_aborted().is_err() {
            return Ok(None);
        }
        let call = self.checked(c)?;
        if call.premul.is_some() || DirectKind::of(call.kind).is_none() || call.part_bytes < self.peer_buffers_floor().max(1) {
            return Ok(None);
        }
        if self.check_buffers(&call).is_err() {
            return Ok(None);
        }
        let (graph, at) = match on.category() {
            Category::Stream => (false, Placement::Stream(on.cuda_stream()?)),
            Category::Graph => (true, Placement::Graph(on.cuda_graph()?)),
            _ => return Ok(None),
        };
        let shape = Shape {
            family: self.family,
            nranks: self.nranks,
            kind: call.kind,
            part_bytes: call.part_bytes,
            dtype: call.dtype,
            op: call.op,
            graph,
            replayed: self.replayed(at)?,
        };
        Ok(Some((call, shape)))
    }

    /// This rank's copy-engine ring scratch for `call`, made now, where the ring may take it
    /// (`shape` as `together_shape` gave it): `None` where it may not, or the scratch could
    /// not be made (then no rank's call takes the ring).
    pub(crate) fn ring_scratch_for(&self, call: &Call, shape: &Shape) -> Option<u64> {
        if shape.graph {
            return None;
        }
        let pieces = self.ring.pieces();
        let kind = ce_ring::wanted(self.ring_mode, self.ring_min, call.kind, call.part_bytes, self.nranks, pieces, false, shape.replayed)?;
        self.ring.scratch_for(kind, self.nranks, call.part_bytes).ok()
    }

    /// `call` (from `together_shape`) with every rank's buffers known.
    ///
    /// # Safety
    /// As the collective's own method.
    pub(crate) unsafe fn run_known(&self, call: Call, on: &Condition, known: &Known) -> Result<ArmedOutputs> {
        self.run(call, on, Some(known))
    }

    /// What a call on the peers' buffers (or a kernel-triggered one's mailbox) needs.
    fn direct_context(&self) -> DirectContext<'_> {
        DirectContext {
            workspace: &self.workspace,
            bootstrap: &self.bootstrap,
            board: self.board.as_ref(),
            rank: self.rank,
            nranks: self.nranks,
            device: self.device,
            kernel_cache: self.kernel_cache.as_deref(),
            timeout_ns: self.timeout.as_nanos().min(u64::MAX as u128) as u64,
        }
    }

    /// An allgather inside a call: on the board where there is one.
    fn exchange(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        match &self.board {
            Some(b) => b.allgather(&self.bootstrap, mine),
            None => self.bootstrap.allgather(mine),
        }
    }

    /// `GSC_COLL_CHECK`: every rank made the same call, or an error naming the one that did not.
    fn agree(&self, call: &Call) -> Result<()> {
        let count = call.part_bytes / call.dtype.size();
        let mut mine = Signature::new(call.kind, call.dtype, call.op, count, call.root);
        if call.premul.is_some() {
            mine = mine.premul();
        }
        let all = self.exchange(&mine.encode()).map_err(|e| e.context("comparing the collective call (GSC_COLL_CHECK)"))?;
        let all = all.iter().map(|b| Signature::decode(b)).collect::<Result<Vec<_>>>()?;
        agreement::check(&all)
    }

    /// The one-shot LL exchange (`gsc_coll_<type>_<op>`), every round in one launch, after
    /// graph node `after` if given.
    fn launch_one_shot(&self, call: &Call, on: &Condition, after: Option<usize>) -> Result<ArmedOutputs> {
        let kernel = format!("gsc_coll_{}_{}", call.dtype.kernel_tag(), call.op_tag());
        let args = self.kernel_args(call, call.part_bytes, SLOT_PAYLOAD, call.part_bytes.div_ceil(SLOT_PAYLOAD));
        let cache = self.kernel_cache.as_deref();
        let grid = one_shot_grid(&args);
        match on.category() {
            Category::Graph => {
                let node = self.workspace.add_node(on.cuda_graph()?, &kernel, cache, args, grid, after)?;
                Ok(ArmedOutputs { start_node: node, done_node: node, device_handle: 0 })
            }
            _ => self.workspace.launch(on.cuda_stream()?, &kernel, cache, args, grid).map(|()| ArmedOutputs::default()),
        }
    }

    /// A workspace kernel's arguments for `bytes` of `call` per part, in `rounds` of `chunk`
    /// (the workspace fills in its own: `Workspace::fill`). A buffer this rank does not touch
    /// is 0 (`check_buffers`) and stays so.
    fn kernel_args(&self, call: &Call, bytes: usize, chunk: usize, rounds: usize) -> CollArgs {
        CollArgs {
            send: call.send,
            recv: call.recv,
            bytes: bytes as u64,
            chunk: chunk as u64,
            rounds: rounds as u64,
            send_stride: if call.kind == CollKind::ReduceScatter { bytes as u64 } else { 0 },
            recv_stride: if call.kind == CollKind::AllGather { bytes as u64 } else { 0 },
            nranks: self.nranks as u64,
            rank: self.rank as u64,
            root: call.root as u64,
            kind: call.kind as u64,
            timeout_ns: self.timeout.as_nanos().min(u64::MAX as u128) as u64,
            premul_bits: call.premul_bits(),
            premul_ptr: call.premul_ptr(),
            ..Default::default()
        }
    }

    /// Whether the call takes a large algorithm (the table in `select`).
    fn large(&self, call: &Call) -> bool {
        let coll = match call.kind {
            CollKind::AllReduce => Collective::AllReduce,
            CollKind::AllGather => Collective::AllGather,
            CollKind::ReduceScatter => Collective::ReduceScatter,
            CollKind::Broadcast => Collective::Broadcast,
            CollKind::Reduce => Collective::Reduce,
        };
        select::choose(coll, call.part_bytes, self.large_min, self.large.algo).is_large()
    }

    /// A large collective: one launch of the communicator's large kernel (phased or pipelined,
    /// `large`; its narrow twin where buffers or parts are off 16 bytes), each
    /// block owning a region of every round. All-gather and reduce-scatter run the halves of
    /// the all-reduce on parts of whole elements (`select`); the all-reduce,
    /// and broadcast and reduce on its pattern, move whole 16-byte pieces and a tail of fewer
    /// bytes (whole elements: 16 is a multiple of every datatype's size) follows as a one-shot
    /// exchange.
    fn launch_large(&self, call: &Call, on: &Condition) -> Result<ArmedOutputs> {
        let (kind, bytes) = match call.kind {
            // Two ranks' reduce is a reduce-scatter to the root (one flag exchange a round);
            // otherwise broadcast and reduce take the all-reduce's geometry (`cuda::coll`).
            CollKind::Reduce if self.nranks == 2 => (LargeKind::ReduceScatter, call.part_bytes & !15),
            CollKind::AllReduce | CollKind::Broadcast | CollKind::Reduce => (LargeKind::AllReduce, call.part_bytes & !15),
            CollKind::ReduceScatter => (LargeKind::ReduceScatter, call.part_bytes),
            CollKind::AllGather => (LargeKind::AllGather, call.part_bytes),
        };
        let l = large::launch(&self.large, kind, self.nranks, bytes, big_round_max());
        let args = CollArgs {
            stages: l.stages as u64,
            stage_bytes: l.stage_bytes as u64,
            push_threads: l.push_threads as u64,
            reduce_threads: l.reduce_threads as u64,
            ..self.kernel_args(call, bytes, l.region, l.rounds)
        };
        let family = select::large_kernel(self.large.algo, large_alignment(call));
        let kernel = format!("gsc_coll_{family}_{}_{}", call.dtype.kernel_tag(), call.op_tag());
        let grid = Grid { blocks: self.large.blocks as u32, threads: self.large.threads as u32 };
        let cache = self.kernel_cache.as_deref();
        let node = match on.category() {
            Category::Graph => self.workspace.add_node(on.cuda_graph()?, &kernel, cache, args, grid, None)?,
            _ => self.workspace.launch(on.cuda_stream()?, &kernel, cache, args, grid).map(|()| 0)?,
        };
        // A buffer this rank does not touch stays 0 (a rooted collective's).
        let past = |addr: u64| if addr == 0 { 0 } else { addr + bytes as u64 };
        let tail = Call { send: past(call.send), recv: past(call.recv), part_bytes: call.part_bytes - bytes, ..*call };
        let done = match (tail.part_bytes, on.category()) {
            (0, _) => node,
            (_, Category::Graph) => self.launch_one_shot(&tail, on, Some(node))?.done_node,
            _ => self.launch_one_shot(&tail, on, None).map(|_| 0)?,
        };
        Ok(ArmedOutputs { start_node: node, done_node: done, device_handle: 0 })
    }

    fn check_device_buffer(&self, addr: u64, what: &str) -> Result<()> {
        super::check_device_buffer(addr, self.device, what)
    }
}

/// `group` with each message to a peer longer than `p2p_max + head` cut in two: its first
/// `head` bytes, which the kernel moves, and the rest, which stays the engine's; `None` when
/// none is (or `head` is 0). Both sides cut a message alike, from its length, so the k-th
/// send to a peer still pairs with the k-th receive there, in the kernel and in the engine.
fn split_heads(group: &[PeerTransfer], rank: usize, p2p_max: usize, head: usize) -> Option<Vec<PeerTransfer>> {
    let cut = |t: &PeerTransfer| head > 0 && t.peer != rank && t.bytes > p2p_max.saturating_add(head);
    if !group.iter().any(cut) {
        return None;
    }
    let mut out = Vec::with_capacity(group.len() * 2);
    for t in group {
        if cut(t) {
            out.push(PeerTransfer { bytes: head, ..*t });
            out.push(PeerTransfer { buf: t.buf + head as u64, bytes: t.bytes - head, ..*t });
        } else {
            out.push(*t);
        }
    }
    Some(out)
}

/// Where a call's addresses sit for the large kernels: its buffers and, for all-gather and
/// reduce-scatter, its parts, which stride the buffers. A rank that does not touch a buffer
/// passes 0 for it, which is aligned.
fn large_alignment(call: &Call) -> Alignment {
    let strides = match call.kind {
        CollKind::AllGather | CollKind::ReduceScatter => call.part_bytes as u64,
        _ => 0,
    };
    Alignment::of(call.send | call.recv | strides, call.dtype.size())
}

fn too_large() -> Error {
    Error::invalid_param("a collective's size in bytes overflows")
}

/// The ranks that split into the same communicator as a rank of `color`, in their new order:
/// those of that color, by (key, old rank). `entries[r]` is rank r's (color, key). None for
/// `color` (no color): no members.
fn split_members(entries: &[(Option<u32>, i32)], color: Option<u32>) -> Vec<usize> {
    let Some(color) = color else { return Vec::new() };
    let mut members: Vec<usize> = (0..entries.len()).filter(|&r| entries[r].0 == Some(color)).collect();
    members.sort_by_key(|&r| (entries[r].1, r));
    members
}

#[cfg(test)]
mod tests {
    use super::{PeerOp, PeerTransfer, split_heads, split_members};

    #[test]
    fn heads_are_cut_from_messages_to_peers_past_the_kernels_limit() {
        let t = |op, buf, bytes, peer| PeerTransfer { op, buf, bytes, peer };
        let (max, head) = (32 << 20, 4 << 20);
        let group = [
            t(PeerOp::Send, 0x1000_0000, 64 << 20, 1),
            t(PeerOp::Recv, 0x2000_0000, max + head, 1), // not longer than max + head: whole
            t(PeerOp::Send, 0x3000_0000, 64 << 20, 0),   // to itself: whole
            t(PeerOp::Recv, 0x4000_0000, max + head + 1, 2),
        ];
        let got = split_heads(&group, 0, max, head).unwrap();
        assert_eq!(
            got,
            [
                t(PeerOp::Send, 0x1000_0000, head, 1),
                t(PeerOp::Send, 0x1000_0000 + head as u64, (64 << 20) - head, 1),
                group[1],
                group[2],
                t(PeerOp::Recv, 0x4000_0000, head, 2),
                t(PeerOp::Recv, 0x4000_0000 + head as u64, max + 1, 2),
            ]
        );
        assert_eq!(split_heads(&group, 0, max, 0), None, "0: off");
        assert_eq!(split_heads(&group[1..3], 0, max, head), None, "nothing to cut");
    }

    #[test]
    fn split_orders_members_by_key_then_rank() {
        let entries = [(Some(1), 0), (Some(0), 5), (None, 0), (Some(1), -3), (Some(0), 5), (Some(1), 0)];
        assert_eq!(split_members(&entries, Some(1)), [3, 0, 5]);
        assert_eq!(split_members(&entries, Some(0)), [1, 4], "equal keys keep the old order");
        assert!(split_members(&entries, None).is_empty());
        assert!(split_members(&entries, Some(7)).is_empty());
    }
}
