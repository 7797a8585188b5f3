"""The engine's asyncio form: :meth:`AsyncGenerate.async_generate`, for the rollout manager.

A mixin of :class:`~miles_host.rollout.engine.Engine`: it submits through the engine's
``_add`` and steps it (``step``) in a task of the running event loop while requests are in
flight.
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping

from miles_host.rollout.logprobs import LogprobOptions
from miles_host.rollout.sampling_params import SamplingParams


class AsyncGenerate:
    """``async_generate`` over an engine's synchronous request API (see the module docstring)."""

    async def async_generate(
        self,
        input_ids: list[int] | list[list[int]],
        sampling_params: SamplingParams | Mapping[str, Any] | list | None = None,
        *,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        rid: str | list[str] | None = None,
        top_logprobs_num: int | None = 0,
        token_ids_logprob: list[int] | None = None,
        logprob_start_len: int | None = -1,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Awaitable generate for the rollout manager.

        One prompt (``list[int]``): its result dict (the list of ``n`` results when
        ``n > 1``). A list of prompts: the flat list, as :meth:`generate`. The
        engine steps in a task of the running event loop while requests are in
        flight; many coroutines can submit concurrently and are batched together.
        Cancelling the awaiting coroutine aborts its request.
        """
        options = LogprobOptions.build(top_logprobs_num, token_ids_logprob, logprob_start_len)
        if input_ids and isinstance(input_ids[0], (list, tuple)):
            prompts, params_list, rids = normalise_batch(input_ids, sampling_params, rid)
            results = await asyncio.gather(*(
                self._async_one(p, sp, r, return_logprob, return_routed_experts, options)
                for p, sp, r in zip(prompts, params_list, rids)
            ))
            return [o for outputs in results for o in outputs]
        outputs = await self._async_one(input_ids, sampling_params, rid, return_logprob, return_routed_experts, options)
        return outputs[0] if len(outputs) == 1 else outputs

    async def _async_one(self, prompt, params, rid, return_logprob, return_routed_experts, options=None) -> list[dict]:
        try:
            request = self._add(rid, prompt, params, return_logprob, return_routed_experts, options)
        except ValueError as error:
            return self._rejected(rid, prompt, params, error)
        if request.done:
            self._ready_outputs = [o for o in self._ready_outputs if o["meta_info"]["id"] != request.rid]
            return request.outputs
        request.future = asyncio.get_running_loop().create_future()
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())
        try:
            return await request.future
        except asyncio.CancelledError:
            self.abort(request.rid)
            raise

    async def _drive(self) -> None:
        while self.scheduler.has_work() or self._pending is not None:
            if self._paused:
                await asyncio.sleep(0.005)
                continue
            self.step()
            await asyncio.sleep(0)  # let other coroutines submit and collect


def normalise_batch(input_ids, sampling_params, rid) -> tuple[list, list, list]:
    """``(prompts, sampling params, request ids)``, one of each per prompt of a generate call."""
    if not isinstance(input_ids, (list, tuple)):
        raise ValueError("input_ids must be a list of prompts (lists of token ids) or one prompt")
    prompts = list(input_ids) if input_ids and isinstance(input_ids[0], (list, tuple)) else [input_ids]
    if isinstance(sampling_params, list):
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        params_list = sampling_params
    else:
        params_list = [sampling_params] * len(prompts)
    if isinstance(rid, list):
        if len(rid) != len(prompts):
            raise ValueError(f"got {len(rid)} request ids for {len(prompts)} prompts")
        rids = rid
    else:
        rids = [rid] if (rid is not None and len(prompts) == 1) else [None] * len(prompts)
    return prompts, params_list, rids
