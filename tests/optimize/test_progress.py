"""Progress events: typed, with increasing steps, loss and ETA from the training stages; bars only when asked."""

from __future__ import annotations

import io

import pytest

from optimize import load_config, run_pipeline
from optimize.progress import Progress, ProgressEvent, collect


def test_events_carry_steps_and_an_eta_and_bars_show_loss_tok_s_eta():
    out = io.StringIO()
    events, cb = collect()
    hub = Progress(bars=True, callback=cb, file=out)
    emit = hub.for_stage("1:distill")
    emit(0, 4, phase="train", event="begin", message="distill: 4 steps")
    for step in range(1, 5):
        emit(step, 4, phase="train", loss=2.0 / step, tokens_per_s=1000.0, lr=1e-3)
    emit(4, 4, phase="train", event="end")
    hub.close()
    assert [e.event for e in events] == ["begin", "step", "step", "step", "step", "end"]
    steps = [e for e in events if e.event == "step"]
    assert [e.step for e in steps] == [1, 2, 3, 4] and all(e.stage == "1:distill" and e.phase == "train" for e in steps)
    assert steps[0].loss == 2.0 and steps[0].fields == {"lr": 1e-3}
    assert all(e.eta_s is not None and e.eta_s >= 0 for e in steps) and steps[-1].eta_s == 0
    assert isinstance(events[0], ProgressEvent) and events[0].as_dict()["message"] == "distill: 4 steps"
    bar = out.getvalue()
    assert "1:distill train" in bar and "4/4" in bar and "loss=0.5000" in bar and "tok/s=1000" in bar and "eta=" in bar


def test_no_bars_draw_nothing(capfd):
    hub = Progress(bars=False)
    hub.emit("x", 1, 2, phase="train", loss=1.0)
    hub.close()
    assert capfd.readouterr() == ("", "")


def _distill_cfg(tiny_cfg, steps=4):
    tiny_cfg["checks"]["latency"]["enabled"] = False
    # noise first: a distill right after the baseline has a student equal to its teacher (loss 0)
    tiny_cfg["stages"] = [{"kind": "test_noise", "scale": 0.1},
                          {"kind": "distill", "steps": steps, "seq_len": 32, "optimizer": {"lr": 1e-3},
                           "batch": {"micro_batch_size": 1}}]
    return load_config(tiny_cfg)


def test_pipeline_callback_gets_stage_and_training_events(tiny_cfg, capfd):
    events, cb = collect()
    cfg = _distill_cfg(tiny_cfg)
    capfd.readouterr()  # loading the config may import torchao (its own noise): only the run is checked
    report = run_pipeline(cfg, callback=cb)
    assert report.ok
    seen = [(e.stage, e.phase, e.event) for e in events if e.event != "step"]
    assert seen[:2] == [("baseline", "stage", "begin"), ("baseline", "stage", "end")]
    assert ("1:distill", "stage", "begin") in seen and ("1:distill", "train", "begin") in seen
    assert seen.index(("1:distill", "train", "end")) < seen.index(("1:distill", "stage", "end"))
    train = [e for e in events if e.stage == "1:distill" and e.phase == "train" and e.event == "step"]
    assert [e.step for e in train] == [1, 2, 3, 4] and all(e.total == 4 for e in train)
    assert all(e.loss is not None and e.loss > 0 and e.tokens_per_s > 0 for e in train)
    assert train[-1].eta_s == 0 and "peak_mem_mib" in train[0].fields
    # the API is quiet unless asked: the bars were not drawn
    assert capfd.readouterr() == ("", "")


def test_qat_reports_prepare_train_convert(tiny_cfg):
    pytest.importorskip("torchao")
    events, cb = collect()
    tiny_cfg["checks"]["latency"]["enabled"] = False
    tiny_cfg["stages"] = [{"kind": "qat", "scheme": "8da8w", "steps": 3, "seq_len": 32, "batch": {"micro_batch_size": 1}}]
    report = run_pipeline(load_config(tiny_cfg), callback=cb)
    assert report.ok, report.rows[-1].error
    mine = [(e.phase, e.event, e.step) for e in events if e.stage == "0:qat" and e.phase != "stage"]
    assert mine == [("prepare", "begin", None), ("prepare", "end", None), ("train", "begin", 0),
                    ("train", "step", 1), ("train", "step", 2), ("train", "step", 3), ("train", "end", 3),
                    ("convert", "begin", None), ("convert", "end", None)]


def test_progress_true_draws_the_training_bar(tiny_cfg, capfd):
    cfg = _distill_cfg(tiny_cfg, steps=3)
    capfd.readouterr()
    report = run_pipeline(cfg, progress=True)
    assert report.ok
    err = capfd.readouterr().err
    assert "1:distill train" in err and "3/3" in err and "loss=" in err and "tok/s=" in err and "eta=" in err
    assert "stage 1:distill: " in err and "report: " in err  # the messages, as on a terminal


def test_gptq_reports_each_block(tiny_cfg):
    events, cb = collect()
    tiny_cfg["checks"]["latency"]["enabled"] = False
    tiny_cfg["stages"] = [{"kind": "ptq_int8", "scheme": "8da8w", "algorithm": "gptq",
                           "gptq": {"calibration_windows": 1}}]
    report = run_pipeline(load_config(tiny_cfg), callback=cb)
    assert report.ok, report.rows[-1].error
    mine = [e for e in events if e.stage == "0:ptq_int8" and e.phase == "gptq"]
    assert mine[0].event == "begin" and mine[-1].event == "end"
    steps = [e for e in mine if e.event == "step"]
    assert [e.step for e in steps] == list(range(1, len(steps) + 1)) and len(steps) >= 2
    assert all(e.total == len(steps) and e.fields.get("layers", 0) >= 1 for e in steps)
