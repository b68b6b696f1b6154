"""RULER variable tracking (multi-hop): a chain of variable assignments spread through the haystack."""

from __future__ import annotations

from .haystack import _RESERVED, _VT_HEADER, _assemble
from .sample import Sample, _check_args, _check_count, _rng


def variable_tracking(tokenizer, n_tokens: int, *, depth: float = 0.5, seed: int = 0, hops: int = 4) -> Sample:
    """RULER variable tracking (multi-hop): "VAR A = 12345." then "VAR B = VAR A." ... spread through the haystack.

    Args:
        tokenizer: counts tokens. n_tokens: context length (within 2%). depth: position of the first assignment;
            the `hops` later ones follow in order, evenly between it and the end.
        seed: fixes haystack, value and variable names (5 capital letters).

    Returns:
        A :class:`Sample` whose answers are the ``hops + 1`` variable names holding the value.
    """
    _check_args(n_tokens, depth)
    rng = _rng("variable_tracking", seed)
    value, names = str(rng.randint(10000, 99999)), []
    while len(names) < hops + 1:
        name = "".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5))
        if name not in names and name.lower() not in _RESERVED:
            names.append(name)
    needles = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    depths = [depth + (1 - depth) * k / (hops + 1) for k in range(hops + 1)]
    context, n, measured = _assemble(tokenizer, n_tokens, rng, _VT_HEADER, needles, depths)
    _check_count(context, value)
    question = f"Find all variables that are assigned the value {value} in the text above. " \
               "Answer with the variable names only."
    prefix = (f"According to the chain of variable assignments in the text above, {hops + 1} variables are "
              f"assigned the value {value}, they are:")
    return Sample("variable_tracking", context, question, names, prefix, measured[0], n, seed, 32,
                  {"requested_depth": depth, "needles": [{"text": t, "depth": d} for t, d in zip(needles, measured)]})
