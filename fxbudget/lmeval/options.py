"""The `--model_args` of lm-eval's `fxbudget` model: parsed and checked before any model is loaded.

Everything here is plain Python (no lm-eval import), so a bad rule, budget, protocol or backend fails with one
message before a checkpoint is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..compiler.backend import INNER_BACKENDS, kernel_window
from ..checks import check_int
from ..harness.likelihood import PROTOCOLS
from ..checks import check_slot_dtype
from ..harness.runner import budget_fraction
from ..kernel import DEFAULT_BLOCK
from ..rules import Rule, available, canonical, get, rule_fields, unknown_rule_message

# question_marker=ruler: the question of a RULER prompt found by RULER's own templates (lm-eval's `ruler` tasks).
RULER_MARKER = "ruler"
INSTALL_HINT = "pip install 'flexbudget[lmeval]'"
DTYPES = ("float32", "bfloat16", "float16", "auto")
# lm-eval `hf` arguments that mean the same here and are handed to its HFLM base (tokenization, truncation, batch).
HF_ARGS = ("batch_size", "max_batch_size", "max_length", "truncation", "add_bos_token", "prefix_token_id",
           "use_fast_tokenizer", "trust_remote_code", "revision", "think_end_token", "enable_thinking",
           "chat_template_args")
OWN_ARGS = ("pretrained", "tokenizer", "rule", "budget", "protocol", "question_marker", "backend", "chunk_size",
            "window", "block", "device", "dtype", "slot_dtype")


class ModelArgsError(ValueError):
    """A bad `--model_args` entry for the `fxbudget` model (raised before any model is loaded)."""


@dataclass
class Options:
    """The fxbudget side of `--model_args` (the rest goes to lm-eval's HFLM as `hf_args`).

    Attributes:
        pretrained: a local model directory, a local `.gguf` file or a Hub id; None = the embedded default model.
        rule: the rule instance (hyperparameters applied). budget: an int (KV entries per layer and KV head) or a
        percentage string such as "25%" (of the tokens each request prefills with eviction). protocol: one of
        `PROTOCOLS`. backend: a Dynamo backend of `fxbudget.compile`, or None (fxbudget's eager kernel).
        chunk_size: prefill chunk (None: one call); also the call size of loglikelihood_rolling (None: 1).
        block: the kernel's query block. device, dtype: where and how the model runs. slot_dtype: how the cache
        stores keys and values (`kernel.slot_storage`; "model" = the model's dtype). question_marker: where the
        question starts for query-agnostic (its last occurrence in each context); None: the chat template's mark.
    """

    pretrained: str | None
    tokenizer: str | None
    rule: Rule
    budget: int | str
    protocol: str
    backend: str | None
    chunk_size: int | None
    block: int | None
    device: str
    dtype: str
    question_marker: str | None = None
    slot_dtype: str = "model"
    hf_args: dict = field(default_factory=dict)

    @property
    def window(self) -> int:
        """The kernel's observation window of this run (the rule's `window`, else the kernel default)."""
        return kernel_window(self.rule)

    @property
    def rolling_call(self) -> int:
        """Tokens per call in loglikelihood_rolling: with one call the prefill attends exactly and evicts only
        afterwards, so the budget would not touch the scores; every call must evict."""
        return self.chunk_size or 1


def _int(name: str, value) -> int:
    try:
        check_int(f"fxbudget model_args {name}", value)
    except (TypeError, ValueError) as e:
        raise ModelArgsError(str(e)) from None
    return value


def parse(args: dict) -> Options:
    """Check `args` (the parsed `--model_args` plus lm-eval's batch_size/device) and split them.

    Args:
        args: keyword arguments as lm-eval passes them to the model class (values already typed by lm-eval:
            `budget=1024` is an int, `budget=25%` a string).
    Returns:
        The `Options`.
    Raises:
        ModelArgsError: one message naming the bad argument and what is accepted.
    """
    args = dict(args)
    # The rule is checked as `compare` checks it (`fxbudget.rules`): case-insensitive names, wrapper forms such as
    # adakv:snapkv, one line listing the rules for an unknown one.
    rule_name = args.pop("rule", "snapkv")
    rule_name = canonical(rule_name) if isinstance(rule_name, str) else rule_name
    fields = rule_fields(rule_name) if isinstance(rule_name, str) else None
    if fields is None:
        raise ModelArgsError(f"fxbudget model_args: {unknown_rule_message(rule_name)}")
    fields = set(fields)
    if rule_name == "full":
        raise ModelArgsError("fxbudget model_args: rule=full is the unmodified model; run lm-eval's own `--model hf` "
                         "for the reference")
    if "budget" not in args:
        raise ModelArgsError("fxbudget model_args: budget= is required, e.g. budget=1024 (KV entries per layer and KV "
                         "head), budget=256MiB (bytes of KV cache per sequence) or budget=25% (of each request's "
                         "prefilled tokens)")
    budget = args.pop("budget")
    try:
        budget_fraction(budget)
    except ValueError as e:
        raise ModelArgsError(f"fxbudget model_args: {e}") from None
    protocol = args.pop("protocol", "query-aware")
    if protocol not in PROTOCOLS:
        raise ModelArgsError(f"fxbudget model_args: protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    backend = args.pop("backend", "none")
    if backend not in (*INNER_BACKENDS, "none", None):
        raise ModelArgsError(f"fxbudget model_args: backend must be none (fxbudget's eager kernel) or one of "
                         f"{', '.join(INNER_BACKENDS)}, got {backend!r}")
    chunk_size, block = args.pop("chunk_size", None), args.pop("block", DEFAULT_BLOCK)
    for name, value in (("chunk_size", chunk_size), ("block", block)):
        if value is not None:
            _int(name, value)
    try:
        slot_dtype = check_slot_dtype(args.pop("slot_dtype", "model"))
    except ValueError as e:
        raise ModelArgsError(f"fxbudget model_args: {e}") from None
    dtype = args.pop("dtype", "float32")
    if dtype not in DTYPES:
        raise ModelArgsError(f"fxbudget model_args: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    device = str(args.pop("device", None) or "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelArgsError(f"fxbudget model_args: device {device} (lm-eval's command line passes cuda:0 unless told "
                             "otherwise), but torch sees no CUDA device: pass --device cpu or device=cpu")
    if "window" in args and "window" not in fields:
        raise ModelArgsError(f"fxbudget model_args: rule {rule_name!r} has no window hyperparameter, so its kernel "
                         f"uses the default observation window ({kernel_window(get(rule_name))}); window= is for "
                         f"rules that declare one ({', '.join(n for n in available() if 'window' in rule_fields(n))})")
    rule_params = {k: args.pop(k) for k in list(args) if k in fields}
    try:
        rule = get(rule_name, **rule_params)
        kernel_window(rule)
    except (TypeError, ValueError) as e:
        raise ModelArgsError(f"fxbudget model_args: {e}") from None
    if rule.replay_only:
        raise ModelArgsError(f"fxbudget model_args: rule={rule_name} evicts only in its own replay protocol "
                             "(fxbudget.harness.kvzip_protocol), which lm-eval's requests do not run; compare it with "
                             f"`fxbudget compare --rules {rule_name} --protocol query-agnostic`")
    marker = args.pop("question_marker", None)
    if marker is not None:
        # Typed on a command line: "\\n" is a newline (lm-eval passes the backslash through).
        marker = str(marker).encode("latin-1", "backslashreplace").decode("unicode_escape")
        if not marker:
            raise ModelArgsError("fxbudget model_args: question_marker must not be empty")
        if protocol != "query-agnostic":
            raise ModelArgsError(f"fxbudget model_args: question_marker is for protocol=query-agnostic (the question "
                                 f"appended after compression), not {protocol}")
    pretrained, tokenizer = args.pop("pretrained", None), args.pop("tokenizer", None)
    batch_size = args.get("batch_size", 1)
    if isinstance(batch_size, str) and batch_size.startswith("auto"):
        raise ModelArgsError("fxbudget model_args: batch_size=auto is not supported (lm-eval probes it with plain "
                         "forwards of the unmodified model); give an int")
    if "batch_size" in args:
        args["batch_size"] = _int("batch_size", int(batch_size) if isinstance(batch_size, str)
                                  and batch_size.isdigit() else batch_size)
    unknown = sorted(set(args) - set(HF_ARGS))
    if unknown:
        raise ModelArgsError(f"fxbudget model_args: unknown argument(s) {', '.join(unknown)}; accepted: "
                         f"{', '.join(OWN_ARGS)}, the rule's hyperparameters ({', '.join(sorted(fields)) or 'none'}) "
                         f"and lm-eval hf's {', '.join(HF_ARGS)}")
    return Options(pretrained=None if pretrained is None else str(pretrained),
                   tokenizer=None if tokenizer is None else str(tokenizer), rule=rule, budget=budget,
                   protocol=protocol, backend=None if backend in ("none", None) else backend,
                   chunk_size=chunk_size, block=block, device=device, dtype=dtype, question_marker=marker,
                   slot_dtype=slot_dtype, hf_args=args)
