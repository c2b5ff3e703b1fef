"""The lean call path for torch tensors: what `fusedce.torch` and the array API run for torch inputs.

Where libfusedce_torch.so is loaded (`_eager`), cross_entropy_fwd without a fused gradient, logsumexp and
temp_softmax call its ops (C++: no DLTensor or struct written from Python); `_EAGER = False` turns that off
(the benchmark's cffi column). Otherwise, and for the other calls:

One call costs: this thread's (device, stream) entry (handle and stream pointer, cached), DLTensors filled
straight from the tensors' metadata into this thread's preallocated slots, this thread's options/outputs
structs with every field set, output tensors from torch's caching allocator, and the C call. Workspaces:
the handle's cached one (one handle per device and stream, so no two streams share it), or, while the
stream is being captured into a CUDA graph, one from torch's allocator sized by the op's query.

Lifetimes: a slot borrows its tensor's memory and holds no reference to it. Every tensor these functions
put in a slot is a parameter or a local variable of the function that makes the library call, so that
function's frame holds it until the call has returned; a tensor made for an argument (a cast, a copy, a
number as a 0-d tensor) is made by the caller and passed in, never made inside a `_dl(...)` / `_at(...)`
argument (tests/test_lifetimes.py checks this module for it). Everything runs on torch's current stream,
where the temporaries are allocated too.
"""
import struct

import torch

from . import _eager
from ._lib import DEVICE_CPU, DEVICE_CUDA, check, default_handle, ffi, lib
from ._tensor import _state, _struct, _torch_tables

_NULL = ffi.NULL
_memmove = ffi._backend.memmove  # ffi.memmove without its Python wrapper
_CODE = {}  # torch dtype -> (DLPack code, bits)
_raw_stream = torch._C._cuda_getCurrentRawStream if torch.cuda.is_available() else None
_capturing = torch.cuda.is_current_stream_capturing
_EAGER = _eager.available
# The array API's shortest path (ops.cross_entropy_fwd) takes these when _EAGER is set.
eager_cross_entropy = _eager.cross_entropy if _EAGER else None
eager_cross_entropy_loss = _eager.cross_entropy_loss if _EAGER else None
reraise = _eager.reraise
PAIR = "pair"  # want_lse for the lse's pairs [N, 2] (fusedce.ops.LSE_PAIR)


def _tables():
    if not _CODE:
        _torch_tables()
        from ._tensor import _TORCH
        _CODE.update(_TORCH)


def _device(x):
    """(handle pointer, stream pointer, DLPack device type, device id) for x's device and the current stream."""
    st = _state
    if x.is_cuda:
        idx = x.get_device()
        s = _raw_stream(idx)
        key = (idx, s)
        entry = st.devices.get(key)
        if entry is None:
            entry = st.devices[key] = (default_handle(DEVICE_CUDA, idx, s).ptr, ffi.cast("fce_stream_t", s),
                                       DEVICE_CUDA, idx)
        return entry
    entry = st.devices.get("cpu")
    if entry is None:
        entry = st.devices["cpu"] = (default_handle(DEVICE_CPU, 0).ptr, _NULL, DEVICE_CPU, 0)
    return entry


_SLOT = struct.Struct("<QiiiBBHQQQqqqq")  # a DLTensor (48 bytes) followed by shape[2] and strides[2]


def _dl(k, x, dev_type, dev_id):
    """Slot k of this thread as a DLTensor describing x (None gives NULL): one packed write."""
    if x is None:
        return _NULL
    st = _state
    try:
        code, bits = _CODE[x.dtype]
    except KeyError:
        raise TypeError("fusedce: torch tensors of dtype %s cannot be passed to libfusedce" % x.dtype) from None
    shape = x.shape
    n = len(shape)
    if n == 2:
        s0, s1 = shape
        t0, t1 = x.stride()
    elif n == 1:
        s0, s1, t0, t1 = shape[0], 0, x.stride()[0], 0
    elif n == 0:
        s0 = s1 = t0 = t1 = 0
    else:
        raise ValueError("fusedce: a tensor of %d dimensions where the library takes at most 2" % n)
    if x.is_cuda != (dev_type == DEVICE_CUDA):  # a tensor on another device: the library says so
        dev_type = DEVICE_CUDA if x.is_cuda else DEVICE_CPU
    _memmove(st.raw[k], _SLOT.pack(x.data_ptr(), dev_type, dev_id, n, code, bits, 1, st.shape_at[k],
                                   st.stride_at[k], 0, s0, s1, t0, t1), 80)
    return st.ptr[k]


