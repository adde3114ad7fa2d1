"""``python -m braintrace``: the main job, and the record of its output the pages quote.

``benchmarks/readme_main_job.py`` records a full run and a ``--quick`` run in
``benchmarks/results/main_job.json``; the README and the docs render their main-job blocks
from it (``tests/test_tables.py`` checks the pages against it). These tests check that the
record is what the code prints today: the ``--quick`` run again (every number but the times),
the full run's memory and data columns by compiling its train steps, and both runs' sentences
from their tables; and, for the full run's accuracy and loss, which only a full run (over a
minute) gives, that the record was made from the sources there are now (its fingerprint).
"""

import importlib.util
import json
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import braintrace
from braintrace.__main__ import (
    FULL,
    HEADER,
    QUICK,
    Result,
    SpikingNet,
    chunks,
    cross_entropy,
    footnote,
    main,
    make_optimizer,
    make_task,
    make_train_step,
    parse_args,
    prepare,
    summary,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
SIZE = r"[\d.]+ (?:B|KiB|MiB|GiB)"
ROW = re.compile(rf"^ *(\d+)  (\w+) +(?:([01]\.\d{{3}}) +(\d+\.\d{{3}})|- +-) +(\d+) *({SIZE}) +"
                 rf"({SIZE}) +(?:([\d.]+) ms|-) +([\d.]+) s(  \(over budget\))?$")
ACCURACY_TOLERANCE = 1 / 256 + 1e-3  # one test sequence of 256, and the printed rounding
LOSS_TOLERANCE = 5e-3
MEMORY_TOLERANCE = 0.01  # relative: XLA's flags move a buffer by a few hundred bytes
BPTT_MEMORY_TOLERANCE = 0.05  # BPTT's step under jax.checkpoint(dots_saveable): the suite's
# fast-compile flags change XLA's fusions, and with them its saved values (T = 640: 2.7 MiB
# against 2.8 with XLA's defaults; T = 1000: 40.2 against 40.7)


def _memory_tolerance(method: str) -> float:
    return BPTT_MEMORY_TOLERANCE if method == "bptt" else MEMORY_TOLERANCE


def _load_script():
    path = ROOT / "benchmarks" / "readme_main_job.py"
    spec = importlib.util.spec_from_file_location("readme_main_job", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


script = _load_script()


UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _bytes(text: str) -> float:
    value, unit = text.split()
    return float(value) * UNITS[unit]


def _prints_as(n: float, text: str, rel: float = 0.0) -> bool:
    """Whether ``n`` bytes print as ``text`` (to its 0.1 of a unit), within ``rel``."""
    return abs(n - _bytes(text)) <= max(rel * _bytes(text), 0.05 * UNITS[text.split()[1]])


class Quoted:
    """One quoted run: its table's rows (regex matches) and the lines after the table."""

    def __init__(self, text: str):
        lines = text.strip("\n").splitlines()
        assert lines[0] == HEADER
        self.rows = []
        for line in lines[1:]:
            match = ROW.match(line)
            if not match:
                break
            self.rows.append(match)
        self.after = lines[1 + len(self.rows):]
        self.lines = lines

    def results(self) -> list[Result]:
        """The rows as :class:`Result` s (sizes as printed, to 0.1 of their unit)."""
        return [Result(int(r[1]), r[2], int(r[5]), int(_bytes(r[6])), int(_bytes(r[7])),
                       float(r[9]), None if r[8] is None else float(r[8]) / 1e3,
                       None if r[3] is None else float(r[3]),
                       None if r[4] is None else float(r[4])) for r in self.rows]

    def sentences(self) -> tuple[str, str, str]:
        """The footnote, the plot line and the closing sentence, each unwrapped."""
        plot = next(i for i, line in enumerate(self.after) if line.startswith("plot: "))
        return " ".join(self.after[:plot]), self.after[plot], " ".join(self.after[plot + 1:])


def _recorded_runs() -> tuple[Quoted, Quoted]:
    """The full and the ``--quick`` run as ``main_job.json`` records them."""
    runs = json.loads(script.RECORD.read_text())["runs"]
    return Quoted(runs["full"]["output"]), Quoted(runs["quick"]["output"])


def _stale(what: str) -> str:
    return (f"{what}: main_job.json records other numbers than the code prints; run `python "
            "benchmarks/readme_main_job.py` and commit the JSON and the pages")


def test_the_record_was_made_from_the_current_sources():
    recorded = json.loads(script.RECORD.read_text()).get("sources_sha256")
    assert recorded == script.sources_fingerprint(), (
        "benchmarks/results/main_job.json, which the README's main-job block and "
        "docs/main_job.md are rendered from, was recorded from other sources than "
        f"{', '.join(script.SOURCES)} hold now, so `python -m braintrace` may print other "
        "numbers: run `python benchmarks/readme_main_job.py` (about 2 minutes on a 2-core CPU; "
        "it runs the main job and --quick, writes the JSON and renders the pages) and commit "
        "the JSON, README.md and docs/main_job.md with the change")


def test_the_fingerprint_sees_an_edit_a_new_file_and_this_script(tmp_path):
    for name in ("braintrace/__main__.py", "layers/_lif.py", "benchmarks/readme_main_job.py",
                 "docs/index.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"# {name}\n")
    seen = {script.sources_fingerprint(tmp_path)}
    (tmp_path / "docs/index.md").write_text("not a source")
    assert script.sources_fingerprint(tmp_path) in seen  # outside the sources
    for edit in ("braintrace/__main__.py", "layers/_lif.py", "benchmarks/readme_main_job.py",
                 "layers/_new.py"):
        (tmp_path / edit).write_text("x = 1\n")
        seen.add(script.sources_fingerprint(tmp_path))
    assert len(seen) == 5


def test_the_record_holds_a_full_run_whose_sentences_match_its_table():
    full, quick = _recorded_runs()
    results = full.results()
    assert [r.length for r in results] == [t for t in FULL["lengths"] for _ in range(2)]
    assert [r.method for r in results] == ["es_d_rtrl", "bptt"] * len(FULL["lengths"])
    assert [r.chunk for r in results] == [c for t in FULL["lengths"] for c in (FULL["chunk"], t)]
    assert [r.step_s is None for r in results] == [False] * 5 + [True]  # BPTT skipped at 10k
    online = [r for r in results if r.method != "bptt"]
    assert len({r.memory for r in online}) == 1  # one program at every T: issue 45's "flat"
    assert online[-1].memory <= 2 * online[0].memory
    budget = FULL["memory_budget"] * 2**20
    assert online[-1].memory < budget < results[-1].memory
    for run, config in ((full, FULL), (quick, QUICK)):
        notes, plot, closing = run.sentences()
        assert notes == f"chance accuracy 0.100; {footnote(run.results())}"
        assert plot == "plot: braintrace_main.png"
        assert closing == summary(run.results(), config["memory_budget"])
        assert all(len(line) <= 100 for line in run.lines)


def test_full_run_memory_and_data_are_what_its_train_steps_compile_to():
    full, _ = _recorded_runs()
    args = parse_args([])
    for row in full.rows:
        result = prepare(row[2], int(row[1]), args).result
        assert result.chunk == int(row[5])
        assert _prints_as(result.memory, row[6], _memory_tolerance(row[2])), (
            _stale(f"T={row[1]} {row[2]} memory"))
        assert _prints_as(result.data, row[7]), _stale(f"T={row[1]} {row[2]} data")


def test_quick_run_prints_the_recorded_numbers(tmp_path, monkeypatch, capsys):
    # In this process, with the suite's XLA flags (faster to compile; the recorded run had
    # XLA's defaults): the same accuracy and loss, memory within a few hundred bytes.
    _, quoted = _recorded_runs()
    monkeypatch.chdir(tmp_path)
    main(["--quick"])
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith("braintrace ") and "online learning (es_d_rtrl) vs BPTT" in lines[0]
    assert "T = 32, 640" in lines[1] and "16 neurons" in lines[2] and "seed 0" in lines[2]
    fresh = Quoted(script.quoted(captured.out))
    assert len(fresh.rows) == len(quoted.rows)
    for new, old in zip(fresh.rows, quoted.rows, strict=True):
        where = f"T={old[1]} {old[2]}"
        assert (new[1], new[2], new[5], new[7], new[10]) == (old[1], old[2], old[5], old[7],
                                                             old[10]), _stale(where)
        assert _prints_as(_bytes(new[6]), old[6], _memory_tolerance(old[2])), (
            _stale(f"{where} memory"))
        if old[3] is not None:
            assert float(new[3]) == pytest.approx(float(old[3]), abs=ACCURACY_TOLERANCE), (
                _stale(f"{where} accuracy"))
            assert float(new[4]) == pytest.approx(float(old[4]), abs=LOSS_TOLERANCE), (
                _stale(f"{where} loss"))
        assert (new[8] is None) == (old[8] is None)
    # the sentences' sizes are the rows' (above, within MEMORY_TOLERANCE; the record's own
    # sentences match its rows: test_the_record_holds_a_full_run_whose_sentences_match_its_table)
    words = lambda run: tuple(re.sub(SIZE, "<size>", s) for s in run.sentences())
    assert words(fresh) == words(quoted), _stale("the sentences")
    assert (tmp_path / "braintrace_main.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "%|" not in captured.out and "T=32 es_d_rtrl" in captured.err  # progress: stderr


def test_chunks_put_the_sequence_in_equal_calls_weighted_to_its_mean():
    xs = np.arange(7 * 2 * 3, dtype=np.float32).reshape(7, 2, 3)
    mask = np.array([0, 0, 0, 1, 1, 1, 1], np.float32)
    parts = list(chunks(braintrace.tasks.Batch(xs, np.ones((7, 2), np.int32), mask), 3))
    assert [p[0].shape for p in parts] == [(3, 2, 3)] * 3
    assert all(isinstance(a, jax.Array) for p in parts for a in p)
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts])[:7], xs)
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts])[7:], 0)
    weights = np.concatenate([p[2] for p in parts])
    np.testing.assert_allclose(weights, np.r_[mask / 4, 0, 0])  # padding unscored


