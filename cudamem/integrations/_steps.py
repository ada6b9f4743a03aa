"""Per-step spans and the metric set shared by the Lightning and Transformers callbacks.

Each measured step is one cudamem span (``sync=False``: the allocator's counters are exact
without waiting for the GPU), opened and closed by the framework's hooks and *detached*
(it never becomes the parent of the user's own spans, which stay top-level in
``cudamem.history()``). The span's name repeats every step, so cudamem's growth detector
watches it and issues a ``cudamem.LeakWarning`` naming the culprits when the level
keeps rising.

The metric set, per measured step (bytes shown in MiB, ``1 MiB = 1024**2`` bytes):

========================  ==================================================================
``allocated_mib``         allocated at the end of the step
``reserved_mib``          reserved (allocated + the caching allocator's cache) at the end
``peak_mib``              the highest allocated during the step
``retained_mib``          allocated at the end minus at the start: what the step kept
``leak_culprits``         holder groups named by the latest LeakWarning for this span name
                          (0 until one is issued; not logged when growth detection is off)
========================  ==================================================================

and, with ``host=True`` (the default), the host columns of ``cudamem.integrations._host``:
``host_rss_mib``, ``host_uss_mib``, ``workers_uss_mib`` and ``pinned_mib``.

Modes: ``cuda`` reads the model's GPU; ``cpu`` counts live CPU storages instead (see
``cudamem.integrations._cpu``: ``allocated_mib``, ``retained_mib`` and ``leak_culprits``
only, since the CPU has no cache and no peak counter); ``auto`` is ``cuda`` for a model on a
GPU and measures nothing on the CPU (no metric is logged rather than a made-up zero).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..allocator import backend as _backend
from ..base.args import check_bool, check_int
from ..growth._warn import add_growth_hook, remove_growth_hook
from ..growth.detector import leak_settings
from ..modules.profiler import ModuleProfiler, track_modules
from ..spans.span import MemorySpan, StepSpan
from ._cpu import CpuStorageBackend
from ._host import HOST_METRICS, HostMeter

if TYPE_CHECKING:
    from ..growth.report import Growth
    from ..modules.profile import ModuleProfile

__all__ = ["METRICS", "MODES", "Meters", "ModuleMeter", "StepMeter"]

MODES = ("auto", "cuda", "cpu")
#: Metric names (without prefix and stage) in the order they are logged.
METRICS = (
    "allocated_mib",
    "reserved_mib",
    "peak_mib",
    "retained_mib",
    "leak_culprits",
    *HOST_METRICS,
)
MiB = 1024**2


@dataclass(frozen=True, slots=True)
class _Open:
    stage: str
    step: StepSpan


class StepMeter:
    """Opens a span at each step's start, closes it at its end, turns it into metrics."""

    def __init__(
        self,
        *,
        device: str = "auto",
        prefix: str = "cudamem/",
        every_n_steps: int = 1,
        peak: bool = True,
        span_names: dict[str, str],
        stage_prefixes: dict[str, str],
        host: bool = True,
    ) -> None:
        if not isinstance(device, str) or device not in MODES:
            raise ValueError(f"device must be one of {MODES}, got {device!r}")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, not {type(prefix).__name__}")
        check_int("every_n_steps", every_n_steps, minimum=1)
        check_bool("peak", peak)
        check_bool("host", host)
        #: The host columns' source, when ``host`` (started with each run).
        self.host = HostMeter() if host else None
        self.requested = device
        self.prefix = prefix
        self.every_n_steps = every_n_steps
        self.peak = peak
        self.span_names = dict(span_names)
        self.stage_prefixes = dict(stage_prefixes)
        #: ``cuda``, ``cpu`` or ``off`` once a run started.
        self.mode = "off"
        self.device_index: int | None = None
        #: Why nothing is measured (``auto`` on a CPU model), for the log and the docs.
        self.note: str | None = None
        #: Growth findings for this meter's spans, the latest last.
        self.findings: deque[Growth] = deque(maxlen=20)
        self._culprits: dict[str, int] = {}
        self._current: _Open | None = None
        self._calls: dict[str, int] = {}
        self._stack: contextlib.ExitStack | None = None

    # -- run ----------------------------------------------------------------------------

    def begin_run(self, device_type: str, index: int | None) -> None:
        """A fit/train starts on ``device_type`` (``'cuda'``, ``'cpu'``, ...)."""
        self.end_run()
        self._culprits.clear()
        self._calls.clear()
        mode = self.requested
        if mode == "auto":
            mode = "cuda" if device_type == "cuda" else "off"
            if mode == "off":
                self.note = (
                    f"cudamem: the model is on {device_type!r}, not a CUDA device: no memory "
                    "metrics are logged (pass device='cpu' to count CPU storages instead)"
                )
        elif mode == "cuda" and device_type != "cuda":
            self.note = f"cudamem: device='cuda' but the model is on {device_type!r}"
        self.mode = mode
        self.device_index = index if mode == "cuda" else None
        self._stack = contextlib.ExitStack()
        if mode == "cpu":
            self._stack.enter_context(_backend.use(CpuStorageBackend()))
        if mode != "off":
            add_growth_hook(self._on_growth)
            self._stack.callback(remove_growth_hook, self._on_growth)
            if self.host is not None:
                self.host.begin()
                self._stack.callback(self.host.end)

    def end_run(self) -> None:
        """The run ended (or failed): close what is open, restore the backend."""
        self.abort(None)
        if self._stack is not None:
            stack, self._stack = self._stack, None
            stack.close()

    # -- steps --------------------------------------------------------------------------

    def start(self, stage: str) -> None:
        """A step of ``stage`` (``'train'``, ``'val'``) begins."""
        if self.mode == "off":
            return
        if self._current is not None:
            self.abort(None)  # the previous step never ended (an exception in between)
        n = self._calls.get(stage, 0)
        self._calls[stage] = n + 1
        if n % self.every_n_steps:
            return
        try:
            step = StepSpan(
                self.span_names[stage], device=self.device_index, sync=False, peak=self.peak
            )
            step.start()
            self._current = _Open(stage, step)
        except Exception as exc:  # bookkeeping never breaks the training step
            warnings.warn(f"cudamem: could not open the step span: {exc!r}", RuntimeWarning, 2)

    def end(self, stage: str) -> dict[str, float] | None:
        """The step of ``stage`` ended: its metrics, or ``None`` when it was not measured."""
        current = self._current
        if current is None or current.stage != stage:
            return None
        self._current = None
        try:
            span = current.step.stop()
            return None if span is None else self._metrics(stage, span)
        except Exception as exc:
            warnings.warn(f"cudamem: could not close the step span: {exc!r}", RuntimeWarning, 2)
            return None

    def abort(self, exc: BaseException | None) -> bool:
        """Close the open span with ``exc`` (an OOM then gets cudamem's post-mortem from the
        span's exit, as any ``track()`` block does); whether a span was open."""
        current, self._current = self._current, None
        if current is None:
            return False
        with contextlib.suppress(Exception):
            current.step.stop(exc)
        return True

    # -- metrics ------------------------------------------------------------------------

    def name(self, stage: str, metric: str) -> str:
        """The logged name of ``metric`` for ``stage``: ``cudamem/val_peak_mib``."""
        return f"{self.prefix}{self.stage_prefixes.get(stage, '')}{metric}"

    def _metrics(self, stage: str, span: MemorySpan) -> dict[str, float] | None:
        record = span.record
        if not record.devices:
            return None
        values: dict[str, float] = {}
        allocated = sum(d.after.allocated for d in record.devices)
        values["allocated_mib"] = allocated / MiB
        if self.mode == "cuda":
            values["reserved_mib"] = sum(d.after.reserved for d in record.devices) / MiB
            if record.peak is not None:
                values["peak_mib"] = record.peak / MiB
        values["retained_mib"] = record.allocated_delta / MiB
        if leak_settings().enabled:
            values["leak_culprits"] = float(self._culprits.get(stage, 0))
        if self.host is not None:
            values.update(self.host.values(self.mode == "cuda"))
        return {self.name(stage, k): values[k] for k in METRICS if k in values}

    def summarize(self, stage: str, steps: list[dict[str, float]]) -> dict[str, float]:
        """Several steps as one set: the last step's levels (allocated, reserved, culprits),
        the highest peak, the mean retained per step."""
        if not steps:
            return {}
        out = dict(steps[-1])
        peak = self.name(stage, "peak_mib")
        if peak in out:
            out[peak] = max(s.get(peak, 0.0) for s in steps)
        retained = self.name(stage, "retained_mib")
        if retained in out:
            out[retained] = sum(s.get(retained, 0.0) for s in steps) / len(steps)
        return out

    def _on_growth(self, growth: Growth) -> None:
        for stage, span_name in self.span_names.items():
            if growth.name == span_name:
                self._culprits[stage] = len(growth.culprits)
                self.findings.append(growth)

    @property
    def measuring(self) -> bool:
        """Whether a run is measured (``cuda`` or ``cpu`` mode)."""
        return self.mode != "off"

    def describe(self) -> dict[str, Any]:
        """Mode and settings, for logs and tests."""
        return {
            "mode": self.mode,
            "device": self.device_index,
            "every_n_steps": self.every_n_steps,
            "peak": self.peak,
            "host": self.host is not None,
            "note": self.note,
        }


