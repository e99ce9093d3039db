"""teraio under a process group: 2 ranks on gloo (torch.multiprocessing.spawn), the tiny GPT.

Each run with a memory budget is compared, rank by rank, with the same distributed run with
``enabled=False``: every loss, every gradient and the final parameters bit-identical; every rank offloads
and reads back, reports its own figures, and its measured step peak is within 5% of its prediction; no
file is left in any rank's offload directory, also after a rank was killed with SIGKILL and the job was
run again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

from .dist_worker import rendezvous_file, worker
from .shared import once_per_run

WORLD = 2


def _run(mode: str, enableds: list, tmp_path: Path, **options) -> list[list[dict]]:
    """One spawn of the job; per value of ``enableds`` (``dist_worker.worker``'s), every rank's result."""
    dirs = options.setdefault("offload_dirs", [str(tmp_path / "off-{local_rank}")])
    options["offload_dirs_resolved"] = [[d.format(local_rank=r, rank=r) for d in dirs] for r in range(WORLD)]
    out = tmp_path / "results"
    out.mkdir(exist_ok=True)
    args = (WORLD, rendezvous_file(tmp_path), mode, enableds, str(out), options)
    mp.spawn(worker, args=args, nprocs=WORLD, join=True)
    return _results(out, mode, enableds)


def _results(out: Path, mode: str, enableds: list) -> list[list[dict]]:
    names = [str(int(e)) if isinstance(e, bool) else e[0] for e in enableds]
    return [[json.loads((out / f"{mode}-{n}-{r}.json").read_text()) for r in range(WORLD)] for n in names]


def _check(mode: str, tmp_path: Path, **options) -> list[dict]:
    reference, results = _run(mode, [False, True], tmp_path, **options)
    return _assert_exact_and_planned(reference, results)


def _assert_exact_and_planned(reference: list[dict], results: list[dict]) -> list[dict]:
    for rank, (got, want) in enumerate(zip(results, reference)):
        assert got["losses"] == want["losses"], f"rank {rank}: losses differ"
        assert got["grads"] == want["grads"], f"rank {rank}: gradients differ"
        assert got["params"] == want["params"], f"rank {rank}: parameters differ"
        st = got["stats"]
        assert st["moved_bytes_per_step"] > 0 and st["running_steps"] > 0, (rank, st)
        assert st["offloaded_bytes"] > 0 and st["prefetched_bytes"] == st["offloaded_bytes"], (rank, st)
        assert st["measured_peak_bytes"] is not None, (rank, st)
        assert (
            abs(st["measured_peak_bytes"] - st["predicted_peak_bytes"]) <= 0.05 * st["predicted_peak_bytes"]
        ), (rank, st)
        assert got["leftover_files"] == [], (rank, got["leftover_files"])
    assert results[0]["losses"] != results[1]["losses"]  # each rank trained on its own batches
    return results


# Note: [One DDP job, several runs]
#     A job costs two process starts and a reference run on each rank. The runs of DDP without graph
#     splitting (activations only, AdamW's states on disk, the parameters on disk too) are one job: one
#     reference with ``enabled=False`` (which offloads nothing, states or parameters: test_states.py's
#     test_enabled_false_offloads_nothing), then each configuration, 8 steps each (the parameters need
#     them: test_ddp_with_the_parameters_on_disk), each backend closed before the next starts, and last a
#     budget no rank can meet, which ends the job. It runs once per test run (tests.teraio.shared),
#     whichever xdist worker asks first.
NOSPLIT_RUNS = [
    ("reference", False, {}),
    ("activations", True, {}),
    # Note: [The whole-step budget keeps some states in memory] in teraio.states.residency: the budget is of
    # the whole step; at half of it the graphs still move activations beside the resident parameters.
    ("states", True, {"states": "offload", "budget": "50%"}),
    # The parameters' run saves a checkpoint after step 4; "resumed" starts fresh processes' worth of
    # objects (a meta model, a new optimizer and backend) from it and trains steps 4-7 (Note: [A checkpoint
    # of a DDP job] in teraio.states.checkpoint).
    (
        "parameters",
        True,
        {"states": "offload", "offload_parameters": True, "budget": "35%", "save_at": 4, "save_to": "ckpt"},
    ),
    (
        "resumed",
        True,
        {
            "states": "offload",
            "offload_parameters": True,
            "budget": "35%",
            "resume": "ckpt",
            "first": 4,
            "refused_save": "ckpt-refused",
        },
    ),
]
UNMET_BUDGET = ("unmet-budget", True, {"budget": "4096"})


def _job_ending_in_a_refusal(
    tmp_path_factory, mode: str, runs: list, last: tuple, refusal: str
) -> dict[str, Any]:
    """One job of ``runs`` then ``last``, which must be refused with ``refusal`` (a rank's error ends the job
    on every rank: Note: [Ranks agree at the start of every step] in teraio.lifecycle.ranks), 8 steps each,
    once per test run: each run's results by name, and the refusal's message (None: ran to its end)."""

    def job() -> dict[str, Any]:
        tmp = tmp_path_factory.mktemp(mode)
        refused = None
        try:
            _run(mode, [*runs, last], tmp, steps=8)
        except mp.ProcessRaisedException as e:
            if refusal not in str(e):
                raise
            refused = str(e)
        results = _results(tmp / "results", mode, runs)
        return {"refused": refused, "dir": str(tmp), **{name: r for (name, _, _), r in zip(runs, results)}}

    return once_per_run(f"distributed-{mode}-job", job)


@pytest.fixture
def nosplit_job(tmp_path_factory) -> dict[str, Any]:
    return _job_ending_in_a_refusal(
        tmp_path_factory, "ddp-nosplit", NOSPLIT_RUNS, UNMET_BUDGET, "cannot be met"
    )


def _nosplit(job: dict[str, Any], name: str) -> list[dict]:
    return _assert_exact_and_planned(job["reference"], job[name])


def test_ddp_with_graph_splitting(tmp_path) -> None:
    """DDP with Dynamo's graph splitting: one graph per gradient bucket, each first called on fake tensors
    (Note: [DDP's fake first call] in teraio.lifecycle.runner)."""
    results = _check("ddp-split", tmp_path)
    assert all(r["stats"]["graphs"] > 1 for r in results)


@pytest.mark.expensive  # by hand: two ranks compiling with Inductor and planning with CP-SAT, minutes of CPU
@pytest.mark.xfail(
    strict=True,
    reason="found 2026-11-29, not yet understood: exact and planned, but rank 0's measured step peak is 29% "
    "below its prediction (292,808 B for 414,976 B)",
)
def test_ddp_with_graph_splitting_on_inductor_with_the_ilp(tmp_path) -> None:
    """What docs/guide.md's DDP example runs by default (the suite runs that example on the FX path). It
    found the reference run compiling a graph while the planned run's waited for the step's other graphs
    (Note: [The step is planned once every graph it calls is profiled]): the losses then differed in
    their last bits; and the pieces after the first never planned (Note: [A graph that is never the
    step's first measures inside the step] in teraio.lifecycle.runner_profiling)."""
    results = _check("ddp-split", tmp_path, inner="inductor", solver="ilp", steps=16)
    assert all(r["stats"]["graphs"] > 1 for r in results)


def test_ddp_without_graph_splitting(nosplit_job) -> None:
    results = _nosplit(nosplit_job, "activations")
    assert all(r["stats"]["graphs"] == 1 for r in results)


# One job for compiled autograd under DDP, as for the runs without graph splitting (Note: [One DDP job,
# several runs]): the reference, the planned run (compiled autograd from step 2, which holds memory outside
# the graphs: two steps confirm it, one replans, hence 8 steps), and last compiled autograd from the first
# step, while teraio profiles, which every rank refuses and which ends the job.
COMPILED_AUTOGRAD_RUNS = [("reference", False, {}), ("planned", True, {})]
WHILE_PROFILING = ("while-profiling", True, {"compiled_autograd_from": 0})
REFUSED_WHILE_PROFILING = "compiled autograd ran its backward while teraio was profiling"


@pytest.fixture
def compiled_autograd_job(tmp_path_factory) -> dict[str, Any]:
    return _job_ending_in_a_refusal(
        tmp_path_factory,
        "ddp-compiled-autograd",
        COMPILED_AUTOGRAD_RUNS,
        WHILE_PROFILING,
        REFUSED_WHILE_PROFILING,
    )


def test_ddp_with_compiled_autograd(compiled_autograd_job) -> None:
    """DDP's python_reducer runs backward through compiled autograd, which keeps the partitioned backward
    graph teraio rewrote: the plan's reads happen (prefetched equals offloaded) and the run is exact."""
    results = _assert_exact_and_planned(compiled_autograd_job["reference"], compiled_autograd_job["planned"])
    assert all(r["compiled_autograd"].get("captures", 0) > 0 for r in results), [
        r["compiled_autograd"] for r in results
    ]


def test_ddp_with_the_optimizer_states_on_disk(nosplit_job) -> None:
    """states="offload" under DDP: each rank streams its own AdamW states through its own directory."""
    results = _nosplit(nosplit_job, "states")
    assert all(r["stats"]["moved_bytes_by_kind"]["optimizer_state"] > 0 for r in results)


def test_ddp_with_the_parameters_on_disk(nosplit_job) -> None:
    """offload_parameters under DDP: DDP's reducer hooks the same parameter objects, whose storage comes
    and goes (Note: [A parameter keeps its storage object] in teraio.states.params). The parameters a
    graph fetches are in its profile (Note: [Fetched parameters are the graph's memory] in
    teraio.states.residency); what the loop holds beside the graphs takes two measured steps to find, and the
    plans made then are measured on a later step, hence 8 steps."""
    results = _nosplit(nosplit_job, "parameters")
    assert all(r["stats"]["moved_bytes_by_kind"]["parameter"] > 0 for r in results)


def test_ddp_resumes_bit_identically_from_a_checkpoint_rank_0_wrote(nosplit_job) -> None:
    """Both ranks save (rank 0 writes, once), then load the same directory into a model built on the meta
    device and continue: losses, gradients and final parameters equal the uninterrupted run's."""
    saved, resumed = nosplit_job["parameters"], nosplit_job["resumed"]
    for rank, (got, want) in enumerate(zip(resumed, saved)):
        assert got["losses"] == want["losses"][4:], f"rank {rank}: losses differ"
        assert got["grads"] == want["grads"][4:], f"rank {rank}: gradients differ"
        assert got["params"] == want["params"], f"rank {rank}: parameters differ"
        kinds = got["stats"]["moved_bytes_by_kind"]
        assert kinds["parameter"] > 0 and kinds["optimizer_state"] > 0, (rank, kinds)
        assert got["leftover_files"] == [], (rank, got["leftover_files"])
    train_state = json.loads((Path(nosplit_job["dir"]) / "ckpt" / "train_state.json").read_text())
    assert train_state["world_size"] == 2 and len(train_state["rng_by_rank"]) == 2
    # A save only rank 1 refuses (a gradient pending there) raises on both ranks, and writes nothing.
    for got in resumed:
        assert got["refused_save"].startswith("CheckpointError: save_checkpoint failed on rank 1:"), got
        assert "have gradients" in got["refused_save"], got
    assert not (Path(nosplit_job["dir"]) / "ckpt-refused").exists()


# Note: [One FSDP2 job, several runs]
#     FSDP2 (``fully_shard`` per block and at the root, each block compiled on its own: torchtitan's order),
#     AdamW with gradients clipped, 8 steps per run: the gathered parameters live outside the graphs, and
#     two measured steps confirm that memory before the graphs are planned again with it (Note: [Memory
#     outside the graphs is measured and planned for] in teraio.lifecycle.measurement); the plans made
#     then are measured on a later step. One job: a reference with ``enabled=False`` per model, then the
#     activations alone, and the whole state (parameter shards, gradient shards and optimizer states) on
#     disk under a whole-step budget and without one (DTensor gradients and optimizer states on disk
#     without FSDP2's gathers are test_sharded_states.py's, on one rank); and the whole state with 2
#     micro-batches a step accumulated by FSDP2, bf16 compute and ``reshard_after_forward=False``, with
#     its reference. The whole-state run saves a checkpoint after step 3, which a second job resumes.
FSDP_RUNS = [
    ("reference", False, {}),
    ("activations", True, {"budget": "80%"}),
    ("whole", True, {"states": "whole", "budget": "50%", "save_at": 3}),
    ("whole-unbudgeted", True, {"states": "whole"}),
    ("llama-reference", False, {"model": "hf-llama"}),
    ("llama-whole", True, {"model": "hf-llama", "states": "whole", "budget": "50%"}),
    ("accumulated-reference", False, {"variant": "accumulated"}),
    ("accumulated-whole", True, {"variant": "accumulated", "states": "whole", "budget": "50%"}),
]


@pytest.fixture
def fsdp_job(tmp_path_factory) -> dict[str, Any]:
    def job() -> dict[str, Any]:
        tmp = tmp_path_factory.mktemp("fsdp-states")
        _run("fsdp-states", FSDP_RUNS, tmp, steps=8, clip=True, checkpoint=str(tmp / "ckpt-step3"))
        results = _results(tmp / "results", "fsdp-states", FSDP_RUNS)
        return {"dir": str(tmp), **{name: r for (name, _, _), r in zip(FSDP_RUNS, results)}}

    return once_per_run("distributed-fsdp-states-job", job)


def test_fsdp2_per_block_compilation(fsdp_job) -> None:
    """FSDP2 with each block compiled on its own: one graph, called once per block, its activations
    planned beside FSDP2's gathered parameters (Note: [One FSDP2 job, several runs])."""
    _assert_exact_and_planned(fsdp_job["reference"], fsdp_job["activations"])


def _assert_whole_step(reference: list[dict], results: list[dict], kinds: tuple[str, ...]) -> None:
    """Bit-identical to the reference (losses, gradients, full parameters, optimizer states); every rank
    moves bytes of each of ``kinds`` and holds its whole-step budget, measured within 5% of its
    prediction; nothing left on disk."""
    for rank, (got, want) in enumerate(zip(results, reference)):
        for key in ("losses", "grads", "params", "optimizer_states"):
            assert got[key] == want[key], f"rank {rank}: {key} differ"
    _assert_moved_within_budget(results, kinds)


def _assert_moved_within_budget(results: list[dict], kinds: tuple[str, ...]) -> None:
    for rank, got in enumerate(results):
        moved = got["stats"]["moved_bytes_by_kind"]
        assert all(moved[k] > 0 for k in kinds), (rank, moved)
        whole = got["whole_step"]
        budget, predicted, measured = (
            whole["budget_bytes"],
            whole["predicted_peak_bytes"],
            whole["measured_peak_bytes"],
        )
        assert got["leftover_files"] == [], (rank, got["leftover_files"])
        if budget is None:  # without a memory budget: everything that can move moves, nothing predicted
            assert measured is not None and predicted is None, (rank, whole)
            continue
        # The figures and what made the measured peak, whole: a dict this long is cut in the report.
        said = (
            f"rank {rank}: budget {budget}, predicted {predicted}, measured {measured} "
            f"(moments {whole.get('measured_moments')}, step {got['stats'].get('steps')})"
        )
        assert predicted <= budget, said
        assert measured is not None and abs(measured - predicted) <= 0.05 * predicted, said
        assert measured <= 1.01 * budget, said
    assert results[0]["losses"] != results[1]["losses"]  # each rank trained on its own batches


def test_fsdp2_whole_state_on_disk(fsdp_job) -> None:
    """Parameter shards, gradient shards and optimizer states on disk under FSDP2, gradients clipped while
    on disk: each shard read back before its all-gather (Note: [A shard is read back before its
    all-gather] in teraio.states.fsdp_shards)."""
    kinds = ("parameter", "gradient", "optimizer_state")
    _assert_whole_step(fsdp_job["reference"], fsdp_job["whole"], kinds)


def test_fsdp2_whole_state_on_disk_without_a_budget(fsdp_job) -> None:
    """No memory budget: every shard that can move moves, every step."""
    kinds = ("parameter", "gradient", "optimizer_state")
    _assert_whole_step(fsdp_job["reference"], fsdp_job["whole-unbudgeted"], kinds)


def test_fsdp2_whole_state_of_a_llama_shaped_model(fsdp_job) -> None:
    kinds = ("parameter", "gradient", "optimizer_state")
    _assert_whole_step(fsdp_job["llama-reference"], fsdp_job["llama-whole"], kinds)


def test_fsdp2_accumulated_micro_batches_in_bf16_with_the_whole_state_on_disk(fsdp_job) -> None:
    """FSDP2 adds the second micro-batch's gradient into the sharded gradient on disk (Note: [FSDP2
    accumulates into the local shard] in teraio.states.grad_norms); the fp32 shards move, the bf16 copies
    are FSDP2's, and the gathered parameters stay from forward to backward."""
    kinds = ("parameter", "gradient", "optimizer_state")
    _assert_whole_step(fsdp_job["accumulated-reference"], fsdp_job["accumulated-whole"], kinds)


def test_a_budget_one_rank_cannot_meet_stops_every_rank_with_one_line(nosplit_job) -> None:
    """Note: [Ranks agree at the start of every step] in teraio.lifecycle.ranks: no rank is left waiting."""
    assert nosplit_job["refused"] is not None, "the job ran to its end under a 4096-byte budget"


def test_no_files_remain_after_a_rank_is_killed_and_the_job_runs_again(tmp_path) -> None:
    with pytest.raises((mp.ProcessExitedException, mp.ProcessRaisedException)):
        _run("ddp-nosplit", [True], tmp_path, kill_rank_at=4, steps=6)
    leftovers = sorted(p for p in tmp_path.glob("off-*/**/*") if p.is_file())
    assert leftovers, "the killed run left nothing behind: the test would prove nothing"
    (results,) = _run("ddp-nosplit", [True], tmp_path, steps=4)
    assert all(r["leftover_files"] == [] for r in results)


def test_compiled_autograd_while_profiling_is_refused_on_every_rank(compiled_autograd_job) -> None:
    """Note: [Compiled autograd runs its own copy of the backward] in teraio.lifecycle.runner: never a silent run
    without a plan."""
    assert compiled_autograd_job["refused"] is not None, "compiled autograd while profiling ran to its end"


# Note: [An FSDP2 checkpoint resumed by a new job]
#     The whole-state run of the FSDP2 job saved a checkpoint after step 3 (each rank its shards: Note: [A
#     checkpoint of an FSDP2 job] in teraio.states.sharded_checkpoint). A second 2-rank job resumes it under
#     the same budget and tries saves that fail; it also loads a checkpoint one process saved without
#     FSDP2 (each rank its blocks of the whole tensors); and this process loads the 2-rank checkpoint
#     without FSDP2. The FX path: on Inductor a resumed run's profiled steps compute op by op
#     (docs/limits.md).
def _one_process_checkpoint(directory: Path) -> dict[str, str]:
    """One step of the tiny GPT with the whole state on disk, saved to ``directory``: its digests."""
    import torch

    import teraio

    from .dist_worker import model_digests
    from .loops import GPTLoss, _tokens

    torch.manual_seed(0)
    model = GPTLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    states = teraio.States(optimizer=opt, gradients=True, parameters=True, model=model, min_param_bytes=0)
    backend = teraio.backend(
        states=states, inner="eager", io_backend="posix", offload_dirs=[str(directory.parent / "off-one")]
    )
    try:
        model.compile(backend=backend)
        model(*_tokens(64, 2)(100, 32)).backward()
        opt.step()
        opt.zero_grad()
        backend.states.save_checkpoint(directory)
        return model_digests(model, opt)
    finally:
        backend.close()


@pytest.fixture
def fsdp_resume_job(fsdp_job, tmp_path_factory) -> dict[str, Any]:
    def job() -> dict[str, Any]:
        tmp = tmp_path_factory.mktemp("fsdp-resume")
        one = _one_process_checkpoint(tmp / "one-process")
        (tmp / "failures").mkdir()
        runs = [
            (
                "resumed",
                True,
                {
                    "states": "whole",
                    "budget": "50%",
                    "load": str(Path(fsdp_job["dir"]) / "ckpt-step3"),
                    "save_failures": str(tmp / "failures"),
                    # The reference's 8 steps, then 4 more: the plan is made again once the memory FSDP2's
                    # gathers take outside the graphs was measured twice, and measured after that.
                    "digest_at": 8,
                    "steps": 12,
                },
            ),
            (
                "from-one-process",
                True,
                {"states": "whole", "load": str(tmp / "one-process"), "restore_rng": False, "steps": 0},
            ),
        ]
        results = _run("fsdp-states", runs, tmp, steps=8, clip=True)
        return {"one-process": one, **{name: r for (name, _, _), r in zip(runs, results)}}

    return once_per_run("distributed-fsdp-resume-job", job)


def test_fsdp2_checkpoint_resumes_bit_identically_in_a_new_job(fsdp_job, fsdp_resume_job) -> None:
    """Saved after step 3 by the whole-state run, loaded by a new 2-rank job under the same budget: steps 4
    to 8 as if never interrupted, and the budget held (Note: [An FSDP2 checkpoint resumed by a new job])."""
    reference, resumed = fsdp_job["reference"], fsdp_resume_job["resumed"]
    for rank, (ref, saver, got) in enumerate(zip(reference, fsdp_job["whole"], resumed)):
        assert got["checkpoints"]["loaded"] == saver["checkpoints"]["at_save"], rank
        assert got["losses"][:5] == ref["losses"][3:], rank
        assert got["grads"][:5] == ref["grads"][3:], rank
        after_8 = {"params": ref["params"], "optimizer_states": ref["optimizer_states"]}
        assert got["checkpoints"]["at_step"] == after_8, rank
    _assert_moved_within_budget(resumed, ("parameter", "gradient", "optimizer_state"))
    files = sorted(p.name for p in (Path(fsdp_job["dir"]) / "ckpt-step3").iterdir())
    assert files == [
        "model.rank00000.safetensors",
        "model.rank00001.safetensors",
        "optimizer.rank00000.safetensors",
        "optimizer.rank00001.safetensors",
        "teraio-checkpoint.json",
        "train_state.json",
    ], files


def test_fsdp2_checkpoint_save_failures_raise_on_every_rank_and_leave_nothing(fsdp_resume_job) -> None:
    """A target that exists (rank 0 finds it) and rank 1 failing to write: every rank raises the same
    line, and the staging directory rank 0 made is gone."""
    messages = [got["checkpoints"]["failures"] for got in fsdp_resume_job["resumed"]]
    assert messages[0] == messages[1], messages
    failures = messages[0]
    assert failures["exists"].startswith("save_checkpoint failed on rank 0: "), failures
    assert "exists" in failures["exists"], failures
    assert failures["rank 1 fails"] == (
        "save_checkpoint failed on rank 1: OSError: [Errno 28] No space left on device"
    ), failures
    assert failures["exists: left"] == ["exists"] and failures["rank 1 fails: left"] == ["exists"], failures


def test_a_one_process_checkpoint_loads_into_fsdp2_shards(fsdp_resume_job) -> None:
    """A checkpoint of one process without FSDP2, loaded by the 2-rank job: each rank its blocks."""
    for rank, got in enumerate(fsdp_resume_job["from-one-process"]):
        assert got["checkpoints"]["loaded"] == fsdp_resume_job["one-process"], rank


def test_an_fsdp2_checkpoint_loads_in_one_process_without_fsdp2(fsdp_job, tmp_path) -> None:
    """The 2-rank checkpoint, loaded whole by one process with the whole state on disk (the parameters
    written to disk as they are read), then one step trained."""
    import torch

    import teraio

    from .dist_worker import model_digests
    from .loops import GPTLoss, _tokens

    with torch.device("meta"):
        model = GPTLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    states = teraio.States(optimizer=opt, gradients=True, parameters=True, model=model, min_param_bytes=0)
    backend = teraio.backend(states=states, inner="eager", io_backend="posix", offload_dirs=[str(tmp_path)])
    try:
        ckpt = Path(fsdp_job["dir"]) / "ckpt-step3"
        from teraio.states.errors import CheckpointError

        with pytest.raises(CheckpointError, match="saved by a job of 2 ranks, this one has 1"):
            backend.states.load_checkpoint(ckpt)
        report = backend.states.load_checkpoint(ckpt, restore_rng=False)
        assert report["committed_steps"] == 3
        assert report["model"]["offloaded_bytes"] == report["model"]["read_bytes"] > 0, report
        assert model_digests(model, opt) == fsdp_job["whole"][0]["checkpoints"]["at_save"]
        model.compile(backend=backend)
        loss = model(*_tokens(64, 2)(0, 32))
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
    finally:
        backend.close()
