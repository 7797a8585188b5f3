"""A speculative engine releases and resumes its memory (``--colocate``): the draft's KV
cache and a separate draft model's weights go and come back; outputs are unchanged."""

from __future__ import annotations

import pytest

from tests.plugins.spec.conftest import spec_engine
from tests.rollout.conftest import PROMPTS

SAMPLING = [{"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True},
            {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 3, "n": 2}]


@pytest.mark.parametrize("draft", ["mtp", "model"])
def test_release_and_resume_keep_speculative_outputs(policy, bad_draft, draft):
    _, path = policy
    engine = spec_engine(path, draft_path=bad_draft[1] if draft == "model" else None)
    sampling = [SAMPLING[i % 2] for i in range(len(PROMPTS))]
    expected = [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in engine.generate(PROMPTS, sampling)]
    draft_model = getattr(engine.strategy.draft, "model", None)
    before = [p.data_ptr() for p in draft_model.parameters()] if draft_model is not None else []
    engine.release_memory_occupation()
    assert not engine.strategy.draft_cache.allocated and engine.strategy.draft_cache.k_NSHD == []
    if draft_model is not None:
        assert all(p.data_ptr() != b for p, b in zip(draft_model.parameters(), before))
    engine.resume_memory_occupation()
    assert engine.strategy.draft_cache.allocated
    got = [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in engine.generate(PROMPTS, sampling)]
    assert got == expected
