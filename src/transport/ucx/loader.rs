//! libucp, opened at run time: the function table and the mapping of UCX status codes.
//!
//! Why at run time: building gscomm must not need UCX, and a machine without it must run every
//! other lane. `libucp.so.0` is opened with `dlopen` the first time a UCX lane is made (`ucp()`);
//! if it is absent that is an error value, `LibraryMissing`, naming the package to install. Every
//! function the lane calls is looked up at load, and a library that lacks one is refused as a
//! whole (`Unsupported`): unlike the verbs engine there is no optional part.
//!
//! Function *types* come from bindgen (`sys::*_fn`); the pointers from `dlsym`. `ucs_status_string`
//! lives in libucs, which libucp depends on; `dlsym` on libucp's handle searches its dependencies.

use std::ffi::{CStr, c_uint, c_void};
use std::ptr::NonNull;
use std::sync::OnceLock;

use super::sys;
use crate::dynlib::Library;
use crate::error::{Error, Result, Status};

/// UCP, by its ABI soname.
pub const LIBUCP: &str = "libucp.so.0";

/// What to install when libucp is missing, for the error message.
const INSTALL_HINT: &str =
    "install UCX (Debian/Ubuntu: apt-get install libucx0; RHEL/Fedora: dnf install ucx) or put its lib directory in LD_LIBRARY_PATH";

/// Oldest UCX accepted: the bindings were generated from 1.13 headers and use nothing newer.
const MIN_VERSION: (u32, u32) = (1, 13);

/// The UCP entry points the lane calls. All are required.
pub(crate) struct Ucp {
    _lib: Library,
    pub config_read: sys::ucp_config_read_fn,
    pub config_release: sys::ucp_config_release_fn,
    pub config_modify: sys::ucp_config_modify_fn,
    pub init_version: sys::ucp_init_version_fn,
    pub cleanup: sys::ucp_cleanup_fn,
    pub worker_create: sys::ucp_worker_create_fn,
    pub worker_destroy: sys::ucp_worker_destroy_fn,
    pub worker_get_address: sys::ucp_worker_get_address_fn,
    pub worker_release_address: sys::ucp_worker_release_address_fn,
    pub worker_progress: sys::ucp_worker_progress_fn,
    pub worker_set_am_recv_handler: sys::ucp_worker_set_am_recv_handler_fn,
    pub ep_create: sys::ucp_ep_create_fn,
    pub ep_close_nbx: sys::ucp_ep_close_nbx_fn,
    pub ep_flush_nbx: sys::ucp_ep_flush_nbx_fn,
    pub am_send_nbx: sys::ucp_am_send_nbx_fn,
    pub request_check_status: sys::ucp_request_check_status_fn,
    pub request_free: sys::ucp_request_free_fn,
    pub status_string: sys::ucs_status_string_fn,
    pub am_recv_data_nbx: sys::ucp_am_recv_data_nbx_fn,
    pub am_data_release: sys::ucp_am_data_release_fn,
    // Remote memory (rendezvous by get): registration, keys, the get itself.
    pub mem_map: sys::ucp_mem_map_fn,
    pub mem_unmap: sys::ucp_mem_unmap_fn,
    pub rkey_pack: sys::ucp_rkey_pack_fn,
    pub rkey_buffer_release: sys::ucp_rkey_buffer_release_fn,
    pub ep_rkey_unpack: sys::ucp_ep_rkey_unpack_fn,
    pub rkey_destroy: sys::ucp_rkey_destroy_fn,
    pub get_nbx: sys::ucp_get_nbx_fn,
    /// (major, minor, release) of the loaded library.
    pub version: (u32, u32, u32),
}

/// The process's UCP, loaded on first use. `Err(LibraryMissing)` where UCX is not installed.
pub(crate) fn ucp() -> Result<&'static Ucp> {
    static UCP: OnceLock<Result<Ucp>> = OnceLock::new();
    UCP.get_or_init(|| Ucp::load(LIBUCP)).as_ref().map_err(Clone::clone)
}

/// `Library::function` typed with bindgen's `sys::NAME_fn` for the C function `NAME`, or a
/// return with an error naming it: the name looked up and the signature come from one
/// identifier, so they cannot disagree.
macro_rules! required {
    ($lib:expr, $name:expr, $fn_type:ident) => {{
        let symbol = stringify!($fn_type).strip_suffix("_fn").expect("a sys::*_fn type");
        // SAFETY: the type is bindgen's pointer type generated for this very name.
        match unsafe { $lib.function::<sys::$fn_type>(symbol) } {
            Some(f) => f,
            None => return Err(Error::unsupported(format!("{} has no {symbol} (UCX older than 1.13?)", $name))),
        }
    }};
}

