"""``optimize`` command line: each command is a thin layer over a typed API function.

    optimize pipeline model.yaml [--target executorch] [key=value ...]
    optimize validate model.yaml [--target executorch] [key=value ...]
    optimize schema [--report]
    optimize ls stages|targets|devices
    optimize fit model.yaml --device-profile raspberry-pi-5
    optimize run model.pte --prompt "..."
    optimize sensitivity model.yaml [--scheme 8da4w]
    optimize train recipe.yaml [key=value ...]

Options and ``key=value`` overrides may come in any order, and ``-v`` before or after the
command. Refusals of bad input (a bad config, a missing file, a refused model, stage or export, a
runner error) print one ``error:`` line and exit 2; ``-v`` shows the traceback and library logs.
Anything else is a bug: it keeps its traceback and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from optimize.quiet import quiet_third_party, setup_cli_logging


class _IntermixedParser(argparse.ArgumentParser):
    """A command's parser that takes options and positionals in any order, so the README's
    ``optimize pipeline p.yaml --target executorch stages.0.scheme=8da4w`` works: plain
    argparse ends ``overrides`` (nargs="*") at the first option and rejects what follows."""

    _plain = False

    def parse_known_args(self, args=None, namespace=None):
        if self._plain:  # parse_known_intermixed_args calls back in here
            return super().parse_known_args(args, namespace)
        self._plain = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._plain = False


def _is_expected(exc: BaseException) -> bool:
    """A refusal of bad input (one ``error:`` line, exit 2), not a bug (traceback, exit 1): the
    project's own error classes, a missing file, or a ValueError/TypeError that an explicit
    ``raise`` in our code raised; an implicit one (a failed unpack) or a library's is a bug.
    One rule for every verb and ``python -m train``: :func:`train.errors.is_refusal`."""
    from train.errors import is_refusal

    return is_refusal(exc)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _console_say(msg: str) -> None:
    """The run's messages on the terminal's stderr even while the run's own output goes to its log."""
    from optimize.quiet import console

    print(msg, file=console(), flush=True)


def _progress(args) -> bool:
    """--progress / --no-progress, else bars only when stderr is a terminal."""
    if getattr(args, "progress", None) is not None:
        return args.progress
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def cmd_pipeline(args) -> int:
    from optimize.config import load_config
    from optimize.pipeline import run_pipeline
    from optimize.report import markdown_table

    cfg = load_config(args.config, args.overrides, target=args.target, device_profile=args.device_profile)
    # a terminal: bars and messages, as always; otherwise (CI logs, pipes) the messages only, and the
    # libraries' warnings and native runtimes' prints go to <run>/pipeline.log
    progress = _progress(args)
    report = run_pipeline(cfg, output_dir=args.output, say=None if progress else _console_say, progress=progress)
    print(markdown_table(report))
    if report.ok:
        status = "warn" if report.warned_gates() else "ok"
        print(f"\n{status}: {report.verdict()} · report in {report.output_dir}")
    else:
        print(f"\nSTOPPED at {report.stopped_at} · last good model: {report.last_good_artifact} · report in {report.output_dir}")
    return report.exit_code


def cmd_validate(args) -> int:
    from optimize.config import load_config

    cfg = load_config(args.config, args.overrides, target=args.target, device_profile=args.device_profile)
    stages = ", ".join(s.label(i) for i, s in enumerate(cfg.stages)) or "none"
    device = f"; device: {cfg.device_profile}" if cfg.device_profile else ""
    draft = (f"; draft: {', '.join(s.label(i) for i, s in enumerate(cfg.draft.stages))}" if cfg.draft is not None
             else "")
    print(f"{args.config}: valid (version {cfg.version}; model {cfg.model.source}; stages: {stages}{draft}; "
          f"target: {cfg.target}{device})")
    return 0


def cmd_schema(args) -> int:
    if args.report:
        from optimize.report import report_json_schema

        print(json.dumps(report_json_schema(), indent=2))
    else:
        from optimize.config import json_schema

        print(json.dumps(json_schema(), indent=2))
    return 0


