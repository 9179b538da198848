"""Tests of the decode microbenchmark ``benchmark/topology_kv_candidate_schedule.py``.

The command line (parsing, defaults, errors, output columns, JSON, RNG hygiene) runs
in-process through ``main(argv)`` on tiny shapes; one test runs the script as a
subprocess from a foreign working directory. The attention hooks the benchmark times
are checked against the plain reference. All on CPU; a few seconds in total.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from unittest import mock

import pytest
import torch

from benchmark.candidates import schedule_bench as bench

# Not resolved: under Bazel the runfiles symlink must stay, so that the script finds the
# runfiles tree (not the source tree) as its repository root.
SCRIPT = pathlib.Path(os.path.abspath(bench.__file__)).parents[1] / "topology_kv_candidate_schedule.py"  # the command

# Smallest run that still has two budgets, partial blocks off, and a schedule with
# sink, local and witness blocks (S=256 -> 1 + 2 + 1 blocks of 64 over 8 blocks).
TINY = ["--seq-len", "512", "--selected-tokens", "64", "256", "--heads", "2", "--head-dim", "8",
        "--rounds", "2", "--warmup", "1", "--device", "cpu"]

# The TSV contract: these columns first, in this order.
CONTRACT_COLUMNS = ["seq_len", "selected_tokens", "dense_sdpa_ms", "sparse_selected_ms", "speedup",
                    "schedule_ms", "ideal_speedup", "fraction_of_ideal"]

# The screening command line of the validation report (16k context, 4 budgets) on the CPU.
SCREENING_ARGV = ["--seq-len", "16384", "--selected-tokens", "128", "256", "512", "1024", "--heads", "16",
              "--head-dim", "64", "--rounds", "60", "--warmup", "20", "--device", "cpu"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def _parse_tsv(text: str):
    lines = text.strip().splitlines()
    header = lines[0].split("\t")
    return header, [dict(zip(header, line.split("\t"))) for line in lines[1:]]


# ---------------------------------------------------------------- parsing


def test_defaults():
    args = bench.parse_args([])
    assert (args.seq_len, args.selected_tokens, args.heads, args.head_dim) == (8192, [512], 16, 64)
    assert (args.rounds, args.warmup, args.block_size, args.seed) == (50, 20, 64, 0)
    assert args.device == ("cuda" if torch.cuda.is_available() else "cpu")  # auto resolved
    assert args.dtype == ("bfloat16" if args.device == "cuda" else "float32")
    assert args.cache == "warm" and args.json is None
    assert args.threads == sorted({1, torch.get_num_threads()})


def test_screening_command_line_parses():
    args = bench.parse_args(SCREENING_ARGV)
    assert args.seq_len == 16384 and args.selected_tokens == [128, 256, 512, 1024]
    assert (args.heads, args.head_dim, args.rounds, args.warmup) == (16, 64, 60, 20)
    assert (args.device, args.dtype) == ("cpu", "float32")


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--seq-len", "0"], "--seq-len"),
        (["--seq-len", "-5"], "--seq-len"),
        (["--selected-tokens", "0"], "--selected-tokens"),
        (["--selected-tokens", "-64"], "--selected-tokens"),
        (["--selected-tokens", "64", "1024"], "--selected-tokens"),  # > --seq-len 512
        (["--selected-tokens", "100"], "--selected-tokens"),  # not whole 64-token blocks
        (["--heads", "0"], "--heads"),
        (["--head-dim", "0"], "--head-dim"),
        (["--rounds", "0"], "--rounds"),
        (["--warmup", "-1"], "--warmup"),
        (["--block-size", "0"], "--block-size"),
        (["--threads", "0"], "--threads"),
        (["--device", "tpu"], "--device"),
        (["--dtype", "int8"], "--dtype"),
        (["--cache", "lukewarm"], "--cache"),
        (["--seq-len", "many"], "--seq-len"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(extra, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(TINY + extra)  # later flags override TINY's
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_cuda_without_gpu_is_a_clear_error(capsys):
    with mock.patch.object(torch.cuda, "is_available", return_value=False):
        with pytest.raises(SystemExit) as exc:
            bench.main(TINY + ["--device", "cuda"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--device cuda" in err and "no CUDA device" in err


def test_auto_device_without_gpu_is_cpu():
    with mock.patch.object(torch.cuda, "is_available", return_value=False):
        args = bench.parse_args(["--device", "auto"])
    assert (args.device, args.dtype) == ("cpu", "float32")


# ---------------------------------------------------------------- running in-process


def test_main_prints_the_table_and_progress(capsys):
    threads = torch.get_num_threads()
    assert bench.main(TINY) == 0
    out, err = capsys.readouterr()
    header, rows = _parse_tsv(out)
    assert header[: len(CONTRACT_COLUMNS)] == CONTRACT_COLUMNS
    assert header == list(bench.COLUMNS)
    assert [int(r["selected_tokens"]) for r in rows] == [64, 256]
    for r in rows:
        assert int(r["seq_len"]) == 512 and int(r["attended_tokens"]) == int(r["selected_tokens"])
        ideal = 512 / int(r["selected_tokens"])
        assert float(r["ideal_speedup"]) == pytest.approx(ideal, abs=1e-4)
        best_dense = min(float(r["dense_sdpa_ms"]), float(r["dense_matmul_ms"]))
        assert r["baseline"] == ("matmul" if float(r["dense_matmul_ms"]) < float(r["dense_sdpa_ms"]) else "sdpa")
        # Rounded to 4 decimals in the TSV: compare loosely.
        assert float(r["speedup"]) == pytest.approx(best_dense / float(r["sparse_selected_ms"]), rel=1e-2)
        assert float(r["fraction_of_ideal"]) == pytest.approx(float(r["speedup"]) / ideal, rel=1e-2)
        assert float(r["schedule_ms"]) > 0 and float(r["sparse_selected_ms"]) > 0
        assert float(r["dense_sdpa_p10_ms"]) <= float(r["dense_sdpa_ms"]) <= float(r["dense_sdpa_p90_ms"])
    for budget in (64, 256):  # one progress line per budget on stderr
        assert f"S={budget}:" in err and f"L=512 S={budget}:" in err
    assert torch.get_num_threads() == threads  # per-kernel thread counts restored


def test_partial_last_block_reports_attended_tokens(capsys):
    # L = 500: the local block 7 holds tokens 448..499 only, so 256 selected -> 244 attended.
    assert bench.main(TINY + ["--seq-len", "500"]) == 0
    _, rows = _parse_tsv(capsys.readouterr().out)
    assert [int(r["attended_tokens"]) for r in rows] == [64, 244]


def test_global_rng_state_untouched(capsys):
    before = torch.get_rng_state()
    bench.main(TINY + ["--seed", "7"])
    assert torch.equal(torch.get_rng_state(), before)


def test_json_report(tmp_path, capsys):
    path = tmp_path / "sub" / "report.json"
    assert bench.main(TINY + ["--json", str(path), "--cache", "cold", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    report = json.loads(path.read_text())
    for key in ("device", "torch_version", "num_threads", "dtype", "args", "rows", "columns"):
        assert key in report
    assert report["torch_version"] == torch.__version__ and report["dtype"] == "float32"
    assert report["args"]["seq_len"] == 512 and report["args"]["cache"] == "cold"
    assert report["columns"] == list(bench.COLUMNS)
    _, rows = _parse_tsv(out)
    assert [r["selected_tokens"] for r in report["rows"]] == [int(r["selected_tokens"]) for r in rows]
    assert [r["sparse_threads"] for r in report["rows"]] == [1, 1]


def test_json_relative_path_resolves_against_bazel_working_directory(tmp_path, monkeypatch, capsys):
    runfiles = tmp_path / "runfiles"
    runfiles.mkdir()
    monkeypatch.chdir(runfiles)  # `bazel run` starts the binary in its runfiles tree
    with mock.patch.dict(os.environ, {"BUILD_WORKING_DIRECTORY": str(tmp_path)}):
        assert bench.main(TINY + ["--selected-tokens", "64", "--json", "out.json"]) == 0
    assert (tmp_path / "out.json").is_file()
    assert not (runfiles / "out.json").exists()


def test_script_runs_from_another_directory(tmp_path):
    # No PYTHONPATH pointing at the repository: the script must find `rtp_llm` itself.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "BUILD_WORKING_DIRECTORY")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)] + TINY + ["--json", "r.json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    header, rows = _parse_tsv(proc.stdout)
    assert header[: len(CONTRACT_COLUMNS)] == CONTRACT_COLUMNS and len(rows) == 2
    assert json.loads((tmp_path / "r.json").read_text())["rows"][0]["selected_tokens"] == 64


# ---------------------------------------------------------------- attention hooks

# fp32 sums of <= 300 products: differences of a few ulp; 16-bit outputs round at ~4e-3.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _qkv(L: int, H: int, D: int, seed: int, dtype=torch.float32):
    g = _gen(seed)
    return tuple(torch.randn(*shape, generator=g).to(dtype) for shape in ((H, D), (L, H, D), (L, H, D)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", list(bench.DenseBackend))
def test_dense_matches_reference(dtype, backend):
    q, k, v = _qkv(300, 4, 16, seed=1, dtype=dtype)
    got = bench.dense_decode_attention(q, k, v, backend=backend)
    assert got.shape == (4, 16) and got.dtype == dtype
    torch.testing.assert_close(got.float(), bench.reference_decode_attention(q, k, v), **TOL[dtype],
                               msg=f"dense {backend}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selected_over_all_tokens_equals_dense(dtype):
    q, k, v = _qkv(300, 4, 16, seed=2, dtype=dtype)
    order = torch.randperm(300, generator=_gen(3))  # order must not matter
    got = bench.selected_decode_attention(q, k, v, order)
    want = bench.dense_decode_attention(q, k, v, backend=bench.DenseBackend.SDPA)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_selected_subset_equals_masked_dense_reference():
    q, k, v = _qkv(300, 4, 16, seed=4)
    subset = torch.tensor([0, 1, 2, 64, 65, 128, 299], dtype=torch.int64)
    # Dense attention with every other score masked to -inf, written out separately.
    scores = torch.einsum("hd,lhd->hl", q, k) / 4.0  # [H, L], 1/sqrt(16)
    keep = torch.zeros(300, dtype=torch.bool)
    keep[subset] = True
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)  # [H, L]
    want = torch.einsum("hl,lhd->hd", probs, v)
    torch.testing.assert_close(bench.selected_decode_attention(q, k, v, subset), want, **TOL[torch.float32])
    torch.testing.assert_close(bench.reference_decode_attention(q, k, v, subset), want, **TOL[torch.float32])


def test_padding_entries_are_ignored_and_workspace_is_reused():
    q, k, v = _qkv(300, 4, 16, seed=5)
    ids = torch.tensor([5, 70, 71, 299], dtype=torch.int64)
    padded = torch.tensor([5, -1, 70, 71, -1, 299, -1, -1], dtype=torch.int64)
    ws = bench.SelectedAttentionWorkspace.allocate(8, 4, 16, torch.float32, torch.device("cpu"))
    got = bench.selected_decode_attention(q, k, v, padded, workspace=ws)
    assert got.data_ptr() == ws.out.data_ptr()
    torch.testing.assert_close(got, bench.selected_decode_attention(q, k, v, ids), **TOL[torch.float32])
    again = bench.selected_decode_attention_unchecked(q, k, v, padded, ws)  # the timed path
    torch.testing.assert_close(again, bench.reference_decode_attention(q, k, v, ids), **TOL[torch.float32])


def test_candidate_indices_follow_the_schedule():
    k = torch.randn(1024, 2, 8, generator=_gen(6))  # 16 blocks
    ids = bench.candidate_token_indices(k, 256)  # 4 blocks: 1 sink, 2 local, 1 witness
    assert ids.dtype == torch.int64 and ids.shape == (256,)
    blocks = sorted(set((ids // 64).tolist()))
    assert blocks[0] == 0 and blocks[-2:] == [14, 15] and len(blocks) == 4
    assert torch.equal(ids, torch.sort(ids).values) and ids.unique().numel() == 256


@pytest.mark.parametrize(
    "mutate, arg",
    [
        (lambda q, k, v, i: (q[0], k, v, i), "q"),
        (lambda q, k, v, i: (q, k[:, :1], v, i), "k"),
        (lambda q, k, v, i: (q, k, v[:-1], i), "v"),
        (lambda q, k, v, i: (q, k, v, i.to(torch.int32)), "token_indices"),
        (lambda q, k, v, i: (q, k, v, i + 300), "token_indices"),  # out of range
        (lambda q, k, v, i: (q, k, v, torch.full_like(i, -1)), "token_indices"),
        (lambda q, k, v, i: (q, k, v, torch.zeros_like(i)), "token_indices"),  # duplicates
    ],
)
def test_selected_attention_validation_names_the_argument(mutate, arg):
    q, k, v = _qkv(300, 4, 16, seed=7)
    ids = torch.arange(0, 300, 30, dtype=torch.int64)
    with pytest.raises((ValueError, TypeError), match=arg):
        bench.selected_decode_attention(*mutate(q, k, v, ids))


def test_cache_mode_parse():
    assert bench.CacheMode.parse(" COLD ") is bench.CacheMode.COLD
    with pytest.raises(ValueError, match=r"\[warm, cold\]"):
        bench.CacheMode.parse("hot")
