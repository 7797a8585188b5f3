"""Rollout tok/s with and without speculative decoding (EAGLE/MTP draft trained online).

    python bench/spec_rollout.py            # H200: the 0.6B-shaped (Qwen3-0.6B) random model, bf16
    python bench/spec_rollout.py --model 4b # a Qwen3-4B shape (bench/small_m.py's table): memory-bound steps
    python bench/spec_rollout.py --tiny     # CPU smoke test (hidden 64, 2 layers)

Steps: (1) plain rollout of the prompts -> tok/s; (2) online training of a fresh
MTP draft head (the MTP loss of miles-spec), as a run does it: ``--train-rounds``
rounds, each a speculative rollout of fresh prompts (a new random prompt set each
round, and a new sampling seed, as each RL step brings new samples) followed by ``--train-steps / rounds`` draft steps
on those samples and a draft weight sync; each round's accepted length is
reported (the rise); (3) the timed speculative rollout with the plain rollout's
seed (prompts and samples the draft never trained on) -> tok/s, acceptance rate and mean
accepted length. A random policy is peaky
(weights scaled, the same logit statistics at every width) so its outputs are
learnable, like a trained model's.

Step costs: the mean plain decode step and speculative step (draft chain + verify
+ acceptance) in ms; their ratio is the accepted length at which speculation
breaks even, so the speed-up at any accepted length follows. ``--profile``: the
speculative steps' top GPU kernels (torch.profiler) of a short extra rollout, on stderr.

Both rollouts use the same prompts, seed and sampling settings. On the GPU plain
decode and the speculative steps run in CUDA graphs (``--spec-eager``: the
speculative steps eagerly, the reference path). One JSON object on stdout; the
phases' times on stderr as they end.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_policy(tiny: bool, model_name: str, directory: str, device: str, dtype: torch.dtype,
                 logit_std: float | None = None, language=None, sft_steps: int = 0):
    """A random Qwen3 saved in HF format; returns a loader of it (the engine's dtype and device).
    Weight std ``0.04 * sqrt(1024 / hidden)``: logits of std ~1.28 at every width, nearly uniform
    over a 151,936-token vocabulary (~11 nats). ``logit_std``: the final norm's weight scales the
    logits to that std. ``language``: fine-tuned on it for ``sft_steps`` steps
    (``bench/structured_policy.py``) in float32, saved in the engine's dtype."""
    import transformers

    from bench import small_m
    from miles_host.models import load_pretrained

    if tiny:
        config = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          max_position_embeddings=1024, tie_word_embeddings=False)
        std = 0.15
    else:
        hidden, inter, heads, kv_heads, head_dim, layers = small_m.MODELS[model_name]
        config = transformers.Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=inter,
                                          num_hidden_layers=layers, num_attention_heads=heads,
                                          num_key_value_heads=kv_heads, head_dim=head_dim,
                                          max_position_embeddings=40960, tie_word_embeddings=model_name != "8b")
        std = 0.04 * (1024 / hidden) ** 0.5
    torch.manual_seed(0)
    build_device = "cpu" if tiny or model_name == "0.6b" else device  # large shapes: initialise on the GPU
    with torch.device(build_device):
        model = transformers.AutoModelForCausalLM.from_config(config)
        model = model.to(torch.float32 if tiny or language is not None else dtype)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, std)
        if logit_std is not None:
            model.model.norm.weight.fill_(logit_std / (std * config.hidden_size ** 0.5))
    if language is not None:
        from bench.structured_policy import fine_tune

        model.to(device)
        fine_tune(model, language, sft_steps, batch=4 if tiny else 8, length=128 if tiny else 256,
                  lr=3e-3 if tiny else 3e-4)
        model.to(dtype)
        free_memory()
    model.save_pretrained(directory)
    del model
    free_memory()
    return lambda: load_pretrained(directory, dtype=dtype, device=device)


def phase(name: str, start: float) -> float:
    """Log a phase's time on stderr; return now."""
    now = time.perf_counter()
    print(f"[spec_rollout] {name}: {now - start:.1f} s", file=sys.stderr, flush=True)
    return now


def rollout(engine, prompts, params) -> tuple[float, list[dict]]:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, outputs