def cmd_ls(args) -> int:
    if args.what == "stages":
        from optimize.stage_api import registered_stages

        specs = registered_stages()
        width = max((len(k) for k in specs), default=0)
        for kind, spec in specs.items():
            print(f"{kind:<{width}}  {spec.description}")
    elif args.what == "tasks":
        from optimize.tasks.catalog import local_tasks

        rows = local_tasks(args.include_path or ())
        width = min(40, max((len(r["name"]) for r in rows), default=0))
        for r in rows:
            print(f"{r['name']:<{width}}  {r['kind']:<5}  {r['output_type'] or '-':<21}  {r['data']}")
        print(f"\n{len(rows)} tasks and groups with their data on this machine (checks.tasks.names); "
              "optimize validate builds the ones a config names")
    elif args.what == "devices":
        from targets.devices import list_devices

        devices = list_devices()
        print(f"{'name':<21} {'RAM GiB':>7} {'usable':>6} {'GB/s':>6} {'x frac':>6} {'cores':>6}  runtimes")
        for d in devices:
            cores = "+".join(str(n) for n in (d.cores.big, d.cores.mid, d.cores.little) if n)
            print(f"{d.name:<21} {d.memory.total_gib:>7g} {d.memory.usable_gib:>6g} {d.bandwidth.theoretical_gb_s:>6g} "
                  f"{d.bandwidth.practical_fraction:>6g} {cores:>6}  {', '.join(d.runtimes)}\n"
                  f"{'':<21} {d.description}; ISA {d.arch_level + ': ' if d.arch_level else ''}{', '.join(d.isa)}")
    else:
        from targets import list_targets

        for t in list_targets():
            print(f"{t.name:<12} exporter={t.exporter} backend={t.backend} max_seq_len={t.max_seq_len} "
                  f"schemes={','.join(t.allowed_schemes)}\n{'':<12} {t.description}")
    return 0


def cmd_fit(args) -> int:
    from optimize.fit import fit

    res = fit(args.config, args.device_profile, target=args.target, out_dir=args.output,
              overrides=tuple(args.overrides), decode_tok_s=args.decode_tok_s, max_memory_gib=args.max_memory_gib,
              max_ppl_pct=args.max_ppl_pct, windows=args.windows, finalists=args.finalists,
              max_seq_lens=args.max_seq_len, export_finalists=args.export_finalists, depths=args.depths,
              heal_steps=args.heal_steps, log=_console_say, progress=_progress(args))
    print(res.table())
    print(f"\nwinner: {res.winner.label(res.several_lengths)} · {res.paths['yaml']} (run it with optimize pipeline to measure it "
          "in the runtime) · plot: " + res.paths.get("png", "not drawn"))
    return 0


def cmd_run(args) -> int:
    from optimize.generate import generate_from_artifact, sampling_from

    sampling = sampling_from(args.temperature, args.top_k, args.top_p, args.seed)
    generate_from_artifact(Path(args.artifact), args.prompt, max_new_tokens=args.max_new_tokens,
                           chat=args.chat, threads=args.threads, stream=sys.stdout, runner=args.runner,
                           speculative=args.speculative, sampling=sampling)
    return 0


def cmd_setup(args) -> int:
    from targets.arm64.environment import setup

    info = setup(force=args.force, say=_say)
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        size = sum(info["bytes"].values()) / 2**30
        print(f"ARM64 environment {'built' if info['built'] else 'ready'}: {info['path']} ({size:.2f} GiB; "
              + ", ".join(f"{d} {v}" for d, v in info["versions"].items() if d in ("torch", "executorch", "onnxruntime",
                                                                                 "onnxruntime-genai")) + ")")
    return 0


def cmd_verify(args) -> int:
    from export.arm64.verify import summary, verify_artifact

    report = verify_artifact(args.artifact, cpu=args.cpu, device=args.device_profile, prompts=args.prompts,
                             new_tokens=args.new_tokens, windows=args.windows, window_tokens=args.window_tokens,
                             ppl_tolerance_pct=args.ppl_tolerance)
    if args.output:
        from targets.atomic import atomic_write_json

        atomic_write_json(Path(args.output), report)
    print(json.dumps(report, indent=1) if args.json else summary(report))
    return 0 if report["verified"] else 1


def cmd_sensitivity(args) -> int:
    from optimize.sensitivity import run_sensitivity

    report = run_sensitivity(
        args.config, args.overrides, scheme=args.scheme, groups=tuple(args.groups), windows=args.windows,
        seq_len=args.seq_len, algorithm=args.algorithm, out_dir=args.output, log=_say,
    )
    print(report.table(limit=args.top))
    return 0


def cmd_train(args) -> int:
    from train.api import check_recipe, run_training
    from train.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    if args.check:
        report = check_recipe(recipe, args.world_size or int(os.environ.get("WORLD_SIZE", "1")))
    else:
        report = run_training(recipe)
    print(json.dumps(report.model_dump(mode="json") if hasattr(report, "model_dump") else report, indent=2, default=str))
    return 0


_SENSITIVITY_GROUPS = ("blocks", "projections", "lm_head", "embeddings", "modules")


