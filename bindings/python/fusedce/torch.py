"""PyTorch autograd functions and drop-in losses over libfusedce (CPU and CUDA tensors).

    from fusedce.torch import cross_entropy          # instead of torch.nn.functional.cross_entropy
    loss = cross_entropy(logits, targets, ignore_index=-100, label_smoothing=0.1)

Importing this module imports torch; `import fusedce` alone does not.

Differences from PyTorch, all deliberate (see the header):
  - the loss is float32 whatever the logits' dtype (PyTorch returns the logits' dtype);
  - reduction="mean" over rows that are all ignored gives 0, not NaN;
  - a target outside [0, C) that is not ignore_index gives a NaN loss instead of an error (no host sync);
  - probability ("soft") targets and float64 logits are handed to torch.nn.functional.cross_entropy.
Gradients flow to the logits (or hidden/weight/bias) only; targets, class weights and a KD teacher are
treated as constants. Work is enqueued on the current CUDA stream and never synchronizes the host.
"""
import torch
import torch.nn.functional as F

from . import ops

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _grad_arg(grad):
    """The upstream gradient as the library wants it: fp32; a stride-0 [N] (from .sum()/.mean() of a
    reduction="none" loss) is passed as a [1] scalar that the library broadcasts."""
    if grad.dim() == 1 and grad.numel() > 1 and grad.stride(0) == 0:
        grad = grad[:1]
    return grad.to(torch.float32).contiguous()


def _legacy_reduction(size_average, reduce, reduction):
    if size_average is not None or reduce is not None:
        return torch.nn._reduction.legacy_get_string(size_average, reduce)
    return reduction


def _class_weights(weight):
    return None if weight is None else weight.detach().to(torch.float32).contiguous()


def _targets(target):
    return target if target.dtype in (torch.int32, torch.int64) else target.to(torch.int64)


# ---- cross-entropy --------------------------------------------------------------------------------

# The library's defaults (its fce_ce_options_init) for its options that PyTorch lacks; PyTorch's own
# arguments keep PyTorch's defaults (ignore_index=-100, reduction="mean", label_smoothing=0.0).
_CE = ops._CE


class CrossEntropyFunction(torch.autograd.Function):
    """Cross-entropy of logits [N, V] against targets [N]; forward keeps only the [N] logsumexp, backward
    calls fce_cross_entropy_bwd with the upstream gradient (read on the device)."""

    @staticmethod
    def forward(ctx, logits, targets, class_weights, reduction, ignore_index, label_smoothing, z_loss_scale,
                softcap, logit_scale):
        opts = dict(reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing,
                    z_loss_scale=z_loss_scale, softcap=softcap, logit_scale=logit_scale)
        out = ops.cross_entropy_fwd(logits, targets, class_weights=class_weights, lse=True, **opts)
        ctx.opts = opts
        ctx.has_weights = class_weights is not None
        saved = [logits, targets, out.lse] + ([class_weights] if class_weights is not None else [])
        ctx.save_for_backward(*saved)
        return out.loss

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        logits, targets, lse = saved[:3]
        cw = saved[3] if ctx.has_weights else None
        dlogits = None
        if ctx.needs_input_grad[0]:
            dlogits = ops.cross_entropy_bwd(logits, targets, lse, grad_loss=_grad_arg(grad), class_weights=cw,
                                            **ctx.opts)
        return (dlogits,) + (None,) * 8


