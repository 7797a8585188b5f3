#!/usr/bin/env python3
"""Build the quickstart assets: tokenizer, tiny Qwen3 base policy, prompt data.

    python scripts/make_quickstart_model.py            # writes miles_host/quickstart/{model,data}
    python scripts/make_quickstart_model.py --out /tmp/qs --no-eval
    python scripts/make_quickstart_model.py --out /tmp/qs --hidden 128 --device cuda   # bigger, on a GPU

Steps (all seeded, one CPU thread, about 90 s):

1. a character-level tokenizer (``miles_host.quickstart.tokenizer``);
2. a random-init ``Qwen3ForCausalLM`` (hidden 64, 2 layers, 4 heads / 2 KV heads,
   head dim 16, MLP 128, tied embeddings);
3. a short supervised fine-tune (3000 steps x 128, AdamW 3e-3, cosine) on
   train-pool addition problems whose labels
   *forget the carry* with probability ``--forget-prob`` (default 0.65), so the
   policy is right about a third of the time and RL has something to fix;
4. ``data/train.jsonl`` and ``data/eval.jsonl`` (disjoint pools);
5. base metrics on the eval prompts: greedy accuracy, sampled accuracy at T=1,
   pass@8, and the fraction of prompts whose 8 samples are mixed (some right,
   some wrong: the groups GRPO learns from).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from miles_host.quickstart import QUICKSTART_DIR  # noqa: E402
from miles_host.quickstart import task  # noqa: E402
from miles_host.quickstart.tokenizer import EOS, PAD, save_tokenizer  # noqa: E402

MODEL_KW = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(QUICKSTART_DIR), help="directory that gets model/ and data/")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3000, help="SFT optimizer steps")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--forget-prob", type=float, default=task.CARRY_FORGET_PROB)
    parser.add_argument("--hidden", type=int, default=MODEL_KW["hidden_size"])
    parser.add_argument("--layers", type=int, default=MODEL_KW["num_hidden_layers"])
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--n-eval", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: same bits everywhere)")
    parser.add_argument("--no-eval", action="store_true", help="skip the base-model metrics")
    parser.add_argument("--device", default="cpu", help="where SFT and the base metrics run (cpu, cuda, cuda:1)")
    return parser.parse_args(argv)


def make_model(vocab_size: int, eos_id: int, pad_id: int, hidden: int, layers: int):
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    heads = MODEL_KW["num_attention_heads"]
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=MODEL_KW["num_key_value_heads"],
        head_dim=hidden // heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_id, pad_token_id=pad_id, max_new_tokens=8, do_sample=True, temperature=1.0, top_k=0, top_p=1.0
    )
    return model


_ENCODED: dict[str, list[int]] = {}


def encode(tokenizer, text: str) -> list[int]:
    if text not in _ENCODED:
        _ENCODED[text] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return list(_ENCODED[text])


def sft_batch(tokenizer, pairs, forget_prob: float, rng: random.Random):
    """Right-padded input ids and labels (-100 on prompt and padding)."""
    rows, labels = [], []
    for a, b in pairs:
        target = task.forgot_carry_answer(a, b) if rng.random() < forget_prob else task.answer(a, b)
        prompt_ids = encode(tokenizer, task.format_prompt(a, b))
        answer_ids = encode(tokenizer, target) + [tokenizer.eos_token_id]
        rows.append(prompt_ids + answer_ids)
        labels.append([-100] * len(prompt_ids) + answer_ids)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([row + [pad] * (width - len(row)) for row in rows])
    lab = torch.tensor([row + [-100] * (width - len(row)) for row in labels])
    return ids, lab


def sft(model, tokenizer, args) -> None:
    device = next(model.parameters()).device
    pool = task.split_pairs()["train"]
    rng = random.Random(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, args.steps // 20)
    schedule = lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps))  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    start = time.time()
    for step in range(args.steps):
        ids, lab = sft_batch(tokenizer, rng.choices(pool, k=args.batch_size), args.forget_prob, rng)
        loss = model(input_ids=ids.to(device), labels=lab.to(device)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if step % 250 == 0 or step == args.steps - 1:
            print(f"sft step {step:5d}  loss {loss.item():.4f}  {time.time() - start:.0f}s", flush=True)
    model.eval()


@torch.no_grad()
def sample_responses(model, tokenizer, prompts: list[str], n: int, greedy: bool, seed: int) -> list[list[str]]:
    """``n`` responses per prompt (all prompts have the same length: no padding)."""
    torch.manual_seed(seed)
    ids = torch.tensor([encode(tokenizer, prompt) for prompt in prompts], device=next(model.parameters()).device)
    ids = ids.repeat_interleave(n, dim=0)
    kwargs = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=6,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **kwargs,
    )
    texts = tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
    return [texts[i * n : (i + 1) * n] for i in range(len(prompts))]


def base_metrics(model, tokenizer, records: list[dict], n: int = 8, seed: int = 0) -> dict:
    prompts = [record["input"] for record in records]
    labels = [record["label"] for record in records]
    greedy = sample_responses(model, tokenizer, prompts, 1, greedy=True, seed=seed)
    sampled = sample_responses(model, tokenizer, prompts, n, greedy=False, seed=seed)
    greedy_ok = [task.check_answer(g[0], y) for g, y in zip(greedy, labels)]
    ok = [[task.check_answer(s, y) for s in group] for group, y in zip(sampled, labels)]
    forgot = [
        [s.strip() == task.forgot_carry_answer(*task.parse_prompt(p)) for s in group] for group, p in zip(sampled, prompts)
    ]
    count = len(records)
    return {
        "n_prompts": count,
        "greedy_acc": sum(greedy_ok) / count,
        "sampled_acc_t1": sum(map(sum, ok)) / (count * n),
        f"pass@{n}_t1": sum(any(group) for group in ok) / count,
        "mixed_group_frac": sum(any(group) and not all(group) for group in ok) / count,
        "forgot_carry_frac_t1": sum(map(sum, forgot)) / (count * n),
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    if torch.device(args.device).type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: no CUDA GPU here; use --device cpu")
        # deterministic cuBLAS needs a fixed workspace, set before the first cuBLAS call
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(args.threads)
    # on a GPU some attention backward kernels have no deterministic variant: warn there, don't fail
    torch.use_deterministic_algorithms(True, warn_only=torch.device(args.device).type != "cpu")
    try:
        return build(args)
    finally:  # leave the process as we found it (tests call main())
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def build(args) -> dict:
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    out = Path(args.out)
    model_dir, data_dir = out / "model", out / "data"

    from transformers import AutoTokenizer

    save_tokenizer(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.eos_token == EOS and tokenizer.pad_token == PAD

    train = task.make_prompts(args.n_train, seed=args.seed, split="train")
    evals = task.make_prompts(args.n_eval, seed=args.seed, split="eval")
    task.write_jsonl(train, data_dir / "train.jsonl")
    task.write_jsonl(evals, data_dir / "eval.jsonl")

    model = make_model(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, args.hidden, args.layers)
    model.to(args.device)
    print(f"params: {sum(p.numel() for p in model.parameters()):,}", flush=True)
    sft(model, tokenizer, args)
    model.save_pretrained(model_dir, safe_serialization=True)
    (model_dir / "model.safetensors").chmod(0o644)

    metrics = {} if args.no_eval else base_metrics(model, tokenizer, evals)
    if metrics:
        (out / "base_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        print(json.dumps(metrics, indent=2))
    return metrics


if __name__ == "__main__":
    main()
