"""The run directory: its files, the checks before a run writes into one, atomic writes, and
reading metrics.jsonl back.

A run directory holds ``config.json`` (the resolved config), ``metrics.jsonl`` (one JSON object
per step, appended and flushed every step), ``checkpoint.pt`` (the latest checkpoint),
``summary.md`` and ``metrics.png``; with ``rollout.engine=vllm`` also ``vllm_model/`` while the
run goes on (the policy the vLLM engine loaded; removed when the run ends). Every file but
metrics.jsonl is replaced atomically (written beside, then renamed), so a crash leaves the old
file or the new one, never half of one; a crash in the middle of a metrics line leaves a torn
last line, which reading drops with a warning.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .errors import ConfigError, RunDirError

CONFIG = "config.json"
METRICS = "metrics.jsonl"
CHECKPOINT = "checkpoint.pt"
SUMMARY = "summary.md"
PLOT = "metrics.png"


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


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The per-step metrics of a run. A torn last line (a crash in the middle of writing it)
    is dropped with a warning; any other unreadable line is a RunDirError."""
    path = Path(run_dir) / METRICS
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise RunDirError(f"{run_dir}: no {METRICS}; not an rl_harness run directory") from None
    except (OSError, UnicodeDecodeError) as error:
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


def check_new(out: str | Path) -> Path:
    """``--out`` for a new run: a new or empty directory, created here."""
    out = Path(out)
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


def load_config(run_dir: Path) -> Any:
    from . import config as config_lib

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
        if not isinstance(state, dict) or not {"step", "master", "optimizer"} <= set(state):
            raise ValueError("not an rl_harness checkpoint")
    except Exception as error:
        reason = (str(error).splitlines() or [type(error).__name__])[0]
        raise RunDirError(
            f"--resume: {path} is not a readable checkpoint ({reason}); "
            f"delete it to rerun {run_dir} from step 0"
        ) from None
    return state
