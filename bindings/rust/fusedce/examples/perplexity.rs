//! Perplexity of SmolLM2-135M on KJV Genesis through libfusedce's linear cross-entropy (CPU handle),
//! from the real-input sample `data/smollm2_kjv_sample.safetensors` (docs/real-input-sample.md).
//!
//! ```sh
//! cargo run --release --example perplexity [-- [PATH] [--rows N]]
//! ```
//! PATH defaults to `$FUSEDCE_SAMPLE`, else `<repo>/data/smollm2_kjv_sample.safetensors`; `--rows N` uses
//! the first N positions only (default: all T = 4096). The LM head (bf16 in the file) is widened to
//! fp32 exactly, so the library's result is compared with the file's float64 `ref_loss`.
#[path = "../tests/support/safetensors.rs"]
mod safetensors;

use std::error::Error;
use std::path::PathBuf;
use std::time::Instant;

use fusedce::{bits, CeOptions, Handle, LinearCeOutputs, Reduction, TensorMut, TensorRef};
use safetensors::SafeTensors;

fn default_path() -> PathBuf {
    match std::env::var_os("FUSEDCE_SAMPLE") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../data/smollm2_kjv_sample.safetensors")),
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let mut path = default_path();
    let mut rows: Option<usize> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--rows" => rows = Some(args.next().ok_or("--rows needs a number")?.parse()?),
            "-h" | "--help" => {
                println!("usage: perplexity [PATH] [--rows N]");
                return Ok(());
            }
            _ => path = PathBuf::from(a),
        }
    }
    if let Err(m) = fusedce::check_version() {
        return Err(Box::new(m));
    }
    println!("{}", fusedce::build_info());

    let t0 = Instant::now();
    let st = SafeTensors::open(&path)?;
    let (hidden, hshape) = st.f32("hidden")?;
    let (head_bits, wshape) = st.bf16_bits("lm_head")?;
    let (targets, _) = st.i32("targets")?;
    let (ref_loss, _) = st.f64("ref_loss")?;
    let (t_all, d) = (hshape[0], hshape[1]);
    let v = wshape[0];
    if wshape[1] != d {
        return Err(format!("lm_head is {:?} but hidden is {:?}", wshape, hshape).into());
    }
    let n = rows.unwrap_or(t_all).min(t_all);
    // bf16 -> fp32 is exact; the library wants weight and hidden in one dtype.
    let weight: Vec<f32> = head_bits.iter().map(|&b| bits::bf16_to_f32(b)).collect();
    let read_s = t0.elapsed().as_secs_f64();

    let h = Handle::cpu()?;
    let mut loss = vec![0f32; n];
    let mut argmax = vec![0i32; n];
    let t1 = Instant::now();
    h.linear_cross_entropy_fwd(
        &TensorRef::matrix(&hidden[..n * d], n, d)?,
        &TensorRef::matrix(&weight, v, d)?,
        None,
        &TensorRef::vector(&targets[..n]),
        &CeOptions::new().reduction(Reduction::None),
        &mut LinearCeOutputs::new(TensorMut::vector(&mut loss)).argmax(TensorMut::vector(&mut argmax)),
    )?;
    let run_s = t1.elapsed().as_secs_f64();

    let mean: f64 = loss.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
    let ref_mean: f64 = ref_loss[..n].iter().sum::<f64>() / n as f64;
    let max_diff = loss.iter().zip(&ref_loss[..n]).map(|(&a, &b)| (a as f64 - b).abs()).fold(0.0, f64::max);
    let top1 = argmax.iter().zip(&targets[..n]).filter(|(a, b)| a == b).count() as f64 / n as f64;
    println!("sample: {}", path.canonicalize().unwrap_or_else(|_| path.clone()).display());
    if let Some(m) = st.metadata.get("model") {
        println!("model: {}", m);
    }
    println!("positions: {} of {}, vocabulary {}, hidden {}", n, t_all, v, d);
    println!(
        "mean next-token loss: {:.6} nats (float64 reference {:.6}; max per-token |diff| {:.2e})",
        mean, ref_mean, max_diff
    );
    println!("perplexity: {:.4} (reference {:.4})", mean.exp(), ref_mean.exp());
    println!("top-1 accuracy: {:.4}", top1);
    println!(
        "read {:.2} s, linear cross-entropy {:.2} s ({:.1} GFLOP/s)",
        read_s,
        run_s,
        2.0 * (n * d * v) as f64 / run_s / 1e9
    );
    Ok(())
}
