//! Option and output structs of the ops. Their defaults are the loaded library's, from its `fce_*_init`
//! functions (equal to the header's `*_INIT` macros), and every C struct handed to the library is filled
//! by those functions before the fields set here are written (see `raw.rs`).
use std::ptr;

use crate::raw;
use crate::sys;
use crate::tensor::{TensorMut, TensorRef};

/// How per-row losses are reduced (`fce_reduction_t`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum Reduction {
    /// The loss output is `[N]` fp32, one value per row (0 for ignored / masked rows).
    None,
    /// The loss output is an fp32 scalar: the sum over rows.
    Sum,
    /// The loss output is an fp32 scalar: the sum divided by the number of non-ignored rows (by the
    /// sum of their class weights when class weights are given, as PyTorch); 0 when every row is
    /// ignored. For distillation this is "batchmean" over unmasked rows. The default.
    #[default]
    Mean,
}

impl Reduction {
    /// The C value (`FCE_REDUCTION_*`).
    pub fn to_raw(self) -> i32 {
        (match self {
            Reduction::None => sys::FCE_REDUCTION_NONE,
            Reduction::Sum => sys::FCE_REDUCTION_SUM,
            Reduction::Mean => sys::FCE_REDUCTION_MEAN,
        }) as i32
    }
    /// The reduction of a C value; None for a value this header does not know.
    pub fn from_raw(raw: i32) -> Option<Self> {
        [Reduction::None, Reduction::Sum, Reduction::Mean].into_iter().find(|r| r.to_raw() == raw)
    }
}

/// Divergence of knowledge distillation (`fce_kd_divergence_t`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum Divergence {
    /// KL(P_teacher ‖ P_student) (Hinton et al. 2015). The default.
    #[default]
    ForwardKl,
    /// KL(P_student ‖ P_teacher).
    ReverseKl,
    /// Generalized Jensen–Shannon divergence (GKD, Agarwal et al. 2024): with
    /// M = β·P_t + (1−β)·P_s, β·KL(P_t‖M) + (1−β)·KL(P_s‖M); β from [`KdOptions::beta`].
    Jsd,
}

impl Divergence {
    /// The C value (`FCE_KD_*`).
    pub fn to_raw(self) -> i32 {
        (match self {
            Divergence::ForwardKl => sys::FCE_KD_FORWARD_KL,
            Divergence::ReverseKl => sys::FCE_KD_REVERSE_KL,
            Divergence::Jsd => sys::FCE_KD_JSD,
        }) as i32
    }
    /// The divergence of a C value; None for a value this header does not know.
    pub fn from_raw(raw: i32) -> Option<Self> {
        [Divergence::ForwardKl, Divergence::ReverseKl, Divergence::Jsd].into_iter().find(|d| d.to_raw() == raw)
    }
}

/// How the student side of a top-K teacher is normalized (`fce_kd_topk_norm_t`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum TopkNorm {
    /// Student log-probabilities over the full vocabulary; gradient over the full row. The default.
    #[default]
    FullVocab,
    /// Student log-probabilities renormalized over the K ids only; gradient zero outside them.
    Renormalize,
}

impl TopkNorm {
    /// The C value (`FCE_KD_TOPK_*`).
    pub fn to_raw(self) -> i32 {
        (match self {
            TopkNorm::FullVocab => sys::FCE_KD_TOPK_FULL_VOCAB,
            TopkNorm::Renormalize => sys::FCE_KD_TOPK_RENORMALIZE,
        }) as i32
    }
    /// The normalization of a C value; None for a value this header does not know.
    pub fn from_raw(raw: i32) -> Option<Self> {
        [TopkNorm::FullVocab, TopkNorm::Renormalize].into_iter().find(|n| n.to_raw() == raw)
    }
}

/// Options of cross-entropy and linear cross-entropy (`fce_ce_options_t`).
///
/// Math for a row x of logits `[V]` with target t (fp32, max of the raw row first):
/// z_j = c·tanh(s·x_j/c) if `softcap` c > 0, else s·x_j (s = `logit_scale`); lse = log Σ_j exp z_j;
/// loss = (1−e)·w_t·(lse − z_t) + (e/V)·Σ_j w_j·(lse − z_j) + q·lse², in nats, with e =
/// `label_smoothing`, w = `class_weights` (1 without), q = `z_loss_scale`. Rows whose target equals
/// `ignore_index` have loss 0 and zero gradient; a target outside `[0, V)` gives that row a NaN loss.
///
/// Vocabulary-parallel cross-entropy (the header's "Vocabulary-parallel cross-entropy"): when the logits
/// are columns `[vocab_start, vocab_start + V_local)` of a vocabulary of `vocab_total` (one rank's shard,
/// possibly padded past `vocab_total`), set [`CeOptions::vocab_start`] and [`CeOptions::vocab_total`] and
/// use [`crate::Handle::cross_entropy_partial`], [`crate::Handle::cross_entropy_combine`] and a shard's
/// [`crate::Handle::cross_entropy_bwd`]; the math above is then over the whole vocabulary (V =
/// `vocab_total`, targets global indices, `class_weights` of the whole vocabulary). For linear
/// cross-entropy, when the weight's rows are such a shard: [`crate::Handle::linear_cross_entropy_partial`],
/// the same combine and a shard's [`crate::Handle::linear_cross_entropy_bwd`]. The unsharded forwards
/// refuse options with `vocab_total` set (`INVALID_ARGUMENT`).
///
/// `CeOptions::default()` is the loaded library's `fce_ce_options_init` (the header's `FCE_CE_OPTIONS_INIT`).
#[derive(Copy, Clone, Debug)]
pub struct CeOptions<'a> {
    /// Reduction of the per-row losses; default [`Reduction::Mean`].
    pub reduction: Reduction,
    /// Targets equal to this are ignored; default -100 (PyTorch).
    pub ignore_index: i64,
    /// e in [0, 1]; default 0.
    pub label_smoothing: f32,
    /// q >= 0 (PaLM uses 1e-4); default 0.
    pub z_loss_scale: f32,
    /// c >= 0, 0 = off (Gemma 2 uses 30); default 0.
    pub softcap: f32,
    /// s > 0, finite, multiplies the logits (1/temperature); default 1.
    pub logit_scale: f32,
    /// Optional class weights `[V]` fp32, finite and >= 0 (PyTorch `weight`); default None (all ones).
    /// With a vocabulary shard: the weights of the whole vocabulary, `[vocab_total]`.
    pub class_weights: Option<TensorRef<'a>>,
    /// Vocabulary-parallel calls: the global index of the logits' first column, in `[0, vocab_total]`
    /// (`vocab_total` itself: a shard of padding alone, whose record is neutral); default 0 (and it must
    /// be 0 when `vocab_total` is 0). Not read by [`crate::Handle::cross_entropy_combine`].
    pub vocab_start: i64,
    /// Vocabulary-parallel calls: V of the whole vocabulary (columns of a shard at or past it are
    /// padding, never read, gradient 0); default 0 = not sharded. At most 2³¹ − 1 for the partial and
    /// combine calls (records hold int32 indices).
    pub vocab_total: i64,
}