def test_one_update_from_the_chunks_equals_one_update_from_the_whole_sequence():
    """The fairness claim: chunked online learning makes BPTT's kind of update (one Adam
    step per batch) from the gradient of the whole sequence, mean over its scored steps."""
    length, chunk, batch_size = 30, 8, 2  # 30 = 3 * 8 + 6: the last chunk is padded
    task = make_task(length, seed=0)
    batch = jax.tree.map(np.asarray, task.sample(jax.random.key(1), batch_size))

    def fresh():
        model = SpikingNet(task.num_inputs, 8, task.num_classes, rngs=nnx.Rngs(0))
        learner = braintrace.compile(model, "es_d_rtrl", jnp.zeros((batch_size, 20)),
                                     batch_size=batch_size)
        return model, learner

    model, learner = fresh()
    whole = braintrace.online_grad(learner, cross_entropy)  # reduction='mean' over the mask
    grads, _, _ = whole.grad(model, whole.init(model), batch.xs, batch.ys, mask=batch.mask)
    reference = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    reference.update(model, grads)
    want = nnx.to_pure_dict(nnx.state(model, nnx.Param))

    model, learner = fresh()
    online = braintrace.online_grad(learner, cross_entropy, reduction="sum")
    optimizer = make_optimizer(model, 1e-2, calls=-(-length // chunk))
    train_step = make_train_step(online)
    state = online.init(model)
    parts = list(chunks(batch, chunk))
    summed = jax.tree.map(jnp.zeros_like, grads)
    probe = state
    for part in parts:  # the chunks' gradients alone: their sum is the whole sequence's
        chunk_grads, probe, _ = online.grad(model, probe, part[0], part[1], mask=part[2])
        summed = jax.tree.map(jnp.add, summed, chunk_grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), summed,
                 grads)
    before = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for i, part in enumerate(parts):
        state, _ = train_step(model, optimizer, state, *part)
        after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        if i < 3:  # no update before the last chunk
            jax.tree.map(np.testing.assert_array_equal, after, before)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), after,
                 want)
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in
               zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True)) > 1e-3


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--algorithm", "--lengths", "--hidden", "--steps", "--batch-size", "--chunk",
                   "--lr", "--seed", "--memory-budget", "--plot", "--quick", "es_d_rtrl",
                   "d_rtrl"):
        assert option in text


