"""lm-eval's `fxbudget` model on the embedded model: a small local generation task through lm-eval's command line.

Writes a passkey task (fxbudget's generator: ~400-token contexts, four depths) as JSONL plus an lm-eval YAML, then
runs `python -m fxbudget.lmeval` (lm-eval's CLI with the model registered) once with lm-eval's own `hf` model (the
reference) and once per fxbudget configuration, with `--apply_chat_template` (the instruct model's template; it also
marks the question for query-agnostic). Reports each run's exact match, the answers, the wall time and the command.

    OMP_NUM_THREADS=1 python benchmarks/lmeval_embedded.py   # -> benchmarks/results/lmeval_embedded.md
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib.env import ROOT, command_line, env_info, header_lines, load_str
from benchlib.output import md_table, write_md

YAML = """task: fxb_passkey
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}\\n\\n{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
filter_list:
  - name: number
    filter:
      - function: regex
        regex_pattern: "(\\\\d+)"
      - function: take_first
metric_list:
  - metric: exact_match
"""

CONFIGS = [  # (label, --model, --model_args beyond the model's path)
    ("hf (reference)", "hf", ""),
    ("snapkv 25% query-aware", "fxbudget", "rule=snapkv,budget=25%,protocol=query-aware"),
    ("snapkv 25% query-agnostic", "fxbudget", "rule=snapkv,budget=25%,protocol=query-agnostic"),
    ("streamingllm 25% query-aware", "fxbudget", "rule=streamingllm,budget=25%,protocol=query-aware"),
]


def _write_task(folder: Path, tokenizer, tokens: int) -> list[str]:
    """Write the task's JSONL and YAML into `folder`; returns the gold passkeys."""
    from fxbudget.harness.tasks import passkey

    rows = []
    for i, depth in enumerate((0.1, 0.4, 0.6, 0.9)):
        s = passkey(tokenizer, tokens, depth=depth, seed=i)
        rows.append({"context": s.context, "question": s.question,
                     "answer": s.answers[0]})
    data = folder / "passkey.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "fxb_passkey.yaml").write_text(YAML.format(data=data))
    return [r["answer"] for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=400, help="context tokens per sample")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/lmeval_embedded.md"))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from fxbudget.models import default_cache_dir, load_default

    checkpoint = default_cache_dir()
    if not (checkpoint / "config.json").is_file():
        load_default()  # converts the GGUF once (~50 s)
    info, start = env_info(), time.perf_counter()
    rows, answers, commands = [], {}, []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        gold = _write_task(tmp, AutoTokenizer.from_pretrained(checkpoint), args.tokens)
        for label, model, extra in CONFIGS:
            model_args = f"pretrained={checkpoint},dtype=float32" + (f",{extra}" if extra else "")
            out = tmp / f"out{len(rows)}"
            cmd = [sys.executable, "-m", "fxbudget.lmeval", "--model", model, "--model_args", model_args,
                   "--tasks", "fxb_passkey", "--include_path", str(tmp), "--apply_chat_template", "--batch_size",
                   "2", "--device", "cpu", "--log_samples", "--output_path", str(out)]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
                                       "HF_DATASETS_OFFLINE": "1"})
            wall = time.perf_counter() - t0
            if proc.returncode:
                sys.exit(f"{label} failed:\n{proc.stderr[-3000:]}")
            result = json.loads(Path(sorted(glob.glob(str(out / "*" / "results_*.json")))[-1]).read_text())
            samples = [json.loads(line) for line in
                       Path(sorted(glob.glob(str(out / "*" / "samples_fxb_passkey_*.jsonl")))[-1]).open()]
            samples.sort(key=lambda s: s["doc_id"])
            answers[label] = [s["filtered_resps"][0] for s in samples]
            fx = result["config"].get("fxbudget", {})
            rows.append([label, f"{result['results']['fxb_passkey']['exact_match,number']:.2f}",
                         ", ".join(map(str, fx.get("budgets_used", []))) or "-",
                         fx.get("kernel_fingerprint", "-")[:12], f"{wall:.0f}"])
            commands.append(" ".join(shlex.quote(c) for c in ["python", *cmd[1:]]).replace(str(tmp), "$TASKS")
                            .replace(str(checkpoint), "$CHECKPOINT"))
    total = time.perf_counter() - start
    lines = header_lines("lm-eval on the embedded model: passkey, generate_until", info, command_line(),
                         load_after=load_str())
    lines += [f"Embedded model (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M dequantized to fp32), lm-eval's CLI through "
              f"`python -m fxbudget.lmeval`, 4 passkey samples of ~{args.tokens} context tokens (depths 0.1, 0.4, "
              f"0.6, 0.9), chat template applied, batch size 2, greedy, eager kernel. Exact match after lm-eval's "
              f"regex filter (first number). Wall time per run includes loading the model (~5 s from the converted "
              f"checkpoint) and, for fxbudget, tracing the kernel fingerprint once.", ""]
    lines += md_table(["configuration", "exact match", "absolute budgets used", "kernel fingerprint", "wall s"], rows)
    lines += ["", "Answers (first number of each output, by sample):", ""]
    lines += md_table(["configuration", *[f"sample {i}" for i in range(4)]],
                      [["gold", *gold]] + [[label, *a] for label, a in answers.items()])
    lines += ["", f"Total wall time {total:.0f} s. Commands (`$TASKS`: the folder with the task YAML and JSONL this "
              "script writes; `$CHECKPOINT`: `fxbudget.models.default_cache_dir()`):", ""]
    lines += [f"- `{c}`" for c in commands]
    write_md(args.out, lines)


if __name__ == "__main__":
    main()