class DraftTrainer:
    """A fresh MTP head trained online (AdamW state kept across rounds) on a float32 copy of the policy."""

    def __init__(self, load, engine, lr: float):
        from miles_spec.draft import attach_mtp

        self.model = load().float()
        attach_mtp(self.model)
        self.model.load_state_dict({k: v.float() for k, v in engine.model.state_dict().items()})
        self.optimizer = torch.optim.AdamW(self.model.mtp.parameters(), lr=lr)

    def train(self, prompts, outputs, steps: int) -> list[float]:
        """``steps`` MTP-loss steps over chunks of 16 of these rollouts (cycling); the policy's hidden
        states of each chunk computed once (a draft step is then one layer and the head)."""
        from miles_host.sample import Sample

        samples = [Sample(prompt="", tokens=p + o["output_ids"], response_length=len(o["output_ids"]),
                          loss_mask=[1] * len(o["output_ids"])) for p, o in zip(prompts, outputs)]
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True  # the float32 trainer's GEMMs (draft training only)
        try:
            prepared = [_policy_hidden(self.model, samples[start:start + 16]) for start in range(0, len(samples), 16)]
            return [_draft_step(self.model, self.optimizer, *prepared[step % len(prepared)]) for step in range(steps)]
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32

    def sync(self, engine) -> None:
        """The draft's weights to the engine (what weight sync does for the MTP head in a run)."""
        engine.update_weights([(k, v) for k, v in self.model.state_dict().items() if k.startswith("mtp.")])


def random_prompts(count: int, vocab: int, seed: int, length: int = 64) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=generator).tolist() for _ in range(count)]


def prompt_maker(language, vocab: int):
    """``(count, seed) -> prompts``: random tokens, or 64-token texts of the policy's language."""
    if language is None:
        return lambda count, seed: random_prompts(count, vocab, seed)
    return lambda count, seed: language.sample(count, 64, seed)


def train_online(load, engine, num_prompts: int, make_prompts, params, args, train_steps: int):
    """Online draft training as a run does it: each round rolls out with speculation on fresh
    samples (new prompts, none of the timed rollout's, and a new sampling seed: at temperature 0
    the timed outputs could otherwise be memorised), trains the draft on them, syncs it. Returns
    the draft losses and each round's mean accepted length (the rise the online training buys)."""
    trainer = DraftTrainer(load, engine, args.lr)
    rounds = max(1, args.train_rounds)
    losses, accept_lens = [], []
    for index in range(rounds):
        prompts = make_prompts(num_prompts, 1 + index)
        _, outputs = rollout(engine, prompts, {**params, "sampling_seed": 1000 + index})
        accept_lens.append(accept_len(engine.strategy.pop_counters()))
        steps = train_steps // rounds + (1 if index < train_steps % rounds else 0)
        losses += trainer.train(prompts, outputs, steps)
        trainer.sync(engine)
        print(f"[spec_rollout] round {index}: accept length {accept_lens[-1]:.3f} before training, "
              f"draft loss {losses[-1] if losses else float('nan'):.3f} after {steps} steps",
              file=sys.stderr, flush=True)
    return losses, accept_lens


def policy_nll(outputs: list[dict]) -> float:
    """Mean -logprob of the sampled tokens (the policy's logprobs the engine returns)."""
    values = [-entry[0] for o in outputs for entry in o["meta_info"].get("output_token_logprobs", [])]
    return sum(values) / max(1, len(values))


def accept_len(counters) -> float:
    """Mean tokens a verify step keeps (accepted drafts + the policy's own token)."""
    return 1 + counters.accepted_tokens / max(1, counters.verify_steps)


def _policy_hidden(trainer_model, chunk):
    """The packed batch of ``chunk`` and the policy's final hidden states over it (no gradients):
    the policy does not change during the bench, so a round computes them once per chunk."""
    from miles_host.models import PackedAttention
    from miles_host.models.context import ForwardContext
    from miles_host.trainer import PackedBatch

    batch = PackedBatch.from_samples(chunk, next(trainer_model.parameters()).device)
    batch.model_config = trainer_model.config
    with torch.no_grad():
        hidden = trainer_model.forward_hidden(batch.input_ids_T, batch.positions_T,
                                              ForwardContext(attention=PackedAttention(batch.cu_seqlens)))
    return batch, hidden


