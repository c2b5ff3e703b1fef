"""The library's ops as PyTorch custom ops (namespace `fusedce`), each with a fake (meta) implementation
and, where it has a gradient, registered autograd, so that torch.compile(fullgraph=True) traces through
them, CUDA graphs capture them, and `torch.ops.fusedce.*` is differentiable on its own.

In eager mode the public functions of `fusedce.torch` call the same implementations directly (`call`),
with autograd through `torch.autograd.Function`s made from the same setup/backward pairs (`Function`):
the dispatcher's per-call cost (~5-10 us for a Python custom op) stays out of the eager path.

Every implementation enqueues on torch's current CUDA stream and never synchronizes the host. Enum
arguments are the header's integer values (fce_reduction_t, fce_kd_divergence_t, fce_kd_topk_norm_t).

An lse an op saves for its backward is the library's pairs [N, 2] fp32 (m, l) = (max z, log sum exp(z - m)),
lse = m + l (fce_ce_outputs_t.lse): the backward forms every probability as exp((z_j - m) - l), exact at any
common offset of the logits (fp32 logits + 1e5, fp16 rows of 65504) and the fused gradient's bits, where an
[N] lse would carry its fp32 rounding (6e-3 relative at 1e5) into every p_j. The ops that return an lse
therefore return the pairs (cross_entropy, linear_cross_entropy, logprobs_entropy, linear_logprobs_entropy:
output 1, or 2 for the log-probability ops); `fusedce.ops.lse_value` (m + l in fp32) gives the [N] values.
The backward ops take either form.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _fast, ops

_REDUCTION_NONE = ops._REDUCTIONS["none"]
_NAMES = {v: k for k, v in ops._REDUCTIONS.items()}


def _nothing(like, dtype=None):
    return torch.empty(0, dtype=dtype if dtype is not None else torch.float32, device=like.device)


def _loss_shape(reduction, n):
    return (n,) if reduction == _REDUCTION_NONE else ()


# ---- scale_rows_ ----------------------------------------------------------------------------------

def _scale_rows_impl(x: Tensor, factor: Tensor) -> None:
    """x[i, :] *= factor[i] (or a scalar factor) in place; rows whose factor is 1 untouched (fce_scale_rows)."""
    _fast.scale_rows(x, factor)


scale_rows_ = torch.library.custom_op("fusedce::scale_rows_", _scale_rows_impl, mutates_args=("x",))


@scale_rows_.register_fake
def _(x, factor):
    return None


def _factor(grad):
    """An upstream gradient as fce_scale_rows / grad_loss want it: fp32; a stride-0 [N] (from .sum() or
    .mean() of a reduction="none" loss) as a [1] scalar the library broadcasts."""
    if grad.dim() == 1 and grad.numel() > 1 and grad.stride(0) == 0:
        grad = grad[:1]
    return grad.to(torch.float32).contiguous()


# ---- cross-entropy --------------------------------------------------------------------------------

def _hold(ctx, saved, grads):
    """Saves `saved` for the backward, and `grads` (gradients formed in the forward) for the backward to hand
    on. Eager (`_function`), the gradients stay on ctx and the backward takes them, so that autograd holds the
    only reference and AccumulateGrad adopts the buffer as a leaf's .grad instead of copying it (saved
    tensors keep a second reference); the eager Function does not return them, which keeps ctx free of
    reference cycles. Traced, everything is saved."""
    if getattr(ctx, "eager", False):
        ctx.save_for_backward(*saved)
        ctx.held = tuple(grads)
    else:
        ctx.save_for_backward(*saved, *grads)
        ctx.n_held = len(grads)


def _take(ctx):
    """(saved, grads) as `_hold` kept them; the gradients leave ctx."""
    if getattr(ctx, "eager", False):
        grads, ctx.held = ctx.held, None
        return ctx.saved_tensors, grads
    t = ctx.saved_tensors
    return t[:len(t) - ctx.n_held], t[len(t) - ctx.n_held:]


def _filled(out, like):
    """A result tuple with every None (an output not asked for) replaced by a fresh empty tensor: a custom op
    returns tensors, each its own."""
    return tuple(_nothing(like, torch.int64 if k == 3 else None) if t is None else t for k, t in enumerate(out))


def _ce_eager(logits, targets, weight, reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale,
              want_z_loss, want_argmax, want_entropy):
    # the lse as its pairs [N, 2]: what the backward reads
    return _fast.cross_entropy_fwd(logits, targets, weight, reduction, ignore_index, label_smoothing, z_loss_scale,
                                   softcap, logit_scale, _fast.PAIR, want_z_loss, want_argmax, want_entropy)


def _cross_entropy_impl(logits: Tensor, targets: Tensor, weight: Optional[Tensor], reduction: int, ignore_index: int,
                        label_smoothing: float, z_loss_scale: float, softcap: float, logit_scale: float,
                        want_z_loss: bool, want_argmax: bool,
                        want_entropy: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fce_cross_entropy_fwd: (loss, lse, z_loss, argmax, entropy): loss [N] (reduction none) or a scalar,
    lse the pairs [N, 2] fp32 (saved for the backward; m + l is the lse), z_loss like the loss, argmax [N]
    int64, entropy [N] fp32; outputs not asked for are empty."""
    return _filled(_ce_eager(logits, targets, weight, reduction, ignore_index, label_smoothing, z_loss_scale, softcap,
                             logit_scale, want_z_loss, want_argmax, want_entropy), logits)


