"""The README's examples are tests: every Python and shell block in the documents below runs here.

A newcomer copies these blocks first, so a block that stops working must fail the suite. Blocks run as a
user would run them: shell blocks with ``bash -euo pipefail`` (the ``teraio`` command of this venv on
PATH), Python blocks in a fresh namespace of a fresh interpreter, both in a scratch directory per document
(blocks of one document run in order and share it, like a user's terminal session).

Where a document shows sizes meant for real work, ``SUBSTITUTIONS`` (below, each with its reason) shrinks
them: the tiny built-in GPT, the FX-only inner compiler (an Inductor compile takes 20-40 s on 2 cores),
scratch directories for ``/nvme0/...``. Every substitution must still match something, so the table
cannot drift from the documents. ``SKIPPED_COMMANDS`` names the few commands that are never run (``make
test`` would run this suite again); a whole block that cannot run here carries
``<!-- readme-test: skip (reason) -->`` on the line before its fence, and is reported as skipped.

The README is also held to what it promises a newcomer: the two commands on its first screen, at most
``README_MAX_LINES`` lines, an option table whose names ``teraio.backend`` really takes, and links (in it
and in every document under ``docs/``) that lead to a file and heading that exist.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock

from tests.teraio.shared import run_directory

REPO_ROOT = Path(__file__).resolve().parents[1]
# The documents whose code blocks are tested, in the order their blocks run: the front door, the guide
# it sends users to, the command line, the formats, then the pages for readers who change teraio.
DOCUMENTS = (
    "README.md",
    "docs/guide.md",
    "docs/cli.md",
    "docs/reference.md",
    "docs/limits.md",
    "docs/design.md",
    "docs/development.md",
    "docs/environment.md",
)

PYTHON_LANGS = frozenset({"python", "py"})
SHELL_LANGS = frozenset({"bash", "sh", "shell", "console"})
# Fences that hold data or a directory tree, not something to run.
DATA_LANGS = frozenset({"", "text", "json"})

SKIP_MARKER = re.compile(r"<!--\s*readme-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")

# Commands that are never run, with why. Keep this list small: everything else must really execute.
SKIPPED_COMMANDS: dict[str, str] = {
    "make test": "runs this very test suite: it would recurse",
}

# (regex, replacement, applies to "python" | "shell", why). ``{work}`` is the document's scratch directory.
SUBSTITUTIONS: tuple[tuple[str, str, str, str], ...] = (
    (
        r"^make demo\b",
        "teraio demo --model tiny --steps 2 --solver greedy --methods no-offload,teraio --inner eager",
        "shell",
        "the demo config trains for minutes; the tiny GPT exercises the same path, on the FX path because "
        "tests/teraio/test_cli_demo.py's documented-keys test runs all four methods on Inductor",
    ),
    (r"builtin:demo\b", "builtin:tiny", "shell", "the demo GPT takes minutes to profile"),
    (
        r"--solver ilp --time-limit 60\b",
        "--solver ilp --time-limit 5",
        "shell",
        "a cap: CP-SAT never proves the tiny GPT's joint plan optimal and ends once it stops improving, "
        "which a loaded machine slows",
    ),
    (r"\bteraio profile ", "teraio profile --inner eager ", "shell", "an Inductor compile takes 20-40 s"),
    (
        r"(examples/train_(?:ddp|fsdp)\.py .*)$",
        r"\1 --inner eager --solver greedy",
        "shell",
        "two ranks compiling with Inductor and planning with CP-SAT at once took 80 s of both cores for the "
        "DDP example (45 s of it CP-SAT), and FSDP2's block graphs take longer; the jobs in "
        "tests/teraio/test_distributed.py run both on the FX path, Inductor and the ILP are tested on one "
        "process (a rank compiles and plans the same way), and DDP on Inductor with the ILP by hand "
        "(test_distributed.py's expensive test)",
    ),
    (
        r"\btorchrun --nproc_per_node=",
        "torchrun --standalone --nproc_per_node=",
        "shell",
        "without it every single-node job on the machine rendezvouses on port 29500: another test run's "
        "job (or any process) there fails this one or joins it; --standalone takes a port the kernel picks",
    ),
    (
        r"\bteraio estimate (hf:\S+)",
        r"teraio estimate \1 --layers 1 --seq 128 --time-limit 5",
        "shell",
        "a whole Llama takes minutes to capture and plan; one layer of it runs the same path in seconds",
    ),
    (
        r"\bteraio estimate (builtin:\S+)",
        r"teraio estimate \1 --time-limit 5",
        "shell",
        "a cap: CP-SAT never proves the tiny GPT's joint plan optimal and ends once it stops improving, "
        "which a loaded machine slows",
    ),
    (
        r"\bteraio calibrate ",
        "teraio calibrate --size 16MiB --repeats 1 --raw-only ",
        "shell",
        "the default measures 3 x 256 MiB each way; raw O_DIRECT only, because the runtime engine's "
        "measurements (pricing transfers under compute: 45 s of CPU here) are run and checked by "
        "tests/teraio/test_cli_planner.py's calibrate test",
    ),
    (r"/nvme(\d)/teraio", r"{work}/nvme\1", "any", "scratch directories stand in for NVMe mounts"),
    (
        r"(?<![\w/])examples/",
        str(REPO_ROOT / "examples") + "/",
        "shell",
        "blocks run in a scratch directory; the examples are the repository's",
    ),
    (
        r"\bteraio\.backend\((?!inner=)",
        'teraio.backend(inner="eager", solver="greedy", ',
        "python",
        "the FX-only inner compiler (an Inductor compile takes 20-40 s); greedy, because CP-SAT spends "
        "seconds of both cores even on the tiny GPT (the CLI block runs the ILP)",
    ),
    (
        r"backend=\"teraio\"",
        'backend=__import__("teraio").backend(inner="eager")',
        "python",
        "the FX-only inner compiler: an Inductor compile takes 20-40 s",
    ),
)
MAX_SKIPPED_COMMANDS = 2
BLOCK_TIMEOUT_S = 600


@dataclass(frozen=True)
class Block:
    document: str
    line: int  # 1-based line of the opening fence
    lang: str
    source: str
    skip_reason: str | None

    @property
    def kind(self) -> str:
        return "python" if self.lang in PYTHON_LANGS else "shell"

    @property
    def id(self) -> str:
        return f"{self.document}:{self.line}-{self.lang}"


def extract_blocks(document: str) -> list[Block]:
    """Every fenced block of ``document`` (python, shell or data), with its skip marker if any."""
    lines = (REPO_ROOT / document).read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, lang = i, m.group("lang").lower()
        end = start + 1
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        assert end < len(lines), f"{document}:{start + 1}: code fence never closed"
        prev = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
        marker = SKIP_MARKER.search(prev)
        source = "\n".join(lines[start + 1 : end]) + "\n"
        blocks.append(Block(document, start + 1, lang, source, marker.group("reason") if marker else None))
        i = end + 1
    return blocks


ALL_BLOCKS = [b for doc in DOCUMENTS for b in extract_blocks(doc)]
CODE_BLOCKS = [b for b in ALL_BLOCKS if b.lang in PYTHON_LANGS | SHELL_LANGS]


def _shell_commands(block: Block) -> str:
    """The commands of a shell block: a console block's ``$ `` lines, any other block as it is."""
    if block.lang != "console":
        return block.source
    return "".join(ln[2:] + "\n" for ln in block.source.splitlines() if ln.startswith("$ "))


