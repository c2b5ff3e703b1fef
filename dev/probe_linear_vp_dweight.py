"""Probe: NCCL mode's linear cross-entropy dweight against the shard backward's and a float64 one (one rank,
torch.distributed NCCL with world size 1, CUDA). Prints, per shape, whether the bf16 dweight of
fce_linear_cross_entropy_fwd_vp with a bf16 dhidden equals the one with dweight alone and the backward's
(fce_linear_cross_entropy_bwd from the same lse), and each one's RMS / max error against float64 dweight
of the same bf16-rounded dlogits (docs/lab-notes.md, 2026-11-26, eighth session).

    FUSEDCE_LIBRARY=... PYTHONPATH=bindings/python python3 dev/probe_linear_vp_dweight.py
"""
import os

import torch
import torch.distributed as dist

os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
from fusedce import ops  # noqa: E402
import fusedce.torch as ft  # noqa: E402


def main():
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29512", rank=0, world_size=1)
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    dist.all_reduce(torch.zeros(1, device=dev))  # PyTorch creates the communicator lazily
    comm = ft._nccl_comm(None, dev)
    for n, hd, vl in [(64, 32, 29000), (64, 128, 29000), (300, 32, 29000)]:
        h = torch.randn(n, hd).to(torch.bfloat16).to(dev)
        w = (torch.randn(vl, hd) * 0.3).to(torch.bfloat16).to(dev)
        t = torch.randint(0, vl, (n,)).to(dev)
        t[1] = -100
        kw = dict(vocab_start=0, vocab_total=vl)
        both = ops.linear_cross_entropy_fwd_vp(h, w, t, comm, dhidden=True, dweight=True, **kw)
        dw_only = ops.linear_cross_entropy_fwd_vp(h, w, t, comm, dweight=True, **kw)
        bwd = ops.linear_cross_entropy_bwd(h, w, t, both.lse, dhidden=True, dweight=True, **kw)
        x = (h.double() @ w.double().T).to(torch.bfloat16).double()
        p = torch.exp(x - both.lse.double()[:, None])
        valid = t != -100
        y = torch.zeros_like(p)
        y[valid.nonzero().squeeze(1), t[valid]] = 1.0
        ref = ((p - y) * valid[:, None] / valid.sum()).to(torch.bfloat16).double().T @ h.double()
        errs = ["%s rms %.3e max %.3e" % (k, (d.double() - ref).pow(2).mean().sqrt(), (d.double() - ref).abs().max())
                for k, d in (("with bf16 dhidden", both.dweight), ("dweight only", dw_only.dweight),
                             ("backward", bwd.dweight))]
        print(n, hd, vl, "equal to dweight only:", torch.equal(both.dweight, dw_only.dweight), "to the backward:",
              torch.equal(both.dweight, bwd.dweight), "; ".join(errs))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
