"""vLLM's layers routed to bik: the numerics both sides of a rollout/training pair share.

RMSNorm, SiLU-and-multiply and the rotary embedding are replaced through vLLM's out-of-tree
custom-op registry (``CustomOp.register_oot``): every one vLLM builds afterwards is bik's
subclass. Unquantized linear layers (the fused QKV and gate/up projections included) and the
LM head run ``bik.linear``; bik keeps their weights as loaded (vLLM's CPU path would repack
them for oneDNN), so a weight update written into the parameters is what the next step uses.
Each replacement computes what the bik-patched Hugging Face model computes for the same
layer, in the same dtype, so the two give the same bits.

With ``tp_invariant`` on, the layers tensor parallelism splits follow bik's TP-invariant
order (bik.contract): a row-parallel linear reduces its K slice in ``TP_CHUNKS / T`` chunks
into one fp32 partial, the ranks' partials are all-gathered and summed in rank order by the
top of the same tree (vLLM's all-reduce is not called), so every TP degree gives the bits of
``bik.patch_model(model, tp_invariant=True)``. The vocab-parallel embedding gathers the ranks'
rows instead of all-reducing them, each rank filling the rows it does not own with -0.0, the
identity of addition (+0.0 is not: -0.0 + 0.0 = +0.0), so the sum is the owner's row exactly.
The LM head needs nothing: vLLM gathers its vocab shards' logits before the sampler.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar, cast

import torch
from vllm.distributed import split_tensor_along_last_dim
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.activation import (
    GeluAndMul,
    ReLUSquaredActivation,
    SiluAndMul,
)
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm, RMSNormGated
from vllm.model_executor.layers.linear import RowParallelLinear, UnquantizedLinearMethod
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import (
    DeepseekScalingRotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.yarn_scaling_rope import (
    YaRNScalingRotaryEmbedding,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
    get_masked_input_and_mask,
)
from vllm.model_executor.models.qwen3_next import Qwen3NextAttention
from vllm.model_executor.models.transformers.fusers.rms_norm import TPAwareRMSNorm

from ..layers.rotary import apply_rotary, apply_rotary_pairs, default_inv_freq, rotary_cos_sin
from ..ops.activations import gelu_tanh, sigmoid, silu_and_mul
from ..ops.matmul import linear
from ..ops.rms_norm import gated_rms_norm, gemma_rms_norm, rms_norm_like_transformers
from . import gdn, mamba2, mla, moe
from .ranks import gather_tp_ranks, row_parallel_in_order


class BikRMSNorm(RMSNorm):
    """``rms_norm(x + residual)``; the residual sum is rounded in the activations' dtype, as
    the Hugging Face decoder layer's ``residual + hidden_states``."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.variance_size_override is not None:
            raise NotImplementedError("bik.vllm: RMSNorm over part of the hidden size")
        # self.weight: all ones when the norm has no weight of its own
        norm = functools.partial(
            rms_norm_like_transformers, weight=self.weight, eps=self.variance_epsilon
        )
        return _after_residual(norm, x, residual)


class BikGemmaRMSNorm(GemmaRMSNorm):
    """Gemma's RMSNorm (Qwen3.5's, Qwen3-Next's): ``x * inv_rms * (1 + w)`` in fp32 after the
    residual sum rounded in the activations' dtype, as the Hugging Face decoder layer adds."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        norm = functools.partial(gemma_rms_norm, weight=self.weight, eps=self.variance_epsilon)
        return _after_residual(norm, x, residual)


def _after_residual(
    norm: Any, x: torch.Tensor, residual: torch.Tensor | None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """vLLM's fused norm call: ``norm(x)``, or with a residual ``(norm(x + residual), x +
    residual)``, the sum rounded in the activations' dtype as the Hugging Face decoder
    layer's ``residual + hidden_states``."""
    if residual is None:
        return norm(x)
    x = x + residual
    return norm(x), x


