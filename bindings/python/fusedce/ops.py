"""The library's ops on numpy arrays (CPU) and PyTorch tensors (CPU or CUDA).

Shapes follow the C header (row-major): logits [N, V], targets [N] (0-based class indices), hidden
[N, H], weight [V, H]. Every option is a keyword argument whose default is the loaded library's, from its
`fce_*_init` functions (the header's `*_INIT` values); every options/outputs struct passed to the library
is filled by those functions first.
Output keywords take False (not computed), True (allocated) or an array/tensor to write into (e.g.
`dlogits=logits` computes the gradient in place). Results are namedtuples; for numpy inputs scalar
losses are numpy float32 scalars, for torch inputs 0-d tensors. CUDA work is enqueued on the current
torch stream (or `stream=`) and never synchronizes. `workspace=` takes a caller's scratch array or tensor
on the call's device, aligned to WORKSPACE_ALIGNMENT (FCE_WORKSPACE_ALIGNMENT, 16) bytes, instead of the
handle's cached one. Failures raise FusedCEError subclasses carrying the library's message.
"""
from collections import namedtuple

import numpy as np

from ._generated import MACROS
from ._lib import Handle, check, defaults, ffi, lib
from ._tensor import Call, is_torch


def _lean(ref, handle, stream, workspace):
    """torch tensors on this thread's handle and the current stream, no caller workspace: fusedce._fast."""
    global _fast
    if handle is not None or stream is not None or workspace is not None or not is_torch(ref):
        return False
    if _fast is None:
        from . import _fast as f
        _fast = f
    return True


_fast = None  # imported with torch, on the first torch call


def _grad_torch(g, like):
    """An upstream gradient for the lean path: None, or an fp32 tensor (a number as a 0-d tensor on like's
    device, an array or a list converted), which the caller passes straight to fusedce._fast: the callee's
    frame holds it until the library call has returned."""
    torch = _fast.torch
    if g is None or is_torch(g):
        return g if g is None else g.to(torch.float32)
    if isinstance(g, (int, float)):
        return torch.full((), float(g), dtype=torch.float32, device=like.device)
    return torch.as_tensor(np.asarray(g, dtype=np.float32), device=like.device)

_CE = defaults("fce_ce_options_t")
_LSE = defaults("fce_lse_options_t")
_SM = defaults("fce_softmax_options_t")
_KD = defaults("fce_kd_options_t")


def _enum_names(ctype, prefix):
    return {name[len(prefix):].lower(): value for value, name in ffi.typeof(ctype).elements.items()
            if name.startswith(prefix)}


_REDUCTIONS = _enum_names("fce_reduction_t", "FCE_REDUCTION_")
_DIVERGENCES = _enum_names("fce_kd_divergence_t", "FCE_KD_")
_TOPK_NORMS = _enum_names("fce_kd_topk_norm_t", "FCE_KD_TOPK_")
_NAME = {
    "reduction": {v: k for k, v in _REDUCTIONS.items()},
    "divergence": {v: k for k, v in _DIVERGENCES.items()},
    "topk_norm": {v: k for k, v in _TOPK_NORMS.items()},
}


def _enum(table, value, what):
    if isinstance(value, int):
        return value
    try:
        return table[str(value).lower()]
    except KeyError:
        raise ValueError("%s must be one of %s, got %r" % (what, sorted(table), value)) from None


CrossEntropyOutput = namedtuple("CrossEntropyOutput", "loss lse z_loss argmax entropy dlogits")

# The lse's two forms (fce_ce_outputs_t.lse; since 0.2.0 of the header): [N] fp32, the lse itself, or its
# pairs [N, 2] fp32 contiguous, (m, l) = (max_j z_j, log sum_j exp(z_j - m)), lse = m + l (for logsumexp and
# a shard's softmax: m the max of the raw x, lse = scale * m + l). A backward or a shard's softmax given the
# pairs forms every probability as exp((z_j - m) - l), exact at any common offset of the logits; from the [N]
# form each carries the lse's fp32 rounding (|lse| 2^-24 relative: 6e-3 at |lse| = 1e5). An lse output
# keyword takes False (none), True ([N]), LSE_PAIR ("pair": the pairs [N, 2]) or an array of either shape to
# write into; an lse input takes an array of either shape.
LSE_PAIR = "pair"
SoftmaxOutput = namedtuple("SoftmaxOutput", "probs logprobs")
KDOutput = namedtuple("KDOutput", "loss dstudent")
LinearCrossEntropyOutput = namedtuple("LinearCrossEntropyOutput",
                                      "loss lse z_loss argmax entropy dhidden dweight dbias")
LinearCrossEntropyGrads = namedtuple("LinearCrossEntropyGrads", "dhidden dweight dbias")


def _ce_options(c, reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, class_weights,
                vocab_start=0, vocab_total=0):
    o = c.struct("fce_ce_options_t")
    o.vocab_start = int(vocab_start)
    o.vocab_total = int(vocab_total)
    o.reduction = _enum(_REDUCTIONS, reduction, "reduction")
    o.ignore_index = int(ignore_index)
    o.label_smoothing = float(label_smoothing)
    o.z_loss_scale = float(z_loss_scale)
    o.softcap = float(softcap)
    o.logit_scale = float(logit_scale)
    o.class_weights = c.dl(None if class_weights is None else c.native(class_weights))
    return o


def _loss_buffer(c, reduction, n):
    return c.empty((n,) if _enum(_REDUCTIONS, reduction, "reduction") == _REDUCTIONS["none"] else (), "float32")


def _ce_outputs(c, n, reduction, lse, z_loss, argmax, entropy, argmax_dtype, dlogits):
    """The fce_ce_outputs_t of a call with n rows (outputs allocated or taken as given), and a function that
    returns the CrossEntropyOutput once the call has run (scalar losses are read then)."""
    loss_a = _loss_buffer(c, reduction, n)
    lse_a = _lse_output(c, lse, n)
    zl_a = c.output(z_loss, lambda: _loss_buffer(c, reduction, n))
    am_a = c.output(argmax, lambda: c.empty((n,), argmax_dtype))
    ent_a = c.output(entropy, lambda: c.empty((n,), "float32"))
    outs = c.struct("fce_ce_outputs_t")
    outs.loss = c.dl(loss_a, True)
    outs.lse = c.dl(lse_a, True)
    outs.z_loss = c.dl(zl_a, True)
    outs.argmax = c.dl(am_a, True)
    outs.entropy = c.dl(ent_a, True)
    outs.dlogits = c.dl(dlogits, True)
    return outs, lambda: CrossEntropyOutput(c.scalar_out(loss_a), lse_a, c.scalar_out(zl_a), am_a, ent_a, dlogits)


def _lse_output(c, spec, n):
    """An lse output of n rows: None (False/None), a new [n] fp32 (True), new pairs [n, 2] fp32 (LSE_PAIR),
    or the array given. Raises ValueError for another string."""
    if isinstance(spec, str):
        if spec != LSE_PAIR:
            raise ValueError("lse must be False, True, %r or an array, got %r" % (LSE_PAIR, spec))
        return c.empty((n, 2), "float32")
    return c.output(spec, lambda: c.empty((n,), "float32"))


def lse_value(lse):
    """The [N] lse of an lse in either form: an [N] array itself, pairs [N, 2] as m + l added in fp32: the
    [N] lse of cross_entropy_fwd on CUDA (m + logf(d) in fp32) bit for bit; where the library rounds m + log s
    once in float64 (the CPU backend, the combines, linear cross-entropy) its [N] output may differ from this
    by 1 ulp. numpy arrays and torch tensors (of fp32 pairs: fp32 results)."""
    if len(lse.shape) != 2:
        return lse
    return lse[:, 0] + lse[:, 1]


def _grad(c, grad_loss):
    if grad_loss is None:
        return None
    if isinstance(grad_loss, (int, float)):
        return c.full((), grad_loss)
    return c.native(grad_loss, "float32")


def _rows(x):
    return int(x.shape[0])


# ---- cross-entropy --------------------------------------------------------------------------------

