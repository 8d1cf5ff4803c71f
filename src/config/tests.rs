use std::path::PathBuf;
use std::time::Duration;

use super::parse::{edit_distance, format_duration, format_size, parse_duration, parse_size, suggest};
use super::*;

fn load(pairs: &[(&str, &str)]) -> Result<ConfigLoad> {
    Config::from_pairs(pairs.iter().copied())
}

fn with(pairs: &[(&str, &str)]) -> Config {
    load(pairs).unwrap_or_else(|e| panic!("{pairs:?}: {e:?}")).config
}

/// Assert that `name=value` is refused with InvalidConfig and a message naming the variable,
/// the value and `expected`.
fn rejects(name: &str, value: &str, expected: &str) {
    let err = load(&[(name, value)]).expect_err(&format!("{name}={value:?} was accepted"));
    assert_eq!(err.status(), Status::InvalidConfig, "{err:?}");
    let msg = err.message();
    assert!(msg.contains(name), "{msg}");
    assert!(msg.contains(&format!("{value:?}")), "{msg}");
    assert!(msg.contains(expected), "{msg}");
}

#[test]
fn every_default_parses_to_the_default_config() {
    let mut config = Config::default();
    for knob in Config::knobs() {
        config.set(knob.name, knob.default).unwrap_or_else(|e| panic!("{}: {e:?}", knob.name));
        if knob.kind != KnobKind::Secret {
            assert_eq!(config.get(knob.name).unwrap(), knob.default, "{} round trip", knob.name);
        }
    }
    assert_eq!(config, Config::default());
    let pairs: Vec<(&str, &str)> = Config::knobs().iter().map(|k| (k.name, k.default)).collect();
    assert_eq!(with(&pairs), Config::default());
    assert_eq!(with(&[]), Config::default());
    Config::default().validate().unwrap();
}

#[test]
fn table_is_well_formed() {
    let knobs = Config::knobs();
    for (i, k) in knobs.iter().enumerate() {
        assert!(k.name.starts_with("GSC_"), "{}", k.name);
        assert!(k.name.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_'));
        assert!(!k.doc.is_empty() && !k.doc.contains('\n'), "{}", k.name);
        assert!(!k.kind.syntax().is_empty());
        assert!(knobs[..i].iter().all(|o| o.name != k.name), "duplicate {}", k.name);
    }
    let dump = Config::default().dump();
    let names: Vec<_> = dump.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, knobs.iter().map(|k| k.name).collect::<Vec<_>>());
}

#[test]
fn sizes() {
    for (text, v) in [
        ("4096", 4096),
        ("0", 0),
        ("64K", 64 << 10),
        ("64k", 64 << 10),
        ("64KB", 64 << 10),
        ("64KiB", 64 << 10),
        ("64kib", 64 << 10),
        ("4M", 4 << 20),
        ("1G", 1 << 30),
        ("2T", 2 << 40),
        (" 8192 ", 8192),
        ("512B", 512),
    ] {
        assert_eq!(parse_size(text), Ok(v), "{text}");
    }
    for bad in ["", "inf", "12Q", "K", "-1", "1.5K", "64 KiBs", "0x10", "99999999999999999999", "16777216T"] {
        assert!(parse_size(bad).is_err(), "{bad:?} accepted");
    }
    assert_eq!(format_size(16 << 10), "16K");
    assert_eq!(format_size(128), "128");
    assert_eq!(format_size(3 << 19), "1536K");
    assert_eq!(format_size(0), "0");

    assert_eq!(with(&[("GSC_EAGER_SHORT_MAX", "1K")]).eager_short_max, 1024);
    assert_eq!(with(&[("GSC_RNDV_FRAG_SIZE", "1m")]).rndv_frag_size, 1 << 20);
    rejects("GSC_RNDV_THRESH", "12Q", "expected a size such as 8192, 64K or 4M");
    rejects("GSC_EAGER_SHORT_MAX", "inf", "expected a size");
    rejects("GSC_RNDV_FRAG_SIZE", "0", "greater than zero");
    let err = load(&[("GSC_RNDV_THRESH", "12Q")]).unwrap_err();
    assert_eq!(err.message(), "GSC_RNDV_THRESH=\"12Q\": expected a size such as 8192, 64K or 4M");
}

