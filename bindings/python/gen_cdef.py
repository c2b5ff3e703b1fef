#!/usr/bin/env python3
"""Generates fusedce/_generated.py (the cffi cdef and the header's constants) from the public header.

    python3 bindings/python/gen_cdef.py           rewrite bindings/python/fusedce/_generated.py
    python3 bindings/python/gen_cdef.py --check   regenerate in memory; print a diff and exit 1 if stale

The binding must not carry a hand-written copy of the declarations (it would drift), and cffi's parser
cannot read the header as is (preprocessor conditionals, `__attribute__`, macros that are expressions),
so this script preprocesses the header *text*:
  - comments are removed, `#if/#ifdef/#ifndef/#else/#endif` are evaluated with nothing predefined
    (so `__cplusplus` and `_WIN32` branches drop out), `#include` lines are dropped;
  - object-like macros are recorded; those used in declarations (FCE_API) are expanded and any
    `__attribute__((...))` removed;
  - the DLPack header the public header includes is processed the same way and put first.
The result is validated by cffi itself (FFI().cdef), and written with:
  CDEF    the declarations, for ffi.cdef() in ABI mode;
  MACROS  the integer and floating macros (FCE_VERSION_*, FCE_ABI_VERSION, FCE_WORKSPACE_ALIGNMENT,
          FCE_KD_TEMPERATURE_MIN/MAX, DLPACK_VERSION, ...), evaluated; a float literal with an `f`
          suffix is rounded to fp32 (the value C gives it: 1e-4f is 9.999999747378752e-05);
  VERSION "MAJOR.MINOR.PATCH" of the header (also the package version, pyproject.toml);
  INITS   each `*_INIT` initializer macro as {field: value} (enum names resolved). The Python API takes
          its defaults from the loaded library's fce_*_init functions; the tests check that they agree
          with these.
"""
import argparse
import ast
import difflib
import operator
import os
import re
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
HEADER = os.path.join(ROOT, "include", "fusedce", "fusedce.h")
OUTPUT = os.path.join(HERE, "fusedce", "_generated.py")
DLPACK_DIRS = [d for d in (os.environ.get("DLPACK_INCLUDE_DIR"), "/usr/include", "/usr/local/include") if d]


def strip_comments(text):
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("/*", i):
            j = text.index("*/", i + 2)
            out.append("\n" * text.count("\n", i, j))  # keep line numbers
            i = j + 2
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text[i] == '"':
            j = i + 1
            while text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def join_continuations(text):
    return re.sub(r"\\\n", " ", text)


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitOr: operator.or_,
           ast.BitAnd: operator.and_}


def eval_int(expr, macros):
    """Evaluates a C integer constant expression over known macros; None if it is not one."""
    expr = re.sub(r"\b(\d+)[uUlL]+\b", r"\1", expr.strip())
    expr = expr.replace("/", "//")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return None

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in macros and isinstance(macros[node.id], int):
                return macros[node.id]
            raise ValueError(node.id)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(ast.dump(node))

    try:
        return ev(tree)
    except (ValueError, TypeError):
        return None


_FLOAT = r"(?:\d+\.\d*|\.\d+|\d+(?=[eE]))(?:[eE][-+]?\d+)?"


def eval_float(expr):
    """A C floating literal, optionally negated; fp32-rounded with an `f` suffix. None if it is not one."""
    m = re.fullmatch(r"(-?)\s*(%s)([fF]?)" % _FLOAT, expr.strip())
    if not m:
        return None
    v = float(m.group(1) + m.group(2))
    return struct.unpack("<f", struct.pack("<f", v))[0] if m.group(3) else v


