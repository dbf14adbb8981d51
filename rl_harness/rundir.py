"""The run directory: its files, the checks before a run writes into one, atomic writes, and
reading metrics.jsonl back.

A run directory holds ``config.json`` (the resolved config, and ``world_size``: the number of
processes that ran it), ``metrics.jsonl`` (one JSON object
per step, appended and flushed every step), ``checkpoint.pt`` (the latest checkpoint),
``summary.md`` and ``metrics.png``; with ``run --keep-policies`` also ``policies/step<k>.pt``
(the policy's weights after step k at every checkpoint: :func:`policy_path`); with
``rollout.engine=vllm`` also ``vllm_model/`` while the run goes on (the policy the vLLM engine
loaded; removed when the run ends). Every file but
metrics.jsonl is replaced atomically (written beside, then renamed), so a crash leaves the old
file or the new one, never half of one; a crash in the middle of a metrics line leaves a torn
last line, which reading drops with a warning. A finished run may be compacted
(:func:`compact`, ``python -m rl_harness compact``): its metrics then live by column in
``metrics.cols.xz`` (rl_harness.metrics_pack; ``metrics.jsonl.gz`` in runs compacted before
it) and its plot as a palette PNG; every reader takes each form, and resuming such a run
writes the plain file back. The runs committed under ``results/`` keep no plot
(``python -m rl_harness compare RUN`` draws one).

Trust: checkpoints load with ``torch.load(weights_only=True)`` (no pickled code), and a
config.json naming a plug-in task (``task.module``) is loaded only when the caller names that
module again (:func:`load_config`), since loading it imports the module.
"""

from __future__ import annotations

import gzip
import json
import lzma
import os
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from . import metrics_pack
from .errors import ConfigError, RunDirError

CONFIG = "config.json"
METRICS = "metrics.jsonl"
METRICS_PACKED = "metrics.cols.xz"  # a compacted run's metrics (compact, metrics_pack)
METRICS_GZ = METRICS + ".gz"  # a run compacted before metrics_pack: the lines gzipped
CHECKPOINT = "checkpoint.pt"
SUMMARY = "summary.md"
PLOT = "metrics.png"
POLICIES = "policies"  # run --keep-policies: the policy at each checkpoint (policy_path)
WORLD_SIZE = "world_size"  # config.json's record of the number of processes (beside the sections)


def policy_path(run_dir: str | Path, step: int) -> Path:
    """Where ``run --keep-policies`` keeps the policy's weights after ``step`` (0-based): a dict
    {"step": step, "master": the fp32 policy's state dict}, loaded with weights_only."""
    return Path(run_dir) / POLICIES / f"step{step}.pt"


def write_atomic(path: str | Path, data: str | bytes | Callable[[Path], None]) -> None:
    """Replace ``path`` with ``data`` (text, bytes, or a function writing a given path)
    atomically: the data goes to a temporary file beside it, which is then renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if callable(data):
            data(tmp)
        else:
            tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def metrics_text(rows: Iterable[dict[str, Any]]) -> str:
    return "".join(json.dumps(m) + "\n" for m in rows)


def metrics_path(run_dir: str | Path) -> Path:
    """The file holding a run's metrics: ``metrics.jsonl``, or where only a compacted form
    exists, ``metrics.cols.xz`` or ``metrics.jsonl.gz``."""
    plain = Path(run_dir) / METRICS
    if not plain.exists():
        for name in (METRICS_PACKED, METRICS_GZ):
            if plain.with_name(name).exists():
                return plain.with_name(name)
    return plain


def has_metrics(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds a run's metrics, plain or compacted."""
    return metrics_path(run_dir).exists()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The per-step metrics of a run (plain or compacted). A torn last line (a crash in the
    middle of writing it) is dropped with a warning; any other unreadable line is a
    RunDirError."""
    path = metrics_path(run_dir)
    if path.exists() and not path.is_file():  # a FIFO or a device would block or never end
        raise RunDirError(f"{path}: not a regular file")
    try:
        data = path.read_bytes()
        if path.name == METRICS_PACKED:
            return metrics_pack.unpack(data)
        text = (gzip.decompress(data) if path.name == METRICS_GZ else data).decode()
    except FileNotFoundError:
        raise RunDirError(f"{run_dir}: no {METRICS}; not an rl_harness run directory") from None
    except (OSError, EOFError, UnicodeDecodeError, lzma.LZMAError, ValueError) as error:
        raise RunDirError(f"{path}: cannot be read ({error})") from None
    lines = text.split("\n")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("not a metrics object with a step")
        except ValueError as error:
            if number == len(lines):  # the last line, without its newline: torn
                warnings.warn(
                    f"{path}: dropped a torn last line (line {number}: a run stopped while "
                    "writing it)",
                    stacklevel=2,
                )
                continue
            raise RunDirError(f"{path}: line {number} is not a metrics record ({error})") from None
        rows.append(row)
    return rows


RUN_PLOT_COLOURS = 16
"""A run's own plot (one series of one colour on white, black text) in a 16-colour palette:
the lines and the text's antialiasing keep their look at half the bytes of 256 colours."""


