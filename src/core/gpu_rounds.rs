//! Prepared transfers whose rounds run on the GPU: no proxy and no frame per round.
//!
//! Pairing (the hello) exchanges each side's control block (`cuda::prep_ctl`) and, from the
//! receiver, its buffer's CUDA IPC key. Each side then maps what it writes: the receiver the
//! sender's control block (to say "ready for round e"), the sender the receiver's control block
//! and buffer (to write the data and "round e arrived"). A round is one kernel on the user's
//! stream (`gsc_prep_kernel`, a graph node under capture or on a graph condition): the round
//! number lives in the control block and is bumped by the kernel, so graph rounds replay any
//! number of times.
//! A send's kernel waits on its stream until the receiver is ready (so on one stream a receive
//! should be started before a send, as a halo exchange does); a receive started without a
//! stream wait puts its wait on the stream at the next `Condition::wait`. Spins give up after
//! `GSC_TIMEOUT` and record the round (`Prepared::gpu_error`); a dead peer never hangs the GPU.
//! A partitioned send's round is begun by our kernel and its partitions sent by the user's
//! kernels (`gsc_pready` in gsc_device.cuh, any order); a partitioned receive is written in
//! place, so `gsc_parrived` can tell a kernel which partitions it may read already.
//! Receives up to 64 KiB are staged in our slab (any buffer works, the peer maps one slab);
//! up to 2 KiB as LL words (flags beside the data: no release fence, no arrival word), and a
//! staged receive's wait announces the next round at once, so a round after the first costs
//! the receiver no release store of its own. LL rounds alternate between two slots, so the
//! sender of round e only needs round e - 2 consumed: in a steady exchange it never waits for
//! readiness (the one-way trip of the "ready" word is off the critical path).

use super::prepared::Prepared;
use super::request::ReqKind;
use super::request::{RequestParams, Started};
use super::worker::State;
use crate::cuda::host_round::{HostRound, RoundStream};
use crate::cuda::prep_ctl::{CtlBlock, LL_MAX, PEER_WORD, STAGE_MAX, block_bytes, ll_area_bytes, ll_slot_words};
use crate::cuda::{PREP_BEGIN, PREP_READY, PREP_READY_WAIT, PREP_SEND, PREP_WAIT, PrepArgs, ipc};
use crate::error::{Error, Result, Status};
use crate::protocols::prepared::{DeviceHello, DevicePeer, PrepDir};
use crate::protocols::{Action, Actions, RecvInfo, ReqId};
use crate::transport::LaneKind;
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// What the first start maps: the peer's word we write, where a send's data goes, the peer's
/// length, and, when the rounds' data travels as LL words, the receiver's slot stride in words
/// (0: not LL).
#[derive(Copy, Clone)]
struct Mapped {
    remote: u64,
    dst: u64,
    peer_len: usize,
    ll: u64,
}

pub(crate) struct GpuSide {
    dir: PrepDir,
    tag: u64,
    ctl: CtlBlock,
    addr: usize,
    len: usize,
    /// Partitions (1: a persistent transfer). Partitioned sends are sent by the user's
    /// kernels (`gsc_pready`); both sides must split alike.
    parts: usize,
    partitioned: bool,
    timeout: Duration,
    /// A receive of up to `STAGE_MAX` bytes: the staging area (after its control block, in our
    /// slab) the sender writes into; the wait copies it into the buffer.
    stage: Option<u64>,
    /// This receive is staged as LL words (a send learns it from the peer at mapping).
    ll: bool,
    /// Set at the first start (after pairing): the peer's word we write (a send: its first
    /// arrival word) and, for a send, where the data goes, both mapped into our GPU's space.
    mapped: OnceLock<Mapped>,
    /// The kernels' descriptor, written once (`Prepared::device_handle`).
    descriptor: OnceLock<u64>,
    /// Rounds started from the host run here (created at the first).
    round_stream: OnceLock<Arc<RoundStream>>,
    /// The device handle of starts on kernel-triggered conditions (made at the first).
    kernel_handle: OnceLock<crate::cuda::DeviceHandleSlot>,
    /// A round started from the host is in flight.
    host_busy: Arc<AtomicBool>,
}

/// Whether the legacy CUDA IPC allocation `key` names may share its memory block with other
/// allocations: the driver sub-allocates blocks of 2 MiB, and the peer can open a block only
/// once (`ipc::map_peer` reports ALREADY_MAPPED for a second allocation in it). The proxy path
/// survives that by pushing the data in frames; a GPU round cannot, so an offered (not
/// required) in-place receive in a small allocation leaves its rounds to the proxy.
fn shares_a_block(key: &[u8]) -> Result<bool> {
    const BLOCK: u64 = 2 << 20;
    let key = ipc::DeviceKey::decode(key)?;
    Ok(matches!(key.kind, ipc::KeyKind::Legacy(_)) && key.size < BLOCK)
}

