"""bench/speculative.py: its prompt sets come from shipped text and copy what they should, and
both decoders it times give the same tokens on a tiny model (the full run is the benchmark)."""

from __future__ import annotations

import pytest
import torch

from tests.bench.conftest import load_bench_script


@pytest.fixture(scope="module")
def speculative():
    yield from load_bench_script("speculative")


def test_three_sets_from_shipped_text(speculative):
    sets = speculative.prompt_sets()
    assert set(sets) == {"extraction", "summary", "chat"} and all(len(v) >= 3 for v in sets.values())
    passage = speculative._passages(1)[0]
    assert len(passage) > 200 and passage in sets["extraction"][0]
    assert "def " in sets["extraction"][4]  # a standard-library function's source
    assert len(set(sum(sets.values(), []))) == sum(len(v) for v in sets.values())  # no prompt twice


@pytest.fixture(scope="module")
def tiny_runner(tiny_config):
    """A tiny Llama with a 512-token vocabulary (its greedy text repeats, so lookup drafts) and a prompt
    said twice."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from export.decoding.runtime import EagerRunner

    cfg = dict(tiny_config("llama"), vocab_size=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg)).eval()
    return EagerRunner(model), torch.randint(3, 512, (12,), generator=torch.Generator().manual_seed(0)).tolist() * 2


def test_both_decoders_give_the_same_tokens(speculative, tiny_runner):
    runner, ids = tiny_runner
    plain, plain_s, _ = speculative.decode_plain(runner, ids, [])
    fast, fast_s, stats = speculative.decode_speculative(runner, ids, [])
    assert fast == plain and len(plain) == speculative.MAX_NEW
    assert plain_s > 0 and fast_s > 0 and stats["tokens"] == len(fast)


def test_sampled_rows_share_the_prompts_seed(speculative, tiny_runner):
    """--temperature: plain and speculative decoders sample with the prompt's own seed, so their tokens are
    equal (and not greedy's); a bad setting is refused before anything loads."""
    runner, ids = tiny_runner
    greedy, _, _ = speculative.decode_plain(runner, ids, [])
    from export.decoding.sampling import Sampling

    speculative.SAMPLING = Sampling(temperature=0.8, top_p=0.95)
    try:
        assert speculative.sampling_for(ids).seed == speculative.sampling_for(list(ids)).seed
        plain, _, _ = speculative.decode_plain(runner, ids, [])
        fast, _, _ = speculative.decode_speculative(runner, ids, [])
        assert fast == plain != greedy
    finally:
        speculative.SAMPLING = None
    with pytest.raises(ValueError, match="top_p must be in"):
        speculative.main(["--temperature", "0.5", "--top-p", "2", "--no-executorch"])
    with pytest.raises(ValueError, match="--top-p shape sampling, and --temperature is 0"):
        speculative.main(["--top-p", "0.9", "--no-executorch"])
