"""What a rule may do inside the shared kernel (`kernel.rule_region`), checked on the eager path and while the pass
traces the rule region (both run `rule_region`): write none of the tensors it is handed, return a floating score of
exactly the candidates' shape, and a bool `protect` mask of that shape."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..rules.base import Rule


class RuleContractError(RuntimeError):
    """A rule broke the kernel's contract: its score has the wrong shape or dtype, or it mutated a tensor."""


def written_args(func, args: tuple, kwargs: dict) -> list:
    """The arguments an aten op writes in place (its schema's `Tensor(a!)` arguments, `out=` included), flattened."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            out += [x for x in pytree.tree_leaves(v) if x is not None]
    return out


def storage_id(t: Tensor):
    """An identity for `t`'s storage, shared by all its views (fake tensors included)."""
    return StorageWeakRef(t.untyped_storage())


class NoMutation(TorchDispatchMode):
    """Refuse any op that writes a tensor the rule was handed: `Signals` holds live tensors (`k_slots` is the cache,
    `acc_attn` is what `evict` writes back), so a rule writing one would change the kernel for every rule. Writes to
    the rule's own temporaries are allowed (library decompositions do it, e.g. cosine_similarity's `clamp_min_`).
    The same mode sees the eager call and the pass's trace (`make_fx` runs `rule_region` too)."""

    def __init__(self, rule: Rule, signals: tuple[Tensor, ...]):
        super().__init__()
        self.rule, self.inputs = rule, {storage_id(t) for t in signals}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.is_mutable and any(isinstance(t, Tensor) and storage_id(t) in self.inputs
                                           for t in written_args(func, args, kwargs)):
            raise RuleContractError(
                f"rule {rule_name(self.rule)!r} writes a signal tensor in place ({func}): a rule must be a pure "
                "function of the signals (use out-of-place ops, e.g. x.clamp(...) instead of x.clamp_(...))")
        return func(*args, **kwargs)


def rule_name(rule: Rule) -> str:
    """The rule's registered name, or its class name, for error messages."""
    return getattr(rule, "name", "") or type(rule).__name__


def check_output(rule: Rule, what: str, x, like: Tensor, *, floating: bool) -> None:
    """`x` must be a tensor of exactly the candidates' shape (no broadcasting) and of the expected dtype kind."""
    if not isinstance(x, Tensor):
        raise RuleContractError(f"rule {rule_name(rule)!r}: {what} must be a tensor, got {type(x).__name__}")
    if x.shape != like.shape:
        raise RuleContractError(f"rule {rule_name(rule)!r}: {what} has shape {tuple(x.shape)}, expected exactly "
                                f"the candidates' shape {tuple(like.shape)} [batch, kv_heads, candidates] "
                                "(no broadcasting)")
    if floating and not x.is_floating_point():
        raise RuleContractError(f"rule {rule_name(rule)!r}: the score must be a floating tensor, got {x.dtype}")
    if not floating and x.dtype != torch.bool:
        raise RuleContractError(f"rule {rule_name(rule)!r}: protect() must return a bool mask, got {x.dtype}")
