//! Safe Rust API of libfusedce: fused kernels for the losses at the end of a language model —
//! cross-entropy (forward, fused or separate backward), logsumexp, temperature softmax, knowledge
//! distillation (full or top-K teacher) and linear cross-entropy (the LM-head GEMM fused with the loss),
//! on CPU or CUDA.
//!
//! * [`Handle`]: one per device, freed on drop; `Send`, not `Sync`. One method per op.
//! * [`TensorRef`] / [`TensorMut`]: views of Rust slices (or, behind `unsafe`, raw device memory)
//!   that become DLPack tensors for the duration of a call. Shapes are `[]`, `[n]` or `[rows, cols]`.
//! * Option structs ([`CeOptions`], [`KdOptions`], ...) whose `Default` is the header's `*_INIT`.
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

mod error;
mod handle;
mod options;
mod tensor;

pub use error::{Error, Result, Status, VersionMismatch};
pub use handle::{Handle, Stream};
pub use options::{
    CeOptions, CeOutputs, Divergence, KdOptions, KdOutputs, LinearCeGrads, LinearCeOutputs, LseOptions, Reduction,
    SoftmaxOptions, Teacher, TopkNorm,
};
pub use tensor::{bits, DType, Device, Element, TensorMut, TensorRef};

use std::ffi::CStr;

/// `FCE_VERSION_NUMBER` of the header these bindings were generated from (MAJOR·10000 + MINOR·100 + PATCH).
pub const HEADER_VERSION_NUMBER: u32 = sys::FCE_VERSION_NUMBER;
/// `FCE_ABI_VERSION` of the header these bindings were generated from.
pub const HEADER_ABI_VERSION: u32 = sys::FCE_ABI_VERSION;

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
