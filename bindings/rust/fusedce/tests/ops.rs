//! Every op through the safe API on the CPU backend, against float64 values computed here
//! (`support/reference.rs`); gradients against central finite differences of those references.
#[path = "support/reference.rs"]
mod reference;

use fusedce::{
    bits, CeOptions, CeOutputs, DType, Divergence, Handle, KdOptions, KdOutputs, LinearCeGrads, LinearCeOutputs,
    LseOptions, Reduction, SoftmaxOptions, Status, Teacher, TensorMut, TensorRef, TopkNorm,
};
use reference::*;

fn cpu() -> Handle {
    Handle::cpu().expect("CPU handle")
}

// ------------------------------------------------------------------------------------ cross-entropy

#[test]
fn cross_entropy_fwd_defaults_all_outputs() {
    let (n, v) = (6, 50);
    let mut rng = Rng::new(1);
    let x = rng.f32s(n * v, -4.0, 4.0);
    let targets: Vec<i64> = vec![3, 49, -100, 0, 17, 17];
    let h = cpu();
    let mut loss = 0f32;
    let mut zl = 0f32;
    let mut lse = vec![0f32; n];
    let mut am = vec![0i32; n];
    let mut ent = vec![0f32; n];
    let mut dx = vec![0f32; n * v];
    h.cross_entropy_fwd(
        &TensorRef::matrix(&x, n, v).unwrap(),
        &TensorRef::vector(&targets),
        &CeOptions::default(),
        &mut CeOutputs::new(TensorMut::scalar(&mut loss))
            .z_loss(TensorMut::scalar(&mut zl))
            .lse(TensorMut::vector(&mut lse))
            .argmax(TensorMut::vector(&mut am))
            .entropy(TensorMut::vector(&mut ent))
            .dlogits(TensorMut::matrix(&mut dx, n, v).unwrap()),
    )
    .unwrap();

    let o = CeRef::default();
    let xd = widen(&x);
    let rows = o.rows(&xd, v, &targets);
    let denom = o.denom(&targets);
    assert_eq!(denom, 5.0);
    let want = rows.iter().map(|r| r.loss).sum::<f64>() / denom;
    assert_close("loss", &[loss as f64], &[want], 1e-6, 1e-6);
    assert_eq!(zl, 0.0);
    assert_close("lse", &widen(&lse), &rows.iter().map(|r| r.lse).collect::<Vec<_>>(), 1e-6, 1e-6);
    assert_close("entropy", &widen(&ent), &rows.iter().map(|r| r.entropy).collect::<Vec<_>>(), 1e-5, 1e-5);
    assert_eq!(am.iter().map(|&a| a as usize).collect::<Vec<_>>(), rows.iter().map(|r| r.argmax).collect::<Vec<_>>());
    let g = fd_grad(&xd, |y| {
        reduce(&o.rows(y, v, &targets).iter().map(|r| r.loss).collect::<Vec<_>>(), &Red::Mean(1.0), denom)
    });
    assert_close("dlogits", &widen(&dx), &g, 1e-6, 1e-4);
    // The ignored row has zero gradient, exactly.
    assert!(dx[2 * v..3 * v].iter().all(|&d| d == 0.0));
}

#[test]
fn cross_entropy_fwd_every_option_reduction_none() {
    let (n, v) = (5, 23);
    let mut rng = Rng::new(2);
    let x = rng.f32s(n * v, -6.0, 6.0);
    let w = rng.f32s(v, 0.2, 2.0);
    let targets: Vec<i32> = vec![1, 7, 22, 7, 0];
    let gl = rng.f32s(n, -1.0, 2.0);
    let opts = CeOptions::new()
        .reduction(Reduction::None)
        .ignore_index(22)
        .label_smoothing(0.1)
        .z_loss_scale(1e-3)
        .softcap(5.0)
        .logit_scale(0.7)
        .class_weights(TensorRef::vector(&w));
    let h = cpu();
    let mut loss = vec![0f32; n];
    let mut zl = vec![0f32; n];
    let mut lse = vec![0f32; n];
    let mut am = vec![0i64; n];
    let mut dx = vec![0f32; n * v];
    h.cross_entropy_fwd(
        &TensorRef::matrix(&x, n, v).unwrap(),
        &TensorRef::vector(&targets),
        &opts,
        &mut CeOutputs::new(TensorMut::vector(&mut loss))
            .z_loss(TensorMut::vector(&mut zl))
            .lse(TensorMut::vector(&mut lse))
            .argmax(TensorMut::vector(&mut am))
            .dlogits(TensorMut::matrix(&mut dx, n, v).unwrap())
            .grad_loss(TensorRef::vector(&gl)),
    )
    .unwrap();
    let o = CeRef { ignore_index: 22, eps: 0.1, q: 1e-3, cap: 5.0, scale: 0.7, weights: Some(widen(&w)) };
    let t64: Vec<i64> = targets.iter().map(|&t| t as i64).collect();
    let xd = widen(&x);
    let rows = o.rows(&xd, v, &t64);
    assert_close("loss", &widen(&loss), &rows.iter().map(|r| r.loss).collect::<Vec<_>>(), 1e-5, 1e-5);
    assert_eq!(loss[2], 0.0, "ignored row");
    assert_close("z_loss", &widen(&zl), &rows.iter().map(|r| r.z_loss).collect::<Vec<_>>(), 1e-7, 1e-5);
    assert_close("lse", &widen(&lse), &rows.iter().map(|r| r.lse).collect::<Vec<_>>(), 1e-6, 1e-6);
    assert_eq!(am.iter().map(|&a| a as usize).collect::<Vec<_>>(), rows.iter().map(|r| r.argmax).collect::<Vec<_>>());
    let red = Red::None(widen(&gl));
    let g = fd_grad(&xd, |y| reduce(&o.rows(y, v, &t64).iter().map(|r| r.loss).collect::<Vec<_>>(), &red, 0.0));
    assert_close("dlogits", &widen(&dx), &g, 1e-6, 1e-4);
}

