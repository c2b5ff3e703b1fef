//! The C structs handed to the library, filled first by its `fce_*_init` functions.
//!
//! A struct is this header's, filled with `struct_size` = its `size_of` (what the header asks of FFI
//! callers): the fields the library knows get its defaults. A newer library gives the fields these
//! bindings lack their defaults itself; an older one zeroes the fields it does not know, and refuses a
//! non-zero value set there (`INVALID_ARGUMENT`) instead of ignoring it.
use std::mem::{align_of, size_of, MaybeUninit};

use crate::error::check;
use crate::sys;

const MAX: usize = sys::FCE_MAX_STRUCT_SIZE as usize;

/// A header struct that starts with `uint32_t struct_size` and has an `fce_*_init` function.
///
/// # Safety
/// `init` must be the struct's own `fce_*_init`, and the struct plain data (any bit pattern valid).
pub(crate) unsafe trait CStruct: Copy {
    /// The C name, for messages.
    const NAME: &'static str;
    /// Calls the library's `fce_*_init` on `p`, `size` bytes.
    unsafe fn init(p: *mut Self, size: usize) -> sys::fce_status_t;
}

macro_rules! c_structs {
    ($($t:ident => $init:ident),* $(,)?) => {$(
        unsafe impl CStruct for sys::$t {
            const NAME: &'static str = stringify!($t);
            unsafe fn init(p: *mut Self, size: usize) -> sys::fce_status_t {
                sys::$init(p, size)
            }
        }
    )*};
}

c_structs!(
    fce_ce_options_t => fce_ce_options_init,
    fce_ce_outputs_t => fce_ce_outputs_init,
    fce_ce_bwd_inputs_t => fce_ce_bwd_inputs_init,
    fce_lse_options_t => fce_lse_options_init,
    fce_softmax_options_t => fce_softmax_options_init,
    fce_kd_options_t => fce_kd_options_init,
    fce_kd_teacher_t => fce_kd_teacher_init,
    fce_kd_outputs_t => fce_kd_outputs_init,
    fce_linear_ce_outputs_t => fce_linear_ce_outputs_init,
);

/// `T` with room for the loaded library's (possibly larger) version of it: for `fce_build_info`, which
/// fills the `struct_size` bytes the caller sets.
#[repr(C)]
pub(crate) union Room<T: Copy> {
    value: T,
    bytes: [u8; MAX],
}

impl<T: Copy> Room<T> {
    /// FCE_MAX_STRUCT_SIZE zero bytes.
    pub(crate) fn zeroed() -> Self {
        assert!(size_of::<T>() <= MAX && align_of::<T>() <= 8);
        Room { bytes: [0u8; MAX] }
    }
    pub(crate) fn as_mut_ptr(&mut self) -> *mut T {
        self as *mut Room<T> as *mut T
    }
    pub(crate) fn as_ptr(&self) -> *const T {
        self as *const Room<T> as *const T
    }
    pub(crate) fn set_struct_size(&mut self, size: u32) {
        // SAFETY: the struct starts with uint32_t struct_size; u32 alignment holds (the union is aligned
        // at least for T and u32).
        unsafe { *(self.as_mut_ptr() as *mut u32) = size }
    }
    /// The fields this header knows.
    pub(crate) fn get(&self) -> &T {
        // SAFETY: T is plain data (build info), so zero or library-written bytes are a valid T.
        unsafe { &*self.as_ptr() }
    }
}

/// A struct holding the loaded library's defaults (its `fce_*_init`), `struct_size` = `size_of::<T>()`.
/// Set its fields and pass `&value` (a `*const T`).
pub(crate) fn init<T: CStruct>() -> T {
    let mut v = MaybeUninit::<T>::zeroed();
    // SAFETY: size_of::<T>() writable bytes aligned for T, at least the struct's first published size.
    let st = unsafe { T::init(v.as_mut_ptr(), size_of::<T>()) };
    // Only a NULL pointer or a struct_size out of range makes an init function fail.
    if let Err(e) = check(st) {
        panic!("fusedce: the init function of {} failed: {}", T::NAME, e);
    }
    // SAFETY: zeroed, then written by the library; T is plain data (CStruct's contract).
    unsafe { v.assume_init() }
}
