"""The ``tracediff`` command line. Thin: parse, call one function per command, render."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from tracediff.errors import InputError, did_you_mean
from tracediff.integrations.producer import Importer
from tracediff.integrations.registry import PRODUCERS
from tracediff.text import safe
from tracediff.tools.replay import AUX_READERS, checkpoint_files

T = TypeVar("T")

if TYPE_CHECKING:
    from tracediff.bundle.build import Explained
    from tracediff.bundle.contents import Bundle
    from tracediff.diff.results import Report
    from tracediff.diff.tolerance import Tolerances
    from tracediff.eagle3.explanation import Explanation
    from tracediff.record.launch import LaunchResult
    from tracediff.record.plugin import LaunchConfig

# Plain-text help (rich_markup_mode None): rich's help rendering costs 0.1 s of imports on every --help.
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,
                  help="Record, replay and diff tensor traces of EAGLE-3 speculative decoding.")


def drop_output() -> None:
    """The reader of stdout left (``| head``): send the rest nowhere. Exit codes carry verdicts (1 is
    "diverged"), so a closed pipe must not turn into one."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def emit(as_json: bool, markdown: bool, json_text: Callable[[], str], markdown_text: Callable[[], str],
         render: Callable[[], None]) -> None:
    """A result on stdout as JSON, Markdown or the terminal rendering; a reader that leaves early
    (``| head``) ends the output, never the exit code."""
    try:
        if as_json:
            print(json_text())
        elif markdown:
            print(markdown_text(), end="")
        else:
            render()
        sys.stdout.flush()
    except BrokenPipeError:
        drop_output()


class _Console(Console):
    def on_broken_pipe(self) -> None:
        self.quiet = True
        drop_output()


# Piped output (files, CI logs, bug reports) gets wide lines instead of rich's 80-column default.
console = _Console(width=None if sys.stdout.isatty() else 200)


def fail(path: str | Path, problem: str) -> NoReturn:
    """One line on stderr, exit 2: the contract for every bad input."""
    print(safe(f"error: {path}: {problem}"), file=sys.stderr)  # names as data: one line, no escapes
    raise typer.Exit(2)


def no_verify_option() -> Any:
    """``--no-verify`` of the commands that read traces."""
    return typer.Option(False, "--no-verify",
                        help="do not check the trace's checksums (a few percent faster; corrupt bytes then "
                             "read silently)")


def force_option(what: str = "the output") -> Any:
    """``--force`` of the commands that write: an existing output is refused without it."""
    return typer.Option(False, "--force", help=f"replace {what} if it exists: only a regular file that is "
                        "none of the inputs is ever replaced (never a link, device, FIFO or directory)")


def wrote(paths: Any) -> Text:
    """``wrote A, B``: the file names as data (no markup, control characters as escapes)."""
    from tracediff.text import safe

    return Text(f"wrote {', '.join(safe(p) for p in paths)}")


def guarded(path: str | Path, action: Callable[[], T]) -> T:
    """What ``action`` returns; an ``InputError`` it raises is the command's one ``error:`` line."""
    try:
        return action()
    except InputError as exc:
        fail(exc.path, exc.problem)


