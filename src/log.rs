//! Logging: `tracing` targets of the subsystems and the subscriber our entry points install.
//!
//! Events are logged under one target per subsystem, selected by `GSC_LOG_SUBSYS` (below
//! warning level: errors and warnings print from every subsystem) and filtered by
//! `GSC_LOG_LEVEL`. `tracing` macros need the target as a literal, so call sites write it out:
//!
//! ```ignore
//! tracing::debug!(target: "gsc::shm", ring = name, "mapped ring");
//! ```
//!
//! The constants below hold the same strings for filters, tests and tools; a test checks that
//! they match `Subsys::target` and that every subsystem has one.
//!
//! The Rust library never installs a subscriber by itself: the process, not a library, owns
//! the global subscriber. `init` is called by the C API's `gsc_init` (C programs have no other
//! way to see our logs) and by our binaries; Rust users bring their own subscriber and may
//! filter on these targets.

pub mod timeline;

use std::fs::{File, OpenOptions};
use std::io::{self, ErrorKind};
use std::path::PathBuf;
use std::sync::Mutex;

use tracing::level_filters::LevelFilter;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::writer::BoxMakeWriter;
use tracing_subscriber::layer::SubscriberExt;

use crate::config::{Config, LogLevel, Subsys};
use crate::error::{Error, Result, Status};

pub const CORE: &str = "gsc::core";
pub const PROTO: &str = "gsc::proto";
pub const SHM: &str = "gsc::shm";
pub const LOOPBACK: &str = "gsc::loopback";
pub const BOOTSTRAP: &str = "gsc::bootstrap";
pub const CONFIG: &str = "gsc::config";
pub const CAPI: &str = "gsc::capi";
pub const BENCH: &str = "gsc::bench";
pub const PROXY: &str = "gsc::proxy";
pub const CUDA: &str = "gsc::cuda";
pub const GDA: &str = "gsc::gda";
pub const UCX: &str = "gsc::ucx";
pub const COLL: &str = "gsc::coll";

/// Events logged under the crate's module paths, i.e. without an explicit `target:`. They
/// belong to no subsystem, so below warning level they are shown only when every subsystem is
/// selected rather than being lost entirely.
const CRATE_TARGET: &str = "gscomm";

pub fn level_filter(level: LogLevel) -> LevelFilter {
    match level {
        LogLevel::Error => LevelFilter::ERROR,
        LogLevel::Warn => LevelFilter::WARN,
        LogLevel::Info => LevelFilter::INFO,
        LogLevel::Debug => LevelFilter::DEBUG,
        LogLevel::Trace => LevelFilter::TRACE,
    }
}

/// The filter `init` installs: each selected subsystem's target at `GSC_LOG_LEVEL`, the others'
/// errors and warnings (as NCCL's subsystem mask leaves its warnings: they are rare, and each
/// names something the user should know; `GSC_LOG_LEVEL=error` silences them), nothing from
/// other crates (their logs are not ours to print from inside a C program).
pub fn filter(config: &Config) -> Targets {
    let level = level_filter(config.log_level);
    let unselected = level.min(LevelFilter::WARN);
    let at = |selected: bool| if selected { level } else { unselected };
    let mut targets = Targets::new();
    for subsys in Subsys::ALL {
        targets = targets.with_target(subsys.target(), at(config.log_subsys.contains(subsys)));
    }
    targets.with_target(CRATE_TARGET, at(Subsys::ALL.iter().all(|s| config.log_subsys.contains(s))))
}

/// Expand `%h` (host name), `%p` (process id) and `%%` in a `GSC_LOG_FILE` pattern. Any other
/// `%` sequence is an error, so that a future expansion cannot change the meaning of a name
/// someone already uses. `Err` says what is wrong, without the pattern (the caller names it).
pub(crate) fn expand_pattern(pattern: &str, host: &str, pid: u32) -> Result<String, String> {
    let mut out = String::with_capacity(pattern.len() + 16);
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('h') => out.push_str(host),
            Some('p') => out.push_str(&pid.to_string()),
            Some('%') => out.push('%'),
            Some(other) => {
                return Err(format!("unknown \"%{other}\" in file name; use %h (host name), %p (process id) or %%"));
            }
            None => return Err("file name ends with a lone %; write %% for a literal %".into()),
        }
    }
    Ok(out)
}

