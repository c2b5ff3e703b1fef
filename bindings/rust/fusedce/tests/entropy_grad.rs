//! The entropy's gradient (`grad_entropy`, since 0.2.0) on the CPU backend: the fused forward,
//! `cross_entropy_bwd_ex` (out of place, in place, workspace query) and linear cross-entropy, against
//! float64 gradients derived here by hand (and checked against central finite differences), plus the
//! statuses of misuse.
//!
//! Math (header, `fce_ce_outputs_t.grad_entropy`): H = −Σ_j p_j log p_j, dH/dz_j = p_j·(μ − z_j),
//! μ = Σ_k p_k z_k = lse − H, chained through logit_scale and softcap like the loss gradient.
#[path = "support/reference.rs"]
mod reference;

use fusedce::{
    CeBwdInputs, CeOptions, CeOutputs, Handle, LinearCeGrads, LinearCeOutputs, Reduction, Status, TensorMut, TensorRef,
};
use reference::*;

fn cpu() -> Handle {
    Handle::cpu().expect("CPU handle")
}

/// Every element within `rel`·max|want| of `want` (the fp32 bound of a gradient whose small entries
/// are sums of cancelling terms); `max|want|` must be positive, so the check is never vacuous.
fn assert_close_to_max(what: &str, got: &[f64], want: &[f64], rel: f64) {
    assert_eq!(got.len(), want.len(), "{}: length", what);
    let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
    assert!(scale > 0.0 && scale.is_finite(), "{}: max|ref| = {}", what, scale);
    let tol = rel * scale;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol,
            "{}[{}]: got {} want {} (|diff| {:.3e} > {:.3e})",
            what,
            i,
            g,
            w,
            (g - w).abs(),
            tol
        );
    }
}

/// max_i |a_i − b_i|.
fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).fold(0.0f64, |m, (x, y)| m.max((x - y).abs()))
}

/// One row's float64 statistics and analytic gradients w.r.t. the raw logits `x` [V].
struct RowGrad {
    lse: f64,
    entropy: f64,
    loss: f64,
    /// d(loss)/dx (0 for an ignored row).
    dloss: Vec<f64>,
    /// dH/dx.
    dent: Vec<f64>,
}

/// The row of `x` with target `t` under options `o` (PyTorch semantics, as the header's math): z =
/// c·tanh(s·x/c) or s·x; p = softmax(z);
///   d(loss)/dz_j = p_j·((1−e)·w_t + (e/V)·Σ_k w_k + 2q·lse) − (1−e)·w_t·[j = t] − (e/V)·w_j,
///   dH/dz_j = p_j·(μ − z_j) (0 where p_j = 0), μ = Σ_k p_k z_k;
/// then d/dx_j = d/dz_j · dz_j/dx_j with dz/dx = s·(1 − tanh²(s·x/c)) (softcap) or s.
fn row_grad(o: &CeRef, x: &[f64], t: i64) -> RowGrad {
    let v = x.len();
    let z: Vec<f64> = x.iter().map(|&xi| o.transform(xi)).collect();
    let dzdx: Vec<f64> = x
        .iter()
        .map(|&xi| {
            if o.cap > 0.0 {
                let th = (o.scale * xi / o.cap).tanh();
                o.scale * (1.0 - th * th)
            } else {
                o.scale
            }
        })
        .collect();
    let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = z.iter().map(|&zj| (zj - m).exp()).sum();
    let lse = m + sum.ln();
    let p: Vec<f64> = z.iter().map(|&zj| (zj - lse).exp()).collect();
    let mu: f64 = (0..v).filter(|&j| p[j] > 0.0).map(|j| p[j] * z[j]).sum();
    let entropy = lse - mu;
    let dent: Vec<f64> = (0..v).map(|j| if p[j] > 0.0 { p[j] * (mu - z[j]) * dzdx[j] } else { 0.0 }).collect();
    if t == o.ignore_index {
        return RowGrad { lse, entropy, loss: 0.0, dloss: vec![0.0; v], dent };
    }
    let tu = t as usize;
    let wsum: f64 = (0..v).map(|k| o.w(k)).sum();
    let (e, vf) = (o.eps, v as f64);
    let c = (1.0 - e) * o.w(tu) + e / vf * wsum + 2.0 * o.q * lse;
    let dloss: Vec<f64> = (0..v)
        .map(|j| {
            let mut g = p[j] * c - e / vf * o.w(j);
            if j == tu {
                g -= (1.0 - e) * o.w(tu);
            }
            g * dzdx[j]
        })
        .collect();
    let mut loss = (1.0 - e) * o.w(tu) * (lse - z[tu]) + e / vf * (0..v).map(|j| o.w(j) * (lse - z[j])).sum::<f64>();
    loss += o.q * lse * lse;
    RowGrad { lse, entropy, loss, dloss, dent }
}