def _at(k, x, dev_type, dev_id):
    """_dl as an address (0 for None), for a pointer field of a packed struct."""
    if x is None:
        return 0
    _dl(k, x, dev_type, dev_id)
    return _state.addr[k]


class _Packed:
    """A library struct written in one packed copy (every field after struct_size, in declaration order;
    pointer fields as addresses): this thread's instance, the C call's argument."""

    _FMT = {"uint32_t": "I", "int32_t": "i", "int64_t": "q", "float": "f"}

    def __init__(self, ctype):
        self.ctype = ctype
        self.size = ffi.sizeof(ctype)
        fmt, at = "<I", 4
        for name, f in ffi.typeof(ctype).fields[1:]:
            fmt += "x" * (f.offset - at) + ("Q" if f.type.kind == "pointer" else self._FMT[f.type.cname])
            at = f.offset + ffi.sizeof(f.type)
        fmt += "x" * (self.size - at)
        self.pack = struct.Struct(fmt).pack
        assert struct.calcsize(fmt) == self.size, ctype

    def __call__(self, *fields):
        p = _struct(None, self.ctype, False)
        _memmove(p, self.pack(self.size, *fields), self.size)
        return p


_CE_OPTIONS = _Packed("fce_ce_options_t")
_CE_OUTPUTS = _Packed("fce_ce_outputs_t")
_CE_BWD_INPUTS = _Packed("fce_ce_bwd_inputs_t")
_LSE_OPTIONS = _Packed("fce_lse_options_t")
_SOFTMAX_OPTIONS = _Packed("fce_softmax_options_t")
_KD_OPTIONS = _Packed("fce_kd_options_t")
_KD_TEACHER = _Packed("fce_kd_teacher_t")
_KD_OUTPUTS = _Packed("fce_kd_outputs_t")


def _run(name, dev, args, x):
    """lib.<name>(handle, stream, *args, workspace, bytes): the handle's cached workspace, or one from torch's
    allocator while capturing a CUDA graph (the cache cannot grow inside a capture)."""
    ws, wsb, buf = _NULL, 0, None
    if dev[2] == DEVICE_CUDA and _capturing():
        need = ffi.new("size_t *")
        check(getattr(lib, name + "_workspace_size")(dev[0], *args, need), name + "_workspace_size")
        if need[0]:
            buf = torch.empty(int(need[0]), dtype=torch.uint8, device=x.device)
            ws, wsb = ffi.cast("void *", buf.data_ptr()), int(need[0])
    check(getattr(lib, name)(dev[0], dev[1], *args, ws, wsb), name)


def _ce_options(weight, reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, dev):
    return _CE_OPTIONS(reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale,
                       _at(2, weight, dev[2], dev[3]), 0, 0)  # not a vocabulary shard


