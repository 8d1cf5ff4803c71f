//! Launcher detection (rank and size from the environment a launcher sets) and launcher-mode
//! bootstrap, where no unique id is passed around: every rank knows the root's address and the
//! secret in advance.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use super::comm::Bootstrap;
use super::root::RootOptions;
use super::uid::UniqueId;
use crate::error::{Error, Result};

/// Which launcher's environment a [`LaunchInfo`] was read from.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Launcher {
    /// `OMPI_COMM_WORLD_RANK` / `_SIZE` / `_LOCAL_RANK` / `_LOCAL_SIZE`.
    OpenMpi,
    /// MPICH, Intel MPI and other Hydra/PMI launchers: `PMI_RANK` / `PMI_SIZE`,
    /// `MPI_LOCALRANKID` / `MPI_LOCALNRANKS`.
    Mpich,
    /// `srun`: `SLURM_PROCID` / `SLURM_NTASKS` (or `SLURM_NPROCS`), `SLURM_LOCALID`.
    Slurm,
    /// `torchrun` / torchelastic: `RANK` / `WORLD_SIZE` / `LOCAL_RANK` / `LOCAL_WORLD_SIZE`.
    Torchrun,
    /// Explicit `GSC_RANK` / `GSC_NRANKS` (and optional `GSC_LOCAL_RANK` / `GSC_LOCAL_NRANKS`).
    Gscomm,
}

/// This process's place in the job, as the launcher described it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchInfo {
    pub rank: u32,
    pub size: u32,
    pub local_rank: Option<u32>,
    pub local_size: Option<u32>,
    pub launcher: Launcher,
}

/// Variable names of one launcher, in the order rank, size, local rank, local size.
struct Vars {
    launcher: Launcher,
    rank: &'static str,
    size: &'static [&'static str],
    local_rank: Option<&'static str>,
    local_size: Option<&'static str>,
    /// Generic names (`RANK`) may be set for unrelated reasons: only detect the launcher when
    /// rank and size are both present, instead of failing on a lone one.
    lenient: bool,
}

/// Precedence: explicit gscomm variables, then MPI launchers (their variables are the truth for
/// MPI processes even inside a Slurm allocation), then torchrun (whose workers may run under
/// srun, where `SLURM_PROCID` names the agent, not the worker), then Slurm.
const LAUNCHERS: &[Vars] = &[
    Vars {
        launcher: Launcher::Gscomm,
        rank: "GSC_RANK",
        size: &["GSC_NRANKS"],
        local_rank: Some("GSC_LOCAL_RANK"),
        local_size: Some("GSC_LOCAL_NRANKS"),
        lenient: false,
    },
    Vars {
        launcher: Launcher::OpenMpi,
        rank: "OMPI_COMM_WORLD_RANK",
        size: &["OMPI_COMM_WORLD_SIZE"],
        local_rank: Some("OMPI_COMM_WORLD_LOCAL_RANK"),
        local_size: Some("OMPI_COMM_WORLD_LOCAL_SIZE"),
        lenient: false,
    },
    Vars {
        launcher: Launcher::Mpich,
        rank: "PMI_RANK",
        size: &["PMI_SIZE"],
        local_rank: Some("MPI_LOCALRANKID"),
        local_size: Some("MPI_LOCALNRANKS"),
        lenient: false,
    },
    Vars {
        launcher: Launcher::Torchrun,
        rank: "RANK",
        size: &["WORLD_SIZE"],
        local_rank: Some("LOCAL_RANK"),
        local_size: Some("LOCAL_WORLD_SIZE"),
        lenient: true,
    },
    Vars {
        launcher: Launcher::Slurm,
        rank: "SLURM_PROCID",
        size: &["SLURM_NTASKS", "SLURM_NPROCS"],
        local_rank: Some("SLURM_LOCALID"),
        // SLURM has no plain per-node task count (SLURM_TASKS_PER_NODE is "2(x3),1").
        local_size: None,
        lenient: true,
    },
];

