//! Shared helpers of the integration tests: contexts with config overrides, a multi-process
//! harness that re-runs the test binary as a child, private shm directories and data patterns.
//!
//! Multi-process protocol: the parent spawns `current_exe() --exact <test> --nocapture
//! --test-threads=1` with `GSC_TEST_CHILD=<role>`; the same test function sees the variable and
//! runs the child role instead. Parent and child exchange `@@key=hex` lines over the child's
//! stdin/stdout (the test harness's own output on stdout is ignored: only `@@` lines count).
//! Every wait has a deadline; on a deadline the parent SIGKILLs the child and panics.
#![allow(dead_code)]

use gscomm::{Config, Context, Started, Status, Worker};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

pub const CHILD_ENV: &str = "GSC_TEST_CHILD";
/// Config overrides handed to a child, `NAME=VALUE` joined with `;`.
pub const CHILD_CFG_ENV: &str = "GSC_TEST_CFG";
/// Hard limit of a child's life: a child that outlives it exits on its own (a parent that died
/// without killing it must not leave it spinning).
///
/// `GSC_TEST_CHILD_LIFE=<seconds>` stretches it for runs under tools that slow everything
/// down (compute-sanitizer's racecheck, valgrind); the parent's own deadlines are the tests'.
pub fn child_max_life() -> Duration {
    std::env::var("GSC_TEST_CHILD_LIFE").ok().and_then(|v| v.parse().ok()).map_or(Duration::from_secs(60), Duration::from_secs)
}

/// `n` rounds divided by `GSC_TEST_ROUNDS_DIVISOR` (default 1, at least one round): under
/// compute-sanitizer's racecheck kernels run hundreds of times slower, and the GPU suites'
/// thousands of replays do not fit a device run there.
pub fn rounds(n: usize) -> usize {
    let d = std::env::var("GSC_TEST_ROUNDS_DIVISOR").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(1).max(1);
    (n / d).max(1)
}

/// A test's time bound `d` multiplied by `GSC_TEST_SLOWDOWN` (default 1). Under
/// compute-sanitizer every kernel, copy and process exit is slower, so bounds that measure
/// the library (release after a kill, replay after an abort) are stretched there instead of
/// being dropped; the runs that judge those bounds are the ones without the tool.
pub fn slowed(d: Duration) -> Duration {
    let f = std::env::var("GSC_TEST_SLOWDOWN").ok().and_then(|v| v.parse::<u32>().ok()).unwrap_or(1).max(1);
    d * f
}

/// A context over `tls` with the given `GSC_*` overrides (applied after the defaults, in order).
pub fn ctx_with(overrides: &[(&str, &str)]) -> Context {
    Context::new(config_with(overrides)).expect("context")
}

pub fn config_with(overrides: &[(&str, &str)]) -> Config {
    let mut c = Config::default();
    // Tests must never wait the default 60 s.
    c.set("GSC_TIMEOUT", "20s").unwrap();
    // Tests build their config from defaults, not the environment; these let a run on the
    // device machines turn logging on without a rebuild, and run the suite under another
    // engine policy for prepared transfers (`GSC_ENGINE=gpu|proxy`) or signalling (`GSC_PREP_WORDS`).
    let passed_on = [
        ("GSC_TEST_LOG_LEVEL", "GSC_LOG_LEVEL"),
        ("GSC_TEST_LOG_SUBSYS", "GSC_LOG_SUBSYS"),
        ("GSC_ENGINE", "GSC_ENGINE"),
        ("GSC_ENGINE_GPU_MAX", "GSC_ENGINE_GPU_MAX"),
        // Shared words or frames for prepared proxy rounds (A/B runs of the GPU tests).
        ("GSC_PREP_WORDS", "GSC_PREP_WORDS"),
    ];
    for (env, knob) in passed_on {
        if let Ok(v) = std::env::var(env) {
            c.set(knob, &v).unwrap_or_else(|e| panic!("{env}: {e}"));
        }
    }
    if std::env::var("GSC_TEST_LOG_LEVEL").is_ok() {
        static LOGGING: std::sync::Once = std::sync::Once::new();
        LOGGING.call_once(|| {
            gscomm::log::init(&c).expect("log init");
        });
    }
    for (k, v) in overrides {
        c.set(k, v).unwrap_or_else(|e| panic!("set {k}={v}: {e}"));
    }
    c
}