def cross_entropy_fwd(logits, targets, weight, reduction, ignore_index, label_smoothing, z_loss_scale, softcap,
                      logit_scale, want_lse, want_z_loss, want_argmax, want_entropy, dlogits=None, grad_loss=None,
                      grad_entropy=None):
    """fce_cross_entropy_fwd: (loss, lse, z_loss, argmax, entropy), None where not asked for. want_lse: False,
    True (lse [N] fp32) or "pair" (its pairs [N, 2] fp32, (max z, log sum exp(z - max)): the form a backward
    should be given)."""
    if (_EAGER and dlogits is None and grad_loss is None and want_lse.__class__ is bool
            and type(logits) is torch.Tensor
            and not (logits.requires_grad and torch.is_grad_enabled())):
        try:
            return _eager.cross_entropy(logits, targets, weight, reduction, ignore_index, label_smoothing, z_loss_scale,
                                        softcap, logit_scale, want_lse, want_z_loss, want_argmax, want_entropy, False)
        except RuntimeError as e:
            _eager.reraise(e)
    _tables()
    dev = _device(logits)
    dt, di = dev[2], dev[3]
    n = logits.shape[0]
    loss_shape = (n,) if reduction == 0 else ()
    empty = torch.empty
    f32 = torch.float32
    loss = empty(loss_shape, dtype=f32, device=logits.device)
    lse = (empty((n, 2) if want_lse == PAIR else (n,), dtype=f32, device=logits.device)
           if want_lse else None)
    zl = empty(loss_shape, dtype=f32, device=logits.device) if want_z_loss else None
    am = empty((n,), dtype=torch.int64, device=logits.device) if want_argmax else None
    ent = empty((n,), dtype=f32, device=logits.device) if want_entropy else None
    o = _ce_options(weight, reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, dev)
    out = _CE_OUTPUTS(_at(3, loss, dt, di), _at(4, lse, dt, di), _at(5, zl, dt, di), _at(6, am, dt, di),
                      _at(7, ent, dt, di), _at(8, dlogits, dt, di), _at(9, grad_loss, dt, di),
                      _at(10, grad_entropy, dt, di))
    _run("fce_cross_entropy_fwd", dev, (_dl(0, logits, dt, di), _dl(1, targets, dt, di), o, out), logits)
    return loss, lse, zl, am, ent


def cross_entropy_bwd(logits, targets, lse, grad_loss, weight, reduction, ignore_index, label_smoothing,
                      z_loss_scale, softcap, logit_scale, dlogits=None):
    """fce_cross_entropy_bwd: dlogits (a new tensor unless given); lse [N] fp32 or its pairs [N, 2]."""
    _tables()
    dev = _device(logits)
    dt, di = dev[2], dev[3]
    d = dlogits if dlogits is not None else torch.empty_like(logits)
    o = _ce_options(weight, reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, dev)
    _run("fce_cross_entropy_bwd", dev, (_dl(0, logits, dt, di), _dl(1, targets, dt, di), _dl(3, lse, dt, di),
                                        _dl(4, grad_loss, dt, di), o, _dl(5, d, dt, di)), logits)
    return d


def cross_entropy_bwd_ex(logits, targets, lse, entropy, grad_loss, grad_entropy, weight, reduction, ignore_index,
                         label_smoothing, z_loss_scale, softcap, logit_scale, dlogits=None):
    """fce_cross_entropy_bwd_ex: dlogits from the saved lse ([N] fp32 or its pairs [N, 2]) and entropy with both
    upstream gradients (None: grad_loss 1, no entropy term)."""
    _tables()
    dev = _device(logits)
    dt, di = dev[2], dev[3]
    d = dlogits if dlogits is not None else torch.empty_like(logits)
    o = _ce_options(weight, reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, dev)
    inputs = _CE_BWD_INPUTS(_at(3, lse, dt, di), _at(4, grad_loss, dt, di), _at(5, entropy, dt, di),
                            _at(6, grad_entropy, dt, di))
    _run("fce_cross_entropy_bwd_ex", dev, (_dl(0, logits, dt, di), _dl(1, targets, dt, di), inputs, o,
                                           _dl(7, d, dt, di)), logits)
    return d


def logsumexp(x, scale, out=None):
    """fce_logsumexp: [N] fp32."""
    if _EAGER and type(x) is torch.Tensor:
        try:
            if out is None:
                return _eager.logsumexp(x, scale)
            _eager.logsumexp_out(x, scale, out)
            return out
        except RuntimeError as e:
            _eager.reraise(e)
    _tables()
    dev = _device(x)
    dt, di = dev[2], dev[3]
    if out is None:
        out = torch.empty((x.shape[0],), dtype=torch.float32, device=x.device)
    o = _LSE_OPTIONS(scale, 0, 0)  # no vocabulary shard
    _run("fce_logsumexp", dev, (_dl(0, x, dt, di), o, _dl(1, out, dt, di)), x)
    return out


