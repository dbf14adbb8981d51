"""Packed sequences (several sequences in one row, positions restarting, no cache: TRL's
``padding_free``, verl's ``use_remove_padding``) through a patched model: each sequence gets
the bits of its forward alone, from transformers' packed mask and from flash-attention's
varlen keywords; the unpatched model's packed forward differs (the negative control); what
cannot be packed exactly is refused."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bik
from bik import testing

# attention only, sliding windows and sinks, multi-head latent attention, experts
FAMILIES = ["qwen3", "llama", "gemma3_text", "gpt_oss", "deepseek_v3", "mixtral"]
NO_PACKED_MASK = {"gpt_oss"}  # its transformers model masks a packed row as one sequence


def _patched(family: str, dtype: torch.dtype = torch.float32):
    model = testing.load_model(f"tiny-{family}", dtype=dtype)
    bik.patch_model(model)
    return model


def _packed_inputs(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 100, (1, sum(lengths)), generator=torch.Generator().manual_seed(seed))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, positions


def _alone(model, ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    cuts = [0, *itertools.accumulate(lengths)]
    with torch.no_grad():
        return torch.cat(
            [
                model(input_ids=ids[:, a:b], use_cache=False).logits
                for a, b in itertools.pairwise(cuts)
            ],
            dim=1,
        )


def _cu(lengths: list[int]) -> dict[str, torch.Tensor | int]:
    cuts = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    longest = max(lengths)
    return {
        "cu_seq_lens_q": cuts,
        "cu_seq_lens_k": cuts,
        "max_length_q": longest,
        "max_length_k": longest,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_packed_row_gives_each_sequence_its_bits_alone(family, dtype):
    """Packed as flash-attention's varlen keywords say, and (in the families whose
    transformers builds a packed mask from restarting positions; gpt-oss's does not) as
    transformers' mask says."""
    model = _patched(family, dtype)
    lengths = [5, 17, 1, 9]  # a one-token sequence, and lengths across the key blocks
    ids, positions = _packed_inputs(lengths)
    expected = _alone(model, ids, lengths)
    with torch.no_grad():
        varlen = model(input_ids=ids, position_ids=positions, use_cache=False, **_cu(lengths))
        assert torch.equal(varlen.logits, expected)
        if family not in NO_PACKED_MASK:
            from_mask = model(input_ids=ids, position_ids=positions, use_cache=False).logits
            assert torch.equal(from_mask, expected)


@settings(max_examples=8, deadline=None)
@given(st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=3), min_size=2, max_size=2))
def test_two_packed_rows_of_random_lengths_equal_their_sequences_alone(rows):
    """Two rows of packed sequences, the shorter row right-padded with a sequence of its own
    (as a collator fills a row), each sequence equal to its forward alone."""
    model = _patched("qwen3")
    width = max(sum(r) for r in rows)
    rows = [r + [width - sum(r)] if sum(r) < width else r for r in rows]
    packed = [_packed_inputs(r, seed=i) for i, r in enumerate(rows)]
    ids = torch.cat([p[0] for p in packed])
    positions = torch.cat([p[1] for p in packed])
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    for i, r in enumerate(rows):
        assert torch.equal(logits[i : i + 1], _alone(model, packed[i][0], r))


def test_the_unpatched_models_packed_forward_differs_from_alone():
    """The negative control: plain transformers (SDPA) gives a packed sequence other bits
    than its forward alone (counted)."""
    model = testing.load_model("tiny-qwen3")
    lengths = [23, 41, 30]
    ids, positions = _packed_inputs(lengths)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    differing = int((packed != _alone(model, ids, lengths)).sum())
    assert differing > 0, "SDPA's packed forward matched the sequences alone bit for bit"


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"cu_seq_lens_q": torch.tensor([0, 4, 9], dtype=torch.int32)}, r"does not cut one row"),
        (
            {
                "cu_seq_lens_q": torch.tensor([0, 4, 12], dtype=torch.int32),
                "cu_seq_lens_k": torch.tensor([0, 6, 12], dtype=torch.int32),
            },
            r"cu_seq_lens_k differs from cu_seq_lens_q",
        ),
    ],
)
def test_varlen_keywords_that_do_not_pack_whole_sequences_are_refused(keywords, message):
    model = _patched("qwen3")
    ids, positions = _packed_inputs([4, 8])
    with pytest.raises(NotImplementedError, match=message), torch.no_grad():
        model(input_ids=ids, position_ids=positions, use_cache=False, **keywords)


def test_packing_a_model_with_recurrent_layers_is_refused():
    """A Gated DeltaNet layer's state would run from one packed sequence into the next."""
    model = _patched("qwen3_next")
    ids, positions = _packed_inputs([6, 6])
    refused = pytest.raises(NotImplementedError, match="packed sequences in a model with recurrent")
    with refused, torch.no_grad():
        model(input_ids=ids, position_ids=positions, use_cache=False)
