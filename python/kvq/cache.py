"""cache.py — kvq.DecodeCache: a KV cache that holds the exact keys and
values a model has produced and hands back, after each step, the
reconstruction of the whole cache under a quantizer — the cache as
generation sees it (kvq-eval --policy decode, docs/models.md#kvq-eval)."""
import threading

import numpy as np

from ._arrays import as_f32
from ._lib import Error
from .quant import _check_int, _check_seed, _check_threads, calibration, quantize, spec_full


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
    use it."""

    def __init__(self, spec, *, calib=None, seed=0, rope=None, threads=0):
        if spec != "none":
            spec_full(spec)  # a bad spec is an Error now, not at the first update
        self.spec, self._exact = spec, spec == "none"  # "none": the exact cache, as kvq-eval -q none
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

    def update(self, layer, key, value, key_pre_rope=None):
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
            return 0 if st is None else st["k"][0].shape[1]

    def reset(self):
        with self._lock:
            self._layers.clear()
