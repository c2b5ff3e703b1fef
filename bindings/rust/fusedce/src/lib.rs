//! Safe Rust API of libfusedce: fused kernels for the losses at the end of a language model —
//! cross-entropy (forward, fused or separate backward, with the entropy's gradient too, or over a
//! vocabulary split across ranks), logsumexp and temperature softmax (of whole rows, or over a vocabulary
//! split across ranks), knowledge distillation (full or top-K teacher, or over a vocabulary split across
//! ranks) and linear cross-entropy (the LM-head GEMM fused with the loss, or over an LM head split by
//! vocabulary rows across ranks), on CPU or CUDA.
//!
//! * [`Handle`]: one per device, freed on drop; `Send`, not `Sync`. One method per op.
//! * [`TensorRef`] / [`TensorMut`]: views of Rust slices (or, behind `unsafe`, raw device memory)
//!   that become DLPack tensors for the duration of a call. Shapes are `[]`, `[n]` or `[rows, cols]`
//!   (and `[W, N, K]` for the records of vocabulary-parallel cross-entropy, logsumexp and distillation).
//! * An lse (a saved logsumexp, output or input) is fp32 `[N]`, or its pairs `[N, 2]` (the row's max and
//!   the log of the shifted sum, [`TensorRef::lse_pairs`] / [`TensorMut::lse_pairs`]): a backward or a
//!   shard's softmax from the pairs forms its probabilities from max-shifted values, as the forward does,
//!   so no rounding of the size of the logits enters them (a backward from the pairs has the fused
//!   gradient's bits). [`lse_from_pairs`] gives the lse of the pairs.
//! * Option structs ([`CeOptions`], [`KdOptions`], ...) whose `Default` is the loaded library's, from its
//!   `fce_*_init` functions (the header's `*_INIT` values); every C struct handed to the library is
//!   filled by those functions first, with `struct_size` = these bindings' `size_of`.
//! * [`build_info`]: what the loaded library was built with (CUDA backend, CUDA/cuBLAS versions, GPU
//!   architectures).
//! * [`Error`]: the library's status and its per-thread message; [`Result`] everywhere.
//!
//! Units: losses, log-probabilities and entropies are in nats; every statistic is computed in fp32 or
//! wider whatever the input dtype; results are bitwise reproducible run to run on one device.
//!
//! ```no_run
//! use fusedce::{CeOptions, CeOutputs, Handle, TensorMut, TensorRef};
//! # fn main() -> fusedce::Result<()> {
//! let h = Handle::cpu()?;
//! let (n, v) = (2, 3);
//! let logits = [1.0f32, 2.0, 3.0, 0.5, 0.5, 0.5];
//! let targets = [2i64, 0];
//! let mut loss = 0.0f32; // mean over rows, nats
//! let mut dlogits = vec![0.0f32; n * v];
//! h.cross_entropy_fwd(
//!     &TensorRef::matrix(&logits, n, v)?,
//!     &TensorRef::vector(&targets),
//!     &CeOptions::default(),
//!     &mut CeOutputs::new(TensorMut::scalar(&mut loss)).dlogits(TensorMut::matrix(&mut dlogits, n, v)?),
//! )?;
//! println!("loss {loss} nats");
//! # Ok(())
//! # }
//! ```
#![deny(missing_docs)]

pub use fusedce_sys as sys;

mod comm;
mod error;
mod handle;
mod options;
mod raw;
mod tensor;

pub use comm::Comm;
pub use error::{Error, Result, Status, VersionMismatch};
pub use handle::{Handle, Stream};
pub use options::{
    CeBwdInputs, CeOptions, CeOutputs, Divergence, KdOptions, KdOutputs, LinearCeGrads, LinearCeOutputs, LseOptions,
    Reduction, SoftmaxOptions, Teacher, TopkNorm,
};
pub use tensor::{bits, DType, Device, Element, TensorMut, TensorRef};

use std::ffi::CStr;

