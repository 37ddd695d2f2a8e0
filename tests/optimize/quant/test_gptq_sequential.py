"""Sequential GPTQ over a model: the Linears that read one input found exactly, and the block
chain's cached inputs giving what re-running the model prefix gives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optimize.quant.fakequant import scheme_for


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "gemma", "phi3"])
def test_gptq_model_groups_the_linears_that_read_one_input(model_type):
    """The grouping the model run uses: equal Hessians (q/k/v, gate/up; Phi-3's fused qkv_proj and
    gate_up_proj stand alone) are found exactly, and different inputs are never merged."""
    from tiny_families import family  # tests/optimize is on sys.path (its conftest)

    from optimize.quant.calibration_hooks import HessianCollector
    from optimize.quant.gptq_sequential import shared_input_groups
    from train.model_parts import decoder_blocks

    model = family(model_type).eval()
    block = decoder_blocks(model)[0][0]
    names = [n for n, m in model.named_modules() if n.startswith(block + ".") and isinstance(m, nn.Linear)]
    scheme = scheme_for("8da4w", 32)
    collector = HessianCollector(model, names, scheme)
    with torch.no_grad():
        model(torch.randint(1, 500, (1, 64), generator=torch.Generator().manual_seed(0)))
    collector.close()
    groups = shared_input_groups(names, collector.h, dict.fromkeys(names, scheme))
    short = [[n.rsplit(".", 1)[-1] for n in g] for g in groups]
    assert sorted(n for g in groups for n in g) == sorted(names)
    for g in groups:
        assert all(torch.equal(collector.h[g[0]], collector.h[n]) for n in g)
    firsts = [g[0] for g in groups]
    assert not any(torch.equal(collector.h[a], collector.h[b]) for i, a in enumerate(firsts) for b in firsts[i + 1:])
    if model_type == "phi3":
        assert len(groups) == len(names) == 4, short
    else:
        assert ["q_proj", "k_proj", "v_proj"] in short and ["gate_proj", "up_proj"] in short, short
    # another scheme for one member splits it off
    mixed = dict.fromkeys(names, scheme) | {names[1]: scheme_for("8da8w", None)}
    assert [names[1]] in shared_input_groups(names, collector.h, mixed)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "phi3", "opt", "gpt_neox"])
def test_cached_block_inputs_give_the_prefix_rerun_result(model_type, monkeypatch):
    """GPTQ calibrates each block on the cached outputs of the quantized blocks before it, and the
    output head on the last block's (no block runs again); that must quantize exactly as
    re-running the model prefix for every block and the whole model for the head (the old,
    quadratic path). Covers sliding-window masks per layer type (gemma3_text, with a window
    shorter than the text), fused projections (phi3), learned positions (opt) and parallel residuals
    (gpt_neox)."""
    import copy

    from tiny_families import family  # tests/optimize is on sys.path (its conftest)

    from optimize.quant import gptq_sequential as gptq_mod
    from optimize.quant.block_inputs import BlockChain
    from optimize.quant.fakequant import WeightScheme
    from train.model_parts import decoder_blocks

    over = {"sliding_window": 16} if model_type == "gemma3_text" else {}
    model = family(model_type, **over)
    blocks = [n for n, _ in decoder_blocks(model)]
    head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    targets = {n: WeightScheme(4, 32, True) for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and (any(n.startswith(b + ".") for b in blocks) or n == head)
               and m.in_features % 32 == 0}
    assert head in targets  # the output head calibrates on the chain's last outputs (BlockChain.replay)
    windows = [torch.randint(1, 500, (48,), generator=torch.Generator().manual_seed(s)) for s in range(3)]

    said: list[str] = []
    cached = gptq_mod.gptq_model(copy.deepcopy(model), targets, windows, log=said.append)
    assert not [m for m in said if "calibrating each block from the model's input" in m], said

    def refuse(cls, model, blocks, windows):
        chain = cls(model, blocks)
        chain.ok, chain.why = False, "forced by the test"
        return chain

    monkeypatch.setattr(BlockChain, "capture", classmethod(refuse))
    rerun = gptq_mod.gptq_model(copy.deepcopy(model), targets, windows, log=said.append)
    assert [m for m in said if "forced by the test" in m]
    assert targets and set(cached.layers) == set(rerun.layers) == set(targets)
    for name in targets:
        a, b = cached.layers[name], rerun.layers[name]
        # the same integers up to float noise in the Hessians (at most 0.1% of them one step apart)
        diff = (a.q.int() - b.q.int()).abs()
        assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) <= 1e-3, (name, int((diff > 0).sum()))
        torch.testing.assert_close(a.scale, b.scale, rtol=1e-5, atol=1e-7)



@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "opt"])
def test_calibration_forwards_stop_after_the_last_target_and_quantize_the_same(model_type, monkeypatch):
    """After the first window, each calibration forward ends at the last target's input (the
    output head's 49152-wide product, a block's down projection): the head runs once, not once
    per window, and every integer and scale equals a run whose forwards all go to the end."""
    import copy

    from tiny_families import family  # tests/optimize is on sys.path (its conftest)

    from optimize.quant import gptq_sequential as gptq_mod
    from optimize.quant.fakequant import WeightScheme

    model = family(model_type).eval()
    head = model.get_output_embeddings()
    targets = {n: WeightScheme(4, 32, True) for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and m.in_features % 32 == 0}
    windows = [torch.randint(1, 500, (48,), generator=torch.Generator().manual_seed(s)) for s in range(4)]

    def run(stopping: bool):
        m = copy.deepcopy(model)
        ran = []
        m.get_output_embeddings().register_forward_hook(lambda *_: ran.append(1))
        if not stopping:
            monkeypatch.setattr(gptq_mod.StopAfterLastInput, "window", lambda self, feed: feed())
        result = gptq_mod.gptq_model(m, targets, windows)
        monkeypatch.undo()
        return result, len(ran)

    stopped, head_runs = run(True)
    whole, head_runs_whole = run(False)
    assert head_runs == 1 and head_runs_whole == len(windows), (head_runs, head_runs_whole)
    assert set(stopped.layers) == set(whole.layers) == set(targets) and head in dict(model.named_modules()).values()
    for name, a in stopped.layers.items():
        b = whole.layers[name]
        assert torch.equal(a.q, b.q), name
        assert torch.equal(a.scale, b.scale), name


def test_a_target_that_runs_twice_a_forward_turns_the_stop_off():
    """A Linear called a data-dependent number of times (an expert, a weight shared by two calls)
    may get inputs after the others have all had theirs: no window stops early then."""
    from optimize.quant.calibration_hooks import HessianCollector, StopAfterLastInput

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):
            return self.a(self.b(self.a(x)))  # a, b, then a again

    model = Twice()
    xs = [torch.randn(4, 32, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    collector = HessianCollector(model, ["a", "b"])
    stopper = StopAfterLastInput(model, ["a", "b"])
    with torch.no_grad():
        for x in xs:
            stopper.window(lambda x=x: model(x))
    stopper.close()
    collector.close()
    assert not stopper.armed and collector.tokens == {"a": 24, "b": 12}


# ---- on a device: the pipeline's placement (whole model there) and one block at a time from the CPU
