//! Vocabulary-parallel knowledge distillation (`kd_partial`, `kd_combine`, `kd_bwd`; the second exchange of
//! JSD and of a top-K teacher: `kd_combine_row_stats`, `kd_terms_partial`, `kd_terms_combine`) on the CPU
//! backend: student and teacher logits split into shards (uneven, and equal-width with a NaN-padded last
//! shard), or a whole top-K teacher of global ids on every rank, records stacked in rank order, combined,
//! and each shard's gradient, against the unsharded `kd_loss` (itself checked here against the float64
//! reference of `support/reference.rs`, for JSD's gradient against one written here, for a top-K teacher
//! against central differences of the reference); then the statuses of bad inputs.
#[path = "support/reference.rs"]
mod reference;

use fusedce::{
    Divergence, Error, Handle, KdOptions, KdOutputs, Reduction, Status, Teacher, TensorMut, TensorRef, TopkNorm,
    KD_RECORD_FIELDS, KD_ROW_STATS_FIELDS, KD_TERMS_RECORD_FIELDS,
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

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Row `i` of `x` `[N, v]`.
fn row(x: &[f64], v: usize, i: usize) -> &[f64] {
    &x[i * v..(i + 1) * v]
}

/// A row's float64 log-probabilities at z = logits / T: the teacher's (lp) and the student's (lq).
fn log_probs(s: &[f64], te: &[f64], t: f64) -> (Vec<f64>, Vec<f64>) {
    let log_softmax = |x: &[f64]| {
        let z: Vec<f64> = x.iter().map(|&a| a / t).collect();
        let l = logsumexp(&z);
        z.iter().map(|&zj| zj - l).collect::<Vec<_>>()
    };
    (log_softmax(te), log_softmax(s))
}

/// The fields 0-3 of a row's statistics in float64: M_student, log D_student, M_teacher, log D_teacher
/// (z = logits / T, M the max of z, D = Σ exp(z − M)).
fn stats_ref(s: &[f64], te: &[f64], t: f64) -> Vec<f64> {
    let mut out = Vec::new();
    for x in [s, te] {
        let z: Vec<f64> = x.iter().map(|&a| a / t).collect();
        let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        out.extend([m, logsumexp(&z) - m]);
    }
    out
}

#[test]
fn sharded_kd_matches_the_unsharded_kd_loss() {
    let (n, v) = (7, 53);
    let k = KD_RECORD_FIELDS;
    let ks = KD_ROW_STATS_FIELDS;
    assert_eq!((k, ks), (7, 5));
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

                // 1. partial per rank, written straight into its slot of the stacked [W, N, 7] records.
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
                // Fields 5-6: the shard's column range [vocab_start, end), padding excluded.
                for (r, rec) in records.chunks(n * k).enumerate() {
                    let want = (lay.starts[r] as i64, (lay.starts[r] + lay.widths[r]) as i64);
                    assert!(rec.chunks(k).all(|f| range_of(f, 5) == want), "{}", what("records' ranges"));
                }

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
                    let mut want = stats_ref(row(&sd, v, i), row(&td, v, i), t as f64);
                    want.push(match dref {
                        Div::Fkl => -1.0,
                        _ => row_kl[i] + 1.0,
                    });
                    let st = widen(&stats[i * ks..(i + 1) * ks]);
                    assert_close(&what(&format!("row_stats row {}", i)), &st, &want, 1e-5, 1e-5);
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
    // ... with vocab_start inside [0, vocab_total] (vocab_start reaches the library; vocab_total itself is
    // a shard of padding alone),
    expect_err(
        h.kd_partial(&sm, &teacher, &shard.vocab_start(vt + 1), &mut TensorMut::matrix(&mut rec, n, k).unwrap()),
        Status::INVALID_ARGUMENT,
        "vocab_start",
    );
    // ... teacher logits of the student's shape, or a top-K teacher of N rows whose log-probabilities are
    // the ids' shape (any divergence: JSD in sharded_jsd_bad_inputs),
    let ids = [0i64, 1, 2, 0];
    let lps = [-0.5f32, -1.5, -0.7, -0.9];
    let topk =
        Teacher::TopK { ids: TensorRef::matrix(&ids, n, 2).unwrap(), logprobs: TensorRef::matrix(&lps, n, 2).unwrap() };
    let topk_short_lps = Teacher::TopK {
        ids: TensorRef::matrix(&ids, n, 2).unwrap(),
        logprobs: TensorRef::matrix(&lps[..2], n, 1).unwrap(),
    };
    let topk_one_row = Teacher::TopK {
        ids: TensorRef::matrix(&ids[..2], 1, 2).unwrap(),
        logprobs: TensorRef::matrix(&lps[..2], 1, 2).unwrap(),
    };
    expect_err(
        h.kd_partial(
            &sm,
            &Teacher::Logits(TensorRef::matrix(&te[..4], n, 2).unwrap()),
            &shard,
            &mut TensorMut::matrix(&mut rec, n, k).unwrap(),
        ),
        Status::SHAPE_MISMATCH,
        "teacher->logits",
    );
    expect_err(
        h.kd_partial(&sm, &topk_short_lps, &shard, &mut TensorMut::matrix(&mut rec, n, k).unwrap()),
        Status::SHAPE_MISMATCH,
        "topk_logprobs",
    );
    expect_err(
        h.kd_partial(&sm, &topk_one_row, &shard, &mut TensorMut::matrix(&mut rec, n, k).unwrap()),
        Status::SHAPE_MISMATCH,
        "topk_ids",
    );
    // ... and records [N, 7].
    expect_err(
        h.kd_partial(&sm, &teacher, &shard, &mut TensorMut::matrix(&mut rec[..n * (k - 1)], n, k - 1).unwrap()),
        Status::SHAPE_MISMATCH,
        "records",
    );
    assert!(rec.iter().all(|&r| r == -1.0), "a failed call wrote records");
    // A top-K teacher over shards (no longer NOT_IMPLEMENTED): its records' cross sum X is NaN.
    h.kd_partial(&sm, &topk, &shard, &mut TensorMut::matrix(&mut rec, n, k).unwrap()).unwrap();
    assert!((0..n).all(|i| rec[i * k + 4].is_nan()), "top-K records {:?}", rec);
    h.kd_partial(&sm, &teacher, &shard, &mut TensorMut::matrix(&mut rec, n, k).unwrap()).unwrap();
    assert!(rec.iter().all(|&r| r != -1.0 && r.is_finite()), "records {:?}", rec);
    // The same logits as the shard [0, 3) before it: the two tile [0, 6), as a combine's records must.
    let mut rec0 = vec![-1f32; n * k];
    h.kd_partial(&sm, &teacher, &shard.vocab_start(0), &mut TensorMut::matrix(&mut rec0, n, k).unwrap()).unwrap();
    let tiled = [rec0, rec.clone()].concat();

    // The combine takes [W, N, 7] records, 3-D ...
    expect_err(
        h.kd_combine(&TensorRef::matrix(&rec, n, k).unwrap(), None, &shard, &mut TensorMut::scalar(&mut loss), None),
        Status::SHAPE_MISMATCH,
        "3-D",
    );
    let rec3 = TensorRef::new(&rec, &[1, n, k]).unwrap();
    // ... and needs vocab_total (JSD's refusal of a loss: sharded_jsd_bad_inputs).
    expect_err(
        h.kd_combine(&rec3, None, &unsharded, &mut TensorMut::scalar(&mut loss), None),
        Status::INVALID_ARGUMENT,
        "vocab_total",
    );
    assert_eq!(loss, -1.0, "a failed call wrote the loss");
    let mut stats = vec![0f32; n * KD_ROW_STATS_FIELDS];
    // One shard's records alone do not tile the vocabulary: a NaN loss and statistics (no error status;
    // forward KL's A, field 4, is its constant -1 whatever the records).
    h.kd_combine(
        &rec3,
        None,
        &shard,
        &mut TensorMut::scalar(&mut loss),
        Some(&mut TensorMut::matrix(&mut stats, n, KD_ROW_STATS_FIELDS).unwrap()),
    )
    .unwrap();
    let nan_stats = stats.chunks(KD_ROW_STATS_FIELDS).all(|r| r[..4].iter().all(|x| x.is_nan()));
    assert!(loss.is_nan() && nan_stats, "loss {} row_stats {:?}", loss, stats);
    h.kd_combine(
        &TensorRef::new(&tiled, &[2, n, k]).unwrap(),
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
        h.kd_bwd(&sm, &topk_short_lps, None, &rs, &shard, None, &mut TensorMut::matrix(&mut ds, n, v).unwrap()),
        Status::SHAPE_MISMATCH,
        "topk_logprobs",
    );
    expect_err(
        h.kd_bwd(&sm, &topk_one_row, None, &rs, &shard, None, &mut TensorMut::matrix(&mut ds, n, v).unwrap()),
        Status::SHAPE_MISMATCH,
        "topk_ids",
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

// ----------------------------------------------------------------------------------------------------
// JSD over shards: the second exchange (kd_combine_row_stats, kd_terms_partial, kd_terms_combine)
// ----------------------------------------------------------------------------------------------------

/// A row's element terms in float64 (the header's "Vocabulary-parallel knowledge distillation"): per column
/// the loss term L_j (`kd_term`) and a_j of the gradient dL/dz_j = a_j − q_j·Σ_k a_k, with p the teacher's
/// and q the student's probabilities: forward KL −p_j; reverse KL q_j·(log(q_j / p_j) + 1); JSD
/// (1 − b)·q_j·log(q_j / m_j), m = b·p + (1 − b)·q; 0 where q_j = 0 (but forward KL's).
fn elem_terms(div: Div, s: &[f64], te: &[f64], t: f64) -> (Vec<f64>, Vec<f64>) {
    let (lp, lq) = log_probs(s, te, t);
    elem_terms_of(div, &lp, &lq)
}

/// The element terms (L_j, a_j) of `elem_terms` from the teacher's (`lp`) and the student's (`lq`)
/// log-probabilities at the same columns (or top-K slots).
fn elem_terms_of(div: Div, lp: &[f64], lq: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let l = (0..lp.len()).map(|j| kd_term(div, lp[j], lq[j])).collect();
    let a = (0..lp.len())
        .map(|j| {
            let (p, q) = (lp[j].exp(), lq[j].exp());
            match div {
                Div::Fkl => -p,
                _ if q == 0.0 => 0.0,
                Div::Rkl => q * (lq[j] - lp[j] + 1.0),
                Div::Jsd(b) => (1.0 - b) * q * (lq[j] - (b * p + (1.0 - b) * q).ln()),
            }
        })
        .collect();
    (l, a)
}

/// JSD's float64 gradient of one row w.r.t. z = student logits / T, M = b·P_teacher + (1 − b)·Q_student:
/// dJSD/dz_j = (1 − b)·q_j·(log(q_j / m_j) − S), S = Σ_k q_k·log(q_k / m_k) (0 where q_j = 0).
fn jsd_dz(b: f64, s: &[f64], te: &[f64], t: f64) -> Vec<f64> {
    let (lp, lq) = log_probs(s, te, t);
    let lm: Vec<f64> = (0..s.len()).map(|j| (b * lp[j].exp() + (1.0 - b) * lq[j].exp()).ln()).collect();
    let q_log_qm = |j: usize| if lq[j].exp() > 0.0 { lq[j].exp() * (lq[j] - lm[j]) } else { 0.0 };
    let sum: f64 = (0..s.len()).map(q_log_qm).sum();
    (0..s.len())
        .map(|j| if lq[j].exp() > 0.0 { (1.0 - b) * lq[j].exp() * (lq[j] - lm[j] - sum) } else { 0.0 })
        .collect()
}

/// Steps 1 and 2: each rank's `kd_partial` with teacher logits, written into its slot of the stacked
/// `[W, N, 7]` records.
fn gathered_partials(
    h: &Handle,
    lay: &Layout,
    ss: &[Vec<f32>],
    ts: &[Vec<f32>],
    n: usize,
    opts: &dyn Fn(usize) -> KdOptions,
) -> Vec<f32> {
    let teacher = |r: usize| Teacher::Logits(TensorRef::matrix(&ts[r], n, lay.cols(r)).unwrap());
    let records = gathered_partials_with(h, lay, ss, &teacher, n, opts);
    assert!(records.iter().all(|x| !x.is_nan()), "{}: NaN in the records", lay.name);
    records
}

/// Steps 1 and 2 with rank r's teacher `teacher(r)` (its logits' shard, or the whole top-K teacher).
fn gathered_partials_with<'t>(
    h: &Handle,
    lay: &Layout,
    ss: &[Vec<f32>],
    teacher: &dyn Fn(usize) -> Teacher<'t>,
    n: usize,
    opts: &dyn Fn(usize) -> KdOptions,
) -> Vec<f32> {
    let k = KD_RECORD_FIELDS;
    let mut records = vec![UNWRITTEN; lay.ranks() * n * k];
    for (r, rec) in records.chunks_mut(n * k).enumerate() {
        h.kd_partial(
            &TensorRef::matrix(&ss[r], n, lay.cols(r)).unwrap(),
            &teacher(r),
            &opts(r),
            &mut TensorMut::matrix(rec, n, k).unwrap(),
        )
        .unwrap();
    }
    assert!(records.iter().all(|&x| x != UNWRITTEN), "{}: records unwritten", lay.name);
    records
}

/// Steps 3a and 3b: each rank's `kd_terms_partial` with teacher logits from the rows' statistics `stats`
/// `[N, 5]`, written into its slot of the stacked `[W, N, 5]` records of the terms.
fn gathered_terms(
    h: &Handle,
    lay: &Layout,
    ss: &[Vec<f32>],
    ts: &[Vec<f32>],
    stats: &[f32],
    n: usize,
    opts: &dyn Fn(usize) -> KdOptions,
) -> Vec<f32> {
    let teacher = |r: usize| Teacher::Logits(TensorRef::matrix(&ts[r], n, lay.cols(r)).unwrap());
    let records = gathered_terms_with(h, lay, ss, &teacher, stats, n, opts);
    // Teacher logits: field 2 is -1.
    let kt = KD_TERMS_RECORD_FIELDS;
    assert!(records.chunks(kt).all(|r| r[2] == -1.0), "{}: slot counts of teacher logits", lay.name);
    records
}

/// Steps 3a and 3b with rank r's teacher `teacher(r)`.
fn gathered_terms_with<'t>(
    h: &Handle,
    lay: &Layout,
    ss: &[Vec<f32>],
    teacher: &dyn Fn(usize) -> Teacher<'t>,
    stats: &[f32],
    n: usize,
    opts: &dyn Fn(usize) -> KdOptions,
) -> Vec<f32> {
    let kt = KD_TERMS_RECORD_FIELDS;
    let mut records = vec![UNWRITTEN; lay.ranks() * n * kt];
    for (r, rec) in records.chunks_mut(n * kt).enumerate() {
        h.kd_terms_partial(
            &TensorRef::matrix(&ss[r], n, lay.cols(r)).unwrap(),
            &teacher(r),
            &TensorRef::matrix(stats, n, KD_ROW_STATS_FIELDS).unwrap(),
            &opts(r),
            &mut TensorMut::matrix(rec, n, kt).unwrap(),
        )
        .unwrap();
    }
    assert!(records.iter().all(|&x| x != UNWRITTEN), "{}: terms' records unwritten", lay.name);
    records
}

/// Checks each shard's terms' records `[W, N, 5]` against the float64 sums of the element terms over the
/// shard's real columns (every row: the partial call has no targets), and their column ranges.
#[allow(clippy::too_many_arguments)]
fn check_terms(what: &str, lay: &Layout, trec: &[f32], div: Div, sd: &[f64], td: &[f64], n: usize, v: usize, t: f64) {
    let kt = KD_TERMS_RECORD_FIELDS;
    for i in 0..n {
        let (l, a) = elem_terms(div, row(sd, v, i), row(td, v, i), t);
        for r in 0..lay.ranks() {
            let cols = lay.starts[r]..lay.starts[r] + lay.widths[r];
            let want = [l[cols.clone()].iter().sum::<f64>(), a[cols.clone()].iter().sum::<f64>(), -1.0];
            let got = &trec[(r * n + i) * kt..(r * n + i + 1) * kt];
            let what = format!("{}: terms' record shard {} row {}", what, r, i);
            assert_close(&what, &widen(&got[..3]), &want, 1e-6, 1e-5);
            assert_eq!(range_of(got, 3), (cols.start as i64, cols.end as i64), "{}: range", what);
        }
    }
}

#[test]
fn sharded_jsd_matches_float64_and_the_unsharded_kd_loss() {
    let (n, v) = (7, 53);
    let (k, ks, kt) = (KD_RECORD_FIELDS, KD_ROW_STATS_FIELDS, KD_TERMS_RECORD_FIELDS);
    assert_eq!(kt, 5);
    let mut rng = Rng::new(55);
    let mut s = rng.f32s(n * v, -4.0, 4.0);
    let mut te = rng.f32s(n * v, -5.0, 3.0);
    // Row 3: the first 22 columns (all of shard 0, and 2 of shard 1) have probability 0 under both
    // distributions: M = 0 there, the terms add 0, shard 0's records are empty.
    for j in 0..22 {
        s[3 * v + j] = f32::NEG_INFINITY;
        te[3 * v + j] = f32::NEG_INFINITY;
    }
    // Row 2: the student has probability 0 where the teacher has mass (column 3, shard 0); row 4: the
    // teacher has probability 0 where the student has mass (column 30, shard 1). JSD stays finite (M > 0).
    s[2 * v + 3] = f32::NEG_INFINITY;
    te[4 * v + 30] = f32::NEG_INFINITY;
    // Row 5 is masked.
    let targets: Vec<i64> = vec![0, 1, 2, 3, 4, -100, 6];
    let masked = 5;
    let (sd, td) = (widen(&s), widen(&te));
    let layouts = [
        Layout::new("uneven [20, 33]", &[20, 33], &[0, 0]),
        Layout::new("padded [20, 20, 13 + 7]", &[20, 20, 13], &[0, 0, 7]),
    ];
    let h = cpu();
    let tg = TensorRef::vector(&targets);
    let gl_rows: Vec<f32> = rng.f32s(n, -1.5, 2.0);
    let gl_scalar = 0.75f32;
    // (β, reduction, T, T², an upstream gradient given: else None = 1)
    for (beta, red, t, t2, with_gl) in [
        (0.5f32, Reduction::None, 1.0f32, false, true),
        (0.1, Reduction::Mean, 2.0, true, true),
        (0.75, Reduction::Sum, 0.5, false, false),
    ] {
        let (b, tt) = (beta as f64, t as f64);
        let base =
            KdOptions::new().divergence(Divergence::Jsd).beta(beta).reduction(red).temperature(t).scale_by_t2(t2);
        let per_row = red == Reduction::None;
        let loss_len = if per_row { n } else { 1 };
        let gl = if !with_gl {
            None
        } else if per_row {
            Some(TensorRef::vector(&gl_rows))
        } else {
            Some(TensorRef::scalar(&gl_scalar))
        };
        let case = format!("JSD β={}/{:?}/T={}", beta, red, t);

        // The unsharded call, with its gradient ...
        let mut loss = vec![0f32; loss_len];
        let mut ds = vec![0f32; n * v];
        {
            let mut outs =
                KdOutputs::new(loss_view(per_row, &mut loss)).dstudent(TensorMut::matrix(&mut ds, n, v).unwrap());
            if let Some(g) = gl {
                outs = outs.grad_loss(g);
            }
            h.kd_loss(
                &TensorRef::matrix(&s, n, v).unwrap(),
                &Teacher::Logits(TensorRef::matrix(&te, n, v).unwrap()),
                Some(&tg),
                &base,
                &mut outs,
            )
            .unwrap();
        }
        // ... against float64: loss = b·KL(P ‖ M) + (1 − b)·KL(Q ‖ M) per row (kd_row_full), times T² with
        // scale_by_t2, reduced; dstudent = g_i · (1 / the unmasked rows with Mean) · (T² with scale_by_t2) ·
        // dJSD/dz / T.
        let scale = if t2 { tt * tt } else { 1.0 };
        let row_jsd: Vec<f64> = (0..n).map(|i| kd_row_full(Div::Jsd(b), row(&sd, v, i), row(&td, v, i), tt)).collect();
        let rows: Vec<f64> = (0..n).map(|i| if i == masked { 0.0 } else { scale * row_jsd[i] }).collect();
        let want = match red {
            Reduction::None => rows.clone(),
            Reduction::Sum => vec![rows.iter().sum::<f64>()],
            Reduction::Mean => vec![rows.iter().sum::<f64>() / (n - 1) as f64],
        };
        assert_close(&format!("{}: kd_loss vs float64", case), &widen(&loss), &want, 1e-6, 1e-5);
        assert!(row_jsd.iter().all(|l| l.is_finite() && *l > 0.01), "{}: trivial losses {:?}", case, row_jsd);
        let g = |i: usize| match (gl.is_some(), per_row) {
            (false, _) => 1.0,
            (true, true) => gl_rows[i] as f64,
            (true, false) => gl_scalar as f64,
        };
        let factor = if red == Reduction::Mean { 1.0 / (n - 1) as f64 } else { 1.0 };
        let mut want_ds = vec![0.0; n * v];
        for i in (0..n).filter(|&i| i != masked) {
            let dz = jsd_dz(b, row(&sd, v, i), row(&td, v, i), tt);
            for j in 0..v {
                want_ds[i * v + j] = g(i) * factor * scale * dz[j] / tt;
            }
        }
        assert_close(&format!("{}: kd_loss dstudent vs float64", case), &widen(&ds), &want_ds, 1e-6, 1e-4);
        assert!(ds.iter().filter(|g| g.abs() > 1e-4).count() > n * v / 4, "{}: trivial dstudent", case);
        // The reference gradient itself against central differences of the reference loss.
        for i in [0, 6] {
            let an: Vec<f64> = jsd_dz(b, row(&sd, v, i), row(&td, v, i), tt).iter().map(|d| d / tt).collect();
            let fd = fd_grad(row(&sd, v, i), |x| kd_row_full(Div::Jsd(b), x, row(&td, v, i), tt));
            assert_close(&format!("{}: jsd_dz row {} vs finite differences", case, i), &an, &fd, 1e-8, 1e-5);
        }

        for lay in &layouts {
            let what = |x: &str| format!("{} {}: {}", case, lay.name, x);
            let w = lay.ranks();
            let shard_opts = |r: usize| base.vocab_start(lay.starts[r] as i64).vocab_total(v as i64);
            let ss: Vec<Vec<f32>> = (0..w).map(|r| lay.shard_cols(&s, n, v, r)).collect();
            let ts: Vec<Vec<f32>> = (0..w).map(|r| lay.shard_cols(&te, n, v, r)).collect();

            // 1-2. the records of every shard (JSD's: the forward-KL record), stacked [W, N, 7].
            let records = gathered_partials(&h, lay, &ss, &ts, n, &shard_opts);
            let rec = TensorRef::new(&records, &[w, n, k]).unwrap();

            // 3. the statistics alone, the same bits on every rank; A is NaN until the terms' combine.
            let firsts: Vec<Vec<f32>> = (0..w)
                .map(|r| {
                    let mut st = vec![UNWRITTEN; n * ks];
                    h.kd_combine_row_stats(
                        &rec,
                        Some(&tg),
                        &shard_opts(r),
                        &mut TensorMut::matrix(&mut st, n, ks).unwrap(),
                    )
                    .unwrap();
                    st
                })
                .collect();
            for st in &firsts[1..] {
                assert_eq!(bits(st), bits(&firsts[0]), "{}", what("row_stats differ between ranks"));
            }
            let stats0 = &firsts[0];
            assert!(stats0.iter().all(|&x| x != UNWRITTEN), "{}", what("row_stats left unwritten"));
            for i in 0..n {
                assert!(stats0[i * ks + 4].is_nan(), "{}", what(&format!("A of row {} before the terms", i)));
            }
            for i in (0..n).filter(|&i| i != masked) {
                assert_close(
                    &what(&format!("row_stats row {}", i)),
                    &widen(&stats0[i * ks..i * ks + 4]),
                    &stats_ref(row(&sd, v, i), row(&td, v, i), tt),
                    1e-5,
                    1e-5,
                );
            }

            // 3a-3b. each shard's sums of the terms, stacked [W, N, 5].
            let trecords = gathered_terms(&h, lay, &ss, &ts, stats0, n, &shard_opts);
            assert!(trecords.iter().all(|x| !x.is_nan()), "{}", what("NaN in the terms' records (padding read?)"));
            check_terms(&what("JSD"), lay, &trecords, Div::Jsd(b), &sd, &td, n, v, tt);

            // 3c. the loss, and A into the statistics (fields 0-3 kept): the same bits on every rank.
            let trec = TensorRef::new(&trecords, &[w, n, kt]).unwrap();
            let results: Vec<(Vec<f32>, Vec<f32>)> = (0..w)
                .map(|r| {
                    let mut closs = vec![UNWRITTEN; loss_len];
                    let mut st = stats0.clone();
                    h.kd_terms_combine(
                        &trec,
                        Some(&tg),
                        &shard_opts(r),
                        &mut loss_view(per_row, &mut closs),
                        &mut TensorMut::matrix(&mut st, n, ks).unwrap(),
                    )
                    .unwrap();
                    (closs, st)
                })
                .collect();
            for (cl, st) in &results[1..] {
                assert_eq!(bits(cl), bits(&results[0].0), "{}", what("loss differs between ranks"));
                assert_eq!(bits(st), bits(&results[0].1), "{}", what("row_stats differ between ranks"));
            }
            let (closs, stats) = &results[0];
            for i in 0..n {
                let f = i * ks..i * ks + 4;
                assert_eq!(bits(&stats[f.clone()]), bits(&stats0[f]), "{}", what(&format!("fields 0-3 of row {}", i)));
            }
            assert_close(&what("loss vs kd_loss"), &widen(closs), &widen(&loss), 1e-7, 2e-5);
            assert_close(&what("loss vs float64"), &widen(closs), &want, 1e-6, 1e-5);
            if per_row {
                assert_eq!(closs[masked], 0.0, "{}", what("masked row's loss"));
            }
            // A = Σ_j a_j = (1 − b)·S.
            for i in (0..n).filter(|&i| i != masked) {
                let a: f64 = elem_terms(Div::Jsd(b), row(&sd, v, i), row(&td, v, i), tt).1.iter().sum();
                assert_close(&what(&format!("A of row {}", i)), &[stats[i * ks + 4] as f64], &[a], 1e-6, 1e-5);
            }

            // 4. each shard's gradient: its columns of the unsharded dstudent (and of float64), 0 in the
            // padding and the masked row (the output starts at 7 so that unwritten elements show).
            let row_stats = TensorRef::matrix(stats, n, ks).unwrap();
            for r in 0..w {
                let (st, wd, c) = (lay.starts[r], lay.widths[r], lay.cols(r));
                let mut dshard = vec![7f32; n * c];
                h.kd_bwd(
                    &TensorRef::matrix(&ss[r], n, c).unwrap(),
                    &Teacher::Logits(TensorRef::matrix(&ts[r], n, c).unwrap()),
                    Some(&tg),
                    &row_stats,
                    &shard_opts(r),
                    gl.as_ref(),
                    &mut TensorMut::matrix(&mut dshard, n, c).unwrap(),
                )
                .unwrap();
                for i in 0..n {
                    let got = widen(&dshard[i * c..i * c + wd]);
                    let what_row = what(&format!("shard {} dstudent row {}", r, i));
                    assert_close(&what_row, &got, &widen(&ds[i * v + st..i * v + st + wd]), 1e-6, 1e-4);
                    assert_close(&what_row, &got, &want_ds[i * v + st..i * v + st + wd], 1e-6, 1e-4);
                    assert!(dshard[i * c + wd..(i + 1) * c].iter().all(|&g| g == 0.0), "{}: padding", what_row);
                }
                assert!(dshard[masked * c..(masked + 1) * c].iter().all(|&g| g == 0.0), "{}", what("masked row"));
            }

            // A CPU handle needs no workspace for either combine.
            let mut st = stats0.clone();
            let ws = h
                .kd_combine_row_stats_workspace_size(
                    &rec,
                    Some(&tg),
                    &shard_opts(0),
                    &mut TensorMut::matrix(&mut st, n, ks).unwrap(),
                )
                .unwrap();
            assert_eq!(ws, 0, "{}", what("kd_combine_row_stats workspace"));
            let mut closs = vec![0f32; loss_len];
            let ws = h
                .kd_terms_combine_workspace_size(
                    &trec,
                    Some(&tg),
                    &shard_opts(0),
                    &mut loss_view(per_row, &mut closs),
                    &mut TensorMut::matrix(&mut st, n, ks).unwrap(),
                )
                .unwrap();
            assert_eq!(ws, 0, "{}", what("kd_terms_combine workspace"));
        }
    }
}

/// Steps 3a-3c for forward and reverse KL, after `kd_combine` (loss and statistics): the terms give the same
/// loss a second way, and A as `kd_combine` formed it. JSD at β = 0 and 1 is exactly forward and reverse KL
/// (one exchange, `kd_combine` takes its loss).
#[test]
fn sharded_kd_terms_give_kl_a_second_way() {
    let (n, v) = (5, 41);
    let ks = KD_ROW_STATS_FIELDS;
    let mut rng = Rng::new(56);
    let s = rng.f32s(n * v, -3.0, 3.0);
    let te = rng.f32s(n * v, -3.0, 3.0);
    let (sd, td) = (widen(&s), widen(&te));
    let targets: Vec<i64> = vec![0, -100, 2, 3, 4];
    let masked = 1;
    let tg = TensorRef::vector(&targets);
    let lay = Layout::new("padded [14, 14, 13 + 1]", &[14, 14, 13], &[0, 0, 1]);
    let w = lay.ranks();
    let ss: Vec<Vec<f32>> = (0..w).map(|r| lay.shard_cols(&s, n, v, r)).collect();
    let ts: Vec<Vec<f32>> = (0..w).map(|r| lay.shard_cols(&te, n, v, r)).collect();
    let h = cpu();
    for (div, dref, beta_end) in [(Divergence::ForwardKl, Div::Fkl, 0.0f32), (Divergence::ReverseKl, Div::Rkl, 1.0)] {
        for red in [Reduction::None, Reduction::Mean] {
            let case = format!("{:?}/{:?}", div, red);
            let base = KdOptions::new().divergence(div).reduction(red).temperature(1.5).vocab_total(v as i64);
            let opts = |r: usize| base.vocab_start(lay.starts[r] as i64);
            let per_row = red == Reduction::None;
            let loss_len = if per_row { n } else { 1 };
            let records = gathered_partials(&h, &lay, &ss, &ts, n, &opts);
            let rec = TensorRef::new(&records, &[w, n, KD_RECORD_FIELDS]).unwrap();
            let mut loss1 = vec![UNWRITTEN; loss_len];
            let mut stats1 = vec![UNWRITTEN; n * ks];
            h.kd_combine(
                &rec,
                Some(&tg),
                &opts(0),
                &mut loss_view(per_row, &mut loss1),
                Some(&mut TensorMut::matrix(&mut stats1, n, ks).unwrap()),
            )
            .unwrap();

            let trecords = gathered_terms(&h, &lay, &ss, &ts, &stats1, n, &opts);
            check_terms(&case, &lay, &trecords, dref, &sd, &td, n, v, 1.5);
            let mut loss2 = vec![UNWRITTEN; loss_len];
            let mut stats2 = stats1.clone();
            h.kd_terms_combine(
                &TensorRef::new(&trecords, &[w, n, KD_TERMS_RECORD_FIELDS]).unwrap(),
                Some(&tg),
                &opts(0),
                &mut loss_view(per_row, &mut loss2),
                &mut TensorMut::matrix(&mut stats2, n, ks).unwrap(),
            )
            .unwrap();
            assert_close(&format!("{}: loss the second way", case), &widen(&loss2), &widen(&loss1), 1e-7, 2e-5);
            for i in 0..n {
                let f = i * ks..i * ks + 4;
                assert_eq!(bits(&stats2[f.clone()]), bits(&stats1[f]), "{}: fields 0-3 of row {}", case, i);
                if i != masked {
                    let a = (stats2[i * ks + 4] as f64, stats1[i * ks + 4] as f64);
                    assert_close(&format!("{}: A of row {}", case, i), &[a.0], &[a.1], 1e-6, 1e-5);
                }
            }

            // JSD at β = 0 (forward KL) or 1 (reverse KL): the same records, the same loss, bit for bit.
            let end = base.divergence(Divergence::Jsd).beta(beta_end);
            let end_opts = |r: usize| end.vocab_start(lay.starts[r] as i64);
            let end_records = gathered_partials(&h, &lay, &ss, &ts, n, &end_opts);
            assert_eq!(bits(&end_records), bits(&records), "{}: JSD β={} records", case, beta_end);
            let mut loss3 = vec![UNWRITTEN; loss_len];
            h.kd_combine(&rec, Some(&tg), &end_opts(0), &mut loss_view(per_row, &mut loss3), None).unwrap();
            assert_eq!(bits(&loss3), bits(&loss1), "{}: JSD β={} loss", case, beta_end);
        }
    }
}

/// JSD's combine refuses a loss, the statistics-only combine takes any divergence, the terms' calls refuse
/// their bad inputs (the terms' combine also a missing row_stats, through the C API); no failed call writes
/// an output.
#[test]
fn sharded_jsd_bad_inputs() {
    use fusedce::sys;
    let h = cpu();
    let (n, v, vt) = (2, 3, 6);
    let (k, ks, kt) = (KD_RECORD_FIELDS, KD_ROW_STATS_FIELDS, KD_TERMS_RECORD_FIELDS);
    let s = [0.5f32, -1.0, 2.0, 0.0, 1.0, 3.0];
    let te = [1.0f32, 0.0, -2.0, 0.5, 0.5, 1.0];
    let sm = TensorRef::matrix(&s, n, v).unwrap();
    let teacher = Teacher::Logits(TensorRef::matrix(&te, n, v).unwrap());
    let ids = [0i64, 1, 2, 0];
    let lps = [-0.5f32, -1.5, -0.7, -0.9];
    let topk =
        Teacher::TopK { ids: TensorRef::matrix(&ids, n, 2).unwrap(), logprobs: TensorRef::matrix(&lps, n, 2).unwrap() };
    let jsd = KdOptions::new().divergence(Divergence::Jsd).vocab_start(3).vocab_total(vt); // β = 0.5, the default
    let kl = jsd.divergence(Divergence::ForwardKl);
    let unsharded = jsd.vocab_start(0).vocab_total(0);
    const POISON: f32 = -1.0;
    let poisoned = |x: &[f32]| x.iter().all(|&v| v == POISON);

    // The partial call takes JSD, and a top-K teacher (neither NOT_IMPLEMENTED any longer).
    let mut rec = vec![POISON; n * k];
    h.kd_partial(&sm, &topk, &jsd, &mut TensorMut::matrix(&mut rec, n, k).unwrap()).unwrap();
    assert!(!poisoned(&rec), "kd_partial of a top-K teacher wrote no records");
    h.kd_partial(&sm, &teacher, &jsd, &mut TensorMut::matrix(&mut rec, n, k).unwrap()).unwrap();
    // With the same logits as the shard [0, 3) before it, the records tile [0, 6) as a combine needs.
    let mut rec0 = vec![POISON; n * k];
    h.kd_partial(&sm, &teacher, &jsd.vocab_start(0), &mut TensorMut::matrix(&mut rec0, n, k).unwrap()).unwrap();
    let tiled = [rec0, rec.clone()].concat();
    let rec3 = TensorRef::new(&tiled, &[2, n, k]).unwrap();

    // JSD's combine refuses a loss (it comes from the terms' combine), with or without the statistics.
    let mut loss = POISON;
    let mut stats = vec![POISON; n * ks];
    expect_err(
        h.kd_combine(
            &rec3,
            None,
            &jsd,
            &mut TensorMut::scalar(&mut loss),
            Some(&mut TensorMut::matrix(&mut stats, n, ks).unwrap()),
        ),
        Status::INVALID_ARGUMENT,
        "fce_kd_terms_combine",
    );
    expect_err(
        h.kd_combine(&rec3, None, &jsd, &mut TensorMut::scalar(&mut loss), None),
        Status::INVALID_ARGUMENT,
        "fce_kd_terms_combine",
    );
    expect_err(
        h.kd_combine_workspace_size(&rec3, None, &jsd, &mut TensorMut::scalar(&mut loss), None).map(|_| ()),
        Status::INVALID_ARGUMENT,
        "fce_kd_terms_combine",
    );
    // The statistics-only combine takes KL too (no longer INVALID_ARGUMENT): kd_combine's statistics, A
    // included (forward KL: -1).
    let mut kl_stats = vec![POISON; n * ks];
    let mut kl_stats_with_loss = vec![POISON; n * ks];
    h.kd_combine_row_stats(&rec3, None, &kl, &mut TensorMut::matrix(&mut kl_stats, n, ks).unwrap()).unwrap();
    let mut kl_loss = POISON;
    h.kd_combine(
        &rec3,
        None,
        &kl,
        &mut TensorMut::scalar(&mut kl_loss),
        Some(&mut TensorMut::matrix(&mut kl_stats_with_loss, n, ks).unwrap()),
    )
    .unwrap();
    assert_eq!(bits(&kl_stats), bits(&kl_stats_with_loss), "KL's statistics without and with the loss");
    assert!((0..n).all(|i| kl_stats[i * ks + 4] == -1.0), "forward KL's A: {:?}", kl_stats);
    expect_err(
        h.kd_combine_row_stats(&rec3, None, &jsd, &mut TensorMut::matrix(&mut stats[..n * 4], n, 4).unwrap()),
        Status::SHAPE_MISMATCH,
        "row_stats",
    );
    assert!(loss == POISON && poisoned(&stats), "a failed combine wrote an output");
    h.kd_combine_row_stats(&rec3, None, &jsd, &mut TensorMut::matrix(&mut stats, n, ks).unwrap()).unwrap();
    for i in 0..n {
        assert!(stats[i * ks..i * ks + 4].iter().all(|x| x.is_finite()), "row_stats {:?}", stats);
        assert!(stats[i * ks + 4].is_nan(), "A before the terms: {:?}", stats);
    }
    let rs = TensorRef::matrix(&stats, n, ks).unwrap();

    // The terms' partial: records [N, 5], statistics [N, 5], a teacher of the right shape, a shard.
    let mut trec = vec![POISON; n * kt];
    let mut wide = vec![POISON; n * k];
    expect_err(
        h.kd_terms_partial(&sm, &teacher, &rs, &jsd, &mut TensorMut::matrix(&mut wide, n, k).unwrap()),
        Status::SHAPE_MISMATCH,
        "records",
    );
    expect_err(
        h.kd_terms_partial(
            &sm,
            &teacher,
            &TensorRef::matrix(&stats[..n * 4], n, 4).unwrap(),
            &jsd,
            &mut TensorMut::matrix(&mut trec, n, kt).unwrap(),
        ),
        Status::SHAPE_MISMATCH,
        "row_stats",
    );
    let topk_short_lps = Teacher::TopK {
        ids: TensorRef::matrix(&ids, n, 2).unwrap(),
        logprobs: TensorRef::matrix(&lps[..2], n, 1).unwrap(),
    };
    expect_err(
        h.kd_terms_partial(&sm, &topk_short_lps, &rs, &jsd, &mut TensorMut::matrix(&mut trec, n, kt).unwrap()),
        Status::SHAPE_MISMATCH,
        "topk_logprobs",
    );
    expect_err(
        h.kd_terms_partial(&sm, &teacher, &rs, &unsharded, &mut TensorMut::matrix(&mut trec, n, kt).unwrap()),
        Status::INVALID_ARGUMENT,
        "vocab_total",
    );
    assert!(poisoned(&trec) && poisoned(&wide), "a failed kd_terms_partial wrote records");
    h.kd_terms_partial(&sm, &teacher, &rs, &jsd, &mut TensorMut::matrix(&mut trec, n, kt).unwrap()).unwrap();
    assert!(trec.iter().all(|x| x.is_finite()), "terms' records {:?}", trec);
    assert!((0..n).all(|i| trec[i * kt + 2] == -1.0), "slot counts of teacher logits: {:?}", trec);
    // A top-K teacher's terms (no longer NOT_IMPLEMENTED): ids 0-2 are not in this shard [3, 6), so no slot.
    let mut topk_trec = vec![POISON; n * kt];
    h.kd_terms_partial(&sm, &topk, &rs, &jsd, &mut TensorMut::matrix(&mut topk_trec, n, kt).unwrap()).unwrap();
    // (Fields 3-4: the shard's column range [3, 6).)
    let range = |r: &[f32]| [r[3].to_bits(), r[4].to_bits()];
    assert!(topk_trec.chunks(kt).all(|r| r[..3] == [0.0; 3] && range(r) == [3, 6]), "{:?}", topk_trec);
    assert!(trec.chunks(kt).all(|r| range(r) == [3, 6]), "terms' records' range {:?}", trec);
    let mut trec0 = vec![POISON; n * kt];
    h.kd_terms_partial(&sm, &teacher, &rs, &jsd.vocab_start(0), &mut TensorMut::matrix(&mut trec0, n, kt).unwrap())
        .unwrap();
    let ttiled = [trec0, trec.clone()].concat();
    let trec3 = TensorRef::new(&ttiled, &[2, n, kt]).unwrap();

    // The terms' combine: [W, N, 5] records, 3-D, a shard's options, the statistics [N, 5] ...
    let stats_before = stats.clone();
    expect_err(
        h.kd_terms_combine(
            &rec3,
            None,
            &jsd,
            &mut TensorMut::scalar(&mut loss),
            &mut TensorMut::matrix(&mut stats, n, ks).unwrap(),
        ),
        Status::SHAPE_MISMATCH,
        &format!("K = {}", kt),
    );
    expect_err(
        h.kd_terms_combine(
            &TensorRef::matrix(&trec, n, kt).unwrap(),
            None,
            &jsd,
            &mut TensorMut::scalar(&mut loss),
            &mut TensorMut::matrix(&mut stats, n, ks).unwrap(),
        ),
        Status::SHAPE_MISMATCH,
        "3-D",
    );
    expect_err(
        h.kd_terms_combine(
            &trec3,
            None,
            &unsharded,
            &mut TensorMut::scalar(&mut loss),
            &mut TensorMut::matrix(&mut stats, n, ks).unwrap(),
        ),
        Status::INVALID_ARGUMENT,
        "vocab_total",
    );
    expect_err(
        h.kd_terms_combine(
            &trec3,
            None,
            &jsd,
            &mut TensorMut::scalar(&mut loss),
            &mut TensorMut::matrix(&mut stats[..n * 4], n, 4).unwrap(),
        ),
        Status::SHAPE_MISMATCH,
        "row_stats",
    );
    // ... which are required: the safe API takes them by reference, so the C API's NULL goes through
    // fusedce::sys (run and workspace query).
    {
        let mut o = std::mem::MaybeUninit::<sys::fce_kd_options_t>::zeroed();
        let st = unsafe { sys::fce_kd_options_init(o.as_mut_ptr(), std::mem::size_of::<sys::fce_kd_options_t>()) };
        assert_eq!(st, sys::fce_status::FCE_STATUS_SUCCESS);
        let mut o = unsafe { o.assume_init() };
        o.divergence = sys::FCE_KD_JSD as i32;
        o.vocab_start = 3;
        o.vocab_total = vt;
        let r = trec3.as_dl();
        let mut l = TensorMut::scalar(&mut loss);
        let mut ldl = l.as_dl();
        let null_stats: *mut sys::DLTensor = std::ptr::null_mut();
        let st = unsafe {
            sys::fce_kd_terms_combine(
                h.as_raw(),
                h.stream(),
                &r,
                std::ptr::null(),
                &o,
                &mut ldl,
                null_stats,
                std::ptr::null_mut(),
                0,
            )
        };
        assert_eq!(st, sys::fce_status::FCE_STATUS_INVALID_ARGUMENT);
        let msg = unsafe { std::ffi::CStr::from_ptr(sys::fce_last_error_message()) }.to_string_lossy().into_owned();
        assert!(msg.contains("row_stats"), "message {:?}", msg);
        let mut bytes = 1usize;
        let st = unsafe {
            sys::fce_kd_terms_combine_workspace_size(h.as_raw(), &r, std::ptr::null(), &o, &ldl, null_stats, &mut bytes)
        };
        assert_eq!(st, sys::fce_status::FCE_STATUS_INVALID_ARGUMENT);
        assert_eq!(bytes, 1, "a failed query wrote its size");
    }
    assert_eq!(loss, POISON, "a failed kd_terms_combine wrote the loss");
    assert_eq!(bits(&stats), bits(&stats_before), "a failed kd_terms_combine wrote row_stats");
    let ws = h
        .kd_terms_combine_workspace_size(
            &trec3,
            None,
            &jsd,
            &mut TensorMut::scalar(&mut loss),
            &mut TensorMut::matrix(&mut stats, n, ks).unwrap(),
        )
        .unwrap();
    assert_eq!(ws, 0, "kd_terms_combine workspace on a CPU handle");
    h.kd_terms_combine(
        &trec3,
        None,
        &jsd,
        &mut TensorMut::scalar(&mut loss),
        &mut TensorMut::matrix(&mut stats, n, ks).unwrap(),
    )
    .unwrap();
    assert!(loss.is_finite() && loss > 0.0, "loss {}", loss);
    assert!((0..n).all(|i| stats[i * ks + 4].is_finite()), "A not written: {:?}", stats);
    assert_eq!(bits(&stats[..4]), bits(&stats_before[..4]), "fields 0-3 changed");

    // The backward takes JSD now (A from the terms' combine), and a top-K teacher of the right shape.
    let rs = TensorRef::matrix(&stats, n, ks).unwrap();
    let mut ds = vec![POISON; n * v];
    expect_err(
        h.kd_bwd(&sm, &topk_short_lps, None, &rs, &jsd, None, &mut TensorMut::matrix(&mut ds, n, v).unwrap()),
        Status::SHAPE_MISMATCH,
        "topk_logprobs",
    );
    assert!(poisoned(&ds), "a failed kd_bwd wrote dstudent");
    h.kd_bwd(&sm, &teacher, None, &rs, &jsd, None, &mut TensorMut::matrix(&mut ds, n, v).unwrap()).unwrap();
    assert!(ds.iter().all(|&d| d != POISON && d.is_finite()), "dstudent {:?}", ds);
}

// ----------------------------------------------------------------------------------------------------
// A top-K teacher over shards: [N, K] global ids and log-probabilities, the same on every rank
// ----------------------------------------------------------------------------------------------------

/// The float64 max and Σ exp(z − max) of z = x / t over `x` (−inf and 0 when empty), as a record's pair.
fn max_and_sum(x: &[f64], t: f64) -> [f64; 2] {
    let z: Vec<f64> = x.iter().map(|&a| a / t).collect();
    let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return [m, 0.0];
    }
    [m, z.iter().map(|&zj| (zj - m).exp()).sum()]
}

