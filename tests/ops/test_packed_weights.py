"""Weights packed once (bik.pack_weights): the bits of the per-call packing, never stale."""

import gc

import pytest
import torch
from conftest import DEVICE
from helpers import DTYPES, assert_bitwise, randn
from hypothesis import given
from hypothesis import strategies as st
from torch.multiprocessing.reductions import StorageWeakRef

import bik
from bik import backends


def _layer(n, k, dtype, bias, seed=1):
    layer = torch.nn.Linear(k, n, bias=bias, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(randn((n, k), dtype, seed))
        if bias:
            layer.bias.copy_(randn((n,), dtype, seed + 1))
    return layer


def _packs_here(dtype=torch.float32) -> bool:
    """Whether the current backend packs weights of ``dtype`` (the cpu one, where the packed
    layout is no wider than the weight; others run matmul)."""
    pack = backends.resolve(torch.device(DEVICE), "matmul").pack_weight
    return pack is not None and pack(torch.zeros(1, 1, dtype=dtype, device=DEVICE)) is not None


# Sizes straddle the 64-column panels, the 64-deep slices of decode-shaped calls (M <= 16),
# the 6-row register blocks and the 96-row tasks; K odd leaves a bf16 pair with a zero partner.
@given(
    dtype=st.sampled_from(DTYPES),
    m=st.sampled_from([1, 2, 5, 16, 17, 97, 200]),
    n=st.integers(1, 150),
    k=st.integers(1, 150),
    bias=st.booleans(),
)
def test_packed_weight_gives_the_bits_of_the_per_call_packing(backend, dtype, m, n, k, bias):
    layer = _layer(n, k, dtype, bias)
    x = randn((m, k), dtype, seed=3)
    with torch.no_grad():
        plain = bik.linear(x, layer.weight, layer.bias)
        assert bik.pack_weights(layer) == 1
        packed = bik.linear(x, layer.weight, layer.bias)
        again = bik.linear(x[:1], layer.weight, layer.bias)  # the copy reused by another M
    assert_bitwise(packed, plain, f"{m}x{k} @ {k}x{n}")
    assert_bitwise(again, plain[:1], "row 0 alone, from the same packed copy")
    assert (bik.packed_bytes(layer) > 0) == _packs_here(dtype)


def test_leading_dims_and_a_strided_input_are_handled(backend):
    layer = _layer(70, 40, torch.float32, bias=True)
    x = randn((3, 5, 80), torch.float32, seed=4)[..., ::2]  # [3, 5, 40], inner stride 2
    with torch.no_grad():
        plain = bik.linear(x, layer.weight, layer.bias)
        bik.pack_weights(layer)
        assert_bitwise(bik.linear(x, layer.weight, layer.bias), plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_tracked_write_repacks(dtype):
    layer = _layer(33, 70, dtype, bias=False)
    x = randn((4, 70), dtype, seed=5)
    bik.pack_weights(layer)

    def fresh():  # the product from an unmarked copy of the current weight
        return bik.linear(x, layer.weight.detach().clone())

    with torch.no_grad():
        bik.linear(x, layer.weight)
        layer.weight.mul_(2)  # an in-place write through the parameter (an optimizer step)
        assert_bitwise(bik.linear(x, layer.weight), fresh(), "after mul_")
        layer.weight.copy_(randn((33, 70), dtype, seed=6))  # load_state_dict's write
        assert_bitwise(bik.linear(x, layer.weight), fresh(), "after copy_")
        layer.weight[:, 3] = 0  # a write through a view (shares the version counter)
        assert_bitwise(bik.linear(x, layer.weight), fresh(), "after a view's write")
        layer.weight.data = randn((33, 70), dtype, seed=7)  # new storage
        assert_bitwise(bik.linear(x, layer.weight), fresh(), "after .data = ...")
        old_storage = layer.weight.data
        layer.weight.data = torch.empty(0, dtype=dtype, device=DEVICE)  # ZeRO-3 style release
        del old_storage
        layer.weight.data = randn((33, 70), dtype, seed=8)  # may land at the freed address
        assert_bitwise(bik.linear(x, layer.weight), fresh(), "after release and regather")
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    bik.linear(x, layer.weight).float().sum().backward()
    optimizer.step()
    with torch.no_grad():
        assert_bitwise(bik.linear(x, layer.weight), fresh(), "after an optimizer step")


def test_writes_through_data_need_weights_changed():
    # `.data` is a tensor with a version counter of its own: its writes are invisible to the
    # parameter's. The packed copy is then stale until bik.weights_changed(), as documented;
    # this test pins that boundary (and that weights_changed() closes it).
    layer = _layer(20, 30, torch.float32, bias=False)
    x = randn((2, 30), torch.float32, seed=9)
    bik.pack_weights(layer)
    with torch.no_grad():
        before = bik.linear(x, layer.weight)
        layer.weight.data.copy_(randn((20, 30), torch.float32, seed=10))
        fresh = bik.linear(x, layer.weight.detach().clone())
        stale = bik.linear(x, layer.weight)
        bik.weights_changed()
        assert_bitwise(bik.linear(x, layer.weight), fresh, "after weights_changed()")
    if _packs_here():
        assert_bitwise(stale, before, "the stale copy, as documented")


def test_graph_recording_calls_bypass_the_packed_copy():
    layer = _layer(24, 16, torch.float32, bias=True)
    x = randn((3, 16), torch.float32, seed=11).requires_grad_()
    plain_out = bik.linear(x, layer.weight, layer.bias)
    plain_grads = torch.autograd.grad(plain_out.sum(), (x, layer.weight, layer.bias))
    bik.pack_weights(layer)
    out = bik.linear(x, layer.weight, layer.bias)
    grads = torch.autograd.grad(out.sum(), (x, layer.weight, layer.bias))
    assert_bitwise(out, plain_out)
    for got, expected in zip(grads, plain_grads):
        assert_bitwise(got, expected, "gradient")
    assert bik.packed_bytes(layer) == 0  # recorded calls never packed the weight


def test_packed_bytes_and_unpack():
    model = torch.nn.Sequential(
        torch.nn.Linear(100, 130, device=DEVICE), torch.nn.Linear(130, 7, device=DEVICE)
    )
    assert bik.pack_weights(model) == 2
    assert bik.packed_bytes(model) == 0  # packed at first use
    with torch.no_grad():
        model(torch.zeros(1, 100, device=DEVICE))  # nn.Linear runs F.linear: nothing packed
        bik.linear(torch.zeros(1, 100, device=DEVICE), model[0].weight)
    if _packs_here():  # fp32: the weight's bytes, N rounded up to the 64-column panels
        assert bik.packed_bytes(model) == 192 * 100 * 4
    bik.unpack_weights(model)
    assert bik.packed_bytes(model) == 0
    assert not any(hasattr(p, "_bik_packed") for p in model.parameters())


class _LoaderParameter(torch.nn.Parameter):
    """A Parameter subclass with no dispatch hook, as vLLM keeps its linear weights in."""


def test_a_plain_parameter_subclass_is_packed():
    layer = _layer(40, 24, torch.float32, bias=False)
    layer.weight = _LoaderParameter(layer.weight.detach().clone(), requires_grad=False)
    x = randn((3, 24), torch.float32, seed=13)
    plain = bik.linear(x, layer.weight)
    bik.pack_weights(layer)
    assert_bitwise(bik.linear(x, layer.weight), plain)
    assert (bik.packed_bytes(layer) > 0) == _packs_here()


def test_fp16_is_not_packed_its_layout_being_twice_as_wide():
    # fp16 is packed widened to fp32: a copy would double a decode call's weight reads.
    layer = _layer(64, 64, torch.float16, bias=False)
    bik.pack_weights(layer)
    x = randn((1, 64), torch.float16, seed=12)
    with torch.no_grad():
        assert_bitwise(bik.linear(x, layer.weight), bik.linear(x, layer.weight.detach().clone()))
    assert bik.packed_bytes(layer) == 0


def test_pack_weights_refuses_what_is_not_a_module():
    with pytest.raises(TypeError, match=r"module: expected a torch\.nn\.Module"):
        bik.pack_weights(torch.zeros(2, 2))


def _fresh(x, weight):
    """The product from an unmarked copy of ``weight`` as it is now."""
    return bik.linear(x, weight.detach().clone())


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [("AdamW", {}), ("Adam", {}), ("SGD", {"momentum": 0.9}), ("Adagrad", {})],
)
def test_a_fused_optimizer_step_repacks(name, kwargs):
    # Fused CPU optimizers write the parameters without bumping their version counters.
    layer = _layer(40, 24, torch.float32, bias=False)
    if name == "Adagrad" and layer.weight.device.type != "cpu":
        pytest.skip("torch's fused Adagrad runs on the CPU only (an H200 run: RuntimeError)")
    x = randn((3, 24), torch.float32, seed=14)
    bik.pack_weights(layer)
    optimizer = getattr(torch.optim, name)(layer.parameters(), lr=0.5, fused=True, **kwargs)
    version = layer.weight._version
    with torch.no_grad():
        before = bik.linear(x, layer.weight)  # the packed copy is made here
    bik.linear(x, layer.weight).sum().backward()
    optimizer.step()
    assert layer.weight._version == version  # what makes this case hard
    with torch.no_grad():
        after = bik.linear(x, layer.weight)
        assert_bitwise(after, _fresh(x, layer.weight), f"after a fused {name} step")
        assert not torch.equal(after, before)


def test_parameters_sharing_storage_are_packed_per_call():
    # `b.data = a.data`: a step on `a` bumps `a`'s counter, never `b`'s.
    a, b = _layer(20, 30, torch.float32, bias=False), _layer(20, 30, torch.float32, False, 2)
    b.weight.data = a.weight.data
    x = randn((2, 30), torch.float32, seed=15)
    bik.pack_weights(b)
    with torch.no_grad():
        bik.linear(x, b.weight)
        a.weight.mul_(3)
        assert_bitwise(bik.linear(x, b.weight), _fresh(x, b.weight), "after a step on the twin")
    assert bik.packed_bytes(b) == 0


def test_a_view_of_a_flat_buffer_written_through_the_buffer():
    # FSDP1 keeps parameters as views of one flat buffer and all-gathers into the buffer.
    flat = torch.zeros(20 * 30 + 7, device=DEVICE)
    layer = _layer(20, 30, torch.float32, bias=False)
    layer.weight.data = flat[7:].view(20, 30)
    x = randn((2, 30), torch.float32, seed=16)
    bik.pack_weights(layer)
    with torch.no_grad():
        flat.copy_(randn((20 * 30 + 7,), torch.float32, seed=17))
        bik.linear(x, layer.weight)
        flat.copy_(randn((20 * 30 + 7,), torch.float32, seed=18))
        assert_bitwise(bik.linear(x, layer.weight), _fresh(x, layer.weight), "after a gather")


def test_a_saved_and_loaded_module_packs_its_loaded_weights(tmp_path):
    layer = _layer(20, 30, torch.float32, bias=False)
    x = randn((2, 30), torch.float32, seed=19)
    bik.pack_weights(layer)
    with torch.no_grad():
        bik.linear(x, layer.weight)
        torch.save(layer, tmp_path / "layer.pt")
        layer.weight.data.copy_(randn((20, 30), torch.float32, seed=20))  # the saved copy is old
        torch.save(layer, tmp_path / "changed.pt")
    loaded = torch.load(tmp_path / "changed.pt", weights_only=False)
    assert bik.packed_bytes(loaded) == 0  # the mark is kept, never a copy
    with torch.no_grad():
        assert_bitwise(bik.linear(x, loaded.weight), _fresh(x, loaded.weight), "loaded")
    assert (bik.packed_bytes(loaded) > 0) == _packs_here()


def test_inference_tensors_are_packed_per_call():
    with torch.inference_mode():
        layer = _layer(20, 30, torch.float32, bias=False)
        x = randn((2, 30), torch.float32, seed=21)
    bik.pack_weights(layer)
    with torch.inference_mode():
        first = bik.linear(x, layer.weight)
        layer.weight.mul_(2)  # no version counter sees this
        assert_bitwise(bik.linear(x, layer.weight), _fresh(x, layer.weight), "after mul_")
    assert not torch.equal(first, bik.linear(x, layer.weight))
    assert bik.packed_bytes(layer) == 0


def test_a_weight_given_new_storage_lets_the_old_one_go():
    # model.to(dtype) gives each weight new storage; the packed copy must not keep the old one.
    layer = _layer(64, 64, torch.float32, bias=False)
    x = randn((2, 64), torch.float32, seed=22)
    bik.pack_weights(layer)
    old = StorageWeakRef(layer.weight.untyped_storage())
    with torch.no_grad():
        bik.linear(x, layer.weight)
    layer.to(torch.bfloat16)
    gc.collect()
    assert old.expired()
    with torch.no_grad():
        x = x.bfloat16()
        assert_bitwise(bik.linear(x, layer.weight), _fresh(x, layer.weight), "after .to(bf16)")