/// dlogits [N·V] of Σ_i a_i·loss_i + Σ_i b_i·H_i: `a` the loss's per-row weight (grad_loss, over the
/// mean's denominator for Mean), `b` grad_entropy per row. `with_entropy` = false drops the H term.
fn ref_dlogits(rows: &[RowGrad], a: &[f64], b: &[f64], with_entropy: bool) -> Vec<f64> {
    let mut out = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        for j in 0..r.dloss.len() {
            out.push(a[i] * r.dloss[j] + if with_entropy { b[i] * r.dent[j] } else { 0.0 });
        }
    }
    out
}

/// One configuration of the cross-entropy tests.
struct Case {
    name: &'static str,
    n: usize,
    v: usize,
    x: Vec<f32>,
    targets: Vec<i64>,
    reduction: Reduction,
    /// grad_loss: `[N]` for Reduction::None, a scalar (length 1) otherwise.
    gl: Vec<f32>,
    /// grad_entropy: `[N]`, or length 1 for a broadcast scalar.
    ge: Vec<f32>,
    o: CeRef,
    weights: Option<Vec<f32>>,
    /// Rows whose logits are finite (the finite-difference check of the reference skips the others).
    finite: bool,
}

impl Case {
    fn options(&self) -> CeOptions<'_> {
        let mut c = CeOptions::new()
            .reduction(self.reduction)
            .ignore_index(self.o.ignore_index)
            .label_smoothing(self.o.eps as f32)
            .z_loss_scale(self.o.q as f32)
            .softcap(self.o.cap as f32)
            .logit_scale(self.o.scale as f32);
        if let Some(w) = &self.weights {
            c = c.class_weights(TensorRef::vector(w));
        }
        c
    }
    fn gl_view(&self) -> TensorRef<'_> {
        if self.reduction == Reduction::None {
            TensorRef::vector(&self.gl)
        } else {
            TensorRef::scalar(&self.gl[0])
        }
    }
    fn ge_view(&self) -> TensorRef<'_> {
        if self.ge.len() == 1 {
            TensorRef::scalar(&self.ge[0])
        } else {
            TensorRef::vector(&self.ge)
        }
    }
    fn rows(&self, x: &[f64]) -> Vec<RowGrad> {
        (0..self.n).map(|i| row_grad(&self.o, &x[i * self.v..(i + 1) * self.v], self.targets[i])).collect()
    }
    /// The per-row weights (a, b) of Σ a_i·loss_i + Σ b_i·H_i, the function whose gradient dlogits is.
    fn weights_ab(&self) -> (Vec<f64>, Vec<f64>) {
        let a = match self.reduction {
            Reduction::None => widen(&self.gl),
            Reduction::Sum => vec![self.gl[0] as f64; self.n],
            Reduction::Mean => vec![self.gl[0] as f64 / self.o.denom(&self.targets); self.n],
        };
        let b = if self.ge.len() == 1 { vec![self.ge[0] as f64; self.n] } else { widen(&self.ge) };
        (a, b)
    }
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    // Odd V, defaults but per-row losses; an ignored row, a peaked row, a row with a −inf logit.
    {
        let (n, v) = (4, 37);
        let mut rng = Rng::new(101);
        let mut x = rng.f32s(n * v, -3.0, 3.0);
        x[2 * v + 7] = 40.0; // row 2: p ≈ one-hot at 7, H ≈ 0
        x[3] = f32::NEG_INFINITY; // row 0, not its target: p = 0 there, gradient 0
        out.push(Case {
            name: "defaults, V = 37",
            n,
            v,
            x,
            targets: vec![5, -100, 7, 36],
            reduction: Reduction::None,
            gl: rng.f32s(n, -1.5, 1.5),
            ge: rng.f32s(n, -2.0, 2.0),
            o: CeRef::default(),
            weights: None,
            finite: false,
        });
    }
    // Every option, V = 1031 (past any vector width, odd tail); ignored and peaked rows.
    {
        let (n, v) = (5, 1031);
        let mut rng = Rng::new(102);
        let mut x = rng.f32s(n * v, -4.0, 4.0);
        x[3 * v + 1030] = 60.0; // peaked after the softcap too (z ≈ 15 against |z| <= 3)
        let w = rng.f32s(v, 0.25, 2.0);
        out.push(Case {
            name: "every option, V = 1031",
            n,
            v,
            x,
            targets: vec![0, 1000, 517, 1030, 3],
            reduction: Reduction::None,
            gl: rng.f32s(n, -1.0, 2.0),
            ge: rng.f32s(n, -1.5, 1.5),
            o: CeRef { ignore_index: 1000, eps: 0.1, q: 1e-3, cap: 15.0, scale: 0.8, weights: Some(widen(&w)) },
            weights: Some(w),
            finite: true,
        });
    }
    // Mean with a scalar grad_loss and a broadcast scalar grad_entropy, V = 3; an ignored, a peaked row.
    {
        let (n, v) = (3, 3);
        let mut rng = Rng::new(103);
        let mut x = rng.f32s(n * v, -2.0, 2.0);
        x[2 * v] = 25.0;
        out.push(Case {
            name: "mean, V = 3",
            n,
            v,
            x,
            targets: vec![2, -100, 1],
            reduction: Reduction::Mean,
            gl: vec![0.7],
            ge: vec![-1.3],
            o: CeRef { scale: 1.7, ..Default::default() },
            weights: None,
            finite: true,
        });
    }
    out
}