/// Top-K rows over shards against the unsharded `kd_loss` with the same top-K teacher, and both against
/// float64 (`kd_row_topk`; gradients by central differences of it): every divergence, both normalizations,
/// the three reductions, over 2 and 3 uneven or padded shards. Rows: slots spread over every shard, unused
/// slots, no used slot (masked), a target-masked row, every id in the first shard, every id in the last,
/// one used slot, ids at the shards' edges.
#[test]
fn sharded_topk_teacher_matches_float64_and_the_unsharded_kd_loss() {
    let (n, v, kk) = (9, 53, 6);
    let (k, ks, kt) = (KD_RECORD_FIELDS, KD_ROW_STATS_FIELDS, KD_TERMS_RECORD_FIELDS);
    let ids: Vec<i64> = vec![
        3, 25, 47, 10, 40, 52, // spread over every shard (52: the last real column)
        5, -1, 30, -1, 44, 21, // unused slots
        -1, -1, -3, -1, -1, -1, // no used slot: masked (loss 0, not counted by the mean, gradient 0)
        8, 33, 49, 2, 27, 15, // masked by its target
        0, 1, 2, 19, 7, -1, // every id in the first shard of each layout
        52, 48, 41, 50, -1, 45, // every id in the last shard of each layout
        -1, -1, -1, 33, -1, -1, // one used slot: the teacher's probability 1
        19, 20, 26, 27, 39, 40, // the shards' edges
        11, 36, 6, 51, 29, 43,
    ];
    let (no_slot, masked) = (2, 3);
    let targets: Vec<i64> = vec![0, 1, 2, -100, 4, 5, 6, 7, 8];
    let mut rng = Rng::new(57);
    let s = rng.f32s(n * v, -4.0, 4.0);
    let lp = rng.f32s(n * kk, -6.0, -0.1);
    let (sd, lpd) = (widen(&s), widen(&lp));
    let tg = TensorRef::vector(&targets);
    let topk = Teacher::TopK {
        ids: TensorRef::matrix(&ids, n, kk).unwrap(),
        logprobs: TensorRef::matrix(&lp, n, kk).unwrap(),
    };
    let row_ids = |i: usize| &ids[i * kk..(i + 1) * kk];
    let row_lp = |i: usize| &lpd[i * kk..(i + 1) * kk];
    let layouts = [
        Layout::new("uneven [20, 33]", &[20, 33], &[0, 0]),
        Layout::new("padded [27, 26 + 1]", &[27, 26], &[0, 1]),
        Layout::new("padded [20, 20, 13 + 7]", &[20, 20, 13], &[0, 0, 7]),
    ];
    let h = cpu();
    let gl_rows: Vec<f32> = rng.f32s(n, -1.5, 2.0);
    let gl_scalar = 0.75f32;
    let unmasked = n - 2;
    for (norm, renorm) in [(TopkNorm::FullVocab, false), (TopkNorm::Renormalize, true)] {
        for (div, dref, beta) in [
            (Divergence::ForwardKl, Div::Fkl, 0.5f32),
            (Divergence::ReverseKl, Div::Rkl, 0.5),
            (Divergence::Jsd, Div::Jsd(0.3), 0.3),
        ] {
            for (red, t, t2, with_gl) in [
                (Reduction::None, 1.0f32, false, true),
                (Reduction::Mean, 2.0, true, true),
                (Reduction::Sum, 0.5, false, false),
            ] {
                let tt = t as f64;
                let base = KdOptions::new()
                    .divergence(div)
                    .beta(beta)
                    .topk_norm(norm)
                    .reduction(red)
                    .temperature(t)
                    .scale_by_t2(t2);
                let per_row = red == Reduction::None;
                let loss_len = if per_row { n } else { 1 };
                let gl = if !with_gl {
                    None
                } else if per_row {
                    Some(TensorRef::vector(&gl_rows))
                } else {
                    Some(TensorRef::scalar(&gl_scalar))
                };
                let case = format!("top-K {:?}/{:?}/{:?}/T={}", norm, dref, red, t);

                // The unsharded call, with its gradient ...
                let mut loss = vec![0f32; loss_len];
                let mut ds = vec![0f32; n * v];
                {
                    let mut outs = KdOutputs::new(loss_view(per_row, &mut loss))
                        .dstudent(TensorMut::matrix(&mut ds, n, v).unwrap());
                    if let Some(g) = gl {
                        outs = outs.grad_loss(g);
                    }
                    h.kd_loss(&TensorRef::matrix(&s, n, v).unwrap(), &topk, Some(&tg), &base, &mut outs).unwrap();
                }
                // ... against float64: rows without a used slot and masked rows 0 and not counted by the
                // mean; dstudent the central differences of Σ_i g_i·loss_i (reduced).
                let scale = if t2 { tt * tt } else { 1.0 };
                let g = |i: usize| match (gl.is_some(), per_row) {
                    (false, _) => 1.0,
                    (true, true) => gl_rows[i] as f64,
                    (true, false) => gl_scalar as f64,
                };
                let factor = if red == Reduction::Mean { 1.0 / unmasked as f64 } else { 1.0 };
                let rows_of = |y: &[f64]| -> Vec<f64> {
                    (0..n)
                        .map(|i| {
                            let l = kd_row_topk(dref, row(y, v, i), row_ids(i), row_lp(i), tt, renorm);
                            if i == masked {
                                0.0
                            } else {
                                scale * l.unwrap_or(0.0)
                            }
                        })
                        .collect()
                };
                let rows = rows_of(&sd);
                // (Row 6's one slot renormalized is q = p = 1: 0 too.)
                assert!(rows[no_slot] == 0.0 && rows[masked] == 0.0, "{}: {:?}", case, rows);
                assert!(rows.iter().filter(|&&l| l != 0.0).count() >= n - 3, "{}: trivial losses {:?}", case, rows);
                let want = match red {
                    Reduction::None => rows.clone(),
                    Reduction::Sum => vec![rows.iter().sum::<f64>()],
                    Reduction::Mean => vec![rows.iter().sum::<f64>() / unmasked as f64],
                };
                assert_close(&format!("{}: kd_loss vs float64", case), &widen(&loss), &want, 1e-6, 1e-5);
                let want_ds =
                    fd_grad(&sd, |y| rows_of(y).iter().enumerate().map(|(i, l)| g(i) * factor * l).sum::<f64>());
                assert_close(&format!("{}: kd_loss dstudent vs float64", case), &widen(&ds), &want_ds, 1e-6, 1e-4);
                assert!(ds.iter().filter(|g| g.abs() > 1e-4).count() > 20, "{}: trivial dstudent", case);

                for lay in &layouts {
                    let what = |x: &str| format!("{} {}: {}", case, lay.name, x);
                    let w = lay.ranks();
                    let shard_opts = |r: usize| base.vocab_start(lay.starts[r] as i64).vocab_total(v as i64);
                    let ss: Vec<Vec<f32>> = (0..w).map(|r| lay.shard_cols(&s, n, v, r)).collect();
                    let in_shard =
                        |r: usize, id: i64| id >= lay.starts[r] as i64 && id < (lay.starts[r] + lay.widths[r]) as i64;

                    // 1-2. the records of every shard, the same teacher on every rank.
                    let records = gathered_partials_with(&h, lay, &ss, &|_| topk, n, &shard_opts);
                    // The student's max and sum over the shard's real columns, and over its columns at the
                    // teacher's ids (P's pair for forward KL and JSD, Q's for reverse KL); X NaN.
                    for r in 0..w {
                        let cols = lay.starts[r]..lay.starts[r] + lay.widths[r];
                        for i in 0..n {
                            let sel: Vec<f64> = row_ids(i)
                                .iter()
                                .filter(|&&id| id >= 0 && in_shard(r, id))
                                .map(|&id| sd[i * v + id as usize])
                                .collect();
                            let (all, ids_pair) =
                                (max_and_sum(&row(&sd, v, i)[cols.clone()], tt), max_and_sum(&sel, tt));
                            let want: Vec<f64> = if dref == Div::Rkl {
                                all.iter().chain(&ids_pair).cloned().collect()
                            } else {
                                ids_pair.iter().chain(&all).cloned().collect()
                            };
                            let got = &records[(r * n + i) * k..(r * n + i + 1) * k];
                            let rw = what(&format!("record shard {} row {}", r, i));
                            assert_close(&rw, &widen(&got[..4]), &want, 1e-6, 1e-5);
                            assert!(got[4].is_nan(), "{}: X {}", rw, got[4]);
                        }
                    }
                    let rec = TensorRef::new(&records, &[w, n, k]).unwrap();

                    // 3. the statistics alone, the same bits on every rank: 0-1 the student's whole rows,
                    // 2-3 its columns at the teacher's ids.
                    let firsts: Vec<Vec<f32>> = (0..w)
                        .map(|r| {
                            let mut st = vec![UNWRITTEN; n * ks];
                            h.kd_combine_row_stats(
                                &rec,
                                Some(&tg),
                                &shard_opts(r),
                                &mut TensorMut::matrix(&mut st, n, ks).unwrap(),
                            )
                            .unwrap();
                            st
                        })
                        .collect();
                    for st in &firsts[1..] {
                        assert_eq!(bits(st), bits(&firsts[0]), "{}", what("row_stats differ between ranks"));
                    }
                    let stats0 = &firsts[0];
                    for i in (0..n).filter(|&i| i != masked && i != no_slot) {
                        let sel: Vec<f64> =
                            row_ids(i).iter().filter(|&&id| id >= 0).map(|&id| sd[i * v + id as usize]).collect();
                        let (all, ids_pair) = (max_and_sum(row(&sd, v, i), tt), max_and_sum(&sel, tt));
                        let want = [all[0], all[1].ln(), ids_pair[0], ids_pair[1].ln()];
                        let got = widen(&stats0[i * ks..i * ks + 4]);
                        assert_close(&what(&format!("row_stats row {}", i)), &got, &want, 1e-5, 1e-5);
                    }
                    // kd_combine with a loss (not JSD's): the same statistics, a NaN loss (the terms give it).
                    if dref != Div::Jsd(0.3) {
                        let mut closs = vec![UNWRITTEN; loss_len];
                        let mut st = vec![UNWRITTEN; n * ks];
                        h.kd_combine(
                            &rec,
                            Some(&tg),
                            &shard_opts(0),
                            &mut loss_view(per_row, &mut closs),
                            Some(&mut TensorMut::matrix(&mut st, n, ks).unwrap()),
                        )
                        .unwrap();
                        assert!(closs[0].is_nan(), "{}: {:?}", what("kd_combine's loss of top-K records"), closs);
                        for i in 0..n {
                            let f = i * ks..i * ks + 4;
                            assert_eq!(bits(&st[f.clone()]), bits(&stats0[f]), "{}", what("kd_combine's statistics"));
                        }
                    }

                    // 3a-3b. each shard's sums of the terms over its slots, and their number, [W, N, 5].
                    let trecords = gathered_terms_with(&h, lay, &ss, &|_| topk, stats0, n, &shard_opts);
                    for i in 0..n {
                        let refs = topk_log_probs(row(&sd, v, i), row_ids(i), row_lp(i), tt, renorm);
                        let mut slots_total = 0.0;
                        for r in 0..w {
                            let mut want = [0.0f64; 3];
                            if let Some((used, lpt, lqs)) = &refs {
                                let (l, a) = elem_terms_of(dref, lpt, lqs);
                                for (u, &kslot) in used.iter().enumerate() {
                                    if in_shard(r, row_ids(i)[kslot]) {
                                        want[0] += l[u];
                                        want[1] += a[u];
                                        want[2] += 1.0;
                                    }
                                }
                            }
                            let got = &trecords[(r * n + i) * kt..(r * n + i + 1) * kt];
                            let rw = what(&format!("terms' record shard {} row {}", r, i));
                            assert_eq!(got[2] as f64, want[2], "{}: slots", rw);
                            assert_close(&rw, &widen(&got[..2]), &want[..2], 1e-6, 1e-5);
                            slots_total += got[2] as f64;
                        }
                        let used = row_ids(i).iter().filter(|&&id| id >= 0).count() as f64;
                        assert_eq!(slots_total, used, "{}", what(&format!("row {}'s slots over the shards", i)));
                    }
                    // 3c. the loss and A, the same bits on every rank; fields 0-3 kept.
                    let trec = TensorRef::new(&trecords, &[w, n, kt]).unwrap();
                    let results: Vec<(Vec<f32>, Vec<f32>)> = (0..w)
                        .map(|r| {
                            let mut closs = vec![UNWRITTEN; loss_len];
                            let mut st = stats0.clone();
                            h.kd_terms_combine(
                                &trec,
                                Some(&tg),
                                &shard_opts(r),
                                &mut loss_view(per_row, &mut closs),
                                &mut TensorMut::matrix(&mut st, n, ks).unwrap(),
                            )
                            .unwrap();
                            (closs, st)
                        })
                        .collect();
                    for (cl, st) in &results[1..] {
                        assert_eq!(bits(cl), bits(&results[0].0), "{}", what("loss differs between ranks"));
                        assert_eq!(bits(st), bits(&results[0].1), "{}", what("row_stats differ between ranks"));
                    }
                    let (closs, stats) = &results[0];
                    for i in 0..n {
                        let f = i * ks..i * ks + 4;
                        assert_eq!(bits(&stats[f.clone()]), bits(&stats0[f]), "{}", what("fields 0-3 kept"));
                    }
                    assert_close(&what("loss vs kd_loss"), &widen(closs), &widen(&loss), 1e-7, 2e-5);
                    assert_close(&what("loss vs float64"), &widen(closs), &want, 1e-6, 1e-5);
                    if per_row {
                        assert_eq!((closs[no_slot], closs[masked]), (0.0, 0.0), "{}", what("masked rows' loss"));
                    }
                    for i in (0..n).filter(|&i| i != masked && i != no_slot) {
                        let (_, lpt, lqs) = topk_log_probs(row(&sd, v, i), row_ids(i), row_lp(i), tt, renorm).unwrap();
                        let a: f64 = elem_terms_of(dref, &lpt, &lqs).1.iter().sum();
                        assert_close(&what(&format!("A of row {}", i)), &[stats[i * ks + 4] as f64], &[a], 1e-6, 1e-5);
                    }

                    // 4. each shard's gradient: its columns of the unsharded dstudent and of float64; 0 in
                    // the padding and the masked rows, and with renormalization outside the row's ids.
                    let row_stats = TensorRef::matrix(stats, n, ks).unwrap();
                    for (r, sr) in ss.iter().enumerate() {
                        let (st, wd, c) = (lay.starts[r], lay.widths[r], lay.cols(r));
                        let mut dshard = vec![7f32; n * c];
                        h.kd_bwd(
                            &TensorRef::matrix(sr, n, c).unwrap(),
                            &topk,
                            Some(&tg),
                            &row_stats,
                            &shard_opts(r),
                            gl.as_ref(),
                            &mut TensorMut::matrix(&mut dshard, n, c).unwrap(),
                        )
                        .unwrap();
                        for i in 0..n {
                            let got = widen(&dshard[i * c..i * c + wd]);
                            let rw = what(&format!("shard {} dstudent row {}", r, i));
                            assert_close(&rw, &got, &widen(&ds[i * v + st..i * v + st + wd]), 1e-6, 1e-4);
                            assert_close(&rw, &got, &want_ds[i * v + st..i * v + st + wd], 1e-6, 1e-4);
                            assert!(dshard[i * c + wd..(i + 1) * c].iter().all(|&g| g == 0.0), "{}: padding", rw);
                            if i == masked || i == no_slot {
                                assert!(got.iter().all(|&g| g == 0.0), "{}: masked", rw);
                            }
                            if renorm {
                                for j in (0..wd).filter(|&j| !row_ids(i).contains(&((st + j) as i64))) {
                                    assert_eq!(got[j], 0.0, "{}: column {} outside the ids", rw, st + j);
                                }
                            }
                        }
                        if r == w - 1 {
                            // In place: the same bits, written over the student's copy.
                            let mut inplace = sr.clone();
                            h.kd_bwd_in_place(
                                &mut TensorMut::matrix(&mut inplace, n, c).unwrap(),
                                &topk,
                                Some(&tg),
                                &row_stats,
                                &shard_opts(r),
                                gl.as_ref(),
                            )
                            .unwrap();
                            assert_eq!(bits(&inplace), bits(&dshard), "{}", what("in place"));
                        }
                    }
                }
            }
        }
    }
}

