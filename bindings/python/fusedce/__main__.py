"""python3 -m fusedce: which libfusedce these bindings load, what it was built with, and a short self-check.

The self-check: one cross-entropy on the CPU (loss, lse and dlogits of an fp32 batch with an ignored row,
against a float64 numpy reference), and, when the CUDA backend is built, torch is importable and a GPU is
present, the same on the GPU (torch tensors, against the same reference). Exit status 0 when every check
that ran passed, 1 otherwise. `--no-check`: the build information alone (and whether fusedce.torch's eager fast path,
libfusedce_torch.so, is loaded).
"""
import argparse
import sys

import fusedce

_N, _V, _IGNORE = 8, 1000, -100


def _batch():
    import numpy as np

    rng = np.random.default_rng(20240611)
    logits = (rng.standard_normal((_N, _V)) * 4.0).astype(np.float32)
    targets = rng.integers(0, _V, _N).astype(np.int64)
    targets[3] = _IGNORE
    return logits, targets


def _reference(logits, targets):
    """Mean cross-entropy over the rows not ignored, per-row lse, and the gradient, in float64."""
    import numpy as np

    x = logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=1))
    valid = targets != _IGNORE
    rows = np.nonzero(valid)[0]
    loss = (lse[rows] - x[rows, targets[rows]]).mean()
    grad = np.exp(x - lse[:, None])
    grad[rows, targets[rows]] -= 1.0
    grad[~valid] = 0.0
    return loss, lse, grad / len(rows)


def _compare(name, loss, lse, dlogits, ref):
    import numpy as np

    ref_loss, ref_lse, ref_grad = ref
    errs = {
        "loss": abs(float(loss) - ref_loss) / abs(ref_loss),
        "lse": float(np.max(np.abs(np.asarray(lse, np.float64) - ref_lse) / np.abs(ref_lse))),
        "dlogits": float(np.max(np.abs(np.asarray(dlogits, np.float64) - ref_grad))),
    }
    tol = {"loss": 1e-5, "lse": 1e-5, "dlogits": 1e-6}
    ok = all(errs[k] <= tol[k] for k in errs)
    detail = ", ".join("%s %.1e" % (k, v) for k, v in errs.items())
    print("  %-5s cross-entropy [%d, %d] fp32 vs float64: %s (%s)" % (name, _N, _V, "ok" if ok else "FAILED", detail))
    return ok


def _cpu_check():
    logits, targets = _batch()
    out = fusedce.cross_entropy_fwd(logits, targets, reduction="mean", ignore_index=_IGNORE, dlogits=True)
    return _compare("cpu", out.loss, out.lse, out.dlogits, _reference(logits, targets))


def _cuda_check(info):
    """True/False, or None with the reason printed when it cannot run here."""
    if not info.cuda_backend:
        print("  cuda  skipped: this library is a CPU-only build")
        return None
    try:
        import torch
    except ImportError:
        print("  cuda  skipped: torch is not installed")
        return None
    except Exception as e:  # a broken torch install (missing shared libraries): not this library's failure
        print("  cuda  skipped: torch cannot be imported (%s: %s)" % (type(e).__name__, e))
        return None
    if not torch.cuda.is_available():
        print("  cuda  skipped: no GPU visible to torch")
        return None
    logits, targets = _batch()
    x = torch.from_numpy(logits).cuda()
    t = torch.from_numpy(targets).cuda()
    out = fusedce.cross_entropy_fwd(x, t, reduction="mean", ignore_index=_IGNORE, dlogits=True)
    return _compare("cuda", out.loss.item(), out.lse.cpu().numpy(), out.dlogits.cpu().numpy(),
                    _reference(logits, targets))


def _fast_path():
    """Whether fusedce.torch runs its eager calls through libfusedce_torch.so, and why not."""
    try:
        import torch  # noqa: F401
    except Exception as e:  # not installed, or broken: fusedce.torch is unavailable either way
        return "no (torch cannot be imported: %s)" % e
    from . import _eager

    return "yes (%s)" % _eager._path() if _eager.available else "no (%s)" % _eager.why


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m fusedce", description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-check", action="store_true", help="print the build information only")
    args = ap.parse_args(argv)

    info = fusedce.build_info()
    print(info)
    print("library: %s" % fusedce.library_path)
    print("bindings generated from header %s" % fusedce.HEADER_VERSION)
    for k, v in info.as_dict().items():
        print("  %-21s %r" % (k, v))
    print("fusedce.torch eager fast path: %s" % _fast_path())
    if args.no_check:
        return 0

    print("self-check:")
    results = []
    for name, check in (("cpu", _cpu_check), ("cuda", lambda: _cuda_check(info))):
        try:
            results.append(check())
        except Exception as e:  # a failure of the library or of its loading, reported as a failed check
            print("  %-5s FAILED: %s: %s" % (name, type(e).__name__, e))
            results.append(False)
    failed = results.count(False)
    print("self-check %s" % ("passed" if not failed else "FAILED (%d)" % failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