class Preprocessed:
    def __init__(self):
        self.macros = {}       # name -> replacement text (object-like macros)
        self.defined = set()
        self.order = []        # macro names in definition order

    def run(self, path):
        text = join_continuations(strip_comments(open(path, encoding="utf-8").read()))
        body = []
        stack = []  # each: [taking, any_branch_taken]
        for line in text.splitlines():
            s = line.strip()
            m = re.match(r"#\s*(\w+)\s*(.*)", s)
            active = all(t for t, _ in stack)
            if not m:
                if active:
                    body.append(line)
                continue
            d, rest = m.group(1), m.group(2).strip()
            if d in ("ifdef", "ifndef"):
                cond = (rest in self.defined) == (d == "ifdef")
                stack.append([cond, cond])
            elif d == "if":
                cond = self.condition(rest)
                stack.append([cond, cond])
            elif d == "elif":
                cond = not stack[-1][1] and self.condition(rest)
                stack[-1] = [cond, stack[-1][1] or cond]
            elif d == "else":
                stack[-1] = [not stack[-1][1], True]
            elif d == "endif":
                stack.pop()
            elif not active:
                continue
            elif d == "define":
                dm = re.match(r"(\w+)(\([^)]*\))?\s*(.*)", rest)
                name, params, value = dm.group(1), dm.group(2), dm.group(3).strip()
                self.defined.add(name)
                if params is None:
                    self.macros[name] = value
                    self.order.append(name)
            elif d == "undef":
                self.defined.discard(rest)
                self.macros.pop(rest, None)
            elif d in ("include", "pragma", "error", "warning", "line"):
                continue
            else:
                raise SystemExit("gen_cdef.py: unhandled directive #%s in %s" % (d, path))
        assert not stack, "unbalanced #if in %s" % path
        return "\n".join(body)

    def condition(self, expr):
        expr = re.sub(r"defined\s*\(\s*(\w+)\s*\)", lambda m: "1" if m.group(1) in self.defined else "0", expr)
        expr = re.sub(r"defined\s+(\w+)", lambda m: "1" if m.group(1) in self.defined else "0", expr)
        expr = expr.replace("&&", " and ").replace("||", " or ").replace("!", " not ")
        expr = re.sub(r"\b[A-Za-z_]\w*\b", lambda m: m.group(0) if m.group(0) in ("and", "or", "not") else
                      str(eval_int(self.macros.get(m.group(0), "0"), {}) or 0), expr)
        return bool(eval(expr, {"__builtins__": {}}))  # digits and boolean operators only


def remove_attributes(text):
    out, i = [], 0
    while True:
        j = text.find("__attribute__", i)
        if j < 0:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:j])
        k = text.index("(", j)
        depth = 0
        while True:
            depth += {"(": 1, ")": -1}.get(text[k], 0)
            k += 1
            if depth == 0:
                break
        while k < len(text) and text[k] in " \t":
            k += 1
        i = k


def declarations(pp, body):
    # expand the object-like macros that appear in declarations (FCE_API, DLPACK_DLL, ...)
    names = [n for n in pp.macros if re.search(r"\b%s\b" % n, body)]
    for n in names:
        body = re.sub(r"\b%s\b[ \t]*" % n, (pp.macros[n] + " ") if pp.macros[n] else "", body)
    body = remove_attributes(body)
    body = re.sub(r'extern\s+"C"\s*\{', "", body)
    return "\n".join(l.rstrip() for l in body.splitlines() if l.strip())


def find_dlpack():
    for d in DLPACK_DIRS:
        p = os.path.join(d, "dlpack", "dlpack.h")
        if os.path.exists(p):
            return p
    raise SystemExit("gen_cdef.py: dlpack/dlpack.h not found (libdlpack-dev; or set DLPACK_INCLUDE_DIR)")