#[test]
fn durations() {
    for (text, d) in [
        ("10s", Duration::from_secs(10)),
        ("100ms", Duration::from_millis(100)),
        ("250us", Duration::from_micros(250)),
        ("5ns", Duration::from_nanos(5)),
        ("2m", Duration::from_secs(120)),
        ("1h", Duration::from_secs(3600)),
        ("7", Duration::from_secs(7)),
        ("1.5s", Duration::from_millis(1500)),
        (".5", Duration::from_millis(500)),
        ("10 MS", Duration::from_millis(10)),
    ] {
        assert_eq!(parse_duration(text), Ok(d), "{text}");
    }
    for bad in [
        "",
        "inf",
        "s",
        "10x",
        "-1s",
        "1.2.3s",
        ".",
        "1e3",
        "99999999999h",
        // The integer part fits at the unit's scale; the fraction pushes it past u128.
        "94522879700260684295381835.999999999h",
    ] {
        assert!(parse_duration(bad).is_err(), "{bad:?} accepted");
    }
    assert_eq!(format_duration(Duration::from_secs(120)), "120s");
    assert_eq!(format_duration(Duration::from_micros(1500)), "1500us");
    assert_eq!(format_duration(Duration::from_nanos(7)), "7ns");

    let c = with(&[("GSC_TIMEOUT", "inf"), ("GSC_PEER_CHECK_INTERVAL", "250us")]);
    assert_eq!(c.timeout, None);
    assert_eq!(c.get("GSC_TIMEOUT").unwrap(), "inf");
    assert_eq!(c.peer_check_interval, Duration::from_micros(250));
    assert_eq!(with(&[("GSC_TIMEOUT", "INF")]).timeout, None);
    assert_eq!(with(&[("GSC_TIMEOUT", "2m")]).timeout, Some(Duration::from_secs(120)));
    assert_eq!(with(&[("GSC_CONNECT_TIMEOUT", "3")]).connect_timeout, Duration::from_secs(3));
    // inf only where the field is optional.
    rejects("GSC_CONNECT_TIMEOUT", "inf", "expected a duration such as 10s");
    rejects("GSC_BOOTSTRAP_TIMEOUT", "soon", "expected a duration");
    rejects("GSC_TIMEOUT", "10 parsecs", "or inf");
    rejects("GSC_TIMEOUT", "0", "greater than zero");
    rejects("GSC_PEER_CHECK_INTERVAL", "0ms", "greater than zero");
}

#[test]
fn enums_and_tristates() {
    assert_eq!(with(&[("GSC_LOG_LEVEL", "DEBUG")]).log_level, LogLevel::Debug);
    assert_eq!(with(&[("GSC_LOG_LEVEL", "warning")]).log_level, LogLevel::Warn);
    assert_eq!(with(&[("GSC_RNDV_SCHEME", "Pipeline")]).rndv_scheme, RndvScheme::Pipeline);
    assert_eq!(with(&[("GSC_RNDV_SCHEME", "get")]).rndv_scheme, RndvScheme::Get);
    rejects("GSC_LOG_LEVEL", "loud", "expected one of error, warn, info, debug, trace");
    rejects("GSC_RNDV_SCHEME", "put", "expected one of auto, get, pipeline");

    for (text, t) in [
        ("auto", Tristate::Auto),
        ("ON", Tristate::On),
        ("yes", Tristate::On),
        ("y", Tristate::On),
        ("true", Tristate::On),
        ("1", Tristate::On),
        ("off", Tristate::Off),
        ("No", Tristate::Off),
        ("n", Tristate::Off),
        ("false", Tristate::Off),
        ("0", Tristate::Off),
    ] {
        assert_eq!(with(&[("GSC_CMA", text)]).cma, t, "{text}");
    }
    rejects("GSC_CMA", "maybe", "expected auto, on/yes/y/true/1 or off/no/n/false/0");
    assert_eq!(with(&[("GSC_CMA", "yes")]).get("GSC_CMA").unwrap(), "on");
}

