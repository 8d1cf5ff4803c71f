//! Handles of the C API and the registry that validates them.
//!
//! A context, worker, endpoint, memory, rkey, bootstrap or communicator handle is a `Box<Handle<T>>` turned into a raw
//! pointer. Every live one is listed in a process-wide registry (address -> type tag, parent), and
//! a handle is dereferenced only while the registry's lock is held *and* after it was found there
//! with the right type tag; its magic word is then checked as well. Destroying removes the entry
//! under the write lock before the box is freed, so a destroyed, forged or wrong-type handle is
//! reported as `InvalidHandle` instead of being read. (A freed address reused by a new handle of
//! the same type cannot be told apart from it; the type tag still catches every other mix-up.)
//!
//! The values are cheap clones of the Rust objects (`Context`, `Worker`, `Arc<Endpoint>`, ...):
//! an exported function clones the value out under the lock and calls the Rust API without it,
//! so a handle destroyed by another thread meanwhile does not pull the object from under a call
//! in progress.
//!
//! Children are recorded with their parent (worker -> context, endpoint -> worker, memory ->
//! context). Destroying a parent destroys its remaining children, so no handle outlives what it
//! refers to.

use super::panic::set_last_error;
use crate::bootstrap::Bootstrap;
use crate::collectives::Communicator;
use crate::condition::{Condition, HostStream};
use crate::core::{Context, Endpoint, MemHandle, Prepared, Rkey, Worker};
use crate::error::{Error, Result, Status};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// The heap object a handle points to.
#[repr(C)]
pub(crate) struct Handle<T> {
    magic: u64,
    pub(crate) value: T,
}

/// A type that handles can carry.
pub(crate) trait Kind: Sized + Send + Sync + 'static {
    const MAGIC: u64;
    /// The C type name, for messages.
    const NAME: &'static str;
}

/// A registered region, with the context that can unmap it.
pub(crate) struct MemObj {
    pub(crate) context: Context,
    pub(crate) mem: MemHandle,
}

impl Kind for Context {
    const MAGIC: u64 = u64::from_le_bytes(*b"gscCTX01");
    const NAME: &'static str = "gsc_context_h";
}
impl Kind for Worker {
    const MAGIC: u64 = u64::from_le_bytes(*b"gscWRK01");
    const NAME: &'static str = "gsc_worker_h";
}
impl Kind for Arc<Endpoint> {
    const MAGIC: u64 = u64::from_le_bytes(*b"gscEP001");
    const NAME: &'static str = "gsc_ep_h";
}
impl Kind for MemObj {
    const MAGIC: u64 = u64::from_le_bytes(*b"gscMEM01");
    const NAME: &'static str = "gsc_mem_h";
}
impl Kind for Rkey {
    const MAGIC: u64 = u64::from_le_bytes(*b"gscRKY01");
    const NAME: &'static str = "gsc_rkey_h";
}
impl Kind for Arc<Prepared> {
    const MAGIC: u64 = u64::from_le_bytes(*b"gscPREP1");
    const NAME: &'static str = "gsc_prepared_h";
}
impl Kind for Arc<Bootstrap> {
    const MAGIC: u64 = u64::from_le_bytes(*b"gscBOOT1");
    const NAME: &'static str = "gsc_bootstrap_h";
}

impl Kind for Arc<Communicator> {
    const MAGIC: u64 = u64::from_le_bytes(*b"gscCOMM1");
    const NAME: &'static str = "gsc_comm_h";
}

/// A memory window of a communicator (`gsc_comm_win_h`), a child of its handle.
impl Kind for crate::collectives::Window {
    const MAGIC: u64 = u64::from_le_bytes(*b"gscCWIN1");
    const NAME: &'static str = "gsc_comm_win_h";
}

/// A buffer registered with a communicator (`gsc_comm_reg_h`), a child of its handle.
impl Kind for crate::collectives::Registration {
    const MAGIC: u64 = u64::from_le_bytes(*b"gscCREG1");
    const NAME: &'static str = "gsc_comm_reg_h";
}

