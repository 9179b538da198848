"""Every command line of ``benchmark/`` refuses a bad flag before it starts the work.

An output path that is a file, lies under one or is a folder where a file is wanted, a
budget list with no budget, a model file that is not a readable GGUF, an unknown name, a
count below 1: each exits 2 with ``error: --flag ...`` before the model load (the loaders,
the text download and the benchmark loops are replaced by a tripwire here), not after a
15-35 minute run. ``--quick`` fills in only the flags not typed.
"""

from __future__ import annotations

import struct

import pytest

from benchmark import cli_checks

TRIPWIRE = "the command started its work before checking its flags"


def _tripwire(*_args, **_kw):
    raise AssertionError(TRIPWIRE)


@pytest.fixture(autouse=True)
def no_work(monkeypatch):
    """Every model load, text download and benchmark loop fails the test if reached."""
    import benchmark.candidates.policy_bench as policy_bench
    import benchmark.candidates.schedule_bench as schedule_bench
    import benchmark.e2e.cli as e2e_cli
    import benchmark.e2e.runner as e2e_runner
    import benchmark.quality.calibrate_cli as calibrate_cli
    import benchmark.quality.cli as quality_cli
    import benchmark.quality.model as quality_model
    import benchmark.validation.report as validation_report

    for module, name in [
        (quality_model, "load_gguf_model"), (quality_cli, "load_gguf_model"), (quality_cli, "ensure_austen_text"),
        (quality_cli, "load_text_file"), (calibrate_cli, "ensure_austen_text"), (calibrate_cli, "load_text_file"),
        (e2e_cli, "run"), (e2e_runner, "load_model"), (policy_bench, "run"), (schedule_bench, "run_benchmark"),
    ]:
        monkeypatch.setattr(module, name, _tripwire)
    monkeypatch.setattr(validation_report, "RUNNERS", {k: _tripwire for k in validation_report.RUNNERS})


def _main(command):
    import benchmark.candidates.policy_bench as policy_bench
    import benchmark.candidates.schedule_bench as schedule_bench
    import benchmark.e2e.cli as e2e_cli
    import benchmark.quality.calibrate_cli as calibrate_cli
    import benchmark.quality.cli as quality_cli
    import benchmark.quality.compare_cli as compare_cli
    import benchmark.indexer.train_cli as train_cli
    import benchmark.validation.report as validation_report

    return {"indexer_train": train_cli.main, "quality": quality_cli.main, "calibrate": calibrate_cli.main, "compare": compare_cli.main,
            "e2e": e2e_cli.main, "policy_bench": policy_bench.main, "schedule": schedule_bench.main,
            "report": validation_report.main}[command]


def _exit_code(command, argv):
    try:
        return _main(command)(argv)
    except SystemExit as exc:
        return exc.code


@pytest.fixture
def paths(tmp_path):
    """A file, a path under it, a folder, and model files that are not readable GGUFs."""
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    folder = tmp_path / "folder"
    folder.mkdir()
    text = tmp_path / "model.txt"
    text.write_text("hello, not a model")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 2))  # promises a tensor and two entries
    return dict(file=str(a_file), under_file=str(a_file / "sub"), folder=str(folder), text=str(text),
                empty=str(empty), truncated=str(truncated))