/// This host's name as `gethostname(2)` reports it.
pub fn hostname() -> Result<String> {
    // 256 covers HOST_NAME_MAX (64 on Linux) on every system we run on; the extra byte keeps
    // the buffer NUL-terminated even if the name was truncated.
    let mut buf = [0u8; 257];
    // SAFETY: the pointer and length describe `buf` minus its last byte, which stays 0.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) };
    if rc != 0 {
        return Err(Error::io("gethostname", io::Error::last_os_error()));
    }
    let len = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Ok(String::from_utf8_lossy(&buf[..len]).into_owned())
}

/// The file `GSC_LOG_FILE=pattern` names in this process.
pub fn log_file_path(pattern: &str) -> Result<PathBuf> {
    file_path(pattern, "GSC_LOG_FILE")
}

/// The file a file-pattern knob (`knob=pattern`) names in this process.
pub(crate) fn file_path(pattern: &str, knob: &str) -> Result<PathBuf> {
    // Only ask for the host name when the pattern uses it.
    let host = if pattern.contains("%h") { hostname()? } else { String::new() };
    expand_pattern(pattern, &host, std::process::id())
        .map(PathBuf::from)
        .map_err(|reason| Error::new(Status::InvalidConfig, format!("{knob}={pattern:?}: {reason}")))
}

/// Open `path` for appending; `true` when this call created it (so a failed `init` can remove
/// what it created and leave the file system as it found it).
fn open_append(path: &PathBuf) -> Result<(File, bool)> {
    let context = || format!("cannot open log file {}", path.display());
    match OpenOptions::new().append(true).create_new(true).open(path) {
        Ok(file) => Ok((file, true)),
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {
            OpenOptions::new().append(true).open(path).map(|file| (file, false)).map_err(|e| Error::io(&context(), e))
        }
        Err(e) => Err(Error::io(&context(), e)),
    }
}

/// Timestamps followed by `host:pid`: ranks of one job usually share a terminal or a file
/// collected by the launcher, and a line that does not say which process wrote it is of
/// little use there.
struct Stamp {
    host: String,
}

impl FormatTime for Stamp {
    fn format_time(&self, w: &mut Writer<'_>) -> std::fmt::Result {
        SystemTime.format_time(w)?;
        // Read per event, not cached: a forked child must not log under its parent's pid.
        write!(w, " {}:{}", self.host, std::process::id())
    }
}

/// The subscriber `init` installs, separate so tests can run it with `with_default`.
fn subscriber(config: &Config, writer: BoxMakeWriter, host: String) -> impl tracing::Subscriber + Send + Sync {
    let layer = tracing_subscriber::fmt::layer().with_writer(writer).with_ansi(false).with_target(true).with_timer(Stamp { host });
    tracing_subscriber::registry().with(layer).with(filter(config))
}

fn make_writer(config: &Config) -> Result<(BoxMakeWriter, Option<(PathBuf, bool)>)> {
    match &config.log_file {
        None => Ok((BoxMakeWriter::new(io::stderr), None)),
        Some(pattern) => {
            let path = log_file_path(pattern)?;
            let (file, created) = open_append(&path)?;
            Ok((BoxMakeWriter::new(Mutex::new(file)), Some((path, created))))
        }
    }
}

/// Install the global subscriber for `config`: `GSC_LOG_LEVEL` and `GSC_LOG_SUBSYS` select
/// events (`filter`), written to stderr or appended to `GSC_LOG_FILE` (`%h`/`%p` expanded now).
///
/// Returns `Ok(false)` and changes nothing when a global subscriber is already installed
/// (someone else's, or ours from an earlier call): the process's choice wins. An error means
/// the log file could not be opened; nothing is installed then either.
///
/// Entry points use it as
///
/// ```ignore
/// let load = Config::load_env()?;   // parse first: the filter comes from the config
/// log::init(&load.config)?;
/// load.warn_unknown();              // now the warnings about unknown GSC_* have somewhere to go
/// ```
pub fn init(config: &Config) -> Result<bool> {
    let host = hostname().unwrap_or_else(|_| "unknown-host".to_string());
    let (writer, file) = make_writer(config)?;
    let dispatch = tracing::Dispatch::new(subscriber(config, writer, host));
    if tracing::dispatcher::set_global_default(dispatch).is_ok() {
        return Ok(true);
    }
    // Lost to an existing subscriber. The file was opened before knowing (opening is what can
    // fail, and it must fail before anything is installed); undo its creation. The dispatch,
    // and with it the file handle, was consumed and dropped by the failed call.
    if let Some((path, true)) = file {
        let _ = std::fs::remove_file(path);
    }
    Ok(false)
}

