//! Status codes and the error type.
use std::ffi::CStr;
use std::fmt;

use crate::sys;

/// A libfusedce status code (`fce_status_t`).
///
/// A newtype over the raw `u32`, never a Rust `enum`: a code appended by a newer library than the one
/// these bindings were generated from is still a valid value (its [`Status::description`] is then
/// "unknown status"). Values are pinned by the C header; 0 is success.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Status(pub u32);

impl Status {
    /// 0: the call succeeded.
    pub const SUCCESS: Status = Status(sys::fce_status::FCE_STATUS_SUCCESS.0);
    /// 1: a required pointer is NULL, or an option value is out of its documented domain.
    pub const INVALID_ARGUMENT: Status = Status(sys::fce_status::FCE_STATUS_INVALID_ARGUMENT.0);
    /// 2: tensor ranks or extents disagree with each other or with the op (including zero extents).
    pub const SHAPE_MISMATCH: Status = Status(sys::fce_status::FCE_STATUS_SHAPE_MISMATCH.0);
    /// 3: a tensor's dtype is not one the op accepts for that argument.
    pub const UNSUPPORTED_DTYPE: Status = Status(sys::fce_status::FCE_STATUS_UNSUPPORTED_DTYPE.0);
    /// 4: strides the op cannot address (last axis must have unit stride, row stride >= row length).
    pub const UNSUPPORTED_LAYOUT: Status = Status(sys::fce_status::FCE_STATUS_UNSUPPORTED_LAYOUT.0);
    /// 5: a tensor lives on another device than the handle.
    pub const DEVICE_MISMATCH: Status = Status(sys::fce_status::FCE_STATUS_DEVICE_MISMATCH.0);
    /// 6: two tensors overlap in memory where the op does not allow aliasing.
    pub const ALIASING: Status = Status(sys::fce_status::FCE_STATUS_ALIASING.0);
    /// 7: a size or byte count overflows 64-bit arithmetic.
    pub const OVERFLOW: Status = Status(sys::fce_status::FCE_STATUS_OVERFLOW.0);
    /// 8: the caller's workspace is smaller than the op's workspace-size query.
    pub const WORKSPACE_TOO_SMALL: Status = Status(sys::fce_status::FCE_STATUS_WORKSPACE_TOO_SMALL.0);
    /// 9: no usable CUDA device (no driver, stub driver, no GPU, or a build without CUDA).
    pub const NO_DEVICE: Status = Status(sys::fce_status::FCE_STATUS_NO_DEVICE.0);
    /// 10: the op exists in the contract but this backend does not implement it yet.
    pub const NOT_IMPLEMENTED: Status = Status(sys::fce_status::FCE_STATUS_NOT_IMPLEMENTED.0);
    /// 11: host or device memory could not be allocated.
    pub const OUT_OF_MEMORY: Status = Status(sys::fce_status::FCE_STATUS_OUT_OF_MEMORY.0);
    /// 12: a CUDA runtime call failed.
    pub const CUDA_ERROR: Status = Status(sys::fce_status::FCE_STATUS_CUDA_ERROR.0);
    /// 13: a cuBLAS or BLAS call failed.
    pub const BLAS_ERROR: Status = Status(sys::fce_status::FCE_STATUS_BLAS_ERROR.0);
    /// 14: a bug in the library.
    pub const INTERNAL_ERROR: Status = Status(sys::fce_status::FCE_STATUS_INTERNAL_ERROR.0);
    /// 15: NCCL cannot be loaded, or an NCCL call failed (NCCL mode).
    pub const COMMUNICATOR_ERROR: Status = Status(sys::fce_status::FCE_STATUS_COMMUNICATOR_ERROR.0);
    /// 16: the handle is inside another thread's call (a handle takes one thread at a time); nothing was
    /// done.
    pub const HANDLE_BUSY: Status = Status(sys::fce_status::FCE_STATUS_HANDLE_BUSY.0);

    /// Wraps a raw status returned by a `fusedce_sys` call.
    pub fn from_raw(raw: sys::fce_status_t) -> Status {
        Status(raw.0)
    }

    /// The raw value for `fusedce_sys` calls.
    pub fn to_raw(self) -> sys::fce_status_t {
        sys::fce_status(self.0)
    }

    /// True for [`Status::SUCCESS`].
    pub fn is_success(self) -> bool {
        self == Status::SUCCESS
    }

