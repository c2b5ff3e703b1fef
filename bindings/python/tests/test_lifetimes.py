"""Every object whose memory a library call reads lives until the call returns (issue 47, item 1).

A DLTensor borrows its object's memory. The binding makes objects for arguments (a Python number as a 0-d
array, a cast to fp32, a list or another framework's array converted, a copy to the unit stride the library
reads, targets cast to int64), and each must outlive the library call; before the fix, fusedce.ops' torch
path dropped them as soon as their DLTensor was filled, and the library read freed memory.

- test_lifetime[mode-case]: the cases of lifetime_cases.py (each against a float64 reference written there)
  run in a subprocess whose glibc overwrites every freed chunk (MALLOC_PERTURB_=165, with the per-thread
  cache off: freed chunks there would otherwise keep their contents), so that a read of freed memory gives
  garbage and fails the comparison; once with libfusedce_torch's eager ops where they are built
  ("eager": the build's environment) and once on the cffi path ("cffi": FUSEDCE_TORCH_EAGER=0).
- test_poison_works: in that subprocess, freed memory really is overwritten (else the above proves nothing).
- the in-process tests check the mechanism itself: a Call keeps what its DLTensors point into (and lets it
  go when it is dropped), and fusedce._fast only puts names (its parameters and locals) in its slots.
"""
import ast
import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

import fusedce
import lifetime_cases
from fusedce import _eager, ffi
from fusedce._tensor import Call

HERE = Path(__file__).resolve().parent
PACKAGE = HERE.parent


def _env(mode):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["MALLOC_PERTURB_"] = "165"
    tunable = "glibc.malloc.tcache_count=0"
    env["GLIBC_TUNABLES"] = env["GLIBC_TUNABLES"] + ":" + tunable if env.get("GLIBC_TUNABLES") else tunable
    if mode == "cffi":
        env["FUSEDCE_TORCH_EAGER"] = "0"
    return env


def _run(mode, script, *args):
    return subprocess.run([sys.executable, str(script), *args], env=_env(mode), capture_output=True, text=True,
                          timeout=900, cwd=str(HERE))


_RESULTS = {}


def _results(mode):
    """{case: None (passed) or its failure} for every case, from as few worker runs as crashes allow: a case
    that kills the worker is reported with the worker's exit status and stderr, and the rest run again."""
    if mode in _RESULTS:
        return _RESULTS[mode]
    todo = list(lifetime_cases.CASES)
    out = {}
    while todo:
        p = _run(mode, HERE / "lifetime_cases.py", *todo)
        for line in p.stdout.splitlines():
            status, _, rest = line.partition(" ")
            name, _, msg = rest.partition(": ")
            if status in ("PASS", "FAIL") and name in todo:
                out[name] = None if status == "PASS" else msg
        left = [n for n in todo if n not in out]
        if left:  # the first one left killed the worker
            out[left[0]] = "the worker died (exit status %d) in this case: %s" % (p.returncode, p.stderr[-3000:])
            left = left[1:]
        todo = left
    _RESULTS[mode] = out
    return out


def _eager_expected():
    return os.environ.get("FUSEDCE_EXPECT_TORCH_EAGER") == "1" or _eager.available


@pytest.mark.parametrize("name", list(lifetime_cases.CASES))
@pytest.mark.parametrize("mode", ["eager", "cffi"])
def test_lifetime(mode, name):
    if mode == "eager" and not _eager_expected():
        pytest.skip("libfusedce_torch.so is not built here (%s): the eager mode is the cffi one" % _eager.why)
    failure = _results(mode)[name]
    if failure is not None:
        pytest.fail(failure, pytrace=False)


_MODE_PROBE = """
import fusedce.torch, fusedce._fast as f
print(int(f._EAGER), int(fusedce.torch._EAGER))
"""


@pytest.mark.parametrize("mode", ["eager", "cffi"])
def test_worker_mode(mode, tmp_path):
    """The workers run the path their mode names: libfusedce_torch's ops in "eager", cffi in "cffi"."""
    if mode == "eager" and not _eager_expected():
        pytest.skip("libfusedce_torch.so is not built here (%s)" % _eager.why)
    probe = tmp_path / "probe.py"
    probe.write_text(_MODE_PROBE)
    p = _run(mode, probe)
    assert p.returncode == 0, p.stderr
    want = "1 1" if mode == "eager" else "0 0"
    assert p.stdout.split() == want.split(), (p.stdout, p.stderr)


_POISON_PROBE = """
import ctypes, torch
for n in (1, 64, 1000):
    t = torch.full((n,), 1.0)
    p = t.data_ptr()
    del t
    print(sum(1 for v in (ctypes.c_float * n).from_address(p) if v == 1.0))
"""


def test_poison_works(tmp_path):
    """Freed torch CPU memory is overwritten in the workers' environment (small buffers included, which glibc's
    per-thread cache would otherwise keep as they were)."""
    probe = tmp_path / "poison.py"
    probe.write_text(_POISON_PROBE)
    p = _run("cffi", probe)
    assert p.returncode == 0, p.stderr
    assert [int(v) for v in p.stdout.split()] == [0, 0, 0], p.stdout


# ---- the mechanism, in process ------------------------------------------------------------------------

def _data(p):
    return int(ffi.cast("uintptr_t", p.data))


def test_torch_call_keeps_temporaries():
    c = Call(torch.zeros(2, 3))
    tmp = c.full((), 0.5)
    alive = weakref.ref(tmp)
    p = c.dl(tmp)
    del tmp
    gc.collect()
    assert alive() is not None and _data(p) == alive().data_ptr()
    # made inside dl: a list, a cast
    for x in ([0.5, 0.25], np.arange(3, dtype=np.int64), torch.ones(3, dtype=torch.float64)):
        p = c.dl(c.native(x, "float32") if torch.is_tensor(x) else x)
        assert torch.is_tensor(c.keep[-1]) and _data(p) == c.keep[-1].data_ptr()
    del c
    gc.collect()
    assert alive() is None  # let go with the call


def test_numpy_call_keeps_temporaries():
    c = Call(np.zeros((2, 3), np.float32))
    for x in (0.5, [0.5, 0.25], np.arange(3.0), torch.ones(3, dtype=torch.float64)):
        a = c.native(x, "float32")
        alive = weakref.ref(a)
        p = c.dl(a)
        del a
        gc.collect()
        assert alive() is not None and _data(p) == alive().__array_interface__["data"][0]
    p = c.dl([1, 2, 3])  # converted inside dl
    kept = [k for k in c.keep if isinstance(k, np.ndarray) and k.__array_interface__["data"][0] == _data(p)]
    assert kept and kept[0].tolist() == [1, 2, 3]


def test_fast_slots_hold_only_names():
    """fusedce._fast's slots hold no reference: what goes into one (`_dl(k, x, ...)`, `_at(k, x, ...)`) must be a
    name, its function's parameter or local (or `a if cond else b` of names / None), never an expression that
    makes a tensor, which would be freed before the library call."""
    import fusedce._fast as fast

    def plain(e):
        if isinstance(e, ast.IfExp):
            return plain(e.body) and plain(e.orelse)
        return isinstance(e, ast.Name) or (isinstance(e, ast.Constant) and e.value is None)

    tree = ast.parse(Path(fast.__file__).read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id in ("_dl", "_at")]
    assert len(calls) > 20
    bad = [ast.unparse(n) for n in calls if not plain(n.args[1])]
    assert not bad, bad
