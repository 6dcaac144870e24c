#!/usr/bin/python3
"""train_retrieval.py — trains data/kvq-retrieval.gguf, kvq's own model that retrieves.

A small Llama (GQA, RoPE, RMSNorm, SwiGLU; head_dim 64) trained from a seed
on text the project generates: the retrieval tasks of `kvq-gen --task`
(needle, multikey, kv, mqar over generated filler), with several questions
after each context.  Its vocabulary is a SentencePiece-style one built from
that text (every word one piece, with byte fallback), so kvq's and
llama.cpp's tokenizers both read it.  Written as GGUF the way llama.cpp's
converter writes a Llama (float32 tensors, tied output embedding).

Key matching (the induction heads retrieval needs) appears suddenly and
late when a model starts on long contexts; on contexts of 4 to 12 pairs it
appears within about a thousand steps, so the first --short-steps steps
train on those (mostly kv and mqar, the loss on the answers), then every
length up to the context.  data/README.md records the command, the seed,
the time and the curve.  --previous-token-init starts layer 0's first head
as a previous-token head through RoPE (tried: it slowed the first plateau,
"answer with any listed value", about twofold, and is off by default).

    python3 tools/train_retrieval.py --kvq-gen build/tools/kvq-gen \\
        --out data/kvq-retrieval.gguf --seed 1 --minutes 60

Needs torch (Debian: python3-torch; with libopenblas0 its BLAS is fast) and
numpy.  Resumable: --work DIR keeps the data and checkpoints.
"""
import argparse
import json
import math
import os
import random
import re
import struct
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

KINDS = ("needle", "multikey", "kv", "mqar")


# ------------------------------------------------------------------ data

def gen_tasks(kvq_gen, kind, count, ctx_tokens, seed, path):
    if not os.path.exists(path):
        subprocess.run([kvq_gen, "--task", kind, "--count", str(count), "--context-tokens", str(ctx_tokens),
                        "--seed", str(seed), "--no-hash", "-o", path + ".tmp"], check=True)
        os.replace(path + ".tmp", path)
        try:
            os.remove(path + ".tmp.meta.json")
        except OSError:
            pass
    with open(path) as f:
        return [json.loads(line) for line in f]


FACT = re.compile(r"The special magic number for (\w+) is (\d+)\.")


def extra_questions(task, rng, k):
    """Up to k more (question, answer) pairs about the same context."""
    kind, ctx = task["task"], task["context"]
    if kind in ("needle", "multikey"):
        facts = FACT.findall(ctx)
        qa = [("What is the special magic number for %s?" % w, d) for w, d in facts]
    elif kind == "kv":
        pairs = re.findall(r"(\w+): (\w+)\.", ctx)
        qa = [("What is the value of %s?" % a, b) for a, b in pairs]
    else:
        w = ctx.split()
        qa = [(w[i], w[i + 1]) for i in range(0, len(w) - 1, 2)]
    qa = [p for p in qa if p[0] != task["question"]]  # never the task's own question again: a repeated
    rng.shuffle(qa)                                    # question is answered by copying the earlier answer
    return qa[:k]


# ------------------------------------------------------------- tokenizer

def build_vocab(texts):
    """SentencePiece-style pieces: <unk>, <s>, </s>, the 256 byte tokens,
    then every printable ASCII character, "▁" with each digit, and every
    prefix of "▁word" for the words of the text (prefix-closed, so the
    SentencePiece merges reach each whole word)."""
    words = set()
    for t in texts:
        words.update(re.findall(r"[A-Za-z]+", t))
    pieces = []
    seen = set()

    def add(p):
        if p not in seen:
            seen.add(p)
            pieces.append(p)
    for c in range(33, 127):
        add(chr(c))
    add("\u2581")
    for d in "0123456789":
        add("\u2581" + d)
    for w in sorted(words):
        s = "\u2581" + w
        for i in range(2, len(s) + 1):
            add(s[:i])
    return pieces


class Tokenizer:
    def __init__(self, pieces):
        self.pieces = pieces
        self.id = {p: 3 + 256 + i for i, p in enumerate(pieces)}

    def encode(self, text):
        """The part's tokens as llama.cpp's SentencePiece gives them for this
        vocabulary: a space prefix, spaces as "▁", and (pieces longer than
        one character all start with "▁") each chunk's longest prefix piece,
        then single characters, bytes for the rest."""
        s = "\u2581" + text.replace(" ", "\u2581")
        out = []
        i = 0
        while i < len(s):
            j = i + 1
            if s[i] == "\u2581":
                while j < len(s) and s[i:j + 1] in self.id:
                    j += 1
            p = s[i:j]
            if p in self.id:
                out.append(self.id[p])
            else:
                out.extend(3 + b for b in p.encode("utf-8"))
            i = j
        return out


