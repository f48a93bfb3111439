"""`epikv fidelity`: the replay reproduces the full cache, equals a masked forward under eviction, and reports."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
from test_exactness import masked_reference
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from epikv_cli.cli import calibrate as calibrate_cli
from epikv_cli.cli import fidelity as fidelity_cli
from epikv_cli.cli.app import app
from epikv_cli.cli.ui import fixed
from epikv_cli.config import CacheSettings
from epikv_cli.data.problems import load_problems, protocol_ids
from epikv_cli.errors import UsageError
from epikv_cli.experiments.fidelity import BudgetSpec, Config, repeated_ngram_share, replay
from epikv_cli.runtime.stream import CacheStream

from conftest import tiny_model

MODEL = tiny_model("llama", seed=6)
runner = CliRunner()


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Per row KL(p || q) from raw logits (the independent reference)."""
    p, q = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return (p.exp() * (p - q)).sum(-1)


def test_full_cache_replay_reproduces_the_reference():
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    tokens, results = replay(MODEL, ids, [Config("full", BudgetSpec.parse("+8"))], 40)
    assert results[0]["kl_all"] < 1e-6 and results[0]["top1_all"] == 1.0
    assert results[0]["kl_after_full"] is None and results[0]["positions_after_full"] == 0
    with torch.no_grad():  # the reference is greedy decoding of the full model
        logits = MODEL(torch.tensor([ids[0].tolist() + tokens[:-1]])).logits[0, 23:]
    assert logits.argmax(-1).tolist() == tokens


@pytest.mark.parametrize("policy", ["streaming", "epikv", "h2o"])
def test_replay_under_eviction_equals_a_masked_full_forward(policy):
    prompt_len, new = 24, 50
    ids = torch.randint(0, 256, (1, prompt_len), generator=torch.Generator().manual_seed(4))
    config = Config(policy, BudgetSpec.parse("+16"))
    tokens, results = replay(MODEL, ids, [config], new, trace=True)
    sequence = ids[0].tolist() + tokens[:-1]
    # the same teacher-forced stream, to learn what it evicted at each step
    evicted = []
    with CacheStream(MODEL, config.settings(prompt_len), max_tokens=prompt_len + new) as stream:
        stream.feed(ids)
        evicted.append(stream.session.last.evicted)
        for token in tokens[:-1]:
            stream.feed(torch.tensor([[token]]))
            evicted.append(stream.session.last.evicted)
    masked = masked_reference(MODEL, sequence, prompt_len, evicted)
    with torch.no_grad():
        full = MODEL(torch.tensor([sequence])).logits[0, prompt_len - 1 :]
    per_position = kl(full, masked)
    filled = [sum(len(e) for e in evicted[:i]) > 0 for i in range(new)]  # evicted before step i's forward
    after = per_position[torch.tensor(filled)]
    assert results[0]["kl_all"] == pytest.approx(float(per_position.mean()), rel=1e-3, abs=1e-6)
    assert results[0]["kl_after_full"] == pytest.approx(float(after.mean()), rel=1e-3, abs=1e-6)
    assert results[0]["positions_after_full"] == int(sum(filled))
    nll = -torch.log_softmax(masked.double(), -1)[torch.arange(new), torch.tensor(tokens)]
    assert results[0]["perplexity"] == pytest.approx(float(nll.mean().exp()), rel=1e-4)
    assert results[0]["top1_all"] == pytest.approx(float((masked.argmax(-1) == torch.tensor(tokens)).double().mean()))
    assert results[0]["kl_all"] > 1e-4  # eviction did move the distribution
    # --trace: every position's KL, in order
    assert results[0]["kl_by_position"] == pytest.approx(per_position.tolist(), rel=1e-3, abs=1e-5)


def test_budgets_parse_and_resolve():
    assert BudgetSpec.parse("+96").resolve(40) == 136 and BudgetSpec.parse("128").resolve(40) == 128
    assert BudgetSpec.parse("+96").text == "+96"
    for bad in ("+x", "-5", "0", "+0", "1.5", ""):
        with pytest.raises(UsageError):
            BudgetSpec.parse(bad)


def test_a_budget_too_small_for_a_prompt_is_that_configs_error():
    ids = torch.randint(0, 256, (1, 40))
    _, results = replay(
        MODEL, ids, [Config("epikv", BudgetSpec.parse("+4")), Config("streaming", BudgetSpec.parse("+4"))], 10
    )
    assert "use --budget" in results[0]["error"] and "kl_all" not in results[0]
    assert results[1]["kl_all"] >= 0 and "error" not in results[1]


