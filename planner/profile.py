"""The Profile: what one captured training step looked like, in a form the planner can reason about.

A Profile is produced by ``teraio`` (which traces and times a real step) or by ``planner.synth`` (a
synthetic transformer), and consumed by the planner. It is deliberately torch-free: two pandas tables
plus a small ``meta`` dict, saved as a directory of parquet files and ``meta.json``.

Index convention (shared by every consumer): ``ops.idx`` numbers the step's ops in execution order,
forward first (``0 .. num_fwd_ops-1``), then backward. A tensor produced by a graph input (parameter
or batch) has ``producer_idx == -1``. Use indices that never happened are ``-1``:
``first_bwd_use_idx == -1`` means backward never reads the tensor.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import pandas as pd

from teraio.planner.limits import (
    MAX_OP_US,
    MAX_ROWS,
    MAX_SECONDS,
    MAX_STEP_NBYTES,
    MAX_TABLE_FILE_NBYTES,
    MAX_TENSOR_NBYTES,
)
from teraio.planner.safe_io import InputError, PrivateDir, load_json, read_input, replace_dir

SCHEMA_VERSION = 1

#: Required columns and the pandas dtype kind each must have ("i" int, "f" float, "O"/"U" str, "b" bool).
OPS_COLUMNS: dict[str, str] = {
    "idx": "i",
    "name": "O",
    "target": "O",
    "phase": "O",
    "duration_us": "f",
}
#: Optional ops columns: ``module`` is the nn.Module path the op came from ("blocks.3.attn"), "" if none;
#: ``other_bytes`` is the memory live while the op runs that the tensors table does not account for
#: (temporaries, gradients, workspace): the unplanned memory at op i is ``other_bytes[i]`` plus every
#: tensors-table storage alive at i (activations over [producer_idx, last_use_idx], params and inputs
#: over the whole step).
OPS_OPTIONAL: dict[str, str] = {"module": "O", "other_bytes": "i"}

TENSORS_COLUMNS: dict[str, str] = {
    "name": "O",
    "nbytes": "i",
    "dtype": "O",
    "shape": "O",
    "kind": "O",
    "offloadable": "b",
    "producer_idx": "i",
    "last_fwd_use_idx": "i",
    "first_bwd_use_idx": "i",
    "last_use_idx": "i",
}
#: Optional tensors columns: ``module`` of the producer; ``aliases`` = saved outputs sharing the storage;
#: and the rebuild recipe of a saved tensor, absent = nothing recomputable:
#:
#: - ``recompute_us`` (float): compute time to rebuild the tensor in backward from its recompute inputs
#:   (the forward ops between them and it). NaN = it cannot be recomputed.
#: - ``recompute_inputs`` (list of str): names of other rows the rebuild reads. Activation rows must then
#:   be resident when it runs (kept, fetched or rebuilt first); param and input rows always are.
#: - ``recompute_peak_bytes`` (int): the most bytes the rebuild holds beyond its inputs and its result
#:   (the intermediates between them).
TENSORS_OPTIONAL: dict[str, str] = {
    "module": "O",
    "aliases": "i",
    "recompute_us": "f",
    "recompute_inputs": "O",
    "recompute_peak_bytes": "i",
}
#: The recompute columns (all optional; see ``TENSORS_OPTIONAL``).
RECOMPUTE_COLUMNS = ("recompute_us", "recompute_inputs", "recompute_peak_bytes")

PHASES = ("fwd", "bwd")
KINDS = ("activation", "param", "input")
META_REQUIRED = ("schema_version", "fingerprint", "num_fwd_ops")


class ProfileError(ValueError):
    """A profile is missing, malformed, or inconsistent. The message names what and where."""


#: Meta keys holding seconds, byte counts and counts (checked when present: ``Profile._validate_bounds``).
_META_SECONDS = ("step_s", "fwd_s", "bwd_s", "outside_s")
_META_NBYTES = ("census_peak_bytes", "census_after_fwd_bytes")
_META_COUNTS = ("graph_id", "num_saved_outputs")


def _real(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return (
        isinstance(value, (int, float, np.integer, np.floating))
        and not isinstance(value, bool)
        and (math.isfinite(value))
    )


def _whole(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _meta_int(meta: dict[str, Any], key: str) -> int:
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ProfileError(f"profile meta '{key}' is {value!r}, expected an integer")
    return int(value)


def _check_columns(df: pd.DataFrame, table: str, required: dict[str, str], optional: dict[str, str]) -> None:
    for col, kind in {**required, **optional}.items():
        if col not in df.columns:
            if col in required:
                raise ProfileError(f"profile table '{table}' lacks column '{col}'")
            continue
        actual = df[col].dtype.kind
        ok = actual == kind or (kind == "O" and actual in "OUT") or (kind == "f" and actual in "fi")
        if kind == "O" and pd.api.types.is_string_dtype(df[col].dtype):
            ok = True
        if not ok:
            raise ProfileError(
                f"profile table '{table}' column '{col}' has dtype {df[col].dtype}, expected kind '{kind}'"
            )


@dataclass
class Profile:
    """One captured graph's step: ``ops`` and ``tensors`` tables plus ``meta`` (see module docstring)."""

    ops: pd.DataFrame
    tensors: pd.DataFrame
    meta: dict[str, Any] = field(default_factory=dict)

    # ----------------------------------------------------------------------------------------- checks
    def validate(self) -> Profile:
        """Check schema and index consistency; raise ProfileError naming the first problem found."""
        _check_columns(self.ops, "ops", OPS_COLUMNS, OPS_OPTIONAL)
        _check_columns(self.tensors, "tensors", TENSORS_COLUMNS, TENSORS_OPTIONAL)
        if not isinstance(self.meta, dict):
            raise ProfileError("profile meta must be a JSON object")
        for key in META_REQUIRED:
            if key not in self.meta:
                raise ProfileError(f"profile meta lacks '{key}'")
        version = _meta_int(self.meta, "schema_version")
        if version != SCHEMA_VERSION:
            raise ProfileError(
                f"profile schema_version {version} is not supported "
                f"(this teraio reads {SCHEMA_VERSION}); re-profile with this version"
            )
        if not isinstance(self.meta["fingerprint"], str) or not self.meta["fingerprint"]:
            raise ProfileError("profile meta 'fingerprint' must be a non-empty string")
        n_ops = len(self.ops)
        nf_meta = _meta_int(self.meta, "num_fwd_ops")
        if not 0 <= nf_meta <= n_ops:
            raise ProfileError(f"profile meta 'num_fwd_ops' is {nf_meta}, expected 0..{n_ops} (the op count)")
        for table, df, cols in (
            ("ops", self.ops, ("duration_us", "other_bytes")),
            ("tensors", self.tensors, ("nbytes",)),
        ):
            for col in cols:
                if col in df.columns and not np.isfinite(df[col].to_numpy(dtype="float64")).all():
                    raise ProfileError(
                        f"profile table '{table}' column '{col}' has NaN or infinite values; expected "
                        f"finite numbers"
                    )
        if "other_bytes" in self.ops.columns and (self.ops["other_bytes"] < 0).any():
            raise ProfileError("profile table 'ops' column 'other_bytes' has negative values")
        n = len(self.ops)
        if list(self.ops["idx"]) != list(range(n)):
            raise ProfileError("profile table 'ops' column 'idx' must be 0..N-1 in execution order")
        bad_phase = set(self.ops["phase"]) - set(PHASES)
        if bad_phase:
            raise ProfileError(f"profile table 'ops' column 'phase' has values {sorted(bad_phase)}")
        nf = int(self.meta["num_fwd_ops"])
        if (
            not (self.ops["phase"].iloc[:nf] == "fwd").all()
            or not (self.ops["phase"].iloc[nf:] == "bwd").all()
        ):
            raise ProfileError(
                "profile ops must be all 'fwd' then all 'bwd' (meta num_fwd_ops marks the split)"
            )
        if (self.ops["duration_us"] < 0).any():
            raise ProfileError("profile table 'ops' column 'duration_us' has negative values")
        # Note: [An offloaded tensor leaves a token] in planner.lifetimes
        if "offload_token_bytes" in self.meta:
            token = self.meta["offload_token_bytes"]
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ProfileError(
                    f"profile meta 'offload_token_bytes' is {token!r}, expected a whole number of bytes >= 0"
                )
        if "model_states" in self.meta:  # a states="offload" run's (teraio.planner.model_states)
            from teraio.planner.model_states import ModelStateError, check_states_record

            try:
                check_states_record(self.meta["model_states"])
            except ModelStateError as exc:
                raise ProfileError(f"profile meta: {exc}") from None
        outside = self.meta.get("outside_s", 0.0)
        if isinstance(outside, bool) or not isinstance(outside, (int, float)) or not 0 <= outside < math.inf:
            raise ProfileError(
                f"profile meta 'outside_s' is {outside!r}, expected a finite number of seconds >= 0"
            )
        t = self.tensors
        if t["name"].duplicated().any():
            dup = t.loc[t["name"].duplicated(), "name"].iloc[0]
            raise ProfileError(f"profile table 'tensors' has duplicate name '{dup}'")
        bad_kind = set(t["kind"]) - set(KINDS)
        if bad_kind:
            raise ProfileError(f"profile table 'tensors' column 'kind' has values {sorted(bad_kind)}")
        if (t["nbytes"] < 0).any():
            raise ProfileError("profile table 'tensors' column 'nbytes' has negative values")
        if (t["offloadable"] & (t["kind"] != "activation")).any():
            raise ProfileError("profile table 'tensors': only kind 'activation' may be offloadable")
        for col in ("producer_idx", "last_fwd_use_idx", "first_bwd_use_idx", "last_use_idx"):
            if ((t[col] < -1) | (t[col] >= n)).any():
                raise ProfileError(f"profile table 'tensors' column '{col}' has indices outside -1..{n - 1}")
        act = t[t["offloadable"]]
        if (act["producer_idx"] >= nf).any() or (act["producer_idx"] < 0).any():
            raise ProfileError("profile: an offloadable tensor must be produced by a forward op")
        if (act["last_fwd_use_idx"] < act["producer_idx"]).any():
            raise ProfileError("profile: last_fwd_use_idx precedes producer_idx")
        used_bwd = act[act["first_bwd_use_idx"] >= 0]
        if (used_bwd["first_bwd_use_idx"] < nf).any():
            raise ProfileError("profile: first_bwd_use_idx must be a backward op")
        if (used_bwd["last_use_idx"] < used_bwd["first_bwd_use_idx"]).any():
            raise ProfileError("profile: last_use_idx precedes first_bwd_use_idx")
        self._validate_recompute()
        self._validate_bounds()
        return self

    def _validate_bounds(self) -> None:
        """Every number within ``planner.limits``: sizes, counts and times beyond them are corrupt input
        (a tensor of 2**62 bytes wrapped the planner's int64 sums silently)."""
        for table, df in (("ops", self.ops), ("tensors", self.tensors)):
            if len(df) > MAX_ROWS:
                raise ProfileError(
                    f"profile table '{table}' has {len(df)} rows, more than the {MAX_ROWS} allowed"
                )
        for table, df, col, hi, what in (
            ("tensors", self.tensors, "nbytes", MAX_TENSOR_NBYTES, "bytes per tensor"),
            ("tensors", self.tensors, "recompute_peak_bytes", MAX_STEP_NBYTES, "bytes"),
            ("ops", self.ops, "other_bytes", MAX_STEP_NBYTES, "bytes"),
            ("ops", self.ops, "duration_us", MAX_OP_US, "microseconds per op"),
            ("tensors", self.tensors, "recompute_us", MAX_OP_US, "microseconds per op"),
        ):
            if col not in df.columns:
                continue
            values = df[col].to_numpy(dtype="float64")  # floats: no int64 wrap while checking
            over = values > hi
            if over.any():
                row = int(np.argmax(over))
                raise ProfileError(
                    f"profile table '{table}' column '{col}' is {values[row]:.6g} at row {row}; at most "
                    f"{hi:.0f} {what} are accepted"
                )
        total = float(self.tensors["nbytes"].to_numpy(dtype="float64").sum())
        if total > MAX_STEP_NBYTES:
            raise ProfileError(
                f"profile table 'tensors' holds {total:.0f} bytes in all, more than the {MAX_STEP_NBYTES} "
                f"bytes (64 PiB) of a step teraio accepts"
            )
        for key, value in self.meta.items():
            if key in _META_SECONDS:
                ok = _real(value) and 0 <= value <= MAX_SECONDS
                expected = f"a finite number of seconds in 0..{MAX_SECONDS:.0e}"
            elif key in _META_NBYTES:
                ok = _whole(value) and 0 <= value <= MAX_STEP_NBYTES
                expected = f"an integer number of bytes in 0..{MAX_STEP_NBYTES}"
            elif key in _META_COUNTS:
                ok = _whole(value) and 0 <= value <= MAX_ROWS
                expected = f"an integer in 0..{MAX_ROWS}"
            elif key == "param_positions":
                ok = isinstance(value, list) and all(_whole(v) and 0 <= v <= MAX_ROWS for v in value)
                expected = f"a list of integers in 0..{MAX_ROWS}"
            else:
                continue
            if not ok:
                raise ProfileError(f"profile meta '{key}' is {value!r}, expected {expected}")

    def _validate_recompute(self) -> None:
        """The recompute columns: costs finite and non-negative (or NaN), inputs naming other existing
        rows, and no rebuild that needs itself, directly or through a chain."""
        t = self.tensors
        if "recompute_us" in t.columns:
            us = t["recompute_us"].to_numpy(dtype="float64")
            bad = np.isinf(us) | (us < 0)
            if bad.any():
                row = t["name"].iat[int(np.argmax(bad))]
                raise ProfileError(
                    f"profile table 'tensors' column 'recompute_us' is {us[bad][0]!r} for row '{row}'; "
                    f"expected a finite number >= 0 or NaN (cannot be recomputed)"
                )
        if "recompute_peak_bytes" in t.columns and (t["recompute_peak_bytes"] < 0).any():
            row = t.loc[t["recompute_peak_bytes"] < 0, "name"].iat[0]
            raise ProfileError(
                f"profile table 'tensors' column 'recompute_peak_bytes' is negative for row '{row}'"
            )
        if "recompute_inputs" not in t.columns:
            return
        names = set(t["name"].astype(str))
        recomputable = (
            np.isfinite(t["recompute_us"].to_numpy(dtype="float64"))
            if "recompute_us" in t.columns
            else np.zeros(len(t), dtype=bool)
        )
        edges: dict[str, list[str]] = {}
        for k, (name, inputs) in enumerate(zip(t["name"].astype(str), t["recompute_inputs"])):
            inputs = recompute_inputs_of(inputs)
            if inputs is None:
                raise ProfileError(
                    f"profile table 'tensors' column 'recompute_inputs' of row '{name}' is "
                    f"{t['recompute_inputs'].iat[k]!r}; expected a list of tensor names"
                )
            for x in inputs:
                if x == name:
                    raise ProfileError(
                        f"profile table 'tensors' column 'recompute_inputs' of row '{name}' names the row "
                        f"itself; a tensor cannot be rebuilt from itself"
                    )
                if x not in names:
                    raise ProfileError(
                        f"profile table 'tensors' column 'recompute_inputs' of row '{name}' names '{x}', "
                        f"which is not a row of the tensors table"
                    )
            if recomputable[k]:
                edges[name] = list(inputs)
        # A chain of rebuilds that comes back to where it started would need a tensor to rebuild itself.
        state: dict[str, int] = {}  # 1: on the current path, 2: done
        for root in edges:
            if state.get(root):
                continue
            stack = [(root, iter(edges[root]))]
            state[root] = 1
            while stack:
                node, it = stack[-1]
                nxt = next(it, None)
                if nxt is None:
                    state[node] = 2
                    stack.pop()
                elif nxt in edges:
                    if state.get(nxt) == 1:
                        raise ProfileError(
                            f"profile table 'tensors' column 'recompute_inputs': row '{nxt}' is rebuilt "
                            f"from itself through a chain of rebuilds (cycle through '{node}')"
                        )
                    if not state.get(nxt):
                        state[nxt] = 1
                        stack.append((nxt, iter(edges[nxt])))

    # ------------------------------------------------------------------------------------ conveniences
    @property
    def has_recompute(self) -> bool:
        """Whether any row can be recomputed (a finite ``recompute_us``)."""
        t = self.tensors
        return "recompute_us" in t.columns and bool(np.isfinite(t["recompute_us"].to_numpy(float)).any())

    @property
    def fingerprint(self) -> str:
        return str(self.meta["fingerprint"])

    @property
    def num_fwd_ops(self) -> int:
        return int(self.meta["num_fwd_ops"])

    @property
    def outside_s(self) -> float:
        """Seconds per step the compute thread spends outside the graph's ops (meta ``outside_s``, 0
        when absent). Note: [Time outside the graphs] in planner.lifetimes."""
        return float(self.meta.get("outside_s", 0.0))

    def activation_bytes(self) -> int:
        """Total bytes of saved activation storages (the offload candidates' upper bound)."""
        return int(self.tensors.loc[self.tensors["kind"] == "activation", "nbytes"].sum())

    # ---------------------------------------------------------------------------------------- file io
    def save(self, out_dir: str | os.PathLike, *, force: bool = False) -> Path:
        """Write ``ops.parquet``, ``tensors.parquet`` and ``meta.json`` into ``out_dir``, atomically.

        The files are written into a fresh sibling directory that is then renamed into place, so an
        interrupted save never leaves a half-written profile. An existing ``out_dir`` is replaced only if
        it is empty or holds a profile (only a profile's files); any other directory needs ``force``
        and is then moved aside, never deleted (see ``planner.safe_dirs.replace_dir``).

        Raises:
            OutputError: ``out_dir`` is not a profile and ``force`` is False.
            ProfileError: the profile is invalid (nothing is written).
        """
        self.validate()
        return replace_dir(out_dir, "profile", self.write_files, force=force)

    def write_files(self, directory: Path) -> None:
        """Write the three files into an existing private ``directory`` (used by :meth:`save`)."""
        self._write(lambda name: open(directory / name, "wb"))  # noqa: SIM115 - closed by _write

    def write_into(self, directory: PrivateDir) -> None:
        """Write the three files into a private directory held by its descriptor (a run directory's
        ``graphN/profile``: ``planner.private_dir.PrivateDir.replace_subdir``), each created 0600 with
        ``O_EXCL|O_NOFOLLOW`` relative to it."""
        self._write(directory.open_new)

    def _write(self, open_new: Callable[[str], IO[bytes]]) -> None:
        with open_new("ops.parquet") as f:
            self.ops.to_parquet(f, index=False)
        tensors = self.tensors.copy()
        tensors["shape"] = tensors["shape"].map(lambda s: [int(x) for x in s])
        if "recompute_inputs" in tensors.columns:
            tensors["recompute_inputs"] = tensors["recompute_inputs"].map(
                lambda s: [str(x) for x in recompute_inputs_of(s) or ()]
            )
        with open_new("tensors.parquet") as f:
            tensors.to_parquet(f, index=False)
        with open_new("meta.json") as f:
            f.write(json.dumps(self.meta, indent=2, sort_keys=True, default=str).encode())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        """Read a profile directory written by ``save``; raise ProfileError naming what is wrong."""
        p = Path(path)
        if not p.exists():
            raise ProfileError(f"profile '{p}' does not exist")
        if not p.is_dir():
            raise ProfileError(
                f"profile '{p}' is not a directory (expected ops.parquet, tensors.parquet, meta.json)"
            )
        for fname in ("ops.parquet", "tensors.parquet", "meta.json"):
            if not os.path.lexists(p / fname):
                raise ProfileError(f"profile '{p}' lacks {fname}")
        # Regular files only, read up to a limit (a FIFO blocked, a link to /dev/zero read without end).
        try:
            meta = load_json(p / "meta.json", what="profile meta")
            tables = [
                read_input(p / name, limit_nbytes=MAX_TABLE_FILE_NBYTES, what="profile table")
                for name in ("ops.parquet", "tensors.parquet")
            ]
        except InputError as e:
            raise ProfileError(str(e)) from None
        if not isinstance(meta, dict):
            raise ProfileError(f"profile '{p}/meta.json' must hold a JSON object")
        try:
            ops, tensors = (pd.read_parquet(io.BytesIO(data)) for data in tables)
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise ProfileError(f"profile '{p}' has an unreadable parquet table: {e}") from None
        try:
            if "shape" in tensors.columns:
                tensors["shape"] = tensors["shape"].map(lambda s: tuple(int(x) for x in s))
            if "recompute_inputs" in tensors.columns:
                tensors["recompute_inputs"] = tensors["recompute_inputs"].map(_inputs_or_raw)
            return cls(ops=ops, tensors=tensors, meta=meta).validate()
        except ProfileError as e:
            raise ProfileError(f"profile '{p}': {e}") from None
        except (TypeError, ValueError) as e:  # a column whose values are not what its dtype promised
            raise ProfileError(f"profile '{p}' has malformed values: {e}") from None