class ModuleMeter:
    """The callbacks' per-module profile (``modules=N``): ``cudamem.track_modules`` over the
    model for the whole run, a step per training step, and at the run's end the ``N``
    modules whose own code kept the most, as metrics:
    ``cudamem/modules/<module>/kept_mib`` (activations its own code kept, mean per step) and
    ``cudamem/modules/<module>/peak_mib`` (its highest peak above its entry level, forward
    or backward). Validation loops are left out (``pause``/``resume``).
    """

    def __init__(self, top: int, prefix: str) -> None:
        self.top = check_int("modules", top, minimum=0)
        self.prefix = prefix
        self._profiler: ModuleProfiler | None = None
        #: The last run's profile.
        self.profile: ModuleProfile | None = None

    def begin(self, model: Any) -> None:
        """Profile ``model``'s modules (nothing with ``modules=0`` or without a model)."""
        self.end()
        import torch

        if self.top and isinstance(model, torch.nn.Module):
            try:
                self._profiler = track_modules(model).start()
            except Exception as exc:  # bookkeeping never breaks the run
                warnings.warn(f"cudamem: no module profile: {exc!r}", RuntimeWarning, 2)

    def step(self) -> None:
        """A training step ended."""
        if self._profiler is not None:
            self._profiler.step()

    def pause(self) -> None:
        """Leave the module calls out until ``resume()`` (a validation loop)."""
        if self._profiler is not None:
            self._profiler.pause()

    def resume(self) -> None:
        if self._profiler is not None:
            self._profiler.resume()

    def end(self) -> dict[str, float]:
        """Stop profiling; the top modules' metrics (empty when nothing was profiled)."""
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return {}
        self.profile = profile = profiler.stop()
        if profile.unmeasured:
            return {}
        metrics: dict[str, float] = {}
        for row in profile.top(self.top):
            base = f"{self.prefix}modules/{row.name}/"
            metrics[base + "kept_mib"] = row.self_kept.mean / MiB
            metrics[base + "peak_mib"] = max(row.forward_peak.max, row.backward_peak.max) / MiB
        return metrics


class Meters:
    """What both callbacks are made of: a ``StepMeter`` and a ``ModuleMeter``, and the two
    results they expose (``module_profile``, ``leaks``)."""

    meter: StepMeter
    modules: ModuleMeter

    def _init_meters(
        self,
        device: str,
        every_n_steps: int,
        prefix: str,
        peak: bool,
        modules: int,
        span_names: dict[str, str],
        stage_prefixes: dict[str, str],
        host: bool = True,
    ) -> None:
        self.modules = ModuleMeter(modules, prefix)
        self.meter = StepMeter(
            device=device,
            prefix=prefix,
            every_n_steps=every_n_steps,
            peak=peak,
            span_names=span_names,
            stage_prefixes=stage_prefixes,
            host=host,
        )

    @property
    def module_profile(self) -> ModuleProfile | None:
        """The per-module profile of the last fit or training (``modules=N``), or ``None``."""
        return self.modules.profile

    @property
    def leaks(self) -> tuple[Growth, ...]:
        """Growth findings (the content of each LeakWarning) for this callback's spans."""
        return tuple(self.meter.findings)
