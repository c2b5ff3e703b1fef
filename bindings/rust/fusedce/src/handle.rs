//! The RAII handle and one method per op.
use std::cell::Cell;
use std::ffi::c_void;
use std::marker::PhantomData;
use std::ptr::{self, NonNull};

use crate::comm::Comm;
use crate::error::{check, Error, Result, Status};
use crate::options::{
    CeBwdInputs, CeOptions, CeOutputs, KdOptions, KdOutputs, LinearCeGrads, LinearCeOutputs, LseOptions,
    SoftmaxOptions, Teacher,
};
use crate::raw;
use crate::sys;
use crate::tensor::{Device, TensorMut, TensorRef};

/// A CUDA stream (`cudaStream_t` / `CUstream`, ABI-identical); null is the legacy default stream.
pub type Stream = sys::fce_stream_t;

/// A libfusedce handle for one device (`fce_handle_t`), destroyed on drop.
///
/// It owns what is costly to make (device properties, BLAS handles, a cached workspace). The library
/// allows one thread at a time per handle and different handles concurrently, so `Handle` is `Send`
/// (move it to another thread) but not `Sync` (no sharing between threads):
///
/// ```compile_fail
/// fn shared<T: Sync>() {}
/// shared::<fusedce::Handle>();
/// ```
///
/// Every op runs on the handle's device with the handle's stream ([`Handle::set_stream`], default
/// null) and workspace ([`Handle::set_workspace`], default none: the handle allocates and caches one).
/// On a CPU handle ops run synchronously, rows in parallel on all cores. On a CUDA handle they are
/// asynchronous: outputs are ready when the stream is.
///
/// On failure an op returns an [`Error`] and has written no output (validation precedes all writes).
pub struct Handle {
    raw: NonNull<sys::fce_handle>,
    stream: Stream,
    workspace: *mut c_void,
    workspace_bytes: usize,
    _not_sync: PhantomData<Cell<()>>,
}

// SAFETY: the library allows a handle to be used by any one thread at a time; `Handle` is not `Sync`,
// and every method takes `&self`/`&mut self`, so a moved handle is used by one thread only.
unsafe impl Send for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: `raw` came from fce_handle_create and is destroyed once. The status is ignored: a
        // destructor cannot report it (on CUDA the call synchronizes the device first).
        unsafe {
            sys::fce_handle_destroy(self.raw.as_ptr());
        }
    }
}

impl std::fmt::Debug for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handle").field("raw", &self.raw).field("device", &self.device().ok()).finish()
    }
}

enum Call<'q> {
    Run,
    Query(&'q mut usize),
}

/// Which combine of vocabulary-parallel distillation: `fce_kd_combine` (the records of
/// `fce_kd_partial`) or `fce_kd_terms_combine` (those of `fce_kd_terms_partial`).
#[derive(Clone, Copy)]
enum KdCombine {
    Records,
    Terms,
}

fn dl(t: &Option<TensorRef<'_>>) -> Option<sys::DLTensor> {
    t.as_ref().map(|t| t.as_dl())
}
fn dl_mut(t: &mut Option<TensorMut<'_>>) -> Option<sys::DLTensor> {
    t.as_mut().map(|t| t.as_dl())
}
fn cptr(t: &Option<sys::DLTensor>) -> *const sys::DLTensor {
    t.as_ref().map_or(ptr::null(), |t| t as *const sys::DLTensor)
}
fn mptr(t: &mut Option<sys::DLTensor>) -> *mut sys::DLTensor {
    t.as_mut().map_or(ptr::null_mut(), |t| t as *mut sys::DLTensor)
}

/// The in-place forward forms write the gradient over the logits: `outputs.dlogits` must be None.
fn no_dlogits(outputs: &CeOutputs<'_>, call: &str) -> Result<()> {
    if outputs.dlogits.is_some() {
        return Err(Error::new(
            Status::INVALID_ARGUMENT,
            format!("fusedce (Rust): {} writes the gradient into the logits; outputs.dlogits must be None", call),
        ));
    }
    Ok(())
}

/// Calls `f` with the C outputs struct of `outputs` (its DLTensors live for the call), `dlogits`
/// replacing outputs.dlogits where given (the in-place gradient: the logits themselves).
fn with_ce_outputs(
    outputs: &mut CeOutputs<'_>,
    dlogits: Option<*mut sys::DLTensor>,
    f: impl FnOnce(&sys::fce_ce_outputs_t) -> sys::fce_status_t,
) -> sys::fce_status_t {
    let mut loss = outputs.loss.as_dl();
    let mut lse = dl_mut(&mut outputs.lse);
    let mut zl = dl_mut(&mut outputs.z_loss);
    let mut am = dl_mut(&mut outputs.argmax);
    let mut ent = dl_mut(&mut outputs.entropy);
    let mut dlg = dl_mut(&mut outputs.dlogits);
    let gl = dl(&outputs.grad_loss);
    let ge = dl(&outputs.grad_entropy);
    let mut out = raw::init::<sys::fce_ce_outputs_t>();
    out.loss = &mut loss;
    out.lse = mptr(&mut lse);
    out.z_loss = mptr(&mut zl);
    out.argmax = mptr(&mut am);
    out.entropy = mptr(&mut ent);
    out.dlogits = dlogits.unwrap_or_else(|| mptr(&mut dlg));
    out.grad_loss = cptr(&gl);
    out.grad_entropy = cptr(&ge);
    f(&out)
}

impl Handle {
    /// Creates a handle for `device`: [`Device::Cpu`] or [`Device::Cuda`]`(ordinal)`.
    ///
    /// Errors: `NO_DEVICE` for CUDA without a driver or GPU, an ordinal out of range, or a library
    /// built without CUDA (the message has the CUDA error text); `INVALID_ARGUMENT` for other device
    /// types or a negative ordinal; `OUT_OF_MEMORY`.
    pub fn new(device: Device) -> Result<Handle> {
        let d = device.to_dl();
        let mut raw: sys::fce_handle_t = ptr::null_mut();
        // SAFETY: `raw` is a valid out pointer, written only on success.
        check(unsafe { sys::fce_handle_create(d.device_type as i32, d.device_id, &mut raw) })?;
        let raw = NonNull::new(raw)
            .ok_or_else(|| Error::new(Status::INTERNAL_ERROR, "fce_handle_create succeeded but returned NULL"))?;
        Ok(Handle {
            raw,
            stream: ptr::null_mut(),
            workspace: ptr::null_mut(),
            workspace_bytes: 0,
            _not_sync: PhantomData,
        })
    }

    /// A CPU handle (ops on host memory, rows in parallel on all cores).
    pub fn cpu() -> Result<Handle> {
        Handle::new(Device::Cpu)
    }

    /// A handle for CUDA device `ordinal`; `NO_DEVICE` when there is none.
    pub fn cuda(ordinal: i32) -> Result<Handle> {
        Handle::new(Device::Cuda(ordinal))
    }

    /// The handle's device (`fce_handle_get_device`): [`Device::Cpu`] or [`Device::Cuda`].
    pub fn device(&self) -> Result<Device> {
        let (mut t, mut id) = (0i32, 0i32);
        // SAFETY: valid handle and out pointers.
        check(unsafe { sys::fce_handle_get_device(self.raw.as_ptr(), &mut t, &mut id) })?;
        match t as u32 {
            x if x == sys::kDLCPU => Ok(Device::Cpu),
            x if x == sys::kDLCUDA => Ok(Device::Cuda(id)),
            other => Err(Error::new(Status::INTERNAL_ERROR, format!("unexpected device type {}", other))),
        }
    }

    /// The raw handle, for `fusedce_sys` calls; it stays owned by `self`.
    pub fn as_raw(&self) -> sys::fce_handle_t {
        self.raw.as_ptr()
    }

    /// Sets the CUDA stream every later op is enqueued on (ignored by CPU handles).
    ///
    /// # Safety
    /// `stream` must be null or a valid stream of the handle's device, and stay valid while it is set.
    pub unsafe fn set_stream(&mut self, stream: Stream) {
        self.stream = stream;
    }

    /// The stream ops are enqueued on (null by default).
    pub fn stream(&self) -> Stream {
        self.stream
    }

    /// Gives every later op a caller-owned workspace of `bytes` bytes (check each op's
    /// `*_workspace_size` query); ops then never allocate, so they can be captured in a CUDA graph.
    /// `WORKSPACE_TOO_SMALL` is returned by an op that needs more.
    ///
    /// # Safety
    /// `ptr` must address `bytes` writable bytes on the handle's device, used by nothing else while set
    /// (on CUDA: until the enqueued work that uses it has completed). It must be aligned to
    /// [`crate::WORKSPACE_ALIGNMENT`] (16) bytes, or every op returns `INVALID_ARGUMENT`.
    pub unsafe fn set_workspace(&mut self, ptr: *mut c_void, bytes: usize) {
        self.workspace = ptr;
        self.workspace_bytes = bytes;
    }

    /// Goes back to the handle's own cached workspace (the default).
    pub fn clear_workspace(&mut self) {
        self.workspace = ptr::null_mut();
        self.workspace_bytes = 0;
    }

    // ---------------------------------------------------------------------------------------------
    // Cross-entropy
    // ---------------------------------------------------------------------------------------------

    /// Cross-entropy forward over a large vocabulary by online softmax, never materializing the
    /// softmax; the gradient is fused into the same pass when `outputs.dlogits` is set.
    ///
    /// * `logits`: `[N, V]` fp32, bf16 or fp16.
    /// * `targets`: `[N]` i32 or i64 (class ids; `options.ignore_index` marks ignored rows).
    /// * `outputs`: the loss (nats; `[N]` or a scalar per `options.reduction`) and optional per-row
    ///   statistics and `dlogits` `[N, V]` (logits' dtype). See [`CeOptions`] for the math. With
    ///   [`CeOutputs::grad_entropy`] (`[N]` or scalar fp32) `dlogits` also holds the entropy's gradient,
    ///   grad_entropy_i × dH_i/d(logits) (see there).
    ///
    /// Errors: `INVALID_ARGUMENT` (options out of domain, `grad_entropy` without `dlogits`),
    /// `SHAPE_MISMATCH`, `UNSUPPORTED_DTYPE`, `UNSUPPORTED_LAYOUT`, `DEVICE_MISMATCH`, `ALIASING`,
    /// `OVERFLOW`, `WORKSPACE_TOO_SMALL`, `NOT_IMPLEMENTED`, `CUDA_ERROR`.
    pub fn cross_entropy_fwd(
        &self,
        logits: &TensorRef<'_>,
        targets: &TensorRef<'_>,
        options: &CeOptions<'_>,
        outputs: &mut CeOutputs<'_>,
    ) -> Result<()> {
        let mut l = logits.as_dl();
        self.ce_fwd(&mut l, targets, options, outputs, false, None, Call::Run)
    }

    /// [`Handle::cross_entropy_fwd`] writing the gradient over the logits themselves (in place):
    /// `logits` `[N, V]` is read, then overwritten by d(loss)/d(logits) × grad_loss.
    /// `outputs.dlogits` must be None (else `INVALID_ARGUMENT`).
    pub fn cross_entropy_fwd_in_place(
        &self,
        logits: &mut TensorMut<'_>,
        targets: &TensorRef<'_>,
        options: &CeOptions<'_>,
        outputs: &mut CeOutputs<'_>,
    ) -> Result<()> {
        no_dlogits(outputs, "cross_entropy_fwd_in_place")?;
        let mut l = logits.as_dl();
        self.ce_fwd(&mut l, targets, options, outputs, true, None, Call::Run)
    }

    /// Workspace bytes [`Handle::cross_entropy_fwd`] needs for these arguments (same validation).
    pub fn cross_entropy_fwd_workspace_size(
        &self,
        logits: &TensorRef<'_>,
        targets: &TensorRef<'_>,
        options: &CeOptions<'_>,
        outputs: &mut CeOutputs<'_>,
    ) -> Result<usize> {
        let mut l = logits.as_dl();
        let mut bytes = 0usize;
        self.ce_fwd(&mut l, targets, options, outputs, false, None, Call::Query(&mut bytes))?;
        Ok(bytes)
    }

    /// NCCL mode's cross-entropy forward (`fce_cross_entropy_fwd_vp`), one call per rank: this rank's
    /// shard's records, their all-gather over `comm` on the handle's stream, their combine in rank order,
    /// and with `outputs.dlogits` the shard's gradient from the combined lse. Every rank gets the same
    /// bits, those of [`Handle::cross_entropy_partial`] and [`Handle::cross_entropy_combine`] (then
    /// [`Handle::cross_entropy_bwd`] for the gradient) over the same shards on one device.
    ///
    /// * `logits`: `[N, V_local]` fp32, bf16 or fp16, this rank's global columns
    ///   `[options.vocab_start, options.vocab_start + V_local)` (those at or past `vocab_total` are padding).
    /// * `targets`: `[N]` i32 or i64, global indices, the same on every rank.
    /// * `options`: [`CeOptions::vocab_start`] (this rank's first column, ranks in vocabulary order) and
    ///   [`CeOptions::vocab_total`] required; the rest as for [`Handle::cross_entropy_fwd`], the same on
    ///   every rank.
    /// * `outputs`: as for [`Handle::cross_entropy_fwd`] (the whole rows' loss, lse, z-loss, argmax,
    ///   entropy); `dlogits` `[N, V_local]` the shard's columns of the unsharded gradient, padding 0.
    ///
    /// Errors: the validation statuses of [`Handle::cross_entropy_fwd`] (`INVALID_ARGUMENT` also without
    /// `vocab_total`, on a CPU handle), `DEVICE_MISMATCH` (`comm` on another device), `WORKSPACE_TOO_SMALL`,
    /// `COMMUNICATOR_ERROR` (the all-gather failed), `CUDA_ERROR`.
    pub fn cross_entropy_fwd_vp(
        &self,
        comm: &Comm,
        logits: &TensorRef<'_>,
        targets: &TensorRef<'_>,
        options: &CeOptions<'_>,
        outputs: &mut CeOutputs<'_>,
    ) -> Result<()> {
        let mut l = logits.as_dl();
        self.ce_fwd(&mut l, targets, options, outputs, false, Some(comm), Call::Run)
    }

