"""Writing a benchmark result: results.json, results.md, up to three small plots, and RESULTS.md.

The JSON (schema 1) holds everything: ``meta`` (device, date, commit, command, versions, timer, copy
bandwidth), ``rows`` (one per workload, or per mask and pass for flex_route: status, decisions, every
candidate's gate result, samples, speedups with CIs, regret) and ``quality``. The markdown is a view of
it; ``bench --report`` rebuilds the markdown and plots from one or more JSON files (several suite calls
make one report), or updates the repository's benchmarks/RESULTS.md: there, each suite and device has
one section, replaced by the newest result (:func:`update_results_md`).
"""

from __future__ import annotations

import importlib
import itertools
import json
import math
import re
from pathlib import Path

from . import flex_route

MAIN_COLUMNS = ("workload", "unit", "baseline", "autotuned", "autotuned / baseline (95% CI)", "tune s",
                "heuristic", "heuristic / baseline (95% CI)", "oracle", "regret (95% CI)")
SETUP_COLUMNS = ("workload", "density", "create_block_mask s", "compiled", "convert s", "kept pairs")
TUNE_COLUMNS = ("workload", "first tune", "s", "second tune", "s", "same", "difference inside the noise")
COMPILE_COLUMNS = ("workload", "autotune, warm store: s", "off: s", "added s", "new decisions")
KIND_TITLES = {"dense": "Dense", "decode": "Decode", "varlen": "Varlen (packed)", "block_sparse": "Block-sparse",
               "backward": "Backward (forward + backward kernels)", "flex_route": "flex_attention routed",
               "paged": "Paged KV cache", "fp8": "fp8 attention against our bf16 choice",
               "tuning-cost": "Tuning cost", "overhead": "Host time per call", "training": "Training steps"}
# suites whose results file (host_suites.py) holds rows of its own: its module's summary() is its RESULTS.md table
SUMMARY_SUITES = ("paged", "fp8", "tuning-cost", "overhead", "training")
SMOKE_BANNER = "**Smoke run: tiny shapes, possibly on a CPU. These numbers mean nothing.**"
# benchmarks/RESULTS.md: `bench --report` rewrites the sections between these two lines
SECTIONS_BEGIN = "<!-- bench sections: `python -m inductor_attn bench --report` replaces one per suite and device -->"
SECTIONS_END = "<!-- end of bench sections -->"
_SECTION = re.compile(r"<!-- bench (?P<suite>[\w-]+) on (?P<device>[^>]+?) -->\n.*?<!-- /bench -->\n", re.S)
MAX_NOTES = 25
# where a run's results.md and RESULTS.md send readers for how the numbers are made
METHOD_DOC = "docs/benchmarks.md"


# -------------------------------------------------------------------------------------------- files
def write_results(result: dict, out_dir: Path, plots: bool = True) -> list[Path]:
    """results.json, results.md, RESULTS.md (a copy to publish) and, with ``plots``, the PNGs."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "results.md", out_dir / "RESULTS.md"]
    paths[0].write_text(json.dumps(result, indent=1, default=_jsonable))
    paths[1].write_text(render_markdown(result))
    paths[2].write_text(render_results_md(result))
    if plots:
        paths += write_plots(result, out_dir)
    return paths


def cell(text: str) -> str:
    """``text`` for a markdown table cell: its pipes ("paged|sdpa", in names and in errors that quote them) escaped,
    or they would split the cell."""
    return text.replace("|", "\\|")


def _jsonable(x):
    return str(x)


def merge(runs: list[dict], paths: list[Path]) -> dict:
    """Merge the parsed results.json files ``runs`` (read from ``paths``, named in errors) into one result: rows in
    run order, each run's meta kept in ``runs``, and the runs' quality sections joined (:func:`_merge_quality`).
    A workload of one suite measured by several files on one device keeps the last file's row, in the place of the
    first: re-running one shard refreshes its rows and leaves the others.

    >>> meta = {"device": "H200"}
    >>> old = {"schema": 1, "meta": meta, "rows": [{"name": "w1", "v": 1}, {"name": "w2", "v": 1}]}
    >>> new = {"schema": 1, "meta": meta, "rows": [{"name": "w1", "v": 2}]}
    >>> [(r["name"], r["v"], r["run"]) for r in merge([old, new], [Path("a"), Path("b")])["rows"]]
    [('w1', 2, 1), ('w2', 1, 0)]
    """
    if not runs:
        raise ValueError("give at least one results.json")
    for p, r in zip(paths, runs):
        if r.get("schema") != 1:
            raise ValueError(f"{p}: not a schema-1 inductor_attn bench result")
        if not isinstance(r.get("rows"), list):
            raise ValueError(f"{p}: a kernel-suite results file without its rows")
    rows: dict[tuple, dict] = {}
    for i, r in enumerate(runs):
        for row in r["rows"]:  # flex_route has a row per pass of one name
            rows[(row.get("kind"), row["name"], row.get("pass"), r["meta"].get("device"))] = {**row, "run": i}
    merged = {"schema": 1, "meta": runs[0]["meta"], "runs": [r["meta"] for r in runs], "rows": list(rows.values()),
              "quality": None}
    qualities = [(r["quality"], r["meta"].get("device")) for r in runs if r.get("quality")]
    if qualities:
        merged["quality"] = _merge_quality(qualities)
    return merged


def _merge_quality(qualities: list[tuple[dict, str | None]]) -> dict:
    """The (quality section, device) of several runs as one: tune and compile entries of one workload and device
    keep the last run's, as rows do (:func:`merge`); notes are all kept."""
    tunes: dict[tuple, dict] = {}
    compiles: dict[tuple, dict] = {}
    notes: list = []
    for q, device in qualities:
        tunes.update(((t.get("name"), device), t) for t in q.get("tunes") or [])
        compiles.update(((c.get("name"), device), c) for c in q.get("compile") or [])
        notes += q.get("notes") or []
    return {"tunes": list(tunes.values()), "compile": list(compiles.values()), "notes": notes}


