//! Gradient accumulation of linear cross-entropy (`LinearCeOutputs::accumulate`,
//! `LinearCeGrads::accumulate`: `FCE_LINEAR_CE_ACCUMULATE`) on the CPU backend: dhidden, dweight and dbias
//! pre-filled with known values get those values plus the float64 gradient derived here (twice the
//! gradient after two calls), fp32 and bf16 outputs, the forward and the backward; without the flag the
//! same outputs are overwritten; a vocabulary shard's padding rows are left as they are; a refused call
//! touches nothing.
//!
//! Reference (Mean over the rows not ignored, label smoothing ε, upstream gradient g): with p = softmax of
//! the row's logits, dz_ij = g/n_valid · (p_ij − (1−ε)·[j = t_i] − ε/V) (0 for an ignored row); dhidden =
//! dz·W, dweight = dzᵀ·h, dbias = Σ_i dz_i. It is checked against central finite differences of the
//! float64 loss.
#[path = "support/reference.rs"]
mod reference;

use fusedce::{bits, CeOptions, DType, Handle, LinearCeGrads, LinearCeOutputs, Status, TensorMut, TensorRef};
use reference::*;

fn cpu() -> Handle {
    Handle::cpu().expect("CPU handle")
}

/// Label smoothing of every call here.
const EPS: f64 = 0.1;
/// |got − want| allowed for an fp32 sum of values below 4 (a few fp32 ulps there): the flag's absence
/// is off by a pre-filled value (|value| ≥ 0.5), the gradient's by 1 or 2 times the gradient (checked
/// to be far above this).
const TOL32: f64 = 1e-6;

fn options() -> CeOptions<'static> {
    CeOptions::new().label_smoothing(EPS as f32)
}

/// N 5, H 7, V 11 with a bias; one ignored row.
struct Problem {
    n: usize,
    hdim: usize,
    v: usize,
    hidden: Vec<f32>,
    weight: Vec<f32>,
    bias: Vec<f32>,
    targets: Vec<i64>,
}

fn problem() -> Problem {
    let (n, hdim, v) = (5, 7, 11);
    let mut rng = Rng::new(23);
    Problem {
        n,
        hdim,
        v,
        hidden: rng.f32s(n * hdim, -1.0, 1.0),
        weight: rng.f32s(v * hdim, -1.0, 1.0),
        bias: rng.f32s(v, -0.5, 0.5),
        targets: vec![3, 10, -100, 0, 7],
    }
}

/// Float64 values of one call with upstream gradient `g`.
struct Want {
    loss: f64,
    lse: Vec<f64>,
    dlogits: Vec<f64>,
    dh: Vec<f64>,
    dw: Vec<f64>,
    db: Vec<f64>,
}

impl Problem {
    fn logits(&self, hid: &[f64], w: &[f64], b: &[f64]) -> Vec<f64> {
        linear_logits(self.n, self.hdim, self.v, hid, w, b)
    }
    /// g × the mean loss, in float64.
    fn loss(&self, hid: &[f64], w: &[f64], b: &[f64], g: f64) -> f64 {
        let o = CeRef { eps: EPS, ..Default::default() };
        let rows: Vec<f64> = o.rows(&self.logits(hid, w, b), self.v, &self.targets).iter().map(|r| r.loss).collect();
        reduce(&rows, &Red::Mean(g), o.denom(&self.targets))
    }
    fn want(&self, g: f64) -> Want {
        let (n, hd, v) = (self.n, self.hdim, self.v);
        let (h, w, b) = (widen(&self.hidden), widen(&self.weight), widen(&self.bias));
        let z = self.logits(&h, &w, &b);
        let valid = self.targets.iter().filter(|&&t| t != -100).count() as f64;
        let mut dz = vec![0.0; n * v];
        let mut lse = vec![0.0; n];
        for i in 0..n {
            let row = &z[i * v..(i + 1) * v];
            lse[i] = logsumexp(row);
            if self.targets[i] == -100 {
                continue;
            }
            for j in 0..v {
                let onehot = if j as i64 == self.targets[i] { 1.0 } else { 0.0 };
                dz[i * v + j] = g / valid * ((row[j] - lse[i]).exp() - (1.0 - EPS) * onehot - EPS / v as f64);
            }
        }
        let (mut dh, mut dw, mut db) = (vec![0.0; n * hd], vec![0.0; v * hd], vec![0.0; v]);
        for i in 0..n {
            for j in 0..v {
                let d = dz[i * v + j];
                db[j] += d;
                for c in 0..hd {
                    dh[i * hd + c] += d * w[j * hd + c];
                    dw[j * hd + c] += d * h[i * hd + c];
                }
            }
        }
        Want { loss: self.loss(&h, &w, &b, 1.0), lse, dlogits: dz, dh, dw, db }
    }
}

