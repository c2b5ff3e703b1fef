"""ONNX conformance vectors from Debian's libonnx-testdata (SoftmaxCrossEntropyLoss, NegativeLogLikelihoodLoss,
LogSoftmax, Softmax, ReduceLogSumExp), mapped onto the library as onnx_vectors.py describes. Missing test
data is a failure, not a skip: CI must run these."""
from pathlib import Path

import pytest

import onnx_vectors as ov

FOUND, OTHER = ov.discover()
DOC = Path(__file__).resolve().parents[3] / "docs" / "onnx-conformance.md"


def test_vectors_found():
    ops = {v.op for v in FOUND}
    assert ops == set(ov.OPS), ops
    assert len(FOUND) >= 140  # 146 in libonnx-testdata 1.12


@pytest.mark.parametrize("vector", FOUND, ids=[v.name for v in FOUND])
def test_onnx_vector(vector):
    failures = ov.check(vector)
    assert not failures, "; ".join(failures)


def test_every_vector_is_in_the_doc_table():
    text = DOC.read_text()
    missing = [v.name for v in FOUND if "`%s`" % v.name not in text]
    missing += [name for name, _ in OTHER if "`%s`" % name not in text]
    assert not missing, "not in %s: %s (python3 bindings/python/tests/onnx_vectors.py --markdown)" % (DOC, missing)