cross_entropy = torch.library.custom_op("fusedce::cross_entropy", _cross_entropy_impl, mutates_args=())


@cross_entropy.register_fake
def _ce_fake(logits, targets, weight, reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale,
             want_z_loss, want_argmax, want_entropy):
    return _ce_fake_outputs(logits, reduction, want_z_loss, want_argmax, want_entropy, (logits.shape[0], 2))


def _ce_fake_outputs(logits, reduction, want_z_loss, want_argmax, want_entropy, lse_shape):
    n = logits.shape[0]
    f32 = dict(dtype=torch.float32, device=logits.device)
    return (logits.new_empty(_loss_shape(reduction, n), **f32), logits.new_empty(lse_shape, **f32),
            logits.new_empty(_loss_shape(reduction, n) if want_z_loss else (0,), **f32),
            logits.new_empty((n,) if want_argmax else (0,), dtype=torch.int64, device=logits.device),
            logits.new_empty((n,) if want_entropy else (0,), **f32))


def _cross_entropy_bwd_impl(logits: Tensor, targets: Tensor, lse: Tensor, grad_loss: Tensor, weight: Optional[Tensor],
                            reduction: int, ignore_index: int, label_smoothing: float, z_loss_scale: float,
                            softcap: float, logit_scale: float) -> Tensor:
    """fce_cross_entropy_bwd: d(loss)/d(logits) * grad_loss from the forward's lse ([N, 2] pairs, or [N])."""
    return _fast.cross_entropy_bwd(logits, targets, lse, grad_loss, weight, reduction, ignore_index, label_smoothing,
                                   z_loss_scale, softcap, logit_scale)


cross_entropy_bwd = torch.library.custom_op("fusedce::cross_entropy_bwd", _cross_entropy_bwd_impl, mutates_args=())


@cross_entropy_bwd.register_fake
def _(logits, targets, lse, grad_loss, weight, *opts):
    return torch.empty_like(logits)


def _ce_setup(ctx, inputs, output):
    logits, targets, weight = inputs[:3]
    ctx.opts = inputs[3:9]
    ctx.save_for_backward(logits, targets, weight, output[1])


def _ce_backward(ctx, g_loss, *unused):
    # lse, z_loss (a part of the loss, reported alone), argmax and entropy are not differentiated.
    logits, targets, weight, lse = ctx.saved_tensors
    d = None
    if ctx.needs_input_grad[0] and g_loss is not None:
        d = call("cross_entropy_bwd", logits, targets, lse, _factor(g_loss), weight, *ctx.opts)
    return (d,) + (None,) * 11


torch.library.register_autograd("fusedce::cross_entropy", _ce_backward, setup_context=_ce_setup)