    /// [`Handle::cross_entropy_fwd_vp`] writing the shard's gradient over its logits (in place);
    /// `outputs.dlogits` must be None (else `INVALID_ARGUMENT`).
    pub fn cross_entropy_fwd_vp_in_place(
        &self,
        comm: &Comm,
        logits: &mut TensorMut<'_>,
        targets: &TensorRef<'_>,
        options: &CeOptions<'_>,
        outputs: &mut CeOutputs<'_>,
    ) -> Result<()> {
        no_dlogits(outputs, "cross_entropy_fwd_vp_in_place")?;
        let mut l = logits.as_dl();
        self.ce_fwd(&mut l, targets, options, outputs, true, Some(comm), Call::Run)
    }

    /// Workspace bytes [`Handle::cross_entropy_fwd_vp`] needs for these arguments (same validation): every
    /// rank's records and the steps' own.
    pub fn cross_entropy_fwd_vp_workspace_size(
        &self,
        comm: &Comm,
        logits: &TensorRef<'_>,
        targets: &TensorRef<'_>,
        options: &CeOptions<'_>,
        outputs: &mut CeOutputs<'_>,
    ) -> Result<usize> {
        let mut l = logits.as_dl();
        let mut bytes = 0usize;
        self.ce_fwd(&mut l, targets, options, outputs, false, Some(comm), Call::Query(&mut bytes))?;
        Ok(bytes)
    }

    #[allow(clippy::too_many_arguments)]
    fn ce_fwd(
        &self,
        logits: *mut sys::DLTensor,
        targets: &TensorRef<'_>,
        options: &CeOptions<'_>,
        outputs: &mut CeOutputs<'_>,
        in_place: bool,
        comm: Option<&Comm>,
        call: Call<'_>,
    ) -> Result<()> {
        let t = targets.as_dl();
        let cw = dl(&options.class_weights);
        let o = options.to_raw(cw.as_ref());
        let dlogits = if in_place { Some(logits) } else { None };
        // SAFETY: every pointer is to a local DLTensor describing memory the views borrow (host
        // slices checked to cover their shapes, or raw memory the caller vouched for); the library
        // keeps none of them past the call (on CUDA: past the enqueued work).
        let st = with_ce_outputs(outputs, dlogits, |out| unsafe {
            match (comm, call) {
                (None, Call::Run) => sys::fce_cross_entropy_fwd(
                    self.as_raw(),
                    self.stream,
                    logits,
                    &t,
                    &o,
                    out,
                    self.workspace,
                    self.workspace_bytes,
                ),
                (None, Call::Query(bytes)) => {
                    sys::fce_cross_entropy_fwd_workspace_size(self.as_raw(), logits, &t, &o, out, bytes)
                }
                (Some(c), Call::Run) => sys::fce_cross_entropy_fwd_vp(
                    self.as_raw(),
                    c.as_raw(),
                    self.stream,
                    logits,
                    &t,
                    &o,
                    out,
                    self.workspace,
                    self.workspace_bytes,
                ),
                (Some(c), Call::Query(bytes)) => {
                    sys::fce_cross_entropy_fwd_vp_workspace_size(self.as_raw(), c.as_raw(), logits, &t, &o, out, bytes)
                }
            }
        });
        check(st)
    }

    /// Cross-entropy backward from a saved logsumexp: `dlogits = d(loss)/d(logits) × grad_loss`.
    ///
    /// With a vocabulary shard (`options.vocab_total > 0`, step 4 of [`Handle::cross_entropy_partial`]'s
    /// recipe): `logits` are the shard's `[N, V_local]` columns as given to the partial call, `targets`
    /// global indices, `lse` the output of [`Handle::cross_entropy_combine`] (best its pairs `[N, 2]`),
    /// and `dlogits` the shard's columns of the unsharded gradient; padding columns (global index >=
    /// vocab_total) get 0.
    ///
    /// * `logits` `[N, V]` and `targets` `[N]` as given to the forward; `lse` fp32 from the forward with
    ///   the same `options`, in either of the forms [`CeOutputs::lse`] describes: `[N]` (the lse), or
    ///   `[N, 2]` contiguous, its pairs (m, l) (e.g. [`TensorRef::lse_pairs`]). From the pairs every
    ///   probability is formed as the forward forms it, `exp((z_j − m) − l)`: the gradient holds at any
    ///   offset of the logits and has the fused gradient's bits. From `[N]` each p_j carries the fp32
    ///   lse's rounding (up to |lse|·2⁻²⁴ relative). Another shape is `SHAPE_MISMATCH`, `[N, 2]` with a
    ///   row stride other than 2 `UNSUPPORTED_LAYOUT`, another dtype `UNSUPPORTED_DTYPE`.
    /// * `grad_loss`: fp32 scalar (Sum/Mean) or `[N]`/scalar (None); None means 1.
    /// * `dlogits`: `[N, V]` in the logits' dtype.
    ///
    /// Errors as [`Handle::cross_entropy_fwd`].
    pub fn cross_entropy_bwd(
        &self,
        logits: &TensorRef<'_>,
        targets: &TensorRef<'_>,
        lse: &TensorRef<'_>,
        grad_loss: Option<&TensorRef<'_>>,
        options: &CeOptions<'_>,
        dlogits: &mut TensorMut<'_>,
    ) -> Result<()> {
        let l = logits.as_dl();
        let mut d = dlogits.as_dl();
        self.ce_bwd(&l, targets, lse, grad_loss, options, &mut d, Call::Run)
    }

    /// [`Handle::cross_entropy_bwd`] in place: `logits` `[N, V]` is read, then overwritten by the
    /// gradient.
    pub fn cross_entropy_bwd_in_place(
        &self,
        logits: &mut TensorMut<'_>,
        targets: &TensorRef<'_>,
        lse: &TensorRef<'_>,
        grad_loss: Option<&TensorRef<'_>>,
        options: &CeOptions<'_>,
    ) -> Result<()> {
        let mut l = logits.as_dl();
        let lp: *mut sys::DLTensor = &mut l;
        // The library allows dlogits to be exactly the logits' memory (it reads a row before writing
        // its gradient); both arguments point to the same descriptor, which it never modifies.
        self.ce_bwd(lp, targets, lse, grad_loss, options, lp, Call::Run)
    }

    /// Workspace bytes [`Handle::cross_entropy_bwd`] needs for these arguments.
    pub fn cross_entropy_bwd_workspace_size(
        &self,
        logits: &TensorRef<'_>,
        targets: &TensorRef<'_>,
        lse: &TensorRef<'_>,
        grad_loss: Option<&TensorRef<'_>>,
        options: &CeOptions<'_>,
        dlogits: &mut TensorMut<'_>,
    ) -> Result<usize> {
        let l = logits.as_dl();
        let mut d = dlogits.as_dl();
        let mut bytes = 0usize;
        self.ce_bwd(&l, targets, lse, grad_loss, options, &mut d, Call::Query(&mut bytes))?;
        Ok(bytes)
    }

    #[allow(clippy::too_many_arguments)]
    fn ce_bwd(
        &self,
        logits: *const sys::DLTensor,
        targets: &TensorRef<'_>,
        lse: &TensorRef<'_>,
        grad_loss: Option<&TensorRef<'_>>,
        options: &CeOptions<'_>,
        dlogits: *mut sys::DLTensor,
        call: Call<'_>,
    ) -> Result<()> {
        let t = targets.as_dl();
        let s = lse.as_dl();
        let g = grad_loss.map(|g| g.as_dl());
        let cw = dl(&options.class_weights);
        let o = options.to_raw(cw.as_ref());
        // SAFETY: as in ce_fwd.
        let st = unsafe {
            match call {
                Call::Run => sys::fce_cross_entropy_bwd(
                    self.as_raw(),
                    self.stream,
                    logits,
                    &t,
                    &s,
                    cptr(&g),
                    &o,
                    dlogits,
                    self.workspace,
                    self.workspace_bytes,
                ),
                Call::Query(bytes) => sys::fce_cross_entropy_bwd_workspace_size(
                    self.as_raw(),
                    logits,
                    &t,
                    &s,
                    cptr(&g),
                    &o,
                    dlogits,
                    bytes,
                ),
            }
        };
        check(st)
    }

    /// Cross-entropy backward from saved statistics with the entropy's upstream gradient as well
    /// (`fce_cross_entropy_bwd_ex`):
    /// `dlogits = grad_loss × d(loss)/d(logits) + grad_entropy × dH/d(logits)`, formed in fp32 and
    /// rounded once, with dH/dz_j = p_j·(μ − z_j), μ = lse − H taken from the saved entropy (the
    /// entropy's derivative, e.g. Pereyra et al. 2017), chained through `logit_scale` and `softcap` as
    /// the loss gradient is; see [`CeOutputs::grad_entropy`]. Without `inputs.grad_entropy` it is
    /// [`Handle::cross_entropy_bwd`], the same bits. With a vocabulary shard, `inputs.lse` and
    /// `inputs.entropy` are [`Handle::cross_entropy_combine`]'s outputs (the same on every rank). From the
    /// forward's lse pairs (`[N, 2]`) the result has the fused forward's bits; from an `[N]` lse each p_j
    /// carries the lse's fp32 rounding (see [`Handle::cross_entropy_bwd`]).
    ///
    /// * `logits` `[N, V]` fp32, bf16 or fp16 and `targets` `[N]` i32/i64 as given to the forward.
    /// * `inputs`: [`CeBwdInputs`]: `lse` `[N]` or `[N, 2]` fp32 (required), `grad_loss` (fp32 scalar for
    ///   Sum/Mean, `[N]`/scalar for None; None = 1), `entropy` `[N]` fp32 (the forward's, same options;
    ///   required with `grad_entropy`), `grad_entropy` (`[N]` or scalar fp32; None = no entropy term).
    /// * `options`: the forward's.
    /// * `dlogits`: `[N, V]` in the logits' dtype.
    ///
    /// Errors as [`Handle::cross_entropy_bwd`], and `INVALID_ARGUMENT` for `grad_entropy` without
    /// `entropy`; `SHAPE_MISMATCH` for an `entropy` not `[N]` or a `grad_entropy` neither `[N]` nor a
    /// scalar; `UNSUPPORTED_DTYPE` for non-fp32 ones. Needs a library of 0.2.0 or later.
    pub fn cross_entropy_bwd_ex(
        &self,
        logits: &TensorRef<'_>,
        targets: &TensorRef<'_>,
        inputs: &CeBwdInputs<'_>,
        options: &CeOptions<'_>,
        dlogits: &mut TensorMut<'_>,
    ) -> Result<()> {
        let l = logits.as_dl();
        let mut d = dlogits.as_dl();
        self.ce_bwd_ex(&l, targets, inputs, options, &mut d, Call::Run)
    }

    /// [`Handle::cross_entropy_bwd_ex`] in place: `logits` `[N, V]` is read, then overwritten by the
    /// gradient (the same bits as the out-of-place call).
    pub fn cross_entropy_bwd_ex_in_place(
        &self,
        logits: &mut TensorMut<'_>,
        targets: &TensorRef<'_>,
        inputs: &CeBwdInputs<'_>,
        options: &CeOptions<'_>,
    ) -> Result<()> {
        let mut l = logits.as_dl();
        let lp: *mut sys::DLTensor = &mut l;
        // As in cross_entropy_bwd_in_place: dlogits may be exactly the logits' memory.
        self.ce_bwd_ex(lp, targets, inputs, options, lp, Call::Run)
    }

    /// Workspace bytes [`Handle::cross_entropy_bwd_ex`] needs for these arguments (same validation).
    pub fn cross_entropy_bwd_ex_workspace_size(
        &self,
        logits: &TensorRef<'_>,
        targets: &TensorRef<'_>,
        inputs: &CeBwdInputs<'_>,
        options: &CeOptions<'_>,
        dlogits: &mut TensorMut<'_>,
    ) -> Result<usize> {
        let l = logits.as_dl();
        let mut d = dlogits.as_dl();
        let mut bytes = 0usize;
        self.ce_bwd_ex(&l, targets, inputs, options, &mut d, Call::Query(&mut bytes))?;
        Ok(bytes)
    }

    fn ce_bwd_ex(
        &self,
        logits: *const sys::DLTensor,
        targets: &TensorRef<'_>,
        inputs: &CeBwdInputs<'_>,
        options: &CeOptions<'_>,
        dlogits: *mut sys::DLTensor,
        call: Call<'_>,
    ) -> Result<()> {
        let t = targets.as_dl();
        let lse = inputs.lse.as_dl();
        let gl = dl(&inputs.grad_loss);
        let ent = dl(&inputs.entropy);
        let ge = dl(&inputs.grad_entropy);
        let mut i = raw::init::<sys::fce_ce_bwd_inputs_t>();
        {
            let r = &mut i;
            r.lse = &lse;
            r.grad_loss = cptr(&gl);
            r.entropy = cptr(&ent);
            r.grad_entropy = cptr(&ge);
        }
        let cw = dl(&options.class_weights);
        let o = options.to_raw(cw.as_ref());
        // SAFETY: as in ce_fwd.
        let st = unsafe {
            match call {
                Call::Run => sys::fce_cross_entropy_bwd_ex(
                    self.as_raw(),
                    self.stream,
                    logits,
                    &t,
                    &i,
                    &o,
                    dlogits,
                    self.workspace,
                    self.workspace_bytes,
                ),
                Call::Query(bytes) => {
                    sys::fce_cross_entropy_bwd_ex_workspace_size(self.as_raw(), logits, &t, &i, &o, dlogits, bytes)
                }
            }
        };
        check(st)
    }

    // ---------------------------------------------------------------------------------------------
    // Vocabulary-parallel cross-entropy
    // ---------------------------------------------------------------------------------------------