/// The hand-derived reference is the gradient of Σ a_i·loss_i + Σ b_i·H_i: central finite differences of
/// the float64 loss and entropy (`CeRef::row` of the shared reference) agree with it.
#[test]
fn entropy_gradient_reference_matches_finite_differences() {
    for c in cases().into_iter().filter(|c| c.finite) {
        let xd = widen(&c.x);
        let (a, b) = c.weights_ab();
        let want = ref_dlogits(&c.rows(&xd), &a, &b, true);
        let rows_ref = c.o.rows(&xd, c.v, &c.targets);
        for (i, r) in c.rows(&xd).iter().enumerate() {
            assert_close(&format!("{} lse", c.name), &[r.lse], &[rows_ref[i].lse], 1e-12, 1e-12);
            assert_close(&format!("{} H", c.name), &[r.entropy], &[rows_ref[i].entropy], 1e-12, 1e-10);
            assert_close(&format!("{} loss", c.name), &[r.loss], &[rows_ref[i].loss], 1e-12, 1e-10);
        }
        let f = |y: &[f64]| -> f64 {
            c.o.rows(y, c.v, &c.targets).iter().enumerate().map(|(i, r)| a[i] * r.loss + b[i] * r.entropy).sum()
        };
        // Only the rows' own entries matter; one row at a time keeps this cheap at V = 1031.
        for i in 0..c.n {
            let row = &xd[i * c.v..(i + 1) * c.v];
            let g = fd_grad(row, |y| {
                let mut all = xd.clone();
                all[i * c.v..(i + 1) * c.v].copy_from_slice(y);
                f(&all)
            });
            assert_close(&format!("{} fd row {}", c.name, i), &want[i * c.v..(i + 1) * c.v], &g, 1e-7, 1e-5);
        }
    }
}