@app.command()
def show(
    trace: Path = typer.Argument(..., help="trace file (.h5 / .arrow), or the stem of per-rank files"),
    other: Path | None = typer.Argument(None, help="a second trace: one row of --name on both sides, side by "
                                        "side, and how they differ"),
    name: str | None = typer.Option(None, "--name", "-n", help="print stats and values of this tensor"),
    step: int | None = typer.Option(None, help="with --name: only this step (two traces: a's step)"),
    request: str | None = typer.Option(None, help="with --name: only this request (two traces: a's request)"),
    request_b: str | None = typer.Option(None, "--request-b", help="two traces: b's request (default: "
                                         "--request; producers name requests differently)"),
    position: int | None = typer.Option(None, "--position", help="two traces: the row's token position "
                                        "(default: the first row of a's that b holds too)"),
    depth: int | None = typer.Option(None, "--depth", help="two traces: the draft depth (default 0)"),
    step_b: int | None = typer.Option(None, "--step-b", help="two traces: b's step (default: --step)"),
    name_b: str | None = typer.Option(None, "--name-b", help="two traces: b's name for the tensor (default: "
                                      "--name; as compare --map renames it)"),
    top: int | None = typer.Option(None, "--top", help="two traces: how many of the largest differences to "
                                   "list (default 10)"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    no_verify: bool = no_verify_option(),
) -> None:
    """Metadata and the tensors of a trace, in execution order; or stats of one tensor. With two
    traces: one row of a tensor on both sides and its largest differences (compare's next step)."""
    if other is not None:
        show_pair(trace, other, name, name_b, request, request_b, position, depth, step, step_b, top, as_json,
                  not no_verify)
        return
    for option, value in (("--request-b", request_b), ("--position", position), ("--depth", depth),
                          ("--step-b", step_b), ("--top", top), ("--name-b", name_b)):
        if value is not None:
            fail(option, "needs two traces: tracediff show A B --name NAME ...")
    guarded(trace, lambda: show_one(trace, name, step, request, as_json, not no_verify))


def show_one(trace: Path, name: str | None, step: int | None, request: str | None, as_json: bool,
             verify: bool) -> None:
    """``show A [--name X]``: the trace's summary, or one tensor's stats, rendered or as JSON."""
    from tracediff.report.show import render_stats, render_summary
    from tracediff.trace.reader import open_trace
    from tracediff.trace.summary import static_stats, summarize, tensor_stats

    with open_trace(trace, verify=verify) as opened:
        if name is None:
            summary = summarize(opened)
            if as_json:
                print(json.dumps(summary.to_dict(), indent=1))
            else:
                render_summary(console, summary)
                if summary.unverified:
                    print(f"unverified: {summary.unverified}")
            return
        where = " ".join(f"{k}={v}" for k, v in (("step", step), ("request", request)) if v is not None)
        try:
            stats = tensor_stats(opened.rows(name, step=step, request=request))
        except KeyError:
            static = static_stats(opened, name, step) if request is None else None
            if static is None:
                names = opened.names()
                hint = did_you_mean(name, names) if name not in names else ""
                fail(trace, f"no rows of tensor {name!r} {where}".rstrip() + (f"; {hint}" if hint else "")
                     + " (list: tracediff show)")
            stats = static
        if as_json:
            print(json.dumps(stats.to_dict(), indent=1))
        else:
            render_stats(console, stats, where)


def show_pair(a: Path, b: Path, name: str | None, name_b: str | None, request: str | None,
              request_b: str | None, position: int | None, depth: int | None, step: int | None,
              step_b: int | None, top: int | None, as_json: bool, verify: bool) -> None:
    """``show A B --name X``: the row on both sides (``row_view``), rendered or as JSON."""
    from tracediff.diff.rowview import row_view
    from tracediff.jsonio import to_plain
    from tracediff.report.show import render_row_view

    if name is None:
        fail("--name", "two traces show one tensor side by side: pass --name NAME")
    if top is not None and top < 0:
        fail("--top", f"takes a count >= 0, not {top}")

    def run() -> None:
        view = row_view(a, b, name, request=request, request_b=request_b, position=position,
                        depth=0 if depth is None else depth, step=step, step_b=step_b,
                        top=10 if top is None else top, name_b=name_b, verify=verify)
        if as_json:
            print(json.dumps(to_plain(view), indent=1, allow_nan=False))
        else:
            render_row_view(console, view)

    guarded(a, run)


@app.command()
def convert(
    src: Path = typer.Argument(..., help="trace to read"),
    dst: Path = typer.Argument(..., help="trace to write (a new file, or with --force a regular file to "
                               "replace); the format follows the extension"),
    force: bool = force_option("DST"),
    no_verify: bool = no_verify_option(),
) -> None:
    """Convert a trace between HDF5 and Arrow without loss. The output appears whole or not at all."""
    from tracediff.trace.convert import convert as run_convert
    from tracediff.trace.output import check_trace_suffix

    guarded(dst, lambda: check_trace_suffix(dst))
    guarded(src, lambda: console.print(wrote(run_convert(src, dst, force=force, verify=not no_verify))))


@app.command("slice")
def slice_command(
    trace: Path = typer.Argument(..., help="trace to read (.h5 / .arrow, or the stem of per-rank files)"),
    out: Path = typer.Option(..., "--out", "-o", help="the smaller trace to write (.h5 or .arrow): a new "
                             "file (replaced only with --force; never the stem or a new rank file of "
                             "existing rank files); a trace of rank files is sliced per rank (OUT stem + "
                             ".rankN; a rank file the selection keeps nothing of is not written)"),
    names: list[str] = typer.Option([], "--names", help="keep tensors whose names match this glob (repeat "
                                    "for more; taken whole: a comma is part of the glob)"),
    requests: list[str] = typer.Option([], "--requests", help="keep the rows and tokens of this request "
                                       "(repeat for more; taken whole: a comma is part of the id)"),
    positions: list[str] = typer.Option([], "--positions", help="keep rows at positions N or A:B (half-open; "
                                        "A: and :B are open-ended; repeat or comma-separate)"),
    steps: list[str] = typer.Option([], "--steps", help="keep records of these steps: N or A:B (half-open; "
                                    "repeat or comma-separate)"),
    depths: list[str] = typer.Option([], "--depths", help="keep records of these draft depths: N or A:B "
                                     "(repeat or comma-separate)"),
    force: bool = force_option("--out"),
    no_verify: bool = no_verify_option(),
) -> None:
    """Write a smaller, valid trace: the records and rows a selection keeps, with the run metadata,
    contract, static records of the kept names and the kept requests' whole token sequences. Names
    and requests the trace does not hold are named in a note."""
    from tracediff.text import safe
    from tracediff.trace.slice import Selection, parse_list, parse_spans, slice_trace

    spans = {}
    for option, values in (("--steps", steps), ("--depths", depths), ("--positions", positions)):
        try:
            spans[option] = parse_spans(values)
        except ValueError as exc:
            fail(option, str(exc))
    selection = Selection(names=parse_list(names), requests=parse_list(requests),
                          positions=spans["--positions"], steps=spans["--steps"], depths=spans["--depths"])
    result = guarded(trace, lambda: slice_trace(trace, out, selection, force=force, verify=not no_verify))
    console.print(wrote(result.paths).append(f": {result.describe()}"))
    for option, unmatched in (("--names", result.unmatched_names),
                              ("--requests", result.unmatched_requests)):
        if unmatched:
            print(f"tracediff: note: {option} {', '.join(repr(safe(u)) for u in unmatched)} matched nothing "
                  f"in {safe(trace)} (tracediff show TRACE lists names, requests and steps)", file=sys.stderr)
    if result.empty:
        print(f"tracediff: note: not written (the selection keeps nothing of that rank file): "
              f"{', '.join(safe(p) for p in result.empty)}", file=sys.stderr)
    if not result.records:
        print("tracediff: note: the selection kept no tensor record (tracediff show TRACE lists names, "
              "requests and steps)", file=sys.stderr)


@app.command("bundle")
def bundle_command(
    a: Path = typer.Argument(..., help="baseline trace (e.g. training)"),
    b: Path = typer.Argument(..., help="trace to check against it (e.g. serving)"),
    out: Path = typer.Option(..., "--out", "-o", help="directory to write (new, or empty; never replaced)"),
    budget: str = typer.Option("1MB", "--budget", help="at most this size on disk for the directory's files "
                               "together, and with --zip for the zip on its own too (you attach one or the "
                               "other): e.g. 500k, 2MB, 1MiB"),
    zip_: bool = typer.Option(False, "--zip", help="also write DIR.zip next to DIR (what a GitHub issue can "
                              "attach)"),
    tol: list[str] = typer.Option([], "--tol", help="per-name bounds, as for compare"),
    mapping: list[str] = typer.Option([], "--map", help="NAME_IN_B=NAME_IN_A, as for compare"),
    align: str = typer.Option("prefix", "--align", help="prefix or step, as for compare"),
    min_coverage: float = typer.Option(0.95, "--min-coverage", help="as for compare"),
    draft: Path | None = typer.Option(None, "--draft", help="also explain (tracediff explain): the draft "
                                      "checkpoint to replay; the bundle holds explain.json / explain.html"),
    draft_b: Path | None = typer.Option(None, "--draft-b", help="with --draft: B's checkpoint, as for "
                                        "explain"),
    target: Path | None = typer.Option(None, "--target", help="with --draft: the target checkpoint, as for "
                                       "explain"),
    depths: int | None = typer.Option(None, min=1, help="with --draft: draft depths, as for explain"),
    force: bool = force_option("DIR.zip"),
    no_verify: bool = no_verify_option(),
) -> None:
    """A bug-report bundle of two traces: report.md (for a GitHub issue), report.json, report.html,
    small slices of both (a.h5 / b.h5) that reproduce the compare, stats.json for the rest; with
    --draft, explain's result too (the draft replayed on the full traces). When the budget is short,
    the slices keep fewer rows and tensors, and report.json / report.html fewer per-tensor error
    profiles (report.md lists what was left out).

    Exit 0 when written (report.md says whether the slices reproduce the compare), 2 for bad input or
    a budget too small for the smallest bundle (the error says how many bytes it takes)."""
    from tracediff.bundle.build import make_bundle
    from tracediff.sizes import parse_size

    try:
        size = parse_size(budget)
    except ValueError as exc:
        fail("--budget", str(exc))
    _, rename = compare_options(tol, mapping, align, min_coverage)
    unused = [name for name, given in (("--draft-b", draft_b), ("--target", target), ("--depths", depths))
              if given is not None]
    if draft is None and unused:
        fail(unused[0], "explains with --draft only: give the draft checkpoint too")
    explained = None if draft is None else _explained(a, b, out, zip_, force, draft, draft_b, target, depths,
                                                      not no_verify)
    bundle = guarded(a, lambda: make_bundle(a, b, out, budget=size, zip=zip_, tol=tol, rename=rename,
                                            align=align, min_coverage=min_coverage, force=force,
                                            explained=explained, verify=not no_verify))
    say_bundle(bundle, out, size)


def say_bundle(bundle: Bundle, out: Path, size: int) -> None:
    """What ``bundle`` wrote, what it left out to fit the budget, and whether its slices reproduce."""
    from tracediff.sizes import human
    from tracediff.text import safe

    zipped = "" if bundle.zip is None else f" and {safe(bundle.zip)} ({bundle.zip_size} bytes)"
    console.print(Text(f"wrote {safe(out)} ({bundle.total} bytes in {len(bundle.files)} files){zipped}, each "
                       f"within the budget of {human(size)} ({size} bytes); read {safe(out / 'report.md')}"))
    for line in bundle.left_out:
        console.print(Text(f"  left out to fit the budget: {safe(line)}"))
    if bundle.profiles_dropped:
        console.print(Text(f"  left out to fit the budget: the error profiles of "
                           f"{len(bundle.profiles_dropped)} tensors in report.json and report.html"))
    empty = [p.name for side in bundle.sides for p in side.sliced.empty]
    if empty:
        console.print(Text(f"  not written (the slice keeps nothing of that rank file): "
                           f"{', '.join(map(safe, empty))}"))
    check = bundle.verification
    if check.reproduced and check.report is not None:
        console.print(Text(f"  the slices reproduce the compare: {check.report.verdict}"))
    else:
        print(f"tracediff: warning: the slices do not reproduce the compare: "
              f"{safe('; '.join(map(str, check.differences)))}", file=sys.stderr)


def _explained(a: Path, b: Path, out: Path, zip_: bool, force: bool, draft: Path, draft_b: Path | None,
               target: Path | None, depths: int | None, verify: bool) -> Explained:
    """explain's result for ``bundle --draft``, run once the bundle's output is known to be writable."""
    need_torch()
    from tracediff.bundle.build import Explained, check_bundle_output

    guarded(out, lambda: check_bundle_output(out, zip_, [a, b], force))  # before the replays (they take long)
    explanation = _explanation(a, b, draft, draft_b, target, depths, verify)
    flags = ["--draft", str(draft), *(["--draft-b", str(draft_b)] if draft_b else []),
             *(["--target", str(target)] if target else []), *(["--depths", str(depths)] if depths else [])]
    return Explained(explanation, tuple(flags))


def _explanation(a: Path, b: Path, draft: Path, draft_b: Path | None, target: Path | None,
                 depths: int | None, verify: bool) -> Explanation:
    """``td.explain`` with a progress bar (rows replayed) on a terminal; bad input is one error line."""
    from tracediff.report.progress import progress_bar
    from tracediff.tools.explain import explain as run_explain

    def run() -> Explanation:
        with progress_bar("explaining", unit="rows") as progress:
            return run_explain(a, b, draft, draft_b=draft_b, target=target, depths=depths, progress=progress,
                               verify=verify)

    return guarded(b, run)


def need_torch() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        print("error: this command runs the draft and needs torch: pip install 'tracediff[torch]'",
              file=sys.stderr)
        raise typer.Exit(2) from None


@app.command()
def replay(
    trace: Path = typer.Argument(..., help="trace with target.* tensors (training or serving)"),
    draft: Path = typer.Option(..., "--draft", help="draft checkpoint dir (config.json + model.safetensors)"),
    target: Path | None = typer.Option(None, "--target", help="target checkpoint dir, for shared embeddings"),
    out: Path | None = typer.Option(None, "--out", "-o", help="write the replayed draft tensors as a trace"),
    aux: str | None = typer.Option(None, "--aux", help="rebuild fc input from these target layers, "
                                      "e.g. 'embed,3,31' (default: the recorded draft.fc_in)"),
    aux_convention: str = typer.Option("output_of_layer", help="how --aux numbers read: output_of_layer "
                                       "(SpecForge/HF), input_to_layer (SGLang's layers_to_capture), or "
                                       f"a producer's name ({', '.join(AUX_READERS)}: a draft's aux ids as "
                                       "it reads them for the trace's target family; its architecture "
                                       "from the contract or --target)"),
    d2t: str = typer.Option("offset", "--d2t", help="how to read d2t: offset (what it holds: target = "
                            "draft + d2t[draft]) or direct (the misreading target = d2t[draft])"),
    engine: str | None = typer.Option(None, "--engine", help="compute the draft as this engine reads its "
                                      "config (norm_output, norm_before_fc, embedding and lm_head): sglang "
                                      "or specforge (default: the engine that recorded the trace)"),
    depths: int | None = typer.Option(None, min=1, help="draft depths to unroll (default: the trace's "
                                      "speculative num_steps, else its deepest recorded draft depth + 1, "
                                      "else 4)"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    force: bool = force_option("--out"),
    no_verify: bool = no_verify_option(),
) -> None:
    """Run a draft offline on recorded target tensors: accuracy per depth, expected accept length."""
    need_torch()
    from tracediff.report.progress import progress_bar
    from tracediff.report.replay import render_replay
    from tracediff.tools.replay import replay as run_replay

    try:
        with progress_bar("replaying", unit="rows") as progress:
            report = run_replay(trace, draft, target=target, out=out, aux=aux, aux_convention=aux_convention,
                                d2t=d2t, engine=engine, depths=depths, force=force, progress=progress,
                                verify=not no_verify)
    except InputError as exc:
        fail(exc.path, exc.problem)
    if as_json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        render_replay(console, report)


def compare_options(tol: list[str], mapping: list[str], align: str,
                    min_coverage: float) -> tuple[Tolerances, dict[str, str]]:
    """The options compare and bundle share, checked: one error line, exit 2, for a bad one."""
    from tracediff.diff.rename import parse_pair
    from tracediff.diff.tolerance import Tolerances

    try:
        tolerances = Tolerances.parse(tol)
    except ValueError as exc:
        fail("--tol", str(exc))
    if align not in ("prefix", "step"):
        fail("--align", f"takes 'prefix' or 'step', not {align!r}")
    if not 0 <= min_coverage <= 1:
        fail("--min-coverage", f"takes a share within 0..1, not {min_coverage}")
    rename: dict[str, str] = {}
    for item in mapping:
        try:
            name_b, name_a = parse_pair(item)
        except ValueError as exc:
            fail("--map", str(exc))
        if name_b in rename:
            fail("--map", f"{name_b!r} is mapped twice")
        rename[name_b] = name_a
    return tolerances, rename


@app.command()
def explain(
    a: Path = typer.Argument(..., help="baseline trace (e.g. training)"),
    b: Path = typer.Argument(..., help="trace to explain against it (e.g. serving)"),
    draft: Path = typer.Option(..., "--draft", help="draft checkpoint (config.json + model.safetensors)"),
    draft_b: Path | None = typer.Option(None, "--draft-b", help="B's draft checkpoint, when it differs from "
                                        "A's"),
    target: Path | None = typer.Option(None, "--target", help="target checkpoint directory (its embedding, "
                                       "and its lm_head where the engine takes it)"),
    depths: int | None = typer.Option(None, min=1, help="draft depths to unroll (default: the serving "
                                      "trace's speculative num_steps, as replay)"),
    as_json: bool = typer.Option(False, "--json", help="the explanation as JSON"),
    markdown: bool = typer.Option(False, "--markdown", help="the explanation as Markdown, for a bug report"),
    html: Path | None = typer.Option(None, "--html", help="also write it as one self-contained HTML page (a "
                                     "bar per run): a new file, or with --force a regular file to replace"),
    force: bool = force_option("the --html file"),
    no_verify: bool = no_verify_option(),
) -> None:
    """Which input costs how many accepted tokens: the draft replayed on A's inputs, B's, and swaps."""
    need_torch()
    from tracediff.report.explain import explanation_markdown, render_explanation

    if as_json and markdown:
        fail("--json", "choose one of --json and --markdown")
    inputs = [a, b, *checkpoint_files(draft), *(checkpoint_files(draft_b) if draft_b else []),
              *(checkpoint_files(target) if target else [])]
    if html is not None:
        from tracediff.trace.output import check_output

        guarded(html, lambda: check_output(html, inputs, force))  # before the replays, which may take long
    ex = _explanation(a, b, draft, draft_b, target, depths, not no_verify)
    if html is not None:
        from tracediff.report.explain_html import write_explain_html

        guarded(html, lambda: write_explain_html(ex, html, inputs, force))
    emit(as_json, markdown, ex.to_json, lambda: explanation_markdown(ex),
         lambda: render_explanation(console, ex))


@app.command()
def compare(
    a: Path = typer.Argument(..., help="baseline trace (e.g. training)"),
    b: Path = typer.Argument(..., help="trace to check against it (e.g. serving)"),
    tol: list[str] = typer.Option([], "--tol",
                                  help="per-name bounds, e.g. 'draft.*:cos>=0.999,max_abs<=1e-2'"),
    mapping: list[str] = typer.Option([], "--map", help="NAME_IN_B=NAME_IN_A for other producers' names"),
    map_file: Path | None = typer.Option(None, "--map-file", help="a file of NAME_IN_B = NAME_IN_A lines "
                                         "(or a JSON object); --map entries override it"),
    align: str = typer.Option("prefix", "--align", help="prefix: rows by token content (any producers); "
                              "step: rows by step and order (same producer, e.g. before vs after a change)"),
    min_coverage: float = typer.Option(0.95, "--min-coverage", help="share of each tensor's comparable rows "
                                       "that must align for a match (else: incomplete, exit 3)"),
    as_json: bool = typer.Option(False, "--json", help="the report as JSON (docs/REPORT.md)"),
    markdown: bool = typer.Option(False, "--markdown", help="the report as Markdown, for a bug report"),
    stop_at_first: bool = typer.Option(False, "--stop-at-first", help="stop reading at the first divergence "
                                       "(fast on large traces; tensors not fully read show as unchecked)"),
    html: Path | None = typer.Option(None, "--html", help="also write the report as one self-contained HTML "
                                     "page (heatmap, error curves, slots, tokens; opens in any browser): a "
                                     "new file, or with --force a regular file to replace"),
    same_target: bool = typer.Option(False, "--same-target", help="compare even when the target facts the "
                                     "contracts state (config sizes, embedding fingerprint) differ: you know "
                                     "the targets are the same model"),
    force: bool = force_option("the --html file"),
    no_verify: bool = no_verify_option(),
) -> None:
    """Align two traces by token prefix and draft depth; name the first diverging tensor and why.

    Exit 0 match, 1 diverged, 2 bad input or incomparable traces, 3 incomplete (too few rows compared)."""
    from tracediff.diff.rename import read_mapping_file
    from tracediff.tools.compare import compare as run_compare

    rename = {} if map_file is None else guarded(map_file, lambda: read_mapping_file(map_file))
    tolerances, given = compare_options(tol, mapping, align, min_coverage)
    rename = {**rename, **given}
    if as_json and markdown:
        fail("--json", "choose one of --json and --markdown")
    if html is not None:
        from tracediff.trace.output import check_output

        guarded(html, lambda: check_output(html, [a, b], force))  # before the compare, which may take long

    def run() -> Report:
        from tracediff.report.progress import progress_bar

        with progress_bar("comparing") as progress:
            return run_compare(a, b, tol=tolerances, rename=rename, align=align, progress=progress,
                               stop_at_first=stop_at_first, min_coverage=min_coverage,
                               same_target=same_target, verify=not no_verify)

    show_report(guarded(a, run), a, b, html, force, as_json, markdown)


def show_report(report: Report, a: Path, b: Path, html: Path | None, force: bool, as_json: bool,
                markdown: bool) -> NoReturn:
    """compare's output: the HTML page where asked, the report as text, JSON or Markdown, the exit code."""
    from tracediff.report.compare import render, to_markdown
    from tracediff.text import safe

    if html is not None:
        from tracediff.report.html import write_html

        guarded(html, lambda: write_html(report, html, force=force))
    emit(as_json, markdown, report.to_json, lambda: to_markdown(report), lambda: render(console, report))
    if report.verdict == "incomparable":
        print(safe(f"error: {b}: not comparable with {a}: {report.reasons[0]}"), file=sys.stderr)
    raise typer.Exit(report.exit_code)


@app.command()
def doctor(
    draft: Path = typer.Option(..., "--draft", help="draft checkpoint dir (config.json + model.safetensors)"),
    target: Path | None = typer.Option(None, "--target", help="target checkpoint dir (its config.json)"),
    server_args: str | None = typer.Option(
        None, "--server-args",
        help="the serving command's speculative arguments, e.g. '--speculative-num-steps 3 "
             "--speculative-eagle-topk 1'"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Static checks of a draft checkpoint against its target and serving arguments.

    Exit 0 when nothing is wrong, 1 when an error is found, 2 when the files cannot be read."""
    need_torch()
    from tracediff.report.doctor import render_findings
    from tracediff.tools.doctor import doctor as run_doctor

    report = guarded(draft, lambda: run_doctor(draft, target=target, server_args=server_args))
    if as_json:
        print(json.dumps(report.to_list(), indent=1))
    else:
        render_findings(console, list(report.findings))
    raise typer.Exit(report.exit_code)


@app.command("record", context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})
def record_command(
    command: list[str] = typer.Argument(None, help="the command to run (after --)", show_default=False),
    out: Path = typer.Option(..., "--out", "-o", help="the trace to write (.h5 or .arrow; per-rank files "
                             "NAME.rankN.EXT for several ranks)"),
    watch: list[str] = typer.Option([], "--watch", help="record these modules of any PyTorch program, by "
                                    "dotted-name glob ('*' = one part), e.g. 'model.layers.*'"),
    names: list[str] = typer.Option([], "--names", help="record only tensors whose names match"),
    exclude: list[str] = typer.Option([], "--exclude", help="leave out tensors whose names match"),
    every: int = typer.Option(1, "--every", help="record every N-th step"),
    requests: int | None = typer.Option(None, "--requests", help="record only the first N requests"),
    match_prefix: str | None = typer.Option(None, "--match-prefix", help="record only requests whose "
                                            "tokens start so, e.g. '128000,9906'"),
    plugin: list[str] = typer.Option([], "--plugin", help="another recording plugin module (one with "
                                     "at_startup(config, recorder))"),
    eager_only: bool = typer.Option(False, "--eager-only", help="a server that replays CUDA graphs: accept "
                                    "a trace of its eager forwards only"),
    queue_bytes: str | None = typer.Option(None, "--queue-bytes", help="each process's recording queue, "
                                           "e.g. 1GiB (default 256MiB); what does not fit is dropped, "
                                           "counted, and makes a compare incomplete"),
    on_full: str = typer.Option("drop", "--on-full", help="when the queue is full: drop (the host never "
                                "waits) or block (the host waits for room, up to 1 s a record)"),
    force: bool = force_option("--out (and its rank files)"),
) -> None:
    """Run CMD and record its tensors: tracediff record --out run.h5 OPTIONS -- CMD ARGS...

    Exits with CMD's exit code (2 for bad input, before anything starts)."""
    from dataclasses import replace

    from tracediff.record.launch import plugins_for
    from tracediff.record.launch import run as run_launch
    from tracediff.record.plugin import LaunchConfig

    argv = list(command or [])
    try:
        prefix = tuple(int(t) for t in match_prefix.split(",") if t.strip()) if match_prefix else None
    except ValueError:
        fail("--match-prefix", f"expected comma-separated token ids, got {match_prefix!r}")
    if on_full not in ("drop", "block"):
        fail("--on-full", f"expected drop or block, got {on_full!r}")
    queue = None
    if queue_bytes is not None:
        from tracediff.sizes import parse_size

        try:
            queue = parse_size(queue_bytes)
        except ValueError:
            fail("--queue-bytes", f"expected a size such as 256MiB or 1GB, got {queue_bytes!r}")
    config = LaunchConfig(out=str(out), plugins=(), watch=tuple(watch), names=tuple(names),
                          exclude=tuple(exclude), every=every, requests=requests, match_prefix=prefix,
                          eager_only=eager_only, queue_bytes=queue, on_full=on_full)
    config = replace(config, plugins=plugins_for(config, argv, plugin, PRODUCERS))
    for producer in PRODUCERS:
        if producer.plugin in config.plugins and (note := producer.advise(config, argv)):
            print(f"tracediff: note: {note}", file=sys.stderr)
    result = guarded(out, lambda: run_launch(config, argv, PRODUCERS, force=force))
    say_recorded(result, config)
    raise typer.Exit(result.exit_code)


def say_recorded(result: LaunchResult, config: LaunchConfig) -> None:
    """What ``tracediff record`` wrote: each file, closed or not and what it lacks, on stderr."""
    from tracediff.record.launch import nothing_recorded
    from tracediff.text import safe

    for f in result.files:
        state = "" if f.closed else (" (not closed: its process was killed, ended with os._exit, or its "
                                     "writer stopped; readable up to its last flush)")
        lacking = f"; {f.lacking}" if f.lacking else ""
        print(safe(f"tracediff: wrote {f.path}: {f.records} records{state}{lacking}"), file=sys.stderr)
    untokened = [safe(f.path) for f in result.files if f.row_keys in ("step_position", "mixed")]
    if untokened:
        print(f"tracediff: note: {', '.join(untokened)}: rows of calls without token ids are keyed by step "
              "and position only (placeholder token -1 - step): they align with another run of the same "
              "program, never with a trace of real tokens", file=sys.stderr)
    if not result.files:
        print(f"tracediff: {nothing_recorded(config, PRODUCERS, result.exit_code)}", file=sys.stderr)


import_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                         help="Other producers' dumps into traces.")
app.add_typer(import_app, name="import")


def add_importer(importer: Importer) -> None:
    """``tracediff import COMMAND``: the producer's function, its options, and its lines printed."""

    @functools.wraps(importer.run)
    def command(**options: Any) -> None:
        if importer.needs_torch:
            need_torch()
        for line in guarded(importer.command, lambda: list(importer.run(**options))):
            console.print(Text(line))

    import_app.command(importer.command)(command)


for _producer in PRODUCERS:
    for _importer in _producer.importers:
        add_importer(_importer)


def main() -> None:
    """The console entry point: the app, with a usage error (a missing argument, an option value of
    the wrong kind) as one ``error:`` line and exit 2, as every other bad input is, not click's box."""
    from typer import Abort

    try:  # typer >= 0.2x vendors click as typer._click; earlier ones run click itself
        from typer._click.exceptions import UsageError
    except ImportError:
        from click.exceptions import UsageError  # type: ignore[assignment]

    command = typer.main.get_command(app)
    try:
        code = command.main(standalone_mode=False)
    except UsageError as exc:
        if not exc.format_message():  # no arguments at all: the help was printed (no_args_is_help)
            sys.exit(exc.exit_code)
        where = f"tracediff {exc.ctx.info_name}" if exc.ctx is not None and exc.ctx.parent is not None \
            else "tracediff"
        print(safe(f"error: {where}: {exc.format_message()} (see --help)"), file=sys.stderr)
        sys.exit(2)
    except Abort:
        print("error: tracediff: aborted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
