"""Checkpoints of an optimizer that is not a full torch.optim.Optimizer (torchao's
CPUOffloadOptimizer, issue 27's first CUDA failure), and DCP's pickled values read safely."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from train import checkpoint as ckpt
from train.config import LoopConfig
from train.errors import TrainInputError
from train.loop import train


class OffloadShapedOptimizer(torch.optim.Optimizer):
    """The shape of ``torchao.optim.CPUOffloadOptimizer`` (torchao 0.18), runnable on a CPU.

    Like it: an ``Optimizer`` subclass (for the LR schedulers) that never calls
    ``Optimizer.__init__`` (so no ``state``, no ``defaults``); one inner optimizer per parameter
    of at least ``minimal_size`` elements, stepping a separate "host" copy whose gradient a
    post-accumulate hook fills, then copying the result back; smaller parameters in one
    on-device optimizer ``d_opt``; ``param_groups`` as a property over the inner ones; and its
    ``state_dict``/``load_state_dict`` verbatim. Only the CUDA streams and pinned memory are gone.
    """

    def __init__(self, params, optimizer_class=torch.optim.AdamW, *, minimal_size: int = 4096, **kwargs):
        param_groups = list(params)
        if not param_groups:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(param_groups[0], dict):
            param_groups = [{"params": param_groups}]
        self.minimal_size = minimal_size
        self.d_opt = None
        self.d_param_groups = []
        self.param_d2h_map = {}
        self.optim_dict = {}
        self.queue = {}

        def backward_hook(p_device):
            if p_device.grad is not None:
                self.param_d2h_map[p_device].grad.copy_(p_device.grad)
                self.queue.pop(p_device, None)
                self.queue[p_device] = True

        for param_group in param_groups:
            group_params = param_group.pop("params")
            retained = []
            for p_device in group_params:
                if not p_device.requires_grad:
                    continue
                if p_device.numel() < self.minimal_size:
                    retained.append(p_device)
                    continue
                p_host = torch.empty_like(p_device)
                p_host.grad = torch.empty_like(p_host)
                p_host.copy_(p_device.detach())
                self.param_d2h_map[p_device] = p_host
                p_device.register_post_accumulate_grad_hook(backward_hook)
                self.optim_dict[p_device] = optimizer_class([{"params": p_host, **param_group}], **kwargs)
            if retained:
                self.d_param_groups.append({"params": retained, **param_group})
        if self.d_param_groups:
            self.d_opt = optimizer_class(self.d_param_groups, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        if self.d_opt is not None:
            self.d_opt.step()
        for p_device in self.queue:
            self.optim_dict[p_device].step()
            p_device.copy_(self.param_d2h_map[p_device])
        self.queue.clear()
        return loss

    def zero_grad(self, set_to_none=True):
        for p_device in self.param_d2h_map:
            p_device.grad = None
        if self.d_opt is not None:
            self.d_opt.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self):
        return sum((optim.param_groups for optim in self.optim_dict.values()), start=self.d_param_groups)

    def state_dict(self):
        state_dict = {"offloaded": [optim.state_dict() for optim in self.optim_dict.values()]}
        if self.d_opt:
            state_dict["on-device"] = self.d_opt.state_dict()
        return state_dict

    def load_state_dict(self, state_dict):
        for optim, optim_state_dict in zip(self.optim_dict.values(), state_dict["offloaded"]):
            optim.load_state_dict(optim_state_dict)
        if self.d_opt:
            self.d_opt.load_state_dict(state_dict["on-device"])


def _offload(model) -> OffloadShapedOptimizer:
    return OffloadShapedOptimizer(model.parameters(), minimal_size=100, lr=1e-2)  # the 256-element weight is offloaded


def _stepped(model, make=_offload, steps: int = 2):
    opt = make(model)
    for _ in range(steps):
        model(torch.ones(3, 16)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return opt


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))


def _adamw(model) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_the_stand_in_has_cpu_offload_optimizers_shape():
    opt = _stepped(_model())
    assert isinstance(opt, torch.optim.Optimizer) and not hasattr(opt, "state")
    assert not ckpt.has_standard_state(opt)
    assert ckpt.has_standard_state(_adamw(_model()))
    assert len(opt.optim_dict) == 1 and opt.d_opt is not None  # both halves of its state_dict exist


def test_offload_shaped_optimizer_round_trips_through_a_checkpoint(tmp_path):
    model = _model()
    opt = _stepped(model)
    ckpt.save_checkpoint(tmp_path, 2, model, opt, {"data": {}})
    assert (tmp_path / "step-00000002" / "optim-rank0.pt").is_file()

    fresh = _model(seed=1)
    fresh_opt = _offload(fresh)
    state = ckpt.load_checkpoint(tmp_path / "step-00000002", fresh, fresh_opt)
    assert state["step"] == 2
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    before, after = opt.state_dict(), fresh_opt.state_dict()
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(after["offloaded"][0]["state"][0][key], before["offloaded"][0]["state"][0][key])
        assert torch.equal(after["on-device"]["state"][0][key], before["on-device"]["state"][0][key])
    # the next step continues from the loaded weights (its host copies were refreshed, not the fresh init)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        m(torch.ones(3, 16)).pow(2).sum().backward()
        o.step()
    assert all(torch.allclose(a, b) for a, b in zip(fresh.parameters(), model.parameters()))


def test_a_checkpoint_of_the_other_optimizer_kind_is_refused(tmp_path):
    model = _model()
    ckpt.save_checkpoint(tmp_path / "plain", 1, model, _stepped(model, _adamw), {})
    fresh = _model()
    with pytest.raises(TrainInputError, match="without CPU offload"):
        ckpt.load_checkpoint(tmp_path / "plain/step-00000001", fresh, _offload(fresh))
    ckpt.save_checkpoint(tmp_path / "offload", 1, model, _stepped(model), {})
    with pytest.raises(TrainInputError, match="CPU-offloaded optimizer"):
        ckpt.load_checkpoint(tmp_path / "offload/step-00000001", fresh, _adamw(fresh))


@pytest.mark.parametrize("lora", [{}, dict(enabled=True, quantize_base="nf4")], ids=["full", "qlora"])
def test_resumed_run_with_an_offload_shaped_optimizer_retraces_the_losses(tiny_llama, train_ids, tmp_path, monkeypatch, lora):
    """What limited_hardware.yaml does on CUDA (QLoRA + optimizer.cpu_offload), with the stand-in.
    Full fine-tuning offloads the large weights (host copies must follow the loaded weights);
    QLoRA's small adapters stay in the on-device optimizer (its LR must keep following the
    schedule after the load: step 6 would differ otherwise)."""

    def offloaded(params, cfg, device):
        return OffloadShapedOptimizer(params, torch.optim.AdamW, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)

    monkeypatch.setattr("train.loop.build_optimizer", offloaded)

    def cfg(name):
        return LoopConfig(
            output_dir=tmp_path / name,
            max_steps=6,
            optimizer=dict(lr=2e-3),
            batch=dict(micro_batch_size=2, grad_accum_steps=2),
            lora=lora,
            checkpoint=dict(every_n_steps=3, save_final=False, export_hf=False),
            logging=dict(progress_bar=False, csv=False),
        )

    full = train(copy.deepcopy(tiny_llama), train_ids, cfg("full"), seq_len=64)
    assert (tmp_path / "full/checkpoints/step-00000003/optim-rank0.pt").is_file()
    shutil.copytree(tmp_path / "full/checkpoints/step-00000003", tmp_path / "resumed/checkpoints/step-00000003")
    resumed = train(copy.deepcopy(tiny_llama), train_ids, cfg("resumed"), seq_len=64)
    assert resumed.start_step == 3 and sorted(resumed.losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed.losses[step] == pytest.approx(full.losses[step], abs=1e-6)


def test_grad_clip_reaches_the_offloaded_gradients(tiny_llama, train_ids, tmp_path, monkeypatch, th):
    """The offloading optimizer copies gradients to the host during backward, before the loop clips:
    the clip must reach those copies too. With a clip that binds every step, the offloaded run
    follows the plain AdamW run (unclipped host gradients would drift from step 3 on)."""
    import train.loop as loop

    def cfg(name):
        return th.loop_cfg(tmp_path / name, max_steps=4, grad_clip=0.05)

    plain = train(copy.deepcopy(tiny_llama), train_ids, cfg("plain"), seq_len=64)
    made = []

    def offloaded(params, c, device):
        made.append(OffloadShapedOptimizer(params, torch.optim.AdamW, lr=c.lr, betas=tuple(c.betas), eps=c.eps,
                                           weight_decay=c.weight_decay))
        return made[-1]

    monkeypatch.setattr(loop, "build_optimizer", offloaded)
    off = train(copy.deepcopy(tiny_llama), train_ids, cfg("offload"), seq_len=64)
    assert len(made[0].optim_dict) > 0  # the large weights really went through host copies
    for step in (1, 2, 3, 4):
        assert off.losses[step] == pytest.approx(plain.losses[step], abs=1e-5)


class _NotAllowlisted:
    """A value ``torch.load(weights_only=True)`` refuses to unpickle."""

    def __init__(self, x=1):
        self.x = x


def test_dcp_values_are_unpickled_with_weights_only(tmp_path):
    """The optimizer's hyper-parameters reach DCP as pickles; a checkpoint that smuggles in an
    arbitrary object is refused on load instead of being executed."""
    import pickle

    from torch.distributed.checkpoint.api import CheckpointException

    model = _model()
    opt = _stepped(model, _adamw)
    ckpt.save_checkpoint(tmp_path / "ok", 2, model, opt, {})
    fresh = _model(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    fresh(torch.ones(3, 16)).sum().backward()
    fresh_opt.step()  # states exist, as in the loop (DCP loads into the optimizer's own state dict)
    ckpt.load_checkpoint(tmp_path / "ok/step-00000002", fresh, fresh_opt)
    assert fresh_opt.param_groups[0]["lr"] == pytest.approx(1e-2)  # read back through the safe planner
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])

    opt.param_groups[0]["smuggled"] = _NotAllowlisted()
    ckpt.save_checkpoint(tmp_path / "bad", 2, model, opt, {})
    victim = _model(seed=1)
    victim_opt = torch.optim.AdamW(victim.parameters())
    victim_opt.param_groups[0]["smuggled"] = 0
    # DCP re-raises the reader's UnpicklingError inside its CheckpointException
    with pytest.raises((pickle.UnpicklingError, CheckpointException), match="Weights only load failed"):
        ckpt.load_checkpoint(tmp_path / "bad/step-00000002", victim, victim_opt)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torchao_cpu_offload_optimizer_round_trips_on_cuda(tmp_path):
    from torchao.optim import CPUOffloadOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 4)).cuda()
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    for _ in range(2):
        model(torch.ones(3, 128, device="cuda")).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    ckpt.save_checkpoint(tmp_path, 2, model, opt, {})
    fresh = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 4)).cuda()
    fresh_opt = CPUOffloadOptimizer(fresh.parameters(), torch.optim.AdamW, lr=1e-2)
    ckpt.load_checkpoint(tmp_path / "step-00000002", fresh, fresh_opt)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    a, b = opt.state_dict()["offloaded"][0]["state"][0], fresh_opt.state_dict()["offloaded"][0]["state"][0]
    assert torch.equal(a["exp_avg"], b["exp_avg"])
