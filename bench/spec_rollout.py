"""Rollout tok/s with and without speculative decoding (EAGLE/MTP draft trained online).

    python bench/spec_rollout.py            # H200: the 0.6B-shaped (Qwen3-0.6B) random model, bf16
    python bench/spec_rollout.py --tiny     # CPU smoke test (hidden 64, 2 layers)

Steps: (1) plain rollout of the prompts -> tok/s; (2) train a fresh MTP draft
head for ``--train-steps`` steps on the policy's own outputs (the online MTP
loss of miles-spec); (3) speculative rollout at equal sampling settings ->
tok/s, acceptance rate and mean accepted length. A random policy is peaky
(weights scaled) so its outputs are learnable, like a trained model's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch


def build_policy(tiny: bool, directory: str, device: str, dtype: torch.dtype):
    import transformers

    from miles_host.models import load_pretrained

    if tiny:
        config = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          max_position_embeddings=1024, tie_word_embeddings=False)
    else:
        config = transformers.Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                          num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                          head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.15 if tiny else 0.04)
    model.save_pretrained(directory)
    return lambda: load_pretrained(directory, dtype=dtype, device=device)


def rollout(engine, prompts, params) -> tuple[float, list[dict]]:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, outputs


def train_draft(load, engine, prompts, outputs, steps: int, lr: float) -> list[float]:
    from miles_host.models import PackedAttention
    from miles_host.models.context import ForwardContext
    from miles_host.sample import Sample
    from miles_host.trainer import PackedBatch
    from miles_spec.draft import attach_mtp
    from miles_spec.training import mtp_loss

    trainer_model = load().float()
    attach_mtp(trainer_model)
    trainer_model.load_state_dict({k: v.float() for k, v in engine.model.state_dict().items()})
    optimizer = torch.optim.AdamW(trainer_model.mtp.parameters(), lr=lr)
    samples = [Sample(prompt="", tokens=p + o["output_ids"], response_length=len(o["output_ids"]),
                      loss_mask=[1] * len(o["output_ids"])) for p, o in zip(prompts, outputs)]
    config = argparse.Namespace(mtp_loss_scaling_factor=1.0)
    losses = []
    device = next(trainer_model.parameters()).device
    for step in range(steps):
        chunk = samples[(step * 16) % len(samples):][:16] or samples[:16]
        batch = PackedBatch.from_samples(chunk, device)
        batch.model_config = trainer_model.config
        with torch.no_grad():
            hidden = trainer_model.forward_hidden(batch.input_ids_T, batch.positions_T,
                                                  ForwardContext(attention=PackedAttention(batch.cu_seqlens)))
        loss, metrics = mtp_loss({"batch": batch, "model": trainer_model, "hidden": hidden}, None, config)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(metrics["loss"])
    engine.update_weights([(k, v) for k, v in trainer_model.state_dict().items() if k.startswith("mtp.")])
    return losses


def engine_memory(device: str) -> dict:
    """KV-cache sizing: a fixed budget on CPU; on the GPU a memory fraction (two engines live one
    after the other), so every prompt decodes at once as in an RL rollout (a 16k-token cache had
    run ~28 sequences at a time and the bench did not finish in 3.5 minutes on the H200)."""
    return {"kv_cache_tokens": 65536} if device == "cpu" else {"mem_fraction_static": 0.4}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test on a tiny model")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--num-steps", type=int, default=3, help="draft tokens per verify")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--train-steps", type=int, default=None)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    from miles_host.rollout import Engine
    from miles_spec.draft import MTPDraft, attach_mtp
    from miles_spec.strategy import EagleStrategy

    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    num_prompts = args.num_prompts or (8 if args.tiny else 256)
    max_new = args.max_new_tokens or (32 if args.tiny else 512)
    train_steps = args.train_steps if args.train_steps is not None else (30 if args.tiny else 200)
    with tempfile.TemporaryDirectory() as directory:
        load = build_policy(args.tiny, directory, device, dtype)
        vocab = 128 if args.tiny else 151936
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(2, vocab, (64,), generator=generator).tolist() for _ in range(num_prompts)]
        params = {"temperature": args.temperature, "max_new_tokens": max_new, "ignore_eos": True, "sampling_seed": 0}
        plain = Engine(load(), **engine_memory(device))
        rollout(plain, prompts[:2], {**params, "max_new_tokens": 4})  # warm-up
        plain_s, outputs = rollout(plain, prompts, params)
        tokens = sum(len(o["output_ids"]) for o in outputs)
        del plain

        def factory(engine):
            attach_mtp(engine.model)
            return EagleStrategy(engine, MTPDraft(engine.model), args.num_steps)

        spec = Engine(load(), decoding_strategy=factory, **engine_memory(device))
        losses = train_draft(load, spec, prompts, outputs, train_steps, args.lr)
        rollout(spec, prompts[:2], {**params, "max_new_tokens": 4})
        spec.strategy.pop_counters()
        spec_s, spec_outputs = rollout(spec, prompts, params)
        counters = spec.strategy.pop_counters()
        spec_tokens = sum(len(o["output_ids"]) for o in spec_outputs)
        result = {
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "num_prompts": num_prompts, "max_new_tokens": max_new, "num_steps": args.num_steps,
            "temperature": args.temperature, "draft_train_steps": train_steps,
            "draft_loss_first_last": [losses[0], losses[-1]] if losses else None,
            "plain_tok_per_s": tokens / plain_s, "spec_tok_per_s": spec_tokens / spec_s,
            "speedup": (spec_tokens / spec_s) / (tokens / plain_s),
            "accept_rate": counters.accepted_tokens / max(1, counters.draft_tokens),
            "accept_len_mean": 1 + counters.accepted_tokens / max(1, counters.verify_steps),
        }
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