#[test]
fn booleans() {
    assert!(!Config::default().flush_rdma_write);
    for (text, on) in [
        ("1", true),
        ("on", true),
        ("Yes", true),
        ("y", true),
        ("TRUE", true),
        (" 1 ", true),
        ("0", false),
        ("off", false),
        ("no", false),
        ("N", false),
        ("false", false),
        // Empty is how a shell clears an inherited value: the default, off.
        ("", false),
    ] {
        assert_eq!(with(&[("GSC_FLUSH_RDMA_WRITE", text)]).flush_rdma_write, on, "{text:?}");
    }
    let c = with(&[("GSC_FLUSH_RDMA_WRITE", "yes")]);
    assert_eq!(c.get("GSC_FLUSH_RDMA_WRITE").unwrap(), "on");
    assert_eq!(Config::default().get("GSC_FLUSH_RDMA_WRITE").unwrap(), "off");
    // A known knob now, not an unknown GSC_* variable.
    assert!(load(&[("GSC_FLUSH_RDMA_WRITE", "1")]).unwrap().unknown.is_empty());
    // No auto: nothing would detect whether the platform needs the write.
    for bad in ["2", "auto", "maybe", "on,off"] {
        rejects("GSC_FLUSH_RDMA_WRITE", bad, "expected on/yes/y/true/1 or off/no/n/false/0");
    }
    let err = load(&[("GSC_FLUSH_RDMA_WRITE", "2")]).unwrap_err();
    assert_eq!(err.message(), "GSC_FLUSH_RDMA_WRITE=\"2\": expected on/yes/y/true/1 or off/no/n/false/0");
    let mut c = Config::default();
    assert_eq!(c.set("GSC_FLUSH_RDMA_WRITE", "auto").unwrap_err().status(), Status::InvalidConfig);
    assert_eq!(c, Config::default());
}

#[test]
fn lane_selection() {
    assert_eq!(with(&[("GSC_TLS", "all")]).tls, LaneKind::ALL.to_vec());
    assert_eq!(with(&[("GSC_TLS", "shm")]).tls, vec![LaneKind::Shm]);
    // Stored in LaneKind::ALL order, duplicates dropped, case ignored.
    assert_eq!(with(&[("GSC_TLS", "SHM, loopback,shm")]).tls, vec![LaneKind::Loopback, LaneKind::Shm]);
    let c = with(&[("GSC_TLS", "^shm")]);
    assert_eq!(c.tls, vec![LaneKind::Loopback, LaneKind::Ucx]);
    assert_eq!(c.get("GSC_TLS").unwrap(), "loopback,ucx");
    assert_eq!(with(&[("GSC_TLS", "^loopback,ucx")]).tls, vec![LaneKind::Shm]);
    assert_eq!(with(&[("GSC_TLS", "ucx")]).tls, vec![LaneKind::Ucx]);
    assert_eq!(with(&[("GSC_TLS", "loopback,shm")]).get("GSC_TLS").unwrap(), "loopback,shm");
    assert_eq!(with(&[("GSC_TLS", "ucx,loopback,shm")]).get("GSC_TLS").unwrap(), "all");

    rejects("GSC_TLS", "shm,ib", "unknown lane \"ib\"");
    rejects("GSC_TLS", "^ib", "unknown lane \"ib\"");
    rejects("GSC_TLS", "^loopback,shm,ucx", "selects no lanes");
    rejects("GSC_TLS", "", "comma-separated list of lanes");
    rejects("GSC_TLS", "shm,,loopback", "comma-separated list of lanes");
}