def dataset(tmp_path, rows):
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_problems_from_datasets(tmp_path):
    path = dataset(
        tmp_path,
        [{"problem": "p1", "answer": 3.0}, {"question": "q2", "answer": "#### 5"}, {"problem": "p3", "id": "x"}],
    )
    problems = load_problems(path)
    assert [(p.id, p.prompt, p.answer) for p in problems] == [(1, "p1", "3"), (2, "q2", "#### 5"), ("x", "p3", None)]
    assert [p.prompt for p in load_problems(path, limit=1, offset=1)] == ["q2"]
    with pytest.raises(UsageError, match="no 'topic' text field"):
        load_problems(path, field="topic")
    with pytest.raises(UsageError, match="--limit must be at least 1"):
        load_problems(path, limit=0)


def test_cli_json_resume_and_output(tiny_model_dir, tmp_path):
    path = dataset(tmp_path, [{"problem": "What is 2 + 2?"}, {"problem": "Name a prime."}, {"problem": "Say hi."}])
    out = tmp_path / "fid.jsonl"
    args = [
        "fidelity",
        "--model",
        str(tiny_model_dir),
        "--prompts",
        str(path),
        "--policies",
        "streaming,epikv",
        "--budgets",
        "+40,64",
        "-n",
        "24",
        "--output",
        str(out),
        "--json",
        "-q",
    ]
    first = runner.invoke(app, [*args, "--limit", "2"])
    assert first.exit_code == 0, first.stderr
    data = json.loads(first.stdout)
    assert (data["new_tokens"], data["prompts"]) == (24, 2)
    assert [(r["policy"], r["budget"]) for r in data["results"]] == [
        ("streaming", "+40"),
        ("streaming", "64"),
        ("epikv", "+40"),
        ("epikv", "64"),
    ]
    assert set(data["results"][0]) >= {
        "kl_after_full",
        "kl_all",
        "top1_after_full",
        "top1_all",
        "perplexity",
        "kept_age",
    }
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == [1, 2]
    # each line says how repetitive its reference is: recomputed from the same greedy reference
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = protocol_ids(AutoTokenizer.from_pretrained(tiny_model_dir), load_problems(path, limit=1)[0])
    reference, _ = replay(model, ids, [], 24)
    assert lines[0]["reference_repeats"] == pytest.approx(repeated_ngram_share(ids[0].tolist(), reference))
    second = runner.invoke(app, [*args, "--resume"])
    assert second.exit_code == 0, second.stderr
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [1, 2, 3]
    assert json.loads(second.stdout)["results"][0]["prompts_counted"] == 3  # the resumed lines count too


def test_cli_trace_writes_the_reference_and_each_positions_kl(tiny_model_dir, tmp_path):
    path = dataset(tmp_path, [{"problem": "What is 2 + 2?"}])
    out = tmp_path / "trace.jsonl"
    result = runner.invoke(
        app,
        [
            "fidelity",
            "--model",
            str(tiny_model_dir),
            "--prompts",
            str(path),
            "--policies",
            "streaming,epikv2",
            "--budgets",
            "+8",
            "-n",
            "20",
            "--trace",
            "--output",
            str(out),
            "-q",
        ],
    )
    assert result.exit_code == 0, result.stderr
    record = json.loads(out.read_text())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = protocol_ids(AutoTokenizer.from_pretrained(tiny_model_dir), load_problems(path)[0])
    assert record["reference_tokens"] == replay(model, ids, [], 20)[0]
    for row in record["results"]:
        assert len(row["kl_by_position"]) == 20
        assert sum(row["kl_by_position"]) / 20 == pytest.approx(row["kl_all"], abs=1e-5)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--trace"], "give --output FILE"),
        (["--budgets", "+x"], "is not a budget"),
        (["--budgets", "-5"], "is not a budget"),
        (["--policies", "h3o"], "unknown policy 'h3o'"),
        (["--policies", "streaming,,epikv2"], "--policies 'streaming,,epikv2' has an empty item"),
        (["--policies", "epikv2:recent=2:recent=3"], "policy option 'recent' is given 2 times; give it once"),
        (["--budgets", "+8,"], "--budgets '+8,' has an empty item"),
        (["--limit", "0"], "--limit must be at least 1"),
        (["--field", "nope"], "no 'nope' text field"),
        (["--budgets", "+64,+64"], "--budgets lists +64 twice"),
        (["--prompts", "DUPLICATES"], 'lines 1 and 2 have the same id "a"'),
    ],
)
def test_bad_input(tiny_model_dir, tmp_path, args, needle):
    path = dataset(tmp_path, [{"problem": "What is 2 + 2?"}])
    duplicates = tmp_path / "dup.jsonl"
    duplicates.write_text('{"id": "a", "problem": "One?"}\n{"id": "a", "problem": "Two?"}\n')
    args = [str(duplicates) if a == "DUPLICATES" else a for a in args]
    result = runner.invoke(app, ["fidelity", "--model", str(tiny_model_dir), "--prompts", str(path), "-n", "8", *args])
    assert result.exit_code == 2 and needle in result.stderr and len(result.stderr.strip().splitlines()) == 1, (
        result.stderr
    )


