//! Float64 references computed in the tests themselves (never by the library), a deterministic RNG,
//! central finite differences and comparison helpers.
#![allow(dead_code)]

/// xorshift64* — deterministic test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    pub fn f32s(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f32> {
        (0..n).map(|_| self.uniform(lo, hi) as f32).collect()
    }
}

pub fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// The column range `[start, end)` that a vocabulary shard's record holds in its fields `at` and `at + 1`
/// (int32 bits in fp32 slots: cross-entropy's 4-5, logsumexp's 2-3, distillation's 5-6, its terms' 3-4).
pub fn range_of(record: &[f32], at: usize) -> (i64, i64) {
    (record[at].to_bits() as i32 as i64, record[at + 1].to_bits() as i32 as i64)
}

/// The bit patterns of fp32 values (bitwise comparisons; NaN equal to itself).
pub fn bits_of(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The logits of linear cross-entropy, `[n, v]`: hidden `[n, hd]` times weight `[v, hd]` transposed, plus
/// bias `[v]`, in float64.
pub fn linear_logits(n: usize, hd: usize, v: usize, hid: &[f64], w: &[f64], b: &[f64]) -> Vec<f64> {
    let mut out = vec![0.0; n * v];
    for i in 0..n {
        for j in 0..v {
            out[i * v + j] = b[j] + (0..hd).map(|c| hid[i * hd + c] * w[j * hd + c]).sum::<f64>();
        }
    }
    out
}

/// log Σ exp over a slice (max first); -inf for an empty or all -inf slice.
pub fn logsumexp(z: &[f64]) -> f64 {
    let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + z.iter().map(|&v| (v - m).exp()).sum::<f64>().ln()
}

pub fn argmax(x: &[f64]) -> usize {
    let mut best = 0;
    for j in 1..x.len() {
        if x[j] > x[best] {
            best = j;
        }
    }
    best
}

/// Central finite differences of `f` at `x`: df/dx_k for every k.
pub fn fd_grad(x: &[f64], f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    let mut y = x.to_vec();
    let mut g = vec![0.0; x.len()];
    for k in 0..x.len() {
        let h = 1e-5 * (1.0 + x[k].abs());
        y[k] = x[k] + h;
        let fp = f(&y);
        y[k] = x[k] - h;
        let fm = f(&y);
        y[k] = x[k];
        g[k] = (fp - fm) / (2.0 * h);
    }
    g
}

/// |got - want| <= atol + rtol·|want| for every element (NaN never passes unless both NaN).
pub fn assert_close(what: &str, got: &[f64], want: &[f64], atol: f64, rtol: f64) {
    assert_eq!(got.len(), want.len(), "{}: length", what);
    let mut worst = (0usize, 0.0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if g.is_nan() && w.is_nan() {
            continue;
        }
        if g == w {
            continue; // infinities
        }
        let err = (g - w).abs();
        let ok = err <= atol + rtol * w.abs();
        assert!(ok, "{}[{}]: got {} want {} (|diff| {:.3e}, atol {:.1e}, rtol {:.1e})", what, i, g, w, err, atol, rtol);
        if err > worst.1 {
            worst = (i, err);
        }
    }
}

pub fn f32v(x: &[f32]) -> Vec<f64> {
    widen(x)
}

// ----------------------------------------------------------------------------------- cross-entropy

/// Cross-entropy options in f64 (mirrors fce_ce_options_t, PyTorch semantics).
#[derive(Clone, Debug)]
pub struct CeRef {
    pub ignore_index: i64,
    pub eps: f64,
    pub q: f64,
    pub cap: f64,
    pub scale: f64,
    pub weights: Option<Vec<f64>>,
}

impl Default for CeRef {
    fn default() -> Self {
        CeRef { ignore_index: -100, eps: 0.0, q: 0.0, cap: 0.0, scale: 1.0, weights: None }
    }
}

#[derive(Clone, Debug, Default)]
pub struct CeRow {
    pub loss: f64,
    pub z_loss: f64,
    pub lse: f64,
    pub entropy: f64,
    pub argmax: usize,
    pub ignored: bool,
}

impl CeRef {
    pub fn w(&self, j: usize) -> f64 {
        self.weights.as_ref().map_or(1.0, |w| w[j])
    }
    pub fn transform(&self, x: f64) -> f64 {
        if self.cap > 0.0 {
            self.cap * (self.scale * x / self.cap).tanh()
        } else {
            self.scale * x
        }
    }
    /// One row of raw logits `x` [V] with target `t`.
    pub fn row(&self, x: &[f64], t: i64) -> CeRow {
        let v = x.len();
        let z: Vec<f64> = x.iter().map(|&xi| self.transform(xi)).collect();
        let lse = logsumexp(&z);
        let entropy = lse - z.iter().map(|&zj| (zj - lse).exp() * zj).sum::<f64>();
        let mut r = CeRow { lse, entropy, argmax: argmax(x), ..Default::default() };
        if t == self.ignore_index {
            r.ignored = true;
            return r;
        }
        let t = t as usize;
        let mut loss = (1.0 - self.eps) * self.w(t) * (lse - z[t]);
        loss += self.eps / v as f64 * (0..v).map(|j| self.w(j) * (lse - z[j])).sum::<f64>();
        r.z_loss = self.q * lse * lse;
        r.loss = loss + r.z_loss;
        r
    }
    pub fn rows(&self, x: &[f64], v: usize, targets: &[i64]) -> Vec<CeRow> {
        targets.iter().enumerate().map(|(i, &t)| self.row(&x[i * v..(i + 1) * v], t)).collect()
    }
    /// Denominator of the mean: Σ w[t] over non-ignored rows.
    pub fn denom(&self, targets: &[i64]) -> f64 {
        targets.iter().filter(|&&t| t != self.ignore_index).map(|&t| self.w(t as usize)).sum()
    }
}

/// What a reduced loss is: None with per-row upstream gradient g, Sum or Mean with a scalar g.
#[derive(Clone, Debug)]
pub enum Red {
    None(Vec<f64>),
    Sum(f64),
    Mean(f64),
}

/// Σ_i g_i·loss_i (None), g·Σ loss (Sum) or g·Σ loss / denom (Mean): the function whose gradient the
/// library's dlogits are.
pub fn reduce(rows: &[f64], red: &Red, denom: f64) -> f64 {
    match red {
        Red::None(g) => rows.iter().zip(g).map(|(l, g)| l * g).sum(),
        Red::Sum(g) => g * rows.iter().sum::<f64>(),
        Red::Mean(g) => {
            if denom > 0.0 {
                g * rows.iter().sum::<f64>() / denom
            } else {
                0.0
            }
        }
    }
}

// -------------------------------------------------------------------------------- distillation

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Div {
    Fkl,
    Rkl,
    Jsd(f64),
}

/// One divergence term from the teacher's and the student's log-probabilities (0·log 0 = 0).
pub fn kd_term(div: Div, lp: f64, lq: f64) -> f64 {
    let (p, q) = (lp.exp(), lq.exp());
    let xlog = |a: f64, la: f64, lb: f64| if a > 0.0 { a * (la - lb) } else { 0.0 };
    match div {
        Div::Fkl => xlog(p, lp, lq),
        Div::Rkl => xlog(q, lq, lp),
        Div::Jsd(b) => {
            let m = b * p + (1.0 - b) * q;
            let lm = m.ln();
            b * xlog(p, lp, lm) + (1.0 - b) * xlog(q, lq, lm)
        }
    }
}

/// Full-vocabulary KD loss of one row: student and teacher logits [V], temperature t.
pub fn kd_row_full(div: Div, s: &[f64], te: &[f64], t: f64) -> f64 {
    let zs: Vec<f64> = s.iter().map(|&x| x / t).collect();
    let zt: Vec<f64> = te.iter().map(|&x| x / t).collect();
    let (ls, lt) = (logsumexp(&zs), logsumexp(&zt));
    (0..s.len()).map(|j| kd_term(div, zt[j] - lt, zs[j] - ls)).sum()
}

/// A top-K row's float64 log-probabilities (None when the row has no used slot): the used slots (indices
/// into `ids`), the teacher's log-probabilities over them, log softmax_K(lp / t), and the student's at their
/// ids, over the whole row `s` [V] or (`renorm`) over those ids only.
pub fn topk_log_probs(
    s: &[f64],
    ids: &[i64],
    lp: &[f64],
    t: f64,
    renorm: bool,
) -> Option<(Vec<usize>, Vec<f64>, Vec<f64>)> {
    let used: Vec<usize> = (0..ids.len()).filter(|&k| ids[k] >= 0).collect();
    if used.is_empty() {
        return None;
    }
    let zt: Vec<f64> = used.iter().map(|&k| lp[k] / t).collect();
    let lt = logsumexp(&zt);
    let zs: Vec<f64> = s.iter().map(|&x| x / t).collect();
    let sel: Vec<f64> = used.iter().map(|&k| zs[ids[k] as usize]).collect();
    let ls = if renorm { logsumexp(&sel) } else { logsumexp(&zs) };
    Some((used, zt.iter().map(|&z| z - lt).collect(), sel.iter().map(|&z| z - ls).collect()))
}

/// Top-K KD loss of one row (None when the row has no used slot, i.e. is masked): teacher
/// log-probabilities `lp` [K] at ids `ids` [K] (negative = unused), student logits `s` [V].
pub fn kd_row_topk(div: Div, s: &[f64], ids: &[i64], lp: &[f64], t: f64, renorm: bool) -> Option<f64> {
    let (_, lpt, lqs) = topk_log_probs(s, ids, lp, t, renorm)?;
    Some(lpt.iter().zip(&lqs).map(|(&p, &q)| kd_term(div, p, q)).sum())
}

/// A split of the vocabulary over ranks: each rank's first global index, real width and padding width.
/// `shard_cols` cuts logits `[N, V]` by columns (padding NaN); `shard_rows` cuts a weight `[V, cols]` by rows.
pub struct Layout {
    pub name: &'static str,
    pub starts: Vec<usize>,
    pub widths: Vec<usize>,
    pub pads: Vec<usize>,
}

impl Layout {
    pub fn new(name: &'static str, widths: &[usize], pads: &[usize]) -> Layout {
        let mut starts = vec![0usize];
        for w in &widths[..widths.len() - 1] {
            starts.push(starts.last().unwrap() + w);
        }
        Layout { name, starts, widths: widths.to_vec(), pads: pads.to_vec() }
    }
    pub fn ranks(&self) -> usize {
        self.widths.len()
    }
    /// Rank r's shard size, padding included (its columns of the logits, or rows of the weight).
    pub fn cols(&self, r: usize) -> usize {
        self.widths[r] + self.pads[r]
    }
    pub fn rows(&self, r: usize) -> usize {
        self.cols(r)
    }
    /// Columns [start, start + width) of `x` [N, V], then `pad` NaN columns.
    pub fn shard_cols(&self, x: &[f32], n: usize, v: usize, r: usize) -> Vec<f32> {
        let (s, w, p) = (self.starts[r], self.widths[r], self.pads[r]);
        let mut m = Vec::with_capacity(n * (w + p));
        for i in 0..n {
            m.extend_from_slice(&x[i * v + s..i * v + s + w]);
            m.extend(std::iter::repeat(f32::NAN).take(p));
        }
        m
    }
    /// Rows [start, start + width) of `x` [V, cols], then `pad` rows of `fill`.
    pub fn shard_rows<T: Copy>(&self, x: &[T], cols: usize, r: usize, fill: T) -> Vec<T> {
        let (s, w, p) = (self.starts[r], self.widths[r], self.pads[r]);
        let mut m = x[s * cols..(s + w) * cols].to_vec();
        m.extend(std::iter::repeat(fill).take(p * cols));
        m
    }
}
