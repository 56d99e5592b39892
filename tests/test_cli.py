"""The `edgetp run` command as a person uses it: a real process, real model, real errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch

from edgetp.models.families import FAMILIES

EDGETP = Path(sys.executable).parent / "edgetp"


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [str(EDGETP)] if EDGETP.exists() else [sys.executable, "-m", "edgetp.tui.cli"]
    return subprocess.run(
        cmd + list(args), capture_output=True, text=True, timeout=180, cwd=cwd, env=os.environ
    )


def assert_clear_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 1, result
    assert result.stdout == ""  # nothing half-written to the output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgetp: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.slow
def test_run_streams_the_greedy_completion(smollm2, smollm2_tokenizer, reference_model):
    prompt = "The capital of France is"
    result = run("run", "--raw", "--max-tokens", "12", prompt)
    assert result.returncode == 0, result.stderr
    ids = smollm2_tokenizer.encode(prompt)
    with torch.inference_mode():
        out = reference_model.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=2
        )
    expected = smollm2_tokenizer.decode(out[0, len(ids) :].tolist())
    assert result.stdout == expected + "\n"


def _shard_dtype_and_bytes(state_dir: Path) -> tuple[str, int]:
    (manifest,) = (state_dir / "shards" / "manifests").glob("*.json")
    shards = (state_dir / "shards").glob("*.safetensors")
    return json.loads(manifest.read_text())["extra"]["dtype"], sum(p.stat().st_size for p in shards)


@pytest.mark.slow  # runs the model end to end, twice
def test_a_gguf_file_keeps_its_own_weights_unless_no_compiler_can_build_their_kernels(
    tmp_path,
):
    """No --dtype: SmolLM2's Q4_1 file runs as the file stores it (`auto`), its shards a fifth
    of float32's 538 MB. On a device with no C compiler for the block kernels it runs as f32
    and says so; the answer is the same (the same weights either way)."""
    args = ("run", "--raw", "--max-tokens", "8", "The capital of France is")
    own = run(*args, "--state-dir", str(tmp_path / "own"))
    assert own.returncode == 0, own.stderr
    dtype, size = _shard_dtype_and_bytes(tmp_path / "own")
    assert dtype == "auto" and size < 0.2 * 538_382_784, (dtype, size)

    bare = tmp_path / "tmp"  # no kernel built before, and no compiler on the PATH to build one
    bare.mkdir()
    env = {**os.environ, "PATH": str(Path(sys.executable).parent), "TMPDIR": str(bare)}
    cmd = [str(EDGETP)] if EDGETP.exists() else [sys.executable, "-m", "edgetp.tui.cli"]
    f32 = subprocess.run(
        [*cmd, *args, "--state-dir", str(tmp_path / "f32")],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert f32.returncode == 0, f32.stderr
    assert "no C compiler" in f32.stderr and "running its weights as f32" in f32.stderr
    assert f32.stdout == own.stdout


def test_missing_model_file(tmp_path):
    assert_clear_error(run("run", "--model", str(tmp_path / "nope.gguf"), "hi"), "not found")


def test_missing_draft_model_file(tmp_path):
    """Before the target's weights load: the one line names the draft."""
    result = run("run", "--draft", str(tmp_path / "draft.gguf"), "hi")
    assert_clear_error(result, "model not found", "draft.gguf")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("hello, I am a text file")
    assert_clear_error(run("run", "--model", str(path), "hi"), "is not a GGUF file")


def test_a_path_that_is_no_model_is_said_before_torch_loads(tmp_path):
    """What `edgetp run` checks before its slow imports (seconds on a small CPU): a file that is
    not a GGUF file, a folder without config.json."""
    (tmp_path / "notes.txt").write_text("hello")
    code = (
        "import sys\n"
        "from edgetp.models.bundled import model_path\n"
        "from edgetp.models.errors import ModelError\n"
        "for path, said in ((sys.argv[1], 'not a GGUF file'), (sys.argv[2], 'no config.json')):\n"
        "    try:\n"
        "        model_path(path)\n"
        "        raise SystemExit(f'{path}: no error')\n"
        "    except ModelError as e:\n"
        "        assert said in str(e), e\n"
        "assert 'torch' not in sys.modules\n"
    )
    args = [sys.executable, "-c", code, str(tmp_path / "notes.txt"), str(tmp_path)]
    subprocess.run(args, check=True, timeout=60)


