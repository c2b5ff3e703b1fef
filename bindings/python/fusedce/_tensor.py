"""Arrays and tensors as borrowed DLTensors: numpy arrays (CPU) directly, PyTorch tensors through the
DLPack protocol (`__dlpack__`, with the current CUDA stream). torch is never imported here: a tensor is
recognized by its type's module, so the package works without torch installed."""
import ctypes

import numpy as np

from ._lib import DEVICE_CPU, DEVICE_CUDA, default_handle, ffi, lib

_PyCapsule_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
_PyCapsule_GetPointer.restype = ctypes.c_void_p
_PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def is_torch(x):
    return type(x).__module__.startswith("torch") and hasattr(x, "__dlpack__") and hasattr(x, "data_ptr")


def _np_dldtype(dt):
    if dt.name == "bfloat16":  # ml_dtypes.bfloat16
        return lib.kDLBfloat, 16
    code = {"f": lib.kDLFloat, "i": lib.kDLInt, "u": lib.kDLUInt, "b": lib.kDLUInt, "c": lib.kDLComplex}.get(dt.kind)
    if code is None:
        raise TypeError("fusedce: numpy arrays of dtype %s cannot be passed to libfusedce" % dt)
    return code, dt.itemsize * 8


class Call:
    """What one library call needs: the framework, device, handle and stream taken from its first tensor,
    DLTensors for its arguments, and the Python objects they point into (kept alive until the call
    object is dropped)."""

    def __init__(self, ref, handle=None, stream=None):
        self.keep = []
        if is_torch(ref):
            import torch

            self.torch = torch
            self.kind = "torch"
            self.device = ref.device
            if ref.device.type == "cuda":
                self.device_type, self.device_id = DEVICE_CUDA, ref.device.index or 0
                if stream is None:
                    s = torch.cuda.current_stream(ref.device).cuda_stream
                elif isinstance(stream, int):
                    s = stream
                else:
                    s = stream.cuda_stream
                self.stream_int = int(s)
                self.stream = ffi.cast("fce_stream_t", self.stream_int)
            elif ref.device.type == "cpu":
                self.device_type, self.device_id = DEVICE_CPU, 0
                self.stream = ffi.NULL
            else:
                raise ValueError("fusedce: tensors on %s are not supported (cpu or cuda)" % ref.device)
        else:
            self.kind = "numpy"
            self.torch = None
            self.device_type, self.device_id = DEVICE_CPU, 0
            self.stream = ffi.NULL
        self.handle = handle if handle is not None else default_handle(self.device_type, self.device_id)

    # ---- conversions -------------------------------------------------------------------------------
    def native(self, x, dtype=None):
        """x as this call's framework's array (lists, numpy or scalars converted), optionally cast."""
        if self.kind == "numpy":
            if is_torch(x):
                x = x.detach().cpu().numpy()
            a = np.asarray(x)
            return a.astype(dtype) if dtype is not None and a.dtype != np.dtype(dtype) else a
        t = self.torch
        if not is_torch(x):
            x = t.as_tensor(np.asarray(x), device=self.device)
        if dtype is not None:
            td = getattr(t, dtype)
            if x.dtype != td:
                x = x.to(td)
        return x

    def dl(self, x, writable=False):
        """A `DLTensor*` for x (NULL for None)."""
        if x is None:
            return ffi.NULL
        if self.kind == "numpy" or isinstance(x, np.ndarray):
            return self._numpy_dl(np.asarray(x) if not isinstance(x, np.ndarray) else x, writable)
        if not is_torch(x):
            x = self.native(x)
        return self._torch_dl(x)

    def _numpy_dl(self, a, writable):
        if writable and not a.flags.writeable:
            raise ValueError("fusedce: an output array is read-only")
        code, bits = _np_dldtype(a.dtype)
        item = a.itemsize
        strides = []
        for s in a.strides:
            if s % item:
                raise ValueError("fusedce: array strides %s are not multiples of the item size" % (a.strides,))
            strides.append(s // item)
        shape_c = ffi.new("int64_t[]", list(a.shape) or [1])
        strides_c = ffi.new("int64_t[]", strides or [1])
        t = ffi.new("DLTensor*")
        t.data = ffi.cast("void*", a.__array_interface__["data"][0])
        t.device.device_type = lib.kDLCPU
        t.device.device_id = 0
        t.ndim = a.ndim
        t.dtype.code = code
        t.dtype.bits = bits
        t.dtype.lanes = 1
        t.shape = shape_c
        t.strides = strides_c
        t.byte_offset = 0
        self.keep += [a, shape_c, strides_c, t]
        return t

    def _torch_dl(self, x):
        if x.requires_grad:
            x = x.detach()
        kw = {}
        if x.device.type == "cuda":
            # The consumer's stream: the producer orders pending work on it before export (a no-op when
            # it is the current stream, as here). 0 is ambiguous in the protocol; 1 is the legacy default.
            kw["stream"] = self.stream_int if self.stream_int != 0 else 1
        cap = x.__dlpack__(**kw)
        ptr = _PyCapsule_GetPointer(cap, b"dltensor")
        mt = ffi.cast("DLManagedTensor*", ptr)
        # The capsule keeps the DLManagedTensor alive; its destructor calls the deleter (we never consume it).
        self.keep += [x, cap]
        return ffi.addressof(mt[0], "dl_tensor")

    # ---- allocation --------------------------------------------------------------------------------
    def empty(self, shape, dtype):
        if self.kind == "numpy":
            return np.empty(shape, dtype=dtype)
        return self.torch.empty(shape, dtype=getattr(self.torch, dtype), device=self.device)

    def empty_like(self, x, dtype=None):
        if self.kind == "numpy":
            return np.empty(np.shape(x), dtype=dtype if dtype is not None else np.asarray(x).dtype)
        t = self.torch
        return t.empty(tuple(x.shape), dtype=getattr(t, dtype) if dtype is not None else x.dtype,
                       device=self.device)

    def full(self, shape, value, dtype="float32"):
        a = self.empty(shape, dtype)
        if self.kind == "numpy":
            a[...] = value
        else:
            a.fill_(value)
        return a

    def output(self, spec, make):
        """An output argument: False/None = not requested, True = make(), an array = write into it."""
        if spec is None or spec is False:
            return None
        if spec is True:
            return make()
        return spec

    def scalar_out(self, a):
        """0-d results: a numpy scalar for numpy calls, a 0-d tensor for torch calls."""
        if a is None:
            return None
        if self.kind == "numpy" and getattr(a, "ndim", 1) == 0:
            return a[()]
        return a


__all__ = ["Call", "is_torch"]
