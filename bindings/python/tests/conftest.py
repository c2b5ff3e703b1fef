"""Shared pytest setup: the package is imported from this checkout (bindings/python), and the library
from FUSEDCE_LIBRARY (meson sets it to the build's libfusedce.so) or the in-tree build.

torch.compile's on-disk caches (FX graph, AOTAutograd) key a graph on its code and inputs, not on the fake
implementations of the custom ops in it: a cache warmed by another version of fusedce/_torch_ops.py (say
with an op's output of another shape) would replay that version's compiled code. The tests therefore tag
the cache key with a hash of the package's sources (torch.compiler.config.cache_key_tag)."""
import hashlib
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PACKAGE))


def _tag_compile_caches():
    try:
        import torch
    except ImportError:
        return
    h = hashlib.sha256()
    for p in sorted((PACKAGE / "fusedce").glob("*.py")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    config = torch.compiler.config
    if hasattr(config, "cache_key_tag"):
        config.cache_key_tag = "fusedce-tests-" + h.hexdigest()[:16] + (config.cache_key_tag or "")


_tag_compile_caches()


def pytest_terminal_summary(terminalreporter):
    """The library under test, at the end of the pytest output (shown with -q too)."""
    import fusedce

    terminalreporter.write_line("fusedce: %s; library %s" % (fusedce.build_info(), fusedce.library_path))