#[test]
fn cross_entropy_weighted_mean_and_sum() {
    let (n, v) = (4, 9);
    let mut rng = Rng::new(3);
    let x = rng.f32s(n * v, -3.0, 3.0);
    let w = rng.f32s(v, 0.5, 3.0);
    let targets: Vec<i64> = vec![8, -100, 2, 5];
    let o = CeRef { eps: 0.2, weights: Some(widen(&w)), ..Default::default() };
    let xd = widen(&x);
    let rows: Vec<f64> = o.rows(&xd, v, &targets).iter().map(|r| r.loss).collect();
    let h = cpu();
    for (red, rref) in [(Reduction::Mean, Red::Mean(0.5)), (Reduction::Sum, Red::Sum(0.5))] {
        let mut loss = 0f32;
        let mut dx = vec![0f32; n * v];
        let half = 0.5f32;
        h.cross_entropy_fwd(
            &TensorRef::matrix(&x, n, v).unwrap(),
            &TensorRef::vector(&targets),
            &CeOptions::new().reduction(red).label_smoothing(0.2).class_weights(TensorRef::vector(&w)),
            &mut CeOutputs::new(TensorMut::scalar(&mut loss))
                .dlogits(TensorMut::matrix(&mut dx, n, v).unwrap())
                .grad_loss(TensorRef::scalar(&half)),
        )
        .unwrap();
        let denom = o.denom(&targets);
        let want = reduce(&rows, &rref, denom) / 0.5;
        assert_close(&format!("{:?} loss", red), &[loss as f64], &[want], 1e-6, 1e-6);
        let g =
            fd_grad(&xd, |y| reduce(&o.rows(y, v, &targets).iter().map(|r| r.loss).collect::<Vec<_>>(), &rref, denom));
        assert_close(&format!("{:?} dlogits", red), &widen(&dx), &g, 1e-6, 1e-4);
    }
}

#[test]
fn cross_entropy_bwd_and_in_place_variants() {
    let (n, v) = (5, 31);
    let mut rng = Rng::new(4);
    let x = rng.f32s(n * v, -5.0, 5.0);
    let targets: Vec<i64> = vec![0, 30, 12, -100, 5];
    let opts = CeOptions::new().label_smoothing(0.05).z_loss_scale(1e-2).logit_scale(1.3);
    let o = CeRef { eps: 0.05, q: 1e-2, scale: 1.3, ..Default::default() };
    let h = cpu();
    // Forward: lse and the fused gradient.
    let mut loss = 0f32;
    let mut lse = vec![0f32; n];
    let mut fused = vec![0f32; n * v];
    h.cross_entropy_fwd(
        &TensorRef::matrix(&x, n, v).unwrap(),
        &TensorRef::vector(&targets),
        &opts,
        &mut CeOutputs::new(TensorMut::scalar(&mut loss))
            .lse(TensorMut::vector(&mut lse))
            .dlogits(TensorMut::matrix(&mut fused, n, v).unwrap()),
    )
    .unwrap();
    // Backward with an upstream gradient of 2.
    let two = 2f32;
    let mut dx = vec![0f32; n * v];
    h.cross_entropy_bwd(
        &TensorRef::matrix(&x, n, v).unwrap(),
        &TensorRef::vector(&targets),
        &TensorRef::vector(&lse),
        Some(&TensorRef::scalar(&two)),
        &opts,
        &mut TensorMut::matrix(&mut dx, n, v).unwrap(),
    )
    .unwrap();
    let xd = widen(&x);
    let denom = o.denom(&targets);
    let g = fd_grad(&xd, |y| {
        reduce(&o.rows(y, v, &targets).iter().map(|r| r.loss).collect::<Vec<_>>(), &Red::Mean(2.0), denom)
    });
    assert_close("bwd dlogits", &widen(&dx), &g, 2e-6, 1e-4);
    let g1: Vec<f64> = g.iter().map(|x| x / 2.0).collect();
    assert_close("fused dlogits", &widen(&fused), &g1, 1e-6, 1e-4);

    // In place: the gradient overwrites the logits, bit-identical to the out-of-place results.
    let mut y = x.clone();
    h.cross_entropy_bwd_in_place(
        &mut TensorMut::matrix(&mut y, n, v).unwrap(),
        &TensorRef::vector(&targets),
        &TensorRef::vector(&lse),
        Some(&TensorRef::scalar(&two)),
        &opts,
    )
    .unwrap();
    assert_eq!(y, dx, "bwd in place");
    let mut y = x.clone();
    let mut loss2 = 0f32;
    h.cross_entropy_fwd_in_place(
        &mut TensorMut::matrix(&mut y, n, v).unwrap(),
        &TensorRef::vector(&targets),
        &opts,
        &mut CeOutputs::new(TensorMut::scalar(&mut loss2)),
    )
    .unwrap();
    assert_eq!(y, fused, "fwd in place");
    assert_eq!(loss2, loss);
    let bytes = h
        .cross_entropy_fwd_workspace_size(
            &TensorRef::matrix(&x, n, v).unwrap(),
            &TensorRef::vector(&targets),
            &opts,
            &mut CeOutputs::new(TensorMut::scalar(&mut loss2)),
        )
        .unwrap();
    assert!(bytes < 1 << 30);
}

