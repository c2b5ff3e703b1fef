"""Drop-in PyTorch losses over libfusedce (CPU and CUDA tensors), differentiable, torch.compile-able.

    from fusedce.torch import cross_entropy          # instead of torch.nn.functional.cross_entropy
    loss = cross_entropy(logits, targets, ignore_index=-100, label_smoothing=0.1)

Arguments are PyTorch's (`weight`, `ignore_index`, `reduction`, `label_smoothing`), Liger-Kernel's
(`lse_square_scale`, `softcap=None`, `return_z_loss`, `return_token_accuracy`, `return_predicted_tokens`)
and Cut Cross-Entropy's (`linear_cross_entropy(e, c, targets, shift=..., ignore_index=..., softcap=...)`)
where the library computes the same thing. Extra results come back as a NamedTuple when asked for.

Every function is a `torch.library` custom op (namespace `fusedce`, see `fusedce._torch_ops`) with a fake
implementation and registered autograd: torch.compile(fullgraph=True) traces them and CUDA graphs capture
them. In eager mode, cross_entropy, logsumexp and the softmax run through libfusedce_torch.so when it is
loaded (`fusedce._eager`: C++ against libtorch, cross-entropy's autograd node in C++), the rest (and all of
them without it) through the same implementations as the ops without the dispatcher, with
`torch.autograd.Function`s when a gradient is needed.

Gradients, by op:
  - cross_entropy: the backward reads the logits again (fce_cross_entropy_bwd from the lse's pairs (m, l)
    kept by the forward: exact at any offset of the logits; upstream gradient read on the device); with
    inplace_backward=True the gradient is written over the logits in the forward (Liger's and quack's
    in-place backward: no [N, V] buffer; the logits are gone after the call) and the backward only applies
    the upstream gradient where it is not 1 (fce_scale_rows: no pass at all for the usual 1).
  - kd_loss: dstudent is formed in the forward pass; the backward applies the upstream gradient likewise.
  - linear_cross_entropy: a reduced loss forms dhidden/dweight/dbias in the forward (6NHV flops in all, no
    recomputation) and the backward applies the upstream scalar on the device; per-row losses recompute in
    the backward. With gradients disabled, or no input requiring one, only the forward (2NHV flops) runs.
  - logprobs_entropy / linear_logprobs_entropy: per-token log-probabilities and entropies, both
    differentiable (the backward reads the logits, or recomputes them, once with both upstream gradients).
Targets, class weights and a KD teacher are constants. cross_entropy's lse, z_loss, entropy and argmax are
reported, not differentiated (z_loss is a part of the loss, returned for logging); a differentiable entropy
comes from logprobs_entropy.

Differences from PyTorch, all deliberate (see the header): the loss is float32 whatever the logits' dtype;
reduction="mean" over rows that are all ignored gives 0, not NaN; a target outside [0, C) that is not
ignore_index gives a NaN loss instead of an error (no host sync); probability ("soft") targets and float64
logits are handed to torch.nn.functional.cross_entropy. Work is enqueued on the current CUDA stream and
never synchronizes the host.
"""
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F

from . import _eager, _fast
from . import _torch_ops as _ops
from . import ops as _arrays
from ._torch_ops import (CrossEntropyFunction, CrossEntropyInplaceFunction, KDLossFunction,
                         LinearCrossEntropyFunction, LogsumexpFunction, TempSoftmaxFunction)

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INDEX = (torch.int64, torch.int32)
_CE = _arrays._CE
_KD = _arrays._KD
_REDUCTIONS = _arrays._REDUCTIONS
_DIVERGENCES = _arrays._DIVERGENCES
_TOPK_NORMS = _arrays._TOPK_NORMS
_REDUCTION_NONE = _REDUCTIONS["none"]


class CrossEntropyOutput(NamedTuple):
    """What cross_entropy and linear_cross_entropy return when an extra result is asked for; the fields
    not asked for are None. loss and z_loss are shaped like the loss; lse, entropy and predicted_tokens are
    per token (shaped like the targets); token_accuracy is the float32 fraction of non-ignored tokens whose
    argmax is the target.

    lse (float32): where the call keeps an lse for a backward (a gradient formed after the forward; and
    under torch.compile every call whose gradient is not fused into the forward), that lse is the library's
    pairs [N, 2] (m, l) = (max z, log sum exp(z - m)), whose gradient is exact at any offset of the logits,
    and lse is m + l added in fp32 (fusedce.lse_value): cross_entropy's [N] lse on CUDA bit for bit; where
    the library rounds m + log s once in float64 (the CPU backend, linear_cross_entropy) within 1 ulp of it.
    Elsewhere (no gradient; inplace_backward; a reduced linear_cross_entropy's fused gradients) it is the
    library's [N] lse itself."""
    loss: torch.Tensor
    z_loss: Optional[torch.Tensor] = None
    lse: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    token_accuracy: Optional[torch.Tensor] = None
    predicted_tokens: Optional[torch.Tensor] = None


class SoftmaxOutput(NamedTuple):
    probs: Optional[torch.Tensor]
    logprobs: Optional[torch.Tensor]


def _compiling():
    return torch.compiler.is_compiling()


_transforms = torch._C._are_functorch_transforms_active
_EAGER = _eager.available


def _eager_ok(x):
    """x is a plain tensor outside torch.compile and functorch transforms: libfusedce_torch's ops may run."""
    return _EAGER and type(x) is torch.Tensor and not _compiling() and not _transforms()


def _wants_grad(*tensors):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _legacy_reduction(size_average, reduce, reduction):
    if size_average is not None or reduce is not None:  # PyTorch's deprecated pair
        return torch.nn._reduction.legacy_get_string(size_average, reduce)
    return reduction


def _reduction(reduction):
    try:
        return _REDUCTIONS[reduction] if isinstance(reduction, str) else int(reduction)
    except KeyError:
        raise ValueError("reduction must be one of %s, got %r" % (sorted(_REDUCTIONS), reduction)) from None


def _class_weights(weight):
    return None if weight is None else weight.detach().to(torch.float32).contiguous()


def _targets(target):
    return target if target.dtype in (torch.int32, torch.int64) else target.to(torch.int64)


def _z_loss_scale(lse_square_scale, z_loss_scale):
    if z_loss_scale is not None:
        if lse_square_scale:
            raise ValueError("give lse_square_scale (Liger's name) or z_loss_scale, not both")
        return float(z_loss_scale)
    return float(lse_square_scale)


def _token_accuracy(argmax, target, ignore_index):
    valid = target != ignore_index
    hits = ((argmax == target) & valid).sum(dtype=torch.float32)
    return hits / valid.sum(dtype=torch.float32).clamp_min(1.0)


_lse_value = _arrays.lse_value


def _extras(out, tgt, shape, ignore_index, red, want):
    """CrossEntropyOutput from a (loss, lse, z_loss, argmax, entropy, ...) tuple, or the loss alone (want
    None: no extra result asked for). lse [N] or the pairs [N, 2] an op keeps for its backward (their m + l
    in fp32 is returned)."""
    loss, lse, zl, am, ent = out[:5]
    if red == _REDUCTION_NONE:
        loss = loss.reshape(shape)
        if want and want["z_loss"]:
            zl = zl.reshape(shape)
    if not want:
        return loss
    per_token = lambda t: t.reshape(shape)  # noqa: E731
    return CrossEntropyOutput(
        loss, zl if want["z_loss"] else None, per_token(_lse_value(lse)) if want["lse"] else None,
        per_token(ent) if want["entropy"] else None,
        _token_accuracy(am, tgt, ignore_index) if want["token_accuracy"] else None,
        per_token(am) if want["predicted_tokens"] else None)


# ---- cross-entropy --------------------------------------------------------------------------------

