//! NCCL mode's safe API without a GPU or NCCL: `Comm::new` refuses a null communicator and a CPU handle
//! with the library's status and message, before touching the communicator. The NCCL-mode calls
//! themselves need a `Comm`, so only a CUDA machine with NCCL runs them (the C library's two-GPU suite,
//! `tests/multi`).
use std::ffi::c_void;
use std::ptr;

use fusedce::{Comm, Handle, Status};

#[test]
fn a_null_communicator_is_refused() {
    let h = Handle::cpu().expect("CPU handle");
    // SAFETY: a null communicator is allowed (and refused).
    let e = unsafe { Comm::new(&h, ptr::null_mut()) }.expect_err("a null communicator must be refused");
    assert_eq!(e.status(), Status::INVALID_ARGUMENT, "{}", e);
    assert!(e.message().contains("nccl_comm is NULL"), "message: {:?}", e.message());
}

#[test]
fn a_cpu_handle_is_refused_before_the_communicator_is_read() {
    let h = Handle::cpu().expect("CPU handle");
    // Not an NCCL communicator: the library must refuse the CPU handle without reading it.
    let mut not_a_comm = [0u64; 4];
    // SAFETY: the pointer addresses readable memory; the library refuses a CPU handle before using it.
    let e =
        unsafe { Comm::new(&h, not_a_comm.as_mut_ptr().cast::<c_void>()) }.expect_err("a CPU handle must be refused");
    assert_eq!(e.status(), Status::INVALID_ARGUMENT, "{}", e);
    assert!(e.message().contains("CUDA handle"), "message: {:?}", e.message());
    assert_eq!(not_a_comm, [0u64; 4]);
}