def _sensitivity_groups(text: str) -> list[str]:
    """``--groups blocks,lm_head``: one comma-separated value, so that overrides after it stay
    overrides (``nargs="+"`` would swallow them)."""
    groups = [g.strip() for g in text.split(",") if g.strip()]
    bad = [g for g in groups if g not in _SENSITIVITY_GROUPS]
    if not groups or bad:
        raise argparse.ArgumentTypeError(
            f"unknown group(s) {', '.join(bad) or repr(text)}; choose from {', '.join(_SENSITIVITY_GROUPS)}")
    return groups


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="optimize", description="Optimize causal LMs and export them, verified, to edge runtimes.")
    p.add_argument("-v", "--verbose", action="store_true", help="show library logs and tracebacks")
    # -v also after the command (``optimize pipeline p.yaml -v``); SUPPRESS keeps a top-level -v
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="show library logs and tracebacks")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_IntermixedParser)

    def command(name: str, **kw) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[verbose], **kw)

    s = command("pipeline", help="run the stages in a pipeline YAML, with checks, gates and a report")
    s.add_argument("config", help="pipeline YAML")
    s.add_argument("overrides", nargs="*", default=[], help="key.path=value overrides, e.g. stages.0.group_size=64")
    s.add_argument("--target", help="target profile (see `optimize ls targets`); overrides the YAML's target")
    s.add_argument("--output", help="output directory (default: the YAML's output_dir or runs/<name>)")
    s.add_argument("--device-profile", help="device the export must fit (see `optimize ls devices`) or a device "
                   "profile YAML; overrides the YAML's device_profile")
    s.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars (step, loss, tokens/s, ETA) and library output on stderr; default: only when "
                   "stderr is a terminal. Without, library warnings and native prints go to <run>/pipeline.log")
    s.set_defaults(fn=cmd_pipeline)

    s = command("validate", help="check a pipeline YAML without running it")
    s.add_argument("config")
    s.add_argument("overrides", nargs="*", default=[], help="key.path=value overrides")
    s.add_argument("--target")
    s.add_argument("--device-profile", help="device profile name or YAML (see `optimize ls devices`)")
    s.set_defaults(fn=cmd_validate)

    s = command("schema", help="print the JSON Schema of the pipeline YAML (or of the report)")
    s.add_argument("--report", action="store_true", help="the report.json schema instead")
    s.set_defaults(fn=cmd_schema)

    s = command("ls", help="list registered stages, target profiles, device profiles, or the lm-eval tasks "
                "whose data is on this machine")
    s.add_argument("what", choices=["stages", "targets", "devices", "tasks"])
    s.add_argument("--include-path", nargs="*", metavar="DIR", help="with tasks: folders of your task YAMLs too")
    s.set_defaults(fn=cmd_ls)

    s = command("fit", help="price quantization recipes against a device from bytes, measure the finalists' "
                "perplexity on a short eval; write a Pareto table, plot and the winning YAML")
    s.add_argument("config", help="pipeline YAML (its model)")
    s.add_argument("overrides", nargs="*", default=[], help="key.path=value overrides")
    s.add_argument("--device-profile", required=True, help="device profile name or YAML (see `optimize ls devices`)")
    s.add_argument("--target", default="executorch", help="only executorch is priced")
    s.add_argument("--output", help="output directory (default <run dir>/fit)")
    s.add_argument("--decode-tok-s", type=float, help="slowest acceptable PREDICTED decode (default: the device's budget)")
    s.add_argument("--max-memory-gib", type=float, help="memory budget below the device's usable memory")
    s.add_argument("--max-ppl-pct", type=float,
                   help="largest measured perplexity increase, %% (default: the YAML's gates.perplexity)")
    s.add_argument("--windows", type=int, default=8, help="eval windows per finalist's perplexity (0: bytes only)")
    s.add_argument("--finalists", type=int, default=6, help="recipes that fit whose perplexity is measured")
    s.add_argument("--export-finalists", type=int, default=0, metavar="K",
                   help="also export the best K measured recipes and measure them in ExecuTorch (the winner is then "
                   "chosen by the runtime's perplexity)")
    s.add_argument("--max-seq-len", type=int, nargs="+", metavar="N",
                   help="KV-cache lengths to price (default: the YAML's); the longest at which a recipe fits wins")
    s.add_argument("--depths", type=int, nargs="+", metavar="N",
                   help="decoder blocks kept, searched beside the full depth: depth-pruned (ShortGPT block influence) "
                   "and healed by distillation from the unpruned model where a recipe at that depth is a finalist")
    s.add_argument("--heal-steps", type=int, default=32,
                   help="distillation steps that heal each depth-pruned model (0: prune only; default 32)")
    s.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars and library output on stderr (default: only on a terminal; else <output>/fit.log)")
    s.set_defaults(fn=cmd_fit)

    s = command("run", help="generate text from an exported artifact (.pte, .onnx)", aliases=["generate"])
    s.add_argument("artifact")
    s.add_argument("--prompt", required=True)
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--runner", choices=["auto", "llm", "python"], default="auto",
                   help=".pte: ExecuTorch's C++ text runner when the program allows it (auto, the default), "
                   "always (llm: an error if it cannot), or the Python loop (python)")
    s.add_argument("--speculative", choices=["off", "ngram", "draft"], default="off",
                   help="ngram: prompt-lookup drafts verified several tokens a call through the .pte's verify method "
                   "(export.executorch.verify_tokens); draft: the .pte's own draft model (the pipeline's draft block) "
                   "where lookup finds nothing; either gives plain decoding's tokens (default off)")
    s.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (default 0: greedy); with --speculative, the answer plain sampling "
                   "gives with the same --seed (drafts kept by the standard rejection rule)")
    s.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    s.add_argument("--top-p", type=float, default=None, help="sample from the fewest most likely tokens holding p")
    s.add_argument("--seed", type=int, default=None, help="the sampling seed: the same seed, the same answer")
    s.set_defaults(fn=cmd_run)

    s = command("setup", help="install what a check needs beyond pip: `optimize setup arm64` builds the ARM64 "
                "root, wheels and QEMU that `optimize verify` runs artifacts in (cached; apt as root)")
    s.add_argument("what", choices=["arm64"])
    s.add_argument("--force", action="store_true", help="rebuild even if the environment for these versions exists")
    s.add_argument("--json", action="store_true", help="print what was built as JSON")
    s.set_defaults(fn=cmd_setup)

    s = command("verify", help="run an artifact in the ARM64 build of its runtime on an emulated core and compare "
                "greedy tokens and perplexity with the x86-64 build")
    s.add_argument("artifact", help=".pte, .onnx or an onnxruntime-genai folder (its tokenizer beside it)")
    where = s.add_mutually_exclusive_group()
    where.add_argument("--cpu", help="emulated core: cortex-a72, cortex-a76 (default), max (Armv9, SME off)")
    where.add_argument("--device-profile", help="device profile whose core to emulate (see `optimize ls devices`)")
    s.add_argument("--prompts", type=int, default=2, help="greedy prompts (32 tokens each, from the reference text)")
    s.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per prompt")
    s.add_argument("--windows", type=int, default=24,
                   help="perplexity windows; fewer make the 1%% tolerance noise (docs/devices.md)")
    s.add_argument("--window-tokens", type=int, default=128, help="tokens per perplexity window")
    s.add_argument("--ppl-tolerance", type=float, default=1.0, help="largest perplexity difference from x86-64, %%")
    s.add_argument("--output", help="also write the report JSON here")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.set_defaults(fn=cmd_verify)

    s = command("sensitivity", help="rank module groups by how much quantizing each alone costs")
    s.add_argument("config", help="pipeline YAML (its model, text and quantization stage are used)")
    s.add_argument("overrides", nargs="*", default=[], help="key.path=value overrides")
    s.add_argument("--scheme", choices=["8da4w", "8da8w", "w4", "w8", "w8a8-tensor"],
                   help="default: the config's ptq stage scheme, or its ONNX Runtime quantize mode "
                   "(w8a8-tensor = ORT's per-tensor dynamic/static activations)")
    s.add_argument("--groups", type=_sensitivity_groups, default=list(_SENSITIVITY_GROUPS[:4]),
                   help="how to group modules, comma-separated (each group is quantized alone): "
                   f"{','.join(_SENSITIVITY_GROUPS)}; default {','.join(_SENSITIVITY_GROUPS[:4])}")
    s.add_argument("--windows", type=int, default=4, help="calibration windows scored per group")
    s.add_argument("--seq-len", type=int, default=256)
    s.add_argument("--algorithm", choices=["rtn", "hqq"], default="rtn", help="weight scale choice")
    s.add_argument("--output", help="output directory (default <run dir>/sensitivity)")
    s.add_argument("--top", type=int, default=None, help="print only the N most sensitive groups")
    s.set_defaults(fn=cmd_sensitivity)

    s = command("train", help="run a training recipe (LoRA/QLoRA, FSDP2 under torchrun, ...)")
    s.add_argument("recipe")
    s.add_argument("overrides", nargs="*", default=[], help="key.path=value overrides")
    s.add_argument("--check", action="store_true",
                   help="check the recipe and its parallel layout against the model; load no weights, train nothing")
    s.add_argument("--world-size", type=int, default=None, help="ranks to check the layout for (default $WORLD_SIZE or 1)")
    s.set_defaults(fn=cmd_train)
    return p


def main(argv: list[str] | None = None) -> int:
    from export.executorch import blas_threads

    # before torch loads: MKL stays serial on ExecuTorch's workers, eager torch keeps its threads
    blas_threads.apply(blas_threads.serial_mkl_env())
    args = build_parser().parse_args(argv)
    setup_cli_logging(args.verbose)
    if not args.verbose:
        quiet_third_party()
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.verbose or not _is_expected(exc):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
