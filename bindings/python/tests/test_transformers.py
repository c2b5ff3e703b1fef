"""fusedce.transformers on tiny random models of each family, on the CPU: the patched model's loss and
gradients against the unpatched model's (transformers' own loss over materialized fp32 logits)."""
import copy

import pytest
import torch
import transformers

import fusedce.transformers as fhf

COMMON = dict(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"final_logit_softcapping": 3.0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"final_logit_softcapping": 3.0}),
}


def make(family, seed=0, dtype=torch.float32, **extra):
    cfg_name, cls_name, kw = FAMILIES[family]
    cfg = getattr(transformers, cfg_name)(**COMMON, **kw, **extra)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(cfg).to(dtype)
    model.train()
    return model


def batch(b=2, t=13, v=257, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, v, (b, t), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt that is not scored
    labels[1, -2] = -100
    return ids, labels


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close_grads(got, want, rtol=2e-5):
    assert got.keys() == want.keys()
    for n in want:
        scale = want[n].abs().max().item() + 1e-12
        err = (got[n] - want[n]).abs().max().item()
        assert err <= rtol * scale, f"{n}: max error {err:.3e} against max |grad| {scale:.3e}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_loss_and_gradients_match_unpatched(family):
    ref = make(family)
    model = copy.deepcopy(ref)
    fhf.apply_fusedce(model)
    ids, labels = batch()
    want = ref(ids, labels=labels)
    want.loss.backward()
    out = model(ids, labels=labels)
    assert out.logits is None  # training with labels: no logits formed
    out.loss.backward()
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=0)
    assert_close_grads(grads(model), grads(ref))


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_gradient_accumulation_with_num_items_in_batch(family):
    ref = make(family)
    model = fhf.apply_fusedce(copy.deepcopy(ref))
    ids, labels = batch(b=4)
    n_items = (labels[:, 1:] != -100).sum()
    whole = ref(ids, labels=labels).loss  # mean over the whole batch
    total = 0
    for half in (slice(0, 2), slice(2, 4)):
        loss = model(ids[half], labels=labels[half], num_items_in_batch=n_items).loss
        want = ref(ids[half], labels=labels[half], num_items_in_batch=n_items).loss
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)
        loss.backward()
        total = total + loss.detach()
    torch.testing.assert_close(total, whole.detach(), rtol=1e-5, atol=0)
    whole.backward()
    assert_close_grads(grads(model), grads(ref))


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_eval_and_return_logits_keep_logits_with_the_library_loss(family):
    ref = make(family)
    model = fhf.apply_fusedce(copy.deepcopy(ref))
    ids, labels = batch()
    want = ref(ids, labels=labels)
    got = model(ids, labels=labels, return_logits=True)
    assert got.logits is not None
    torch.testing.assert_close(got.logits, want.logits)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
    model.eval()
    ref.eval()
    with torch.no_grad():
        got, want = model(ids, labels=labels), ref(ids, labels=labels)
    assert got.logits is not None
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
    assert model.loss_function is fhf.causal_lm_loss_from_logits
    no_labels = model(ids)
    assert no_labels.loss is None and no_labels.logits.shape == (2, 13, 257)


def test_return_dict_false_gives_a_tuple():
    model = fhf.apply_fusedce(make("llama"))
    ids, labels = batch()
    out = model(ids, labels=labels, return_dict=False, use_cache=False)
    assert isinstance(out, tuple) and out[0].dim() == 0


def test_patch_twice_is_a_no_op_and_unpatch_restores():
    model = make("llama")
    cls = type(model)
    fhf.apply_fusedce(model)
    patched = model.forward
    fhf.apply_fusedce(model)
    assert model.forward == patched
    fhf.unpatch(model)
    assert "forward" not in vars(model) and "_loss_function" not in vars(model)
    assert model.forward.__func__ is cls.forward
    # the class: every instance, then undone
    fhf.apply_fusedce(cls)
    try:
        fresh = make("llama")
        assert getattr(fresh.forward, "__fusedce__", False)
        fhf.apply_fusedce(fresh)  # an instance of a patched class is not wrapped twice
        assert "forward" not in vars(fresh)
        ids, labels = batch()
        assert fresh(ids, labels=labels).logits is None
    finally:
        fhf.unpatch(cls)
    assert not getattr(cls.forward, "__fusedce__", False) and "_loss_function" not in vars(cls)


def test_bf16_model_matches_unpatched():
    ref = make("llama", dtype=torch.bfloat16)
    model = fhf.apply_fusedce(copy.deepcopy(ref))
    ids, labels = batch()
    want, got = ref(ids, labels=labels).loss, model(ids, labels=labels).loss
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=0)


def test_not_a_causal_lm_raises():
    with pytest.raises(TypeError):
        fhf.apply_fusedce(torch.nn.Linear(3, 4))
    with pytest.raises(KeyError):
        fhf.apply_fusedce("no-such-family")


def _kd_reference(s, t, mask, T):
    lq = torch.log_softmax(s.double() / T, -1)
    lp = torch.log_softmax(t.double() / T, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return (kl * mask).sum() / mask.sum() * T * T


def test_kd_loss_full_and_topk():
    g = torch.Generator().manual_seed(3)
    s = (torch.randn(2, 7, 131, generator=g) * 2).requires_grad_()
    t = torch.randn(2, 7, 131, generator=g) * 2
    labels = torch.randint(0, 131, (2, 7), generator=g)
    labels[0, 2] = -100
    mask = (torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:] != -100).double()
    s64 = s.detach().double().requires_grad_()
    want = _kd_reference(s64, t, mask, 2.0)
    want.backward()
    got = fhf.kd_loss(s, t, labels=labels, temperature=2.0)
    got.backward()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)
    torch.testing.assert_close(s.grad.double(), s64.grad, rtol=1e-4, atol=1e-7)
    # top-K holding the whole vocabulary: the same distribution
    lp = torch.log_softmax(t, -1)
    ids = torch.arange(131).expand(2, 7, 131)
    got_k = fhf.kd_loss(s.detach(), topk_ids=ids, topk_logprobs=lp, labels=labels, temperature=2.0)
    torch.testing.assert_close(got_k.double(), want.detach(), rtol=1e-4, atol=0)


def test_distill_example_runs():
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    for extra in ([], ["--topk", "8"]):
        r = subprocess.run([sys.executable, os.path.join(root, "examples", "hf_distill.py"), "--steps", "2"] + extra,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert "step 1: loss" in r.stdout