def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean",
                  label_smoothing=0.0, *, lse_square_scale=0.0, z_loss_scale=None, softcap=None,
                  logit_scale=_CE["logit_scale"], return_z_loss=False, return_lse=False, return_entropy=False,
                  return_token_accuracy=False, return_predicted_tokens=False, inplace_backward=False):
    """Drop-in for torch.nn.functional.cross_entropy with Liger's extras. input: (C), (N, C) or (N, C, d1, ...)
    logits (fp32/bf16/fp16); target: class indices. lse_square_scale (alias z_loss_scale): the PaLM z-loss
    weight; softcap: Gemma 2's logit soft-cap (None = off); logit_scale: multiplies the logits (1/T).
    inplace_backward: write the gradient over `input` in the forward (its values are gone afterwards).
    Returns the loss, or a CrossEntropyOutput when a return_* flag is set."""
    if (_EAGER and type(input) is torch.Tensor and input.dim() == 2 and reduction.__class__ is str and weight is None
            and size_average is None and reduce is None and z_loss_scale is None and softcap is None
            and not (return_z_loss or return_lse or return_entropy or return_token_accuracy
                     or return_predicted_tokens)
            and input.dtype in _FLOATS and target.dtype in _INDEX and not _compiling() and not _transforms()):
        # the common call: libfusedce_torch's op with nothing to reshape
        red = _REDUCTIONS.get(reduction)
        if red is not None:
            try:
                return _eager.cross_entropy_loss(input, target, red, ignore_index, label_smoothing,
                                                 lse_square_scale, logit_scale, inplace_backward)
            except RuntimeError as e:
                _eager.reraise(e)
            except TypeError:  # an argument the op's schema does not take as is (a numpy scalar): converted below
                pass
    reduction = _legacy_reduction(size_average, reduce, reduction)
    zq = _z_loss_scale(lse_square_scale, z_loss_scale)
    cap = 0.0 if softcap is None else float(softcap)
    if target.is_floating_point() or input.dtype not in _FLOATS:
        if zq or cap or logit_scale != 1 or return_z_loss or return_lse or return_entropy or return_token_accuracy \
                or return_predicted_tokens:
            raise NotImplementedError("fusedce: z-loss, softcap, logit_scale and the extra outputs need integer "
                                      "targets and fp32/bf16/fp16 logits")
        return F.cross_entropy(input, target, weight, ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)
    if input.dim() == 1:
        rows, tgt, shape = input.unsqueeze(0), target.reshape(1), ()
    elif input.dim() == 2:
        rows, tgt, shape = input, target, tuple(target.shape)
    else:
        c = input.shape[1]
        rows, tgt, shape = input.movedim(1, -1).reshape(-1, c), target.reshape(-1), tuple(target.shape)
    red = _reduction(reduction)
    want = None
    if return_z_loss or return_lse or return_entropy or return_token_accuracy or return_predicted_tokens:
        want = dict(z_loss=return_z_loss, lse=return_lse, entropy=return_entropy,
                    token_accuracy=return_token_accuracy, predicted_tokens=return_predicted_tokens)
    tgt = _targets(tgt)
    args = (rows, tgt, _class_weights(weight), red, int(ignore_index), float(label_smoothing), zq, cap,
            float(logit_scale), bool(return_z_loss), bool(return_token_accuracy or return_predicted_tokens),
            bool(return_entropy))
    if _eager_ok(rows):
        try:
            out = _eager.cross_entropy(*args[:9], bool(return_lse), *args[9:], bool(inplace_backward))
        except RuntimeError as e:
            _eager.reraise(e)
        return _extras(out, tgt, shape, int(ignore_index), red, want)
    grad = _wants_grad(rows)
    if _compiling():
        op = torch.ops.fusedce.cross_entropy_fused if grad and inplace_backward else torch.ops.fusedce.cross_entropy
        out = op(*args)
    elif grad:
        out = (CrossEntropyInplaceFunction if inplace_backward else CrossEntropyFunction).run(*args)
    else:
        out = _fast.cross_entropy_fwd(*args[:9], bool(return_lse), *args[9:])
    return _extras(out, tgt, shape, int(ignore_index), red, want)


class CrossEntropyLoss(torch.nn.Module):
    """Drop-in for torch.nn.CrossEntropyLoss (and Liger's LigerCrossEntropyLoss), with the library's extras;
    keywords as cross_entropy."""

    def __init__(self, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean",
                 label_smoothing=0.0, **extras):
        super().__init__()
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index
        self.reduction = _legacy_reduction(size_average, reduce, reduction)
        self.label_smoothing = label_smoothing
        self.extras = extras

    def forward(self, input, target):
        return cross_entropy(input, target, self.weight, ignore_index=self.ignore_index, reduction=self.reduction,
                             label_smoothing=self.label_smoothing, **self.extras)


# ---- linear cross-entropy -------------------------------------------------------------------------

def _shifted_targets(targets, shift, ignore_index):
    """Targets for the hidden state of the token `shift` places earlier (a causal LM's next-token loss): the
    last `shift` positions of each sequence get ignore_index, so the hidden states are never copied."""
    s = int(shift)
    if s <= 0:
        return targets
    pad = torch.full(targets.shape[:-1] + (s,), int(ignore_index), dtype=targets.dtype, device=targets.device)
    return torch.cat([targets[..., s:], pad], dim=-1)


def linear_cross_entropy(e, c, targets, bias=None, ignore_index=-100, softcap=None, reduction="mean", shift=False, *,
                         class_weights=None, label_smoothing=0.0, lse_square_scale=0.0, z_loss_scale=None,
                         logit_scale=_CE["logit_scale"], return_z_loss=False, return_lse=False, return_entropy=False,
                         return_token_accuracy=False, return_predicted_tokens=False):
    """F.cross_entropy(F.linear(e, c, bias), targets, ...) without the logits: e (..., H) hidden states (fp32/
    bf16/fp16), c (V, H) the LM head's weight, targets (...). The order is Cut Cross-Entropy's
    (linear_cross_entropy(e, c, targets, ...)); shift=True (or k) scores e[..., t, :] against targets[..., t+k]
    (a causal LM's labels as Hugging Face passes them). Keywords as cross_entropy. Returns the loss, or a
    CrossEntropyOutput when a return_* flag is set."""
    zq = _z_loss_scale(lse_square_scale, z_loss_scale)
    cap = 0.0 if softcap is None else float(softcap)
    if shift:
        targets = _shifted_targets(targets, shift, ignore_index)
    shape = tuple(targets.shape)
    h = e.reshape(-1, e.shape[-1])
    tgt = _targets(targets.reshape(-1))
    red = _reduction(reduction)
    grad = torch.is_grad_enabled()
    need = (grad and e.requires_grad, grad and c.requires_grad, grad and bias is not None and bias.requires_grad)
    fused = tuple(n and red != _REDUCTIONS["none"] for n in need)
    want = None
    if return_z_loss or return_lse or return_entropy or return_token_accuracy or return_predicted_tokens:
        want = dict(z_loss=return_z_loss, lse=return_lse, entropy=return_entropy,
                    token_accuracy=return_token_accuracy, predicted_tokens=return_predicted_tokens)
    args = (h, c, bias, tgt, _class_weights(class_weights), red, int(ignore_index), float(label_smoothing), zq, cap,
            float(logit_scale), bool(return_z_loss), bool(return_token_accuracy or return_predicted_tokens),
            bool(return_entropy)) + fused
    if _compiling():
        out = torch.ops.fusedce.linear_cross_entropy(*args)
    elif any(need):
        out = LinearCrossEntropyFunction.run(*args)
    elif _ops._traced(h):
        out = _ops.call("linear_cross_entropy", *args)
    else:  # no backward: the library's [N] lse
        out = _ops._lce_forward(*args, lse=bool(return_lse))
    return _extras(out, tgt, shape, int(ignore_index), red, want)