def cross_entropy_fwd(logits, targets, *, reduction=_NAME["reduction"][_CE["reduction"]],
                      ignore_index=_CE["ignore_index"], label_smoothing=_CE["label_smoothing"],
                      z_loss_scale=_CE["z_loss_scale"], softcap=_CE["softcap"], logit_scale=_CE["logit_scale"],
                      class_weights=None, lse=True, z_loss=False, argmax=False, entropy=False, dlogits=False,
                      grad_loss=None, grad_entropy=None, argmax_dtype="int64", handle=None, stream=None,
                      workspace=None):
    """fce_cross_entropy_fwd: logits [N, V] (fp32/bf16/fp16), targets [N] (int32/int64, 0-based).

    Returns CrossEntropyOutput(loss, lse, z_loss, argmax, entropy, dlogits); outputs not asked for are
    None. loss/z_loss are [N] for reduction="none", scalars otherwise; dlogits (gradient times grad_loss)
    has the logits' dtype. lse: True gives the [N] fp32 lse, LSE_PAIR ("pair") its pairs [N, 2] fp32 (m, l),
    lse = m + l: the form to save for cross_entropy_bwd, whose gradient from it holds at any offset of the
    logits (lse_value turns them into the [N] values); an array of either shape is written. grad_entropy (a
    number or an [N] fp32 array; needs dlogits) adds grad_entropy * dH/dlogits to dlogits, H the entropy
    (dH/dz_j = p_j (sum_k p_k z_k - z_j)). See the header's fce_ce_options_t and fce_ce_outputs_t for the
    math. Raises ValueError for an lse string other than "pair", and the library's errors (FusedCEError
    subclasses: ShapeMismatchError for an lse array of another shape, UnsupportedLayoutError for pairs that
    are not contiguous, ...)."""
    if (_fast is not None and _fast._EAGER and dlogits is False and grad_loss is None and class_weights is None
            and handle is None and stream is None and workspace is None and type(logits) is _fast.torch.Tensor
            and type(targets) is _fast.torch.Tensor and argmax_dtype == "int64" and lse.__class__ is bool
            and z_loss.__class__ is bool and argmax.__class__ is bool and entropy.__class__ is bool
            and not logits.requires_grad):
        # the common torch call, straight to libfusedce_torch's op (fusedce._eager)
        try:
            if not (lse or z_loss or argmax or entropy) and softcap == 0:  # the loss alone
                return CrossEntropyOutput(_fast.eager_cross_entropy_loss(
                    logits, targets, _REDUCTIONS[reduction] if reduction.__class__ is str else int(reduction),
                    ignore_index, label_smoothing, z_loss_scale, logit_scale, False), None, None, None, None, None)
            return CrossEntropyOutput(*_fast.eager_cross_entropy(
                logits, targets, None, _REDUCTIONS[reduction] if reduction.__class__ is str else int(reduction),
                ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, lse, z_loss, argmax, entropy, False),
                None)
        except RuntimeError as e:
            _fast.reraise(e)
        except (TypeError, KeyError):  # an argument of another type: the general path converts or refuses it
            pass
    if (_lean(logits, handle, stream, workspace) and is_torch(targets) and argmax_dtype == "int64"
            and (isinstance(lse, bool) or (isinstance(lse, str) and lse == LSE_PAIR))
            and all(isinstance(o, bool) for o in (z_loss, argmax, entropy))
            and (isinstance(dlogits, bool) or is_torch(dlogits)) and (class_weights is None or is_torch(class_weights))):
        # torch tensors, this thread's handle, the current stream, outputs allocated here: the lean path
        d = _fast.torch.empty_like(logits) if dlogits is True else (None if dlogits is False else dlogits)
        loss_t, lse_t, zl_t, am_t, ent_t = _fast.cross_entropy_fwd(
            logits, targets, class_weights, _enum(_REDUCTIONS, reduction, "reduction"), int(ignore_index),
            float(label_smoothing), float(z_loss_scale), float(softcap), float(logit_scale), lse, z_loss, argmax,
            entropy, dlogits=d, grad_loss=_grad_torch(grad_loss, logits),
            grad_entropy=_grad_torch(grad_entropy, logits))
        return CrossEntropyOutput(loss_t, lse_t, zl_t, am_t, ent_t, d)
    c = Call(logits, handle, stream)
    targets = c.native(targets)
    dl_a = c.output(dlogits, lambda: c.empty_like(logits))
    opts = _ce_options(c, reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, class_weights)
    outs, result = _ce_outputs(c, _rows(logits), reduction, lse, z_loss, argmax, entropy, argmax_dtype, dl_a)
    outs.grad_loss = c.dl(_grad(c, grad_loss))
    outs.grad_entropy = c.dl(_grad(c, grad_entropy))
    c.run("fce_cross_entropy_fwd", c.dl(logits), c.dl(targets), opts, outs, workspace=workspace)
    return result()


def cross_entropy(logits, targets, **kw):
    """The loss alone (keywords as cross_entropy_fwd)."""
    return cross_entropy_fwd(logits, targets, lse=False, **kw).loss


def cross_entropy_bwd(logits, targets, lse, *, grad_loss=None, dlogits=None,
                      reduction=_NAME["reduction"][_CE["reduction"]], ignore_index=_CE["ignore_index"],
                      label_smoothing=_CE["label_smoothing"], z_loss_scale=_CE["z_loss_scale"],
                      softcap=_CE["softcap"], logit_scale=_CE["logit_scale"], class_weights=None,
                      vocab_start=0, vocab_total=0, handle=None, stream=None, workspace=None):
    """fce_cross_entropy_bwd: d(loss)/d(logits) * grad_loss from the forward's lse (same options).
    lse: [N] fp32, or its pairs [N, 2] fp32 contiguous (cross_entropy_fwd(lse="pair")): from the pairs every
    probability is exp((z_j - m) - l), exact at any offset of the logits and the fused gradient's bits; from
    [N] each carries the lse's fp32 rounding (|lse| 2^-24 relative). grad_loss: None (= 1), a number, or an
    [N] array for reduction="none". dlogits: None to allocate, or the array to write (it may be `logits`
    itself). Returns dlogits [N, V] in the logits' dtype. With vocab_total > 0, `logits` is the vocabulary
    shard starting at column vocab_start and `lse` the one cross_entropy_combine returned (its pairs, for the
    same exactness): the shard's gradient. Raises the library's errors (ShapeMismatchError for an lse that
    is neither [N] nor [N, 2], UnsupportedLayoutError for non-contiguous pairs, ...)."""
    c = Call(logits, handle, stream)
    targets = c.native(targets)
    out = dlogits if dlogits is not None else c.empty_like(logits)
    opts = _ce_options(c, reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, class_weights,
                       vocab_start, vocab_total)
    c.run("fce_cross_entropy_bwd", c.dl(logits), c.dl(targets), c.dl(c.native(lse)), c.dl(_grad(c, grad_loss)), opts,
          c.dl(out, True), workspace=workspace)
    return out


def cross_entropy_bwd_ex(logits, targets, lse, *, entropy=None, grad_loss=None, grad_entropy=None, dlogits=None,
                         reduction=_NAME["reduction"][_CE["reduction"]], ignore_index=_CE["ignore_index"],
                         label_smoothing=_CE["label_smoothing"], z_loss_scale=_CE["z_loss_scale"],
                         softcap=_CE["softcap"], logit_scale=_CE["logit_scale"], class_weights=None,
                         vocab_start=0, vocab_total=0, handle=None, stream=None, workspace=None):
    """fce_cross_entropy_bwd_ex: grad_loss * d(loss)/d(logits) + grad_entropy * dH/d(logits) from the
    forward's lse ([N] fp32 or its pairs [N, 2], as cross_entropy_bwd) and entropy ([N] fp32; same
    options). grad_loss as cross_entropy_bwd; grad_entropy
    None (no entropy term), a number or an [N] array, and then `entropy` is required (InvalidArgumentError
    otherwise). Returns dlogits (allocated unless given; may be `logits` itself)."""
    c = Call(logits, handle, stream)
    targets = c.native(targets)
    out = dlogits if dlogits is not None else c.empty_like(logits)
    opts = _ce_options(c, reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, class_weights,
                       vocab_start, vocab_total)
    inputs = c.struct("fce_ce_bwd_inputs_t")
    inputs.lse = c.dl(c.native(lse))
    inputs.grad_loss = c.dl(_grad(c, grad_loss))
    inputs.entropy = c.dl(None if entropy is None else c.native(entropy))
    inputs.grad_entropy = c.dl(_grad(c, grad_entropy))
    c.run("fce_cross_entropy_bwd_ex", c.dl(logits), c.dl(targets), inputs, opts, c.dl(out, True),
          workspace=workspace)
    return out


# ---- vocabulary-parallel cross-entropy ------------------------------------------------------------

RECORD_FIELDS_LOSS, RECORD_FIELDS_ENTROPY, RECORD_FIELDS_ALL = (
    MACROS[f"FCE_CE_RECORD_FIELDS_{k}"] for k in ("LOSS", "ENTROPY", "ALL"))


def cross_entropy_record_fields():
    """K, the fp32 fields of a row's full record (fce_cross_entropy_record_fields: RECORD_FIELDS_ALL). Narrower
    records are its prefixes: RECORD_FIELDS_LOSS (loss, lse, z-loss) and RECORD_FIELDS_ENTROPY (and entropy)."""
    k = ffi.new("int64_t *")
    check(lib.fce_cross_entropy_record_fields(ffi.NULL, k), "fce_cross_entropy_record_fields")
    return int(k[0])