def compact(run_dir: str | Path) -> bool:
    """Store a finished run small: its metrics by column (``metrics.cols.xz``,
    rl_harness.metrics_pack; no time stamp inside, so the same metrics give the same file),
    after checking that they read back as the same lines byte for byte, and its plot as a
    palette image of :data:`RUN_PLOT_COLOURS` colours (:func:`shrink_png`). A run compacted
    before (``metrics.jsonl.gz``) is repacked. Returns whether the metrics were packed now
    (False: already packed). A run still going on would append to the plain file, so only
    a finished one (with its summary.md) is taken."""
    run_dir = Path(run_dir)
    if not (run_dir / SUMMARY).is_file():
        raise RunDirError(f"compact: {run_dir} has no {SUMMARY}: not a finished run")
    source = metrics_path(run_dir)
    done_now = source.name != METRICS_PACKED and source.is_file()
    if done_now:
        data = source.read_bytes()
        text = (gzip.decompress(data) if source.name == METRICS_GZ else data).decode()
        packed = metrics_pack.pack(read_metrics(run_dir))
        if metrics_text(metrics_pack.unpack(packed)) != text:
            raise RunDirError(
                f"compact: {source} does not print back byte for byte from its rows (a torn "
                "or hand-edited line?); left as it is"
            )
        write_atomic(run_dir / METRICS_PACKED, packed)
        source.unlink()
    if (run_dir / PLOT).is_file():
        shrink_png(run_dir / PLOT, RUN_PLOT_COLOURS)
    return done_now