class LinearCrossEntropyLoss(torch.nn.Module):
    """Fused LM head + cross-entropy, called like Liger's LigerFusedLinearCrossEntropyLoss:
    loss_fn(lin_weight, _input, target, bias=None); keywords as linear_cross_entropy."""

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, class_weights=None, **extras):
        super().__init__()
        self.register_buffer("class_weights", class_weights)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.extras = extras

    def forward(self, weight, input, target, bias=None):
        return linear_cross_entropy(input, weight, target, bias, ignore_index=self.ignore_index,
                                    reduction=self.reduction, class_weights=self.class_weights,
                                    label_smoothing=self.label_smoothing, **self.extras)


# ---- log-probabilities and entropy ------------------------------------------------------------------

def _reduce_pair(lp, ent, reduction, shape):
    if reduction == "none":
        return lp.reshape(shape), ent.reshape(shape)
    if reduction == "sum":
        return lp.sum(), ent.sum()
    if reduction == "mean":
        return lp.mean(), ent.mean()
    raise ValueError("reduction must be 'none', 'sum' or 'mean', got %r" % (reduction,))


def _logit_scale(temperature):
    t = float(temperature)
    if not t > 0 or t == float("inf"):
        raise ValueError("temperature must be finite and > 0, got %r" % (temperature,))
    return 1.0 / t


def logprobs_entropy(logits, labels, temperature=1.0, reduction="none", *, ignore_index=-100):
    """Per-token log-probabilities of the labels and entropies of softmax(logits / temperature), both
    differentiable (verl's log-prob + entropy for PPO/GRPO losses with an entropy bonus).

    logits (..., V) fp32/bf16/fp16; labels (...) int32/int64 class indices. Returns (logprobs, entropy), fp32,
    shaped like labels for reduction="none", scalars for "sum" and "mean" (the mean over every token, as
    verl's). logprob_i = z_{i,t} - lse_i with z = logits / temperature; a label equal to ignore_index gives
    logprob 0 and no gradient through it (its entropy is still computed and differentiated); a label outside
    [0, V) otherwise gives NaN. entropy_i = -sum_j p_ij log p_ij. The backward reads the logits once more and
    forms grad_logprobs * d(logprob)/d(logits) + grad_entropy * dH/d(logits), dH/dz_j = p_j (sum_k p_k z_k -
    z_j), in fp32 rounded once to the logits' dtype (fce_cross_entropy_bwd_ex). Raises ValueError for a
    temperature that is not finite and > 0, and the library's errors (fusedce.FusedCEError) for bad shapes or
    dtypes."""
    scale = _logit_scale(temperature)
    shape = tuple(labels.shape)
    rows = logits.reshape(-1, logits.shape[-1])
    tgt = _targets(labels.reshape(-1))
    args = (rows, tgt, scale, int(ignore_index))
    if _compiling():
        lp, ent, _ = torch.ops.fusedce.logprobs_entropy(*args)
    elif _wants_grad(rows):
        lp, ent, _ = _ops.LogprobsEntropyFunction.run(*args)
    else:
        lp, ent, _ = _ops.call("logprobs_entropy", *args)
    return _reduce_pair(lp, ent, reduction, shape)


def linear_logprobs_entropy(hidden, weight, labels, temperature=1.0, reduction="none", *, ignore_index=-100,
                            keep_logits=False):
    """logprobs_entropy(hidden @ weight.T, labels, temperature, reduction) without materializing the logits
    (verl's LinearCrossEntropy): hidden (..., H) and weight (V, H) of one dtype (fp32/bf16/fp16), labels (...).
    Returns (logprobs, entropy) as logprobs_entropy; gradients through both reach hidden and weight
    (fce_linear_cross_entropy_bwd with grad_entropy: the backward recomputes the logits chunk by chunk, so
    forward + backward is 8 N H V flops). The logits are accumulated in fp32 and rounded to the inputs' dtype,
    as torch.nn.functional.linear gives them.

    keep_logits=True trades memory for time: the [N, V] logits in the inputs' dtype are formed once and kept
    for the backward (logprobs_entropy(hidden @ weight.T, ...): 6 N H V flops, N V elements twice, for the
    logits and their gradient), the same results within rounding. docs/benchmarks.md has both paths' time and
    memory."""
    if keep_logits:
        return logprobs_entropy(hidden @ weight.T, labels, temperature, reduction, ignore_index=ignore_index)
    scale = _logit_scale(temperature)
    shape = tuple(labels.shape)
    h = hidden.reshape(-1, hidden.shape[-1])
    tgt = _targets(labels.reshape(-1))
    args = (h, weight, tgt, scale, int(ignore_index))
    if _compiling():
        lp, ent, _ = torch.ops.fusedce.linear_logprobs_entropy(*args)
    elif _wants_grad(h, weight):
        lp, ent, _ = _ops.LinearLogprobsEntropyFunction.run(*args)
    else:
        lp, ent, _ = _ops.call("linear_logprobs_entropy", *args)
    return _reduce_pair(lp, ent, reduction, shape)


# ---- logsumexp and temperature softmax ------------------------------------------------------------

def _f32_vector(t):
    """A per-row fp32 [N] constant (temperatures) as the library reads it: t itself when it already is one."""
    if t.dtype is torch.float32 and t.dim() == 1 and t.is_contiguous() and not t.requires_grad:
        return t
    return t.detach().reshape(-1).to(torch.float32).contiguous()


def _plain_rows(x, dim):
    """x is a plain (not traced) 2-D tensor reduced over its last dimension, outside torch.compile."""
    return type(x) is torch.Tensor and x.dim() == 2 and (dim == -1 or dim == 1) and not _compiling()


def _rows(x, dim):
    """(x as [N, V] rows over `dim`, the leading shape). A `dim` moved last is copied to the unit stride on its
    last axis that the library reads (movedim alone leaves a strided view, which fce_* reject)."""
    if dim not in (-1, x.dim() - 1):
        x = x.movedim(dim, -1).contiguous()
    return x.reshape(-1, x.shape[-1]), x.shape[:-1]


def logsumexp(x, dim=-1, *, scale=1.0):
    """torch.logsumexp(scale * x, dim) in fp32, the max of the raw values first (fce_logsumexp)."""
    if _plain_rows(x, dim) and not (x.requires_grad and torch.is_grad_enabled()):
        # the common call, nothing to reshape or record
        if _EAGER and not _transforms():
            try:
                return _eager.logsumexp(x, float(scale))
            except RuntimeError as e:
                _eager.reraise(e)
        return _fast.logsumexp(x, float(scale))
    rows, lead = _rows(x, dim)
    if _compiling():
        out = torch.ops.fusedce.logsumexp(rows, float(scale))
    elif _wants_grad(rows):
        (out,) = LogsumexpFunction.run(rows, float(scale))
    else:
        out = _ops.call("logsumexp", rows, float(scale))
    return out.reshape(lead)


def _softmax(logits, temperature, temperatures, probs, logprobs, fp32):
    """(probs, logprobs) of a plain 2-D tensor needing no gradient: libfusedce_torch's op, or the cffi path."""
    if _EAGER and not _transforms():
        try:
            return _eager.temp_softmax(logits, temperature, temperatures, probs, logprobs, fp32)
        except RuntimeError as e:
            _eager.reraise(e)
    return _fast.temp_softmax(logits, temperature, temperatures, probs, logprobs, torch.float32 if fp32 else None)