impl Default for CeOptions<'_> {
    /// The library's defaults (`fce_ce_options_init`).
    fn default() -> Self {
        let d = raw::init::<sys::fce_ce_options_t>();
        CeOptions {
            reduction: Reduction::from_raw(d.reduction).unwrap_or_default(),
            ignore_index: d.ignore_index,
            label_smoothing: d.label_smoothing,
            z_loss_scale: d.z_loss_scale,
            softcap: d.softcap,
            logit_scale: d.logit_scale,
            class_weights: None,
            vocab_start: d.vocab_start,
            vocab_total: d.vocab_total,
        }
    }
}

impl<'a> CeOptions<'a> {
    /// The defaults (`fce_ce_options_init`, i.e. `FCE_CE_OPTIONS_INIT`).
    pub fn new() -> Self {
        Self::default()
    }
    /// Sets [`CeOptions::reduction`].
    pub fn reduction(mut self, r: Reduction) -> Self {
        self.reduction = r;
        self
    }
    /// Sets [`CeOptions::ignore_index`].
    pub fn ignore_index(mut self, i: i64) -> Self {
        self.ignore_index = i;
        self
    }
    /// Sets [`CeOptions::label_smoothing`].
    pub fn label_smoothing(mut self, e: f32) -> Self {
        self.label_smoothing = e;
        self
    }
    /// Sets [`CeOptions::z_loss_scale`].
    pub fn z_loss_scale(mut self, q: f32) -> Self {
        self.z_loss_scale = q;
        self
    }
    /// Sets [`CeOptions::softcap`].
    pub fn softcap(mut self, c: f32) -> Self {
        self.softcap = c;
        self
    }
    /// Sets [`CeOptions::logit_scale`].
    pub fn logit_scale(mut self, s: f32) -> Self {
        self.logit_scale = s;
        self
    }
    /// Sets [`CeOptions::class_weights`] (`[V]` fp32).
    pub fn class_weights(mut self, w: TensorRef<'a>) -> Self {
        self.class_weights = Some(w);
        self
    }
    /// Sets [`CeOptions::vocab_start`].
    pub fn vocab_start(mut self, start: i64) -> Self {
        self.vocab_start = start;
        self
    }
    /// Sets [`CeOptions::vocab_total`].
    pub fn vocab_total(mut self, total: i64) -> Self {
        self.vocab_total = total;
        self
    }

    /// The C struct (filled by `fce_ce_options_init`, then these fields), with `class_weights` pointing
    /// at `weights` (NULL when None). `weights` must be the DLTensor of `self.class_weights` and outlive
    /// the use of the result.
    pub(crate) fn to_raw(self, weights: Option<&sys::DLTensor>) -> sys::fce_ce_options_t {
        let mut r = raw::init::<sys::fce_ce_options_t>();
        let o = &mut r;
        o.reduction = self.reduction.to_raw();
        o.ignore_index = self.ignore_index;
        o.label_smoothing = self.label_smoothing;
        o.z_loss_scale = self.z_loss_scale;
        o.softcap = self.softcap;
        o.logit_scale = self.logit_scale;
        o.class_weights = weights.map_or(ptr::null(), |w| w as *const sys::DLTensor);
        o.vocab_start = self.vocab_start;
        o.vocab_total = self.vocab_total;
        r
    }
}

