"""The quickstart assets: model, tokenizer, prompt data, checker, generator script."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import pytest

from miles_host.quickstart import EVAL_PATH, MODEL_DIR, QUICKSTART_DIR, TRAIN_PATH, task

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "make_quickstart_model.py"


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    return transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval()


def _load_script():
    spec = importlib.util.spec_from_file_location("make_quickstart_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_files_exist_and_small():
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json"):
        assert (MODEL_DIR / name).is_file(), name
    assert TRAIN_PATH.is_file() and EVAL_PATH.is_file()
    total = sum(path.stat().st_size for path in QUICKSTART_DIR.rglob("*") if path.is_file())
    assert total < 5 * 1024 * 1024


def test_tokenizer(tokenizer):
    assert tokenizer.eos_token == "<eos>" and tokenizer.pad_token == "<pad>"
    assert tokenizer.eos_token_id is not None and tokenizer.pad_token_id is not None
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    prompt = task.make_prompts(1, seed=0, split="eval")[0]["input"]
    ids = tokenizer(prompt)["input_ids"]
    assert len(ids) == len(prompt)  # one token per character, no BOS added
    assert tokenizer.decode(ids) == prompt
    response = tokenizer("82", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode(response, skip_special_tokens=True) == "82"
    assert tokenizer.unk_token_id not in tokenizer("Hello, world! 12+3=?")["input_ids"]


def test_model_loads(model, tokenizer):
    config = model.config
    assert config.model_type == "qwen3"
    assert config.vocab_size == len(tokenizer)
    assert config.tie_word_embeddings
    assert config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_model_answers_in_format(model, tokenizer):
    records = task.read_jsonl(EVAL_PATH)[:32]
    ids = torch.tensor([tokenizer(r["input"])["input_ids"] for r in records])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=6, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    responses = out[:, ids.shape[1]:]
    assert (responses == tokenizer.eos_token_id).any(dim=1).all()  # every answer ends
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    assert all(text.strip().isdigit() for text in texts)
    # the base policy mostly forgets the carry (that is what RL fixes)
    forgot = sum(t.strip() == task.forgot_carry_answer(*task.parse_prompt(r["input"])) for t, r in zip(texts, records))
    assert forgot >= len(records) // 2


def test_splits_disjoint():
    pools = task.split_pairs()
    assert not set(pools["train"]) & set(pools["eval"])
    assert len(pools["train"]) + len(pools["eval"]) == len(task.all_pairs())
    train = {r["input"] for r in task.read_jsonl(TRAIN_PATH)}
    evals = {r["input"] for r in task.read_jsonl(EVAL_PATH)}
    assert train and evals and not train & evals
    for record in task.read_jsonl(EVAL_PATH):
        assert record["label"] == task.answer(*task.parse_prompt(record["input"]))


def test_checker():
    assert task.check_answer("82", "82")
    assert task.check_answer(" 82\n", "82")
    assert task.check_answer("82<eos>", "82")
    assert task.check_answer("125", 125)
    assert not task.check_answer("72", "82")
    assert not task.check_answer("820", "82")
    assert not task.check_answer("8 2", "82")
    assert not task.check_answer("", "82")
    assert task.reward("82", "82") == 1.0 and task.reward("81", "82") == 0.0
    assert task.make_record(37, 45) == {"input": "37+45=", "label": "82"}
    assert task.forgot_carry_answer(37, 45) == "72"


def test_prompts_deterministic():
    assert task.make_prompts(50, seed=3) == task.make_prompts(50, seed=3)
    assert task.make_prompts(50, seed=3) != task.make_prompts(50, seed=4)
    assert task.make_prompts(20, seed=1, split="eval") == task.make_prompts(20, seed=1, split="eval")
    records = task.make_prompts(100, seed=0)
    assert len({r["input"] for r in records}) == 100  # no repeats within the pool size
    # the shipped files are what the script's defaults generate
    assert task.read_jsonl(TRAIN_PATH) == task.make_prompts(len(task.read_jsonl(TRAIN_PATH)), seed=0, split="train")
    assert task.read_jsonl(EVAL_PATH) == task.make_prompts(len(task.read_jsonl(EVAL_PATH)), seed=0, split="eval")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_script_deterministic(tmp_path):
    script = _load_script()
    for name in ("a", "b"):
        script.main(["--out", str(tmp_path / name), "--steps", "3", "--n-train", "64", "--n-eval", "16", "--no-eval"])
    for rel in ("data/train.jsonl", "data/eval.jsonl", "model/model.safetensors", "model/tokenizer.json"):
        assert _digest(tmp_path / "a" / rel) == _digest(tmp_path / "b" / rel), rel
