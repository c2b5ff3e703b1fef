//! The shards' column ranges in their records (since 0.2.0): every combine (cross-entropy, logsumexp,
//! distillation and its terms) checks that the ranges tile `[0, vocab_total)` in rank order and gives NaN
//! rows otherwise (overlapping shards, a gap, shards out of order, a missing last shard), never a plausible
//! number and no error status; a shard of padding alone (vocab_start = vocab_total) is accepted and
//! neutral.
#[path = "support/reference.rs"]
mod reference;

use fusedce::{
    CeOptions, CeOutputs, Divergence, Handle, KdOptions, LinearCeGrads, LseOptions, Reduction, SoftmaxOptions, Teacher,
    TensorMut, TensorRef, KD_RECORD_FIELDS, KD_ROW_STATS_FIELDS, KD_TERMS_RECORD_FIELDS, LSE_RECORD_FIELDS,
};
use reference::*;

fn cpu() -> Handle {
    Handle::cpu().expect("CPU handle")
}

const N: usize = 4;
const V: usize = 60;

/// Columns [start, start + width) of x [N, V] (x's columns past V read as NaN padding).
fn cols(x: &[f32], start: usize, width: usize) -> Vec<f32> {
    let mut m = Vec::with_capacity(N * width);
    for i in 0..N {
        m.extend((start..start + width).map(|j| if j < V { x[i * V + j] } else { f32::NAN }));
    }
    m
}

/// Shard layouts as (vocab_start, width) per rank: the tiling one, then the ones a combine must refuse.
fn layouts() -> Vec<(&'static str, Vec<(usize, usize)>, bool)> {
    vec![
        ("tiling [0,20) [20,40) [40,60)", vec![(0, 20), (20, 20), (40, 20)], true),
        ("overlapping [0,20) [15,40) [40,60)", vec![(0, 20), (15, 25), (40, 20)], false),
        ("a gap [0,20) [25,40) [40,60)", vec![(0, 20), (25, 15), (40, 20)], false),
        ("out of order [20,40) [0,20) [40,60)", vec![(20, 20), (0, 20), (40, 20)], false),
        ("the last missing [0,20) [20,40)", vec![(0, 20), (20, 20)], false),
    ]
}

fn data() -> (Vec<f32>, Vec<f32>, Vec<i64>) {
    let mut rng = Rng::new(60);
    let x = rng.f32s(N * V, -3.0, 3.0);
    let te = rng.f32s(N * V, -3.0, 3.0);
    // A target in each third of the vocabulary, and an ignored row (NaN too when the layout is wrong).
    (x, te, vec![5, 30, 59, -100])
}

/// Every rank's cross-entropy records [W, N, K], stacked in rank order.
fn ce_records(h: &Handle, x: &[f32], t: &[i64], base: &CeOptions<'_>, shards: &[(usize, usize)]) -> Vec<f32> {
    let k = fusedce::cross_entropy_record_fields(base).unwrap();
    let mut rec = vec![0f32; shards.len() * N * k];
    for (r, &(st, w)) in shards.iter().enumerate() {
        h.cross_entropy_partial(
            &TensorRef::matrix(&cols(x, st, w), N, w).unwrap(),
            &TensorRef::vector(t),
            &base.vocab_start(st as i64),
            &mut TensorMut::matrix(&mut rec[r * N * k..(r + 1) * N * k], N, k).unwrap(),
        )
        .unwrap();
    }
    rec
}

/// The combine's (loss, lse, lse pairs, z_loss, entropy, argmax) of `rec`, per row.
#[allow(clippy::type_complexity)]
fn ce_combine(
    h: &Handle,
    rec: &[f32],
    w: usize,
    t: &[i64],
    base: &CeOptions<'_>,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<i64>) {
    let k = fusedce::cross_entropy_record_fields(base).unwrap();
    let recs = TensorRef::new(rec, &[w, N, k]).unwrap();
    let (mut loss, mut lse, mut zl, mut ent, mut am) =
        (vec![0f32; N], vec![0f32; N], vec![0f32; N], vec![0f32; N], vec![0i64; N]);
    h.cross_entropy_combine(
        &recs,
        &TensorRef::vector(t),
        base,
        &mut CeOutputs::new(TensorMut::vector(&mut loss))
            .lse(TensorMut::vector(&mut lse))
            .z_loss(TensorMut::vector(&mut zl))
            .entropy(TensorMut::vector(&mut ent))
            .argmax(TensorMut::vector(&mut am)),
    )
    .unwrap();
    let mut pairs = vec![0f32; 2 * N];
    let mut loss2 = vec![0f32; N];
    h.cross_entropy_combine(
        &recs,
        &TensorRef::vector(t),
        base,
        &mut CeOutputs::new(TensorMut::vector(&mut loss2)).lse(TensorMut::lse_pairs(&mut pairs).unwrap()),
    )
    .unwrap();
    assert_eq!(bits_of(&loss2), bits_of(&loss));
    (loss, lse, pairs, zl, ent, am)
}