def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                  reduction="mean", label_smoothing=0.0, *, z_loss_scale=_CE["z_loss_scale"],
                  softcap=_CE["softcap"], logit_scale=_CE["logit_scale"]):
    """Drop-in for torch.nn.functional.cross_entropy (same arguments, plus the library's z_loss_scale,
    softcap and logit_scale). input: (C), (N, C) or (N, C, d1, ...); target: class indices."""
    reduction = _legacy_reduction(size_average, reduce, reduction)
    if target.is_floating_point() or input.dtype not in _FLOATS:
        if (z_loss_scale, softcap, logit_scale) != (_CE["z_loss_scale"], _CE["softcap"], _CE["logit_scale"]):
            raise NotImplementedError("fusedce: z_loss_scale/softcap/logit_scale need integer targets and "
                                      "fp32/bf16/fp16 logits")
        return F.cross_entropy(input, target, weight, ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)
    if input.dim() == 1:
        rows, tgt, shape = input.unsqueeze(0), target.reshape(1), ()
    elif input.dim() == 2:
        rows, tgt, shape = input, target, tuple(target.shape)
    else:
        c = input.shape[1]
        rows, tgt, shape = input.movedim(1, -1).reshape(-1, c), target.reshape(-1), tuple(target.shape)
    loss = CrossEntropyFunction.apply(rows, _targets(tgt), _class_weights(weight), reduction, int(ignore_index),
                                      float(label_smoothing), float(z_loss_scale), float(softcap), float(logit_scale))
    if reduction == "none":
        loss = loss.reshape(shape)
    return loss


class CrossEntropyLoss(torch.nn.Module):
    """Drop-in for torch.nn.CrossEntropyLoss, with the library's extra options."""

    def __init__(self, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean",
                 label_smoothing=0.0, *, z_loss_scale=_CE["z_loss_scale"], softcap=_CE["softcap"],
                 logit_scale=_CE["logit_scale"]):
        super().__init__()
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index
        self.reduction = _legacy_reduction(size_average, reduce, reduction)
        self.label_smoothing = label_smoothing
        self.z_loss_scale, self.softcap, self.logit_scale = z_loss_scale, softcap, logit_scale

    def forward(self, input, target):
        return cross_entropy(input, target, self.weight, ignore_index=self.ignore_index, reduction=self.reduction,
                             label_smoothing=self.label_smoothing, z_loss_scale=self.z_loss_scale,
                             softcap=self.softcap, logit_scale=self.logit_scale)


# ---- linear cross-entropy -------------------------------------------------------------------------

