"""The recipe for a new kernel signal (docs/development.md) holds: applied to a copy of the package, a per-token signal
is a `Signals` field plus one `TOKEN_SIGNALS` entry (two files), and then a rule reads it, eagerly and through the
graph pass, with the cached slots' values carried through eviction."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import fxbudget

PACKAGE = Path(fxbudget.__file__).resolve().parent

# The two edits of the recipe: the field (with its docstring line) and its computation.
FIELD = ('    wov_norm: Tensor = field(metadata=PER_CANDIDATE)\n',
         '    wov_norm: Tensor = field(metadata=PER_CANDIDATE)\n    value_max: Tensor = field(metadata=PER_CANDIDATE)\n')
ENTRY = ('TOKEN_SIGNALS = {"key_norm": _key_norm, "value_norm": _value_norm, "wov_norm": _wov_norm}',
         'TOKEN_SIGNALS = {"key_norm": _key_norm, "value_norm": _value_norm, "wov_norm": _wov_norm,\n'
         '                 "value_max": lambda new, const, acc: new.values.to(acc).abs().amax(dim=-1)}')

_SCRIPT = r"""
import json
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import fxbudget
from fxbudget.rules.base import Rule

class ByValueMax(Rule):
    name = "by_value_max"
    def score(self, s):
        return s.value_max

torch.manual_seed(0)
shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
ids = torch.randint(0, 64, (1, 24))
kept = {}
for backend in (None, "aot_eager"):
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    fxbudget.compile(model, rule=ByValueMax(), budget=6, backend=backend)
    cache = model.forward.new_cache(1)
    values = []
    with torch.no_grad():
        model(input_ids=ids[:, :20], cache=cache)
        model(input_ids=ids[:, 20:], cache=cache)  # a second call: the slots' part comes from the cache
    layer = cache.layers[0]
    expect = layer.values.float().abs().amax(dim=-1) * (layer.pos >= 0)
    kept[str(backend)] = {"pos": sorted(layer.pos[0, 0].tolist()), "column": layer.norms.shape[-1],
                          "cached_ok": bool(torch.allclose(layer.norms[..., 3], expect))}
print(json.dumps(kept))
"""


def test_a_new_token_signal_takes_two_files(tmp_path):
    site = tmp_path / "site"
    shutil.copytree(PACKAGE, site / "fxbudget", ignore=shutil.ignore_patterns("__pycache__"))
    for rel, (old, new) in (("rules/base.py", FIELD), ("kernel/signals.py", ENTRY)):
        path = site / "fxbudget" / rel
        text = path.read_text()
        assert text.count(old) == 1, rel
        path.write_text(text.replace(old, new))
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=site, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    kept = json.loads(done.stdout.strip().splitlines()[-1])
    # The new signal is cached as a fourth column, carried through eviction, and the eager path and the graph
    # pass keep the same entries by it.
    for backend in ("None", "aot_eager"):
        assert kept[backend]["column"] == 4 and kept[backend]["cached_ok"], kept
    assert kept["None"]["pos"] == kept["aot_eager"]["pos"] and len(kept["None"]["pos"]) == 6
