"""The rmsnorm stage: exact on every supported pre-LN family, reloadable, refuses clearly."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from optimize.rewrites.layernorm_fold import CONFIG_KEY, load_rewritten
from optimize.rewrites.ln_plans import RewriteRefused
from optimize.stage_api import StageContext, get_stage
from optimize.stages.rmsnorm import RMSNormConfig, restore

V = 512
TINY_LLAMA_CFG = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=49152)
MODEL_TYPE = {"opt_nobias": "opt", "gpt_neox_parallel": "gpt_neox", "gpt_neox_sequential": "gpt_neox"}
ARCHS = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=V, n_positions=64),
    "opt": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, vocab_size=V,
                max_position_embeddings=64, word_embed_proj_dim=64),
    "opt_nobias": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, vocab_size=V,
                       max_position_embeddings=64, word_embed_proj_dim=64, enable_bias=False),
    "gpt_neox_parallel": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                              vocab_size=V, use_parallel_residual=True),
    "gpt_neox_sequential": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                vocab_size=V, use_parallel_residual=False, tie_word_embeddings=True),
    "phi": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=V),
}


def build(name: str, **over) -> nn.Module:
    """A random model whose norms and biases are far from their init, so folding them matters."""
    kw = dict(ARCHS[name], **over)
    torch.manual_seed(0)
    config = AutoConfig.for_model(MODEL_TYPE.get(name, name), **kw)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if isinstance(model.get_submodule(n.rpartition(".")[0]), nn.LayerNorm):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if n.endswith("weight") else 0.0))
            elif n.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1)
    return model


def ctx(tmp_path, seed: int = 0) -> StageContext:
    ids = torch.randint(0, V, (600,), generator=torch.Generator().manual_seed(1))
    return StageContext(tokenizer=None, calibration=[ids[:64]], train_ids=ids, target=None, work_dir=tmp_path, seed=seed)


def run(model, cfg: dict, c: StageContext):
    spec = get_stage("rmsnorm")
    return spec.fn(model, spec.config_cls.model_validate({"kind": "rmsnorm", **cfg}), c)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_exact_on_every_supported_family(name, tmp_path):
    model = build(name)
    ref = logits(model, IDS)
    c = ctx(tmp_path)
    out = run(model, {}, c)
    assert not any(isinstance(m, nn.LayerNorm) for m in out.modules())
    diff = (logits(out, IDS) - ref).abs().max().item()
    assert diff <= 1e-4, f"{name}: max abs logit diff {diff}"
    exact = c.details["exactness"]
    assert c.details["mode"] == "exact" and exact["relative_diff"] <= exact["tolerance"] == 1e-4
    assert exact["tokens"] == 64 and exact["max_abs_logit_diff"] <= 1e-4  # ctx() has one 64-token window
    assert getattr(out.config, CONFIG_KEY)["mode"] == "exact"


@pytest.mark.parametrize("name", ["gpt2", "gpt_neox_parallel", "opt_nobias"])
def test_save_load_round_trip(name, tmp_path):
    model = run(build(name), {}, ctx(tmp_path))
    ref = logits(model, IDS)
    model.save_pretrained(tmp_path / "saved")
    again = load_rewritten(tmp_path / "saved")
    assert (logits(again, IDS) - ref).abs().max().item() <= 1e-6
    assert type(again) is type(model)


def test_restore_rebuilds_layout_on_meta(tmp_path):
    """The pipeline's checkpoint resume builds the model on meta, restores, then assigns weights."""
    model = run(build("gpt2"), {}, ctx(tmp_path))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(model.config)
    restore(skeleton)
    restore(skeleton)  # idempotent: a resume may list the stage's restore more than once
    missing, unexpected = skeleton.load_state_dict(model.state_dict(), strict=False, assign=True)
    assert not missing and not unexpected
    assert not any(p.is_meta for p in skeleton.parameters())
    assert (logits(skeleton.eval(), IDS) - logits(model, IDS)).abs().max().item() == 0


