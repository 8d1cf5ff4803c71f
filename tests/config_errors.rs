//! Bad configuration values are `InvalidConfig` errors that name the variable; unknown `GSC_*`
//! variables are reported with a suggestion; a bad value reaching a context fails there.
mod common;

use gscomm::{Config, Context, Status};

const BAD: &[(&str, &str)] = &[
    ("GSC_EAGER_SHORT_MAX", "lots"),
    ("GSC_RNDV_THRESH", "-5"),
    ("GSC_RNDV_SCHEME", "teleport"),
    ("GSC_SHM_DIR", "relative/dir"),
    ("GSC_SHM_RING_SIZE", "100000"),
    ("GSC_CMA", "maybe"),
    ("GSC_TIMEOUT", "soon"),
    ("GSC_PEER_CHECK_INTERVAL", "0ms"),
    ("GSC_TLS", "carrier_pigeon"),
    ("GSC_LOG_LEVEL", "loud"),
];

#[test]
fn bad_values_name_their_variable_via_set() {
    for (name, value) in BAD {
        let mut c = Config::default();
        let before = c.clone();
        let e = c.set(name, value).expect_err(&format!("{name}={value} accepted"));
        assert_eq!(e.status(), Status::InvalidConfig, "{name}");
        assert!(e.message().contains(name), "{name}={value}: message does not name it: {}", e.message());
        assert!(c == before, "{name}: a refused set changed the config");
    }
}

#[test]
fn bad_values_name_their_variable_via_from_pairs() {
    for (name, value) in BAD {
        let e = Config::from_pairs([(*name, *value)]).expect_err(&format!("{name}={value} accepted"));
        assert_eq!(e.status(), Status::InvalidConfig);
        assert!(e.message().contains(name), "{name}: {}", e.message());
    }
    // Every bad value at once: each is named in the one error.
    let e = Config::from_pairs(BAD.iter().copied()).unwrap_err();
    for (name, _) in BAD {
        assert!(e.message().contains(name), "{name} missing from the combined error: {}", e.message());
    }
    // Cross-knob rules name both variables.
    let e = Config::from_pairs([("GSC_EAGER_SHORT_MAX", "64K"), ("GSC_RNDV_THRESH", "32K")]).unwrap_err();
    assert_eq!(e.status(), Status::InvalidConfig);
    assert!(e.message().contains("GSC_RNDV_THRESH") && e.message().contains("GSC_EAGER_SHORT_MAX"), "{}", e.message());
}

#[test]
fn unknown_variables_are_reported_with_a_suggestion() {
    let load = Config::from_pairs([("GSC_RNDV_TRESH", "1M"), ("GSC_FOO", "1"), ("GSC_TLS", "shm"), ("PATH", "/bin")]).unwrap();
    assert_eq!(load.config.tls, vec![gscomm::transport::LaneKind::Shm], "known variables still apply");
    let unknown: Vec<(&str, Option<&str>)> = load.unknown.iter().map(|(n, s)| (n.as_str(), *s)).collect();
    assert_eq!(unknown, vec![("GSC_FOO", None), ("GSC_RNDV_TRESH", Some("GSC_RNDV_THRESH"))]);
    // `set` refuses an unknown name outright, with the suggestion in the message.
    let e = Config::default().set("GSC_TIMEOUTT", "1s").unwrap_err();
    assert_eq!(e.status(), Status::InvalidConfig);
    assert!(e.message().contains("GSC_TIMEOUT"), "{}", e.message());
}

#[test]
fn a_missing_shm_dir_fails_worker_creation_naming_the_variable() {
    let mut c = Config::default();
    c.set("GSC_TLS", "shm").unwrap();
    c.set("GSC_SHM_DIR", "/nonexistent/gsc-test-dir").unwrap();
    let ctx = Context::new(c).unwrap();
    let e = ctx.create_worker().err().expect("worker over a missing shm dir");
    assert_eq!(e.status(), Status::InvalidConfig);
    assert!(e.message().contains("GSC_SHM_DIR"), "{}", e.message());
}
