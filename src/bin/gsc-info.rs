//! gsc-info: what this gscomm build is and how the environment configures it (cf. ucx_info).
//!
//! Exit status: 0 on success, 1 when the configuration in the environment is invalid (the error
//! is printed), 2 on a usage error.

use std::io::{self, Write};
use std::process::ExitCode;

use gscomm::config::{Config, ConfigLoad};
use gscomm::error::ALL_STATUSES;
use gscomm::transport::LaneKind;

const USAGE: &str = "\
Usage: gsc-info [options]

Without options: the version, the lanes and the RDMA NICs.

  -v, --version   print the gscomm version
  -c, --config    print every GSC_* variable with its current value and description
  -s, --status    print the status code table (code, C name, meaning)
  -l, --lanes     print the lanes and whether GSC_TLS enables them
  -p, --protocols print the protocol selection table for each enabled lane, the
                  prepared transfers' engine and the collectives' algorithms
  -r, --rdma      print the RDMA NICs the GDA verbs engine can use (or why there are none)
  -k, --kernels   build gscomm's kernels for every GPU of this machine now (compiled, or
                  read from GSC_KERNEL_CACHE_DIR) and print how long each took: warms
                  the cache before a job, so its ranks' first communicator does not wait
  -h, --help      print this help

Short options combine: gsc-info -vl.
";

#[derive(Debug, Default)]
struct Wanted {
    version: bool,
    config: bool,
    status: bool,
    lanes: bool,
    help: bool,
    protocols: bool,
    rdma: bool,
    kernels: bool,
}

fn parse_args(args: impl Iterator<Item = String>) -> Result<Wanted, String> {
    let mut wanted = Wanted::default();
    for arg in args {
        let flags: Vec<char> = match arg.as_str() {
            "--version" => vec!['v'],
            "--config" => vec!['c'],
            "--status" => vec!['s'],
            "--lanes" => vec!['l'],
            "--help" => vec!['h'],
            "--protocols" => vec!['p'],
            "--rdma" => vec!['r'],
            "--kernels" => vec!['k'],
            s if s.len() > 1 && s.starts_with('-') && !s.starts_with("--") => s[1..].chars().collect(),
            _ => return Err(format!("unknown argument {arg:?}")),
        };
        for flag in flags {
            match flag {
                'v' => wanted.version = true,
                'c' => wanted.config = true,
                's' => wanted.status = true,
                'l' => wanted.lanes = true,
                'h' => wanted.help = true,
                'p' => wanted.protocols = true,
                'r' => wanted.rdma = true,
                'k' => wanted.kernels = true,
                _ => return Err(format!("unknown option -{flag}")),
            }
        }
    }
    if !(wanted.version
        || wanted.config
        || wanted.status
        || wanted.lanes
        || wanted.help
        || wanted.protocols
        || wanted.rdma
        || wanted.kernels)
    {
        wanted.version = true;
        wanted.lanes = true;
        wanted.rdma = true;
    }
    Ok(wanted)
}

/// Quote a value for a POSIX shell when it needs it, so `-c` output can be pasted back.
fn shell_quote(value: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_-.,:/%+@=".contains(c);
    // Empty (an unset optional knob) needs no quotes: `GSC_RANK=` is already valid shell.
    if value.chars().all(plain) { value.to_string() } else { format!("'{}'", value.replace('\'', r"'\''")) }
}

fn print_config(out: &mut impl Write, load: &ConfigLoad) -> io::Result<()> {
    // `dump` is in table order, which the config tests check.
    for (knob, (name, value)) in Config::knobs().iter().zip(load.config.dump()) {
        writeln!(out, "# {}", knob.doc)?;
        let default = if knob.default.is_empty() { "unset" } else { knob.default };
        writeln!(out, "# syntax: {}; default: {default}", knob.kind.syntax())?;
        writeln!(out, "{name}={}", shell_quote(&value))?;
        writeln!(out)?;
    }
    for (name, suggestion) in &load.unknown {
        match suggestion {
            Some(s) => writeln!(out, "# warning: unknown variable {name}; did you mean {s}?")?,
            None => writeln!(out, "# warning: unknown variable {name}")?,
        }
    }
    Ok(())
}

