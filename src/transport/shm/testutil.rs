//! Test helpers for multi-process tests: a test re-runs its own test binary as a child process
//! that takes on a role chosen by an environment variable, and a private segment directory per
//! test so that leftover checks are not disturbed by tests running in parallel.
//!
//! Every wait has a hard time limit; a child that overstays it is killed and the test fails.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

/// The longest any multi-process test step may take before the test fails.
pub const TIME_LIMIT: Duration = Duration::from_secs(20);

const ROLE_VAR: &str = "GSC_SHM_TEST_ROLE";
/// Lines a child writes to stdout with this prefix are messages to the parent.
const MSG_PREFIX: &str = "GSC-CHILD ";

/// The role this process plays, when it was started by `ChildProc::spawn`.
pub fn role() -> Option<String> {
    std::env::var(ROLE_VAR).ok()
}

/// An environment variable the parent passed to the child.
pub fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("child started without {name}"))
}

/// From the child: send one line to the parent.
pub fn tell_parent(msg: &str) {
    let mut out = std::io::stdout().lock();
    // Leading newline: libtest may have left a partial line ("test x ... ") on stdout.
    writeln!(out, "\n{MSG_PREFIX}{msg}").unwrap();
    out.flush().unwrap();
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// A child test process; killed and reaped on drop so a failing parent never leaves it behind.
pub struct ChildProc {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
}

impl ChildProc {
    /// Run test `test_name` (as libtest names it, without the crate) in a new process with `role`.
    pub fn spawn(test_name: &str, role: &str, envs: &[(&str, String)]) -> ChildProc {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = Command::new(exe);
        cmd.args(["--exact", test_name, "--nocapture", "--include-ignored", "--test-threads=1"])
            .env(ROLE_VAR, role)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                match line.find(MSG_PREFIX).map(|at| &line[at + MSG_PREFIX.len()..]) {
                    Some(msg) => {
                        if tx.send(msg.to_string()).is_err() {
                            break;
                        }
                    }
                    None => eprintln!("[child] {line}"),
                }
            }
        });
        ChildProc { child, stdin, lines }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// The next message from the child; fails the test after `TIME_LIMIT`.
    pub fn expect_msg(&mut self) -> String {
        match self.lines.recv_timeout(TIME_LIMIT) {
            Ok(m) => m,
            Err(RecvTimeoutError::Timeout) => {
                self.kill();
                panic!("child {} sent nothing within {TIME_LIMIT:?}", self.pid())
            }
            Err(RecvTimeoutError::Disconnected) => {
                let status = self.child.wait();
                panic!("child {} exited without a message: {status:?}", self.pid())
            }
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Wait for the child to exit and require success; kill it and fail after `TIME_LIMIT`.
    pub fn wait_success(&mut self) {
        let deadline = Instant::now() + TIME_LIMIT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "child {} failed: {status}", self.pid());
                return;
            }
            if Instant::now() > deadline {
                self.kill();
                panic!("child {} did not exit within {TIME_LIMIT:?}", self.pid());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill();
        }
    }
}

/// A private directory for one test's segments, under /dev/shm so it is tmpfs like production.
pub struct TestDir(PathBuf);

impl TestDir {
    pub fn new(tag: &str) -> TestDir {
        let mut r = [0u8; 8];
        getrandom::getrandom(&mut r).unwrap();
        let dir = PathBuf::from(format!("/dev/shm/gsctest-{tag}-{}-{}", std::process::id(), hex(&r)));
        std::fs::create_dir(&dir).unwrap();
        TestDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Names of the entries left in the directory.
    pub fn entries(&self) -> Vec<String> {
        let mut v: Vec<String> =
            std::fs::read_dir(&self.0).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Spin on `cond` until it holds; fail the test after `TIME_LIMIT`.
pub fn spin_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + TIME_LIMIT;
    let mut spins = 0u32;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        spins += 1;
        // Tests run in parallel on few cores: yield now and then so the other side can run.
        if spins % 64 == 0 {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}
