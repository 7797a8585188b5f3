"""The command lines of the servers the sglang backend launches carry the given --sglang-* flags."""

from __future__ import annotations

import argparse

import pytest

from miles_host.config import MilesConfig
from miles_host.config_sglang import KIND_TYPES
from miles_host.sglang_args_data import SERVER_ARGS
from miles_sglang import flag_checks
from miles_sglang.launcher import client_host, server_command
from miles_sglang.serve_cli import SGLANG_OPTIONS, add_arguments, engine_kwargs_of

PLUGIN_FLAGS = {"sglang_server_command": "sglang", "sglang_url": None, "sglang_router_ip": None}


def sglang_launch_parser() -> argparse.ArgumentParser:
    """What ``python -m sglang.launch_server`` accepts, rebuilt from the pinned ServerArgs rows."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    for arg in SERVER_ARGS:
        names = ["--" + arg.name, *("--" + alias for alias in arg.aliases)]
        if arg.kind == "bool":
            parser.add_argument(*names, action="store_true")
        else:
            parser.add_argument(*names, type=KIND_TYPES[arg.kind], nargs=arg.nargs, default=arg.default)
    return parser


def _config(**values):
    return MilesConfig(hf_checkpoint="/models/glm", **values, plugin_args=dict(PLUGIN_FLAGS))


def test_real_sglang_gets_tensor_parallelism_placement_and_every_given_flag():
    config = _config(rollout_num_gpus=4, rollout_num_gpus_per_engine=2, actor_num_gpus_per_node=2,
                     sglang_mem_fraction_static=0.7, sglang_enable_dp_attention=True, sglang_dp_size=2,
                     sglang_ep_size=2, sglang_cuda_graph_bs=[1, 2, 4, 8], sglang_context_length=32000,
                     sglang_moe_a2a_backend="deepep", sglang_host="0.0.0.0", router_policy="round_robin")
    command = server_command(config, 30001, "sglang", index=1)
    assert command[1:3] == ["-m", "sglang.launch_server"]
    args = sglang_launch_parser().parse_args(command[3:])  # every forwarded option is SGLang's, values readable
    assert (args.model_path, args.port, args.host, args.tp_size) == ("/models/glm", 30001, "0.0.0.0", 2)
    assert args.base_gpu_id == 2 + 1 * 2  # after the 2 trainer GPUs, 2 per server
    assert (args.mem_fraction_static, args.dp_size, args.ep_size, args.context_length) == (0.7, 2, 2, 32000)
    assert args.enable_dp_attention and args.cuda_graph_bs == [1, 2, 4, 8] and args.moe_a2a_backend == "deepep"
    # nothing else: the flags left at their default are SGLang's defaults, router flags go nowhere
    given = [token for token in command[3:] if token.startswith("--")]
    assert sorted(given) == sorted(
        ["--model-path", "--host", "--port", "--tp-size", "--base-gpu-id", "--mem-fraction-static",
         "--enable-dp-attention", "--dp-size", "--ep-size", "--cuda-graph-bs", "--context-length", "--moe-a2a-backend"])
    assert client_host(config) == "127.0.0.1"


def test_without_rollout_num_gpus_sglang_places_the_server_itself():
    command = server_command(_config(), 30001, "sglang")
    assert "--base-gpu-id" not in command and command[command.index("--tp-size") + 1] == "1"


def test_miles_serve_gets_the_options_it_has_and_builds_the_same_engine_kwargs():
    config = MilesConfig(
        hf_checkpoint="/models/glm", device="cpu", sglang_max_running_requests=8, sglang_chunked_prefill_size=512,
        sglang_disable_radix_cache=True, sglang_api_key="k", sglang_ep_size=8, sglang_enable_dp_attention=True,
        plugin_args={**PLUGIN_FLAGS, "sglang_server_command": "miles"})
    command = server_command(config, 30002, "miles")
    assert command[3] == "serve"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(command[4:])
    assert args.api_key == "k" and args.port == 30002
    assert engine_kwargs_of(args) == {"max_num_seqs": 8, "max_num_batched_tokens": 512, "enable_prefix_caching": False}
    assert "--ep-size" not in command and "--enable-dp-attention" not in command
    assert {"mem-fraction-static", "context-length", "max-running-requests", "api-key"} <= SGLANG_OPTIONS


def test_flags_that_reach_no_server_are_named_once(monkeypatch, capsys):
    monkeypatch.setattr(flag_checks, "_warned", set())
    config = MilesConfig(hf_checkpoint="/models/glm", sglang_ep_size=8, router_policy="round_robin",
                         plugin_args={**PLUGIN_FLAGS, "sglang_url": ["http://10.0.0.1:30000"]})
    assert flag_checks.check_server_flags(config) == ["--router-policy", "--sglang-ep-size"]
    assert flag_checks.check_server_flags(config) == []
    err = capsys.readouterr().err
    assert "miles starts no SGLang router" in err and "started outside miles" in err
    monkeypatch.setattr(flag_checks, "_warned", set())
    config = MilesConfig(hf_checkpoint="/models/glm", sglang_ep_size=8, sglang_max_running_requests=4,
                         plugin_args={**PLUGIN_FLAGS, "sglang_server_command": "miles"})
    assert flag_checks.check_server_flags(config) == ["--sglang-ep-size"]  # max-running-requests: miles serve's


def test_miles_serve_refuses_tensor_parallelism():
    config = _config(rollout_num_gpus_per_engine=2)
    with pytest.raises(ValueError, match="miles serve .* runs on one GPU per server"):
        server_command(config, 30003, "miles")
