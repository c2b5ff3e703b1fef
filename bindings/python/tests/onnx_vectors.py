"""The ONNX conformance vectors (Debian's libonnx-testdata) that the library's ops can express, and how.

Each vector is a folder with model.onnx (one node, or its `_expanded` decomposition into primitive ops,
with the same data) and test_data_set_*/input_*.pb, output_*.pb. The node's attributes and opset (read
with the `onnx` package) decide the mapping onto the library:

  SoftmaxCrossEntropyLoss (opset 13): scores [N, C, d1, ...] are transposed to rows [N*d1*..., C] (class
      axis last), labels flattened; reduction, ignore_index and weights map one to one (no ignore_index:
      INT64_MIN, which no label equals); the optional log_prob output is fce_temp_softmax's logprobs at
      T = 1, transposed back.
  NegativeLogLikelihoodLoss (opset 13): the input is not required to hold log-probabilities (the vectors'
      rows do not sum to 1 in probability), and the library's cross-entropy always normalizes, so
      NLL is not expressible directly. It is checked through the exact identity
      NLL_i = CE_i - w[t_i] * lse_i with CE and lse from fce_cross_entropy_fwd, and for sum/mean through
      the library's reduction: NLL_sum = CE_sum - sum_i w[t_i] lse_i, NLL_mean = CE_mean - that / sum w[t_i].
  LogSoftmax / Softmax: opset >= 13 reduces one axis (moved last); opset < 13 flattens to 2-D at `axis`
      (rows = prod(shape[:axis])). fce_temp_softmax at T = 1.
  ReduceLogSumExp: the reduced axes (all when absent) are moved last and flattened; fce_logsumexp; keepdims
      restores size-1 axes. These vectors are float64, which the library does not take: the input is
      rounded to fp32 and compared at fp32 tolerance.

`python3 onnx_vectors.py --markdown` prints the table of docs/onnx-conformance.md.
"""
import os
import re
import sys
from pathlib import Path

import numpy as np

DATA = Path(os.environ.get("ONNX_TESTDATA_DIR", "/usr/share/libonnx-testdata/data"))
SUITES = ("node", "pytorch-converted", "pytorch-operator", "simple")
OPS = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss", "LogSoftmax", "Softmax", "ReduceLogSumExp")
NAME_HINT = re.compile(r"sce|nll|softmax|log_sum_exp", re.I)
RTOL, ATOL = 1e-5, 1e-6


class Vector:
    def __init__(self, path, op, attrs, opset, via=None):
        self.path, self.op, self.attrs, self.opset, self.via = path, op, attrs, opset, via

    @property
    def name(self):
        return "%s/%s" % (self.path.parent.name, self.path.name)

    def data_sets(self):
        import onnx
        from onnx import numpy_helper

        def read(f):
            t = onnx.TensorProto()
            t.ParseFromString(f.read_bytes())
            return numpy_helper.to_array(t)

        for ds in sorted(self.path.glob("test_data_set_*")):
            ins = [read(f) for f in sorted(ds.glob("input_*.pb"), key=lambda p: int(p.stem.split("_")[1]))]
            outs = [read(f) for f in sorted(ds.glob("output_*.pb"), key=lambda p: int(p.stem.split("_")[1]))]
            yield ds.name, ins, outs


def _node_info(model_path):
    import onnx
    from onnx import helper

    m = onnx.load(str(model_path))
    opset = max((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), default=0)
    nodes = list(m.graph.node)
    if len(nodes) != 1:
        return None, None, opset, len(nodes)
    n = nodes[0]
    return n.op_type, {a.name: helper.get_attribute_value(a) for a in n.attribute}, opset, 1


