//! examples/host_allreduce under launchers (issue #7): three processes with the environment
//! Open MPI's mpirun gives its ranks (OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK /
//! _LOCAL_SIZE), the same with Slurm's and torchrun's variables, and the rendezvous from
//! GSC_BOOTSTRAP_ADDR + GSC_BOOTSTRAP_SECRET (torchrun: MASTER_ADDR / MASTER_PORT). Each rank
//! must print its OK line naming the launcher it detected; every run is bounded.
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The example, built by `cargo test` beside this test's own binary (target/<profile>/examples).
fn example() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap().join("examples");
    let path = dir.join("host_allreduce");
    assert!(path.exists(), "{} is missing: `cargo test` builds the examples", path.display());
    path
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Start `n` ranks with `vars(rank)` on top of a clean GSC environment; wait (bounded) and
/// return each rank's stdout.
fn launch(n: usize, vars: impl Fn(usize) -> Vec<(String, String)>) -> Vec<String> {
    let children: Vec<Child> = (0..n)
        .map(|r| {
            let mut c = Command::new(example());
            c.stdout(Stdio::piped()).stderr(Stdio::piped());
            for (k, _) in std::env::vars() {
                // Whatever launcher this test itself runs under must not leak into the ranks.
                if k.starts_with("OMPI_")
                    || k.starts_with("PMI_")
                    || k.starts_with("SLURM_")
                    || k.starts_with("GSC_")
                    || k == "RANK"
                    || k == "WORLD_SIZE"
                {
                    c.env_remove(&k);
                }
            }
            c.env("GSC_TLS", "shm,loopback").env("GSC_BOOTSTRAP_TIMEOUT", "30");
            for (k, v) in vars(r) {
                c.env(k, v);
            }
            c.spawn().unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut outs = Vec::new();
    for mut c in children {
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                let out = c.wait_with_output().unwrap();
                let (so, se) = (String::from_utf8_lossy(&out.stdout).to_string(), String::from_utf8_lossy(&out.stderr).to_string());
                assert!(st.success(), "a rank failed ({st}):\n{so}{se}");
                outs.push(so);
                break;
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                panic!("a rank did not finish within 60 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    outs
}

fn check(outs: &[String], launcher: &str) {
    let n = outs.len();
    for (r, o) in outs.iter().enumerate() {
        let want = format!("rank {r}/{n} ({launcher}): all-reduce of 1048576 int32");
        assert!(o.contains(&want) && o.trim_end().ends_with("OK"), "rank {r}: {o:?} (wanted {want:?} ... OK)");
    }
}

fn rendezvous() -> Vec<(String, String)> {
    vec![
        ("GSC_BOOTSTRAP_ADDR".into(), format!("127.0.0.1:{}", free_port())),
        ("GSC_BOOTSTRAP_SECRET".into(), "5ec2e7-f0r-this-test-only".into()),
    ]
}

#[test]
fn under_open_mpi_variables() {
    let rv = rendezvous();
    let outs = launch(3, |r| {
        let mut v = rv.clone();
        for (k, val) in
            [("OMPI_COMM_WORLD_RANK", r), ("OMPI_COMM_WORLD_SIZE", 3), ("OMPI_COMM_WORLD_LOCAL_RANK", r), ("OMPI_COMM_WORLD_LOCAL_SIZE", 3)]
        {
            v.push((k.into(), val.to_string()));
        }
        v
    });
    check(&outs, "OpenMpi");
}

#[test]
fn under_slurm_variables() {
    let rv = rendezvous();
    let outs = launch(2, |r| {
        let mut v = rv.clone();
        for (k, val) in [("SLURM_PROCID", r), ("SLURM_NTASKS", 2), ("SLURM_LOCALID", r)] {
            v.push((k.into(), val.to_string()));
        }
        v
    });
    check(&outs, "Slurm");
}

#[test]
fn under_torchrun_variables() {
    // torchrun's rendezvous: MASTER_ADDR and MASTER_PORT (gscomm serves on MASTER_PORT + 1).
    let port = free_port() - 1;
    let outs = launch(2, |r| {
        let mut v: Vec<(String, String)> = Vec::new();
        for (k, val) in
            [("RANK", r.to_string()), ("WORLD_SIZE", "2".into()), ("LOCAL_RANK", r.to_string()), ("LOCAL_WORLD_SIZE", "2".into())]
        {
            v.push((k.into(), val));
        }
        v.push(("MASTER_ADDR".into(), "127.0.0.1".into()));
        v.push(("MASTER_PORT".into(), port.to_string()));
        v.push(("GSC_BOOTSTRAP_SECRET".into(), "torchrun-test-secret".into()));
        v
    });
    check(&outs, "Torchrun");
}