def cross_entropy_partial(logits, targets, *, vocab_start, vocab_total, reduction=_NAME["reduction"][_CE["reduction"]],
                          ignore_index=_CE["ignore_index"], label_smoothing=_CE["label_smoothing"],
                          z_loss_scale=_CE["z_loss_scale"], softcap=_CE["softcap"], logit_scale=_CE["logit_scale"],
                          class_weights=None, fields=RECORD_FIELDS_ALL, records=None, handle=None, stream=None):
    """fce_cross_entropy_partial: the [N, K] fp32 records of a vocabulary shard. logits [N, V_local] are the
    global columns [vocab_start, vocab_start + V_local) of a vocabulary of vocab_total, 0 <= vocab_start <=
    vocab_total (columns past it are padding; vocab_start = vocab_total: a shard of padding alone, whose
    record is neutral); targets [N] are global indices; class_weights cover the whole vocabulary. fields: K,
    one of RECORD_FIELDS_LOSS (6) / _ENTROPY (7) / _ALL (9) (the narrower the record, the less the partial
    computes; the combine then gives no entropy / argmax); a given `records` array sets it by its shape.
    Fields 4-5 hold the shard's column range (int32 bits), which the combine checks. Gather every rank's
    records in rank order ([W, N, K]) for cross_entropy_combine. Raises InvalidArgumentError (no shard:
    vocab_total 0, or vocab_start outside [0, vocab_total]), ShapeMismatchError (another K) and the
    library's other errors."""
    c = Call(logits, handle, stream)
    targets = c.native(targets)
    out = records if records is not None else c.empty((_rows(logits), int(fields)), "float32")
    opts = _ce_options(c, reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, class_weights,
                       vocab_start, vocab_total)
    c.run_plain("fce_cross_entropy_partial", c.dl(logits), c.dl(targets), opts, c.dl(out, True))
    return out


def cross_entropy_combine(records, targets, *, vocab_total, reduction=_NAME["reduction"][_CE["reduction"]],
                          ignore_index=_CE["ignore_index"], label_smoothing=_CE["label_smoothing"],
                          z_loss_scale=_CE["z_loss_scale"], softcap=_CE["softcap"], logit_scale=_CE["logit_scale"],
                          class_weights=None, lse=True, z_loss=False, argmax=False, entropy=False,
                          argmax_dtype="int64", handle=None, stream=None, workspace=None):
    """fce_cross_entropy_combine: the cross-entropy forward of whole rows from every shard's records
    [W, N, K] fp32 (rank order; K one of RECORD_FIELDS_*), with the partial calls' options. Returns
    CrossEntropyOutput(loss, lse, z_loss, argmax, entropy, None), as cross_entropy_fwd of the unsharded
    logits; lse as cross_entropy_fwd's (True: [N]; "pair": the pairs [N, 2], m the rows' max z over every
    shard): pass the pairs to cross_entropy_bwd with each shard for its gradient. Records whose column ranges
    do not tile [0, vocab_total) in rank order (overlapping, gappy or out-of-order shards) give NaN loss, lse,
    z_loss and entropy and argmax -1 in every row, not an exception. Raises InvalidArgumentError (entropy
    without K >= RECORD_FIELDS_ENTROPY, argmax without RECORD_FIELDS_ALL), ShapeMismatchError, and the
    library's other errors."""
    c = Call(records, handle, stream)
    targets = c.native(targets)
    opts = _ce_options(c, reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, class_weights,
                       0, vocab_total)
    outs, result = _ce_outputs(c, int(records.shape[1]), reduction, lse, z_loss, argmax, entropy, argmax_dtype, None)
    c.run("fce_cross_entropy_combine", c.dl(records), c.dl(targets), opts, outs, workspace=workspace)
    return result()


class Communicator:
    """An NCCL communicator borrowed for NCCL mode (fce_comm_create). nccl_comm: the ncclComm_t as an integer
    address (PyTorch: ProcessGroupNCCL._comm_ptr(), non-zero once the group has run a collective); device: its
    CUDA device. The communicator stays the caller's: close() (or collection) releases only this object.
    Attributes: rank, size."""

    def __init__(self, nccl_comm, device=0):
        self.device = int(device)
        self.handle = Handle("cuda", self.device)
        out = ffi.new("fce_comm_t *")
        check(lib.fce_comm_create(self.handle.ptr, ffi.cast("struct ncclComm *", int(nccl_comm)), out),
              "fce_comm_create")
        self._ptr = ffi.gc(out[0], lib.fce_comm_destroy)
        r, w = ffi.new("int32_t *"), ffi.new("int32_t *")
        check(lib.fce_comm_info(self._ptr, r, w), "fce_comm_info")
        self.rank, self.size = int(r[0]), int(w[0])

    @property
    def ptr(self):
        if self._ptr is None:
            raise ValueError("Communicator is closed")
        return self._ptr

    def close(self):
        if self._ptr is not None:
            lib.fce_comm_destroy(ffi.gc(self._ptr, None))
            self._ptr = None


def cross_entropy_fwd_vp(logits, targets, comm, *, vocab_start, vocab_total,
                         reduction=_NAME["reduction"][_CE["reduction"]], ignore_index=_CE["ignore_index"],
                         label_smoothing=_CE["label_smoothing"], z_loss_scale=_CE["z_loss_scale"],
                         softcap=_CE["softcap"], logit_scale=_CE["logit_scale"], class_weights=None, lse=True,
                         z_loss=False, argmax=False, entropy=False, dlogits=False, grad_loss=None,
                         argmax_dtype="int64", stream=None, workspace=None):
    """fce_cross_entropy_fwd_vp: vocabulary-parallel cross-entropy over NCCL (a Communicator), one call per
    rank: this rank's shard logits [N, V_local] (global columns [vocab_start, vocab_start + V_local); past
    vocab_total is padding), targets [N] global indices. Returns CrossEntropyOutput of the whole rows, the
    same bits on every rank (lse as cross_entropy_fwd's: [N], or "pair" for the pairs [N, 2] a later
    cross_entropy_bwd of the shard should take); dlogits (True, or an array, may be the logits) is this
    shard's gradient times grad_loss. The records' all-gather runs on `stream` inside the library. Raises
    CommunicatorError when NCCL fails."""
    c = Call(logits, None, stream)
    targets = c.native(targets)
    dl_a = c.output(dlogits, lambda: c.empty_like(logits))
    opts = _ce_options(c, reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, class_weights,
                       vocab_start, vocab_total)
    outs, result = _ce_outputs(c, _rows(logits), reduction, lse, z_loss, argmax, entropy, argmax_dtype, dl_a)
    outs.grad_loss = c.dl(_grad(c, grad_loss))
    args = (comm.ptr, c.dl(logits), c.dl(targets), opts, outs)
    ws, wsb = c.workspace("fce_cross_entropy_fwd_vp_workspace_size", args, workspace)
    check(lib.fce_cross_entropy_fwd_vp(c.handle.ptr, comm.ptr, c.stream, *args[1:], ws, wsb),
          "fce_cross_entropy_fwd_vp")
    return result()


# ---- logsumexp and temperature softmax ------------------------------------------------------------

def logsumexp(x, *, scale=_LSE["scale"], out=None, handle=None, stream=None, workspace=None):
    """fce_logsumexp: [N] fp32, log(sum_j exp(scale * x[i, j])) for x [N, V]."""
    if _lean(x, handle, stream, workspace) and (out is None or is_torch(out)):
        return _fast.logsumexp(x, float(scale), out)
    c = Call(x, handle, stream)
    out = out if out is not None else c.empty((_rows(x),), "float32")
    o = c.struct("fce_lse_options_t")
    o.scale = float(scale)
    c.run("fce_logsumexp", c.dl(x), o, c.dl(out, True), workspace=workspace)
    return out


LSE_RECORD_FIELDS = MACROS["FCE_LSE_RECORD_FIELDS"]


def softmax_scale(temperature):
    """The logsumexp scale of a shard's softmax at `temperature`: the fp32 value 1.0f / T that fce_temp_softmax
    forms (fp32 1 divided by T rounded to fp32, not 1 / T in float64 rounded), as a Python float. Give it to
    logsumexp_partial for the lse that temp_softmax of the shard takes: at a small T another rounding of the
    scale moves x / T by whole nats."""
    return float(np.float32(1.0) / np.float32(temperature))


