//! NCCL mode through the safe API, live (cargo feature `gpu-tests`, which links libcudart and libnccl;
//! without a GPU the test returns at once). One thread per rank over W = min(visible GPUs, 2) ranks of one
//! `ncclCommInitAll` communicator: each rank holds its columns of the logits (its rows of the LM head),
//! calls the five NCCL-mode ops with their workspace queries, and the results must be the same bits on
//! every rank and, within fp32 rounding, the unsharded calls' on GPU 0 (partial/combine and the single pass
//! are different code paths, each tested against float64 elsewhere).
//!
//!     FUSEDCE_LIB_DIR=<CUDA build> RUSTFLAGS="-L /usr/local/cuda/lib64" \
//!         cargo test --offline --features gpu-tests --test nccl_mode_gpu
#![cfg(feature = "gpu-tests")]

use std::ffi::c_void;
use std::ptr;

use fusedce::{
    CeOptions, CeOutputs, Comm, DType, Device, Divergence, Handle, KdOptions, KdOutputs, LinearCeOutputs, LseOptions,
    SoftmaxOptions, Teacher, TensorMut, TensorRef, KD_ROW_STATS_FIELDS,
};

#[link(name = "cudart")]
extern "C" {
    fn cudaGetDeviceCount(n: *mut i32) -> i32;
    fn cudaSetDevice(d: i32) -> i32;
    fn cudaMalloc(p: *mut *mut c_void, bytes: usize) -> i32;
    fn cudaFree(p: *mut c_void) -> i32;
    fn cudaMemcpy(dst: *mut c_void, src: *const c_void, bytes: usize, kind: i32) -> i32;
    fn cudaDeviceSynchronize() -> i32;
}
#[link(name = "nccl")]
extern "C" {
    fn ncclCommInitAll(comms: *mut *mut c_void, ndev: i32, devlist: *const i32) -> i32;
    fn ncclCommDestroy(comm: *mut c_void) -> i32;
}
const H2D: i32 = 1;
const D2H: i32 = 2;

fn ck(e: i32, what: &str) {
    assert_eq!(e, 0, "{} failed: {}", what, e);
}

/// Device memory of one GPU (the current device when made), freed on drop.
struct Buf {
    ptr: *mut c_void,
    n: usize,
    ordinal: i32,
}
impl Buf {
    fn from(data: &[f32], ordinal: i32) -> Buf {
        Buf::raw_from(data.as_ptr().cast(), data.len(), 4, ordinal)
    }
    fn from_i64(data: &[i64], ordinal: i32) -> Buf {
        Buf::raw_from(data.as_ptr().cast(), data.len(), 8, ordinal)
    }
    fn zeros(n: usize, ordinal: i32) -> Buf {
        // NaN: a value the calls must overwrite
        Buf::from(&vec![f32::NAN; n], ordinal)
    }
    fn raw_from(src: *const c_void, n: usize, es: usize, ordinal: i32) -> Buf {
        let mut p = ptr::null_mut();
        // SAFETY: plain CUDA runtime calls on the current device; `src` holds n * es bytes.
        unsafe {
            ck(cudaMalloc(&mut p, (n * es).max(4)), "cudaMalloc");
            ck(cudaMemcpy(p, src, n * es, H2D), "cudaMemcpy");
        }
        Buf { ptr: p, n, ordinal }
    }
    fn get(&self) -> Vec<f32> {
        let mut v = vec![0f32; self.n];
        // SAFETY: the buffer holds n f32 written by the device; the device is synchronized first.
        unsafe {
            ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
            ck(cudaMemcpy(v.as_mut_ptr().cast(), self.ptr, self.n * 4, D2H), "cudaMemcpy");
        }
        v
    }
    fn r(&self, dtype: DType, shape: &[i64]) -> TensorRef<'_> {
        // SAFETY: the buffer holds the shape's elements on this device and outlives the view.
        unsafe { TensorRef::from_raw_parts(self.ptr, dtype, Device::Cuda(self.ordinal), shape, None, 0).unwrap() }
    }
    fn m(&mut self, shape: &[i64]) -> TensorMut<'_> {
        // SAFETY: as `r`, and nothing else uses the buffer while the view lives.
        unsafe { TensorMut::from_raw_parts(self.ptr, DType::F32, Device::Cuda(self.ordinal), shape, None, 0).unwrap() }
    }
}
impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: allocated by cudaMalloc; freeing synchronizes with the work that used it.
        unsafe {
            cudaSetDevice(self.ordinal);
            cudaFree(self.ptr);
        }
    }
}