def test_tied_gpt2_is_untied_and_head_keeps_logits(tmp_path):
    model = build("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    c = ctx(tmp_path)
    out = run(model, {}, c)
    assert out.lm_head.weight.data_ptr() != out.transformer.wte.weight.data_ptr()
    assert out.config.tie_word_embeddings is False and c.details["untied_head"] is True
    assert "lm_head" in c.details["added_bias"]  # the final norm's beta becomes a logit bias


def test_post_ln_opt_is_refused_with_reason(tmp_path):
    model = build("opt", do_layer_norm_before=False)
    with pytest.raises(RewriteRefused, match=r"opt with do_layer_norm_before=False \(post-LayerNorm"):
        run(model, {}, ctx(tmp_path))
    assert any(isinstance(m, nn.LayerNorm) for m in model.modules())  # untouched


def test_unsupported_architecture_is_refused(tmp_path):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("gptj", n_embd=64, n_layer=1, n_head=4, vocab_size=V, rotary_dim=8, n_positions=64)
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(RewriteRefused, match="architecture 'gptj'.*no exact LayerNorm->RMSNorm plan; supported: gpt2"):
        run(model, {}, ctx(tmp_path))


def test_approximate_swap_warns_and_heals(tmp_path):
    model = build("opt", do_layer_norm_before=False)
    c = ctx(tmp_path)
    heal = {"loss": "distill", "steps": 4, "seq_len": 16, "batch": {"micro_batch_size": 2}, "optimizer": {"lr": 1e-3}}
    with pytest.warns(UserWarning, match="needs healing"):
        out = run(model, {"approximate": True, "heal": heal}, c)
    assert not any(isinstance(m, nn.LayerNorm) for m in out.modules())
    assert c.details["mode"] == "approximate" and len(c.details["heal"]["loss_curve"]) == 4


def test_llama_has_nothing_to_do(tiny_llama, tmp_path):
    c = ctx(tmp_path)
    assert run(tiny_llama, {}, c) is tiny_llama and c.details["mode"] == "none"


def test_config_errors():
    with pytest.raises(ValidationError, match="heal needs approximate: true"):
        RMSNormConfig.model_validate({"heal": {"steps": 3}})
    with pytest.raises(ValidationError, match="unknown key 'aproximate'.*did you mean 'approximate'"):
        RMSNormConfig.model_validate({"aproximate": True})
    with pytest.raises(ValidationError, match="heal.steps\n  Input should be greater than or equal to 1"):
        RMSNormConfig.model_validate({"approximate": True, "heal": {"steps": 0}})


def test_pipeline_resume_restores_rewritten_layout(tiny_cfg):
    """A resumed run rebuilds the rmsnorm checkpoint through the stage's restore hook."""
    import math

    from optimize import load_config, run_pipeline

    tiny_cfg["model"]["config"] = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                       vocab_size=49152)
    tiny_cfg["stages"] = [{"kind": "rmsnorm"}, {"kind": "test_noise", "scale": 0.0}]
    first = run_pipeline(load_config(tiny_cfg), say=lambda m: None)
    assert first.ok, first.rows[-1].error
    messages: list[str] = []
    again = run_pipeline(load_config(tiny_cfg, ["stages.1.scale=1e-12"]), say=messages.append)
    assert [r.status for r in again.rows[1:]] == ["resumed", "pass"], again.rows[-1].error
    assert math.isclose(again.rows[2].metrics.perplexity, first.rows[2].metrics.perplexity, rel_tol=1e-5)


# ---------------------------------------------------------------------------------------------
# pre-flight (validation) and the shared exactness check

TINY = {
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=512, vocab_size=49152),
    "opt_post_ln": dict(model_type="opt", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                        vocab_size=49152, word_embed_proj_dim=64, do_layer_norm_before=False),
    "gptj": dict(model_type="gptj", n_embd=64, n_layer=1, n_head=4, vocab_size=49152, rotary_dim=8, n_positions=512),
}


