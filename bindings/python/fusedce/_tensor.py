"""Arrays and tensors as borrowed DLTensors, and one library call's context (`Call`).

Three kinds of arguments:
  - PyTorch tensors: the fast path. Their DLTensors are filled straight from the tensor's metadata into
    this thread's preallocated slots (no DLPack capsule), options/outputs structs are reused per thread
    (reset to the library's defaults), the stream is torch's current one, and each (device, stream) has its
    own library handle, so that the handle's cached workspace is never shared by two streams. Outputs come
    from torch's caching allocator. Host cost: a few microseconds per call above the library's own.
  - numpy arrays (CPU): described directly.
  - any other DLPack producer (CuPy, JAX, ...): through `__dlpack__` / `__dlpack_device__`; outputs are
    allocated with numpy for CPU inputs, with CuPy or torch (whichever is importable) for CUDA inputs.
torch is never imported here unless a torch tensor is passed: a tensor is recognized by its type's module.

Lifetimes: a DLTensor borrows its object's memory, so every object whose pointer a Call puts in a DLTensor
(its arguments, and the temporaries made for them: numbers as 0-d arrays, casts, conversions from other
array types, outputs, workspaces) is appended to the Call's `keep` list by the method that builds the
DLTensor (`dl`, `workspace`). An op holds its Call in a local variable until the library call has returned,
so nothing it passed can be freed before the library has read it, whatever the caller still holds. On CUDA,
a call given a `stream` other than torch's current one also records that stream on every tensor it
describes (Tensor.record_stream: the caching allocator then reuses the memory only after the stream's work
so far), and makes its temporaries (conversions, filled scalars) on that stream; the DLPack path allocates
and fills its arrays on the call's stream.
"""
import contextlib
import ctypes
import threading

import numpy as np

from ._lib import DEVICE_CPU, DEVICE_CUDA, check, default_handle, ffi, lib, new_struct

_NO_CONTEXT = contextlib.nullcontext()
_PyCapsule_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
_PyCapsule_GetPointer.restype = ctypes.c_void_p
_PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

# A DLTensor with an integer data pointer (same layout, checked below), so that a slot is filled by plain
# integer assignments.
ffi.cdef("""
typedef struct {
  uintptr_t data;
  int32_t device_type;
  int32_t device_id;
  int32_t ndim;
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
} fce_py_dltensor;
""")
for _f in ("data", "ndim", "shape", "strides", "byte_offset"):
    assert ffi.offsetof("fce_py_dltensor", _f) == ffi.offsetof("DLTensor", _f), _f
assert ffi.sizeof("fce_py_dltensor") == ffi.sizeof("DLTensor")

_SLOTS = 16  # DLTensors in one call (linear cross-entropy takes 14)
_DIMS = 2    # the slots' tensors have at most 2 dimensions (3-D records go through DLPack capsules)


class _ThreadState(threading.local):
    """Per thread: the DLTensor slots, the reusable structs, the CUDA stream pointers seen."""

    def __init__(self):
        # Slot k: a DLTensor followed by its shape[2] and strides[2] (fusedce._fast writes all 80 bytes at
        # once; TorchCall sets the fields one by one).
        self.slots = ffi.new("char[]", _SLOTS * 80 + 8)
        base = (int(ffi.cast("uintptr_t", self.slots)) + 7) // 8 * 8
        self.raw, self.ptr, self.dl, self.shape_at, self.stride_at, self.addr = [], [], [], [], [], []
        for k in range(_SLOTS):
            at = base + 80 * k
            self.addr.append(at)
            self.raw.append(ffi.cast("char *", at))
            self.ptr.append(ffi.cast("DLTensor *", at))
            d = ffi.cast("fce_py_dltensor *", at)
            self.shape_at.append(at + 48)
            self.stride_at.append(at + 64)
            d.shape = ffi.cast("int64_t *", at + 48)
            d.strides = ffi.cast("int64_t *", at + 64)
            d.lanes = 1
            self.dl.append(d[0])
        self.structs = {}  # ctype -> (struct pointer, its default bytes)
        self.streams = {}  # stream int -> fce_stream_t
        self.devices = {}  # (device index, stream int) or "cpu" -> (handle, stream pointer, type, id): _fast
        self.side_streams = {}  # (device index, stream int) -> torch.cuda.ExternalStream (TorchCall.side)


