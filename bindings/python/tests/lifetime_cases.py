"""The cases of test_lifetimes.py: every argument that a call converts (a Python number as a 0-d array, a
cast, a list or an array of another framework, a reshape or .contiguous() that copies, targets of another
integer dtype), for every function of fusedce.ops, fusedce.torch and fusedce.transformers that takes one,
each against a float64 reference written here from the formulas (not from the library).

A temporary that a call makes and frees before the library reads it gives wrong results only if its memory
has changed by then; test_lifetimes.py runs these cases in a subprocess whose glibc overwrites freed memory
(MALLOC_PERTURB_, with the thread cache off so that every free is overwritten), which makes such a read
fail reliably. Lists of integers are at least 1 KiB: numpy keeps smaller freed buffers in a cache of its
own, which glibc never sees.

Run as a script: `python3 lifetime_cases.py NAME...` (no name: all) prints one line per case, "PASS name"
or "FAIL name: message", flushed as it goes (a crash leaves the rest unreported); `--list` prints the names.
"""
import sys
import traceback

import numpy as np
import torch

import fusedce
import fusedce.ops as ops
import fusedce.torch as ft
import fusedce.transformers as fhf

N, V, H = 160, 24, 16  # N int64 targets are 1280 bytes: past numpy's small-buffer cache
CASES = {}


def case(f):
    CASES[f.__name__] = f
    return f


# ---- float64 references ----------------------------------------------------------------------------

def f64(a):
    if torch.is_tensor(a):
        return a.detach().cpu().double().numpy()
    return np.asarray(a, np.float64)


def close(got, want, rtol=2e-4, atol=2e-5, what=""):
    np.testing.assert_allclose(f64(got), np.asarray(want, np.float64), rtol=rtol, atol=atol, err_msg=what)


def lse(z):
    m = z.max(axis=1, keepdims=True)
    return (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]


def softmax(z):
    return np.exp(z - lse(z)[:, None])


def _col(a):
    """A per-row coefficient as a column (a scalar stays a scalar)."""
    a = np.asarray(a, np.float64)
    return a.reshape(-1, 1) if a.ndim else a


def ce_ref(x, t, *, weight=None, reduction="mean", ignore_index=-100, grad_loss=1.0, grad_entropy=None, scale=1.0):
    """(loss, dlogits, lse, entropy) of cross-entropy of logits x [N, V] (times `scale`, the logit scale),
    targets t: dlogits = grad_loss * d(loss)/dx + grad_entropy * dH/dx."""
    x = f64(x)
    t = np.asarray(f64(t), np.int64)
    n, v = x.shape
    z = scale * x
    w = np.ones(v) if weight is None else f64(weight)
    p, l = softmax(z), lse(z)
    used = t != ignore_index
    tt = np.where(used, t, 0)
    wt = np.where(used, w[tt], 0.0)
    per = wt * (l - z[np.arange(n), tt])
    onehot = np.zeros_like(z)
    onehot[np.arange(n), tt] = 1.0
    dper = wt[:, None] * (p - onehot) * scale
    if reduction == "none":
        loss, coef = per, _col(grad_loss)
    elif reduction == "sum":
        loss, coef = per.sum(), np.float64(grad_loss)
    else:
        loss, coef = per.sum() / wt.sum(), np.float64(grad_loss) / wt.sum()
    d = coef * dper
    ez = (p * z).sum(axis=1, keepdims=True)
    ent = l - ez[:, 0]
    if grad_entropy is not None:
        d = d + _col(grad_entropy) * p * (ez - z) * scale
    return loss, d, l, ent


def kd_ref(s, teacher_logp, *, temperature=1.0, reduction="mean", mask=None, grad_loss=1.0, ids=None):
    """Forward KL(teacher || student) at temperature T (no T^2): (loss, dstudent). teacher_logp [N, K]: the
    teacher's log-probabilities at temperature T over the vocabulary (ids None) or at the top-K `ids`
    (full-vocabulary normalization of the student)."""
    s = f64(s)
    n, v = s.shape
    lq = np.log(softmax(s / temperature))
    p = np.exp(teacher_logp)
    if ids is None:
        per = (p * (teacher_logp - lq)).sum(axis=1)
        pv = p
    else:
        per = (p * (teacher_logp - np.take_along_axis(lq, ids, axis=1))).sum(axis=1)
        pv = np.zeros((n, v))
        np.add.at(pv, (np.repeat(np.arange(n), ids.shape[1]), ids.reshape(-1)), p.reshape(-1))
    dper = (np.exp(lq) * p.sum(axis=1, keepdims=True) - pv) / temperature
    used = np.ones(n, bool) if mask is None else mask
    per, dper = per * used, dper * used[:, None]
    if reduction == "none":
        return per, _col(grad_loss) * dper
    if reduction == "sum":
        return per.sum(), grad_loss * dper
    return per.sum() / used.sum(), grad_loss / used.sum() * dper


def log_softmax_t(x, temperature):
    z = f64(x) / temperature
    return z - lse(z)[:, None]


# ---- inputs -------------------------------------------------------------------------------------------

def _gen(seed):
    return torch.Generator().manual_seed(seed)


def logits(seed=0, n=N, v=V, dtype=torch.float32, grad=False):
    return (torch.randn(n, v, generator=_gen(seed)) * 2).to(dtype).requires_grad_(grad)


