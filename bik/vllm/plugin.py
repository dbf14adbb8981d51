"""bik's ``vllm.general_plugins`` entry point: vLLM calls :func:`register` in every process
it starts. bik is enabled only where ``BIK_VLLM`` names a backend (see bik.vllm)."""


def register() -> None:
    from . import enable, requested

    backend = requested()  # a BIK_VLLM naming no invariant backend stops the engine here
    if backend is not None:
        enable(backend)
