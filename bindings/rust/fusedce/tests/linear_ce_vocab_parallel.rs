//! Vocabulary-parallel linear cross-entropy (`linear_cross_entropy_partial`, `cross_entropy_combine`, a
//! shard's `linear_cross_entropy_bwd`) on the CPU backend: an LM head split by rows into 2 and 3 uneven
//! shards (the last padded with NaN rows, which nothing may read), records stacked in rank order, combined,
//! and each shard's gradients (its dweight and dbias rows, its fp32 part of dhidden, summed over the ranks)
//! against the unsharded `linear_cross_entropy_fwd` (itself checked here against float64); bf16 inputs;
//! then the statuses of bad inputs.
#[path = "support/reference.rs"]
mod reference;

use fusedce::{
    bits, CeOptions, CeOutputs, DType, Error, Handle, LinearCeGrads, LinearCeOutputs, Reduction, Status, TensorMut,
    TensorRef,
};
use reference::*;

fn cpu() -> Handle {
    Handle::cpu().expect("CPU handle")
}

fn expect_err(r: fusedce::Result<()>, status: Status, needle: &str) -> Error {
    let e = r.expect_err("the call should fail");
    assert_eq!(e.status(), status, "{}", e);
    assert!(e.message().contains(needle), "message {:?} should mention {:?}", e.message(), needle);
    e
}

/// `[N]` for Reduction::None, else a scalar.
fn loss_view(per_row: bool, l: &mut [f32]) -> TensorMut<'_> {
    if per_row {
        TensorMut::vector(l)
    } else {
        TensorMut::scalar(&mut l[0])
    }
}

