"""`optimize run` on real exported artifacts: streams the same text eager decoding gives, whole in every language.

A model scripted to answer in characters that SmolLM2's byte-level tokenizer splits across tokens ("わ" is
two tokens, " 🎉" three), exported once to ExecuTorch and once to ONNX Runtime (module fixtures), is run
through every runner (ExecuTorch's C++ runner, the Python loop, speculative decoding; onnxruntime-genai
and ONNX Runtime), greedy and sampled: what streams is exactly ``tokenizer.decode`` of the ids, never a
replacement character for half of one."""

from __future__ import annotations

import io

import pytest
import torch

from export.base import get_exporter
from export.decoding.runtime import EagerRunner, generate_ids, greedy_generate
from export.decoding.sampling import Sampling
from optimize.cli import main
from optimize.generate import generate_from_artifact
from targets.sources import RandomSource, load_model
from tests.conftest import TINY_LLAMA

#: the scripted answer's cycle of ids: わ (10391 233), then " 🎉" (15107 232 227), and again
CYCLE = [10391, 233, 15107, 232, 227]
#: the prompts of the reliability issue, and a chat turn: each ends in a token the script leads into the cycle
JAPANESE = "こんにちは、元気ですか？"
PROMPTS = [JAPANESE, "Write a short poem about autumn leaves？"]
MAX_SEQ_LEN = 128


def _scripted(tok, config: dict) -> torch.nn.Module:
    """A tiny Llama whose attention and MLP add nothing (their output projections are zero), so each position's
    logits depend on its own token alone, and whose untied head leads each token of ``CYCLE`` to the next, and
    the prompts' last tokens ("？", the chat template's "\n") into it. Every other row of the head is noise, so
    a prompt ending elsewhere (and a sampled answer) still gives varied ids."""
    entries = {tok(JAPANESE, add_special_tokens=False)["input_ids"][-1], tok("\n", add_special_tokens=False)["input_ids"][-1]}
    model = load_model(RandomSource(config={**config, "tie_word_embeddings": False}, seed=0)).model
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb /= emb.norm(dim=1, keepdim=True)  # unit rows: a row's product with itself (1) beats any other (< 0.6)
        head = model.lm_head.weight
        head.normal_(0.0, 0.01, generator=torch.Generator().manual_seed(1))
        for a, b in zip(CYCLE + sorted(entries), CYCLE[1:] + CYCLE[:1] + [CYCLE[0]] * len(entries)):
            head[b] += 2.0 * emb[a]
    return model


@pytest.fixture(scope="module")
def scripted(smollm2_tokenizer):
    return _scripted(smollm2_tokenizer, dict(TINY_LLAMA))


@pytest.fixture(scope="module")
def scripted_exports(scripted, smollm2_tokenizer, tmp_path_factory):
    """The scripted model as a .pte and as an onnxruntime-genai folder, both with a verification path."""
    root = tmp_path_factory.mktemp("scripted")
    opts = {"max_seq_len": MAX_SEQ_LEN, "verify_tokens": 4}
    pte = get_exporter("executorch").export(scripted, smollm2_tokenizer, root / "et", opts, log=lambda *a: None)
    onnx = get_exporter("onnxruntime").export(scripted, smollm2_tokenizer, root / "ort", opts, log=lambda *a: None)
    return {"pte": pte.artifact, "onnx": onnx.artifact}


def _prompt_ids(tok, prompt: str, chat: bool) -> list[int]:
    if not chat:
        return tok(prompt, add_special_tokens=True)["input_ids"]
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return ids["input_ids"] if hasattr(ids, "keys") else ids


def _streamed(artifact, prompt: str, **kw) -> tuple[str, str]:
    out = io.StringIO()
    answer = generate_from_artifact(artifact, prompt, max_new_tokens=20, stream=out, say=None, **kw)
    return answer, out.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("chat", [False, True])
