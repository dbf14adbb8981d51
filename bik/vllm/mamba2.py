"""vLLM's Mamba2 mixers (Nemotron-H) routed to bik: the short causal convolution and the
selective scan in bik.layers' fixed orders over vLLM's pooled states (bik.vllm.recurrent),
and the gated group RMSNorm on the scan's fp32 output, as the bik-patched trainer computes
them (bik.hf.linear_attention.Mamba2Mixer), so prompts, chunked prefills and decode steps
give the trainer's bits.

vLLM's ``MambaMixer2.forward`` calls one op for the convolution and the scan (its chunked SSD
kernels for prompts, a recurrent kernel for decode steps) and rounds the scan's output to the
model's dtype before the norm; bik replaces the forward: the projections stay the mixer's
linears (bik's here), each sequence of a step (decodes first, then prefills, vLLM's order)
runs its convolution and scan from its own slots, and the norm takes the fp32 output.
"""

from typing import Any

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2, Mixer2RMSNormGated

from ..layers.mamba2 import selective_scan
from ..ops.activations import silu, softplus
from ..ops.rms_norm import rms_norm
from .recurrent import convolve, slots, state_pools


def _forward(
    self: Any, hidden_states: torch.Tensor, mup_vector: torch.Tensor | None = None
) -> torch.Tensor:
    """MambaMixer2.forward with bik's convolution, scan and gated group norm."""
    if mup_vector is not None:
        raise NotImplementedError("bik.vllm: a Mamba2 mixer with a muP vector")
    projected, _ = self.in_proj(hidden_states)
    sizes = [self.tped_intermediate_size, self.tped_conv_size, self.tped_dt_size]
    gate, mixed, dt = projected.split(sizes, dim=-1)
    y = torch.zeros(
        (hidden_states.shape[0], self.num_heads // self.tp_size, self.head_dim),
        dtype=torch.float32,
        device=hidden_states.device,
    )
    metadata = get_forward_context().attn_metadata
    if metadata is not None:  # None: vLLM's warm-up run
        _core(self, metadata[self.prefix], mixed, dt, y)
    y = _gated_group_norm(self.norm, y.reshape(y.shape[0], -1), gate)
    output, _ = self.out_proj(y.to(hidden_states.dtype))
    return output


def _sequences(metadata: Any) -> list[tuple[int, int, int, bool]]:
    """(first token, end, state slot, resumes its state) of each sequence of the step: the
    decodes (one token each) first, then the prefills."""
    if metadata.num_accepted_tokens is not None:
        raise NotImplementedError("bik.vllm: speculative decoding in a Mamba2 mixer")
    decodes = metadata.num_decodes
    spans = []
    if decodes:  # [decodes, 1]: no speculative tokens
        for i, slot in enumerate(slots(metadata.state_indices_tensor_d[:decodes, 0])):
            spans.append((i, i + 1, slot, True))
    if metadata.num_prefills:
        starts = metadata.query_start_loc_p.tolist()
        offset = metadata.num_decode_tokens - starts[0]  # the prefills follow the decodes
        resumes = metadata.has_initial_states_p.tolist()
        indices = slots(metadata.state_indices_tensor_p)
        for i, (slot, resume) in enumerate(zip(indices, resumes)):
            spans.append((starts[i] + offset, starts[i + 1] + offset, slot, resume))
    return spans


def _core(
    layer: Any, metadata: Any, mixed: torch.Tensor, dt: torch.Tensor, y: torch.Tensor
) -> None:
    """Each sequence's convolution and scan, its output written into ``y [T, H, P]``."""
    conv_states, ssm_states = state_pools(layer, "Mamba2")
    low, high = layer._bik_time_step_limit  # set by problem()
    groups = layer.n_groups // layer.tp_size
    for lo, hi, slot, resume in _sequences(metadata):
        convolved = silu(convolve(layer, mixed[lo:hi], conv_states[slot], resume))
        width = groups * layer.ssm_state_size
        x, b, c = torch.split(convolved, [y.shape[1] * y.shape[2], width, width], dim=-1)
        if not resume:
            ssm_states[slot].zero_()
        step = softplus(dt[lo:hi].float() + layer.dt_bias.float()).clamp(min=low, max=high)
        out, state = selective_scan(
            x.reshape(1, hi - lo, -1, layer.head_dim),
            step[None],
            layer.A,  # -exp(A_log) in fp32, as vLLM's loader and transformers compute it
            b.reshape(1, hi - lo, groups, -1),
            c.reshape(1, hi - lo, groups, -1),
            layer.D,
            ssm_states[slot][None],
        )
        ssm_states[slot].copy_(state[0])
        y[lo:hi] = out[0]


def _gated_group_norm(norm: Any, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``weight * rms_norm_per_group(y * silu(gate))`` in fp32, as the trainer's
    (bik.hf.linear_attention.Mamba2Mixer)."""
    gated = y * silu(gate.float())
    groups = gated.reshape(-1, norm.group_size)
    ones = torch.ones(norm.group_size, dtype=torch.float32, device=y.device)
    normed = rms_norm(groups, ones, norm.variance_epsilon)
    return norm.weight.float() * normed.reshape(y.shape)


PATCHED_METHODS = ((MambaMixer2, "forward", _forward),)
UNCALLED = (Mixer2RMSNormGated,)  # the mixer's norm: bik's forward computes it from its weight


def problem(name: str, mixer: Any, hf_config: Any) -> str | None:
    """Why bik cannot run ``mixer`` as the trainer does, or None; with none, the mixer gets the
    trainer's step limit (transformers clamps the step to ``(time_step_min, inf)``, vLLM does
    not)."""
    if mixer.tp_size != 1 or not mixer.use_rms_norm or mixer.activation != "silu":
        return f"{name} (MambaMixer2): tensor parallelism, no gated norm or another activation"
    mixer._bik_time_step_limit = (getattr(hf_config, "time_step_min", 0.0), float("inf"))
    return None
