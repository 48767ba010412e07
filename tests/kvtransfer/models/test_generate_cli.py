"""``kvtransfer generate``: text for good input; one line on stderr, exit 2, no traceback, for bad."""

import os
import subprocess
import sys

import pytest



def _generate(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-m", "kvtransfer", "generate", *args], capture_output=True,
                          text=True, timeout=300, env=env)


def test_unknown_model_exits_2_with_one_line():
    out = _generate("--model", "gpt-5", "--prompt", "hi")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == "kvtransfer generate: error: unknown model 'gpt-5'; expected one of smollm2, mla-tiny, hybrid-tiny, smollm2-135m-random, llama3-8b, deepseek-v2-lite-mla\n"


@pytest.mark.parametrize("args, message", [
    (["--model", "mla-tiny", "--tp", "3", "--prompt", "hi"], "TP size 3 does not divide the query heads=8; this model allows TP 1, 2, 4"),
    (["--model", "hybrid-tiny", "--prompt", "x" * 40, "--raw", "--pool-tokens", "32", "--page-size", "4"],
     "prompt of 40 tokens + 64 new tokens = 104 does not fit the pool of 32 token slots"),
    (["--model", "mla-tiny", "--prompt", "hi", "--dtype", "int8"], "unknown dtype 'int8'"),
    (["--model", "mla-tiny", "--prompt", "hi", "--tp", "0"], "TP size must be a positive int, got 0"),
])
def test_bad_input_is_one_line(capsys, args, message):
    """The same main() the command runs, in process (the subprocess path is tested above)."""
    from kvtransfer import generate

    assert generate.main(args) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and message in out.err and "Traceback" not in out.err


def test_smollm2_tp_the_heads_do_not_allow(smollm2_raw):
    """The check generate runs first (in process: the session already opened the file)."""
    from kvtransfer.models import registry
    from kvtransfer.models.config import ModelName

    with pytest.raises(ValueError, match=r"^TP size 2 does not divide the query heads=9; this model allows TP 1, 3$"):
        registry.load_config(ModelName.SMOLLM2).check_tp(2)


def test_tiny_hybrid_generates_with_tp2():
    out = _generate("--model", "hybrid-tiny", "--tp", "2", "--prompt", "hi", "--max-tokens", "4", "--stats")
    assert out.returncode == 0, out.stderr
    assert "decode 3 tokens" in out.stderr and "tp=2" in out.stderr
