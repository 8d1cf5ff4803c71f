//! The table of knobs. Every `GSC_*` variable is one row here and nowhere else: parsing, the
//! defaults text, `Config::get`/`dump`, `gsc-info -c` and the documentation all read this table.
//!
//! Adding a knob: add the field to `Config` and its value to `Config::default()`, then one row
//! here. The tests check that every row's default text parses to exactly `Config::default()`,
//! so the two cannot drift apart.

use std::path::PathBuf;
use std::time::Duration;

use super::parse::{
    self, DURATION_INF_EXPECTED, check_host_port, format_duration, format_selection, format_size, parse_duration, parse_selection,
    parse_tristate, parse_usize,
};
use super::{Config, Engine, LargeAlgo, LogLevel, RndvScheme, Subsys, Tristate};
use crate::transport::LaneKind;

/// One configuration variable.
#[derive(Copy, Clone)]
pub struct Knob {
    /// The environment variable, e.g. `GSC_RNDV_THRESH`.
    pub name: &'static str,
    /// The default, as text in the knob's own syntax (empty: unset).
    pub default: &'static str,
    /// One line for `gsc-info -c` and the documentation.
    pub doc: &'static str,
    pub kind: KnobKind,
    /// Parse `value` into its field of the config. `Err` says what was expected; it must not
    /// repeat the value (the caller adds `NAME="value": `, or hides it for secrets).
    pub(super) parse: fn(&mut Config, &str) -> Result<(), String>,
    /// The field's current value in canonical text (parseable back by `parse`).
    pub(super) show: fn(&Config) -> String,
}

impl std::fmt::Debug for Knob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Knob").field("name", &self.name).field("default", &self.default).field("kind", &self.kind).finish_non_exhaustive()
    }
}

/// The value syntax of a knob.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum KnobKind {
    LogLevel,
    Subsystems,
    /// A file name pattern with `%h`/`%p`; empty: stderr.
    LogFile,
    Lanes,
    Size,
    RndvScheme,
    Engine,
    /// An absolute directory.
    Path,
    Tristate,
    /// `on` or `off` (no `auto`: nothing detects the answer); empty: off.
    Bool,
    /// A duration greater than zero.
    Duration,
    /// A duration greater than zero, or `inf`.
    DurationOrInf,
    /// `host:port`; empty: unset.
    HostPort,
    /// Free text; empty: unset.
    Text,
    /// Free text never shown by `get`, `dump`, `Debug` or error messages; empty: unset.
    Secret,
    /// A non-negative integer; empty: unset.
    Count,
    /// An integer from 1 up.
    Positive,
    /// `auto`, or an integer.
    AutoCount,
    LargeAlgo,
    /// `auto`, or three shares `push:reduce:copy`.
    RoleShares,
}

impl KnobKind {
    /// What values look like, for `gsc-info -c` and documentation.
    pub fn syntax(self) -> String {
        match self {
            KnobKind::LogLevel => join_names(LogLevel::ALL, LogLevel::name, "|"),
            KnobKind::Subsystems => format!("all, a list of {} or ^list to exclude", join_names(Subsys::ALL, Subsys::name, ",")),
            KnobKind::LogFile => "file name (%h: host name, %p: process id, %%: %); empty: stderr".to_string(),
            KnobKind::Lanes => format!("all, a list of {} or ^list to exclude", join_names(LaneKind::ALL, LaneKind::name, ",")),
            KnobKind::Size => "bytes, or with a unit K, M, G (1K = 1024) such as 64K".to_string(),
            KnobKind::RndvScheme => join_names(RndvScheme::ALL, RndvScheme::name, "|"),
            KnobKind::Engine => join_names(Engine::ALL, Engine::name, "|"),
            KnobKind::Path => "absolute directory".to_string(),
            KnobKind::Tristate => "auto|on|off (also yes/no, y/n, true/false, 1/0)".to_string(),
            KnobKind::Bool => "on|off (also yes/no, y/n, true/false, 1/0); empty: off".to_string(),
            KnobKind::Duration => "duration such as 10s, 100ms, 250us, 2m; bare number: seconds".to_string(),
            KnobKind::DurationOrInf => "duration such as 10s, 100ms, 250us, 2m; bare number: seconds; inf: no bound".to_string(),
            KnobKind::HostPort => "host:port; empty: unset".to_string(),
            KnobKind::Text | KnobKind::Secret => "text; empty: unset".to_string(),
            KnobKind::Count => "non-negative integer; empty: unset".to_string(),
            KnobKind::Positive => "integer from 1 up".to_string(),
            KnobKind::AutoCount => "auto, or an integer".to_string(),
            KnobKind::LargeAlgo => join_names(LargeAlgo::ALL, LargeAlgo::name, "|"),
            KnobKind::RoleShares => "auto, or push:reduce:copy shares such as 3:3:2".to_string(),
        }
    }
}

fn join_names<T: Copy>(items: &[T], name_of: fn(T) -> &'static str, sep: &str) -> String {
    items.iter().map(|&t| name_of(t)).collect::<Vec<_>>().join(sep)
}

/// A file-name pattern knob (`%h`, `%p`); empty: unset. The pattern is checked now so a typo
/// fails at configuration time, not when the file is opened (where the real expansion happens).
fn file_pattern(value: &str) -> Result<Option<String>, String> {
    let file = optional_text(value);
    if let Some(pattern) = &file {
        crate::log::expand_pattern(pattern, "host", 1)?;
    }
    Ok(file)
}

/// Empty means unset for optional text knobs: `GSC_X=` is how a shell clears an inherited value.
fn optional_text(value: &str) -> Option<String> {
    let value = value.trim();
    (!value.is_empty()).then(|| value.to_string())
}