#[test]
fn cross_entropy_bf16_and_f16_logits() {
    let (n, v) = (3, 40);
    let mut rng = Rng::new(5);
    let targets: Vec<i64> = vec![4, 39, 0];
    let o = CeRef::default();
    let h = cpu();
    for dtype in [DType::BF16, DType::F16] {
        let enc = |x: f32| if dtype == DType::BF16 { bits::f32_to_bf16(x) } else { bits::f32_to_f16(x) };
        let dec = |b: u16| if dtype == DType::BF16 { bits::bf16_to_f32(b) } else { bits::f16_to_f32(b) };
        let xb: Vec<u16> = rng.f32s(n * v, -4.0, 4.0).into_iter().map(enc).collect();
        let xd: Vec<f64> = xb.iter().map(|&b| dec(b) as f64).collect();
        let mut loss = vec![0f32; n];
        let mut dxb = vec![0u16; n * v];
        h.cross_entropy_fwd(
            &TensorRef::from_bits(&xb, dtype, &[n, v]).unwrap(),
            &TensorRef::vector(&targets),
            &CeOptions::new().reduction(Reduction::None),
            &mut CeOutputs::new(TensorMut::vector(&mut loss))
                .dlogits(TensorMut::from_bits(&mut dxb, dtype, &[n, v]).unwrap()),
        )
        .unwrap();
        let rows = o.rows(&xd, v, &targets);
        assert_close(
            &format!("{:?} loss", dtype),
            &widen(&loss),
            &rows.iter().map(|r| r.loss).collect::<Vec<_>>(),
            1e-5,
            1e-5,
        );
        let g = fd_grad(&xd, |y| {
            reduce(&o.rows(y, v, &targets).iter().map(|r| r.loss).collect::<Vec<_>>(), &Red::None(vec![1.0; n]), 0.0)
        });
        let got: Vec<f64> = dxb.iter().map(|&b| dec(b) as f64).collect();
        // One rounding to 8 (bf16) or 11 (fp16) significant bits.
        assert_close(&format!("{:?} dlogits", dtype), &got, &g, 1e-7, if dtype == DType::BF16 { 8e-3 } else { 1e-3 });
    }
}

#[test]
fn cross_entropy_padded_rows() {
    let (n, v, ld) = (3, 10, 13);
    let mut rng = Rng::new(6);
    let dense = rng.f32s(n * v, -2.0, 2.0);
    let mut padded = vec![f32::NAN; (n - 1) * ld + v]; // the padding must never be read
    for i in 0..n {
        padded[i * ld..i * ld + v].copy_from_slice(&dense[i * v..(i + 1) * v]);
    }
    let targets: Vec<i32> = vec![9, 0, 5];
    let h = cpu();
    let mut loss = 0f32;
    let mut dx = vec![-7f32; (n - 1) * ld + v];
    h.cross_entropy_fwd(
        &TensorRef::strided(&padded, n, v, ld).unwrap(),
        &TensorRef::vector(&targets),
        &CeOptions::default(),
        &mut CeOutputs::new(TensorMut::scalar(&mut loss)).dlogits(TensorMut::strided(&mut dx, n, v, ld).unwrap()),
    )
    .unwrap();
    let o = CeRef::default();
    let t64: Vec<i64> = targets.iter().map(|&t| t as i64).collect();
    let rows = o.rows(&widen(&dense), v, &t64);
    let want = rows.iter().map(|r| r.loss).sum::<f64>() / 3.0;
    assert_close("loss", &[loss as f64], &[want], 1e-6, 1e-6);
    for i in 0..n - 1 {
        assert!(dx[i * ld + v..(i + 1) * ld].iter().all(|&p| p == -7.0), "padding written");
    }
}

// ----------------------------------------------------------------- vocabulary-parallel cross-entropy

/// `[N]` for Reduction::None, else a scalar.
fn loss_view(per_row: bool, l: &mut [f32]) -> TensorMut<'_> {
    if per_row {
        TensorMut::vector(l)
    } else {
        TensorMut::scalar(&mut l[0])
    }
}