    /// The records of one vocabulary shard (`fce_cross_entropy_partial`): step 1 of vocabulary-parallel
    /// cross-entropy, whose steps are (the header's "Vocabulary-parallel cross-entropy"):
    ///
    /// 1. each rank: `cross_entropy_partial` on its shard → records `[N, K]`;
    /// 2. the caller gathers every rank's records in rank (vocabulary) order into `[W, N, K]` (an
    ///    all-gather; the library does no communication);
    /// 3. each rank: [`Handle::cross_entropy_combine`] → loss, lse, z-loss, argmax and entropy of the
    ///    whole rows, the same bits on every rank;
    /// 4. each rank: [`Handle::cross_entropy_bwd`] with the combined lse (its pairs `[N, 2]`, so that the
    ///    shard's probabilities are formed from max-shifted values) and the same sharded options → its
    ///    shard's dlogits (padding columns 0); [`Handle::cross_entropy_bwd_ex`] with the combined lse and
    ///    entropy to add the entropy's gradient.
    ///
    /// * `logits`: `[N, V_local]` fp32, bf16 or fp16, V_local >= 1: global columns
    ///   `[options.vocab_start, options.vocab_start + V_local)`; those at or past `options.vocab_total`
    ///   are padding and never read. Rows may be padded ([`TensorRef::strided`]).
    /// * `targets`: `[N]` i32 or i64, global class indices (as for the unsharded call).
    /// * `options`: [`CeOptions::vocab_start`] and [`CeOptions::vocab_total`] required
    ///   (0 <= vocab_start <= vocab_total <= 2³¹ − 1; vocab_start = vocab_total is a shard of padding
    ///   alone, as padding a small vocabulary to a multiple of the ranks gives); the other options as for
    ///   [`Handle::cross_entropy_fwd`] (class weights of the whole vocabulary, `[vocab_total]`).
    /// * `records`: `[N, K]` fp32, written; K from [`crate::cross_entropy_record_fields`]
    ///   ([`crate::CE_RECORD_FIELDS_ALL`], 9), or a narrower prefix: [`crate::CE_RECORD_FIELDS_LOSS`] (6:
    ///   loss, lse, z-loss; the partial skips the entropy's sums) or [`crate::CE_RECORD_FIELDS_ENTROPY`]
    ///   (7: and the entropy), the same on every rank; the combine then refuses the outputs the width does
    ///   not hold. Per row, with z the transformed logits of the shard's real columns and m their max: 0 m,
    ///   1 Σ exp(z − m), 2 z at the target if the shard holds it (else 0), 3 Σ w_j·z_j (label smoothing; 0
    ///   without it), 4 and 5 the shard's column range `[vocab_start, end)`, end one past its last real
    ///   column (int32 bits in the fp32 slots), 6 Σ exp(z − m)·(z − m) (entropy), 7 the largest raw logit,
    ///   8 its global index (int32 bits). A shard with no column below vocab_total (padding alone) gives a
    ///   neutral record with the empty range `[vocab_total, vocab_total)`. (0.2.0's records were 4/5/7
    ///   wide, without the range.)
    ///
    /// Math: [`CeOptions`] over the whole vocabulary; the records' sums are rounded to fp32 once per
    /// shard (`docs/numerics.md`, "Vocabulary shards").
    ///
    /// Errors: `INVALID_ARGUMENT` (options without a shard, vocab_start outside `[0, vocab_total]`,
    /// options out of domain), `SHAPE_MISMATCH` (records not `[N, K]`, class weights not
    /// `[vocab_total]`), `UNSUPPORTED_DTYPE`, `UNSUPPORTED_LAYOUT`, `DEVICE_MISMATCH`, `ALIASING`,
    /// `OVERFLOW`, `CUDA_ERROR`.
    pub fn cross_entropy_partial(
        &self,
        logits: &TensorRef<'_>,
        targets: &TensorRef<'_>,
        options: &CeOptions<'_>,
        records: &mut TensorMut<'_>,
    ) -> Result<()> {
        let l = logits.as_dl();
        let t = targets.as_dl();
        let cw = dl(&options.class_weights);
        let o = options.to_raw(cw.as_ref());
        let mut r = records.as_dl();
        // SAFETY: as in ce_fwd.
        let st = unsafe { sys::fce_cross_entropy_partial(self.as_raw(), self.stream, &l, &t, &o, &mut r) };
        check(st)
    }

    /// The cross-entropy forward of whole rows from the records of every shard
    /// (`fce_cross_entropy_combine`): step 3 of [`Handle::cross_entropy_partial`]'s recipe. It writes
    /// what [`Handle::cross_entropy_fwd`] would for the unsharded rows: argmax, ignored rows, NaN and
    /// out-of-range targets and all-ignored means bitwise equal; loss, lse and entropy within the fp32
    /// rounding of the records' sums (`docs/numerics.md`). The records are merged in rank order (no float
    /// all-reduce), so the result is bitwise reproducible and the same on every rank.
    ///
    /// The records' column ranges must tile `[0, vocab_total)` in rank order: the first shard beginning at
    /// 0 and each where the one before ends (shards of padding alone, `[vocab_total, vocab_total)`, may
    /// follow). Overlapping shards, a gap, shards out of vocabulary order or records of another
    /// vocab_total are not an error status (the records may be on the device): every row's loss, lse,
    /// z-loss and entropy are NaN and its argmax −1 (ignored rows included), never a plausible number.
    ///
    /// * `records`: `[W, N, K]` fp32, contiguous (e.g. [`TensorRef::new`] with shape `[w, n, k]`): the
    ///   `[N, K]` records of ranks 0..W from [`Handle::cross_entropy_partial`] (or
    ///   [`Handle::linear_cross_entropy_partial`]), in rank order, which must be vocabulary order.
    /// * `targets`: `[N]` i32 or i64, global indices (those given to the partial calls).
    /// * `options`: the partial calls' options ([`CeOptions::vocab_total`] required;
    ///   [`CeOptions::vocab_start`] is not read).
    /// * `outputs`: as for [`Handle::cross_entropy_fwd`] (loss per `options.reduction`; optional lse,
    ///   `[N]` or its pairs `[N, 2]` (m the rows' max z over every shard, l the log of the shifted sum):
    ///   the pairs are what each shard's [`Handle::cross_entropy_bwd`] or
    ///   [`Handle::linear_cross_entropy_bwd`] should take; z-loss, argmax `[N]` i32/i64 of global indices,
    ///   entropy), but `dlogits`, `grad_loss` and
    ///   `grad_entropy` must be None (the entropy's gradient of a shard comes from
    ///   [`Handle::cross_entropy_bwd_ex`], or [`Handle::linear_cross_entropy_bwd`] with
    ///   [`LinearCeGrads::grad_entropy`], with the combined lse and entropy).
    ///
    /// Errors: `INVALID_ARGUMENT` (options without `vocab_total`, `outputs.dlogits`,
    /// `outputs.grad_loss` or `outputs.grad_entropy` set), `SHAPE_MISMATCH` (records not
    /// `[W >= 1, N, K]`, targets not `[N]`), `UNSUPPORTED_DTYPE`, `UNSUPPORTED_LAYOUT` (records not
    /// contiguous), `DEVICE_MISMATCH`, `ALIASING`, `OVERFLOW`, `WORKSPACE_TOO_SMALL`, `CUDA_ERROR`.
    pub fn cross_entropy_combine(
        &self,
        records: &TensorRef<'_>,
        targets: &TensorRef<'_>,
        options: &CeOptions<'_>,
        outputs: &mut CeOutputs<'_>,
    ) -> Result<()> {
        self.ce_combine(records, targets, options, outputs, Call::Run)
    }

    /// Workspace bytes [`Handle::cross_entropy_combine`] needs for these arguments (same validation;
    /// 0 on a CPU handle).
    pub fn cross_entropy_combine_workspace_size(
        &self,
        records: &TensorRef<'_>,
        targets: &TensorRef<'_>,
        options: &CeOptions<'_>,
        outputs: &mut CeOutputs<'_>,
    ) -> Result<usize> {
        let mut bytes = 0usize;
        self.ce_combine(records, targets, options, outputs, Call::Query(&mut bytes))?;
        Ok(bytes)
    }

    fn ce_combine(
        &self,
        records: &TensorRef<'_>,
        targets: &TensorRef<'_>,
        options: &CeOptions<'_>,
        outputs: &mut CeOutputs<'_>,
        call: Call<'_>,
    ) -> Result<()> {
        if outputs.grad_entropy.is_some() {
            return Err(Error::new(
                Status::INVALID_ARGUMENT,
                "fusedce (Rust): cross_entropy_combine writes no gradient; outputs.grad_entropy must be None \
                 (a shard's entropy gradient comes from cross_entropy_bwd_ex)",
            ));
        }
        let r = records.as_dl();
        let t = targets.as_dl();
        let cw = dl(&options.class_weights);
        let o = options.to_raw(cw.as_ref());
        // dlogits and grad_loss are passed on as given, so that the library refuses them with its own
        // message. SAFETY: as in ce_fwd.
        let st = with_ce_outputs(outputs, None, |out| unsafe {
            match call {
                Call::Run => sys::fce_cross_entropy_combine(
                    self.as_raw(),
                    self.stream,
                    &r,
                    &t,
                    &o,
                    out,
                    self.workspace,
                    self.workspace_bytes,
                ),
                Call::Query(bytes) => {
                    sys::fce_cross_entropy_combine_workspace_size(self.as_raw(), &r, &t, &o, out, bytes)
                }
            }
        });
        check(st)
    }

    // ---------------------------------------------------------------------------------------------
    // Logsumexp and softmax
    // ---------------------------------------------------------------------------------------------

    /// Per-row logsumexp: `lse_i = log Σ_j exp(s·x_ij)` (s = `options.scale`), the max of the raw
    /// row taken first. A row of all −inf gives −inf; NaN propagates.
    ///
    /// * `x`: `[N, V]` fp32, bf16 or fp16, N, V >= 1.
    /// * `options`: [`LseOptions::scale`]; [`LseOptions::vocab_total`] must be 0 (a shard goes through
    ///   [`Handle::logsumexp_partial`] and [`Handle::logsumexp_combine`]).
    /// * `lse`: `[N]` fp32.
    ///
    /// Errors: `INVALID_ARGUMENT` (scale not finite and > 0, options with `vocab_total` set),
    /// `SHAPE_MISMATCH`, `UNSUPPORTED_DTYPE`, `UNSUPPORTED_LAYOUT`, `DEVICE_MISMATCH`, `ALIASING`,
    /// `WORKSPACE_TOO_SMALL`, `CUDA_ERROR`.
    pub fn logsumexp(&self, x: &TensorRef<'_>, options: &LseOptions, lse: &mut TensorMut<'_>) -> Result<()> {
        self.lse_impl(x, options, lse, None, Call::Run)
    }

    /// Workspace bytes [`Handle::logsumexp`] needs for these arguments.
    pub fn logsumexp_workspace_size(
        &self,
        x: &TensorRef<'_>,
        options: &LseOptions,
        lse: &mut TensorMut<'_>,
    ) -> Result<usize> {
        let mut bytes = 0usize;
        self.lse_impl(x, options, lse, None, Call::Query(&mut bytes))?;
        Ok(bytes)
    }

    /// NCCL mode's logsumexp (`fce_logsumexp_vp`), one call per rank: this rank's shard's records, their
    /// all-gather over `comm` on the handle's stream and their combine in rank order; every rank gets the
    /// whole rows' lse, the same bits as [`Handle::logsumexp_partial`] and [`Handle::logsumexp_combine`]
    /// over the same shards on one device.
    ///
    /// * `x`: `[N, V_local]` fp32, bf16 or fp16, this rank's global columns (padding past `vocab_total`).
    /// * `options`: [`LseOptions::vocab_start`] (this rank's first column, ranks in vocabulary order),
    ///   [`LseOptions::vocab_total`] and [`LseOptions::scale`] required, the last two the same on every rank.
    /// * `lse`: `[N]` fp32, `log Σ_j exp(scale·x_ij)` over the whole rows, written on every rank; or `[N, 2]`
    ///   for its pairs (M, log D), lse = scale·M + log D, as [`Handle::logsumexp_combine`] writes them.
    ///
    /// Errors: those of [`Handle::logsumexp_partial`] (`INVALID_ARGUMENT` also without `vocab_total`, on a
    /// CPU handle), `DEVICE_MISMATCH`, `WORKSPACE_TOO_SMALL`, `COMMUNICATOR_ERROR`, `CUDA_ERROR`.
    pub fn logsumexp_vp(
        &self,
        comm: &Comm,
        x: &TensorRef<'_>,
        options: &LseOptions,
        lse: &mut TensorMut<'_>,
    ) -> Result<()> {
        self.lse_impl(x, options, lse, Some(comm), Call::Run)
    }

    /// Workspace bytes [`Handle::logsumexp_vp`] needs for these arguments (every rank's records).
    pub fn logsumexp_vp_workspace_size(
        &self,
        comm: &Comm,
        x: &TensorRef<'_>,
        options: &LseOptions,
        lse: &mut TensorMut<'_>,
    ) -> Result<usize> {
        let mut bytes = 0usize;
        self.lse_impl(x, options, lse, Some(comm), Call::Query(&mut bytes))?;
        Ok(bytes)
    }

    fn lse_impl(
        &self,
        x: &TensorRef<'_>,
        options: &LseOptions,
        lse: &mut TensorMut<'_>,
        comm: Option<&Comm>,
        call: Call<'_>,
    ) -> Result<()> {
        let xd = x.as_dl();
        let o = options.to_raw();
        let mut l = lse.as_dl();
        // SAFETY: as in ce_fwd.
        let st = unsafe {
            match (comm, call) {
                (None, Call::Run) => sys::fce_logsumexp(
                    self.as_raw(),
                    self.stream,
                    &xd,
                    &o,
                    &mut l,
                    self.workspace,
                    self.workspace_bytes,
                ),
                (None, Call::Query(bytes)) => sys::fce_logsumexp_workspace_size(self.as_raw(), &xd, &o, &l, bytes),
                (Some(c), Call::Run) => sys::fce_logsumexp_vp(
                    self.as_raw(),
                    c.as_raw(),
                    self.stream,
                    &xd,
                    &o,
                    &mut l,
                    self.workspace,
                    self.workspace_bytes,
                ),
                (Some(c), Call::Query(bytes)) => {
                    sys::fce_logsumexp_vp_workspace_size(self.as_raw(), c.as_raw(), &xd, &o, &l, bytes)
                }
            }
        };
        check(st)
    }

