"""Bitwise fingerprints of every CUDA path of every op: one line per (forced path, case) with a hash of all
the outputs. Run it with two builds of the library (FUSEDCE_LIBRARY) and diff the outputs to see which
paths a change kept bitwise (issue 26's constraint: bits kept wherever the order of operations is).

    FUSEDCE_LIBRARY=old/libfusedce.so.0 python3 dev/bitwise_paths.py > old.txt
    FUSEDCE_LIBRARY=new/libfusedce.so.0 python3 dev/bitwise_paths.py > new.txt
    diff old.txt new.txt
"""
import hashlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bindings", "python"))
import torch  # noqa: E402

from fusedce import ops  # noqa: E402

DEV = os.environ.get("BITWISE_DEVICE", "cuda")  # "cpu" to try the script without a GPU
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def forced_paths():
    seen = []
    with open(os.path.join(ROOT, "tests", "gpu", "forced_paths.txt")) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#") and line.split()[0] not in seen:
                seen.append(line.split()[0])
    return ["default"] + seen


def digest(*ts):
    h = hashlib.sha1()
    for t in ts:
        if t is not None:
            h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() if t.dim() else
                     t.detach().reshape(1).cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def logits(n, v, dtype, seed, peaked=False, special=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(n, v, device=DEV, generator=g) * (8.0 if peaked else 2.0)
    if special and n > 2:
        x[1, v // 3] = float("nan")
        x[2, :] = float("-inf")
        x[2, 5] = 1.0
    return x.to(dtype)


SHAPES = [(1, 128256), (3, 50021), (16, 151936), (64, 32003), (257, 129920), (1024, 32000)]
if DEV == "cpu":
    SHAPES = [(1, 1000), (5, 3001)]
DTYPES = [torch.bfloat16, torch.float32]


def cases():
    for n, v in SHAPES:
        for dt in DTYPES:
            for peaked in (False, True):
                yield n, v, dt, peaked


def run_ce(tag):
    for n, v, dt, peaked in cases():
        x = logits(n, v, dt, n + v, peaked, special=not peaked)
        t = torch.randint(0, v, (n,), device=DEV, generator=torch.Generator(device=DEV).manual_seed(v))
        t[0] = -100
        for opts in (dict(), dict(label_smoothing=0.1, z_loss_scale=1e-4, softcap=30.0)):
            o = ops.cross_entropy_fwd(x, t, reduction="mean", lse=True, z_loss=True, argmax=True, entropy=True,
                                      dlogits=True, **opts)
            o2 = ops.cross_entropy_fwd(x, t, reduction="none", lse=True, **opts)
            b = ops.cross_entropy_bwd(x, t, o2.lse, **opts)
            print(tag, "ce", n, v, dt, peaked, sorted(opts), digest(o.loss, o.lse, o.z_loss, o.argmax, o.entropy,
                                                                    o.dlogits, o2.loss, b))


def run_lse(tag):
    for n, v, dt, peaked in cases():
        x = logits(n, v, dt, 7 * n + v, peaked, special=not peaked)
        print(tag, "lse", n, v, dt, peaked, digest(ops.logsumexp(x), ops.logsumexp(x, scale=0.5)))


def run_softmax(tag):
    for n, v, dt, peaked in cases():
        x = logits(n, v, dt, 11 * n + v, peaked, special=not peaked)
        temps = torch.linspace(0.6, 1.5, n, device=DEV)
        a = ops.temp_softmax(x, temperature=0.7, probs=True, logprobs=True)
        b = ops.temp_softmax(x, temperatures=temps, probs=True, logprobs=False, dtype=None)
        print(tag, "softmax", n, v, dt, peaked, digest(a.probs, a.logprobs, b.probs))


def run_kd(tag):
    for n, v, dt, peaked in cases():
        s = logits(n, v, dt, 13 * n + v, peaked)
        te = logits(n, v, dt, 17 * n + v, peaked)
        for div in ("forward_kl", "reverse_kl", "jsd"):
            a = ops.kd_loss(s, te, divergence=div, temperature=2.0, reduction="none", dstudent=True)
            b = ops.kd_loss(s, te, divergence=div, reduction="mean")
            print(tag, "kd", div, n, v, dt, peaked, digest(a.loss, a.dstudent, b.loss))
        k = 64
        tv, ti = torch.topk(te.float().log_softmax(-1), k, dim=-1)
        c = ops.kd_loss(s, topk_ids=ti, topk_logprobs=tv.contiguous(), reduction="none", dstudent=True)
        print(tag, "kd topk", n, v, dt, peaked, digest(c.loss, c.dstudent))


def run_linear(tag):
    g = torch.Generator(device=DEV).manual_seed(5)
    for n, h, v in ((300, 64, 3001), (1024, 256, 32003)):
        hid = torch.randn(n, h, device=DEV, generator=g).to(torch.bfloat16)
        w = (torch.randn(v, h, device=DEV, generator=g) * 0.05).to(torch.bfloat16)
        t = torch.randint(0, v, (n,), device=DEV, generator=g)
        o = ops.linear_cross_entropy_fwd(hid, w, t, lse=True, dhidden=True, dweight=True)
        print(tag, "linear_ce", n, h, v, digest(o.loss, o.lse, o.dhidden, o.dweight))


def run_vp(tag):
    for n, v, dt, peaked in cases():
        x = logits(n, v, dt, 19 * n + v, peaked, special=not peaked)
        t = torch.randint(0, v, (n,), device=DEV, generator=torch.Generator(device=DEV).manual_seed(v + 1))
        cut = v // 3 + 1
        recs = [ops.cross_entropy_partial(x[:, a:b].contiguous(), t, vocab_start=a, vocab_total=v)
                for a, b in ((0, cut), (cut, v))]
        o = ops.cross_entropy_combine(torch.stack(recs), t, vocab_total=v, reduction="none", lse=True, argmax=True)
        print(tag, "vp", n, v, dt, peaked, digest(*recs, o.loss, o.lse, o.argmax))


RUNS = {"ce": [run_ce, run_vp], "lse": [run_lse], "softmax": [run_softmax], "kd": [run_kd], "rows": [run_softmax, run_kd]}

if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = False
    for p in forced_paths():
        if p == "default":
            os.environ.pop("FCE_FORCE_PATH", None)
            fns = [run_ce, run_vp, run_lse, run_softmax, run_kd, run_linear]
        else:
            os.environ["FCE_FORCE_PATH"] = p
            fns = RUNS[p.split(":")[0]]
        for fn in fns:
            fn(p)
        sys.stdout.flush()