#[test]
fn subsystem_selection() {
    assert_eq!(with(&[("GSC_LOG_SUBSYS", "all")]).log_subsys, Subsys::ALL.to_vec());
    assert_eq!(with(&[("GSC_LOG_SUBSYS", "bootstrap,shm")]).log_subsys, vec![Subsys::Shm, Subsys::Bootstrap]);
    let c = with(&[("GSC_LOG_SUBSYS", "^bench,capi")]);
    assert_eq!(c.log_subsys.len(), Subsys::ALL.len() - 2);
    assert!(!c.log_subsys.contains(&Subsys::Bench) && !c.log_subsys.contains(&Subsys::Capi));
    assert_eq!(with(&[("GSC_LOG_SUBSYS", "gda")]).log_subsys, vec![Subsys::Gda]);
    assert!(!with(&[("GSC_LOG_SUBSYS", "^gda")]).log_subsys.contains(&Subsys::Gda));
    assert_eq!(Subsys::Gda.target(), "gsc::gda");
    assert_eq!(with(&[("GSC_LOG_SUBSYS", "ucx")]).log_subsys, vec![Subsys::Ucx]);
    assert_eq!(Subsys::Ucx.target(), "gsc::ucx");
    assert_eq!(with(&[("GSC_LOG_SUBSYS", "coll")]).log_subsys, vec![Subsys::Coll]);
    assert_eq!(Subsys::Coll.target(), "gsc::coll");
    rejects("GSC_LOG_SUBSYS", "shm,nvlink", "unknown subsystem \"nvlink\"");
}

#[test]
fn text_knobs() {
    let c = with(&[
        ("GSC_SHM_DIR", "/tmp/gsc"),
        ("GSC_LOG_FILE", "/tmp/gsc.%h.%p.log"),
        ("GSC_BOOTSTRAP_ADDR", "node01:5000"),
        ("GSC_BOOTSTRAP_SECRET", "hunter2"),
        ("GSC_UNIQUE_ID", "job-42"),
        ("GSC_RANK", "3"),
        ("GSC_NRANKS", "4"),
    ]);
    assert_eq!(c.shm_dir, PathBuf::from("/tmp/gsc"));
    assert_eq!(c.log_file.as_deref(), Some("/tmp/gsc.%h.%p.log"));
    assert_eq!(c.bootstrap_addr.as_deref(), Some("node01:5000"));
    assert_eq!(c.bootstrap_secret.as_deref(), Some("hunter2"));
    assert_eq!(c.unique_id.as_deref(), Some("job-42"));
    assert_eq!((c.rank, c.nranks), (Some(3), Some(4)));

    for addr in ["10.0.0.1:1", "[::1]:65535", "[fe80::1%eth0]:5000"] {
        assert_eq!(with(&[("GSC_BOOTSTRAP_ADDR", addr)]).bootstrap_addr.as_deref(), Some(addr));
    }
    for bad in ["node01", "node01:", ":5000", "node01:0", "node01:65536", "::1:5000", "[]:5", "a b:5"] {
        rejects("GSC_BOOTSTRAP_ADDR", bad, "expected host:port");
    }
    // Empty means unset: how a shell clears an inherited variable.
    assert_eq!(with(&[("GSC_BOOTSTRAP_ADDR", "")]).bootstrap_addr, None);
    assert_eq!(with(&[("GSC_LOG_FILE", "")]).log_file, None);
    assert_eq!(with(&[("GSC_RANK", "")]).rank, None);

    rejects("GSC_SHM_DIR", "shm", "absolute");
    rejects("GSC_LOG_FILE", "/tmp/%d.log", "unknown \"%d\"");
    rejects("GSC_RANK", "-1", "non-negative integer");
    rejects("GSC_RANK", "4294967296", "at most 4294967295");
    rejects("GSC_NRANKS", "0", "at least 1");
}