# (command, argv with {placeholders}, the flag the error names)
BAD_FLAGS = [
    ("quality", ["--out-dir", "{file}"], "--out-dir"),
    ("quality", ["--out-dir", "{under_file}"], "--out-dir"),
    ("quality", ["--budgets", ","], "--budgets"),
    ("quality", ["--model", "{text}"], "--model"),
    ("quality", ["--model", "{empty}"], "--model"),
    ("quality", ["--model", "{truncated}"], "--model"),
    ("quality", ["--threads", "-1"], "--threads"),
    ("quality", ["--num-layers", "0"], "--num-layers"),
    ("quality", ["--novel", "emma,nosuch"], "--novel"),
    ("calibrate", ["--out-dir", "{file}"], "--out-dir"),
    ("calibrate", ["--out-dir", "{under_file}"], "--out-dir"),
    ("calibrate", ["--budgets", ","], "--budgets"),
    ("calibrate", ["--shares", ","], "--shares"),
    ("calibrate", ["--model", "{text}"], "--model"),
    ("calibrate", ["--model", "{truncated}"], "--model"),
    ("calibrate", ["--threads", "-1"], "--threads"),
    ("compare", ["--run", "a={file}", "--out-dir", "{file}"], "--out-dir"),
    ("e2e", ["--json", "{folder}"], "--json"),
    ("e2e", ["--json", "{under_file}/a.json"], "--json"),
    ("e2e", ["--model", "{text}"], "--model"),
    ("e2e", ["--model", "{empty}"], "--model"),
    ("e2e", ["--novel", "nosuch"], "--novel"),
    ("e2e", ["--indexer-heads", "0"], "--indexer-heads"),
    ("e2e", ["--indexer-dim", "0"], "--indexer-dim"),
    ("e2e", ["--threads", "-1"], "--threads"),
    ("e2e", ["--num-layers", "0"], "--num-layers"),
    ("e2e", ["--quick", "--contexts", "0"], "--contexts"),
    ("e2e", ["--quick", "--budget", "0"], "--budget"),
    ("e2e", ["--merge", "{file}", "--out", "{file}"], "--out"),
    ("policy_bench", ["--json", "{folder}"], "--json"),
    ("policy_bench", ["--quick", "--rows", "0"], "--rows"),
    ("schedule", ["--json", "{folder}"], "--json"),
    ("schedule", ["--json", "{under_file}/a.json"], "--json"),
    ("report", ["--out-dir", "{file}"], "--out-dir"),
    ("quality", ["--indexer-checkpoint", "{text}"], "--indexer-checkpoint"),
    ("e2e", ["--indexer-checkpoint", "{text}"], "--indexer-checkpoint"),
    ("e2e", ["--indexer-checkpoint", "{folder}"], "--indexer-checkpoint"),
    ("indexer_train", ["--out", "{folder}"], "--out"),
    ("indexer_train", ["--out", "{under_file}/a.safetensors"], "--out"),
    ("indexer_train", ["--evaluate", "{under_file}"], "--evaluate"),
    ("indexer_train", [], "--out / --evaluate"),
    ("indexer_train", ["--out", "x.safetensors", "--model", "{text}"], "--model"),
    ("indexer_train", ["--out", "x.safetensors", "--report-dir", "{file}"], "--report-dir"),
    ("indexer_train", ["--out", "x.safetensors", "--shape", "big"], "--shape"),
    ("indexer_train", ["--out", "x.safetensors", "--novel", "nosuch"], "--novel"),
    ("indexer_train", ["--out", "x.safetensors", "--train-windows", "1"], "--train-windows"),
    ("indexer_train", ["--out", "x.safetensors", "--steps", "0"], "--steps"),
    ("indexer_train", ["--out", "x.safetensors", "--flag-margin", "1.5"], "--flag-margin"),
    ("indexer_train", ["--out", "x.safetensors", "--copy-segments", "-1"], "--copy-segments"),
    ("indexer_train", ["--out", "x.safetensors", "--train-contexts", "256", "--train-windows", "1"], "--copy-segments"),
]


@pytest.mark.parametrize("command, argv, flag", BAD_FLAGS,
                         ids=[f"{c}:{' '.join(a)}" for c, a, _ in BAD_FLAGS])
def test_a_bad_flag_exits_2_naming_it_before_any_work(command, argv, flag, paths, capsys):
    argv = [a.format(**paths) for a in argv]
    assert _exit_code(command, argv) == 2
    err = capsys.readouterr().err
    assert f"error: {flag}" in err, err[-500:]


@pytest.mark.parametrize("command", ["quality", "calibrate", "e2e"])
def test_a_long_bad_value_is_cut_in_the_message(command, capsys):
    assert _exit_code(command, ["--model", "/nonexistent/" + "m" * 100_000]) == 2
    err = capsys.readouterr().err
    assert "error: --model" in err and len(err) < 5000, len(err)


def test_quick_fills_in_only_the_flags_not_typed():
    from benchmark.e2e.cli import parse_args

    args = parse_args(["--quick", "--contexts", "1024", "--budget", "128"])
    assert args.contexts == [1024] and args.budget == [128]  # typed: kept (--budget takes a list of W)
    assert args.batches == [1, 4] and args.new_tokens == 4  # not typed: the quick run's


def test_output_checks_accept_new_and_existing_paths(tmp_path):
    assert cli_checks.check_output_dir("--out-dir", tmp_path / "new" / "deeper").is_dir()
    assert cli_checks.check_output_dir("--out-dir", tmp_path).is_dir()
    existing = tmp_path / "a.json"
    existing.write_text("{}")
    assert cli_checks.check_output_file("--json", existing) == existing
    assert existing.read_text() == "{}", "the check must not truncate an existing file"
    assert cli_checks.check_output_file("--json", tmp_path / "x" / "b.json").parent.is_dir()


def test_the_default_model_passes_the_gguf_check():
    from benchmark.quality.model import default_gguf_path

    path = default_gguf_path()
    if not path.is_file():
        pytest.skip(f"no default model at {path}")
    assert cli_checks.check_gguf("--model", path) == path


def test_an_output_folder_that_cannot_be_made_is_refused():
    # procfs takes no new folders, even for root (os.access would say yes there).
    with pytest.raises(cli_checks.FlagError, match=r"^--out-dir: cannot write into '/proc/self/topology_kv'"):
        cli_checks.check_output_dir("--out-dir", "/proc/self/topology_kv")
    with pytest.raises(cli_checks.FlagError, match=r"^--json: cannot write '/proc/self/topology_kv/a.json'"):
        cli_checks.check_output_file("--json", "/proc/self/topology_kv/a.json")