def temp_softmax(logits, temperature=1.0, dim=-1, *, temperatures=None, probs=True, logprobs=False,
                 dtype=torch.float32):
    """Temperature softmax for sampling (fce_temp_softmax): softmax(logits / T) with the max of the raw logits
    first, T = 0 greedy (one-hot at the first maximum); temperatures: an optional per-row [N] fp32 override.
    dtype: torch.float32 or the logits' dtype. Returns SoftmaxOutput(probs, logprobs) (None where not asked)."""
    if dtype is not torch.float32 and dtype != logits.dtype:
        raise ValueError("fusedce: the softmax's output dtype is float32 or the logits' dtype")
    t = None if temperatures is None else _f32_vector(temperatures)
    if _plain_rows(logits, dim) and not (logits.requires_grad and torch.is_grad_enabled()):
        # the common call (sampling): nothing to reshape or record
        return SoftmaxOutput(*_softmax(logits, float(temperature), t, bool(probs), bool(logprobs),
                                       dtype is torch.float32))
    rows, lead = _rows(logits, dim)
    args = (rows, float(temperature), t, bool(probs), bool(logprobs), 0 if dtype == torch.float32 else 1)
    if _compiling():
        p, lp = torch.ops.fusedce.temp_softmax(*args)
    elif _wants_grad(rows):
        p, lp = TempSoftmaxFunction.run(*args)
    else:
        p, lp = _ops.call("temp_softmax", *args)

    def back(a):
        a = a.reshape(tuple(lead) + (rows.shape[-1],))
        return a if dim in (-1, logits.dim() - 1) else a.movedim(-1, dim)

    return SoftmaxOutput(back(p) if probs else None, back(lp) if logprobs else None)


def softmax(logits, temperature=1.0, dim=-1, *, temperatures=None, dtype=torch.float32):
    """The probabilities of temp_softmax."""
    if dtype is torch.float32 and _plain_rows(logits, dim) and not (logits.requires_grad and torch.is_grad_enabled()):
        t = None if temperatures is None else _f32_vector(temperatures)
        return _softmax(logits, float(temperature), t, True, False, True)[0]
    return temp_softmax(logits, temperature, dim, temperatures=temperatures, dtype=dtype).probs


def log_softmax(logits, temperature=1.0, dim=-1, *, temperatures=None, dtype=torch.float32):
    """The log-probabilities of temp_softmax."""
    return temp_softmax(logits, temperature, dim, temperatures=temperatures, probs=False, logprobs=True,
                        dtype=dtype).logprobs


# ---- knowledge distillation -----------------------------------------------------------------------

_enum = _arrays._enum
_KD_DIVERGENCE = _arrays._NAME["divergence"][_KD["divergence"]]
_KD_TOPK_NORM = _arrays._NAME["topk_norm"][_KD["topk_norm"]]
_KD_REDUCTION = _arrays._NAME["reduction"][_KD["reduction"]]


def _kd(student_logits, teacher, ids, lps, target, divergence, beta, temperature, scale_by_t2, topk_norm, reduction,
        ignore_index):
    s = student_logits.reshape(-1, student_logits.shape[-1])
    tg = None if target is None else _targets(target.reshape(-1))
    red = _reduction(reduction)
    grad = _wants_grad(s)
    args = (s, teacher, ids, lps, tg, _enum(_DIVERGENCES, divergence, "divergence"), float(beta), float(temperature),
            bool(scale_by_t2), _enum(_TOPK_NORMS, topk_norm, "topk_norm"), red, int(ignore_index), grad)
    if _compiling():
        loss, _ = torch.ops.fusedce.kd_loss(*args)
    elif grad:
        loss, _ = KDLossFunction.run(*args)
    else:
        loss, _ = _ops.call("kd_loss", *args)
    return loss.reshape(student_logits.shape[:-1]) if red == _REDUCTIONS["none"] else loss


def kd_loss(student_logits, teacher_logits, target=None, *, divergence=_KD_DIVERGENCE, beta=_KD["beta"],
            temperature=_KD["temperature"], scale_by_t2=bool(_KD["scale_by_t2"]), reduction=_KD_REDUCTION,
            ignore_index=_KD["ignore_index"]):
    """Distillation divergence between softmax(student/T) and softmax(teacher/T) over the last axis;
    reduction="mean" is batchmean over rows whose target is not ignore_index. divergence: "forward_kl"
    (KL(teacher||student), as F.kl_div(log_softmax(s), log_softmax(t), log_target=True)), "reverse_kl",
    "jsd" (generalized, weight beta: 0 is forward KL, 1 reverse KL). temperature in [1e-4, 100]
    (fusedce.KD_TEMPERATURE_MIN/MAX). The teacher gets no gradient; dstudent is formed in the forward."""
    t = teacher_logits.detach().reshape(-1, teacher_logits.shape[-1])
    return _kd(student_logits, t, None, None, target, divergence, beta, temperature, scale_by_t2, _KD_TOPK_NORM,
               reduction, ignore_index)


def kd_loss_topk(student_logits, topk_ids, topk_logprobs, target=None, *, divergence=_KD_DIVERGENCE, beta=_KD["beta"],
                 temperature=_KD["temperature"], scale_by_t2=bool(_KD["scale_by_t2"]), topk_norm=_KD_TOPK_NORM,
                 reduction=_KD_REDUCTION, ignore_index=_KD["ignore_index"]):
    """Distillation from a top-K teacher: topk_ids (..., K) (negative = unused slot) and topk_logprobs
    (..., K) fp32 log-probabilities at temperature 1 (the axolotl format); topk_norm "full_vocab" or
    "renormalize" (the student over the K ids)."""
    ids = _targets(topk_ids.reshape(-1, topk_ids.shape[-1])).contiguous()  # e.g. an expanded arange
    lps = topk_logprobs.reshape(-1, topk_logprobs.shape[-1]).detach().to(torch.float32).contiguous()
    return _kd(student_logits, None, ids, lps, target, divergence, beta, temperature, scale_by_t2, topk_norm,
               reduction, ignore_index)


class KDLoss(torch.nn.Module):
    """Module form of kd_loss: loss_fn(student_logits, teacher_logits, target=None)."""

    def __init__(self, divergence=_KD_DIVERGENCE, beta=_KD["beta"], temperature=_KD["temperature"],
                 scale_by_t2=bool(_KD["scale_by_t2"]), reduction=_KD_REDUCTION, ignore_index=_KD["ignore_index"]):
        super().__init__()
        self.kw = dict(divergence=divergence, beta=beta, temperature=temperature, scale_by_t2=scale_by_t2,
                       reduction=reduction, ignore_index=ignore_index)

    def forward(self, student_logits, teacher_logits, target=None):
        return kd_loss(student_logits, teacher_logits, target, **self.kw)


__all__ = ["CrossEntropyLoss", "CrossEntropyOutput", "KDLoss", "LinearCrossEntropyLoss", "SoftmaxOutput",
           "cross_entropy", "kd_loss", "kd_loss_topk", "linear_cross_entropy", "linear_logprobs_entropy",
           "log_softmax", "logprobs_entropy", "logsumexp", "softmax", "temp_softmax", "vocab_parallel_cross_entropy",
           "vocab_parallel_kd_loss", "vocab_parallel_kd_loss_topk", "vocab_parallel_linear_cross_entropy",
           "vocab_parallel_logprobs_entropy", "vocab_parallel_logsumexp", "vocab_parallel_softmax"]


# ---- vocabulary-parallel cross-entropy -------------------------------------------------------------

def _gather_records(records, group):
    """[W, N, K]: every rank's records in rank order (one all-gather; a lone process keeps its own)."""
    import torch.distributed as dist
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return records.unsqueeze(0)
    parts = [torch.empty_like(records) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, records.contiguous(), group=group)
    return torch.stack(parts)


class _VocabParallelCE(torch.autograd.Function):
    """The shard's records, one all-gather, the combine (the rows' lse as its pairs [N, 2]); the backward is
    the shard's fce_cross_entropy_bwd from those pairs."""

    @staticmethod
    def forward(ctx, logits, targets, group, kw):
        rec = _arrays.cross_entropy_partial(logits.detach(), targets, fields=_arrays.RECORD_FIELDS_LOSS, **kw)
        combine_kw = {k: v for k, v in kw.items() if k != "vocab_start"}
        out = _arrays.cross_entropy_combine(_gather_records(rec, group), targets, lse=_arrays.LSE_PAIR, **combine_kw)
        ctx.save_for_backward(logits, targets, out.lse)  # the pairs [N, 2]: the shard's exact gradient
        ctx.kw = kw
        return out.loss

    @staticmethod
    def backward(ctx, grad):
        logits, targets, lse = ctx.saved_tensors
        d = _arrays.cross_entropy_bwd(logits.detach(), targets, lse, grad_loss=grad.float().contiguous(), **ctx.kw)
        return d, None, None, None