def prepare(block: Block, work: Path, used: set[int], skipped: set[str]) -> str:
    """The text that runs for ``block``: skipped commands removed, substitutions applied."""
    text = block.source if block.kind == "python" else _shell_commands(block)
    if block.kind == "shell":
        kept = []
        for ln in text.splitlines():
            command = ln.split("#", 1)[0].strip()
            if command in SKIPPED_COMMANDS:
                skipped.add(command)
                kept.append(f": skipped by tests/test_readme.py: {command}")
            else:
                kept.append(ln)
        text = "\n".join(kept) + "\n"
    for idx, (pattern, replacement, applies, _why) in enumerate(SUBSTITUTIONS):
        if applies not in ("any", block.kind):
            continue
        text, n = re.subn(pattern, replacement.replace("{work}", str(work)), text, flags=re.MULTILINE)
        if n:
            used.add(idx)
    return text


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


# Runs a document's Python blocks in one fresh interpreter (torch is imported once), each block in a
# fresh namespace, and reports each block's outcome as one JSON line.
PYTHON_RUNNER = textwrap.dedent(
    """
    import json, sys, traceback
    blocks = json.load(open(sys.argv[1]))
    for b in blocks:
        try:
            exec(compile(b["source"], b["id"], "exec"), {"__name__": "__main__"})
            result = {"id": b["id"], "ok": True}
        except BaseException:
            result = {"id": b["id"], "ok": False, "traceback": traceback.format_exc()}
        try:
            import torch._dynamo
            torch._dynamo.reset()
        except ImportError:
            pass
        print("READMETEST " + json.dumps(result), flush=True)
    """
)


@dataclass
class Outcome:
    ok: bool
    detail: str