/// `GSC_FAKE_HOST`: empty is unset; otherwise 1 to 64 characters that are safe in logs and
/// file names, so a typo (a stray space, a quote) is an error rather than a silent other host.
fn parse_fake_host(value: &str) -> Result<Option<String>, String> {
    let Some(label) = optional_text(value) else { return Ok(None) };
    if label.len() > 64 {
        return Err(format!("a host label of at most 64 characters (this one has {})", label.len()));
    }
    if let Some(bad) = label.chars().find(|ch| !(ch.is_ascii_alphanumeric() || matches!(ch, '.' | '_' | '-'))) {
        return Err(format!("a host label of A-Z a-z 0-9 . _ - (found {bad:?})"));
    }
    Ok(Some(label))
}

fn show_optional(value: &Option<String>) -> String {
    value.clone().unwrap_or_default()
}

/// Every duration knob bounds a wait or sets a polling period; zero would turn every wait into
/// an immediate failure or a busy loop, so it is refused rather than silently meaning "never".
fn positive_duration(value: &str) -> Result<Duration, String> {
    let d = parse_duration(value)?;
    if d.is_zero() {
        return Err("must be greater than zero".to_string());
    }
    Ok(d)
}

/// A positive duration, or `inf` (`None`): no bound.
fn duration_or_inf(value: &str) -> Result<Option<Duration>, String> {
    let value = value.trim();
    if value.eq_ignore_ascii_case("inf") || value.eq_ignore_ascii_case("infinity") {
        return Ok(None);
    }
    positive_duration(value)
        .map(Some)
        .map_err(|reason| if reason == parse::DURATION_EXPECTED { DURATION_INF_EXPECTED.to_string() } else { reason })
}

fn optional_count(value: &str) -> Result<Option<u32>, String> {
    let value = value.trim();
    if value.is_empty() {
        return Ok(None);
    }
    if !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err("expected a non-negative integer such as 0 or 16".to_string());
    }
    value.parse().map(Some).map_err(|_| "expected an integer of at most 4294967295".to_string())
}

fn show_count(value: Option<u32>) -> String {
    value.map(|v| v.to_string()).unwrap_or_default()
}

const BOOL_EXPECTED: &str = "expected on/yes/y/true/1 or off/no/n/false/0";

/// A switch with no `auto`: the spellings of a tristate's on and off. Empty is off, the way a
/// shell clears an inherited value; `auto` is refused because nothing would detect the answer.
fn parse_bool(value: &str) -> Result<bool, String> {
    if value.trim().is_empty() {
        return Ok(false);
    }
    match parse_tristate(value) {
        Ok(Some(on)) => Ok(on),
        Ok(None) | Err(_) => Err(BOOL_EXPECTED.to_string()),
    }
}

/// `auto` (`None`), or `push:reduce:copy` shares, each 0..=32, push not 0.
fn parse_role_shares(value: &str) -> Result<Option<[u32; 3]>, String> {
    const EXPECTED: &str = "expected auto or push:reduce:copy shares, each 0 to 32, push not 0 (such as 3:3:2)";
    let value = value.trim();
    if value.eq_ignore_ascii_case("auto") {
        return Ok(None);
    }
    let parts: Vec<&str> = value.split(':').collect();
    let [p, r, c] = parts.as_slice() else { return Err(EXPECTED.to_string()) };
    let mut shares = [0u32; 3];
    for (share, text) in shares.iter_mut().zip([p, r, c]) {
        *share = text.trim().parse().ok().filter(|s| *s <= 32).ok_or_else(|| EXPECTED.to_string())?;
    }
    if shares[0] == 0 {
        return Err(EXPECTED.to_string());
    }
    Ok(Some(shares))
}

fn show_bool(value: bool) -> String {
    if value { "on" } else { "off" }.to_string()
}

const SECRET_SET: &str = "<set>";
const SECRET_UNSET: &str = "<unset>";

/// Smallest shared-memory ring: below this the ring holds too few frames of any useful size
/// for the sender to run ahead of the receiver.
const SHM_RING_MIN: usize = 64 << 10;

