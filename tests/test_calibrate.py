"""`epikv calibrate`: rank correlation, window labels, band choice, and bands picked up by later runs."""

from __future__ import annotations

import json

import pytest
import torch
from test_exactness import masked_reference
from typer.testing import CliRunner

from epikv_cli.cli.app import app
from epikv_cli.errors import UsageError
from epikv_cli.experiments import calibrate as calibrate_module
from epikv_cli.experiments.calibrate import (
    MIN_WINDOWS,
    STRIDE,
    WINDOW,
    choose_bands,
    rolling_mean,
    spearman,
    window_labels,
)
from epikv_cli.models.calibration import bands_path

from conftest import tiny_model

runner = CliRunner()


def test_spearman_by_hand():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties share ranks: x ranks [1, 2.5, 2.5, 4], y ranks [1, 2, 3, 4]; Pearson of those ranks
    rx, ry = torch.tensor([1, 2.5, 2.5, 4.0]), torch.tensor([1, 2, 3, 4.0])
    rx, ry = rx - rx.mean(), ry - ry.mean()
    assert spearman([5, 7, 7, 9], [1, 2, 3, 4]) == pytest.approx(float((rx * ry).sum() / (rx.norm() * ry.norm())))


def test_rolling_mean_is_causal():
    values = torch.arange(1.0, 11.0).unsqueeze(0)
    expected = [sum(range(max(1, t - 2), t + 1)) / min(3, t) for t in range(1, 11)]
    assert rolling_mean(values, width=3)[0].tolist() == pytest.approx(expected)


def test_band_choice_and_notes():
    assert choose_bands([0.1, 0.3, -0.2, -0.4]) == ([(1, 1.0), (3, -1.0)], None)
    bands, note = choose_bands([-0.3, 0.1, 0.4, -0.1])
    assert bands == [(2, 1.0), (0, -1.0)] and "differs from the paper's" in note
    assert choose_bands([0.2, 0.1])[1].startswith("only one band")
    with pytest.raises(UsageError, match="no layer"):
        choose_bands([0.0, 0.0])


def test_window_labels_are_the_kl_of_a_masked_forward():
    model = tiny_model("llama", seed=9)
    prompt_len, new = 10, 60
    sequence = torch.randint(0, 256, (prompt_len + new - 1,), generator=torch.Generator().manual_seed(2)).tolist()
    labels = window_labels(model, sequence, prompt_len, new)
    assert [start for start, _ in labels] == list(range(0, new - WINDOW - 1, STRIDE))
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([sequence])).logits[0].double(), -1)
    for start, label in labels:
        first, last = prompt_len + start, prompt_len + start + WINDOW
        # the masked reference of the exactness test: positions evicted once the query at `last` is fed
        evicted = [[] for _ in range(new)]
        evicted[last - prompt_len] = list(range(first, last))
        masked = torch.log_softmax(masked_reference(model, sequence, prompt_len, evicted).double(), -1)
        after = slice(last - (prompt_len - 1), None)  # rows of masked_reference start at position prompt_len - 1
        reference = full[last:]
        expected = (reference.exp() * (reference - masked[after])).sum(-1).mean()
        assert label == pytest.approx(float(expected), rel=1e-3, abs=1e-7)


