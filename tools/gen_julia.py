#!/usr/bin/env python3
"""Generates the Julia binding's low-level module from the public header, with libclang.

    tools/gen_julia.py           writes bindings/julia/FusedCE.jl/src/LibFusedCE.jl
    tools/gen_julia.py --check   regenerates in memory, prints a diff and exits 1 on any difference

Reads include/fusedce/fusedce.h (and the DLPack header it includes) with libclang's Python bindings:
Debian's `python3-clang` (pure Python over libclang-N.so; any python3 works, its dist-packages folder is
added to sys.path when needed) or PyPI's `libclang` wheel. Emits, in header order and in the style of
Clang.jl's output (CUDA.jl's lib/cublas/libcublas.jl):
  - enums as integer type aliases plus one constant per value (never Julia enums: an unknown status
    from a newer library must stay representable);
  - structs with identical layout, checked at load time against libclang's sizes and field offsets;
  - opaque handle/stream types as `Ptr` to empty mutable structs;
  - `@ccall` wrappers for every function, calling through function pointers resolved by
    `load_library!` (Julia 1.5's ccall cannot take a library path known only at run time);
  - the integer and floating macros (a C float literal `1e-4f` becomes the Julia Float32 `1.0f-4`) and
    the `*_INIT` initializer macros (as constant struct values: the header's defaults; the Julia layer
    takes its defaults from the loaded library's `fce_*_init` functions).
Works with Julia 1.5 (the oldest syntax used is `var"..."`, 1.3).
"""
import argparse
import difflib
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = os.path.join(ROOT, "include", "fusedce", "fusedce.h")
OUTPUT = os.path.join(ROOT, "bindings", "julia", "FusedCE.jl", "src", "LibFusedCE.jl")


def import_cindex():
    try:
        import clang.cindex as ci
    except ImportError:
        # Debian's python3-clang lives in the system interpreter's dist-packages; it is pure Python.
        sys.path.append("/usr/lib/python3/dist-packages")
        try:
            import clang.cindex as ci
        except ImportError:
            sys.exit("gen_julia.py: libclang's Python bindings are missing: apt install python3-clang "
                     "(tools/deps.d/julia.sh) or pip install libclang")
    if os.environ.get("LIBCLANG_PATH"):
        ci.Config.set_library_file(os.environ["LIBCLANG_PATH"])
    return ci


ci = import_cindex()
K = ci.CursorKind
T = ci.TypeKind

JULIA_KEYWORDS = {
    "baremodule", "begin", "break", "catch", "const", "continue", "do", "else", "elseif", "end", "export",
    "false", "finally", "for", "function", "global", "if", "import", "let", "local", "macro", "module",
    "quote", "return", "struct", "true", "try", "using", "while", "abstract", "primitive", "mutable",
    "type", "where", "in", "isa",
}

STD_TYPEDEFS = {
    "int8_t": "Int8", "int16_t": "Int16", "int32_t": "Int32", "int64_t": "Int64",
    "uint8_t": "UInt8", "uint16_t": "UInt16", "uint32_t": "UInt32", "uint64_t": "UInt64",
    "size_t": "Csize_t", "ptrdiff_t": "Cptrdiff_t", "intptr_t": "Cintptr_t", "uintptr_t": "Cuintptr_t",
}

BUILTINS = {
    T.VOID: "Cvoid", T.BOOL: "Bool", T.CHAR_S: "Cchar", T.SCHAR: "Cchar", T.CHAR_U: "Cuchar",
    T.UCHAR: "Cuchar", T.SHORT: "Cshort", T.USHORT: "Cushort", T.INT: "Cint", T.UINT: "Cuint",
    T.LONG: "Clong", T.ULONG: "Culong", T.LONGLONG: "Clonglong", T.ULONGLONG: "Culonglong",
    T.FLOAT: "Cfloat", T.DOUBLE: "Cdouble",
}


def ident(name):
    return 'var"%s"' % name if name in JULIA_KEYWORDS else name


