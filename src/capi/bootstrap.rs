//! Bootstrap exports: how the processes of a C program find each other (see `crate::bootstrap`).

use super::handles;
use super::panic::ffi_guard;
use crate::bootstrap::{Bootstrap, BootstrapOptions, UNIQUE_ID_BYTES, UniqueId, detect};
use crate::error::{Error, Result, Status};
use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::Arc;

const _: () = assert!(UNIQUE_ID_BYTES == 128, "gsc_unique_id_t in gsc.h holds 128 bytes");

/// `gsc_unique_id_t`
#[repr(C)]
pub struct CUniqueId {
    pub internal: [u8; UNIQUE_ID_BYTES],
}

/// Opaque C handle type (by type only).
#[repr(C)]
pub struct CBootstrap {
    _opaque: [u8; 0],
}

/// The C string form's length including the NUL (`GSC_UNIQUE_ID_STRING_LEN`).
pub(crate) const UNIQUE_ID_STRING_LEN: usize = 2 * UNIQUE_ID_BYTES + 1;

/// # Safety
/// `uid` is NULL or readable.
unsafe fn read_uid(uid: *const CUniqueId) -> Result<UniqueId> {
    if uid.is_null() {
        return Err(Error::invalid_param("unique id is NULL"));
    }
    // SAFETY: non-NULL and readable by the caller's contract.
    UniqueId::from_bytes(unsafe { &(*uid).internal })
}

fn rank_arg(v: c_int, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::invalid_param(format!("{what} is negative ({v})")))
}

/// # Safety
/// `bootstrap_p` is NULL-checked by the caller and writable.
unsafe fn give(b: Bootstrap, bootstrap_p: *mut *mut CBootstrap) {
    let h = handles::register(Arc::new(b), std::ptr::null());
    // SAFETY: checked non-NULL by the caller; writable by the C caller's contract.
    unsafe { bootstrap_p.write(h as *mut CBootstrap) };
}

/// `gsc_get_unique_id`
///
/// # Safety
/// `uid` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_get_unique_id(uid: *mut CUniqueId) -> i32 {
    ffi_guard("gsc_get_unique_id", || {
        if uid.is_null() {
            return Err(Error::invalid_param("uid is NULL"));
        }
        let id = UniqueId::create(None)?;
        // SAFETY: non-NULL (checked), writable by the caller's contract.
        unsafe { (*uid).internal = id.to_bytes() };
        Ok(Status::Ok.code())
    })
}

/// `gsc_unique_id_to_string`
///
/// # Safety
/// `uid` is NULL or readable; `buffer` is NULL or writable for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_unique_id_to_string(uid: *const CUniqueId, buffer: *mut c_char, length: usize) -> i32 {
    ffi_guard("gsc_unique_id_to_string", || {
        // SAFETY: forwarded caller contract.
        let id = unsafe { read_uid(uid) }?;
        if buffer.is_null() {
            return Err(Error::invalid_param("buffer is NULL"));
        }
        if length < UNIQUE_ID_STRING_LEN {
            return Err(Error::invalid_param(format!(
                "buffer of {length} bytes; the string needs {UNIQUE_ID_STRING_LEN} (GSC_UNIQUE_ID_STRING_LEN)"
            )));
        }
        let text = id.to_string();
        debug_assert_eq!(text.len() + 1, UNIQUE_ID_STRING_LEN);
        // SAFETY: `buffer` is writable for `length` >= text.len() + 1 bytes (checked above).
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buffer as *mut u8, text.len());
            buffer.add(text.len()).write(0);
        }
        Ok(Status::Ok.code())
    })
}

/// `gsc_unique_id_from_string`
///
/// # Safety
/// `text` is NULL or NUL-terminated; `uid` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_unique_id_from_string(text: *const c_char, uid: *mut CUniqueId) -> i32 {
    ffi_guard("gsc_unique_id_from_string", || {
        if text.is_null() || uid.is_null() {
            return Err(Error::invalid_param(if text.is_null() { "string is NULL" } else { "uid is NULL" }));
        }
        // SAFETY: non-NULL, NUL-terminated by the caller's contract.
        let s = unsafe { CStr::from_ptr(text) }.to_str().map_err(|_| Error::invalid_param("unique id string is not ASCII hex"))?;
        let id: UniqueId = s.parse()?;
        // SAFETY: non-NULL (checked), writable by the caller's contract.
        unsafe { (*uid).internal = id.to_bytes() };
        Ok(Status::Ok.code())
    })
}

/// `gsc_bootstrap_init`
///
/// # Safety
/// `uid` is NULL or readable; `bootstrap_p` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_bootstrap_init(uid: *const CUniqueId, rank: c_int, nranks: c_int, bootstrap_p: *mut *mut CBootstrap) -> i32 {
    ffi_guard("gsc_bootstrap_init", || {
        if bootstrap_p.is_null() {
            return Err(Error::invalid_param("bootstrap_p is NULL"));
        }
        // SAFETY: forwarded caller contract.
        let id = unsafe { read_uid(uid) }?;
        let (rank, nranks) = (rank_arg(rank, "rank")?, rank_arg(nranks, "nranks")?);
        // The same GSC_BOOTSTRAP_TIMEOUT the launcher path reads.
        let timeout = BootstrapOptions::from_env()?.timeout;
        let b = Bootstrap::init(&id, rank, nranks, timeout)?;
        // SAFETY: checked non-NULL above.
        unsafe { give(b, bootstrap_p) };
        Ok(Status::Ok.code())
    })
}