def test_split_characters_stream_whole_in_every_runner(scripted, scripted_exports, smollm2_tokenizer, chat):
    """Greedy: eager's ids decode to わ and 🎉 characters; every runner of both artifacts streams exactly that
    text (the C++ runner included, whose binding cannot hand over half a character as a str)."""
    tok = smollm2_tokenizer
    for prompt in PROMPTS:
        want_ids = greedy_generate(EagerRunner(scripted), _prompt_ids(tok, prompt, chat), 20, eos_token_ids=[tok.eos_token_id])
        want = tok.decode(want_ids, skip_special_tokens=True)
        assert want_ids[:5] == CYCLE and "わ" in want and "🎉" in want and "\ufffd" not in want, (want_ids, want)
        assert [tok.decode([i]) for i in CYCLE[:2]] == ["\ufffd", "\ufffd"]  # what decoding each token alone shows
        runs = [("pte", dict(runner="llm")), ("pte", dict(runner="python")), ("pte", dict(speculative="ngram")),
                ("onnx", {}), ("onnx", dict(speculative="ngram"))]
        for art, kw in runs:
            answer, streamed = _streamed(scripted_exports[art], prompt, chat=chat, **kw)
            assert answer == want and streamed == want + "\n", (art, kw, streamed)


@pytest.mark.slow
def test_sampled_answers_stream_whole_whatever_the_draw(scripted, scripted_exports, smollm2_tokenizer):
    """Sampled: the Python loop's answer is the seed's (eager draws the same ids) in both runtimes, speculative or
    not; ExecuTorch's C++ runner samples without a seed, so what is asserted of it holds for every draw: it runs,
    and what streams is exactly its answer."""
    tok = smollm2_tokenizer
    s = Sampling(temperature=0.7, seed=3)
    ids = _prompt_ids(tok, JAPANESE, False)
    want = tok.decode(generate_ids(EagerRunner(scripted), ids, 20, sampling=s, eos_token_ids=[tok.eos_token_id]),
                      skip_special_tokens=True)
    for art, kw in [("pte", {}), ("pte", dict(speculative="ngram")), ("onnx", {}), ("onnx", dict(speculative="ngram"))]:
        answer, streamed = _streamed(scripted_exports[art], JAPANESE, sampling=s, **kw)
        assert answer == want and streamed == want + "\n", (art, kw, streamed)
    for _ in range(3):
        answer, streamed = _streamed(scripted_exports["pte"], JAPANESE, runner="llm", sampling=Sampling(temperature=1.0))
        assert streamed == answer + "\n"
    with pytest.raises(ValueError, match="--runner llm samples .* temperature in \\(0, 1\\], got 1.5"):
        generate_from_artifact(scripted_exports["pte"], JAPANESE, runner="llm", sampling=Sampling(temperature=1.5))


@pytest.mark.slow
def test_optimize_run_prints_the_japanese_answer(scripted, scripted_exports, smollm2_tokenizer, capsys):
    """The CLI as the issue ran it: `optimize run model.pte --prompt "こんにちは、元気ですか？" [--runner llm]`."""
    tok = smollm2_tokenizer
    want = tok.decode(greedy_generate(EagerRunner(scripted), _prompt_ids(tok, JAPANESE, False), 12,
                                      eos_token_ids=[tok.eos_token_id]), skip_special_tokens=True)
    for extra in ([], ["--runner", "llm"], ["--runner", "python"]):
        assert main(["run", str(scripted_exports["pte"]), "--prompt", JAPANESE, "--max-new-tokens", "12", *extra]) == 0
        assert capsys.readouterr().out == want + "\n"


@pytest.mark.slow  # the module's exports
def test_run_streams_greedy_text_from_exported_onnx(scripted, scripted_exports, smollm2_tokenizer, capsys):
    onnx = scripted_exports["onnx"]
    prompt = "What is the capital of France?"

    # --chat: the prompt goes through the chat template (a BatchEncoding in transformers 5)
    assert main(["run", str(onnx), "--prompt", prompt, "--chat", "--max-new-tokens", "6"]) == 0
    streamed = capsys.readouterr().out.strip()
    expected_ids = greedy_generate(EagerRunner(scripted), torch.tensor(_prompt_ids(smollm2_tokenizer, prompt, True)), 6,
                                   eos_token_ids=[smollm2_tokenizer.eos_token_id])
    expected = smollm2_tokenizer.decode(expected_ids, skip_special_tokens=True).strip()
    assert len(expected_ids) >= 1 and expected, "the check needs visible text"
    assert streamed == expected
    # --runner python is the same loop; --runner llm needs ExecuTorch's C++ runner, which .onnx has not
    assert main(["run", str(onnx), "--prompt", prompt, "--chat", "--max-new-tokens", "6", "--runner", "python"]) == 0
    assert capsys.readouterr().out.strip() == expected
    assert main(["run", str(onnx), "--prompt", prompt, "--runner", "llm"]) == 2
    assert "--runner llm: onnxruntime artifacts have no C++ LLM runner" in capsys.readouterr().err