    /// The library's short static description (`fce_status_string`), e.g. "shape mismatch";
    /// "unknown status" for a code the loaded library does not know.
    pub fn description(self) -> &'static str {
        // SAFETY: fce_status_string accepts any value and returns static storage, never NULL.
        let p = unsafe { sys::fce_status_string(self.to_raw()) };
        if p.is_null() {
            return "unknown status";
        }
        unsafe { CStr::from_ptr(p) }.to_str().unwrap_or("unknown status")
    }

    /// The C name of a known code (`"FCE_STATUS_SHAPE_MISMATCH"`), None for others.
    pub fn name(self) -> Option<&'static str> {
        const NAMES: [&str; 17] = [
            "FCE_STATUS_SUCCESS",
            "FCE_STATUS_INVALID_ARGUMENT",
            "FCE_STATUS_SHAPE_MISMATCH",
            "FCE_STATUS_UNSUPPORTED_DTYPE",
            "FCE_STATUS_UNSUPPORTED_LAYOUT",
            "FCE_STATUS_DEVICE_MISMATCH",
            "FCE_STATUS_ALIASING",
            "FCE_STATUS_OVERFLOW",
            "FCE_STATUS_WORKSPACE_TOO_SMALL",
            "FCE_STATUS_NO_DEVICE",
            "FCE_STATUS_NOT_IMPLEMENTED",
            "FCE_STATUS_OUT_OF_MEMORY",
            "FCE_STATUS_CUDA_ERROR",
            "FCE_STATUS_BLAS_ERROR",
            "FCE_STATUS_INTERNAL_ERROR",
            "FCE_STATUS_COMMUNICATOR_ERROR",
            "FCE_STATUS_HANDLE_BUSY",
        ];
        NAMES.get(self.0 as usize).copied()
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => write!(f, "{}({})", n, self.0),
            None => write!(f, "Status({})", self.0),
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.description())
    }
}

/// A failed call: the status and the detail message.
///
/// For errors reported by the library the message is `fce_last_error_message()` read right after the
/// failing call on the same thread (it names the offending argument, e.g. "targets has length 3;
/// expected N = 4"). Errors detected by these bindings before calling the library (a slice shorter
/// than the shape it is viewed as, more than 3 dimensions, ...) use the same statuses and say so in
/// their message.
#[derive(Clone, PartialEq, Eq)]
pub struct Error {
    status: Status,
    message: String,
}

/// `std::result::Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An error with a status and a message of your own.
    pub fn new(status: Status, message: impl Into<String>) -> Error {
        Error { status, message: message.into() }
    }

    /// The status code (never [`Status::SUCCESS`] for errors made by this crate).
    pub fn status(&self) -> Status {
        self.status
    }

    /// The detail message (the library's per-thread message, or the bindings' own). May be empty
    /// only if the library gave none.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Reads `fce_last_error_message()` for a failure just returned on this thread.
    pub(crate) fn from_library(status: Status) -> Error {
        // SAFETY: never NULL; valid until the next libfusedce call on this thread, and copied now.
        let p = unsafe { sys::fce_last_error_message() };
        let message =
            if p.is_null() { String::new() } else { unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned() };
        Error { status, message }
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Error").field("status", &self.status).field("message", &self.message).finish()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.message.is_empty() {
            write!(f, "libfusedce: {}", self.status.description())
        } else {
            write!(f, "libfusedce: {}: {}", self.status.description(), self.message)
        }
    }
}

impl std::error::Error for Error {}

/// Turns a raw status into a `Result`, reading the thread's message on failure.
pub(crate) fn check(raw: sys::fce_status_t) -> Result<()> {
    let s = Status::from_raw(raw);
    if s.is_success() {
        Ok(())
    } else {
        Err(Error::from_library(s))
    }
}

/// The loaded library is not the one these bindings were built against (see [`crate::check_version`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct VersionMismatch {
    /// `FCE_VERSION_NUMBER` of the header the bindings were generated from (MAJOR*10000+MINOR*100+PATCH).
    pub header_version: u32,
    /// `fce_version_number()` of the loaded library.
    pub library_version: u32,
    /// `FCE_ABI_VERSION` of the header.
    pub header_abi: u32,
    /// `fce_abi_version()` of the loaded library.
    pub library_abi: u32,
}

impl fmt::Display for VersionMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "libfusedce version {} (ABI {}) is loaded, but these bindings need version >= {} with ABI {}",
            self.library_version, self.library_abi, self.header_version, self.header_abi
        )
    }
}

impl std::error::Error for VersionMismatch {}
