//! Log output for NCCL programs: gscomm's log subscriber, installed by the first call that
//! reads the configuration (a communicator init), so `GSC_LOG_*` work here as they do for the
//! C API's `gsc_init`. A program run with NVIDIA's switches gets them where gscomm's are not
//! set: `NCCL_DEBUG` (VERSION and WARN as `warn`, INFO and ABORT as `info`, TRACE as `trace`)
//! `NCCL_DEBUG_FILE` (the same `%h`/`%p` patterns) and `NCCL_DEBUG_SUBSYS` (NCCL's
//! subsystems, each standing for the gscomm subsystems `gsc_subsystems` names; `^` excludes,
//! as in NCCL; errors and warnings print from every subsystem either way).
//!
//! Without either, gscomm's default holds: warnings are printed (to stderr), where NVIDIA's
//! library prints nothing. They are rare, and each names something the user should know.

use gscomm::Config;
use gscomm::config::{ConfigLoad, LogLevel, Subsys};
use std::sync::OnceLock;

/// `GSC_LOG_LEVEL`'s value for an `NCCL_DEBUG` level; `None` for a value NCCL does not know
/// (NCCL then logs nothing).
fn level_of(nccl_debug: &str) -> Option<&'static str> {
    match nccl_debug.trim().to_ascii_uppercase().as_str() {
        "VERSION" | "WARN" => Some("warn"),
        "INFO" | "ABORT" => Some("info"),
        "TRACE" => Some("trace"),
        _ => None,
    }
}

/// NCCL's subsystems (`NCCL_DEBUG_SUBSYS`, 2.28), each with the gscomm subsystems whose
/// messages are of its kind; those with none select nothing here.
const NCCL_SUBSYSTEMS: [(&str, &[Subsys]); 16] = [
    ("INIT", &[Subsys::Core]),
    ("COLL", &[Subsys::Coll]),
    ("P2P", &[Subsys::Proto]),
    ("SHM", &[Subsys::Shm, Subsys::Loopback]),
    ("NET", &[Subsys::Ucx, Subsys::Gda]),
    ("GRAPH", &[]),
    ("TUNING", &[]),
    ("ENV", &[Subsys::Config]),
    ("ALLOC", &[Subsys::Cuda]),
    ("CALL", &[Subsys::Capi]),
    ("PROXY", &[Subsys::Proxy]),
    ("NVLS", &[]),
    ("BOOTSTRAP", &[Subsys::Bootstrap]),
    ("REG", &[]),
    ("PROFILE", &[Subsys::Bench]),
    ("RAS", &[]),
];

/// The gscomm subsystems an `NCCL_DEBUG_SUBSYS` value selects (NCCL's parse: a comma-separated
/// list, `^` before it to select every subsystem but those, `ALL` for all), and the names in it
/// NCCL does not know (NCCL ignores them).
fn gsc_subsystems(value: &str) -> (Vec<Subsys>, Vec<String>) {
    let (invert, list) = match value.trim().strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, value.trim()),
    };
    let mut named: Vec<&str> = Vec::new();
    let mut unknown = Vec::new();
    for item in list.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        match NCCL_SUBSYSTEMS.iter().find(|(n, _)| n.eq_ignore_ascii_case(item)) {
            Some((n, _)) => named.push(n),
            None if item.eq_ignore_ascii_case("ALL") => named.extend(NCCL_SUBSYSTEMS.iter().map(|(n, _)| *n)),
            None => unknown.push(item.to_string()),
        }
    }
    let on = |n: &str| named.contains(&n) != invert;
    let selected = Subsys::ALL.iter().copied().filter(|s| NCCL_SUBSYSTEMS.iter().any(|(n, subs)| on(n) && subs.contains(s))).collect();
    (selected, unknown)
}