_state = _ThreadState()


def _struct(keep, ctype, reset=True):
    """This thread's `ctype *`, reset to the library's defaults (fce_*_init) unless the caller sets every
    field: one per type and thread, reused call after call (the library keeps no pointer past a call)."""
    st = _state
    entry = st.structs.get(ctype)
    if entry is None:
        p = new_struct(ctype, [])
        template = ffi.new("char[]", ffi.sizeof(ctype))
        ffi.memmove(template, p, ffi.sizeof(ctype))
        entry = st.structs[ctype] = (p, template)
    elif reset:
        ffi.memmove(entry[0], entry[1], ffi.sizeof(ctype))
    return entry[0]


def _bfloat16():
    import ml_dtypes
    return ml_dtypes.bfloat16


def is_torch(x):
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr") and hasattr(x, "__dlpack__")


def _np_dldtype(dt):
    if dt.name == "bfloat16":  # ml_dtypes.bfloat16
        return lib.kDLBfloat, 16
    code = {"f": lib.kDLFloat, "i": lib.kDLInt, "u": lib.kDLUInt, "b": lib.kDLUInt, "c": lib.kDLComplex}.get(dt.kind)
    if code is None:
        raise TypeError("fusedce: numpy arrays of dtype %s cannot be passed to libfusedce" % dt)
    return code, dt.itemsize * 8


