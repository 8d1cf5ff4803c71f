//! Run-time configuration: one registry of `GSC_*` knobs.
//!
//! Every knob is one row of a static table (`Config::knobs()`): its variable name, its default
//! as text, its syntax and a one-line description. The same table parses the environment,
//! answers `get`/`set`/`dump`, and prints `gsc-info -c`, so a knob cannot be documented in one
//! place and parsed differently in another.
//!
//! Parsing is strict: a value that does not parse, or that breaks a rule involving several
//! knobs, is an error with `Status::InvalidConfig` naming the variable, the value and what was
//! expected. Running with a silently ignored typo in a tuning variable is worse than failing at
//! startup. Unknown `GSC_*` variables are not errors (they may belong to a newer or older
//! version) but are reported, with a "did you mean" suggestion.
//!
//! | syntax    | accepted                                                                  |
//! |-----------|---------------------------------------------------------------------------|
//! | size      | `4096`, `64K`, `64k`, `64KB`, `64KiB`, `4M`, `1G` (binary units); no `inf` |
//! | duration  | `10s`, `100ms`, `250us`, `5ns`, `2m`, `1h`, `1.5s`; bare number: seconds  |
//! | tristate  | `auto`, `on`/`yes`/`y`/`true`/`1`, `off`/`no`/`n`/`false`/`0`             |
//! | boolean   | as tristate without `auto`; empty: off                                    |
//! | selection | `all`, `a,b` (only those), `^a,b` (all but those)                         |
//! | enums     | case-insensitive names                                                    |

mod knobs;
mod parse;
#[cfg(test)]
mod tests;

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use self::knobs::KNOBS;
pub use self::knobs::{Knob, KnobKind};
pub(crate) use self::parse::format_size;
use crate::error::{Error, Result, Status};
use crate::transport::LaneKind;

/// The largest GPU message `GSC_CUDA_STAGE_MAX` can stage (the largest staging slot).
pub const CUDA_STAGE_LIMIT: usize = 64 << 10;

/// Severity threshold of log messages (`GSC_LOG_LEVEL`), least verbose first.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

impl LogLevel {
    pub const ALL: &'static [LogLevel] = &[LogLevel::Error, LogLevel::Warn, LogLevel::Info, LogLevel::Debug, LogLevel::Trace];

    pub fn name(self) -> &'static str {
        match self {
            LogLevel::Error => "error",
            LogLevel::Warn => "warn",
            LogLevel::Info => "info",
            LogLevel::Debug => "debug",
            LogLevel::Trace => "trace",
        }
    }

    fn parse(text: &str) -> Result<LogLevel, String> {
        let text = text.trim();
        if text.eq_ignore_ascii_case("warning") {
            return Ok(LogLevel::Warn);
        }
        LogLevel::ALL
            .iter()
            .copied()
            .find(|l| l.name().eq_ignore_ascii_case(text))
            .ok_or_else(|| "expected one of error, warn, info, debug, trace".to_string())
    }
}

/// A logging subsystem (`GSC_LOG_SUBSYS`); each maps to one `tracing` target (see `crate::log`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Subsys {
    Core,
    Proto,
    Shm,
    Loopback,
    Bootstrap,
    Config,
    Capi,
    Bench,
    Proxy,
    Cuda,
    /// GPU-initiated execution (src/gda): the verbs engine, its flush and RDMA discovery.
    Gda,
    /// The UCX lane (src/transport/ucx).
    Ucx,
    /// Communicators and collectives (src/collectives).
    Coll,
}