def _cross_entropy_fused_impl(logits: Tensor, targets: Tensor, weight: Optional[Tensor], reduction: int,
                              ignore_index: int, label_smoothing: float, z_loss_scale: float, softcap: float,
                              logit_scale: float, want_z_loss: bool, want_argmax: bool,
                              want_entropy: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fce_cross_entropy_fwd with the gradient fused (for an upstream gradient of 1): (loss, lse, z_loss,
    argmax, entropy, dlogits), lse the library's [N] fp32 (no backward reads it). The in-place mode of
    fusedce.torch.cross_entropy in eager writes dlogits into the logits themselves instead
    (`cross_entropy_inplace`)."""
    d = torch.empty_like(logits)
    out = _fast.cross_entropy_fwd(logits, targets, weight, reduction, ignore_index, label_smoothing, z_loss_scale,
                                  softcap, logit_scale, True, want_z_loss, want_argmax, want_entropy, dlogits=d)
    return _filled(out, logits) + (d,)


cross_entropy_fused = torch.library.custom_op("fusedce::cross_entropy_fused", _cross_entropy_fused_impl,
                                              mutates_args=())


@cross_entropy_fused.register_fake
def _(logits, targets, weight, reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale,
      want_z_loss, want_argmax, want_entropy):
    fwd = _ce_fake_outputs(logits, reduction, want_z_loss, want_argmax, want_entropy, (logits.shape[0],))
    return tuple(fwd) + (torch.empty_like(logits),)


def cross_entropy_inplace(logits, targets, weight, reduction, ignore_index, label_smoothing, z_loss_scale, softcap,
                          logit_scale, want_z_loss, want_argmax, want_entropy):
    """The fused forward writing dlogits over the logits (eager only: no op, the memory is the point):
    (loss, lse, z_loss, argmax, entropy), None where not asked for."""
    return _fast.cross_entropy_fwd(logits, targets, weight, reduction, ignore_index, label_smoothing, z_loss_scale,
                                   softcap, logit_scale, True, want_z_loss, want_argmax, want_entropy, dlogits=logits)


def _inplace_setup(ctx, inputs, output):
    _hold(ctx, (), (inputs[0].detach(),))  # its memory holds dlogits now


def _fused_setup(ctx, inputs, output):
    _hold(ctx, (), (output[-1],))


def _fused_backward(ctx, g_loss, *unused):
    _, (d,) = _take(ctx)
    if not ctx.needs_input_grad[0] or g_loss is None:
        return (None,) * 12
    call("scale_rows_", d, _factor(g_loss).reshape(-1))  # nothing moves for the usual upstream gradient of 1
    return (d,) + (None,) * 11


torch.library.register_autograd("fusedce::cross_entropy_fused", _fused_backward, setup_context=_fused_setup)


# ---- logsumexp and temperature softmax ------------------------------------------------------------

def _logsumexp_impl(x: Tensor, scale: float) -> Tensor:
    """fce_logsumexp: [N] fp32, log sum_j exp(scale x_ij)."""
    return _fast.logsumexp(x, scale)


logsumexp = torch.library.custom_op("fusedce::logsumexp", _logsumexp_impl, mutates_args=())


@logsumexp.register_fake
def _(x, scale):
    return x.new_empty((x.shape[0],), dtype=torch.float32)


def _lse_setup(ctx, inputs, output):
    ctx.scale = inputs[1]
    ctx.save_for_backward(inputs[0])


def _lse_backward(ctx, g):
    # d lse_i / d x_ij = scale * softmax(scale * x_i)_j
    (x,) = ctx.saved_tensors
    if g is None:
        return None, None
    p, _ = call("temp_softmax", x, 1.0 / ctx.scale, None, True, False, 0)
    return (p * (g.to(torch.float32).unsqueeze(1) * ctx.scale)).to(x.dtype), None


torch.library.register_autograd("fusedce::logsumexp", _lse_backward, setup_context=_lse_setup)

def _sm_eager(logits, temperature, temperatures, want_probs, want_logprobs, out_dtype):
    return _fast.temp_softmax(logits, temperature, temperatures, want_probs, want_logprobs,
                              torch.float32 if out_dtype == 0 else None)


def _temp_softmax_impl(logits: Tensor, temperature: float, temperatures: Optional[Tensor], want_probs: bool,
                       want_logprobs: bool, out_dtype: int) -> Tuple[Tensor, Tensor]:
    """fce_temp_softmax: (probs, logprobs), each [N, V] in fp32 (out_dtype 0) or the logits' dtype (1), or
    empty when not asked for."""
    p, lp = _sm_eager(logits, temperature, temperatures, want_probs, want_logprobs, out_dtype)
    return (p if p is not None else _nothing(logits), lp if lp is not None else _nothing(logits))


temp_softmax = torch.library.custom_op("fusedce::temp_softmax", _temp_softmax_impl, mutates_args=())


@temp_softmax.register_fake
def _(logits, temperature, temperatures, want_probs, want_logprobs, out_dtype):
    dt = torch.float32 if out_dtype == 0 else logits.dtype
    shape = tuple(logits.shape)
    return (logits.new_empty(shape if want_probs else (0,), dtype=dt),
            logits.new_empty(shape if want_logprobs else (0,), dtype=dt))


def _sm_setup(ctx, inputs, output):
    logits, temperature, temperatures = inputs[:3]
    ctx.want = inputs[3:5]
    ctx.temperature = temperature
    ctx.in_dtype = logits.dtype
    ctx.save_for_backward(temperatures, *output)


def _sm_backward(ctx, g_p, g_lp):
    # p = softmax(x/T): dx = p (g_p - sum_k g_p,k p_k) / T; log p: dx = (g_lp - p sum_k g_lp,k) / T. T per row
    # when given; T = 0 (greedy) has no gradient (0).
    temperatures, probs, logprobs = ctx.saved_tensors
    p = probs.float() if ctx.want[0] else logprobs.float().exp()
    inv_t = (1.0 / temperatures.float()).unsqueeze(1) if temperatures is not None else 1.0 / ctx.temperature
    inv_t = torch.nan_to_num(torch.as_tensor(inv_t, device=p.device), posinf=0.0)
    dx = torch.zeros_like(p)
    if g_p is not None and ctx.want[0]:
        g = g_p.float()
        dx = dx + p * (g - (g * p).sum(1, keepdim=True))
    if g_lp is not None and ctx.want[1]:
        g = g_lp.float()
        dx = dx + g - p * g.sum(1, keepdim=True)
    return (dx * inv_t).to(ctx.in_dtype), None, None, None, None, None


torch.library.register_autograd("fusedce::temp_softmax", _sm_backward, setup_context=_sm_setup)


# ---- knowledge distillation -----------------------------------------------------------------------

def _kd_eager(student, teacher_logits, topk_ids, topk_logprobs, targets, divergence, beta, temperature, scale_by_t2,
              topk_norm, reduction, ignore_index, want_grad):
    return _fast.kd_loss(student, teacher_logits, topk_ids, topk_logprobs, targets, divergence, beta, temperature,
                         scale_by_t2, topk_norm, reduction, ignore_index, want_grad)


def _kd_loss_impl(student: Tensor, teacher_logits: Optional[Tensor], topk_ids: Optional[Tensor],
                  topk_logprobs: Optional[Tensor], targets: Optional[Tensor], divergence: int, beta: float,
                  temperature: float, scale_by_t2: bool, topk_norm: int, reduction: int, ignore_index: int,
                  want_grad: bool) -> Tuple[Tensor, Tensor]:
    """fce_kd_loss: (loss, dstudent), dstudent formed in the same pass for an upstream gradient of 1 when
    want_grad (empty otherwise)."""
    loss, ds = _kd_eager(student, teacher_logits, topk_ids, topk_logprobs, targets, divergence, beta, temperature,
                         scale_by_t2, topk_norm, reduction, ignore_index, want_grad)
    return loss, ds if ds is not None else _nothing(student, student.dtype)


kd_loss = torch.library.custom_op("fusedce::kd_loss", _kd_loss_impl, mutates_args=())


@kd_loss.register_fake
def _(student, teacher_logits, topk_ids, topk_logprobs, targets, divergence, beta, temperature, scale_by_t2,
      topk_norm, reduction, ignore_index, want_grad):
    n = student.shape[0]
    return (student.new_empty(_loss_shape(reduction, n), dtype=torch.float32),
            torch.empty_like(student) if want_grad else student.new_empty((0,)))


def _kd_setup(ctx, inputs, output):
    _hold(ctx, (), (output[1],))


def _kd_backward(ctx, g_loss, *unused):
    _, (d,) = _take(ctx)
    if not ctx.needs_input_grad[0] or g_loss is None or d is None or d.numel() == 0:
        return (None,) * 13
    call("scale_rows_", d, _factor(g_loss).reshape(-1))
    return (d,) + (None,) * 12


torch.library.register_autograd("fusedce::kd_loss", _kd_backward, setup_context=_kd_setup)


# ---- linear cross-entropy -------------------------------------------------------------------------

def _linear_cross_entropy_impl(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor,
                               class_weights: Optional[Tensor], reduction: int, ignore_index: int,
                               label_smoothing: float, z_loss_scale: float, softcap: float, logit_scale: float,
                               want_z_loss: bool, want_argmax: bool, want_entropy: bool, fused_dh: bool,
                               fused_dw: bool,
                               fused_db: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fce_linear_cross_entropy_fwd: (loss, lse, z_loss, argmax, entropy, dhidden, dweight, dbias); the
    fused_* gradients (for an upstream gradient of 1) are computed in the same pass, the others are empty.
    lse: the pairs [N, 2] fp32, which the backward reads, or with a gradient fused (no backward reading it)
    the library's [N] lse."""
    return _lce_forward(hidden, weight, bias, targets, class_weights, reduction, ignore_index, label_smoothing,
                        z_loss_scale, softcap, logit_scale, want_z_loss, want_argmax, want_entropy, fused_dh,
                        fused_dw, fused_db, lse=True if fused_dh or fused_dw or fused_db else ops.LSE_PAIR)


def _lce_forward(hidden, weight, bias, targets, class_weights, reduction, ignore_index, label_smoothing, z_loss_scale,
                 softcap, logit_scale, want_z_loss, want_argmax, want_entropy, fused_dh, fused_dw, fused_db,
                 lse=ops.LSE_PAIR):
    """The linear cross-entropy op's forward, lse as ops.linear_cross_entropy_fwd takes it (a call without a
    backward: True, the library's [N] lse, or False)."""
    o = ops.linear_cross_entropy_fwd(hidden, weight, targets, bias=bias, reduction=reduction,
                                     ignore_index=ignore_index, label_smoothing=label_smoothing,
                                     z_loss_scale=z_loss_scale, softcap=softcap, logit_scale=logit_scale,
                                     class_weights=class_weights, lse=lse, z_loss=want_z_loss, argmax=want_argmax,
                                     entropy=want_entropy, dhidden=fused_dh, dweight=fused_dw, dbias=fused_db)
    return (o.loss, o.lse, o.z_loss if want_z_loss else _nothing(hidden),
            o.argmax if want_argmax else _nothing(hidden, torch.int64), o.entropy if want_entropy else _nothing(hidden),
            o.dhidden if fused_dh else _nothing(hidden, hidden.dtype),
            o.dweight if fused_dw else _nothing(hidden, weight.dtype),
            o.dbias if fused_db else _nothing(hidden, weight.dtype))


linear_cross_entropy = torch.library.custom_op("fusedce::linear_cross_entropy", _linear_cross_entropy_impl,
                                               mutates_args=())


@linear_cross_entropy.register_fake
def _(hidden, weight, bias, targets, class_weights, reduction, ignore_index, label_smoothing, z_loss_scale, softcap,
      logit_scale, want_z_loss, want_argmax, want_entropy, fused_dh, fused_dw, fused_db):
    n = hidden.shape[0]
    f32 = dict(dtype=torch.float32)
    lse_shape = (n,) if fused_dh or fused_dw or fused_db else (n, 2)
    return (hidden.new_empty(_loss_shape(reduction, n), **f32), hidden.new_empty(lse_shape, **f32),
            hidden.new_empty(_loss_shape(reduction, n) if want_z_loss else (0,), **f32),
            hidden.new_empty((n,) if want_argmax else (0,), dtype=torch.int64),
            hidden.new_empty((n,) if want_entropy else (0,), **f32),
            torch.empty_like(hidden) if fused_dh else hidden.new_empty((0,)),
            torch.empty_like(weight) if fused_dw else weight.new_empty((0,)),
            torch.empty_like(bias) if fused_db else weight.new_empty((0,)))


def _linear_cross_entropy_bwd_impl(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor,
                                   lse: Tensor, grad_loss: Tensor, class_weights: Optional[Tensor], reduction: int,
                                   ignore_index: int, label_smoothing: float, z_loss_scale: float, softcap: float,
                                   logit_scale: float, want_dh: bool, want_dw: bool,
                                   want_db: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """fce_linear_cross_entropy_bwd: (dhidden, dweight, dbias) (empty where not asked for), recomputing the
    logits chunk by chunk from the forward's lse ([N, 2] pairs, or [N])."""
    g = ops.linear_cross_entropy_bwd(hidden, weight, targets, lse, bias=bias, dhidden=want_dh, dweight=want_dw,
                                     dbias=want_db, grad_loss=grad_loss, reduction=reduction,
                                     ignore_index=ignore_index, label_smoothing=label_smoothing,
                                     z_loss_scale=z_loss_scale, softcap=softcap, logit_scale=logit_scale,
                                     class_weights=class_weights)
    return (g.dhidden if want_dh else _nothing(hidden, hidden.dtype),
            g.dweight if want_dw else _nothing(hidden, weight.dtype),
            g.dbias if want_db else _nothing(hidden, weight.dtype))


linear_cross_entropy_bwd = torch.library.custom_op("fusedce::linear_cross_entropy_bwd",
                                                   _linear_cross_entropy_bwd_impl,
                                                   mutates_args=())


@linear_cross_entropy_bwd.register_fake
def _(hidden, weight, bias, targets, lse, grad_loss, class_weights, reduction, ignore_index, label_smoothing,
      z_loss_scale, softcap, logit_scale, want_dh, want_dw, want_db):
    return (torch.empty_like(hidden) if want_dh else hidden.new_empty((0,)),
            torch.empty_like(weight) if want_dw else weight.new_empty((0,)),
            torch.empty_like(bias) if want_db else weight.new_empty((0,)))


def _lce_setup(ctx, inputs, output):
    hidden, weight, bias, targets, cw = inputs[:5]
    ctx.opts = inputs[5:11]
    ctx.fused = inputs[14:17]
    _hold(ctx, (hidden, weight, bias, targets, cw, output[1]), output[5:8])


def _lce_backward(ctx, g_loss, *unused):
    (hidden, weight, bias, targets, cw, lse), (dh, dw, db) = _take(ctx)
    want = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2] and bias is not None)
    if g_loss is None:  # the loss is not used (only lse, z_loss, entropy or the argmax)
        return (None,) * 17
    if any(ctx.fused):
        # A reduced loss: its gradients were formed in the forward for an upstream gradient of 1; the
        # upstream scalar, read on the device, is applied in place where it is not 1.
        g = _factor(g_loss).reshape(-1)
        out = []
        for w, f, t in zip(want, ctx.fused, (dh, dw, db)):
            if w and f:
                call("scale_rows_", t, g)
            out.append(t if w and f else None)
        return tuple(out) + (None,) * 14
    if not any(want):
        return (None,) * 17
    dh, dw, db = call("linear_cross_entropy_bwd", hidden, weight, bias, targets, lse, _factor(g_loss), cw, *ctx.opts,
                      want[0], want[1], want[2])
    return (dh if want[0] else None, dw if want[1] else None, db if want[2] else None) + (None,) * 14