/// A top-K id at or past vocab_total (one in the last shard's padding columns, one far past it) makes its
/// row's loss and gradient NaN on every shard, as in the unsharded `kd_loss`; the other rows are unaffected
/// (a row without a used slot stays masked), and a reduced loss is NaN. i32 ids.
#[test]
fn sharded_topk_teacher_out_of_range_id_gives_nan() {
    let (n, v, kk) = (4, 11, 3);
    let ks = KD_ROW_STATS_FIELDS;
    let kt = KD_TERMS_RECORD_FIELDS;
    let ids: Vec<i32> = vec![
        2, 9, 5, //
        1, 11, -1, // 11 = vocab_total: a padding column of the last shard, never read
        1000, 3, 4, //
        -1, -1, -1, // no used slot: masked
    ];
    let (ok, bad, no_slot) = (0, [1, 2], 3);
    let mut rng = Rng::new(58);
    let s = rng.f32s(n * v, -3.0, 3.0);
    let lp = rng.f32s(n * kk, -5.0, -0.2);
    let topk = Teacher::TopK {
        ids: TensorRef::matrix(&ids, n, kk).unwrap(),
        logprobs: TensorRef::matrix(&lp, n, kk).unwrap(),
    };
    let ids64: Vec<i64> = ids.iter().map(|&x| x as i64).collect();
    let (sd, lpd) = (widen(&s), widen(&lp));
    let layouts = [
        Layout::new("padded [5, 6 + 2]", &[5, 6], &[0, 2]),
        Layout::new("padded [4, 4, 3 + 1]", &[4, 4, 3], &[0, 0, 1]),
    ];
    let h = cpu();
    for (norm, renorm) in [(TopkNorm::FullVocab, false), (TopkNorm::Renormalize, true)] {
        for (div, dref) in
            [(Divergence::ForwardKl, Div::Fkl), (Divergence::ReverseKl, Div::Rkl), (Divergence::Jsd, Div::Jsd(0.5))]
        {
            for red in [Reduction::None, Reduction::Mean] {
                let base = KdOptions::new().divergence(div).topk_norm(norm).reduction(red).temperature(1.25);
                let per_row = red == Reduction::None;
                let loss_len = if per_row { n } else { 1 };
                let case = format!("top-K out of range {:?}/{:?}/{:?}", norm, dref, red);
                let mut loss = vec![0f32; loss_len];
                let mut ds = vec![0f32; n * v];
                h.kd_loss(
                    &TensorRef::matrix(&s, n, v).unwrap(),
                    &topk,
                    None,
                    &base,
                    &mut KdOutputs::new(loss_view(per_row, &mut loss))
                        .dstudent(TensorMut::matrix(&mut ds, n, v).unwrap()),
                )
                .unwrap();
                if per_row {
                    let want = kd_row_topk(dref, row(&sd, v, ok), &ids64[..kk], &lpd[..kk], 1.25, renorm).unwrap();
                    assert_close(&format!("{}: kd_loss row 0", case), &[loss[ok] as f64], &[want], 1e-6, 1e-5);
                    assert!(bad.iter().all(|&i| loss[i].is_nan()) && loss[no_slot] == 0.0, "{}: {:?}", case, loss);
                } else {
                    assert!(loss[0].is_nan(), "{}: kd_loss {:?}", case, loss);
                }
                assert!(bad.iter().all(|&i| ds[i * v..(i + 1) * v].iter().all(|g| g.is_nan())), "{}: kd_loss ds", case);

                for lay in &layouts {
                    let what = |x: &str| format!("{} {}: {}", case, lay.name, x);
                    let w = lay.ranks();
                    let shard_opts = |r: usize| base.vocab_start(lay.starts[r] as i64).vocab_total(v as i64);
                    let ss: Vec<Vec<f32>> = (0..w).map(|r| lay.shard_cols(&s, n, v, r)).collect();
                    let records = gathered_partials_with(&h, lay, &ss, &|_| topk, n, &shard_opts);
                    let mut stats = vec![UNWRITTEN; n * ks];
                    h.kd_combine_row_stats(
                        &TensorRef::new(&records, &[w, n, KD_RECORD_FIELDS]).unwrap(),
                        None,
                        &shard_opts(0),
                        &mut TensorMut::matrix(&mut stats, n, ks).unwrap(),
                    )
                    .unwrap();
                    let trecords = gathered_terms_with(&h, lay, &ss, &|_| topk, &stats, n, &shard_opts);
                    // Every shard sees the bad id: NaN sums; the slots counted are the ids in the shard.
                    for r in 0..w {
                        for &i in &bad {
                            let got = &trecords[(r * n + i) * kt..(r * n + i + 1) * kt];
                            assert!(got[0].is_nan() && got[1].is_nan(), "{}", what(&format!("shard {} row {}", r, i)));
                        }
                    }
                    let mut closs = vec![UNWRITTEN; loss_len];
                    h.kd_terms_combine(
                        &TensorRef::new(&trecords, &[w, n, kt]).unwrap(),
                        None,
                        &shard_opts(0),
                        &mut loss_view(per_row, &mut closs),
                        &mut TensorMut::matrix(&mut stats, n, ks).unwrap(),
                    )
                    .unwrap();
                    if per_row {
                        assert_close(&what("loss vs kd_loss"), &widen(&closs), &widen(&loss), 1e-7, 2e-5);
                        assert_eq!(closs[no_slot], 0.0, "{}", what("the row without a used slot"));
                    } else {
                        assert!(closs[0].is_nan(), "{}: {:?}", what("reduced loss"), closs);
                    }
                    for (r, sr) in ss.iter().enumerate() {
                        let (st, wd, c) = (lay.starts[r], lay.widths[r], lay.cols(r));
                        let mut dshard = vec![7f32; n * c];
                        h.kd_bwd(
                            &TensorRef::matrix(sr, n, c).unwrap(),
                            &topk,
                            None,
                            &TensorRef::matrix(&stats, n, ks).unwrap(),
                            &shard_opts(r),
                            None,
                            &mut TensorMut::matrix(&mut dshard, n, c).unwrap(),
                        )
                        .unwrap();
                        for i in 0..n {
                            let rw = what(&format!("shard {} dstudent row {}", r, i));
                            let got = &dshard[i * c..(i + 1) * c];
                            assert!(got[wd..].iter().all(|&g| g == 0.0), "{}: padding {:?}", rw, got);
                            if bad.contains(&i) {
                                assert!(got[..wd].iter().all(|g| g.is_nan()), "{}: {:?}", rw, got);
                            } else {
                                let want = widen(&ds[i * v + st..i * v + st + wd]);
                                assert_close(&rw, &widen(&got[..wd]), &want, 1e-6, 1e-4);
                            }
                        }
                    }
                }
            }
        }
    }
}
