"""Under torch.autocast a patched model returns the dtypes the unpatched one does, and its
outputs stay batch-invariant."""

import pytest
import torch

import bik

pytest.importorskip("transformers")
from bik import testing
from bik.testing.checks import run_checks


def _output_dtypes(model, ids):
    """{module name: output dtype} of one forward, and the logits."""
    dtypes, hooks = {}, []
    for name, module in model.named_modules():
        if name:

            def record(_module, _inputs, output, name=name):
                output = output[0] if isinstance(output, tuple) else output
                if isinstance(output, torch.Tensor):
                    dtypes[name] = output.dtype

            hooks.append(module.register_forward_hook(record))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    for hook in hooks:
        hook.remove()
    return dtypes, logits


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_dtypes_match_the_unpatched_model(preset, dtype):
    model = testing.load_model(preset)  # fp32 weights
    ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=dtype):
        plain, plain_logits = _output_dtypes(model, ids)
        bik.patch_model(model)
        patched, logits = _output_dtypes(model, ids)
    assert plain_logits.dtype == dtype  # autocast: lm_head runs in the autocast dtype
    assert patched == plain
    assert torch.allclose(logits.float(), plain_logits.float(), atol=0.1, rtol=0.1)
    no_autocast = _output_dtypes(model, ids)[1]
    assert no_autocast.dtype == torch.float32  # autocast is read per call, not frozen in


def test_autocast_outputs_stay_batch_invariant():
    model = testing.load_model("tiny-qwen3")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = run_checks(model)
        assert not all(ok for ok, _ in plain.values()), "negative control: plain torch differs"
        bik.patch_model(model)
        patched = run_checks(model)
    assert all(ok for ok, _ in patched.values()), patched


def test_autocast_row_alone_equals_row_in_batch_bitwise():
    model = testing.load_model("tiny-llama")
    bik.patch_model(model)
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, 256, (n,), generator=gen) for n in (9, 4, 12)]
    ids, mask = bik.hf.left_pad(rows, pad_id=0)
    positions = bik.hf.generation_position_ids(mask)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        alone = model(input_ids=rows[0][None]).logits
    assert batch.dtype == torch.bfloat16
    assert torch.equal(batch[0, -len(rows[0]) :], alone[0])


def test_autocast_training_step_gives_fp32_grads_on_fp32_weights():
    model = testing.load_model("tiny-qwen3").train()
    bik.patch_model(model)
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert bool(torch.isfinite(p.grad).all()), name