/// `FCE_VERSION_NUMBER` of the header these bindings were generated from (MAJOR·10000 + MINOR·100 + PATCH).
pub const HEADER_VERSION_NUMBER: u32 = sys::FCE_VERSION_NUMBER;
/// `FCE_ABI_VERSION` of the header these bindings were generated from.
pub const HEADER_ABI_VERSION: u32 = sys::FCE_ABI_VERSION;
/// `FCE_WORKSPACE_ALIGNMENT`: required alignment, in bytes, of a caller's workspace
/// ([`Handle::set_workspace`]).
pub const WORKSPACE_ALIGNMENT: usize = sys::FCE_WORKSPACE_ALIGNMENT as usize;
/// `FCE_MAX_STRUCT_SIZE`: the largest `struct_size` the library accepts for any struct.
pub const MAX_STRUCT_SIZE: usize = sys::FCE_MAX_STRUCT_SIZE as usize;
/// `FCE_KD_TEMPERATURE_MIN` (1e-4): lower end of [`KdOptions::temperature`]'s domain, inclusive.
pub const KD_TEMPERATURE_MIN: f32 = sys::FCE_KD_TEMPERATURE_MIN as f32;
/// `FCE_KD_TEMPERATURE_MAX` (100): upper end of [`KdOptions::temperature`]'s domain, inclusive.
pub const KD_TEMPERATURE_MAX: f32 = sys::FCE_KD_TEMPERATURE_MAX as f32;
/// `FCE_CE_RECORD_FIELDS_LOSS` (6): the narrowest cross-entropy record, fields 0–5 (the loss, lse and
/// z-loss; 4 and 5 the shard's column range), for [`Handle::cross_entropy_partial`] and
/// [`Handle::linear_cross_entropy_partial`]. Was 4 in 0.1.0.
pub const CE_RECORD_FIELDS_LOSS: usize = sys::FCE_CE_RECORD_FIELDS_LOSS as usize;
/// `FCE_CE_RECORD_FIELDS_ENTROPY` (7): a cross-entropy record with the entropy as well (fields 0–6).
/// Was 5 in 0.1.0.
pub const CE_RECORD_FIELDS_ENTROPY: usize = sys::FCE_CE_RECORD_FIELDS_ENTROPY as usize;
/// `FCE_CE_RECORD_FIELDS_ALL` (9): a cross-entropy record with every field (0–8, the argmax too), what
/// [`cross_entropy_record_fields`] returns. Was 7 in 0.1.0.
pub const CE_RECORD_FIELDS_ALL: usize = sys::FCE_CE_RECORD_FIELDS_ALL as usize;
/// `FCE_LSE_RECORD_FIELDS` (6): the fp32 fields per row of a vocabulary shard's logsumexp record
/// ([`Handle::logsumexp_partial`] writes `[N, 6]`, [`Handle::logsumexp_combine`] reads `[W, N, 6]`): the
/// raw max, the shifted sum, the column range, the scale and vocab_total. Was 2 in 0.1.0.
pub const LSE_RECORD_FIELDS: usize = sys::FCE_LSE_RECORD_FIELDS as usize;
/// `FCE_KD_RECORD_FIELDS` (7): the fp32 fields per row of a vocabulary shard's distillation record
/// ([`Handle::kd_partial`] writes `[N, 7]`, [`Handle::kd_combine`] reads `[W, N, 7]`; 5 and 6 the column
/// range). Was 5 in 0.1.0.
pub const KD_RECORD_FIELDS: usize = sys::FCE_KD_RECORD_FIELDS as usize;
/// `FCE_KD_ROW_STATS_FIELDS` (5): the fp32 fields per row of the rows' distillation statistics
/// ([`Handle::kd_combine`] or [`Handle::kd_combine_row_stats`] writes `[N, 5]`, [`Handle::kd_terms_combine`]
/// writes field 4 for JSD and a top-K teacher, [`Handle::kd_bwd`] reads them).
pub const KD_ROW_STATS_FIELDS: usize = sys::FCE_KD_ROW_STATS_FIELDS as usize;
/// `FCE_KD_TERMS_RECORD_FIELDS` (5): the fp32 fields per row of a vocabulary shard's record of the
/// divergence's terms, the second exchange of JSD and of a top-K teacher ([`Handle::kd_terms_partial`]
/// writes `[N, 5]`: 0 Σ L_j, 1 Σ a_j, 2 the top-K teacher's used slots whose ids fall in the shard, −1 with
/// teacher logits, 3 and 4 the shard's column range; [`Handle::kd_terms_combine`] reads `[W, N, 5]`).
/// Since 0.2.0; 3 fields in 0.1.0.
pub const KD_TERMS_RECORD_FIELDS: usize = sys::FCE_KD_TERMS_RECORD_FIELDS as usize;

