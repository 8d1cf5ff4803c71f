//! One error type for the whole crate, with stable C status codes.
//!
//! Codes are part of the C ABI (`gsc_status_t` in include/gsc.h) and never change meaning once
//! released. They are grouped by scope so a caller can tell at a glance where a failure came from:
//!
//! | range        | scope                                                     |
//! |--------------|-----------------------------------------------------------|
//! | 0, 1         | OK, IN_PROGRESS                                           |
//! | -1 ..= -19   | the call itself (arguments, handles, resources, config)   |
//! | -20 ..= -39  | the operation (truncation, cancel, timeout, abort)        |
//! | -40 ..= -59  | the peer or connection (failed, unreachable, closed)      |
//! | -60 ..= -79  | devices and drivers (CUDA, NICs, missing libraries)       |
//! | -80 ..= -99  | the library itself (internal invariants)                  |
//!
//! `GSC_ERR_LAST` (-100) bounds them: a status pointer whose value as an unsigned integer is at
//! least `(uintptr_t)GSC_ERR_LAST` encodes an error (see `GSC_PTR_IS_ERR`).

use std::borrow::Cow;
use std::fmt;

/// Stable status codes shared by the Rust API and the C API (`gsc_status_t`).
#[repr(i32)]
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    Ok = 0,
    InProgress = 1,

    // -- the call itself
    InvalidParam = -1,
    InvalidHandle = -2,
    Unsupported = -3,
    NoMemory = -4,
    NoResource = -5,
    OutOfRange = -6,
    Busy = -7,
    AlreadyExists = -8,
    NoMessage = -9,
    InvalidAddress = -10,
    InvalidConfig = -11,
    IoError = -12,

    // -- the operation
    MessageTruncated = -20,
    Canceled = -21,
    TimedOut = -22,
    Aborted = -23,

    // -- the peer or connection
    PeerFailed = -40,
    Unreachable = -41,
    NotConnected = -42,
    ConnectionReset = -43,
    Rejected = -44,

    // -- devices and drivers
    NoDevice = -60,
    DeviceError = -61,
    LibraryMissing = -62,

    // -- the library itself
    Internal = -80,
}

/// Every value above; used by the C header test and `gsc-info` so the list is written once.
pub const ALL_STATUSES: &[Status] = &[
    Status::Ok,
    Status::InProgress,
    Status::InvalidParam,
    Status::InvalidHandle,
    Status::Unsupported,
    Status::NoMemory,
    Status::NoResource,
    Status::OutOfRange,
    Status::Busy,
    Status::AlreadyExists,
    Status::NoMessage,
    Status::InvalidAddress,
    Status::InvalidConfig,
    Status::IoError,
    Status::MessageTruncated,
    Status::Canceled,
    Status::TimedOut,
    Status::Aborted,
    Status::PeerFailed,
    Status::Unreachable,
    Status::NotConnected,
    Status::ConnectionReset,
    Status::Rejected,
    Status::NoDevice,
    Status::DeviceError,
    Status::LibraryMissing,
    Status::Internal,
];

/// Lower bound of the error codes; status pointers at or above it (as unsigned) are errors.
pub const ERR_LAST: i32 = -100;

impl Status {
    pub fn code(self) -> i32 {
        self as i32
    }

    pub fn from_code(code: i32) -> Option<Status> {
        ALL_STATUSES.iter().copied().find(|s| s.code() == code)
    }

    pub fn is_error(self) -> bool {
        self.code() < 0
    }

