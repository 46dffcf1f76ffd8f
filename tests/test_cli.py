"""python -m inductor_attn cache ... on a store filled through the public API."""

import contextlib
import json
import os
import sqlite3
import subprocess
import sys

import pytest
import torch
from fakes import FakeBackend, FakeTimer, timed_with_fakes
from test_store import _simulate_read_only, decision_row

import inductor_attn
from inductor_attn.backends import only_backends
from inductor_attn.cli import main
from inductor_attn.store.db import DecisionStore
from inductor_attn.store.keys import key_of
from inductor_attn.tuning.decisions import forget_decisions
from inductor_attn.tuning.step_cost import OP_IN_GRAPH_MS


@pytest.fixture
def one_decision(monkeypatch):
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    b = FakeBackend("b", {"x=1": (0.5, 0.01)}, fail=())
    c = FakeBackend("c", {"default": (0.1, 0.01)}, wrong={"default"})
    timed_with_fakes(monkeypatch, a, b, c)
    q = torch.randn(1, 2, 32, 16)
    with only_backends(a, b, c), inductor_attn.tuning_mode("autotune"):
        inductor_attn.attention(q, q, q, causal=True)
    return inductor_attn.cache.list_decisions()[0]["key"]


def test_list_explain_show(one_decision, capsys):
    assert main(["cache", "list"]) == 0
    assert "b:x=1" in capsys.readouterr().out
    assert main(["cache", "explain", one_decision[:10]]) == 0
    text = capsys.readouterr().out
    assert "winner:           b:x=1" in text and "wrong" in text and "rel. error" in text
    assert main(["cache", "show", one_decision[:10]]) == 0
    assert json.loads(capsys.readouterr().out)["winner"] == "b:x=1"


def test_export_clear_import_plot(one_decision, tmp_path, capsys):
    assert main(["cache", "export", str(tmp_path / "d.json")]) == 0
    assert main(["cache", "clear"]) == 0
    assert inductor_attn.cache.list_decisions() == []
    assert main(["cache", "import", str(tmp_path / "d.json")]) == 0
    assert len(inductor_attn.cache.list_decisions()) == 1
    assert main(["cache", "plot", str(tmp_path / "d.png")]) == 0
    assert (tmp_path / "d.png").read_bytes()[:4] == b"\x89PNG"


def test_unknown_key_is_an_error_not_a_traceback(capsys):
    assert main(["cache", "explain", "nope"]) == 2
    assert "no decision with a key starting with 'nope'" in capsys.readouterr().err


def _store_path():
    return inductor_attn.cache.get_store().path


def _rewrite(key: str, **changes) -> dict:
    """The stored row of ``key`` with ``changes`` to its versions, under the key those versions give."""
    row = inductor_attn.cache.show(key)
    versions = {**row["versions"], **changes}
    fields = {"op": row["op"], "problem": row["problem"], "device": row["device"], "versions": versions}
    return {**row, **fields, "key": key_of(fields)}


