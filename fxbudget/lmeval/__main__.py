"""`python -m fxbudget.lmeval ARGS`: lm-eval's command line (`lm_eval ARGS`) with the `fxbudget` model registered.

lm-eval 0.4.13 has no plugin discovery, so its own `lm_eval` command does not know `--model fxbudget`; this does.
A bad `--model_args` or a missing lm-eval is one line on stderr and exit status 2, before any model is loaded.
`--help` lists fxbudget's model arguments first (`MODEL_ARGS`), then lm-eval's own help.
"""

from __future__ import annotations

import sys

from . import ModelArgsError, require_lm_eval

# fxbudget's `--model_args` keys (`options.OWN_ARGS`, a test holds them equal), as `--help` lists them.
MODEL_ARGS = {
    "pretrained": "a local model directory, a .gguf file or a hub id (default: the embedded "
                  "Qwen2.5-Coder-0.5B-Instruct)",
    "tokenizer": "another tokenizer (a directory or a hub id; default: the model's)",
    "rule": "a registered rule, see `fxbudget rules` (default: snapkv; full is refused: run --model hf)",
    "budget": "required: KV entries per layer and KV head (1024), bytes of KV cache per sequence (256MiB), or a "
              "percentage of each request's prefilled tokens (25%)",
    "protocol": "query-aware (default here), query-agnostic or streaming (docs/lmeval.md)",
    "question_marker": "query-agnostic only: the question starts at the last occurrence of this string",
    "window": "the observation window, for rules that have one (snapkv, pyramidkv)",
    "backend": "none (default: fxbudget's eager kernel), inductor, aot_eager or eager",
    "chunk_size": "prefill chunk (default: one call); the call size of loglikelihood_rolling (default 1)",
    "block": "the kernel's query block (default: one block per call)",
    "device": "cpu (default), cuda, cuda:N",
    "dtype": "float32 (default), bfloat16, float16 or auto",
    "slot_dtype": "how the cache stores keys and values: model (default), float8_e4m3fn, int8, int4 or bfloat16",
}


def model_args_help() -> str:
    """The `--help` section on fxbudget's `--model_args`."""
    width = max(map(len, MODEL_ARGS))
    lines = ["fxbudget's model: --model fxbudget --model_args KEY=VALUE,... with these keys (docs/lmeval.md):", ""]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in MODEL_ARGS.items()]
    lines += ["  <rule hyperparameter>  by its field name, e.g. window=64 (snapkv), recent_ratio=0.3 (h2o)",
              "  lm-eval hf's batch_size (an int), max_length, truncation, add_bos_token, revision, trust_remote_code, "
              "...", "",
              "e.g. python -m fxbudget.lmeval --model fxbudget --model_args rule=snapkv,budget=1024,"
              "protocol=query-aware --tasks TASK --device cpu", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run lm-eval's CLI on `argv` (default: this process's arguments). Returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    asks_help = any(a in ("-h", "--help") for a in argv)
    if asks_help:
        print(model_args_help())
    try:
        require_lm_eval()
    except ImportError as e:
        if asks_help:
            print(f"lm-eval's own options: {e}")
            return 0
        print(f"error: {e}", file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate

    from . import model  # noqa: F401  (registers the model)

    if asks_help:
        print("lm-eval's own options:\n", flush=True)
    sys.argv = ["lm_eval", *argv]
    try:
        cli_evaluate()
    except ModelArgsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
