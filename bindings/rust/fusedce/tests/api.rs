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

    // INVALID_ARGUMENT: a distillation temperature outside [KD_TEMPERATURE_MIN, KD_TEMPERATURE_MAX]
    // (0, below the minimum, above the maximum); a softmax with no output.
    for bad in [0.0, fusedce::KD_TEMPERATURE_MIN / 2.0, fusedce::KD_TEMPERATURE_MAX * 1.01] {
        expect_err(
            h.kd_loss(
                &xm,
                &Teacher::Logits(xm),
                None,
                &KdOptions::new().temperature(bad),
                &mut KdOutputs::new(TensorMut::scalar(&mut loss)),
            ),
            Status::INVALID_ARGUMENT,
            "temperature",
        );
    }
    assert_eq!(loss, 0.0);
    // Both ends of the domain are accepted.
    for good in [fusedce::KD_TEMPERATURE_MIN, 1e-4, fusedce::KD_TEMPERATURE_MAX] {
        h.kd_loss(
            &xm,
            &Teacher::Logits(xm),
            None,
            &KdOptions::new().temperature(good),
            &mut KdOutputs::new(TensorMut::scalar(&mut loss)),
        )
        .unwrap_or_else(|e| panic!("temperature {}: {}", good, e));
        assert!(loss.is_finite());
    }
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
fn vocab_parallel_bad_inputs() {
    let h = cpu();
    let k = fusedce::cross_entropy_record_fields(&CeOptions::default()).unwrap();
    assert_eq!(k, 9);
    assert_eq!(k, fusedce::sys::FCE_CE_RECORD_FIELDS_ALL as usize);
    let (n, v) = (2, 3);
    let x = [0.5f32; 6];
    let t = [0i64, 4];
    let xm = TensorRef::matrix(&x, n, v).unwrap();
    let shard = CeOptions::new().vocab_start(3).vocab_total(6);
    assert_eq!(fusedce::cross_entropy_record_fields(&shard).unwrap(), k);
    let mut rec = vec![-1f32; n * k];
    let mut loss = 0f32;

    // The unsharded forward refuses a shard.
    expect_err(
        h.cross_entropy_fwd(&xm, &TensorRef::vector(&t), &shard, &mut CeOutputs::new(TensorMut::scalar(&mut loss))),
        Status::INVALID_ARGUMENT,
        "vocab_total",
    );
    // The partial call needs one ...
    expect_err(
        h.cross_entropy_partial(
            &xm,
            &TensorRef::vector(&t),
            &CeOptions::default(),
            &mut TensorMut::matrix(&mut rec, n, k).unwrap(),
        ),
        Status::INVALID_ARGUMENT,
        "vocab_total",
    );
    // ... with vocab_start inside [0, vocab_total] (vocab_total itself: a shard of padding alone),
    expect_err(
        h.cross_entropy_partial(
            &xm,
            &TensorRef::vector(&t),
            &CeOptions::new().vocab_start(7).vocab_total(6),
            &mut TensorMut::matrix(&mut rec, n, k).unwrap(),
        ),
        Status::INVALID_ARGUMENT,
        "vocab_start",
    );
    // ... and records [N, K].
    expect_err(
        h.cross_entropy_partial(
            &xm,
            &TensorRef::vector(&t),
            &shard,
            &mut TensorMut::matrix(&mut rec[..n * (k - 1)], n, k - 1).unwrap(),
        ),
        Status::SHAPE_MISMATCH,
        "records",
    );
    assert!(rec.iter().all(|&r| r == -1.0), "a failed call wrote records");
    h.cross_entropy_partial(&xm, &TensorRef::vector(&t), &shard, &mut TensorMut::matrix(&mut rec, n, k).unwrap())
        .unwrap();

    // The combine takes [W, N, K] records, 3-D ...
    expect_err(
        h.cross_entropy_combine(
            &TensorRef::matrix(&rec, n, k).unwrap(),
            &TensorRef::vector(&t),
            &shard,
            &mut CeOutputs::new(TensorMut::scalar(&mut loss)),
        ),
        Status::SHAPE_MISMATCH,
        "3-D",
    );
    let rec3 = TensorRef::new(&rec, &[1, n, k]).unwrap();
    // ... needs vocab_total ...
    expect_err(
        h.cross_entropy_combine(
            &rec3,
            &TensorRef::vector(&t),
            &CeOptions::default(),
            &mut CeOutputs::new(TensorMut::scalar(&mut loss)),
        ),
        Status::INVALID_ARGUMENT,
        "vocab_total",
    );
    // ... and writes no gradient.
    let mut dx = [0f32; 6];
    expect_err(
        h.cross_entropy_combine(
            &rec3,
            &TensorRef::vector(&t),
            &shard,
            &mut CeOutputs::new(TensorMut::scalar(&mut loss)).dlogits(TensorMut::matrix(&mut dx, n, v).unwrap()),
        ),
        Status::INVALID_ARGUMENT,
        "dlogits",
    );
    assert_eq!(loss, 0.0);
    let ws = h
        .cross_entropy_combine_workspace_size(
            &rec3,
            &TensorRef::vector(&t),
            &shard,
            &mut CeOutputs::new(TensorMut::scalar(&mut loss)),
        )
        .unwrap();
    assert_eq!(ws, 0, "a CPU handle needs no workspace");
}