fn parse_u32(lookup: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<Option<u32>> {
    match lookup(name) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse::<u32>()
            .map(Some)
            .map_err(|_| Error::invalid_param(format!("{name}={v:?} is not a non-negative 32-bit integer"))),
    }
}

/// Read the launcher environment through `lookup` (a variable name → its value).
///
/// Returns `Ok(None)` when no known launcher variables are set. Malformed numbers, a zero size,
/// a rank not below the size, or half of a required pair are errors that name the variables.
pub fn detect_with(lookup: &dyn Fn(&str) -> Option<String>) -> Result<Option<LaunchInfo>> {
    for v in LAUNCHERS {
        let rank_set = lookup(v.rank).is_some();
        let size_name = v.size.iter().copied().find(|n| lookup(n).is_some());
        match (rank_set, size_name) {
            (false, None) => continue,
            (true, None) | (false, Some(_)) if v.lenient => continue,
            (true, None) => {
                return Err(Error::invalid_param(format!("{} is set but {} is not", v.rank, v.size.join(" / "))));
            }
            (false, Some(s)) => {
                return Err(Error::invalid_param(format!("{s} is set but {} is not", v.rank)));
            }
            (true, Some(size_name)) => {
                let rank = parse_u32(lookup, v.rank)?.unwrap_or(0);
                let size = parse_u32(lookup, size_name)?.unwrap_or(0);
                if size == 0 {
                    return Err(Error::invalid_param(format!("{size_name}=0: a job has at least one rank")));
                }
                if rank >= size {
                    return Err(Error::invalid_param(format!("{}={rank} is not below {size_name}={size}", v.rank)));
                }
                let local_rank = match v.local_rank {
                    Some(n) => parse_u32(lookup, n)?,
                    None => None,
                };
                let local_size = match v.local_size {
                    Some(n) => parse_u32(lookup, n)?,
                    None => None,
                };
                if let (Some(lr), Some(ls)) = (local_rank, local_size)
                    && lr >= ls
                {
                    return Err(Error::invalid_param(format!(
                        "{}={lr} is not below {}={ls}",
                        v.local_rank.unwrap_or("local rank"),
                        v.local_size.unwrap_or("local size")
                    )));
                }
                return Ok(Some(LaunchInfo { rank, size, local_rank, local_size, launcher: v.launcher }));
            }
        }
    }
    Ok(None)
}

/// Process environment lookup; a value that is not UTF-8 is passed on lossily so that parsing
/// fails with the variable's name instead of the variable being silently ignored.
pub fn env_lookup(name: &str) -> Option<String> {
    std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
}

/// [`detect_with`] over the process environment.
pub fn detect() -> Result<Option<LaunchInfo>> {
    detect_with(&env_lookup)
}

/// How [`Bootstrap::from_launcher`] finds the job. Each field mirrors an environment variable.
#[derive(Clone, PartialEq, Eq)]
pub struct BootstrapOptions {
    /// `GSC_UNIQUE_ID`: hex form of a [`UniqueId`] made by one process and handed to all.
    pub unique_id: Option<String>,
    /// `GSC_BOOTSTRAP_ADDR`: `host:port` where rank 0 runs the root service.
    pub addr: Option<String>,
    /// `GSC_BOOTSTRAP_SECRET`: shared secret for `addr` mode.
    pub secret: Option<String>,
    /// `GSC_BOOTSTRAP_TIMEOUT`: bound on rendezvous and on each later operation.
    pub timeout: Duration,
}

impl Default for BootstrapOptions {
    fn default() -> BootstrapOptions {
        BootstrapOptions { unique_id: None, addr: None, secret: None, timeout: Duration::from_secs(60) }
    }
}

