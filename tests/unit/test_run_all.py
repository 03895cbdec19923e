"""benchmarks/run_all.py: a benchmark's output becomes the doc's section and the
README's headline; ``--only`` keeps the other benchmarks' blocks. No benchmark runs."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks" / "run_all.py")
run_all = sys.modules["run_all"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_all)

POOL_OUT = """CPython 3.11.7, 2 CPUs, 2 workers
peer ray not measured: not installed (pip install ray)

| measurement | fibrl | mp spawn | loky | fibrl/spawn | fibrl/loky | better |
|---|---|---|---|---|---|---|
| no-op map, chunksize=1 (tasks/s) | 50,000 | 25,000 | 5,000 | 2.00x | 10x | higher |

plot: {img}/pool_workers.png
"""


def outcome(name, stdout, code=0, note=""):
    bench = next(b for b in run_all.BENCHES if b.name == name)
    return run_all.Outcome(bench, ["python", f"benchmarks/{bench.script}", "--quick"], 12.0,
                           code, stdout, "Traceback: boom\n", note, "2026-11-24 04:00 UTC")


def test_section_turns_output_into_tables_text_and_the_plot(tmp_path):
    out = outcome("pool", POOL_OUT.format(img=tmp_path / "img"))
    text = run_all.section([out], True, ["--quick"], "2026-11-24 04:00 UTC", (1.0, 2.0),
                           tmp_path, {})
    assert text.startswith(run_all.BEGIN) and text.endswith(run_all.END)
    assert "| no-op map, chunksize=1 (tasks/s) | 50,000 |" in text
    assert "```text\nCPython 3.11.7, 2 CPUs, 2 workers\npeer ray not measured" in text
    assert "![Pool: plot of this run](img/pool_workers.png)" in text
    assert "Quick run" in text and "Machine: " in text


def test_a_failed_benchmark_is_marked_incomplete_with_its_error(tmp_path):
    text = run_all.markdown_of(outcome("core", "", code=1, note="exited with code 1"), tmp_path)
    assert "**Incomplete: exited with code 1.**" in text and "Traceback: boom" in text


def test_headline_reads_ratios_from_the_tables(tmp_path):
    rows = run_all.headline({"pool": outcome("pool", POOL_OUT.format(img=tmp_path))})
    assert rows == [("no-op map, chunksize=1 (tasks/s)",
                     "2.00x mp spawn, 10x loky (tasks/s; higher is better)")]


def test_only_keeps_the_other_blocks_and_the_page_around_them(tmp_path):
    doc = "# Benchmarks\n\nintro\n\n## Pool\n\ntext\n"
    first = run_all.section([outcome("pool", POOL_OUT.format(img=tmp_path)),
                             outcome("scale", "| a | b |\n|---|---|\n| 1 | 2 |\n")],
                            False, [], "t", (0, 0), tmp_path, {})
    doc = run_all.replace_between(doc, run_all.BEGIN, run_all.END, first, "## Pool")
    assert doc.index("intro") < doc.index(run_all.BEGIN) < doc.index("## Pool\n\ntext")
    kept = run_all.bench_blocks(doc)
    assert set(kept) == {"pool", "scale"}
    again = run_all.section([outcome("scale", "| a | b |\n|---|---|\n| 3 | 4 |\n")], False,
                            ["--only", "scale"], "t", (0, 0), tmp_path, kept)
    doc = run_all.replace_between(doc, run_all.BEGIN, run_all.END, again, "## Pool")
    assert doc.count(run_all.BEGIN) == 1 and "| 3 | 4 |" in doc and "| 1 | 2 |" not in doc
    assert "| no-op map, chunksize=1 (tasks/s) | 50,000 |" in doc
    assert "from an earlier run: pool" in doc