/// Fused forward with grad_loss and grad_entropy against the float64 reference; cross_entropy_bwd_ex
/// from the forward's lse and entropy gives the same bits, in place too; without grad_entropy it is
/// cross_entropy_bwd's bits.
#[test]
fn fused_and_bwd_ex_entropy_gradient() {
    let h = cpu();
    for c in cases() {
        let (n, v) = (c.n, c.v);
        let opts = c.options();
        let xm = TensorRef::matrix(&c.x, n, v).unwrap();
        let tv = TensorRef::vector(&c.targets);
        let mut loss = vec![f32::NAN; if c.reduction == Reduction::None { n } else { 1 }];
        // The fused forward saves the lse's pairs [N, 2] (the form whose backward has the fused bits);
        // a second forward the [N] lse.
        let mut pairs = vec![f32::NAN; 2 * n];
        let mut lse = vec![f32::NAN; n];
        let mut ent = vec![f32::NAN; n];
        let mut fused = vec![f32::NAN; n * v];
        for with_pairs in [true, false] {
            let lv = if c.reduction == Reduction::None {
                TensorMut::vector(&mut loss)
            } else {
                TensorMut::scalar(&mut loss[0])
            };
            let out = CeOutputs::new(lv);
            let mut out = if with_pairs {
                out.lse(TensorMut::lse_pairs(&mut pairs).unwrap())
                    .entropy(TensorMut::vector(&mut ent))
                    .dlogits(TensorMut::matrix(&mut fused, n, v).unwrap())
                    .grad_loss(c.gl_view())
                    .grad_entropy(c.ge_view())
            } else {
                out.lse(TensorMut::vector(&mut lse))
            };
            h.cross_entropy_fwd(&xm, &tv, &opts, &mut out)
                .unwrap_or_else(|e| panic!("{}: forward (pairs {}): {}", c.name, with_pairs, e));
        }
        let xd = widen(&c.x);
        let rows = c.rows(&xd);
        let (a, b) = c.weights_ab();
        assert_close(
            &format!("{} lse", c.name),
            &widen(&lse),
            &rows.iter().map(|r| r.lse).collect::<Vec<_>>(),
            1e-6,
            1e-6,
        );
        assert_close(
            &format!("{} lse of the pairs", c.name),
            &widen(&fusedce::lse_from_pairs(&pairs, 1.0).unwrap()),
            &widen(&lse),
            0.0,
            3e-7,
        );
        assert_close(
            &format!("{} entropy", c.name),
            &widen(&ent),
            &rows.iter().map(|r| r.entropy).collect::<Vec<_>>(),
            1e-5,
            1e-5,
        );
        let want = ref_dlogits(&rows, &a, &b, true);
        assert_close_to_max(&format!("{} fused dlogits", c.name), &widen(&fused), &want, 1e-5);
        // The entropy term is at least 100 times the tolerance: a library ignoring grad_entropy fails above.
        let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
        let term = max_diff(&want, &ref_dlogits(&rows, &a, &b, false));
        assert!(term > 1e-3 * scale, "{}: entropy term {:.3e} against max|ref| {:.3e}", c.name, term, scale);
        // The ignored row gets the entropy's gradient alone.
        if let Some(i) = c.targets.iter().position(|&t| t == c.o.ignore_index) {
            let got = widen(&fused[i * v..(i + 1) * v]);
            let only_h: Vec<f64> = rows[i].dent.iter().map(|d| b[i] * d).collect();
            assert!(got.iter().any(|&g| g != 0.0), "{}: ignored row has no entropy gradient", c.name);
            assert_close_to_max(&format!("{} ignored row", c.name), &got, &only_h, 1e-5);
        }
        if c.name.starts_with("defaults") {
            assert_eq!(fused[3], 0.0, "a -inf logit gets 0");
        }

        // bwd_ex from the forward's lse pairs and entropy: the fused bits.
        let lse_v = TensorRef::lse_pairs(&pairs).unwrap();
        let ent_v = TensorRef::vector(&ent);
        let inputs = CeBwdInputs::new(lse_v).grad_loss(c.gl_view()).entropy(ent_v).grad_entropy(c.ge_view());
        let mut dx = vec![f32::NAN; n * v];
        h.cross_entropy_bwd_ex(&xm, &tv, &inputs, &opts, &mut TensorMut::matrix(&mut dx, n, v).unwrap())
            .unwrap_or_else(|e| panic!("{}: bwd_ex: {}", c.name, e));
        assert_eq!(bits_of(&dx), bits_of(&fused), "{}: bwd_ex vs fused", c.name);
        // From the [N] lse: each p_j carries the fp32 lse's rounding (small logits here: within fp32's
        // bound of the fused gradient).
        let plain_inputs = CeBwdInputs { lse: TensorRef::vector(&lse), ..inputs };
        let mut dx_n = vec![f32::NAN; n * v];
        h.cross_entropy_bwd_ex(&xm, &tv, &plain_inputs, &opts, &mut TensorMut::matrix(&mut dx_n, n, v).unwrap())
            .unwrap_or_else(|e| panic!("{}: bwd_ex from [N]: {}", c.name, e));
        assert_close_to_max(&format!("{} bwd_ex from [N]", c.name), &widen(&dx_n), &widen(&fused), 1e-5);
        let mut y = c.x.clone();
        h.cross_entropy_bwd_ex_in_place(&mut TensorMut::matrix(&mut y, n, v).unwrap(), &tv, &inputs, &opts).unwrap();
        assert_eq!(bits_of(&y), bits_of(&fused), "{}: bwd_ex in place", c.name);
        let bytes = h
            .cross_entropy_bwd_ex_workspace_size(
                &xm,
                &tv,
                &inputs,
                &opts,
                &mut TensorMut::matrix(&mut dx, n, v).unwrap(),
            )
            .unwrap();
        assert!(bytes < 1 << 30, "{}: {} workspace bytes", c.name, bytes);

        // Without grad_entropy: cross_entropy_bwd's bits (the saved entropy is then not read), which
        // match the loss-only reference.
        let mut plain = vec![f32::NAN; n * v];
        h.cross_entropy_bwd(
            &xm,
            &tv,
            &lse_v,
            Some(&c.gl_view()),
            &opts,
            &mut TensorMut::matrix(&mut plain, n, v).unwrap(),
        )
        .unwrap();
        // With and without the (then unread) saved entropy.
        let with_entropy = CeBwdInputs { grad_entropy: None, ..inputs };
        for inputs in [CeBwdInputs::new(lse_v).grad_loss(c.gl_view()), with_entropy] {
            let mut d = vec![f32::NAN; n * v];
            h.cross_entropy_bwd_ex(&xm, &tv, &inputs, &opts, &mut TensorMut::matrix(&mut d, n, v).unwrap()).unwrap();
            assert_eq!(bits_of(&d), bits_of(&plain), "{}: bwd_ex without grad_entropy", c.name);
        }
        assert_close_to_max(
            &format!("{} loss-only dlogits", c.name),
            &widen(&plain),
            &ref_dlogits(&rows, &a, &b, false),
            1e-5,
        );
        let wsz_plain = h
            .cross_entropy_bwd_workspace_size(
                &xm,
                &tv,
                &lse_v,
                Some(&c.gl_view()),
                &opts,
                &mut TensorMut::matrix(&mut dx, n, v).unwrap(),
            )
            .unwrap();
        let wsz_ex = h
            .cross_entropy_bwd_ex_workspace_size(
                &xm,
                &tv,
                &CeBwdInputs::new(lse_v).grad_loss(c.gl_view()),
                &opts,
                &mut TensorMut::matrix(&mut dx, n, v).unwrap(),
            )
            .unwrap();
        assert_eq!(wsz_ex, wsz_plain, "{}: workspace of bwd_ex without grad_entropy", c.name);
    }
}

