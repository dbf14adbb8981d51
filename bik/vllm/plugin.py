"""bik's ``vllm.general_plugins`` entry point: vLLM calls :func:`register` in every process
it starts. bik is enabled only where ``BIK_VLLM`` names a backend (see bik.vllm)."""

import os


def register() -> None:
    from . import ENV_VAR, enable

    backend = os.environ.get(ENV_VAR, "")
    if backend:
        enable(backend)