def recompute_inputs_of(value: Any) -> tuple[str, ...] | None:
    """A ``recompute_inputs`` cell as a tuple of names: a list, tuple or array of strings; None/NaN is
    empty. None when the cell is anything else (the caller reports it)."""
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return ()
    if isinstance(value, (str, bytes)):
        return None
    if isinstance(value, (list, tuple, np.ndarray)):
        if all(isinstance(x, str) for x in value):
            return tuple(value)
    return None


def _inputs_or_raw(value: Any) -> Any:
    """Parquet hands lists back as arrays: make them tuples, leave malformed cells for ``validate``."""
    out = recompute_inputs_of(value)
    return value if out is None else out


def make_profile(
    ops: list[dict[str, Any]] | pd.DataFrame,
    tensors: list[dict[str, Any]] | pd.DataFrame,
    meta: dict[str, Any],
) -> Profile:
    """Build and validate a Profile from row dicts (or frames), filling schema defaults.

    ``meta`` needs at least ``fingerprint``; ``schema_version`` and ``num_fwd_ops`` are derived when
    absent.
    """
    ops_df = pd.DataFrame(ops) if not isinstance(ops, pd.DataFrame) else ops.copy()
    t_df = pd.DataFrame(tensors) if not isinstance(tensors, pd.DataFrame) else tensors.copy()
    if ops_df.empty:
        ops_df = pd.DataFrame(
            {
                c: pd.Series(dtype="int64" if k == "i" else "float64" if k == "f" else "object")
                for c, k in OPS_COLUMNS.items()
            }
        )
    if t_df.empty:
        t_df = pd.DataFrame(
            {
                c: pd.Series(dtype={"i": "int64", "b": "bool"}.get(k, "object"))
                for c, k in TENSORS_COLUMNS.items()
            }
        )
    ops_df["duration_us"] = ops_df["duration_us"].astype("float64")
    if "offloadable" not in t_df.columns:
        t_df["offloadable"] = (t_df["kind"] == "activation") & (t_df["nbytes"] > 0)
    for col in ("nbytes", "producer_idx", "last_fwd_use_idx", "first_bwd_use_idx", "last_use_idx"):
        t_df[col] = t_df[col].astype("int64")
    t_df["offloadable"] = t_df["offloadable"].astype(bool)
    if "shape" in t_df.columns:
        t_df["shape"] = t_df["shape"].map(lambda s: tuple(int(x) for x in s))
    if any(c in t_df.columns for c in RECOMPUTE_COLUMNS):
        # One recompute column implies the others with their "nothing to rebuild" defaults.
        if "recompute_us" not in t_df.columns:
            t_df["recompute_us"] = np.nan
        t_df["recompute_us"] = t_df["recompute_us"].astype("float64")
        if "recompute_inputs" not in t_df.columns:
            t_df["recompute_inputs"] = [() for _ in range(len(t_df))]
        t_df["recompute_inputs"] = t_df["recompute_inputs"].map(_inputs_or_raw)
        if "recompute_peak_bytes" not in t_df.columns:
            t_df["recompute_peak_bytes"] = 0
        t_df["recompute_peak_bytes"] = t_df["recompute_peak_bytes"].fillna(0).astype("int64")
    meta = dict(meta)
    meta.setdefault("schema_version", SCHEMA_VERSION)
    meta.setdefault("num_fwd_ops", int((ops_df["phase"] == "fwd").sum()))
    return Profile(
        ops=ops_df.reset_index(drop=True), tensors=t_df.reset_index(drop=True), meta=meta
    ).validate()