/// `config` with NCCL's switches, read by `var`, applied where gscomm's own are not set, and
/// what could not be applied (to be logged once logging is up).
pub(crate) fn apply_nccl_switches(config: &mut Config, var: impl Fn(&str) -> Option<String>) -> Vec<String> {
    let mut problems = Vec::new();
    if var("GSC_LOG_LEVEL").is_none()
        && let Some(value) = var("NCCL_DEBUG")
    {
        match level_of(&value) {
            // A level is always valid for GSC_LOG_LEVEL.
            Some(level) => config.set("GSC_LOG_LEVEL", level).expect("a GSC_LOG_LEVEL value"),
            None => problems.push(format!(
                "NCCL_DEBUG={value:?} is not VERSION, WARN, INFO, ABORT or TRACE; the log level stays {}",
                config.log_level.name()
            )),
        }
    }
    if var("GSC_LOG_FILE").is_none()
        && let Some(pattern) = var("NCCL_DEBUG_FILE")
        && let Err(e) = config.set("GSC_LOG_FILE", &pattern)
    {
        problems.push(format!("NCCL_DEBUG_FILE: {e}; logging to stderr"));
    }
    if var("GSC_LOG_SUBSYS").is_none()
        && let Some(value) = var("NCCL_DEBUG_SUBSYS")
    {
        let (selected, unknown) = gsc_subsystems(&value);
        if !unknown.is_empty() {
            let known: Vec<&str> = NCCL_SUBSYSTEMS.iter().map(|(n, _)| *n).collect();
            problems.push(format!("NCCL_DEBUG_SUBSYS: {} not NCCL's (known: {}, ALL); ignored", unknown.join(", "), known.join(", ")));
        }
        if selected.is_empty() {
            // Nothing of gscomm's is of those kinds: what prints is what every subsystem
            // prints anyway, errors and warnings.
            config.log_level = config.log_level.min(LogLevel::Warn);
        } else {
            let names: Vec<&str> = selected.iter().map(|s| s.name()).collect();
            config.set("GSC_LOG_SUBSYS", &names.join(",")).expect("known subsystem names");
        }
    }
    problems
}

static INSTALLED: OnceLock<()> = OnceLock::new();

/// Install the subscriber from the environment where a call comes before any configuration is
/// needed (`ncclGetUniqueId`, the start of an init, as NVIDIA's library sets up its log there).
/// A bad `GSC_*` value leaves it for the call that needs the configuration, which says why.
pub(crate) fn start() {
    if INSTALLED.get().is_none()
        && let Ok(load) = Config::load_env()
    {
        install_once(&load);
    }
}