def test_cache_settings_for_relative_budgets():
    assert Config("epikv", BudgetSpec.parse("+96")).settings(50) == CacheSettings(budget=146, policy="epikv")


def test_the_full_cache_runs_once_whatever_the_budgets():
    from epikv_cli.experiments.fidelity import check_configs

    configs = check_configs("full,epikv", "+64,128")
    assert [(c.policy, c.budget.text) for c in configs] == [("full", "none"), ("epikv", "+64"), ("epikv", "128")]
    assert configs[0].settings(30).budget is None
    with pytest.raises(UsageError, match="twice"):
        check_configs("epikv,epikv", "+64")


def test_repeated_ngram_share_counts_generated_tokens_closing_an_earlier_ngram():
    # n = 2 over prompt [1, 2] + generated [1, 2, 3, 1, 2]: the bigrams ending at generated tokens are
    # (2,1) new, (1,2) seen in the prompt, (2,3) new, (3,1) new, (1,2) seen: 2 of 5
    assert repeated_ngram_share([1, 2], [1, 2, 3, 1, 2], n=2) == pytest.approx(2 / 5)
    # a bigram straddling the prompt's end counts: prompt [5, 6, 5], generated [6] closes (5, 6)
    assert repeated_ngram_share([5, 6, 5], [6], n=2) == 1.0
    assert repeated_ngram_share([1, 2, 3], [4, 5, 6], n=2) == 0.0
    assert repeated_ngram_share([1, 2], [], n=2) is None
    # a generated run shorter than n that repeats nothing longer than itself is not a repeat
    assert repeated_ngram_share([7], [7, 7], n=3) == 0.0


def fidelity_args(model_dir, prompts, out, *extra):
    return ["fidelity", "--model", str(model_dir), "--prompts", str(prompts), "-o", str(out), "--json", "-q", *extra]


def test_resume_refuses_another_length_and_other_prompts(tiny_model_dir, tmp_path):
    """Resumed with -n 12 over -n 24 results, fidelity would average both lengths; other prompts under the same ids
    would be counted as these."""
    path = dataset(tmp_path, [{"problem": "What is 2 + 2?"}, {"problem": "Name a prime."}])
    out = tmp_path / "fid.jsonl"
    base = ("--policies", "streaming", "--budgets", "+8")
    first = runner.invoke(app, fidelity_args(tiny_model_dir, path, out, *base, "-n", "24", "--limit", "1"))
    assert first.exit_code == 0, first.stderr
    shorter = runner.invoke(app, fidelity_args(tiny_model_dir, path, out, *base, "-n", "12", "--resume"))
    assert shorter.exit_code == 2 and len(shorter.stderr.strip().splitlines()) == 1, shorter.stderr
    assert "new_tokens = 24, this run has new_tokens = 12" in shorter.stderr
    (tmp_path / "other").mkdir()
    other = dataset(tmp_path / "other", [{"problem": "Something else entirely?"}])
    swapped = runner.invoke(app, fidelity_args(tiny_model_dir, other, out, *base, "-n", "24", "--resume"))
    assert swapped.exit_code == 2 and "answers a different prompt than" in swapped.stderr, swapped.stderr
    assert len(out.read_text().splitlines()) == 1  # nothing was added by a refused resume


def test_a_policy_added_on_resume_runs_on_the_prompts_already_finished(tiny_model_dir, tmp_path):
    path = dataset(tmp_path, [{"problem": "What is 2 + 2?"}, {"problem": "Name a prime."}])
    out = tmp_path / "fid.jsonl"
    first = runner.invoke(
        app, fidelity_args(tiny_model_dir, path, out, "--policies", "streaming", "--budgets", "+8", "-n", "12")
    )
    assert first.exit_code == 0, first.stderr
    added = runner.invoke(
        app,
        fidelity_args(
            tiny_model_dir, path, out, "--policies", "streaming,h2o", "--budgets", "+8", "-n", "12", "--resume"
        ),
    )
    assert added.exit_code == 0, added.stderr
    counted = {r["policy"]: r["prompts_counted"] for r in json.loads(added.stdout)["results"]}
    assert counted == {"streaming": 2, "h2o": 2}
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], [x["policy"] for x in r["results"]]) for r in lines] == [
        (1, ["streaming"]),
        (2, ["streaming"]),
        (1, ["h2o"]),
        (2, ["h2o"]),
    ]