def logsumexp_partial(x, *, vocab_start, vocab_total, scale=_LSE["scale"], records=None, handle=None, stream=None):
    """fce_logsumexp_partial: the [N, LSE_RECORD_FIELDS] fp32 records of a vocabulary shard x [N, V_local]
    (global columns [vocab_start, vocab_start + V_local) of vocab_total, 0 <= vocab_start <= vocab_total:
    vocab_start = vocab_total is a shard of padding alone, whose record is neutral; columns past vocab_total
    are padding). Fields: 0 the max of the raw x over the shard's real columns, 1 sum exp((x - max) scale),
    2-3 its column range (int32 bits), 4 the scale, 5 vocab_total (int32 bits). For a shard's softmax at T,
    scale must be softmax_scale(T). Gather every rank's records in rank order ([W, N, K]) for
    logsumexp_combine. Raises InvalidArgumentError (no shard, vocab_start outside [0, vocab_total]),
    ShapeMismatchError (records not [N, LSE_RECORD_FIELDS]) and the library's other errors."""
    c = Call(x, handle, stream)
    out = records if records is not None else c.empty((_rows(x), LSE_RECORD_FIELDS), "float32")
    o = c.struct("fce_lse_options_t")
    o.scale = float(scale)
    o.vocab_start = int(vocab_start)
    o.vocab_total = int(vocab_total)
    c.run_plain("fce_logsumexp_partial", c.dl(x), o, c.dl(out, True))
    return out


def logsumexp_combine(records, *, pair=False, out=None, handle=None, stream=None):
    """fce_logsumexp_combine: the logsumexp of whole rows from every shard's records [W, N, LSE_RECORD_FIELDS]
    fp32 (rank order); the same bits on every rank. Returns [N] fp32, or with pair=True the pairs [N, 2] fp32
    (M, log D), M the rows' max raw x, lse = scale * M + log D: the form a shard's temp_softmax takes at any T
    without overflow or the rounding of a large lse. `out`: an [N] or [N, 2] fp32 array to write instead
    (its shape decides). Rows whose records disagree (scale, vocab_total) or whose ranges do not tile
    [0, vocab_total) in rank order are NaN, not an exception."""
    c = Call(records, handle, stream)
    if out is None:
        n = int(records.shape[1])
        out = c.empty((n, 2) if pair else (n,), "float32")
    c.run_plain("fce_logsumexp_combine", c.dl(records), c.dl(out, True))
    return out


def logsumexp_vp(x, comm, *, vocab_start, vocab_total, scale=_LSE["scale"], pair=False, out=None, stream=None,
                 workspace=None):
    """fce_logsumexp_vp: [N] fp32 (pair=True: the pairs [N, 2], as logsumexp_combine), the whole rows'
    logsumexp of scale * x from this rank's shard x [N, V_local] (global columns [vocab_start, vocab_start +
    V_local) of vocab_total) over NCCL (a Communicator): the records' all-gather runs on `stream` inside the
    library; the same bits on every rank as logsumexp_combine of every rank's logsumexp_partial. `out`: an
    [N] or [N, 2] fp32 array to write instead. Raises CommunicatorError when NCCL fails."""
    c = Call(x, None, stream)
    out = out if out is not None else c.empty((_rows(x), 2) if pair else (_rows(x),), "float32")
    o = c.struct("fce_lse_options_t")
    o.scale = float(scale)
    o.vocab_start = int(vocab_start)
    o.vocab_total = int(vocab_total)
    args = (comm.ptr, c.dl(x), o, c.dl(out, True))
    ws, wsb = c.workspace("fce_logsumexp_vp_workspace_size", args, workspace)
    check(lib.fce_logsumexp_vp(c.handle.ptr, comm.ptr, c.stream, *args[1:], ws, wsb), "fce_logsumexp_vp")
    return out


def temp_softmax_vp(logits, comm, *, vocab_start, vocab_total, temperature=_SM["temperature"], probs=True,
                    logprobs=False, lse=False, dtype="float32", stream=None, workspace=None):
    """fce_temp_softmax_vp: this rank's columns of softmax(logits / T) (and/or its log) over whole rows split
    across the ranks of a Communicator, in one call: the rows' lse of logits / T exchanged over NCCL, then the
    shard's probabilities (padding columns 0 and -inf), formed from the rows' pairs the call keeps. probs/
    logprobs as for temp_softmax; lse: True (a new [N] fp32), "pair" (the pairs [N, 2], as logsumexp_combine's)
    or an array of either shape receives the rows' lse of logits / T. One finite temperature > 0
    (BackendNotImplementedError otherwise). Returns SoftmaxOutput, and the lse as a third value when asked
    for."""
    c = Call(logits, None, stream)
    p_a = c.output(probs, lambda: c.empty_like(logits, dtype))
    lp_a = c.output(logprobs, lambda: c.empty_like(logits, dtype))
    lse_a = _lse_output(c, lse, _rows(logits))
    o = c.struct("fce_softmax_options_t")
    o.temperature = float(temperature)
    o.vocab_start = int(vocab_start)
    o.vocab_total = int(vocab_total)
    args = (comm.ptr, c.dl(logits), o, c.dl(p_a, True), c.dl(lp_a, True), c.dl(lse_a, True))
    ws, wsb = c.workspace("fce_temp_softmax_vp_workspace_size", args, workspace)
    check(lib.fce_temp_softmax_vp(c.handle.ptr, comm.ptr, c.stream, *args[1:], ws, wsb), "fce_temp_softmax_vp")
    out = SoftmaxOutput(p_a, lp_a)
    return (out, lse_a) if lse_a is not None else out


def temp_softmax(logits, *, temperature=_SM["temperature"], temperatures=None, probs=True, logprobs=False,
                 dtype="float32", vocab_start=0, vocab_total=0, lse=None, handle=None, stream=None,
                 workspace=None):
    """fce_temp_softmax: softmax of each row at a temperature (0 = greedy one-hot). temperatures: an
    optional [N] fp32 per-row override. probs/logprobs: False, True (allocated with `dtype`, "float32"
    or None for the logits' dtype) or an array (probs=logits works in place). Returns SoftmaxOutput.
    A vocabulary shard (vocab_total > 0, logits [N, V_local] the columns from vocab_start): its part of the
    whole rows' distribution from `lse`, the rows' logsumexp of logits / T (logsumexp_combine of every
    shard's logsumexp_partial with scale softmax_scale(T), the fp32 1.0f / T): its pairs [N, 2] fp32
    (logsumexp_combine(pair=True); log p_j = (x_j - M) / T - log D, finite at any T > 0) or [N] fp32 (every
    value then carries the lse's fp32 rounding: at T = 1e-3 and logits of 65504 the probabilities are off by
    e^2, and an lse that overflowed fp32 gives probabilities 0); one finite temperature > 0
    (BackendNotImplementedError otherwise). Raises InvalidArgumentError (a shard without lse),
    ShapeMismatchError (an lse neither [N] nor [N, 2]) and the library's other errors."""
    if (not vocab_total and _lean(logits, handle, stream, workspace) and (temperatures is None or is_torch(temperatures))
            and all(isinstance(o, bool) or is_torch(o) for o in (probs, logprobs))):
        odt = None if dtype is None else getattr(_fast.torch, dtype)
        f32 = _fast.torch.float32
        t = temperatures if temperatures is None or temperatures.dtype == f32 else temperatures.to(f32)  # as `c.native`
        p, lp = _fast.temp_softmax(logits, float(temperature), t, probs is not False, logprobs is not False,
                                   odt, None if isinstance(probs, bool) else probs,
                                   None if isinstance(logprobs, bool) else logprobs)
        return SoftmaxOutput(p, lp)
    c = Call(logits, handle, stream)
    p_a = c.output(probs, lambda: c.empty_like(logits, dtype))
    lp_a = c.output(logprobs, lambda: c.empty_like(logits, dtype))
    o = c.struct("fce_softmax_options_t")
    o.temperature = float(temperature)
    o.temperatures = c.dl(None if temperatures is None else c.native(temperatures, "float32"))
    o.vocab_start = int(vocab_start)
    o.vocab_total = int(vocab_total)
    o.lse = c.dl(None if lse is None else c.native(lse, "float32"))
    c.run("fce_temp_softmax", c.dl(logits), o, c.dl(p_a, True), c.dl(lp_a, True), workspace=workspace)
    return SoftmaxOutput(p_a, lp_a)


# ---- knowledge distillation -----------------------------------------------------------------------

