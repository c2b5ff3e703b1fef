"""The eager fast path of fusedce.torch: libfusedce_torch.so (bindings/python/src/torch_eager.cpp), C++
against libtorch, defining the ops `fusedce_eager::*` (cross_entropy with its autograd, and cross_entropy_loss,
its common call: the loss alone; logsumexp and temp_softmax without autograd, and their _out forms
for the array API's preallocated outputs). A call costs a bound OpOverload (about 1 us from Python) and the library's own
time; the cffi path of `_fast` costs several microseconds more per tensor and a Python autograd.Function.

Found as FUSEDCE_TORCH_EAGER (a path; "0" turns the fast path off), else beside the loaded libfusedce
(a wheel's package folder; the in-tree build's bindings/python/src). It is loaded only under the torch
version it was built against (libfusedce_torch.torch beside it): a C++ library against another libtorch is
undefined behaviour, so any other version gets the cffi path. The library it calls is the one `_lib` loaded
(its function addresses are handed over), FUSEDCE_LIBRARY included.

`available`: whether it loaded; `why`: why not. The ops raise RuntimeError("fusedce-status:<s>:<function>")
for a failed call, which `reraise` turns into the binding's exception with the library's message."""
import os
import re
from pathlib import Path

import torch

from ._lib import check, ffi, lib, library_path

_FUNCTIONS = ("fce_handle_create", "fce_cross_entropy_fwd", "fce_cross_entropy_fwd_workspace_size",
              "fce_cross_entropy_bwd", "fce_cross_entropy_bwd_workspace_size", "fce_logsumexp",
              "fce_logsumexp_workspace_size", "fce_temp_softmax", "fce_temp_softmax_workspace_size",
              "fce_scale_rows")
NAME = "libfusedce_torch.so"


def _path():
    env = os.environ.get("FUSEDCE_TORCH_EAGER")
    if env:
        return None if env == "0" else Path(env)
    here = Path(library_path).resolve().parent
    for p in (here / NAME, here / "bindings" / "python" / "src" / NAME):
        if p.exists():
            return p
    return here / NAME


def _load():
    p = _path()
    if p is None:
        return None, "FUSEDCE_TORCH_EAGER=0"
    if not p.exists():
        return None, "%s not found" % p
    stamp = p.with_suffix(".torch")
    built = stamp.read_text().strip() if stamp.exists() else None
    if built != torch.__version__:
        return None, "%s was built against torch %s, this is torch %s" % (p, built, torch.__version__)
    try:
        torch.ops.load_library(str(p))
    except (OSError, RuntimeError) as e:
        return None, "%s: %s" % (p, e)
    ops = torch.ops.fusedce_eager
    ops._bind([int(ffi.cast("uintptr_t", getattr(lib, f))) for f in _FUNCTIONS])
    return ops, None


_ops, why = _load()
available = _ops is not None
if available:
    cross_entropy = _ops.cross_entropy.default
    cross_entropy_loss = _ops.cross_entropy_loss.default
    logsumexp = _ops.logsumexp.default
    logsumexp_out = _ops.logsumexp_out.default
    temp_softmax = _ops.temp_softmax.default
    temp_softmax_out = _ops.temp_softmax_out.default

_STATUS = re.compile(r"fusedce-status:(-?\d+):(\w+)")


def reraise(e):
    """Raises the binding's exception for a failed library call reported by the fast path (the library's
    message is still this thread's), or `e` itself for anything else."""
    m = _STATUS.match(str(e))
    if m is None:
        raise e
    check(int(m.group(1)), m.group(2))
    raise e
