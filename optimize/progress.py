"""Progress of a run as typed events: a tqdm bar on a terminal, a callback for whoever embeds the run.

``run_pipeline(cfg, progress=True, callback=fn)``: every long part of a run (the baseline, each
stage, the training steps of ``distill`` / ``qat``, each export phase) emits
:class:`ProgressEvent` values; ``fn`` receives each one (an exception it raises fails the stage
it came from, which is a way to cancel). Stages emit through ``ctx.progress(step, total, ...)``
(:class:`optimize.stage_api.StageContext`); the pipeline fills in the stage's label.

With ``bars=True`` (``progress=True``, which the CLI sets on a terminal) each (stage, phase) that
reports steps gets a tqdm bar on stderr showing step/total, loss, tokens/s and the ETA; without
it nothing is drawn. The ETA is computed here from the steps seen so far, so callers get it too.
"""

from __future__ import annotations

import contextvars
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal

EventKind = Literal["begin", "step", "end"]


@dataclass(frozen=True)
class ProgressEvent:
    """One progress report. ``stage`` is the report row it belongs to (``baseline``, a stage
    label such as ``1:distill``, ``export:executorch``); ``phase`` what part of it (``stage``,
    ``train``, ``export``, ``verify``...). ``begin``/``end`` events bracket a phase; ``step``
    events carry ``step`` of ``total`` and what the phase measures (``loss``, ``tokens_per_s``)."""

    stage: str
    phase: str = "stage"
    event: EventKind = "step"
    step: int | None = None
    total: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None
    elapsed_s: float | None = None
    message: str | None = None
    #: anything else the emitter reported (lr, grad_norm, peak_mem_mib, ...)
    fields: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


Callback = Callable[[ProgressEvent], None]


class _Clock:
    """Elapsed time and ETA of one (stage, phase) from the steps it reported."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.first: tuple[int, float] | None = None  # (step, time) of the first step event

    def eta(self, step: int | None, total: int | None) -> tuple[float, float | None]:
        now = time.perf_counter()
        elapsed = now - self.t0
        if step is None:
            return elapsed, None
        if self.first is None:
            # the rate from the phase's start: the first step includes warm-up, later ones correct it
            self.first = (0, self.t0) if step > 0 else (step, now)
        s0, t0 = self.first
        if total is None or step <= s0 or now <= t0:
            return elapsed, None
        per_step = (now - t0) / (step - s0)
        return elapsed, max(0.0, (total - step) * per_step)


class Progress:
    """Fans progress events out to a callback and (``bars``) tqdm bars on ``file`` (stderr)."""

    def __init__(self, *, bars: bool = False, callback: Callback | None = None, file=None) -> None:
        self.bars = bars
        self.callback = callback
        self.file = file
        self._clocks: dict[tuple[str, str], _Clock] = {}
        self._bars: dict[tuple[str, str], Any] = {}
        self.listeners: list[Callback] = []  # internal consumers (tracking), after the callback

    # ---- emitting

    def emit(
        self,
        stage: str,
        step: int | None = None,
        total: int | None = None,
        *,
        phase: str = "stage",
        event: EventKind = "step",
        loss: float | None = None,
        tokens_per_s: float | None = None,
        message: str | None = None,
        **fields: Any,
    ) -> ProgressEvent:
        key = (stage, phase)
        if event == "begin" or key not in self._clocks:
            self._clocks[key] = _Clock()
        elapsed, eta = self._clocks[key].eta(step if event == "step" else None, total)
        ev = ProgressEvent(stage=stage, phase=phase, event=event, step=step, total=total,
                           loss=None if loss is None else float(loss),
                           tokens_per_s=None if tokens_per_s is None else float(tokens_per_s),
                           eta_s=eta, elapsed_s=elapsed, message=message, fields=fields)
        if self.bars:
            self._draw(key, ev)
        if event == "end":
            self._clocks.pop(key, None)
        if self.callback is not None:
            self.callback(ev)
        for listener in self.listeners:
            listener(ev)
        return ev

    def begin(self, stage: str, phase: str = "stage", *, total: int | None = None, message: str | None = None,
              **fields: Any) -> ProgressEvent:
        return self.emit(stage, 0 if total else None, total, phase=phase, event="begin", message=message, **fields)

    def end(self, stage: str, phase: str = "stage", *, message: str | None = None, **fields: Any) -> ProgressEvent:
        return self.emit(stage, phase=phase, event="end", message=message, **fields)

    def for_stage(self, stage: str) -> Callable[..., ProgressEvent]:
        """An emitter bound to one row label: what ``StageContext.progress`` calls."""

        def emit(step: int | None = None, total: int | None = None, **kw: Any) -> ProgressEvent:
            kw.setdefault("phase", "stage")
            return self.emit(stage, step, total, **kw)

        return emit

    # ---- bars

    def _draw(self, key: tuple[str, str], ev: ProgressEvent) -> None:
        bar = self._bars.get(key)
        if ev.event == "end":
            if bar is not None:
                if bar.total:
                    bar.n = max(bar.n, bar.total if ev.step is None else ev.step)
                bar.refresh()
                bar.close()
                self._bars.pop(key, None)
            return
        if ev.step is None and ev.total is None:
            return  # a begin without steps: nothing to draw
        if bar is None:
            from tqdm.auto import tqdm

            desc = ev.stage if ev.phase == "stage" else f"{ev.stage} {ev.phase}"
            bar = self._bars[key] = tqdm(total=ev.total, desc=desc, unit="step", dynamic_ncols=True,
                                         file=self.file or sys.stderr, leave=True)
        if ev.total is not None and bar.total != ev.total:
            bar.total = ev.total
        if ev.step is not None and ev.step > bar.n:
            bar.update(ev.step - bar.n)
        post = {}
        if ev.loss is not None:
            post["loss"] = f"{ev.loss:.4f}"
        if ev.tokens_per_s is not None:
            post["tok/s"] = f"{ev.tokens_per_s:.0f}"
        if ev.eta_s is not None:
            post["eta"] = _clock(ev.eta_s)
        if post:
            bar.set_postfix(post, refresh=True)

    def write(self, msg: str) -> None:
        """A message line that does not tear the bars (tqdm.write when bars are drawn)."""
        if self.bars and self._bars:
            from tqdm.auto import tqdm

            tqdm.write(msg, file=self.file or sys.stderr)
        else:
            print(msg, file=self.file or sys.stderr, flush=True)

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()
        self._clocks.clear()


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def collect() -> tuple[list[ProgressEvent], Callback]:
    """(events, callback): a callback that appends to the list, for tests and notebooks."""
    events: list[ProgressEvent] = []
    return events, events.append


__all__ = ["Callback", "Progress", "ProgressEvent", "collect"]


#: the hub of the run in progress (set by :func:`optimize.pipeline.run_pipeline`), for the parts of the
#: runner that report phases (the stages' loop, the export and its verification)
_CURRENT: contextvars.ContextVar[Progress | None] = contextvars.ContextVar("optimize_progress", default=None)


def current_hub() -> Progress:
    """The run's hub; a silent one outside a run."""
    return _CURRENT.get() or Progress()


def use_hub(hub: Progress) -> contextvars.Token:
    """Make ``hub`` the run's hub; :func:`reset_hub` with the token puts the previous one back."""
    return _CURRENT.set(hub)


def reset_hub(token: contextvars.Token) -> None:
    _CURRENT.reset(token)

