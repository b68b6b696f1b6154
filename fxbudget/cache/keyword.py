"""The cache's keyword: `past_key_values` up to transformers 5.23, `cache` from 5.24 (the old name is a deprecated
alias there until 5.40). fxbudget accepts both wherever it takes a cache, and passes the one the callee declares.
"""

from __future__ import annotations

import inspect

NAMES = ("cache", "past_key_values")


def pick_cache(cache=None, past_key_values=None):
    """The cache given under either name (None if neither); both at once is an error.

    Args:
        cache, past_key_values: the two spellings of one argument.
    Returns:
        Whichever is not None.
    """
    if cache is not None and past_key_values is not None:
        raise TypeError("got both cache= and past_key_values= (two names of one argument): pass only one")
    return past_key_values if cache is None else cache


def cache_name(fn) -> str:
    """The keyword `fn` takes its cache under: `cache` if its signature declares it, else `past_key_values`."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(fn, cache) -> dict:
    """`{name: cache}` with the name `fn` declares, for `fn(..., **cache_kwargs(fn, cache))`."""
    return {cache_name(fn): cache}


def output_cache(out):
    """The cache a forward returned: `out.cache` (transformers >= 5.24), else `out.past_key_values`."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)