torch.library.register_autograd("fusedce::linear_cross_entropy", _lce_backward, setup_context=_lce_setup)


# ---- log-probabilities and entropy (verl's fused log-prob + entropy) ---------------------------------

def _lpe_impl(logits: Tensor, labels: Tensor, logit_scale: float, ignore_index: int) -> Tuple[Tensor, Tensor, Tensor]:
    """(logprobs, entropy, lse): logprobs and entropy [N] fp32, log softmax(s * logits) at the labels (0 where
    ignored) and the entropy of softmax(s * logits); lse its pairs [N, 2] fp32 (saved for the backward):
    fce_cross_entropy_fwd, reduction none, negated."""
    loss, lse, _, _, ent = _fast.cross_entropy_fwd(logits, labels, None, _REDUCTION_NONE, ignore_index, 0.0, 0.0, 0.0,
                                                   logit_scale, _fast.PAIR, False, False, True)
    return loss.neg_(), ent, lse


logprobs_entropy = torch.library.custom_op("fusedce::logprobs_entropy", _lpe_impl, mutates_args=())


@logprobs_entropy.register_fake
def _(logits, labels, logit_scale, ignore_index):
    n = logits.shape[0]
    return tuple(logits.new_empty(shape, dtype=torch.float32) for shape in ((n,), (n,), (n, 2)))