// ---------------------------------------------------------------------------------------------
// Private shm directories

/// A fresh directory under /dev/shm (a tmpfs, like production) owned by one test; removed on drop.
pub struct ShmDir {
    pub path: PathBuf,
}

impl ShmDir {
    pub fn new(test: &str) -> ShmDir {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
        let path = base.join(format!("gsctest-{}-{n}-{test}", std::process::id()));
        std::fs::create_dir_all(&path).expect("create shm test dir");
        ShmDir { path }
    }

    pub fn as_str(&self) -> &str {
        self.path.to_str().unwrap()
    }

    /// `gsc-*` files currently in the directory.
    pub fn segments(&self) -> Vec<String> {
        list_segments(&self.path)
    }
}

pub fn list_segments(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| rd.flatten().filter_map(|e| e.file_name().into_string().ok()).filter(|n| n.starts_with("gsc-")).collect())
        .unwrap_or_default();
    v.sort();
    v
}

impl Drop for ShmDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

// ---------------------------------------------------------------------------------------------
// Child side

/// The role this process plays, when it is a child of a multi-process test.
pub fn child_role() -> Option<String> {
    std::env::var(CHILD_ENV).ok()
}

/// Config overrides the parent passed to this child.
pub fn child_overrides() -> Vec<(String, String)> {
    std::env::var(CHILD_CFG_ENV)
        .unwrap_or_default()
        .split(';')
        .filter(|s| !s.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').expect("NAME=VALUE");
            (k.to_string(), v.to_string())
        })
        .collect()
}

pub fn child_ctx() -> Context {
    let o = child_overrides();
    let refs: Vec<(&str, &str)> = o.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    ctx_with(&refs)
}

/// The child's end of the line protocol. Creating it arms a watchdog that ends the process after
/// `child_max_life()`, and stdin EOF (the parent died) ends it too.
pub struct Parent {
    lines: Receiver<String>,
}

impl Parent {
    pub fn new() -> Parent {
        std::thread::spawn(|| {
            std::thread::sleep(child_max_life());
            eprintln!("child {}: watchdog expired; exiting", std::process::id());
            std::process::exit(97);
        });
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let stdin = std::io::stdin();
            for line in stdin.lock().lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.strip_prefix("@@")
                    && tx.send(rest.to_string()).is_err()
                {
                    break;
                }
            }
            // The parent went away (or closed our stdin on purpose): nothing left to do.
            std::process::exit(98);
        });
        Parent { lines: rx }
    }

    pub fn put(&self, key: &str, value: &[u8]) {
        let mut out = std::io::stdout().lock();
        writeln!(out, "@@{key}={}", hex(value)).unwrap();
        out.flush().unwrap();
    }

    pub fn get(&self, key: &str) -> Vec<u8> {
        let line = self.lines.recv_timeout(child_max_life()).unwrap_or_else(|_| panic!("child: no `{key}` from parent"));
        let (k, v) = line.split_once('=').expect("key=value");
        assert_eq!(k, key, "child: expected `{key}`, got `{k}`");
        unhex(v)
    }
}

// ---------------------------------------------------------------------------------------------
// Parent side

pub struct ChildProc {
    proc: std::process::Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    pub role: String,
    pub pid: u32,
}

/// Spawn this test binary as a child running `test` (its full name, e.g. `mod::name`) in `role`.
pub fn spawn_child(test: &str, role: &str, cfg: &[(&str, &str)]) -> ChildProc {
    spawn_child_with(test, role, cfg, &[], &[])
}

/// `spawn_child` with extra environment variables (`env`, e.g. `UCX_TLS` for the child's UCX)
/// and the child started through `wrapper` (e.g. `ip netns exec NAME`), which must exec it in
/// the same process so that the pid is the child's.
pub fn spawn_child_with(test: &str, role: &str, cfg: &[(&str, &str)], env: &[(&str, &str)], wrapper: &[&str]) -> ChildProc {
    let exe = std::env::current_exe().expect("current_exe");
    let cfg_text: Vec<String> = cfg.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let mut cmd = match wrapper.split_first() {
        None => Command::new(exe),
        Some((program, args)) => {
            let mut c = Command::new(program);
            c.args(args).arg(exe);
            c
        }
    };
    let mut proc = cmd
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .envs(env.iter().copied())
        .env(CHILD_ENV, role)
        .env(CHILD_CFG_ENV, cfg_text.join(";"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn child");
    let stdout = proc.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            // libtest prints "test name ... " without a newline before the test body runs, so
            // the first message shares its line: look for the marker anywhere.
            if let Some(at) = line.find("@@")
                && tx.send(line[at + 2..].to_string()).is_err()
            {
                break;
            }
        }
    });
    let pid = proc.id();
    ChildProc { stdin: proc.stdin.take(), proc, lines: rx, role: role.to_string(), pid }
}