def targets(seed=1, n=N, v=V, ignored=(3, 17)):
    t = torch.randint(0, v, (n,), generator=_gen(seed))
    for i in ignored:
        t[i] = -100
    return t


def rows(seed=2, n=N, lo=0.2, hi=1.8, dtype=torch.float64):
    return (lo + (hi - lo) * torch.rand(n, generator=_gen(seed))).to(dtype)


def linear(seed=3, n=N, v=V, h=H, bias=True):
    g = _gen(seed)
    hid = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) * 0.5
    b = torch.randn(v, generator=g) * 0.5 if bias else None
    return hid, w, b


HANDLE = fusedce.Handle("cpu")  # a handle given: ops' general path (Call), not the lean one (_fast)


def _paths():
    return ({}, {"handle": HANDLE})


# ---- fusedce.ops: scale_rows --------------------------------------------------------------------------

@case
def ops_scale_rows_float():
    x = logits()
    want = f64(x) * 2.0
    assert ops.scale_rows(x, 2.0) is x
    close(x, want)


@case
def ops_scale_rows_int():
    x = logits()
    want = f64(x) * 3
    ops.scale_rows(x, 3)
    close(x, want)


@case
def ops_scale_rows_numpy_scalar():
    x = logits()
    want = f64(x) * 0.75
    ops.scale_rows(x, np.float32(0.75))
    close(x, want)


@case
def ops_scale_rows_float64_scalar_tensor():
    x = logits()
    want = f64(x) * 0.5
    ops.scale_rows(x, torch.tensor(0.5, dtype=torch.float64))
    close(x, want)


@case
def ops_scale_rows_float64_rows():
    x, f = logits(), rows()
    want = f64(x) * f64(f)[:, None]
    ops.scale_rows(x, f)
    close(x, want)


@case
def ops_scale_rows_numpy_float64_rows():
    x, f = logits(), rows().numpy()
    want = f64(x) * f[:, None]
    ops.scale_rows(x, f)
    close(x, want)


@case
def ops_scale_rows_list():
    x, f = logits(), rows().tolist()
    want = f64(x) * np.asarray(f)[:, None]
    ops.scale_rows(x, f)
    close(x, want)


@case
def ops_scale_rows_one_row():
    x = logits()[5].clone()
    want = f64(x) * 0.25
    ops.scale_rows(x, 0.25)
    close(x, want)


@case
def ops_scale_rows_padded_rows():
    base = logits(v=V + 8)
    x = base[:, :V]  # a strided view: rows padded
    want = f64(x) * 1.5
    ops.scale_rows(x, 1.5)
    close(x, want)
    close(base[:, V:], f64(logits(v=V + 8))[:, V:], what="padding")


@case
def ops_scale_rows_numpy():
    x = logits().numpy()
    want = f64(x) * 2.0
    ops.scale_rows(x, 2.0)
    close(x, want)
    f = rows().numpy()
    want = f64(x) * f[:, None]
    ops.scale_rows(x, f)
    close(x, want)


# ---- fusedce.ops: cross-entropy -----------------------------------------------------------------------

def _ce_fwd_grad(grad_loss, grad_entropy=None, reduction="mean", ref_gl=None, ref_ge=None):
    x, t = logits(), targets()
    ref = ce_ref(x, t, reduction=reduction, grad_loss=grad_loss if ref_gl is None else ref_gl,
                 grad_entropy=ref_ge if ref_ge is not None else (None if grad_entropy is None else f64(grad_entropy)))
    for kw in _paths():
        o = ops.cross_entropy_fwd(x, t, reduction=reduction, dlogits=True, entropy=grad_entropy is not None,
                                  grad_loss=grad_loss, grad_entropy=grad_entropy, **kw)
        close(o.loss, ref[0], what="loss %s" % kw)
        close(o.dlogits, ref[1], what="dlogits %s" % kw)


@case
def ops_cross_entropy_fwd_grad_loss_number():
    _ce_fwd_grad(0.5)


@case
def ops_cross_entropy_fwd_grad_loss_float64():
    _ce_fwd_grad(torch.tensor(0.5, dtype=torch.float64), ref_gl=0.5)


@case
def ops_cross_entropy_fwd_grad_loss_float64_rows():
    g = rows()
    _ce_fwd_grad(g, reduction="none", ref_gl=f64(g))


@case
def ops_cross_entropy_fwd_grad_loss_numpy_rows():
    g = rows().numpy().astype(np.float32)
    _ce_fwd_grad(g, reduction="none", ref_gl=g)


@case
def ops_cross_entropy_fwd_grad_loss_list():
    g = rows().tolist()
    _ce_fwd_grad(g, reduction="none", ref_gl=np.asarray(g))


@case
def ops_cross_entropy_fwd_grad_entropy_number():
    _ce_fwd_grad(0.5, 0.3, ref_ge=0.3)


@case
def ops_cross_entropy_fwd_grad_entropy_float64_rows():
    _ce_fwd_grad(rows(seed=4), rows(seed=5), reduction="none", ref_gl=f64(rows(seed=4)))