#[test]
fn ce_combine_of_shards_that_do_not_tile_the_vocabulary_gives_nan_rows() {
    let h = cpu();
    let (x, _, t) = data();
    let base = CeOptions::new().reduction(Reduction::None).z_loss_scale(1e-3).vocab_total(V as i64);
    // The unsharded call, for the tiling layout.
    let mut want = vec![0f32; N];
    h.cross_entropy_fwd(
        &TensorRef::matrix(&x, N, V).unwrap(),
        &TensorRef::vector(&t),
        &base.vocab_total(0),
        &mut CeOutputs::new(TensorMut::vector(&mut want)),
    )
    .unwrap();
    for (name, shards, tiles) in layouts() {
        let rec = ce_records(&h, &x, &t, &base, &shards);
        let (loss, lse, pairs, zl, ent, am) = ce_combine(&h, &rec, shards.len(), &t, &base);
        if tiles {
            assert_close(&format!("{}: loss", name), &widen(&loss), &widen(&want), 2e-5, 0.0);
            assert!(lse.iter().chain(&pairs).chain(&ent).all(|a| a.is_finite()), "{}: lse {:?}", name, lse);
            assert!(am.iter().all(|&a| a >= 0), "{}: argmax {:?}", name, am);
        } else {
            // Every row, the ignored one included: NaN loss, lse (both forms), z-loss, entropy; argmax -1.
            for (what, got) in
                [("loss", &loss), ("lse", &lse), ("lse pairs", &pairs), ("z_loss", &zl), ("entropy", &ent)]
            {
                assert!(got.iter().all(|a| a.is_nan()), "{}: {} {:?}", name, what, got);
            }
            assert_eq!(am, vec![-1; N], "{}: argmax", name);
        }
        // A reduced loss is NaN too.
        let k = fusedce::cross_entropy_record_fields(&base).unwrap();
        let mut mean = 0f32;
        h.cross_entropy_combine(
            &TensorRef::new(&rec, &[shards.len(), N, k]).unwrap(),
            &TensorRef::vector(&t),
            &base.reduction(Reduction::Mean),
            &mut CeOutputs::new(TensorMut::scalar(&mut mean)),
        )
        .unwrap();
        assert_eq!(mean.is_nan(), !tiles, "{}: mean loss {}", name, mean);
    }
}

/// The task's case: V = 60 in shards [0,20), [15,40), [40,60) (the second overlaps the first): NaN loss
/// and lse in every row, with the narrowest records (FCE_CE_RECORD_FIELDS_LOSS) too.
#[test]
fn overlapping_shards_give_nan_loss_and_lse() {
    let h = cpu();
    let (x, _, t) = data();
    let shards = [(0usize, 20usize), (15, 25), (40, 20)];
    let base = CeOptions::new().reduction(Reduction::None).vocab_total(V as i64);
    let rec = ce_records(&h, &x, &t, &base, &shards);
    let (loss, lse, pairs, _, _, _) = ce_combine(&h, &rec, shards.len(), &t, &base);
    assert!(loss.iter().all(|a| a.is_nan()), "loss {:?}", loss);
    assert!(lse.iter().all(|a| a.is_nan()), "lse {:?}", lse);
    assert!(pairs.iter().all(|a| a.is_nan()), "lse pairs {:?}", pairs);

    let k = fusedce::CE_RECORD_FIELDS_LOSS;
    assert_eq!(k, 6);
    let mut narrow = vec![0f32; shards.len() * N * k];
    for (r, &(st, w)) in shards.iter().enumerate() {
        h.cross_entropy_partial(
            &TensorRef::matrix(&cols(&x, st, w), N, w).unwrap(),
            &TensorRef::vector(&t),
            &base.vocab_start(st as i64),
            &mut TensorMut::matrix(&mut narrow[r * N * k..(r + 1) * N * k], N, k).unwrap(),
        )
        .unwrap();
        // Fields 4-5: the shard's range [vocab_start, end).
        assert!(narrow[r * N * k..(r + 1) * N * k].chunks(k).all(|f| range_of(f, 4) == (st as i64, (st + w) as i64)));
    }
    let (mut loss, mut lse) = (vec![0f32; N], vec![0f32; N]);
    h.cross_entropy_combine(
        &TensorRef::new(&narrow, &[shards.len(), N, k]).unwrap(),
        &TensorRef::vector(&t),
        &base,
        &mut CeOutputs::new(TensorMut::vector(&mut loss)).lse(TensorMut::vector(&mut lse)),
    )
    .unwrap();
    assert!(loss.iter().chain(&lse).all(|a| a.is_nan()), "narrow records: loss {:?} lse {:?}", loss, lse);
}