/// Outputs of [`crate::Handle::cross_entropy_fwd`] and [`crate::Handle::cross_entropy_combine`]
/// (`fce_ce_outputs_t`); every field but `loss` optional. The combine writes no gradient: `dlogits`,
/// `grad_loss` and `grad_entropy` must be None there.
#[derive(Debug)]
pub struct CeOutputs<'a> {
    /// Required. fp32: `[N]` for [`Reduction::None`], a scalar otherwise. Nats.
    pub loss: TensorMut<'a>,
    /// The logsumexp of the transformed logits z, fp32, in one of two forms (save it for the backward):
    /// `[N]` ([`TensorMut::vector`]), the lse itself; or `[N, 2]` contiguous ([`TensorMut::lse_pairs`],
    /// or [`TensorMut::matrix`] with 2 columns), each row's pair (m, l): m = max_j z_j and
    /// l = log Σ_j exp(z_j − m), lse = m + l ([`crate::lse_from_pairs`]). A backward from the pairs
    /// forms every probability as the forward does, p_j = exp((z_j − m) − l): its gradient holds at any
    /// common offset of the logits and has the fused gradient's bits. From `[N]` each p_j carries the fp32
    /// lse's rounding, up to |lse|·2⁻²⁴ relative (6e-3 at |lse| = 1e5). Pairs since 0.2.0. Another shape
    /// is `SHAPE_MISMATCH`, an `[N, 2]` view with a row stride other than 2 `UNSUPPORTED_LAYOUT`.
    pub lse: Option<TensorMut<'a>>,
    /// The z-loss part of `loss` (q·lse² per non-ignored row), shaped and reduced like `loss`.
    pub z_loss: Option<TensorMut<'a>>,
    /// `[N]` i32 or i64: index of the largest raw logit (lowest on ties; NaN counts as largest).
    pub argmax: Option<TensorMut<'a>>,
    /// `[N]` fp32: entropy of softmax(z) in nats, H = −Σ_j p_j·log p_j (differentiable through
    /// [`CeOutputs::grad_entropy`]).
    pub entropy: Option<TensorMut<'a>>,
    /// `[N, V]` in the logits' dtype: d(loss)/d(logits) × grad_loss (+ grad_entropy × dH/d(logits)
    /// with [`CeOutputs::grad_entropy`]), fused into the forward pass, formed in fp32 and rounded once.
    pub dlogits: Option<TensorMut<'a>>,
    /// Upstream gradient, fp32: scalar for Sum/Mean, `[N]` or scalar for None; default 1.
    pub grad_loss: Option<TensorRef<'a>>,
    /// Upstream gradient of the entropy, fp32: `[N]` or a scalar (broadcast), whatever the reduction;
    /// default None (the entropy is not differentiated). Only with `dlogits` (else `INVALID_ARGUMENT`):
    /// `dlogits` then also holds grad_entropy_i × dH_i/d(logits) for every row, ignored rows included,
    /// with dH/dz_j = p_j·(μ − z_j), μ = Σ_k p_k·z_k = lse − H (the entropy's derivative, e.g. Pereyra
    /// et al. 2017), chained through `logit_scale` and `softcap` as the loss gradient is; a logit of −inf
    /// gets 0. Since 0.2.0 (`fce_ce_outputs_t.grad_entropy`).
    pub grad_entropy: Option<TensorRef<'a>>,
}

impl<'a> CeOutputs<'a> {
    /// Outputs with only the loss (the rest as `fce_ce_outputs_init` leaves them: none).
    pub fn new(loss: TensorMut<'a>) -> Self {
        CeOutputs {
            loss,
            lse: None,
            z_loss: None,
            argmax: None,
            entropy: None,
            dlogits: None,
            grad_loss: None,
            grad_entropy: None,
        }
    }
    /// Requests [`CeOutputs::lse`].
    pub fn lse(mut self, t: TensorMut<'a>) -> Self {
        self.lse = Some(t);
        self
    }
    /// Requests [`CeOutputs::z_loss`].
    pub fn z_loss(mut self, t: TensorMut<'a>) -> Self {
        self.z_loss = Some(t);
        self
    }
    /// Requests [`CeOutputs::argmax`].
    pub fn argmax(mut self, t: TensorMut<'a>) -> Self {
        self.argmax = Some(t);
        self
    }
    /// Requests [`CeOutputs::entropy`].
    pub fn entropy(mut self, t: TensorMut<'a>) -> Self {
        self.entropy = Some(t);
        self
    }
    /// Requests the fused gradient [`CeOutputs::dlogits`].
    pub fn dlogits(mut self, t: TensorMut<'a>) -> Self {
        self.dlogits = Some(t);
        self
    }
    /// Sets [`CeOutputs::grad_loss`].
    pub fn grad_loss(mut self, t: TensorRef<'a>) -> Self {
        self.grad_loss = Some(t);
        self
    }
    /// Sets [`CeOutputs::grad_entropy`] (`[N]` or scalar fp32).
    pub fn grad_entropy(mut self, t: TensorRef<'a>) -> Self {
        self.grad_entropy = Some(t);
        self
    }
}

/// What [`crate::Handle::cross_entropy_bwd_ex`] reads (`fce_ce_bwd_inputs_t`): the forward's saved
/// statistics and the upstream gradients. `CeBwdInputs::new(lse)` leaves the rest as
/// `fce_ce_bwd_inputs_init` does (none).
#[derive(Copy, Clone, Debug)]
pub struct CeBwdInputs<'a> {
    /// Required: the forward's lse (same options), fp32, `[N]` or its pairs `[N, 2]` as
    /// [`CeOutputs::lse`] describes (the pairs give the fused gradient's bits).
    pub lse: TensorRef<'a>,
    /// Upstream gradient of the loss, as [`CeOutputs::grad_loss`] (fp32 scalar for Sum/Mean, `[N]` or
    /// scalar for None); default None = 1.
    pub grad_loss: Option<TensorRef<'a>>,
    /// `[N]` fp32, the forward's entropy output (same options); required with `grad_entropy`
    /// (`INVALID_ARGUMENT` otherwise), else not read. The backward takes μ = lse − H from it.
    pub entropy: Option<TensorRef<'a>>,
    /// Upstream gradient of the entropy, fp32, `[N]` or a scalar, as [`CeOutputs::grad_entropy`];
    /// default None.
    pub grad_entropy: Option<TensorRef<'a>>,
}