pub(super) static KNOBS: &[Knob] = &[
    Knob {
        name: "GSC_LOG_LEVEL",
        default: "warn",
        doc: "Least severe level of log messages that are printed",
        kind: KnobKind::LogLevel,
        parse: |c, v| {
            c.log_level = LogLevel::parse(v)?;
            Ok(())
        },
        show: |c| c.log_level.name().to_string(),
    },
    Knob {
        name: "GSC_LOG_SUBSYS",
        default: "all",
        doc: "Subsystems whose log messages below warning level are printed (errors and \
              warnings print from every subsystem)",
        kind: KnobKind::Subsystems,
        parse: |c, v| {
            c.log_subsys = parse_selection(v, Subsys::ALL, Subsys::name, "subsystem")?;
            Ok(())
        },
        show: |c| format_selection(&c.log_subsys, Subsys::ALL, Subsys::name),
    },
    Knob {
        name: "GSC_LOG_FILE",
        default: "",
        doc: "File that log messages are appended to instead of stderr",
        kind: KnobKind::LogFile,
        parse: |c, v| {
            c.log_file = file_pattern(v)?;
            Ok(())
        },
        show: |c| show_optional(&c.log_file),
    },
    Knob {
        name: "GSC_TIMELINE",
        default: "",
        doc: "File the event timeline (ns timestamps of every proxy step) is appended to; empty: off",
        kind: KnobKind::LogFile,
        parse: |c, v| {
            c.timeline = file_pattern(v)?;
            Ok(())
        },
        show: |c| show_optional(&c.timeline),
    },
    Knob {
        name: "GSC_TLS",
        default: "all",
        doc: "Lanes that may be used to reach peers",
        kind: KnobKind::Lanes,
        parse: |c, v| {
            c.tls = parse_selection(v, LaneKind::ALL, LaneKind::name, "lane")?;
            Ok(())
        },
        show: |c| format_selection(&c.tls, LaneKind::ALL, LaneKind::name),
    },
    Knob {
        name: "GSC_EAGER_SHORT_MAX",
        default: "128",
        doc: "Largest message sent inline with its header in a single frame",
        kind: KnobKind::Size,
        parse: |c, v| {
            c.eager_short_max = parse_usize(v)?;
            Ok(())
        },
        show: |c| format_size(c.eager_short_max as u64),
    },
    Knob {
        name: "GSC_RNDV_THRESH",
        default: "64K",
        doc: "Messages of this size and larger use the rendezvous protocol (> GSC_EAGER_SHORT_MAX)",
        kind: KnobKind::Size,
        parse: |c, v| {
            c.rndv_thresh = parse_usize(v)?;
            Ok(())
        },
        show: |c| format_size(c.rndv_thresh as u64),
    },
    Knob {
        name: "GSC_RNDV_SCHEME",
        default: "auto",
        doc: "Rendezvous data movement: get (read the sender's memory), pipeline (fragments \
              through frames) or auto (loopback: get; shm: the receiver takes whichever it \
              measured faster; else pipeline)",
        kind: KnobKind::RndvScheme,
        parse: |c, v| {
            c.rndv_scheme = RndvScheme::parse(v)?;
            Ok(())
        },
        show: |c| c.rndv_scheme.name().to_string(),
    },
    Knob {
        name: "GSC_RNDV_FRAG_SIZE",
        default: "512K",
        doc: "Fragment size of pipelined rendezvous transfers",
        kind: KnobKind::Size,
        parse: |c, v| {
            let size = parse_usize(v)?;
            if size == 0 {
                return Err("must be greater than zero".to_string());
            }
            c.rndv_frag_size = size;
            Ok(())
        },
        show: |c| format_size(c.rndv_frag_size as u64),
    },
    Knob {
        name: "GSC_SHM_DIR",
        default: "/dev/shm",
        doc: "Directory holding shared-memory segment files",
        kind: KnobKind::Path,
        parse: |c, v| {
            let path = PathBuf::from(v.trim());
            // Peers open each other's segments by name; a relative path would resolve against
            // each process's own working directory and silently disagree.
            if !path.is_absolute() {
                return Err("expected an absolute directory such as /dev/shm".to_string());
            }
            c.shm_dir = path;
            Ok(())
        },
        show: |c| c.shm_dir.display().to_string(),
    },
    Knob {
        name: "GSC_SHM_RING_SIZE",
        default: "4M",
        doc: "Bytes in each shared-memory frame ring (a power of two, at least 64K)",
        kind: KnobKind::Size,
        parse: |c, v| {
            let size = parse_usize(v)?;
            // Ring indices wrap with a mask, which needs a power of two.
            if !size.is_power_of_two() || size < SHM_RING_MIN {
                return Err(format!("must be a power of two of at least {}, such as 1M or 4M", format_size(SHM_RING_MIN as u64)));
            }
            c.shm_ring_size = size;
            Ok(())
        },
        show: |c| format_size(c.shm_ring_size as u64),
    },
    Knob {
        name: "GSC_SHM_MAX_FRAME",
        default: "64K",
        doc: "Largest frame on a shared-memory ring (at most GSC_SHM_RING_SIZE / 4)",
        kind: KnobKind::Size,
        parse: |c, v| {
            let size = parse_usize(v)?;
            if size == 0 {
                return Err("must be greater than zero".to_string());
            }
            c.shm_max_frame = size;
            Ok(())
        },
        show: |c| format_size(c.shm_max_frame as u64),
    },
    Knob {
        name: "GSC_UCX_MAX_FRAME",
        default: "256K",
        doc: "Largest frame on the UCX lane (4K to 64M); UCX's TCP segments are sized to hold one \
              (UCX_TCP_TX_SEG_SIZE / RX_SEG_SIZE, unless set)",
        kind: KnobKind::Size,
        parse: |c, v| {
            let size = parse_usize(v)?;
            if !(4 << 10..=64 << 20).contains(&size) {
                return Err("must be between 4K and 64M".to_string());
            }
            c.ucx_max_frame = size;
            Ok(())
        },
        show: |c| format_size(c.ucx_max_frame as u64),
    },
    Knob {
        name: "GSC_UCX_RNDV_MIN",
        default: "off",
        doc: "UCX lane frames of at least this many bytes go by UCX's rendezvous protocol \
              (zero-copy where the transport has it: cma, rc) instead of eager copies; off: none \
              (fastest over TCP)",
        kind: KnobKind::Size,
        parse: |c, v| {
            c.ucx_rndv_min = if v.eq_ignore_ascii_case("off") { usize::MAX } else { parse_usize(v)? };
            Ok(())
        },
        show: |c| if c.ucx_rndv_min == usize::MAX { "off".to_string() } else { format_size(c.ucx_rndv_min as u64) },
    },
    Knob {
        name: "GSC_CMA",
        default: "auto",
        doc: "Cross-memory attach (process_vm_readv/writev) for shared-memory zero copy; auto: \
              use it where the kernel permits, on: fail if it does not",
        kind: KnobKind::Tristate,
        parse: |c, v| {
            c.cma = Tristate::from_option(parse_tristate(v)?);
            Ok(())
        },
        show: |c| c.cma.name().to_string(),
    },
    Knob {
        name: "GSC_CUDA_IPC",
        default: "auto",
        doc: "Read peers' GPU buffers through CUDA IPC with the copy engine (auto: fall back to \
              the sender pushing through host memory when a read cannot be done; on: a failed \
              IPC read fails the receive); off: always push GPU data through host memory frame \
              by frame (staged)",
        kind: KnobKind::Tristate,
        parse: |c, v| {
            c.cuda_ipc = Tristate::from_option(parse_tristate(v)?);
            Ok(())
        },
        show: |c| c.cuda_ipc.name().to_string(),
    },
    Knob {
        name: "GSC_CUDA_PDL",
        default: "auto",
        doc: "Stream conditions' trigger/wait kernels (on GPUs of compute capability 9.0 on) and \
              captured GPU rounds of prepared transfers are launched with programmatic dependent \
              launch (the next kernel is scheduled while the previous one runs, and waits for it \
              on the GPU); off: plain launches and kernel nodes. Read once per process",
        kind: KnobKind::Tristate,
        parse: |c, v| {
            c.cuda_pdl = Tristate::from_option(parse_tristate(v)?);
            Ok(())
        },
        show: |c| c.cuda_pdl.name().to_string(),
    },
    Knob {
        name: "GSC_PREP_WORDS",
        default: "auto",
        doc: "Prepared transfers between processes of one host (shm lane, one partition): the \
              sender makes a page both processes map, the receiver raises a 'ready' word in it \
              each round and the sender an 'arrived' word after its direct write (from the copy \
              stream for GPU buffers), instead of a ready frame and a completion frame per \
              round. off: frames (for A/B comparisons). auto: shared words where the page can \
              be made and mapped (else frames, logged at pairing); on: as auto, but a sender \
              that cannot make or register its page fails the preparation",
        kind: KnobKind::Tristate,
        parse: |c, v| {
            c.prep_words = Tristate::from_option(parse_tristate(v)?);
            Ok(())
        },
        show: |c| c.prep_words.name().to_string(),
    },
    Knob {
        name: "GSC_CUDA_WAIT_KERNEL",
        default: "auto",
        doc: "A CUDA stream's trigger and wait (stream conditions not being captured) are one small \
              kernel whose thread writes the trigger word and polls the completion word: about 2 \
              us from completion to the stream going on. off: stream memops (cuStreamBatchMemOp), \
              which need no kernel compiler but take 4-12 us, the GPU polling host memory slowly \
              once a wait has lasted. auto: the kernel where NVRTC works, else memops; on: the \
              kernel or an error. Read once per process",
        kind: KnobKind::Tristate,
        parse: |c, v| {
            c.cuda_wait_kernel = Tristate::from_option(parse_tristate(v)?);
            Ok(())
        },
        show: |c| c.cuda_wait_kernel.name().to_string(),
    },
    Knob {
        name: "GSC_ENGINE",
        default: "auto",
        doc: "Who runs the rounds of prepared transfers that did not ask for an engine: auto (the \
              GPU itself where both buffers are GPU memory on peers reachable through CUDA IPC, up \
              to GSC_ENGINE_GPU_MAX bytes; the proxy thread elsewhere), gpu (the GPU wherever it \
              can, any size), proxy (the proxy thread). A transfer that asked for GPU rounds (its \
              kernels drive them) or for the proxy gets what it asked. gsc-info -p prints the table",
        kind: KnobKind::Engine,
        parse: |c, v| {
            c.engine = Engine::parse(v)?;
            Ok(())
        },
        show: |c| c.engine.name().to_string(),
    },
    Knob {
        name: "GSC_ENGINE_GPU_MAX",
        default: "16M",
        doc: "Largest prepared transfer GSC_ENGINE=auto runs on the GPU (larger ones: the proxy \
              and the copy engine)",
        kind: KnobKind::Size,
        parse: |c, v| {
            c.engine_gpu_max = parse_usize(v)?;
            Ok(())
        },
        show: |c| format_size(c.engine_gpu_max as u64),
    },
    Knob {
        name: "GSC_COLL_CHECK",
        default: "off",
        doc: "Debug mode: before every collective the ranks compare the call (collective, type, \
              operator, count, root) through the bootstrap; a mismatch fails the call on every \
              rank, naming the rank that differs, and starts nothing. Costs a host round trip \
              per call. Off (with a warning) for a communicator with several ranks in one \
              process, whose calls one thread issues in turn",
        kind: KnobKind::Bool,
        parse: |c, v| {
            c.coll_check = parse_bool(v)?;
            Ok(())
        },
        show: |c| show_bool(c.coll_check),
    },
    Knob {
        name: "GSC_COLL_CE",
        default: "auto",
        doc: "Large all-reduce, all-gather and reduce-scatter by the copy engines: each rank \
              pulls its peers' parts straight from their buffers (a reduction kernel adds them \
              up), between barriers in the communicator's workspace. The ranks exchange and map \
              the buffers through the bootstrap during the call, so auto does it only for calls \
              captured into a graph (paid once, not per replay), and only where the engines \
              measured faster than the kernels: all-gathers of three and more ranks; on: \
              all three, every call from \
              GSC_COLL_CE_MIN; off: never. Every rank must capture the same calls (a rank that \
              does not waits for the others until GSC_TIMEOUT). Always off for a communicator \
              with several ranks in one process (ncclCommInitAll: one thread issues every \
              rank's call)",
        kind: KnobKind::Tristate,
        parse: |c, v| {
            c.coll_ce = Tristate::from_option(parse_tristate(v)?);
            Ok(())
        },
        show: |c| c.coll_ce.name().to_string(),
    },
    Knob {
        name: "GSC_COLL_CE_MIN",
        default: "4M",
        doc: "Smallest call (bytes per rank's part: the whole buffer of an all-reduce) that \
              GSC_COLL_CE gives to the copy engines",
        kind: KnobKind::Size,
        parse: |c, v| {
            c.coll_ce_min = parse_usize(v)?;
            Ok(())
        },
        show: |c| format_size(c.coll_ce_min as u64),
    },
    Knob {
        name: "GSC_COLL_SM",
        default: "auto",
        doc: "Large all-reduce, all-gather and reduce-scatter by one SM kernel on the peers' own \
              buffers: all-gather pushes each part into every rank's receive buffer, \
              reduce-scatter and all-reduce read each rank's shard of every send buffer and \
              reduce it in rank order (all-reduce writes the sum into every receive buffer), \
              between two meetings of the ranks in the same launch. The buffers are exchanged \
              and mapped through the bootstrap during the call, as for GSC_COLL_CE. on: every \
              such call from GSC_COLL_SM_MIN whose buffers are on 16 bytes and whose parts \
              (all-reduce: shards) are whole 16 bytes, before the copy engines; auto: the same \
              between two ranks where it measured faster on 2 x H200 (docs/PERF.md): \
              all-gather from 8M per rank, reduce-scatter from 16M, all-reduce from 1M when \
              captured into or added to a graph and from 16M on a stream (where each call \
              exchanges the buffers); all-gathers of three and four ranks from 512K in graphs \
              and 8M on a stream (measured ahead on 4 x H200); never the rest \
              (not measured, or slower than the copy-engine ring); off: never. Always off for a \
              communicator with several ranks in one process",
        kind: KnobKind::Tristate,
        parse: |c, v| {
            c.coll_sm = Tristate::from_option(parse_tristate(v)?);
            Ok(())
        },
        show: |c| c.coll_sm.name().to_string(),
    },
    Knob {
        name: "GSC_COLL_SM_MIN",
        default: "512K",
        doc: "Smallest call (bytes per rank's part: the whole buffer of an all-reduce) that \
              GSC_COLL_SM gives to the direct kernel",
        kind: KnobKind::Size,
        parse: |c, v| {
            c.coll_sm_min = parse_usize(v)?;
            Ok(())
        },
        show: |c| format_size(c.coll_sm_min as u64),
    },
    Knob {
        name: "GSC_COLL_SM_BLOCKS",
        default: "auto",
        doc: "Blocks of the direct kernel (GSC_COLL_SM), 1..=4096; auto: two per SM. Fewer are \
              launched when the call has fewer 16-byte pieces than threads",
        kind: KnobKind::AutoCount,
        parse: |c, v| {
            if v.trim().eq_ignore_ascii_case("auto") {
                c.coll_sm_blocks = None;
                return Ok(());
            }
            let n = parse_usize(v).map_err(|_| "expected auto or a number of blocks".to_string())?;
            if !(1..=4096).contains(&n) {
                return Err("expected auto or 1 to 4096 blocks".into());
            }
            c.coll_sm_blocks = Some(n);
            Ok(())
        },
        show: |c| c.coll_sm_blocks.map_or("auto".to_string(), |n| n.to_string()),
    },
    Knob {
        name: "GSC_COLL_RING",
        default: "auto",
        doc: "Large reduce-scatter and all-reduce by a ring of copy engines: each rank's engines \
              copy a part into the next rank's scratch, a kernel there waits for the copy's \
              flag and adds its own input, and the sum travels on, step by step (an all-reduce \
              then passes the reduced shards around the ring into every receive buffer). Each \
              step is cut into GSC_COLL_RING_PIECES pieces so copies and reductions overlap. \
              The buffers are exchanged and mapped during the call, as for GSC_COLL_CE. auto: \
              on four or more ranks, for calls captured into a graph, where it measured faster \
              than the kernels on 4 x H200 (docs/PERF.md): reduce-scatter from 32M per rank, \
              all-reduce from 64M (and from GSC_COLL_RING_MIN); on: every \
              such call from GSC_COLL_RING_MIN on stream conditions, before the copy engines; \
              off: never. Parts (all-reduce: shards) must cut into pieces of whole 16 bytes, \
              buffers on 16 bytes. Always off for a communicator with several ranks in one \
              process",
        kind: KnobKind::Tristate,
        parse: |c, v| {
            c.coll_ring = Tristate::from_option(parse_tristate(v)?);
            Ok(())
        },
        show: |c| c.coll_ring.name().to_string(),
    },
    Knob {
        name: "GSC_COLL_RING_MIN",
        default: "1M",
        doc: "Smallest call (bytes per rank's part: the whole buffer of an all-reduce) that \
              GSC_COLL_RING gives to the copy-engine ring",
        kind: KnobKind::Size,
        parse: |c, v| {
            c.coll_ring_min = parse_usize(v)?;
            Ok(())
        },
        show: |c| format_size(c.coll_ring_min as u64),
    },
    Knob {
        name: "GSC_COLL_RING_PIECES",
        default: "2",
        doc: "Pieces each step of the copy-engine ring (GSC_COLL_RING) is cut into, 1 to 16: \
              more overlap copies with reductions better, but every copy costs the engines a \
              few microseconds (docs/PERF.md)",
        kind: KnobKind::Positive,
        parse: |c, v| {
            let n = parse_usize(v)?;
            if !(1..=16).contains(&n) {
                return Err("expected 1 to 16 pieces".into());
            }
            c.coll_ring_pieces = n;
            Ok(())
        },
        show: |c| c.coll_ring_pieces.to_string(),
    },
    Knob {
        name: "GSC_COLL_TRIGGER_MAX",
        default: "64",
        doc: "Largest all-reduce (bytes) on a kernel-triggered condition that the triggering \
              thread runs itself: gsc_trigger writes this rank's input into every peer's \
              mailbox, gsc_wait reduces what the peers wrote into its own, with no launch and \
              no host in between (every type but 16-bit floats, every operator but \
              pre-multiplied sums). Larger ones, and the other collectives, are launched by \
              gscomm's thread on every trigger. One thread moves the data, about 0.6 us per \
              4 bytes, so it wins for small calls only: 8 bytes in 4.2-4.9 us against 15-16 \
              launched, 64 bytes 11.9 against 15.3, 128 bytes slower (2 x H200, docs/PERF.md). \
              0: never. Always 0 for a communicator with several ranks in one process",
        kind: KnobKind::Size,
        parse: |c, v| {
            c.coll_trigger_max = parse_usize(v)?;
            Ok(())
        },
        show: |c| format_size(c.coll_trigger_max as u64),
    },
    Knob {
        name: "GSC_COLL_P2P_MAX",
        default: "32M",
        doc: "Largest send/recv (bytes) of a communicator's group that SMs move, through FIFOs \
              in the receivers' workspaces, in one kernel per group on the stream (no host in \
              the loop, no buffer exchange, replayable in graphs); larger ones go through the \
              point-to-point engine (copy engines through CUDA IPC). Decided per message from \
              its length, so every rank must share it. 0: never. Applies to the NCCL-ABI \
              library's ncclSend/ncclRecv and Communicator::transfers. Between two H200s the \
              kernel wins up to 32 MiB; at 64 MiB the engine wins one message per pair by \
              2% and the kernel an all-to-all by 11% (docs/PERF.md, session 25)",
        kind: KnobKind::Size,
        parse: |c, v| {
            c.coll_p2p_max = parse_usize(v)?;
            Ok(())
        },
        show: |c| format_size(c.coll_p2p_max as u64),
    },
    Knob {
        name: "GSC_COLL_P2P_HEAD",
        default: "4M",
        doc: "Of a send/recv longer than GSC_COLL_P2P_MAX plus this between two ranks (not to \
              itself), on a CUDA stream (captured or not): the first this many bytes go by the \
              send/recv kernel on a side stream, which starts at once, while the point-to-point \
              engine matches and moves the rest, so the links carry data while the engine \
              starts. Decided from the message's length, so every rank must share it; the \
              buffer must be GPU memory, as for the kernel. At most GSC_COLL_P2P_MAX; 0: off. \
              Between two H200s, all-to-all of 128 MiB in graphs: 0: 209 us, 3M: 206, 4M: \
              199-200, 6M: 205 (docs/PERF.md, session 27)",
        kind: KnobKind::Size,
        parse: |c, v| {
            c.coll_p2p_head = parse_usize(v)?;
            Ok(())
        },
        show: |c| format_size(c.coll_p2p_head as u64),
    },
    Knob {
        name: "GSC_COLL_P2P_BLOCKS",
        default: "64",
        doc: "Blocks the send/recv kernel (GSC_COLL_P2P_MAX) gives one send or receive, 1 to \
              64: each moves one chunk (16 to 64 KiB) at a time, through a FIFO of 128 chunks \
              per pair; a message has as many blocks as chunks at most (32 up to 2 MiB). \
              Between two H200s at 16 MiB: 32 blocks 255 GB/s, 64: 298 (docs/PERF.md, session \
              25). A group's blocks are kept within the GPU's SM count (fewer per operation \
              when it has many)",
        kind: KnobKind::Positive,
        parse: |c, v| {
            let n = parse_usize(v)?;
            if !(1..=64).contains(&n) {
                return Err("expected 1 to 64 blocks".into());
            }
            c.coll_p2p_blocks = n;
            Ok(())
        },
        show: |c| c.coll_p2p_blocks.to_string(),
    },
    Knob {
        name: "GSC_COLL_LARGE_MIN",
        default: "256K",
        doc: "Smallest all-reduce (bytes per rank; also broadcast and reduce, and parts of \
              all-gather and reduce-scatter) that takes the large algorithm (reduce-scatter + \
              all-gather by NVLink writes, GSC_COLL_LARGE_BLOCKS channels) instead of the \
              one-shot LL exchange; gsc-info -p prints the collectives' table",
        kind: KnobKind::Size,
        parse: |c, v| {
            c.coll_large_min = parse_usize(v)?;
            Ok(())
        },
        show: |c| format_size(c.coll_large_min as u64),
    },
    Knob {
        name: "GSC_COLL_LARGE_ROUND",
        default: "8M",
        doc: "Bytes per rank one round of the large collectives moves (1M..=64M, whole MiB): each \
              round costs two flag exchanges between ranks, and each communicator holds four \
              areas of this size in GPU memory (the pipelined kernel cuts them into \
              GSC_COLL_LARGE_STAGES stages: rounds of 2 x this / stages). Read once per process",
        kind: KnobKind::Size,
        parse: |c, v| {
            let n = parse_usize(v)?;
            if !(1 << 20..=64 << 20).contains(&n) || n % (1 << 20) != 0 {
                return Err(format!("{v}: whole MiB from 1M to 64M"));
            }
            c.coll_large_round = n;
            Ok(())
        },
        show: |c| format_size(c.coll_large_round as u64),
    },
    Knob {
        name: "GSC_FAKE_HOST",
        default: "",
        doc: "Testing: a label (1 to 64 of A-Z a-z 0-9 . _ -) mixed into this process's host \
              identity, so processes of one machine with different labels count as different \
              hosts: no shm lane between them (UCX instead), and hierarchical collectives put \
              them in different groups (e.g. 4 GPUs as 2 hosts x 2 GPUs). Empty: the real host",
        kind: KnobKind::Text,
        parse: |c, v| {
            c.fake_host = parse_fake_host(v)?;
            Ok(())
        },
        show: |c| show_optional(&c.fake_host),
    },
    Knob {
        name: "GSC_COLL_LARGE_ALGO",
        default: "phased",
        doc: "Kernel of the large collectives: phased (each block pushes, exchanges flags, \
              reduces, exchanges flags and copies out, one phase after the other) or pipelined \
              (each block's warps split into push, reduce and copy-out roles working on \
              different rounds at once). Read when a communicator is made; every rank of it \
              must have the same value, as for every GSC_COLL_LARGE_* knob",
        kind: KnobKind::LargeAlgo,
        parse: |c, v| {
            c.coll_large_algo = LargeAlgo::parse(v)?;
            Ok(())
        },
        show: |c| c.coll_large_algo.name().to_string(),
    },
    Knob {
        name: "GSC_COLL_LARGE_BLOCKS",
        default: "128",
        doc: "Blocks (channels) of the large collectives' kernels, 1..=1024: each owns a region \
              of every round",
        kind: KnobKind::Positive,
        parse: |c, v| {
            let n = parse_usize(v)?;
            if !(1..=1024).contains(&n) {
                return Err("expected 1 to 1024 blocks".into());
            }
            c.coll_large_blocks = n;
            Ok(())
        },
        show: |c| c.coll_large_blocks.to_string(),
    },
    Knob {
        name: "GSC_COLL_LARGE_THREADS",
        default: "auto",
        doc: "Threads per block of the large collectives' kernels: whole warps, 64..=1024 \
              (phased: at most 768, pipelined: at most 512, by their registers); auto: 512 \
              for both",
        kind: KnobKind::AutoCount,
        parse: |c, v| {
            if v.trim().eq_ignore_ascii_case("auto") {
                c.coll_large_threads = None;
                return Ok(());
            }
            let n = parse_usize(v).map_err(|_| "expected auto or a number of threads".to_string())?;
            if !(64..=1024).contains(&n) || !n.is_multiple_of(32) {
                return Err("expected auto or whole warps (a multiple of 32) from 64 to 1024".into());
            }
            c.coll_large_threads = Some(n);
            Ok(())
        },
        show: |c| c.coll_large_threads.map_or("auto".to_string(), |n| n.to_string()),
    },
    Knob {
        name: "GSC_COLL_LARGE_STAGES",
        default: "4",
        doc: "Rounds the pipelined kernel has in flight, 2..=8: its rounds are 2 x \
              GSC_COLL_LARGE_ROUND / stages bytes per rank (the workspace's four areas cut \
              into stages of \"in\" and \"out\")",
        kind: KnobKind::Positive,
        parse: |c, v| {
            let n = parse_usize(v)?;
            if !(2..=8).contains(&n) {
                return Err("expected 2 to 8 stages".into());
            }
            c.coll_large_stages = n;
            Ok(())
        },
        show: |c| c.coll_large_stages.to_string(),
    },
    Knob {
        name: "GSC_COLL_LARGE_WARPS",
        default: "auto",
        doc: "How the pipelined kernel splits a block's warps between its roles, as shares \
              push:reduce:copy (each 0..=32, push not 0); a collective without reducers \
              (all-gather) or copiers (reduce-scatter) shares among the others. auto: 3:3:2 \
              all-reduce, 5:3:0 reduce-scatter, 5:0:3 all-gather",
        kind: KnobKind::RoleShares,
        parse: |c, v| {
            c.coll_large_warps = parse_role_shares(v)?;
            Ok(())
        },
        show: |c| c.coll_large_warps.map_or("auto".to_string(), |[p, r, k]| format!("{p}:{r}:{k}")),
    },
    Knob {
        name: "GSC_CUDA_COPY_STREAMS",
        default: "1",
        doc: "Copy streams per GPU that one large GPU read is spread over (1..=16); on H200 \
              more streams did not move data faster and cost enqueue time, hence 1",
        kind: KnobKind::Positive,
        parse: |c, v| {
            let n = parse_usize(v)?;
            if !(1..=16).contains(&n) {
                return Err("expected 1 to 16 streams".into());
            }
            c.cuda_copy_streams = n;
            Ok(())
        },
        show: |c| c.cuda_copy_streams.to_string(),
    },
    Knob {
        name: "GSC_CUDA_COPY_SPLIT",
        default: "8M",
        doc: "Smallest piece a GPU read is split into over the copy streams; reads under twice \
              this size go whole on one stream",
        kind: KnobKind::Size,
        parse: |c, v| {
            let n = parse_usize(v)?;
            if n == 0 {
                return Err("expected a size greater than zero".into());
            }
            c.cuda_copy_split = n;
            Ok(())
        },
        show: |c| format_size(c.cuda_copy_split as u64),
    },
    Knob {
        name: "GSC_CUDA_PIPELINE_CHUNK",
        default: "4M",
        doc: "Chunk of the host-staging pipeline for GPU data on lanes that cannot reach GPU \
              memory (UCX; shm with GSC_CUDA_IPC=off): bytes copied to or from page-locked \
              memory by one copy-engine transfer (64K to 256M)",
        kind: KnobKind::Size,
        parse: |c, v| {
            let n = parse_usize(v)?;
            if !(64 << 10..=256 << 20).contains(&n) {
                return Err("expected a size from 64K to 256M".into());
            }
            c.cuda_pipeline_chunk = n;
            Ok(())
        },
        show: |c| format_size(c.cuda_pipeline_chunk as u64),
    },
    Knob {
        name: "GSC_CUDA_PIPELINE_DEPTH",
        default: "4",
        doc: "Chunks of the host-staging pipeline one link stages ahead of the frame it sends \
              (1..=64): the copy of the next chunks overlaps the transfer of this one",
        kind: KnobKind::Positive,
        parse: |c, v| {
            let n = parse_usize(v)?;
            if !(1..=64).contains(&n) {
                return Err("expected 1 to 64 chunks".into());
            }
            c.cuda_pipeline_depth = n;
            Ok(())
        },
        show: |c| c.cuda_pipeline_depth.to_string(),
    },
    Knob {
        name: "GSC_CUDA_STAGE_MAX",
        default: "4K",
        doc: "GPU messages up to this size on stream and graph conditions go through page-locked \
              slots copied by gscomm's trigger and wait kernels instead of the copy engine; 0: \
              never (at most 64K)",
        kind: KnobKind::Size,
        parse: |c, v| {
            let n = parse_usize(v)?;
            if n > crate::config::CUDA_STAGE_LIMIT {
                return Err(format!("at most {} (the largest staging slot)", format_size(crate::config::CUDA_STAGE_LIMIT as u64)));
            }
            c.cuda_stage_max = n;
            Ok(())
        },
        show: |c| format_size(c.cuda_stage_max as u64),
    },
    Knob {
        name: "GSC_FLUSH_RDMA_WRITE",
        default: "off",
        doc: "When a NIC writes into GPU memory, the receiver's flush is an RDMA read from GPU \
              memory into a host buffer; with 1 (on), an RDMA write from the host buffer into a \
              GPU buffer precedes that read",
        kind: KnobKind::Bool,
        parse: |c, v| {
            c.flush_rdma_write = parse_bool(v)?;
            Ok(())
        },
        show: |c| show_bool(c.flush_rdma_write),
    },
    Knob {
        name: "GSC_TIMEOUT",
        default: "60s",
        doc: "Bound on every blocking wait; inf: wait forever",
        kind: KnobKind::DurationOrInf,
        parse: |c, v| {
            c.timeout = duration_or_inf(v)?;
            Ok(())
        },
        show: |c| c.timeout.map(format_duration).unwrap_or_else(|| "inf".to_string()),
    },
    // Why 10 s: a peer's proxy thread beats every tenth of its own timeout (at most every
    // second), so a live process misses this only if none of its threads that beat gets the
    // worker for ten whole seconds. CPU throttling (cgroup quotas: 100 ms periods), page
    // reclaim and an overloaded run queue stall threads for milliseconds to a second or two,
    // not ten; yet 10 s still finds a stopped peer six times sooner than GSC_TIMEOUT's 60 s.
    Knob {
        name: "GSC_HEARTBEAT_TIMEOUT",
        default: "10s",
        doc: "A shm peer whose proxy thread promised a heartbeat and stayed silent this long \
              (stopped, hung, starved) fails its link with TIMED_OUT, well before GSC_TIMEOUT. \
              A peer without a proxy thread promises none and is never judged by it. inf: \
              neither promise a heartbeat nor judge peers by theirs (e.g. while debugging)",
        kind: KnobKind::DurationOrInf,
        parse: |c, v| {
            c.heartbeat_timeout = duration_or_inf(v)?;
            Ok(())
        },
        show: |c| c.heartbeat_timeout.map(format_duration).unwrap_or_else(|| "inf".to_string()),
    },
    Knob {
        name: "GSC_PEER_CHECK_INTERVAL",
        default: "100ms",
        doc: "How often links check that their peer is still alive",
        kind: KnobKind::Duration,
        parse: |c, v| {
            c.peer_check_interval = positive_duration(v)?;
            Ok(())
        },
        show: |c| format_duration(c.peer_check_interval),
    },
    Knob {
        name: "GSC_PROXY_SPIN",
        default: "100ms",
        doc: "How long the proxy spins on graph/kernel triggers after the last activity before polling",
        kind: KnobKind::Duration,
        parse: |c, v| {
            c.proxy_spin = positive_duration(v)?;
            Ok(())
        },
        show: |c| format_duration(c.proxy_spin),
    },
    Knob {
        name: "GSC_PROXY_THREAD",
        default: "on",
        doc: "Watch conditioned operations' triggers on a proxy thread per worker (on), or only \
              inside the application's calls that progress the worker (off: gsc_worker_progress, \
              request waits), for callers that drive progress themselves. Off, a GPU \
              stream waiting on such an operation waits until the host progresses the worker",
        kind: KnobKind::Bool,
        parse: |c, v| {
            c.proxy_thread = parse_bool(v)?;
            Ok(())
        },
        show: |c| show_bool(c.proxy_thread),
    },
    Knob {
        name: "GSC_PROXY_POLL",
        default: "50us",
        doc: "Polling period of an idle proxy that has graph/kernel triggers armed",
        kind: KnobKind::Duration,
        parse: |c, v| {
            c.proxy_poll = positive_duration(v)?;
            Ok(())
        },
        show: |c| format_duration(c.proxy_poll),
    },
    Knob {
        name: "GSC_KERNEL_CACHE_DIR",
        default: "",
        doc: "Directory for compiled kernels (empty: $XDG_CACHE_HOME or ~/.cache, under gscomm/kernels)",
        kind: KnobKind::Path,
        parse: |c, v| {
            let v = v.trim();
            if v.is_empty() {
                c.kernel_cache_dir = None;
                return Ok(());
            }
            let path = PathBuf::from(v);
            if !path.is_absolute() {
                return Err("expected an absolute directory, or nothing for the default".to_string());
            }
            c.kernel_cache_dir = Some(path);
            Ok(())
        },
        show: |c| c.kernel_cache_dir.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
    },
    Knob {
        name: "GSC_CONNECT_TIMEOUT",
        default: "10s",
        doc: "Time allowed to establish a link to a peer",
        kind: KnobKind::Duration,
        parse: |c, v| {
            c.connect_timeout = positive_duration(v)?;
            Ok(())
        },
        show: |c| format_duration(c.connect_timeout),
    },
    Knob {
        name: "GSC_BOOTSTRAP_ADDR",
        default: "",
        doc: "host:port of the bootstrap root",
        kind: KnobKind::HostPort,
        parse: |c, v| {
            let addr = optional_text(v);
            if let Some(addr) = &addr {
                check_host_port(addr)?;
            }
            c.bootstrap_addr = addr;
            Ok(())
        },
        show: |c| show_optional(&c.bootstrap_addr),
    },
    Knob {
        name: "GSC_BOOTSTRAP_SECRET",
        default: "",
        doc: "Shared secret that authenticates bootstrap peers (never printed)",
        kind: KnobKind::Secret,
        parse: |c, v| {
            // The placeholders `get`/`dump` print: a dump pasted back into the environment
            // must fail loudly, not make "<set>" the secret and fail authentication later.
            if v == SECRET_SET || v == SECRET_UNSET {
                return Err(format!(
                    "{v} is the placeholder printed instead of the secret; set the secret \
                     itself, or leave the variable empty"
                ));
            }
            // Not trimmed: the secret is compared byte for byte with the peers' copy.
            c.bootstrap_secret = (!v.is_empty()).then(|| v.to_string());
            Ok(())
        },
        show: |c| if c.bootstrap_secret.is_some() { SECRET_SET } else { SECRET_UNSET }.to_string(),
    },
    Knob {
        name: "GSC_UNIQUE_ID",
        default: "",
        doc: "Job identifier shared by all ranks of one bootstrap",
        kind: KnobKind::Text,
        parse: |c, v| {
            c.unique_id = optional_text(v);
            Ok(())
        },
        show: |c| show_optional(&c.unique_id),
    },
    Knob {
        name: "GSC_BOOTSTRAP_TIMEOUT",
        default: "60s",
        doc: "Time allowed for all ranks to join the bootstrap",
        kind: KnobKind::Duration,
        parse: |c, v| {
            c.bootstrap_timeout = positive_duration(v)?;
            Ok(())
        },
        show: |c| format_duration(c.bootstrap_timeout),
    },
    Knob {
        name: "GSC_RANK",
        default: "",
        doc: "This process's rank in the job, from 0 (< GSC_NRANKS)",
        kind: KnobKind::Count,
        parse: |c, v| {
            c.rank = optional_count(v)?;
            Ok(())
        },
        show: |c| show_count(c.rank),
    },
    Knob {
        name: "GSC_NRANKS",
        default: "",
        doc: "Number of ranks in the job",
        kind: KnobKind::Count,
        parse: |c, v| {
            let n = optional_count(v)?;
            if n == Some(0) {
                return Err("must be at least 1".to_string());
            }
            c.nranks = n;
            Ok(())
        },
        show: |c| show_count(c.nranks),
    },
];