/// `fce_version_number()`: MAJOR·10000 + MINOR·100 + PATCH of the loaded library.
pub fn version_number() -> u32 {
    // SAFETY: no arguments, no preconditions.
    unsafe { sys::fce_version_number() }
}

/// `fce_version_string()`: "MAJOR.MINOR.PATCH" of the loaded library.
pub fn version_string() -> &'static str {
    // SAFETY: static storage, never NULL.
    let p = unsafe { sys::fce_version_string() };
    if p.is_null() {
        return "";
    }
    unsafe { CStr::from_ptr(p) }.to_str().unwrap_or("")
}

/// `fce_abi_version()`: the ABI version of the loaded library (the `N` of `libfusedce.so.N`).
pub fn abi_version() -> u32 {
    // SAFETY: no arguments, no preconditions.
    unsafe { sys::fce_abi_version() }
}

/// Checks that the loaded library can serve these bindings: same ABI version, and a version number
/// at least the header's (functions and struct fields are only ever added within an ABI).
pub fn check_version() -> std::result::Result<(), VersionMismatch> {
    let m = VersionMismatch {
        header_version: HEADER_VERSION_NUMBER,
        library_version: version_number(),
        header_abi: HEADER_ABI_VERSION,
        library_abi: abi_version(),
    };
    if m.library_abi == m.header_abi && m.library_version >= m.header_version {
        Ok(())
    } else {
        Err(m)
    }
}

/// `fce_cross_entropy_record_fields`: K, the fp32 fields per row of a vocabulary shard's record, for
/// these options ([`CE_RECORD_FIELDS_ALL`], 9 in this version, 7 in 0.1.0: see
/// [`Handle::cross_entropy_partial`] for what they hold). Size the
/// `[N, K]` records of [`Handle::cross_entropy_partial`] and [`Handle::linear_cross_entropy_partial`] and
/// the `[W, N, K]` ones of [`Handle::cross_entropy_combine`] with it.
///
/// Needs no handle. Errors: `INVALID_ARGUMENT` when the library refuses the options struct.
pub fn cross_entropy_record_fields(options: &CeOptions<'_>) -> Result<usize> {
    let cw = options.class_weights.as_ref().map(|w| w.as_dl());
    let o = options.to_raw(cw.as_ref());
    let mut k = 0i64;
    // SAFETY: `o` is a filled fce_ce_options_t (its class_weights, if any, points at `cw`, alive here);
    // `k` is a valid out pointer.
    error::check(unsafe { sys::fce_cross_entropy_record_fields(&o, &mut k) })?;
    usize::try_from(k).map_err(|_| {
        Error::new(Status::INTERNAL_ERROR, format!("fce_cross_entropy_record_fields returned {} fields", k))
    })
}