/// `len` values of magnitude in [0.5, 2] and random sign: far from 0, so that a call that overwrote them
/// is caught.
fn prefill(rng: &mut Rng, len: usize) -> Vec<f32> {
    (0..len)
        .map(|_| {
            let m = rng.uniform(0.5, 2.0) as f32;
            if rng.below(2) == 0 {
                m
            } else {
                -m
            }
        })
        .collect()
}

/// `base + times · grad`, elementwise, in float64.
fn plus(base: &[f32], times: f64, grad: &[f64]) -> Vec<f64> {
    base.iter().zip(grad).map(|(&b, &g)| b as f64 + times * g).collect()
}

/// max |x|.
fn max_abs(x: &[f64]) -> f64 {
    x.iter().fold(0.0f64, |m, v| m.max(v.abs()))
}

/// Every element of a bf16 output within half a bf16 ulp of `want` (+ `slack` for the fp32 gradient):
/// the fp32 sum rounded once to bf16.
fn assert_bf16_rounded_once(what: &str, got: &[u16], want: &[f64], slack: f64) {
    assert_eq!(got.len(), want.len(), "{}: length", what);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let g = bits::bf16_to_f32(g) as f64;
        // bf16 keeps 8 significant bits: ulp(w) = 2^(floor(log2 |w|) − 7).
        let half_ulp = 0.5 * 2f64.powi(w.abs().log2().floor() as i32 - 7);
        assert!(
            (g - w).abs() <= half_ulp + slack,
            "{}[{}]: got {} want {} (|diff| {:.3e} > half an ulp {:.3e} + {:.1e})",
            what,
            i,
            g,
            w,
            (g - w).abs(),
            half_ulp,
            slack
        );
    }
}

/// The float64 reference itself: its gradients against central finite differences of the loss, and large
/// enough (every gradient's max entry 100 times [`TOL32`]) for the checks below to mean something.
#[test]
fn reference_gradients_match_finite_differences() {
    let p = problem();
    let want = p.want(1.0);
    let (h, w, b) = (widen(&p.hidden), widen(&p.weight), widen(&p.bias));
    assert_close("dhidden", &want.dh, &fd_grad(&h, |y| p.loss(y, &w, &b, 1.0)), 1e-7, 1e-5);
    assert_close("dweight", &want.dw, &fd_grad(&w, |y| p.loss(&h, y, &b, 1.0)), 1e-7, 1e-5);
    assert_close("dbias", &want.db, &fd_grad(&b, |y| p.loss(&h, &w, y, 1.0)), 1e-7, 1e-5);
    for (what, g) in [("dhidden", &want.dh), ("dweight", &want.dw), ("dbias", &want.db)] {
        assert!(max_abs(g) > 100.0 * TOL32, "{}: gradient too small to test", what);
    }
    // Builders: accumulate is off unless asked for.
    let mut loss = 0f32;
    assert!(!LinearCeOutputs::new(TensorMut::scalar(&mut loss)).accumulate);
    assert!(LinearCeOutputs::new(TensorMut::scalar(&mut loss)).accumulate(true).accumulate);
    assert!(!LinearCeGrads::new().accumulate);
    assert!(!LinearCeGrads::default().accumulate);
    assert!(LinearCeGrads::new().accumulate(true).accumulate);
}