impl Kind for Condition {
    const MAGIC: u64 = u64::from_le_bytes(*b"gscCOND1");
    const NAME: &'static str = "gsc_condition_h";
}
impl Kind for HostStream {
    const MAGIC: u64 = u64::from_le_bytes(*b"gscHSTR1");
    const NAME: &'static str = "gsc_host_stream_h";
}

#[derive(Copy, Clone)]
struct Entry {
    magic: u64,
    /// The parent handle's address, 0 for none.
    parent: usize,
}

fn registry() -> &'static RwLock<HashMap<usize, Entry>> {
    static REGISTRY: OnceLock<RwLock<HashMap<usize, Entry>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

// Poisoning cannot leave the map inconsistent (each update is a single insert or remove), so a
// panic elsewhere must not make every later call fail.
fn read() -> RwLockReadGuard<'static, HashMap<usize, Entry>> {
    registry().read().unwrap_or_else(|e| e.into_inner())
}

fn write() -> RwLockWriteGuard<'static, HashMap<usize, Entry>> {
    registry().write().unwrap_or_else(|e| e.into_inner())
}

/// Box `value` as a new handle whose parent is `parent` (null for none).
pub(crate) fn register<T: Kind>(value: T, parent: *const c_void) -> *mut c_void {
    let ptr = Box::into_raw(Box::new(Handle { magic: T::MAGIC, value }));
    write().insert(ptr as usize, Entry { magic: T::MAGIC, parent: parent as usize });
    ptr as *mut c_void
}

/// Run `f` on the value of handle `ptr` (a `T`), under the registry lock. `f` should only clone
/// what it needs: the lock is shared by every handle of the process.
pub(crate) fn with<T: Kind, R>(ptr: *const c_void, f: impl FnOnce(&T) -> R) -> Result<R> {
    let reg = read();
    check::<T>(&reg, ptr)?;
    // SAFETY: `ptr` is in the registry with `T`'s tag, so it came from `register::<T>` and has not
    // been freed: freeing happens only after removal under the write lock, which cannot be taken
    // while we hold the read lock. The value is only read through a shared reference.
    let handle = unsafe { &*(ptr as *const Handle<T>) };
    if handle.magic != T::MAGIC {
        return Err(Error::new(Status::Internal, format!("{}: registered handle {ptr:p} has a corrupt magic word", T::NAME)));
    }
    Ok(f(&handle.value))
}

/// A clone of handle `ptr`'s value.
pub(crate) fn get<T: Kind + Clone>(ptr: *const c_void) -> Result<T> {
    with(ptr, T::clone)
}

fn check<T: Kind>(reg: &HashMap<usize, Entry>, ptr: *const c_void) -> Result<()> {
    if ptr.is_null() {
        return Err(Error::new(Status::InvalidHandle, format!("{} is NULL", T::NAME)));
    }
    match reg.get(&(ptr as usize)) {
        Some(e) if e.magic == T::MAGIC => Ok(()),
        Some(e) => Err(Error::new(Status::InvalidHandle, format!("{ptr:p} is a {}, not a {}", name_of(e.magic), T::NAME))),
        None => Err(Error::new(Status::InvalidHandle, format!("{ptr:p} is not a live {} (destroyed, or never created)", T::NAME))),
    }
}

fn name_of(magic: u64) -> &'static str {
    match magic {
        m if m == Context::MAGIC => Context::NAME,
        m if m == Worker::MAGIC => Worker::NAME,
        m if m == <Arc<Endpoint>>::MAGIC => <Arc<Endpoint>>::NAME,
        m if m == MemObj::MAGIC => MemObj::NAME,
        m if m == Rkey::MAGIC => Rkey::NAME,
        m if m == <Arc<Bootstrap>>::MAGIC => <Arc<Bootstrap>>::NAME,
        m if m == Condition::MAGIC => Condition::NAME,
        m if m == <Arc<Communicator>>::MAGIC => <Arc<Communicator>>::NAME,
        m if m == HostStream::MAGIC => HostStream::NAME,
        m if m == <Arc<Prepared>>::MAGIC => <Arc<Prepared>>::NAME,
        m if m == crate::collectives::Registration::MAGIC => crate::collectives::Registration::NAME,
        m if m == crate::collectives::Window::MAGIC => crate::collectives::Window::NAME,
        _ => "unknown handle",
    }
}

