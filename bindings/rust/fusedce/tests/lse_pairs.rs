//! The lse in its pair form `[N, 2]` (m, l), lse = m + l (since 0.2.0): saved by a forward or written by a
//! combine, it lets a backward or a shard's softmax form every probability from max-shifted values, so that
//! no rounding of the size of the logits enters them. Rows whose logits sit at 2^25, where an fp32 lse
//! cannot hold log 2 (its ulp there is 4): the gradient from the pairs is exact and has the fused
//! gradient's bits; from the `[N]` lse (rounded to 2^25) every p_j is 1.
#[path = "support/reference.rs"]
mod reference;

use fusedce::{
    CeBwdInputs, CeOptions, CeOutputs, Handle, LinearCeGrads, LinearCeOutputs, LseOptions, Reduction, SoftmaxOptions,
    TensorMut, TensorRef, LSE_RECORD_FIELDS,
};
use reference::*;

fn cpu() -> Handle {
    Handle::cpu().expect("CPU handle")
}

const BIG: f32 = 33_554_432.0; // 2^25

/// The row [2^25, 2^25, 0, 1], target 0: p = (1/2, 1/2, 0, 0) (e^(-2^25) is 0), so
/// dlogits = p - onehot(0) = [-0.5, 0.5, 0, 0], exactly.
const LOGITS: [f32; 4] = [BIG, BIG, 0.0, 1.0];
const EXACT: [f32; 4] = [-0.5, 0.5, 0.0, 0.0];

#[test]
fn ce_backward_from_the_lse_pairs_is_exact_at_a_large_offset() {
    let h = cpu();
    let (n, v) = (1, 4);
    let x = TensorRef::matrix(&LOGITS, n, v).unwrap();
    let t = [0i64];
    let tv = TensorRef::vector(&t);
    let opts = CeOptions::new().reduction(Reduction::None);

    // The forward saves the pairs, with the fused gradient.
    let mut loss = [f32::NAN; 1];
    let mut pairs = [f32::NAN; 2];
    let mut fused = [f32::NAN; 4];
    h.cross_entropy_fwd(
        &x,
        &tv,
        &opts,
        &mut CeOutputs::new(TensorMut::vector(&mut loss))
            .lse(TensorMut::lse_pairs(&mut pairs).unwrap())
            .dlogits(TensorMut::matrix(&mut fused, n, v).unwrap()),
    )
    .unwrap();
    assert_eq!(pairs, [BIG, std::f32::consts::LN_2], "the pair (m, l)");
    // (The loss, lse - z_t in fp32, is 0 here rather than log 2: within docs/numerics.md's per-row bound,
    // 2e-5·(1 + |lse|), so not checked.)
    assert_eq!(bits_of(&fused), bits_of(&EXACT), "fused dlogits {:?}", fused);
    assert_eq!(fusedce::lse_from_pairs(&pairs, 1.0).unwrap(), vec![BIG], "lse = m + l rounds to 2^25 in fp32");

    // The backward from the pairs: exact, the fused bits (plain, _ex, in place).
    let pv = TensorRef::lse_pairs(&pairs).unwrap();
    let mut d = [f32::NAN; 4];
    h.cross_entropy_bwd(&x, &tv, &pv, None, &opts, &mut TensorMut::matrix(&mut d, n, v).unwrap()).unwrap();
    assert_eq!(bits_of(&d), bits_of(&fused), "cross_entropy_bwd from the pairs: {:?}", d);
    let mut d_ex = [f32::NAN; 4];
    h.cross_entropy_bwd_ex(&x, &tv, &CeBwdInputs::new(pv), &opts, &mut TensorMut::matrix(&mut d_ex, n, v).unwrap())
        .unwrap();
    assert_eq!(bits_of(&d_ex), bits_of(&fused), "cross_entropy_bwd_ex from the pairs: {:?}", d_ex);
    let mut y = LOGITS;
    h.cross_entropy_bwd_in_place(&mut TensorMut::matrix(&mut y, n, v).unwrap(), &tv, &pv, None, &opts).unwrap();
    assert_eq!(bits_of(&y), bits_of(&fused), "in place from the pairs: {:?}", y);

    // The [N] lse of the same forward is 2^25 (fp32 rounding): the backward's p_j = exp(z_j - lse) are
    // then 1 for both large logits, as the header documents for that form.
    let mut lse = [f32::NAN; 1];
    h.cross_entropy_fwd(
        &x,
        &tv,
        &opts,
        &mut CeOutputs::new(TensorMut::vector(&mut loss)).lse(TensorMut::vector(&mut lse)),
    )
    .unwrap();
    assert_eq!(lse, [BIG]);
    let mut d_n = [f32::NAN; 4];
    h.cross_entropy_bwd(
        &x,
        &tv,
        &TensorRef::vector(&lse),
        None,
        &opts,
        &mut TensorMut::matrix(&mut d_n, n, v).unwrap(),
    )
    .unwrap();
    assert_eq!(d_n, [0.0, 1.0, 0.0, 0.0], "from the [N] lse");
}

