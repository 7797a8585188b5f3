"""INT4 (``--int4-target all``) DeepSeek rollouts over the latent MLA cache: ``kv_b_proj`` keeps its
compressed-tensors buffers (the other linears the kernel's layout), the latent path reads it as
the independent float64 formula's dequantized weight, and weight sync keeps that copy in step."""

from __future__ import annotations

import torch

from miles_host.kernels import switches
from miles_host.models import load_pretrained
from miles_host.rollout import Engine
from miles_int4.rollout import Int4Linear, convert_for_rollout, prepare_rollout_model
from tests.models.mla_checkpoints import save_deepseek_v3_128
from tests.plugins.int4.conftest import Flags
from tests.plugins.int4.test_quant import reference

PROMPTS = [[5, 9, 3, 17, 4], [8, 2, 2, 11, 40, 41, 7]]
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


def _generate(engine: Engine):
    outputs = engine.generate(PROMPTS, GREEDY)
    return [o["output_ids"] for o in outputs], [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outputs]


def _dequantized64(weight: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(reference(weight.detach().numpy(), 128)[2]).float()


def test_int4_kv_b_proj_is_absorbed_dequantized_and_follows_weight_sync(tmp_path):
    path = save_deepseek_v3_128(tmp_path / "dsv3")
    flags = Flags(group_size=128, target="all")
    with switches.switched(mla_kv_cache="latent"):
        model = prepare_rollout_model(load_pretrained(path, device="cpu"), flags)
        attn = model.layers[1].attn
        assert isinstance(attn.kv_b_proj, Int4Linear) and not attn.kv_b_proj.use_kernel
        assert attn.can_cache_latents()
        assert attn.o_proj.use_kernel == attn.q_b_proj.use_kernel  # the others as the device allows
        engine = Engine(model, kv_cache_tokens=256, block_size=4)
        mla = model.config.mla
        assert set(engine.kv_cache.layout) == {(1, mla.kv_lora_rank + mla.qk_rope_head_dim, 0, None)}
        _generate(engine)
        master = load_pretrained(path, device="cpu")
        assert torch.equal(attn.absorbed_kv_b, _dequantized64(master.layers[1].attn.kv_b_proj.weight))

        absorbed = attn.absorbed_kv_b
        with torch.no_grad():  # stands in for an optimizer step
            generator = torch.Generator().manual_seed(3)
            for parameter in master.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02)
        engine.update_weights(convert_for_rollout(master.state_dict().items(), flags))
        assert attn.absorbed_kv_b is absorbed  # in place: CUDA graphs read its address
        assert torch.equal(absorbed, _dequantized64(master.layers[1].attn.kv_b_proj.weight))
        fresh = prepare_rollout_model(master, flags)
        assert _generate(engine) == _generate(Engine(fresh, kv_cache_tokens=256, block_size=4))