#[test]
fn secret_is_never_shown() {
    let c = with(&[("GSC_BOOTSTRAP_SECRET", "hunter2")]);
    assert_eq!(c.get("GSC_BOOTSTRAP_SECRET").unwrap(), "<set>");
    assert_eq!(Config::default().get("GSC_BOOTSTRAP_SECRET").unwrap(), "<unset>");
    let dump = format!("{:?} {:?}", c.dump(), c);
    assert!(!dump.contains("hunter2"), "{dump}");
    assert!(dump.contains("<set>"), "{dump}");
    // A dump pasted back is refused instead of making the placeholder the secret.
    let err = load(&[("GSC_BOOTSTRAP_SECRET", "<set>")]).unwrap_err();
    assert!(err.message().contains("placeholder"), "{err:?}");
    assert!(load(&[("GSC_BOOTSTRAP_SECRET", "<unset>")]).is_err());
    // Not even in an error triggered by a later bad value of another knob.
    let err = load(&[("GSC_BOOTSTRAP_SECRET", "hunter2"), ("GSC_TLS", "x")]).unwrap_err();
    assert!(!err.message().contains("hunter2"));
}

#[test]
fn cross_field_rules() {
    let err = load(&[("GSC_EAGER_SHORT_MAX", "64K")]).unwrap_err();
    assert_eq!(err.status(), Status::InvalidConfig);
    assert_eq!(err.message(), "GSC_RNDV_THRESH=64K must be greater than GSC_EAGER_SHORT_MAX=64K");
    // Checked after all values are read, so the order of the pairs does not matter.
    let c = with(&[("GSC_EAGER_SHORT_MAX", "64K"), ("GSC_RNDV_THRESH", "128K")]);
    assert_eq!((c.eager_short_max, c.rndv_thresh), (64 << 10, 128 << 10));
    let c = with(&[("GSC_RNDV_THRESH", "128K"), ("GSC_EAGER_SHORT_MAX", "64K")]);
    assert_eq!((c.eager_short_max, c.rndv_thresh), (64 << 10, 128 << 10));

    let err = load(&[("GSC_SHM_RING_SIZE", "128K")]).unwrap_err();
    assert!(err.message().contains("GSC_SHM_MAX_FRAME=64K"), "{err:?}");
    assert!(err.message().contains("GSC_SHM_RING_SIZE=128K"), "{err:?}");
    let c = with(&[("GSC_SHM_RING_SIZE", "256K")]);
    assert_eq!(c.shm_ring_size, 256 << 10);
    let c = with(&[("GSC_SHM_RING_SIZE", "64K"), ("GSC_SHM_MAX_FRAME", "16K")]);
    assert_eq!((c.shm_ring_size, c.shm_max_frame), (64 << 10, 16 << 10));
    rejects("GSC_SHM_RING_SIZE", "3M", "power of two of at least 64K");
    rejects("GSC_SHM_RING_SIZE", "32K", "power of two of at least 64K");
    rejects("GSC_SHM_MAX_FRAME", "0", "greater than zero");

    let err = load(&[("GSC_RANK", "4"), ("GSC_NRANKS", "4")]).unwrap_err();
    assert_eq!(err.message(), "GSC_RANK=4 must be less than GSC_NRANKS=4");
    // Either alone is fine: the bootstrap may supply the other.
    assert_eq!(with(&[("GSC_RANK", "7")]).rank, Some(7));
}

#[test]
fn validate_catches_direct_field_changes() {
    let mut c = Config::default();
    c.tls.clear();
    assert!(c.validate().unwrap_err().message().contains("GSC_TLS"));
    let c = Config { shm_ring_size: 100_000, ..Config::default() };
    assert!(c.validate().unwrap_err().message().contains("GSC_SHM_RING_SIZE"));
    let c = Config { connect_timeout: Duration::ZERO, ..Config::default() };
    assert!(c.validate().unwrap_err().message().contains("GSC_CONNECT_TIMEOUT"));
    let c = Config { rndv_thresh: 1, ..Config::default() };
    assert!(c.validate().unwrap_err().message().contains("GSC_EAGER_SHORT_MAX"));
}

#[test]
fn all_bad_values_are_reported_together() {
    let err = load(&[("GSC_TLS", "ib"), ("GSC_CMA", "perhaps")]).unwrap_err();
    let msg = err.message();
    assert!(msg.contains("GSC_TLS=\"ib\"") && msg.contains("GSC_CMA=\"perhaps\""), "{msg}");
}