/// The lse of each row from its pair (m, l), as written into an `[N, 2]` lse ([`CeOutputs::lse`],
/// [`Handle::cross_entropy_combine`], [`Handle::logsumexp_combine`], ...): `scale·m + l`, formed in fp64
/// and rounded once to fp32 (within an fp32 rounding of the `[N]` form the library writes). `scale` is
/// 1 for the pairs of cross-entropy and linear cross-entropy (m the max of the transformed logits z),
/// and the records' [`LseOptions::scale`] for those of logsumexp (m the raw max). A pair (±inf, 0) gives
/// ±inf, a NaN gives NaN.
///
/// `pairs` is the `[N, 2]` buffer row by row, `[m_0, l_0, m_1, l_1, ...]`; an odd length is
/// `SHAPE_MISMATCH`.
pub fn lse_from_pairs(pairs: &[f32], scale: f32) -> Result<Vec<f32>> {
    if pairs.len() % 2 != 0 {
        return Err(Error::new(
            Status::SHAPE_MISMATCH,
            format!("fusedce (Rust): lse pairs [N, 2] need an even length; got {} values", pairs.len()),
        ));
    }
    Ok(pairs.chunks_exact(2).map(|p| (scale as f64 * p[0] as f64 + p[1] as f64) as f32).collect())
}

/// What the loaded library was built with ([`build_info`], `fce_build_info_t`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BuildInfo {
    /// `FCE_VERSION_NUMBER` of the library: MAJOR·10000 + MINOR·100 + PATCH.
    pub version_number: u32,
    /// `FCE_ABI_VERSION` of the library.
    pub abi_version: u32,
    /// The CUDA backend is built (false: a CPU-only build).
    pub cuda_backend: bool,
    /// `CUDART_VERSION` the library was compiled against (13000 = 13.0); 0 without CUDA.
    pub cuda_runtime_version: i32,
    /// `CUBLAS_VERSION` of the cuBLAS headers it was compiled against (130100 = 13.1.0); 0 without CUDA.
    /// cuBLAS itself is loaded at run time on the first linear cross-entropy call.
    pub cublas_version: i32,
    /// "MAJOR.MINOR.PATCH".
    pub version_string: String,
    /// GPU code compiled in, space separated ("sm_80 sm_90 compute_90": machine code for sm_80 and sm_90,
    /// PTX for newer GPUs); empty without CUDA.
    pub cuda_architectures: String,
}

impl std::fmt::Display for BuildInfo {
    /// `libfusedce 0.2.0 (ABI 0), CUDA backend: CUDA runtime 13.0, cuBLAS 13.1.0, sm_80 sm_90 compute_90`,
    /// or `libfusedce 0.2.0 (ABI 0), CPU only`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "libfusedce {} (ABI {})", self.version_string, self.abi_version)?;
        if !self.cuda_backend {
            return write!(f, ", CPU only");
        }
        let (rt, cb) = (self.cuda_runtime_version, self.cublas_version);
        write!(
            f,
            ", CUDA backend: CUDA runtime {}.{}, cuBLAS {}.{}.{}, {}",
            rt / 1000,
            rt % 1000 / 10,
            cb / 10000,
            cb % 10000 / 100,
            cb % 100,
            if self.cuda_architectures.is_empty() { "no GPU code" } else { &self.cuda_architectures }
        )
    }
}

/// `fce_build_info()`: what the loaded library was built with.
///
/// The struct is passed with room for a newer library's larger one (`struct_size` =
/// [`MAX_STRUCT_SIZE`]), so the call cannot fail; it panics if the library reports otherwise.
pub fn build_info() -> BuildInfo {
    let mut room = raw::Room::<sys::fce_build_info_t>::zeroed();
    room.set_struct_size(MAX_STRUCT_SIZE as u32);
    // SAFETY: MAX_STRUCT_SIZE writable bytes, aligned for the struct; the library writes at most struct_size.
    let st = unsafe { sys::fce_build_info(room.as_mut_ptr()) };
    if let Err(e) = error::check(st) {
        panic!("fusedce: fce_build_info failed: {}", e);
    }
    let b = room.get();
    let text = |p: *const std::os::raw::c_char| {
        if p.is_null() {
            String::new()
        } else {
            // SAFETY: NUL-terminated static storage of the library.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    BuildInfo {
        version_number: b.version_number,
        abi_version: b.abi_version,
        cuda_backend: b.cuda_backend != 0,
        cuda_runtime_version: b.cuda_runtime_version,
        cublas_version: b.cublas_version,
        version_string: text(b.version_string),
        cuda_architectures: text(b.cuda_architectures),
    }
}
