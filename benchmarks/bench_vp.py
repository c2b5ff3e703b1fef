"""Vocabulary-parallel cross-entropy through PyTorch on W GPUs (one process each, NCCL), per rank: forward
+ backward of a [N, V/W] bf16 shard (strong scaling) and of [N, V] per rank (weak scaling), CUDA events
after an L2 flush, median of 20, for
  - fusedce NCCL mode (fusedce.torch.vocab_parallel_cross_entropy: one fce_cross_entropy_fwd_vp per rank),
  - fusedce with the records' all-gather through torch.distributed (nccl=False),
  - Liger-Kernel's LigerVocabParallelCEFunction (3 all-reduces, an fp32 buffer), when installed,
  - Megatron's algorithm in plain PyTorch (all-reduce MAX, SUM of sum-exp, SUM of the target logit),
and, on one GPU, fusedce's fused cross-entropy over the whole [N, V] for scale. With --linear H: linear
cross-entropy with the LM head [V, H] split by rows instead (strong scaling, forward + backward with dhidden
and dweight): fusedce NCCL mode (fusedce.torch.vocab_parallel_linear_cross_entropy), its all-gather path,
and Megatron's layers in plain PyTorch (a column-parallel linear whose input gradient is all-reduced, then
the algorithm above); the peak counts PyTorch's allocator and, for fusedce, the library's own workspace
(cudaMemGetInfo around the first call). With --kd: KD forward KL with student and teacher split by the same
columns (fusedce.torch.vocab_parallel_kd_loss in NCCL mode and through torch.distributed, Megatron's pattern
in plain PyTorch) and fusedce.torch.kd_loss over the whole V on one GPU. Prints a markdown table (rank 0)
and writes --json FILE.

    python3 benchmarks/bench_vp.py [--world 2] [--n 8192] [--v 128256] [--linear 4096 | --kd] [--json FILE]
"""
import argparse
import json
import os
import socket
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bindings", "python"))


def megatron_ce(x, t, group, vocab_start):
    """Megatron's vocab-parallel cross-entropy in plain PyTorch (fp32 softmax kept for the backward)."""
    import torch
    import torch.distributed as dist

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, t):
            x = x.float()
            m = x.max(dim=-1).values
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            x = x - m.unsqueeze(-1)
            local = t - vocab_start
            own = (local >= 0) & (local < x.shape[-1])
            idx = local.clamp(0, x.shape[-1] - 1)
            zt = x.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * own
            e = x.exp()
            s = e.sum(dim=-1)
            dist.all_reduce(zt, group=group)
            dist.all_reduce(s, group=group)
            e.div_(s.unsqueeze(-1))
            ctx.save_for_backward(e, idx, own)
            return s.log() - zt

        @staticmethod
        def backward(ctx, g):
            p, idx, own = ctx.saved_tensors
            p.scatter_add_(-1, idx.unsqueeze(-1), -own.float().unsqueeze(-1))
            return (p * g.unsqueeze(-1)).to(torch.bfloat16), None

    return F.apply(x, t)


def timed_peak(dev, timed, fn):
    """(median ms of fn, the peak MiB of PyTorch's allocator beyond what was allocated before)."""
    import torch
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    ms = timed(fn)
    return ms, (torch.cuda.max_memory_allocated(dev) - before) / 2**20


