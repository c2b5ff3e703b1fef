#!/usr/bin/env python3
"""The Python package as a user installs it (meson test python-pip-install, suite python).

    pip_install.py SOURCE_ROOT EXPECTED_VERSION BUILD_TREE_LIBRARY [MESON_SETUP_ARG...]

MESON_SETUP_ARG: passed to the package's meson setup (pip's --config-settings=setup-args=...); meson test
passes its build's -Dgencode, so that the test compiles the GPU architectures the build does.

1. A fresh venv in a temporary folder; `pip install SOURCE_ROOT` in it (pyproject.toml: meson-python builds
   libfusedce again with -Dpython_package=true, its build folder inside the temporary folder, so nothing is
   written into the source tree). The build requirements and cffi/numpy come from the package index.
   Where torch is importable here, the venv sees it (--system-site-packages) and the package builds the
   eager fast path libfusedce_torch.so against it.
2. What was installed: only fusedce/ and its dist-info (the RECORD); the library fusedce/libfusedce.so.<ABI>
   (and libfusedce_torch.so with its torch stamp exactly when torch is importable), its soname, and a
   RUNPATH with no relative or build-folder entry (readelf).
3. With no environment variable but PATH and HOME, from the temporary folder: `import fusedce` loads the
   bundled library; fusedce.build_info() reports the CUDA backend exactly when nvcc is on PATH or in
   /usr/local/cuda/bin (meson.build's -Dcuda=auto finds it there); one cross-entropy on the CPU against a
   float64 numpy reference; with torch, fusedce.torch on the fast path against torch; `python -m fusedce`
   exits 0.
4. FUSEDCE_LIBRARY=BUILD_TREE_LIBRARY still overrides the bundled library.

Every failure, a failed install included, is a test failure (exit 1), never a skip. The pip log is printed
when the install fails, and the install's duration always.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHECK = r'''
import json, sys
from pathlib import Path
import numpy as np
import fusedce

expect = json.loads(sys.argv[1])
site = Path(fusedce.__file__).resolve().parent
assert Path(sys.prefix).resolve() in site.parents, ("fusedce imported from outside the venv", site)
lib = Path(fusedce.library_path)
assert lib == site / ("libfusedce.so.%d" % fusedce.ABI_VERSION), ("not the bundled library", fusedce.library_path)
info = fusedce.build_info()
print("build info:", info)
assert info.version_string == expect["version"], (info.version_string, expect["version"])
assert info.cuda_backend == expect["cuda"], ("cuda_backend is %s but nvcc was %sfound"
                                             % (info.cuda_backend, "" if expect["cuda"] else "not "))
assert bool(info.cuda_architectures) == expect["cuda"], info.cuda_architectures

rng = np.random.default_rng(7)
logits = (rng.standard_normal((16, 3000)) * 5).astype(np.float32)
targets = rng.integers(0, 3000, 16).astype(np.int64)
targets[5] = -100
out = fusedce.cross_entropy_fwd(logits, targets, reduction="none", label_smoothing=0.1)
x = logits.astype(np.float64)
m = x.max(1, keepdims=True)
lse = m[:, 0] + np.log(np.exp(x - m).sum(1))
logp = x - lse[:, None]
ref = -(0.9 * logp[np.arange(16), np.clip(targets, 0, None)] + 0.1 * logp.mean(1))
ref[targets == -100] = 0.0
err = np.abs(np.asarray(out.loss, np.float64) - ref).max()
print("cpu cross_entropy_fwd [16, 3000], label smoothing 0.1: max |loss - float64 reference| = %.2e" % err)
assert err < 1e-4, err
assert np.allclose(out.lse, lse, rtol=1e-6, atol=1e-5)
if expect["torch"]:
    # built against this environment's torch: the eager fast path loads and is the path taken
    import torch
    import fusedce.torch as ft
    from fusedce import _eager
    assert _eager.available, _eager.why
    xt = torch.from_numpy(logits).requires_grad_()
    tt = torch.from_numpy(targets)
    loss = ft.cross_entropy(xt, tt, label_smoothing=0.1)
    assert loss.grad_fn.name() == "CrossEntropyBackward", loss.grad_fn.name()
    loss.backward()
    xr = torch.from_numpy(x).requires_grad_()
    want = torch.nn.functional.cross_entropy(xr, tt, label_smoothing=0.1)
    want.backward()
    assert abs(loss.item() - want.item()) < 1e-4 and (xt.grad.double() - xr.grad).abs().max().item() < 1e-6
    print("torch %s: eager fast path loaded, cross_entropy forward + backward match" % torch.__version__)
print("ok")
'''


def run(cmd, log=None, **kw):
    t0 = time.monotonic()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    if log is not None:
        Path(log).write_text(r.stdout)
    return r, time.monotonic() - t0


def fail(msg, output=None, tail=80):
    if output:
        lines = output.rstrip().splitlines()
        print("\n".join(lines[-tail:]))
    print("FAILED: " + msg)
    sys.exit(1)


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    source, version, tree_lib = Path(sys.argv[1]).resolve(), sys.argv[2], sys.argv[3]
    setup_args = ["--config-settings=setup-args=%s" % a for a in sys.argv[4:]]
    expect_cuda = bool(shutil.which("nvcc")) or os.access("/usr/local/cuda/bin/nvcc", os.X_OK)
    try:
        import torch  # noqa: F401
        expect_torch = True
    except ImportError:
        expect_torch = False
    expect = {"version": version, "cuda": expect_cuda, "torch": expect_torch}
    print("source %s, version %s, nvcc found: %s, torch importable: %s, setup args %s"
          % (source, version, expect_cuda, expect_torch, sys.argv[4:]))

    tmp = Path(tempfile.mkdtemp(prefix="fusedce-pip-"))
    try:
        # The user's environment, less what points the bindings or Python elsewhere and meson test's own.
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("FUSEDCE_", "PYTHON", "MESON"))
               and k not in ("LD_LIBRARY_PATH", "VIRTUAL_ENV", "MALLOC_PERTURB_")}
        # With torch here, the venv sees it (--system-site-packages), as a user's environment with torch: the
        # package then builds libfusedce_torch.so against it (tools/torch_build_flags.py finds it through
        # pip's build isolation) and must load it.
        venv = [sys.executable, "-m", "venv"] + (["--system-site-packages"] if expect_torch else [])
        r, _ = run(venv + [str(tmp / "venv")], env=env)
        if r.returncode:
            fail("python3 -m venv failed (Debian: python3-venv, tools/deps.d/python.sh)", r.stdout)
        py = str(tmp / "venv" / "bin" / "python")
        r, secs = run([py, "-m", "pip", "install", "--disable-pip-version-check", "-v",
                       "--config-settings=build-dir=%s" % (tmp / "build")] + setup_args + [str(source)],
                      log=tmp / "pip.log", env=env, cwd=str(tmp))
        print("pip install %s: %.0f s (exit %d)" % (source, secs, r.returncode))
        if r.returncode:
            fail("pip install failed", r.stdout, tail=120)
        done = re.findall(r"^Successfully installed .*", r.stdout, re.M)  # the last: the venv's, not the build env's
        print(done[-1] if done else "pip: no 'Successfully installed' line")

        # What was installed: the package and its dist-info only.
        site = Path(subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_paths()['platlib'])"],
                                            text=True, env=env).strip())
        records = list(site.glob("fusedce-*.dist-info/RECORD"))
        if len(records) != 1:
            fail("expected one fusedce-*.dist-info/RECORD in %s, found %s" % (site, records))
        installed = [line.split(",")[0] for line in records[0].read_text().splitlines() if line]
        distinfo = records[0].parent.name + "/"
        stray = [p for p in installed if not (p.startswith("fusedce/") or p.startswith(distinfo))]
        if stray:
            fail("files installed outside the package: %s" % stray)
        libs = [p for p in installed if re.fullmatch(r"fusedce/libfusedce\.so\.\d+", p)]
        eager = ["fusedce/libfusedce_torch.so", "fusedce/libfusedce_torch.torch"] if expect_torch else []
        if len(libs) != 1 or sorted(p for p in installed if "libfusedce" in p and p not in libs) != eager:
            fail("expected the library fusedce/libfusedce.so.<ABI>%s: %s"
                 % (" and the eager fast path" if expect_torch else "", [p for p in installed if "libfusedce" in p]))
        modules = sorted(p for p in installed if p.startswith("fusedce/") and p.endswith(".py"))
        print("installed: %s, %d modules (%s)" % (libs[0], len(modules), ", ".join(Path(p).name for p in modules)))
        for want in ("fusedce/__init__.py", "fusedce/_lib.py", "fusedce/_generated.py", "fusedce/__main__.py"):
            if want not in modules:
                fail("%s is missing from the installed package" % want)
        lib = site / libs[0]
        abi = libs[0].rsplit(".", 1)[1]

        readelf = shutil.which("readelf")
        if readelf:
            dyn = subprocess.check_output([readelf, "-d", str(lib)], text=True)
            soname = re.search(r"\(SONAME\)\s+Library soname: \[(.*)\]", dyn)
            runpath = re.search(r"\((?:RUNPATH|RPATH)\)\s+Library r(?:un)?path: \[(.*)\]", dyn)
            needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.*)\]", dyn)
            entries = runpath.group(1).split(":") if runpath else []
            print("soname %s; NEEDED %s; RUNPATH %s" % (soname and soname.group(1), " ".join(needed), entries))
            if not soname or soname.group(1) != "libfusedce.so." + abi:
                fail("the library's soname is not libfusedce.so.%s" % abi)
            bad = [e for e in entries if not (e.startswith("/") or e.startswith("$ORIGIN"))
                   or str(tmp) in e or str(source) in e]
            if bad:
                fail("RUNPATH entries that are relative or point into the build: %s" % bad)
            if expect_cuda and not any(n.startswith("libcudart.so.") for n in needed):
                fail("a CUDA build that does not link libcudart")
        else:
            print("readelf not found: soname and RUNPATH not checked")

        # A user's shell: no FUSEDCE_LIBRARY, no PYTHONPATH, nothing but PATH and HOME; cwd outside the tree.
        clean = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
        (tmp / "check.py").write_text(CHECK)
        r, _ = run([py, str(tmp / "check.py"), json.dumps(expect)], env=clean, cwd=str(tmp))
        print(r.stdout.rstrip())
        if r.returncode:
            fail("import fusedce / build_info / cross-entropy in the venv")
        r, _ = run([py, "-m", "fusedce"], env=clean, cwd=str(tmp))
        print("python -m fusedce (exit %d):\n  %s" % (r.returncode, r.stdout.rstrip().replace("\n", "\n  ")))
        if r.returncode or str(lib) not in r.stdout:
            fail("python -m fusedce")

        # The override: FUSEDCE_LIBRARY names another library (the build tree's), which is loaded instead.
        r, _ = run([py, "-c", "import fusedce; print(fusedce.library_path)"],
                   env=dict(clean, FUSEDCE_LIBRARY=tree_lib), cwd=str(tmp))
        if r.returncode or r.stdout.strip() != tree_lib:
            fail("FUSEDCE_LIBRARY=%s is not what was loaded" % tree_lib, r.stdout)
        print("FUSEDCE_LIBRARY=%s: loaded" % tree_lib)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("ok")


if __name__ == "__main__":
    main()