def run_document(document: str, work: Path) -> tuple[dict[str, Outcome], set[int], set[str]]:
    """Run every code block of ``document`` in order in ``work``; outcomes by block id."""
    for d in ("nvme0", "nvme1"):
        (work / d).mkdir(parents=True, exist_ok=True)
    used: set[int] = set()
    skipped: set[str] = set()
    outcomes: dict[str, Outcome] = {}
    pending_python: list[dict[str, str]] = []

    def flush_python() -> None:
        if not pending_python:
            return
        spec = work / ".readme_blocks.json"
        spec.write_text(json.dumps(pending_python))
        proc = subprocess.run(
            [sys.executable, "-c", PYTHON_RUNNER, str(spec)],
            cwd=work,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
        )
        reported = {}
        for ln in proc.stdout.splitlines():
            if ln.startswith("READMETEST "):
                r = json.loads(ln[len("READMETEST ") :])
                reported[r["id"]] = r
        for b in pending_python:
            r = reported.get(b["id"])
            if r is None:
                outcomes[b["id"]] = Outcome(
                    False, f"no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
                )
            else:
                outcomes[b["id"]] = Outcome(r["ok"], r.get("traceback", "")[-3000:])
        pending_python.clear()

    for block in (b for b in CODE_BLOCKS if b.document == document and b.skip_reason is None):
        text = prepare(block, work, used, skipped)
        if block.kind == "python":
            pending_python.append({"id": block.id, "source": text})
            continue
        flush_python()  # keep the document's order: a shell block may use what Python wrote, and back
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", text],
            cwd=work,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
        )
        ok = proc.returncode == 0 and "Traceback (most recent call last)" not in proc.stderr
        outcomes[block.id] = Outcome(ok, f"exit {proc.returncode}\n$ {text}\n{proc.stderr[-3000:]}")
    flush_python()
    return outcomes, used, skipped


_RESULTS: dict[str, tuple[dict[str, Outcome], set[int], set[str]]] = {}


@pytest.fixture(scope="session")
def results(tmp_path_factory: pytest.TempPathFactory):
    """Runs each document once per test run, lazily, and keeps the outcomes for the per-block tests.

    Once per run, not per process: under pytest-xdist the first worker that needs a document runs it
    under a file lock and leaves the outcomes in the run's shared temporary directory; the other reads
    them (split across two workers, `make demo` ran twice and CI took 26 minutes). Session-scoped: a
    module fixture is torn down whenever a worker runs another module's test in between."""
    shared = run_directory(tmp_path_factory.getbasetemp())

    def get(document: str) -> tuple[dict[str, Outcome], set[int], set[str]]:
        if document not in _RESULTS:
            key = re.sub(r"\W", "_", document)
            done = shared / f"document-{key}.pickle"
            with FileLock(str(done) + ".lock"):
                if done.is_file():
                    _RESULTS[document] = pickle.loads(done.read_bytes())
                else:
                    _RESULTS[document] = run_document(document, tmp_path_factory.mktemp(key))
                    done.write_bytes(pickle.dumps(_RESULTS[document]))
        return _RESULTS[document]

    return get


@pytest.mark.slow  # a document's blocks run together on its first block: 10-40 s of CPU each
@pytest.mark.parametrize("block", CODE_BLOCKS, ids=lambda b: b.id)
def test_block_runs(block: Block, results) -> None:
    if block.skip_reason is not None:
        pytest.skip(f"marked in {block.document}: {block.skip_reason}")
    outcomes, _, _ = results(block.document)
    outcome = outcomes[block.id]
    assert outcome.ok, f"{block.id} failed:\n{outcome.detail}"


def test_every_substitution_and_skipped_command_is_still_used(results) -> None:
    used: set[int] = set()
    skipped: set[str] = set()
    for doc in DOCUMENTS:
        _, u, s = results(doc)
        used |= u
        skipped |= s
    stale = [SUBSTITUTIONS[i][0] for i in range(len(SUBSTITUTIONS)) if i not in used]
    assert not stale, f"substitutions that no longer match any block (remove them): {stale}"
    assert set(SKIPPED_COMMANDS) == skipped, f"skip list out of date: found {sorted(skipped)}"
    assert len(SKIPPED_COMMANDS) <= MAX_SKIPPED_COMMANDS