impl<'a> CeBwdInputs<'a> {
    /// Inputs with only the saved lse (`[N]` or `[N, 2]` fp32): the backward of [`crate::Handle::cross_entropy_bwd`]
    /// with an upstream gradient of 1.
    pub fn new(lse: TensorRef<'a>) -> Self {
        CeBwdInputs { lse, grad_loss: None, entropy: None, grad_entropy: None }
    }
    /// Sets [`CeBwdInputs::grad_loss`].
    pub fn grad_loss(mut self, t: TensorRef<'a>) -> Self {
        self.grad_loss = Some(t);
        self
    }
    /// Sets [`CeBwdInputs::entropy`] (`[N]` fp32, the forward's entropy).
    pub fn entropy(mut self, t: TensorRef<'a>) -> Self {
        self.entropy = Some(t);
        self
    }
    /// Sets [`CeBwdInputs::grad_entropy`] (`[N]` or scalar fp32); needs [`CeBwdInputs::entropy`].
    pub fn grad_entropy(mut self, t: TensorRef<'a>) -> Self {
        self.grad_entropy = Some(t);
        self
    }
}

/// Options of [`crate::Handle::logsumexp`] and of vocabulary-parallel logsumexp (`fce_lse_options_t`); the
/// default is the library's `fce_lse_options_init` (`FCE_LSE_OPTIONS_INIT`).
///
/// Vocabulary-parallel logsumexp (the header's "Vocabulary-parallel logsumexp"): when x holds columns
/// `[vocab_start, vocab_start + V_local)` of a vocabulary of `vocab_total` (one rank's shard, possibly
/// padded past `vocab_total`), set [`LseOptions::vocab_start`] and [`LseOptions::vocab_total`] and use
/// [`crate::Handle::logsumexp_partial`] and [`crate::Handle::logsumexp_combine`]; the lse is then that of
/// the whole rows. [`crate::Handle::logsumexp`] refuses options with `vocab_total` set
/// (`INVALID_ARGUMENT`).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct LseOptions {
    /// s > 0, finite: lse_i = log Σ_j exp(s·x_ij); default 1. With scale 1/T (the fp32 `1.0 / T` that
    /// the softmax forms) the combined lse is the one a shard's [`crate::Handle::temp_softmax`] takes
    /// ([`SoftmaxOptions::lse`]). Every shard's records carry it; records of different scales combine
    /// to NaN.
    pub scale: f32,
    /// Vocabulary-parallel calls: the global index of the shard's first column, in `[0, vocab_total]`
    /// (`vocab_total`: a shard of padding alone); default 0 (and it must be 0 when `vocab_total` is 0).
    /// Since 0.2.0.
    pub vocab_start: i64,
    /// Vocabulary-parallel calls: V of the whole vocabulary (columns of a shard at or past it are
    /// padding, never read); default 0 = not sharded. Required by [`crate::Handle::logsumexp_partial`],
    /// refused by [`crate::Handle::logsumexp`]. Since 0.2.0.
    pub vocab_total: i64,
}

impl Default for LseOptions {
    /// The library's defaults (`fce_lse_options_init`).
    fn default() -> Self {
        let d = raw::init::<sys::fce_lse_options_t>();
        LseOptions { scale: d.scale, vocab_start: d.vocab_start, vocab_total: d.vocab_total }
    }
}

impl LseOptions {
    /// The defaults (`fce_lse_options_init`, i.e. `FCE_LSE_OPTIONS_INIT`).
    pub fn new() -> Self {
        Self::default()
    }
    /// Sets [`LseOptions::scale`].
    pub fn scale(mut self, s: f32) -> Self {
        self.scale = s;
        self
    }
    /// Sets [`LseOptions::vocab_start`].
    pub fn vocab_start(mut self, start: i64) -> Self {
        self.vocab_start = start;
        self
    }
    /// Sets [`LseOptions::vocab_total`].
    pub fn vocab_total(mut self, total: i64) -> Self {
        self.vocab_total = total;
        self
    }
    pub(crate) fn to_raw(self) -> sys::fce_lse_options_t {
        let mut r = raw::init::<sys::fce_lse_options_t>();
        r.scale = self.scale;
        r.vocab_start = self.vocab_start;
        r.vocab_total = self.vocab_total;
        r
    }
}

