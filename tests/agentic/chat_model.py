"""A tiny chat policy for the agentic tests and the calculator example: a character-level
tokenizer with ``<|im_start|>`` / ``<|im_end|>`` and a Qwen-style chat template (tools in a
system turn, Hermes ``<tool_call>`` JSON for the assistant's calls, tool answers in
``<tool_response>``), and a random hidden-64, 2-layer Qwen3 model."""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<|im_end|>", "<|im_start|>"]
CHARS = ["\n"] + [chr(code) for code in range(32, 127)]

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
    "{% for call in message.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_chat_tokenizer(directory: Path) -> None:
    """``tokenizer.json`` and its config (EOS ``<|im_end|>``, the chat template) in ``directory``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + CHARS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    special = {"eos_token": "<|im_end|>", "pad_token": "<pad>"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "bos_token": None,
              "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def build_chat_policy(directory: Path, seed: int = 0, max_positions: int = 512) -> Path:
    """A random hidden-64, 2-layer Qwen3 chat model with the tokenizer above, saved in ``directory``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    save_chat_tokenizer(directory)
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(SPECIAL_TOKENS) + len(CHARS), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, tie_word_embeddings=True,
        eos_token_id=1, pad_token_id=0, bos_token_id=None, max_position_embeddings=max_positions,
    )
    Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory
