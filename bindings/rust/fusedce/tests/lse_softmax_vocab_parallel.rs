//! Vocabulary-parallel logsumexp (`logsumexp_partial`, `logsumexp_combine`) and a shard's temperature
//! softmax (`temp_softmax` with `SoftmaxOptions::vocab_start` / `vocab_total` / `lse`) on the CPU backend:
//! logits split into shards (uneven, and equal-width with a NaN-padded last shard), records stacked in rank
//! order, combined (into the lse `[N]` and its pairs `[N, 2]`), and each shard's probabilities from the
//! combined lse in both forms, against the unsharded
//! `logsumexp` and `temp_softmax` (themselves checked here against float64 references); the special rows
//! (NaN, +inf, all −inf); then the statuses of bad inputs.
#[path = "support/reference.rs"]
mod reference;

use fusedce::{Error, Handle, LseOptions, SoftmaxOptions, Status, TensorMut, TensorRef, LSE_RECORD_FIELDS};
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

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Marks record / output slots that a call left unwritten.
const UNWRITTEN: f32 = -7.25e30;

#[test]
fn sharded_lse_and_softmax_match_the_unsharded_calls() {
    let (n, v) = (6, 47);
    let k = LSE_RECORD_FIELDS;
    assert_eq!(k, 6);
    let t = 0.8f32;
    let scale = 1.0 / t; // fp32, as the caller would pass it; the shard's softmax multiplies by 1/T in fp32
    let mut rng = Rng::new(47);
    let mut x = rng.f32s(n * v, -4.0, 4.0);
    // Row 2: the first 17 columns (all of shard 0 in both layouts) are -inf: that shard's record is
    // neutral (m = -inf, d = 0) and its probabilities 0.
    let neutral = 2;
    for j in 0..17 {
        x[neutral * v + j] = f32::NEG_INFINITY;
    }
    // Row 4: one large logit, so that the row's max sits in the last shard and far above the others.
    x[4 * v + 40] = 30.0;
    let xd = widen(&x);
    let h = cpu();
    let xm = TensorRef::matrix(&x, n, v).unwrap();

    // The unsharded logsumexp at scale 1/T ...
    let mut lse_ref = vec![0f32; n];
    h.logsumexp(&xm, &LseOptions::new().scale(scale), &mut TensorMut::vector(&mut lse_ref)).unwrap();
    // ... against float64, so that the comparisons below compare something.
    let z: Vec<f64> = xd.iter().map(|&a| a * scale as f64).collect();
    let lse64: Vec<f64> = (0..n).map(|i| logsumexp(&z[i * v..(i + 1) * v])).collect();
    assert_close("logsumexp vs float64", &widen(&lse_ref), &lse64, 1e-6, 1e-6);

    // The unsharded softmax at T, against float64.
    let mut p_ref = vec![0f32; n * v];
    let mut lp_ref = vec![0f32; n * v];
    h.temp_softmax(
        &xm,
        &SoftmaxOptions::new().temperature(t),
        Some(&mut TensorMut::matrix(&mut p_ref, n, v).unwrap()),
        Some(&mut TensorMut::matrix(&mut lp_ref, n, v).unwrap()),
    )
    .unwrap();
    let lp64: Vec<f64> = (0..n * v).map(|e| xd[e] / t as f64 - lse64[e / v]).collect();
    let p64: Vec<f64> = lp64.iter().map(|a| a.exp()).collect();
    assert_close("temp_softmax probs vs float64", &widen(&p_ref), &p64, 1e-7, 1e-5);
    assert_close("temp_softmax logprobs vs float64", &widen(&lp_ref), &lp64, 1e-5, 1e-5);
    assert!(p_ref.iter().filter(|&&p| p > 1e-3).count() > n * v / 4, "trivial probabilities");

    let layouts = [
        Layout::new("uneven [17, 30]", &[17, 30], &[0, 0]),
        // Equal widths of 17: the last shard holds global columns 34..46 and 4 NaN padding columns.
        Layout::new("padded [17, 17, 13 + 4]", &[17, 17, 13], &[0, 0, 4]),
    ];
    for lay in &layouts {
        let what = |s: &str| format!("{}: {}", lay.name, s);
        let w = lay.ranks();
        let lse_opts =
            |r: usize| LseOptions::new().scale(scale).vocab_start(lay.starts[r] as i64).vocab_total(v as i64);
        let xs: Vec<Vec<f32>> = (0..w).map(|r| lay.shard_cols(&x, n, v, r)).collect();

        // 1. partial per rank, written straight into its slot of the stacked [W, N, 6] records.
        let mut records = vec![UNWRITTEN; w * n * k];
        for (r, rec) in records.chunks_mut(n * k).enumerate() {
            h.logsumexp_partial(
                &TensorRef::matrix(&xs[r], n, lay.cols(r)).unwrap(),
                &lse_opts(r),
                &mut TensorMut::matrix(rec, n, k).unwrap(),
            )
            .unwrap();
        }
        assert!(records.iter().all(|&a| a != UNWRITTEN), "{}", what("records left unwritten"));
        assert!(records.iter().all(|a| !a.is_nan()), "{}", what("NaN in the records (padding read?)"));
        // The records against float64 (the header's fields): 0 m = the raw max of x, 1 Σ exp((x − m)·s),
        // 2-3 the shard's column range, 4 the scale s, 5 vocab_total (int32 bits); a shard of all -inf
        // gives m = -inf, d = 0.
        for r in 0..w {
            for i in 0..n {
                let xs = &xd[i * v + lay.starts[r]..i * v + lay.starts[r] + lay.widths[r]];
                let m = xs.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let d =
                    if m == f64::NEG_INFINITY { 0.0 } else { xs.iter().map(|&a| ((a - m) * scale as f64).exp()).sum() };
                let f = &records[(r * n + i) * k..(r * n + i + 1) * k];
                let rw = what(&format!("record of rank {} row {}", r, i));
                assert_close(&rw, &widen(&f[..2]), &[m, d], 1e-6, 1e-6);
                assert_eq!(range_of(f, 2), (lay.starts[r] as i64, (lay.starts[r] + lay.widths[r]) as i64), "{}", rw);
                assert_eq!((f[4], f[5].to_bits()), (scale, v as u32), "{}: scale and vocab_total", rw);
            }
        }
        assert_eq!(&records[neutral * k..neutral * k + 2], &[f32::NEG_INFINITY, 0.0], "{}", what("neutral record"));

        // 3. combine -> the lse of the whole rows, reproducible bit for bit.
        let rec = TensorRef::new(&records, &[w, n, k]).unwrap();
        let mut lse = vec![UNWRITTEN; n];
        h.logsumexp_combine(&rec, &mut TensorMut::vector(&mut lse)).unwrap();
        let mut again = vec![0f32; n];
        h.logsumexp_combine(&rec, &mut TensorMut::vector(&mut again)).unwrap();
        assert_eq!(bits(&again), bits(&lse), "{}", what("combine not reproducible"));
        assert_close(&what("lse vs unsharded logsumexp"), &widen(&lse), &widen(&lse_ref), 1e-6, 1e-6);
        assert_close(&what("lse vs float64"), &widen(&lse), &lse64, 1e-6, 1e-6);
        // ... and its pairs (M, log D), lse = s·M + log D, M the rows' raw max.
        let mut pairs = vec![UNWRITTEN; 2 * n];
        h.logsumexp_combine(&rec, &mut TensorMut::lse_pairs(&mut pairs).unwrap()).unwrap();
        let pair_lse = fusedce::lse_from_pairs(&pairs, scale).unwrap();
        assert_close(&what("lse of the pairs"), &widen(&pair_lse), &widen(&lse), 0.0, 3e-7);
        for i in 0..n {
            let m = xd[i * v..(i + 1) * v].iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            assert_eq!(pairs[2 * i] as f64, m, "{}", what(&format!("row {}'s pair: the raw max", i)));
        }

        // 4. each shard's softmax from that lse, its pairs and its [N] form: its columns of the unsharded
        // temp_softmax; padding exactly 0 / -inf (the outputs start at UNWRITTEN so that unwritten
        // elements show).
        for (from_pairs, lse_t) in [(true, TensorRef::lse_pairs(&pairs).unwrap()), (false, TensorRef::vector(&lse))] {
            let what = |s: &str| format!("{} (lse pairs {}): {}", lay.name, from_pairs, s);
            let mut total = vec![0f64; n];
            for (r, shard) in xs.iter().enumerate() {
                let (st, wd, c) = (lay.starts[r], lay.widths[r], lay.cols(r));
                let logits = TensorRef::matrix(shard, n, c).unwrap();
                let opts = SoftmaxOptions::new().temperature(t).vocab_start(st as i64).vocab_total(v as i64).lse(lse_t);
                let mut p = vec![UNWRITTEN; n * c];
                let mut lp = vec![UNWRITTEN; n * c];
                h.temp_softmax(
                    &logits,
                    &opts,
                    Some(&mut TensorMut::matrix(&mut p, n, c).unwrap()),
                    Some(&mut TensorMut::matrix(&mut lp, n, c).unwrap()),
                )
                .unwrap();
                for i in 0..n {
                    let (pr, lpr) = (&p[i * c..(i + 1) * c], &lp[i * c..(i + 1) * c]);
                    let row = format!("shard {} row {}", r, i);
                    assert_close(
                        &what(&format!("{} probs", row)),
                        &widen(&pr[..wd]),
                        &widen(&p_ref[i * v + st..i * v + st + wd]),
                        1e-7,
                        1e-5,
                    );
                    assert_close(
                        &what(&format!("{} logprobs", row)),
                        &widen(&lpr[..wd]),
                        &widen(&lp_ref[i * v + st..i * v + st + wd]),
                        1e-5,
                        1e-5,
                    );
                    assert!(pr[wd..].iter().all(|&a| a == 0.0), "{}: padding probs {:?}", what(&row), &pr[wd..]);
                    assert!(
                        lpr[wd..].iter().all(|&a| a == f32::NEG_INFINITY),
                        "{}: padding logprobs {:?}",
                        what(&row),
                        &lpr[wd..]
                    );
                    total[i] += pr[..wd].iter().map(|&a| a as f64).sum::<f64>();
                }
                if r == 0 {
                    let row = &p[neutral * c..(neutral + 1) * c];
                    assert!(row.iter().all(|&a| a == 0.0), "{}", what("the -inf shard's probabilities"));
                }

                // One output at a time: the same bits.
                let mut p1 = vec![UNWRITTEN; n * c];
                h.temp_softmax(&logits, &opts, Some(&mut TensorMut::matrix(&mut p1, n, c).unwrap()), None).unwrap();
                assert_eq!(bits(&p1), bits(&p), "{}", what(&format!("shard {} probs alone", r)));
                let mut lp1 = vec![UNWRITTEN; n * c];
                h.temp_softmax(&logits, &opts, None, Some(&mut TensorMut::matrix(&mut lp1, n, c).unwrap())).unwrap();
                assert_eq!(bits(&lp1), bits(&lp), "{}", what(&format!("shard {} logprobs alone", r)));

                // A shard's softmax is one elementwise pass: no workspace.
                let ws = h
                    .temp_softmax_workspace_size(
                        &logits,
                        &opts,
                        Some(&mut TensorMut::matrix(&mut p1, n, c).unwrap()),
                        None,
                    )
                    .unwrap();
                assert_eq!(ws, 0, "{}", what("shard softmax workspace"));
            }
            // The shards' probabilities make up whole distributions.
            assert_close(&what("Σ probs over the shards"), &total, &vec![1.0; n], 1e-5, 0.0);
        }
    }
}

