"""rl_harness remedies: every remedy's weights, sequence-level masked IS, the per-level clipped /
masked fractions, geometric rejection's length invariance, bypass with an importance-sampling
remedy, one-sided MIS (hand-computed values)."""

import math
from pathlib import Path

import pytest
import torch

from rl_harness import config, remedies
from rl_harness.__main__ import main
from rl_harness.errors import ConfigError
from rl_harness.remedies import REMEDIES, RemedyConfig


def _weights(name, old, rollout, mask, **extra):
    return remedies.weights(RemedyConfig(name=name, **extra), old, rollout, mask)


def _logps(r):
    """(old, rollout) whose log ratio old - rollout is ``r``."""
    r = torch.tensor(r, dtype=torch.float64)
    return torch.zeros_like(r), -r


def test_every_remedy_has_a_level():
    weighting = set(REMEDIES) - {"none", "fp16"}
    assert weighting == set(remedies.TOKEN_REMEDIES) | set(remedies.SEQUENCE_REMEDIES)
    assert set(remedies.IS_REMEDIES) <= weighting


def test_seq_mis_keeps_sequences_whose_weight_is_inside_the_bounds():
    # R = sum_t r_t: 0.1 (kept, weight e^0.1), 1.5 (e^1.5 > 2: dropped), -1.5 (< 0.5: dropped)
    old, rollout = _logps([[0.2, -0.1, 0.0], [1.0, 0.5, 7.0], [-1.0, -0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    w, keep, stats = _weights("seq_mis", old, rollout, mask)
    assert torch.allclose(w[0], torch.full((3,), math.exp(0.1), dtype=w.dtype))
    assert keep[0].all() and not keep[1:].any() and not w[1:].any()
    assert stats["remedy/masked_frac"] == pytest.approx(2 / 3)  # sequences
    assert stats["remedy/clipped_frac"] == 0.0
    # the masked token (7.0) does not count: with it row 1 would be e^8.5
    _, keep, _ = _weights("seq_mis", old, rollout, mask, high=5.0)
    assert keep[1].all() and not keep[2].any()


def test_seq_mis_is_not_token_mis():
    # every token ratio inside [0.5, 2] but the product e^{1.8} = 6.05 is not
    old, rollout = _logps([[0.6, 0.6, 0.6]])
    mask = torch.ones(1, 3)
    _, keep, _ = _weights("token_mis", old, rollout, mask)
    assert keep.all()
    _, keep, stats = _weights("seq_mis", old, rollout, mask)
    assert not keep.any() and stats["remedy/masked_frac"] == 1.0


def test_fractions_count_at_the_remedy_level():
    # row 0: ratios 3, 1, 1 (seq weight 3); row 1: 0.25, e^-1e-4, 1 (seq weight ~0.25)
    old, rollout = _logps([[math.log(3.0), 0.0, 0.0], [-math.log(4.0), 1e-4, 0.0]])
    mask = torch.ones(2, 3)
    _, _, stats = _weights("token_tis", old, rollout, mask)
    assert stats["remedy/clipped_frac"] == pytest.approx(1 / 6)  # 1 token of 6
    assert stats["remedy/masked_frac"] == 0.0
    w, _, stats = _weights("seq_tis", old, rollout, mask)
    assert stats["remedy/clipped_frac"] == pytest.approx(1 / 2)  # 1 sequence of 2
    assert torch.allclose(w[0], torch.full((3,), 2.0, dtype=w.dtype))
    _, _, stats = _weights("geo_is", old, rollout, mask)
    assert stats["remedy/clipped_frac"] == 0.0  # 3^(1/3) = 1.44 < 2
    w, _, stats = _weights("geo_is", old, rollout, mask, clip=1.2)
    assert stats["remedy/clipped_frac"] == pytest.approx(1 / 2)
    assert torch.allclose(w[0], torch.full((3,), 1.2, dtype=w.dtype))
    _, _, stats = _weights("token_mis", old, rollout, mask)
    assert stats["remedy/masked_frac"] == pytest.approx(2 / 6)  # tokens 3 and 0.25
    assert stats["remedy/clipped_frac"] == 0.0
    _, _, stats = _weights("token_veto", old, rollout, mask, veto=0.5)
    assert stats["remedy/masked_frac"] == pytest.approx(1 / 2)
    _, _, stats = _weights("geo_rs", old, rollout, mask)
    assert stats["remedy/masked_frac"] == 1.0  # both sequences


def test_sequence_fractions_skip_rows_without_tokens():
    old, rollout = _logps([[math.log(3.0), 0.0], [0.0, 0.0], [5.0, 5.0]])
    mask = torch.tensor([[1, 1], [1, 1], [0, 0]])  # row 2 has no response token
    _, _, stats = _weights("seq_tis", old, rollout, mask)
    assert stats["remedy/clipped_frac"] == pytest.approx(1 / 2)
    _, _, stats = _weights("seq_mis", old, rollout, mask)
    assert stats["remedy/masked_frac"] == pytest.approx(1 / 2)


@pytest.mark.parametrize("name", sorted(set(REMEDIES) - {"fp16"}))
def test_no_tokens_gives_zero_fractions_and_no_weight(name):
    old, rollout = _logps([[1.0, -1.0], [2.0, 0.0]])
    mask = torch.zeros(2, 2)
    w, _, stats = _weights(name, old, rollout, mask)
    assert stats == {"remedy/masked_frac": 0.0, "remedy/clipped_frac": 0.0}
    assert torch.isfinite(w).all()


def test_an_entirely_clipped_sequence():
    old, rollout = _logps([[1.0, 1.0], [0.0, 0.0]])  # row 0: every token e > 2
    mask = torch.ones(2, 2)
    w, _, stats = _weights("token_tis", old, rollout, mask)
    assert torch.equal(w[0], torch.full((2,), 2.0, dtype=w.dtype))
    assert stats["remedy/clipped_frac"] == pytest.approx(2 / 4)
    _, keep, stats = _weights("token_mis", old, rollout, mask)
    assert not keep[0].any() and keep[1].all() and stats["remedy/masked_frac"] == 0.5
    _, _, stats = _weights("seq_tis", old, rollout, mask)
    assert stats["remedy/clipped_frac"] == pytest.approx(1 / 2)


def test_one_sided_token_mis():
    # low tiny: only the upper bound drops; a ratio of e^-5 is kept
    old, rollout = _logps([[-5.0, 0.0, 1.0]])
    mask = torch.ones(1, 3)
    w, keep, stats = _weights("token_mis", old, rollout, mask, low=1e-9)
    assert keep.tolist() == [[1.0, 1.0, 0.0]]
    assert w[0, 0] == pytest.approx(math.exp(-5.0)) and stats[
        "remedy/masked_frac"
    ] == pytest.approx(1 / 3)
    _, keep, _ = _weights("token_mis", old, rollout, mask)  # two-sided default [0.5, 2]
    assert keep.tolist() == [[0.0, 1.0, 0.0]]


@pytest.mark.parametrize("name", sorted(remedies.IS_REMEDIES))
def test_bypass_refuses_an_importance_sampling_remedy(name):
    with pytest.raises(ConfigError, match=rf"remedy\.bypass=true.*remedy\.name={name}"):
        config.build({}, ["remedy.bypass=true", f"remedy.name={name}"])
    config.build({}, [f"remedy.name={name}"])  # without bypass: fine


@pytest.mark.parametrize("name", ["none", "geo_rs", "k1_rs", "k3_rs", "token_veto"])
def test_bypass_takes_a_rejection_remedy(name):
    assert config.build({}, ["remedy.bypass=true", f"remedy.name={name}"]).remedy.bypass


def test_bypass_with_reinforce_takes_an_importance_sampling_remedy():
    # REINFORCE has no ratio to pi_old: the IS weight is the only correction
    cfg = config.build({}, ["remedy.bypass=true", "remedy.name=seq_tis", "train.loss=reinforce"])
    assert cfg.remedy.name == "seq_tis"


def _remedy(name, **extra):
    return RemedyConfig(name=name, **extra)


def test_remedy_weights():
    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    rollout = torch.tensor([[-math.log(3.0), 0.0, 0.0], [math.log(4.0), -1e-4, 0.0]])
    mask = torch.ones(2, 3)
    w, _, stats = remedies.weights(_remedy("token_tis"), old, rollout, mask)
    assert w[0, 0] == pytest.approx(2.0) and w[1, 0] == pytest.approx(0.25)
    assert stats["remedy/clipped_frac"] == pytest.approx(1 / 6)
    w, keep, _ = remedies.weights(_remedy("token_mis"), old, rollout, mask)
    assert keep[0, 0] == 0 and keep[1, 0] == 0 and w[0, 1] == 1
    w, _, _ = remedies.weights(_remedy("seq_tis"), old, rollout, mask)
    assert torch.allclose(w[0], torch.full((3,), 2.0)) and w[1, 0] < 0.26
    _, keep, stats = remedies.weights(_remedy("token_veto", veto=0.5), old, rollout, mask)
    assert keep[1].sum() == 0 and keep[0].sum() == 3 and stats["remedy/masked_frac"] == 0.5
    w, _, _ = remedies.weights(_remedy("geo_is"), old, rollout, mask)
    assert torch.allclose(w[0], torch.full((3,), 3.0 ** (1 / 3)), rtol=1e-5)
    _, keep, _ = remedies.weights(_remedy("geo_rs"), old, rollout, mask)
    assert keep.sum() == 0  # both sequences' geometric ratios leave [0.999, 1.001]
    w, _, _ = remedies.weights(_remedy("token_tis", self_normalize=True), old, rollout, mask)
    assert (w * mask).sum() / mask.sum() == pytest.approx(1.0)


def test_geometric_rejection_is_length_invariant():
    for length in (4, 400):
        old, rollout = torch.zeros(1, length), torch.full((1, length), -0.0005)
        _, keep, _ = remedies.weights(_remedy("geo_rs"), old, rollout, torch.ones(1, length))
        assert keep.all()


def test_the_readme_lists_every_remedy_as_its_record_states_it(capsys):
    """One home per formula: the README's list is the records' text, and the command prints it."""
    readme = (Path(__file__).parents[2] / "rl_harness" / "README.md").read_text()
    block = readme.split("<!-- remedies: begin -->\n")[1].split("\n<!-- remedies: end -->")[0]
    assert block == remedies.markdown()
    assert main(["remedies"]) == 0
    # issue 71, item 5: the command defines rho_t, r_t and R before using them
    assert capsys.readouterr().out == f"{remedies.LEGEND}:\n\n{remedies.markdown()}\n"
    assert remedies.LEGEND.startswith("rho_t = exp(r_t), r_t the trainer's minus")