impl Subsys {
    pub const ALL: &'static [Subsys] = &[
        Subsys::Core,
        Subsys::Proto,
        Subsys::Shm,
        Subsys::Loopback,
        Subsys::Bootstrap,
        Subsys::Config,
        Subsys::Capi,
        Subsys::Bench,
        Subsys::Proxy,
        Subsys::Cuda,
        Subsys::Gda,
        Subsys::Ucx,
        Subsys::Coll,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Subsys::Core => "core",
            Subsys::Proto => "proto",
            Subsys::Shm => "shm",
            Subsys::Loopback => "loopback",
            Subsys::Bootstrap => "bootstrap",
            Subsys::Config => "config",
            Subsys::Capi => "capi",
            Subsys::Bench => "bench",
            Subsys::Proxy => "proxy",
            Subsys::Cuda => "cuda",
            Subsys::Gda => "gda",
            Subsys::Ucx => "ucx",
            Subsys::Coll => "coll",
        }
    }

    /// The `tracing` target events of this subsystem are logged under.
    pub fn target(self) -> &'static str {
        use crate::log;
        match self {
            Subsys::Core => log::CORE,
            Subsys::Proto => log::PROTO,
            Subsys::Shm => log::SHM,
            Subsys::Loopback => log::LOOPBACK,
            Subsys::Bootstrap => log::BOOTSTRAP,
            Subsys::Config => log::CONFIG,
            Subsys::Capi => log::CAPI,
            Subsys::Bench => log::BENCH,
            Subsys::Proxy => log::PROXY,
            Subsys::Cuda => log::CUDA,
            Subsys::Gda => log::GDA,
            Subsys::Ucx => log::UCX,
            Subsys::Coll => log::COLL,
        }
    }
}

/// How rendezvous moves the payload (`GSC_RNDV_SCHEME`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum RndvScheme {
    /// The faster scheme per lane, as measured (docs/PERF.md): `Get` on loopback (one copy in
    /// one address space), `Pipeline` on shm (frame copies through the rings beat
    /// cross-memory attach at every size on our machines), `Pipeline` where remote memory is
    /// not accessible.
    Auto,
    /// The receiver reads the sender's buffer directly (zero copy).
    Get,
    /// The payload goes through frames in `rndv_frag_size` fragments.
    Pipeline,
}

impl RndvScheme {
    pub const ALL: &'static [RndvScheme] = &[RndvScheme::Auto, RndvScheme::Get, RndvScheme::Pipeline];

    pub fn name(self) -> &'static str {
        match self {
            RndvScheme::Auto => "auto",
            RndvScheme::Get => "get",
            RndvScheme::Pipeline => "pipeline",
        }
    }

    fn parse(text: &str) -> Result<RndvScheme, String> {
        let text = text.trim();
        RndvScheme::ALL
            .iter()
            .copied()
            .find(|s| s.name().eq_ignore_ascii_case(text))
            .ok_or_else(|| "expected one of auto, get, pipeline".to_string())
    }
}

/// Who runs the rounds of prepared transfers (`GSC_ENGINE`): the selection table decides per
/// transfer (`crate::protocols::select::prepared_engine`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Engine {
    /// The GPU where the pair can run its rounds there (GPU buffers, peers reachable over
    /// NVLink/PCIe P2P through CUDA IPC) up to `GSC_ENGINE_GPU_MAX` bytes, the proxy elsewhere.
    Auto,
    /// The GPU wherever the pair can, at every size; the proxy elsewhere.
    Gpu,
    /// The proxy thread (transfers that asked for GPU rounds still get them: their kernels
    /// drive the rounds through the device handle).
    Proxy,
}

impl Engine {
    pub const ALL: &'static [Engine] = &[Engine::Auto, Engine::Gpu, Engine::Proxy];

    pub fn name(self) -> &'static str {
        match self {
            Engine::Auto => "auto",
            Engine::Gpu => "gpu",
            Engine::Proxy => "proxy",
        }
    }

    fn parse(text: &str) -> Result<Engine, String> {
        let text = text.trim();
        Engine::ALL
            .iter()
            .copied()
            .find(|e| e.name().eq_ignore_ascii_case(text))
            .ok_or_else(|| "expected one of auto, gpu, proxy".to_string())
    }
}