class _VocabParallelCENccl(_VocabParallelCE):
    """NCCL mode: partial, all-gather and combine in one library call; the backward is the all-gather path's
    (the shard's fce_cross_entropy_bwd: each element formed in fp32 and rounded once, the same bits)."""

    @staticmethod
    def forward(ctx, logits, targets, comm, kw):
        out = _arrays.cross_entropy_fwd_vp(logits.detach(), targets, comm, lse=_arrays.LSE_PAIR, **kw)
        ctx.save_for_backward(logits, targets, out.lse)
        ctx.kw = kw
        return out.loss


class _VocabParallelLPE(torch.autograd.Function):
    """Per-token log-probabilities and entropies of a vocabulary shard's rows: records, one all-gather,
    combine (logprobs = -loss with reduction none); the backward is the shard's fce_cross_entropy_bwd_ex
    from the combined lse (its pairs [N, 2]) and entropy."""

    @staticmethod
    def forward(ctx, logits, targets, group, kw):
        ctx.set_materialize_grads(False)
        rec = _arrays.cross_entropy_partial(logits.detach(), targets, fields=_arrays.RECORD_FIELDS_ENTROPY, **kw)
        combine_kw = {k: v for k, v in kw.items() if k != "vocab_start"}
        out = _arrays.cross_entropy_combine(_gather_records(rec, group), targets, lse=_arrays.LSE_PAIR, entropy=True,
                                            **combine_kw)
        ctx.save_for_backward(logits, targets, out.lse, out.entropy)
        ctx.kw = kw
        return out.loss.neg_(), out.entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, targets, lse, ent = ctx.saved_tensors
        if g_lp is None and g_ent is None:
            return None, None, None, None
        gl, ge = _ops._lpe_grads(g_lp, g_ent, logits)
        d = _arrays.cross_entropy_bwd_ex(logits.detach(), targets, lse, entropy=ent if ge is not None else None,
                                         grad_loss=gl, grad_entropy=ge, **ctx.kw)
        return d, None, None, None


def _shard_of(v_local, vocab_start, vocab_total, group):
    """(vocab_start, vocab_total) of this rank's shard: the given ones, or equal shards in rank order."""
    import torch.distributed as dist
    if vocab_start is None or vocab_total is None:
        distributed = group is not None or (dist.is_available() and dist.is_initialized())
        rank = dist.get_rank(group) if distributed else 0
        world = dist.get_world_size(group) if distributed else 1
        vocab_start = rank * v_local if vocab_start is None else vocab_start
        vocab_total = world * v_local if vocab_total is None else vocab_total
    return int(vocab_start), int(vocab_total)


class _VocabParallelKD(torch.autograd.Function):
    """Records of the shard, one all-gather, combine (loss and the rows' statistics); JSD (0 < beta < 1) and a
    top-K teacher then the shard's terms' records from those statistics, a second all-gather, and the terms'
    combine (the loss, and A into the statistics). The backward is the shard's fce_kd_bwd from the final
    statistics. The teacher is `teacher` (the shard's logits) or `ids` / `lps` (top-K), the others None."""

    @staticmethod
    def forward(ctx, student, teacher, ids, lps, targets, group, kw, comm):
        pkw = {k: kw[k] for k in ("vocab_start", "vocab_total", "divergence", "beta", "temperature", "topk_norm")}
        ckw = {k: v for k, v in kw.items() if k != "vocab_start"}
        tkw = dict(topk_ids=ids, topk_logprobs=lps)
        topk = ids is not None
        s = student.detach()
        if comm is not None:  # every step in one library call over the group's NCCL communicator
            (loss, _), stats = _arrays.kd_fwd_vp(s, teacher, comm, targets=targets, row_stats=True, **tkw, **kw)
            ctx.save_for_backward(student, teacher, ids, lps, targets, stats)
            ctx.kw = kw
            return loss
        rec = _arrays.kd_partial(s, teacher, **tkw, **pkw)
        loss, stats = _arrays.kd_combine(_gather_records(rec, group), targets=targets, loss=not topk, **ckw)
        if loss is None:  # JSD's mixture, a top-K teacher's terms: the second exchange
            terms = _arrays.kd_terms_partial(s, teacher, stats, **tkw, **pkw)
            loss, stats = _arrays.kd_terms_combine(_gather_records(terms, group), stats, targets=targets, **ckw)
        ctx.save_for_backward(student, teacher, ids, lps, targets, stats)
        ctx.kw = kw
        return loss

    @staticmethod
    def backward(ctx, grad):
        student, teacher, ids, lps, targets, stats = ctx.saved_tensors
        d = _arrays.kd_bwd(student.detach(), teacher, stats, topk_ids=ids, topk_logprobs=lps, targets=targets,
                           grad_loss=grad.float().contiguous(), **ctx.kw)
        return d, None, None, None, None, None, None, None


def vocab_parallel_kd_loss(student_logits, teacher_logits=None, target=None, *, topk_ids=None, topk_logprobs=None,
                           divergence=_KD_DIVERGENCE, beta=_KD["beta"], temperature=_KD["temperature"],
                           scale_by_t2=bool(_KD["scale_by_t2"]), topk_norm=_KD_TOPK_NORM, reduction=_KD_REDUCTION,
                           ignore_index=_KD["ignore_index"], vocab_start=None, vocab_total=None, group=None,
                           nccl=True):
    """kd_loss of student and teacher logits whose vocabulary is split across the ranks of a
    torch.distributed `group` by the same columns (this rank holds global columns [vocab_start, vocab_start +
    V_local) of both; equal shards in rank order by default, uneven or padded ones when given), or kd_loss_topk
    of such student logits and a top-K teacher. divergence "forward_kl", "reverse_kl" or "jsd" (generalized,
    weight beta in [0, 1]: 0 is forward KL, 1 reverse KL, as kd_loss); reduction "mean" is batchmean over rows
    whose target is not ignore_index (and, with a top-K teacher, that have a used slot). Returns the loss of
    the whole rows (fp32, nats, times T^2 with scale_by_t2; shaped like the rows with "none"), the same bits on
    every rank; its gradient flows to this rank's student logits (the teacher gets none).

    student_logits: [..., V_local], fp32/bf16/fp16, CPU or CUDA. The teacher: teacher_logits [..., V_local]
    (fp32, bf16 or fp16, this rank's columns), or the keywords topk_ids (..., K) int32/int64 global vocabulary ids
    (negative = unused slot; an id >= vocab_total makes its row NaN) and topk_logprobs (..., K)
    log-probabilities (cast to fp32), the whole top-K teacher, the same on every rank, as kd_loss_topk takes
    them (topk_norm "full_vocab" or "renormalize"; a row without a used slot is masked: loss 0, not counted
    by the mean, gradient 0). Per call, through torch.distributed: forward and reverse KL with teacher logits
    (and JSD at beta 0 or 1) take one all-gather of [N, 7] fp32 records (fce_kd_partial on this rank's shard,
    fce_kd_combine of every rank's records in rank order: the loss and the rows' statistics); JSD with
    0 < beta < 1 and every top-K teacher take two, since JSD's mixture and a top-K teacher's terms need the
    rows' normalizers before any term can be formed: the same first exchange (statistics only), then one of
    [N, 5] fp32 records (fce_kd_terms_partial of the shard, fce_kd_terms_combine: the loss, and A into the
    statistics). No float all-reduce, so NaN propagates and the result does not depend on the collective's
    algorithm. With nccl=True and an NCCL group on CUDA the forward is one library call over the group's own
    communicator (fce_kd_fwd_vp: the same steps and bits, the all-gathers on the current stream). The
    backward is fce_kd_bwd of the shard from the final statistics (no exchange). Without an initialized
    process group the call is the one-shard case. Not a torch.library op: torch.compile graph-breaks around
    it.
    Raises ValueError (neither or both teachers given; an unknown name) and the library's errors
    (fusedce.FusedCEError subclasses: options out of domain, shapes that disagree, ...)."""
    if (teacher_logits is None) == (topk_ids is None or topk_logprobs is None):
        raise ValueError("vocab_parallel_kd_loss: give either teacher_logits or both topk_ids and topk_logprobs")
    v_local = student_logits.shape[-1]
    vocab_start, vocab_total = _shard_of(v_local, vocab_start, vocab_total, group)
    kw = dict(vocab_start=vocab_start, vocab_total=vocab_total, divergence=divergence, beta=float(beta),
              temperature=float(temperature), scale_by_t2=bool(scale_by_t2), topk_norm=topk_norm,
              reduction=reduction, ignore_index=int(ignore_index))
    x = student_logits.reshape(-1, v_local)
    t = ids = lps = None
    if teacher_logits is not None:
        t = teacher_logits.detach().reshape(-1, v_local)
    else:
        ids = _targets(topk_ids.reshape(-1, topk_ids.shape[-1])).contiguous()  # e.g. an expanded arange
        lps = topk_logprobs.reshape(-1, topk_logprobs.shape[-1]).detach().to(torch.float32).contiguous()
    tg = None if target is None else _targets(target).reshape(-1)
    comm = _nccl_comm(group, x.device) if nccl else None
    loss = _VocabParallelKD.apply(x, t, ids, lps, tg, group, kw, comm)
    return loss.reshape(student_logits.shape[:-1]) if _reduction(reduction) == _REDUCTION_NONE else loss


