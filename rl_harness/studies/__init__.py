"""The harness's registered studies of training-inference mismatch (results/rl/RESULTS.md),
each a ``python -m rl_harness`` command over many runs of the runner:

- ``edge``: the stability-edge grid, learning rates x mismatch doses x seeds, and its report;
- ``edge_remedies``: the edge's remedy phase, remedy arms x seeds at one learning rate;
- ``dose_response``: the registered dose-response at LR*, read back from an edge grid;
- ``alarms``: early-warning signals and the mismatch budget, read back from an edge grid;
- ``bias``: the gradient bias of mismatched rollouts at fixed weights.
"""