class Call:
    """What one library call needs: the framework, device, handle and stream taken from its first
    argument, DLTensors for its arguments, and the objects they point into (`keep`: every one that `dl` or
    `workspace` described, temporaries included, alive until the call object is dropped; an op holds its
    Call until the library call has returned). `Call(ref, ...)` makes a TorchCall for torch tensors."""

    def __new__(cls, ref=None, handle=None, stream=None):
        if cls is Call and is_torch(ref):
            return object.__new__(TorchCall)
        return object.__new__(cls)

    def __init__(self, ref, handle=None, stream=None):
        self.keep = []
        self.stream = ffi.NULL
        self.device_type, self.device_id = DEVICE_CPU, 0
        if isinstance(ref, np.ndarray) or not hasattr(ref, "__dlpack_device__"):
            self.kind = "numpy"
        else:
            dev_type, dev_id = ref.__dlpack_device__()
            self.kind = "dlpack"
            self.module = type(ref).__module__.split(".")[0]
            if int(dev_type) in (int(lib.kDLCUDA), int(lib.kDLCUDAManaged)):
                self.device_type, self.device_id = DEVICE_CUDA, int(dev_id)
                self.stream_int = int(stream) if stream is not None else 0
                self.stream = ffi.cast("fce_stream_t", self.stream_int)
            elif int(dev_type) not in (int(lib.kDLCPU), int(lib.kDLCUDAHost)):
                raise ValueError("fusedce: arrays on DLPack device type %d are not supported" % int(dev_type))
        self.handle = handle if handle is not None else default_handle(self.device_type, self.device_id)

    def struct(self, ctype):
        """A `ctype *` holding the library's defaults (its fce_*_init)."""
        return new_struct(ctype, self.keep)

    def hold(self, x):
        """Keeps x, an object whose memory this call's DLTensors point into, alive as long as this call (see
        the module docstring); returns x."""
        self.keep.append(x)
        return x

    # ---- conversions -------------------------------------------------------------------------------
    def native(self, x, dtype=None):
        """x as an array this call can describe (lists and scalars converted to numpy), optionally cast."""
        if self.kind == "numpy" or not hasattr(x, "__dlpack__"):
            if is_torch(x):
                x = x.detach().cpu().numpy()
            a = np.asarray(x)
            return a.astype(dtype) if dtype is not None and a.dtype != np.dtype(dtype) else a
        return x

    def dl(self, x, writable=False):
        """A `DLTensor*` for x (NULL for None). The array it describes (x, or x converted to numpy) is kept
        alive as long as this call: temporaries may be passed."""
        if x is None:
            return ffi.NULL
        if isinstance(x, np.ndarray) or not hasattr(x, "__dlpack__"):
            return self._numpy_dl(np.asarray(x) if not isinstance(x, np.ndarray) else x, writable)
        return self._capsule_dl(x)

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

    def _capsule_dl(self, x):
        """Any DLPack producer: its capsule's DLTensor (the capsule, never consumed, keeps it alive)."""
        kw = {}
        if self.device_type == DEVICE_CUDA:
            # The consumer's stream; 0 is ambiguous in the protocol, 1 is the legacy default stream.
            kw["stream"] = self.stream_int if self.stream_int != 0 else 1
        try:
            cap = x.__dlpack__(**kw)
        except TypeError:
            cap = x.__dlpack__()
        ptr = _PyCapsule_GetPointer(cap, b"dltensor")
        mt = ffi.cast("DLManagedTensor*", ptr)
        self.keep += [x, cap]
        return ffi.addressof(mt[0], "dl_tensor")

    # ---- allocation --------------------------------------------------------------------------------
    def _array_module(self):
        if self.device_type == DEVICE_CPU:
            return np
        for name in ("cupy", "torch"):
            try:
                return __import__(name)
            except ImportError:
                pass
        raise ImportError("fusedce: CUDA outputs for a %s array need CuPy or torch; pass output arrays" % self.module)

    def empty(self, shape, dtype, fill=None):
        """A new array on the call's device (filled with `fill` unless None). CUDA arrays are allocated and
        filled on the call's stream, so that the allocator reuses their memory in that stream's order."""
        m = self._array_module()
        if m is np:
            a = np.empty(shape, dtype=_bfloat16() if dtype == "bfloat16" else dtype)
            if fill is not None:
                a[...] = fill
            return a
        if m.__name__ == "torch":
            dev = "cuda:%d" % self.device_id
            # stream 0, the legacy default stream, is ordered with every blocking stream: nothing to switch
            with m.cuda.stream(m.cuda.ExternalStream(self.stream_int, device=dev)) if self.stream_int else _NO_CONTEXT:
                return (m.empty(shape, dtype=getattr(m, dtype), device=dev) if fill is None
                        else m.full(shape, fill, dtype=getattr(m, dtype), device=dev))
        with m.cuda.Device(self.device_id):  # cupy
            with m.cuda.ExternalStream(self.stream_int) if self.stream_int else _NO_CONTEXT:
                a = m.empty(shape, dtype=dtype)
                if fill is not None:
                    a.fill(fill)
                return a

    def empty_like(self, x, dtype=None):
        if dtype is None:
            dtype = str(np.dtype(x.dtype)) if not hasattr(x, "__dlpack__") or isinstance(x, np.ndarray) else str(x.dtype)
            dtype = dtype.replace("torch.", "")
        return self.empty(tuple(x.shape), dtype)

    def full(self, shape, value, dtype="float32"):
        return self.empty(shape, dtype, value)

    def output(self, spec, make):
        """An output argument: False/None = not requested, True = make(), an array = write into it."""
        if spec is None or spec is False:
            return None
        if spec is True:
            return make()
        return spec

    def scalar_out(self, a):
        """0-d results: a numpy scalar for numpy calls, the framework's 0-d array otherwise."""
        if a is None:
            return None
        if isinstance(a, np.ndarray) and a.ndim == 0:
            return a[()]
        return a

    # ---- the call ----------------------------------------------------------------------------------
    def workspace(self, query, args, workspace):
        """(pointer, bytes) of the workspace: the caller's `workspace`, or NULL for the handle's cache."""
        if workspace is None:
            return ffi.NULL, 0
        t = self.dl(workspace, True)
        nbytes = 1
        for i in range(t.ndim):
            nbytes *= t.shape[i]
        nbytes *= (t.dtype.bits * t.dtype.lanes + 7) // 8
        return ffi.cast("void*", int(ffi.cast("uintptr_t", t.data)) + t.byte_offset), nbytes

    def run_plain(self, function, *args):
        """Calls lib.<function>(handle, stream, *args) (an op without a workspace) and raises on failure."""
        check(getattr(lib, function)(self.handle.ptr, self.stream, *args), function)

    def run(self, function, *args, workspace=None):
        """Calls lib.<function>(handle, stream, *args, workspace, bytes) and raises on failure."""
        ws, wsb = self.workspace(function + "_workspace_size", args, workspace)
        check(getattr(lib, function)(self.handle.ptr, self.stream, *args, ws, wsb), function)


