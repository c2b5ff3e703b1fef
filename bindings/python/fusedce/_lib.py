"""Loading libfusedce with cffi (ABI mode), errors, handles."""
import ctypes.util
import os
import threading
from pathlib import Path

import cffi

from ._generated import CDEF, INITS, MACROS, VERSION

ffi = cffi.FFI()
ffi.cdef(CDEF)

ABI_VERSION = MACROS["FCE_ABI_VERSION"]
HEADER_VERSION = VERSION


def _candidates():
    """FUSEDCE_LIBRARY (a file or a folder), then the in-tree build, then the system loader."""
    env = os.environ.get("FUSEDCE_LIBRARY")
    if env:
        p = Path(env)
        return [str(p / "libfusedce.so" if p.is_dir() else p)]  # an explicit choice is never replaced
    out = []
    here = Path(__file__).resolve().parent  # <repo>/bindings/python/fusedce
    intree = here.parents[2] / "build" / "libfusedce.so"
    if intree.exists():
        out.append(str(intree))
    out.append("libfusedce.so.%d" % ABI_VERSION)
    found = ctypes.util.find_library("fusedce")
    if found:
        out.append(found)
    return out


def _load():
    errors = []
    for cand in _candidates():
        try:
            lib = ffi.dlopen(cand)
        except OSError as e:
            errors.append("%s: %s" % (cand, e))
            continue
        abi = lib.fce_abi_version()
        if abi != ABI_VERSION:
            raise ImportError("fusedce: %s has ABI %d but these bindings were generated for ABI %d "
                              "(python3 bindings/python/gen_cdef.py)" % (cand, abi, ABI_VERSION))
        return lib, cand
    raise ImportError("fusedce: cannot load libfusedce; set FUSEDCE_LIBRARY to its path. Tried:\n  " +
                      "\n  ".join(errors))


lib, library_path = _load()

# ---- status codes and errors ---------------------------------------------------------------------

STATUS = {name[len("FCE_STATUS_"):]: value for value, name in ffi.typeof("fce_status_t").elements.items()}
_STATUS_NAMES = {v: k for k, v in STATUS.items()}


class FusedCEError(RuntimeError):
    """A libfusedce call failed. Attributes: status (int), status_name (e.g. "SHAPE_MISMATCH"),
    function (the C entry point), message (fce_last_error_message(), or the status text)."""

    def __init__(self, status, function, message):
        self.status = int(status)
        self.status_name = _STATUS_NAMES.get(self.status, "UNKNOWN(%d)" % self.status)
        self.function = function
        self.message = message
        text = message if message.startswith(function) else "%s: %s" % (function, message)
        super().__init__("%s [FCE_STATUS_%s]" % (text, self.status_name))


class InvalidArgumentError(FusedCEError, ValueError):
    pass


class ShapeMismatchError(FusedCEError, ValueError):
    pass


class UnsupportedDtypeError(FusedCEError, TypeError):
    pass


class UnsupportedLayoutError(FusedCEError, ValueError):
    pass


class DeviceMismatchError(FusedCEError, ValueError):
    pass


class AliasingError(FusedCEError, ValueError):
    pass


class NoDeviceError(FusedCEError):
    pass


class BackendNotImplementedError(FusedCEError, NotImplementedError):
    pass


class OutOfMemoryError(FusedCEError, MemoryError):
    pass


_ERROR_CLASSES = {
    "INVALID_ARGUMENT": InvalidArgumentError,
    "SHAPE_MISMATCH": ShapeMismatchError,
    "UNSUPPORTED_DTYPE": UnsupportedDtypeError,
    "UNSUPPORTED_LAYOUT": UnsupportedLayoutError,
    "DEVICE_MISMATCH": DeviceMismatchError,
    "ALIASING": AliasingError,
    "NO_DEVICE": NoDeviceError,
    "NOT_IMPLEMENTED": BackendNotImplementedError,
    "OUT_OF_MEMORY": OutOfMemoryError,
}


def check(status, function):
    if status == STATUS["SUCCESS"]:
        return
    detail = ffi.string(lib.fce_last_error_message()).decode("utf-8", "replace")
    if not detail:
        detail = ffi.string(lib.fce_status_string(status)).decode("utf-8", "replace")
    cls = _ERROR_CLASSES.get(_STATUS_NAMES.get(int(status)), FusedCEError)
    raise cls(status, function, detail)


def version():
    """Version string of the loaded library."""
    return ffi.string(lib.fce_version_string()).decode()


# ---- handles -------------------------------------------------------------------------------------

DEVICE_CPU = lib.kDLCPU
DEVICE_CUDA = lib.kDLCUDA


class Handle:
    """A library handle for one device: Handle("cpu") or Handle("cuda", 0). Freed by close(), by a
    `with` block, or when collected. One thread at a time may use a handle; the functions of this
    package use a per-thread handle per device unless given one."""

    def __init__(self, device="cpu", device_id=0):
        dt = {"cpu": DEVICE_CPU, "cuda": DEVICE_CUDA}.get(device, device)
        if dt not in (DEVICE_CPU, DEVICE_CUDA):
            raise ValueError("device must be 'cpu' or 'cuda', got %r" % (device,))
        out = ffi.new("fce_handle_t*")
        check(lib.fce_handle_create(dt, int(device_id), out), "fce_handle_create")
        self.device_type = int(dt)
        self.device_id = int(device_id) if dt == DEVICE_CUDA else 0
        self._ptr = ffi.gc(out[0], lib.fce_handle_destroy)

    @property
    def ptr(self):
        if self._ptr is None:
            raise ValueError("this fusedce.Handle was closed")
        return self._ptr

    def close(self):
        if self._ptr is not None:
            p, self._ptr = self._ptr, None
            ffi.release(p)  # calls fce_handle_destroy now

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        kind = "cpu" if self.device_type == DEVICE_CPU else "cuda:%d" % self.device_id
        return "fusedce.Handle(%s%s)" % (kind, ", closed" if self._ptr is None else "")


_local = threading.local()


def default_handle(device_type, device_id=0):
    """The calling thread's handle for a device, created on first use."""
    cache = getattr(_local, "handles", None)
    if cache is None:
        cache = _local.handles = {}
    key = (int(device_type), int(device_id) if device_type == DEVICE_CUDA else 0)
    h = cache.get(key)
    if h is None:
        h = cache[key] = Handle(key[0], key[1])
    return h


def defaults(init_name):
    """{field: value} of a header initializer macro, e.g. defaults("FCE_CE_OPTIONS_INIT")."""
    return dict(INITS[init_name][1])