/// Two forwards with accumulate on: the gradients are the pre-filled values plus once, then twice, the
/// gradient; loss and lse are written (not added to) every time.
#[test]
fn linear_cross_entropy_fwd_accumulate_adds_into_the_gradients() {
    let p = problem();
    let want = p.want(1.0);
    let (n, hdim, v) = (p.n, p.hdim, p.v);
    let mut rng = Rng::new(24);
    let (dh0, dw0, db0) = (prefill(&mut rng, n * hdim), prefill(&mut rng, v * hdim), prefill(&mut rng, v));
    let (mut dh, mut dw, mut db) = (dh0.clone(), dw0.clone(), db0.clone());
    let h = cpu();
    let (hm, wm, bv, tv) = (
        TensorRef::matrix(&p.hidden, n, hdim).unwrap(),
        TensorRef::matrix(&p.weight, v, hdim).unwrap(),
        TensorRef::vector(&p.bias),
        TensorRef::vector(&p.targets),
    );
    for call in 1..=2 {
        let mut loss = 1e3f32;
        let mut lse = vec![f32::NAN; n];
        h.linear_cross_entropy_fwd(
            &hm,
            &wm,
            Some(&bv),
            &tv,
            &options(),
            &mut LinearCeOutputs::new(TensorMut::scalar(&mut loss))
                .lse(TensorMut::vector(&mut lse))
                .dhidden(TensorMut::matrix(&mut dh, n, hdim).unwrap())
                .dweight(TensorMut::matrix(&mut dw, v, hdim).unwrap())
                .dbias(TensorMut::vector(&mut db))
                .accumulate(true),
        )
        .unwrap();
        let k = call as f64;
        assert_close(&format!("call {}: loss", call), &[loss as f64], &[want.loss], 1e-6, 1e-5);
        assert_close(&format!("call {}: lse", call), &widen(&lse), &want.lse, 1e-6, 1e-5);
        assert_close(&format!("call {}: dhidden", call), &widen(&dh), &plus(&dh0, k, &want.dh), TOL32, 0.0);
        assert_close(&format!("call {}: dweight", call), &widen(&dw), &plus(&dw0, k, &want.dw), TOL32, 0.0);
        assert_close(&format!("call {}: dbias", call), &widen(&db), &plus(&db0, k, &want.db), TOL32, 0.0);
    }
}

/// bf16 gradient outputs (fp32 inputs) with accumulate: each element is the fp32 sum of the pre-filled
/// bf16 value and the gradient, rounded once to bf16.
#[test]
fn linear_cross_entropy_fwd_accumulate_bf16_outputs_rounded_once() {
    let p = problem();
    let want = p.want(1.0);
    let (n, hdim, v) = (p.n, p.hdim, p.v);
    let mut rng = Rng::new(25);
    let to16 = |x: Vec<f32>| -> Vec<u16> { x.into_iter().map(bits::f32_to_bf16).collect() };
    let (dh0, dw0, db0) =
        (to16(prefill(&mut rng, n * hdim)), to16(prefill(&mut rng, v * hdim)), to16(prefill(&mut rng, v)));
    let (mut dh, mut dw, mut db) = (dh0.clone(), dw0.clone(), db0.clone());
    let mut loss = 0f32;
    cpu()
        .linear_cross_entropy_fwd(
            &TensorRef::matrix(&p.hidden, n, hdim).unwrap(),
            &TensorRef::matrix(&p.weight, v, hdim).unwrap(),
            Some(&TensorRef::vector(&p.bias)),
            &TensorRef::vector(&p.targets),
            &options(),
            &mut LinearCeOutputs::new(TensorMut::scalar(&mut loss))
                .dhidden(TensorMut::from_bits(&mut dh, DType::BF16, &[n, hdim]).unwrap())
                .dweight(TensorMut::from_bits(&mut dw, DType::BF16, &[v, hdim]).unwrap())
                .dbias(TensorMut::from_bits(&mut db, DType::BF16, &[v]).unwrap())
                .accumulate(true),
        )
        .unwrap();
    let base = |x: &[u16]| -> Vec<f32> { x.iter().map(|&b| bits::bf16_to_f32(b)).collect() };
    assert_bf16_rounded_once("bf16 dhidden", &dh, &plus(&base(&dh0), 1.0, &want.dh), TOL32);
    assert_bf16_rounded_once("bf16 dweight", &dw, &plus(&base(&dw0), 1.0, &want.dw), TOL32);
    assert_bf16_rounded_once("bf16 dbias", &db, &plus(&base(&db0), 1.0, &want.db), TOL32);
    // Not a vacuous check: the sums moved away from the pre-filled values.
    for (what, got, was) in [("dhidden", &dh, &dh0), ("dweight", &dw, &dw0), ("dbias", &db, &db0)] {
        assert!(got != was, "bf16 {}: unchanged", what);
    }
}