@case
def ops_cross_entropy_fwd_class_weights_numpy():
    x, t = logits(), targets()
    w = rows(n=V, seed=6).numpy().astype(np.float32)
    ref = ce_ref(x, t, weight=w, grad_loss=0.5)
    o = ops.cross_entropy_fwd(x, t, class_weights=w, dlogits=True, grad_loss=0.5)
    close(o.loss, ref[0])
    close(o.dlogits, ref[1])


@case
def ops_cross_entropy_fwd_targets_list():
    x, t = logits(), targets()
    ref = ce_ref(x, t, reduction="none")
    o = ops.cross_entropy_fwd(x, t.tolist(), reduction="none", dlogits=True)
    close(o.loss, ref[0])
    close(o.dlogits, ref[1])


@case
def ops_cross_entropy_fwd_numpy():
    x, t = logits().numpy(), targets().numpy()
    for g, rg, red in ((0.5, 0.5, "mean"), (rows().numpy(), rows().numpy(), "none"), (rows().tolist(), f64(rows()), "none"),
                       (rows(), f64(rows()), "none")):  # the last a float64 torch tensor in a numpy call
        ref = ce_ref(x, t, reduction=red, grad_loss=rg, grad_entropy=0.3)
        o = ops.cross_entropy_fwd(x, t, reduction=red, dlogits=True, entropy=True, grad_loss=g, grad_entropy=0.3)
        close(o.loss, ref[0])
        close(o.dlogits, ref[1])


def _ce_bwd(grad_loss, ref_gl, reduction="mean", lse_as=None, **extra):
    x, t = logits(), targets()
    ref = ce_ref(x, t, reduction=reduction, grad_loss=ref_gl, weight=extra.get("class_weights"))
    lse = torch.as_tensor(ref[2], dtype=torch.float32)
    for kw in _paths():
        d = ops.cross_entropy_bwd(x, t, lse if lse_as is None else lse_as(lse), grad_loss=grad_loss,
                                  reduction=reduction, **extra, **kw)
        close(d, ref[1], what=str(kw))


@case
def ops_cross_entropy_bwd_grad_loss_number():
    _ce_bwd(0.5, 0.5)


@case
def ops_cross_entropy_bwd_grad_loss_int():
    _ce_bwd(2, 2.0, reduction="sum")


@case
def ops_cross_entropy_bwd_grad_loss_float64():
    _ce_bwd(torch.tensor(0.5, dtype=torch.float64), 0.5)


@case
def ops_cross_entropy_bwd_grad_loss_float64_rows():
    _ce_bwd(rows(), f64(rows()), reduction="none")


@case
def ops_cross_entropy_bwd_grad_loss_list():
    _ce_bwd(rows().tolist(), f64(rows()), reduction="none")


@case
def ops_cross_entropy_bwd_numpy_lse_and_weights():
    w = rows(n=V, seed=6).numpy().astype(np.float32)
    _ce_bwd(0.5, 0.5, lse_as=lambda l: l.numpy(), class_weights=w)


@case
def ops_cross_entropy_bwd_numpy():
    x, t = logits().numpy(), targets().numpy()
    ref = ce_ref(x, t, reduction="none", grad_loss=f64(rows()))
    lse = ref[2].astype(np.float32)
    for g in (rows().numpy(), rows().tolist(), rows()):
        close(ops.cross_entropy_bwd(x, t, lse, grad_loss=g, reduction="none"), ref[1])
    ref = ce_ref(x, t, grad_loss=0.5)
    close(ops.cross_entropy_bwd(x, t, lse, grad_loss=0.5), ref[1])


def _ce_bwd_ex(grad_loss, grad_entropy, ref_gl, ref_ge, reduction="mean", entropy_as=None):
    x, t = logits(), targets()
    ref = ce_ref(x, t, reduction=reduction, grad_loss=ref_gl, grad_entropy=ref_ge)
    lse, ent = (torch.as_tensor(a, dtype=torch.float32) for a in (ref[2], ref[3]))
    for kw in _paths():
        d = ops.cross_entropy_bwd_ex(x, t, lse, entropy=ent if entropy_as is None else entropy_as(ent),
                                     grad_loss=grad_loss, grad_entropy=grad_entropy, reduction=reduction, **kw)
        close(d, ref[1], what=str(kw))


@case
def ops_cross_entropy_bwd_ex_numbers():
    _ce_bwd_ex(0.5, 0.3, 0.5, 0.3)


@case
def ops_cross_entropy_bwd_ex_float64():
    _ce_bwd_ex(torch.tensor(0.5, dtype=torch.float64), torch.tensor(0.3, dtype=torch.float64), 0.5, 0.3)


@case
def ops_cross_entropy_bwd_ex_float64_rows():
    _ce_bwd_ex(rows(seed=4), rows(seed=5), f64(rows(seed=4)), f64(rows(seed=5)), reduction="none")


@case
def ops_cross_entropy_bwd_ex_lists_numpy_entropy():
    _ce_bwd_ex(rows(seed=4).tolist(), rows(seed=5).numpy(), f64(rows(seed=4)), f64(rows(seed=5)), reduction="none",
               entropy_as=lambda e: e.numpy())