/// A round started from the host, until its kernel ended.
pub(crate) struct HostRoundInFlight {
    req: ReqId,
    round: HostRound,
    ctl: CtlBlock,
    info: RecvInfo,
    busy: Arc<AtomicBool>,
}

/// Complete the host-started rounds whose kernels ended; returns how many did. A kernel that
/// gave up on the peer (its control block's error word) fails its request with `TimedOut`.
pub(crate) fn poll_host_rounds(rounds: &mut Vec<HostRoundInFlight>, out: &mut Actions) -> usize {
    let mut done = 0;
    let mut i = 0;
    while i < rounds.len() {
        let Some(result) = rounds[i].round.poll() else {
            i += 1;
            continue;
        };
        let r = rounds.swap_remove(i);
        let status = match result.and_then(|()| r.ctl.error()) {
            Ok(0) => Status::Ok,
            Ok(_) => Status::TimedOut,
            Err(e) => e.status(),
        };
        r.busy.store(false, Ordering::Release);
        out.push(Action::Complete { req: r.req, status, info: r.info });
        done += 1;
    }
    done
}

impl GpuSide {
    /// This side's control block and what it announces. Whether GPU rounds are possible at all
    /// (a GPU buffer, the shm lane with CUDA IPC, peer access) the selection table decided.
    /// `required`: the GPU rounds were asked for (not only offered).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        st: &State,
        required: bool,
        dir: PrepDir,
        tag: u64,
        addr: usize,
        len: usize,
        partitions: Option<usize>,
        timeout: Option<Duration>,
    ) -> Result<(GpuSide, DeviceHello)> {
        let parts = partitions.unwrap_or(1);
        // Checked here too (the engine checks again): before a control block is taken.
        if parts == 0 || !len.is_multiple_of(parts) {
            return Err(Error::invalid_param(format!("buffer of {len} bytes does not split into {parts} equal partitions")));
        }
        if parts > crate::cuda::prep_ctl::MAX_PARTS {
            return Err(Error::invalid_param(format!("at most {} partitions with rounds on the GPU", crate::cuda::prep_ctl::MAX_PARTS)));
        }
        let device = crate::cuda::memory::device_ptr(addr)?.map(|p| p.device).ok_or_else(|| Error::invalid_param("not GPU memory"))?;
        // A small receive is staged in our slab: the sender maps the slab once for every pair,
        // whatever allocation the user's buffer sits in (a peer cannot open a second buffer of
        // a CUDA block it already opened; small cudaMalloc buffers share blocks).
        // (A partitioned receive is written in place: its partitions are readable as they
        // arrive, `gsc_parrived`.)
        let staged = dir == PrepDir::Recv && len <= STAGE_MAX && partitions.is_none();
        // A small one is staged as LL words (flags beside the data: no fence, no arrival word).
        let ll = staged && len <= LL_MAX;
        let stage_bytes = if ll {
            ll_area_bytes(len)
        } else if staged {
            len
        } else {
            0
        };
        let ctl = CtlBlock::take(device, parts, stage_bytes)?;
        let stage = staged.then(|| ctl.addr + block_bytes(parts) as u64);
        let (buf_addr, buf_key) = match (dir, stage) {
            (PrepDir::Send, _) => (0, Vec::new()),
            (PrepDir::Recv, Some(stage)) => (stage, ctl.key.clone()),
            (PrepDir::Recv, None) => {
                let key = super::device_mem::DeviceMem::send_key(st.device.ipc, LaneKind::Shm, addr, len)
                    .ok_or_else(|| Error::unsupported("this GPU buffer cannot be shared through CUDA IPC"))?;
                if !required && shares_a_block(&key)? {
                    return Err(Error::unsupported(
                        "a receive written in place in an allocation under 2 MiB: its CUDA memory block may hold other \
                         allocations the peer opened already, and a block opens once per process (proxy rounds instead)",
                    ));
                }
                (addr as u64, key)
            }
        };
        let hello = DeviceHello { ctl_addr: ctl.addr, ctl_key: ctl.key.clone(), buf_addr, buf_key, ll, proxy_key: Vec::new() };
        let timeout = timeout.unwrap_or(Duration::from_secs(3600));
        let side = GpuSide {
            dir,
            tag,
            ctl,
            addr,
            len,
            parts,
            partitioned: partitions.is_some(),
            timeout,
            stage,
            ll,
            mapped: OnceLock::new(),
            descriptor: OnceLock::new(),
            round_stream: OnceLock::new(),
            kernel_handle: OnceLock::new(),
            host_busy: Arc::new(AtomicBool::new(false)),
        };
        Ok((side, hello))
    }

    /// One round on the stream (or as a node of the graph) of `params.condition`.
    pub(super) fn start(&self, p: &Prepared, params: RequestParams) -> Result<Started> {
        // The pair must still be there: released here or by the peer, or its link gone, a round
        // would only spin until the timeout.
        p.worker().with_state(|st, _| st.engine.prepared.device_peer(p.id()))?;
        let Mapped { remote, dst, peer_len, ll } = self.mapped(p)?;
        let args = PrepArgs {
            ctl: self.ctl.addr,
            remote,
            src: self.addr as u64,
            dst,
            // A receive copies out what the sender sends (it may be shorter).
            len: if self.dir == PrepDir::Recv { peer_len.min(self.len) as u64 } else { self.len as u64 },
            role: PREP_SEND,
            timeout_ns: self.timeout.as_nanos().min(u64::MAX as u128) as u64,
            stage: self.stage.unwrap_or(0),
            buf: self.addr as u64,
            parts: self.parts as u64,
            ll,
        };
        let Some(cond) = params.condition.as_ref() else { return self.start_on_host(p, params, args) };
        if cond.category() == crate::condition::Category::KernelTriggered {
            return self.start_from_kernels(p, cond);
        }
        let outputs = match self.dir {
            // The user's kernels send the partitions (`gsc_pready`) after this begins the round.
            PrepDir::Send if self.partitioned => cond.gpu_round(PrepArgs { role: PREP_BEGIN, ..args }, None)?,
            PrepDir::Send => cond.gpu_round(args, None)?,
            PrepDir::Recv if params.no_stream_wait => {
                cond.gpu_round(PrepArgs { role: PREP_READY, ..args }, Some(PrepArgs { role: PREP_WAIT, ..args }))?
            }
            PrepDir::Recv => cond.gpu_round(PrepArgs { role: PREP_READY_WAIT, ..args }, None)?,
        };
        Ok(Started::Armed(outputs))
    }

    /// Started on a kernel-triggered condition: a device handle on which the user's kernels
    /// run the rounds themselves (`gsc_trigger`, `gsc_wait`: gsc_prep_trigger in
    /// gsc_device.cuh), made at the first such start and returned by every later one.
    fn start_from_kernels(&self, p: &Prepared, cond: &crate::condition::Condition) -> Result<Started> {
        if self.partitioned && self.dir == PrepDir::Send {
            return Err(Error::unsupported(
                "a partitioned send with GPU rounds is begun on a CUDA stream or graph (its partitions are sent by kernels: gsc_pready)",
            ));
        }
        let handle = match self.kernel_handle.get() {
            Some(h) => h.addr(),
            None => {
                let descriptor = self.device_handle(p)?;
                let slot = cond
                    .prepared_kernel_handle(descriptor, self.dir == PrepDir::Recv)?
                    .ok_or_else(|| Error::new(Status::Internal, "not a kernel-triggered condition"))?;
                self.kernel_handle.get_or_init(|| slot).addr()
            }
        };
        Ok(Started::Armed(crate::condition::ArmedOutputs { device_handle: handle, ..Default::default() }))
    }

    /// A round started without a condition: our kernel on this side's own stream
    /// (`cuda::host_round`); the request completes when it ended, as the worker's progress
    /// finds (`poll_host_rounds`). One such round at a time (`Busy` otherwise), like any start
    /// without a condition.
    fn start_on_host(&self, p: &Prepared, params: RequestParams, args: PrepArgs) -> Result<Started> {
        if self.partitioned && self.dir == PrepDir::Send {
            return Err(Error::unsupported(
                "a partitioned send with GPU rounds is begun on a CUDA stream or graph (its partitions are sent by kernels: gsc_pready)",
            ));
        }
        if self.host_busy.swap(true, Ordering::AcqRel) {
            return Err(Error::new(Status::Busy, "a round of this prepared transfer started from the host is still in flight"));
        }
        let started = self.launch_on_host(p, params, args);
        if started.is_err() {
            self.host_busy.store(false, Ordering::Release);
        }
        started
    }

    fn launch_on_host(&self, p: &Prepared, params: RequestParams, args: PrepArgs) -> Result<Started> {
        let stream = match self.round_stream.get() {
            Some(s) => s.clone(),
            None => {
                let cache = p.worker().context().config().kernel_cache_dir.clone();
                let s = Arc::new(RoundStream::new(self.ctl.device, cache.as_deref())?);
                self.round_stream.get_or_init(|| s).clone()
            }
        };
        let (kind, role, length) = match self.dir {
            PrepDir::Send => (ReqKind::Send, PREP_SEND, self.len),
            PrepDir::Recv => (ReqKind::Recv, PREP_READY_WAIT, args.len as usize),
        };
        let info = RecvInfo { tag: self.tag, length };
        let (ctl, busy) = (self.ctl.clone(), self.host_busy.clone());
        // No link on the request: a stuck peer ends the round through the kernel's own timeout
        // (`GSC_TIMEOUT`), not by a blocking wait closing the link.
        p.worker().start_op(kind, None, params, move |st, req, _| {
            let round = stream.launch(&PrepArgs { role, ..args })?;
            st.host_rounds.push(HostRoundInFlight { req, round, ctl: ctl.clone(), info, busy: busy.clone() });
            Ok(())
        })
    }

    /// (the peer's word we write, the peer's buffer for a send), mapped once. The pair is
    /// known here: every caller came through `Prepared::gpu_side`, which waited for pairing.
    fn mapped(&self, p: &Prepared) -> Result<Mapped> {
        if let Some(m) = self.mapped.get() {
            return Ok(*m);
        }
        let peer = p
            .worker()
            .with_state(|st, _| st.engine.prepared.device_peer(p.id()))?
            .ok_or_else(|| Error::new(Status::Internal, "GPU rounds used before pairing"))?;
        // Opening the peer's memory is not a stream operation; allowed while a stream of this
        // thread is being captured.
        crate::cuda::with_relaxed_capture(|| self.map(&peer))
    }

    fn map(&self, peer: &DevicePeer) -> Result<Mapped> {
        let device = self.ctl.device;
        let ctl_key = ipc::DeviceKey::decode(&peer.hello.ctl_key)?;
        // A sender writes the receiver's arrival words (one per partition), a receiver the
        // sender's ready word.
        let words = if self.dir == PrepDir::Send { self.parts } else { 1 };
        let remote = ipc::map_peer(&ctl_key, peer.hello.ctl_addr + PEER_WORD * 8, 8 * words, device)
            .map_err(|e| e.context("opening the peer's prepared-transfer control block"))?;
        let dst = match self.dir {
            PrepDir::Send => {
                if self.len > peer.len {
                    return Err(Error::new(
                        Status::MessageTruncated,
                        format!("prepared send of {} bytes into a receive of {}", self.len, peer.len),
                    ));
                }
                let key = ipc::DeviceKey::decode(&peer.hello.buf_key)?;
                // An LL receive's whole area (two slots sized by its length), else our bytes.
                let bytes = if peer.hello.ll { ll_area_bytes(peer.len) } else { self.len };
                ipc::map_peer(&key, peer.hello.buf_addr, bytes, device)
                    .map_err(|e| e.context("opening the peer's prepared receive buffer"))?
            }
            PrepDir::Recv => 0,
        };
        // The receiver's LL slot stride, which both sides' kernels use (0: not LL).
        let ll = match self.dir {
            PrepDir::Send if peer.hello.ll => ll_slot_words(peer.len) as u64,
            PrepDir::Recv if self.ll => ll_slot_words(self.len) as u64,
            _ => 0,
        };
        Ok(*self.mapped.get_or_init(|| Mapped { remote, dst, peer_len: peer.len, ll }))
    }

    /// The device address of this side's `gsc_prepared_device_t` (for `gsc_pready` /
    /// `gsc_parrived` in the user's kernels). Waits for pairing the first time.
    pub(super) fn device_handle(&self, p: &Prepared) -> Result<u64> {
        if let Some(d) = self.descriptor.get() {
            return Ok(*d);
        }
        let Mapped { remote, dst, peer_len, ll } = self.mapped(p)?;
        let timeout = self.timeout.as_nanos().min(u64::MAX as u128) as u64;
        let words = match self.dir {
            PrepDir::Send => [self.ctl.addr, remote, self.addr as u64, dst, (self.len / self.parts) as u64, self.parts as u64, timeout, ll],
            // A receive: staging area (or none) into the buffer, the sender's length.
            PrepDir::Recv => [
                self.ctl.addr,
                remote,
                self.stage.unwrap_or(0),
                self.addr as u64,
                peer_len.min(self.len) as u64,
                self.parts as u64,
                timeout,
                ll,
            ],
        };
        let at = crate::cuda::with_relaxed_capture(|| self.ctl.write_descriptor(&words))?;
        Ok(*self.descriptor.get_or_init(|| at))
    }

    pub(super) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// 0, or the round a kernel of this side gave up on (the peer did not answer in time).
    pub(super) fn error(&self) -> Result<u64> {
        self.ctl.error()
    }
}