    /// The records of one vocabulary shard of x (`fce_logsumexp_partial`): step 1 of vocabulary-parallel
    /// logsumexp, whose steps are (the header's "Vocabulary-parallel logsumexp"):
    ///
    /// 1. each rank: `logsumexp_partial` on its shard → records `[N, LSE_RECORD_FIELDS]` (6);
    /// 2. the caller gathers every rank's records in rank (vocabulary) order into `[W, N, 6]` (an
    ///    all-gather; the library does no communication);
    /// 3. each rank: [`Handle::logsumexp_combine`] → the lse of the whole rows (`[N]`, or its pairs
    ///    `[N, 2]`), the same bits on every rank;
    /// 4. optionally, each rank: [`Handle::temp_softmax`] of its shard with that lse
    ///    ([`SoftmaxOptions::lse`], best the pairs; partials with [`LseOptions::scale`] the fp32 `1.0 / T`)
    ///    → its columns of the rows' probabilities and log-probabilities.
    ///
    /// * `x`: `[N, V_local]` fp32, bf16 or fp16, V_local >= 1: global columns
    ///   `[options.vocab_start, options.vocab_start + V_local)`; those at or past `options.vocab_total`
    ///   are padding and never read.
    /// * `options`: [`LseOptions::vocab_start`] and [`LseOptions::vocab_total`] required
    ///   (0 <= vocab_start <= vocab_total <= 2³¹ − 1; vocab_start = vocab_total: a shard of padding
    ///   alone); [`LseOptions::scale`] s as for [`Handle::logsumexp`], the same on every rank.
    /// * `records`: `[N, LSE_RECORD_FIELDS]` fp32 ([`crate::LSE_RECORD_FIELDS`], 6), written. Per row,
    ///   over the shard's real columns, in raw units (so that s·x never overflows): 0 m = max x_j, the raw
    ///   maximum (NaN when one is NaN), 1 Σ exp((x_j − m)·s) (1 when m is +inf, 0 when it is −inf), 2 and
    ///   3 the shard's column range `[vocab_start, end)` (int32 bits, as cross-entropy's records), 4 the
    ///   scale s, 5 vocab_total (int32 bits). (0.2.0's records had 2 fields, m = max s·x.)
    ///
    /// Errors: `INVALID_ARGUMENT` (options without a shard, vocab_start outside `[0, vocab_total]`, scale
    /// not finite and > 0), `SHAPE_MISMATCH` (records not `[N, 6]`), `UNSUPPORTED_DTYPE`,
    /// `UNSUPPORTED_LAYOUT`, `DEVICE_MISMATCH`, `ALIASING`, `CUDA_ERROR`.
    pub fn logsumexp_partial(
        &self,
        x: &TensorRef<'_>,
        options: &LseOptions,
        records: &mut TensorMut<'_>,
    ) -> Result<()> {
        let xd = x.as_dl();
        let o = options.to_raw();
        let mut r = records.as_dl();
        // SAFETY: as in ce_fwd.
        let st = unsafe { sys::fce_logsumexp_partial(self.as_raw(), self.stream, &xd, &o, &mut r) };
        check(st)
    }

    /// The logsumexp of whole rows from the records of every shard (`fce_logsumexp_combine`): step 3 of
    /// [`Handle::logsumexp_partial`]'s recipe. With M the largest of the records' raw maxima m_r, d_r
    /// their sums and s the scale, `lse = s·M + log D`, `D = Σ_r d_r·exp((m_r − M)·s)`, merged in fp64 in
    /// rank order (no float all-reduce), so the result is bitwise reproducible and the same on every
    /// rank. It is what [`Handle::logsumexp`] gives for the unsharded rows: NaN when a record is NaN,
    /// +inf when a max is +inf, −inf for rows of all −inf, otherwise the same value within the fp32
    /// rounding of the records' sums. NaN too in every row when the records' scales or vocab_total differ
    /// or their column ranges do not tile `[0, vocab_total)` in rank order (overlapping shards, a gap,
    /// shards out of order; shards of padding alone may follow): never a plausible number, and no error
    /// status. No options (the records carry the scale) and no workspace.
    ///
    /// * `records`: `[W, N, LSE_RECORD_FIELDS]` fp32, contiguous (e.g. [`TensorRef::new`] with shape
    ///   `[w, n, 6]`): the records of ranks 0..W from [`Handle::logsumexp_partial`], in rank (vocabulary)
    ///   order.
    /// * `lse`: fp32, written: `[N]`, the lse; or `[N, 2]` contiguous ([`TensorMut::lse_pairs`]), its
    ///   pairs (M, log D), lse = s·M + log D ([`crate::lse_from_pairs`]): the form a shard's
    ///   [`Handle::temp_softmax`] takes at any T without overflow or the rounding of a large lse.
    ///
    /// Errors: `SHAPE_MISMATCH` (records not `[W >= 1, N, 6]`, lse neither `[N]` nor `[N, 2]`),
    /// `UNSUPPORTED_DTYPE`,
    /// `UNSUPPORTED_LAYOUT` (records not contiguous), `DEVICE_MISMATCH`, `ALIASING`, `OVERFLOW`,
    /// `CUDA_ERROR`.
    pub fn logsumexp_combine(&self, records: &TensorRef<'_>, lse: &mut TensorMut<'_>) -> Result<()> {
        let r = records.as_dl();
        let mut l = lse.as_dl();
        // SAFETY: as in ce_fwd.
        let st = unsafe { sys::fce_logsumexp_combine(self.as_raw(), self.stream, &r, &mut l) };
        check(st)
    }

    /// Temperature softmax for sampling: `p_j = exp((x_j − max x)/T) / Σ_k exp((x_k − max x)/T)`.
    /// T = 0 is greedy (one-hot at the argmax, lowest index on ties; log-probabilities 0 there and
    /// −inf elsewhere). −inf logits get probability 0; a row of all −inf, or with a NaN, gives NaN.
    ///
    /// * `logits`: `[N, V]` fp32, bf16 or fp16.
    /// * `probs`, `logprobs`: optional `[N, V]`, fp32 or the logits' dtype; at least one is required
    ///   (`INVALID_ARGUMENT` otherwise). Log-probabilities are in nats.
    ///
    /// A vocabulary shard ([`SoftmaxOptions::vocab_total`] > 0): `logits` `[N, V_local]` are global
    /// columns `[vocab_start, vocab_start + V_local)` (those at or past `vocab_total` are padding, never
    /// read) and the call writes the shard's columns of the whole rows' distribution from
    /// [`SoftmaxOptions::lse`] (the rows' logsumexp of logits/T: [`Handle::logsumexp_combine`] of every
    /// shard's [`Handle::logsumexp_partial`] with [`LseOptions::scale`] the fp32 `1.0 / T`), fp32, as its
    /// pairs `[N, 2]` (M, log D) or as `[N]`: `log p_j = x_j/T − lse`, formed from the pairs as
    /// `(x_j − M)/T − log D` (no NaN for finite logits at any T > 0, no rounding of the size of x/T),
    /// `p_j` its exp; padding columns get 0 and −inf. From `[N]` every value carries the lse's fp32
    /// rounding (|lse|·2⁻²⁴) and an lse that overflowed fp32 gives probabilities 0. No workspace is needed
    /// then.
    ///
    /// Errors: `INVALID_ARGUMENT` (no output, a temperature negative or NaN, vocab_start outside
    /// `[0, vocab_total]`, a shard without [`SoftmaxOptions::lse`]), `NOT_IMPLEMENTED` (a shard with
    /// per-row temperatures, T = 0 or T = +inf), `SHAPE_MISMATCH` (also `temperatures` not `[N]`, `lse`
    /// neither `[N]` nor `[N, 2]`), `UNSUPPORTED_DTYPE`, `UNSUPPORTED_LAYOUT` (also an `[N, 2]` lse with a
    /// row stride other than 2), `DEVICE_MISMATCH`, `ALIASING`,
    /// `WORKSPACE_TOO_SMALL`, `CUDA_ERROR`.
    pub fn temp_softmax(
        &self,
        logits: &TensorRef<'_>,
        options: &SoftmaxOptions<'_>,
        probs: Option<&mut TensorMut<'_>>,
        logprobs: Option<&mut TensorMut<'_>>,
    ) -> Result<()> {
        self.softmax_impl(logits, options, probs, logprobs, None, Call::Run)
    }

    /// Workspace bytes [`Handle::temp_softmax`] needs for these arguments.
    pub fn temp_softmax_workspace_size(
        &self,
        logits: &TensorRef<'_>,
        options: &SoftmaxOptions<'_>,
        probs: Option<&mut TensorMut<'_>>,
        logprobs: Option<&mut TensorMut<'_>>,
    ) -> Result<usize> {
        let mut bytes = 0usize;
        self.softmax_impl(logits, options, probs, logprobs, None, Call::Query(&mut bytes))?;
        Ok(bytes)
    }

    /// NCCL mode's temperature softmax of a vocabulary shard (`fce_temp_softmax_vp`), one call per rank:
    /// the whole rows' lse of logits/T ([`Handle::logsumexp_vp`] at scale 1/T), then this shard's
    /// probabilities and log-probabilities of the whole rows, `log p_j = x_j/T − lse` formed from the rows'
    /// pairs (which the call keeps in its workspace), `p_j` its exp (padding columns 0 and −inf): the same
    /// bits as those steps on one device with the pairs.
    ///
    /// * `logits`: `[N, V_local]` fp32, bf16 or fp16, this rank's global columns.
    /// * `options`: [`SoftmaxOptions::vocab_start`], [`SoftmaxOptions::vocab_total`] and one finite
    ///   temperature > 0 ([`SoftmaxOptions::temperature`]), the same on every rank but vocab_start; no
    ///   per-row temperatures and no [`SoftmaxOptions::lse`] (the call computes it).
    /// * `probs` / `logprobs`: optional `[N, V_local]` (at least one), as for [`Handle::temp_softmax`].
    /// * `lse`: optional, receives the whole rows' lse of logits/T: `[N]` fp32, or `[N, 2]` for its pairs
    ///   (M, log D), lse = M/T + log D.
    ///
    /// Errors: `INVALID_ARGUMENT` (no output, without `vocab_total`, with `options.lse`, on a CPU handle),
    /// `NOT_IMPLEMENTED` (per-row, zero or infinite temperatures), `SHAPE_MISMATCH`, `UNSUPPORTED_DTYPE`,
    /// `UNSUPPORTED_LAYOUT`, `DEVICE_MISMATCH`, `ALIASING`, `WORKSPACE_TOO_SMALL`, `COMMUNICATOR_ERROR`,
    /// `CUDA_ERROR`.
    pub fn temp_softmax_vp(
        &self,
        comm: &Comm,
        logits: &TensorRef<'_>,
        options: &SoftmaxOptions<'_>,
        probs: Option<&mut TensorMut<'_>>,
        logprobs: Option<&mut TensorMut<'_>>,
        lse: Option<&mut TensorMut<'_>>,
    ) -> Result<()> {
        self.softmax_impl(logits, options, probs, logprobs, Some((comm, lse)), Call::Run)
    }

    /// Workspace bytes [`Handle::temp_softmax_vp`] needs for these arguments (every rank's records and the
    /// rows' pairs).
    pub fn temp_softmax_vp_workspace_size(
        &self,
        comm: &Comm,
        logits: &TensorRef<'_>,
        options: &SoftmaxOptions<'_>,
        probs: Option<&mut TensorMut<'_>>,
        logprobs: Option<&mut TensorMut<'_>>,
        lse: Option<&mut TensorMut<'_>>,
    ) -> Result<usize> {
        let mut bytes = 0usize;
        self.softmax_impl(logits, options, probs, logprobs, Some((comm, lse)), Call::Query(&mut bytes))?;
        Ok(bytes)
    }

