#!/usr/bin/env python3
"""Prints the library version (or, with --abi, the ABI version) read from the public header."""
import pathlib, re, sys

text = (pathlib.Path(__file__).resolve().parent.parent / "include/fusedce/fusedce.h").read_text()
def macro(name):
    return re.search(r"#define\s+%s\s+(\d+)" % name, text).group(1)
if "--abi" in sys.argv:
    print(macro("FCE_ABI_VERSION"))
else:
    print(".".join(macro("FCE_VERSION_" + p) for p in ("MAJOR", "MINOR", "PATCH")))