/// The large collectives' kernel (`GSC_COLL_LARGE_ALGO`; `collectives::select`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum LargeAlgo {
    /// Every block runs a round's phases one after the other (push, flags, reduce and push,
    /// flags, copy out), two parities of the workspace's areas.
    Phased,
    /// Each block's warps split into roles (push, reduce, copy out) that work on different
    /// rounds at once, `GSC_COLL_LARGE_STAGES` stages of the areas.
    Pipelined,
}

impl LargeAlgo {
    pub const ALL: &'static [LargeAlgo] = &[LargeAlgo::Phased, LargeAlgo::Pipelined];

    pub fn name(self) -> &'static str {
        match self {
            LargeAlgo::Phased => "phased",
            LargeAlgo::Pipelined => "pipelined",
        }
    }

    fn parse(text: &str) -> Result<LargeAlgo, String> {
        let text = text.trim();
        LargeAlgo::ALL
            .iter()
            .copied()
            .find(|e| e.name().eq_ignore_ascii_case(text))
            .ok_or_else(|| "expected one of phased, pipelined".to_string())
    }
}

/// A feature switch that can also be left to detection (`GSC_CMA`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Tristate {
    /// Use the feature when it is available, silently do without otherwise.
    Auto,
    /// Require the feature: its absence is an error.
    On,
    Off,
}

impl Tristate {
    pub fn name(self) -> &'static str {
        match self {
            Tristate::Auto => "auto",
            Tristate::On => "on",
            Tristate::Off => "off",
        }
    }

    fn from_option(v: Option<bool>) -> Tristate {
        match v {
            None => Tristate::Auto,
            Some(true) => Tristate::On,
            Some(false) => Tristate::Off,
        }
    }
}

