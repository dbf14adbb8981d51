"""bik's ``vllm.general_plugins`` entry point: vLLM calls :func:`register` in every process
it starts. bik is enabled only where ``BIK_VLLM`` names a backend (see bik.vllm), in the
TP-invariant order where ``BIK_VLLM_TP_INVARIANT`` is 1."""


def register() -> None:
    from . import enable, requested, requested_tp_invariant

    backend = requested()  # a BIK_VLLM naming no invariant backend stops the engine here
    if backend is not None:
        enable(backend, tp_invariant=requested_tp_invariant())