@pytest.mark.parametrize(
    "model,message",
    [
        ("opt_post_ln", r"exact rewrite refused: opt with do_layer_norm_before=False \(post-LayerNorm"),
        ("gptj", r"exact rewrite refused: architecture 'gptj' \(GPTJForCausalLM\) has no exact LayerNorm->RMSNorm plan"),
    ],
)
def test_refused_at_validation_unless_approximate(tiny_cfg, model, message):
    from optimize import load_config
    from optimize.errors import ConfigError

    tiny_cfg["model"]["config"] = dict(TINY[model])
    tiny_cfg["stages"] = [{"kind": "rmsnorm"}]
    with pytest.raises(ConfigError, match=r"stages\.0: stage '0:rmsnorm': " + message):
        load_config(tiny_cfg)
    tiny_cfg["stages"] = [{"kind": "rmsnorm", "approximate": True}]
    assert load_config(tiny_cfg).stages[0].approximate is True


def test_planned_config_records_the_rewrite_for_exporters(tiny_cfg, tmp_path):
    """An exporter that needs RMSNorm (TorchChat) sees the record at validation, before any weights."""
    from optimize import load_config
    from targets.sources import peek_config

    tiny_cfg["model"]["config"] = dict(TINY["gpt2"], tie_word_embeddings=True)
    tiny_cfg["stages"] = [{"kind": "rmsnorm"}]
    stage = load_config(tiny_cfg).stages[0]
    config = peek_config(load_config(tiny_cfg).model)
    planned = stage.planned_config(config)
    record = getattr(planned, CONFIG_KEY)
    assert record["mode"] == "exact" and record["planned"] is True and record["arch"] == "gpt2"
    assert record["norms"] == ["transformer.h.0.ln_1", "transformer.h.0.ln_2", "transformer.h.1.ln_1",
                               "transformer.h.1.ln_2", "transformer.ln_f"]
    assert record["untied_head"] is True and planned.tie_word_embeddings is False
    assert getattr(config, CONFIG_KEY, None) is None and config.tie_word_embeddings is True  # input untouched
    # the stage writes the same record (plus eps and added biases) when it runs
    model = AutoModelForCausalLM.from_config(config).eval()
    run(model, {}, ctx(tmp_path))
    done = getattr(model.config, CONFIG_KEY)
    assert {k: done[k] for k in ("mode", "arch", "norms", "untied_head")} == {
        k: record[k] for k in ("mode", "arch", "norms", "untied_head")}
    approx = load_config({**tiny_cfg, "model": {**tiny_cfg["model"], "config": dict(TINY["opt_post_ln"])},
                          "stages": [{"kind": "rmsnorm", "approximate": True}]})
    rec = getattr(approx.stages[0].planned_config(peek_config(approx.model)), CONFIG_KEY)
    assert rec["mode"] == "approximate" and len(rec["norms"]) == 4  # 2 per layer (post-LN OPT has no final norm)
    llama = load_config({**tiny_cfg, "model": {**tiny_cfg["model"], "config": dict(TINY_LLAMA_CFG)}})
    cfg_llama = peek_config(llama.model)
    assert RMSNormConfig().planned_config(cfg_llama) is cfg_llama  # no LayerNorm: nothing to record


def test_exact_rewrite_that_is_not_exact_is_refused(tmp_path, monkeypatch):
    import optimize.stages.rmsnorm as stage
    from optimize.rewrites.exactness import FoldNotExact

    real = stage.fold_exact

    def broken(model, plan):  # forgets to centre the embeddings, so LayerNorm's mean subtraction mattered
        plan.embeddings.clear()
        return real(model, plan)

    monkeypatch.setattr(stage, "fold_exact", broken)
    with pytest.raises(FoldNotExact, match=r"rmsnorm \(exact LayerNorm->RMSNorm rewrite of gpt2\) is not exact on this "
                                           r"model: logits moved by up to .*above the tolerance 0.0001"):
        run(build("gpt2"), {}, ctx(tmp_path))