/// The same row as linear cross-entropy's logits: hidden [1], weight rows [2^25, 2^25, 0, 1]. dweight =
/// dlogits · hidden, exact from the pairs.
#[test]
fn linear_ce_backward_from_the_lse_pairs_is_exact_at_a_large_offset() {
    let h = cpu();
    let (n, hd, v) = (1, 1, 4);
    let hidden = [1.0f32];
    let hm = TensorRef::matrix(&hidden, n, hd).unwrap();
    let wm = TensorRef::matrix(&LOGITS, v, hd).unwrap();
    let t = [0i64];
    let tv = TensorRef::vector(&t);
    let opts = CeOptions::new().reduction(Reduction::None);
    let mut loss = [f32::NAN; 1];
    let mut pairs = [f32::NAN; 2];
    let mut dw_fused = [f32::NAN; 4];
    h.linear_cross_entropy_fwd(
        &hm,
        &wm,
        None,
        &tv,
        &opts,
        &mut LinearCeOutputs::new(TensorMut::vector(&mut loss))
            .lse(TensorMut::lse_pairs(&mut pairs).unwrap())
            .dweight(TensorMut::matrix(&mut dw_fused, v, hd).unwrap()),
    )
    .unwrap();
    assert_eq!(pairs, [BIG, std::f32::consts::LN_2], "the pair (m, l)");
    assert_eq!(bits_of(&dw_fused), bits_of(&EXACT), "fused dweight {:?}", dw_fused);
    let mut dw = [f32::NAN; 4];
    h.linear_cross_entropy_bwd(
        &hm,
        &wm,
        None,
        &tv,
        &TensorRef::lse_pairs(&pairs).unwrap(),
        &opts,
        &mut LinearCeGrads::new().dweight(TensorMut::matrix(&mut dw, v, hd).unwrap()),
    )
    .unwrap();
    assert_eq!(bits_of(&dw), bits_of(&EXACT), "dweight from the pairs {:?}", dw);
}

/// A shard's softmax at T = 1e-3 from the combined pairs (M, log D): two shards of one column each, both
/// 1000.5, so p = 1/2 each; s·x = 1.0005e6 puts the [N] lse's ulp at 1/16, which the pairs never round.
#[test]
fn shard_softmax_from_the_combined_pairs_at_a_small_temperature() {
    let h = cpu();
    let (n, v) = (1usize, 2usize);
    let t = 1e-3f32;
    let scale = 1.0f32 / t;
    let x = [1000.5f32, 1000.5];
    let k = LSE_RECORD_FIELDS;
    let mut records = vec![f32::NAN; v * n * k];
    for (r, rec) in records.chunks_mut(n * k).enumerate() {
        h.logsumexp_partial(
            &TensorRef::matrix(&x[r..r + 1], n, 1).unwrap(),
            &LseOptions::new().scale(scale).vocab_start(r as i64).vocab_total(v as i64),
            &mut TensorMut::matrix(rec, n, k).unwrap(),
        )
        .unwrap();
    }
    let mut pairs = [f32::NAN; 2];
    h.logsumexp_combine(&TensorRef::new(&records, &[v, n, k]).unwrap(), &mut TensorMut::lse_pairs(&mut pairs).unwrap())
        .unwrap();
    assert_eq!(pairs[0], 1000.5, "M, the raw max");
    assert_close("log D", &[pairs[1] as f64], &[std::f64::consts::LN_2], 0.0, 1e-6);
    for r in 0..v {
        let mut p = [f32::NAN; 1];
        let mut lp = [f32::NAN; 1];
        h.temp_softmax(
            &TensorRef::matrix(&x[r..r + 1], n, 1).unwrap(),
            &SoftmaxOptions::new()
                .temperature(t)
                .vocab_start(r as i64)
                .vocab_total(v as i64)
                .lse(TensorRef::lse_pairs(&pairs).unwrap()),
            Some(&mut TensorMut::matrix(&mut p, n, 1).unwrap()),
            Some(&mut TensorMut::matrix(&mut lp, n, 1).unwrap()),
        )
        .unwrap();
        assert_close(&format!("shard {} p", r), &[p[0] as f64], &[0.5], 0.0, 1e-6);
        assert_close(&format!("shard {} log p", r), &[lp[0] as f64], &[-std::f64::consts::LN_2], 0.0, 1e-6);
    }
}