fn print_status(out: &mut impl Write) -> io::Result<()> {
    writeln!(out, "# code  name                          meaning")?;
    for s in ALL_STATUSES {
        writeln!(out, "{:>6}  {:<28}  {}", s.code(), s.c_name(), s.description())?;
    }
    Ok(())
}

fn print_lanes(out: &mut impl Write, config: &Config) -> io::Result<()> {
    let tls = config.get("GSC_TLS").unwrap_or_default();
    writeln!(out, "# lanes (GSC_TLS={tls})")?;
    for lane in LaneKind::ALL {
        let state = if config.tls.contains(lane) { "enabled" } else { "disabled" };
        // Whether the lane can work here at all: only UCX depends on something installed.
        let here = match lane {
            LaneKind::Ucx => match gscomm::transport::ucx::availability() {
                Ok(loaded) => format!(", {loaded} loaded"),
                Err(e) => format!(", unavailable: {}", e.message()),
            },
            _ => String::new(),
        };
        writeln!(out, "{:<10} {state}{here}", lane.name())?;
    }
    writeln!(out, "# per peer: loopback in this process, shm on this host and network namespace, ucx otherwise")
}

/// The RDMA devices as the verbs engine sees them. Discovery never fails: a machine without
/// rdma-core, or without devices, gets the reason as the report.
fn print_rdma(out: &mut impl Write) -> io::Result<()> {
    writeln!(out, "# RDMA NICs (GDA verbs engine)")?;
    writeln!(out, "{}", gscomm::gda::verbs::report())
}

fn run(wanted: &Wanted) -> Result<(), ExitCode> {
    let stdout = io::stdout();
    let mut out = stdout.lock();
    let io_failed = |e: io::Error| {
        // A closed pipe (`gsc-info -c | head`) is not worth a message.
        if e.kind() != io::ErrorKind::BrokenPipe {
            eprintln!("gsc-info: cannot write output: {e}");
        }
        ExitCode::FAILURE
    };
    if wanted.help {
        return out.write_all(USAGE.as_bytes()).map_err(io_failed);
    }
    // Only read the environment when the output depends on it, so -v and -s work whatever
    // the GSC_* variables say.
    let load = if wanted.config || wanted.lanes || wanted.protocols || wanted.kernels {
        match Config::load_env() {
            Ok(load) => Some(load),
            Err(e) => {
                eprintln!("gsc-info: {}", e.message());
                return Err(ExitCode::FAILURE);
            }
        }
    } else {
        None
    };
    if wanted.version {
        writeln!(out, "gscomm {}", gscomm::VERSION).map_err(io_failed)?;
    }
    if let Some(load) = &load {
        if wanted.lanes {
            print_lanes(&mut out, &load.config).map_err(io_failed)?;
        }
        if wanted.config {
            print_config(&mut out, load).map_err(io_failed)?;
        }
    }
    if wanted.status {
        print_status(&mut out).map_err(io_failed)?;
    }
    if let (true, Some(load)) = (wanted.protocols, &load) {
        out.write_all(gscomm::protocols::selection_table(&load.config).as_bytes()).map_err(io_failed)?;
        let table = match gscomm::collectives::large::LargeShape::from_config(&load.config) {
            Ok(shape) => gscomm::collectives::select::describe(
                load.config.coll_large_min,
                &shape,
                (load.config.coll_sm, load.config.coll_sm_min),
                (load.config.coll_ring, load.config.coll_ring_min),
                (load.config.coll_ce, load.config.coll_ce_min),
                load.config.coll_trigger_max,
                (load.config.coll_p2p_max, load.config.coll_p2p_blocks, load.config.coll_p2p_head),
            ),
            Err(e) => format!("# collectives: {e}\n"),
        };
        out.write_all(table.as_bytes()).map_err(io_failed)?;
    }
    if wanted.rdma {
        print_rdma(&mut out).map_err(io_failed)?;
    }
    if let (true, Some(load)) = (wanted.kernels, &load) {
        out.flush().map_err(io_failed)?;
        build_kernels(&mut out, &load.config).map_err(|e| match e {
            KernelsFailed::Io(e) => io_failed(e),
            KernelsFailed::Build(why) => {
                eprintln!("gsc-info: {why}");
                ExitCode::FAILURE
            }
        })?;
    }
    out.flush().map_err(io_failed)
}

