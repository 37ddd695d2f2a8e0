"""Each trainer component on its own: data position, schedule, batch plan, blocks, memory, checkpoints."""

from __future__ import annotations

import pytest
import torch

from train import checkpoint as ckpt
from train.batching import MicroBatchPlan, is_oom
from train.config import BatchConfig, MemoryConfig, OptimizerConfig
from train.data import PackedWindows, ResumableBatchSampler, make_loader, split_micro
from train.memory import apply_activation_checkpointing, transformer_blocks
from train.optim import build_optimizer, lr_lambda


def test_packed_windows_shift():
    ds = PackedWindows(torch.arange(101), seq_len=10)
    assert len(ds) == 10
    assert ds[1].tolist() == list(range(10, 21))
    loader = make_loader(ds, ResumableBatchSampler(len(ds), 2))
    batch = next(iter(loader))
    assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])


def test_sampler_resume_position_is_exact():
    full = ResumableBatchSampler(10, 3, seed=7)
    it = iter(full)
    expected = [next(it) for _ in range(8)]  # crosses epoch boundaries (3 steps per epoch)
    resumed = ResumableBatchSampler(10, 3, seed=7)
    resumed.load_state_dict({**full.state_dict(), "position": 5})
    it = iter(resumed)
    assert [next(it) for _ in range(3)] == expected[5:]
    with pytest.raises(ValueError, match="same data and batch settings"):
        ResumableBatchSampler(12, 3).load_state_dict(full.state_dict())


def test_sampler_ranks_are_disjoint_and_cover_global_batch():
    r0, r1 = (ResumableBatchSampler(16, 2, rank=r, world=2, seed=1) for r in (0, 1))
    a, b = next(iter(r0)), next(iter(r1))
    assert len(a) == len(b) == 2 and not set(a) & set(b)


def test_loader_with_workers_matches_inline():
    ds = PackedWindows(torch.arange(401), seq_len=10)
    inline = [b["input_ids"] for _, b in zip(range(4), make_loader(ds, ResumableBatchSampler(len(ds), 4)))]
    workers = make_loader(ds, ResumableBatchSampler(len(ds), 4), num_workers=1, prefetch_factor=2)
    for want, (_, got) in zip(inline, zip(range(4), workers)):
        assert torch.equal(want, got["input_ids"])


def test_split_micro():
    batch = {"input_ids": torch.zeros(8, 4), "labels": torch.zeros(8, 4)}
    assert [m["input_ids"].shape[0] for m in split_micro(batch, 3)] == [3, 3, 2]


def test_lr_schedule_warmup_and_decay():
    kw = dict(warmup=4, total=20, min_ratio=0.1)
    assert [lr_lambda(s, decay="cosine", **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_lambda(19, decay="cosine", **kw) == pytest.approx(0.1, abs=0.01)
    assert lr_lambda(12, decay="linear", **kw) == pytest.approx(0.55)
    assert lr_lambda(15, decay="constant", **kw) == 1.0


def test_micro_batch_plan_halves_and_keeps_effective():
    plan = MicroBatchPlan(BatchConfig(micro_batch_size=8, grad_accum_steps=1, dynamic=True, min_micro_batch_size=2))
    plan.shrink(torch.OutOfMemoryError("x"))
    assert (plan.micro, plan.accum) == (4, 2)
    plan.shrink(torch.OutOfMemoryError("x"))
    assert (plan.micro, plan.accum) == (2, 4)
    with pytest.raises(RuntimeError, match="min_micro_batch_size is 2"):
        plan.shrink(torch.OutOfMemoryError("x"))
    assert is_oom(RuntimeError("CUDA out of memory. Tried to allocate")) and not is_oom(ValueError("x"))


def test_blocks_and_activation_checkpointing(tiny_llama):
    assert len(transformer_blocks(tiny_llama)) == 2
    n = apply_activation_checkpointing(tiny_llama, MemoryConfig(activation_checkpointing="full"))
    assert n == 2
    assert sum(type(m).__name__ == "CheckpointWrapper" for m in tiny_llama.modules()) == 2
    # the wrapper is invisible in state dict keys, so exports and checkpoints keep HF names
    assert not any("_checkpoint_wrapped_module" in k for k in tiny_llama.state_dict())


def test_peak_memory_tracks_an_allocation():
    """Measured in a fresh process: in the long-lived test process the allocator can serve
    64 MiB from pages already resident after earlier tests, so RSS would not move."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from train.memory import peak_memory_mib, reset_peak_memory\n"
        "dev = torch.device('cpu')\n"
        "reset_peak_memory(dev)\n"
        "before = peak_memory_mib(dev)\n"
        "x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched\n"
        "print(peak_memory_mib(dev) - before)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert float(out.stdout.strip().splitlines()[-1]) > 48


def test_optimizer_cpu_offload_on_cpu_falls_back(caplog):
    p = torch.nn.Parameter(torch.zeros(4))
    with caplog.at_level("INFO", logger="optimize.train"):
        opt = build_optimizer([p], OptimizerConfig(cpu_offload=True), torch.device("cpu"))
    assert isinstance(opt, torch.optim.AdamW)
    assert "nothing to offload" in caplog.text


def test_checkpoint_atomic_marker_and_keep_last(tmp_path):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step, model, opt, {"data": {}}, keep_last=2)
    (tmp_path / ".step-00000004.tmp").mkdir()  # a killed run's partial write
    (tmp_path / "step-00000005").mkdir()  # renamed but without marker: not complete
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [2, 3]
    assert ckpt.latest_checkpoint(tmp_path).name == "step-00000003"
    fresh = torch.nn.Linear(4, 4)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    state = ckpt.load_checkpoint(tmp_path / "step-00000003", fresh, fresh_opt)
    assert state["step"] == 3
    assert torch.equal(fresh.weight, model.weight)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ckpt.load_checkpoint(tmp_path / "step-00000005", fresh, fresh_opt)


def test_train_never_imports_optimize(th):
    """Layering: optimize imports train, never the other way."""
    import ast

    for path in (th.REPO / "train").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n == "optimize" or n.startswith("optimize.") for n in names), path


def test_fused_adamw_only_for_plain_adamw_all_on_cuda():
    from train.optim import use_fused_adamw

    assert use_fused_adamw(OptimizerConfig(), {"cuda"})
    assert not use_fused_adamw(OptimizerConfig(), {"cpu"})  # CPU keeps torch's default
    assert not use_fused_adamw(OptimizerConfig(), {"cuda", "cpu"})  # FSDP CPU offload: host shards
    assert not use_fused_adamw(OptimizerConfig(cpu_offload=True), {"cuda"})  # torchao fuses its CPU step itself
    assert not use_fused_adamw(OptimizerConfig(name="adamw8bit"), {"cuda"})
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(4))], OptimizerConfig(), torch.device("cpu"))
    assert not opt.defaults["fused"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_adamw_on_cuda():
    p = torch.nn.Parameter(torch.zeros(4, device="cuda"))
    opt = build_optimizer([p], OptimizerConfig(), torch.device("cuda"))
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"] is True
    p.grad = torch.ones_like(p)
    opt.step()
    assert p.detach().abs().sum().item() > 0