/// The handle's parent (as registered), if `ptr` is a live `T`.
pub(crate) fn parent_of<T: Kind>(ptr: *const c_void) -> Result<*const c_void> {
    let reg = read();
    check::<T>(&reg, ptr)?;
    Ok(reg[&(ptr as usize)].parent as *const c_void)
}

/// Remove handle `ptr` (a `T`) and every descendant from the registry, then free them: the
/// handle's value is returned, descendants are released (see `release`). Fails, changing
/// nothing, if `ptr` is not a live `T`.
pub(crate) fn unregister<T: Kind>(ptr: *const c_void) -> Result<T> {
    let removed = {
        let mut reg = write();
        check::<T>(&reg, ptr)?;
        let mut removed = vec![(ptr as usize, reg.remove(&(ptr as usize)).expect("checked"))];
        let mut i = 0;
        while i < removed.len() {
            let parent = removed[i].0;
            let children: Vec<usize> = reg.iter().filter(|(_, e)| e.parent == parent).map(|(a, _)| *a).collect();
            for c in children {
                let e = reg.remove(&c).expect("listed");
                removed.push((c, e));
            }
            i += 1;
        }
        removed
    };
    // Free outside the lock: dropping a worker or endpoint takes the worker's own lock.
    let mut it = removed.into_iter();
    let (own, _) = it.next().expect("the handle itself");
    // SAFETY: `own` was registered by `register::<T>` (checked above) and is now out of the
    // registry, so no other call can reach it; we own the box.
    let handle = unsafe { Box::from_raw(own as *mut Handle<T>) };
    // Children are released deepest first so that e.g. endpoints go before their worker.
    let children: Vec<(usize, Entry)> = it.collect();
    if !children.is_empty() {
        tracing::warn!(
            target: crate::log::CAPI,
            handle = T::NAME,
            children = children.len(),
            "destroyed with live child handles (endpoints, workers or memory regions); released them too"
        );
    }
    for (addr, e) in children.into_iter().rev() {
        release(addr, e.magic);
    }
    Ok(handle.value)
}

/// Free a descendant removed from the registry, undoing what it holds (memory is unmapped).
fn release(addr: usize, magic: u64) {
    // SAFETY (every arm): `addr` was registered with this magic by `register::<T>` for the
    // matching `T`, and has just been removed from the registry, so we own the box.
    match magic {
        m if m == Context::MAGIC => drop(unsafe { Box::from_raw(addr as *mut Handle<Context>) }),
        m if m == Worker::MAGIC => drop(unsafe { Box::from_raw(addr as *mut Handle<Worker>) }),
        m if m == <Arc<Endpoint>>::MAGIC => drop(unsafe { Box::from_raw(addr as *mut Handle<Arc<Endpoint>>) }),
        // Dropping releases it (at once, or when its round in flight ends).
        m if m == <Arc<Prepared>>::MAGIC => drop(unsafe { Box::from_raw(addr as *mut Handle<Arc<Prepared>>) }),
        m if m == MemObj::MAGIC => {
            let h = unsafe { Box::from_raw(addr as *mut Handle<MemObj>) };
            let MemObj { context, mem } = h.value;
            if let Err(e) = context.mem_unmap(mem) {
                tracing::warn!(target: crate::log::CAPI, error = %e, "unmapping a region of a destroyed context");
            }
        }
        m if m == Rkey::MAGIC => drop(unsafe { Box::from_raw(addr as *mut Handle<Rkey>) }),
        m if m == <Arc<Bootstrap>>::MAGIC => drop(unsafe { Box::from_raw(addr as *mut Handle<Arc<Bootstrap>>) }),
        m if m == <Arc<Communicator>>::MAGIC => drop(unsafe { Box::from_raw(addr as *mut Handle<Arc<Communicator>>) }),
        m if m == crate::collectives::Registration::MAGIC => {
            drop(unsafe { Box::from_raw(addr as *mut Handle<crate::collectives::Registration>) })
        }
        // Released with its communicator, which takes its windows along.
        m if m == crate::collectives::Window::MAGIC => drop(unsafe { Box::from_raw(addr as *mut Handle<crate::collectives::Window>) }),
        _ => {
            // Unreachable: only `register` inserts, with one of the magics above. Leaking is
            // the only safe reaction to not knowing the type.
            set_last_error(format!("internal: registry entry {addr:#x} has an unknown type tag"));
        }
    }
}

