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
    """One step sees the same first batch in every run (same seed), so the first loss of
    alpha=0.5 must be the mean of pure KL*T^2 (alpha=0) and pure CE (loss: lm) on it."""
    teacher, student = teacher_and_student()
    first = {}
    for name, opts in {"kl": dict(alpha=0.0), "ce": dict(loss="lm"), "mix": dict(alpha=0.5)}.items():
        ctx = ctx_for(tmp_path, teacher)
        t = {} if name == "ce" else {"temperature": 2.0}
        run(copy.deepcopy(student), DistillConfig(steps=1, seq_len=32, **t, **opts), ctx)
        first[name] = ctx.details["loss_first"]
    assert first["kl"] != pytest.approx(first["ce"], rel=0.05)  # the mix below could not hide an ignored alpha
    assert first["mix"] == pytest.approx(0.5 * first["kl"] + 0.5 * first["ce"], rel=1e-5)


def test_hidden_weight_from_the_yaml_scales_the_hidden_term(tmp_path):
    """Through the stage (config -> loss): the first loss is KL + w * hidden MSE on the same first
    batch, so it rises linearly in ``hidden_weight``; a stage that dropped the weight fails."""
    teacher, student = teacher_and_student()
    first = {}
    for w in (0.0, 1.0, 3.0):
        ctx = ctx_for(tmp_path, teacher)
        run(copy.deepcopy(student), DistillConfig(steps=1, seq_len=32, hidden_weight=w), ctx)
        first[w] = ctx.details["loss_first"]
    term = first[1.0] - first[0.0]
    assert term > 0.05 * first[0.0], first  # the perturbed student's block outputs differ measurably
    assert first[3.0] - first[0.0] == pytest.approx(3 * term, rel=1e-4)


def _grads(model, loss) -> torch.Tensor:
    model.zero_grad()
    loss.backward()
    g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()])
    model.zero_grad()
    return g


@pytest.mark.parametrize("chunk_size", [None, 16])
def test_each_loss_weight_shapes_the_gradient(chunk_size):
    """The gradient of the combined loss is exactly the weighted sum of the three terms'
    gradients, each computed here independently: ignoring any weight fails this."""
    import torch.nn.functional as F

    from optimize.losses import DistillLoss

    teacher, student = teacher_and_student()
    ids = PROBE[:, :-1]
    batch = {"input_ids": ids, "labels": PROBE[:, 1:]}
    alpha, beta, T = 0.3, 2.0, 1.5
    layer_map = {0: 0, 1: 1}
    loss = DistillLoss(teacher, temperature=T, alpha=alpha, hidden_weight=beta, layer_map=layer_map,
                       chunk_size=chunk_size, student=student)
    got = _grads(student, loss(student, batch))
    loss.close()

    def forward(m):
        out = m(input_ids=ids, output_hidden_states=True)
        return out.logits, out.hidden_states
    with torch.no_grad():
        t_logits, t_hidden = forward(teacher)
    t_block1 = []  # the last block's output before the final norm: hooked, as HF replaces it with the normed one
    h = teacher.model.layers[1].register_forward_hook(lambda _m, _a, out: t_block1.append(out))
    with torch.no_grad():
        teacher(input_ids=ids)
    h.remove()
    s_block1 = []
    h = student.model.layers[1].register_forward_hook(lambda _m, _a, out: s_block1.append(out))
    logits, hidden = forward(student)
    h.remove()
    kl = kl_to_teacher(logits, t_logits, T)
    ce = F.cross_entropy(logits.reshape(-1, V), batch["labels"].reshape(-1))

    def nmse(a, b):
        return (a - b).pow(2).sum() / b.pow(2).sum()
    mse = (nmse(hidden[1], t_hidden[1]) + nmse(s_block1[0], t_block1[0])) / 2
    g_kl = _grads(student, kl)
    logits, hidden = forward(student)
    g_ce = _grads(student, F.cross_entropy(logits.reshape(-1, V), batch["labels"].reshape(-1)))
    s_block1.clear()
    h = student.model.layers[1].register_forward_hook(lambda _m, _a, out: s_block1.append(out))
    logits, hidden = forward(student)
    h.remove()
    g_mse = _grads(student, (nmse(hidden[1], t_hidden[1]) + nmse(s_block1[0], t_block1[0])) / 2)
    expected = (1 - alpha) * g_kl + alpha * g_ce + beta * g_mse
    assert min(float(mse.detach()), float(ce.detach()), float(kl.detach())) > 0
    for part in (g_kl, g_ce, g_mse):  # every term moves the gradient measurably
        assert float((part - expected).norm()) > 1e-3 * float(expected.norm())
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_chunked_and_full_logits_train_the_same(tmp_path):
    teacher, student = teacher_and_student()
    curves = []
    for chunk in (None, 24):
        ctx = ctx_for(tmp_path, teacher)
        run(copy.deepcopy(student), DistillConfig(steps=3, seq_len=32, alpha=0.2, chunk_size=chunk,
                                                  optimizer={"lr": 1e-3}), ctx)
        curves.append(ctx.details["loss_curve"])
    assert curves[0] == pytest.approx(curves[1], rel=1e-4)


