#!/usr/bin/env python3
"""libfusedce through its PyTorch binding against PyTorch eager, torch.compile and Liger-Kernel.

    python3 benchmarks/bench_torch.py                       # defaults: 8192 tokens, Llama-3 vocab, bf16
    python3 benchmarks/bench_torch.py --ops ce,linear_ce --tokens 16384 --vocab 49152 --hidden 576
    python3 benchmarks/bench_torch.py --ops linear_ce --real data/smollm2_kjv_sample.safetensors  # real data
    FUSEDCE_LIBRARY=build/libfusedce.so python3 benchmarks/bench_torch.py --json out.json

For each op (cross-entropy on [N, V] logits, linear cross-entropy from [N, H] hidden states and a [V, H]
head, forward-KL distillation on [N, V] student/teacher logits) and each implementation, it times forward +
backward (median of --iters runs after --warmup, CUDA events), reads the extra memory (PyTorch's peak above
what the inputs hold, plus device memory held outside PyTorch's allocator after the call, from
cudaMemGetInfo: the library's handles), and checks the loss and gradient against PyTorch eager in fp32.
Next to fusedce.torch's autograd paths it times the library's fused C calls through the array API
(fusedce.ops: one call forming the gradient, no autograd), the reference for "the C path"; "no grad" rows
time the forward under torch.no_grad().
--host times the host cost of one call at decode shapes instead (enqueue only: the median of per-call
wall times over calls that do not wait for the GPU), for fusedce.torch (its eager fast path, and the cffi
path it takes without libfusedce_torch.so), the array API and the PyTorch op each replaces, and the softmax from Python with the L2 flushed (triton.testing.do_bench). An implementation that is
missing (Liger not installed) or fails (e.g. the library's CUDA backend reporting
FCE_STATUS_NOT_IMPLEMENTED, or an out-of-memory) is reported as n/a with the reason; nothing is skipped
silently. Prints a markdown table; --json also writes the rows.

--real takes linear CE's inputs from the sample file (tools/make_sample.py): SmolLM2's final hidden states
and targets, tiled to --tokens rows, and its LM head (V and H from the file). Cut Cross-Entropy (when
importable) joins linear CE: its gradient skips blocks whose softmax is small, so its time depends on the
data, which is why real hidden states are measured next to random ones.
"""
import argparse
import json
import os
import statistics
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bindings", "python"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ---- implementations: each returns (loss, [grads]) for fresh leaf inputs ---------------------------

def read_safetensors(path, names):
    """The named tensors of a safetensors file (u64 header length, JSON header, little-endian data)."""
    kinds = {"F32": torch.float32, "BF16": torch.bfloat16, "I32": torch.int32}
    with open(path, "rb") as fh:
        blob = fh.read()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    out = {}
    for name in names:
        t = header[name]
        b, e = t["data_offsets"]
        out[name] = torch.frombuffer(bytearray(blob[8 + n + b:8 + n + e]), dtype=kinds[t["dtype"]]).reshape(t["shape"])
    return out