def save_figure(fig: Any, path: Path, dpi: int = 100) -> None:
    """A report's matplotlib figure laid out, written atomically as a palette PNG
    (:func:`shrink_png`) and closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))
    plt.close(fig)
    shrink_png(path)


def shrink_png(path: Path, colours: int = 256) -> None:
    """Rewrite the PNG ``path`` with an adaptive palette of at most ``colours`` colours (a
    line plot has few; a translucent band's shades are merged into the nearest ones): about
    a third of the RGBA size at 256. A palette image with no more colours: left as it is."""
    from PIL import Image

    with Image.open(path) as image:
        image.load()
    if image.mode == "P" and image.getcolors(colours) is not None:  # None: more colours
        return
    small = image.convert("RGB").quantize(colors=colours, method=Image.Quantize.MEDIANCUT)
    write_atomic(path, lambda tmp: small.save(tmp, format="PNG", optimize=True))


def resolved(out: str | Path) -> Path:
    """``out`` as an absolute path with ``..`` and links resolved, the way the file system
    will follow it once its missing folders exist: ``nosuch/../old`` is ``old``, which a
    test of ``Path("nosuch/../old").exists()`` (False: ``nosuch`` is missing) would miss."""
    return Path(out).resolve()


def check_new(out: str | Path) -> Path:
    """``--out`` for a new run: a new or empty directory, created here; returns its
    resolved path (:func:`resolved`)."""
    out = resolved(out)
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out: {out} is a file; pass a directory for the run")
    if out.is_dir() and any(out.iterdir()):
        if (out / METRICS).exists() or (out / CONFIG).exists():
            raise RunDirError(
                f"--out: {out} already holds a run; pass --resume {out} to continue it, "
                "or another --out"
            )
        raise RunDirError(
            f"--out: {out} is not empty and is not an rl_harness run; pass a new or empty directory"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise RunDirError(f"--out: cannot create {out} ({error})") from None
    return out


def check_resume(run_dir: str | Path) -> Path:
    """``--resume DIR``: an existing run directory with its config.json."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise RunDirError(f"--resume: no run directory at {run_dir}")
    if not run_dir.is_dir():
        raise RunDirError(f"--resume: {run_dir} is a file, not a run directory")
    if not (run_dir / CONFIG).is_file():
        raise RunDirError(
            f"--resume: {run_dir} holds no {CONFIG}, so it is not an rl_harness run; "
            "start a new run with --out"
        )
    return run_dir


def config_text(cfg: Any, world_size: int) -> str:
    """The text of config.json: the config's sections (``Config.to_json``) and, beside them,
    ``world_size``, the number of processes the run takes (a torchrun run's gradients differ
    from a one-process run's, so a reader must know)."""
    values = json.loads(cfg.to_json())
    values[WORLD_SIZE] = world_size
    return json.dumps(values, indent=1, sort_keys=True) + "\n"


def recorded_world_size(run_dir: Path) -> int | None:
    """The ``world_size`` config.json records (None: written before it was recorded)."""
    size = _read_json(run_dir).get(WORLD_SIZE)
    return size if isinstance(size, int) else None


def _read_json(run_dir: Path) -> dict[str, Any]:
    path = run_dir / CONFIG
    try:
        values = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RunDirError(f"--resume: {path}: not a readable config ({error})") from None
    if not isinstance(values, dict):
        raise RunDirError(f"--resume: {path}: expected a JSON object of config sections")
    return values


def task_module(run_dir: Path) -> str | None:
    """The plug-in ``task.module`` config.json names (None: a shipped task), read as text:
    nothing is imported."""
    task = _read_json(run_dir).get("task")
    module = task.get("module") if isinstance(task, dict) else None
    return None if module is None else str(module)


def load_config(run_dir: Path, trust_task_module: str | None = None) -> Any:
    """The Config of ``run_dir``. Building it imports a plug-in task's module (task.module),
    which runs that module's code, so a directory whose config names one is loaded only
    when ``trust_task_module`` names the same module (``--trust-task-module``): a run
    directory received from someone else runs no code unless its module is named again."""
    from . import config as config_lib

    module = task_module(run_dir)
    if module is not None and module != trust_task_module:
        given = "" if trust_task_module is None else f" (--trust-task-module {trust_task_module})"
        raise RunDirError(
            f"--resume: {run_dir / CONFIG} names the plug-in task task.module={module!r}, "
            f"whose code resuming would import and run{given}; if you trust it, pass "
            f"--trust-task-module {module}"
        )
    try:
        return config_lib.load(run_dir / CONFIG)
    except ConfigError as error:
        raise RunDirError(f"--resume: {error}") from None


def load_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The checkpoint of ``run_dir``, or None when it has none (the run restarts at step 0)."""
    import torch

    path = run_dir / CHECKPOINT
    if not path.exists():
        return None
    try:
        state = torch.load(path, weights_only=True)
        _check_checkpoint(state)
    except Exception as error:
        reason = (str(error).splitlines() or [type(error).__name__])[0]
        raise RunDirError(
            f"--resume: {path} is not a readable checkpoint ({reason}); "
            f"delete it to rerun {run_dir} from step 0"
        ) from None
    return state


def _check_checkpoint(state: Any) -> None:
    """What a resume reads before anything is built: a step that is a count, and weights that
    are finite tensors (a NaN would train on silently)."""
    import torch

    if not isinstance(state, dict) or not {"step", "master", "optimizer"} <= set(state):
        raise ValueError("not an rl_harness checkpoint")
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"its step is {step!r}, expected an integer >= 0")
    for part in ("master", "reference"):
        weights = state.get(part, {})
        if not isinstance(weights, dict):
            raise ValueError(f"its {part} weights are not a state dict")
        for name, tensor in weights.items():
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{part} {name} is not a tensor")
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"{part} {name} holds NaN or infinite values")


class CheckpointMismatch(ValueError):
    """A checkpoint that does not fit the run's config (resume names the files)."""


def restore(load: Callable[[Any], Any], state: dict[str, Any], part: str) -> None:
    """``load(state[part])``, any failure a :class:`CheckpointMismatch` naming ``part``."""
    if part not in state:
        raise CheckpointMismatch(f"it has no {part} state")
    try:
        load(state[part])
    except Exception as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise CheckpointMismatch(f"its {part} state does not fit ({reason})") from None
