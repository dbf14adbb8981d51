"""bik in verl: GRPO / PPO on verl's own trainer with the rollout and the update in bik's order.

``VERL_USE_EXTERNAL_MODULES=bik.verl.plugin`` makes every verl process import
:mod:`bik.verl.plugin`, which registers, through verl's public registries:

* the platform ``cpu`` (:mod:`bik.verl.platform`, ``VERL_PLATFORM=cpu``): gloo collectives and
  logical Ray GPUs, so verl's FSDP2 workers run on this machine's cores;
* the training engine (:mod:`bik.verl.engine`): verl's FSDP2 engine with the policy
  ``bik.patch_model``-ed before it is sharded, and verl's per-token log-prob formula replaced
  by bik's;
* the rollout ``bik`` (:mod:`bik.verl.rollout`, ``actor_rollout_ref.rollout.name=bik``): a
  replica whose server decodes with the patched policy and returns the log-probs the trainer
  will compute, bit for bit;
* the settings check (:mod:`bik.verl.checks`) and the bypass-mode audit
  (:mod:`bik.verl.audit`) on verl's trainer.

``python -m bik.verl.run`` runs a small GRPO job and checks verl's mismatch metrics. verl
lives in a venv of its own (``make install-verl``); elsewhere this package imports, but its
plug-in modules do not. See docs/verl.md.
"""

import importlib.util

TESTED_VERL = "==0.9.1"  # read by the Makefile's install-verl

# verl imports the plug-in module (VERL_USE_EXTERNAL_MODULES) from its own __init__, and the
# plug-in imports this package's modules: verl goes first, so that a process whose first
# import is one of them (a Ray worker unpickling the rollout server) never hands the plug-in
# a half-imported module.
if importlib.util.find_spec("verl") is not None:
    import verl  # noqa: F401