@case
def ops_cross_entropy_partial_combine_bwd():
    x, t = logits(), targets()
    w = rows(n=V, seed=6).numpy().astype(np.float32)
    ref = ce_ref(x, t, weight=w, grad_loss=0.5)
    kw = dict(vocab_total=V, class_weights=w)
    rec = ops.cross_entropy_partial(x, t.tolist(), vocab_start=0, **kw)
    out = ops.cross_entropy_combine(rec.unsqueeze(0), t.tolist(), **kw)
    close(out.loss, ref[0])
    close(out.lse, ref[2])
    d = ops.cross_entropy_bwd(x, t.tolist(), out.lse, grad_loss=0.5, vocab_start=0, **kw)
    close(d, ref[1])


# ---- fusedce.ops: logsumexp and softmax -------------------------------------------------------------

@case
def ops_logsumexp():
    x = logits()
    for kw in _paths():
        close(ops.logsumexp(x, scale=0.5, **kw), lse(0.5 * f64(x)))
    close(ops.logsumexp(x.numpy(), scale=0.5), lse(0.5 * f64(x)))


def _softmax_rows(temps):
    x = logits()
    ref_t = f64(temps) if not isinstance(temps, list) else np.asarray(temps)
    want = softmax(f64(x) / ref_t[:, None])
    for kw in _paths():
        o = ops.temp_softmax(x, temperatures=temps, logprobs=True, **kw)
        close(o.probs, want, what=str(kw))
        close(o.logprobs, np.log(want), what=str(kw))


@case
def ops_temp_softmax_temperatures_float64():
    _softmax_rows(rows())


@case
def ops_temp_softmax_temperatures_numpy_float64():
    _softmax_rows(rows().numpy())


@case
def ops_temp_softmax_temperatures_list():
    _softmax_rows(rows().tolist())


@case
def ops_temp_softmax_shard_lse_float64():
    x, T = logits(), 1.7
    full = torch.as_tensor(lse(f64(x) / T), dtype=torch.float64)
    want = softmax(f64(x) / T)
    for kw in _paths():
        o = ops.temp_softmax(x, temperature=T, vocab_start=0, vocab_total=V, lse=full, **kw)
        close(o.probs, want, what=str(kw))


@case
def ops_temp_softmax_numpy():
    x = logits().numpy()
    t = rows().numpy()
    close(ops.temp_softmax(x, temperatures=t).probs, softmax(f64(x) / t[:, None]))
    close(ops.temp_softmax(x, temperatures=t.tolist()).probs, softmax(f64(x) / t[:, None]))


# ---- fusedce.ops: knowledge distillation ------------------------------------------------------------

def _kd_setup(seed=7):
    s, teacher = logits(seed), logits(seed + 1)
    t = targets()
    return s, teacher, t, (t != -100).numpy()


@case
def ops_kd_loss_grad_loss_number():
    s, teacher, t, mask = _kd_setup()
    T = 2.0
    want = kd_ref(s, log_softmax_t(teacher, T), temperature=T, mask=mask, grad_loss=0.5)
    o = ops.kd_loss(s, teacher, targets=t, temperature=T, dstudent=True, grad_loss=0.5)
    close(o.loss, want[0])
    close(o.dstudent, want[1])


@case
def ops_kd_loss_grad_loss_float64_rows():
    s, teacher, t, mask = _kd_setup()
    g = rows()
    want = kd_ref(s, log_softmax_t(teacher, 1.0), reduction="none", mask=mask, grad_loss=f64(g))
    o = ops.kd_loss(s, teacher, targets=t, reduction="none", dstudent=True, grad_loss=g)
    close(o.loss, want[0])
    close(o.dstudent, want[1])


@case
def ops_kd_loss_targets_list_numpy_teacher():
    s, teacher, t, mask = _kd_setup()
    want = kd_ref(s, log_softmax_t(teacher, 1.0), mask=mask, grad_loss=2.0)
    o = ops.kd_loss(s, teacher.numpy(), targets=t.tolist(), dstudent=True, grad_loss=2)
    close(o.loss, want[0])
    close(o.dstudent, want[1])


def _topk(seed=9, k=5, n=N, v=V):
    g = _gen(seed)
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])
    lp = torch.log_softmax(torch.randn(n, k, generator=g), dim=1)
    return ids, lp


@case
def ops_kd_loss_topk_lists():
    s = logits(7)
    ids, lp = _topk()
    want = kd_ref(s, f64(lp), ids=ids.numpy(), grad_loss=0.5)
    o = ops.kd_loss(s, topk_ids=ids.tolist(), topk_logprobs=lp.numpy(), dstudent=True, grad_loss=0.5)
    close(o.loss, want[0])
    close(o.dstudent, want[1])


@case
def ops_kd_partial_combine_bwd():
    s, teacher, t, mask = _kd_setup()
    T = 1.5
    want = kd_ref(s, log_softmax_t(teacher, T), temperature=T, mask=mask, grad_loss=0.5)
    kw = dict(vocab_total=V, temperature=T)
    rec = ops.kd_partial(s, teacher.numpy(), vocab_start=0, **kw)
    loss, stats = ops.kd_combine(rec.unsqueeze(0), targets=t.tolist(), **kw)
    close(loss, want[0])
    for gl in (0.5, torch.tensor(0.5, dtype=torch.float64)):
        d = ops.kd_bwd(s, teacher, stats.numpy(), vocab_start=0, targets=t.tolist(), grad_loss=gl, **kw)
        close(d, want[1])


