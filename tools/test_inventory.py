#!/usr/bin/env python3
"""Counts the project's tests and assertions, so that a change to the test loop shows whether one was lost.

    tools/test_inventory.py [BUILD]

Static counts from the sources (test cases and assertion sites per language: gtest TEST*/EXPECT_*/ASSERT_*,
pytest test functions and asserts, Rust #[test] and assert* macros, Julia @test*, the fuzz harness's oracle
calls); with BUILD, also the gtest cases each unit executable lists (--gtest_list_tests, the filter-free
count) and the tests `meson test --list` runs. docs/testing.md records the figures.
"""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def count(globs, pattern):
    rx = re.compile(pattern, re.M)
    files = sorted({p for g in globs for p in ROOT.glob(g) if p.is_file() and "/target/" not in str(p)})
    return sum(len(rx.findall(p.read_text(errors="replace"))) for p in files), len(files)


def main():
    rows = [
        ("C++ (tests/)", ["tests/**/*.cpp", "tests/**/*.hpp", "tests/**/*.c"],
         r"^\s*TEST(?:_F|_P)?\(", r"\b(?:EXPECT|ASSERT)_[A-Z_0-9]+\(|\bADD_FAILURE\(|\bFAIL\(\)"),
        ("fuzz harness oracles", ["tests/fuzz/fuzz_api.cpp"], r"(?!x)x", r"\bdie\("),
        ("Python (bindings/python/tests, tests/packaging)",
         ["bindings/python/tests/**/*.py", "tests/packaging/*.py"], r"^\s*def test_\w+\(", r"^\s*assert\b|\bpytest\.raises\("),
        ("Rust (bindings/rust)", ["bindings/rust/**/*.rs"], r"#\[test\]", r"\bassert(?:_eq|_ne)?!\("),
        ("Julia (bindings/julia)", ["bindings/julia/**/*.jl"], r"@testset\b", r"@test(?:_throws|_broken|_skip)?\b(?!set)"),
    ]
    print("%-48s %6s %10s %12s" % ("", "files", "test cases", "assertions"))
    for name, globs, case_rx, assert_rx in rows:
        cases, files = count(globs, case_rx)
        asserts, _ = count(globs, assert_rx)
        print("%-48s %6d %10d %12d" % (name, files, cases, asserts))
    if len(sys.argv) > 1:
        build = Path(sys.argv[1])
        total = 0
        for exe in sorted((build / "tests").glob("test_*")):
            if not exe.is_file():
                continue
            out = subprocess.run([str(exe), "--gtest_list_tests"], capture_output=True, text=True).stdout
            total += sum(1 for line in out.splitlines() if line.startswith("  "))
        print("gtest cases listed by %s/tests/test_* (the CPU executables): %d" % (build, total))
        out = subprocess.run(["meson", "test", "-C", str(build), "--list", "--no-rebuild"], capture_output=True,
                             text=True).stdout
        tests = [line for line in out.splitlines() if " / " in line]
        print("meson tests: %d" % len(tests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
