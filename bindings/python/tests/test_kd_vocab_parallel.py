"""Vocabulary-parallel knowledge distillation through the Python binding (CPU backend): student and teacher
split into shards, kd_partial per shard, the records stacked in rank order, kd_combine (JSD: then
kd_terms_partial per shard, stacked, kd_terms_combine), and each shard's kd_bwd, against the unsharded
kd_loss and a float64 reference."""
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


def _shards(s, t, widths, pad):
    """(vocab_start, student shard, teacher shard) per rank; the last shard padded with NaN columns (never read)."""
    n, v = s.shape
    starts = np.cumsum([0] + widths)[:-1]
    widths = widths[:-1] + [v - starts[-1]]
    out = []
    for r, (b, w) in enumerate(zip(starts, widths)):
        cols = w + (pad if r == len(widths) - 1 else 0)
        ps, pt = np.full((n, cols), np.nan, np.float32), np.full((n, cols), np.nan, np.float32)
        ps[:, :w], pt[:, :w] = s[:, b:b + w], t[:, b:b + w]
        out.append((int(b), ps, pt))
    return out


def _jsd_reference(s, t, temp, beta):
    """float64 per-row JSD b*KL(P||M) + (1-b)*KL(Q||M), M = b*P + (1-b)*Q (P the teacher, Q the student at
    temperature T), and its gradient in z = s / T: (1-b) q_j (log(q_j/m_j) - S), S = sum_k q_k log(q_k/m_k)."""
    lq, lp = _log_softmax(s.astype(np.float64) / temp), _log_softmax(t.astype(np.float64) / temp)
    q, p = np.exp(lq), np.exp(lp)
    lm = np.log(beta * p + (1 - beta) * q)
    rows = beta * (p * (lp - lm)).sum(1) + (1 - beta) * (q * (lq - lm)).sum(1)
    big_s = (q * (lq - lm)).sum(1, keepdims=True)
    dz = (1 - beta) * q * ((lq - lm) - big_s)
    return rows, dz, (1 - beta) * big_s[:, 0]


@pytest.mark.parametrize("widths,pad", [([53], 3), ([20, 33], 0), ([29, 24], 5), ([1, 25, 27], 4)])
@pytest.mark.parametrize("beta", [0.3, 0.5, 0.85])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_jsd_shards_match_the_whole_vocabulary(widths, pad, beta, reduction):
    """JSD's two exchanges: kd_combine gives only the rows' statistics (A NaN), the terms' records give the
    loss and A; loss and each shard's dstudent against kd_loss of the whole rows and a float64 reference."""
    n, v, temp = 7, 53, 1.7
    s = (rng.standard_normal((n, v)) * 2).astype(np.float32)
    t = (rng.standard_normal((n, v)) * 2).astype(np.float32)
    s[4] = t[4]  # identical distributions: exactly 0
    tg = rng.integers(0, v, n)
    tg[2] = -100
    opts = dict(divergence="jsd", beta=beta, temperature=temp, scale_by_t2=True, reduction=reduction)
    pkw = dict(divergence="jsd", beta=beta, temperature=temp)
    shards = _shards(s, t, widths, pad)
    assert fusedce.kd_needs_terms("jsd", beta)
    records = np.stack([fusedce.kd_partial(a, b, vocab_start=st, vocab_total=v, **pkw) for st, a, b in shards])
    loss, stats = fusedce.kd_combine(records, vocab_total=v, targets=tg, **opts)
    assert loss is None and stats.shape == (n, fusedce.ops.KD_ROW_STATS_FIELDS)
    assert np.isnan(stats[:, 4]).all() and np.isfinite(stats[:, :4]).all()
    terms = []
    for st, a, b in shards:
        out = np.full((n, fusedce.ops.KD_TERMS_RECORD_FIELDS), np.nan, np.float32)  # poisoned: fully written
        assert fusedce.kd_terms_partial(a, b, stats, vocab_start=st, vocab_total=v, records=out, **pkw) is out
        assert np.isfinite(out).all()
        terms.append(out)
    terms = np.stack(terms)
    assert terms.shape == (len(shards), n, fusedce.ops.KD_TERMS_RECORD_FIELDS)
    kept = stats[:, :4].copy()
    loss, stats2 = fusedce.kd_terms_combine(terms, stats, vocab_total=v, targets=tg, **opts)
    assert stats2 is stats and np.array_equal(stats[:, :4], kept)
    g = np.linspace(0.5, 1.5, n).astype(np.float32) if reduction == "none" else np.float32(1.3)
    whole = fusedce.kd_loss(s, t, targets=tg, dstudent=True, grad_loss=g, **opts)
    np.testing.assert_allclose(np.asarray(loss, np.float64), np.asarray(whole.loss, np.float64), rtol=2e-5,
                               atol=2e-6)
    rows, dz, big_a = _jsd_reference(s, t, temp, beta)
    np.testing.assert_allclose(stats[:, 4], big_a, rtol=2e-5, atol=2e-6)
    keep = tg != -100
    rows = np.where(keep, rows * temp * temp, 0.0)
    count = np.count_nonzero(keep)
    want = rows if reduction == "none" else rows.sum() / (count if reduction == "mean" else 1)
    np.testing.assert_allclose(np.asarray(loss, np.float64), want, rtol=2e-5, atol=2e-6)
    if reduction == "none":
        assert loss[4] == 0 and loss[2] == 0
    # d loss / d s = dz / T * T^2 (scale_by_t2) * upstream (/ count for the mean), 0 at masked rows
    up = g.astype(np.float64)[:, None] if reduction == "none" else float(g) / (count if reduction == "mean" else 1)
    dwant = np.where(keep[:, None], dz * temp * up, 0.0)
    for st, a, b in shards:
        out = np.full(a.shape, np.nan, np.float32)  # poisoned: padding columns must come back 0
        d = fusedce.kd_bwd(a, b, stats, vocab_start=st, vocab_total=v, targets=tg, grad_loss=g, dstudent=out,
                           **opts)
        assert d is out
        w = min(a.shape[1], v - st)
        np.testing.assert_allclose(d[:, :w], whole.dstudent[:, st:st + w], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(d[:, :w], dwant[:, st:st + w], rtol=2e-4, atol=1e-6)
        assert (d[:, w:] == 0).all()


@pytest.mark.parametrize("divergence,beta,like", [("jsd", 0.0, "forward_kl"), ("jsd", 1.0, "reverse_kl"),
                                                  ("forward_kl", 0.5, "forward_kl"),
                                                  ("reverse_kl", 0.5, "reverse_kl")])
def test_kl_takes_one_exchange_and_the_terms_agree(divergence, beta, like):
    """KL (and JSD at beta 0 or 1, exactly KL): kd_combine gives the loss at once; the second exchange gives the
    same loss and A another way."""
    n, v, temp = 5, 41, 0.9
    s = (rng.standard_normal((n, v)) * 2).astype(np.float32)
    t = (rng.standard_normal((n, v)) * 2).astype(np.float32)
    opts = dict(divergence=divergence, beta=beta, temperature=temp, reduction="none")
    pkw = dict(divergence=divergence, beta=beta, temperature=temp)
    shards = _shards(s, t, [17, 24], 2)
    assert not fusedce.kd_needs_terms(divergence, beta)
    rec = np.stack([fusedce.kd_partial(a, b, vocab_start=st, vocab_total=v, **pkw) for st, a, b in shards])
    loss, stats = fusedce.kd_combine(rec, vocab_total=v, **opts)
    want = fusedce.kd_loss(s, t, divergence=like, temperature=temp, reduction="none").loss
    np.testing.assert_allclose(loss, want, rtol=2e-5, atol=2e-6)
    a_first = stats[:, 4].copy()
    terms = np.stack([fusedce.kd_terms_partial(a, b, stats, vocab_start=st, vocab_total=v, **pkw)
                      for st, a, b in shards])
    loss2, _ = fusedce.kd_terms_combine(terms, stats, vocab_total=v, **opts)
    np.testing.assert_allclose(loss2, want, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(stats[:, 4], a_first, rtol=2e-5, atol=2e-6)


def test_kd_needs_terms_reads_beta_as_fp32():
    assert fusedce.kd_needs_terms("jsd", 0.5) and fusedce.kd_needs_terms(fusedce.ops._DIVERGENCES["jsd"], 0.5)
    assert not fusedce.kd_needs_terms("jsd", 1e-50)  # 0 in fp32: forward KL
    assert not fusedce.kd_needs_terms("jsd", 1 - 1e-10)  # 1 in fp32: reverse KL
    assert not fusedce.kd_needs_terms("forward_kl", 0.5) and not fusedce.kd_needs_terms("reverse_kl", 0.5)
    x = np.zeros((2, 4), np.float32)
    rec = fusedce.kd_partial(x, x, vocab_start=0, vocab_total=4, divergence="jsd", beta=1e-50)[None]
    loss, _ = fusedce.kd_combine(rec, vocab_total=4, divergence="jsd", beta=1e-50)
    assert loss == 0


def test_bad_calls_raise():
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(fusedce.InvalidArgumentError, match="vocab_total"):
        fusedce.kd_partial(x, x, vocab_start=0, vocab_total=0)
    with pytest.raises(fusedce.InvalidArgumentError, match="beta"):
        fusedce.kd_partial(x, x, vocab_start=0, vocab_total=8, divergence="jsd", beta=1.5)
    rec = fusedce.kd_partial(x, x, vocab_start=0, vocab_total=8, divergence="jsd")[None]
    with pytest.raises(fusedce.InvalidArgumentError, match="row_stats"):
        fusedce.kd_combine(rec, vocab_total=8, divergence="jsd", row_stats=False)
    loss, stats = fusedce.kd_combine(rec, vocab_total=8, divergence="jsd")
    terms = fusedce.kd_terms_partial(x, x, stats, vocab_start=0, vocab_total=8, divergence="jsd")[None]
    with pytest.raises(fusedce.InvalidArgumentError, match="row_stats"):
        fusedce.kd_terms_combine(terms, None, vocab_total=8, divergence="jsd")
    with pytest.raises(fusedce.ShapeMismatchError):
        fusedce.kd_terms_combine(rec, stats, vocab_total=8, divergence="jsd")  # [W, N, 7], not [W, N, 5]
    with pytest.raises(fusedce.ShapeMismatchError):
        fusedce.kd_terms_partial(x, x, stats[:, :4].copy(), vocab_start=0, vocab_total=8, divergence="jsd")
    # the C contract: a loss in JSD's first combine is refused (the binding passes none)
    from fusedce._tensor import Call
    c = Call(rec)
    o = fusedce.ops._kd_options(c, "jsd", 0.5, 1.0, False, "full_vocab", "mean", -100, 0, 8)
    loss_a, stats_a = np.zeros((), np.float32), np.zeros((2, 5), np.float32)
    with pytest.raises(fusedce.InvalidArgumentError, match="loss"):
        c.run("fce_kd_combine", c.dl(rec), fusedce.ffi.NULL, o, c.dl(loss_a, True), c.dl(stats_a, True))


@pytest.mark.parametrize("pad", [0, 3])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_vocab_parallel_jsd_one_process(pad, reduction):
    """vocab_parallel_kd_loss with JSD without a process group (one shard, padded): the loss and the student's
    gradient through autograd against kd_loss and torch's float64 JSD."""
    torch = pytest.importorskip("torch")
    import fusedce.torch as ft
    n, v, temp, beta = 6, 37, 1.3, 0.35
    g = torch.Generator().manual_seed(4)
    s = torch.randn(2, n // 2, v, generator=g) * 2
    t = torch.randn(2, n // 2, v, generator=g) * 2
    tg = torch.randint(0, v, (2, n // 2), generator=g)
    tg[1, 0] = -100
    sp = torch.cat([s, torch.full((2, n // 2, pad), float("nan"))], -1).requires_grad_()
    tp = torch.cat([t, torch.full((2, n // 2, pad), float("nan"))], -1)
    loss = ft.vocab_parallel_kd_loss(sp, tp, tg, divergence="jsd", beta=beta, temperature=temp, scale_by_t2=True,
                                     reduction=reduction, vocab_start=0, vocab_total=v)
    up = torch.rand(loss.shape, generator=g)
    (loss * up).sum().backward()
    whole = ft.kd_loss(s, t, tg, divergence="jsd", beta=beta, temperature=temp, scale_by_t2=True, reduction=reduction)
    torch.testing.assert_close(loss.detach(), whole, rtol=2e-5, atol=2e-6)
    x64 = s.double().requires_grad_()
    lq, lp = torch.log_softmax(x64 / temp, -1), torch.log_softmax(t.double() / temp, -1)
    lm = torch.logaddexp(lp + np.log(beta), lq + np.log(1 - beta))
    rows = (beta * (lp.exp() * (lp - lm)).sum(-1) + (1 - beta) * (lq.exp() * (lq - lm)).sum(-1)) * temp ** 2
    keep = tg != -100
    rows = torch.where(keep, rows, torch.zeros((), dtype=torch.float64))
    ref = rows if reduction == "none" else rows.sum() / keep.sum()
    (ref * up.double()).sum().backward()
    assert float((loss.detach().double() - ref.detach()).abs().max()) < 2e-5
    assert float((sp.grad[..., :v].double() - x64.grad).abs().max()) < 1e-5
    assert (sp.grad[..., v:] == 0).all()


# ---- a top-K teacher over vocabulary shards ---------------------------------------------------------------

def _student_shards(s, widths, pad):
    """(vocab_start, student shard) per rank; the last shard padded with NaN columns (never read)."""
    return [(st, a) for st, a, _ in _shards(s, s, widths, pad)]


def _topk_reference(s, ids, lps, temp, divergence, beta, topk_norm):
    """float64 per-row divergence against a top-K teacher, and its gradient in z = s / T, written from the
    header: the teacher p = softmax(lps / T) over the used slots (ids >= 0), the student's log q_k at those ids
    from log_softmax(z) over the whole vocabulary ("full_vocab") or over the used ids ("renormalize"), the terms
    summed over the used slots only. With g_k = dL/dlog q_k (forward KL -p_k; reverse KL q_k (log q_k/p_k + 1);
    JSD (1-beta) q_k log(q_k/m_k)) and r the student's softmax over the normalizing set:
    dL/dz_j = sum_k g_k [j == id_k] - r_j sum_k g_k. Rows without a used slot: (0, 0, unused)."""
    s = s.astype(np.float64)
    n, v = s.shape
    rows, dz, used = np.zeros(n), np.zeros((n, v)), np.zeros(n, bool)
    for i in range(n):
        sel = ids[i] >= 0
        if not sel.any():
            continue
        used[i] = True
        idn = ids[i][sel]
        z = s[i] / temp
        lp = _log_softmax(lps[i][sel].astype(np.float64)[None] / temp)[0]
        if topk_norm == "full_vocab":
            lr = _log_softmax(z[None])[0]
            lq, r = lr[idn], np.exp(lr)
        else:
            lq = _log_softmax(z[idn][None])[0]
            r = np.zeros(v)
            r[idn] = np.exp(lq)
        p, q = np.exp(lp), np.exp(lq)
        if divergence == "forward_kl":
            rows[i], g = (p * (lp - lq)).sum(), -p
        elif divergence == "reverse_kl":
            rows[i], g = (q * (lq - lp)).sum(), q * (lq - lp + 1)
        else:
            lm = np.log(beta * p + (1 - beta) * q)
            rows[i] = beta * (p * (lp - lm)).sum() + (1 - beta) * (q * (lq - lm)).sum()
            g = (1 - beta) * q * (lq - lm)
        dz[i, idn] += g
        dz[i] -= r * g.sum()
    return rows, dz, used


def _topk_teacher(n, v, k, widths):
    """ids [N, K] (distinct per row; an unused slot; row 0's ids all in the last shard, row 5's all in the
    first) and log-probabilities [N, K] fp32 summing below 1."""
    ids = np.stack([rng.permutation(v)[:k] for _ in range(n)]).astype(np.int64)
    ids[0] = np.arange(v - k, v)[::-1]
    ids[5] = np.arange(0, k) if widths[0] >= k else -1
    ids[5, 0] = 0
    ids[1, 2] = -1
    lps = np.log(rng.random((n, k)) * 0.2 + 1e-3).astype(np.float32)
    return ids, lps


def _topk_flow(shards, ids, lps, v, tg, opts, pkw, g):
    """The five steps over the shards: partial, combine without the loss, terms, terms' combine, bwd."""
    tkw = dict(topk_ids=ids, topk_logprobs=lps)
    rec = np.stack([fusedce.kd_partial(a, vocab_start=st, vocab_total=v, **tkw, **pkw) for st, a in shards])
    assert rec.shape == (len(shards), len(ids), fusedce.ops.KD_RECORD_FIELDS)
    first, stats = fusedce.kd_combine(rec, vocab_total=v, targets=tg, loss=False, **opts)
    assert first is None and stats.shape == (len(ids), fusedce.ops.KD_ROW_STATS_FIELDS)
    terms = []
    for st, a in shards:
        out = np.full((len(ids), fusedce.ops.KD_TERMS_RECORD_FIELDS), np.nan, np.float32)  # poisoned
        assert fusedce.kd_terms_partial(a, row_stats=stats, vocab_start=st, vocab_total=v, records=out, **tkw,
                                        **pkw) is out
        terms.append(out)
    terms = np.stack(terms)
    loss, stats2 = fusedce.kd_terms_combine(terms, stats, vocab_total=v, targets=tg, **opts)
    assert stats2 is stats
    ds = [fusedce.kd_bwd(a, row_stats=stats, vocab_start=st, vocab_total=v, targets=tg, grad_loss=g, **tkw, **opts)
          for st, a in shards]
    return loss, terms, ds


@pytest.mark.parametrize("widths,pad", [([20, 33], 0), ([29, 24], 5), ([1, 25, 27], 4)])
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("topk_norm", ["full_vocab", "renormalize"])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_topk_shards_match_the_whole_vocabulary(widths, pad, divergence, topk_norm, reduction):
    """A top-K teacher (the same [N, K] ids and log-probabilities on every rank) over 2 and 3 uneven, padded
    shards, always two exchanges: the loss and each shard's dstudent against kd_loss of the whole rows with the
    same teacher and a float64 reference; the terms' slot counts; a row without a used slot is masked."""
    n, v, k, temp, beta = 8, 53, 5, 1.7, 0.4
    s = (rng.standard_normal((n, v)) * 2).astype(np.float32)
    ids, lps = _topk_teacher(n, v, k, widths)
    ids[6] = -1  # no used slot: masked (loss 0, not counted by the mean, gradient 0)
    tg = rng.integers(0, v, n)
    tg[2] = -100
    opts = dict(divergence=divergence, beta=beta, temperature=temp, scale_by_t2=True, topk_norm=topk_norm,
                reduction=reduction)
    pkw = dict(divergence=divergence, beta=beta, temperature=temp, topk_norm=topk_norm)
    assert fusedce.kd_needs_terms(divergence, beta, topk=True)
    shards = _student_shards(s, widths, pad)
    g = np.linspace(0.5, 1.5, n).astype(np.float32) if reduction == "none" else np.float32(1.3)
    loss, terms, ds = _topk_flow(shards, ids, lps, v, tg, opts, pkw, g)
    # the slot counts: each used id counted by exactly the shard that holds it
    ends = [st + min(a.shape[1], v - st) for st, a in shards]
    for r, (st, _) in enumerate(shards):
        want = ((ids >= st) & (ids < ends[r])).sum(1)
        np.testing.assert_array_equal(terms[r, :, 2], want)
    whole = fusedce.kd_loss(s, topk_ids=ids, topk_logprobs=lps, targets=tg, dstudent=True, grad_loss=g, **opts)
    np.testing.assert_allclose(np.asarray(loss, np.float64), np.asarray(whole.loss, np.float64), rtol=2e-5,
                               atol=2e-6)
    rows, dz, used = _topk_reference(s, ids, lps, temp, divergence, beta, topk_norm)
    keep = used & (tg != -100)
    count = np.count_nonzero(keep)
    rows = np.where(keep, rows * temp * temp, 0.0)
    want = rows if reduction == "none" else rows.sum() / count
    np.testing.assert_allclose(np.asarray(loss, np.float64), want, rtol=2e-5, atol=2e-6)
    if reduction == "none":
        assert loss[6] == 0 and loss[2] == 0
    up = g.astype(np.float64)[:, None] if reduction == "none" else float(g) / count
    dwant = np.where(keep[:, None], dz * temp * up, 0.0)  # d/ds = d/dz / T, times T^2
    for (st, a), d in zip(shards, ds):
        w = min(a.shape[1], v - st)
        np.testing.assert_allclose(d[:, :w], whole.dstudent[:, st:st + w], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(d[:, :w], dwant[:, st:st + w], rtol=2e-4, atol=1e-6)
        assert (d[:, w:] == 0).all() and (d[6] == 0).all() and (d[2] == 0).all()


@pytest.mark.parametrize("widths,pad", [([20, 33], 4), ([1, 25, 27], 4)])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_topk_edge_rows(widths, pad, divergence):
    """A row without a used slot (masked: loss 0, not counted by the mean, gradient 0), rows with an id past
    vocab_total (one in the last shard's padding columns, one past every shard: NaN), int32 ids, and every
    other row unaffected; the unsharded kd_loss agrees."""
    n, v, k, temp = 8, 53, 5, 1.3
    s = (rng.standard_normal((n, v)) * 2).astype(np.float32)
    ids, lps = _topk_teacher(n, v, k, widths)
    ids[3] = -1
    ids[4, 1] = v + 1  # in the padding columns of the last shard: not a real column
    ids[7, 0] = v + 100
    ids = ids.astype(np.int32)
    opts = dict(divergence=divergence, temperature=temp, reduction="none")
    pkw = dict(divergence=divergence, temperature=temp)
    shards = _student_shards(s, widths, pad)
    loss, terms, ds = _topk_flow(shards, ids, lps, v, None, opts, pkw, None)
    whole = fusedce.kd_loss(s, topk_ids=ids, topk_logprobs=lps, dstudent=True, **opts)
    bad = [4, 7]
    good = [i for i in range(n) if i not in bad]
    assert np.isnan(loss[bad]).all() and np.isnan(whole.loss[bad]).all()
    assert np.isnan(terms[:, bad, :2].sum(0)).all()
    assert loss[3] == 0 and whole.loss[3] == 0
    rows, dz, _ = _topk_reference(s[good], ids[good], lps[good], temp, divergence, 0.5, "full_vocab")
    np.testing.assert_allclose(loss[good], rows, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(loss[good], whole.loss[good], rtol=2e-5, atol=2e-6)
    for (st, a), d in zip(shards, ds):
        w = min(a.shape[1], v - st)
        assert (d[3] == 0).all() and (d[:, w:] == 0).all()
        np.testing.assert_allclose(d[good, :w], dz[:, st:st + w] / temp, rtol=2e-4, atol=1e-6)
    # the mean: batchmean over the rows with a used slot; a NaN row makes it NaN
    mean_opts = dict(opts, reduction="mean")
    ok = [i for i in good if i != 3]
    m, _, _ = _topk_flow([(st, a[ok]) for st, a in shards], ids[ok], lps[ok], v, None, mean_opts, pkw, None)
    np.testing.assert_allclose(m, rows[[good.index(i) for i in ok]].sum() / len(ok), rtol=2e-5, atol=2e-6)
    sel = good  # row 3 (no used slot) included: not counted
    m, _, _ = _topk_flow([(st, a[sel]) for st, a in shards], ids[sel], lps[sel], v, None, mean_opts, pkw, None)
    np.testing.assert_allclose(m, rows.sum() / (len(good) - 1), rtol=2e-5, atol=2e-6)
    m, _, _ = _topk_flow(shards, ids, lps, v, None, mean_opts, pkw, None)
    assert np.isnan(m)


def test_topk_bad_calls():
    x = np.zeros((2, 4), np.float32)
    ids = np.array([[0, 5], [1, -1]], np.int64)
    lps = np.log(np.full((2, 2), 0.4, np.float32))
    tkw = dict(topk_ids=ids, topk_logprobs=lps, vocab_start=0, vocab_total=8)
    stats0 = np.zeros((2, 5), np.float32)
    for f, extra in ((fusedce.kd_partial, {}), (fusedce.kd_terms_partial, dict(row_stats=stats0)),
                     (fusedce.kd_bwd, dict(row_stats=stats0))):
        with pytest.raises(ValueError, match="either teacher_logits"):
            f(x, x, **extra, **tkw)  # both
        with pytest.raises(ValueError, match="either teacher_logits"):
            f(x, **extra, vocab_start=0, vocab_total=8, topk_ids=ids)  # half of a top-K teacher
    rec = fusedce.kd_partial(x, **tkw)[None]
    # records of a top-K teacher carry no divergence: a loss formed from them is NaN (hence loss=False)
    loss, _ = fusedce.kd_combine(rec, vocab_total=8, reduction="none")
    assert np.isnan(loss).all()
    with pytest.raises(fusedce.InvalidArgumentError, match="row_stats"):
        fusedce.kd_combine(rec, vocab_total=8, loss=False, row_stats=False)
    _, stats = fusedce.kd_combine(rec, vocab_total=8, loss=False)
    with pytest.raises(ValueError, match="row_stats"):
        fusedce.kd_terms_partial(x, vocab_start=0, vocab_total=8, topk_ids=ids, topk_logprobs=lps)
    with pytest.raises(fusedce.ShapeMismatchError):
        fusedce.kd_terms_partial(x, row_stats=stats, vocab_start=0, vocab_total=8, topk_ids=ids,
                                 topk_logprobs=lps[:, :1].copy())
    assert fusedce.kd_needs_terms("forward_kl", topk=True) and not fusedce.kd_needs_terms("forward_kl")
    with pytest.raises(ValueError, match="divergence"):
        fusedce.kd_needs_terms("kl", topk=True)


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("topk_norm", ["full_vocab", "renormalize"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_vocab_parallel_topk_one_process(divergence, topk_norm, reduction):
    """vocab_parallel_kd_loss with a top-K teacher without a process group (one padded shard, [B, S, V]): the
    loss and the student's gradient through autograd against kd_loss_topk and torch's float64 divergence;
    vocab_parallel_kd_loss_topk gives the same bits."""
    torch = pytest.importorskip("torch")
    import fusedce.torch as ft
    n, v, k, temp, beta, pad = 6, 37, 4, 1.3, 0.35, 3
    g = torch.Generator().manual_seed(5)
    s = torch.randn(2, n // 2, v, generator=g) * 2
    teacher = torch.randn(2, n // 2, v, generator=g) * 2
    lps, ids = torch.log_softmax(teacher, -1).topk(k, -1)
    ids[0, 1, 2] = -1
    ids[1, 2] = -1  # no used slot: masked
    tg = torch.randint(0, v, (2, n // 2), generator=g)
    tg[1, 0] = -100
    sp = torch.cat([s, torch.full((2, n // 2, pad), float("nan"))], -1).requires_grad_()
    kw = dict(divergence=divergence, beta=beta, temperature=temp, scale_by_t2=True, topk_norm=topk_norm,
              reduction=reduction)
    loss = ft.vocab_parallel_kd_loss(sp, None, tg, topk_ids=ids, topk_logprobs=lps, vocab_start=0, vocab_total=v,
                                     **kw)
    up = torch.rand(loss.shape, generator=g)
    (loss * up).sum().backward()
    whole = ft.kd_loss_topk(s, ids, lps, tg, **kw)
    torch.testing.assert_close(loss.detach(), whole, rtol=2e-5, atol=2e-6)
    same = ft.vocab_parallel_kd_loss_topk(sp.detach(), ids.int(), lps.double(), tg, vocab_start=0, vocab_total=v,
                                          **kw)
    assert torch.equal(same, loss.detach())
    # float64 reference through autograd: unused slots get logits of -1e4 (probability exactly 0, finite
    # logarithms, so no NaN reaches the gradient) and are left out of the sum
    x64 = s.double().requires_grad_()
    used = ids >= 0
    safe = ids.clamp_min(0)
    lp = torch.log_softmax((lps.double() / temp).masked_fill(~used, -1e4), -1)
    z = x64 / temp
    if topk_norm == "full_vocab":
        lq = torch.log_softmax(z, -1).gather(-1, safe)
    else:
        lq = torch.log_softmax(z.gather(-1, safe).masked_fill(~used, -1e4), -1)
    p, q = lp.exp(), lq.exp()
    zero = torch.zeros((), dtype=torch.float64)
    if divergence == "forward_kl":
        terms = p * (lp - lq)
    elif divergence == "reverse_kl":
        terms = q * (lq - lp)
    else:
        lm = torch.logaddexp(lp + np.log(beta), lq + np.log(1 - beta))
        terms = beta * p * (lp - lm) + (1 - beta) * q * (lq - lm)
    rows = torch.where(used, terms, zero).sum(-1) * temp ** 2
    keep = (tg != -100) & used.any(-1)
    rows = torch.where(keep, rows, zero)
    ref = rows if reduction == "none" else rows.sum() / keep.sum()
    (ref * up.double()).sum().backward()
    assert float((loss.detach().double() - ref.detach()).abs().max()) < 2e-5
    assert float((sp.grad[..., :v].double() - x64.grad).abs().max()) < 1e-5
    assert (sp.grad[..., v:] == 0).all() and (sp.grad[1, 2] == 0).all()
    with pytest.raises(ValueError, match="either teacher_logits"):
        ft.vocab_parallel_kd_loss(sp, None, tg, topk_ids=ids)
