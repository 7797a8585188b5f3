"""A character-level tokenizer built locally with the ``tokenizers`` library.

Every printable ASCII character (and newline) is one token; special tokens are
``<pad>`` (id 0), ``<eos>`` (id 1) and ``<unk>`` (id 2). No BOS is added: prompts
are raw text. Saved as ``tokenizer.json`` + ``tokenizer_config.json`` +
``special_tokens_map.json`` so that ``transformers.AutoTokenizer`` loads it.
"""

from __future__ import annotations

import json
from pathlib import Path

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, EOS, UNK]
CHARS = ["\n"] + [chr(code) for code in range(32, 127)]
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def build_tokenizer():
    """The raw ``tokenizers.Tokenizer``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + CHARS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer


def save_tokenizer(directory: str | Path) -> None:
    """Write the three tokenizer files into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(directory / "tokenizer.json"))
    special = {"eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "bos_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 64,
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