# -- errors are one line, name the file, and exit 2 (bad input) or 1 (unusable store) ----------------------
def test_import_of_a_missing_file_is_one_line_naming_it(tmp_path, capsys):
    assert main(["cache", "import", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path / 'missing.json'}: No such file or directory\n"


def test_import_of_garbage_names_the_file(tmp_path, capsys):
    (tmp_path / "garbage.json").write_text("garbage")
    assert main(["cache", "import", str(tmp_path / "garbage.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'garbage.json'}: not a JSON file") and err.count("\n") == 1


def test_import_of_a_bad_row_names_file_row_and_field_and_writes_nothing(one_decision, tmp_path, capsys):
    assert main(["cache", "export", str(tmp_path / "d.json")]) == 0
    data = json.loads((tmp_path / "d.json").read_text())
    data["decisions"].append({**data["decisions"][0], "record": "garbage"})
    (tmp_path / "bad.json").write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["cache", "import", str(tmp_path / "bad.json")]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'bad.json'}: decision 1: field 'record': must be a JSON "
                                       "object (the tuner's record), got str 'garbage'\n")
    assert len(inductor_attn.cache.list_decisions()) == 1


def test_a_file_argument_that_is_no_regular_file_is_one_line_and_nothing_is_written(one_decision, tmp_path,
                                                                                   monkeypatch, capsys):
    """The empty name is the current directory; a FIFO would block the import for ever, waiting for a writer."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    os.mkfifo(work / "fifo")
    for argv, message in ((["export", ""], "'' is a directory: give the name of a file to write"),
                          (["export", str(work)], f"{str(work)!r} is a directory"),
                          (["plot", str(work)], f"{str(work)!r} is a directory"),
                          (["import", "fifo"], "'fifo' is not a regular file (a directory, a pipe or a device)")):
        assert main(["cache", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert [p.name for p in work.iterdir()] == ["fifo"]


def test_plot_writes_the_file_it_was_given_and_says_so(one_decision, tmp_path, capsys):
    # matplotlib alone would add .png to a name without a suffix, and the message would name a file that is not there
    assert main(["cache", "plot", str(tmp_path / "drawing")]) == 0
    assert capsys.readouterr().out == f"plotted 1 decisions to {tmp_path / 'drawing'}\n"
    assert (tmp_path / "drawing").read_bytes()[:4] == b"\x89PNG"
    assert main(["cache", "plot", str(tmp_path / "drawing.svg")]) == 0
    assert b"<svg" in (tmp_path / "drawing.svg").read_bytes()[:1000]


def test_clear_and_prune_of_an_unusable_store_say_nothing_was_deleted(tmp_path, capsys):
    _store_path().parent.mkdir(parents=True, exist_ok=True)
    _store_path().write_bytes(b"SQLite format 3\0" + os.urandom(4000))
    for verb in ("clear", "prune"):
        with pytest.warns(RuntimeWarning, match="unusable") if verb == "clear" else contextlib.nullcontext():
            assert main(["cache", verb]) == 1  # the store warns once per process
        out, err = capsys.readouterr()
        assert "deleted" not in out and err.endswith("; nothing was deleted\n"), (out, err)


def test_a_cache_dir_that_is_a_file_is_an_error_not_another_store(tmp_path, monkeypatch, capsys):
    # the library goes on with a store elsewhere; `cache clear` would clear that one
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("INDUCTOR_ATTN_CACHE_DIR", str(tmp_path / "file" / "store"))
    assert main(["cache", "clear"]) == 1
    assert capsys.readouterr().err == (f"error: the decision store {tmp_path / 'file' / 'store' / 'decisions.sqlite'} "
                                       f"cannot be made: {tmp_path / 'file'} is a file, not a directory "
                                       "(INDUCTOR_ATTN_CACHE_DIR names the store's directory)\n")


@pytest.mark.parametrize("argv", [["--quick"], ["--smoke"], ["--shard", "1/2"]])
def test_export_priors_options_of_the_tune_without_tune_are_refused(tmp_path, capsys, argv):
    assert main(["cache", "export-priors", *argv, "--out", str(tmp_path / "t.json")]) == 2
    assert capsys.readouterr().err.endswith("choose what --tune tunes; without --tune nothing is tuned\n")


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--rounds", "2.5"], ["--budget-s", "-1"], ["--budget-s", "nan"]])
def test_bench_refuses_rounds_and_budgets_that_are_not_above_zero(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--smoke", *argv])
    assert exit_.value.code == 2 and f"argument {argv[0]}: {argv[0]} takes a" in capsys.readouterr().err


def test_import_prints_the_count_written(one_decision, tmp_path, capsys):
    assert main(["cache", "export", str(tmp_path / "d.json")]) == 0
    assert main(["cache", "clear"]) == 0
    capsys.readouterr()
    assert main(["cache", "import", str(tmp_path / "d.json")]) == 0
    assert capsys.readouterr().out == f"imported 1 decisions into {_store_path()}\n"


def test_export_of_a_corrupt_store_fails_and_keeps_the_target(tmp_path, capsys):
    target = tmp_path / "d.json"
    target.write_text("an earlier export")
    _store_path().parent.mkdir(parents=True, exist_ok=True)
    _store_path().write_bytes(b"not a database " * 300)
    with pytest.warns(RuntimeWarning, match="unusable"):
        assert main(["cache", "export", str(target)]) == 1
    err = capsys.readouterr().err
    assert "error: the decision store is unreadable" in err and f"{target} was left as it was" in err
    assert target.read_text() == "an earlier export"


def test_explain_on_an_unreadable_store_says_so_instead_of_no_decision(one_decision, capsys):
    _store_path().write_bytes(b"not a database " * 300)  # damaged after the decision was written
    with pytest.warns(RuntimeWarning, match="unusable"):
        assert main(["cache", "explain", one_decision[:10]]) == 1
    err = capsys.readouterr().err
    assert "the decision store is unreadable" in err and "no decision with a key" not in err


# -- a bad row in the store never breaks list or attention() ----------------------------------------------
def test_list_and_attention_survive_a_bad_row_and_the_next_tune_replaces_it(one_decision, monkeypatch, capsys):
    with sqlite3.connect(_store_path()) as conn:
        conn.execute("UPDATE decisions SET record = 'garbage' WHERE key = ?", (one_decision,))
    with pytest.warns(RuntimeWarning, match="skipping unreadable decision") as record:
        assert main(["cache", "list"]) == 0
    assert capsys.readouterr().out.startswith("0 decisions") and len(record) == 1
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    b = FakeBackend("b", {"x=1": (0.5, 0.01)})
    timed_with_fakes(monkeypatch, a, b)
    forget_decisions()
    q = torch.randn(1, 2, 32, 16)
    with only_backends(a, b), inductor_attn.tuning_mode("autotune"):
        inductor_attn.attention(q, q, q, causal=True)
    assert b.calls > 0  # re-tuned
    assert [r["winner"] for r in inductor_attn.cache.list_decisions()] == ["b:x=1"]


# -- stale rows, prune, doctor ---------------------------------------------------------------------------
def test_list_marks_stale_rows_and_prune_deletes_them(one_decision, capsys):
    store = inductor_attn.cache.get_store()
    store.put(_rewrite(one_decision, torch="1.0"))
    sources = inductor_attn.cache.show(one_decision)["versions"]["sources"]
    store.put(_rewrite(one_decision, sources={**sources, "sdpa": "an-older-hash"}))
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert out.count("[stale: ") == 2 and f"torch 1.0 -> {torch.__version__}" in out
    assert "sdpa source changed" in out and "2 stale" in out
    assert main(["cache", "prune"]) == 0
    assert capsys.readouterr().out == f"deleted 2 stale decisions from {_store_path()}\n"
    assert [r["key"] for r in inductor_attn.cache.list_decisions()] == [one_decision]


def test_stale_rows_of_a_read_only_store_are_said_to_stay(tmp_path, monkeypatch, capsys):
    image = tmp_path / "image" / "decisions.sqlite"
    DecisionStore(image).put_many([decision_row(i) for i in range(2)])  # versions of no real install: stale
    monkeypatch.setenv("INDUCTOR_ATTN_CACHE_DIR", str(image.parent))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    _simulate_read_only(monkeypatch, image, image.parent)
    assert main(["cache", "list"]) == 0
    assert "2 stale: never looked up again, each for the reason it gives (read-only stores keep them)" in \
        capsys.readouterr().out
    assert main(["cache", "doctor"]) == 0
    assert "2 stale (never looked up again; `cache list` says why): a read-only store, which `cache prune` leaves" in \
           capsys.readouterr().out
    assert main(["cache", "prune"]) == 0
    assert capsys.readouterr().out.endswith("kept 2 stale decisions of read-only stores\n")


def test_doctor_checks_integrity_and_counts_rows_per_version(one_decision, capsys):
    inductor_attn.cache.get_store().put(_rewrite(one_decision, torch="1.0"))
    assert main(["cache", "doctor"]) == 0
    out = capsys.readouterr().out
    assert "integrity_check: ok" in out and "2 decisions, 0 unreadable" in out
    assert f"torch {torch.__version__}," in out and "(current)" in out and "torch 1.0," in out
    assert "1 stale" in out


def test_doctor_reports_an_unreadable_row_and_exits_1(one_decision, capsys):
    with sqlite3.connect(_store_path()) as conn:
        conn.execute("UPDATE decisions SET versions = '{' WHERE key = ?", (one_decision,))
    assert main(["cache", "doctor"]) == 1
    out = capsys.readouterr().out
    assert "0 decisions, 1 unreadable" in out and "field 'versions': is not JSON" in out


def test_output_to_a_reader_that_has_gone_ends_quietly_and_a_full_disk_in_one_line(tmp_path):
    env = {**os.environ, "INDUCTOR_ATTN_CACHE_DIR": str(tmp_path)}  # the shipped tables' rows are listed
    listing = [sys.executable, "-m", "inductor_attn", "cache", "list"]
    gone = subprocess.Popen(listing, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    gone.stdout.close()  # before it writes: `cache list | head -0`
    assert gone.wait(timeout=120) == 1 and gone.stderr.read() == ""
    with open("/dev/full", "w") as full:
        done = subprocess.run(listing, env=env, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr == "error: the output: No space left on device\n"


def test_a_row_a_newer_version_wrote_is_stale_not_damage_and_prune_deletes_it(one_decision, capsys, recwarn):
    # a newer inductor_attn may add record fields this one refuses; its key (its version) is never looked up here
    with sqlite3.connect(_store_path()) as conn:
        columns = [row[1] for row in conn.execute("PRAGMA table_info(decisions)")]
        row = dict(zip(columns, conn.execute("SELECT * FROM decisions").fetchone()))
        versions, record = json.loads(row["versions"]), json.loads(row["record"])
        row.update(key="newer" + row["key"][5:], versions=json.dumps({**versions, "inductor_attn": "99.0"}),
                   record=json.dumps({**record, "a_later_field": 1}))
        conn.execute(f"INSERT INTO decisions VALUES ({', '.join('?' * len(columns))})", list(row.values()))
    assert main(["cache", "list"]) == 0 and main(["cache", "doctor"]) == 0
    out = capsys.readouterr().out
    assert "1 decisions, 0 unreadable" in out and "1 written by another inductor_attn version" in out
    assert not [w for w in recwarn if "unreadable decision" in str(w.message)]
    assert main(["cache", "prune"]) == 0
    with sqlite3.connect(_store_path()) as conn:
        assert [key for (key,) in conn.execute("SELECT key FROM decisions")] == [one_decision]


@pytest.mark.parametrize("device, message", [
    ("tpu", "--device must be cpu or cuda, got 'tpu'"),
    ("cuda", "--device cuda needs a CUDA GPU, and torch finds none here (torch.cuda.is_available() is False)"),
])
def test_demo_on_a_device_it_cannot_run_on_is_a_one_line_error(monkeypatch, capsys, device, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["demo", "--device", device]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


@pytest.mark.parametrize("content, message", [
    (None, "No such file or directory"),
    ("{not json", "not JSON"),
    ("[1, 2]", "not an inductor_attn bench results file"),
    ('{"suite": "dense"}', "not an inductor_attn bench results file"),
    ('{"schema": 2, "meta": META, "rows": []}', "not a schema-1 inductor_attn bench result"),
    ('{"schema": 1, "meta": META}', "without its rows"),
    (b"\xff\xfe{", "not JSON"),
    ('{"schema": 1, "meta": {"device": "H200"}, "rows": []}', "its meta lacks date, commit, command"),
    ('{"schema": 1, "meta": META, "rows": ["dense B1"]}', "its rows are not a list of workloads"),
    ('{"schema": 1, "meta": META, "rows": [{"kind": "dense"}]}', "its rows are not a list of workloads"),
    ('{"meta": META, "rows": {"shape": "decode"}}', "its rows are not a list of workloads"),
    ('{"schema": 1, "meta": META, "rows": [{"name": "dense B1", "status": 3}]}', "a row lacks a field or holds one"),
])
def test_bench_report_of_a_file_that_is_no_results_file_is_a_one_line_error(tmp_path, capsys, content, message):
    path = tmp_path / "results.json"
    meta = {"device": "H200", "date": "2026-11-30 08:00 UTC", "commit": "abc1234", "command": "bench", "versions": {}}
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content.replace("META", json.dumps(meta)))
    assert main(["bench", "--report", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}") and message in err and len(err.strip().splitlines()) == 1, err


def test_bench_with_an_out_it_cannot_make_stops_before_measuring(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["bench", "--suite", "overhead", "--smoke", "--out", str(blocker / "out")]) == 2
    assert capsys.readouterr().err.startswith(f"error: --out {blocker / 'out'}: ")


def test_plot_labels_each_decision_apart_and_fits_them_in_the_picture(monkeypatch, tmp_path):
    """The package's tables hold the same problems measured on an H100 and an H200."""
    from matplotlib.figure import Figure

    saved, labels, boxes = Figure.savefig, [], []

    def savefig(fig, *args, **kwargs):
        saved(fig, *args, **kwargs)
        fig.set_dpi(kwargs.get("dpi", fig.dpi))  # as saved: text does not scale exactly with the resolution
        fig.canvas.draw()
        renderer, (ax,) = fig.canvas.get_renderer(), fig.axes
        labels.extend(label.get_text() for label in ax.get_yticklabels())
        boxes.extend((text, text.get_window_extent(renderer)) for text in
                     [*ax.get_yticklabels(), ax.xaxis.label, *fig.legends])
        boxes.append(("the figure", fig.bbox.frozen()))

    monkeypatch.delenv("INDUCTOR_ATTN_PRIORS")
    monkeypatch.setattr(Figure, "savefig", savefig)
    assert main(["cache", "plot", str(tmp_path / "d.png")]) == 0
    assert len(set(labels)) == len(labels) == 20
    *texts, (_, figure) = boxes
    for text, box in texts:
        assert figure.x0 <= box.x0 and box.x1 <= figure.x1 and figure.y0 <= box.y0 and box.y1 <= figure.y1, text


def test_plot_without_matplotlib_is_a_one_line_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the [plot] extra has
    assert main(["cache", "plot", str(tmp_path / "d.png")]) == 1
    assert capsys.readouterr().err == "error: cache plot needs matplotlib: pip install 'inductor-attn[plot]'\n"


# -- each command imports only what it needs ------------------------------------------------------------
HEAVY = ("torch._dynamo", "torch._inductor.compile_fx", "inductor_attn.bench", "inductor_attn.api", "matplotlib",
         "transformers")


@pytest.mark.parametrize("argv", [["--help"], ["cache", "list"]])
def test_help_and_cache_list_import_neither_inductor_nor_bench(argv, tmp_path):
    code = ("import sys\nfrom inductor_attn.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    env = {**os.environ, "INDUCTOR_ATTN_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["cache", "--help"], ["cache", "import", "--help"],
                                  ["cache", "export-priors", "--help"], ["bench", "--help"]])
