//! gsc-bench: gscomm's benchmark tool. Every test starts its peer process itself.
//!
//! Host point-to-point between two processes on this machine:
//!   gsc-bench tag-lat [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP] [--ucx]
//!   gsc-bench tag-bw  [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP] [-W WINDOW] [--ucx] [--buffer-per-send]
//! Latency is half the round trip of a ping-pong; bandwidth streams WINDOW outstanding sends per
//! iteration. `--ucx` runs UCX's `ucx_perftest` on the same sizes in the same run (Debian package
//! ucx-utils) and prints both side by side.
//!
//! GPU point-to-point between two GPUs, one process per GPU (see `gpu.rs`):
//!   gsc-bench gpu-sendrecv [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP] [-G GRAPH_ITERS]
//!                          [-m stream,graph,kernel,pstream,pgraph,gstream,ggraph,gkernel,gping] [-d DEV0,DEV1] [--nccl]
//! nccl-tests' sendrecv pattern (each rank sends to and receives from the other at once), with
//! the operation started by a stream position, a captured graph or a kernel trigger, and NCCL's
//! ncclSend/ncclRecv in the same run with `--nccl`. Beside each time, `proxy ops/iter`: the
//! operations the proxy thread started per iteration (0.00 for the g* modes: no host work).
//!
//! GPU buffers against host buffers over one link, one way (see `staged.rs`):
//!   gsc-bench staged-bw [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP] [-W WINDOW]
//!                       [--gpus SEND,RECV] [--mem cuda,host] [--no-pin]
//! With `GSC_TLS=ucx`: the UCX lane's host-staging pipeline for GPU data beside a plain host
//! transfer over the same lane, in nccl-tests' columns.
//!
//! Collectives between GPUs, one process per GPU (see `coll.rs`):
//!   gsc-bench all-reduce|all-gather|reduce-scatter|broadcast|reduce|sendrecv|all-to-all [-b MIN] [-e MAX] [-f FACTOR]
//!             [-n ITERS] [-w WARMUP] [-g NGPUS] [-G GRAPH_ITERS] [-d TYPE] [-o OP] [-r ROOT]
//!             [-m stream,graph,kernel] [--nccl]
//! nccl-tests' collectives (sizes, algbw, busbw, #wrong as nccl-tests defines them) on a gscomm
//! communicator of NGPUS ranks (default 2), each call started on a stream or replayed from a
//! captured graph, or triggered from a kernel, and NCCL's same collective in the same run with
//! `--nccl`.
//!
//! GSC_* knobs apply as usual (e.g. GSC_TLS=shm, GSC_LOG_LEVEL). The tool's own variables:
//! GSC_BENCH_NCCL_LIB (where libnccl.so.2 is), GSC_BENCH_HOST_TIME=1 (gpu-sendrecv's stream
//! modes print the host's enqueue time per iteration, to tell a host-bound mode).

mod coll;
mod gpu;
mod host;
mod nccl;
mod staged;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

fn usage() -> ! {
    eprintln!(
        "usage: gsc-bench tag-lat|tag-bw [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP] [-W WINDOW] [--ucx] [--no-pin] [--prepared] [--buffer-per-send]\n\
         \x20      gsc-bench gpu-sendrecv [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP] [-G GRAPH_ITERS]\n\
         \x20                             [-m stream,graph,kernel,pstream,pgraph,gstream,ggraph,gkernel,gping] [-d DEV0,DEV1] [--nccl]\n\
         \x20      gsc-bench staged-bw [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP] [-W WINDOW] [--gpus SEND,RECV] [--mem cuda,host] [--no-pin]\n\
         \x20      gsc-bench all-reduce|all-gather|reduce-scatter|broadcast|reduce|sendrecv|all-to-all [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP]\n\
         \x20                             [-g NGPUS] [-G GRAPH_ITERS] [-d TYPE] [-o OP] [-r ROOT] [-m stream,graph,kernel] [-R 0|2] [--nccl]\n\
         \x20        TYPE: int8 uint8 int32 uint32 int64 uint64 half float double bfloat16 (default float)\n\
         \x20        OP: sum prod max min avg (default sum); NGPUS: ranks, one GPU each (default 2); ROOT default 0\n\
         \x20        -R 2: VMM buffers registered as symmetric windows with both libraries (nccl-tests' -R 2); 0: none (default)\n\
         sizes accept K/M/G suffixes"
    );
    std::process::exit(2)
}

pub(crate) fn parse_size(s: &str) -> usize {
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().map(|n| n * mult).unwrap_or_else(|_| {
        eprintln!("gsc-bench: bad size {s:?}");
        usage()
    })
}

/// The options every test has: the size sweep (-b MIN -e MAX -f FACTOR) and the iteration
/// counts (-n ITERS -w WARMUP).
#[derive(Clone, Debug)]
pub(crate) struct Sweep {
    pub(crate) min: usize,
    pub(crate) max: usize,
    pub(crate) factor: usize,
    pub(crate) iters: usize,
    pub(crate) warmup: usize,
}

impl Sweep {
    /// Apply `flag` if it is one of these options, taking its value from `val`. `Some(false)`:
    /// not one of ours; `None`: its value is missing.
    pub(crate) fn apply(&mut self, flag: &str, val: &mut dyn FnMut() -> Option<String>) -> Option<bool> {
        match flag {
            "-b" => self.min = parse_size(&val()?),
            "-e" => self.max = parse_size(&val()?),
            "-f" => self.factor = parse_size(&val()?).max(2),
            "-n" => self.iters = parse_size(&val()?).max(1),
            "-w" => self.warmup = parse_size(&val()?),
            _ => return Some(false),
        }
        Some(true)
    }