def test_options_default_to_full_or_quick_sizes_and_explicit_values_win():
    assert {k: getattr(parse_args([]), k) for k in FULL} == FULL
    quick = parse_args(["--quick", "--hidden", "5", "--lengths", "300,20,300"])
    assert {k: getattr(quick, k) for k in QUICK} == {**QUICK, "hidden": 5, "lengths": (20, 300)}
    assert parse_args(["--algorithm", "d_rtrl"]).algorithm == "d_rtrl"
    assert parse_args(["--chunk", "7"]).chunk == 7
    assert parse_args([]).plot == "braintrace_main.png"


@pytest.mark.parametrize("argv, message", [
    (["--algorithm", "bptt"], "invalid choice: 'bptt'"),
    (["--steps", "0"], "--steps must be a positive integer"),
    (["--batch-size", "-1"], "--batch-size must be a positive integer"),
    (["--chunk", "0"], "--chunk must be a positive integer"),
    (["--lengths", "100,5"], "every length must be at least 12"),
    (["--lengths", "100,x"], "expected comma-separated integers"),
    (["--memory-budget", "0"], "--memory-budget must be positive"),
])
def test_bad_options_are_refused_with_a_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_describes_every_column_of_the_table(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = capsys.readouterr().out
    described = re.findall(r"^  (\S+(?: \S+)?) {2,}", text.split("the table it prints", 1)[1],
                           flags=re.MULTILINE)
    assert described == ["T", "method", "test acc", "test loss", "chunk", "memory", "data",
                         "time/step", "compile", "(over budget)"]
    assert all(column in HEADER for column in described[:-1])  # the printed header's names


def test_the_record_holds_each_run_from_its_table_on_with_its_times():
    runs = [(f"preamble\n{HEADER}\nrow {name}\nplot: braintrace_main.png\n", 61.0, 58.5)
            for name in ("full", "quick")]
    recorded = script.record(*runs)
    assert recorded["benchmark"] == "main_job"
    assert recorded["environment"]["braintrace"]["commit"]
    assert recorded["sources_sha256"] == script.sources_fingerprint()
    full, quick = recorded["runs"]["full"], recorded["runs"]["quick"]
    assert full["output"] == f"{HEADER}\nrow full\nplot: braintrace_main.png"
    assert "preamble" not in quick["output"] and "row quick" in quick["output"]
    assert (full["command"], quick["command"]) == ("python -m braintrace",
                                                   "python -m braintrace --quick")
    assert (full["wall_s"], full["cpu_s"]) == (61.0, 58.5)
    assert sys.executable == script.COMMAND[0]
