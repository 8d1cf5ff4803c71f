//! The protocol registry and the one selection table.
//!
//! Like UCX's `proto.c`: a static list of protocols, each with a pure probe that says for which
//! message sizes it applies to a given (memory type, lane). Selection walks the list in order of
//! preference and takes the first protocol whose range holds the size. The same walk renders the
//! table `gsc-info -p` prints, so what is printed is what runs.

use crate::error::{Error, Result};
use crate::transport::LaneKind;
use std::fmt::Write;

/// Where a buffer lives.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum MemType {
    Host,
    Cuda,
}

impl MemType {
    pub fn name(self) -> &'static str {
        match self {
            MemType::Host => "host",
            MemType::Cuda => "cuda",
        }
    }
}

/// How the rendezvous data moves (the `GSC_RNDV_SCHEME` knob's type): the receiver reads the
/// sender's buffer (`Get`, needs remote memory access on the lane) or the sender pushes it in
/// frames once the receiver is ready (`Pipeline`).
pub use crate::config::RndvScheme;

/// The knobs protocol selection depends on (a slice of `Config`).
#[derive(Copy, Clone, Debug)]
pub struct ProtoConfig {
    pub eager_short_max: usize,
    pub rndv_thresh: usize,
    pub rndv_scheme: RndvScheme,
}

impl Default for ProtoConfig {
    fn default() -> Self {
        ProtoConfig { eager_short_max: 128, rndv_thresh: 64 * 1024, rndv_scheme: RndvScheme::Auto }
    }
}

/// What protocol selection needs to know about a link.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LaneProps {
    pub lane: LaneKind,
    pub max_frame: usize,
    /// The receiver can read the sender's host memory (CMA, one address space).
    pub remote_memory: bool,
    /// The peer's GPU memory can be opened here (CUDA IPC on one host, or one process).
    pub device_ipc: bool,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum ProtoId {
    /// Whole message in one frame; the sender's buffer is free as soon as the call returns.
    EagerShort,
    /// Copied through frames (fragmented at the lane's frame size), no handshake.
    EagerCopy,
    /// RTS, then the receiver reads the sender's buffer directly into its own (one copy), then ATS.
    /// For GPU memory the RTS carries a CUDA IPC key and the copy engine does the read.
    RndvGet,
    /// RTS, RTR from the ready receiver, then the sender pushes the data in frames.
    RndvPipeline,
}

struct Protocol {
    id: ProtoId,
    name: &'static str,
    /// Inclusive size range this protocol serves for (memory type, lane), or None.
    probe: fn(&ProtoConfig, MemType, &LaneProps) -> Option<(usize, usize)>,
}

/// Header bytes the eager frames carry in front of the data (see wire.rs).
const EAGER_ONLY_HEADER: usize = 16;

fn eager_short(cfg: &ProtoConfig, mem: MemType, lane: &LaneProps) -> Option<(usize, usize)> {
    if mem != MemType::Host {
        return None;
    }
    let max = cfg.eager_short_max.min(lane.max_frame.saturating_sub(EAGER_ONLY_HEADER));
    // Eager-short never exceeds the rendezvous threshold either.
    Some((0, max.min(cfg.rndv_thresh.saturating_sub(1))))
}

fn eager_copy(cfg: &ProtoConfig, mem: MemType, lane: &LaneProps) -> Option<(usize, usize)> {
    let (_, short_max) = eager_short(cfg, mem, lane)?;
    let lo = short_max + 1;
    let hi = cfg.rndv_thresh.checked_sub(1)?;
    (lo <= hi).then_some((lo, hi))
}

fn rndv_get(cfg: &ProtoConfig, mem: MemType, lane: &LaneProps) -> Option<(usize, usize)> {
    // Under Auto the sender offers its buffer for reading wherever the lane can read remote
    // memory, and the receiver decides: on loopback a read is one memcpy; on shm it reads or
    // asks for a push, whichever it has measured faster (`rndv_tuner`: neither wins everywhere).
    let wanted = match cfg.rndv_scheme {
        RndvScheme::Get | RndvScheme::Auto => true,
        RndvScheme::Pipeline => false,
    };
    match mem {
        MemType::Host => (lane.remote_memory && wanted).then_some((cfg.rndv_thresh, usize::MAX)),
        // GPU memory: a copy-engine read through CUDA IPC at every size. Eager would stage the
        // bytes through host memory on both sides (two blocking copies); the read is one
        // asynchronous copy, and an 8-byte RTS/ATS round trip costs less than either staging.
        MemType::Cuda => lane.device_ipc.then_some((0, usize::MAX)),
    }
}