/// The backward with accumulate (upstream gradient 1.5, twice), from the forward's lse; then a call with
/// dweight only adds into dweight alone.
#[test]
fn linear_cross_entropy_bwd_accumulate_adds_into_the_gradients() {
    let p = problem();
    let want = p.want(1.0);
    let (n, hdim, v) = (p.n, p.hdim, p.v);
    let h = cpu();
    let (hm, wm, bv, tv) = (
        TensorRef::matrix(&p.hidden, n, hdim).unwrap(),
        TensorRef::matrix(&p.weight, v, hdim).unwrap(),
        TensorRef::vector(&p.bias),
        TensorRef::vector(&p.targets),
    );
    let mut loss = 0f32;
    let mut lse = vec![0f32; n];
    h.linear_cross_entropy_fwd(
        &hm,
        &wm,
        Some(&bv),
        &tv,
        &options(),
        &mut LinearCeOutputs::new(TensorMut::scalar(&mut loss)).lse(TensorMut::vector(&mut lse)),
    )
    .unwrap();
    let mut rng = Rng::new(26);
    let (dh0, dw0, db0) = (prefill(&mut rng, n * hdim), prefill(&mut rng, v * hdim), prefill(&mut rng, v));
    let (mut dh, mut dw, mut db) = (dh0.clone(), dw0.clone(), db0.clone());
    let g15 = 1.5f32;
    for call in 1..=2 {
        h.linear_cross_entropy_bwd(
            &hm,
            &wm,
            Some(&bv),
            &tv,
            &TensorRef::vector(&lse),
            &options(),
            &mut LinearCeGrads::new()
                .dhidden(TensorMut::matrix(&mut dh, n, hdim).unwrap())
                .dweight(TensorMut::matrix(&mut dw, v, hdim).unwrap())
                .dbias(TensorMut::vector(&mut db))
                .grad_loss(TensorRef::scalar(&g15))
                .accumulate(true),
        )
        .unwrap();
        let k = 1.5 * call as f64;
        assert_close(&format!("bwd call {}: dhidden", call), &widen(&dh), &plus(&dh0, k, &want.dh), TOL32, 0.0);
        assert_close(&format!("bwd call {}: dweight", call), &widen(&dw), &plus(&dw0, k, &want.dw), TOL32, 0.0);
        assert_close(&format!("bwd call {}: dbias", call), &widen(&db), &plus(&db0, k, &want.db), TOL32, 0.0);
    }
    // dweight alone (grad_loss 1): dhidden and dbias, not given, stay at 3 gradients.
    let (dh3, db3) = (dh.clone(), db.clone());
    h.linear_cross_entropy_bwd(
        &hm,
        &wm,
        Some(&bv),
        &tv,
        &TensorRef::vector(&lse),
        &options(),
        &mut LinearCeGrads::new().dweight(TensorMut::matrix(&mut dw, v, hdim).unwrap()).accumulate(true),
    )
    .unwrap();
    assert_close("bwd dweight, 4 gradients", &widen(&dw), &plus(&dw0, 4.0, &want.dw), TOL32, 0.0);
    assert_eq!(dh, dh3);
    assert_eq!(db, db3);
}