def test_the_summary_keeps_every_digit_of_the_means(tiny_model_dir, tmp_path):
    """--json printed means rounded to 6 digits; a script comparing policies needs them as computed."""
    path = dataset(tmp_path, [{"problem": "What is 2 + 2?"}, {"problem": "Name a prime."}, {"problem": "Say hi."}])
    out = tmp_path / "fid.jsonl"
    result = runner.invoke(
        app, fidelity_args(tiny_model_dir, path, out, "--policies", "streaming", "--budgets", "+8", "-n", "16")
    )
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)["results"][0]
    per_prompt = [r["results"][0]["kl_all"] for r in map(json.loads, out.read_text().splitlines())]
    assert summary["kl_all"] == statistics.fmean(per_prompt)


def test_no_kl_prints_as_a_negative_zero():
    assert [fixed(v, 4) for v in (-3e-9, -0.00004, 0.0, -0.0)] == ["0.0000"] * 4
    assert fixed(-0.4, 0) == "0" and fixed(-0.2, 1) == "-0.2" and fixed(0.12345, 4) == "0.1235"


def test_resume_after_a_line_cut_short_rewrites_the_file(tiny_model_dir, tmp_path):
    """A crash left half a line without its newline: the resumed record went onto its end, and the next --resume
    refused the file."""
    path = dataset(tmp_path, [{"problem": "What is 2 + 2?"}, {"problem": "Name a prime."}])
    out = tmp_path / "fid.jsonl"
    base = ("--policies", "streaming", "--budgets", "+8", "-n", "8")
    assert runner.invoke(app, fidelity_args(tiny_model_dir, path, out, *base, "--limit", "1")).exit_code == 0
    with out.open("a") as file:
        file.write('{"id": 2, "line": 2, "prompt_tokens": 4')  # cut short by a crash
    resumed = runner.invoke(app, fidelity_args(tiny_model_dir, path, out, *base, "--resume"))
    assert resumed.exit_code == 0, resumed.stderr
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [1, 2]
    again = runner.invoke(app, fidelity_args(tiny_model_dir, path, out, *base, "--resume"))
    assert again.exit_code == 0, again.stderr
    assert json.loads(again.stdout)["results"][0]["prompts_counted"] == 2
    assert len(out.read_text().splitlines()) == 2


def test_resume_with_another_range_summarises_only_its_prompts(tiny_model_dir, tmp_path):
    path = dataset(tmp_path, [{"problem": "What is 2 + 2?"}, {"problem": "Name a prime."}, {"problem": "Say hi."}])
    out = tmp_path / "fid.jsonl"
    base = ("--policies", "streaming", "--budgets", "+8", "-n", "8")
    assert runner.invoke(app, fidelity_args(tiny_model_dir, path, out, *base)).exit_code == 0
    part = runner.invoke(
        app, fidelity_args(tiny_model_dir, path, out, *base, "--resume", "--offset", "1", "--limit", "1")
    )
    assert part.exit_code == 0, part.stderr
    data = json.loads(part.stdout)
    kl_of_2 = json.loads(out.read_text().splitlines()[1])["results"][0]["kl_all"]
    assert (data["prompts"], data["results"][0]["prompts_counted"], data["results"][0]["kl_all"]) == (1, 1, kl_of_2)
    assert len(out.read_text().splitlines()) == 3  # the file keeps the other prompts


def refuse_to_load(*args, **kwargs):
    raise AssertionError("the model loaded before the prompts were checked")


@pytest.mark.parametrize("command", ["fidelity", "calibrate"])
@pytest.mark.parametrize(
    "line, needle",
    [
        ({"id": 2.5, "problem": "Two?"}, "'id' must be a string or a whole number, got 2.5"),
        ({"id": None, "problem": "Two?"}, "'id' must be a string or a whole number, got null"),
        ({"id": ["b"], "problem": "Two?"}, "'id' must be a string or a whole number, got [\"b\"]"),
        ({"messages": "hello"}, "'messages' must be a non-empty list of {'role', 'content'} objects"),
        ({"messages": [{"role": "user", "content": 2}]}, "'messages' must be a non-empty list of {'role', 'content'}"),
    ],
)
def test_a_bad_id_or_messages_is_refused_before_the_model_loads(
    tiny_model_dir, tmp_path, monkeypatch, command, line, needle
):
    path = dataset(tmp_path, [{"problem": "One?"}, line])
    monkeypatch.setattr(fidelity_cli, "load", refuse_to_load)
    monkeypatch.setattr(calibrate_cli, "load", refuse_to_load)
    result = runner.invoke(app, [command, "--model", str(tiny_model_dir), "--prompts", str(path), "-n", "4"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"epikv: error: {path}:2: {needle}"), result.stderr


def test_problems_keep_well_formed_messages_and_ids(tmp_path):
    messages = [{"role": "user", "content": "Hi"}]
    path = dataset(tmp_path, [{"id": "a", "messages": messages}, {"unique_id": "test/1.json", "problem": "p2"}])
    assert [(p.id, p.messages, p.prompt) for p in load_problems(path)] == [
        ("a", messages, None),
        ("test/1.json", None, "p2"),
    ]
