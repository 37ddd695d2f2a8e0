"""Speculative decoding through a ``.pte``: drafts verified by the program's ``forward_all`` give the
tokens plain greedy decoding of the same program gives (``optimize run --speculative ngram`` and
its refusal of a program without ``forward_all`` are tested in ``test_scoring_method.py``, on that
module's program)."""

from __future__ import annotations

import pytest
import torch

from export.executorch.runner import ExecuTorchRunner
from export.runtime import greedy_generate
from export.speculative import speculative_generate

MAX_SEQ_LEN = 96

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def small_vocab_pte(tmp_path_factory):
    """A tiny Llama with a 512-token vocabulary, whose greedy text repeats itself enough for prompt
    lookup to find drafts (with SmolLM2's 49152 a random model's text never does)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from export.executorch import ExecuTorchOptions, lower_to_pte
    from tests.conftest import TINY_CONFIGS
    from tests.export.conftest import _Tok

    cfg = dict(TINY_CONFIGS["llama"], vocab_size=512, initializer_range=0.2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg)).eval()
    data, _ = lower_to_pte(model, _Tok(), ExecuTorchOptions(max_seq_len=MAX_SEQ_LEN, quantize="8da4w", group_size=32,
                                                           scoring_method=True), log=lambda *a: None)
    path = tmp_path_factory.mktemp("speculative512") / "model.pte"
    path.write_bytes(data)
    return path


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    passage = torch.randint(3, 512, (10,), generator=g).tolist()
    rand = torch.randint(3, 512, (30,), generator=g).tolist()
    return [passage * 3, rand, passage + rand[:7] + passage]


def test_the_same_tokens_as_plain_greedy_of_the_same_program(small_vocab_pte):
    plain_runner = ExecuTorchRunner(small_vocab_pte)
    verifier = plain_runner.scoring_runner()
    assert verifier.all_positions and not plain_runner.all_positions
    drafted = accepted = 0
    for prompt in _prompts():
        new = MAX_SEQ_LEN  # runs until the cache is full
        plain = greedy_generate(plain_runner, prompt, new)
        same_method = greedy_generate(verifier, prompt, new)
        fast, stats = speculative_generate(verifier, prompt, new)
        assert fast == same_method == plain
        assert len(plain) == MAX_SEQ_LEN - len(prompt) + 1
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    # drafts were verified, some kept and some cut back from the cache
    assert 0 < accepted < drafted