impl ChildProc {
    pub fn put(&mut self, key: &str, value: &[u8]) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        let r = writeln!(stdin, "@@{key}={}", hex(value)).and_then(|_| stdin.flush());
        if let Err(e) = r {
            self.fail(&format!("cannot write `{key}` to the child: {e}"));
        }
    }

    /// The next line from the child, which must be `key`; kill and fail after `timeout`.
    pub fn get(&mut self, key: &str, timeout: Duration) -> Vec<u8> {
        match self.lines.recv_timeout(timeout) {
            Ok(line) => {
                let (k, v) = line.split_once('=').expect("key=value");
                if k != key {
                    self.fail(&format!("expected `{key}` from the child, got `{k}`"));
                }
                unhex(v)
            }
            Err(RecvTimeoutError::Timeout) => self.fail(&format!("no `{key}` from the child within {timeout:?}")),
            Err(RecvTimeoutError::Disconnected) => {
                let st = self.proc.wait().ok();
                self.fail(&format!("child exited ({st:?}) before sending `{key}`"))
            }
        }
    }

    /// Wait for the child to exit successfully within `timeout`.
    pub fn wait_success(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            match self.proc.try_wait() {
                Ok(Some(st)) if st.success() => return,
                Ok(Some(st)) => self.fail(&format!("child failed: {st}")),
                Ok(None) if Instant::now() >= deadline => self.fail(&format!("child still running after {timeout:?}")),
                Ok(None) => std::thread::sleep(Duration::from_millis(5)),
                Err(e) => self.fail(&format!("wait: {e}")),
            }
        }
    }

    /// Has the child exited (successfully or not)? Does not reap a failure's status away.
    pub fn exited(&mut self) -> bool {
        !matches!(self.proc.try_wait(), Ok(None))
    }

    /// Close the child's stdin (it exits when it next reads).
    pub fn close_stdin(&mut self) {
        self.stdin.take();
    }

    pub fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill(2) on our own child's pid, which is not reaped while `self` lives.
        let rc = unsafe { libc::kill(self.pid as libc::pid_t, sig) };
        assert_eq!(rc, 0, "kill({}, {sig})", self.pid);
    }

    /// SIGSTOP, and return once the child is stopped. kill(2) returns before the child stops:
    /// the signal takes effect when the child next enters the kernel, and until then (long, on a
    /// loaded VM) it keeps running and may still act on what is sent to it afterwards.
    pub fn stop(&self) {
        self.signal(libc::SIGSTOP);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            // /proc/<pid>/stat: "pid (comm) S ...", the state after the last ')'.
            let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).unwrap_or_default();
            let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next());
            if matches!(state, Some('T') | Some('t')) {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "child {} did not stop (state {state:?})", self.pid);
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    /// SIGKILL, reap, and prove the signal did it: the exit status that waitpid reports must
    /// say "killed by SIGKILL" (a child that had already exited, or crashed on its own, fails
    /// the test instead of passing it for the wrong reason). Returns CLOCK_MONOTONIC just
    /// before the kill, for a survivor to measure from (`mono_ns`).
    pub fn sigkill_proven(&mut self) -> u64 {
        use std::os::unix::process::ExitStatusExt;
        if let Ok(Some(st)) = self.proc.try_wait() {
            self.fail(&format!("exited ({st}) before it could be killed"));
        }
        let at = mono_ns();
        self.signal(libc::SIGKILL);
        let st = self.proc.wait().unwrap_or_else(|e| panic!("waitpid({}): {e}", self.pid));
        assert_eq!(st.signal(), Some(libc::SIGKILL), "child `{}` (pid {}): waitpid says {st}, not killed by SIGKILL", self.role, self.pid);
        at
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        let _ = self.proc.kill();
        let _ = self.proc.wait();
    }

    /// Wait (bounded) until the kernel reports the process as gone or a zombie, without reaping.
    pub fn wait_dead_unreaped(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let text = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).unwrap_or_default();
            let state = text.rfind(')').and_then(|i| text[i + 1..].split_whitespace().next().map(str::to_string));
            if matches!(state.as_deref(), None | Some("Z") | Some("X")) {
                return;
            }
            if Instant::now() >= deadline {
                self.fail("child did not die");
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn fail(&mut self, what: &str) -> ! {
        self.kill();
        panic!("child `{}` (pid {}): {what}", self.role, self.pid);
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        // Never leave a child behind, whatever happened (a failed assertion included).
        if let Ok(None) = self.proc.try_wait() {
            let _ = self.proc.kill();
        }
        let _ = self.proc.wait();
    }
}