def vocab_parallel_kd_loss_topk(student_logits, topk_ids, topk_logprobs, target=None, *, divergence=_KD_DIVERGENCE,
                                beta=_KD["beta"], temperature=_KD["temperature"],
                                scale_by_t2=bool(_KD["scale_by_t2"]), topk_norm=_KD_TOPK_NORM,
                                reduction=_KD_REDUCTION, ignore_index=_KD["ignore_index"], vocab_start=None,
                                vocab_total=None, group=None, nccl=True):
    """kd_loss_topk over vocabulary shards, kd_loss_topk's arguments: vocab_parallel_kd_loss(student_logits,
    None, target, topk_ids=topk_ids, topk_logprobs=topk_logprobs, ...) (see there: two all-gathers)."""
    return vocab_parallel_kd_loss(student_logits, None, target, topk_ids=topk_ids, topk_logprobs=topk_logprobs,
                                  divergence=divergence, beta=beta, temperature=temperature, scale_by_t2=scale_by_t2,
                                  topk_norm=topk_norm, reduction=reduction, ignore_index=ignore_index,
                                  vocab_start=vocab_start, vocab_total=vocab_total, group=group, nccl=nccl)


def vocab_parallel_logprobs_entropy(logits, labels, temperature=1.0, reduction="none", *, vocab_start=None,
                                    vocab_total=None, group=None, ignore_index=-100):
    """logprobs_entropy of logits whose vocabulary is split across the ranks of a torch.distributed `group`
    (as vocab_parallel_cross_entropy: this rank holds global columns [vocab_start, vocab_start + V_local),
    equal shards in rank order by default, uneven or padded ones when given). Returns (logprobs, entropy) of
    the whole rows, the same bits on every rank, shaped like labels ("none") or reduced ("sum", "mean" over
    every token); gradients through both flow to this rank's logits. One all-gather of [N, 7] fp32 records
    through torch.distributed per call; the backward is the shard's fce_cross_entropy_bwd_ex from the combined
    lse's pairs and entropy, elementwise the bits of the unsharded call's backward. Not a torch.library op."""
    scale = _logit_scale(temperature)
    v_local = logits.shape[-1]
    vocab_start, vocab_total = _shard_of(v_local, vocab_start, vocab_total, group)
    kw = dict(vocab_start=vocab_start, vocab_total=vocab_total, reduction=_REDUCTION_NONE,
              ignore_index=int(ignore_index), logit_scale=scale)
    lp, ent = _VocabParallelLPE.apply(logits.reshape(-1, v_local), _targets(labels).reshape(-1), group, kw)
    return _reduce_pair(lp, ent, reduction, tuple(labels.shape))


_COMMS = {}  # (process group, device index) -> ops.Communicator over the group's NCCL communicator


def _nccl_comm(group, device):
    """The library's Communicator over `group`'s NCCL communicator on `device`, or None where there is none
    (not NCCL, or PyTorch creates communicators lazily and this group has not run a collective yet)."""
    import torch.distributed as dist
    if device.type != "cuda" or not (dist.is_available() and dist.is_initialized()):
        return None
    pg = group if group is not None else dist.group.WORLD
    key = (pg, device.index)
    comm = _COMMS.get(key)
    if comm is None:
        try:
            if dist.get_backend(pg) != "nccl":
                return None
            ptr = pg._get_backend(device)._comm_ptr()
        except (AttributeError, RuntimeError, ValueError):
            return None
        if not ptr:
            return None
        comm = _COMMS[key] = _arrays.Communicator(ptr, device.index)
    return comm


def vocab_parallel_cross_entropy(logits, target, *, vocab_start=None, vocab_total=None, group=None, weight=None,
                                 ignore_index=-100, reduction="mean", label_smoothing=0.0, lse_square_scale=0.0,
                                 softcap=None, nccl=True):
    """Cross-entropy of logits whose vocabulary is split across the ranks of a torch.distributed `group`
    (tensor parallelism: this rank holds global columns [vocab_start, vocab_start + V_local) of every row).
    Returns what torch.nn.functional.cross_entropy of the whole rows returns (float32), the same bits on every
    rank; its gradient flows to this rank's logits only.

    logits: [..., V_local] (Megatron's [S, B, V/W] too), fp32/bf16/fp16, CPU or CUDA. target: [...] global
    class indices. vocab_start / vocab_total: default equal shards in rank order (rank * V_local,
    world_size * V_local); give them for uneven or padded shards (columns at or past vocab_total are padding).
    weight: class weights of the whole vocabulary. Without an initialized process group the call is the
    one-shard case. Per call: one all-gather of [N, 6] fp32 records (fce_cross_entropy_partial on this
    rank's shard, fce_cross_entropy_combine of all ranks' records in rank order; no float all-reduce, so NaN
    propagates and the result does not depend on the collective's algorithm; the records carry the shards'
    column ranges, and shards that do not tile [0, vocab_total) in rank order give NaN losses, not an
    error), and the backward is fce_cross_entropy_bwd of the shard from the combined lse's pairs (m, l) (its
    probabilities exp((z - m) - l): exact at any offset of the logits). On CUDA with an NCCL group (and
    nccl=True) the library runs the forward over the group's own NCCL communicator in one call
    (fce_cross_entropy_fwd_vp); otherwise the all-gather goes through torch.distributed. Both give the same
    bits. Not a torch.library op: torch.compile graph-breaks around it.
    """
    v_local = logits.shape[-1]
    vocab_start, vocab_total = _shard_of(v_local, vocab_start, vocab_total, group)
    red = _reduction(reduction)
    kw = dict(vocab_start=int(vocab_start), vocab_total=int(vocab_total), reduction=red, ignore_index=int(ignore_index),
              label_smoothing=float(label_smoothing), z_loss_scale=float(lse_square_scale),
              softcap=float(softcap or 0.0), class_weights=_class_weights(weight))
    x = logits.reshape(-1, v_local)
    t = _targets(target).reshape(-1)
    comm = _nccl_comm(group, x.device) if nccl else None
    if comm is not None:
        loss = _VocabParallelCENccl.apply(x, t, comm, kw)
    else:
        loss = _VocabParallelCE.apply(x, t, group, kw)
    return loss.reshape(target.shape) if red == _REDUCTION_NONE else loss