    /// `vp`: NCCL mode, with its optional lse output.
    fn softmax_impl(
        &self,
        logits: &TensorRef<'_>,
        options: &SoftmaxOptions<'_>,
        probs: Option<&mut TensorMut<'_>>,
        logprobs: Option<&mut TensorMut<'_>>,
        vp: Option<(&Comm, Option<&mut TensorMut<'_>>)>,
        call: Call<'_>,
    ) -> Result<()> {
        let l = logits.as_dl();
        let temps = dl(&options.temperatures);
        let lse = dl(&options.lse);
        let o = options.to_raw(temps.as_ref(), lse.as_ref());
        let mut p = probs.map(|p| p.as_dl());
        let mut lp = logprobs.map(|p| p.as_dl());
        let (comm, lse_out) = match vp {
            Some((c, out)) => (Some(c), out.map(|t| t.as_dl())),
            None => (None, None),
        };
        let mut lo = lse_out;
        // SAFETY: as in ce_fwd.
        let st = unsafe {
            match (comm, call) {
                (None, Call::Run) => sys::fce_temp_softmax(
                    self.as_raw(),
                    self.stream,
                    &l,
                    &o,
                    mptr(&mut p),
                    mptr(&mut lp),
                    self.workspace,
                    self.workspace_bytes,
                ),
                (None, Call::Query(bytes)) => {
                    sys::fce_temp_softmax_workspace_size(self.as_raw(), &l, &o, cptr(&p), cptr(&lp), bytes)
                }
                (Some(c), Call::Run) => sys::fce_temp_softmax_vp(
                    self.as_raw(),
                    c.as_raw(),
                    self.stream,
                    &l,
                    &o,
                    mptr(&mut p),
                    mptr(&mut lp),
                    mptr(&mut lo),
                    self.workspace,
                    self.workspace_bytes,
                ),
                (Some(c), Call::Query(bytes)) => sys::fce_temp_softmax_vp_workspace_size(
                    self.as_raw(),
                    c.as_raw(),
                    &l,
                    &o,
                    cptr(&p),
                    cptr(&lp),
                    cptr(&lo),
                    bytes,
                ),
            }
        };
        check(st)
    }

    // ---------------------------------------------------------------------------------------------
    // Knowledge distillation
    // ---------------------------------------------------------------------------------------------

    /// Knowledge-distillation divergence between the student's and the teacher's distributions, per
    /// row, reduced; with `outputs.dstudent` also its gradient w.r.t. the student logits.
    ///
    /// * `student`: `[N, V]` fp32, bf16 or fp16.
    /// * `teacher`: full logits `[N, V]`, or top-K ids and log-probabilities `[N, K]` ([`Teacher`]).
    /// * `targets`: optional `[N]` i32/i64; rows whose target equals `options.ignore_index` are masked
    ///   (loss 0, gradient 0).
    /// * `outputs.loss`: nats, `[N]` or a scalar per `options.reduction` (Mean = batchmean).
    pub fn kd_loss(
        &self,
        student: &TensorRef<'_>,
        teacher: &Teacher<'_>,
        targets: Option<&TensorRef<'_>>,
        options: &KdOptions,
        outputs: &mut KdOutputs<'_>,
    ) -> Result<()> {
        self.kd_impl(student, teacher, targets, options, outputs, None, Call::Run)
    }

    /// Workspace bytes [`Handle::kd_loss`] needs for these arguments.
    pub fn kd_loss_workspace_size(
        &self,
        student: &TensorRef<'_>,
        teacher: &Teacher<'_>,
        targets: Option<&TensorRef<'_>>,
        options: &KdOptions,
        outputs: &mut KdOutputs<'_>,
    ) -> Result<usize> {
        let mut bytes = 0usize;
        self.kd_impl(student, teacher, targets, options, outputs, None, Call::Query(&mut bytes))?;
        Ok(bytes)
    }

    /// NCCL mode's knowledge distillation (`fce_kd_fwd_vp`), one call per rank: the steps of
    /// [`Handle::kd_partial`]'s recipe on this rank's shard, the records' all-gathers over `comm` on the
    /// handle's stream (two for JSD with 0 < β < 1 and for a top-K teacher), the combines in rank order,
    /// and with `outputs.dstudent` the shard's gradient ([`Handle::kd_bwd`]). The loss is the same bits on
    /// every rank, those of the partial and combine calls over the same shards on one device.
    ///
    /// * `student`, `teacher`, `targets`: as for [`Handle::kd_partial`] (this rank's shard; a top-K teacher
    ///   whole, the same on every rank).
    /// * `options`: [`KdOptions::vocab_start`] (this rank's) and [`KdOptions::vocab_total`] required; any
    ///   divergence and temperature, the same on every rank but vocab_start.
    /// * `outputs`: the loss (nats, as [`Handle::kd_combine`]'s); `dstudent` optional, the shard's
    ///   `[N, V_local]` (with `grad_loss` as for [`Handle::kd_bwd`]).
    /// * `row_stats`: optional `[N, KD_ROW_STATS_FIELDS]` fp32 ([`crate::KD_ROW_STATS_FIELDS`]), receives
    ///   the rows' final statistics: what [`Handle::kd_bwd`] takes for the shard's gradient later.
    ///
    /// Errors: the validation statuses of [`Handle::kd_partial`] (`INVALID_ARGUMENT` also on a CPU handle),
    /// `DEVICE_MISMATCH`, `NOT_IMPLEMENTED` (a top-K teacher of K > 8192 with dstudent),
    /// `WORKSPACE_TOO_SMALL`, `COMMUNICATOR_ERROR`, `CUDA_ERROR`.
    #[allow(clippy::too_many_arguments)]
    pub fn kd_fwd_vp(
        &self,
        comm: &Comm,
        student: &TensorRef<'_>,
        teacher: &Teacher<'_>,
        targets: Option<&TensorRef<'_>>,
        options: &KdOptions,
        outputs: &mut KdOutputs<'_>,
        row_stats: Option<&mut TensorMut<'_>>,
    ) -> Result<()> {
        self.kd_impl(student, teacher, targets, options, outputs, Some((comm, row_stats)), Call::Run)
    }

    /// Workspace bytes [`Handle::kd_fwd_vp`] needs for these arguments.
    #[allow(clippy::too_many_arguments)]
    pub fn kd_fwd_vp_workspace_size(
        &self,
        comm: &Comm,
        student: &TensorRef<'_>,
        teacher: &Teacher<'_>,
        targets: Option<&TensorRef<'_>>,
        options: &KdOptions,
        outputs: &mut KdOutputs<'_>,
        row_stats: Option<&mut TensorMut<'_>>,
    ) -> Result<usize> {
        let mut bytes = 0usize;
        self.kd_impl(student, teacher, targets, options, outputs, Some((comm, row_stats)), Call::Query(&mut bytes))?;
        Ok(bytes)
    }

    /// `vp`: NCCL mode, with its optional row_stats output.
    #[allow(clippy::too_many_arguments)]
    fn kd_impl(
        &self,
        student: &TensorRef<'_>,
        teacher: &Teacher<'_>,
        targets: Option<&TensorRef<'_>>,
        options: &KdOptions,
        outputs: &mut KdOutputs<'_>,
        vp: Option<(&Comm, Option<&mut TensorMut<'_>>)>,
        call: Call<'_>,
    ) -> Result<()> {
        let (comm, stats) = match vp {
            Some((c, rs)) => (Some(c), rs.map(|t| t.as_dl())),
            None => (None, None),
        };
        let mut rs = stats;
        let s = student.as_dl();
        let tt = RawTeacher::new(teacher);
        let t = tt.to_raw();
        let tg = targets.map(|t| t.as_dl());
        let o = options.to_raw();
        let mut loss = outputs.loss.as_dl();
        let mut ds = dl_mut(&mut outputs.dstudent);
        let gl = dl(&outputs.grad_loss);
        let mut out = raw::init::<sys::fce_kd_outputs_t>();
        {
            let r = &mut out;
            r.loss = &mut loss;
            r.dstudent = mptr(&mut ds);
            r.grad_loss = cptr(&gl);
        }
        // SAFETY: as in ce_fwd.
        let st = unsafe {
            match (comm, call) {
                (None, Call::Run) => sys::fce_kd_loss(
                    self.as_raw(),
                    self.stream,
                    &s,
                    &t,
                    cptr(&tg),
                    &o,
                    &out,
                    self.workspace,
                    self.workspace_bytes,
                ),
                (None, Call::Query(bytes)) => {
                    sys::fce_kd_loss_workspace_size(self.as_raw(), &s, &t, cptr(&tg), &o, &out, bytes)
                }
                (Some(c), Call::Run) => sys::fce_kd_fwd_vp(
                    self.as_raw(),
                    c.as_raw(),
                    self.stream,
                    &s,
                    &t,
                    cptr(&tg),
                    &o,
                    &out,
                    mptr(&mut rs),
                    self.workspace,
                    self.workspace_bytes,
                ),
                (Some(c), Call::Query(bytes)) => sys::fce_kd_fwd_vp_workspace_size(
                    self.as_raw(),
                    c.as_raw(),
                    &s,
                    &t,
                    cptr(&tg),
                    &o,
                    &out,
                    cptr(&rs),
                    bytes,
                ),
            }
        };
        check(st)
    }

    // ---------------------------------------------------------------------------------------------
    // Vocabulary-parallel knowledge distillation
    // ---------------------------------------------------------------------------------------------

    /// The records of one vocabulary shard of student and teacher (`fce_kd_partial`): step 1 of
    /// vocabulary-parallel distillation, whose steps are (the header's "Vocabulary-parallel knowledge
    /// distillation"):
    ///
    /// 1. each rank: `kd_partial` on its shard → records `[N, KD_RECORD_FIELDS]` (7);
    /// 2. the caller gathers every rank's records in rank (vocabulary) order into `[W, N, 7]` (one
    ///    all-gather; the library does no communication);
    /// 3. each rank: [`Handle::kd_combine`] → the loss of the whole rows (what [`Handle::kd_loss`]
    ///    returns) and the rows' statistics `[N, KD_ROW_STATS_FIELDS]` (5), the same bits on every rank;
    /// 4. each rank: [`Handle::kd_bwd`] with those statistics → its shard's dstudent (padding columns 0).
    ///
    /// That is forward and reverse KL with teacher logits (and JSD at β = 0 or 1, exactly those). JSD with
    /// 0 < β < 1 and a top-K teacher take a second exchange: JSD's mixture M = β·P_teacher +
    /// (1 − β)·P_student, and a top-K teacher's terms at its K ids, need the rows' normalizers before any
    /// term can be formed; steps 1, 2 and 4 as above, step 3 becomes:
    ///
    /// 3. each rank: [`Handle::kd_combine_row_stats`] (no loss) → the rows' statistics, A (field 4) not yet
    ///    valid;
    ///    * 3a. each rank: [`Handle::kd_terms_partial`] → records `[N, KD_TERMS_RECORD_FIELDS]` (5) of
    ///      its shard;
    ///    * 3b. the caller gathers those in rank order into `[W, N, 5]` (a second all-gather);
    ///    * 3c. each rank: [`Handle::kd_terms_combine`] → the loss, and A written into the statistics.
    ///
    /// Steps 3a–3c work for every divergence (for KL with teacher logits they give its loss a second way).
    /// With a top-K teacher the result is [`Handle::kd_loss`]'s with the same teacher, for every divergence
    /// and both [`KdOptions::topk_norm`] values: the teacher's distribution is softmax_K(logprobs / T) over
    /// the used slots, formed by every rank from its own copy; a row without a used slot is masked (loss 0,
    /// not counted by the mean, gradient 0); an id >= `vocab_total` makes the row's loss and gradient NaN.
    ///
    /// * `student`: `[N, V_local]` fp32, bf16 or fp16, V_local >= 1: global columns
    ///   `[options.vocab_start, options.vocab_start + V_local)`; those at or past `options.vocab_total`
    ///   are padding and never read.
    /// * `teacher`: [`Teacher::Logits`] `[N, V_local]` (any float dtype), the same columns; or a
    ///   [`Teacher::TopK`] teacher: `[N, K]` global vocabulary ids (i32/i64, negative = unused slot) and
    ///   fp32 log-probabilities, the whole of it, the same on every rank.
    /// * `options`: [`KdOptions::vocab_start`] and [`KdOptions::vocab_total`] required
    ///   (0 <= vocab_start <= vocab_total; vocab_start = vocab_total: a shard of padding alone, whose
    ///   record is neutral); any divergence ([`Divergence::Jsd`]: the forward-KL record, P
    ///   the teacher); temperature and [`KdOptions::topk_norm`] as for [`Handle::kd_loss`]; the same
    ///   options on every rank and call.
    /// * `records`: `[N, KD_RECORD_FIELDS]` fp32 ([`crate::KD_RECORD_FIELDS`]), written. With z = logits / T,
    ///   P the divergence's weighting distribution (the teacher for forward KL and JSD, the student for
    ///   reverse KL) and Q the other, a row's record holds, over the shard's real columns: 0 m_P = max z_P,
    ///   1 Σ exp(z_P − m_P), 2 m_Q, 3 Σ exp(z_Q − m_Q), 4 X = Σ exp(z_P − m_P)·((z_P − m_P) − (z_Q − m_Q)),
    ///   terms of zero probability under P adding 0, and 5 and 6 the shard's column range
    ///   `[vocab_start, end)` (int32 bits, as cross-entropy's records; 0.2.0's records had 5 fields,
    ///   without it). A top-K teacher's record holds the student's max and
    ///   sum over the shard's real columns (Q's fields for forward KL and JSD, P's for reverse KL) and those
    ///   of the student's columns at the teacher's ids in the shard (the other pair: the normalizer of
    ///   [`TopkNorm::Renormalize`]), X NaN.
    ///
    /// Math: the combine shifts each record to the row's maxima and merges them in rank order in fp64:
    /// KL(P ‖ Q) = X / D_P − log D_P + log D_Q; the records' sums are rounded to fp32 once per shard
    /// (`docs/numerics.md`).
    ///
    /// Errors: `INVALID_ARGUMENT` (options without a shard, vocab_start outside `[0, vocab_total]`,
    /// options out of domain), `SHAPE_MISMATCH` (teacher logits not the student's shape, top-K ids or
    /// log-probabilities not `[N, K]`, records not `[N, 7]`), `UNSUPPORTED_DTYPE`, `UNSUPPORTED_LAYOUT`,
    /// `DEVICE_MISMATCH`, `ALIASING`, `CUDA_ERROR`.
    ///
    /// [`Divergence::Jsd`]: crate::Divergence::Jsd
    /// [`TopkNorm::Renormalize`]: crate::TopkNorm::Renormalize
    pub fn kd_partial(
        &self,
        student: &TensorRef<'_>,
        teacher: &Teacher<'_>,
        options: &KdOptions,
        records: &mut TensorMut<'_>,
    ) -> Result<()> {
        let s = student.as_dl();
        let tt = RawTeacher::new(teacher);
        let t = tt.to_raw();
        let o = options.to_raw();
        let mut r = records.as_dl();
        // SAFETY: as in ce_fwd.
        let st = unsafe { sys::fce_kd_partial(self.as_raw(), self.stream, &s, &t, &o, &mut r) };
        check(st)
    }

    /// The divergence of whole rows from the records of every shard (`fce_kd_combine`): step 3 of
    /// [`Handle::kd_partial`]'s recipe. It writes what [`Handle::kd_loss`] would for the unsharded rows:
    /// masked rows, all-masked means, NaN and +inf losses and identical distributions (exactly 0) as it
    /// gives them; the loss within the fp32 rounding of the records' sums (`docs/numerics.md`). The
    /// records are merged in rank order in fp64 (no float all-reduce), so the result is bitwise
    /// reproducible and the same on every rank.
    ///
    /// * `records`: `[W, N, KD_RECORD_FIELDS]` fp32, contiguous (e.g. [`TensorRef::new`] with shape
    ///   `[w, n, 7]`): the records of ranks 0..W from [`Handle::kd_partial`], in rank (vocabulary) order.
    ///   Their column ranges must tile `[0, vocab_total)` in rank order (shards of padding alone may
    ///   follow); otherwise every row's loss (masked rows included) and statistics are NaN, never a
    ///   plausible number (no error status).
    /// * `targets`: optional `[N]` i32 or i64; rows whose target equals `options.ignore_index` are
    ///   masked (loss 0).
    /// * `options`: the partial calls' options ([`KdOptions::vocab_total`] required;
    ///   [`KdOptions::vocab_start`] is not read).
    /// * `loss`: fp32, `[N]` with [`Reduction::None`] (0 at masked rows), else a scalar
    ///   ([`Reduction::Mean`]: batchmean over the unmasked rows); nats, times T² with
    ///   [`KdOptions::scale_by_t2`]. [`Divergence::Jsd`] with 0 < β < 1 has no loss here
    ///   (`INVALID_ARGUMENT`): use [`Handle::kd_combine_row_stats`], then the terms' exchange. The records
    ///   of a top-K teacher give a NaN loss (0 at masked rows): theirs comes from
    ///   [`Handle::kd_terms_combine`].
    /// * `row_stats`: optional `[N, KD_ROW_STATS_FIELDS]` fp32 ([`crate::KD_ROW_STATS_FIELDS`]), the
    ///   rows' statistics for [`Handle::kd_bwd`] (and [`Handle::kd_terms_partial`]): 0 M_student,
    ///   1 log D_student, 2 M_teacher, 3 log D_teacher (a row's log-probabilities are (z − M) − log D),
    ///   4 A = Σ_j a_j of the gradient dL/dz_j = a_j − q_j·A (forward KL: −1; reverse KL: KL + 1). With a
    ///   top-K teacher, 2 and 3 are the max and log Σ exp of the student's columns at the teacher's ids,
    ///   and A is valid only after [`Handle::kd_terms_combine`].
    ///
    /// Math: KL(P ‖ Q) = X / D_P − log D_P + log D_Q over the merged records (see [`Handle::kd_partial`]);
    /// a column where P > 0 and Q = 0 gives +inf; NaN propagates; a row without a finite logit in either
    /// distribution gives NaN, as [`Handle::kd_loss`] does.
    ///
    /// Errors: `INVALID_ARGUMENT` (options without `vocab_total`, options out of domain, JSD with
    /// 0 < β < 1), `SHAPE_MISMATCH` (records not `[W >= 1, N, 7]`, targets not `[N]`, loss or row_stats
    /// of the wrong shape), `UNSUPPORTED_DTYPE`, `UNSUPPORTED_LAYOUT` (records not contiguous),
    /// `DEVICE_MISMATCH`, `ALIASING`, `OVERFLOW`, `WORKSPACE_TOO_SMALL`, `CUDA_ERROR`.
    ///
    /// [`Reduction::None`]: crate::Reduction::None
    /// [`Reduction::Mean`]: crate::Reduction::Mean
    /// [`Divergence::Jsd`]: crate::Divergence::Jsd
    pub fn kd_combine(
        &self,
        records: &TensorRef<'_>,
        targets: Option<&TensorRef<'_>>,
        options: &KdOptions,
        loss: &mut TensorMut<'_>,
        row_stats: Option<&mut TensorMut<'_>>,
    ) -> Result<()> {
        self.kd_combine_impl(KdCombine::Records, records, targets, options, Some(loss), row_stats, Call::Run)
    }

    /// Workspace bytes [`Handle::kd_combine`] needs for these arguments (same validation; 0 on a CPU
    /// handle).
    pub fn kd_combine_workspace_size(
        &self,
        records: &TensorRef<'_>,
        targets: Option<&TensorRef<'_>>,
        options: &KdOptions,
        loss: &mut TensorMut<'_>,
        row_stats: Option<&mut TensorMut<'_>>,
    ) -> Result<usize> {
        let mut bytes = 0usize;
        let call = Call::Query(&mut bytes);
        self.kd_combine_impl(KdCombine::Records, records, targets, options, Some(loss), row_stats, call)?;
        Ok(bytes)
    }

    /// The rows' statistics alone from the records of every shard (`fce_kd_combine` with loss = NULL):
    /// step 3 of [`Handle::kd_partial`]'s recipe for [`Divergence::Jsd`] with 0 < β < 1 and for a top-K
    /// teacher, whose loss needs the terms' second exchange ([`Handle::kd_terms_partial`],
    /// [`Handle::kd_terms_combine`]). Any divergence is accepted (for KL with teacher logits the
    /// statistics are [`Handle::kd_combine`]'s, A included). The same bits on every rank.
    ///
    /// * `records`, `targets`, `options`: as for [`Handle::kd_combine`].
    /// * `row_stats`: `[N, KD_ROW_STATS_FIELDS]` fp32, written: fields 0–3 as [`Handle::kd_combine`]
    ///   writes them (0 M_student, 1 log D_student, 2 M_teacher, 3 log D_teacher; a top-K teacher: 2 and 3
    ///   of the student's columns at its ids), field 4 (A) valid for KL with teacher logits, else (JSD:
    ///   NaN) not until [`Handle::kd_terms_combine`] writes it.
    ///
    /// Errors: `INVALID_ARGUMENT` (options without `vocab_total`, options out of domain),
    /// `SHAPE_MISMATCH` (records not `[W >= 1, N, 7]`, targets not `[N]`, row_stats not `[N, 5]`),
    /// `UNSUPPORTED_DTYPE`, `UNSUPPORTED_LAYOUT`, `DEVICE_MISMATCH`, `ALIASING`, `OVERFLOW`,
    /// `WORKSPACE_TOO_SMALL`, `CUDA_ERROR`.
    ///
    /// [`Divergence::Jsd`]: crate::Divergence::Jsd
    pub fn kd_combine_row_stats(
        &self,
        records: &TensorRef<'_>,
        targets: Option<&TensorRef<'_>>,
        options: &KdOptions,
        row_stats: &mut TensorMut<'_>,
    ) -> Result<()> {
        self.kd_combine_impl(KdCombine::Records, records, targets, options, None, Some(row_stats), Call::Run)
    }

    /// Workspace bytes [`Handle::kd_combine_row_stats`] needs for these arguments (same validation; 0 on
    /// a CPU handle).
    pub fn kd_combine_row_stats_workspace_size(
        &self,
        records: &TensorRef<'_>,
        targets: Option<&TensorRef<'_>>,
        options: &KdOptions,
        row_stats: &mut TensorMut<'_>,
    ) -> Result<usize> {
        let mut bytes = 0usize;
        let call = Call::Query(&mut bytes);
        self.kd_combine_impl(KdCombine::Records, records, targets, options, None, Some(row_stats), call)?;
        Ok(bytes)
    }

    /// A shard's sums of the divergence's element terms, from the rows' statistics
    /// (`fce_kd_terms_partial`): step 3a of [`Handle::kd_partial`]'s recipe, the second exchange of JSD
    /// and of a top-K teacher (any divergence works: for KL with teacher logits it gives the loss a second
    /// way). Since 0.2.0.
    ///
    /// * `student` `[N, V_local]` fp32, bf16 or fp16 and `teacher` ([`Teacher::Logits`] `[N, V_local]`,
    ///   any float dtype, or the whole [`Teacher::TopK`]): as given to [`Handle::kd_partial`].
    /// * `row_stats`: `[N, KD_ROW_STATS_FIELDS]` fp32 from [`Handle::kd_combine_row_stats`] (or
    ///   [`Handle::kd_combine`]); fields 0–3 are read.
    /// * `options`: the partial call's options (this shard's [`KdOptions::vocab_start`]).
    /// * `records`: `[N, KD_TERMS_RECORD_FIELDS]` fp32 ([`crate::KD_TERMS_RECORD_FIELDS`]), written: per
    ///   row, over the shard's real columns (a top-K teacher: its used slots whose ids fall in the shard),
    ///   0 Σ_j L_j and 1 Σ_j a_j, L_j and a_j the element terms of [`Handle::kd_loss`] (the loss's, not
    ///   times T², and those of the gradient dL/dz_j = a_j − q_j·A) formed from the row's log-probabilities
    ///   (z − M) − log D of the statistics (+inf where a term is, NaN where a logit or a statistic is, or a
    ///   top-K id is >= `vocab_total`), 2 the number of those slots (−1 with teacher logits), and 3 and 4
    ///   the shard's column range `[vocab_start, end)` (int32 bits; 0.2.0's records had 3 fields).
    ///
    /// Math: with z = logits / T, p the teacher's and q the student's probabilities and
    /// m = β·p + (1 − β)·q (JSD): L_j = β·p_j·log(p_j / m_j) + (1 − β)·q_j·log(q_j / m_j),
    /// a_j = (1 − β)·q_j·log(q_j / m_j); forward KL: L_j = p_j·log(p_j / q_j), a_j = −p_j; reverse KL:
    /// L_j = q_j·log(q_j / p_j), a_j = q_j·(log(q_j / p_j) + 1); terms of zero probability add 0. A top-K
    /// teacher's p is softmax_K(logprobs / T) over the used slots and its q the student's log-probability
    /// over the whole row ([`TopkNorm::FullVocab`]) or over the columns at the ids
    /// ([`TopkNorm::Renormalize`]). A record is the shard's sum rounded to fp32 (the sum formed in fp64 on
    /// the CPU; `docs/numerics.md`).
    ///
    /// Errors: `INVALID_ARGUMENT` (options without a shard or out of domain), `SHAPE_MISMATCH` (teacher
    /// logits not the student's shape, top-K ids or log-probabilities not `[N, K]`, row_stats not
    /// `[N, 5]`, records not `[N, 5]`), `UNSUPPORTED_DTYPE`, `UNSUPPORTED_LAYOUT`, `DEVICE_MISMATCH`,
    /// `ALIASING`, `CUDA_ERROR`.
    ///
    /// [`TopkNorm::FullVocab`]: crate::TopkNorm::FullVocab
    /// [`TopkNorm::Renormalize`]: crate::TopkNorm::Renormalize
    pub fn kd_terms_partial(
        &self,
        student: &TensorRef<'_>,
        teacher: &Teacher<'_>,
        row_stats: &TensorRef<'_>,
        options: &KdOptions,
        records: &mut TensorMut<'_>,
    ) -> Result<()> {
        let s = student.as_dl();
        let tt = RawTeacher::new(teacher);
        let t = tt.to_raw();
        let rs = row_stats.as_dl();
        let o = options.to_raw();
        let mut r = records.as_dl();
        // SAFETY: as in ce_fwd.
        let st = unsafe { sys::fce_kd_terms_partial(self.as_raw(), self.stream, &s, &t, &rs, &o, &mut r) };
        check(st)
    }

    /// The loss of whole rows from every shard's terms' records, and the rows' A
    /// (`fce_kd_terms_combine`): step 3c of [`Handle::kd_partial`]'s recipe. The records are added in rank
    /// order in fp64, so the result is bitwise reproducible and the same on every rank; the loss is what
    /// [`Handle::kd_loss`] gives for the unsharded rows (masked rows, all-masked means, NaN and +inf
    /// losses as it gives them) within the fp32 rounding of the records' sums (`docs/numerics.md`).
    /// Since 0.2.0.
    ///
    /// * `records`: `[W, N, KD_TERMS_RECORD_FIELDS]` fp32, contiguous (e.g. [`TensorRef::new`] with shape
    ///   `[w, n, 5]`): the records of ranks 0..W from [`Handle::kd_terms_partial`], in rank order. Their
    ///   column ranges must tile `[0, vocab_total)` in rank order, else every row's loss and A are NaN.
    /// * `targets`: optional `[N]` i32 or i64, as for [`Handle::kd_combine`] (masked rows: loss 0; so are a
    ///   top-K teacher's rows without a used slot, known from the records' slot counts).
    /// * `options`: the partial calls' options.
    /// * `loss`: fp32, `[N]` with [`Reduction::None`] (0 at masked rows), else a scalar
    ///   ([`Reduction::Mean`]: batchmean over the unmasked rows), as [`Handle::kd_combine`]'s; nats, times
    ///   T² with [`KdOptions::scale_by_t2`].
    /// * `row_stats`: `[N, KD_ROW_STATS_FIELDS]` fp32 from [`Handle::kd_combine_row_stats`] (or
    ///   [`Handle::kd_combine`]): field 4 (A) written, fields 0–3 kept; then the statistics for
    ///   [`Handle::kd_bwd`]. Required (the C API's NULL is `INVALID_ARGUMENT`).
    ///
    /// Math: loss = Σ_j L_j per row, A = Σ_j a_j (for KL with teacher logits, A as [`Handle::kd_combine`]
    /// forms it: −1, or KL + 1; a top-K teacher's sums its slots' a_k, as [`Handle::kd_loss`] does); JSD's
    /// gradient is then dL/dz_j = a_j − q_j·A = (1 − β)·q_j·(log(q_j / m_j) − S),
    /// S = Σ_k q_k·log(q_k / m_k) (the header's "Vocabulary-parallel knowledge distillation").
    ///
    /// Errors: `INVALID_ARGUMENT` (options without `vocab_total`, options out of domain),
    /// `SHAPE_MISMATCH` (records not `[W >= 1, N, 5]`, targets not `[N]`, loss or row_stats of the wrong
    /// shape), `UNSUPPORTED_DTYPE`, `UNSUPPORTED_LAYOUT` (records not contiguous), `DEVICE_MISMATCH`,
    /// `ALIASING`, `OVERFLOW`, `WORKSPACE_TOO_SMALL`, `CUDA_ERROR`.
    ///
    /// [`Reduction::None`]: crate::Reduction::None
    /// [`Reduction::Mean`]: crate::Reduction::Mean
    pub fn kd_terms_combine(
        &self,
        records: &TensorRef<'_>,
        targets: Option<&TensorRef<'_>>,
        options: &KdOptions,
        loss: &mut TensorMut<'_>,
        row_stats: &mut TensorMut<'_>,
    ) -> Result<()> {
        self.kd_combine_impl(KdCombine::Terms, records, targets, options, Some(loss), Some(row_stats), Call::Run)
    }

    /// Workspace bytes [`Handle::kd_terms_combine`] needs for these arguments (same validation; 0 on a
    /// CPU handle).
    pub fn kd_terms_combine_workspace_size(
        &self,
        records: &TensorRef<'_>,
        targets: Option<&TensorRef<'_>>,
        options: &KdOptions,
        loss: &mut TensorMut<'_>,
        row_stats: &mut TensorMut<'_>,
    ) -> Result<usize> {
        let mut bytes = 0usize;
        let call = Call::Query(&mut bytes);
        self.kd_combine_impl(KdCombine::Terms, records, targets, options, Some(loss), Some(row_stats), call)?;
        Ok(bytes)
    }

    #[allow(clippy::too_many_arguments)]
    fn kd_combine_impl(
        &self,
        which: KdCombine,
        records: &TensorRef<'_>,
        targets: Option<&TensorRef<'_>>,
        options: &KdOptions,
        loss: Option<&mut TensorMut<'_>>,
        row_stats: Option<&mut TensorMut<'_>>,
        call: Call<'_>,
    ) -> Result<()> {
        let r = records.as_dl();
        let tg = targets.map(|t| t.as_dl());
        let o = options.to_raw();
        let mut l = loss.map(|t| t.as_dl());
        let mut rs = row_stats.map(|t| t.as_dl());
        let (h, ws, wsb) = (self.as_raw(), self.workspace, self.workspace_bytes);
        // SAFETY: as in ce_fwd.
        let st = unsafe {
            match (which, call) {
                (KdCombine::Records, Call::Run) => {
                    sys::fce_kd_combine(h, self.stream, &r, cptr(&tg), &o, mptr(&mut l), mptr(&mut rs), ws, wsb)
                }
                (KdCombine::Records, Call::Query(bytes)) => {
                    sys::fce_kd_combine_workspace_size(h, &r, cptr(&tg), &o, cptr(&l), cptr(&rs), bytes)
                }
                (KdCombine::Terms, Call::Run) => {
                    sys::fce_kd_terms_combine(h, self.stream, &r, cptr(&tg), &o, mptr(&mut l), mptr(&mut rs), ws, wsb)
                }
                (KdCombine::Terms, Call::Query(bytes)) => {
                    sys::fce_kd_terms_combine_workspace_size(h, &r, cptr(&tg), &o, cptr(&l), cptr(&rs), bytes)
                }
            }
        };
        check(st)
    }

    /// A shard's dstudent from the rows' statistics (`fce_kd_bwd`): step 4 of [`Handle::kd_partial`]'s
    /// recipe. `dstudent` = d(loss)/d(student logits) × grad_loss for the shard's columns, the shard's
    /// columns of [`Handle::kd_loss`]'s dstudent within the fp32 rounding of the records' sums; formed in
    /// fp32 and rounded once; 0 at masked rows and padding columns.
    ///
    /// * `student` `[N, V_local]` fp32, bf16 or fp16 and `teacher` ([`Teacher::Logits`] `[N, V_local]`,
    ///   any float dtype, or the whole [`Teacher::TopK`]) as given to [`Handle::kd_partial`].
    /// * `targets`: optional `[N]` i32/i64, as given to [`Handle::kd_combine`] (the mean counts the same
    ///   rows; with a top-K teacher, not those without a used slot).
    /// * `row_stats`: `[N, KD_ROW_STATS_FIELDS]` fp32 from [`Handle::kd_combine`] (JSD with 0 < β < 1 and
    ///   a top-K teacher: from [`Handle::kd_combine_row_stats`] then [`Handle::kd_terms_combine`], which
    ///   writes A; before it, A is not valid and neither is the gradient).
    /// * `options`: the partial call's options (this shard's [`KdOptions::vocab_start`] and
    ///   [`KdOptions::vocab_total`]).
    /// * `grad_loss`: optional fp32 upstream gradient: a scalar, or `[N]` with [`Reduction::None`];
    ///   None means 1.
    /// * `dstudent`: `[N, V_local]` in the student's dtype.
    ///
    /// Math: with z = student logits / T and q the student's probabilities, dL/dz_j = a_j − q_j·A, A = Σ_j a_j
    /// from `row_stats` (forward KL: a_j = −p_teacher,j, A = −1; reverse KL: A = KL + 1; JSD with
    /// m = β·p + (1 − β)·q: a_j = (1 − β)·q_j·log(q_j / m_j); the element terms of [`Handle::kd_loss`]),
    /// chained through 1/T, times T² with [`KdOptions::scale_by_t2`], the reduction's factor and
    /// grad_loss. A top-K teacher, as [`Handle::kd_loss`]: a_k − q_k·A at its ids in the shard and −q_j·A
    /// at the shard's other columns with [`TopkNorm::FullVocab`] (0 with [`TopkNorm::Renormalize`]); 0 at
    /// rows without a used slot, NaN at rows with an id >= `vocab_total`.
    ///
    /// Errors: `INVALID_ARGUMENT` (options without a shard or out of domain), `SHAPE_MISMATCH`,
    /// `UNSUPPORTED_DTYPE` (also a dstudent not of the student's dtype), `UNSUPPORTED_LAYOUT`,
    /// `DEVICE_MISMATCH`, `ALIASING`, `WORKSPACE_TOO_SMALL`, `NOT_IMPLEMENTED` (on CUDA, a top-K teacher of
    /// K > 8192), `CUDA_ERROR`.
    ///
    /// [`Reduction::None`]: crate::Reduction::None
    /// [`TopkNorm::FullVocab`]: crate::TopkNorm::FullVocab
    /// [`TopkNorm::Renormalize`]: crate::TopkNorm::Renormalize
    #[allow(clippy::too_many_arguments)]
    pub fn kd_bwd(
        &self,
        student: &TensorRef<'_>,
        teacher: &Teacher<'_>,
        targets: Option<&TensorRef<'_>>,
        row_stats: &TensorRef<'_>,
        options: &KdOptions,
        grad_loss: Option<&TensorRef<'_>>,
        dstudent: &mut TensorMut<'_>,
    ) -> Result<()> {
        let s = student.as_dl();
        let mut d = dstudent.as_dl();
        self.kd_bwd_impl(&s, teacher, targets, row_stats, options, grad_loss, &mut d, Call::Run)
    }

    /// [`Handle::kd_bwd`] in place: `student` `[N, V_local]` is read, then overwritten by the shard's
    /// dstudent (padding columns 0).
    pub fn kd_bwd_in_place(
        &self,
        student: &mut TensorMut<'_>,
        teacher: &Teacher<'_>,
        targets: Option<&TensorRef<'_>>,
        row_stats: &TensorRef<'_>,
        options: &KdOptions,
        grad_loss: Option<&TensorRef<'_>>,
    ) -> Result<()> {
        let mut s = student.as_dl();
        let sp: *mut sys::DLTensor = &mut s;
        // As in cross_entropy_bwd_in_place: the header allows dstudent to be the student's memory.
        self.kd_bwd_impl(sp, teacher, targets, row_stats, options, grad_loss, sp, Call::Run)
    }

    /// Workspace bytes [`Handle::kd_bwd`] needs for these arguments (same validation; 0 on a CPU handle).
    #[allow(clippy::too_many_arguments)]
    pub fn kd_bwd_workspace_size(
        &self,
        student: &TensorRef<'_>,
        teacher: &Teacher<'_>,
        targets: Option<&TensorRef<'_>>,
        row_stats: &TensorRef<'_>,
        options: &KdOptions,
        grad_loss: Option<&TensorRef<'_>>,
        dstudent: &mut TensorMut<'_>,
    ) -> Result<usize> {
        let s = student.as_dl();
        let mut d = dstudent.as_dl();
        let mut bytes = 0usize;
        self.kd_bwd_impl(&s, teacher, targets, row_stats, options, grad_loss, &mut d, Call::Query(&mut bytes))?;
        Ok(bytes)
    }

    #[allow(clippy::too_many_arguments)]
    fn kd_bwd_impl(
        &self,
        student: *const sys::DLTensor,
        teacher: &Teacher<'_>,
        targets: Option<&TensorRef<'_>>,
        row_stats: &TensorRef<'_>,
        options: &KdOptions,
        grad_loss: Option<&TensorRef<'_>>,
        dstudent: *mut sys::DLTensor,
        call: Call<'_>,
    ) -> Result<()> {
        let tt = RawTeacher::new(teacher);
        let t = tt.to_raw();
        let tg = targets.map(|t| t.as_dl());
        let rs = row_stats.as_dl();
        let o = options.to_raw();
        let g = grad_loss.map(|g| g.as_dl());
        // SAFETY: as in ce_fwd.
        let st = unsafe {
            match call {
                Call::Run => sys::fce_kd_bwd(
                    self.as_raw(),
                    self.stream,
                    student,
                    &t,
                    cptr(&tg),
                    &rs,
                    &o,
                    cptr(&g),
                    dstudent,
                    self.workspace,
                    self.workspace_bytes,
                ),
                Call::Query(bytes) => sys::fce_kd_bwd_workspace_size(
                    self.as_raw(),
                    student,
                    &t,
                    cptr(&tg),
                    &rs,
                    &o,
                    cptr(&g),
                    dstudent,
                    bytes,
                ),
            }
        };
        check(st)
    }

    // ---------------------------------------------------------------------------------------------
    // Linear cross-entropy
    // ---------------------------------------------------------------------------------------------

    /// Linear cross-entropy: `logits = hidden · weightᵀ (+ bias)`, then cross-entropy with every
    /// option of [`CeOptions`], in token chunks, never holding `[N, V]` logits. Gradients requested in
    /// `outputs` are computed in the same call (6·N·H·V flops; forward only 2·N·H·V).
    ///
    /// * `hidden`: `[N, H]` fp32, bf16 or fp16.
    /// * `weight`: `[V, H]`, the hidden's dtype.
    /// * `bias`: optional `[V]`, the hidden's dtype.
    /// * `targets`: `[N]` i32 or i64.
    /// * `options`: as for [`Handle::cross_entropy_fwd`]; [`CeOptions::vocab_total`] must be 0 (a shard
    ///   goes through [`Handle::linear_cross_entropy_partial`]).
    /// * `outputs`: see [`LinearCeOutputs`]; with [`LinearCeOutputs::grad_entropy`] (`[N]` or scalar
    ///   fp32, needs a gradient output) the gradients are those of grad_loss·loss + Σ_i grad_entropy_i·H_i:
    ///   with dlogits = grad_loss × d(loss)/d(logits) + grad_entropy × dH/d(logits) (math in
    ///   [`CeOutputs::grad_entropy`]), dhidden = dlogits · weight, dweight = dlogitsᵀ · hidden, dbias =
    ///   Σ_rows dlogits. With [`LinearCeOutputs::accumulate`] the gradients are added into `dhidden`,
    ///   `dweight` and `dbias` as given (each sum formed in fp32, rounded once) instead of written.
    ///
    /// Errors: the validation statuses (`INVALID_ARGUMENT` also for `grad_entropy` without a gradient
    /// output and for options with `vocab_total` set), `BLAS_ERROR`, `CUDA_ERROR`, `NOT_IMPLEMENTED`.
    pub fn linear_cross_entropy_fwd(
        &self,
        hidden: &TensorRef<'_>,
        weight: &TensorRef<'_>,
        bias: Option<&TensorRef<'_>>,
        targets: &TensorRef<'_>,
        options: &CeOptions<'_>,
        outputs: &mut LinearCeOutputs<'_>,
    ) -> Result<()> {
        let mut out = RawLce::from_outputs(outputs);
        self.lce_impl(hidden, weight, bias, targets, None, None, options, &mut out, Call::Run)
    }

    /// Workspace bytes [`Handle::linear_cross_entropy_fwd`] needs for a chunk of the default size. A
    /// caller's workspace may be smaller, down to that of one-token chunks for the same N (not this query
    /// at N = 1: on a GPU a reduced loss also keeps two fp32 values per row); a `WORKSPACE_TOO_SMALL`
    /// error's message states the bytes needed. A larger workspace changes nothing: the chunks (and so
    /// the bits of the results) are the default plan's whatever the workspace's size.
    pub fn linear_cross_entropy_fwd_workspace_size(
        &self,
        hidden: &TensorRef<'_>,
        weight: &TensorRef<'_>,
        bias: Option<&TensorRef<'_>>,
        targets: &TensorRef<'_>,
        options: &CeOptions<'_>,
        outputs: &mut LinearCeOutputs<'_>,
    ) -> Result<usize> {
        let mut out = RawLce::from_outputs(outputs);
        let mut bytes = 0usize;
        self.lce_impl(hidden, weight, bias, targets, None, None, options, &mut out, Call::Query(&mut bytes))?;
        Ok(bytes)
    }

    /// Linear cross-entropy backward from a saved logsumexp: recomputes each chunk's logits and writes
    /// the gradients requested in `grads` (at least one of dhidden `[N, H]`, dweight `[V, H]`, dbias
    /// `[V]`), times `grads.grad_loss`; with `grads.grad_entropy` (`[N]` or scalar fp32) and
    /// `grads.saved_entropy` (`[N]` fp32, the forward's entropy output) also the entropy's gradient, as
    /// [`Handle::linear_cross_entropy_fwd`] with [`LinearCeOutputs::grad_entropy`] computes it. With
    /// [`LinearCeGrads::accumulate`] they are added into the outputs given (each sum formed in fp32,
    /// rounded once) instead of written.
    ///
    /// * `lse`: fp32 from [`Handle::linear_cross_entropy_fwd`] with the same `options`, `[N]` or its pairs
    ///   `[N, 2]` (see [`Handle::cross_entropy_bwd`]: from the pairs the probabilities hold at any offset of
    ///   the logits).
    /// * Other arguments as the forward.
    ///
    /// With a vocabulary shard (`options.vocab_total > 0`, step 4 of
    /// [`Handle::linear_cross_entropy_partial`]'s recipe): `weight` `[V_local, H]` and `bias` `[V_local]` are
    /// the shard's rows as given to the partial call, `targets` global indices, `lse` (best its pairs
    /// `[N, 2]`) and `grads.saved_entropy` the outputs of [`Handle::cross_entropy_combine`]; `grads.dweight`
    /// `[V_local, H]` and `grads.dbias` `[V_local]` are the shard's rows of the unsharded gradients
    /// (padding rows, at or past vocab_total, get 0; with `grads.accumulate` they are left as they are),
    /// and `grads.dhidden` `[N, H]` must be fp32: this shard's part of dhidden, to be summed over the
    /// ranks in fp32 and rounded once.
    ///
    /// Errors as the forward; `INVALID_ARGUMENT` also for `grad_entropy` without `saved_entropy`,
    /// `SHAPE_MISMATCH` for a `saved_entropy` not `[N]`, `UNSUPPORTED_DTYPE` for a shard's dhidden not
    /// fp32.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_cross_entropy_bwd(
        &self,
        hidden: &TensorRef<'_>,
        weight: &TensorRef<'_>,
        bias: Option<&TensorRef<'_>>,
        targets: &TensorRef<'_>,
        lse: &TensorRef<'_>,
        options: &CeOptions<'_>,
        grads: &mut LinearCeGrads<'_>,
    ) -> Result<()> {
        let mut out = RawLce::from_grads(grads);
        self.lce_impl(hidden, weight, bias, targets, Some(lse), None, options, &mut out, Call::Run)
    }

    /// Workspace bytes [`Handle::linear_cross_entropy_bwd`] needs (as the forward's query).
    #[allow(clippy::too_many_arguments)]
    pub fn linear_cross_entropy_bwd_workspace_size(
        &self,
        hidden: &TensorRef<'_>,
        weight: &TensorRef<'_>,
        bias: Option<&TensorRef<'_>>,
        targets: &TensorRef<'_>,
        lse: &TensorRef<'_>,
        options: &CeOptions<'_>,
        grads: &mut LinearCeGrads<'_>,
    ) -> Result<usize> {
        let mut out = RawLce::from_grads(grads);
        let mut bytes = 0usize;
        self.lce_impl(hidden, weight, bias, targets, Some(lse), None, options, &mut out, Call::Query(&mut bytes))?;
        Ok(bytes)
    }

    /// NCCL mode's linear cross-entropy over an LM head split by vocabulary rows
    /// (`fce_linear_cross_entropy_fwd_vp`), one call per rank: in each token chunk the shard's logits, their
    /// records, an all-gather of the chunk's records over `comm` on the handle's stream, the combine in rank
    /// order, and with gradients the chunk's dlogits from the combined lse, then the dhidden and dweight
    /// GEMMs; dhidden is every rank's part summed in fp32 in rank order and rounded once. The same bits on
    /// every rank, those of [`Handle::linear_cross_entropy_partial`] and [`Handle::cross_entropy_combine`]
    /// (and the backward) over the same shards on one device.
    ///
    /// * `hidden` `[N, H]`, `weight` `[V_local, H]` (this rank's rows of the head), `bias` `[V_local]`,
    ///   `targets` `[N]` global indices: as for [`Handle::linear_cross_entropy_partial`].
    /// * `options`: [`CeOptions::vocab_start`] (this rank's first row, ranks in vocabulary order) and
    ///   [`CeOptions::vocab_total`] required; the rest the same on every rank.
    /// * `outputs`: as for [`Handle::linear_cross_entropy_fwd`] (the whole rows' statistics); `dhidden`
    ///   `[N, H]` (any float dtype: the ranks' sum), `dweight` `[V_local, H]` and `dbias` `[V_local]` this
    ///   shard's rows. Every rank passes the same outputs.
    ///
    /// Every rank must cut the same token chunks, so they are planned from `vocab_total / W` and the default
    /// workspace on every rank: a caller's workspace below this rank's query is refused
    /// (`WORKSPACE_TOO_SMALL`), not cut into more chunks.
    ///
    /// Errors: the validation statuses (`INVALID_ARGUMENT` also on a CPU handle), `WORKSPACE_TOO_SMALL`,
    /// `COMMUNICATOR_ERROR` (a collective failed), `BLAS_ERROR`, `CUDA_ERROR`.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_cross_entropy_fwd_vp(
        &self,
        comm: &Comm,
        hidden: &TensorRef<'_>,
        weight: &TensorRef<'_>,
        bias: Option<&TensorRef<'_>>,
        targets: &TensorRef<'_>,
        options: &CeOptions<'_>,
        outputs: &mut LinearCeOutputs<'_>,
    ) -> Result<()> {
        let mut out = RawLce::from_outputs(outputs);
        self.lce_impl(hidden, weight, bias, targets, None, Some(comm), options, &mut out, Call::Run)
    }