@pytest.mark.parametrize("size", [3000, 40_000_000])
def test_truncated_gguf(smollm2, tmp_path, size):
    path = tmp_path / "cut.gguf"
    with open(smollm2.path, "rb") as src:
        path.write_bytes(src.read(size))
    assert_clear_error(run("run", "--model", str(path), "hi"), "truncated")


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # the one line names what would work
    supported = [f"{f.name} ({f.gguf} / {f.hf})" for f in FAMILIES]
    assert_clear_error(
        run("run", "--model", str(path), "hi"), "'mamba' is not supported", *supported
    )
    (tmp_path / "config.json").write_text('{"architectures": ["MambaForCausalLM"]}')
    assert_clear_error(
        run("run", "--model", str(tmp_path), "hi"),
        "'MambaForCausalLM' is not supported",
        *supported,
    )


def test_no_think_on_a_model_without_a_thinking_block():
    assert_clear_error(run("run", "--no-think", "hi"), "no thinking block", "enable_thinking")


def test_hf_folder_without_config(tmp_path):
    assert_clear_error(run("run", "--model", str(tmp_path), "hi"), "no config.json")


@pytest.mark.parametrize("prompt", ["", "   \n"])
def test_empty_prompt(tmp_path, prompt):
    assert_clear_error(run("run", prompt, cwd=tmp_path), "prompt is empty")
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_prompt_longer_than_context(tmp_path):
    result = run("run", "--context", "16", "word " * 40, cwd=tmp_path)
    assert_clear_error(result, "context holds 16", "--context")
    assert list(tmp_path.iterdir()) == []


def test_out_of_range_sampling_value():
    assert_clear_error(run("run", "--top-p", "0", "hi"), "top_p")


def test_a_bad_core_count_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("EDGETP_CORES", "two")
    assert_clear_error(run("run", "hi"), "EDGETP_CORES='two' is not a whole number")


@pytest.mark.parametrize(
    "args",
    [["master", "--port", "70000"], ["master", "--port", "-3"], ["serve", "--cluster-port", "x"]],
)
def test_a_port_devices_cannot_join_on_is_refused_by_the_parser(args, capsys):
    """ZeroMQ and the LAN announcement took such a port only to fail with a traceback."""
    from edgetp.tui.arguments import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(args)
    assert exit_.value.code == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"'{args[-1]}' is not a port: give 1..65535, or 0 for any" in said, said


@pytest.mark.parametrize(
    "args",
    [["run", "--threads", "-1", "hi"], ["join", "--threads", "0"], ["serve", "--threads", "-2"]],
)
def test_a_thread_count_under_one_is_refused_before_any_kernel_is_checked(args, capsys):
    """`--threads -1` once reached the kernel check, whose child crashed on it (libgomp asked
    for 928 GB); the crash was kept against the kernel, and every later run on that device
    was refused for want of a working kernel."""
    from edgetp.models.kernels import set_threads
    from edgetp.tui.arguments import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(args)
    assert exit_.value.code == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --threads:" in said and "is not a whole number of at least 1" in said, said
    with pytest.raises(ValueError, match="threads must be at least 1, got -1"):
        set_threads(-1)


@pytest.mark.parametrize("speed", ["0", "-1", "inf", "nan", "fast"])
def test_a_join_speed_that_is_no_speed_is_refused_by_the_parser(speed, capsys):
    """A speed the plan cannot divide work by (Capacity refuses it after the probe it skips)."""
    from edgetp.tui.arguments import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["join", "--speed", speed])
    assert exit_.value.code == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument --speed: '{speed}' is not a speed in GB/s above 0" in said, said
    assert build_parser().parse_args(["join", "--speed", "12.5"]).speed == 12.5


def test_no_local_nodes_is_refused_by_the_parser(capsys):
    """`run --local-nodes 0` ran on one node without a word (`serve` refused it)."""
    from edgetp.tui.arguments import build_parser

    for command in (["run", "hi"], ["serve"], ["kernels"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command[0], "--local-nodes", "0", *command[1:]])
        said = capsys.readouterr().err.strip().splitlines()[-1]
        assert "argument --local-nodes: '0' is not a whole number of at least 1" in said, said


def test_activations_are_a_choice_of_every_command_that_runs_a_model():
    """`--activations int8` on run, serve, chat, master and bench; the chat app hands it to the
    server it starts. (That the master's choice reaches every node: test_int8_activations.)"""
    from edgetp.tui.arguments import build_parser, memory_options
    from edgetp.tui.chat.command import _serve_args

    for command in (["run", "hi"], ["serve"], ["chat"], ["master"], ["bench"]):
        args = build_parser().parse_args([command[0], "--activations", "int8", *command[1:]])
        assert args.activations == "int8", command
        assert memory_options(args).activations == "int8", command
        assert build_parser().parse_args(command).activations == "exact", command
    chat = build_parser().parse_args(["chat", "--activations", "auto"])
    served = _serve_args(chat)
    assert served[served.index("--activations") + 1] == "auto"
    assert "--activations" not in _serve_args(build_parser().parse_args(["chat"]))