/// Every knob, typed. Build it with `Config::from_env()` (or `Default` plus `set`); fields are
/// public for reading, and code that changes them directly should call `validate()` after.
#[derive(Clone, PartialEq, Eq)]
pub struct Config {
    /// `GSC_LOG_LEVEL`
    pub log_level: LogLevel,
    /// `GSC_LOG_SUBSYS`: enabled subsystems, in `Subsys::ALL` order, never empty.
    pub log_subsys: Vec<Subsys>,
    /// `GSC_LOG_FILE`: a pattern; `%h`/`%p` are expanded by `crate::log` when it opens the file.
    pub log_file: Option<String>,
    /// `GSC_TIMELINE`: a file pattern like `log_file`; `None`: no timeline is recorded.
    pub timeline: Option<String>,
    /// `GSC_TLS`: enabled lanes, in `LaneKind::ALL` order, never empty.
    pub tls: Vec<LaneKind>,
    /// `GSC_EAGER_SHORT_MAX`, bytes.
    pub eager_short_max: usize,
    /// `GSC_RNDV_THRESH`, bytes; always greater than `eager_short_max`.
    pub rndv_thresh: usize,
    /// `GSC_RNDV_SCHEME`
    pub rndv_scheme: RndvScheme,
    /// `GSC_RNDV_FRAG_SIZE`, bytes, non-zero.
    pub rndv_frag_size: usize,
    /// `GSC_SHM_DIR`, absolute.
    pub shm_dir: PathBuf,
    /// `GSC_SHM_RING_SIZE`, bytes: a power of two, at least 64K.
    pub shm_ring_size: usize,
    /// `GSC_SHM_MAX_FRAME`, bytes: non-zero, at most `shm_ring_size / 4`.
    pub shm_max_frame: usize,
    /// `GSC_UCX_MAX_FRAME`, bytes: 4K..=64M.
    pub ucx_max_frame: usize,
    /// `GSC_UCX_RNDV_MIN`, bytes; `usize::MAX` (`off`): every frame is sent eagerly.
    pub ucx_rndv_min: usize,
    /// `GSC_CMA`
    pub cma: Tristate,
    /// `GSC_CUDA_IPC`
    pub cuda_ipc: Tristate,
    /// `GSC_CUDA_PDL`
    pub cuda_pdl: Tristate,
    /// `GSC_CUDA_WAIT_KERNEL`
    pub cuda_wait_kernel: Tristate,
    /// `GSC_PREP_WORDS`: prepared rounds signalled through a shared word page.
    pub prep_words: Tristate,
    /// `GSC_ENGINE`
    pub engine: Engine,
    /// `GSC_ENGINE_GPU_MAX`, bytes: the largest prepared transfer `Engine::Auto` runs on the GPU.
    pub engine_gpu_max: usize,
    /// `GSC_COLL_LARGE_MIN`, bytes: all-reduces from this size take the large algorithm.
    pub coll_large_min: usize,
    /// `GSC_COLL_LARGE_ROUND`, bytes per rank per round of the large collectives.
    pub coll_large_round: usize,
    /// `GSC_COLL_LARGE_ALGO`: the large collectives' kernel, per communicator.
    pub coll_large_algo: LargeAlgo,
    /// `GSC_COLL_LARGE_BLOCKS`, 1..=1024: blocks (channels) of the large kernels.
    pub coll_large_blocks: usize,
    /// `GSC_COLL_LARGE_THREADS`, 64..=1024 in whole warps; `None` (`auto`): the algorithm's own.
    pub coll_large_threads: Option<usize>,
    /// `GSC_COLL_LARGE_STAGES`, 2..=8: rounds the pipelined kernel has in flight.
    pub coll_large_stages: usize,
    /// `GSC_COLL_LARGE_WARPS`: the pipelined kernel's shares of warps (push, reduce, copy);
    /// `None` (`auto`): a split per collective (`collectives::large`).
    pub coll_large_warps: Option<[u32; 3]>,
    /// `GSC_COLL_CHECK`: ranks compare each collective call over the bootstrap first.
    pub coll_check: bool,
    /// `GSC_COLL_CE`: large collectives by copy engines pulling from the peers' buffers
    /// (`collectives::copy_engine`): `Auto` under stream capture, `On` for every call too.
    pub coll_ce: Tristate,
    /// `GSC_COLL_CE_MIN`, bytes per rank's part: the smallest call the copy engines take.
    pub coll_ce_min: usize,
    /// `GSC_COLL_SM`: large collectives by one SM kernel on the peers' own buffers
    /// (`collectives::direct`): `On` only; `Auto` waits for a device measurement.
    pub coll_sm: Tristate,
    /// `GSC_COLL_SM_MIN`, bytes per rank's part: the smallest call the direct kernel takes.
    pub coll_sm_min: usize,
    /// `GSC_COLL_SM_BLOCKS`: the direct kernel's blocks; `None` (`auto`): two per SM.
    pub coll_sm_blocks: Option<usize>,
    /// `GSC_COLL_RING`: reduce-scatter and all-reduce by a copy-engine ring, the SMs reducing
    /// (`collectives::ce_ring`).
    pub coll_ring: Tristate,
    /// `GSC_COLL_RING_MIN`, bytes per rank's part: the smallest call the ring takes.
    pub coll_ring_min: usize,
    /// `GSC_COLL_RING_PIECES`: pieces each ring step is cut into, 1..=16.
    pub coll_ring_pieces: usize,
    /// `GSC_COLL_TRIGGER_MAX`, bytes: the largest kernel-triggered all-reduce the triggering
    /// thread runs itself (`collectives::triggered`); 0: none.
    pub coll_trigger_max: usize,
    /// `GSC_COLL_P2P_MAX`, bytes: the largest send/recv of a group the send/recv kernel moves
    /// (`collectives::p2p_kernel`); 0: none.
    pub coll_p2p_max: usize,
    /// `GSC_COLL_P2P_BLOCKS`: blocks per send or receive of that kernel, 1..=64.
    /// `GSC_COLL_P2P_HEAD`: bytes at the start of an engine-sized send/recv that the kernel
    /// moves while the engine starts on the rest.
    pub coll_p2p_head: usize,
    pub coll_p2p_blocks: usize,
    /// `GSC_FAKE_HOST`: a label mixed into this process's host identity (testing: makes
    /// processes of one machine count as different hosts). `None`: the real host only.
    pub fake_host: Option<String>,
    /// `GSC_CUDA_COPY_STREAMS`, 1..=16.
    pub cuda_copy_streams: usize,
    /// `GSC_CUDA_COPY_SPLIT`, bytes, non-zero.
    pub cuda_copy_split: usize,
    /// `GSC_CUDA_PIPELINE_CHUNK`, bytes: 64K..=256M.
    pub cuda_pipeline_chunk: usize,
    /// `GSC_CUDA_PIPELINE_DEPTH`, 1..=64.
    pub cuda_pipeline_depth: usize,
    /// `GSC_CUDA_STAGE_MAX`, bytes, at most `CUDA_STAGE_LIMIT`; 0 turns staging off.
    pub cuda_stage_max: usize,
    /// `GSC_FLUSH_RDMA_WRITE`: the GPUDirect RDMA flush writes into GPU memory before it reads
    /// (see `crate::gda::verbs::FlushConfig::from_config`).
    pub flush_rdma_write: bool,
    /// `GSC_TIMEOUT`: bound on every blocking wait; `None` waits forever.
    pub timeout: Option<Duration>,
    /// `GSC_PEER_CHECK_INTERVAL`, non-zero.
    pub peer_check_interval: Duration,
    /// `GSC_HEARTBEAT_TIMEOUT`: how long a shm peer that promised a heartbeat may stay silent
    /// before its link fails; `None` neither promises nor judges heartbeats.
    pub heartbeat_timeout: Option<Duration>,
    /// `GSC_CONNECT_TIMEOUT`, non-zero.
    pub connect_timeout: Duration,
    /// `GSC_PROXY_SPIN`: how long the proxy keeps spinning on persistent triggers after the last
    /// activity before it falls back to polling every `proxy_poll`.
    pub proxy_spin: Duration,
    /// `GSC_PROXY_POLL`: the idle proxy's polling period for persistent triggers.
    pub proxy_poll: Duration,
    /// `GSC_PROXY_THREAD`: conditioned operations are watched by a proxy thread (true) or by the
    /// application's own calls to progress (false), as an MPI library that drives progress may
    /// prefer.
    pub proxy_thread: bool,
    /// `GSC_KERNEL_CACHE_DIR`, absolute: where compiled kernels are kept; `None`: the default
    /// place (see [`default_kernel_cache_dir`]).
    pub kernel_cache_dir: Option<PathBuf>,
    /// `GSC_BOOTSTRAP_ADDR`: `host:port` (checked syntax, not resolved).
    pub bootstrap_addr: Option<String>,
    /// `GSC_BOOTSTRAP_SECRET`. Never printed: `get`, `dump` and `Debug` show `<set>`/`<unset>`.
    pub bootstrap_secret: Option<String>,
    /// `GSC_UNIQUE_ID`
    pub unique_id: Option<String>,
    /// `GSC_BOOTSTRAP_TIMEOUT`, non-zero.
    pub bootstrap_timeout: Duration,
    /// `GSC_RANK`; less than `nranks` when both are set.
    pub rank: Option<u32>,
    /// `GSC_NRANKS`; at least 1.
    pub nranks: Option<u32>,
}

