"""A character-level chat tokenizer with a Qwen-style chat template, and tiny chat models.

The template follows the structure of Qwen 2.5's (``<|im_start|>role\\n...<|im_end|>``
turns, tools listed in the system turn, assistant calls as
``<tool_call>\\n{"name", "arguments"}\\n</tool_call>``, tool results as
``<tool_response>`` in a user turn, ``enable_thinking=False`` writing an empty
``<think>`` block after the generation prompt as Qwen 3's does), shortened so prompts
stay small under a one-character-per-token vocabulary.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool as <tool_call>\\n{\"name\": <name>, \"arguments\": <args>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + message.content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set call = call.function %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' + call.arguments | tojson + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

SPECIAL_TOKENS = ["<pad>", "<|im_start|>", "<|im_end|>"]
#: added but not special: tool-call markup survives skip_special_tokens, as in Qwen's tokenizer
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]


def chat_tokenizer(chat_template: str | None = CHAT_TEMPLATE, extra_tokens: tuple[str, ...] = ()):
    """One token per printable ASCII character, plus the chat markup tokens (``<|im_end|>`` is EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\r\x0b\x0c"))
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *MARKUP_TOKENS, *extra_tokens, *chars])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.add_tokens([*MARKUP_TOKENS, *extra_tokens])
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def _config(vocab_size: int, eos_token_id: int, tie: bool):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, tie_word_embeddings=tie, eos_token_id=eos_token_id, pad_token_id=0,
        max_position_embeddings=2048,
    )


def build_chat_model(directory: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """A random hidden-64, 2-layer Qwen3 with the chat tokenizer."""
    from transformers import Qwen3ForCausalLM

    tokenizer = chat_tokenizer(chat_template)
    torch.manual_seed(0)
    Qwen3ForCausalLM(_config(len(tokenizer), tokenizer.eos_token_id, tie=True)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def build_successor_model(directory: Path, chain: list[str]) -> Path:
    """A Qwen3 whose greedy next token depends only on the current one: ``chain[i] -> chain[i + 1]``
    (tokens outside the chain have no preferred successor).

    Attention and MLP outputs are zeroed, so the last hidden state is the current
    token's (normalised) embedding; the untied LM head scores, for each token, the
    embedding of every token whose successor it is. Random 64-d embeddings are near
    orthogonal, so the successor wins by a wide margin. Tokens in ``chain`` that are
    not characters or markup are added to the vocabulary whole.
    """
    from transformers import Qwen3ForCausalLM

    known = set(chat_tokenizer(None).get_vocab())
    tokenizer = chat_tokenizer(CHAT_TEMPLATE, extra_tokens=tuple(dict.fromkeys(t for t in chain if t not in known)))
    vocab = tokenizer.get_vocab()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(_config(len(tokenizer), tokenizer.eos_token_id, tie=False))
    successor = {vocab[a]: vocab[b] for a, b in zip(chain, chain[1:])}
    assert len(successor) == len(chain) - 1, "each token of the chain must have one successor"
    with torch.no_grad():
        embed = torch.randn(len(tokenizer), 64)
        model.model.embed_tokens.weight.copy_(embed)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        unit = embed / embed.norm(dim=-1, keepdim=True)
        head = torch.zeros(len(tokenizer), 64)
        for token, following in successor.items():
            head[following] += unit[token]
        model.lm_head.weight.copy_(head * 4.0)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