#[test]
fn unknown_variables_are_reported_with_suggestions() {
    let load = load(&[
        ("GSC_RNDV_THRES", "8K"),
        ("GSC_FOO", "1"),
        ("GSC_Log_Level", "debug"),
        ("GSC_TL", "shm"),
        ("GSC_FOO", "2"),
        ("PATH", "/usr/bin"),
        ("gsc_tls", "shm"),
        // The test harness's and gsc-bench's switches are not knobs and not typos of one.
        ("GSC_TEST_GPU", "1"),
        ("GSC_TEST_CHILD", "peer"),
        ("GSC_BENCH_HOST_TIME", "1"),
    ])
    .unwrap();
    assert_eq!(
        load.unknown,
        vec![
            ("GSC_FOO".to_string(), None),
            ("GSC_Log_Level".to_string(), Some("GSC_LOG_LEVEL")),
            ("GSC_RNDV_THRES".to_string(), Some("GSC_RNDV_THRESH")),
            ("GSC_TL".to_string(), Some("GSC_TLS")),
        ]
    );
    // Unknown variables change nothing.
    assert_eq!(load.config, Config::default());
}

#[test]
fn unknown_variables_are_logged_under_config_target() {
    let load = load(&[("GSC_RNDV_THRES", "8K")]).unwrap();
    let text = crate::log::capture_warnings(|| load.warn_unknown());
    assert!(text.contains("gsc::config"), "{text}");
    assert!(text.contains("GSC_RNDV_THRES; did you mean GSC_RNDV_THRESH?"), "{text}");
}

#[test]
fn suggestions() {
    let names = ["GSC_TLS", "GSC_TIMEOUT", "GSC_SHM_DIR"];
    assert_eq!(suggest("GSC_TIMOUT", &names), Some("GSC_TIMEOUT"));
    assert_eq!(suggest("GSC_SHMDIR", &names), Some("GSC_SHM_DIR"));
    assert_eq!(suggest("GSC_XYZ", &names), None);
    assert_eq!(suggest("GSC_", &names), None);
    assert_eq!(edit_distance("kitten", "sitting"), 3);
    assert_eq!(edit_distance("", "abc"), 3);
}

#[test]
fn set_and_get() {
    let mut c = Config::default();
    c.set("GSC_RNDV_THRESH", "32K").unwrap();
    assert_eq!(c.rndv_thresh, 32 << 10);
    // API names: prefix optional, case ignored.
    c.set("rndv_scheme", "get").unwrap();
    assert_eq!(c.get("RNDV_SCHEME").unwrap(), "get");
    assert_eq!(c.get("gsc_rndv_thresh").unwrap(), "32K");
    for (name, value) in c.dump() {
        if name != "GSC_BOOTSTRAP_SECRET" {
            let mut d = Config::default();
            d.set(name, &value).unwrap();
            assert_eq!(d.get(name).unwrap(), value, "{name}");
        }
    }
    let err = c.get("GSC_RNDV_THRES").unwrap_err();
    assert_eq!(err.status(), Status::InvalidConfig);
    assert!(err.message().contains("did you mean GSC_RNDV_THRESH?"), "{err:?}");
}

#[test]
fn set_on_error_changes_nothing() {
    let mut c = with(&[("GSC_TLS", "shm"), ("GSC_RNDV_THRESH", "32K")]);
    let before = c.clone();
    // Bad syntax.
    let err = c.set("GSC_RNDV_THRESH", "12Q").unwrap_err();
    assert_eq!(err.message(), "GSC_RNDV_THRESH=\"12Q\": expected a size such as 8192, 64K or 4M");
    assert_eq!(c, before);
    // Good syntax, but breaks a cross-knob rule.
    let err = c.set("GSC_EAGER_SHORT_MAX", "32K").unwrap_err();
    assert!(err.message().contains("GSC_EAGER_SHORT_MAX=32K"), "{err:?}");
    assert_eq!(c, before);
    let err = c.set("GSC_TLS", "^shm,loopback,ucx").unwrap_err();
    assert!(err.message().contains("selects no lanes"));
    assert_eq!(c, before);
    assert!(c.set("GSC_NOPE", "1").is_err());
    assert_eq!(c, before);
}

#[test]
fn from_pairs_later_values_win() {
    let c = with(&[("GSC_TLS", "shm"), ("GSC_TLS", "loopback")]);
    assert_eq!(c.tls, vec![LaneKind::Loopback]);
}

#[test]
fn cuda_stage_max_is_bounded_by_the_largest_slot() {
    assert_eq!(with(&[("GSC_CUDA_STAGE_MAX", "0")]).cuda_stage_max, 0, "0 turns staging off");
    assert_eq!(with(&[("GSC_CUDA_STAGE_MAX", "64K")]).cuda_stage_max, CUDA_STAGE_LIMIT);
    rejects("GSC_CUDA_STAGE_MAX", "65537", "at most 64K");
    rejects("GSC_CUDA_STAGE_MAX", "1M", "at most 64K");
}

#[test]
fn fake_host_labels_are_checked() {
    assert_eq!(with(&[("GSC_FAKE_HOST", "")]).fake_host, None);
    assert_eq!(with(&[("GSC_FAKE_HOST", " hostA-1.x_y ")]).fake_host.as_deref(), Some("hostA-1.x_y"));
    assert_eq!(with(&[("GSC_FAKE_HOST", &"a".repeat(64))]).fake_host.map(|l| l.len()), Some(64));
    rejects("GSC_FAKE_HOST", "two words", "A-Z a-z 0-9 . _ -");
    rejects("GSC_FAKE_HOST", "a/b", "A-Z a-z 0-9 . _ -");
    rejects("GSC_FAKE_HOST", &"a".repeat(65), "at most 64");
    let c = with(&[("GSC_FAKE_HOST", "h1")]);
    assert_eq!(c.get("GSC_FAKE_HOST").unwrap(), "h1");
}

#[test]
fn large_collective_knobs_parse_and_refuse_clearly() {
    let c = with(&[
        ("GSC_COLL_LARGE_ALGO", "Pipelined"),
        ("GSC_COLL_LARGE_BLOCKS", "256"),
        ("GSC_COLL_LARGE_THREADS", "384"),
        ("GSC_COLL_LARGE_STAGES", "3"),
        ("GSC_COLL_LARGE_WARPS", "4:3:1"),
    ]);
    assert_eq!(c.coll_large_algo, LargeAlgo::Pipelined);
    assert_eq!((c.coll_large_blocks, c.coll_large_threads, c.coll_large_stages), (256, Some(384), 3));
    assert_eq!(c.coll_large_warps, Some([4, 3, 1]));
    assert_eq!(c.get("GSC_COLL_LARGE_WARPS").unwrap(), "4:3:1");
    assert_eq!(with(&[("GSC_COLL_LARGE_THREADS", "auto"), ("GSC_COLL_LARGE_WARPS", "AUTO")]), Config::default());
    rejects("GSC_COLL_LARGE_ALGO", "ring", "expected one of phased, pipelined");
    rejects("GSC_COLL_LARGE_BLOCKS", "0", "expected 1 to 1024 blocks");
    rejects("GSC_COLL_LARGE_BLOCKS", "2048", "expected 1 to 1024 blocks");
    rejects("GSC_COLL_LARGE_THREADS", "100", "whole warps (a multiple of 32) from 64 to 1024");
    rejects("GSC_COLL_LARGE_THREADS", "2048", "whole warps");
    rejects("GSC_COLL_LARGE_THREADS", "many", "expected auto or a number of threads");
    rejects("GSC_COLL_LARGE_STAGES", "1", "expected 2 to 8 stages");
    rejects("GSC_COLL_LARGE_STAGES", "9", "expected 2 to 8 stages");
    for bad in ["3:3", "0:3:2", "3:3:33", "a:b:c", "3:3:2:1"] {
        rejects("GSC_COLL_LARGE_WARPS", bad, "push:reduce:copy shares");
    }
}