# ---- vocabulary-parallel linear cross-entropy --------------------------------------------------------

class _VocabParallelLinearCE(torch.autograd.Function):
    """NCCL mode with a reduced loss: one library call forms the loss and every gradient (upstream gradient 1;
    the backward scales them where it is not, as linear_cross_entropy does). Otherwise: the shard's records,
    one all-gather, the combine; the backward is the shard's fce_linear_cross_entropy_bwd from the combined
    lse (its pairs [N, 2]), its fp32 part of dhidden summed over the group, then rounded once."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, group, comm, kw, need):
        h, w = hidden.detach(), weight.detach()
        b = None if bias is None else bias.detach()
        fused = comm is not None and any(need) and kw["reduction"] != _REDUCTION_NONE
        if comm is not None:
            out = _arrays.linear_cross_entropy_fwd_vp(h, w, targets, comm, bias=b, lse=_arrays.LSE_PAIR,
                                                      dhidden=fused and need[0], dweight=fused and need[1],
                                                      dbias=fused and need[2], **kw)
        else:
            rec = _arrays.linear_cross_entropy_partial(h, w, targets, bias=b, fields=_arrays.RECORD_FIELDS_LOSS, **kw)
            out = _arrays.cross_entropy_combine(_gather_records(rec, group), targets, lse=_arrays.LSE_PAIR,
                                                **{k: v for k, v in kw.items() if k != "vocab_start"})
        ctx.grads = (out.dhidden, out.dweight, out.dbias) if fused else None
        ctx.save_for_backward(hidden, weight, bias, targets, out.lse)
        ctx.group, ctx.kw, ctx.need = group, kw, need
        return out.loss

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need = ctx.need
        if ctx.grads is not None:
            grads, ctx.grads = ctx.grads, None
            g = grad.float().reshape(())
            dh, dw, db = (_arrays.scale_rows(d, g) if d is not None and n else None for d, n in zip(grads, need))
        else:
            r = _arrays.linear_cross_entropy_bwd(hidden.detach(), weight.detach(), targets, lse,
                                                 bias=None if bias is None else bias.detach(), dhidden=need[0],
                                                 dweight=need[1], dbias=need[2] and bias is not None,
                                                 grad_loss=grad.float().contiguous(), **ctx.kw)
            dh, dw, db = r
            if dh is not None:
                dh = _sum_over_ranks(dh, ctx.group, hidden.dtype)  # the ranks' fp32 parts
        return dh, dw, db, None, None, None, None, None


def _sum_over_ranks(x, group, dtype):
    """The sum over the group's ranks of each rank's fp32 x, added in rank order (((x_0 + x_1) + x_2) + ...),
    rounded once to dtype: the same bits on every rank, under any NCCL setting, and as the library's NCCL mode
    (fce_linear_cross_entropy_fwd_vp). Two ranks all-reduce (a + b whatever the order); more all-gather the
    parts (64 Mi elements of all ranks' at a time) and add them in rank order, as an all-reduce (its ring's
    or tree's order) would not. A lone process (no process group) returns x rounded."""
    import torch.distributed as dist
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return x.to(dtype)
    world = dist.get_world_size(group)
    if world <= 2:
        if world == 2:
            dist.all_reduce(x, group=group)
        return x.to(dtype)
    flat = x.reshape(-1)
    out = torch.empty(flat.shape, dtype=dtype, device=x.device)
    step = max(1, (64 << 20) // world)
    for off in range(0, flat.numel(), step):
        piece = flat[off:off + step].contiguous()
        parts = [torch.empty_like(piece) for _ in range(world)]
        dist.all_gather(parts, piece, group=group)
        total = parts[0]
        for r in range(1, world):
            total += parts[r]
        out[off:off + step] = total
    return out.view(x.shape)


def vocab_parallel_linear_cross_entropy(hidden, weight, target, bias=None, *, vocab_start=None, vocab_total=None,
                                        group=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                                        lse_square_scale=0.0, softcap=None, nccl=True):
    """Cross-entropy of F.linear(hidden, weight, bias) whose LM head is split by rows of the vocabulary across
    the ranks of a torch.distributed `group` (tensor parallelism: this rank holds weight rows [vocab_start,
    vocab_start + V_local), and the bias's; hidden and target are the same on every rank), without the logits.
    Returns the loss of the whole rows (float32), the same bits on every rank; gradients flow to hidden (the
    sum over the ranks), and to this rank's weight and bias rows.

    hidden: [..., H] fp32/bf16/fp16, CUDA or CPU. weight: [V_local, H], hidden's dtype. target: [...] global
    class indices. vocab_start / vocab_total: default equal shards in rank order; give them for uneven or padded
    shards (rows at or past vocab_total are padding, never read). On CUDA with an NCCL group (and nccl=True)
    the library runs each token chunk's record exchange over the group's NCCL communicator inside one call
    (fce_linear_cross_entropy_fwd_vp: 6*N*H*V_local flops), and with a reduced loss forms every gradient in
    that call. Otherwise one all-gather of [N, 6] fp32 records through torch.distributed
    (fce_linear_cross_entropy_partial, fce_cross_entropy_combine); the backward recomputes the shard's logits
    (fce_linear_cross_entropy_bwd: 8*N*H*V_local flops in all) and sums dhidden's fp32 parts in rank order.
    Both paths give dhidden the same bits on every rank and under any NCCL setting. Not a
    torch.library op: torch.compile graph-breaks around it."""
    v_local = weight.shape[0]
    vocab_start, vocab_total = _shard_of(v_local, vocab_start, vocab_total, group)
    red = _reduction(reduction)
    kw = dict(vocab_start=vocab_start, vocab_total=vocab_total, reduction=red, ignore_index=int(ignore_index),
              label_smoothing=float(label_smoothing), z_loss_scale=float(lse_square_scale),
              softcap=float(softcap or 0.0))
    h = hidden.reshape(-1, hidden.shape[-1])
    t = _targets(target).reshape(-1)
    grad = torch.is_grad_enabled()
    need = (grad and hidden.requires_grad, grad and weight.requires_grad,
            grad and bias is not None and bias.requires_grad)
    comm = _nccl_comm(group, h.device) if nccl else None
    loss = _VocabParallelLinearCE.apply(h, weight, bias, t, group, comm, kw, need)
    return loss.reshape(target.shape) if red == _REDUCTION_NONE else loss


# ---- vocabulary-parallel logsumexp and softmax -------------------------------------------------------

def _whole_lse(x, group, vocab_start, vocab_total, scale, comm=None, pair=False):
    """The whole rows' logsumexp of scale * x from this shard's records and every rank's (in one library call
    over the group's NCCL communicator when `comm` is given; the same bits either way): [N] fp32, or with
    pair=True its pairs [N, 2] fp32 (M the rows' max raw x, log D; lse = scale M + log D), the form a
    shard's softmax takes exactly at any temperature."""
    if comm is not None:
        return _arrays.logsumexp_vp(x, comm, vocab_start=vocab_start, vocab_total=vocab_total, scale=scale,
                                    pair=pair)
    rec = _arrays.logsumexp_partial(x, vocab_start=vocab_start, vocab_total=vocab_total, scale=scale)
    return _arrays.logsumexp_combine(_gather_records(rec, group), pair=pair)


def _lse_of_pairs(pairs, scale):
    """[N] fp32: the lse scale * M + log D of logsumexp pairs [N, 2], as the library's combine forms its [N]
    output: in float64, rounded once, an infinite M the lse itself (within 1 ulp of that output, whose log D
    is not rounded to fp32 first)."""
    m = pairs[:, 0]
    v = (m.double() * float(np.float32(scale)) + pairs[:, 1].double()).float()
    return torch.where(m.isinf(), m, v)


def _temperature_of(scale):
    """A temperature T whose fp32 1.0f / T (what a shard's fce_temp_softmax multiplies by) is the fp32 `scale`
    when one of the three fp32 values next to 1 / scale gives it (nearly always), else fp32(1 / scale)."""
    s = np.float32(scale)
    t = np.float32(1.0 / float(s)) if s != 0 else np.float32(np.inf)
    for c in (t, np.nextafter(t, np.float32(np.inf)), np.nextafter(t, np.float32(0))):
        if np.float32(1.0) / c == s:
            return float(c)
    return float(t)


def _real_columns(x, vocab_start, vocab_total):
    """The shard's columns inside the vocabulary (the rest is padding)."""
    return max(0, min(x.shape[-1], vocab_total - vocab_start))


class _VocabParallelLse(torch.autograd.Function):
    """The whole rows' logsumexp: one all-gather of [N, LSE_RECORD_FIELDS] records. With a gradient to form,
    the combine gives the pairs [N, 2], kept for the backward (the lse returned is formed from them); the
    backward is scale * the shard's part of softmax(scale * x) (fce_temp_softmax of the shard at T = 1 / scale
    from the pairs: exact at any scale, where an [N] lse's rounding would enter every probability)."""

    @staticmethod
    def forward(ctx, x, group, vocab_start, vocab_total, scale, comm, grad):
        if not grad:  # the library's [N] lse itself
            return _whole_lse(x.detach(), group, vocab_start, vocab_total, scale, comm)
        pairs = _whole_lse(x.detach(), group, vocab_start, vocab_total, scale, comm, pair=True)
        ctx.save_for_backward(x, pairs)
        ctx.shard = (vocab_start, vocab_total, scale)
        return _lse_of_pairs(pairs, scale)

    @staticmethod
    def backward(ctx, g):
        x, pairs = ctx.saved_tensors
        vs, vt, scale = ctx.shard
        p = _arrays.temp_softmax(x.detach(), temperature=_temperature_of(scale), vocab_start=vs, vocab_total=vt,
                                 lse=pairs).probs
        return (p * (g.float() * scale).unsqueeze(-1)).to(x.dtype), None, None, None, None, None, None


def _row_sum_over_ranks(v, group):
    """[N] fp32: the sum over the group's ranks of each rank's [N] values, in rank order (an all-gather, then a
    fixed-order sum: the same bits on every rank)."""
    parts = _gather_records(v.contiguous(), group)
    total = parts[0].clone()
    for r in range(1, parts.shape[0]):
        total += parts[r]
    return total


class _VocabParallelSoftmax(torch.autograd.Function):
    """A shard's part of softmax(x / T) (or its log) over the whole rows: the rows' lse pairs from one
    all-gather of records made at the scale fce_temp_softmax forms (fp32 1.0f / T), then fce_temp_softmax of the
    shard from the pairs (exact at any T; an [N] lse at T = 1e-3 and logits of 65504 would be off by e^2).
    Backward: the row sums it needs (sum g p, or sum g) summed over the ranks in rank order."""

    @staticmethod
    def forward(ctx, x, group, vocab_start, vocab_total, temperature, log, comm):
        if comm is not None:  # one library call: the lse's exchange over NCCL, then the shard's softmax
            out = _arrays.temp_softmax_vp(x.detach(), comm, temperature=temperature, probs=not log, logprobs=log,
                                          vocab_start=vocab_start, vocab_total=vocab_total)
        else:
            pairs = _whole_lse(x.detach(), group, vocab_start, vocab_total, _arrays.softmax_scale(temperature),
                               pair=True)
            out = _arrays.temp_softmax(x.detach(), temperature=temperature, probs=not log, logprobs=log,
                                       vocab_start=vocab_start, vocab_total=vocab_total, lse=pairs)
        y = out.logprobs if log else out.probs
        ctx.save_for_backward(x, y)
        ctx.shard = (group, vocab_start, vocab_total, temperature, log)
        return y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        group, vs, vt, temperature, log = ctx.shard
        n = _real_columns(x, vs, vt)
        g = g.float().clone()
        g[..., n:] = 0  # padding columns are outside the distribution
        p = y.exp() if log else y
        dot = _row_sum_over_ranks(g.sum(-1) if log else (g * p).sum(-1), group).unsqueeze(-1)
        dx = (g - p * dot) if log else p * (g - dot)
        dx = dx / temperature
        dx[..., n:] = 0
        return dx.to(x.dtype), None, None, None, None, None, None


def vocab_parallel_logsumexp(x, *, scale=1.0, vocab_start=None, vocab_total=None, group=None, nccl=True):
    """torch.logsumexp(scale * x, -1) of rows whose vocabulary is split across the ranks of a torch.distributed
    `group` (this rank holds global columns [vocab_start, vocab_start + V_local) of each row; equal shards in
    rank order by default, uneven or padded ones when given). x: [..., V_local] fp32/bf16/fp16, CPU or CUDA.
    Returns [...] fp32, the same bits on every rank and in both modes: one all-gather of [N, LSE_RECORD_FIELDS]
    fp32 records (fce_logsumexp_partial, fce_logsumexp_combine in rank order); with nccl=True and an NCCL
    group on CUDA, in one library call over the group's communicator (fce_logsumexp_vp), otherwise through
    torch.distributed. Without a gradient to record that is the library's [N] lse; with one, the combine
    gives the rows' pairs (M, log D) for the backward and the lse is scale M + log D from them in float64,
    rounded once (within 1 ulp of the [N] output, whose log D is not rounded to fp32 first). Its gradient
    flows to this rank's x: scale * the shard's part of softmax(scale * x), formed from the pairs, which needs
    scale > 0 (the backward raises fusedce.BackendNotImplementedError, a NotImplementedError, otherwise, from
    fce_temp_softmax). Not a torch.library op."""
    v_local = x.shape[-1]
    vocab_start, vocab_total = _shard_of(v_local, vocab_start, vocab_total, group)
    comm = _nccl_comm(group, x.device) if nccl else None
    lse = _VocabParallelLse.apply(x.reshape(-1, v_local), group, vocab_start, vocab_total, float(scale), comm,
                                  _wants_grad(x))
    return lse.reshape(x.shape[:-1])


def vocab_parallel_softmax(logits, temperature=1.0, *, log=False, vocab_start=None, vocab_total=None, group=None,
                           nccl=True):
    """This rank's columns of softmax(logits / temperature) (log=True: of log_softmax) over rows whose
    vocabulary is split across the ranks of a torch.distributed `group` (as vocab_parallel_logsumexp). logits:
    [..., V_local] fp32/bf16/fp16; returns [..., V_local] fp32 (padding columns: probability 0, log-probability
    -inf), the same distribution on every rank. One all-gather of [N, LSE_RECORD_FIELDS] records at the scale
    fp32 1.0f / temperature (fusedce.softmax_scale), the whole rows' lse as its pairs (M, log D), then
    fce_temp_softmax of the shard from them: log p = (x - M) / T - log D, no overflow or NaN for finite logits
    at any T > 0 (nccl=True with an NCCL group on CUDA: all in one library call, fce_temp_softmax_vp, the same
    bits); one finite temperature > 0 (fusedce.BackendNotImplementedError, a NotImplementedError, otherwise).
    Differentiable: the backward all-gathers one [N] fp32 row sum and adds the ranks' parts in rank order. Not a
    torch.library op."""
    v_local = logits.shape[-1]
    vocab_start, vocab_total = _shard_of(v_local, vocab_start, vocab_total, group)
    comm = _nccl_comm(group, logits.device) if nccl else None
    y = _VocabParallelSoftmax.apply(logits.reshape(-1, v_local), group, vocab_start, vocab_total, float(temperature),
                                    bool(log), comm)
    return y.reshape(logits.shape)
