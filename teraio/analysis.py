"""Deprecated spelling of :mod:`teraio.tools.analysis` (the notebooks' toolbox), kept for this release."""

from __future__ import annotations

import warnings

from teraio.tools.analysis import *  # noqa: F403
from teraio.tools.analysis import __all__  # noqa: F401

warnings.warn(
    "teraio.analysis moved to teraio.tools.analysis: import it from there", DeprecationWarning, stacklevel=2
)