_TORCH = {}  # torch dtype -> (DLPack code, bits), filled on the first TorchCall
# Ops whose workspace is large (linear cross-entropy's chunks): always from torch's caching allocator, so
# that the memory returns to PyTorch after the call instead of staying in a handle.
_TORCH_WORKSPACE = {"fce_linear_cross_entropy_fwd", "fce_linear_cross_entropy_bwd"}


def _torch_tables():
    import torch

    _TORCH.update({torch.float32: (lib.kDLFloat, 32), torch.bfloat16: (lib.kDLBfloat, 16),
                   torch.float16: (lib.kDLFloat, 16), torch.int32: (lib.kDLInt, 32), torch.int64: (lib.kDLInt, 64),
                   torch.uint8: (lib.kDLUInt, 8), torch.float64: (lib.kDLFloat, 64)})
    return torch


class TorchCall(Call):
    """The fast path for torch tensors (see the module docstring)."""

    torch = None

    def __init__(self, ref, handle=None, stream=None):
        torch = TorchCall.torch
        if torch is None:
            torch = TorchCall.torch = _torch_tables()
        self.kind = "torch"
        self.keep = []
        self.slot = 0
        self.device = ref.device
        self.side = None  # the call's stream when it is not torch's current one (a torch.cuda.ExternalStream)
        st = _state
        if ref.is_cuda:
            self.device_type = DEVICE_CUDA
            self.device_id = ref.get_device()
            current = torch._C._cuda_getCurrentRawStream(self.device_id)
            if stream is None:
                s = current
            else:
                s = int(stream) if isinstance(stream, int) else int(stream.cuda_stream)
                if s != current:
                    key = (self.device_id, s)
                    self.side = st.side_streams.get(key)
                    if self.side is None:
                        self.side = st.side_streams[key] = torch.cuda.ExternalStream(s, device=self.device)
            self.stream_int = s
            p = st.streams.get(s)
            if p is None:
                p = st.streams[s] = ffi.cast("fce_stream_t", s)
            self.stream = p
            # A handle per (device, stream): its cached workspace is never shared by two streams.
            self.handle = handle if handle is not None else default_handle(DEVICE_CUDA, self.device_id, s)
        elif ref.device.type == "cpu":
            self.device_type, self.device_id = DEVICE_CPU, 0
            self.stream = ffi.NULL
            self.handle = handle if handle is not None else default_handle(DEVICE_CPU, 0)
        else:
            raise ValueError("fusedce: tensors on %s are not supported (cpu or cuda)" % ref.device)

    def struct(self, ctype):
        return _struct(self.keep, ctype)

    def native(self, x, dtype=None):
        """x as a torch tensor on the call's device, cast to `dtype` if given (made on the call's stream)."""
        if self.side is not None:
            with self.torch.cuda.stream(self.side):
                return self._native(x, dtype)
        return self._native(x, dtype)

    def _native(self, x, dtype):
        torch = self.torch
        if not isinstance(x, torch.Tensor):
            x = torch.as_tensor(np.asarray(x), device=self.device)
        if dtype is not None:
            td = getattr(torch, dtype)
            if x.dtype != td:
                x = x.to(td)
        return x

    def dl(self, x, writable=False):
        """A `DLTensor*` for x (NULL for None) in this thread's next slot; x (converted to a tensor when it is
        not one) is kept alive as long as this call, and on a side stream recorded on it."""
        if x is None:
            return ffi.NULL
        if not isinstance(x, self.torch.Tensor):
            x = self.native(x)
        self.keep.append(x)
        if self.side is not None:
            self._record(x)
        if x.dim() > _DIMS:  # the records of vocabulary-parallel calls [W, N, K]: through DLPack
            return self._capsule_dl(x)
        k = self.slot
        self.slot = k + 1
        st = _state
        d = st.dl[k]
        d.data = x.data_ptr()
        d.device_type = self.device_type if x.is_cuda == (self.device_type == DEVICE_CUDA) else (
            DEVICE_CUDA if x.is_cuda else DEVICE_CPU)
        d.device_id = x.get_device() if x.is_cuda else 0
        try:
            d.code, d.bits = _TORCH[x.dtype]
        except KeyError:
            raise TypeError("fusedce: torch tensors of dtype %s cannot be passed to libfusedce" % x.dtype) from None
        n = x.dim()
        d.ndim = n
        if n:
            if n > _DIMS:
                raise ValueError("fusedce: a tensor of %d dimensions where the library takes at most 2" % n)
            shape, stride = x.shape, x.stride()
            for i in range(n):
                d.shape[i] = shape[i]
                d.strides[i] = stride[i]
        return st.ptr[k]

    def empty(self, shape, dtype):
        return self.torch.empty(shape, dtype=getattr(self.torch, dtype), device=self.device)

    def empty_like(self, x, dtype=None):
        torch = self.torch
        if dtype is not None:
            dt = getattr(torch, dtype)
        else:  # x's own; for a numpy array among torch arguments, the torch dtype of that name
            dt = x.dtype if isinstance(x, torch.Tensor) else getattr(torch, np.dtype(x.dtype).name)
        return torch.empty(tuple(x.shape), dtype=dt, device=self.device)

    def full(self, shape, value, dtype="float32"):
        if self.side is not None:  # filled on the call's stream, which reads it
            with self.torch.cuda.stream(self.side):
                return self.torch.full(shape, value, dtype=getattr(self.torch, dtype), device=self.device)
        return self.torch.full(shape, value, dtype=getattr(self.torch, dtype), device=self.device)

    def hold(self, x):
        self.keep.append(x)
        if self.side is not None:
            self._record(x)
        return x

    def _record(self, x):
        """The call's side stream recorded on a CUDA tensor of its device: the caching allocator reuses the
        memory only once the stream's work so far (this call's) is done, whichever stream allocated it."""
        if x.is_cuda and x.get_device() == self.device_id:
            x.record_stream(self.side)

    def workspace(self, query, args, workspace):
        if workspace is not None:
            return Call.workspace(self, query, args, workspace)
        torch = self.torch
        if self.device_type == DEVICE_CUDA and (query[:-len("_workspace_size")] in _TORCH_WORKSPACE
                                                or torch.cuda.is_current_stream_capturing()):
            # From torch's caching allocator: stream-ordered, capturable, and visible to PyTorch.
            need = ffi.new("size_t *")
            check(getattr(lib, query)(self.handle.ptr, *args, need), query)
            if need[0] == 0:
                return ffi.NULL, 0
            buf = self.hold(torch.empty(int(need[0]), dtype=torch.uint8, device=self.device))
            return ffi.cast("void *", buf.data_ptr()), int(need[0])
        return ffi.NULL, 0


__all__ = ["Call", "TorchCall", "is_torch"]