/// Where compiled kernels are cached when `GSC_KERNEL_CACHE_DIR` is unset:
/// `$XDG_CACHE_HOME/gscomm/kernels`, else `$HOME/.cache/gscomm/kernels`, else nowhere.
pub fn default_kernel_cache_dir() -> Option<PathBuf> {
    let base = match std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        Some(x) => PathBuf::from(x),
        None => PathBuf::from(std::env::var_os("HOME").filter(|v| !v.is_empty())?).join(".cache"),
    };
    base.is_absolute().then(|| base.join("gscomm").join("kernels"))
}

impl Default for Config {
    /// Must equal the table's default texts parsed; the tests hold the two together.
    fn default() -> Config {
        Config {
            log_level: LogLevel::Warn,
            log_subsys: Subsys::ALL.to_vec(),
            log_file: None,
            timeline: None,
            tls: LaneKind::ALL.to_vec(),
            eager_short_max: 128,
            rndv_thresh: 64 << 10,
            rndv_scheme: RndvScheme::Auto,
            rndv_frag_size: 512 << 10,
            shm_dir: PathBuf::from("/dev/shm"),
            shm_ring_size: 4 << 20,
            shm_max_frame: 64 << 10,
            ucx_max_frame: 256 << 10,
            ucx_rndv_min: usize::MAX,
            cma: Tristate::Auto,
            cuda_ipc: Tristate::Auto,
            cuda_pdl: Tristate::Auto,
            cuda_wait_kernel: Tristate::Auto,
            prep_words: Tristate::Auto,
            engine: Engine::Auto,
            engine_gpu_max: 16 << 20,
            coll_large_min: 256 << 10,
            coll_large_round: 8 << 20,
            coll_large_algo: LargeAlgo::Phased,
            coll_large_blocks: 128,
            coll_large_threads: None,
            coll_large_stages: 4,
            coll_large_warps: None,
            coll_check: false,
            coll_ce: Tristate::Auto,
            coll_ce_min: 4 << 20,
            coll_sm: Tristate::Auto,
            coll_sm_min: 512 << 10,
            coll_sm_blocks: None,
            coll_ring: Tristate::Auto,
            coll_ring_min: 1 << 20,
            coll_trigger_max: 64,
            coll_ring_pieces: 2,
            coll_p2p_max: 32 << 20,
            coll_p2p_head: 4 << 20,
            coll_p2p_blocks: 64,
            fake_host: None,
            cuda_copy_streams: 1,
            cuda_copy_split: 8 << 20,
            cuda_pipeline_chunk: 4 << 20,
            cuda_pipeline_depth: 4,
            cuda_stage_max: 4 << 10,
            flush_rdma_write: false,
            timeout: Some(Duration::from_secs(60)),
            peer_check_interval: Duration::from_millis(100),
            heartbeat_timeout: Some(Duration::from_secs(10)),
            connect_timeout: Duration::from_secs(10),
            proxy_spin: Duration::from_millis(100),
            proxy_poll: Duration::from_micros(50),
            proxy_thread: true,
            kernel_cache_dir: None,
            bootstrap_addr: None,
            bootstrap_secret: None,
            unique_id: None,
            bootstrap_timeout: Duration::from_secs(60),
            rank: None,
            nranks: None,
        }
    }
}

