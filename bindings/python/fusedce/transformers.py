"""Hugging Face transformers models trained and distilled through the library.

    import fusedce.transformers as fhf
    model = AutoModelForCausalLM.from_pretrained(name)
    fhf.apply_fusedce(model)             # this model; or a class (every instance), or None (every family below)
    loss = model(input_ids, labels=labels).loss   # training mode: no [B, T, V] logits are formed
    fhf.unpatch(model)

`apply_fusedce` changes two things on a causal LM (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
MistralForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, or any *ForCausalLM built the same way: a decoder
at `.model` whose `last_hidden_state` goes through `.lm_head`):

- linear_cross_entropy=True: when labels are given and the model is training (or the call passes
  `return_logits=False`), the loss is `fusedce.torch.linear_cross_entropy` of the last hidden states and
  `lm_head.weight` (and its bias): the logits are never formed, and the output's `logits` is None. Eval mode,
  `return_logits=True`, no labels, `logits_to_keep` other than 0, or a config with
  `output_router_logits` (an MoE auxiliary loss) take the model's own forward.
- cross_entropy=True: where logits are formed and labels given, the model's loss function is
  `causal_lm_loss_from_logits` (the library's cross-entropy, reading bf16 logits without an fp32 copy).

Both keep transformers' semantics (`ForCausalLMLoss`): labels shifted one place left (the last position and
`ignore_index` = -100 ignored) or `shift_labels` as given; mean over non-ignored tokens, or the sum divided by
`num_items_in_batch` when the Trainer passes it (gradient accumulation); Gemma's `final_logit_softcapping`
(cap * tanh(logits / cap)). Logits are rounded to the inputs' dtype before the loss as `lm_head` would
round them; under autocast the hidden states and weight are cast to the autocast dtype first. Patching
twice is a no-op; `unpatch` restores what was there.

`kd_loss` is a distillation loss over a student's and a teacher's outputs, for a Trainer.compute_loss
override (examples/hf_distill.py).
"""
import functools
import importlib

import torch

from . import torch as _ft

FAMILIES = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaForCausalLM"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3ForCausalLM"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "MistralForCausalLM"),
    "gemma2": ("transformers.models.gemma2.modeling_gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("transformers.models.gemma3.modeling_gemma3", "Gemma3ForCausalLM"),
}
_MARK = "_fusedce_patch"  # the attribute holding what apply_fusedce replaced


def _shift(labels, shift_labels, ignore_index):
    """transformers' next-token targets: labels[..., 1:] with ignore_index appended, or shift_labels."""
    return shift_labels if shift_labels is not None else _ft._shifted_targets(labels, 1, ignore_index)


def _reduce(loss_sum_or_mean, num_items_in_batch):
    if num_items_in_batch is None:
        return loss_sum_or_mean
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss_sum_or_mean.device)
    return loss_sum_or_mean / num_items_in_batch


def causal_lm_loss(hidden_states, weight, labels=None, *, bias=None, num_items_in_batch=None, ignore_index=-100,
                   shift_labels=None, softcap=None):
    """transformers' ForCausalLMLoss of `lm_head(hidden_states)` without the logits.

    hidden_states: [B, T, H] (or [N, H]) fp32/bf16/fp16; weight: [V, H] the LM head's; bias: [V] or None;
    labels: [B, T] int64 (shifted here) or shift_labels: [B, T] already shifted; softcap: Gemma's
    final_logit_softcapping or None. Returns the fp32 scalar loss: the mean over non-ignored tokens, or
    their sum / num_items_in_batch when that is given. Raises the binding's errors (fusedce.errors) for input
    the library rejects (e.g. a target outside [0, V) other than ignore_index)."""
    targets = _shift(labels, shift_labels, ignore_index)
    h, w, b = hidden_states, weight, bias
    if torch.is_autocast_enabled(h.device.type):
        dt = torch.get_autocast_dtype(h.device.type)
        h, w = h.to(dt), w.to(dt)
        b = None if b is None else b.to(dt)
    elif h.dtype != w.dtype:
        h = h.to(w.dtype)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = _ft.linear_cross_entropy(h, w, targets.to(h.device), b, ignore_index=ignore_index, softcap=softcap,
                                    reduction=reduction)
    return _reduce(loss, num_items_in_batch)


def causal_lm_loss_from_logits(logits, labels=None, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                               shift_labels=None, **kwargs):
    """transformers' ForCausalLMLoss (same signature) through the library's cross-entropy: logits [B, T, V]
    in their own dtype (statistics in fp32, no fp32 copy of the logits)."""
    targets = _shift(labels, shift_labels, ignore_index)
    v = logits.shape[-1] if vocab_size is None else vocab_size
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = _ft.cross_entropy(logits.reshape(-1, v), targets.reshape(-1).to(logits.device), ignore_index=ignore_index,
                             reduction=reduction)
    return _reduce(loss, num_items_in_batch)


def _decoder(model):
    d = getattr(model, "model", None)
    return d if d is not None else model.get_decoder()