# ----------------------------------------------------------------------------------------- markdown
def render_markdown(result: dict) -> str:
    rows = result["rows"]
    parts = [SMOKE_BANNER if _smoke(result) else "", _summary(rows)]
    for kind, title in KIND_TITLES.items():
        mine = [r for r in rows if r["kind"] == kind]
        if mine:
            parts.append(f"## {title}\n\n" + _suite_tables(kind, mine))
    parts.append(_quality_section(result.get("quality")))
    return "\n\n".join(p for p in parts if p) + "\n"


def _smoke(result: dict) -> bool:
    return any(m.get("smoke") for m in result.get("runs") or [result["meta"]])


def _suite_tables(kind: str, rows: list[dict]) -> str:
    return flex_route.table(rows) if kind == "flex_route" else _kind_section(rows)


def update_results_md(result: dict, path: Path) -> list[str]:
    """Replace (or add) the section of each suite and device in ``result`` in the RESULTS.md at ``path``:
    its date, commit, command and versions, and its tables. Other sections and the hand-written text
    around them stay. Returns the headings written."""
    if _smoke(result):
        raise ValueError("smoke results are not measurements: they never go into RESULTS.md")
    runs = result.get("runs") or [result["meta"]]
    sections, written = {}, []
    for kind in KIND_TITLES:
        mine = [r for r in result["rows"] if r["kind"] == kind]
        for device in sorted({runs[r.get("run", 0)]["device"] for r in mine}):
            rows = [r for r in mine if runs[r.get("run", 0)]["device"] == device]
            metas = [runs[i] for i in sorted({r.get("run", 0) for r in rows})]
            ok = [r for r in rows if r["status"] == "ok"]
            name = f"{kind}-{_slug(device)}"
            plot = (_summary_plot(flex_route, rows, name, Path(path)) if kind == "flex_route" else
                    _plot_link(name, lambda plt, ok=ok: _plot_speedups(plt, ok), Path(path)))
            body = f"{_provenance(metas)}{plot}\n\n{_suite_tables(kind, rows)}\n"
            sections[(kind, device)] = _results_section(kind, device, body)
            written.append(f"{KIND_TITLES[kind]} on {device}")
    _replace_sections(Path(path), sections)
    return written


PLOTS = "plots"  # beside RESULTS.md, git-ignored: drawn again by every `bench --report`


def _plot_link(name: str, draw, results_md: Path) -> str:
    """Draw a figure, ``draw(pyplot)`` (None: nothing to draw), into ``plots/<name>.png`` beside RESULTS.md; the text
    that links it at the end of its section's provenance, or "" (nothing drawn, or no matplotlib)."""
    plt = _pyplot()
    fig = None if plt is None else draw(plt)
    if fig is None:
        return ""
    file = f"{name}.png"
    path = results_md.parent / PLOTS / file
    path.parent.mkdir(exist_ok=True)
    _save(plt, fig, path)
    return f"; plot (drawn by `bench --report`, not committed): [{PLOTS}/{file}]({PLOTS}/{file})"