    /// Workspace bytes [`Handle::linear_cross_entropy_fwd_vp`] uses (its default plan; the least it takes).
    #[allow(clippy::too_many_arguments)]
    pub fn linear_cross_entropy_fwd_vp_workspace_size(
        &self,
        comm: &Comm,
        hidden: &TensorRef<'_>,
        weight: &TensorRef<'_>,
        bias: Option<&TensorRef<'_>>,
        targets: &TensorRef<'_>,
        options: &CeOptions<'_>,
        outputs: &mut LinearCeOutputs<'_>,
    ) -> Result<usize> {
        let mut out = RawLce::from_outputs(outputs);
        let mut bytes = 0usize;
        self.lce_impl(hidden, weight, bias, targets, None, Some(comm), options, &mut out, Call::Query(&mut bytes))?;
        Ok(bytes)
    }

    /// `lse`: the backward (no `comm`); `comm`: NCCL mode's forward.
    #[allow(clippy::too_many_arguments)]
    fn lce_impl(
        &self,
        hidden: &TensorRef<'_>,
        weight: &TensorRef<'_>,
        bias: Option<&TensorRef<'_>>,
        targets: &TensorRef<'_>,
        lse: Option<&TensorRef<'_>>,
        comm: Option<&Comm>,
        options: &CeOptions<'_>,
        out: &mut RawLce,
        call: Call<'_>,
    ) -> Result<()> {
        let h = hidden.as_dl();
        let w = weight.as_dl();
        let b = bias.map(|b| b.as_dl());
        let t = targets.as_dl();
        let cw = dl(&options.class_weights);
        let o = options.to_raw(cw.as_ref());
        let mut raw_out = raw::init::<sys::fce_linear_ce_outputs_t>();
        {
            let r = &mut raw_out;
            r.loss = mptr(&mut out.loss);
            r.lse = mptr(&mut out.lse);
            r.z_loss = mptr(&mut out.z_loss);
            r.argmax = mptr(&mut out.argmax);
            r.entropy = mptr(&mut out.entropy);
            r.dhidden = mptr(&mut out.dhidden);
            r.dweight = mptr(&mut out.dweight);
            r.dbias = mptr(&mut out.dbias);
            r.grad_loss = cptr(&out.grad_loss);
            r.grad_entropy = cptr(&out.grad_entropy);
            r.saved_entropy = cptr(&out.saved_entropy);
            r.flags = out.flags;
        }
        // SAFETY: as in ce_fwd.
        let st = unsafe {
            match (lse, comm, call) {
                (_, Some(c), Call::Run) => sys::fce_linear_cross_entropy_fwd_vp(
                    self.as_raw(),
                    c.as_raw(),
                    self.stream,
                    &h,
                    &w,
                    cptr(&b),
                    &t,
                    &o,
                    &raw_out,
                    self.workspace,
                    self.workspace_bytes,
                ),
                (_, Some(c), Call::Query(bytes)) => sys::fce_linear_cross_entropy_fwd_vp_workspace_size(
                    self.as_raw(),
                    c.as_raw(),
                    &h,
                    &w,
                    cptr(&b),
                    &t,
                    &o,
                    &raw_out,
                    bytes,
                ),
                (None, None, Call::Run) => sys::fce_linear_cross_entropy_fwd(
                    self.as_raw(),
                    self.stream,
                    &h,
                    &w,
                    cptr(&b),
                    &t,
                    &o,
                    &raw_out,
                    self.workspace,
                    self.workspace_bytes,
                ),
                (None, None, Call::Query(bytes)) => sys::fce_linear_cross_entropy_fwd_workspace_size(
                    self.as_raw(),
                    &h,
                    &w,
                    cptr(&b),
                    &t,
                    &o,
                    &raw_out,
                    bytes,
                ),
                (Some(l), None, Call::Run) => sys::fce_linear_cross_entropy_bwd(
                    self.as_raw(),
                    self.stream,
                    &h,
                    &w,
                    cptr(&b),
                    &t,
                    &l.as_dl(),
                    &o,
                    &raw_out,
                    self.workspace,
                    self.workspace_bytes,
                ),
                (Some(l), None, Call::Query(bytes)) => sys::fce_linear_cross_entropy_bwd_workspace_size(
                    self.as_raw(),
                    &h,
                    &w,
                    cptr(&b),
                    &t,
                    &l.as_dl(),
                    &o,
                    &raw_out,
                    bytes,
                ),
            }
        };
        check(st)
    }

