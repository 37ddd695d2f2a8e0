"""The split head (export/onnxruntime/last_logits.py): ``logits`` holds the last fed position,
``all_logits`` every position on request; onnxruntime-genai's own Generator allocates one row per
call; scoring through both runners equals the builder's whole-head graph."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import pytest
import torch

from export.onnxruntime.exporter import OnnxRuntimeExporter
from export.onnxruntime.genai_runner import GenaiRunner, genai_greedy
from export.onnxruntime.last_logits import ALL, ASK, LAST
from export.decoding.runtime import greedy_generate

IDS = torch.arange(1, 41) * 37 % 4000
W8A8 = {"quantize": "dynamic_per_token", "quantize_lm_head": True, "quantize_embedding": True}


def _quiet(*_a, **_k):
    pass


def _model(family: str, **extra) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=49152, max_position_embeddings=1024, initializer_range=0.2)
    cfg = AutoConfig.for_model(family, **{**base, **extra})
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.fixture(scope="module")
def exports(smollm2_tokenizer, tmp_path_factory):
    """Per family: the W8A8 export with the split head (default) and the builder's whole head, from
    the same weights: a quantized lm_head whose per-token chain is copied, and Gemma 2's softcap
    (Div, Tanh, Mul after the MatMul) in the head."""
    out = {}
    for family, extra in {"llama": dict(tie_word_embeddings=True),
                          "gemma2": dict(head_dim=16, sliding_window=8, tie_word_embeddings=True),
                          "qwen2": dict(tie_word_embeddings=False)}.items():
        model = _model(family, **extra)
        root = tmp_path_factory.mktemp(family)
        split = OnnxRuntimeExporter().export(model, smollm2_tokenizer, root / "split", W8A8, log=_quiet)
        whole = OnnxRuntimeExporter().export(model, smollm2_tokenizer, root / "whole", {**W8A8, "last_logits": False},
                                             log=_quiet)
        out[family] = (split, whole)
    return out


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen2"])
@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_graph_declares_one_row_and_asks_for_the_rest(exports, family):
    split, whole = exports[family]
    g = onnx.load(str(split.artifact), load_external_data=False).graph
    outs = {o.name: o for o in g.output}
    assert outs[LAST].type.tensor_type.shape.dim[1].dim_value == 1  # what onnxruntime-genai reads as pruned
    assert ALL in outs and ASK in {i.name for i in g.input} and ASK in {t.name for t in g.initializer}
    assert split.manifest["head"]["head_nodes"] >= 1 and whole.manifest["head"] is None
    assert ASK in split.manifest["inputs"] and ALL in split.manifest["outputs"] and "position_ids" not in split.manifest["inputs"]
    assert ALL not in {o.name for o in onnx.load(str(whole.artifact), load_external_data=False).graph.output}
    # the copy reads the same initializers: the weights file does not grow
    size = lambda r: (r.artifact.parent / (r.artifact.name + ".data")).stat().st_size  # noqa: E731
    assert size(split) == size(whole)
    # one head: the graph gains the row selection (Where, Slice) and the last row's Slice, nothing else
    for key in ("ops", "decode_ops"):
        gained = Counter(split.manifest[key])
        gained.subtract(whole.manifest[key])
        assert {k: v for k, v in gained.items() if v} == {"Where": 1, "Slice": 2}, key


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen2"])
def test_scoring_and_generating_equal_the_whole_head(exports, family):
    """Through ONNX Runtime and onnxruntime-genai: every position's logits (prefill in one call, then
    a decode step, then a chunk) within 1e-5 of the builder's whole-head graph, the last-position
    call equal to the last row, and greedy tokens identical."""
    split, whole = exports[family]
    ex = OnnxRuntimeExporter()
    pairs = [(ex.load(split.artifact), ex.load(whole.artifact)),
             (GenaiRunner(split.artifact.parent), GenaiRunner(whole.artifact.parent))]
    for a, b in pairs:
        assert a.last_logits and not b.last_logits, a.runtime
        for r in (a, b):
            r.reset()
        for piece in (IDS[:20], IDS[20:21], IDS[21:]):
            got, want = a.forward(piece), b.forward(piece)
            assert got.shape == want.shape == (piece.numel(), 49152), a.runtime
            assert (got - want).abs().max() < 1e-5, a.runtime
        a.reset(), b.reset()
        last, full = a.forward(IDS, all_logits=False), b.forward(IDS)
        assert last.shape == (1, 49152) and (last[0] - full[-1]).abs().max() < 1e-5, a.runtime
        assert greedy_generate(a, IDS[:8], 12) == greedy_generate(b, IDS[:8], 12), a.runtime


def test_genai_generator_allocates_one_row_per_call(exports):
    """An app's loop (onnxruntime-genai's own Generator on the shipped folder, nothing set): the
    prefill's logits are one row, ``all_logits`` too (the head ran on the last position only), and
    its greedy search gives the tokens of the whole-head graph's."""
    import onnxruntime_genai as og

    split, whole = exports["llama"]
    model = og.Model(str(split.artifact.parent))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=64, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(IDS[:30].numpy().astype(np.int32))
    assert gen.get_output(LAST).shape == (1, 1, 49152)
    assert gen.get_output(ALL).shape == (1, 1, 49152)
    prompt = IDS[:10].tolist()
    assert genai_greedy(split.artifact.parent, prompt, 12) == genai_greedy(whole.artifact.parent, prompt, 12)


def test_runner_does_not_touch_the_shipped_graph(exports):
    """The genai runner flips ``return_all_logits`` on an in-memory copy of the graph: the folder's
    files are byte for byte what the exporter wrote."""
    split, _ = exports["llama"]
    before = {f.name: f.read_bytes() for f in split.artifact.parent.iterdir() if f.is_file()}
    r = GenaiRunner(split.artifact.parent)
    r.forward(IDS[:12])
    r.close()
    assert {f.name: f.read_bytes() for f in split.artifact.parent.iterdir() if f.is_file()} == before
    assert json.loads((split.artifact.parent / "genai_config.json").read_text())["model"]["decoder"]["filename"] == "model.onnx"