@pytest.mark.slow  # the module's exports
def test_run_without_tokenizer_files_is_a_clear_error(scripted_exports, tmp_path, capsys):
    import shutil

    folder = shutil.copytree(scripted_exports["onnx"].parent, tmp_path / "onnx")
    for f in folder.glob("tokenizer*"):
        f.unlink()
    assert main(["run", str(folder / scripted_exports["onnx"].name), "--prompt", "hi"]) == 2
    assert "no tokenizer files beside" in capsys.readouterr().err


def test_unknown_runner_choice_is_a_clear_error(tmp_path):
    from optimize.generate import generate_from_artifact

    art = tmp_path / "model.pte"
    art.write_bytes(b"x")
    with pytest.raises(ValueError, match="runner must be auto, llm or python, got 'cpp'"):
        generate_from_artifact(art, "hi", runner="cpp")
    with pytest.raises(SystemExit):  # the CLI offers only the three choices
        main(["run", str(art), "--prompt", "hi", "--runner", "cpp"])


def test_sampling_flags_are_checked_before_anything_loads(tmp_path, capsys):
    """--top-k, --top-p or --seed without a temperature would be ignored: refused in one line (exit 2),
    naming them, before the artifact is opened; bad values name the setting."""
    from optimize.generate import sampling_from

    assert sampling_from() is None and sampling_from(0.0) is None
    s = sampling_from(0.7, 20, 0.9, 3)
    assert (s.temperature, s.top_k, s.top_p, s.seed) == (0.7, 20, 0.9, 3)
    missing = tmp_path / "absent.pte"  # never opened: the flags are refused first
    for flags, said in [(["--top-k", "5"], "--top-k shape sampling, and --temperature is 0"),
                        (["--seed", "1", "--top-p", "0.9"], "--top-p, --seed shape sampling"),
                        (["--temperature", "-1"], "temperature must be a number > 0"),
                        (["--temperature", "0.5", "--top-p", "1.5"], "top_p must be in (0, 1]")]:
        assert main(["run", str(missing), "--prompt", "hi", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and said in err and err.count("\n") == 1, err


@pytest.mark.slow  # the module's exports
def test_run_samples_what_the_seed_draws(scripted, scripted_exports, smollm2_tokenizer, capsys):
    """--temperature/--top-k/--seed through the Python loop (an ONNX export): the tokens export.decoding.sampling
    draws from the eager model's logits with that seed. With --speculative, the same answer:
    tests/export/executorch/test_runner.py (.pte) and tests/export/onnxruntime/test_verify_rows.py."""
    prompt = "the cat sat on the mat, the cat sat on the"  # ends off the script: the head's noise is sampled
    ids = smollm2_tokenizer(prompt, add_special_tokens=True)["input_ids"]
    answers = set()
    for seed in (1, 2):
        s = Sampling(temperature=0.8, top_k=50, seed=seed)
        want = generate_ids(EagerRunner(scripted), torch.tensor(ids), 8, sampling=s,
                            eos_token_ids=[smollm2_tokenizer.eos_token_id])
        expected = smollm2_tokenizer.decode(want, skip_special_tokens=True).strip()
        assert main(["run", str(scripted_exports["onnx"]), "--prompt", prompt, "--max-new-tokens", "8",
                     "--temperature", "0.8", "--top-k", "50", "--seed", str(seed)]) == 0
        assert capsys.readouterr().out.strip() == expected
        answers.add(expected)
    assert len(answers) == 2  # the seed chose the answer