/// Logits [N, V] split into two shards of widths 17 and 30, the second padded by 3 NaN columns (global
/// indices 47..50, past vocab_total): partial per shard, records stacked in rank order, combine; then
/// each shard's backward from the combined lse, its pairs `[N, 2]` and its `[N]` form. Everything against
/// the unsharded calls.
#[test]
fn vocab_parallel_uneven_padded_shards_match_the_unsharded_call() {
    let (n, v) = (9, 47);
    let widths = [17usize, 30];
    let pads = [0usize, 3];
    let mut rng = Rng::new(28);
    let x = rng.f32s(n * v, -4.0, 4.0);
    let mut targets: Vec<i64> = (0..n).map(|_| rng.below(v as u64) as i64).collect();
    // Both sides of the shard boundary, both ends of the vocabulary, an ignored row.
    targets[..4].copy_from_slice(&[16, 17, 0, 46]);
    targets[5] = -100;
    let h = cpu();
    let option_sets = [
        CeOptions::new(),
        CeOptions::new().reduction(Reduction::None).label_smoothing(0.1).z_loss_scale(1e-3).softcap(20.0),
    ];
    for (case, base) in option_sets.iter().enumerate() {
        let per_row = base.reduction == Reduction::None;
        let loss_len = if per_row { n } else { 1 };

        // The unsharded forward, with the fused gradient.
        let mut loss = vec![0f32; loss_len];
        let mut zl = vec![0f32; loss_len];
        let mut lse = vec![0f32; n];
        let mut am = vec![0i64; n];
        let mut ent = vec![0f32; n];
        let mut dx = vec![0f32; n * v];
        h.cross_entropy_fwd(
            &TensorRef::matrix(&x, n, v).unwrap(),
            &TensorRef::vector(&targets),
            base,
            &mut CeOutputs::new(loss_view(per_row, &mut loss))
                .z_loss(loss_view(per_row, &mut zl))
                .lse(TensorMut::vector(&mut lse))
                .argmax(TensorMut::vector(&mut am))
                .entropy(TensorMut::vector(&mut ent))
                .dlogits(TensorMut::matrix(&mut dx, n, v).unwrap()),
        )
        .unwrap();

        // The shards: columns [start, start + width) of x, then `pad` NaN columns.
        let mut starts = vec![0usize];
        for w in &widths[..widths.len() - 1] {
            starts.push(starts.last().unwrap() + w);
        }
        let shards: Vec<Vec<f32>> = (0..widths.len())
            .map(|r| {
                let (s, w, p) = (starts[r], widths[r], pads[r]);
                let mut m = Vec::with_capacity(n * (w + p));
                for i in 0..n {
                    m.extend_from_slice(&x[i * v + s..i * v + s + w]);
                    m.extend(std::iter::repeat(f32::NAN).take(p));
                }
                m
            })
            .collect();
        let shard_opts = |r: usize| base.vocab_start(starts[r] as i64).vocab_total(v as i64);

        // 1. partial per rank, written straight into its slot of the stacked [W, N, K] records.
        let k = fusedce::cross_entropy_record_fields(&shard_opts(0)).unwrap();
        assert_eq!(k, fusedce::CE_RECORD_FIELDS_ALL);
        assert_eq!(k, 9);
        let mut records = vec![f32::NAN; widths.len() * n * k];
        for (r, rec) in records.chunks_mut(n * k).enumerate() {
            h.cross_entropy_partial(
                &TensorRef::matrix(&shards[r], n, widths[r] + pads[r]).unwrap(),
                &TensorRef::vector(&targets),
                &shard_opts(r),
                &mut TensorMut::matrix(rec, n, k).unwrap(),
            )
            .unwrap();
        }
        // (Field 8, the argmax's index, holds int32 bits: -1 reads as a NaN.)
        assert!(records.iter().enumerate().all(|(i, r)| !r.is_nan() || i % k == 8), "records left unwritten");
        // Fields 4 and 5: each shard's column range [vocab_start, end), end one past its last real column.
        for (r, rec) in records.chunks(n * k).enumerate() {
            for i in 0..n {
                let range = [rec[i * k + 4].to_bits() as usize, rec[i * k + 5].to_bits() as usize];
                assert_eq!(range, [starts[r], starts[r] + widths[r]], "case {}: shard {} row {}: range", case, r, i);
            }
        }

        // 3. combine (vocab_start is not read: any rank's options do).
        let mut closs = vec![0f32; loss_len];
        let mut czl = vec![0f32; loss_len];
        let mut clse = vec![0f32; n];
        let mut cam = vec![0i64; n];
        let mut cent = vec![0f32; n];
        let rec3 = TensorRef::new(&records, &[widths.len(), n, k]).unwrap();
        h.cross_entropy_combine(
            &rec3,
            &TensorRef::vector(&targets),
            &shard_opts(1),
            &mut CeOutputs::new(loss_view(per_row, &mut closs))
                .z_loss(loss_view(per_row, &mut czl))
                .lse(TensorMut::vector(&mut clse))
                .argmax(TensorMut::vector(&mut cam))
                .entropy(TensorMut::vector(&mut cent)),
        )
        .unwrap();
        // The lse's pairs (m, l): m the rows' max z over every shard, lse = m + l.
        let mut cpairs = vec![f32::NAN; 2 * n];
        let mut closs2 = vec![0f32; loss_len];
        h.cross_entropy_combine(
            &rec3,
            &TensorRef::vector(&targets),
            &shard_opts(0),
            &mut CeOutputs::new(loss_view(per_row, &mut closs2)).lse(TensorMut::lse_pairs(&mut cpairs).unwrap()),
        )
        .unwrap();
        let what = |s: &str| format!("case {}: {}", case, s);
        assert_close(&what("loss"), &widen(&closs), &widen(&loss), 2e-5, 0.0);
        assert_close(&what("z_loss"), &widen(&czl), &widen(&zl), 2e-5, 0.0);
        assert_close(&what("lse"), &widen(&clse), &widen(&lse), 2e-5, 0.0);
        assert_close(&what("entropy"), &widen(&cent), &widen(&ent), 2e-5, 0.0);
        assert_eq!(cam, am, "case {}: argmax", case);
        if per_row {
            assert_eq!(closs[5], 0.0, "ignored row");
        }
        assert_eq!(bits_of(&closs2), bits_of(&closs), "case {}: loss with the pairs", case);
        let pair_lse = fusedce::lse_from_pairs(&cpairs, 1.0).unwrap();
        assert_close(&what("lse of the pairs"), &widen(&pair_lse), &widen(&clse), 0.0, 3e-7);

        // 4. each shard's gradient from the combined lse, its pairs and its [N] form: its columns of the
        // unsharded dlogits, 0 in the padding (the output starts at 7 everywhere so that unwritten
        // elements show).
        for (r, lse_form) in (0..widths.len()).flat_map(|r| [(r, true), (r, false)]) {
            let (s, w, p) = (starts[r], widths[r], pads[r]);
            let mut dshard = vec![7f32; n * (w + p)];
            let lse_in = if lse_form { TensorRef::lse_pairs(&cpairs).unwrap() } else { TensorRef::vector(&clse) };
            h.cross_entropy_bwd(
                &TensorRef::matrix(&shards[r], n, w + p).unwrap(),
                &TensorRef::vector(&targets),
                &lse_in,
                None,
                &shard_opts(r),
                &mut TensorMut::matrix(&mut dshard, n, w + p).unwrap(),
            )
            .unwrap();
            for i in 0..n {
                let got = &dshard[i * (w + p)..(i + 1) * (w + p)];
                let want = &dx[i * v + s..i * v + s + w];
                assert_close(
                    &what(&format!("shard {} dlogits row {}", r, i)),
                    &widen(&got[..w]),
                    &widen(want),
                    1e-6,
                    1e-5,
                );
                assert!(
                    got[w..].iter().all(|&g| g == 0.0),
                    "case {}: shard {} row {}: padding gradient {:?}",
                    case,
                    r,
                    i,
                    &got[w..]
                );
            }
            assert!(dshard[5 * (w + p)..6 * (w + p)].iter().all(|&g| g == 0.0), "ignored row's gradient");
        }
    }
}

