//! NCCL mode: a borrowed NCCL communicator for the one-call-per-rank vocabulary-parallel ops.
use std::cell::Cell;
use std::ffi::c_void;
use std::marker::PhantomData;
use std::ptr::{self, NonNull};

use crate::error::{check, Error, Result, Status};
use crate::handle::Handle;
use crate::sys;

/// A caller's NCCL communicator borrowed for NCCL mode (`fce_comm_t`), released on drop; the NCCL
/// communicator itself stays the caller's.
///
/// NCCL mode runs a vocabulary-parallel op in one call per rank: the shard's records, their all-gather
/// over the communicator on the handle's stream, their combine in rank order, and the shard's gradient
/// where asked ([`Handle::cross_entropy_fwd_vp`], [`Handle::logsumexp_vp`], [`Handle::temp_softmax_vp`],
/// [`Handle::kd_fwd_vp`], [`Handle::linear_cross_entropy_fwd_vp`]). Every rank gets the same bits, those of
/// the partial and combine calls on one device over the same shards. NCCL is loaded by the library at run
/// time (`libnccl.so.2`), never linked. NCCL's rules hold: every rank makes the same calls in the same
/// order, no call inside an open `ncclGroupStart`/`ncclGroupEnd`, one thread per communicator at a time
/// (`Comm` is `Send`, not `Sync`):
///
/// ```compile_fail
/// fn shared<T: Sync>() {}
/// shared::<fusedce::Comm>();
/// ```
pub struct Comm {
    raw: NonNull<sys::fce_comm>,
    rank: i32,
    size: i32,
    _not_sync: PhantomData<Cell<()>>,
}

// SAFETY: the library's comm object holds the communicator's rank, size and device; NCCL allows a
// communicator to be used from any one thread at a time, and `Comm` is not `Sync`.
unsafe impl Send for Comm {}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: `raw` came from fce_comm_create and is destroyed once; the NCCL communicator is not.
        unsafe {
            sys::fce_comm_destroy(self.raw.as_ptr());
        }
    }
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm").field("rank", &self.rank).field("size", &self.size).finish()
    }
}

impl Comm {
    /// Borrows `nccl_comm` (an `ncclComm_t`) for the NCCL-mode ops of `handle`'s device
    /// (`fce_comm_create`, then `fce_comm_info` for [`Comm::rank`] and [`Comm::size`]).
    ///
    /// Errors: `INVALID_ARGUMENT` (a null `nccl_comm`, a CPU handle), `DEVICE_MISMATCH` (the communicator
    /// is on another device than the handle), `COMMUNICATOR_ERROR` (NCCL cannot be loaded, or
    /// `ncclCommCount` / `ncclCommUserRank` / `ncclCommCuDevice` fail; the message has NCCL's text).
    ///
    /// # Safety
    /// `nccl_comm` must be null or an initialized NCCL communicator (a non-blocking one finished
    /// initializing) that outlives the returned `Comm` and every op enqueued with it.
    pub unsafe fn new(handle: &Handle, nccl_comm: *mut c_void) -> Result<Comm> {
        let mut raw: sys::fce_comm_t = ptr::null_mut();
        check(sys::fce_comm_create(handle.as_raw(), nccl_comm.cast::<sys::ncclComm>(), &mut raw))?;
        let raw = NonNull::new(raw)
            .ok_or_else(|| Error::new(Status::INTERNAL_ERROR, "fce_comm_create succeeded but returned NULL"))?;
        let (mut rank, mut size) = (0i32, 0i32);
        if let Err(e) = check(sys::fce_comm_info(raw.as_ptr(), &mut rank, &mut size)) {
            sys::fce_comm_destroy(raw.as_ptr());
            return Err(e);
        }
        Ok(Comm { raw, rank, size, _not_sync: PhantomData })
    }

    /// This rank, 0 ≤ rank < [`Comm::size`]: its shard must be the `rank`-th in vocabulary order.
    pub fn rank(&self) -> i32 {
        self.rank
    }

    /// The number of ranks W.
    pub fn size(&self) -> i32 {
        self.size
    }

    /// The raw object, for `fusedce_sys` calls; it stays owned by `self`.
    pub fn as_raw(&self) -> sys::fce_comm_t {
        self.raw.as_ptr()
    }
}