/// Install the log subscriber from `load` (once per process; later calls do nothing). A log
/// file that cannot be opened is not the init's failure: NVIDIA's library falls back to its
/// standard output, this one to stderr, with a warning.
pub(crate) fn install_once(load: &ConfigLoad) {
    INSTALLED.get_or_init(|| {
        let mut config = load.config.clone();
        let mut problems = apply_nccl_switches(&mut config, |name| std::env::var(name).ok());
        if let Err(e) = gscomm::log::init(&config) {
            problems.push(format!("{e}; logging to stderr"));
            config.log_file = None;
            let _ = gscomm::log::init(&config);
        }
        for problem in problems {
            tracing::warn!(target: "gsc::capi", "{problem}");
        }
        load.warn_unknown();
        tracing::info!(target: "gsc::capi", "gscomm {} as libnccl.so.2 (NCCL 2.28.9's API)", env!("CARGO_PKG_VERSION"));
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn applied(vars: &[(&str, &str)]) -> (Config, Vec<String>) {
        let mut config = Config::default();
        let problems = apply_nccl_switches(&mut config, |name| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string()));
        (config, problems)
    }

    #[test]
    fn nccl_debug_subsys_selects_gscomm_subsystems_where_gsc_log_subsys_is_unset() {
        let subsys = |vars: &[(&str, &str)]| applied(vars).0.log_subsys;
        let info = ("NCCL_DEBUG", "INFO");
        assert_eq!(subsys(&[info, ("NCCL_DEBUG_SUBSYS", "INIT,COLL")]), vec![Subsys::Core, Subsys::Coll]);
        assert_eq!(subsys(&[info, ("NCCL_DEBUG_SUBSYS", "coll, net")]), vec![Subsys::Gda, Subsys::Ucx, Subsys::Coll]);
        assert_eq!(subsys(&[info, ("NCCL_DEBUG_SUBSYS", "ALL")]), Subsys::ALL.to_vec());
        // ^ selects every subsystem but those, as in NCCL.
        let all_but = subsys(&[info, ("NCCL_DEBUG_SUBSYS", "^COLL,SHM")]);
        assert!(!all_but.contains(&Subsys::Coll) && !all_but.contains(&Subsys::Shm) && !all_but.contains(&Subsys::Loopback));
        assert!(all_but.contains(&Subsys::Core) && all_but.contains(&Subsys::Proto), "{all_but:?}");
        // GSC_LOG_SUBSYS wins.
        assert_eq!(subsys(&[("NCCL_DEBUG_SUBSYS", "COLL"), ("GSC_LOG_SUBSYS", "shm")]), Config::default().log_subsys);
        // Unknown names are named and ignored.
        let (config, problems) = applied(&[info, ("NCCL_DEBUG_SUBSYS", "COLL,WIBBLE")]);
        assert_eq!(config.log_subsys, vec![Subsys::Coll]);
        assert!(problems.len() == 1 && problems[0].contains("WIBBLE") && problems[0].contains("BOOTSTRAP"), "{problems:?}");
        // Kinds gscomm has no messages of: errors and warnings only, the subsystems unchanged.
        let (config, problems) = applied(&[info, ("NCCL_DEBUG_SUBSYS", "GRAPH,TUNING")]);
        assert_eq!((config.log_level, config.log_subsys), (LogLevel::Warn, Subsys::ALL.to_vec()));
        assert!(problems.is_empty(), "{problems:?}");
    }

    #[test]
    fn nccl_debug_sets_the_level_where_gsc_log_level_is_unset() {
        use gscomm::config::LogLevel;
        assert_eq!(applied(&[]).0.log_level, LogLevel::Warn);
        assert_eq!(applied(&[("NCCL_DEBUG", "INFO")]).0.log_level, LogLevel::Info);
        assert_eq!(applied(&[("NCCL_DEBUG", "trace")]).0.log_level, LogLevel::Trace);
        assert_eq!(applied(&[("NCCL_DEBUG", "VERSION")]).0.log_level, LogLevel::Warn);
        assert_eq!(applied(&[("NCCL_DEBUG", "ABORT")]).0.log_level, LogLevel::Info);
        // Where GSC_LOG_LEVEL is set, NCCL_DEBUG is not read (the config already holds
        // GSC_LOG_LEVEL's value; here, the default).
        assert_eq!(applied(&[("NCCL_DEBUG", "INFO"), ("GSC_LOG_LEVEL", "error")]).0.log_level, LogLevel::Warn);
        let (config, problems) = applied(&[("NCCL_DEBUG", "LOUD")]);
        assert_eq!(config.log_level, LogLevel::Warn);
        assert!(problems.len() == 1 && problems[0].contains("NCCL_DEBUG=\"LOUD\""), "{problems:?}");
    }

    #[test]
    fn nccl_debug_file_sets_the_file_where_gsc_log_file_is_unset() {
        assert_eq!(applied(&[("NCCL_DEBUG_FILE", "/tmp/nccl.%h.%p")]).0.log_file.as_deref(), Some("/tmp/nccl.%h.%p"));
        assert_eq!(applied(&[("NCCL_DEBUG_FILE", "/tmp/a"), ("GSC_LOG_FILE", "/tmp/b")]).0.log_file, None);
        let (config, problems) = applied(&[("NCCL_DEBUG_FILE", "/tmp/nccl.%r")]);
        assert_eq!(config.log_file, None);
        assert!(problems.len() == 1 && problems[0].contains("NCCL_DEBUG_FILE") && problems[0].contains("%r"), "{problems:?}");
    }
}