def test_calibrated_bands_are_saved_and_used_until_overridden(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("EPIKV_CACHE_DIR", str(tmp_path))
    prompts = tmp_path / "p.txt"
    prompts.write_text("The first prompt.\nA second one, longer than the first.\n")
    result = runner.invoke(
        app, ["calibrate", "--model", str(tiny_model_dir), "--prompts", str(prompts), "-n", "64", "--json", "-q"]
    )
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["windows"] == 2 * len(range(0, 64 - WINDOW - 1, STRIDE)) and len(data["spearman"]) == 4
    saved = json.loads(open(data["path"]).read())
    assert saved["bands"] == [list(b) for b in data["bands"]]
    # four windows: correlations that are chance, said in one warning line beside the JSON
    assert data["windows"] < MIN_WINDOWS and "rest on only 4 windows" in data["note"]
    assert result.stderr.count("epikv: warning: the correlations rest on only 4 windows") == 1
    run = runner.invoke(app, ["generate", "--model", str(tiny_model_dir), "-p", "epikv", "-n", "4", "--json", "hi"])
    used = json.loads(run.stdout)
    assert used["bands"] == saved["bands"] and used["bands_source"] == f"calibrated ({data['path']})"
    assert f"(calibrated ({data['path']}))" in run.stderr  # generate says that it uses them, and which file
    override = json.loads(
        runner.invoke(
            app,
            ["generate", "--model", str(tiny_model_dir), "-p", "epikv", "-n", "4", "--json", "--bands", "0:+1", "hi"],
        ).stdout
    )
    assert override["bands"] == [[0, 1.0]] and override["bands_source"] == "--bands"


def test_the_table_says_where_the_bands_were_saved(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("EPIKV_CACHE_DIR", str(tmp_path))
    prompts = tmp_path / "p.txt"
    prompts.write_text("The first prompt.\n")
    result = runner.invoke(app, ["calibrate", "--model", str(tiny_model_dir), "--prompts", str(prompts), "-n", "64"])
    assert result.exit_code == 0, result.stderr
    saved = next((tmp_path / "bands").glob("*.json"))
    assert f"bandssavedto{saved}" in "".join(result.stdout.split())  # the table wraps at the runner's width


def saved_record(bands) -> bytes:
    """A saved calibration's JSON with ``bands``, every other field as calibrate writes it."""
    record = {"model": "m", "bands": bands, "spearman": [0.0] * 4, "windows": 9, "prompts": 2, "new_tokens": 64}
    return json.dumps(record).encode()


@pytest.mark.parametrize(
    "content",
    [b"", b"{not json", b'{"bands": 3}', saved_record([]), saved_record([[1, 5]]), saved_record([[1.9, -1]])],
)
def test_an_unreadable_bands_file_is_named_in_a_warning(tiny_model_dir, tmp_path, monkeypatch, content):
    """A bands file left empty by a full disk (or damaged) was silently ignored: now one warning names it."""
    monkeypatch.setenv("EPIKV_CACHE_DIR", str(tmp_path))
    path = bands_path(str(tiny_model_dir.resolve()))
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    args = ["generate", "--model", str(tiny_model_dir), "-p", "epikv", "-n", "4", "--json", "-q", "hi"]
    run = runner.invoke(app, args)
    assert run.exit_code == 0, run.stderr
    assert json.loads(run.stdout)["bands_source"].startswith("default")
    warning = [line for line in run.stderr.splitlines() if line.startswith("epikv: warning:")]
    assert len(warning) == 1 and f"cannot read the calibrated bands {path}" in warning[0]


def test_the_cache_directory_holds_calibrations_says_the_help():
    assert "calibrated bands" in " ".join(runner.invoke(app, ["--help"]).stdout.split())


def test_too_few_tokens_for_a_window(tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    result = runner.invoke(app, ["calibrate", "--model", str(tiny_model_dir), "--prompts", str(prompts), "-n", "40"])
    assert result.exit_code == 2 and "--new-tokens must be at least 48" in result.stderr


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_prints_what_the_finished_prompts_say_and_saves_nothing(tiny_model_dir, tmp_path, monkeypatch, as_json):
    monkeypatch.setenv("EPIKV_CACHE_DIR", str(tmp_path))
    real = calibrate_module.trace
    calls = {"n": 0}

    def interrupted_at_the_third(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(calibrate_module, "trace", interrupted_at_the_third)
    prompts = tmp_path / "p.txt"
    prompts.write_text("The first prompt.\nA second one, longer than the first.\nA third.\n")
    args = ["calibrate", "--model", str(tiny_model_dir), "--prompts", str(prompts), "-n", "64", "-q"]
    result = runner.invoke(app, [*args, *(["--json"] if as_json else [])])
    assert result.exit_code == 130, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "epikv: interrupted after 2 of 3 prompts; these bands were not saved"
    )
    assert not (tmp_path / "bands").exists()
    if as_json:
        data = json.loads(result.stdout)
        assert data["prompts"] == 2 and data["path"] is None
        assert data["windows"] == 2 * len(range(0, 64 - WINDOW - 1, STRIDE))
    else:
        assert "nowhere (not saved)" in " ".join(result.stdout.split())


def test_a_config_json_is_refused_before_anything_loads(tiny_model_dir, tmp_path, monkeypatch):
    """Random weights from a config.json would be calibrated and saved under bands generate never reads for them."""
    monkeypatch.setenv("EPIKV_CACHE_DIR", str(tmp_path))
    prompts = tmp_path / "p.txt"
    prompts.write_text("The first prompt.\n")
    args = ["calibrate", "--model", str(tiny_model_dir / "config.json"), "--prompts", str(prompts), "-n", "64"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "epikv: error: calibrate measures a model's trained weights; a config.json builds random ones, for which "
        "generate reads no saved bands: give the model's directory"
    ]
    assert not (tmp_path / "bands").exists()