enum KernelsFailed {
    Io(io::Error),
    Build(String),
}

/// `-k`: build the kernels for every GPU, one line per GPU as it is done.
fn build_kernels(out: &mut impl Write, config: &Config) -> Result<(), KernelsFailed> {
    use gscomm::cuda::api::device_count;
    let io = KernelsFailed::Io;
    if let Err(e) = gscomm::cuda::init() {
        return Err(KernelsFailed::Build(format!("cannot build the kernels: {}", e.message())));
    }
    let gpus = device_count();
    if gpus <= 0 {
        return Err(KernelsFailed::Build("cannot build the kernels: no GPU on this machine".to_string()));
    }
    let dir = config.kernel_cache_dir.clone().or_else(gscomm::config::default_kernel_cache_dir);
    let dir = dir.map_or_else(|| "no cache directory: compiled, not kept".to_string(), |d| d.display().to_string());
    writeln!(out, "# gscomm's kernels ({dir})").map_err(io)?;
    for gpu in 0..gpus {
        let t0 = std::time::Instant::now();
        match gscomm::collectives::prepare_kernels(gpu, config) {
            Ok(()) => writeln!(out, "GPU {gpu}: ready in {:.1} s", t0.elapsed().as_secs_f64()).map_err(io)?,
            Err(e) => return Err(KernelsFailed::Build(format!("GPU {gpu}: {}", e.message()))),
        }
        out.flush().map_err(io)?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let wanted = match parse_args(std::env::args().skip(1)) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("gsc-info: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(&wanted) {
        Ok(()) => ExitCode::SUCCESS,
        Err(code) => code,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Wanted, String> {
        parse_args(args.iter().map(|s| s.to_string()))
    }

    #[test]
    fn arguments() {
        let w = parse(&[]).unwrap();
        assert!(w.version && w.lanes && w.rdma && !w.config && !w.status && !w.help);
        let w = parse(&["-cs", "--lanes"]).unwrap();
        assert!(w.config && w.status && w.lanes && !w.version && !w.rdma);
        assert!(parse(&["-p"]).unwrap().protocols);
        let w = parse(&["--rdma"]).unwrap();
        assert!(w.rdma && !w.version && !w.lanes);
        assert!(parse(&["-vr"]).unwrap().rdma);
        let w = parse(&["--kernels"]).unwrap();
        assert!(w.kernels && !w.version && !w.lanes && !w.rdma);
        assert!(parse(&["-k"]).unwrap().kernels);
        assert!(parse(&["-x"]).unwrap_err().contains("-x"));
        assert!(parse(&["-vx"]).unwrap_err().contains("-x"));
        assert!(parse(&["--verbose"]).is_err());
        assert!(parse(&["-"]).is_err());
        assert!(parse(&["config"]).is_err());
    }

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("64K"), "64K");
        assert_eq!(shell_quote(""), "");
        assert_eq!(shell_quote("/tmp/gsc.%h.%p.log"), "/tmp/gsc.%h.%p.log");
        assert_eq!(shell_quote("/tmp/a b"), "'/tmp/a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote("<set>"), "'<set>'");
    }
}
