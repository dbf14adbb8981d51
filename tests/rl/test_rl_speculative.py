"""Speculative decoding in the hf sampler (rollout.speculative=ngram): with bik's kernels it
draws plain decoding's tokens, log-probs and random numbers bit for bit, a whole run included;
native kernels differ (the negative control); what it cannot run is refused."""

import pytest
import torch
from rl_helpers import TINY, run_metrics
from transformers import DynamicCache

from rl_harness import config, engines, policy, rollout, same
from rl_harness.errors import ConfigError

# two rows of unequal length (left padding); the rows draw in lockstep, so a draft stands
# only where every row drew it: more rows, fewer drafts standing
PROMPTS = [[1, 7, 8, 9, 7, 8, 9, 7], [1, 3, 3, 3, 3]]
SPECULATE = ["rollout.speculative=ngram", "rollout.speculative_tokens=4"]


def _sample(
    kernels: str,
    dtype: str,
    speculate: bool,
    *,
    greedy: bool = False,
    prompts: list[list[int]] = PROMPTS,
    spread: float = 1.0,
):
    """``prompts`` from a random policy (weights of spread ``spread``: at 1 it repeats
    itself), EOS never drawn, 24 tokens each at temperature 1."""
    sets = [*TINY, f"rollout.dtype={dtype}", f"train.dtype={dtype}", f"rollout.kernels={kernels}"]
    sets += ["rollout.max_new_tokens=24", *(SPECULATE if speculate else [])]
    cfg = config.build({}, sets)
    master = policy.build_master(cfg.model, 0)
    torch.manual_seed(1)
    for p in master.parameters():
        p.data.normal_(0, spread)
    master.lm_head.weight.data[master.config.eos_token_id] = 0.0  # responses run to the end
    engine = engines.ENGINES["hf"](master, cfg, torch.zeros(master.config.vocab_size), None)
    if not greedy:
        return engine.sample(prompts, 7, slice(0, len(prompts)))
    policy.refresh(engine.model, master)
    generator = torch.Generator().manual_seed(7)
    return rollout.sample(engine.model, prompts, cfg.rollout, engine.drift, generator, greedy=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_drafts_stand_and_every_token_and_log_prob_is_plain_decodings(dtype, greedy):
    plain = _sample("bik", dtype, False, greedy=greedy)
    fast = _sample("bik", dtype, True, greedy=greedy)
    assert torch.equal(fast.sequences, plain.sequences)
    assert torch.equal(fast.rollout_logp, plain.rollout_logp)  # bit for bit
    drafts = fast.speculation
    tokens = plain.sequences.shape[1] - plain.prompt_width
    assert plain.speculation is None and drafts.accepted > 0
    assert (
        drafts.forwards == tokens - drafts.accepted < tokens
    )  # each draft that stood: a forward saved


def _decode_and_score(kernels: str, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of 8 tokens after an 8-token prefix, 4 rows: fed one decode step at a
    time, and scored by one forward as a draft is, both over the prefix's KV cache."""
    cfg = config.build({}, TINY)
    model = policy.working_copy(policy.build_master(cfg.model, 0), dtype, kernels)
    ids = torch.randint(3, 40, (4, 16), generator=torch.Generator().manual_seed(0))

    def logits(steps: list[slice]) -> torch.Tensor:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids[:, :8], past_key_values=cache, use_cache=True)
            return torch.cat(
                [
                    model(
                        input_ids=ids[:, s],
                        position_ids=torch.arange(s.start, s.stop).expand(4, -1),
                        past_key_values=cache,
                        use_cache=True,
                    ).logits
                    for s in steps
                ],
                dim=1,
            )

    return logits([slice(i, i + 1) for i in range(8, 16)]), logits([slice(8, 16)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_scoring_forward_gives_decodings_bits_with_bik_and_not_natively(dtype):
    """What speculation rests on, and the negative control: bik scores 8 positions in one
    forward with a decode step's bits; native kernels do not (differing logits counted)."""
    assert torch.equal(*_decode_and_score("bik", dtype))
    decoded, scored = _decode_and_score("native", dtype)
    differing = int((decoded != scored).sum())
    assert differing > 0, f"native {dtype}: the scoring forward matched decoding bit for bit"


def test_a_speculative_run_is_the_plain_run_bit_for_bit_with_its_drafts_logged(tmp_path, cache):
    sets = [*TINY, "steps=3", "rollout.max_new_tokens=8"]
    run_metrics(tmp_path, cache, "plain", sets)
    history = run_metrics(tmp_path, cache, "fast", [*sets, *SPECULATE])
    ignore = ("rollout/draft_tokens", "rollout/draft_accepted", "rollout/forwards")
    alike, report = same.compare(tmp_path / "plain", tmp_path / "fast", ignore)
    assert alike, report
    assert all(m["mismatch/k3_kl"] == 0.0 and m["rollout/forwards"] >= 1 for m in history)


def test_prompt_lookup_takes_the_latest_match_of_the_longest_tail():
    assert rollout.lookup([5, 1, 2, 9, 1, 2, 7, 1, 2], ngram=3, limit=2) == [7, 1]
    assert rollout.lookup([4, 6, 4], ngram=2, limit=3) == [6, 4]  # a 1-token tail
    assert rollout.lookup([1, 2, 3], ngram=3, limit=2) == []


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ["rollout.engine=vllm", "rollout.top_k=8"],
            r"^rollout\.top_k: expected 0 with rollout\.speculative=ngram on rollout\.engine=vllm",
        ),
        (["model.family=qwen3_moe"], r"^rollout\.speculative: expected a dense policy"),
        (["model.family=qwen3_5_text"], r"^rollout\.speculative: expected a policy whose KV"),
    ],
)
def test_what_speculation_cannot_run_is_refused_by_name(sets, message):
    with pytest.raises(ConfigError, match=message):
        cfg = config.build({}, [*TINY, *SPECULATE, *sets])
        master = policy.build_master(cfg.model, 0)
        engines.ENGINES[cfg.rollout.engine].check(cfg, None, master)
