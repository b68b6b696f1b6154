"""A byte-level tokenizer built in code, for a model with seeded random weights (`--model random:CONFIG`): such a model
ships no tokenizer, and a borrowed GPU machine has none to download. Each UTF-8 byte is one token (ids 0-255, GPT-2's
byte-to-character map), then three specials (pad, bos, eos); no merges, no chat template (the harness then writes the
plain prompt). Every id fits any real vocabulary, so the model's own embedding reads them."""

from __future__ import annotations

SPECIALS = ("<|pad|>", "<|bos|>", "<|eos|>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes onto printable characters (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def byte_tokenizer():
    """A `PreTrainedTokenizerFast` of 259 tokens: the 256 bytes, then pad, bos and eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: b for b, c in sorted(_bytes_to_unicode().items())}
    vocab |= {s: 256 + i for i, s in enumerate(SPECIALS)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=SPECIALS[0], bos_token=SPECIALS[1],
                                  eos_token=SPECIALS[2])
    return tok