def _draft_step(trainer_model, optimizer, batch, hidden) -> float:
    """One MTP-loss step of the draft on a batch and its policy hidden states."""
    from miles_spec.training import mtp_loss

    config = argparse.Namespace(mtp_loss_scaling_factor=1.0)
    loss, metrics = mtp_loss({"batch": batch, "model": trainer_model, "hidden": hidden}, None, config)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return metrics["loss"]


def engine_memory(device: str) -> dict:
    """KV-cache sizing: a fixed budget on CPU; on the GPU a memory fraction (two engines live one
    after the other), so every prompt decodes at once as in an RL rollout (a 16k-token cache had
    run ~28 sequences at a time and the bench did not finish in 3.5 minutes on the H200)."""
    return {"kv_cache_tokens": 65536} if device == "cpu" else {"mem_fraction_static": 0.4}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test on a tiny model")
    parser.add_argument("--model", default="0.6b", choices=["0.6b", "1.7b", "4b", "8b"],
                        help="the policy's Qwen3 shape (bench/small_m.py)")
    parser.add_argument("--logit-std", type=float, default=None,
                        help="scale the random policy's logits to this std (peakier: a trained model's entropy)")
    parser.add_argument("--policy", choices=["random", "bigram"], default="random",
                        help="bigram: the random policy fine-tuned on a noisy bigram language (bench/structured_policy.py)")
    parser.add_argument("--sft-steps", type=int, default=None, help="fine-tuning steps of --policy bigram")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed rollouts, the speculative steps' top GPU kernels (stderr)")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--num-steps", type=int, default=3, help="draft tokens per verify")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--train-steps", type=int, default=None, help="draft steps in all (default 1000; tiny 30)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--train-prompts", type=int, default=None,
                        help="prompts per online round (default: --num-prompts, at least 64 on the GPU)")
    parser.add_argument("--train-rounds", type=int, default=4,
                        help="online rounds: speculative rollout on fresh samples, then train-steps/rounds draft steps")
    parser.add_argument("--spec-eager", action="store_true", help="speculative steps without CUDA graphs")
    parser.add_argument("--hot-vocab", type=int, default=0,
                        help="FR-Spec: the draft proposes only the N most frequent tokens of a sample of the task's text")
    return parser.parse_args()


def profile_steps(engine, prompts, params) -> None:
    """A short speculative rollout under torch.profiler: the top GPU kernels by total time, and the
    GPU-busy fraction of the wall time (host gaps between steps show as the rest), on stderr."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params)
        torch.cuda.synchronize()
    wall_us = 1e6 * (time.perf_counter() - start)
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.self_device_time_total for e in events)
    print(f"[spec_rollout] profile: {len(prompts)} prompts x {params['max_new_tokens']} tokens, wall {wall_us / 1e3:.1f} ms,"
          f" GPU kernels {busy_us / 1e3:.1f} ms ({busy_us / wall_us:.0%})", file=sys.stderr)
    for event in sorted(events, key=lambda e: -e.self_device_time_total)[:25]:
        print(f"  {event.self_device_time_total / 1e3:9.2f} ms {event.count:7d} x  {event.key[:110]}", file=sys.stderr)
    sys.stderr.flush()


def free_memory() -> None:
    """Free a deleted engine's memory before the next one is sized (the engine froze its objects
    out of the garbage collector's reach)."""
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def spec_engine(load, device: str, args, token_map=None):
    """The speculative engine (a fresh MTP draft; ``token_map``: the FR-Spec ids it may propose)."""
    from miles_host.rollout import Engine
    from miles_spec.draft import MTPDraft, attach_mtp
    from miles_spec.strategy import EagleStrategy

    def factory(engine):
        attach_mtp(engine.model)
        return EagleStrategy(engine, MTPDraft(engine.model, token_map), args.num_steps)

    return Engine(load(), decoding_strategy=factory, enforce_eager=args.spec_eager, **engine_memory(device))