def kd_loss(student, teacher_logits=None, *, topk_ids=None, topk_logprobs=None, targets=None,
            divergence=_NAME["divergence"][_KD["divergence"]], beta=_KD["beta"], temperature=_KD["temperature"],
            scale_by_t2=bool(_KD["scale_by_t2"]), topk_norm=_NAME["topk_norm"][_KD["topk_norm"]],
            reduction=_NAME["reduction"][_KD["reduction"]], ignore_index=_KD["ignore_index"],
            dstudent=False, grad_loss=None, handle=None, stream=None, workspace=None):
    """fce_kd_loss: divergence between softmax(student / T) and the teacher's distribution, per row.

    The teacher is either `teacher_logits` [N, V] or the pair `topk_ids` [N, K] (int32/int64; negative =
    unused slot) and `topk_logprobs` [N, K] fp32. divergence: "forward_kl" (KL(teacher||student)),
    "reverse_kl" or "jsd" (weight beta in [0, 1]). temperature: T in [KD_TEMPERATURE_MIN,
    KD_TEMPERATURE_MAX] = [1e-4, 100] (FCE_KD_TEMPERATURE_MIN/MAX; InvalidArgumentError otherwise). Rows
    whose target equals ignore_index are masked; "mean" is batchmean over unmasked rows.
    Returns KDOutput(loss, dstudent)."""
    if (teacher_logits is None) == (topk_ids is None or topk_logprobs is None):
        raise ValueError("kd_loss: give either teacher_logits or both topk_ids and topk_logprobs")
    c = Call(student, handle, stream)
    n = _rows(student)
    loss_a = _loss_buffer(c, reduction, n)
    ds_a = c.output(dstudent, lambda: c.empty_like(student))
    teacher = c.struct("fce_kd_teacher_t")
    teacher.logits = c.dl(None if teacher_logits is None else c.native(teacher_logits))
    teacher.topk_ids = c.dl(None if topk_ids is None else c.native(topk_ids))
    teacher.topk_logprobs = c.dl(None if topk_logprobs is None else c.native(topk_logprobs))
    o = _kd_options(c, divergence, beta, temperature, scale_by_t2, topk_norm, reduction, ignore_index)
    outs = c.struct("fce_kd_outputs_t")
    outs.loss = c.dl(loss_a, True)
    outs.dstudent = c.dl(ds_a, True)
    outs.grad_loss = c.dl(_grad(c, grad_loss))
    c.run("fce_kd_loss", c.dl(student), teacher, c.dl(None if targets is None else c.native(targets)), o, outs,
          workspace=workspace)
    return KDOutput(c.scalar_out(loss_a), ds_a)


def _kd_options(c, divergence, beta, temperature, scale_by_t2, topk_norm, reduction, ignore_index, vocab_start=0,
                vocab_total=0):
    o = c.struct("fce_kd_options_t")
    o.divergence = _enum(_DIVERGENCES, divergence, "divergence")
    o.beta = float(beta)
    o.temperature = float(temperature)
    o.scale_by_t2 = 1 if scale_by_t2 else 0
    o.topk_norm = _enum(_TOPK_NORMS, topk_norm, "topk_norm")
    o.reduction = _enum(_REDUCTIONS, reduction, "reduction")
    o.ignore_index = int(ignore_index)
    o.vocab_start = int(vocab_start)
    o.vocab_total = int(vocab_total)
    return o


def _shard_teacher(c, teacher_logits, topk_ids, topk_logprobs, fn):
    """The fce_kd_teacher_t of a vocabulary-parallel call: the shard's logits, or the top-K pair."""
    if (teacher_logits is None) == (topk_ids is None or topk_logprobs is None):
        raise ValueError("%s: give either teacher_logits or both topk_ids and topk_logprobs" % fn)
    teacher = c.struct("fce_kd_teacher_t")
    teacher.logits = c.dl(None if teacher_logits is None else c.native(teacher_logits))
    teacher.topk_ids = c.dl(None if topk_ids is None else c.native(topk_ids))
    teacher.topk_logprobs = c.dl(None if topk_logprobs is None else c.native(topk_logprobs))
    return teacher


# ---- vocabulary-parallel knowledge distillation ---------------------------------------------------
#
# The contract and the math are the header's section "Vocabulary-parallel knowledge distillation"
# (include/fusedce/fusedce.h, at fce_kd_partial / fce_kd_terms_partial); the error bounds are docs/numerics.md's.
# Forward and reverse KL (and JSD at beta 0 or 1, which are exactly them) take one exchange:
#     rec = kd_partial(shard)                         # [N, KD_RECORD_FIELDS] per rank
#     loss, stats = kd_combine(gather(rec))           # gather: [W, N, KD_RECORD_FIELDS], rank order
#     d = kd_bwd(shard, stats)
# JSD with 0 < beta < 1 and a top-K teacher take two (JSD's mixture M = beta*P_teacher + (1-beta)*P_student,
# and a top-K teacher's terms at its K ids, need the rows' normalizers before any term can be formed):
# kd_combine then returns loss None (for a top-K teacher pass loss=False) and the rows' statistics with
# A (field 4) not yet valid, and
#     terms = kd_terms_partial(shard, stats)          # [N, KD_TERMS_RECORD_FIELDS] per rank
#     loss, stats = kd_terms_combine(gather(terms), stats)   # the loss; A written into stats in place
# gives the loss and completes the statistics for kd_bwd. The second exchange works for KL too.
# A top-K teacher (topk_ids [N, K] global ids, negative = unused slot, and topk_logprobs [N, K] fp32) is
# passed whole to every rank's kd_partial, kd_terms_partial and kd_bwd instead of the shard's teacher logits.

KD_RECORD_FIELDS, KD_ROW_STATS_FIELDS = MACROS["FCE_KD_RECORD_FIELDS"], MACROS["FCE_KD_ROW_STATS_FIELDS"]
KD_TERMS_RECORD_FIELDS = MACROS["FCE_KD_TERMS_RECORD_FIELDS"]


def kd_needs_terms(divergence, beta=_KD["beta"], *, topk=False):
    """True when the divergence over vocabulary shards takes the second exchange (kd_terms_partial /
    kd_terms_combine): always for a top-K teacher (topk=True); else JSD with 0 < beta < 1 after rounding beta
    to fp32, as the library reads it (JSD at beta 0 or 1 is exactly forward or reverse KL and takes one).
    kd_combine's loss is None exactly then (for a top-K teacher when called with loss=False, as it should be).
    Raises ValueError for an unknown divergence name."""
    if topk:
        _enum(_DIVERGENCES, divergence, "divergence")
        return True
    if _enum(_DIVERGENCES, divergence, "divergence") != _DIVERGENCES["jsd"]:
        return False
    b = float(ffi.cast("float", float(beta)))
    return 0.0 < b < 1.0


def _targets_or_null(c, targets):
    return c.dl(None if targets is None else c.native(targets))


def kd_partial(student, teacher_logits=None, *, vocab_start, vocab_total, topk_ids=None, topk_logprobs=None,
               divergence=_NAME["divergence"][_KD["divergence"]], beta=_KD["beta"], temperature=_KD["temperature"],
               topk_norm=_NAME["topk_norm"][_KD["topk_norm"]], records=None, handle=None, stream=None):
    """fce_kd_partial: the records of a vocabulary shard of student and teacher (step 1).

    student: [N, V_local] fp32/bf16/fp16, the global columns [vocab_start, vocab_start + V_local) of a
    vocabulary of vocab_total; columns at or past vocab_total are padding and never read. The teacher is
    either teacher_logits [N, V_local] (fp32, bf16 or fp16, whatever the student's; the same columns), or a
    top-K teacher as kd_loss takes it: topk_ids [N, K] int32/int64 global vocabulary ids (negative = unused
    slot) and topk_logprobs [N, K] fp32 log-probabilities, the same arrays on every rank (the teacher's distribution is
    softmax(topk_logprobs / T) over the used slots; topk_norm "full_vocab" or "renormalize", as kd_loss). A
    top-K teacher always takes the second exchange (kd_combine with loss=False, kd_terms_partial,
    kd_terms_combine). divergence "forward_kl", "reverse_kl" or "jsd" (weight beta in [0, 1]; JSD's record is
    forward KL's, P the teacher); temperature T: both distributions are softmax(logits / T). Use the same
    options (and teacher) on every rank and in every later call of the row.
    Returns records [N, KD_RECORD_FIELDS] fp32 (into `records` when given): per row over the shard's real
    columns, with z = logits / T, P the weighting distribution and Q the other: max z_P, sum exp(z_P - max),
    max z_Q, sum exp(z_Q - max), X = sum exp(z_P - m_P)((z_P - m_P) - (z_Q - m_Q)) (nats); a top-K teacher's
    record holds the student's max and sum over the shard and over its columns at the teacher's ids in the
    shard, X NaN; fields 5-6 the shard's column range (int32 bits), which the combines check (ranges that do
    not tile [0, vocab_total) in rank order give NaN rows; vocab_start = vocab_total, a shard of padding
    alone, is neutral). Gather every rank's records in rank order ([W, N, KD_RECORD_FIELDS]) for kd_combine.
    Raises ValueError (neither or both teachers given), InvalidArgumentError (no shard: vocab_total 0 or
    vocab_start outside [0, vocab_total]; beta outside [0, 1]; T outside [KD_TEMPERATURE_MIN,
    KD_TEMPERATURE_MAX]), ShapeMismatchError (student, teacher and records disagree), UnsupportedDtypeError,
    UnsupportedLayoutError, DeviceMismatchError."""
    c = Call(student, handle, stream)
    teacher = _shard_teacher(c, teacher_logits, topk_ids, topk_logprobs, "kd_partial")
    out = records if records is not None else c.empty((_rows(student), KD_RECORD_FIELDS), "float32")
    o = _kd_options(c, divergence, beta, temperature, False, topk_norm, "mean", -100, vocab_start, vocab_total)
    c.run_plain("fce_kd_partial", c.dl(student), teacher, o, c.dl(out, True))
    return out