def test_blocks_are_found_and_skips_are_few_and_explained() -> None:
    # The front door has a Python example, the shell commands, and nothing unrecognised.
    readme = [b for b in ALL_BLOCKS if b.document == "README.md"]
    assert any(b.lang in PYTHON_LANGS for b in readme) and any(b.lang in SHELL_LANGS for b in readme)
    unknown = [b.id for b in ALL_BLOCKS if b.lang not in PYTHON_LANGS | SHELL_LANGS | DATA_LANGS]
    assert not unknown, f"code blocks in a language this test cannot run: {unknown}"
    skips = [(b.id, b.skip_reason) for b in CODE_BLOCKS if b.skip_reason is not None]
    print(f"{len(skips)} of {len(CODE_BLOCKS)} code blocks skipped: {skips}")
    assert len(skips) <= 2, f"too many skipped blocks; make them run: {skips}"
    # The first thing a newcomer runs: both commands, at the top of the README.
    first_shell = next(b for b in readme if b.lang in SHELL_LANGS)
    assert "make demo" in first_shell.source and "make test" in first_shell.source


def test_extraction_sees_markers_and_console_prompts(tmp_path: Path) -> None:
    # The parser itself: a skip marker attaches to the next fence, console blocks run only "$ " lines.
    doc = tmp_path / "doc.md"
    doc.write_text(
        "<!-- readme-test: skip (needs a GPU) -->\n```python\nimport cupy\n```\n\n"
        "```console\n$ make demo\noutput line\n$ make test\n```\n"
    )
    blocks = extract_blocks(str(doc))  # an absolute path: REPO_ROOT / doc is doc
    assert [b.skip_reason for b in blocks] == ["needs a GPU", None]
    used: set[int] = set()
    skipped: set[str] = set()
    text = prepare(blocks[1], tmp_path, used, skipped)
    assert "output line" not in text and text.startswith("teraio demo --model tiny")
    assert skipped == {"make test"} and not any(ln.startswith("make test") for ln in text.splitlines())


# The front door: what a newcomer runs first, on the first screen, and a page short enough to read whole.
README_MAX_LINES = 300
README_FIRST_SCREEN_LINES = 40


def test_readme_is_short_and_opens_with_the_two_commands() -> None:
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move depth to docs/"
    )
    first_screen = "\n".join(lines[:README_FIRST_SCREEN_LINES])
    for command in ("make demo", "make test"):
        assert command in first_screen, f"{command!r} is not on the README's first screen"
    readme = [b for b in ALL_BLOCKS if b.document == "README.md"]
    first_shell = next(b for b in readme if b.lang in SHELL_LANGS)
    assert first_shell.line <= README_FIRST_SCREEN_LINES


def _readme_option_names() -> list[str]:
    """The first column of the README's option table (the table under "The options that matter")."""
    text = (REPO_ROOT / "README.md").read_text()
    section = text.split("## The options that matter", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE)


def test_readme_options_are_parameters_of_teraio_backend() -> None:
    # The README names the few options most runs set; each must be one teraio.backend really takes,
    # with the default the table says (the full tables, checked field by field, are docs/options.md's).
    import inspect

    import teraio

    names = _readme_option_names()
    assert len(names) >= 8, f"the README's option table was not found or lost rows: {names}"
    params = inspect.signature(teraio.backend).parameters
    unknown = [n for n in names if n not in params]
    assert not unknown, f"the README's option table names options teraio.backend does not take: {unknown}"
    for name, default in (
        ("memory_budget", None),
        ("solver", "ilp"),
        ("inner", "inductor"),
        ("states", None),
    ):
        assert params[name].default == default, (name, params[name].default)


MD_LINK = re.compile(r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors_and_links(path: Path) -> tuple[set[str], list[tuple[int, str]]]:
    """The heading anchors of a Markdown file and its links with their line numbers, fences skipped."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    links: list[tuple[int, str]] = []
    in_fence = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        heading = re.match(r"^#{1,6} (.*)$", line)
        if heading:
            slug = _slug(heading.group(1))
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
        links += [(number, m.group("target")) for m in MD_LINK.finditer(line)]
    return anchors, links


LINKED_DOCUMENTS = (
    "README.md",
    *sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "docs").glob("*.md")),
)


@pytest.mark.parametrize("document", LINKED_DOCUMENTS)
def test_relative_links_resolve(document: str) -> None:
    # A reader follows the README into docs/ and back: every relative link must reach a file that exists
    # and, for a Markdown file, a heading that exists.
    source = REPO_ROOT / document
    _, links = _anchors_and_links(source)
    broken = []
    for number, target in links:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        path = (source.parent / path_part).resolve() if path_part else source
        if not path.exists():
            broken.append(f"{document}:{number}: {target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors_and_links(path)[0]:
            broken.append(f"{document}:{number}: {target} (no heading #{anchor} in {path.name})")
    assert not broken, "broken links:\n" + "\n".join(broken)