def temp_softmax(logits, temperature, temperatures, want_probs, want_logprobs, out_dtype, probs=None,
                 logprobs=None):
    """fce_temp_softmax: (probs, logprobs), None where not asked for; out_dtype a torch dtype (None: the
    logits')."""
    odt = out_dtype if out_dtype is not None else logits.dtype
    if _EAGER and type(logits) is torch.Tensor and odt in (torch.float32, logits.dtype):
        try:
            if probs is None and logprobs is None:
                return _eager.temp_softmax(logits, temperature, temperatures, want_probs, want_logprobs,
                                           odt is torch.float32)
            if want_probs and probs is None:
                probs = torch.empty(logits.shape, dtype=odt, device=logits.device)
            if want_logprobs and logprobs is None:
                logprobs = torch.empty(logits.shape, dtype=odt, device=logits.device)
            p, lp = (probs if want_probs else None), (logprobs if want_logprobs else None)
            _eager.temp_softmax_out(logits, temperature, temperatures, p, lp)
            return p, lp
        except RuntimeError as e:
            _eager.reraise(e)
    _tables()
    dev = _device(logits)
    dt, di = dev[2], dev[3]
    if want_probs and probs is None:
        probs = torch.empty(logits.shape, dtype=odt, device=logits.device)
    if want_logprobs and logprobs is None:
        logprobs = torch.empty(logits.shape, dtype=odt, device=logits.device)
    o = _SOFTMAX_OPTIONS(temperature, _at(1, temperatures, dt, di), 0, 0, 0)  # no vocabulary shard
    _run("fce_temp_softmax", dev, (_dl(0, logits, dt, di), o, _dl(2, probs if want_probs else None, dt, di),
                                   _dl(3, logprobs if want_logprobs else None, dt, di)), logits)
    return (probs if want_probs else None), (logprobs if want_logprobs else None)


def kd_loss(student, teacher_logits, topk_ids, topk_logprobs, targets, divergence, beta, temperature, scale_by_t2,
            topk_norm, reduction, ignore_index, want_grad):
    """fce_kd_loss: (loss, dstudent or None)."""
    _tables()
    dev = _device(student)
    dt, di = dev[2], dev[3]
    n = student.shape[0]
    loss = torch.empty((n,) if reduction == 0 else (), dtype=torch.float32, device=student.device)
    ds = torch.empty_like(student) if want_grad else None
    teacher = _KD_TEACHER(_at(1, teacher_logits, dt, di), _at(2, topk_ids, dt, di), _at(3, topk_logprobs, dt, di))
    o = _KD_OPTIONS(divergence, beta, temperature, 1 if scale_by_t2 else 0, topk_norm, reduction, ignore_index, 0, 0)
    out = _KD_OUTPUTS(_at(5, loss, dt, di), _at(6, ds, dt, di), 0)
    _run("fce_kd_loss", dev, (_dl(0, student, dt, di), teacher, _dl(4, targets, dt, di), o, out), student)
    return loss, ds


def scale_rows(x, factor):
    """fce_scale_rows in place on x ([N, V], or [V] as one row); factor an fp32 scalar or [N] tensor."""
    _tables()
    dev = _device(x)
    dt, di = dev[2], dev[3]
    rows = x if x.dim() == 2 else x.reshape(1, -1)
    check(lib.fce_scale_rows(dev[0], dev[1], _dl(0, rows, dt, di), _dl(1, factor, dt, di)), "fce_scale_rows")
    return x


__all__ = ["cross_entropy_bwd", "cross_entropy_bwd_ex", "cross_entropy_fwd", "kd_loss", "logsumexp", "scale_rows", "temp_softmax"]