def _lpe_grads(g_lp, g_ent, like):
    """fce grad_loss (-dlogprobs; 0 when the log-probabilities are unused) and grad_entropy (None when the
    entropy is unused)."""
    gl = _factor(g_lp).neg() if g_lp is not None else torch.zeros((), dtype=torch.float32, device=like.device)
    return gl, None if g_ent is None else _factor(g_ent)


def _lpe_bwd_impl(logits: Tensor, labels: Tensor, lse: Tensor, entropy: Tensor, grad_logprobs: Optional[Tensor],
                  grad_entropy: Optional[Tensor], logit_scale: float, ignore_index: int) -> Tensor:
    """dlogits = dlogprobs * dlogprobs/dlogits + dentropy * dH/dlogits (fce_cross_entropy_bwd_ex), from the
    forward's lse ([N, 2] pairs, or [N]) and entropy [N]."""
    gl, ge = _lpe_grads(grad_logprobs, grad_entropy, logits)
    return _fast.cross_entropy_bwd_ex(logits, labels, lse, entropy if ge is not None else None, gl, ge, None,
                                      _REDUCTION_NONE, ignore_index, 0.0, 0.0, 0.0, logit_scale)


logprobs_entropy_bwd = torch.library.custom_op("fusedce::logprobs_entropy_bwd", _lpe_bwd_impl, mutates_args=())


