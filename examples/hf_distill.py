#!/usr/bin/env python3
"""Distil a Hugging Face causal LM into a smaller one with libfusedce's KD and cross-entropy losses.

    python3 examples/hf_distill.py                     # tiny random Llama models, CPU, a few steps
    python3 examples/hf_distill.py --device cuda --dtype bf16 --steps 50
    python3 examples/hf_distill.py --trainer           # the same loss through transformers.Trainer
                                                       # (needs `accelerate`)

The student's loss is alpha * (next-token cross-entropy) + (1 - alpha) * T^2 * KL(teacher || student) at
temperature T, over the positions whose label is scored. The student is patched with
fusedce.transformers.apply_fusedce: asked for its logits (return_logits=True, the KD term needs them), its
cross-entropy is the library's over those logits (no fp32 copy); fhf.kd_loss forms the student's gradient
in its forward pass. DistillTrainer shows the same as a Trainer.compute_loss override, the place such
losses go in a Hugging Face training script. --topk K distils from the teacher's top-K log-probabilities
instead of its full logits (what a precomputed teacher dataset holds).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bindings", "python"))

import torch  # noqa: E402
import transformers  # noqa: E402

import fusedce.transformers as fhf  # noqa: E402


def distill_loss(student, teacher, batch, *, alpha, temperature, topk=0, num_items_in_batch=None):
    """alpha * CE + (1 - alpha) * KD for one batch ({"input_ids", "labels"[, "attention_mask"]})."""
    out = student(**batch, return_logits=True, num_items_in_batch=num_items_in_batch)
    with torch.no_grad():
        t_logits = teacher(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
    if topk:
        lp, ids = torch.log_softmax(t_logits.float(), -1).topk(topk, -1)
        kd = fhf.kd_loss(out.logits, topk_ids=ids, topk_logprobs=lp, labels=batch["labels"], temperature=temperature)
    else:
        kd = fhf.kd_loss(out.logits, t_logits, labels=batch["labels"], temperature=temperature)
    return alpha * out.loss + (1 - alpha) * kd, out


class DistillTrainer(transformers.Trainer):
    """transformers.Trainer with the distillation loss (teacher=, alpha=, temperature=, topk= keywords)."""

    def __init__(self, *args, teacher, alpha=0.5, temperature=2.0, topk=0, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher, self.alpha, self.temperature, self.topk = teacher.eval(), alpha, temperature, topk

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, out = distill_loss(model, self.teacher, inputs, alpha=self.alpha, temperature=self.temperature,
                                 topk=self.topk, num_items_in_batch=num_items_in_batch)
        return (loss, out) if return_outputs else loss


def tiny_llama(layers, hidden, vocab, seed):
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--topk", type=int, default=0)
    ap.add_argument("--trainer", action="store_true")
    args = ap.parse_args()
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    teacher = tiny_llama(4, 128, args.vocab, 0).to(args.device, dt).eval()
    student = fhf.apply_fusedce(tiny_llama(2, 64, args.vocab, 1).to(args.device, dt))
    g = torch.Generator().manual_seed(2)
    data = [{"input_ids": torch.randint(0, args.vocab, (args.seq,), generator=g)} for _ in range(args.batch * args.steps)]
    for d in data:
        d["labels"] = d["input_ids"].clone()
    if args.trainer:
        targs = transformers.TrainingArguments(output_dir="/tmp/hf_distill", per_device_train_batch_size=args.batch,
                                               max_steps=args.steps, logging_steps=1, report_to=[],
                                               bf16=args.dtype == "bf16", use_cpu=args.device == "cpu")
        DistillTrainer(model=student, args=targs, train_dataset=data, teacher=teacher, alpha=args.alpha,
                       temperature=args.temperature, topk=args.topk).train()
        return
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    student.train()
    for step in range(args.steps):
        rows = data[step * args.batch:(step + 1) * args.batch]
        batch = {k: torch.stack([r[k] for r in rows]).to(args.device) for k in rows[0]}
        loss, _ = distill_loss(student, teacher, batch, alpha=args.alpha, temperature=args.temperature,
                               topk=args.topk)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
