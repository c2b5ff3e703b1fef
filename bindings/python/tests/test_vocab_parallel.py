"""Vocabulary-parallel cross-entropy through the Python binding (CPU backend): shards of the logits, one
partial call each, the records stacked in rank order, combined, and each shard's gradient, against the
unsharded call and a float64 logsumexp."""
import numpy as np
import pytest

import fusedce

rng = np.random.default_rng(7)


@pytest.mark.parametrize("widths,pad", [([40], 0), ([17, 30], 0), ([1, 20, 26], 5)])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_shards_match_the_whole_vocabulary(widths, pad, reduction):
    n, v = 9, 47
    x = (rng.standard_normal((n, v)) * 3).astype(np.float32)
    t = rng.integers(0, v, n)
    t[3] = -100
    opts = dict(reduction=reduction, label_smoothing=0.1, z_loss_scale=1e-3)
    starts = np.cumsum([0] + widths)[:-1]
    widths = widths[:-1] + [v - starts[-1]]
    shards = []
    for r, (s, w) in enumerate(zip(starts, widths)):
        cols = w + (pad if r == len(widths) - 1 else 0)
        part = np.full((n, cols), np.nan, np.float32)  # padding: never read into a sum
        part[:, :w] = x[:, s:s + w]
        shards.append((int(s), part))
    records = np.stack([fusedce.cross_entropy_partial(p, t, vocab_start=s, vocab_total=v, **opts) for s, p in shards])
    assert records.shape == (len(shards), n, fusedce.cross_entropy_record_fields())
    got = fusedce.cross_entropy_combine(records, t, vocab_total=v, argmax=True, entropy=True, z_loss=True, **opts)
    whole = fusedce.cross_entropy_fwd(x, t, argmax=True, entropy=True, z_loss=True, **opts)
    np.testing.assert_array_equal(got.argmax, whole.argmax)
    for a, b in ((got.loss, whole.loss), (got.lse, whole.lse), (got.entropy, whole.entropy), (got.z_loss, whole.z_loss)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=2e-5, atol=2e-6)
    x64 = x.astype(np.float64)
    m = x64.max(axis=1)
    np.testing.assert_allclose(got.lse, m + np.log(np.exp(x64 - m[:, None]).sum(axis=1)), rtol=2e-6, atol=2e-6)
    dwhole = fusedce.cross_entropy_bwd(x, t, whole.lse, **opts)
    for s, part in shards:
        d = fusedce.cross_entropy_bwd(part, t, got.lse, vocab_start=s, vocab_total=v, **opts)
        w = min(part.shape[1], v - s)
        np.testing.assert_allclose(d[:, :w], dwhole[:, s:s + w], rtol=2e-5, atol=2e-7)
        assert (d[:, w:] == 0).all()