/// Buffers the library hands out (worker addresses, packed rkeys) until the user releases them.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub(crate) enum BufKind {
    /// A worker address, with the worker handle it came from.
    Address {
        worker: usize,
    },
    Rkey,
}

type Buffers = std::sync::Mutex<HashMap<usize, (BufKind, Box<[u8]>)>>;

fn buffers() -> &'static Buffers {
    static BUFFERS: OnceLock<Buffers> = OnceLock::new();
    BUFFERS.get_or_init(Default::default)
}

/// Hand out a copy of `bytes` (never empty) as a library-owned buffer.
pub(crate) fn give_buffer(kind: BufKind, bytes: &[u8]) -> (*mut c_void, usize) {
    debug_assert!(!bytes.is_empty(), "an empty buffer has no unique address");
    let mut b: Box<[u8]> = bytes.into();
    let ptr = b.as_mut_ptr() as *mut c_void;
    buffers().lock().unwrap_or_else(|e| e.into_inner()).insert(ptr as usize, (kind, b));
    (ptr, bytes.len())
}

/// Take back a buffer handed out by `give_buffer` with kind `kind`, freeing it.
pub(crate) fn take_buffer(ptr: *const c_void, kind: BufKind, what: &str) -> Result<()> {
    if ptr.is_null() {
        return Err(Error::invalid_param(format!("{what} is NULL")));
    }
    let mut map = buffers().lock().unwrap_or_else(|e| e.into_inner());
    match map.get(&(ptr as usize)) {
        Some((k, _)) if *k == kind => {
            map.remove(&(ptr as usize));
            Ok(())
        }
        Some((BufKind::Address { .. }, _)) if matches!(kind, BufKind::Address { .. }) => {
            Err(Error::invalid_param(format!("{what} {ptr:p} belongs to another worker")))
        }
        Some(_) => Err(Error::invalid_param(format!("{what} {ptr:p} is a different kind of library buffer"))),
        None => Err(Error::new(Status::InvalidHandle, format!("{what} {ptr:p} was not handed out by gscomm, or was already released"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn handles_are_checked_for_liveness_and_type_and_children_go_with_parents() {
        let ctx = Context::new(Config::default()).unwrap();
        let w = ctx.create_worker().unwrap();
        let hc = register(ctx.clone(), std::ptr::null());
        let hw = register(w, hc);
        assert!(get::<Context>(hc).is_ok());
        assert!(get::<Worker>(hw).is_ok());
        assert_eq!(get::<Worker>(hc).err().map(|e| e.status()), Some(Status::InvalidHandle));
        assert_eq!(get::<Worker>(std::ptr::null()).err().map(|e| e.status()), Some(Status::InvalidHandle));
        let forged = 0x1000 as *const c_void;
        assert_eq!(get::<Context>(forged).err().map(|e| e.status()), Some(Status::InvalidHandle));
        assert_eq!(parent_of::<Worker>(hw).unwrap(), hc as *const c_void);

        unregister::<Context>(hc).unwrap();
        assert_eq!(get::<Worker>(hw).err().map(|e| e.status()), Some(Status::InvalidHandle), "child released with its parent");
        assert_eq!(unregister::<Context>(hc).err().map(|e| e.status()), Some(Status::InvalidHandle), "double destroy");
    }

    #[test]
    fn buffers_are_released_once_and_by_kind() {
        let (p, n) = give_buffer(BufKind::Rkey, b"abc");
        assert_eq!(n, 3);
        assert_eq!(take_buffer(p, BufKind::Address { worker: 1 }, "address").unwrap_err().status(), Status::InvalidParam);
        take_buffer(p, BufKind::Rkey, "rkey buffer").unwrap();
        assert_eq!(take_buffer(p, BufKind::Rkey, "rkey buffer").unwrap_err().status(), Status::InvalidHandle);
    }
}
