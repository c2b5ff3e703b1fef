"""Loading libfusedce with cffi (ABI mode), errors, handles."""
import ctypes.util
import dataclasses
import os
import threading
from pathlib import Path

import cffi

from ._generated import CDEF, INITS, MACROS, VERSION

ffi = cffi.FFI()
ffi.cdef(CDEF)

ABI_VERSION = MACROS["FCE_ABI_VERSION"]
HEADER_VERSION = VERSION
HEADER_VERSION_NUMBER = MACROS["FCE_VERSION_NUMBER"]
#: Required alignment, in bytes, of a caller's workspace (FCE_WORKSPACE_ALIGNMENT).
WORKSPACE_ALIGNMENT = MACROS["FCE_WORKSPACE_ALIGNMENT"]
#: Largest struct_size the library accepts (FCE_MAX_STRUCT_SIZE).
MAX_STRUCT_SIZE = MACROS["FCE_MAX_STRUCT_SIZE"]
#: Domain of kd_loss's temperature, inclusive (FCE_KD_TEMPERATURE_MIN/MAX, as fp32 values).
KD_TEMPERATURE_MIN = MACROS["FCE_KD_TEMPERATURE_MIN"]
KD_TEMPERATURE_MAX = MACROS["FCE_KD_TEMPERATURE_MAX"]


LIBRARY_NAME = "libfusedce.so.%d" % ABI_VERSION  # the soname; the file a wheel bundles in the package


def _candidates():
    """[(path or name, why it was skipped or None)]: FUSEDCE_LIBRARY (a file, or a folder holding
    libfusedce.so or libfusedce.so.<ABI>) alone when set; else the library bundled in the package (a wheel
    built by `pip install .`: fusedce/libfusedce.so.<ABI>), the in-tree build (<repo>/build/libfusedce.so,
    when these modules are the sources in <repo>/bindings/python), and the system loader."""
    env = os.environ.get("FUSEDCE_LIBRARY")
    if env:
        p = Path(env)
        if p.is_dir():
            p = next((p / n for n in ("libfusedce.so", LIBRARY_NAME) if (p / n).exists()), p / "libfusedce.so")
        return [(str(p), None)]  # an explicit choice is never replaced
    here = Path(__file__).resolve().parent
    out = []
    bundled = here / LIBRARY_NAME
    out.append((str(bundled), None if bundled.exists() else "not present"))
    if here.parent.name == "python" and here.parent.parent.name == "bindings":
        intree = here.parents[2] / "build" / "libfusedce.so"
        out.append((str(intree), None if intree.exists() else "not present"))
    out.append((LIBRARY_NAME, None))
    found = ctypes.util.find_library("fusedce")
    if found and found != LIBRARY_NAME:
        out.append((found, None))
    return out


def _preload_cuda_library(message):
    """A library built with CUDA that failed to load for want of a CUDA library (libcudart.so.13): that
    library from an NVIDIA wheel on sys.path (PyTorch's: site-packages/nvidia/cu13/lib, or
    nvidia/cuda_runtime/lib for CUDA 12), loaded RTLD_GLOBAL so that the retry finds it by its soname.
    Returns its path, or None. (The bundled library's RUNPATH already names ../nvidia/cu<N>/lib of its own
    site-packages and the CUDA toolkit it was built with; this covers another site-packages.)"""
    import re
    import sys

    m = re.search(r"(libcu[a-z]+\.so\.\d+)", message)
    if not m:
        return None
    for entry in sys.path:
        nvidia = Path(entry or ".") / "nvidia"
        if not nvidia.is_dir():
            continue
        for cand in sorted(nvidia.glob("*/lib/" + m.group(1))):
            try:
                ctypes.CDLL(str(cand), mode=ctypes.RTLD_GLOBAL)
                return str(cand)
            except OSError:
                continue
    return None


def _load():
    tried = []
    for cand, skipped in _candidates():
        if skipped:
            tried.append("%s: %s" % (cand, skipped))
            continue
        try:
            lib = ffi.dlopen(cand)
        except OSError as e:
            preloaded = _preload_cuda_library(str(e))
            if preloaded is None:
                tried.append("%s: %s" % (cand, e))
                continue
            try:
                lib = ffi.dlopen(cand)
            except OSError as e2:
                tried.append("%s: %s (after loading %s)" % (cand, e2, preloaded))
                continue
        abi = lib.fce_abi_version()
        if abi != ABI_VERSION:
            raise ImportError("fusedce: %s has ABI %d but these bindings were generated for ABI %d "
                              "(python3 bindings/python/gen_cdef.py)" % (cand, abi, ABI_VERSION))
        found = lib.fce_version_number()
        if found < HEADER_VERSION_NUMBER:  # functions are only added within an ABI: an older one may lack some
            raise ImportError("fusedce: %s is libfusedce %s, older than the header these bindings were generated "
                              "from (%s)" % (cand, ffi.string(lib.fce_version_string()).decode(), VERSION))
        return lib, cand
    raise ImportError("fusedce: cannot load libfusedce; install the package with its library (pip install . at "
                      "the repository root) or set FUSEDCE_LIBRARY to its path. Tried:\n  " + "\n  ".join(tried))


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


class CommunicatorError(FusedCEError):
    """NCCL could not be loaded, or an NCCL call failed (NCCL mode)."""


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
    "COMMUNICATOR_ERROR": CommunicatorError,
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