// ---------------------------------------------------------------------------------------------
// Bytes and waiting

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process of the host, so a time taken in
/// the test process (a kill) and one taken in a child (the error it saw) can be subtracted.
pub fn mono_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid out-pointer; CLOCK_MONOTONIC always exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}

pub fn u64_bytes(v: u64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

pub fn bytes_u64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b.try_into().expect("8 bytes"))
}

/// Deterministic content for (`seed`, `len`), cheap to build in a debug build even for 64 MiB:
/// a 4093-byte (prime) pattern doubled with memcpy, with the offset stamped every 4 KiB so a
/// block moved to the wrong offset is detected.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    let p = 4093.min(len);
    for (i, b) in v[..p].iter_mut().enumerate() {
        *b = (i as u64).wrapping_mul(31).wrapping_add(seed.wrapping_mul(7)).wrapping_add(i as u64 >> 3) as u8;
    }
    let mut filled = p;
    while filled < len {
        let n = filled.min(len - filled);
        v.copy_within(0..n, filled);
        filled += n;
    }
    let mut off = 0;
    while off + 16 <= len {
        v[off..off + 8].copy_from_slice(&(off as u64).to_le_bytes());
        v[off + 8..off + 16].copy_from_slice(&seed.to_le_bytes());
        off += 4096;
    }
    v
}

/// Assert two buffers are equal, reporting the first difference instead of megabytes of bytes.
pub fn assert_same(got: &[u8], want: &[u8], what: &str) {
    if got == want {
        return;
    }
    assert_eq!(got.len(), want.len(), "{what}: length");
    let i = got.iter().zip(want).position(|(a, b)| a != b).unwrap();
    panic!("{what}: first difference at byte {i} of {}: got {:#04x}, want {:#04x}", want.len(), got[i], want[i]);
}

/// A child's wait for the next message from the test, progressing `w` meanwhile (the peer may
/// need us), for at most `limit`. Between idle passes it yields, or sleeps `idle` when that is
/// not zero (a child that must leave a core to its proxy thread).
pub fn next_msg(chan: &dyn Chan, w: &Worker, key: &str, limit: Duration, idle: Duration) -> Vec<u8> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some((k, v)) = chan.try_get() {
            assert_eq!(k, key, "expected `{key}`");
            return v;
        }
        assert!(Instant::now() < deadline, "no `{key}` within {limit:?}");
        if w.progress() == 0 {
            if idle.is_zero() {
                std::thread::yield_now();
            } else {
                std::thread::sleep(idle);
            }
        }
    }
}

/// Progress `w` until `done()` or the deadline; panics on the deadline.
pub fn progress_until(w: &Worker, timeout: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        if w.progress() == 0 {
            std::thread::yield_now();
        }
        if Instant::now() >= deadline {
            panic!("{what}: not done within {timeout:?}");
        }
    }
}

/// Wait for `s` (if pending) and release it; returns (status, info).
pub fn wait_release(w: &Worker, s: Started) -> gscomm::Completion {
    match s {
        Started::Done(info) => gscomm::Completion { status: Status::Ok, info },
        Started::Armed(_) => panic!("no condition was given"),
        Started::Pending(h) => {
            let c = w.request_wait(h).expect("request_wait");
            w.request_release(h).expect("release");
            c
        }
    }
}

// ---------------------------------------------------------------------------------------------
// One scenario, two lanes: a peer is a child process (shm) or a thread of this process
// (loopback, which only reaches workers of one process). Roles are written once against `Chan`.