fn rndv_pipeline(cfg: &ProtoConfig, mem: MemType, _lane: &LaneProps) -> Option<(usize, usize)> {
    // Always possible: it only needs frames. It is listed after rndv_get, so it is chosen when
    // Get is excluded or the lane cannot read remote memory. GPU memory with no IPC goes this way
    // at every size, staged through host memory frame by frame.
    match mem {
        MemType::Host => Some((cfg.rndv_thresh, usize::MAX)),
        MemType::Cuda => Some((0, usize::MAX)),
    }
}

/// In order of preference.
static REGISTRY: &[Protocol] = &[
    Protocol { id: ProtoId::EagerShort, name: "eager_short", probe: eager_short },
    Protocol { id: ProtoId::EagerCopy, name: "eager_copy", probe: eager_copy },
    Protocol { id: ProtoId::RndvGet, name: "rndv_get", probe: rndv_get },
    Protocol { id: ProtoId::RndvPipeline, name: "rndv_pipeline", probe: rndv_pipeline },
];

impl ProtoId {
    pub fn name(self) -> &'static str {
        REGISTRY.iter().find(|p| p.id == self).map(|p| p.name).unwrap_or("?")
    }
}

/// The protocol for a tagged send of `size` bytes.
pub fn select(cfg: &ProtoConfig, mem: MemType, lane: &LaneProps, size: usize) -> Result<ProtoId> {
    for p in REGISTRY {
        if let Some((lo, hi)) = (p.probe)(cfg, mem, lane)
            && (lo..=hi).contains(&size)
        {
            return Ok(p.id);
        }
    }
    Err(Error::unsupported(format!("no protocol sends {size} bytes of {} memory over the {} lane", mem.name(), lane.lane.name())))
}

/// The largest host-memory send that `select` makes eager-short on `lane`: every size from 0
/// up to it is, none above. `None` when no size is. Lets the send fast path decide with one
/// comparison per message while the table stays the one place that decides.
pub fn eager_short_limit(cfg: &ProtoConfig, lane: &LaneProps) -> Option<usize> {
    // Eager-short is first in the registry and starts at 0, so its probe range is exactly where
    // `select` picks it.
    matches!(select(cfg, MemType::Host, lane, 0), Ok(ProtoId::EagerShort))
        .then(|| eager_short(cfg, MemType::Host, lane))
        .flatten()
        .map(|r| r.1)
}

/// The selection table as text, one block per (lane, memory type), for `gsc-info -p`.
pub fn describe(cfg: &ProtoConfig, lanes: &[LaneProps]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# tag send protocols (GSC_EAGER_SHORT_MAX={}, GSC_RNDV_THRESH={}, GSC_RNDV_SCHEME={:?})",
        cfg.eager_short_max, cfg.rndv_thresh, cfg.rndv_scheme
    );
    for lane in lanes {
        for mem in [MemType::Host, MemType::Cuda] {
            let yes_no = |b: bool| if b { "yes" } else { "no" };
            let access = match mem {
                MemType::Host => format!("remote memory {}", yes_no(lane.remote_memory)),
                MemType::Cuda => format!("cuda ipc {}", yes_no(lane.device_ipc)),
            };
            let _ = writeln!(out, "[{} lane, {} memory, frame {} B, {access}]", lane.lane.name(), mem.name(), lane.max_frame);
            let mut covered_to: Option<usize> = None;
            let mut any = false;
            for p in REGISTRY {
                let Some((lo, hi)) = (p.probe)(cfg, mem, lane) else { continue };
                // A range already served by an earlier protocol is not reachable.
                let lo = match covered_to {
                    Some(c) if c >= hi => continue,
                    Some(c) => lo.max(c + 1),
                    None => lo,
                };
                let hi_text = if hi == usize::MAX { "inf".to_string() } else { hi.to_string() };
                let note = if p.id == ProtoId::RndvGet
                    && mem == MemType::Host
                    && cfg.rndv_scheme == RndvScheme::Auto
                    && lane.lane == LaneKind::Shm
                {
                    " (or rndv_pipeline: the receiver measures both and takes the faster)"
                } else {
                    ""
                };
                let _ = writeln!(out, "  {lo:>10} .. {hi_text:<10} {}{note}", p.name);
                covered_to = Some(hi);
                any = true;
            }
            if !any {
                let _ = writeln!(out, "  (no protocol yet)");
            }
        }
    }
    out
}