impl fmt::Debug for Config {
    /// Written through `dump()` so that it lists every knob and never shows the secret.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.dump()).finish()
    }
}

/// Variables of the test harness (`GSC_TEST_GPU`, `GSC_TEST_CHILD`, ...), set next to knobs on the
/// device machines and in multi-process tests; never knobs themselves.
const TEST_PREFIX: &str = "GSC_TEST_";
/// Variables of gsc-bench (`GSC_BENCH_NCCL_LIB`, `GSC_BENCH_HOST_TIME`): the tool's, not knobs.
const BENCH_PREFIX: &str = "GSC_BENCH_";

/// A variable that looks like a knob (`GSC_` prefix) but is not one, with the closest knob name
/// when it is a plausible typo.
pub type UnknownVar = (String, Option<&'static str>);

/// The result of reading a set of variables: the configuration and what was not understood.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigLoad {
    pub config: Config,
    /// Unknown `GSC_*` variables, sorted by name, each listed once.
    pub unknown: Vec<UnknownVar>,
}

impl ConfigLoad {
    /// Log each unknown variable as a warning under `gsc::config`.
    ///
    /// Separate from loading because the logging subscriber is usually configured *from* the
    /// loaded config: call this after `crate::log::init`, or the warnings go nowhere.
    pub fn warn_unknown(&self) {
        for (name, suggestion) in &self.unknown {
            match suggestion {
                Some(s) => tracing::warn!(
                    target: "gsc::config",
                    "unknown configuration variable {name}; did you mean {s}?"
                ),
                None => {
                    tracing::warn!(target: "gsc::config", "unknown configuration variable {name}")
                }
            }
        }
    }
}