/// The role side's end of the key/value line protocol.
pub trait Chan: Send {
    fn put(&self, key: &str, value: &[u8]);
    fn get(&self, key: &str) -> Vec<u8>;
    /// The next message if one is there (`key`, value), without waiting.
    fn try_get(&self) -> Option<(String, Vec<u8>)>;
}

impl Chan for Parent {
    fn put(&self, key: &str, value: &[u8]) {
        Parent::put(self, key, value)
    }
    fn get(&self, key: &str) -> Vec<u8> {
        Parent::get(self, key)
    }
    fn try_get(&self) -> Option<(String, Vec<u8>)> {
        let line = self.lines.try_recv().ok()?;
        let (k, v) = line.split_once('=').expect("key=value");
        Some((k.to_string(), unhex(v)))
    }
}

pub struct ThreadChan {
    tx: std::sync::mpsc::Sender<(String, Vec<u8>)>,
    rx: std::sync::Mutex<Receiver<(String, Vec<u8>)>>,
}

impl Chan for ThreadChan {
    fn put(&self, key: &str, value: &[u8]) {
        let _ = self.tx.send((key.to_string(), value.to_vec()));
    }
    fn get(&self, key: &str) -> Vec<u8> {
        let (k, v) = self.rx.lock().unwrap().recv_timeout(child_max_life()).unwrap_or_else(|_| panic!("role thread: no `{key}`"));
        assert_eq!(k, key, "role thread: expected `{key}`");
        v
    }
    fn try_get(&self) -> Option<(String, Vec<u8>)> {
        self.rx.lock().unwrap().try_recv().ok()
    }
}

/// The test side's handle on a peer.
pub enum Peer {
    Proc(ChildProc),
    Thread { handle: Option<std::thread::JoinHandle<()>>, tx: std::sync::mpsc::Sender<(String, Vec<u8>)>, rx: Receiver<(String, Vec<u8>)> },
}

/// The lane a scenario runs on.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Lane {
    /// Between processes.
    Shm,
    /// Between threads of this process.
    Loopback,
}

impl Lane {
    pub fn tls(self) -> &'static str {
        match self {
            Lane::Shm => "shm",
            Lane::Loopback => "loopback",
        }
    }
}

/// Start `role` as a peer: a child process running `test` for shm (the test function must call
/// `run_child_role` first thing), a thread for loopback. `cfg` is the peer's config overrides.
pub fn start_peer(lane: Lane, test: &str, role: &str, cfg: &[(&str, &str)], f: fn(&str, &dyn Chan, Context)) -> Peer {
    match lane {
        Lane::Shm => Peer::Proc(spawn_child(test, role, cfg)),
        Lane::Loopback => {
            let (to_role, role_rx) = std::sync::mpsc::channel();
            let (role_tx, from_role) = std::sync::mpsc::channel();
            let ctx = ctx_with(cfg);
            let role = role.to_string();
            let handle = std::thread::spawn(move || {
                let chan = ThreadChan { tx: role_tx, rx: std::sync::Mutex::new(role_rx) };
                f(&role, &chan, ctx);
            });
            Peer::Thread { handle: Some(handle), tx: to_role, rx: from_role }
        }
    }
}

/// In a child process: run the role named by `GSC_TEST_CHILD` and report whether this was one.
pub fn run_child_role(f: fn(&str, &dyn Chan, Context)) -> bool {
    let Some(role) = child_role() else { return false };
    let parent = Parent::new();
    f(&role, &parent, child_ctx());
    true
}

impl Peer {
    pub fn put(&mut self, key: &str, value: &[u8]) {
        match self {
            Peer::Proc(c) => c.put(key, value),
            Peer::Thread { tx, .. } => {
                let _ = tx.send((key.to_string(), value.to_vec()));
            }
        }
    }

    pub fn get(&mut self, key: &str, timeout: Duration) -> Vec<u8> {
        match self {
            Peer::Proc(c) => c.get(key, timeout),
            Peer::Thread { rx, .. } => match rx.recv_timeout(timeout) {
                Ok((k, v)) => {
                    assert_eq!(k, key, "expected `{key}` from the role thread");
                    v
                }
                Err(e) => panic!("no `{key}` from the role thread within {timeout:?}: {e:?}"),
            },
        }
    }