impl std::fmt::Debug for BootstrapOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let redact = |o: &Option<String>| o.as_ref().map(|_| "<redacted>");
        f.debug_struct("BootstrapOptions")
            .field("unique_id", &redact(&self.unique_id))
            .field("addr", &self.addr)
            .field("secret", &redact(&self.secret))
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl BootstrapOptions {
    /// Read `GSC_UNIQUE_ID`, `GSC_BOOTSTRAP_ADDR`, `GSC_BOOTSTRAP_SECRET` and
    /// `GSC_BOOTSTRAP_TIMEOUT` through `lookup`; unset ones keep their defaults. The timeout is a
    /// number of seconds, optionally with an `s` or `ms` suffix (`30`, `2.5s`, `500ms`).
    pub fn from_env_with(lookup: &dyn Fn(&str) -> Option<String>) -> Result<BootstrapOptions> {
        let non_empty = |n: &str| lookup(n).filter(|v| !v.trim().is_empty());
        let mut o = BootstrapOptions {
            unique_id: non_empty("GSC_UNIQUE_ID"),
            addr: non_empty("GSC_BOOTSTRAP_ADDR").map(|a| a.trim().to_string()),
            secret: non_empty("GSC_BOOTSTRAP_SECRET"),
            ..BootstrapOptions::default()
        };
        if let Some(t) = non_empty("GSC_BOOTSTRAP_TIMEOUT") {
            o.timeout = parse_timeout(&t).ok_or_else(|| {
                Error::invalid_param(format!("GSC_BOOTSTRAP_TIMEOUT={t:?} is not a positive duration (e.g. 30, 2.5s, 500ms)"))
            })?;
        }
        Ok(o)
    }

    /// [`from_env_with`](BootstrapOptions::from_env_with) over the process environment.
    pub fn from_env() -> Result<BootstrapOptions> {
        BootstrapOptions::from_env_with(&env_lookup)
    }
}

fn parse_timeout(s: &str) -> Option<Duration> {
    let s = s.trim();
    let (num, scale) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num.trim().parse().ok()?;
    let secs = v * scale;
    // Reject NaN, infinities, zero and absurd values that would overflow Duration.
    if !(secs > 0.0 && secs < 1e9) {
        return None;
    }
    Some(Duration::from_secs_f64(secs))
}

/// A job identifier the launcher put in the environment, to derive a secret from when none is
/// configured, with the variable(s) it came from.
fn job_identifier(lookup: &dyn Fn(&str) -> Option<String>) -> Option<(String, &'static str)> {
    let non_empty = |n: &str| lookup(n).filter(|v| !v.trim().is_empty());
    if let Some(j) = non_empty("OMPI_MCA_ess_base_jobid") {
        return Some((format!("ompi:{j}"), "OMPI_MCA_ess_base_jobid"));
    }
    if let Some(j) = non_empty("SLURM_JOB_ID") {
        let step = non_empty("SLURM_STEP_ID").unwrap_or_default();
        return Some((format!("slurm:{j}.{step}"), "SLURM_JOB_ID/SLURM_STEP_ID"));
    }
    if let Some(j) = non_empty("TORCHELASTIC_RUN_ID") {
        return Some((format!("torchelastic:{j}"), "TORCHELASTIC_RUN_ID"));
    }
    None
}

/// Resolve `host:port`, IPv4 first so every rank picks the same address from a mixed answer.
pub(super) fn resolve(addr: &str, origin: &str) -> Result<SocketAddr> {
    let mut all: Vec<SocketAddr> =
        addr.to_socket_addrs().map_err(|e| Error::invalid_param(format!("{origin}={addr:?} does not resolve: {e}")))?.collect();
    all.sort_by_key(|a| !a.is_ipv4());
    all.into_iter().next().ok_or_else(|| Error::invalid_param(format!("{origin}={addr:?} resolves to no address")))
}

