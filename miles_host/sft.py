"""Supervised fine-tuning data as a rollout: slime's SFT rollout (``slime/rollout/sft_rollout.py``).

``--rollout-function-path miles_host.sft.generate_rollout`` (slime's
``slime.rollout.sft_rollout.generate_rollout`` is an alias of it) with ``--loss-type
sft_loss``: no generation; each record's conversation (``--input-key``, a list of chat
messages, e.g. ``messages``) is rendered with the checkpoint's chat template, and the
assistant messages' tokens are the trained ones (loss mask 1), everything else is
context (loss mask 0). As in slime, the sample's response runs from the first trained
token to the end, its reward is 0, and a message with ``step_loss_mask`` other than 1
is not trained.

Where the tokens of each message lie is read off the template itself: the conversation
is rendered prefix by prefix (``messages[:i + 1]``), and an assistant message's trained
tokens are those its prefix adds after the generation prompt
(``messages[:i]`` with ``add_generation_prompt``). This gives slime's masks for Qwen's
templates and works for any template whose renderings of a conversation's prefixes are
prefixes of its rendering; one that is not (a template that rewrites earlier turns) is
refused, naming the message.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from miles_host.sample import Sample, Status


def render(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None,
           add_generation_prompt: bool = False) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template (no messages: none)."""
    if not messages and not add_generation_prompt:
        return []
    encoded = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True,
                                            add_generation_prompt=add_generation_prompt)
    if hasattr(encoded, "keys"):  # transformers 5 returns a BatchEncoding
        encoded = encoded["input_ids"]
    return [int(t) for t in encoded]


def _starts_with(tokens: list[int], prefix: list[int]) -> bool:
    return tokens[: len(prefix)] == prefix


def conversation_tokens(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """``(token_ids, loss_mask)`` of a conversation: the chat template's rendering, 1 on the
    tokens of assistant messages after their generation prompt (slime's
    ``MultiTurnLossMaskGenerator.get_loss_mask``), 0 elsewhere."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError(f"an SFT sample's prompt must be a list of chat messages {{'role', 'content'}}, got "
                         f"{type(messages).__name__}; set --input-key to the conversation's key (e.g. messages)")
    tokens = render(tokenizer, messages, tools)
    mask = [0] * len(tokens)
    start = 0
    for position, message in enumerate(messages):
        prefix = render(tokenizer, messages[: position + 1], tools)
        if not _starts_with(tokens, prefix) or len(prefix) < start:
            raise ValueError(
                f"the chat template renders messages[:{position + 1}] as something other than the start of the whole "
                "conversation's rendering, so the trained tokens of each message cannot be told apart; "
                "use a template that renders earlier turns unchanged")
        if message["role"] == "assistant" and message.get("step_loss_mask", 1) == 1:
            header = render(tokenizer, messages[:position], tools, add_generation_prompt=True) if position else []
            first = len(header) if _starts_with(tokens, header) and start <= len(header) <= len(prefix) else start
            mask[first : len(prefix)] = [1] * (len(prefix) - first)
        start = len(prefix)
    return tokens, mask


def response_length(loss_mask: list[int]) -> int:
    """Tokens from the first trained one to the end (slime's ``get_response_lengths``)."""
    return len(loss_mask) - loss_mask.index(1) if 1 in loss_mask else 0


def sft_sample(sample: Sample, tokenizer: Any) -> Sample:
    """Fill ``sample`` (its prompt: the conversation) as slime's SFT rollout does."""
    tokens, mask = conversation_tokens(tokenizer, sample.prompt, sample.metadata.get("tools"))
    length = response_length(mask)
    sample.tokens = tokens
    sample.response_length = length
    sample.loss_mask = mask[len(mask) - length :]
    sample.response = tokenizer.decode(tokens[len(tokens) - length :]) if length else ""
    sample.reward = 0
    sample.rollout_log_probs = None
    sample.status = Status.COMPLETED
    return sample


@lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    from miles_host.tokenizer_loading import load_tokenizer

    return load_tokenizer(path)


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> list[list[Sample]]:
    """slime's ``generate_rollout`` contract: the next ``--rollout-batch-size`` groups of the
    data source, their conversations tokenized and loss-masked; nothing is generated."""
    if evaluation:
        raise ValueError("the SFT rollout has no evaluation; evaluate with --eval-prompt-data (the built-in "
                         "rollout generates the eval answers)")
    tokenizer = _tokenizer(args.hf_checkpoint)
    groups = data_source.get_samples(args.rollout_batch_size)
    for group in groups:
        for sample in group:
            sft_sample(sample, tokenizer)
    return groups