@pytest.mark.parametrize("widths,pad", [([30, 0], 0), ([11, 20, 0], 4)])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_linear_ce_shards_match_the_whole_head(widths, pad, reduction):
    """The LM head split by rows: each shard's partial records, combined, then each shard's backward from the
    combined lse; loss, lse and the gradients against the unsharded linear cross-entropy (fp32)."""
    n, hdim, v = 13, 24, 61
    h = rng.standard_normal((n, hdim)).astype(np.float32)
    w = (rng.standard_normal((v, hdim)) * 0.5).astype(np.float32)
    b = rng.standard_normal(v).astype(np.float32)
    t = rng.integers(0, v, n)
    t[2] = -100
    opts = dict(reduction=reduction, label_smoothing=0.05, z_loss_scale=1e-3)
    starts = np.cumsum([0] + widths)[:-1]
    widths = list(widths[:-1]) + [v - starts[-1]]
    shards = []
    for r, (s, k) in enumerate(zip(starts, widths)):
        rows = k + (pad if r == len(widths) - 1 else 0)
        ws = np.full((rows, hdim), np.nan, np.float32)  # padding rows: never read
        bs = np.full(rows, np.nan, np.float32)
        ws[:k], bs[:k] = w[s:s + k], b[s:s + k]
        shards.append((int(s), k, ws, bs))
    rec = np.stack([fusedce.linear_cross_entropy_partial(h, ws, t, bias=bs, vocab_start=s, vocab_total=v, **opts)
                    for s, _, ws, bs in shards])
    got = fusedce.cross_entropy_combine(rec, t, vocab_total=v, **opts)
    whole = fusedce.linear_cross_entropy_fwd(h, w, t, bias=b, dhidden=True, dweight=True, dbias=True, **opts)
    np.testing.assert_allclose(got.loss, whole.loss, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(got.lse, whole.lse, rtol=2e-5, atol=2e-6)
    dh = np.zeros((n, hdim), np.float64)
    for s, k, ws, bs in shards:
        g = fusedce.linear_cross_entropy_bwd(h, ws, t, got.lse, bias=bs, vocab_start=s, vocab_total=v, **opts)
        assert g.dhidden.dtype == np.float32
        dh += g.dhidden
        np.testing.assert_allclose(g.dweight[:k], whole.dweight[s:s + k], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(g.dbias[:k], whole.dbias[s:s + k], rtol=1e-4, atol=1e-6)
        assert (g.dweight[k:] == 0).all() and (g.dbias[k:] == 0).all()
    np.testing.assert_allclose(dh, whole.dhidden, rtol=1e-4, atol=1e-6)
    with pytest.raises(fusedce.UnsupportedDtypeError, match="float32"):
        s, _, ws, bs = shards[0]
        fusedce.linear_cross_entropy_bwd(h.astype(np.float16), ws.astype(np.float16), t, got.lse,
                                         vocab_start=s, vocab_total=v, dhidden=np.zeros((n, hdim), np.float16),
                                         dweight=False, **opts)


def test_bad_shards_raise():
    """vocab_start past vocab_total, or no vocab_total, is refused (vocab_start = vocab_total is a shard of
    padding alone since 0.2.0: test_padding_alone_and_bad_layouts)."""
    x = np.zeros((2, 4), np.float32)
    t = np.array([0, 1])
    with pytest.raises(fusedce.InvalidArgumentError, match="vocab_start"):
        fusedce.cross_entropy_partial(x, t, vocab_start=9, vocab_total=8)
    with pytest.raises(fusedce.InvalidArgumentError, match="vocab_total"):
        fusedce.cross_entropy_partial(x, t, vocab_start=0, vocab_total=0)
    with pytest.raises(fusedce.InvalidArgumentError, match="vocab_start"):
        fusedce.logsumexp_partial(x, vocab_start=9, vocab_total=8)


def test_record_widths_are_the_headers():
    """The binding's record widths are the 0.2.0 header's (the CE records carry their column range)."""
    o = fusedce.ops
    assert (o.RECORD_FIELDS_LOSS, o.RECORD_FIELDS_ENTROPY, o.RECORD_FIELDS_ALL) == (6, 7, 9)
    assert fusedce.cross_entropy_record_fields() == 9
    assert (o.LSE_RECORD_FIELDS, o.KD_RECORD_FIELDS, o.KD_TERMS_RECORD_FIELDS) == (6, 7, 5)
    x = np.zeros((3, 5), np.float32)
    t = np.zeros(3, np.int64)
    for k in (6, 7, 9):
        assert fusedce.cross_entropy_partial(x, t, vocab_start=0, vocab_total=5, fields=k).shape == (3, k)
    assert fusedce.logsumexp_partial(x, vocab_start=0, vocab_total=5).shape == (3, 6)
    assert fusedce.kd_partial(x, x, vocab_start=0, vocab_total=5).shape == (3, 7)


def test_padding_alone_and_bad_layouts():
    """A rank holding padding alone (vocab_start = vocab_total, as padding a small vocabulary to a multiple of
    the ranks gives) adds a neutral record: the combines give the whole rows' values. Shards whose ranges
    overlap, leave a gap or come out of vocabulary order give NaN rows (argmax -1), not a plausible number."""
    n, v = 5, 12
    x = (rng.standard_normal((n, v)) * 2).astype(np.float32)
    t = rng.integers(0, v, n)
    pad = np.full((n, 4), np.nan, np.float32)
    parts = [(0, x[:, :7].copy()), (7, x[:, 7:].copy()), (v, pad)]
    rec = np.stack([fusedce.cross_entropy_partial(p, t, vocab_start=s, vocab_total=v) for s, p in parts])
    got = fusedce.cross_entropy_combine(rec, t, vocab_total=v, argmax=True, entropy=True, reduction="none")
    whole = fusedce.cross_entropy_fwd(x, t, argmax=True, entropy=True, reduction="none")
    np.testing.assert_allclose(got.loss, whole.loss, rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(got.argmax, whole.argmax)
    d = fusedce.cross_entropy_bwd(pad, t, fusedce.cross_entropy_combine(rec, t, vocab_total=v, lse="pair").lse,
                                  vocab_start=v, vocab_total=v)
    assert (d == 0).all()  # padding columns
    lrec = np.stack([fusedce.logsumexp_partial(p, vocab_start=s, vocab_total=v) for s, p in parts])
    np.testing.assert_allclose(fusedce.logsumexp_combine(lrec), fusedce.logsumexp(x), rtol=1e-6, atol=1e-6)
    for bad in ([(0, x[:, :7]), (6, x[:, 6:])],        # overlap
                [(0, x[:, :7]), (8, x[:, 8:])],        # gap
                [(7, x[:, 7:]), (0, x[:, :7])]):       # out of order
        r = np.stack([fusedce.cross_entropy_partial(np.ascontiguousarray(p), t, vocab_start=s, vocab_total=v)
                      for s, p in bad])
        o = fusedce.cross_entropy_combine(r, t, vocab_total=v, argmax=True, reduction="none")
        assert np.isnan(o.loss).all() and np.isnan(o.lse).all() and (o.argmax == -1).all()
        lr = np.stack([fusedce.logsumexp_partial(np.ascontiguousarray(p), vocab_start=s, vocab_total=v)
                       for s, p in bad])
        assert np.isnan(fusedce.logsumexp_combine(lr)).all()
        assert np.isnan(fusedce.logsumexp_combine(lr, pair=True)).all()


def _max_shifted_ce(x, t):
    """float64 cross-entropy rows' gradient p - onehot(t) and lse of x [N, V], from max-shifted values."""
    x64 = x.astype(np.float64)
    m = x64.max(axis=1, keepdims=True)
    e = np.exp(x64 - m)
    p = e / e.sum(axis=1, keepdims=True)
    p[np.arange(len(t)), t] -= 1
    return p, (m + np.log(e.sum(axis=1, keepdims=True)))[:, 0]


def test_shard_backward_from_pairs_exact_at_large_offsets():
    """The array API: a shard's cross_entropy_bwd from the combine's pairs (lse="pair") is the float64
    gradient at logits + 1e5 and exactly [-0.5, 0.5, 0, 0] on the rows [2^25, 2^25, 0, 1]; from the [N] lse
    it carries the lse's rounding (the documented difference, checked too). linear_cross_entropy_bwd
    likewise, its logits offset by a bias."""
    n, v = 6, 30
    x = (rng.standard_normal((n, v)) * 2 + 1e5).astype(np.float32)
    t = rng.integers(0, v, n)
    big = np.float32(2 ** 25)
    x[0, :4] = [big, big, 0, 1]
    x[0, 4:] = 0
    t[0] = 0
    shards = [(0, x[:, :4].copy()), (4, x[:, 4:19].copy()), (19, x[:, 19:].copy())]
    rec = np.stack([fusedce.cross_entropy_partial(p, t, vocab_start=s, vocab_total=v, reduction="none")
                    for s, p in shards])
    pairs = fusedce.cross_entropy_combine(rec, t, vocab_total=v, reduction="none", lse="pair").lse
    plain = fusedce.cross_entropy_combine(rec, t, vocab_total=v, reduction="none").lse
    assert pairs.shape == (n, 2) and plain.shape == (n,)
    want, lse64 = _max_shifted_ce(x, t)
    assert abs(fusedce.lse_value(pairs) - lse64).max() <= 2 ** -23 * abs(lse64).max()
    got = np.concatenate([fusedce.cross_entropy_bwd(p, t, pairs, vocab_start=s, vocab_total=v, reduction="none")
                          for s, p in shards], axis=1)
    np.testing.assert_array_equal(got[0, :4], [-0.5, 0.5, 0, 0])
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    from_plain = fusedce.cross_entropy_bwd(shards[0][1], t, plain, vocab_start=0, vocab_total=v, reduction="none")
    assert from_plain[0, 1] == 1.0  # the [N] lse rounds log 2 away beside 2^25: p = 1 at both maxima
    # the unsharded forward's pairs, numpy and an [N, 2] given as the output array
    out = np.full((n, 2), np.nan, np.float32)
    r = fusedce.cross_entropy_fwd(x, t, reduction="none", lse=out, dlogits=True)
    assert r.lse is out
    np.testing.assert_array_equal(fusedce.cross_entropy_bwd(x, t, out, reduction="none"), r.dlogits)
    with pytest.raises(ValueError, match="pair"):
        fusedce.cross_entropy_fwd(x, t, lse="pairs")
    # linear: bias 1e5 puts every logit near it; the shard's backward from the pairs
    hdim = 8
    h = rng.standard_normal((n, hdim)).astype(np.float32)
    w = (rng.standard_normal((v, hdim)) * 0.5).astype(np.float32)
    b = (rng.standard_normal(v) + 1e5).astype(np.float32)
    z = ((h.astype(np.float64) @ w.T.astype(np.float64)) + b).astype(np.float32)
    want, _ = _max_shifted_ce(z, t)
    lrec = np.stack([fusedce.linear_cross_entropy_partial(h, w[s:e], t, bias=b[s:e], vocab_start=s, vocab_total=v,
                                                          reduction="none")
                     for s, e in ((0, 11), (11, v))])
    lp = fusedce.cross_entropy_combine(lrec, t, vocab_total=v, reduction="none", lse="pair").lse
    for s, e in ((0, 11), (11, v)):
        g = fusedce.linear_cross_entropy_bwd(h, w[s:e], t, lp, bias=b[s:e], vocab_start=s, vocab_total=v,
                                             reduction="none")
        np.testing.assert_allclose(g.dbias, want[:, s:e].sum(0), rtol=0, atol=2e-5)


def _rank(rank, world, port, shape, widths, results):
    import math

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import fusedce.torch as ft
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(11)
        s, b, v = shape
        x = torch.randn(s, b, v, generator=g) * 3
        t = torch.randint(0, v, (s, b), generator=g)
        t[0, 0] = -100
        starts = [sum(widths[:r]) for r in range(world)]
        mine = x[..., starts[rank]:starts[rank] + widths[rank]].clone().requires_grad_()
        even = len(set(widths)) == 1
        kw = {} if even else dict(vocab_start=starts[rank], vocab_total=v)
        for red in ("mean", "none"):
            loss = ft.vocab_parallel_cross_entropy(mine, t, reduction=red, label_smoothing=0.1, **kw)
            up = torch.rand(loss.shape, generator=torch.Generator().manual_seed(3))
            (loss * up).sum().backward()
            x64 = x.double().requires_grad_()
            ref = F.cross_entropy(x64.reshape(-1, v), t.reshape(-1), reduction=red, label_smoothing=0.1)
            ref = ref.reshape(t.shape) if red == "none" else ref
            (ref * up.double()).sum().backward()
            want_grad = x64.grad[..., starts[rank]:starts[rank] + widths[rank]]
            results.put((rank, red, float((loss.double() - ref.detach()).abs().max()),
                         float((mine.grad.double() - want_grad).abs().max()), loss.detach().numpy().tobytes()))
            mine.grad = None
        # log-probabilities and entropies (verl's), both differentiated, at temperature 0.8
        lp, ent = ft.vocab_parallel_logprobs_entropy(mine, t, 0.8, **kw)
        gen = torch.Generator().manual_seed(5)
        u1, u2 = torch.randn(t.shape, generator=gen), torch.randn(t.shape, generator=gen)
        ((lp * u1).sum() + (ent * u2).sum()).backward()
        x64 = x.double().requires_grad_()
        logp = torch.log_softmax(x64 / 0.8, -1)
        rlp = torch.where(t != -100, logp.gather(-1, t.clamp_min(0).unsqueeze(-1)).squeeze(-1), torch.zeros(()).double())
        rent = -(logp.exp() * logp).sum(-1)
        ((rlp * u1.double()).sum() + (rent * u2.double()).sum()).backward()
        want_grad = x64.grad[..., starts[rank]:starts[rank] + widths[rank]]
        err = max(float((lp.double() - rlp.detach()).abs().max()), float((ent.double() - rent.detach()).abs().max()))
        results.put((rank, "logprobs_entropy", err, float((mine.grad.double() - want_grad).abs().max()),
                     lp.detach().numpy().tobytes() + ent.detach().numpy().tobytes()))
        # knowledge distillation, reverse KL at T = 2 with T^2, batchmean over the unmasked rows
        mine.grad = None
        teacher = torch.randn(s, b, v, generator=g) * 2
        tmine = teacher[..., starts[rank]:starts[rank] + widths[rank]]
        kd = ft.vocab_parallel_kd_loss(mine, tmine, t, divergence="reverse_kl", temperature=2.0, scale_by_t2=True,
                                       **kw)
        kd.backward()
        x64 = x.double().requires_grad_()
        lq, lpt = torch.log_softmax(x64 / 2, -1), torch.log_softmax(teacher.double() / 2, -1)
        rows = (lq.exp() * (lq - lpt)).sum(-1) * 4
        ref = (rows * (t != -100)).sum() / (t != -100).sum()
        ref.backward()
        want_grad = x64.grad[..., starts[rank]:starts[rank] + widths[rank]]
        results.put((rank, "kd", float((kd.double() - ref.detach()).abs()), float((mine.grad.double() - want_grad).abs().max()),
                     kd.detach().numpy().tobytes()))
        # JSD (beta 0.3, T = 1.5, per-row losses): two all-gathers (records, then the terms' records)
        mine.grad = None
        jsd = ft.vocab_parallel_kd_loss(mine, tmine, t, divergence="jsd", beta=0.3, temperature=1.5,
                                        scale_by_t2=True, reduction="none", **kw)
        up = torch.rand(jsd.shape, generator=torch.Generator().manual_seed(6))
        (jsd * up).sum().backward()
        x64 = x.double().requires_grad_()
        lq, lpt = torch.log_softmax(x64 / 1.5, -1), torch.log_softmax(teacher.double() / 1.5, -1)
        lm = torch.logaddexp(lpt + math.log(0.3), lq + math.log(0.7))
        rows = (0.3 * (lpt.exp() * (lpt - lm)).sum(-1) + 0.7 * (lq.exp() * (lq - lm)).sum(-1)) * 1.5 ** 2
        ref = torch.where(t != -100, rows, torch.zeros((), dtype=torch.float64))
        (ref * up.double()).sum().backward()
        want_grad = x64.grad[..., starts[rank]:starts[rank] + widths[rank]]
        results.put((rank, "kd_jsd", float((jsd.detach().double() - ref.detach()).abs().max()),
                     float((mine.grad.double() - want_grad).abs().max()), jsd.detach().numpy().tobytes()))
        # a top-K teacher (the same [S, B, 5] ids and log-probabilities on every rank; an unused slot, a row
        # without one: masked): reverse KL over the K ids renormalized, T = 1.5, batchmean; two all-gathers
        mine.grad = None
        lps, ids = torch.log_softmax(teacher, -1).topk(5, -1)
        ids[1, 2, 3] = -1
        ids[2, 1] = -1
        topk = ft.vocab_parallel_kd_loss(mine, None, t, topk_ids=ids, topk_logprobs=lps, divergence="reverse_kl",
                                         temperature=1.5, scale_by_t2=True, topk_norm="renormalize", **kw)
        topk.backward()
        x64 = x.double().requires_grad_()
        used = ids >= 0
        lpt = torch.log_softmax((lps.double() / 1.5).masked_fill(~used, -1e4), -1)
        lq = torch.log_softmax((x64 / 1.5).gather(-1, ids.clamp_min(0)).masked_fill(~used, -1e4), -1)
        rows = torch.where(used, lq.exp() * (lq - lpt), torch.zeros((), dtype=torch.float64)).sum(-1) * 1.5 ** 2
        keep = (t != -100) & used.any(-1)
        ref = (rows * keep).sum() / keep.sum()
        ref.backward()
        want_grad = x64.grad[..., starts[rank]:starts[rank] + widths[rank]]
        results.put((rank, "kd_topk", float((topk.detach().double() - ref.detach()).abs()),
                     float((mine.grad.double() - want_grad).abs().max()), topk.detach().numpy().tobytes()))
        # linear cross-entropy: the LM head split by rows; dhidden summed over the ranks
        hid = torch.randn(s, b, 16, generator=g).requires_grad_()
        head = torch.randn(v, 16, generator=g) * 0.5
        wmine = head[starts[rank]:starts[rank] + widths[rank]].clone().requires_grad_()
        lce = ft.vocab_parallel_linear_cross_entropy(hid, wmine, t, label_smoothing=0.1, **kw)
        (lce * 0.5).backward()
        h64, w64 = hid.detach().double().requires_grad_(), head.double().requires_grad_()
        ref = F.cross_entropy((h64 @ w64.T).reshape(-1, v), t.reshape(-1), label_smoothing=0.1)
        (ref * 0.5).backward()
        gerr = max(float((hid.grad.double() - h64.grad).abs().max()),
                   float((wmine.grad.double() - w64.grad[starts[rank]:starts[rank] + widths[rank]]).abs().max()))
        results.put((rank, "linear", float((lce.double() - ref.detach()).abs()), gerr,
                     lce.detach().numpy().tobytes() + hid.grad.numpy().tobytes()))
        # logsumexp at scale 0.8 and softmax / log_softmax at T = 0.7 of the shards; the softmax's upstream
        # gradient is one [S, B, V] tensor cut like the logits (the objective is the sum over the ranks)
        sl = slice(starts[rank], starts[rank] + widths[rank])
        xs = mine.detach().clone().requires_grad_()
        lse = ft.vocab_parallel_logsumexp(xs, scale=0.8, **kw)
        u = torch.randn(lse.shape, generator=torch.Generator().manual_seed(8))
        (lse * u).sum().backward()
        x64 = x.double().requires_grad_()
        rl = torch.logsumexp(0.8 * x64, -1)
        (rl * u.double()).sum().backward()
        err, gerr = float((lse.double() - rl.detach()).abs().max()), float((xs.grad.double() - x64.grad[..., sl]).abs().max())
        bits = lse.detach().numpy().tobytes()
        for log in (False, True):
            xs = mine.detach().clone().requires_grad_()
            y = ft.vocab_parallel_softmax(xs, 0.7, log=log, **kw)
            gfull = torch.randn(x.shape, generator=torch.Generator().manual_seed(9))
            (y * gfull[..., sl]).sum().backward()
            x64 = x.double().requires_grad_()
            ry = (torch.log_softmax if log else torch.softmax)(x64 / 0.7, -1)
            (ry * gfull.double()).sum().backward()
            err = max(err, float((y.double() - ry.detach()[..., sl]).abs().max()))
            gerr = max(gerr, float((xs.grad.double() - x64.grad[..., sl]).abs().max()))
        results.put((rank, "lse_softmax", err, gerr, bits))
        # large offsets: cross-entropy at logits + 1e5 (each shard's backward from the combine's pairs: the
        # float64 gradient, where an [N] lse's rounding gives 1e-3), and the softmax at T = 1e-3 of fp16
        # logits holding +-65504 (the records at the fp32 scale 1.0f / T; rows summing to 1 over the ranks)
        xo = x.reshape(-1, v) + 1e5
        to = t.reshape(-1).clamp_min(0)
        mo = xo[:, sl].clone().requires_grad_()
        lo = ft.vocab_parallel_cross_entropy(mo, to, reduction="none", **kw)
        up = torch.linspace(0.5, 1.5, lo.shape[0])
        (lo * up).sum().backward()
        x64 = xo.double()
        d = x64 - x64.max(-1, keepdim=True).values
        pr = d.exp() / d.exp().sum(-1, keepdim=True)
        ref = d.exp().sum(-1).log() - d.gather(-1, to[:, None])[:, 0]
        want_grad = ((pr - F.one_hot(to, v).double()) * up.double()[:, None])[:, sl]
        ulp = torch.finfo(torch.float32).eps * (x64.max(-1).values + d.exp().sum(-1).log())
        loss_err = float(((lo.double() - ref).abs() - ulp).clamp_min(0).max())  # the loss is formed from the fp32 lse
        gerr = float((mo.grad.double() - want_grad).abs().max())
        xh = (x.reshape(-1, v) * 3).to(torch.float16)
        xh[0, 0], xh[0, v - 1] = 65504, -65504
        xh[1, 1] = xh[1, v - 2] = 65504  # maxima on the first and the last rank
        ys = ft.vocab_parallel_softmax(xh[:, sl].clone(), 1e-3, **kw)
        total = ys.sum(-1)
        dist.all_reduce(total)
        assert not torch.isnan(ys).any()
        loss_err = max(loss_err, float((total - 1).abs().max()))
        results.put((rank, "offsets", loss_err, gerr, lo.detach().numpy().tobytes() + total.numpy().tobytes()))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("widths", [[20, 20], [13, 27], [13, 20, 7]])
def test_torch_distributed_ranks(widths):
    """Two or three processes (gloo, CPU), Megatron's [S, B, V/W] layout: the loss of the whole rows (and the
    log-probabilities and entropies, KD divergences (reverse KL, and JSD and a top-K teacher with their two
    all-gathers), linear cross-entropy with the LM head split by rows, and logsumexp and softmax with their
    gradients), the same bits on every rank (linear cross-entropy's dhidden too: a rank-order sum), and each
    rank's gradient its part of PyTorch's float64 gradient; at large offsets too (cross-entropy at logits +
    1e5, the softmax at T = 1e-3 of fp16 logits of +-65504: rows summing to 1 over the ranks)."""
    torch = pytest.importorskip("torch")
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    world = len(widths)
    procs = [ctx.Process(target=_rank, args=(r, world, port, (3, 4, sum(widths)), widths, results))
             for r in range(world)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in range(9 * world)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    by = {}
    for rank, red, loss_err, grad_err, bits in got:
        assert loss_err < 2e-5, (rank, red, loss_err)
        loose = red in ("logprobs_entropy", "kd", "kd_jsd", "kd_topk", "linear", "lse_softmax")
        assert grad_err < (1e-5 if loose else 2e-6), (rank, red, grad_err)
        by.setdefault(red, set()).add(bits)
    assert all(len(b) == 1 for b in by.values()), "the ranks' losses differ"
    del torch


def _nccl_rank(rank, world, port, widths, results):
    import os

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import fusedce.torch as ft
    for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ[k] = "0" if k == "NCCL_NVLS_ENABLE" else "1"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(5)
        v = sum(widths)
        x = (torch.randn(64, v, generator=g) * 3).to(torch.bfloat16)
        t = torch.randint(0, v, (64,), generator=g)
        t[1] = -100
        x[2, v - 1] = float("nan")  # in the last rank's shard: every rank's loss of row 2 is NaN
        starts = [sum(widths[:r]) for r in range(world)]
        dev = torch.device("cuda", rank)
        shard = x[:, starts[rank]:starts[rank] + widths[rank]].to(dev)
        kw = dict(vocab_start=starts[rank], vocab_total=v, label_smoothing=0.1, reduction="none")
        up = torch.rand(64, generator=torch.Generator().manual_seed(3)).to(dev)
        out = {}
        for mode in ("gather", "nccl", "nccl"):  # the first NCCL call may find the communicator not yet created
            mine = shard.clone().requires_grad_()
            loss = ft.vocab_parallel_cross_entropy(mine, t.to(dev), nccl=mode == "nccl", **kw)
            (loss.nan_to_num() * up).sum().backward()
            out[mode] = (loss.detach().cpu(), mine.grad.float().cpu())
        used = any(k[1] == rank for k in ft._COMMS)
        ref = F.cross_entropy(x.double(), t, reduction="none", label_smoothing=0.1)
        # linear cross-entropy, the head split by rows: NCCL mode (one fce_linear_cross_entropy_fwd_vp forming
        # every gradient) against the all-gather path (records through torch.distributed, the shard's backward,
        # dhidden's fp32 parts summed in rank order); 64 rows are one token chunk in both, so the same bits
        hid = (torch.randn(64, 32, generator=g)).to(torch.bfloat16).to(dev)
        head = (torch.randn(v, 32, generator=g) * 0.3).to(torch.bfloat16)
        wmine = head[starts[rank]:starts[rank] + widths[rank]].to(dev)
        lin = {}
        for mode in ("gather", "nccl"):
            hm, wm = hid.clone().requires_grad_(), wmine.clone().requires_grad_()
            loss = ft.vocab_parallel_linear_cross_entropy(hm, wm, t.to(dev), nccl=mode == "nccl",
                                                          vocab_start=starts[rank], vocab_total=v,
                                                          label_smoothing=0.1)
            (loss * 2).backward()
            lin[mode] = (loss.detach().cpu(), hm.grad.cpu(), wm.grad.cpu())
        # the library rounds the logits to the inputs' dtype, as F.linear does: the reference too
        lref = F.cross_entropy((hid.double().cpu() @ head.double().T).to(torch.bfloat16).double(), t,
                               label_smoothing=0.1)
        # loss and dhidden (both summed in rank order): the same bits; dweight within a bf16 ulp
        # (docs/lab-notes.md: at 64 rows the NCCL mode's dweight GEMM, beside a bf16 dhidden, gave other last
        # bits than the shard's backward)
        (l0, h0, w0), (l1, h1, w1) = lin["gather"], lin["nccl"]
        same_lin = torch.equal(l0, l1) and torch.equal(h0, h1) and torch.allclose(w0.float(), w1.float(), rtol=2**-6,
                                                                                   atol=1e-6)
        lin_err = float((lin["nccl"][0].double() - lref).abs())
        # logsumexp and softmax: one fce_logsumexp_vp / fce_temp_softmax_vp against the all-gather path
        sm = {}
        for mode in ("gather", "nccl"):
            xm = shard.clone().requires_grad_()
            lse = ft.vocab_parallel_logsumexp(xm, scale=0.8, vocab_start=starts[rank], vocab_total=v,
                                              nccl=mode == "nccl")
            y = ft.vocab_parallel_softmax(xm, 0.7, vocab_start=starts[rank], vocab_total=v, nccl=mode == "nccl")
            (lse.nan_to_num() * up).sum().backward()
            sm[mode] = [a.detach().nan_to_num(7.0).float().cpu() for a in (lse, y)]
        same_sm = all(torch.equal(a, b) for a, b in zip(sm["gather"], sm["nccl"]))
        # KD: one fce_kd_fwd_vp (statistics kept for the backward) against the all-gather path, for forward KL,
        # JSD (two exchanges) and a top-K teacher
        teacher = (torch.randn(64, v, generator=g) * 2).to(torch.bfloat16)
        lps, ids = torch.log_softmax(teacher.float(), -1).topk(8, -1)
        tshard = teacher[:, starts[rank]:starts[rank] + widths[rank]].to(dev)
        kd = {}
        for mode in ("gather", "nccl"):
            kd[mode] = []
            for kwk in (dict(teacher_logits=tshard), dict(teacher_logits=tshard, divergence="jsd", beta=0.3),
                        dict(topk_ids=ids.to(dev), topk_logprobs=lps.to(dev))):
                xm = shard.clone().requires_grad_()
                loss = ft.vocab_parallel_kd_loss(xm, target=t.to(dev), vocab_start=starts[rank], vocab_total=v,
                                                 reduction="none", nccl=mode == "nccl", **kwk)
                (loss.nan_to_num() * up).sum().backward()
                kd[mode] += [loss.detach().nan_to_num(7.0).cpu(), xm.grad.float().nan_to_num(7.0).cpu()]
        same_sm = same_sm and all(torch.equal(a, b) for a, b in zip(kd["gather"], kd["nccl"]))
        results.put((rank, used, torch.equal(out["gather"][0].nan_to_num(7.0), out["nccl"][0].nan_to_num(7.0)),
                     torch.equal(out["gather"][1], out["nccl"][1]) and same_lin and same_sm,
                     bool(torch.isnan(out["nccl"][0][2])),
                     float((out["nccl"][0].double() - ref).nan_to_num().abs().max()), lin_err,
                     out["nccl"][0].nan_to_num(7.0).numpy().tobytes() + lin["nccl"][0].numpy().tobytes()
                     + lin["nccl"][1].float().numpy().tobytes()))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("widths", [[50000, 29000], [30000, 29000, 20000], [20000, 30000, 19000, 10000]],
                         ids=["2 ranks", "3 ranks", "4 ranks"])
def test_nccl_mode_gpus(widths):
    """W processes on W GPUs with PyTorch's NCCL communicator, uneven shards: the library's NCCL mode (one
    fce_cross_entropy_fwd_vp per rank) gives the same loss and gradient bits as the torch.distributed
    all-gather path, the same loss on every rank, and a NaN of one rank's shard on every rank; likewise
    linear cross-entropy with the LM head split by rows (fce_linear_cross_entropy_fwd_vp), whose dhidden is
    the same bits on every rank and in both paths (a rank-order sum), and whose dweight agrees within a bf16
    ulp; logsumexp and softmax in one call (fce_logsumexp_vp, fce_temp_softmax_vp) and KD (fce_kd_fwd_vp:
    forward KL, JSD, a top-K teacher; the backward from its statistics), the same bits as the all-gather
    path."""
    torch = pytest.importorskip("torch")
    world = len(widths)
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip("needs %d GPUs" % world)
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_nccl_rank, args=(r, world, port, widths, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = [results.get(timeout=300) for _ in range(world)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank, used, same_loss, same_grad, nan_seen, err, lin_err, _ in got:
        assert used, "rank %d did not run NCCL mode" % rank
        assert same_loss and same_grad, (rank, same_loss, same_grad)
        assert nan_seen, rank
        assert err < 2e-5, (rank, err)
        # a logit whose fp32 GEMM value rounds to the other bf16 neighbour of the float64 one moves the mean
        # loss by up to about an ulp of it over 64 rows
        assert lin_err < 1e-4, (rank, lin_err)
    assert all(g[-1] == got[0][-1] for g in got), "the ranks' losses or dhidden differ"


@pytest.mark.parametrize("widths,pad", [([40], 0), ([17, 30], 3)])
def test_logsumexp_and_softmax_shards(widths, pad):
    n, v, temp = 6, 47, 0.8
    x = (rng.standard_normal((n, v)) * 3).astype(np.float32)
    starts = np.cumsum([0] + widths)[:-1]
    widths = widths[:-1] + [v - starts[-1]]
    shards = []
    for r, (s, w) in enumerate(zip(starts, widths)):
        part = np.full((n, w + (pad if r == len(widths) - 1 else 0)), np.nan, np.float32)
        part[:, :w] = x[:, s:s + w]
        shards.append((int(s), w, part))
    scale = fusedce.softmax_scale(temp)  # the fp32 1.0f / T fce_temp_softmax forms
    rec = np.stack([fusedce.logsumexp_partial(p, vocab_start=s, vocab_total=v, scale=scale) for s, _, p in shards])
    lse = fusedce.logsumexp_combine(rec)
    pairs = fusedce.logsumexp_combine(rec, pair=True)
    np.testing.assert_allclose(lse, fusedce.logsumexp(x, scale=scale), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(scale * pairs[:, 0].astype(np.float64) + pairs[:, 1], lse, rtol=1e-6, atol=1e-6)
    whole = fusedce.temp_softmax(x, temperature=temp, logprobs=True)
    for form in (lse, pairs):
        for s, w, part in shards:
            got = fusedce.temp_softmax(part, temperature=temp, logprobs=True, vocab_start=s, vocab_total=v, lse=form)
            np.testing.assert_allclose(got.probs[:, :w], whole.probs[:, s:s + w], rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(got.logprobs[:, :w], whole.logprobs[:, s:s + w], rtol=1e-5, atol=1e-5)
            assert (got.probs[:, w:] == 0).all() and (got.logprobs[:, w:] == -np.inf).all()
    with pytest.raises(NotImplementedError):
        fusedce.temp_softmax(shards[0][2], temperature=0.0, vocab_start=0, vocab_total=v, lse=lse)


def test_shard_softmax_from_pairs_at_a_small_temperature():
    """A shard's softmax at T = 1e-3 of fp16 logits holding +-65504: from the combine's pairs (records at the
    fp32 scale 1.0f / T, fusedce.softmax_scale) every row sums to 1 over the shards, no NaN, the float64
    softmax's values; the [N] lse (6.6e7, rounded to a multiple of 4) gives rows off by up to e^2."""
    n, v, temp = 4, 24, 1e-3
    x = (rng.standard_normal((n, v)) * 3).astype(np.float16)
    x[0, 3], x[0, 17] = 65504, -65504
    x[1, 5] = x[1, 20] = 65504  # two maxima: 0.5 each
    x[2, :] = -65504
    x[2, 9] = np.float16(-65472)  # the max 32 below the rest: at T = 1e-3, probability 1 there
    scale = fusedce.softmax_scale(temp)
    assert scale == float(np.float32(1) / np.float32(temp)) and scale != float(np.float32(1 / temp))
    shards = [(0, x[:, :10].copy()), (10, x[:, 10:].copy())]
    rec = np.stack([fusedce.logsumexp_partial(p, vocab_start=s, vocab_total=v, scale=scale) for s, p in shards])
    pairs = fusedce.logsumexp_combine(rec, pair=True)
    assert pairs.shape == (n, 2)
    np.testing.assert_array_equal(pairs[:, 0], x.astype(np.float32).max(axis=1))  # raw maxima
    z = x.astype(np.float64) / np.float64(np.float32(temp))
    ref = np.exp(z - z.max(axis=1, keepdims=True))
    ref /= ref.sum(axis=1, keepdims=True)
    got = np.concatenate([fusedce.temp_softmax(p, temperature=temp, vocab_start=s, vocab_total=v, lse=pairs).probs
                          for s, p in shards], axis=1)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got.sum(axis=1), 1, rtol=0, atol=1e-5)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(got[1, [5, 20]], [0.5, 0.5])
    plain = fusedce.logsumexp_combine(rec)
    off = np.concatenate([fusedce.temp_softmax(p, temperature=temp, vocab_start=s, vocab_total=v, lse=plain).probs
                          for s, p in shards], axis=1)
    assert abs(off.sum(axis=1) - 1).max() > 0.1  # the [N] form's documented rounding


# ---- fusedce.torch's vocabulary-parallel functions, one process (the one-shard case) --------------------

def _torch_offset_cases():
    """(logits, targets) for the torch functions: fp32 logits near 1e5 and the rows [2^25, 2^25, 0, 1]
    (whose gradient at target 0 is exactly [-0.5, 0.5, 0, 0])."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(13)
    x = torch.randn(6, 37, generator=g) * 2 + 1e5
    t = torch.randint(0, 37, (6,), generator=g)
    big = 2.0 ** 25
    rows = torch.tensor([[big, big, 0.0, 1.0], [0.0, 1.0, big, big]])
    return [(x, t), (rows, torch.tensor([0, 3]))]


def _torch_ce_grad64(x, t):
    import torch
    x64 = x.double()
    d = x64 - x64.max(-1, keepdim=True).values
    p = d.exp() / d.exp().sum(-1, keepdim=True)
    return p - torch.nn.functional.one_hot(t, x.shape[-1]).double()


@pytest.mark.parametrize("pad", [0, 3])
def test_torch_vocab_parallel_cross_entropy_exact_at_large_offsets(pad):
    """vocab_parallel_cross_entropy and vocab_parallel_logprobs_entropy without a process group (one shard,
    padded by `pad` columns past vocab_total): the backward reads the combine's pairs, so the gradient is the
    float64 one at logits + 1e5 and exactly [-0.5, 0.5, 0, 0] g on the rows of two equal maxima."""
    torch = pytest.importorskip("torch")
    import fusedce.torch as ft
    for x0, t in _torch_offset_cases():
        n, v = x0.shape
        xs = torch.cat([x0, torch.full((n, pad), float("nan"))], 1) if pad else x0
        up = torch.linspace(0.5, 1.5, n)
        want = _torch_ce_grad64(x0, t) * up.double()[:, None]
        x = xs.clone().requires_grad_()
        loss = ft.vocab_parallel_cross_entropy(x, t, reduction="none", vocab_start=0, vocab_total=v)
        (loss * up).sum().backward()
        assert (x.grad[:, v:] == 0).all()
        if v == 4:
            assert torch.equal(x.grad[:, :v].double(), want), x.grad
        else:
            err = float((x.grad[:, :v].double() - want).abs().max())
            assert err < 2e-6, "vocab_parallel_cross_entropy: gradient off by %g" % err
        x = xs.clone().requires_grad_()
        lp, _ = ft.vocab_parallel_logprobs_entropy(x, t, vocab_start=0, vocab_total=v)
        (lp * up).sum().backward()
        err = float((x.grad[:, :v].double() + want).abs().max())  # d logprob = -d loss
        assert err < 2e-6, "vocab_parallel_logprobs_entropy: gradient off by %g" % err


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_torch_vocab_parallel_linear_cross_entropy_exact_at_large_offsets(reduction):
    """vocab_parallel_linear_cross_entropy without a process group: the shard's backward from the combine's
    pairs, a bias putting every logit near 1e5; dhidden, dweight and dbias against float64."""
    torch = pytest.importorskip("torch")
    import fusedce.torch as ft
    g = torch.Generator().manual_seed(17)
    h0, w0 = torch.randn(6, 8, generator=g), torch.randn(29, 8, generator=g) * 0.5
    b0 = torch.randn(29, generator=g) + 1e5
    t = torch.randint(0, 29, (6,), generator=g)
    h, w, b = (a.clone().requires_grad_() for a in (h0, w0, b0))
    loss = ft.vocab_parallel_linear_cross_entropy(h, w, t, bias=b, reduction=reduction)
    up = torch.linspace(0.5, 1.5, 6) if reduction == "none" else torch.tensor(0.75)
    (loss * up).sum().backward()
    z = (h0.double() @ w0.double().T + b0.double()).float()
    dz = _torch_ce_grad64(z, t) * (up.double()[:, None] if reduction == "none" else up.double() / 6)
    for got, want, name in ((b.grad, dz.sum(0), "dbias"), (h.grad, dz @ w0.double(), "dhidden"),
                            (w.grad, dz.T @ h0.double(), "dweight")):
        err = float((got.double() - want).abs().max())
        assert err < 1e-5, (name, err)


def test_torch_vocab_parallel_logsumexp_exact_at_large_offsets():
    """vocab_parallel_logsumexp at x + 1e5 (scale 0.8): its gradient scale * softmax(scale x) from the pairs
    against float64; without a gradient the lse is the library's [N] output, with one it is formed from the
    pairs (scale M + log D in float64), within 1 ulp of it and of the float64 lse."""
    torch = pytest.importorskip("torch")
    import fusedce.torch as ft
    g = torch.Generator().manual_seed(19)
    x0 = torch.randn(5, 31, generator=g) * 2 + 1e5
    x = x0.clone().requires_grad_()
    lse = ft.vocab_parallel_logsumexp(x, scale=0.8)
    u = torch.randn(5, generator=g)
    (lse * u).sum().backward()
    x64 = x0.double().requires_grad_()
    ref = torch.logsumexp(0.8 * x64 - 0.8 * x64.detach().max(-1, keepdim=True).values, -1)
    (ref * u.double()).sum().backward()
    err = float((x.grad.double() - x64.grad).abs().max())
    assert err < 2e-6, "vocab_parallel_logsumexp: gradient off by %g" % err
    lse64 = ref.detach() + 0.8 * x0.double().max(-1).values
    ulp = torch.finfo(torch.float32).eps * lse64.abs()
    assert bool(((lse.detach().double() - lse64).abs() <= ulp).all())
    with torch.no_grad():
        plain = ft.vocab_parallel_logsumexp(x0, scale=0.8)
    rec = fusedce.logsumexp_partial(x0, vocab_start=0, vocab_total=31, scale=0.8)
    assert torch.equal(plain, fusedce.logsumexp_combine(rec[None]))
    assert bool(((lse.detach() - plain).abs() <= torch.finfo(torch.float32).eps * plain.abs()).all())


@pytest.mark.parametrize("log", [False, True])
def test_torch_vocab_parallel_softmax_at_a_small_temperature(log):
    """vocab_parallel_softmax at T = 1e-3 of fp16 logits holding +-65504 (one shard): no NaN, rows summing to 1,
    the float64 softmax's values and gradient (the records at the fp32 scale 1.0f / T, the softmax from the
    combine's pairs)."""
    torch = pytest.importorskip("torch")
    import fusedce.torch as ft
    g = torch.Generator().manual_seed(23)
    x0 = (torch.randn(4, 26, generator=g) * 3).to(torch.float16)
    x0[0, 3], x0[0, 17] = 65504, -65504
    x0[1, 5] = x0[1, 20] = 65504
    x0[2, :] = -65504
    x0[2, 9] = -65472
    x = x0.clone().requires_grad_()
    y = ft.vocab_parallel_softmax(x, 1e-3, log=log)
    assert not torch.isnan(y).any()
    p = y.exp() if log else y
    torch.testing.assert_close(p.sum(-1), torch.ones(4), rtol=0, atol=1e-5)
    t32 = float(torch.tensor(1e-3, dtype=torch.float32))
    x64 = x0.double().requires_grad_()
    z = x64 / t32
    ref = torch.log_softmax(z, -1) if log else torch.softmax(z, -1)
    fin = torch.isfinite(ref)
    # log-probabilities of -1e8 hold fp32's relative rounding
    torch.testing.assert_close(y.double()[fin], ref.detach()[fin], rtol=1e-6 if log else 0, atol=1e-5)
    if log:
        assert torch.equal(torch.isfinite(y), fin)
    else:
        assert torch.equal(y[1, [5, 20]], torch.tensor([0.5, 0.5]))
    gu = torch.randn(4, 26, generator=g)
    (y.masked_fill(~torch.isfinite(y), 0) * gu).sum().backward()
    (ref.masked_fill(~fin, 0) * gu.double()).sum().backward()
    assert not torch.isnan(x.grad).any()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=2e-3, atol=2e-2)  # fp16 gradients of up to 1e3