@case
def ops_kd_terms_topk():
    s = logits(7)
    ids, lp = _topk()
    t = targets()
    mask = (t != -100).numpy()
    want = kd_ref(s, f64(lp), ids=ids.numpy(), mask=mask, grad_loss=0.5)
    kw = dict(vocab_total=V, topk_ids=ids.tolist(), topk_logprobs=lp.numpy())
    rec = ops.kd_partial(s, vocab_start=0, **kw)
    _, stats = ops.kd_combine(rec.unsqueeze(0), vocab_total=V, targets=t.tolist(), loss=False)
    terms = ops.kd_terms_partial(s, row_stats=stats.numpy(), vocab_start=0, **kw)
    loss, stats = ops.kd_terms_combine(terms.unsqueeze(0), stats, vocab_total=V, targets=t.tolist())
    close(loss, want[0])
    d = ops.kd_bwd(s, row_stats=stats, vocab_start=0, targets=t.tolist(), grad_loss=0.5, **kw)
    close(d, want[1])


# ---- fusedce.ops: linear cross-entropy ---------------------------------------------------------------

def _lce_ref(hid, w, b, t, **kw):
    x = f64(hid) @ f64(w).T + (0 if b is None else f64(b))
    loss, d, l, ent = ce_ref(x, t, **kw)
    return loss, d @ f64(w), d.T @ f64(hid), d.sum(axis=0), l, ent


@case
def ops_linear_cross_entropy_fwd_numbers():
    hid, w, b = linear()
    t = targets()
    ref = _lce_ref(hid, w, b, t, grad_loss=0.5, grad_entropy=0.3)
    for kw in _paths():
        o = ops.linear_cross_entropy_fwd(hid, w, t, bias=b, entropy=True, dhidden=True, dweight=True, dbias=True,
                                         grad_loss=0.5, grad_entropy=0.3, **kw)
        close(o.loss, ref[0])
        for got, want in zip((o.dhidden, o.dweight, o.dbias), ref[1:4]):
            close(got, want, what=str(kw))


@case
def ops_linear_cross_entropy_fwd_float64_rows():
    hid, w, b = linear()
    t = targets()
    g, ge = rows(seed=4), rows(seed=5)
    ref = _lce_ref(hid, w, b, t, reduction="none", grad_loss=f64(g), grad_entropy=f64(ge))
    o = ops.linear_cross_entropy_fwd(hid, w, t.tolist(), bias=b.numpy(), reduction="none", entropy=True, dhidden=True,
                                     dweight=True, dbias=True, grad_loss=g, grad_entropy=ge.tolist())
    close(o.loss, ref[0])
    for got, want in zip((o.dhidden, o.dweight, o.dbias), ref[1:4]):
        close(got, want)


@case
def ops_linear_cross_entropy_bwd_numbers():
    hid, w, b = linear()
    t = targets()
    ref = _lce_ref(hid, w, b, t, grad_loss=0.5, grad_entropy=0.3)
    lse, ent = (torch.as_tensor(a, dtype=torch.float32) for a in ref[4:6])
    for kw in _paths():
        g = ops.linear_cross_entropy_bwd(hid, w, t, lse, bias=b, dbias=True, grad_loss=0.5, grad_entropy=0.3,
                                         entropy=ent, **kw)
        for got, want in zip(g, ref[1:4]):
            close(got, want, what=str(kw))


@case
def ops_linear_cross_entropy_bwd_converted():
    hid, w, b = linear()
    t = targets()
    g, ge = rows(seed=4), rows(seed=5)
    ref = _lce_ref(hid, w, b, t, reduction="none", grad_loss=f64(g), grad_entropy=f64(ge))
    lse, ent = (np.asarray(a, np.float32) for a in ref[4:6])
    out = ops.linear_cross_entropy_bwd(hid, w.numpy(), t.tolist(), lse, bias=b.numpy(), reduction="none",
                                       grad_loss=g, grad_entropy=ge.numpy(), entropy=ent)
    for got, want in zip(out, ref[1:4]):
        close(got, want)


@case
def ops_linear_cross_entropy_partial():
    hid, w, b = linear()
    t = targets()
    cw = rows(n=V, seed=6).numpy().astype(np.float32)
    ref = _lce_ref(hid, w, b, t, weight=cw, grad_loss=0.5)
    rec = ops.linear_cross_entropy_partial(hid, w, t.tolist(), vocab_start=0, vocab_total=V, bias=b, class_weights=cw)
    out = ops.cross_entropy_combine(rec.unsqueeze(0), t.tolist(), vocab_total=V, class_weights=cw)
    close(out.loss, ref[0])
    g = ops.linear_cross_entropy_bwd(hid, w, t.tolist(), out.lse, bias=b, grad_loss=0.5, class_weights=cw,
                                     vocab_start=0, vocab_total=V)
    for got, want in zip(g, ref[1:4]):
        close(got, want)


@case
def ops_linear_cross_entropy_numpy():
    hid, w, b = (a.numpy() for a in linear())
    t = targets().numpy()
    ref = _lce_ref(hid, w, b, t, grad_loss=0.5, grad_entropy=0.3)
    o = ops.linear_cross_entropy_fwd(hid, w, t, bias=b, entropy=True, dhidden=True, dweight=True, dbias=True,
                                     grad_loss=0.5, grad_entropy=0.3)
    close(o.loss, ref[0])
    for got, want in zip((o.dhidden, o.dweight, o.dbias), ref[1:4]):
        close(got, want)
    g = ops.linear_cross_entropy_bwd(hid, w, t, o.lse, bias=b, grad_loss=0.5, grad_entropy=0.3, entropy=o.entropy)
    for got, want in zip(g, ref[1:4]):
        close(got, want)