    // ---------------------------------------------------------------------------------------------
    // Vocabulary-parallel linear cross-entropy
    // ---------------------------------------------------------------------------------------------

    /// The cross-entropy records of one vocabulary shard of the LM head
    /// (`fce_linear_cross_entropy_partial`): step 1 of vocabulary-parallel linear cross-entropy, whose
    /// steps are (the header's "Vocabulary-parallel linear cross-entropy"):
    ///
    /// 1. each rank: `linear_cross_entropy_partial` on its rows of the weight → records `[N, K]` of its
    ///    shard's logits;
    /// 2. the caller gathers every rank's records in rank (vocabulary) order into `[W, N, K]` (an
    ///    all-gather; the library does no communication);
    /// 3. each rank: [`Handle::cross_entropy_combine`] → loss, lse, z-loss, argmax and entropy of the
    ///    whole rows, the same bits on every rank;
    /// 4. each rank: [`Handle::linear_cross_entropy_bwd`] with the combined lse and the same sharded
    ///    options → its shard's dweight and dbias (complete: they depend on the shard's logits only) and
    ///    its part of dhidden, fp32 `[N, H]`; the caller sums the W parts in fp32 and rounds once (in rank
    ///    order for the same bits whatever the communicator: an all-reduce's order is its algorithm's
    ///    beyond two ranks).
    ///
    /// Step 4 recomputes the shard's logits (8·N·H·V_local flops in all).
    ///
    /// * `hidden`: `[N, H]` fp32, bf16 or fp16, the whole batch (the same on every rank).
    /// * `weight`: `[V_local, H]`, the hidden's dtype, V_local >= 1: rows
    ///   `[options.vocab_start, options.vocab_start + V_local)` of the LM head; those at or past
    ///   `options.vocab_total` are padding and never read.
    /// * `bias`: optional `[V_local]`, the hidden's dtype: the shard's part of the bias.
    /// * `targets`: `[N]` i32 or i64, global class indices.
    /// * `options`: [`CeOptions::vocab_start`] and [`CeOptions::vocab_total`] required
    ///   (0 <= vocab_start <= vocab_total <= 2³¹ − 1; vocab_start = vocab_total: a shard of padding
    ///   alone); the other options as for
    ///   [`Handle::linear_cross_entropy_fwd`] (class weights of the whole vocabulary, `[vocab_total]`).
    /// * `records`: `[N, K]` fp32, written: the records [`Handle::cross_entropy_partial`] writes for the
    ///   shard's logits, `hidden · weightᵀ (+ bias)` rounded to the inputs' dtype as in
    ///   [`Handle::linear_cross_entropy_fwd`] (K and the fields there).
    ///
    /// Errors: the validation statuses (`INVALID_ARGUMENT` also for options without a shard or a
    /// vocab_start outside `[0, vocab_total)`; `SHAPE_MISMATCH` for records not `[N, K]`),
    /// `WORKSPACE_TOO_SMALL`, `BLAS_ERROR`, `CUDA_ERROR`.
    pub fn linear_cross_entropy_partial(
        &self,
        hidden: &TensorRef<'_>,
        weight: &TensorRef<'_>,
        bias: Option<&TensorRef<'_>>,
        targets: &TensorRef<'_>,
        options: &CeOptions<'_>,
        records: &mut TensorMut<'_>,
    ) -> Result<()> {
        self.lce_partial(hidden, weight, bias, targets, options, records, Call::Run)
    }

