//! Version functions, the handle, and errors: each bad input returns the right status and a message.
use std::ffi::{c_void, CStr};

use fusedce::{
    CeOptions, CeOutputs, DType, Device, Error, Handle, KdOptions, KdOutputs, LinearCeGrads, LseOptions, Reduction,
    SoftmaxOptions, Status, Teacher, TensorMut, TensorRef,
};

fn cpu() -> Handle {
    Handle::cpu().expect("CPU handle")
}

fn expect_err(r: fusedce::Result<()>, status: Status, needle: &str) -> Error {
    let e = r.expect_err("the call should fail");
    assert_eq!(e.status(), status, "{}", e);
    assert!(!e.message().is_empty(), "empty message for {:?}", e.status());
    assert!(e.message().contains(needle), "message {:?} should mention {:?}", e.message(), needle);
    assert!(e.to_string().contains(e.status().description()));
    e
}

#[test]
fn version_matches_the_header() {
    assert_eq!(fusedce::version_number(), fusedce::HEADER_VERSION_NUMBER);
    assert_eq!(fusedce::abi_version(), fusedce::HEADER_ABI_VERSION);
    let s = fusedce::version_string();
    let parts: Vec<u32> = s.split('.').map(|p| p.parse().expect("numeric version part")).collect();
    assert_eq!(parts.len(), 3, "{:?}", s);
    assert_eq!(parts[0] * 10000 + parts[1] * 100 + parts[2], fusedce::version_number());
    assert_eq!(
        (parts[0], parts[1], parts[2]),
        (fusedce::sys::FCE_VERSION_MAJOR, fusedce::sys::FCE_VERSION_MINOR, fusedce::sys::FCE_VERSION_PATCH)
    );
    fusedce::check_version().expect("loaded library matches the bindings");
}

#[test]
fn status_strings() {
    assert_eq!(Status::SUCCESS.description(), "success");
    assert_eq!(Status::SHAPE_MISMATCH.name(), Some("FCE_STATUS_SHAPE_MISMATCH"));
    for code in 1..=14 {
        assert!(!Status(code).description().is_empty());
        assert_ne!(Status(code).description(), "unknown status", "code {}", code);
    }
    // A code from a newer library is a value, not undefined behaviour.
    assert_eq!(Status(1000).description(), "unknown status");
    assert_eq!(format!("{:?}", Status(1000)), "Status(1000)");
}

#[test]
fn handle_device_send_and_cuda_absence() {
    fn assert_send<T: Send>() {}
    assert_send::<Handle>();
    let h = cpu();
    assert_eq!(h.device().unwrap(), Device::Cpu);
    // Moved to another thread and used there.
    let lse = std::thread::spawn(move || {
        let x = [0f32, 0.0];
        let mut lse = [0f32; 1];
        h.logsumexp(&TensorRef::matrix(&x, 1, 2).unwrap(), &LseOptions::default(), &mut TensorMut::vector(&mut lse))
            .unwrap();
        lse[0]
    })
    .join()
    .unwrap();
    assert!((lse - std::f32::consts::LN_2).abs() < 1e-6);
    match Handle::cuda(0) {
        // This machine may have a GPU after all.
        Ok(h) => assert_eq!(h.device().unwrap(), Device::Cuda(0)),
        Err(e) => {
            assert_eq!(e.status(), Status::NO_DEVICE, "{}", e);
            assert!(!e.message().is_empty());
        }
    }
    let e = Handle::new(Device::CudaHost).unwrap_err();
    assert_eq!(e.status(), Status::INVALID_ARGUMENT);
    assert!(!e.message().is_empty());
    let e = Handle::cuda(-1).unwrap_err();
    assert_eq!(e.status(), Status::INVALID_ARGUMENT);
}