#[test]
fn views_that_do_not_fit_their_slice_are_refused() {
    let x = [0f32; 11];
    let e = TensorRef::matrix(&x, 3, 4).unwrap_err();
    assert_eq!(e.status(), Status::SHAPE_MISMATCH);
    assert!(e.message().contains("11"), "{}", e);
    let e = TensorRef::new(&x, &[1, 1, 1, 11]).unwrap_err(); // at most 3 dimensions
    assert_eq!(e.status(), Status::SHAPE_MISMATCH);
    let e = TensorRef::new(&x, &[2, 1, 5]).unwrap_err(); // 10 elements, not 11
    assert_eq!(e.status(), Status::SHAPE_MISMATCH);
    let x12 = [0f32; 12];
    let t3 = TensorRef::new(&x12, &[2, 3, 2]).unwrap(); // 3-D, contiguous (vocabulary-parallel records)
    assert_eq!(t3.shape(), &[2i64, 3, 2][..]);
    let d = t3.as_dl();
    assert_eq!((d.ndim, d.strides.is_null()), (3, true));
    assert_eq!(unsafe { std::slice::from_raw_parts(d.shape, 3) }, &[2i64, 3, 2][..]);
    let e = unsafe {
        TensorRef::from_raw_parts(x12.as_ptr() as *const c_void, DType::F32, Device::Cpu, &[1, 1, 1, 12], None, 0)
    }
    .unwrap_err();
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
fn option_defaults_come_from_the_init_functions() {
    // The library's fce_*_init functions give the header's *_INIT values.
    // FCE_CE_OPTIONS_INIT: MEAN, -100, 0, 0, 0, 1, NULL, 0, 0.
    let o = CeOptions::default();
    assert_eq!(
        (
            o.reduction,
            o.ignore_index,
            o.label_smoothing,
            o.z_loss_scale,
            o.softcap,
            o.logit_scale,
            o.class_weights.is_none(),
            o.vocab_start,
            o.vocab_total
        ),
        (Reduction::Mean, -100, 0.0, 0.0, 0.0, 1.0, true, 0, 0)
    );
    assert_eq!(Reduction::Mean.to_raw(), fusedce::sys::FCE_REDUCTION_MEAN as i32);
    // FCE_KD_OPTIONS_INIT: FORWARD_KL, 0.5, 1, 0, FULL_VOCAB, MEAN, -100, 0, 0.
    let k = KdOptions::default();
    assert_eq!(
        (
            k.divergence.to_raw(),
            k.beta,
            k.temperature,
            k.scale_by_t2,
            k.topk_norm.to_raw(),
            k.reduction,
            k.ignore_index,
            k.vocab_start,
            k.vocab_total
        ),
        (
            fusedce::sys::FCE_KD_FORWARD_KL as i32,
            0.5,
            1.0,
            false,
            fusedce::sys::FCE_KD_TOPK_FULL_VOCAB as i32,
            Reduction::Mean,
            -100,
            0,
            0
        )
    );
    let l = LseOptions::default();
    assert_eq!((l.scale, l.vocab_start, l.vocab_total), (1.0, 0, 0));
    let s = SoftmaxOptions::default();
    assert_eq!(
        (s.temperature, s.temperatures.is_none(), s.vocab_start, s.vocab_total, s.lse.is_none()),
        (1.0, true, 0, 0, true)
    );
}

#[test]
fn raw_init_functions_match_the_header() {
    use fusedce::sys;
    use std::mem::MaybeUninit;
    // Each fce_*_init on this header's struct, struct_size = its size_of.
    macro_rules! size_of_init {
        ($t:ident, $f:ident) => {{
            let mut v = MaybeUninit::<sys::$t>::zeroed();
            let st = unsafe { sys::$f(v.as_mut_ptr(), std::mem::size_of::<sys::$t>()) };
            assert_eq!(st, sys::fce_status::FCE_STATUS_SUCCESS, stringify!($f));
            let v = unsafe { v.assume_init() };
            assert_eq!(v.struct_size as usize, std::mem::size_of::<sys::$t>(), stringify!($t));
            v
        }};
    }
    let ce = size_of_init!(fce_ce_options_t, fce_ce_options_init);
    assert!(ce.class_weights.is_null() && ce.logit_scale == 1.0 && ce.ignore_index == -100);
    let o = size_of_init!(fce_ce_outputs_t, fce_ce_outputs_init);
    assert!(o.loss.is_null() && o.dlogits.is_null() && o.grad_loss.is_null() && o.grad_entropy.is_null());
    // FCE_CE_BWD_INPUTS_INIT: every pointer NULL.
    let bi = size_of_init!(fce_ce_bwd_inputs_t, fce_ce_bwd_inputs_init);
    assert!(bi.lse.is_null() && bi.grad_loss.is_null() && bi.entropy.is_null() && bi.grad_entropy.is_null());
    let lo = size_of_init!(fce_lse_options_t, fce_lse_options_init);
    assert!(lo.scale == 1.0 && lo.vocab_start == 0 && lo.vocab_total == 0);
    let sm = size_of_init!(fce_softmax_options_t, fce_softmax_options_init);
    assert!(sm.temperature == 1.0 && sm.temperatures.is_null());
    assert!(sm.vocab_start == 0 && sm.vocab_total == 0 && sm.lse.is_null());
    let kd = size_of_init!(fce_kd_options_t, fce_kd_options_init);
    assert!(kd.beta == 0.5 && kd.temperature == 1.0 && kd.scale_by_t2 == 0);
    assert!(kd.vocab_start == 0 && kd.vocab_total == 0);
    let t = size_of_init!(fce_kd_teacher_t, fce_kd_teacher_init);
    assert!(t.logits.is_null() && t.topk_ids.is_null() && t.topk_logprobs.is_null());
    let ko = size_of_init!(fce_kd_outputs_t, fce_kd_outputs_init);
    assert!(ko.loss.is_null() && ko.dstudent.is_null());
    let lo = size_of_init!(fce_linear_ce_outputs_t, fce_linear_ce_outputs_init);
    assert!(lo.loss.is_null() && lo.dweight.is_null() && lo.flags == 0);
    assert!(lo.grad_entropy.is_null() && lo.saved_entropy.is_null());
    // NULL is refused.
    let n = std::mem::size_of::<sys::fce_ce_options_t>();
    let st = unsafe { sys::fce_ce_options_init(std::ptr::null_mut(), n) };
    assert_eq!(st, sys::fce_status::FCE_STATUS_INVALID_ARGUMENT);
    // A larger struct_size: the defaults, zeros past the library's struct, struct_size as given. One below
    // the struct's first published size (0.1.0's, up to class_weights) or above FCE_MAX_STRUCT_SIZE is
    // refused, and nothing is written.
    #[repr(C, align(8))]
    struct Buf([u8; 128]);
    let mut buf = Buf([0xab; 128]);
    let p = buf.0.as_mut_ptr() as *mut sys::fce_ce_options_t;
    let st = unsafe { sys::fce_ce_options_init(p, n + 16) };
    assert_eq!(st, sys::fce_status::FCE_STATUS_SUCCESS);
    let v = unsafe { p.read() };
    assert!(v.struct_size as usize == n + 16 && v.logit_scale == 1.0 && v.class_weights.is_null());
    assert!(buf.0[n..n + 16].iter().all(|&b| b == 0) && buf.0[n + 16..].iter().all(|&b| b == 0xab));
    buf.0 = [0xab; 128];
    let p = buf.0.as_mut_ptr() as *mut sys::fce_ce_options_t;
    // 0.1.0's fce_ce_options_t ended at class_weights; 0.2.0 added vocab_start and vocab_total.
    let first = {
        let u = MaybeUninit::<sys::fce_ce_options_t>::uninit();
        let base = u.as_ptr();
        unsafe { std::ptr::addr_of!((*base).vocab_start) as usize - base as usize }
    };
    assert_eq!(first, 40);
    for size in [first - 8, fusedce::MAX_STRUCT_SIZE + 1] {
        assert_eq!(unsafe { sys::fce_ce_options_init(p, size) }, sys::fce_status::FCE_STATUS_INVALID_ARGUMENT);
    }
    assert!(buf.0.iter().all(|&b| b == 0xab));
    // The first published size is accepted (a 0.1.0 caller): the fields it has, nothing past them.
    assert_eq!(unsafe { sys::fce_ce_options_init(p, first) }, sys::fce_status::FCE_STATUS_SUCCESS);
    assert!(buf.0[first..].iter().all(|&b| b == 0xab));
}

#[test]
fn build_info_is_consistent_with_the_version_functions() {
    let b = fusedce::build_info();
    assert_eq!(b.version_number, fusedce::version_number());
    assert_eq!(b.abi_version, fusedce::abi_version());
    assert_eq!(b.version_string, fusedce::version_string());
    assert_eq!(b.version_number, fusedce::HEADER_VERSION_NUMBER);
    // The raw field is 0 or 1.
    let mut raw: fusedce::sys::fce_build_info_t = unsafe { std::mem::zeroed() };
    raw.struct_size = std::mem::size_of::<fusedce::sys::fce_build_info_t>() as u32;
    assert_eq!(unsafe { fusedce::sys::fce_build_info(&mut raw) }, fusedce::sys::fce_status::FCE_STATUS_SUCCESS);
    assert!(raw.cuda_backend == 0 || raw.cuda_backend == 1, "{}", raw.cuda_backend);
    assert_eq!(raw.cuda_backend == 1, b.cuda_backend);
    if b.cuda_backend {
        assert!(b.cuda_runtime_version > 0 && b.cublas_version > 0, "{:?}", b);
        assert!(!b.cuda_architectures.is_empty());
        for a in b.cuda_architectures.split(' ') {
            assert!(a.starts_with("sm_") || a.starts_with("compute_"), "{:?}", b.cuda_architectures);
        }
    } else {
        assert_eq!((b.cuda_runtime_version, b.cublas_version, b.cuda_architectures.as_str()), (0, 0, ""));
    }
    let shown = b.to_string();
    assert!(shown.starts_with(&format!("libfusedce {} (ABI {})", b.version_string, b.abi_version)), "{}", shown);
    // A struct_size below the library's struct is refused, and nothing is written.
    let mut small: fusedce::sys::fce_build_info_t = unsafe { std::mem::zeroed() };
    small.struct_size = 8;
    let st = unsafe { fusedce::sys::fce_build_info(&mut small) };
    assert_eq!(st, fusedce::sys::fce_status::FCE_STATUS_INVALID_ARGUMENT);
    assert_eq!(small.version_number, 0);
}

#[test]
fn header_constants() {
    assert_eq!(fusedce::WORKSPACE_ALIGNMENT, 16);
    assert_eq!(fusedce::MAX_STRUCT_SIZE, 4096);
    assert_eq!(fusedce::KD_TEMPERATURE_MIN, 1e-4f32);
    assert_eq!(fusedce::KD_TEMPERATURE_MAX, 100.0f32);
}
