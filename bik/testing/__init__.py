"""The testing wing: what tests, the bench, benchmarks/ and the RL harness share, none of it
computing bik's numerics.

  presets        the tiny model presets, the model loader, random prompt sets
  models, gguf   the real pretrained model's registry, cache and GGUF reader
  machine        the machine's name, load and CPU numerics, recorded beside every figure
  cases          the bench's op and model cases (bik vs the non-invariant baseline)
  graphs         CUDA-graph timing of a case
  plain_static   the unpatched model's static-cache decode under CUDA graphs
  rollouts       sample a rollout and score it as a trainer does (the demo's measurements)
  checks         the invariance checks of a patched model (``python -m bik verify``'s)
  vllm_compare   a vLLM engine's log-probs against the trainer's
  sm90           Triton launches compiled for Hopper (sm_90a) with no GPU, and their SASS
  cutlass_sm90   the CUTLASS sm_90a GEMM, a candidate backend measured on a GPU
  attention_candidates  the Triton attention's candidate tiles and rescale, not shipped

The command line (``bik/tools``) builds on it; nothing here imports the command line.
"""

from .presets import PRESETS, load_model, sample_prompts

__all__ = ["PRESETS", "load_model", "sample_prompts"]
