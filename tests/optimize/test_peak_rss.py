"""What set a 1B-class model's peak RSS on the CPU (issue #27), held down on tiny models: the
baseline's log-probabilities stay on disk during a run, installing GPTQ's integers never
holds a float32 copy of the whole weight (a 128256-row output head is 1 GiB a copy), and each
block's integers go in as soon as the next block has its input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from optimize import load_config, run_pipeline


def _windows(n: int, length: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen) for _ in range(n)]


def test_baseline_logprobs_on_disk_score_exactly_as_in_memory(tiny_llama, tmp_path):
    """With a directory the log-probabilities leave memory window by window, and a later model
    scored against them gets the very same perplexity, agreement and KL."""
    from export.decoding.runtime import EagerRunner
    from optimize.checks.accuracy import BaselineLogits, evaluate

    model = tiny_llama.eval()
    windows = _windows(3, 17, model.config.vocab_size)
    in_memory, on_disk = BaselineLogits(), BaselineLogits(directory=tmp_path / "spill")
    with torch.no_grad():
        evaluate(EagerRunner(model), windows, keep=in_memory)
        evaluate(EagerRunner(model), windows, keep=on_disk)
    assert on_disk.logprobs == [] and len(on_disk) == 3 == len(sorted((tmp_path / "spill").iterdir()))
    for i in range(3):
        assert torch.equal(on_disk.logprobs_at(i), in_memory.logprobs_at(i))
    with torch.no_grad():
        model.lm_head.weight.mul_(1.01)  # another model: agreement and KL below 100% and above 0
        a = evaluate(EagerRunner(model), windows, in_memory)
        b = evaluate(EagerRunner(model), windows, on_disk)
    assert (a.perplexity, a.top1_agreement, a.kl_divergence) == (b.perplexity, b.top1_agreement, b.kl_divergence)
    assert a.kl_divergence > 0
    with pytest.raises(IndexError):
        on_disk.logprobs_at(3)


def test_a_run_scores_against_baseline_logprobs_on_disk_and_removes_them(tiny_cfg, monkeypatch):
    """Every check after the baseline reads the log-probabilities from disk (none in memory), and
    the run's directory has no trace of them afterwards."""
    from optimize import measure

    seen = []
    real = measure.evaluate

    def spy(runner, windows, baseline=None, **kw):
        if baseline is not None:
            seen.append((list(baseline.logprobs), baseline.directory, baseline.directory.is_dir()))
        return real(runner, windows, baseline, **kw)

    monkeypatch.setattr(measure, "evaluate", spy)
    tiny_cfg["stages"] = [{"kind": "ptq_int8", "scheme": "8da8w"}]
    report = run_pipeline(load_config(tiny_cfg), say=lambda m: None)
    assert report.ok, report.rows[-1].error
    assert seen and all(kept == [] and d is not None and exists for kept, d, exists in seen)
    assert not seen[0][1].exists()
    assert not list(Path(tiny_cfg["output_dir"]).glob("baseline-logprobs-*"))