fn bits32(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Marks record slots that a call left unwritten.
const UNWRITTEN: f32 = -7.25e30;

/// hidden [N, H] · weight [V, H]ᵀ + bias, in float64.
fn logits(hid: &[f64], w: &[f64], b: &[f64], n: usize, hd: usize, v: usize) -> Vec<f64> {
    let mut out = vec![0.0; n * v];
    for i in 0..n {
        for j in 0..v {
            out[i * v + j] = b[j] + (0..hd).map(|c| hid[i * hd + c] * w[j * hd + c]).sum::<f64>();
        }
    }
    out
}

#[test]
fn sharded_linear_ce_matches_the_unsharded_call() {
    let (n, hd, v) = (7, 12, 41);
    let mut rng = Rng::new(4112);
    let mut hidden = rng.f32s(n * hd, -1.0, 1.0);
    let weight = rng.f32s(v * hd, -1.0, 1.0);
    let bias = rng.f32s(v, -0.5, 0.5);
    // Row 4 peaked on class 20, so that one row's probability is concentrated in one shard.
    for c in 0..hd {
        hidden[4 * hd + c] = 3.0 * weight[20 * hd + c];
    }
    // Both sides of the shard boundaries, both ends of the vocabulary, an ignored row.
    let targets: Vec<i64> = vec![8, 9, 0, 40, 20, -100, 27];
    let ignored = 5;
    let cw: Vec<f32> = rng.f32s(v, 0.2, 2.0);
    let gl_rows = rng.f32s(n, -1.0, 2.0);
    let ge_rows = rng.f32s(n, -1.5, 1.5);
    let gl_scalar = 0.75f32;

    let layouts = [
        Layout::new("uneven [9, 32 + 3]", &[9, 32], &[0, 3]),
        // Equal widths of 14: the last shard holds global rows 28..40 and one NaN padding row.
        Layout::new("padded [14, 14, 13 + 1]", &[14, 14, 13], &[0, 0, 1]),
        Layout::new("uneven [20, 3, 18 + 5]", &[20, 3, 18], &[0, 0, 5]),
    ];
    struct Case<'a> {
        name: &'static str,
        opts: CeOptions<'a>,
        grad_loss: Option<TensorRef<'a>>,
        grad_entropy: Option<TensorRef<'a>>,
    }
    let cases = [
        Case { name: "defaults (mean)", opts: CeOptions::new(), grad_loss: None, grad_entropy: None },
        Case {
            name: "none, smoothing, z-loss, softcap, grad_loss and grad_entropy [N]",
            opts: CeOptions::new().reduction(Reduction::None).label_smoothing(0.1).z_loss_scale(1e-3).softcap(3.0),
            grad_loss: Some(TensorRef::vector(&gl_rows)),
            grad_entropy: Some(TensorRef::vector(&ge_rows)),
        },
        Case {
            name: "sum, class weights, logit scale, grad_loss 0.75",
            opts: CeOptions::new().reduction(Reduction::Sum).class_weights(TensorRef::vector(&cw)).logit_scale(1.5),
            grad_loss: Some(TensorRef::scalar(&gl_scalar)),
            grad_entropy: None,
        },
    ];
    let h = cpu();
    let (hm, tv) = (TensorRef::matrix(&hidden, n, hd).unwrap(), TensorRef::vector(&targets));
    let x64 = logits(&widen(&hidden), &widen(&weight), &widen(&bias), n, hd, v);

    for case in &cases {
        let base = case.opts;
        let per_row = base.reduction == Reduction::None;
        let loss_len = if per_row { n } else { 1 };

        // The unsharded forward, with every statistic and gradient.
        let mut loss = vec![0f32; loss_len];
        let mut zl = vec![0f32; loss_len];
        let mut lse = vec![0f32; n];
        let mut am = vec![0i64; n];
        let mut ent = vec![0f32; n];
        let mut dh = vec![0f32; n * hd];
        let mut dw = vec![0f32; v * hd];
        let mut db = vec![0f32; v];
        {
            let mut outs = LinearCeOutputs::new(loss_view(per_row, &mut loss))
                .z_loss(loss_view(per_row, &mut zl))
                .lse(TensorMut::vector(&mut lse))
                .argmax(TensorMut::vector(&mut am))
                .entropy(TensorMut::vector(&mut ent))
                .dhidden(TensorMut::matrix(&mut dh, n, hd).unwrap())
                .dweight(TensorMut::matrix(&mut dw, v, hd).unwrap())
                .dbias(TensorMut::vector(&mut db));
            outs.grad_loss = case.grad_loss;
            outs.grad_entropy = case.grad_entropy;
            h.linear_cross_entropy_fwd(
                &hm,
                &TensorRef::matrix(&weight, v, hd).unwrap(),
                Some(&TensorRef::vector(&bias)),
                &tv,
                &base,
                &mut outs,
            )
            .unwrap();
        }
        // ... its lse and argmax against float64, so that the comparisons below compare something.
        let s = base.logit_scale as f64;
        let z = |i: usize| -> Vec<f64> {
            x64[i * v..(i + 1) * v]
                .iter()
                .map(|&a| {
                    let a = s * a;
                    if base.softcap > 0.0 {
                        base.softcap as f64 * (a / base.softcap as f64).tanh()
                    } else {
                        a
                    }
                })
                .collect()
        };
        let want_lse: Vec<f64> = (0..n).map(|i| logsumexp(&z(i))).collect();
        let want_am: Vec<i64> = (0..n).map(|i| argmax(&x64[i * v..(i + 1) * v]) as i64).collect();
        assert_close(&format!("{}: unsharded lse vs float64", case.name), &widen(&lse), &want_lse, 1e-6, 1e-5);
        assert_eq!(am, want_am, "{}: unsharded argmax vs float64", case.name);
        assert_eq!(am[4], 20, "row 4 should peak on class 20");
        assert!(dh.iter().filter(|g| g.abs() > 1e-3).count() > n * hd / 2, "{}: trivial dhidden", case.name);
        assert!(dw.iter().filter(|g| g.abs() > 1e-4).count() > v * hd / 2, "{}: trivial dweight", case.name);

        for lay in &layouts {
            let what = |x: &str| format!("{} / {}: {}", case.name, lay.name, x);
            let w = lay.ranks();
            assert_eq!(lay.widths.iter().sum::<usize>(), v, "{}", what("the shards cover the vocabulary"));
            let shard_opts = |r: usize| base.vocab_start(lay.starts[r] as i64).vocab_total(v as i64);
            let ws: Vec<Vec<f32>> = (0..w).map(|r| lay.shard_rows(&weight, hd, r, f32::NAN)).collect();
            let bs: Vec<Vec<f32>> = (0..w).map(|r| lay.shard_rows(&bias, 1, r, f32::NAN)).collect();
            let k = fusedce::cross_entropy_record_fields(&shard_opts(0)).unwrap();
            assert_eq!(k, 9);

            // 1. partial per rank, written straight into its slot of the stacked [W, N, K] records.
            let mut records = vec![UNWRITTEN; w * n * k];
            for (r, rec) in records.chunks_mut(n * k).enumerate() {
                h.linear_cross_entropy_partial(
                    &hm,
                    &TensorRef::matrix(&ws[r], lay.rows(r), hd).unwrap(),
                    Some(&TensorRef::vector(&bs[r])),
                    &tv,
                    &shard_opts(r),
                    &mut TensorMut::matrix(rec, n, k).unwrap(),
                )
                .unwrap();
            }
            assert!(records.iter().all(|&x| x != UNWRITTEN), "{}", what("records left unwritten"));
            assert!(records.iter().all(|x| !x.is_nan()), "{}", what("NaN in the records (padding read?)"));
            for (r, rec) in records.chunks(n * k).enumerate() {
                let want = (lay.starts[r] as i64, (lay.starts[r] + lay.widths[r]) as i64);
                assert!(rec.chunks(k).all(|f| range_of(f, 4) == want), "{}", what("records' column ranges"));
            }

            // The same records through a caller workspace of the queried size (the last rank's).
            let last = w - 1;
            let mut rec2 = vec![UNWRITTEN; n * k];
            let wm = TensorRef::matrix(&ws[last], lay.rows(last), hd).unwrap();
            let bv = TensorRef::vector(&bs[last]);
            let bytes = h
                .linear_cross_entropy_partial_workspace_size(
                    &hm,
                    &wm,
                    Some(&bv),
                    &tv,
                    &shard_opts(last),
                    &mut TensorMut::matrix(&mut rec2, n, k).unwrap(),
                )
                .unwrap();
            assert!(bytes > 0, "{}", what("partial workspace"));
            let mut buf = vec![0u8; bytes + fusedce::WORKSPACE_ALIGNMENT];
            let off = buf.as_ptr().align_offset(fusedce::WORKSPACE_ALIGNMENT);
            let mut h2 = cpu();
            unsafe { h2.set_workspace(buf.as_mut_ptr().add(off) as *mut std::ffi::c_void, bytes) };
            h2.linear_cross_entropy_partial(
                &hm,
                &wm,
                Some(&bv),
                &tv,
                &shard_opts(last),
                &mut TensorMut::matrix(&mut rec2, n, k).unwrap(),
            )
            .unwrap();
            h2.clear_workspace();
            assert_eq!(bits32(&rec2), bits32(&records[last * n * k..]), "{}", what("records with a caller workspace"));

            // 3. combine (vocab_start is not read: any rank's options do).
            let mut closs = vec![0f32; loss_len];
            let mut czl = vec![0f32; loss_len];
            let mut clse = vec![0f32; n];
            let mut cam = vec![0i64; n];
            let mut cent = vec![0f32; n];
            h.cross_entropy_combine(
                &TensorRef::new(&records, &[w, n, k]).unwrap(),
                &tv,
                &shard_opts(last),
                &mut CeOutputs::new(loss_view(per_row, &mut closs))
                    .z_loss(loss_view(per_row, &mut czl))
                    .lse(TensorMut::vector(&mut clse))
                    .argmax(TensorMut::vector(&mut cam))
                    .entropy(TensorMut::vector(&mut cent)),
            )
            .unwrap();
            assert_close(&what("loss"), &widen(&closs), &widen(&loss), 1e-6, 1e-4);
            assert_close(&what("z_loss"), &widen(&czl), &widen(&zl), 1e-7, 1e-4);
            assert_close(&what("lse"), &widen(&clse), &widen(&lse), 1e-6, 1e-4);
            assert_close(&what("entropy"), &widen(&cent), &widen(&ent), 1e-6, 1e-4);
            assert_eq!(cam, am, "{}", what("argmax"));
            if per_row {
                assert_eq!(closs[ignored], 0.0, "{}", what("ignored row's loss"));
            }
            // The combined lse's pairs [N, 2], which the shards' backward takes.
            let mut cpairs = vec![f32::NAN; 2 * n];
            let mut closs2 = vec![0f32; loss_len];
            h.cross_entropy_combine(
                &TensorRef::new(&records, &[w, n, k]).unwrap(),
                &tv,
                &shard_opts(0),
                &mut CeOutputs::new(loss_view(per_row, &mut closs2)).lse(TensorMut::lse_pairs(&mut cpairs).unwrap()),
            )
            .unwrap();
            let pair_lse = fusedce::lse_from_pairs(&cpairs, 1.0).unwrap();
            assert_close(&what("lse of the pairs"), &widen(&pair_lse), &widen(&clse), 0.0, 3e-7);

            // 4. each shard's backward from the combined lse's pairs (and entropy): its dweight and dbias rows,
            // 0 in the padding (the outputs start at 7 so that unwritten elements show), and its fp32
            // part of dhidden, summed over the ranks.
            let mut dh_sum = vec![0f64; n * hd];
            for r in 0..w {
                let (st, wd, rows) = (lay.starts[r], lay.widths[r], lay.rows(r));
                let mut dhp = vec![7f32; n * hd];
                let mut dws = vec![7f32; rows * hd];
                let mut dbs = vec![7f32; rows];
                let mut grads = LinearCeGrads::new()
                    .dhidden(TensorMut::matrix(&mut dhp, n, hd).unwrap())
                    .dweight(TensorMut::matrix(&mut dws, rows, hd).unwrap())
                    .dbias(TensorMut::vector(&mut dbs));
                grads.grad_loss = case.grad_loss;
                if let Some(ge) = case.grad_entropy {
                    grads = grads.grad_entropy(ge).saved_entropy(TensorRef::vector(&cent));
                }
                h.linear_cross_entropy_bwd(
                    &hm,
                    &TensorRef::matrix(&ws[r], rows, hd).unwrap(),
                    Some(&TensorRef::vector(&bs[r])),
                    &tv,
                    &TensorRef::lse_pairs(&cpairs).unwrap(),
                    &shard_opts(r),
                    &mut grads,
                )
                .unwrap();
                assert!(dhp.iter().all(|g| g.is_finite()), "{}", what(&format!("shard {} dhidden", r)));
                for (acc, &g) in dh_sum.iter_mut().zip(&dhp) {
                    *acc += g as f64;
                }
                assert_close(
                    &what(&format!("shard {} dweight", r)),
                    &widen(&dws[..wd * hd]),
                    &widen(&dw[st * hd..(st + wd) * hd]),
                    1e-6,
                    1e-4,
                );
                assert_close(
                    &what(&format!("shard {} dbias", r)),
                    &widen(&dbs[..wd]),
                    &widen(&db[st..st + wd]),
                    1e-6,
                    1e-4,
                );
                assert!(
                    dws[wd * hd..].iter().all(|&g| g == 0.0),
                    "{}: padding dweight {:?}",
                    what(&format!("shard {}", r)),
                    &dws[wd * hd..]
                );
                assert!(
                    dbs[wd..].iter().all(|&g| g == 0.0),
                    "{}: padding dbias {:?}",
                    what(&format!("shard {}", r)),
                    &dbs[wd..]
                );

                // The backward's workspace query accepts the shard too.
                let mut dhq = vec![0f32; n * hd];
                let bytes = h
                    .linear_cross_entropy_bwd_workspace_size(
                        &hm,
                        &TensorRef::matrix(&ws[r], rows, hd).unwrap(),
                        Some(&TensorRef::vector(&bs[r])),
                        &tv,
                        &TensorRef::vector(&clse),
                        &shard_opts(r),
                        &mut LinearCeGrads::new().dhidden(TensorMut::matrix(&mut dhq, n, hd).unwrap()),
                    )
                    .unwrap();
                assert!(bytes > 0, "{}", what("bwd workspace"));
            }
            assert_close(&what("dhidden (sum of the shards' parts)"), &dh_sum, &widen(&dh), 1e-6, 1e-4);
            if case.grad_entropy.is_none() {
                let row = &dh_sum[ignored * hd..(ignored + 1) * hd];
                assert!(row.iter().all(|&g| g == 0.0), "{}", what("ignored row's dhidden"));
            }
        }
    }
}