/// Options of [`crate::Handle::temp_softmax`] (`fce_softmax_options_t`); the default is the library's
/// `fce_softmax_options_init` (`FCE_SOFTMAX_OPTIONS_INIT`).
///
/// A vocabulary shard (the header's `fce_softmax_options_t.vocab_total`): when the logits are columns
/// `[vocab_start, vocab_start + V_local)` of a vocabulary of `vocab_total` (one rank's shard, possibly
/// padded past `vocab_total`), set [`SoftmaxOptions::vocab_start`], [`SoftmaxOptions::vocab_total`] and
/// [`SoftmaxOptions::lse`]; the call then writes the shard's columns of the whole rows' distribution from
/// that lse: log p_j = x_j/T − lse, p_j its exp, padding columns 0 and −inf. One finite
/// temperature T > 0 only: per-row `temperatures`, T = 0 and T = +inf are `NOT_IMPLEMENTED` there.
#[derive(Copy, Clone, Debug)]
pub struct SoftmaxOptions<'a> {
    /// Temperature T of every row when `temperatures` is None: >= 0 and not NaN; 0 is greedy (one-hot
    /// at the argmax), +inf the uniform distribution over finite logits. Default 1. With a shard: finite
    /// and > 0 (`NOT_IMPLEMENTED` otherwise).
    pub temperature: f32,
    /// Optional per-row temperatures `[N]` fp32; a negative or NaN one makes that row NaN. Not with a
    /// shard (`NOT_IMPLEMENTED`).
    pub temperatures: Option<TensorRef<'a>>,
    /// A vocabulary shard: the global index of the logits' first column, in `[0, vocab_total]`
    /// (`vocab_total`: padding alone); default 0 (and it must be 0 when `vocab_total` is 0). Since 0.2.0.
    pub vocab_start: i64,
    /// A vocabulary shard: V of the whole vocabulary (columns at or past it are padding, never read:
    /// probability 0, log-probability −inf); default 0 = the logits are whole rows. Since 0.2.0.
    pub vocab_total: i64,
    /// With a shard (required then, `INVALID_ARGUMENT` when None): the rows' logsumexp of logits/T over
    /// the whole vocabulary, i.e. [`crate::Handle::logsumexp_combine`] of every shard's
    /// [`crate::Handle::logsumexp_partial`] with [`LseOptions::scale`] the fp32 `1.0 / T`; fp32, as its
    /// pairs `[N, 2]` (M, log D) ([`TensorRef::lse_pairs`]; since 0.2.0) or as `[N]`. From the pairs,
    /// log p_j = (x_j − M)/T − log D, formed as the unsharded call forms it (no NaN for finite logits at
    /// any T > 0, no rounding of the size of x/T); from `[N]` every value carries the lse's rounding
    /// (|lse|·2⁻²⁴) and an lse that overflowed fp32 gives probabilities 0. Not read without a shard.
    /// Since 0.2.0 (`fce_softmax_options_t.lse`).
    pub lse: Option<TensorRef<'a>>,
}

impl Default for SoftmaxOptions<'_> {
    /// The library's defaults (`fce_softmax_options_init`).
    fn default() -> Self {
        let d = raw::init::<sys::fce_softmax_options_t>();
        SoftmaxOptions {
            temperature: d.temperature,
            temperatures: None,
            vocab_start: d.vocab_start,
            vocab_total: d.vocab_total,
            lse: None,
        }
    }
}

impl<'a> SoftmaxOptions<'a> {
    /// The defaults (`fce_softmax_options_init`, i.e. `FCE_SOFTMAX_OPTIONS_INIT`).
    pub fn new() -> Self {
        Self::default()
    }
    /// Sets [`SoftmaxOptions::temperature`].
    pub fn temperature(mut self, t: f32) -> Self {
        self.temperature = t;
        self
    }
    /// Sets [`SoftmaxOptions::temperatures`] (`[N]` fp32).
    pub fn temperatures(mut self, t: TensorRef<'a>) -> Self {
        self.temperatures = Some(t);
        self
    }
    /// Sets [`SoftmaxOptions::vocab_start`].
    pub fn vocab_start(mut self, start: i64) -> Self {
        self.vocab_start = start;
        self
    }
    /// Sets [`SoftmaxOptions::vocab_total`].
    pub fn vocab_total(mut self, total: i64) -> Self {
        self.vocab_total = total;
        self
    }
    /// Sets [`SoftmaxOptions::lse`] (`[N]` or `[N, 2]` fp32, the whole rows' logsumexp of logits/T).
    pub fn lse(mut self, lse: TensorRef<'a>) -> Self {
        self.lse = Some(lse);
        self
    }
    /// The C struct (filled by `fce_softmax_options_init`, then these fields), with `temperatures` and
    /// `lse` pointing at `temps` and `lse` (NULL when None). They must be the DLTensors of
    /// `self.temperatures` and `self.lse` and outlive the use of the result.
    pub(crate) fn to_raw(
        self,
        temps: Option<&sys::DLTensor>,
        lse: Option<&sys::DLTensor>,
    ) -> sys::fce_softmax_options_t {
        let mut r = raw::init::<sys::fce_softmax_options_t>();
        let o = &mut r;
        o.temperature = self.temperature;
        o.temperatures = temps.map_or(ptr::null(), |t| t as *const sys::DLTensor);
        o.vocab_start = self.vocab_start;
        o.vocab_total = self.vocab_total;
        o.lse = lse.map_or(ptr::null(), |t| t as *const sys::DLTensor);
        r
    }
}

