//! The real-input sample (docs/real-input-sample.md): SmolLM2-135M hidden states and bf16 LM head on KJV
//! Genesis. Its perplexity through the crate's linear cross-entropy must match the file's float64
//! references. Skipped (passes with a note) when the file is absent: `data/` is not in git; it is made by
//! tools/fetch-sample.sh. Set FUSEDCE_SAMPLE to use another path.
#[path = "support/safetensors.rs"]
mod safetensors;

use std::path::PathBuf;

use fusedce::{bits, CeOptions, Handle, LinearCeOutputs, Reduction, TensorMut, TensorRef};
use safetensors::SafeTensors;

fn sample_path() -> PathBuf {
    match std::env::var_os("FUSEDCE_SAMPLE") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../data/smollm2_kjv_sample.safetensors")),
    }
}

#[test]
fn sample_perplexity() {
    let path = sample_path();
    if !path.exists() {
        eprintln!("SKIPPED sample_perplexity: {} is absent (tools/fetch-sample.sh makes it)", path.display());
        return;
    }
    let st = SafeTensors::open(&path).expect("readable sample");
    let (hidden, hshape) = st.f32("hidden").unwrap();
    let (head, wshape) = st.bf16_bits("lm_head").unwrap();
    let (targets, _) = st.i32("targets").unwrap();
    let (ref_loss, _) = st.f64("ref_loss").unwrap();
    let (ref_lse, _) = st.f64("ref_lse").unwrap();
    let (ref_argmax, _) = st.i32("ref_argmax").unwrap();
    let (n, d, v) = (hshape[0], hshape[1], wshape[0]);
    assert_eq!(wshape[1], d);
    let weight: Vec<f32> = head.iter().map(|&b| bits::bf16_to_f32(b)).collect(); // exact

    let h = Handle::cpu().unwrap();
    let mut loss = vec![0f32; n];
    let mut lse = vec![0f32; n];
    let mut argmax = vec![0i32; n];
    let mut mean = 0f32;
    // All T rows, per-row losses.
    h.linear_cross_entropy_fwd(
        &TensorRef::matrix(&hidden, n, d).unwrap(),
        &TensorRef::matrix(&weight, v, d).unwrap(),
        None,
        &TensorRef::vector(&targets),
        &CeOptions::new().reduction(Reduction::None),
        &mut LinearCeOutputs::new(TensorMut::vector(&mut loss))
            .lse(TensorMut::vector(&mut lse))
            .argmax(TensorMut::vector(&mut argmax)),
    )
    .unwrap();
    // The first 512 rows again with the default (mean) reduction.
    let m = 512.min(n);
    h.linear_cross_entropy_fwd(
        &TensorRef::matrix(&hidden[..m * d], m, d).unwrap(),
        &TensorRef::matrix(&weight, v, d).unwrap(),
        None,
        &TensorRef::vector(&targets[..m]),
        &CeOptions::default(),
        &mut LinearCeOutputs::new(TensorMut::scalar(&mut mean)),
    )
    .unwrap();

    let max_loss = loss.iter().zip(&ref_loss).map(|(&a, &b)| (a as f64 - b).abs()).fold(0.0, f64::max);
    let max_lse = lse.iter().zip(&ref_lse).map(|(&a, &b)| (a as f64 - b).abs()).fold(0.0, f64::max);
    assert!(max_loss < 1e-3, "per-token loss differs from ref_loss by up to {}", max_loss);
    assert!(max_lse < 1e-3, "lse differs from ref_lse by up to {}", max_lse);
    let agree = argmax.iter().zip(&ref_argmax).filter(|(a, b)| a == b).count();
    assert!(agree as f64 >= 0.999 * n as f64, "argmax agrees on {} of {} rows", agree, n);

    let ppl = (loss.iter().map(|&x| x as f64).sum::<f64>() / n as f64).exp();
    let ref_ppl = (ref_loss.iter().sum::<f64>() / n as f64).exp();
    assert!((ppl / ref_ppl - 1.0).abs() < 1e-5, "perplexity {} vs reference {}", ppl, ref_ppl);
    if let Some(meta) = st.metadata.get("perplexity").and_then(|s| s.parse::<f64>().ok()) {
        assert!((ppl / meta - 1.0).abs() < 1e-5, "perplexity {} vs metadata {}", ppl, meta);
    }
    let ref_mean512 = ref_loss[..m].iter().sum::<f64>() / m as f64;
    assert!((mean as f64 - ref_mean512).abs() < 1e-4, "mean of {} rows {} vs {}", m, mean, ref_mean512);
    eprintln!(
        "sample perplexity {:.4} (reference {:.4}); max |loss diff| {:.2e}, max |lse diff| {:.2e}",
        ppl, ref_ppl, max_loss, max_lse
    );
}
