"""Shared pytest setup: the package is imported from this checkout (bindings/python), and the library
from FUSEDCE_LIBRARY (meson sets it to the build's libfusedce.so) or the in-tree build."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_terminal_summary(terminalreporter):
    """The library under test, at the end of the pytest output (shown with -q too)."""
    import fusedce

    terminalreporter.write_line("fusedce: %s; library %s" % (fusedce.build_info(), fusedce.library_path))