    /// MIN, MIN*FACTOR, ... up to and including MAX.
    pub(crate) fn sizes(&self) -> Vec<usize> {
        let mut v = Vec::new();
        let mut s = self.min;
        loop {
            v.push(s);
            if s >= self.max {
                break;
            }
            s = if s == 0 { 1 } else { (s * self.factor).min(self.max) };
        }
        v
    }
}

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub(crate) fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2).map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex")).collect()
}

pub(crate) fn die(what: &str, e: impl std::fmt::Display) -> ! {
    eprintln!("gsc-bench: {what}: {e}");
    std::process::exit(1)
}

/// The line-based control channel between the tool and the peer process it started: the
/// client holds the child's stdin/stdout, the peer its own stdin/stdout.
pub(crate) struct Control {
    input: Box<dyn BufRead>,
    output: Box<dyn Write>,
}

impl Control {
    /// In the peer process.
    pub(crate) fn of_parent() -> Control {
        Control { input: Box::new(BufReader::new(std::io::stdin())), output: Box::new(std::io::stdout()) }
    }

    /// `of_parent` for a peer whose libraries may print to stdout (NCCL does with NCCL_DEBUG):
    /// the channel writes to the parent's pipe through a duplicate of descriptor 1, and
    /// descriptor 1 itself goes to stderr, so a stray line cannot break the protocol.
    pub(crate) fn of_parent_stdout_to_stderr() -> Control {
        use std::os::fd::FromRawFd;
        // SAFETY: plain descriptor calls; the duplicate is owned by the File made from it.
        let pipe = unsafe { libc::dup(1) };
        if pipe < 0 || unsafe { libc::dup2(2, 1) } < 0 {
            die("control channel", std::io::Error::last_os_error());
        }
        // SAFETY: `pipe` is a fresh descriptor nothing else owns.
        let output = unsafe { std::fs::File::from_raw_fd(pipe) };
        Control { input: Box::new(BufReader::new(std::io::stdin())), output: Box::new(output) }
    }

    pub(crate) fn send(&mut self, key: &str, value: &str) {
        writeln!(self.output, "{key} {value}").unwrap_or_else(|e| die("control channel", e));
        self.output.flush().unwrap_or_else(|e| die("control channel", e));
    }

    pub(crate) fn expect(&mut self, key: &str) -> String {
        let mut line = String::new();
        if self.input.read_line(&mut line).unwrap_or(0) == 0 {
            die("control channel", format!("the peer closed it while {key} was expected"));
        }
        match line.trim_end().split_once(' ') {
            Some((k, v)) if k == key => v.to_string(),
            _ if line.trim_end() == key => String::new(),
            _ => die("control channel", format!("expected {key}, got {:?}", line.trim_end())),
        }
    }

    /// Both sides call it; returns when both have.
    pub(crate) fn barrier(&mut self) {
        self.send("BARRIER", "");
        self.expect("BARRIER");
    }
}

/// Start this binary again as the peer (`__server ARGS`) and hold its control channel.
pub(crate) fn spawn_peer(args: &[String]) -> (Child, Control) {
    let exe = std::env::current_exe().unwrap_or_else(|e| die("current_exe", e));
    let mut child = Command::new(exe)
        .arg("__server")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| die("spawn peer", e));
    let stdin: ChildStdin = child.stdin.take().expect("piped");
    let stdout: ChildStdout = child.stdout.take().expect("piped");
    (child, Control { input: Box::new(BufReader::new(stdout)), output: Box::new(stdin) })
}

/// The configuration from the environment, with logging set up as it asks.
pub(crate) fn config() -> gscomm::Config {
    let cfg = gscomm::Config::from_env().unwrap_or_else(|e| die("configuration", e));
    gscomm::log::init(&cfg).unwrap_or_else(|e| die("logging", e));
    cfg
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let server = args.first().map(String::as_str) == Some("__server");
    if server {
        args.remove(0);
    }
    match args.first().map(String::as_str) {
        Some("tag-lat" | "tag-bw") => {
            let o = host::parse_args(&args).unwrap_or_else(|| usage());
            if server { host::server(&o) } else { host::client(&o, &args) }
        }
        Some("staged-bw") => {
            let o = staged::parse_args(&args[1..]).unwrap_or_else(|| usage());
            if server { staged::server(&o) } else { staged::client(&o, &args) }
        }
        Some("gpu-sendrecv") => {
            let o = gpu::parse_args(&args[1..]).unwrap_or_else(|| usage());
            if server { gpu::server(&o) } else { gpu::client(&o, &args) }
        }
        // The collectives: one subcommand each, one code path.
        Some(name) => match coll::Coll::parse(name) {
            Some(c) => {
                let o = coll::parse_args(c, &args[1..]).unwrap_or_else(|| usage());
                if server { coll::server(&o) } else { coll::client(&o, &args) }
            }
            None => usage(),
        },
        None => usage(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sweep() -> Sweep {
        Sweep { min: 8, max: 4 << 20, factor: 2, iters: 10, warmup: 1 }
    }

    #[test]
    fn sweep_options_and_sizes() {
        let mut s = sweep();
        let mut vals = vec!["100".to_string(), "1K".to_string()].into_iter();
        assert_eq!(s.apply("-b", &mut || vals.next()), Some(true));
        assert_eq!(s.apply("-e", &mut || vals.next()), Some(true));
        assert_eq!(s.apply("-f", &mut || None), None, "a flag without its value");
        assert_eq!(s.apply("-G", &mut || Some("5".into())), Some(false), "not a sweep option");
        s.factor = 3;
        assert_eq!(s.sizes(), vec![100, 300, 900, 1024], "the last size is MAX itself");
        let zero = Sweep { min: 0, max: 4, factor: 2, ..sweep() };
        assert_eq!(zero.sizes(), vec![0, 1, 2, 4]);
    }
}
