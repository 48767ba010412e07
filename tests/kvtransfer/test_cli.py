"""The command line: every benchmark runs at a small size and prints its table."""

import os
import re
import subprocess
import sys

import pytest


def _kvt(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, UCX_NET_DEVICES="lo", UCX_TLS="tcp,self,sm", NIXL_LOG_LEVEL="WARN")
    return subprocess.run([sys.executable, "-m", "kvtransfer", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_bench_lists_names_and_rejects_unknown():
    out = _kvt("bench")
    assert out.returncode == 0 and "transport" in out.stdout and "plan" in out.stdout
    bad = _kvt("bench", "nonesuch")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_bench_transport_small():
    out = _kvt("bench", "transport", "--total", "8M", "--blocks", "256K", "--iters", "1", "--fixed-reps", "3")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "GB/s" in out.stdout
    for entries in (1, 160):  # the fixed cost per write, beside bare NIXL's: done on the writer, seen by the receiver
        assert re.search(rf"fixed cost per write, {entries} x 2 KiB .*: call -> wait\(\) returned: kvtransfer \d+\.\d us, "
                         r"bare NIXL \d+\.\d us \([+-]\d+\.\d us\); call -> the receiver saw it: kvtransfer \d+\.\d us, "
                         r"bare NIXL \d+\.\d us \([+-]\d+\.\d us\)", out.stdout), out.stdout
    small = _kvt("bench", "transport", "--total", "1M", "--blocks", "256K", "--iters", "1", "--fixed-reps", "1")
    assert small.returncode == 0 and "fixed cost per write, 160 x 2 KiB: skipped (--total holds 64 rows 16 KiB apart)" \
        in small.stdout, small.stdout + small.stderr


def test_bench_transport_kv_shares_the_staging_slots_on_one_host():
    """``bench transport --kv`` on loopback: the staged path shares the receiver's slots, and
    the same write through slots NIXL writes is timed beside it; both moved the request's
    bytes (checked against the reference before the timing)."""
    out = _kvt("bench", "transport", "--kv", "--iters", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"staged NIXL +\d+\.\d\d GB/s \(slots shared\) .* data ok", out.stdout), out.stdout
    assert re.search(r"staged, the sender's slots written by NIXL +\d+\.\d\d GB/s = +\d+\.\d % of blocks \(data ok\)",
                     out.stdout), out.stdout


def _mooncake_loads() -> bool:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _mooncake_loads(), reason="needs mooncake-transfer-engine (bench/mooncake.sh installs it)")
def test_bench_transport_times_mooncake_beside_nixl():
    out = _kvt("bench", "transport", "--mooncake", "--total", "4M", "--blocks", "256K", "--iters", "1",
               "--fixed-reps", "3")
    assert out.returncode == 0, out.stdout + out.stderr
    for entries in (1, 160):
        assert re.search(rf"fixed cost per write, {entries} x 2 KiB .*; Mooncake TE \(tcp\): returned \d+\.\d us, "
                         r"the receiver saw it \d+\.\d us", out.stdout), out.stdout


def test_bench_transport_mooncake_says_what_it_needs():
    """Mooncake's Transfer Engine is an optional baseline: without its wheel (CI installs none),
    --mooncake stops before any process starts and names the script that sets it up."""
    if _mooncake_loads():
        pytest.skip("mooncake-transfer-engine loads here")
    out = _kvt("bench", "transport", "--mooncake", "--total", "1M", "--blocks", "256K")
    assert out.returncode == 2 and "--mooncake needs mooncake-transfer-engine" in out.stderr \
        and "bench/mooncake.sh" in out.stderr, out.stderr
    bad = _kvt("bench", "transport", "--mooncake", "--kv")
    assert bad.returncode == 2 and "--mooncake times the fixed cost per write on host memory" in bad.stderr, bad.stderr


def test_bench_move_kv_cpu():
    out = _kvt("bench", "move_kv", "--cpu", "--iters", "2", "--warmup", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "native torch" in out.stdout


def test_layouts_prints_every_pool_kind():
    out = _kvt("layouts", "--page-size", "16", "--tp-size", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    for name in ("MHA bf16", "MHA fp8", "MHA fp4", "MLA", "NSA", "hybrid"):
        assert name in out.stdout
    assert "state buffers" in out.stdout


def test_bench_nvlink_names_the_gpus_it_needs():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("has GPUs: the real benchmark runs in bench/gpu_check.sh")
    out = _kvt("bench", "nvlink")
    assert out.returncode == 1
    assert f"needs CUDA GPUs 0 and 1, found {torch.cuda.device_count()}" in out.stdout + out.stderr
    one = _kvt("bench", "nvlink", "--dst-device", "0")  # one GPU is enough for that, none is not
    assert one.returncode == 1 and "needs CUDA GPUs 0 and 0" in one.stdout


def test_bench_nvlink_prints_n_a_for_a_path_that_did_not_run():
    from kvtransfer.benchmarks.nvlink import _rate_cells

    assert _rate_cells(2.0, 4.0) == "    2.0  50.0%"
    assert _rate_cells(float("nan"), 4.0) == "    n/a       "  # the staged engine on one GPU


# -- bad arguments and dead children: one clear line, no traceback, no hang -------------------


@pytest.mark.parametrize("command,args,match", [
    ("kvtransfer.benchmarks.plan", ["--tokens", "-5"], "argument --tokens: must be a positive integer, got -5"),
    ("kvtransfer.benchmarks.plan", ["--repeat", "0"], "argument --repeat: must be a positive integer, got 0"),
    ("kvtransfer.benchmarks.plan", ["--pool-tokens", "10", "--tokens", "100"],
     r"--pool-tokens \(10\) must hold the request's --tokens \(100\)"),
    ("kvtransfer.cli_layouts", ["--tp-size", "0"], "argument --tp-size: must be a positive integer, got 0"),
    ("kvtransfer.benchmarks.move_kv", ["--tokens", "-1"], "argument --tokens: must be a positive integer, got -1"),
    ("kvtransfer.benchmarks.transport", ["--total", "0"], "--total must be a positive size, got 0"),
    ("kvtransfer.benchmarks.transport", ["--iters", "0"], "argument --iters: must be a positive integer, got 0"),
    ("kvtransfer.benchmarks.transport", ["--kv", "--cuda", "--two-hosts"],
     r"--two-hosts goes with --kv on host memory \(not --cuda\)"),
    ("kvtransfer.benchmarks.transport", ["--two-hosts"], r"--two-hosts goes with --kv on host memory"),
    ("kvtransfer.benchmarks.transport", ["--fixed-entries", "1,0"], r"--fixed-entries must be counts > 0, got \[1, 0\]"),
])
def test_bad_arguments_are_one_usage_line(command, args, match, capsys):
    import importlib
    import re

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(command).main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert re.search(match, err[-1]) and "Traceback" not in "\n".join(err), err


def _killed(conn, *args):
    """A child that dies before it says anything (spawned by reference from this module)."""
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def test_bench_transport_names_a_receiver_that_dies_before_its_export(monkeypatch, capsys):
    from kvtransfer.benchmarks import transport as bench

    monkeypatch.setattr(bench, "_receiver", _killed)
    monkeypatch.setattr(bench, "READY_TIMEOUT_S", 60.0)
    assert bench.main(["--total", "1M", "--blocks", "256K", "--iters", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "kvtransfer bench transport failed: receiver died before its export (killed by SIGKILL)"


def test_bench_transport_names_a_receiver_that_fails_before_its_export():
    """``UCX_TLS`` without tcp: the receiver's NIXL agent cannot start; the parent says so."""
    env = dict(os.environ, UCX_NET_DEVICES="lo", UCX_TLS="self,sm", NIXL_LOG_LEVEL="WARN")
    out = subprocess.run([sys.executable, "-m", "kvtransfer", "bench", "transport", "--total", "1M", "--blocks",
                          "256K", "--iters", "1"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith("kvtransfer bench transport failed: receiver failed "
                                                          "before its export:"), out.stderr


def test_demo_names_the_rank_that_died(monkeypatch, capsys):
    from kvtransfer import transfer_demo as demo

    spawn = demo.Child.spawn
    monkeypatch.setattr(demo.Child, "spawn", staticmethod(lambda target, args, name: spawn(_killed, args, name)))
    assert demo.main(["--prefill-tp", "1", "--decode-tp", "1", "--layers", "1", "--tokens", "16"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvtransfer transfer-demo failed: decode rank 0 died before its handshake (killed by SIGKILL)"]


@pytest.mark.parametrize("command", ["serve", "router", "demo", "generate"])
def test_help_shows_defaults_and_no_rst_markup(command, capsys):
    import importlib

    modules = {"serve": "kvtransfer.serve.node", "router": "kvtransfer.serve.router"}
    module = modules.get(command, f"kvtransfer.{command}")
    with pytest.raises(SystemExit) as done:
        importlib.import_module(module).main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text and "(default: " in text
    if command == "serve":
        assert re.search(r"--pool-tokens POOL_TOKENS\s+KV pool size in token slots \(default: 65536 on a GPU,\s+8192 on\s+the CPU\)",
                         text)
        assert "--max-tokens" not in text  # the old name of --pool-tokens: accepted, not shown


def test_serve_max_tokens_is_a_deprecated_name_of_pool_tokens(capsys):
    from kvtransfer.serve.node import parser

    args = parser().parse_args(["--role", "decode", "--model", "mla-tiny", "--port", "1", "--max-tokens", "640"])
    assert args.pool_tokens == 640
    assert capsys.readouterr().err == "kvtransfer serve: warning: --max-tokens is deprecated; use --pool-tokens\n"


def test_serve_engine_defaults_follow_the_device_and_yield_to_flags():
    from kvtransfer.serve.node import DEFAULTS, parser, resolve

    base = ["--role", "decode", "--model", "mla-tiny", "--port", "1", "--device", "cpu"]
    cpu = DEFAULTS["cpu"]
    _, _, ec, _ = resolve(parser().parse_args(base))
    assert (ec.max_tokens, ec.max_requests, ec.chunk_size) == (cpu.pool_tokens, cpu.max_running, cpu.chunk_size)
    _, _, ec, _ = resolve(parser().parse_args(base + ["--chunk-size", "64", "--max-running", "3"]))
    assert (ec.max_tokens, ec.max_requests, ec.chunk_size) == (cpu.pool_tokens, 3, 64)


@pytest.mark.parametrize("name, alias", [("smollm2", "smollm2-135m"), ("mla-tiny", "tiny-mla"),
                                         ("hybrid-tiny", "tiny-hybrid")])
def test_one_model_name_set_with_the_old_names_as_aliases(name, alias):
    from kvtransfer.models.config import ModelName

    assert ModelName.parse(name) is ModelName.parse(alias)
    assert ModelName.parse(alias).names == (name, alias)