def linear_rows(rank, world, args, dev, g, timed):
    """Linear cross-entropy, the head split by rows (strong scaling), forward + backward (dhidden, dweight)."""
    import torch
    import torch.distributed as dist

    import fusedce.torch as ft
    n, v, hd = args.n, args.v, args.linear
    vl = -(-v // world)
    start = rank * vl
    hidden = (torch.randn(n, hd, device=dev, generator=g)).to(torch.bfloat16)
    weight = (torch.randn(vl, hd, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), device=dev, generator=torch.Generator(device=dev).manual_seed(2))

    class CopyToTP(torch.autograd.Function):  # Megatron's copy_to_tensor_model_parallel_region
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, gr):
            gr = gr.contiguous()
            dist.all_reduce(gr)
            return gr

    def step(kind):
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        if kind.startswith("fusedce"):
            loss = ft.vocab_parallel_linear_cross_entropy(h, w, t, vocab_start=start, vocab_total=vl * world,
                                                          nccl=kind == "fusedce NCCL mode")
        else:
            loss = megatron_ce(CopyToTP.apply(h) @ w.T, t, None, start).mean()
        loss.backward()

    out = []
    for kind in ("fusedce NCCL mode", "fusedce, all-gather by torch.distributed", "Megatron layers, PyTorch"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        free0 = torch.cuda.mem_get_info(dev)[0]
        step(kind)
        torch.cuda.synchronize()
        held = max(0, free0 - torch.cuda.mem_get_info(dev)[0] - (torch.cuda.memory_reserved(dev) - before)) \
            if kind.startswith("fusedce") else 0
        ms = timed(lambda: step(kind))
        peak = (torch.cuda.max_memory_allocated(dev) - before) / 2**20
        out.append(dict(rank=rank, scaling="linear strong, H=%d" % hd, impl=kind, n=n, v_local=vl, v=vl * world, ms=ms,
                        peak_mib=peak, library_mib=held / 2**20))
    return out


def megatron_kd(xs, xt, group):
    """Forward KL(teacher || student) of shards in plain PyTorch, Megatron's pattern: all-reduce MAX of each
    side's rows, then SUM of their sum-exp and of the KL's partial sums; the fp32 probabilities kept for the
    backward (q - p)."""
    import torch
    import torch.distributed as dist

    def log_softmax(x):
        x = x.float()
        m = x.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        x = x - m.unsqueeze(-1)
        s = x.exp().sum(dim=-1)
        dist.all_reduce(s, group=group)
        return x - s.log().unsqueeze(-1)

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, t):
            lq, lp = log_softmax(x), log_softmax(t)
            p = lp.exp()
            kl = (p * (lp - lq)).sum(dim=-1)
            dist.all_reduce(kl, group=group)
            ctx.save_for_backward(lq.exp_(), p)
            return kl.mean()

        @staticmethod
        def backward(ctx, g):
            q, p = ctx.saved_tensors
            return ((q - p) * (g / q.shape[0])).to(torch.bfloat16), None

    return F.apply(xs, xt)