/// Build the `InvalidConfig` error for one knob. Secrets are never echoed, even when invalid.
fn value_error(knob: &Knob, value: &str, reason: &str) -> Error {
    let message = if knob.kind == KnobKind::Secret {
        format!("{}=<redacted>: {reason}", knob.name)
    } else {
        format!("{}={value:?}: {reason}", knob.name)
    };
    Error::new(Status::InvalidConfig, message)
}

fn knob_names() -> Vec<&'static str> {
    KNOBS.iter().map(|k| k.name).collect()
}

fn unknown_knob(name: &str) -> Error {
    let message = match parse::suggest(name, &knob_names()) {
        Some(s) => format!("unknown configuration variable {name:?}; did you mean {s}?"),
        None => format!("unknown configuration variable {name:?}"),
    };
    Error::new(Status::InvalidConfig, message)
}

impl Config {
    /// The knob table, in a fixed order (the order of `dump` and `gsc-info -c`).
    pub fn knobs() -> &'static [Knob] {
        KNOBS
    }

    /// Look a knob up by name, with or without the `GSC_` prefix, ignoring case (for API
    /// callers; environment variables themselves must be spelled exactly).
    pub fn knob(name: &str) -> Option<&'static Knob> {
        let name = name.trim();
        let bare = match name.get(..4) {
            Some(prefix) if prefix.eq_ignore_ascii_case("GSC_") => &name[4..],
            _ => name,
        };
        KNOBS.iter().find(|k| k.name[4..].eq_ignore_ascii_case(bare))
    }

    /// Read the process environment, log unknown `GSC_*` variables (see
    /// `ConfigLoad::warn_unknown` for why a caller may prefer `load_env`) and validate.
    pub fn from_env() -> Result<Config> {
        let load = Config::load_env()?;
        load.warn_unknown();
        Ok(load.config)
    }

    /// Read the process environment without logging anything.
    pub fn load_env() -> Result<ConfigLoad> {
        let mut pairs = Vec::new();
        for (name, value) in std::env::vars_os() {
            let name = name.to_string_lossy().into_owned();
            if !name.starts_with("GSC_") {
                continue;
            }
            match value.into_string() {
                Ok(value) => pairs.push((name, value)),
                Err(_) => {
                    return Err(Error::new(Status::InvalidConfig, format!("{name}: value is not valid UTF-8")));
                }
            }
        }
        Config::from_pairs(pairs)
    }

    /// Build a configuration from `(variable, value)` pairs as the environment would hold them:
    /// names are exact (`GSC_TLS`), names without the `GSC_` prefix are ignored, and so are the
    /// test harness's `GSC_TEST_*` switches (not knobs: no warning for them); a later pair
    /// overrides an earlier one. Pure: no environment, no logging.
    ///
    /// Values are applied in table order and every bad value is reported (joined with `; `),
    /// so one run shows all the mistakes; cross-knob rules are checked once all values are in.
    pub fn from_pairs<I, K, V>(pairs: I) -> Result<ConfigLoad>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut values: Vec<Option<String>> = vec![None; KNOBS.len()];
        let mut unknown: Vec<UnknownVar> = Vec::new();
        let names = knob_names();
        for (name, value) in pairs {
            let name = name.as_ref();
            if !name.starts_with("GSC_") || name.starts_with(TEST_PREFIX) || name.starts_with(BENCH_PREFIX) {
                continue;
            }
            match KNOBS.iter().position(|k| k.name == name) {
                Some(i) => values[i] = Some(value.as_ref().to_string()),
                None if unknown.iter().any(|(n, _)| n == name) => {}
                None => unknown.push((name.to_string(), parse::suggest(name, &names))),
            }
        }
        unknown.sort();

        let mut config = Config::default();
        let mut errors = Vec::new();
        for (knob, value) in KNOBS.iter().zip(&values) {
            if let Some(value) = value
                && let Err(reason) = (knob.parse)(&mut config, value)
            {
                errors.push(value_error(knob, value, &reason).message().to_string());
            }
        }
        if !errors.is_empty() {
            return Err(Error::new(Status::InvalidConfig, errors.join("; ")));
        }
        config.validate()?;
        Ok(ConfigLoad { config, unknown })
    }

    /// Set one knob from text (`name` as for `knob`). On any error, including a cross-knob rule
    /// the new value would break, the configuration is left exactly as it was.
    pub fn set(&mut self, name: &str, value: &str) -> Result<()> {
        let knob = Config::knob(name).ok_or_else(|| unknown_knob(name))?;
        let mut next = self.clone();
        (knob.parse)(&mut next, value).map_err(|reason| value_error(knob, value, &reason))?;
        next.validate()?;
        *self = next;
        Ok(())
    }

    /// One knob's current value as canonical text, which `set` accepts back. The bootstrap
    /// secret reads as `<set>` or `<unset>`; code that needs it reads the field.
    pub fn get(&self, name: &str) -> Result<String> {
        let knob = Config::knob(name).ok_or_else(|| unknown_knob(name))?;
        Ok((knob.show)(self))
    }

    /// Every knob with its current value, in table order.
    pub fn dump(&self) -> Vec<(&'static str, String)> {
        KNOBS.iter().map(|k| (k.name, (k.show)(self))).collect()
    }

    /// Check the rules that involve several knobs. `from_pairs` and `set` call it; call it
    /// after changing fields directly.
    pub fn validate(&self) -> Result<()> {
        // Rules of single knobs (non-empty selections, power-of-two ring, non-zero durations,
        // ...) matter here because fields can be assigned directly. Round-tripping every field
        // through its text form rechecks them with the parsers themselves, so each rule exists
        // exactly once.
        // The secret is skipped: it has no rules, and its shown text is only a placeholder.
        let mut scratch = self.clone();
        for knob in KNOBS.iter().filter(|k| k.kind != KnobKind::Secret) {
            let text = (knob.show)(self);
            (knob.parse)(&mut scratch, &text).map_err(|reason| value_error(knob, &text, &reason))?;
        }
        let fail = |message: String| Err(Error::new(Status::InvalidConfig, message));
        let size = |v: usize| parse::format_size(v as u64);
        if self.rndv_thresh <= self.eager_short_max {
            return fail(format!(
                "GSC_RNDV_THRESH={} must be greater than GSC_EAGER_SHORT_MAX={}",
                size(self.rndv_thresh),
                size(self.eager_short_max)
            ));
        }
        if self.shm_max_frame > self.shm_ring_size / 4 {
            // A quarter keeps several frames in flight per ring, so a sender is not stalled
            // behind every single frame the receiver has yet to consume.
            return fail(format!(
                "GSC_SHM_MAX_FRAME={} must be at most a quarter of GSC_SHM_RING_SIZE={}",
                size(self.shm_max_frame),
                size(self.shm_ring_size)
            ));
        }
        if let (Some(rank), Some(nranks)) = (self.rank, self.nranks)
            && rank >= nranks
        {
            return fail(format!("GSC_RANK={rank} must be less than GSC_NRANKS={nranks}"));
        }
        Ok(())
    }
}