def default_handle(device_type, device_id=0, stream=0):
    """The calling thread's handle for a device (and, on CUDA, a stream: a handle's cached workspace then
    never serves two streams at once), created on first use."""
    cache = getattr(_local, "handles", None)
    if cache is None:
        cache = _local.handles = {}
    key = (device_type, device_id, stream)
    h = cache.get(key)
    if h is None:
        cuda = int(device_type) == int(DEVICE_CUDA)
        h = cache[key] = Handle(int(device_type), int(device_id) if cuda else 0)
    return h


# ---- structs filled by the library's fce_*_init functions -----------------------------------------

# Every struct with an fce_*_init function: fce_ce_options_t -> fce_ce_options_init, ...
_INIT_FUNCTIONS = {ctype: ctype[:-len("_t")] + "_init" for ctype, _ in INITS.values()
                   if ctype != "fce_build_info_t"}


def _init_struct(ctype):
    """A `ctype *` (zeroed cffi memory of these declarations' sizeof) filled by the loaded library's
    fce_*_init with struct_size = that sizeof: the fields the library knows get its defaults. A newer
    library gives the fields these declarations lack their defaults itself; an older one zeroes the
    fields it does not know, and refuses (FCE_STATUS_INVALID_ARGUMENT) a non-zero value set there instead
    of ignoring it."""
    p = ffi.new(ctype + " *")
    fn = _INIT_FUNCTIONS[ctype]
    check(getattr(lib, fn)(p, ffi.sizeof(ctype)), fn)
    return p


def _library_defaults(ctype):
    """{field: value} of the loaded library's defaults of `ctype` (pointers as None or an int)."""
    p = _init_struct(ctype)
    values = {}
    for name, field in ffi.typeof(ctype).fields:
        v = getattr(p, name)
        values[name] = (None if v == ffi.NULL else int(ffi.cast("uintptr_t", v))) if field.type.kind == "pointer" else v
    return values


_LIBRARY_DEFAULTS = {ctype: _library_defaults(ctype) for ctype in _INIT_FUNCTIONS}


def new_struct(ctype, keep):
    """A `ctype *` (e.g. "fce_ce_options_t") holding the loaded library's defaults, filled by its
    fce_*_init function; struct_size is these declarations' sizeof. The memory is owned by an object
    appended to `keep`, which must outlive the pointer's use."""
    p = _init_struct(ctype)
    keep.append(p)
    return p


def defaults(struct):
    """{field: value} of the loaded library's defaults for a struct, from its fce_*_init function:
    defaults("fce_ce_options_t"), or by the header's macro name, defaults("FCE_CE_OPTIONS_INIT").
    struct_size is these declarations' sizeof; pointers are None (NULL). These are the keyword defaults of
    every function; the tests check that they equal the header's *_INIT macros."""
    ctype = INITS[struct][0] if struct in INITS else struct
    if ctype not in _LIBRARY_DEFAULTS:
        raise KeyError("fusedce.defaults: %r has no fce_*_init function (one of %s)"
                       % (struct, ", ".join(sorted(_LIBRARY_DEFAULTS))))
    return dict(_LIBRARY_DEFAULTS[ctype])


# ---- build information ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BuildInfo:
    """What the loaded library was built with (fce_build_info)."""

    version_number: int        #: FCE_VERSION_NUMBER of the library (MAJOR*10000 + MINOR*100 + PATCH)
    abi_version: int           #: FCE_ABI_VERSION of the library
    cuda_backend: bool         #: the CUDA backend is built (False: a CPU-only build)
    cuda_runtime_version: int  #: CUDART_VERSION compiled against (13000 = 13.0); 0 without CUDA
    cublas_version: int        #: CUBLAS_VERSION of the cuBLAS headers compiled against; 0 without CUDA
    version_string: str        #: "MAJOR.MINOR.PATCH"
    cuda_architectures: str    #: GPU code in the library, space separated ("sm_80 sm_90 compute_90"); "" without CUDA

    def as_dict(self):
        return dataclasses.asdict(self)

    def __str__(self):
        s = "libfusedce %s (ABI %d)" % (self.version_string, self.abi_version)
        if not self.cuda_backend:
            return s + ", CPU only"
        rt, cb = self.cuda_runtime_version, self.cublas_version
        return s + ", CUDA backend: CUDA runtime %d.%d, cuBLAS %d.%d.%d, %s" % (
            rt // 1000, rt % 1000 // 10, cb // 10000, cb % 10000 // 100, cb % 100,
            self.cuda_architectures or "no GPU code")


def build_info():
    """fce_build_info() of the loaded library, as a BuildInfo (`.as_dict()` for a dict)."""
    buf = ffi.new("char[]", MAX_STRUCT_SIZE)  # room for a newer library's larger struct
    p = ffi.cast("fce_build_info_t *", buf)
    p.struct_size = MAX_STRUCT_SIZE
    check(lib.fce_build_info(p), "fce_build_info")

    def text(s):
        return ffi.string(s).decode("utf-8", "replace") if s != ffi.NULL else ""

    return BuildInfo(int(p.version_number), int(p.abi_version), bool(p.cuda_backend), int(p.cuda_runtime_version),
                     int(p.cublas_version), text(p.version_string), text(p.cuda_architectures))
