"""``--loss-type sft_loss`` with slime's SFT rollout, ``--loss-type custom_loss`` and the
policy-loss reducer hook.

References: the loss mask of a conversation built token by token from the template's
definition (not from the renderer under test); the SFT loss against a float64 loop; a
slime-signature custom loss that computes the NLL from the raw logits itself; and the
quickstart model, whose greedy eval accuracy (it forgot the carry) rises with SFT.
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from miles_host.algorithms.losses import PolicyLossBatch, policy_loss, sft_loss, sum_of_sample_mean
from miles_host.cli.main import main
from miles_host.quickstart import EVAL_PATH, MODEL_DIR, task
from miles_host.rollout_function import as_groups, resolve_rollout_function_path
from miles_host.sample import Sample, Status
from miles_host.sft import conversation_tokens, response_length
from tests.loop.conftest import read_metrics

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_tokenizer():
    """A character tokenizer with Qwen's ChatML template (two special tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz0123456789+= ?\n"
    vocab = {"<pad>": 0, IM_START: 1, IM_END: 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token=IM_END,
                                   additional_special_tokens=[IM_START])
    fast.chat_template = CHAT_TEMPLATE
    return fast, vocab


def chatml_reference(messages, vocab):
    """Token ids and loss mask from ChatML's definition: each message is ``<|im_start|>role\\n
    content<|im_end|>\\n``; an assistant message trains everything after its ``role\\n``
    header (slime's qwen mask: content, ``<|im_end|>`` and the newline)."""
    ids, mask = [], []
    for message in messages:
        header = [vocab[IM_START]] + [vocab[c] for c in message["role"] + "\n"]
        body = [vocab[c] for c in message["content"]] + [vocab[IM_END], vocab["\n"]]
        trained = message["role"] == "assistant" and message.get("step_loss_mask", 1) == 1
        ids += header + body
        mask += [0] * len(header) + [int(trained)] * len(body)
    return ids, mask