def main() -> None:
    from miles_host.rollout import Engine

    args = parse_args()
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    num_prompts = args.num_prompts or (8 if args.tiny else 256)
    max_new = args.max_new_tokens or (32 if args.tiny else 512)
    train_steps = args.train_steps if args.train_steps is not None else (30 if args.tiny else 1000)
    begin = clock = time.perf_counter()
    with tempfile.TemporaryDirectory() as directory:
        vocab = 128 if args.tiny else 151936
        language = None
        if args.policy == "bigram":
            from bench.structured_policy import BigramLanguage

            language = BigramLanguage(vocab, 32 if args.tiny else 512)
        sft_steps = args.sft_steps if args.sft_steps is not None else 150
        load = build_policy(args.tiny, args.model, directory, device, dtype, args.logit_std, language, sft_steps)
        make_prompts = prompt_maker(language, vocab)
        prompts = make_prompts(num_prompts, 0)
        params = {"temperature": args.temperature, "max_new_tokens": max_new, "ignore_eos": True, "sampling_seed": 0}
        clock = phase(f"{args.policy} policy", clock)
        # warm-up: every prompt (both engines then find them in the prefix cache), a few steps at the
        # timed batch size (Triton compilation, a graph variant captured on first use)
        warm_up = {**params, "max_new_tokens": 2 * (args.num_steps + 1)}
        plain = Engine(load(), **engine_memory(device))
        rollout(plain, prompts, warm_up)
        clock = phase("plain engine", clock)
        plain_s, outputs = rollout(plain, prompts, params)
        tokens = sum(len(o["output_ids"]) for o in outputs)
        del plain
        free_memory()
        clock = phase("plain rollout", clock)
        token_map = None
        if args.hot_vocab:  # FR-Spec: the most frequent tokens of a sample of the task's text (not the timed prompts)
            from miles_spec.hot_vocab import frequent_tokens

            token_map = frequent_tokens(make_prompts(256, 10_000), args.hot_vocab)
        spec = spec_engine(load, device, args, token_map)
        clock = phase("speculative engine (CUDA graphs captured)", clock)
        rollout(spec, prompts, warm_up)
        spec.strategy.pop_counters()
        train_prompts = args.train_prompts or (num_prompts if args.tiny else max(num_prompts, 64))
        losses, round_accept_lens = train_online(load, spec, train_prompts, make_prompts, params, args, train_steps)
        clock = phase("draft training", clock)
        spec_s, spec_outputs = rollout(spec, prompts, params)
        counters = spec.strategy.pop_counters()
        spec_tokens = sum(len(o["output_ids"]) for o in spec_outputs)
        phase("speculative rollout", clock)
        graphs = spec.strategy.graphs
        if args.profile and device == "cuda":
            profile_steps(spec, prompts, {**params, "max_new_tokens": 64})
        # every sequence decodes max_new tokens (ignore_eos) at once: one plain step per token,
        # one speculative step per verify of the whole batch
        plain_step_ms = 1e3 * plain_s / max_new
        spec_step_ms = 1e3 * spec_s / max(1, counters.verify_steps / num_prompts)
        result = {
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "model": "tiny" if args.tiny else args.model,
            "num_prompts": num_prompts, "max_new_tokens": max_new, "num_steps": args.num_steps,
            "temperature": args.temperature, "logit_std": args.logit_std, "policy": args.policy,
            "sft_steps": sft_steps if language is not None else 0,
            "language_entropy": language.entropy() if language is not None else None, "draft_train_steps": train_steps, "draft_train_rounds": args.train_rounds,
            "draft_train_prompts_per_round": train_prompts,
            "hot_vocab": len(token_map) if token_map is not None else None,
            "draft_loss_first_last": [losses[0], losses[-1]] if losses else None,
            "accept_len_per_round": round_accept_lens,
            # the policy's sampling entropy (mean -logprob of its sampled tokens): a trained model
            # sampling reasoning at temperature 1 is well under 1 nat, where drafts get long accepts
            "policy_nll_mean": policy_nll(outputs),
            "plain_tok_per_s": tokens / plain_s, "spec_tok_per_s": spec_tokens / spec_s,
            "speedup": (spec_tokens / spec_s) / (tokens / plain_s),
            "accept_rate": counters.accepted_tokens / max(1, counters.draft_tokens),
            "accept_len_mean": accept_len(counters),
            "plain_step_ms": plain_step_ms, "spec_step_ms": spec_step_ms,
            "break_even_accept_len": spec_step_ms / plain_step_ms,
            "plain_s": plain_s, "spec_s": spec_s, "spec_cuda_graphs": graphs is not None,
            "spec_graph_replays": graphs.num_replays if graphs is not None else 0,
            "bench_s": time.perf_counter() - begin,
        }
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
