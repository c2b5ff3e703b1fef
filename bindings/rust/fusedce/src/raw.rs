//! The C structs handed to the library, filled first by its `fce_*_init` functions.
//!
//! A struct is built in [`FCE_MAX_STRUCT_SIZE`](sys::FCE_MAX_STRUCT_SIZE) zeroed bytes: a newer library
//! may have grown it past the header these bindings were generated from, and its init function writes
//! all of its own struct (its defaults for the fields these bindings do not know). `struct_size` is
//! then the larger of the library's size and ours: with an older library, a field it does not know
//! stays zero, and a non-zero value set there is refused (`INVALID_ARGUMENT`) instead of being ignored.
use std::mem::{align_of, size_of};

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
    /// Calls the library's `fce_*_init` on `p`.
    unsafe fn init(p: *mut Self) -> sys::fce_status_t;
}

macro_rules! c_structs {
    ($($t:ident => $init:ident),* $(,)?) => {$(
        unsafe impl CStruct for sys::$t {
            const NAME: &'static str = stringify!($t);
            unsafe fn init(p: *mut Self) -> sys::fce_status_t {
                sys::$init(p)
            }
        }
    )*};
}

c_structs!(
    fce_ce_options_t => fce_ce_options_init,
    fce_ce_outputs_t => fce_ce_outputs_init,
    fce_lse_options_t => fce_lse_options_init,
    fce_softmax_options_t => fce_softmax_options_init,
    fce_kd_options_t => fce_kd_options_init,
    fce_kd_teacher_t => fce_kd_teacher_init,
    fce_kd_outputs_t => fce_kd_outputs_init,
    fce_linear_ce_outputs_t => fce_linear_ce_outputs_init,
);

/// `T` with room for the loaded library's (possibly larger) version of it.
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
    /// The `uint32_t struct_size` every such struct starts with.
    pub(crate) fn struct_size(&self) -> u32 {
        // SAFETY: the first 4 bytes are always initialized (zeroed, then maybe written by the library).
        unsafe { *(self.as_ptr() as *const u32) }
    }
    pub(crate) fn set_struct_size(&mut self, size: u32) {
        // SAFETY: as in struct_size; u32 alignment holds (the union is aligned at least for T and u32).
        unsafe { *(self.as_mut_ptr() as *mut u32) = size }
    }
    /// The fields this header knows.
    pub(crate) fn get(&self) -> &T {
        // SAFETY: T is plain data (CStruct's contract or build info), so zero or library-written bytes are a valid T.
        unsafe { &*self.as_ptr() }
    }
    /// The fields this header knows, to set them.
    pub(crate) fn get_mut(&mut self) -> &mut T {
        // SAFETY: as in get.
        unsafe { &mut *self.as_mut_ptr() }
    }
}

/// A struct holding the loaded library's defaults (its `fce_*_init`), `struct_size` set as the module
/// documentation says. Set the fields with [`Room::get_mut`] and pass [`Room::as_ptr`].
pub(crate) fn init<T: CStruct>() -> Room<T> {
    let mut room = Room::<T>::zeroed();
    // SAFETY: MAX writable bytes aligned for T; the library's struct is at most FCE_MAX_STRUCT_SIZE bytes.
    let st = unsafe { T::init(room.as_mut_ptr()) };
    // Only a NULL pointer makes an init function fail.
    if let Err(e) = check(st) {
        panic!("fusedce: the init function of {} failed: {}", T::NAME, e);
    }
    let lib = room.struct_size() as usize;
    assert!(lib <= MAX, "fusedce: the init function of {} set struct_size {}", T::NAME, lib);
    room.set_struct_size(lib.max(size_of::<T>()) as u32);
    room
}