#[test]
fn bad_inputs_return_the_right_status_and_a_message() {
    let h = cpu();
    let (n, v) = (3, 4);
    let x = [0.5f32; 12];
    let t = [0i64, 1, 2];
    let xm = TensorRef::matrix(&x, n, v).unwrap();
    let mut loss = 0f32;

    // SHAPE_MISMATCH: targets of length 2 for N = 3.
    expect_err(
        h.cross_entropy_fwd(
            &xm,
            &TensorRef::vector(&t[..2]),
            &CeOptions::default(),
            &mut CeOutputs::new(TensorMut::scalar(&mut loss)),
        ),
        Status::SHAPE_MISMATCH,
        "targets",
    );
    // INVALID_ARGUMENT: option out of its domain.
    expect_err(
        h.cross_entropy_fwd(
            &xm,
            &TensorRef::vector(&t),
            &CeOptions::new().label_smoothing(1.5),
            &mut CeOutputs::new(TensorMut::scalar(&mut loss)),
        ),
        Status::INVALID_ARGUMENT,
        "label_smoothing",
    );
    // UNSUPPORTED_DTYPE: float targets.
    let tf = [0f32, 1.0, 2.0];
    expect_err(
        h.cross_entropy_fwd(
            &xm,
            &TensorRef::vector(&tf),
            &CeOptions::default(),
            &mut CeOutputs::new(TensorMut::scalar(&mut loss)),
        ),
        Status::UNSUPPORTED_DTYPE,
        "targets",
    );
    // SHAPE_MISMATCH: a reduced loss must be a scalar, not [N].
    let mut rows = [0f32; 3];
    expect_err(
        h.cross_entropy_fwd(
            &xm,
            &TensorRef::vector(&t),
            &CeOptions::default(),
            &mut CeOutputs::new(TensorMut::vector(&mut rows)),
        ),
        Status::SHAPE_MISMATCH,
        "loss",
    );
    // Nothing was written by the failed calls.
    assert_eq!(loss, 0.0);
    assert_eq!(rows, [0.0; 3]);

    // INVALID_ARGUMENT: temperature 0 for distillation; a softmax with no output.
    expect_err(
        h.kd_loss(
            &xm,
            &Teacher::Logits(xm),
            None,
            &KdOptions::new().temperature(0.0),
            &mut KdOutputs::new(TensorMut::scalar(&mut loss)),
        ),
        Status::INVALID_ARGUMENT,
        "temperature",
    );
    expect_err(h.temp_softmax(&xm, &SoftmaxOptions::default(), None, None), Status::INVALID_ARGUMENT, "NULL");
    // INVALID_ARGUMENT: a linear cross-entropy backward with no gradient requested.
    let lse = [0f32; 3];
    expect_err(
        h.linear_cross_entropy_bwd(
            &xm,
            &xm,
            None,
            &TensorRef::vector(&t),
            &TensorRef::vector(&lse),
            &CeOptions::default(),
            &mut LinearCeGrads::new(),
        ),
        Status::INVALID_ARGUMENT,
        "dhidden",
    );

    // UNSUPPORTED_LAYOUT: column-major strides (same memory, so a raw view is sound).
    let cm = unsafe {
        TensorRef::from_raw_parts(x.as_ptr() as *const c_void, DType::F32, Device::Cpu, &[3, 4], Some(&[1, 3]), 0)
            .unwrap()
    };
    let mut lse3 = [0f32; 3];
    expect_err(
        h.logsumexp(&cm, &LseOptions::default(), &mut TensorMut::vector(&mut lse3)),
        Status::UNSUPPORTED_LAYOUT,
        "stride",
    );

    // DEVICE_MISMATCH: a tensor that claims to live on a GPU, given to a CPU handle.
    let dev = unsafe {
        TensorRef::from_raw_parts(x.as_ptr() as *const c_void, DType::F32, Device::Cuda(0), &[3, 4], None, 0).unwrap()
    };
    expect_err(
        h.logsumexp(&dev, &LseOptions::default(), &mut TensorMut::vector(&mut lse3)),
        Status::DEVICE_MISMATCH,
        "device",
    );

    // ALIASING: probabilities and log-probabilities in the same memory (only possible with unsafe).
    let mut out = [0f32; 12];
    let p = out.as_mut_ptr() as *mut c_void;
    let mut a = unsafe { TensorMut::from_raw_parts(p, DType::F32, Device::Cpu, &[3, 4], None, 0).unwrap() };
    let mut b = unsafe { TensorMut::from_raw_parts(p, DType::F32, Device::Cpu, &[3, 4], None, 0).unwrap() };
    expect_err(
        h.temp_softmax(&xm, &SoftmaxOptions::default(), Some(&mut a), Some(&mut b)),
        Status::ALIASING,
        "overlaps",
    );

    // A success clears the thread's message.
    h.logsumexp(&xm, &LseOptions::default(), &mut TensorMut::vector(&mut lse3)).unwrap();
    let msg = unsafe { CStr::from_ptr(fusedce::sys::fce_last_error_message()) };
    assert_eq!(msg.to_bytes(), b"");
}