/// Who runs a prepared transfer's rounds (`GSC_ENGINE`, and what a preparation asks for).
pub use crate::config::Engine;

/// What one side of a prepared transfer announces when it prepares. The pair's rounds run on
/// the GPU when both sides offer it; a side that required it (its kernels drive the rounds
/// through the device handle) fails the pair otherwise.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum EngineOffer {
    /// Only the proxy can run this side's rounds.
    Proxy,
    /// This side can run its rounds on the GPU; the proxy if the peer cannot.
    Gpu,
    /// This side's rounds must run on the GPU.
    GpuRequired,
}

impl EngineOffer {
    pub fn offers_gpu(self) -> bool {
        self != EngineOffer::Proxy
    }
}

/// What the engine of one side of a prepared transfer depends on.
#[derive(Copy, Clone, Debug)]
pub struct EngineQuery {
    pub mem: MemType,
    pub lane: LaneKind,
    /// CUDA IPC may be used (`GSC_CUDA_IPC` is not off).
    pub device_ipc: bool,
    /// Every GPU of this process can access every other one directly (NVLink or PCIe P2P), so
    /// whichever GPU the peer uses, kernels here can write its memory.
    pub p2p: bool,
    pub partitioned: bool,
    pub len: usize,
}

/// Why the rounds of this side cannot run on the GPU (`None`: they can).
fn gpu_rounds_impossible(q: &EngineQuery) -> Option<&'static str> {
    if q.mem != MemType::Cuda {
        Some(NOT_GPU_MEMORY)
    } else if q.lane != LaneKind::Shm {
        Some("rounds on the GPU run between processes (the shm lane with CUDA IPC)")
    } else if !q.device_ipc {
        Some("rounds on the GPU need CUDA IPC (GSC_CUDA_IPC is off)")
    } else if !q.p2p {
        Some("rounds on the GPU need peer access between the GPUs (NVLink or PCIe P2P)")
    } else {
        None
    }
}

const NOT_GPU_MEMORY: &str = "rounds on the GPU need a GPU buffer";

/// The engine one side offers for its rounds: `policy` is `GSC_ENGINE`, `gpu_max` is
/// `GSC_ENGINE_GPU_MAX`, `asked` what the preparation asked for (`Auto`: the table and the
/// policy decide; `Gpu`: required, an error where impossible; `Proxy`: the proxy).
///
/// The table: GPU rounds where the pair can run them — GPU buffers, processes on one host with
/// CUDA IPC, peer access between the GPUs — because a round then costs one kernel per side and
/// no proxy pass (docs/PERF.md); under `auto` only up to `gpu_max` bytes, above which the copy
/// engine the proxy drives moves data faster than the round kernel's blocks. (What the buffer's
/// allocation allows is checked where it is known: `core::gpu_rounds::GpuSide::new`.) Partitioned
/// transfers run on the GPU only when asked: their partitions are then sent by the user's
/// kernels (`gsc_pready`), which a program written for host `pready` calls does not do.
pub fn prepared_engine(policy: Engine, gpu_max: usize, asked: Engine, q: &EngineQuery) -> Result<EngineOffer> {
    // What a preparation asked for is what it gets: a transfer asking for GPU rounds has
    // kernels that drive them through its device handle, and would break on the proxy. The
    // policy decides the rest.
    if asked == Engine::Proxy {
        return Ok(EngineOffer::Proxy);
    }
    let impossible = gpu_rounds_impossible(q);
    if asked == Engine::Gpu {
        return match impossible {
            None => Ok(EngineOffer::GpuRequired),
            // A host buffer is the caller's mistake; the rest is what this machine lacks.
            Some(why) if why == NOT_GPU_MEMORY => Err(Error::invalid_param(why)),
            Some(why) => Err(Error::unsupported(why)),
        };
    }
    let too_large = policy == Engine::Auto && q.len > gpu_max;
    Ok(if policy == Engine::Proxy || impossible.is_some() || q.partitioned || too_large { EngineOffer::Proxy } else { EngineOffer::Gpu })
}