# ------------------------------------------------------------------ model

class Config:
    def __init__(self, vocab):
        self.vocab = vocab
        self.dim = 128
        self.n_layers = 4
        self.n_heads = 2
        self.n_kv_heads = 1
        self.head_dim = 64
        self.ffn = 384
        self.ctx = 1024
        self.theta = 500000.0  # Llama 3's base: the slow pairs stay still over the context, free for matching
        self.eps = 1e-5


def rope_tables(cfg, T):
    i = torch.arange(cfg.head_dim // 2, dtype=torch.float64)
    theta = cfg.theta ** (-2.0 * i / cfg.head_dim)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * theta[None, :]
    return torch.cos(ang).float(), torch.sin(ang).float()


def rope(x, cos, sin):
    """llama.cpp's normal (interleaved) RoPE: pairs (2i, 2i+1) rotated by pos·θ_i.  x [B,H,T,D]."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    y0 = x0 * cos - x1 * sin
    y1 = x0 * sin + x1 * cos
    return torch.stack((y0, y1), dim=-1).flatten(-2)


def rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class Model(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.dim, cfg.head_dim
        P = torch.nn.Parameter
        self.tok = P(torch.randn(cfg.vocab, d) * 0.02)
        self.norm = P(torch.ones(d))
        self.layers = torch.nn.ModuleList()
        for _ in range(cfg.n_layers):
            L = torch.nn.Module()
            L.attn_norm = P(torch.ones(d))
            L.wq = P(torch.randn(cfg.n_heads * hd, d) / math.sqrt(d))
            L.wk = P(torch.randn(cfg.n_kv_heads * hd, d) / math.sqrt(d))
            L.wv = P(torch.randn(cfg.n_kv_heads * hd, d) / math.sqrt(d))
            L.wo = P(torch.randn(d, cfg.n_heads * hd) / math.sqrt(cfg.n_heads * hd) / math.sqrt(2 * cfg.n_layers))
            L.ffn_norm = P(torch.ones(d))
            L.w1 = P(torch.randn(cfg.ffn, d) / math.sqrt(d))
            L.w3 = P(torch.randn(cfg.ffn, d) / math.sqrt(d))
            L.w2 = P(torch.randn(d, cfg.ffn) / math.sqrt(cfg.ffn) / math.sqrt(2 * cfg.n_layers))
            self.layers.append(L)

    def forward(self, ids, cos, sin):
        cfg = self.cfg
        B, T = ids.shape
        H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        x = self.tok[ids]
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        c, s = cos[:T], sin[:T]
        for L in self.layers:
            h = rmsnorm(x, L.attn_norm, cfg.eps)
            q = (h @ L.wq.T).view(B, T, H, hd).transpose(1, 2)
            k = (h @ L.wk.T).view(B, T, KV, hd).transpose(1, 2)
            v = (h @ L.wv.T).view(B, T, KV, hd).transpose(1, 2)
            q, k = rope(q, c, s), rope(k, c, s)
            k = k.repeat_interleave(H // KV, dim=1)
            v = v.repeat_interleave(H // KV, dim=1)
            att = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
            att = att.masked_fill(mask, float("-inf")).softmax(-1)
            a = (att @ v).transpose(1, 2).reshape(B, T, H * hd)
            x = x + a @ L.wo.T
            h = rmsnorm(x, L.ffn_norm, cfg.eps)
            x = x + (F.silu(h @ L.w1.T) * (h @ L.w3.T)) @ L.w2.T
        return rmsnorm(x, self.norm, cfg.eps) @ self.tok.T


def init_previous_token_heads(model, offsets=(1,), npair=8):
    """Layer 0's first heads attend to the given offsets (head h to offset
    offsets[h]).  Channel 0 of every token embedding is a constant (the rows
    rescaled to one norm), so after RMSNorm it is the same for every token;
    the shared key's first `npair` rotary pairs are that channel times a_i on
    the pair's first element, head h's query the same rotated back by δ_h
    positions, so q·k = Σ a_i² cos((m − n − δ_h)θ_i) peaks at n = m − δ_h.
    The key's other pairs and the other heads keep their random start (a
    layer 0 without a content head learned to copy far more slowly)."""
    cfg = model.cfg
    d, hd = cfg.dim, cfg.head_dim
    with torch.no_grad():
        E = model.tok
        scale = float(E[:, 1:].norm(dim=1).mean())  # keep the embedding's scale (RMSNorm does not see it)
        E[:, 0] = 0
        E.mul_(scale / E.norm(dim=1, keepdim=True))  # rows of one norm in channels 1..d-1
        E[:, 0] = scale                              # then x̂_0 = sqrt(d / 2) after RMSNorm
        xhat0 = math.sqrt(d / 2.0)
        L = model.layers[0]
        theta = cfg.theta ** (-2.0 * np.arange(npair) / hd)
        w = np.exp(-np.arange(npair) / 4.0)  # the fast pairs tell neighbours apart
        # scale so that the target beats every other offset up to the context by 12 (logits)
        deltas = np.arange(0, cfg.ctx)
        gap = min((w * np.cos((0) * theta)).sum() - np.max(np.delete(
            (w[None, :] * np.cos((deltas[:, None] - dl) * theta[None, :])).sum(1), dl)) for dl in offsets)
        a = np.sqrt(12.0 * math.sqrt(hd) / gap * w)  # a_i² = amplitude · w_i
        L.wk[:2 * npair, :] = 0
        L.wk[:, 0] = 0
        for i in range(npair):
            L.wk[2 * i, 0] = float(a[i]) / xhat0
        for h in range(len(offsets), cfg.n_heads):  # the other heads: blind to the positional pairs
            L.wq[h * hd:h * hd + 2 * npair, :] = 0
        for h, dl in enumerate(offsets):
            L.wq[h * hd:(h + 1) * hd, :] = 0
            for i in range(npair):
                L.wq[h * hd + 2 * i, 0] = float(a[i] * math.cos(theta[i] * dl)) / xhat0
                L.wq[h * hd + 2 * i + 1, 0] = float(-a[i] * math.sin(theta[i] * dl)) / xhat0
        return gap


# ------------------------------------------------------------------ GGUF

def write_gguf(path, model, pieces, name):
    cfg = model.cfg
    kv = []

    def s(x):
        b = x.encode("utf-8")
        return struct.pack("<Q", len(b)) + b
    def add(key, typ, payload):
        kv.append(s(key) + struct.pack("<I", typ) + payload)
    u32 = lambda k, v: add(k, 4, struct.pack("<I", v))
    f32 = lambda k, v: add(k, 6, struct.pack("<f", v))
    st = lambda k, v: add(k, 8, s(v))
    bl = lambda k, v: add(k, 7, struct.pack("<B", 1 if v else 0))
    st("general.architecture", "llama")
    st("general.name", name)
    u32("general.file_type", 0)
    u32("llama.context_length", cfg.ctx)
    u32("llama.embedding_length", cfg.dim)
    u32("llama.block_count", cfg.n_layers)
    u32("llama.feed_forward_length", cfg.ffn)
    u32("llama.rope.dimension_count", cfg.head_dim)
    u32("llama.attention.head_count", cfg.n_heads)
    u32("llama.attention.head_count_kv", cfg.n_kv_heads)
    f32("llama.attention.layer_norm_rms_epsilon", cfg.eps)
    f32("llama.rope.freq_base", cfg.theta)
    u32("llama.vocab_size", cfg.vocab)
    st("tokenizer.ggml.model", "llama")
    toks = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)] + pieces
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    add("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, len(toks)) + b"".join(s(t) for t in toks))
    add("tokenizer.ggml.scores", 9, struct.pack("<IQ", 6, len(toks)) + struct.pack("<%df" % len(toks), *scores))
    add("tokenizer.ggml.token_type", 9, struct.pack("<IQ", 5, len(toks)) + struct.pack("<%di" % len(toks), *types))
    u32("tokenizer.ggml.bos_token_id", 1)
    u32("tokenizer.ggml.eos_token_id", 2)
    u32("tokenizer.ggml.unknown_token_id", 0)
    bl("tokenizer.ggml.add_bos_token", True)
    bl("tokenizer.ggml.add_eos_token", False)
    tensors = [("token_embd.weight", model.tok)]
    for i, L in enumerate(model.layers):
        tensors += [("blk.%d.attn_norm.weight" % i, L.attn_norm), ("blk.%d.attn_q.weight" % i, L.wq),
                    ("blk.%d.attn_k.weight" % i, L.wk), ("blk.%d.attn_v.weight" % i, L.wv),
                    ("blk.%d.attn_output.weight" % i, L.wo), ("blk.%d.ffn_norm.weight" % i, L.ffn_norm),
                    ("blk.%d.ffn_gate.weight" % i, L.w1), ("blk.%d.ffn_up.weight" % i, L.w3),
                    ("blk.%d.ffn_down.weight" % i, L.w2)]
    tensors.append(("output_norm.weight", model.norm))
    info, data, off = [], [], 0
    for n, t in tensors:
        a = t.detach().float().contiguous().numpy().astype("<f4")
        ne = list(reversed(a.shape))
        info.append(s(n) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", e) for e in ne) +
                    struct.pack("<IQ", 0, off))
        b = a.tobytes()
        pad = (-len(b)) % 32
        data.append(b + b"\0" * pad)
        off += len(b) + pad
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)) + b"".join(kv) + b"".join(info)
    head += b"\0" * ((-len(head)) % 32)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(head)
        for b in data:
            f.write(b)
    os.replace(tmp, path)


def read_gguf(path):
    """(metadata, {tensor name: float32 numpy array}) of a GGUF file this script wrote."""
    data = open(path, "rb").read()
    if data[:4] != b"GGUF":
        raise SystemExit(f"{path}: not a GGUF file")
    _, nt, nkv = struct.unpack_from("<IQQ", data, 4)
    o = 24

    def string(o):
        (n,) = struct.unpack_from("<Q", data, o)
        return data[o + 8:o + 8 + n].decode("utf-8"), o + 8 + n

    sizes = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}

    def value(t, o):
        if t == 8:
            return string(o)
        if t == 9:
            at, n = struct.unpack_from("<IQ", data, o)
            o += 12
            out = []
            for _ in range(n):
                v, o = value(at, o)
                out.append(v)
            return out, o
        v = struct.unpack_from("<" + sizes[t], data, o)[0]
        return v, o + struct.calcsize(sizes[t])
    meta = {}
    for _ in range(nkv):
        k, o = string(o)
        (t,) = struct.unpack_from("<I", data, o)
        meta[k], o = value(t, o + 4)
    info = []
    for _ in range(nt):
        name, o = string(o)
        (nd,) = struct.unpack_from("<I", data, o)
        ne = struct.unpack_from("<%dQ" % nd, data, o + 4)
        typ, off = struct.unpack_from("<IQ", data, o + 4 + 8 * nd)
        o += 4 + 8 * nd + 12
        info.append((name, ne, typ, off))
    base = o + (-o) % meta.get("general.alignment", 32)
    tensors = {}
    for name, ne, typ, off in info:
        if typ != 0:
            raise SystemExit(f"{path}: {name}: type {typ}, expected float32")
        n = int(np.prod(ne))
        tensors[name] = np.frombuffer(data, "<f4", n, base + off).reshape(tuple(reversed(ne))).copy()
    return meta, tensors


def load_gguf_weights(model, path):
    """The weights of a GGUF file this script wrote (data/kvq-retrieval.gguf) into model: to go on training it."""
    _, t = read_gguf(path)
    names = {"token_embd.weight": model.tok, "output_norm.weight": model.norm}
    for i, L in enumerate(model.layers):
        for gg, p in (("attn_norm", L.attn_norm), ("attn_q", L.wq), ("attn_k", L.wk), ("attn_v", L.wv),
                      ("attn_output", L.wo), ("ffn_norm", L.ffn_norm), ("ffn_gate", L.w1), ("ffn_up", L.w3),
                      ("ffn_down", L.w2)):
            names["blk.%d.%s.weight" % (i, gg)] = p
    with torch.no_grad():
        for n, p in names.items():
            if n not in t or tuple(t[n].shape) != tuple(p.shape):
                raise SystemExit(f"{path}: {n}: absent or not of shape {tuple(p.shape)}")
            p.copy_(torch.from_numpy(t[n]))


# --------------------------------------------------------------- training

def task_sequence(tok, task, extra, bos=1):
    """BOS + context + (question + answer)...; weights: answer tokens 1, the rest 0 (mask)."""
    ids = [bos] + tok.encode(task["context"])
    ans = [0] * len(ids)
    for q, a in [(task["question"], task["answer"])] + extra:
        qi, ai = tok.encode(q), tok.encode(a)
        ids += qi
        ans += [0] * len(qi)
        ids += ai
        ans += [1] * len(ai)
    return ids, ans


@torch.no_grad()
def exact_rate(model, tok, tasks, cos, sin):
    """Fraction of tasks whose every answer token is the arg-max (teacher forced), as kvq-eval scores."""
    model.eval()
    hits = 0
    for t in tasks:
        p = [1] + tok.encode(t["context"]) + tok.encode(t["question"])
        a = tok.encode(t["answer"])
        ids = torch.tensor([p + a])
        logits = model(ids, cos, sin)[0]
        pred = logits[len(p) - 1:len(p) - 1 + len(a)].argmax(-1).tolist()
        hits += pred == a
    model.train()
    return hits / len(tasks)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvq-gen", default="build/tools/kvq-gen")
    ap.add_argument("--out", default="data/kvq-retrieval.gguf")
    ap.add_argument("--work", default="build/train-retrieval")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--minutes", type=float, default=60.0, help="training time budget (wall clock)")
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--previous-token-init", action="store_true",
                    help="start layer 0's first head as a previous-token head (slowed the first plateau)")
    ap.add_argument("--first-steps", type=int, default=1000, help="steps on 4 to 8 pairs (kv, mqar) only")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--init-from", help="start from this GGUF's weights (one this script wrote), e.g. to train on; "
                                        "the step count and the curriculum start from --start-step")
    ap.add_argument("--start-step", type=int, default=0)
    ap.add_argument("--language", action="store_true",
                    help="train on every kind and length with every token weighing 1 (the text as a language model)")
    ap.add_argument("--short-only", action="store_true",
                    help="train on kv and mqar of 16 to 64 context tokens only (what a CPU session reached)")
    ap.add_argument("--text-weight", type=float, default=0.05, help="loss weight of the non-answer tokens at the end")
    ap.add_argument("--target", type=float, default=0.98, help="stop once kv and mqar exact reach this at 256 and 768")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # denormals made a d=128 step 5x slower
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    os.makedirs(args.work, exist_ok=True)
    log_path = os.path.join(args.work, "log.jsonl")

    # training tasks: every kind at several context lengths, from seeds of their own;
    # the short ones (a few pairs) first, where the matching key stands out most
    short = {"needle": (32, 48), "multikey": (64,), "kv": (16, 24, 32, 48), "mqar": (16, 24, 32, 48)}
    lengths = (64, 128, 192, 384, 768, 960)
    # the curriculum: (until step, {kind: context lengths}, weight of the non-answer tokens);
    # key matching appears on 4 to 8 pairs, and the text's loss, let in too early, undid it
    stages = [(args.first_steps, {"kv": (16, 24), "mqar": (16,)}, 0.0),
              (args.first_steps + 1500, {"kv": (16, 24, 32, 48), "mqar": (16, 24, 32)}, 0.0),
              (args.first_steps + 3000, {"kv": (32, 48, 64, 128), "mqar": (32, 48, 64), "needle": (32, 48, 64),
                                         "multikey": (64,)}, args.text_weight / 4),
              (1 << 30, {k: lengths for k in KINDS}, args.text_weight)]
    if args.language:  # every kind and length, every token scored alike: the language model
        stages = [(1 << 30, {k: lengths for k in KINDS}, 1.0)]
    if args.short_only:  # from here on the pairs of short contexts alone, the answers alone scored
        stages = [(1 << 30, {"kv": (16, 24, 32, 48, 64), "mqar": (16, 24, 32, 48, 64)}, 0.0)]
    count = 1500
    train = {}
    for ki, kind in enumerate(KINDS):
        for li, L in enumerate(sorted(set(short[kind] + lengths))):
            seed = 1000 * args.seed + 10 * ki + li
            train[kind, L] = gen_tasks(args.kvq_gen, kind, count, L, seed,
                                       os.path.join(args.work, "train-%s-%d.jsonl" % (kind, L)))
    held = {(kind, L): gen_tasks(args.kvq_gen, kind, 64, L, 999 + args.seed,
                                 os.path.join(args.work, "held-%s-%d.jsonl" % (kind, L)))
            for kind in KINDS for L in (64, 256, 768)}
    texts = [t["context"] + " " + t["question"] + " " + t["answer"] for v in train.values() for t in v]
    texts += [t["context"] + " " + t["question"] + " " + t["answer"] for v in held.values() for t in v]
    pieces = build_vocab(texts)
    if args.init_from:  # the model's own vocabulary
        pieces = read_gguf(args.init_from)[0]["tokenizer.ggml.tokens"][3 + 256:]
    tok = Tokenizer(pieces)
    cfg = Config(3 + 256 + len(pieces))
    cfg.n_layers = args.layers
    model = Model(cfg)
    gap = init_previous_token_heads(model) if args.previous_token_init else None
    if args.init_from:
        load_gguf_weights(model, args.init_from)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    cos, sin = rope_tables(cfg, cfg.ctx)
    ckpt = os.path.join(args.work, "ckpt.pt")
    step, elapsed = args.start_step, 0.0
    if os.path.exists(ckpt):
        st = torch.load(ckpt)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, elapsed = st["step"], st["elapsed"]
        rng.setstate(st["rng"])
        torch.set_rng_state(st["torch_rng"])
        print("resumed at step %d (%.1f min)" % (step, elapsed / 60), flush=True)
    nparams = sum(p.numel() for p in model.parameters())
    print("vocab %d, parameters %d, previous-token init gap %s" % (cfg.vocab, nparams, gap), flush=True)

    warmup = 200
    t0 = time.time() - elapsed
    tokens_seen = 0
    while step < args.max_steps and time.time() - t0 < args.minutes * 60:
        # a curriculum: short contexts first, then all lengths
        frac = (time.time() - t0) / (args.minutes * 60)
        _, menu, tw = next(st for st in stages if step < st[0])
        kinds = sorted(menu)
        kind = rng.choices(kinds, weights=[2 if k == "kv" else 1 for k in kinds])[0]
        L = rng.choice(menu[kind])
        seqs = []
        ntok = 0
        while ntok < args.batch_tokens:
            t = rng.choice(train[kind, L])
            ids, ans = task_sequence(tok, t, extra_questions(t, rng, 6))
            ids, ans = ids[:cfg.ctx], ans[:cfg.ctx]
            seqs.append((ids, ans))
            ntok += len(ids)
        T = max(len(s[0]) for s in seqs)
        ids = torch.zeros(len(seqs), T, dtype=torch.long)
        w = torch.zeros(len(seqs), T)
        for i, (a, m) in enumerate(seqs):
            ids[i, :len(a)] = torch.tensor(a)
            # predict token t+1 from t: the answers weigh 1, the other text --text-weight, padding 0
            mt = torch.tensor(m[1:], dtype=torch.float)
            w[i, :len(a) - 1] = tw + (1.0 - tw) * mt
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        logits = model(ids, cos, sin)
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab), ids[:, 1:].reshape(-1), reduction="none")
        wf = w[:, :-1].reshape(-1)
        loss = (nll * wf).sum() / wf.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += int(ntok)
        am = (wf > 0.99)
        if step % 20 == 0:
            print("step %d  %.1f min  L=%d %s  loss %.3f  answer nll %.3f  lr %.2e" %
                  (step, (time.time() - t0) / 60, L, kind, loss.item(), (nll[am].mean().item() if am.any() else 0), lr),
                  flush=True)
        if step % 200 == 0:
            ev = {f"{k}@{n}": exact_rate(model, tok, held[k, n][:32], cos, sin) for (k, n) in held}
            rec = {"step": step, "minutes": round((time.time() - t0) / 60, 2), "loss": round(loss.item(), 4),
                   "exact": ev}
            print(json.dumps(rec), flush=True)
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                        "elapsed": time.time() - t0, "rng": rng.getstate(), "torch_rng": torch.get_rng_state()},
                       ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
            write_gguf(args.out, model, pieces, "kvq-retrieval")
            if min(ev["kv@256"], ev["kv@768"], ev["mqar@256"]) >= args.target and step >= 1000:
                break
    write_gguf(args.out, model, pieces, "kvq-retrieval")
    ev = {f"{k}@{n}": exact_rate(model, tok, held[k, n], cos, sin) for (k, n) in held}
    print(json.dumps({"final_step": step, "minutes": round((time.time() - t0) / 60, 2), "exact": ev}), flush=True)


if __name__ == "__main__":
    main()
