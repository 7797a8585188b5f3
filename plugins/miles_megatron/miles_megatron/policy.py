"""A Megatron-Core ``GPTModel`` behind the model interface the host trainer uses.

:class:`MegatronPolicy` is what :class:`~miles_megatron.trainer.MegatronTrainer`
puts where the native trainer keeps its ``CausalLM``:

- ``packed_log_probs(...)``: same signature and result as ``CausalLM.packed_log_probs``
  (per-position float32 log-probs of the targets, optional entropy); the hidden
  states come from Megatron's embedding + decoder, the log-probs from the host's
  :func:`~miles_host.models.logprobs.chunked_log_probs` over Megatron's output weight.
  Under PP the last stage computes it inside Megatron's schedule, the earlier stages
  ``stage_forward`` (:mod:`miles_megatron.schedule`).
- ``attach_mtp_draft`` / ``mtp_draft_log_probs``: the online-trained draft of miles-spec
  (``--enable-mtp-training``) as Megatron-Core's own ``MultiTokenPredictionLayer``
  (:mod:`miles_megatron.mtp`), same numbers as the native draft's loss.
- ``config``: the native :class:`~miles_host.models.ModelConfig` (R3 reads the MoE
  layers from it; ``save_pretrained`` writes the HF config from it).
- ``state_dict()`` / ``load_state_dict()``: native names and layouts
  (:mod:`miles_megatron.weights`), so weight sync, ``--save-hf`` and checkpoints see
  what the native trainer gives them. Under TP/EP (:mod:`miles_megatron.parallel`)
  the model is this rank's shard, under PP its pipeline stage's layers
  (:mod:`miles_megatron.pipeline`): ``load_state_dict`` takes the full weights and keeps
  this rank's part, ``state_dict`` is a collective that gathers the full weights.
- ``chunks``: this rank's GPTModels, one per virtual pipeline stage (one without virtual
  stages: ``gpt``); the schedule says which one runs (``running_chunk``), and ``chunk``
  is it for the forward methods.

Precision follows the native trainer: float32 parameters (the masters) and, on GPU,
the forward under the trainer's bf16 autocast. Megatron-Core is written for bf16
*parameters* (``Float16Module``), not autocast; three places are adjusted so it
computes what the native model computes under autocast:

- residual adds keep the residual stream's dtype (float32; Megatron's
  bias-dropout-add casts the residual to the branch output's bf16);
- the router GEMM gets its input in the autocast dtype (its autograd Function has
  no ``custom_bwd``: a float32 input under autocast gives bf16 logits whose
  backward then multiplies bf16 gradients by float32 weights and fails) — see
  :mod:`miles_megatron.replay`;
- every decoder layer runs under the autocast state of the forward that first ran
  it, so Megatron's activation recomputation (which re-runs layers in backward,
  outside the trainer's autocast) recomputes what the forward computed.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from miles_host.devices import host_values
from miles_megatron.layout import PaddedLayout
from miles_megatron.mla import set_latent_norm_eps
from miles_megatron.plain_linears import use_plain_linears
from miles_megatron.replay import RouterReplayBridge
from miles_megatron.runtime import on_device, quiet_imports
from miles_megatron.weights import (
    gpt_model_kwargs,
    megatron_to_native,
    megatron_transformer_config_kwargs,
    native_to_megatron,
)

#: TransformerConfig settings of this backend: local (non-TE) modules, no dropout,
#: no fused kernels (Apex / TransformerEngine are not used), weights loaded from the
#: checkpoint rather than initialised, the parameters float32 (masters; see module doc)
LOCAL_SETTINGS: dict[str, Any] = dict(
    use_cpu_initialization=True,
    perform_initialization=False,
    params_dtype=torch.float32,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    gradient_accumulation_fusion=False,
    fp16=False,
    bf16=False,  # bf16 *parameters*; the forward's bf16 comes from the trainer's autocast
)
#: MoE settings: one rank, so the all-gather dispatcher (no collective at size 1, no
#: device-to-host copies on side streams), the experts as ``SequentialMLP`` in the spec (Megatron's
#: ``GroupedMLP`` needs the grouped_gemm package and bf16 parameters), which
#: :func:`~miles_megatron.grouped_experts.with_grouped_experts` swaps for its grouped-GEMM
#: subclass, no TE fused permute/router kernels, the router GEMM in its input's dtype (as the
#: native Qwen3-MoE router), no auxiliary loss (the native trainer has none)
MOE_SETTINGS: dict[str, Any] = dict(
    moe_token_dispatcher_type="allgather",
    moe_grouped_gemm=False,
    moe_permute_fusion=False,
    moe_router_fusion=False,
    moe_router_load_balancing_type="none",
)


def transformer_config(native_config: Any, recompute: bool = False, sequence_parallel_tp: int = 0, pp: int = 1,
                       overrides: dict[str, Any] | None = None, cp: int = 1):
    """Megatron ``TransformerConfig`` of a native config (unsupported features refused);
    ``sequence_parallel_tp``: the TP size when sequence parallelism is on (0: off);
    ``pp``: the pipeline size (each stage builds its slice of the layers); ``cp``: the
    context-parallel size (:mod:`miles_megatron.context_parallel`); ``overrides``:
    the run's Megatron flags this backend honours
    (:func:`miles_megatron.perf_flags.transformer_config_overrides`; ``moe_*`` ones for MoE
    models only)."""
    from miles_megatron.mla import config_class

    kwargs = megatron_transformer_config_kwargs(native_config)
    kwargs.update(LOCAL_SETTINGS)
    if native_config.moe is not None:
        kwargs.update(MOE_SETTINGS)
    for name, value in (overrides or {}).items():
        if native_config.moe is not None or not name.startswith("moe_"):
            kwargs[name] = value
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if sequence_parallel_tp:
        kwargs.update(sequence_parallel=True, tensor_model_parallel_size=sequence_parallel_tp)
    if pp > 1:
        from miles_megatron.pipeline import PipelineLayout

        # virtual stages and uneven first / last stages come with the overrides
        layout = PipelineLayout(pp, kwargs.get("virtual_pipeline_model_parallel_size") or 1,
                                kwargs.get("num_layers_in_first_pipeline_stage"),
                                kwargs.get("num_layers_in_last_pipeline_stage"))
        layout.rank_layers(native_config.num_layers)
        # the stages exchange the float32 residual stream
        kwargs.update(layout.transformer_kwargs(), pipeline_dtype=LOCAL_SETTINGS["params_dtype"])
    if cp > 1:
        from miles_megatron.context_parallel import CP_COMM_TYPE, check_context_parallel

        check_context_parallel(native_config, cp)
        kwargs.update(context_parallel_size=cp, cp_comm_type=CP_COMM_TYPE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Apex/TE fallbacks
        return config_class(kwargs)(**kwargs)


def build_gpt_model(native_config: Any, recompute: bool = False, device: Any = "cpu",
                    sequence_parallel: bool = False, overrides: dict[str, Any] | None = None,
                    vp_stage: int | None = None) -> torch.nn.Module:
    """An uninitialised GPTModel (local layer spec) with its parameters on CPU for a
    native config; ``device`` is the trainer's (where Megatron's few eager buffers go);
    ``sequence_parallel`` (TP > 1): Megatron's sequence parallelism, with norms that
    allow it (:func:`miles_megatron.sequence_parallel.norms_for_sequence_parallel`);
    ``overrides``: see :func:`transformer_config`; ``vp_stage``: the model chunk (virtual
    pipeline stage) of this rank to build (None: no virtual stages)."""
    with quiet_imports():
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from miles_megatron.parallel import current_sizes, padded_vocab

    sizes = current_sizes()
    config = transformer_config(native_config, recompute, sizes.tp if sequence_parallel else 0, sizes.pp, overrides,
                                sizes.cp)
    with warnings.catch_warnings(), on_device(device):
        warnings.simplefilter("ignore")
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)  # its layers
        if config.multi_latent_attention:
            from miles_megatron.mla_spec import with_latent_core_attention

            spec = with_latent_core_attention(spec)
        if sequence_parallel:
            from miles_megatron.sequence_parallel import norms_for_sequence_parallel

            spec = norms_for_sequence_parallel(spec)
        if sizes.cp > 1:
            from miles_megatron.context_parallel import with_context_parallel_attention

            spec = with_context_parallel_attention(spec)
        from miles_megatron.sdpa_attention import with_sdpa_attention

        spec = with_sdpa_attention(spec, config)  # plain causal attention: one SDPA call, no [S, S] scores
        if native_config.moe is not None:  # the routed experts as grouped GEMMs where experts_impl says so
            from miles_megatron.grouped_experts import with_grouped_experts

            spec = with_grouped_experts(spec, native_config.moe.experts_impl)
        kwargs = gpt_model_kwargs(native_config)
        kwargs["vocab_size"] = padded_vocab(kwargs["vocab_size"], sizes.tp)  # TP splits it evenly
        if sizes.pp > 1:
            kwargs.update(_stage_kwargs(vp_stage))
        gpt = GPTModel(config, spec, **kwargs)
    for layer in gpt.decoder.layers:
        adjust_layer(layer)
    return gpt


def _stage_kwargs(vp_stage: int | None) -> dict[str, Any]:
    """GPTModel arguments of this pipeline stage (model chunk ``vp_stage`` of it under virtual
    stages): embedding on the first, final norm and output layer on the last; no embedding group, so Megatron does not all-reduce the
    tied copy at construction (it moves it with ``.cuda()``, which fails on CPU): the
    copy is loaded with the weights (:func:`miles_megatron.pipeline.stage_state`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = ProcessGroupCollection.use_mpu_process_groups()
    groups.embd = None
    virtual = dict(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    return dict(pre_process=ps.is_pipeline_first_stage(**virtual), post_process=ps.is_pipeline_last_stage(**virtual),
                pg_collection=groups, vp_stage=vp_stage)


def adjust_layer(layer: torch.nn.Module) -> None:
    """This backend's changes to a Megatron ``TransformerLayer`` (decoder and MTP layers alike)."""
    layer.self_attn_bda = layer.mlp_bda = residual_bias_dropout_add
    use_plain_linears(layer)  # F.linear where Megatron's Python linear function adds nothing (TP 1)
    if layer.config.multi_latent_attention:
        set_latent_norm_eps(layer)
    router = getattr(layer.mlp, "router", None)
    if router is not None:
        from miles_megatron.dispatcher import use_one_rank_dispatcher  # (imports Megatron's dispatchers)

        use_one_rank_dispatcher(layer.mlp)  # no host reads in the dispatch where one rank holds every expert
        # torch.compile'd token counting at every routing, read only by Megatron's expert-bias
        # update, which this backend never runs (the bias stays the checkpoint's, as in the
        # native trainer): skipped (no Dynamo trace per router, no compiler needed on GPU)
        router._apply_expert_bias = _no_expert_bias
    if router is not None and layer.mlp.attn_tp_group.size() > 1 and not layer.config.sequence_parallel:
        layer.mlp.attn_tp_group = _TensorParallelCheckOnly(layer.mlp.attn_tp_group)


class _TensorParallelCheckOnly:
    """An MoE layer's attention-TP group as its training check sees it (size 1).

    Megatron-Core 0.16 reads ``MoELayer.attn_tp_group`` only to refuse training MoE
    under TP without sequence parallelism (a performance warning raised as an error).
    Here that runs correctly: the TP ranks hold the same tokens, the all-gather
    dispatcher sends each to its expert once per rank of the EP group, and
    :mod:`miles_megatron.schedule` divides the expert gradients by those copies. Anything else asked of the group goes to the real one."""

    def __init__(self, group: Any):
        self.group = group

    def size(self) -> int:
        return 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.group, name)


def _no_expert_bias(routing_map, padding_mask=None) -> None:
    return None


def residual_bias_dropout_add(training: bool, fused: bool):
    """Megatron's ``get_bias_dropout_add`` without the cast of the residual to the branch's
    dtype: ``residual + dropout(x + bias)`` in the promoted dtype, so under autocast the
    residual stream stays float32 as in the native model (identical where all is float32)."""

    def add(x_with_bias, residual: torch.Tensor, prob: float) -> torch.Tensor:
        x, bias = x_with_bias
        if bias is not None:
            x = x + bias
        if prob:
            x = F.dropout(x, p=prob, training=training)
        return residual + x

    return add


@dataclass
class DecoderPass:
    """One forward through this rank's decoder layers (padded [S, B] layout); the MTP
    draft's loss reads the policy's last one (``hidden_SBH`` then detached)."""

    layout: PaddedLayout
    ids_SB: torch.Tensor
    positions_SB: torch.Tensor
    #: the rope of a GQA decoder (None for MLA, whose attention computes its own)
    rotary_SB1D: torch.Tensor | None
    #: this rank's output: the final-norm hidden states (under PP, the last stage's only)
    hidden_SBH: torch.Tensor
    #: under context parallelism, when ``hidden_SBH`` holds this CP rank's rows only: which
    #: (:class:`~miles_megatron.context_parallel.ContextShard`); None when it holds every row
    context: Any = None


@dataclass
class AutocastState:
    """``torch.autocast`` arguments of the latest forward."""

    device_type: str = "cpu"
    enabled: bool = False
    dtype: torch.dtype = torch.bfloat16

    def capture(self, device_type: str) -> None:
        """Take the autocast state in force now for ``device_type``."""
        self.device_type = device_type
        self.enabled = torch.is_autocast_enabled(device_type)
        self.dtype = torch.get_autocast_dtype(device_type)

    def context(self):
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)