/// The engine table as text, for `gsc-info -p`: for each lane with CUDA memory, which sizes of
/// a prepared transfer run on the GPU. `p2p`: whether the GPUs here reach each other (`None`:
/// unknown, no CUDA driver).
pub fn describe_engine(policy: Engine, gpu_max: usize, device_ipc: bool, p2p: Option<bool>, lanes: &[LaneKind]) -> String {
    let mut out = String::new();
    let p2p_text = match p2p {
        Some(true) => "yes",
        Some(false) => "no",
        None => "unknown (no CUDA driver; taken as yes)",
    };
    let _ = writeln!(
        out,
        "# prepared transfers' engine (GSC_ENGINE={}, GSC_ENGINE_GPU_MAX={}; peer access between GPUs: {p2p_text})",
        policy.name(),
        crate::config::format_size(gpu_max as u64)
    );
    for &lane in lanes {
        let q = EngineQuery { mem: MemType::Cuda, lane, device_ipc, p2p: p2p.unwrap_or(true), partitioned: false, len: 0 };
        let _ = write!(out, "[{} lane, cuda memory] ", lane.name());
        let line = match (gpu_rounds_impossible(&q), policy) {
            (_, Engine::Proxy) => "proxy at every size".to_string(),
            (Some(why), _) => format!("proxy at every size ({why})"),
            (None, Engine::Gpu) => "gpu at every size".to_string(),
            (None, Engine::Auto) if gpu_max == usize::MAX => "gpu at every size".to_string(),
            (None, Engine::Auto) => format!("gpu 0 .. {gpu_max}, proxy above"),
        };
        let _ = writeln!(out, "{line}; partitioned: gpu only when asked");
    }
    let _ = writeln!(out, "[every lane, host memory] proxy");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shm(remote: bool) -> LaneProps {
        LaneProps { lane: LaneKind::Shm, max_frame: 65536, remote_memory: remote, device_ipc: true }
    }

    #[test]
    fn boundaries_follow_the_thresholds() {
        let cfg = ProtoConfig { eager_short_max: 128, rndv_thresh: 16384, rndv_scheme: RndvScheme::Auto };
        let l = shm(true);
        let lb = LaneProps { lane: LaneKind::Loopback, max_frame: 65536, remote_memory: true, device_ipc: true };
        assert_eq!(select(&cfg, MemType::Host, &l, 0).unwrap(), ProtoId::EagerShort);
        assert_eq!(select(&cfg, MemType::Host, &l, 128).unwrap(), ProtoId::EagerShort);
        assert_eq!(select(&cfg, MemType::Host, &l, 129).unwrap(), ProtoId::EagerCopy);
        assert_eq!(select(&cfg, MemType::Host, &l, 16383).unwrap(), ProtoId::EagerCopy);
        // Auto: the read is offered wherever the lane can read remote memory (the receiver
        // may still ask for a push, see rndv_tuner).
        assert_eq!(select(&cfg, MemType::Host, &l, 16384).unwrap(), ProtoId::RndvGet);
        assert_eq!(select(&cfg, MemType::Host, &shm(false), 16384).unwrap(), ProtoId::RndvPipeline);
        assert_eq!(select(&cfg, MemType::Host, &lb, 16384).unwrap(), ProtoId::RndvGet);
        assert_eq!(select(&cfg, MemType::Host, &lb, 64 << 20).unwrap(), ProtoId::RndvGet);
        let get = ProtoConfig { rndv_scheme: RndvScheme::Get, ..cfg };
        assert_eq!(select(&get, MemType::Host, &l, 16384).unwrap(), ProtoId::RndvGet);
        assert_eq!(select(&get, MemType::Host, &shm(false), 16384).unwrap(), ProtoId::RndvPipeline, "get needs remote memory");
    }

    /// The send fast path's one comparison must say what the table says, at the edges too.
    #[test]
    fn eager_short_limit_is_where_select_stops_choosing_eager_short() {
        let lanes = [
            shm(true),
            LaneProps { lane: LaneKind::Shm, max_frame: 256, remote_memory: true, device_ipc: false },
            LaneProps { lane: LaneKind::Loopback, max_frame: 65536, remote_memory: true, device_ipc: true },
            LaneProps { lane: LaneKind::Shm, max_frame: 8, remote_memory: false, device_ipc: false },
        ];
        for (short, thresh) in [(128, 16384), (4096, 1000), (0, 1), (1 << 20, 1 << 20), (64, 0)] {
            let cfg = ProtoConfig { eager_short_max: short, rndv_thresh: thresh, rndv_scheme: RndvScheme::Auto };
            for lane in &lanes {
                let is_short = |n| matches!(select(&cfg, MemType::Host, lane, n), Ok(ProtoId::EagerShort));
                match eager_short_limit(&cfg, lane) {
                    Some(max) => {
                        assert!(is_short(0) && is_short(max), "{cfg:?} {lane:?}: up to {max}");
                        assert!(!is_short(max + 1), "{cfg:?} {lane:?}: not above {max}");
                    }
                    None => assert!(!is_short(0), "{cfg:?} {lane:?}: no size is eager-short"),
                }
            }
        }
    }

    #[test]
    fn scheme_knob_and_small_frames_are_respected() {
        let cfg = ProtoConfig { eager_short_max: 4096, rndv_thresh: 1000, rndv_scheme: RndvScheme::Pipeline };
        let small = LaneProps { lane: LaneKind::Shm, max_frame: 256, remote_memory: true, device_ipc: false };
        // eager_short is capped by the frame and by the rendezvous threshold.
        assert_eq!(select(&cfg, MemType::Host, &small, 240).unwrap(), ProtoId::EagerShort);
        assert_eq!(select(&cfg, MemType::Host, &small, 241).unwrap(), ProtoId::EagerCopy);
        assert_eq!(select(&cfg, MemType::Host, &small, 1000).unwrap(), ProtoId::RndvPipeline);
    }

    #[test]
    fn device_memory_is_read_through_ipc_or_pushed_staged() {
        let cfg = ProtoConfig::default();
        for n in [0, 8, 1 << 20, 1 << 30] {
            assert_eq!(select(&cfg, MemType::Cuda, &shm(true), n).unwrap(), ProtoId::RndvGet);
        }
        let no_ipc = LaneProps { device_ipc: false, ..shm(true) };
        for n in [0, 8, 1 << 20] {
            assert_eq!(select(&cfg, MemType::Cuda, &no_ipc, n).unwrap(), ProtoId::RndvPipeline);
        }
        // The pipeline scheme knob is about host memory; GPU memory still prefers IPC.
        let pipe = ProtoConfig { rndv_scheme: RndvScheme::Pipeline, ..cfg };
        assert_eq!(select(&pipe, MemType::Cuda, &shm(true), 8).unwrap(), ProtoId::RndvGet);
    }

    #[test]
    fn table_shows_each_reachable_range_once() {
        let lb = LaneProps { lane: LaneKind::Loopback, max_frame: 65536, remote_memory: true, device_ipc: true };
        let t = describe(&ProtoConfig::default(), &[lb]);
        assert!(t.contains("eager_short"));
        assert!(t.contains("rndv_get"));
        assert_eq!(t.matches("rndv_pipeline").count(), 0, "pipeline is unreachable when get covers the range:\n{t}");
        assert_eq!(t.matches("rndv_get").count(), 2, "host and cuda blocks:\n{t}");
    }

    #[test]
    fn prepared_engine_table_picks_the_gpu_only_where_the_pair_can_run_it() {
        let gpu_ok = EngineQuery { mem: MemType::Cuda, lane: LaneKind::Shm, device_ipc: true, p2p: true, partitioned: false, len: 8 };
        let max = 1 << 20;
        let pick = |policy, asked, q: &EngineQuery| prepared_engine(policy, max, asked, q);
        assert_eq!(pick(Engine::Auto, Engine::Auto, &gpu_ok).unwrap(), EngineOffer::Gpu);
        assert_eq!(pick(Engine::Auto, Engine::Auto, &EngineQuery { len: max, ..gpu_ok }).unwrap(), EngineOffer::Gpu);
        assert_eq!(pick(Engine::Auto, Engine::Auto, &EngineQuery { len: max + 1, ..gpu_ok }).unwrap(), EngineOffer::Proxy);
        // `gpu` ignores the size limit; `proxy` keeps every transfer that did not ask on the
        // proxy; what a transfer asked for it gets, whatever the policy.
        assert_eq!(pick(Engine::Gpu, Engine::Auto, &EngineQuery { len: max + 1, ..gpu_ok }).unwrap(), EngineOffer::Gpu);
        assert_eq!(pick(Engine::Proxy, Engine::Auto, &gpu_ok).unwrap(), EngineOffer::Proxy);
        assert_eq!(pick(Engine::Proxy, Engine::Gpu, &gpu_ok).unwrap(), EngineOffer::GpuRequired);
        assert_eq!(pick(Engine::Gpu, Engine::Proxy, &gpu_ok).unwrap(), EngineOffer::Proxy);
        // Asked for: required, at any size, partitioned too.
        let big_parts = EngineQuery { len: max + 1, partitioned: true, ..gpu_ok };
        assert_eq!(pick(Engine::Auto, Engine::Gpu, &big_parts).unwrap(), EngineOffer::GpuRequired);
        // Partitioned: only when asked.
        assert_eq!(pick(Engine::Gpu, Engine::Auto, &EngineQuery { partitioned: true, ..gpu_ok }).unwrap(), EngineOffer::Proxy);
        // Where the GPU cannot run the rounds: the proxy, or an error naming why when asked.
        let impossible = [
            (EngineQuery { mem: MemType::Host, ..gpu_ok }, "GPU buffer"),
            (EngineQuery { lane: LaneKind::Loopback, ..gpu_ok }, "between processes"),
            (EngineQuery { device_ipc: false, ..gpu_ok }, "GSC_CUDA_IPC"),
            (EngineQuery { p2p: false, ..gpu_ok }, "peer access"),
        ];
        for (q, why) in impossible {
            assert_eq!(pick(Engine::Gpu, Engine::Auto, &q).unwrap(), EngineOffer::Proxy, "{q:?}");
            let e = pick(Engine::Auto, Engine::Gpu, &q).unwrap_err();
            assert!(e.to_string().contains(why), "{q:?}: {e}");
        }
    }

    #[test]
    fn engine_table_text_follows_the_knobs() {
        let lanes = [LaneKind::Loopback, LaneKind::Shm];
        let t = describe_engine(Engine::Auto, 64 << 20, true, Some(true), &lanes);
        assert!(t.contains("GSC_ENGINE=auto, GSC_ENGINE_GPU_MAX=64M"), "{t}");
        assert!(t.contains("[shm lane, cuda memory] gpu 0 .. 67108864, proxy above"), "{t}");
        assert!(t.contains("[loopback lane, cuda memory] proxy at every size (rounds on the GPU run between processes"), "{t}");
        let t = describe_engine(Engine::Gpu, 64 << 20, true, Some(false), &lanes);
        assert!(t.contains("[shm lane, cuda memory] proxy at every size (rounds on the GPU need peer access"), "{t}");
        let t = describe_engine(Engine::Proxy, 64 << 20, true, None, &lanes);
        assert!(t.contains("unknown") && t.contains("[shm lane, cuda memory] proxy at every size;"), "{t}");
    }
}
