"""`optimize run` on a real exported artifact: streams the same text eager greedy decoding gives."""

from __future__ import annotations

import pytest
import torch

from export.base import get_exporter
from export.runtime import EagerRunner, greedy_generate
from optimize.cli import main
from targets.sources import RandomSource, load_model


def test_run_streams_greedy_text_from_exported_onnx(tiny_llama_config, smollm2_tokenizer, tmp_path, capsys):
    # initializer_range 0.2 makes greedy output vary, so the text is non-empty and checkable
    tiny_llama = load_model(RandomSource(config={**tiny_llama_config, "initializer_range": 0.2})).model
    exporter = get_exporter("onnxruntime")
    res = exporter.export(tiny_llama, smollm2_tokenizer, tmp_path / "onnx", exporter.options_model(), log=lambda *a: None)
    prompt = "What is the capital of France?"

    # --chat: the prompt goes through the chat template (a BatchEncoding in transformers 5)
    assert main(["run", str(res.artifact), "--prompt", prompt, "--chat", "--max-new-tokens", "6"]) == 0
    streamed = capsys.readouterr().out.strip()

    ids = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    expected_ids = greedy_generate(EagerRunner(tiny_llama), torch.tensor(ids), 6,
                                   eos_token_ids=[smollm2_tokenizer.eos_token_id])
    expected = smollm2_tokenizer.decode(expected_ids, skip_special_tokens=True).strip()
    assert len(expected_ids) >= 1 and expected, "the check needs visible text"
    assert streamed == expected
    # --runner python is the same loop; --runner llm needs ExecuTorch's C++ runner, which .onnx has not
    assert main(["run", str(res.artifact), "--prompt", prompt, "--chat", "--max-new-tokens", "6",
                 "--runner", "python"]) == 0
    assert capsys.readouterr().out.strip() == expected
    assert main(["run", str(res.artifact), "--prompt", prompt, "--runner", "llm"]) == 2
    assert "--runner llm: onnxruntime artifacts have no C++ LLM runner" in capsys.readouterr().err


def test_run_without_tokenizer_files_is_a_clear_error(tiny_llama, smollm2_tokenizer, tmp_path, capsys):
    exporter = get_exporter("onnxruntime")
    res = exporter.export(tiny_llama, smollm2_tokenizer, tmp_path / "onnx", exporter.options_model(), log=lambda *a: None)
    for f in res.artifact.parent.glob("tokenizer*"):
        f.unlink()
    assert main(["run", str(res.artifact), "--prompt", "hi"]) == 2
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


def test_run_samples_what_the_seed_draws(tiny_llama_config, smollm2_tokenizer, tmp_path, capsys):
    """--temperature/--top-k/--seed through the Python loop (an ONNX export): the tokens export.sampling
    draws from the eager model's logits with that seed. With --speculative, the same answer:
    tests/export/executorch/test_runner.py (.pte) and tests/export/onnxruntime/test_verify_rows.py."""
    from export.runtime import generate_ids
    from export.sampling import Sampling

    model = load_model(RandomSource(config={**tiny_llama_config, "initializer_range": 0.2})).model
    exporter = get_exporter("onnxruntime")
    res = exporter.export(model, smollm2_tokenizer, tmp_path / "onnx", exporter.options_model(), log=lambda *a: None)
    prompt = "the cat sat on the mat, the cat sat on the"
    ids = smollm2_tokenizer(prompt, add_special_tokens=True)["input_ids"]
    answers = set()
    for seed in (1, 2):
        s = Sampling(temperature=0.8, top_k=50, seed=seed)
        want = generate_ids(EagerRunner(model), torch.tensor(ids), 8, sampling=s,
                            eos_token_ids=[smollm2_tokenizer.eos_token_id])
        expected = smollm2_tokenizer.decode(want, skip_special_tokens=True).strip()
        assert main(["run", str(res.artifact), "--prompt", prompt, "--max-new-tokens", "8", "--temperature", "0.8",
                     "--top-k", "50", "--seed", str(seed)]) == 0
        assert capsys.readouterr().out.strip() == expected
        answers.add(expected)
    assert len(answers) == 2  # the seed chose the answer