impl Bootstrap {
    /// Bootstrap a launcher-started job (see [`detect`]) without passing a unique id around.
    ///
    /// * `opts.unique_id` set: join that job.
    /// * else the root address is `opts.addr`, or for torchrun `MASTER_ADDR:MASTER_PORT+1`
    ///   (`MASTER_PORT` itself belongs to torch's own store). Rank 0 starts the root service
    ///   there; the others connect, retrying until it is up.
    /// * the secret is `opts.secret`, else derived from the launcher's job id
    ///   (`OMPI_MCA_ess_base_jobid`, `SLURM_JOB_ID`+`SLURM_STEP_ID`, `TORCHELASTIC_RUN_ID`).
    ///   A derived secret only keeps *different jobs* from joining each other by accident; any
    ///   local user can read a job id, so it is no defence against an attacker. Set
    ///   `GSC_BOOTSTRAP_SECRET` to a random value when that matters.
    pub fn from_launcher(opts: &BootstrapOptions, info: &LaunchInfo) -> Result<Bootstrap> {
        Bootstrap::from_launcher_with(opts, info, &env_lookup)
    }

    /// [`from_launcher`](Bootstrap::from_launcher) reading the environment through `lookup`.
    pub fn from_launcher_with(opts: &BootstrapOptions, info: &LaunchInfo, lookup: &dyn Fn(&str) -> Option<String>) -> Result<Bootstrap> {
        if let Some(s) = &opts.unique_id {
            let uid: UniqueId = s.parse().map_err(|e: Error| e.context("GSC_UNIQUE_ID"))?;
            return Bootstrap::init(&uid, info.rank, info.size, opts.timeout);
        }
        let (addr_str, origin) = match (&opts.addr, info.launcher) {
            (Some(a), _) => (a.clone(), "GSC_BOOTSTRAP_ADDR"),
            (None, Launcher::Torchrun) => {
                let host = lookup("MASTER_ADDR")
                    .ok_or_else(|| Error::invalid_param("torchrun job without GSC_UNIQUE_ID, GSC_BOOTSTRAP_ADDR or MASTER_ADDR"))?;
                let port_s = lookup("MASTER_PORT").ok_or_else(|| Error::invalid_param("MASTER_ADDR is set but MASTER_PORT is not"))?;
                let port: u16 =
                    port_s.trim().parse().map_err(|_| Error::invalid_param(format!("MASTER_PORT={port_s:?} is not a port number")))?;
                let port = port
                    .checked_add(1)
                    .ok_or_else(|| Error::invalid_param("MASTER_PORT=65535: no room for the bootstrap port MASTER_PORT+1"))?;
                let host = host.trim();
                // Bracket bare IPv6 literals so "host:port" parses.
                let joined =
                    if host.contains(':') && !host.starts_with('[') { format!("[{host}]:{port}") } else { format!("{host}:{port}") };
                (joined, "MASTER_ADDR/MASTER_PORT")
            }
            (None, _) => {
                return Err(Error::invalid_param(
                    "no bootstrap rendezvous configured: set GSC_UNIQUE_ID, or GSC_BOOTSTRAP_ADDR=host:port \
                     (rank 0 listens there)",
                ));
            }
        };
        let addr = resolve(&addr_str, origin)?;
        let secret: Vec<u8> = match (&opts.secret, job_identifier(lookup)) {
            (Some(s), _) if !s.is_empty() => s.as_bytes().to_vec(),
            (_, Some((id, var))) => {
                tracing::info!(target: "gsc::bootstrap", from = var,
                    "bootstrap secret derived from the launcher's job id: this prevents accidental \
                     cross-job connections only; set GSC_BOOTSTRAP_SECRET for protection against \
                     other users");
                id.into_bytes()
            }
            _ => {
                return Err(Error::invalid_param(format!(
                    "no bootstrap secret for {origin}={addr_str}: set GSC_BOOTSTRAP_SECRET to the same \
                     random value on every rank (no launcher job id was found to derive one from)"
                )));
            }
        };
        let uid = if info.rank == 0 {
            let root = RootOptions { timeout: opts.timeout, ..RootOptions::default() };
            UniqueId::create_at(addr, &secret, &root)?
        } else {
            UniqueId::with_root(addr, &secret)?
        };
        Bootstrap::init(&uid, info.rank, info.size, opts.timeout)
    }
}