impl Ucp {
    /// Open `name` and look up every entry point. `ucp()` uses the soname; tests pass names that
    /// do not exist.
    pub(crate) fn load(name: &str) -> Result<Ucp> {
        let lib =
            Library::open(name).map_err(|why| Error::new(Status::LibraryMissing, format!("{name} not found ({why}); {INSTALL_HINT}")))?;
        let get_version = required!(lib, name, ucp_get_version_fn);
        let (mut major, mut minor, mut release): (c_uint, c_uint, c_uint) = (0, 0, 0);
        // SAFETY: three valid out-pointers.
        unsafe { get_version(&mut major, &mut minor, &mut release) };
        if (major, minor) < MIN_VERSION {
            return Err(Error::unsupported(format!(
                "{name} is UCX {major}.{minor}.{release}; the UCX lane needs {}.{} or newer",
                MIN_VERSION.0, MIN_VERSION.1
            )));
        }
        Ok(Ucp {
            config_read: required!(lib, name, ucp_config_read_fn),
            config_release: required!(lib, name, ucp_config_release_fn),
            config_modify: required!(lib, name, ucp_config_modify_fn),
            init_version: required!(lib, name, ucp_init_version_fn),
            cleanup: required!(lib, name, ucp_cleanup_fn),
            worker_create: required!(lib, name, ucp_worker_create_fn),
            worker_destroy: required!(lib, name, ucp_worker_destroy_fn),
            worker_get_address: required!(lib, name, ucp_worker_get_address_fn),
            worker_release_address: required!(lib, name, ucp_worker_release_address_fn),
            worker_progress: required!(lib, name, ucp_worker_progress_fn),
            worker_set_am_recv_handler: required!(lib, name, ucp_worker_set_am_recv_handler_fn),
            ep_create: required!(lib, name, ucp_ep_create_fn),
            ep_close_nbx: required!(lib, name, ucp_ep_close_nbx_fn),
            ep_flush_nbx: required!(lib, name, ucp_ep_flush_nbx_fn),
            am_send_nbx: required!(lib, name, ucp_am_send_nbx_fn),
            request_check_status: required!(lib, name, ucp_request_check_status_fn),
            request_free: required!(lib, name, ucp_request_free_fn),
            status_string: required!(lib, name, ucs_status_string_fn),
            am_recv_data_nbx: required!(lib, name, ucp_am_recv_data_nbx_fn),
            am_data_release: required!(lib, name, ucp_am_data_release_fn),
            mem_map: required!(lib, name, ucp_mem_map_fn),
            mem_unmap: required!(lib, name, ucp_mem_unmap_fn),
            rkey_pack: required!(lib, name, ucp_rkey_pack_fn),
            rkey_buffer_release: required!(lib, name, ucp_rkey_buffer_release_fn),
            ep_rkey_unpack: required!(lib, name, ucp_ep_rkey_unpack_fn),
            rkey_destroy: required!(lib, name, ucp_rkey_destroy_fn),
            get_nbx: required!(lib, name, ucp_get_nbx_fn),
            version: (major, minor, release),
            _lib: lib,
        })
    }

    pub(crate) fn version_text(&self) -> String {
        let (a, b, c) = self.version;
        format!("{a}.{b}.{c}")
    }