# ---- fusedce.ops: any other DLPack producer ------------------------------------------------------------

class Producer:
    """A minimal DLPack producer on the CPU (what CuPy or JAX arrays look like to the binding)."""

    def __init__(self, a):
        self.a = a
        self.shape, self.dtype = a.shape, a.dtype

    def __dlpack__(self, stream=None):
        return self.a.__dlpack__()

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


@case
def ops_dlpack_producer():
    x, t = logits().numpy(), targets().numpy()
    ref = ce_ref(x, t, grad_loss=0.5)
    d = ops.cross_entropy_bwd(Producer(x), Producer(t), Producer(ref[2].astype(np.float32)), grad_loss=0.5,
                              dlogits=Producer(np.empty_like(x)))
    close(d.a, ref[1])
    a = x.copy()
    ops.scale_rows(Producer(a), 2.0)
    close(a, f64(x) * 2)


# ---- fusedce.torch -------------------------------------------------------------------------------------

def _grad_of(x, loss_fn):
    x = x.detach().clone().requires_grad_(True)
    loss = loss_fn(x)
    return loss, x


@case
def torch_cross_entropy_plain_scaled_backward():
    x, t = logits(grad=True), targets()
    ref = ce_ref(x, t, grad_loss=0.5)
    loss = ft.cross_entropy(x, t)
    (loss * 0.5).backward()
    close(loss, ref[0])
    close(x.grad, ref[1])


@case
def torch_cross_entropy_noncontiguous_int32_weight_float64():
    # (B, C, T) logits: made rows by movedim + reshape (a copy), int32 targets, float64 class weights
    b, tt = 8, N // 8
    x = logits().reshape(b, tt, V).transpose(1, 2).detach().requires_grad_(True)
    t = targets().reshape(b, tt).to(torch.int32)
    w = rows(n=V, seed=6)
    x2 = f64(x.transpose(1, 2).reshape(-1, V))
    ref = ce_ref(x2, t.reshape(-1), weight=f64(w), grad_loss=0.5, reduction="sum")
    loss = ft.cross_entropy(x, t, weight=w, reduction="sum")
    loss.backward(torch.tensor(0.5))
    close(loss, ref[0])
    close(x.grad.transpose(1, 2).reshape(-1, V), ref[1])


@case
def torch_cross_entropy_small_int_targets():
    for dt in (torch.int16, torch.uint8):
        x, t = logits(grad=True), targets(ignored=())
        ref = ce_ref(x, t, grad_loss=0.5, reduction="mean")
        loss = ft.cross_entropy(x, t.to(dt))
        (loss * 0.5).backward()
        close(loss, ref[0], what=str(dt))
        close(x.grad, ref[1], what=str(dt))


@case
def torch_cross_entropy_one_row():
    x = logits()[4].detach().requires_grad_(True)
    t = targets()[4]
    ref = ce_ref(x[None], t[None], grad_loss=0.5)
    loss = ft.cross_entropy(x, t)
    (loss * 0.5).backward()
    close(loss, ref[0])
    close(x.grad, ref[1][0])


@case
def torch_cross_entropy_none_noncontiguous_upstream():
    x, t = logits(grad=True), targets()
    g = rows(n=2 * N, dtype=torch.float32)[::2]  # a strided upstream gradient
    ref = ce_ref(x, t, reduction="none", grad_loss=f64(g))
    loss = ft.cross_entropy(x, t, reduction="none")
    loss.backward(g)
    close(loss, ref[0])
    close(x.grad, ref[1])


@case
def torch_cross_entropy_inplace_scaled():
    x, t = logits(), targets()
    ref = ce_ref(x, t, grad_loss=0.5)
    leaf = x.clone().requires_grad_(True)
    y = leaf * 1.0  # the in-place backward overwrites its input: not the leaf
    loss = ft.cross_entropy(y, t, inplace_backward=True)
    (loss * 0.5).backward()
    close(loss, ref[0])
    close(leaf.grad, ref[1])


@case
def torch_cross_entropy_extras():
    x, t = logits(grad=True), targets()
    ref = ce_ref(x, t, weight=f64(rows(n=V, seed=6)), grad_loss=0.5, scale=0.5)
    out = ft.cross_entropy(x, t.to(torch.int32), weight=rows(n=V, seed=6), logit_scale=0.5, return_lse=True,
                           return_entropy=True)
    (out.loss * 0.5).backward()
    close(out.loss, ref[0])
    close(out.lse, ref[2])
    close(out.entropy, ref[3])
    close(x.grad, ref[1])


