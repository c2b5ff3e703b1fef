"""fusedce: Python bindings of libfusedce (fused kernels for the losses at the end of a language model).

    import numpy as np, fusedce
    out = fusedce.cross_entropy_fwd(logits, targets, reduction="mean", dlogits=True)

The library is loaded with cffi in ABI mode (no compiler needed): the FUSEDCE_LIBRARY environment variable
alone when set; else the library bundled in this package (`pip install .` at the repository root), the
in-tree build (<repo>/build/libfusedce.so), the system loader. Its declarations come from
fusedce/_generated.py, generated from include/fusedce/fusedce.h by bindings/python/gen_cdef.py. Inputs are
numpy arrays, PyTorch tensors or any DLPack producer, on the CPU or CUDA (the current stream). Drop-in
PyTorch losses, differentiable and torch.compile-able, are in `fusedce.torch` (torch imported lazily).
`fusedce.build_info()` tells what the loaded library was built with; `python3 -m fusedce` prints it.
"""
from ._generated import MACROS as _MACROS
from ._lib import (ABI_VERSION, HEADER_VERSION, KD_TEMPERATURE_MAX, KD_TEMPERATURE_MIN, MAX_STRUCT_SIZE, STATUS,
                   WORKSPACE_ALIGNMENT, AliasingError, BackendNotImplementedError, BuildInfo, CommunicatorError,
                   DeviceMismatchError,
                   FusedCEError, Handle, InvalidArgumentError, NoDeviceError, OutOfMemoryError, ShapeMismatchError,
                   UnsupportedDtypeError, UnsupportedLayoutError, build_info, default_handle, defaults, ffi, lib,
                   library_path, new_struct, version)
from .ops import (LSE_PAIR, CrossEntropyOutput, KDOutput, LinearCrossEntropyGrads, LinearCrossEntropyOutput,
                  SoftmaxOutput,
                  cross_entropy, cross_entropy_bwd, cross_entropy_bwd_ex, cross_entropy_combine, cross_entropy_fwd,
                  cross_entropy_partial,
                  cross_entropy_record_fields, kd_bwd, kd_combine, kd_loss, kd_needs_terms, kd_partial,
                  kd_terms_combine, kd_terms_partial, linear_cross_entropy,
                  linear_cross_entropy_bwd, linear_cross_entropy_fwd, linear_cross_entropy_partial, logsumexp,
                  logsumexp_combine,
                  logsumexp_partial, lse_value, softmax_scale, temp_softmax)

__version__ = HEADER_VERSION
VERSION_NUMBER = _MACROS["FCE_VERSION_NUMBER"]


def __getattr__(name):  # `fusedce.torch` without importing torch at `import fusedce`
    if name == "torch":
        import importlib

        return importlib.import_module(".torch", __name__)
    raise AttributeError(name)


__all__ = [
    "ABI_VERSION", "HEADER_VERSION", "KD_TEMPERATURE_MAX", "KD_TEMPERATURE_MIN", "LSE_PAIR", "MAX_STRUCT_SIZE",
    "STATUS",
    "VERSION_NUMBER", "WORKSPACE_ALIGNMENT", "AliasingError", "BackendNotImplementedError", "BuildInfo",
    "CommunicatorError",
    "CrossEntropyOutput", "DeviceMismatchError", "FusedCEError", "Handle", "InvalidArgumentError", "KDOutput",
    "LinearCrossEntropyGrads", "LinearCrossEntropyOutput", "NoDeviceError", "OutOfMemoryError",
    "ShapeMismatchError", "SoftmaxOutput", "UnsupportedDtypeError", "UnsupportedLayoutError", "build_info",
    "cross_entropy", "cross_entropy_bwd", "cross_entropy_bwd_ex", "cross_entropy_combine", "cross_entropy_fwd", "cross_entropy_partial",
    "cross_entropy_record_fields", "default_handle", "defaults", "ffi", "kd_bwd", "kd_combine", "kd_loss",
    "kd_needs_terms", "kd_partial", "kd_terms_combine", "kd_terms_partial",
    "lib", "library_path", "linear_cross_entropy", "linear_cross_entropy_bwd", "linear_cross_entropy_fwd",
    "linear_cross_entropy_partial",
    "logsumexp", "logsumexp_combine", "logsumexp_partial", "lse_value", "new_struct", "softmax_scale", "temp_softmax",
    "version",
]