def test_help_is_plain_text(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith("usage: ") and "`" not in out


def test_bench_options_are_still_parsed_and_listed(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--help"])
    assert exit_.value.code == 0 and "--smoke" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "--shard", "3/2"])
    assert "--shard K/N needs 1 <= K <= N" in capsys.readouterr().err


def test_the_package_root_still_exports_every_public_name():
    for name in inductor_attn.__all__:
        assert getattr(inductor_attn, name) is not None
    assert inductor_attn.attention is inductor_attn.api.attention and "attention" in dir(inductor_attn)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        inductor_attn.nope  # noqa: B018


def test_explain_shows_the_host_time_the_rule_weighs_and_each_probe_beside_it(monkeypatch, capsys):
    """Configs of one backend share their launch path's host time (tuning/step_cost.py): the table shows that
    figure, and a config whose own probe differs says so."""
    b = FakeBackend("b", {"x=1": (0.5, 0.01), "x=2": (0.6, 0.01)}, fail=())
    monkeypatch.setattr(FakeTimer, "host_ms_each", staticmethod(
        lambda launches, device, failed=None, device_ms=None: dict(zip(launches, [0.030, 0.050]))))
    timed_with_fakes(monkeypatch, b)
    q = torch.randn(1, 2, 32, 16)
    with only_backends(b), inductor_attn.tuning_mode("autotune"):
        inductor_attn.attention(q, q, q, causal=True)
    assert main(["cache", "explain", inductor_attn.cache.list_decisions()[0]["key"][:10]]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line[2:].startswith("b:x=")]
    weighed = f"{0.040 + OP_IN_GRAPH_MS:.4f}"  # the fake backend has no traced form: compiled code calls the op
    assert len(rows) == 2 and all(f"{weighed}  host: its launch path's median + the launch op's cost in a graph; "
                                  "its own probe 0.0" in r for r in rows)


def test_a_tune_of_export_priors_that_runs_out_of_device_memory_is_one_line(monkeypatch, capsys):
    from inductor_attn.tuning.decisions import OutOfMemoryWhileTuning

    def tune(args):
        raise OutOfMemoryWhileTuning("tuning Problem(...) ran out of device memory in fa4:default")

    monkeypatch.setattr("inductor_attn.cli.run_cache", tune)
    assert main(["cache", "export-priors", "--tune", "dense"]) == 1
    assert capsys.readouterr().err == "error: tuning Problem(...) ran out of device memory in fa4:default\n"