#[test]
fn logsumexp_and_kd_combines_of_shards_that_do_not_tile_give_nan_rows() {
    let h = cpu();
    let (x, te, t) = data();
    let (k, kd, ks, kt) = (LSE_RECORD_FIELDS, KD_RECORD_FIELDS, KD_ROW_STATS_FIELDS, KD_TERMS_RECORD_FIELDS);
    for (name, shards, tiles) in layouts() {
        let w = shards.len();
        // Logsumexp.
        let mut rec = vec![0f32; w * N * k];
        for (r, &(st, wd)) in shards.iter().enumerate() {
            h.logsumexp_partial(
                &TensorRef::matrix(&cols(&x, st, wd), N, wd).unwrap(),
                &LseOptions::new().scale(0.5).vocab_start(st as i64).vocab_total(V as i64),
                &mut TensorMut::matrix(&mut rec[r * N * k..(r + 1) * N * k], N, k).unwrap(),
            )
            .unwrap();
        }
        let recs = TensorRef::new(&rec, &[w, N, k]).unwrap();
        let (mut lse, mut pairs) = (vec![0f32; N], vec![0f32; 2 * N]);
        h.logsumexp_combine(&recs, &mut TensorMut::vector(&mut lse)).unwrap();
        h.logsumexp_combine(&recs, &mut TensorMut::lse_pairs(&mut pairs).unwrap()).unwrap();
        assert!(lse.iter().chain(&pairs).all(|a| a.is_nan() != tiles), "{}: lse {:?} pairs {:?}", name, lse, pairs);

        // Distillation (forward KL), then its terms' exchange from the combined statistics.
        let kd_opts =
            |st: usize| KdOptions::new().reduction(Reduction::None).vocab_start(st as i64).vocab_total(V as i64);
        let mut krec = vec![0f32; w * N * kd];
        for (r, &(st, wd)) in shards.iter().enumerate() {
            h.kd_partial(
                &TensorRef::matrix(&cols(&x, st, wd), N, wd).unwrap(),
                &Teacher::Logits(TensorRef::matrix(&cols(&te, st, wd), N, wd).unwrap()),
                &kd_opts(st),
                &mut TensorMut::matrix(&mut krec[r * N * kd..(r + 1) * N * kd], N, kd).unwrap(),
            )
            .unwrap();
        }
        let tv = TensorRef::vector(&t);
        let (mut loss, mut stats) = (vec![0f32; N], vec![0f32; N * ks]);
        h.kd_combine(
            &TensorRef::new(&krec, &[w, N, kd]).unwrap(),
            Some(&tv),
            &kd_opts(0),
            &mut TensorMut::vector(&mut loss),
            Some(&mut TensorMut::matrix(&mut stats, N, ks).unwrap()),
        )
        .unwrap();
        // Every row's loss, the masked one included, and the statistics' maxima and log-sums.
        assert!(loss.iter().all(|a| a.is_nan() != tiles), "{}: KD loss {:?}", name, loss);
        assert!(stats.chunks(ks).all(|s| s[..4].iter().all(|a| a.is_nan() != tiles)), "{}: {:?}", name, stats);

        // The terms' records, from statistics of the tiling layout (so that only their ranges are wrong).
        let good: Vec<(usize, usize)> = vec![(0, 20), (20, 20), (40, 20)];
        let mut grec = vec![0f32; 3 * N * kd];
        for (r, &(st, wd)) in good.iter().enumerate() {
            h.kd_partial(
                &TensorRef::matrix(&cols(&x, st, wd), N, wd).unwrap(),
                &Teacher::Logits(TensorRef::matrix(&cols(&te, st, wd), N, wd).unwrap()),
                &kd_opts(st),
                &mut TensorMut::matrix(&mut grec[r * N * kd..(r + 1) * N * kd], N, kd).unwrap(),
            )
            .unwrap();
        }
        let mut gstats = vec![0f32; N * ks];
        h.kd_combine_row_stats(
            &TensorRef::new(&grec, &[3, N, kd]).unwrap(),
            Some(&tv),
            &kd_opts(0),
            &mut TensorMut::matrix(&mut gstats, N, ks).unwrap(),
        )
        .unwrap();
        let mut trec = vec![0f32; w * N * kt];
        for (r, &(st, wd)) in shards.iter().enumerate() {
            h.kd_terms_partial(
                &TensorRef::matrix(&cols(&x, st, wd), N, wd).unwrap(),
                &Teacher::Logits(TensorRef::matrix(&cols(&te, st, wd), N, wd).unwrap()),
                &TensorRef::matrix(&gstats, N, ks).unwrap(),
                &kd_opts(st),
                &mut TensorMut::matrix(&mut trec[r * N * kt..(r + 1) * N * kt], N, kt).unwrap(),
            )
            .unwrap();
        }
        let mut tloss = vec![0f32; N];
        h.kd_terms_combine(
            &TensorRef::new(&trec, &[w, N, kt]).unwrap(),
            Some(&tv),
            &kd_opts(0).divergence(Divergence::ForwardKl),
            &mut TensorMut::vector(&mut tloss),
            &mut TensorMut::matrix(&mut gstats, N, ks).unwrap(),
        )
        .unwrap();
        assert!(tloss.iter().all(|a| a.is_nan() != tiles), "{}: KD terms' loss {:?}", name, tloss);
        if tiles {
            assert_close(&format!("{}: KD loss two ways", name), &widen(&tloss), &widen(&loss), 1e-6, 1e-5);
        }
    }
}