fn lcg(seed: u64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect()
}

const N: usize = 8;
const V: usize = 101;
const HD: usize = 16;
const T: f32 = 1.7;

/// The columns [s, e) of a row-major [N, V] matrix.
fn cols(x: &[f32], s: usize, e: usize) -> Vec<f32> {
    (0..N).flat_map(|i| x[i * V + s..i * V + e].to_vec()).collect()
}

/// What each op returns: (name, values) in a fixed order.
type Results = Vec<(&'static str, Vec<f32>)>;

const NAMES: [&str; 11] = [
    "ce loss",
    "ce lse",
    "ce dlogits",
    "lse at 1/T",
    "softmax probs",
    "kd loss",
    "kd dstudent",
    "lce loss",
    "lce lse",
    "lce dhidden",
    "lce dweight",
];

/// The outputs of the ops, in NAMES' order, copied back from the device.
fn named(outputs: [&Buf; 11]) -> Results {
    NAMES.iter().copied().zip(outputs.iter().map(|b| b.get())).collect()
}

struct Inputs {
    logits: Vec<f32>,
    teacher: Vec<f32>,
    hidden: Vec<f32>,
    weight: Vec<f32>,
    targets: Vec<i64>,
}

fn unsharded(inp: &Inputs) -> Results {
    ck(unsafe { cudaSetDevice(0) }, "cudaSetDevice");
    let h = Handle::cuda(0).unwrap();
    let (lg, te, hid, w, tg) = (
        Buf::from(&inp.logits, 0),
        Buf::from(&inp.teacher, 0),
        Buf::from(&inp.hidden, 0),
        Buf::from(&inp.weight, 0),
        Buf::from_i64(&inp.targets, 0),
    );
    let (n, v, hd) = (N as i64, V as i64, HD as i64);
    let (mut loss, mut lse, mut dl) = (Buf::zeros(1, 0), Buf::zeros(N, 0), Buf::zeros(N * V, 0));
    h.cross_entropy_fwd(
        &lg.r(DType::F32, &[n, v]),
        &tg.r(DType::I64, &[n]),
        &CeOptions::default(),
        &mut CeOutputs::new(loss.m(&[])).lse(lse.m(&[n])).dlogits(dl.m(&[n, v])),
    )
    .unwrap();
    let mut lse_t = Buf::zeros(N, 0);
    h.logsumexp(&lg.r(DType::F32, &[n, v]), &LseOptions::new().scale(1.0 / T), &mut lse_t.m(&[n])).unwrap();
    let mut probs = Buf::zeros(N * V, 0);
    h.temp_softmax(
        &lg.r(DType::F32, &[n, v]),
        &SoftmaxOptions::new().temperature(T),
        Some(&mut probs.m(&[n, v])),
        None,
    )
    .unwrap();
    let (mut kl, mut ds) = (Buf::zeros(1, 0), Buf::zeros(N * V, 0));
    let kd = KdOptions { divergence: Divergence::ForwardKl, temperature: T, ..KdOptions::default() };
    h.kd_loss(
        &lg.r(DType::F32, &[n, v]),
        &Teacher::Logits(te.r(DType::F32, &[n, v])),
        Some(&tg.r(DType::I64, &[n])),
        &kd,
        &mut KdOutputs::new(kl.m(&[])).dstudent(ds.m(&[n, v])),
    )
    .unwrap();
    let (mut ll, mut llse, mut dh, mut dw) =
        (Buf::zeros(1, 0), Buf::zeros(N, 0), Buf::zeros(N * HD, 0), Buf::zeros(V * HD, 0));
    h.linear_cross_entropy_fwd(
        &hid.r(DType::F32, &[n, hd]),
        &w.r(DType::F32, &[v, hd]),
        None,
        &tg.r(DType::I64, &[n]),
        &CeOptions::default(),
        &mut LinearCeOutputs::new(ll.m(&[])).lse(llse.m(&[n])).dhidden(dh.m(&[n, hd])).dweight(dw.m(&[v, hd])),
    )
    .unwrap();
    named([&loss, &lse, &dl, &lse_t, &probs, &kl, &ds, &ll, &llse, &dh, &dw])
}

/// One rank's calls on its shard [s, e); the sharded outputs come back as the rank's columns (rows of
/// dweight), to be put side by side.
fn rank(r: i32, w: i32, nccl: usize, s: usize, e: usize, inp: &Inputs) -> Results {
    ck(unsafe { cudaSetDevice(r) }, "cudaSetDevice");
    let h = Handle::cuda(r).unwrap();
    // SAFETY: ncclCommInitAll's communicator of this rank's device, destroyed after `comm`.
    let comm = unsafe { Comm::new(&h, nccl as *mut c_void) }.unwrap();
    assert_eq!((comm.rank(), comm.size()), (r, w));
    let vl = e - s;
    let (n, vli, hd, vt) = (N as i64, vl as i64, HD as i64, V as i64);
    let lg = Buf::from(&cols(&inp.logits, s, e), r);
    let te = Buf::from(&cols(&inp.teacher, s, e), r);
    let hid = Buf::from(&inp.hidden, r);
    let wr = Buf::from(&inp.weight[s * HD..e * HD], r);
    let tg = Buf::from_i64(&inp.targets, r);
    let ce = CeOptions::default().vocab_start(s as i64).vocab_total(vt);

    let (mut loss, mut lse, mut dl) = (Buf::zeros(1, r), Buf::zeros(N, r), Buf::zeros(N * vl, r));
    {
        let mut out = CeOutputs::new(loss.m(&[])).lse(lse.m(&[n])).dlogits(dl.m(&[n, vli]));
        let ws = h.cross_entropy_fwd_vp_workspace_size(
            &comm,
            &lg.r(DType::F32, &[n, vli]),
            &tg.r(DType::I64, &[n]),
            &ce,
            &mut out,
        );
        assert!(ws.unwrap() > 0, "the records of every rank take workspace");
        h.cross_entropy_fwd_vp(&comm, &lg.r(DType::F32, &[n, vli]), &tg.r(DType::I64, &[n]), &ce, &mut out).unwrap();
    }
    let mut lse_t = Buf::zeros(N, r);
    let lo = LseOptions::new().scale(1.0 / T).vocab_start(s as i64).vocab_total(vt);
    assert!(h.logsumexp_vp_workspace_size(&comm, &lg.r(DType::F32, &[n, vli]), &lo, &mut lse_t.m(&[n])).unwrap() > 0);
    h.logsumexp_vp(&comm, &lg.r(DType::F32, &[n, vli]), &lo, &mut lse_t.m(&[n])).unwrap();
    let (mut probs, mut sm_lse) = (Buf::zeros(N * vl, r), Buf::zeros(N, r));
    let so = SoftmaxOptions::new().temperature(T).vocab_start(s as i64).vocab_total(vt);
    h.temp_softmax_vp_workspace_size(
        &comm,
        &lg.r(DType::F32, &[n, vli]),
        &so,
        Some(&mut probs.m(&[n, vli])),
        None,
        Some(&mut sm_lse.m(&[n])),
    )
    .unwrap();
    h.temp_softmax_vp(
        &comm,
        &lg.r(DType::F32, &[n, vli]),
        &so,
        Some(&mut probs.m(&[n, vli])),
        None,
        Some(&mut sm_lse.m(&[n])),
    )
    .unwrap();
    let (mut kl, mut ds, mut stats) = (Buf::zeros(1, r), Buf::zeros(N * vl, r), Buf::zeros(N * KD_ROW_STATS_FIELDS, r));
    let kd = KdOptions {
        divergence: Divergence::ForwardKl,
        temperature: T,
        vocab_start: s as i64,
        vocab_total: vt,
        ..KdOptions::default()
    };
    {
        let teacher = Teacher::Logits(te.r(DType::F32, &[n, vli]));
        let mut out = KdOutputs::new(kl.m(&[])).dstudent(ds.m(&[n, vli]));
        let rs = KD_ROW_STATS_FIELDS as i64;
        h.kd_fwd_vp_workspace_size(
            &comm,
            &lg.r(DType::F32, &[n, vli]),
            &teacher,
            Some(&tg.r(DType::I64, &[n])),
            &kd,
            &mut out,
            Some(&mut stats.m(&[n, rs])),
        )
        .unwrap();
        h.kd_fwd_vp(
            &comm,
            &lg.r(DType::F32, &[n, vli]),
            &teacher,
            Some(&tg.r(DType::I64, &[n])),
            &kd,
            &mut out,
            Some(&mut stats.m(&[n, rs])),
        )
        .unwrap();
    }
    let (mut ll, mut llse, mut dh, mut dw) =
        (Buf::zeros(1, r), Buf::zeros(N, r), Buf::zeros(N * HD, r), Buf::zeros(vl * HD, r));
    {
        let mut out =
            LinearCeOutputs::new(ll.m(&[])).lse(llse.m(&[n])).dhidden(dh.m(&[n, hd])).dweight(dw.m(&[vli, hd]));
        let (hr, wrr, tr) = (hid.r(DType::F32, &[n, hd]), wr.r(DType::F32, &[vli, hd]), tg.r(DType::I64, &[n]));
        assert!(h.linear_cross_entropy_fwd_vp_workspace_size(&comm, &hr, &wrr, None, &tr, &ce, &mut out).unwrap() > 0);
        h.linear_cross_entropy_fwd_vp(&comm, &hr, &wrr, None, &tr, &ce, &mut out).unwrap();
    }
    let st = stats.get();
    assert!(st.iter().all(|x| !x.is_nan()), "row statistics written");
    let mut r = named([&loss, &lse, &dl, &lse_t, &probs, &kl, &ds, &ll, &llse, &dh, &dw]);
    r.push(("softmax's lse (vs lse at 1/T)", sm_lse.get()));
    r
}

#[test]
fn nccl_mode_ops_agree_with_the_unsharded_calls() {
    let mut count = 0i32;
    // SAFETY: an out pointer.
    if unsafe { cudaGetDeviceCount(&mut count) } != 0 || count == 0 {
        eprintln!("no CUDA device: NCCL mode not tested");
        return;
    }
    let w = count.min(2);
    let mut t = lcg(7, N, 0.0, V as f32).into_iter().map(|x| (x as i64).min(V as i64 - 1)).collect::<Vec<_>>();
    t[3] = -100; // ignored
    let inp = Inputs {
        logits: lcg(1, N * V, -4.0, 4.0),
        teacher: lcg(2, N * V, -3.0, 3.0),
        hidden: lcg(3, N * HD, -1.0, 1.0),
        weight: lcg(4, V * HD, -0.5, 0.5),
        targets: t,
    };
    let want = unsharded(&inp);
    let mut comms = vec![ptr::null_mut::<c_void>(); w as usize];
    let devs: Vec<i32> = (0..w).collect();
    // SAFETY: w out pointers and w device ordinals.
    ck(unsafe { ncclCommInitAll(comms.as_mut_ptr(), w, devs.as_ptr()) }, "ncclCommInitAll");
    let bounds: Vec<usize> = (0..=w as usize).map(|r| r * V / w as usize).collect();
    let got: Vec<Results> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..w as usize)
            .map(|r| {
                let (c, s, e, inp) = (comms[r] as usize, bounds[r], bounds[r + 1], &inp);
                sc.spawn(move || rank(r as i32, w, c, s, e, inp))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for c in comms {
        // SAFETY: made by ncclCommInitAll; every Comm borrowing it is gone.
        unsafe { ncclCommDestroy(c) };
    }
    let close = |what: &str, a: &[f32], b: &[f32]| {
        assert_eq!(a.len(), b.len(), "{}", what);
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= 1e-5 + 1e-5 * y.abs(), "{}[{}]: NCCL mode {} against {}", what, i, x, y);
        }
    };
    for (k, (name, v)) in want.iter().enumerate() {
        let sharded = matches!(*name, "ce dlogits" | "softmax probs" | "kd dstudent");
        let whole: Vec<f32> = if sharded {
            // every rank's columns, side by side
            (0..N)
                .flat_map(|i| {
                    got.iter().flat_map(move |g| {
                        let vl = g[k].1.len() / N;
                        g[k].1[i * vl..(i + 1) * vl].to_vec()
                    })
                })
                .collect()
        } else if *name == "lce dweight" {
            got.iter().flat_map(|g| g[k].1.clone()).collect()
        } else {
            for g in &got[1..] {
                let same = g[k].1.iter().zip(&got[0][k].1).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{}: the ranks' bits differ", name);
            }
            got[0][k].1.clone()
        };
        close(name, &whole, v);
    }
    close("softmax's lse", &got[0][11].1, &got[0][3].1);
    eprintln!("NCCL mode over {} rank(s): the five ops agree with the unsharded calls", w);
}