/// Without the flag (the default, or accumulate(false)) the same pre-filled outputs are overwritten with
/// the gradient, by the forward and by the backward.
#[test]
fn linear_cross_entropy_overwrites_without_accumulate() {
    let p = problem();
    let want = p.want(1.0);
    let (n, hdim, v) = (p.n, p.hdim, p.v);
    let h = cpu();
    let (hm, wm, bv, tv) = (
        TensorRef::matrix(&p.hidden, n, hdim).unwrap(),
        TensorRef::matrix(&p.weight, v, hdim).unwrap(),
        TensorRef::vector(&p.bias),
        TensorRef::vector(&p.targets),
    );
    let mut rng = Rng::new(27);
    let (dh0, dw0, db0) = (prefill(&mut rng, n * hdim), prefill(&mut rng, v * hdim), prefill(&mut rng, v));
    let mut lse = vec![0f32; n];
    for explicit in [false, true] {
        let (mut dh, mut dw, mut db) = (dh0.clone(), dw0.clone(), db0.clone());
        let mut loss = 1e3f32;
        let mut outs = LinearCeOutputs::new(TensorMut::scalar(&mut loss))
            .lse(TensorMut::vector(&mut lse))
            .dhidden(TensorMut::matrix(&mut dh, n, hdim).unwrap())
            .dweight(TensorMut::matrix(&mut dw, v, hdim).unwrap())
            .dbias(TensorMut::vector(&mut db));
        if explicit {
            outs = outs.accumulate(false);
        }
        h.linear_cross_entropy_fwd(&hm, &wm, Some(&bv), &tv, &options(), &mut outs).unwrap();
        assert_close("fwd loss", &[loss as f64], &[want.loss], 1e-6, 1e-5);
        assert_close("fwd dhidden", &widen(&dh), &want.dh, TOL32, 0.0);
        assert_close("fwd dweight", &widen(&dw), &want.dw, TOL32, 0.0);
        assert_close("fwd dbias", &widen(&db), &want.db, TOL32, 0.0);

        let (mut dh, mut dw, mut db) = (dh0.clone(), dw0.clone(), db0.clone());
        let mut grads = LinearCeGrads::new()
            .dhidden(TensorMut::matrix(&mut dh, n, hdim).unwrap())
            .dweight(TensorMut::matrix(&mut dw, v, hdim).unwrap())
            .dbias(TensorMut::vector(&mut db));
        if explicit {
            grads = grads.accumulate(false);
        }
        h.linear_cross_entropy_bwd(&hm, &wm, Some(&bv), &tv, &TensorRef::vector(&lse), &options(), &mut grads).unwrap();
        assert_close("bwd dhidden", &widen(&dh), &want.dh, TOL32, 0.0);
        assert_close("bwd dweight", &widen(&dw), &want.dw, TOL32, 0.0);
        assert_close("bwd dbias", &widen(&db), &want.db, TOL32, 0.0);
    }
}

/// A vocabulary shard's backward (rows [6, 11) of V = 11 plus 2 NaN padding rows) with accumulate: the
/// shard's dweight and dbias rows and its fp32 part of dhidden are added into; the padding rows keep
/// their values (written 0 without the flag).
#[test]
fn linear_cross_entropy_shard_bwd_accumulate_keeps_padding_rows() {
    let p = problem();
    let want = p.want(1.0);
    let (n, hdim, v) = (p.n, p.hdim, p.v);
    let (start, pad) = (6usize, 2usize);
    let rows = v - start + pad;
    let h = cpu();
    let (hm, tv) = (TensorRef::matrix(&p.hidden, n, hdim).unwrap(), TensorRef::vector(&p.targets));
    let mut loss = 0f32;
    let mut lse = vec![0f32; n];
    h.linear_cross_entropy_fwd(
        &hm,
        &TensorRef::matrix(&p.weight, v, hdim).unwrap(),
        Some(&TensorRef::vector(&p.bias)),
        &tv,
        &options(),
        &mut LinearCeOutputs::new(TensorMut::scalar(&mut loss)).lse(TensorMut::vector(&mut lse)),
    )
    .unwrap();
    let mut ws = p.weight[start * hdim..].to_vec();
    ws.extend(std::iter::repeat(f32::NAN).take(pad * hdim));
    let mut bs = p.bias[start..].to_vec();
    bs.extend(std::iter::repeat(f32::NAN).take(pad));
    let shard = options().vocab_start(start as i64).vocab_total(v as i64);
    // This shard's part of dhidden: Σ over its columns of dlogits · W.
    let wd = widen(&p.weight);
    let mut part = vec![0.0; n * hdim];
    for i in 0..n {
        for j in start..v {
            for c in 0..hdim {
                part[i * hdim + c] += want.dlogits[i * v + j] * wd[j * hdim + c];
            }
        }
    }
    let mut rng = Rng::new(28);
    let (dh0, dw0, db0) = (prefill(&mut rng, n * hdim), prefill(&mut rng, rows * hdim), prefill(&mut rng, rows));
    for accumulate in [true, false] {
        let (mut dh, mut dw, mut db) = (dh0.clone(), dw0.clone(), db0.clone());
        h.linear_cross_entropy_bwd(
            &hm,
            &TensorRef::matrix(&ws, rows, hdim).unwrap(),
            Some(&TensorRef::vector(&bs)),
            &tv,
            &TensorRef::vector(&lse),
            &shard,
            &mut LinearCeGrads::new()
                .dhidden(TensorMut::matrix(&mut dh, n, hdim).unwrap())
                .dweight(TensorMut::matrix(&mut dw, rows, hdim).unwrap())
                .dbias(TensorMut::vector(&mut db))
                .accumulate(accumulate),
        )
        .unwrap();
        let real = (v - start) * hdim;
        let k = if accumulate { 1.0 } else { 0.0 };
        let base = |x: &[f32]| -> Vec<f32> { x.iter().map(|&b| b * k as f32).collect() };
        let tag = if accumulate { "accumulate" } else { "overwrite" };
        assert_close(&format!("{}: dhidden part", tag), &widen(&dh), &plus(&base(&dh0), 1.0, &part), TOL32, 0.0);
        assert_close(
            &format!("{}: dweight rows", tag),
            &widen(&dw[..real]),
            &plus(&base(&dw0[..real]), 1.0, &want.dw[start * hdim..]),
            TOL32,
            0.0,
        );
        assert_close(
            &format!("{}: dbias rows", tag),
            &widen(&db[..v - start]),
            &plus(&base(&db0[..v - start]), 1.0, &want.db[start..]),
            TOL32,
            0.0,
        );
        // Padding rows: bitwise the pre-filled values with the flag, 0 without.
        let pad_w: Vec<f32> = if accumulate { dw0[real..].to_vec() } else { vec![0.0; pad * hdim] };
        let pad_b: Vec<f32> = if accumulate { db0[v - start..].to_vec() } else { vec![0.0; pad] };
        assert_eq!(bits32(&dw[real..]), bits32(&pad_w), "{}: dweight padding rows", tag);
        assert_eq!(bits32(&db[v - start..]), bits32(&pad_b), "{}: dbias padding rows", tag);
    }
}