def test_loss_mask_of_a_multi_turn_conversation(chat_tokenizer):
    tokenizer, vocab = chat_tokenizer
    messages = [
        {"role": "system", "content": "add"},
        {"role": "user", "content": "2+3=?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "and 4+4=?"},
        {"role": "assistant", "content": "8", "step_loss_mask": 0},
        {"role": "user", "content": "9+9=?"},
        {"role": "assistant", "content": "18"},
    ]
    tokens, mask = conversation_tokens(tokenizer, messages)
    assert (tokens, mask) == chatml_reference(messages, vocab)
    # slime's response: from the first trained token to the end
    assert response_length(mask) == len(mask) - mask.index(1)


def test_sft_rollout_sample_on_the_quickstart_template():
    """The quickstart template concatenates contents: the answer (with its EOS) is the response."""
    from miles_host.sft import sft_sample
    from miles_host.tokenizer_loading import load_tokenizer

    tokenizer = load_tokenizer(str(MODEL_DIR))
    sample = Sample(prompt=[{"role": "user", "content": "37+45="}, {"role": "assistant", "content": "82<eos>"}])
    sft_sample(sample, tokenizer)
    prompt_ids = tokenizer("37+45=", add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer("82", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert sample.tokens == prompt_ids + answer_ids
    assert sample.response_length == len(answer_ids) and sample.loss_mask == [1] * len(answer_ids)
    assert sample.status is Status.COMPLETED and sample.reward == 0 and sample.rollout_log_probs is None


def test_a_template_that_rewrites_earlier_turns_is_refused(chat_tokenizer):
    tokenizer, _ = chat_tokenizer
    rewriting = SimpleNamespace(apply_chat_template=lambda messages, **kw: tokenizer.apply_chat_template(
        messages[::-1], **kw))
    with pytest.raises(ValueError, match="start of the whole conversation"):
        conversation_tokens(rewriting, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    with pytest.raises(ValueError, match="--input-key"):
        conversation_tokens(tokenizer, "a plain string")


def packed(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    log_probs = -torch.rand(total, generator=generator, dtype=torch.float64) * 3
    mask = (torch.rand(total, generator=generator) > 0.3).double()
    return PolicyLossBatch(log_probs=log_probs, advantages=torch.zeros(total, dtype=torch.float64),
                           loss_mask=mask, response_lengths=lengths)


def loss_config(**overrides):
    values = dict(loss_agg_mode=None, calculate_per_token_loss=False, eps_clip=0.2, eps_clip_high=None,
                  eps_clip_c=None, advantage_estimator="grpo", use_kl_loss=False, kl_loss_coef=0.0,
                  kl_loss_type="k1", use_unbiased_kl=False, entropy_coef=0.0, use_rollout_logprobs=False,
                  use_tis=False, use_mis=False, use_icepop=False)
    values.update(overrides)
    return SimpleNamespace(**values)


@pytest.mark.parametrize("per_token", [True, False])
def test_sft_loss_is_the_masked_nll(per_token):
    """slime's two modes against a float64 loop: token mean, or mean over sequences of masked means."""
    lengths = [3, 5, 1, 4]
    batch = packed(lengths)
    loss, metrics = sft_loss(batch, loss_config(calculate_per_token_loss=per_token))
    nll, mask = (-batch.log_probs).tolist(), batch.loss_mask.tolist()
    if per_token:
        expected = sum(n * m for n, m in zip(nll, mask)) / sum(mask)
    else:
        means, start = [], 0
        for length in lengths:
            seq_m = mask[start : start + length]
            seq_n = nll[start : start + length]
            means.append(sum(n * m for n, m in zip(seq_n, seq_m)) / max(sum(seq_m), 1))
            start += length
        expected = sum(means) / len(means)
    assert float(loss) == pytest.approx(expected, rel=1e-12)
    assert float(metrics["sft_nll"]) == pytest.approx(expected, rel=1e-12)


def test_pg_loss_reducer_hook_replaces_the_reduction():
    """A slime-style reducer (the micro-batch sum) reproduces the default; a doubled one doubles pg_loss."""
    lengths = [2, 4, 3]
    base = packed(lengths, seed=1)
    batch = PolicyLossBatch(log_probs=base.log_probs.clone().requires_grad_(), loss_mask=base.loss_mask,
                            advantages=torch.linspace(-1, 1, sum(lengths), dtype=torch.float64),
                            old_log_probs=base.log_probs + 0.05, response_lengths=lengths)
    config = loss_config()
    default, _ = policy_loss(batch, config)
    slime_sum = sum_of_sample_mean(config, batch.loss_mask, lengths)
    same, _ = policy_loss(batch, config, pg_reducer=slime_sum)
    doubled, _ = policy_loss(batch, config, pg_reducer=lambda values: 2 * slime_sum(values))
    assert same.item() == pytest.approx(default.item(), rel=1e-12)
    assert doubled.item() == pytest.approx(2 * default.item(), rel=1e-12)


def test_rollout_function_output_shapes():
    def done(index, group):
        return Sample(tokens=[1, 2, 3], response_length=1, reward=1.0, status=Status.COMPLETED, index=index,
                      group_index=group)

    flat = [done(0, 0), done(1, 0), done(2, 1)]
    groups, _ = as_groups(flat, "f")
    assert [[s.index for s in g] for g in groups] == [[0, 1], [2]]
    assert groups[0][0].loss_mask == [1]  # slime's conversion default
    output = SimpleNamespace(samples=[[done(3, 5)]], metrics={"my_count": 2})
    groups, metrics = as_groups(output, "f")
    assert len(groups) == 1 and metrics == {"my_count": 2}
    with pytest.raises(ValueError, match="no reward"):
        as_groups([Sample(tokens=[1, 2], response_length=1, status=Status.COMPLETED)], "pkg.fn")
    assert resolve_rollout_function_path("slime.rollout.sft_rollout.generate_rollout") == "miles_host.sft.generate_rollout"
    assert resolve_rollout_function_path("slime.rollout.sglang_rollout.generate_rollout") is None


def write_sft_data(directory, count, seed=0):
    """Quickstart SFT data: each prompt with its correct sum (and EOS) as the assistant turn."""
    path = directory / "sft.jsonl"
    with path.open("w") as handle:
        for record in task.make_prompts(count, seed=seed, split="train"):
            messages = [{"role": "user", "content": record["input"]},
                        {"role": "assistant", "content": record["label"] + "<eos>"}]
            handle.write(json.dumps({"messages": messages, "label": record["label"]}) + "\n")
    return path


def write_eval_data(directory, count):
    """The quickstart eval prompts under the SFT data's keys (a plain-text prompt)."""
    path = directory / "eval.jsonl"
    with path.open("w") as handle:
        for record in task.read_jsonl(EVAL_PATH)[:count]:
            handle.write(json.dumps({"messages": record["input"], "label": record["label"]}) + "\n")
    return path


def sft_flags(data, out, *extra):
    """slime's SFT_ARGS (run-qwen3-4B-base-sft.sh) on the quickstart model."""
    return ["run", "--hf-checkpoint", str(MODEL_DIR), "--prompt-data", str(data), "--input-key", "messages",
            "--label-key", "label", "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout",
            "--loss-type", "sft_loss", "--calculate-per-token-loss", "--disable-compute-advantages-and-returns",
            "--rollout-shuffle", "--rollout-max-response-len", "6", "--device", "cpu", "--dtype", "float32",
            "--output-dir", str(out), "--no-progress", *extra]


def test_sft_raises_the_quickstart_eval_accuracy(tmp_path):
    """The quickstart policy forgot the carry (greedy accuracy 0); a few SFT steps on the right
    sums teach it, as the eval of the built-in rollout (greedy, exact match) shows."""
    data, evals = write_sft_data(tmp_path, 256), write_eval_data(tmp_path, 200)
    flags = ("--rollout-batch-size", "32", "--micro-batch-size", "32", "--num-rollout", "8", "--lr", "2e-3",
             "--rm-type", "exact", "--eval-prompt-data", "carry", str(evals), "--eval-temperature", "0")
    assert main(sft_flags(data, tmp_path / "out", *flags)) == 0
    rows = read_metrics(tmp_path / "out")
    accuracy = [row["eval/carry/accuracy"] for row in rows if "eval/carry/accuracy" in row]
    assert len(accuracy) == 2
    assert accuracy[0] < 0.2 and accuracy[1] > 0.6, accuracy
    train = [row for row in rows if "train/loss" in row]
    assert len(train) == 8 and all(row["rollout/reward_mean"] == 0.0 for row in train)
    assert all(math.isfinite(row["train/sft_nll"]) and row["train/grad_norm"] > 0 for row in train)


def test_slime_sft_script_runs_without_an_engine_or_a_reward(tmp_path):
    """slime's SFT_ARGS include --debug-train-only and no reward: nothing is generated."""
    data = write_sft_data(tmp_path, 16)
    assert main(sft_flags(data, tmp_path / "out", "--debug-train-only", "--rollout-batch-size", "8",
                          "--num-rollout", "1")) == 0
    row = read_metrics(tmp_path / "out")[0]
    assert row["perf/weight_sync_time_s"] == 0.0 and row["train/sft_nll"] > 0


@pytest.fixture
def custom_loss_module(tmp_path, monkeypatch):
    """slime-signature losses: the NLL of the response tokens from the raw logits."""
    (tmp_path / "slime_style_losses.py").write_text(textwrap.dedent(
        """
        import torch

        def nll_from_logits(args, batch, logits, sum_of_sample_mean):
            log_probs = torch.log_softmax(logits[0].float() / args.rollout_temperature, dim=-1)
            per_token, start = [], 0
            for tokens, total, response in zip(batch["unconcat_tokens"], batch["total_lengths"],
                                               batch["response_lengths"]):
                positions = torch.arange(start + total - response - 1, start + total - 1)
                per_token.append(log_probs[positions, tokens[total - response:]])
                start += total
            loss = -sum_of_sample_mean(torch.cat(per_token))
            return loss, {"nll": loss.detach()}
        """
    ))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("slime_style_losses", None)
    return "slime_style_losses.nll_from_logits"


@pytest.mark.parametrize("per_token", [True, False])
def test_custom_loss_with_slimes_signature_equals_sft_loss(tmp_path, custom_loss_module, per_token):
    """The same step with sft_loss and with a custom loss that recomputes the NLL from the logits."""
    data = write_sft_data(tmp_path, 16)
    common = ["--rollout-batch-size", "8", "--micro-batch-size", "3", "--num-rollout", "1", "--debug-train-only"]
    rows = {}
    for name, extra in (("sft", []), ("custom", ["--custom-loss-function-path", custom_loss_module])):
        flags = sft_flags(data, tmp_path / name, *common, *extra)
        if name == "custom":
            flags[flags.index("sft_loss")] = "custom_loss"
        if not per_token:
            flags.remove("--calculate-per-token-loss")
        assert main(flags) == 0
        rows[name] = read_metrics(tmp_path / name)[0]
    assert rows["custom"]["train/loss"] == pytest.approx(rows["sft"]["train/loss"], rel=1e-5)
    assert rows["custom"]["train/grad_norm"] == pytest.approx(rows["sft"]["train/grad_norm"], rel=1e-4)
    assert rows["custom"]["train/nll"] == pytest.approx(rows["sft"]["train/sft_nll"], rel=1e-5)


def test_loss_type_flags_are_checked():
    from miles_host.config import MilesConfig

    with pytest.raises(ValueError, match="--custom-loss-function-path"):
        MilesConfig(loss_type="custom_loss")
    with pytest.raises(ValueError, match="only used with --loss-type custom_loss"):
        MilesConfig(custom_loss_function_path="m.f")
    with pytest.raises(ValueError, match="reduces the policy loss"):
        MilesConfig(loss_type="sft_loss", custom_pg_loss_reducer_function_path="m.f")


@pytest.mark.slow
def test_sft_over_two_trainer_processes_matches_one_process(tmp_path):
    """The SFT loss under the data-parallel trainer (2 gloo processes, no engine) equals one process."""
    from tests.distributed.conftest import run_launched, run_one_process

    data = write_sft_data(tmp_path, 32)
    common = ("--debug-train-only", "--rollout-batch-size", "16", "--global-batch-size", "8", "--num-rollout", "2",
              "--lr", "1e-3")
    assert run_one_process(sft_flags(data, tmp_path / "one", *common)) == 0
    assert run_launched(sft_flags(data, tmp_path / "two", *common), worker_timeout=60, actor_num_gpus_per_node=2) == 0
    for want, have in zip(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two"), strict=True):
        for key in ("train/loss", "train/sft_nll", "train/grad_norm"):
            assert have[key] == pytest.approx(want[key], rel=1e-5), key


def test_sft_with_a_critic_estimator_is_refused(tmp_path, capsys):
    data = write_sft_data(tmp_path, 4)
    assert main(sft_flags(data, tmp_path / "out", "--debug-train-only", "--advantage-estimator", "ppo",
                          "--dry-run")) == 2
    assert "trains a critic" in capsys.readouterr().err