def kd_combine(records, *, vocab_total, targets=None, divergence=_NAME["divergence"][_KD["divergence"]],
               beta=_KD["beta"], temperature=_KD["temperature"], scale_by_t2=bool(_KD["scale_by_t2"]),
               topk_norm=_NAME["topk_norm"][_KD["topk_norm"]], reduction=_NAME["reduction"][_KD["reduction"]],
               ignore_index=_KD["ignore_index"], loss=True, row_stats=True, handle=None, stream=None,
               workspace=None):
    """fce_kd_combine: whole rows from every shard's records (step 3).

    records: [W, N, KD_RECORD_FIELDS] fp32, contiguous, every rank's kd_partial records in rank (vocabulary)
    order; the options are the partial calls' (vocab_start is not read). targets: optional [N] int32/int64,
    rows whose target is ignore_index are masked (loss 0, gradient 0; "mean" is batchmean over the others).
    loss: False skips the loss (the library gets none): pass it for a top-K teacher, whose records carry no
    divergence (X NaN: a loss formed from them would be NaN) and whose loss comes from kd_terms_combine; then
    row_stats is required. JSD with 0 < beta < 1 skips it whatever `loss` says.
    Returns (loss, row_stats):
      - loss: the divergence of the whole rows in nats (times T^2 with scale_by_t2), fp32 [N] ("none") or a
        scalar, what kd_loss of the unsharded rows returns within the fp32 rounding of the records' sums;
        None with loss=False or when kd_needs_terms(divergence, beta) (JSD with 0 < beta < 1: the loss needs
        the second exchange, kd_terms_partial and kd_terms_combine);
      - row_stats: [N, KD_ROW_STATS_FIELDS] fp32, the same bits on every rank (M_student, log D_student,
        M_teacher, log D_teacher, A; a top-K teacher: fields 2-3 are the student's M and log D over the
        teacher's ids), for kd_bwd (and kd_terms_partial); None with row_stats=False. For JSD and a top-K
        teacher its A (field 4) is not valid until kd_terms_combine writes it.
    Raises InvalidArgumentError (options out of domain; row_stats=False with JSD with 0 < beta < 1 or with
    loss=False: the second exchange needs them), ShapeMismatchError (records not [W, N, KD_RECORD_FIELDS],
    targets not [N]), UnsupportedDtypeError, UnsupportedLayoutError, DeviceMismatchError."""
    c = Call(records, handle, stream)
    n = int(records.shape[1])
    loss_a = None if not loss or kd_needs_terms(divergence, beta) else _loss_buffer(c, reduction, n)
    stats = c.empty((n, KD_ROW_STATS_FIELDS), "float32") if row_stats else None
    o = _kd_options(c, divergence, beta, temperature, scale_by_t2, topk_norm, reduction, ignore_index, 0,
                    vocab_total)
    c.run("fce_kd_combine", c.dl(records), _targets_or_null(c, targets), o, c.dl(loss_a, True), c.dl(stats, True),
          workspace=workspace)
    return c.scalar_out(loss_a), stats


def kd_terms_partial(student, teacher_logits=None, row_stats=None, *, vocab_start, vocab_total, topk_ids=None,
                     topk_logprobs=None, divergence=_NAME["divergence"][_KD["divergence"]], beta=_KD["beta"],
                     temperature=_KD["temperature"], topk_norm=_NAME["topk_norm"][_KD["topk_norm"]], records=None,
                     handle=None, stream=None):
    """fce_kd_terms_partial: the second exchange (JSD, a top-K teacher), a shard's sums of the divergence's
    element terms (step 3a).

    student and the teacher (teacher_logits, or topk_ids / topk_logprobs): the shard as given to kd_partial
    (with a top-K teacher call it as kd_terms_partial(student, row_stats=stats, topk_ids=..., ...));
    row_stats: [N, KD_ROW_STATS_FIELDS] fp32 from kd_combine (fields 0-3 read: the rows' maxima and
    log-normalizers); the kd_partial call's options. Works for every divergence (for KL with teacher logits it
    gives the loss a second way).
    Returns records [N, KD_TERMS_RECORD_FIELDS] fp32 (into `records` when given): per row over the shard's
    real columns (a top-K teacher: its used slots whose ids fall in the shard), 0 sum_j L_j and 1 sum_j a_j,
    L_j and a_j the element terms of kd_loss from the whole rows' log-probabilities (for JSD with
    M = beta*p + (1-beta)*q, p the teacher and q the student at temperature T:
    L_j = beta p_j log(p_j/m_j) + (1-beta) q_j log(q_j/m_j), nats; a_j = (1-beta) q_j log(q_j/m_j)); +inf where
    a term is, NaN where a logit or a statistic is, or a top-K id is >= vocab_total; 2 the number of those
    slots (a float count; -1 with teacher logits); 3-4 the shard's column range. Gather every rank's in rank order
    ([W, N, KD_TERMS_RECORD_FIELDS]) for kd_terms_combine.
    Raises ValueError (neither or both teachers given; row_stats None), InvalidArgumentError,
    ShapeMismatchError (row_stats not [N, KD_ROW_STATS_FIELDS], records not [N, KD_TERMS_RECORD_FIELDS]),
    UnsupportedDtypeError, UnsupportedLayoutError, DeviceMismatchError."""
    if row_stats is None:
        raise ValueError("kd_terms_partial: row_stats (kd_combine's) is required")
    c = Call(student, handle, stream)
    teacher = _shard_teacher(c, teacher_logits, topk_ids, topk_logprobs, "kd_terms_partial")
    out = records if records is not None else c.empty((_rows(student), KD_TERMS_RECORD_FIELDS), "float32")
    o = _kd_options(c, divergence, beta, temperature, False, topk_norm, "mean", -100, vocab_start, vocab_total)
    c.run_plain("fce_kd_terms_partial", c.dl(student), teacher, c.dl(c.native(row_stats)), o, c.dl(out, True))
    return out


def kd_terms_combine(records, row_stats, *, vocab_total, targets=None,
                     divergence=_NAME["divergence"][_KD["divergence"]], beta=_KD["beta"],
                     temperature=_KD["temperature"], scale_by_t2=bool(_KD["scale_by_t2"]),
                     topk_norm=_NAME["topk_norm"][_KD["topk_norm"]], reduction=_NAME["reduction"][_KD["reduction"]],
                     ignore_index=_KD["ignore_index"], handle=None, stream=None, workspace=None):
    """fce_kd_terms_combine: the loss of whole rows from every shard's terms' records, and the rows' A (3c).

    records: [W, N, KD_TERMS_RECORD_FIELDS] fp32, contiguous, every rank's kd_terms_partial records in rank
    order; row_stats: kd_combine's [N, KD_ROW_STATS_FIELDS] fp32 array (writable): its field 4 (A = sum_j a_j,
    the gradient's dL/dz_j = a_j - q_j A) is written in place, the rest kept; targets and options as for
    kd_combine. The records are added in rank order in fp64: the same bits on every rank. A top-K teacher's
    rows whose slot counts (field 2) add up to 0 (no used slot) are masked like ignored targets.
    Returns (loss, row_stats): loss = sum_j L_j in nats (times T^2 with scale_by_t2), fp32 [N] ("none", 0 at
    masked rows) or a scalar ("mean": batchmean over the unmasked rows), what kd_loss of the unsharded rows
    (with the same teacher) returns within the fp32 rounding of the records' sums; row_stats the same array,
    now complete for kd_bwd.
    Raises InvalidArgumentError (options out of domain; row_stats None), ShapeMismatchError,
    UnsupportedDtypeError (row_stats not fp32), UnsupportedLayoutError, DeviceMismatchError."""
    c = Call(records, handle, stream)
    loss_a = _loss_buffer(c, reduction, int(records.shape[1]))
    o = _kd_options(c, divergence, beta, temperature, scale_by_t2, topk_norm, reduction, ignore_index, 0,
                    vocab_total)
    c.run("fce_kd_terms_combine", c.dl(records), _targets_or_null(c, targets), o, c.dl(loss_a, True),
          c.dl(row_stats, True), workspace=workspace)
    return c.scalar_out(loss_a), row_stats


