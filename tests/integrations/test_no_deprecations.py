"""bik's own calls into transformers raise no deprecation warning (they would break when
transformers removes the old form inside the ``transformers>=5,<6`` range bik allows)."""

import subprocess
import sys
import textwrap

# Run in a fresh process: transformers reports many deprecations once per process
# (logger.warning_once), so an earlier test in this one could hide them.
SCRIPT = textwrap.dedent(
    """
    import logging, warnings

    class Fail(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if "deprecat" in message.lower() or "will be removed" in message.lower():
                raise SystemExit(f"transformers deprecation: {message}")

    logging.getLogger("transformers").addHandler(Fail())
    warnings.simplefilter("error", DeprecationWarning)
    warnings.simplefilter("error", FutureWarning)

    import bik
    from bik import testing
    from bik.testing.checks import run_checks
    from rl_harness import config, runner

    model = testing.load_model("tiny-llama")
    model.save_pretrained(DIRECTORY)
    bik.patch_model(model)
    run_checks(model)  # generate, chunked prefill over a DynamicCache, full forwards
    sets = [
        "model.path=" + DIRECTORY, "warmup.steps=1", "steps=1", "rollout.prompts=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=3",
    ]
    runner.run(config.build({}, sets), OUT, cache_dir=CACHE, progress=False, name="x")
    """
)


def test_bik_calls_into_transformers_raise_no_deprecation(tmp_path):
    setup = (
        f"DIRECTORY, OUT, CACHE = {str(tmp_path / 'model')!r}, {str(tmp_path / 'run')!r}, "
        f"{str(tmp_path / 'cache')!r}\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", setup + SCRIPT], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