def _make_forward(original):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    @functools.wraps(original)
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, return_logits=None, **kwargs):
        fused = labels is not None and (return_logits is False or (return_logits is None and self.training))
        if (not fused or not isinstance(logits_to_keep, int) or logits_to_keep != 0
                or getattr(self.config, "output_router_logits", False)):
            return original(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                            use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        outputs = _decoder(self)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                                 **kwargs)
        cfg = getattr(self.config, "get_text_config", lambda: self.config)()
        loss = causal_lm_loss(outputs.last_hidden_state, self.lm_head.weight, labels,
                              bias=getattr(self.lm_head, "bias", None),
                              num_items_in_batch=kwargs.get("num_items_in_batch"),
                              shift_labels=kwargs.get("shift_labels"),
                              softcap=getattr(cfg, "final_logit_softcapping", None))
        out = CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                     hidden_states=outputs.hidden_states, attentions=outputs.attentions)
        return out if return_dict else out.to_tuple()

    forward.__fusedce__ = True
    return forward


def _classes(target):
    if target is None:
        out = []
        for mod, name in FAMILIES.values():
            try:
                out.append(getattr(importlib.import_module(mod), name))
            except (ImportError, AttributeError):
                pass  # a transformers release without this family
        return out
    if isinstance(target, str):
        mod, name = FAMILIES[target.lower()]
        return [getattr(importlib.import_module(mod), name)]
    return [target]


def _check(t):
    if isinstance(t, torch.nn.Module):
        ok = isinstance(getattr(t, "lm_head", None), torch.nn.Linear) and (
            getattr(t, "model", None) is not None or hasattr(t, "get_decoder"))
    else:
        ok = isinstance(t, type) and issubclass(t, torch.nn.Module)
    if not ok:
        raise TypeError(f"apply_fusedce: {getattr(t, '__name__', type(t).__name__)} is not a causal LM "
                        "with a decoder at .model and an nn.Linear lm_head")


def apply_fusedce(model_or_class=None, *, linear_cross_entropy=True, cross_entropy=True):
    """Patch a causal LM (an instance: that model only; a class: every instance; a family name such as
    "llama"; None: every family in FAMILIES that this transformers has). Returns its argument.
    Raises TypeError for an object that is not a causal LM with an lm_head, KeyError for an unknown family."""
    targets = [model_or_class] if isinstance(model_or_class, torch.nn.Module) else _classes(model_or_class)
    for t in targets:
        _check(t)
        if _MARK in vars(t):
            continue  # already patched: a no-op
        saved = {"forward": vars(t).get("forward"), "_loss_function": vars(t).get("_loss_function")}
        base = type(t).forward if isinstance(t, torch.nn.Module) else t.forward
        if linear_cross_entropy and not getattr(base, "__fusedce__", False):  # not through a patched class
            fwd = _make_forward(base)
            if isinstance(t, torch.nn.Module):
                t.forward = fwd.__get__(t)
            else:
                t.forward = fwd
        if cross_entropy:
            if isinstance(t, torch.nn.Module):
                t._loss_function = causal_lm_loss_from_logits
            else:
                t._loss_function = staticmethod(causal_lm_loss_from_logits)
        setattr(t, _MARK, saved)
    return model_or_class


def unpatch(model_or_class=None):
    """Undo apply_fusedce on the same argument (a no-op where it was not patched)."""
    targets = [model_or_class] if isinstance(model_or_class, torch.nn.Module) else _classes(model_or_class)
    for t in targets:
        saved = vars(t).get(_MARK)
        if saved is None:
            continue
        for name, value in saved.items():
            if value is None:
                if name in vars(t):
                    delattr(t, name)
            else:
                setattr(t, name, value)
        delattr(t, _MARK)
    return model_or_class


def kd_loss(student_logits, teacher_logits=None, *, topk_ids=None, topk_logprobs=None, labels=None,
            shift_labels=None, ignore_index=-100, divergence="forward_kl", beta=0.5, temperature=1.0,
            scale_by_t2=True):
    """Distillation loss between a student's logits [B, T, V] and the teacher's (logits [B, T, V], or its
    top-K: topk_ids [B, T, K] int64 and topk_logprobs [B, T, K] fp32) at the same positions, averaged over
    the positions whose next-token label is not ignore_index (labels [B, T], shifted as the LM loss is, or
    shift_labels as given; all positions when both are None). divergence: "forward_kl", "reverse_kl" or
    "jsd" (weight beta); temperature T in [1e-4, 100]; scale_by_t2 multiplies by T^2 (Hinton et al. 2015).
    Returns the fp32 scalar loss; its gradient flows to student_logits only."""
    v = student_logits.shape[-1]
    s = student_logits.reshape(-1, v)
    target = None
    if labels is not None or shift_labels is not None:
        target = _shift(labels, shift_labels, ignore_index).reshape(-1).to(s.device)
    kw = dict(divergence=divergence, beta=beta, temperature=temperature, scale_by_t2=scale_by_t2,
              ignore_index=ignore_index, reduction="mean")
    if teacher_logits is not None:
        return _ft.kd_loss(s, teacher_logits.reshape(-1, v), target, **kw)
    k = topk_ids.shape[-1]
    return _ft.kd_loss_topk(s, topk_ids.reshape(-1, k), topk_logprobs.reshape(-1, k), target, **kw)
