"""optimize.finetune: distillation reduces KL to the teacher; config and data errors are clear."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from transformers import AutoConfig, AutoModelForCausalLM

from optimize.finetune import FinetuneConfig, FinetuneError, finetune
from optimize.rewrites.gqa import convert_to_gqa

V = 256


def tiny():
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=4, vocab_size=V)
    return AutoModelForCausalLM.from_config(cfg).eval()


def kl(student, teacher, ids):
    with torch.no_grad():
        s = F.log_softmax(student(input_ids=ids).logits, -1).flatten(0, 1)
        t = F.log_softmax(teacher(input_ids=ids).logits, -1).flatten(0, 1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean").item()


TRAIN = torch.randint(0, V, (4000,), generator=torch.Generator().manual_seed(5))
PROBE = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(6))


def test_distillation_reduces_kl_after_gqa():
    teacher = tiny()
    # sharpen the teacher so there is a signal to distil
    with torch.no_grad():
        teacher.lm_head.weight.mul_(20)
    student = copy.deepcopy(teacher)
    convert_to_gqa(student, 1)
    before = kl(student, teacher, PROBE)
    cfg = FinetuneConfig(steps=30, optimizer={"lr": 3e-4}, seq_len=32, batch={"micro_batch_size": 4}, progress=False)
    facts = finetune(student, cfg, TRAIN, teacher=teacher, seed=0, log=lambda s: None)
    after = kl(student, teacher, PROBE)
    assert after < 0.85 * before, (before, after)
    assert facts["loss_last5_mean"] < facts["loss_first5_mean"]
    assert not student.training and all(p.grad is None for p in student.parameters())


def test_finetune_is_deterministic_for_a_seed():
    teacher = tiny()
    runs = []
    for _ in range(2):
        student = copy.deepcopy(teacher)
        convert_to_gqa(student, 2)
        cfg = FinetuneConfig(steps=3, optimizer={"lr": 1e-3}, seq_len=16, batch={"micro_batch_size": 2}, progress=False)
        runs.append(finetune(student, cfg, TRAIN, teacher=teacher, seed=3, log=lambda s: None)["loss_curve"])
    assert runs[0] == runs[1]


def test_lm_mode_needs_no_teacher():
    m = tiny()
    facts = finetune(m, FinetuneConfig(loss="lm", steps=2, seq_len=16, batch={"micro_batch_size": 1}, progress=False), TRAIN, log=lambda s: None)
    assert facts["loss"] == "lm" and len(facts["loss_curve"]) == 2


def test_errors():
    m = tiny()
    with pytest.raises(FinetuneError, match="finetune: loss 'distill' needs a teacher model"):
        finetune(m, FinetuneConfig(progress=False), TRAIN)
    with pytest.raises(FinetuneError, match="needs at least seq_len\\+1=257 training tokens; ctx.train_ids has 100"):
        finetune(m, FinetuneConfig(loss="lm", progress=False), TRAIN[:100])
    with pytest.raises(ValidationError, match="optimizer.lr\n  Input should be greater than 0"):
        FinetuneConfig(optimizer={"lr": 0})
    with pytest.raises(ValidationError, match="loss\n  Input should be 'distill' or 'lm'"):
        FinetuneConfig(loss="kd")
    with pytest.raises(ValidationError, match="unknown key 'lr'.*allowed keys: alpha, batch"):
        FinetuneConfig.model_validate({"lr": 1e-4})
    with pytest.raises(ValidationError, match="with loss: lm it must stay 0"):
        FinetuneConfig(loss="lm", alpha=0.5)


def test_finetune_runs_on_the_shared_loop_and_restores_the_model():
    m = tiny()
    m.config.use_cache = True
    frozen = m.model.embed_tokens.weight
    frozen.requires_grad_(False)
    facts = finetune(m, FinetuneConfig(loss="lm", steps=3, seq_len=16, batch={"micro_batch_size": 2}, progress=False), TRAIN, log=lambda s: None)
    assert facts["tokens_seen"] == 3 * 2 * 16  # counted by train.loop
    assert m.config.use_cache is True  # the loop turns the KV cache off while training; finetune restores it
    assert frozen.requires_grad is False and all(p.grad is None for p in m.parameters())
    with pytest.raises(FinetuneError, match="holds 1 windows of seq_len=16, fewer than the 2"):
        finetune(m, FinetuneConfig(loss="lm", steps=1, seq_len=16, batch={"micro_batch_size": 2}, progress=False), TRAIN[:20])


@pytest.mark.parametrize("tied", [False, True])
def test_frozen_parameters_stay_as_they_are(tied):
    """frozen: [embeddings] keeps the input embedding and the output projection (one tensor when tied) bit for
    bit while the rest trains; a pattern keeps the parameters it names. What a draft model needs to share its
    tables with the target in one program."""
    teacher = tiny()
    student = copy.deepcopy(teacher)
    with torch.no_grad():  # a student that differs from its teacher, so there is a gradient
        for p in student.model.layers.parameters():
            p.add_(0.05 * torch.randn_like(p))
    if tied:
        student.lm_head.weight = student.model.embed_tokens.weight
    emb, head = student.model.embed_tokens.weight.detach().clone(), student.lm_head.weight.detach().clone()
    norm0 = student.model.layers[0].input_layernorm.weight.detach().clone()
    q0 = student.model.layers[0].self_attn.q_proj.weight.detach().clone()
    cfg = FinetuneConfig(steps=3, optimizer={"lr": 1e-3}, seq_len=16, batch={"micro_batch_size": 2},
                         frozen=["embeddings", "model.layers.0.input_layernorm.*"])
    finetune(student, cfg, TRAIN, teacher=teacher, seed=0, log=lambda s: None)
    assert torch.equal(student.model.embed_tokens.weight, emb) and torch.equal(student.lm_head.weight, head)
    assert torch.equal(student.model.layers[0].input_layernorm.weight, norm0)
    assert not torch.equal(student.model.layers[0].self_attn.q_proj.weight, q0)  # the rest trained
    assert all(p.requires_grad for p in student.parameters())  # handed back as it came


def test_a_frozen_pattern_that_matches_nothing_is_refused():
    student = tiny()
    cfg = FinetuneConfig(steps=1, seq_len=16, batch={"micro_batch_size": 2}, frozen=["model.layer.*"])
    with pytest.raises(FinetuneError, match="matches no parameter.*'embeddings'"):
        finetune(student, cfg, TRAIN, teacher=tiny(), log=lambda s: None)
    with pytest.raises(FinetuneError, match="nothing would train"):
        finetune(student, cfg.model_copy(update={"frozen": ["*"]}), TRAIN, teacher=tiny(), log=lambda s: None)
