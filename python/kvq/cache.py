"""cache.py — kvq.DecodeCache: a KV cache that holds the exact keys and
values a model has produced and hands back, after each step, the
reconstruction of the whole cache under a quantizer — the cache as
generation sees it (kvq-eval --policy decode, docs/models.md#kvq-eval) —
or, for a tokens(...) whose selector has target=S,interval=I, the cache
compressed while decoding (docs/models.md#compress-while-generating)."""
import ctypes
import math
import threading

import numpy as np

from . import _lib
from ._arrays import as_f32, fptr
from ._lib import Error
from .quant import _check_int, _check_seed, _check_threads, calibration, quantize, selectors, spec_full


def _press_of(full):
    """The decode-time keys of a tokens(...) spec's selector (None when it has no target=)."""
    if not full.startswith("tokens("):
        return None
    sel, hi, lo = (p.strip() for p in full[len("tokens("):-1].split(";"))
    name, _, keys = sel.partition(":")
    kv = dict(item.split("=", 1) for item in keys.split(",") if item)
    if "target" not in kv:
        return None
    interval = int(kv["interval"])
    needs = {d["name"]: d["needs_queries"] for d in selectors()}[name]
    return dict(name=name, hi=hi, lo=lo, target=int(kv["target"]), interval=interval,
                buffer=min(int(kv.get("buffer", interval)), interval), needs_queries=needs,
                once=("keep" in kv) or (name == "window" and int(kv.get("recent", "0")) > 0))