@logprobs_entropy_bwd.register_fake
def _(logits, labels, lse, entropy, grad_logprobs, grad_entropy, logit_scale, ignore_index):
    return torch.empty_like(logits)


def _lpe_setup(ctx, inputs, output):
    logits, labels, logit_scale, ignore_index = inputs
    ctx.opts = (logit_scale, ignore_index)
    ctx.save_for_backward(logits, labels, output[2], output[1])


def _lpe_backward(ctx, g_lp, g_ent, g_lse):
    logits, labels, lse, ent = ctx.saved_tensors
    if not ctx.needs_input_grad[0] or (g_lp is None and g_ent is None):
        return None, None, None, None
    return call("logprobs_entropy_bwd", logits, labels, lse, ent, g_lp, g_ent, *ctx.opts), None, None, None


torch.library.register_autograd("fusedce::logprobs_entropy", _lpe_backward, setup_context=_lpe_setup)


def _llpe_impl(hidden: Tensor, weight: Tensor, labels: Tensor, logit_scale: float,
               ignore_index: int) -> Tuple[Tensor, Tensor, Tensor]:
    """(logprobs, entropy, lse) of logits = hidden @ weight^T without materializing them
    (fce_linear_cross_entropy_fwd, reduction none): as logprobs_entropy, lse the pairs [N, 2]."""
    o = ops.linear_cross_entropy_fwd(hidden, weight, labels, reduction=_REDUCTION_NONE, ignore_index=ignore_index,
                                     logit_scale=logit_scale, lse=ops.LSE_PAIR, entropy=True)
    return o.loss.neg_(), o.entropy, o.lse


