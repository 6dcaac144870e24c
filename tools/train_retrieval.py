#!/usr/bin/python3
"""train_retrieval.py — makes data/kvq-retrieval.gguf, kvq's own model that retrieves.

A small Llama (GQA, RoPE, RMSNorm, SwiGLU; head_dim 64), from a seed, on
text the project generates: the retrieval tasks of `kvq-gen --task`
(needle, multikey, kv, mqar over generated filler), with several questions
after each context.  Its vocabulary is a SentencePiece-style one built from
that text (every word one piece, with byte fallback), so kvq's and
llama.cpp's tokenizers both read it.  Written as GGUF the way llama.cpp's
converter writes a Llama (float32 tensors, tied output embedding).

Two routes (data/README.md records both):
- --construct (the committed model): the retrieval circuit is written into
  the attention weights (construct_circuit: positional heads in layer 0,
  content matching and an induction head in layer 1, RoPE base 1e10), then
  layer 1's feed-forward is trained on the text, every token scored:

    python3 tools/train_retrieval.py --kvq-gen build/tools/kvq-gen --work build/train6 \\
        --out data/kvq-retrieval.gguf --seed 1 --construct --polish-steps 1500 --text-weight 1.0

- without it, gradient descent from random weights: a curriculum of kv and
  mqar context lengths, each level passed when held-out kv tasks of its
  length are answered exactly (--target), then every kind and length with
  the text scored (--polish-steps).  On 2 CPU cores it stayed at "answer
  with any listed value" (key matching appears suddenly and late).

Needs torch (Debian: python3-torch; with libopenblas-dev its BLAS is fast)
and numpy.  Resumable: --work DIR keeps the checkpoint and the log.
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


# ------------------------------------------------- the retrieval circuit

# The residual stream's rooms in the constructed model (dim 128): the token's
# code T (its first NM channels, the matching code m, are what attention
# compares), the previous token's m (A) and the one before's (B), a flag that
# only BOS sets, and a constant channel.
T0, NT = 0, 62
A0, B0, NM = 62, 93, 21
FLAG, CONST = 126, 127
M_SCALE, R_SCALE = 6.0, math.sqrt(28.0)  # |T| = 8 = the flag's and the constant's value: rms 1 in layer 0


def spread_codes(n, k, gen, steps=300):
    """n unit vectors in k dimensions pushed apart (a soft-max of their
    pairwise cosines minimised): the matching codes, so that two tokens'
    codes are as unlike as k dimensions allow."""
    x = torch.randn(n, k, generator=gen, dtype=torch.float64)
    x = x / x.norm(dim=1, keepdim=True)
    x.requires_grad_(True)
    opt = torch.optim.Adam([x], lr=0.01)
    for _ in range(steps):
        u = x / x.norm(dim=1, keepdim=True)
        c = u @ u.T - 2.0 * torch.eye(n, dtype=torch.float64)
        loss = torch.logsumexp(12.0 * c.flatten(), 0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        u = x / x.norm(dim=1, keepdim=True)
        c = u @ u.T - 2.0 * torch.eye(n, dtype=torch.float64)
        return u.detach(), float(c.max())


def positional_amplitudes(cfg, offsets, npair, margin):
    """Amplitudes a_i of the first npair rotary pairs such that a query
    rotated back by δ scores offset δ at least `margin` logits above every
    other offset up to the context (the score is Σ a_i² cos((Δ−δ)θ_i)/√hd)."""
    theta = cfg.theta ** (-2.0 * np.arange(npair) / cfg.head_dim)
    w = np.exp(-np.arange(npair) / 3.0)
    d = np.arange(0, cfg.ctx)
    gap = min(w.sum() - np.max(np.delete((w[None, :] * np.cos((d[:, None] - dl) * theta[None, :])).sum(1), dl))
              for dl in offsets)
    return np.sqrt(margin * math.sqrt(cfg.head_dim) / gap * w), theta, gap


def construct_circuit(model, pieces, seed):
    """Writes the retrieval circuit into a 2-layer model (dim 128, 2 query
    heads and 1 KV head of 64, RoPE base 1e10):
      layer 0: RoPE-only attention from the constant channel: query head 0
        looks one position back, head 1 two; the shared value is the token's
        matching code, written to A (head 0) and B (head 1);
      layer 1: content attention in the slow rotary pairs (11..30: at most
        0.4 radians over the context): head 0 matches its A (the previous
        token: "of KEY ?") against the keys' B (the token two back: "KEY :
        VALUE", "W is D"), head 1 its own code against the keys' A (the
        token one back: induction, "KEY VALUE" and a number's next digit);
        both fall back to BOS (flag against constant, the slowest pair) when
        nothing matches; the value is the attended token's code T, written
        back to T scaled by 4, so the output (tied embedding) names it.
    The feed-forward layers start at 0 (layer 1's is trained afterwards)."""
    cfg = model.cfg
    assert (cfg.dim, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.n_layers) == (128, 64, 2, 1, 2)
    gen = torch.Generator().manual_seed(seed)
    V = cfg.vocab
    m, cmax = spread_codes(V, NM, gen)
    r = torch.randn(V, NT - NM, generator=gen, dtype=torch.float64)
    r = r / r.norm(dim=1, keepdim=True)
    E = torch.zeros(V, cfg.dim, dtype=torch.float64)
    E[:, T0:T0 + NM] = M_SCALE * m
    E[:, T0 + NM:T0 + NT] = R_SCALE * r
    E[:, CONST] = 8.0
    E[1, :] = 0.0  # BOS: the flag and the constant only (no code: attending to it adds nothing)
    E[1, FLAG] = 8.0
    E[1, CONST] = 8.0
    hd = cfg.head_dim
    z = lambda *shape: torch.zeros(*shape, dtype=torch.float64)
    # layer 0: positional heads (x̂_CONST = 8 at every token)
    a, theta, gap = positional_amplitudes(cfg, (1, 2), 8, 14.0)
    wq0, wk0, wv0, wo0 = z(2 * hd, 128), z(hd, 128), z(hd, 128), z(128, 2 * hd)
    for i in range(8):
        wk0[2 * i, CONST] = a[i] / 8.0
        for h, dl in enumerate((1, 2)):
            wq0[h * hd + 2 * i, CONST] = a[i] * math.cos(theta[i] * dl) / 8.0
            wq0[h * hd + 2 * i + 1, CONST] = -a[i] * math.sin(theta[i] * dl) / 8.0
    for j in range(NM):
        wv0[j, T0 + j] = 1.0
        wo0[A0 + j, j] = 1.0           # head 0 (one back) -> A
        wo0[B0 + j, hd + j] = 1.0      # head 1 (two back) -> B
    # layer 1: after layer 0 |x|^2 = 128 + 2 * 36, rms 1.25
    rms1 = math.sqrt((128.0 + 72.0) / 128.0)
    cm = (M_SCALE / rms1) ** 2  # <x̂_A, x̂_B> of a matching pair
    s_true, s_sink = 48.0, 30.0
    gb = s_true * math.sqrt(hd) / cm  # γβ
    g = b = math.sqrt(gb)
    st = s_sink * math.sqrt(hd) / (8.0 * 8.0 / rms1)  # στ: the flag (8, rms 1 at BOS) against the constant
    sg = tg = math.sqrt(st)
    K1, K2, KS = 22, 43, 62  # head 0's content dims, head 1's (19 of the code), the sink pair
    n2 = 19
    wq1, wk1, wv1, wo1 = z(2 * hd, 128), z(hd, 128), z(hd, 128), z(128, 2 * hd)
    for j in range(NM):
        wk1[K1 + j, B0 + j] = b
        wq1[K1 + j, A0 + j] = g
    for j in range(n2):
        wk1[K2 + j, A0 + j] = b
        wq1[hd + K2 + j, T0 + j] = g * M_SCALE / M_SCALE  # the token's own code (same scale as A's copy)
    wk1[KS, FLAG] = sg
    wq1[KS, CONST] = tg
    wq1[hd + KS, CONST] = tg
    for j in range(NT):
        wv1[j, T0 + j] = 1.0
        wo1[T0 + j, j] = 4.0
        wo1[T0 + j, hd + j] = 4.0
    L0, L1 = model.layers
    with torch.no_grad():
        model.tok.copy_(E.float())
        model.norm.fill_(1.0)
        for L, (wq, wk, wv, wo) in ((L0, (wq0, wk0, wv0, wo0)), (L1, (wq1, wk1, wv1, wo1))):
            L.attn_norm.fill_(1.0)
            L.ffn_norm.fill_(1.0)
            L.wq.copy_(wq.float())
            L.wk.copy_(wk.float())
            L.wv.copy_(wv.float())
            L.wo.copy_(wo.float())
            L.w2.zero_()
        L0.w1.zero_()
        L0.w3.zero_()
    return {"code_max_cos": round(cmax, 3), "positional_gap": round(float(gap), 3)}


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
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--init-from", help="start from this GGUF's weights (one this script wrote), e.g. to train on")
    ap.add_argument("--text-weight", type=float, default=0.1,
                    help="loss weight of the non-answer tokens once every level is passed")
    ap.add_argument("--target", type=float, default=0.95,
                    help="held-out exact recall on kv tasks that passes a level of the curriculum")
    ap.add_argument("--polish-steps", type=int, default=3000,
                    help="steps on every kind and length, the text scored too, after the last level")
    ap.add_argument("--construct", action="store_true",
                    help="write the retrieval circuit into the weights (construct_circuit; RoPE base 1e10), "
                         "then train layer 1's feed-forward alone on the text (--polish-steps)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # denormals made a d=128 step 5x slower
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    os.makedirs(args.work, exist_ok=True)
    log_path = os.path.join(args.work, "log.jsonl")

    # the curriculum: levels of context length for kv and mqar, the answers alone scored;
    # a level is passed when held-out tasks of its length are answered exactly (--target),
    # its training draws half its batches at the level's length, half below.  Key matching
    # appears within a thousand steps on a few pairs; contexts too long too early, or the
    # text's loss, kept every earlier try at "answer with any listed value".
    levels = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 960)
    short = {"needle": tuple(n for n in levels if n >= 32), "multikey": tuple(n for n in levels if n >= 64),
             "kv": levels, "mqar": levels}
    # training tasks are drawn fresh for every batch (kvq-gen, the batch's own seed): from a fixed
    # set of 1,500 contexts per length the model learned the sets' pairs by heart instead of
    # looking them up (train 84 %, held-out 12 % at 4 pairs)
    def fresh_tasks(kind, L, count, seed):
        path = os.path.join(args.work, "batch.jsonl")
        if os.path.exists(path):
            os.remove(path)
        tasks = gen_tasks(args.kvq_gen, kind, count, L, seed, path)
        os.remove(path)
        return tasks

    held = {(kind, L): gen_tasks(args.kvq_gen, kind, 64, L, 999 + args.seed,
                                 os.path.join(args.work, "held-%s-%d.jsonl" % (kind, L)))
            for kind in KINDS for L in short[kind]}
    vocab_text = [fresh_tasks(kind, L, 300, 1000 * args.seed + 20 * ki + li)  # every word of the lists and grammar
                  for ki, kind in enumerate(KINDS) for li, L in enumerate((short[kind][0], 960))]
    texts = [t["context"] + " " + t["question"] + " " + t["answer"] for v in vocab_text for t in v]
    texts += [t["context"] + " " + t["question"] + " " + t["answer"] for v in held.values() for t in v]
    pieces = build_vocab(texts)
    if args.init_from:  # the model's own vocabulary
        pieces = read_gguf(args.init_from)[0]["tokenizer.ggml.tokens"][3 + 256:]
    tok = Tokenizer(pieces)
    cfg = Config(3 + 256 + len(pieces))
    cfg.n_layers = args.layers
    if args.construct:
        cfg.theta = 1e10  # 21 rotary pairs turn less than 0.4 radians over the context: room for content matching
    model = Model(cfg)
    gap = init_previous_token_heads(model) if args.previous_token_init else None
    if args.init_from:
        load_gguf_weights(model, args.init_from)
    params = list(model.parameters())
    if args.construct:
        gap = construct_circuit(model, pieces, args.seed)
        L1 = model.layers[-1]
        params = [L1.w1, L1.w3, L1.w2]  # the circuit stays as written; the feed-forward learns the text
        for p in model.parameters():
            p.requires_grad_(any(p is q for q in params))
        with torch.no_grad():  # a small start for the trained feed-forward (its output, w2, is 0)
            g = torch.Generator().manual_seed(args.seed)
            L1.w1.copy_(torch.randn(L1.w1.shape, generator=g) / math.sqrt(cfg.dim))
            L1.w3.copy_(torch.randn(L1.w3.shape, generator=g) / math.sqrt(cfg.dim))
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    cos, sin = rope_tables(cfg, cfg.ctx)
    ckpt = os.path.join(args.work, "ckpt.pt")
    step, elapsed, level, polish = 0, 0.0, (len(levels) if args.construct else 0), 0
    if os.path.exists(ckpt):
        st = torch.load(ckpt)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, elapsed, level, polish = st["step"], st["elapsed"], st["level"], st["polish"]
        rng.setstate(st["rng"])
        torch.set_rng_state(st["torch_rng"])
        print("resumed at step %d (%.1f min), level %d" % (step, elapsed / 60, level), flush=True)
    nparams = sum(p.numel() for p in model.parameters())
    print("vocab %d, parameters %d, trained %d; previous-token init gap / circuit %s" %
          (cfg.vocab, nparams, sum(p.numel() for p in params), gap), flush=True)

    def batch_menu():
        """(kind, context length, text weight) of the next batch."""
        if level < len(levels):
            kind = rng.choice(("kv", "kv", "mqar"))
            L = levels[level] if rng.random() < 0.5 or level == 0 else rng.choice(levels[:level])
            return kind, L, 0.0
        kind = rng.choices(KINDS, weights=(1, 1, 2, 1))[0]
        return kind, rng.choice(short[kind]), args.text_weight

    warmup = 200
    t0 = time.time() - elapsed
    while step < args.max_steps and time.time() - t0 < args.minutes * 60 and polish <= args.polish_steps:
        kind, L, tw = batch_menu()
        seqs = []
        ntok = 0
        batch = fresh_tasks(kind, L, max(1, args.batch_tokens // L), rng.randrange(1 << 30))
        while ntok < args.batch_tokens:
            t = batch[len(seqs) % len(batch)]
            ids, ans = task_sequence(tok, t, extra_questions(t, rng, 6))
            ids, ans = ids[:cfg.ctx], ans[:cfg.ctx]
            seqs.append((ids, ans))
            ntok += len(ids)
        T = max(len(s[0]) for s in seqs)
        ids = torch.zeros(len(seqs), T, dtype=torch.long)
        w = torch.zeros(len(seqs), T)
        for i, (a, m) in enumerate(seqs):
            ids[i, :len(a)] = torch.tensor(a)
            # predict token t+1 from t: the answers weigh 1, the other text tw, padding 0
            mt = torch.tensor(m[1:], dtype=torch.float)
            w[i, :len(a) - 1] = tw + (1.0 - tw) * mt
        # constant after the warm-up; the polish decays it (cosine) to a tenth
        lr = args.lr * min(1.0, (step + 1) / warmup)
        if level >= len(levels):
            lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(polish / max(args.polish_steps, 1), 1.0)))
            polish += 1
        for g in opt.param_groups:
            g["lr"] = lr
        logits = model(ids, cos, sin)
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab), ids[:, 1:].reshape(-1), reduction="none")
        wf = w[:, :-1].reshape(-1)
        loss = (nll * wf).sum() / wf.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        am = (wf > 0.99)
        if step % 20 == 0:
            print("step %d  %.1f min  level %d  L=%d %s  loss %.3f  answer nll %.3f  lr %.2e" %
                  (step, (time.time() - t0) / 60, level, L, kind, loss.item(),
                   (nll[am].mean().item() if am.any() else 0), lr), flush=True)
        if step % (200 if level >= len(levels) else 100) == 0:
            rec = {"step": step, "minutes": round((time.time() - t0) / 60, 2), "level": level,
                   "loss": round(loss.item(), 4)}
            if level < len(levels):  # the level's held-out tasks: passed?
                Ln = levels[level]
                ev = {f"{k}@{Ln}": exact_rate(model, tok, held[k, Ln][:32], cos, sin) for k in ("kv", "mqar")}
                if ev[f"kv@{Ln}"] >= args.target:  # the kv tasks gate (mqar, trained beside, learns later)
                    level += 1
            else:
                ev = {f"{k}@{n}": exact_rate(model, tok, held[k, n][:16], cos, sin)
                      for k in KINDS for n in (256, 768)}
            rec["exact"] = ev
            print(json.dumps(rec), flush=True)
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                        "elapsed": time.time() - t0, "level": level, "polish": polish,
                        "rng": rng.getstate(), "torch_rng": torch.get_rng_state()}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
            write_gguf(args.out, model, pieces, "kvq-retrieval")
    write_gguf(args.out, model, pieces, "kvq-retrieval")
    ev = {f"{k}@{n}": exact_rate(model, tok, held[k, n], cos, sin) for k in KINDS for n in (64, 256, 768)}
    print(json.dumps({"final_step": step, "minutes": round((time.time() - t0) / 60, 2), "exact": ev}), flush=True)


if __name__ == "__main__":
    main()
