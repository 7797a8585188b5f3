"""A structured policy for the speculative-rollout bench: a random Qwen3 fine-tuned on a noisy
bigram language, so that what it samples can be predicted the way a trained model's can.

A random policy is no test bed for a draft: its next token is a chaotic function of the whole
context (a draft of one layer cannot emulate 28-36 random layers), so on the H200 a draft trained
online reached accepted length 1.0 on unseen prompts at temperature 0 and with peaky logits at
temperature 1 (``bench/RESULTS.md``). A trained LLM's continuations have structure a small draft
learns; this language has the simplest such structure:

- ``S`` tokens (a random subset of the vocabulary) and a random successor permutation ``f``;
- after token ``x`` comes ``f(x)`` with probability ``follow`` (0.9), else a uniform token of ``S``.

Fine-tuned on it (:func:`fine_tune`: full-parameter AdamW, bf16 autocast on the GPU), the policy
samples at temperature 1 with ~1 nat of entropy per token (``-0.9 ln 0.9 - 0.1 ln(0.1 / S)``),
about what a trained model has on reasoning text; the speculative bench then measures speed at
the accepted length a draft trained online on it reaches. The policy's own NLL is reported.
"""

from __future__ import annotations

import sys

import torch


class BigramLanguage:
    def __init__(self, vocab: int, size: int, follow: float = 0.9, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randperm(vocab - 2, generator=generator)[:size] + 2  # ids 0 and 1 kept out
        self.successor = torch.randperm(size, generator=generator)              # index -> index
        self.follow = follow

    def sample(self, count: int, length: int, seed: int) -> list[list[int]]:
        """``count`` sequences of ``length`` tokens."""
        generator = torch.Generator().manual_seed(seed)
        size = len(self.tokens)
        index_B = torch.randint(size, (count,), generator=generator)
        columns = [index_B]
        for _ in range(length - 1):
            jump_B = torch.rand(count, generator=generator) >= self.follow
            random_B = torch.randint(size, (count,), generator=generator)
            index_B = torch.where(jump_B, random_B, self.successor[index_B])
            columns.append(index_B)
        return self.tokens[torch.stack(columns, dim=1)].tolist()

    def entropy(self) -> float:
        """Nats per token of the language (what a perfectly fitted policy samples with at temperature 1)."""
        size = len(self.tokens)
        p_next = self.follow + (1 - self.follow) / size
        p_other = (1 - self.follow) / size
        return float(-(p_next * torch.log(torch.tensor(p_next)) + (size - 1) * p_other * torch.log(torch.tensor(p_other))))


def fine_tune(model, language: BigramLanguage, steps: int, batch: int, length: int, lr: float) -> list[float]:
    """Full-parameter AdamW on the language (float32 weights; bf16 autocast on the GPU); the losses."""
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    model.train()
    losses = []
    for step in range(steps):
        ids = torch.tensor(language.sample(batch, length, seed=10_000 + step), device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == steps - 1:
            print(f"[structured_policy] step {step}: loss {losses[-1]:.3f} (language entropy {language.entropy():.3f})",
                  file=sys.stderr, flush=True)
    model.eval()
    del optimizer
    return losses
