"""float64 numpy references of every op, written from the header's formulas (not from the library)."""
import numpy as np


def lse(z, axis=-1):
    m = np.max(z, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return np.squeeze(m, axis) + np.log(np.sum(np.exp(z - m), axis=axis))


def log_softmax(z, axis=-1):
    return z - np.expand_dims(lse(z, axis), axis)


def cross_entropy(x, t, *, reduction="mean", ignore_index=-100, label_smoothing=0.0, z_loss_scale=0.0,
                  softcap=0.0, logit_scale=1.0, class_weights=None):
    """Returns dict(loss, z_loss, lse, entropy, argmax) for logits x [N, V], targets t [N] (0-based)."""
    x = np.asarray(x, np.float64)
    n, v = x.shape
    w = np.ones(v) if class_weights is None else np.asarray(class_weights, np.float64)
    e, q, c, s = label_smoothing, z_loss_scale, softcap, logit_scale
    z = c * np.tanh(s * x / c) if c > 0 else s * x
    l = lse(z)
    p = np.exp(z - l[:, None])
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.sum(np.where(p > 0, p * np.log(p), 0.0), axis=1)
    loss, zl, den = np.zeros(n), np.zeros(n), 0.0
    for i in range(n):
        if t[i] == ignore_index:
            continue
        ti = t[i]
        loss[i] = (1 - e) * w[ti] * (l[i] - z[i, ti]) + e / v * np.sum(w * (l[i] - z[i])) + q * l[i] ** 2
        zl[i] = q * l[i] ** 2
        den += w[ti]

    def red(a):
        if reduction == "none":
            return a
        if reduction == "sum":
            return a.sum()
        return a.sum() / den if den > 0 else 0.0

    return dict(loss=red(loss), z_loss=red(zl), lse=l, entropy=ent, argmax=np.argmax(x, axis=1))


def fd_grad(f, x, g=1.0, h=1e-6):
    """d(sum(g * f(x)))/dx by central differences (x float64)."""
    x = np.array(x, np.float64)
    out = np.zeros_like(x)
    g = np.asarray(g, np.float64)
    for i in np.ndindex(x.shape):
        xp = x.copy()
        xp[i] += h
        xm = x.copy()
        xm[i] -= h
        out[i] = (np.sum(g * f(xp)) - np.sum(g * f(xm))) / (2 * h)
    return out


def _xlogratio(p, lp, lq):
    with np.errstate(invalid="ignore"):
        return np.where(p > 0, p * (lp - lq), 0.0)


def kd_terms(logp, logq, divergence, beta):
    """Sum over the support of the per-element divergence terms (teacher logp, student logq)."""
    p, q = np.exp(logp), np.exp(logq)
    if divergence == "forward_kl" or (divergence == "jsd" and beta == 0):
        return np.sum(_xlogratio(p, logp, logq))
    if divergence == "reverse_kl" or (divergence == "jsd" and beta == 1):
        return np.sum(_xlogratio(q, logq, logp))
    with np.errstate(divide="ignore"):
        logm = np.log(beta * p + (1 - beta) * q)
    return beta * np.sum(_xlogratio(p, logp, logm)) + (1 - beta) * np.sum(_xlogratio(q, logq, logm))


def _reduce_rows(loss, used, reduction):
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / used if used else 0.0


def kd(student, teacher, *, targets=None, divergence="forward_kl", beta=0.5, temperature=1.0, scale_by_t2=False,
       reduction="mean", ignore_index=-100):
    s, t = np.asarray(student, np.float64), np.asarray(teacher, np.float64)
    n = s.shape[0]
    loss, used = np.zeros(n), 0
    for i in range(n):
        if targets is not None and targets[i] == ignore_index:
            continue
        used += 1
        lq, lp = log_softmax(s[i] / temperature), log_softmax(t[i] / temperature)
        loss[i] = kd_terms(lp, lq, divergence, beta) * (temperature ** 2 if scale_by_t2 else 1.0)
    return _reduce_rows(loss, used, reduction)


def kd_topk(student, ids, lps, *, divergence="forward_kl", beta=0.5, temperature=1.0, topk_norm="full_vocab",
            scale_by_t2=False, reduction="mean"):
    s = np.asarray(student, np.float64)
    n = s.shape[0]
    loss, used = np.zeros(n), 0
    for i in range(n):
        sel = ids[i] >= 0
        if not sel.any():
            continue
        used += 1
        zs = s[i] / temperature
        idn = ids[i][sel]
        lp = log_softmax(np.asarray(lps[i][sel], np.float64) / temperature)
        lq = log_softmax(zs)[idn] if topk_norm == "full_vocab" else log_softmax(zs[idn])
        loss[i] = kd_terms(lp, lq, divergence, beta) * (temperature ** 2 if scale_by_t2 else 1.0)
    return _reduce_rows(loss, used, reduction)


def softmax_t(x, temperature):
    x = np.asarray(x, np.float64)
    if temperature == 0:
        k = np.argmax(x, axis=1)
        p = np.zeros_like(x)
        p[np.arange(len(k)), k] = 1
        with np.errstate(divide="ignore"):
            return p, np.log(p)
    lp = log_softmax(x / temperature)
    return np.exp(lp), lp