// ------------------------------------------------------------------------- logsumexp and softmax

#[test]
fn logsumexp_f32_and_f16() {
    let (n, v) = (4, 100);
    let mut rng = Rng::new(7);
    let mut x = rng.f32s(n * v, -10.0, 10.0);
    for j in 0..v {
        x[3 * v + j] = f32::NEG_INFINITY; // a row of -inf gives -inf
    }
    let h = cpu();
    let mut lse = vec![0f32; n];
    h.logsumexp(&TensorRef::matrix(&x, n, v).unwrap(), &LseOptions::new().scale(0.5), &mut TensorMut::vector(&mut lse))
        .unwrap();
    let want: Vec<f64> =
        (0..n).map(|i| logsumexp(&x[i * v..(i + 1) * v].iter().map(|&a| 0.5 * a as f64).collect::<Vec<_>>())).collect();
    assert_close("lse f32", &widen(&lse), &want, 1e-6, 1e-6);
    assert_eq!(lse[3], f32::NEG_INFINITY);

    let xh: Vec<u16> = x[..3 * v].iter().map(|&a| bits::f32_to_f16(a)).collect();
    let mut lse = vec![0f32; 3];
    h.logsumexp(
        &TensorRef::from_bits(&xh, DType::F16, &[3, v]).unwrap(),
        &LseOptions::default(),
        &mut TensorMut::vector(&mut lse),
    )
    .unwrap();
    let want: Vec<f64> = (0..3)
        .map(|i| logsumexp(&xh[i * v..(i + 1) * v].iter().map(|&b| bits::f16_to_f32(b) as f64).collect::<Vec<_>>()))
        .collect();
    assert_close("lse f16", &widen(&lse), &want, 1e-6, 1e-6);
}

fn softmax_ref(x: &[f64], t: f64) -> (Vec<f64>, Vec<f64>) {
    let z: Vec<f64> = x.iter().map(|&a| a / t).collect();
    let l = logsumexp(&z);
    let lp: Vec<f64> = z.iter().map(|&a| a - l).collect();
    (lp.iter().map(|a| a.exp()).collect(), lp)
}

#[test]
fn temp_softmax_temperatures_greedy_and_dtypes() {
    let (n, v) = (3, 17);
    let mut rng = Rng::new(8);
    let mut x = rng.f32s(n * v, -5.0, 5.0);
    x[v + 3] = f32::NEG_INFINITY;
    let h = cpu();
    let xm = TensorRef::matrix(&x, n, v).unwrap();
    // One temperature.
    let mut p = vec![0f32; n * v];
    let mut lp = vec![0f32; n * v];
    h.temp_softmax(
        &xm,
        &SoftmaxOptions::new().temperature(0.7),
        Some(&mut TensorMut::matrix(&mut p, n, v).unwrap()),
        Some(&mut TensorMut::matrix(&mut lp, n, v).unwrap()),
    )
    .unwrap();
    let (mut wp, mut wlp) = (Vec::new(), Vec::new());
    for i in 0..n {
        let (a, b) = softmax_ref(&widen(&x[i * v..(i + 1) * v]), 0.7);
        wp.extend(a);
        wlp.extend(b);
    }
    assert_close("probs", &widen(&p), &wp, 1e-7, 1e-5);
    assert_close("logprobs", &widen(&lp), &wlp, 1e-5, 1e-5);
    assert_eq!(p[v + 3], 0.0);

    // Per-row temperatures, probabilities only.
    let temps = [0.5f32, 1.0, 3.0];
    let mut p = vec![0f32; n * v];
    h.temp_softmax(
        &xm,
        &SoftmaxOptions::new().temperatures(TensorRef::vector(&temps)),
        Some(&mut TensorMut::matrix(&mut p, n, v).unwrap()),
        None,
    )
    .unwrap();
    let mut wp = Vec::new();
    for i in 0..n {
        wp.extend(softmax_ref(&widen(&x[i * v..(i + 1) * v]), temps[i] as f64).0);
    }
    assert_close("probs per-row T", &widen(&p), &wp, 1e-7, 1e-5);

    // T = 0: one-hot at the argmax, lowest index on ties.
    let mut y = x.clone();
    y[2] = 100.0;
    y[5] = 100.0;
    let mut p = vec![0f32; n * v];
    let mut lp = vec![0f32; n * v];
    h.temp_softmax(
        &TensorRef::matrix(&y, n, v).unwrap(),
        &SoftmaxOptions::new().temperature(0.0),
        Some(&mut TensorMut::matrix(&mut p, n, v).unwrap()),
        Some(&mut TensorMut::matrix(&mut lp, n, v).unwrap()),
    )
    .unwrap();
    for i in 0..n {
        let am = argmax(&widen(&y[i * v..(i + 1) * v]));
        for j in 0..v {
            assert_eq!(p[i * v + j], if j == am { 1.0 } else { 0.0 });
            assert_eq!(lp[i * v + j], if j == am { 0.0 } else { f32::NEG_INFINITY });
        }
    }
    assert_eq!(p[2], 1.0);

    // bf16 logits: probabilities in bf16 (the logits' dtype) and log-probabilities in fp32.
    let xb: Vec<u16> = x.iter().map(|&a| bits::f32_to_bf16(a)).collect();
    let mut pb = vec![0u16; n * v];
    let mut lp = vec![0f32; n * v];
    h.temp_softmax(
        &TensorRef::from_bits(&xb, DType::BF16, &[n, v]).unwrap(),
        &SoftmaxOptions::new().temperature(1.5),
        Some(&mut TensorMut::from_bits(&mut pb, DType::BF16, &[n, v]).unwrap()),
        Some(&mut TensorMut::matrix(&mut lp, n, v).unwrap()),
    )
    .unwrap();
    let (mut wp, mut wlp) = (Vec::new(), Vec::new());
    for i in 0..n {
        let row: Vec<f64> = xb[i * v..(i + 1) * v].iter().map(|&b| bits::bf16_to_f32(b) as f64).collect();
        let (a, b) = softmax_ref(&row, 1.5);
        wp.extend(a);
        wlp.extend(b);
    }
    assert_close("bf16 probs", &pb.iter().map(|&b| bits::bf16_to_f32(b) as f64).collect::<Vec<_>>(), &wp, 1e-7, 8e-3);
    assert_close("bf16 logprobs (fp32 out)", &widen(&lp), &wlp, 1e-5, 1e-5);
}