def kd_rows(rank, world, args, dev, g, timed):
    """KD forward KL, student and teacher split by the same columns (strong scaling), forward + backward."""
    import torch

    import fusedce.torch as ft
    n, v = args.n, args.v
    vl = -(-v // world)
    start = rank * vl
    base = (torch.randn(n, vl, device=dev, generator=g) * 2).to(torch.bfloat16)
    teacher = (torch.randn(n, vl, device=dev, generator=g) * 2).to(torch.bfloat16)

    def step(kind):
        x = base.clone().requires_grad_()
        if kind.startswith("fusedce"):
            loss = ft.vocab_parallel_kd_loss(x, teacher, vocab_start=start, vocab_total=vl * world,
                                             nccl=kind == "fusedce NCCL mode")
        else:
            loss = megatron_kd(x, teacher, None)
        loss.backward()

    out = []
    for kind in ("fusedce NCCL mode", "fusedce, all-gather by torch.distributed", "Megatron algorithm, PyTorch"):
        ms, peak = timed_peak(dev, timed, lambda: step(kind))
        out.append(dict(rank=rank, scaling="KD forward KL, strong", impl=kind, n=n, v_local=vl, v=vl * world, ms=ms,
                        peak_mib=peak))
    x1 = (torch.randn(n, v, device=dev, generator=g) * 2).to(torch.bfloat16)
    t1 = (torch.randn(n, v, device=dev, generator=g) * 2).to(torch.bfloat16)

    def one():
        x = x1.clone().requires_grad_()
        ft.kd_loss(x, t1).backward()

    out.append(dict(rank=rank, scaling="KD forward KL, one GPU", impl="fusedce.torch.kd_loss", n=n, v_local=v, v=v,
                    ms=timed(one), peak_mib=None))
    return out


def rank_main(rank, world, port, args, q):
    import torch
    import torch.distributed as dist

    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[k] = v
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world)
    import fusedce.torch as ft
    try:
        from liger_kernel.ops.vocab_parallel_cross_entropy import LigerVocabParallelCEFunction
    except ImportError:
        LigerVocabParallelCEFunction = None
    dev = torch.device("cuda", rank)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    dist.barrier()

    def timed(fn, reps=20):
        fn()
        fn()
        ms = []
        for _ in range(reps):
            flush.zero_()
            dist.barrier()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
        return statistics.median(ms)

    rows = []
    n, v = args.n, args.v
    g = torch.Generator(device=dev).manual_seed(1)
    if args.linear or args.kd:
        rows += (linear_rows if args.linear else kd_rows)(rank, world, args, dev, g, timed)
        q.put(rows)
        dist.barrier()
        dist.destroy_process_group()
        return
    for scaling in ("strong", "weak"):
        vl = -(-v // world) if scaling == "strong" else v
        vt = vl * world
        base = (torch.randn(n, vl, device=dev, generator=g) * 2).to(torch.bfloat16)
        t = torch.randint(0, vt, (n,), device=dev, generator=torch.Generator(device=dev).manual_seed(2))
        start = rank * vl
        mem = {}

        def step(kind):
            x = base.clone().requires_grad_()
            if kind == "fusedce NCCL mode":
                loss = ft.vocab_parallel_cross_entropy(x, t, vocab_start=start, vocab_total=vt)
            elif kind == "fusedce, all-gather by torch.distributed":
                loss = ft.vocab_parallel_cross_entropy(x, t, vocab_start=start, vocab_total=vt, nccl=False)
            elif kind == "Liger-Kernel":
                loss = LigerVocabParallelCEFunction.apply(x.view(n, 1, vl), t.view(n, 1), dist.group.WORLD, -100, 0.0,
                                                          "pytorch", "global").mean()
            else:
                loss = megatron_ce(x, t, None, start).mean()
            loss.backward()

        kinds = ["fusedce NCCL mode", "fusedce, all-gather by torch.distributed", "Megatron algorithm, PyTorch"]
        if LigerVocabParallelCEFunction is not None:
            kinds.insert(2, "Liger-Kernel")
        for kind in kinds:
            ms, peak = timed_peak(dev, timed, lambda: step(kind))
            rows.append(dict(rank=rank, scaling=scaling, impl=kind, n=n, v_local=vl, v=vt, ms=ms, peak_mib=peak))
    # one GPU, the whole vocabulary, for scale
    x1 = (torch.randn(n, v, device=dev, generator=g) * 2).to(torch.bfloat16)
    t1 = torch.randint(0, v, (n,), device=dev)

    def one():
        x = x1.clone().requires_grad_()
        ft.cross_entropy(x, t1).backward()

    rows.append(dict(rank=rank, scaling="one GPU", impl="fusedce.torch.cross_entropy", n=n, v_local=v, v=v,
                     ms=timed(one), peak_mib=None))
    q.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--v", type=int, default=128256)
    ap.add_argument("--linear", type=int, default=0, help="H: linear cross-entropy instead")
    ap.add_argument("--kd", action="store_true", help="KD forward KL (student and teacher sharded) instead")
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args.world, port, args, q)) for r in range(args.world)]
    for p in procs:
        p.start()
    rows = [r for _ in procs for r in q.get(timeout=900)]
    for p in procs:
        p.join()
    rows.sort(key=lambda r: (r["scaling"], r["impl"], r["rank"]))
    print("device: %s x %d, torch %s" % (torch.cuda.get_device_name(0), args.world, torch.__version__))
    print("| scaling | implementation | rank | N | V local | V | fwd+bwd ms | peak extra MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        peak = "-" if r["peak_mib"] is None else "%.0f" % r["peak_mib"]
        if r.get("library_mib"):
            peak += " + %.0f (library)" % r["library_mib"]
        print("| %s | %s | %d | %d | %d | %d | %.3f | %s |" % (r["scaling"], r["impl"], r["rank"], r["n"], r["v_local"],
                                                          r["v"], r["ms"], peak))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(program="bench_vp", device=torch.cuda.get_device_name(0), world=args.world, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
