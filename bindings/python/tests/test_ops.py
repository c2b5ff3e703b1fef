"""Every op of the Python binding on the CPU backend against float64 numpy references (tests/reference.py),
plus bad input, handles, the version and the generated declarations."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fusedce
import reference as ref

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]

rng = np.random.default_rng(20240607)
N, V = 7, 11
X = (rng.standard_normal((N, V)) * 3).astype(np.float32)
T = rng.integers(0, V, N)
T[2] = -100


def close(a, b, rtol=2e-5, atol=2e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol, atol=atol)


# ---- version, loading, generated code -------------------------------------------------------------

def test_version_matches():
    assert fusedce.version() == fusedce.HEADER_VERSION == fusedce.__version__
    assert fusedce.lib.fce_version_number() == fusedce.VERSION_NUMBER
    assert fusedce.lib.fce_abi_version() == fusedce.ABI_VERSION
    expected = os.environ.get("FUSEDCE_EXPECTED_VERSION")
    if expected:
        assert fusedce.version() == expected


def test_library_from_env():
    want = os.environ.get("FUSEDCE_LIBRARY")
    if want:
        assert os.path.realpath(fusedce.library_path) == os.path.realpath(want)


def test_generated_cdef_up_to_date():
    r = subprocess.run([sys.executable, str(HERE.parent / "gen_cdef.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_struct_layouts_agree_with_libclang():
    """cffi's layouts (pycparser over the cleaned header) against libclang's, asserted in the generated
    Julia module: two independent parsers of the same header."""
    jl = (ROOT / "bindings" / "julia" / "FusedCE.jl" / "src" / "LibFusedCE.jl").read_text()
    sizes = dict(re.findall(r"@assert sizeof\((\w+)\) == (\d+)", jl))
    assert len(sizes) >= 10
    for name, size in sizes.items():
        cname = name if name.startswith("DL") else name + "_t"
        assert fusedce.ffi.sizeof(cname) == int(size), name
    for name, idx, off in re.findall(r"@assert fieldoffset\((\w+), (\d+)\) == (\d+)", jl):
        cname = name if name.startswith("DL") else name + "_t"
        field = fusedce.ffi.typeof(cname).fields[int(idx) - 1]
        assert field[1].offset == int(off), (name, field[0])


def test_defaults_come_from_the_library_and_match_the_header():
    d = fusedce.defaults("FCE_CE_OPTIONS_INIT")
    assert d == fusedce.defaults("fce_ce_options_t")
    assert d["ignore_index"] == -100 and d["reduction"] == fusedce.lib.FCE_REDUCTION_MEAN
    assert d["logit_scale"] == 1.0
    assert fusedce.defaults("FCE_KD_OPTIONS_INIT")["beta"] == 0.5
    # every fce_*_init of the loaded library gives the header's *_INIT values, struct_size included
    from fusedce._generated import INITS
    checked = 0
    for name, (ctype, values) in INITS.items():
        if ctype == "fce_build_info_t":
            continue
        lib_values = fusedce.defaults(name)
        assert lib_values == {k: (fusedce.ffi.sizeof(ctype) if v == "sizeof" else v) for k, v in values.items()}, name
        checked += 1
    assert checked == 9
    with pytest.raises(KeyError):
        fusedce.defaults("fce_build_info_t")
    # the keyword defaults are the library's
    import inspect
    sig = inspect.signature(fusedce.cross_entropy_fwd).parameters
    assert sig["ignore_index"].default == d["ignore_index"] and sig["logit_scale"].default == d["logit_scale"]
    assert inspect.signature(fusedce.kd_loss).parameters["temperature"].default == 1.0


def test_new_struct_is_filled_by_the_init_function():
    keep = []
    o = fusedce.new_struct("fce_kd_options_t", keep)
    assert o.struct_size == fusedce.ffi.sizeof("fce_kd_options_t") and o.beta == 0.5 and o.ignore_index == -100
    t = fusedce.new_struct("fce_kd_teacher_t", keep)
    assert t.logits == fusedce.ffi.NULL and t.topk_ids == fusedce.ffi.NULL
    assert len(keep) == 2


def test_init_functions_fill_the_struct_size_given():
    ffi, lib = fusedce.ffi, fusedce.lib
    n = ffi.sizeof("fce_kd_options_t")
    buf = ffi.new("char[]", n + 24)
    ffi.memmove(buf, b"\xab" * (n + 24), n + 24)
    p = ffi.cast("fce_kd_options_t *", buf)
    # the defaults, zeros past the library's struct, struct_size as given
    assert lib.fce_kd_options_init(p, n + 16) == fusedce.STATUS["SUCCESS"]
    assert p.struct_size == n + 16 and p.beta == 0.5 and p.ignore_index == -100
    raw = ffi.buffer(buf)[:]
    assert raw[n:n + 16] == b"\0" * 16 and raw[n + 16:] == b"\xab" * 8
    # below the struct's first published size (0.1.0's, before vocab_start), above FCE_MAX_STRUCT_SIZE, or NULL:
    # refused, nothing written
    ffi.memmove(buf, b"\xab" * (n + 24), n + 24)
    for size in (ffi.offsetof("fce_kd_options_t", "vocab_start") - 8, fusedce.MAX_STRUCT_SIZE + 1):
        assert lib.fce_kd_options_init(p, size) == fusedce.STATUS["INVALID_ARGUMENT"]
    assert ffi.buffer(buf)[:] == b"\xab" * (n + 24)
    assert lib.fce_kd_options_init(ffi.NULL, n) == fusedce.STATUS["INVALID_ARGUMENT"]


def test_build_info():
    info = fusedce.build_info()
    assert isinstance(info, fusedce.BuildInfo)
    assert info.version_number == fusedce.lib.fce_version_number() == fusedce.VERSION_NUMBER
    assert info.abi_version == fusedce.lib.fce_abi_version() == fusedce.ABI_VERSION
    assert info.version_string == fusedce.version()
    assert info.cuda_backend in (0, 1)
    if info.cuda_backend:
        assert info.cuda_runtime_version > 0 and info.cublas_version > 0
        archs = info.cuda_architectures.split()
        assert archs and all(re.fullmatch(r"(sm|compute)_\d+a?", a) for a in archs), info.cuda_architectures
    else:
        assert (info.cuda_runtime_version, info.cublas_version, info.cuda_architectures) == (0, 0, "")
    d = info.as_dict()
    assert set(d) == {"version_number", "abi_version", "cuda_backend", "cuda_runtime_version", "cublas_version",
                      "version_string", "cuda_architectures"}
    assert str(info).startswith("libfusedce %s (ABI %d)" % (info.version_string, info.abi_version))
    out = subprocess.run([sys.executable, "-m", "fusedce"], capture_output=True, text=True, cwd=str(HERE.parent))
    assert out.returncode == 0 and str(info) in out.stdout, out.stdout + out.stderr


def test_header_constants():
    assert fusedce.WORKSPACE_ALIGNMENT == 16 and fusedce.MAX_STRUCT_SIZE == 4096
    assert fusedce.KD_TEMPERATURE_MIN == float(np.float32(1e-4)) and fusedce.KD_TEMPERATURE_MAX == 100.0


def test_handles():
    h = fusedce.Handle("cpu")
    dt, di = fusedce.ffi.new("int32_t*"), fusedce.ffi.new("int32_t*")
    assert fusedce.lib.fce_handle_get_device(h.ptr, dt, di) == 0 and dt[0] == fusedce.lib.kDLCPU
    assert fusedce.cross_entropy(X, T, handle=h) == fusedce.cross_entropy(X, T)
    h.close()
    with pytest.raises(ValueError):
        fusedce.cross_entropy(X, T, handle=h)
    with fusedce.Handle() as h2:
        fusedce.logsumexp(X, handle=h2)
    assert fusedce.default_handle(fusedce.lib.kDLCPU) is fusedce.default_handle(fusedce.lib.kDLCPU)


def test_cuda_handle_without_gpu_or_with():
    try:
        h = fusedce.Handle("cuda", 0)
    except fusedce.NoDeviceError as e:
        assert "cuda" in str(e).lower() or e.message
        return
    with pytest.raises(fusedce.DeviceMismatchError):  # a GPU machine: CPU arrays with a CUDA handle
        fusedce.cross_entropy(X, T, handle=h)


# ---- cross-entropy --------------------------------------------------------------------------------

CE_OPTIONS = [
    {},
    {"reduction": "sum"},
    {"reduction": "none"},
    {"label_smoothing": 0.1},
    {"z_loss_scale": 1e-2},
    {"softcap": 3.0},
    {"logit_scale": 0.7},
    {"class_weights": (rng.random(V) + 0.5).astype(np.float32)},
    {"class_weights": (rng.random(V) + 0.5).astype(np.float32), "label_smoothing": 0.2, "reduction": "none"},
    {"softcap": 2.5, "logit_scale": 1.3, "z_loss_scale": 1e-3, "label_smoothing": 0.05, "reduction": "sum"},
    {"ignore_index": 3},
]


@pytest.mark.parametrize("kw", CE_OPTIONS, ids=lambda kw: ",".join(kw) or "defaults")
def test_cross_entropy(kw):
    t = T.copy()
    if "ignore_index" in kw:
        t[2] = kw["ignore_index"]
    r = ref.cross_entropy(X, t, **kw)
    out = fusedce.cross_entropy_fwd(X, t, **kw, z_loss=True, argmax=True, entropy=True, dlogits=True)
    close(out.loss, r["loss"])
    close(out.z_loss, r["z_loss"])
    close(out.lse, r["lse"])
    close(out.entropy, r["entropy"])
    np.testing.assert_array_equal(out.argmax, r["argmax"])
    assert out.dlogits.dtype == np.float32 and np.all(out.dlogits[2] == 0)
    close(out.dlogits, ref.fd_grad(lambda x: ref.cross_entropy(x, t, **kw)["loss"], X), atol=1e-5, rtol=1e-4)
    assert fusedce.cross_entropy(X, t, **kw) == out.loss if np.ndim(out.loss) == 0 else True
    # backward from the saved lse with an upstream gradient, and the fused gradient with one
    g = rng.random(N).astype(np.float32) if kw.get("reduction") == "none" else 0.37
    want = ref.fd_grad(lambda x: ref.cross_entropy(x, t, **kw)["loss"], X, g=g)
    close(fusedce.cross_entropy_bwd(X, t, out.lse, grad_loss=g, **kw), want, atol=1e-5, rtol=1e-4)
    close(fusedce.cross_entropy_fwd(X, t, dlogits=True, grad_loss=g, **kw).dlogits, want, atol=1e-5, rtol=1e-4)


def test_cross_entropy_layouts_and_dtypes():
    # padded rows: a column slice of a wider array has row stride > V
    big = rng.standard_normal((N, V + 5)).astype(np.float32)
    big[:, :V] = X
    assert fusedce.cross_entropy(big[:, :V], T) == fusedce.cross_entropy(X, T)
    # int32 targets and argmax
    out = fusedce.cross_entropy_fwd(X, T.astype(np.int32), argmax=True, argmax_dtype="int32")
    assert out.argmax.dtype == np.int32
    np.testing.assert_array_equal(out.argmax, X.argmax(1))
    # in place: the gradient overwrites the logits
    xc = X.copy()
    want = fusedce.cross_entropy_fwd(X, T, dlogits=True).dlogits
    fusedce.cross_entropy_fwd(xc, T, dlogits=xc)
    np.testing.assert_array_equal(xc, want)
    # fp16 and bf16 logits: statistics in fp32, gradient in the logits' dtype
    x16 = X.astype(np.float16)
    o16 = fusedce.cross_entropy_fwd(x16, T, dlogits=True)
    assert o16.dlogits.dtype == np.float16
    close(o16.loss, ref.cross_entropy(x16.astype(np.float64), T)["loss"])
    ml_dtypes = pytest.importorskip("ml_dtypes")
    xb = X.astype(ml_dtypes.bfloat16)
    ob = fusedce.cross_entropy_fwd(xb, T, dlogits=True)
    assert ob.dlogits.dtype == xb.dtype
    close(ob.loss, ref.cross_entropy(xb.astype(np.float64), T)["loss"])
    close(ob.dlogits.astype(np.float64), ref.fd_grad(lambda x: ref.cross_entropy(x, T)["loss"], xb.astype(np.float64)),
          atol=1e-2, rtol=1e-2)
    # all rows ignored: mean is 0 (PyTorch gives NaN), as the header documents
    assert fusedce.cross_entropy(X, np.full(N, -100)) == 0
    # a target out of range that is not ignore_index: NaN loss, not an error status
    tb = T.copy()
    tb[0] = V
    assert np.isnan(fusedce.cross_entropy(X, tb))


# ---- logsumexp, temperature softmax -----------------------------------------------------------------

@pytest.mark.parametrize("scale", [1.0, 0.25, 3.0])
def test_logsumexp(scale):
    close(fusedce.logsumexp(X, scale=scale), ref.lse(scale * X.astype(np.float64)))


def test_logsumexp_edges():
    y = X.copy()
    y[1] = -np.inf
    y[3, 4] = np.nan
    out = fusedce.logsumexp(y)
    assert out[1] == -np.inf and np.isnan(out[3])
    close(fusedce.logsumexp(X.astype(np.float16)), ref.lse(X.astype(np.float16).astype(np.float64)))
    out = np.empty(N, np.float32)
    assert fusedce.logsumexp(X, out=out) is out


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5, 0.0])
def test_temp_softmax(temperature):
    p, lp = ref.softmax_t(X, temperature)
    out = fusedce.temp_softmax(X, temperature=temperature, logprobs=True)
    close(out.probs, p)
    if temperature == 0:
        np.testing.assert_array_equal(out.logprobs, lp)
    else:
        close(out.logprobs, lp)


def test_temp_softmax_options():
    ts = np.linspace(0.5, 2.0, N).astype(np.float32)
    out = fusedce.temp_softmax(X, temperatures=ts)
    for i in range(N):
        close(out.probs[i], ref.softmax_t(X[i:i + 1], ts[i])[0][0])
    ts[1] = -1.0  # a bad per-row temperature poisons that row only
    out = fusedce.temp_softmax(X, temperatures=ts)
    assert np.isnan(out.probs[1]).all() and not np.isnan(out.probs[0]).any()
    o16 = fusedce.temp_softmax(X.astype(np.float16), dtype=None, logprobs=True)
    assert o16.probs.dtype == np.float16 and o16.logprobs.dtype == np.float16
    xc = X.copy()
    fusedce.temp_softmax(xc, probs=xc)
    np.testing.assert_array_equal(xc, fusedce.temp_softmax(X).probs)
    assert fusedce.temp_softmax(X).logprobs is None
    # +inf temperature: uniform over finite logits; -inf logits get probability 0
    y = X.copy()
    y[0, :3] = -np.inf
    p = fusedce.temp_softmax(y, temperature=np.inf).probs
    close(p[0, 3:], np.full(V - 3, 1 / (V - 3)))
    assert np.all(p[0, :3] == 0)


# ---- knowledge distillation -------------------------------------------------------------------------

S = (rng.standard_normal((N, V)) * 2).astype(np.float32)
TT = (rng.standard_normal((N, V)) * 2).astype(np.float32)
KT = rng.integers(0, V, N)
KT[3] = -100

KD_OPTIONS = [
    {},
    {"divergence": "reverse_kl"},
    {"divergence": "jsd"},
    {"divergence": "jsd", "beta": 0.2},
    {"divergence": "jsd", "beta": 0.0},
    {"divergence": "jsd", "beta": 1.0},
    {"temperature": 2.0, "scale_by_t2": True},
    {"reduction": "sum", "temperature": 0.7},
    {"reduction": "none", "divergence": "reverse_kl"},
]


@pytest.mark.parametrize("kw", KD_OPTIONS, ids=lambda kw: ",".join("%s=%s" % i for i in kw.items()) or "defaults")
@pytest.mark.parametrize("masked", [False, True])
def test_kd_loss(kw, masked):
    targets = KT if masked else None
    out = fusedce.kd_loss(S, TT, targets=targets, dstudent=True, **kw)
    close(out.loss, ref.kd(S, TT, targets=targets, **kw))
    close(out.dstudent, ref.fd_grad(lambda s: ref.kd(s, TT, targets=targets, **kw), S), atol=1e-5, rtol=1e-4)
    if masked:
        assert np.all(out.dstudent[3] == 0)
    g = rng.random(N).astype(np.float32) if kw.get("reduction") == "none" else 1.7
    out = fusedce.kd_loss(S, TT, targets=targets, dstudent=True, grad_loss=g, **kw)
    close(out.dstudent, ref.fd_grad(lambda s: ref.kd(s, TT, targets=targets, **kw), S, g=g), atol=1e-5, rtol=1e-4)


KD_TOPK_OPTIONS = [
    {},
    {"topk_norm": "renormalize"},
    {"divergence": "reverse_kl"},
    {"divergence": "reverse_kl", "topk_norm": "renormalize"},
    {"divergence": "jsd", "beta": 0.4, "temperature": 1.5},
    {"reduction": "none", "scale_by_t2": True, "temperature": 2.0},
]


@pytest.mark.parametrize("kw", KD_TOPK_OPTIONS, ids=lambda kw: ",".join("%s=%s" % i for i in kw.items()) or "defaults")
def test_kd_loss_topk(kw):
    k = 4
    ids = np.stack([rng.permutation(V)[:k] for _ in range(N)]).astype(np.int64)
    ids[1, 3] = -1     # an unused slot
    ids[4, :] = -1     # a row with no used slot: masked
    lps = np.log(rng.random((N, k)) * 0.2).astype(np.float32)
    out = fusedce.kd_loss(S, topk_ids=ids, topk_logprobs=lps, dstudent=True, **kw)
    close(out.loss, ref.kd_topk(S, ids, lps, **kw))
    close(out.dstudent, ref.fd_grad(lambda s: ref.kd_topk(s, ids, lps, **kw), S), atol=1e-5, rtol=1e-4)
    assert np.all(out.dstudent[4] == 0)
    assert fusedce.kd_loss(S, topk_ids=ids.astype(np.int32), topk_logprobs=lps, **kw).loss.tolist() == \
        np.asarray(out.loss).tolist()


def test_kd_temperature_domain_ends_are_accepted():
    for t in (fusedce.KD_TEMPERATURE_MIN, 1e-4, fusedce.KD_TEMPERATURE_MAX):
        assert np.isfinite(fusedce.kd_loss(S, TT, temperature=t).loss), t


# ---- linear cross-entropy ---------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [{}, {"reduction": "sum", "label_smoothing": 0.1},
                                {"reduction": "none", "z_loss_scale": 1e-2, "softcap": 4.0}],
                         ids=lambda kw: ",".join(kw) or "defaults")
def test_linear_cross_entropy(kw):
    h = 5
    hid = rng.standard_normal((N, h)).astype(np.float32)
    w = (rng.standard_normal((V, h)) * 0.5).astype(np.float32)
    b = (rng.standard_normal(V) * 0.1).astype(np.float32)
    t = rng.integers(0, V, N)
    t[1] = -100

    def f(hh, ww, bb):
        return ref.cross_entropy(np.asarray(hh, np.float64) @ np.asarray(ww, np.float64).T + bb, t, **kw)

    r = f(hid, w, b)
    out = fusedce.linear_cross_entropy_fwd(hid, w, t, bias=b, **kw, z_loss=True, argmax=True, entropy=True,
                                           dhidden=True, dweight=True, dbias=True)
    tol = dict(rtol=1e-4, atol=1e-4)
    close(out.loss, r["loss"], **tol)
    close(out.lse, r["lse"], **tol)
    close(out.z_loss, r["z_loss"], **tol)
    close(out.entropy, r["entropy"], **tol)
    np.testing.assert_array_equal(out.argmax, r["argmax"])
    close(out.dhidden, ref.fd_grad(lambda x: f(x, w, b)["loss"], hid), **tol)
    close(out.dweight, ref.fd_grad(lambda x: f(hid, x, b)["loss"], w), **tol)
    close(out.dbias, ref.fd_grad(lambda x: f(hid, w, x)["loss"], b), **tol)
    g = rng.random(N).astype(np.float32) if kw.get("reduction") == "none" else 0.5
    d = fusedce.linear_cross_entropy_bwd(hid, w, t, out.lse, bias=b, grad_loss=g, **kw)
    close(d.dhidden, ref.fd_grad(lambda x: f(x, w, b)["loss"], hid, g=g), **tol)
    close(d.dweight, ref.fd_grad(lambda x: f(hid, x, b)["loss"], w, g=g), **tol)
    close(d.dbias, ref.fd_grad(lambda x: f(hid, w, x)["loss"], b, g=g), **tol)
    close(fusedce.linear_cross_entropy(hid, w, t, **kw), f(hid, w, 0.0)["loss"], **tol)
    # a caller workspace (aligned to FCE_WORKSPACE_ALIGNMENT, 16 bytes) instead of the handle's cache: same
    # result; one byte off that alignment is refused
    a = fusedce.WORKSPACE_ALIGNMENT
    buf = np.zeros((1 << 20) + 2 * a, np.uint8)
    off = (-buf.ctypes.data) % a
    o2 = fusedce.linear_cross_entropy_fwd(hid, w, t, bias=b, workspace=buf[off:off + (1 << 20)], **kw)
    np.testing.assert_array_equal(o2.loss, out.loss)
    with pytest.raises(fusedce.InvalidArgumentError):
        fusedce.linear_cross_entropy_fwd(hid, w, t, bias=b, workspace=buf[off + 1:off + 1 + (1 << 20)], **kw)


# ---- bad input ----------------------------------------------------------------------------------------

BAD = [
    ("short targets", lambda: fusedce.cross_entropy(X, T[:-1]), fusedce.ShapeMismatchError),
    ("float64 logits", lambda: fusedce.cross_entropy(X.astype(np.float64), T), fusedce.UnsupportedDtypeError),
    ("label_smoothing 2", lambda: fusedce.cross_entropy(X, T, label_smoothing=2), fusedce.InvalidArgumentError),
    ("logit_scale 0", lambda: fusedce.cross_entropy(X, T, logit_scale=0), fusedce.InvalidArgumentError),
    ("column stride 2", lambda: fusedce.cross_entropy(np.repeat(X, 2, axis=1)[:, ::2], T),
     fusedce.UnsupportedLayoutError),
    ("class weights V+1", lambda: fusedce.cross_entropy(X, T, class_weights=np.ones(V + 1, np.float32)),
     fusedce.ShapeMismatchError),
    ("lse out N+1", lambda: fusedce.logsumexp(X, out=np.empty(N + 1, np.float32)), fusedce.ShapeMismatchError),
    ("temperature -1", lambda: fusedce.temp_softmax(X, temperature=-1), fusedce.InvalidArgumentError),
    ("no softmax output", lambda: fusedce.temp_softmax(X, probs=False), fusedce.InvalidArgumentError),
    ("teacher rows", lambda: fusedce.kd_loss(S, TT[:-1]), fusedce.ShapeMismatchError),
    ("kd temperature 0", lambda: fusedce.kd_loss(S, TT, temperature=0), fusedce.InvalidArgumentError),
    ("kd temperature below min", lambda: fusedce.kd_loss(S, TT, temperature=fusedce.KD_TEMPERATURE_MIN / 2),
     fusedce.InvalidArgumentError),
    ("kd temperature above max", lambda: fusedce.kd_loss(S, TT, temperature=fusedce.KD_TEMPERATURE_MAX * 1.01),
     fusedce.InvalidArgumentError),
    ("hidden/weight H", lambda: fusedce.linear_cross_entropy(np.ones((N, 4), np.float32), np.ones((V, 5), np.float32), T),
     fusedce.ShapeMismatchError),
    ("hidden/weight dtype", lambda: fusedce.linear_cross_entropy(np.ones((N, 4), np.float32),
                                                                np.ones((V, 4), np.float16), T),
     fusedce.UnsupportedDtypeError),
    ("probs = logprobs", lambda: fusedce.temp_softmax(X, probs=(b := np.empty_like(X)), logprobs=b),
     fusedce.AliasingError),
    ("dlogits overlaps logits", lambda: fusedce.cross_entropy_fwd((big := np.zeros((N, V + 1), np.float32))[:, :V], T,
                                                                  dlogits=big[:, 1:]), fusedce.AliasingError),
]


@pytest.mark.parametrize("name,call,exc", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises(name, call, exc):
    with pytest.raises(exc) as info:
        call()
    e = info.value
    assert isinstance(e, fusedce.FusedCEError)
    assert e.message and e.function.startswith("fce_")
    assert e.status == fusedce.STATUS[e.status_name]
    # the message is per-thread and cleared by the next successful call
    fusedce.logsumexp(X)
    assert fusedce.ffi.string(fusedce.lib.fce_last_error_message()) == b""


def test_python_side_errors():
    with pytest.raises(ValueError):
        fusedce.cross_entropy(X, T, reduction="avg")
    with pytest.raises(ValueError):
        fusedce.kd_loss(S, TT, divergence="kl")
    with pytest.raises(ValueError):
        fusedce.kd_loss(S)
    with pytest.raises(TypeError):
        fusedce.cross_entropy(np.array([["a"]]), T)
    ro = np.empty(N, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        fusedce.logsumexp(X, out=ro)


def test_linear_cross_entropy_accumulate_adds_into_the_arrays_given():
    """accumulate=True (FCE_LINEAR_CE_ACCUMULATE) adds the gradients into dhidden/dweight/dbias as given, in
    the forward and the backward; True (an array allocated here) is refused."""
    rng = np.random.default_rng(21)
    n, h, v = 9, 6, 37
    hid = rng.standard_normal((n, h)).astype(np.float32)
    w = rng.standard_normal((v, h)).astype(np.float32)
    b = rng.standard_normal(v).astype(np.float32)
    t = rng.integers(0, v, n)
    t[2] = -100
    plain = fusedce.linear_cross_entropy_fwd(hid, w, t, bias=b, dhidden=True, dweight=True, dbias=True)
    starts = [rng.standard_normal(a.shape).astype(np.float32) for a in (plain.dhidden, plain.dweight, plain.dbias)]
    got = [s.copy() for s in starts]
    out = fusedce.linear_cross_entropy_fwd(hid, w, t, bias=b, dhidden=got[0], dweight=got[1], dbias=got[2],
                                           accumulate=True)
    for g, s, p in zip(got, starts, (plain.dhidden, plain.dweight, plain.dbias)):
        np.testing.assert_allclose(g, s + p, rtol=1e-5, atol=1e-6)
    assert out.dweight is got[1]
    got = [s.copy() for s in starts]
    fusedce.linear_cross_entropy_bwd(hid, w, t, plain.lse, bias=b, dhidden=got[0], dweight=got[1], dbias=got[2],
                                     accumulate=True)
    for g, s, p in zip(got, starts, (plain.dhidden, plain.dweight, plain.dbias)):
        np.testing.assert_allclose(g, s + p, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="accumulate"):
        fusedce.linear_cross_entropy_fwd(hid, w, t, dweight=True, accumulate=True)