def parse_init(value, macros, enums):
    v = value.strip()
    assert v.startswith("{") and v.endswith("}"), value
    items, depth, cur = [], 0, ""
    for ch in v[1:-1]:
        if ch == "," and depth == 0:
            items.append(cur.strip())
            cur = ""
            continue
        depth += {"(": 1, ")": -1, "{": 1, "}": -1}.get(ch, 0)
        cur += ch
    if cur.strip():
        items.append(cur.strip())
    struct = re.search(r"sizeof\s*\(\s*(\w+)\s*\)", items[0]).group(1)
    vals = []
    for it in items:
        if "sizeof" in it:
            vals.append("sizeof")
        elif it == "NULL":
            vals.append(None)
        elif eval_float(it) is not None:
            vals.append(eval_float(it))
        elif it in enums:
            vals.append(enums[it])
        else:
            iv = eval_int(it, macros)
            if iv is None:
                raise SystemExit("gen_cdef.py: cannot evaluate initializer item %r" % it)
            vals.append(iv)
    return struct, vals


def generate():
    import cffi

    dl_pp, pp = Preprocessed(), Preprocessed()
    dl_path = find_dlpack()
    dl_body = declarations(dl_pp, dl_pp.run(dl_path))
    fce_body = declarations(pp, pp.run(HEADER))
    cdef = dl_body + "\n" + fce_body + "\n"
    ffi = cffi.FFI()
    ffi.cdef(cdef)  # validates

    int_macros = {}
    for src in (dl_pp, pp):
        for name in src.order:
            v = eval_int(src.macros[name], int_macros)
            if v is None:
                v = eval_float(src.macros[name])
            if v is not None and (name.startswith("FCE_") or name.startswith("DLPACK_")):
                int_macros[name] = v
    enums = {}
    for tname in list(ffi.list_types()[0]):
        t = ffi.typeof(tname)
        if t.kind == "enum":
            enums.update(t.relements)
    inits = {}
    for name in pp.order:
        val = pp.macros[name]
        if name.endswith("_INIT") and val.startswith("{"):
            struct, vals = parse_init(val, int_macros, enums)
            fields = [f for f, _ in ffi.typeof(struct).fields]
            if len(vals) > len(fields):
                raise SystemExit("gen_cdef.py: %s has more values than %s has fields" % (name, struct))
            for f, ftype in ffi.typeof(struct).fields[len(vals):]:  # C zero-fills omitted fields
                vals.append(None if ftype.type.kind == "pointer" else 0)
            inits[name] = (struct, dict(zip(fields, vals)))

    def fmt_dict(d, indent):
        pad = " " * indent
        return "{\n" + "".join("%s    %r: %r,\n" % (pad, k, v) for k, v in d.items()) + pad + "}"

    out = []
    out.append("# GENERATED by bindings/python/gen_cdef.py from include/fusedce/fusedce.h and dlpack/dlpack.h.\n"
               "# Do not edit: change the header and run `python3 bindings/python/gen_cdef.py`\n"
               "# (the test suite runs it with --check).\n"
               '"""cffi declarations and constants of libfusedce, generated from its public header."""\n')
    out.append('CDEF = r"""\n%s"""\n' % cdef)
    out.append("MACROS = %s\n" % fmt_dict(int_macros, 0))
    out.append("VERSION = %r\n" % ("%d.%d.%d" % tuple(int_macros["FCE_VERSION_" + k] for k in ("MAJOR", "MINOR", "PATCH"))))
    out.append("INITS = {\n" + "".join("    %r: (%r, %s),\n" % (k, s, fmt_dict(d, 4)) for k, (s, d) in inits.items())
               + "}\n")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--output", default=OUTPUT)
    a = ap.parse_args()
    text = generate()
    if a.check:
        old = open(a.output, encoding="utf-8").read() if os.path.exists(a.output) else ""
        if old != text:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                                       a.output + " (committed)", "regenerated"))
            print("gen_cdef.py --check: %s is out of date; run python3 bindings/python/gen_cdef.py" % a.output)
            return 1
        print("gen_cdef.py --check: %s is up to date" % os.path.relpath(a.output, ROOT))
        return 0
    with open(a.output, "w", encoding="utf-8") as f:
        f.write(text)
    print("wrote", os.path.relpath(a.output, ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