/// V = 60 padded to 3 ranks of 30 columns: [0,30), [30,60) and [60,90), the last a shard of padding alone
/// (vocab_start = vocab_total). Its partial calls are accepted (0.2.0 refused vocab_start = vocab_total),
/// its records are neutral (range [60, 60)), and the combines give the two real shards' results; its
/// gradients and probabilities are 0.
#[test]
fn a_shard_of_padding_alone_is_accepted_and_neutral() {
    let h = cpu();
    let (x, te, t) = data();
    let shards = [(0usize, 30usize), (30, 30), (60, 30)];
    let base = CeOptions::new().reduction(Reduction::None).label_smoothing(0.1).vocab_total(V as i64);

    // Cross-entropy: 3 records against the 2 real shards'.
    let rec3 = ce_records(&h, &x, &t, &base, &shards);
    let rec2 = ce_records(&h, &x, &t, &base, &shards[..2]);
    let k = fusedce::cross_entropy_record_fields(&base).unwrap();
    let pad = &rec3[2 * N * k..];
    assert!(pad.chunks(k).all(|f| range_of(f, 4) == (60, 60)), "the padding shard's range {:?}", pad);
    let all3 = ce_combine(&h, &rec3, 3, &t, &base);
    let all2 = ce_combine(&h, &rec2, 2, &t, &base);
    assert_eq!(bits_of(&all3.0), bits_of(&all2.0), "loss");
    assert_eq!(bits_of(&all3.1), bits_of(&all2.1), "lse");
    assert_eq!(bits_of(&all3.2), bits_of(&all2.2), "lse pairs");
    assert_eq!(bits_of(&all3.4), bits_of(&all2.4), "entropy");
    assert_eq!(all3.5, all2.5, "argmax");
    assert!(all3.0[..3].iter().all(|a| a.is_finite()) && all3.0[3] == 0.0, "loss {:?}", all3.0);
    // The padding shard's backward from the combined pairs: every column is padding, gradient 0.
    let mut d = vec![7f32; N * 30];
    h.cross_entropy_bwd(
        &TensorRef::matrix(&cols(&x, 60, 30), N, 30).unwrap(),
        &TensorRef::vector(&t),
        &TensorRef::lse_pairs(&all3.2).unwrap(),
        None,
        &base.vocab_start(60),
        &mut TensorMut::matrix(&mut d, N, 30).unwrap(),
    )
    .unwrap();
    assert!(d.iter().all(|&g| g == 0.0), "padding shard's dlogits {:?}", d);

    // Linear cross-entropy: a shard of the LM head whose rows are all padding.
    let hd = 2;
    let hidden = Rng::new(61).f32s(N * hd, -1.0, 1.0);
    let weight = vec![f32::NAN; 30 * hd];
    let mut lrec = vec![0f32; N * k];
    h.linear_cross_entropy_partial(
        &TensorRef::matrix(&hidden, N, hd).unwrap(),
        &TensorRef::matrix(&weight, 30, hd).unwrap(),
        None,
        &TensorRef::vector(&t),
        &base.vocab_start(60),
        &mut TensorMut::matrix(&mut lrec, N, k).unwrap(),
    )
    .unwrap();
    assert_eq!(bits_of(&lrec), bits_of(pad), "linear CE's padding record is cross-entropy's");
    let mut dw = vec![7f32; 30 * hd];
    h.linear_cross_entropy_bwd(
        &TensorRef::matrix(&hidden, N, hd).unwrap(),
        &TensorRef::matrix(&weight, 30, hd).unwrap(),
        None,
        &TensorRef::vector(&t),
        &TensorRef::lse_pairs(&all3.2).unwrap(),
        &base.vocab_start(60),
        &mut LinearCeGrads::new().dweight(TensorMut::matrix(&mut dw, 30, hd).unwrap()),
    )
    .unwrap();
    // (Its fp32 part of dhidden should be 0 as well; the CPU library left it unwritten before this fix for a
    // shard without a real row, so it is not checked here.)
    assert!(dw.iter().all(|&g| g == 0.0), "padding shard's dweight {:?}", dw);

    // Logsumexp and the padding shard's softmax.
    let kl = LSE_RECORD_FIELDS;
    let t_soft = 0.5f32;
    let lse_rec = |shards: &[(usize, usize)]| {
        let mut rec = vec![0f32; shards.len() * N * kl];
        for (r, &(st, wd)) in shards.iter().enumerate() {
            h.logsumexp_partial(
                &TensorRef::matrix(&cols(&x, st, wd), N, wd).unwrap(),
                &LseOptions::new().scale(1.0 / t_soft).vocab_start(st as i64).vocab_total(V as i64),
                &mut TensorMut::matrix(&mut rec[r * N * kl..(r + 1) * N * kl], N, kl).unwrap(),
            )
            .unwrap();
        }
        let mut pairs = vec![0f32; 2 * N];
        h.logsumexp_combine(
            &TensorRef::new(&rec, &[shards.len(), N, kl]).unwrap(),
            &mut TensorMut::lse_pairs(&mut pairs).unwrap(),
        )
        .unwrap();
        (rec, pairs)
    };
    let (lrec3, lpairs3) = lse_rec(&shards);
    let (_, lpairs2) = lse_rec(&shards[..2]);
    assert!(lrec3[2 * N * kl..].chunks(kl).all(|f| range_of(f, 2) == (60, 60) && f[..2] == [f32::NEG_INFINITY, 0.0]));
    assert_eq!(bits_of(&lpairs3), bits_of(&lpairs2), "logsumexp pairs");
    let (mut p, mut lp) = (vec![7f32; N * 30], vec![7f32; N * 30]);
    h.temp_softmax(
        &TensorRef::matrix(&cols(&x, 60, 30), N, 30).unwrap(),
        &SoftmaxOptions::new()
            .temperature(t_soft)
            .vocab_start(60)
            .vocab_total(V as i64)
            .lse(TensorRef::lse_pairs(&lpairs3).unwrap()),
        Some(&mut TensorMut::matrix(&mut p, N, 30).unwrap()),
        Some(&mut TensorMut::matrix(&mut lp, N, 30).unwrap()),
    )
    .unwrap();
    assert!(p.iter().all(|&a| a == 0.0) && lp.iter().all(|&a| a == f32::NEG_INFINITY), "padding probabilities");

    // Distillation.
    let kd = KD_RECORD_FIELDS;
    let kd_rec = |shards: &[(usize, usize)]| {
        let mut rec = vec![0f32; shards.len() * N * kd];
        for (r, &(st, wd)) in shards.iter().enumerate() {
            h.kd_partial(
                &TensorRef::matrix(&cols(&x, st, wd), N, wd).unwrap(),
                &Teacher::Logits(TensorRef::matrix(&cols(&te, st, wd), N, wd).unwrap()),
                &KdOptions::new().vocab_start(st as i64).vocab_total(V as i64),
                &mut TensorMut::matrix(&mut rec[r * N * kd..(r + 1) * N * kd], N, kd).unwrap(),
            )
            .unwrap();
        }
        let mut loss = 0f32;
        h.kd_combine(
            &TensorRef::new(&rec, &[shards.len(), N, kd]).unwrap(),
            None,
            &KdOptions::new().vocab_total(V as i64),
            &mut TensorMut::scalar(&mut loss),
            None,
        )
        .unwrap();
        (rec, loss)
    };
    let (krec3, kloss3) = kd_rec(&shards);
    let (_, kloss2) = kd_rec(&shards[..2]);
    assert!(krec3[2 * N * kd..].chunks(kd).all(|f| range_of(f, 5) == (60, 60)), "KD padding record");
    assert!(kloss3.is_finite() && kloss3 > 0.0, "KD loss {}", kloss3);
    assert_eq!(kloss3.to_bits(), kloss2.to_bits(), "KD loss with the padding shard");
}
