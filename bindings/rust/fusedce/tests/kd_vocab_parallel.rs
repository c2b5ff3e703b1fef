//! Vocabulary-parallel knowledge distillation (`kd_partial`, `kd_combine`, `kd_bwd`) on the CPU backend:
//! student and teacher logits split into shards (uneven, and equal-width with a NaN-padded last shard),
//! records stacked in rank order, combined, and each shard's gradient, against the unsharded `kd_loss`
//! (itself checked here against the float64 reference of `support/reference.rs`); then the statuses of
//! bad inputs.
#[path = "support/reference.rs"]
mod reference;

use fusedce::{
    Divergence, Error, Handle, KdOptions, KdOutputs, Reduction, Status, Teacher, TensorMut, TensorRef,
    KD_RECORD_FIELDS, KD_ROW_STATS_FIELDS,
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

/// Marks record / statistic slots that a call left unwritten.
const UNWRITTEN: f32 = -7.25e30;

#[test]
fn sharded_kd_matches_the_unsharded_kd_loss() {
    let (n, v) = (7, 53);
    let k = KD_RECORD_FIELDS;
    let ks = KD_ROW_STATS_FIELDS;
    assert_eq!((k, ks), (5, 5));
    let mut rng = Rng::new(53);
    let mut s = rng.f32s(n * v, -4.0, 4.0);
    let mut te = rng.f32s(n * v, -5.0, 3.0);
    // Row 3: the first 22 columns (all of shard 0 in both layouts, and 2 of shard 1) have probability 0
    // under both distributions: the terms add 0, a whole shard's record is empty.
    for j in 0..22 {
        s[3 * v + j] = f32::NEG_INFINITY;
        te[3 * v + j] = f32::NEG_INFINITY;
    }
    // Row 5 is masked.
    let targets: Vec<i64> = vec![0, 1, 2, 3, 4, -100, 6];
    let masked = 5;
    let (sd, td) = (widen(&s), widen(&te));

    let layouts = [
        Layout::new("uneven [20, 33]", &[20, 33], &[0, 0]),
        // Equal widths of 20: the last shard holds global columns 40..52 and 7 NaN padding columns.
        Layout::new("padded [20, 20, 13 + 7]", &[20, 20, 13], &[0, 0, 7]),
    ];
    let h = cpu();
    let gl_rows: Vec<f32> = rng.f32s(n, -1.5, 2.0);
    let gl_scalar = 0.75f32;
    for (div, dref) in [(Divergence::ForwardKl, Div::Fkl), (Divergence::ReverseKl, Div::Rkl)] {
        for (red, t, t2) in
            [(Reduction::None, 1.0f32, false), (Reduction::Mean, 2.0, true), (Reduction::Sum, 0.5, false)]
        {
            let base = KdOptions::new().divergence(div).reduction(red).temperature(t).scale_by_t2(t2);
            let per_row = red == Reduction::None;
            let loss_len = if per_row { n } else { 1 };
            let grad_loss = if per_row { TensorRef::vector(&gl_rows) } else { TensorRef::scalar(&gl_scalar) };
            let case = format!("{:?}/{:?}/T={}", div, red, t);

            // The unsharded call, with its gradient.
            let mut loss = vec![0f32; loss_len];
            let mut ds = vec![0f32; n * v];
            h.kd_loss(
                &TensorRef::matrix(&s, n, v).unwrap(),
                &Teacher::Logits(TensorRef::matrix(&te, n, v).unwrap()),
                Some(&TensorRef::vector(&targets)),
                &base,
                &mut KdOutputs::new(loss_view(per_row, &mut loss))
                    .dstudent(TensorMut::matrix(&mut ds, n, v).unwrap())
                    .grad_loss(grad_loss),
            )
            .unwrap();
            // ... against float64, so that the comparisons below compare something.
            let row_kl: Vec<f64> =
                (0..n).map(|i| kd_row_full(dref, &sd[i * v..(i + 1) * v], &td[i * v..(i + 1) * v], t as f64)).collect();
            let scale = if t2 { (t as f64).powi(2) } else { 1.0 };
            let rows: Vec<f64> = (0..n).map(|i| if i == masked { 0.0 } else { scale * row_kl[i] }).collect();
            let want = match red {
                Reduction::None => rows.clone(),
                Reduction::Sum => vec![rows.iter().sum::<f64>()],
                Reduction::Mean => vec![rows.iter().sum::<f64>() / (n - 1) as f64],
            };
            assert_close(&format!("{}: kd_loss vs float64", case), &widen(&loss), &want, 1e-6, 1e-5);
            assert!(want.iter().all(|&l| l >= 0.0) && want.iter().any(|&l| l > 0.05), "{}: trivial losses", case);
            assert!(ds.iter().filter(|g| g.abs() > 1e-3).count() > n * v / 4, "{}: trivial dstudent", case);

            for lay in &layouts {
                let what = |x: &str| format!("{} {}: {}", case, lay.name, x);
                let w = lay.ranks();
                let shard_opts = |r: usize| base.vocab_start(lay.starts[r] as i64).vocab_total(v as i64);
                let ss: Vec<Vec<f32>> = (0..w).map(|r| lay.shard_cols(&s, n, v, r)).collect();
                let ts: Vec<Vec<f32>> = (0..w).map(|r| lay.shard_cols(&te, n, v, r)).collect();

                // 1. partial per rank, written straight into its slot of the stacked [W, N, 5] records.
                let mut records = vec![UNWRITTEN; w * n * k];
                for (r, rec) in records.chunks_mut(n * k).enumerate() {
                    h.kd_partial(
                        &TensorRef::matrix(&ss[r], n, lay.cols(r)).unwrap(),
                        &Teacher::Logits(TensorRef::matrix(&ts[r], n, lay.cols(r)).unwrap()),
                        &shard_opts(r),
                        &mut TensorMut::matrix(rec, n, k).unwrap(),
                    )
                    .unwrap();
                }
                assert!(records.iter().all(|&x| x != UNWRITTEN), "{}", what("records left unwritten"));
                assert!(records.iter().all(|x| !x.is_nan()), "{}", what("NaN in the records (padding read?)"));

                // 3. combine, loss and row statistics; every rank's call (its own vocab_start, not read)
                // gives the same bits.
                let rec = TensorRef::new(&records, &[w, n, k]).unwrap();
                let mut results = Vec::new();
                for r in 0..w {
                    let mut closs = vec![UNWRITTEN; loss_len];
                    let mut stats = vec![UNWRITTEN; n * ks];
                    h.kd_combine(
                        &rec,
                        Some(&TensorRef::vector(&targets)),
                        &shard_opts(r),
                        &mut loss_view(per_row, &mut closs),
                        Some(&mut TensorMut::matrix(&mut stats, n, ks).unwrap()),
                    )
                    .unwrap();
                    results.push((closs, stats));
                }
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                for (cl, st) in &results[1..] {
                    assert_eq!(bits(cl), bits(&results[0].0), "{}", what("loss differs between ranks"));
                    assert_eq!(bits(st), bits(&results[0].1), "{}", what("row_stats differ between ranks"));
                }
                let (closs, stats) = &results[0];
                assert_close(&what("loss"), &widen(closs), &widen(&loss), 0.0, 2e-5);
                if per_row {
                    assert_eq!(closs[masked], 0.0, "{}", what("masked row's loss"));
                }
                // Without the row statistics the loss is the same.
                let mut closs2 = vec![0f32; loss_len];
                h.kd_combine(
                    &rec,
                    Some(&TensorRef::vector(&targets)),
                    &shard_opts(0),
                    &mut loss_view(per_row, &mut closs2),
                    None,
                )
                .unwrap();
                assert_eq!(bits(&closs2), bits(closs), "{}", what("loss without row_stats"));

                // The statistics of the unmasked rows against float64 (the header's fields): 0 M_student,
                // 1 log D_student, 2 M_teacher, 3 log D_teacher, 4 A (forward KL: -1; reverse KL: KL + 1).
                for i in (0..n).filter(|&i| i != masked) {
                    let st = widen(&stats[i * ks..(i + 1) * ks]);
                    let z = |x: &[f64]| x.iter().map(|&a| a / t as f64).collect::<Vec<_>>();
                    let (zs, zt) = (z(&sd[i * v..(i + 1) * v]), z(&td[i * v..(i + 1) * v]));
                    let (ms, mt) = (
                        zs.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
                        zt.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
                    );
                    let ld = |z: &[f64], m: f64| logsumexp(z) - m;
                    let a = match dref {
                        Div::Fkl => -1.0,
                        _ => row_kl[i] + 1.0,
                    };
                    assert_close(
                        &what(&format!("row_stats row {}", i)),
                        &st,
                        &[ms, ld(&zs, ms), mt, ld(&zt, mt), a],
                        1e-5,
                        1e-5,
                    );
                }

                // 4. each shard's gradient: its columns of the unsharded dstudent, 0 in the padding and
                // the masked row (the output starts at 7 so that unwritten elements show).
                for r in 0..w {
                    let (st, wd, c) = (lay.starts[r], lay.widths[r], lay.cols(r));
                    let student = TensorRef::matrix(&ss[r], n, c).unwrap();
                    let teacher = Teacher::Logits(TensorRef::matrix(&ts[r], n, c).unwrap());
                    let row_stats = TensorRef::matrix(stats, n, ks).unwrap();
                    let mut dshard = vec![7f32; n * c];
                    h.kd_bwd(
                        &student,
                        &teacher,
                        Some(&TensorRef::vector(&targets)),
                        &row_stats,
                        &shard_opts(r),
                        Some(&grad_loss),
                        &mut TensorMut::matrix(&mut dshard, n, c).unwrap(),
                    )
                    .unwrap();
                    for i in 0..n {
                        let got = &dshard[i * c..(i + 1) * c];
                        assert_close(
                            &what(&format!("shard {} dstudent row {}", r, i)),
                            &widen(&got[..wd]),
                            &widen(&ds[i * v + st..i * v + st + wd]),
                            1e-6,
                            1e-4,
                        );
                        assert!(
                            got[wd..].iter().all(|&g| g == 0.0),
                            "{}: padding gradient {:?}",
                            what(&format!("shard {} row {}", r, i)),
                            &got[wd..]
                        );
                    }
                    assert!(
                        dshard[masked * c..(masked + 1) * c].iter().all(|&g| g == 0.0),
                        "{}",
                        what("masked row's gradient")
                    );

                    // In place: the same bits, written over the student's copy.
                    let mut inplace = ss[r].clone();
                    h.kd_bwd_in_place(
                        &mut TensorMut::matrix(&mut inplace, n, c).unwrap(),
                        &teacher,
                        Some(&TensorRef::vector(&targets)),
                        &row_stats,
                        &shard_opts(r),
                        Some(&grad_loss),
                    )
                    .unwrap();
                    assert_eq!(bits(&inplace), bits(&dshard), "{}", what(&format!("shard {} in place", r)));

                    // A CPU handle needs no workspace.
                    let ws = h
                        .kd_bwd_workspace_size(
                            &student,
                            &teacher,
                            Some(&TensorRef::vector(&targets)),
                            &row_stats,
                            &shard_opts(r),
                            Some(&grad_loss),
                            &mut TensorMut::matrix(&mut dshard, n, c).unwrap(),
                        )
                        .unwrap();
                    assert_eq!(ws, 0, "{}", what("kd_bwd workspace"));
                }
                let mut closs3 = vec![0f32; loss_len];
                let mut stats3 = vec![0f32; n * ks];
                let ws = h
                    .kd_combine_workspace_size(
                        &rec,
                        Some(&TensorRef::vector(&targets)),
                        &shard_opts(0),
                        &mut loss_view(per_row, &mut closs3),
                        Some(&mut TensorMut::matrix(&mut stats3, n, ks).unwrap()),
                    )
                    .unwrap();
                assert_eq!(ws, 0, "{}", what("kd_combine workspace"));
            }
        }
    }
}

/// No targets and no upstream gradient (None = 1): the mean is over every row.
#[test]
fn sharded_kd_without_targets_or_grad_loss() {
    let (n, v) = (7, 53);
    let mut rng = Rng::new(54);
    let s = rng.f32s(n * v, -3.0, 3.0);
    let te = rng.f32s(n * v, -3.0, 3.0);
    let lay = Layout::new("padded [27, 26 + 1]", &[27, 26], &[0, 1]);
    let h = cpu();
    for div in [Divergence::ForwardKl, Divergence::ReverseKl] {
        let base = KdOptions::new().divergence(div);
        let mut loss = 0f32;
        let mut ds = vec![0f32; n * v];
        h.kd_loss(
            &TensorRef::matrix(&s, n, v).unwrap(),
            &Teacher::Logits(TensorRef::matrix(&te, n, v).unwrap()),
            None,
            &base,
            &mut KdOutputs::new(TensorMut::scalar(&mut loss)).dstudent(TensorMut::matrix(&mut ds, n, v).unwrap()),
        )
        .unwrap();
        assert!(loss > 0.05, "{:?}: loss {}", div, loss);
        let w = lay.ranks();
        let opts = |r: usize| base.vocab_start(lay.starts[r] as i64).vocab_total(v as i64);
        let ss: Vec<Vec<f32>> = (0..w).map(|r| lay.shard_cols(&s, n, v, r)).collect();
        let ts: Vec<Vec<f32>> = (0..w).map(|r| lay.shard_cols(&te, n, v, r)).collect();
        let mut records = vec![0f32; w * n * KD_RECORD_FIELDS];
        for (r, rec) in records.chunks_mut(n * KD_RECORD_FIELDS).enumerate() {
            h.kd_partial(
                &TensorRef::matrix(&ss[r], n, lay.cols(r)).unwrap(),
                &Teacher::Logits(TensorRef::matrix(&ts[r], n, lay.cols(r)).unwrap()),
                &opts(r),
                &mut TensorMut::matrix(rec, n, KD_RECORD_FIELDS).unwrap(),
            )
            .unwrap();
        }
        let mut closs = 0f32;
        let mut stats = vec![0f32; n * KD_ROW_STATS_FIELDS];
        h.kd_combine(
            &TensorRef::new(&records, &[w, n, KD_RECORD_FIELDS]).unwrap(),
            None,
            &opts(0),
            &mut TensorMut::scalar(&mut closs),
            Some(&mut TensorMut::matrix(&mut stats, n, KD_ROW_STATS_FIELDS).unwrap()),
        )
        .unwrap();
        assert_close(&format!("{:?} loss", div), &[closs as f64], &[loss as f64], 0.0, 2e-5);
        for r in 0..w {
            let (st, wd, c) = (lay.starts[r], lay.widths[r], lay.cols(r));
            let mut dshard = vec![7f32; n * c];
            h.kd_bwd(
                &TensorRef::matrix(&ss[r], n, c).unwrap(),
                &Teacher::Logits(TensorRef::matrix(&ts[r], n, c).unwrap()),
                None,
                &TensorRef::matrix(&stats, n, KD_ROW_STATS_FIELDS).unwrap(),
                &opts(r),
                None,
                &mut TensorMut::matrix(&mut dshard, n, c).unwrap(),
            )
            .unwrap();
            for i in 0..n {
                let got = &dshard[i * c..(i + 1) * c];
                assert_close(
                    &format!("{:?} shard {} dstudent row {}", div, r, i),
                    &widen(&got[..wd]),
                    &widen(&ds[i * v + st..i * v + st + wd]),
                    1e-6,
                    1e-4,
                );
                assert!(got[wd..].iter().all(|&g| g == 0.0), "{:?} shard {} row {}: padding", div, r, i);
            }
        }
    }
}

#[test]
fn sharded_kd_bad_inputs() {
    let h = cpu();
    let (n, v, vt) = (2, 3, 6);
    let k = KD_RECORD_FIELDS;
    let s = [0.5f32, -1.0, 2.0, 0.0, 1.0, 3.0];
    let te = [1.0f32, 0.0, -2.0, 0.5, 0.5, 1.0];
    let sm = TensorRef::matrix(&s, n, v).unwrap();
    let teacher = Teacher::Logits(TensorRef::matrix(&te, n, v).unwrap());
    let shard = KdOptions::new().vocab_start(3).vocab_total(vt);
    let unsharded = KdOptions::new();
    assert_eq!((unsharded.vocab_start, unsharded.vocab_total), (0, 0), "KdOptions defaults");
    let jsd = shard.divergence(Divergence::Jsd); // β = 0.5, the default
    let mut rec = vec![-1f32; n * k];
    let mut loss = -1f32;
    let mut ds = vec![-1f32; n * v];

    // The unsharded kd_loss refuses a shard (vocab_total reaches the library).
    expect_err(
        h.kd_loss(&sm, &teacher, None, &shard, &mut KdOutputs::new(TensorMut::scalar(&mut loss))),
        Status::INVALID_ARGUMENT,
        "vocab_total",
    );

    // The partial call needs a shard ...
    expect_err(
        h.kd_partial(&sm, &teacher, &unsharded, &mut TensorMut::matrix(&mut rec, n, k).unwrap()),
        Status::INVALID_ARGUMENT,
        "vocab_total",
    );
    // ... with vocab_start inside [0, vocab_total) (vocab_start reaches the library),
    expect_err(
        h.kd_partial(&sm, &teacher, &shard.vocab_start(vt), &mut TensorMut::matrix(&mut rec, n, k).unwrap()),
        Status::INVALID_ARGUMENT,
        "vocab_start",
    );
    // ... forward or reverse KL,
    expect_err(
        h.kd_partial(&sm, &teacher, &jsd, &mut TensorMut::matrix(&mut rec, n, k).unwrap()),
        Status::NOT_IMPLEMENTED,
        "JSD",
    );
    // ... full teacher logits,
    let ids = [0i64, 1, 2, 0];
    let lps = [-0.5f32, -1.5, -0.7, -0.9];
    let topk =
        Teacher::TopK { ids: TensorRef::matrix(&ids, n, 2).unwrap(), logprobs: TensorRef::matrix(&lps, n, 2).unwrap() };
    expect_err(
        h.kd_partial(&sm, &topk, &shard, &mut TensorMut::matrix(&mut rec, n, k).unwrap()),
        Status::NOT_IMPLEMENTED,
        "top-K",
    );
    // ... and records [N, 5].
    expect_err(
        h.kd_partial(&sm, &teacher, &shard, &mut TensorMut::matrix(&mut rec[..n * (k - 1)], n, k - 1).unwrap()),
        Status::SHAPE_MISMATCH,
        "records",
    );
    assert!(rec.iter().all(|&r| r == -1.0), "a failed call wrote records");
    h.kd_partial(&sm, &teacher, &shard, &mut TensorMut::matrix(&mut rec, n, k).unwrap()).unwrap();
    assert!(rec.iter().any(|&r| r != -1.0), "records not written");

    // The combine takes [W, N, 5] records, 3-D ...
    expect_err(
        h.kd_combine(&TensorRef::matrix(&rec, n, k).unwrap(), None, &shard, &mut TensorMut::scalar(&mut loss), None),
        Status::SHAPE_MISMATCH,
        "3-D",
    );
    let rec3 = TensorRef::new(&rec, &[1, n, k]).unwrap();
    // ... needs vocab_total ...
    expect_err(
        h.kd_combine(&rec3, None, &unsharded, &mut TensorMut::scalar(&mut loss), None),
        Status::INVALID_ARGUMENT,
        "vocab_total",
    );
    // ... and forward or reverse KL.
    expect_err(
        h.kd_combine(&rec3, None, &jsd, &mut TensorMut::scalar(&mut loss), None),
        Status::NOT_IMPLEMENTED,
        "JSD",
    );
    assert_eq!(loss, -1.0, "a failed call wrote the loss");
    let mut stats = vec![0f32; n * KD_ROW_STATS_FIELDS];
    h.kd_combine(
        &rec3,
        None,
        &shard,
        &mut TensorMut::scalar(&mut loss),
        Some(&mut TensorMut::matrix(&mut stats, n, KD_ROW_STATS_FIELDS).unwrap()),
    )
    .unwrap();
    assert!(loss.is_finite() && loss != -1.0, "loss {}", loss);
    let rs = TensorRef::matrix(&stats, n, KD_ROW_STATS_FIELDS).unwrap();

    // The backward: the same refusals.
    expect_err(
        h.kd_bwd(&sm, &teacher, None, &rs, &unsharded, None, &mut TensorMut::matrix(&mut ds, n, v).unwrap()),
        Status::INVALID_ARGUMENT,
        "vocab_total",
    );
    expect_err(
        h.kd_bwd(&sm, &teacher, None, &rs, &jsd, None, &mut TensorMut::matrix(&mut ds, n, v).unwrap()),
        Status::NOT_IMPLEMENTED,
        "JSD",
    );
    expect_err(
        h.kd_bwd(&sm, &topk, None, &rs, &shard, None, &mut TensorMut::matrix(&mut ds, n, v).unwrap()),
        Status::NOT_IMPLEMENTED,
        "top-K",
    );
    expect_err(
        h.kd_bwd(
            &sm,
            &teacher,
            None,
            &TensorRef::matrix(&stats[..n * 4], n, 4).unwrap(),
            &shard,
            None,
            &mut TensorMut::matrix(&mut ds, n, v).unwrap(),
        ),
        Status::SHAPE_MISMATCH,
        "row_stats",
    );
    assert!(ds.iter().all(|&d| d == -1.0), "a failed call wrote dstudent");
    h.kd_bwd(&sm, &teacher, None, &rs, &shard, None, &mut TensorMut::matrix(&mut ds, n, v).unwrap()).unwrap();
    assert!(ds.iter().all(|&d| d != -1.0 && d.is_finite()), "dstudent {:?}", ds);
}