/// `gsc_bootstrap_init_from_env`
///
/// # Safety
/// `bootstrap_p` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_bootstrap_init_from_env(bootstrap_p: *mut *mut CBootstrap) -> i32 {
    ffi_guard("gsc_bootstrap_init_from_env", || {
        if bootstrap_p.is_null() {
            return Err(Error::invalid_param("bootstrap_p is NULL"));
        }
        let info = detect()?.ok_or_else(|| {
            Error::invalid_param("no launcher detected (set GSC_RANK and GSC_NRANKS, or run under mpirun, srun or torchrun)")
        })?;
        let opts = BootstrapOptions::from_env()?;
        let b = Bootstrap::from_launcher(&opts, &info)?;
        // SAFETY: checked non-NULL above.
        unsafe { give(b, bootstrap_p) };
        Ok(Status::Ok.code())
    })
}

/// `gsc_bootstrap_rank`
///
/// # Safety
/// `rank_p` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_bootstrap_rank(bootstrap: *mut CBootstrap, rank_p: *mut c_int) -> i32 {
    ffi_guard("gsc_bootstrap_rank", || {
        let b: Arc<Bootstrap> = handles::get(bootstrap as *const c_void)?;
        if rank_p.is_null() {
            return Err(Error::invalid_param("rank_p is NULL"));
        }
        // SAFETY: non-NULL (checked), writable by the caller's contract. Ranks fit an int: they
        // came from ints or from a launcher's rank count.
        unsafe { rank_p.write(b.rank() as c_int) };
        Ok(Status::Ok.code())
    })
}

/// `gsc_bootstrap_nranks`
///
/// # Safety
/// `nranks_p` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_bootstrap_nranks(bootstrap: *mut CBootstrap, nranks_p: *mut c_int) -> i32 {
    ffi_guard("gsc_bootstrap_nranks", || {
        let b: Arc<Bootstrap> = handles::get(bootstrap as *const c_void)?;
        if nranks_p.is_null() {
            return Err(Error::invalid_param("nranks_p is NULL"));
        }
        // SAFETY: as in `gsc_bootstrap_rank`.
        unsafe { nranks_p.write(b.nranks() as c_int) };
        Ok(Status::Ok.code())
    })
}

/// `gsc_bootstrap_allgather`
///
/// # Safety
/// `input` is readable for `length` bytes and `output` writable for `nranks * length` bytes
/// (either may be NULL when `length` is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gsc_bootstrap_allgather(
    bootstrap: *mut CBootstrap,
    input: *const c_void,
    length: usize,
    output: *mut c_void,
) -> i32 {
    ffi_guard("gsc_bootstrap_allgather", || {
        let b: Arc<Bootstrap> = handles::get(bootstrap as *const c_void)?;
        if length > 0 && (input.is_null() || output.is_null()) {
            return Err(Error::invalid_param(if input.is_null() { "input is NULL" } else { "output is NULL" }));
        }
        let total = length
            .checked_mul(b.nranks() as usize)
            .ok_or_else(|| Error::invalid_param(format!("{length} bytes times {} ranks overflows", b.nranks())))?;
        let mine: &[u8] = if length == 0 {
            &[]
        } else {
            // SAFETY: non-NULL, readable for `length` bytes by the caller's contract.
            unsafe { std::slice::from_raw_parts(input as *const u8, length) }
        };
        let all = b.allgather(mine)?;
        if let Some((r, v)) = all.iter().enumerate().find(|(_, v)| v.len() != length) {
            return Err(Error::invalid_param(format!(
                "rank {r} contributed {} bytes, this rank {length}: every rank must pass the same length",
                v.len()
            )));
        }
        if total > 0 {
            // SAFETY: `output` is writable for nranks * length = `total` bytes (caller's
            // contract), and each block is `length` bytes (checked above).
            let out = unsafe { std::slice::from_raw_parts_mut(output as *mut u8, total) };
            for (chunk, v) in out.chunks_exact_mut(length).zip(&all) {
                chunk.copy_from_slice(v);
            }
        }
        Ok(Status::Ok.code())
    })
}

/// `gsc_bootstrap_barrier`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_bootstrap_barrier(bootstrap: *mut CBootstrap) -> i32 {
    ffi_guard("gsc_bootstrap_barrier", || {
        let b: Arc<Bootstrap> = handles::get(bootstrap as *const c_void)?;
        b.barrier()?;
        Ok(Status::Ok.code())
    })
}

/// `gsc_bootstrap_destroy`
#[unsafe(no_mangle)]
pub extern "C" fn gsc_bootstrap_destroy(bootstrap: *mut CBootstrap) -> i32 {
    ffi_guard("gsc_bootstrap_destroy", || {
        handles::unregister::<Arc<Bootstrap>>(bootstrap as *const c_void)?;
        Ok(Status::Ok.code())
    })
}
