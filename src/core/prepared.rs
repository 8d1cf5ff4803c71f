//! Prepared transfers as users see them: a persistent or partitioned send or receive on an
//! endpoint, prepared once and started any number of times (MPI's `Send_init`/`Recv_init`,
//! `Psend_init`/`Precv_init` + `Pready`/`Parrived`; the design's `gsc_prepare_transfers`).
//! The protocol is in protocols/prepared.rs; this module checks arguments, holds the handle and
//! routes each call through the worker.

use super::device_mem::DeviceMem;
use super::endpoint::Endpoint;
use super::gpu_rounds::GpuSide;
use super::request::{ReqKind, RequestParams, Started};
use super::worker::{Worker, check_buffer, resolve_memtype};
use crate::condition::StageDir;
use crate::error::{Error, Result, Status};
use crate::protocols::prepared::{PrepDir, PrepId, PrepSpec};
use crate::protocols::select::{self, EngineQuery};
use crate::protocols::{ConnId, EngineOffer, MemType, UserBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

pub use crate::config::Engine;

pub use crate::protocols::prepared::PrepDir as Direction;

/// What to prepare besides the buffer.
#[derive(Copy, Clone, Debug)]
pub struct PrepareParams {
    pub dir: Direction,
    pub tag: u64,
    /// `None`: persistent (each start moves the whole buffer). `Some(n)`: partitioned into `n`
    /// equal parts; a send's parts go once `pready` marks them, a receive reports them through
    /// `parrived`. The two sides may split differently; the send may be shorter than the
    /// receive, never longer.
    pub partitions: Option<usize>,
    /// Declared memory type of the buffer (`None`: detected).
    pub memory_type: Option<MemType>,
    /// Who runs the rounds (`select::prepared_engine` decides with `GSC_ENGINE`): `Auto` lets
    /// the table choose (the GPU where both sides can, see `gpu_rounds.rs`: no proxy, no
    /// frames per round); `Gpu` requires GPU rounds (an error where impossible; the peer must
    /// be able to run them too) — needed when the user's kernels drive the rounds through
    /// `device_handle`; `Proxy` the proxy thread.
    pub engine: Engine,
}

/// A prepared transfer. Each `start` is one round and returns its own request, like any
/// non-blocking operation. Dropping it releases it; with a round in flight the release happens
/// when that round ends (the buffer must stay valid until then).
pub struct Prepared {
    worker: Worker,
    id: PrepId,
    conn: ConnId,
    dir: Direction,
    /// The buffer, for rounds that stage it (see `start`).
    buf: UserBuf,
    partitioned: bool,
    /// `release` succeeded: dropping does nothing more.
    released: AtomicBool,
    /// This side offered GPU rounds: its control block and what its kernels need (used only
    /// if the pair runs on the GPU, `on_gpu`).
    pub(super) gpu: Option<GpuSide>,
    /// Learnt at pairing: the pair's rounds run on the GPU.
    on_gpu: OnceLock<bool>,
}

impl Endpoint {
    /// Prepare a transfer of `len` bytes at `buf` with the peer: announce it, pair it with the
    /// peer's preparation of the other direction and the same tag (the k-th with the k-th, in
    /// creation order), and fix the protocol once.
    ///
    /// # Safety
    /// `buf` must stay valid for `len` bytes (reads for a send, writes for a receive, which
    /// the peer may perform directly) until the `Prepared` is released, and must not be
    /// touched by the caller while a round is in flight.
    pub unsafe fn prepare(&self, buf: *mut u8, len: usize, params: PrepareParams) -> Result<Prepared> {
        check_buffer(buf, len, "prepare")?;
        let addr = buf as usize;
        let declared = RequestParams { memory_type: params.memory_type, ..Default::default() };
        let mem = resolve_memtype(&declared, addr, len)?;
        let key = self.key();
        let worker = self.worker().clone();
        let timeout = worker.context().config().timeout;
        let stage_max = worker.context().config().cuda_stage_max;
        let cfg = worker.context().config();
        let (policy, gpu_max) = (cfg.engine, cfg.engine_gpu_max);
        // Shared words (core/prep_words.rs): a send of one partition to a process of this host
        // makes its page now, outside the worker's lock (registering it with CUDA may take a
        // while, and the proxy needs the lock meanwhile). Not for a send that requires GPU
        // rounds: the proxy never runs those.
        let words = if params.dir == PrepDir::Send && params.partitions.is_none() && params.engine != Engine::Gpu {
            let lane = worker.with_state(|st, _| Ok(st.conns[key.usable(st)?].props.lane))?;
            match lane {
                crate::transport::LaneKind::Shm => {
                    let device = match mem {
                        MemType::Cuda => Some(super::device_mem::device_of(addr)?),
                        MemType::Host => None,
                    };
                    super::prep_words::SendPage::make(cfg.prep_words, &cfg.shm_dir, device)?
                }
                _ => None,
            }
        } else {
            None
        };
        let (id, conn, gpu) = worker.with_state(|st, out| {
            let conn = key.usable(st)?;
            let query = EngineQuery {
                mem,
                lane: st.conns[conn].props.lane,
                device_ipc: st.device.ipc != crate::config::Tristate::Off,
                p2p: mem == MemType::Cuda && crate::cuda::peer_access_everywhere().unwrap_or(false),
                partitioned: params.partitions.is_some(),
                len,
            };
            let mut offer = select::prepared_engine(policy, gpu_max, params.engine, &query)?;
            let (gpu, hello) = match offer {
                EngineOffer::Proxy => (None, None),
                _ => {
                    match GpuSide::new(st, offer == EngineOffer::GpuRequired, params.dir, params.tag, addr, len, params.partitions, timeout)
                    {
                        Ok((side, hello)) => (Some(side), Some(hello)),
                        Err(e) if offer == EngineOffer::GpuRequired => return Err(e),
                        Err(e) => {
                            // Only offered: the proxy runs this side's rounds instead.
                            tracing::debug!(target: "gsc::core", error = %e, "GPU rounds not offered");
                            offer = EngineOffer::Proxy;
                            (None, None)
                        }
                    }
                }
            };
            let mut device_key = None;
            // The proxy may run the rounds unless the GPU is required.
            if mem == MemType::Cuda && offer != EngineOffer::GpuRequired {
                st.device.prepare_for(addr)?;
                // A GPU receive buffer is opened to the peer once, here, so each round's data
                // can be written into it by the sender's copy engine.
                // Not for one whose stream and graph rounds are staged (`start`): those rounds go
                // in frames, so both sides must agree that no round writes in place.
                if params.dir == PrepDir::Recv && !(stageable(len, params.partitions) && len <= stage_max) {
                    let lane = st.conns[conn].props.lane;
                    device_key = DeviceMem::send_key(st.device.ipc, lane, addr, len);
                }
            }
            let buf = UserBuf { addr, len, mem };
            let spec = PrepSpec { dir: params.dir, conn, tag: params.tag, buf, partitions: params.partitions, engine: offer };
            let path = words.as_ref().map(|w| w.path());
            let id = st.engine.prepared.prepare_with_words(out, spec, device_key, hello, path.as_deref())?;
            if let Some(w) = words {
                st.prep_words.add_send(id, w);
            }
            Ok((id, conn, gpu))
        })?;
        Ok(Prepared {
            worker,
            id,
            conn,
            dir: params.dir,
            buf: UserBuf { addr, len, mem },
            partitioned: params.partitions.is_some(),
            released: AtomicBool::new(false),
            gpu,
            on_gpu: OnceLock::new(),
        })
    }
}

impl Prepared {
    pub(super) fn id(&self) -> PrepId {
        self.id
    }

    pub fn direction(&self) -> Direction {
        self.dir
    }

    pub fn worker(&self) -> &Worker {
        &self.worker
    }

    /// Start one round. Without a condition a round must not be in flight (`Busy`); with one,
    /// rounds triggered while another is in flight run after it, in order.
    pub fn start(&self, params: RequestParams) -> Result<Started> {
        if let Some(gpu) = self.gpu_side()? {
            return gpu.start(self, params);
        }
        let id = self.id;
        let queue = params.condition.is_some();
        let (kind, stage_dir) = match self.dir {
            PrepDir::Send => (ReqKind::Send, StageDir::Send),
            PrepDir::Recv => (ReqKind::Recv, StageDir::Recv),
        };
        // A small GPU buffer's stream or graph round is staged like any such operation: our
        // kernels copy it to or from a page-locked slot, and the round moves the slot's bytes in
        // frames (no copy engine for a few bytes).
        let UserBuf { addr, len, mem } = self.buf;
        let stage = match stageable(len, self.partitioned.then_some(0)) {
            true => self.worker.stage_for(&params, stage_dir, addr, len, mem)?,
            false => None,
        };
        let round_buf = stage.as_ref().map(|s| UserBuf { addr: s.host_data(), len, mem: MemType::Host });
        self.worker.start_staged_op(kind, Some(self.conn), params, stage, move |st, req, out| {
            st.engine.prepared.start(out, id, req, queue, round_buf)
        })
    }

    /// Mark partition `part` of a partitioned send ready: it goes as soon as the receiver is.
    pub fn pready(&self, part: usize) -> Result<()> {
        self.worker.check_aborted()?;
        self.worker.with_state(|st, out| st.engine.prepared.pready(out, self.id, part))
    }

    /// Whether partition `part` of a partitioned receive has arrived in the round in progress
    /// (progresses the worker first).
    pub fn parrived(&self, part: usize) -> Result<bool> {
        self.worker.progress();
        self.worker.with_state(|st, _| st.engine.prepared.parrived(self.id, part))
    }

    /// Rounds on the GPU: the device address of this side's `gsc_prepared_device_t`, which
    /// kernels pass to `gsc_pready` (a partitioned send) and `gsc_parrived` (a partitioned
    /// receive) from include/gsc_device.cuh. Waits for the peer to have prepared.
    pub fn device_handle(&self) -> Result<u64> {
        self.gpu_side()?.ok_or_else(not_on_gpu)?.device_handle(self)
    }

    /// Whether the pair's per-round signals go through a shared word page (`GSC_PREP_WORDS`)
    /// instead of a ready frame and a completion frame: `None` before pairing. A receive knows
    /// at pairing; a send once its receiver readied a round through the page.
    pub fn shared_words(&self) -> Result<Option<bool>> {
        self.worker.with_state(|st, _| Ok(st.engine.prepared.shared_words(self.id)))
    }

    /// Whether the pair's rounds run on the GPU (waits for the peer to have prepared, up to
    /// `GSC_TIMEOUT`, when this side offered them).
    pub fn runs_on_gpu(&self) -> Result<bool> {
        Ok(self.gpu_side()?.is_some())
    }

    /// This side's GPU rounds, if the pair runs on the GPU. The engine is fixed at pairing, so a
    /// side that offered GPU rounds waits for the peer's preparation (progressing the worker)
    /// the first time.
    pub(super) fn gpu_side(&self) -> Result<Option<&GpuSide>> {
        let Some(gpu) = &self.gpu else { return Ok(None) };
        if let Some(&on) = self.on_gpu.get() {
            return Ok(on.then_some(gpu));
        }
        let deadline = Instant::now() + gpu.timeout();
        let on = loop {
            if let Some(on) = self.worker.with_state(|st, _| st.engine.prepared.runs_on_gpu(self.id))? {
                break on;
            }
            if Instant::now() >= deadline {
                return Err(Error::new(Status::TimedOut, "the peer did not prepare its side of the transfer"));
            }
            if self.worker.progress() == 0 {
                std::thread::yield_now();
            }
        };
        Ok(self.on_gpu.get_or_init(|| on).then_some(gpu))
    }

    /// Rounds on the GPU: 0, or the round a kernel of this side gave up on because the peer
    /// did not answer within `GSC_TIMEOUT` (the pair is unusable after that).
    pub fn gpu_error(&self) -> Result<u64> {
        self.gpu_side()?.ok_or_else(not_on_gpu)?.error()
    }

    /// Release now: the peer is told, and every later call on this object is an
    /// `InvalidHandle` error. `Busy` (and nothing changes) while a round is in flight.
    pub fn release(&self) -> Result<()> {
        self.worker.with_state(|st, out| st.engine.prepared.release(out, self.id))?;
        self.released.store(true, Ordering::Release);
        Ok(())
    }
}

fn not_on_gpu() -> Error {
    Error::invalid_param("this prepared transfer does not run its rounds on the GPU (see GSC_ENGINE and PrepareParams::engine)")
}

/// Whether stream and graph rounds of a GPU buffer of `len` bytes may be staged: not for
/// partitioned transfers (their partitions go as they are readied, not all at the trigger).
fn stageable(len: usize, partitions: Option<usize>) -> bool {
    partitions.is_none() && len > 0
}

impl Drop for Prepared {
    fn drop(&mut self) {
        if self.released.load(Ordering::Acquire) {
            return;
        }
        let id = self.id;
        let result = self.worker.with_state(|st, out| match st.engine.prepared.release(out, id) {
            Err(e) if e.status() == Status::Busy => {
                st.engine.prepared.release_when_idle(id);
                Ok(())
            }
            other => other,
        });
        if let Err(e) = result {
            tracing::debug!(target: "gsc::core", id, error = %e, "releasing a dropped prepared transfer");
        }
    }
}
