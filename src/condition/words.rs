//! Where a channel's trigger and done words live.
//!
//! Host streams and tests use plain host memory. CUDA producers need memory both sides can
//! reach: page-locked host memory mapped into the device (the stream's memops and kernels use the
//! device address, the proxy the host address). Each word sits on its own cache line: the device
//! writes one and the proxy the other, and sharing a line would make every write bounce it.

use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

#[repr(C, align(64))]
#[derive(Default)]
struct Line {
    word: AtomicU64,
}

/// The two words of one channel, host-side view, plus their device addresses when a GPU uses them.
pub(crate) struct Words {
    trigger: NonNull<AtomicU64>,
    done: NonNull<AtomicU64>,
    /// (trigger, done) as the GPU addresses them.
    pub(crate) device: Option<(u64, u64)>,
    _backing: Backing,
    /// The device handle in GPU memory, when kernels loop on it (see `cuda::DeviceHandleSlot`);
    /// otherwise the pinned slot's own handle line is used.
    gpu_handle: Option<crate::cuda::DeviceHandleSlot>,
}

enum Backing {
    Host(#[allow(dead_code)] Box<[Line; 2]>),
    /// A slot of mapped page-locked memory (see `cuda::PinnedSlot`).
    Pinned(crate::cuda::PinnedSlot),
}

// SAFETY: the pointers refer to memory the `Words` owns (or keeps alive through `_backing`) for
// its whole life, and they are only used through atomics.
unsafe impl Send for Words {}
// SAFETY: as above; every access is an atomic operation.
unsafe impl Sync for Words {}

impl Words {
    /// Words in ordinary host memory (host streams, tests).
    pub(crate) fn host() -> Words {
        let lines = Box::new([Line::default(), Line::default()]);
        let trigger = NonNull::from(&lines[0].word);
        let done = NonNull::from(&lines[1].word);
        Words { trigger, done, device: None, _backing: Backing::Host(lines), gpu_handle: None }
    }

    /// Words in a mapped page-locked slot (CUDA producers).
    pub(crate) fn pinned(slot: crate::cuda::PinnedSlot) -> Words {
        let (trigger, done) = slot.host_words();
        let device = Some(slot.device_words());
        Words { trigger, done, device, _backing: Backing::Pinned(slot), gpu_handle: None }
    }

    /// The device handle (`gsc_device_handle_t`), for pinned words.
    pub(crate) fn device_handle(&self) -> Option<u64> {
        if let Some(h) = &self.gpu_handle {
            return Some(h.addr());
        }
        match &self._backing {
            Backing::Pinned(s) => Some(s.device_handle()),
            Backing::Host(_) => None,
        }
    }

    /// Point the device handle of pinned words at them with the epoch at `base`: in GPU memory
    /// of `gpu_ctx` when given, else in the pinned slot. Called before any kernel has the handle.
    pub(crate) fn init_device_handle(&mut self, base: u64, gpu_ctx: Option<usize>) -> crate::error::Result<()> {
        let Backing::Pinned(s) = &self._backing else { return Ok(()) };
        s.init_handle(base);
        if let Some(ctx) = gpu_ctx {
            let (t, d) = s.device_words();
            self.gpu_handle = Some(crate::cuda::DeviceHandleSlot::new(crate::cuda::raw(ctx), t, d, base)?);
        }
        Ok(())
    }

    /// Never reuse this memory: a stream may still write a stale trigger into it.
    pub(crate) fn poison(&mut self) {
        if let Backing::Pinned(s) = &mut self._backing {
            s.poison();
        }
    }

    pub(crate) fn trigger(&self) -> &AtomicU64 {
        // SAFETY: see the `Send`/`Sync` note: the backing outlives `self`.
        unsafe { self.trigger.as_ref() }
    }

    pub(crate) fn done(&self) -> &AtomicU64 {
        // SAFETY: as for `trigger`.
        unsafe { self.done.as_ref() }
    }
}