def discover():
    """(applicable vectors, [(name, reason)] of vectors whose name suggests these ops but whose op is another)."""
    if not DATA.is_dir():
        raise FileNotFoundError("ONNX test data not found at %s: install Debian's libonnx-testdata "
                                "(tools/deps.d/python.sh)" % DATA)
    found, other = [], []
    direct = {}
    dirs = [d for s in SUITES if (DATA / s).is_dir() for d in sorted((DATA / s).iterdir())
            if d.is_dir() and NAME_HINT.search(d.name) and (d / "model.onnx").exists()]
    for d in dirs:
        if d.name.endswith("_expanded"):
            continue
        op, attrs, opset, nodes = _node_info(d / "model.onnx")
        if op in OPS:
            v = Vector(d, op, attrs, opset)
            direct[d] = v
            found.append(v)
        elif op is None:
            other.append(("%s/%s" % (d.parent.name, d.name),
                          "a graph of %d primitive nodes (another loss, exported from PyTorch), none of the "
                          "operators above" % nodes))
        else:
            other.append(("%s/%s" % (d.parent.name, d.name), "operator %s, not one of the operators above" % op))
    for d in dirs:
        if not d.name.endswith("_expanded"):
            continue
        base = d.parent / d.name[: -len("_expanded")]
        if base in direct:
            b = direct[base]
            found.append(Vector(d, b.op, b.attrs, b.opset, via=b.name))
        else:
            other.append(("%s/%s" % (d.parent.name, d.name), "expanded graph of an operator outside the library"))
    return found, other


# ---- mapping onto the library ------------------------------------------------------------------------

def _rows_class_axis(x):
    c = x.shape[1]
    return np.ascontiguousarray(np.moveaxis(x, 1, -1).reshape(-1, c)), c


def _reduction(attrs):
    r = attrs.get("reduction", b"mean")
    return r.decode() if isinstance(r, bytes) else r


def run(v, inputs):
    """The library's outputs for one data set, shaped as ONNX's."""
    import fusedce

    a = v.attrs
    if v.op == "SoftmaxCrossEntropyLoss":
        scores, labels = inputs[0], inputs[1]
        weights = inputs[2] if len(inputs) > 2 else None
        rows, c = _rows_class_axis(scores)
        t = labels.reshape(-1).astype(np.int64)
        ii = int(a["ignore_index"]) if "ignore_index" in a else np.iinfo(np.int64).min
        red = _reduction(a)
        loss = fusedce.cross_entropy(rows, t, reduction=red, ignore_index=ii, class_weights=weights)
        loss = loss.reshape(labels.shape) if red == "none" else np.asarray(loss)
        logp = fusedce.temp_softmax(rows, probs=False, logprobs=True).logprobs
        logp = np.moveaxis(logp.reshape(labels.shape + (c,)), -1, 1)
        return [loss, logp]
    if v.op == "NegativeLogLikelihoodLoss":
        x, labels = inputs[0], inputs[1]
        weights = inputs[2] if len(inputs) > 2 else None
        rows, c = _rows_class_axis(x)
        t = labels.reshape(-1).astype(np.int64)
        ii = int(a["ignore_index"]) if "ignore_index" in a else np.iinfo(np.int64).min
        red = _reduction(a)
        kw = dict(ignore_index=ii, class_weights=weights)
        out = fusedce.cross_entropy_fwd(rows, t, reduction="none", lse=True, **kw)
        valid = t != ii
        w_t = np.zeros(len(t))
        w_t[valid] = 1.0 if weights is None else weights[t[valid]]
        wl = w_t * out.lse.astype(np.float64)
        if red == "none":
            return [(out.loss - wl).reshape(labels.shape)]
        lib_red = np.float64(fusedce.cross_entropy(rows, t, reduction=red, **kw))
        if red == "sum":
            return [np.asarray(lib_red - wl.sum())]
        return [np.asarray(lib_red - wl.sum() / w_t.sum())]
    if v.op in ("LogSoftmax", "Softmax"):
        x = inputs[0]
        if v.opset >= 13:
            axis = a.get("axis", -1) % x.ndim
            moved = np.moveaxis(x, axis, -1)
            rows = np.ascontiguousarray(moved.reshape(-1, x.shape[axis]))
        else:
            axis = a.get("axis", 1) % x.ndim
            rows = np.ascontiguousarray(x.reshape(int(np.prod(x.shape[:axis], dtype=np.int64)), -1))
        logp = v.op == "LogSoftmax"
        out = fusedce.temp_softmax(rows, probs=not logp, logprobs=logp)
        y = out.logprobs if logp else out.probs
        if v.opset >= 13:
            return [np.moveaxis(y.reshape(moved.shape), -1, axis)]
        return [y.reshape(x.shape)]
    if v.op == "ReduceLogSumExp":
        x = inputs[0]
        axes = a.get("axes")
        if axes is None and len(inputs) > 1 and inputs[1].size:
            axes = inputs[1].tolist()
        axes = sorted({int(ax) % x.ndim for ax in axes}) if axes else list(range(x.ndim))
        keep = [i for i in range(x.ndim) if i not in axes]
        rows = np.transpose(x, keep + axes).reshape(int(np.prod([x.shape[i] for i in keep], dtype=np.int64)), -1)
        y = fusedce.logsumexp(np.ascontiguousarray(rows, dtype=np.float32))
        y = y.reshape([x.shape[i] for i in keep])
        if a.get("keepdims", 1):
            y = y.reshape([1 if i in axes else x.shape[i] for i in range(x.ndim)])
        return [y]
    raise AssertionError(v.op)


