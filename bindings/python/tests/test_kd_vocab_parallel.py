"""Vocabulary-parallel knowledge distillation through the Python binding (CPU backend): student and teacher
split into shards, kd_partial per shard, the records stacked in rank order, kd_combine, and each shard's
kd_bwd, against the unsharded kd_loss and a float64 reference."""
import numpy as np
import pytest

import fusedce

rng = np.random.default_rng(11)


def _log_softmax(z):
    m = z.max(axis=1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=1, keepdims=True))


@pytest.mark.parametrize("widths,pad", [([53], 0), ([20, 33], 0), ([1, 25, 27], 4)])
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl"])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_shards_match_the_whole_vocabulary(widths, pad, divergence, reduction):
    n, v, temp = 7, 53, 1.7
    s = (rng.standard_normal((n, v)) * 2).astype(np.float32)
    t = (rng.standard_normal((n, v)) * 2).astype(np.float32)
    tg = rng.integers(0, v, n)
    tg[2] = -100
    opts = dict(divergence=divergence, temperature=temp, scale_by_t2=True, reduction=reduction)
    starts = np.cumsum([0] + widths)[:-1]
    widths = widths[:-1] + [v - starts[-1]]
    shards = []
    for r, (b, w) in enumerate(zip(starts, widths)):
        cols = w + (pad if r == len(widths) - 1 else 0)
        ps, pt = np.full((n, cols), np.nan, np.float32), np.full((n, cols), np.nan, np.float32)
        ps[:, :w], pt[:, :w] = s[:, b:b + w], t[:, b:b + w]
        shards.append((int(b), ps, pt))
    kw = dict(divergence=divergence, temperature=temp)
    records = np.stack([fusedce.kd_partial(a, b, vocab_start=st, vocab_total=v, **kw) for st, a, b in shards])
    assert records.shape == (len(shards), n, fusedce.ops.KD_RECORD_FIELDS)
    loss, stats = fusedce.kd_combine(records, vocab_total=v, targets=tg, **opts)
    g = np.linspace(0.5, 1.5, n).astype(np.float32) if reduction == "none" else np.float32(1.3)
    whole = fusedce.kd_loss(s, t, targets=tg, dstudent=True, grad_loss=g, **opts)
    np.testing.assert_allclose(np.asarray(loss, np.float64), np.asarray(whole.loss, np.float64), rtol=2e-5,
                               atol=2e-6)
    lq, lp = _log_softmax(s.astype(np.float64) / temp), _log_softmax(t.astype(np.float64) / temp)
    rows = (np.exp(lp) * (lp - lq)).sum(1) if divergence == "forward_kl" else (np.exp(lq) * (lq - lp)).sum(1)
    rows = np.where(tg == -100, 0.0, rows * temp * temp)
    want = rows if reduction == "none" else rows.sum() / (np.count_nonzero(tg != -100) if reduction == "mean" else 1)
    np.testing.assert_allclose(np.asarray(loss, np.float64), want, rtol=2e-5, atol=2e-6)
    for st, a, b in shards:
        d = fusedce.kd_bwd(a, b, stats, vocab_start=st, vocab_total=v, targets=tg, grad_loss=g, **opts)
        w = min(a.shape[1], v - st)
        np.testing.assert_allclose(d[:, :w], whole.dstudent[:, st:st + w], rtol=1e-4, atol=1e-6)
        assert (d[:, w:] == 0).all()


def test_jsd_and_topk_are_not_implemented():
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(NotImplementedError, match="JSD"):
        fusedce.kd_partial(x, x, vocab_start=0, vocab_total=8, divergence="jsd")
    with pytest.raises(fusedce.InvalidArgumentError, match="vocab_total"):
        fusedce.kd_partial(x, x, vocab_start=0, vocab_total=0)