def clean_comment(raw):
    """Doxygen block or line comment -> plain text lines."""
    if not raw:
        return []
    text = raw.strip()
    lines = []
    for line in text.splitlines():
        line = line.strip()
        line = re.sub(r"^/\*[*!]?<?", "", line)
        line = re.sub(r"\*/$", "", line)
        line = re.sub(r"^//[/!]?<?", "", line)
        line = re.sub(r"^\*(?!/)", "", line)
        line = line.replace("\\brief ", "")
        lines.append(line.rstrip())
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    # common indentation
    indents = [len(l) - len(l.lstrip()) for l in lines if l.strip()]
    cut = min(indents) if indents else 0
    return [l[cut:] for l in lines]


def docstring(raw, indent=""):
    lines = clean_comment(raw)
    if not lines:
        return ""
    body = "\n".join(indent + l if l else "" for l in lines)
    body = body.replace("\\", "\\\\").replace("$", "\\$").replace('"""', '\\"\\"\\"')
    return '%s"""\n%s\n%s"""\n' % (indent, body, indent)


def comment_lines(raw, indent):
    return "".join("%s# %s\n" % (indent, l) if l else "%s#\n" % indent for l in clean_comment(raw))


class Generator:
    def __init__(self, header):
        self.header = header
        index = ci.Index.create()
        args = ["-x", "c", "-std=c99", "-fretain-comments-from-system-headers",
                "-I", os.path.join(ROOT, "include")]
        self.tu = index.parse(header, args=args,
                              options=ci.TranslationUnit.PARSE_DETAILED_PROCESSING_RECORD)
        errors = [d for d in self.tu.diagnostics if d.severity >= ci.Diagnostic.Error]
        if errors:
            sys.exit("gen_julia.py: libclang could not parse the header:\n" +
                     "\n".join(str(d) for d in errors))
        self.names = {}        # declaration USR/hash -> Julia name
        self.struct_types = {}  # Julia struct name -> [(field, julia type)]
        self.aliases = {}      # typedef name -> Julia name
        self.alias_targets = {}  # typedef name -> the Julia type it names
        self.functions = []
        self.dlpack_path = None
        self._unary = False
        self.typedef_comments = {}  # anonymous struct/enum hash -> its typedef's comment

    # -- files --------------------------------------------------------------------------------------
    def ours(self, cursor):
        f = cursor.location.file
        if f is None:
            return False
        name = os.path.realpath(f.name)
        if name == os.path.realpath(self.header):
            return True
        if name.endswith(os.path.join("dlpack", "dlpack.h")):
            self.dlpack_path = name
            return True
        return False

    # -- types --------------------------------------------------------------------------------------
    def decl_name(self, decl):
        key = decl.hash
        if key in self.names:
            return self.names[key]
        if decl.spelling:
            return decl.spelling
        raise RuntimeError("anonymous declaration without a typedef at %s" % decl.location)

    def jl(self, t, context="field"):
        k = t.kind
        if k in BUILTINS:
            return BUILTINS[k]
        if k == T.ELABORATED:
            return self.jl(t.get_named_type(), context)
        if k == T.TYPEDEF:
            name = t.get_declaration().spelling
            if name in STD_TYPEDEFS:
                return STD_TYPEDEFS[name]
            return self.aliases.get(name, name)
        if k in (T.RECORD, T.ENUM):
            return self.decl_name(t.get_declaration())
        if k == T.POINTER:
            p = t.get_pointee()
            pc = p.get_canonical()
            if pc.kind in (T.CHAR_S, T.SCHAR) and p.is_const_qualified() and context == "function":
                return "Cstring"
            if pc.kind in (T.FUNCTIONPROTO, T.FUNCTIONNOPROTO):
                return "Ptr{Cvoid}"
            return "Ptr{%s}" % self.jl(p, "pointee")
        if k == T.CONSTANTARRAY:
            return "NTuple{%d, %s}" % (t.element_count, self.jl(t.element_type))
        raise RuntimeError("unsupported type %s (%s)" % (t.spelling, k))

    # -- declarations -------------------------------------------------------------------------------
    def run(self):
        out = []
        top = list(self.tu.cursor.get_children())
        # Give anonymous structs/enums the name of the typedef that follows them.
        for i, c in enumerate(top):
            if c.kind == K.TYPEDEF_DECL and self.ours(c):
                u = c.underlying_typedef_type
                if u.kind == T.ELABORATED:
                    u = u.get_named_type()
                if u.kind in (T.RECORD, T.ENUM):
                    d = u.get_declaration()
                    if not d.spelling:
                        self.names[d.hash] = c.spelling
                        self.typedef_comments[d.hash] = c.raw_comment
        int_macros, init_cursors = [], []
        for c in top:
            if not self.ours(c):
                continue
            if c.kind == K.MACRO_DEFINITION:
                toks = [t.spelling for t in c.get_tokens()][1:]
                if toks and toks[0] == "{" and c.spelling.startswith("FCE_"):
                    init_cursors.append((c, toks))  # after the structs they build
                    continue
                m = self.macro(c)
                if m is not None:
                    int_macros.append(m)
            elif c.kind == K.ENUM_DECL:
                out.append(self.enum(c))
            elif c.kind == K.STRUCT_DECL:
                out.append(self.struct(c))
            elif c.kind == K.TYPEDEF_DECL:
                s = self.typedef(c)
                if s:
                    out.append(s)
            elif c.kind == K.FUNCTION_DECL:
                out.append(self.function(c))
        init_macros = [comment_lines(c.raw_comment, "") + self.init_macro(c.spelling, toks)
                       for c, toks in init_cursors]
        return int_macros, out, init_macros

    def enum(self, c):
        name = self.decl_name(c)
        base = self.jl(c.enum_type)
        s = docstring(c.raw_comment or self.typedef_comments.get(c.hash)) + "const %s = %s\n" % (name, base)
        for v in c.get_children():
            if v.kind == K.ENUM_CONSTANT_DECL:
                s += comment_lines(v.raw_comment, "")
                s += "const %s = %s(%d)\n" % (v.spelling, name, v.enum_value)
        return s

    def struct(self, c):
        name = self.decl_name(c)
        fields = [f for f in c.get_children() if f.kind == K.FIELD_DECL]
        if not c.is_definition():
            return "mutable struct %s end\n" % name
        s = docstring(c.raw_comment or self.typedef_comments.get(c.hash))
        s += "struct %s\n" % name
        typed = []
        for f in fields:
            jt = self.jl(f.type)
            typed.append((f.spelling, jt))
            s += comment_lines(f.raw_comment, "    ")
            s += "    %s::%s\n" % (ident(f.spelling), jt)
        s += "end\n"
        self.struct_types[name] = typed
        size = c.type.get_size()
        s += "@assert sizeof(%s) == %d\n" % (name, size)
        for i, f in enumerate(fields):
            s += "@assert fieldoffset(%s, %d) == %d\n" % (name, i + 1, c.type.get_offset(f.spelling) // 8)
        return s

    def typedef(self, c):
        u = c.underlying_typedef_type
        target = self.jl(u)
        if target == c.spelling:  # the anonymous struct/enum already carries this name
            return ""
        self.aliases[c.spelling] = c.spelling
        self.alias_targets[c.spelling] = target
        if u.kind == T.ELABORATED and u.get_named_type().kind in (T.RECORD, T.ENUM):
            doc = ""  # the struct/enum above carries the comment
        else:
            doc = docstring(c.raw_comment)
        return doc + "const %s = %s\n" % (c.spelling, target)

    def function(self, c):
        name = c.spelling
        ret = self.jl(c.result_type, "function")
        params = []
        for i, a in enumerate(c.get_arguments()):
            params.append((ident(a.spelling or "arg%d" % (i + 1)), self.jl(a.type, "function")))
        self.functions.append(name)
        sig = ", ".join(p for p, _ in params)
        typed = ", ".join("%s::%s" % (p, t) for p, t in params)
        s = docstring(c.raw_comment)
        s += "function %s(%s)\n" % (name, sig)
        s += "    @ccall $(_fptr_%s[])(%s)::%s\n" % (name, typed, ret)
        s += "end\n"
        return s

    # -- macros -------------------------------------------------------------------------------------
    def macro(self, c):
        toks = [t.spelling for t in c.get_tokens()][1:]
        name = c.spelling
        if not toks or name.endswith("_H_") or name in ("FCE_API",):
            return None
        if not (name.startswith("FCE_") or name == "DLPACK_VERSION"):
            return None
        if len(toks) >= 2 and toks[0] == "(" and name == toks[0]:
            return None
        expr = self.expr(toks)
        if expr is None:
            return None
        return comment_lines(c.raw_comment, "") + "const %s = %s\n" % (name, expr)

    # A C floating literal: digits with a point and/or an exponent ("0.5", "1.", ".5", "1e-4", "2.5E+3").
    FLOAT = r"((?:[0-9]+\.[0-9]*|\.[0-9]+|[0-9]+(?=[eE]))(?:[eE]([-+]?[0-9]+))?)"

    def literal(self, tok):
        m = re.fullmatch(self.FLOAT + r"[fF]", tok)
        if m:  # a float: Julia's Float32 literal is the mantissa, "f" and the exponent ("1e-4f" -> 1.0f-4)
            mant = re.split(r"[eE]", m.group(1))[0]
            mant = ("0" + mant if mant.startswith(".") else mant)
            mant = (mant + "0" if mant.endswith(".") else mant if "." in mant else mant + ".0")
            return "%sf%s" % (mant, m.group(2) or "0")
        m = re.fullmatch(r"([0-9]+)[uU]?[lL]*", tok)
        if m:
            return m.group(1)
        m = re.fullmatch(self.FLOAT, tok)
        if m:  # a double
            return tok
        return None

    def expr(self, toks):
        """C constant expression tokens -> Julia, handling casts `(type)x`, float suffixes and NULL."""
        out = []
        i = 0
        while i < len(toks):
            t = toks[i]
            if t == "(" and i + 2 < len(toks) and toks[i + 2] == ")" and toks[i + 1] in STD_TYPEDEFS:
                jt = STD_TYPEDEFS[toks[i + 1]]
                j = i + 3
                # the cast's operand: a call `f(...)`, a parenthesized group, or one token
                if j + 1 < len(toks) and toks[j + 1] == "(":
                    depth, k = 0, j + 1
                    while True:
                        depth += {"(": 1, ")": -1}.get(toks[k], 0)
                        if depth == 0:
                            break
                        k += 1
                    operand = self.expr(toks[j:k + 1])
                    i = k + 1
                else:
                    operand = self.expr([toks[j]])
                    i = j + 1
                out.append("%s(%s)" % (jt, operand))
                continue
            lit = self.literal(t)
            if lit is not None:
                out.append(lit)
            elif t == "NULL":
                out.append("C_NULL")
            elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", t):
                out.append(t)
            elif t in ("+", "-", "*", "/", "(", ")", ",", "<<", ">>", "|", "&"):
                out.append({"/": "÷"}.get(t, t))
            else:
                return None
            i += 1
        s, prev = "", None
        for t in out:
            unary_prev = prev in (None, "(", ",", "+", "-", "*", "÷")
            if prev is not None and not (
                    t in (")", ",") or prev == "(" or (prev == "-" and s.endswith("-") and self._unary)
                    or (t == "(" and re.search(r"[A-Za-z0-9_]$", s))):
                s += " "
            self._unary = t == "-" and unary_prev
            s += t
            prev = t
        return s

    def init_macro(self, name, toks):
        assert toks[0] == "{" and toks[-1] == "}", name
        inner = toks[1:-1]
        elems, cur, depth = [], [], 0
        for t in inner:
            if t == "," and depth == 0:
                elems.append(cur)
                cur = []
                continue
            depth += {"(": 1, ")": -1, "{": 1, "}": -1}.get(t, 0)
            cur.append(t)
        if cur:
            elems.append(cur)
        m = re.search(r"sizeof\s*\(\s*([A-Za-z_0-9]+)\s*\)", " ".join(elems[0]))
        if not m:
            raise RuntimeError("cannot tell the struct of %s" % name)
        struct = m.group(1)
        target = struct
        while target not in self.struct_types and target in self.alias_targets:
            target = self.alias_targets[target]
        fields = self.struct_types[target]
        if len(elems) > len(fields):
            raise RuntimeError("%s has more initializers than %s has fields" % (name, struct))
        args = [self.expr(e) for e in elems]
        for _, jt in fields[len(elems):]:  # C zero-initializes the fields an initializer list omits
            args.append("C_NULL" if jt.startswith("Ptr") or jt == "Cstring" else "zero(%s)" % jt)
        body = ",\n    ".join(args)
        return "const %s = %s(\n    %s)\n" % (name, struct, body)


def generate():
    g = Generator(HEADER)
    int_macros, decls, init_macros = g.run()
    dlpack_rel = "dlpack/dlpack.h"
    parts = []
    parts.append(
        "# LibFusedCE.jl: GENERATED by tools/gen_julia.py from include/fusedce/fusedce.h and %s.\n"
        "# Do not edit: change the header and run `tools/gen_julia.py` (CI runs `tools/gen_julia.py --check`).\n"
        "# Low-level bindings, one-to-one with the C header; the idiomatic API is in FusedCE.jl.\n"
        % dlpack_rel)
    parts.append("module LibFusedCE\n\nusing Libdl\n\nexport load_library!\n")
    parts.append("# ---- macros ----\n" + "".join(int_macros))
    parts.append("# ---- types and functions, in header order ----\n")
    parts.append("\n".join(decls))
    parts.append("# ---- initializer macros (the header's defaults) ----\n" + "\n".join(init_macros))
    ptrs = "".join("const _fptr_%s = Ref{Ptr{Cvoid}}(C_NULL)\n" % f for f in g.functions)
    loads = "".join("    _fptr_%s[] = Libdl.dlsym(lib, :%s)\n" % (f, f) for f in g.functions)
    parts.append(
        "# ---- symbol resolution ----\n" + ptrs + "\n"
        '"""\n    load_library!(lib::Ptr{Cvoid})\n\n'
        "Resolves every entry point from a library handle returned by `Libdl.dlopen`. Must run before any\n"
        "wrapper is called (FusedCE's `__init__` does it); throws if a symbol is missing.\n"
        '"""\n'
        "function load_library!(lib::Ptr{Cvoid})\n" + loads + "    return nothing\nend\n")
    parts.append("\"Every entry point of the header, in header order.\"\nconst FUNCTIONS = (\n%s)\n"
                 % "".join("    :%s,\n" % f for f in g.functions))
    parts.append("end # module LibFusedCE\n")
    text = "\n".join(parts)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the committed file differs")
    ap.add_argument("--output", default=OUTPUT)
    a = ap.parse_args()
    text = generate()
    if a.check:
        try:
            with open(a.output, encoding="utf-8") as f:
                old = f.read()
        except FileNotFoundError:
            old = ""
        if old != text:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                                       a.output + " (committed)", "regenerated"))
            print("gen_julia.py --check: %s is out of date; run tools/gen_julia.py" % a.output)
            return 1
        print("gen_julia.py --check: %s is up to date" % os.path.relpath(a.output, ROOT))
        return 0
    os.makedirs(os.path.dirname(a.output), exist_ok=True)
    with open(a.output, "w", encoding="utf-8") as f:
        f.write(text)
    print("wrote", os.path.relpath(a.output, ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
