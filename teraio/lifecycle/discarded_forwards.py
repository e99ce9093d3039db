"""Forwards whose outputs are thrown away before any backward: learned by call site, run without a plan.

Note: [Forwards never backpropagated move nothing]
    A training forward whose autograd graph is freed without a backward (a GAN's generator called once
    more for the discriminator's step, ``G(z).detach()``; a loss computed for logging) has its saved
    tensors written to disk by its plan and never read back: the I/O is pure waste, and on a busy disk it
    slows the forwards that do need it. Which forward that is cannot be known when it runs, but loops are
    regular: the same line of the loop does the same thing every step. So each running graph remembers,
    per call site (the chain of the user's frames that called it), whether its invocations from there got
    a backward. After ``ABANDONED_TO_SKIP`` consecutive invocations from a site ended without one, calls
    from that site run the graph's compilation without migration ops (its memory is freed with its
    autograd graph right after anyway); one of them that does get a backward puts the site back on the
    plan. A loop that alternates at one line stays on the plan.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading

import torch

#: Consecutive abandoned invocations from one call site before its calls run without the plan.
ABANDONED_TO_SKIP = 2
#: How many of the user's frames identify a call site.
SITE_FRAMES = 4


def _package_dirs(name: str) -> list[str]:
    """The directories a package's modules load from (``teraio.planner`` and ``teraio.runtime`` live in
    folders of their own), wherever its files sit: not "the directory of this file"."""
    spec = importlib.util.find_spec(name)
    locations = spec.submodule_search_locations if spec is not None else None
    return [os.path.abspath(d) + os.sep for d in (locations or [])]


#: Frames from these directories are torch's, teraio's or the threading module's, not the user's.
_SKIPPED_PREFIXES = (
    os.path.dirname(torch.__file__) + os.sep,
    *_package_dirs("teraio"),
    *_package_dirs("teraio.planner"),
    *_package_dirs("teraio.runtime"),
    os.path.dirname(threading.__file__) + os.sep,
)

Site = tuple[tuple[str, int], ...]


def call_site() -> Site:
    """The user's frames that made this call (innermost first), torch's and teraio's frames left out."""
    frames: list[tuple[str, int]] = []
    f = sys._getframe(1)
    while f is not None and len(frames) < SITE_FRAMES:
        name = f.f_code.co_filename
        if not name.startswith(_SKIPPED_PREFIXES) and not name.startswith("<"):
            frames.append((name, f.f_lineno))
        f = f.f_back
    return tuple(frames)


class SiteMemory:
    """Per call site of one graph: how its last invocations ended (Note: [Forwards never backpropagated
    move nothing]). ``ended`` runs in finalizers and backward hooks: it only updates a dict entry."""

    def __init__(self) -> None:
        self._abandoned: dict[Site, int] = {}  # consecutive invocations ended without a backward

    def skip_plan(self, site: Site) -> bool:
        """Whether calls from ``site`` should run without migration ops."""
        return self._abandoned.get(site, 0) >= ABANDONED_TO_SKIP

    def ended(self, site: Site, abandoned: bool) -> None:
        self._abandoned[site] = self._abandoned.get(site, 0) + 1 if abandoned else 0

    @property
    def skipped_sites(self) -> int:
        return sum(1 for n in self._abandoned.values() if n >= ABANDONED_TO_SKIP)