def kd_fwd_vp(student, teacher_logits=None, comm=None, *, vocab_start, vocab_total, topk_ids=None,
              topk_logprobs=None, targets=None, divergence=_NAME["divergence"][_KD["divergence"]], beta=_KD["beta"],
              temperature=_KD["temperature"], scale_by_t2=bool(_KD["scale_by_t2"]),
              topk_norm=_NAME["topk_norm"][_KD["topk_norm"]], reduction=_NAME["reduction"][_KD["reduction"]],
              ignore_index=_KD["ignore_index"], dstudent=False, grad_loss=None, row_stats=False, stream=None,
              workspace=None):
    """fce_kd_fwd_vp: vocabulary-parallel KD over NCCL (a Communicator `comm`), one call per rank: kd_partial of
    this rank's shard, the records' all-gather inside the library, kd_combine, for JSD (0 < beta < 1) and a
    top-K teacher the terms' exchange, and with dstudent this shard's kd_bwd. Arguments as kd_partial and
    kd_bwd. dstudent / row_stats: True (new arrays) or an array ([N, V_local] in the student's dtype;
    [N, KD_ROW_STATS_FIELDS] fp32, the rows' final statistics for a later kd_bwd). Returns (KDOutput(loss,
    dstudent), row_stats); the loss is the same bits on every rank. Raises CommunicatorError when NCCL fails,
    and kd_partial's errors."""
    if comm is None:
        raise ValueError("kd_fwd_vp: comm (a Communicator) is required")
    c = Call(student, None, stream)
    teacher = _shard_teacher(c, teacher_logits, topk_ids, topk_logprobs, "kd_fwd_vp")
    loss_a = _loss_buffer(c, reduction, _rows(student))
    ds_a = c.output(dstudent, lambda: c.empty_like(student))
    st_a = c.output(row_stats, lambda: c.empty((_rows(student), KD_ROW_STATS_FIELDS), "float32"))
    o = _kd_options(c, divergence, beta, temperature, scale_by_t2, topk_norm, reduction, ignore_index,
                    vocab_start, vocab_total)
    outs = c.struct("fce_kd_outputs_t")
    outs.loss = c.dl(loss_a, True)
    outs.dstudent = c.dl(ds_a, True)
    outs.grad_loss = c.dl(_grad(c, grad_loss))
    args = (comm.ptr, c.dl(student), teacher, _targets_or_null(c, targets), o, outs, c.dl(st_a, True))
    ws, wsb = c.workspace("fce_kd_fwd_vp_workspace_size", args, workspace)
    check(lib.fce_kd_fwd_vp(c.handle.ptr, comm.ptr, c.stream, *args[1:], ws, wsb), "fce_kd_fwd_vp")
    return KDOutput(c.scalar_out(loss_a), ds_a), st_a


def kd_bwd(student, teacher_logits=None, row_stats=None, *, vocab_start, vocab_total, topk_ids=None,
           topk_logprobs=None, targets=None, divergence=_NAME["divergence"][_KD["divergence"]], beta=_KD["beta"],
           temperature=_KD["temperature"], scale_by_t2=bool(_KD["scale_by_t2"]),
           topk_norm=_NAME["topk_norm"][_KD["topk_norm"]], reduction=_NAME["reduction"][_KD["reduction"]],
           ignore_index=_KD["ignore_index"], grad_loss=None, dstudent=None, handle=None, stream=None,
           workspace=None):
    """fce_kd_bwd: this shard's d(loss)/d(student) * grad_loss (step 4).

    student and the teacher (teacher_logits, or topk_ids / topk_logprobs): as given to kd_partial (with a
    top-K teacher call it as kd_bwd(student, row_stats=stats, topk_ids=..., ...)). row_stats:
    [N, KD_ROW_STATS_FIELDS] fp32 from kd_combine, or for JSD with 0 < beta < 1 and a top-K teacher after
    kd_terms_combine has written its A (with A not yet written the gradient is wrong: NaN for JSD); the same
    options and targets as the combine. grad_loss: optional fp32 upstream gradient, a scalar, or [N] with
    reduction "none".
    Returns dstudent [N, V_local] in the student's dtype (fp32, rounded once; 0 at masked rows (a top-K
    teacher's rows without a used slot too) and padding columns), into `dstudent` when given (may be
    `student`, in place). Raises ValueError (neither or both teachers given; row_stats None),
    InvalidArgumentError, ShapeMismatchError, UnsupportedDtypeError, UnsupportedLayoutError,
    DeviceMismatchError, BackendNotImplementedError (CUDA: a top-K teacher of K > 8192)."""
    if row_stats is None:
        raise ValueError("kd_bwd: row_stats (kd_combine's) is required")
    c = Call(student, handle, stream)
    teacher = _shard_teacher(c, teacher_logits, topk_ids, topk_logprobs, "kd_bwd")
    ds_a = dstudent if dstudent is not None else c.empty_like(student)
    o = _kd_options(c, divergence, beta, temperature, scale_by_t2, topk_norm, reduction, ignore_index,
                    vocab_start, vocab_total)
    c.run("fce_kd_bwd", c.dl(student), teacher, _targets_or_null(c, targets), c.dl(c.native(row_stats)), o,
          c.dl(_grad(c, grad_loss)), c.dl(ds_a, True), workspace=workspace)
    return ds_a


# ---- linear cross-entropy -------------------------------------------------------------------------

def linear_cross_entropy_fwd(hidden, weight, targets, *, bias=None,
                             reduction=_NAME["reduction"][_CE["reduction"]], ignore_index=_CE["ignore_index"],
                             label_smoothing=_CE["label_smoothing"], z_loss_scale=_CE["z_loss_scale"],
                             softcap=_CE["softcap"], logit_scale=_CE["logit_scale"], class_weights=None,
                             lse=True, z_loss=False, argmax=False, entropy=False, dhidden=False, dweight=False,
                             dbias=False, grad_loss=None, grad_entropy=None, argmax_dtype="int64", accumulate=False,
                             handle=None, stream=None, workspace=None):
    """fce_linear_cross_entropy_fwd: cross-entropy of hidden [N, H] @ weight[V, H]^T (+ bias [V]) without
    materializing the logits; gradients asked for are computed in the same call. accumulate=True adds them
    into the arrays given as dhidden/dweight/dbias (FCE_LINEAR_CE_ACCUMULATE: gradient accumulation, e.g. an
    fp32 main_grad) instead of overwriting them.
    grad_entropy (a number or [N] fp32; with a gradient asked for) adds the entropy's gradient, as
    cross_entropy_fwd's. lse as cross_entropy_fwd's: True ([N] fp32), "pair" (the pairs [N, 2] fp32, the form
    to save for linear_cross_entropy_bwd) or an array of either shape.
    Returns LinearCrossEntropyOutput(loss, lse, z_loss, argmax, entropy, dhidden, dweight, dbias)."""
    c = Call(hidden, handle, stream)
    targets = c.native(targets)
    opts = _ce_options(c, reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, class_weights)
    outs, result = _lce_outputs(c, hidden, weight, bias, reduction, lse, z_loss, argmax, entropy, dhidden, dweight,
                                dbias, grad_loss, grad_entropy, argmax_dtype, accumulate)
    c.run("fce_linear_cross_entropy_fwd", c.dl(hidden), c.dl(c.native(weight)),
          c.dl(None if bias is None else c.native(bias)), c.dl(targets), opts, outs, workspace=workspace)
    return result()


def _lce_outputs(c, hidden, weight, bias, reduction, lse, z_loss, argmax, entropy, dhidden, dweight, dbias, grad_loss,
                 grad_entropy, argmax_dtype, accumulate):
    """The fce_linear_ce_outputs_t of a forward (outputs allocated or taken as given), and a function that returns
    the LinearCrossEntropyOutput once the call has run."""
    _accumulating(accumulate, dhidden, dweight, dbias)
    n = _rows(hidden)
    loss_a = _loss_buffer(c, reduction, n)
    lse_a = _lse_output(c, lse, n)
    zl_a = c.output(z_loss, lambda: _loss_buffer(c, reduction, n))
    am_a = c.output(argmax, lambda: c.empty((n,), argmax_dtype))
    ent_a = c.output(entropy, lambda: c.empty((n,), "float32"))
    dh_a = c.output(dhidden, lambda: c.empty_like(hidden))
    dw_a = c.output(dweight, lambda: c.empty_like(weight))
    db_a = c.output(dbias, lambda: c.empty_like(bias) if bias is not None else _no_bias())
    outs = c.struct("fce_linear_ce_outputs_t")
    outs.loss = c.dl(loss_a, True)
    outs.lse = c.dl(lse_a, True)
    outs.z_loss = c.dl(zl_a, True)
    outs.argmax = c.dl(am_a, True)
    outs.entropy = c.dl(ent_a, True)
    outs.dhidden = c.dl(dh_a, True)
    outs.dweight = c.dl(dw_a, True)
    outs.dbias = c.dl(db_a, True)
    outs.grad_loss = c.dl(_grad(c, grad_loss))
    outs.grad_entropy = c.dl(_grad(c, grad_entropy))
    outs.flags = _ACCUMULATE if accumulate else 0
    return outs, lambda: LinearCrossEntropyOutput(c.scalar_out(loss_a), lse_a, c.scalar_out(zl_a), am_a, ent_a, dh_a,
                                                  dw_a, db_a)


