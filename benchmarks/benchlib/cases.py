"""What is timed: one attention layer with a full BudgetCache (`LayerCase`) or a model (`bench_model`).
fxbudget is imported lazily, inside the functions."""

from __future__ import annotations

from .timing import timed

QWEN_LAYER = {"heads": 14, "kv_heads": 2, "head_dim": 64, "rope_theta": 1e6}  # Qwen2.5-0.5B attention shapes


def fresh_function(fn):
    """A copy of `fn` with its own code object: Dynamo caches compiled variants per code object, so benchmark cases
    that compile the same function for other shapes or rules would otherwise share one cache (recompile limit, and
    guard checks that walk every earlier variant on each call)."""
    import types

    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _layer_module():
    import torch
    import torch.nn.functional as F

    class BudgetAttentionLayer(torch.nn.Module):
        """Attention only: the call's K/V go through the BudgetCache, SDPA attends (the pass rewrites it)."""

        def forward(self, q, k, v, past_key_values):
            keys, values = past_key_values.update(k, v, 0)
            return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)

    BudgetAttentionLayer.forward = fresh_function(BudgetAttentionLayer.forward)
    return BudgetAttentionLayer()


class LayerCase:
    """One attention layer with a full BudgetCache (every call evicts `n`), random inputs, fixed shapes.

    `compiled()` compiles the layer through fxbudget's backend (the SDPA pass + Inductor) once and returns a
    zero-argument step; `eager()` returns a step running `fxbudget.kernel.budget_attention` directly (no torch.compile);
    `static_sdpa()` returns the ideal that never evicts: a compiled index_copy_ of the call's K/V into a static cache of
    `budget` tokens, then SDPA over it (causal among the new tokens). Compile times are kept in `compile_s`.
    """

    def __init__(self, rule, budget: int, n: int, *, device: str = "cpu", dtype=None, heads: int = 14,
                 kv_heads: int = 2, head_dim: int = 64, rope_theta: float = 1e6, seed: int = 0,
                 cudagraphs: bool = False):
        from types import SimpleNamespace

        import torch

        import fxbudget
        from fxbudget.rules import get

        self.rule = get(rule)
        self.budget, self.n, self.device = budget, n, device
        self.dtype = dtype or torch.float32
        self.cudagraphs = cudagraphs
        self.compile_s: dict[str, float] = {}
        cfg = SimpleNamespace(num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
                              head_dim=head_dim, hidden_size=heads * head_dim,
                              rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
        self.cache = fxbudget.BudgetCache(cfg, budget, dtype=self.dtype, device=device)
        g = torch.Generator().manual_seed(seed)

        def rnd(*shape):
            return torch.randn(*shape, generator=g).to(device=device, dtype=self.dtype)

        self.q, self.k, self.v = rnd(1, heads, n, head_dim), rnd(1, kv_heads, n, head_dim), rnd(1, kv_heads, n, head_dim)
        L = self.layer = self.cache.layers[0]
        with torch.no_grad():
            L.keys.copy_(rnd(*L.keys.shape))
            L.values.copy_(rnd(*L.values.shape))
            L.pos.copy_(torch.arange(budget, device=device).expand_as(L.pos))  # a full cache: every call evicts
            L.norms[..., :2].copy_(torch.stack([L.keys.float().norm(dim=-1), L.values.float().norm(dim=-1)], dim=-1))
            L.seen.fill_(budget)
        # A random output projection (hidden = heads x head_dim), so the kernel pays for `wov_norm` as on a model.
        self.cache.set_output_projections([rnd(heads * head_dim, heads * head_dim)])
        self.cache._held = [budget]
        # Static cache for the no-eviction ideal: same token count, the call writes its n rows at the end.
        self.K, self.V = rnd(1, kv_heads, budget, head_dim), rnd(1, kv_heads, budget, head_dim)
        self.idx = torch.arange(budget - n, budget, device=device)
        qpos = torch.arange(budget - n, budget, device=device).view(n, 1)
        self.mask = torch.arange(budget, device=device).view(1, budget) <= qpos  # [n, budget], causal for new rows
        if cudagraphs:  # CUDA graphs may only mutate inputs with a static address
            for t in (L.keys, L.values, L.pos, L.state, L.norms, L.totals, L.seen, self.K, self.V):
                torch._dynamo.mark_static_address(t)

    def _first(self, name: str, fn):
        import torch

        with torch.no_grad():
            self.compile_s[name] = timed(fn, self.device)

    def compiled(self, inner: str = "inductor"):
        """Compiled step (the first call, which compiles, happens here and is timed into compile_s['budget'])."""
        import torch

        from fxbudget.compiler.backend import make_backend

        extra = {"cudagraphs": True} if self.cudagraphs else {}
        backend = make_backend(self.rule, inner=inner, **extra)
        layer = torch.compile(_layer_module(), backend=backend, fullgraph=True, dynamic=False)
        q, k, v, cache = self.q, self.k, self.v, self.cache

        def step():
            with torch.no_grad():
                return layer(q, k, v, cache)

        self._first("budget", step)
        return step

    def eager(self):
        """Eager step: the kernel called directly on the layer's tensors (same semantics as the compiled step)."""
        import torch

        from fxbudget.compiler.backend import kernel_window
        from fxbudget.kernel import budget_attention

        L, rule, window, n = self.layer, self.rule, kernel_window(self.rule), self.n
        q, k, v = self.q, self.k, self.v
        ar = torch.arange(n, device=self.device)

        def step():
            with torch.no_grad():
                new_pos = ar + L.seen
                L.seen.add_(n)
                return budget_attention(q, L.keys, L.values, L.pos, L.state, L.norms, L.totals, k, v, new_pos,
                                        L.inv_freq, L.wo, rule=rule, budget=L.budget, window=window)

        step()
        return step

    def static_sdpa(self, tokens: int | None = None):
        """Compiled plain SDPA over a static cache of `tokens` (default `budget`) tokens: index_copy_ of the call's
        K/V into its last `n` rows, then SDPA (causal among the new rows; no mask in decode)."""
        import torch
        import torch.nn.functional as F

        decode = self.n == 1
        if tokens is not None and tokens != self.budget:
            kv, d, n, dev = self.K.shape[1], self.K.shape[-1], self.n, self.device
            K = torch.randn(1, kv, tokens, d).to(device=dev, dtype=self.dtype)
            V = torch.randn(1, kv, tokens, d).to(device=dev, dtype=self.dtype)
            idx = torch.arange(tokens - n, tokens, device=dev)
            mask = torch.arange(tokens, device=dev).view(1, tokens) <= idx.view(n, 1)
            if self.cudagraphs:
                for t in (K, V):
                    torch._dynamo.mark_static_address(t)
        else:
            tokens, K, V, idx, mask = self.budget, self.K, self.V, self.idx, self.mask

        def fn(q, k, v, K, V, idx, mask):
            K.index_copy_(2, idx, k)
            V.index_copy_(2, idx, v)
            if decode:
                return F.scaled_dot_product_attention(q, K, V, enable_gqa=True)
            return F.scaled_dot_product_attention(q, K, V, attn_mask=mask, enable_gqa=True)

        opts = {"mode": "reduce-overhead"} if self.cudagraphs else {}
        c = torch.compile(fresh_function(fn), fullgraph=True, dynamic=False, **opts)
        args = (self.q, self.k, self.v, K, V, idx, mask)

        def step():
            with torch.no_grad():
                return c(*args)

        self._first(f"static_{tokens}", step)
        return step


def bench_model(quick: bool):
    """A benchmark's model: the embedded one (24 layers), or with `quick` a tiny random Qwen2 (4 layers, seeded) for
    smoke runs."""
    if not quick:
        from fxbudget.models import load_default

        return load_default(progress=False)[0]
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        attn_implementation="sdpa")).eval()