    /// UCX's own words for a status.
    pub(crate) fn describe(&self, st: sys::ucs_status_t::Type) -> String {
        // SAFETY: ucs_status_string takes any value and returns a static NUL-terminated string
        // (or "Unknown error"); never null in UCX 1.x, checked anyway.
        let p = unsafe { (self.status_string)(st) };
        if p.is_null() {
            return format!("UCX status {st}");
        }
        // SAFETY: non-null, static, NUL-terminated.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// An error for UCX status `st` returned by `what`.
    pub(crate) fn error(&self, what: &str, st: sys::ucs_status_t::Type) -> Error {
        Error::new(status_of(st), format!("{what}: {} (UCX status {st})", self.describe(st)))
    }
}

/// The gscomm status closest to a UCX error status.
pub(crate) fn status_of(st: sys::ucs_status_t::Type) -> Status {
    use sys::ucs_status_t::*;
    match st {
        UCS_ERR_NO_MEMORY => Status::NoMemory,
        UCS_ERR_NO_RESOURCE | UCS_ERR_EXCEEDS_LIMIT => Status::NoResource,
        UCS_ERR_INVALID_PARAM => Status::InvalidParam,
        UCS_ERR_UNREACHABLE => Status::Unreachable,
        UCS_ERR_INVALID_ADDR => Status::InvalidAddress,
        UCS_ERR_NOT_IMPLEMENTED | UCS_ERR_UNSUPPORTED => Status::Unsupported,
        UCS_ERR_MESSAGE_TRUNCATED => Status::MessageTruncated,
        UCS_ERR_NO_DEVICE => Status::NoDevice,
        UCS_ERR_BUSY => Status::Busy,
        UCS_ERR_CANCELED => Status::Canceled,
        UCS_ERR_TIMED_OUT => Status::TimedOut,
        UCS_ERR_OUT_OF_RANGE => Status::OutOfRange,
        UCS_ERR_REJECTED => Status::Rejected,
        UCS_ERR_NOT_CONNECTED => Status::NotConnected,
        UCS_ERR_CONNECTION_RESET => Status::ConnectionReset,
        // Link and endpoint failures (transport errors, keepalive timeouts): the peer is gone.
        s if (UCS_ERR_LAST_ENDPOINT_FAILURE..=UCS_ERR_FIRST_LINK_FAILURE).contains(&s) => Status::PeerFailed,
        _ => Status::IoError,
    }
}

/// What a `ucs_status_ptr_t` returned by an `_nbx` call means.
#[derive(Debug)]
pub(crate) enum StatusPtr {
    /// Completed inside the call.
    Done,
    /// Failed inside the call.
    Failed(sys::ucs_status_t::Type),
    /// A request to poll and free.
    Pending(NonNull<c_void>),
}

/// Decode a status pointer the way UCS_PTR_IS_ERR / UCS_PTR_STATUS do: NULL is success, values
/// in the top `-UCS_ERR_LAST` addresses are negated status codes, anything else a request.
pub(crate) fn status_ptr(p: sys::ucs_status_ptr_t) -> StatusPtr {
    let v = p as usize;
    if v == 0 {
        StatusPtr::Done
    } else if v >= (sys::ucs_status_t::UCS_ERR_LAST as isize) as usize {
        StatusPtr::Failed(v as isize as sys::ucs_status_t::Type)
    } else {
        // Non-null: checked just above.
        StatusPtr::Pending(NonNull::new(p).expect("non-null"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_names_the_package() {
        let Err(err) = Ucp::load("libgscomm-test-no-such-ucp.so.0") else { panic!("a library that does not exist loaded") };
        assert_eq!(err.status(), Status::LibraryMissing);
        assert!(err.message().starts_with("libgscomm-test-no-such-ucp.so.0 not found"), "{err:?}");
        assert!(err.message().contains("libucx0"), "the message names the Debian package: {err:?}");
    }

    /// Runs the dlopen/dlsym path for real where UCX is installed (it is on the development and
    /// CI machines); elsewhere checks the missing-library error.
    #[test]
    fn the_installed_library_if_any_has_every_symbol() {
        match Ucp::load(LIBUCP) {
            Err(e) => {
                assert_eq!(e.status(), Status::LibraryMissing, "{e:?}");
                eprintln!("skipped: {e}");
            }
            Ok(u) => {
                assert!(u.version >= (1, 13, 0), "{:?}", u.version);
                assert_eq!(u.describe(sys::ucs_status_t::UCS_OK), "Success");
                let e = u.error("ucp_ep_create", sys::ucs_status_t::UCS_ERR_UNREACHABLE);
                assert_eq!(e.status(), Status::Unreachable);
                assert!(e.message().starts_with("ucp_ep_create: "), "{e:?}");
            }
        }
    }

    #[test]
    fn status_pointers_decode_like_the_ucs_macros() {
        assert!(matches!(status_ptr(std::ptr::null_mut()), StatusPtr::Done));
        let err = sys::ucs_status_t::UCS_ERR_CONNECTION_RESET as isize as *mut c_void;
        assert!(matches!(status_ptr(err), StatusPtr::Failed(sys::ucs_status_t::UCS_ERR_CONNECTION_RESET)));
        let last = sys::ucs_status_t::UCS_ERR_LAST as isize as *mut c_void;
        assert!(matches!(status_ptr(last), StatusPtr::Failed(sys::ucs_status_t::UCS_ERR_LAST)));
        let mut x = 0u64;
        assert!(matches!(status_ptr((&mut x as *mut u64).cast()), StatusPtr::Pending(_)));
    }

    #[test]
    fn ucx_failures_map_to_gscomm_statuses() {
        use sys::ucs_status_t::*;
        assert_eq!(status_of(UCS_ERR_ENDPOINT_TIMEOUT), Status::PeerFailed);
        assert_eq!(status_of(UCS_ERR_FIRST_LINK_FAILURE), Status::PeerFailed);
        assert_eq!(status_of(UCS_ERR_LAST_ENDPOINT_FAILURE), Status::PeerFailed);
        assert_eq!(status_of(UCS_ERR_CONNECTION_RESET), Status::ConnectionReset);
        assert_eq!(status_of(UCS_ERR_UNREACHABLE), Status::Unreachable);
        assert_eq!(status_of(UCS_ERR_IO_ERROR), Status::IoError);
    }
}