/// Options of [`crate::Handle::kd_loss`] and of vocabulary-parallel distillation (`fce_kd_options_t`);
/// the default is the library's `fce_kd_options_init` (`FCE_KD_OPTIONS_INIT`).
///
/// With temperature T both distributions are softmax(logits / T); a top-K teacher's distribution over
/// its K ids is softmax_K(logprobs / T). Terms of zero probability contribute exactly 0.
///
/// Vocabulary-parallel distillation (the header's "Vocabulary-parallel knowledge distillation"): when
/// student and teacher logits are the same columns `[vocab_start, vocab_start + V_local)` of a vocabulary
/// of `vocab_total` (one rank's shard, possibly padded past `vocab_total`), set [`KdOptions::vocab_start`]
/// and [`KdOptions::vocab_total`] and use [`crate::Handle::kd_partial`], [`crate::Handle::kd_combine`]
/// and [`crate::Handle::kd_bwd`]; the divergence is then that of the whole rows. Forward and reverse KL
/// with teacher logits take one exchange of records; [`Divergence::Jsd`] (0 < β < 1) and a top-K teacher
/// ([`Teacher::TopK`], global ids, the same on every rank; either [`TopkNorm`]) take two, needing the rows'
/// normalizers first ([`crate::Handle::kd_combine_row_stats`], [`crate::Handle::kd_terms_partial`],
/// [`crate::Handle::kd_terms_combine`]; the recipe is in [`crate::Handle::kd_partial`]'s docs).
/// [`crate::Handle::kd_loss`] refuses options with `vocab_total` set (`INVALID_ARGUMENT`).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct KdOptions {
    /// The divergence; default [`Divergence::ForwardKl`].
    pub divergence: Divergence,
    /// β in [0, 1] for [`Divergence::Jsd`]; default 0.5.
    pub beta: f32,
    /// T from [`crate::KD_TEMPERATURE_MIN`] to [`crate::KD_TEMPERATURE_MAX`] inclusive (1e-4 to 100;
    /// `INVALID_ARGUMENT` otherwise); default 1.
    pub temperature: f32,
    /// Multiply loss and gradient by T² (Hinton); default false.
    pub scale_by_t2: bool,
    /// Student normalization for a top-K teacher; default [`TopkNorm::FullVocab`].
    pub topk_norm: TopkNorm,
    /// Reduction; [`Reduction::Mean`] (the default) is batchmean over unmasked rows.
    pub reduction: Reduction,
    /// Rows whose target equals this are masked (when targets are given); default -100.
    pub ignore_index: i64,
    /// Vocabulary-parallel calls: the global index of the shard's first column, in `[0, vocab_total]`
    /// (`vocab_total`: a shard of padding alone); default 0 (and it must be 0 when `vocab_total` is 0). Not
    /// read by [`crate::Handle::kd_combine`].
    /// Since 0.2.0.
    pub vocab_start: i64,
    /// Vocabulary-parallel calls: V of the whole vocabulary (columns of a shard at or past it are
    /// padding, never read, gradient 0); default 0 = not sharded. Since 0.2.0.
    pub vocab_total: i64,
}

impl Default for KdOptions {
    /// The library's defaults (`fce_kd_options_init`).
    fn default() -> Self {
        let d = raw::init::<sys::fce_kd_options_t>();
        KdOptions {
            divergence: Divergence::from_raw(d.divergence).unwrap_or_default(),
            beta: d.beta,
            temperature: d.temperature,
            scale_by_t2: d.scale_by_t2 != 0,
            topk_norm: TopkNorm::from_raw(d.topk_norm).unwrap_or_default(),
            reduction: Reduction::from_raw(d.reduction).unwrap_or_default(),
            ignore_index: d.ignore_index,
            vocab_start: d.vocab_start,
            vocab_total: d.vocab_total,
        }
    }
}

impl KdOptions {
    /// The defaults (`fce_kd_options_init`, i.e. `FCE_KD_OPTIONS_INIT`).
    pub fn new() -> Self {
        Self::default()
    }
    /// Sets [`KdOptions::divergence`].
    pub fn divergence(mut self, d: Divergence) -> Self {
        self.divergence = d;
        self
    }
    /// Sets [`KdOptions::beta`].
    pub fn beta(mut self, b: f32) -> Self {
        self.beta = b;
        self
    }
    /// Sets [`KdOptions::temperature`].
    pub fn temperature(mut self, t: f32) -> Self {
        self.temperature = t;
        self
    }
    /// Sets [`KdOptions::scale_by_t2`].
    pub fn scale_by_t2(mut self, on: bool) -> Self {
        self.scale_by_t2 = on;
        self
    }
    /// Sets [`KdOptions::topk_norm`].
    pub fn topk_norm(mut self, n: TopkNorm) -> Self {
        self.topk_norm = n;
        self
    }
    /// Sets [`KdOptions::reduction`].
    pub fn reduction(mut self, r: Reduction) -> Self {
        self.reduction = r;
        self
    }
    /// Sets [`KdOptions::ignore_index`].
    pub fn ignore_index(mut self, i: i64) -> Self {
        self.ignore_index = i;
        self
    }
    /// Sets [`KdOptions::vocab_start`].
    pub fn vocab_start(mut self, start: i64) -> Self {
        self.vocab_start = start;
        self
    }
    /// Sets [`KdOptions::vocab_total`].
    pub fn vocab_total(mut self, total: i64) -> Self {
        self.vocab_total = total;
        self
    }
    pub(crate) fn to_raw(self) -> sys::fce_kd_options_t {
        let mut r = raw::init::<sys::fce_kd_options_t>();
        let o = &mut r;
        o.divergence = self.divergence.to_raw();
        o.beta = self.beta;
        o.temperature = self.temperature;
        o.scale_by_t2 = self.scale_by_t2 as i32;
        o.topk_norm = self.topk_norm.to_raw();
        o.reduction = self.reduction.to_raw();
        o.ignore_index = self.ignore_index;
        o.vocab_start = self.vocab_start;
        o.vocab_total = self.vocab_total;
        r
    }
}

/// The teacher of [`crate::Handle::kd_loss`] and of the vocabulary-parallel calls
/// ([`crate::Handle::kd_partial`], [`crate::Handle::kd_terms_partial`], [`crate::Handle::kd_bwd`]: logits
/// are the shard's columns, a top-K teacher is the whole `[N, K]`, the same on every rank)
/// (`fce_kd_teacher_t`).
#[derive(Copy, Clone, Debug)]
pub enum Teacher<'a> {
    /// Full teacher logits `[N, V]` fp32, bf16 or fp16 (may differ from the student's dtype).
    Logits(TensorRef<'a>),
    /// A top-K teacher (the axolotl format).
    TopK {
        /// `[N, K]` i32 or i64, K >= 1; a negative id marks an unused slot, ids of a row distinct;
        /// an id >= V ([`KdOptions::vocab_total`] over shards: global ids) makes that row's loss and
        /// gradient NaN; a row without a used slot is masked (loss 0, not counted by the mean, gradient 0).
        ids: TensorRef<'a>,
        /// `[N, K]` fp32 teacher log-probabilities at temperature 1.
        logprobs: TensorRef<'a>,
    },
}