#[test]
fn entropy_gradient_misuse_is_refused_and_writes_nothing() {
    let h = cpu();
    let (n, v) = (3, 5);
    let mut rng = Rng::new(104);
    let x = rng.f32s(n * v, -2.0, 2.0);
    let targets = [0i64, 4, 2];
    let ge = [0.5f32, -1.0, 2.0];
    let xm = TensorRef::matrix(&x, n, v).unwrap();
    let tv = TensorRef::vector(&targets);
    let opts = CeOptions::default();
    let mut lse = vec![0f32; n];
    let mut ent = vec![0f32; n];
    let mut loss = 0f32;
    h.cross_entropy_fwd(
        &xm,
        &tv,
        &opts,
        &mut CeOutputs::new(TensorMut::scalar(&mut loss))
            .lse(TensorMut::vector(&mut lse))
            .entropy(TensorMut::vector(&mut ent)),
    )
    .unwrap();
    let poison = -7.25f32;
    let check_err = |r: fusedce::Result<()>, status: Status, needle: &str| {
        let e = r.expect_err(needle);
        assert_eq!(e.status(), status, "{}", e);
        assert!(e.message().contains(needle), "message {:?} lacks {:?}", e.message(), needle);
    };

    // bwd_ex: grad_entropy without the saved entropy.
    let mut dx = vec![poison; n * v];
    check_err(
        h.cross_entropy_bwd_ex(
            &xm,
            &tv,
            &CeBwdInputs::new(TensorRef::vector(&lse)).grad_entropy(TensorRef::vector(&ge)),
            &opts,
            &mut TensorMut::matrix(&mut dx, n, v).unwrap(),
        ),
        Status::INVALID_ARGUMENT,
        "entropy",
    );
    let mut y = x.clone();
    check_err(
        h.cross_entropy_bwd_ex_in_place(
            &mut TensorMut::matrix(&mut y, n, v).unwrap(),
            &tv,
            &CeBwdInputs::new(TensorRef::vector(&lse)).grad_entropy(TensorRef::vector(&ge)),
            &opts,
        ),
        Status::INVALID_ARGUMENT,
        "entropy",
    );
    assert_eq!(bits_of(&y), bits_of(&x), "in-place logits written by a refused call");
    let mut bytes = 0usize;
    check_err(
        h.cross_entropy_bwd_ex_workspace_size(
            &xm,
            &tv,
            &CeBwdInputs::new(TensorRef::vector(&lse)).grad_entropy(TensorRef::vector(&ge)),
            &opts,
            &mut TensorMut::matrix(&mut dx, n, v).unwrap(),
        )
        .map(|b| bytes = b),
        Status::INVALID_ARGUMENT,
        "entropy",
    );
    assert_eq!(bytes, 0);
    // A saved entropy or grad_entropy of the wrong length.
    check_err(
        h.cross_entropy_bwd_ex(
            &xm,
            &tv,
            &CeBwdInputs::new(TensorRef::vector(&lse))
                .entropy(TensorRef::vector(&ent[..2]))
                .grad_entropy(TensorRef::vector(&ge)),
            &opts,
            &mut TensorMut::matrix(&mut dx, n, v).unwrap(),
        ),
        Status::SHAPE_MISMATCH,
        "entropy",
    );
    check_err(
        h.cross_entropy_bwd_ex(
            &xm,
            &tv,
            &CeBwdInputs::new(TensorRef::vector(&lse))
                .entropy(TensorRef::vector(&ent))
                .grad_entropy(TensorRef::vector(&ge[..2])),
            &opts,
            &mut TensorMut::matrix(&mut dx, n, v).unwrap(),
        ),
        Status::SHAPE_MISMATCH,
        "grad_entropy",
    );
    // An int32 grad_entropy.
    let ge_int = [1i32, -1, 2];
    check_err(
        h.cross_entropy_bwd_ex(
            &xm,
            &tv,
            &CeBwdInputs::new(TensorRef::vector(&lse))
                .entropy(TensorRef::vector(&ent))
                .grad_entropy(TensorRef::vector(&ge_int)),
            &opts,
            &mut TensorMut::matrix(&mut dx, n, v).unwrap(),
        ),
        Status::UNSUPPORTED_DTYPE,
        "grad_entropy",
    );
    assert!(dx.iter().all(|&d| d == poison), "dlogits written by a refused call");

    // Fused forward: grad_entropy without dlogits.
    let mut loss2 = poison;
    let mut ent2 = vec![poison; n];
    check_err(
        h.cross_entropy_fwd(
            &xm,
            &tv,
            &opts,
            &mut CeOutputs::new(TensorMut::scalar(&mut loss2))
                .entropy(TensorMut::vector(&mut ent2))
                .grad_entropy(TensorRef::vector(&ge)),
        ),
        Status::INVALID_ARGUMENT,
        "grad_entropy",
    );
    assert_eq!(loss2, poison);
    assert!(ent2.iter().all(|&e| e == poison));

    // Linear cross-entropy: grad_entropy without a gradient output (forward), without saved_entropy
    // (backward).
    let hdim = 4;
    let hid = rng.f32s(n * hdim, -1.0, 1.0);
    let w = rng.f32s(v * hdim, -1.0, 1.0);
    let (hm, wm) = (TensorRef::matrix(&hid, n, hdim).unwrap(), TensorRef::matrix(&w, v, hdim).unwrap());
    let mut lossl = poison;
    check_err(
        h.linear_cross_entropy_fwd(
            &hm,
            &wm,
            None,
            &tv,
            &opts,
            &mut LinearCeOutputs::new(TensorMut::scalar(&mut lossl)).grad_entropy(TensorRef::vector(&ge)),
        ),
        Status::INVALID_ARGUMENT,
        "grad_entropy",
    );
    assert_eq!(lossl, poison);
    let mut dh = vec![poison; n * hdim];
    check_err(
        h.linear_cross_entropy_bwd(
            &hm,
            &wm,
            None,
            &tv,
            &TensorRef::vector(&lse),
            &opts,
            &mut LinearCeGrads::new()
                .dhidden(TensorMut::matrix(&mut dh, n, hdim).unwrap())
                .grad_entropy(TensorRef::vector(&ge)),
        ),
        Status::INVALID_ARGUMENT,
        "saved_entropy",
    );
    check_err(
        h.linear_cross_entropy_bwd(
            &hm,
            &wm,
            None,
            &tv,
            &TensorRef::vector(&lse),
            &opts,
            &mut LinearCeGrads::new()
                .dhidden(TensorMut::matrix(&mut dh, n, hdim).unwrap())
                .grad_entropy(TensorRef::vector(&ge))
                .saved_entropy(TensorRef::vector(&ent[..1])),
        ),
        Status::SHAPE_MISMATCH,
        "saved_entropy",
    );
    assert!(dh.iter().all(|&d| d == poison), "dhidden written by a refused call");

    // The vocabulary-parallel combine writes no gradient: grad_entropy is refused.
    let shard = CeOptions::new().vocab_start(0).vocab_total(v as i64);
    let k = fusedce::cross_entropy_record_fields(&shard).unwrap();
    let mut rec = vec![0f32; n * k];
    h.cross_entropy_partial(&xm, &tv, &shard, &mut TensorMut::matrix(&mut rec, n, k).unwrap()).unwrap();
    let mut lossc = poison;
    check_err(
        h.cross_entropy_combine(
            &TensorRef::new(&rec, &[1, n, k]).unwrap(),
            &tv,
            &shard,
            &mut CeOutputs::new(TensorMut::scalar(&mut lossc)).grad_entropy(TensorRef::vector(&ge)),
        ),
        Status::INVALID_ARGUMENT,
        "grad_entropy",
    );
    assert_eq!(lossc, poison);
}