/// bf16 inputs: the shards' logits are rounded to bf16 as the unsharded call's are, so the combined loss
/// and lse match it to fp32 rounding; the fp32 dhidden parts, summed and rounded once, match the
/// unsharded bf16 dhidden to bf16 rounding.
#[test]
fn sharded_linear_ce_bf16() {
    let (n, hd, v) = (7, 12, 41);
    let mut rng = Rng::new(4113);
    let hb: Vec<u16> = rng.f32s(n * hd, -1.0, 1.0).into_iter().map(bits::f32_to_bf16).collect();
    let wb: Vec<u16> = rng.f32s(v * hd, -1.0, 1.0).into_iter().map(bits::f32_to_bf16).collect();
    let targets: Vec<i32> = vec![0, 40, 13, 14, -100, 26, 27];
    let nan = bits::f32_to_bf16(f32::NAN);
    let dec = |x: &[u16]| x.iter().map(|&b| bits::bf16_to_f32(b) as f64).collect::<Vec<_>>();
    let h = cpu();
    let hm = TensorRef::from_bits(&hb, DType::BF16, &[n, hd]).unwrap();
    let tv = TensorRef::vector(&targets);
    let base = CeOptions::new();

    let mut loss = 0f32;
    let mut lse = vec![0f32; n];
    let mut dhb = vec![0u16; n * hd];
    let mut dwb = vec![0u16; v * hd];
    h.linear_cross_entropy_fwd(
        &hm,
        &TensorRef::from_bits(&wb, DType::BF16, &[v, hd]).unwrap(),
        None,
        &tv,
        &base,
        &mut LinearCeOutputs::new(TensorMut::scalar(&mut loss))
            .lse(TensorMut::vector(&mut lse))
            .dhidden(TensorMut::from_bits(&mut dhb, DType::BF16, &[n, hd]).unwrap())
            .dweight(TensorMut::from_bits(&mut dwb, DType::BF16, &[v, hd]).unwrap()),
    )
    .unwrap();

    let lay = Layout::new("padded [14, 14, 13 + 1]", &[14, 14, 13], &[0, 0, 1]);
    let w = lay.ranks();
    let k = fusedce::cross_entropy_record_fields(&base).unwrap();
    let shard_opts = |r: usize| base.vocab_start(lay.starts[r] as i64).vocab_total(v as i64);
    let ws: Vec<Vec<u16>> = (0..w).map(|r| lay.shard_rows(&wb, hd, r, nan)).collect();
    let mut records = vec![UNWRITTEN; w * n * k];
    for (r, rec) in records.chunks_mut(n * k).enumerate() {
        h.linear_cross_entropy_partial(
            &hm,
            &TensorRef::from_bits(&ws[r], DType::BF16, &[lay.rows(r), hd]).unwrap(),
            None,
            &tv,
            &shard_opts(r),
            &mut TensorMut::matrix(rec, n, k).unwrap(),
        )
        .unwrap();
    }
    let mut closs = 0f32;
    let mut cpairs = vec![0f32; 2 * n];
    h.cross_entropy_combine(
        &TensorRef::new(&records, &[w, n, k]).unwrap(),
        &tv,
        &shard_opts(0),
        &mut CeOutputs::new(TensorMut::scalar(&mut closs)).lse(TensorMut::lse_pairs(&mut cpairs).unwrap()),
    )
    .unwrap();
    let clse = fusedce::lse_from_pairs(&cpairs, 1.0).unwrap();
    assert_close("bf16 loss", &[closs as f64], &[loss as f64], 1e-6, 1e-4);
    assert_close("bf16 lse", &widen(&clse), &widen(&lse), 1e-6, 1e-4);

    let mut dh_sum = vec![0f32; n * hd];
    for (r, wr) in ws.iter().enumerate() {
        let (st, wd, rows) = (lay.starts[r], lay.widths[r], lay.rows(r));
        let mut dhp = vec![7f32; n * hd];
        let mut dws = vec![bits::f32_to_bf16(7.0); rows * hd];
        h.linear_cross_entropy_bwd(
            &hm,
            &TensorRef::from_bits(wr, DType::BF16, &[rows, hd]).unwrap(),
            None,
            &tv,
            &TensorRef::lse_pairs(&cpairs).unwrap(),
            &shard_opts(r),
            &mut LinearCeGrads::new()
                .dhidden(TensorMut::matrix(&mut dhp, n, hd).unwrap())
                .dweight(TensorMut::from_bits(&mut dws, DType::BF16, &[rows, hd]).unwrap()),
        )
        .unwrap();
        for (acc, &g) in dh_sum.iter_mut().zip(&dhp) {
            *acc += g;
        }
        // bf16 dweight rows: a bf16 ulp or so (the dlogits are rounded to bf16 before the GEMM).
        assert_close(
            &format!("bf16 shard {} dweight", r),
            &dec(&dws[..wd * hd]),
            &dec(&dwb[st * hd..(st + wd) * hd]),
            1e-3,
            1e-2,
        );
        assert!(dws[wd * hd..].iter().all(|&g| g == 0), "bf16 shard {}: padding dweight", r);
    }
    let dh_round: Vec<u16> = dh_sum.iter().map(|&g| bits::f32_to_bf16(g)).collect();
    assert_close("bf16 dhidden (sum rounded once)", &dec(&dh_round), &dec(&dhb), 1e-3, 1e-2);
}