def linear_cross_entropy(hidden, weight, targets, **kw):
    """The loss alone (keywords as linear_cross_entropy_fwd)."""
    return linear_cross_entropy_fwd(hidden, weight, targets, lse=False, **kw).loss


def linear_cross_entropy_bwd(hidden, weight, targets, lse, *, bias=None, dhidden=True, dweight=True, dbias=None,
                             grad_loss=None, grad_entropy=None, entropy=None,
                             reduction=_NAME["reduction"][_CE["reduction"]],
                             ignore_index=_CE["ignore_index"], label_smoothing=_CE["label_smoothing"],
                             z_loss_scale=_CE["z_loss_scale"], softcap=_CE["softcap"],
                             logit_scale=_CE["logit_scale"], class_weights=None, accumulate=False,
                             vocab_start=0, vocab_total=0, handle=None, stream=None, workspace=None):
    """fce_linear_cross_entropy_bwd: the gradients asked for (dbias defaults to "if there is a bias"),
    recomputing the logits chunk by chunk from the forward's lse ([N] fp32, or its pairs [N, 2] fp32
    contiguous, as cross_entropy_bwd takes them: from the pairs the gradient holds at any offset of the
    logits); accumulate=True adds them into the arrays
    given (as linear_cross_entropy_fwd). grad_entropy (a number or [N] fp32) with `entropy` (the forward's
    entropy output, [N] fp32) adds the entropy's gradient. With vocab_total (a shard, as
    linear_cross_entropy_partial), weight and bias are the shard's rows, lse the combined one (its pairs,
    cross_entropy_combine(lse="pair")), dweight / dbias
    the shard's, and dhidden fp32 (allocated so for True): this shard's part, to be summed over the ranks in
    fp32. Returns LinearCrossEntropyGrads."""
    _accumulating(accumulate, dhidden, dweight, dbias)
    c = Call(hidden, handle, stream)
    targets = c.native(targets)
    if dbias is None:
        dbias = bias is not None
    dh_a = c.output(dhidden, lambda: c.empty((_rows(hidden), hidden.shape[1]), "float32") if vocab_total
                    else c.empty_like(hidden))
    dw_a = c.output(dweight, lambda: c.empty_like(weight))
    db_a = c.output(dbias, lambda: c.empty_like(bias) if bias is not None else _no_bias())
    opts = _ce_options(c, reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, class_weights,
                       vocab_start, vocab_total)
    outs = c.struct("fce_linear_ce_outputs_t")
    outs.dhidden = c.dl(dh_a, True)
    outs.dweight = c.dl(dw_a, True)
    outs.dbias = c.dl(db_a, True)
    outs.grad_loss = c.dl(_grad(c, grad_loss))
    outs.grad_entropy = c.dl(_grad(c, grad_entropy))
    outs.saved_entropy = c.dl(None if entropy is None else c.native(entropy))
    outs.flags = _ACCUMULATE if accumulate else 0
    c.run("fce_linear_cross_entropy_bwd", c.dl(hidden), c.dl(c.native(weight)),
          c.dl(None if bias is None else c.native(bias)), c.dl(targets), c.dl(c.native(lse)), opts, outs,
          workspace=workspace)
    return LinearCrossEntropyGrads(dh_a, dw_a, db_a)


def linear_cross_entropy_partial(hidden, weight, targets, *, vocab_start, vocab_total, bias=None,
                                 reduction=_NAME["reduction"][_CE["reduction"]], ignore_index=_CE["ignore_index"],
                                 label_smoothing=_CE["label_smoothing"], z_loss_scale=_CE["z_loss_scale"],
                                 softcap=_CE["softcap"], logit_scale=_CE["logit_scale"], class_weights=None,
                                 fields=RECORD_FIELDS_ALL, records=None, handle=None, stream=None, workspace=None):
    """fce_linear_cross_entropy_partial: the [N, K] fp32 cross-entropy records of a vocabulary shard's logits
    hidden [N, H] @ weight[V_local, H]^T (+ bias [V_local]), where weight holds the LM head's rows [vocab_start,
    vocab_start + V_local) of a vocabulary of vocab_total (rows past it are padding, never read). Gather every
    rank's records in rank order ([W, N, K]) for cross_entropy_combine, then linear_cross_entropy_bwd with
    the shard and the combined lse. fields / records as cross_entropy_partial."""
    c = Call(hidden, handle, stream)
    targets = c.native(targets)
    out = records if records is not None else c.empty((_rows(hidden), int(fields)), "float32")
    opts = _ce_options(c, reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, class_weights,
                       vocab_start, vocab_total)
    c.run("fce_linear_cross_entropy_partial", c.dl(hidden), c.dl(c.native(weight)),
          c.dl(None if bias is None else c.native(bias)), c.dl(targets), opts, c.dl(out, True), workspace=workspace)
    return out


def linear_cross_entropy_fwd_vp(hidden, weight, targets, comm, *, vocab_start, vocab_total, bias=None,
                                reduction=_NAME["reduction"][_CE["reduction"]], ignore_index=_CE["ignore_index"],
                                label_smoothing=_CE["label_smoothing"], z_loss_scale=_CE["z_loss_scale"],
                                softcap=_CE["softcap"], logit_scale=_CE["logit_scale"], class_weights=None,
                                lse=True, z_loss=False, argmax=False, entropy=False, dhidden=False, dweight=False,
                                dbias=False, grad_loss=None, grad_entropy=None, argmax_dtype="int64",
                                accumulate=False, stream=None, workspace=None):
    """fce_linear_cross_entropy_fwd_vp: vocabulary-parallel linear cross-entropy over NCCL (a Communicator),
    one call per rank: hidden [N, H] and targets [N] (global indices) the same on every rank, weight [V_local, H]
    (and bias [V_local]) this rank's rows [vocab_start, vocab_start + V_local). Each token chunk's records
    cross the ranks inside the call; dhidden (True or an array, any float dtype) is the sum over every rank,
    dweight / dbias this shard's. Returns LinearCrossEntropyOutput of the whole rows, the same bits on every
    rank (lse as linear_cross_entropy_fwd's: [N], or "pair" for the pairs [N, 2]). Raises CommunicatorError
    when NCCL fails."""
    c = Call(hidden, None, stream)
    targets = c.native(targets)
    opts = _ce_options(c, reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, class_weights,
                       vocab_start, vocab_total)
    outs, result = _lce_outputs(c, hidden, weight, bias, reduction, lse, z_loss, argmax, entropy, dhidden, dweight,
                                dbias, grad_loss, grad_entropy, argmax_dtype, accumulate)
    args = (comm.ptr, c.dl(hidden), c.dl(c.native(weight)), c.dl(None if bias is None else c.native(bias)),
            c.dl(targets), opts, outs)
    ws, wsb = c.workspace("fce_linear_cross_entropy_fwd_vp_workspace_size", args, workspace)
    check(lib.fce_linear_cross_entropy_fwd_vp(c.handle.ptr, comm.ptr, c.stream, *args[1:], ws, wsb),
          "fce_linear_cross_entropy_fwd_vp")
    return result()


_ACCUMULATE = MACROS["FCE_LINEAR_CE_ACCUMULATE"]


def _accumulating(accumulate, *grads):
    """accumulate=True adds into arrays the caller gives: a gradient asked for with True would be allocated
    here, uninitialized, and adding into it is never meant."""
    if accumulate and any(g is True for g in grads):
        raise ValueError("accumulate=True adds into the arrays given as dhidden/dweight/dbias; pass arrays, "
                         "not True")


def _no_bias():
    raise ValueError("dbias needs a bias")


# ---- upstream gradients after the fact ------------------------------------------------------------

def scale_rows(x, factor, *, handle=None, stream=None):
    """fce_scale_rows: x[i, :] *= factor[i] in place (factor a number, a scalar array or [N] fp32, read on the
    device); rows whose factor is exactly 1 are neither read nor written. x: [N, V] or [V] (one row). For an
    upstream gradient known only after a fused forward. Returns x."""
    c = Call(x, handle, stream)
    rows = x if len(x.shape) == 2 else x.reshape(1, -1)
    c.run_plain("fce_scale_rows", c.dl(rows, True), c.dl(_grad(c, factor)))
    return x