class BikRMSNormGated(RMSNormGated):
    """The gated RMSNorm after a Gated DeltaNet layer: transformers' ``RMSNormGated`` (the
    norm of the whole row, then the gate), as bik.ops.rms_norm.gated_rms_norm computes it;
    other forms (grouped, the gate before the norm) are refused when vLLM builds the layer."""

    def __init__(self, hidden_size: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(hidden_size, *args, **kwargs)
        activation = "silu" if self.activation == "swish" else self.activation
        if self.group_size not in (None, hidden_size) or not self.norm_before_gate:
            raise NotImplementedError(
                "bik.vllm: a gated RMSNorm over groups of channels or with the gate applied "
                "before the norm"
            )
        if activation not in ("silu", "sigmoid"):
            raise NotImplementedError(f"bik.vllm: a gated RMSNorm with activation {activation!r}")
        self.bik_activation = activation

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        if z is None:
            raise NotImplementedError("bik.vllm: a gated RMSNorm called without its gate")
        return gated_rms_norm(x, z, self.weight, self.eps, self.bik_activation)


class BikGeluAndMul(GeluAndMul):
    """Gemma's gated MLP activation: ``gelu_tanh(gate) * up`` with bik.gelu_tanh (the patched
    trainer's ``act_fn``; torch's fp32 kernels' bits depend on the layout), the product in the
    activations' dtype as the Hugging Face MLP multiplies; the exact (erf) GELU is refused."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__(approximate)
        if approximate != "tanh":
            raise NotImplementedError(
                f"bik.vllm: a GELU-and-multiply with approximate={approximate!r} (bik computes "
                "the tanh approximation)"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return gelu_tanh(x[..., :half]) * x[..., half:]


class BikReLUSquaredActivation(ReLUSquaredActivation):
    """Nemotron-H's squared ReLU, transformers' formula (``square(relu(x))``: two exact
    elementwise steps, the same bits in any layout)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.square(torch.relu(x))


class BikTPAwareRMSNorm(TPAwareRMSNorm, BikRMSNorm):
    """The RMSNorm vLLM's Transformers backend puts in place of transformers' (OLMo-3,
    SmolLM3): bik's, over the whole row (vLLM's mixin gathers a TP-sharded input first).
    A subclass of vLLM's class, so that vLLM's registry initialises it as one."""


class BikSiluAndMul(SiluAndMul):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


class BikRotaryEmbedding(RotaryEmbedding):
    """Half-rotation ("neox") RoPE over the first ``rotary_dim`` dims of each head (all of
    them, or part: GLM-4.5's partial rotary), the rest passed through, cos/sin from bik's
    formula; transformers' partial RoPE rotates and concatenates the same way. Interleaved
    (GPT-J style) RoPE only for a model whose config asks transformers for DeepSeek's
    interleaved pairs (``rope_interleave``), laid out as transformers lays them out: vLLM's
    latent attention only dots the rotated part of queries with that of keys, so both sides
    must hold the same dims in the same order for the sums to run alike."""

    bik_inv_freq: torch.Tensor  # a buffer (register_buffer below)

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: torch.dtype,
        init_cache: bool = True,
    ) -> None:
        self.bik_pairs = not is_neox_style and _config_rope_interleave()
        if not is_neox_style and not self.bik_pairs:
            raise NotImplementedError(
                "bik.vllm: interleaved (GPT-J style) rotary embedding is supported for a model "
                "whose config sets rope_interleave (DeepSeek-V3) only"
            )
        super().__init__(
            head_size,
            rotary_dim,
            max_position_embeddings,
            base,
            is_neox_style,
            dtype,
            init_cache=False,
        )
        self.register_buffer("bik_inv_freq", default_inv_freq(base, rotary_dim), persistent=False)
        self.bik_scaling = 1.0  # the cos/sin scale (YaRN's attention factor)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        cos, sin = rotary_cos_sin(self.bik_inv_freq, positions, self.bik_scaling, query.dtype)
        cos, sin = cos[:, None], sin[:, None]  # [T, 1, rotary_dim] against [T, heads, D]
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate(
        self, x: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor | None:
        if x is None:
            return None
        heads = x.view(x.shape[0], -1, self.head_size)
        rotate = apply_rotary_pairs if self.bik_pairs else apply_rotary
        out = rotate(heads[..., : self.rotary_dim], cos, sin)
        if self.rotary_dim < self.head_size:
            out = torch.cat((out, heads[..., self.rotary_dim :]), dim=-1)
        return out.view(x.shape)


def _config_rope_interleave() -> bool:
    """Whether the model vLLM is building asks transformers for interleaved RoPE."""
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config().model_config.hf_text_config
    return bool(getattr(config, "rope_interleave", False))


# transformers' YaRN defaults for keys a config may leave out
_YARN_DEFAULTS = {"beta_fast": 32, "beta_slow": 1, "truncate": True}


def _take_transformers_yarn(
    rope: BikRotaryEmbedding, rotary_dim: int, asked: dict[str, Any], defaults: dict[str, Any]
) -> None:
    """Give ``rope`` the inverse frequencies and cos/sin scale that transformers' own YaRN
    function computes from the engine's model config (the trainer's rotary module calls the
    same function, so both sides start from the same bits), after checking that vLLM's
    arguments ``asked`` are that config's (``defaults`` for keys it leaves out)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config().model_config.hf_text_config
    given = dict(getattr(config, "rope_parameters", None) or {})
    differs = sorted(
        key for key, value in asked.items() if given.get(key, defaults.get(key)) != value
    )
    if differs or getattr(config, "head_dim", rotary_dim) != rotary_dim:
        settings = ", ".join(differs) or "its width"
        raise NotImplementedError(
            f"bik.vllm: a YaRN rotary embedding whose settings ({settings}) are not the "
            "model config's rope_parameters: bik computes RoPE as transformers computes it "
            "from the config"
        )
    inv_freq, rope.bik_scaling = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    rope.bik_inv_freq = inv_freq.float()


class _TransformersYaRN:
    """A YaRN layer of vLLM's, built by vLLM's own ``__init__`` (``VLLM_INIT``) over
    BikRotaryEmbedding (which builds no cos/sin cache and gives the forward), then given
    transformers' YaRN frequencies and scale (:func:`_take_transformers_yarn`), its arguments
    checked against the config (``ROPE_TYPE``: how the engine's config names its RoPE;
    ``DEFAULTS``: what vLLM assumes for absent keys)."""

    VLLM_INIT: ClassVar[Callable[..., None]]
    ROPE_TYPE: ClassVar[str]
    DEFAULTS: ClassVar[dict[str, Any]]

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        scaling_factor: float,
        dtype: torch.dtype,
        **yarn: Any,
    ) -> None:
        type(self).VLLM_INIT(  # vLLM's own, over BikRotaryEmbedding (the MRO)
            self,
            head_size,
            rotary_dim,
            max_position_embeddings,
            base,
            is_neox_style,
            scaling_factor,
            dtype,
            **yarn,
        )
        asked = dict(
            rope_type=self.ROPE_TYPE,
            rope_theta=base,
            factor=scaling_factor,
            original_max_position_embeddings=max_position_embeddings,
            **{key: value for key, value in yarn.items() if key != "init_cache"},
        )
        _take_transformers_yarn(cast(BikRotaryEmbedding, self), rotary_dim, asked, self.DEFAULTS)


class BikYaRNRotaryEmbedding(_TransformersYaRN, YaRNScalingRotaryEmbedding, BikRotaryEmbedding):
    """YaRN RoPE (gpt-oss)."""

    VLLM_INIT = YaRNScalingRotaryEmbedding.__init__
    ROPE_TYPE = "yarn"
    DEFAULTS = _YARN_DEFAULTS


class BikDeepseekScalingRotaryEmbedding(
    _TransformersYaRN, DeepseekScalingRotaryEmbedding, BikRotaryEmbedding
):
    """DeepSeek-V3's YaRN RoPE (Kimi K2), interleaved; the attention's softmax scale (mscale
    squared) is the model's, which vLLM and transformers compute by one formula."""

    VLLM_INIT = DeepseekScalingRotaryEmbedding.__init__
    ROPE_TYPE = "deepseek_yarn"  # vLLM renames the engine config's "yarn" for DeepSeek
    # transformers reads an absent mscale as 1 and an absent mscale_all_dim as none: the same
    DEFAULTS: ClassVar[dict[str, Any]] = {**_YARN_DEFAULTS, "mscale": 1, "mscale_all_dim": 0}


def _gated_attention_forward(self: Any, positions: torch.Tensor, hidden_states: torch.Tensor):
    """Qwen3NextAttention.forward (Qwen3.5's, Qwen3-Next's full attention) with the output
    gate's sigmoid through bik.sigmoid, as the trainer computes it (torch's fp32 sigmoid
    depends on the tensor's layout on a CPU)."""
    qkv, _ = self.qkv_proj(hidden_states)
    query, key, value, gate = self._project_qkv_gate(qkv, positions)
    out = self.attn(query, key, value)
    if gate is not None:
        out = out * sigmoid(gate)
    output, _ = self.o_proj(out)
    return output


def _linear_apply(self, layer, x, bias=None):
    return linear(x, layer.weight, bias)


def _keep_weights(self, layer):
    """bik reads ``layer.weight`` as loaded: nothing to repack."""


def _row_parallel_forward(
    self: RowParallelLinear, input_: torch.Tensor
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
    """RowParallelLinear.forward in the TP-invariant order (:func:`row_parallel_in_order`)."""
    if not self.reduce_results:
        raise NotImplementedError(
            "bik.vllm tp_invariant: a row-parallel linear whose sum a later layer takes "
            "(reduce_results=False) would be reduced in vLLM's order"
        )
    x = input_
    if not self.input_is_parallel:
        x = split_tensor_along_last_dim(input_, num_partitions=self.tp_size)[self.tp_rank]
    output = row_parallel_in_order(self, x)
    if not self.return_bias:
        return output
    return output, self.bias if self.skip_bias_add else None


def _vocab_parallel_embedding_forward(
    self: VocabParallelEmbedding, input_: torch.Tensor
) -> torch.Tensor:
    """The rows of ``input_``'s token ids: looked up on the rank that owns each id, the
    others' rows -0.0, gathered and added in rank order (exact; see the module doc)."""
    if self.tp_size == 1:
        return self.quant_method.embedding(self, input_.long())
    if not self.reduce_results or self.parallel_group is not None:
        raise NotImplementedError(
            "bik.vllm tp_invariant: a vocab-parallel embedding that is not reduced over the "
            "TP group"
        )
    shard = self.shard_indices
    masked, foreign = get_masked_input_and_mask(
        input_,
        shard.org_vocab_start_index,
        shard.org_vocab_end_index,
        shard.num_org_vocab_padding,
        shard.added_vocab_start_index,
        shard.added_vocab_end_index,
    )
    rows = self.quant_method.embedding(self, masked.long()).masked_fill(foreign.unsqueeze(-1), -0.0)
    ranks = gather_tp_ranks(self.tp_size, rows)
    out = ranks[0]
    for other in ranks[1:]:
        out = out + other
    return out


Method = tuple[type, str, Callable]  # (vLLM's class, the method's name, bik's method)


@dataclasses.dataclass(frozen=True)
class EngineLayers:
    """What computes one layer kind in vLLM: bik's subclasses of vLLM's custom ops, by the
    op's name in vLLM's registry, and bik's methods set on vLLM's classes."""

    ops: dict[str, type[CustomOp]] = dataclasses.field(default_factory=dict)
    methods: tuple[Method, ...] = ()


# bik's vLLM layers by layer kind, keyed by the names bik.hf.kinds gives the kinds (and the
# report, and bik.families): tests/integrations/test_vllm_errors.py checks that every kind is
# here, computed by the MoE runner's forward, or refused in vLLM.
ENGINE_LAYERS: dict[str, EngineLayers] = {
    "linear": EngineLayers(  # unquantized linears and the LM head, on the weights as loaded
        methods=(
            (UnquantizedLinearMethod, "apply", _linear_apply),
            (UnquantizedLinearMethod, "process_weights_after_loading", _keep_weights),
            (UnquantizedEmbeddingMethod, "apply", _linear_apply),
        )
    ),
    "rms_norm": EngineLayers({"RMSNorm": BikRMSNorm, "TPAwareRMSNorm": BikTPAwareRMSNorm}),
    "gemma_rms_norm": EngineLayers({"GemmaRMSNorm": BikGemmaRMSNorm}),
    "gated_rms_norm": EngineLayers({"RMSNormGated": BikRMSNormGated}),
    "silu": EngineLayers({"SiluAndMul": BikSiluAndMul}),
    "gelu_tanh": EngineLayers({"GeluAndMul": BikGeluAndMul}),
    # Nemotron-H's MLP activation: elementwise in transformers (no kind there), a custom op here
    "relu_squared": EngineLayers({"ReLUSquaredActivation": BikReLUSquaredActivation}),
    "rotary": EngineLayers(
        {
            "RotaryEmbedding": BikRotaryEmbedding,
            "YaRNScalingRotaryEmbedding": BikYaRNRotaryEmbedding,
            "DeepseekScalingRotaryEmbedding": BikDeepseekScalingRotaryEmbedding,
        }
    ),
    # plain attention: vLLM's Attention on bik's backend (bik.vllm.attention); latent attention
    # (DeepSeek-V3) in the trainer's form
    "attention": EngineLayers(methods=mla.PATCHED_METHODS),
    "gated_attention": EngineLayers(
        methods=((Qwen3NextAttention, "forward", _gated_attention_forward),)
    ),
    # the router, the experts and the block in one runner's forward (bik.vllm.moe)
    "experts": EngineLayers(methods=moe.PATCHED_METHODS),
    "gated_delta_net": EngineLayers(methods=gdn.PATCHED_METHODS),
    "mamba2_mixer": EngineLayers(methods=mamba2.PATCHED_METHODS),
}
BIK_LAYERS = tuple(cls for layers in ENGINE_LAYERS.values() for cls in layers.ops.values())
_TP_INVARIANT_FORWARDS = (
    (RowParallelLinear, _row_parallel_forward),
    (VocabParallelEmbedding, _vocab_parallel_embedding_forward),
)
_VLLM_FORWARDS = {owner: owner.forward for owner, _ in _TP_INVARIANT_FORWARDS}


# transformers' module kinds (bik.hf.kinds) vLLM's Transformers backend leaves in the model
# that bik computes: a module that reduces nothing itself, the attention module (its kernel is
# vLLM's Attention, bik's backend), and the two patched below.
TRANSFORMERS_KINDS = (None, "attention", "rotary", "silu", "gelu_tanh")


def patch_transformers_modules(model: torch.nn.Module, model_type: str) -> None:
    """vLLM's Transformers backend (OLMo-3, SmolLM3) builds transformers' own model and swaps
    its linears, norms, activation-and-mul and attention kernel for vLLM layers (bik's, here);
    what stays transformers' runs the trainer's code. Of that, the rotary embeddings get the
    forward bik.patch_model gives the trainer's (the same cos/sin bits) and activations bik's;
    check_model refuses any other kind that reduces."""
    from ..families import FAMILIES
    from ..hf.forwards import Activation, EagerRotary
    from ..hf.kinds import module_kind

    family = FAMILIES.get(model_type)
    for module in model.modules():
        if not _from_transformers(module):
            continue
        kind = module_kind(module, family)
        if kind == "rotary":
            module.forward = EagerRotary(module, family is not None and family.bik_rotary)
        elif kind in ("silu", "gelu_tanh"):
            module.forward = Activation(kind)


def _from_transformers(module: torch.nn.Module) -> bool:
    return type(module).__module__.startswith("transformers.")


def transformers_module_problem(name: str, module: torch.nn.Module, model_type: str) -> str | None:
    """Why ``module`` (one of transformers' own, left in a vLLM model) would compute with
    numerics bik does not vouch for, or None."""
    from ..families import FAMILIES
    from ..hf.kinds import module_kind

    family = FAMILIES.get(model_type)
    if family is None:
        return f"{name} ({type(module).__name__}): a module of a family bik does not support"
    kind = module_kind(module, family)
    if kind in TRANSFORMERS_KINDS:
        return None
    return f"{name} ({type(module).__name__}): transformers' {kind} module, not computed by bik"


def install() -> None:
    """Register bik's layers with vLLM (once per process)."""
    from vllm.model_executor.custom_op import op_registry_oot

    for layers in ENGINE_LAYERS.values():
        for name, cls in layers.ops.items():
            if op_registry_oot.get(name) is not cls:
                CustomOp.register_oot(cls, name=name)
        for owner, name, method in layers.methods:
            setattr(owner, name, method)


def use_tp_invariant(on: bool) -> None:
    """Run the row-parallel linears and the vocab-parallel embedding in the TP-invariant order
    (``on``), or in vLLM's own (whose bits at TP 1 are bik.linear's)."""
    for owner, forward in _TP_INVARIANT_FORWARDS:
        owner.forward = forward if on else _VLLM_FORWARDS[owner]