@case
def torch_linear_cross_entropy_noncontiguous_shift():
    hid, w, b = linear()
    bsz, tt = 8, N // 8
    e = hid.reshape(tt, bsz, H).transpose(0, 1).detach().requires_grad_(True)  # (B, T, H), not contiguous
    c = w.clone().requires_grad_(True)
    bias = b.clone().requires_grad_(True)
    labels = targets(ignored=()).reshape(bsz, tt).to(torch.int32)
    shifted = torch.cat([labels[:, 1:], torch.full((bsz, 1), -100, dtype=torch.int32)], 1)
    cw = rows(n=V, seed=6)
    ref = _lce_ref(e.reshape(-1, H), w, b, shifted.reshape(-1), weight=f64(cw), grad_loss=0.5)
    loss = ft.linear_cross_entropy(e, c, labels, bias, shift=True, class_weights=cw)
    (loss * 0.5).backward()
    close(loss, ref[0])
    close(e.grad.reshape(-1, H), ref[1])
    close(c.grad, ref[2])
    close(bias.grad, ref[3])


@case
def torch_linear_cross_entropy_none_backward():
    hid, w, b = linear()
    e, c = hid.clone().requires_grad_(True), w.clone().requires_grad_(True)
    t = targets()
    g = rows(n=2 * N, dtype=torch.float32)[::2]
    ref = _lce_ref(hid, w, None, t, reduction="none", grad_loss=f64(g))
    loss = ft.linear_cross_entropy(e, c, t.to(torch.int32), reduction="none")
    loss.backward(g)
    close(loss, ref[0])
    close(e.grad, ref[1])
    close(c.grad, ref[2])


@case
def torch_logprobs_entropy_backward():
    x, t = logits(grad=True), targets()
    T = 1.3
    ref = ce_ref(x, t, reduction="none", grad_loss=-0.5, grad_entropy=0.3, scale=1 / T)
    lp, ent = ft.logprobs_entropy(x, t.to(torch.int32), temperature=T)
    (lp.sum() * 0.5 + ent.sum() * 0.3).backward()
    close(lp, -ref[0])
    close(ent, ref[3])
    close(x.grad, ref[1])


@case
def torch_linear_logprobs_entropy_backward():
    hid, w, _ = linear()
    e, c = hid.clone().requires_grad_(True), w.clone().requires_grad_(True)
    t = targets()
    ref = _lce_ref(hid, w, None, t, reduction="none", grad_loss=-0.5, grad_entropy=0.3)
    lp, ent = ft.linear_logprobs_entropy(e, c, t.to(torch.int32))
    (lp.sum() * 0.5 + ent.sum() * 0.3).backward()
    close(lp, -ref[0])
    close(ent, ref[5])
    close(e.grad, ref[1])
    close(c.grad, ref[2])


@case
def torch_logsumexp_dim0_backward():
    x = logits(grad=True)
    want = lse(0.5 * f64(x).T)
    out = ft.logsumexp(x, dim=0, scale=0.5)
    (out.sum() * 0.5).backward()
    close(out, want)
    close(x.grad, 0.5 * 0.5 * softmax(0.5 * f64(x).T).T)
    close(ft.logsumexp(x.detach(), scale=0.5), lse(0.5 * f64(x)))


@case
def torch_temp_softmax_temperatures_float64():
    x = logits()
    temps = rows(n=2 * N)[::2]  # float64, strided
    want = softmax(f64(x) / f64(temps)[:, None])
    out = ft.temp_softmax(x, temperatures=temps, logprobs=True)
    close(out.probs, want)
    close(out.logprobs, np.log(want))
    close(ft.softmax(x, temperatures=temps), want)
    xt = x.T.contiguous().T  # column-major: the dim=0 path reshapes a copy
    close(ft.temp_softmax(xt.T, dim=0, temperatures=temps).probs.T, want)


@case
def torch_temp_softmax_backward():
    x = logits(grad=True)
    temps = rows()
    p = ft.temp_softmax(x, temperatures=temps).probs
    g = rows(n=N * V, seed=8, dtype=torch.float32).reshape(N, V)
    p.backward(g)
    pp = softmax(f64(x) / f64(temps)[:, None])
    gg = f64(g)
    want = pp * (gg - (gg * pp).sum(1, keepdims=True)) / f64(temps)[:, None]
    close(p, pp)
    close(x.grad, want)


@case
def torch_kd_loss_backward():
    s, teacher, t, mask = _kd_setup()
    s.requires_grad_(True)
    T = 2.0
    want = kd_ref(s, log_softmax_t(teacher, T), temperature=T, mask=mask, grad_loss=0.5)
    loss = ft.kd_loss(s, teacher, t.to(torch.int32), temperature=T)
    (loss * 0.5).backward()
    close(loss, want[0])
    close(s.grad, want[1])


@case
def torch_kd_loss_topk_converted():
    s = logits(7, grad=True)
    ids, lp = _topk()
    ids32 = ids.to(torch.int32).T.contiguous().T  # int32, column-major
    want = kd_ref(s, f64(lp), ids=ids.numpy(), grad_loss=0.5)
    loss = ft.kd_loss_topk(s, ids32, lp.double())
    (loss * 0.5).backward()
    close(loss, want[0])
    close(s.grad, want[1])


@case
def torch_vocab_parallel_cross_entropy():
    x, t = logits(grad=True), targets()
    w = rows(n=V, seed=6)
    ref = ce_ref(x, t, weight=f64(w), grad_loss=0.5)
    loss = ft.vocab_parallel_cross_entropy(x, t.to(torch.int32), weight=w)
    (loss * 0.5).backward()
    close(loss, ref[0])
    close(x.grad, ref[1])