/// Rows of NaN, +inf and all −inf: the combine gives what the unsharded logsumexp gives.
#[test]
fn sharded_lse_special_rows() {
    let (n, v) = (4, 9);
    let k = LSE_RECORD_FIELDS;
    let mut rng = Rng::new(9);
    let mut x = rng.f32s(n * v, -2.0, 2.0);
    x[7] = f32::NAN; // row 0, shard 1
    x[v + 2] = f32::INFINITY; // row 1, shard 0
    for j in 0..v {
        x[2 * v + j] = f32::NEG_INFINITY; // row 2: all -inf
    }
    // Row 3 is finite.
    let lay = Layout::new("[5, 4 + 2]", &[5, 4], &[0, 2]);
    let h = cpu();
    let mut lse_ref = vec![0f32; n];
    h.logsumexp(&TensorRef::matrix(&x, n, v).unwrap(), &LseOptions::new(), &mut TensorMut::vector(&mut lse_ref))
        .unwrap();
    assert!(lse_ref[0].is_nan() && lse_ref[1] == f32::INFINITY && lse_ref[2] == f32::NEG_INFINITY, "{:?}", lse_ref);
    let mut records = vec![UNWRITTEN; lay.ranks() * n * k];
    for (r, rec) in records.chunks_mut(n * k).enumerate() {
        h.logsumexp_partial(
            &TensorRef::matrix(&lay.shard_cols(&x, n, v, r), n, lay.cols(r)).unwrap(),
            &LseOptions::new().vocab_start(lay.starts[r] as i64).vocab_total(v as i64),
            &mut TensorMut::matrix(rec, n, k).unwrap(),
        )
        .unwrap();
    }
    // Rank 0, row 1 (+inf): m = +inf, d = 1; rank 1, row 0: NaN.
    assert_eq!(&records[k..k + 2], &[f32::INFINITY, 1.0]);
    assert!(records[n * k].is_nan(), "NaN row's record {:?}", &records[n * k..n * k + k]);
    let mut lse = vec![UNWRITTEN; n];
    h.logsumexp_combine(&TensorRef::new(&records, &[lay.ranks(), n, k]).unwrap(), &mut TensorMut::vector(&mut lse))
        .unwrap();
    assert!(lse[0].is_nan(), "NaN row: {}", lse[0]);
    assert_eq!(lse[1], f32::INFINITY);
    assert_eq!(lse[2], f32::NEG_INFINITY);
    assert_close("finite row", &[lse[3] as f64], &[lse_ref[3] as f64], 1e-6, 1e-6);
    // The pairs: (NaN, NaN), (+inf, 0), (-inf, 0), and the finite row's (M, log D).
    let mut pairs = vec![UNWRITTEN; 2 * n];
    h.logsumexp_combine(
        &TensorRef::new(&records, &[lay.ranks(), n, k]).unwrap(),
        &mut TensorMut::lse_pairs(&mut pairs).unwrap(),
    )
    .unwrap();
    assert!(pairs[0].is_nan() && pairs[1].is_nan(), "NaN row's pair {:?}", &pairs[..2]);
    assert_eq!(&pairs[2..6], &[f32::INFINITY, 0.0, f32::NEG_INFINITY, 0.0]);
    assert_close(
        "finite row's pair",
        &widen(&fusedce::lse_from_pairs(&pairs[6..], 1.0).unwrap()),
        &[lse[3] as f64],
        0.0,
        3e-7,
    );
}