fn bits32(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The statuses are the call's: a refused call with accumulate on (dbias without a bias:
/// INVALID_ARGUMENT; dweight of the wrong shape: SHAPE_MISMATCH) leaves every output as it was.
#[test]
fn linear_cross_entropy_accumulate_refused_calls_touch_nothing() {
    let p = problem();
    let (n, hdim, v) = (p.n, p.hdim, p.v);
    let h = cpu();
    let (hm, wm, tv) = (
        TensorRef::matrix(&p.hidden, n, hdim).unwrap(),
        TensorRef::matrix(&p.weight, v, hdim).unwrap(),
        TensorRef::vector(&p.targets),
    );
    let mut rng = Rng::new(29);
    let (dh0, dw0, db0) = (prefill(&mut rng, n * hdim), prefill(&mut rng, v * hdim), prefill(&mut rng, v));
    let (mut dh, mut dw, mut db) = (dh0.clone(), dw0.clone(), db0.clone());
    let mut loss = 1e3f32;
    let e = h
        .linear_cross_entropy_fwd(
            &hm,
            &wm,
            None,
            &tv,
            &options(),
            &mut LinearCeOutputs::new(TensorMut::scalar(&mut loss))
                .dhidden(TensorMut::matrix(&mut dh, n, hdim).unwrap())
                .dbias(TensorMut::vector(&mut db))
                .accumulate(true),
        )
        .unwrap_err();
    assert_eq!(e.status(), Status::INVALID_ARGUMENT, "{}", e);
    let lse = vec![1f32; n];
    let e = h
        .linear_cross_entropy_bwd(
            &hm,
            &wm,
            None,
            &tv,
            &TensorRef::vector(&lse),
            &options(),
            &mut LinearCeGrads::new()
                .dhidden(TensorMut::matrix(&mut dh, n, hdim).unwrap())
                .dweight(TensorMut::matrix(&mut dw[..(v - 1) * hdim], v - 1, hdim).unwrap())
                .accumulate(true),
        )
        .unwrap_err();
    assert_eq!(e.status(), Status::SHAPE_MISMATCH, "{}", e);
    assert_eq!(loss, 1e3);
    assert_eq!(bits32(&dh), bits32(&dh0));
    assert_eq!(bits32(&dw), bits32(&dw0));
    assert_eq!(bits32(&db), bits32(&db0));
}