    /// Like `get`, progressing `w` while waiting (the peer may need us to move to answer).
    pub fn get_progress(&mut self, key: &str, timeout: Duration, w: &Worker) -> Vec<u8> {
        let deadline = Instant::now() + timeout;
        loop {
            let got = match self {
                Peer::Proc(c) => c.lines.try_recv().ok().map(|line| {
                    let (k, v) = line.split_once('=').expect("key=value");
                    (k.to_string(), unhex(v))
                }),
                Peer::Thread { rx, .. } => rx.try_recv().ok(),
            };
            if let Some((k, v)) = got {
                if k != key {
                    self.abort(&format!("expected `{key}`, got `{k}`"));
                }
                return v;
            }
            if Instant::now() >= deadline {
                self.abort(&format!("no `{key}` within {timeout:?}"));
            }
            if w.progress() == 0 {
                std::thread::yield_now();
            }
        }
    }

    /// Wait for the peer to finish successfully (process exit 0 / thread returned).
    pub fn finish(&mut self, timeout: Duration) {
        match self {
            Peer::Proc(c) => c.wait_success(timeout),
            Peer::Thread { handle, .. } => {
                let deadline = Instant::now() + timeout;
                let h = handle.take().expect("finish once");
                while !h.is_finished() {
                    assert!(Instant::now() < deadline, "role thread still running after {timeout:?}");
                    std::thread::sleep(Duration::from_millis(2));
                }
                if let Err(e) = h.join() {
                    std::panic::resume_unwind(e);
                }
            }
        }
    }

    /// Has the peer ended (process exited / thread returned)?
    pub fn is_finished(&mut self) -> bool {
        match self {
            Peer::Proc(c) => c.exited(),
            Peer::Thread { handle, .. } => handle.as_ref().is_none_or(|h| h.is_finished()),
        }
    }

    fn abort(&mut self, what: &str) -> ! {
        match self {
            Peer::Proc(c) => c.fail(what),
            Peer::Thread { .. } => panic!("role thread: {what}"),
        }
    }

    pub fn proc(&mut self) -> &mut ChildProc {
        match self {
            Peer::Proc(c) => c,
            Peer::Thread { .. } => panic!("not a process peer"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Conditioned operations (tests/conditions_host.rs, tests/conditions_gpu.rs)

/// Request parameters putting an operation on condition `c`; `wait`: the stream waits for it.
#[allow(dead_code)]
pub fn on(c: &gscomm::condition::Condition, wait: bool) -> gscomm::RequestParams {
    gscomm::RequestParams { condition: Some(c.clone()), no_stream_wait: !wait, ..Default::default() }
}

/// The request of a stream-conditioned operation (they always give one).
#[allow(dead_code)]
pub fn pending(s: Started) -> u64 {
    match s {
        Started::Pending(h) => h,
        other => panic!("a stream-conditioned operation gave {other:?}"),
    }
}

/// Wait for and release every request; the statuses in order.
#[allow(dead_code)]
pub fn wait_all(w: &Worker, hs: Vec<u64>) -> Vec<Status> {
    hs.into_iter()
        .map(|h| {
            let c = w.request_wait(h).expect("request_wait");
            w.request_release(h).unwrap();
            c.status
        })
        .collect()
}

/// The outputs of a graph- or kernel-conditioned operation (they are persistent, never pending).
#[allow(dead_code)]
pub fn armed(s: Started) -> gscomm::condition::ArmedOutputs {
    match s {
        Started::Armed(o) => o,
        other => panic!("expected an armed persistent operation, got {other:?}"),
    }
}

/// A 64-bit counter a kernel keeps in page-locked memory (error counts, round numbers).
#[allow(dead_code)]
pub fn pinned_u64(b: &gscomm::cuda::api::PinnedBuf) -> u64 {
    u64::from_le_bytes(b.to_vec()[..8].try_into().unwrap())
}

/// `f` on a thread of its own, failing the test if it takes longer than `limit` (a hang must
/// fail, not stall the suite; a stuck CUDA call cannot be interrupted, only abandoned). Returns
/// `f`'s result and how long it took.
#[allow(dead_code)]
pub fn bounded<R: Send + 'static>(what: &str, limit: Duration, f: impl FnOnce() -> R + Send + 'static) -> (R, Duration) {
    let (tx, rx) = std::sync::mpsc::channel();
    let t0 = Instant::now();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(r) => (r, t0.elapsed()),
        Err(_) => panic!("{what}: still running after {limit:?}"),
    }
}

/// `GSC_TEST_SHARE_GPUS=1`: the multi-rank collective jobs run on fewer GPUs than ranks (rank r
/// on GPU r mod count; ranks on one GPU map each other's memory by CUDA IPC within the device,
/// and their kernels take turns on it). It checks the code paths of more ranks than the machine
/// has GPUs, not their speed.
pub fn sharing_gpus() -> bool {
    std::env::var_os("GSC_TEST_SHARE_GPUS").is_some()
}

/// The GPU of rank `rank` in a collective job: rank mod the GPUs there are.
pub fn gpu_of(rank: usize) -> i32 {
    rank as i32 % gscomm::cuda::api::device_count().max(1)
}

/// A job of `n` ranks, one process each: rank 0 here, ranks 1.. as children running `roles`
/// (which call `run_rank` with the unique id the parent sends as "uid" and put its result as
/// "result"). Each rank returns what it found wrong, one problem per line; the test fails with
/// every rank's. Skips (printing why) without GPUs, or with fewer than `n` unless
/// `sharing_gpus`. `limit`: how long each child may take.
pub fn run_rank_job(
    test: &str,
    n: usize,
    limit: Duration,
    roles: fn(&str, &dyn Chan, Context),
    run_rank: fn(usize, usize, &[u8]) -> String,
) {
    use gscomm::bootstrap::UniqueId;
    use gscomm::cuda::api::{device_count, gpu_test_skip_reason};
    if let Some(why) = gpu_test_skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    if device_count() < n as i32 && !sharing_gpus() {
        eprintln!("skipped: needs {n} GPUs (or GSC_TEST_SHARE_GPUS=1), found {}", device_count());
        return;
    }
    // The kernels compiled once here, before the ranks start: on a machine with a cold kernel
    // cache, ranks compiling them all at once outlive the children's watchdog.
    let t0 = Instant::now();
    gscomm::collectives::prepare_kernels(0, &config_with(&[])).unwrap();
    eprintln!("collective kernels ready in {:?}", t0.elapsed());
    let uid = UniqueId::create(None).unwrap();
    let mut peers: Vec<Peer> = (1..n).map(|r| start_peer(Lane::Shm, test, &format!("rank{r}of{n}"), &[], roles)).collect();
    for p in peers.iter_mut() {
        p.put("uid", &uid.to_bytes());
    }
    let mut all = vec![run_rank(0, n, &uid.to_bytes())];
    for p in peers.iter_mut() {
        all.push(String::from_utf8(p.get("result", slowed(limit))).unwrap());
    }
    for p in peers.iter_mut() {
        p.finish(slowed(limit));
    }
    let problems: Vec<&String> = all.iter().filter(|s| !s.is_empty()).collect();
    assert!(problems.is_empty(), "{problems:#?}");
}

/// Rank `rank`'s input of `count` elements of `dtype` for `seed`, for the collective tests:
/// random bits for integers (sums and products wrap), small integers for floats (exact in every
/// float type, so a result is wrong only when the data is).
pub fn coll_input(dtype: gscomm::collectives::DataType, rank: usize, seed: u64, count: usize) -> Vec<u8> {
    let raw = pattern(seed * 31 + rank as u64, count * 8);
    if !dtype.is_float() {
        return raw[..count * dtype.size()].to_vec();
    }
    let mut out = Vec::with_capacity(count * dtype.size());
    for i in 0..count {
        dtype.push_integer(i64::from(raw[i * 8] % 5) - 2, &mut out);
    }
    out
}

/// One rank of a collective job: its communicator, a stream, and the stream's condition.
pub struct CommRank {
    pub comm: gscomm::collectives::Communicator,
    pub stream: gscomm::cuda::api::Stream,
    pub cond: gscomm::condition::Condition,
}

impl CommRank {
    pub fn sync(&self) {
        self.stream.synchronize().unwrap();
    }
    pub fn me(&self) -> usize {
        self.comm.rank()
    }
    pub fn n(&self) -> usize {
        self.comm.nranks()
    }
}