@case
def torch_vocab_parallel_logprobs_entropy():
    x, t = logits(grad=True), targets()
    ref = ce_ref(x, t, reduction="none", grad_loss=-0.5, grad_entropy=0.3)
    lp, ent = ft.vocab_parallel_logprobs_entropy(x, t.to(torch.int32))
    (lp.sum() * 0.5 + ent.sum() * 0.3).backward()
    close(lp, -ref[0])
    close(ent, ref[3])
    close(x.grad, ref[1])


@case
def torch_vocab_parallel_kd():
    s, teacher, t, mask = _kd_setup()
    s.requires_grad_(True)
    want = kd_ref(s, log_softmax_t(teacher, 2.0), temperature=2.0, mask=mask, grad_loss=0.5)
    loss = ft.vocab_parallel_kd_loss(s, teacher, t.to(torch.int32), temperature=2.0)
    (loss * 0.5).backward()
    close(loss, want[0])
    close(s.grad, want[1])
    s2 = logits(7, grad=True)
    ids, lp = _topk()
    want = kd_ref(s2, f64(lp), ids=ids.numpy(), grad_loss=0.5)
    loss = ft.vocab_parallel_kd_loss_topk(s2, ids.to(torch.int32).T.contiguous().T, lp.double())
    (loss * 0.5).backward()
    close(loss, want[0])
    close(s2.grad, want[1])


@case
def torch_vocab_parallel_linear_cross_entropy():
    hid, w, b = linear()
    t = targets()
    for red, g in (("mean", torch.tensor(0.5)), ("none", rows(n=2 * N, dtype=torch.float32)[::2])):
        e, c, bias = (a.clone().requires_grad_(True) for a in (hid, w, b))
        ref = _lce_ref(hid, w, b, t, reduction=red, grad_loss=f64(g))
        loss = ft.vocab_parallel_linear_cross_entropy(e, c, t.to(torch.int32), bias, reduction=red)
        loss.backward(g)
        close(loss, ref[0], what=red)
        for got, want in zip((e.grad, c.grad, bias.grad), ref[1:4]):
            close(got, want, what=red)


@case
def torch_vocab_parallel_logsumexp_softmax():
    x = logits(grad=True)
    out = ft.vocab_parallel_logsumexp(x, scale=0.5)
    (out.sum() * 0.5).backward()
    close(out, lse(0.5 * f64(x)))
    close(x.grad, 0.25 * softmax(0.5 * f64(x)))
    x = logits(grad=True)
    p = ft.vocab_parallel_softmax(x, 1.5)
    g = rows(n=N * V, seed=8, dtype=torch.float32).reshape(N, V)
    p.backward(g)
    pp, gg = softmax(f64(x) / 1.5), f64(g)
    close(p, pp)
    close(x.grad, pp * (gg - (gg * pp).sum(1, keepdims=True)) / 1.5)


# ---- fusedce.transformers ---------------------------------------------------------------------------

@case
def transformers_causal_lm_loss():
    hid, w, _ = linear()
    bsz, tt = 8, N // 8
    h = hid.double().reshape(bsz, tt, H).requires_grad_(True)  # float64 hidden states: cast to the weight's dtype
    labels = targets(ignored=()).reshape(bsz, tt)
    shifted = torch.cat([labels[:, 1:], torch.full((bsz, 1), -100)], 1)
    ref = _lce_ref(h.reshape(-1, H), w, None, shifted.reshape(-1), reduction="sum", grad_loss=1 / 37)
    loss = fhf.causal_lm_loss(h, w, labels.to(torch.int32), num_items_in_batch=37)
    loss.backward()
    close(loss, ref[0] / 37)
    close(h.grad.reshape(-1, H), ref[1])


@case
def transformers_loss_from_logits_and_kd():
    bsz, tt = 8, N // 8
    x = logits().reshape(bsz, tt, V).requires_grad_(True)
    labels = targets(ignored=()).reshape(bsz, tt)
    shifted = torch.cat([labels[:, 1:], torch.full((bsz, 1), -100)], 1).reshape(-1)
    ref = ce_ref(x.reshape(-1, V), shifted)
    loss = fhf.causal_lm_loss_from_logits(x, labels.to(torch.int32))
    loss.backward()
    close(loss, ref[0])
    close(x.grad.reshape(-1, V), ref[1])
    s = logits(7).reshape(bsz, tt, V).requires_grad_(True)
    teacher = logits(8).reshape(bsz, tt, V)
    want = kd_ref(s.reshape(-1, V), log_softmax_t(teacher.reshape(-1, V), 2.0), temperature=2.0,
                  mask=(shifted != -100).numpy())
    loss = fhf.kd_loss(s, teacher, labels=labels.to(torch.int32), temperature=2.0, scale_by_t2=False)
    loss.backward()
    close(loss, want[0])
    close(s.grad.reshape(-1, V), want[1])


def main(argv):
    if argv[:1] == ["--list"]:
        print("\n".join(CASES))
        return 0
    names = argv or list(CASES)
    for name in names:
        try:
            CASES[name]()
            print("PASS %s" % name, flush=True)
        except Exception as e:  # noqa: BLE001 - reported to the parent test
            msg = "".join(traceback.format_exception_only(type(e), e)).strip().replace("\n", " | ")
            print("FAIL %s: %s" % (name, msg[:3000]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
