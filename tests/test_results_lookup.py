"""Where a chapter finds the committed benchmark results: a checkout, a folder, or a URL (Colab)."""

from __future__ import annotations

import functools
import http.server
import json
import sys
import threading
from pathlib import Path

import pytest

from infer_lab.measure import results

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(results, "_CACHE", {})
    monkeypatch.delenv(results.RESULTS_ENV, raising=False)


def write(folder: Path, name: str, data: dict) -> None:
    path = folder / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_a_chapter_in_the_checkout_finds_the_committed_files(monkeypatch):
    monkeypatch.chdir(ROOT / "chapters")
    committed = json.loads((ROOT / "benchmarks" / "results" / "routing.json").read_text())
    assert results.find_result("routing") == committed


def test_the_environment_names_a_folder_and_wins(monkeypatch, tmp_path):
    write(tmp_path / "mine", "routing", {"rows": [1]})
    write(tmp_path / "mine", "gpu/kernels", {"rows": [2]})
    monkeypatch.chdir(ROOT / "chapters")
    monkeypatch.setenv(results.RESULTS_ENV, str(tmp_path / "mine"))
    assert results.find_result("routing") == {"rows": [1]}
    assert results.find_result("gpu/kernels.json") == {"rows": [2]}


def test_a_file_url_as_the_colab_stand_in_sets_it(monkeypatch, tmp_path):
    write(tmp_path, "speculative", {"batch1": []})
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(results.RESULTS_ENV, f"file://{tmp_path}")
    assert results.find_result("speculative") == {"batch1": []}
    assert results.find_result("absent") is None


def test_an_http_url_as_colab_reads_github(monkeypatch, tmp_path):
    write(tmp_path / "benchmarks" / "results", "quantization", {"models": ["x"]})
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}/benchmarks/results/"
        monkeypatch.chdir(tmp_path / "benchmarks")  # not a checkout: no results/ under it
        monkeypatch.setenv(results.RESULTS_ENV, base)
        assert results.find_result("quantization") == {"models": ["x"]}
        assert results.find_result("missing") is None  # a 404 is "not here", not a crash
    finally:
        server.shutdown()


def test_an_unreachable_url_is_not_here(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(results.RESULTS_ENV, "http://127.0.0.1:9/nothing")  # discard port
    assert results.find_result("routing", timeout=2) is None


def test_load_result_names_the_machine_or_says_how_to_make_it(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(results, "_folders", lambda: [tmp_path / "benchmarks" / "results"])
    assert results.load_result("kv_cache") is None
    said = capsys.readouterr().out
    assert "python -m benchmarks.kv_cache" in said and results.RESULTS_ENV in said
    write(tmp_path / "benchmarks" / "results", "kv_cache",
          {"device": "cpu", "device_name": "Xeon", "cpu_threads": 2, "commit": "abc1234",
           "date": "2026-12-01", "load_average": {"before": [1, 2, 3], "after": [2, 2, 3]}})
    assert results.load_result("kv_cache")["commit"] == "abc1234"
    said = capsys.readouterr().out
    assert "Xeon, 2 threads" in said and "abc1234" in said and "[1, 2, 3]" in said
    write(tmp_path / "benchmarks" / "results", "routing",
          {"provenance": [{"device": "cpu", "commit": "r1"}, {"device": "cpu", "commit": "r2"}]})
    results.load_result("routing")
    said = capsys.readouterr().out
    assert "r1" in said and "r2" in said
    write(tmp_path / "benchmarks" / "results", "quant_formats",
          {"runs": {"a": {"provenance": {"device": "cpu", "commit": "q1"}},
                    "b": {"provenance": {"device": "cpu", "commit": "q2"}}}})
    results.load_result("quant_formats")
    said = capsys.readouterr().out
    assert "commit q1" in said and "commit q2" in said


@pytest.mark.parametrize("bad", ["", "/etc/passwd", "../secrets", "gpu/../../x"])
def test_names_stay_inside_the_results_folder(bad):
    with pytest.raises(ValueError, match="relative"):
        results.find_result(bad)


def test_the_setup_cell_points_colab_at_the_repository_results():
    sys.path.insert(0, str(ROOT / "scripts"))
    import sync_notebooks as sn

    assert sn.results_url("https://github.com/me/fork") == (
        "https://raw.githubusercontent.com/me/fork/main/benchmarks/results")
    assert sn.results_url("https://github.com/me/fork.git", "dev").endswith(
        "/me/fork/dev/benchmarks/results")
    assert sn.results_url("https://gitlab.example/me/fork") is None
    cell = sn.setup_cell("import sys\n", "https://github.com/me/fork", branch="dev")
    assert 'RAW = "https://raw.githubusercontent.com/me/fork/dev"' in cell
    assert 'os.environ.setdefault("INFER_LAB_RESULTS"' in cell  # an override set first wins
    assert "INFER_LAB_RESULTS" not in sn.setup_cell("import sys\n", "https://x.org/a/b")