class LinearCrossEntropyFunction(torch.autograd.Function):
    """Cross-entropy of hidden [N, H] @ weight[V, H]^T (+ bias) without materializing [N, V] logits;
    forward keeps the [N] logsumexp, backward recomputes the logits chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, class_weights, reduction, ignore_index, label_smoothing,
                z_loss_scale, softcap, logit_scale):
        opts = dict(reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing,
                    z_loss_scale=z_loss_scale, softcap=softcap, logit_scale=logit_scale)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and bias is not None
        # A reduced loss has a scalar upstream gradient, so the gradients are linear in it: compute them in
        # this pass (6*N*H*V flops in all, no recomputation) for an upstream gradient of 1, and scale them in
        # backward. Per-row losses keep the recomputing backward.
        ctx.fused = reduction != "none" and (need_h or need_w or need_b)
        out = ops.linear_cross_entropy_fwd(hidden, weight, targets, bias=bias, class_weights=class_weights,
                                           lse=True, dhidden=ctx.fused and need_h, dweight=ctx.fused and need_w,
                                           dbias=ctx.fused and need_b, **opts)
        ctx.opts = opts
        ctx.has_bias = bias is not None
        ctx.has_weights = class_weights is not None
        if ctx.fused:
            ctx.grads = (out.dhidden if need_h else None, out.dweight if need_w else None,
                         out.dbias if need_b else None)
            return out.loss
        saved = [hidden, weight, targets, out.lse]
        saved += [bias] if bias is not None else []
        saved += [class_weights] if class_weights is not None else []
        ctx.save_for_backward(*saved)
        return out.loss

    @staticmethod
    def backward(ctx, grad):
        if ctx.fused:
            dh, dw, db = ctx.grads
            ctx.grads = None
            # In place, no host sync: exact for the usual upstream gradient of 1; another scale rounds the
            # bf16/fp16 gradients a second time (as Liger's fused linear cross-entropy does).
            scale = grad.detach().to(torch.float32)
            for g in (dh, dw, db):
                if g is not None:
                    g.mul_(scale)
            return (dh, dw, db) + (None,) * 8
        saved = list(ctx.saved_tensors)
        hidden, weight, targets, lse = saved[:4]
        rest = saved[4:]
        bias = rest.pop(0) if ctx.has_bias else None
        cw = rest.pop(0) if ctx.has_weights else None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and bias is not None
        dh = dw = db = None
        if need_h or need_w or need_b:
            g = ops.linear_cross_entropy_bwd(hidden, weight, targets, lse, bias=bias, dhidden=need_h, dweight=need_w,
                                             dbias=need_b, grad_loss=_grad_arg(grad), class_weights=cw, **ctx.opts)
            dh, dw, db = g.dhidden, g.dweight, g.dbias
        return (dh, dw, db) + (None,) * 8


def linear_cross_entropy(input, weight, target, bias=None, class_weights=None, ignore_index=-100,
                         reduction="mean", label_smoothing=0.0, *, z_loss_scale=_CE["z_loss_scale"],
                         softcap=_CE["softcap"], logit_scale=_CE["logit_scale"]):
    """F.cross_entropy(F.linear(input, weight, bias), target, class_weights, ...) without the logits.
    input: (..., H); weight: (V, H); target: (...)."""
    h = input.reshape(-1, input.shape[-1])
    tgt = target.reshape(-1)
    loss = LinearCrossEntropyFunction.apply(h, weight, bias, _targets(tgt), _class_weights(class_weights),
                                            reduction, int(ignore_index), float(label_smoothing), float(z_loss_scale),
                                            float(softcap), float(logit_scale))
    if reduction == "none":
        loss = loss.reshape(target.shape)
    return loss


class LinearCrossEntropyLoss(torch.nn.Module):
    """Fused LM head + cross-entropy; called like Liger's LigerFusedLinearCrossEntropyLoss:
    loss_fn(lm_head.weight, hidden, target, bias=None)."""

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, class_weights=None, *,
                 z_loss_scale=_CE["z_loss_scale"], softcap=_CE["softcap"], logit_scale=_CE["logit_scale"]):
        super().__init__()
        self.register_buffer("class_weights", class_weights)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.z_loss_scale, self.softcap, self.logit_scale = z_loss_scale, softcap, logit_scale

    def forward(self, weight, input, target, bias=None):
        return linear_cross_entropy(input, weight, target, bias, self.class_weights, self.ignore_index,
                                    self.reduction, self.label_smoothing, z_loss_scale=self.z_loss_scale,
                                    softcap=self.softcap, logit_scale=self.logit_scale)


# ---- knowledge distillation -----------------------------------------------------------------------

class KDLossFunction(torch.autograd.Function):
    """Distillation loss; the student's gradient is formed in the forward pass (one pass over the logits)
    and scaled by the upstream gradient in backward."""

    @staticmethod
    def forward(ctx, student, teacher_logits, topk_ids, topk_logprobs, targets, divergence, beta, temperature,
                scale_by_t2, topk_norm, reduction, ignore_index):
        want = ctx.needs_input_grad[0]
        out = ops.kd_loss(student, teacher_logits, topk_ids=topk_ids, topk_logprobs=topk_logprobs, targets=targets,
                          divergence=divergence, beta=beta, temperature=temperature, scale_by_t2=scale_by_t2,
                          topk_norm=topk_norm, reduction=reduction, ignore_index=ignore_index, dstudent=want)
        ctx.none = reduction == "none"
        if want:
            ctx.save_for_backward(out.dstudent)
        return out.loss

    @staticmethod
    def backward(ctx, grad):
        ds = None
        if ctx.needs_input_grad[0]:
            (d,) = ctx.saved_tensors
            g = grad.to(d.dtype)
            ds = d * (g.unsqueeze(1) if ctx.none else g)
        return (ds,) + (None,) * 11


def _kd_rows(x):
    return x.reshape(-1, x.shape[-1])


# The library's defaults (its fce_kd_options_init), as ops.kd_loss's keywords.
_KD = ops._KD
_KD_DIVERGENCE = ops._NAME["divergence"][_KD["divergence"]]
_KD_TOPK_NORM = ops._NAME["topk_norm"][_KD["topk_norm"]]
_KD_REDUCTION = ops._NAME["reduction"][_KD["reduction"]]


def kd_loss(student_logits, teacher_logits, target=None, *, divergence=_KD_DIVERGENCE, beta=_KD["beta"],
            temperature=_KD["temperature"], scale_by_t2=bool(_KD["scale_by_t2"]), reduction=_KD_REDUCTION,
            ignore_index=_KD["ignore_index"]):
    """Distillation divergence between softmax(student/T) and softmax(teacher/T) over the last axis;
    reduction="mean" is batchmean over rows whose target is not ignore_index. divergence: "forward_kl"
    (KL(teacher||student), as F.kl_div(log_softmax(s), log_softmax(t), log_target=True)), "reverse_kl",
    "jsd" (generalized, weight beta). temperature in [1e-4, 100] (fusedce.KD_TEMPERATURE_MIN/MAX). The
    teacher gets no gradient."""
    s = _kd_rows(student_logits)
    t = _kd_rows(teacher_logits).detach()
    tg = None if target is None else _targets(target.reshape(-1))
    loss = KDLossFunction.apply(s, t, None, None, tg, divergence, float(beta), float(temperature), bool(scale_by_t2),
                                _KD_TOPK_NORM, reduction, int(ignore_index))
    return loss.reshape(student_logits.shape[:-1]) if reduction == "none" else loss


def kd_loss_topk(student_logits, topk_ids, topk_logprobs, target=None, *, divergence=_KD_DIVERGENCE, beta=_KD["beta"],
                 temperature=_KD["temperature"], scale_by_t2=bool(_KD["scale_by_t2"]), topk_norm=_KD_TOPK_NORM,
                 reduction=_KD_REDUCTION, ignore_index=_KD["ignore_index"]):
    """Distillation from a top-K teacher: topk_ids (..., K) (negative = unused slot) and topk_logprobs
    (..., K) fp32 log-probabilities at temperature 1 (the axolotl format)."""
    s = _kd_rows(student_logits)
    ids = _targets(topk_ids.reshape(-1, topk_ids.shape[-1]))
    lps = topk_logprobs.reshape(-1, topk_logprobs.shape[-1]).detach().to(torch.float32).contiguous()
    tg = None if target is None else _targets(target.reshape(-1))
    loss = KDLossFunction.apply(s, None, ids, lps, tg, divergence, float(beta), float(temperature), bool(scale_by_t2),
                                topk_norm, reduction, int(ignore_index))
    return loss.reshape(student_logits.shape[:-1]) if reduction == "none" else loss


class KDLoss(torch.nn.Module):
    """Module form of kd_loss: loss_fn(student_logits, teacher_logits, target=None)."""

    def __init__(self, divergence=_KD_DIVERGENCE, beta=_KD["beta"], temperature=_KD["temperature"],
                 scale_by_t2=bool(_KD["scale_by_t2"]), reduction=_KD_REDUCTION, ignore_index=_KD["ignore_index"]):
        super().__init__()
        self.kw = dict(divergence=divergence, beta=beta, temperature=temperature, scale_by_t2=scale_by_t2,
                       reduction=reduction, ignore_index=ignore_index)

    def forward(self, student_logits, teacher_logits, target=None):
        return kd_loss(student_logits, teacher_logits, target, **self.kw)


__all__ = ["CrossEntropyFunction", "CrossEntropyLoss", "KDLoss", "KDLossFunction", "LinearCrossEntropyFunction",
           "LinearCrossEntropyLoss", "cross_entropy", "kd_loss", "kd_loss_topk", "linear_cross_entropy"]
