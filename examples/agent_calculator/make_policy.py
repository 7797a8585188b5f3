#!/usr/bin/env python3
"""Build the calculator agent's base policy and data (CPU, seeded, about a minute).

    python make_policy.py                       # model/, train.jsonl, eval.jsonl next to this file
    python make_policy.py --out /tmp/calc --device cuda

1. a character-level tokenizer with ``<|im_start|>`` / ``<|im_end|>`` (and the tool tags as
   single tokens) and a Qwen-style chat
   template: tools listed in a system turn, tool calls as Hermes ``<tool_call>`` JSON (the
   format miles' ``qwen25`` tool parser reads), tool answers in ``<tool_response>``;
2. a random tiny ``Qwen3ForCausalLM`` (hidden 64, 2 layers; 0.1 M parameters);
3. a short supervised fine-tune on whole agent conversations rendered by that template
   (question, tool call, tool answer, final answer; loss on the assistant turns only) whose
   tool calls confuse the operator with probability ``--confuse-prob`` (see ``task.py``);
4. ``train.jsonl`` / ``eval.jsonl`` records ``{"input", "label", "tools"}``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from task import CALCULATOR_TOOL, CONFUSED, calculator, problems, write_data  # noqa: E402

SPECIAL_TOKENS = ["<pad>", "<|im_end|>", "<|im_start|>"]
#: one token each, kept in decoded text (Qwen's added tokens)
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CHARS = ["\n"] + [chr(code) for code in range(32, 127)]
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tokenizer(directory: Path):
    """The tokenizer files in ``directory``; the loaded ``transformers`` tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + CHARS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.add_tokens(TOOL_TAGS)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    special = {"eos_token": "<|im_end|>", "pad_token": "<pad>"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "bos_token": None, "add_bos_token": False,
              "add_eos_token": False, "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return AutoTokenizer.from_pretrained(str(directory))


def make_model(vocab_size: int, hidden: int, layers: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=hidden // 4, intermediate_size=2 * hidden, max_position_embeddings=512,
        tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=1, pad_token_id=0,
    )
    return Qwen3ForCausalLM(config)


def conversation(tokenizer, a: int, op: str, b: int, confuse: bool) -> tuple[list[int], list[int]]:
    """One agent conversation as token ids and its loss mask (1 on what the model writes:
    the tool call and the answer, each with its ``<|im_end|>``). Built turn by turn as the
    session records it (tool-call arguments as a dict, as the session hands them to the
    template); each turn's prompt must extend the previous turn's tokens."""
    written = f"{a}{CONFUSED[op] if confuse else op}{b}"
    call = {"id": "call_0", "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": written}}}
    result = calculator(written)
    turns = [
        [{"role": "user", "content": f"{a}{op}{b}"}],
        [{"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "call_0", "content": result}],
    ]
    replies = [f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{written}"}}}}\n</tool_call>',
               result]
    ids: list[int] = []
    mask: list[int] = []
    messages: list[dict] = []
    for turn, reply in zip(turns, replies):
        messages.extend(turn)
        prompt = tokenizer.apply_chat_template(messages, tools=[CALCULATOR_TOOL], add_generation_prompt=True,
                                               tokenize=False)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert prompt_ids[:len(ids)] == ids, "the chat template does not extend the earlier turns"
        mask += [0] * (len(prompt_ids) - len(ids))
        reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = prompt_ids + reply_ids
        mask += [1] * len(reply_ids)
    return ids, mask


def sft(model, tokenizer, args) -> None:
    device = next(model.parameters()).device
    rng = random.Random(args.seed)
    pool = problems(5000, seed=args.seed + 100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, args.steps // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
    model.train()
    start = time.time()
    for step in range(args.steps):
        rows = [conversation(tokenizer, *p, rng.random() < args.confuse_prob) for p in rng.choices(pool, k=args.batch_size)]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in rows])
        labels = torch.tensor([[t if m else -100 for t, m in zip(ids_, mask)] + [-100] * (width - len(ids_))
                               for ids_, mask in rows])
        loss = model(input_ids=ids.to(device), labels=labels.to(device)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"sft step {step:5d}  loss {loss.item():.4f}  {time.time() - start:.0f}s", flush=True)
    model.eval()


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--confuse-prob", type=float, default=0.7)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="where the fine-tune runs (cpu, cuda)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    torch.manual_seed(args.seed)
    tokenizer = save_tokenizer(out / "model")
    model = make_model(len(tokenizer), args.hidden, args.layers).to(args.device)
    sft(model, tokenizer, args)
    model.to("cpu").save_pretrained(out / "model")
    write_data(out, seed=args.seed)
    print(f"wrote {out / 'model'}, {out / 'train.jsonl'}, {out / 'eval.jsonl'}")
    return out


if __name__ == "__main__":
    main()