    /// The C name of the code, as in include/gsc.h.
    pub fn c_name(self) -> &'static str {
        match self {
            Status::Ok => "GSC_OK",
            Status::InProgress => "GSC_INPROGRESS",
            Status::InvalidParam => "GSC_ERR_INVALID_PARAM",
            Status::InvalidHandle => "GSC_ERR_INVALID_HANDLE",
            Status::Unsupported => "GSC_ERR_UNSUPPORTED",
            Status::NoMemory => "GSC_ERR_NO_MEMORY",
            Status::NoResource => "GSC_ERR_NO_RESOURCE",
            Status::OutOfRange => "GSC_ERR_OUT_OF_RANGE",
            Status::Busy => "GSC_ERR_BUSY",
            Status::AlreadyExists => "GSC_ERR_ALREADY_EXISTS",
            Status::NoMessage => "GSC_ERR_NO_MESSAGE",
            Status::InvalidAddress => "GSC_ERR_INVALID_ADDRESS",
            Status::InvalidConfig => "GSC_ERR_INVALID_CONFIG",
            Status::IoError => "GSC_ERR_IO_ERROR",
            Status::MessageTruncated => "GSC_ERR_MESSAGE_TRUNCATED",
            Status::Canceled => "GSC_ERR_CANCELED",
            Status::TimedOut => "GSC_ERR_TIMED_OUT",
            Status::Aborted => "GSC_ERR_ABORTED",
            Status::PeerFailed => "GSC_ERR_PEER_FAILED",
            Status::Unreachable => "GSC_ERR_UNREACHABLE",
            Status::NotConnected => "GSC_ERR_NOT_CONNECTED",
            Status::ConnectionReset => "GSC_ERR_CONNECTION_RESET",
            Status::Rejected => "GSC_ERR_REJECTED",
            Status::NoDevice => "GSC_ERR_NO_DEVICE",
            Status::DeviceError => "GSC_ERR_DEVICE",
            Status::LibraryMissing => "GSC_ERR_LIBRARY_MISSING",
            Status::Internal => "GSC_ERR_INTERNAL",
        }
    }

    /// Human text, as returned by `gsc_status_string`. NUL-terminated for the C side.
    pub fn description_c(self) -> &'static str {
        match self {
            Status::Ok => "success\0",
            Status::InProgress => "operation in progress\0",
            Status::InvalidParam => "invalid parameter\0",
            Status::InvalidHandle => "invalid, stale or already released handle\0",
            Status::Unsupported => "operation not supported\0",
            Status::NoMemory => "out of memory\0",
            Status::NoResource => "resources temporarily exhausted\0",
            Status::OutOfRange => "value or address out of range\0",
            Status::Busy => "object busy (operations in flight)\0",
            Status::AlreadyExists => "already exists\0",
            Status::NoMessage => "no matching message\0",
            Status::InvalidAddress => "invalid or corrupt worker address\0",
            Status::InvalidConfig => "invalid configuration value\0",
            Status::IoError => "input/output error\0",
            Status::MessageTruncated => "message truncated: receive buffer too small\0",
            Status::Canceled => "request canceled\0",
            Status::TimedOut => "timed out\0",
            Status::Aborted => "aborted\0",
            Status::PeerFailed => "peer failed (process died or stopped answering)\0",
            Status::Unreachable => "peer unreachable by any enabled lane\0",
            Status::NotConnected => "endpoint closed or not connected\0",
            Status::ConnectionReset => "connection reset by peer\0",
            Status::Rejected => "connection rejected (authentication or version mismatch)\0",
            Status::NoDevice => "no such device\0",
            Status::DeviceError => "device or driver error\0",
            Status::LibraryMissing => "a required shared library could not be loaded\0",
            Status::Internal => "internal error\0",
        }
    }

    pub fn description(self) -> &'static str {
        let s = self.description_c();
        &s[..s.len() - 1]
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.description())
    }
}

/// An error: a stable status plus a message that names what was wrong.
#[derive(Clone, PartialEq, Eq)]
pub struct Error {
    status: Status,
    message: Cow<'static, str>,
}

impl Error {
    pub fn new(status: Status, message: impl Into<Cow<'static, str>>) -> Error {
        debug_assert!(status.is_error(), "Error built from non-error status {status:?}");
        Error { status, message: message.into() }
    }

    pub fn status(&self) -> Status {
        self.status
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    pub fn invalid_param(message: impl Into<Cow<'static, str>>) -> Error {
        Error::new(Status::InvalidParam, message)
    }

    pub fn unsupported(message: impl Into<Cow<'static, str>>) -> Error {
        Error::new(Status::Unsupported, message)
    }

    pub fn io(context: &str, err: std::io::Error) -> Error {
        Error::new(Status::IoError, format!("{context}: {err}"))
    }

    /// Prefix the message with more context, keeping the status.
    pub fn context(self, what: impl fmt::Display) -> Error {
        Error { status: self.status, message: format!("{what}: {}", self.message).into() }
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({})", self.status.c_name(), self.message)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status.description(), self.message)
    }
}

impl std::error::Error for Error {}

impl From<Status> for Error {
    fn from(status: Status) -> Error {
        Error::new(status, status.description())
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_unique_and_in_their_scope() {
        let mut seen = std::collections::HashSet::new();
        for s in ALL_STATUSES {
            assert!(seen.insert(s.code()), "duplicate code {}", s.code());
            assert_eq!(Status::from_code(s.code()), Some(*s));
            assert!(s.code() > ERR_LAST);
            assert!(s.description_c().ends_with('\0'));
            assert!(s.c_name().starts_with("GSC_"));
        }
        assert_eq!(Status::Ok.code(), 0);
        assert_eq!(Status::InProgress.code(), 1);
        assert!(Status::from_code(-99).is_none());
    }

    #[test]
    fn error_display_names_the_problem() {
        let e = Error::invalid_param("tag_mask is zero").context("gsc_tag_recv_nbx");
        assert_eq!(e.status(), Status::InvalidParam);
        assert_eq!(e.to_string(), "invalid parameter: gsc_tag_recv_nbx: tag_mask is zero");
    }
}