#[test]
fn views_that_do_not_fit_their_slice_are_refused() {
    let x = [0f32; 11];
    let e = TensorRef::matrix(&x, 3, 4).unwrap_err();
    assert_eq!(e.status(), Status::SHAPE_MISMATCH);
    assert!(e.message().contains("11"), "{}", e);
    let e = TensorRef::new(&x, &[1, 1, 11]).unwrap_err();
    assert_eq!(e.status(), Status::SHAPE_MISMATCH);
    let e = TensorRef::strided(&x, 3, 4, 5).unwrap_err(); // needs 2*5+4 = 14 elements
    assert_eq!(e.status(), Status::SHAPE_MISMATCH);
    assert!(TensorRef::strided(&x, 2, 4, 7).is_ok()); // needs 7+4 = 11
    let e = TensorRef::strided(&x, 2, 4, 3).unwrap_err();
    assert_eq!(e.status(), Status::UNSUPPORTED_LAYOUT);
    let b = [0u16; 4];
    let e = TensorRef::from_bits(&b, DType::F32, &[4]).unwrap_err();
    assert_eq!(e.status(), Status::UNSUPPORTED_DTYPE);
    let t = TensorRef::from_bits(&b, DType::BF16, &[2, 2]).unwrap();
    assert_eq!((t.shape(), t.dtype(), t.device()), (&[2i64, 2][..], DType::BF16, Device::Cpu));
    let s = 1f32;
    assert_eq!(TensorRef::scalar(&s).shape(), &[] as &[i64]);
}

#[test]
fn option_defaults_mirror_the_init_macros() {
    // FCE_CE_OPTIONS_INIT: MEAN, -100, 0, 0, 0, 1, NULL.
    let o = CeOptions::default();
    assert_eq!(
        (
            o.reduction,
            o.ignore_index,
            o.label_smoothing,
            o.z_loss_scale,
            o.softcap,
            o.logit_scale,
            o.class_weights.is_none()
        ),
        (Reduction::Mean, -100, 0.0, 0.0, 0.0, 1.0, true)
    );
    assert_eq!(Reduction::Mean.to_raw(), fusedce::sys::FCE_REDUCTION_MEAN as i32);
    // FCE_KD_OPTIONS_INIT: FORWARD_KL, 0.5, 1, 0, FULL_VOCAB, MEAN, -100.
    let k = KdOptions::default();
    assert_eq!(
        (
            k.divergence.to_raw(),
            k.beta,
            k.temperature,
            k.scale_by_t2,
            k.topk_norm.to_raw(),
            k.reduction,
            k.ignore_index
        ),
        (
            fusedce::sys::FCE_KD_FORWARD_KL as i32,
            0.5,
            1.0,
            false,
            fusedce::sys::FCE_KD_TOPK_FULL_VOCAB as i32,
            Reduction::Mean,
            -100
        )
    );
    assert_eq!(LseOptions::default().scale, 1.0);
    let s = SoftmaxOptions::default();
    assert_eq!((s.temperature, s.temperatures.is_none()), (1.0, true));
}