class _LargestFloat(TorchDispatchMode):
    """The most elements any plain floating-point tensor that an op returns has (a torchao wrapper
    has a float dtype and the weight's shape but holds int8 data: not counted)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if type(t) is torch.Tensor and t.is_floating_point():
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("bits,dtype", [(4, torch.float32), (4, torch.bfloat16), (8, torch.bfloat16)])
def test_install_integers_builds_from_hps_tensor_a_chunk_of_rows_at_a_time(monkeypatch, bits, dtype):
    """The installed tensor equals torchao's ``from_hp`` of the de-quantized weight field by field,
    while no float tensor larger than a chunk of rows is ever made (the whole-matrix ``from_hp``
    made several: 3 GiB for a 1B model's output head)."""
    from torchao.quantization import IntxUnpackedToInt8Tensor

    from optimize.stages import ptq_gptq

    out_f, in_f, gs = 64, 96, 32
    lo, hi = (-8, 7) if bits == 4 else (-128, 127)
    gen = torch.Generator().manual_seed(bits)
    stacked = torch.randint(lo, hi + 1, (2 * out_f, in_f), generator=gen, dtype=torch.int8)
    q = stacked[out_f:]  # GPTQ hands out row slices of stacked q/k/v integers
    scale = torch.rand(out_f, in_f // gs if bits == 4 else 1, generator=gen) + 0.01
    lin = nn.Linear(in_f, out_f, bias=False).to(dtype)
    monkeypatch.setattr(ptq_gptq, "INSTALL_ROWS", 8)
    with _LargestFloat() as probe:
        ptq_gptq.install_integers(lin, q, scale, bits)
    assert probe.largest <= 8 * in_f
    got = lin.weight.data
    deq = (q.float().unflatten(-1, (scale.shape[1], -1)) * scale.unsqueeze(-1)).flatten(-2)
    want = IntxUnpackedToInt8Tensor.from_hp(
        deq, (1, in_f // scale.shape[1]), torch.int4 if bits == 4 else torch.int8,
        activation_quantization="int8_asym_per_token", intx_choose_qparams_algorithm=None,
        custom_scale=scale.float(), custom_zero_point=torch.zeros_like(scale, dtype=torch.int8))
    if dtype != torch.float32:
        want = want.to(dtype)
    assert type(got) is type(want) and not lin.weight.requires_grad
    for name in ("qdata", "scale", "zero_point"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("target_dtype", "block_size", "dtype", "activation_quantization"):
        assert getattr(got, name) == getattr(want, name), name
    assert got.qdata.untyped_storage().nbytes() == q.numel()  # its own storage, not the stacked rows'
    x = torch.randn(3, in_f, generator=gen).to(dtype)
    assert torch.equal(nn.functional.linear(x, got), nn.functional.linear(x, want))


def test_install_integers_refuses_integers_off_the_grid():
    from optimize.stages.ptq_gptq import install_integers

    q = torch.zeros(4, 32, dtype=torch.int8)
    q[2, 5] = 9  # outside int4's -8..7: torchao's round trip clamps it
    with pytest.raises(RuntimeError, match=r"GPTQ integers changed .*\(1 values\)"):
        install_integers(nn.Linear(32, 4, bias=False), q, torch.ones(4, 1), 4)


@pytest.mark.parametrize("model_type,calibration_dtype", [("llama", None), ("qwen2", None), ("gemma", None),
                                                          ("phi3", None), ("llama", torch.float64)])
def test_gptq_installs_each_block_once_the_next_has_its_input(model_type, calibration_dtype):
    """On the block chain each block's integers go in as soon as the next block has its input, so
    the float weights and the integers are never both held for the whole model (a 1B-class run's
    peak: 6.35 GiB before, 5.45 after): the same tensors and logits as installing everything at the end, each
    Linear once; a tied head (Gemma) is untied only at its turn and the embedding keeps its values.
    A model cast for the calibration (float64) installs at the end, after the cast back."""
    import copy

    from tiny_families import family  # tests/optimize is on sys.path (its conftest)

    from optimize.quant.fakequant import scheme_for
    from optimize.quant.gptq_sequential import gptq_model
    from optimize.stages.ptq_gptq import install_integers
    from train.model_parts import decoder_blocks

    model = family(model_type).eval()
    blocks = [n for n, _ in decoder_blocks(model)]
    head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    targets = {n: scheme_for("8da4w", 32) for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and any(n.startswith(b + ".") for b in blocks)}
    targets[head] = scheme_for("8da8w", None)
    windows = _windows(3, 48, 500)
    steps: list[int] = []
    when: dict[str, int] = {}
    early = copy.deepcopy(model)
    embedding = early.get_input_embeddings().weight.detach().clone()

    def install(name, res):
        assert name not in when, f"{name} installed twice"
        when[name] = len(steps)
        if tied and name == head:  # its own weight by now: the embedding is not rewritten
            assert early.get_output_embeddings().weight is not early.get_input_embeddings().weight
        install_integers(early.get_submodule(name), res.q, res.scale, targets[name].bits)

    with torch.no_grad():
        res = gptq_model(early, targets, windows, scale_init="mse", install=install,
                         progress=lambda step, total, **kw: steps.append(step), calibration_dtype=calibration_dtype)
    late = copy.deepcopy(model)
    with torch.no_grad():
        ref = gptq_model(late, targets, windows, scale_init="mse", calibration_dtype=calibration_dtype)
    for name, r in ref.layers.items():
        install_integers(late.get_submodule(name), r.q, r.scale, targets[name].bits)

    assert set(when) == set(targets)
    for name in targets:
        step = len(blocks) + 1 if calibration_dtype is not None or name == head else blocks.index(
            next(b for b in blocks if name.startswith(b + "."))) + 1
        assert when[name] == step, (name, when[name], step)
        a, b = early.get_submodule(name).weight, late.get_submodule(name).weight
        for field in ("qdata", "scale", "zero_point"):
            assert torch.equal(getattr(a, field), getattr(b, field)), (name, field)
        assert res.layers[name].rel_error_gptq == ref.layers[name].rel_error_gptq
    assert torch.equal(early.get_input_embeddings().weight, embedding)
    x = windows[0].view(1, -1)
    with torch.no_grad():
        assert torch.equal(early(x).logits, late(x).logits)