def pin_autocast(layer: torch.nn.Module, state: AutocastState) -> None:
    """Run ``layer`` under ``state`` (see module doc: recomputation in backward)."""
    forward = layer.forward

    def forward_under_autocast(*args, **kwargs):
        with state.context():
            return forward(*args, **kwargs)

    layer.forward = forward_under_autocast


def load_native_state(gpt: torch.nn.Module, state: dict[str, torch.Tensor], native_config: Any) -> None:
    """Copy native-named (full) weights into ``gpt``, this rank's part of them under
    TP/EP/PP (:func:`~miles_megatron.parallel.rank_state`); every Megatron weight must be given."""
    from miles_megatron.parallel import current_sizes, rank_state

    megatron_state = native_to_megatron(state, native_config)
    if current_sizes().parallel:
        megatron_state = rank_state(megatron_state, gpt, native_config.vocab_size)
    missing, unexpected = gpt.load_state_dict(megatron_state, strict=False)
    missing = [name for name in missing if not name.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"native -> Megatron-Core weights do not match: missing {missing}, unexpected {unexpected}")


class MegatronPolicy(torch.nn.Module):
    """A GPTModel with the native model's trainer-facing interface (see module doc)."""

    def __init__(self, gpt: torch.nn.Module | list[torch.nn.Module], native_config: Any, routing_hooks: Any):
        """``gpt``: the GPTModel, or under virtual pipeline stages this rank's model chunks in order."""
        super().__init__()
        from miles_megatron.parallel import current_sizes

        chunks = list(gpt) if isinstance(gpt, (list, tuple)) else [gpt]
        #: the first model chunk (the only one without virtual pipeline stages)
        self.gpt = chunks[0]
        #: the further model chunks of this rank (virtual pipeline stages; names ``later_chunks.{i}.``)
        self.later_chunks = torch.nn.ModuleList(chunks[1:]) if len(chunks) > 1 else None
        #: index of the chunk the schedule runs now (:meth:`running_chunk`)
        self.running = 0
        self.config = native_config
        #: TP / EP / PP sizes this rank's part belongs to
        self.sizes = current_sizes()
        #: set by the host trainer; Megatron's recomputation is fixed when the model is built
        self.gradient_checkpointing = False
        self.replay = RouterReplayBridge(chunks, routing_hooks, native_config.moe)
        #: autocast of the last forward, re-entered by each layer (recomputation in backward)
        self.autocast_state = AutocastState()
        #: the smallest padded ``(S, B)`` of the next forwards (:mod:`miles_megatron.schedule`)
        self.pad_to: tuple[int, int] = (0, 0)
        for chunk in chunks:
            for layer in chunk.decoder.layers:
                pin_autocast(layer, self.autocast_state)

    @property
    def chunks(self) -> list[torch.nn.Module]:
        """This rank's model chunks (one GPTModel each; one without virtual pipeline stages)."""
        return [self.gpt, *(self.later_chunks or [])]

    @property
    def chunk(self) -> torch.nn.Module:
        """The model chunk the schedule runs now (see :meth:`running_chunk`)."""
        return self.chunks[self.running]

    def running_chunk(self, model: torch.nn.Module) -> None:
        """The schedule is about to run ``model`` (a chunk, or Megatron's DDP around one): the
        forward methods use that chunk."""
        model = getattr(model, "module", model)
        self.running = next(i for i, chunk in enumerate(self.chunks) if chunk is model)

    @classmethod
    def from_pretrained(cls, path: str, device: torch.device, routing_hooks: Any, recompute: bool = False,
                        sequence_parallel: bool = False, overrides: dict[str, Any] | None = None):
        """Build from an HF checkpoint directory, through the family adapter's native
        weights and :func:`~miles_megatron.weights.native_to_megatron` (``overrides``: see
        :func:`transformer_config`)."""
        from miles_host.models import load_pretrained

        native = load_pretrained(path, dtype=torch.float32, device="cpu")
        from megatron.core import parallel_state as ps

        virtual = ps.get_virtual_pipeline_model_parallel_world_size()
        stages = [None] if virtual is None else list(range(virtual))
        chunks = [build_gpt_model(native.config, recompute, device, sequence_parallel, overrides, vp_stage=stage)
                  for stage in stages]
        weights = native.state_dict()
        for gpt in chunks:
            load_native_state(gpt, weights, native.config)
            gpt.to(device)
            if not gpt.config.multi_latent_attention:  # (MLA layers keep their own rope)
                # a plain attribute, not a buffer (Megatron moves it lazily to torch.cuda.current_device())
                gpt.rotary_pos_emb.inv_freq = gpt.rotary_pos_emb.inv_freq.to(device)
        config = native.config
        del native, weights
        return cls(chunks, config, routing_hooks)

    # -- what the trainer and the loop read ----------------------------------------

    @property
    def embed_tokens(self) -> torch.nn.Module:
        return self.gpt.embedding.word_embeddings

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[V, H]`` output weight (the embedding when tied); under TP gathered from the
        vocab-parallel shards (:func:`~miles_megatron.parallel.vocab_parallel_head`)."""
        chunk = self.chunk  # the last chunk of the last stage holds the head
        if chunk.share_embeddings_and_output_weights:
            weight = chunk.shared_embedding_or_output_weight()
        else:
            weight = chunk.output_layer.weight
        if self.sizes.tp > 1:
            from miles_megatron.parallel import vocab_parallel_head

            return vocab_parallel_head(weight, self.config.vocab_size)
        return weight

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:  # noqa: D102 - native names, see module doc
        states = [{name: tensor.detach() for name, tensor in chunk.state_dict().items()
                   if not name.endswith("_extra_state")} for chunk in self.chunks]
        if self.sizes.parallel:  # a collective: every rank calls it and gets the full weights
            from miles_megatron.parallel import full_state_of_chunks

            return megatron_to_native(full_state_of_chunks(states, self.chunks, self.config.vocab_size), self.config)
        return megatron_to_native(states[0], self.config)

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True, assign: bool = False):  # noqa: D102
        for chunk in self.chunks:
            load_native_state(chunk, state, self.config)

    # -- forward ----------------------------------------------------------------------

    def decoder_pass(self, input_ids_T, positions_T, cu_seqlens, routing=None,
                     gather_context: bool = True) -> DecoderPass:
        """This rank's layers on packed sequences: the embedding (first pipeline stage; a later
        stage's decoder reads what the schedule received, ``set_input_tensor``), then the
        decoder layers, padded to at least :attr:`pad_to`. Under context parallelism the
        layers run on this CP rank's rows and the last stage gathers the group's
        (:mod:`miles_megatron.context_parallel`), unless ``gather_context`` is False."""
        device = input_ids_T.device
        gpt = self.chunk
        sequence_parallel = gpt.config.sequence_parallel
        cp = self.sizes.cp
        # sequence parallelism splits the sequence dim over the TP ranks, context parallelism into 2 * CP
        # chunks: pad it to a multiple
        multiple = (self.sizes.tp if sequence_parallel else 1) * (2 * cp if cp > 1 else 1)
        layout = PaddedLayout.from_cu_seqlens(cu_seqlens, device, multiple=multiple, at_least=self.pad_to)
        self.replay.set_forward(routing, layout)
        self.autocast_state.capture(device.type)
        ids_SB = layout.to_sb(input_ids_T)
        positions_SB = layout.to_sb(positions_T)
        mask, shard = layout.causal_mask(), None
        if cp > 1:
            from miles_megatron.context_parallel import ContextShard

            shard = ContextShard.current(layout.seq_len, device)
            ids_SB, positions_SB, mask = shard.take(ids_SB), shard.take(positions_SB), shard.causal_mask()
        with on_device(device):
            x_SBH = None  # a later stage: the decoder's input tensor
            if gpt.pre_process:
                x_SBH = gpt.embedding(input_ids=ids_SB.t(), position_ids=positions_SB.t())
            rotary_SB1D = None  # MLA: the attention ropes each token by its index in the sequence
            if not gpt.config.multi_latent_attention:
                # [P, 1, D], every position (packed_seq: Megatron would keep its CP rank's part of the table)
                positions = int(host_values(positions_T).max()) + 1  # (a packed batch's: its host copy)
                freqs_PD = gpt.rotary_pos_emb(positions, packed_seq=True)[:, 0]
                rotary_SB1D = freqs_PD[positions_SB]
            hidden_SBH = gpt.decoder(
                hidden_states=x_SBH, attention_mask=mask, rotary_pos_emb=rotary_SB1D
            )
            # this rank's sequence shard -> every position (the head is gathered too); a PP stage
            # before the last passes its shard on to the next stage's same TP rank
            if sequence_parallel and gpt.post_process:
                from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

                hidden_SBH = gather_from_sequence_parallel_region(hidden_SBH, tensor_parallel_output_grad=False)
            if shard is not None and gpt.post_process and gather_context:  # the CP group's rows, in order
                hidden_SBH, shard = shard.gather_sequence(hidden_SBH), None
        return DecoderPass(layout, ids_SB, positions_SB, rotary_SB1D, hidden_SBH, shard)

    def stage_forward(self, batch: Any) -> torch.Tensor:
        """A pipeline stage before the last: its output ``[S, B, H]`` (this TP rank's sequence
        shard under sequence parallelism), what the schedule sends to the next stage."""
        run = self.decoder_pass(batch.input_ids_T, batch.positions_T, batch.cu_seqlens, batch.routing)
        return run.hidden_SBH.to(self.chunk.config.pipeline_dtype)

    def forward_hidden(self, input_ids_T, positions_T, cu_seqlens, routing=None) -> torch.Tensor:
        """Final-norm hidden states ``[T, H]`` of packed sequences (under PP on the last stage,
        inside Megatron's schedule: :mod:`miles_megatron.schedule`)."""
        if not self.chunk.post_process:
            raise RuntimeError("forward_hidden: this pipeline stage has no final layers; the stages run together "
                               "in miles_megatron.schedule")
        run = self.decoder_pass(input_ids_T, positions_T, cu_seqlens, routing)
        if self.has_mtp_draft:  # what the draft's loss reads (no second forward)
            self.last_forward = dataclasses.replace(run, hidden_SBH=run.hidden_SBH.detach())
        return run.layout.from_sb(run.hidden_SBH)

    def attach_mtp_draft(self, num_layers: int = 1) -> None:
        """Give the policy an MTP draft layer (miles-spec's ``--enable-mtp-training``)."""
        from miles_megatron.mtp import attach_mtp_block

        if self.sizes.cp > 1:
            raise ValueError("--enable-mtp-training with --context-parallel-size > 1 is not supported by "
                             "--train-backend megatron (the draft reads whole sequences); use CP 1")
        attach_mtp_block(self, num_layers)
        self.last_forward = None

    @property
    def has_mtp_draft(self) -> bool:
        return getattr(self.gpt, "mtp", None) is not None

    def mtp_draft_log_probs(self, batch: Any, rows_R: torch.Tensor, targets_R: torch.Tensor) -> torch.Tensor:
        """The draft's log-probs of ``x_{t+2}`` at packed rows ``rows_R`` of the last forward's batch."""
        from miles_megatron.mtp import draft_log_probs

        return draft_log_probs(self, batch, rows_R, targets_R)

    def packed_log_probs(
        self,
        input_ids_T: torch.Tensor,
        positions_T: torch.Tensor,
        cu_seqlens: torch.Tensor,
        target_ids_T: torch.Tensor,
        temperature: float = 1.0,
        ctx: Any = None,
        chunk_size: int = 1024,
        return_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``CausalLM.packed_log_probs`` on Megatron-Core."""
        from miles_host.models.logprobs import chunked_log_probs

        if ctx is not None and ctx.batch_invariant:
            raise ValueError("--true-on-policy (batch-invariant forward) is not supported by --train-backend megatron")
        routing = ctx.routing if ctx is not None else None
        if self.sizes.cp > 1:  # each CP rank its rows' log-probs, then the group's gathered
            run = self.decoder_pass(input_ids_T, positions_T, cu_seqlens, routing, gather_context=False)
            rows, batch, hidden = run.hidden_SBH.shape
            targets_N = run.context.take(run.layout.to_sb(target_ids_T)).reshape(-1)
            values = chunked_log_probs(
                run.hidden_SBH.reshape(rows * batch, hidden), self.lm_head_weight, targets_N,
                temperature=temperature, chunk_size=chunk_size, return_entropy=return_entropy,
            )
            return tuple(  # type: ignore[return-value]
                None if v is None else run.layout.from_sb(run.context.gather_sequence(v.view(rows, batch)))
                for v in values
            )
        hidden_TH = self.forward_hidden(input_ids_T, positions_T, cu_seqlens, routing)
        return chunked_log_probs(
            hidden_TH, self.lm_head_weight, target_ids_T,
            temperature=temperature, chunk_size=chunk_size, return_entropy=return_entropy,
        )
