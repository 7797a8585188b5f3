"""The loss and estimator knobs of miles_host.algorithms are flags with slime's spellings,
and the config dataclass holds their only defaults."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from miles_host.cli.args import build_run_parser
from miles_host.config import MilesConfig
from miles_host.plugin_manager import MilesPluginManager

ALGORITHMS = Path(__file__).resolve().parents[2] / "miles_host" / "algorithms"


def parse(*argv: str) -> MilesConfig:
    parser, _ = build_run_parser(MilesPluginManager())
    args = parser.parse_args(list(argv))
    return MilesConfig(**{name: getattr(args, name) for name in MilesConfig.field_names()})


def test_flags_reach_the_config():
    config = parse("--use-unbiased-kl", "--disable-rewards-normalization", "--loss-agg-mode", "seq-mean-token-sum",
                   "--mis-mode", "clip")
    assert config.use_unbiased_kl and config.disable_rewards_normalization
    assert config.loss_agg_mode == "seq-mean-token-sum" and config.mis_mode == "clip"
    default = parse()
    assert not default.use_unbiased_kl and not default.disable_rewards_normalization
    assert default.loss_agg_mode is None and default.mis_mode == "truncate"


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum"])
def test_every_loss_agg_mode_is_offered(mode):
    from miles_host.algorithms.losses import LOSS_AGGREGATIONS

    assert parse("--loss-agg-mode", mode).loss_agg_mode == mode and mode in LOSS_AGGREGATIONS


def test_unknown_mode_and_conflicting_flags_are_refused(capsys):
    with pytest.raises(SystemExit):
        parse("--loss-agg-mode", "batch-mean")
    assert "--loss-agg-mode" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--calculate-per-token-loss.*--loss-agg-mode"):
        parse("--calculate-per-token-loss", "--loss-agg-mode", "seq-mean-token-sum")
    assert parse("--calculate-per-token-loss", "--loss-agg-mode", "token-mean").calculate_per_token_loss


def test_no_defaults_for_config_fields_in_the_algorithms():
    """``getattr(config, name, default)`` would hide a second default beside the dataclass's."""
    pattern = re.compile(r"getattr\(\s*config\s*,[^,()]+,")
    offenders = [f"{path.name}: {line.strip()}" for path in sorted(ALGORITHMS.glob("*.py"))
                 for line in path.read_text().splitlines() if pattern.search(line)]
    assert offenders == []