class _Press:
    """One sequence's cache of one layer compressed while decoding (SPEC §3.11):
    the exact entries, which are held at HI, which are held at all, LO's
    values of those that left HI, and the queries of the last decoded rows."""

    def __init__(self, cache, layer, k, v, q):
        self.c, self.layer, self.p = cache, layer, cache._press
        H, t, D = k.shape
        self.k, self.v = k.copy(), v.copy()
        self.hi, self.held = np.ones((H, t), bool), np.ones((H, t), bool)
        self.lk, self.lv = np.zeros_like(self.k), np.zeros_like(self.v)
        self.lo_bits = [0.0, 0.0]
        self.q = None if q is None else q[:, -self.p["interval"]:].copy()
        self.steps, self.pending = 0, False
        self._hi = None  # _hi_values() until the tokens at HI change
        if t > 1:  # a prefill: the context, compressed once by keep= (PrefillDecodingPress)
            if self.p["once"]:
                self._compress(0, q, t)
        else:
            self.steps, self.pending = 1, self.p["interval"] == 1

    def _select(self, keys, q, target, qrow0):
        H, n, D = keys.shape
        keep = np.empty((H, n), np.uint8)
        keys = np.ascontiguousarray(keys, np.float32)
        q = None if q is None else np.ascontiguousarray(q, np.float32)
        opts = _lib.ArraysOpts(spec=self.c._spec_b, layer=self.layer, seed=self.c.seed, nthreads=self.c.threads,
                               query=fptr(q), num_heads=q.shape[0] if q is not None else 0)
        err = _lib.new_error()
        st = _lib.lib().kvq_select_arrays(ctypes.byref(opts), H, n, D, fptr(keys), target, qrow0,
                                          keep.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte)), ctypes.byref(err))
        _lib.check(st, err)
        return keep.astype(bool)

    def _hi_values(self):
        """The tokens held at HI as HI stores them (a layer of their own, in position order); kept until
        they change, so that a compression reuses what the last update returned."""
        if self._hi is None:
            self._hi = self._store_hi()
        return self._hi

    def _store_hi(self):
        k, v = self.k.copy(), self.v.copy()
        H, n = self.hi.shape[0], int(self.hi[0].sum())
        if self.p["hi"] == "none" or n == 0:
            return k, v, 16.0 * n * H * k.shape[2], 16.0 * n * H * k.shape[2]
        kc, vc = self.k[self.hi].reshape(H, n, -1), self.v[self.hi].reshape(H, n, -1)
        r = quantize(self.p["hi"], kc, vc, layer=self.layer, calib=self.c.calib, seed=self.c.seed,
                     threads=self.c.threads)
        k[self.hi], v[self.hi] = r.key.reshape(-1, k.shape[2]), r.value.reshape(-1, k.shape[2])
        return k, v, r.k_bits * H * n * k.shape[2], r.v_bits * H * n * k.shape[2]

    def _compress(self, target, q, nq):
        """Keeps `target` (0: keep= of the whole cache) of the tokens at HI, scored by the last nq query rows;
        the others leave HI for good: evicted, exact, or stored by LO from their HI values."""
        H, T, D = self.k.shape
        n = int(self.hi[0].sum())
        hk, hv, _, _ = self._hi_values()
        keys = hk[self.hi].reshape(H, n, D)
        qc = None
        if self.p["needs_queries"]:
            Hq = q.shape[0]
            qc = np.zeros((Hq, n, D), np.float32)
            qc[:, n - nq:] = q[:, q.shape[1] - nq:]
        kept = self._select(keys, qc, target, n - nq if target else 0)
        moving = np.zeros_like(self.hi)
        moving[self.hi] = ~kept.reshape(-1)
        m = int(moving[0].sum())
        if m == 0:
            return
        if self.p["lo"] == "drop":
            self.held &= ~moving
        elif self.p["lo"] == "none":
            self.lk[moving], self.lv[moving] = hk[moving], hv[moving]
            self.lo_bits[0] += 16.0 * m * H * D
            self.lo_bits[1] += 16.0 * m * H * D
        else:
            r = quantize(self.p["lo"], hk[moving].reshape(H, m, D), hv[moving].reshape(H, m, D), layer=self.layer,
                         calib=self.c.calib, seed=self.c.seed, threads=self.c.threads)
            self.lk[moving], self.lv[moving] = r.key.reshape(-1, D), r.value.reshape(-1, D)
            self.lo_bits[0] += r.k_bits * m * H * D
            self.lo_bits[1] += r.v_bits * m * H * D
        self.hi &= ~moving
        self._hi = None

    def append(self, k, v, q):
        """Decoded tokens one by one: a compression that the previous token made due first."""
        for i in range(k.shape[1]):
            if self.pending and int(self.hi[0].sum()) > self.p["target"]:
                self._compress(self.p["target"], self.q, min(self.p["buffer"], self.q.shape[1])
                               if self.q is not None else 0)
            self._hi = None
            self.k = np.concatenate([self.k, k[:, i:i + 1]], 1)
            self.v = np.concatenate([self.v, v[:, i:i + 1]], 1)
            H = self.k.shape[0]
            self.hi = np.concatenate([self.hi, np.ones((H, 1), bool)], 1)
            self.held = np.concatenate([self.held, np.ones((H, 1), bool)], 1)
            self.lk = np.concatenate([self.lk, np.zeros_like(k[:, :1])], 1)
            self.lv = np.concatenate([self.lv, np.zeros_like(v[:, :1])], 1)
            if q is not None:
                qi = q[:, i:i + 1]
                self.q = qi.copy() if self.q is None else np.concatenate([self.q, qi], 1)[:, -self.p["interval"]:]
            self.steps += 1
            self.pending = self.steps % self.p["interval"] == 0

    def cache(self):
        """K', V' of the whole cache (evicted rows 0) and its (k_bits, v_bits) per element."""
        hk, hv, kb, vb = self._hi_values()
        k, v = np.where(self.hi[..., None], hk, self.lk), np.where(self.hi[..., None], hv, self.lv)
        k[~self.held], v[~self.held] = 0, 0
        H, T, D = self.k.shape
        left, held = int((~self.hi[0]).sum()), int(self.held[0].sum())
        where = 0.0 if not left else 32.0 * held * H if self.p["lo"] == "drop" else float(T * H)
        el = float(H * T * D)
        return k, v, ((kb + self.lo_bits[0] + where / 2) / el, (vb + self.lo_bits[1] + where / 2) / el, 0.0)


