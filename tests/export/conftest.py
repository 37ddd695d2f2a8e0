"""Fixtures shared by the export tests."""

from __future__ import annotations

import pytest

from tests.conftest import TINY_CONFIGS  # the shared tiny configs (one definition)

#: the tiny Llama the exporters' tests share; a larger init so quantization errors show in the logits
TINY_LLAMA = {**TINY_CONFIGS["llama"], "initializer_range": 0.2}


def quiet(*_a, **_k):
    """An exporter ``log`` that prints nothing."""


@pytest.fixture(scope="module")
def tiny():
    """The tiny Llama (model and tokenizer), built once per test module."""
    from targets.sources import RandomSource, load_model

    return load_model(RandomSource(config=dict(TINY_LLAMA), seed=0))


class _Tok:
    """The tokenizer fields the ExecuTorch metadata reads, for models without a real tokenizer."""

    bos_token_id, eos_token_id, vocab_file = 1, 2, ""


@pytest.fixture()
def lower_variants(tmp_path):
    """``lower(model, field, **common)``: the model lowered to a ``.pte`` once with the ExecuTorch
    option ``field`` true and once false; returns ``(runners, details)`` keyed by that value."""
    from export.executorch.exporter import ExecuTorchOptions, lower_to_pte
    from export.executorch.runner import ExecuTorchRunner

    def lower(model, field: str, **common):
        runners, details = {}, {}
        for value in (True, False):
            opts = ExecuTorchOptions(**common, **{field: value})
            data, details[value] = lower_to_pte(model, _Tok(), opts, log=lambda *_: None)
            (tmp_path / f"{field}-{value}.pte").write_bytes(data)
            runners[value] = ExecuTorchRunner(tmp_path / f"{field}-{value}.pte")
        return runners, details

    return lower


DECODER_LAYERS = 2
#: shapes for decoders exported with ``torch.export`` only (GQA 4:2)
DECODER_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=DECODER_LAYERS, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, initializer_range=0.2,
                    pad_token_id=0)


@pytest.fixture()
def exported_decoder():
    """``export(model_type, **overrides)``: a tiny random model of that family as the ExecuTorch
    decoder (custom cache ops, norms swapped, q/k/v and gate/up fused), through ``torch.export``
    with a dynamic length (seconds; nothing lowered)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from export.executorch.delegable import split_as_slices, static_reshapes, swap_rms_norms
    from export.executorch.fusion import fuse_projections, merge_duplicate_linears
    from export.executorch.llm import ExecuTorchDecoder, plan_layers

    def export(model_type: str, **over):
        torch.manual_seed(0)
        cfg = AutoConfig.for_model(model_type, **{**DECODER_BASE, **over})
        model = AutoModelForCausalLM.from_config(cfg).eval()
        swap_rms_norms(model)
        fuse_projections(model)
        dec = ExecuTorchDecoder(model, plan_layers(model.config, 16))
        seq = torch.export.Dim("seq_len", min=1, max=8)
        with torch.no_grad():
            ep = torch.export.export(dec, (torch.zeros(1, 3, dtype=torch.long), torch.arange(3)),
                                     dynamic_shapes=({1: seq}, {0: seq}), strict=True)
        static_reshapes(ep)  # the graph passes lower_program runs before the layout rewrites
        split_as_slices(ep)
        merge_duplicate_linears(ep)
        return ep

    return export


def run_decoder(ep, ids) -> list:
    """An exported decoder's logits for a prefill of all but the last of ``ids`` then one step,
    and every cache buffer after them."""
    import torch

    mod = ep.module()
    t = ids.shape[1] - 1
    with torch.no_grad():
        out = [mod(ids[:, :t], torch.arange(t)), mod(ids[:, t:], torch.arange(t, t + 1))]
    return out + [b.clone() for name, b in mod.named_buffers() if "cache" in name]


def real_text_prompts(text: list[int], cache: int) -> list[list[int]]:
    """Twelve prompts from the reference text for a real model's speculative tests: passages said twice
    (lookup finds drafts), plain text, and prompts that leave a few positions to the cache's end."""
    prompts = [text[i * 97: i * 97 + 40] * 2 for i in range(4)] + [text[i * 131: i * 131 + 24] for i in range(4)]
    return prompts + [text[900:1010], text[1200:1300] + text[1200:1220], text[2000:2000 + cache - 4],
                      text[3000:3000 + cache - 1]]


def assert_keeps_plain_greedy(plain, fast, prompts: list[list[int]], cache: int) -> tuple[int, int]:
    """Speculative decoding through ``fast`` gives ``plain``'s greedy tokens on every prompt, each run until
    the cache is full (no EOS); returns (drafted, accepted) over all of them."""
    from export.decoding.runtime import greedy_generate
    from export.decoding.speculative import DraftLength, speculative_generate

    drafted = accepted = 0
    for prompt in prompts:
        want = greedy_generate(plain, prompt, cache)
        got, stats = speculative_generate(fast, prompt, cache, draft=DraftLength(measure=False))
        assert got == want, (len(prompt), next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None))
        assert len(want) == cache - len(prompt) + 1
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    return drafted, accepted


def fixed_policy(**kw):
    """A draft policy priced by its cost line, not by timing the calls (so tests are deterministic)."""
    from export.decoding.draft_policy import DraftLength

    return DraftLength(measure=False, **kw)


def scripted_runner(logits_after):
    """A runner whose logits for each fed token are ``logits_after(history)`` (every token fed so far,
    that one last): every position's logits, a KV "cache" that is the history, cut back exactly. For
    the decoding loops' tests, where the model's answer must be known in closed form."""
    import torch

    from export.decoding.runtime import EagerRunner

    class Scripted(EagerRunner):
        def __init__(self):
            super().__init__(torch.nn.Identity())
            self.ids: list[int] = []

        def reset(self):
            super().reset()
            self.ids = []

        def forward(self, ids, *, all_logits=True):
            rows = []
            for t in torch.as_tensor(ids).reshape(-1).tolist():
                self.ids.append(t)
                self._pos += 1
                rows.append(logits_after(self.ids))
            logits = torch.stack(rows)
            return logits if all_logits else logits[-1:]

        def truncate(self, n):
            del self.ids[n:]
            self._pos = n
            return True

    return Scripted()