def test_hidden_loss_maps_a_depth_pruned_student_to_the_blocks_it_kept(tmp_path):
    from optimize.stages.prune import PruneConfig

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=V)
    teacher = AutoModelForCausalLM.from_config(cfg).eval()
    calib = [TRAIN[:64], TRAIN[64:128]]
    pctx = StageContext(tokenizer=None, calibration=calib, train_ids=TRAIN, target=None, work_dir=tmp_path,
                        log=lambda s: None)
    student = get_stage("prune").fn(copy.deepcopy(teacher), PruneConfig(method="depth", num_hidden_layers=2), pctx)
    kept = pctx.details["kept_blocks"]
    ctx = ctx_for(tmp_path, teacher)
    run(student, DistillConfig(steps=12, seq_len=32, hidden_weight=1.0, optimizer={"lr": 1e-3}), ctx)
    d = ctx.details
    assert d["layer_map"] == {"0": kept[0], "1": kept[1]} and d["layer_map_from"] == "pruning record"
    assert d["projection"] is None  # same hidden size: nothing to learn
    assert d["loss_last5_mean"] < d["loss_first5_mean"]
    # an explicit map and a subset of blocks override the record
    ctx = ctx_for(tmp_path, teacher)
    run(student, DistillConfig(steps=1, seq_len=32, hidden_weight=0.5, layer_map={0: 3, 1: 3}, hidden_layers=[1]), ctx)
    assert ctx.details["layer_map"] == {"1": 3} and ctx.details["layer_map_from"] == "config"


def test_a_wider_teacher_is_matched_through_a_learned_projection(tmp_path, monkeypatch):
    import targets.sources as sources

    teacher, student = teacher_and_student()
    keys = list(student.state_dict())
    torch.manual_seed(1)
    wide_model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=V))
    # a random source needs a vocabulary as large as its tokenizer's; serve this small one instead
    monkeypatch.setattr("optimize.stages.distill.load_model", lambda src: sources.LoadedModel(wide_model, None, "wide"))
    wide = sources.RandomSource(config=dict(model_type="llama", hidden_size=96, vocab_size=V))
    ctx = ctx_for(tmp_path, teacher)
    run(student, DistillConfig(teacher=wide, steps=6, seq_len=32, hidden_weight=1.0, optimizer={"lr": 1e-3}), ctx)
    d = ctx.details
    assert d["projection"] == "learned Linear 64->96" and d["layer_map_from"] == "uniform"
    assert d["layer_map"] == {"0": 1, "1": 2}  # 2 student blocks spread over 3, the last to the last
    assert list(student.state_dict()) == keys  # the projection is gone after training


