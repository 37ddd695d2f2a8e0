"""Chunked cross-entropy and chunked KL-to-teacher equal the plain losses (values and gradients),
and never hold a tensor the size of the full ``[tokens, vocab]`` logits."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from train.chunked_loss import check_head_matches_logits, chunked_cross_entropy, chunked_kl_to_teacher, chunked_lm_loss
from train.lm_head import ChunkedLossError, LMHead, lm_head_of
from train.step import causal_lm_loss


def _plain_logits(h, head: LMHead):
    z = (h @ head.weight.t()).float()
    if head.bias is not None:
        z = z + head.bias
    z = z * head.scale
    if head.softcap:
        z = head.softcap * torch.tanh(z / head.softcap)
    return z


def _leaves(n=37, hdim=24, vocab=101, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, n, hdim, generator=g).requires_grad_()
    w = (torch.randn(vocab, hdim, generator=g) * 0.3).requires_grad_()
    b = (torch.randn(vocab, generator=g) * 0.1).requires_grad_() if bias else None
    return h, w, b


def _grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("chunk", [1, 7, 74, 500])
@pytest.mark.parametrize(
    "transform", [dict(), dict(bias=True), dict(scale=0.5, softcap=3.0)], ids=["plain", "bias", "scale+softcap"]
)
def test_chunked_ce_equals_plain_loss_and_grads(chunk, transform):
    h, w, b = _leaves(bias=transform.get("bias", False))
    head = LMHead(w, b, transform.get("scale", 1.0), transform.get("softcap"))
    labels = torch.randint(0, w.shape[0], (2, h.shape[1]), generator=torch.Generator().manual_seed(1))
    labels[0, :5] = -100  # ignored positions leave the mean and the gradient
    ref = F.cross_entropy(_plain_logits(h, head).reshape(-1, w.shape[0]), labels.reshape(-1))
    got = chunked_cross_entropy(h, head, labels, chunk_size=chunk)
    assert got.item() == pytest.approx(ref.item(), rel=1e-6, abs=1e-6)
    for a, r in zip(_grads(got, (h, w, b)), _grads(ref, (h, w, b))):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)


def test_chunked_ce_under_bf16_autocast_is_close():
    h, w, _ = _leaves(n=64)
    labels = torch.randint(0, w.shape[0], (2, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy((h @ w.t()).float().reshape(-1, w.shape[0]), labels.reshape(-1))
        got = chunked_cross_entropy(h, w, labels, chunk_size=16)
    assert got.item() == pytest.approx(ref.item(), abs=2e-2)
    gw = _grads(got, (w,))[0]
    assert gw.dtype == torch.float32 and torch.allclose(gw, _grads(ref, (w,))[0], atol=2e-3)


@pytest.mark.slow
def test_compiled_chunks_equal_the_eager_chunks():
    """train.compile's chunked CE (one torch.compile'd function per chunk) against the eager path and
    the plain loss: fp32 with bias, scale and soft-cap, a short last chunk and ignored labels, then
    bf16 autocast (the compiled path fuses the cast of the logits' gradient)."""
    h, w, b = _leaves(bias=True)
    head = LMHead(w, b, 0.5, 3.0)
    labels = torch.randint(0, w.shape[0], (2, h.shape[1]), generator=torch.Generator().manual_seed(1))
    labels[0, :5] = -100
    ref = F.cross_entropy(_plain_logits(h, head).reshape(-1, w.shape[0]), labels.reshape(-1))
    eager = chunked_cross_entropy(h, head, labels, chunk_size=32)
    got = chunked_cross_entropy(h, head, labels, chunk_size=32, compiled=True)
    assert got.item() == pytest.approx(ref.item(), rel=1e-5) and got.item() == pytest.approx(eager.item(), rel=1e-5)
    for a, r in zip(_grads(got, (h, w, b)), _grads(ref, (h, w, b))):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-6)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = chunked_cross_entropy(h, w, labels, chunk_size=32)
        got = chunked_cross_entropy(h, w, labels, chunk_size=32, compiled=True)
    assert got.item() == pytest.approx(eager.item(), abs=1e-3)
    ge, gg = _grads(eager, (h, w)), _grads(got, (h, w))
    assert gg[1].dtype == torch.float32
    for a, r in zip(gg, ge):
        torch.testing.assert_close(a, r, rtol=2e-2, atol=2e-3)


def _ref_kl(zs, zt, T, labels=None, alpha=0.0):
    v = zs.shape[-1]
    kl = F.kl_div(
        F.log_softmax(zs / T, -1).reshape(-1, v), F.log_softmax(zt / T, -1).reshape(-1, v), log_target=True,
        reduction="batchmean",
    ) * T * T
    if alpha:
        return (1 - alpha) * kl + alpha * F.cross_entropy(zs.reshape(-1, v), labels.reshape(-1))
    return kl


