"""OPD settings that cannot work are refused before anything starts (``miles run`` and
``--dry-run`` alike, exit 2) with a message naming the flag; valid ones pass."""

from __future__ import annotations

import json

import pytest

from miles_host.cli.main import main
from tests.loop.conftest import base_args


def other_tokenizer_teacher(directory, student):
    """The student's weights with another character vocabulary of the same size."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(student, directory)
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate("abcdefghijkl")}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (directory / name).unlink(missing_ok=True)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>").save_pretrained(directory)
    return directory


def bigger_vocab_teacher_without_tokenizer(directory, student):
    """A config.json with another vocab_size, no tokenizer files."""
    directory.mkdir()
    config = json.loads((student / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "vocab_size": 20}))
    return directory


REFUSED = {
    "no opd type": (["--use-opd"], "--use-opd needs --opd-type"),
    "no teacher": (["--use-opd", "--opd-type", "embedded"], "--opd-type embedded needs --opd-teacher-load"),
    "missing teacher": (["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "{tmp}/nowhere"],
                        "--opd-teacher-load {tmp}/nowhere: no such directory"),
    "empty teacher dir": (["--use-opd", "--opd-type", "embedded", "--opd-teacher-load", "{empty}"],
                          "neither an HF model directory"),
    "other tokenizer": (["--use-opd", "--opd-type", "embedded", "--opd-teacher-load", "{other_tok}"],
                        "its tokenizer is not the student's"),
    "other vocab size": (["--use-opd", "--opd-type", "embedded", "--opd-teacher-load", "{big_vocab}"],
                         "vocab_size 20 differs from the student's 14"),
    "teacher without use-opd": (["--opd-teacher-load", "{teacher}"], "--opd-teacher-load is set but --use-opd is not"),
    "served without url": (["--use-opd", "--opd-type", "sglang"], "--opd-type sglang needs --opd-teacher-urls"),
    "served with a load": (["--use-opd", "--opd-type", "sglang", "--opd-teacher-urls", "http://h:1",
                            "--opd-teacher-load", "{teacher}"], "--opd-teacher-load / --opd-teacher-ckpt-step"),
    "embedded with urls": (["--use-opd", "--opd-type", "embedded", "--opd-teacher-load", "{teacher}",
                            "--opd-teacher-urls", "http://h:1"], "--opd-teacher-urls is for a served teacher"),
    "bad url pairs": (["--use-opd", "--opd-type", "sglang", "--opd-teacher-urls", "http://a", "http://b"],
                      "give NAME=URL pairs"),
    "top-k": (["--use-opd", "--opd-type", "sglang", "--opd-teacher-urls", "http://h:1", "--opd-log-prob-top-k", "16"],
              "--opd-log-prob-top-k 16: only 0"),
    "negative coef": (["--use-opd", "--opd-type", "embedded", "--opd-teacher-load", "{teacher}", "--opd-kl-coef",
                       "-1"], "--opd-kl-coef must be a finite number >= 0"),
    "sft loss": (["--use-opd", "--opd-type", "embedded", "--opd-teacher-load", "{teacher}", "--loss-type",
                  "sft_loss"], "--use-opd with --loss-type sft_loss"),
    "step of an hf teacher": (["--use-opd", "--opd-type", "embedded", "--opd-teacher-load", "{teacher}",
                               "--opd-teacher-ckpt-step", "3"], "--opd-teacher-ckpt-step picks an iteration"),
}


@pytest.fixture(scope="module")
def teachers(opd_task, tmp_path_factory):
    student, teacher, _ = opd_task
    root = tmp_path_factory.mktemp("bad_teachers")
    (root / "empty").mkdir()
    return {"teacher": teacher, "empty": root / "empty",
            "other_tok": other_tokenizer_teacher(root / "other_tok", student),
            "big_vocab": bigger_vocab_teacher_without_tokenizer(root / "big_vocab", student)}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_with_the_flag_named(opd_task, teachers, tmp_path, capsys, case):
    student, _, data = opd_task
    flags, message = REFUSED[case]
    paths = {"tmp": tmp_path, **teachers}
    flags = [f.format(**paths) for f in flags]
    message = message.format(**paths)
    for extra in ([], ["--dry-run"]):
        assert main(base_args(student, data, tmp_path / "out", *flags, *extra)) == 2, case
        err = capsys.readouterr().err
        assert message in err, err


def no_reward_args(student, data, out, *extra):
    args = base_args(student, data, out, *extra)
    at = args.index("--rm-type")
    return args[:at] + args[at + 2:]


def test_opd_without_reward_is_accepted_but_not_with_an_unscored_evaluation(opd_task, tmp_path, capsys):
    student, teacher, data = opd_task
    opd = ["--use-opd", "--opd-type", "embedded", "--opd-teacher-load", str(teacher), "--dry-run"]
    assert main(no_reward_args(student, data, tmp_path / "a", *opd)) == 0
    assert main(no_reward_args(student, data, tmp_path / "b", "--dry-run")) == 2
    assert "no reward configured" in capsys.readouterr().err
    assert main(no_reward_args(student, data, tmp_path / "o", *opd, "--over-sampling-batch-size", "8")) == 2
    assert "no group would ever be kept" in capsys.readouterr().err
    assert main(no_reward_args(student, data, tmp_path / "c", *opd, "--eval-prompt-data", "add", str(data))) == 2
    assert "evaluation (--eval-prompt-data) needs a reward" in capsys.readouterr().err
    eval_config = tmp_path / "eval.yaml"
    eval_config.write_text(f"eval:\n  datasets:\n    - name: add\n      path: {data}\n      rm_type: math\n")
    assert main(no_reward_args(student, data, tmp_path / "d", *opd, "--eval-config", str(eval_config))) == 0


def test_valid_settings_pass(opd_task, teachers, tmp_path):
    student, teacher, data = opd_task
    for flags in (["--opd-type", "embedded", "--opd-teacher-load", str(teacher)],
                  ["--opd-type", "megatron", "--opd-teacher-load", str(teacher), "--opd-kl-coef", "0.5"],
                  ["--opd-type", "sglang", "--opd-teacher-urls", "math=http://a:1", "default=http://b:2"]):
        assert main(base_args(student, data, tmp_path / "out", "--use-opd", *flags, "--dry-run")) == 0, flags
