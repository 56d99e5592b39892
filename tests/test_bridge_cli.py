"""`edgetp serve` refuses what it cannot do with one clear line, before loading any weights."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from test_cli import assert_clear_error, run


def test_a_taken_port_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = run("serve", "--port", str(port))
    assert_clear_error(result, f"cannot listen on 127.0.0.1:{port}", "pick another --port")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--max-batch", "0"], "--max-batch must be at least 1"),
        (["--api-key", " "], "--api-key is empty"),
        (["--port", "70000"], "--port must be in 0..65535"),
        (["--host", "no-such-host.invalid"], "does not resolve"),
    ],
)
def test_bad_options_are_clear_errors(args, needle):
    assert_clear_error(run("serve", *args), needle)


def test_option_errors_come_before_the_weights_code_is_imported():
    """The checks run before torch and the model code are imported (seconds on a small CPU),
    so a mistyped option or model path is answered at once."""
    code = (
        "import sys\n"
        "from tui.cli import main\n"
        "assert main(['serve', '--port', '70000']) == 1\n"
        "assert main(['serve', '--api-key', ' ']) == 1\n"
        "assert main(['serve', '--model', '/nonexistent.gguf']) == 1\n"
        "assert main(['run', '--model', '/nonexistent.gguf', 'hi']) == 1\n"
        "assert main(['run', ' ']) == 1\n"
        "assert main(['run', '--top-p', '0', 'hi']) == 1\n"
        "import os; os.environ['EDGETP_API_KEY'] = ' '\n"
        "assert main(['serve']) == 1\n"
        "print(sorted({'torch', 'master.session', 'uvicorn'} & set(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=os.environ
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result
    assert result.stderr.count("edgetp: error: ") == 7, result.stderr
    assert "the prompt is empty" in result.stderr and "top_p must be in" in result.stderr
    assert result.stderr.count("--api-key is empty") == 2, result.stderr
    assert result.stderr.count("model not found: /nonexistent.gguf") == 2, result.stderr