#[test]
fn sharded_linear_ce_bad_inputs() {
    let h = cpu();
    let (n, hd, v, vt) = (3, 4, 5, 9);
    let mut rng = Rng::new(4114);
    let hidden = rng.f32s(n * hd, -1.0, 1.0);
    let weight = rng.f32s(v * hd, -1.0, 1.0);
    let targets = [1i64, 3, 4];
    let hm = TensorRef::matrix(&hidden, n, hd).unwrap();
    let wm = TensorRef::matrix(&weight, v, hd).unwrap();
    let tv = TensorRef::vector(&targets);
    // Rank 1 of [4, 5]: global rows 4..8.
    let shard = CeOptions::new().vocab_start(4).vocab_total(vt);
    let unsharded = CeOptions::new();
    let k = fusedce::cross_entropy_record_fields(&shard).unwrap();
    let mut rec = vec![-1f32; n * k];
    let mut loss = -1f32;

    // The unsharded forward refuses a shard (INVALID_ARGUMENT, no longer NOT_IMPLEMENTED), as does its
    // workspace query.
    expect_err(
        h.linear_cross_entropy_fwd(
            &hm,
            &wm,
            None,
            &tv,
            &shard,
            &mut LinearCeOutputs::new(TensorMut::scalar(&mut loss)),
        ),
        Status::INVALID_ARGUMENT,
        "vocab_total",
    );
    let e = h
        .linear_cross_entropy_fwd_workspace_size(
            &hm,
            &wm,
            None,
            &tv,
            &shard,
            &mut LinearCeOutputs::new(TensorMut::scalar(&mut loss)),
        )
        .unwrap_err();
    assert_eq!(e.status(), Status::INVALID_ARGUMENT, "{}", e);
    assert_eq!(loss, -1.0, "a failed call wrote the loss");

    // The partial call needs a shard ...
    expect_err(
        h.linear_cross_entropy_partial(
            &hm,
            &wm,
            None,
            &tv,
            &unsharded,
            &mut TensorMut::matrix(&mut rec, n, k).unwrap(),
        ),
        Status::INVALID_ARGUMENT,
        "vocab_total",
    );
    let e = h
        .linear_cross_entropy_partial_workspace_size(
            &hm,
            &wm,
            None,
            &tv,
            &unsharded,
            &mut TensorMut::matrix(&mut rec, n, k).unwrap(),
        )
        .unwrap_err();
    assert_eq!(e.status(), Status::INVALID_ARGUMENT, "{}", e);
    // ... with vocab_start inside [0, vocab_total] (vocab_total itself: a shard of padding alone) ...
    expect_err(
        h.linear_cross_entropy_partial(
            &hm,
            &wm,
            None,
            &tv,
            &shard.vocab_start(vt + 1),
            &mut TensorMut::matrix(&mut rec, n, k).unwrap(),
        ),
        Status::INVALID_ARGUMENT,
        "vocab_start",
    );
    // ... records [N, K] ...
    expect_err(
        h.linear_cross_entropy_partial(
            &hm,
            &wm,
            None,
            &tv,
            &shard,
            &mut TensorMut::matrix(&mut rec[..n * (k - 1)], n, k - 1).unwrap(),
        ),
        Status::SHAPE_MISMATCH,
        "records",
    );
    // ... and a bias of the shard's rows.
    let short_bias = [0f32; 4];
    expect_err(
        h.linear_cross_entropy_partial(
            &hm,
            &wm,
            Some(&TensorRef::vector(&short_bias)),
            &tv,
            &shard,
            &mut TensorMut::matrix(&mut rec, n, k).unwrap(),
        ),
        Status::SHAPE_MISMATCH,
        "bias",
    );
    assert!(rec.iter().all(|&r| r == -1.0), "a failed call wrote records");
    h.linear_cross_entropy_partial(&hm, &wm, None, &tv, &shard, &mut TensorMut::matrix(&mut rec, n, k).unwrap())
        .unwrap();
    assert!(rec.iter().all(|&r| r != -1.0), "records not written");
    let lse = [2.5f32; 3];
    let lv = TensorRef::vector(&lse);

    // A shard's dhidden must be fp32 (its part of a sum over ranks): bf16 or fp16 is UNSUPPORTED_DTYPE,
    // with fp32 inputs ...
    let poison = 0x7e7e_u16;
    for dt in [DType::BF16, DType::F16] {
        let mut dh16 = vec![poison; n * hd];
        expect_err(
            h.linear_cross_entropy_bwd(
                &hm,
                &wm,
                None,
                &tv,
                &lv,
                &shard,
                &mut LinearCeGrads::new().dhidden(TensorMut::from_bits(&mut dh16, dt, &[n, hd]).unwrap()),
            ),
            Status::UNSUPPORTED_DTYPE,
            "dhidden",
        );
        assert!(dh16.iter().all(|&d| d == poison), "{:?}: a failed call wrote dhidden", dt);
        // (the unsharded backward takes it)
        h.linear_cross_entropy_bwd(
            &hm,
            &wm,
            None,
            &tv,
            &lv,
            &unsharded,
            &mut LinearCeGrads::new().dhidden(TensorMut::from_bits(&mut dh16, dt, &[n, hd]).unwrap()),
        )
        .unwrap();
        assert!(dh16.iter().any(|&d| d != poison), "{:?}: unsharded dhidden not written", dt);
    }
    // ... and with bf16 inputs, whose dhidden would otherwise be bf16 too; the query refuses it as well.
    let hb: Vec<u16> = hidden.iter().map(|&x| bits::f32_to_bf16(x)).collect();
    let wb: Vec<u16> = weight.iter().map(|&x| bits::f32_to_bf16(x)).collect();
    let hbm = TensorRef::from_bits(&hb, DType::BF16, &[n, hd]).unwrap();
    let wbm = TensorRef::from_bits(&wb, DType::BF16, &[v, hd]).unwrap();
    let mut dhb = vec![poison; n * hd];
    expect_err(
        h.linear_cross_entropy_bwd(
            &hbm,
            &wbm,
            None,
            &tv,
            &lv,
            &shard,
            &mut LinearCeGrads::new().dhidden(TensorMut::from_bits(&mut dhb, DType::BF16, &[n, hd]).unwrap()),
        ),
        Status::UNSUPPORTED_DTYPE,
        "dhidden",
    );
    let e = h
        .linear_cross_entropy_bwd_workspace_size(
            &hbm,
            &wbm,
            None,
            &tv,
            &lv,
            &shard,
            &mut LinearCeGrads::new().dhidden(TensorMut::from_bits(&mut dhb, DType::BF16, &[n, hd]).unwrap()),
        )
        .unwrap_err();
    assert_eq!(e.status(), Status::UNSUPPORTED_DTYPE, "{}", e);
    assert!(dhb.iter().all(|&d| d == poison), "a failed call wrote dhidden");
    // An fp32 dhidden is the shard's part; a bf16 dweight of the shard's rows is fine.
    let mut dh32 = vec![-1f32; n * hd];
    let mut dwb = vec![poison; v * hd];
    h.linear_cross_entropy_bwd(
        &hbm,
        &wbm,
        None,
        &tv,
        &lv,
        &shard,
        &mut LinearCeGrads::new()
            .dhidden(TensorMut::matrix(&mut dh32, n, hd).unwrap())
            .dweight(TensorMut::from_bits(&mut dwb, DType::BF16, &[v, hd]).unwrap()),
    )
    .unwrap();
    assert!(dh32.iter().all(|&d| d != -1.0 && d.is_finite()), "dhidden {:?}", dh32);
    assert!(dwb.iter().all(|&d| d != poison), "dweight not written");
}
