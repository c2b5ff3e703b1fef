#!/usr/bin/env python3
"""Training steps of Hugging Face causal LMs: unpatched, fusedce.transformers.apply_fusedce, and Liger's patch
of the loss alone (fused_linear_cross_entropy=True, its other kernels off), one process each.

    python3 benchmarks/bench_hf.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --sample sample.safetensors \\
        --json out.json --plot docs/img/hf-training.svg

Models: "smollm2" is SmolLM2-135M-Instruct loaded by transformers from the GGUF (needs the gguf and
accelerate packages; the sample's own model), "llama3-2l" a 2-layer Llama with Llama-3's vocabulary
(V = 128256, H = 2048, random weights, seed 0). Data: the King James text of the real-input sample
(tools/make_sample.py, its input_ids), --batch windows of --seq + 1 tokens at evenly spread offsets, the
same batch every step (labels = the tokens; transformers shifts them). Training: fp32 weights, bf16
autocast (as Trainer(bf16=True)), AdamW lr 1e-4, --steps steps. Per step: CUDA-synchronized wall time (the
median over the steps after the first two is reported), the loss; per run: PyTorch's peak allocated
memory, and the device memory in use outside PyTorch's allocator after the steps (cudaMemGetInfo minus
torch.cuda.memory_reserved: the library's handle workspace), their sum as "peak device memory".
Each run is a fresh process from the same weights; "unpatched-rerun" repeats the unpatched run, so its
difference to the first is the run-to-run noise floor of the training step itself (cuBLAS and attention
kernels are not bitwise repeatable), the scale against which the patched runs' differences are read. Prints a markdown table; --json writes the rows and the
loss curves; --plot draws the curves.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ["unpatched", "unpatched-rerun", "fusedce", "liger"]


def tokens(sample, batch, seq):
    import torch
    from safetensors.torch import load_file

    ids = load_file(sample)["input_ids"].long()
    span = ids.numel() - (seq + 1)
    starts = [round(i * span / max(batch - 1, 1)) for i in range(batch)]
    return torch.stack([ids[s:s + seq] for s in starts])


def build(model_name, args):
    import torch
    import transformers

    if model_name == "smollm2":
        from safetensors.torch import load_model, save_model
        cache = os.path.join(args.cache, "smollm2-hf")
        if not os.path.isdir(cache):  # dequantized once (a GGUF-loaded model cannot be saved as such)
            m = transformers.AutoModelForCausalLM.from_pretrained(
                os.path.dirname(os.path.abspath(args.gguf)), gguf_file=os.path.basename(args.gguf),
                dtype=torch.float32)
            d = m.config.to_dict()
            d.pop("quantization_config", None)
            os.makedirs(cache + ".tmp", exist_ok=True)
            with open(os.path.join(cache + ".tmp", "config.json"), "w") as fh:
                json.dump(d, fh)
            save_model(m, os.path.join(cache + ".tmp", "model.safetensors"))
            os.rename(cache + ".tmp", cache)
        with open(os.path.join(cache, "config.json")) as fh:
            cfg = transformers.LlamaConfig.from_dict(json.load(fh))
        m = transformers.LlamaForCausalLM(cfg)
        load_model(m, os.path.join(cache, "model.safetensors"))
        return m
    cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=2,
                                   num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def child(args):
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bindings", "python"))
    model = build(args.model, args).to(args.device)
    cuda = args.device == "cuda"
    model.config._attn_implementation = "sdpa"
    if args.variant == "fusedce":
        import fusedce.transformers as fhf
        fhf.apply_fusedce(model)
    elif args.variant == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama(rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=False,
                                    swiglu=False, model=model)
    ids = tokens(args.sample, args.batch, args.seq).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        with torch.autocast(args.device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    free, total = torch.cuda.mem_get_info() if cuda else (0, 0)
    outside = (total - free) - torch.cuda.memory_reserved() if cuda else 0
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    print(json.dumps({"model": args.model, "variant": args.variant, "losses": losses,
                      "step_ms": statistics.median(times[2:]) * 1e3, "step_ms_all": [t * 1e3 for t in times],
                      "torch_peak_mib": peak / 2**20, "outside_torch_mib": outside / 2**20,
                      "peak_mib": (peak + outside) / 2**20, "device": torch.cuda.get_device_name() if cuda else "cpu",
                      "torch": torch.__version__}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf")
    ap.add_argument("--sample", required=True)
    ap.add_argument("--models", default="smollm2,llama3-2l")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cache", default="/tmp")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (no memory figures)")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    rows = []
    for m in args.models.split(","):
        for v in args.variants.split(","):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", m, "--variant", v,
                   "--sample", args.sample, "--batch", str(args.batch), "--seq", str(args.seq),
                   "--steps", str(args.steps), "--cache", args.cache, "--device", args.device] + (["--gguf", args.gguf] if args.gguf else [])
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                reason = (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1]
                rows.append({"model": m, "variant": v, "error": reason[-300:]})
                print(f"{m} {v}: n/a ({reason[-300:]})", file=sys.stderr)
                continue
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"| model | variant | step ms (median) | peak device MiB | PyTorch peak MiB | outside PyTorch MiB | "
          f"loss step 1 | loss step {args.steps} | max rel. diff to unpatched |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['variant']} | n/a: {r['error'][:120]} | | | | | | |")
            continue
        base = next((b for b in rows if b["model"] == r["model"] and b["variant"] == "unpatched" and "losses" in b), None)
        diff = "-" if base is None else f"{max(abs(a - b) / abs(b) for a, b in zip(r['losses'], base['losses'])):.1e}"
        print(f"| {r['model']} | {r['variant']} | {r['step_ms']:.1f} | {r['peak_mib']:.0f} | {r['torch_peak_mib']:.0f} | "
              f"{r['outside_torch_mib']:.0f} | {r['losses'][0]:.4f} | {r['losses'][-1]:.4f} | {diff} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"batch": args.batch, "seq": args.seq, "steps": args.steps, "rows": rows}, fh, indent=1)
    if args.plot:
        plot(rows, args.plot)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.4), squeeze=False)
    for ax, m in zip(axes[0], models):
        for r in rows:
            if r["model"] == m and "losses" in r:
                ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"{r['variant']} ({r['step_ms']:.0f} ms/step)",
                        ls={"unpatched": "-", "unpatched-rerun": "-.", "fusedce": "--", "liger": ":"}[r["variant"]])
        ax.set_title(m, fontsize=10)
        ax.set_xlabel("AdamW step")
        ax.set_ylabel("loss")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