/// Tests: run `f` with a subscriber that captures warnings (and worse); what was logged.
#[cfg(test)]
pub(crate) fn capture_warnings(f: impl FnOnce()) -> String {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<u8>>>);
    impl Write for Capture {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap_or_else(|e| e.into_inner()).extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let capture = Capture::default();
    let sink = capture.clone();
    let subscriber =
        tracing_subscriber::fmt().with_writer(move || sink.clone()).with_ansi(false).with_max_level(tracing::Level::WARN).finish();
    tracing::subscriber::with_default(subscriber, f);
    String::from_utf8_lossy(&capture.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use tracing::Level;

    fn temp_path(tag: &str) -> PathBuf {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        std::env::temp_dir().join(format!("gsc-log-test-{}-{tag}-{n}.log", std::process::id()))
    }

    #[test]
    fn constants_match_subsystems() {
        let consts = [CORE, PROTO, SHM, LOOPBACK, BOOTSTRAP, CONFIG, CAPI, BENCH, PROXY, CUDA, GDA, UCX, COLL];
        assert_eq!(consts.len(), Subsys::ALL.len());
        for (c, s) in consts.iter().zip(Subsys::ALL) {
            assert_eq!(*c, s.target());
            assert_eq!(*c, format!("gsc::{}", s.name()));
        }
    }

    /// Every `target: "gsc::..."` written in the sources is a subsystem's: the filter passes
    /// only subsystems' targets, so an event under any other was never printed (collectives
    /// logged under `gsc::coll` before it was one).
    #[test]
    fn every_target_in_the_sources_is_a_subsystems() {
        fn walk(dir: &std::path::Path, found: &mut Vec<(PathBuf, String)>) {
            for entry in std::fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    walk(&path, found);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let text = std::fs::read_to_string(&path).unwrap();
                    for piece in text.split("target: \"gsc::").skip(1) {
                        let name: String = piece.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                        if !name.is_empty() {
                            found.push((path.clone(), format!("gsc::{name}")));
                        }
                    }
                }
            }
        }
        let mut found = Vec::new();
        for tree in ["src", "nccl/src"] {
            walk(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(tree), &mut found);
        }
        assert!(found.len() > 100, "only {} targets found: did the sources move?", found.len());
        let targets: Vec<&str> = Subsys::ALL.iter().map(|s| s.target()).collect();
        let stray: Vec<_> = found.iter().filter(|(_, t)| !targets.contains(&t.as_str())).collect();
        assert!(stray.is_empty(), "targets that no GSC_LOG_SUBSYS selects, so never printed: {stray:?}");
    }

    #[test]
    fn filter_selects_subsystems_at_level() {
        let mut config = Config::default();
        config.set("GSC_LOG_LEVEL", "info").unwrap();
        config.set("GSC_LOG_SUBSYS", "shm,proto").unwrap();
        let f = filter(&config);
        assert!(f.would_enable(SHM, &Level::INFO));
        assert!(f.would_enable(PROTO, &Level::ERROR));
        assert!(!f.would_enable(SHM, &Level::DEBUG));
        // The others keep their errors and warnings only.
        assert!(f.would_enable(CORE, &Level::WARN));
        assert!(!f.would_enable(CORE, &Level::INFO));
        // Module-path targets belong to no subsystem: warnings only when some are selected.
        assert!(f.would_enable("gscomm::transport::shm", &Level::ERROR));
        assert!(!f.would_enable("gscomm::transport::shm", &Level::INFO));
        assert!(!f.would_enable("other_crate", &Level::ERROR));

        config.set("GSC_LOG_SUBSYS", "^shm").unwrap();
        let f = filter(&config);
        assert!(!f.would_enable(SHM, &Level::INFO));
        assert!(f.would_enable(SHM, &Level::WARN));
        assert!(f.would_enable(LOOPBACK, &Level::INFO));

        // At GSC_LOG_LEVEL=error nothing prints a warning, selected or not.
        config.set("GSC_LOG_LEVEL", "error").unwrap();
        let f = filter(&config);
        assert!(!f.would_enable(SHM, &Level::WARN) && !f.would_enable(LOOPBACK, &Level::WARN));
        assert!(f.would_enable(SHM, &Level::ERROR));

        config.set("GSC_LOG_SUBSYS", "all").unwrap();
        config.set("GSC_LOG_LEVEL", "trace").unwrap();
        let f = filter(&config);
        for s in Subsys::ALL {
            assert!(f.would_enable(s.target(), &Level::TRACE));
        }
        assert!(f.would_enable("gscomm::core::worker", &Level::TRACE));
        assert!(!f.would_enable("other_crate", &Level::ERROR));
    }

    #[test]
    fn gda_events_pass_the_default_filter_and_can_be_deselected() {
        // The verbs engine warns under gsc::gda (e.g. a flush buffer that failed to deregister);
        // the default configuration must show that.
        let f = filter(&Config::default());
        assert!(f.would_enable(GDA, &Level::WARN));
        assert!(!f.would_enable(GDA, &Level::INFO));
        let mut config = Config::default();
        config.set("GSC_LOG_SUBSYS", "gda").unwrap();
        config.set("GSC_LOG_LEVEL", "trace").unwrap();
        let f = filter(&config);
        assert!(f.would_enable(GDA, &Level::TRACE));
        assert!(!f.would_enable(CUDA, &Level::INFO));
        config.set("GSC_LOG_SUBSYS", "^gda").unwrap();
        assert!(!filter(&config).would_enable(GDA, &Level::INFO));
    }

    #[test]
    fn pattern_expansion() {
        assert_eq!(expand_pattern("/tmp/gsc.%h.%p.log", "n01", 42).unwrap(), "/tmp/gsc.n01.42.log");
        assert_eq!(expand_pattern("/tmp/100%%-%p", "n01", 7).unwrap(), "/tmp/100%-7");
        assert_eq!(expand_pattern("/tmp/plain", "n01", 7).unwrap(), "/tmp/plain");
        assert!(expand_pattern("/tmp/%d.log", "n01", 7).unwrap_err().contains("%d"));
        assert!(expand_pattern("/tmp/x%", "n01", 7).unwrap_err().contains("lone %"));

        let host = hostname().unwrap();
        assert!(!host.is_empty());
        let path = log_file_path("/tmp/gsc-%h-%p.log").unwrap();
        assert_eq!(path, PathBuf::from(format!("/tmp/gsc-{host}-{}.log", std::process::id())));
        let err = log_file_path("/tmp/%q").unwrap_err();
        assert_eq!(err.status(), Status::InvalidConfig);
        assert!(err.message().contains("GSC_LOG_FILE"), "{err:?}");
    }

    #[test]
    fn subscriber_writes_selected_events_to_file() {
        let path = temp_path("events");
        let mut config = Config::default();
        config.set("GSC_LOG_FILE", path.to_str().unwrap()).unwrap();
        config.set("GSC_LOG_LEVEL", "info").unwrap();
        config.set("GSC_LOG_SUBSYS", "shm").unwrap();
        // An existing file is appended to, not truncated.
        std::fs::write(&path, "earlier line\n").unwrap();
        let (writer, file) = make_writer(&config).unwrap();
        assert_eq!(file, Some((path.clone(), false)));
        let sub = subscriber(&config, writer, "testhost".to_string());
        tracing::subscriber::with_default(sub, || {
            tracing::info!(target: "gsc::shm", "ring mapped");
            tracing::debug!(target: "gsc::shm", "too verbose");
            tracing::info!(target: "gsc::core", "other subsystem");
            tracing::warn!(target: "gsc::core", "other subsystem's warning");
        });
        let text = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        assert!(text.starts_with("earlier line\n"), "{text}");
        assert!(text.contains("ring mapped"), "{text}");
        assert!(text.contains("gsc::shm"), "{text}");
        assert!(text.contains(&format!("testhost:{}", std::process::id())), "{text}");
        assert!(!text.contains("too verbose"), "{text}");
        assert!(!text.contains("other subsystem\n") && text.contains("other subsystem's warning"), "{text}");
    }

    #[test]
    fn init_defers_to_an_existing_global_subscriber() {
        // Whatever the first call returns (another test could install a global subscriber
        // first), a global subscriber exists after it, so the second call must back off and
        // must not leave the file it would have created behind.
        let first = temp_path("first");
        let second = temp_path("second");
        let mut config = Config::default();
        config.set("GSC_LOG_LEVEL", "error").unwrap();
        config.set("GSC_LOG_FILE", first.to_str().unwrap()).unwrap();
        let installed = init(&config).unwrap();
        assert_eq!(first.exists(), installed);
        config.set("GSC_LOG_FILE", second.to_str().unwrap()).unwrap();
        assert!(!init(&config).unwrap());
        assert!(!second.exists());
        let _ = std::fs::remove_file(&first);
    }

    #[test]
    fn init_reports_unopenable_file() {
        let mut config = Config::default();
        config.set("GSC_LOG_FILE", "/nonexistent-dir-gsc/x.log").unwrap();
        let err = init(&config).unwrap_err();
        assert_eq!(err.status(), Status::IoError);
        assert!(err.message().contains("/nonexistent-dir-gsc/x.log"), "{err:?}");
    }
}