// ----------------------------------------------------------------------------------- distillation

#[test]
fn kd_loss_full_teacher_every_divergence() {
    let (n, v) = (4, 19);
    let mut rng = Rng::new(9);
    let s = rng.f32s(n * v, -4.0, 4.0);
    // Teacher in bf16 (may differ from the student's dtype).
    let tb: Vec<u16> = rng.f32s(n * v, -4.0, 4.0).into_iter().map(bits::f32_to_bf16).collect();
    let td: Vec<f64> = tb.iter().map(|&b| bits::bf16_to_f32(b) as f64).collect();
    let targets: Vec<i64> = vec![1, -100, 3, 4];
    let t = 2.0f32;
    let sd = widen(&s);
    let h = cpu();
    for (div, dref) in
        [(Divergence::ForwardKl, Div::Fkl), (Divergence::ReverseKl, Div::Rkl), (Divergence::Jsd, Div::Jsd(0.3))]
    {
        let opts = KdOptions::new().divergence(div).beta(0.3).temperature(t).scale_by_t2(true);
        let mut loss = 0f32;
        let mut ds = vec![0f32; n * v];
        h.kd_loss(
            &TensorRef::matrix(&s, n, v).unwrap(),
            &Teacher::Logits(TensorRef::from_bits(&tb, DType::BF16, &[n, v]).unwrap()),
            Some(&TensorRef::vector(&targets)),
            &opts,
            &mut KdOutputs::new(TensorMut::scalar(&mut loss)).dstudent(TensorMut::matrix(&mut ds, n, v).unwrap()),
        )
        .unwrap();
        let total = |y: &[f64]| -> f64 {
            let mut sum = 0.0;
            for i in 0..n {
                if targets[i] != -100 {
                    sum += kd_row_full(dref, &y[i * v..(i + 1) * v], &td[i * v..(i + 1) * v], t as f64);
                }
            }
            sum * (t as f64).powi(2) / 3.0 // T², batchmean over 3 unmasked rows
        };
        assert_close(&format!("{:?} loss", div), &[loss as f64], &[total(&sd)], 1e-6, 1e-5);
        assert_close(&format!("{:?} dstudent", div), &widen(&ds), &fd_grad(&sd, total), 1e-6, 1e-4);
        assert!(ds[v..2 * v].iter().all(|&g| g == 0.0), "masked row has zero gradient");

        // Reduction None: one loss per row, 0 for the masked row.
        let mut rows = vec![0f32; n];
        h.kd_loss(
            &TensorRef::matrix(&s, n, v).unwrap(),
            &Teacher::Logits(TensorRef::from_bits(&tb, DType::BF16, &[n, v]).unwrap()),
            Some(&TensorRef::vector(&targets)),
            &opts.reduction(Reduction::None).scale_by_t2(false),
            &mut KdOutputs::new(TensorMut::vector(&mut rows)),
        )
        .unwrap();
        let want: Vec<f64> = (0..n)
            .map(|i| {
                if targets[i] == -100 {
                    0.0
                } else {
                    kd_row_full(dref, &sd[i * v..(i + 1) * v], &td[i * v..(i + 1) * v], t as f64)
                }
            })
            .collect();
        assert_close(&format!("{:?} per-row loss", div), &widen(&rows), &want, 1e-6, 1e-5);
    }
}

#[test]
fn kd_loss_topk_teacher_both_normalizations() {
    let (n, v, k) = (4, 15, 4);
    let mut rng = Rng::new(10);
    let s = rng.f32s(n * v, -3.0, 3.0);
    let ids: Vec<i64> = vec![
        3, 7, 0, 14, //
        5, -1, 2, 9, // one unused slot
        -1, -1, -1, -1, // no used slot: the row is masked
        11, 12, 13, 1,
    ];
    let lp: Vec<f32> = rng.f32s(n * k, -6.0, -0.1);
    let sd = widen(&s);
    let lpd = widen(&lp);
    let t = 1.5f64;
    let h = cpu();
    for (norm, renorm) in [(TopkNorm::FullVocab, false), (TopkNorm::Renormalize, true)] {
        for (div, dref) in
            [(Divergence::ForwardKl, Div::Fkl), (Divergence::ReverseKl, Div::Rkl), (Divergence::Jsd, Div::Jsd(0.5))]
        {
            let opts = KdOptions::new().divergence(div).topk_norm(norm).temperature(t as f32);
            let mut loss = 0f32;
            let mut ds = vec![0f32; n * v];
            let gl = 3f32;
            h.kd_loss(
                &TensorRef::matrix(&s, n, v).unwrap(),
                &Teacher::TopK {
                    ids: TensorRef::matrix(&ids, n, k).unwrap(),
                    logprobs: TensorRef::matrix(&lp, n, k).unwrap(),
                },
                None,
                &opts,
                &mut KdOutputs::new(TensorMut::scalar(&mut loss))
                    .dstudent(TensorMut::matrix(&mut ds, n, v).unwrap())
                    .grad_loss(TensorRef::scalar(&gl)),
            )
            .unwrap();
            let total = |y: &[f64]| -> f64 {
                let rows: Vec<f64> = (0..n)
                    .filter_map(|i| {
                        kd_row_topk(
                            dref,
                            &y[i * v..(i + 1) * v],
                            &ids[i * k..(i + 1) * k],
                            &lpd[i * k..(i + 1) * k],
                            t,
                            renorm,
                        )
                    })
                    .collect();
                rows.iter().sum::<f64>() / rows.len() as f64
            };
            let what = format!("{:?}/{:?}", norm, div);
            assert_close(&format!("{} loss", what), &[loss as f64], &[total(&sd)], 1e-6, 1e-5);
            let g: Vec<f64> = fd_grad(&sd, total).iter().map(|x| 3.0 * x).collect();
            assert_close(&format!("{} dstudent", what), &widen(&ds), &g, 1e-6, 1e-4);
            if renorm {
                // Zero outside the K ids.
                assert_eq!(ds[1], 0.0);
            }
        }
    }
}