def real_linear_ce(a, dtype, device):
    t = read_safetensors(a.real, ["hidden", "lm_head", "targets"])
    reps = -(-a.tokens // t["hidden"].shape[0])
    hid = t["hidden"].repeat(reps, 1)[: a.tokens].to(device=device, dtype=dtype).contiguous()
    tgt = t["targets"].repeat(reps)[: a.tokens].to(device=device, dtype=torch.int64)
    w = t["lm_head"].to(device=device, dtype=dtype).contiguous()
    return dict(hidden=hid, weight=w, target=tgt)


def make_inputs(op, a, dtype, device, seed=0):
    if op == "linear_ce" and a.real:
        return real_linear_ce(a, dtype, device)
    g = torch.Generator(device=device).manual_seed(seed)
    n, v, h = a.tokens, a.vocab, a.hidden
    tgt = torch.randint(0, v, (n,), device=device, generator=g)
    tgt[: n // 16] = -100  # some ignored (padding) tokens
    if op == "ce":
        x = (torch.randn(n, v, device=device, generator=g, dtype=torch.float32) * 2).to(dtype)
        return dict(logits=x, target=tgt)
    if op == "linear_ce":
        hid = torch.randn(n, h, device=device, generator=g, dtype=torch.float32).to(dtype)
        w = (torch.randn(v, h, device=device, generator=g, dtype=torch.float32) * h ** -0.5).to(dtype)
        return dict(hidden=hid, weight=w, target=tgt)
    if op == "kd":
        s = (torch.randn(n, v, device=device, generator=g, dtype=torch.float32) * 2).to(dtype)
        t = (torch.randn(n, v, device=device, generator=g, dtype=torch.float32) * 2).to(dtype)
        return dict(student=s, teacher=t, target=tgt)
    raise ValueError(op)


def leaves(op, inp):
    """The inputs that get gradients, as fresh leaves."""
    names = {"ce": ["logits"], "linear_ce": ["hidden", "weight"], "kd": ["student"]}[op]
    out = dict(inp)
    for k in names:
        out[k] = inp[k].detach().clone().requires_grad_(True)
    return out, names


def eager(op, a):
    if op == "ce":
        return lambda d: F.cross_entropy(d["logits"], d["target"])
    if op == "linear_ce":
        return lambda d: F.cross_entropy(F.linear(d["hidden"], d["weight"]).float(), d["target"])
    T = a.temperature

    def kd(d):
        mask = (d["target"] != -100).float()
        lq = F.log_softmax(d["student"].float() / T, -1)
        lp = F.log_softmax(d["teacher"].float() / T, -1)
        per = (lp.exp() * (lp - lq)).sum(-1) * mask
        return per.sum() / mask.sum()
    return kd


def compiled(op, a):
    return torch.compile(eager(op, a), dynamic=False)


def fusedce_impl(op, a):
    import fusedce.torch as ft

    if op == "ce":
        return lambda d: ft.cross_entropy(d["logits"], d["target"])
    if op == "linear_ce":
        return lambda d: ft.linear_cross_entropy(d["hidden"], d["weight"], d["target"])
    return lambda d: ft.kd_loss(d["student"], d["teacher"], d["target"], temperature=a.temperature)


def liger(op, a):
    # The ops' autograd functions directly (liger_kernel.ops.<op>), so a peers folder whose ops/__init__.py is
    # empty (as ../shared/tools/peers_bench.py wants it) works too.
    if op == "ce":
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

        return lambda d: LigerCrossEntropyFunction.apply(d["logits"], d["target"], None, -100, 0.0, 0.0, "mean")[0]
    if op == "linear_ce":
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        return lambda d: LigerFusedLinearCrossEntropyFunction.apply(d["hidden"], d["weight"], d["target"])[0]
    from liger_kernel.ops.jsd import LigerJSDFunction  # beta = 0 is forward KL(teacher || student)

    T = a.temperature
    return lambda d: LigerJSDFunction.apply(F.log_softmax(d["student"].float() / T, -1),
                                            F.log_softmax(d["teacher"].float() / T, -1), d["target"], 0.0, -100)


def cce(op, a):
    if op != "linear_ce":
        raise ImportError("Cut Cross-Entropy has linear cross-entropy only")
    from cut_cross_entropy import linear_cross_entropy

    return lambda d: linear_cross_entropy(d["hidden"], d["weight"], d["target"])


def fusedce_inplace(op, a):
    import fusedce.torch as ft

    if op != "ce":
        raise ImportError("the in-place backward is cross-entropy's")
    # The logits are a fresh copy each call (leaves()), so they may be overwritten; their gradient is their
    # own memory.
    return lambda d: ft.cross_entropy(d["logits"], d["target"], inplace_backward=True)


def _no_backward(fn):
    fn.no_backward = True
    return fn


def c_call(op, a):
    """The library's fused call through the array API: loss and gradient in one call, no autograd. Its
    gradient lands in the leaf's .grad (for the comparison)."""
    import fusedce

    if op == "ce":
        def ce(d):
            x = d["logits"].detach()
            out = fusedce.cross_entropy_fwd(x, d["target"], lse=False, dlogits=x)  # in place
            d["logits"].grad = x
            return out.loss
        return _no_backward(ce)
    if op == "kd":
        def kd(d):
            out = fusedce.kd_loss(d["student"].detach(), d["teacher"], targets=d["target"], temperature=a.temperature,
                                  dstudent=True)
            d["student"].grad = out.dstudent
            return out.loss
        return _no_backward(kd)

    def lce(d):
        out = fusedce.linear_cross_entropy_fwd(d["hidden"].detach(), d["weight"].detach(), d["target"], lse=False,
                                               dhidden=True, dweight=True)
        d["hidden"].grad, d["weight"].grad = out.dhidden, out.dweight
        return out.loss
    return _no_backward(lce)


def c_fwd_bwd(op, a):
    """Cross-entropy's forward then backward from the saved lse: what the default (logits-preserving)
    autograd path calls."""
    import fusedce

    if op != "ce":
        raise ImportError("the separate backward is cross-entropy's")

    def ce(d):
        x = d["logits"].detach()
        out = fusedce.cross_entropy_fwd(x, d["target"])
        d["logits"].grad = fusedce.cross_entropy_bwd(x, d["target"], out.lse)
        return out.loss
    return _no_backward(ce)


def no_grad(factory):
    def make(op, a):
        fn = factory(op, a)

        def run(d):
            with torch.no_grad():
                return fn({k: v.detach() for k, v in d.items()})
        return _no_backward(run)
    return make


IMPLS = [("torch eager", eager), ("torch.compile", compiled), ("liger-kernel", liger), ("cut-cross-entropy", cce),
         ("fusedce", fusedce_impl), ("fusedce in-place", fusedce_inplace), ("C call (fused)", c_call),
         ("C fwd + bwd", c_fwd_bwd), ("fusedce no grad", no_grad(fusedce_impl)),
         ("torch.compile no grad", no_grad(compiled))]


# ---- measurement ----------------------------------------------------------------------------------

def run_once(fn, op, inp):
    d, names = leaves(op, inp)
    loss = fn(d)
    if not getattr(fn, "no_backward", False):
        loss.backward()
    return loss.detach().float(), [d[k].grad for k in names]


def outside_torch():
    """Device bytes in use that PyTorch's allocator does not hold (cudaMemGetInfo): libraries' own memory."""
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def bench(fn, op, inp, a):
    for _ in range(a.warmup):
        run_once(fn, op, inp)
    torch.cuda.synchronize()
    times = []
    for _ in range(a.iters):
        d, names = leaves(op, inp)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = fn(d)
        if not getattr(fn, "no_backward", False):
            loss.backward()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        del d, loss
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run_once(fn, op, inp)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return statistics.median(times), peak, max(0, outside_torch() - a.outside0)


def compare(ref, got):
    (lr, gr), (lg, gg) = ref, got
    loss_err = abs(float(lr) - float(lg))
    if any(b is None for b in gg):  # a forward-only row
        return loss_err, None
    grad_err = max(float((a.float() - b.float()).abs().max()) for a, b in zip(gr, gg))
    return loss_err, grad_err


# ---- host cost per call -----------------------------------------------------------------------------

def host_us(fns, rounds=10, calls=40, warmup=50):
    """Median host wall time of one call (no synchronization inside a timed block: enqueue only), in us, for
    each of fns, a list of (setup, fn) where setup() -> restore() is run around each block of calls outside
    the timing (choosing a path). The implementations take turns in blocks of `calls`, `rounds` times, so
    that the machine's drift over the run falls on all alike. The GPU work of these decode shapes is shorter
    than the host's, so the launch queue never fills."""
    import time

    ts = [[] for _ in fns]
    for setup, fn in fns:
        restore = setup()
        for _ in range(warmup):
            fn()
        restore()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for k, (setup, fn) in enumerate(fns):
            restore = setup()
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                ts[k].append(time.perf_counter() - t0)
            restore()
            torch.cuda.synchronize()
    return [statistics.median(t) * 1e6 for t in ts]


def host_overheads(a):
    import fusedce
    import fusedce.torch as ft

    dev = torch.cuda.get_device_name()
    print("# bench_torch.py --host on %s, torch %s: host us per call (enqueue only, median of 400, the implementations taking turns in blocks of 40)\n"
          % (dev, torch.__version__))
    from fusedce import _eager

    print("fusedce.torch eager fast path (libfusedce_torch.so): %s\n"
          % ("loaded" if _eager.available else "not loaded: %s" % _eager.why))
    print("| call | shape | fusedce.torch | fusedce.torch, cffi path | array API (fusedce.ops) | PyTorch op it replaces "
          "| PyTorch us |")
    print("|---|---|---|---|---|---|---|")

    def as_is():
        return lambda: None

    from fusedce import _fast

    def cffi_path():
        saved = ft._EAGER, _fast._EAGER
        ft._EAGER = _fast._EAGER = False

        def restore():
            ft._EAGER, _fast._EAGER = saved
        return restore

    rows = []
    for n, v in ((1, 128256), (16, 151936)):
        x = (torch.randn(n, v, device="cuda") * 3).to(torch.bfloat16)
        t = torch.randint(0, v, (n,), device="cuda")
        temps = torch.full((n,), 0.7, device="cuda")
        lse_out = torch.empty(n, device="cuda")
        p_out = torch.empty(n, v, device="cuda")
        xg = x.detach().clone().requires_grad_()
        cases = [
            ("cross_entropy (no grad)", lambda: ft.cross_entropy(x, t),
             lambda: fusedce.cross_entropy_fwd(x, t, lse=False), "F.cross_entropy", lambda: F.cross_entropy(x, t)),
            ("cross_entropy (forward, logits require grad)", lambda: ft.cross_entropy(xg, t), None,
             "F.cross_entropy", lambda: F.cross_entropy(xg, t)),
            ("logsumexp", lambda: ft.logsumexp(x), lambda: fusedce.logsumexp(x, out=lse_out), "torch.logsumexp",
             lambda: torch.logsumexp(x, -1)),
            ("temp_softmax, T per row, fp32 out", lambda: ft.softmax(x, temperatures=temps),
             lambda: fusedce.temp_softmax(x, temperatures=temps, probs=p_out), "softmax(x.float() / T)",
             lambda: torch.softmax(x.float() / temps[:, None], -1)),
        ]
        for name, f_t, f_a, ref_name, f_r in cases:
            fns = [(as_is, f_r), (cffi_path, f_t)] + ([(as_is, f_a)] if f_a else [])
            if _eager.available:
                fns.append((as_is, f_t))
            us = host_us(fns)
            ref_us, cffi = us[:2]
            array_us = us[2] if f_a else None
            fast = us[-1] if _eager.available else None
            r = dict(call=name, shape="%dx%d" % (n, v), torch_us=fast, torch_cffi_us=cffi, array_us=array_us,
                     ref=ref_name, ref_us=ref_us)
            rows.append(r)
            f1 = lambda u: "%.1f" % u if u is not None else "n/a"  # noqa: E731
            print("| %s | %s | %s | %s | %s | %s | %.1f |" % (name, r["shape"], f1(fast), f1(cffi),
                                                               f1(array_us) if f_a else "-", ref_name,
                                                               r["ref_us"]), flush=True)
    try:
        from triton.testing import do_bench

        x = (torch.randn(16, 151936, device="cuda") * 3).to(torch.bfloat16)
        temps = torch.full((16,), 0.7, device="cuda")
        ours = do_bench(lambda: ft.softmax(x, temperatures=temps), return_mode="median") * 1e3
        theirs = do_bench(lambda: torch.softmax(x.float() / temps[:, None], -1), return_mode="median") * 1e3
        print("\nsoftmax 16x151936 from Python, L2 flushed (do_bench median): fusedce.torch %.1f us, torch eager %.1f us"
              % (ours, theirs))
        rows.append(dict(call="softmax from Python, L2 flushed", shape="16x151936", torch_us=ours, ref_us=theirs))
    except ImportError as e:
        print("\n(no triton: %s)" % e)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(device=dev, torch=torch.__version__, host=rows), fh, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="ce,linear_ce,kd")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--impls", default=",".join(n for n, _ in IMPLS))
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--real", help="linear CE on this sample file's hidden states, targets and LM head")
    ap.add_argument("--host", action="store_true", help="host cost per call at decode shapes instead")
    a = ap.parse_args()
    if a.real:  # the random-data rows use the same shape
        a.vocab, a.hidden = read_safetensors(a.real, ["lm_head"])["lm_head"].shape
    if not torch.cuda.is_available():
        sys.exit("bench_torch.py: needs a CUDA device (torch.cuda.is_available() is False)")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference is true fp32
    dtype = DTYPES[a.dtype]
    wanted = set(a.impls.split(","))
    rows = []
    dev = torch.cuda.get_device_name()
    print("# bench_torch.py on %s, torch %s, %s, N=%d V=%d H=%d%s\n" % (dev, torch.__version__, a.dtype, a.tokens,
                                                                         a.vocab, a.hidden,
                                                                         ", linear CE on " + a.real if a.real else ""))
    if a.host:
        return host_overheads(a)
    a.outside0 = outside_torch()
    print("| op | implementation | fwd+bwd ms | PyTorch peak extra MiB | held outside PyTorch MiB | loss err vs eager fp32 "
          "| grad max err | note |")
    print("|---|---|---|---|---|---|---|---|")
    for op in a.ops.split(","):
        inp = make_inputs(op, a, dtype, "cuda")
        ref_inp = {k: (v.float() if v.is_floating_point() else v) for k, v in inp.items()}
        ref = run_once(eager(op, a), op, ref_inp)
        for name, factory in IMPLS:
            if name not in wanted:
                continue
            row = dict(op=op, impl=name, ms=None, peak_mib=None, outside_mib=None, loss_err=None, grad_err=None,
                       note="")
            try:
                fn = factory(op, a)
                got = run_once(fn, op, inp)
                row["loss_err"], row["grad_err"] = compare(ref, got)
                del got
                ms, peak, held = bench(fn, op, inp, a)
                row["ms"], row["peak_mib"], row["outside_mib"] = ms, peak / 2 ** 20, held / 2 ** 20
            except ImportError as e:
                row["note"] = "n/a: not importable (%s)" % e
            except Exception as e:  # noqa: BLE001 - report every failure as a row, keep going
                row["note"] = "n/a: %s: %s" % (type(e).__name__, str(e).splitlines()[0][:160] if str(e) else "")
                if os.environ.get("BENCH_TRACEBACK"):
                    traceback.print_exc()
            torch.cuda.empty_cache()
            rows.append(row)

            def f(x, fmt):
                return fmt % x if x is not None else "-"

            print("| %s | %s | %s | %s | %s | %s | %s | %s |" % (
                op, name, f(row["ms"], "%.3f"), f(row["peak_mib"], "%.0f"), f(row["outside_mib"], "%.0f"),
                f(row["loss_err"], "%.2e"), f(row["grad_err"], "%.2e"), row["note"]), flush=True)
        del inp, ref_inp, ref
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(device=dev, torch=torch.__version__, args=vars(a), rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
