"""The arguments of a `scaled_dot_product_attention` call that fxbudget replaces: one rule for both paths.

The eager interceptor (`eager.py`) and the SDPA pass (`passes/sdpa.py`) bind the call with `bind` and check it with
`check`, so an argument means the same on both. The kernel takes visibility from positions (valid slots, causal), so:
- `attn_mask` must be None, whatever its dtype. A float mask is additive and can carry a bias (ALiBi in Bloom, Falcon,
  MPT; a T5-style `position_bias`) that the kernel would drop. A bool mask indexes keys by slot, and slots are not in
  position order, so what it hides beyond causal visibility would be dropped too. transformers models run with
  fxbudget's attention implementation, which builds no mask; padded batches are refused before the call.
- `dropout_p` must be 0 (call `model.eval()`).
- `scale` is honoured (None = 1/sqrt(head_dim)); torch takes it, and `enable_gqa`, by keyword only.
- `is_causal` is accepted either way (visibility is causal by position: a KV cache serves causal decoding), and
  `enable_gqa` too (query heads are always grouped per KV head).
"""

from __future__ import annotations

SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")  # positional; then scale, enable_gqa
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def bind(args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name, defaults filled in.

    Args:
        args, kwargs: as passed to `scaled_dot_product_attention` (tensors, or fx nodes in the pass).
    Returns:
        A dict keyed by parameter name (`SDPA_PARAMS`, then `scale` and `enable_gqa`).
    """
    return {**_DEFAULTS, **dict(zip(SDPA_PARAMS, args)), **kwargs}


def check(bound: dict, *, mask_dtype=None) -> float | None:
    """Refuse what the kernel cannot honour (same error on both paths); returns the scale to use.

    Args:
        bound: from `bind`.
        mask_dtype: the mask's dtype, for the message (the pass has a graph node, not a tensor).
    Returns:
        The softmax scale, None for the default 1/sqrt(head_dim).
    """
    if bound["dropout_p"]:
        raise RuntimeError("fxbudget: SDPA with dropout (training mode?) cannot use a budget cache; call .eval()")
    mask = bound["attn_mask"]
    if mask is not None:
        dtype = mask_dtype if mask_dtype is not None else getattr(mask, "dtype", type(mask).__name__)
        kind = "an additive bias (e.g. ALiBi)" if "bool" not in str(dtype) else "hidden keys indexed by slot"
        raise RuntimeError(
            f"fxbudget: SDPA over a BudgetCache got an attn_mask ({dtype}), which can carry {kind} that the budget "
            "kernel would drop: it computes visibility from positions. Pass no mask (transformers models: "
            "fxbudget.compile sets an attention implementation that builds none; models with ALiBi or a "
            "position bias are not supported)")
    return bound["scale"]