linear_logprobs_entropy = torch.library.custom_op("fusedce::linear_logprobs_entropy", _llpe_impl, mutates_args=())


@linear_logprobs_entropy.register_fake
def _(hidden, weight, labels, logit_scale, ignore_index):
    n = hidden.shape[0]
    return tuple(hidden.new_empty(shape, dtype=torch.float32) for shape in ((n,), (n,), (n, 2)))


def _llpe_bwd_impl(hidden: Tensor, weight: Tensor, labels: Tensor, lse: Tensor, entropy: Tensor,
                   grad_logprobs: Optional[Tensor], grad_entropy: Optional[Tensor], logit_scale: float,
                   ignore_index: int, want_dh: bool, want_dw: bool) -> Tuple[Tensor, Tensor]:
    """(dhidden, dweight) (empty where not asked for) from both upstream gradients, recomputing the logits
    chunk by chunk (fce_linear_cross_entropy_bwd with grad_entropy and the saved lse, [N, 2] pairs or [N],
    and entropy)."""
    gl, ge = _lpe_grads(grad_logprobs, grad_entropy, hidden)
    g = ops.linear_cross_entropy_bwd(hidden, weight, labels, lse, dhidden=want_dh, dweight=want_dw, dbias=False,
                                     grad_loss=gl, grad_entropy=ge, entropy=entropy if ge is not None else None,
                                     reduction=_REDUCTION_NONE, ignore_index=ignore_index, logit_scale=logit_scale)
    return (g.dhidden if want_dh else _nothing(hidden, hidden.dtype),
            g.dweight if want_dw else _nothing(hidden, weight.dtype))


linear_logprobs_entropy_bwd = torch.library.custom_op("fusedce::linear_logprobs_entropy_bwd", _llpe_bwd_impl,
                                                      mutates_args=())


@linear_logprobs_entropy_bwd.register_fake
def _(hidden, weight, labels, lse, entropy, grad_logprobs, grad_entropy, logit_scale, ignore_index, want_dh, want_dw):
    return (torch.empty_like(hidden) if want_dh else hidden.new_empty((0,)),
            torch.empty_like(weight) if want_dw else weight.new_empty((0,)))


def _llpe_setup(ctx, inputs, output):
    hidden, weight, labels, logit_scale, ignore_index = inputs
    ctx.opts = (logit_scale, ignore_index)
    ctx.save_for_backward(hidden, weight, labels, output[2], output[1])


def _llpe_backward(ctx, g_lp, g_ent, g_lse):
    hidden, weight, labels, lse, ent = ctx.saved_tensors
    want = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not any(want) or (g_lp is None and g_ent is None):
        return (None,) * 5
    dh, dw = call("linear_logprobs_entropy_bwd", hidden, weight, labels, lse, ent, g_lp, g_ent, *ctx.opts, *want)
    return (dh if want[0] else None, dw if want[1] else None, None, None, None)