#[test]
fn sharded_lse_and_softmax_bad_inputs() {
    let h = cpu();
    let (n, v, vt) = (2, 3, 6);
    let k = LSE_RECORD_FIELDS;
    let x = [0.5f32, -1.0, 2.0, 0.0, 1.0, 3.0];
    let xm = TensorRef::matrix(&x, n, v).unwrap();
    let shard = LseOptions::new().vocab_start(3).vocab_total(vt);
    let unsharded = LseOptions::new();
    assert_eq!((unsharded.scale, unsharded.vocab_start, unsharded.vocab_total), (1.0, 0, 0), "LseOptions defaults");
    let mut rec = vec![-1f32; n * k];
    let mut lse = vec![-1f32; n];

    // The unsharded logsumexp refuses a shard (vocab_total reaches the library).
    expect_err(h.logsumexp(&xm, &shard, &mut TensorMut::vector(&mut lse)), Status::INVALID_ARGUMENT, "vocab_total");
    assert!(lse.iter().all(|&a| a == -1.0), "a failed logsumexp wrote lse");

    // The partial call needs a shard ...
    expect_err(
        h.logsumexp_partial(&xm, &unsharded, &mut TensorMut::matrix(&mut rec, n, k).unwrap()),
        Status::INVALID_ARGUMENT,
        "vocab_total",
    );
    // ... with vocab_start inside [0, vocab_total] (vocab_start reaches the library; vocab_total itself is a
    // shard of padding alone),
    expect_err(
        h.logsumexp_partial(&xm, &shard.vocab_start(vt + 1), &mut TensorMut::matrix(&mut rec, n, k).unwrap()),
        Status::INVALID_ARGUMENT,
        "vocab_start",
    );
    // ... a scale in the domain,
    expect_err(
        h.logsumexp_partial(&xm, &shard.scale(0.0), &mut TensorMut::matrix(&mut rec, n, k).unwrap()),
        Status::INVALID_ARGUMENT,
        "scale",
    );
    // ... and records [N, 6].
    expect_err(
        h.logsumexp_partial(&xm, &shard, &mut TensorMut::matrix(&mut rec[..n], n, 1).unwrap()),
        Status::SHAPE_MISMATCH,
        "records",
    );
    assert!(rec.iter().all(|&a| a == -1.0), "a failed call wrote records");
    h.logsumexp_partial(&xm, &shard, &mut TensorMut::matrix(&mut rec, n, k).unwrap()).unwrap();
    assert!(rec.iter().all(|&a| a != -1.0), "records not written");
    // With the same x as the shard [0, 3) before it, the records tile [0, 6) as a combine needs.
    let mut rec0 = vec![-1f32; n * k];
    h.logsumexp_partial(&xm, &shard.vocab_start(0), &mut TensorMut::matrix(&mut rec0, n, k).unwrap()).unwrap();
    let tiled = [rec0, rec.clone()].concat();

    // The combine takes [W, N, 6] records, 3-D ...
    expect_err(
        h.logsumexp_combine(&TensorRef::matrix(&rec, n, k).unwrap(), &mut TensorMut::vector(&mut lse)),
        Status::SHAPE_MISMATCH,
        "3-D",
    );
    // ... of width 6,
    expect_err(
        h.logsumexp_combine(&TensorRef::new(&rec, &[1, 1, 2 * k]).unwrap(), &mut TensorMut::vector(&mut lse[..1])),
        Status::SHAPE_MISMATCH,
        "records",
    );
    // ... and writes lse [N] or [N, 2] (contiguous).
    let rec3 = TensorRef::new(&tiled, &[2, n, k]).unwrap();
    let mut pairs = vec![-1f32; 3 * n];
    expect_err(h.logsumexp_combine(&rec3, &mut TensorMut::vector(&mut lse[..1])), Status::SHAPE_MISMATCH, "lse");
    expect_err(
        h.logsumexp_combine(&rec3, &mut TensorMut::matrix(&mut pairs[..2 * n], 1, 2 * n).unwrap()),
        Status::SHAPE_MISMATCH,
        "lse",
    );
    expect_err(
        h.logsumexp_combine(&rec3, &mut TensorMut::matrix(&mut pairs, n, 3).unwrap()),
        Status::SHAPE_MISMATCH,
        "lse",
    );
    expect_err(
        h.logsumexp_combine(&rec3, &mut TensorMut::strided(&mut pairs[..2 * n + 1], n, 2, 3).unwrap()),
        Status::UNSUPPORTED_LAYOUT,
        "lse",
    );
    assert_eq!(
        TensorMut::lse_pairs(&mut pairs[..2 * n + 1]).unwrap_err().status(),
        Status::SHAPE_MISMATCH,
        "odd length"
    );
    assert!(lse.iter().all(|&a| a == -1.0) && pairs.iter().all(|&a| a == -1.0), "a failed combine wrote lse");
    h.logsumexp_combine(&rec3, &mut TensorMut::vector(&mut lse)).unwrap();
    assert!(lse.iter().all(|a| a.is_finite() && *a != -1.0), "lse {:?}", lse);
    // One shard's records alone do not tile the vocabulary: NaN rows, no error status.
    let mut lse1 = vec![-1f32; n];
    h.logsumexp_combine(&TensorRef::new(&rec, &[1, n, k]).unwrap(), &mut TensorMut::vector(&mut lse1)).unwrap();
    assert!(lse1.iter().all(|a| a.is_nan()), "one shard's lse {:?}", lse1);
    h.logsumexp_combine(&rec3, &mut TensorMut::lse_pairs(&mut pairs[..2 * n]).unwrap()).unwrap();

    // A shard's softmax.
    let lse_t = TensorRef::vector(&lse);
    let sm = SoftmaxOptions::new().vocab_start(3).vocab_total(vt).lse(lse_t);
    let defaults = SoftmaxOptions::new();
    assert_eq!((defaults.vocab_start, defaults.vocab_total, defaults.lse.is_none()), (0, 0, true), "SoftmaxOptions");
    let mut p = vec![-1f32; n * v];
    let run = |o: &SoftmaxOptions<'_>, p: &mut [f32]| {
        h.temp_softmax(&xm, o, Some(&mut TensorMut::matrix(p, n, v).unwrap()), None)
    };
    // Greedy, infinite and per-row temperatures are not implemented over shards,
    expect_err(run(&sm.temperature(0.0), &mut p), Status::NOT_IMPLEMENTED, "temperature");
    expect_err(run(&sm.temperature(f32::INFINITY), &mut p), Status::NOT_IMPLEMENTED, "temperature");
    let temps = [1.0f32, 2.0];
    expect_err(run(&sm.temperatures(TensorRef::vector(&temps)), &mut p), Status::NOT_IMPLEMENTED, "temperature");
    // ... a negative one is out of domain as without a shard,
    expect_err(run(&sm.temperature(-1.0), &mut p), Status::INVALID_ARGUMENT, "temperature");
    // ... the lse is required,
    let mut no_lse = sm;
    no_lse.lse = None;
    expect_err(run(&no_lse, &mut p), Status::INVALID_ARGUMENT, "lse");
    // ... and [N] or [N, 2] contiguous,
    expect_err(run(&sm.lse(TensorRef::vector(&lse[..1])), &mut p), Status::SHAPE_MISMATCH, "lse");
    expect_err(
        run(&sm.lse(TensorRef::matrix(&pairs[..2 * n], 1, 2 * n).unwrap()), &mut p),
        Status::SHAPE_MISMATCH,
        "lse",
    );
    expect_err(
        run(&sm.lse(TensorRef::strided(&pairs[..2 * n + 1], n, 2, 3).unwrap()), &mut p),
        Status::UNSUPPORTED_LAYOUT,
        "lse",
    );
    // ... and vocab_start inside [0, vocab_total].
    expect_err(run(&sm.vocab_start(vt + 1), &mut p), Status::INVALID_ARGUMENT, "vocab_start");
    assert!(p.iter().all(|&a| a == -1.0), "a failed softmax wrote probs");
    run(&sm, &mut p).unwrap();
    let total: f32 = p.iter().sum();
    assert!(p.iter().all(|&a| a > 0.0 && a < 1.0) && total > 0.5 && total < 1.5, "probs {:?}", p);
    // From the pairs: the same distribution.
    let mut pp = vec![-1f32; n * v];
    run(&sm.lse(TensorRef::lse_pairs(&pairs[..2 * n]).unwrap()), &mut pp).unwrap();
    assert_close("shard probs from the pairs", &widen(&pp), &widen(&p), 0.0, 1e-6);
    // A shard of padding alone (vocab_start = vocab_total): probabilities 0.
    let mut p0 = vec![-1f32; n * v];
    run(&sm.vocab_start(vt), &mut p0).unwrap();
    assert!(p0.iter().all(|&a| a == 0.0), "padding-alone shard's probs {:?}", p0);

    // Without a shard the lse is not read: the unsharded softmax, the same bits.
    let mut p_plain = vec![0f32; n * v];
    run(&SoftmaxOptions::new(), &mut p_plain).unwrap();
    let mut p_lse = vec![0f32; n * v];
    run(&SoftmaxOptions::new().lse(TensorRef::vector(&lse[..1])), &mut p_lse).unwrap();
    assert_eq!(bits(&p_lse), bits(&p_plain), "lse read without a shard");
}