/// Outputs of [`crate::Handle::kd_loss`] (`fce_kd_outputs_t`).
#[derive(Debug)]
pub struct KdOutputs<'a> {
    /// Required: fp32 `[N]` ([`Reduction::None`], 0 for masked rows) or a scalar. Nats.
    pub loss: TensorMut<'a>,
    /// Optional `[N, V]` in the student's dtype: d(loss)/d(student logits) × grad_loss.
    pub dstudent: Option<TensorMut<'a>>,
    /// Upstream gradient as in [`CeOutputs::grad_loss`]; default 1.
    pub grad_loss: Option<TensorRef<'a>>,
}

impl<'a> KdOutputs<'a> {
    /// Outputs with only the loss (the rest as `fce_kd_outputs_init` leaves them: none).
    pub fn new(loss: TensorMut<'a>) -> Self {
        KdOutputs { loss, dstudent: None, grad_loss: None }
    }
    /// Requests [`KdOutputs::dstudent`].
    pub fn dstudent(mut self, t: TensorMut<'a>) -> Self {
        self.dstudent = Some(t);
        self
    }
    /// Sets [`KdOutputs::grad_loss`].
    pub fn grad_loss(mut self, t: TensorRef<'a>) -> Self {
        self.grad_loss = Some(t);
        self
    }
}

/// Outputs of [`crate::Handle::linear_cross_entropy_fwd`] (`fce_linear_ce_outputs_t`). Gradients are
/// written (added into with [`LinearCeOutputs::accumulate`]), formed with fp32 accumulation and rounded
/// once to their dtype.
#[derive(Debug)]
pub struct LinearCeOutputs<'a> {
    /// Required; as [`CeOutputs::loss`].
    pub loss: TensorMut<'a>,
    /// Optional fp32 logsumexp (save it for the backward): `[N]`, or its pairs `[N, 2]` as
    /// [`CeOutputs::lse`] describes.
    pub lse: Option<TensorMut<'a>>,
    /// Optional; as [`CeOutputs::z_loss`].
    pub z_loss: Option<TensorMut<'a>>,
    /// Optional `[N]` i32/i64 argmax of the logits.
    pub argmax: Option<TensorMut<'a>>,
    /// Optional `[N]` fp32 entropy in nats (save it as [`LinearCeGrads::saved_entropy`] for a backward
    /// with [`LinearCeGrads::grad_entropy`]).
    pub entropy: Option<TensorMut<'a>>,
    /// Optional `[N, H]` fp32/bf16/fp16 gradient of the hidden states.
    pub dhidden: Option<TensorMut<'a>>,
    /// Optional `[V, H]` fp32/bf16/fp16 gradient of the weight.
    pub dweight: Option<TensorMut<'a>>,
    /// Optional `[V]` fp32/bf16/fp16 gradient of the bias (only with a bias).
    pub dbias: Option<TensorMut<'a>>,
    /// Upstream gradient as in [`CeOutputs::grad_loss`]; default 1.
    pub grad_loss: Option<TensorRef<'a>>,
    /// Upstream gradient of the entropy as in [`CeOutputs::grad_entropy`] (`[N]` or scalar fp32);
    /// default None. Only with a gradient output (`dhidden`, `dweight` or `dbias`; else
    /// `INVALID_ARGUMENT`): the gradients then include grad_entropy_i × dH_i/d(logits) chained through
    /// the GEMM. Since 0.2.0 (`fce_linear_ce_outputs_t.grad_entropy`).
    pub grad_entropy: Option<TensorRef<'a>>,
    /// Add the gradients into the outputs given (`dhidden`, `dweight`, `dbias`) instead of overwriting
    /// them: gradient accumulation across micro-batches (an fp32 `dweight` as Megatron's main_grad).
    /// Each sum (current value + this call's gradient) is formed in fp32 and rounded once to the
    /// output's dtype (a bf16/fp16 `dweight` on CUDA once per token chunk, the first chunk adding into the
    /// current values); the outputs are then read as well as written. The loss and the statistics
    /// (`lse`, `z_loss`, `argmax`, `entropy`) are written as without it. Default false
    /// (`fce_linear_ce_outputs_t.flags` = `FCE_LINEAR_CE_ACCUMULATE` when true). Errors: the call's
    /// own (see [`crate::Handle::linear_cross_entropy_fwd`]); the flag adds none, and a refused call
    /// leaves the outputs as they were.
    pub accumulate: bool,
}

