"""torch.compile(patched model) gives the eager model's bits, so a compiled rollout and an
eager trainer agree; plain torch's compiled forward does not."""

import copy

import pytest
import torch

import bik
from bik import testing
from bik.hf import generation_position_ids

pytest.importorskip("transformers")

_TORCH_VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2])


def _left_padded_batch():
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=gen) for n in (9, 4, 12)]
    return bik.hf.left_pad(prompts, pad_id=0)


def _logits(model, ids, mask):
    positions = generation_position_ids(mask)  # as generate() does for left-padded rows
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits


def test_compiled_patched_model_equals_eager_bitwise_and_plain_torch_differs():
    model = testing.load_model("tiny-qwen3")
    ids, mask = _left_padded_batch()
    torch._dynamo.reset()
    plain_eager, plain_compiled = (
        _logits(model, ids, mask),
        _logits(torch.compile(model), ids, mask),
    )
    assert not torch.equal(plain_eager, plain_compiled), (
        "negative control: inductor's rotary differs"
    )

    bik.patch_model(model)
    torch._dynamo.reset()
    eager = _logits(model, ids, mask)
    assert torch.equal(_logits(torch.compile(model), ids, mask), eager)
    # and each row compiled alone equals its row in the compiled batch (a recompile with
    # dynamic shapes, except under torch 2.11, whose inductor emits C++ for that graph that
    # does not compile on an AVX-512/AMX CPU: "'tmp2' was not declared", in a bounds check)
    dynamic = None if _TORCH_VERSION >= (2, 12) else False
    alone = _logits(torch.compile(model, dynamic=dynamic), ids[1:2, -4:], mask[1:2, -4:])
    assert torch.equal(alone[0], eager[1, -4:])


@pytest.mark.parametrize("preset", ["tiny-qwen3_5_text", "tiny-nemotron_h", "tiny-kimi_linear"])
def test_compiled_hybrid_models_equal_eager_bitwise(preset):
    """The recurrent layers, one family of each kind (Gated DeltaNet, Mamba2, Kimi Delta
    Attention; Qwen3-Next's is Qwen3.5's), run eagerly inside the compiled graph: the Qwen3.5
    preset's compiled recurrence differed from eager by 2e-7 before they did."""
    model = testing.load_model(preset)
    ids, mask = _left_padded_batch()
    bik.patch_model(model)
    torch._dynamo.reset()
    eager = _logits(model, ids, mask)
    assert torch.equal(_logits(torch.compile(model), ids, mask), eager)


def test_a_per_module_backend_is_honoured_under_compile():
    """patch_model(backend=...) must not be silently replaced by the global selection."""
    model = testing.load_model("tiny-qwen3")
    ids, mask = _left_padded_batch()
    default = copy.deepcopy(model)
    bik.patch_model(model, backend="reference")
    bik.patch_model(default)
    torch._dynamo.reset()
    compiled = _logits(torch.compile(model, backend="aot_eager"), ids, mask)
    assert torch.equal(compiled, _logits(model, ids, mask))
    assert not torch.equal(compiled, _logits(default, ids, mask)), "control: backends differ"
