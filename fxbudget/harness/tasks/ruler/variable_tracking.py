"""RULER's variable tracking (``scripts/data/synthetic/variable_tracking.py``, task ``vt``): chains of
``VAR X = VAR Y`` assignments hidden in the noise haystack, after one worked example (RULER always prepends one,
fitted to 500 tokens, its names and value then redrawn)."""

from __future__ import annotations

import random
import string

from ..sample import _check_args
from .fit import fit, rng_for, to_sample
from .templates import CONFIGS, FAMILIES, NOISE

_FAMILY = FAMILIES["variable_tracking"]


def _chains(rng: random.Random, num_chains: int, num_hops: int, icl: bool):
    """RULER's ``generate_chains``: distinct upper-case names (3 letters in the example, else 5), the first of each
    chain assigned a 5-digit value (12345 in the example), each next one the previous one."""
    k = 3 if icl else 5
    names: list[str] = []
    while len(names) < num_chains * (num_hops + 1):
        name = "".join(rng.choices(string.ascii_uppercase, k=k))
        if name not in names and name != "VAR":  # "VAR" would be rewritten with the example's names (RULER's bug)
            names.append(name)
    variables, chains = [], []
    for i in range(0, len(names), num_hops + 1):
        these = names[i:i + num_hops + 1]
        value = "12345" if icl else str(rng.randint(10000, 99998))  # np.random.randint(10000, 99999)
        variables.append(these)
        chains.append([f"VAR {these[0]} = {value}"] + [f"VAR {these[j + 1]} = VAR {these[j]} "
                                                        for j in range(num_hops)])
    return variables, chains


def _prompt(rng_seed: str, num_noises: int, num_chains: int, num_hops: int, icl: bool):
    rng = random.Random(rng_seed)
    variables, chains = _chains(rng, num_chains, num_hops, icl)
    value = chains[0][0].split("=")[-1].strip()
    sentences = [NOISE] * num_noises
    for chain in chains:
        positions = sorted(rng.sample(range(len(sentences)), len(chain)))
        for j, at in enumerate(positions):
            sentences.insert(at + j, chain[j])
    context = "\n".join(sentences).replace(". \n", ".\n")
    prefix = _FAMILY.answer_prefix.format(num_v=num_hops + 1, query=value)
    return _FAMILY.template.format(context=context, query=value, num_v=num_hops + 1) + prefix, prefix, variables[0]


def _randomize(example: str, num_hops: int, rng: random.Random) -> str:
    """RULER's ``randomize_icl``: the example's answer names replaced by new random ones, 12345 by a new value."""
    for item in example.strip().split()[-num_hops - 1:]:
        example = example.replace(item, "".join(rng.choices(string.ascii_uppercase, k=len(item))))
    return example.replace("12345", str(rng.randint(10000, 99998)))


def generator(name: str):
    args = CONFIGS[name].args
    task = f"ruler:{name}"
    chains, hops = args["num_chains"], args["num_hops"]

    def generate(tokenizer, n_tokens: int, *, depth: float = 0.5, seed: int = 0, data_dir=None):
        _check_args(n_tokens, depth)
        base = f"{task}:{seed}"
        # The worked example: RULER fits it to 500 tokens (nothing reserved for generation), noise grown by 5, and
        # follows it with its answer: "<prompt> <names>\n".
        k, _, _ = fit(lambda k: _prompt(f"{base}:icl:{k}", k, chains, hops, True)[0], tokenizer, 500, 0, 5, task)
        example, _, names = _prompt(f"{base}:icl:{k}", k, chains, hops, True)
        example = _randomize(example + " " + " ".join(names) + "\n", hops, rng_for(task, seed, "icl-names"))
        lowest = 5 if n_tokens < 4096 else 10
        k, prompt, _ = fit(lambda k: example + "\n" + _prompt(f"{base}:{k}", k, chains, hops, False)[0], tokenizer,
                           n_tokens, _FAMILY.tokens_to_generate, lowest, task)
        _, prefix, answers = _prompt(f"{base}:{k}", k, chains, hops, False)
        return to_sample(task, "variable_tracking", prompt, prefix, answers, tokenizer, n_tokens, seed,
                         {"haystack": "noise", "n_haystack": k, "example": example},
                         needle=f"VAR {answers[0]} = ")

    generate.__name__ = generate.__qualname__ = name
    generate.__doc__ = (f"RULER's {name}: variable tracking with {args} (scripts/synthetic.yaml); answers: the "
                        f"{hops + 1} names of the chain, in order. `depth` is ignored (RULER draws the positions).")
    return generate