@pytest.mark.parametrize(
    ("flag", "field", "default", "values"),
    [("--attention", "attention", "auto", ("split", "master")),
     ("--wire", "wire", "float32", ("float32", "float16"))],
)  # fmt: skip
def test_a_plan_s_choice_is_on_every_command_that_plans_and_bench_alternates_it(
    flag, field, default, values
):
    """`--attention split|master|auto` and `--wire float32|float16` on run, serve, chat and
    master (with their defaults), the chat app handing each to the server it starts; bench
    takes each more than once, one run each; one node has no sums: it runs once."""
    from edgetp.master.bench.cluster import bench_configs
    from edgetp.tui.arguments import build_parser, memory_options
    from edgetp.tui.chat.command import _serve_args

    first, second = values
    for command in (["run", "hi"], ["serve"], ["chat"], ["master"]):
        args = build_parser().parse_args([command[0], flag, second, *command[1:]])
        assert getattr(memory_options(args), field) == second, command
        assert getattr(memory_options(build_parser().parse_args(command)), field) == default
    chat = build_parser().parse_args(["chat", flag, second])
    served = _serve_args(chat)
    assert served[served.index(flag) + 1] == second
    assert flag not in _serve_args(build_parser().parse_args(["chat"]))
    bench = build_parser().parse_args(["bench", flag, first, flag, second])
    assert getattr(bench, field) == [first, second]
    assert getattr(memory_options(bench), field) == default
    runs = bench_configs([1, 4], **{f"{field}s": getattr(bench, field)})
    assert [(c.nodes, getattr(c, field)) for c in runs] == [
        (1, default), (4, first), (4, second)
    ]  # fmt: skip


def test_auto_activations_are_int8_for_4_to_6_bit_blocks_and_exact_otherwise(smollm2):
    """`--activations auto` by the split's matrices: the Q4_1 file and Gemma 3's
    Q4_K_M (Q4_K, Q6_K, Q5_0) in their own blocks take int8; the same weights as f32 or Q8_0
    stay exact; a mode asked for is kept, a mode unknown refused."""
    from edgetp.models.bundled import BUNDLED_MODELS
    from edgetp.models.source import model_activations, open_model

    gemma3 = open_model(BUNDLED_MODELS["gemma3-270m"]())
    assert model_activations(smollm2, "auto", "auto") == "int8"
    assert model_activations(gemma3, "auto", "auto") == "int8"
    assert model_activations(smollm2, "q4_k", "auto") == "int8"
    for dtype in ("f32", "q8_0"):
        assert model_activations(smollm2, dtype, "auto") == "exact", dtype
    assert model_activations(smollm2, "auto", "exact") == "exact"
    assert model_activations(smollm2, "f32", "int8") == "int8"
    with pytest.raises(ValueError, match="choose exact or int8"):
        model_activations(smollm2, "auto", "int4")


def test_the_parser_and_the_chat_app_start_without_torch():
    """`edgetp --help` and the chat app (a bridge client) load in a fraction of torch's time."""
    probe = (
        "import sys, edgetp.tui.cli, edgetp.tui.chat.app, edgetp.tui.chat.command\n"
        "import edgetp.master.bridge.client\n"
        "edgetp.tui.arguments.build_parser().format_help()\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_bench_hands_threads_to_every_node_count(monkeypatch):
    """`edgetp bench --local-nodes ... --threads N` runs every node with N BLAS threads (it was
    once dropped on the way, and each node took its share of the cores)."""
    import edgetp.master.bench.cluster as cluster
    from edgetp.tui.cli import main

    taken: dict[str, object] = {}
    monkeypatch.setattr(cluster, "run_cluster_bench", lambda *a, **_: taken.update(args=a))
    main(["bench", "--local-nodes", "1,2", "--threads", "1", "--tokens", "4"])
    _model, node_counts, *_, threads = taken["args"]
    configs = cluster.bench_configs(node_counts, threads=threads)
    assert [(c.nodes, c.threads, c.label) for c in configs] == [
        (1, 1, "none, 1 thread(s)"),
        (2, 1, "none, 1 thread(s)"),
    ]
    without = cluster.bench_configs(node_counts)
    assert [c.threads for c in without] == [None, None]
    # A node count given twice is timed once a round: each round's ratio pairs one run with one.
    assert [c.nodes for c in cluster.bench_configs([1, 2, 1])] == [1, 2]