@pytest.mark.parametrize("temperature,alpha", [(1.0, 0.0), (2.0, 0.0), (2.0, 0.3)])
@pytest.mark.parametrize("teacher_as", ["head", "logits"])
def test_chunked_kl_equals_plain_kl_and_grads(temperature, alpha, teacher_as):
    h, w, b = _leaves(bias=True)
    s_head = LMHead(w, b, softcap=5.0)
    th, tw, _ = _leaves(hdim=16, seed=3)  # the teacher may have another width
    t_head = LMHead(tw.detach())
    labels = torch.randint(0, w.shape[0], (2, h.shape[1]))
    zt = _plain_logits(th, t_head).detach()
    ref = _ref_kl(_plain_logits(h, s_head), zt, temperature, labels, alpha)
    teacher = (th, t_head) if teacher_as == "head" else (zt, None)
    got = chunked_kl_to_teacher(
        h, s_head, *teacher, temperature=temperature, labels=labels, alpha=alpha, chunk_size=9
    )
    assert got.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    for a, r in zip(_grads(got, (h, w, b)), _grads(ref, (h, w, b))):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-6)


def test_kl_is_zero_for_identical_models_and_checks_inputs():
    h, w, _ = _leaves()
    assert chunked_kl_to_teacher(h, w, h.detach(), w.detach(), chunk_size=5).item() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="vocabulary 101 and teacher vocabulary 50 differ"):
        chunked_kl_to_teacher(h, w, h.detach(), w[:50].detach())
    with pytest.raises(ValueError, match="alpha > 0 mixes in cross-entropy and needs labels"):
        chunked_kl_to_teacher(h, w, h.detach(), w.detach(), alpha=0.5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        chunked_kl_to_teacher(h, w, h.detach(), w.detach(), temperature=0)


class _MaxNumel(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.max = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max = max(self.max, t.numel())
        return out


def test_no_tensor_of_full_logits_size_is_ever_allocated():
    h, w, _ = _leaves(n=256, hdim=16, vocab=1000)
    labels = torch.randint(0, 1000, (2, 256))
    full = 2 * 256 * 1000
    with _MaxNumel() as plain:
        F.cross_entropy((h @ w.t()).reshape(-1, 1000), labels.reshape(-1)).backward()
    with _MaxNumel() as chunked:
        chunked_cross_entropy(h, w, labels, chunk_size=64).backward()
    with _MaxNumel() as kl:
        chunked_kl_to_teacher(h, w, h.detach(), w.detach() * 0.5, temperature=2.0, chunk_size=64).backward()
    assert plain.max >= full
    assert chunked.max <= 64 * 1000 and kl.max <= 64 * 1000


FAMILIES = {
    "llama": dict(tie_word_embeddings=True),
    "qwen2": dict(),
    "mistral": dict(sliding_window=16),
    "phi3": dict(pad_token_id=0),
    "gemma2": dict(head_dim=16, final_logit_softcapping=30.0),
    "gpt2": None,
}


def _family_model(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    if model_type == "gpt2":
        cfg = AutoConfig.for_model("gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=503, n_positions=128)
    else:
        cfg = AutoConfig.for_model(
            model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=503, max_position_embeddings=128, **FAMILIES[model_type],
        )
    attn = "eager" if model_type == "gemma2" else "sdpa"
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).train()


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_chunked_lm_loss_matches_plain_loss_on_families(model_type):
    model = _family_model(model_type)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 503, (2, 41), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    assert check_head_matches_logits(model, batch["input_ids"]) < 1e-4
    torch.manual_seed(0)
    ref = causal_lm_loss(twin, batch)
    ref.backward()
    torch.manual_seed(0)
    got = chunked_lm_loss(chunk_size=13)(model, batch)
    got.backward()
    assert got.item() == pytest.approx(ref.item(), rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_unknown_logit_transform_and_lora_head_are_refused():
    model = _family_model("llama")
    ids = torch.randint(0, 503, (1, 12))
    model.config.final_logit_softcapping = 1.0  # the head now claims a transform the model does not apply
    with pytest.raises(ChunkedLossError, match="logits are not lm_head\\(final hidden states\\).*loss.chunked: false"):
        check_head_matches_logits(model, ids)
    model.config.final_logit_softcapping = None
    model.lm_head.lora_A = torch.nn.ModuleDict()
    with pytest.raises(ChunkedLossError, match="leave lm_head out of lora.target_modules"):
        lm_head_of(model)
    with pytest.raises(ChunkedLossError, match="has no output embeddings"):
        lm_head_of(torch.nn.Linear(2, 2))


def test_chunked_lm_loss_through_lora_adapters():
    """peft wraps the model: the loss still leaves through the inner transformers model's own loss."""
    from train.config import LoRAConfig
    from train.lora import apply_lora

    model = apply_lora(_family_model("qwen2"), LoRAConfig(enabled=True, rank=4))
    for _, p in model.named_parameters():
        if "lora_B" in _:
            torch.nn.init.normal_(p, std=0.02)  # non-zero adapters, so they matter
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 503, (2, 33), generator=torch.Generator().manual_seed(5))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    ref = causal_lm_loss(twin, batch)
    ref.backward()
    got = chunked_lm_loss(chunk_size=16)(model, batch)
    got.backward()
    assert got.item() == pytest.approx(ref.item(), rel=1e-6)
    trained = [(n, p, q) for (n, p), q in zip(model.named_parameters(), twin.parameters()) if p.requires_grad]
    assert trained and all(n for n, _, _ in trained)
    for name, p, q in trained:
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert "_loss_function" not in next(m for m in model.modules() if type(m).__name__ == "Qwen2ForCausalLM").__dict__