def method(v):
    if v.op == "SoftmaxCrossEntropyLoss":
        return "cross_entropy_fwd (+ temp_softmax logprobs)"
    if v.op == "NegativeLogLikelihoodLoss":
        return "identity NLL = CE - w_t*lse (not direct)"
    if v.op in ("LogSoftmax", "Softmax"):
        return "temp_softmax T=1" + (" (opset %d: 2-D coercion)" % v.opset if v.opset < 13 else "")
    return "logsumexp (fp64 input rounded to fp32)"


def check(v):
    """Runs every data set of a vector; returns a list of failure strings."""
    fails = []
    for ds, ins, outs in v.data_sets():
        got = run(v, ins)
        for k, want in enumerate(outs):
            g = np.asarray(got[k], np.float64)
            if g.shape != want.shape:
                fails.append("%s output %d: shape %s, expected %s" % (ds, k, g.shape, want.shape))
                continue
            if not np.allclose(g, want, rtol=RTOL, atol=ATOL, equal_nan=True):
                err = np.max(np.abs(g - want))
                fails.append("%s output %d: max abs error %.3g" % (ds, k, err))
    return fails


def markdown():
    found, other = discover()
    lines = ["| vector | op (opset) | attributes | how | result |", "|---|---|---|---|---|"]
    for v in sorted(found, key=lambda v: (v.op, v.name)):
        attrs = ", ".join("%s=%s" % (k, val.decode() if isinstance(val, bytes) else val)
                          for k, val in sorted(v.attrs.items())) or "-"
        how = method(v) + ("; same data as %s" % v.via.split("/")[1] if v.via else "")
        res = ("pass" if v.op != "NegativeLogLikelihoodLoss" else "not direct; identity passes") \
            if not check(v) else "FAIL"
        lines.append("| `%s` | %s (%d) | %s | %s | %s |" % (v.name, v.op, v.opset, attrs, how, res))
    lines.append("")
    lines.append("| vector not applicable | why |")
    lines.append("|---|---|")
    for name, why in other:
        lines.append("| `%s` | %s |" % (name, why))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if "--markdown" in sys.argv:
        print(markdown())
    else:
        found, other = discover()
        bad = 0
        for v in found:
            f = check(v)
            bad += bool(f)
            print("%-70s %s" % (v.name, "pass" if not f else "FAIL " + "; ".join(f)))
        for name, why in other:
            print("%-70s n/a: %s" % (name, why))
        sys.exit(1 if bad else 0)
