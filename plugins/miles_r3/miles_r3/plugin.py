"""miles-r3 (entry point ``r3``): rollout routing replay for MoE models.

Activated by ``--plugins r3`` or slime's ``--use-rollout-routing-replay`` (R3), or
``--use-routing-replay`` (R2).

- R3: in rollout, ``miles_experts_selected`` captures the top-k experts of every
  token at every MoE layer; the engine returns them and the rollout manager
  stores them in ``sample.rollout_routed_experts`` ``[len(tokens) - 1, layers, k]``.
  In every training forward (old log-probs, reference, train),
  ``miles_train_batch_prepared`` lays the ids out in the packed token order and
  ``miles_select_experts`` replays them; the MoE layer recomputes the gate
  weights from its own scores at those ids, so the router keeps its gradient.
- R2: the old-log-prob pass records its own choice; the training passes replay it.

``r3/expert_agreement`` is the share of token-layer top-k sets the training
router would have chosen identically without replay, over every trainer rank
(pipeline stages count their own layers, data-parallel ranks their own samples:
``miles_rank_counters`` sums them). With ``--use-miles-dashboard`` the same is kept per
response token of the samples trained in this process (``sample.metadata``, for the
dashboard's rollout browser).
"""

from __future__ import annotations

import torch

from miles_host.dashboard.samples import EXPERT_AGREEMENT_KEY
from miles_host.validation.host_checks import model_config
from miles_r3.replay import ReplayState, replay_ids_for_batch

STATE = ReplayState()
NO_MOE_LAYERS = ("--plugins r3 / routing replay is on, but the model has no MoE layers: there is nothing to "
                 "replay; drop --plugins r3 for dense models")


def miles_add_arguments(parser):
    """slime's routing-replay flags."""
    group = parser.add_argument_group("r3 (plugin)")
    group.add_argument(
        "--use-rollout-routing-replay", action="store_true", help="R3: replay the rollout's experts in training"
    )
    group.add_argument(
        "--use-routing-replay", action="store_true", help="R2: record in the old-logprob pass, replay in training"
    )


def miles_activate(args):
    """slime's flags switch replay on without --plugins."""
    return bool(getattr(args, "use_rollout_routing_replay", False) or getattr(args, "use_routing_replay", False))


def miles_configure(config):
    """``--plugins r3`` alone means R3; R3 asks the engine for routes."""
    if not config.plugin_args.get("use_routing_replay"):
        config.plugin_args["use_rollout_routing_replay"] = True
    if config.plugin_args.get("use_rollout_routing_replay"):
        config.rollout_return_routed_experts = True
    else:
        config.old_logprob_pass = "always"  # R2 records the routes it replays in that pass


def miles_validate(config, registries):
    """Replay needs MoE layers: a dense model is refused before the run starts."""
    if not any(model_config(config).moe_layers):
        raise ValueError(NO_MOE_LAYERS)


def miles_process_start(config):
    """Every process that trains (worker ranks too) replays in the mode the driver configured."""
    STATE.reset_step()
    STATE.mode = "r3" if config.plugin_args.get("use_rollout_routing_replay") else "r2"


def miles_experts_selected(layer_index, expert_ids, routing_context):
    """Capture routes in rollout (engine asked for them) and in R2's old-logprob pass."""
    capture = routing_context.phase == "rollout" and routing_context.extra.get("capture")
    record = STATE.mode == "r2" and routing_context.phase == "old_logprob"
    if capture or record:
        routing_context.captured[layer_index] = expert_ids.detach()


def miles_select_experts(layer_index, scores, topk, router_ids, routing_context):
    """Replay the recorded ids (rows marked -1 keep the router's own choice)."""
    replay = routing_context.replay_expert_ids.get(layer_index)
    if replay is None:
        return None
    replay = replay.to(router_ids.device)
    valid_T = replay[:, 0] >= 0
    ids = torch.where(valid_T[:, None], replay, router_ids)
    if routing_context.phase == "train":
        same_T = (torch.sort(router_ids, dim=-1).values == torch.sort(replay, dim=-1).values).all(dim=-1)
        # counted on the router's device: the host reads the step's sums once (miles_rank_counters)
        STATE.agree = STATE.agree + (same_T & valid_T).sum()
        STATE.total = STATE.total + valid_T.sum()
        STATE.count_tokens(routing_context, same_T & valid_T)
    return ids


def miles_train_batch_prepared(batch, samples, config):
    """Attach the ids to replay to the batch's routing context."""
    model_config = batch.model_config
    moe_layers = [i for i, is_moe in enumerate(getattr(model_config, "moe_layers", []) or []) if is_moe]
    if not moe_layers:
        raise ValueError(NO_MOE_LAYERS)
    topk = model_config.moe.top_k
    phase = batch.routing.phase
    if STATE.mode == "r2":
        if phase == "old_logprob":
            STATE.pending.append((batch.routing, list(samples), batch.cu_seqlens.tolist(), moe_layers))
            return
        STATE.collect_recorded()
        routes = [STATE.recorded.get(id(sample)) for sample in samples]
    else:
        routes = [sample.rollout_routed_experts for sample in samples]
    batch.routing.replay_expert_ids.update(
        replay_ids_for_batch(samples, routes, moe_layers, topk, batch.input_ids_T.device)
    )
    if phase == "train" and getattr(config, "use_miles_dashboard", False):  # per-token agreement, for its browser
        STATE.track_tokens(batch.routing, samples, batch.cu_seqlens.tolist())


def miles_rank_counters(config):
    """This process's agreeing and compared token-layers of the step; its per-step state dropped."""
    STATE.write_token_agreement(EXPERT_AGREEMENT_KEY)
    agree, total = torch.as_tensor(STATE.agree).double(), torch.as_tensor(STATE.total).double()
    agree_total = torch.stack([agree, total.to(agree.device)]).tolist()  # the step's one host read
    counts = {"r3/agree": agree_total[0], "r3/total": agree_total[1]}
    STATE.reset_step()
    return counts


def miles_step_end(rollout_id, metrics, config, counters):
    """Report agreement of the training router with the replayed routes, over all trainer ranks."""
    if counters.get("r3/total"):
        metrics["r3/expert_agreement"] = counters["r3/agree"] / counters["r3/total"]