class DecodeCache:
    """A quantized decode-time KV cache for any model loop, on any device.

        cache = kvq.DecodeCache("kivi:bits=2,group=32,residual=128")
        k_hat, v_hat = cache.update(layer, key, value)  # new tokens' [B,H,t,D] or [H,t,D]

    `update` appends the new tokens' exact keys and values to layer `layer`'s
    cache and returns the quantizer's reconstruction of the whole cache so
    far ([B,H,T,D] or [H,T,D], float32 numpy): at a step that brings the
    cache to T tokens, exactly kvq.quantize(spec, first T keys, first T
    values, layer=layer, seed=seed) — what kvq-eval's decode policy attends
    to at position T−1.  Feeding several tokens at once (a prefill) gives
    their cache after the last of them.  Each sequence of a batch has its
    own cache.  The cost of a step grows with T (the quantizer reruns over
    the whole cache, as the reference does).  `rope` and `calib` as in
    kvq.quantize; key_pre_rope may be passed to update for quantizers that
    use it, query ([B,Hq,t,D] or [Hq,t,D], post-RoPE) for the tokens(...)
    selectors that score by attention.

    A tokens(...) whose selector has target=S,interval=I[,buffer=B]
    compresses while decoding, as kvq-eval --policy decode does (SPEC
    §3.11, kvpress's DecodingPress): a first update of several tokens is the
    context (compressed once by keep= when given: PrefillDecodingPress);
    every later token is a decoded step; after every I-th step, before the
    next token is appended, a cache holding more than S tokens at HI keeps S
    of them (scored with the queries of the last min(B, I) steps), the
    others leave HI for good (drop: evicted, their rows 0 — `keep(layer)`
    says which tokens are held; none: exact; a spec: stored once by LO from
    their HI values).  Several decoded tokens in one update are appended one
    by one, a due compression between them."""

    def __init__(self, spec, *, calib=None, seed=0, rope=None, threads=0):
        full = spec_full(spec) if spec != "none" else "none"  # a bad spec is an Error now, not at the first update
        self.spec, self._exact = spec, spec == "none"  # "none": the exact cache, as kvq-eval -q none
        self._press, self._spec_b = _press_of(full), full.encode()
        self.seed, self.threads = _check_seed(seed), _check_threads(threads)
        self.rope, self.calib = rope, calibration(calib)
        self._layers = {}  # layer -> {"k": [B][H,T,D], "v": ..., "p": ... or None, "bits": ...}
        self._lock = threading.Lock()  # one update at a time: the caches are appended to

    def _quantize(self, layer, k, v, p):
        if self._exact:
            return k.copy(), v.copy(), (16.0, 16.0, 0.0)
        r = quantize(self.spec, k, v, layer=layer, key_pre_rope=p, rope=self.rope, calib=self.calib,
                     seed=self.seed, threads=self.threads)
        return r.key, r.value, (r.k_bits, r.v_bits, r.static_bytes)

    def update(self, layer, key, value, key_pre_rope=None, query=None):
        layer = _check_int(layer, "layer")
        k = as_f32(key, "key", True, (3, 4))
        four = k.ndim == 4
        k = k if four else k[None]
        v = as_f32(value, "value", True, (3, 4))
        v = v if v.ndim == 4 else v[None]
        if v.shape != k.shape:
            raise Error(f"value: expected {list(k.shape)} like key, got {list(v.shape)}")
        p = None
        if key_pre_rope is not None:
            p = as_f32(key_pre_rope, "key_pre_rope", True, (3, 4))
            p = p if p.ndim == 4 else p[None]
            if p.shape != k.shape:
                raise Error(f"key_pre_rope: expected {list(k.shape)} like key, got {list(p.shape)}")
        B, H, t, D = k.shape
        q = None
        if query is not None:
            q = as_f32(query, "query", True, (3, 4))
            q = q if q.ndim == 4 else q[None]
            if q.shape[0] != B or q.shape[2:] != (t, D) or q.shape[1] % H:
                raise Error(f"query: expected [{B}, Hq, {t}, {D}] with Hq a multiple of {H}, got {list(q.shape)}")
        if self._press is not None:
            return self._press_update(layer, k, v, q, four)
        with self._lock:
            st = self._layers.get(layer)
            if st is not None:
                old = st["k"][0]
                if len(st["k"]) != B or (old.shape[0], old.shape[2]) != (H, D):
                    raise Error(f"layer {layer}: key: shape {list(k.shape)} does not continue the cache "
                                f"(batch {len(st['k'])}, {old.shape[0]} heads of {old.shape[2]})")
                if (p is not None) != st["pre"]:
                    raise Error(f"layer {layer}: key_pre_rope: give it at every update of a layer or never")
            outk, outv, bits = [], [], []
            new = {"k": [], "v": [], "p": []}
            for b in range(B):
                for name, x in (("k", k), ("v", v), ("p", p)):
                    prev = None if st is None else st[name][b]
                    new[name].append(None if x is None else x[b].copy() if prev is None
                                     else np.concatenate([prev, x[b]], axis=1))
                kq, vq, bb = self._quantize(layer, new["k"][b], new["v"][b], new["p"][b])
                outk.append(kq), outv.append(vq), bits.append(bb)
            # the state changes only once every sequence has succeeded
            self._layers[layer] = {"k": new["k"], "v": new["v"], "p": new["p"], "pre": p is not None,
                                   "four": four, "bits": bits}
        kq, vq = np.stack(outk), np.stack(outv)
        return (kq, vq) if four else (kq[0], vq[0])

    def _press_update(self, layer, k, v, q, four):
        p = self._press
        if p["needs_queries"] and q is None:
            raise Error(f"{self.spec}: the {p['name']} selector scores by attention: expected query= at every update")
        with self._lock:
            st = self._layers.get(layer)
            if st is not None and (len(st["press"]) != k.shape[0] or st["press"][0].k.shape[::2] != k.shape[1::2]):
                raise Error(f"layer {layer}: key: shape {list(k.shape)} does not continue the cache")
            if st is None:
                st = {"press": [_Press(self, layer, k[b], v[b], None if q is None else q[b])
                                for b in range(k.shape[0])], "four": four}
            else:
                for b, pr in enumerate(st["press"]):
                    pr.append(k[b], v[b], None if q is None else q[b])
            outs = [pr.cache() for pr in st["press"]]
            st["bits"] = [o[2] for o in outs]
            self._layers[layer] = st
        kq, vq = np.stack([o[0] for o in outs]), np.stack([o[1] for o in outs])
        return (kq, vq) if four else (kq[0], vq[0])

    def keep(self, layer, batch=0):
        """[H, T] bool: the tokens the cache holds (False: evicted); all True for a spec that evicts nothing."""
        layer, batch = _check_int(layer, "layer"), _check_int(batch, "batch")
        with self._lock:
            st = self._layers.get(layer)
            if st is None:
                raise Error(f"layer {layer}: nothing cached yet")
            if "press" in st:
                if batch >= len(st["press"]):
                    raise Error(f"batch {batch}: the cache of layer {layer} holds {len(st['press'])} sequence(s)")
                return st["press"][batch].held.copy()
            k = st["k"][0]
            return np.ones(k.shape[:2], bool)

    def bits(self, layer, batch=0):
        """(k_bits, v_bits, static_bytes) of the cache as the last update left it."""
        layer = _check_int(layer, "layer")
        with self._lock:
            st = self._layers.get(layer)
            if st is None:
                raise Error(f"layer {layer}: nothing cached yet")
            batch = _check_int(batch, "batch")
            if batch >= len(st["bits"]):
                raise Error(f"batch {batch}: the cache of layer {layer} holds {len(st['bits'])} sequence(s)")
            return st["bits"][batch]

    def seq_length(self, layer=0):
        layer = _check_int(layer, "layer")
        with self._lock:
            st = self._layers.get(layer)
            return 0 if st is None else st["press"][0].k.shape[1] if "press" in st else st["k"][0].shape[1]

    def reset(self):
        with self._lock:
            self._layers.clear()
