"""What one backend's steps did, kept apart per model: step times, measured peaks and the predictions
they are compared with.

Note: [Models of one backend]
    One backend may compile several models (two trained one after the other, a generator and a
    discriminator, a model and its validation twin), each a set of graphs. The graphs a step calls are
    its *kind*; kinds that share a graph belong to one *model* (a graph break splits a model into graphs
    that are called in the same steps). Figures are kept per kind and reported per model, so a measured
    peak is always paired with the prediction for the step that was measured, never with another
    model's, and step times of two models are never one median.

Note: [A measured step belongs to one backend]
    The torch profiler sees every allocation of the process. A step of this backend during which another
    backend's graphs ran (two models whose forwards interleave) would count their memory as this step's,
    far above the prediction. So a measurement records how many forwards the process and this backend
    made while it ran (``teraio.lifecycle.registry``), and is discarded and tried again on a later step when another
    backend's forward ran inside it; after ``MAX_FOREIGN_ATTEMPTS`` such steps a model is reported
    unmeasured, with the reason.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

#: Steps of a model in which another backend's forwards ran, before it is reported unmeasured.
MAX_FOREIGN_ATTEMPTS = 8


@dataclass
class Measurement:
    """A measured step: its peak and the composed prediction for the same calls under the plans then."""

    step: int
    kind: frozenset[int]
    peak_bytes: int
    predicted_peak_bytes: int | None
    plan_generation: int


@dataclass
class KindStats:
    """Figures of the steps of one kind (the set of graph ids a step called)."""

    steps: int = 0
    step_times_s: list[float] = field(default_factory=list)  # running steps only
    last_calls: list[tuple[Any, str, int]] = field(default_factory=list)  # (graph, "fwd"|"bwd", invocation)


class StepStats:
    """Per kind and per model (Note: [Models of one backend])."""

    def __init__(self) -> None:
        self.kinds: dict[frozenset[int], KindStats] = {}
        self.measurements: dict[frozenset[int], Measurement] = {}
        self.foreign_attempts: dict[frozenset[int], int] = {}
        self.last_kind: frozenset[int] | None = None

    @staticmethod
    def kind_of(calls: Iterable[tuple[Any, Any, int]]) -> frozenset[int]:
        return frozenset(g.graph_id for g, _, _ in calls)

    def step_ended(self, calls: list[tuple[Any, str, int]], step_s: float | None) -> frozenset[int]:
        """A complete step with no abandoned invocation: count it (and its time, when it ran every graph's
        final compilation)."""
        kind = self.kind_of(calls)
        ks = self.kinds.setdefault(kind, KindStats())
        ks.steps += 1
        ks.last_calls = list(calls)
        if step_s is not None:
            ks.step_times_s.append(step_s)
        self.last_kind = kind
        return kind

    def add_time(self, kind: frozenset[int], step_s: float) -> None:
        self.kinds.setdefault(kind, KindStats()).step_times_s.append(step_s)

    def needs_measurement(self, generation: Callable[[frozenset[int]], int]) -> bool:
        """Whether a known kind has no measurement under its current plans (nor has given up)."""
        return any(
            (m := self.measurements.get(k)) is None or m.plan_generation != generation(k)
            for k in self.kinds
            if self.foreign_attempts.get(k, 0) < MAX_FOREIGN_ATTEMPTS
        )

    def foreign(self, kind: frozenset[int]) -> None:
        """A measurement of ``kind`` was discarded: another backend's forward ran inside it."""
        self.foreign_attempts[kind] = self.foreign_attempts.get(kind, 0) + 1

    def models(self, links: Iterable[frozenset[int]] = ()) -> list[frozenset[int]]:
        """Kinds joined into models, ordered by their smallest graph id: graphs called in the same steps are
        one model (kinds that share a graph), and so are the graphs of each of ``links`` (graphs that
        compute with the same parameters: one model's shapes)."""
        groups: list[set[int]] = []
        for kind in [*self.kinds, *links]:
            merged = set(kind)
            rest = []
            for g in groups:
                if g & merged:
                    merged |= g
                else:
                    rest.append(g)
            groups = [*rest, merged]
        known = {g for k in self.kinds for g in k}
        return sorted((frozenset(g) for g in groups if g & known), key=min)

    def summary(
        self, model: frozenset[int], moved_bytes_of: Callable[[list[tuple[Any, str, int]]], int]
    ) -> dict:
        """One model's figures: steps, running steps, median step time, the latest measurement with the
        prediction for the same step, and the bytes its latest step kind moves per step."""
        kinds = [k for k in self.kinds if k <= model]
        times = [t for k in kinds for t in self.kinds[k].step_times_s]
        measured = [self.measurements[k] for k in kinds if k in self.measurements]
        # The step that bounds the model's memory: its largest measured peak, with that step's prediction.
        latest = max(measured, key=lambda m: m.peak_bytes) if measured else None
        recent = max(kinds, key=lambda k: self.kinds[k].steps) if kinds else None
        gave_up = [k for k in kinds if self.foreign_attempts.get(k, 0) >= MAX_FOREIGN_ATTEMPTS]
        return {
            "graphs": sorted(model),
            "steps": sum(self.kinds[k].steps for k in kinds),
            "running_steps": len(times),
            "step_s": statistics.median(times) if times else None,
            "measured_peak_bytes": latest.peak_bytes if latest else None,
            "predicted_peak_bytes": latest.predicted_peak_bytes if latest else None,
            "measured_step": latest.step if latest else None,
            "measure_note": (
                "another backend's graphs ran inside every step of this model: its memory cannot be told "
                "apart from theirs"
            )
            if latest is None and gave_up
            else None,
            "moved_bytes_per_step": moved_bytes_of(self.kinds[recent].last_calls) if recent else 0,
        }