    /// Workspace bytes [`Handle::linear_cross_entropy_partial`] uses by default (same validation); a
    /// caller's workspace may be smaller, as for [`Handle::linear_cross_entropy_fwd_workspace_size`].
    pub fn linear_cross_entropy_partial_workspace_size(
        &self,
        hidden: &TensorRef<'_>,
        weight: &TensorRef<'_>,
        bias: Option<&TensorRef<'_>>,
        targets: &TensorRef<'_>,
        options: &CeOptions<'_>,
        records: &mut TensorMut<'_>,
    ) -> Result<usize> {
        let mut bytes = 0usize;
        self.lce_partial(hidden, weight, bias, targets, options, records, Call::Query(&mut bytes))?;
        Ok(bytes)
    }

    #[allow(clippy::too_many_arguments)]
    fn lce_partial(
        &self,
        hidden: &TensorRef<'_>,
        weight: &TensorRef<'_>,
        bias: Option<&TensorRef<'_>>,
        targets: &TensorRef<'_>,
        options: &CeOptions<'_>,
        records: &mut TensorMut<'_>,
        call: Call<'_>,
    ) -> Result<()> {
        let h = hidden.as_dl();
        let w = weight.as_dl();
        let b = bias.map(|b| b.as_dl());
        let t = targets.as_dl();
        let cw = dl(&options.class_weights);
        let o = options.to_raw(cw.as_ref());
        let mut r = records.as_dl();
        // SAFETY: as in ce_fwd.
        let st = unsafe {
            match call {
                Call::Run => sys::fce_linear_cross_entropy_partial(
                    self.as_raw(),
                    self.stream,
                    &h,
                    &w,
                    cptr(&b),
                    &t,
                    &o,
                    &mut r,
                    self.workspace,
                    self.workspace_bytes,
                ),
                Call::Query(bytes) => sys::fce_linear_cross_entropy_partial_workspace_size(
                    self.as_raw(),
                    &h,
                    &w,
                    cptr(&b),
                    &t,
                    &o,
                    &r,
                    bytes,
                ),
            }
        };
        check(st)
    }
}

/// DLTensors of a distillation call's teacher, kept alive for the call.
struct RawTeacher {
    logits: Option<sys::DLTensor>,
    topk_ids: Option<sys::DLTensor>,
    topk_logprobs: Option<sys::DLTensor>,
}

impl RawTeacher {
    fn new(t: &Teacher<'_>) -> RawTeacher {
        match t {
            Teacher::Logits(l) => RawTeacher { logits: Some(l.as_dl()), topk_ids: None, topk_logprobs: None },
            Teacher::TopK { ids, logprobs } => {
                RawTeacher { logits: None, topk_ids: Some(ids.as_dl()), topk_logprobs: Some(logprobs.as_dl()) }
            }
        }
    }
    /// The C struct (filled by `fce_kd_teacher_init`, then these fields), pointing into `self`: valid while
    /// `self` is neither moved nor dropped.
    fn to_raw(&self) -> sys::fce_kd_teacher_t {
        let mut t = raw::init::<sys::fce_kd_teacher_t>();
        {
            let r = &mut t;
            r.logits = cptr(&self.logits);
            r.topk_ids = cptr(&self.topk_ids);
            r.topk_logprobs = cptr(&self.topk_logprobs);
        }
        t
    }
}

/// DLTensors of a linear cross-entropy call's outputs, kept alive for the call.
struct RawLce {
    loss: Option<sys::DLTensor>,
    lse: Option<sys::DLTensor>,
    z_loss: Option<sys::DLTensor>,
    argmax: Option<sys::DLTensor>,
    entropy: Option<sys::DLTensor>,
    dhidden: Option<sys::DLTensor>,
    dweight: Option<sys::DLTensor>,
    dbias: Option<sys::DLTensor>,
    grad_loss: Option<sys::DLTensor>,
    grad_entropy: Option<sys::DLTensor>,
    saved_entropy: Option<sys::DLTensor>,
    /// `fce_linear_ce_outputs_t.flags` (`FCE_LINEAR_CE_*` bits).
    flags: u64,
}

/// The `fce_linear_ce_outputs_t.flags` of an `accumulate` field.
fn lce_flags(accumulate: bool) -> u64 {
    if accumulate {
        u64::from(sys::FCE_LINEAR_CE_ACCUMULATE)
    } else {
        0
    }
}

impl RawLce {
    fn from_outputs(o: &mut LinearCeOutputs<'_>) -> RawLce {
        RawLce {
            loss: Some(o.loss.as_dl()),
            lse: dl_mut(&mut o.lse),
            z_loss: dl_mut(&mut o.z_loss),
            argmax: dl_mut(&mut o.argmax),
            entropy: dl_mut(&mut o.entropy),
            dhidden: dl_mut(&mut o.dhidden),
            dweight: dl_mut(&mut o.dweight),
            dbias: dl_mut(&mut o.dbias),
            grad_loss: dl(&o.grad_loss),
            grad_entropy: dl(&o.grad_entropy),
            saved_entropy: None,
            flags: lce_flags(o.accumulate),
        }
    }
    fn from_grads(g: &mut LinearCeGrads<'_>) -> RawLce {
        RawLce {
            loss: None,
            lse: None,
            z_loss: None,
            argmax: None,
            entropy: None,
            dhidden: dl_mut(&mut g.dhidden),
            dweight: dl_mut(&mut g.dweight),
            dbias: dl_mut(&mut g.dbias),
            grad_loss: dl(&g.grad_loss),
            grad_entropy: dl(&g.grad_entropy),
            saved_entropy: dl(&g.saved_entropy),
            flags: lce_flags(g.accumulate),
        }
    }
}
