"""PNG plots of one or several runs: reward, response length, mismatch, grad norm, LR."""

PANELS = [
    ("reward/mean", "reward"),
    ("response_length/mean", "response length"),
    ("mismatch/k3_kl", "k3 KL (rollout vs train)"),
    ("mismatch/tokens_unequal_frac", "fraction of unequal tokens"),
    ("grad_norm", "grad norm"),
    ("lr", "learning rate"),
]


def plot_runs(runs, path):
    """``runs``: {name: list of metric dicts}; one panel per metric, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, (key, title) in zip(axes.flat, PANELS):
        for name, history in runs.items():
            ax.plot(
                [m["step"] for m in history], [m[key] for m in history], label=name, linewidth=1
            )
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        if key in ("mismatch/k3_kl", "grad_norm") and any(
            m[key] > 0 for h in runs.values() for m in h
        ):
            ax.set_yscale("symlog", linthresh=1e-8 if key == "mismatch/k3_kl" else 1e-3)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