def test_a_hidden_size_pruned_student_starts_its_projection_on_the_kept_channels(tmp_path):
    from optimize.stages.prune import PruneConfig

    teacher, _ = teacher_and_student()
    pctx = StageContext(tokenizer=None, calibration=[TRAIN[:64]], train_ids=TRAIN, target=None, work_dir=tmp_path,
                        log=lambda s: None)
    student = get_stage("prune").fn(copy.deepcopy(teacher), PruneConfig(method="width", hidden_size=48), pctx)
    ctx = ctx_for(tmp_path, teacher)
    run(student, DistillConfig(steps=6, seq_len=32, hidden_weight=1.0, optimizer={"lr": 1e-3}), ctx)
    d = ctx.details
    assert d["projection"] == "learned Linear 48->64" and d["projection_init"] == "identity on the kept channels"
    assert d["layer_map_from"] == "identity" and len(d["loss_curve"]) == 6


def test_an_interrupted_distillation_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """Killed after step 5 with checkpoints every 2 steps, the re-run resumes at step 4 and ends
    with the weights of an uninterrupted run."""
    from optimize import losses

    teacher, student = teacher_and_student()
    cfg = DistillConfig(steps=6, seq_len=32, checkpoint_every_n_steps=2, optimizer={"lr": 1e-3})
    whole = copy.deepcopy(student)
    run(whole, cfg, ctx_for(tmp_path / "whole", teacher))

    calls = {"n": 0}
    real = losses.DistillLoss.__call__

    def dies_at_step_5(self, model, batch):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt("killed")
        return real(self, model, batch)

    monkeypatch.setattr(losses.DistillLoss, "__call__", dies_at_step_5)
    first = copy.deepcopy(student)
    with pytest.raises(KeyboardInterrupt):
        run(first, cfg, ctx_for(tmp_path / "run", teacher))
    saved = list((tmp_path / "run").glob("distill-train-*/checkpoints/step-*"))
    assert [p.name for p in saved] == ["step-00000004"]
    monkeypatch.setattr(losses.DistillLoss, "__call__", real)
    again = copy.deepcopy(student)  # the pipeline re-enters the stage with the model it had before it
    ctx = ctx_for(tmp_path / "run", teacher)
    run(again, cfg, ctx)
    assert ctx.details["resumed_at_step"] == 4 and len(ctx.details["loss_curve"]) == 2
    assert not list((tmp_path / "run").glob("distill-train-*"))  # finished: the mid-stage checkpoint is gone
    for (name, a), b in zip(whole.state_dict().items(), again.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


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
    with pytest.raises(ValidationError, match="unknown key .learning_rate.; allowed keys: alpha, answers, batch"):
        DistillConfig(learning_rate=1e-4)
    with pytest.raises(ValidationError, match="hidden_layers and layer_map apply only with hidden_weight > 0"):
        DistillConfig(hidden_layers=[0])
    with pytest.raises(ValidationError, match="hidden_weight needs loss: distill"):
        DistillConfig(loss="lm", hidden_weight=1.0)
    with pytest.raises(ValidationError, match="hidden_weight\n  Input should be greater than or equal to 0"):
        DistillConfig(hidden_weight=-1)
    with pytest.raises(ValidationError, match="checkpoint_every_n_steps\n  Input should be greater than or equal"):
        DistillConfig(checkpoint_every_n_steps=-1)
    with pytest.raises(ValidationError, match="chunk_size\n  Input should be greater than or equal to 1"):
        DistillConfig(chunk_size=0)
    with pytest.raises(ValidationError, match="keep_sparsity\n  Input should be a valid boolean"):
        DistillConfig(keep_sparsity="sometimes")
    with pytest.raises(ValidationError, match="hidden_layers\n  List should have at least 1 item"):
        DistillConfig(hidden_weight=1.0, hidden_layers=[])
    with pytest.raises(ValidationError, match="layer_map\n  Dictionary should have at least 1 item"):
        DistillConfig(hidden_weight=1.0, layer_map={})

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
    with pytest.raises(ValueError, match=r"layer_map \{0: 5\} is out of range: the student has 2 blocks"):
        run(student, DistillConfig(steps=1, seq_len=32, hidden_weight=1.0, layer_map={0: 5}), ctx_for(tmp_path, teacher))
    with pytest.raises(ValueError, match=r"hidden_layers \[7\] are not student blocks"):
        run(student, DistillConfig(steps=1, seq_len=32, hidden_weight=1.0, hidden_layers=[7]), ctx_for(tmp_path, teacher))


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")])]


@pytest.mark.parametrize("device", DEVICES)
def test_distillation_trains_where_the_pipeline_placed_the_model(tmp_path, device):
    """Student and baseline teacher on ``device``, training text on the CPU: the stage trains
    there, leaves the model there, and pulls it toward the teacher as on the CPU."""
    teacher, student = teacher_and_student()
    teacher.to(device)
    student.to(device)
    probe = PROBE.to(device)

    def kl_here() -> float:
        with torch.no_grad():
            return kl_to_teacher(student(input_ids=probe).logits, teacher(input_ids=probe).logits).item()

    before = kl_here()
    cfg = DistillConfig(steps=25, seq_len=32, optimizer={"lr": 1e-3}, batch={"micro_batch_size": 2, "grad_accum_steps": 2})
    ctx = ctx_for(tmp_path, teacher)
    ctx.device = torch.device(device)
    out = run(student, cfg, ctx)
    assert out is student and all(p.device.type == device for p in student.parameters())
    assert kl_here() < 0.8 * before


def test_the_teacher_answers_its_prompts_and_the_student_trains_on_them(tmp_path, smollm2_tokenizer):
    """data: teacher_answers: prompts made from the training text, in the chat template, each followed by the
    teacher's own greedy answer (what plain greedy decoding gives), cached for a resumed run; the student then
    trains on them and agrees with the teacher's answers more often."""
    from export.decoding.runtime import EagerRunner, greedy_generate
    from optimize.teacher_answers import TeacherAnswers, teacher_answers

    teacher = tiny(vocab=49152)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(20)
    text = torch.tensor(smollm2_tokenizer("def quote(s):\n    return repr(s)\n\nThe quick brown fox. " * 40)["input_ids"])
    cfg = TeacherAnswers(prompts=4, prompt_tokens=24, new_tokens=12, batch_size=3)
    said = []
    stream = teacher_answers(teacher, smollm2_tokenizer, text, cfg, seed=0, work_dir=tmp_path, log=said.append)
    assert "4 prompts answered" in said[-1]
    first = smollm2_tokenizer.decode(stream[:40].tolist())
    assert first.startswith("<|im_start|>") and "Explain this:" in first  # the chat template around an instruction
    # the first piece is its prompt then exactly what plain greedy decoding answers
    start = "<|im_start|>assistant\n"
    head = stream.tolist()
    prompt_end = next(i for i in range(len(head)) if smollm2_tokenizer.decode(head[:i]).endswith(start))
    answer = greedy_generate(EagerRunner(teacher), head[:prompt_end], 12, eos_token_ids=[smollm2_tokenizer.eos_token_id])
    assert head[prompt_end:prompt_end + len(answer)] == answer
    again = teacher_answers(teacher, smollm2_tokenizer, text, cfg, seed=0, work_dir=tmp_path, log=said.append)
    assert torch.equal(again, stream) and said[-1].startswith("teacher answers: reusing")

    student = copy.deepcopy(teacher)
    with torch.no_grad():
        for name, p in student.named_parameters():
            if name.endswith("proj.weight"):
                p.add_(torch.randn_like(p) * p.std() * 0.5)

    def agreement(m) -> float:
        ids = stream[None, :256]
        with torch.no_grad():
            return float((m(ids).logits.argmax(-1) == teacher(ids).logits.argmax(-1)).float().mean())

    before = agreement(student)
    ctx = StageContext(tokenizer=smollm2_tokenizer, calibration=[], train_ids=text, target=None, work_dir=tmp_path,
                       seed=0, baseline_model=teacher, log=lambda s: None)
    run(student, DistillConfig(steps=15, seq_len=32, optimizer={"lr": 1e-3}, data="teacher_answers",
                               answers=cfg.model_dump()), ctx)
    assert ctx.details["data"] == "teacher_answers" and ctx.details["answer_tokens"] == stream.numel()
    assert agreement(student) > before
    with pytest.raises(ValidationError, match="applies with data: teacher_answers or both"):
        DistillConfig(answers={"prompts": 3})