torch.library.register_autograd("fusedce::linear_logprobs_entropy", _llpe_backward, setup_context=_llpe_setup)


# ---- eager calls and autograd functions -----------------------------------------------------------

# The implementations eager calls run: the ops' own, except that outputs not asked for are None.
_IMPL = {
    "scale_rows_": _scale_rows_impl,
    "cross_entropy": _ce_eager,
    "cross_entropy_bwd": _cross_entropy_bwd_impl,
    "cross_entropy_fused": _cross_entropy_fused_impl,
    "logsumexp": _logsumexp_impl,
    "temp_softmax": _sm_eager,
    "kd_loss": _kd_eager,
    "linear_cross_entropy": _linear_cross_entropy_impl,
    "linear_cross_entropy_bwd": _linear_cross_entropy_bwd_impl,
    "logprobs_entropy": _lpe_impl,
    "logprobs_entropy_bwd": _lpe_bwd_impl,
    "linear_logprobs_entropy": _llpe_impl,
    "linear_logprobs_entropy_bwd": _llpe_bwd_impl,
}


def _traced(t):
    """A tensor being traced (AOTAutograd's fake or functional tensors, or another tensor subclass), not
    plain data: the dispatcher handles those."""
    return type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter)


def call(name, *args):
    """torch.ops.fusedce.<name>(*args) when traced (torch.compile, including the backward graphs AOTAutograd
    traces with fake tensors outside Dynamo), the implementation itself in eager mode (no dispatcher on
    the path)."""
    if torch.compiler.is_compiling() or _traced(args[0]):
        return getattr(torch.ops.fusedce, name)(*args)
    return _IMPL[name](*args)


def _function(name, impl, setup, backward, held=()):
    """An autograd.Function running `impl` eagerly with the op's registered setup/backward pair; the outputs
    at `held` (gradients formed in the forward, kept by `_hold`) come back as None. Its `run(*args)` is
    `apply` without the Python layer of Function.apply (argument binding for setup_context, functorch's
    dead-wrapper unwrapping: neither applies here unless a functorch transform is active)."""

    def forward(ctx, *args):
        ctx.eager = True
        ctx.set_materialize_grads(False)  # no zeros for outputs the loss does not use (each backward copes)
        out = impl(*args)
        setup(ctx, args, out)
        return tuple(None if k in held else o for k, o in enumerate(out))

    cls = type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                   "backward": staticmethod(backward)})
    raw = super(torch.autograd.Function, cls).apply
    transforms = torch._C._are_functorch_transforms_active
    cls.run = staticmethod(lambda *args: cls.apply(*args) if transforms() else raw(*args))
    return cls


CrossEntropyFunction = _function("CrossEntropyFunction", _IMPL["cross_entropy"], _ce_setup, _ce_backward)
CrossEntropyInplaceFunction = _function("CrossEntropyInplaceFunction", cross_entropy_inplace, _inplace_setup,
                                        _fused_backward)  # the gradient is the logits' own memory
LogsumexpFunction = _function("LogsumexpFunction", lambda *a: (_IMPL["logsumexp"](*a),), _lse_setup,
                              lambda ctx, g: _lse_backward(ctx, g))
TempSoftmaxFunction = _function("TempSoftmaxFunction", _IMPL["temp_softmax"], _sm_setup, _sm_backward)
KDLossFunction = _function("KDLossFunction", _IMPL["kd_loss"], _kd_setup, _kd_backward, held=(1,))
LinearCrossEntropyFunction = _function("LinearCrossEntropyFunction", _IMPL["linear_cross_entropy"], _lce_setup,
                                       _lce_backward, held=(5, 6, 7))
LogprobsEntropyFunction = _function("LogprobsEntropyFunction", _IMPL["logprobs_entropy"], _lpe_setup,
                                    _lpe_backward)
LinearLogprobsEntropyFunction = _function("LinearLogprobsEntropyFunction", _IMPL["linear_logprobs_entropy"],
                                          _llpe_setup, _llpe_backward)

__all__ = ["call", "CrossEntropyFunction", "CrossEntropyInplaceFunction", "KDLossFunction",
           "LinearCrossEntropyFunction", "LinearLogprobsEntropyFunction", "LogprobsEntropyFunction", "LogsumexpFunction",
           "TempSoftmaxFunction"]