impl<'a> LinearCeOutputs<'a> {
    /// Outputs with only the loss (the rest as `fce_linear_ce_outputs_init` leaves them: none).
    pub fn new(loss: TensorMut<'a>) -> Self {
        LinearCeOutputs {
            loss,
            lse: None,
            z_loss: None,
            argmax: None,
            entropy: None,
            dhidden: None,
            dweight: None,
            dbias: None,
            grad_loss: None,
            grad_entropy: None,
            accumulate: false,
        }
    }
    /// Requests [`LinearCeOutputs::lse`].
    pub fn lse(mut self, t: TensorMut<'a>) -> Self {
        self.lse = Some(t);
        self
    }
    /// Requests [`LinearCeOutputs::z_loss`].
    pub fn z_loss(mut self, t: TensorMut<'a>) -> Self {
        self.z_loss = Some(t);
        self
    }
    /// Requests [`LinearCeOutputs::argmax`].
    pub fn argmax(mut self, t: TensorMut<'a>) -> Self {
        self.argmax = Some(t);
        self
    }
    /// Requests [`LinearCeOutputs::entropy`].
    pub fn entropy(mut self, t: TensorMut<'a>) -> Self {
        self.entropy = Some(t);
        self
    }
    /// Requests [`LinearCeOutputs::dhidden`].
    pub fn dhidden(mut self, t: TensorMut<'a>) -> Self {
        self.dhidden = Some(t);
        self
    }
    /// Requests [`LinearCeOutputs::dweight`].
    pub fn dweight(mut self, t: TensorMut<'a>) -> Self {
        self.dweight = Some(t);
        self
    }
    /// Requests [`LinearCeOutputs::dbias`].
    pub fn dbias(mut self, t: TensorMut<'a>) -> Self {
        self.dbias = Some(t);
        self
    }
    /// Sets [`LinearCeOutputs::grad_loss`].
    pub fn grad_loss(mut self, t: TensorRef<'a>) -> Self {
        self.grad_loss = Some(t);
        self
    }
    /// Sets [`LinearCeOutputs::grad_entropy`] (`[N]` or scalar fp32).
    pub fn grad_entropy(mut self, t: TensorRef<'a>) -> Self {
        self.grad_entropy = Some(t);
        self
    }
    /// Sets [`LinearCeOutputs::accumulate`] (add the gradients into the outputs given).
    pub fn accumulate(mut self, on: bool) -> Self {
        self.accumulate = on;
        self
    }
}

/// Gradients written (added into with [`LinearCeGrads::accumulate`]) by
/// [`crate::Handle::linear_cross_entropy_bwd`]; at least one is required.
#[derive(Debug, Default)]
pub struct LinearCeGrads<'a> {
    /// Optional `[N, H]` fp32/bf16/fp16; fp32 with a vocabulary shard (its part of the sum over ranks;
    /// else `UNSUPPORTED_DTYPE`).
    pub dhidden: Option<TensorMut<'a>>,
    /// Optional `[V, H]` fp32/bf16/fp16; with a vocabulary shard the shard's rows (padding rows 0, left as
    /// they are with [`LinearCeGrads::accumulate`]).
    pub dweight: Option<TensorMut<'a>>,
    /// Optional `[V]` fp32/bf16/fp16; only with a bias. With a vocabulary shard the shard's part (padding 0,
    /// left as it is with [`LinearCeGrads::accumulate`]).
    pub dbias: Option<TensorMut<'a>>,
    /// Upstream gradient as in [`CeOutputs::grad_loss`]; default 1.
    pub grad_loss: Option<TensorRef<'a>>,
    /// Upstream gradient of the entropy as in [`LinearCeOutputs::grad_entropy`] (`[N]` or scalar fp32);
    /// default None. Needs [`LinearCeGrads::saved_entropy`] (else `INVALID_ARGUMENT`).
    pub grad_entropy: Option<TensorRef<'a>>,
    /// `[N]` fp32, the forward's entropy output ([`LinearCeOutputs::entropy`], same options); read only
    /// with `grad_entropy` (`fce_linear_ce_outputs_t.saved_entropy`). Since 0.2.0.
    pub saved_entropy: Option<TensorRef<'a>>,
    /// Add the gradients into the outputs given (`dhidden`, `dweight`, `dbias`) instead of overwriting
    /// them, as [`LinearCeOutputs::accumulate`]: each sum formed in fp32 and rounded once to the
    /// output's dtype; the outputs are then read as well as written. With a vocabulary shard the padding
    /// rows of `dweight` and `dbias` (at or past vocab_total) are left as they are instead of written 0,
    /// and this shard's fp32 part of dhidden is added into `dhidden`. Default false
    /// (`fce_linear_ce_outputs_t.flags` = `FCE_LINEAR_CE_ACCUMULATE` when true). Errors: the call's
    /// own (see [`crate::Handle::linear_cross_entropy_bwd`]); the flag adds none, and a refused call
    /// leaves the outputs as they were.
    pub accumulate: bool,
}

impl<'a> LinearCeGrads<'a> {
    /// No gradient requested yet.
    pub fn new() -> Self {
        Self::default()
    }
    /// Requests [`LinearCeGrads::dhidden`].
    pub fn dhidden(mut self, t: TensorMut<'a>) -> Self {
        self.dhidden = Some(t);
        self
    }
    /// Requests [`LinearCeGrads::dweight`].
    pub fn dweight(mut self, t: TensorMut<'a>) -> Self {
        self.dweight = Some(t);
        self
    }
    /// Requests [`LinearCeGrads::dbias`].
    pub fn dbias(mut self, t: TensorMut<'a>) -> Self {
        self.dbias = Some(t);
        self
    }
    /// Sets [`LinearCeGrads::grad_loss`].
    pub fn grad_loss(mut self, t: TensorRef<'a>) -> Self {
        self.grad_loss = Some(t);
        self
    }
    /// Sets [`LinearCeGrads::grad_entropy`] (`[N]` or scalar fp32); needs
    /// [`LinearCeGrads::saved_entropy`].
    pub fn grad_entropy(mut self, t: TensorRef<'a>) -> Self {
        self.grad_entropy = Some(t);
        self
    }
    /// Sets [`LinearCeGrads::saved_entropy`] (`[N]` fp32, the forward's entropy).
    pub fn saved_entropy(mut self, t: TensorRef<'a>) -> Self {
        self.saved_entropy = Some(t);
        self
    }
    /// Sets [`LinearCeGrads::accumulate`] (add the gradients into the outputs given).
    pub fn accumulate(mut self, on: bool) -> Self {
        self.accumulate = on;
        self
    }
}