def _slug(device: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")


def _summary_plot(module, result, name: str, results_md: Path) -> str:
    """The figure of a suite whose module describes its own (the summary suites, flex_route): the bars of
    ``module.bars(result)`` (``xlabel``, ``labels``, ``series`` {name: values}, optional ``ref``), linked as
    :func:`_plot_link` does."""
    def draw(plt):
        data = module.bars(result)
        if data is None:
            return None
        series = [(n, values, None) for n, values in data["series"].items()]
        return _bars(plt, data["labels"], series, data["xlabel"], ref=data.get("ref"))
    return _plot_link(name, draw, results_md)


def summary_suite(data: dict) -> str | None:
    """The suite of ``SUMMARY_SUITES`` whose results file ``data`` is, or None (a schema-1 result)."""
    suite = data.get("meta", {}).get("suite")
    return suite if "schema" not in data and suite in SUMMARY_SUITES else None


def update_summary_sections(datas: list[dict], path: Path) -> list[str]:
    """Replace (or add) the section of each suite (of ``SUMMARY_SUITES``) and device of the results files ``datas``
    in the RESULTS.md at ``path``; the titles of those sections. The files of one suite and device (its shards, its
    ``--part``s) make one section: their rows in turn, each other part from the last file that has it."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for data in datas:
        groups.setdefault((summary_suite(data), data["meta"]["device"]), []).append(data)
    sections, old = {}, _split(Path(path))[1]
    for (suite, device), group in groups.items():
        # lazy: the suites import the tuner
        module = importlib.import_module(f".{suite.replace('-', '_')}", __package__)
        name = f"{suite}-{_slug(device)}"
        if getattr(module, "PARTS", None) is None:
            merged = _merged(group, module)
            body = (_provenance([data["meta"] for data in group]) + _summary_plot(module, merged, name, Path(path))
                    + "\n\n" + module.summary(merged) + "\n" + _not_run(merged))
        else:
            body = _part_blocks(module, group, old.get((suite, device), ""), name, Path(path))
        sections[(suite, device)] = _results_section(suite, device, body)
    _replace_sections(Path(path), sections)
    return [f"{KIND_TITLES[suite]} on {device}" for suite, device in sections]


_PART = re.compile(r"<!-- part (?P<part>[\w-]+) -->\n.*?(?=<!-- part |<!-- /bench -->)", re.S)


def _part_blocks(module, group: list[dict], old_section: str, name: str, results_md: Path) -> str:
    """A suite whose runs may measure one part each (``--part``: what fits one device call) names its parts and
    their results' keys in ``module.PARTS``; its section holds a block per part, each with the provenance of the
    files that measured it and its figure (``plots/<name>-<part>.png``). A part that no file of ``group``
    measured keeps its block of ``old_section``: its files may be gone."""
    old = {m["part"]: m.group(0).rstrip() + "\n" for m in _PART.finditer(old_section)}
    blocks = []
    for part, keys in module.PARTS.items():
        covering = [data for data in group if data["meta"].get("part", "all") in ("all", part)]
        if covering:
            merged = _merged(covering, module)
            result = {"rows": [], **{k: merged[k] for k in keys if k in merged}}
            plot = _summary_plot(module, result, f"{name}-{part}", results_md)
            blocks.append(f"<!-- part {part} -->\n{_provenance([d['meta'] for d in covering])}{plot}\n\n"
                          f"{module.summary(result)}\n{_not_run(result)}")
        elif part in old:
            blocks.append(old[part])
    return "\n".join(blocks)


def _merged(group: list[dict], module) -> dict:
    """One result from the files of one suite and device: the suite module's ``merge(group)`` where it keeps its
    rows under keys of its own (tuning-cost), else their rows and the shapes they did not reach (``not_run``) in
    turn, each other key from the last file that has it."""
    if hasattr(module, "merge"):
        return module.merge(group)
    listed = ("rows", "not_run")
    merged = {key: [x for data in group for x in data.get(key, ())] for key in listed}
    for data in group:
        merged.update({k: v for k, v in data.items() if k != "meta" and k not in listed})
    return merged


def _not_run(result: dict) -> str:
    """A line naming the shapes a run stopped before (host_suites' ``not_run``), or nothing."""
    names = result.get("not_run")
    return f"\nNot measured, the run stopped before them: {', '.join(names)}.\n" if names else ""


def _split(path: Path) -> tuple[str, dict, str]:
    """The RESULTS.md at ``path`` as (the text before its bench sections block, the sections by (suite, device),
    the text after it)."""
    text = path.read_text()
    if SECTIONS_BEGIN not in text or SECTIONS_END not in text:
        raise ValueError(f"{path} has no bench sections block: expected the lines {SECTIONS_BEGIN!r} and "
                         f"{SECTIONS_END!r}")
    head, rest = text.split(SECTIONS_BEGIN, 1)
    body, tail = rest.split(SECTIONS_END, 1)
    return head, {(m["suite"], m["device"]): m.group(0) for m in _SECTION.finditer(body)}, tail


def _replace_sections(path: Path, new: dict) -> None:
    """Write ``new`` ({(suite, device): section}) over those sections of RESULTS.md, keeping the others and the
    hand-written text around them."""
    head, sections, tail = _split(path)
    sections.update(new)
    order = list(KIND_TITLES)
    ordered = sorted(sections.items(), key=lambda item: (order.index(item[0][0]) if item[0][0] in order else
                                                           len(order), item[0][1]))
    body = "\n" + "\n".join(section for _, section in ordered) + "\n"
    path.write_text(head + SECTIONS_BEGIN + body + SECTIONS_END + tail)


def _results_section(kind: str, device: str, body: str) -> str:
    """One RESULTS.md section: heading, then ``body``: where every number comes from, the tables."""
    return f"<!-- bench {kind} on {device} -->\n### {KIND_TITLES[kind]}: {device}\n\n{body}<!-- /bench -->\n"


def _provenance(metas: list[dict]) -> str:
    """A line per run of consecutive results files that share commit, versions and timer (the shards of one
    run): their dates, the commit, each file's command, the versions."""
    lines = []
    for _, same in itertools.groupby(metas, key=lambda m: (m["commit"], m["versions"], m.get("timer"))):
        same = list(same)
        m = same[0]
        lines.append(f"- {_date_span([x['date'] for x in same])}, commit {m['commit']}: "
                     + _commands_text([x["command"] for x in same]) + "; " + versions_text(m["versions"])
                     + (f"; {m['timer']} timer" if "timer" in m else ""))
    return "\n".join(lines)


def _commands_text(commands: list[str]) -> str:
    """A run's commands, written once where they differ only in ``--shard K/N`` and ``--out``.

    >>> _commands_text(["bench --shard 1/8 --out /o/tc1", "bench --shard 3/8 --out /o/tc3"])
    '`bench --shard K/8 --out DIR` for K in 1, 3'
    >>> _commands_text(["bench --suite paged --out /o/p", "bench --suite fp8 --out /o/f"])
    '`bench --suite paged --out /o/p`, `bench --suite fp8 --out /o/f`'
    """
    shard = re.compile(r"--shard (\d+)/(\d+)")
    shards = [shard.search(c) for c in commands]
    templates = {re.sub(r"--out \S+", "--out DIR", shard.sub(r"--shard K/\2", c)) for c in commands}
    if len(commands) > 1 and all(shards) and len(templates) == 1:
        return f"`{templates.pop()}` for K in {', '.join(s.group(1) for s in shards)}"
    return ", ".join(f"`{c}`" for c in commands)


def _date_span(dates: list[str]) -> str:
    """The first and last of ``dates`` ("YYYY-MM-DD HH:MM UTC"), one day written once.

    >>> _date_span(["2026-11-29 22:02 UTC", "2026-11-29 21:59 UTC"]), _date_span(["2026-11-29 21:59 UTC"])
    ('2026-11-29 21:59-22:02 UTC', '2026-11-29 21:59 UTC')
    >>> _date_span(["2026-11-29 23:59 UTC", "2026-11-30 00:10 UTC"])
    '2026-11-29 23:59 UTC to 2026-11-30 00:10 UTC'
    """
    first, last = min(dates), max(dates)
    if first == last:
        return first
    day, clock = first.split(" ", 1)
    if last.startswith(day + " ") and clock.endswith(" UTC"):
        return f"{day} {clock.removesuffix(' UTC')}-{last.split(' ', 1)[1]}"
    return f"{first} to {last}"


def versions_text(versions: dict) -> str:
    """A run's library versions as RESULTS.md writes them: "torch 2.11.0+cu130, triton 3.6.0"."""
    return ", ".join(f"{k} {v}" for k, v in versions.items())


def render_results_md(result: dict) -> str:
    runs = result.get("runs") or [result["meta"]]
    meta = runs[0]
    head = ["# Benchmark results" + (" (smoke run: these numbers mean nothing)" if _smoke(result) else ""), ""]
    head += [
        "Generated by `python -m inductor_attn bench`; do not edit by hand (rerun, see the commands below).", "",
        f"- device: {meta['device']} ({meta['capability']}, {meta['sm_count']} SMs)",
        f"- date: {', '.join(sorted({m['date'] for m in runs}))}",
        f"- commit: {', '.join(sorted({m['commit'] for m in runs}))}",
        "- versions: " + versions_text(meta["versions"]),
        f"- timer: {meta['timer']}, {meta['rounds']} interleaved rounds per workload",
        "- device-to-device copy bandwidth (read + write), measured in the run: "
        + ", ".join(_gbps_text(m.get("copy_gbps")) for m in runs),
        "- commands:",
        *[f"  - `{m['command']}` ({m.get('elapsed_s') or 0:.0f} s)" for m in runs],
    ]
    return ("\n".join(head) + "\n\n" + render_markdown(result)
            + f"\n\nHow these numbers are made: {METHOD_DOC} in the inductor_attn repository.\n")


def _gbps_text(x) -> str:
    return "?" if x is None else f"{x:.0f} GB/s"


def _summary(rows: list[dict]) -> str:
    lines = []
    for kind in KIND_TITLES:
        mine = [r for r in rows if r["kind"] == kind]
        if not mine or kind == "flex_route":  # no decision of ours to compare: its own table says all
            continue
        ok = [r for r in mine if r["status"] == "ok"]
        auto = [r["choices"]["autotune"].get("speedup") for r in ok]
        best = [r["choices"]["oracle"].get("speedup") for r in ok]
        regrets = sorted(r["regret"] for r in ok if r.get("regret") is not None)
        wrong = sum(e["status"] == "wrong" for r in ok for e in r["entries"])
        lines.append(f"| {kind} | {len(ok)} | {len(mine) - len(ok)} | {_geomean(auto, len(ok))} | "
                     f"{_geomean(best, len(ok))} | "
                     f"{_pct(regrets[len(regrets) // 2]) if regrets else ''} | "
                     f"{_pct(regrets[-1]) if regrets else ''} | {wrong} |")
    if not lines:
        return ""
    return "\n".join(["## Summary", "", "| suite | workloads measured | not measured | autotuned / baseline (geomean) "
                      "| oracle / baseline (geomean) | median regret | worst regret | wrong candidates |",
                      "|---|---|---|---|---|---|---|---|", *lines])


def _geomean(xs, rows: int) -> str:
    """The geomean of the speedups ``xs`` of ``rows`` measured rows, saying how many it left out (a pick that
    failed, or a baseline that did not run, has none).

    >>> _geomean([2.0, None, 2.0], 3)
    '2.000x (over 2 of 3)'
    """
    xs = [x for x in xs if x]
    if not xs:
        return ""
    text = f"{math.exp(sum(math.log(x) for x in xs) / len(xs)):.3f}x"
    return text if len(xs) == rows else f"{text} (over {len(xs)} of {rows})"


def _pct(x) -> str:
    return f"{100 * x:.1f}%"


def _kind_section(rows: list[dict]) -> str:
    ok = [r for r in rows if r["status"] == "ok"]
    parts = []
    if ok:
        parts.append(_table(MAIN_COLUMNS, [_main_cells(r) for r in ok]))
        parts.append(_defaults_table(ok))
    if any(r["kind"] == "block_sparse" for r in ok):
        parts.append("Mask construction (not part of the attention times):\n\n"
                     + _table(SETUP_COLUMNS, [_setup_cells(r) for r in ok]))
    notes = _notes(rows)
    if notes:
        parts.append("Not timed, wrong, failed, pruned or not measured:\n\n" + "\n".join(notes))
    return "\n\n".join(p for p in parts if p)


def _table(columns, rows) -> str:
    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns)
    return head + "".join("\n| " + " | ".join(str(c) for c in cells) + " |" for cells in rows)


def _value_text(d: dict, metric: str) -> str:
    if metric == "GB/s":
        if d.get("gbps") is None:
            return ""
        frac = d.get("frac_copy")
        return f"{d['gbps']:.0f}" + (f" ({100 * frac:.0f}%)" if frac is not None else "")
    v = d.get("tflops")
    return "" if v is None else f"{v:.0f}" if v >= 10 else f"{v:.2f}"


def _unit(row: dict) -> str:
    return "GB/s (% copy)" if row["metric"] == "GB/s" else "TF/s"


def _pick_text(d: dict, metric: str) -> str:
    if not d.get("choice"):
        return "none"
    value = _value_text(d, metric)
    return f"{value} `{d['choice']}`" if value else f"`{d['choice']}` ({d.get('status')})"


def _ci_text(d: dict) -> str:
    if d.get("speedup") is None:
        return ""
    return f"{d['speedup']:.2f}x ({d['ci_low']:.2f}-{d['ci_high']:.2f})"


def _main_cells(row: dict) -> list[str]:
    m = row["metric"]
    base = row.get("baseline")
    base_entry = next((e for e in row["entries"] if base and e["name"] == base["name"]), {})
    auto, heur, oracle = (row["choices"][k] for k in ("autotune", "heuristic", "oracle"))
    tune_s = auto.get("tune_s")
    regret = ""
    if row.get("regret") is not None:
        lo, hi = row["regret_ci"]
        regret = f"{_pct(row['regret'])} ({_pct(lo)}-{_pct(hi)})"
    tune = "" if tune_s is None else f"{tune_s:.1f}" + (" (reused)" if auto.get("reused_from") else "")
    return [row["name"], _unit(row), f"{_value_text(base_entry, m)} {base['label']}" if base else "none",
            _pick_text(auto, m), _ci_text(auto), tune,
            _pick_text(heur, m), _ci_text(heur), _pick_text(oracle, m), regret]


def _defaults_table(rows: list[dict]) -> str:
    labels = []
    for r in rows:
        for d in r["defaults"]:
            if d.get("choice") and d["label"] not in labels:
                labels.append(d["label"])
    users = []
    for r in rows:
        for e in r["entries"]:
            if e["kind"] == "user" and e["name"] != (r.get("baseline") or {}).get("name") and e["name"] not in users:
                users.append(e["name"])
    if not labels and not users:
        return ""
    cells = []
    for r in rows:
        by_label = {d["label"]: d for d in r["defaults"]}
        by_name = {e["name"]: e for e in r["entries"]}
        line = [r["name"], _unit(r)]
        line += [_status_or_value(by_label.get(label, {}), r["metric"]) for label in labels]
        line += [_status_or_value(by_name.get(name, {}), r["metric"]) for name in users]
        cells.append(line)
    return "Each backend's own default config, and user baselines other than the row's baseline:\n\n" + _table(
        ("workload", "unit", *labels, *users), cells)


def _status_or_value(d: dict, metric: str) -> str:
    value = _value_text(d, metric)
    if value:
        return value
    status = d.get("status")
    return "" if status in (None, "n/a", "none") else status


def _setup_cells(row: dict) -> list[str]:
    s = row.get("setup_s") or {}
    density = _density(row)
    return [row["name"], density, _num(s.get("create_block_mask_s"), ".3f"),
            "yes" if s.get("create_block_mask_compiled") else "no", _num(s.get("convert_s"), ".3f"),
            f"{row['pairs']:,}"]


def _density(row: dict) -> str:
    for item in row["problem"].split(","):
        if item.startswith("density="):
            return f"{float(item.split('=')[1]):.3f}"
    return ""


def _num(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


def _notes(rows: list[dict]) -> list[str]:
    """Workloads not measured, and every entry that is wrong, failed, or is a named choice (a mode's
    pick, a backend default) that was not timed, with its reason; one line per distinct finding, with
    the workloads it applies to. Backend defaults with no candidate share a line where their reasons and
    workloads are the same (SDPA's three kernels refuse a problem alike), and one backend default's reasons
    share a line (split-K decode refuses each prefill length in its own words)."""
    found: dict[str, list[str]] = {}
    refused: dict[str, dict[str, list[str]]] = {}  # backend default -> reason -> workloads
    for r in rows:
        if r["status"] != "ok":
            found.setdefault(f"{r['status']}: {r['reason']}", []).append(r["name"])
            continue
        if r.get("forward_choice"):
            found.setdefault(f"every candidate and the autotuned choice ran after the autotuned forward "
                             f"`{r['forward_choice']}`", []).append(r["name"])
        owner = r["choices"]["autotune"].get("reused_from")
        if owner:
            found.setdefault(f"autotuned decision reused from the store: same decision bucket as {owner}",
                             []).append(r["name"])
        named = {d["choice"]: d["label"] for d in r["defaults"] if d.get("choice")}
        named.update({c["choice"]: f"{mode} choice" for mode, c in r["choices"].items() if c.get("choice")})
        for e in r["entries"]:
            untimed_pick = e["name"] in named and not e.get("median_ms")
            if e["status"] in ("wrong", "failed") or untimed_pick:
                what = f"`{e['name']}`" + (f" ({named[e['name']]})" if e["name"] in named else "")
                found.setdefault(f"{what} {e['status']}: {e['reason']}", []).append(r["name"])
        for d in r["defaults"]:
            if not d.get("choice"):
                reason = d.get("reason") or "no candidate for this problem"
                refused.setdefault(d["label"], {}).setdefault(reason, []).append(r["name"])
    every = [r["name"] for r in rows]
    notes = [f"- {text} ({_workloads_text(names, every)})" for text, names in found.items()]
    labels: dict[str, list[str]] = {}
    for label, reasons in refused.items():
        text = "; ".join(f"{reason} ({_workloads_text(names, every)})" for reason, names in reasons.items())
        labels.setdefault(text, []).append(label)
    notes += [f"- {', '.join(names)}: {text}" for text, names in labels.items()]
    if len(notes) > MAX_NOTES:
        notes = notes[:MAX_NOTES] + [f"- ... and {len(notes) - MAX_NOTES} more in results.json"]
    return notes


def _workloads_text(names: list[str], every: list[str]) -> str:
    """``names`` among the table's workloads ``every``, or the few left out where that is shorter.

    >>> _workloads_text(["a", "b", "c", "d"], ["a", "b", "c", "d", "e"]), _workloads_text(["a"], ["a", "b"])
    ('all 5 workloads but e', 'a')
    """
    rest = [n for n in every if n not in names]
    if len(every) > 1 and len(rest) < len(names) - 1:
        return f"all {len(every)} workloads" + (f" but {'; '.join(rest)}" if rest else "")
    return "; ".join(names)


def _quality_section(q: dict | None) -> str:
    if not q:
        return ""
    parts = ["## Tuning quality"]
    tunes = q.get("tunes") or []
    if tunes:
        same = sum(t["same"] for t in tunes)
        inside = sum(bool(t.get("inside_noise")) for t in tunes if not t["same"])
        differ = len(tunes) - same
        text = (f"Two fresh tunes in two processes, each on its own empty store: {same} of {len(tunes)} "
                f"decisions identical ({100 * same / len(tunes):.0f}%)")
        parts.append(text + (f"; of the {differ} that differ, {inside} lie inside the tuner's tie margin (noise)."
                             if differ else "."))
        parts.append(_table(TUNE_COLUMNS, [[t["name"], f"`{t['first']}`", _num(t.get("first_s"), ".1f"),
                                            f"`{t['second']}`", _num(t.get("second_s"), ".1f"),
                                            "yes" if t["same"] else "no",
                                            "" if t["same"] else ("yes" if t.get("inside_noise") else "no")]
                                           for t in tunes]))
    comp = q.get("compile") or []
    if comp:
        parts.append("Compile time added by inductor_attn in a new process with the decisions stored "
                     "(`torch.compile` + first call):\n\n" + _table(COMPILE_COLUMNS, [
                         [c["name"], _num(c.get("autotune_s"), ".2f"), _num(c.get("off_s"), ".2f"),
                          _num(c.get("added_s"), "+.2f"), _num(c.get("new_decisions"), "d")] for c in comp]))
    if q.get("notes"):
        parts.append("\n".join(f"- {n}" for n in q["notes"]))
    return "\n\n".join(parts)


# -------------------------------------------------------------------------------------------- plots
def write_plots(result: dict, out_dir: Path) -> list[Path]:
    """speedups.png, decode_bandwidth.png and tuning.png (each only when there is something to draw);
    none when matplotlib is missing (its absence is noted in the JSON's meta)."""
    plt = _pyplot()
    if plt is None:
        result["meta"]["plots"] = "skipped: matplotlib is not installed"
        return []
    ok = [r for r in result["rows"] if r["status"] == "ok" and r["kind"] != "flex_route"]
    paths = []
    for name, draw in (("speedups.png", _plot_speedups), ("decode_bandwidth.png", _plot_decode),
                       ("tuning.png", _plot_tuning)):
        fig = draw(plt, ok)
        if fig is not None:
            paths.append(_save(plt, fig, Path(out_dir) / name))
    return paths


def _pyplot():
    """matplotlib's pyplot on the file-only backend, or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _bars(plt, labels, series, xlabel, ref=None):
    """Horizontal grouped bars: ``series`` = [(name, values, (lows, highs) or None)]."""
    n = len(labels)
    fig, ax = plt.subplots(figsize=(8, 0.32 * n * max(1, len(series) / 2) + 1.4))
    height = 0.8 / len(series)
    for i, (name, values, err) in enumerate(series):
        ys = [y + i * height for y in range(n)]
        vals = [v if v is not None else 0.0 for v in values]
        xerr = None
        if err is not None:
            xerr = [[max(v - lo, 0) if lo is not None else 0 for v, lo in zip(vals, err[0])],
                    [max(hi - v, 0) if hi is not None else 0 for v, hi in zip(vals, err[1])]]
        ax.barh(ys, vals, height=height, xerr=xerr, label=name, capsize=2)
    if ref is not None:
        ax.axvline(ref, color="black", linewidth=0.8)
    ax.set_yticks([y + 0.4 - height / 2 for y in range(n)], labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel, fontsize=8)
    ax.legend(fontsize=7)
    return fig


def _plot_speedups(plt, rows):
    """Points with 95% CI bars on a log axis: speedups run from below 1 to 20x (split-K decode)."""
    rows = [r for r in rows if r.get("baseline")]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(rows) + 1.4))
    for i, (mode, marker) in enumerate((("autotune", "o"), ("heuristic", "s"), ("oracle", "^"))):
        ys, xs, lows, highs = [], [], [], []
        for y, r in enumerate(rows):
            p = r["choices"][mode]
            if p.get("speedup"):
                ys.append(y + (i - 1) * 0.2)
                xs.append(p["speedup"])
                lows.append(p["speedup"] - p["ci_low"])
                highs.append(p["ci_high"] - p["speedup"])
        ax.errorbar(xs, ys, xerr=[lows, highs], fmt=marker, markersize=4, capsize=2, label=mode)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter

    ticks = FuncFormatter(lambda x, _: f"{x:.3g}x")  # 1.2x, not log scale's 1.2 x 10^0
    ax.xaxis.set_major_formatter(ticks)
    ax.xaxis.set_minor_formatter(ticks)
    ax.set_yticks(range(len(rows)), [r["name"] for r in rows], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("speedup over the row's baseline (95% CI, log scale)", fontsize=8)
    ax.legend(fontsize=7)
    return fig


def _plot_decode(plt, rows):
    rows = [r for r in rows if r["metric"] == "GB/s"]
    if not rows:
        return None
    series = []
    for label in ("baseline", "autotune", "oracle"):
        vals = []
        for r in rows:
            if label == "baseline":
                name = (r.get("baseline") or {}).get("name")
                d = next((e for e in r["entries"] if e["name"] == name), {})
            else:
                d = r["choices"][label]
            vals.append(d.get("frac_copy"))
        series.append((label, vals, None))
    return _bars(plt, [r["name"] for r in rows], series, "share of the measured copy bandwidth", ref=1.0)


def _plot_tuning(plt, rows):
    rows = [r for r in rows if r["choices"]["autotune"].get("tune_s") is not None]
    if not rows:
        return None
    fig = _bars(plt, [r["name"] for r in rows], [("tuning s", [r["choices"]["autotune"]["tune_s"] for r in rows],
                                                    None)], "seconds to tune (first time in the run)")
    ax = fig.axes[0]
    ax.margins(x=0.2)  # room for the regret labels right of the bars
    for y, r in enumerate(rows):
        if r.get("regret") is not None:
            ax.annotate(f"regret {_pct(r['regret'])}", (r["choices"]["autotune"]["tune_s"], y), fontsize=6,
                        xytext=(3, -2), textcoords="offset points")
    return fig
