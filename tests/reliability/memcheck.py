#!/usr/bin/env python3
"""valgrind memcheck over a set of runs that reaches every entry point (the meson suite `reliability`).

    memcheck.py run BUILD NAME       one run under memcheck: NAME a unit executable (BUILD/tests/test_NAME) with
                                     the gtest filter below, or `fuzz_replay`: the fuzz seed corpus
                                     (tests/fuzz/corpus) through BUILD/tests/reliability/fuzz_replay, every entry point the
                                     harness reaches with valid and invalid arguments
    memcheck.py entry-points BUILD NAME...
                                     the runs NAME... natively, with the dynamic loader's record of the library
                                     functions each binds (LD_DEBUG=bindings): every function the library exports
                                     must be called by one of them, else the memcheck set misses it

Memcheck runs a program 20-100x slower. The tests left out below each take 0.15 s or more natively (float64
references over 10^5-column rows, many rows, thread-count sweeps): 30-300 s under memcheck apiece, through the
same library paths that the tests kept run on shorter rows. ASan+UBSan (tools/sanitizers.sh asan) runs every
test, these included. Exit status: 0 clean; 1 a memcheck error (invalid access, use of an uninitialised value,
definite or indirect leak), a crash, or an entry point no run calls; 2 usage or a missing tool or program.
A gtest assertion failure under memcheck (no memcheck error) is printed as a warning: the unit suite runs the
same tests natively and owns them.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Left out of memcheck: natively >= 0.15 s each (one thread, the 2-core build machine, 2026-12-02); ASan runs them.
SLOW = [
    "Contract.CrossEntropySubnormalSoftcap", "Contract.HandleSharedByThreadsIsRefusedNotRaced",
    "Contract.KdInvariantToACommonLogitOffset", "Contract.LinearCrossEntropyIndependentOfThreadCounts",
    "Contract.SoftmaxHugeLogitsAtInfiniteAndHugeTemperatures", "CrossEntropy.FewRowsForward",
    "CrossEntropy.FewRowsSpecialValues", "CrossEntropy.ManyRowsFusedGradient", "CrossEntropy.ShapesDtypesReductions",
    "EntropyGrad.PeakedLargeVocabulary", "KdLoss.ForwardOnlyManyRows", "KdLoss.GradientManyRows",
    "KdLoss.LargeVocabularies", "KdLoss.TopK", "KdVocabParallel.ManyRanksMegatronSplit",
    "KdVocabParallel.ManyRowsLongShards", "KdVocabParallel.ShardsDtypesDivergences",
    "KdVocabParallel.TemperaturesAndSpecialRows", "KdVocabParallel.TopkTeacher",
    "LargeLogits.CrossEntropyGradientAtAnyOffset", "LinearCrossEntropy.BitsDoNotDependOnTheWorkspaceSize",
    "LinearCrossEntropy.DtypesOptionsAndBias", "LinearCrossEntropy.ForwardOnly",
    "LinearCrossEntropy.QueriedWorkspace", "LinearCrossEntropy.ShortLastChunkSplits",
    "Logsumexp.FewAlignedRowsWithPartialLastVector", "Logsumexp.ShapesAndDtypes", "ScaleRows.ScalarAndPerRowFactors",
    "TempSoftmax.FewAlignedRowsWithPartialLastVector", "TempSoftmax.FewRowsProbabilitiesOnly",
    "TempSoftmax.ManyLongAlignedRows", "TempSoftmax.ManyRowsProbabilitiesOnly", "TempSoftmax.ScalarTemperatures",
    "VocabParallel.ManyRanksMegatronSplit", "VocabParallel.ShardsDtypesOptions",
]
GTEST_FILTER = os.environ.get("MEMCHECK_GTEST_FILTER") or "-" + ":".join(SLOW)  # the override: a narrower set

VALGRIND = ["valgrind", "--tool=memcheck", "--error-exitcode=99", "--leak-check=full",
            "--show-leak-kinds=definite,indirect", "--errors-for-leak-kinds=definite,indirect", "--track-origins=yes",
            "--suppressions=%s" % (ROOT / "tests" / "valgrind.supp"), "--gen-suppressions=all", "--quiet"]
# OMP_NUM_THREADS=2: the threaded paths run (memcheck serialises threads: more only costs time).
ENV = dict(os.environ, OMP_NUM_THREADS="2", OPENBLAS_NUM_THREADS="1")


def command(build, name):
    """The program and arguments of run NAME (without valgrind)."""
    if name == "fuzz_replay":
        return [str(Path(build) / "tests" / "reliability" / "fuzz_replay"), str(ROOT / "tests" / "fuzz" / "corpus")]
    return [str(Path(build) / "tests" / ("test_" + name)), "--gtest_filter=" + GTEST_FILTER, "--gtest_brief=1"]


def need(prog):
    if not Path(prog).exists():
        sys.exit("memcheck.py: %s missing (build it: ninja -C BUILD)" % prog)


def run(build, name):
    if not shutil.which("valgrind"):
        print("memcheck.py: valgrind not found (tools/install-deps.sh installs it)")
        return 2
    cmd = command(build, name)
    need(cmd[0])
    print("== valgrind memcheck: %s" % " ".join(cmd), flush=True)
    t0 = time.monotonic()
    st = subprocess.run(VALGRIND + cmd, env=ENV, cwd=ROOT).returncode
    print("   %.0f s, exit %d" % (time.monotonic() - t0, st))
    if st == 0:
        return 0
    if st == 99:
        print("memcheck.py: memcheck errors in %s" % name)
    elif st == 1 and name != "fuzz_replay":
        print("memcheck.py: WARNING: %s had gtest assertion failures under memcheck (no memcheck error)" % name)
        return 0
    else:
        print("memcheck.py: %s died under memcheck (status %d)" % (name, st))
    return 1


def exported(build):
    lib = Path(build) / "libfusedce.so"
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], check=True, capture_output=True, text=True).stdout
    return {line.split()[-1] for line in out.splitlines() if " T fce_" in line}


def entry_points(build, names):
    want = exported(build)
    bound = {}
    binding = re.compile(r"binding file (\S+) \[\d+\] to (\S+) \[\d+\]: normal symbol `(fce_\w+)'")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            cmd = command(build, name)
            need(cmd[0])
            # Lazy binding (the default): the loader binds a function at its first call, so a bound name was called.
            flags = subprocess.run(["readelf", "-d", cmd[0]], capture_output=True, text=True).stdout
            if re.search(r"\(FLAGS\).*\bNOW\b|\(BIND_NOW\)", flags):
                print("memcheck.py: %s is linked with -z now: its bindings do not show its calls" % cmd[0])
                return 1
            env = dict(ENV, LD_DEBUG="bindings", LD_DEBUG_OUTPUT=str(Path(tmp) / name))
            env.pop("LD_BIND_NOW", None)
            subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for f in Path(tmp).glob(name + ".*"):
                for m in binding.finditer(f.read_text(errors="replace")):
                    if "libfusedce" in m.group(2) and "libfusedce" not in m.group(1):
                        bound.setdefault(m.group(3), set()).add(name)
    missing = sorted(want - set(bound))
    print("memcheck.py: %d of the %d exported functions are called by the memcheck set" % (len(want & set(bound)),
                                                                                           len(want)))
    if missing:
        print("memcheck.py: no memcheck run calls %s" % ", ".join(missing))
        return 1
    return 0


def main():
    if len(sys.argv) < 4 or sys.argv[1] not in ("run", "entry-points"):
        sys.exit(__doc__)
    what, build = sys.argv[1], sys.argv[2]
    if what == "entry-points":
        return entry_points(build, sys.argv[3:])
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    return run(build, sys.argv[3])


if __name__ == "__main__":
    sys.exit(main())