// ------------------------------------------------------------------------------ linear cross-entropy

struct Lce {
    n: usize,
    hdim: usize,
    v: usize,
    hidden: Vec<f32>,
    weight: Vec<f32>,
    bias: Vec<f32>,
    targets: Vec<i64>,
}

impl Lce {
    fn logits(&self, hid: &[f64], w: &[f64], b: &[f64]) -> Vec<f64> {
        linear_logits(self.n, self.hdim, self.v, hid, w, b)
    }
}

#[test]
fn linear_cross_entropy_fwd_bwd_and_workspace() {
    let (n, hdim, v) = (5, 7, 11);
    let mut rng = Rng::new(11);
    let p = Lce {
        n,
        hdim,
        v,
        hidden: rng.f32s(n * hdim, -1.0, 1.0),
        weight: rng.f32s(v * hdim, -1.0, 1.0),
        bias: rng.f32s(v, -0.5, 0.5),
        targets: vec![3, 10, -100, 0, 3],
    };
    let opts = CeOptions::new().label_smoothing(0.05).z_loss_scale(1e-3);
    let o = CeRef { eps: 0.05, q: 1e-3, ..Default::default() };
    let (hd, wd, bd) = (widen(&p.hidden), widen(&p.weight), widen(&p.bias));
    let denom = o.denom(&p.targets);
    let total = |hid: &[f64], w: &[f64], b: &[f64]| -> f64 {
        let rows: Vec<f64> = o.rows(&p.logits(hid, w, b), v, &p.targets).iter().map(|r| r.loss).collect();
        reduce(&rows, &Red::Mean(1.0), denom)
    };
    let h = cpu();
    let (hm, wm, bv, tv) = (
        TensorRef::matrix(&p.hidden, n, hdim).unwrap(),
        TensorRef::matrix(&p.weight, v, hdim).unwrap(),
        TensorRef::vector(&p.bias),
        TensorRef::vector(&p.targets),
    );
    let mut loss = 0f32;
    let mut zl = 0f32;
    let mut lse = vec![0f32; n];
    let mut am = vec![0i32; n];
    let mut ent = vec![0f32; n];
    let mut dh = vec![0f32; n * hdim];
    let mut dw = vec![0f32; v * hdim];
    let mut db = vec![0f32; v];
    h.linear_cross_entropy_fwd(
        &hm,
        &wm,
        Some(&bv),
        &tv,
        &opts,
        &mut LinearCeOutputs::new(TensorMut::scalar(&mut loss))
            .z_loss(TensorMut::scalar(&mut zl))
            .lse(TensorMut::vector(&mut lse))
            .argmax(TensorMut::vector(&mut am))
            .entropy(TensorMut::vector(&mut ent))
            .dhidden(TensorMut::matrix(&mut dh, n, hdim).unwrap())
            .dweight(TensorMut::matrix(&mut dw, v, hdim).unwrap())
            .dbias(TensorMut::vector(&mut db)),
    )
    .unwrap();
    let rows = o.rows(&p.logits(&hd, &wd, &bd), v, &p.targets);
    assert_close("loss", &[loss as f64], &[total(&hd, &wd, &bd)], 1e-6, 1e-5);
    let zwant = rows.iter().map(|r| r.z_loss).sum::<f64>() / denom;
    assert_close("z_loss", &[zl as f64], &[zwant], 1e-8, 1e-5);
    assert_close("lse", &widen(&lse), &rows.iter().map(|r| r.lse).collect::<Vec<_>>(), 1e-6, 1e-5);
    assert_close("entropy", &widen(&ent), &rows.iter().map(|r| r.entropy).collect::<Vec<_>>(), 1e-5, 1e-5);
    assert_eq!(am.iter().map(|&a| a as usize).collect::<Vec<_>>(), rows.iter().map(|r| r.argmax).collect::<Vec<_>>());
    let gh = fd_grad(&hd, |y| total(y, &wd, &bd));
    let gw = fd_grad(&wd, |y| total(&hd, y, &bd));
    let gb = fd_grad(&bd, |y| total(&hd, &wd, y));
    assert_close("dhidden", &widen(&dh), &gh, 1e-6, 1e-4);
    assert_close("dweight", &widen(&dw), &gw, 1e-6, 1e-4);
    assert_close("dbias", &widen(&db), &gb, 1e-6, 1e-4);

    // Backward from the saved lse with an upstream gradient of 1.5.
    let g15 = 1.5f32;
    let mut dh2 = vec![0f32; n * hdim];
    let mut dw2 = vec![0f32; v * hdim];
    let mut db2 = vec![0f32; v];
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
            .grad_loss(TensorRef::scalar(&g15)),
    )
    .unwrap();
    let scale = |g: &[f64]| g.iter().map(|x| 1.5 * x).collect::<Vec<_>>();
    assert_close("bwd dhidden", &widen(&dh2), &scale(&gh), 2e-6, 1e-4);
    assert_close("bwd dweight", &widen(&dw2), &scale(&gw), 2e-6, 1e-4);
    assert_close("bwd dbias", &widen(&db2), &scale(&gb), 2e-6, 1e-4);

    // A caller workspace of the queried size: same results; one too small: WORKSPACE_TOO_SMALL.
    let mut loss_ws = vec![0f32; n];
    let none = CeOptions::new().reduction(Reduction::None);
    let mut buf;
    let off;
    let bytes_ws;
    let mut h2 = cpu();
    {
        let mut outs = LinearCeOutputs::new(TensorMut::vector(&mut loss_ws));
        let bytes = h.linear_cross_entropy_fwd_workspace_size(&hm, &wm, Some(&bv), &tv, &none, &mut outs).unwrap();
        assert!(bytes > 0);
        buf = vec![0u8; bytes + 2 * fusedce::WORKSPACE_ALIGNMENT];
        off = buf.as_ptr().align_offset(fusedce::WORKSPACE_ALIGNMENT);
        unsafe { h2.set_workspace(buf.as_mut_ptr().add(off) as *mut std::ffi::c_void, bytes) };
        h2.linear_cross_entropy_fwd(&hm, &wm, Some(&bv), &tv, &none, &mut outs).unwrap();
        bytes_ws = bytes;
    }
    let plain = CeRef::default().rows(&p.logits(&hd, &wd, &bd), v, &p.targets);
    let want: Vec<f64> = plain.iter().map(|r| r.loss).collect();
    assert_close("loss with a caller workspace", &widen(&loss_ws), &want, 1e-6, 1e-5);
    unsafe { h2.set_workspace(buf.as_mut_ptr().add(off) as *mut std::ffi::c_void, 128) };
    let e = h2
        .linear_cross_entropy_fwd(
            &hm,
            &wm,
            Some(&bv),
            &tv,
            &none,
            &mut LinearCeOutputs::new(TensorMut::vector(&mut loss_ws)),
        )
        .unwrap_err();
    assert_eq!(e.status(), Status::WORKSPACE_TOO_SMALL, "{}", e);
    assert!(!e.message().is_empty());
    // One byte off FCE_WORKSPACE_ALIGNMENT: INVALID_ARGUMENT.
    unsafe { h2.set_workspace(buf.as_mut_ptr().add(off + 1) as *mut std::ffi::c_void, bytes_ws) };
    let e = h2
        .linear_cross_entropy_fwd(
            &hm,
            &wm,
            Some(&bv),
            &tv,
            &none,
            &mut LinearCeOutputs::new(TensorMut::vector(&mut loss_ws)),
        )
        .unwrap_err();
    assert_eq!(e.status(), Status::INVALID_ARGUMENT, "{}", e);
    h2.clear_workspace();
    h2.linear_cross_entropy_fwd(
        &hm,
        &wm,
        Some(&bv),
        &tv,
        &none,
        &mut LinearCeOutputs::new(TensorMut::vector(&mut loss_ws)),
    )
    .unwrap();
}

