"""distill stage: KD on the shared train loop pulls a perturbed model back toward its teacher;
bad settings fail with messages that name the problem."""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoConfig, AutoModelForCausalLM

from optimize.finetune import FinetuneError
from optimize.losses import kl_to_teacher
from optimize.stage_api import StageContext, get_stage
from optimize.stages.distill import DistillConfig

V = 256
TRAIN = torch.randint(0, V, (3000,), generator=torch.Generator().manual_seed(5))
PROBE = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(6))


def tiny(vocab: int = V):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab)
    return AutoModelForCausalLM.from_config(cfg).eval()


def ctx_for(tmp_path, baseline, train_ids=TRAIN):
    return StageContext(tokenizer=None, calibration=[], train_ids=train_ids, target=None, work_dir=tmp_path,
                        seed=0, baseline_model=baseline, log=lambda s: None)


def kl(student, teacher) -> float:
    with torch.no_grad():
        return kl_to_teacher(student(input_ids=PROBE).logits, teacher(input_ids=PROBE).logits).item()


def teacher_and_student():
    teacher = tiny()
    with torch.no_grad():
        teacher.lm_head.weight.mul_(20)  # a sharp teacher gives a real signal to distil
    student = copy.deepcopy(teacher)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in student.named_parameters():
            if name.endswith("proj.weight"):
                p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.5)
    return teacher, student


def run(student, cfg: DistillConfig, ctx):
    return get_stage("distill").fn(student, cfg, ctx)


def test_distillation_reduces_kl_to_the_baseline_teacher(tmp_path):
    teacher, student = teacher_and_student()
    teacher_state = {k: v.clone() for k, v in teacher.state_dict().items()}
    before = kl(student, teacher)
    cfg = DistillConfig(steps=25, seq_len=32, temperature=1.0, optimizer={"lr": 1e-3},
                        batch={"micro_batch_size": 2, "grad_accum_steps": 2})
    ctx = ctx_for(tmp_path, teacher)
    out = run(student, cfg, ctx)
    after = kl(student, teacher)
    assert out is student
    assert after < 0.8 * before, (before, after)
    d = ctx.details
    assert d["loss_last5_mean"] < d["loss_first5_mean"]
    assert d["tokens_seen"] == 25 * 4 * 32 and d["grad_accum_steps"] == 2
    assert d["teacher"] == "baseline (pre-pipeline model)"
    # the stage contract: back in eval mode, no grads left, teacher untouched
    assert not student.training and all(p.grad is None for p in student.parameters())
    assert all(torch.equal(teacher_state[k], v) for k, v in teacher.state_dict().items())
    assert student.config.use_cache is True


def test_alpha_mixes_cross_entropy(tmp_path):
    teacher, student = teacher_and_student()
    ctx = ctx_for(tmp_path, teacher)
    run(student, DistillConfig(steps=2, seq_len=32, alpha=0.5, temperature=2.0), ctx)
    assert ctx.details["alpha"] == 0.5 and len(ctx.details["loss_curve"]) == 2


def test_loop_memory_savers_leave_no_trace(tmp_path):
    """Activation checkpointing wraps blocks inside the loop; the stage must hand back the same
    module tree, or later stages, resume and export would see checkpoint wrappers."""
    teacher, student = teacher_and_student()
    keys = list(student.state_dict())
    tree = [type(m).__name__ for m in student.modules()]
    cfg = DistillConfig(steps=2, seq_len=32, memory={"activation_checkpointing": "full"})
    run(student, cfg, ctx_for(tmp_path, teacher))
    assert list(student.state_dict()) == keys
    assert [type(m).__name__ for m in student.modules()] == tree


def test_bad_values_are_clear(tmp_path):
    with pytest.raises(ValidationError, match="alpha\n  Input should be less than 1"):
        DistillConfig(alpha=1.0)
    with pytest.raises(ValidationError, match="temperature\n  Input should be greater than 0"):
        DistillConfig(temperature=0)
    with pytest.raises(ValidationError, match="steps\n  Input should be greater than or equal to 1"):
        DistillConfig(steps=0)
    with pytest.raises(ValidationError, match="optimizer.lr\n  Input should be greater than 0"):
        DistillConfig(optimizer={"lr": 0})
    with pytest.raises(ValidationError, match="unknown key .learning_rate.; allowed keys: alpha, batch"):
        DistillConfig(learning_rate=1e-4)

    teacher, student = teacher_and_student()
    with pytest.raises(ValueError, match="no teacher: the pipeline passed no baseline model"):
        run(student, DistillConfig(steps=1, seq_len=32), ctx_for(tmp_path, None))
    with pytest.raises(FinetuneError, match="needs at least seq_len\\+1=257 training tokens; ctx.train_ids has 100"):
        run(student, DistillConfig(steps=1), ctx_for(tmp_path, teacher, TRAIN[:100]))
    with pytest.raises(FinetuneError, match="holds 2 windows of seq_len=32, fewer than the 4"):
        run(student, DistillConfig(steps=1, seq_len=32, batch={"micro_batch_size": 4}),
            ctx_for(tmp_path, teacher, TRAIN[:70]))
    with pytest.raises(ValueError, match="the teacher's vocabulary has 128 tokens, the model's 256"):
        run(student, DistillConfig(steps=1, seq_len=32), ctx_for(tmp_path, tiny(vocab=128)))