/// Linear cross-entropy with grad_loss `[N]` and grad_entropy `[N]`: the forward's gradients and the
/// backward's (from the saved lse and entropy) against dlogits (float64, as above) chained through the
/// GEMM: dhidden = dlogits·W, dweight = dlogitsᵀ·h, dbias = Σ_rows dlogits.
#[test]
fn linear_cross_entropy_entropy_gradient() {
    let (n, hdim, v) = (6, 7, 13);
    let mut rng = Rng::new(105);
    let mut hid = rng.f32s(n * hdim, -1.0, 1.0);
    let w = rng.f32s(v * hdim, -1.0, 1.0);
    let bias = rng.f32s(v, -0.5, 0.5);
    // Row 4 peaked: its hidden state is 8 times the weight row of class 9.
    for c in 0..hdim {
        hid[4 * hdim + c] = 8.0 * w[9 * hdim + c];
    }
    let targets: Vec<i64> = vec![3, 12, -100, 0, 9, 5];
    let gl = rng.f32s(n, -1.0, 2.0);
    let ge = rng.f32s(n, -2.0, 2.0);
    let opts = CeOptions::new()
        .reduction(Reduction::None)
        .label_smoothing(0.05)
        .z_loss_scale(1e-3)
        .softcap(10.0)
        .logit_scale(1.2);
    let o = CeRef { eps: 0.05, q: 1e-3, cap: 10.0, scale: 1.2, ..Default::default() };

    // float64 reference.
    let (hd, wd, bd) = (widen(&hid), widen(&w), widen(&bias));
    let mut logits = vec![0.0f64; n * v];
    for i in 0..n {
        for j in 0..v {
            logits[i * v + j] = bd[j] + (0..hdim).map(|c| hd[i * hdim + c] * wd[j * hdim + c]).sum::<f64>();
        }
    }
    let rows: Vec<RowGrad> = (0..n).map(|i| row_grad(&o, &logits[i * v..(i + 1) * v], targets[i])).collect();
    let chain = |with_entropy: bool| -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let dz = ref_dlogits(&rows, &widen(&gl), &widen(&ge), with_entropy);
        let mut dh = vec![0.0; n * hdim];
        let mut dw = vec![0.0; v * hdim];
        let mut db = vec![0.0; v];
        for i in 0..n {
            for j in 0..v {
                let g = dz[i * v + j];
                db[j] += g;
                for c in 0..hdim {
                    dh[i * hdim + c] += g * wd[j * hdim + c];
                    dw[j * hdim + c] += g * hd[i * hdim + c];
                }
            }
        }
        (dh, dw, db)
    };
    let (rh, rw, rb) = chain(true);
    let (ph, pw, pb) = chain(false);
    // The entropy term is at least 100 times the tolerance in every gradient.
    for (what, a, b) in [("dhidden", &rh, &ph), ("dweight", &rw, &pw), ("dbias", &rb, &pb)] {
        let scale = a.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        assert!(max_diff(a, b) > 1e-3 * scale, "{}: entropy term too small to test", what);
    }

    let h = cpu();
    let (hm, wm, bv, tv) = (
        TensorRef::matrix(&hid, n, hdim).unwrap(),
        TensorRef::matrix(&w, v, hdim).unwrap(),
        TensorRef::vector(&bias),
        TensorRef::vector(&targets),
    );
    let mut loss = vec![f32::NAN; n];
    let mut lse = vec![f32::NAN; n];
    let mut ent = vec![f32::NAN; n];
    let mut dh = vec![f32::NAN; n * hdim];
    let mut dw = vec![f32::NAN; v * hdim];
    let mut db = vec![f32::NAN; v];
    h.linear_cross_entropy_fwd(
        &hm,
        &wm,
        Some(&bv),
        &tv,
        &opts,
        &mut LinearCeOutputs::new(TensorMut::vector(&mut loss))
            .lse(TensorMut::vector(&mut lse))
            .entropy(TensorMut::vector(&mut ent))
            .dhidden(TensorMut::matrix(&mut dh, n, hdim).unwrap())
            .dweight(TensorMut::matrix(&mut dw, v, hdim).unwrap())
            .dbias(TensorMut::vector(&mut db))
            .grad_loss(TensorRef::vector(&gl))
            .grad_entropy(TensorRef::vector(&ge)),
    )
    .unwrap();
    assert_close("loss", &widen(&loss), &rows.iter().map(|r| r.loss).collect::<Vec<_>>(), 1e-5, 1e-5);
    assert_close("entropy", &widen(&ent), &rows.iter().map(|r| r.entropy).collect::<Vec<_>>(), 1e-5, 1e-5);
    assert_close_to_max("fwd dhidden", &widen(&dh), &rh, 1e-5);
    assert_close_to_max("fwd dweight", &widen(&dw), &rw, 1e-5);
    assert_close_to_max("fwd dbias", &widen(&db), &rb, 1e-5);

    // Backward from the saved lse and entropy.
    let mut dh2 = vec![f32::NAN; n * hdim];
    let mut dw2 = vec![f32::NAN; v * hdim];
    let mut db2 = vec![f32::NAN; v];
    h.linear_cross_entropy_bwd(
        &hm,
        &wm,
        Some(&bv),
        &tv,
        &TensorRef::vector(&lse),
        &opts,
        &mut LinearCeGrads::new()
            .dhidden(TensorMut::matrix(&mut dh2, n, hdim).unwrap())
            .dweight(TensorMut::matrix(&mut dw2, v, hdim).unwrap())
            .dbias(TensorMut::vector(&mut db2))
            .grad_loss(TensorRef::vector(&gl))
            .grad_entropy(TensorRef::vector(&ge))
            .saved_entropy(TensorRef::vector(&ent)),
    )
    .unwrap();
    assert_close_to_max("bwd dhidden", &widen(&dh2), &rh, 1e-5);
    assert_close_to_max("bwd dweight", &widen(&dw2), &rw, 1e-5);
    assert_close_to_max("bwd dbias", &widen(&db2), &rb, 1e-5);
    // The backward's workspace query accepts the same arguments.
    let bytes = h
        .linear_cross_entropy_bwd_workspace_size(
            &hm,
            &wm,
            Some(&bv),
            &tv,
            &TensorRef::vector(&lse),
            &opts,
            &mut LinearCeGrads::new()
                .dhidden(TensorMut::matrix(&mut dh2, n, hdim).unwrap())
                .grad_entropy(TensorRef::vector(&ge))
                .saved_entropy(TensorRef::vector(&ent)),
        )
        .unwrap();
    assert!(bytes > 0 && bytes < 1 << 30, "{}", bytes);
}