#[test]
fn linear_cross_entropy_bf16_weights() {
    let (n, hdim, v) = (4, 16, 33);
    let mut rng = Rng::new(12);
    let hb: Vec<u16> = rng.f32s(n * hdim, -1.0, 1.0).into_iter().map(bits::f32_to_bf16).collect();
    let wb: Vec<u16> = rng.f32s(v * hdim, -1.0, 1.0).into_iter().map(bits::f32_to_bf16).collect();
    let targets: Vec<i32> = vec![0, 32, 16, 7];
    let h = cpu();
    let mut loss = vec![0f32; n];
    let mut dhb = vec![0u16; n * hdim];
    h.linear_cross_entropy_fwd(
        &TensorRef::from_bits(&hb, DType::BF16, &[n, hdim]).unwrap(),
        &TensorRef::from_bits(&wb, DType::BF16, &[v, hdim]).unwrap(),
        None,
        &TensorRef::vector(&targets),
        &CeOptions::new().reduction(Reduction::None),
        &mut LinearCeOutputs::new(TensorMut::vector(&mut loss))
            .dhidden(TensorMut::from_bits(&mut dhb, DType::BF16, &[n, hdim]).unwrap()),
    )
    .unwrap();
    let hd: Vec<f64> = hb.iter().map(|&b| bits::bf16_to_f32(b) as f64).collect();
    let wd: Vec<f64> = wb.iter().map(|&b| bits::bf16_to_f32(b) as f64).collect();
    let p = Lce {
        n,
        hdim,
        v,
        hidden: vec![],
        weight: vec![],
        bias: vec![],
        targets: targets.iter().map(|&t| t as i64).collect(),
    };
    let o = CeRef::default();
    let zero = vec![0.0; v];
    // The contract rounds the logits of bf16 inputs to bf16 (as torch's linear does) before the loss.
    let logits16: Vec<f64> =
        p.logits(&hd, &wd, &zero).iter().map(|&z| bits::bf16_to_f32(bits::f32_to_bf16(z as f32)) as f64).collect();
    let rows: Vec<f64> = o.rows(&logits16, v, &p.targets).iter().map(|r| r.loss).collect();
    assert_close("bf16 loss", &widen(&loss), &rows, 1e-5, 1e-5);
    let g = fd_grad(&hd, |y| o.rows(&p.logits(y, &wd, &zero), v, &p.targets).iter().map(|r| r.loss).sum());
    let got: Vec<f64> = dhb.iter().map(|&b| bits::bf16_to_f32(b) as f64).collect();
    // dlogits are rounded to bf16 before the dhidden GEMM, and dhidden to bf16 after: a few bf16 ulps of
    // sum |dlogits| |w| (about 1e-3 here).
    assert_close("bf16 dhidden", &got, &g, 3e-3, 8e-3);
}
